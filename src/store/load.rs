//! The warm reload: a shard's rows read back into its in-memory shard at start, up to its share
//! of the L1 budget (the rest stays in L2 and is counted, so every counter is exact once the
//! load is done).
//!
//! A load has two steps, so that an index of any size answers at once after a restart:
//! 1. [`Store::begin_load`] restores the shard's partitions and engines (a few rows each)
//!    before the service answers: lookups need them to name engines and to key queries;
//! 2. [`Store::finish_load`] restores engine-map and block rows, read in chunks of
//!    [`LOAD_CHUNK`] rows, each chunk applied through a [`LoadTarget`]. Behind a lock, the
//!    shard is write-locked for one chunk at a time and lookups go on between chunks; the
//!    shard is attached to L2 as spilled meanwhile, so a block not loaded yet is read from L2,
//!    which holds exactly what L1 will (nothing is applied to a shard until its load is done).
//!
//! [`Store::load_shard`] runs both at once on a shard the caller owns.

use super::codec::*;
use super::{LoadStats, Store, StoreError};
use crate::event::{PartitionKey, TierSet};
use crate::index::Shard;
use crate::index::holders::EngineIdx;
use crate::index::shard::{BLOCK_ENTRY_BYTES, MAP_ENTRY_BYTES};
use parking_lot::RwLock;
use smallvec::SmallVec;

/// Rows read per chunk of [`Store::finish_load`] (one write-lock hold of the shard: about a
/// millisecond of restores).
pub const LOAD_CHUNK: usize = 4096;

/// Memberships restored per prefetched group during a reload.
const RESTORE_GROUP: usize = 16;

/// Where [`Store::finish_load`] applies its chunks: a shard the caller owns, or one behind its
/// lock (taken for one chunk at a time).
pub trait LoadTarget {
    fn with_shard<R>(&mut self, f: impl FnOnce(&mut Shard) -> R) -> R;
}

impl LoadTarget for &mut Shard {
    fn with_shard<R>(&mut self, f: impl FnOnce(&mut Shard) -> R) -> R {
        f(self)
    }
}

impl LoadTarget for &RwLock<Shard> {
    fn with_shard<R>(&mut self, f: impl FnOnce(&mut Shard) -> R) -> R {
        f(&mut self.write())
    }
}

/// One shard's load between [`Store::begin_load`] and [`Store::finish_load`]: the durable →
/// shard-local id translation, the L1 budget spent, and what was restored so far.
#[derive(Debug)]
pub struct ShardLoad {
    shard: u16,
    l1_budget: u64,
    l1_bytes: u64,
    engines: hashbrown::HashMap<u32, u32>,
    partitions: hashbrown::HashMap<u32, u32>,
    stats: LoadStats,
}

/// An engine-map row: (durable engine, durable partition, engine hash, block key).
type MapRow = (u32, u32, u64, u64);

/// A block row: its key, durable partition and holders (durable engine, tiers).
struct BlockRow {
    key: u64,
    partition: u32,
    holders: SmallVec<[(u32, TierSet); 4]>,
}

impl Store {
    /// Rebuilds `shard`'s in-memory state into `into` (an empty shard) from its rows: blocks
    /// with their holders and tiers, engine maps, engines (liveness, partitions) and partition
    /// counters, so lookups, stats and engines after a restart equal those before it. Enable
    /// change tracking on `into` afterwards.
    pub fn load_shard(&self, shard: u16, into: &mut Shard) -> Result<LoadStats, StoreError> {
        self.load_shard_bounded(shard, into, u64::MAX)
    }

    /// [`Store::load_shard`] into an L1 of `l1_budget` bytes: engine-map rows may take half
    /// of it, block rows the rest; rows beyond are counted (blocks, memberships, tiers are
    /// L1 ∪ L2 counts) but stay in L2 (`left_in_l2`), for the shard to read through.
    pub fn load_shard_bounded(
        &self,
        shard: u16,
        into: &mut Shard,
        l1_budget: u64,
    ) -> Result<LoadStats, StoreError> {
        let mut load = self.begin_load(shard, into, l1_budget)?;
        self.finish_load(&mut load, into, |_| true)
    }

