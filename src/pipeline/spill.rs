//! The spill's wiring, the one place that names both the index and the store: the L1 budget
//! split over the shards, one [`SpillController`] per shard worker over that shard's
//! [`ShardL1`] and the store's [`StoreSink`], one circuit breaker shared by every L2 write, and
//! the `/v1/stats` view summed over shards.
//!
//! What a shard worker does with its [`ShardSpill`] (see `worker.rs`):
//! - after each batch of events and each commit: [`ShardSpill::maintain`] (an eviction pass
//!   above the high watermark, the periodic backup flush when due, then the restores lookups
//!   asked for), whenever [`ShardSpill::has_work`] only right after a successful checkpoint
//!   commit: so every entry it writes back or drops is clean (its row and the offsets that
//!   cover it are already in one committed batch) and L2 never runs ahead of the offsets;
//! - its checkpoint commits go through [`ShardSpill::breaker`] too: the commit is the main
//!   writer of L2, so while RocksDB fails, commits back off like write-back batches do;
//! - while [`ShardSpill::must_pause`] (L1 at its hard cap, the breaker open) it stops taking
//!   events, so its queue fills and the sources stop pulling: backpressure, never a dropped
//!   event.

use crate::config::Config;
use crate::index::shard::{ReadThroughSettings, ReadThroughStats};
use crate::index::{Index, Shard, ShardL1};
use crate::spill::{
    CircuitBreaker, Clock, SpillController, SpillMetrics, SpillSettings, SpillStats,
};
use crate::store::{Store, StoreSink};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

/// Write-back of the whole index: what every shard's controller shares.
pub struct Spill {
    index: Arc<Index>,
    store: Arc<Store>,
    /// Per shard: the configured budget divided by the shard count.
    settings: SpillSettings,
    restore_on_read: bool,
    breaker: Arc<CircuitBreaker>,
    metrics: Arc<SpillMetrics>,
    read_stats: Arc<ReadThroughStats>,
}

impl Spill {
    /// `clock` drives the breaker's pauses and the flush schedule ([`crate::spill::SystemClock`] in
    /// the service, a manual clock in tests).
    pub fn new(
        config: &Config,
        index: Arc<Index>,
        store: Arc<Store>,
        clock: Arc<dyn Clock>,
    ) -> Spill {
        let shards = index.shard_count().max(1) as u64;
        let mut settings = SpillSettings::from(config);
        settings.l1_max_bytes = (settings.l1_max_bytes / shards).max(1);
        settings.hard_cap_bytes = settings.l1_max_bytes;
        Spill {
            index,
            store,
            settings,
            restore_on_read: config.writeback.restore_on_read,
            breaker: Arc::new(CircuitBreaker::new(clock)),
            metrics: Arc::new(SpillMetrics::default()),
            read_stats: Arc::new(ReadThroughStats::default()),
        }
    }

    /// What one shard may load at start: its budget down to the low watermark, so eviction
    /// does not start the moment events flow.
    pub fn load_budget(&self) -> u64 {
        self.settings.low_bytes()
    }

    /// Puts the store behind `shard` (number `n`) as its L2; `spilled`: L2 may hold rows L1
    /// lacks (so while its load is under way, and after a load that left rows in L2).
    pub fn attach(&self, shard: &mut Shard, n: usize, spilled: bool) {
        shard.attach_l2(
            self.store.clone(),
            n as u16,
            ReadThroughSettings {
                restore_on_read: self.restore_on_read,
            },
            self.read_stats.clone(),
            spilled,
        );
    }

    /// The write-back duty of shard `n`'s worker.
    pub fn for_shard(&self, n: usize) -> ShardSpill {
        let controller = SpillController::new(
            ShardL1::new(self.index.clone(), n),
            StoreSink::new(self.store.clone()),
            self.breaker.clone(),
            self.settings.clone(),
        )
        .with_metrics(self.metrics.clone());
        ShardSpill {
            controller,
            index: self.index.clone(),
            shard: n,
        }
    }

