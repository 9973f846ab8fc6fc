//! The shard's side of the spill: its tables are L1, the store's rows in RocksDB are L2, and
//! an entry may live in either. This file is the read side (reading through to L2, restores,
//! the durable ids rows are written with); `evict.rs` is what the spill controller calls.
//!
//! # What L2 holds, and when
//! Every checkpoint commit writes each row the shard changed since the last one (rows and
//! offsets in one batch), so L2 trails L1 by at most one commit interval. An entry of L1 is
//! *dirty* while it is marked in the change tracker, *clean* otherwise. Write-back (see
//! `evict.rs`) writes dirty entries before they leave L1, and clears their marks.
//!
//! # Reading through
//! Once anything has left L1 (`spilled`), an event that needs an entry L1 lacks reads it from
//! L2 first and keeps it in L1 as clean ("fault in"), before it changes anything; so event
//! application itself only ever sees resident entries, and the counters (blocks, memberships,
//! tiers), which always count L1 ∪ L2, stay exact. Lookups read L2 for blocks L1 lacks without
//! keeping them, and queue them for restore (`restore_on_read`), which the shard's worker runs
//! ([`Shard::fetch_restores`] under the read lock, so lookups go on during its L2 reads, then
//! [`Shard::insert_restored`] under the write lock): only the worker changes L1 and writes the
//! shard's L2 rows, so a restore can never resurrect a value older than one it wrote back, and
//! a block with a change pending (removed since the last commit) is never restored.

use super::evict::BLOCK_ENTRY_BYTES;
use super::lookup_l2::{count_read, read_counted};
use super::{Block, MapEntry, Shard, SkipReason};
use crate::event::TierSet;
use crate::index::holders::{DenseBits, EngineIdx, Holders, should_be_dense};
use crate::spill::{L2ReadError, L2Reader, StoredBlock};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

/// Blocks a lookup may queue for restore before the worker drains them; more are not queued.
const PROMOTE_QUEUE_MAX: usize = 4096;
/// Attempts of an L2 read an event depends on, before the event is skipped and counted.
const READ_ATTEMPTS: u32 = 3;

/// Knobs of the shard's spill (the `[writeback]` keys it needs itself).
#[derive(Clone, Copy, Debug)]
pub struct ReadThroughSettings {
    /// Lookups queue the L2-only blocks they read for [`Shard::restore_blocks`].
    pub restore_on_read: bool,
}

/// Read-path counters, shared by every shard of the index (for `/v1/stats` and `/metrics`).
#[derive(Debug, Default)]
pub struct ReadThroughStats {
    /// Point reads of L2 (lookups and faults).
    pub l2_reads: AtomicU64,
    /// Of those, reads that found the row.
    pub l2_hits: AtomicU64,
    /// Reads that failed (each retried; an event is skipped after three).
    pub l2_read_errors: AtomicU64,
    /// Blocks brought back into L1 for lookups (`restore_on_read`).
    pub restored: AtomicU64,
}

/// Shard-local ↔ durable (store-wide) ids of engines and partitions.
#[derive(Debug, Default)]
pub(super) struct DurableIds {
    engine_durable: Vec<u32>,
    engine_local: Vec<u32>,
    partition_durable: Vec<u32>,
    partition_local: Vec<u32>,
}

const NO_ID: u32 = u32::MAX;

fn learn(to: &mut Vec<u32>, from: &mut Vec<u32>, local: u32, durable: u32) {
    let set = |v: &mut Vec<u32>, i: u32, x: u32| {
        if v.len() <= i as usize {
            v.resize(i as usize + 1, NO_ID);
        }
        v[i as usize] = x;
    };
    set(to, local, durable);
    set(from, durable, local);
}

/// Undoes [`learn`] for `local`, if it has a durable id.
fn unlearn(to: &mut [u32], from: &mut [u32], local: u32) {
    if let Some(durable) = get(to, local) {
        to[local as usize] = NO_ID;
        if get(from, durable) == Some(local) {
            from[durable as usize] = NO_ID;
        }
    }
}

fn get(v: &[u32], i: u32) -> Option<u32> {
    v.get(i as usize).copied().filter(|&x| x != NO_ID)
}

