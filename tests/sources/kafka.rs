//! The Kafka source against librdkafka's mock cluster (the embedded broker). Every test has its
//! own cluster on its own ephemeral port, so they run in parallel; every wait is bounded.

use kvindex::config::StartPosition;
use kvindex::event::encode;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::kafka::check_divergence;
use kvindex::source::{
    Checkpoints, Divergence, EmbeddedBroker, EventSource, KafkaPublisher, KafkaSettings,
    KafkaSource, Message,
};
use parking_lot::Mutex;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const TOPIC: &str = "kv-events";

/// A checkpoint store as the pipeline uses it: the test marks delivered messages as applied;
/// `persist_now` (or `persist`) makes them durable; `next_offset` reads the durable state.
#[derive(Default)]
struct TestCheckpoints {
    applied: Mutex<HashMap<i32, i64>>,
    durable: Mutex<HashMap<(String, i32), i64>>,
    persists: AtomicU64,
}

impl TestCheckpoints {
    fn store(&self, partition: i32, next: i64) {
        self.durable
            .lock()
            .insert((format!("kafka:{TOPIC}"), partition), next);
    }
    fn apply(&self, batch: &[Message]) {
        let mut a = self.applied.lock();
        for m in batch {
            a.insert(m.partition, m.offset + 1);
        }
    }
    fn persist(&self) {
        let applied = self.applied.lock().clone();
        for (p, o) in applied {
            self.store(p, o);
        }
    }
}

impl Checkpoints for TestCheckpoints {
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64> {
        self.durable
            .lock()
            .get(&(source.to_string(), partition))
            .copied()
    }
    fn persist_now(&self) {
        self.persists.fetch_add(1, Ordering::SeqCst);
        self.persist();
    }
}

fn settings(broker: &EmbeddedBroker, group: Option<&str>, start: StartPosition) -> KafkaSettings {
    KafkaSettings {
        brokers: broker.bootstrap_servers(),
        topic: TOPIC.into(),
        group_id: group.map(str::to_string),
        subscribe: group.is_some(),
        partitions: None,
        start,
        properties: BTreeMap::new(),
        reset_on_divergence: false,
        log_is_ephemeral: false,
    }
}

/// Publishes `n` small messages with keys `e0..e7`, returns when all are delivered.
async fn publish(broker: &EmbeddedBroker, n: usize, tag: &str) {
    let p = KafkaPublisher::new(&broker.bootstrap_servers(), TOPIC, &BTreeMap::new()).unwrap();
    for i in 0..n {
        let key = format!("e{}", i % 8);
        let payload = format!("{tag}-{i}");
        p.send(Some(&key), &[("model", "m")], payload.as_bytes())
            .await
            .unwrap();
    }
    p.flush(Duration::from_secs(30)).await.unwrap();
    assert_eq!(p.delivered(), n as u64);
}

/// Low and high watermarks of every partition.
fn watermarks(broker: &EmbeddedBroker) -> BTreeMap<i32, (i64, i64)> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .create()
        .unwrap();
    (0..broker.partitions())
        .map(|p| {
            (
                p,
                c.fetch_watermarks(TOPIC, p, Duration::from_secs(5))
                    .unwrap(),
            )
        })
        .collect()
}

/// Consumes until `want` messages arrived or `deadline` passed, marking them applied. Then
/// keeps polling for `settle` to catch duplicates.
async fn consume(
    src: &mut KafkaSource,
    cp: &TestCheckpoints,
    want: usize,
    deadline: Duration,
    settle: Duration,
) -> Vec<Message> {
    let mut out = Vec::new();
    let end = Instant::now() + deadline;
    while out.len() < want && Instant::now() < end {
        let batch = src
            .next_batch(500, Duration::from_millis(100))
            .await
            .unwrap();
        cp.apply(&batch);
        out.extend(batch);
    }
    let end = Instant::now() + settle;
    while Instant::now() < end {
        let batch = src
            .next_batch(500, Duration::from_millis(50))
            .await
            .unwrap();
        cp.apply(&batch);
        out.extend(batch);
    }
    out
}

