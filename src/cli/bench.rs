//! `kvindex bench replay`: runs [`kvindex::replay`] and prints its figures.

use anyhow::{Context, bail};
use kvindex::bench::trace::{self, RunReport};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Trace file (JSONL, plain or gzip), in the workloads README's format.
    pub file: PathBuf,
    /// Index shards (worker threads) to replay through.
    #[arg(long, default_value_t = 1)]
    pub shards: usize,
    /// Replays of the whole file, each on a fresh index; the median is reported too.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Replay only the first N lines.
    #[arg(long)]
    pub lines: Option<usize>,
    /// Chain-hash seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also time stores, removes and finds apart (one shard): where the replay's time goes, at
    /// the cost of two clock reads per event.
    #[arg(long)]
    pub split: bool,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn print_run(label: &str, r: &RunReport) {
    println!(
        "{label:>8}: {:>7.2} M block ops/s  {:>9.0} lookups/s  {:>8.2} ms  lookup p50 {:.2} µs  p99 {:.2} µs  p99.9 {:.2} µs  max {:.2} µs  {:.1} L1 bytes/membership ({} memberships)",
        r.block_ops_per_sec / 1e6,
        r.lookups_per_sec,
        r.elapsed.as_secs_f64() * 1e3,
        us(r.percentile(0.50)),
        us(r.percentile(0.99)),
        us(r.percentile(0.999)),
        us(r.percentile(1.0)),
        r.bytes_per_membership(),
        r.memberships,
    );
}

pub fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    if args.repeat == 0 || args.shards == 0 {
        bail!("--repeat and --shards must be at least 1");
    }
    let trace = trace::load(&args.file, args.lines)
        .with_context(|| format!("loading {}", args.file.display()))?;
    println!(
        "trace {}: {} ops, {} finds, {} block ops; shards {}",
        args.file.display(),
        trace.ops.len(),
        trace.finds,
        trace.block_ops,
        args.shards
    );
    let mut runs = Vec::new();
    for i in 0..args.repeat {
        let r = trace::run(&trace, args.shards, args.seed, args.split)?;
        if r.skipped > 0 {
            println!("note: {} events skipped (see logs)", r.skipped);
        }
        print_run(&format!("run {}", i + 1), &r);
        if r.split.iter().any(|d| !d.is_zero()) {
            let [s, rm, f] = r.split.map(|d| d.as_secs_f64() * 1e3);
            println!("          time in stores {s:.1} ms, removes {rm:.1} ms, finds {f:.1} ms");
        }
        runs.push(r);
    }
    runs.sort_by(|a, b| a.block_ops_per_sec.total_cmp(&b.block_ops_per_sec));
    let median = &runs[runs.len() / 2];
    print_run("median", median);
    println!("0 mismatches in {} finds per run", trace.finds);
    if let Some(rss) = trace::peak_rss_bytes() {
        println!("peak RSS {:.1} MiB", rss as f64 / (1 << 20) as f64);
    }
    Ok(())
}
