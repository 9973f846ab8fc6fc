//! Write-back counters ([`SpillMetrics`], shared atomics the controller bumps) and the
//! point-in-time [`SpillStats`] that `/v1/stats` serializes and `/metrics` renders.
//!
//! Counters are atomics in an `Arc` so the HTTP side reads them without touching the
//! controller, which lives on a shard's worker thread.

use super::breaker::{BreakerSnapshot, BreakerState};
use serde::Serialize;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Monotonic write-back counters of one controller (or several, summed by sharing the `Arc`).
#[derive(Debug, Default)]
pub struct SpillMetrics {
    /// Batches durably written to L2 (eviction, flush and emergency alike).
    pub batches: AtomicU64,
    /// Rows those batches carried.
    pub entries_written: AtomicU64,
    /// Entries removed from L1 after their batch was durable (or clean already).
    pub entries_evicted: AtomicU64,
    /// Cold dirty entries eviction left in L1 for the next commit to write
    /// (`write_back_on_evict = false`).
    pub entries_awaiting_commit: AtomicU64,
    /// Entries left in L1 because they changed while their batch was in flight.
    pub entries_kept_changed: AtomicU64,
    /// Real write failures (including partial writes); these drive the breaker.
    pub failures: AtomicU64,
    /// Of `failures`, those where the sink wrote a prefix of the batch.
    pub partial_failures: AtomicU64,
    /// Writes that ran out of their deadline, or that L2 refused as busy.
    pub deadline_expiries: AtomicU64,
    /// Writes not attempted because the breaker was open.
    pub breaker_rejections: AtomicU64,
    /// Rows copied to L2 by the periodic backup flush (a subset of `entries_written`).
    pub flush_entries: AtomicU64,
    /// Complete rotations of the flush cursor over the keyspace.
    pub flush_sweeps: AtomicU64,
    /// Emergency evictions for a restore, and how many of them ran out of their time budget.
    pub emergency_runs: AtomicU64,
    pub emergency_timeouts: AtomicU64,
}

impl SpillMetrics {
    pub(crate) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Relaxed);
    }
}

/// Everything `/v1/stats` reports about write-back.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpillStats {
    pub l1_bytes: u64,
    pub l1_entries: u64,
    /// `index.l1_max_bytes` (0 where the controller has no budget of its own to report).
    pub l1_max_bytes: u64,
    pub l1_high_watermark_bytes: u64,
    pub l1_hard_cap_bytes: u64,
    /// The sources should be paused (L1 at its hard cap).
    pub backpressure: bool,
    pub batches: u64,
    pub entries_written: u64,
    pub entries_evicted: u64,
    pub entries_awaiting_commit: u64,
    pub entries_kept_changed: u64,
    pub failures: u64,
    pub partial_failures: u64,
    pub deadline_expiries: u64,
    pub breaker_rejections: u64,
    pub flush_entries: u64,
    pub flush_sweeps: u64,
    pub emergency_runs: u64,
    pub emergency_timeouts: u64,
    /// Rows in L2 (RocksDB's estimate over blocks and engine maps; 0 without a store).
    pub l2_entries: u64,
    /// Point reads of L2 (lookups falling through, events faulting entries in), and how many
    /// found their row, failed, or were brought back into L1 for lookups.
    pub l2_reads: u64,
    pub l2_hits: u64,
    pub l2_read_errors: u64,
    pub restored: u64,
    pub breaker: BreakerSnapshot,
}

impl SpillStats {
    /// Counter values from `m`; the caller fills the gauges.
    pub(crate) fn counters(m: &SpillMetrics, breaker: BreakerSnapshot) -> SpillStats {
        SpillStats {
            l1_bytes: 0,
            l1_entries: 0,
            l1_max_bytes: 0,
            l1_high_watermark_bytes: 0,
            l1_hard_cap_bytes: 0,
            backpressure: false,
            batches: m.batches.load(Relaxed),
            entries_written: m.entries_written.load(Relaxed),
            entries_evicted: m.entries_evicted.load(Relaxed),
            entries_awaiting_commit: m.entries_awaiting_commit.load(Relaxed),
            entries_kept_changed: m.entries_kept_changed.load(Relaxed),
            failures: m.failures.load(Relaxed),
            partial_failures: m.partial_failures.load(Relaxed),
            deadline_expiries: m.deadline_expiries.load(Relaxed),
            breaker_rejections: m.breaker_rejections.load(Relaxed),
            flush_entries: m.flush_entries.load(Relaxed),
            flush_sweeps: m.flush_sweeps.load(Relaxed),
            emergency_runs: m.emergency_runs.load(Relaxed),
            emergency_timeouts: m.emergency_timeouts.load(Relaxed),
            l2_entries: 0,
            l2_reads: 0,
            l2_hits: 0,
            l2_read_errors: 0,
            restored: 0,
            breaker,
        }
    }

