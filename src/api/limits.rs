//! Load limits of the API: a deadline per request (`http.request_timeout_ms`, 503 on expiry)
//! and a cap on requests served at once (`http.max_concurrent_requests`): one over the cap is
//! answered 503 with `Retry-After: 1` at once, never queued. The router puts the probes
//! outside the cap, so an overloaded server still answers its liveness and readiness checks.
//!
//! A request cut off by the deadline stops where its handler was awaiting; work already handed
//! to a blocking thread (an engine being cleared) still completes.

use super::error::ApiError;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Default of `http.request_timeout_ms`.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of `http.max_concurrent_requests`.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 1024;

/// The limits one router enforces (see [`crate::config::HttpConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub request_timeout: Duration,
    pub max_concurrent_requests: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
        }
    }
}

/// Middleware: answers 503 when the rest of the stack takes longer than the duration.
pub async fn deadline(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(res) => res,
        Err(_) => {
            let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
            tracing::debug!(timeout_ms = ms, "request timed out");
            ApiError::Timeout { ms }.into_response()
        }
    }
}

/// The permits of [`shed`]: one per request in flight. Each router builds its own.
#[derive(Clone, Debug)]
pub struct Gate {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl Gate {
    pub fn new(limit: usize) -> Gate {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Gate {
            permits: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }
}

/// Middleware: runs the request if a permit is free (held until its response is built; the
/// API's bodies are built whole), else answers 503 with `Retry-After: 1` without waiting.
pub async fn shed(State(gate): State<Gate>, req: Request, next: Next) -> Response {
    match gate.permits.clone().try_acquire_owned() {
        Ok(permit) => {
            let res = next.run(req).await;
            drop(permit);
            res
        }
        Err(_) => {
            tracing::debug!(limit = gate.limit, "request shed: too many in flight");
            ApiError::Overloaded { limit: gate.limit }.into_response()
        }
    }
}
