//! `kvindex bench restart`: how long a restart takes until the first lookup is answered, for a
//! durable index of a given size and a given length of event history behind it.
//!
//! 1. **Build** (once per data dir): fleet traffic goes through the real durable pipeline
//!    (`Pipeline::ingest_batch`, commits of index rows + offsets to RocksDB) until the index
//!    holds `--memberships`; then cheap churn events (one engine stores a block and removes it
//!    again) are added until the history counts `--history` events. Churn leaves the state's
//!    size unchanged but leaves RocksDB what a long history leaves: overwritten rows and
//!    tombstones that a reload has to skip.
//! 2. **Measure**: `kvindex serve` on that data dir is started `--runs` times; each run is timed
//!    from the spawn to the first `200` of `POST /v1/lookup`, then stopped. The median is
//!    printed.

use anyhow::{Context, bail};
use kvindex::config::Config;
use kvindex::event::{BlockContent, EngineHash, Event, EventKind, encode};
use kvindex::produce::{Fleet, FleetConfig};
use kvindex::service::{Service, store_dir};
use kvindex::source::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The source name the built history is checkpointed under.
const HISTORY: &str = "bench:history";
/// Blocks each simulated engine caches.
const CAPACITY: usize = 4096;
const BATCH: usize = 512;

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

fn config(data_dir: &Path) -> Config {
    Config {
        data_dir: data_dir.to_path_buf(),
        ..Config::default()
    }
}

/// Feeds `events` (one message each) through the pipeline at `*offset`.
fn feed(service: &Service, events: Vec<Event>, offset: &mut i64) -> anyhow::Result<()> {
    let opts = service.config.decode_options();
    let messages: Vec<Message> = events
        .chunk_by(|a, b| a.engine == b.engine)
        .map(|run| {
            *offset += 1;
            Message {
                offset: *offset - 1,
                payload: encode::to_proto(run),
                ..Message::default()
            }
        })
        .collect();
    service.pipeline.ingest_batch(HISTORY, &messages, &opts)?;
    Ok(())
}

/// A store of one block by `engine` and its removal: history without growth.
fn churn_pair(fleet_cfg: &FleetConfig, engine: &str, i: u64) -> [Event; 2] {
    let partition = kvindex::event::PartitionKey::new("", "model-0", "");
    let hash = EngineHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut stored = Event::new(EventKind::Stored, engine, partition.clone());
    stored.block_hashes = vec![hash];
    stored.content = BlockContent::Tokens {
        token_ids: (0..fleet_cfg.block_size)
            .map(|t| (i as u32).wrapping_add(t) % 128_000)
            .collect(),
        block_size: fleet_cfg.block_size,
    };
    let mut removed = Event::new(EventKind::Removed, engine, partition);
    removed.block_hashes = vec![hash];
    removed.adapter_scoped = true;
    [stored, removed]
}

fn build(args: &RestartArgs) -> anyhow::Result<()> {
    let service = Service::open(config(&args.data_dir), None)?;
    let engines = args.memberships.div_ceil(CAPACITY as u64).max(1) as usize;
    let fleet_cfg = FleetConfig {
        engines,
        adapters: 0,
        capacity_blocks: CAPACITY,
        clear_every: u64::MAX,
        ..FleetConfig::default()
    };
    let mut fleet = Fleet::new(fleet_cfg.clone());
    let started = Instant::now();
    let (mut offset, mut events) = (0i64, 0u64);
    while service.index.stats().memberships < args.memberships {
        let mut batch = Vec::new();
        for _ in 0..BATCH {
            batch.extend(fleet.next_request());
        }
        events += batch.len() as u64;
        feed(&service, batch, &mut offset)?;
        service.pipeline.flush();
    }
    let names: Vec<String> = fleet.engines().into_iter().map(|(e, _)| e).collect();
    let mut i = 0u64;
    while events < args.history {
        let mut batch = Vec::with_capacity(BATCH * 2);
        for _ in 0..BATCH {
            batch.extend(churn_pair(
                &fleet_cfg,
                &names[(i as usize) % names.len()],
                i,
            ));
            i += 1;
        }
        events += batch.len() as u64;
        feed(&service, batch, &mut offset)?;
    }
    if !service.pipeline.persist() {
        bail!("the final commit failed");
    }
    let stats = service.index.stats();
    println!(
        "built {}: {} memberships, {} blocks, {} engines, {events} events of history in {:.1} s",
        store_dir(&service.config).display(),
        stats.memberships,
        stats.block_entries,
        stats.engines,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One POST of a small lookup; the status code.
fn lookup_status(addr: &str) -> Option<u16> {
    let body = r#"{"model":"model-0","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}"#;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    write!(
        s,
        "POST /v1/lookup HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Spawns `serve` on the data dir and times spawn → first lookup answered.
fn time_restart(data_dir: &Path) -> anyhow::Result<Duration> {
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut child = Command::new(exe)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir)
        .env("KVINDEX_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let mut addr = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(a) = line.strip_prefix("kvindex listening on http://") {
            addr = Some(a.trim().to_string());
            break;
        }
    }
    let addr = addr.context("serve exited before listening")?;
    let took = loop {
        if lookup_status(&addr) == Some(200) {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!("no lookup answered within 300 s");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait()?;
    Ok(took)
}

pub fn restart(args: RestartArgs) -> anyhow::Result<()> {
    let built =
        std::fs::read_dir(store_dir(&config(&args.data_dir))).is_ok_and(|mut d| d.next().is_some());
    if built {
        println!("reusing the index in {}", args.data_dir.display());
    } else {
        build(&args)?;
    }
    let mut times = Vec::new();
    if args.runs == 0 {
        return Ok(());
    }
    for run in 0..args.runs {
        let t = time_restart(&args.data_dir)?;
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
