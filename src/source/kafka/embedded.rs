//! The embedded Kafka-protocol broker: librdkafka's mock cluster, a real Kafka wire protocol
//! server on a loopback port inside this process. `kvindex serve` uses it by default so a laptop
//! run needs no Kafka; any Kafka client (librdkafka, the Java client, `kcat`, `kvindex produce
//! --kafka`) can produce to [`EmbeddedBroker::bootstrap_servers`].
//!
//! # Limits of the mock cluster (measured / read from librdkafka 2.12.1)
//!
//! * **Retention:** each partition keeps at most [`MOCK_MAX_PARTITION_BYTES`] (5 MiB of
//!   record batches) or [`MOCK_MAX_PARTITION_MESSAGES`] (100,000) *record batches* (librdkafka
//!   counts appended batches, not records: with producer batching the byte limit is what
//!   bites), whichever is hit first; the oldest batches are deleted and the log start (low
//!   watermark) moves forward. With ~1 KiB payloads that is only ~5,000 events per partition.
//!   A consumer that falls further behind than that sees `OFFSET_OUT_OF_RANGE` (kvindex reports
//!   it as [`Divergence::EventsDeleted`](super::Divergence::EventsDeleted)).
//! * **Nothing survives a restart:** every start is a new, empty log at offset 0, and the
//!   listen port is a new ephemeral loopback port (it cannot be fixed). Hence
//!   `KafkaSettings::log_is_ephemeral` for the consumer.
//! * **Topics:** the CreateTopics admin API is not implemented; topics are created here with
//!   [`MockCluster::create_topic`]. Auto-created topics get only 4 partitions.
//! * **`offsets_for_times` is not implemented:** ListOffsets by timestamp always answers `-1`
//!   (no such message), so a timestamp start position means "latest" against the mock.
//! * **Group join delay:** the mock defaults `group.initial.rebalance.delay.ms` to 3 s; we set
//!   it to 0 so a consumer group starts consuming immediately.
//! * **Fetches are not woken by new data:** a fetch that finds nothing waits its whole
//!   `fetch.wait.max.ms` (librdkafka's default 500 ms) even if records arrive meanwhile, so a
//!   quiet stream is seen up to half a second late. The service's consumer of the embedded
//!   broker waits [`EMBEDDED_FETCH_WAIT_MS`] instead (`kvindex bench bridge`, 2,000 block
//!   events/s: publish → visible p50 488 ms with the default, 13 ms with 10 ms).
//! * Loopback only (`127.0.0.1`), no TLS/SASL, one replica per partition.

use crate::source::SourceError;
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, DefaultProducerContext, Producer};

/// `fetch.wait.max.ms` of the service's consumer of the embedded broker (see the module docs).
pub const EMBEDDED_FETCH_WAIT_MS: u32 = 10;
/// Partitions of the embedded topic unless told otherwise.
pub const DEFAULT_PARTITIONS: i32 = 16;
/// Mock cluster retention per partition, in record batches (not records).
pub const MOCK_MAX_PARTITION_MESSAGES: u64 = 100_000;
/// Mock cluster retention per partition, in bytes of stored record batches.
pub const MOCK_MAX_PARTITION_BYTES: u64 = 5 * 1024 * 1024;

/// An in-process Kafka-protocol broker with one topic. Dropping it shuts the broker down
/// (clients connected to it then see "all brokers down").
pub struct EmbeddedBroker {
    /// **Kept alive for the broker's whole lifetime.** The librdkafka client handle that owns
    /// the mock cluster: the cluster was created by this handle (`test.mock.num.brokers`), runs
    /// on its threads and is destroyed when it is dropped. It is never used to produce.
    keeper: BaseProducer,
    topic: String,
    partitions: i32,
    bootstrap: String,
}

impl EmbeddedBroker {
    /// Starts a one-broker mock cluster on an ephemeral loopback port and creates `topic` with
    /// `partitions` partitions (use [`DEFAULT_PARTITIONS`]).
    pub fn start(topic: &str, partitions: i32) -> Result<EmbeddedBroker, SourceError> {
        if partitions < 1 {
            return Err(SourceError::Config(format!(
                "embedded broker: partitions must be ≥ 1, got {partitions}"
            )));
        }
        let keeper: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", "1")
            // The keeper never produces; keep its own chatter down.
            .set("log_level", "3")
            .create()
            .map_err(|e| SourceError::Kafka(format!("embedded broker: {e}")))?;
        let mut broker = EmbeddedBroker {
            keeper,
            topic: topic.to_string(),
            partitions,
            bootstrap: String::new(),
        };
        let mock = broker.mock();
        mock.create_topic(topic, partitions, 1).map_err(|e| {
            SourceError::Kafka(format!("embedded broker: creating topic `{topic}`: {e}"))
        })?;
        let bootstrap = mock.bootstrap_servers();
        drop(mock);
        broker.set_initial_rebalance_delay_ms(0);
        broker.bootstrap = bootstrap;
        tracing::info!(
            bootstrap = %broker.bootstrap,
            topic,
            partitions,
            "embedded Kafka-protocol broker started (in memory; nothing survives a restart)"
        );
        Ok(broker)
    }

    /// `host:port` of the broker, for `bootstrap.servers`.
    pub fn bootstrap_servers(&self) -> String {
        self.bootstrap.clone()
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    pub fn partitions(&self) -> i32 {
        self.partitions
    }

    /// The mock cluster, for fault injection (`broker_down`/`broker_up` with broker id 1,
    /// `request_errors`, ...) and extra topics. The handle borrows the broker and does not own
    /// the cluster (dropping it does nothing).
    pub fn mock(&self) -> MockCluster<'_, DefaultProducerContext> {
        self.keeper
            .client()
            .mock_cluster()
            .expect("the keeper client was created with test.mock.num.brokers")
    }

    /// Sets the mock's `group.initial.rebalance.delay.ms` (how long a new group waits for more
    /// members before its first assignment). [`start`](Self::start) sets 0.
    pub fn set_initial_rebalance_delay_ms(&self, delay_ms: i32) {
        // SAFETY: the keeper handle is alive (borrowed from `self`), so the mock cluster it owns
        // is too; the function only stores an integer under the cluster's own mutex.
        unsafe {
            let mc =
                rdkafka::bindings::rd_kafka_handle_mock_cluster(self.keeper.client().native_ptr());
            if !mc.is_null() {
                rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(mc, delay_ms);
            }
        }
    }
}

impl std::fmt::Debug for EmbeddedBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedBroker")
            .field("bootstrap", &self.bootstrap)
            .field("topic", &self.topic)
            .field("partitions", &self.partitions)
            .finish()
    }
}
