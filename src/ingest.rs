//! The ingest loop: the configured source feeding the pipeline, on a thread of its own.
//!
//! One loop per process pulls batches from the source (Kafka, the embedded broker or NATS
//! JetStream), hands them to [`Pipeline::ingest_batch`], acknowledges upstream what every
//! shard has made durable (Kafka commit / NATS ack, never earlier), forgets partitions whose
//! checkpoint was abandoned (`--reset-on-divergence`), and publishes the source's status for
//! `/v1/stats`, `/readyz` and `/metrics` ([`SourceReport`]).
//!
//! It runs on a dedicated thread with a current-thread tokio runtime: when the shards push
//! back (full queues), `ingest_batch` blocks this thread only, never the HTTP API's runtime.
//! [`Ingest`] owns the thread; stopping it (or dropping it) persists what was applied and
//! acknowledges it before the source disconnects.

use crate::checkpoint::Progress;
use crate::event::DecodeOptions;
use crate::metrics::{Metrics, SourceGauge};
use crate::pipeline::Pipeline;
use crate::source::{
    Checkpoints, Divergence, KafkaSettings, KafkaSource, Message, PartitionStatus, SourceError,
    nats::{NatsSettings, NatsSource},
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Messages pulled per batch.
const MAX_BATCH: usize = 4096;
/// How long a pull waits for the first message (also the stop-check period).
const POLL_WAIT: Duration = Duration::from_millis(100);
/// How often durable offsets are acknowledged upstream and the status is refreshed.
const ACK_EVERY: Duration = Duration::from_millis(100);
/// Retry bounds for connecting and for store trouble.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// How to reach the source.
#[derive(Clone, Debug)]
pub enum SourceSpec {
    /// Kafka; `embedded`: the in-process broker (reported as kind `embedded`).
    Kafka {
        settings: KafkaSettings,
        embedded: bool,
    },
    Nats(NatsSettings),
}

impl SourceSpec {
    /// The checkpoint key of the source (`kafka:<topic>` / `nats:<stream>`).
    pub fn name(&self) -> String {
        match self {
            SourceSpec::Kafka { settings, .. } => format!("kafka:{}", settings.topic),
            SourceSpec::Nats(s) => format!("nats:{}", s.stream),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            SourceSpec::Kafka { embedded: true, .. } => "embedded",
            SourceSpec::Kafka { .. } => "kafka",
            SourceSpec::Nats(s) if s.jetstream => "nats",
            SourceSpec::Nats(_) => "nats-core",
        }
    }
}

/// A connected source of either kind.
enum Source {
    Kafka(KafkaSource),
    Nats(Box<NatsSource>),
}

impl Source {
    async fn connect(
        spec: &SourceSpec,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<Source, SourceError> {
        match spec {
            SourceSpec::Kafka { settings, .. } => {
                KafkaSource::new(settings.clone(), checkpoints).map(Source::Kafka)
            }
            SourceSpec::Nats(s) => NatsSource::connect(s.clone(), checkpoints)
                .await
                .map(|n| Source::Nats(Box::new(n))),
        }
    }

    async fn next_batch(&mut self) -> Result<Vec<Message>, SourceError> {
        match self {
            Source::Kafka(k) => k.next_batch(MAX_BATCH, POLL_WAIT).await,
            Source::Nats(n) => n.next_batch(MAX_BATCH, POLL_WAIT).await,
        }
    }

    /// Partitions whose checkpoint was abandoned since the last call.
    fn take_resets(&mut self) -> Vec<i32> {
        match self {
            Source::Kafka(k) => k.take_resets(),
            Source::Nats(n) => n.take_reset().map(|_| vec![0]).unwrap_or_default(),
        }
    }

    /// Acknowledges `(partition, durable next offset)` upstream.
    async fn acknowledge(&mut self, durable: &[(i32, i64)]) -> Result<(), SourceError> {
        match self {
            Source::Kafka(k) => k.commit(durable),
            Source::Nats(n) => match durable.iter().find(|(p, _)| *p == 0) {
                Some(&(_, next)) => n.commit(next).await,
                None => Ok(()),
            },
        }
    }

    fn status(&self) -> Vec<PartitionStatus> {
        match self {
            Source::Kafka(k) => k.status(),
            Source::Nats(n) => n.status(),
        }
    }

    /// Log end of each partition when the source first positioned it: readiness waits for
    /// these. Empty until a Kafka group has its assignment.
    fn high_at_start(&self) -> Vec<(i32, i64)> {
        match self {
            Source::Kafka(k) => k.high_watermarks_at_start(),
            Source::Nats(n) => vec![(0, n.high_watermark_at_start())],
        }
    }

    fn divergences_total(&self) -> u64 {
        match self {
            Source::Kafka(k) => k.divergences_total(),
            Source::Nats(n) => n.divergences_total(),
        }
    }

    async fn close(&mut self) {
        if let Source::Nats(n) = self {
            n.close().await;
        }
    }
}

/// What the ingest loop last saw of its source.
#[derive(Default)]
struct Snapshot {
    connected: bool,
    error: Option<String>,
    partitions: Vec<PartitionStatus>,
    high_at_start: BTreeMap<i32, i64>,
    divergences_total: u64,
    ready: bool,
    batches: u64,
    messages: u64,
}

/// The source's status, shared between the ingest loop (writer) and the HTTP API (reader).
pub struct SourceReport {
    kind: &'static str,
    name: String,
    bootstrap: Option<String>,
    progress: Arc<Progress>,
    snapshot: Mutex<Snapshot>,
}

fn divergence_json(d: &Divergence) -> Value {
    match d {
        Divergence::AheadOfLog { stored, high } => {
            json!({ "kind": "ahead_of_log", "stored_offset": stored, "high_watermark": high })
        }
        Divergence::EventsDeleted { stored, low } => {
            json!({ "kind": "events_deleted", "stored_offset": stored, "low_watermark": low })
        }
    }
}

/// One partition's view: where it is and how far behind.
struct PartitionView {
    status: PartitionStatus,
    applied_next: Option<i64>,
    durable_next: Option<i64>,
    events_applied: u64,
    duplicates: u64,
    high_at_start: Option<i64>,
}

impl PartitionView {
    /// Next offset applied: the shards' minimum, or the source position while nothing of the
    /// partition was delivered in this process (an empty partition, a `latest` start).
    fn applied(&self) -> i64 {
        self.applied_next.unwrap_or(self.status.position)
    }

    fn lag(&self) -> i64 {
        if self.status.high_watermark < 0 || self.applied() < 0 {
            return -1;
        }
        (self.status.high_watermark - self.applied()).max(0)
    }

    fn caught_up(&self) -> bool {
        self.status.divergence.is_none()
            && self
                .high_at_start
                .is_some_and(|h| self.applied() >= 0 && self.applied() >= h)
    }
}

impl SourceReport {
    pub fn new(
        spec: &SourceSpec,
        bootstrap: Option<String>,
        progress: Arc<Progress>,
    ) -> SourceReport {
        SourceReport {
            kind: spec.kind(),
            name: spec.name(),
            bootstrap,
            progress,
            snapshot: Mutex::new(Snapshot::default()),
        }
    }

    fn views(&self, snap: &Snapshot) -> Vec<PartitionView> {
        let known: BTreeMap<i32, _> = self
            .progress
            .of_source(&self.name)
            .into_iter()
            .map(|p| (p.partition, p))
            .collect();
        snap.partitions
            .iter()
            .map(|s| {
                let p = known.get(&s.partition);
                PartitionView {
                    status: s.clone(),
                    applied_next: p.and_then(|p| p.applied_next()),
                    durable_next: p.and_then(|p| p.durable_next()),
                    events_applied: p.map_or(0, |p| p.events_applied.load(Ordering::Relaxed)),
                    duplicates: p.map_or(0, |p| p.duplicates.load(Ordering::Relaxed)),
                    high_at_start: snap.high_at_start.get(&s.partition).copied(),
                }
            })
            .collect()
    }

    /// Whether every partition has caught up to the log end it saw at start (latched: once
    /// ready, a later lag does not make the service unready).
    pub fn is_ready(&self) -> bool {
        self.snapshot.lock().ready
    }

    /// The `sources` section of `/v1/stats` (its `lag` is also shown by `/readyz`).
    pub fn to_json(&self) -> Value {
        let snap = self.snapshot.lock();
        let views = self.views(&snap);
        let lag: i64 = views.iter().map(|v| v.lag().max(0)).sum();
        let partitions: Vec<Value> = views
            .iter()
            .map(|v| {
                json!({
                    "partition": v.status.partition,
                    "stored_offset": v.durable_next,
                    "applied_offset": v.applied_next,
                    "position": v.status.position,
                    "high_watermark": v.status.high_watermark,
                    "low_watermark": v.status.low_watermark,
                    "high_watermark_at_start": v.high_at_start,
                    "lag": v.lag(),
                    "events_applied": v.events_applied,
                    "duplicates_skipped": v.duplicates,
                    "divergence": v.status.divergence.as_ref().map(divergence_json),
                })
            })
            .collect();
        json!({
            "kind": self.kind,
            "name": self.name,
            "bootstrap_servers": self.bootstrap,
            "connected": snap.connected,
            "error": snap.error,
            "ready": snap.ready,
            "lag": lag,
            "batches": snap.batches,
            "messages": snap.messages,
            "divergences_total": snap.divergences_total,
            "partitions": partitions,
        })
    }

    fn set_error(&self, error: String) {
        let mut s = self.snapshot.lock();
        s.connected = false;
        s.error = Some(error);
    }

    /// Takes a fresh status from the source; returns whether the service is ready.
    fn refresh(&self, source: &Source, metrics: &Metrics) -> bool {
        let mut snap = self.snapshot.lock();
        snap.connected = true;
        snap.error = None;
        snap.partitions = source.status();
        snap.divergences_total = source.divergences_total();
        for (p, h) in source.high_at_start() {
            snap.high_at_start.entry(p).or_insert(h);
        }
        let views = self.views(&snap);
        if !snap.ready && !views.is_empty() && views.iter().all(PartitionView::caught_up) {
            snap.ready = true;
            tracing::info!(source = %self.name, partitions = views.len(), "caught up with the log end seen at start: ready");
        }
        metrics.set_sources(
            views
                .iter()
                .map(|v| SourceGauge {
                    source: self.name.clone(),
                    partition: v.status.partition,
                    lag: v.lag(),
                    durable_offset: v.durable_next.unwrap_or(-1),
                    high_watermark: v.status.high_watermark,
                    diverged: v.status.divergence.is_some(),
                })
                .collect(),
        );
        snap.ready
    }

    fn count_batch(&self, messages: usize) {
        let mut s = self.snapshot.lock();
        s.batches += 1;
        s.messages += messages as u64;
    }
}

/// What the ingest loop needs besides its source.
pub struct IngestContext {
    pub pipeline: Arc<Pipeline>,
    /// Where partitions start: normally the pipeline itself (the store's offsets).
    pub checkpoints: Arc<dyn Checkpoints>,
    pub metrics: Arc<Metrics>,
    pub decode: DecodeOptions,
    pub report: Arc<SourceReport>,
    /// Set once the source has caught up (what `/readyz` reads).
    pub ready: Arc<AtomicBool>,
}

/// The running ingest loop. Dropping it stops the loop (after a last persist and
/// acknowledgement) and joins its thread.
pub struct Ingest {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pipeline: Arc<Pipeline>,
}

impl Ingest {
    /// Starts the loop on its own thread. Connection failures are retried inside (and shown
    /// in the report), so this returns at once.
    pub fn start(spec: SourceSpec, ctx: IngestContext) -> std::io::Result<Ingest> {
        let stop = Arc::new(AtomicBool::new(false));
        let pipeline = ctx.pipeline.clone();
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kvindex-ingest".into())
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot start the ingest runtime");
                            return;
                        }
                    };
                    rt.block_on(run(spec, ctx, stop));
                })?
        };
        Ok(Ingest {
            stop,
            thread: Some(thread),
            pipeline,
        })
    }

    /// Stops the loop and waits for its last persist and acknowledgement.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The loop may be blocked handing a batch to a worker that holds events back at L1's
        // hard cap while L2 is down: let the workers take it, or this join waits for L2.
        self.pipeline.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Ingest {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Sleeps up to `d`, waking early when `stop` is set. Returns whether to stop.
async fn pause(d: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20).min(until - Instant::now())).await;
    }
    stop.load(Ordering::Relaxed)
}

