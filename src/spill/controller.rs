//! The spill controller: keeps a shard's L1 within its byte budget by writing cold entries
//! back to L2 and dropping them only once durable; copies dirty entries to L2 periodically; and
//! makes room for restores in an emergency. It owns the rules, not the data: L1 is reached
//! through [`SpillL1`], L2 through [`L2Sink`], and every L2 write passes the
//! [`CircuitBreaker`].
//!
//! # The one invariant
//! An entry leaves L1 only after a write containing its current value has *succeeded*. The
//! order is always: snapshot a batch (key, version, row) → write it with no lock held → remove
//! each entry whose version is unchanged. So a failed, partial or timed-out batch removes
//! nothing, and an entry changed during the flight stays (its new value is not in L2). At
//! every instant, for every key, L1's value (if resident) or else L2's value is the current one.
//!
//! # Sizes
//! Above the high watermark an eviction pass runs down to the low watermark, coldest first, in
//! batches of at most `batch_size` keys. A batch that fails ends the pass (retrying at once
//! would fail the same way; the breaker decides when to try again). While the breaker is open
//! nothing is written and L1 grows past the high watermark, up to the hard cap; there
//! [`SpillController::must_pause`] asks the pipeline to stop pulling from its sources
//! (backpressure). Events are never dropped.
//!
//! # `write_back_on_evict = false`
//! Eviction then never writes: only entries the last checkpoint commit made durable (clean)
//! leave L1; dirty ones wait for the next commit (`checkpoint.interval_ms`) to write them. So
//! eviction never blocks on L2, and nothing is ever discarded: a dirty entry dropped unwritten
//! would leave L2's older row to be read back, serving an engine for a block it had evicted.
//! Config validation refuses `emergency_evict_for_restore` in that mode (it must write).
//!
//! # Periodic backup flush
//! Every `periodic_flush_interval` the controller copies up to `flush_max_entries` dirty entries
//! to L2 *without* removing them (they become clean), walking the keyspace with a cursor that
//! resumes where the last call stopped and wraps at the end, so hot keys at the start of the
//! keyspace cannot starve the rest. A restart then finds L2 nearly current even if L1 never
//! reached its watermark.
//!
//! # Emergency eviction for a restore
//! Restoring a hot L2 entry into a full L1 may evict: write back, then drop LRU entries, at
//! most 60% of L1's bytes per restore, within a time budget (about 1 s) even if L2 hangs, and
//! never while the breaker is open. A batch that does not finish in time is not removed, so a
//! hanging L2 leaves L1 intact.
//!
//! # Threading
//! The controller is plain synchronous code, meant to run on the shard's worker thread between
//! event batches (e.g. [`SpillController::maintain`] after each commit). Deadlines are real
//! time (`Instant::now()`), because they bound real waits; the breaker's pauses and the flush
//! schedule read the injected [`Clock`](super::breaker::Clock) so tests can skip through them.

use super::breaker::{CircuitBreaker, Rejected};
use super::seam::{L2Error, L2Row, L2Sink, Removal, Resident, SpillL1, Stamp};
use super::stats::{SpillMetrics, SpillStats};
use crate::config::Config;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most of L1 an emergency eviction may free for one restore.
pub const EMERGENCY_MAX_FRACTION: f64 = 0.6;
/// Time budget of an emergency eviction, L2 hanging or not.
pub const EMERGENCY_BUDGET: Duration = Duration::from_secs(1);
/// Default bound on one L2 store (eviction or flush batch).
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// The controller's settings (the validated `[index]` and `[writeback]` keys, in bytes and
/// durations, plus the fixed bounds above).
#[derive(Clone, Debug, PartialEq)]
pub struct SpillSettings {
    pub l1_max_bytes: u64,
    /// Fractions of `l1_max_bytes`: a pass starts above `high` and stops at `low`.
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// L1 size at which [`SpillController::must_pause`] turns true. At least the high
    /// watermark; the budget itself by default, so an open breaker lets L1 use the headroom
    /// between the high watermark and the budget before the sources pause.
    pub hard_cap_bytes: u64,
    pub write_back_on_evict: bool,
    /// Keys per L2 batch (`writeback.batch_size`, 128 by default).
    pub batch_size: usize,
    /// Bound on each L2 store.
    pub write_timeout: Duration,
    /// `None`: no periodic flush.
    pub periodic_flush_interval: Option<Duration>,
    /// Dirty entries copied per periodic flush call.
    pub flush_max_entries: usize,
    pub emergency_evict_for_restore: bool,
    pub emergency_max_fraction: f64,
    pub emergency_budget: Duration,
}

