//! The longest-prefix lookup: walks the query's blocks, intersecting the holders of each with
//! the engines still matching, in per-thread scratch bitsets, and emits a row per engine where
//! its run ends, with how its matched blocks sit on its tiers ([`TierMix`]).
//!
//! Tier sets are counted only for blocks an engine holds somewhere other than on GPU alone: the
//! usual all-GPU walk keeps one bitset per block and pays nothing per engine. A lookup cut to
//! the best few rows pushes only the rows that can make the cut (see [`Rows::push_group`]).

use super::lookup_l2::L2Prefetch;
use super::{PREFETCH_AHEAD, RawMatch, Shard};
use crate::event::{Tier, TierSet};
use crate::index::holders::{DenseBits, Holders};
use crate::index::tiers::TierMix;
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering::Relaxed;

/// Where a lookup gets the rows of blocks only L2 holds.
#[derive(Clone, Copy)]
pub enum L2Access<'a> {
    /// From the rows prefetched with the shard's lock released where they cover the block
    /// (see `lookup_l2.rs`), else read from L2 under the lock.
    Prefetched(Option<&'a L2Prefetch>),
    /// Only what L2 serves from memory ([`crate::spill::L2Reader::block_if_cached`]): a row
    /// that would wait on storage ends the walk and sets the flag, and the answer is void.
    MemoryOnly(&'a Cell<bool>),
}

/// The set every block of the usual deployment has: GPU alone. Not counted (see [`TierMix`]).
const GPU_ONLY: TierSet = TierSet::of(Tier::Gpu);

/// Scratch bitsets of one query block, over the engines still matching: which hold it, and
/// which of those on GPU and on CPU (for the fastest tier of a run's last block). Reused per
/// thread so a lookup allocates nothing but its answer.
///
/// While every engine set holds the block on GPU alone (`gpu_only`, the usual deployment),
/// `gpu` and `cpu` are not kept (they would equal `held` and zero): a block of such holders
/// costs one AND and one store per word.
#[derive(Default)]
struct Bits {
    held: Vec<u64>,
    gpu: Vec<u64>,
    cpu: Vec<u64>,
    gpu_only: bool,
}

impl Bits {
    fn reset(&mut self, words: usize) {
        self.held.clear();
        self.held.resize(words, 0);
        self.gpu_only = true;
    }

    /// Starts keeping `gpu` and `cpu` (until now implied by `held`), if not yet kept.
    #[inline]
    fn keep_tiers(&mut self) {
        if self.gpu_only {
            self.gpu.clear();
            self.gpu.extend_from_slice(&self.held);
            self.cpu.clear();
            self.cpu.resize(self.held.len(), 0);
            self.gpu_only = false;
        }
    }

    /// The fastest tier engine bit `bit` of word `w` holds the block on.
    #[inline]
    fn tier_at(&self, w: usize, bit: u64) -> Tier {
        if self.gpu_only || self.gpu[w] & bit != 0 {
            Tier::Gpu
        } else if self.cpu[w] & bit != 0 {
            Tier::Cpu
        } else {
            Tier::Disk
        }
    }

    /// Whether at least `n` engines are set (counting stops there).
    #[inline]
    fn holds_at_least(&self, n: usize) -> bool {
        let mut count = 0;
        for w in &self.held {
            count += w.count_ones() as usize;
            if count >= n {
                return true;
            }
        }
        false
    }

    fn count(&self) -> usize {
        self.held.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Marks engine `e` as holding the block on `tiers`, counting the tiers into `mix`.
    #[inline]
    fn mark(&mut self, e: usize, tiers: TierSet, mix: &mut [TierMix]) {
        let (w, bit) = (e / 64, 1u64 << (e % 64));
        if tiers == GPU_ONLY {
            self.held[w] |= bit;
            if !self.gpu_only {
                self.gpu[w] |= bit;
            }
            return;
        }
        self.keep_tiers();
        self.held[w] |= bit;
        if tiers.contains(Tier::Gpu) {
            self.gpu[w] |= bit;
        }
        if tiers.contains(Tier::Cpu) {
            self.cpu[w] |= bit;
        }
        mix[e].by_set[tiers.bits() as usize] += 1;
    }

    /// `self = keep ∩ d` (`keep`: every engine if `None`) with the tiers of `d`, counting the
    /// tier sets of the engines not on GPU alone into `mix`. `self` must be freshly reset.
    /// Whether any engine is set.
    #[inline]
    fn take_dense(&mut self, keep: Option<&[u64]>, d: &DenseBits, mix: &mut [TierMix]) -> bool {
        let n = d.words().min(self.held.len());
        let (held, src) = (&mut self.held[..n], &d.held()[..n]);
        let mut any = 0u64;
        if !d.mixed() {
            // Every holder on GPU alone: one word to read, nothing to count.
            match keep {
                Some(keep) => {
                    for ((h, &s), &k) in held.iter_mut().zip(src).zip(&keep[..n]) {
                        *h = s & k;
                        any |= *h;
                    }
                }
                None => {
                    held.copy_from_slice(src);
                    any = src.iter().fold(0, |a, &s| a | s);
                }
            }
            return any != 0;
        }
        self.keep_tiers();
        for w in 0..n {
            any |= self.take_mixed_word(w, keep.map_or(u64::MAX, |k| k[w]), d, mix);
        }
        any != 0
    }

    /// Word `w` of a block whose holders are not all on GPU alone, restricted to `keep`: held,
    /// GPU and CPU bits, then the tier sets of the engines not on GPU alone counted into `mix`.
    #[inline]
    fn take_mixed_word(&mut self, w: usize, keep: u64, d: &DenseBits, mix: &mut [TierMix]) -> u64 {
        let held = keep & d.held()[w];
        let gpu = held & d.on(Tier::Gpu)[w];
        let cpu = held & d.on(Tier::Cpu)[w];
        let disk = held & d.on(Tier::Disk)[w];
        self.held[w] = held;
        self.gpu[w] = gpu;
        self.cpu[w] = cpu;
        let mut odd = cpu | disk | (held & !gpu);
        while odd != 0 {
            let b = odd.trailing_zeros();
            let set = ((gpu >> b) & 1) | ((cpu >> b) & 1) << 1 | ((disk >> b) & 1) << 2;
            mix[w * 64 + b as usize].by_set[set as usize] += 1;
            odd &= odd - 1;
        }
        held
    }

    /// Loads block 0's holders as the active set, starting each one's tier counts afresh.
    fn load(&mut self, holders: &Holders, dense: Option<&DenseBits>, mix: &mut [TierMix]) {
        for h in holders.as_slice() {
            mix[h.engine() as usize] = TierMix::default();
        }
        match dense {
            Some(d) => {
                self.take_dense(None, d, mix);
            }
            None => {
                for h in holders.as_slice() {
                    self.mark(h.engine() as usize, h.tiers(), mix);
                }
            }
        }
    }

    /// `self = active ∩ holders`, with the tiers of `holders`. `self` must be freshly reset.
    #[inline]
    fn intersect(
        &mut self,
        active: &Bits,
        holders: &Holders,
        dense: Option<&DenseBits>,
        mix: &mut [TierMix],
    ) -> bool {
        match dense {
            Some(d) => self.take_dense(Some(&active.held), d, mix),
            None => {
                let mut any = 0u64;
                for h in holders.as_slice() {
                    let e = h.engine() as usize;
                    let bit = 1u64 << (e % 64);
                    if active.held[e / 64] & bit != 0 {
                        self.mark(e, h.tiers(), mix);
                        any |= bit;
                    }
                }
                any != 0
            }
        }
    }
}

#[derive(Default)]
struct Scratch {
    active: Bits,
    next: Bits,
    /// Per engine: the tier sets of its matched blocks so far (valid for engines of block 0).
    mix: Vec<TierMix>,
    /// [`Rows::push_group`]'s candidates, `rank << 32 | engine`.
    picked: Vec<u64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Where a walk's rows go, and how many can make the answer.
struct Rows<'a> {
    out: &'a mut Vec<RawMatch>,
    /// The answer's length (`usize::MAX`: every row).
    limit: usize,
    /// The shard's name rank per engine (the order within a group of equal `matched`).
    rank: &'a [u32],
    picked: &'a mut Vec<u64>,
}

impl Rows<'_> {
    /// Pushes a row matching `matched` blocks for every engine set in `active` and not in
    /// `keep`, the engines that go on matching. Each of those beats every row pushed here, so
    /// when fewer places of the `limit` are left after them than there are rows, only the
    /// rows first by name rank are pushed: the rest cannot make the answer. (A prefix the
    /// whole fleet holds then costs a selection over packed integers, not a row per engine
    /// to order afterwards.)
    #[inline]
    fn push_group(&mut self, active: &Bits, keep: Option<&Bits>, matched: u32, mix: &[TierMix]) {
        let dropped = |w: usize| active.held[w] & !keep.map_or(0, |k| k.held[w]);
        if self.limit != usize::MAX {
            let room = self.limit.saturating_sub(keep.map_or(0, Bits::count));
            let rows: usize = (0..active.held.len())
                .map(|w| dropped(w).count_ones() as usize)
                .sum();
            if rows > room {
                self.picked.clear();
                for w in 0..active.held.len() {
                    let mut bits = dropped(w);
                    while bits != 0 {
                        let engine = (w * 64) as u32 + bits.trailing_zeros();
                        let rank = u64::from(self.rank[engine as usize]);
                        self.picked.push(rank << 32 | u64::from(engine));
                        bits &= bits - 1;
                    }
                }
                if room > 0 {
                    self.picked.select_nth_unstable(room - 1);
                }
                for i in 0..room {
                    let engine = self.picked[i] as u32;
                    self.push(active, engine, matched, mix);
                }
                return;
            }
        }
        for w in 0..active.held.len() {
            let mut bits = dropped(w);
            while bits != 0 {
                let engine = (w * 64) as u32 + bits.trailing_zeros();
                self.push(active, engine, matched, mix);
                bits &= bits - 1;
            }
        }
    }

    #[inline]
    fn push(&mut self, active: &Bits, engine: u32, matched: u32, mix: &[TierMix]) {
        let e = engine as usize;
        self.out.push(RawMatch {
            engine,
            matched,
            tier: active.tier_at(e / 64, 1u64 << (e % 64)),
            mix: mix[e],
        });
    }
}

thread_local! {
    /// [`sort_by_rank`]'s table: per name rank, the index of its row in the group, or `NONE`.
    static RANK_SLOTS: RefCell<(Vec<u32>, Vec<RawMatch>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Orders `group` (rows of distinct engines) by `rank[engine]`, a permutation of the shard's
/// engines. A group that holds a good share of the shard's engines (a prefix the whole fleet
/// shares) is ordered by one pass over a rank-indexed table, O(engines), instead of a
/// comparison sort's O(g log g) random loads of ranks; a small group is sorted.
fn sort_by_rank(group: &mut [RawMatch], rank: &[u32]) {
    const NONE: u32 = u32::MAX;
    let key = |m: &RawMatch| rank[m.engine as usize];
    if group.is_sorted_by_key(key) {
        return;
    }
    if group.len() < 32 || rank.len() > group.len() * 8 {
        group.sort_unstable_by_key(key);
        return;
    }
    RANK_SLOTS.with(|cell| {
        let (slots, sorted) = &mut *cell.borrow_mut();
        slots.clear();
        slots.resize(rank.len(), NONE);
        for (i, m) in group.iter().enumerate() {
            slots[key(m) as usize] = i as u32;
        }
        sorted.clear();
        sorted.extend(
            slots
                .iter()
                .filter(|&&i| i != NONE)
                .map(|&i| group[i as usize]),
        );
        group.copy_from_slice(sorted);
    });
}

impl Shard {
    /// [`Shard::lookup`], sorted by `matched` descending then engine name, and cut to the best
    /// `limit` rows (`usize::MAX`: all). Only the groups of equal `matched` that reach into the
    /// first `limit` rows are ordered, and of the last one only what is kept: an answer naming
    /// a whole fleet costs a sort of the rows returned, not of every engine that matched.
    pub fn lookup_sorted(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize) {
        self.lookup_sorted_with(keys, out, limit, L2Access::Prefetched(None));
    }

    /// [`Shard::lookup_sorted`], getting the L2 rows it needs as `l2` says.
    pub fn lookup_sorted_with(
        &self,
        keys: &[u64],
        out: &mut Vec<RawMatch>,
        limit: usize,
        l2: L2Access<'_>,
    ) {
        let start = out.len();
        self.lookup_best(keys, out, limit, l2);
        // `lookup_best` emits rows grouped by `matched` ascending: reversing the whole run puts the
        // groups in descending order, then each (small) group is ordered by name rank.
        let rows = &mut out[start..];
        rows.reverse();
        let rank = &self.name_rank;
        let key = |m: &RawMatch| rank[m.engine as usize];
        let mut i = 0;
        while i < rows.len() && i < limit {
            let matched = rows[i].matched;
            let end = i + rows[i..].partition_point(|m| m.matched == matched);
            let group = &mut rows[i..end];
            // Engines often join in name order (engine-000, engine-001, ...): then a reversed
            // group is just backwards, and reversing it again is the whole sort.
            group.reverse();
            let want = limit - i;
            if want < group.len() {
                group.select_nth_unstable_by_key(want - 1, key);
                group[..want].sort_unstable_by_key(key);
            } else {
                sort_by_rank(group, rank);
            }
            i = end;
        }
        out.truncate(start + (out.len() - start).min(limit));
    }

    /// For each engine holding `keys[0]`: the longest run of leading `keys` it holds. Rows are
    /// appended to `out` in ascending `matched` order.
    pub fn lookup(&self, keys: &[u64], out: &mut Vec<RawMatch>) {
        self.lookup_best(keys, out, usize::MAX, L2Access::Prefetched(None));
    }

    /// [`Shard::lookup`], leaving out rows that cannot be among the best `limit`: an engine
    /// that drops out at block `i` while at least `limit` others still hold block `i` is
    /// beaten by each of them (they match more blocks), so its row is never emitted. A router
    /// asking for the best few of a large fleet then pays for the rows near the end of the
    /// match, not for one row per engine holding the first block.
    fn lookup_best(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize, l2: L2Access<'_>) {
        let Some((&first, _)) = keys.split_first() else {
            return;
        };
        let now = self.lru_now();
        // A block only L2 holds is decoded into a spare (see `resolve`).
        let (mut spare0, mut spare) = (Holders::default(), Holders::default());
        let Some(h0) = self.resolve(first, now, &mut spare0, l2) else {
            return;
        };
        let words = self.engines.len().div_ceil(64).max(1);
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let Scratch {
                active,
                next,
                mix,
                picked,
            } = &mut *guard;
            let mut rows = Rows {
                out,
                limit,
                rank: &self.name_rank,
                picked,
            };
            for &key in keys.iter().skip(1).take(PREFETCH_AHEAD) {
                self.table.prefetch(key);
            }
            if mix.len() < words * 64 {
                mix.resize(words * 64, TierMix::default());
            }
            active.reset(words);
            active.load(h0, self.dense_of(first, h0), mix);
            for (i, key) in keys.iter().enumerate().skip(1) {
                if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
                    self.table.prefetch(ahead);
                }
                let Some(h) = self.resolve(*key, now, &mut spare, l2) else {
                    rows.push_group(active, None, i as u32, mix);
                    return;
                };
                next.reset(words);
                let any = next.intersect(active, h, self.dense_of(*key, h), mix);
                if limit == usize::MAX || !next.holds_at_least(limit) {
                    rows.push_group(active, Some(next), i as u32, mix);
                }
                if !any {
                    return;
                }
                std::mem::swap(active, next);
            }
            rows.push_group(active, None, keys.len() as u32, mix);
        });
    }

    /// The holders of block `key`: L1's (stamping the entry as used at `now`), else L2's
    /// decoded into `spare` when the shard has spilled to L2, as `l2` says.
    #[inline]
    fn resolve<'a>(
        &'a self,
        key: u64,
        now: u32,
        spare: &'a mut Holders,
        l2: L2Access<'_>,
    ) -> Option<&'a Holders> {
        if let Some(b) = self.table.blocks.get(key) {
            if now != 0 && b.used.load(Relaxed) != now {
                b.used.store(now, Relaxed);
            }
            return Some(&b.holders);
        }
        if !self.is_spilled() {
            return None;
        }
        let pre = match l2 {
            L2Access::Prefetched(pre) => pre,
            L2Access::MemoryOnly(missed) => {
                let Some(found) = self.read_l2_cached_for_lookup(key, spare) else {
                    missed.set(true);
                    return None;
                };
                return found.then_some(&*spare);
            }
        };
        match self.prefetched(pre, key) {
            Some(row) => {
                self.take_l2_row(key, row?, spare);
                Some(&*spare)
            }
            None => self.read_l2_for_lookup(key, spare).then_some(&*spare),
        }
    }

    #[inline]
    fn dense_of(&self, key: u64, holders: &Holders) -> Option<&DenseBits> {
        if holders.len() >= 16 {
            self.table.dense.get(key)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A permutation of `0..n` from a small xorshift generator.
    fn shuffled(n: u32, seed: &mut u64) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            v.swap(i, (*seed % (i as u64 + 1)) as usize);
        }
        v
    }

    #[test]
    fn rank_order_matches_a_sort_by_rank_whichever_way_it_is_taken() {
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        // (engines, group size): small groups, groups that are a small share of many engines
        // (comparison sort), and groups that are most of the engines (the rank table).
        for (engines, size) in [(10, 5), (1000, 20), (5000, 100), (700, 650), (64, 64)] {
            let rank = shuffled(engines, &mut seed);
            let members = shuffled(engines, &mut seed);
            let mut group: Vec<RawMatch> = members[..size]
                .iter()
                .map(|&engine| RawMatch {
                    engine,
                    matched: 3,
                    tier: Tier::Gpu,
                    mix: TierMix::default(),
                })
                .collect();
            let mut want = group.clone();
            want.sort_by_key(|m| rank[m.engine as usize]);
            sort_by_rank(&mut group, &rank);
            assert_eq!(group, want, "{engines} engines, {size} rows");
        }
    }
}
