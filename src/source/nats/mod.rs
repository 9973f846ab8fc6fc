//! The NATS source: a JetStream durable pull consumer (the default), or plain core NATS
//! subscriptions (`jetstream = false`). Here: the source and its delivery loop;
//! `position.rs`: (re)positioning the consumer and classifying what it pulls; `publisher.rs`:
//! publishing; `wire.rs`: subjects and headers, both directions; `connect.rs`: TLS and
//! credentials, for every NATS client kvindex makes.
//!
//! # JetStream: kvindex's checkpoint is the truth
//!
//! The stream (name and subjects from `[source.nats]`) and the durable pull consumer are
//! created if missing. On `connect` the durable consumer is positioned from
//! kvindex's own checkpoint (`Checkpoints::next_offset("nats:<stream>", 0)`), never from the
//! consumer's ack floor:
//!
//! - a stored next sequence `k` → delivery starts exactly at `k`. A durable consumer's start
//!   cannot be changed, so unless the existing consumer is idle exactly at `k - 1` (nothing
//!   pending, delivered = ack floor = `k - 1`, our configuration) it is deleted and recreated
//!   with `DeliverPolicy::ByStartSequence { k }`;
//! - no checkpoint → the index is empty and needs everything: `DeliverPolicy::All` (an
//!   existing consumer that already delivered part of the stream is recreated).
//!
//! Messages are delivered in increasing stream-sequence order. Gaps (deleted messages,
//! purges behind or ahead of the position while consuming) are jumps, not errors. The only
//! messages that may arrive with a sequence below the position are **redeliveries** (ack wait
//! expired because nothing was committed for [`ACK_WAIT`]); they are delivered as they come
//! and counted ([`NatsSource::redeliveries_total`]); the consumer must skip what it has
//! already applied.
//!
//! Order is protected against lost deliveries and server restarts: if the consumer sequence
//! jumps (messages the server sent were lost in flight) or the client reconnected (a restarted
//! server may resume the consumer from older, not yet flushed state and re-send sequences
//! below the position with a delivery count of 1), the pull is dropped and the consumer
//! repositioned (deleted and recreated at the next undelivered sequence) instead of delivering
//! out of order. Messages that arrive over a new connection on an old pull are discarded.
//!
//! ## One consumer per replica
//!
//! Two processes pulling from one durable would split the stream between them, and each
//! repositioning would delete the other's consumer. The consumer's description names its
//! owner (`kvindex replica <id>`, from [`NatsSettings::owner`]); an existing durable that
//! names another owner who is consuming from it (a pull request waiting, or a delivery or ack
//! within [`PULL_EXPIRES`]) is left alone: positioning fails with an error naming that replica
//! and is retried with backoff, so nothing is consumed until the configuration is fixed. A
//! durable whose owner has gone quiet that long (a killed process's last pull expires too) is
//! taken over. The default durable name, `kvindex-{replica_id}`, keeps replicas apart
//! without any of this.
//!
//! ## Acks
//!
//! The consumer uses `AckPolicy::All`. `commit` (`(0, next)`) is called only once
//! everything below `next` is durable in kvindex; it acks the highest delivered message below
//! `next`, which acks everything before it. Only the reply subjects (not the payloads) of
//! delivered-but-uncommitted messages are held, at most [`MAX_ACK_PENDING`] of them (the server
//! stops delivering beyond that many unacked messages, which is also the backpressure if
//! commits stall). An ack that gets lost is harmless: the next connect positions from the
//! checkpoint anyway.
//!
//! ## Divergence
//!
//! At every (re)positioning the stored / next sequence `k` is checked against the stream:
//! `k > last_seq + 1` (stream recreated or shortened) is [`Divergence::AheadOfLog`];
//! `k < first_seq` (unread messages purged / aged out) is [`Divergence::EventsDeleted`].
//! Consuming then stops (an `error!` log, `status` shows the divergence, `divergences_total`
//! counts it, `next_batch` returns empty batches) unless
//! `reset_on_divergence`, which restarts from the stream's first sequence with a warning and
//! leaves a note for the caller in [`NatsSource::take_reset`]. A stream deleted and recreated
//! that has since grown past `k` cannot be told apart from the original by sequence alone.
//!
//! ## Connection loss
//!
//! async-nats reconnects by itself (forever). Meanwhile `next_batch` keeps returning empty
//! batches after `wait`; once reconnected the consumer is repositioned at the next undelivered
//! sequence and consumption resumes. Nothing here panics on broker trouble.
//!
//! # Core NATS (`jetstream = false`): AT-MOST-ONCE
//!
//! **Plain subscriptions to the configured subjects. There is no replay and no resume:
//! messages published while kvindex is down or disconnected are lost, checkpoints are ignored,
//! and offsets are a local counter starting at 1 in each process (they mean nothing across
//! restarts). `commit` does nothing.** A slow consumer can also lose messages (the client drops
//! them when its subscription buffer is full). Use it for best-effort, live-only indexes.

