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
//! The body is read once: the queries' bounds are found by counting brackets (a batch's
//! token ids are passed over a word at a time), and each query is parsed by the lookup
//! parser; serde reads the body whole only when a query is not JSON, to word the error (see
//! [`parse`]).
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
    // The usual batch in one pass: its queries found by bracket matching, each read once by
    // the lookup parser. A query that failed is that query's 400 if it is JSON (then every
    // query is, the split is serde's, and serde's path would answer the same), else the
    // batch's, which serde's path below words.
    if let Some(queries) = split_queries(body) {
        let prepared: Vec<_> = queries.iter().map(|q| prepare_query(state, q)).collect();
        let is_json = |q: &[u8]| serde_json::from_slice::<serde::de::IgnoredAny>(q).is_ok();
        if prepared
            .iter()
            .zip(&queries)
            .all(|(p, q)| p.is_ok() || is_json(q))
        {
            return Ok(prepared);
        }
    }
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

/// The queries of a batch body laid out as `{"queries": [{...}, ...]}` (JSON whitespace
/// anywhere), as the bytes of each object, found by counting brackets outside strings without
/// reading the queries' numbers; `None` for any other layout (another or an escaped key, a
/// query that is not an object, more than [`MAX_BATCH_QUERIES`] queries, unbalanced
/// brackets), which serde then reads and words.
///
/// Only the split is trusted here, not the JSON inside a query: each query is then read on
/// its own, and once every one of them is known to be valid JSON, its closing bracket is the
/// one counted here and the queries are exactly those serde would have given.
fn split_queries(body: &[u8]) -> Option<Vec<&[u8]>> {
    let skip_ws = |mut i: usize| {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = body.get(i) {
            i += 1;
        }
        i
    };
    let mut i = skip_ws(0);
    for expected in [&b"{"[..], b"\"queries\"", b":", b"["] {
        if !body.get(i..)?.starts_with(expected) {
            return None;
        }
        i = skip_ws(i + expected.len());
    }
    let mut queries = Vec::new();
    if body.get(i) == Some(&b']') {
        i = skip_ws(i + 1);
    } else {
        loop {
            if body.get(i) != Some(&b'{') || queries.len() == MAX_BATCH_QUERIES {
                return None;
            }
            let end = object_end(body, i)?;
            queries.push(&body[i..end]);
            i = skip_ws(end);
            match body.get(i) {
                Some(b',') => i = skip_ws(i + 1),
                Some(b']') => {
                    i = skip_ws(i + 1);
                    break;
                }
                _ => return None,
            }
        }
    }
    (body.get(i) == Some(&b'}') && skip_ws(i + 1) == body.len()).then_some(queries)
}

