//! The write path: decoded events routed to per-shard worker threads, which apply them in
//! source order under their shard's write lock, skip what they have already applied, and
//! commit their changes together with the source offsets they cover.
//!
//! - `mod.rs` (here): the [`Pipeline`]: decoding a batch of source messages, routing its
//!   events to shards (pinning each model's block size first), and the control messages
//!   (flush, persist, forget a partition, forget an engine);
//! - [`worker`]: one shard's worker thread: apply, skip duplicates, hold on a failed L2 read,
//!   expire silent engines, commit;
//! - `inflight.rs`: the byte budget of decoded events queued for the workers;
//! - [`progress`]: per source partition, what each shard has applied and made durable;
//! - [`spill`]: the bounded L1's wiring: one spill controller per worker over the store;
//! - [`warm_up`]: after a restart, each worker loads its shard's rows before it applies,
//!   while lookups read what is not loaded yet from L2.
//!
//! Workers are plain threads (index work is CPU-bound Rust on owned data, no `.await`); the
//! bounded queues and the in-flight byte budget give backpressure: a source that outruns the
//! index blocks in [`Pipeline::ingest_batch`] instead of growing memory without bound. The `Pipeline` owns its
//! workers and stops them on drop (each makes a last commit first).
//!
//! # The checkpoint contract
//! Offsets are kvindex's own, stored with the index rows they cover:
//! - [`Pipeline::ingest_batch`] tags the events of every source message with the message's
//!   (source partition, offset). Each worker keeps a *floor* per source partition: the next
//!   offset it has applied. A message below the floor was applied before (a redelivery, a
//!   re-read after a restart or a rebalance) and its events are skipped and counted as
//!   duplicates. Every shard is told the offsets of every batch, also when none of its events
//!   were in it, so its floor (and its durable row) keeps up; `store/offsets.rs` says why.
//! - Each worker commits its shard's [`ChangeSet`](crate::index::ChangeSet) and its floors in
//!   one RocksDB `WriteBatch` ([`crate::store::Store::commit`]) every `interval` or
//!   `max_events` applied events, whichever comes first, and on [`Pipeline::persist`]. The
//!   change set is taken under the shard's write lock (between two events, so rows and offsets
//!   agree); the write runs outside it, so lookups never wait on I/O. A failed commit puts the
//!   changes back and is retried at the next tick.
//! - [`Progress`] mirrors what is applied and durable; the ingest loop acknowledges upstream
//!   (Kafka commit, NATS ack) only what every shard has made durable, and a restart resumes
//!   each source partition from the minimum over shards ([`Checkpoints`]).
//!
//! # Bounded L1
//! Each worker also runs its shard's spill duty after every batch and commit
//! (`pipeline/spill.rs`): commits pass the L2 circuit breaker, and while the shard's L1 is at
//! its hard cap the worker takes no work, so its queue fills and `ingest_batch` blocks: the
//! sources pause.

mod inflight;
pub mod progress;
pub mod spill;
pub mod warm_up;
pub mod worker;

pub use inflight::DEFAULT_INFLIGHT_BYTES;
pub use progress::Progress;
pub use spill::{ShardSpill, Spill};
pub use warm_up::{WarmUp, WarmUpFailed, WarmUpReport};
pub use worker::{CommitSettings, Liveness};

use crate::event::{DecodeSettings, Decoded, Envelope, Event, EventKind, decode_payload};
use crate::index::{Index, Observed, SkipReason};
use crate::metrics::Metrics;
use crate::source::{Checkpoints, Message};
use crate::store::{ShardLoad, Store, StoreError};
use crate::util::LogEvery;
use inflight::Inflight;
use progress::PartId;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::mpsc::{Sender, SyncSender, sync_channel};
use std::thread::JoinHandle;
use warm_up::ShardWarmUp;
use worker::{Worker, WorkerContext};

/// Batches waiting per shard before `ingest_batch` blocks.
const QUEUE_BATCHES: usize = 64;

/// Events of one source message that went to one shard: `events[previous end..end]`.
struct Span {
    part: PartId,
    offset: i64,
    end: usize,
}

/// One shard's share of a batch.
#[derive(Default)]
struct ShardWork {
    events: Vec<Event>,
    spans: Vec<Span>,
    /// (partition, next offset) of every source partition in the batch, for every shard.
    delivered: Vec<(PartId, i64)>,
    /// What `events` count against the in-flight budget (given back once applied).
    bytes: u64,
}

