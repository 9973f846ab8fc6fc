//! Applying one event to a shard: store (keying the chain, assigning memberships), remove
//! (resolving engine hashes through the engine's map) and clear, with the eviction-scope rule
//! deciding which adapter partitions a removal or a clear reaches.

use super::blocks::{Added, drop_membership};
use super::{MapEntry, PREFETCH_AHEAD, Shard, SkipReason};
use crate::event::TierSet;
use crate::event::{BlockContent, EngineHash, Event, EventKind};
use crate::index::hash;
use crate::index::holders::EngineIdx;
use crate::index::table::KeyTable;
use smallvec::SmallVec;

impl Shard {
    /// Applies one event routed to this shard; returns the memberships it added or removed.
    /// `now_us` stamps liveness when the event carries no timestamp.
    pub fn apply(&mut self, ev: &Event, now_us: i64) -> Result<usize, SkipReason> {
        self.clock_us = now_us;
        if ev.seq > 0 {
            self.note_seq(ev);
        }
        let seen = if ev.timestamp_us > 0 {
            ev.timestamp_us
        } else {
            now_us
        };
        match ev.kind {
            EventKind::Stored => self.store(ev, seen),
            EventKind::Removed => self.remove(ev, seen),
            EventKind::AllCleared => self.clear(ev, seen, false),
            EventKind::AdapterCleared => self.clear(ev, seen, true),
            EventKind::ReplicaUpdated => {
                let eid = self.intern_engine(&ev.engine)?;
                self.touch(eid, seen);
                Ok(0)
            }
            EventKind::Unknown(t) => Err(SkipReason::UnknownType(t)),
        }
    }

    /// Counts an event whose producer `seq` is below the highest applied for its engine. A
    /// producer may give a whole batch one seq, so only a strictly lower one counts.
    fn note_seq(&mut self, ev: &Event) {
        if let Some(&eid) = self.engine_ids.get(ev.engine.as_str()) {
            let e = &mut self.engines[eid as usize];
            if ev.seq < e.last_seq {
                e.seq_regressions += 1;
            } else {
                e.last_seq = ev.seq;
            }
        }
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
        let (engines, partitions) = (self.engine_ids.len(), self.partition_ids.len());
        let eid = self.intern_engine(&ev.engine)?;
        self.touch(eid, seen_us);
        let pid = self.intern_partition(&ev.partition);
        if let Some(c) = self.changes.as_deref_mut()
            && !c.retire_partitions.is_empty()
        {
            c.retire_partitions.remove(&pid); // stored into: not retired
        }
        let stored = self.store_chain(ev, eid, pid);
        if stored.is_err() {
            // A skipped store leaves nothing behind, not even the names it interned.
            if self.engine_ids.len() > engines {
                self.retire_engine_later(eid);
            }
            if self.partition_ids.len() > partitions {
                self.retire_partition_later(pid);
            }
        }
        stored
    }

