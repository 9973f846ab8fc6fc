//! The warm reload: a shard's rows read back into an empty in-memory shard at start, up to its
//! share of the L1 budget (the rest stays in L2 and is counted, so every counter is exact).

use super::codec::*;
use super::{LoadStats, Store, StoreError};
use crate::event::{PartitionKey, TierSet};
use crate::index::Shard;
use crate::index::holders::EngineIdx;
use crate::index::shard::{BLOCK_ENTRY_BYTES, MAP_ENTRY_BYTES};

impl Store {
    /// Rebuilds `shard`'s in-memory state into `into` (an empty shard) from its rows: blocks
    /// with their holders and tiers, engine maps, engines (liveness, partitions) and partition
    /// counters, so lookups, stats and engines after a restart equal those before it. Enable
    /// change tracking on `into` afterwards. Shards load independently (in parallel if wanted).
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
        self.check_shard(shard)?;
        if !into.is_empty() {
            return Err(StoreError::ShardNotEmpty(shard));
        }
        let mut l = Loader {
            store: self,
            shard,
            into,
            engines: hashbrown::HashMap::new(),
            partitions: hashbrown::HashMap::new(),
            stats: LoadStats::default(),
        };
        // Partitions, then engines (their rows name partitions), then maps and blocks.
        self.scan(
            CF_META,
            &shard_row_prefix(TAG_SHARD_PARTITION, shard),
            |k, _| {
                let id = u32_at(k, 3).ok_or_else(|| corrupt("partition row", k))?;
                l.partition(id).map(drop)
            },
        )?;
        let mut pids = Vec::new();
        let mut l1_bytes = 0u64;
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
                    pids.push(l.partition(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))?);
                }
                l.engine_row(id, last_seen, &pids).map(drop)
            },
        )?;
        self.scan(CF_MAPS, &shard.to_be_bytes(), |k, v| {
            let (Some(e), Some(p), Some(hash)) = (u32_at(k, 2), u32_at(k, 6), u64_at(k, 10)) else {
                return Err(corrupt("map key", k));
            };
            let block = u64_at(v, 0).ok_or_else(|| corrupt("map value", v))?;
            let (eid, pid) = (l.engine(e)?, l.partition(p)?);
            l.stats.map_entries += 1;
            if l1_bytes + MAP_ENTRY_BYTES > l1_budget / 2 {
                l.stats.left_in_l2 += 1;
                return Ok(());
            }
            l1_bytes += MAP_ENTRY_BYTES;
            l.into.restore_map_entry(eid, pid, hash, block);
            Ok(())
        })?;
        // RocksDB's estimate of the blocks column family's rows, shared evenly by the shards:
        // the block table is sized once instead of doubling ~20 times on the way.
        let estimate = self
            .db
            .property_int_value_cf(self.cf(CF_BLOCKS)?, "rocksdb.estimate-num-keys")?
            .unwrap_or(0);
        // Capped: the estimate counts overwritten rows too, and the table never shrinks. A
        // bounded load reserves only what its budget lets in: sizing the table for every row
        // in L2 would touch memory for all of them (the peak RSS of a spilled start-up).
        let fits = l1_budget.saturating_sub(l1_bytes) / BLOCK_ENTRY_BYTES;
        let per_shard = (estimate / u64::from(self.shards)).min(fits).min(1 << 26) as usize;
        l.into.reserve_blocks(per_shard);
        // Rows arrive in key order but land in random table slots: they are restored in
        // groups whose slots are prefetched first, so the cache misses overlap.
        let mut pending: Vec<(u64, u32, EngineIdx, TierSet)> =
            Vec::with_capacity(RESTORE_GROUP * 2);
        self.scan(CF_BLOCKS, &shard.to_be_bytes(), |k, v| {
            let block = u64_at(k, 2).ok_or_else(|| corrupt("block key", k))?;
            let (p, holders) = decode_block(v)?;
            let pid = l.partition(p)?;
            l.stats.blocks += 1;
            if l1_bytes.saturating_add(BLOCK_ENTRY_BYTES) > l1_budget {
                l.stats.left_in_l2 += 1;
                for (i, (e, tier)) in holders.enumerate() {
                    let eid = l.engine(e)?;
                    l.into.count_stored_membership(pid, eid, tier, i == 0);
                    l.stats.memberships += 1;
                }
                return Ok(());
            }
            l1_bytes += BLOCK_ENTRY_BYTES;
            l.into.prefetch_block(block);
            for (e, tier) in holders {
                pending.push((block, pid, l.engine(e)?, tier));
            }
            if pending.len() >= RESTORE_GROUP {
                l.restore_memberships(&mut pending);
            }
            Ok(())
        })?;
        l.restore_memberships(&mut pending);
        Ok(l.stats)
    }
}

/// Memberships restored per prefetched group during a reload.
const RESTORE_GROUP: usize = 16;

/// Durable id → shard-local id translation during one [`Store::load_shard`].
struct Loader<'a> {
    store: &'a Store,
    shard: u16,
    into: &'a mut Shard,
    engines: hashbrown::HashMap<u32, u32>,
    partitions: hashbrown::HashMap<u32, u32>,
    stats: LoadStats,
}

impl Loader<'_> {
    /// Restores the buffered (block, partition, engine, tier) memberships, whose block slots
    /// were prefetched as they were read.
    fn restore_memberships(&mut self, pending: &mut Vec<(u64, u32, EngineIdx, TierSet)>) {
        for (block, pid, eid, tier) in pending.drain(..) {
            self.into.restore_membership(pid, eid, block, tier);
            self.stats.memberships += 1;
        }
    }

    fn partition(&mut self, id: u32) -> Result<u32, StoreError> {
        if let Some(&pid) = self.partitions.get(&id) {
            return Ok(pid);
        }
        let key: PartitionKey = self
            .store
            .registry
            .lock()
            .partitions
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("partition id", &id.to_be_bytes()))?;
        let pid = self.into.restore_partition(&key);
        self.into.learn_durable_partition(pid, id);
        self.partitions.insert(id, pid);
        self.stats.partitions += 1;
        Ok(pid)
    }

    fn engine_row(&mut self, id: u32, last_seen: i64, pids: &[u32]) -> Result<u32, StoreError> {
        let name = self
            .store
            .registry
            .lock()
            .engines
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("engine id", &id.to_be_bytes()))?;
        let eid = self
            .into
            .restore_engine(&name, last_seen, pids)
            .map_err(|source| StoreError::Restore {
                shard: self.shard,
                source,
            })?;
        self.into.learn_durable_engine(eid, id);
        if self.engines.insert(id, eid).is_none() {
            self.stats.engines += 1;
        }
        Ok(eid)
    }

    /// An engine named by a map or block row. Its engine row is written in the same batch as
    /// the rows that first use it, so it is normally loaded already; if not, it is restored
    /// with no liveness rather than failing the load.
    fn engine(&mut self, id: u32) -> Result<u32, StoreError> {
        match self.engines.get(&id) {
            Some(&eid) => Ok(eid),
            None => self.engine_row(id, 0, &[]),
        }
    }
}
