//! Holdings by tier in the index: what an engine holds per tier, how a matched prefix sits on
//! the tiers it is held on, and the weights a router ranks prefixes by. The tier sets
//! themselves, and the weights a lookup may give, are part of the wire contract
//! ([`crate::event::TierSet`], [`TierWeights`]).

pub use crate::event::TierWeights;
use crate::event::{Tier, TierSet};

/// How an engine holds the blocks of a matched prefix: `by_set[s]` counts the blocks it holds
/// on exactly tier set `s` (bits `Tier as u8`), for the sets other than GPU alone; the rest
/// of the prefix is on GPU alone. Enough to report blocks per tier and to score by the best
/// weight of each block's tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierMix {
    pub by_set: [u32; 8],
}

impl TierMix {
    /// Blocks of a `matched`-block prefix held on `tier` (a block on two tiers counts on both).
    pub fn on(&self, tier: Tier, matched: u32) -> u32 {
        let mut n = 0;
        for (set, &count) in self.by_set.iter().enumerate() {
            if TierSet::from_bits(set as u8).contains(tier) {
                n += count;
            }
        }
        if tier == Tier::Gpu {
            n += self.gpu_only(matched);
        }
        n
    }

    /// Σ over the prefix's blocks of the highest weight among the tiers each is held on.
    pub fn score(&self, matched: u32, weights: &TierWeights) -> f64 {
        let mut score = weights.of(Tier::Gpu) * self.gpu_only(matched) as f64;
        for (set, &count) in self.by_set.iter().enumerate() {
            if count > 0 {
                score += weights.best(TierSet::from_bits(set as u8)) * count as f64;
            }
        }
        score
    }

    fn gpu_only(&self, matched: u32) -> u32 {
        matched - self.by_set.iter().sum::<u32>()
    }
}

/// What an engine holds in a shard: memberships, and memberships per tier (a block held on
/// two tiers counts once in `blocks` and once on each tier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holdings {
    pub blocks: u64,
    pub on: [u64; 3],
}

impl Holdings {
    /// Accounts for one membership going from `before` to `after` tiers (empty: not held).
    #[inline]
    pub fn change(&mut self, before: TierSet, after: TierSet) {
        self.blocks = self.blocks + !after.is_empty() as u64 - !before.is_empty() as u64;
        for tier in before.without(after).iter() {
            self.on[tier as usize] -= 1;
        }
        for tier in after.without(before).iter() {
            self.on[tier as usize] += 1;
        }
    }
}