mod connect;
mod position;
mod publisher;
pub mod wire;

pub use connect::NatsAuth;
pub use publisher::NatsPublisher;

use super::{
    Checkpoints, DP_RANK_HEADER, Divergence, EventSource, MODEL_HEADER, Message, PartitionStatus,
    SourceError, TENANT_HEADER,
};
use crate::config::NatsConfig;
use crate::util::{Backoff, LogEvery};
use async_nats::Subject;
use async_nats::jetstream::{self, consumer::pull};
use futures::{FutureExt, StreamExt};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How long the server waits for an ack before redelivering. Commits normally come every
/// checkpoint interval (100 ms), so a redelivery means the pipeline stalled for this long.
pub const ACK_WAIT: Duration = Duration::from_secs(120);
/// Most delivered-but-unacked messages the server lets the consumer have (and the most ack
/// handles the source holds).
pub const MAX_ACK_PENDING: i64 = 65_536;
/// Messages per pull request.
const PULL_BATCH: usize = 512;
const PULL_EXPIRES: Duration = Duration::from_secs(30);
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// Timeout of one JetStream API request.
const API_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on a whole (re)positioning (several API requests).
const POSITION_TIMEOUT: Duration = Duration::from_secs(10);
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How often the stream's first/last sequence is refreshed for `status()`.
const STATUS_REFRESH: Duration = Duration::from_secs(1);
/// Repeated warnings of one kind are logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How long the server keeps a transient consumer nobody pulls from.
pub const TRANSIENT_IDLE: Duration = Duration::from_secs(60);

/// Everything the NATS source needs (see `[source.nats]` in the configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsSettings {
    pub url: String,
    pub stream: String,
    pub subjects: Vec<String>,
    pub durable: String,
    /// Which subject token is the engine id: an index into the subject split at `.`;
    /// negative counts from the end (-1 = last).
    pub engine_token: i32,
    /// `false` = core NATS subscriptions, at-most-once (see the module docs).
    pub jetstream: bool,
    /// On a diverged checkpoint, restart from the stream's first sequence instead of stopping.
    pub reset_on_divergence: bool,
    /// TLS and credentials.
    pub auth: NatsAuth,
    /// The replica this consumer belongs to (its id), written into the consumer's
    /// description: a durable that another owner is pulling from is never taken over (see
    /// "One consumer per replica" in the module docs). `""` = no owner.
    pub owner: String,
    /// A short-lived consumer (the rebuild's): deleted on close, and by the server after
    /// [`TRANSIENT_IDLE`] without a pull should the process die first.
    pub transient: bool,
}

/// `[source.nats]`, stopping on divergence.
impl From<&NatsConfig> for NatsSettings {
    fn from(cfg: &NatsConfig) -> NatsSettings {
        NatsSettings {
            url: cfg.url.clone(),
            stream: cfg.stream.clone(),
            subjects: cfg.subjects.clone(),
            durable: cfg.durable.clone(),
            engine_token: i32::try_from(cfg.engine_token).unwrap_or(-1),
            jetstream: cfg.jetstream,
            reset_on_divergence: false,
            auth: NatsAuth::from(cfg),
            owner: String::new(),
            transient: false,
        }
    }
}

