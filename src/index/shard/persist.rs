//! A shard's durability: change tracking (what the next checkpoint commit must write) and the
//! restore calls that rebuild a shard from stored rows at start. Restoring records no changes
//! (the rows are durable already).

use super::{MapEntry, Shard, SkipReason};
use crate::event::PartitionKey;
use crate::event::TierSet;
use crate::index::changes::{BlockChange, ChangeSet, EngineChange, MapChange};
use crate::index::holders::EngineIdx;
use std::sync::Arc;

/// Durability: change tracking for the store, and the restore API that rebuilds a shard from
/// stored rows. Restoring records no changes (the rows are already durable).
impl Shard {
    /// Starts recording every mutation for [`Shard::take_changes`]. Enable it on an empty
    /// shard or right after restoring one: state that exists before is not reported.
    pub fn enable_change_tracking(&mut self) {
        if self.changes.is_none() {
            self.changes = Some(Box::default());
        }
    }

    pub fn is_tracking_changes(&self) -> bool {
        self.changes.is_some()
    }

    /// Whether anything changed since the last take (always `false` without tracking).
    pub fn has_changes(&self) -> bool {
        self.changes.as_deref().is_some_and(|c| !c.is_empty())
    }

    /// The current value of every row changed since the last call (empty without tracking),
    /// and resets the tracker. Call it between events, in the thread that applies them, and
    /// commit the result with the source offsets applied so far.
    pub fn take_changes(&mut self) -> ChangeSet {
        self.advance_l2_epoch();
        if self.changes.is_none() {
            return ChangeSet::default();
        }
        let (retired_engines, retired_partitions) = self.take_retired();
        let mut engine_names: Vec<Option<Arc<str>>> = self
            .engines
            .iter()
            .map(|e| (!e.is_free()).then(|| e.name.clone()))
            .collect();
        let mut partitions: Vec<Option<PartitionKey>> = self
            .partitions
            .iter()
            .map(|p| (!p.free).then(|| p.key.clone()))
            .collect();
        for &(e, _) in &retired_engines {
            engine_names[e as usize] = None;
        }
        for &(p, _) in &retired_partitions {
            partitions[p as usize] = None;
        }
        let c = self.changes.as_deref_mut().expect("tracking");
        let mut out = ChangeSet {
            new_partitions: std::mem::take(&mut c.partitions)
                .into_iter()
                .filter(|&p| partitions[p as usize].is_some())
                .collect(),
            engine_names,
            partitions,
            retired_engines,
            retired_partitions,
            ..ChangeSet::default()
        };
        out.engines.reserve(c.engines.len());
        for eid in c.engines.drain() {
            if out.engine_names[eid as usize].is_none() {
                continue; // retired: its row goes instead
            }
            let e = &self.engines[eid as usize];
            out.engines.push(EngineChange {
                engine: eid,
                last_seen_us: e.last_seen_us,
                partitions: e.partition_ids().collect(),
            });
        }
        out.cleared.extend(c.cleared.drain());
        out.maps.reserve(c.maps.len());
        for (eid, pid, hash) in c.maps.drain() {
            let block = self.engines[eid as usize]
                .part(pid)
                .and_then(|m| m.get(hash))
                .map(|e| e.block);
            if block.is_none() && c.born_maps.contains(&(eid, pid, hash)) {
                continue; // created and gone within the interval: nothing to delete
            }
            out.maps.push(MapChange {
                engine: eid,
                partition: pid,
                hash,
                block,
            });
        }
        out.blocks.reserve(c.blocks.len());
        for (key, pid) in c.blocks.drain() {
            let start = out.holders.len() as u32;
            if let Some(b) = self.table.blocks.get(key) {
                out.holders
                    .extend(b.holders.as_slice().iter().map(|h| (h.engine(), h.tiers())));
            }
            if start == out.holders.len() as u32 && c.born_blocks.contains(&key) {
                continue; // created and gone within the interval: nothing to delete
            }
            out.blocks.push(BlockChange {
                key,
                partition: pid,
                holders: start..out.holders.len() as u32,
            });
        }
        c.born_blocks.clear();
        c.born_maps.clear();
        out
    }

