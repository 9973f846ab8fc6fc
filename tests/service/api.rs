//! The HTTP read API end to end: lookup answers on a hand-built index, request validation,
//! the JSON error contract, `/metrics` format, conformance of every route and body with
//! `schemas/openapi.yaml`, and one real server over TCP.

use crate::support::events;
use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode, header};
use http_body_util::BodyExt;
use kvindex::api::{self, AppState, ROUTES};
use kvindex::event::{Event, PartitionKey, Tier};
use kvindex::index::{Index, IndexSettings};
use kvindex::ingest::SourceStatus;
use kvindex::metrics::Metrics;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tower::ServiceExt;

const NOW: i64 = 1_700_000_000_000_000;
const HASH_32: [u8; 32] = [7; 32];

fn tokens(n: u32) -> Vec<u32> {
    (1..=n).collect()
}

/// A root chain of `blocks` blocks of 4 tokens (`1, 2, 3, ...`) stored by `engine`.
fn stored_tokens(engine: &str, p: PartitionKey, blocks: u32, tier: Tier) -> Event {
    stored_tokens_bs(engine, p, blocks, 4, tier)
}

fn stored_tokens_bs(engine: &str, p: PartitionKey, blocks: u32, bs: u32, tier: Tier) -> Event {
    events::stored(engine, p)
        .hashes((0..blocks).map(|i| 1000 + u64::from(i)))
        .tokens(tokens(blocks * bs), bs)
        .tier(tier)
        .event()
}

fn stored_hashes(engine: &str, p: PartitionKey) -> Event {
    events::stored(engine, p)
        .hash_bytes(&[
            &[0, 0, 0, 0, 0, 0, 0, 0xff],
            &0xdead_beefu64.to_be_bytes(),
            &HASH_32,
        ])
        .event()
}

fn llama(adapter: &str) -> PartitionKey {
    PartitionKey::new("", "llama", adapter)
}

/// The fixture index (see the module docs of each case below for what each engine is for).
fn fixture() -> (AppState, Arc<AtomicBool>) {
    let index = Index::new(IndexSettings { shards: 2, seed: 1 });
    let events = [
        // Base-model chains: prefixes of 3, 2, 2 and 1 blocks, on different tiers.
        stored_tokens("engine-a", llama(""), 3, Tier::Gpu),
        stored_tokens("engine-0", llama(""), 2, Tier::Gpu),
        stored_tokens("engine-b", llama(""), 2, Tier::Cpu),
        stored_tokens("engine-c", llama(""), 1, Tier::Disk),
        // LoRA adapter "x": the same tokens, another partition.
        stored_tokens("engine-a", llama("x"), 2, Tier::Gpu),
        stored_tokens("lora-only", llama("x"), 1, Tier::Cpu),
        // Another tenant.
        stored_tokens(
            "engine-t",
            PartitionKey::new("acme", "llama", ""),
            3,
            Tier::Gpu,
        ),
        // Hash-only producers: one in a model with a learned block size, one without.
        stored_hashes("hash-engine", llama("")),
        stored_hashes("hash-engine", PartitionKey::new("", "opaque", "")),
        // A model whose events use block size 8.
        stored_tokens_bs(
            "engine-m8",
            PartitionKey::new("", "m8", ""),
            2,
            8,
            Tier::Gpu,
        ),
    ];
    for ev in &events {
        index.learn_block_size(ev);
        index.apply(ev, NOW).expect("fixture event applies");
    }
    let ready = Arc::new(AtomicBool::new(false));
    let mut state = AppState::new(Arc::new(index), Arc::new(Metrics::new()));
    state.ready = ready.clone();
    state.max_body_bytes = 4096;
    state.sources = Some(Arc::new(SourceStatus {
        kind: "kafka".into(),
        name: "kafka:kv-events".into(),
        lag: 12,
        ..SourceStatus::default()
    }));
    (state, ready)
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
) -> (StatusCode, HeaderMap, Vec<u8>) {
    // As `api::serve` would: the peer address, on loopback (what a test client is).
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .extension(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40_000))));
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req.body(body.map_or_else(Body::empty, Body::from)).unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

