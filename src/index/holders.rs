//! Who holds a block: the compact per-block membership list, and the bitset twin that dense
//! blocks (held by many engines) keep so lookups intersect them a word at a time.
//!
//! An engine may hold one block on several tiers at once (vLLM's CPU offloading keeps the GPU
//! copy until it is evicted; LMCache adds disk), so a membership carries a [`TierSet`], and a
//! removal naming one medium drops only that tier.

use crate::event::Tier;
use crate::event::TierSet;

/// An engine id local to one shard (dense, from 0), as interned by the shard.
pub type EngineIdx = u32;

/// The most engines one shard can intern: three bits of each packed holder carry its tiers.
pub const MAX_ENGINES: u32 = 1 << 29;

/// One membership packed in 32 bits: `engine << 3 | tiers`. Sorting packed values sorts by
/// engine, so a binary search by engine works on the raw slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder(u32);

impl Holder {
    #[inline]
    pub fn new(engine: EngineIdx, tiers: TierSet) -> Holder {
        Holder((engine << 3) | tiers.bits() as u32)
    }
    #[inline]
    pub fn engine(self) -> EngineIdx {
        self.0 >> 3
    }
    #[inline]
    pub fn tiers(self) -> TierSet {
        TierSet::from_bits(self.0 as u8)
    }
}

/// How many holders live inline, without a heap allocation.
const INLINE: usize = 3;

/// The engines holding one block, sorted by engine.
///
/// 16 bytes: up to three holders inline (the usual handful of replicas per block), more on the
/// heap. Small matters here: this sits in every slot of the block table, so each byte saved is
/// saved per block. Kept sorted so membership tests are binary searches even for a root block
/// that a thousand engines share.
#[derive(Clone, Debug)]
pub enum Holders {
    Inline { len: u8, items: [Holder; INLINE] },
    Heap(Box<Vec<Holder>>),
}

impl Default for Holders {
    fn default() -> Self {
        Holders::Inline {
            len: 0,
            items: [Holder(0); INLINE],
        }
    }
}

/// What [`Holders::set`] changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetOutcome {
    /// The engine was not a holder; it is now.
    Added,
    /// The engine held the block on other tiers (returned); the tier joins them.
    TierAdded(TierSet),
    /// Nothing changed.
    Unchanged,
}

/// What [`Holders::remove`] dropped: the engine's tiers before and after. `after` is empty
/// when the engine no longer holds the block at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removed {
    pub before: TierSet,
    pub after: TierSet,
}

impl Holders {
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Holders::Inline { len, .. } => *len as usize,
            Holders::Heap(v) => v.len(),
        }
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    #[inline]
    pub fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::Inline { len, items } => &items[..*len as usize],
            Holders::Heap(v) => v,
        }
    }
    #[inline]
    fn as_mut_slice(&mut self) -> &mut [Holder] {
        match self {
            Holders::Inline { len, items } => &mut items[..*len as usize],
            Holders::Heap(v) => v,
        }
    }

    #[inline]
    fn position(&self, engine: EngineIdx) -> Result<usize, usize> {
        let slice = self.as_slice();
        if slice.len() <= 8 {
            // A short linear scan beats binary search's branch mispredictions.
            for (i, h) in slice.iter().enumerate() {
                if h.engine() >= engine {
                    return if h.engine() == engine { Ok(i) } else { Err(i) };
                }
            }
            return Err(slice.len());
        }
        slice.binary_search_by_key(&engine, |h| h.engine())
    }

    /// Makes `engine` a holder on `tier`, besides any tiers it holds the block on already.
    #[inline]
    pub fn set(&mut self, engine: EngineIdx, tier: Tier) -> SetOutcome {
        let holder = Holder::new(engine, TierSet::of(tier));
        match self.position(engine) {
            Ok(i) => {
                let slot = &mut self.as_mut_slice()[i];
                let old = slot.tiers();
                if old.contains(tier) {
                    SetOutcome::Unchanged
                } else {
                    *slot = Holder::new(engine, old.with(tier));
                    SetOutcome::TierAdded(old)
                }
            }
            Err(i) => {
                match self {
                    Holders::Inline { len, items } if (*len as usize) < INLINE => {
                        let n = *len as usize;
                        items.copy_within(i..n, i + 1);
                        items[i] = holder;
                        *len += 1;
                    }
                    Holders::Inline { items, .. } => {
                        let mut v = Vec::with_capacity(2 * INLINE + 2);
                        v.extend_from_slice(&items[..i]);
                        v.push(holder);
                        v.extend_from_slice(&items[i..]);
                        *self = Holders::Heap(Box::new(v));
                    }
                    Holders::Heap(v) => v.insert(i, holder),
                }
                SetOutcome::Added
            }
        }
    }

    /// Drops `tiers` of `engine`'s holding ([`TierSet::ALL`]: the whole membership); the
    /// engine stops being a holder once it holds the block on no tier. `None` if it was not a
    /// holder.
    #[inline]
    pub fn remove(&mut self, engine: EngineIdx, tiers: TierSet) -> Option<Removed> {
        let i = self.position(engine).ok()?;
        let before = self.as_slice()[i].tiers();
        let after = before.without(tiers);
        if !after.is_empty() {
            if after != before {
                self.as_mut_slice()[i] = Holder::new(engine, after);
            }
            return Some(Removed { before, after });
        }
        match self {
            Holders::Inline { len, items } => {
                let n = *len as usize;
                items.copy_within(i + 1..n, i);
                *len -= 1;
            }
            Holders::Heap(v) => {
                v.remove(i);
                if v.len() <= INLINE {
                    let mut items = [Holder(0); INLINE];
                    items[..v.len()].copy_from_slice(v);
                    *self = Holders::Inline {
                        len: v.len() as u8,
                        items,
                    };
                }
            }
        }
        Some(Removed { before, after })
    }

    /// The tiers `engine` holds the block on, if it holds it.
    pub fn tiers_of(&self, engine: EngineIdx) -> Option<TierSet> {
        self.position(engine)
            .ok()
            .map(|i| self.as_slice()[i].tiers())
    }

    /// Restores `engine`'s holding as `tiers` exactly (loads from L2 rows); an empty set is a
    /// no-op.
    pub fn set_tiers(&mut self, engine: EngineIdx, tiers: TierSet) -> SetOutcome {
        let mut outcome = SetOutcome::Unchanged;
        for tier in tiers.iter() {
            match (self.set(engine, tier), outcome) {
                (SetOutcome::Unchanged, _) => {}
                (o, SetOutcome::Unchanged) => outcome = o,
                _ => {}
            }
        }
        outcome
    }

    /// Heap bytes owned beyond the inline storage (for L1 accounting).
    #[inline]
    pub fn heap_bytes(&self) -> usize {
        match self {
            Holders::Inline { .. } => 0,
            Holders::Heap(v) => {
                std::mem::size_of::<Vec<Holder>>() + v.capacity() * std::mem::size_of::<Holder>()
            }
        }
    }
}