/// Every partition's offsets, in delivery order.
fn by_partition(msgs: &[Message]) -> BTreeMap<i32, Vec<i64>> {
    let mut m: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    for x in msgs {
        m.entry(x.partition).or_default().push(x.offset);
    }
    m
}

/// Asserts that each partition delivered exactly `from[p]..high[p]`, once each, in order.
fn assert_exact(msgs: &[Message], from: &BTreeMap<i32, i64>, high: &BTreeMap<i32, (i64, i64)>) {
    let got = by_partition(msgs);
    for (&p, &(_, h)) in high {
        let start = from.get(&p).copied().unwrap_or(0);
        let want: Vec<i64> = (start..h).collect();
        let have = got.get(&p).cloned().unwrap_or_default();
        assert_eq!(have, want, "partition {p}");
    }
}

#[test]
fn divergence_rules() {
    assert_eq!(check_divergence(5, 0, 10), None);
    assert_eq!(check_divergence(10, 0, 10), None);
    assert_eq!(check_divergence(0, 0, 0), None);
    assert_eq!(
        check_divergence(11, 0, 10),
        Some(Divergence::AheadOfLog {
            stored: 11,
            high: 10
        })
    );
    assert_eq!(
        check_divergence(3, 4, 10),
        Some(Divergence::EventsDeleted { stored: 3, low: 4 })
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_broker_accepts_external_producers() {
    let broker = EmbeddedBroker::start(TOPIC, 16).unwrap();
    assert!(broker.bootstrap_servers().starts_with("127.0.0.1:"));
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .create()
        .unwrap();
    for i in 0..100 {
        let key = format!("k{i}");
        producer
            .send(
                FutureRecord::to(TOPIC).key(&key).payload("x"),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    let wm = watermarks(&broker);
    assert_eq!(wm.len(), 16, "the topic has 16 partitions");
    assert_eq!(wm.values().map(|(l, h)| h - l).sum::<i64>(), 100);
    // And consume it back with a plain client.
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .set("group.id", "reader")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..16 {
        tpl.add_partition_offset(TOPIC, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
    let (mut n, end) = (0, Instant::now() + Duration::from_secs(20));
    while n < 100 && Instant::now() < end {
        if let Some(Ok(_)) = c.poll(Duration::from_millis(100)) {
            n += 1;
        }
    }
    assert_eq!(n, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_consumes_every_offset_once_in_order() {
    let broker = EmbeddedBroker::start(TOPIC, 16).unwrap();
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), TOPIC, &BTreeMap::new()).unwrap();
    let mut fleet = Fleet::new(FleetSettings {
        engines: 12,
        ..FleetSettings::default()
    });
    let mut sent = 0usize;
    let mut engine_payloads: HashMap<String, usize> = HashMap::new();
    for _ in 0..300 {
        let events = fleet.next_request();
        for run in events.chunk_by(|a, b| a.engine == b.engine) {
            let engine = run[0].engine.clone();
            publisher
                .send(Some(&engine), &[], &encode::to_proto(run))
                .await
                .unwrap();
            *engine_payloads.entry(engine).or_default() += 1;
            sent += 1;
        }
    }
    publisher.flush(Duration::from_secs(30)).await.unwrap();
    let wm = watermarks(&broker);
    assert_eq!(wm.values().map(|w| w.1).sum::<i64>() as usize, sent);

    let cp = Arc::new(TestCheckpoints::default());
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g1"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    assert_eq!(src.name(), "kafka:kv-events");
    let msgs = consume(
        &mut src,
        &cp,
        sent,
        Duration::from_secs(40),
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(msgs.len(), sent);
    assert_exact(&msgs, &BTreeMap::new(), &wm);
    // Keys are engine ids, one engine per partition, payloads decode.
    let mut engine_partition: HashMap<String, i32> = HashMap::new();
    for m in &msgs {
        let e = m.engine.clone().expect("keyed by engine");
        assert_eq!(
            *engine_partition.entry(e).or_insert(m.partition),
            m.partition
        );
    }
    assert_eq!(engine_partition.len(), engine_payloads.len());
    // Status: every partition caught up to the high watermark seen at start.
    let starts: BTreeMap<i32, i64> = src.high_watermarks_at_start().into_iter().collect();
    assert_eq!(starts.len(), 16);
    for s in src.status() {
        assert_eq!(s.position, wm[&s.partition].1);
        assert!(s.position >= starts[&s.partition]);
        assert_eq!(s.divergence, None);
    }
    assert_eq!(src.divergences_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_from_checkpoint_not_from_broker_commits() {
    let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
    publish(&broker, 400, "a").await;
    let wm = watermarks(&broker);
    // The broker's committed offsets say 1 everywhere ...
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .set("group.id", "g2")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..4 {
        tpl.add_partition_offset(TOPIC, p, Offset::Offset(1))
            .unwrap();
    }
    c.commit(&tpl, CommitMode::Sync).unwrap();
    drop(c);
    // ... kvindex's checkpoint says half-way for partitions 0 and 1, nothing for 2 and 3.
    let cp = Arc::new(TestCheckpoints::default());
    let mut from = BTreeMap::new();
    for p in 0..2 {
        let half = wm[&p].1 / 2;
        cp.store(p, half);
        from.insert(p, half);
    }
    let want: i64 = wm
        .iter()
        .map(|(p, w)| w.1 - from.get(p).unwrap_or(&0))
        .sum();
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g2"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    let msgs = consume(
        &mut src,
        &cp,
        want as usize,
        Duration::from_secs(30),
        Duration::from_millis(500),
    )
    .await;
    assert_exact(&msgs, &from, &wm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_latest_and_timestamp_without_checkpoint() {
    // A future timestamp: no message at or after it, so the partitions start at the end.
    // (The mock cluster cannot look up offsets by time: any timestamp gives "end" there; real
    // Kafka resolves past timestamps to the first message at or after them.)
    let future_us = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64)
        + 3_600_000_000;
    for start in [StartPosition::Latest, StartPosition::TimeUs(future_us)] {
        let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
        publish(&broker, 100, "old").await;
        let before = watermarks(&broker);
        let cp = Arc::new(TestCheckpoints::default());
        let mut src = KafkaSource::connect(settings(&broker, Some("g3"), start), cp.clone())
            .await
            .unwrap();
        // Wait until every partition is positioned.
        let end = Instant::now() + Duration::from_secs(20);
        let mut early = Vec::new();
        while Instant::now() < end {
            early.extend(
                src.next_batch(100, Duration::from_millis(100))
                    .await
                    .unwrap(),
            );
            let st = src.status();
            if st.len() == 4 && st.iter().all(|s| s.position >= 0) {
                break;
            }
        }
        assert!(early.is_empty(), "{start:?}: old messages delivered");
        for s in src.status() {
            assert_eq!(s.position, before[&s.partition].1, "{start:?}");
        }
        publish(&broker, 100, "new").await;
        let after = watermarks(&broker);
        let from: BTreeMap<i32, i64> = before.iter().map(|(&p, w)| (p, w.1)).collect();
        let msgs = consume(
            &mut src,
            &cp,
            100,
            Duration::from_secs(20),
            Duration::from_millis(300),
        )
        .await;
        assert!(msgs.iter().all(|m| m.payload.starts_with(b"new")));
        assert_exact(&msgs, &from, &after);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ahead_of_log_stops_the_partition_or_resets() {
    let broker = EmbeddedBroker::start(TOPIC, 2).unwrap();
    publish(&broker, 40, "a").await;
    let wm = watermarks(&broker);
    let (h0, h1) = (wm[&0].1, wm[&1].1);
    assert!(h0 > 0 && h1 > 0);

    // Reported and stopped.
    let cp = Arc::new(TestCheckpoints::default());
    cp.store(0, 1000);
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g4"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    let msgs = consume(
        &mut src,
        &cp,
        h1 as usize,
        Duration::from_secs(20),
        Duration::from_millis(500),
    )
    .await;
    assert!(msgs.iter().all(|m| m.partition == 1));
    assert_eq!(msgs.len() as i64, h1);
    let st = src.status();
    let p0 = st.iter().find(|s| s.partition == 0).unwrap();
    assert_eq!(
        p0.divergence,
        Some(Divergence::AheadOfLog {
            stored: 1000,
            high: h0
        })
    );
    assert_eq!(src.divergences_total(), 1);
    drop(src);

    // reset_on_divergence: partition 0 restarts from the configured start.
    let cp = Arc::new(TestCheckpoints::default());
    cp.store(0, 1000);
    let mut s = settings(&broker, Some("g5"), StartPosition::Earliest);
    s.reset_on_divergence = true;
    let mut src = KafkaSource::connect(s, cp.clone()).await.unwrap();
    let msgs = consume(
        &mut src,
        &cp,
        (h0 + h1) as usize,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    assert_exact(&msgs, &BTreeMap::new(), &wm);
    assert_eq!(src.divergences_total(), 0);
    assert!(src.status().iter().all(|s| s.divergence.is_none()));
    drop(src);

    // An ephemeral log (embedded broker restarted): back to the log start, not a divergence.
    let cp = Arc::new(TestCheckpoints::default());
    cp.store(0, 1000);
    let mut s = settings(&broker, None, StartPosition::Latest);
    s.log_is_ephemeral = true;
    let mut src = KafkaSource::connect(s, cp.clone()).await.unwrap();
    let msgs = consume(
        &mut src,
        &cp,
        h0 as usize,
        Duration::from_secs(20),
        Duration::from_millis(300),
    )
    .await;
    // Partition 0 from its log start; partition 1 (no checkpoint) from `latest`.
    let mut only0 = wm.clone();
    only0.insert(1, (0, 0));
    assert_exact(&msgs, &BTreeMap::new(), &only0);
    assert_eq!(src.divergences_total(), 0);
    // And the caller is told to forget what it applied of the old log, so the new log's
    // messages (whose offsets start over) are not skipped as duplicates.
    assert_eq!(src.take_resets(), vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_deleted_is_a_divergence() {
    // The mock keeps ≤ 5 MiB per partition: 8 MiB in 128 KiB messages moves the log start.
    let broker = EmbeddedBroker::start(TOPIC, 1).unwrap();
    let p = KafkaPublisher::new(&broker.bootstrap_servers(), TOPIC, &BTreeMap::new()).unwrap();
    let big = vec![7u8; 128 * 1024];
    for _ in 0..64 {
        p.send(Some("e"), &[], &big).await.unwrap();
    }
    p.flush(Duration::from_secs(30)).await.unwrap();
    let (low, high) = watermarks(&broker)[&0];
    assert!(
        low > 1,
        "mock retention should have moved the log start (low {low})"
    );
    assert_eq!(high, 64);

    let cp = Arc::new(TestCheckpoints::default());
    cp.store(0, 1);
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g6"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    let msgs = consume(
        &mut src,
        &cp,
        1,
        Duration::from_secs(5),
        Duration::from_millis(300),
    )
    .await;
    assert!(msgs.is_empty());
    let st = src.status();
    assert_eq!(
        st[0].divergence,
        Some(Divergence::EventsDeleted { stored: 1, low })
    );
    assert_eq!(src.divergences_total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_broker_down_and_request_errors() {
    let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
    publish(&broker, 300, "a").await;
    let cp = Arc::new(TestCheckpoints::default());
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g7"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    let mut msgs = consume(&mut src, &cp, 100, Duration::from_secs(20), Duration::ZERO).await;
    assert!(msgs.len() >= 100);

    // Broker down: empty batches, bounded waits, no error.
    broker.mock().broker_down(1).unwrap();
    let t = Instant::now();
    for _ in 0..20 {
        let b = src
            .next_batch(100, Duration::from_millis(100))
            .await
            .unwrap();
        cp.apply(&b);
        msgs.extend(b);
    }
    assert!(t.elapsed() < Duration::from_secs(10));
    let trouble = src.trouble();
    assert!(trouble.is_some(), "the status says why nothing arrives");
    broker.mock().broker_up(1).unwrap();

    // Failing fetches and dropped connections mid-stream.
    let mock = broker.mock();
    mock.request_errors(
        RDKafkaApiKey::Fetch,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
        ],
    );
    mock.request_errors(
        RDKafkaApiKey::Heartbeat,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT],
    );
    drop(mock);
    publish(&broker, 300, "b").await;
    let wm = watermarks(&broker);
    let total = wm.values().map(|w| w.1).sum::<i64>() as usize;
    assert_eq!(total, 600);
    let rest = consume(
        &mut src,
        &cp,
        total - msgs.len(),
        Duration::from_secs(40),
        Duration::from_millis(500),
    )
    .await;
    msgs.extend(rest);
    assert_exact(&msgs, &BTreeMap::new(), &wm);
    // Once the brokers answer again, the trouble is over (the next watermark refresh says so).
    let end = Instant::now() + Duration::from_secs(10);
    while src.trouble().is_some() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(src.trouble(), None, "was: {trouble:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_persists_before_release() {
    let broker = EmbeddedBroker::start(TOPIC, 4).unwrap();
    publish(&broker, 200, "a").await;
    let wm = watermarks(&broker);
    // One store shared by both members, as if they were one replica set's checkpoint.
    let cp = Arc::new(TestCheckpoints::default());
    // The mock cluster waits up to session.timeout.ms − 1 s for members to rejoin when a member
    // joins a stable group (44 s with the default 45 s): keep it short here.
    let member = || {
        let mut s = settings(&broker, Some("g8"), StartPosition::Earliest);
        s.properties
            .insert("session.timeout.ms".into(), "6000".into());
        s.properties
            .insert("heartbeat.interval.ms".into(), "500".into());
        s
    };
    let mut a = KafkaSource::connect(member(), cp.clone()).await.unwrap();
    let first = consume(
        &mut a,
        &cp,
        200,
        Duration::from_secs(20),
        Duration::from_millis(200),
    )
    .await;
    assert_eq!(first.len(), 200);
    assert_eq!(cp.persists.load(Ordering::SeqCst), 0);

    let mut b = KafkaSource::connect(member(), cp.clone()).await.unwrap();
    let end = Instant::now() + Duration::from_secs(30);
    let mut late = Vec::new();
    while Instant::now() < end && (b.status().is_empty() || a.status().len() == 4) {
        let x = a.next_batch(100, Duration::from_millis(50)).await.unwrap();
        let y = b.next_batch(100, Duration::from_millis(50)).await.unwrap();
        cp.apply(&x);
        cp.apply(&y);
        late.extend(x);
        late.extend(y);
    }
    assert!(!b.status().is_empty(), "second member got no partitions");
    assert!(a.status().len() < 4, "first member kept every partition");
    assert!(
        cp.persists.load(Ordering::SeqCst) >= 1,
        "persist_now not called"
    );
    // B starts where A's persisted checkpoint says: nothing is delivered twice.
    assert!(late.is_empty(), "re-delivered {} messages", late.len());
    for s in b.status() {
        assert_eq!(s.position, wm[&s.partition].1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_sets_broker_offsets() {
    let broker = EmbeddedBroker::start(TOPIC, 2).unwrap();
    publish(&broker, 50, "a").await;
    let cp = Arc::new(TestCheckpoints::default());
    let mut src = KafkaSource::connect(
        settings(&broker, Some("g9"), StartPosition::Earliest),
        cp.clone(),
    )
    .await
    .unwrap();
    consume(&mut src, &cp, 50, Duration::from_secs(20), Duration::ZERO).await;
    src.commit(&[(0, 3), (1, 5)]).await.unwrap();
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .set("group.id", "g9")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(TOPIC, 0);
    tpl.add_partition(TOPIC, 1);
    let end = Instant::now() + Duration::from_secs(15);
    let mut got = Vec::new();
    while Instant::now() < end {
        // Serves the async commit's completion.
        src.next_batch(10, Duration::from_millis(50)).await.unwrap();
        let c = reader
            .committed_offsets(tpl.clone(), Duration::from_secs(5))
            .unwrap();
        got = c
            .elements()
            .iter()
            .map(|e| (e.partition(), e.offset()))
            .collect();
        if got == vec![(0, Offset::Offset(3)), (1, Offset::Offset(5))] {
            break;
        }
    }
    assert_eq!(got, vec![(0, Offset::Offset(3)), (1, Offset::Offset(5))]);
}
