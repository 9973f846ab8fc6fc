//! The real `kvindex produce` binary publishing to brokers, read back with independent clients:
//!
//! - Kafka: the embedded broker (librdkafka's mock cluster, its own ephemeral port per test),
//!   consumed back with a plain rdkafka consumer;
//! - NATS JetStream at 127.0.0.1:4222 (tests fail, loudly, if it is not running), each test
//!   with its own uniquely named stream and subjects, deleted at the end (also on failure);
//! - a file (`--out`) for the `--rate` cap.
//!
//! What was published is compared with the same fleet simulated here: every payload decodes,
//! is keyed by (Kafka) or addressed to (NATS subject) the engine whose events it holds, and each
//! engine's events arrive complete and in order.

use crate::support::{require_nats, unique_id};
use kvindex::event::{DecodeSettings, Envelope, Event, EventKind, Format, decode_payload};
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::EmbeddedBroker;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const NATS_URL: &str = "nats://127.0.0.1:4222";
const ENGINES: usize = 6;

/// The closing summary of a `kvindex produce` run.
#[derive(Debug, Default)]
struct Summary {
    payloads: u64,
    events: u64,
    block_events: u64,
    bytes: u64,
    seconds: f64,
}

/// Parses "produced P payloads, E events, B block events, N bytes in S s: ...".
fn parse_summary(stderr: &str) -> Summary {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("produced "))
        .unwrap_or_else(|| panic!("no summary line in stderr:\n{stderr}"));
    let words: Vec<&str> = line
        .split([' ', ',', ':'])
        .filter(|w| !w.is_empty())
        .collect();
    let before = |label: &str| -> &str {
        let i = words
            .iter()
            .position(|w| *w == label)
            .unwrap_or_else(|| panic!("no `{label}` in summary: {line}"));
        words[i - 1]
    };
    let num = |label: &str| -> u64 {
        before(label)
            .parse()
            .unwrap_or_else(|e| panic!("`{label}` in {line}: {e}"))
    };
    let seconds_at = words
        .iter()
        .position(|w| *w == "in")
        .expect("`in` in summary")
        + 1;
    Summary {
        payloads: num("payloads"),
        events: num("events"),
        block_events: words
            .windows(3)
            .find(|w| w[1] == "block" && w[2] == "events")
            .map(|w| w[0].parse().expect("block events count"))
            .expect("block events in summary"),
        bytes: num("bytes"),
        seconds: words[seconds_at].parse().expect("duration in summary"),
    }
}

/// Runs `kvindex produce ARGS` to completion (bounded) and returns its summary.
fn run_produce(args: &[&str]) -> Summary {
    let bin = env!("CARGO_BIN_EXE_kvindex");
    let mut child = Command::new(bin)
        .arg("produce")
        .args(args)
        .env("KVINDEX_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kvindex produce");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvindex produce {args:?} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("produce output");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "kvindex produce {args:?} failed ({}):\n{stderr}",
        out.status
    );
    println!("{}", stderr.trim());
    parse_summary(&stderr)
}

fn fleet_config(requests_seed: u64) -> FleetSettings {
    // What `kvindex produce --engines 6 --seed S` simulates (CLI defaults for the rest).
    FleetSettings {
        engines: ENGINES,
        adapters: 2,
        tenants: 1,
        models: 1,
        block_size: 16,
        seed: requests_seed,
        ..FleetSettings::default()
    }
}

/// What the fleet publishes, per engine: one entry per payload (one engine's events of one
/// request), with the events a payload of `format` carries.
fn expected_payloads(
    seed: u64,
    requests: u64,
    format: Format,
) -> BTreeMap<String, Vec<Vec<Event>>> {
    let mut fleet = Fleet::new(fleet_config(seed));
    let mut out: BTreeMap<String, Vec<Vec<Event>>> = BTreeMap::new();
    for _ in 0..requests {
        let events = fleet.next_request();
        for run in events.chunk_by(|a, b| a.engine == b.engine) {
            let kept: Vec<Event> = run
                .iter()
                .filter(|e| format != Format::Vllm || e.kind != EventKind::ReplicaUpdated)
                .cloned()
                .collect();
            if !kept.is_empty() {
                out.entry(kept[0].engine.clone()).or_default().push(kept);
            }
        }
    }
    out
}

fn total<T>(m: &BTreeMap<String, Vec<T>>) -> u64 {
    m.values().map(|v| v.len() as u64).sum()
}