    /// Appends the Prometheus text exposition of these values (`kvindex_writeback_*`,
    /// `kvindex_l1_*`) to `out`.
    pub fn render_prometheus(&self, out: &mut String) {
        let gauges: [(&str, &str, u64); 9] = [
            ("kvindex_l1_bytes", "Bytes accounted in L1.", self.l1_bytes),
            (
                "kvindex_l1_max_bytes",
                "The L1 budget (index.l1_max_bytes).",
                self.l1_max_bytes,
            ),
            (
                "kvindex_l2_entries",
                "Rows in L2 (RocksDB's estimate).",
                self.l2_entries,
            ),
            (
                "kvindex_l1_entries",
                "Entries resident in L1.",
                self.l1_entries,
            ),
            (
                "kvindex_l1_hard_cap_bytes",
                "L1 size at which the sources pause.",
                self.l1_hard_cap_bytes,
            ),
            (
                "kvindex_writeback_backpressure",
                "1 while the sources are paused because L1 is at its hard cap.",
                u64::from(self.backpressure),
            ),
            (
                "kvindex_writeback_breaker_state",
                "L2 circuit breaker: 0 closed, 1 open, 2 half-open.",
                u64::from(self.breaker.state.gauge()),
            ),
            (
                "kvindex_writeback_breaker_consecutive_failures",
                "Consecutive real L2 write failures.",
                u64::from(self.breaker.consecutive_failures),
            ),
            (
                "kvindex_writeback_breaker_backoff_seconds",
                "Pause imposed by the last L2 write failure.",
                self.breaker.backoff.as_secs(),
            ),
        ];
        for (name, help, v) in gauges {
            family(out, name, "gauge", help);
            let _ = writeln!(out, "{name} {v}");
        }
        let counters: [(&str, &str, u64); 12] = [
            (
                "batches",
                "Write-back batches durably written to L2.",
                self.batches,
            ),
            (
                "entries_written",
                "Rows written to L2 by write-back.",
                self.entries_written,
            ),
            (
                "entries_evicted",
                "Entries removed from L1 once durable.",
                self.entries_evicted,
            ),
            (
                "entries_awaiting_commit",
                "Cold dirty entries left in L1 for the next commit (write_back_on_evict = false).",
                self.entries_awaiting_commit,
            ),
            (
                "entries_kept_changed",
                "Entries kept in L1 because they changed during their write.",
                self.entries_kept_changed,
            ),
            ("failures", "Real L2 write failures.", self.failures),
            (
                "partial_failures",
                "L2 writes that landed only a prefix.",
                self.partial_failures,
            ),
            (
                "deadline_expiries",
                "L2 writes that ran out of their deadline or found L2 busy.",
                self.deadline_expiries,
            ),
            (
                "breaker_rejections",
                "L2 writes skipped while the breaker was open.",
                self.breaker_rejections,
            ),
            (
                "flush_entries",
                "Rows copied to L2 by the periodic flush.",
                self.flush_entries,
            ),
            (
                "emergency_runs",
                "Emergency evictions for a restore.",
                self.emergency_runs,
            ),
            (
                "emergency_timeouts",
                "Emergency evictions that ran out of their time budget.",
                self.emergency_timeouts,
            ),
        ];
        for (name, help, v) in counters {
            let name = format!("kvindex_writeback_{name}_total");
            family(out, &name, "counter", help);
            let _ = writeln!(out, "{name} {v}");
        }
        let reads: [(&str, &str, u64); 4] = [
            ("reads", "Point reads of L2.", self.l2_reads),
            ("hits", "L2 reads that found their row.", self.l2_hits),
            ("read_errors", "L2 reads that failed.", self.l2_read_errors),
            (
                "restored",
                "Blocks brought back into L1 for lookups.",
                self.restored,
            ),
        ];
        for (name, help, v) in reads {
            let name = format!("kvindex_l2_{name}_total");
            family(out, &name, "counter", help);
            let _ = writeln!(out, "{name} {v}");
        }
    }

    /// Whether the breaker currently blocks L2 writes.
    pub fn breaker_open(&self) -> bool {
        self.breaker.state == BreakerState::Open
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}
