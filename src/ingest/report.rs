//! The source's status: what the ingest loop last saw of its source ([`SourceReport`], written by
//! the loop) combined with what the pipeline has applied and made durable of each partition, as
//! the typed [`SourceStatus`] that `/v1/stats` serializes, `/readyz` takes its `lag` from, and
//! `/metrics` renders.

use crate::metrics::{Metrics, SourceGauge};
use crate::pipeline::Progress;
use crate::source::{Divergence, EventSource, PartitionStatus, SourceSpec};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// The source as `/v1/stats` shows it under `sources`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SourceStatus {
    /// `embedded`, `kafka`, `nats` or `nats-core`.
    pub kind: String,
    /// The checkpoint key: `kafka:<topic>`, `nats:<stream>`.
    pub name: String,
    /// The Kafka bootstrap servers (the embedded broker's too); `null` for NATS.
    pub bootstrap_servers: Option<String>,
    pub connected: bool,
    /// The last connection or source error, until the next success.
    pub error: Option<String>,
    /// Every partition caught up with the log end it saw at start (latched).
    pub ready: bool,
    /// Offsets behind the log ends, summed over partitions.
    pub lag: i64,
    pub batches: u64,
    pub messages: u64,
    pub divergences_total: u64,
    pub partitions: Vec<PartitionProgress>,
}

/// One source partition: where the source is, what is applied and durable, how far behind.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PartitionProgress {
    pub partition: i32,
    /// Next offset durable in RocksDB (every shard): where a restart resumes.
    pub stored_offset: Option<i64>,
    /// Next offset applied in memory (every shard).
    pub applied_offset: Option<i64>,
    pub position: i64,
    pub high_watermark: i64,
    pub low_watermark: i64,
    pub high_watermark_at_start: Option<i64>,
    /// `-1` while unknown.
    pub lag: i64,
    pub events_applied: u64,
    pub duplicates_skipped: u64,
    pub divergence: Option<Divergence>,
    /// Messages of the partition reached the pipeline (or its offsets were restored) and not
    /// every shard has applied one yet: how far it is applied is unknown, and the source's
    /// position, which runs ahead of the shards, must not stand in for it.
    #[serde(skip)]
    pub pending: bool,
}

/// What the ingest loop last saw of its source.
#[derive(Default)]
struct Snapshot {
    connected: bool,
    error: Option<String>,
    partitions: Vec<PartitionStatus>,
    high_at_start: BTreeMap<i32, i64>,
    divergences_total: u64,
    ready: bool,
    batches: u64,
    messages: u64,
}

/// The source's status, shared between the ingest loop (writer) and the HTTP API (reader).
pub struct SourceReport {
    kind: &'static str,
    name: String,
    bootstrap: Option<String>,
    progress: Arc<Progress>,
    snapshot: Mutex<Snapshot>,
}

impl PartitionProgress {
    /// Next offset applied: the shards' minimum, or the source position while nothing of the
    /// partition reached the pipeline in this process (an empty partition, a `latest` start);
    /// `None` while it is [`pending`](PartitionProgress::pending) or unknown.
    fn applied(&self) -> Option<i64> {
        match self.applied_offset {
            Some(applied) => Some(applied),
            None if self.pending => None,
            None => Some(self.position),
        }
        .filter(|&a| a >= 0)
    }

    fn caught_up(&self) -> bool {
        self.divergence.is_none()
            && self
                .high_watermark_at_start
                .is_some_and(|h| self.applied().is_some_and(|a| a >= h))
    }
}

impl SourceReport {
    pub fn new(spec: &SourceSpec, bootstrap: Option<String>, progress: Arc<Progress>) -> Self {
        SourceReport {
            kind: spec.kind(),
            name: spec.name(),
            bootstrap,
            progress,
            snapshot: Mutex::new(Snapshot::default()),
        }
    }