    /// Step 1 of a load (see the module docs): `shard`'s partitions and engines into `into`
    /// (an empty shard), for an L1 of `l1_budget` bytes.
    pub fn begin_load(
        &self,
        shard: u16,
        into: &mut Shard,
        l1_budget: u64,
    ) -> Result<ShardLoad, StoreError> {
        self.check_shard(shard)?;
        if !into.is_empty() {
            return Err(StoreError::ShardNotEmpty(shard));
        }
        let mut l = ShardLoad {
            shard,
            l1_budget,
            l1_bytes: 0,
            engines: hashbrown::HashMap::new(),
            partitions: hashbrown::HashMap::new(),
            stats: LoadStats::default(),
        };
        // Partitions, then engines (their rows name partitions).
        self.scan(
            CF_META,
            &shard_row_prefix(TAG_SHARD_PARTITION, shard),
            |k, _| {
                let id = u32_at(k, 3).ok_or_else(|| corrupt("partition row", k))?;
                l.partition(self, into, id).map(drop)
            },
        )?;
        let mut pids = Vec::new();
        self.scan(
            CF_META,
            &shard_row_prefix(TAG_SHARD_ENGINE, shard),
            |k, v| {
                let id = u32_at(k, 3).ok_or_else(|| corrupt("engine row", k))?;
                let last_seen = i64_at(v, 0).ok_or_else(|| corrupt("engine row", v))?;
                if !(v.len() - 8).is_multiple_of(4) {
                    return Err(corrupt("engine row", v));
                }
                pids.clear();
                for c in v[8..].chunks_exact(4) {
                    let durable = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
                    pids.push(l.partition(self, into, durable)?);
                }
                l.engine_row(self, into, id, last_seen, &pids).map(drop)
            },
        )?;
        into.rank_restored_engines();
        Ok(l)
    }

    /// Step 2 of a load (see the module docs): engine-map and block rows, chunk by chunk into
    /// `target`. `keep_going` sees the running totals after each chunk; `false` stops the load
    /// ([`StoreError::LoadInterrupted`]). Returns the load's totals.
    pub fn finish_load(
        &self,
        load: &mut ShardLoad,
        mut target: impl LoadTarget,
        mut keep_going: impl FnMut(&LoadStats) -> bool,
    ) -> Result<LoadStats, StoreError> {
        let prefix = load.shard.to_be_bytes();
        let mut after_chunk = |load: &ShardLoad| match keep_going(&load.stats) {
            true => Ok(()),
            false => Err(StoreError::LoadInterrupted(load.shard)),
        };
        self.scan_chunks(
            CF_MAPS,
            &prefix,
            |k, v, rows: &mut Vec<MapRow>| {
                let (Some(e), Some(p), Some(hash)) = (u32_at(k, 2), u32_at(k, 6), u64_at(k, 10))
                else {
                    return Err(corrupt("map key", k));
                };
                let block = u64_at(v, 0).ok_or_else(|| corrupt("map value", v))?;
                rows.push((e, p, hash, block));
                Ok(())
            },
            |rows| {
                target.with_shard(|into| load.restore_maps(self, into, rows))?;
                after_chunk(load)
            },
        )?;
        // RocksDB's estimate of the blocks column family's rows, shared evenly by the shards:
        // the block table is sized once instead of doubling ~20 times on the way.
        let estimate = self
            .db
            .property_int_value_cf(self.cf(CF_BLOCKS)?, "rocksdb.estimate-num-keys")?
            .unwrap_or(0);
        // Capped: the estimate counts overwritten rows too, and the table never shrinks. A
        // bounded load reserves only what its budget lets in: sizing the table for every row
        // in L2 would touch memory for all of them (the peak RSS of a spilled start-up).
        let fits = load.l1_budget.saturating_sub(load.l1_bytes) / BLOCK_ENTRY_BYTES;
        let per_shard = (estimate / u64::from(self.shards)).min(fits).min(1 << 26) as usize;
        target.with_shard(|into| into.reserve_blocks(per_shard));
        self.scan_chunks(
            CF_BLOCKS,
            &prefix,
            |k, v, rows: &mut Vec<BlockRow>| {
                let key = u64_at(k, 2).ok_or_else(|| corrupt("block key", k))?;
                let (partition, holders) = decode_block(v)?;
                rows.push(BlockRow {
                    key,
                    partition,
                    holders: holders.collect(),
                });
                Ok(())
            },
            |rows| {
                target.with_shard(|into| load.restore_blocks(self, into, rows))?;
                after_chunk(load)
            },
        )?;
        Ok(load.stats.clone())
    }
}

impl ShardLoad {
    /// What was restored so far.
    pub fn stats(&self) -> &LoadStats {
        &self.stats
    }