/// Bitsets over a shard's engine ids for one dense block: which engines hold it, and on which
/// tiers. Lookups AND these a word at a time instead of walking hundreds of holders per block.
#[derive(Clone, Debug, Default)]
pub struct DenseBits {
    /// `[held | gpu | cpu | disk]`, each `words` long.
    bits: Vec<u64>,
    words: usize,
    /// Engines holding the block on a set of tiers other than GPU alone: with none, a
    /// lookup reads only the held set (GPU is the held set, CPU and disk are empty).
    mixed: u32,
}

/// Parts of [`DenseBits`]: the held set, then one per tier (`1 + Tier as usize`).
const PARTS: usize = 4;

impl DenseBits {
    /// Builds the bitsets for `holders`, sized for `engine_count` engines.
    pub fn from_holders(holders: &Holders, engine_count: usize) -> DenseBits {
        let mut d = DenseBits {
            bits: Vec::new(),
            words: 0,
            mixed: 0,
        };
        d.grow(engine_count.max(1));
        for h in holders.as_slice() {
            d.set(h.engine(), h.tiers());
        }
        d
    }

    fn grow(&mut self, engines: usize) {
        let words = engines.div_ceil(64);
        if words <= self.words {
            return;
        }
        let mut bits = vec![0u64; words * PARTS];
        for part in 0..PARTS {
            bits[part * words..part * words + self.words]
                .copy_from_slice(&self.bits[part * self.words..(part + 1) * self.words]);
        }
        self.bits = bits;
        self.words = words;
    }

    #[inline]
    pub fn words(&self) -> usize {
        self.words
    }
    /// Whether some engine holds the block elsewhere than on GPU alone.
    #[inline]
    pub fn mixed(&self) -> bool {
        self.mixed > 0
    }
    #[inline]
    pub fn held(&self) -> &[u64] {
        &self.bits[..self.words]
    }
    /// Engines holding the block on `tier`.
    #[inline]
    pub fn on(&self, tier: Tier) -> &[u64] {
        let part = 1 + tier as usize;
        &self.bits[part * self.words..(part + 1) * self.words]
    }

    /// Records that `engine` holds the block on exactly `tiers` (empty: not at all).
    pub fn set(&mut self, engine: EngineIdx, tiers: TierSet) {
        let e = engine as usize;
        self.grow(e + 1);
        let (w, b) = (e / 64, 1u64 << (e % 64));
        let words = self.words;
        let was = TierSet::from_bits(Tier::ALL.iter().fold(0, |acc, &t| {
            let on = self.bits[(1 + t as usize) * words + w] & b != 0;
            acc | (u8::from(on) << t as u8)
        }));
        let mixed = |t: TierSet| !t.is_empty() && t != TierSet::of(Tier::Gpu);
        self.mixed = self.mixed + u32::from(mixed(tiers)) - u32::from(mixed(was));
        let mut put = |part: usize, on: bool| {
            let word = &mut self.bits[part * words + w];
            *word = if on { *word | b } else { *word & !b };
        };
        put(0, !tiers.is_empty());
        for tier in Tier::ALL {
            put(1 + tier as usize, tiers.contains(tier));
        }
    }

