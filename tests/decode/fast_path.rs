//! The decoders' hot paths against their references.
//!
//! Protobuf: the hand-written reader (`proto::decode_fast`) against prost
//! (`proto::decode_prost`) on randomized `CacheEvent`s and batches built field by field
//! (any order, repeated and unknown fields, packed and unpacked token ids, non-canonical and
//! over-long varints, out-of-range integers, invalid UTF-8, groups, wrong wire types) and on
//! mutations of them: whenever the fast path answers it must answer exactly what prost does,
//! and `proto::decode` (fast path with fallback) must always equal prost, errors included.
//!
//! vLLM: token ids and block hashes in every msgpack integer form decode to the same values
//! as before, and a bad item after a run of good ones still gets the general reader's error.

use crate::support::TestRng as Rng;
use kvindex::event::decode::{DecodeSettings, Format};
use kvindex::event::proto::{decode, decode_fast, decode_prost};
use kvindex::event::{
    BlockContent, DecodeError, EngineHash, Envelope, Event, EventKind, PartitionKey, VllmSettings,
    decode_payload, encode,
};

/// Protobuf wire writer with knobs prost's encoder never turns.
#[derive(Default)]
struct Wire(Vec<u8>);

impl Wire {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    /// `v` as a varint, sometimes padded with redundant continuation bytes (still ≤ 10 bytes,
    /// which prost accepts).
    fn varint_any(&mut self, rng: &mut Rng, v: u64) {
        let len = (64 - v.leading_zeros()).div_ceil(7).max(1) as u64;
        if len < 10 && rng.chance(10) {
            let pad = 1 + rng.below(10 - len);
            let mut rest = v;
            for _ in 0..len + pad - 1 {
                self.0.push((rest as u8 & 0x7f) | 0x80);
                rest >>= 7;
            }
            self.0.push(rest as u8);
        } else {
            self.varint(v);
        }
    }

    fn key(&mut self, field: u32, wire_type: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire_type));
    }

    fn bytes(&mut self, field: u32, data: &[u8]) {
        self.key(field, 2);
        self.varint(data.len() as u64);
        self.0.extend_from_slice(data);
    }
}

/// A value for an integer field: usually small, sometimes anything up to 64 bits (prost
/// truncates) or a negative int as its 10-byte two's complement.
fn int_value(rng: &mut Rng, typical: u64) -> u64 {
    match rng.below(10) {
        0 => rng.next(),
        1 => (-(rng.below(1000) as i64) - 1) as u64,
        2 => rng.below(1 << 35),
        _ => rng.below(typical),
    }
}

fn token(rng: &mut Rng) -> u64 {
    match rng.below(20) {
        0 => rng.next(), // wider than 32 bits: prost keeps the low 32
        1 => rng.below(1 << 32),
        2 => rng.below(128),
        3 => rng.below(1 << 28),
        _ => rng.below(128_000),
    }
}

const STRINGS: [&[u8]; 6] = [
    b"",
    b"vllm-0",
    b"acme",
    b"llama-3-8b",
    "l\u{f6}ra".as_bytes(),
    b"\xff\xfe",
];

