//! One shard of the in-memory index (L1): block memberships, the per-engine hash maps that
//! resolve removals, and the longest-prefix lookup.
//!
//! A shard is plain single-threaded Rust on owned data: the pipeline serializes writes to it
//! and lookups read it under a read lock. Everything an event changes is an *assignment* of a
//! (block, engine) membership, so replaying a suffix of the log onto a newer state converges.

use super::changes::{BlockChange, ChangeSet, Changes, EngineChange, MapChange};
use super::hash;
use super::holders::{
    DenseBits, EngineIdx, Holders, MAX_ENGINES, SetOutcome, should_be_dense, should_stay_dense,
};
use super::table::KeyTable;
use crate::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

mod tiers;
pub use tiers::{
    BLOCK_ENTRY_BYTES, DirtyCursor, L1Key, L2ReadError, L2Reader, MAP_ENTRY_BYTES, StoredBlock,
    TierSettings, TierStats,
};
use tiers::{DurableIds, Tiers};

/// Why a well-formed event could not be applied. Each is counted by `reason()` and logged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkipReason {
    #[error("unknown event type {0}")]
    UnknownType(i32),
    #[error(
        "parent hash {0:#x} was never stored by this engine (or already removed): the chain cannot be keyed"
    )]
    UnknownParent(u64),
    #[error("{tokens} token ids do not fill {blocks} blocks of {block_size}")]
    TokenCountMismatch {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    #[error("{digests} content digests for {blocks} blocks")]
    DigestCountMismatch { digests: usize, blocks: usize },
    #[error("token ids given with block_size 0")]
    ZeroBlockSize,
    #[error("shard holds the maximum number of engines")]
    TooManyEngines,
    #[error("the L2 read this event needs failed: {0}")]
    L2ReadFailed(String),
}

impl SkipReason {
    /// Stable label for `kvindex_events_skipped_total{reason=...}`.
    pub fn reason(&self) -> &'static str {
        match self {
            SkipReason::UnknownType(_) => "unknown_type",
            SkipReason::UnknownParent(_) => "unknown_parent",
            SkipReason::TokenCountMismatch { .. } => "token_count_mismatch",
            SkipReason::DigestCountMismatch { .. } => "digest_count_mismatch",
            SkipReason::ZeroBlockSize => "zero_block_size",
            SkipReason::TooManyEngines => "too_many_engines",
            SkipReason::L2ReadFailed(_) => "l2_read_failed",
        }
    }
}

/// One engine's row in a lookup answer, with shard-local engine id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMatch {
    pub engine: EngineIdx,
    /// Length of the engine's longest run of leading query blocks.
    pub matched: u32,
    /// Tier of the last matched block on this engine.
    pub tier: Tier,
}

/// Stats of one partition (tenant, model, adapter) within a shard.
#[derive(Clone, Debug, Default)]
pub struct PartitionState {
    pub key: PartitionKey,
    /// Seed of this partition's chains (see [`hash::partition_seed`]).
    pub seed: u64,
    pub blocks: u64,
    pub memberships: u64,
}

/// One entry of the block table: the block's holders, and when it was last used.
#[derive(Debug, Default)]
pub struct Block {
    pub holders: Holders,
    /// The shard's tier clock at the last apply or lookup that touched the block (the
    /// write-back's LRU order). Atomic so lookups, which hold only a read lock, can stamp it;
    /// 0 while the shard has no L2.
    used: AtomicU32,
}

/// One entry of an engine's hash map: the block key the engine's hash names, and when the
/// entry was last written (its LRU stamp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapEntry {
    pub block: u64,
    used: u32,
}

/// What a shard knows about one engine.
#[derive(Debug, Default)]
pub struct EngineState {
    /// Shared so lookup answers can name engines without copying strings.
    pub name: Arc<str>,
    pub last_seen_us: i64,
    /// Memberships held, by tier (`Tier as usize`).
    pub tier_counts: [u64; 3],
    /// Per partition the engine stored into: its engine hash → block key map. This resolves
    /// removals that carry only engine hashes, and is the reverse index that makes
    /// `ALL_CLEARED` cost the engine's own blocks rather than a scan of the shard.
    parts: SmallVec<[(u32, KeyTable<MapEntry>); 1]>,
}

impl EngineState {
    fn part(&self, pid: u32) -> Option<&KeyTable<MapEntry>> {
        self.parts.iter().find(|(p, _)| *p == pid).map(|(_, m)| m)
    }
    /// Partition ids this engine stored into.
    pub fn partition_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.parts.iter().map(|(p, _)| *p)
    }
    pub fn blocks_held(&self) -> u64 {
        self.tier_counts.iter().sum()
    }
    /// Entries of the engine's hash map in each partition it stored into (diagnostics, tests).
    pub fn map_sizes(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.parts.iter().map(|(p, m)| (*p, m.len()))
    }
}

