//! The lookup body's fast path (`api/request/fast.rs`) against the complete serde parser.
//!
//! Bodies are built field by field in random order with random JSON whitespace, from values
//! that are right, wrong in type, out of range, escaped, repeated, unknown or null, and then
//! mutated (truncated, a byte replaced by a JSON-significant one). Whenever the fast path
//! answers, it must answer exactly what the general parser does, errors included; and it must
//! answer for the bodies routers send, or it would accelerate nothing.

use crate::support::TestRng as Rng;
use kvindex::api::request::{parse_lookup, parse_lookup_fast, parse_lookup_general};

fn pick<'a>(rng: &mut Rng, from: &[&'a str]) -> &'a str {
    from[rng.below(from.len() as u64) as usize]
}

/// How far a body strays: `Tame` ones stay mostly within the fast path's subset (and still
/// carry values the validation rejects), `Wild` ones do not.
#[derive(Clone, Copy, PartialEq)]
enum Mood {
    Tame,
    Wild,
}

/// JSON whitespace; a wild body's may be a form feed (which JSON does not allow).
fn ws(rng: &mut Rng, mood: Mood) -> &'static str {
    let spaces = [" ", "\n", "\t ", "\r\n  ", "\u{c}"];
    if rng.chance(70) {
        ""
    } else if mood == Mood::Wild && rng.chance(5) {
        spaces[4]
    } else {
        pick(rng, &spaces[..4])
    }
}

fn token(rng: &mut Rng, mood: Mood) -> String {
    match rng.below(if mood == Mood::Wild { 40 } else { 4_000 }) {
        0 => pick(
            rng,
            &[
                "-1",
                "1.5",
                "1e3",
                "01",
                "4294967296",
                "\"7\"",
                "null",
                "[]",
            ],
        )
        .into(),
        1 => "4294967295".into(),
        2 => "0".into(),
        3 => "18446744073709551616".into(),
        _ => rng.below(200_000).to_string(),
    }
}

fn value(rng: &mut Rng, field: &str, mood: Mood) -> String {
    let common = ["null", "true", "{}", "[1]", "\"x\"", "7", "-3", "2.5"];
    if rng.chance(if mood == Mood::Wild { 15 } else { 2 }) {
        return pick(rng, &common).into();
    }
    match field {
        "model" | "tenant" | "adapter" => {
            // The first four are plain strings; the rest need the general parser.
            let strings = [
                "\"llama-3-8b\"",
                "\"\"",
                "\"naïve-模型\"",
                "\"acme\"",
                "\"a\\\"b\"",
                "\"\\u0041\"",
                "\"tab\there\"",
            ];
            let plain = mood == Mood::Tame && rng.chance(95);
            pick(rng, &strings[..if plain { 4 } else { strings.len() }]).into()
        }
        "token_ids" => {
            let max = if rng.chance(10) { 3 } else { 300 };
            let n = rng.below(max);
            let mut s = String::from("[");
            s += ws(rng, mood);
            for i in 0..n {
                if i > 0 {
                    s += ws(rng, mood);
                    s += ",";
                    s += ws(rng, mood);
                }
                s += &token(rng, mood);
            }
            s += ws(rng, mood);
            s + "]"
        }
        "block_hashes" => pick(rng, &["[1,2]", "[\"00ff\"]", "[-1]", "[]"]).into(),
        "block_size" | "limit" => pick(
            rng,
            &[
                "16",
                "0",
                "1",
                "8",
                "4294967295",
                "4294967296",
                "16.0",
                "1e1",
                "00",
                "\"4\"",
            ],
        )
        .into(),
        _ => pick(rng, &common).into(),
    }
}