    /// Keys `ev`'s chain and assigns its memberships to engine `eid` in partition `pid`.
    fn store_chain(&mut self, ev: &Event, eid: EngineIdx, pid: u32) -> Result<usize, SkipReason> {
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
                    let extras = crate::event::extra::digests(&ev.block_extras);
                    self.chain_start(eid, pid, ev.parent_hash).map(|prev| {
                        let bs = *block_size as usize;
                        hash::token_chain_keys(prev, token_ids, bs, &extras, &mut keys)
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
        let now = self.lru_now();
        // A store naming no tier lands on GPU.
        let tier = ev.tier.unwrap_or_default();
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
                engine.parts.push((pid, KeyTable::seeded()));
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
                    (eid, TierSet::ALL, engine_count),
                    &mut engine.holdings,
                    (part, pid),
                    changes.as_deref_mut(),
                    now,
                );
            }
            let added = table.add(key, eid, tier, engine_count, now);
            added.count(tier, &mut engine.holdings, part);
            if let Some(c) = changes.as_deref_mut().filter(|_| added != Added::Unchanged) {
                let born = matches!(added, Added::Holder { new_block: true });
                c.block(key, pid, born);
            }
        }
        self.key_buf = keys;
        Ok(n)
    }

    /// Removes `hashes` of engine `eid` from the engine's partition at `slot` of its parts:
    /// from the tiers named by `tiers` only, the whole membership with [`TierSet::ALL`].
    fn remove_in_part(
        &mut self,
        eid: EngineIdx,
        slot: usize,
        hashes: &[EngineHash],
        tiers: TierSet,
    ) -> usize {
        if tiers != TierSet::ALL {
            return self.remove_tiers_in_part(eid, slot, hashes, tiers);
        }
        let engine_count = self.engines.len();
        let now = self.lru_now();
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
                (eid, TierSet::ALL, engine_count),
                &mut engine.holdings,
                part,
                changes.as_deref_mut(),
                now,
            )
            .is_some() as usize;
        }
        *key_buf = keys;
        removed
    }

    /// [`Shard::remove_in_part`] for a removal that names its medium: each block loses that
    /// tier, and the engine's hash map keeps the entry while the block stays on another tier.
    fn remove_tiers_in_part(
        &mut self,
        eid: EngineIdx,
        slot: usize,
        hashes: &[EngineHash],
        tiers: TierSet,
    ) -> usize {
        let engine_count = self.engines.len();
        let now = self.lru_now();
        let Shard {
            table,
            engines,
            partitions,
            changes,
            ..
        } = self;
        let mut changes = changes.as_deref_mut();
        let engine = &mut engines[eid as usize];
        let (pid, map) = &mut engine.parts[slot];
        let pid = *pid;
        let part = &mut partitions[pid as usize];
        let mut removed = 0;
        for h in hashes {
            let Some(&MapEntry { block: key, .. }) = map.get(h.0) else {
                continue;
            };
            let dropped = drop_membership(
                table,
                key,
                (eid, tiers, engine_count),
                &mut engine.holdings,
                (&mut *part, pid),
                changes.as_deref_mut(),
                now,
            );
            removed += dropped.is_some_and(|r| r.before != r.after) as usize;
            // The entry goes once the engine holds the block on no tier (or, inconsistent,
            // never held it).
            if dropped.is_none_or(|r| r.after.is_empty()) {
                map.remove(h.0);
                if let Some(c) = changes.as_deref_mut() {
                    c.map(eid, pid, h.0, false);
                }
            }
        }
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
        // Every read first: a removal that reaches several adapters is never half applied.
        for &slot in &slots {
            let pid = self.engines[eid as usize].parts[slot].0;
            self.fault_in_removed(eid, pid, &ev.block_hashes)?;
        }
        // A removal naming no medium drops the block from every tier.
        let tiers = ev.tier.map_or(TierSet::ALL, TierSet::of);
        let mut removed = 0;
        for slot in slots {
            removed += self.remove_in_part(eid, slot, &ev.block_hashes, tiers);
        }
        Ok(removed)
    }

    /// Drops the engine from every adapter partition of the event's (tenant, model), or from
    /// the event's own partition only when `scoped`.
    fn clear(&mut self, ev: &Event, seen_us: i64, scoped: bool) -> Result<usize, SkipReason> {
        let Some(&eid) = self.engine_ids.get(ev.engine.as_str()) else {
            return Ok(0);
        };
        self.touch(eid, seen_us);
        let slots = self.reached_slots(eid, ev, scoped);
        // Entries of the cleared maps that live only in L2 come back first, so the drain
        // below sees every membership (their L2 rows go with the clear's range delete).
        for &slot in &slots {
            let pid = self.engines[eid as usize].parts[slot].0;
            self.fault_in_cleared(eid, pid)?;
        }
        let engine_count = self.engines.len();
        let now = self.lru_now();
        let mut removed = 0;
        // Highest slot first so removing a slot leaves the remaining indices valid.
        let mut left = SmallVec::<[u32; 2]>::new();
        for slot in slots.into_iter().rev() {
            let (pid, mut map) = self.engines[eid as usize].parts.swap_remove(slot);
            left.push(pid);
            let part = &mut self.partitions[pid as usize];
            let engine = &mut self.engines[eid as usize];
            let mut changes = self.changes.as_deref_mut();
            if let Some(c) = changes.as_deref_mut() {
                // The map's rows go with one range delete, not one mark per entry.
                c.cleared.insert((eid, pid));
            }
            for (_, MapEntry { block: key, .. }) in map.drain() {
                let holder = (eid, TierSet::ALL, engine_count);
                let part = (&mut *part, pid);
                removed += drop_membership(
                    &mut self.table,
                    key,
                    holder,
                    &mut engine.holdings,
                    part,
                    changes.as_deref_mut(),
                    now,
                )
                .is_some() as usize;
            }
        }
        // What the clear emptied is reclaimed (see `reclaim.rs`).
        for pid in left {
            self.retire_partition_later(pid);
        }
        if self.engines[eid as usize].parts.is_empty() {
            self.retire_engine_later(eid);
        }
        Ok(removed)
    }
}
