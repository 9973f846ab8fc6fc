//! Write-back throughput into the store in 128-key batches (target: ≥ 1 M entries/s).
//!
//! - `sink_128`: the L2 side alone: the store's [`StoreSink::write_batch`] of 128 rows (block
//!   rows with 24-byte keys and 48-byte values) per call, WAL on, no fsync (the default).
//! - `evict_pass`: the whole controller: an eviction pass over a [`MemL1`] holding 64 k dirty
//!   entries with a budget that sends 3/4 of them to L2. `MemL1` is a test double (two
//!   B-trees behind a mutex), so this is a lower bound for a real shard's L1.
//!
//! Each sample writes fresh keys into one database per bench, so RocksDB sees a growing
//! memtable and flushes, as in production.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvindex::spill::testing::MemL1;
use kvindex::spill::{
    CircuitBreaker, L2Row, L2Sink, SpillController, SpillL1, SpillSettings, SystemClock,
};
use kvindex::store::{ROW_BLOCKS, StoreSink};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BATCH: usize = 128;
const VALUE: [u8; 48] = [0x5a; 48];

/// A block row's key (its kind in the first byte, then 24 bytes).
fn key(i: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(25);
    k.push(ROW_BLOCKS);
    k.extend_from_slice(&0u16.to_be_bytes());
    k.extend_from_slice(&7u32.to_be_bytes());
    k.extend_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes());
    k.extend_from_slice(&[0; 10]);
    k
}

fn bench_sink(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = l2(dir.path());
    let mut next = 0u64;
    let mut g = c.benchmark_group("writeback");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("sink_128", |b| {
        b.iter_batched(
            || {
                let rows: Vec<L2Row> = (next..next + BATCH as u64)
                    .map(|i| L2Row::put(key(i), VALUE))
                    .collect();
                next += BATCH as u64;
                rows
            },
            |rows| {
                sink.write_batch(&rows, Instant::now() + Duration::from_secs(10))
                    .expect("write")
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn bench_evict(c: &mut Criterion) {
    const ENTRIES: u64 = 65_536;
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = Arc::new(l2(dir.path()));
    let breaker = Arc::new(CircuitBreaker::new(Arc::new(SystemClock)));
    let probe = MemL1::new();
    for i in 0..ENTRIES {
        probe.put(&key(i), &VALUE);
    }
    // High watermark 0.8 is crossed; the pass stops at low = 0.6 of a budget of 1/3 of the
    // bytes held, i.e. evicts 80% of the entries.
    let budget = probe.bytes_used() / 3;
    let evicted = ENTRIES * 4 / 5;
    let mut g = c.benchmark_group("writeback");
    g.throughput(Throughput::Elements(evicted));
    g.sample_size(10);
    let mut round = 0u64;
    g.bench_function("evict_pass", |b| {
        b.iter_batched(
            || {
                round += 1;
                let l1 = MemL1::new();
                for i in 0..ENTRIES {
                    l1.put(&key(round * ENTRIES + i), &VALUE);
                }
                SpillController::new(
                    l1,
                    sink.clone(),
                    breaker.clone(),
                    SpillSettings::for_budget(budget),
                )
            },
            |mut ctl| {
                let r = ctl.evict();
                assert!(r.stopped.is_none() && r.batches > 0, "{r:?}");
                ctl
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench_sink, bench_evict);
criterion_main!(benches);

/// The production store in `dir`, as the controller's L2.
fn l2(dir: &std::path::Path) -> StoreSink {
    StoreSink::open_scratch(dir).expect("open the store")
}
