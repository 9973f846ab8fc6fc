//! The Kafka source: an rdkafka consumer, in a consumer group (cooperative-sticky) or on an
//! explicit partition list.
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
mod publisher;
pub mod wire;

pub use embedded::{DEFAULT_PARTITIONS, EmbeddedBroker};
pub use publisher::KafkaPublisher;

use super::{
    Checkpoints, Divergence, EventSource, MODEL_HEADER, Message, PartitionStatus, SourceError,
    TENANT_HEADER,
};
use crate::config::{ConfigError, KafkaConfig, StartPosition};
use parking_lot::Mutex;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
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

/// How to run the Kafka source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub brokers: String,
    pub topic: String,
    /// Consumer group; `None` = explicit partitions (all of the topic's unless `partitions`).
    /// With both a group and `partitions`, the partitions are assigned explicitly and the group
    /// is used only for [`KafkaSource::commit`].
    pub group_id: Option<String>,
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

/// `[source.kafka]` (an empty `group_id` = explicit partitions), stopping on divergence.
impl TryFrom<&KafkaConfig> for KafkaSettings {
    type Error = ConfigError;

    fn try_from(k: &KafkaConfig) -> Result<KafkaSettings, ConfigError> {
        Ok(KafkaSettings {
            brokers: k.brokers.clone(),
            topic: k.topic.clone(),
            group_id: Some(k.group_id.clone()).filter(|g| !g.is_empty()),
            partitions: (!k.partitions.is_empty()).then(|| k.partitions.clone()),
            start: k.start_position()?,
            properties: k.properties.clone(),
            reset_on_divergence: false,
            log_is_ephemeral: false,
        })
    }
}

/// Whether a stored next offset can be resumed from, given the partition's watermarks.
/// `stored == high` is fine (nothing new yet); `stored == low` is the oldest retained event.
pub fn check_divergence(stored: i64, low: i64, high: i64) -> Option<Divergence> {
    if stored > high {
        Some(Divergence::AheadOfLog { stored, high })
    } else if stored < low {
        Some(Divergence::EventsDeleted { stored, low })
    } else {
        None
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
    last_warn: Option<Instant>,
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
}

/// Where a partition is (re)positioned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    At(i64),
    Beginning,
    End,
}

impl Target {
    fn offset(self) -> Offset {
        match self {
            Target::At(o) => Offset::Offset(o),
            Target::Beginning => Offset::Beginning,
            Target::End => Offset::End,
        }
    }
}

/// The decision for one partition being acquired or re-checked.
struct Placement {
    partition: i32,
    target: Target,
    /// Set when the partition must not be consumed.
    diverged: Option<Divergence>,
    watermarks: Option<(i64, i64)>,
}

impl Placement {
    fn position(&self) -> i64 {
        match (self.target, self.watermarks) {
            (Target::At(o), _) => o,
            (Target::Beginning, Some((low, _))) => low,
            (Target::End, Some((_, high))) => high,
            _ => -1,
        }
    }
}

/// What to do about a partition whose position is unusable.
enum Resolution {
    /// Continue from the configured start.
    Start,
    /// Continue from this offset (ephemeral log start).
    At(i64),
    /// Stop consuming it.
    Stop,
}

