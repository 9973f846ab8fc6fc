//! One shard of the in-memory index (L1): block memberships, the per-engine hash maps that
//! resolve removals, and the longest-prefix lookup.
//!
//! A shard is plain single-threaded Rust on owned data: the pipeline serializes writes to it
//! and lookups read it under a read lock. Everything an event changes is an *assignment* of a
//! (block, engine) membership, so replaying a suffix of the log onto a newer state converges.
//!
//! One [`Shard`] type, one concern per file:
//! - here: the data (blocks, engines and their hash maps, partitions), interning, counters;
//! - `blocks.rs`: the block table (holders, bitsets of dense blocks);
//! - `apply.rs`: stored / removed / cleared events, with the eviction-scope rule;
//! - `lookup.rs`: the longest-prefix walk;
//! - `lookup_l2.rs`: the L2 rows a lookup needs, read outside the shard's lock;
//! - `persist.rs`: change tracking for commits, and the restore calls of a reload;
//! - `spill.rs`: reading through to L2 (faults, restores, durable ids);
//! - `evict.rs`: what the spill controller calls (costs, coldest entries, conditional removal);
//! - `liveness.rs`: which engines have gone silent, and forgetting an engine;
//! - `reclaim.rs`: retiring engines and partitions that emptied, and reusing their slots.
mod liveness;
mod reclaim;

mod apply;
mod blocks;
mod evict;
mod lookup;
mod lookup_l2;
mod persist;
mod spill;

pub use evict::{BLOCK_ENTRY_BYTES, DirtyCursor, L1Key, MAP_ENTRY_BYTES};
pub use lookup::L2Access;
pub use lookup_l2::{L2Plan, L2Prefetch};
pub use spill::{ReadThroughSettings, ReadThroughStats};

use super::changes::Changes;
use super::hash;
use super::holders::{EngineIdx, Holders, MAX_ENGINES};
use super::table::KeyTable;
use super::tiers::{Holdings, TierMix};
use crate::event::TierSet;
use crate::event::{PartitionKey, Tier};
use blocks::BlockTable;
use smallvec::SmallVec;
use spill::{DurableIds, SpillState};
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

/// How many blocks ahead of the current one a loop prefetches table slots.
const PREFETCH_AHEAD: usize = 8;

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
    /// The fastest tier the engine holds its last matched block on.
    pub tier: Tier,
    /// How the matched blocks sit on the engine's tiers (see [`TierMix`]).
    pub mix: TierMix,
}

/// Stats of one partition (tenant, model, adapter) within a shard.
#[derive(Clone, Debug, Default)]
pub struct PartitionState {
    pub key: PartitionKey,
    /// Seed of this partition's chains (see [`hash::partition_seed`]).
    pub seed: u64,
    pub blocks: u64,
    pub memberships: u64,
    /// The slot is free (its partition was retired; see `reclaim.rs`).
    pub free: bool,
}

/// One entry of the block table: the block's holders, and when it was last used.
#[derive(Debug, Default)]
pub struct Block {
    pub holders: Holders,
    /// The shard's LRU clock at the last apply or lookup that touched the block (the
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
    /// When kvindex last applied an event of this engine, by its own clock (0: not since this
    /// process loaded it). Liveness goes by this, never by producers' timestamps.
    pub heard_us: i64,
    /// Highest producer `seq` applied in this process (0: none), and the events whose `seq`
    /// went below it (reordered or replayed by the producer; in memory only).
    pub last_seq: u64,
    pub seq_regressions: u64,
    /// Memberships held, in all and per tier.
    pub holdings: Holdings,
    /// Per partition the engine stored into: its engine hash → block key map. This resolves
    /// removals that carry only engine hashes, and is the reverse index that makes
    /// `ALL_CLEARED` cost the engine's own blocks rather than a scan of the shard.
    parts: SmallVec<[(u32, KeyTable<MapEntry>); 1]>,
}

