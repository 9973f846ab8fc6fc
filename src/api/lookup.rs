//! `POST /v1/lookup`: which engines hold the longest cached prefix of a query.
//!
//! The body is read as JSON whatever its `Content-Type` says (callers such as `curl -d` send
//! form types by default; the body is the contract), parsed by [`super::request`], and answered
//! from the index inline on the async worker: a typical lookup takes ~10 µs and even the largest
//! allowed query (1M tokens) is about a millisecond of hashing, less than the cost of handing
//! work to `spawn_blocking` and back. Once blocks live only in L2, a lookup may read RocksDB:
//! inline still while RocksDB can answer from memory, on the blocking pool once a read would
//! wait on storage (see [`answer`]). Shard read locks are held only for the scan of each shard
//! (never across an L2 read), and writers hold theirs only per applied batch.

use super::AppState;
use super::applied::Applied;
use super::error::ApiError;
use super::request::{Query, parse_lookup};
use crate::event::Tier;
use crate::index::{LookupOptions, QueryBlocks};
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

pub async fn lookup(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Read before the index: a floor of what the answer reflects (see `applied.rs`).
    let applied = state.applied();
    let answered = match prepare(&state, body) {
        Ok(query) => answer(&state, query).await,
        Err(e) => Err(e),
    };
    if answered.is_err() {
        state.metrics.lookup_errors.fetch_add(1, Relaxed);
    }
    let body = render(&answered?, applied.as_ref());
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// The answer as the JSON body `schemas/openapi.yaml` calls `LookupResponse`:
/// `{"model", "tenant", "adapter", "query_blocks", "block_size", "engines": [{"engine_id",
/// "matched_blocks", "matched_tokens", "tier", "blocks_by_tier": {"GPU", "CPU", "DISK"},
/// "score"?}, ..], "applied"?}` (`block_size` and `matched_tokens` are `null` for a hash query
/// of a model whose block size is unknown; `score` is there when the request gave
/// `tier_weights`; `applied`, when the index has a source, is `applied.rs`'s).
///
/// Written by hand rather than through serde: answers of a busy fleet name hundreds of
/// engines, and serde's per-field calls and per-byte string escaping were the largest cost of
/// a lookup over HTTP (a third of the server's CPU under `kvindex bench http`). Strings take
/// one scan for bytes that need escaping and are copied whole when none does (the usual case).
fn render(a: &Answered, applied: Option<&Applied>) -> Vec<u8> {
    let hint = rendered_size_hint(a) + applied.map_or(0, Applied::size_hint);
    let mut out = Vec::with_capacity(hint);
    render_into(a, &mut out);
    if let Some(applied) = applied {
        out.pop(); // the closing brace
        applied.render_member(&mut out);
        out.push(b'}');
    }
    out
}

/// About how many bytes [`render`] writes for `a`.
/// A little over: growing a buffer of a thousand rows copies it again at every doubling.
pub(super) fn rendered_size_hint(a: &Answered) -> usize {
    // A row without its engine id: keys, punctuation and up to ~20 digits of counts.
    const ROW_BYTES: usize = 128;
    const SCORE_BYTES: usize = 32;
    let p = &a.partition;
    let per_row = ROW_BYTES + if a.answer.is_scored() { SCORE_BYTES } else { 0 };
    160 + p.model.len()
        + p.tenant.len()
        + p.adapter.len()
        + a.answer.len() * per_row
        + a.answer.engine_id_bytes()
}

/// [`render`], appending to `out`.
pub(super) fn render_into(a: &Answered, out: &mut Vec<u8>) {
    let p = &a.partition;
    let mut num = itoa::Buffer::new();
    out.extend_from_slice(b"{\"model\":");
    push_json_str(out, &p.model);
    out.extend_from_slice(b",\"tenant\":");
    push_json_str(out, &p.tenant);
    out.extend_from_slice(b",\"adapter\":");
    push_json_str(out, &p.adapter);
    out.extend_from_slice(b",\"query_blocks\":");
    out.extend_from_slice(num.format(a.query_blocks).as_bytes());
    out.extend_from_slice(b",\"block_size\":");
    match a.block_size {
        Some(bs) => out.extend_from_slice(num.format(bs).as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"engines\":[");
    for (i, m) in a.answer.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"engine_id\":");
        push_json_str(out, m.engine_id);
        out.extend_from_slice(b",\"matched_blocks\":");
        out.extend_from_slice(num.format(m.matched_blocks).as_bytes());
        out.extend_from_slice(b",\"matched_tokens\":");
        match a.block_size {
            Some(bs) => out.extend_from_slice(
                num.format(u64::from(m.matched_blocks) * u64::from(bs))
                    .as_bytes(),
            ),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"tier\":\"");
        out.extend_from_slice(m.tier.as_str().as_bytes());
        out.extend_from_slice(b"\",\"blocks_by_tier\":{");
        for (t, tier) in Tier::ALL.into_iter().enumerate() {
            if t > 0 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(tier.as_str().as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(num.format(m.blocks_on[t]).as_bytes());
        }
        out.push(b'}');
        if let Some(score) = m.score {
            out.extend_from_slice(b",\"score\":");
            // Finite (weights are checked finite, counts are integers): always a JSON number.
            out.extend_from_slice(ryu::Buffer::new().format_finite(score).as_bytes());
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
}

/// Appends `s` as a JSON string literal (RFC 8259: `"` and `\` escaped, control characters
/// as `\u00XX` or their short forms; everything else, UTF-8 included, as is).
pub(super) fn push_json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0x00..=0x1f => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if short == 0 {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.push(b'\\');
            out.push(short);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A lookup answered, before serialization.
pub(super) struct Answered {
    partition: crate::event::PartitionKey,
    query_blocks: usize,
    block_size: Option<u32>,
    answer: crate::index::Answer,
}

/// A lookup parsed, its block keys computed.
pub(super) struct Prepared {
    partition: crate::event::PartitionKey,
    block_size: Option<u32>,
    keys: Vec<u64>,
    options: LookupOptions,
    start: Instant,
}

/// Answers `query` on the async worker when no L2 read it needs waits on storage (the usual
/// case, spilled or not: RocksDB's filters say "absent" from memory, and hot rows are in its
/// block cache), else on the blocking pool, where a read may wait on the disk.
async fn answer(state: &AppState, query: Prepared) -> Result<Answered, ApiError> {
    match query.try_answer(state) {
        Attempt::Answered(answered) => Ok(answered),
        Attempt::Declined(query) => {
            let index = state.index.clone();
            let answered = tokio::task::spawn_blocking(move || query.answer_blocking(&index))
                .await
                .map_err(|e| ApiError::Unavailable(format!("lookup failed: {e}")))?;
            state.metrics.observe_lookup(answered.1);
            Ok(answered.0)
        }
    }
}

/// What [`Prepared::try_answer`] did.
pub(super) enum Attempt {
    Answered(Answered),
    /// An L2 read would wait on storage: answer it with [`Prepared::answer_blocking`] where
    /// blocking is allowed.
    Declined(Prepared),
}

impl Prepared {
    /// The answer if no L2 read it needs waits on storage; else the query back.
    pub(super) fn try_answer(self, state: &AppState) -> Attempt {
        match state.index.try_lookup_keys_with(&self.keys, &self.options) {
            Some(answer) => {
                state
                    .metrics
                    .observe_lookup(self.start.elapsed().as_secs_f64());
                Attempt::Answered(self.answered(answer))
            }
            None => Attempt::Declined(self),
        }
    }

    /// The answer, reading L2 from storage where it must (blocking), and the seconds it took
    /// since the query was parsed (for the lookup latency histogram).
    pub(super) fn answer_blocking(self, index: &crate::index::Index) -> (Answered, f64) {
        let answer = index.lookup_keys_with(&self.keys, &self.options);
        let took = self.start.elapsed().as_secs_f64();
        (self.answered(answer), took)
    }

    fn answered(self, answer: crate::index::Answer) -> Answered {
        Answered {
            partition: self.partition,
            query_blocks: self.keys.len(),
            block_size: self.block_size,
            answer,
        }
    }
}

fn prepare(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Prepared, ApiError> {
    prepare_query(state, &read_body(state, body)?)
}

/// The request body, or the error that names why it could not be read.
pub(super) fn read_body(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
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
    })
}

/// One lookup body parsed and validated, its block keys computed.
pub(super) fn prepare_query(state: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let req = parse_lookup(body)?;
    let p = &req.partition;
    let learned = || state.index.block_size(&p.tenant, &p.model);
    let (blocks, block_size) = match req.query {
        Query::Tokens(token_ids) => {
            let bs = req
                .block_size
                .or_else(learned)
                .or((state.default_block_size > 0).then_some(state.default_block_size))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "block_size: unknown for model `{}` (tenant `{}`): no event with token ids has told kvindex its block size; pass `block_size`",
                        p.model, p.tenant
                    ))
                })?;
            let blocks = token_ids.len() / bs as usize;
            let extras = crate::event::extra::request_extras(
                blocks,
                bs as usize,
                &req.mm_inputs,
                &req.cache_salt,
            );
            (
                QueryBlocks::Tokens {
                    token_ids,
                    block_size: bs,
                    extras: crate::event::extra::digests(&extras),
                },
                Some(bs),
            )
        }
        Query::Hashes(hashes) => (QueryBlocks::Hashes(hashes), req.block_size.or_else(learned)),
    };
    let start = Instant::now();
    let limit = req.limit.unwrap_or(usize::MAX);
    let heard_since = req.max_idle_s.map(|s| {
        crate::util::now_us().saturating_sub(
            i64::try_from(s)
                .unwrap_or(i64::MAX)
                .saturating_mul(1_000_000),
        )
    });
    let options = LookupOptions {
        limit,
        heard_since_us: heard_since,
        tier_weights: req.tier_weights,
    };
    Ok(Prepared {
        keys: state.index.query_keys(p, &blocks),
        partition: req.partition,
        block_size,
        options,
        start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::PartitionKey;
    use serde_json::{Value, json};

    #[test]
    fn strings_are_escaped_exactly_as_json_requires() {
        for s in [
            "",
            "engine-001",
            "quote\" backslash\\ slash/",
            "tab\t newline\n cr\r bs\u{8} ff\u{c} nul\u{0} unit\u{1f} del\u{7f}",
            "ünïcödé ✓ 𝄞",
        ] {
            let mut out = Vec::new();
            push_json_str(&mut out, s);
            let back: String = serde_json::from_slice(&out)
                .unwrap_or_else(|e| panic!("{s:?} rendered as invalid JSON {out:?}: {e}"));
            assert_eq!(back, s);
        }
    }

    #[test]
    fn an_empty_answer_renders_as_the_documented_object() {
        for (block_size, want) in [(Some(16), json!(16)), (None, Value::Null)] {
            let a = Answered {
                partition: PartitionKey::new("t\"1", "m", ""),
                query_blocks: 3,
                block_size,
                answer: crate::index::Answer::default(),
            };
            let got: Value = serde_json::from_slice(&render(&a, None)).expect("valid JSON");
            assert_eq!(
                got,
                json!({"model": "m", "tenant": "t\"1", "adapter": "", "query_blocks": 3,
                       "block_size": want, "engines": []})
            );
        }
    }
}