/// The index just past the object or array that opens at `start`: brackets counted, strings
/// (escapes included) skipped, and runs of 8 bytes that hold no bracket, quote or backslash
/// (a token array's digits, commas and spaces) passed over a word at a time. `None` if the
/// body ends first.
fn object_end(body: &[u8], start: usize) -> Option<usize> {
    const LOW_SEVEN: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut depth = 0usize;
    let mut i = start;
    loop {
        if let Some(word) = body.get(i..i + 8) {
            let w = u64::from_le_bytes(word.try_into().ok()?);
            // High bit of a byte set iff it is ≥ b'[' (brackets, braces, backslash, letters)
            // or a quote (0x22); digits, commas and whitespace are neither.
            let high = ((w & LOW_SEVEN) + 0x2525_2525_2525_2525) | w;
            let quote = w ^ 0x2222_2222_2222_2222;
            let not_quote = ((quote & LOW_SEVEN) + LOW_SEVEN) | quote;
            if (high | !not_quote) & HIGH == 0 {
                i += 8;
                continue;
            }
        }
        match *body.get(i)? {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            b'"' => loop {
                i += 1;
                match *body.get(i)? {
                    b'\\' => i += 1,
                    b'"' => break,
                    _ => {}
                }
            },
            _ => {}
        }
        i += 1;
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::sim::Rng;

    fn pick<'a>(rng: &mut Rng, from: &[&'a str]) -> &'a str {
        from[rng.below(from.len())]
    }

    fn ws(rng: &mut Rng) -> &'static str {
        pick(rng, &["", "", "", " ", "\n  ", "\t", "\r\n"])
    }

    /// A query object whose strings hold brackets, quotes and escapes, with nested arrays and
    /// token arrays long enough to be passed over a word at a time.
    fn query(rng: &mut Rng) -> String {
        let strings = [
            r#""llama""#,
            r#""a]b}c""#,
            r#""q\"{[""#,
            r#""back\\""#,
            r#""\u005d""#,
            r#""""#,
        ];
        let mut members = Vec::new();
        for _ in 0..rng.below(4) {
            let value = match rng.below(4) {
                0 => pick(rng, &strings).to_owned(),
                1 => {
                    let n = rng.below(40);
                    let ids: Vec<String> = (0..n).map(|_| rng.below(200_000).to_string()).collect();
                    format!("[{}]", ids.join(pick(rng, &[",", ", ", " , "])))
                }
                2 => format!("[[{}],{{\"x\":[]}}]", pick(rng, &strings)),
                _ => pick(rng, &["null", "16", "true", "{}"]).to_owned(),
            };
            members.push(format!(
                "{}{}:{}{}",
                pick(rng, &strings),
                ws(rng),
                ws(rng),
                value
            ));
        }
        format!("{{{}{}}}", ws(rng), members.join(","))
    }

    fn batch(rng: &mut Rng) -> String {
        let queries: Vec<String> = (0..rng.below(6)).map(|_| query(rng)).collect();
        let sep = format!("{},{}", ws(rng), ws(rng));
        format!(
            "{}{{{}\"queries\"{}:{}[{}{}{}]{}}}{}",
            ws(rng),
            ws(rng),
            ws(rng),
            ws(rng),
            ws(rng),
            queries.join(&sep),
            ws(rng),
            ws(rng),
            ws(rng)
        )
    }

    /// The queries serde reads from `body`, as their text.
    fn by_serde(body: &[u8]) -> Option<Vec<String>> {
        let batch: Batch = serde_json::from_slice(body).ok()?;
        Some(batch.queries.iter().map(|q| q.get().to_owned()).collect())
    }

    fn text(queries: &[&[u8]]) -> Vec<String> {
        queries
            .iter()
            .map(|q| String::from_utf8(q.to_vec()).expect("utf-8"))
            .collect()
    }

    #[test]
    fn the_split_is_serdes_wherever_the_queries_are_json() {
        let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut split_count = 0;
        for round in 0..20_000 {
            let mut body = batch(&mut rng).into_bytes();
            let whole = round % 2 == 0;
            if !whole {
                // Truncated, or one byte replaced by a JSON-significant one.
                let at = rng.below(body.len());
                match rng.below(2) {
                    0 => body.truncate(at),
                    _ => body[at] = *b"{}[],:\"\\ 0x".get(rng.below(11)).unwrap(),
                }
            }
            let serde = by_serde(&body);
            match split_queries(&body) {
                Some(queries) => {
                    split_count += 1;
                    let valid = queries
                        .iter()
                        .all(|q| serde_json::from_slice::<serde_json::Value>(q).is_ok());
                    // An unmutated batch is always valid: its split must be serde's.
                    if valid || whole {
                        assert_eq!(
                            Some(text(&queries)),
                            serde,
                            "{}",
                            String::from_utf8_lossy(&body)
                        );
                    }
                }
                None => assert!(
                    !whole,
                    "an unmutated batch was not split: {}",
                    String::from_utf8_lossy(&body)
                ),
            }
        }
        assert!(split_count > 10_000, "{split_count}");
    }

    #[test]
    fn other_layouts_are_left_to_serde() {
        for body in [
            r#"[{"queries": []}]"#,
            r#"{"queries": [], "x": 1}"#,
            r#"{"x": 1, "queries": []}"#,
            r#"{"quer\u0069es": []}"#,
            r#"{"queries": [[]]}"#,
            r#"{"queries": [null]}"#,
            r#"{"queries": [{"a": "}"]"#,
            r#"{"queries": [{}] } x"#,
        ] {
            assert_eq!(split_queries(body.as_bytes()), None, "{body}");
        }
        let many = format!(
            "{{\"queries\": [{}]}}",
            vec!["{}"; MAX_BATCH_QUERIES + 1].join(",")
        );
        assert_eq!(split_queries(many.as_bytes()), None);
        let most = format!(
            "{{\"queries\": [{}]}}",
            vec!["{}"; MAX_BATCH_QUERIES].join(",")
        );
        assert_eq!(
            split_queries(most.as_bytes()).map(|q| q.len()),
            Some(MAX_BATCH_QUERIES)
        );
    }
}
