//! Reclaiming what emptied: an engine a clear left with no partition (or that an operator or
//! the liveness TTL forgot), and a partition no engine stores into and no block is in, are
//! *retired*, so nothing keyed by producers' input (engine ids churn with deployments and dp
//! ranks, adapters come and go) grows without bound.
//!
//! Retiring is two-phase in a shard that persists its changes. The change set taken for a
//! commit names the engines and partitions still empty: their rows go with that commit (the
//! store releases a durable id that no shard names any more). Only once that commit succeeded
//! does [`Shard::reclaim`] free their slots, so no row written before can name a slot a new
//! engine then reuses. A failed commit hands the candidates back with the rest of its changes.
//! A shard that persists nothing frees an emptied slot at once.
//!
//! A freed slot is reused by the next engine or partition interned, which gets a new durable id
//! at its first commit and a fresh name rank and liveness: the engine table, the bitsets sized
//! by it and the durable-id maps stay as large as the most engines and partitions live at once.

use super::{PartitionState, Shard};
use crate::event::PartitionKey;
use crate::index::changes::ChangeSet;
use crate::index::holders::EngineIdx;
use std::sync::Arc;

/// What a take retired: (engine slot, name) and (partition slot, key) pairs.
pub(super) type Retired = (Vec<(EngineIdx, Arc<str>)>, Vec<(u32, PartitionKey)>);

impl Shard {
    /// Engine `eid` is live, holds nothing and has no map in any partition.
    fn engine_is_empty(&self, eid: EngineIdx) -> bool {
        let e = &self.engines[eid as usize];
        !e.is_free() && e.parts.is_empty() && e.holdings.blocks == 0
    }

    /// Partition `pid` is live, holds no membership and no engine has a map in it. A scan of
    /// the engines: it runs once per retirement candidate, never per event.
    fn partition_is_empty(&self, pid: u32) -> bool {
        let p = &self.partitions[pid as usize];
        !p.free && p.memberships == 0 && !self.engines.iter().any(|e| e.part(pid).is_some())
    }

    /// Engine `eid` may have emptied for good: if it has, it is freed now in a shard that
    /// persists nothing, else retired by the next take (an event of it cancels that). A
    /// candidate is empty until then: listings leave it out already.
    pub(super) fn retire_engine_later(&mut self, eid: EngineIdx) {
        if !self.engine_is_empty(eid) {
            return;
        }
        match self.changes.as_deref_mut() {
            Some(c) => {
                c.retire_engines.insert(eid);
            }
            None => self.free_engine(eid),
        }
    }

    /// As [`Shard::retire_engine_later`], for partition `pid` (a store into it cancels it).
    pub(super) fn retire_partition_later(&mut self, pid: u32) {
        if !self.partition_is_empty(pid) {
            return;
        }
        match self.changes.as_deref_mut() {
            Some(c) => {
                c.retire_partitions.insert(pid);
            }
            None => self.free_partition(pid),
        }
    }

    /// Forgets `engine` if it holds nothing (after the clears that drop it): the operator's and
    /// the liveness TTL's last step. False if the shard does not know it.
    pub fn retire_engine(&mut self, engine: &str) -> bool {
        match self.engine_ids.get(engine) {
            Some(&eid) => {
                self.retire_engine_later(eid);
                true
            }
            None => false,
        }
    }

    /// Whether engine `eid` waits to be retired by the next take.
    pub(super) fn retiring(&self, eid: EngineIdx) -> bool {
        self.changes
            .as_deref()
            .is_some_and(|c| c.retire_engines.contains(&eid))
    }

    /// Whether partition `pid` waits to be retired by the next take.
    pub(super) fn retiring_partition(&self, pid: u32) -> bool {
        self.changes
            .as_deref()
            .is_some_and(|c| c.retire_partitions.contains(&pid))
    }

    /// The take's part: the candidates still empty, each once. Candidates that filled again
    /// are dropped (the next emptying names them anew).
    pub(super) fn take_retired(&mut self) -> Retired {
        let Some(c) = self.changes.as_deref_mut() else {
            return Retired::default();
        };
        let (engines, partitions) = (
            std::mem::take(&mut c.retire_engines),
            std::mem::take(&mut c.retire_partitions),
        );
        let mut engines: Vec<EngineIdx> = engines
            .into_iter()
            .filter(|&e| self.engine_is_empty(e))
            .collect();
        let mut partitions: Vec<u32> = partitions
            .into_iter()
            .filter(|&p| self.partition_is_empty(p))
            .collect();
        engines.sort_unstable();
        partitions.sort_unstable();
        (
            engines
                .into_iter()
                .map(|e| (e, self.engines[e as usize].name.clone()))
                .collect(),
            partitions
                .into_iter()
                .map(|p| (p, self.partitions[p as usize].key.clone()))
                .collect(),
        )
    }

    /// After the commit of `changes` (taken from this shard) succeeded: frees the slots of the
    /// engines and partitions it retired. Their durable ids are forgotten in any case (the
    /// store may have released them); one that an event reached since the take stays live and
    /// is written anew, under a new durable id, by the next commit.
    pub fn reclaim(&mut self, changes: &ChangeSet) {
        for (eid, name) in &changes.retired_engines {
            if self.engines[*eid as usize].name != *name {
                continue;
            }
            self.durable.forget_engine(*eid);
            if self.engine_is_empty(*eid) && !self.engine_dirty(*eid) {
                self.free_engine(*eid);
            } else if let Some(c) = self.changes.as_deref_mut() {
                c.engines.insert(*eid);
            }
        }
        for (pid, key) in &changes.retired_partitions {
            if self.partitions[*pid as usize].key != *key {
                continue;
            }
            self.durable.forget_partition(*pid);
            if self.partition_is_empty(*pid) {
                self.free_partition(*pid);
            } else if let Some(c) = self.changes.as_deref_mut()
                && !c.partitions.contains(pid)
            {
                c.partitions.push(*pid);
            }
        }
    }

    fn engine_dirty(&self, eid: EngineIdx) -> bool {
        self.changes
            .as_deref()
            .is_some_and(|c| c.engines.contains(&eid))
    }

    fn free_engine(&mut self, eid: EngineIdx) {
        let old = std::mem::take(&mut self.engines[eid as usize]);
        self.engine_ids.remove(&*old.name);
        let free: Arc<str> = self.engines[eid as usize].name.clone();
        Arc::make_mut(&mut self.names)[eid as usize] = free;
        self.durable.forget_engine(eid);
        self.free_engines.push(eid);
    }

    fn free_partition(&mut self, pid: u32) {
        let old = std::mem::replace(
            &mut self.partitions[pid as usize],
            PartitionState {
                free: true,
                ..PartitionState::default()
            },
        );
        self.partition_ids.remove(&old.key);
        self.durable.forget_partition(pid);
        self.free_partitions.push(pid);
    }
}