impl DurableIds {
    pub(super) fn engine(&self, local: EngineIdx) -> Option<u32> {
        get(&self.engine_durable, local)
    }
    pub(super) fn engine_local(&self, durable: u32) -> Option<EngineIdx> {
        get(&self.engine_local, durable)
    }
    pub(super) fn partition(&self, local: u32) -> Option<u32> {
        get(&self.partition_durable, local)
    }
    /// Forgets engine slot `local`'s durable id (its slot was retired).
    pub(super) fn forget_engine(&mut self, local: EngineIdx) {
        unlearn(&mut self.engine_durable, &mut self.engine_local, local);
    }
    /// Forgets partition slot `local`'s durable id (its slot was retired).
    pub(super) fn forget_partition(&mut self, local: u32) {
        unlearn(
            &mut self.partition_durable,
            &mut self.partition_local,
            local,
        );
    }
}

/// The spill state of one shard (see the module docs).
pub(super) struct SpillState {
    pub(super) l2: Arc<dyn L2Reader>,
    pub(super) shard: u16,
    pub(super) settings: ReadThroughSettings,
    /// Something may live only in L2: reads fall through. False until the first eviction
    /// (or a load that left rows in L2), so a shard that fits pays nothing.
    pub(super) spilled: bool,
    /// The LRU clock; starts at 1 (0 marks "never stamped").
    pub(super) clock: AtomicU32,
    /// Where the next [`Shard::coldest`] sample starts: a block-table slot, and an (engine,
    /// part, slot) position among the engine maps.
    pub(super) block_hand: usize,
    pub(super) map_hand: (usize, usize, usize),
    /// Blocks lookups read from L2, for [`Shard::restore_blocks`].
    pub(super) promote: Mutex<Vec<u64>>,
    pub(super) stats: Arc<ReadThroughStats>,
    /// Counts evictions and commits started: the moments L2's rows of blocks L1 lacks can
    /// change (see `lookup_l2.rs`).
    pub(super) epoch: u64,
}

impl Shard {
    /// Puts `l2` behind this shard (number `shard` in the store). `spilled`: L2 may hold rows
    /// L1 lacks (a load under way, or one that left rows in L2; see [`Shard::end_load`]).
    /// Enable change tracking too (once loaded): dirtiness is the tracker's.
    pub fn attach_l2(
        &mut self,
        l2: Arc<dyn L2Reader>,
        shard: u16,
        settings: ReadThroughSettings,
        stats: Arc<ReadThroughStats>,
        spilled: bool,
    ) {
        self.spill = Some(Box::new(SpillState {
            l2,
            shard,
            settings,
            spilled,
            clock: AtomicU32::new(1),
            block_hand: 0,
            map_hand: (0, 0, 0),
            promote: Mutex::new(Vec::new()),
            stats,
            epoch: 0,
        }));
    }

    /// A load into this shard (attached as spilled while it ran) is done: it stays spilled
    /// only if rows were `left_in_l2`. Lookups' pending restores are dropped when not (every
    /// row is in L1), and plans made during the load are void.
    pub fn end_load(&mut self, left_in_l2: bool) {
        self.advance_l2_epoch();
        if let Some(t) = self.spill.as_deref_mut() {
            t.spilled = left_in_l2;
            if !left_in_l2 {
                t.promote.get_mut().clear();
            }
        }
    }

    /// Whether anything of this shard may live only in L2.
    #[inline]
    pub fn is_spilled(&self) -> bool {
        self.spill.as_deref().is_some_and(|t| t.spilled)
    }

    /// The LRU clock (0 without an L2 behind the shard: nothing is stamped).
    #[inline]
    pub(super) fn lru_now(&self) -> u32 {
        self.spill.as_deref().map_or(0, |t| t.clock.load(Relaxed))
    }

    /// Records that local engine `local` is durable engine `durable` (load, after commits).
    pub fn learn_durable_engine(&mut self, local: EngineIdx, durable: u32) {
        let d = &mut self.durable;
        learn(&mut d.engine_durable, &mut d.engine_local, local, durable);
    }

    /// Records that local partition `local` is durable partition `durable`.
    pub fn learn_durable_partition(&mut self, local: u32, durable: u32) {
        let d = &mut self.durable;
        learn(
            &mut d.partition_durable,
            &mut d.partition_local,
            local,
            durable,
        );
    }

    /// Whether a live engine or partition has no durable id yet (what the worker asks the
    /// store about after a commit).
    pub fn lacks_durable_ids(&self) -> bool {
        let d = &self.durable;
        let engine = |(i, e): (usize, &super::EngineState)| {
            !e.is_free() && get(&d.engine_durable, i as u32).is_none()
        };
        let partition = |(i, p): (usize, &super::PartitionState)| {
            !p.free && get(&d.partition_durable, i as u32).is_none()
        };
        self.engines.iter().enumerate().any(engine)
            || self.partitions.iter().enumerate().any(partition)
    }

