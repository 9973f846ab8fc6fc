//! Subcommands of the `kvindex` binary, one file each (`bench_build.rs`: the index the service
//! benches run against).

use std::time::Duration;

/// How long a bench waits for a spawned `kvindex serve` to listen (it loads its index first).
pub const SPAWN_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a bench waits for a spawned `kvindex serve` to stop after SIGTERM.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(120);

pub mod bench;
pub mod bench_bridge;
pub mod bench_build;
pub mod bench_http;
pub mod bench_restart;
pub mod bridge;
pub mod produce;
pub mod rebuild;
pub mod serve;
