//! Sources: where payloads come from, with their positions. Each source delivers
//! [`Message`]s in per-partition order, starts each partition where kvindex's own checkpoint
//! says (never the broker's), and acknowledges upstream only what is already durable.
//!
//! - `kafka.rs`: Kafka consumer (rdkafka), group or explicit partitions.
//! - `embedded.rs`: the in-process Kafka-protocol broker (librdkafka's mock cluster).
//! - `nats.rs`: NATS JetStream pull consumer, or core NATS subjects (at-most-once).

pub mod embedded;
pub mod kafka;
pub mod nats;
pub mod produce_kafka;

pub use embedded::EmbeddedBroker;
pub use kafka::{KafkaSettings, KafkaSource};
pub use produce_kafka::KafkaPublisher;

use std::time::Duration;

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

/// Why a partition's stored position cannot be resumed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Divergence {
    /// The stored next offset is past the partition's high watermark / stream's last sequence.
    AheadOfLog { stored: i64, high: i64 },
    /// The log start moved past the stored offset: unread events were deleted.
    EventsDeleted { stored: i64, low: i64 },
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