    /// Clears `engine`.
    pub fn clear(&mut self, engine: EngineIdx) {
        if (engine as usize) / 64 < self.words {
            self.set(engine, TierSet::EMPTY);
        }
    }

    pub fn heap_bytes(&self) -> usize {
        self.bits.capacity() * 8
    }
}

/// When a block with `holders` holders, in a shard of `engines` engines, deserves bitsets:
/// the bitsets (4 × engines/8 bytes) must cost at most ~6.4 bytes per membership.
#[inline]
pub fn should_be_dense(holders: usize, engines: usize) -> bool {
    holders >= 32 && holders >= 5 * engines.div_ceil(64)
}

/// Hysteresis for dropping bitsets: half the promotion threshold.
#[inline]
pub fn should_stay_dense(holders: usize, engines: usize) -> bool {
    holders >= 16 && 2 * holders >= 5 * engines.div_ceil(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_stay_sorted_and_keep_a_set_of_tiers() {
        let mut h = Holders::default();
        for e in [9, 3, 7, 1, 5, 11, 2, 8, 4, 6, 10, 0] {
            assert_eq!(h.set(e, Tier::Gpu), SetOutcome::Added);
        }
        let engines: Vec<_> = h.as_slice().iter().map(|x| x.engine()).collect();
        assert_eq!(engines, (0..12).collect::<Vec<_>>());
        let gpu = TierSet::of(Tier::Gpu);
        let both = gpu.with(Tier::Cpu);
        assert_eq!(h.set(7, Tier::Cpu), SetOutcome::TierAdded(gpu));
        assert_eq!(h.set(7, Tier::Cpu), SetOutcome::Unchanged);
        assert_eq!(h.tiers_of(7), Some(both));
        // Dropping one medium keeps the other; dropping the last one drops the holder.
        let removed = h.remove(7, gpu).unwrap();
        assert_eq!(
            (removed.before, removed.after),
            (both, TierSet::of(Tier::Cpu))
        );
        assert_eq!(h.len(), 12);
        assert_eq!(
            h.remove(7, TierSet::of(Tier::Disk)).unwrap().after,
            TierSet::of(Tier::Cpu)
        );
        assert!(h.remove(7, TierSet::ALL).unwrap().after.is_empty());
        assert_eq!(h.remove(7, TierSet::ALL), None);
        assert_eq!(h.len(), 11);
        // Back down to inline storage, still sorted.
        for e in [0, 2, 4, 6, 8, 10, 11, 1] {
            h.remove(e, TierSet::ALL);
        }
        assert!(matches!(h, Holders::Inline { len: 3, .. }));
        assert_eq!(
            h.as_slice().iter().map(|x| x.engine()).collect::<Vec<_>>(),
            vec![3, 5, 9]
        );
        assert_eq!(h.heap_bytes(), 0);
    }

    #[test]
    fn holders_fit_in_16_bytes() {
        assert_eq!(std::mem::size_of::<Holders>(), 16);
    }

    #[test]
    fn the_largest_engine_id_keeps_its_tiers() {
        let h = Holder::new(MAX_ENGINES - 1, TierSet::ALL);
        assert_eq!((h.engine(), h.tiers()), (MAX_ENGINES - 1, TierSet::ALL));
        assert_eq!(TierSet::of(Tier::Cpu).with(Tier::Disk).fastest(), Tier::Cpu);
        assert_eq!(TierSet::ALL.fastest(), Tier::Gpu);
    }

    #[test]
    fn dense_bits_track_tiers_and_grow() {
        let mut h = Holders::default();
        h.set(3, Tier::Disk);
        let mut d = DenseBits::from_holders(&h, 10);
        assert_eq!(d.words(), 1);
        d.set(130, TierSet::of(Tier::Cpu).with(Tier::Gpu));
        assert_eq!(d.words(), 3);
        assert_eq!(d.held()[0], 1 << 3);
        assert_eq!(d.on(Tier::Disk)[0], 1 << 3);
        assert_eq!(d.on(Tier::Cpu)[2], 1 << 2);
        assert_eq!(d.on(Tier::Gpu)[2], 1 << 2);
        assert!(d.mixed());
        d.set(130, TierSet::of(Tier::Gpu));
        assert_eq!(d.on(Tier::Cpu)[2], 0);
        assert!(d.mixed(), "engine 3 is still on disk");
        d.clear(3);
        assert_eq!(d.held()[0], 0);
        assert_eq!(d.on(Tier::Disk)[0], 0);
        assert!(!d.mixed(), "GPU alone is left");
        d.set(7, TierSet::of(Tier::Cpu));
        d.set(7, TierSet::of(Tier::Cpu));
        assert!(d.mixed());
        d.set(7, TierSet::of(Tier::Gpu));
        assert!(!d.mixed());
    }
}