/// One randomized `CacheEvent` body: coherent often enough to decode, broken often enough to
/// exercise the fallback. Groups (which the fast path leaves to prost) only with `groups`.
fn random_event(rng: &mut Rng, groups: bool) -> Vec<u8> {
    let blocks = rng.below(5);
    let block_size = 1 + rng.below(4);
    let mut fields: Vec<Vec<u8>> = Vec::new();
    let mut field = |build: &mut dyn FnMut(&mut Wire)| {
        let mut w = Wire::default();
        build(&mut w);
        fields.push(w.0);
    };
    let kind = if rng.chance(85) {
        1 + rng.below(4)
    } else {
        int_value(rng, 8)
    };
    field(&mut |w| {
        w.key(1, 0);
        w.varint_any(rng, kind);
    });
    for f in [2u32, 3, 4, 7] {
        // Replica and model are required by every kind that reaches an engine: present and
        // non-empty most of the time, so both sides of the contract get exercised.
        let named = f == 2 || f == 3;
        if rng.chance(if named { 95 } else { 85 }) {
            let s = if rng.chance(3) {
                STRINGS[5]
            } else {
                STRINGS[rng.below(5) as usize + usize::from(named)]
            };
            field(&mut |w| w.bytes(f, s));
        }
    }
    for _ in 0..blocks {
        let len = match rng.below(20) {
            0 => 0,
            1 => 32,
            2 => 3,
            _ => 8,
        };
        let h: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        field(&mut |w| w.bytes(9, &h));
    }
    for f in [5u32, 10] {
        if rng.chance(50) {
            let h: Vec<u8> = (0..[8, 0, 32][rng.below(3) as usize])
                .map(|_| rng.next() as u8)
                .collect();
            field(&mut |w| w.bytes(f, &h));
        }
    }
    // Token ids: packed in one or more chunks, or unpacked, or a mix.
    let mut count = if rng.chance(80) {
        blocks * block_size
    } else {
        rng.below(12)
    };
    while count > 0 {
        let chunk = 1 + rng.below(count);
        count -= chunk;
        let values: Vec<u64> = (0..chunk).map(|_| token(rng)).collect();
        if rng.chance(70) {
            let mut packed = Wire::default();
            for &v in &values {
                packed.varint_any(rng, v);
            }
            field(&mut |w| w.bytes(11, &packed.0));
        } else {
            for &v in &values {
                field(&mut |w| {
                    w.key(11, 0);
                    w.varint_any(rng, v);
                });
            }
        }
    }
    for (f, typical) in [(6u32, 1 << 60), (8, 2), (13, 5), (14, 1 << 40), (15, 4)] {
        if rng.chance(60) {
            let v = int_value(rng, typical);
            field(&mut |w| {
                w.key(f, 0);
                w.varint_any(rng, v);
            });
        }
    }
    let bs = if rng.chance(90) {
        block_size
    } else {
        int_value(rng, 8)
    };
    field(&mut |w| {
        w.key(12, 0);
        w.varint_any(rng, bs);
    });
    // Unknown fields of every wire type; rarely a group or a known field with a wrong type.
    for _ in 0..rng.below(3) {
        let f = 16 + rng.below(2000) as u32;
        match rng.below(12) {
            0 if groups => field(&mut |w| {
                w.key(f, 3);
                w.key(f + 1, 0);
                w.varint(7);
                w.key(f, 4);
            }),
            1 => field(&mut |w| {
                w.key(1 + rng.below(15) as u32, 5);
                w.0.extend_from_slice(&[1, 2, 3, 4]);
            }),
            2..=4 => {
                let v = int_value(rng, 1000);
                field(&mut |w| {
                    w.key(f, 0);
                    w.varint_any(rng, v);
                })
            }
            5 | 6 => field(&mut |w| {
                w.key(f, 1);
                w.0.extend_from_slice(&rng.next().to_le_bytes());
            }),
            7 | 8 => field(&mut |w| {
                w.key(f, 5);
                w.0.extend_from_slice(&[9, 8, 7, 6]);
            }),
            _ => field(&mut |w| w.bytes(f, b"unknown")),
        }
    }
    // Any order; sometimes a singular field twice (the last one wins).
    for i in (1..fields.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        fields.swap(i, j);
    }
    if rng.chance(10) && !fields.is_empty() {
        let dup = fields[rng.below(fields.len() as u64) as usize].clone();
        fields.push(dup);
    }
    fields.concat()
}

fn random_batch(rng: &mut Rng, groups: bool) -> Vec<u8> {
    let mut w = Wire::default();
    for i in 0..1 + rng.below(4) {
        w.bytes(1, &random_event(rng, groups));
        if i == 0 && rng.chance(10) {
            w.key(2 + rng.below(100) as u32, 0);
            w.varint(42);
        }
    }
    w.0
}