impl Shared {
    /// Decides what to do about a divergence (and logs it / counts it).
    fn resolve(&self, partition: i32, d: &Divergence, low: i64) -> Resolution {
        let topic = &self.topic;
        match d {
            Divergence::AheadOfLog { stored, high } if self.log_is_ephemeral => {
                let mut st = self.state.lock();
                if !st.ephemeral_logged {
                    st.ephemeral_logged = true;
                    tracing::info!(
                        topic,
                        partition,
                        stored,
                        high,
                        "the embedded broker's log is new since the checkpoint was written; \
                         partitions restart at the log start (logged once)"
                    );
                }
                Resolution::At(low)
            }
            _ if self.reset_on_divergence => {
                self.state.lock().resets.push(partition);
                tracing::warn!(
                    topic,
                    partition,
                    divergence = ?d,
                    start = ?self.start,
                    "checkpoint diverged from the log; reset_on_divergence: restarting the \
                     partition from the configured start"
                );
                Resolution::Start
            }
            _ => {
                self.divergences.fetch_add(1, Ordering::Relaxed);
                match d {
                    Divergence::AheadOfLog { stored, high } => tracing::error!(
                        topic,
                        partition,
                        stored,
                        high,
                        "checkpoint is ahead of the log (stored next offset > high watermark): \
                         partition stopped; the topic was probably recreated"
                    ),
                    Divergence::EventsDeleted { stored, low } => tracing::error!(
                        topic,
                        partition,
                        stored,
                        low,
                        "events were deleted before kvindex read them (log start > stored next \
                         offset): partition stopped"
                    ),
                }
                Resolution::Stop
            }
        }
    }

    /// Positions `partitions` from the checkpoint store (or the configured start), checking
    /// each stored offset against the log. Blocks on broker queries (bounded by timeouts).
    fn place(&self, consumer: &BaseConsumer<Ctx>, partitions: &[i32]) -> Vec<Placement> {
        let wms = match fetch_watermarks(consumer, &self.topic, partitions, QUERY_TIMEOUT) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(
                    topic = %self.topic,
                    error = %e,
                    "cannot fetch watermarks while positioning partitions; stored offsets are \
                     used unchecked (an out-of-range fetch is still reported as divergence)"
                );
                HashMap::new()
            }
        };
        let mut out = Vec::with_capacity(partitions.len());
        let mut need_start = Vec::new();
        for &p in partitions {
            let wm = wms.get(&p).copied();
            let stored = self.checkpoints.next_offset(&self.source_name, p);
            let mut placement = Placement {
                partition: p,
                target: Target::End,
                diverged: None,
                watermarks: wm,
            };
            match (stored, wm) {
                (Some(s), Some((low, high))) => match check_divergence(s, low, high) {
                    None => placement.target = Target::At(s),
                    Some(d) => match self.resolve(p, &d, low) {
                        Resolution::At(o) => placement.target = Target::At(o),
                        Resolution::Start => need_start.push(out.len()),
                        Resolution::Stop => {
                            placement.target = Target::At(s);
                            placement.diverged = Some(d);
                        }
                    },
                },
                (Some(s), None) => placement.target = Target::At(s),
                (None, _) => need_start.push(out.len()),
            }
            out.push(placement);
        }
        if !need_start.is_empty() {
            let parts: Vec<i32> = need_start.iter().map(|&i| out[i].partition).collect();
            let targets = self.start_targets(consumer, &parts);
            for (i, t) in need_start.into_iter().zip(targets) {
                out[i].target = t;
            }
        }
        out
    }

    /// The configured start for each partition.
    fn start_targets(&self, consumer: &BaseConsumer<Ctx>, partitions: &[i32]) -> Vec<Target> {
        match self.start {
            StartPosition::Earliest => vec![Target::Beginning; partitions.len()],
            StartPosition::Latest => vec![Target::End; partitions.len()],
            StartPosition::TimeUs(us) => {
                let mut tpl = TopicPartitionList::new();
                for &p in partitions {
                    // Timestamps are milliseconds in Kafka.
                    let _ = tpl.add_partition_offset(
                        &self.topic,
                        p,
                        Offset::Offset(us.div_euclid(1000)),
                    );
                }
                match consumer.offsets_for_times(tpl, QUERY_TIMEOUT) {
                    Ok(res) => partitions
                        .iter()
                        .map(|&p| {
                            match res.find_partition(&self.topic, p).map(|e| e.offset()) {
                                Some(Offset::Offset(o)) => Target::At(o),
                                // -1: no message at or after the time (Kafka semantics: end).
                                Some(Offset::End) => Target::End,
                                other => {
                                    tracing::warn!(
                                        topic = %self.topic, partition = p, result = ?other,
                                        "offsets_for_times gave no offset; starting at the \
                                         log start rather than skipping events"
                                    );
                                    Target::Beginning
                                }
                            }
                        })
                        .collect(),
                    Err(e) => {
                        tracing::warn!(
                            topic = %self.topic, error = %e,
                            "offsets_for_times failed; starting at the log start rather than \
                             skipping events"
                        );
                        vec![Target::Beginning; partitions.len()]
                    }
                }
            }
        }
    }

    /// Records placements as the partitions now held.
    fn record(&self, placements: &[Placement]) {
        let mut st = self.state.lock();
        for pl in placements {
            let (low, high) = pl.watermarks.unwrap_or((-1, -1));
            st.parts.insert(
                pl.partition,
                PartState {
                    position: pl.position(),
                    low,
                    high,
                    divergence: pl.diverged.clone(),
                },
            );
            if let Some((_, high)) = pl.watermarks {
                st.high_at_start.entry(pl.partition).or_insert(high);
            }
        }
    }

    fn forget(&self, partitions: &[i32]) {
        let mut st = self.state.lock();
        for p in partitions {
            st.parts.remove(p);
            st.high_at_start.remove(p);
        }
        st.ready.retain(|m| !partitions.contains(&m.partition));
    }

    fn warn_rate_limited(&self, what: &str, error: &KafkaError) {
        let mut st = self.state.lock();
        let now = Instant::now();
        if st
            .last_warn
            .is_none_or(|t| now.duration_since(t) >= WARN_EVERY)
        {
            st.last_warn = Some(now);
            drop(st);
            tracing::warn!(topic = %self.topic, %error, "kafka: {what} (retrying)");
        }
    }
}