/// Block → holders, plus the bitsets of dense blocks. Split from [`Shard`] so membership updates
/// can borrow it while an engine's hash map is borrowed too.
#[derive(Default)]
struct BlockTable {
    /// Block key (partition-namespaced, see [`hash`]) → engines holding it.
    blocks: KeyTable<Block>,
    /// Bitsets for blocks with many holders; see [`should_be_dense`]. A [`KeyTable`] too, so
    /// a lookup can prefetch a block's bitset slot along with its block slot.
    dense: KeyTable<DenseBits>,
    memberships: u64,
    /// Heap bytes of spilled holder lists and dense bitsets (the maps' own tables are measured
    /// from their capacity).
    heap_bytes: usize,
}

/// What adding one membership did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Added {
    /// A new holder, and `new_block` says if the block itself is new.
    Holder {
        new_block: bool,
    },
    TierChanged(Tier),
    Unchanged,
}

impl BlockTable {
    /// Starts loading the slots a lookup of `key` reads: the block's and, when the shard has
    /// dense blocks, its bitset's.
    #[inline]
    fn prefetch(&self, key: u64) {
        self.blocks.prefetch(key);
        if !self.dense.is_empty() {
            self.dense.prefetch(key);
        }
    }

    #[inline]
    fn add(
        &mut self,
        key: u64,
        engine: EngineIdx,
        tier: Tier,
        engine_count: usize,
        now: u32,
    ) -> Added {
        let (block, new_block) = self.blocks.get_or_default(key);
        *block.used.get_mut() = now;
        let holders = &mut block.holders;
        let heap_before = holders.heap_bytes();
        let outcome = holders.set(engine, tier);
        let len = holders.len();
        self.heap_bytes = self.heap_bytes + holders.heap_bytes() - heap_before;
        if len >= 16 && outcome != SetOutcome::Unchanged {
            if let Some(d) = self.dense.get_mut(key) {
                let before = d.heap_bytes();
                d.set(engine, tier);
                self.heap_bytes = self.heap_bytes + d.heap_bytes() - before;
            } else if should_be_dense(len, engine_count) {
                let d = DenseBits::from_holders(holders, engine_count);
                self.heap_bytes += d.heap_bytes();
                self.dense.insert(key, d);
            }
        }
        match outcome {
            SetOutcome::Added => {
                self.memberships += 1;
                Added::Holder { new_block }
            }
            SetOutcome::TierChanged(old) => Added::TierChanged(old),
            SetOutcome::Unchanged => Added::Unchanged,
        }
    }

    /// Removes one membership: the tier it had, and whether the block is now gone.
    #[inline]
    fn remove(&mut self, key: u64, engine: EngineIdx, engine_count: usize) -> Option<(Tier, bool)> {
        let Some(slot) = self.blocks.slot(key) else {
            // Key 0 has no slot (see KeyTable); it takes the general path.
            let holders = &mut self.blocks.get_mut(key)?.holders;
            let tier = holders.remove(engine)?;
            self.memberships -= 1;
            let gone = holders.is_empty();
            if gone {
                self.blocks.remove(key);
            }
            return Some((tier, gone));
        };
        let holders = &mut self.blocks.at_mut(slot).holders;
        let heap_before = holders.heap_bytes();
        let tier = holders.remove(engine)?;
        let len = holders.len();
        self.heap_bytes = self.heap_bytes + holders.heap_bytes() - heap_before;
        self.memberships -= 1;
        // Only blocks with 16+ holders keep bitsets; skip the probe for the rest.
        if let Some(d) = (len + 1 >= 16).then(|| self.dense.get_mut(key)).flatten() {
            if should_stay_dense(len, engine_count) {
                d.clear(engine);
            } else {
                self.heap_bytes -= d.heap_bytes();
                self.dense.remove(key);
            }
        }
        let gone = len == 0;
        if gone {
            self.blocks.remove_slot(slot);
        }
        Some((tier, gone))
    }
}

/// Drops the membership of `holder` = (engine, shard engine count) in block `key`, keeping the
/// engine's `tier_counts`, the partition's totals (`part` = (state, id)) and the change log in
/// step. True if the engine held the block.
#[inline]
fn drop_membership(
    table: &mut BlockTable,
    key: u64,
    holder: (EngineIdx, usize),
    tier_counts: &mut [u64; 3],
    part: (&mut PartitionState, u32),
    changes: Option<&mut Changes>,
) -> bool {
    let (eid, engine_count) = holder;
    let Some((tier, gone)) = table.remove(key, eid, engine_count) else {
        return false;
    };
    let (part, pid) = part;
    tier_counts[tier as usize] -= 1;
    part.memberships -= 1;
    part.blocks -= gone as u64;
    if let Some(c) = changes {
        c.block(key, pid, false);
    }
    true
}

