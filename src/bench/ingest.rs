//! The JetStream ingest bench's two halves that are not `kvindex serve` itself: the workload
//! (a stream pre-filled with Stored events, in any encoding) and the baseline it is held
//! against, a plain drain of the same stream.
//!
//! The drain is the least a consumer of that stream can do: an async-nats pull consumer with
//! the service's own consumer settings (`AckPolicy::All`, the same pull batch and ack window)
//! that acknowledges the last message of every pulled batch and throws the payloads away. The
//! time it takes is the broker's delivery limit on this machine; `kvindex serve` indexing the
//! same messages durably is measured against it.

use crate::event::{BlockContent, EngineHash, Event, EventKind, Format, PartitionKey, encode};
use crate::sim::Rng;
use crate::source::{NatsPublisher, SourceError, labels, nats};
use async_nats::jetstream::{self, consumer::AckPolicy, consumer::DeliverPolicy, consumer::pull};
use futures::StreamExt;
use std::time::{Duration, Instant};

/// The model and tenant every bench event belongs to.
pub const MODEL: &str = "bench-model";
pub const TENANT: &str = "default";

/// What the pre-filled stream holds: `messages` payloads, each one Stored event of `blocks`
/// blocks of `block_size` token ids. An engine's consecutive messages continue one chain (a
/// conversation growing turn by turn) for `turns` messages, then it starts a new root.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub messages: usize,
    pub blocks: usize,
    pub block_size: u32,
    pub engines: usize,
    pub turns: usize,
    pub format: Format,
    pub seed: u64,
}

/// One message of the workload: the engine it is published for (last subject token), its
/// payload, and the block events it carries.
pub struct Payload {
    pub engine: String,
    pub bytes: Vec<u8>,
    pub block_events: u64,
}

impl Workload {
    /// Block events in the whole stream (every block of every message is one store).
    pub fn block_events(&self) -> u64 {
        (self.messages * self.blocks) as u64
    }

    /// The messages, in publishing order (engines round-robin).
    pub fn payloads(&self) -> Vec<Payload> {
        let engines = self.engines.max(1);
        let turns = self.turns.max(1);
        let mut rng = Rng::new(self.seed);
        // Per engine: the last block hash of its current chain and how many turns it has.
        let mut chains: Vec<(Option<EngineHash>, usize)> = vec![(None, 0); engines];
        let mut next_hash = 1u64;
        let partition = PartitionKey::new(TENANT, MODEL, "");
        (0..self.messages)
            .map(|i| {
                let e = i % engines;
                let engine = format!("engine-{e}");
                let (parent, turn) = &mut chains[e];
                if *turn == turns {
                    (*parent, *turn) = (None, 0);
                }
                let mut event = Event::new(EventKind::Stored, engine.clone(), partition.clone());
                event.parent_hash = *parent;
                event.block_hashes = (0..self.blocks)
                    .map(|_| {
                        next_hash += 1;
                        EngineHash(next_hash)
                    })
                    .collect();
                event.content = BlockContent::Tokens {
                    token_ids: (0..self.blocks * self.block_size as usize)
                        .map(|_| (rng.next_u64() % 100_000) as u32)
                        .collect(),
                    block_size: self.block_size,
                };
                *parent = event.block_hashes.last().copied();
                *turn += 1;
                let events = [event];
                let bytes = match self.format {
                    Format::Json => encode::to_json(&events),
                    Format::Vllm => encode::to_vllm(&events, 0),
                    Format::Proto | Format::Auto => encode::to_proto(&events),
                };
                Payload {
                    engine,
                    bytes,
                    block_events: self.blocks as u64,
                }
            })
            .collect()
    }
}

/// Creates `stream` (subjects `<prefix>.>`) and publishes `payloads` to it, each on
/// `<prefix>.<engine>` with the model and tenant headers (vLLM payloads name neither), waiting
/// for every ack. Returns the stream's last sequence.
pub async fn fill_stream(
    url: &str,
    stream: &str,
    prefix: &str,
    payloads: Vec<Payload>,
) -> Result<u64, SourceError> {
    let mut publisher = NatsPublisher::connect(url, true).await?;
    publisher
        .ensure_stream(stream, &[format!("{prefix}.>")])
        .await?;
    let headers = labels(MODEL, TENANT);
    for p in payloads {
        let subject = nats::wire::subject_for(prefix, &p.engine);
        publisher.send(&subject, &headers, p.bytes).await?;
    }
    publisher.flush().await?;
    let info = jetstream_of(publisher.client())
        .get_stream(stream)
        .await
        .map_err(|e| nats_err(&format!("stream `{stream}`"), e))?
        .info()
        .await
        .map_err(|e| nats_err(&format!("stream `{stream}` info"), e))?
        .clone();
    Ok(info.state.last_sequence)
}

