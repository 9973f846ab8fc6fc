//! The longest-prefix lookup: walks the query's blocks, intersecting the holders of each with
//! the engines still matching, in per-thread scratch bitsets, and emits a row per engine where
//! its run ends.

use super::{PREFETCH_AHEAD, RawMatch, Shard};
use crate::event::Tier;
use crate::index::holders::{DenseBits, Holders};
use std::cell::RefCell;
use std::sync::atomic::Ordering::Relaxed;

/// Scratch bitsets for one lookup, reused per thread so a lookup allocates nothing but its
/// answer.
#[derive(Default)]
struct Bits {
    held: Vec<u64>,
    cpu: Vec<u64>,
    disk: Vec<u64>,
}

impl Bits {
    fn reset(&mut self, words: usize) {
        for v in [&mut self.held, &mut self.cpu, &mut self.disk] {
            v.clear();
            v.resize(words, 0);
        }
    }

    #[inline]
    fn tier_at(&self, w: usize, bit: u64) -> Tier {
        if self.cpu[w] & bit != 0 {
            Tier::Cpu
        } else if self.disk[w] & bit != 0 {
            Tier::Disk
        } else {
            Tier::Gpu
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

    /// Loads block 0's holders as the active set.
    fn load(&mut self, holders: &Holders, dense: Option<&DenseBits>) {
        match dense {
            Some(d) => {
                let n = d.words().min(self.held.len());
                self.held[..n].copy_from_slice(&d.held()[..n]);
                self.cpu[..n].copy_from_slice(&d.cpu()[..n]);
                self.disk[..n].copy_from_slice(&d.disk()[..n]);
            }
            None => {
                for h in holders.as_slice() {
                    let e = h.engine() as usize;
                    let (w, bit) = (e / 64, 1u64 << (e % 64));
                    self.held[w] |= bit;
                    match h.tier() {
                        Tier::Gpu => {}
                        Tier::Cpu => self.cpu[w] |= bit,
                        Tier::Disk => self.disk[w] |= bit,
                    }
                }
            }
        }
    }

    /// `self = active ∩ holders`, with the tiers of `holders`. `self` must be zeroed.
    #[inline]
    fn intersect(&mut self, active: &Bits, holders: &Holders, dense: Option<&DenseBits>) -> bool {
        let mut any = 0u64;
        match dense {
            Some(d) => {
                let n = d.words().min(self.held.len());
                for w in 0..n {
                    let held = active.held[w] & d.held()[w];
                    self.held[w] = held;
                    self.cpu[w] = held & d.cpu()[w];
                    self.disk[w] = held & d.disk()[w];
                    any |= held;
                }
            }
            None => {
                for h in holders.as_slice() {
                    let e = h.engine() as usize;
                    let (w, bit) = (e / 64, 1u64 << (e % 64));
                    if active.held[w] & bit != 0 {
                        self.held[w] |= bit;
                        any |= bit;
                        match h.tier() {
                            Tier::Gpu => {}
                            Tier::Cpu => self.cpu[w] |= bit,
                            Tier::Disk => self.disk[w] |= bit,
                        }
                    }
                }
            }
        }
        any != 0
    }
}

#[derive(Default)]
struct Scratch {
    active: Bits,
    next: Bits,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Pushes a row for every engine set in `held` (and not in `keep`, if given).
#[inline]
fn emit(active: &Bits, keep: Option<&Bits>, matched: u32, out: &mut Vec<RawMatch>) {
    for w in 0..active.held.len() {
        let mut dropped = active.held[w] & !keep.map_or(0, |k| k.held[w]);
        while dropped != 0 {
            let b = dropped.trailing_zeros();
            let bit = 1u64 << b;
            out.push(RawMatch {
                engine: (w * 64) as u32 + b,
                matched,
                tier: active.tier_at(w, bit),
            });
            dropped &= dropped - 1;
        }
    }
}

impl Shard {
    /// [`Shard::lookup`], sorted by `matched` descending then engine name, and cut to the best
    /// `limit` rows (`usize::MAX`: all). Only the groups of equal `matched` that reach into the
    /// first `limit` rows are ordered, and of the last one only what is kept: an answer naming
    /// a whole fleet costs a sort of the rows returned, not of every engine that matched.
    pub fn lookup_sorted(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize) {
        let start = out.len();
        self.lookup_best(keys, out, limit);
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
            } else if !group.is_sorted_by_key(key) {
                group.sort_unstable_by_key(key);
            }
            i = end;
        }
        out.truncate(start + (out.len() - start).min(limit));
    }

    /// For each engine holding `keys[0]`: the longest run of leading `keys` it holds. Rows are
    /// appended to `out` in ascending `matched` order.
    pub fn lookup(&self, keys: &[u64], out: &mut Vec<RawMatch>) {
        self.lookup_best(keys, out, usize::MAX);
    }

    /// [`Shard::lookup`], leaving out rows that cannot be among the best `limit`: an engine
    /// that drops out at block `i` while at least `limit` others still hold block `i` is
    /// beaten by each of them (they match more blocks), so its row is never emitted. A router
    /// asking for the best few of a large fleet then pays for the rows near the end of the
    /// match, not for one row per engine holding the first block.
    fn lookup_best(&self, keys: &[u64], out: &mut Vec<RawMatch>, limit: usize) {
        let Some((&first, _)) = keys.split_first() else {
            return;
        };
        let now = self.lru_now();
        // A block only L2 holds is decoded into a spare (see `resolve`).
        let (mut spare0, mut spare) = (Holders::default(), Holders::default());
        let Some(h0) = self.resolve(first, now, &mut spare0) else {
            return;
        };
        let words = self.engines.len().div_ceil(64).max(1);
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let Scratch { active, next } = &mut *guard;
            for &key in keys.iter().skip(1).take(PREFETCH_AHEAD) {
                self.table.prefetch(key);
            }
            active.reset(words);
            active.load(h0, self.dense_of(first, h0));
            for (i, key) in keys.iter().enumerate().skip(1) {
                if let Some(&ahead) = keys.get(i + PREFETCH_AHEAD) {
                    self.table.prefetch(ahead);
                }
                let Some(h) = self.resolve(*key, now, &mut spare) else {
                    emit(active, None, i as u32, out);
                    return;
                };
                next.reset(words);
                let any = next.intersect(active, h, self.dense_of(*key, h));
                if limit == usize::MAX || !next.holds_at_least(limit) {
                    emit(active, Some(next), i as u32, out);
                }
                if !any {
                    return;
                }
                std::mem::swap(active, next);
            }
            emit(active, None, keys.len() as u32, out);
        });
    }

    /// The holders of block `key`: L1's (stamping the entry as used at `now`), else L2's
    /// decoded into `spare` when the shard has spilled to L2.
    #[inline]
    fn resolve<'a>(&'a self, key: u64, now: u32, spare: &'a mut Holders) -> Option<&'a Holders> {
        if let Some(b) = self.table.blocks.get(key) {
            if now != 0 && b.used.load(Relaxed) != now {
                b.used.store(now, Relaxed);
            }
            return Some(&b.holders);
        }
        if !self.is_spilled() {
            return None;
        }
        self.read_l2_for_lookup(key, spare).then_some(&*spare)
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
