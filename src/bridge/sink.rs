//! Where the bridge's records go: a Kafka topic (an external cluster or kvindex's embedded
//! broker) or a NATS JetStream stream. The sink reports every record's fate to the
//! [`Ledger`], which turns delivered records into durable stream positions and failed ones
//! into fences.
//!
//! Order and backpressure: one engine's records are sent in order on one key (Kafka: an
//! idempotent producer with `acks=all` and no delivery timeout, so while a broker is down
//! records wait, in order, in a bounded queue; NATS: JetStream publishes whose acks are
//! awaited in a bounded window). When the queue or window is full the sink stops taking
//! records; the stream threads then block, and ZeroMQ's high-water mark drops on the engine
//! side, which the gap rule repairs from the engine's replay buffer.

use super::ledger::{Ledger, Ticket};
use super::output::Record;
use crate::source::SourceError;
use crate::source::nats::NatsAuth;
use crate::util::{Backoff, LogEvery};
use async_nats::jetstream;
use futures::FutureExt as _;
use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, Message as _, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use std::collections::{BTreeMap, VecDeque};
use std::future::IntoFuture as _;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A batch's (or fence's) records with the ticket their fate is reported under.
pub struct Outgoing {
    pub ticket: Ticket,
    pub records: Vec<Record>,
}

/// Where to publish.
#[derive(Clone, Debug)]
pub enum SinkSpec {
    Kafka {
        brokers: String,
        topic: String,
        /// librdkafka properties passed through (SASL, TLS, …).
        properties: BTreeMap<String, String>,
    },
    Nats {
        url: String,
        stream: String,
        /// Subjects the stream captures (created if missing).
        subjects: Vec<String>,
        /// Records go to `<prefix>.<key>`.
        prefix: String,
        /// TLS and credentials (boxed: the largest part of the spec, seldom set).
        auth: Box<NatsAuth>,
    },
}

/// JetStream publishes awaiting their ack before the sink waits for the oldest.
const NATS_WINDOW: usize = 512;
/// Upper bound of the Kafka producer's local queue (librdkafka `queue.buffering.max.kbytes`).
const KAFKA_QUEUE_KBYTES: &str = "65536";

struct DeliveryCtx {
    ledger: Arc<Ledger>,
    warn: LogEvery,
}

impl ClientContext for DeliveryCtx {}

impl ProducerContext for DeliveryCtx {
    type DeliveryOpaque = Box<Ticket>;

    fn delivery(&self, result: &DeliveryResult<'_>, ticket: Box<Ticket>) {
        match result {
            Ok(m) => self.ledger.delivered(*ticket, m.partition(), m.offset()),
            Err((e, _)) => {
                if self.warn.ready() {
                    tracing::error!(error = %e, "bridge: a record was not delivered; its engine is fenced");
                }
                self.ledger.failed(*ticket);
            }
        }
    }
}

/// Runs the sink until `rx` closes and everything sent is settled.
pub async fn run(
    spec: SinkSpec,
    ledger: Arc<Ledger>,
    rx: mpsc::Receiver<Outgoing>,
) -> Result<(), SourceError> {
    match spec {
        SinkSpec::Kafka {
            brokers,
            topic,
            properties,
        } => run_kafka(&brokers, &topic, &properties, ledger, rx).await,
        SinkSpec::Nats {
            url,
            stream,
            subjects,
            prefix,
            auth,
        } => run_nats(&url, &auth, &stream, &subjects, &prefix, ledger, rx).await,
    }
}

fn kafka_producer(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    ledger: Arc<Ledger>,
) -> Result<ThreadedProducer<DeliveryCtx>, SourceError> {
    let mut cfg = ClientConfig::new();
    for (k, v) in properties {
        cfg.set(k, v);
    }
    cfg.set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        // 0 = no delivery timeout: while the cluster is down, records wait in order.
        .set("message.timeout.ms", "0")
        .set("linger.ms", "2")
        .set("queue.buffering.max.kbytes", KAFKA_QUEUE_KBYTES)
        // Java's partitioner, so every client maps a key to the same partition.
        .set("partitioner", "murmur2_random");
    cfg.create_with_context(DeliveryCtx {
        ledger,
        warn: LogEvery::new(Duration::from_secs(10)),
    })
    .map_err(|e| SourceError::Kafka(format!("bridge producer: {e}")))
}

