//! The shard's side of the two-tier index: its tables are L1, the store's rows in RocksDB are
//! L2, and an entry may live in either.
//!
//! # What L2 holds, and when
//! Every checkpoint commit writes each row the shard changed since the last one (DESIGN.md:
//! rows and offsets in one batch), so L2 trails L1 by at most one commit interval. An entry of
//! L1 is *dirty* while it is marked in the change tracker, *clean* otherwise. The write-back
//! controller (`crate::writeback`) sees this shard through [`crate::writeback::ShardL1`]:
//! - [`Shard::coldest`] samples the least recently used entries (blocks and engine-map entries
//!   alike), carrying the encoded row of each dirty one;
//! - once the controller has written those rows, [`Shard::evict_if_unchanged`] drops the
//!   entries whose stamp did not move and clears their dirty marks (their current value is in
//!   L2 now, so the next commit must neither rewrite nor delete them);
//! - [`Shard::dirty_after`] / [`Shard::mark_clean_if_unchanged`] are the backup flush.
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
//!
//! # LRU, approximately
//! Every entry carries a `u32` stamp of the shard's tier clock at its last use (blocks also on
//! lookups). [`Shard::coldest`] takes the oldest entries of a rotating sample of a few times
//! the batch size, as Redis's approximated LRU does: O(batch) per call, no list to maintain on
//! the hot path. The clock advances once per call, so an entry read while its batch is in
//! flight carries a newer stamp and [`Shard::evict_if_unchanged`] keeps it.

use super::{Block, MapEntry, Shard, SkipReason};
use crate::event::Tier;
use crate::index::holders::{DenseBits, EngineIdx, Holders, should_be_dense};
use crate::writeback::{DirtyPage, L2Row, Removal, Resident, Stamp};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

/// What one block-table entry counts against `l1_max_bytes`, before its holders' heap: its
/// slot, twice (the table is at most 13/16 full and grows by doubling).
pub const BLOCK_ENTRY_BYTES: u64 = 2 * std::mem::size_of::<(u64, Block)>() as u64;
/// What one engine-map entry counts against `l1_max_bytes` (see [`BLOCK_ENTRY_BYTES`]).
pub const MAP_ENTRY_BYTES: u64 = 2 * std::mem::size_of::<(u64, MapEntry)>() as u64;
/// Blocks a lookup may queue for restore before the worker drains them; more are not queued.
const PROMOTE_QUEUE_MAX: usize = 4096;
/// How many candidates [`Shard::coldest`] samples per entry it returns.
const SAMPLE_FACTOR: usize = 4;
/// Attempts of an L2 read an event depends on, before the event is skipped and counted.
const READ_ATTEMPTS: u32 = 3;

/// An L2 read failed (the store's error, as text: the index does not depend on the store).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct L2ReadError(pub String);

/// A block row as L2 stores it: durable partition id, holders by durable engine id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredBlock {
    pub partition: u32,
    pub holders: Vec<(u32, Tier)>,
}

/// The shard's view of L2: point reads of its rows, and the encoding of the rows write-back
/// writes (in the store's layout, with durable ids). Implemented by the store.
pub trait L2Reader: Send + Sync {
    fn block(&self, shard: u16, key: u64) -> Result<Option<StoredBlock>, L2ReadError>;
    fn map_entry(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        hash: u64,
    ) -> Result<Option<u64>, L2ReadError>;
    /// Calls `each(hash, block)` for every stored entry of one engine's map in one partition.
    fn map_entries(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        each: &mut dyn FnMut(u64, u64),
    ) -> Result<(), L2ReadError>;
    fn block_row(&self, shard: u16, key: u64, partition: u32, holders: &[(u32, Tier)]) -> L2Row;
    fn map_row(&self, shard: u16, engine: u32, partition: u32, hash: u64, block: u64) -> L2Row;
}

/// Knobs of the shard's tiering (the `[writeback]` keys it needs itself).
#[derive(Clone, Copy, Debug)]
pub struct TierSettings {
    /// Lookups queue the L2-only blocks they read for [`Shard::restore_blocks`].
    pub restore_on_read: bool,
}

/// Read-path counters, shared by every shard of the index (for `/v1/stats` and `/metrics`).
#[derive(Debug, Default)]
pub struct TierStats {
    /// Point reads of L2 (lookups and faults).
    pub l2_reads: AtomicU64,
    /// Of those, reads that found the row.
    pub l2_hits: AtomicU64,
    /// Reads that failed (each retried; an event is skipped after three).
    pub l2_read_errors: AtomicU64,
    /// Blocks brought back into L1 for lookups (`restore_on_read`).
    pub restored: AtomicU64,
}