/// Low and high watermarks of `partitions` in two ListOffsets round trips (not 2 per partition).
fn fetch_watermarks<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partitions: &[i32],
    timeout: Duration,
) -> Result<HashMap<i32, (i64, i64)>, KafkaError> {
    if partitions.is_empty() {
        return Ok(HashMap::new());
    }
    let query = |which: Offset| -> Result<HashMap<i32, i64>, KafkaError> {
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition_offset(topic, p, which)?;
        }
        let res = consumer.offsets_for_times(tpl, timeout)?;
        let mut out = HashMap::new();
        for e in res.elements() {
            if e.error().is_ok()
                && let Offset::Offset(o) = e.offset()
            {
                out.insert(e.partition(), o);
            }
        }
        Ok(out)
    };
    let lows = query(Offset::Beginning)?;
    let highs = query(Offset::End)?;
    Ok(lows
        .into_iter()
        .filter_map(|(p, low)| highs.get(&p).map(|&high| (p, (low, high))))
        .collect())
}

/// The consumer context: rebalance handling and log routing.
struct Ctx {
    shared: Arc<Shared>,
}

impl ClientContext for Ctx {
    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::BrokerTransportFailure)
            | Some(RDKafkaErrorCode::AllBrokersDown)
            | Some(RDKafkaErrorCode::Resolve) => {
                self.shared.warn_rate_limited(reason, &error);
            }
            _ => tracing::error!(topic = %self.shared.topic, %error, reason, "librdkafka error"),
        }
    }
}