/// Scratch bitsets for one lookup, reused per thread so a lookup allocates nothing but its
/// answer.
#[derive(Default)]
struct Bits {
    held: Vec<u64>,
    cpu: Vec<u64>,
    disk: Vec<u64>,
}

impl Bits {
    fn reset(&mut self, words: usize) {
        for v in [&mut self.held, &mut self.cpu, &mut self.disk] {
            v.clear();
            v.resize(words, 0);
        }
    }

    #[inline]
    fn tier_at(&self, w: usize, bit: u64) -> Tier {
        if self.cpu[w] & bit != 0 {
            Tier::Cpu
        } else if self.disk[w] & bit != 0 {
            Tier::Disk
        } else {
            Tier::Gpu
        }
    }

    /// Whether at least `n` engines are set (counting stops there).
    #[inline]
    fn holds_at_least(&self, n: usize) -> bool {
        let mut count = 0;
        for w in &self.held {
            count += w.count_ones() as usize;
            if count >= n {
                return true;
            }
        }
        false
    }

    /// Loads block 0's holders as the active set.
    fn load(&mut self, holders: &Holders, dense: Option<&DenseBits>) {
        match dense {
            Some(d) => {
                let n = d.words().min(self.held.len());
                self.held[..n].copy_from_slice(&d.held()[..n]);
                self.cpu[..n].copy_from_slice(&d.cpu()[..n]);
                self.disk[..n].copy_from_slice(&d.disk()[..n]);
            }
            None => {
                for h in holders.as_slice() {
                    let e = h.engine() as usize;
                    let (w, bit) = (e / 64, 1u64 << (e % 64));
                    self.held[w] |= bit;
                    match h.tier() {
                        Tier::Gpu => {}
                        Tier::Cpu => self.cpu[w] |= bit,
                        Tier::Disk => self.disk[w] |= bit,
                    }
                }
            }
        }
    }

    /// `self = active ∩ holders`, with the tiers of `holders`. `self` must be zeroed.
    #[inline]
    fn intersect(&mut self, active: &Bits, holders: &Holders, dense: Option<&DenseBits>) -> bool {
        let mut any = 0u64;
        match dense {
            Some(d) => {
                let n = d.words().min(self.held.len());
                for w in 0..n {
                    let held = active.held[w] & d.held()[w];
                    self.held[w] = held;
                    self.cpu[w] = held & d.cpu()[w];
                    self.disk[w] = held & d.disk()[w];
                    any |= held;
                }
            }
            None => {
                for h in holders.as_slice() {
                    let e = h.engine() as usize;
                    let (w, bit) = (e / 64, 1u64 << (e % 64));
                    if active.held[w] & bit != 0 {
                        self.held[w] |= bit;
                        any |= bit;
                        match h.tier() {
                            Tier::Gpu => {}
                            Tier::Cpu => self.cpu[w] |= bit,
                            Tier::Disk => self.disk[w] |= bit,
                        }
                    }
                }
            }
        }
        any != 0
    }
}

#[derive(Default)]
struct Scratch {
    active: Bits,
    next: Bits,
}

/// How many blocks ahead of the current one a loop prefetches table slots.
const PREFETCH_AHEAD: usize = 8;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Pushes a row for every engine set in `held` (and not in `keep`, if given).
#[inline]
fn emit(active: &Bits, keep: Option<&Bits>, matched: u32, out: &mut Vec<RawMatch>) {
    for w in 0..active.held.len() {
        let mut dropped = active.held[w] & !keep.map_or(0, |k| k.held[w]);
        while dropped != 0 {
            let b = dropped.trailing_zeros();
            let bit = 1u64 << b;
            out.push(RawMatch {
                engine: (w * 64) as u32 + b,
                matched,
                tier: active.tier_at(w, bit),
            });
            dropped &= dropped - 1;
        }
    }
}

