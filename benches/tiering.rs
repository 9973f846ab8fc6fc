//! Lookups over a bounded L1: the same 32-block queries against an index that
//! holds every block in memory (the baseline) and against one whose L1 is small enough that
//! at least 90% of the blocks the queries meet live only in RocksDB (L2), read through on
//! every lookup (`restore_on_read` off, so they stay there). p50 / p99 are printed besides
//! criterion's mean.
//!
//! `shard_writeback`: the live write-back path end to end: a shard's L1 full of dirty entries
//! (stored since the last commit), evicted down to 10% of them by the write-back controller
//! through the store's sink in 128-key batches (sampling, row encoding, the RocksDB write, the
//! removal), in entries written per second: one shard alone, and two shards at once on two
//! threads, as the service's shard workers (one per core by default) write back.

use criterion::measurement::WallTime;
use criterion::{Criterion, criterion_group, criterion_main};
use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use kvindex::index::shard::{BLOCK_ENTRY_BYTES, ReadThroughSettings, ReadThroughStats};
use kvindex::index::{Index, IndexSettings, ShardL1, hash};
use kvindex::sim::Rng;
use kvindex::spill::{CircuitBreaker, SpillController, SpillL1, SpillSettings, SystemClock};
use kvindex::store::{Store, StoreSettings, StoreSink};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK: u32 = 16;
const CHAIN: u32 = 32;
const SEED: u64 = 1;
const ENGINES: u64 = 64;
const FAMILIES: u64 = 8_000;
const STORES: usize = 24_000;

fn partition() -> PartitionKey {
    PartitionKey::new("t", "m", "")
}

fn tokens(family: u64) -> Vec<u32> {
    (0..CHAIN * BLOCK)
        .map(|t| (family as u32).wrapping_mul(7919).wrapping_add(t))
        .collect()
}

/// Engine `e` stores prompt `family` (32 blocks) as one root chain.
fn chain_event(e: u64, family: u64) -> Event {
    let mut ev = Event::new(EventKind::Stored, format!("engine-{e:03}"), partition());
    ev.block_hashes = (0..CHAIN as u64)
        .map(|b| EngineHash(hash::chain(e + 1, family << 32 | b)))
        .collect();
    ev.content = BlockContent::Tokens {
        token_ids: tokens(family),
        block_size: BLOCK,
    };
    ev.tier = Some(Tier::Gpu);
    ev
}

/// A store holding ~`STORES` chains over `ENGINES` engines; returns it and the families stored.
fn build_store(dir: &std::path::Path) -> (Arc<Store>, Vec<u64>) {
    let opts = StoreSettings {
        shards: 1,
        seed: SEED,
        sync: false,
    };
    let store = Arc::new(Store::open(dir, &opts).expect("open store"));
    let index = Index::new(IndexSettings {
        shards: 1,
        seed: SEED,
    });
    index.enable_change_tracking();
    let mut rng = Rng::new(5);
    let mut families = Vec::new();
    for i in 0..STORES {
        let family = rng.below(FAMILIES as usize) as u64;
        index
            .apply(&chain_event(rng.below(ENGINES as usize) as u64, family), 0)
            .expect("stores");
        families.push(family);
        if i % 2_000 == 1_999 {
            let changes = index.shard(0).write().take_changes();
            store.commit(0, &changes, &[]).expect("commit");
        }
    }
    let changes = index.shard(0).write().take_changes();
    store.commit(0, &changes, &[]).expect("commit");
    store.flush().expect("flush");
    (store, families)
}

/// An index over `store` whose L1 holds at most `fraction` of the blocks.
fn tiered(store: &Arc<Store>, fraction: Option<f64>) -> Index {
    let index = Index::new(IndexSettings {
        shards: 1,
        seed: SEED,
    });
    let mut shard = index.shard(0).write();
    let stats = match fraction {
        None => store.load_shard(0, &mut shard).expect("load"),
        Some(f) => {
            // Map rows may take half of a load budget: double it so blocks get `f`.
            let blocks = store
                .load_shard(0, &mut kvindex::index::Shard::new(SEED))
                .expect("count")
                .blocks;
            let budget = 2.0 * f * blocks as f64 * BLOCK_ENTRY_BYTES as f64;
            store
                .load_shard_bounded(0, &mut shard, budget as u64)
                .expect("load")
        }
    };
    shard.attach_l2(
        store.clone(),
        0,
        ReadThroughSettings {
            restore_on_read: false,
        },
        Arc::new(ReadThroughStats::default()),
        stats.left_in_l2 > 0,
    );
    shard.enable_change_tracking();
    drop(shard);
    index
}

