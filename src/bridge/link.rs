//! One engine endpoint (an engine's DP rank): a thread owning the SUB socket, its monitor and
//! the replay client, applying the sequence rules ([`Sequencer`]) to every batch and handing
//! what to publish to the sink.
//!
//! libzmq sockets are blocking and not thread-safe, so each endpoint gets its own OS thread
//! (vLLM's publisher has one per rank too); the sink is async and shared. While the sink is
//! full the thread blocks, the SUB socket's queue fills, and the engine's PUB drops: those
//! drops come back as gaps, which the engine's replay buffer repairs.
//!
//! Connection events come from the socket monitor. Every (re)connection is a moment the
//! publisher may have changed (an engine restart keeps its address), so it is verified with a
//! probe replay from the last forwarded seq: the same batch at the same seq means the same
//! publisher life; anything else fences. Without a replay endpoint there is nothing to verify
//! with, so a reconnection fences. Disconnected longer than `gone_after` also fences.
//!
//! Streams are per topic: the configured topic (usually `""`) is the engine itself; another
//! topic arriving on the same socket (several publishers connecting to one bound SUB) is its
//! own stream, engine id `<id>/<topic>`, with its own sequence space and no replay (the
//! replay endpoint belongs to the configured engine).

use super::frames::{self, Batch};
use super::ledger::{Ledger, StreamId, StreamKey};
use super::output::{PartitionBy, StreamLabels};
use super::replay::ReplayClient;
use super::sequencer::{Live, Probe, Sequencer, digest};
use super::sink::Outgoing;
use super::stats::{BridgeStats, FenceReason, ReplayOutcome, StreamEntry};
use crate::util::LogEvery;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long the thread waits on its sockets before checking stop, fences and the gone timer.
const TICK: Duration = Duration::from_millis(50);
/// Most live messages taken in one go before the housekeeping runs again.
const DRAIN: usize = 4096;
/// No new replay for a stream this long after one failed (gaps meanwhile fence at once).
const REPLAY_COOLDOWN: Duration = Duration::from_secs(10);
/// The SUB socket's receive high-water mark (messages held while the thread is busy).
const RCVHWM: i32 = 100_000;

/// One endpoint to subscribe to.
#[derive(Clone, Debug)]
pub struct LinkSpec {
    pub labels: StreamLabels,
    /// The engine's PUB endpoint (with the rank's port offset applied).
    pub endpoint: String,
    /// Bind instead of connect (engines that connect to us).
    pub bind: bool,
    pub replay_endpoint: Option<String>,
    /// ZMQ subscription prefix.
    pub topic: String,
    pub partition_by: PartitionBy,
    /// Fence after this long disconnected.
    pub gone_after: Option<Duration>,
}

/// What every link shares.
#[derive(Clone)]
pub struct Shared {
    pub zmq: zmq::Context,
    pub ledger: Arc<Ledger>,
    pub stats: BridgeStats,
    pub sink: mpsc::Sender<Outgoing>,
    pub stop: Arc<AtomicBool>,
}

struct Stream {
    id: StreamId,
    entry: Arc<StreamEntry>,
    seq: Sequencer,
    labels: StreamLabels,
    adapters: BTreeSet<String>,
    needs_fence: Arc<AtomicBool>,
    /// Only the configured topic's stream replays.
    replays: bool,
    cooldown_until: Option<Instant>,
}

struct Link {
    spec: LinkSpec,
    shared: Shared,
    replay: Option<ReplayClient>,
    streams: HashMap<Vec<u8>, Stream>,
    connected: bool,
    peers: usize,
    disconnected_since: Option<Instant>,
    warn: LogEvery,
    /// Set once the sink is gone (shutdown): nothing more can be published.
    closed: bool,
}

static MONITORS: AtomicUsize = AtomicUsize::new(0);