/// The stream's log start / end as last seen.
#[derive(Clone, Copy, Debug, Default)]
struct Watermarks {
    /// First sequence present (last + 1 when the stream is empty).
    low: i64,
    /// Last sequence + 1.
    high: i64,
}

impl Watermarks {
    fn of(state: &jetstream::stream::State) -> Watermarks {
        let high = state.last_sequence as i64 + 1;
        let low = if state.messages == 0 {
            high
        } else {
            (state.first_sequence as i64).max(1)
        };
        Watermarks { low, high }
    }
}

/// A live pull of the durable consumer.
struct Reader {
    messages: pull::Stream,
    /// Consumer sequence of the last delivery seen; a jump means deliveries were lost.
    last_cseq: u64,
}

struct Js {
    context: jetstream::Context,
    stream_config: jetstream::stream::Config,
    reader: Option<Reader>,
    /// No checkpoint and nothing delivered yet: (re)position with `DeliverPolicy::All`.
    from_start: bool,
    /// (stream sequence, ack reply subject) of delivered, uncommitted messages.
    held: VecDeque<(i64, Subject)>,
    /// Reconnect count when the current reader was positioned.
    seen_connects: u64,
    retry_at: Option<Instant>,
    retry: Backoff,
    refresher: JoinHandle<()>,
}

enum Mode {
    Core {
        subs: futures::stream::SelectAll<async_nats::Subscriber>,
    },
    JetStream(Box<Js>),
}

/// What one pulled message means.
enum Pulled {
    Deliver(Message),
    /// Unusable (no ack metadata); logged.
    Skip,
    /// Deliveries were lost before this one, or it came over a new connection to an old pull
    /// (the server may have restarted with older consumer state): reposition, do not deliver.
    Reposition,
}

/// The NATS source. See the module docs for the delivery contract.
pub struct NatsSource {
    settings: NatsSettings,
    name: String,
    client: async_nats::Client,
    mode: Mode,
    /// The client's connection statistics; `connects` counts the first connect and every
    /// reconnect.
    stats: Arc<async_nats::Statistics>,
    watermarks: Arc<Mutex<Watermarks>>,
    high_at_start: i64,
    /// Next sequence to deliver (-1 before positioned); core NATS: next local counter value.
    position: i64,
    health: Health,
}

/// What the source has run into since it connected (all zero / empty at first).
struct Health {
    /// The divergence consuming is stopped on, if any.
    divergence: Option<Divergence>,
    divergences: u64,
    redeliveries: u64,
    repositions: u64,
    /// A `reset_on_divergence` restart not yet taken by the caller.
    reset: Option<(Divergence, i64)>,
    /// Pull and positioning failures, logged at most every [`WARN_EVERY`].
    warnings: LogEvery,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            divergence: None,
            divergences: 0,
            redeliveries: 0,
            repositions: 0,
            reset: None,
            warnings: LogEvery::new(WARN_EVERY),
        }
    }
}

fn nats_err(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Nats(format!("{what}: {e}"))
}

fn to_message(m: &async_nats::Message, offset: i64, engine_token: i32) -> Message {
    Message {
        partition: 0,
        offset,
        engine: wire::engine_of(m.subject.as_str(), engine_token).map(str::to_string),
        model: wire::header(m.headers.as_ref(), MODEL_HEADER),
        tenant: wire::header(m.headers.as_ref(), TENANT_HEADER),
        dp_rank: wire::header(m.headers.as_ref(), DP_RANK_HEADER).and_then(|r| r.parse().ok()),
        payload: m.payload.to_vec(),
    }
}

