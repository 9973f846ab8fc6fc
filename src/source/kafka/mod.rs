//! The Kafka source: an rdkafka consumer on an explicit partition list (every partition by
//! default: what the service runs, so that replicas each read everything), or in a consumer
//! group (cooperative-sticky). Here: the source and its poll loop; `position.rs`: where
//! partitions start, divergence, watermarks; `rebalance.rs`: the rebalance callback;
//! `publisher.rs`: producing; `wire.rs`: keys and headers, both directions; `embedded.rs`: the
//! in-process broker.
//!
//! # Positions are kvindex's, not the broker's
//!
//! Whenever a partition is acquired (group assignment in the rebalance callback, or the explicit
//! assignment), it is positioned at the next offset the [`Checkpoints`] store holds for
//! `"kafka:<topic>"`, or at the configured [`StartPosition`] when none is stored. The group's
//! committed offsets are never read; [`KafkaSource::commit`] writes them only for state that is
//! already durable, so external lag tools stay meaningful. On revocation,
//! [`Checkpoints::persist_now`] runs before the partition is released, and any messages of it
//! buffered here are dropped (the next owner starts from that checkpoint).
//!
//! # Divergence
//!
//! On acquisition the partition's watermarks are fetched: a stored offset past the high
//! watermark is [`Divergence::AheadOfLog`], one before the low watermark is
//! [`Divergence::EventsDeleted`]. The partition is then paused, reported in
//! [`KafkaSource::status`] and counted ([`KafkaSource::divergences_total`]), unless
//! `reset_on_divergence` (then it restarts from the configured start, with a warning).
//! `auto.offset.reset=error` is forced, so an out-of-range fetch later on (retention overtaking
//! a slow consumer, a log that was recreated, or a check that could not run because the broker
//! was down) surfaces as an error that is classified the same way, never as a silent reset.
//! With `log_is_ephemeral` (the embedded broker: a new, empty log every start) a stored offset
//! past the log end is reset to the log start, logged once at info and not counted.
//!
//! # Broker trouble
//!
//! librdkafka reconnects by itself; while the broker is unreachable `next_batch` returns empty
//! batches (transport errors are logged at most every 10 s) and consumption resumes where it
//! stopped.
//!
//! # Threads
//!
//! Polling (and with it the rebalance callback, which may block on watermark queries) runs on
//! tokio's blocking pool; `next_batch` is cancel-safe (a poll that outlives a dropped
//! `next_batch` leaves its messages for the next call). A background thread refreshes the
//! watermarks shown by [`KafkaSource::status`] about once a second.

pub mod embedded;
mod position;
mod publisher;
mod rebalance;
pub mod wire;

pub use embedded::{DEFAULT_PARTITIONS, EMBEDDED_FETCH_WAIT_MS, EmbeddedBroker};
pub use position::check_divergence;
use position::refresh_loop;
pub use publisher::KafkaPublisher;
use rebalance::Ctx;

use super::{
    Checkpoints, DP_RANK_HEADER, Divergence, EventSource, MODEL_HEADER, Message, PartitionStatus,
    SourceError, TENANT_HEADER,
};
use crate::config::{ConfigError, KafkaConfig, StartPosition};
use crate::util::LogEvery;
use parking_lot::Mutex;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Timeout of watermark / timestamp / metadata queries made while positioning partitions.
const QUERY_TIMEOUT: Duration = Duration::from_secs(3);
/// How often the background thread refreshes the watermarks shown by `status()`.
const REFRESH_EVERY: Duration = Duration::from_secs(1);
/// Minimum interval between two "broker trouble" warnings.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// Group id used for explicit assignment without a configured group (librdkafka needs one to
/// assign partitions; nothing is ever committed to it).
const EXPLICIT_GROUP: &str = "kvindex-explicit-assign";

/// Properties kvindex sets itself; a conflicting value in `properties` is overridden (with a
/// warning) because the source's contract depends on them.
const FORCED: &[(&str, &str)] = &[
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
    ("auto.offset.reset", "error"),
];

/// Defaults kvindex sets unless `properties` says otherwise: librdkafka prefetches up to
/// 64 MiB per client by default, outside any budget; 16 MiB keeps the prefetch a small, known
/// part of the process memory bound (README, "Memory") and is still many fetches ahead.
pub const PREFETCH_DEFAULTS: &[(&str, &str)] = &[("queued.max.messages.kbytes", "16384")];