fn body(rng: &mut Rng) -> String {
    let mood = if rng.chance(50) {
        Mood::Tame
    } else {
        Mood::Wild
    };
    let mut fields = vec![
        "model",
        "tenant",
        "adapter",
        "token_ids",
        "block_size",
        "limit",
    ];
    fields.retain(|_| rng.chance(80));
    if mood == Mood::Wild && rng.chance(10) {
        fields.push(pick(rng, &["block_hashes", "x", "mod\\u0065l"]));
    }
    if !fields.is_empty() && rng.chance(5) {
        // A repeated field (serde's "duplicate field" error).
        fields.push(fields[rng.below(fields.len() as u64) as usize]);
    }
    for i in (1..fields.len()).rev() {
        fields.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut s = String::new();
    s += ws(rng, mood);
    s += "{";
    for (i, f) in fields.iter().enumerate() {
        if i > 0 {
            s += ",";
        }
        s += ws(rng, mood);
        s += &format!("\"{f}\"");
        s += ws(rng, mood);
        s += ":";
        s += ws(rng, mood);
        s += &value(rng, f, mood);
        s += ws(rng, mood);
    }
    s += "}";
    s += ws(rng, mood);
    s
}

fn mutate(rng: &mut Rng, body: &str) -> Vec<u8> {
    let mut b = body.as_bytes().to_vec();
    match rng.below(3) {
        0 => b.truncate(rng.below(b.len() as u64 + 1) as usize),
        1 if !b.is_empty() => {
            let at = rng.below(b.len() as u64) as usize;
            b[at] = *b"{}[],:\"0 .-e\\n\xff".get(rng.below(15) as usize).unwrap();
        }
        _ => b.extend_from_slice(pick(rng, &[",", "}", " x", "\u{0}"]).as_bytes()),
    }
    b
}

fn answer(
    r: Result<kvindex::api::request::LookupRequest, kvindex::api::request::BadRequest>,
) -> String {
    format!("{:?}", r.map_err(|e| e.to_string()))
}

/// Checks `body` and returns whether the fast path answered.
fn check(body: &[u8]) -> bool {
    let general = answer(parse_lookup_general(body));
    assert_eq!(
        answer(parse_lookup(body)),
        general,
        "parse_lookup differs on {}",
        String::from_utf8_lossy(body)
    );
    match parse_lookup_fast(body) {
        None => false,
        Some(fast) => {
            assert_eq!(
                answer(fast),
                general,
                "the fast path differs on {}",
                String::from_utf8_lossy(body)
            );
            true
        }
    }
}

#[test]
fn the_fast_path_answers_what_the_general_parser_answers() {
    let mut rng = Rng::new(0x100c_0b0d);
    let (mut fast, mut fast_ok, mut mutated_fast) = (0, 0, 0);
    for _ in 0..20_000 {
        let b = body(&mut rng);
        if check(b.as_bytes()) {
            fast += 1;
            fast_ok += usize::from(parse_lookup(b.as_bytes()).is_ok());
        }
        mutated_fast += usize::from(check(&mutate(&mut rng, &b)));
    }
    eprintln!("fast path: {fast} bodies ({fast_ok} valid), {mutated_fast} mutated");
    // The fast path must carry real traffic, good answers and errors alike.
    assert!(
        fast > 2_000,
        "fast path answered only {fast} of 20000 bodies"
    );
    assert!(
        fast_ok > 500,
        "fast path parsed only {fast_ok} valid bodies"
    );
    assert!(
        mutated_fast > 100,
        "fast path answered only {mutated_fast} mutated bodies"
    );
}

#[test]
fn a_router_body_takes_the_fast_path() {
    let tokens: Vec<String> = (0..2048)
        .map(|t| (t * 7919 % 128_000).to_string())
        .collect();
    for body in [
        format!(
            r#"{{"model":"llama-3-8b","tenant":"acme","adapter":"","token_ids":[{}],"limit":8}}"#,
            tokens.join(",")
        ),
        format!(
            "{{\n  \"model\": \"m\",\n  \"token_ids\": [ {} ],\n  \"block_size\": 16\n}}\n",
            tokens.join(", ")
        ),
    ] {
        let r = parse_lookup_fast(body.as_bytes())
            .expect("fast path taken")
            .expect("valid");
        assert_eq!(
            r.query,
            kvindex::api::request::Query::Tokens((0..2048).map(|t| t * 7919 % 128_000).collect())
        );
    }
}
