//! The one seeded random generator of the crate: the fleet simulator, the property and
//! fuzz-style tests and the benches all draw from it, so a seed names the same stream
//! everywhere, on every platform.

use super::fleet::VOCAB_SIZE;

/// SplitMix64: tiny, fast, and good enough for a workload generator; keeps the crate free of a
/// `rand` dependency and the stream identical on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; returns 0 for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// In `0..n`, skewed towards 0 (roughly Zipf-like popularity: index 0 is the hot one).
    pub fn skewed(&mut self, n: usize) -> usize {
        let k = self.below(n);
        self.below(k + 1)
    }

    /// `n` random token ids.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % u64::from(VOCAB_SIZE)) as u32)
            .collect()
    }
}
