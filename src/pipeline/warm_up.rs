//! Warming L1 after a restart, while the service already answers.
//!
//! A restart opens the store and restores every shard's partitions and engines (a few rows),
//! attaching L2 behind each shard as *spilled*: from then on a lookup reads from L2 whatever
//! L1 lacks, so the first answer does not wait for the index to load, whatever its size. Each
//! shard's worker then loads the shard's map and block rows ([`Store::finish_load`]) in chunks
//! under the write lock, before it applies any event: while it loads, L2 holds exactly what
//! L1 will, so an answer during the warm-up equals one after it. When the load is done the
//! worker turns change tracking on, and the shard stays spilled only if its L1 budget left
//! rows in L2.
//!
//! [`WarmUp`] is the shared status of all shards: `/v1/stats` (`warm_up`), `/readyz` (not
//! ready before every shard is warm; counters of a shard still loading are partial) and
//! [`crate::service::Service::wait_warm`].

use crate::index::Shard;
use crate::store::{LoadStats, ShardLoad, Store};
use parking_lot::{Condvar, Mutex, RwLock};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A shard's warm-up failed (its rows could not be read back): the service cannot apply
/// events to it, and stops.
#[derive(Clone, Debug, thiserror::Error)]
#[error("warming shard {shard} from the store failed: {error}")]
pub struct WarmUpFailed {
    pub shard: usize,
    pub error: String,
}

/// The warm-up of every shard (see the module docs).
#[derive(Debug)]
pub struct WarmUp {
    shards: usize,
    started: Instant,
    /// Every shard is warm (the fast path of [`WarmUp::is_done`]).
    done: AtomicBool,
    /// Rows (map entries and blocks) read back so far, over all shards.
    rows: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    warm: usize,
    totals: LoadStats,
    took: Option<Duration>,
    failure: Option<WarmUpFailed>,
}

/// What `/v1/stats` reports of the warm-up.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WarmUpReport {
    /// Every shard's rows are loaded: counters are exact, and readiness may follow.
    pub done: bool,
    pub shards: usize,
    pub shards_warm: usize,
    /// Engine-map and block rows read back so far.
    pub rows_loaded: u64,
    /// Milliseconds since the warm-up began, or that it took once done.
    pub elapsed_ms: u64,
    /// Why a shard could not be warmed (the service stops).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl WarmUp {
    pub fn new(shards: usize) -> WarmUp {
        WarmUp {
            shards,
            started: Instant::now(),
            done: AtomicBool::new(shards == 0),
            rows: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    }

    /// A status with every shard warm (an index that was not loaded from a store).
    pub fn warm(shards: usize) -> WarmUp {
        let w = WarmUp::new(shards);
        w.state.lock().warm = shards;
        w.state.lock().took = Some(Duration::ZERO);
        w.done.store(true, Ordering::Release);
        w
    }

    /// Whether every shard is warm.
    #[inline]
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The first shard's failure, if one failed.
    pub fn failure(&self) -> Option<WarmUpFailed> {
        self.state.lock().failure.clone()
    }

    /// Blocks until every shard is warm (the totals of their loads) or one failed.
    pub fn wait(&self) -> Result<LoadStats, WarmUpFailed> {
        let mut s = self.state.lock();
        loop {
            if let Some(f) = &s.failure {
                return Err(f.clone());
            }
            if s.warm == self.shards {
                return Ok(s.totals.clone());
            }
            self.changed.wait(&mut s);
        }
    }

    pub fn report(&self) -> WarmUpReport {
        let s = self.state.lock();
        let elapsed = s.took.unwrap_or_else(|| self.started.elapsed());
        WarmUpReport {
            done: s.warm == self.shards,
            shards: self.shards,
            shards_warm: s.warm,
            rows_loaded: self.rows.load(Ordering::Relaxed),
            elapsed_ms: elapsed.as_millis() as u64,
            error: s.failure.as_ref().map(|f| f.to_string()),
        }
    }

    fn shard_warm(&self, shard: usize, stats: &LoadStats) {
        let mut s = self.state.lock();
        s.warm += 1;
        s.totals.add(stats);
        tracing::debug!(shard, blocks = stats.blocks, "shard warm");
        if s.warm == self.shards {
            let took = self.started.elapsed();
            s.took = Some(took);
            self.done.store(true, Ordering::Release);
            tracing::info!(
                blocks = s.totals.blocks,
                memberships = s.totals.memberships,
                map_entries = s.totals.map_entries,
                left_in_l2 = s.totals.left_in_l2,
                warm_ms = took.as_millis() as u64,
                "index warm: every shard's rows are back in L1 (up to its budget)"
            );
        }
        self.changed.notify_all();
    }

    fn shard_failed(&self, failure: WarmUpFailed) {
        tracing::error!(shard = failure.shard, error = %failure.error, "warming a shard from the store failed");
        let mut s = self.state.lock();
        s.failure.get_or_insert(failure);
        self.changed.notify_all();
    }
}

/// One shard's part of the warm-up, run by its worker before anything else.
pub(super) struct ShardWarmUp {
    pub load: ShardLoad,
    pub status: std::sync::Arc<WarmUp>,
}

impl ShardWarmUp {
    /// Loads the rest of shard `shard` into `lock`, then makes it an ordinary shard: change
    /// tracking on, spilled only if rows stayed in L2. False if the load failed or `stop` was
    /// set meanwhile: the shard must then not be changed (its counters are partial).
    pub(super) fn run(
        mut self,
        store: &Store,
        shard: usize,
        lock: &RwLock<Shard>,
        stop: &AtomicBool,
    ) -> bool {
        let mut counted = 0;
        let result = store.finish_load(&mut self.load, lock, |s| {
            crate::util::crash_point("warmup.chunk");
            let rows = s.map_entries + s.blocks;
            self.status
                .rows
                .fetch_add(rows - counted, Ordering::Relaxed);
            counted = rows;
            !stop.load(Ordering::Relaxed)
        });
        match result {
            Ok(stats) => {
                let mut guard = lock.write();
                guard.end_load(stats.left_in_l2 > 0);
                guard.enable_change_tracking();
                drop(guard);
                self.status.shard_warm(shard, &stats);
                true
            }
            Err(e) => {
                self.status.shard_failed(WarmUpFailed {
                    shard,
                    error: e.to_string(),
                });
                false
            }
        }
    }
}
