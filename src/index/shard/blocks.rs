//! The block table: block key → holders, with bitsets for blocks many engines hold, and the
//! one operation that drops a membership with every counter kept in step.

use super::{Block, PartitionState};
use crate::event::{Tier, TierSet};
use crate::index::changes::Changes;
use crate::index::holders::{
    DenseBits, EngineIdx, Removed, SetOutcome, should_be_dense, should_stay_dense,
};
use crate::index::table::KeyTable;
use crate::index::tiers::Holdings;

/// Block → holders, plus the bitsets of dense blocks. Split from [`Shard`] so membership updates
/// can borrow it while an engine's hash map is borrowed too.
#[derive(Default)]
pub(super) struct BlockTable {
    /// Block key (partition-namespaced, see [`hash`]) → engines holding it.
    pub(super) blocks: KeyTable<Block>,
    /// Bitsets for blocks with many holders; see [`should_be_dense`]. A [`KeyTable`] too, so
    /// a lookup can prefetch a block's bitset slot along with its block slot.
    pub(super) dense: KeyTable<DenseBits>,
    pub(super) memberships: u64,
    /// Heap bytes of spilled holder lists and dense bitsets (the maps' own tables are measured
    /// from their capacity).
    pub(super) heap_bytes: usize,
}

/// What adding one membership did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Added {
    /// A new holder, and `new_block` says if the block itself is new.
    Holder {
        new_block: bool,
    },
    /// The engine held the block on these other tiers; now on `tier` too.
    Tier(TierSet),
    Unchanged,
}

impl Added {
    /// Counts what adding a membership on `tier` did into the engine's `holdings` and its
    /// partition's block and membership counts.
    pub(super) fn count(self, tier: Tier, holdings: &mut Holdings, part: &mut PartitionState) {
        match self {
            Added::Holder { new_block } => {
                holdings.change(TierSet::EMPTY, TierSet::of(tier));
                part.memberships += 1;
                part.blocks += new_block as u64;
            }
            Added::Tier(old) => holdings.change(old, old.with(tier)),
            Added::Unchanged => {}
        }
    }
}

impl BlockTable {
    /// Starts loading the slots a lookup of `key` reads: the block's and, when the shard has
    /// dense blocks, its bitset's.
    #[inline]
    pub(super) fn prefetch(&self, key: u64) {
        self.blocks.prefetch(key);
        if !self.dense.is_empty() {
            self.dense.prefetch(key);
        }
    }

    #[inline]
    pub(super) fn add(
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
                let tiers = match outcome {
                    SetOutcome::TierAdded(old) => old.with(tier),
                    _ => TierSet::of(tier),
                };
                d.set(engine, tiers);
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
            SetOutcome::TierAdded(old) => Added::Tier(old),
            SetOutcome::Unchanged => Added::Unchanged,
        }
    }

    /// Drops `tiers` of one membership ([`TierSet::ALL`]: all of it): what the engine held
    /// before and after, and whether the block is now gone. A block that stays is stamped
    /// `now` (the LRU clock), so its version moves: a write-back that sampled it before the
    /// removal cannot evict it with its old row (see `evict.rs`).
    #[inline]
    pub(super) fn remove(
        &mut self,
        key: u64,
        engine: EngineIdx,
        tiers: TierSet,
        engine_count: usize,
        now: u32,
    ) -> Option<(Removed, bool)> {
        let Some(slot) = self.blocks.slot(key) else {
            // Key 0 has no slot (see KeyTable); it takes the general path.
            let block = self.blocks.get_mut(key)?;
            let removed = block.holders.remove(engine, tiers)?;
            *block.used.get_mut() = now;
            if !removed.after.is_empty() {
                return Some((removed, false));
            }
            self.memberships -= 1;
            let gone = block.holders.is_empty();
            if gone {
                self.blocks.remove(key);
            }
            return Some((removed, gone));
        };
        let block = self.blocks.at_mut(slot);
        let holders = &mut block.holders;
        let heap_before = holders.heap_bytes();
        let removed = holders.remove(engine, tiers)?;
        *block.used.get_mut() = now;
        let len = holders.len();
        self.heap_bytes = self.heap_bytes + holders.heap_bytes() - heap_before;
        let left = removed.after.is_empty();
        self.memberships -= left as u64;
        // Only blocks with 16+ holders keep bitsets; skip the probe for the rest.
        if let Some(d) = (len + 1 >= 16).then(|| self.dense.get_mut(key)).flatten() {
            if !left || should_stay_dense(len, engine_count) {
                d.set(engine, removed.after);
            } else {
                self.heap_bytes -= d.heap_bytes();
                self.dense.remove(key);
            }
        }
        let gone = len == 0;
        if gone {
            self.blocks.remove_slot(slot);
        }
        Some((removed, gone))
    }
}

/// Drops tiers of one membership: `holder` = (engine, tiers to drop ([`TierSet::ALL`]: all of
/// it), shard engine count) in block `key`, at LRU time `now`, keeping the engine's holdings, the
/// partition's totals (`part` = (state, id)) and the change log in step. What the engine held
/// before and after, if it held the block.
#[inline]
pub(super) fn drop_membership(
    table: &mut BlockTable,
    key: u64,
    holder: (EngineIdx, TierSet, usize),
    holdings: &mut Holdings,
    part: (&mut PartitionState, u32),
    changes: Option<&mut Changes>,
    now: u32,
) -> Option<Removed> {
    let (eid, tiers, engine_count) = holder;
    let (removed, gone) = table.remove(key, eid, tiers, engine_count, now)?;
    let (part, pid) = part;
    holdings.change(removed.before, removed.after);
    if removed.after.is_empty() {
        part.memberships -= 1;
        part.blocks -= gone as u64;
    }
    if let Some(c) = changes.filter(|_| removed.before != removed.after) {
        c.block(key, pid, false);
    }
    Some(removed)
}
