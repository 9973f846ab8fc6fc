//! The NATS source against a real NATS server with JetStream at 127.0.0.1:4222 (tests fail,
//! loudly, if it is not running), plus one private `nats-server` the fault test kills and
//! restarts. Every test uses its own uniquely named stream and subjects (`kvtest.<id>.>`),
//! deletes them at the end (also on failure), and bounds every wait.

use crate::support::{PrivateServer, require_nats, unique_id};
use kvindex::event::encode;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::{
    Checkpoints, Divergence, EventSource, Message, NatsPublisher, NatsSettings, NatsSource,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A checkpoint store in memory.
#[derive(Default)]
struct MemCheckpoints(Mutex<HashMap<(String, i32), i64>>);

impl MemCheckpoints {
    fn with(source: &str, next: i64) -> Arc<MemCheckpoints> {
        let c = MemCheckpoints::default();
        c.set(source, next);
        Arc::new(c)
    }
    fn set(&self, source: &str, next: i64) {
        self.0.lock().unwrap().insert((source.to_string(), 0), next);
    }
}

impl Checkpoints for MemCheckpoints {
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64> {
        self.0
            .lock()
            .unwrap()
            .get(&(source.to_string(), partition))
            .copied()
    }
    fn persist_now(&self) {}
}

fn none() -> Arc<MemCheckpoints> {
    Arc::new(MemCheckpoints::default())
}

/// One test's stream and subjects; deletes the stream when dropped (also on panic).
struct TestStream {
    id: String,
    url: String,
}

impl TestStream {
    fn new(url: &str) -> TestStream {
        TestStream {
            id: unique_id("t"),
            url: url.to_string(),
        }
    }
    fn stream(&self) -> String {
        format!("KVTEST_{}", self.id)
    }
    fn subject(&self, engine: &str) -> String {
        format!("kvtest.{}.events.{engine}", self.id)
    }
    fn settings(&self) -> NatsSettings {
        NatsSettings {
            url: self.url.clone(),
            stream: self.stream(),
            subjects: vec![format!("kvtest.{}.>", self.id)],
            durable: "kvindex".into(),
            engine_token: -1,
            jetstream: true,
            reset_on_divergence: false,
            auth: Default::default(),
            owner: "test-replica".into(),
            transient: false,
        }
    }
    fn source_name(&self) -> String {
        format!("nats:{}", self.stream())
    }
    async fn context(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(require_nats(&self.url).await)
    }
    async fn js_stream(&self) -> async_nats::jetstream::stream::Stream {
        self.context()
            .await
            .get_stream(self.stream())
            .await
            .expect("test stream exists")
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (url, stream) = (self.url.clone(), self.stream());
        // Drop cannot await: delete from a throwaway runtime on another thread.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let connect = async_nats::ConnectOptions::new()
                    .connection_timeout(Duration::from_secs(2))
                    .connect(url.as_str());
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

async fn connect(ts: &TestStream, settings: NatsSettings, cp: Arc<MemCheckpoints>) -> NatsSource {
    let _ = require_nats(&ts.url).await;
    tokio::time::timeout(Duration::from_secs(20), NatsSource::connect(settings, cp))
        .await
        .expect("NatsSource::connect timed out")
        .expect("NatsSource::connect")
}

async fn publisher(url: &str, jetstream: bool) -> NatsPublisher {
    let _ = require_nats(url).await;
    NatsPublisher::connect(url, jetstream)
        .await
        .expect("publisher connects")
}

/// What a published message should come back as.
#[derive(Clone, Debug)]
struct Expected {
    engine: String,
    model: String,
    tenant: String,
    payload: Vec<u8>,
}

/// Publishes `n` fleet events, one protobuf payload each, on `kvtest.<id>.events.<engine>`
/// with `model` / `tenant` headers.
async fn publish_fleet(
    p: &mut NatsPublisher,
    ts: &TestStream,
    n: usize,
    seed: u64,
) -> Vec<Expected> {
    let mut fleet = Fleet::new(FleetSettings {
        engines: 4,
        seed,
        ..FleetSettings::default()
    });
    let mut out = Vec::new();
    while out.len() < n {
        for ev in fleet.next_request() {
            if out.len() == n {
                break;
            }
            let e = Expected {
                engine: ev.engine.clone(),
                model: ev.partition.model.clone(),
                tenant: format!("tenant-{}", ev.partition.tenant),
                payload: encode::to_proto(std::slice::from_ref(&ev)),
            };
            p.send(
                &ts.subject(&e.engine),
                &[("model", e.model.as_str()), ("tenant", e.tenant.as_str())],
                e.payload.clone(),
            )
            .await
            .expect("publish");
            out.push(e);
        }
    }
    p.flush().await.expect("publish flush");
    out
}

/// Publishes `n` small messages `msg-<i>` to `kvtest.<id>.events.e<i % 3>`.
async fn publish_simple(p: &mut NatsPublisher, ts: &TestStream, range: std::ops::Range<usize>) {
    for i in range {
        p.send(
            &ts.subject(&format!("e{}", i % 3)),
            &[("model", "m")],
            format!("msg-{i}").into_bytes(),
        )
        .await
        .expect("publish");
    }
    p.flush().await.expect("publish flush");
}

/// Reads until `n` messages arrived; panics after `limit`.
async fn collect(src: &mut NatsSource, n: usize, limit: Duration) -> Vec<Message> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            start.elapsed() < limit,
            "only {} of {n} messages within {limit:?}; got offsets {:?}; status {:?}",
            out.len(),
            out.iter().map(|m: &Message| m.offset).collect::<Vec<_>>(),
            src.status()
        );
        let batch = src
            .next_batch(n - out.len(), Duration::from_millis(200))
            .await
            .expect("next_batch");
        out.extend(batch);
    }
    out
}

