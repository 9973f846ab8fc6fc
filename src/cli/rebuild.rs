//! The rebuild: `kvindex replay --from earliest|offset:N|time:RFC3339` rebuilds a durable index
//! from a Kafka topic or NATS stream into an empty data dir, with a progress bar, and stops
//! once it has caught up with the log end it saw at start. `kvindex serve` on the same data dir
//! then resumes from there. (The command keeps its name, `replay`; the trace benchmark is
//! `kvindex bench replay`, in `bench/trace.rs`.)

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use kvindex::config::{Config, Overrides, SourceKind, StartPosition};
use kvindex::pipeline::Pipeline;
use kvindex::service::{Service, SourceSetup, StartSettings, store_dir};
use kvindex::source::{Checkpoints, SourceSpec};
use kvindex::util::parse_rfc3339_us;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// TOML config file: the source to read (`source.kind` = kafka or nats) and the index
    /// settings.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where to build the index (must not hold one yet; overrides `data_dir`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Where to start: `earliest`, `offset:N` (every partition; the stream sequence for NATS)
    /// or `time:RFC3339` (Kafka only).
    #[arg(long, default_value = "earliest")]
    pub from: String,
}

/// Where the replay starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum From {
    Earliest,
    Offset(i64),
    TimeUs(i64),
}

fn parse_from(s: &str) -> anyhow::Result<From> {
    if s == "earliest" {
        return Ok(From::Earliest);
    }
    if let Some(n) = s.strip_prefix("offset:") {
        let n: i64 =
            n.parse().ok().filter(|&n| n >= 0).with_context(|| {
                format!("--from offset:N needs a non-negative integer, got `{s}`")
            })?;
        return Ok(From::Offset(n));
    }
    if let Some(t) = s.strip_prefix("time:") {
        let us = parse_rfc3339_us(t)
            .with_context(|| format!("--from time: needs an RFC 3339 time, got `{t}`"))?;
        return Ok(From::TimeUs(us));
    }
    bail!("--from must be earliest, offset:N or time:RFC3339, got `{s}`")
}

/// Starts every partition at a fixed offset (`--from offset:N`): the offset is presented as
/// if it were stored, so the source checks it against the log like any checkpoint.
struct StartAt {
    pipeline: Arc<Pipeline>,
    offset: i64,
}

impl Checkpoints for StartAt {
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64> {
        self.pipeline
            .next_offset(source, partition)
            .or(Some(self.offset))
    }
    fn persist_now(&self) {
        self.pipeline.persist_now();
    }
}

fn check_empty(config: &Config) -> anyhow::Result<()> {
    let dir = store_dir(config);
    let occupied = std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some());
    if occupied {
        bail!(
            "{} already holds an index: replay rebuilds into an empty data dir (pass another \
             --data-dir, or remove it)",
            dir.display()
        );
    }
    Ok(())
}

pub async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    let from = parse_from(&args.from)?;
    let overrides = Overrides {
        data_dir: args.data_dir.clone(),
        ..Overrides::default()
    };
    let mut config = Config::load(args.config.as_deref(), std::env::vars(), &overrides)
        .context("invalid configuration")?;
    if config.source.kind == SourceKind::Embedded {
        bail!(
            "replay reads an existing topic or stream: set source.kind = \"kafka\" or \"nats\" \
             (the embedded broker starts empty)"
        );
    }
    check_empty(&config)?;
    if let From::TimeUs(_) = from
        && config.source.kind == SourceKind::Nats
    {
        bail!(
            "--from time: is supported for Kafka only; use offset:N (a stream sequence) for NATS"
        );
    }
    config.source.kafka.start = "earliest".into();
    let replica = kvindex::cluster::resolve_replica_id(&mut config)
        .context("reading the data dir's replica id")?;
    let mut setup = SourceSetup::from_config(&config, &StartSettings::default())?;
    match &mut setup.spec {
        SourceSpec::Kafka { settings, .. } => {
            // Read every partition and commit nowhere: the serving replicas' groups are theirs.
            settings.group_id = None;
            if let From::TimeUs(us) = from {
                settings.start = StartPosition::TimeUs(us);
            }
        }
        SourceSpec::Nats(settings) => {
            // A consumer of its own, gone when the replay is: never a serving replica's.
            settings.durable = format!("kvindex-replay-{replica}");
            settings.transient = true;
        }
    }
    let service = Service::open(config, None).context("opening the data dir")?;
    let checkpoints: Arc<dyn Checkpoints> = match from {
        From::Offset(offset) => Arc::new(StartAt {
            pipeline: service.pipeline.clone(),
            offset,
        }),
        _ => service.pipeline.clone(),
    };
    let (ingest, report) =
        service.start_ingest_from(setup.spec.clone(), setup.bootstrap(), checkpoints)?;

    let started = Instant::now();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} messages ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut total: u64 = 0;
    let outcome = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let status = report.status();
        if let Some((p, d)) = status
            .partitions
            .iter()
            .find_map(|p| Some((p.partition, p.divergence.as_ref()?)))
        {
            break Err(anyhow::anyhow!(
                "partition {p} cannot be replayed from here: {}",
                serde_json::to_string(d).unwrap_or_default()
            ));
        }
        let lag = u64::try_from(status.lag).unwrap_or(0);
        let done = status.messages;
        total = total.max(done + lag);
        bar.set_length(total);
        bar.set_position(done);
        if report.is_ready() {
            break Ok(());
        }
    };
    bar.finish_and_clear();
    ingest.stop();
    outcome?;
    let took = started.elapsed();
    let events = service.metrics.applied_total();
    let stats = service.index.stats();
    println!(
        "replayed {} into {}: {events} events ({} block ops, {} duplicates skipped) in {:.1} s \
         = {:.0} events/s; index: {} blocks, {} memberships, {} engines",
        setup.spec.name(),
        store_dir(&service.config).display(),
        service
            .metrics
            .block_ops
            .load(std::sync::atomic::Ordering::Relaxed),
        service
            .metrics
            .duplicates
            .load(std::sync::atomic::Ordering::Relaxed),
        took.as_secs_f64(),
        events as f64 / took.as_secs_f64().max(1e-9),
        stats.block_entries,
        stats.memberships,
        stats.engines,
    );
    Ok(())
}
