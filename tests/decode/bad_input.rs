//! Hostile and broken payloads in every encoding: truncated, garbage, wrong-typed, deeply
//! nested, oversized, huge declared lengths, and a deterministic seeded fuzz over mutations
//! of every fixture. Each must come back as a typed [`DecodeError`] (or decode), never panic.

use kvindex::event::decode::{DecodeSettings, Format};
use kvindex::event::{DecodeError, Envelope, VllmSettings, decode_payload};
use kvindex::sim::Rng;
use std::path::{Path, PathBuf};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
const REASONS: [&str; 12] = [
    "empty",
    "too_large",
    "unknown_format",
    "protobuf",
    "json",
    "msgpack",
    "bad_field",
    "too_deep",
    "missing_engine",
    "missing_model",
    "unmapped_lora",
    "other_kv_group",
];

fn opts(format: Format) -> DecodeSettings {
    DecodeSettings {
        format,
        vllm: VllmSettings {
            model: Some("m".into()),
            tenant: "t".into(),
            lora_names: [(1, "a".to_string())].into_iter().collect(),
        },
        ..DecodeSettings::default()
    }
}

fn env() -> Envelope<'static> {
    Envelope {
        engine: Some("e"),
        ..Envelope::default()
    }
}

fn decode(bytes: &[u8], format: Format) -> Result<usize, DecodeError> {
    let d = decode_payload(bytes, &env(), &opts(format))?;
    for s in &d.skipped {
        assert!(REASONS.contains(&s.reason()));
    }
    Ok(d.events.len())
}

fn err(bytes: &[u8], format: Format) -> DecodeError {
    match decode(bytes, format) {
        Ok(n) => panic!(
            "{format}: decoded {n} events from bad input {:02x?}",
            &bytes[..bytes.len().min(64)]
        ),
        Err(e) => {
            assert!(REASONS.contains(&e.reason()), "{e:?}");
            assert!(!e.to_string().is_empty());
            e
        }
    }
}

fn fixtures() -> Vec<(PathBuf, Format)> {
    let mut out = Vec::new();
    for (dir, ext, format) in [
        ("vllm", "msgpack", Format::Vllm),
        ("inference-cache", "pb", Format::Proto),
        ("inference-cache", "json", Format::Json),
    ] {
        for entry in std::fs::read_dir(Path::new(FIXTURES).join(dir)).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|x| x == ext) {
                out.push((p, format));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 12);
    out
}

#[test]
fn empty_and_oversized() {
    for f in [Format::Auto, Format::Proto, Format::Json, Format::Vllm] {
        assert_eq!(err(b"", f), DecodeError::Empty);
        let big = vec![b'['; (4 << 20) + 1];
        assert_eq!(
            err(&big, f),
            DecodeError::TooLarge {
                size: big.len(),
                limit: 4 << 20
            }
        );
    }
    let mut small = opts(Format::Auto);
    small.max_payload_bytes = 8;
    let e = decode_payload(b"[1,2,3,4,5]", &env(), &small).unwrap_err();
    assert_eq!(e.reason(), "too_large");
}

#[test]
fn truncated_fixtures() {
    for (path, format) in fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        let end = bytes.len()
            - bytes
                .iter()
                .rev()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        for cut in 1..end {
            let head = &bytes[..cut];
            match format {
                // A protobuf prefix cut at a field boundary is itself a valid message.
                Format::Proto => {
                    let _ = decode(head, Format::Auto);
                    let _ = decode(head, Format::Proto);
                }
                _ => {
                    let e = err(head, Format::Auto);
                    let want = if format == Format::Json {
                        "json"
                    } else {
                        "msgpack"
                    };
                    assert_eq!(e.reason(), want, "{} cut at {cut}: {e}", path.display());
                    err(head, format);
                }
            }
        }
    }
}

#[test]
fn garbage() {
    let cases: &[&[u8]] = &[
        b"hello world",
        b"\xc1",
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        b"{]",
        b"[1, 2, 3]",
        b"{\"type\": \"PREFIX_ADDED\"} trailing",
        b"\x0a\xff\xff\xff\xff\x0f",
        b"\x08",
        b"\x92\xcb\x41\xda\x55\x6e\x40\x10\x00\x00\xdd\xff\xff\xff\xff",
        b"\x92\xc0\x91\xc6\xff\xff\xff\xff",
        b"\x92\xc0\x90\x00",
        b"\x90",
        b"\xc0",
    ];
    for case in cases {
        err(case, Format::Auto);
    }
    for f in [Format::Proto, Format::Json, Format::Vllm] {
        err(b"\x00\x01\x02 not a payload \xfe", f);
    }
    assert_eq!(err(b"[1]", Format::Json).reason(), "json");
    assert_eq!(err(b"\x92\xc0\x90\x00", Format::Auto).reason(), "msgpack");
}

