//! Crash safety of the real binary: `kvindex serve` consumes a Kafka topic (a librdkafka mock
//! cluster owned by this test, so the log outlives every kvindex process) and is SIGKILLed at
//! random moments, 24 times (`CRASH_TRIALS` for more; while starting, consuming and
//! committing), while events keep arriving. After a last clean run has caught up, its durable
//! state, loaded the way a restart loads it, must equal a reference index folded over every
//! produced event: nothing lost.
//! Nothing is applied out of order either: a re-read after a crash re-applies a suffix of a
//! partition in order, onto state that already holds it, which converges because every
//! mutation is an assignment; that the re-read is skipped (and counted) rather than re-applied
//! is pinned by `tests/pipeline_durable.rs`.
//!
//! It runs three times: with the default L1 budget (everything fits in memory), with a tiny one
//! (64 KiB), so most of the state lives only in RocksDB (L2) and every crash also interrupts
//! eviction and read-through, and with a tiny one while engines reuse block hashes for other
//! content.
//!
//! A fourth run damages the write-ahead log after every kill, as a power loss would (a
//! `kill -9` leaves the WAL whole in the page cache; a power loss loses or garbles its unsynced
//! tail): RocksDB's point-in-time recovery keeps the longest consistent prefix of the log, whose
//! batches hold rows and offsets together, so the next run resumes from the offsets that prefix
//! holds and re-reads the rest from the source.
//!
//! Two more runs, one per source (the Kafka topic; a JetStream stream on the local NATS
//! server), let the process die by itself at each crash point in turn (`KVINDEX_CRASH_AT`,
//! `kvindex::util::crash_point`): exactly between the steps of a durability boundary, where a
//! random kill rarely lands. A last run kills at random moments on the JetStream stream.
//!
//! Every [`CATCH_UP_EVERY`] trials one more run catches up and stops cleanly, which keeps the
//! backlog of trials that die early within the embedded broker's retention (about 5 MiB per
//! partition) however many trials run.

use crate::support::brokers::NATS_URL;
use crate::support::*;
use kvindex::config::Config;
use kvindex::event::Event;
use kvindex::index::{Index, IndexSettings};
use kvindex::service::Service;
use kvindex::sim::{Fleet, FleetSettings, Rng};
use kvindex::source::{EmbeddedBroker, KafkaPublisher, NatsPublisher};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

const TOPIC: &str = "kv-crash";
/// Kills per run in CI; `CRASH_TRIALS` asks for more (RELIABILITY.md's long runs).
const TRIALS: usize = 24;

