//! The HTTP edge: the bearer token on mutations (and reads with `auth_reads`), the loopback
//! rule without a token, open probes, TLS end to end with a certificate made here, the request
//! deadline and the concurrency cap on routes of their own (a slow and a held handler behind
//! the real guards), `/v1/engines` pages, the `[http]` config rules, and a token that never
//! reaches the logs or the config's `Debug`.

use crate::support::{events, unique_id};
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::routing::get;
use http_body_util::BodyExt;
use kvindex::api::{self, AppState, auth::AuthPolicy, limits::Limits};
use kvindex::config::{Config, ConfigError, HttpConfig, Overrides, Secret};
use kvindex::event::{DecodeSettings, PartitionKey, Tier, encode};
use kvindex::index::{Index, IndexSettings};
use kvindex::metrics::Metrics;
use kvindex::service::Service;
use kvindex::source::Message;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tower::ServiceExt;

const TOKEN: &str = "edge-test-token-5f1c9a";
const NOW: i64 = 1_700_000_000_000_000;
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 77));

/// An index of `n` engines (`engine-000`, …, plus ids a URL would mangle: `#`, `/`, `?`).
fn index_of(n: usize) -> (Arc<Index>, Vec<String>) {
    let index = Index::new(IndexSettings { shards: 3, seed: 1 });
    let mut ids: Vec<String> = (0..n).map(|i| format!("engine-{i:03}")).collect();
    ids.extend(["gpu#dp1", "a/b", "q?x=1&y", "ünïcode"].map(String::from));
    for (i, id) in ids.iter().enumerate() {
        let ev = events::stored(id, PartitionKey::new("", "llama", ""))
            .hashes([1000 + i as u64])
            .tokens(1..=4, 4)
            .tier(Tier::Gpu)
            .event();
        index.apply(&ev, NOW).expect("event applies");
    }
    ids.sort();
    (Arc::new(index), ids)
}

fn state(auth: AuthPolicy) -> AppState {
    let (index, _) = index_of(3);
    let mut state = AppState::new(index, Arc::new(Metrics::new()));
    state.auth = auth;
    state.ready.store(true, Ordering::Release);
    state
}

fn token_policy(auth_reads: bool) -> AuthPolicy {
    AuthPolicy::new(Some(&Secret::new(TOKEN)), auth_reads)
}

