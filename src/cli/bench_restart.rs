//! `kvindex bench restart`: how long a restart takes until the first lookup is answered, for a
//! durable index of a given size and a given length of event history behind it.
//!
//! 1. **Build** (once per data dir, [`bench_build::build_once`]): fleet traffic goes through
//!    the real durable pipeline until the index holds `--memberships`, then churn until the
//!    history counts `--history` events.
//! 2. **Measure**: `kvindex serve` on that data dir is started `--runs` times; each run is timed
//!    from the spawn to the first `200` of `POST /v1/lookup`, then stopped. The median is
//!    printed.

use super::bench_build;
use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
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

/// Spawns `serve` on the data dir and times spawn → first lookup answered.
fn time_restart(args: &RestartArgs) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let served = Spawned::serve(
        &std::env::current_exe()?,
        &args.data_dir,
        None,
        SPAWN_TIMEOUT,
    )?;
    served.wait_answering(Duration::from_secs(300))?;
    let took = started.elapsed();
    served.terminate(STOP_TIMEOUT)?;
    Ok(took)
}

pub fn restart(args: RestartArgs) -> anyhow::Result<()> {
    bench_build::build_once(&args.data_dir, args.memberships, args.history)?;
    let mut times = Vec::new();
    if args.runs == 0 {
        return Ok(());
    }
    for run in 0..args.runs {
        let t = time_restart(&args)?;
        println!(
            "restart {run}: first lookup answered after {:.0} ms",
            t.as_secs_f64() * 1e3
        );
        times.push(t);
    }
    times.sort();
    println!(
        "median restart to first lookup: {:.0} ms (min {:.0}, max {:.0})",
        times[times.len() / 2].as_secs_f64() * 1e3,
        times[0].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3
    );
    Ok(())
}
