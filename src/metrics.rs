//! Process-wide counters and the Prometheus text rendering of them and of index gauges.
//!
//! Hot counters are plain atomics; counters by reason (malformed / skipped) sit behind a mutex
//! because they only move on bad input, which is rare by definition.

use crate::index::IndexStats;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Upper bounds (seconds) of the lookup latency histogram buckets.
const LATENCY_BUCKETS: [f64; 12] = [
    5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3,
];

/// All counters kvindex exports. One instance per process, shared by `Arc`.
#[derive(Default)]
pub struct Metrics {
    /// Events applied, by kind label (`stored`, `removed`, `all_cleared`, `replica_updated`).
    applied: [AtomicU64; 4],
    /// Block memberships added or removed by applied events.
    pub block_ops: AtomicU64,
    /// Payloads or events that failed to decode, by reason.
    malformed: Mutex<BTreeMap<&'static str, u64>>,
    /// Decoded events that could not be applied, by reason.
    skipped: Mutex<BTreeMap<&'static str, u64>>,
    pub lookups: AtomicU64,
    pub lookup_errors: AtomicU64,
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_sum_ns: AtomicU64,
    /// Events skipped because their shard had already applied their source offset.
    pub duplicates: AtomicU64,
    /// Shard commits (index rows + offsets in one RocksDB batch) that succeeded / failed.
    pub commits: AtomicU64,
    pub commit_failures: AtomicU64,
    commit_sum_ns: AtomicU64,
    /// Engines cleared because no event reached them for `index.engine_ttl_s`.
    pub engines_expired: AtomicU64,
    /// Times a shard held its events because an L2 read one needed failed.
    pub l2_read_holds: AtomicU64,
    /// The source partitions as last published by the ingest loop.
    sources: Mutex<Vec<SourceGauge>>,
}

/// One source partition's gauges for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceGauge {
    pub source: String,
    pub partition: i32,
    /// Log end minus the next offset applied (-1 while unknown).
    pub lag: i64,
    /// Next offset durable in the store (-1: none).
    pub durable_offset: i64,
    pub high_watermark: i64,
    /// Consuming stopped because the checkpoint diverged from the log.
    pub diverged: bool,
}