enum Msg {
    Work(ShardWork),
    /// Acknowledged once everything sent before it is applied.
    Barrier(Sender<()>),
    /// Commit now; acknowledged with whether the commit succeeded.
    Persist(Sender<bool>),
    /// Forget a source partition's floor (its checkpoint was abandoned).
    Forget(PartId, Sender<()>),
    /// Drop an engine from the shard; answered with the memberships removed (`None`: the
    /// shard does not know it).
    ForgetEngine(String, Sender<Option<u64>>),
}

/// Where a payload came from, for logs of what could not be decoded.
#[derive(Clone, Debug, Default)]
struct Position<'a> {
    source: &'a str,
    partition: i64,
    offset: i64,
}

/// What [`Pipeline::ingest_batch`] routed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    pub messages: usize,
    pub events: usize,
}

/// Shard workers plus the router in front of them.
pub struct Pipeline {
    index: Arc<Index>,
    metrics: Arc<Metrics>,
    store: Arc<Store>,
    progress: Arc<Progress>,
    senders: Vec<SyncSender<Msg>>,
    workers: Vec<JoinHandle<()>>,
    /// Set by [`Pipeline::close`]: the workers stop holding events back at L1's hard cap.
    closing: Arc<AtomicBool>,
    /// Rate limit of the block-size conflict warning.
    conflict_warnings: LogEvery,
    /// Bytes of decoded events queued for the workers (`inflight.rs`).
    inflight: Arc<Inflight>,
    /// The workers' loads after a restart (`warm_up.rs`).
    warm_up: Arc<WarmUp>,
}