impl NatsSource {
    /// Connects, creates the stream and durable consumer if missing, and positions the
    /// consumer from the checkpoint (see the module docs). A broker that cannot be reached at
    /// all is an error; a diverged checkpoint is not (the source starts stopped, or resets).
    async fn open(
        settings: NatsSettings,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<Self, SourceError> {
        if settings.subjects.is_empty() {
            return Err(SourceError::Config(
                "source.nats.subjects: at least one subject is needed".into(),
            ));
        }
        let client = settings
            .auth
            .options()
            .await?
            .name("kvindex")
            .connection_timeout(Duration::from_secs(5))
            .event_callback(|event| async move {
                match event {
                    async_nats::Event::Connected => tracing::info!("nats: connected"),
                    async_nats::Event::Disconnected => {
                        tracing::warn!("nats: disconnected; reconnecting")
                    }
                    other => tracing::debug!(event = %other, "nats client event"),
                }
            })
            .connect(settings.url.as_str())
            .await
            .map_err(|e| nats_err(&format!("cannot connect to {}", settings.url), e))?;
        let name = format!("nats:{}", settings.stream);
        let stats = client.statistics();
        let watermarks = Arc::new(Mutex::new(Watermarks::default()));

        if !settings.jetstream {
            let mut subs = Vec::new();
            for subject in &settings.subjects {
                let sub = client
                    .subscribe(subject.clone())
                    .await
                    .map_err(|e| nats_err(&format!("subscribe {subject}"), e))?;
                subs.push(sub);
            }
            // A round trip, so the server has the subscriptions before `connect` returns.
            client.flush().await.map_err(|e| nats_err("flush", e))?;
            tracing::warn!(subjects = ?settings.subjects, "nats: core NATS mode, at-most-once: no replay, no resume, checkpoints ignored");
            *watermarks.lock() = Watermarks { low: 1, high: 1 };
            return Ok(NatsSource {
                settings,
                name,
                client,
                mode: Mode::Core {
                    subs: futures::stream::select_all(subs),
                },
                stats,
                watermarks,
                high_at_start: 1,
                position: 1,
                health: Health::default(),
            });
        }

        let context = jetstream::ContextBuilder::new()
            .timeout(API_TIMEOUT)
            .build(client.clone());
        let stream_config = jetstream::stream::Config {
            name: settings.stream.clone(),
            subjects: settings.subjects.clone(),
            ..Default::default()
        };
        let refresher = tokio::spawn(refresh_watermarks(
            context.clone(),
            settings.stream.clone(),
            watermarks.clone(),
        ));
        let stored = checkpoints.next_offset(&name, 0);
        let mut source = NatsSource {
            settings,
            name,
            client,
            mode: Mode::JetStream(Box::new(Js {
                context,
                stream_config,
                reader: None,
                from_start: stored.is_none(),
                held: VecDeque::new(),
                seen_connects: 0,
                retry_at: None,
                retry: Backoff::new(RETRY_MIN, RETRY_MAX),
                refresher,
            })),
            stats,
            watermarks,
            high_at_start: 0,
            position: stored.unwrap_or(-1),
            health: Health::default(),
        };
        match tokio::time::timeout(POSITION_TIMEOUT, source.reposition()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(SourceError::Nats(format!(
                    "positioning consumer `{}` on stream `{}` timed out",
                    source.settings.durable, source.settings.stream
                )));
            }
        }
        source.high_at_start = source.watermarks.lock().high;
        Ok(source)
    }

    /// Whether this source is a JetStream consumer (false: core NATS, at-most-once).
    pub fn is_jetstream(&self) -> bool {
        matches!(self.mode, Mode::JetStream(_))
    }

