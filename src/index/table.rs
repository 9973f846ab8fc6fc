//! `KeyTable`: the open-addressing hash table behind every hot map of the index (block key →
//! holders, engine hash → block key).
//!
//! Why not hashbrown: an index op touches one random slot per block, so on a table larger than
//! the CPU caches its cost is one cache miss per block. hashbrown offers no way to prefetch a
//! key's slot, so misses are paid one after another. Here `prefetch(key)` issues the load for a
//! slot before it is needed, letting a chain of blocks overlap its misses. The design is kept
//! small to stay obviously correct:
//! - keys are `u64`; the slot is the top bits of `key * φ` (Fibonacci hashing), which spreads
//!   sequential and random keys alike with one multiply;
//! - linear probing, at most 13/16 full; deletion shifts followers back (no tombstones, so
//!   probe lengths never degrade under churn);
//! - keys and values side by side in one slot, so a hit near home costs one cache line (two
//!   arrays would cost two: measured slower on the replay trace);
//! - key 0 marks an empty slot; the one real key 0 lives in its own field;
//! - tables keyed by producers' raw hashes ([`KeyTable::seeded`]) xor every key with a random
//!   per-process seed before the multiply. Unseeded, `i * φ⁻¹` for `i = 0, 1, 2…` all share
//!   home slot 0 and probing degrades to O(n²); a producer that cannot see the seed cannot
//!   aim keys at one slot. Block keys are kvindex's own chained hashes and stay unseeded
//!   (seed 0, the same arithmetic).

/// Fibonacci hashing multiplier (2^64 / φ).
const PHI: u64 = 0x9e37_79b9_7f4a_7c15;
const MIN_CAPACITY: usize = 8;

/// A position in a [`KeyTable`], valid until the table's next insert or removal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot(usize);

/// An open-addressing `u64 → V` map. See the module docs.
#[derive(Clone, Debug)]
pub struct KeyTable<V> {
    /// `(key, value)`; key 0 = empty slot, whose value is `V::default()`. Length is a power of
    /// two (or 0 before the first insert).
    slots: Vec<(u64, V)>,
    /// `64 - log2(slots.len())`: shifting `key * PHI` by this gives the home slot.
    shift: u32,
    /// Entries in `slots` (not counting `zero`).
    len: usize,
    /// The value of key 0, which cannot live in `slots`.
    zero: Option<V>,
    /// Xored into every key before hashing (0: unseeded). See the module docs.
    seed: u64,
}

/// The process's seed for [`KeyTable::seeded`] tables: random, fixed for the process's life.
fn process_seed() -> u64 {
    use std::hash::BuildHasher;
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| std::hash::RandomState::new().hash_one(0u64))
}

impl<V: Default> Default for KeyTable<V> {
    fn default() -> Self {
        KeyTable {
            slots: Vec::new(),
            shift: 64,
            len: 0,
            zero: None,
            seed: 0,
        }
    }
}

impl<V: Default> KeyTable<V> {
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table for keys a producer chooses (engine hashes): keys are mixed with the
    /// process's random seed, so crafted keys cannot pile onto one home slot.
    pub fn seeded() -> Self {
        KeyTable {
            seed: process_seed(),
            ..Self::default()
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len + self.zero.is_some() as usize
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the slot array (for memory accounting; values' own heap is the caller's).
    pub fn allocation_size(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, V)>()
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        // Callers guard emptiness (shift 64 then); masking keeps the shift defined regardless.
        ((key ^ self.seed).wrapping_mul(PHI) >> (self.shift & 63)) as usize
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Starts loading `key`'s home slot into cache; a no-op where unsupported.
    #[inline(always)]
    pub fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.slots.is_empty() {
            // SAFETY: `home` is always < slots.len() when the table is allocated; prefetching
            // never faults and reads nothing.
            unsafe {
                use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
                _mm_prefetch(
                    self.slots.as_ptr().add(self.home(key)).cast::<i8>(),
                    _MM_HINT_T0,
                );
            }
        }
    }

    /// The key in slot `i`. Probe loops call this with `i & mask`, always in bounds: the
    /// unchecked read drops a bounds check from the hottest loop of the index.
    #[inline(always)]
    fn key_at(&self, i: usize) -> u64 {
        debug_assert!(i < self.slots.len());
        // SAFETY: every caller passes an index masked by `self.mask()` (slots.len() - 1, with
        // slots.len() a power of two) or a home slot (< slots.len()), on a non-empty table.
        unsafe { self.slots.get_unchecked(i).0 }
    }

    /// The slot index holding `key` (non-zero), if present.
    #[inline(always)]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.key_at(i);
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<&V> {
        if key == 0 {
            return self.zero.as_ref();
        }
        self.find(key).map(|i| &self.slots[i].1)
    }

    #[inline]
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == 0 {
            return self.zero.as_mut();
        }
        self.find(key).map(|i| &mut self.slots[i].1)
    }