    pub fn breaker(&self) -> &Arc<CircuitBreaker> {
        &self.breaker
    }

    pub fn read_stats(&self) -> &Arc<ReadThroughStats> {
        &self.read_stats
    }

    /// `/v1/stats`' write-back section: gauges summed over shards, the shared counters.
    pub fn stats(&self) -> SpillStats {
        let mut s = SpillStats::counters(&self.metrics, self.breaker.snapshot());
        let shards = self.index.shard_count() as u64;
        let l1 = self.index.l1_usage();
        s.l1_bytes = l1.iter().map(|u| u.bytes).sum();
        s.l1_entries = l1.iter().map(|u| u.entries as u64).sum();
        s.l1_max_bytes = self.settings.l1_max_bytes * shards;
        s.l1_high_watermark_bytes = self.settings.high_bytes() * shards;
        s.l1_hard_cap_bytes = self.settings.cap_bytes() * shards;
        s.backpressure = l1.iter().any(|u| u.bytes >= self.settings.cap_bytes());
        s.l2_entries = self.store.l2_entries();
        let t = &self.read_stats;
        s.l2_reads = t.l2_reads.load(Relaxed);
        s.l2_hits = t.l2_hits.load(Relaxed);
        s.l2_read_errors = t.l2_read_errors.load(Relaxed);
        s.restored = t.restored.load(Relaxed);
        s
    }
}

/// One shard worker's write-back: its controller, and the restores lookups asked for.
pub struct ShardSpill {
    controller: SpillController<ShardL1, StoreSink>,
    index: Arc<Index>,
    shard: usize,
}

impl ShardSpill {
    pub fn breaker(&self) -> &Arc<CircuitBreaker> {
        self.controller.breaker()
    }

    /// Counts a checkpoint commit that failed for real, or that the open breaker refused, in
    /// the write-back counters (the breaker itself was told by the commit's permit).
    pub fn count_commit(&self, failed: bool, rejected: bool) {
        let m = self.controller.metrics();
        SpillMetrics::add(&m.failures, usize::from(failed));
        SpillMetrics::add(&m.breaker_rejections, usize::from(rejected));
    }

    /// L1 is at its hard cap: take no events until a [`maintain`](Self::maintain) frees room.
    pub fn must_pause(&self) -> bool {
        self.controller.must_pause()
    }

    /// Whether [`maintain`](Self::maintain) has anything to write or drop: eviction, a
    /// backup flush, or restores (which may evict to make room).
    pub fn has_work(&self) -> bool {
        self.controller.has_work() || self.index.has_promotions(self.shard)
    }

    /// Eviction above the high watermark, the backup flush when due, then restores.
    pub fn maintain(&mut self) {
        self.controller.maintain();
        self.restore_requested();
    }

    /// Brings back the blocks lookups read from L2, making room by emergency eviction when
    /// L1 lacks it (never while the breaker is open, at most 60% of L1, about 1 s at most).
    /// What still does not fit below the high watermark stays in L2 (and is found there); the
    /// first blocks queued go first (query prefixes, the part every lookup needs).
    fn restore_requested(&mut self) {
        let keys = self.index.take_promotions(self.shard);
        if keys.is_empty() {
            return;
        }
        let need = Shard::restore_cost(&keys);
        let settings = self.controller.settings();
        let high = settings.high_bytes();
        let used = self.index.l1_usage_of(self.shard).bytes;
        if used + need > high
            && settings.emergency_evict_for_restore
            && let Err(e) = self
                .controller
                .emergency_evict_for_restore(used + need - high)
        {
            tracing::debug!(shard = self.shard, error = %e, "no room made for restores");
        }
        // Sound here: this worker is the only writer of the shard's L2 rows.
        self.index.restore_within(self.shard, keys, high);
    }
}