    /// Up to `max` messages, waiting up to `wait` for the first. Returns an empty batch on
    /// timeout, while disconnected, and while stopped on a divergence. Errors are fatal only
    /// (core NATS subscriptions closed).
    async fn pull(&mut self, max: usize, wait: Duration) -> Result<Vec<Message>, SourceError> {
        let deadline = tokio::time::Instant::now() + wait;
        let max = max.max(1);
        if matches!(self.mode, Mode::Core { .. }) {
            return self.core_batch(max, deadline).await;
        }
        if self.health.divergence.is_some() {
            tokio::time::sleep_until(deadline).await;
            return Ok(Vec::new());
        }
        let connects = self.stats.connects.load(Ordering::SeqCst);
        let needs_position = {
            let js = self.js();
            if js.reader.is_some() && js.seen_connects != connects {
                tracing::info!(
                    position = self.position,
                    "nats: reconnected; repositioning the consumer"
                );
                true
            } else {
                js.reader.is_none()
            }
        };
        if needs_position {
            self.js_mut().reader = None;
            if !self.try_reposition(deadline).await {
                tokio::time::sleep_until(deadline).await;
                return Ok(Vec::new());
            }
        }

        let mut out = Vec::new();
        let first = {
            let js = self.js_mut();
            let Some(reader) = js.reader.as_mut() else {
                return Ok(out);
            };
            tokio::time::timeout_at(deadline, reader.messages.next()).await
        };
        let mut next = match first {
            Err(_) => return Ok(out),
            Ok(item) => Some(item),
        };
        while let Some(item) = next.take() {
            match item {
                None => {
                    self.reader_failed("pull stream ended");
                    break;
                }
                Some(Err(e)) => {
                    self.reader_failed(&e.to_string());
                    break;
                }
                Some(Ok(m)) => match self.pulled(m) {
                    Pulled::Deliver(msg) => out.push(msg),
                    Pulled::Skip => {}
                    Pulled::Reposition => break,
                },
            }
            if out.len() >= max {
                break;
            }
            let js = self.js_mut();
            if let Some(reader) = js.reader.as_mut() {
                next = reader.messages.next().now_or_never();
            }
        }
        Ok(out)
    }

    /// Acks everything delivered below `durable_next` (call only once it is durable). Ack
    /// trouble is logged, not returned: the checkpoint, not the ack floor, decides where the
    /// next run starts. Core NATS: nothing to do.
    async fn ack_below(&mut self, durable_next: i64) -> Result<(), SourceError> {
        let Mode::JetStream(js) = &mut self.mode else {
            return Ok(());
        };
        let mut best: Option<(i64, Subject)> = None;
        js.held.retain(|(seq, reply)| {
            if *seq >= durable_next {
                return true;
            }
            if best.as_ref().is_none_or(|(b, _)| seq > b) {
                best = Some((*seq, reply.clone()));
            }
            false
        });
        if let Some((seq, reply)) = best
            && let Err(e) = self.client.publish(reply, "+ACK".into()).await
        {
            tracing::debug!(seq, error = %e, "nats: ack not sent (the checkpoint still holds)");
        }
        Ok(())
    }

    /// The divergence consuming is stopped on, if any.
    pub fn divergence(&self) -> Option<&Divergence> {
        self.health.divergence.as_ref()
    }

    /// Messages delivered again with a sequence below the position (ack wait expired).
    pub fn redeliveries_total(&self) -> u64 {
        self.health.redeliveries
    }

    /// Times the consumer was (re)created or re-attached after the first positioning
    /// (reconnects, lost deliveries, pull errors, resets).
    pub fn repositions_total(&self) -> u64 {
        self.health.repositions
    }

    /// After a `reset_on_divergence` restart: the divergence and the sequence consumption
    /// restarted at, once. The caller must rebase its own notion of "already applied" (the
    /// restarted stream's sequences may be below the stored checkpoint) before applying.
    pub fn take_reset(&mut self) -> Option<(Divergence, i64)> {
        self.health.reset.take()
    }

    /// The stream's last sequence + 1 when the source started (core NATS: 1), for readiness:
    /// caught up once everything below it is applied.
    pub fn high_watermark_at_start(&self) -> i64 {
        self.high_at_start
    }

    fn js(&self) -> &Js {
        match &self.mode {
            Mode::JetStream(js) => js,
            Mode::Core { .. } => unreachable!("JetStream path in core NATS mode"),
        }
    }

    fn js_mut(&mut self) -> &mut Js {
        match &mut self.mode {
            Mode::JetStream(js) => js,
            Mode::Core { .. } => unreachable!("JetStream path in core NATS mode"),
        }
    }