impl EngineState {
    /// The slot is free (its engine was retired; see `reclaim.rs`): live engines have names.
    pub fn is_free(&self) -> bool {
        self.name.is_empty()
    }
    fn part(&self, pid: u32) -> Option<&KeyTable<MapEntry>> {
        self.parts.iter().find(|(p, _)| *p == pid).map(|(_, m)| m)
    }
    /// Partition ids this engine stored into.
    pub fn partition_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.parts.iter().map(|(p, _)| *p)
    }
    pub fn blocks_held(&self) -> u64 {
        self.holdings.blocks
    }
    /// Entries of the engine's hash map in each partition it stored into (diagnostics, tests).
    pub fn map_sizes(&self) -> impl Iterator<Item = (u32, usize)> + '_ {
        self.parts.iter().map(|(p, m)| (*p, m.len()))
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
    /// Slots of retired engines and partitions, reused before new ones are appended, so the
    /// tables stay as large as the most engines and partitions live at once.
    free_engines: Vec<EngineIdx>,
    free_partitions: Vec<u32>,
    /// Reused buffer for a chain's block keys.
    key_buf: Vec<u64>,
    /// Rows changed since the store last took them; `None` unless the service persists the
    /// shard. Boxed so an untracked shard pays one word and one predictable branch.
    changes: Option<Box<Changes>>,
    /// The L2 behind this shard's L1 (`None`: the shard holds everything in memory). See
    /// `shard/spill.rs`.
    spill: Option<Box<SpillState>>,
    /// Shard-local ↔ durable (store-wide) engine and partition ids, to read and write L2 rows.
    durable: DurableIds,
    /// kvindex's clock at the event being applied (see [`EngineState::heard_us`]).
    clock_us: i64,
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
            free_engines: Vec::new(),
            free_partitions: Vec::new(),
            key_buf: Vec::new(),
            changes: None,
            spill: None,
            durable: DurableIds::default(),
            clock_us: 0,
        }
    }

    fn touch(&mut self, eid: EngineIdx, seen_us: i64) {
        let e = &mut self.engines[eid as usize];
        e.last_seen_us = e.last_seen_us.max(seen_us);
        e.heard_us = e.heard_us.max(self.clock_us);
        // Every event that reaches an engine touches it, and every change of its partition list
        // (a new map, a clear) comes with an event of it: marking here covers both.
        if let Some(c) = self.changes.as_deref_mut() {
            c.engines.insert(eid);
            // An engine heard from is not retired (see `reclaim.rs`).
            if !c.retire_engines.is_empty() {
                c.retire_engines.remove(&eid);
            }
        }
    }

    fn intern_engine(&mut self, name: &str) -> Result<EngineIdx, SkipReason> {
        if let Some(&id) = self.engine_ids.get(name) {
            return Ok(id);
        }
        let id = self.intern_engine_unranked(name)?;
        self.rank_engines();
        Ok(id)
    }

    /// Adds engine `name` without ranking it: a restore interns every engine first and ranks
    /// them once ([`Shard::rank_engines`]), not once per engine.
    fn intern_engine_unranked(&mut self, name: &str) -> Result<EngineIdx, SkipReason> {
        if let Some(&id) = self.engine_ids.get(name) {
            return Ok(id);
        }
        debug_assert!(!name.is_empty(), "events name their engine");
        let state = EngineState {
            name: Arc::from(name),
            ..EngineState::default()
        };
        let id = match self.free_engines.pop() {
            Some(id) => {
                self.engines[id as usize] = state;
                Arc::make_mut(&mut self.names)[id as usize] =
                    self.engines[id as usize].name.clone();
                id
            }
            None if self.engines.len() as u32 >= MAX_ENGINES => {
                return Err(SkipReason::TooManyEngines);
            }
            None => {
                self.engines.push(state);
                let id = (self.engines.len() - 1) as EngineIdx;
                Arc::make_mut(&mut self.names).push(self.engines[id as usize].name.clone());
                id
            }
        };
        self.engine_ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// Recomputes every engine's rank by name, so lookups can order rows by engine id with
    /// integer compares. O(E log E) per new engine: engines join rarely (a fleet has thousands,
    /// not millions), lookups are constant.
    pub(super) fn rank_engines(&mut self) {
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
        let state = PartitionState {
            key: key.clone(),
            seed: hash::partition_seed(self.seed, key),
            ..PartitionState::default()
        };
        let id = match self.free_partitions.pop() {
            Some(id) => {
                self.partitions[id as usize] = state;
                id
            }
            None => {
                self.partitions.push(state);
                (self.partitions.len() - 1) as u32
            }
        };
        self.partition_ids.insert(key.clone(), id);
        if let Some(c) = self.changes.as_deref_mut() {
            c.partitions.push(id);
        }
        id
    }

    /// The slot of `pid` in `eid`'s parts, creating an empty map if needed.
    fn part_slot(&mut self, eid: EngineIdx, pid: u32) -> usize {
        let engine = &mut self.engines[eid as usize];
        match engine.parts.iter().position(|(p, _)| *p == pid) {
            Some(i) => i,
            None => {
                engine.parts.push((pid, KeyTable::seeded()));
                engine.parts.len() - 1
            }
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
    /// The shard's engines, leaving out free slots and engines retired at the next take.
    pub fn engines(&self) -> impl Iterator<Item = &EngineState> + '_ {
        self.engines
            .iter()
            .enumerate()
            .filter(|(i, e)| !e.is_free() && !self.retiring(*i as EngineIdx))
            .map(|(_, e)| e)
    }
    /// The shard's partitions, leaving out free slots and partitions retired at the next take.
    pub fn partitions(&self) -> impl Iterator<Item = &PartitionState> + '_ {
        self.partitions
            .iter()
            .enumerate()
            .filter(|(i, p)| !p.free && !self.retiring_partition(*i as u32))
            .map(|(_, p)| p)
    }
    /// Partition `pid` (a shard-local id, as [`EngineState::partition_ids`] gives them).
    pub fn partition(&self, pid: u32) -> &PartitionState {
        &self.partitions[pid as usize]
    }
    /// Engine and partition slots, live and free (the tables' sizes; tests and diagnostics).
    pub fn slots(&self) -> (usize, usize) {
        (self.engines.len(), self.partitions.len())
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
    /// The tiers `engine` holds block `key` on, if it holds it (tests and diagnostics).
    pub fn holder_tiers(&self, key: u64, engine: &str) -> Option<TierSet> {
        let eid = *self.engine_ids.get(engine)?;
        self.table.blocks.get(key)?.holders.tiers_of(eid)
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
