//! Probes and scraping: `GET /healthz` (liveness), `GET /readyz` (readiness: sources caught up)
//! and `GET /metrics` (Prometheus text exposition).

use super::AppState;
use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering::Acquire;

/// Content type of the Prometheus text format 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Alive as long as the server answers.
pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// 200 `{"ready": true}` once `state.ready` is set (sources caught up, every shard loaded);
/// before that 503 with a `reason`, the `warm_up` while shards load, and, when there is a
/// source, its `lag`.
pub async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.ready.load(Acquire) {
        return Json(json!({ "ready": true })).into_response();
    }
    let mut body = json!({ "ready": false, "reason": "sources have not caught up yet" });
    if let Some(warm_up) = state.pipeline.as_ref().map(|p| p.warm_up())
        && !warm_up.is_done()
    {
        body["reason"] = "the index is loading from disk (lookups are answered meanwhile)".into();
        body["warm_up"] = serde_json::to_value(warm_up.report()).unwrap_or_default();
    }
    if let Some(sources) = &state.sources {
        body["lag"] = sources.source_status().lag.into();
    }
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = state.metrics.render(&state.index.stats());
    if let Some(spill) = &state.spill {
        spill.stats().render_prometheus(&mut text);
    }
    if let Some(bridge) = &state.bridge {
        bridge.render_prometheus(&mut text);
    }
    ([(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)], text).into_response()
}
