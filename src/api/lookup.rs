//! `POST /v1/lookup`: which engines hold the longest cached prefix of a query.
//!
//! The body is read as JSON whatever its `Content-Type` says (callers such as `curl -d` send
//! form types by default; the body is the contract), parsed by [`super::request`], and answered
//! from the index inline on the async worker: a typical lookup takes ~10 µs and even the largest
//! allowed query (1M tokens) is about a millisecond of hashing, less than the cost of handing
//! work to `spawn_blocking` and back for the common case. Shard read locks are held only for the
//! scan of each shard, and writers hold theirs only per applied batch.

use super::AppState;
use super::error::ApiError;
use super::request::{Query, parse_lookup};
use crate::index::QueryBlocks;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

#[derive(Debug, Serialize)]
pub struct LookupResponse<'a> {
    pub model: String,
    pub tenant: String,
    pub adapter: String,
    /// Full blocks in the query (trailing partial token block excluded).
    pub query_blocks: usize,
    /// Block size the answer is in; `null` for a hash query with no known block size.
    pub block_size: Option<u32>,
    pub engines: Vec<EngineRow<'a>>,
}

#[derive(Debug, Serialize)]
pub struct EngineRow<'a> {
    pub engine_id: &'a str,
    pub matched_blocks: u32,
    pub matched_tokens: Option<u64>,
    /// Tier of the engine's last matched block.
    pub tier: &'static str,
}

pub async fn lookup(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let answered = answer(&state, body);
    if answered.is_err() {
        state.metrics.lookup_errors.fetch_add(1, Relaxed);
    }
    let Answered {
        partition,
        query_blocks,
        block_size,
        answer,
    } = answered?;
    let engines = answer
        .iter()
        .map(|m| EngineRow {
            matched_tokens: block_size.map(|bs| u64::from(m.matched_blocks) * u64::from(bs)),
            engine_id: m.engine_id,
            matched_blocks: m.matched_blocks,
            tier: m.tier.as_str(),
        })
        .collect();
    let crate::event::PartitionKey {
        tenant,
        model,
        adapter,
    } = partition;
    // Serialized here, while the rows still borrow the answer's engine names.
    Ok(Json(LookupResponse {
        model,
        tenant,
        adapter,
        query_blocks,
        block_size,
        engines,
    })
    .into_response())
}

/// A lookup answered, before serialization.
struct Answered {
    partition: crate::event::PartitionKey,
    query_blocks: usize,
    block_size: Option<u32>,
    answer: crate::index::Answer,
}

fn answer(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Answered, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge {
                limit: state.max_body_bytes,
            }
        } else {
            ApiError::bad_request(format!(
                "failed to read request body: {}",
                rejection.body_text()
            ))
        }
    })?;
    let req = parse_lookup(&body)?;
    drop(body);
    let p = &req.partition;
    let learned = || state.index.block_size(&p.tenant, &p.model);
    let (blocks, block_size) = match req.query {
        Query::Tokens(token_ids) => {
            let bs = req
                .block_size
                .or_else(learned)
                .unwrap_or(state.default_block_size);
            (
                QueryBlocks::Tokens {
                    token_ids,
                    block_size: bs,
                },
                Some(bs),
            )
        }
        Query::Hashes(hashes) => (QueryBlocks::Hashes(hashes), req.block_size.or_else(learned)),
    };
    let start = Instant::now();
    let (query_blocks, answer) = state.index.lookup(p, &blocks);
    state.metrics.observe_lookup(start.elapsed().as_secs_f64());
    Ok(Answered {
        partition: req.partition,
        query_blocks,
        block_size,
        answer,
    })
}