    /// Restores a chunk of engine-map rows (draining `rows`).
    fn restore_maps(
        &mut self,
        store: &Store,
        into: &mut Shard,
        rows: &mut Vec<MapRow>,
    ) -> Result<(), StoreError> {
        for (e, p, hash, block) in rows.drain(..) {
            let (eid, pid) = (
                self.engine(store, into, e)?,
                self.partition(store, into, p)?,
            );
            self.stats.map_entries += 1;
            if self.l1_bytes + MAP_ENTRY_BYTES > self.l1_budget / 2 {
                self.stats.left_in_l2 += 1;
                continue;
            }
            self.l1_bytes += MAP_ENTRY_BYTES;
            into.restore_map_entry(eid, pid, hash, block);
        }
        Ok(())
    }

    /// Restores a chunk of block rows (draining `rows`). Rows arrive in key order but land in
    /// random table slots: they are restored in groups whose slots are prefetched first, so
    /// the cache misses overlap. Every row of the chunk is whole in L1 when this returns.
    fn restore_blocks(
        &mut self,
        store: &Store,
        into: &mut Shard,
        rows: &mut Vec<BlockRow>,
    ) -> Result<(), StoreError> {
        let mut pending: SmallVec<[(u64, u32, EngineIdx, TierSet); RESTORE_GROUP * 2]> =
            SmallVec::new();
        for row in rows.drain(..) {
            let pid = self.partition(store, into, row.partition)?;
            self.stats.blocks += 1;
            if self.l1_bytes.saturating_add(BLOCK_ENTRY_BYTES) > self.l1_budget {
                self.stats.left_in_l2 += 1;
                for (i, &(e, tiers)) in row.holders.iter().enumerate() {
                    let eid = self.engine(store, into, e)?;
                    into.count_stored_membership(pid, eid, tiers, i == 0);
                    self.stats.memberships += 1;
                }
                continue;
            }
            self.l1_bytes += BLOCK_ENTRY_BYTES;
            into.prefetch_block(row.key);
            for &(e, tiers) in &row.holders {
                pending.push((row.key, pid, self.engine(store, into, e)?, tiers));
            }
            if pending.len() >= RESTORE_GROUP {
                self.restore_memberships(into, &mut pending);
            }
        }
        self.restore_memberships(into, &mut pending);
        Ok(())
    }

    /// Restores the buffered (block, partition, engine, tier) memberships, whose block slots
    /// were prefetched as they were read.
    fn restore_memberships(
        &mut self,
        into: &mut Shard,
        pending: &mut SmallVec<[(u64, u32, EngineIdx, TierSet); RESTORE_GROUP * 2]>,
    ) {
        for (block, pid, eid, tiers) in pending.drain(..) {
            into.restore_membership(pid, eid, block, tiers);
            self.stats.memberships += 1;
        }
    }

    fn partition(&mut self, store: &Store, into: &mut Shard, id: u32) -> Result<u32, StoreError> {
        if let Some(&pid) = self.partitions.get(&id) {
            return Ok(pid);
        }
        let key: PartitionKey = store
            .registry
            .lock()
            .partitions
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("partition id", &id.to_be_bytes()))?;
        let pid = into.restore_partition(&key);
        into.learn_durable_partition(pid, id);
        self.partitions.insert(id, pid);
        self.stats.partitions += 1;
        Ok(pid)
    }

    fn engine_row(
        &mut self,
        store: &Store,
        into: &mut Shard,
        id: u32,
        last_seen: i64,
        pids: &[u32],
    ) -> Result<u32, StoreError> {
        let name = store
            .registry
            .lock()
            .engines
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("engine id", &id.to_be_bytes()))?;
        let eid = into
            .restore_engine(&name, last_seen, pids)
            .map_err(|source| StoreError::Restore {
                shard: self.shard,
                source,
            })?;
        into.learn_durable_engine(eid, id);
        if self.engines.insert(id, eid).is_none() {
            self.stats.engines += 1;
        }
        Ok(eid)
    }

    /// An engine named by a map or block row. Its engine row is written in the same batch as
    /// the rows that first use it, so it is normally loaded already; if not, it is restored
    /// with no liveness rather than failing the load.
    fn engine(&mut self, store: &Store, into: &mut Shard, id: u32) -> Result<u32, StoreError> {
        match self.engines.get(&id) {
            Some(&eid) => Ok(eid),
            None => {
                let eid = self.engine_row(store, into, id, 0, &[])?;
                into.rank_restored_engines();
                Ok(eid)
            }
        }
    }
}