/// How to run the Kafka source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    pub topic: String,
    /// Consumer group: where [`KafkaSource::commit`] writes (`None` = nowhere), and with
    /// `subscribe`, the group whose assignment is consumed.
    pub group_id: Option<String>,
    /// Join the group and consume what it assigns (needs `group_id`, and no `partitions`).
    /// `false`: assign `partitions`, or every partition of the topic, explicitly; replicas
    /// then each read everything, whatever group they commit to.
    pub subscribe: bool,
    pub partitions: Option<Vec<i32>>,
    /// Where partitions without a checkpoint start.
    pub start: StartPosition,
    /// librdkafka properties, passed through (SASL, TLS, timeouts, ...).
    pub properties: BTreeMap<String, String>,
    /// On divergence, restart the partition from `start` instead of stopping it.
    pub reset_on_divergence: bool,
    /// The log is new every start (embedded broker): stored offsets past its end are reset to
    /// its start without reporting a divergence.
    pub log_is_ephemeral: bool,
}

/// `[source.kafka]`: every partition (or those listed) assigned explicitly, commits to
/// `group_id` unless it is empty, stopping on divergence.
impl TryFrom<&KafkaConfig> for KafkaSettings {
    type Error = ConfigError;

    fn try_from(k: &KafkaConfig) -> Result<KafkaSettings, ConfigError> {
        Ok(KafkaSettings {
            brokers: k.brokers.clone(),
            topic: k.topic.clone(),
            group_id: Some(k.group_id.clone()).filter(|g| !g.is_empty()),
            subscribe: false,
            partitions: (!k.partitions.is_empty()).then(|| k.partitions.clone()),
            start: k.start_position()?,
            properties: k.properties.clone(),
            reset_on_divergence: false,
            log_is_ephemeral: false,
        })
    }
}

#[derive(Clone, Debug)]
struct PartState {
    /// Next offset to deliver; -1 while unknown (logical start not yet resolved).
    position: i64,
    low: i64,
    high: i64,
    divergence: Option<Divergence>,
}

#[derive(Default)]
struct State {
    /// Partitions this consumer currently holds.
    parts: BTreeMap<i32, PartState>,
    /// High watermark of each held partition when it was first positioned (readiness).
    high_at_start: BTreeMap<i32, i64>,
    /// Polled but not yet handed out by `next_batch`.
    ready: VecDeque<Message>,
    /// An out-of-range error arrived: re-check every active partition against the log.
    needs_check: bool,
    last_check: Option<Instant>,
    explicit_assigned: bool,
    last_assign_attempt: Option<Instant>,
    ephemeral_logged: bool,
    /// Partitions whose checkpoint was abandoned (`reset_on_divergence`), not yet taken.
    resets: Vec<i32>,
}

/// What the source knows and decides; shared by the consumer context (rebalance callback), the
/// poll task, the refresher thread and the public API.
struct Shared {
    topic: String,
    source_name: String,
    start: StartPosition,
    reset_on_divergence: bool,
    log_is_ephemeral: bool,
    checkpoints: Arc<dyn Checkpoints>,
    state: Mutex<State>,
    divergences: AtomicU64,
    /// Broker trouble, logged at most every [`WARN_EVERY`]: transient (a warning) and with a
    /// named cause (an error: TLS, authentication, ...), each on its own clock.
    warnings: LogEvery,
    errors: LogEvery,
    /// The last broker trouble (a TLS handshake refused, brokers unreachable, metadata not
    /// fetched) since the last successful exchange with the brokers: the status shows it.
    trouble: Mutex<Option<String>>,
}

enum Mode {
    Group,
    /// `None` = every partition of the topic (from metadata).
    Explicit(Option<Vec<i32>>),
}

struct Inner {
    consumer: BaseConsumer<Ctx>,
    shared: Arc<Shared>,
    mode: Mode,
    /// Whether `commit` has a group to commit to.
    can_commit: bool,
    /// Serializes polls (a poll of a cancelled `next_batch` may still be running).
    poll_lock: Mutex<()>,
}

/// The Kafka source. See the module docs.
pub struct KafkaSource {
    inner: Arc<Inner>,
    stop: Arc<AtomicBool>,
    refresher: Option<JoinHandle<()>>,
}

