//! [`MemL1`]: a small, obviously-correct in-memory [`SpillL1`], the test double of a shard's L1
//! and a reference for whoever implements the trait on the real shard.
//!
//! It is an ordered map (so the flush cursor is simply "the last key seen") plus an LRU order
//! kept as a second ordered map from access tick to key. Every operation is O(log n) behind
//! one mutex; it is built to be read, not to be fast.

use crate::spill::{DirtyPage, L2Row, Removal, Resident, SpillL1, Stamp};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ops::Bound;

/// Fixed per-entry cost added to key and value lengths (map nodes, version, flags).
pub const ENTRY_OVERHEAD: u64 = 48;

#[derive(Clone, Debug)]
struct Slot {
    /// `None`: a tombstone (deleted in L1, L2 may still hold an older value).
    value: Option<Vec<u8>>,
    version: u64,
    dirty: bool,
    /// Position in `lru`.
    tick: u64,
    bytes: u64,
}

#[derive(Debug, Default)]
struct Inner {
    map: BTreeMap<Vec<u8>, Slot>,
    /// Access tick → key; the first entry is the coldest.
    lru: BTreeMap<u64, Vec<u8>>,
    next_tick: u64,
    next_version: u64,
    bytes: u64,
}

impl Inner {
    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn version(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    /// Inserts or replaces `key`, most recently used, with a new version.
    fn set(&mut self, key: &[u8], value: Option<Vec<u8>>, dirty: bool) {
        let tick = self.tick();
        let version = self.version();
        let bytes =
            ENTRY_OVERHEAD + key.len() as u64 + value.as_ref().map_or(0, |v| v.len() as u64);
        let slot = Slot {
            value,
            version,
            dirty,
            tick,
            bytes,
        };
        if let Some(old) = self.map.insert(key.to_vec(), slot) {
            self.lru.remove(&old.tick);
            self.bytes -= old.bytes;
        }
        self.lru.insert(tick, key.to_vec());
        self.bytes += bytes;
    }

    fn remove(&mut self, key: &[u8]) -> Option<Slot> {
        let slot = self.map.remove(key)?;
        self.lru.remove(&slot.tick);
        self.bytes -= slot.bytes;
        Some(slot)
    }

    fn resident(key: &[u8], slot: &Slot) -> Resident<Vec<u8>> {
        Resident {
            key: key.to_vec(),
            version: slot.version,
            bytes: slot.bytes,
            dirty: slot.dirty.then(|| L2Row {
                key: key.to_vec(),
                value: slot.value.clone(),
            }),
        }
    }
}

/// An in-memory L1: byte-accounted, LRU-ordered, versioned, with dirty flags.
#[derive(Debug, Default)]
pub struct MemL1 {
    inner: Mutex<Inner>,
}

impl MemL1 {
    pub fn new() -> MemL1 {
        MemL1::default()
    }

    /// An event changed `key`: new value, dirty, most recently used.
    pub fn put(&self, key: &[u8], value: &[u8]) {
        self.inner.lock().set(key, Some(value.to_vec()), true);
    }

    /// An event emptied `key`: a dirty tombstone stays until L2 has forgotten the key too.
    pub fn delete(&self, key: &[u8]) {
        self.inner.lock().set(key, None, true);
    }

    /// A value read back from L2 (restore on read): clean, most recently used.
    pub fn insert_clean(&self, key: &[u8], value: &[u8]) {
        self.inner.lock().set(key, Some(value.to_vec()), false);
    }

    /// A lookup read `key`: most recently used, and a new version so an in-flight write-back
    /// of it does not drop it. Returns whether it was resident.
    pub fn touch(&self, key: &[u8]) -> bool {
        let mut guard = self.inner.lock();
        // Reborrow once so the map and the LRU order can be borrowed apart.
        let inner = &mut *guard;
        if !inner.map.contains_key(key) {
            return false;
        }
        let (tick, version) = (inner.tick(), inner.version());
        let Some(slot) = inner.map.get_mut(key) else {
            return false;
        };
        let old_tick = std::mem::replace(&mut slot.tick, tick);
        slot.version = version;
        inner.lru.remove(&old_tick);
        inner.lru.insert(tick, key.to_vec());
        true
    }

    /// `None`: not resident. `Some(None)`: a tombstone. `Some(Some(v))`: the value.
    pub fn get(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.inner.lock().map.get(key).map(|s| s.value.clone())
    }

    pub fn is_dirty(&self, key: &[u8]) -> Option<bool> {
        self.inner.lock().map.get(key).map(|s| s.dirty)
    }

    /// Every resident entry: (key, value or tombstone, dirty).
    pub fn entries(&self) -> Vec<(Vec<u8>, Option<Vec<u8>>, bool)> {
        let inner = self.inner.lock();
        inner
            .map
            .iter()
            .map(|(k, s)| (k.clone(), s.value.clone(), s.dirty))
            .collect()
    }