/// Reads every message of `topic` from the beginning until `want` arrived (bounded):
/// (partition, key, payload).
fn consume_all(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    want: u64,
) -> Vec<(i32, String, Vec<u8>)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "produce-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (got.len() as u64) < want && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                assert!(
                    m.headers().is_none_or(|h| h.count() == 0),
                    "proto payloads need no headers"
                );
                let key = String::from_utf8(m.key().expect("every message has a key").to_vec())
                    .expect("utf-8 key");
                got.push((m.partition(), key, m.payload().unwrap_or_default().to_vec()));
            }
            Some(Err(e)) => panic!("consume: {e}"),
            None => {}
        }
    }
    // Nothing beyond what was expected arrives.
    let extra = consumer.poll(Duration::from_millis(500));
    assert!(extra.is_none(), "more messages than produced");
    got
}

#[test]
fn produces_to_kafka_keyed_by_engine() {
    let topic = format!("kv-events-{}", unique_id("p"));
    let broker = EmbeddedBroker::start(&topic, 16).expect("embedded broker");
    let (seed, requests) = (7, 1500);
    let summary = run_produce(&[
        "--kafka",
        &broker.bootstrap_servers(),
        "--topic",
        &topic,
        "--engines",
        &ENGINES.to_string(),
        "--seed",
        &seed.to_string(),
        "--requests",
        &requests.to_string(),
    ]);
    let expected = expected_payloads(seed, requests, Format::Proto);
    assert_eq!(summary.payloads, total(&expected), "{summary:?}");
    assert_eq!(
        summary.events,
        expected
            .values()
            .flatten()
            .map(|p| p.len() as u64)
            .sum::<u64>()
    );
    assert_eq!(
        summary.block_events,
        expected
            .values()
            .flatten()
            .flatten()
            .map(|e| e.block_ops() as u64)
            .sum::<u64>()
    );

    let messages = consume_all(&broker.bootstrap_servers(), &topic, 16, summary.payloads);
    assert_eq!(
        messages.len() as u64,
        summary.payloads,
        "every payload arrived once"
    );
    assert_eq!(
        messages.iter().map(|m| m.2.len() as u64).sum::<u64>(),
        summary.bytes
    );
    let opts = DecodeSettings::default();
    let mut got: BTreeMap<String, Vec<Vec<Event>>> = BTreeMap::new();
    let mut partitions: BTreeMap<String, BTreeSet<i32>> = BTreeMap::new();
    for (partition, key, payload) in &messages {
        let decoded = decode_payload(payload, &Envelope::default(), &opts)
            .unwrap_or_else(|e| panic!("payload on partition {partition} does not decode: {e}"));
        assert!(decoded.skipped.is_empty());
        assert!(
            decoded.events.iter().all(|e| &e.engine == key),
            "the key is the engine of every event in the payload"
        );
        got.entry(key.clone()).or_default().push(decoded.events);
        partitions
            .entry(key.clone())
            .or_default()
            .insert(*partition);
    }
    assert_eq!(got.len(), ENGINES);
    assert!(
        partitions.values().all(|p| p.len() == 1),
        "one engine, one partition: {partitions:?}"
    );
    // Per engine, complete and in order (one partition keeps one engine's order).
    assert_eq!(got, expected);
}

#[test]
fn rate_caps_events_per_second() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("events.bin");
    let summary = run_produce(&[
        "--out",
        out.to_str().expect("utf-8 path"),
        "--engines",
        &ENGINES.to_string(),
        "--requests",
        "600",
        "--rate",
        "1000",
    ]);
    let floor = summary.events as f64 / 1000.0;
    assert!(summary.events > 500, "{summary:?}");
    assert!(
        summary.seconds >= floor * 0.95,
        "{} events at ≤ 1000/s took only {:.3} s",
        summary.events,
        summary.seconds
    );
    assert_eq!(count_frames(&out), summary.payloads);
}

#[test]
fn block_rate_caps_block_events_per_second() {
    let summary = run_produce(&[
        "--engines",
        &ENGINES.to_string(),
        "--requests",
        "600",
        "--block-rate",
        "50000",
    ]);
    let floor = summary.block_events as f64 / 50_000.0;
    assert!(summary.block_events > 20_000, "{summary:?}");
    assert!(
        summary.seconds >= floor * 0.95,
        "{} block events at ≤ 50,000/s took only {:.3} s",
        summary.block_events,
        summary.seconds
    );
}