/// The contract: `decode` equals prost exactly; a fast-path answer equals prost's `Ok`.
fn check_against_prost(bytes: &[u8]) -> (bool, bool) {
    let reference = decode_prost(bytes);
    assert_eq!(decode(bytes), reference, "decode vs prost on {bytes:02x?}");
    let fast = decode_fast(bytes);
    if let Some(events) = &fast {
        assert_eq!(
            Ok(events),
            reference.as_ref(),
            "fast path vs prost on {bytes:02x?}"
        );
    }
    (fast.is_some(), reference.is_ok())
}

#[test]
fn proto_fast_path_matches_prost_on_random_messages() {
    let mut rng = Rng::new(0x5eed_1234_abcd_0001);
    for groups in [false, true] {
        let (mut ok, mut fast_ok, mut errors) = (0, 0, 0);
        for i in 0..10_000 {
            let bytes = if i % 4 == 0 {
                random_batch(&mut rng, groups)
            } else {
                random_event(&mut rng, groups)
            };
            if bytes.is_empty() {
                continue;
            }
            let (fast, reference_ok) = check_against_prost(&bytes);
            ok += usize::from(reference_ok);
            fast_ok += usize::from(fast);
            errors += usize::from(!reference_ok);
        }
        // The generator must exercise both sides, and without groups (the one wire feature it
        // leaves to prost) the fast path must answer every body prost accepts.
        assert!(ok > 2_500 && errors > 1_000, "ok {ok}, errors {errors}");
        if !groups {
            assert_eq!(fast_ok, ok, "fast path answered {fast_ok} of {ok}");
        }
    }
}

#[test]
fn proto_fast_path_matches_prost_on_mutations() {
    let mut rng = Rng::new(0x0bad_cafe_f00d_0002);
    for _ in 0..5_000 {
        let mut bytes = if rng.chance(30) {
            random_batch(&mut rng, true)
        } else {
            random_event(&mut rng, true)
        };
        if bytes.is_empty() {
            continue;
        }
        match rng.below(4) {
            0 => bytes.truncate(rng.below(bytes.len() as u64) as usize),
            1 => {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] ^= 1 << rng.below(8);
            }
            2 => {
                let i = rng.below(bytes.len() as u64) as usize;
                bytes[i] = rng.next() as u8;
            }
            _ => bytes.extend_from_slice(&[0x80, 0x80]),
        }
        if !bytes.is_empty() {
            check_against_prost(&bytes);
        }
    }
}

#[test]
fn proto_fast_path_edge_cases() {
    let cases: &[&[u8]] = &[
        // Field number 0, key above 32 bits, wire types 6 and 7.
        &[0x00, 0x01],
        &[0x80, 0x80, 0x80, 0x80, 0x10, 0x01],
        &[0x0e, 0x01],
        &[0x0f],
        // type = 1 as a maximal 10-byte varint, then with a 10th byte of 2 (invalid).
        &[
            0x08, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00,
        ],
        &[
            0x08, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01,
        ],
        &[
            0x08, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02,
        ],
        &[
            0x08, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00,
        ],
        // Packed token ids whose last varint runs past the field / an empty packed field.
        &[0x5a, 0x02, 0x01, 0x81, 0x01],
        &[0x5a, 0x00],
        // A string longer than the body; an empty inner event in a batch; an empty batch field
        // followed by a bare end-group key.
        &[0x12, 0x05, b'a'],
        &[0x0a, 0x00],
        &[0x0a, 0x00, 0x0c],
    ];
    for bytes in cases {
        check_against_prost(bytes);
    }
    assert_eq!(decode_fast(&[]), None);
    assert_eq!(decode(&[]), Err(DecodeError::Empty));
}

