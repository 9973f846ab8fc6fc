//! The apply pipeline: routes decoded events to per-shard worker threads, which apply them in
//! source order under their shard's write lock, skip what they have already applied, and
//! commit their changes together with the source offsets they cover.
//!
//! Workers are plain threads (index work is CPU-bound Rust on owned data, no `.await`); the
//! bounded queues give backpressure: a producer that outruns the index blocks in `submit`
//! instead of growing memory without bound. The `Pipeline` owns its workers and stops them
//! on drop (each makes a last commit first).
//!
//! # Offsets and duplicates
//! [`Pipeline::ingest_batch`] tags the events of every source message with the message's
//! (source partition, offset). Each worker keeps a *floor* per source partition: the next
//! offset it has applied. A message below the floor was applied before (a redelivery, a
//! re-read after a restart or a rebalance) and its events are skipped and counted as
//! duplicates. Every shard is told the offsets of every batch, also when none of its events
//! were in it, so its floor (and its durable row) keeps up; see `store/mod.rs` for why.
//!
//! # Commits
//! With a [`Store`], each worker commits its shard's [`ChangeSet`](crate::index::ChangeSet)
//! and its floors in one `WriteBatch` every `interval` or `max_events` applied events,
//! whichever comes first, and on [`Pipeline::persist`]. The change set is taken under the
//! shard's write lock (between two events, so rows and offsets agree); the RocksDB write runs
//! outside it, so lookups never wait on I/O. A failed commit puts the changes back and is
//! retried at the next tick; nothing is acknowledged upstream until it succeeds.
//!
//! # Bounded L1
//! With a [`Tiering`] ([`Pipeline::start_tiered`], what the service uses), each worker also
//! runs its shard's write-back after every batch and commit (`writeback/live.rs`): commits pass
//! the L2 circuit breaker, and while the shard's L1 is at its hard cap the worker takes no
//! work, so its queue fills and `submit` / `ingest_batch` block: the sources pause.

use crate::checkpoint::{NONE, PartId, Progress};
use crate::event::{DecodeOptions, Decoded, Envelope, Event, EventKind, decode_payload};
use crate::index::{Index, SkipReason};
use crate::metrics::Metrics;
use crate::source::{Checkpoints, Message};
use crate::store::{Store, StoreError};
use crate::writeback::{ShardWriteback, Tiering};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Batches waiting per shard before `submit` blocks.
const QUEUE_BATCHES: usize = 64;
/// Failed commits are logged at most this often per shard.
const COMMIT_WARN_EVERY: Duration = Duration::from_secs(10);

/// When a shard commits: every `interval`, or after `max_events` applied events.
#[derive(Clone, Copy, Debug)]
pub struct CommitPolicy {
    pub interval: Duration,
    pub max_events: u64,
}

impl Default for CommitPolicy {
    fn default() -> Self {
        CommitPolicy {
            interval: Duration::from_millis(100),
            max_events: 10_000,
        }
    }
}

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
    /// Empty for events without source positions ([`Pipeline::submit`]).
    spans: Vec<Span>,
    /// (partition, next offset) of every source partition in the batch, for every shard.
    delivered: Vec<(PartId, i64)>,
}

enum Msg {
    Work(ShardWork),
    /// Acknowledged once everything sent before it is applied.
    Barrier(Sender<()>),
    /// Commit now; acknowledged with whether the commit succeeded.
    Persist(Sender<bool>),
    /// Forget a source partition's floor (its checkpoint was abandoned).
    Forget(PartId, Sender<()>),
}

/// Where a payload came from, for logs of what could not be decoded.
#[derive(Clone, Debug, Default)]
pub struct Position<'a> {
    pub source: &'a str,
    pub partition: i64,
    pub offset: i64,
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
    store: Option<Arc<Store>>,
    progress: Arc<Progress>,
    senders: Vec<SyncSender<Msg>>,
    workers: Vec<JoinHandle<()>>,
    /// Set by [`Pipeline::close`]: the workers stop holding events back at L1's hard cap.
    closing: Arc<AtomicBool>,
}

pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn kind_slot(kind: EventKind) -> Option<usize> {
    match kind {
        EventKind::Stored => Some(0),
        EventKind::Removed => Some(1),
        EventKind::AllCleared => Some(2),
        EventKind::ReplicaUpdated => Some(3),
        EventKind::Unknown(_) => None,
    }
}

impl Pipeline {
    /// Starts one worker thread per shard of `index`, keeping everything in memory only.
    pub fn start(index: Arc<Index>, metrics: Arc<Metrics>) -> Pipeline {
        let progress = Arc::new(Progress::new(index.shard_count()));
        Pipeline::spawn(
            index,
            metrics,
            None,
            progress,
            CommitPolicy::default(),
            None,
        )
    }