fn percentiles(name: &str, index: &Index, queries: &[Vec<u64>]) {
    let mut samples: Vec<Duration> = queries
        .iter()
        .cycle()
        .take(20_000)
        .map(|keys| {
            let t = Instant::now();
            black_box(index.lookup_keys(keys));
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    println!(
        "{name}: lookup of 32 blocks: p50 {:.2} µs  p99 {:.2} µs  p99.9 {:.2} µs",
        pct(0.5),
        pct(0.99),
        pct(0.999)
    );
}

/// Of the blocks `queries` name that the index holds at all, the share `bounded` keeps only in
/// L2 (counted once per query, as lookups meet them).
fn share_only_in_l2(full: &Index, bounded: &Index, queries: &[Vec<u64>]) -> f64 {
    let (full, bounded) = (full.shard(0).read(), bounded.shard(0).read());
    let (mut held, mut in_l2) = (0u64, 0u64);
    for &k in queries.iter().flatten() {
        if full.l1_blocks_contain(k) {
            held += 1;
            in_l2 += u64::from(!bounded.l1_blocks_contain(k));
        }
    }
    in_l2 as f64 / held.max(1) as f64
}

fn bench_tiered_lookup(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, families) = build_store(dir.path());
    let full = tiered(&store, None);
    let queries: Vec<Vec<u64>> = families
        .iter()
        .take(2_000)
        .map(|&f| {
            full.query_keys(
                &partition(),
                &kvindex::index::QueryBlocks::Tokens {
                    token_ids: tokens(f),
                    block_size: BLOCK,
                    extras: Vec::new(),
                },
            )
        })
        .collect();
    // The target case: 90% of the queried blocks live only in L2. Shrink L1 until they do.
    let (bounded, in_l2) = [0.1, 0.07, 0.05, 0.035, 0.025, 0.015]
        .into_iter()
        .map(|fraction| {
            let bounded = tiered(&store, Some(fraction));
            let share = share_only_in_l2(&full, &bounded, &queries);
            (bounded, share)
        })
        .find(|(_, share)| *share >= 0.9)
        .expect("an L1 small enough to leave 90% of the queried blocks in L2");
    let (l1, all) = {
        let s = bounded.shard(0).read();
        (s.l1_entries(), s.blocks())
    };
    // The bounded index must answer exactly like the full one.
    for keys in queries.iter().take(200) {
        assert_eq!(
            full.lookup_keys(keys).to_vec(),
            bounded.lookup_keys(keys).to_vec()
        );
    }
    println!(
        "bounded L1: {l1} blocks + map entries resident of {all} blocks; {:.1}% of the queried \
         blocks only in L2",
        100.0 * in_l2
    );
    percentiles("all in L1", &full, &queries);
    percentiles(">= 90% of queried blocks in L2", &bounded, &queries);

    let mut g = c.benchmark_group("tiered_lookup");
    let mut i = 0;
    g.bench_function("all_in_l1_32_blocks", |b| {
        b.iter(|| {
            i = (i + 1) % queries.len();
            black_box(full.lookup_keys(&queries[i]))
        })
    });
    g.bench_function("ninety_percent_in_l2_32_blocks", |b| {
        b.iter(|| {
            i = (i + 1) % queries.len();
            black_box(bounded.lookup_keys(&queries[i]))
        })
    });
    g.finish();
}

/// An index of `shards` shards over a fresh store, holding `stores` chains applied since the
/// last commit (all dirty; the events spread over the shards as the service routes them), with
/// durable ids for every shard's engines and partition.
fn dirty_shards(
    dir: &std::path::Path,
    shards: usize,
    stores: usize,
    seed: u64,
) -> (Arc<Index>, Arc<Store>) {
    let opts = StoreSettings {
        shards,
        seed: SEED,
        sync: false,
    };
    let store = Arc::new(Store::open(dir, &opts).expect("open store"));
    let index = Arc::new(Index::new(IndexSettings { shards, seed: SEED }));
    for s in 0..shards {
        let mut shard = index.shard(s).write();
        shard.attach_l2(
            store.clone(),
            s as u16,
            ReadThroughSettings {
                restore_on_read: false,
            },
            Arc::new(ReadThroughStats::default()),
            false,
        );
        shard.enable_change_tracking();
    }
    // One store per engine so the first commit makes every id durable.
    for e in 0..ENGINES {
        index
            .apply(&chain_event(e, FAMILIES + e), 0)
            .expect("stores");
    }
    for s in 0..shards {
        let changes = index.shard(s).write().take_changes();
        store.commit(s as u16, &changes, &[]).expect("commit");
        store.after_commit(&mut index.shard(s).write(), &changes);
    }
    let mut rng = Rng::new(seed);
    for _ in 0..stores {
        let family = rng.below(FAMILIES as usize) as u64;
        index
            .apply(&chain_event(rng.below(ENGINES as usize) as u64, family), 0)
            .expect("stores");
    }
    (index, store)
}

/// One eviction pass of shard `shard` from its dirty L1 down to 10% of it, as a shard worker
/// runs it: returns the entries written back.
fn evict_to_ten_percent(index: &Arc<Index>, store: &Arc<Store>, shard: usize) -> usize {
    let l1 = ShardL1::new(index.clone(), shard);
    let used = l1.bytes_used();
    let mut settings = SpillSettings::for_budget(used * 10 / 9);
    settings.low_watermark = 0.1;
    settings.high_watermark = 0.5;
    let mut ctl = SpillController::new(
        l1,
        StoreSink::new(store.clone()),
        Arc::new(CircuitBreaker::new(Arc::new(SystemClock))),
        settings,
    );
    let r = ctl.evict();
    assert!(r.stopped.is_none() && r.written > 0, "{r:?}");
    r.written
}

/// `shards` shards written back at once, one thread each (the service runs one worker per
/// shard, one shard per core by default); entries per second of wall time over all shards.
fn bench_writeback_shards(g: &mut criterion::BenchmarkGroup<'_, WallTime>, shards: usize) {
    let name = match shards {
        1 => "evict_dirty_l1_to_10_percent_128_key_batches".to_string(),
        n => format!("{n}_shards_at_once_evict_to_10_percent_128_key_batches"),
    };
    let mut seed = 1;
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut written = 0usize;
            for _ in 0..iters {
                let dir = tempfile::tempdir().expect("tempdir");
                seed += 1;
                let (index, store) = dirty_shards(dir.path(), shards, 4_000 * shards, seed);
                let start = std::sync::Barrier::new(shards + 1);
                let t = std::thread::scope(|s| {
                    let workers: Vec<_> = (0..shards)
                        .map(|shard| {
                            let (index, store, start) = (&index, &store, &start);
                            s.spawn(move || {
                                start.wait();
                                evict_to_ten_percent(index, store, shard)
                            })
                        })
                        .collect();
                    start.wait();
                    let t = Instant::now();
                    written += workers
                        .into_iter()
                        .map(|w| w.join().expect("worker"))
                        .sum::<usize>();
                    t.elapsed()
                });
                spent += t;
            }
            println!(
                "  {shards} shard(s): {:.2} M entries/s written back ({written} entries, {:.1} ms)",
                written as f64 / spent.as_secs_f64() / 1e6,
                spent.as_secs_f64() * 1e3
            );
            spent
        })
    });
}

fn bench_shard_writeback(c: &mut Criterion) {
    let mut g = c.benchmark_group("shard_writeback");
    g.sample_size(10);
    bench_writeback_shards(&mut g, 1);
    bench_writeback_shards(&mut g, 2);
    g.finish();
}

criterion_group!(benches, bench_tiered_lookup, bench_shard_writeback);
criterion_main!(benches);