    /// Marks the rows of `changes` (taken from this shard) dirty again, so the next
    /// [`Shard::take_changes`] reports their then-current values: what a failed commit calls
    /// so nothing it carried is lost. A no-op without tracking.
    pub fn requeue_changes(&mut self, changes: &ChangeSet) {
        let Some(c) = self.changes.as_deref_mut() else {
            return;
        };
        for &p in &changes.new_partitions {
            if !c.partitions.contains(&p) {
                c.partitions.push(p);
            }
        }
        c.engines.extend(changes.engines.iter().map(|e| e.engine));
        c.retire_engines
            .extend(changes.retired_engines.iter().map(|(e, _)| *e));
        for &(p, _) in &changes.retired_partitions {
            // Its row may never have been written: should it fill again, the next take writes it.
            c.retire_partitions.insert(p);
            if !c.partitions.contains(&p) {
                c.partitions.push(p);
            }
        }
        c.cleared.extend(changes.cleared.iter().copied());
        c.maps
            .extend(changes.maps.iter().map(|m| (m.engine, m.partition, m.hash)));
        for b in &changes.blocks {
            // A newer mark of the block is at least as current.
            c.blocks.entry(b.key).or_insert(b.partition);
        }
    }

    /// Interns `key` as a partition of this shard (restore), returning its shard-local id.
    pub fn restore_partition(&mut self, key: &PartitionKey) -> u32 {
        let tracking = self.changes.take();
        let pid = self.intern_partition(key);
        self.changes = tracking;
        pid
    }

    /// Interns engine `name` (restore) with its liveness and the partitions (ids from
    /// [`Shard::restore_partition`]) it has hash maps in. Engines restored this way are not
    /// ranked by name until [`Shard::rank_restored_engines`]: call it after the last one and
    /// before the shard answers a lookup (ranking per engine would cost O(E² log E)).
    pub fn restore_engine(
        &mut self,
        name: &str,
        last_seen_us: i64,
        partitions: &[u32],
    ) -> Result<EngineIdx, SkipReason> {
        let eid = self.intern_engine_unranked(name)?;
        let e = &mut self.engines[eid as usize];
        e.last_seen_us = e.last_seen_us.max(last_seen_us);
        for &pid in partitions {
            self.part_slot(eid, pid);
        }
        Ok(eid)
    }

    /// Ranks the engines restored so far by name, as lookups order them.
    pub fn rank_restored_engines(&mut self) {
        self.rank_engines();
    }

    /// Restores one entry of `eid`'s hash map in `pid` (ids from the restore calls above).
    pub fn restore_map_entry(&mut self, eid: EngineIdx, pid: u32, hash: u64, block: u64) {
        let slot = self.part_slot(eid, pid);
        self.engines[eid as usize].parts[slot]
            .1
            .insert(hash, MapEntry { block, used: 0 });
    }

    /// Starts loading the table slot of block `key` into the cache (a reload prefetches a
    /// group of rows before it restores them).
    #[inline]
    pub fn prefetch_block(&self, key: u64) {
        self.table.blocks.prefetch(key);
    }

    /// Makes room for about `blocks` blocks before a reload inserts them.
    pub fn reserve_blocks(&mut self, blocks: usize) {
        self.table.blocks.reserve(blocks);
    }

    /// Restores one membership: `eid` holds `block` (of partition `pid`) on `tiers`, with
    /// every counter (engine holdings, partition blocks and memberships, bitsets) kept as
    /// `apply` keeps them.
    pub fn restore_membership(&mut self, pid: u32, eid: EngineIdx, block: u64, tiers: TierSet) {
        let engine_count = self.engines.len();
        let engine = &mut self.engines[eid as usize];
        let part = &mut self.partitions[pid as usize];
        for tier in tiers.iter() {
            let added = self.table.add(block, eid, tier, engine_count, 0);
            added.count(tier, &mut engine.holdings, part);
        }
    }

    /// True if the shard holds nothing (no engines, partitions or blocks).
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty() && self.partitions.is_empty() && self.table.blocks.is_empty()
    }
}