    /// Counts one membership of a row a bounded load leaves in L2 (counters are L1 ∪ L2).
    pub fn count_stored_membership(
        &mut self,
        pid: u32,
        eid: EngineIdx,
        tiers: TierSet,
        first: bool,
    ) {
        self.engines[eid as usize]
            .holdings
            .change(TierSet::EMPTY, tiers);
        let part = &mut self.partitions[pid as usize];
        part.memberships += 1;
        part.blocks += first as u64;
        self.table.memberships += 1;
    }

    /// Whether block `key` changed since the last commit. Then L1 is authoritative: if it
    /// lacks the block, the block was deleted, and L2's row is the stale pre-delete value.
    pub(super) fn block_pending(&self, key: u64) -> bool {
        self.changes
            .as_deref()
            .is_some_and(|c| c.blocks.contains_key(&key))
    }

    /// Like [`Shard::block_pending`], for one engine-map entry (a pending clear of its map
    /// counts: L2 still holds the cleared entries until the commit's range delete).
    fn map_pending(&self, eid: EngineIdx, pid: u32, hash: u64) -> bool {
        self.changes
            .as_deref()
            .is_some_and(|c| c.maps.contains(&(eid, pid, hash)) || c.cleared.contains(&(eid, pid)))
    }

    /// Decodes L2's row of block `key` into `out` (local engine ids), queueing the block for
    /// restore. False if L2 has no such row (or the read failed: a lookup degrades to a
    /// shorter match rather than failing).
    pub(super) fn read_l2_for_lookup(&self, key: u64, out: &mut Holders) -> bool {
        self.lookup_l2_row(key, out, |t| Some(self.read_block(t, key)))
            .unwrap_or(false)
    }

    /// [`Shard::read_l2_for_lookup`] from memory only (see [`L2Reader::block_if_cached`]):
    /// `None` if L2's answer would have to wait on storage.
    pub(super) fn read_l2_cached_for_lookup(&self, key: u64, out: &mut Holders) -> Option<bool> {
        self.lookup_l2_row(key, out, |t| {
            Some(count_read(&t.stats, t.l2.block_if_cached(t.shard, key)?))
        })
    }

    /// Block `key`'s row as `read` gets it (`None`: it cannot), decoded into `out`.
    fn lookup_l2_row(
        &self,
        key: u64,
        out: &mut Holders,
        read: impl FnOnce(&SpillState) -> Option<Result<Option<StoredBlock>, L2ReadError>>,
    ) -> Option<bool> {
        let Some(t) = self.spill.as_deref() else {
            return Some(false);
        };
        if self.block_pending(key) {
            return Some(false);
        }
        let Ok(Some(row)) = read(t)? else {
            return Some(false);
        };
        self.take_l2_row(key, &row, out);
        Some(true)
    }

    /// A lookup's use of L2's `row` of block `key`: its holders into `out` (local ids), and
    /// the block queued for restore.
    pub(super) fn take_l2_row(&self, key: u64, row: &StoredBlock, out: &mut Holders) {
        *out = self.holders_of(row);
        if let Some(t) = self.spill.as_deref()
            && t.settings.restore_on_read
        {
            let mut q = t.promote.lock();
            if q.len() < PROMOTE_QUEUE_MAX {
                q.push(key);
            }
        }
    }

    fn read_block(&self, t: &SpillState, key: u64) -> Result<Option<StoredBlock>, L2ReadError> {
        read_counted(&*t.l2, t.shard, &t.stats, key)
    }

    /// Bumps the L2 epoch (an eviction, or a commit taking the changes).
    pub(super) fn advance_l2_epoch(&mut self) {
        if let Some(t) = self.spill.as_deref_mut() {
            t.epoch += 1;
        }
    }

    /// A stored row's holders in local ids (holders of engines this shard does not know,
    /// which a consistent store never has, are left out).
    fn holders_of(&self, row: &StoredBlock) -> Holders {
        let mut h = Holders::default();
        for &(d, tiers) in &row.holders {
            if let Some(e) = self.durable.engine_local(d) {
                h.set_tiers(e, tiers);
            }
        }
        h
    }