impl Default for SpillSettings {
    fn default() -> Self {
        SpillSettings::from(&Config::default())
    }
}

/// The `[index]` budget and watermarks and the `[writeback]` keys of a validated [`Config`].
impl From<&Config> for SpillSettings {
    fn from(c: &Config) -> SpillSettings {
        let wb = &c.writeback;
        SpillSettings {
            l1_max_bytes: c.index.l1_max_bytes,
            high_watermark: c.index.high_watermark,
            low_watermark: c.index.low_watermark,
            hard_cap_bytes: c.index.l1_max_bytes,
            write_back_on_evict: wb.write_back_on_evict,
            batch_size: wb.batch_size.max(1),
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            periodic_flush_interval: wb.periodic_flush(),
            flush_max_entries: wb.batch_size.max(1) * 8,
            emergency_evict_for_restore: wb.emergency_evict_for_restore,
            emergency_max_fraction: EMERGENCY_MAX_FRACTION,
            emergency_budget: EMERGENCY_BUDGET,
        }
    }
}

impl SpillSettings {
    /// Settings for an L1 of `l1_max_bytes` with the default watermarks and knobs.
    pub fn for_budget(l1_max_bytes: u64) -> SpillSettings {
        SpillSettings {
            l1_max_bytes,
            hard_cap_bytes: l1_max_bytes,
            ..SpillSettings::default()
        }
    }

    pub fn high_bytes(&self) -> u64 {
        fraction(self.l1_max_bytes, self.high_watermark)
    }

    pub fn low_bytes(&self) -> u64 {
        fraction(self.l1_max_bytes, self.low_watermark)
    }

    /// The hard cap, never below the high watermark.
    pub fn cap_bytes(&self) -> u64 {
        self.hard_cap_bytes.max(self.high_bytes())
    }
}

fn fraction(bytes: u64, f: f64) -> u64 {
    (bytes as f64 * f.clamp(0.0, 1.0)) as u64
}

/// Why a pass or flush stopped before its goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The breaker refused the write.
    BreakerOpen,
    /// The write failed for real (the breaker counted it).
    Failed,
    /// The write ran out of its deadline or L2 was busy (the breaker did not count it).
    DeadlineExceeded,
}

/// What one eviction pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictReport {
    pub batches: usize,
    pub written: usize,
    pub removed: usize,
    pub kept_changed: usize,
    pub bytes_freed: u64,
    /// `None`: the pass reached its goal (or had nothing to do).
    pub stopped: Option<Stop>,
}

/// What one flush call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    pub batches: usize,
    pub written: usize,
    pub marked_clean: usize,
    /// The cursor reached the end of the keyspace and wrapped.
    pub wrapped: bool,
    pub stopped: Option<Stop>,
}

/// What an emergency eviction did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmergencyReport {
    pub requested: u64,
    /// 60% of L1's bytes when it started: never freed more than this.
    pub cap: u64,
    pub bytes_freed: u64,
    pub removed: usize,
    pub elapsed: Duration,
    /// `None`: freed `min(requested, cap)` bytes (or L1 had nothing left to give).
    pub stopped: Option<Stop>,
}

impl EmergencyReport {
    /// The restore has the room it asked for.
    pub fn satisfied(&self) -> bool {
        self.bytes_freed >= self.requested
    }
}

/// Why an emergency eviction did not run at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EmergencyError {
    #[error("writeback.emergency_evict_for_restore is off")]
    Disabled,
    #[error("the L2 circuit breaker is open (retry in {retry_in:?}); no emergency eviction")]
    BreakerOpen { retry_in: Duration },
}

/// Write-back for one L1 (one shard). See the module doc for the rules it enforces.
pub struct SpillController<L: SpillL1, S: L2Sink> {
    l1: L,
    sink: S,
    /// Shared with the other shards' controllers when they write to the same L2.
    breaker: Arc<CircuitBreaker>,
    settings: SpillSettings,
    metrics: Arc<SpillMetrics>,
    /// Where the next periodic flush resumes.
    cursor: L::Cursor,
    /// When the next periodic flush is due (by the breaker's clock).
    next_flush: Option<Instant>,
}

impl<L: SpillL1, S: L2Sink> SpillController<L, S> {
    pub fn new(
        l1: L,
        sink: S,
        breaker: Arc<CircuitBreaker>,
        mut settings: SpillSettings,
    ) -> SpillController<L, S> {
        let next_flush = settings
            .periodic_flush_interval
            .and_then(|d| breaker.clock().now().checked_add(d));
        if next_flush.is_none() {
            // Off, or an interval beyond the clock's range (config validation caps it at a
            // year): either way, never.
            settings.periodic_flush_interval = None;
        }
        SpillController {
            l1,
            sink,
            breaker,
            settings,
            metrics: Arc::new(SpillMetrics::default()),
            cursor: L::Cursor::default(),
            next_flush,
        }
    }