impl ConsumerContext for Ctx {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let shared = &self.shared;
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&shared.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let placements = shared.place(consumer, &partitions);
                for pl in &placements {
                    if let Err(e) =
                        tpl.set_partition_offset(&shared.topic, pl.partition, pl.target.offset())
                    {
                        tracing::error!(partition = pl.partition, error = %e, "set offset");
                    }
                }
                shared.record(&placements);
                let res = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = res {
                    tracing::error!(topic = %shared.topic, error = %e, "assigning partitions");
                }
                pause_diverged(consumer, &shared.topic, &placements);
                if placements.is_empty() {
                    return;
                }
                tracing::info!(
                    topic = %shared.topic,
                    partitions = ?placements
                        .iter()
                        .map(|p| (p.partition, p.target))
                        .collect::<Vec<_>>(),
                    "kafka partitions assigned"
                );
            }
            _ => {
                if err == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
                    tracing::info!(
                        topic = %shared.topic,
                        ?partitions,
                        lost = consumer.assignment_lost(),
                        "kafka partitions revoked; persisting checkpoint first"
                    );
                } else {
                    tracing::error!(topic = %shared.topic, ?err, "rebalance error");
                }
                // Everything handed out so far must be durable before another consumer starts
                // from our checkpoint.
                shared.checkpoints.persist_now();
                shared.forget(&partitions);
                let res = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = res {
                    tracing::error!(topic = %shared.topic, error = %e, "unassigning partitions");
                }
            }
        }
    }
}