/// Payloads in a length-framed `--out` file.
fn count_frames(path: &Path) -> u64 {
    let bytes = std::fs::read(path).expect("read output");
    let (mut at, mut n) = (0usize, 0u64);
    while at < bytes.len() {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().expect("frame header"));
        at += 4 + len as usize;
        n += 1;
    }
    assert_eq!(at, bytes.len(), "frames cover the file exactly");
    n
}

// ---------------------------------------------------------------------------------------------
// NATS JetStream

/// Deletes the test's stream when dropped (also when the test panics).
struct StreamGuard {
    stream: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let stream = self.stream.clone();
        // Drop cannot await: delete from a throwaway runtime on another thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let connect = async_nats::ConnectOptions::new()
                    .connection_timeout(Duration::from_secs(2))
                    .connect(NATS_URL);
                if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(3), connect).await
                {
                    let js = async_nats::jetstream::new(client);
                    let _ = tokio::time::timeout(Duration::from_secs(3), js.delete_stream(&stream))
                        .await;
                }
            });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produces_to_nats_jetstream_by_engine_subject() {
    let client = require_nats(NATS_URL).await;
    let id = unique_id("p");
    let guard = StreamGuard {
        stream: format!("KVTEST_PRODUCE_{id}"),
    };
    let prefix = format!("kvtest.{id}.events");
    let (seed, requests) = (3, 800);
    let args: Vec<String> = [
        "--nats",
        NATS_URL,
        "--stream",
        &guard.stream,
        "--subject-prefix",
        &prefix,
        "--format",
        "vllm",
        "--engines",
        &ENGINES.to_string(),
        "--seed",
        &seed.to_string(),
        "--requests",
        &requests.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let summary = tokio::task::spawn_blocking(move || {
        run_produce(&args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .expect("produce task");
    let expected = expected_payloads(seed, requests, Format::Vllm);
    assert_eq!(summary.payloads, total(&expected), "{summary:?}");

    // The stream was created with `<prefix>.>` and holds every payload once.
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(&guard.stream).await.expect("stream created");
    let info = stream.info().await.expect("stream info").clone();
    assert_eq!(info.config.subjects, vec![format!("{prefix}.>")]);
    assert_eq!(info.state.messages, summary.payloads);

    // One subject per engine, `<prefix>.<engine>`, with that engine's payload count.
    let mut subjects = BTreeMap::new();
    let mut listing = stream
        .info_with_subjects(format!("{prefix}.>"))
        .await
        .expect("subjects");
    use futures::TryStreamExt;
    while let Some((subject, count)) = listing.try_next().await.expect("subject listing") {
        subjects.insert(subject, count);
    }
    let want: BTreeMap<String, usize> = expected
        .iter()
        .map(|(engine, p)| (format!("{prefix}.{engine}"), p.len()))
        .collect();
    assert_eq!(subjects, want);

    // Every payload decodes as vLLM with the engine from the subject and the model/tenant
    // headers, and each engine's events arrive complete and in order.
    let opts = DecodeSettings {
        format: Format::Vllm,
        ..DecodeSettings::default()
    };
    let mut got: BTreeMap<String, Vec<Vec<(EventKind, usize)>>> = BTreeMap::new();
    for seq in 1..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.expect("stored message");
        let engine = m
            .subject
            .as_str()
            .rsplit('.')
            .next()
            .expect("subject token")
            .to_string();
        let model = m.headers.get("model").map(|v| v.as_str().to_string());
        let tenant = m.headers.get("tenant").map(|v| v.as_str().to_string());
        assert!(model.is_some(), "vLLM payloads carry a model header");
        let env = Envelope {
            engine: Some(&engine),
            model: model.as_deref(),
            tenant: tenant.as_deref(),
            dp_rank: None,
        };
        let decoded = decode_payload(&m.payload, &env, &opts)
            .unwrap_or_else(|e| panic!("message {seq} does not decode: {e}"));
        assert!(decoded.skipped.is_empty());
        got.entry(engine).or_default().push(
            decoded
                .events
                .iter()
                .map(|e| (e.kind, e.block_ops()))
                .collect(),
        );
    }
    let want: BTreeMap<String, Vec<Vec<(EventKind, usize)>>> = expected
        .iter()
        .map(|(engine, payloads)| {
            let shapes = payloads
                .iter()
                .map(|p| p.iter().map(|e| (e.kind, e.block_ops())).collect())
                .collect();
            (engine.clone(), shapes)
        })
        .collect();
    assert_eq!(got, want);
    drop(guard);
}