fn stored(i: u64, tokens: Vec<u32>) -> Event {
    let mut ev = Event::new(
        EventKind::Stored,
        "vllm-0",
        PartitionKey::new("acme", "m", ""),
    );
    ev.block_hashes = (0..4)
        .map(|b| EngineHash((i * 4 + b).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect();
    ev.parent_hash = Some(EngineHash(i));
    ev.content = BlockContent::Tokens {
        token_ids: tokens,
        block_size: 4,
    };
    ev.seq = i;
    ev
}

#[test]
fn proto_encoder_output_takes_the_fast_path() {
    // Token ids of every varint length from 1 to 5 bytes, including u32::MAX.
    let tokens = vec![
        0,
        127,
        128,
        16_383,
        16_384,
        2_097_151,
        2_097_152,
        268_435_455,
        268_435_456,
        u32::MAX,
        1,
        2,
        3,
        4,
        5,
        6,
    ];
    for events in [
        vec![stored(1, tokens.clone())],
        (0..3).map(|i| stored(i, tokens.clone())).collect(),
    ] {
        let bytes = encode::to_proto(&events);
        assert_eq!(decode_fast(&bytes), Some(events.clone()));
        assert_eq!(decode(&bytes), Ok(events));
    }
}

// --- vLLM msgpack ---

fn vllm_opts() -> DecodeSettings {
    DecodeSettings {
        format: Format::Vllm,
        vllm: VllmSettings {
            model: Some("m".into()),
            tenant: "acme".into(),
            ..VllmSettings::default()
        },
        ..DecodeSettings::default()
    }
}

fn vllm_env() -> Envelope<'static> {
    Envelope {
        engine: Some("vllm-0"),
        ..Envelope::default()
    }
}

/// `[ts, [["BlockStored", hashes, nil, tokens, block_size, nil]]]` with the hash and token
/// arrays given as raw msgpack items.
fn stored_batch(hashes: &[Vec<u8>], tokens: &[Vec<u8>], block_size: u8) -> Vec<u8> {
    let mut b = vec![0x92, 0x00, 0x91, 0x96, 0xab];
    b.extend_from_slice(b"BlockStored");
    b.push(0xdc);
    b.extend_from_slice(&(hashes.len() as u16).to_be_bytes());
    hashes.iter().for_each(|h| b.extend_from_slice(h));
    b.push(0xc0);
    b.push(0xdc);
    b.extend_from_slice(&(tokens.len() as u16).to_be_bytes());
    tokens.iter().for_each(|t| b.extend_from_slice(t));
    b.push(block_size);
    b.push(0xc0);
    b
}

/// Every msgpack form an unsigned integer `v` fits in.
fn uint_forms(v: u64) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    if v < 0x80 {
        out.push(vec![v as u8]);
    }
    if v <= 0xff {
        out.push(vec![0xcc, v as u8]);
    }
    if v <= 0xffff {
        out.push([&[0xcd][..], &(v as u16).to_be_bytes()].concat());
    }
    if v <= 0xffff_ffff {
        out.push([&[0xce][..], &(v as u32).to_be_bytes()].concat());
    }
    out.push([&[0xcf][..], &v.to_be_bytes()].concat());
    if v <= i64::MAX as u64 {
        out.push([&[0xd3][..], &v.to_be_bytes()].concat());
        if v <= 0x7fff_ffff {
            out.push([&[0xd2][..], &(v as u32).to_be_bytes()].concat());
        }
    }
    out
}

fn decode_vllm(bytes: &[u8]) -> Result<Vec<Event>, DecodeError> {
    decode_payload(bytes, &vllm_env(), &vllm_opts()).map(|d| d.events)
}

fn content_tokens(ev: &Event) -> &[u32] {
    match &ev.content {
        BlockContent::Tokens { token_ids, .. } => token_ids,
        other => panic!("no tokens: {other:?}"),
    }
}

