//! Decode throughput benchmarks (criterion): protobuf `CacheEvent` and a vLLM msgpack
//! `BlockStored` batch, reported as events/s. Target: ≥ 1 M events/s per core. Also the
//! lookup body parser (`lookup_body`), fast path against serde, in tokens/s.
//!
//! Each bench decodes one payload over and over, so the CPU's branch predictor ends up knowing
//! its varint / msgpack-marker lengths by heart; the `_varied` twins cycle through payloads of
//! pseudo-random token ids to show the decoders do not depend on that.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvindex::event::decode::DecodeSettings;
use kvindex::event::{
    BlockContent, EngineHash, Envelope, Event, EventKind, PartitionKey, decode_payload, encode,
};
use std::hint::black_box;

const BLOCKS: u64 = 16;
const BLOCK_SIZE: u32 = 16;

/// A typical PREFIX_ADDED: 16 block hashes with the tokens of 16-token blocks.
fn typical_stored(i: u64) -> Event {
    let mut ev = Event::new(
        EventKind::Stored,
        "vllm-0",
        PartitionKey::new("acme", "llama-3-8b", ""),
    );
    ev.block_hashes = (0..BLOCKS)
        .map(|b| EngineHash((i * BLOCKS + b).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect();
    ev.parent_hash = Some(EngineHash(i));
    ev.content = BlockContent::Tokens {
        token_ids: (0..BLOCKS as u32 * BLOCK_SIZE)
            .map(|t| (t * 7919) % 128_000)
            .collect(),
        block_size: BLOCK_SIZE,
    };
    ev.timestamp_us = 1_767_225_600_250_000;
    ev.seq = i;
    ev
}

/// [`typical_stored`] with token ids drawn uniformly from a 128k vocabulary (the fleet's
/// seeded generator, seeded by `i`): the mix of 2- and 3-byte varints real prompts have.
fn random_stored(i: u64) -> Event {
    let mut ev = typical_stored(i);
    if let BlockContent::Tokens { token_ids, .. } = &mut ev.content {
        *token_ids = kvindex::sim::Rng::new(i).tokens(token_ids.len());
    }
    ev
}

fn bench_decode(c: &mut Criterion) {
    let opts = DecodeSettings {
        vllm: kvindex::event::VllmSettings {
            model: Some("llama-3-8b".into()),
            tenant: "acme".into(),
            ..Default::default()
        },
        ..DecodeSettings::default()
    };
    let env = Envelope {
        engine: Some("vllm-0"),
        ..Envelope::default()
    };
    let mut group = c.benchmark_group("decode");

    let proto = encode::to_proto(&[typical_stored(1)]);
    group.throughput(Throughput::Elements(1));
    group.bench_function("proto_cache_event", |b| {
        b.iter(|| decode_payload(black_box(&proto), &env, &opts))
    });

    // The same shape with pseudo-random token ids, cycling through 64 distinct payloads, so
    // the branch predictor cannot learn one payload's varint lengths by heart.
    let varied: Vec<Vec<u8>> = (0..64)
        .map(|i| encode::to_proto(&[random_stored(i)]))
        .collect();
    let mut next = 0;
    group.bench_function("proto_cache_event_varied", |b| {
        b.iter(|| {
            next = (next + 1) % varied.len();
            decode_payload(black_box(&varied[next]), &env, &opts)
        })
    });

    const BATCH: u64 = 16;
    let events: Vec<Event> = (0..BATCH).map(typical_stored).collect();
    let vllm = encode::to_vllm(&events, 0);
    group.throughput(Throughput::Elements(BATCH));
    group.bench_function("vllm_block_stored_batch16", |b| {
        b.iter(|| decode_payload(black_box(&vllm), &env, &opts))
    });

    // Batches of pseudo-random token ids, cycling through 16 distinct payloads.
    let varied: Vec<Vec<u8>> = (0..16)
        .map(|b| {
            let events: Vec<Event> = (0..BATCH).map(|i| random_stored(b * BATCH + i)).collect();
            encode::to_vllm(&events, 0)
        })
        .collect();
    let mut next = 0;
    group.bench_function("vllm_block_stored_batch16_varied", |b| {
        b.iter(|| {
            next = (next + 1) % varied.len();
            decode_payload(black_box(&varied[next]), &env, &opts)
        })
    });

    let json = encode::to_json(&events);
    group.bench_function("json_batch16", |b| {
        b.iter(|| decode_payload(black_box(&json), &env, &opts))
    });
    group.finish();
}

/// `POST /v1/lookup` bodies as a router sends them: a prompt of 2,250 token ids from a 128k
/// vocabulary (the harness's average), with `limit`; the fast path against the general
/// (serde) parser in the same run, in tokens/s.
fn bench_lookup_body(c: &mut Criterion) {
    const TOKENS: usize = 2_250;
    let bodies: Vec<Vec<u8>> = (0..16)
        .map(|i| {
            let tokens = kvindex::sim::Rng::new(i).tokens(TOKENS);
            serde_json::to_vec(&serde_json::json!({
                "model": "llama-3-8b", "tenant": "acme", "adapter": "", "token_ids": tokens,
                "limit": 8,
            }))
            .expect("json")
        })
        .collect();
    let mut group = c.benchmark_group("lookup_body");
    group.throughput(Throughput::Elements(TOKENS as u64));
    for (name, parse) in [
        (
            "parse_lookup",
            kvindex::api::request::parse_lookup as fn(&[u8]) -> _,
        ),
        (
            "general_parser",
            kvindex::api::request::parse_lookup_general,
        ),
    ] {
        let mut next = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                next = (next + 1) % bodies.len();
                parse(black_box(&bodies[next])).expect("valid")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_decode, bench_lookup_body);
criterion_main!(benches);
