//! Change tracking: what a shard changed since the durable store last took its changes.
//!
//! The tracker records *which* rows are dirty, never their values; [`Shard::take_changes`]
//! (see `shard/persist.rs`) reads the current values when the changes are taken. A [`ChangeSet`] is
//! therefore a set of assignments (row = current value, or row deleted): writing it twice, or
//! writing it over a store that already holds some of it, gives the same rows. That is what
//! makes "state at checkpoint k + replay of the events after k" equal to the full state.
//!
//! [`Shard::take_changes`]: super::Shard::take_changes

use super::hash::U64Map;
use super::holders::EngineIdx;
use crate::event::PartitionKey;
use crate::event::TierSet;
use smallvec::SmallVec;
use std::ops::Range;
use std::sync::Arc;

/// Dirty rows of one shard, by shard-local ids. Boxed behind an `Option` in the shard, so a
/// shard without tracking (the replay benchmark) pays one predictable branch per mutation.
#[derive(Default)]
pub(crate) struct Changes {
    /// Block key → the partition it was last changed in (a block key belongs to one partition:
    /// keys are namespaced by the partition seed).
    pub(crate) blocks: U64Map<u32>,
    /// (engine, partition, engine hash) entries of the engines' hash maps.
    pub(crate) maps: hashbrown::HashSet<(EngineIdx, u32, u64)>,
    /// (engine, partition) maps emptied by `ALL_CLEARED`: the store deletes their rows with one
    /// range delete instead of one tombstone per entry (a cleared engine may hold millions).
    pub(crate) cleared: hashbrown::HashSet<(EngineIdx, u32)>,
    /// Engines whose liveness or partition list changed.
    pub(crate) engines: hashbrown::HashSet<EngineIdx>,
    /// Partitions interned since the last take (in interning order).
    pub(crate) partitions: Vec<u32>,
    /// Engines that may have emptied for good (a clear left them no partition, an operator or
    /// the liveness TTL forgot them, a store that interned them was skipped): the next take
    /// retires those still empty (see `shard/reclaim.rs`). Any event of the engine cancels it.
    pub(crate) retire_engines: hashbrown::HashSet<EngineIdx>,
    /// Partitions that may have emptied for good (an engine's map in them was cleared, or a
    /// store that interned them was skipped): retired at the next take if still empty.
    pub(crate) retire_partitions: hashbrown::HashSet<u32>,
    /// Blocks and map entries that did not exist when they were first marked in this interval.
    /// L1 mirrors the store plus what is dirty, so such a row is not in the store either: if
    /// it is gone again when the changes are taken, no delete is written for it. Under churn
    /// (blocks stored and evicted within one checkpoint interval) this keeps RocksDB free of
    /// tombstones that every later reload would have to skip. With a bounded L1 this holds
    /// because an event reads an evicted row back from L2 before it marks it (so "new in L1"
    /// is "new"), and write-back clears the marks of the rows it writes.
    pub(crate) born_blocks: hashbrown::HashSet<u64>,
    pub(crate) born_maps: hashbrown::HashSet<(EngineIdx, u32, u64)>,
}

impl Changes {
    /// Marks block `key` dirty; `born`: it did not exist before this change.
    #[inline]
    pub(crate) fn block(&mut self, key: u64, pid: u32, born: bool) {
        if self.blocks.insert(key, pid).is_none() && born {
            self.born_blocks.insert(key);
        }
    }
    /// Marks a map entry dirty; `born`: it did not exist before this change.
    #[inline]
    pub(crate) fn map(&mut self, eid: EngineIdx, pid: u32, hash: u64, born: bool) {
        if self.maps.insert((eid, pid, hash)) && born {
            self.born_maps.insert((eid, pid, hash));
        }
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
            && self.maps.is_empty()
            && self.cleared.is_empty()
            && self.engines.is_empty()
            && self.partitions.is_empty()
            && self.retire_engines.is_empty()
            && self.retire_partitions.is_empty()
    }
}

/// The current value of one dirty block: its holders in this shard, or deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockChange {
    pub key: u64,
    /// Shard-local partition id (index into [`ChangeSet::partitions`]).
    pub partition: u32,
    /// Range of [`ChangeSet::holders`]; empty = the block is gone from this shard.
    pub holders: Range<u32>,
}

impl BlockChange {
    pub fn is_deleted(&self) -> bool {
        self.holders.is_empty()
    }
}

/// The current value of one dirty engine-map entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapChange {
    pub engine: EngineIdx,
    pub partition: u32,
    pub hash: u64,
    /// The block key the engine hash resolves to, or `None` if the entry is gone.
    pub block: Option<u64>,
}

/// The current value of one dirty engine row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineChange {
    pub engine: EngineIdx,
    pub last_seen_us: i64,
    /// Partitions the engine has a hash map in (possibly empty maps: `/v1/engines` lists them).
    pub partitions: SmallVec<[u32; 2]>,
}

/// What a shard changed since the last [`take_changes`](super::Shard::take_changes), as current
/// values (see the module docs). Engines and partitions are named by shard-local ids; the
/// name tables resolve them (the store maps names to its durable ids).
#[derive(Clone, Debug, Default)]
pub struct ChangeSet {
    /// Every live engine of the shard, by shard-local id (`Arc` clones, no string copies);
    /// `None` for a free slot or an engine retired by this set.
    pub engine_names: Vec<Option<Arc<str>>>,
    /// Every live partition of the shard, by shard-local id; `None` as for engines.
    pub partitions: Vec<Option<PartitionKey>>,
    /// Engines that emptied for good: their rows go (the store releases a durable id no shard
    /// names any more), and once the set is committed the shard frees their slots
    /// ([`Shard::reclaim`](super::Shard::reclaim)).
    pub retired_engines: Vec<(EngineIdx, Arc<str>)>,
    /// Partitions that emptied for good, as for engines.
    pub retired_partitions: Vec<(u32, PartitionKey)>,
    /// Partitions interned since the last take.
    pub new_partitions: Vec<u32>,
    pub engines: Vec<EngineChange>,
    /// (engine, partition) hash maps that were emptied by a clear: every map row of the pair
    /// is deleted *before* `maps` is applied (entries added after the clear are in `maps`).
    pub cleared: Vec<(EngineIdx, u32)>,
    pub maps: Vec<MapChange>,
    pub blocks: Vec<BlockChange>,
    /// Holders of every block in `blocks`, flat, as (shard-local engine id, tiers).
    pub holders: Vec<(EngineIdx, TierSet)>,
}

impl ChangeSet {
    /// Holders of `block` (empty if deleted).
    pub fn holders_of(&self, block: &BlockChange) -> &[(EngineIdx, TierSet)] {
        &self.holders[block.holders.start as usize..block.holders.end as usize]
    }

    pub fn is_empty(&self) -> bool {
        self.new_partitions.is_empty()
            && self.retired_engines.is_empty()
            && self.retired_partitions.is_empty()
            && self.engines.is_empty()
            && self.cleared.is_empty()
            && self.maps.is_empty()
            && self.blocks.is_empty()
    }
}
