//! `kvindex bench restart`: how long a restart takes until the first lookup is answered, for a
//! durable index of a given size and a given length of event history behind it.
//!
//! 1. **Build** (once per data dir, [`bench_build::build_once`]): fleet traffic goes through
//!    the real durable pipeline until the index holds `--memberships`, then churn until the
//!    history counts `--history` events.
//! 2. **Measure**: `kvindex serve` on that data dir is started `--runs` times; each run is timed
//!    from the spawn to the first `200` of `POST /v1/lookup` for a prompt of the built fleet
//!    (its answer must name engines), and to the end of the warm-up
//!    (every shard's rows in L1), then stopped. The medians are printed.

use super::bench_build;
use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
use anyhow::Context;
use kvindex::bench::harness::Spawned;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    /// Data dir: built if it holds no index yet, reused otherwise.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Memberships to build.
    #[arg(long, default_value_t = 10_000_000)]
    pub memberships: u64,
    /// Events of history to build (fleet traffic plus churn).
    #[arg(long, default_value_t = 1_000_000)]
    pub history: u64,
    /// Restarts to time (0: only build).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

/// Spawns `serve` on the data dir and times spawn → `probe` (a lookup body) answered, and
/// spawn → every shard's rows loaded (`warm_up.done` in `/v1/stats`).
fn time_restart(args: &RestartArgs, probe: &[u8]) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    let served = Spawned::serve(
        &std::env::current_exe()?,
        &args.data_dir,
        None,
        SPAWN_TIMEOUT,
    )?;
    let answer = served.wait_answering_to(probe, Duration::from_secs(300))?;
    let answered = started.elapsed();
    anyhow::ensure!(
        answer.windows(11).any(|w| w == b"\"engine_id\""),
        "the first answer named no engine: {}",
        String::from_utf8_lossy(&answer)
    );
    served.wait_warm(Duration::from_secs(600))?;
    let warm = started.elapsed();
    served.terminate(STOP_TIMEOUT)?;
    Ok((answered, warm))
}

pub fn restart(args: RestartArgs) -> anyhow::Result<()> {
    bench_build::build_once(&args.data_dir, args.memberships, args.history)?;
    let mut times = Vec::new();
    if args.runs == 0 {
        return Ok(());
    }
    // A prompt of the live fleet (its answer names engines), not a miss.
    let probe = bench_build::read_queries(&args.data_dir)?
        .into_iter()
        .next()
        .context("the built index has no sample queries")?;
    let mut warm = Vec::new();
    for run in 0..args.runs {
        let (answered, warmed) = time_restart(&args, &probe)?;
        println!(
            "restart {run}: first lookup answered after {:.0} ms, every shard loaded after {:.0} ms",
            answered.as_secs_f64() * 1e3,
            warmed.as_secs_f64() * 1e3
        );
        times.push(answered);
        warm.push(warmed);
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for (what, mut t) in [("first lookup", times), ("loaded", warm)] {
        t.sort();
        println!(
            "median restart to {what}: {:.0} ms (min {:.0}, max {:.0})",
            ms(t[t.len() / 2]),
            ms(t[0]),
            ms(t[t.len() - 1])
        );
    }
    Ok(())
}