fn pause_diverged<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    placements: &[Placement],
) {
    let mut tpl = TopicPartitionList::new();
    for pl in placements.iter().filter(|p| p.diverged.is_some()) {
        tpl.add_partition(topic, pl.partition);
    }
    if tpl.count() > 0
        && let Err(e) = consumer.pause(&tpl)
    {
        tracing::error!(topic, error = %e, "pausing diverged partitions");
    }
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
            (Some(_), None) => Mode::Group,
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

    /// Explicit mode: assigns the partitions once (retried every second until the broker
    /// answers, if the partition list must come from metadata).
    fn assign_explicit(&self) {
        let Mode::Explicit(parts) = &self.mode else {
            return;
        };
        let shared = &self.shared;
        {
            let mut st = shared.state.lock();
            if st.explicit_assigned
                || st
                    .last_assign_attempt
                    .is_some_and(|t| t.elapsed() < REFRESH_EVERY)
            {
                return;
            }
            st.last_assign_attempt = Some(Instant::now());
        }
        let partitions = match parts {
            Some(p) => p.clone(),
            None => match self
                .consumer
                .fetch_metadata(Some(&shared.topic), QUERY_TIMEOUT)
            {
                Ok(md) => {
                    let t = md.topics().iter().find(|t| t.name() == shared.topic);
                    match t {
                        Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                            t.partitions().iter().map(|p| p.id()).collect()
                        }
                        _ => {
                            tracing::warn!(topic = %shared.topic, "topic not found (retrying)");
                            return;
                        }
                    }
                }
                Err(e) => {
                    shared.warn_rate_limited("fetching metadata", &e);
                    return;
                }
            },
        };
        let placements = shared.place(&self.consumer, &partitions);
        let mut tpl = TopicPartitionList::new();
        for pl in &placements {
            let _ = tpl.add_partition_offset(&shared.topic, pl.partition, pl.target.offset());
        }
        shared.record(&placements);
        if let Err(e) = self.consumer.assign(&tpl) {
            tracing::error!(topic = %shared.topic, error = %e, "assigning partitions");
            return;
        }
        pause_diverged(&self.consumer, &shared.topic, &placements);
        shared.state.lock().explicit_assigned = true;
        tracing::info!(
            topic = %shared.topic,
            partitions = ?placements.iter().map(|p| (p.partition, p.target)).collect::<Vec<_>>(),
            "kafka partitions assigned (explicit)"
        );
    }

    /// After an out-of-range error: classifies every active partition's position against the
    /// log; diverged ones are stopped / reset, the others are re-seeked to their position so a
    /// partition whose fetcher stopped on the error resumes.
    fn recheck(&self) {
        let shared = &self.shared;
        let active: Vec<(i32, i64)> = {
            let mut st = shared.state.lock();
            if !st.needs_check || st.last_check.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return;
            }
            st.last_check = Some(Instant::now());
            st.parts
                .iter()
                .filter(|(_, s)| s.divergence.is_none())
                .map(|(&p, s)| (p, s.position))
                .collect()
        };
        let parts: Vec<i32> = active.iter().map(|&(p, _)| p).collect();
        let wms = match fetch_watermarks(&self.consumer, &shared.topic, &parts, QUERY_TIMEOUT) {
            Ok(w) => w,
            Err(e) => {
                shared.warn_rate_limited("fetching watermarks for an out-of-range check", &e);
                return;
            }
        };
        shared.state.lock().needs_check = false;
        let mut to_start = Vec::new();
        let mut stopped = Vec::new();
        for (p, pos) in active {
            let Some(&(low, high)) = wms.get(&p) else {
                continue;
            };
            let target = match (pos >= 0)
                .then(|| check_divergence(pos, low, high))
                .flatten()
            {
                None => {
                    if pos >= 0 {
                        Some(Target::At(pos))
                    } else {
                        None
                    }
                }
                Some(d) => match shared.resolve(p, &d, low) {
                    Resolution::At(o) => Some(Target::At(o)),
                    Resolution::Start => {
                        to_start.push(p);
                        None
                    }
                    Resolution::Stop => {
                        stopped.push(Placement {
                            partition: p,
                            target: Target::At(pos),
                            diverged: Some(d),
                            watermarks: Some((low, high)),
                        });
                        None
                    }
                },
            };
            if let Some(t) = target {
                self.seek(p, t, Some((low, high)));
            }
        }
        if !to_start.is_empty() {
            let targets = shared.start_targets(&self.consumer, &to_start);
            for (p, t) in to_start.into_iter().zip(targets) {
                self.seek(p, t, wms.get(&p).copied());
            }
        }
        if !stopped.is_empty() {
            pause_diverged(&self.consumer, &shared.topic, &stopped);
            let mut st = shared.state.lock();
            for pl in &stopped {
                if let Some(ps) = st.parts.get_mut(&pl.partition) {
                    ps.divergence = pl.diverged.clone();
                }
            }
            st.ready
                .retain(|m| !stopped.iter().any(|s| s.partition == m.partition));
        }
    }

    fn seek(&self, partition: i32, target: Target, wm: Option<(i64, i64)>) {
        let shared = &self.shared;
        let pl = Placement {
            partition,
            target,
            diverged: None,
            watermarks: wm,
        };
        if let Err(e) = self
            .consumer
            .seek(&shared.topic, partition, target.offset(), QUERY_TIMEOUT)
        {
            tracing::error!(topic = %shared.topic, partition, ?target, error = %e, "seek failed");
            shared.state.lock().needs_check = true;
            return;
        }
        let mut st = shared.state.lock();
        if let Some(ps) = st.parts.get_mut(&partition) {
            ps.position = pl.position();
            if let Some((low, high)) = wm {
                ps.low = low;
                ps.high = high;
            }
        }
    }
}

/// Refreshes the watermarks of held partitions about once a second until `stop`.
fn refresh_loop(weak: Weak<Inner>, stop: Arc<AtomicBool>) {
    let tick = Duration::from_millis(50);
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() < next {
            std::thread::sleep(tick);
            continue;
        }
        next = Instant::now() + REFRESH_EVERY;
        let Some(inner) = weak.upgrade() else {
            return;
        };
        let shared = &inner.shared;
        let parts: Vec<i32> = shared.state.lock().parts.keys().copied().collect();
        if parts.is_empty() {
            continue;
        }
        let timeout = Duration::from_secs(1);
        if let Ok(wms) = fetch_watermarks(&inner.consumer, &shared.topic, &parts, timeout) {
            let mut st = shared.state.lock();
            let State {
                parts,
                high_at_start,
                ..
            } = &mut *st;
            for (p, (low, high)) in wms {
                if let Some(ps) = parts.get_mut(&p) {
                    ps.low = low;
                    ps.high = high;
                    high_at_start.entry(p).or_insert(high);
                }
            }
        }
    }
}
