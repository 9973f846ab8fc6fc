//! One shard's worker thread: applies its share of every batch in source order under the
//! shard's write lock, skips offsets it has applied already, commits its changes with the
//! offsets they cover, and runs its shard's spill duty between batches.
//!
//! After a restart the worker first finishes loading its shard (`warm_up.rs`), then applies.
//!
//! A worker is the only writer of its shard: of its tables (events, restores, evictions) and
//! of its rows in the store (checkpoint commits and write-back batches). That is what lets a
//! commit take the change set between two events and write it without the lock, and a restore
//! read L2 under the read lock only.

use super::progress::{NONE, PartId, Progress};
use super::spill::ShardSpill;
use super::warm_up::ShardWarmUp;
use super::{Msg, ShardWork};
use crate::event::{Event, EventKind};
use crate::index::{Index, Shard, SkipReason};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::util::{LogEvery, now_us};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Failed commits are logged at most this often per shard.
const COMMIT_WARN_EVERY: Duration = Duration::from_secs(10);

/// When a shard commits: every `interval`, or after `max_events` applied events.
#[derive(Clone, Copy, Debug)]
pub struct CommitSettings {
    pub interval: Duration,
    pub max_events: u64,
    /// Budget of decoded events queued for the workers, in bytes.
    pub max_inflight_bytes: u64,
}

impl Default for CommitSettings {
    fn default() -> Self {
        CommitSettings::from(&crate::config::CheckpointConfig::default())
    }
}

impl From<&crate::config::CheckpointConfig> for CommitSettings {
    fn from(c: &crate::config::CheckpointConfig) -> Self {
        CommitSettings {
            interval: Duration::from_millis(c.interval_ms),
            max_events: c.max_events,
            max_inflight_bytes: super::DEFAULT_INFLIGHT_BYTES,
        }
    }
}

/// The `kvindex_events_applied_total` slot of an event kind.
fn kind_slot(kind: EventKind) -> Option<usize> {
    match kind {
        EventKind::Stored => Some(0),
        EventKind::Removed => Some(1),
        EventKind::AllCleared | EventKind::AdapterCleared => Some(2),
        EventKind::ReplicaUpdated => Some(3),
        EventKind::Unknown(_) => None,
    }
}

/// What a worker shares with the pipeline that spawned it.
pub(super) struct WorkerContext {
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub store: Arc<Store>,
    pub progress: Arc<Progress>,
    pub commits: CommitSettings,
    /// The pipeline's [`close`](super::Pipeline::close) flag.
    pub closing: Arc<AtomicBool>,
    pub liveness: Liveness,
    /// The in-flight budget each applied batch gives its bytes back to.
    pub inflight: Arc<super::inflight::Inflight>,
}

/// When silent engines are forgotten (`index.engine_ttl_s`).
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// An engine no event has reached for this long is cleared (`None`: never).
    pub ttl: Option<Duration>,
    /// The service's readiness (sources caught up): before it, a backlog being replayed is
    /// not silence, so nothing expires.
    pub ready: Arc<AtomicBool>,
}

/// One shard's worker: applies its share of every batch, skips duplicates, commits.
pub(super) struct Worker {
    shard: usize,
    ctx: WorkerContext,
    /// Next offset applied, by [`PartId`] ([`NONE`]: nothing).
    floors: Vec<i64>,
    /// Partitions whose floor changed since the last commit.
    dirty: Vec<PartId>,
    applied_since_commit: u64,
    next_commit: Instant,
    commit_warnings: LogEvery,
    /// The shard's bounded-L1 duty.
    spill: ShardSpill,
    /// When this worker started (engines loaded from disk count as heard then).
    /// Since when (kvindex clock) the sources have been caught up without a break: silence
    /// counts from here at the earliest, so a backlog, however long, is never silence.
    caught_up_since_us: Option<i64>,
    next_sweep: Instant,
    /// Pauses between retries of an event whose L2 read failed.
    read_backoff: crate::util::Backoff,
    /// Set when shutdown came while an event was held: later work is not applied, so no
    /// offset moves past it.
    abandoned: bool,
    /// The rest of the shard's load after a restart, run before anything else.
    warm_up: Option<ShardWarmUp>,
}