impl KafkaSource {
    /// Creates the consumer and subscribes (group mode). Partitions are positioned when they
    /// are assigned, during `next_batch`; nothing here waits for the broker.
    fn create(
        settings: KafkaSettings,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<KafkaSource, SourceError> {
        if settings.topic.is_empty() {
            return Err(SourceError::Config("source.kafka.topic is empty".into()));
        }
        let mut cfg = ClientConfig::new();
        cfg.set("partition.assignment.strategy", "cooperative-sticky");
        for (k, v) in PREFETCH_DEFAULTS {
            cfg.set(*k, *v);
        }
        for (k, v) in &settings.properties {
            cfg.set(k, v);
        }
        for (k, v) in FORCED {
            if settings.properties.get(*k).is_some_and(|u| u != v) {
                tracing::warn!(
                    property = k,
                    value = v,
                    "overriding a kafka property kvindex relies on"
                );
            }
            cfg.set(*k, *v);
        }
        cfg.set("bootstrap.servers", &settings.brokers);
        let mode = match (&settings.group_id, &settings.partitions) {
            (Some(_), None) if settings.subscribe => Mode::Group,
            (_, parts) => Mode::Explicit(parts.clone()),
        };
        cfg.set(
            "group.id",
            settings.group_id.as_deref().unwrap_or(EXPLICIT_GROUP),
        );
        let source_name = format!("kafka:{}", settings.topic);
        let shared = Arc::new(Shared {
            topic: settings.topic.clone(),
            source_name,
            start: settings.start,
            reset_on_divergence: settings.reset_on_divergence,
            log_is_ephemeral: settings.log_is_ephemeral,
            checkpoints,
            state: Mutex::new(State::default()),
            warnings: LogEvery::new(WARN_EVERY),
            errors: LogEvery::new(WARN_EVERY),
            trouble: Mutex::new(None),
            divergences: AtomicU64::new(0),
        });
        let consumer: BaseConsumer<Ctx> = cfg
            .create_with_context(Ctx {
                shared: shared.clone(),
            })
            .map_err(|e| SourceError::Kafka(format!("creating consumer: {e}")))?;
        if let Mode::Group = mode {
            consumer.subscribe(&[&settings.topic]).map_err(|e| {
                SourceError::Kafka(format!("subscribing to {}: {e}", settings.topic))
            })?;
        }
        let inner = Arc::new(Inner {
            consumer,
            shared,
            mode,
            can_commit: settings.group_id.is_some(),
            poll_lock: Mutex::new(()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let refresher = {
            let weak = Arc::downgrade(&inner);
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kafka-watermarks".into())
                .spawn(move || refresh_loop(weak, stop))
                .map_err(|e| SourceError::Kafka(format!("spawning watermark thread: {e}")))?
        };
        Ok(KafkaSource {
            inner,
            stop,
            refresher: Some(refresher),
        })
    }

    fn take_ready(&self, max: usize) -> Option<Vec<Message>> {
        let mut st = self.inner.shared.state.lock();
        if st.ready.is_empty() {
            return None;
        }
        let n = st.ready.len().min(max);
        Some(st.ready.drain(..n).collect())
    }
}

impl EventSource for KafkaSource {
    type Settings = KafkaSettings;

    async fn connect(
        settings: KafkaSettings,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<KafkaSource, SourceError> {
        KafkaSource::create(settings, checkpoints)
    }

    /// `"kafka:<topic>"`.
    fn name(&self) -> String {
        self.inner.shared.source_name.clone()
    }

    /// Rebalances are handled inside. Cancel-safe.
    async fn next_batch(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Message>, SourceError> {
        let max = max.max(1);
        if let Some(batch) = self.take_ready(max) {
            return Ok(batch);
        }
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.poll(max, wait))
            .await
            .map_err(|e| SourceError::Kafka(format!("poll task failed: {e}")))??;
        Ok(self.take_ready(max).unwrap_or_default())
    }

    fn take_resets(&mut self) -> Vec<i32> {
        std::mem::take(&mut self.inner.shared.state.lock().resets)
    }

    /// Commits the next offsets to the group, asynchronously. A no-op without a group.
    async fn commit(&mut self, durable: &[(i32, i64)]) -> Result<(), SourceError> {
        if !self.inner.can_commit || durable.is_empty() {
            return Ok(());
        }
        let topic = &self.inner.shared.topic;
        let mut tpl = TopicPartitionList::with_capacity(durable.len());
        for &(p, o) in durable {
            tpl.add_partition_offset(topic, p, Offset::Offset(o))
                .map_err(|e| SourceError::Kafka(format!("commit: {e}")))?;
        }
        self.inner
            .consumer
            .commit(&tpl, CommitMode::Async)
            .map_err(|e| SourceError::Kafka(format!("commit: {e}")))
    }

    /// The partitions this consumer holds, with positions, last refreshed watermarks and
    /// divergences.
    fn status(&self) -> Vec<PartitionStatus> {
        let st = self.inner.shared.state.lock();
        st.parts
            .iter()
            .map(|(&partition, s)| PartitionStatus {
                partition,
                position: s.position,
                high_watermark: s.high,
                low_watermark: s.low,
                divergence: s.divergence.clone(),
            })
            .collect()
    }

    /// High watermark of each held partition when it was first positioned (or first refreshed,
    /// if the broker was unreachable then). Empty until partitions are assigned, which happens
    /// inside `next_batch`.
    fn high_watermarks_at_start(&self) -> Vec<(i32, i64)> {
        let st = self.inner.shared.state.lock();
        st.high_at_start.iter().map(|(&p, &h)| (p, h)).collect()
    }

    /// Partitions stopped because their checkpoint diverged from the log, since creation.
    fn divergences_total(&self) -> u64 {
        self.inner.shared.divergences.load(Ordering::Relaxed)
    }

    /// Broker trouble since the last successful exchange with the brokers (librdkafka retries
    /// by itself; this says why nothing arrives meanwhile).
    fn trouble(&self) -> Option<String> {
        self.inner.shared.trouble.lock().clone()
    }

    /// Nothing buffered: commits are handed to librdkafka at once.
    async fn close(&mut self) {}
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.refresher.take() {
            let _ = h.join();
        }
        // The consumer closes when the last `Inner` reference goes (possibly after an
        // in-flight poll): it leaves the group, which revokes (→ `persist_now`).
    }
}

impl Inner {
    /// One poll round on the blocking pool: fills `ready` with up to `max` messages.
    fn poll(&self, max: usize, wait: Duration) -> Result<(), SourceError> {
        let _guard = self.poll_lock.lock();
        let shared = &self.shared;
        if shared.state.lock().ready.len() >= max {
            return Ok(());
        }
        self.assign_explicit();
        self.recheck();
        let deadline = Instant::now() + wait;
        loop {
            let have = !shared.state.lock().ready.is_empty();
            let timeout = if have {
                Duration::ZERO
            } else {
                deadline.saturating_duration_since(Instant::now())
            };
            match self.consumer.poll(timeout) {
                None => {
                    // A timeout, or an event (rebalance, commit) was served.
                    if have || Instant::now() >= deadline {
                        return Ok(());
                    }
                }
                Some(Ok(m)) => {
                    if self.accept(&m) >= max {
                        return Ok(());
                    }
                }
                Some(Err(e)) => self.on_error(e)?,
            }
        }
    }

    /// Converts and buffers a message unless its partition is stopped or it is a duplicate.
    /// Returns the buffered count.
    fn accept(&self, m: &BorrowedMessage<'_>) -> usize {
        use rdkafka::Message as _;
        let mut st = self.shared.state.lock();
        let (partition, offset) = (m.partition(), m.offset());
        match st.parts.get_mut(&partition) {
            Some(ps) if ps.divergence.is_none() => {
                if ps.position >= 0 && offset < ps.position {
                    tracing::debug!(
                        partition,
                        offset,
                        position = ps.position,
                        "dropping duplicate"
                    );
                    return st.ready.len();
                }
                ps.position = offset + 1;
                if ps.high < ps.position {
                    ps.high = ps.position;
                }
            }
            _ => return st.ready.len(),
        }
        let msg = Message {
            partition,
            offset,
            engine: wire::engine_of(m.key()),
            model: wire::header(m.headers(), MODEL_HEADER),
            tenant: wire::header(m.headers(), TENANT_HEADER),
            dp_rank: wire::header(m.headers(), DP_RANK_HEADER).and_then(|r| r.parse().ok()),
            payload: m.payload().unwrap_or_default().to_vec(),
        };
        st.ready.push_back(msg);
        st.ready.len()
    }

    fn on_error(&self, e: KafkaError) -> Result<(), SourceError> {
        match &e {
            KafkaError::PartitionEOF(_) => Ok(()),
            KafkaError::MessageConsumptionFatal(_) => {
                tracing::error!(topic = %self.shared.topic, error = %e, "fatal kafka error");
                Err(SourceError::Kafka(e.to_string()))
            }
            KafkaError::MessageConsumption(
                RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
            ) => {
                tracing::warn!(
                    topic = %self.shared.topic,
                    error = %e,
                    "offset out of range; checking partitions against the log"
                );
                let mut st = self.shared.state.lock();
                st.needs_check = true;
                st.last_check = None;
                Ok(())
            }
            _ => {
                self.shared.warn_rate_limited("consumer error", &e);
                Ok(())
            }
        }
    }
}
