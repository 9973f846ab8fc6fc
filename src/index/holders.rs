//! Who holds a block: the compact per-block membership list, and the bitset twin that dense
//! blocks (held by many engines) keep so lookups intersect them a word at a time.

use crate::event::Tier;

/// An engine id local to one shard (dense, from 0), as interned by the shard.
pub type EngineIdx = u32;

/// The most engines one shard can intern: two bits of each packed holder carry the tier.
pub const MAX_ENGINES: u32 = 1 << 30;

/// One (engine, tier) membership packed in 32 bits: `engine << 2 | tier`. Sorting packed values
/// sorts by engine, so a binary search by engine works on the raw slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder(u32);

impl Holder {
    #[inline]
    pub fn new(engine: EngineIdx, tier: Tier) -> Holder {
        Holder((engine << 2) | tier as u32)
    }
    #[inline]
    pub fn engine(self) -> EngineIdx {
        self.0 >> 2
    }
    #[inline]
    pub fn tier(self) -> Tier {
        Tier::from_bits(self.0)
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
    /// The engine held the block at another tier (returned); the tier is replaced.
    TierChanged(Tier),
    /// Nothing changed.
    Unchanged,
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

    /// Makes `engine` a holder at `tier` (last writer wins on the tier).
    #[inline]
    pub fn set(&mut self, engine: EngineIdx, tier: Tier) -> SetOutcome {
        let holder = Holder::new(engine, tier);
        match self.position(engine) {
            Ok(i) => {
                let slot = &mut self.as_mut_slice()[i];
                let old = slot.tier();
                if old == tier {
                    SetOutcome::Unchanged
                } else {
                    *slot = holder;
                    SetOutcome::TierChanged(old)
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

    /// Removes `engine`, returning the tier it held the block at.
    #[inline]
    pub fn remove(&mut self, engine: EngineIdx) -> Option<Tier> {
        let i = self.position(engine).ok()?;
        match self {
            Holders::Inline { len, items } => {
                let tier = items[i].tier();
                let n = *len as usize;
                items.copy_within(i + 1..n, i);
                *len -= 1;
                Some(tier)
            }
            Holders::Heap(v) => {
                let tier = v.remove(i).tier();
                if v.len() <= INLINE {
                    let mut items = [Holder(0); INLINE];
                    items[..v.len()].copy_from_slice(v);
                    *self = Holders::Inline {
                        len: v.len() as u8,
                        items,
                    };
                }
                Some(tier)
            }
        }
    }

    /// The tier `engine` holds the block at, if it holds it.
    pub fn tier_of(&self, engine: EngineIdx) -> Option<Tier> {
        self.position(engine)
            .ok()
            .map(|i| self.as_slice()[i].tier())
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

/// Bitsets over a shard's engine ids for one dense block: which engines hold it, and which of
/// those hold it on CPU or disk (GPU is the rest). Lookups AND these a word at a time instead of
/// walking hundreds of holders per block.
#[derive(Clone, Debug, Default)]
pub struct DenseBits {
    /// `[held | cpu | disk]`, each `words` long.
    bits: Vec<u64>,
    words: usize,
}

impl DenseBits {
    /// Builds the bitsets for `holders`, sized for `engine_count` engines.
    pub fn from_holders(holders: &Holders, engine_count: usize) -> DenseBits {
        let mut d = DenseBits {
            bits: Vec::new(),
            words: 0,
        };
        d.grow(engine_count.max(1));
        for h in holders.as_slice() {
            d.set(h.engine(), h.tier());
        }
        d
    }

    fn grow(&mut self, engines: usize) {
        let words = engines.div_ceil(64);
        if words <= self.words {
            return;
        }
        let mut bits = vec![0u64; words * 3];
        for part in 0..3 {
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
    #[inline]
    pub fn held(&self) -> &[u64] {
        &self.bits[..self.words]
    }
    #[inline]
    pub fn cpu(&self) -> &[u64] {
        &self.bits[self.words..2 * self.words]
    }
    #[inline]
    pub fn disk(&self) -> &[u64] {
        &self.bits[2 * self.words..]
    }

    /// Marks `engine` as holding the block at `tier`.
    pub fn set(&mut self, engine: EngineIdx, tier: Tier) {
        let e = engine as usize;
        self.grow(e + 1);
        let (w, b) = (e / 64, 1u64 << (e % 64));
        let words = self.words;
        self.bits[w] |= b;
        self.bits[words + w] &= !b;
        self.bits[2 * words + w] &= !b;
        match tier {
            Tier::Gpu => {}
            Tier::Cpu => self.bits[words + w] |= b,
            Tier::Disk => self.bits[2 * words + w] |= b,
        }
    }

    /// Clears `engine`.
    pub fn clear(&mut self, engine: EngineIdx) {
        let e = engine as usize;
        if e / 64 >= self.words {
            return;
        }
        let (w, b) = (e / 64, !(1u64 << (e % 64)));
        let words = self.words;
        self.bits[w] &= b;
        self.bits[words + w] &= b;
        self.bits[2 * words + w] &= b;
    }

    pub fn heap_bytes(&self) -> usize {
        self.bits.capacity() * 8
    }
}

/// When a block with `holders` holders, in a shard of `engines` engines, deserves bitsets:
/// the bitsets (3 × engines/8 bytes) must cost at most ~6 bytes per membership.
#[inline]
pub fn should_be_dense(holders: usize, engines: usize) -> bool {
    holders >= 32 && holders >= 4 * engines.div_ceil(64)
}

/// Hysteresis for dropping bitsets: half the promotion threshold.
#[inline]
pub fn should_stay_dense(holders: usize, engines: usize) -> bool {
    holders >= 16 && holders >= 2 * engines.div_ceil(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_stay_sorted_and_replace_tiers() {
        let mut h = Holders::default();
        for e in [9, 3, 7, 1, 5, 11, 2, 8, 4, 6, 10, 0] {
            assert_eq!(h.set(e, Tier::Gpu), SetOutcome::Added);
        }
        let engines: Vec<_> = h.as_slice().iter().map(|x| x.engine()).collect();
        assert_eq!(engines, (0..12).collect::<Vec<_>>());
        assert_eq!(h.set(7, Tier::Cpu), SetOutcome::TierChanged(Tier::Gpu));
        assert_eq!(h.set(7, Tier::Cpu), SetOutcome::Unchanged);
        assert_eq!(h.tier_of(7), Some(Tier::Cpu));
        assert_eq!(h.remove(7), Some(Tier::Cpu));
        assert_eq!(h.remove(7), None);
        assert_eq!(h.len(), 11);
        // Back down to inline storage, still sorted.
        for e in [0, 2, 4, 6, 8, 10, 11, 1] {
            h.remove(e);
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
    fn dense_bits_track_tiers_and_grow() {
        let mut h = Holders::default();
        h.set(3, Tier::Disk);
        let mut d = DenseBits::from_holders(&h, 10);
        assert_eq!(d.words(), 1);
        d.set(130, Tier::Cpu);
        assert_eq!(d.words(), 3);
        assert_eq!(d.held()[0], 1 << 3);
        assert_eq!(d.disk()[0], 1 << 3);
        assert_eq!(d.cpu()[2], 1 << 2);
        d.set(130, Tier::Gpu);
        assert_eq!(d.cpu()[2], 0);
        d.clear(3);
        assert_eq!(d.held()[0], 0);
        assert_eq!(d.disk()[0], 0);
    }
}
