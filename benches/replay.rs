//! The workloads' Mooncake trace replayed through the index (issue target: ≥ 25 M block ops/s
//! on one thread), with one and two shards, every lookup checked against the trace's answers.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvindex::replay;
use std::path::Path;

fn bench_replay(c: &mut Criterion) {
    let path = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/workloads/mooncake-64w.jsonl.gz"
    ));
    let trace = replay::load(path, None).expect("the shared workload trace loads");
    let mut g = c.benchmark_group("replay_mooncake_64w");
    g.throughput(Throughput::Elements(trace.block_ops));
    g.sample_size(20);
    for shards in [1, 2] {
        g.bench_function(format!("shards_{shards}"), |b| {
            // Time the replay loop only, as `kvindex bench replay` does: index setup, the
            // answer check and teardown stay outside the clock (they run all the same).
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        replay::run(&trace, shards, 1)
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