/// Calls a JSON route; asserts the response is JSON and returns it parsed.
async fn call_json(
    app: &Router,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (StatusCode, Value) {
    let (status, headers, bytes) =
        call(app, method, path, body.map(|b| b.as_bytes().to_vec())).await;
    assert_eq!(
        headers.get(header::CONTENT_TYPE).unwrap(),
        "application/json",
        "{method} {path}"
    );
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "{method} {path}: not JSON ({e}): {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    (status, v)
}

async fn lookup(app: &Router, body: Value) -> Value {
    let (status, v) = call_json(app, "POST", "/v1/lookup", Some(&body.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body} -> {v}");
    v
}

/// `[(engine_id, matched_blocks, matched_tokens, tier)]` of a lookup answer.
fn rows(v: &Value) -> Vec<(String, u64, Value, String)> {
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["engine_id"].as_str().unwrap().to_string(),
                r["matched_blocks"].as_u64().unwrap(),
                r["matched_tokens"].clone(),
                r["tier"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn row(id: &str, blocks: u64, tokens: Value, tier: &str) -> (String, u64, Value, String) {
    (id.to_string(), blocks, tokens, tier.to_string())
}

#[tokio::test]
async fn lookups_report_blocks_per_tier_and_rank_by_tier_weights_when_asked() {
    let (state, _) = fixture();
    let app = api::router(state.clone());
    let v = lookup(&app, json!({"model": "llama", "token_ids": tokens(13)})).await;
    let by_tier = |v: &Value| -> Vec<(String, Value, Option<f64>)> {
        v["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let id = r["engine_id"].as_str().unwrap().to_string();
                (
                    id,
                    r["blocks_by_tier"].clone(),
                    r.get("score").map(|s| s.as_f64().unwrap()),
                )
            })
            .collect()
    };
    let counts = |g: u32, c: u32, d: u32| json!({"GPU": g, "CPU": c, "DISK": d});
    assert_eq!(
        by_tier(&v),
        [
            ("engine-a".into(), counts(3, 0, 0), None),
            ("engine-0".into(), counts(2, 0, 0), None),
            ("engine-b".into(), counts(0, 2, 0), None),
            ("engine-c".into(), counts(0, 0, 1), None),
        ]
    );
    // CPU blocks worth 2, GPU 1, disk left out (1): engine-b's 2 CPU blocks rank first.
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": tokens(13), "tier_weights": {"cpu": 2.0, "GPU": 1}}),
    )
    .await;
    assert_eq!(
        by_tier(&v),
        [
            ("engine-b".into(), counts(0, 2, 0), Some(4.0)),
            ("engine-a".into(), counts(3, 0, 0), Some(3.0)),
            ("engine-0".into(), counts(2, 0, 0), Some(2.0)),
            ("engine-c".into(), counts(0, 0, 1), Some(1.0)),
        ]
    );
    for (weights, names) in [
        (json!({"HBM": 1.0}), "`HBM` is not a tier"),
        (json!({"GPU": -1.0}), "`GPU` is not"),
        (json!({"GPU": "high"}), "`GPU` is not"),
        (json!([1.0, 0.8]), "tier_weights: expected an object"),
    ] {
        let body = json!({"model": "llama", "token_ids": tokens(13), "tier_weights": weights});
        let (status, v) = call_json(&app, "POST", "/v1/lookup", Some(&body.to_string())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let error = v["error"].as_str().unwrap();
        assert!(error.contains(names), "{body}: {error}");
    }
}

#[tokio::test]
async fn token_lookup_ranks_engines_by_prefix() {
    let (state, _) = fixture();
    let app = api::router(state.clone());
    let v = lookup(&app, json!({"model": "llama", "token_ids": tokens(13)})).await;
    assert_eq!(v["model"], "llama");
    assert_eq!(v["tenant"], "");
    assert_eq!(v["adapter"], "");
    assert_eq!(v["query_blocks"], 3, "the partial 4th block is not keyed");
    assert_eq!(v["block_size"], 4, "learned from llama's events");
    assert_eq!(
        rows(&v),
        [
            row("engine-a", 3, json!(12), "GPU"),
            row("engine-0", 2, json!(8), "GPU"),
            row("engine-b", 2, json!(8), "CPU"),
            row("engine-c", 1, json!(4), "DISK"),
        ]
    );

    // `limit`: only the best engines, in the same order.
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": tokens(13), "limit": 2}),
    )
    .await;
    assert_eq!(
        rows(&v),
        [
            row("engine-a", 3, json!(12), "GPU"),
            row("engine-0", 2, json!(8), "GPU"),
        ]
    );
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": tokens(13), "limit": 99}),
    )
    .await;
    assert_eq!(rows(&v).len(), 4, "a limit above the answer caps nothing");

    // Diverging after the first block: everyone holding block 0 matches 1.
    let mut diverging = tokens(12);
    diverging[5] = 99;
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": diverging, "tenant": ""}),
    )
    .await;
    let ids: Vec<_> = rows(&v).into_iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        ids,
        [
            ("engine-0".into(), 1),
            ("engine-a".into(), 1),
            ("engine-b".into(), 1),
            ("engine-c".into(), 1)
        ]
    );

    // An explicit block size overrides the learned one (and here keys nothing stored).
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": tokens(12), "block_size": 2}),
    )
    .await;
    assert_eq!(
        (v["query_blocks"].clone(), v["block_size"].clone()),
        (json!(6), json!(2))
    );
    assert_eq!(v["engines"], json!([]));

    // Empty query.
    let v = lookup(&app, json!({"model": "llama", "token_ids": []})).await;
    assert_eq!(
        (v["query_blocks"].clone(), v["engines"].clone()),
        (json!(0), json!([]))
    );

    // Unknown fields are ignored.
    let v = lookup(
        &app,
        json!({"model": "llama", "token_ids": tokens(4), "future": {"x": [1]}}),
    )
    .await;
    assert_eq!(rows(&v).len(), 4);

    assert_eq!(state.metrics.lookups.load(Ordering::Relaxed), 7);
}