/// An L1 entry's key as the write-back controller sees it. Ordered (blocks first, by key) for
/// the backup flush's cursor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum L1Key {
    Block(u64),
    Map {
        engine: EngineIdx,
        partition: u32,
        hash: u64,
    },
}

/// Where the backup flush resumes: after this key (`None`: from the start).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyCursor(Option<L1Key>);

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

fn get(v: &[u32], i: u32) -> Option<u32> {
    v.get(i as usize).copied().filter(|&x| x != NO_ID)
}

impl DurableIds {
    fn engine(&self, local: EngineIdx) -> Option<u32> {
        get(&self.engine_durable, local)
    }
    fn engine_local(&self, durable: u32) -> Option<EngineIdx> {
        get(&self.engine_local, durable)
    }
    fn partition(&self, local: u32) -> Option<u32> {
        get(&self.partition_durable, local)
    }
}

/// The tiering state of one shard (see the module docs).
pub(super) struct Tiers {
    l2: Arc<dyn L2Reader>,
    shard: u16,
    settings: TierSettings,
    /// Something may live only in L2: reads fall through. False until the first eviction
    /// (or a load that left rows in L2), so a shard that fits pays nothing.
    spilled: bool,
    /// The LRU clock; starts at 1 (0 marks "never stamped").
    clock: AtomicU32,
    /// Where the next [`Shard::coldest`] sample starts: a block-table slot, and an (engine,
    /// part, slot) position among the engine maps.
    block_hand: usize,
    map_hand: (usize, usize, usize),
    /// Blocks lookups read from L2, for [`Shard::restore_blocks`].
    promote: Mutex<Vec<u64>>,
    stats: Arc<TierStats>,
}

/// One sampled candidate of [`Shard::coldest`].
struct Candidate {
    key: L1Key,
    used: u32,
}

impl Shard {
    /// Puts `l2` behind this shard (number `shard` in the store). `spilled`: the shard was
    /// loaded with rows left in L2. Enable change tracking too: dirtiness is the tracker's.
    pub fn enable_tiers(
        &mut self,
        l2: Arc<dyn L2Reader>,
        shard: u16,
        settings: TierSettings,
        stats: Arc<TierStats>,
        spilled: bool,
    ) {
        self.tiers = Some(Box::new(Tiers {
            l2,
            shard,
            settings,
            spilled,
            clock: AtomicU32::new(1),
            block_hand: 0,
            map_hand: (0, 0, 0),
            promote: Mutex::new(Vec::new()),
            stats,
        }));
    }

    /// Whether anything of this shard may live only in L2.
    #[inline]
    pub fn is_spilled(&self) -> bool {
        self.tiers.as_deref().is_some_and(|t| t.spilled)
    }