fn trials() -> usize {
    std::env::var("CRASH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(TRIALS)
}
const REQUESTS_PER_TRIAL: usize = 120;
/// Every this many trials, one more run catches up and stops cleanly, so the backlog stays
/// within the embedded broker's retention however many trials run.
const CATCH_UP_EVERY: usize = 8;
const SEED: u64 = 0x6b76_696e_6465_7831;

fn fleet_config() -> FleetSettings {
    FleetSettings {
        engines: 10,
        adapters: 2,
        // Small caches and frequent restarts: many removals and clears, whose double
        // application (or loss) changes the state.
        capacity_blocks: 192,
        clear_every: 250,
        seed: 42,
        ..FleetSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_loses_nothing_and_applies_nothing_twice() {
    crash_trials(
        Source::Kafka,
        None,
        false,
        Kill::AtRandom,
        AfterKill::Nothing,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_a_tiny_l1_loses_nothing_either() {
    crash_trials(
        Source::Kafka,
        Some(64 << 10),
        false,
        Kill::AtRandom,
        AfterKill::Nothing,
    )
    .await;
}

/// Engines that reuse a block hash for other content once the first is gone: replaying a log
/// suffix is only exact if L2 never holds rows newer than the offsets stored with it (eviction
/// commits first), since a newer row for a reused parent hash would re-key its children.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_reused_hashes_and_a_tiny_l1_loses_nothing_either() {
    crash_trials(
        Source::Kafka,
        Some(64 << 10),
        true,
        Kill::AtRandom,
        AfterKill::Nothing,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_wal_tail_after_each_kill_recovers_a_consistent_prefix_and_loses_nothing() {
    crash_trials(
        Source::Kafka,
        Some(64 << 10),
        false,
        Kill::AtRandom,
        AfterKill::TearWal,
    )
    .await;
}

/// Every crash point (`kvindex::util::crash_point`) in turn, each armed for its 1st or 2nd
/// pass: the process dies exactly between two steps of a durability boundary (the batch built
/// and not written, written and not known durable, durable and not acknowledged upstream,
/// durable in L2 and not yet dropped from L1, half loaded), with a tiny L1 so that eviction
/// and warm-up pass their points too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_durability_boundary_loses_nothing_and_applies_nothing_twice() {
    crash_trials(
        Source::Kafka,
        Some(64 << 10),
        false,
        Kill::AtCrashPoints,
        AfterKill::Nothing,
    )
    .await;
}

/// Random kills on a JetStream stream: the consumer is repositioned from the checkpoint after
/// each, whatever the server's consumer state (acked, delivered, pending) says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_of_the_nats_source_loses_nothing() {
    crash_trials(
        Source::Nats,
        Some(64 << 10),
        false,
        Kill::AtRandom,
        AfterKill::Nothing,
    )
    .await;
}

/// The same on a JetStream stream, where "acknowledged upstream" is a NATS ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_durability_boundary_of_the_nats_source_loses_nothing() {
    crash_trials(
        Source::Nats,
        Some(64 << 10),
        false,
        Kill::AtCrashPoints,
        AfterKill::Nothing,
    )
    .await;
}

/// Which log the trials' events go through; it outlives every kvindex process.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A topic of a librdkafka mock cluster this test owns.
    Kafka,
    /// A stream of its own on the local NATS server (127.0.0.1:4222).
    Nats,
}

/// The log of a [`Source`] and a publisher into it.
enum Log {
    Kafka {
        _broker: EmbeddedBroker,
        publisher: KafkaPublisher,
    },
    Nats {
        /// Boxed: far larger than the Kafka side.
        publisher: Box<NatsPublisher>,
        stream: String,
        prefix: String,
    },
}

impl Log {
    /// Starts the log; also returns the `[source]` section that reads it.
    async fn start(source: Source) -> (Log, String) {
        match source {
            Source::Kafka => {
                let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
                let servers = broker.bootstrap_servers();
                let publisher = KafkaPublisher::new(&servers, TOPIC, &Default::default()).unwrap();
                let section = format!(
                    "[source]\nkind = \"kafka\"\n[source.kafka]\nbrokers = \"{servers}\"\n\
                     topic = \"{TOPIC}\"\ngroup_id = \"\"\nstart = \"earliest\""
                );
                let log = Log::Kafka {
                    _broker: broker,
                    publisher,
                };
                (log, section)
            }
            Source::Nats => {
                require_nats(NATS_URL).await;
                let stream = unique_id("KVCRASH").replace(['-', '.'], "_");
                let prefix = format!("kvcrash.{}", stream.to_lowercase());
                let publisher = NatsPublisher::connect(NATS_URL, true).await.unwrap();
                publisher
                    .ensure_stream(&stream, &[format!("{prefix}.>")])
                    .await
                    .unwrap();
                let section = format!(
                    "[source]\nkind = \"nats\"\n[source.nats]\nurl = \"{NATS_URL}\"\n\
                     stream = \"{stream}\"\nsubjects = [\"{prefix}.>\"]"
                );
                let log = Log::Nats {
                    publisher: Box::new(publisher),
                    stream,
                    prefix,
                };
                (log, section)
            }
        }
    }

    /// Publishes `events` (one message per run of one engine's events); how many messages.
    async fn publish(&mut self, events: &[Event]) -> usize {
        match self {
            Log::Kafka { publisher, .. } => publish_kafka(publisher, events).await,
            Log::Nats {
                publisher, prefix, ..
            } => publish_nats(publisher, prefix, events).await,
        }
    }

    /// Waits until everything published is in the log.
    async fn flush(&mut self) {
        match self {
            Log::Kafka { publisher, .. } => publisher.flush(Duration::from_secs(30)).await.unwrap(),
            Log::Nats { publisher, .. } => publisher.flush().await.unwrap(),
        }
    }

    /// The log end (`caught_up`'s) once `sent` messages are in: Kafka counts offsets from 0,
    /// a stream's sequences from 1.
    fn end(&self, sent: usize) -> i64 {
        match self {
            Log::Kafka { .. } => sent as i64,
            Log::Nats { .. } => sent as i64 + 1,
        }
    }

    /// Deletes a NATS stream (the shared server outlives the test).
    async fn remove(self) {
        if let Log::Nats {
            publisher, stream, ..
        } = self
        {
            let js = async_nats::jetstream::new(publisher.client().clone());
            let _ = js.delete_stream(&stream).await;
        }
    }
}

/// The crash points the service has (`kvindex::util::crash_point`'s table).
const CRASH_POINTS: [&str; 6] = [
    "commit.built",
    "commit.written",
    "ack.before",
    "ack.after",
    "evict.durable",
    "warmup.chunk",
];

/// How each trial's process dies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kill {
    /// SIGKILL at a random moment.
    AtRandom,
    /// It aborts itself at a crash point (SIGKILL after a while if it never gets there).
    AtCrashPoints,
}

/// What the trials do to the data dir after each kill, before the next start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AfterKill {
    Nothing,
    /// Damage the newest WAL file's tail: cut it, zero it or append garbage.
    TearWal,
}