#[test]
fn wrong_typed_fields_name_the_field() {
    let json_cases: &[(&str, &str)] = &[
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_size":"16"}"#,
            "block_size",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":[true]}"#,
            "block_hashes",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":["zz"]}"#,
            "block_hashes",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":[-5]}"#,
            "block_hashes",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":[""]}"#,
            "block_hashes",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","token_ids":[-1]}"#,
            "token_ids",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":[1],"token_ids":[1,2]}"#,
            "block_size",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","block_hashes":[1],"token_ids":[1,2],"block_size":4}"#,
            "token_ids",
        ),
        (r#"{"type":"PREFIX_ADDED","replica_id":""}"#, "replica_id"),
        (r#"{"type":"PREFIX_EVICTED"}"#, "replica_id"),
        (r#"{"type":7,"replica_id":"r"}"#, "type"),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","dp_rank":4294967296}"#,
            "dp_rank",
        ),
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r","seq":1,"seq":2}"#,
            "seq",
        ),
    ];
    for (doc, field) in json_cases {
        match err(doc.as_bytes(), Format::Auto) {
            DecodeError::Field { field: f, .. } => assert_eq!(f, *field, "{doc}"),
            other => panic!("{doc}: {other:?}"),
        }
    }
    // In an array, the bad event is skipped (its field named) and the others decode.
    let d = decode_payload(
        br#"[{"type":"PREFIX_ADDED","replica_id":"r","model_id":"m"},{"type":"PREFIX_ADDED","adapter_scoped":1}]"#,
        &env(),
        &opts(Format::Auto),
    )
    .unwrap();
    assert_eq!(d.events.len(), 1);
    assert!(
        matches!(
            &d.skipped[..],
            [DecodeError::Field {
                field: "adapter_scoped",
                ..
            }]
        ),
        "{:?}",
        d.skipped
    );
    // An unknown type name is an Unknown event, not an error; unknown fields are ignored.
    assert_eq!(
        decode(br#"{"type":"PREFIX_MOVED","new":{"x":[1]}}"#, Format::Json),
        Ok(1)
    );
    // Non-object array elements are rejected clearly.
    let e = err(
        br#"[{"type":"ALL_CLEARED","replica_id":"r"}, 5]"#,
        Format::Auto,
    );
    assert!(e.to_string().contains("CacheEvent JSON object"), "{e}");

    // vLLM: BlockStored with block_size as a string, a float hash, a negative token id.
    let ts = [0xcb, 0x41, 0xda, 0x55, 0x6e, 0x40, 0x10, 0x00, 0x00];
    let stored = |fields: &[u8]| {
        let mut b = vec![0x92];
        b.extend_from_slice(&ts);
        b.extend_from_slice(&[0x91, 0x96, 0xab]);
        b.extend_from_slice(b"BlockStored");
        b.extend_from_slice(fields);
        b
    };
    let cases: &[(&[u8], &str)] = &[
        (
            &[0x91, 0x01, 0xc0, 0x90, 0xa2, b'1', b'6', 0xc0],
            "block_size",
        ),
        (
            &[0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xc0, 0x90, 0x10, 0xc0],
            "block_hashes",
        ),
        (&[0x91, 0x01, 0xc0, 0x91, 0xff, 0x01, 0xc0], "token_ids"),
        (&[0x91, 0x01, 0xc0, 0x90, 0x10, 0xa1, b'x'], "lora_id"),
        (&[0x01, 0xc0, 0x90, 0x10, 0xc0], "block_hashes"),
        (&[0x91, 0x01, 0xc3, 0x90, 0x10, 0xc0], "parent_block_hash"),
    ];
    for (fields, field) in cases {
        match err(&stored(fields), Format::Auto) {
            DecodeError::Field { field: f, .. } => assert_eq!(f, *field),
            other => panic!("{fields:02x?}: {other:?}"),
        }
    }
    // Token count not matching blocks × block_size: that event is skipped, not the batch.
    let d = decode_payload(
        &stored(&[0x91, 0x01, 0xc0, 0x92, 0x01, 0x02, 0x10, 0xc0]),
        &env(),
        &opts(Format::Vllm),
    )
    .unwrap();
    assert!(d.events.is_empty());
    assert_eq!(d.skipped.len(), 1);
    assert_eq!(d.skipped[0].reason(), "bad_field");
    // Unknown event tags decode as Unknown(-1) events.
    let mut unknown = vec![0x92];
    unknown.extend_from_slice(&ts);
    unknown.extend_from_slice(&[0x91, 0x92, 0xa4]);
    unknown.extend_from_slice(b"Nope");
    unknown.push(0x07);
    assert_eq!(decode(&unknown, Format::Vllm), Ok(1));
}

#[test]
fn deeply_nested() {
    const N: usize = 100_000;
    // Events are objects, so nested arrays fail at the first element, before any recursion.
    let json_arrays = "[".repeat(N);
    assert_eq!(err(json_arrays.as_bytes(), Format::Auto).reason(), "json");
    let closed = format!("{}{}", "[".repeat(N), "]".repeat(N));
    assert_eq!(err(closed.as_bytes(), Format::Json).reason(), "json");
    let in_field = format!("{{\"block_hashes\":{}", "[".repeat(N));
    err(in_field.as_bytes(), Format::Auto);
    let json_objects = format!(
        "{{\"type\":\"ALL_CLEARED\",\"replica_id\":\"r\",\"x\":{}1{}}}",
        "[".repeat(N),
        "]".repeat(N)
    );
    // An ignored field may nest arbitrarily (serde_json skips it iteratively).
    let _ = decode(json_objects.as_bytes(), Format::Auto);

    let msgpack_arrays = vec![0x91; N];
    err(&msgpack_arrays, Format::Auto);
    err(&msgpack_arrays, Format::Vllm);
    let msgpack_maps: Vec<u8> = std::iter::repeat_n([0x81, 0xa1, b'k'], N)
        .flatten()
        .collect();
    err(&msgpack_maps, Format::Auto);

    // Deep nesting inside an ignored field of a named vLLM event.
    let mut b = vec![0x92, 0xc0, 0x91, 0x82, 0xa4];
    b.extend_from_slice(b"type");
    b.push(0xb0);
    b.extend_from_slice(b"AllBlocksCleared");
    b.push(0xaa);
    b.extend_from_slice(b"extra_keys");
    b.extend(std::iter::repeat_n(0x91, N));
    b.push(0x00);
    assert_eq!(
        err(&b, Format::Vllm),
        DecodeError::TooDeep(kvindex::event::vllm::MAX_DEPTH)
    );

    // Protobuf: a batch whose event claims to hold a deeper batch is just a bad message.
    let mut pb = Vec::new();
    for _ in 0..200 {
        pb.splice(0..0, [0x0a, pb.len().min(127) as u8]);
    }
    let _ = decode(&pb, Format::Auto);
}

#[test]
fn huge_declared_lengths() {
    // msgpack: array32 / map32 / bin32 / str32 claiming 4 G items in a few bytes.
    for marker in [0xdd, 0xdf, 0xc6, 0xdb] {
        let mut b = vec![0x92, 0xc0, 0x91, marker, 0xff, 0xff, 0xff, 0xff];
        b.extend_from_slice(&[0u8; 16]);
        assert_eq!(err(&b, Format::Vllm).reason(), "msgpack");
    }
    // protobuf: a length-delimited field claiming 2^32 bytes.
    let b = [0x12, 0x80, 0x80, 0x80, 0x80, 0x10, b'r'];
    assert_eq!(err(&b, Format::Auto).reason(), "protobuf");
    // JSON with a gigantic number.
    let e = err(
        br#"{"type":"PREFIX_ADDED","replica_id":"r","seq":1e400}"#,
        Format::Json,
    );
    assert!(matches!(e.reason(), "json" | "bad_field"));
}

fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len());
        match rng.below(6) {
            0 if !b.is_empty() => b[at] ^= 1 << rng.below(8),
            1 if !b.is_empty() => b[at] = rng.next_u64() as u8,
            2 => b.insert(at, rng.next_u64() as u8),
            3 if !b.is_empty() => {
                b.remove(at);
            }
            4 if !b.is_empty() => {
                b[at] = [0x00, 0x7f, 0x80, 0xc0, 0xcf, 0xdd, 0xff, b'[', b'"'][rng.below(9)]
            }
            _ => b.truncate(at),
        }
    }
    b
}