/// Runs one link until `shared.stop` is set. Whether its sockets came up is sent on `ready`;
/// later socket errors are logged, and libzmq reconnects on its own.
pub fn run(
    spec: LinkSpec,
    shared: Shared,
    ready: std::sync::mpsc::Sender<Result<(), zmq::Error>>,
) -> Result<(), zmq::Error> {
    let (sub, monitor) = match open_sockets(&spec, &shared) {
        Ok(sockets) => {
            let _ = ready.send(Ok(()));
            sockets
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    let replay = spec
        .replay_endpoint
        .clone()
        .map(|e| ReplayClient::new(shared.zmq.clone(), e));
    let mut link = Link {
        spec,
        shared,
        replay,
        streams: HashMap::new(),
        connected: false,
        peers: 0,
        disconnected_since: Some(Instant::now()),
        warn: LogEvery::new(Duration::from_secs(10)),
        closed: false,
    };
    let topic = link.spec.topic.as_bytes().to_vec();
    link.stream(&topic);
    tracing::info!(engine = %link.spec.labels.engine, dp_rank = link.spec.labels.dp_rank,
        endpoint = %link.spec.endpoint, bind = link.spec.bind, "bridge: subscribing");
    while !link.shared.stop.load(Relaxed) && !link.closed {
        let mut items = [
            sub.as_poll_item(zmq::POLLIN),
            monitor.as_poll_item(zmq::POLLIN),
        ];
        if let Err(e) = zmq::poll(&mut items, TICK.as_millis() as i64)
            && e != zmq::Error::EINTR
        {
            return Err(e);
        }
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
            link.on_monitor_event(&frames);
        }
        for _ in 0..DRAIN {
            match sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => link.on_live(frames),
                Err(_) => break,
            }
        }
        link.housekeeping();
    }
    Ok(())
}

/// The SUB socket (subscribed, monitored, bound or connected) and its monitor's PAIR socket.
fn open_sockets(
    spec: &LinkSpec,
    shared: &Shared,
) -> Result<(zmq::Socket, zmq::Socket), zmq::Error> {
    let sub = shared.zmq.socket(zmq::SUB)?;
    sub.set_linger(0)?;
    sub.set_rcvhwm(RCVHWM)?;
    sub.set_subscribe(spec.topic.as_bytes())?;
    let monitor_addr = format!(
        "inproc://kvindex-bridge-monitor-{}",
        MONITORS.fetch_add(1, Relaxed)
    );
    let events = zmq::SocketEvent::CONNECTED.to_raw()
        | zmq::SocketEvent::ACCEPTED.to_raw()
        | zmq::SocketEvent::DISCONNECTED.to_raw();
    sub.monitor(&monitor_addr, i32::from(events))?;
    let monitor = shared.zmq.socket(zmq::PAIR)?;
    monitor.set_linger(0)?;
    monitor.connect(&monitor_addr)?;
    if spec.bind {
        sub.bind(&spec.endpoint)?;
    } else {
        sub.connect(&spec.endpoint)?;
    }
    Ok((sub, monitor))
}

impl Link {
    /// The stream of `topic`, registered on first sight.
    fn stream(&mut self, topic: &[u8]) -> &mut Stream {
        let configured = topic == self.spec.topic.as_bytes();
        if !self.streams.contains_key(topic) {
            let mut labels = self.spec.labels.clone();
            let topic_str = String::from_utf8_lossy(topic).into_owned();
            if !configured {
                labels.engine = format!("{}/{}", labels.engine, topic_str);
            }
            let shown_topic = if configured { "" } else { topic_str.as_str() };
            let entry = self
                .shared
                .stats
                .register(&labels.engine, labels.dp_rank, shown_topic);
            let needs_fence = Arc::new(AtomicBool::new(false));
            let key = StreamKey {
                engine: labels.engine.clone(),
                dp_rank: labels.dp_rank,
                topic: shown_topic.to_string(),
            };
            let (id, position, adapters) =
                self.shared
                    .ledger
                    .register(key, entry.clone(), needs_fence.clone());
            let seq = Sequencer::resume(position.as_ref());
            entry.stats.epoch.store(seq.epoch(), Relaxed);
            entry.stats.connected.store(self.connected, Relaxed);
            let mut stream = Stream {
                id,
                entry,
                seq,
                labels,
                adapters,
                needs_fence,
                replays: configured && self.replay.is_some(),
                cooldown_until: None,
            };
            // A fence that was started but never followed by anything durable: redo it.
            if position.as_ref().is_some_and(|p| p.seq.is_none()) {
                self.fence(&mut stream, FenceReason::Unverified);
            } else if position.is_none() && !configured {
                // A publisher first seen on a bound socket: the index may hold anything
                // for its engine id (the configured stream meets its engine on connect).
                self.fence(&mut stream, FenceReason::FirstContact);
            }
            self.streams.insert(topic.to_vec(), stream);
        }
        self.streams.get_mut(topic).expect("inserted above")
    }