/// One shard of the index. See the module docs.
pub struct Shard {
    /// Configured seed of every partition's chain.
    seed: u64,
    table: BlockTable,
    engines: Vec<EngineState>,
    engine_ids: hashbrown::HashMap<String, EngineIdx>,
    partitions: Vec<PartitionState>,
    partition_ids: hashbrown::HashMap<PartitionKey, u32>,
    /// `name_rank[e]`: position of engine `e`'s name among the shard's engines, sorted.
    name_rank: Vec<u32>,
    /// Engine names by id, shared with lookup answers (one refcount per answer, not per row);
    /// copied on write when an engine joins while an answer still holds the old list.
    names: Arc<Vec<Arc<str>>>,
    /// Reused buffer for a chain's block keys.
    key_buf: Vec<u64>,
    /// Rows changed since the store last took them; `None` unless the service persists the
    /// shard. Boxed so an untracked shard pays one word and one predictable branch.
    changes: Option<Box<Changes>>,
    /// The L2 behind this shard's L1 (`None`: the shard holds everything in memory). See
    /// `shard/tiers.rs`.
    tiers: Option<Box<Tiers>>,
    /// Shard-local ↔ durable (store-wide) engine and partition ids, to read and write L2 rows.
    durable: DurableIds,
}

impl Shard {
    pub fn new(seed: u64) -> Shard {
        Shard {
            seed,
            table: BlockTable::default(),
            engines: Vec::new(),
            engine_ids: hashbrown::HashMap::new(),
            partitions: Vec::new(),
            partition_ids: hashbrown::HashMap::new(),
            name_rank: Vec::new(),
            names: Arc::new(Vec::new()),
            key_buf: Vec::new(),
            changes: None,
            tiers: None,
            durable: DurableIds::default(),
        }
    }

    /// Applies one event routed to this shard; returns the memberships it added or removed.
    /// `now_us` stamps liveness when the event carries no timestamp.
    pub fn apply(&mut self, ev: &Event, now_us: i64) -> Result<usize, SkipReason> {
        let seen = if ev.timestamp_us > 0 {
            ev.timestamp_us
        } else {
            now_us
        };
        match ev.kind {
            EventKind::Stored => self.store(ev, seen),
            EventKind::Removed => self.remove(ev, seen),
            EventKind::AllCleared => self.clear(ev, seen),
            EventKind::ReplicaUpdated => {
                let eid = self.intern_engine(&ev.engine)?;
                self.touch(eid, seen);
                Ok(0)
            }
            EventKind::Unknown(t) => Err(SkipReason::UnknownType(t)),
        }
    }

    fn touch(&mut self, eid: EngineIdx, seen_us: i64) {
        let e = &mut self.engines[eid as usize];
        e.last_seen_us = e.last_seen_us.max(seen_us);
        // Every event that reaches an engine touches it, and every change of its partition list
        // (a new map, a clear) comes with an event of it: marking here covers both.
        if let Some(c) = self.changes.as_deref_mut() {
            c.engines.insert(eid);
        }
    }

    fn intern_engine(&mut self, name: &str) -> Result<EngineIdx, SkipReason> {
        if let Some(&id) = self.engine_ids.get(name) {
            return Ok(id);
        }
        if self.engines.len() as u32 >= MAX_ENGINES {
            return Err(SkipReason::TooManyEngines);
        }
        let id = self.engines.len() as EngineIdx;
        self.engines.push(EngineState {
            name: Arc::from(name),
            ..EngineState::default()
        });
        self.engine_ids.insert(name.to_string(), id);
        Arc::make_mut(&mut self.names).push(self.engines[id as usize].name.clone());
        self.rank_engines();
        Ok(id)
    }

    /// Recomputes every engine's rank by name, so lookups can order rows by engine id with
    /// integer compares. O(E log E) per new engine: engines join rarely (a fleet has thousands,
    /// not millions), lookups are constant.
    fn rank_engines(&mut self) {
        let mut order: Vec<EngineIdx> = (0..self.engines.len() as EngineIdx).collect();
        order.sort_unstable_by(|&a, &b| {
            self.engines[a as usize]
                .name
                .cmp(&self.engines[b as usize].name)
        });
        self.name_rank.resize(order.len(), 0);
        for (rank, &e) in order.iter().enumerate() {
            self.name_rank[e as usize] = rank as u32;
        }
    }

    fn intern_partition(&mut self, key: &PartitionKey) -> u32 {
        if let Some(&id) = self.partition_ids.get(key) {
            return id;
        }
        let id = self.partitions.len() as u32;
        self.partitions.push(PartitionState {
            key: key.clone(),
            seed: hash::partition_seed(self.seed, key),
            blocks: 0,
            memberships: 0,
        });
        self.partition_ids.insert(key.clone(), id);
        if let Some(c) = self.changes.as_deref_mut() {
            c.partitions.push(id);
        }
        id
    }

    /// The key the chain continues from: the partition seed for a root chain, else the key of
    /// the parent block as this engine stored it.
    fn chain_start(
        &self,
        eid: EngineIdx,
        pid: u32,
        parent: Option<EngineHash>,
    ) -> Result<u64, SkipReason> {
        match parent {
            None => Ok(self.partitions[pid as usize].seed),
            Some(p) => self.engines[eid as usize]
                .part(pid)
                .and_then(|m| m.get(p.0))
                .map(|e| e.block)
                .ok_or(SkipReason::UnknownParent(p.0)),
        }
    }