/// Kind labels for [`Metrics::applied`] (the index of each is its slot).
pub const APPLIED_KINDS: [&str; 4] = ["stored", "removed", "all_cleared", "replica_updated"];

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// Counts an applied event of the kind at `APPLIED_KINDS[slot]`.
    pub fn count_applied(&self, slot: usize, block_ops: usize) {
        if let Some(c) = self.applied.get(slot) {
            c.fetch_add(1, Relaxed);
        }
        self.block_ops.fetch_add(block_ops as u64, Relaxed);
    }

    pub fn count_duplicates(&self, events: u64) {
        self.duplicates.fetch_add(events, Relaxed);
    }

    pub fn observe_commit(&self, took: std::time::Duration) {
        self.commits.fetch_add(1, Relaxed);
        self.commit_sum_ns
            .fetch_add(took.as_nanos() as u64, Relaxed);
    }

    pub fn count_commit_failure(&self) {
        self.commit_failures.fetch_add(1, Relaxed);
    }

    /// Replaces the source partitions shown by `/metrics`.
    pub fn set_sources(&self, gauges: Vec<SourceGauge>) {
        *self.sources.lock() = gauges;
    }

    pub fn count_malformed(&self, reason: &'static str) {
        *self.malformed.lock().entry(reason).or_default() += 1;
    }

    pub fn count_l2_read_hold(&self) {
        self.l2_read_holds.fetch_add(1, Relaxed);
    }

    pub fn count_engine_expired(&self) {
        self.engines_expired.fetch_add(1, Relaxed);
    }

    pub fn count_skipped(&self, reason: &'static str) {
        *self.skipped.lock().entry(reason).or_default() += 1;
    }

    /// Records one lookup's latency.
    pub fn observe_lookup(&self, seconds: f64) {
        self.lookups.fetch_add(1, Relaxed);
        self.latency_sum_ns
            .fetch_add((seconds * 1e9) as u64, Relaxed);
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
            self.latency_buckets[i].fetch_add(1, Relaxed);
        }
    }

    /// Applied events by kind label.
    pub fn applied(&self) -> BTreeMap<&'static str, u64> {
        APPLIED_KINDS
            .iter()
            .zip(&self.applied)
            .map(|(k, c)| (*k, c.load(Relaxed)))
            .collect()
    }
    pub fn applied_total(&self) -> u64 {
        self.applied.iter().map(|c| c.load(Relaxed)).sum()
    }
    pub fn malformed(&self) -> BTreeMap<&'static str, u64> {
        self.malformed.lock().clone()
    }
    pub fn skipped(&self) -> BTreeMap<&'static str, u64> {
        self.skipped.lock().clone()
    }

    /// Prometheus text exposition (format 0.0.4) of these counters and of `index`'s gauges.
    pub fn render(&self, index: &IndexStats) -> String {
        let mut out = String::with_capacity(4096);
        write_family(
            &mut out,
            "kvindex_events_applied_total",
            "counter",
            "Events applied to the index, by kind.",
        );
        for (kind, n) in self.applied() {
            let _ = writeln!(out, "kvindex_events_applied_total{{kind=\"{kind}\"}} {n}");
        }
        write_family(
            &mut out,
            "kvindex_block_ops_total",
            "counter",
            "Block memberships added or removed.",
        );
        let _ = writeln!(
            out,
            "kvindex_block_ops_total {}",
            self.block_ops.load(Relaxed)
        );
        write_family(
            &mut out,
            "kvindex_events_malformed_total",
            "counter",
            "Payloads or events rejected by a decoder, by reason.",
        );
        for (reason, n) in self.malformed() {
            let _ = writeln!(
                out,
                "kvindex_events_malformed_total{{reason=\"{reason}\"}} {n}"
            );
        }
        write_family(
            &mut out,
            "kvindex_events_skipped_total",
            "counter",
            "Decoded events that could not be applied, by reason.",
        );
        for (reason, n) in self.skipped() {
            let _ = writeln!(
                out,
                "kvindex_events_skipped_total{{reason=\"{reason}\"}} {n}"
            );
        }
        write_family(
            &mut out,
            "kvindex_lookup_errors_total",
            "counter",
            "Lookup requests rejected as invalid.",
        );
        let _ = writeln!(
            out,
            "kvindex_lookup_errors_total {}",
            self.lookup_errors.load(Relaxed)
        );
        write_family(
            &mut out,
            "kvindex_lookup_duration_seconds",
            "histogram",
            "Time to answer a lookup in the index.",
        );
        let mut cumulative = 0;
        for (bound, c) in LATENCY_BUCKETS.iter().zip(&self.latency_buckets) {
            cumulative += c.load(Relaxed);
            let _ = writeln!(
                out,
                "kvindex_lookup_duration_seconds_bucket{{le=\"{bound}\"}} {cumulative}"
            );
        }
        let count = self.lookups.load(Relaxed);
        let _ = writeln!(
            out,
            "kvindex_lookup_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "kvindex_lookup_duration_seconds_sum {}",
            self.latency_sum_ns.load(Relaxed) as f64 / 1e9
        );
        let _ = writeln!(out, "kvindex_lookup_duration_seconds_count {count}");
        for (name, help, value) in [
            (
                "kvindex_duplicates_skipped_total",
                "Events skipped because their offset was already applied (redeliveries, re-reads).",
                self.duplicates.load(Relaxed),
            ),
            (
                "kvindex_commits_total",
                "Shard commits of index rows and source offsets in one RocksDB batch.",
                self.commits.load(Relaxed),
            ),
            (
                "kvindex_commit_failures_total",
                "Shard commits that failed (retried; nothing is acknowledged upstream meanwhile).",
                self.commit_failures.load(Relaxed),
            ),
            (
                "kvindex_producer_seq_regressions_total",
                "Events whose producer seq was below the highest applied for their engine.",
                index.seq_regressions,
            ),
            (
                "kvindex_l2_read_holds_total",
                "Retries of an event whose L2 read failed (its shard holds; nothing is skipped).",
                self.l2_read_holds.load(Relaxed),
            ),
            (
                "kvindex_engines_expired_total",
                "Engines cleared because no event reached them for index.engine_ttl_s.",
                self.engines_expired.load(Relaxed),
            ),
            (
                "kvindex_block_size_conflicts_total",
                "Events whose block size differs from the size pinned for their model.",
                index.block_size_conflicts,
            ),
        ] {
            write_family(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {value}");
        }
        write_family(
            &mut out,
            "kvindex_commit_seconds_total",
            "counter",
            "Total time spent writing shard commits.",
        );
        let _ = writeln!(
            out,
            "kvindex_commit_seconds_total {}",
            self.commit_sum_ns.load(Relaxed) as f64 / 1e9
        );
        self.render_sources(&mut out);
        for (name, help, value) in [
            (
                "kvindex_block_entries",
                "Distinct blocks per shard, summed over shards.",
                index.block_entries as f64,
            ),
            (
                "kvindex_memberships",
                "(block, engine) memberships indexed.",
                index.memberships as f64,
            ),
            ("kvindex_engines", "Engines known.", index.engines as f64),
            (
                "kvindex_partitions",
                "(tenant, model, adapter) partitions known.",
                index.partitions.len() as f64,
            ),
            (
                "kvindex_index_memory_bytes",
                "Bytes of memory held by the in-memory index (kvindex_l1_bytes is what L1 accounts against its budget).",
                index.l1_bytes as f64,
            ),
            ("kvindex_shards", "Index shards.", index.shards as f64),
        ] {
            write_family(&mut out, name, "gauge", help);
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }
}

impl Metrics {
    fn render_sources(&self, out: &mut String) {
        let sources = self.sources.lock();
        type Field = fn(&SourceGauge) -> i64;
        let families: [(&str, &str, Field); 4] = [
            (
                "kvindex_source_lag",
                "Offsets between the log end and the next offset applied.",
                |g| g.lag,
            ),
            (
                "kvindex_source_durable_offset",
                "Next offset durable in the store (where a restart resumes).",
                |g| g.durable_offset,
            ),
            (
                "kvindex_source_high_watermark",
                "Log end (next offset to be written) as last seen.",
                |g| g.high_watermark,
            ),
            (
                "kvindex_source_diverged",
                "1 while consuming is stopped because the checkpoint diverged from the log.",
                |g| i64::from(g.diverged),
            ),
        ];
        for (name, help, field) in families {
            write_family(out, name, "gauge", help);
            for g in sources.iter() {
                let _ = writeln!(
                    out,
                    "{name}{{source=\"{}\",partition=\"{}\"}} {}",
                    g.source,
                    g.partition,
                    field(g)
                );
            }
        }
    }
}

fn write_family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}