#[test]
fn vllm_tokens_and_hashes_in_every_integer_form() {
    let mut rng = Rng::new(0x7007_0003);
    for _ in 0..300 {
        let n = 1 + rng.below(12) as usize;
        let values: Vec<u64> = (0..n)
            .map(|_| {
                [
                    rng.below(128),
                    rng.below(256),
                    rng.below(65_536),
                    rng.below(1 << 32),
                ][rng.below(4) as usize]
            })
            .collect();
        let tokens: Vec<Vec<u8>> = values
            .iter()
            .map(|&v| {
                let forms = uint_forms(v);
                forms[rng.below(forms.len() as u64) as usize].clone()
            })
            .collect();
        let hash_values: Vec<u64> = (0..n)
            .map(|_| {
                if rng.chance(50) {
                    rng.next()
                } else {
                    rng.below(300)
                }
            })
            .collect();
        let mut hashes: Vec<Vec<u8>> = hash_values
            .iter()
            .map(|&v| {
                let forms = uint_forms(v);
                forms[rng.below(forms.len() as u64) as usize].clone()
            })
            .collect();
        // A negative int 64 hash keeps its bits; a negative fixint too.
        hashes[0] = [&[0xd3][..], &(-5i64).to_be_bytes()].concat();
        let mut want_hashes = hash_values.clone();
        want_hashes[0] = -5i64 as u64;
        if n > 1 {
            hashes[1] = vec![0xff];
            want_hashes[1] = u64::MAX;
        }
        let events = decode_vllm(&stored_batch(&hashes, &tokens, 1)).unwrap();
        let want_tokens: Vec<u32> = values.iter().map(|&v| v as u32).collect();
        assert_eq!(content_tokens(&events[0]), want_tokens);
        let got: Vec<u64> = events[0].block_hashes.iter().map(|h| h.0).collect();
        assert_eq!(got, want_hashes);
    }
}

#[test]
fn vllm_bad_token_after_good_ones_keeps_its_error() {
    let good: Vec<Vec<u8>> = vec![vec![0x05], vec![0xcd, 0x12, 0x34], vec![0xce, 0, 1, 0, 0]];
    let hashes: Vec<Vec<u8>> = (0..4).map(|i| vec![i]).collect();
    let cases: [(Vec<u8>, &str); 4] = [
        (
            vec![0xa1, b'x'],
            "expected an unsigned 32-bit integer, got string",
        ),
        (
            vec![0xff],
            "expected an unsigned 32-bit integer, got integer",
        ),
        (
            [&[0xcf][..], &(1u64 << 32).to_be_bytes()].concat(),
            "4294967296 > 2^32-1",
        ),
        (vec![0xc0], "expected an unsigned 32-bit integer, got nil"),
    ];
    for (bad, reason) in cases {
        let tokens = [good.clone(), vec![bad]].concat();
        let e = decode_vllm(&stored_batch(&hashes, &tokens, 1)).unwrap_err();
        assert_eq!(
            e,
            DecodeError::Field {
                field: "token_ids",
                reason: reason.into()
            }
        );
    }
    // A hash of the wrong type after good ones.
    let bad_hashes = vec![
        vec![0x01],
        vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 2],
        vec![0xc2],
        vec![0x04],
    ];
    let e = decode_vllm(&stored_batch(&bad_hashes, &good, 1)).unwrap_err();
    assert_eq!(
        e,
        DecodeError::Field {
            field: "block_hashes",
            reason: "expected an integer or bytes hash, got bool".into()
        }
    );
}

#[test]
fn vllm_token_array_cut_short_is_truncation() {
    let hashes: Vec<Vec<u8>> = vec![vec![1]];
    let tokens: Vec<Vec<u8>> = vec![vec![0xcd, 0x12, 0x34], vec![0xce, 0, 1, 0, 0]];
    let full = stored_batch(&hashes, &tokens, 2);
    let cut_at = full.len() - 4; // inside the uint 32, before block_size / lora_id
    let e = decode_vllm(&full[..cut_at]).unwrap_err();
    assert_eq!(e.reason(), "msgpack");
    assert_eq!(
        content_tokens(&decode_vllm(&full).unwrap()[0]),
        [0x1234, 0x10000]
    );
}