    async fn core_batch(
        &mut self,
        max: usize,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Message>, SourceError> {
        let engine_token = self.settings.engine_token;
        let Mode::Core { subs } = &mut self.mode else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let mut next = match tokio::time::timeout_at(deadline, subs.next()).await {
            Err(_) => return Ok(out),
            Ok(item) => Some(item),
        };
        while let Some(item) = next.take() {
            let Some(m) = item else {
                return Err(SourceError::Nats(
                    "core NATS subscriptions closed".to_string(),
                ));
            };
            out.push(to_message(&m, self.position, engine_token));
            self.position += 1;
            if out.len() >= max {
                break;
            }
            next = subs.next().now_or_never();
        }
        let mut w = self.watermarks.lock();
        w.high = self.position;
        Ok(out)
    }
}

impl EventSource for NatsSource {
    type Settings = NatsSettings;

    async fn connect(
        settings: NatsSettings,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<NatsSource, SourceError> {
        NatsSource::open(settings, checkpoints).await
    }

    /// `"nats:<stream>"` (partition 0).
    fn name(&self) -> String {
        self.name.clone()
    }

    async fn next_batch(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Message>, SourceError> {
        self.pull(max, wait).await
    }

    /// Partition 0 after a `reset_on_divergence` restart ([`NatsSource::take_reset`] says
    /// more).
    fn take_resets(&mut self) -> Vec<i32> {
        self.take_reset().map(|_| vec![0]).unwrap_or_default()
    }

    async fn commit(&mut self, durable: &[(i32, i64)]) -> Result<(), SourceError> {
        match durable.iter().find(|(p, _)| *p == 0) {
            Some(&(_, next)) => self.ack_below(next).await,
            None => Ok(()),
        }
    }

    /// One entry, partition 0: position, stream first/last sequence (refreshed every second),
    /// and the divergence consuming stopped on, if any.
    fn status(&self) -> Vec<PartitionStatus> {
        let w = *self.watermarks.lock();
        vec![PartitionStatus {
            partition: 0,
            position: self.position,
            high_watermark: w.high,
            low_watermark: w.low,
            divergence: self.health.divergence.clone(),
        }]
    }

    fn high_watermarks_at_start(&self) -> Vec<(i32, i64)> {
        vec![(0, self.high_at_start)]
    }

    /// Divergences detected (including those reset past with `reset_on_divergence`).
    fn divergences_total(&self) -> u64 {
        self.health.divergences
    }

    /// Sends what is still buffered (the last acks), waiting at most 2 s; deletes a transient
    /// consumer.
    async fn close(&mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
        if let (true, Mode::JetStream(js)) = (self.settings.transient, &self.mode) {
            let (stream, durable) = (&self.settings.stream, &self.settings.durable);
            let delete = js.context.delete_consumer_from_stream(durable, stream);
            match tokio::time::timeout(Duration::from_secs(2), delete).await {
                Ok(Ok(_)) => {
                    tracing::debug!(durable = %durable, "nats: transient consumer deleted")
                }
                Ok(Err(e)) => {
                    tracing::warn!(durable = %durable, error = %e, "nats: cannot delete the transient consumer (the server drops it once idle)")
                }
                Err(_) => {
                    tracing::warn!(durable = %durable, "nats: deleting the transient consumer timed out (the server drops it once idle)")
                }
            }
        }
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        if let Mode::JetStream(js) = &self.mode {
            js.refresher.abort();
        }
    }
}

/// Refreshes the stream's first/last sequence for `status()` while connected.
async fn refresh_watermarks(
    context: jetstream::Context,
    stream: String,
    watermarks: Arc<Mutex<Watermarks>>,
) {
    let mut tick = tokio::time::interval(STATUS_REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if context.client().connection_state() != async_nats::connection::State::Connected {
            continue;
        }
        if let Ok(Ok(s)) = tokio::time::timeout(API_TIMEOUT, context.get_stream(&stream)).await {
            *watermarks.lock() = Watermarks::of(&s.cached_info().state);
        }
    }
}
