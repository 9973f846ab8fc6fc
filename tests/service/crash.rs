//! Crash safety of the real binary: `kvindex serve` consumes a Kafka topic (a librdkafka mock
//! cluster owned by this test, so the log outlives every kvindex process) and is SIGKILLed at
//! random moments, 24 times (while starting, consuming and committing), while events keep
//! arriving. After a last clean run has caught up, its durable state, loaded the way a restart
//! loads it, must equal a reference index folded over every produced event: nothing lost.
//! Nothing is applied out of order either: a re-read after a crash re-applies a suffix of a
//! partition in order, onto state that already holds it, which converges because every
//! mutation is an assignment; that the re-read is skipped (and counted) rather than re-applied
//! is pinned by `tests/pipeline_durable.rs`.
//!
//! It runs three times: with the default L1 budget (everything fits in memory), with a tiny one
//! (64 KiB), so most of the state lives only in RocksDB (L2) and every crash also interrupts
//! eviction and read-through, and with a tiny one while engines reuse block hashes for other
//! content.

use crate::support::*;
use kvindex::config::Config;
use kvindex::index::{Index, IndexSettings};
use kvindex::service::Service;
use kvindex::sim::{Fleet, FleetSettings, Rng};
use kvindex::source::{EmbeddedBroker, KafkaPublisher};
use std::process::{Command, Stdio};
use std::time::Duration;

const TOPIC: &str = "kv-crash";
const TRIALS: usize = 24;
const REQUESTS_PER_TRIAL: usize = 120;
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
    crash_trials(None, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_a_tiny_l1_loses_nothing_either() {
    crash_trials(Some(64 << 10), false).await;
}

/// Engines that reuse a block hash for other content once the first is gone: replaying a log
/// suffix is only exact if L2 never holds rows newer than the offsets stored with it (eviction
/// commits first), since a newer row for a reused parent hash would re-key its children.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_reused_hashes_and_a_tiny_l1_loses_nothing_either() {
    crash_trials(Some(64 << 10), true).await;
}

async fn crash_trials(l1_max_bytes: Option<u64>, reuse_hashes: bool) {
    let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
    let l1 = l1_max_bytes
        .map(|b| format!("l1_max_bytes = {b}"))
        .unwrap_or_default();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "kafka"
[source.kafka]
brokers = "{}"
topic = "{TOPIC}"
group_id = ""
start = "earliest"
[index]
shards = 2
seed = {SEED}
{l1}
[checkpoint]
interval_ms = 20
"#,
            broker.bootstrap_servers()
        ),
    );
    let data = dir.path().join("data");
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), TOPIC, &Default::default()).unwrap();
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

    for trial in 0..TRIALS {
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
            for _ in 0..REQUESTS_PER_TRIAL / 4 {
                let events = fleet.next_request();
                for ev in &events {
                    let _ = reference.apply(ev, 0);
                }
                sent += publish_kafka(&publisher, &events).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.range(0, 400) as u64)).await;
            child.kill().unwrap();
            child.wait().unwrap();
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
        for _ in 0..REQUESTS_PER_TRIAL {
            let events = fleet.next_request();
            for ev in &events {
                let _ = reference.apply(ev, 0);
            }
            sent += publish_kafka(&publisher, &events).await;
        }
        if trial % 6 == 0 {
            queries.extend((0..8).map(|_| fleet.sample_query()));
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 700) as u64)).await;
        kv.kill9();
    }
    publisher.flush(Duration::from_secs(30)).await.unwrap();
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
    let stats = tokio::task::block_in_place(|| {
        wait_for(
            "the final run to catch up",
            Duration::from_secs(120),
            || {
                let s = kv.stats();
                caught_up(&s, sent as i64).then_some(s)
            },
        )
    });
    let duplicates: u64 = stats["sources"]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["duplicates_skipped"].as_u64().unwrap())
        .sum();
    tokio::task::block_in_place(|| kv.terminate());

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
        "{TRIALS} kills survived: {} memberships, {} engines, {} queries agree; the last run \
         skipped {duplicates} duplicate events",
        want.partitions.iter().map(|p| p.2).sum::<u64>(),
        want.engines.len(),
        queries.len()
    );
}