impl Worker {
    pub(super) fn new(
        shard: usize,
        ctx: WorkerContext,
        spill: ShardSpill,
        warm_up: Option<ShardWarmUp>,
    ) -> Worker {
        let mut w = Worker {
            shard,
            next_commit: Instant::now() + ctx.commits.interval,
            ctx,
            floors: Vec::new(),
            dirty: Vec::new(),
            applied_since_commit: 0,
            commit_warnings: LogEvery::new(COMMIT_WARN_EVERY),
            spill,
            caught_up_since_us: None,
            next_sweep: Instant::now(),
            read_backoff: crate::util::Backoff::new(
                Duration::from_millis(50),
                Duration::from_secs(5),
            ),
            abandoned: false,
            warm_up,
        };
        // Floors restored from the store (Progress::restore) before the workers started.
        for id in 0..w.ctx.progress.len() as PartId {
            let next = w.ctx.progress.get(id).applied_at(shard);
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
    /// Not once the pipeline is closing (see [`super::Pipeline::close`]).
    fn hold_while_full(&mut self) {
        while !self.ctx.closing.load(Relaxed) && self.spill.must_pause() {
            if Instant::now() >= self.next_commit {
                self.commit();
            }
            self.maintain_spill();
            if self.spill.must_pause() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub(super) fn run(&mut self, rx: Receiver<Msg>) {
        if let Some(warm_up) = self.warm_up.take() {
            let index = self.ctx.index.clone();
            let lock = index.shard(self.shard);
            if !warm_up.run(&self.ctx.store, self.shard, lock, &self.ctx.closing) {
                self.refuse_all(rx);
                return;
            }
        }
        loop {
            self.hold_while_full();
            let wait = self.next_commit.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Msg::Work(w)) => self.apply(w),
                Ok(Msg::Barrier(ack)) => {
                    let _ = ack.send(());
                }
                Ok(Msg::Persist(ack)) => {
                    let ok = self.commit();
                    let _ = ack.send(ok);
                }
                Ok(Msg::ForgetEngine(engine, ack)) => {
                    let _ = ack.send(self.forget_engine(&engine));
                }
                Ok(Msg::Forget(part, ack)) => {
                    *self.floor_mut(part) = NONE;
                    self.dirty.retain(|&p| p != part);
                    let p = self.ctx.progress.get(part);
                    p.set_applied(self.shard, NONE);
                    p.set_durable(self.shard, NONE);
                    let _ = ack.send(());
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.expire_silent_engines();
            if Instant::now() >= self.next_commit
                || self.applied_since_commit >= self.ctx.commits.max_events
            {
                self.commit();
            }
            self.maintain_spill();
        }
        // Shutdown: make what was applied durable.
        self.commit();
    }

    /// After a warm-up that did not finish (a failed read, or shutdown during it) the shard's
    /// counters are partial, so nothing may change it or its rows: work is dropped unapplied
    /// (no offset advances, so a restart delivers it again) and control messages answered.
    fn refuse_all(&mut self, rx: Receiver<Msg>) {
        for msg in rx {
            match msg {
                Msg::Work(w) => self.ctx.inflight.release(w.bytes),
                Msg::Barrier(ack) | Msg::Forget(_, ack) => {
                    let _ = ack.send(());
                }
                // Nothing was applied, so nothing applied is lost.
                Msg::Persist(ack) => {
                    let _ = ack.send(true);
                }
                Msg::ForgetEngine(_, ack) => {
                    let _ = ack.send(None);
                }
            }
        }
    }

    fn apply(&mut self, work: ShardWork) {
        let bytes = work.bytes;
        self.apply_work(work);
        self.ctx.inflight.release(bytes);
    }

    fn apply_work(&mut self, work: ShardWork) {
        if self.abandoned {
            return;
        }
        let now = now_us();
        let index = self.ctx.index.clone();
        let mut guard = index.shard(self.shard).write();
        let mut start = 0;
        for span in &work.spans {
            let events = &work.events[start..span.end];
            start = span.end;
            let p = self.ctx.progress.get(span.part);
            let previous = *self.floor_mut(span.part);
            if span.offset < previous {
                let n = events.len() as u64;
                p.duplicates.fetch_add(n, Relaxed);
                self.ctx.metrics.count_duplicates(n);
                continue;
            }
            *self.floor_mut(span.part) = span.offset + 1;
            for ev in events {
                // An L2 read the event needs failed: hold this shard (retrying) rather than
                // skip the event. No commit runs meanwhile (this thread makes them), so no
                // offset moves past it.
                loop {
                    match guard.apply(ev, now) {
                        Err(SkipReason::L2ReadFailed(error)) => {
                            drop(guard);
                            if !self.hold_for_l2_read(&error) {
                                // Shutting down mid-message: nothing of it, or after it, counts
                                // as applied; a restart applies it again.
                                *self.floor_mut(span.part) = previous;
                                self.abandoned = true;
                                return;
                            }
                            guard = index.shard(self.shard).write();
                        }
                        result => {
                            self.count_applied(ev, result);
                            break;
                        }
                    }
                }
            }
            self.read_backoff.reset();
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
            self.ctx.progress.get(part).set_applied(self.shard, value);
        }
    }

    /// Clears every engine of the shard that no event has reached for `index.engine_ttl_s`
    /// (kvindex's clock) since the sources last caught up. The clears go through the shard
    /// like any `ALL_CLEARED` and are durable with the next commit.
    fn expire_silent_engines(&mut self) {
        let Some(ttl) = self.ctx.liveness.ttl else {
            return;
        };
        if !self.ctx.liveness.ready.load(Relaxed) {
            self.caught_up_since_us = None;
            return;
        }
        let caught_up_since = *self.caught_up_since_us.get_or_insert_with(now_us);
        if Instant::now() < self.next_sweep {
            return;
        }
        self.next_sweep =
            Instant::now() + (ttl / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let cutoff = now_us().saturating_sub(i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX));
        let silent = self
            .ctx
            .index
            .shard(self.shard)
            .read()
            .silent_engines(cutoff, caught_up_since);
        for engine in silent {
            let removed = self.forget_engine(&engine).unwrap_or(0);
            self.ctx.metrics.count_engine_expired();
            tracing::info!(shard = self.shard, engine = %engine, memberships = removed, ttl_s = ttl.as_secs(), "engine silent past index.engine_ttl_s: cleared");
        }
    }

    /// Drops `engine` from this shard (an `ALL_CLEARED` per (tenant, model) it stored into):
    /// the memberships removed, or `None` if the shard does not know it.
    fn forget_engine(&mut self, engine: &str) -> Option<u64> {
        let index = self.ctx.index.clone();
        let mut guard = index.shard(self.shard).write();
        if !guard.knows_engine(engine) {
            return None;
        }
        let now = now_us();
        let events = guard.forget_events(engine);
        let mut removed = 0;
        for ev in &events {
            removed += self.apply_one(&mut guard, ev, now) as u64;
        }
        guard.retire_engine(engine);
        self.applied_since_commit += events.len() as u64;
        Some(removed)
    }

    /// Waits before retrying an event whose L2 read failed (backing off up to 5 s), unless
    /// the pipeline is closing: `false` then.
    fn hold_for_l2_read(&mut self, error: &str) -> bool {
        if self.ctx.closing.load(Relaxed) {
            return false;
        }
        self.ctx.metrics.count_l2_read_hold();
        if self.commit_warnings.ready() {
            tracing::error!(
                shard = self.shard,
                error,
                "an L2 read an event needs failed; holding this shard's events until it succeeds (nothing is skipped)"
            );
        }
        std::thread::sleep(self.read_backoff.next_delay());
        !self.ctx.closing.load(Relaxed)
    }

    /// Applies one event, counting it; returns the memberships it changed (0 if skipped).
    fn apply_one(&self, shard: &mut Shard, ev: &Event, now: i64) -> usize {
        let result = shard.apply(ev, now);
        self.count_applied(ev, result)
    }

    /// Counts an applied (or skipped) event; returns the memberships it changed.
    fn count_applied(&self, ev: &Event, result: Result<usize, SkipReason>) -> usize {
        match result {
            Ok(ops) => {
                if let Some(slot) = kind_slot(ev.kind) {
                    self.ctx.metrics.count_applied(slot, ops);
                }
                ops
            }
            Err(reason) => {
                self.ctx.metrics.count_skipped(reason.reason());
                tracing::warn!(shard = self.shard, engine = %ev.engine, model = %ev.partition.model, adapter = %ev.partition.adapter, reason = reason.reason(), error = %reason, "event not applied");
                0
            }
        }
    }

    /// The spill's maintenance, committing first whenever it has work: what it then writes
    /// back or drops is clean, so L2 holds only committed values and after any crash a
    /// shard's rows are exactly its state at its stored offsets. If that commit fails (L2
    /// down), nothing is evicted: L1 grows to its hard cap and the worker pauses.
    fn maintain_spill(&mut self) {
        if !self.spill.has_work() {
            return;
        }
        if self.commit() {
            self.spill.maintain();
        }
    }

    /// Commits the shard's changes and dirty floors in one batch, through the L2 circuit
    /// breaker (the commit is L2's main writer). `true` on success or when there was nothing
    /// to commit. A commit that fails, or that the open breaker refuses, hands its changes back
    /// to the shard: the next one carries them.
    fn commit(&mut self) -> bool {
        self.next_commit = Instant::now() + self.ctx.commits.interval;
        self.applied_since_commit = 0;
        let lock = self.ctx.index.shard(self.shard);
        let changes = {
            let mut shard = lock.write();
            if !shard.has_changes() && self.dirty.is_empty() {
                return true;
            }
            shard.take_changes()
        };
        let parts: Vec<_> = self
            .dirty
            .iter()
            .map(|&id| (id, self.ctx.progress.get(id)))
            .collect();
        let offsets: Vec<(String, i32, i64)> = parts
            .iter()
            .map(|(id, p)| (p.source.to_string(), p.partition, self.floors[*id as usize]))
            .filter(|o| o.2 != NONE)
            .collect();
        let started = Instant::now();
        let Ok(permit) = self.spill.breaker().try_acquire() else {
            lock.write().requeue_changes(&changes);
            self.spill.count_commit(false, true);
            return false;
        };
        let written = self.ctx.store.commit(self.shard as u16, &changes, &offsets);
        match written {
            Ok(()) => {
                crate::util::crash_point("commit.written");
                permit.succeeded();
                let mut shard = lock.write();
                self.ctx.store.after_commit(&mut shard, &changes);
                drop(shard);
                for (id, p) in &parts {
                    p.set_durable(self.shard, self.floors[*id as usize]);
                }
                self.dirty.clear();
                self.ctx.metrics.observe_commit(started.elapsed());
                true
            }
            Err(e) => {
                if e.is_transient() {
                    permit.timed_out();
                } else {
                    permit.failed();
                }
                self.spill.count_commit(true, false);
                lock.write().requeue_changes(&changes);
                self.ctx.metrics.count_commit_failure();
                if self.commit_warnings.ready() {
                    tracing::error!(shard = self.shard, error = %e, "commit to the store failed; retrying (nothing is acknowledged upstream until it succeeds)");
                }
                false
            }
        }
    }
}