/// Asserts nothing more arrives within `quiet`.
async fn assert_quiet(src: &mut NatsSource, quiet: Duration) {
    let start = Instant::now();
    while start.elapsed() < quiet {
        let batch = src
            .next_batch(100, Duration::from_millis(100))
            .await
            .expect("next_batch");
        assert!(
            batch.is_empty(),
            "expected nothing more, got offsets {:?}",
            batch.iter().map(|m| m.offset).collect::<Vec<_>>()
        );
    }
}

fn offsets(msgs: &[Message]) -> Vec<i64> {
    msgs.iter().map(|m| m.offset).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_every_sequence_once_in_order() {
    let ts = TestStream::new(NATS_URL);
    let mut src = connect(&ts, ts.settings(), none()).await;
    assert_eq!(src.name(), ts.source_name());
    assert_eq!(
        src.high_watermarks_at_start(),
        [(0, 1)],
        "empty stream at start"
    );
    let mut p = publisher(&ts.url, true).await;
    let expected = publish_fleet(&mut p, &ts, 300, 7).await;

    let got = collect(&mut src, expected.len(), Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (1..=300).collect::<Vec<i64>>());
    for (m, e) in got.iter().zip(&expected) {
        assert_eq!(m.partition, 0);
        assert_eq!(m.engine.as_deref(), Some(e.engine.as_str()), "engine token");
        assert_eq!(m.model.as_deref(), Some(e.model.as_str()), "model header");
        assert_eq!(
            m.tenant.as_deref(),
            Some(e.tenant.as_str()),
            "tenant header"
        );
        assert_eq!(m.payload, e.payload);
    }
    assert!(
        got.iter()
            .map(|m| m.engine.clone())
            .collect::<BTreeSet<_>>()
            .len()
            > 1
    );
    assert_quiet(&mut src, Duration::from_millis(500)).await;
    let st = &src.status()[0];
    assert_eq!(
        (st.partition, st.position, st.high_watermark),
        (0, 301, 301)
    );
    assert_eq!(st.divergence, None);
    src.commit(&[(0, 301)]).await.unwrap();

    // Another token: the first one (`kvtest`), counted from the start.
    let settings = NatsSettings {
        engine_token: 0,
        durable: "other".into(),
        ..ts.settings()
    };
    let mut other = connect(&ts, settings, none()).await;
    assert_eq!(other.high_watermarks_at_start(), [(0, 301)]);
    let got = collect(&mut other, 300, Duration::from_secs(20)).await;
    assert!(got.iter().all(|m| m.engine.as_deref() == Some("kvtest")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_wins_over_the_consumer_ack_floor() {
    let ts = TestStream::new(NATS_URL);
    let mut p = publisher(&ts.url, true).await;
    p.ensure_stream(&ts.stream(), &ts.settings().subjects)
        .await
        .unwrap();
    publish_simple(&mut p, &ts, 0..50).await;

    // The durable consumer reads everything but acks only below 11.
    let mut a = connect(&ts, ts.settings(), none()).await;
    assert_eq!(a.high_watermarks_at_start(), [(0, 51)]);
    let got = collect(&mut a, 50, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (1..=50).collect::<Vec<i64>>());
    a.commit(&[(0, 11)]).await.unwrap();
    drop(a);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The checkpoint is ahead of the ack floor (10): delivery starts at exactly 40.
    let mut b = connect(
        &ts,
        ts.settings(),
        MemCheckpoints::with(&ts.source_name(), 40),
    )
    .await;
    assert_eq!(b.status()[0].position, 40);
    let got = collect(&mut b, 11, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (40..=50).collect::<Vec<i64>>());
    assert_eq!(got[0].payload, b"msg-39");
    assert_quiet(&mut b, Duration::from_millis(300)).await;
    b.commit(&[(0, 51)]).await.unwrap();
    drop(b);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The consumer acked everything (ack floor 50); the checkpoint says 5: it starts at 5.
    let mut c = connect(
        &ts,
        ts.settings(),
        MemCheckpoints::with(&ts.source_name(), 5),
    )
    .await;
    let got = collect(&mut c, 46, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (5..=50).collect::<Vec<i64>>());
    c.commit(&[(0, 51)]).await.unwrap();
    c.close().await;
    drop(c);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Checkpoint == ack floor + 1 and nothing pending: the consumer is reused, same result.
    let mut d = connect(
        &ts,
        ts.settings(),
        MemCheckpoints::with(&ts.source_name(), 51),
    )
    .await;
    assert_quiet(&mut d, Duration::from_millis(300)).await;
    publish_simple(&mut p, &ts, 50..53).await;
    let got = collect(&mut d, 3, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), vec![51, 52, 53]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncommitted_messages_come_back_committed_ones_do_not() {
    let ts = TestStream::new(NATS_URL);
    let mut p = publisher(&ts.url, true).await;
    p.ensure_stream(&ts.stream(), &ts.settings().subjects)
        .await
        .unwrap();
    publish_simple(&mut p, &ts, 0..20).await;
    let checkpoints = none();

    // Read everything, commit nothing, go away.
    let mut a = connect(&ts, ts.settings(), checkpoints.clone()).await;
    let got = collect(&mut a, 20, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (1..=20).collect::<Vec<i64>>());
    drop(a);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Reconnect: nothing was durable, so all of it is delivered again, in order.
    let mut b = connect(&ts, ts.settings(), checkpoints.clone()).await;
    let got = collect(&mut b, 20, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (1..=20).collect::<Vec<i64>>());
    // Now 1..=15 become durable and are committed.
    checkpoints.set(&ts.source_name(), 16);
    b.commit(&[(0, 16)]).await.unwrap();
    drop(b);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Reconnect with that checkpoint: only 16.. again (uncommitted), never 1..=15.
    let mut c = connect(&ts, ts.settings(), checkpoints.clone()).await;
    publish_simple(&mut p, &ts, 20..25).await;
    let got = collect(&mut c, 10, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (16..=25).collect::<Vec<i64>>());
    assert_quiet(&mut c, Duration::from_millis(300)).await;
    assert_eq!(c.redeliveries_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_from_deletes_and_purges_are_crossed() {
    let ts = TestStream::new(NATS_URL);
    let mut p = publisher(&ts.url, true).await;
    p.ensure_stream(&ts.stream(), &ts.settings().subjects)
        .await
        .unwrap();
    publish_simple(&mut p, &ts, 0..30).await;
    let stream = ts.js_stream().await;
    assert!(stream.delete_message(10).await.unwrap());
    stream.purge().sequence(6).await.unwrap(); // removes 1..=5

    // No checkpoint: everything still there, across the hole at 10.
    let mut src = connect(&ts, ts.settings(), none()).await;
    assert_eq!(src.status()[0].low_watermark, 6);
    let got = collect(&mut src, 24, Duration::from_secs(20)).await;
    let want: Vec<i64> = (6..=30).filter(|&s| s != 10).collect();
    assert_eq!(offsets(&got), want);
    assert_eq!(got[0].payload, b"msg-5");

    src.commit(&[(0, 31)]).await.unwrap();
    drop(src);

    // Holes ahead of a stored position: resumes at 31 and crosses them.
    publish_simple(&mut p, &ts, 30..40).await; // 31..=40
    assert!(stream.delete_message(35).await.unwrap());
    assert!(stream.delete_message(36).await.unwrap());
    let mut src = connect(
        &ts,
        ts.settings(),
        MemCheckpoints::with(&ts.source_name(), 31),
    )
    .await;
    let got = collect(&mut src, 8, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), vec![31, 32, 33, 34, 37, 38, 39, 40]);
    assert_quiet(&mut src, Duration::from_millis(300)).await;
    drop(src);

    // A checkpoint on a deleted sequence (10) is not a divergence: delivery resumes at 11.
    let mut src = connect(
        &ts,
        ts.settings(),
        MemCheckpoints::with(&ts.source_name(), 10),
    )
    .await;
    let got = collect(&mut src, 3, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), vec![11, 12, 13]);
    assert_eq!(src.divergences_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergence_stops_or_resets() {
    let ts = TestStream::new(NATS_URL);
    let mut p = publisher(&ts.url, true).await;
    let subjects = ts.settings().subjects;
    p.ensure_stream(&ts.stream(), &subjects).await.unwrap();
    publish_simple(&mut p, &ts, 0..10).await;
    let name = ts.source_name();

    // Unread events purged: stored next 3, stream now starts at 6.
    ts.js_stream().await.purge().sequence(6).await.unwrap();
    let mut src = connect(&ts, ts.settings(), MemCheckpoints::with(&name, 3)).await;
    let deleted = Divergence::EventsDeleted { stored: 3, low: 6 };
    assert_eq!(src.status()[0].divergence, Some(deleted.clone()));
    assert_eq!(src.divergences_total(), 1);
    assert_quiet(&mut src, Duration::from_millis(300)).await;
    drop(src);

    // Same with reset_on_divergence: restarts at the stream's first sequence.
    let reset = NatsSettings {
        reset_on_divergence: true,
        ..ts.settings()
    };
    let mut src = connect(&ts, reset.clone(), MemCheckpoints::with(&name, 3)).await;
    assert_eq!(src.status()[0].divergence, None);
    assert_eq!(src.divergences_total(), 1);
    assert_eq!(src.take_reset(), Some((deleted, 6)));
    assert_eq!(src.take_reset(), None);
    let got = collect(&mut src, 5, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), (6..=10).collect::<Vec<i64>>());
    drop(src);

    // Stream recreated shorter: stored next 11, the new stream ends at 3.
    let js = ts.context().await;
    js.delete_stream(ts.stream()).await.unwrap();
    p.ensure_stream(&ts.stream(), &subjects).await.unwrap();
    publish_simple(&mut p, &ts, 0..3).await;
    let mut src = connect(&ts, ts.settings(), MemCheckpoints::with(&name, 11)).await;
    let ahead = Divergence::AheadOfLog {
        stored: 11,
        high: 4,
    };
    assert_eq!(src.status()[0].divergence, Some(ahead.clone()));
    assert_eq!(src.divergences_total(), 1);
    assert_quiet(&mut src, Duration::from_millis(300)).await;
    drop(src);

    let mut src = connect(&ts, reset, MemCheckpoints::with(&name, 11)).await;
    assert_eq!(src.take_reset(), Some((ahead, 1)));
    let got = collect(&mut src, 3, Duration::from_secs(20)).await;
    assert_eq!(offsets(&got), vec![1, 2, 3]);
    drop(src);

    // While running: the stream is deleted and recreated shorter under the source.
    let mut src = connect(&ts, ts.settings(), MemCheckpoints::with(&name, 4)).await;
    assert_eq!(src.status()[0].divergence, None);
    assert_quiet(&mut src, Duration::from_millis(300)).await;
    js.delete_stream(ts.stream()).await.unwrap();
    p.ensure_stream(&ts.stream(), &subjects).await.unwrap();
    publish_simple(&mut p, &ts, 0..1).await;
    let start = Instant::now();
    while src.status()[0].divergence.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no divergence detected after the stream was recreated: {:?}",
            src.status()
        );
        let batch = src
            .next_batch(10, Duration::from_millis(200))
            .await
            .unwrap();
        assert!(batch.is_empty(), "delivered {:?}", offsets(&batch));
    }
    // The source may see the new stream before or after its one message.
    assert!(
        matches!(
            src.status()[0].divergence,
            Some(Divergence::AheadOfLog {
                stored: 4,
                high: 1 | 2
            })
        ),
        "{:?}",
        src.status()
    );
    assert_eq!(src.divergences_total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_a_server_restart_without_losing_anything() {
    let mut server = PrivateServer::start();
    let ts = TestStream::new(&server.url());
    let mut p = publisher(&ts.url, true).await;
    p.ensure_stream(&ts.stream(), &ts.settings().subjects)
        .await
        .unwrap();
    publish_simple(&mut p, &ts, 0..400).await;

    let mut src = connect(&ts, ts.settings(), none()).await;
    let mut seen: Vec<i64> = Vec::new();
    // Consume part of it in small batches, committing as a pipeline would.
    while seen.len() < 100 {
        let batch = src
            .next_batch(10, Duration::from_millis(200))
            .await
            .unwrap();
        seen.extend(offsets(&batch));
        if let Some(last) = batch.last() {
            src.commit(&[(0, last.offset + 1)]).await.unwrap();
        }
    }

    server.kill();
    // During the outage: empty batches, promptly, no panic.
    for _ in 0..5 {
        let t = Instant::now();
        let batch = tokio::time::timeout(
            Duration::from_secs(5),
            src.next_batch(10, Duration::from_millis(200)),
        )
        .await
        .expect("next_batch returns during the outage")
        .expect("next_batch is not an error during the outage");
        // Anything already buffered in the client may still come out; then nothing.
        seen.extend(offsets(&batch));
        assert!(t.elapsed() < Duration::from_secs(5));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.spawn();

    // The publisher reconnects by itself too; publish more once JetStream answers again.
    let start = Instant::now();
    let mut published = false;
    while !published {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "JetStream did not come back"
        );
        let mut probe = match NatsPublisher::connect(&ts.url, true).await {
            Ok(p) => p,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if probe
            .ensure_stream(&ts.stream(), &ts.settings().subjects)
            .await
            .is_ok()
        {
            publish_simple(&mut probe, &ts, 400..500).await;
            published = true;
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let start = Instant::now();
    loop {
        let distinct: BTreeSet<i64> = seen.iter().copied().collect();
        if distinct.len() == 500 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {} of 500 sequences after the restart; missing from {:?}; status {:?}",
            distinct.len(),
            (1..=500).find(|s| !distinct.contains(s)),
            src.status()
        );
        let batch = src
            .next_batch(50, Duration::from_millis(200))
            .await
            .unwrap();
        if let Some(last) = batch.last() {
            src.commit(&[(0, last.offset + 1)]).await.unwrap();
        }
        seen.extend(offsets(&batch));
    }
    // Everything exactly once, in increasing order. (A redelivery would be allowed, but needs
    // the 120 s ack wait to expire; what a restarted server re-sends from older consumer state
    // must not come through: the source repositions instead.)
    assert_eq!(
        (1..=500).collect::<BTreeSet<i64>>(),
        seen.iter().copied().collect::<BTreeSet<i64>>()
    );
    let out_of_order: Vec<_> = seen.windows(2).filter(|w| w[1] <= w[0]).collect();
    assert!(out_of_order.is_empty(), "out of order: {out_of_order:?}");
    assert_eq!(src.redeliveries_total(), 0);
    assert!(
        src.repositions_total() >= 1,
        "reconnect repositions the consumer"
    );
    let st = &src.status()[0];
    assert_eq!(st.position, 501);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_receives_live_messages() {
    let ts = TestStream::new(NATS_URL);
    let settings = NatsSettings {
        jetstream: false,
        engine_token: 3,
        ..ts.settings()
    };
    let mut src = connect(&ts, settings, none()).await;
    assert_eq!(src.high_watermarks_at_start(), [(0, 1)]);
    let mut p = publisher(&ts.url, false).await;
    publish_simple(&mut p, &ts, 0..20).await;
    let got = collect(&mut src, 20, Duration::from_secs(10)).await;
    assert_eq!(
        offsets(&got),
        (1..=20).collect::<Vec<i64>>(),
        "local counter"
    );
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.payload, format!("msg-{i}").into_bytes());
        assert_eq!(m.engine.as_deref(), Some(format!("e{}", i % 3).as_str()));
        assert_eq!(m.model.as_deref(), Some("m"));
        assert_eq!(m.tenant, None);
    }
    src.commit(&[(0, 21)]).await.unwrap();
    assert_eq!(src.status()[0].position, 21);
    assert_quiet(&mut src, Duration::from_millis(300)).await;
}