    #[inline]
    pub fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// The value of `key`, inserting `V::default()` first if absent; `true` if it was inserted.
    #[inline]
    pub fn get_or_default(&mut self, key: u64) -> (&mut V, bool) {
        if key == 0 {
            let new = self.zero.is_none();
            return (self.zero.get_or_insert_with(V::default), new);
        }
        if (self.len + 1) * 16 > self.slots.len() * 13 {
            self.resize((self.slots.len() * 2).max(MIN_CAPACITY));
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.key_at(i);
            if k == key {
                return (&mut self.slots[i].1, false);
            }
            if k == 0 {
                self.slots[i].0 = key;
                self.len += 1;
                return (&mut self.slots[i].1, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// Sets `key` to `value`, returning the previous value.
    #[inline]
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        let (slot, new) = self.get_or_default(key);
        let old = std::mem::replace(slot, value);
        (!new).then_some(old)
    }

    /// Removes `key`, returning its value.
    #[inline]
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.take();
        }
        let slot = self.find(key)?;
        Some(self.remove_slot(Slot(slot)))
    }

    /// Where `key` lives, for a read-modify-maybe-remove without probing twice. Key 0 has no
    /// slot: use [`KeyTable::get_mut`] / [`KeyTable::remove`] for it.
    #[inline]
    pub fn slot(&self, key: u64) -> Option<Slot> {
        if key == 0 {
            None
        } else {
            self.find(key).map(Slot)
        }
    }

    /// The value at `slot` (from [`KeyTable::slot`], with no insert or removal since).
    #[inline]
    pub fn at_mut(&mut self, slot: Slot) -> &mut V {
        &mut self.slots[slot.0].1
    }

    /// Removes the entry at `slot` (from [`KeyTable::slot`], with no change since).
    #[inline]
    pub fn remove_slot(&mut self, slot: Slot) -> V {
        let i = slot.0;
        let value = std::mem::take(&mut self.slots[i].1);
        self.slots[i].0 = 0;
        self.len -= 1;
        self.close_gap(i);
        if self.slots.len() > MIN_CAPACITY && self.len * 8 < self.slots.len() {
            // Give memory back after mass removals (an engine cleared, a partition evicted).
            self.resize(self.slots.len() / 2);
        }
        value
    }

    /// Backward-shift deletion: moves every follower that may live in the emptied slot `hole`
    /// into it, so lookups never stop early at a gap.
    fn close_gap(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.key_at(j);
            if k == 0 {
                return;
            }
            let home = self.home(k);
            // The entry at j may move to `hole` iff `hole` lies on its probe path [home, j].
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.slots.swap(hole, j);
                hole = j;
            }
        }
    }

    /// Makes room for `additional` more keys without growing on the way (a reload that knows
    /// roughly how many rows it will insert skips every intermediate rehash).
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.len.saturating_add(additional);
        if needed.saturating_mul(16) > self.slots.len().saturating_mul(13) {
            self.resize(needed.saturating_mul(16) / 13 + 1);
        }
    }

    fn resize(&mut self, capacity: usize) {
        let capacity = capacity.max(MIN_CAPACITY).next_power_of_two();
        let old = std::mem::replace(
            &mut self.slots,
            (0..capacity).map(|_| (0, V::default())).collect(),
        );
        self.shift = 64 - capacity.trailing_zeros();
        let mask = capacity - 1;
        for (k, v) in old {
            if k == 0 {
                continue;
            }
            let mut i = self.home(k);
            while self.slots[i].0 != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = (k, v);
        }
    }

    /// Slots in the table (occupied or not): the range of [`KeyTable::entry_at`].
    #[inline]
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The entry in slot `i` (`< capacity()`), if the slot is occupied. Walks that visit the
    /// table a window at a time (the write-back's LRU sample) use it with a rotating index.
    /// Key 0's entry has no slot and is never returned.
    #[inline]
    pub fn entry_at(&self, i: usize) -> Option<(u64, &V)> {
        self.slots
            .get(i)
            .filter(|(k, _)| *k != 0)
            .map(|(k, v)| (*k, v))
    }

    /// Every `(key, &value)`, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        let slots = self
            .slots
            .iter()
            .filter(|(k, _)| *k != 0)
            .map(|(k, v)| (*k, v));
        self.zero.iter().map(|v| (0, v)).chain(slots)
    }

    /// Removes and returns every entry, leaving the table empty and unallocated.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, V)> {
        let slots = std::mem::take(&mut self.slots);
        let zero = self.zero.take();
        self.len = 0;
        self.shift = 64;
        zero.map(|v| (0, v))
            .into_iter()
            .chain(slots.into_iter().filter(|(k, _)| *k != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Mean distance of the table's entries from their home slots (1.0 is a perfect spread).
    fn mean_probe_distance(t: &KeyTable<u64>) -> f64 {
        let mask = t.mask();
        let total: usize = (0..t.capacity())
            .filter_map(|i| {
                t.entry_at(i)
                    .map(|(k, _)| (i.wrapping_sub(t.home(k)) & mask) + 1)
            })
            .sum();
        total as f64 / t.len() as f64
    }

    #[test]
    fn seeded_tables_spread_keys_crafted_to_collide() {
        // k·φ = i for k = i·φ⁻¹: every key's product has all-zero top bits, one home slot.
        let phi_inverse = (0..6).fold(PHI, |x, _| {
            x.wrapping_mul(2u64.wrapping_sub(PHI.wrapping_mul(x)))
        });
        assert_eq!(PHI.wrapping_mul(phi_inverse), 1);
        let crafted = || (1..=4_000u64).map(|i| i.wrapping_mul(phi_inverse));
        let mut plain: KeyTable<u64> = KeyTable::new();
        let mut seeded: KeyTable<u64> = KeyTable::seeded();
        for k in crafted() {
            plain.insert(k, k);
            seeded.insert(k, k);
        }
        assert!(
            mean_probe_distance(&plain) > 1000.0,
            "the crafted keys do collide unseeded"
        );
        let spread = mean_probe_distance(&seeded);
        assert!(spread < 4.0, "seeded mean probe distance {spread}");
        assert!(crafted().all(|k| seeded.get(k) == Some(&k)));
    }

    #[test]
    fn behaves_like_a_hashmap_under_random_churn() {
        let mut t: KeyTable<u64> = KeyTable::new();
        let mut m: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x1234_5678_9abc_def1u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small key space (with 0 and sequential keys) forces collisions, shifts and resizes.
            let key = if step % 7 == 0 { x % 16 } else { x % 5000 };
            match x % 3 {
                0 | 1 => assert_eq!(t.insert(key, step), m.insert(key, step)),
                _ => assert_eq!(t.remove(key), m.remove(&key)),
            }
            if step % 1000 == 0 {
                assert_eq!(t.len(), m.len());
                for (k, v) in &m {
                    assert_eq!(t.get(*k), Some(v));
                }
                assert_eq!(t.iter().count(), m.len());
            }
        }
        let drained: HashMap<u64, u64> = t.drain().collect();
        assert_eq!(drained, m);
        assert!(t.is_empty());
        assert_eq!(t.get(1), None);
    }

    #[test]
    fn shrinks_after_mass_removal() {
        let mut t: KeyTable<u32> = KeyTable::new();
        for k in 1..=10_000 {
            t.insert(k, k as u32);
        }
        let big = t.allocation_size();
        for k in 1..=9_990 {
            t.remove(k);
        }
        assert!(
            t.allocation_size() * 64 <= big,
            "{} vs {big}",
            t.allocation_size()
        );
        for k in 9_991..=10_000 {
            assert_eq!(t.get(k), Some(&(k as u32)));
        }
    }
}
