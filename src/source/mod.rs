//! Sources: where payloads come from, with their positions, and how they get there. Each
//! source delivers [`Message`]s in per-partition order, starts each partition where kvindex's
//! own checkpoint says (never the broker's), and acknowledges upstream only what is already
//! durable. Every transport implements [`EventSource`], the one API the ingest loop drives.
//!
//! One folder per transport, both directions in it (consumer, publisher, and the engine
//! contract in `wire.rs`):
//! - [`kafka`]: the rdkafka consumer (group or explicit partitions), the publisher, and the
//!   embedded Kafka-protocol broker (librdkafka's mock cluster);
//! - [`nats`]: the JetStream pull consumer, or core NATS subjects (at-most-once), and the
//!   publisher.

pub mod kafka;
pub mod nats;

pub use kafka::{EmbeddedBroker, KafkaPublisher, KafkaSettings, KafkaSource};
pub use nats::{NatsPublisher, NatsSettings, NatsSource};

use std::sync::Arc;
use std::time::Duration;

/// Header naming the model of a payload that names none itself (vLLM's), on every transport.
pub const MODEL_HEADER: &str = "model";
/// Header naming the tenant of a payload that names none itself.
pub const TENANT_HEADER: &str = "tenant";
/// Header naming the data-parallel rank of a vLLM payload (the bridge sets it).
pub const DP_RANK_HEADER: &str = "dp_rank";

/// The headers a publisher sends with a payload that names neither its model nor its tenant.
pub fn labels<'a>(model: &'a str, tenant: &'a str) -> [(&'static str, &'a str); 2] {
    [(MODEL_HEADER, model), (TENANT_HEADER, tenant)]
}

/// One payload and where it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// Kafka partition; NATS: always 0 (one stream).
    pub partition: i32,
    /// Kafka offset; NATS: stream sequence. Core NATS (no JetStream): a local counter.
    pub offset: i64,
    /// Engine id for vLLM payloads: the Kafka message key / the configured NATS subject token.
    pub engine: Option<String>,
    /// Header `model`, if present.
    pub model: Option<String>,
    /// Header `tenant`, if present.
    pub tenant: Option<String>,
    /// Header `dp_rank`, if present (the bridge sets it): the rank of a vLLM batch that
    /// names none itself.
    pub dp_rank: Option<u32>,
    pub payload: Vec<u8>,
}

/// Where each partition resumes: kvindex's durable checkpoint, consulted by sources when they
/// (re)acquire a partition. Implemented by the checkpoint store.
pub trait Checkpoints: Send + Sync {
    /// The next offset to read on `partition` of source `source` (e.g. `"kafka:kv-events"`), if
    /// one is durable.
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64>;
    /// Makes everything applied so far durable now (called before a partition is released).
    fn persist_now(&self);
}

/// A checkpoint store that has nothing stored (tests, `replay --from`).
pub struct NoCheckpoints;

impl Checkpoints for NoCheckpoints {
    fn next_offset(&self, _: &str, _: i32) -> Option<i64> {
        None
    }
    fn persist_now(&self) {}
}

/// Why a partition's stored position cannot be resumed from. `/v1/stats` shows it as
/// `{"kind": "ahead_of_log", "stored_offset", "high_watermark"}` (or `events_deleted` with
/// `low_watermark`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Divergence {
    /// The stored next offset is past the partition's high watermark / stream's last sequence.
    AheadOfLog {
        #[serde(rename = "stored_offset")]
        stored: i64,
        #[serde(rename = "high_watermark")]
        high: i64,
    },
    /// The log start moved past the stored offset: unread events were deleted.
    EventsDeleted {
        #[serde(rename = "stored_offset")]
        stored: i64,
        #[serde(rename = "low_watermark")]
        low: i64,
    },
}

/// What `/v1/stats` shows of one source partition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionStatus {
    pub partition: i32,
    /// Next offset the source will deliver (or -1 before the partition is positioned).
    pub position: i64,
    /// Log end (next offset to be written) as last seen.
    pub high_watermark: i64,
    /// Log start as last seen.
    pub low_watermark: i64,
    /// Set when consuming this partition stopped because its checkpoint diverged from the log.
    pub divergence: Option<Divergence>,
}

/// Source failures. Transient broker trouble is retried inside the source; what reaches the
/// caller is either fatal or reported for visibility.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("kafka: {0}")]
    Kafka(String),
    #[error("nats: {0}")]
    Nats(String),
    #[error("source configuration: {0}")]
    Config(String),
}

/// How long a poll may wait for the first message before returning an empty batch.
pub const DEFAULT_POLL_WAIT: Duration = Duration::from_millis(100);

/// What the ingest loop needs of a source, whichever transport it reads. Offsets are
/// `(partition, next offset)`; NATS has one partition, 0, whose offsets are stream sequences.
#[allow(async_fn_in_trait)] // driven on one current-thread runtime: no `Send` bound needed
pub trait EventSource: Sized {
    /// How to reach it (cloned for every reconnection attempt).
    type Settings: Clone;

    /// Connects and positions every partition it is given from `checkpoints` (or the
    /// configured start where none is stored).
    async fn connect(
        settings: Self::Settings,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<Self, SourceError>;

    /// The source's key in the checkpoint store (`kafka:<topic>`, `nats:<stream>`).
    fn name(&self) -> String;

    /// Up to `max` messages in per-partition order, waiting at most `wait` for the first: an
    /// empty batch means "nothing right now" (also while the broker is unreachable).
    async fn next_batch(&mut self, max: usize, wait: Duration)
    -> Result<Vec<Message>, SourceError>;

    /// Partitions whose checkpoint was abandoned (`reset_on_divergence`) since the last call:
    /// the caller forgets what it applied of them before it applies their next messages.
    fn take_resets(&mut self) -> Vec<i32>;

    /// Acknowledges upstream (Kafka group commit, JetStream ack) everything below each
    /// `(partition, next offset)`. Call only for durable state.
    async fn commit(&mut self, durable: &[(i32, i64)]) -> Result<(), SourceError>;

    /// The partitions it holds: positions, watermarks, divergences.
    fn status(&self) -> Vec<PartitionStatus>;

    /// Each held partition's log end when it was first positioned: caught up = applied past
    /// it. Empty until partitions are assigned.
    fn high_watermarks_at_start(&self) -> Vec<(i32, i64)>;

    /// Divergences detected since connecting.
    fn divergences_total(&self) -> u64;

    /// Why the brokers are not being read right now, for a source that keeps retrying inside
    /// (`None`: nothing known to be wrong).
    fn trouble(&self) -> Option<String> {
        None
    }

    /// Sends what is still buffered (the last acknowledgements). Call after the last `commit`.
    async fn close(&mut self);
}

/// How to reach the configured source.
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

    /// What `/v1/stats` calls it: `embedded`, `kafka`, `nats` or `nats-core`.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceSpec::Kafka { embedded: true, .. } => "embedded",
            SourceSpec::Kafka { .. } => "kafka",
            SourceSpec::Nats(s) if s.jetstream => "nats",
            SourceSpec::Nats(_) => "nats-core",
        }
    }
}
