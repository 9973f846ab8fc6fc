//! Publishing to Kafka for `kvindex produce --kafka BROKERS` (and tests): messages are keyed by
//! engine id, so one engine's events stay ordered in one partition, and the producer is
//! idempotent by default, so retries neither duplicate nor reorder them.

use super::wire;
use crate::source::SourceError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::DeliveryResult;
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientConfig, ClientContext};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Default)]
struct Counts {
    delivered: AtomicU64,
    failed: AtomicU64,
}

struct PubCtx {
    counts: Arc<Counts>,
}

impl ClientContext for PubCtx {}

impl ProducerContext for PubCtx {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(_) => {
                self.counts.delivered.fetch_add(1, Ordering::Relaxed);
            }
            Err((e, _)) => {
                if self.counts.failed.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::error!(error = %e, "kafka delivery failed");
                }
            }
        }
    }
}

/// A Kafka producer for one topic. `send` only enqueues (librdkafka batches and delivers in the
/// background); [`flush`](Self::flush) waits for every delivery and reports failures.
pub struct KafkaPublisher {
    producer: ThreadedProducer<PubCtx>,
    topic: String,
    counts: Arc<Counts>,
}

impl KafkaPublisher {
    /// `properties` are librdkafka properties passed through (they may override the defaults
    /// `enable.idempotence=true`, `linger.ms=5`).
    pub fn new(
        brokers: &str,
        topic: &str,
        properties: &BTreeMap<String, String>,
    ) -> Result<KafkaPublisher, SourceError> {
        let mut cfg = ClientConfig::new();
        cfg.set("enable.idempotence", "true").set("linger.ms", "5");
        for (k, v) in properties {
            cfg.set(k, v);
        }
        cfg.set("bootstrap.servers", brokers);
        let counts = Arc::new(Counts::default());
        let producer = cfg
            .create_with_context(PubCtx {
                counts: counts.clone(),
            })
            .map_err(|e| SourceError::Kafka(format!("creating producer: {e}")))?;
        Ok(KafkaPublisher {
            producer,
            topic: topic.to_string(),
            counts,
        })
    }

    /// Enqueues one message keyed by `key` (the engine id) with `headers` (e.g.
    /// [`crate::source::labels`]). Waits only while librdkafka's local queue is full.
    pub async fn send(
        &self,
        key: Option<&str>,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> Result<(), SourceError> {
        let mut record: BaseRecord<'_, str, [u8]> = BaseRecord::to(&self.topic).payload(payload);
        if let Some(engine) = key {
            record = record.key(wire::key_of(engine));
        }
        if !headers.is_empty() {
            record = record.headers(wire::headers(headers));
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => return Err(SourceError::Kafka(format!("produce: {e}"))),
            }
        }
    }

    /// Waits up to `timeout` for every enqueued message to be delivered; fails if any was not.
    pub async fn flush(&self, timeout: Duration) -> Result<(), SourceError> {
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| SourceError::Kafka(format!("flush task failed: {e}")))?
            .map_err(|e| SourceError::Kafka(format!("flush: {e}")))?;
        match self.failed() {
            0 => Ok(()),
            n => Err(SourceError::Kafka(format!(
                "{n} messages were not delivered"
            ))),
        }
    }

    /// Messages acknowledged by the broker so far.
    pub fn delivered(&self) -> u64 {
        self.counts.delivered.load(Ordering::Relaxed)
    }

    /// Messages that failed delivery so far.
    pub fn failed(&self) -> u64 {
        self.counts.failed.load(Ordering::Relaxed)
    }
}