    /// The tier clock (0 without tiers: nothing is stamped).
    #[inline]
    pub(super) fn tier_now(&self) -> u32 {
        self.tiers.as_deref().map_or(0, |t| t.clock.load(Relaxed))
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

    /// Local engines and partitions with no durable id yet (what the worker asks the store
    /// about after a commit).
    pub fn durable_ids_known(&self) -> (usize, usize) {
        let count = |v: &[u32], n: usize| (0..n as u32).filter(|&i| get(v, i).is_some()).count();
        (
            count(&self.durable.engine_durable, self.engines.len()),
            count(&self.durable.partition_durable, self.partitions.len()),
        )
    }

    /// Counts one membership of a row a bounded load leaves in L2 (counters are L1 ∪ L2).
    pub fn count_stored_membership(&mut self, pid: u32, eid: EngineIdx, tier: Tier, first: bool) {
        self.engines[eid as usize].tier_counts[tier as usize] += 1;
        let part = &mut self.partitions[pid as usize];
        part.memberships += 1;
        part.blocks += first as u64;
        self.table.memberships += 1;
    }

    /// Whether block `key` changed since the last commit. Then L1 is authoritative: if it
    /// lacks the block, the block was deleted, and L2's row is the stale pre-delete value.
    fn block_pending(&self, key: u64) -> bool {
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
        let Some(t) = self.tiers.as_deref() else {
            return false;
        };
        if self.block_pending(key) {
            return false;
        }
        let Ok(Some(row)) = self.read_block(t, key) else {
            return false;
        };
        *out = self.holders_of(&row);
        if t.settings.restore_on_read {
            let mut q = t.promote.lock();
            if q.len() < PROMOTE_QUEUE_MAX {
                q.push(key);
            }
        }
        true
    }

    fn read_block(&self, t: &Tiers, key: u64) -> Result<Option<StoredBlock>, L2ReadError> {
        t.stats.l2_reads.fetch_add(1, Relaxed);
        let r = t.l2.block(t.shard, key);
        match &r {
            Ok(Some(_)) => {
                t.stats.l2_hits.fetch_add(1, Relaxed);
            }
            Ok(None) => {}
            Err(_) => {
                t.stats.l2_read_errors.fetch_add(1, Relaxed);
            }
        }
        r
    }

    /// A stored row's holders in local ids (holders of engines this shard does not know,
    /// which a consistent store never has, are left out).
    fn holders_of(&self, row: &StoredBlock) -> Holders {
        let mut h = Holders::default();
        for &(d, tier) in &row.holders {
            if let Some(e) = self.durable.engine_local(d) {
                h.set(e, tier);
            }
        }
        h
    }

    /// Runs an L2 read an event depends on, retrying a failed one a few times; then the event
    /// is skipped (counted and logged by the caller), before it changed anything.
    fn read_for_event<T>(
        &self,
        mut read: impl FnMut(&Tiers) -> Result<T, L2ReadError>,
    ) -> Result<T, SkipReason> {
        let t = self.tiers.as_deref().expect("reads only when spilled");
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
        let now = self.tier_now();
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
            let used = self.tier_now();
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
        let used = self.tier_now();
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

    /// Bytes L1 counts against `l1_max_bytes` (see [`BLOCK_ENTRY_BYTES`]).
    pub fn l1_bytes(&self) -> u64 {
        self.table.blocks.len() as u64 * BLOCK_ENTRY_BYTES
            + self.table.heap_bytes as u64
            + self.map_entry_count() as u64 * MAP_ENTRY_BYTES
    }

    /// Whether block `key` is resident in L1 (tests, diagnostics).
    pub fn l1_blocks_contain(&self, key: u64) -> bool {
        self.table.blocks.contains_key(key)
    }

    /// Entries resident in L1: blocks and engine-map entries.
    pub fn l1_entries(&self) -> usize {
        self.table.blocks.len() + self.map_entry_count()
    }

    fn map_entry_count(&self) -> usize {
        self.engines
            .iter()
            .flat_map(|e| e.parts.iter())
            .map(|(_, m)| m.len())
            .sum()
    }

    /// What one resident entry counts, and its encoded row if it is dirty. `None`: the entry
    /// is not resident, or may not leave L1 yet (a dirty entry whose engine or partition has
    /// no durable id yet; a map entry whose map has a clear waiting for the next commit).
    fn resident(&self, key: L1Key) -> Option<Resident<L1Key>> {
        self.inspect(key, true)
    }

    /// The version [`Shard::resident`] would report for `key` (`None` where it reports no
    /// entry), without encoding a row: what the conditional removals compare stamps with.
    fn current_version(&self, key: L1Key) -> Option<u64> {
        self.inspect(key, false).map(|r| r.version)
    }

    /// `key` as the write-back controller sees it; `encode == false` leaves `dirty` empty but
    /// keeps every check that decides whether the entry is there for it at all (a dirty entry
    /// whose engine or partition has no durable id yet is not).
    fn inspect(&self, key: L1Key, encode: bool) -> Option<Resident<L1Key>> {
        let t = self.tiers.as_deref()?;
        let changes = self.changes.as_deref();
        match key {
            L1Key::Block(k) => {
                let b = self.table.blocks.get(k)?;
                let dense = self.table.dense.get(k).map_or(0, |d| d.heap_bytes());
                let bytes = BLOCK_ENTRY_BYTES + (b.holders.heap_bytes() + dense) as u64;
                let dirty = match changes.and_then(|c| c.blocks.get(&k)) {
                    None => None,
                    Some(&pid) if !encode => {
                        self.durable.partition(pid)?;
                        let holders = b.holders.as_slice();
                        if !holders
                            .iter()
                            .all(|h| self.durable.engine(h.engine()).is_some())
                        {
                            return None;
                        }
                        None
                    }
                    Some(&pid) => {
                        let part = self.durable.partition(pid)?;
                        let holders = b
                            .holders
                            .as_slice()
                            .iter()
                            .map(|h| Some((self.durable.engine(h.engine())?, h.tier())))
                            .collect::<Option<SmallVec<[_; 16]>>>()?;
                        Some(t.l2.block_row(t.shard, k, part, &holders))
                    }
                };
                Some(Resident {
                    key,
                    version: u64::from(b.used.load(Relaxed)),
                    bytes,
                    dirty,
                })
            }
            L1Key::Map {
                engine,
                partition,
                hash,
            } => {
                let e = self.engines[engine as usize].part(partition)?.get(hash)?;
                let dirty = match changes {
                    Some(c) if c.cleared.contains(&(engine, partition)) => return None,
                    Some(c) if c.maps.contains(&(engine, partition, hash)) => {
                        let (de, dp) = (
                            self.durable.engine(engine)?,
                            self.durable.partition(partition)?,
                        );
                        encode.then(|| t.l2.map_row(t.shard, de, dp, hash, e.block))
                    }
                    _ => None,
                };
                Some(Resident {
                    key,
                    version: u64::from(e.used),
                    bytes: MAP_ENTRY_BYTES,
                    dirty,
                })
            }
        }
    }

    /// Up to `max` of the least recently used entries (from a rotating sample; see the module
    /// docs), coldest first. Advances the tier clock, so a use from now on moves a stamp.
    pub fn coldest(&mut self, max: usize) -> Vec<Resident<L1Key>> {
        let Some(t) = self.tiers.as_deref_mut() else {
            return Vec::new();
        };
        let now = t.clock.fetch_add(1, Relaxed) + 1;
        let want = max.saturating_mul(SAMPLE_FACTOR).max(1);
        // At most this many slots are visited per table walk, so a sparse table cannot make
        // one call expensive.
        let budget = want * 16 + 64;
        let mut sample: Vec<Candidate> = Vec::with_capacity(2 * want);

        let blocks = &self.table.blocks;
        let cap = blocks.capacity();
        let mut hand = t.block_hand;
        let mut visited = 0;
        while cap > 0 && visited < budget.min(cap) && sample.len() < want {
            hand = (hand + 1) % cap;
            visited += 1;
            if let Some((k, b)) = blocks.entry_at(hand) {
                sample.push(Candidate {
                    key: L1Key::Block(k),
                    used: b.used.load(Relaxed),
                });
            }
        }
        t.block_hand = hand;

        let (mut e, mut p, mut s) = t.map_hand;
        let found_blocks = sample.len();
        let mut visited = 0;
        let total_maps: usize = self.engines.iter().map(|e| e.parts.len()).sum();
        while total_maps > 0 && visited < budget && sample.len() - found_blocks < want {
            let Some(engine) = self.engines.get(e) else {
                (e, p, s) = (0, 0, 0);
                continue;
            };
            let Some((pid, map)) = engine.parts.get(p) else {
                (e, p, s) = (e + 1, 0, 0);
                continue;
            };
            if s >= map.capacity() {
                (p, s) = (p + 1, 0);
                visited += 1;
                continue;
            }
            if let Some((hash, m)) = map.entry_at(s) {
                sample.push(Candidate {
                    key: L1Key::Map {
                        engine: e as EngineIdx,
                        partition: *pid,
                        hash,
                    },
                    used: m.used,
                });
            }
            s += 1;
            visited += 1;
        }
        t.map_hand = (e, p, s);

        // Oldest first: the largest age by the wrapping clock.
        sample.sort_unstable_by_key(|c| std::cmp::Reverse(now.wrapping_sub(c.used)));
        for c in sample.iter().take(max) {
            self.prefetch_entry(c.key);
        }
        sample
            .into_iter()
            .filter_map(|c| self.resident(c.key))
            .take(max)
            .collect()
    }

    /// Drops each entry whose stamp still equals `version`; its dirty mark goes with it (the
    /// controller wrote its row first, or discards it with `write_back_on_evict = false`).
    pub fn evict_if_unchanged(&mut self, victims: &[Stamp<L1Key>]) -> Removal {
        let mut r = Removal::default();
        // The victims were last touched before their batch went to RocksDB, so their slots
        // are likely out of cache by now: start every load before the first is needed.
        for v in victims {
            self.prefetch_entry(v.key);
        }
        for v in victims {
            match self.evict_one(v) {
                Some(bytes) => {
                    r.removed += 1;
                    r.bytes_freed += bytes;
                }
                None => r.kept += 1,
            }
        }
        if r.removed > 0
            && let Some(t) = self.tiers.as_deref_mut()
        {
            t.spilled = true;
        }
        r
    }

    /// Starts loading the table slots [`Shard::inspect`] reads for `key` (a block's slot and
    /// bitset slot; a map entry's slot).
    #[inline]
    fn prefetch_entry(&self, key: L1Key) {
        match key {
            L1Key::Block(k) => self.table.prefetch(k),
            L1Key::Map {
                engine,
                partition,
                hash,
            } => {
                if let Some(map) = self
                    .engines
                    .get(engine as usize)
                    .and_then(|e| e.part(partition))
                {
                    map.prefetch(hash);
                }
            }
        }
    }

    fn evict_one(&mut self, v: &Stamp<L1Key>) -> Option<u64> {
        let now = self.inspect(v.key, false)?;
        if now.version != v.version {
            return None;
        }
        match v.key {
            L1Key::Block(k) => {
                let slot = self.table.blocks.slot(k)?;
                let b = self.table.blocks.remove_slot(slot);
                self.table.heap_bytes -= b.holders.heap_bytes();
                if let Some(d) = self.table.dense.remove(k) {
                    self.table.heap_bytes -= d.heap_bytes();
                }
                if let Some(c) = self.changes.as_deref_mut() {
                    c.blocks.remove(&k);
                    c.born_blocks.remove(&k);
                }
            }
            L1Key::Map {
                engine,
                partition,
                hash,
            } => {
                let parts = &mut self.engines[engine as usize].parts;
                let (_, map) = parts.iter_mut().find(|(p, _)| *p == partition)?;
                map.remove(hash)?;
                if let Some(c) = self.changes.as_deref_mut() {
                    c.maps.remove(&(engine, partition, hash));
                    c.born_maps.remove(&(engine, partition, hash));
                }
            }
        }
        Some(now.bytes)
    }

    /// Up to `max` dirty resident entries after `cursor`, in key order (the backup flush).
    pub fn dirty_after(&self, cursor: &DirtyCursor, max: usize) -> DirtyPage<L1Key, DirtyCursor> {
        let Some(c) = self.changes.as_deref() else {
            return DirtyPage {
                entries: Vec::new(),
                next: None,
            };
        };
        let mut keys: Vec<L1Key> = c
            .blocks
            .keys()
            .map(|&k| L1Key::Block(k))
            .chain(c.maps.iter().map(|&(engine, partition, hash)| L1Key::Map {
                engine,
                partition,
                hash,
            }))
            .filter(|k| cursor.0.is_none_or(|after| *k > after))
            .collect();
        keys.sort_unstable();
        let mut entries = Vec::new();
        let mut next = None;
        for k in keys {
            if entries.len() == max {
                next = entries
                    .last()
                    .map(|e: &Resident<L1Key>| DirtyCursor(Some(e.key)));
                break;
            }
            if let Some(r) = self.resident(k).filter(|r| r.dirty.is_some()) {
                entries.push(r);
            }
        }
        DirtyPage { entries, next }
    }

    /// Clears the dirty mark of each entry whose stamp still equals `version` (its row is in
    /// L2 now); returns how many.
    pub fn mark_clean_if_unchanged(&mut self, written: &[Stamp<L1Key>]) -> usize {
        let mut marked = 0;
        for w in written {
            if self.current_version(w.key) != Some(w.version) {
                continue;
            }
            let Some(c) = self.changes.as_deref_mut() else {
                break;
            };
            match w.key {
                L1Key::Block(k) => {
                    c.blocks.remove(&k);
                    c.born_blocks.remove(&k);
                }
                L1Key::Map {
                    engine,
                    partition,
                    hash,
                } => {
                    c.maps.remove(&(engine, partition, hash));
                    c.born_maps.remove(&(engine, partition, hash));
                }
            }
            marked += 1;
        }
        marked
    }

    /// Blocks lookups found only in L2 since the last call (`restore_on_read`).
    pub fn take_promotions(&self) -> Vec<u64> {
        self.tiers
            .as_deref()
            .map(|t| std::mem::take(&mut *t.promote.lock()))
            .unwrap_or_default()
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
        let Some(t) = self.tiers.as_deref() else {
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
        let Some(t) = self.tiers.as_deref() else {
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