#[test]
fn fuzz_mutations_never_panic() {
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    for (path, format) in fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        for _ in 0..3000 {
            let m = mutate(&mut rng, &bytes);
            for f in [Format::Auto, format] {
                if let Err(e) = decode(&m, f) {
                    assert!(REASONS.contains(&e.reason()));
                }
            }
        }
    }
    for _ in 0..5000 {
        let len = rng.below(256);
        let b: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        for f in [Format::Auto, Format::Proto, Format::Json, Format::Vllm] {
            if let Err(e) = decode(&b, f) {
                assert!(REASONS.contains(&e.reason()));
            }
        }
    }
}

#[test]
fn one_bad_event_in_a_batch_skips_only_that_event() {
    use kvindex::event::{Event, EventKind, PartitionKey, encode};
    let good = |engine: &str| {
        let mut ev = Event::new(EventKind::Removed, engine, PartitionKey::new("t", "m", ""));
        ev.block_hashes = vec![kvindex::event::EngineHash(7)];
        ev
    };
    // Protobuf: the middle event has no replica id.
    let events = [good("a"), good(""), good("c")];
    let d = decode_payload(&encode::to_proto(&events), &env(), &opts(Format::Auto)).unwrap();
    let engines: Vec<&str> = d.events.iter().map(|e| e.engine.as_str()).collect();
    assert_eq!(engines, ["a", "c"]);
    assert_eq!(d.skipped.len(), 1);
    assert_eq!(d.skipped[0].reason(), "bad_field");
    // JSON: one event with a wrong-typed field, one without a replica id.
    let body =
        br#"[{"type":"PREFIX_EVICTED","replica_id":"a","model_id":"m","block_hashes":["07"]},
        {"type":"PREFIX_ADDED","replica_id":"r","model_id":"m","block_size":"16"},
        {"type":"PREFIX_EVICTED","replica_id":"","model_id":"m","block_hashes":["07"]},
        {"type":"PREFIX_EVICTED","replica_id":"d","model_id":"m","block_hashes":["07"]}]"#;
    for format in [Format::Auto, Format::Json] {
        let d = decode_payload(body, &env(), &opts(format)).unwrap();
        let engines: Vec<&str> = d.events.iter().map(|e| e.engine.as_str()).collect();
        assert_eq!(engines, ["a", "d"], "{format}");
        let reasons: Vec<&str> = d.skipped.iter().map(DecodeError::reason).collect();
        assert_eq!(reasons, ["bad_field", "bad_field"], "{format}");
    }
    // Names: a model for every event that changes memberships, a replica for every event
    // that reaches an engine (heartbeats too), and no name longer than 256 bytes.
    let long = "x".repeat(257);
    for (doc, field) in [
        (
            r#"{"type":"PREFIX_ADDED","replica_id":"r"}"#.to_string(),
            "model_id",
        ),
        (
            r#"{"type":"ALL_CLEARED","replica_id":"r","model_id":""}"#.to_string(),
            "model_id",
        ),
        (
            r#"{"type":"REPLICA_UPDATED","model_id":"m"}"#.to_string(),
            "replica_id",
        ),
        (
            format!(r#"{{"type":"PREFIX_ADDED","replica_id":"r","model_id":"{long}"}}"#),
            "model_id",
        ),
        (
            format!(r#"{{"type":"PREFIX_ADDED","replica_id":"{long}","model_id":"m"}}"#),
            "replica_id",
        ),
    ] {
        match decode_payload(doc.as_bytes(), &env(), &opts(Format::Json)) {
            Err(DecodeError::Field { field: f, .. }) => assert_eq!(f, field, "{doc}"),
            other => panic!("{doc}: {other:?}"),
        }
    }
    // A heartbeat needs no model.
    assert_eq!(
        decode(
            br#"{"type":"REPLICA_UPDATED","replica_id":"r"}"#,
            Format::Json
        ),
        Ok(1)
    );
    // Broken framing still fails the whole payload.
    assert!(
        decode(
            br#"[{"type":"PREFIX_EVICTED","replica_id":"a"},"#,
            Format::Json
        )
        .is_err()
    );
}