    fn store(&mut self, ev: &Event, seen_us: i64) -> Result<usize, SkipReason> {
        let eid = self.intern_engine(&ev.engine)?;
        self.touch(eid, seen_us);
        let pid = self.intern_partition(&ev.partition);
        let n = ev.block_hashes.len();
        if let Some(parent) = ev.parent_hash.filter(|_| self.is_spilled()) {
            self.fault_in_map(eid, pid, parent.0)?;
        }
        let mut keys = std::mem::take(&mut self.key_buf);
        keys.clear();
        let keyed = match &ev.content {
            BlockContent::HashesOnly => {
                let seed = self.partitions[pid as usize].seed;
                keys.extend(ev.block_hashes.iter().map(|h| hash::raw(seed, h.0)));
                Ok(())
            }
            BlockContent::Tokens {
                token_ids,
                block_size,
            } => {
                if *block_size == 0 {
                    Err(SkipReason::ZeroBlockSize)
                } else if token_ids.len() != n * *block_size as usize {
                    Err(SkipReason::TokenCountMismatch {
                        tokens: token_ids.len(),
                        blocks: n,
                        block_size: *block_size,
                    })
                } else {
                    self.chain_start(eid, pid, ev.parent_hash).map(|prev| {
                        hash::token_chain_keys(prev, token_ids, *block_size as usize, &mut keys)
                    })
                }
            }
            BlockContent::Digests(digests) => {
                if digests.len() != n {
                    Err(SkipReason::DigestCountMismatch {
                        digests: digests.len(),
                        blocks: n,
                    })
                } else {
                    self.chain_start(eid, pid, ev.parent_hash)
                        .map(|prev| hash::chain_keys(prev, digests.iter().copied(), &mut keys))
                }
            }
        };
        if let Err(e) = keyed.and_then(|()| self.fault_in_stored(eid, pid, &ev.block_hashes, &keys))
        {
            self.key_buf = keys;
            return Err(e);
        }
        let now = self.tier_now();

        let engine_count = self.engines.len();
        let Shard {
            table,
            engines,
            partitions,
            changes,
            ..
        } = self;
        let mut changes = changes.as_deref_mut();
        let engine = &mut engines[eid as usize];
        let map_slot = match engine.parts.iter().position(|(p, _)| *p == pid) {
            Some(i) => i,
            None => {
                engine.parts.push((pid, KeyTable::default()));
                engine.parts.len() - 1
            }
        };
        let part = &mut partitions[pid as usize];
        let map = &mut engine.parts[map_slot].1;
        for (h, &key) in ev.block_hashes.iter().zip(keys.iter()).take(PREFETCH_AHEAD) {
            map.prefetch(h.0);
            table.blocks.prefetch(key);
        }
        for (i, (h, &key)) in ev.block_hashes.iter().zip(keys.iter()).enumerate() {
            // Overlap the cache misses of blocks a few steps ahead with this one's work.
            if let (Some(ah), Some(&ak)) = (
                ev.block_hashes.get(i + PREFETCH_AHEAD),
                keys.get(i + PREFETCH_AHEAD),
            ) {
                map.prefetch(ah.0);
                table.blocks.prefetch(ak);
            }
            let previous = map
                .insert(
                    h.0,
                    MapEntry {
                        block: key,
                        used: now,
                    },
                )
                .map(|e| e.block);
            if let Some(c) = changes.as_deref_mut().filter(|_| previous != Some(key)) {
                c.map(eid, pid, h.0, previous.is_none());
            }
            if let Some(old) = previous.filter(|&old| old != key) {
                // The engine reused a hash for other content (e.g. it restarted with a new hash
                // seed without clearing): the old assignment is superseded.
                drop_membership(
                    table,
                    old,
                    (eid, engine_count),
                    &mut engine.tier_counts,
                    (part, pid),
                    changes.as_deref_mut(),
                );
            }
            let added = table.add(key, eid, ev.tier, engine_count, now);
            match added {
                Added::Holder { new_block } => {
                    engine.tier_counts[ev.tier as usize] += 1;
                    part.memberships += 1;
                    part.blocks += new_block as u64;
                }
                Added::TierChanged(old) => {
                    engine.tier_counts[old as usize] -= 1;
                    engine.tier_counts[ev.tier as usize] += 1;
                }
                Added::Unchanged => {}
            }
            if let Some(c) = changes.as_deref_mut().filter(|_| added != Added::Unchanged) {
                let born = matches!(added, Added::Holder { new_block: true });
                c.block(key, pid, born);
            }
        }
        self.key_buf = keys;
        Ok(n)
    }

