//! The HTTP read API (axum): the router over [`AppState`], the server entry points [`serve`]
//! (plain HTTP) and [`serve_tls`], and request tracing. Handlers live in the submodules;
//! `schemas/openapi.yaml` documents every route and `tests/service/api.rs` checks the two
//! agree. The edge guards are their own modules: `auth.rs` (bearer token, loopback rule),
//! `limits.rs` (deadline, concurrency cap), `tls.rs` (rustls listener).

pub mod applied;
pub mod auth;
pub mod baseline;
pub mod error;
pub mod health;
pub mod limits;
pub mod lookup;
pub mod lookup_batch;
pub mod sidecar;
pub mod stats;
pub mod tls;

/// The lookup body parser lives in the wire crate (it is part of the contract routers speak).
pub use kvindex_wire::lookup as request;

use crate::bridge::BridgeStats;
use crate::config::ConfigError;
use crate::index::Index;
use crate::ingest::{SourceReport, SourceStatus};
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, Spill};
use crate::service::Service;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::serve::{Listener, ListenerExt};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Default of [`AppState::max_body_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default of [`AppState::max_page_size`].
pub const DEFAULT_MAX_PAGE_SIZE: usize = 1000;
/// Default of [`AppState::default_block_size`]: none (a token lookup for a model whose
/// block size no event has told is a 400, never an empty answer keyed with a guess).
pub const DEFAULT_BLOCK_SIZE: u32 = 0;

/// Every (method, path) the router serves (see [`router`]), but the opt-in baseline route
/// (`baseline.rs`), which is no part of the API. `GET` routes answer
/// `HEAD` too. Kept by hand in step with [`router`]; `tests/service/api.rs` checks each is
/// served and that the OpenAPI document lists exactly these.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/lookup"),
    ("POST", "/v1/lookup/batch"),
    ("GET", "/v1/engines"),
    ("DELETE", "/v1/engines/{id}"),
    ("GET", "/v1/stats"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
];

/// What every handler shares. The router holds it behind one `Arc`, so a request clones a
/// pointer, not the dozen handles inside.
#[derive(Clone)]
pub struct AppState {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    /// Set true once the source has caught up (by the ingest loop); `/readyz` reads it.
    pub ready: Arc<AtomicBool>,
    /// Block size for token lookups when neither the request nor learned model block size gives one.
    pub default_block_size: u32,
    /// The event source's status, for `/v1/stats` (`sources`) and `/readyz` (`lag`); `None`
    /// without a source.
    pub sources: Option<Arc<dyn SourceStatusView>>,
    /// Max request body bytes (default 1 MiB).
    pub max_body_bytes: usize,
    /// The bounded L1 and its spill to L2, for `/v1/stats` (`writeback`) and `/metrics`
    /// (`None`: an index without a store behind it).
    pub spill: Option<Arc<Spill>>,
    /// The engine bridge's streams, for `/v1/stats` (`bridge`), `/v1/engines` and `/metrics`
    /// (`None`: no bridge runs in this process).
    pub bridge: Option<BridgeStats>,
    /// The shard workers, for `DELETE /v1/engines/{id}` (`None`: a read-only state, 503).
    pub pipeline: Option<Arc<Pipeline>>,
    /// Who may call which route (default: no token; mutations from loopback only).
    pub auth: auth::AuthPolicy,
    /// Request deadline and concurrency cap.
    pub limits: limits::Limits,
    /// Most engines in one `GET /v1/engines` page.
    pub max_page_size: usize,
    /// Serve `POST /bench/static` (see `baseline.rs`); off by default.
    pub baseline_route: bool,
    /// This replica's id, for `/v1/stats` (`""`: none).
    pub replica_id: String,
}

impl AppState {
    /// A state with the defaults: not ready, [`DEFAULT_BLOCK_SIZE`], no source,
    /// [`DEFAULT_MAX_BODY_BYTES`], no token, the default limits and page size.
    pub fn new(index: Arc<Index>, metrics: Arc<Metrics>) -> AppState {
        AppState {
            index,
            metrics,
            ready: Arc::new(AtomicBool::new(false)),
            default_block_size: DEFAULT_BLOCK_SIZE,
            sources: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            spill: None,
            bridge: None,
            pipeline: None,
            auth: auth::AuthPolicy::default(),
            limits: limits::Limits::default(),
            max_page_size: DEFAULT_MAX_PAGE_SIZE,
            baseline_route: false,
            replica_id: String::new(),
        }
    }

    /// The state over a running `service`, with the source's status from `sources` and the
    /// guards of its `[http]` section (which reads the token file: hence the error).
    pub fn over(
        service: &Service,
        sources: Option<Arc<dyn SourceStatusView>>,
    ) -> Result<AppState, ConfigError> {
        let http = &service.config.http;
        let mut state = AppState::new(service.index.clone(), service.metrics.clone());
        state.ready = service.ready.clone();
        state.default_block_size = service.config.index.default_block_size;
        state.max_body_bytes = http.max_body_bytes;
        state.spill = Some(service.spill.clone());
        state.pipeline = Some(service.pipeline.clone());
        state.sources = sources;
        state.auth = auth::AuthPolicy::from_config(http)?;
        state.limits = limits::Limits {
            request_timeout: http.request_timeout(),
            max_concurrent_requests: http.max_concurrent_requests,
        };
        state.max_page_size = http.max_page_size;
        state.baseline_route = http.baseline_route;
        state.replica_id = service.config.cluster.replica_id.clone();
        Ok(state)
    }

    /// How far the index has applied its source, read now (before a lookup).
    pub fn applied(&self) -> Option<applied::Applied> {
        self.sources.as_ref()?.applied()
    }
}

/// Where the API reads the event source's status: the ingest loop's [`SourceReport`] in the
/// service; a fixed [`SourceStatus`] in tests and tools.
pub trait SourceStatusView: Send + Sync {
    fn source_status(&self) -> SourceStatus;

    /// How far the index has applied the source, for lookup answers (`None`: not known).
    fn applied(&self) -> Option<applied::Applied> {
        None
    }
}

impl SourceStatusView for SourceReport {
    fn source_status(&self) -> SourceStatus {
        self.status()
    }

    fn applied(&self) -> Option<applied::Applied> {
        let (source, next_offsets) = SourceReport::applied(self);
        Some(applied::Applied {
            source: source.to_string(),
            next_offsets,
        })
    }
}

impl SourceStatusView for SourceStatus {
    fn source_status(&self) -> SourceStatus {
        self.clone()
    }
}

/// The API router. Unknown paths get a JSON 404 and known paths with another method a JSON 405
/// (with `Allow`); bodies over `max_body_bytes` get a JSON 413.
///
/// Guards, outermost first: tracing; the request deadline (every route); then, for all but
/// the probes, the token check of the route's kind ([`auth::reads`] or [`auth::mutations`])
/// and the concurrency cap ([`limits::shed`]).
pub fn router(state: AppState) -> Router {
    let mut reads = read_routes();
    if state.baseline_route {
        reads = reads.route("/bench/static", post(baseline::static_answer));
    }
    assemble(state, reads)
}

/// [`router`] with `extra` routes served as reads (behind the same guards), for tests of the
/// guards with handlers of their own (a deliberately slow one).
#[cfg(any(test, feature = "testing"))]
pub fn router_with_reads(state: AppState, extra: Router<Arc<AppState>>) -> Router {
    assemble(state, read_routes().merge(extra))
}

/// The routes that only read: open unless `http.auth_reads`.
fn read_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/lookup", post(lookup::lookup))
        .route("/v1/lookup/batch", post(lookup_batch::lookup_batch))
        .route("/v1/engines", get(stats::engines))
        .route("/v1/stats", get(stats::stats))
        .route("/metrics", get(health::metrics))
}

fn assemble(state: AppState, reads: Router<Arc<AppState>>) -> Router {
    let body_limit = state.max_body_bytes;
    let policy = state.auth.clone();
    // One gate for all capped routes; `route_layer` wraps inside out, so the token check runs
    // first and a refused request never holds a permit.
    let gate = limits::Gate::new(state.limits.max_concurrent_requests);
    let reads = reads
        .route_layer(middleware::from_fn_with_state(gate.clone(), limits::shed))
        .route_layer(middleware::from_fn_with_state(policy.clone(), auth::reads));
    let mutations = Router::new()
        .route("/v1/engines/{id}", delete(stats::forget_engine))
        .route_layer(middleware::from_fn_with_state(gate, limits::shed))
        .route_layer(middleware::from_fn_with_state(policy, auth::mutations));
    let probes = Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz));
    reads
        .merge(mutations)
        .merge(probes)
        .method_not_allowed_fallback(error::method_not_allowed)
        .fallback(error::not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(
            state.limits.request_timeout,
            limits::deadline,
        ))
        .layer(middleware::from_fn(trace))
        .with_state(Arc::new(state))
}

/// Serves the API over plain HTTP on `listener` until `shutdown` completes, then drains
/// in-flight requests. Handlers see the peer address (`ConnectInfo<SocketAddr>`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "HTTP API listening");
    }
    // Small request/response exchanges on keep-alive connections: don't let Nagle delay them.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
    });
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// [`serve`] over TLS: connections are accepted and their handshakes completed by
/// [`tls::TlsListener`] with `config` (see [`tls::server_config`]).
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    config: Arc<tls::ServerConfig>,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = tls::TlsListener::new(listener, config)?;
    tracing::info!(addr = %listener.local_addr()?, "HTTPS API listening");
    // `tap_io` only so that axum's `ConnectInfo<SocketAddr>` applies to this listener type.
    let listener = listener.tap_io(|_| {});
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Logs method, path, status and latency of every request at debug level.
async fn trace(req: Request, next: Next) -> Response {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return next.run(req).await;
    }
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let res = next.run(req).await;
    tracing::debug!(
        %method,
        path,
        status = res.status().as_u16(),
        latency_us = start.elapsed().as_micros() as u64,
        "http request"
    );
    res
}