#[tokio::test]
async fn partitions_are_isolated() {
    let (state, _) = fixture();
    let app = api::router(state);
    let v = lookup(
        &app,
        json!({"model": "llama", "adapter": "x", "token_ids": tokens(8)}),
    )
    .await;
    assert_eq!(v["adapter"], "x");
    assert_eq!(
        rows(&v),
        [
            row("engine-a", 2, json!(8), "GPU"),
            row("lora-only", 1, json!(4), "CPU")
        ]
    );

    // The base model never sees the adapter's blocks (fixture check above: no lora-only), and
    // another adapter sees neither.
    let v = lookup(&app, json!({"model": "llama", "token_ids": tokens(8)})).await;
    assert!(
        rows(&v)
            .iter()
            .all(|r| r.0 != "lora-only" && r.0 != "engine-t"),
        "{v}"
    );
    let v = lookup(
        &app,
        json!({"model": "llama", "adapter": "y", "token_ids": tokens(8)}),
    )
    .await;
    assert_eq!(v["engines"], json!([]));

    let v = lookup(
        &app,
        json!({"model": "llama", "tenant": "acme", "token_ids": tokens(12), "block_size": 4}),
    )
    .await;
    assert_eq!(rows(&v), [row("engine-t", 3, json!(12), "GPU")]);
    let v = lookup(
        &app,
        json!({"model": "llama", "tenant": "other", "token_ids": tokens(12), "block_size": 4}),
    )
    .await;
    assert_eq!(v["engines"], json!([]));
}

/// Blocks stored with extra keys (a salt, an image) match only lookups that name the same.
#[tokio::test]
async fn salted_and_multimodal_blocks_match_only_the_same_salt_and_images() {
    use kvindex::event::{BlockExtras, MmKey};
    let (state, _) = fixture();
    let mut ev = stored_tokens(
        "engine-mm",
        PartitionKey::new("", "llava", ""),
        3,
        Tier::Gpu,
    );
    ev.block_extras = vec![
        BlockExtras {
            cache_salt: "s1".into(),
            ..BlockExtras::default()
        },
        BlockExtras {
            mm: vec![MmKey {
                hash: "cat".into(),
                offset: 2,
            }],
            ..BlockExtras::default()
        },
        BlockExtras {
            mm: vec![MmKey {
                hash: "cat".into(),
                offset: -2,
            }],
            ..BlockExtras::default()
        },
    ];
    state.index.learn_block_size(&ev);
    state.index.apply(&ev, NOW).unwrap();
    let app = api::router(state);
    let cat = json!([{"hash": "cat", "offset": 6, "length": 4}]);
    let dog = json!([{"hash": "dog", "offset": 6, "length": 4}]);
    for (salt, images, want) in [
        (json!("s1"), cat.clone(), 3),
        (json!("s1"), dog, 1),
        (json!("s1"), json!(null), 1),
        (json!("s2"), cat.clone(), 0),
        (json!(null), cat, 0),
    ] {
        let v = lookup(
            &app,
            json!({"model": "llava", "token_ids": tokens(12), "cache_salt": salt, "mm_inputs": images}),
        )
        .await;
        let got = rows(&v).first().map_or(0, |r| r.1);
        assert_eq!(got, want, "salt {salt}, images {images}: {v}");
    }
}

