//! What the end-to-end tests of `kvindex serve` share: a seeded fleet's events produced to
//! Kafka or NATS and folded into a reference index, lookups over HTTP against the reference's,
//! and waiting for a process to catch up.

use crate::support::*;
use kvindex::event::PartitionKey;
use kvindex::index::{Index, IndexSettings};
use kvindex::sim::Fleet;
use kvindex::source::nats::NatsPublisher;
use kvindex::source::{EmbeddedBroker, KafkaPublisher};
use serde_json::{Value, json};
use std::time::Duration;

pub const SEED: u64 = 0x6b76_696e_6465_7831;
pub const START: Duration = Duration::from_secs(60);
pub const CATCH_UP: Duration = Duration::from_secs(90);

/// Produces `requests` fleet requests, applying them to `reference` too; returns messages.
pub async fn produce(
    publisher: &KafkaPublisher,
    fleet: &mut Fleet,
    reference: &Index,
    requests: usize,
) -> usize {
    let mut messages = 0;
    for _ in 0..requests {
        let events = fleet.next_request();
        for ev in &events {
            let _ = reference.apply(ev, 0);
        }
        messages += publish_kafka(publisher, &events).await;
    }
    publisher.flush(Duration::from_secs(30)).await.unwrap();
    messages
}

pub fn reference_index(shards: usize) -> Index {
    Index::new(IndexSettings { shards, seed: SEED })
}

/// The lookup answer over HTTP, as sorted (engine, matched blocks) pairs.
pub fn http_answer(kv: &Kvindex, partition: &PartitionKey, tokens: &[u32]) -> Vec<(String, u64)> {
    let (status, body) = kv.post(
        "/v1/lookup",
        &json!({
            "tenant": partition.tenant, "model": partition.model, "adapter": partition.adapter,
            "token_ids": tokens, "block_size": 16,
        }),
    );
    assert_eq!(status, 200, "{body}");
    let mut rows: Vec<(String, u64)> = body["engines"]
        .as_array()
        .unwrap_or_else(|| panic!("no engines in {body}"))
        .iter()
        .map(|r| {
            (
                r["engine_id"].as_str().unwrap().to_string(),
                r["matched_blocks"].as_u64().unwrap(),
            )
        })
        .collect();
    rows.sort();
    rows
}

pub fn reference_answer(
    index: &Index,
    partition: &PartitionKey,
    tokens: &[u32],
) -> Vec<(String, u64)> {
    let blocks = kvindex::index::QueryBlocks::Tokens {
        token_ids: tokens.to_vec(),
        block_size: 16,
        extras: Vec::new(),
    };
    let mut rows: Vec<_> = index
        .lookup(partition, &blocks)
        .1
        .to_vec()
        .into_iter()
        .map(|m| (m.engine_id, m.matched_blocks as u64))
        .collect();
    rows.sort();
    rows
}

/// Waits until the log shows at least `log_end` (see `caught_up`) and all of it is applied.
pub fn wait_caught_up(kv: &Kvindex, log_end: usize) -> Value {
    wait_for("kvindex to catch up", CATCH_UP, || {
        let s = kv.stats();
        caught_up(&s, log_end as i64).then_some(s)
    })
}

/// Readiness once caught up: the source loop re-evaluates it every acknowledgement tick
/// (100 ms), so it may trail the stats by one tick (more on a loaded machine).
pub fn wait_ready(kv: &Kvindex) {
    wait_for("/readyz to answer 200", CATCH_UP, || {
        let (status, _) = kv.get("/readyz");
        (status == 200).then_some(())
    })
}

pub fn sum(stats: &Value, field: &str) -> u64 {
    stats["sources"]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[field].as_u64().unwrap_or(0))
        .sum()
}

pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

pub async fn nats_publisher() -> NatsPublisher {
    NatsPublisher::connect("nats://127.0.0.1:4222", true)
        .await
        .expect(
            "NATS with JetStream must be running at 127.0.0.1:4222 (scripts/setup.sh starts it)",
        )
}

/// Publishes `requests` fleet requests to NATS, applying them to `reference` too, and waits for
/// the server's acks; returns how many messages were published.
pub async fn produce_nats(
    p: &mut NatsPublisher,
    prefix: &str,
    fleet: &mut Fleet,
    reference: &Index,
    requests: usize,
) -> usize {
    let mut sent = 0;
    for _ in 0..requests {
        let events = fleet.next_request();
        for ev in &events {
            let _ = reference.apply(ev, 0);
        }
        sent += publish_nats(p, prefix, &events).await;
    }
    p.flush().await.unwrap();
    sent
}

/// Offsets `group` has committed on `topic`, by partition (-1: none).
pub fn committed(broker: &EmbeddedBroker, topic: &str, group: &str, partitions: i32) -> Vec<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .set("group.id", group)
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(5))
        .unwrap();
    (0..partitions)
        .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
            Some(rdkafka::Offset::Offset(o)) => o,
            _ => -1,
        })
        .collect()
}