/// Creates `stream` (subjects `<prefix>.>`) holding at most `max_bytes`, the oldest messages
/// discarded first: a long run's stream that a consumer near its head reads.
pub async fn create_capped_stream(
    url: &str,
    stream: &str,
    prefix: &str,
    max_bytes: i64,
) -> Result<(), SourceError> {
    let publisher = NatsPublisher::connect(url, true).await?;
    jetstream_of(publisher.client())
        .create_stream(jetstream::stream::Config {
            name: stream.to_string(),
            subjects: vec![format!("{prefix}.>")],
            max_bytes,
            ..Default::default()
        })
        .await
        .map_err(|e| nats_err(&format!("create stream `{stream}`"), e))?;
    Ok(())
}

/// Deletes `stream`.
pub async fn delete_stream(url: &str, stream: &str) -> Result<(), SourceError> {
    let publisher = NatsPublisher::connect(url, true).await?;
    jetstream_of(publisher.client())
        .delete_stream(stream)
        .await
        .map_err(|e| nats_err(&format!("delete stream `{stream}`"), e))?;
    Ok(())
}

/// What one plain drain measured.
#[derive(Clone, Copy, Debug)]
pub struct Drained {
    pub messages: u64,
    /// From the first message received to the ack of the last.
    pub elapsed: Duration,
}

impl Drained {
    pub fn messages_per_sec(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }
}

/// Messages per pull request and acks: the service's own pull batch.
const DRAIN_BATCH: usize = 512;
const DRAIN_ACK_PENDING: i64 = 65_536;

/// Reads `stream` from its first message to sequence `last` with a fresh pull consumer named
/// `consumer`, acking the last message of every `DRAIN_BATCH` and discarding the payloads;
/// deletes the consumer afterwards. Gives up after `limit`.
pub async fn drain(
    url: &str,
    stream: &str,
    consumer: &str,
    last: u64,
    limit: Duration,
) -> Result<Drained, SourceError> {
    let client = NatsPublisher::connect(url, false).await?;
    let js = jetstream_of(client.client());
    let stream_handle = js
        .get_stream(stream)
        .await
        .map_err(|e| nats_err(&format!("stream `{stream}`"), e))?;
    let pull_consumer: jetstream::consumer::PullConsumer = stream_handle
        .create_consumer(pull::Config {
            durable_name: Some(consumer.to_string()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::All,
            max_ack_pending: DRAIN_ACK_PENDING,
            ..Default::default()
        })
        .await
        .map_err(|e| nats_err(&format!("create consumer `{consumer}`"), e))?;
    let mut messages = pull_consumer
        .stream()
        .max_messages_per_batch(DRAIN_BATCH)
        .messages()
        .await
        .map_err(|e| nats_err(&format!("pull from `{consumer}`"), e))?;
    let deadline = Instant::now() + limit;
    let mut started = None;
    let mut received = 0u64;
    let result = loop {
        let next = tokio::time::timeout_at(deadline.into(), messages.next()).await;
        let message = match next {
            Err(_) => {
                break Err(nats_err(
                    "drain",
                    format!("{received} of {last} in {limit:?}"),
                ));
            }
            Ok(None) => break Err(nats_err("drain", "the pull ended early")),
            Ok(Some(Err(e))) => break Err(nats_err("drain", e)),
            Ok(Some(Ok(m))) => m,
        };
        started.get_or_insert_with(Instant::now);
        received += 1;
        let sequence = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        if received.is_multiple_of(DRAIN_BATCH as u64) || sequence >= last {
            message.ack().await.map_err(|e| nats_err("ack", e))?;
        }
        if sequence >= last {
            client
                .client()
                .flush()
                .await
                .map_err(|e| nats_err("flush", e))?;
            break Ok(Drained {
                messages: received,
                elapsed: started.map_or(Duration::ZERO, |t| t.elapsed()),
            });
        }
    };
    drop(messages);
    let _ = stream_handle.delete_consumer(consumer).await;
    result
}

fn jetstream_of(client: &async_nats::Client) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .build(client.clone())
}

fn nats_err(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Nats(format!("{what}: {e}"))
}
