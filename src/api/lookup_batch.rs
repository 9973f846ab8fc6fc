//! `POST /v1/lookup/batch`: many lookups in one request, as a router scoring a batch of
//! requests asks them, for one round trip and one pass of the HTTP stack instead of many.
//!
//! The body is `{"queries": [q, ...]}`, each `q` exactly a `POST /v1/lookup` body (so each may
//! name its own model, adapter, limit or weights); the answer is `{"answers": [a, ...]}` in the
//! same order, each `a` what `/v1/lookup` answers for `q`, or `{"error": "...", "status": 400}`
//! for a query that is invalid on its own: the others are answered all the same. A body that
//! is not such an object, or that holds more than [`MAX_BATCH_QUERIES`] queries, is a 400 as
//! a whole. Each query counts as one lookup in `/v1/stats` and `/metrics`.
//!
//! Queries are answered inline while every L2 read they need is served from memory, as a
//! single lookup is; those that would wait on storage are answered together on the blocking
//! pool.

use super::AppState;
use super::applied::Applied;
use super::error::ApiError;
use super::lookup::{
    Answered, Attempt, Prepared, prepare_query, push_json_str, read_body, render_into,
    rendered_size_hint,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::value::RawValue;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// Most queries one batch may hold.
pub const MAX_BATCH_QUERIES: usize = 1024;

#[derive(serde::Deserialize)]
struct Batch<'a> {
    #[serde(borrow)]
    queries: Vec<&'a RawValue>,
}

pub async fn lookup_batch(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let applied = state.applied();
    let answers = match answer_batch(&state, body).await {
        Ok(answers) => answers,
        Err(e) => {
            state.metrics.lookup_errors.fetch_add(1, Relaxed);
            return Err(e);
        }
    };
    let failed = answers.iter().filter(|a| a.is_err()).count();
    state
        .metrics
        .lookup_errors
        .fetch_add(failed as u64, Relaxed);
    let body = render(&answers, applied.as_ref());
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

async fn answer_batch(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Vec<Result<Answered, ApiError>>, ApiError> {
    let body = read_body(state, body)?;
    let prepared = parse(state, &body)?;
    drop(body);
    let mut answers: Vec<Option<Result<Answered, ApiError>>> = Vec::new();
    let mut waiting: Vec<(usize, Prepared)> = Vec::new();
    for (i, query) in prepared.into_iter().enumerate() {
        answers.push(match query.map(|q| q.try_answer(state)) {
            Ok(Attempt::Answered(answered)) => Some(Ok(answered)),
            Ok(Attempt::Declined(query)) => {
                waiting.push((i, query));
                None
            }
            Err(e) => Some(Err(e)),
        });
    }
    if !waiting.is_empty() {
        let index = state.index.clone();
        let answered = tokio::task::spawn_blocking(move || {
            waiting
                .into_iter()
                .map(|(i, query)| (i, query.answer_blocking(&index)))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| ApiError::Unavailable(format!("lookup failed: {e}")))?;
        for (i, (answer, took)) in answered {
            state.metrics.observe_lookup(took);
            answers[i] = Some(Ok(answer));
        }
    }
    Ok(answers
        .into_iter()
        .map(|a| a.expect("every query answered"))
        .collect())
}

/// The batch's queries, each parsed and validated on its own.
fn parse(state: &AppState, body: &[u8]) -> Result<Vec<Result<Prepared, ApiError>>, ApiError> {
    let invalid = |why: &dyn std::fmt::Display| {
        ApiError::bad_request(format!(
            "invalid batch: {why} (expected {{\"queries\": [<lookup body>, ...]}})"
        ))
    };
    // serde would also read a JSON array as a positional struct: insist on an object.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(invalid(&"not a JSON object"));
    }
    let batch: Batch = serde_json::from_slice(body).map_err(|e| invalid(&e))?;
    if batch.queries.len() > MAX_BATCH_QUERIES {
        return Err(ApiError::bad_request(format!(
            "queries: {} queries, at most {MAX_BATCH_QUERIES} per batch",
            batch.queries.len()
        )));
    }
    Ok(batch
        .queries
        .iter()
        .map(|q| prepare_query(state, q.get().as_bytes()))
        .collect())
}

/// `{"answers": [...], "applied"?}`: each answer rendered as `/v1/lookup` renders it but
/// without `applied`, which the batch carries once, each failed query as its error body with
/// its status.
fn render(answers: &[Result<Answered, ApiError>], applied: Option<&Applied>) -> Vec<u8> {
    let size: usize = answers
        .iter()
        .map(|a| a.as_ref().map_or(128, rendered_size_hint))
        .sum();
    let mut out = Vec::with_capacity(16 + size + applied.map_or(0, Applied::size_hint));
    out.extend_from_slice(b"{\"answers\":[");
    for (i, answer) in answers.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        match answer {
            Ok(a) => render_into(a, &mut out),
            Err(e) => {
                out.extend_from_slice(b"{\"error\":");
                push_json_str(&mut out, &e.to_string());
                out.extend_from_slice(b",\"status\":");
                out.extend_from_slice(itoa::Buffer::new().format(e.status().as_u16()).as_bytes());
                out.push(b'}');
            }
        }
    }
    out.push(b']');
    if let Some(applied) = applied {
        applied.render_member(&mut out);
    }
    out.push(b'}');
    out
}