    fn on_monitor_event(&mut self, frames: &[Vec<u8>]) {
        let Some(head) = frames.first().filter(|f| f.len() >= 2) else {
            return;
        };
        let event = u16::from_ne_bytes([head[0], head[1]]);
        if event == zmq::SocketEvent::CONNECTED.to_raw()
            || event == zmq::SocketEvent::ACCEPTED.to_raw()
        {
            self.peers += 1;
            if !self.connected {
                self.connected = true;
                self.disconnected_since = None;
                self.set_connected(true);
                self.on_connect();
            }
        } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
            self.peers = self.peers.saturating_sub(1);
            if self.peers == 0 || !self.spec.bind {
                self.peers = 0;
                self.connected = false;
                self.disconnected_since = Some(Instant::now());
                self.set_connected(false);
                for s in self.streams.values_mut() {
                    s.seq.disconnected();
                }
                tracing::info!(engine = %self.spec.labels.engine, dp_rank = self.spec.labels.dp_rank, "bridge: engine disconnected");
            }
        }
    }

    fn set_connected(&self, up: bool) {
        for s in self.streams.values() {
            s.entry.stats.connected.store(up, Relaxed);
        }
    }

    /// A (re)connection: verify the publisher, or meet it.
    fn on_connect(&mut self) {
        tracing::info!(engine = %self.spec.labels.engine, dp_rank = self.spec.labels.dp_rank, "bridge: engine connected");
        let topics: Vec<Vec<u8>> = self.streams.keys().cloned().collect();
        for topic in topics {
            let Some(mut s) = self.streams.remove(&topic) else {
                continue;
            };
            if s.replays {
                match s.seq.last() {
                    Some(last) => self.probe(&mut s, last),
                    None => {
                        if !s.seq.is_clean() {
                            self.fence(&mut s, FenceReason::FirstContact);
                        }
                        self.replay_all(&mut s);
                    }
                }
            } else if !s.seq.is_clean() {
                let reason = if s.seq.last().is_some() {
                    FenceReason::Unverified
                } else {
                    FenceReason::FirstContact
                };
                self.fence(&mut s, reason);
            }
            self.streams.insert(topic, s);
        }
    }

    /// Every batch the engine buffers from `from` on, contiguous: libzmq's ROUTER drops
    /// replies beyond its send high-water mark (1,000 by default), so a long replay comes back
    /// with holes or without its end marker; each hole is asked for again. The first batch
    /// may be above `from` (the buffer no longer reaches it: the caller's call). `None`: the
    /// engine did not answer.
    fn replay(&mut self, s: &Stream, from: u64) -> Option<Vec<Batch>> {
        const MAX_ROUNDS: usize = 64;
        let client = self.replay.as_mut()?;
        let mut out: Vec<Batch> = Vec::new();
        let mut next = from;
        for _ in 0..MAX_ROUNDS {
            let reply = match client.replay(next) {
                Ok(r) => r,
                Err(e) => {
                    if self.warn.ready() {
                        tracing::warn!(engine = %s.labels.engine, dp_rank = s.labels.dp_rank, from = next, error = %e, "bridge: replay failed");
                    }
                    return (!out.is_empty()).then_some(out);
                }
            };
            let before = out.len();
            let mut hole = false;
            for b in reply.batches {
                match out.last().map(|last| last.seq + 1) {
                    Some(expected) if b.seq < expected => continue,
                    Some(expected) if b.seq > expected => {
                        hole = true;
                        break;
                    }
                    _ => out.push(b),
                }
            }
            if !hole && reply.complete {
                return Some(out);
            }
            if out.len() == before {
                // No progress (the buffer moved past the hole): what is contiguous is all.
                return Some(out);
            }
            next = out.last().map_or(from, |b| b.seq + 1);
        }
        Some(out)
    }

    /// Probe from `last`: the same batch at the same seq means the same publisher life.
    fn probe(&mut self, s: &mut Stream, last: u64) {
        let Some(batches) = self.replay(s, last) else {
            s.entry.stats.count_replay(ReplayOutcome::Failed);
            s.cooldown_until = Some(Instant::now() + REPLAY_COOLDOWN);
            self.fence(s, FenceReason::Unverified);
            return;
        };
        let first = batches.first().map(|b| (b.seq, digest(&b.payload)));
        match s.seq.judge_probe(first) {
            Probe::SameLife => {
                s.entry.stats.count_replay(ReplayOutcome::Ok);
                self.forward_replayed(s, batches);
            }
            Probe::Lost => {
                let truncated = first.is_some_and(|(seq, _)| seq > last);
                if truncated {
                    s.entry.stats.count_replay(ReplayOutcome::Truncated);
                    self.fence(s, FenceReason::Truncated);
                    // The buffer starts past `last`: what came back is all of it.
                    self.forward_replayed(s, batches);
                } else {
                    s.entry.stats.count_replay(ReplayOutcome::Ok);
                    s.entry.stats.restarts.fetch_add(1, Relaxed);
                    self.fence(s, FenceReason::Restarted);
                    self.replay_all(s);
                }
            }
        }
    }

    /// After a fence (or at first contact): everything the engine still buffers.
    fn replay_all(&mut self, s: &mut Stream) {
        match self.replay(s, 0) {
            Some(batches) => {
                s.entry.stats.count_replay(ReplayOutcome::Ok);
                self.forward_replayed(s, batches);
            }
            None => {
                s.entry.stats.count_replay(ReplayOutcome::Failed);
                s.cooldown_until = Some(Instant::now() + REPLAY_COOLDOWN);
            }
        }
    }

    fn forward_replayed(&mut self, s: &mut Stream, batches: Vec<Batch>) {
        for b in batches {
            if !s.seq.is_new(b.seq) {
                continue;
            }
            if s.seq.last().is_some_and(|last| b.seq != last + 1) {
                // A batch the engine numbered but no longer has: what follows cannot stand on
                // what is missing; fence and start over from this batch.
                s.entry.stats.gaps.fetch_add(1, Relaxed);
                self.fence(s, FenceReason::Unrepaired);
            }
            self.forward(s, &b);
        }
    }

    fn on_live(&mut self, frames: Vec<Vec<u8>>) {
        let batch = match frames::parse_live(frames) {
            Ok(b) => b,
            Err(e) => {
                let s = self.stream(self.spec.topic.clone().as_bytes());
                s.entry.stats.malformed.fetch_add(1, Relaxed);
                if self.warn.ready() {
                    tracing::warn!(engine = %self.spec.labels.engine, error = %e, "bridge: skipping a malformed message");
                }
                return;
            }
        };
        let topic = batch.topic.clone();
        self.stream(&topic);
        let Some(mut s) = self.streams.remove(&topic) else {
            return;
        };
        self.on_batch(&mut s, batch);
        self.streams.insert(topic, s);
    }

    fn on_batch(&mut self, s: &mut Stream, batch: Batch) {
        let seq = batch.seq;
        match s.seq.classify_live(seq) {
            Live::Forward => self.forward(s, &batch),
            Live::Duplicate => {
                s.entry.stats.duplicates.fetch_add(1, Relaxed);
            }
            Live::Restarted => {
                s.entry.stats.restarts.fetch_add(1, Relaxed);
                self.fence(s, FenceReason::Restarted);
                if s.replays && !self.cooling(s) {
                    self.replay_all(s);
                }
                if s.seq.is_new(seq) {
                    self.forward(s, &batch);
                }
            }
            Live::Gap { from } => {
                s.entry.stats.gaps.fetch_add(1, Relaxed);
                self.repair(s, from);
                match s.seq.classify_live(seq) {
                    Live::Forward => self.forward(s, &batch),
                    Live::Duplicate => {}
                    _ => {
                        self.fence(s, FenceReason::Unrepaired);
                        self.forward(s, &batch);
                    }
                }
            }
        }
        s.seq.saw_live(seq);
    }

    fn cooling(&self, s: &Stream) -> bool {
        s.cooldown_until.is_some_and(|t| Instant::now() < t)
    }

    /// Fills the gap from `from` with a replay, or fences.
    fn repair(&mut self, s: &mut Stream, from: u64) {
        if !s.replays || self.cooling(s) {
            self.fence(s, FenceReason::Unrepaired);
            return;
        }
        let Some(batches) = self.replay(s, from) else {
            s.entry.stats.count_replay(ReplayOutcome::Failed);
            s.cooldown_until = Some(Instant::now() + REPLAY_COOLDOWN);
            self.fence(s, FenceReason::Unrepaired);
            return;
        };
        if batches.first().map(|b| b.seq) != Some(from) {
            s.entry.stats.count_replay(ReplayOutcome::Truncated);
            self.fence(s, FenceReason::Truncated);
        } else {
            s.entry.stats.count_replay(ReplayOutcome::Ok);
        }
        self.forward_replayed(s, batches);
    }

    fn send(&mut self, out: Outgoing) {
        if self.shared.sink.blocking_send(out).is_err() {
            self.closed = true;
        }
    }

    fn forward(&mut self, s: &mut Stream, batch: &Batch) {
        let digest = digest(&batch.payload);
        let epoch = s.seq.epoch();
        let stats = &s.entry.stats;
        match s.labels.batch(
            self.spec.partition_by,
            batch.seq,
            epoch,
            &batch.payload,
            &mut s.adapters,
        ) {
            Ok(out) => {
                for adapter in &out.new_adapters {
                    self.shared.ledger.note_adapter(s.id, adapter);
                }
                let ticket = self.shared.ledger.enqueue(
                    s.id,
                    epoch,
                    Some(batch.seq),
                    digest,
                    out.records.len(),
                );
                stats.batches_forwarded.fetch_add(1, Relaxed);
                stats.events_forwarded.fetch_add(out.events as u64, Relaxed);
                stats.last_seq.store(batch.seq as i64, Relaxed);
                stats.last_event_us.store(crate::util::now_us(), Relaxed);
                self.send(Outgoing {
                    ticket,
                    records: out.records,
                });
            }
            Err(e) => {
                stats.malformed.fetch_add(1, Relaxed);
                if self.warn.ready() {
                    tracing::warn!(engine = %s.labels.engine, seq = batch.seq, error = %e, "bridge: skipping a batch that does not decode");
                }
            }
        }
        s.seq.forwarded(batch.seq, digest);
    }

    /// Publishes `AllBlocksCleared` for the stream's engine and rank before anything newer,
    /// and starts a new epoch. A fence right after another adds nothing and is skipped.
    fn fence(&mut self, s: &mut Stream, reason: FenceReason) {
        if s.seq.is_clean() {
            return;
        }
        let epoch = s.seq.fence();
        if let Err(e) = self.shared.ledger.begin_fence(s.id, epoch) {
            tracing::error!(error = %e, "bridge: could not record a fence; a restart may not repeat it");
        }
        let records = s.labels.fence(self.spec.partition_by, epoch, &s.adapters);
        let ticket = self
            .shared
            .ledger
            .enqueue(s.id, epoch, None, 0, records.len());
        s.entry.stats.count_fence(reason);
        s.entry.stats.epoch.store(epoch, Relaxed);
        s.entry.stats.last_seq.store(-1, Relaxed);
        tracing::info!(engine = %s.labels.engine, dp_rank = s.labels.dp_rank, epoch, reason = reason.as_str(), "bridge: fenced (engine's blocks cleared)");
        self.send(Outgoing { ticket, records });
    }

    fn housekeeping(&mut self) {
        let gone = match (self.spec.gone_after, self.disconnected_since) {
            (Some(after), Some(since)) => since.elapsed() >= after,
            _ => false,
        };
        let topics: Vec<Vec<u8>> = self.streams.keys().cloned().collect();
        for topic in topics {
            let Some(mut s) = self.streams.remove(&topic) else {
                continue;
            };
            if s.needs_fence.swap(false, Relaxed) {
                self.fence(&mut s, FenceReason::DeliveryFailed);
                if s.replays && self.connected && !self.cooling(&s) {
                    self.replay_all(&mut s);
                }
            }
            if gone && !s.seq.is_clean() {
                self.fence(&mut s, FenceReason::Gone);
            }
            self.streams.insert(topic, s);
        }
    }
}
