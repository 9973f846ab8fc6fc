//! A recorded KV-cache op stream (the Mooncake trace, see `tests/fixtures/README.md`) replayed
//! through the index, with one and two shards, every lookup checked against the trace's answers.
//!
//! The whole stream (20,932 lines) is read from `$KVINDEX_TRACE`, else from
//! `benches/data/mooncake-64w.jsonl.gz` (not in the repository: 6.7 MiB); without either the
//! bench says so and runs on the 2,500-line head the tests use, which is not comparable with
//! figures of the whole stream.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvindex::bench::trace;
use std::path::PathBuf;

/// The whole stream if it is here, else the committed head (with a message saying so).
fn stream() -> (PathBuf, &'static str) {
    if let Some(p) = std::env::var_os("KVINDEX_TRACE") {
        return (PathBuf::from(p), "mooncake_64w");
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let full = root.join("benches/data/mooncake-64w.jsonl.gz");
    if full.exists() {
        return (full, "mooncake_64w");
    }
    eprintln!(
        "trace bench: {} is absent (set KVINDEX_TRACE to the whole op stream); \
         replaying the 2,500-line head from tests/fixtures instead",
        full.display()
    );
    (
        root.join("tests/fixtures/trace/mooncake-64w-head.jsonl.gz"),
        "mooncake_64w_head",
    )
}

fn bench_replay(c: &mut Criterion) {
    let (path, name) = stream();
    let ops = trace::load(&path, None)
        .unwrap_or_else(|e| panic!("loading the trace {}: {e}", path.display()));
    let mut g = c.benchmark_group(format!("replay_{name}"));
    g.throughput(Throughput::Elements(ops.block_ops));
    g.sample_size(20);
    for shards in [1, 2] {
        g.bench_function(format!("shards_{shards}"), |b| {
            // Time the replay loop only, as `kvindex bench replay` does: index setup, the
            // answer check and teardown stay outside the clock (they run all the same).
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        trace::run(&ops, shards, 1, false)
                            .expect("every lookup matches the reference")
                            .elapsed
                    })
                    .sum()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_replay);
criterion_main!(benches);