    /// Starts the workers of a durable index: `index` holds what `store` held at start (see
    /// [`crate::store::Store::load_shard`]) with change tracking on, and `progress` the
    /// offsets the store holds ([`Progress::restore`]).
    pub fn start_durable(
        index: Arc<Index>,
        metrics: Arc<Metrics>,
        store: Arc<Store>,
        progress: Arc<Progress>,
        policy: CommitPolicy,
    ) -> Pipeline {
        Pipeline::spawn(index, metrics, Some(store), progress, policy, None)
    }

    /// [`Pipeline::start_durable`] with a bounded L1: every shard's worker also runs its
    /// write-back (see `writeback/live.rs`); the shards must have been attached to `tiering`.
    pub fn start_tiered(
        index: Arc<Index>,
        metrics: Arc<Metrics>,
        store: Arc<Store>,
        progress: Arc<Progress>,
        policy: CommitPolicy,
        tiering: &Tiering,
    ) -> Pipeline {
        Pipeline::spawn(index, metrics, Some(store), progress, policy, Some(tiering))
    }

    fn spawn(
        index: Arc<Index>,
        metrics: Arc<Metrics>,
        store: Option<Arc<Store>>,
        progress: Arc<Progress>,
        policy: CommitPolicy,
        tiering: Option<&Tiering>,
    ) -> Pipeline {
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        let closing = Arc::new(AtomicBool::new(false));
        for shard in 0..index.shard_count() {
            let (tx, rx) = sync_channel(QUEUE_BATCHES);
            let mut worker = Worker::new(
                shard,
                index.clone(),
                metrics.clone(),
                store.clone(),
                progress.clone(),
                policy,
            );
            worker.writeback = tiering.map(|t| t.for_shard(shard));
            worker.closing = closing.clone();
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
        }
    }

    /// Shutdown has begun. From now on the workers no longer hold events back while L1 is at
    /// its hard cap: with L2 down that hold would last as long as the outage, and the sources
    /// (stopping after a last batch and persist) with it, so the process would never exit.
    /// What is queued is applied over the cap instead; commits still go through the breaker,
    /// so offsets only advance over what is durable, and a restart replays the rest.
    pub fn close(&self) {
        self.closing.store(true, Relaxed);
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
        for (tx, w) in self.senders.iter().zip(work) {
            if !w.events.is_empty() || !w.delivered.is_empty() {
                // A send fails only if the worker died, which it does only on shutdown.
                let _ = tx.send(Msg::Work(w));
            }
        }
    }

    /// Routes `events` (in source order, without source positions) to their shards. Blocks
    /// while a shard's queue is full.
    pub fn submit(&self, events: Vec<Event>) {
        let mut work: Vec<ShardWork> = (0..self.senders.len())
            .map(|_| ShardWork::default())
            .collect();
        for ev in events {
            if self.skip_unknown(&ev) {
                continue;
            }
            self.index.learn_block_size(&ev);
            work[self.index.route(&ev)].events.push(ev);
        }
        self.send(work);
    }

