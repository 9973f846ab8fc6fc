//! The HTTP surface of `kvindex bridge` (the sidecar has no index): `GET /healthz`,
//! `GET /metrics` (the `kvindex_bridge_*` families) and `GET /v1/stats` (`{"bridge": [...]}`,
//! one row per engine stream, as in the service's `/v1/stats`).

use super::{error, health};
use crate::bridge::BridgeStats;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

pub fn router(stats: BridgeStats) -> Router {
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/metrics", get(metrics))
        .route("/v1/stats", get(stats_route))
        .method_not_allowed_fallback(error::method_not_allowed)
        .fallback(error::not_found)
        .with_state(stats)
}

async fn metrics(State(stats): State<BridgeStats>) -> Response {
    let mut text = String::new();
    stats.render_prometheus(&mut text);
    (
        [(header::CONTENT_TYPE, health::PROMETHEUS_CONTENT_TYPE)],
        text,
    )
        .into_response()
}

async fn stats_route(State(stats): State<BridgeStats>) -> Response {
    Json(serde_json::json!({ "bridge": stats.report() })).into_response()
}