async fn run_kafka(
    brokers: &str,
    topic: &str,
    properties: &BTreeMap<String, String>,
    ledger: Arc<Ledger>,
    mut rx: mpsc::Receiver<Outgoing>,
) -> Result<(), SourceError> {
    let producer = kafka_producer(brokers, properties, ledger.clone())?;
    while let Some(out) = rx.recv().await {
        for record in out.records {
            let headers = record
                .headers
                .iter()
                .fold(OwnedHeaders::new(), |h, (k, v)| {
                    h.insert(Header {
                        key: k,
                        value: Some(v.as_str()),
                    })
                });
            let mut base: BaseRecord<'_, str, [u8], Box<Ticket>> =
                BaseRecord::with_opaque_to(topic, Box::new(out.ticket))
                    .key(record.key.as_str())
                    .headers(headers)
                    .payload(record.payload.as_slice());
            loop {
                match producer.send(base) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        base = r;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    Err((e, _)) => {
                        tracing::error!(error = %e, "bridge: produce failed; the engine is fenced");
                        ledger.failed(out.ticket);
                        break;
                    }
                }
            }
        }
    }
    // Settle what is in flight (bounded: a cluster down at shutdown loses nothing durable,
    // the ledger simply does not advance past it).
    let p = producer.clone();
    let _ = tokio::task::spawn_blocking(move || p.flush(Duration::from_secs(10))).await;
    Ok(())
}

async fn run_nats(
    url: &str,
    auth: &NatsAuth,
    stream: &str,
    subjects: &[String],
    prefix: &str,
    ledger: Arc<Ledger>,
    mut rx: mpsc::Receiver<Outgoing>,
) -> Result<(), SourceError> {
    let nats_err =
        |what: &str, e: &dyn std::fmt::Display| SourceError::Nats(format!("bridge {what}: {e}"));
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let client = loop {
        match auth
            .options()
            .await?
            .name("kvindex-bridge")
            .retry_on_initial_connect()
            .connect(url)
            .await
        {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(error = %e, url, "bridge: NATS not reachable yet");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    };
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .build(client.clone());
    loop {
        match js
            .get_or_create_stream(jetstream::stream::Config {
                name: stream.to_string(),
                subjects: subjects.to_vec(),
                ..Default::default()
            })
            .await
        {
            Ok(_) => break,
            Err(e) => {
                tracing::warn!(error = %e, stream, "bridge: JetStream stream not available yet");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
    type AckFuture = futures::future::BoxFuture<
        'static,
        Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
    >;
    let mut window: VecDeque<(Ticket, AckFuture)> = VecDeque::new();
    let settle = |ticket: Ticket,
                  result: Result<jetstream::publish::PublishAck, String>,
                  ledger: &Ledger| match result {
        Ok(ack) => ledger.delivered(ticket, 0, i64::try_from(ack.sequence).unwrap_or(i64::MAX)),
        Err(e) => {
            tracing::error!(error = %e, "bridge: a JetStream publish was not acknowledged; its engine is fenced");
            ledger.failed(ticket);
        }
    };
    loop {
        // While acks are outstanding, settle them as they come in rather than only when the
        // next record arrives (an idle engine's position must still advance).
        let next = match window.front_mut() {
            None => rx.recv().await,
            Some((_, ack)) => tokio::select! {
                biased;
                result = ack => {
                    if let Some((t, _)) = window.pop_front() {
                        settle(t, result.map_err(|e| e.to_string()), &ledger);
                    }
                    continue;
                }
                out = rx.recv() => out,
            },
        };
        let Some(out) = next else { break };
        for record in out.records {
            while window.len() >= NATS_WINDOW {
                if let Some((t, ack)) = window.pop_front() {
                    settle(t, ack.await.map_err(|e| e.to_string()), &ledger);
                }
            }
            let mut headers = async_nats::HeaderMap::new();
            for (k, v) in &record.headers {
                headers.insert(*k, v.as_str());
            }
            let subject = crate::source::nats::wire::subject_for(prefix, &record.key);
            match js
                .publish_with_headers(subject, headers, record.payload.into())
                .await
            {
                Ok(ack) => window.push_back((out.ticket, ack.into_future().boxed())),
                Err(e) => {
                    settle(out.ticket, Err(e.to_string()), &ledger);
                    // Hold (backpressure) until the server is back rather than failing
                    // every record of every engine meanwhile.
                    while client.connection_state() != async_nats::connection::State::Connected {
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    backoff.reset();
                }
            }
        }
    }
    while let Some((t, ack)) = window.pop_front() {
        settle(t, ack.await.map_err(|e| e.to_string()), &ledger);
    }
    let _ = client.flush().await.map_err(|e| nats_err("flush", &e));
    Ok(())
}