    /// Decodes one payload; bad input is counted and logged with its position, never fatal.
    fn decode(
        &self,
        payload: &[u8],
        env: &Envelope<'_>,
        opts: &DecodeOptions,
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

    /// Decodes one payload and submits its events (no source position: nothing is skipped
    /// as a duplicate). Returns how many events were submitted.
    pub fn ingest(
        &self,
        payload: &[u8],
        env: &Envelope<'_>,
        opts: &DecodeOptions,
        pos: &Position<'_>,
    ) -> usize {
        let events = self.decode(payload, env, opts, pos);
        let n = events.len();
        self.submit(events);
        n
    }

    /// Decodes a batch of messages of `source` and routes their events with their positions.
    /// Before the first batch of a source partition in this process its shard rows are begun
    /// in the store; if that fails nothing is routed and the error is returned (retry the
    /// same batch).
    pub fn ingest_batch(
        &self,
        source: &str,
        messages: &[Message],
        opts: &DecodeOptions,
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
                self.index.learn_block_size(&ev);
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
        let Some(store) = &self.store else {
            return Ok(());
        };
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
            store.begin_partition(source, msg.partition, msg.offset)?;
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
    /// commit succeeded (always, without a store).
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

    /// Abandons the checkpoint of (source, partition): everything applied is committed, every
    /// shard forgets its floor, and the stored rows are deleted, so the partition's next batch
    /// starts it afresh (`reset_on_divergence`: the log it resumes from has other offsets).
    pub fn forget_partition(&self, source: &str, partition: i32) -> Result<(), StoreError> {
        let id = self.progress.id(source, partition);
        self.persist();
        self.broadcast(|ack| Msg::Forget(id, ack));
        if let Some(store) = &self.store {
            store.forget_partition(source, partition)?;
        }
        self.progress.get(id).begun.store(false, Release);
        Ok(())
    }
}

/// Sources position their partitions from the store's durable offsets, and have everything
/// applied persisted before they release a partition.
impl Checkpoints for Pipeline {
    fn next_offset(&self, source: &str, partition: i32) -> Option<i64> {
        let store = self.store.as_ref()?;
        match store.next_offset(source, partition) {
            Ok(o) => o,
            Err(e) => {
                // Positioning from the configured start could re-apply or skip events; a
                // store that cannot be read is reported and treated as "no checkpoint" only
                // by the source's own divergence checks, so log loudly.
                tracing::error!(source, partition, error = %e, "cannot read the stored offset");
                None
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

/// One shard's worker: applies its share of every batch, skips duplicates, commits.
struct Worker {
    shard: usize,
    index: Arc<Index>,
    metrics: Arc<Metrics>,
    store: Option<Arc<Store>>,
    progress: Arc<Progress>,
    policy: CommitPolicy,
    /// Next offset applied, by [`PartId`] ([`NONE`]: nothing).
    floors: Vec<i64>,
    /// Partitions whose floor changed since the last commit.
    dirty: Vec<PartId>,
    applied_since_commit: u64,
    next_commit: Instant,
    last_warn: Option<Instant>,
    /// The shard's bounded-L1 duty (`None`: L1 holds everything).
    writeback: Option<ShardWriteback>,
    /// The pipeline's [`Pipeline::close`] flag.
    closing: Arc<AtomicBool>,
}

impl Worker {
    fn new(
        shard: usize,
        index: Arc<Index>,
        metrics: Arc<Metrics>,
        store: Option<Arc<Store>>,
        progress: Arc<Progress>,
        policy: CommitPolicy,
    ) -> Worker {
        let mut w = Worker {
            shard,
            index,
            metrics,
            store,
            progress,
            policy,
            floors: Vec::new(),
            dirty: Vec::new(),
            applied_since_commit: 0,
            next_commit: Instant::now() + policy.interval,
            last_warn: None,
            writeback: None,
            closing: Arc::default(),
        };
        // Floors restored from the store (Progress::restore) before the workers started.
        for id in 0..w.progress.len() as PartId {
            let next = w.progress.get(id).applied_at(shard);
            if next != NONE {
                *w.floor_mut(id) = next;
            }
        }
        w
    }

    fn floor_mut(&mut self, part: PartId) -> &mut i64 {
        let i = part as usize;
        if self.floors.len() <= i {
            self.floors.resize(i + 1, NONE);
        }
        &mut self.floors[i]
    }

    fn mark_dirty(&mut self, part: PartId) {
        if !self.dirty.contains(&part) {
            self.dirty.push(part);
        }
    }

    /// While L1 is at its hard cap (the breaker keeps write-back from freeing it), take no
    /// events: the queue fills and the sources stop pulling. Commits and write-back retry.
    /// Not once the pipeline is closing (see [`Pipeline::close`]).
    fn hold_while_full(&mut self) {
        while !self.closing.load(Relaxed) && self.writeback.as_ref().is_some_and(|w| w.must_pause())
        {
            if Instant::now() >= self.next_commit {
                self.commit();
            }
            if let Some(w) = self.writeback.as_mut() {
                w.maintain();
                if w.must_pause() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    fn run(&mut self, rx: Receiver<Msg>) {
        loop {
            self.hold_while_full();
            let msg = if self.store.is_some() {
                let wait = self.next_commit.saturating_duration_since(Instant::now());
                match rx.recv_timeout(wait) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else {
                match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => break,
                }
            };
            match msg {
                Some(Msg::Work(w)) => self.apply(w),
                Some(Msg::Barrier(ack)) => {
                    let _ = ack.send(());
                }
                Some(Msg::Persist(ack)) => {
                    let ok = self.commit();
                    let _ = ack.send(ok);
                }
                Some(Msg::Forget(part, ack)) => {
                    *self.floor_mut(part) = NONE;
                    self.dirty.retain(|&p| p != part);
                    let p = self.progress.get(part);
                    p.set_applied(self.shard, NONE);
                    p.set_durable(self.shard, NONE);
                    let _ = ack.send(());
                }
                None => {}
            }
            if self.store.is_some()
                && (Instant::now() >= self.next_commit
                    || self.applied_since_commit >= self.policy.max_events)
            {
                self.commit();
            }
            if let Some(w) = self.writeback.as_mut() {
                w.maintain();
            }
        }
        // Shutdown: make what was applied durable.
        self.commit();
    }

    fn apply(&mut self, work: ShardWork) {
        let now = now_us();
        let index = self.index.clone();
        let mut guard = index.shard(self.shard).write();
        if work.spans.is_empty() {
            for ev in &work.events {
                self.apply_one(&mut guard, ev, now);
            }
        }
        let mut start = 0;
        for span in &work.spans {
            let events = &work.events[start..span.end];
            start = span.end;
            let p = self.progress.get(span.part);
            let floor = self.floor_mut(span.part);
            if span.offset < *floor {
                let n = events.len() as u64;
                p.duplicates.fetch_add(n, Relaxed);
                self.metrics.count_duplicates(n);
                continue;
            }
            *floor = span.offset + 1;
            for ev in events {
                self.apply_one(&mut guard, ev, now);
            }
            p.events_applied.fetch_add(events.len() as u64, Relaxed);
            self.applied_since_commit += events.len() as u64;
        }
        drop(guard);
        for &(part, next) in &work.delivered {
            let floor = self.floor_mut(part);
            if next > *floor {
                *floor = next;
            }
            let value = *floor;
            self.mark_dirty(part);
            self.progress.get(part).set_applied(self.shard, value);
        }
    }

    fn apply_one(&self, shard: &mut crate::index::Shard, ev: &Event, now: i64) {
        match shard.apply(ev, now) {
            Ok(ops) => {
                if let Some(slot) = kind_slot(ev.kind) {
                    self.metrics.count_applied(slot, ops);
                }
            }
            Err(reason) => {
                self.metrics.count_skipped(reason.reason());
                tracing::warn!(shard = self.shard, engine = %ev.engine, model = %ev.partition.model, adapter = %ev.partition.adapter, reason = reason.reason(), error = %reason, "event not applied");
            }
        }
    }

    /// After a commit: the durable ids of engines and partitions that just got them, so the
    /// shard can read and write their L2 rows.
    fn learn_durable_ids(&self, store: &Store, changes: &crate::index::ChangeSet) {
        let mut shard = self.index.shard(self.shard).write();
        let known = shard.durable_ids_known();
        if known == (shard.engines().len(), shard.partitions().len()) {
            return;
        }
        let (engines, partitions) = store.durable_ids(&changes.engine_names, &changes.partitions);
        for (local, durable) in engines {
            shard.learn_durable_engine(local, durable);
        }
        for (local, durable) in partitions {
            shard.learn_durable_partition(local, durable);
        }
    }

    /// Commits the shard's changes and dirty floors in one batch. `true` on success or when
    /// there was nothing to commit.
    fn commit(&mut self) -> bool {
        self.next_commit = Instant::now() + self.policy.interval;
        self.applied_since_commit = 0;
        let Some(store) = self.store.clone() else {
            return true;
        };
        let changes = {
            let mut shard = self.index.shard(self.shard).write();
            if !shard.has_changes() && self.dirty.is_empty() {
                return true;
            }
            shard.take_changes()
        };
        let parts: Vec<_> = self
            .dirty
            .iter()
            .map(|&id| (id, self.progress.get(id)))
            .collect();
        let offsets: Vec<(String, i32, i64)> = parts
            .iter()
            .map(|(id, p)| (p.source.to_string(), p.partition, self.floors[*id as usize]))
            .filter(|o| o.2 != NONE)
            .collect();
        let started = Instant::now();
        // With write-back, the commit (L2's main writer) goes through the breaker too.
        let permit = match self.writeback.as_ref().map(|w| w.breaker().try_acquire()) {
            Some(Err(_)) => {
                self.index
                    .shard(self.shard)
                    .write()
                    .requeue_changes(&changes);
                if let Some(w) = &self.writeback {
                    w.count_commit(false, true);
                }
                return false;
            }
            Some(Ok(p)) => Some(p),
            None => None,
        };
        let injected = self
            .writeback
            .as_ref()
            .and_then(|w| w.injected_commit_fault());
        let written = match injected {
            Some(e) => Err(e),
            None => store.commit(self.shard as u16, &changes, &offsets),
        };
        if let Some(p) = permit {
            if written.is_ok() {
                p.succeeded();
            } else {
                p.failed();
            }
        }
        if let (Some(w), Err(_)) = (&self.writeback, &written) {
            w.count_commit(true, false);
        }
        match written {
            Ok(()) => {
                if self.writeback.is_some() {
                    self.learn_durable_ids(&store, &changes);
                }
                for (id, p) in &parts {
                    p.set_durable(self.shard, self.floors[*id as usize]);
                }
                self.dirty.clear();
                self.metrics.observe_commit(started.elapsed());
                true
            }
            Err(e) => {
                self.index
                    .shard(self.shard)
                    .write()
                    .requeue_changes(&changes);
                self.metrics.count_commit_failure();
                if self
                    .last_warn
                    .is_none_or(|t| t.elapsed() >= COMMIT_WARN_EVERY)
                {
                    self.last_warn = Some(Instant::now());
                    tracing::error!(shard = self.shard, error = %e, "commit to the store failed; retrying (nothing is acknowledged upstream until it succeeds)");
                }
                false
            }
        }
    }
}
