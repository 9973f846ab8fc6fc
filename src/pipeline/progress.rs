//! Progress per source partition: for each (source, partition) and each shard, the next offset
//! applied in memory and the next offset made durable in RocksDB.
//!
//! The offsets themselves are written by the shard workers (see `worker.rs`) in the same
//! RocksDB `WriteBatch` as the index rows they cover ([`crate::store::Store::commit`]); this
//! module is the in-memory mirror that everything else reads:
//! - the ingest loop acknowledges upstream (Kafka commit, NATS ack) only up to
//!   [`SourcePartition::durable_next`], the minimum over shards;
//! - readiness compares [`SourcePartition::applied_next`] with the high watermark seen at
//!   start;
//! - `/v1/stats` shows both, with the events applied and the duplicates skipped.
//!
//! Values are atomics written by one shard worker each and read by anyone: a reader may see
//! one shard's newer value beside another's older one, which only makes a minimum lag a
//! little behind, never run ahead of what is true.

use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};

/// Dense id of a (source, partition) within this process; indexes the workers' floor tables.
pub type PartId = u32;

/// "No offset": the shard has no row for this partition.
pub const NONE: i64 = i64::MIN;

/// One source partition's progress.
pub struct SourcePartition {
    pub source: Arc<str>,
    pub partition: i32,
    /// Per shard: next offset applied in memory ([`NONE`] = nothing yet).
    applied: Box<[AtomicI64]>,
    /// Per shard: next offset durable in RocksDB ([`NONE`] = no row).
    durable: Box<[AtomicI64]>,
    /// Events applied from this partition in this process.
    pub events_applied: AtomicU64,
    /// Events skipped because their shard had already applied their offset (redeliveries,
    /// re-reads after a restart or a rebalance).
    pub duplicates: AtomicU64,
    /// Whether [`crate::store::Store::begin_partition`] ran for it in this process.
    pub(crate) begun: AtomicBool,
}

fn min_of(values: &[AtomicI64]) -> Option<i64> {
    let mut min = i64::MAX;
    for v in values {
        let v = v.load(Relaxed);
        if v == NONE {
            return None;
        }
        min = min.min(v);
    }
    (!values.is_empty()).then_some(min)
}

impl SourcePartition {
    fn new(source: Arc<str>, partition: i32, shards: usize) -> SourcePartition {
        let none = || (0..shards).map(|_| AtomicI64::new(NONE)).collect();
        SourcePartition {
            source,
            partition,
            applied: none(),
            durable: none(),
            events_applied: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            begun: AtomicBool::new(false),
        }
    }

    /// Next offset every shard has applied (the minimum), `None` until every shard has one.
    pub fn applied_next(&self) -> Option<i64> {
        min_of(&self.applied)
    }

    /// Next offset every shard has made durable: what may be acknowledged upstream, and where
    /// a restart resumes.
    pub fn durable_next(&self) -> Option<i64> {
        min_of(&self.durable)
    }

    /// Next offset `shard` has applied ([`NONE`]: nothing).
    pub fn applied_at(&self, shard: usize) -> i64 {
        self.applied[shard].load(Relaxed)
    }

    pub(crate) fn set_applied(&self, shard: usize, next: i64) {
        self.applied[shard].store(next, Relaxed);
    }

    pub(crate) fn set_durable(&self, shard: usize, next: i64) {
        self.durable[shard].store(next, Relaxed);
    }

    /// Shards without a durable row get `next` (what `begin_partition` wrote for them).
    pub(crate) fn begin_at(&self, next: i64) {
        for d in self.durable.iter() {
            let _ = d.compare_exchange(NONE, next, Relaxed, Relaxed);
        }
    }
}

#[derive(Default)]
struct Table {
    parts: Vec<Arc<SourcePartition>>,
    ids: HashMap<(Arc<str>, i32), PartId>,
}

/// Every source partition this process knows, by [`PartId`].
pub struct Progress {
    shards: usize,
    table: RwLock<Table>,
}

impl Progress {
    pub fn new(shards: usize) -> Progress {
        Progress {
            shards,
            table: RwLock::new(Table::default()),
        }
    }

    /// The id of (source, partition), registering it on first use.
    pub fn id(&self, source: &str, partition: i32) -> PartId {
        let key: (Arc<str>, i32) = (source.into(), partition);
        if let Some(&id) = self.table.read().ids.get(&key) {
            return id;
        }
        let mut t = self.table.write();
        if let Some(&id) = t.ids.get(&key) {
            return id;
        }
        let id = t.parts.len() as PartId;
        t.parts.push(Arc::new(SourcePartition::new(
            key.0.clone(),
            partition,
            self.shards,
        )));
        t.ids.insert(key, id);
        id
    }

    /// How many partitions are registered (ids are `0..len`).
    pub fn len(&self) -> usize {
        self.table.read().parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The partition with id `id` (ids come from [`Progress::id`]).
    pub fn get(&self, id: PartId) -> Arc<SourcePartition> {
        self.table.read().parts[id as usize].clone()
    }

    /// The known partitions of `source`, by partition number.
    pub fn of_source(&self, source: &str) -> Vec<Arc<SourcePartition>> {
        let mut v: Vec<_> = self
            .table
            .read()
            .parts
            .iter()
            .filter(|p| &*p.source == source)
            .cloned()
            .collect();
        v.sort_by_key(|p| p.partition);
        v
    }

    /// `(partition, next offset every shard has applied)` for each partition of `source` that
    /// every shard has applied something of, by partition: everything below is in the index.
    pub fn applied_of(&self, source: &str) -> Vec<(i32, i64)> {
        let mut v: Vec<(i32, i64)> = self
            .table
            .read()
            .parts
            .iter()
            .filter(|p| &*p.source == source)
            .filter_map(|p| Some((p.partition, p.applied_next()?)))
            .collect();
        v.sort_unstable();
        v
    }

    /// Records a durable row read from the store at start: `shard` has applied and persisted
    /// everything of (source, partition) below `next`.
    pub fn restore(&self, shard: usize, source: &str, partition: i32, next: i64) -> PartId {
        let id = self.id(source, partition);
        let p = self.get(id);
        p.set_applied(shard, next);
        p.set_durable(shard, next);
        id
    }
}