    /// Forgets everything (a process restart).
    pub fn clear(&self) {
        *self.inner.lock() = Inner::default();
    }
}

impl SpillL1 for MemL1 {
    type Key = Vec<u8>;
    /// The last key returned; `None` = the start of the keyspace.
    type Cursor = Option<Vec<u8>>;

    fn bytes_used(&self) -> u64 {
        self.inner.lock().bytes
    }

    fn entry_count(&self) -> usize {
        self.inner.lock().map.len()
    }

    fn coldest(&self, max: usize) -> Vec<Resident<Vec<u8>>> {
        let inner = self.inner.lock();
        inner
            .lru
            .values()
            .take(max)
            .filter_map(|k| inner.map.get(k).map(|s| Inner::resident(k, s)))
            .collect()
    }

    fn remove_if_unchanged(&self, victims: &[Stamp<Vec<u8>>]) -> Removal {
        let mut inner = self.inner.lock();
        let mut out = Removal::default();
        for v in victims {
            let unchanged = inner
                .map
                .get(&v.key)
                .is_some_and(|s| s.version == v.version);
            match unchanged.then(|| inner.remove(&v.key)).flatten() {
                Some(slot) => {
                    out.removed += 1;
                    out.bytes_freed += slot.bytes;
                }
                None => out.kept += 1,
            }
        }
        out
    }

    fn dirty_after(
        &self,
        cursor: &Option<Vec<u8>>,
        max: usize,
    ) -> DirtyPage<Vec<u8>, Option<Vec<u8>>> {
        if max == 0 {
            return DirtyPage {
                entries: Vec::new(),
                next: Some(cursor.clone()),
            };
        }
        let inner = self.inner.lock();
        let start = match cursor {
            Some(k) => Bound::Excluded(k.clone()),
            None => Bound::Unbounded,
        };
        let mut entries = Vec::new();
        let mut last = None;
        let mut range = inner.map.range((start, Bound::Unbounded));
        for (k, s) in range.by_ref() {
            if s.dirty {
                entries.push(Inner::resident(k, s));
                last = Some(k.clone());
                if entries.len() == max {
                    break;
                }
            }
        }
        // More keys after the last one returned: continue from it; otherwise wrap.
        let more = range.any(|(_, s)| s.dirty);
        DirtyPage {
            entries,
            next: if more { Some(last) } else { None },
        }
    }

    fn mark_clean_if_unchanged(&self, written: &[Stamp<Vec<u8>>]) -> usize {
        let mut inner = self.inner.lock();
        let mut marked = 0;
        for w in written {
            let Some(slot) = inner.map.get_mut(&w.key) else {
                continue;
            };
            if slot.version != w.version {
                continue;
            }
            if slot.value.is_none() {
                // A tombstone L2 has now forgotten too: nothing left to keep.
                inner.remove(&w.key);
            } else {
                slot.dirty = false;
            }
            marked += 1;
        }
        marked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_bytes_and_versions() {
        let l1 = MemL1::new();
        l1.put(b"a", b"1");
        l1.put(b"b", b"22");
        l1.put(b"c", b"333");
        assert_eq!(l1.bytes_used(), 3 * (ENTRY_OVERHEAD + 1) + 6);
        l1.touch(b"a");
        let order: Vec<Vec<u8>> = l1.coldest(10).into_iter().map(|r| r.key).collect();
        assert_eq!(order, [b"b".to_vec(), b"c".to_vec(), b"a".to_vec()]);
        let b = l1.coldest(1).remove(0);
        l1.put(b"b", b"x");
        let r = l1.remove_if_unchanged(&[b.stamp()]);
        assert_eq!((r.removed, r.kept), (0, 1));
        let b = l1
            .coldest(3)
            .into_iter()
            .find(|r| r.key == b"b")
            .expect("b");
        let r = l1.remove_if_unchanged(&[b.stamp()]);
        assert_eq!((r.removed, r.bytes_freed), (1, ENTRY_OVERHEAD + 2));
        assert_eq!(l1.bytes_used(), 2 * ENTRY_OVERHEAD + 2 + 4);
    }

    #[test]
    fn dirty_pages_wrap() {
        let l1 = MemL1::new();
        for k in [b"a", b"b", b"c"] {
            l1.put(k, b"v");
        }
        let p = l1.dirty_after(&None, 2);
        assert_eq!(p.entries.len(), 2);
        assert_eq!(p.next, Some(Some(b"b".to_vec())));
        let p = l1.dirty_after(&Some(b"b".to_vec()), 2);
        assert_eq!(p.entries.len(), 1);
        assert_eq!(p.next, None);
    }
}
