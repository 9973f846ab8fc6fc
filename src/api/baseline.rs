//! `POST /bench/static?bytes=N`: the HTTP stack's own rate on this machine. It reads the
//! request body as a lookup does and answers `N` bytes of fixed JSON, behind the same guards
//! as the read routes, so `kvindex bench http --baseline` can hold lookups against what the
//! server would do with no index work at all. Served only with `http.baseline_route`.

use super::AppState;
use super::error::ApiError;
use super::lookup::read_body;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use std::sync::Arc;

/// Shortest body the route answers: `{"pad":""}`.
const MIN_BYTES: usize = 10;
/// Longest body the route answers (an answer of thousands of engines is ~1 MiB).
const MAX_BYTES: usize = 4 << 20;

#[derive(Deserialize)]
pub struct BaselineParams {
    /// Size of the answer, in bytes (default: [`MIN_BYTES`]).
    #[serde(default)]
    bytes: usize,
}

pub async fn static_answer(
    State(state): State<Arc<AppState>>,
    Query(params): Query<BaselineParams>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    read_body(&state, body)?;
    if params.bytes > MAX_BYTES {
        return Err(ApiError::bad_request(format!(
            "`bytes` must be at most {MAX_BYTES}, got {}",
            params.bytes
        )));
    }
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        padded_json(params.bytes.max(MIN_BYTES)),
    )
        .into_response())
}

/// `{"pad":"aaa…"}` of exactly `len` (≥ [`MIN_BYTES`]) bytes, built per request as a lookup
/// builds its answer.
fn padded_json(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(b"{\"pad\":\"");
    out.resize(len - 2, b'a');
    out.extend_from_slice(b"\"}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_padding_is_json_of_the_asked_size() {
        for len in [MIN_BYTES, 11, 1500, 70_000] {
            let body = padded_json(len);
            assert_eq!(body.len(), len);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["pad"].as_str().unwrap().len(), len - MIN_BYTES);
        }
    }
}
