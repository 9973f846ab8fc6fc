//! Index benches (one core): apply throughput of 128-block chains over 1,000
//! engines and 16 adapters; lookup latency of a 128-block query against 1,000 engines holding
//! overlapping prefixes (p50/p99 printed besides criterion's mean); L1 bytes per membership at
//! 10 M memberships.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use kvindex::index::{Index, IndexSettings, Shard, hash};
use kvindex::sim::Rng;
use std::hint::black_box;
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;
const CHAIN: u32 = 128;

/// Engine `e` stores the first `len` blocks of prompt `family` under `adapter` as one root chain.
fn chain_event(e: u32, adapter: u32, family: u32, len: u32) -> Event {
    let partition = PartitionKey::new(
        "t",
        "m",
        if adapter == 0 {
            String::new()
        } else {
            format!("lora-{adapter}")
        },
    );
    let mut ev = Event::new(EventKind::Stored, format!("engine-{e:04}"), partition);
    ev.block_hashes = (0..len)
        .map(|b| EngineHash(hash::chain(e as u64 + 1, (family as u64) << 32 | b as u64)))
        .collect();
    ev.content = BlockContent::Tokens {
        token_ids: (0..len * BLOCK)
            .map(|t| family.wrapping_mul(7919).wrapping_add(t))
            .collect(),
        block_size: BLOCK,
    };
    ev.tier = Some(Tier::Gpu);
    ev
}

/// 2,000 chain stores over 1,000 engines × 16 adapters, 64 prompt families (shared prefixes).
fn apply_workload() -> Vec<Event> {
    let mut rng = Rng::new(42);
    (0..2_000)
        .map(|_| {
            let e = (rng.next_u64() % 1000) as u32;
            chain_event(
                e,
                (rng.next_u64() % 16) as u32,
                (rng.next_u64() % 64) as u32,
                CHAIN,
            )
        })
        .collect()
}

fn bench_apply(c: &mut Criterion) {
    let events = apply_workload();
    let blocks: u64 = events.iter().map(|e| e.block_hashes.len() as u64).sum();
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(blocks));
    g.sample_size(20);
    g.bench_function("store_128_block_chains_1000_engines_16_adapters", |b| {
        b.iter_batched(
            || Shard::new(1),
            |mut shard| {
                for ev in &events {
                    let _ = black_box(shard.apply(ev, 0));
                }
                shard
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// 1,000 engines each holding a random-length prefix (1..=128 blocks) of one 128-block prompt.
fn lookup_index() -> (Index, PartitionKey, Vec<u32>) {
    let index = Index::new(IndexSettings { shards: 1, seed: 1 });
    let mut rng = Rng::new(7);
    for e in 0..1000 {
        let len = 1 + (rng.next_u64() % CHAIN as u64) as u32;
        index.apply(&chain_event(e, 0, 1, len), 0).expect("stores");
    }
    let tokens = (0..CHAIN * BLOCK)
        .map(|t| 7919u32.wrapping_add(t))
        .collect();
    (index, PartitionKey::new("t", "m", ""), tokens)
}

fn bench_lookup(c: &mut Criterion) {
    let (index, partition, tokens) = lookup_index();
    let q = kvindex::index::QueryBlocks::Tokens {
        token_ids: tokens,
        block_size: BLOCK,
        extras: Vec::new(),
    };
    let keys = index.query_keys(&partition, &q);
    let (_, rows) = index.lookup(&partition, &q);
    assert_eq!(rows.len(), 1000, "every engine holds the first block");

    // Percentiles, which criterion does not report.
    let mut samples: Vec<Duration> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(index.lookup(&partition, &q));
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    println!(
        "lookup 128 blocks × 1000 engines (keys + match + 1000 named rows sorted): p50 {:.2} µs  p99 {:.2} µs  p99.9 {:.2} µs",
        pct(0.5),
        pct(0.99),
        pct(0.999)
    );

    let mut g = c.benchmark_group("lookup");
    g.bench_function("query_keys_2048_tokens", |b| {
        b.iter(|| black_box(index.query_keys(&partition, &q)))
    });
    g.bench_function("lookup_keys_128_blocks_1000_engines_named_sorted", |b| {
        b.iter(|| black_box(index.lookup_keys(black_box(&keys))))
    });
    g.bench_function("lookup_keys_128_blocks_1000_engines_best_8", |b| {
        b.iter(|| black_box(index.lookup_keys_limited(black_box(&keys), 8)))
    });
    g.bench_function("tokens_128_blocks_1000_engines", |b| {
        b.iter(|| black_box(index.lookup(&partition, &q)))
    });
    g.bench_function("keys_128_blocks_1000_engines_raw_shard", |b| {
        let shard = index.shard(0).read();
        let mut out = Vec::with_capacity(1000);
        b.iter(|| {
            out.clear();
            shard.lookup(black_box(&keys), &mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

/// Builds 10 M memberships (1,000 engines × 16 adapters × 625 blocks, shared prefixes) and
/// reports the index's own byte count and the process RSS growth per membership.
fn bench_memory(_c: &mut Criterion) {
    let rss = || -> Option<u64> {
        let s = std::fs::read_to_string("/proc/self/statm").ok()?;
        Some(s.split_whitespace().nth(1)?.parse::<u64>().ok()? * 4096)
    };
    let before = rss().unwrap_or(0);
    let index = Index::new(IndexSettings { shards: 1, seed: 1 });
    let target = 10_000_000u64;
    let mut rng = Rng::new(3);
    let mut stored = 0u64;
    'fill: for family in 0.. {
        for e in 0..1000u32 {
            let len = 64 + (rng.next_u64() % 65) as u32;
            let ev = chain_event(e, (e + family) % 16, family, len);
            stored += index.apply(&ev, 0).expect("stores") as u64;
            if stored >= target {
                break 'fill;
            }
        }
    }
    let stats = index.stats();
    let after = rss().unwrap_or(0);
    println!(
        "L1 memory at {} memberships ({} blocks): index {:.1} bytes/membership, RSS growth {:.1} bytes/membership",
        stats.memberships,
        stats.block_entries,
        stats.l1_bytes as f64 / stats.memberships as f64,
        after.saturating_sub(before) as f64 / stats.memberships as f64
    );
}

criterion_group!(benches, bench_apply, bench_lookup, bench_memory);
criterion_main!(benches);