    /// Counts into `metrics` instead of a private set (to sum several shards).
    pub fn with_metrics(mut self, metrics: Arc<SpillMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    pub fn l1(&self) -> &L {
        &self.l1
    }

    pub fn sink(&self) -> &S {
        &self.sink
    }

    pub fn breaker(&self) -> &Arc<CircuitBreaker> {
        &self.breaker
    }

    pub fn settings(&self) -> &SpillSettings {
        &self.settings
    }

    pub fn metrics(&self) -> &Arc<SpillMetrics> {
        &self.metrics
    }

    /// L1 is at its hard cap: the pipeline must stop pulling events until this turns false
    /// (after a later [`maintain`](Self::maintain) freed room). Never drop events instead.
    pub fn must_pause(&self) -> bool {
        self.l1.bytes_used() >= self.settings.cap_bytes()
    }

    /// Whether [`maintain`](Self::maintain) would write or drop anything now: L1 above its
    /// high watermark (or at the cap), or a backup flush due. Its owner can commit first, so
    /// that what leaves L1 is already durable with its offsets.
    pub fn has_work(&self) -> bool {
        let used = self.l1.bytes_used();
        let flush_due = self.settings.periodic_flush_interval.is_some()
            && self
                .next_flush
                .is_none_or(|due| self.breaker.clock().now() >= due);
        used > self.settings.high_bytes() || used >= self.settings.cap_bytes() || flush_due
    }

    /// The periodic duty: an eviction pass if above the high watermark, then a backup flush if
    /// one is due. Call it after each commit and while paused.
    pub fn maintain(&mut self) -> (EvictReport, Option<FlushReport>) {
        let evict = self.evict();
        let flush = self.maybe_flush();
        (evict, flush)
    }

    /// One eviction pass: nothing below the high watermark; above it, write back and drop the
    /// coldest entries down to the low watermark, batch by batch, stopping at the first batch
    /// that is not durable.
    pub fn evict(&mut self) -> EvictReport {
        let mut report = EvictReport::default();
        let used = self.l1.bytes_used();
        // At the cap a pass runs even if the cap equals the high watermark (`high = 1.0`):
        // otherwise `must_pause` could hold the pipeline with no pass ever freeing room.
        if used <= self.settings.high_bytes() && used < self.settings.cap_bytes() {
            return report;
        }
        let low = self.settings.low_bytes();
        loop {
            let used = self.l1.bytes_used();
            if used <= low {
                break;
            }
            let victims = select(
                self.l1.coldest(self.settings.batch_size),
                used - low,
                u64::MAX,
            );
            if victims.is_empty() {
                break;
            }
            let deadline = Instant::now() + self.settings.write_timeout;
            match self.evict_batch(victims, deadline) {
                Ok(r) => {
                    report.add(&r);
                    if r.removal.removed == 0 {
                        // Every victim changed in flight: they are now the hottest entries,
                        // but do not spin on an L1 that does not reorder them.
                        break;
                    }
                }
                Err(stop) => {
                    report.stopped = Some(stop);
                    break;
                }
            }
        }
        if report.batches > 0 || report.stopped.is_some() {
            tracing::debug!(
                batches = report.batches,
                removed = report.removed,
                bytes_freed = report.bytes_freed,
                stopped = ?report.stopped,
                l1_bytes = self.l1.bytes_used(),
                "write-back eviction pass"
            );
        }
        report
    }

    /// Runs the periodic flush if it is on and due; schedules the next one.
    pub fn maybe_flush(&mut self) -> Option<FlushReport> {
        let interval = self.settings.periodic_flush_interval?;
        let now = self.breaker.clock().now();
        if self.next_flush.is_some_and(|due| now < due) {
            return None;
        }
        self.next_flush = now.checked_add(interval);
        if self.next_flush.is_none() {
            // Beyond the clock's range: never again, rather than a panic or a busy loop.
            self.settings.periodic_flush_interval = None;
        }
        Some(self.flush_dirty(self.settings.flush_max_entries))
    }

    /// Copies up to `limit` dirty entries, from the rotating cursor on, to L2 without removing
    /// them (they become clean unless they changed meanwhile). On a failed batch the cursor
    /// stays, so the same entries are tried first next time.
    pub fn flush_dirty(&mut self, limit: usize) -> FlushReport {
        let mut report = FlushReport::default();
        let page = self.l1.dirty_after(&self.cursor, limit);
        let mut entries = page.entries;
        while !entries.is_empty() {
            let rest = entries.split_off(entries.len().min(self.settings.batch_size.max(1)));
            let chunk = std::mem::replace(&mut entries, rest);
            let deadline = Instant::now() + self.settings.write_timeout;
            let (rows, stamps) = split(chunk);
            if let Err(stop) = self.write(&rows, deadline) {
                report.stopped = Some(stop);
                return report;
            }
            SpillMetrics::add(&self.metrics.flush_entries, rows.len());
            report.batches += 1;
            report.written += rows.len();
            report.marked_clean += self.l1.mark_clean_if_unchanged(&stamps);
        }
        match page.next {
            Some(next) => self.cursor = next,
            None => {
                self.cursor = L::Cursor::default();
                report.wrapped = true;
                SpillMetrics::add(&self.metrics.flush_sweeps, 1);
            }
        }
        report
    }

    /// Flushes every dirty entry (a graceful shutdown), giving up at the first batch that is
    /// not durable or when `budget` runs out.
    pub fn flush_all(&mut self, budget: Duration) -> FlushReport {
        let end = Instant::now() + budget;
        let mut total = FlushReport::default();
        self.cursor = L::Cursor::default();
        while Instant::now() < end {
            let r = self.flush_dirty(self.settings.batch_size);
            total.batches += r.batches;
            total.written += r.written;
            total.marked_clean += r.marked_clean;
            total.stopped = r.stopped;
            if r.stopped.is_some() || r.wrapped {
                total.wrapped = r.wrapped;
                break;
            }
        }
        total
    }

    /// Makes room for restoring `need_bytes` from L2: writes back, then drops, LRU entries,
    /// at most `emergency_max_fraction` of L1's bytes, within `emergency_budget`. A batch that
    /// does not become durable in time stays in L1 whole.
    pub fn emergency_evict_for_restore(
        &mut self,
        need_bytes: u64,
    ) -> Result<EmergencyReport, EmergencyError> {
        if !self.settings.emergency_evict_for_restore {
            return Err(EmergencyError::Disabled);
        }
        if let Err(Rejected::Open { retry_in }) = self.precheck_breaker() {
            return Err(EmergencyError::BreakerOpen { retry_in });
        }
        let start = Instant::now();
        let end = start + self.settings.emergency_budget;
        let cap = fraction(self.l1.bytes_used(), self.settings.emergency_max_fraction);
        let mut report = EmergencyReport {
            requested: need_bytes,
            cap,
            ..EmergencyReport::default()
        };
        SpillMetrics::add(&self.metrics.emergency_runs, 1);
        let goal = need_bytes.min(cap);
        while report.bytes_freed < goal {
            if Instant::now() >= end {
                report.stopped = Some(Stop::DeadlineExceeded);
                break;
            }
            let victims = select(
                self.l1.coldest(self.settings.batch_size),
                goal - report.bytes_freed,
                cap - report.bytes_freed,
            );
            if victims.is_empty() {
                break;
            }
            let deadline = end.min(Instant::now() + self.settings.write_timeout);
            match self.evict_batch(victims, deadline) {
                Ok(r) if r.removal.removed == 0 => break,
                Ok(r) => {
                    report.bytes_freed += r.removal.bytes_freed;
                    report.removed += r.removal.removed;
                }
                Err(stop) => {
                    report.stopped = Some(stop);
                    break;
                }
            }
        }
        report.elapsed = start.elapsed();
        if report.stopped == Some(Stop::DeadlineExceeded) {
            SpillMetrics::add(&self.metrics.emergency_timeouts, 1);
        }
        tracing::debug!(
            requested = need_bytes,
            cap,
            bytes_freed = report.bytes_freed,
            elapsed_ms = report.elapsed.as_millis() as u64,
            stopped = ?report.stopped,
            "emergency eviction for restore"
        );
        Ok(report)
    }

    /// Counters and gauges for `/v1/stats` and `/metrics`.
    pub fn stats(&self) -> SpillStats {
        let mut s = SpillStats::counters(&self.metrics, self.breaker.snapshot());
        s.l1_bytes = self.l1.bytes_used();
        s.l1_entries = self.l1.entry_count() as u64;
        s.l1_max_bytes = self.settings.l1_max_bytes;
        s.l1_high_watermark_bytes = self.settings.high_bytes();
        s.l1_hard_cap_bytes = self.settings.cap_bytes();
        s.backpressure = s.l1_bytes >= s.l1_hard_cap_bytes;
        s
    }

    /// The breaker refuses outright (open); a half-open breaker lets the caller try a probe.
    fn precheck_breaker(&self) -> Result<(), Rejected> {
        let snap = self.breaker.snapshot();
        match snap.state {
            super::breaker::BreakerState::Open => Err(Rejected::Open {
                retry_in: snap.remaining,
            }),
            _ => Ok(()),
        }
    }

    /// Writes back the dirty ones among `victims` (unless write-back is off), then removes
    /// every victim that did not change meanwhile. Nothing is removed unless the write is
    /// durable.
    fn evict_batch(
        &mut self,
        victims: Vec<Resident<L::Key>>,
        deadline: Instant,
    ) -> Result<BatchOutcome, Stop> {
        let victims = if self.settings.write_back_on_evict {
            victims
        } else {
            let (clean, dirty): (Vec<_>, Vec<_>) =
                victims.into_iter().partition(|v| v.dirty.is_none());
            SpillMetrics::add(&self.metrics.entries_awaiting_commit, dirty.len());
            clean
        };
        let (rows, stamps) = split(victims);
        let mut outcome = BatchOutcome::default();
        if !rows.is_empty() {
            self.write(&rows, deadline)?;
            outcome.written = rows.len();
        }
        crate::util::crash_point("evict.durable");
        outcome.removal = self.l1.remove_if_unchanged(&stamps);
        SpillMetrics::add(&self.metrics.entries_evicted, outcome.removal.removed);
        SpillMetrics::add(&self.metrics.entries_kept_changed, outcome.removal.kept);
        Ok(outcome)
    }

    /// One L2 write behind the breaker, with its outcome reported to the breaker and counted.
    fn write(&self, rows: &[L2Row], deadline: Instant) -> Result<(), Stop> {
        let permit = match self.breaker.try_acquire() {
            Ok(p) => p,
            Err(rejected) => {
                SpillMetrics::add(&self.metrics.breaker_rejections, 1);
                tracing::trace!(%rejected, "write-back skipped");
                return Err(Stop::BreakerOpen);
            }
        };
        match self.sink.write_batch(rows, deadline) {
            Ok(()) => {
                permit.succeeded();
                SpillMetrics::add(&self.metrics.batches, 1);
                SpillMetrics::add(&self.metrics.entries_written, rows.len());
                Ok(())
            }
            Err(e) if e.is_failure() => {
                permit.failed();
                SpillMetrics::add(&self.metrics.failures, 1);
                if matches!(e, L2Error::Partial { .. }) {
                    SpillMetrics::add(&self.metrics.partial_failures, 1);
                }
                tracing::warn!(error = %e, rows = rows.len(), "write-back batch failed; entries kept in L1");
                Err(Stop::Failed)
            }
            Err(e) => {
                permit.timed_out();
                SpillMetrics::add(&self.metrics.deadline_expiries, 1);
                tracing::info!(error = %e, rows = rows.len(), "write-back batch not durable in time; entries kept in L1");
                Err(Stop::DeadlineExceeded)
            }
        }
    }
}

#[derive(Default)]
struct BatchOutcome {
    written: usize,
    removal: Removal,
}

impl EvictReport {
    fn add(&mut self, b: &BatchOutcome) {
        self.batches += usize::from(b.written > 0);
        self.written += b.written;
        self.removed += b.removal.removed;
        self.kept_changed += b.removal.kept;
        self.bytes_freed += b.removal.bytes_freed;
    }
}

/// The coldest prefix of `candidates` that frees at least `want` bytes (fewer if there are not
/// enough) without ever exceeding `limit` bytes in total.
fn select<K>(candidates: Vec<Resident<K>>, want: u64, limit: u64) -> Vec<Resident<K>> {
    let mut total = 0u64;
    let mut out = Vec::with_capacity(candidates.len());
    for c in candidates {
        if total >= want || total.saturating_add(c.bytes) > limit {
            break;
        }
        total += c.bytes;
        out.push(c);
    }
    out
}

/// The rows to write (dirty entries only) and the stamps of every entry, moved out of
/// `entries` (no copy of keys or values on the hot path).
fn split<K>(entries: Vec<Resident<K>>) -> (Vec<L2Row>, Vec<Stamp<K>>) {
    let mut rows = Vec::with_capacity(entries.len());
    let mut stamps = Vec::with_capacity(entries.len());
    for e in entries {
        rows.extend(e.dirty);
        stamps.push(Stamp {
            key: e.key,
            version: e.version,
        });
    }
    (rows, stamps)
}