/// Damages the tail of the newest write-ahead log under `data` the way a power loss can
/// (RocksDB keeps its WAL as `<data>/index/*.log`); returns what it did.
fn tear_wal(data: &Path, rng: &mut Rng) -> String {
    let newest = std::fs::read_dir(data.join("index"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max();
    let Some(wal) = newest else {
        return "no WAL".into();
    };
    let bytes = std::fs::read(&wal).unwrap();
    let len = bytes.len();
    let tail = rng.range(1, 4096).min(len);
    let torn = match rng.range(0, 2) {
        0 => {
            std::fs::write(&wal, &bytes[..len - tail]).unwrap();
            format!("cut {tail} of {len} bytes")
        }
        1 => {
            let mut torn = bytes;
            torn[len - tail..].fill(0);
            std::fs::write(&wal, torn).unwrap();
            format!("zeroed the last {tail} of {len} bytes")
        }
        _ => {
            let mut torn = bytes;
            torn.extend((0..tail).map(|_| rng.range(0, 255) as u8));
            std::fs::write(&wal, torn).unwrap();
            format!("appended {tail} random bytes to {len}")
        }
    };
    format!("{}: {torn}", wal.file_name().unwrap().to_string_lossy())
}

async fn crash_trials(
    source: Source,
    l1_max_bytes: Option<u64>,
    reuse_hashes: bool,
    kill: Kill,
    after_kill: AfterKill,
) {
    let (mut log, source_section) = Log::start(source).await;
    let l1 = l1_max_bytes
        .map(|b| format!("l1_max_bytes = {b}"))
        .unwrap_or_default();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            r#"
{source_section}
[index]
shards = 2
seed = {SEED}
{l1}
[checkpoint]
interval_ms = 20
"#
        ),
    );
    let data = dir.path().join("data");
    let mut fleet = Fleet::new(FleetSettings {
        reuse_hashes,
        // The stressed variant also holds blocks on GPU and CPU at once.
        cpu_offload: reuse_hashes,
        ..fleet_config()
    });
    let reference = Index::new(IndexSettings {
        shards: 2,
        seed: SEED,
    });
    let mut rng = Rng::new(7);
    let mut queries = Vec::new();
    let mut sent = 0;
    let mut torn = Vec::new();

    let trials = trials();
    // Per crash point: trials armed for it, and how many of those died there.
    let mut fired = [(0u32, 0u32); CRASH_POINTS.len()];
    for trial in 0..trials {
        if trial > 0 && trial % CATCH_UP_EVERY == 0 {
            // A run that catches up and stops cleanly: trials that die early (and WAL tears,
            // which drop the last commits) let the backlog grow, and the embedded broker
            // deletes what a partition holds beyond about 5 MiB.
            log.flush().await;
            let kv = tokio::task::block_in_place(|| {
                spawn_kvindex(
                    &["serve", "--config", &config],
                    &data,
                    &[("KVINDEX_LOG", "error")],
                    Duration::from_secs(60),
                )
            });
            let resumed = wait_for(
                "the partitions to be listed",
                Duration::from_secs(60),
                || Some(stored_offsets(&kv.stats())).filter(|s| !s.is_empty()),
            );
            let end = tokio::task::block_in_place(|| wait_caught_up(&kv, log.end(sent)));
            eprintln!(
                "catch-up before trial {trial}: resumed at stored offsets {resumed:?}, caught up \
                 with log ends {:?}",
                high_watermarks(&end)
            );
            tokio::task::block_in_place(|| kv.terminate());
        }
        if kill == Kill::AtCrashPoints {
            let point = trial % CRASH_POINTS.len();
            let arm = format!("{}@{}", CRASH_POINTS[point], rng.range(1, 2));
            let mut child = Command::new(env!("CARGO_BIN_EXE_kvindex"))
                .args(["serve", "--config", &config, "--listen", "127.0.0.1:0"])
                .arg("--data-dir")
                .arg(&data)
                .env("KVINDEX_LOG", "error")
                .env(kvindex::util::crash_point::CRASH_AT_ENV, &arm)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            // Fewer events than a random-kill trial: many of these processes die before they
            // read anything (at the warm-up, at the first commit), and the embedded broker
            // keeps only a few hundred messages per partition, so the backlog must stay below
            // that or the broker deletes events no run has read.
            sent += produce(&mut log, &mut fleet, &reference, REQUESTS_PER_TRIAL / 4).await;
            if trial % 6 == 0 {
                queries.extend((0..8).map(|_| fleet.sample_query()));
            }
            let status = tokio::task::block_in_place(|| exit_within(&mut child, 15));
            fired[point].0 += 1;
            if let Some(status) = status {
                assert_eq!(
                    status.signal(),
                    Some(SIGABRT),
                    "serve armed with {arm} exited with {status} instead of dying there"
                );
                fired[point].1 += 1;
            }
            continue;
        }
        // Every fourth trial dies while starting (loading, positioning), the others while
        // consuming and committing.
        if trial % 4 == 3 {
            let mut child = Command::new(env!("CARGO_BIN_EXE_kvindex"))
                .args([
                    "serve",
                    "--config",
                    &config,
                    "--listen",
                    "127.0.0.1:0",
                    "--data-dir",
                ])
                .arg(&data)
                .env("KVINDEX_LOG", "error")
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            sent += produce(&mut log, &mut fleet, &reference, REQUESTS_PER_TRIAL / 4).await;
            tokio::time::sleep(Duration::from_millis(rng.range(0, 400) as u64)).await;
            child.kill().unwrap();
            child.wait().unwrap();
            if after_kill == AfterKill::TearWal {
                torn.push(tear_wal(&data, &mut rng));
            }
            continue;
        }
        let kv = tokio::task::block_in_place(|| {
            spawn_kvindex(
                &["serve", "--config", &config],
                &data,
                &[("KVINDEX_LOG", "error")],
                Duration::from_secs(60),
            )
        });
        sent += produce(&mut log, &mut fleet, &reference, REQUESTS_PER_TRIAL).await;
        if trial % 6 == 0 {
            queries.extend((0..8).map(|_| fleet.sample_query()));
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 700) as u64)).await;
        kv.kill9();
        if after_kill == AfterKill::TearWal {
            torn.push(tear_wal(&data, &mut rng));
        }
    }
    if kill == Kill::AtCrashPoints {
        let report: Vec<String> = CRASH_POINTS
            .iter()
            .zip(fired)
            .map(|(name, (armed, died))| format!("{name}: {died} of {armed}"))
            .collect();
        eprintln!("trials that died at their crash point: {report:?}");
        for (name, (_, died)) in CRASH_POINTS.iter().zip(fired) {
            assert!(died > 0, "no trial reached crash point {name}: {report:?}");
        }
    }
    if !torn.is_empty() {
        eprintln!("WAL damage after each kill: {torn:?}");
    }
    log.flush().await;
    queries.extend((0..32).map(|_| fleet.sample_query()));

    // A last, clean run catches up, then stops gracefully.
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &data,
            &[("KVINDEX_LOG", "error")],
            Duration::from_secs(60),
        )
    });
    let stats = tokio::task::block_in_place(|| wait_caught_up(&kv, log.end(sent)));
    let duplicates: u64 = stats["sources"]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["duplicates_skipped"].as_u64().unwrap())
        .sum();
    tokio::task::block_in_place(|| kv.terminate());
    log.remove().await;

    // The durable state, loaded the way a restart loads it.
    let mut cfg = Config {
        data_dir: data.clone(),
        ..Config::default()
    };
    cfg.index.shards = 2;
    cfg.index.seed = SEED;
    if let Some(b) = l1_max_bytes {
        cfg.index.l1_max_bytes = b;
    }
    let service = Service::open(cfg, None).unwrap();
    // Counters are exact once every shard's rows are loaded (lookups are right before).
    let loaded = service.wait_warm().expect("the store loads");
    if l1_max_bytes.is_some() {
        let wb = service.spill.stats();
        assert!(
            loaded.left_in_l2 > 0,
            "a tiny L1 should leave most rows in L2: {loaded:?}"
        );
        eprintln!("tiny L1: {loaded:?}; {} write-back batches", wb.batches);
    }
    let block_size = fleet_config().block_size;
    let got = fingerprint(&service.index, &queries, block_size);
    let want = fingerprint(&reference, &queries, block_size);
    assert!(
        want.partitions.iter().any(|p| p.2 > 0),
        "the workload indexed nothing"
    );
    assert!(
        want.answers.iter().any(|a| !a.is_empty()),
        "no query matched anything: the comparison would be vacuous"
    );
    assert_eq!(
        got.partitions, want.partitions,
        "per-partition counts differ"
    );
    assert_eq!(got.engines, want.engines, "per-engine blocks differ");
    assert_eq!(got.answers, want.answers, "lookup answers differ");
    eprintln!(
        "{trials} kills survived: {} memberships, {} engines, {} queries agree; the last run \
         skipped {duplicates} duplicate events",
        want.partitions.iter().map(|p| p.2).sum::<u64>(),
        want.engines.len(),
        queries.len()
    );
}

