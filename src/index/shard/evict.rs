//! The shard as the spill controller sees it: what each L1 entry costs, the coldest entries
//! with their rows, conditional removal once those rows are durable, and the walk over the
//! dirty entries for the backup flush. [`ShardL1`](crate::index::ShardL1) forwards the
//! [`SpillL1`](crate::spill::SpillL1) calls here, one lock per call.
//!
//! # LRU, approximately
//! Every entry carries a `u32` stamp of the shard's LRU clock at its last use or change (blocks
//! also on lookups, and when a holder leaves: the stamp is the entry's version too). [`Shard::coldest`] takes the oldest entries of a rotating sample of a few times
//! the batch size, as Redis's approximated LRU does: O(batch) per call, no list to maintain on
//! the hot path. The clock advances once per call, so an entry read while its batch is in
//! flight carries a newer stamp and [`Shard::evict_if_unchanged`] keeps it.

use super::{Block, MapEntry, Shard};
use crate::index::holders::EngineIdx;
use crate::spill::{DirtyPage, Removal, Resident, Stamp};
use smallvec::SmallVec;
use std::sync::atomic::Ordering::Relaxed;

/// What one block-table entry counts against `l1_max_bytes`, before its holders' heap: its
/// slot, twice (the table is at most 13/16 full and grows by doubling).
pub const BLOCK_ENTRY_BYTES: u64 = 2 * std::mem::size_of::<(u64, Block)>() as u64;
/// What one engine-map entry counts against `l1_max_bytes` (see [`BLOCK_ENTRY_BYTES`]).
pub const MAP_ENTRY_BYTES: u64 = 2 * std::mem::size_of::<(u64, MapEntry)>() as u64;
/// How many candidates [`Shard::coldest`] samples per entry it returns.
const SAMPLE_FACTOR: usize = 4;
/// An L1 entry's key as the spill controller sees it. Ordered (blocks first, by key) for
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

/// One sampled candidate of [`Shard::coldest`].
struct Candidate {
    key: L1Key,
    used: u32,
}

impl Shard {
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

    /// `key` as the spill controller sees it; `encode == false` leaves `dirty` empty but
    /// keeps every check that decides whether the entry is there for it at all (a dirty entry
    /// whose engine or partition has no durable id yet is not).
    fn inspect(&self, key: L1Key, encode: bool) -> Option<Resident<L1Key>> {
        let t = self.spill.as_deref()?;
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
                            .map(|h| Some((self.durable.engine(h.engine())?, h.tiers())))
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
    /// docs), coldest first. Advances the LRU clock, so a use from now on moves a stamp.
    pub fn coldest(&mut self, max: usize) -> Vec<Resident<L1Key>> {
        let Some(t) = self.spill.as_deref_mut() else {
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
    /// controller wrote its row first; with `write_back_on_evict = false` it offers clean
    /// entries only).
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
            && let Some(t) = self.spill.as_deref_mut()
        {
            t.spilled = true;
            t.epoch += 1;
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

    /// Dirty resident entries after `cursor`, in key order, from the next `max` changed keys
    /// (the backup flush). One pass over the change set keeps only the `max` smallest keys
    /// past the cursor (a bounded heap), so a page costs O(changes · log max) time and
    /// O(max) memory, never a sorted copy of the whole dirty set. A page may hold fewer than
    /// `max` entries (changed keys no longer resident or dirty); `next` is `None` once no
    /// changed key lies past the page.
    pub fn dirty_after(&self, cursor: &DirtyCursor, max: usize) -> DirtyPage<L1Key, DirtyCursor> {
        let Some(c) = self.changes.as_deref() else {
            return DirtyPage {
                entries: Vec::new(),
                next: None,
            };
        };
        let changed = c
            .blocks
            .keys()
            .map(|&k| L1Key::Block(k))
            .chain(c.maps.iter().map(|&(engine, partition, hash)| L1Key::Map {
                engine,
                partition,
                hash,
            }))
            .filter(|k| cursor.0.is_none_or(|after| *k > after));
        let mut smallest = std::collections::BinaryHeap::with_capacity(max.min(4096) + 1);
        let mut more = false;
        for k in changed {
            if smallest.len() < max {
                smallest.push(k);
                continue;
            }
            more = true;
            if smallest.peek().is_some_and(|&largest| k < largest) {
                smallest.pop();
                smallest.push(k);
            }
        }
        let keys = smallest.into_sorted_vec();
        let next = keys.last().filter(|_| more).map(|&k| DirtyCursor(Some(k)));
        let entries = keys
            .into_iter()
            .filter_map(|k| self.resident(k).filter(|r| r.dirty.is_some()))
            .collect();
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
}