async fn connect(spec: &SourceSpec, ctx: &IngestContext, stop: &AtomicBool) -> Option<Source> {
    let mut delay = RETRY_MIN;
    loop {
        match Source::connect(spec, ctx.checkpoints.clone()).await {
            Ok(s) => return Some(s),
            Err(e) => {
                tracing::warn!(source = %spec.name(), error = %e, retry_in_ms = delay.as_millis() as u64, "cannot start the source; retrying");
                ctx.report.set_error(e.to_string());
            }
        }
        if pause(delay, stop).await {
            return None;
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}

/// Acknowledges upstream every partition whose durable offset moved since `acked`.
async fn acknowledge(
    source: &mut Source,
    name: &str,
    progress: &Progress,
    acked: &mut BTreeMap<i32, i64>,
) {
    let durable: Vec<(i32, i64)> = progress
        .of_source(name)
        .iter()
        .filter_map(|p| Some((p.partition, p.durable_next()?)))
        .filter(|(p, d)| acked.get(p).is_none_or(|a| d > a))
        .collect();
    if durable.is_empty() {
        return;
    }
    match source.acknowledge(&durable).await {
        Ok(()) => acked.extend(durable),
        Err(e) => {
            tracing::warn!(source = name, error = %e, "acknowledging durable offsets upstream failed (retried; the checkpoint still holds)")
        }
    }
}

async fn run(spec: SourceSpec, ctx: IngestContext, stop: Arc<AtomicBool>) {
    let name = spec.name();
    let Some(mut source) = connect(&spec, &ctx, &stop).await else {
        return;
    };
    tracing::info!(source = %name, kind = spec.kind(), "source started");
    let progress = ctx.pipeline.progress().clone();
    let mut acked = BTreeMap::new();
    let mut last_ack = Instant::now();
    let mut error_delay = RETRY_MIN;
    while !stop.load(Ordering::Relaxed) {
        let batch = match source.next_batch().await {
            Ok(b) => {
                error_delay = RETRY_MIN;
                b
            }
            Err(e) => {
                tracing::warn!(source = %name, error = %e, "source error; retrying");
                ctx.report.set_error(e.to_string());
                if pause(error_delay, &stop).await {
                    break;
                }
                error_delay = (error_delay * 2).min(RETRY_MAX);
                continue;
            }
        };
        for partition in source.take_resets() {
            forget(&ctx.pipeline, &name, partition, &stop).await;
        }
        if !batch.is_empty() {
            deliver(&ctx, &name, &batch, &stop).await;
            ctx.report.count_batch(batch.len());
        }
        if last_ack.elapsed() >= ACK_EVERY {
            last_ack = Instant::now();
            acknowledge(&mut source, &name, &progress, &mut acked).await;
            if ctx.report.refresh(&source, &ctx.metrics) {
                ctx.ready.store(true, Ordering::Release);
            }
        }
    }
    // Stopping: make everything applied durable, then tell the broker.
    ctx.pipeline.persist();
    acknowledge(&mut source, &name, &progress, &mut acked).await;
    source.close().await;
    tracing::info!(source = %name, "source stopped");
}

/// Hands one batch to the pipeline, retrying (never dropping it) while the store fails.
async fn deliver(ctx: &IngestContext, name: &str, batch: &[Message], stop: &AtomicBool) {
    let mut delay = RETRY_MIN;
    loop {
        match ctx.pipeline.ingest_batch(name, batch, &ctx.decode) {
            Ok(_) => return,
            Err(e) => {
                tracing::error!(source = name, error = %e, "cannot begin a partition's checkpoint in the store; retrying the batch");
                ctx.report.set_error(e.to_string());
            }
        }
        if pause(delay, stop).await {
            return;
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}

/// Forgets a partition whose checkpoint the source abandoned, retrying while the store fails.
async fn forget(pipeline: &Pipeline, name: &str, partition: i32, stop: &AtomicBool) {
    let mut delay = RETRY_MIN;
    loop {
        match pipeline.forget_partition(name, partition) {
            Ok(()) => {
                tracing::warn!(
                    source = name,
                    partition,
                    "checkpoint abandoned (reset_on_divergence): the partition restarts from the configured start"
                );
                return;
            }
            Err(e) => {
                tracing::error!(source = name, partition, error = %e, "cannot forget the partition's checkpoint; retrying")
            }
        }
        if pause(delay, stop).await {
            return;
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}