/// Each partition's durable next offset, as `/v1/stats` shows it (-1: none yet).
fn stored_offsets(stats: &serde_json::Value) -> Vec<i64> {
    partition_field(stats, "stored_offset")
}

/// Each partition's log end, as `/v1/stats` shows it.
fn high_watermarks(stats: &serde_json::Value) -> Vec<i64> {
    partition_field(stats, "high_watermark")
}

fn partition_field(stats: &serde_json::Value, field: &str) -> Vec<i64> {
    stats["sources"]["partitions"]
        .as_array()
        .map(|ps| ps.iter().map(|p| p[field].as_i64().unwrap_or(-1)).collect())
        .unwrap_or_default()
}

/// Waits (up to two minutes) until `kv` has applied everything up to `log_end`; its stats.
fn wait_caught_up(kv: &Kvindex, log_end: i64) -> serde_json::Value {
    wait_for("kvindex to catch up", Duration::from_secs(120), || {
        let s = kv.stats();
        caught_up(&s, log_end).then_some(s)
    })
}

/// Publishes `requests` fleet requests into `log`, folding them into `reference` too; how many
/// messages that took.
async fn produce(log: &mut Log, fleet: &mut Fleet, reference: &Index, requests: usize) -> usize {
    let mut sent = 0;
    for _ in 0..requests {
        let events = fleet.next_request();
        for ev in &events {
            let _ = reference.apply(ev, 0);
        }
        sent += log.publish(&events).await;
    }
    sent
}

/// SIGABRT, what `std::process::abort` dies of.
const SIGABRT: i32 = 6;

/// Waits up to `seconds` for `child` to exit by itself (its status), else SIGKILLs it (`None`).
fn exit_within(child: &mut Child, seconds: u64) -> Option<ExitStatus> {
    let deadline = std::time::Instant::now() + Duration::from_secs(seconds);
    while std::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}