    /// Runs an L2 read an event depends on, retrying a failed one a few times; then the event
    /// is skipped (counted and logged by the caller), before it changed anything.
    fn read_for_event<T>(
        &self,
        mut read: impl FnMut(&SpillState) -> Result<T, L2ReadError>,
    ) -> Result<T, SkipReason> {
        let t = self.spill.as_deref().expect("reads only when spilled");
        let mut attempt = 1;
        loop {
            match read(t) {
                Ok(v) => return Ok(v),
                Err(e) if attempt >= READ_ATTEMPTS => {
                    return Err(SkipReason::L2ReadFailed(e.to_string()));
                }
                Err(e) => {
                    tracing::warn!(shard = t.shard, attempt, error = %e, "L2 read failed; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(5 << attempt));
                    attempt += 1;
                }
            }
        }
    }

    /// Brings block `key` into L1 from L2 if L1 lacks it (clean: L2 has its value).
    fn fault_in_block(&mut self, key: u64) -> Result<(), SkipReason> {
        if !self.is_spilled() || self.table.blocks.contains_key(key) || self.block_pending(key) {
            return Ok(());
        }
        let row = self.read_for_event(|t| self.read_block(t, key))?;
        if let Some(row) = row {
            let holders = self.holders_of(&row);
            self.insert_clean_block(key, holders);
        }
        Ok(())
    }

    fn insert_clean_block(&mut self, key: u64, holders: Holders) {
        if holders.is_empty() {
            return;
        }
        let now = self.lru_now();
        let engine_count = self.engines.len();
        let table = &mut self.table;
        table.heap_bytes += holders.heap_bytes();
        if should_be_dense(holders.len(), engine_count) {
            let d = DenseBits::from_holders(&holders, engine_count);
            table.heap_bytes += d.heap_bytes();
            table.dense.insert(key, d);
        }
        table.blocks.insert(
            key,
            Block {
                holders,
                used: AtomicU32::new(now),
            },
        );
    }

    /// Brings engine `eid`'s map entry for `hash` in partition `pid` into L1 if L1 lacks it;
    /// returns the block it names, wherever it lives.
    pub(super) fn fault_in_map(
        &mut self,
        eid: EngineIdx,
        pid: u32,
        hash: u64,
    ) -> Result<Option<u64>, SkipReason> {
        if let Some(e) = self.engines[eid as usize]
            .part(pid)
            .and_then(|m| m.get(hash))
        {
            return Ok(Some(e.block));
        }
        if !self.is_spilled() || self.map_pending(eid, pid, hash) {
            return Ok(None);
        }
        let (Some(de), Some(dp)) = (self.durable.engine(eid), self.durable.partition(pid)) else {
            return Ok(None); // never committed: nothing of it is in L2
        };
        let block = self.read_for_event(|t| {
            t.stats.l2_reads.fetch_add(1, Relaxed);
            t.l2.map_entry(t.shard, de, dp, hash)
        })?;
        if let Some(block) = block {
            let used = self.lru_now();
            let slot = self.part_slot(eid, pid);
            self.engines[eid as usize].parts[slot]
                .1
                .insert(hash, MapEntry { block, used });
        }
        Ok(block)
    }

    /// Before a store of `hashes` (keyed `keys`): the map entries it overwrites, the blocks it
    /// adds to, and any block an overwritten entry named.
    pub(super) fn fault_in_stored(
        &mut self,
        eid: EngineIdx,
        pid: u32,
        hashes: &[crate::event::EngineHash],
        keys: &[u64],
    ) -> Result<(), SkipReason> {
        if !self.is_spilled() {
            return Ok(());
        }
        for (h, &key) in hashes.iter().zip(keys) {
            if let Some(old) = self.fault_in_map(eid, pid, h.0)?.filter(|&b| b != key) {
                self.fault_in_block(old)?;
            }
            self.fault_in_block(key)?;
        }
        Ok(())
    }

    /// Before a removal of `hashes`: their map entries and the blocks those name.
    pub(super) fn fault_in_removed(
        &mut self,
        eid: EngineIdx,
        pid: u32,
        hashes: &[crate::event::EngineHash],
    ) -> Result<(), SkipReason> {
        if !self.is_spilled() {
            return Ok(());
        }
        for h in hashes {
            if let Some(block) = self.fault_in_map(eid, pid, h.0)? {
                self.fault_in_block(block)?;
            }
        }
        Ok(())
    }

    /// Before `ALL_CLEARED` of engine `eid` in `pid`: every entry of its map and every block
    /// those name.
    pub(super) fn fault_in_cleared(&mut self, eid: EngineIdx, pid: u32) -> Result<(), SkipReason> {
        if !self.is_spilled() {
            return Ok(());
        }
        let mut entries = Vec::new();
        let cleared = self
            .changes
            .as_deref()
            .is_some_and(|c| c.cleared.contains(&(eid, pid)));
        if let (false, Some(de), Some(dp)) = (
            cleared,
            self.durable.engine(eid),
            self.durable.partition(pid),
        ) {
            entries = self.read_for_event(|t| {
                let mut v = Vec::new();
                t.l2.map_entries(t.shard, de, dp, &mut |h, b| v.push((h, b)))
                    .map(|()| v)
            })?;
        }
        let slot = self.part_slot(eid, pid);
        let used = self.lru_now();
        let map = &mut self.engines[eid as usize].parts[slot].1;
        let pending = self.changes.as_deref();
        for &(hash, block) in &entries {
            // An entry changed since the last commit is L1's to say (absent: removed).
            let changed = pending.is_some_and(|c| c.maps.contains(&(eid, pid, hash)));
            if !changed && !map.contains_key(hash) {
                map.insert(hash, MapEntry { block, used });
            }
        }
        let blocks: Vec<u64> = map.iter().map(|(_, e)| e.block).collect();
        for block in blocks {
            self.fault_in_block(block)?;
        }
        Ok(())
    }

    /// Whether lookups found blocks only in L2 that wait to be restored.
    pub fn has_promotions(&self) -> bool {
        self.spill
            .as_deref()
            .is_some_and(|t| !t.promote.lock().is_empty())
    }

    /// Blocks lookups found only in L2 since the last call (`restore_on_read`), each once.
    pub fn take_promotions(&self) -> Vec<u64> {
        let mut keys = self
            .spill
            .as_deref()
            .map(|t| std::mem::take(&mut *t.promote.lock()))
            .unwrap_or_default();
        // A hot query reads the same L2 blocks again and again: each key once (first read
        // first), so the restore's cost (and any room made for it) is what it really needs.
        let mut seen = hashbrown::HashSet::with_capacity(keys.len());
        keys.retain(|k| seen.insert(*k));
        keys
    }

    /// Brings `keys` back into L1 from L2 (those L1 lacks); returns how many came back.
    /// Failed reads are skipped: a restore is an optimization. [`Shard::fetch_restores`] then
    /// [`Shard::insert_restored`] in one call, for a caller that holds the write lock anyway.
    pub fn restore_blocks(&mut self, keys: &[u64]) -> usize {
        let rows = self.fetch_restores(keys);
        self.insert_restored(rows)
    }

    /// The first half of a restore, under a *read* lock so lookups go on during the L2 reads:
    /// the rows of `keys` that only L2 holds (not resident, no change pending), in local ids.
    /// Sound only if the shard's L2 rows do not change before [`Shard::insert_restored`]:
    /// the shard's worker, which alone applies its events and writes its rows (commits and
    /// write-back), calls the two in turn.
    pub fn fetch_restores(&self, keys: &[u64]) -> Vec<(u64, Holders)> {
        let Some(t) = self.spill.as_deref() else {
            return Vec::new();
        };
        keys.iter()
            .filter(|&&k| !self.table.blocks.contains_key(k) && !self.block_pending(k))
            .filter_map(|&k| {
                let row = self.read_block(t, k).ok()??;
                Some((k, self.holders_of(&row)))
            })
            .collect()
    }

    /// The second half of a restore (write lock): inserts the fetched rows still absent from
    /// L1 and not changed meanwhile; returns how many came back.
    pub fn insert_restored(&mut self, rows: Vec<(u64, Holders)>) -> usize {
        let Some(t) = self.spill.as_deref() else {
            return 0;
        };
        let stats = t.stats.clone();
        let mut restored = 0;
        for (key, holders) in rows {
            if self.table.blocks.contains_key(key) || self.block_pending(key) {
                continue;
            }
            self.insert_clean_block(key, holders);
            restored += 1;
        }
        stats.restored.fetch_add(restored as u64, Relaxed);
        restored
    }

    /// The bytes restoring `keys` would add at most (every one absent, no spilled holders).
    pub fn restore_cost(keys: &[u64]) -> u64 {
        keys.len() as u64 * BLOCK_ENTRY_BYTES
    }
}
