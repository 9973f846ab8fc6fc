//! Subcommands of the `kvindex` binary, one file each (`bench_build.rs`: the index the service
//! benches run against).

use anyhow::Context;
use kvindex::config::{Config, Overrides};
use std::path::PathBuf;
use std::time::Duration;

/// The flags every long-running command takes: the config file and the two overrides.
#[derive(clap::Args, Debug)]
pub struct ConfigArgs {
    /// TOML config file (see kvindex.example.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory for durable state (overrides `data_dir`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// HTTP listen address (overrides `http.listen`).
    #[arg(long)]
    pub listen: Option<String>,
}

impl ConfigArgs {
    /// Defaults < the file < `KVINDEX_*` < these flags, validated.
    pub fn load(&self) -> anyhow::Result<Config> {
        let overrides = Overrides {
            data_dir: self.data_dir.clone(),
            listen: self.listen.clone(),
            ..Overrides::default()
        };
        Config::load(self.config.as_deref(), std::env::vars(), &overrides)
            .context("invalid configuration")
    }
}

/// How long a bench waits for a spawned `kvindex serve` to listen (it loads its index first).
pub const SPAWN_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a bench waits for a spawned `kvindex serve` to stop after SIGTERM.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(120);

/// A tag unique to this run of a bench (`<pid>_<unix millis>`), for the names of the streams and
/// subjects it creates on a shared broker, so that runs side by side never meet.
pub fn run_tag() -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{}_{millis}", std::process::id())
}

pub mod bench;
pub mod bench_bridge;
pub mod bench_build;
pub mod bench_http;
pub mod bench_ingest;
pub mod bench_load;
pub mod bench_restart;
pub mod bench_soak;
pub mod bridge;
pub mod produce;
pub mod rebuild;
pub mod serve;