#[tokio::test]
async fn block_size_is_learned_per_model_else_a_400() {
    let (state, _) = fixture();
    let app = api::router(state);
    let v = lookup(&app, json!({"model": "m8", "token_ids": tokens(20)})).await;
    assert_eq!(
        (v["block_size"].clone(), v["query_blocks"].clone()),
        (json!(8), json!(2))
    );
    assert_eq!(rows(&v), [row("engine-m8", 2, json!(16), "GPU")]);
    // No event told this model's block size: a 400 that says so, never an empty answer
    // keyed with a guess.
    let body = json!({"model": "nobody", "token_ids": tokens(40)}).to_string();
    let (status, v) = call_json(&app, "POST", "/v1/lookup", Some(&body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("block_size: unknown for model `nobody`"),
        "{v}"
    );
    // Unless the operator configured a default.
    let (mut state, _) = fixture();
    state.default_block_size = 16;
    let app = api::router(state);
    let v = lookup(&app, json!({"model": "nobody", "token_ids": tokens(40)})).await;
    assert_eq!(
        (v["block_size"].clone(), v["query_blocks"].clone()),
        (json!(16), json!(2))
    );
}

/// A batch answers each query exactly as `/v1/lookup` answers it alone, in order; a query
/// invalid on its own gets its error and status in its place, and the others are answered.
#[tokio::test]
async fn a_batch_answers_each_query_as_a_lookup_alone_would() {
    let (state, _) = fixture();
    let metrics = state.metrics.clone();
    let app = api::router(state);
    let queries = vec![
        json!({"model": "llama", "token_ids": tokens(13)}),
        json!({"model": "llama", "adapter": "x", "token_ids": tokens(12), "limit": 1}),
        json!({"model": "llama", "tenant": "acme", "token_ids": tokens(12)}),
        json!({"model": "m8", "token_ids": tokens(20)}),
        json!({"model": "opaque", "block_hashes": [255, hex::encode(HASH_32)]}),
        json!({"model": "llama", "token_ids": tokens(12), "tier_weights": {"GPU": 1.0, "CPU": 0.5}}),
        json!({"model": "nobody", "token_ids": tokens(40)}),
        json!({"token_ids": tokens(4)}),
        json!({"model": "llama", "token_ids": "abc"}),
    ];
    let mut alone = Vec::new();
    for q in &queries {
        let (status, v) = call_json(&app, "POST", "/v1/lookup", Some(&q.to_string())).await;
        alone.push(match status {
            StatusCode::OK => v,
            status => json!({"error": v["error"], "status": status.as_u16()}),
        });
    }
    assert_eq!(
        alone.iter().filter(|a| a.get("status").is_some()).count(),
        3
    );
    assert!(alone.iter().any(|a| !rows(a).is_empty()));
    let before = metrics.lookups.load(Ordering::Relaxed);
    let body = json!({ "queries": queries }).to_string();
    let (status, v) = call_json(&app, "POST", "/v1/lookup/batch", Some(&body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v, json!({ "answers": alone }));
    assert_eq!(
        metrics.lookups.load(Ordering::Relaxed) - before,
        6,
        "each answered query counts as a lookup"
    );

    let (status, v) = call_json(&app, "POST", "/v1/lookup/batch", Some(r#"{"queries":[]}"#)).await;
    assert_eq!((status, v), (StatusCode::OK, json!({"answers": []})));
    for bad in [
        "not json",
        r#"{"queries": 5}"#,
        r#"{"model": "llama", "token_ids": [1]}"#,
        r#"[{"model": "llama", "token_ids": [1]}]"#,
        // Laid out as a batch, but a query is not JSON: the batch's 400, not the query's.
        r#"{"queries": [{"model": "llama", "token_ids": [1]}, {"model": llama}]}"#,
        r#"{"queries": [{"model": "llama", "token_ids": [1,]}]}"#,
    ] {
        let (status, v) = call_json(&app, "POST", "/v1/lookup/batch", Some(bad)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {v}");
        assert!(
            v["error"].as_str().unwrap().contains("invalid batch"),
            "{v}"
        );
    }
    let many = format!(r#"{{"queries":[{}]}}"#, vec!["{}"; 1025].join(","));
    let (status, v) = call_json(&app, "POST", "/v1/lookup/batch", Some(&many)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(
        v["error"],
        json!("queries: 1025 queries, at most 1024 per batch")
    );
}

#[tokio::test]
async fn hash_lookup_accepts_hex_and_integers() {
    let (state, _) = fixture();
    let app = api::router(state);
    let hex32 = hex::encode(HASH_32);
    let v = lookup(
        &app,
        json!({"model": "llama", "block_hashes": ["00000000000000fF", 3_735_928_559u64, hex32]}),
    )
    .await;
    assert_eq!(
        (v["query_blocks"].clone(), v["block_size"].clone()),
        (json!(3), json!(4))
    );
    assert_eq!(rows(&v), [row("hash-engine", 3, json!(12), "GPU")]);

    // Integers: 255 is the big-endian value of the 8 hash bytes above.
    let v = lookup(
        &app,
        json!({"model": "llama", "block_hashes": [255, "00000000DEADBEEF"]}),
    )
    .await;
    assert_eq!(rows(&v), [row("hash-engine", 2, json!(8), "GPU")]);

    // No known block size: matched_tokens is null, unless the request names one.
    let v = lookup(
        &app,
        json!({"model": "opaque", "block_hashes": [255, 3_735_928_559u64]}),
    )
    .await;
    assert_eq!(v["block_size"], Value::Null);
    assert_eq!(rows(&v), [row("hash-engine", 2, Value::Null, "GPU")]);
    let v = lookup(
        &app,
        json!({"model": "opaque", "block_hashes": [255], "block_size": 16}),
    )
    .await;
    assert_eq!(rows(&v), [row("hash-engine", 1, json!(16), "GPU")]);

    // Hash queries never match token chains, nor another adapter's hashes.
    let v = lookup(
        &app,
        json!({"model": "llama", "adapter": "x", "block_hashes": [255]}),
    )
    .await;
    assert_eq!(v["engines"], json!([]));
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let (state, _) = fixture();
    let app = api::router(state.clone());
    let cases: &[(&str, &str)] = &[
        (r#"{"model": "llama", "token_ids": [1,"#, "invalid JSON: "),
        ("", "invalid JSON: "),
        ("[1, 2]", "request body must be a JSON object"),
        (
            r#"{"model": "llama"}"#,
            "one of token_ids or block_hashes is required",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "block_hashes": [1]}"#,
            "token_ids and block_hashes are mutually exclusive",
        ),
        (
            r#"{"model": "llama", "token_ids": "abc"}"#,
            "token_ids: expected an array of unsigned 32-bit integers",
        ),
        (
            r#"{"model": "llama", "token_ids": [-1]}"#,
            "token_ids: expected an array of unsigned 32-bit integers (element 0",
        ),
        (
            r#"{"model": "llama", "block_hashes": [{}]}"#,
            "block_hashes: expected an array of hex strings",
        ),
        (
            r#"{"model": "llama", "block_hashes": ["xyz"]}"#,
            "block_hashes: ",
        ),
        (r#"{"token_ids": [1]}"#, "model: required"),
        (
            r#"{"model": 5, "token_ids": [1]}"#,
            "model: expected a non-empty string",
        ),
        (
            r#"{"model": "", "token_ids": [1]}"#,
            "model: expected a non-empty string",
        ),
        (
            r#"{"model": "llama", "adapter": 1, "token_ids": [1]}"#,
            "adapter: expected a string",
        ),
        (
            r#"{"model": "llama", "tenant": {}, "token_ids": [1]}"#,
            "tenant: expected a string",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "block_size": 0}"#,
            "block_size: ",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "block_size": -4}"#,
            "block_size: ",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "cache_salt": 5}"#,
            "cache_salt: expected a string",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "mm_inputs": {}}"#,
            "mm_inputs: expected an array",
        ),
        (
            r#"{"model": "llama", "token_ids": [1], "mm_inputs": [{"hash": "a", "offset": 0, "length": 0}]}"#,
            "mm_inputs: expected an array of {\"hash\": string, \"offset\": integer ≥ 0, \"length\": integer ≥ 1} (element 0",
        ),
        (
            r#"{"model": "llama", "block_hashes": [1], "cache_salt": "s"}"#,
            "cache_salt and mm_inputs apply to token_ids lookups only",
        ),
    ];
    for (body, prefix) in cases {
        let (status, v) = call_json(&app, "POST", "/v1/lookup", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {v}");
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{body} -> {v}"));
        assert!(
            msg.starts_with(prefix),
            "{body}: {msg:?} does not start with {prefix:?}"
        );
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
    }

    // Oversize body (limit 4096 in the fixture) -> 413 JSON.
    let big = format!(
        r#"{{"model": "llama", "token_ids": [{}]}}"#,
        vec!["1"; 3000].join(",")
    );
    let (status, v) = call_json(&app, "POST", "/v1/lookup", Some(&big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(
        v,
        json!({"error": "request body exceeds the limit of 4096 bytes"})
    );

    // Over the token cap with a limit large enough to carry it.
    let mut roomy = state.clone();
    roomy.max_body_bytes = 4 << 20;
    let huge = format!(
        r#"{{"model": "llama", "token_ids": [{}]}}"#,
        vec!["1"; 1_000_001].join(",")
    );
    let (status, v) = call_json(&api::router(roomy), "POST", "/v1/lookup", Some(&huge)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v, json!({"error": "token_ids: more than 1000000 tokens"}));

    assert_eq!(
        state.metrics.lookup_errors.load(Ordering::Relaxed),
        cases.len() as u64 + 2
    );
    assert_eq!(state.metrics.lookups.load(Ordering::Relaxed), 0);

    // Any content type: the body is JSON regardless.
    let req = Request::post("/v1/lookup")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(
            r#"{"model": "llama", "token_ids": [1, 2, 3, 4]}"#,
        ))
        .unwrap();
    assert_eq!(
        app.clone().oneshot(req).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn unknown_paths_and_methods_answer_json() {
    let (state, _) = fixture();
    let app = api::router(state);
    let (status, v) = call_json(&app, "GET", "/x", None).await;
    assert_eq!(
        (status, v),
        (
            StatusCode::NOT_FOUND,
            json!({"error": "no route for GET /x"})
        )
    );
    let (status, v) = call_json(&app, "POST", "/v1/lookup/extra?q=1", Some("{}")).await;
    assert_eq!(
        (status, v),
        (
            StatusCode::NOT_FOUND,
            json!({"error": "no route for POST /v1/lookup/extra"})
        )
    );

    let (status, headers, body) = call(&app, "GET", "/v1/lookup", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(headers.get(header::ALLOW).unwrap(), "POST");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        json!({"error": "method GET is not allowed for /v1/lookup"})
    );
    let (status, v) = call_json(&app, "DELETE", "/v1/stats", None).await;
    assert_eq!(
        (status, v),
        (
            StatusCode::METHOD_NOT_ALLOWED,
            json!({"error": "method DELETE is not allowed for /v1/stats"})
        )
    );
}

#[tokio::test]
async fn the_baseline_route_is_served_only_when_configured() {
    let (state, _) = fixture();
    let app = api::router(state.clone());
    let (status, _) = call_json(&app, "POST", "/bench/static?bytes=100", Some("{}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let app = api::router(AppState {
        baseline_route: true,
        ..state
    });
    for bytes in [0usize, 10, 1234] {
        let path = format!("/bench/static?bytes={bytes}");
        let (status, headers, body) = call(&app, "POST", &path, Some(b"{}".to_vec())).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(
            headers.get(header::CONTENT_TYPE).unwrap(),
            "application/json"
        );
        assert_eq!(body.len(), bytes.max(10), "{path}");
        serde_json::from_slice::<Value>(&body).unwrap();
    }
    let (status, _) = call_json(&app, "POST", "/bench/static?bytes=99999999", Some("{}")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn engines_stats_and_probes() {
    let (state, ready) = fixture();
    let app = api::router(state.clone());

    let (status, v) = call_json(&app, "GET", "/v1/engines", None).await;
    assert_eq!(status, StatusCode::OK);
    let engines = v["engines"].as_array().unwrap();
    let ids: Vec<_> = engines
        .iter()
        .map(|e| e["engine_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "engine-0",
            "engine-a",
            "engine-b",
            "engine-c",
            "engine-m8",
            "engine-t",
            "hash-engine",
            "lora-only"
        ]
    );
    assert_eq!(
        engines[1],
        json!({
            "engine_id": "engine-a",
            "blocks": 5,
            "blocks_by_tier": {"GPU": 5, "CPU": 0, "DISK": 0},
            "partitions": [
                {"tenant": "", "model": "llama", "adapter": ""},
                {"tenant": "", "model": "llama", "adapter": "x"},
            ],
            "adapters": ["", "x"],
            "last_seen_us": NOW,
            "seq_regressions": 0,
        })
    );
    assert_eq!(
        engines[2]["blocks_by_tier"],
        json!({"GPU": 0, "CPU": 2, "DISK": 0})
    );
    assert_eq!(engines[6]["adapters"], json!([""]));
    assert_eq!(engines[6]["partitions"].as_array().unwrap().len(), 2);

    state.metrics.count_applied(0, 3);
    state.metrics.count_malformed("json");
    state.metrics.count_skipped("unknown_parent");
    lookup(&app, json!({"model": "llama", "token_ids": tokens(4)})).await;
    call_json(&app, "POST", "/v1/lookup", Some("{")).await;
    let (status, v) = call_json(&app, "GET", "/v1/stats", None).await;
    assert_eq!(status, StatusCode::OK);
    let index = &v["index"];
    assert_eq!(index["shards"], 2);
    assert_eq!(index["engines"], 8);
    // Block entries are counted per shard (a block held in two shards counts in each).
    assert_eq!(index["block_entries"], state.index.stats().block_entries);
    assert_eq!(index["memberships"], 3 + 2 + 2 + 1 + 2 + 1 + 3 + 3 + 3 + 2);
    assert!(index["l1_bytes"].as_u64().unwrap() > 0);
    assert!(index["l1_bytes_per_membership"].as_f64().unwrap() > 0.0);
    let parts: Vec<_> = index["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}/{}/{}",
                p["tenant"].as_str().unwrap(),
                p["model"].as_str().unwrap(),
                p["adapter"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        parts,
        ["/llama/", "/llama/x", "/m8/", "/opaque/", "acme/llama/"]
    );
    assert_eq!(index["partitions"][1]["memberships"], 3);
    assert_eq!(index["partitions"][1]["adapter"], "x");
    assert_eq!(
        v["events"],
        json!({
            "applied": {"stored": 1, "removed": 0, "all_cleared": 0, "replica_updated": 0},
            "applied_total": 1,
            "block_ops": 3,
            "malformed": {"json": 1},
            "skipped": {"unknown_parent": 1},
        })
    );
    assert_eq!(v["lookups"], json!({"total": 1, "errors": 1}));
    assert_eq!(v["sources"]["lag"], 12);
    assert_eq!(v["sources"]["name"], "kafka:kv-events");
    assert_eq!(v["sources"]["partitions"], json!([]));

    let (status, v) = call_json(&app, "GET", "/healthz", None).await;
    assert_eq!((status, v), (StatusCode::OK, json!({"status": "ok"})));
    let (status, v) = call_json(&app, "GET", "/readyz", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(v["ready"], false);
    assert_eq!(v["lag"], 12);
    assert!(v["reason"].is_string());
    ready.store(true, Ordering::Release);
    let (status, v) = call_json(&app, "GET", "/readyz", None).await;
    assert_eq!((status, v), (StatusCode::OK, json!({"ready": true})));
}

/// Checks one Prometheus text line is `name{labels} value` (labels optional).
fn check_sample(line: &str) -> Result<(), String> {
    let (series, value) = line.rsplit_once(' ').ok_or("no value")?;
    if !matches!(value, "+Inf" | "-Inf" | "NaN") {
        value
            .parse::<f64>()
            .map_err(|e| format!("value {value:?}: {e}"))?;
    }
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, Some(rest.strip_suffix('}').ok_or("unclosed labels")?)),
        None => (series, None),
    };
    let name_ok = name.chars().enumerate().all(|(i, c)| {
        c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
    });
    if name.is_empty() || !name_ok {
        return Err(format!("bad metric name {name:?}"));
    }
    for pair in labels.into_iter().flat_map(|l| l.split(',')) {
        let (k, v) = pair.split_once('=').ok_or("label without =")?;
        let k_ok = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        let v_ok = v.len() >= 2 && v.starts_with('"') && v.ends_with('"');
        if !k_ok || !v_ok {
            return Err(format!("bad label {pair:?}"));
        }
    }
    Ok(())
}

#[tokio::test]
async fn metrics_are_prometheus_text() {
    let (state, _) = fixture();
    let app = api::router(state);
    lookup(&app, json!({"model": "llama", "token_ids": tokens(8)})).await;
    let (status, headers, body) = call(&app, "GET", "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    let ct = headers.get(header::CONTENT_TYPE).unwrap().to_str().unwrap();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let text = String::from_utf8(body).unwrap();
    assert!(text.contains("kvindex_events_applied_total"));
    assert!(text.contains("kvindex_lookup_duration_seconds_bucket"));
    assert!(text.contains("kvindex_lookup_duration_seconds_count 1\n"));
    for line in text.lines().filter(|l| !l.is_empty()) {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ") || line.starts_with("# TYPE "),
                "{line}"
            );
        } else if let Err(e) = check_sample(line) {
            panic!("{line:?}: {e}");
        }
    }
}

// ---- OpenAPI conformance ----

fn openapi() -> Value {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/schemas/openapi.yaml"))
            .unwrap();
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    serde_json::to_value(yaml).unwrap()
}

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// (METHOD, path) of every operation in the document.
fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for m in item
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| METHODS.contains(&k.as_str()))
        {
            out.insert((m.to_uppercase(), path.clone()));
        }
    }
    out
}

/// Follows a local `$ref` (`#/a/b`) in `doc`.
fn deref<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => doc
            .pointer(r.trim_start_matches('#'))
            .unwrap_or_else(|| panic!("dangling $ref {r}")),
        None => v,
    }
}

/// A validator for `schema` (a schema of `doc`) with `doc`'s components in scope.
fn validator(doc: &Value, schema: &Value) -> jsonschema::Validator {
    let mut wrapper = json!({ "$schema": "https://json-schema.org/draft/2020-12/schema" });
    for (k, v) in schema.as_object().unwrap() {
        wrapper[k] = v.clone();
    }
    wrapper["components"] = doc["components"].clone();
    jsonschema::validator_for(&wrapper)
        .unwrap_or_else(|e| panic!("schema {schema} does not compile: {e}"))
}

/// Validates a response against the document's schema for (method, path, status), falling
/// back to the operation's `default` response, and for an undocumented operation (a 405) to
/// the shared `Error` response.
fn conforms(
    doc: &Value,
    method: &str,
    path: &str,
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
) {
    let response = match doc["paths"][path].get(method.to_lowercase()) {
        Some(op) => {
            let responses = &op["responses"];
            responses
                .get(status.as_str())
                .or_else(|| responses.get("default"))
                .unwrap_or_else(|| panic!("{method} {path}: status {status} not documented"))
        }
        None => {
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            &doc["components"]["responses"]["Error"]
        }
    };
    let response = deref(doc, response);
    let content_type = headers.get(header::CONTENT_TYPE).unwrap().to_str().unwrap();
    let media = response["content"].get(content_type).unwrap_or_else(|| {
        panic!("{method} {path} {status}: content type {content_type} not documented")
    });
    if content_type != "application/json" {
        assert_eq!(media["schema"]["type"], "string");
        return;
    }
    let instance: Value = serde_json::from_slice(body).unwrap();
    let v = validator(doc, &media["schema"]);
    let errors: Vec<String> = v
        .iter_errors(&instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{method} {path} {status}: {instance} violates its schema: {errors:?}"
    );
}

#[test]
fn openapi_schemas_compile_and_refs_resolve() {
    let doc = openapi();
    assert_eq!(doc["openapi"], "3.1.0");
    for (name, schema) in doc["components"]["schemas"].as_object().unwrap() {
        validator(&doc, schema);
        let _ = name;
    }
    // The wrapper must really resolve `$ref`s: a wrong body must fail.
    let lookup = validator(
        &doc,
        &json!({"$ref": "#/components/schemas/LookupResponse"}),
    );
    let good = json!({"model": "m", "tenant": "", "adapter": "", "query_blocks": 1, "block_size": null,
        "engines": [{"engine_id": "e", "matched_blocks": 1, "matched_tokens": null, "tier": "GPU",
                     "blocks_by_tier": {"GPU": 1, "CPU": 0, "DISK": 0}}]});
    assert!(lookup.is_valid(&good));
    let mut bad = good.clone();
    bad["engines"][0]["tier"] = json!("HBM");
    assert!(!lookup.is_valid(&bad), "nested $ref to Tier not enforced");
    let mut scored = good.clone();
    scored["engines"][0]["score"] = json!(0.8);
    assert!(lookup.is_valid(&scored));
    let request = validator(&doc, &json!({"$ref": "#/components/schemas/LookupRequest"}));
    assert!(request.is_valid(&json!({"model": "m", "token_ids": [1, 2]})));
    assert!(request.is_valid(&json!({"model": "m", "block_hashes": ["00ff", 5]})));
    assert!(
        request.is_valid(&json!({"model": "m", "token_ids": [1], "tier_weights": {"CPU": 0.8}}))
    );
    assert!(
        !request.is_valid(&json!({"model": "m", "token_ids": [1], "tier_weights": {"HBM": 1}}))
    );
    assert!(!request.is_valid(&json!({"model": "m", "block_hashes": [1], "token_ids": [1]})));
    assert!(!request.is_valid(&json!({"model": "m"})));
}

#[tokio::test]
async fn openapi_document_matches_router_and_responses() {
    let doc = openapi();
    let (state, ready) = fixture();
    let app = api::router(state);

    // Routes: the document lists exactly the routes served, and each is served.
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(documented(&doc), served);
    for path in doc["paths"].as_object().unwrap().keys() {
        for method in ["GET", "POST", "PUT", "DELETE", "PATCH"] {
            let query = r#"{"model": "llama", "token_ids": [1]}"#;
            let body = (method == "POST").then(|| match path.as_str() {
                "/v1/lookup/batch" => format!(r#"{{"queries": [{query}]}}"#).into_bytes(),
                _ => query.as_bytes().to_vec(),
            });
            let (status, headers, bytes) = call(&app, method, path, body).await;
            if served.contains(&(method.to_string(), path.clone())) {
                assert!(
                    status.is_success() || status == StatusCode::SERVICE_UNAVAILABLE,
                    "{method} {path}: {status}"
                );
            } else {
                assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            }
            conforms(&doc, method, path, status, &headers, &bytes);
        }
    }

    // Bodies of each route, success and error, against their documented schemas.
    let hex32 = hex::encode(HASH_32);
    let cases: Vec<(&str, &str, Option<String>)> = vec![
        (
            "POST",
            "/v1/lookup",
            Some(json!({"model": "llama", "token_ids": tokens(13)}).to_string()),
        ),
        (
            "POST",
            "/v1/lookup",
            Some(json!({"model": "opaque", "block_hashes": [255, hex32]}).to_string()),
        ),
        (
            "POST",
            "/v1/lookup",
            Some(json!({"model": "nobody", "token_ids": []}).to_string()),
        ),
        (
            "POST",
            "/v1/lookup",
            Some(r#"{"model": "llama", "token_ids": "abc"}"#.to_string()),
        ),
        ("POST", "/v1/lookup", Some("not json".to_string())),
        (
            "POST",
            "/v1/lookup",
            Some(format!(
                r#"{{"model": "llama", "token_ids": [{}]}}"#,
                vec!["1"; 3000].join(",")
            )),
        ),
        (
            "POST",
            "/v1/lookup/batch",
            Some(
                json!({"queries": [
                    {"model": "llama", "token_ids": tokens(13)},
                    {"model": "llama", "token_ids": "abc"},
                ]})
                .to_string(),
            ),
        ),
        ("POST", "/v1/lookup/batch", Some("[]".to_string())),
        ("GET", "/v1/lookup", None),
        ("GET", "/v1/engines", None),
        ("GET", "/v1/stats", None),
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
        ("GET", "/metrics", None),
    ];
    let mut statuses = BTreeSet::new();
    for (method, path, body) in &cases {
        let (status, headers, bytes) = call(
            &app,
            method,
            path,
            body.as_ref().map(|b| b.as_bytes().to_vec()),
        )
        .await;
        statuses.insert(status.as_u16());
        conforms(&doc, method, path, status, &headers, &bytes);
    }
    ready.store(true, Ordering::Release);
    let (status, headers, bytes) = call(&app, "GET", "/readyz", None).await;
    assert_eq!(status, StatusCode::OK);
    conforms(&doc, "GET", "/readyz", status, &headers, &bytes);
    // An unknown path answers the shared Error schema.
    let (status, _, bytes) = call(&app, "GET", "/nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let error = validator(&doc, &json!({"$ref": "#/components/schemas/Error"}));
    assert!(error.is_valid(&serde_json::from_slice(&bytes).unwrap()));
    assert_eq!(
        statuses,
        BTreeSet::from([200, 400, 405, 413, 503]),
        "every documented status was exercised"
    );
}

// ---- A real server ----

#[tokio::test]
async fn serve_answers_over_tcp_and_shuts_down() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (state, _) = fixture();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(api::serve(listener, state, async {
        let _ = stopped.await;
    }));

    let body = json!({"model": "llama", "token_ids": tokens(8)}).to_string();
    let request = format!(
        "POST /v1/lookup HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tcp.read_to_end(&mut response).await.unwrap();
    let response = String::from_utf8(response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        v["engines"][0],
        json!({"engine_id": "engine-0", "matched_blocks": 2, "matched_tokens": 8, "tier": "GPU",
               "blocks_by_tier": {"GPU": 2, "CPU": 0, "DISK": 0}})
    );
    assert_eq!(v["engines"].as_array().unwrap().len(), 4);

    stop.send(()).unwrap();
    let result = tokio::time::timeout(std::time::Duration::from_secs(10), server).await;
    result.expect("server stops on shutdown").unwrap().unwrap();
}