impl Pipeline {
    /// Starts one worker per shard of `index`, each shard attached to `spill` and begun
    /// loading from `store` (`loads`, one per shard, which each worker finishes first; see
    /// `warm_up.rs`); `progress` holds the offsets the store holds ([`Progress::restore`]).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        index: Arc<Index>,
        metrics: Arc<Metrics>,
        store: Arc<Store>,
        progress: Arc<Progress>,
        commits: CommitSettings,
        spill: &Spill,
        liveness: Liveness,
        loads: Vec<ShardLoad>,
    ) -> Pipeline {
        assert_eq!(loads.len(), index.shard_count(), "one load per shard");
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        let closing = Arc::new(AtomicBool::new(false));
        let inflight = Arc::new(Inflight::new(commits.max_inflight_bytes));
        let warm_up = Arc::new(WarmUp::new(index.shard_count()));
        for (shard, load) in loads.into_iter().enumerate() {
            let (tx, rx) = sync_channel(QUEUE_BATCHES);
            let ctx = WorkerContext {
                index: index.clone(),
                metrics: metrics.clone(),
                store: store.clone(),
                progress: progress.clone(),
                commits,
                closing: closing.clone(),
                liveness: liveness.clone(),
                inflight: inflight.clone(),
            };
            let warm = ShardWarmUp {
                load,
                status: warm_up.clone(),
            };
            let mut worker = Worker::new(shard, ctx, spill.for_shard(shard), Some(warm));
            let handle = std::thread::Builder::new()
                .name(format!("kvindex-shard-{shard}"))
                .spawn(move || worker.run(rx))
                .expect("spawning a shard worker thread");
            senders.push(tx);
            workers.push(handle);
        }
        Pipeline {
            index,
            metrics,
            store,
            progress,
            senders,
            workers,
            closing,
            conflict_warnings: LogEvery::new(std::time::Duration::from_secs(10)),
            inflight,
            warm_up,
        }
    }

    /// The shards' warm-up after a restart (`warm_up.rs`).
    pub fn warm_up(&self) -> &Arc<WarmUp> {
        &self.warm_up
    }

    /// Shutdown has begun. From now on the workers no longer hold events back while L1 is at
    /// its hard cap: with L2 down that hold would last as long as the outage, and the sources
    /// (stopping after a last batch and persist) with it, so the process would never exit.
    /// What is queued is applied over the cap instead; commits still go through the breaker,
    /// so offsets only advance over what is durable, and a restart replays the rest.
    pub fn close(&self) {
        self.closing.store(true, Relaxed);
    }

    /// Bytes of decoded events queued for the workers now, and the budget.
    pub fn inflight_bytes(&self) -> (u64, u64) {
        (self.inflight.used(), self.inflight.limit())
    }

    pub fn index(&self) -> &Arc<Index> {
        &self.index
    }

    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// Counts and logs an event of unknown type; `false` for every other event.
    fn skip_unknown(&self, ev: &Event) -> bool {
        let EventKind::Unknown(t) = ev.kind else {
            return false;
        };
        self.metrics
            .count_skipped(SkipReason::UnknownType(t).reason());
        tracing::debug!(engine = %ev.engine, kind = t, "skipping event of unknown type");
        true
    }

    fn send(&self, work: Vec<ShardWork>) {
        for (tx, mut w) in self.senders.iter().zip(work) {
            if !w.events.is_empty() || !w.delivered.is_empty() {
                w.bytes = w.events.iter().map(inflight::event_bytes).sum();
                self.inflight.acquire(w.bytes);
                // A send fails only if the worker died, which it does only on shutdown.
                if let Err(std::sync::mpsc::SendError(Msg::Work(w))) = tx.send(Msg::Work(w)) {
                    self.inflight.release(w.bytes);
                }
            }
        }
    }

    /// Decodes one payload; bad input is counted and logged with its position, never fatal.
    fn decode(
        &self,
        payload: &[u8],
        env: &Envelope<'_>,
        opts: &DecodeSettings,
        pos: &Position<'_>,
    ) -> Vec<Event> {
        match decode_payload(payload, env, opts) {
            Ok(Decoded { events, skipped }) => {
                for e in &skipped {
                    self.metrics.count_malformed(e.reason());
                    tracing::warn!(source = pos.source, partition = pos.partition, offset = pos.offset, error = %e, "event dropped");
                }
                events
            }
            Err(e) => {
                self.metrics.count_malformed(e.reason());
                tracing::warn!(source = pos.source, partition = pos.partition, offset = pos.offset, bytes = payload.len(), error = %e, "payload skipped");
                Vec::new()
            }
        }
    }

    /// Pins the block size of a token-carrying event's model the first time one is seen,
    /// durably before the event is routed (so no commit holds it without its size); another
    /// size than the pinned one is counted and logged, and the event keys with its own.
    fn pin_block_size(&self, ev: &Event) -> Result<(), StoreError> {
        match self.index.observe_block_size(ev) {
            Observed::Known => {}
            Observed::New(size) => {
                let (tenant, model) = (&ev.partition.tenant, &ev.partition.model);
                self.store.pin_block_size(tenant, model, size)?;
                self.index.pin_block_size(tenant, model, size);
            }
            Observed::Conflict { pinned, got } => {
                if self.conflict_warnings.ready() {
                    tracing::warn!(tenant = %ev.partition.tenant, model = %ev.partition.model,
                        engine = %ev.engine, pinned, got,
                        "block size conflicts with the model's pinned one; token lookups keep the pinned size");
                }
            }
        }
        Ok(())
    }

    /// Decodes a batch of messages of `source` and routes their events with their positions.
    /// Before the first batch of a source partition in this process its shard rows are begun
    /// in the store; if that fails nothing is routed and the error is returned (retry the
    /// same batch).
    pub fn ingest_batch(
        &self,
        source: &str,
        messages: &[Message],
        opts: &DecodeSettings,
    ) -> Result<BatchStats, StoreError> {
        self.begin_partitions(source, messages)?;
        let shards = self.senders.len();
        let mut work: Vec<ShardWork> = (0..shards).map(|_| ShardWork::default()).collect();
        let mut delivered: Vec<(PartId, i64)> = Vec::new();
        let mut last: Option<(i32, PartId)> = None;
        let mut before = vec![0usize; shards];
        let mut stats = BatchStats::default();
        for msg in messages {
            let part = match last {
                Some((p, id)) if p == msg.partition => id,
                _ => self.progress.id(source, msg.partition),
            };
            last = Some((msg.partition, part));
            let env = Envelope {
                engine: msg.engine.as_deref(),
                model: msg.model.as_deref(),
                tenant: msg.tenant.as_deref(),
                dp_rank: msg.dp_rank,
            };
            let pos = Position {
                source,
                partition: msg.partition.into(),
                offset: msg.offset,
            };
            for (b, w) in before.iter_mut().zip(&work) {
                *b = w.events.len();
            }
            for ev in self.decode(&msg.payload, &env, opts, &pos) {
                if self.skip_unknown(&ev) {
                    continue;
                }
                self.pin_block_size(&ev)?;
                work[self.index.route(&ev)].events.push(ev);
                stats.events += 1;
            }
            for (w, &b) in work.iter_mut().zip(&before) {
                if w.events.len() > b {
                    w.spans.push(Span {
                        part,
                        offset: msg.offset,
                        end: w.events.len(),
                    });
                }
            }
            match delivered.iter_mut().find(|(p, _)| *p == part) {
                Some((_, next)) => *next = (*next).max(msg.offset + 1),
                None => delivered.push((part, msg.offset + 1)),
            }
            stats.messages += 1;
        }
        for w in &mut work {
            w.delivered.clone_from(&delivered);
        }
        self.send(work);
        Ok(stats)
    }

    /// `Store::begin_partition` for each source partition of `messages` not begun yet in this
    /// process, at its first message's offset.
    fn begin_partitions(&self, source: &str, messages: &[Message]) -> Result<(), StoreError> {
        let mut seen: Vec<i32> = Vec::new();
        for msg in messages {
            if seen.contains(&msg.partition) {
                continue;
            }
            seen.push(msg.partition);
            let p = self.progress.get(self.progress.id(source, msg.partition));
            if p.begun.load(Acquire) {
                continue;
            }
            self.store
                .begin_partition(source, msg.partition, msg.offset)?;
            p.begin_at(msg.offset);
            p.begun.store(true, Release);
        }
        Ok(())
    }

    /// Waits until every event submitted before this call is applied.
    pub fn flush(&self) {
        self.broadcast(Msg::Barrier);
    }

    /// Applies everything submitted so far and commits every shard now. `true` if every
    /// commit succeeded.
    pub fn persist(&self) -> bool {
        let replies = self.broadcast(Msg::Persist);
        replies.len() == self.senders.len() && replies.into_iter().all(|ok| ok)
    }

    /// Sends every worker the message `make` builds around a reply channel, after everything
    /// queued before it, and waits for every reply (workers that are gone do not reply).
    fn broadcast<T>(&self, make: impl Fn(Sender<T>) -> Msg) -> Vec<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        let pending = self
            .senders
            .iter()
            .filter(|s| s.send(make(tx.clone())).is_ok())
            .count();
        drop(tx);
        rx.iter().take(pending).collect()
    }

    /// Drops `engine` from the index on an operator's word (`DELETE /v1/engines/{id}`), as an
    /// `ALL_CLEARED` of every (tenant, model) it stored into, through its shards, committed
    /// before this returns: the memberships removed, or `None` if no shard knows it. The
    /// engine comes back with its next event.
    pub fn forget_engine(&self, engine: &str) -> Option<u64> {
        let replies = self.broadcast(|ack| Msg::ForgetEngine(engine.to_string(), ack));
        let removed = replies.into_iter().flatten().reduce(|a, b| a + b);
        self.persist();
        removed
    }

    /// Abandons the checkpoint of (source, partition): everything applied is committed, every
    /// shard forgets its floor, and the stored rows are deleted, so the partition's next batch
    /// starts it afresh (`reset_on_divergence`: the log it resumes from has other offsets).
    pub fn forget_partition(&self, source: &str, partition: i32) -> Result<(), StoreError> {
        let id = self.progress.id(source, partition);
        self.persist();
        self.broadcast(|ack| Msg::Forget(id, ack));
        self.store.forget_partition(source, partition)?;
        self.progress.get(id).begun.store(false, Release);
        Ok(())
    }
}

/// Sources position their partitions from the store's durable offsets, and have everything
/// applied persisted before they release a partition.
impl Checkpoints for Pipeline {
    /// A stored offset that cannot be read is retried (backing off up to 5 s) until it can:
    /// positioning from the configured start instead could skip events for good (`latest`)
    /// or re-apply them. The source's assignment waits meanwhile. Only a closing pipeline
    /// gives up (it applies nothing more).
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64> {
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            match self.store.next_offset(source, partition) {
                Ok(o) => return o,
                Err(e) if self.closing.load(Relaxed) => {
                    tracing::warn!(source, partition, error = %e, "cannot read the stored offset while closing");
                    return None;
                }
                Err(e) => {
                    tracing::error!(source, partition, error = %e, retry_in_ms = pause.as_millis() as u64, "cannot read the stored offset; the partition waits until it can");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_secs(5));
                }
            }
        }
    }

    fn persist_now(&self) {
        if !self.persist() {
            tracing::warn!(
                "persisting before a partition is released failed; the next owner re-reads from the last durable offset"
            );
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.senders.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