    fn partitions(&self, snap: &Snapshot) -> Vec<PartitionProgress> {
        let known: BTreeMap<i32, _> = self
            .progress
            .of_source(&self.name)
            .into_iter()
            .map(|p| (p.partition, p))
            .collect();
        snap.partitions
            .iter()
            .map(|s| {
                let p = known.get(&s.partition);
                let mut view = PartitionProgress {
                    partition: s.partition,
                    stored_offset: p.and_then(|p| p.durable_next()),
                    applied_offset: p.and_then(|p| p.applied_next()),
                    position: s.position,
                    high_watermark: s.high_watermark,
                    low_watermark: s.low_watermark,
                    high_watermark_at_start: snap.high_at_start.get(&s.partition).copied(),
                    lag: -1,
                    events_applied: p.map_or(0, |p| p.events_applied.load(Relaxed)),
                    duplicates_skipped: p.map_or(0, |p| p.duplicates.load(Relaxed)),
                    divergence: s.divergence.clone(),
                    pending: p.is_some_and(|p| p.applied_next().is_none()),
                };
                if let Some(applied) = view.applied().filter(|_| view.high_watermark >= 0) {
                    view.lag = (view.high_watermark - applied).max(0);
                }
                view
            })
            .collect()
    }

    /// The source's name and, per partition, the next offset every shard has applied.
    pub fn applied(&self) -> (&str, Vec<(i32, i64)>) {
        (&self.name, self.progress.applied_of(&self.name))
    }

    /// Whether every partition has caught up to the log end it saw at start (latched: once
    /// ready, a later lag does not make the service unready).
    pub fn is_ready(&self) -> bool {
        self.snapshot.lock().ready
    }

    /// The status now.
    pub fn status(&self) -> SourceStatus {
        let snap = self.snapshot.lock();
        let partitions = self.partitions(&snap);
        SourceStatus {
            kind: self.kind.to_string(),
            name: self.name.clone(),
            bootstrap_servers: self.bootstrap.clone(),
            connected: snap.connected,
            error: snap.error.clone(),
            ready: snap.ready,
            lag: partitions.iter().map(|p| p.lag.max(0)).sum(),
            batches: snap.batches,
            messages: snap.messages,
            divergences_total: snap.divergences_total,
            partitions,
        }
    }

    pub(super) fn set_error(&self, error: String) {
        let mut s = self.snapshot.lock();
        s.connected = false;
        s.error = Some(error);
    }

    /// Takes a fresh status from the source; returns whether the service is ready.
    pub(super) fn refresh(&self, source: &impl EventSource, metrics: &Metrics) -> bool {
        let mut snap = self.snapshot.lock();
        snap.error = source.trouble();
        snap.connected = snap.error.is_none();
        snap.partitions = source.status();
        snap.divergences_total = source.divergences_total();
        for (p, h) in source.high_watermarks_at_start() {
            snap.high_at_start.entry(p).or_insert(h);
        }
        let partitions = self.partitions(&snap);
        if !snap.ready
            && !partitions.is_empty()
            && partitions.iter().all(PartitionProgress::caught_up)
        {
            snap.ready = true;
            tracing::info!(source = %self.name, partitions = partitions.len(), "caught up with the log end seen at start (ready once the index is warm too)");
        }
        metrics.set_sources(
            partitions
                .iter()
                .map(|p| SourceGauge {
                    source: self.name.clone(),
                    partition: p.partition,
                    lag: p.lag,
                    durable_offset: p.stored_offset.unwrap_or(-1),
                    high_watermark: p.high_watermark,
                    diverged: p.divergence.is_some(),
                })
                .collect(),
        );
        snap.ready
    }

    pub(super) fn count_batch(&self, messages: usize) {
        let mut s = self.snapshot.lock();
        s.batches += 1;
        s.messages += messages as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(applied_offset: Option<i64>, pending: bool) -> PartitionProgress {
        PartitionProgress {
            applied_offset,
            position: 100,
            high_watermark: 100,
            high_watermark_at_start: Some(100),
            pending,
            ..PartitionProgress::default()
        }
    }

    #[test]
    fn the_source_position_stands_in_only_while_nothing_reached_the_pipeline() {
        // Nothing delivered (an empty partition, a `latest` start): caught up at the position.
        assert!(partition(None, false).caught_up());
        // Delivered up to the log end, not yet applied by every shard: not caught up.
        assert!(!partition(None, true).caught_up());
        assert!(!partition(Some(40), false).caught_up());
        assert!(partition(Some(100), false).caught_up());
    }
}