/// A request as `api::serve` hands it to the router: with the peer address.
fn request(method: &str, path: &str, bearer: Option<&str>, peer: IpAddr) -> Request<Body> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .extension(ConnectInfo(SocketAddr::new(peer, 50_000)));
    if let Some(t) = bearer {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = if method == "POST" {
        Body::from(r#"{"model": "llama", "token_ids": [1, 2, 3, 4], "block_size": 4}"#)
    } else {
        Body::empty()
    };
    req.body(body).unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, HeaderMap, Value) {
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (parts.status, parts.headers, v)
}

async fn status_of(app: &Router, req: Request<Body>) -> StatusCode {
    send(app, req).await.0
}

/// A JSON error body (`{"error": "..."}`, nothing else), as `src/api/error.rs` makes them.
fn assert_error_body(v: &Value) -> &str {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(obj.len(), 1, "{v}");
    obj["error"].as_str().expect("error is a string")
}

const READS: [(&str, &str); 4] = [
    ("POST", "/v1/lookup"),
    ("GET", "/v1/engines"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
];
const PROBES: [&str; 2] = ["/healthz", "/readyz"];

#[tokio::test]
async fn a_token_guards_mutations_from_every_peer() {
    let app = api::router(state(token_policy(false)));
    for peer in [LOOPBACK, REMOTE] {
        let (status, headers, v) = send(&app, request("DELETE", "/v1/engines/x", None, peer)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{peer}: {v}");
        assert_eq!(
            headers[header::WWW_AUTHENTICATE],
            r#"Bearer realm="kvindex""#
        );
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert!(assert_error_body(&v).contains("bearer token"), "{v}");

        let longer = format!("{TOKEN}x");
        for wrong in ["nope", &TOKEN[..TOKEN.len() - 1], longer.as_str(), ""] {
            let (status, headers, v) =
                send(&app, request("DELETE", "/v1/engines/x", Some(wrong), peer)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{wrong:?}: {v}");
            assert_eq!(
                headers[header::WWW_AUTHENTICATE],
                r#"Bearer realm="kvindex", error="invalid_token""#
            );
            assert_error_body(&v);
        }
        // The right token reaches the handler (this state has no index to change: its 503).
        let (status, _, v) =
            send(&app, request("DELETE", "/v1/engines/x", Some(TOKEN), peer)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert_eq!(assert_error_body(&v), "this server has no index to change");
    }
}

#[tokio::test]
async fn reads_are_open_unless_auth_reads_and_probes_always() {
    let open = api::router(state(token_policy(false)));
    let guarded = api::router(state(token_policy(true)));
    for (method, path) in READS {
        assert_eq!(
            status_of(&open, request(method, path, None, REMOTE)).await,
            StatusCode::OK,
            "{method} {path} without auth_reads"
        );
        let (status, headers, v) = send(&guarded, request(method, path, None, LOOPBACK)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {v}");
        assert_eq!(
            headers[header::WWW_AUTHENTICATE],
            r#"Bearer realm="kvindex""#
        );
        assert_error_body(&v);
        assert_eq!(
            status_of(&guarded, request(method, path, Some("wrong"), LOOPBACK)).await,
            StatusCode::UNAUTHORIZED,
            "{method} {path} with a wrong token"
        );
        assert_eq!(
            status_of(&guarded, request(method, path, Some(TOKEN), REMOTE)).await,
            StatusCode::OK,
            "{method} {path} with the token"
        );
    }
    for path in PROBES {
        for app in [&open, &guarded] {
            assert_eq!(
                status_of(app, request("GET", path, None, REMOTE)).await,
                StatusCode::OK,
                "{path}"
            );
        }
    }
}

#[tokio::test]
async fn without_a_token_mutations_are_for_loopback_only() {
    let app = api::router(state(AuthPolicy::default()));
    let (status, _, v) = send(&app, request("DELETE", "/v1/engines/x", None, REMOTE)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    let msg = assert_error_body(&v);
    assert!(
        msg.contains("http.auth_token_file") && msg.contains("KVINDEX_HTTP__AUTH_TOKEN"),
        "{msg}"
    );
    // A presented token changes nothing: there is none to check it against.
    assert_eq!(
        status_of(
            &app,
            request("DELETE", "/v1/engines/x", Some(TOKEN), REMOTE)
        )
        .await,
        StatusCode::FORBIDDEN
    );
    // Loopback (v4, v6, v4-mapped v6) reaches the handler.
    for peer in [
        LOOPBACK,
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        IpAddr::from(Ipv4Addr::LOCALHOST.to_ipv6_mapped()),
    ] {
        assert_eq!(
            status_of(&app, request("DELETE", "/v1/engines/x", None, peer)).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "{peer}"
        );
    }
    // A request without a peer address (not served by `api::serve`) counts as remote.
    let bare = Request::delete("/v1/engines/x")
        .body(Body::empty())
        .unwrap();
    assert_eq!(status_of(&app, bare).await, StatusCode::FORBIDDEN);
    // Reads stay open from anywhere.
    for (method, path) in READS {
        assert_eq!(
            status_of(&app, request(method, path, None, REMOTE)).await,
            StatusCode::OK
        );
    }
}

// ---- Over real sockets ----

/// One HTTP/1.1 exchange (`Connection: close`) on `stream`: status, head, JSON body.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    method: &str,
    path: &str,
    bearer: Option<&str>,
) -> (u16, String, Value) {
    let auth = bearer.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    // A peer that closes without TLS close_notify ends in an error after the whole response.
    if let Err(e) = stream.read_to_end(&mut response).await {
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    }
    let response = String::from_utf8(response).unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head: {response:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head}"));
    let body = serde_json::from_str(body).unwrap_or(Value::String(body.to_string()));
    (status, head.to_string(), body)
}

/// This machine's address on its default route, if it has one that is not loopback (the
/// route is looked up for a UDP socket; nothing is sent).
fn non_loopback_ip() -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    socket.connect("192.0.2.1:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

async fn serve_plain(
    state: AppState,
    bind: &str,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(api::serve(listener, state, async {
        let _ = stopped.await;
    }));
    (addr, stop)
}

#[tokio::test]
async fn the_server_sees_the_peer_address() {
    let (addr, _stop) = serve_plain(state(AuthPolicy::default()), "0.0.0.0:0").await;
    let port = addr.port();
    let local = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (status, _, v) = exchange(local, "DELETE", "/v1/engines/x", None).await;
    assert_eq!(status, 503, "loopback reaches the handler: {v}");
    let Some(ip) = non_loopback_ip() else {
        eprintln!("no non-loopback address here: the 403 path is covered by the router tests");
        return;
    };
    let remote = tokio::net::TcpStream::connect((ip, port)).await.unwrap();
    let (status, _, v) = exchange(remote, "DELETE", "/v1/engines/x", None).await;
    assert_eq!(status, 403, "from {ip}: {v}");
    assert_error_body(&v);
    let remote = tokio::net::TcpStream::connect((ip, port)).await.unwrap();
    let (status, _, _) = exchange(remote, "GET", "/v1/engines", None).await;
    assert_eq!(status, 200, "reads stay open from {ip}");
}

#[tokio::test]
async fn tls_round_trip_with_a_certificate_made_here() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let http = HttpConfig {
        tls_cert: cert_path.clone(),
        tls_key: key_path.clone(),
        ..HttpConfig::default()
    };
    let config = api::tls::server_config(&http)
        .expect("the certificate loads")
        .expect("TLS is configured");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(api::serve_tls(
        listener,
        config,
        state(token_policy(true)),
        async {
            let _ = stopped.await;
        },
    ));

    // A client that trusts that certificate alone.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        connector.connect(name, tcp).await.expect("TLS handshake")
    };
    let (status, _, v) = exchange(connect().await, "GET", "/healthz", None).await;
    assert_eq!((status, v), (200, json!({"status": "ok"})));
    let (status, head, _) = exchange(connect().await, "GET", "/v1/stats", None).await;
    assert_eq!(status, 401, "auth_reads holds over TLS too");
    assert!(head.contains(r#"Bearer realm="kvindex""#), "{head}");
    let (status, _, v) = exchange(connect().await, "GET", "/v1/engines", Some(TOKEN)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["engines"].as_array().unwrap().len(), 7, "{v}");

    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), plain.read_to_end(&mut answer)).await;
    assert!(
        !answer.starts_with(b"HTTP/1.1 200"),
        "plain HTTP was served"
    );

    // A client that does not trust the certificate fails the handshake.
    let untrusting = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    assert!(
        tokio_rustls::TlsConnector::from(Arc::new(untrusting))
            .connect(name, tcp)
            .await
            .is_err()
    );

    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the TLS server stops on shutdown")
        .unwrap()
        .unwrap();

    // Bad files are config errors naming the key at fault.
    let missing_key = HttpConfig {
        tls_key: dir.path().join("absent.pem"),
        ..http.clone()
    };
    let e = api::tls::server_config(&missing_key).unwrap_err();
    assert_eq!(e.field(), Some("http.tls_key"), "{e}");
    let key_as_cert = HttpConfig {
        tls_cert: key_path,
        ..http
    };
    let e = api::tls::server_config(&key_as_cert).unwrap_err();
    assert_eq!(e.field(), Some("http.tls_cert"), "{e}");
}

// ---- Deadline and concurrency cap ----

fn limited(limits: Limits, extra: Router<Arc<AppState>>) -> Router {
    let mut s = state(AuthPolicy::default());
    s.limits = limits;
    api::router_with_reads(s, extra)
}

#[tokio::test]
async fn a_request_past_its_deadline_answers_503() {
    let app = limited(
        Limits {
            request_timeout: Duration::from_millis(200),
            ..Limits::default()
        },
        Router::new()
            .route(
                "/test/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    "late"
                }),
            )
            .route("/test/quick", get(|| async { "quick" })),
    );
    let start = Instant::now();
    let (status, headers, v) = send(&app, request("GET", "/test/slow", None, LOOPBACK)).await;
    let took = start.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(
        assert_error_body(&v),
        "the request did not complete within 200 ms"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(
        send(&app, request("GET", "/test/quick", None, LOOPBACK))
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        status_of(&app, request("GET", "/v1/stats", None, LOOPBACK)).await,
        StatusCode::OK
    );
}

#[tokio::test]
async fn over_the_cap_a_request_is_shed_at_once_and_probes_still_answer() {
    let entered = Arc::new(AtomicUsize::new(0));
    // No permits until the test releases the held requests.
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let hold = {
        let (entered, release) = (entered.clone(), release.clone());
        move || {
            let (entered, release) = (entered.clone(), release.clone());
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                let _permit = release.acquire().await;
                "held"
            }
        }
    };
    let app = limited(
        Limits {
            max_concurrent_requests: 2,
            ..Limits::default()
        },
        Router::new().route("/test/hold", get(hold)),
    );
    let held: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(
                async move { send(&app, request("GET", "/test/hold", None, LOOPBACK)).await },
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while entered.load(Ordering::SeqCst) < 2 {
        assert!(Instant::now() < deadline, "the held requests never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    for (method, path) in [
        ("GET", "/test/hold"),
        ("GET", "/v1/engines"),
        ("POST", "/v1/lookup"),
    ] {
        let start = Instant::now();
        let (status, headers, v) = tokio::time::timeout(
            Duration::from_secs(2),
            send(&app, request(method, path, None, LOOPBACK)),
        )
        .await
        .unwrap_or_else(|_| panic!("{method} {path} waited instead of being shed"));
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{method} {path}: {v}"
        );
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert!(assert_error_body(&v).contains("limit 2"), "{v}");
        assert!(start.elapsed() < Duration::from_secs(1), "shed, not queued");
    }
    for path in PROBES {
        assert_eq!(
            status_of(&app, request("GET", path, None, LOOPBACK)).await,
            StatusCode::OK,
            "{path} is exempt from the cap"
        );
    }
    assert_eq!(
        entered.load(Ordering::SeqCst),
        2,
        "the shed request never ran"
    );

    release.add_permits(2);
    for h in held {
        assert_eq!(h.await.unwrap().0, StatusCode::OK);
    }
    // The permits came back.
    assert_eq!(
        status_of(&app, request("GET", "/v1/engines", None, LOOPBACK)).await,
        StatusCode::OK
    );
}

// ---- Pages ----

#[tokio::test]
async fn engine_pages_cover_every_engine_once() {
    let (index, ids) = index_of(23);
    let mut s = AppState::new(index, Arc::new(Metrics::new()));
    s.max_page_size = 5;
    let app = api::router(s);
    let get = |path: String| {
        let app = app.clone();
        async move { send(&app, request("GET", &path, None, LOOPBACK)).await }
    };

    for (limit, page_size) in [(None, 5), (Some(4), 4), (Some(1), 1), (Some(1000), 5)] {
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        let mut pages = 0;
        loop {
            let mut path = "/v1/engines?".to_string();
            if let Some(l) = limit {
                path += &format!("limit={l}&");
            }
            if let Some(c) = &cursor {
                path += &format!("cursor={c}");
            }
            let (status, _, v) = get(path.clone()).await;
            assert_eq!(status, StatusCode::OK, "{path}: {v}");
            let page = v["engines"].as_array().unwrap();
            assert!(page.len() <= page_size, "{path}: {} engines", page.len());
            for e in page {
                // Every field of an engine is still there.
                for field in [
                    "engine_id",
                    "blocks",
                    "blocks_by_tier",
                    "partitions",
                    "adapters",
                    "last_seen_us",
                    "seq_regressions",
                ] {
                    assert!(e.get(field).is_some(), "{field} missing: {e}");
                }
                seen.push(e["engine_id"].as_str().unwrap().to_string());
            }
            pages += 1;
            match &v["next"] {
                Value::Null => break,
                Value::String(next) => {
                    assert_eq!(page.len(), page_size, "only the last page is short");
                    cursor = Some(next.clone());
                }
                other => panic!("next: {other}"),
            }
            assert!(pages <= ids.len(), "the walk does not end");
        }
        let distinct: BTreeSet<_> = seen.iter().collect();
        assert_eq!(
            distinct.len(),
            seen.len(),
            "an engine served twice: {seen:?}"
        );
        assert_eq!(seen, ids, "limit {limit:?}: every engine, in order");
        assert_eq!(pages, ids.len().div_ceil(page_size));
    }

    // Bad parameters are JSON 400s naming the parameter.
    for (query, field) in [
        ("limit=0", "limit: "),
        ("limit=-3", "limit: "),
        ("limit=ten", "limit: "),
        ("cursor=not-hex", "cursor: "),
        ("cursor=abc", "cursor: "),
    ] {
        let (status, _, v) = get(format!("/v1/engines?{query}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {v}");
        assert!(assert_error_body(&v).starts_with(field), "{query}: {v}");
    }
    // Any hex is a position in the order of the ids, even bytes no id holds: `ff` sorts after
    // every UTF-8 id, so its page is empty and last.
    let (status, _, v) = get("/v1/engines?cursor=ff".to_string()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v, serde_json::json!({"engines": [], "next": null}));
}

// ---- The real durable service ----

#[tokio::test]
async fn the_token_lets_an_operator_clear_an_engine() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config {
        data_dir: dir.path().to_path_buf(),
        ..Config::default()
    };
    config.index.shards = 2;
    config.http.auth_token = Secret::new(TOKEN);
    let service = Service::open(config, None).expect("open the service");
    let ev = events::stored("doomed", PartitionKey::new("t", "m", ""))
        .hashes([7])
        .tokens(1..=4, 4)
        .event();
    let msg = Message {
        partition: 0,
        offset: 0,
        engine: Some("doomed".into()),
        payload: encode::to_proto(&[ev]),
        ..Message::default()
    };
    let applied = service
        .pipeline
        .ingest_batch("test", &[msg], &DecodeSettings::default())
        .expect("the store takes the batch");
    assert_eq!(applied.events, 1);
    let app = api::router(AppState::over(&service, None).expect("the token is configured"));

    let (status, _, v) = send(
        &app,
        request("DELETE", "/v1/engines/doomed", None, LOOPBACK),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "loopback needs the token too: {v}"
    );
    let (status, _, v) = send(
        &app,
        request("DELETE", "/v1/engines/doomed", Some(TOKEN), REMOTE),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v, json!({"engine_id": "doomed", "memberships_removed": 1}));
    let (status, _, v) = send(&app, request("GET", "/v1/engines", None, REMOTE)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["next"], Value::Null);
    assert!(
        v["engines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["engine_id"] != "doomed" || e["blocks"] == 0),
        "{v}"
    );
}

// ---- Configuration ----

fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let path = crate::support::write_config(dir.path(), text);
    let env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect::<Vec<_>>();
    Config::load(
        Some(std::path::Path::new(&path)),
        env,
        &Overrides::default(),
    )
}

#[test]
fn http_config_rules_name_their_field() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\r\n")).unwrap();
    let file_line = format!(
        "[http]\nauth_token_file = {:?}\n",
        token_file.display().to_string()
    );

    // The file's token, its line break dropped; or the environment's.
    let c = load(&file_line, &[]).unwrap();
    assert_eq!(c.http.bearer_token().unwrap().unwrap().expose(), TOKEN);
    let c = load("", &[("KVINDEX_HTTP__AUTH_TOKEN", TOKEN)]).unwrap();
    assert_eq!(c.http.bearer_token().unwrap().unwrap().expose(), TOKEN);
    assert_eq!(load("", &[]).unwrap().http.bearer_token().unwrap(), None);

    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    // (config file, environment, the field its error must name)
    type Case<'a> = (String, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            file_line.clone(),
            vec![("KVINDEX_HTTP__AUTH_TOKEN", TOKEN)],
            "http.auth_token_file",
        ),
        (
            format!("[http]\nauth_token = \"{TOKEN}\"\n"),
            vec![],
            "http.auth_token",
        ),
        (
            format!(
                "[http]\nauth_token_file = {:?}\n",
                dir.path().join("absent").display().to_string()
            ),
            vec![],
            "http.auth_token_file",
        ),
        (
            format!(
                "[http]\nauth_token_file = {:?}\n",
                empty.display().to_string()
            ),
            vec![],
            "http.auth_token_file",
        ),
        (
            "".into(),
            vec![("KVINDEX_HTTP__AUTH_TOKEN", "two words")],
            "http.auth_token",
        ),
        (
            "[http]\nauth_reads = true\n".into(),
            vec![],
            "http.auth_reads",
        ),
        (
            "[http]\ntls_cert = \"c.pem\"\n".into(),
            vec![],
            "http.tls_key",
        ),
        (
            "[http]\ntls_key = \"k.pem\"\n".into(),
            vec![],
            "http.tls_cert",
        ),
        (
            "[http]\nrequest_timeout_ms = 0\n".into(),
            vec![],
            "http.request_timeout_ms",
        ),
        (
            "[http]\nmax_concurrent_requests = 0\n".into(),
            vec![],
            "http.max_concurrent_requests",
        ),
        (
            "[http]\nmax_page_size = 0\n".into(),
            vec![],
            "http.max_page_size",
        ),
    ];
    for (text, env, field) in cases {
        let e = load(&text, &env).expect_err(&text);
        assert_eq!(e.field(), Some(field), "{text} {env:?}: {e}");
        assert!(
            !e.to_string().contains(TOKEN),
            "the error quotes the token: {e}"
        );
    }
    let c = load(
        &format!("{file_line}auth_reads = true\nrequest_timeout_ms = 5\nmax_page_size = 7\n"),
        &[],
    )
    .unwrap();
    assert!(c.http.auth_reads);
    assert_eq!(c.http.request_timeout(), Duration::from_millis(5));
    assert_eq!(c.http.max_page_size, 7);
}

#[test]
fn the_token_never_shows_in_the_config() {
    let c = load("", &[("KVINDEX_HTTP__AUTH_TOKEN", TOKEN)]).unwrap();
    for shown in [
        format!("{c:?}"),
        format!("{c:#?}"),
        format!("{:?}", c.http),
        toml::to_string(&c).unwrap(),
        serde_json::to_string(&c).unwrap(),
        format!("{:?}", AuthPolicy::from_config(&c.http).unwrap()),
    ] {
        assert!(!shown.contains(TOKEN), "{shown}");
    }
    assert!(format!("{:?}", c.http).contains("<redacted>"));
}

/// The real binary with the token in its environment and debug logging: requests with a
/// wrong and the right token go through, and the token appears nowhere in what it wrote.
#[test]
fn the_binary_never_logs_the_token() {
    use kvindex::bench::harness::Spawned;
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("stderr.log");
    let token = format!("tok-{}", unique_id("never-logged"));
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"));
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .env("KVINDEX_LOG", "debug")
        .env("KVINDEX_HTTP__AUTH_TOKEN", &token)
        .env("KVINDEX_HTTP__AUTH_READS", "true")
        .stderr(std::fs::File::create(&log_path).unwrap());
    let process = Spawned::start(cmd, Duration::from_secs(120)).expect("kvindex serve starts");
    let call = |method: &str, path: &str, bearer: &str| -> u16 {
        let mut tcp = std::net::TcpStream::connect(process.http).unwrap();
        write!(
            tcp,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bearer}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        tcp.read_to_string(&mut out).unwrap();
        out.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    // The first refusal is the one logged (they are rate-limited): make it one whose header
    // holds the token, so a log of the header would show it.
    assert_eq!(
        call("DELETE", "/v1/engines/nobody", &format!("{token}0")),
        401
    );
    assert_eq!(call("GET", "/v1/stats", "wrong"), 401);
    assert_eq!(call("GET", "/v1/stats", &token), 200);
    assert_eq!(call("DELETE", "/v1/engines/nobody", &token), 404);
    let status = process
        .terminate(Duration::from_secs(30))
        .expect("kvindex stops");
    assert!(status.success());
    let mut log = String::new();
    std::fs::File::open(&log_path)
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(
        log.contains("request refused"),
        "debug logging was on: {log}"
    );
    assert!(!log.contains(&token), "the token is in the log");
}