    /// Removes `hashes` of engine `eid` from the engine's partition at `slot` of its parts.
    fn remove_in_part(&mut self, eid: EngineIdx, slot: usize, hashes: &[EngineHash]) -> usize {
        let engine_count = self.engines.len();
        let Shard {
            table,
            engines,
            partitions,
            key_buf,
            changes,
            ..
        } = self;
        let mut changes = changes.as_deref_mut();
        let engine = &mut engines[eid as usize];
        let (pid, map) = &mut engine.parts[slot];
        let pid = *pid;
        let part = &mut partitions[pid as usize];
        // Two passes, each prefetching ahead: resolve engine hashes to keys, then drop the
        // memberships. Misses of one pass overlap instead of alternating between two tables.
        let mut keys = std::mem::take(key_buf);
        keys.clear();
        for h in hashes.iter().take(PREFETCH_AHEAD) {
            map.prefetch(h.0);
        }
        for (i, h) in hashes.iter().enumerate() {
            if let Some(ahead) = hashes.get(i + PREFETCH_AHEAD) {
                map.prefetch(ahead.0);
            }
            if let Some(MapEntry { block: key, .. }) = map.remove(h.0) {
                keys.push(key);
                if let Some(c) = changes.as_deref_mut() {
                    c.map(eid, pid, h.0, false);
                }
            }
        }
        let mut removed = 0;
        for &key in keys.iter().take(PREFETCH_AHEAD) {
            table.blocks.prefetch(key);
        }
        for (i, &key) in keys.iter().enumerate() {
            if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
                table.blocks.prefetch(ahead);
            }
            let part = (&mut *part, pid);
            removed += drop_membership(
                table,
                key,
                (eid, engine_count),
                &mut engine.tier_counts,
                part,
                changes.as_deref_mut(),
            ) as usize;
        }
        *key_buf = keys;
        removed
    }

    /// Slots in `eid`'s parts of the partitions an event reaches: its own partition when
    /// scoped, every adapter of its (tenant, model) otherwise.
    fn reached_slots(&self, eid: EngineIdx, ev: &Event, scoped: bool) -> SmallVec<[usize; 4]> {
        let p = &ev.partition;
        self.engines[eid as usize]
            .parts
            .iter()
            .enumerate()
            .filter(|(_, (pid, _))| {
                let k = &self.partitions[*pid as usize].key;
                k.tenant == p.tenant && k.model == p.model && (!scoped || k.adapter == p.adapter)
            })
            .map(|(i, _)| i)
            .collect()
    }

    fn remove(&mut self, ev: &Event, seen_us: i64) -> Result<usize, SkipReason> {
        let Some(&eid) = self.engine_ids.get(ev.engine.as_str()) else {
            return Ok(0);
        };
        self.touch(eid, seen_us);
        let slots = self.reached_slots(eid, ev, ev.is_scoped());
        let mut removed = 0;
        for slot in slots {
            let pid = self.engines[eid as usize].parts[slot].0;
            self.fault_in_removed(eid, pid, &ev.block_hashes)?;
            removed += self.remove_in_part(eid, slot, &ev.block_hashes);
        }
        Ok(removed)
    }

    fn clear(&mut self, ev: &Event, seen_us: i64) -> Result<usize, SkipReason> {
        let Some(&eid) = self.engine_ids.get(ev.engine.as_str()) else {
            return Ok(0);
        };
        self.touch(eid, seen_us);
        let slots = self.reached_slots(eid, ev, false);
        // Entries of the cleared maps that live only in L2 come back first, so the drain
        // below sees every membership (their L2 rows go with the clear's range delete).
        for &slot in &slots {
            let pid = self.engines[eid as usize].parts[slot].0;
            self.fault_in_cleared(eid, pid)?;
        }
        let engine_count = self.engines.len();
        let mut removed = 0;
        // Highest slot first so removing a slot leaves the remaining indices valid.
        for slot in slots.into_iter().rev() {
            let (pid, mut map) = self.engines[eid as usize].parts.swap_remove(slot);
            let part = &mut self.partitions[pid as usize];
            let engine = &mut self.engines[eid as usize];
            let mut changes = self.changes.as_deref_mut();
            if let Some(c) = changes.as_deref_mut() {
                // The map's rows go with one range delete, not one mark per entry.
                c.cleared.insert((eid, pid));
            }
            for (_, MapEntry { block: key, .. }) in map.drain() {
                let holder = (eid, engine_count);
                let part = (&mut *part, pid);
                removed += drop_membership(
                    &mut self.table,
                    key,
                    holder,
                    &mut engine.tier_counts,
                    part,
                    changes.as_deref_mut(),
                ) as usize;
            }
        }
        Ok(removed)
    }

    /// [`Shard::lookup`], sorted by `matched` descending then engine name, and cut to the best
    /// `limit` rows (`usize::MAX`: all). Only the groups of equal `matched` that reach into the
    /// first `limit` rows are ordered, and of the last one only what is kept: an answer naming
    /// a whole fleet costs a sort of the rows returned, not of every engine that matched.
    pub fn lookup_sorted(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize) {
        let start = out.len();
        self.lookup_best(keys, out, limit);
        // `lookup_best` emits rows grouped by `matched` ascending: reversing the whole run puts the
        // groups in descending order, then each (small) group is ordered by name rank.
        let rows = &mut out[start..];
        rows.reverse();
        let rank = &self.name_rank;
        let key = |m: &RawMatch| rank[m.engine as usize];
        let mut i = 0;
        while i < rows.len() && i < limit {
            let matched = rows[i].matched;
            let end = i + rows[i..].partition_point(|m| m.matched == matched);
            let group = &mut rows[i..end];
            // Engines often join in name order (engine-000, engine-001, ...): then a reversed
            // group is just backwards, and reversing it again is the whole sort.
            group.reverse();
            let want = limit - i;
            if want < group.len() {
                group.select_nth_unstable_by_key(want - 1, key);
                group[..want].sort_unstable_by_key(key);
            } else if !group.is_sorted_by_key(key) {
                group.sort_unstable_by_key(key);
            }
            i = end;
        }
        out.truncate(start + (out.len() - start).min(limit));
    }

    /// For each engine holding `keys[0]`: the longest run of leading `keys` it holds. Rows are
    /// appended to `out` in ascending `matched` order.
    pub fn lookup(&self, keys: &[u64], out: &mut Vec<RawMatch>) {
        self.lookup_best(keys, out, usize::MAX);
    }

    /// [`Shard::lookup`], leaving out rows that cannot be among the best `limit`: an engine
    /// that drops out at block `i` while at least `limit` others still hold block `i` is
    /// beaten by each of them (they match more blocks), so its row is never emitted. A router
    /// asking for the best few of a large fleet then pays for the rows near the end of the
    /// match, not for one row per engine holding the first block.
    fn lookup_best(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize) {
        let Some((&first, _)) = keys.split_first() else {
            return;
        };
        let now = self.tier_now();
        // A block only L2 holds is decoded into a spare (see `resolve`).
        let (mut spare0, mut spare) = (Holders::default(), Holders::default());
        let Some(h0) = self.resolve(first, now, &mut spare0) else {
            return;
        };
        let words = self.engines.len().div_ceil(64).max(1);
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let Scratch { active, next } = &mut *guard;
            for &key in keys.iter().skip(1).take(PREFETCH_AHEAD) {
                self.table.prefetch(key);
            }
            active.reset(words);
            active.load(h0, self.dense_of(first, h0));
            for (i, key) in keys.iter().enumerate().skip(1) {
                if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
                    self.table.prefetch(ahead);
                }
                let Some(h) = self.resolve(*key, now, &mut spare) else {
                    emit(active, None, i as u32, out);
                    return;
                };
                next.reset(words);
                let any = next.intersect(active, h, self.dense_of(*key, h));
                if limit == usize::MAX || !next.holds_at_least(limit) {
                    emit(active, Some(next), i as u32, out);
                }
                if !any {
                    return;
                }
                std::mem::swap(active, next);
            }
            emit(active, None, keys.len() as u32, out);
        });
    }

    /// The holders of block `key`: L1's (stamping the entry as used at `now`), else L2's
    /// decoded into `spare` when the shard has spilled to L2.
    #[inline]
    fn resolve<'a>(&'a self, key: u64, now: u32, spare: &'a mut Holders) -> Option<&'a Holders> {
        if let Some(b) = self.table.blocks.get(key) {
            if now != 0 && b.used.load(Relaxed) != now {
                b.used.store(now, Relaxed);
            }
            return Some(&b.holders);
        }
        if !self.is_spilled() {
            return None;
        }
        self.read_l2_for_lookup(key, spare).then_some(&*spare)
    }

    #[inline]
    fn dense_of(&self, key: u64, holders: &Holders) -> Option<&DenseBits> {
        if holders.len() >= 16 {
            self.table.dense.get(key)
        } else {
            None
        }
    }

    /// Block keys of a query in `partition`, computed like stored chains (see [`hash`]).
    pub fn partition_seed(&self, partition: &PartitionKey) -> u64 {
        match self.partition_ids.get(partition) {
            Some(&pid) => self.partitions[pid as usize].seed,
            None => hash::partition_seed(self.seed, partition),
        }
    }

    pub fn engine_name(&self, eid: EngineIdx) -> &Arc<str> {
        &self.engines[eid as usize].name
    }
    /// Every engine name by id, shared (see the `names` field).
    pub fn engine_names(&self) -> &Arc<Vec<Arc<str>>> {
        &self.names
    }
    pub fn engines(&self) -> &[EngineState] {
        &self.engines
    }
    pub fn partitions(&self) -> &[PartitionState] {
        &self.partitions
    }
    /// Distinct blocks, in L1 and L2 alike.
    pub fn blocks(&self) -> u64 {
        self.partitions.iter().map(|p| p.blocks).sum()
    }
    pub fn memberships(&self) -> u64 {
        self.table.memberships
    }
    /// Blocks that currently keep lookup bitsets (held by many engines).
    pub fn dense_blocks(&self) -> usize {
        self.table.dense.len()
    }
    /// Whether `engine` holds block `key`, and at which tier (tests and diagnostics).
    pub fn holder_tier(&self, key: u64, engine: &str) -> Option<Tier> {
        let eid = *self.engine_ids.get(engine)?;
        self.table.blocks.get(key)?.holders.tier_of(eid)
    }

    /// Bytes of memory the shard's structures own (tables at capacity, spilled lists, bitsets,
    /// engine maps), for the L1 budget and the bytes-per-membership figure.
    pub fn memory_bytes(&self) -> usize {
        let engines: usize = self
            .engines
            .iter()
            .map(|e| {
                std::mem::size_of::<EngineState>()
                    + e.name.len()
                    + e.parts
                        .iter()
                        .map(|(_, m)| m.allocation_size())
                        .sum::<usize>()
            })
            .sum();
        self.table.blocks.allocation_size()
            + self.table.dense.allocation_size()
            + self.table.heap_bytes
            + engines
            + self.partitions.capacity() * std::mem::size_of::<PartitionState>()
    }
}

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
        let Some(c) = self.changes.as_deref_mut() else {
            return ChangeSet::default();
        };
        let mut out = ChangeSet {
            engine_names: self.engines.iter().map(|e| e.name.clone()).collect(),
            partitions: self.partitions.iter().map(|p| p.key.clone()).collect(),
            new_partitions: std::mem::take(&mut c.partitions),
            ..ChangeSet::default()
        };
        out.engines.reserve(c.engines.len());
        for eid in c.engines.drain() {
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
                    .extend(b.holders.as_slice().iter().map(|h| (h.engine(), h.tier())));
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
    /// [`Shard::restore_partition`]) it has hash maps in.
    pub fn restore_engine(
        &mut self,
        name: &str,
        last_seen_us: i64,
        partitions: &[u32],
    ) -> Result<EngineIdx, SkipReason> {
        let eid = self.intern_engine(name)?;
        let e = &mut self.engines[eid as usize];
        e.last_seen_us = e.last_seen_us.max(last_seen_us);
        for &pid in partitions {
            self.part_slot(eid, pid);
        }
        Ok(eid)
    }

    /// The slot of `pid` in `eid`'s parts, creating an empty map if needed.
    fn part_slot(&mut self, eid: EngineIdx, pid: u32) -> usize {
        let engine = &mut self.engines[eid as usize];
        match engine.parts.iter().position(|(p, _)| *p == pid) {
            Some(i) => i,
            None => {
                engine.parts.push((pid, KeyTable::default()));
                engine.parts.len() - 1
            }
        }
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

    /// Restores one membership: `eid` holds `block` (of partition `pid`) at `tier`, with every
    /// counter (engine tiers, partition blocks and memberships, bitsets) kept as `apply` keeps
    /// them.
    pub fn restore_membership(&mut self, pid: u32, eid: EngineIdx, block: u64, tier: Tier) {
        let engine_count = self.engines.len();
        let engine = &mut self.engines[eid as usize];
        let part = &mut self.partitions[pid as usize];
        match self.table.add(block, eid, tier, engine_count, 0) {
            Added::Holder { new_block } => {
                engine.tier_counts[tier as usize] += 1;
                part.memberships += 1;
                part.blocks += new_block as u64;
            }
            Added::TierChanged(old) => {
                engine.tier_counts[old as usize] -= 1;
                engine.tier_counts[tier as usize] += 1;
            }
            Added::Unchanged => {}
        }
    }

    /// True if the shard holds nothing (no engines, partitions or blocks).
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty() && self.partitions.is_empty() && self.table.blocks.is_empty()
    }
}
