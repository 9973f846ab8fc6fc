//! The ingest loop: the configured source feeding the pipeline, on a thread of its own.
//!
//! One loop per process pulls batches from the source (Kafka, the embedded broker or NATS
//! JetStream), hands them to [`Pipeline::ingest_batch`], acknowledges upstream what every
//! shard has made durable (Kafka commit / NATS ack, never earlier), forgets partitions whose
//! checkpoint was abandoned (`--reset-on-divergence`), and publishes the source's status for
//! `/v1/stats`, `/readyz` and `/metrics` ([`SourceReport`], in `report.rs`). The loop is one
//! generic function over [`EventSource`]: Kafka, the embedded broker and NATS run the same code.
//!
//! It runs on a dedicated thread with a current-thread tokio runtime: when the shards push
//! back (full queues), `ingest_batch` blocks this thread only, never the HTTP API's runtime.
//! [`Ingest`] owns the thread; stopping it (or dropping it) persists what was applied and
//! acknowledges it before the source disconnects.

mod report;

pub use report::{PartitionProgress, SourceReport, SourceStatus};

use crate::event::DecodeSettings;
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, Progress};
use crate::source::{Checkpoints, EventSource, KafkaSource, Message, NatsSource, SourceSpec};
use crate::util::Backoff;
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

/// What the ingest loop needs besides its source.
pub struct IngestContext {
    pub pipeline: Arc<Pipeline>,
    /// Where partitions start: normally the pipeline itself (the store's offsets).
    pub checkpoints: Arc<dyn Checkpoints>,
    pub metrics: Arc<Metrics>,
    pub decode: DecodeSettings,
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

/// Connects `S`, retrying with backoff (and reporting why) until it works or `stop` is set.
async fn connect<S: EventSource>(
    settings: &S::Settings,
    ctx: &IngestContext,
    name: &str,
    stop: &AtomicBool,
) -> Option<S> {
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
    loop {
        match S::connect(settings.clone(), ctx.checkpoints.clone()).await {
            Ok(s) => return Some(s),
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(source = name, error = %e, retry_in_ms = delay.as_millis() as u64, "cannot start the source; retrying");
                ctx.report.set_error(e.to_string());
                if pause(delay, stop).await {
                    return None;
                }
            }
        }
    }
}

/// Acknowledges upstream every partition whose durable offset moved since `acked`.
async fn acknowledge(
    source: &mut impl EventSource,
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
    crate::util::crash_point("ack.before");
    match source.commit(&durable).await {
        Ok(()) => {
            crate::util::crash_point("ack.after");
            acked.extend(durable)
        }
        Err(e) => {
            tracing::warn!(source = name, error = %e, "acknowledging durable offsets upstream failed (retried; the checkpoint still holds)")
        }
    }
}

async fn run(spec: SourceSpec, ctx: IngestContext, stop: Arc<AtomicBool>) {
    match &spec {
        SourceSpec::Kafka { settings, .. } => {
            drive::<KafkaSource>(settings, &spec, ctx, stop).await
        }
        SourceSpec::Nats(settings) => drive::<NatsSource>(settings, &spec, ctx, stop).await,
    }
}

/// The loop over one connected source: pull, forget abandoned partitions, deliver,
/// acknowledge what is durable, report.
async fn drive<S: EventSource>(
    settings: &S::Settings,
    spec: &SourceSpec,
    ctx: IngestContext,
    stop: Arc<AtomicBool>,
) {
    let name = spec.name();
    let Some(mut source) = connect::<S>(settings, &ctx, &name, &stop).await else {
        return;
    };
    tracing::info!(source = %name, kind = spec.kind(), "source started");
    // Connected from now on, in the status too (not only after the first acknowledgement).
    ctx.report.refresh(&source, &ctx.metrics);
    let progress = ctx.pipeline.progress().clone();
    let mut acked = BTreeMap::new();
    let mut last_ack = Instant::now();
    let mut errors = Backoff::new(RETRY_MIN, RETRY_MAX);
    while !stop.load(Ordering::Relaxed) {
        let batch = match source.next_batch(MAX_BATCH, POLL_WAIT).await {
            Ok(b) => {
                errors.reset();
                b
            }
            Err(e) => {
                tracing::warn!(source = %name, error = %e, "source error; retrying");
                ctx.report.set_error(e.to_string());
                if pause(errors.next_delay(), &stop).await {
                    break;
                }
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
            // Ready once caught up, and not before every shard is warm (its counters exact).
            if ctx.report.refresh(&source, &ctx.metrics) && ctx.pipeline.warm_up().is_done() {
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
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
    loop {
        match ctx.pipeline.ingest_batch(name, batch, &ctx.decode) {
            Ok(_) => return,
            Err(e) => {
                tracing::error!(source = name, error = %e, "cannot begin a partition's checkpoint in the store; retrying the batch");
                ctx.report.set_error(e.to_string());
            }
        }
        if pause(backoff.next_delay(), stop).await {
            return;
        }
    }
}

/// Forgets a partition whose checkpoint the source abandoned, retrying while the store fails.
async fn forget(pipeline: &Pipeline, name: &str, partition: i32, stop: &AtomicBool) {
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
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
        if pause(backoff.next_delay(), stop).await {
            return;
        }
    }
}
