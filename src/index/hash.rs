//! Block keys: how kvindex names a block, independent of any engine's own hashing.
//!
//! Engines hash blocks with per-process seeds, so their hashes only identify a block *on that
//! engine*. kvindex computes its own key for every block from the block's content and its
//! position in the chain: `key_i = mix(key_{i-1}, digest(tokens_i))`, where `key_{-1}` is the
//! partition's seed. Two engines that cached the same prefix of the same model and adapter
//! therefore hold the same keys, and the same tokens under another adapter never collide.

use crate::event::PartitionKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Domain separators so a chained key, a raw-hash key and a seed never coincide by design.
const CHAIN_SALT: u64 = 0x9e37_79b9_7f4a_7c15;
const CONTENT_SALT: u64 = 0xc2b2_ae3d_27d4_eb4f;
const RAW_SALT: u64 = 0x1656_67b1_9e37_79f9;
const EXTRA_SALT: u64 = 0x27d4_eb2f_1656_67c5;

/// wyhash's 128-bit multiply-fold: a full-avalanche mix of two words in about a nanosecond.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let m = (a as u128).wrapping_mul(b as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

/// The key of a block whose predecessor has key `prev` and whose content digest is `digest`.
#[inline(always)]
pub fn chain(prev: u64, digest: u64) -> u64 {
    fold_mul(prev ^ CHAIN_SALT, digest ^ CONTENT_SALT)
}

/// The key of a block known only by a producer's raw hash (hash-only producers).
#[inline(always)]
pub fn raw(partition_seed: u64, engine_hash: u64) -> u64 {
    fold_mul(partition_seed ^ RAW_SALT, engine_hash ^ CHAIN_SALT)
}

/// The content digest of one block's token ids.
#[inline]
pub fn token_digest(tokens: &[u32]) -> u64 {
    // Tokens are hashed as their little-endian bytes; on little-endian targets that is the
    // slice's own memory, so no copy is made.
    if cfg!(target_endian = "little") {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8; the slice covers
        // exactly the tokens' memory.
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
        };
        xxh3_64(bytes)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64(&bytes)
    }
}

/// The seed every chain of `partition` starts from, derived from the configured `seed` and the
/// partition's names (not from interned ids, so it is stable across restarts and shards).
pub fn partition_seed(seed: u64, partition: &PartitionKey) -> u64 {
    let mut buf = Vec::with_capacity(
        partition.tenant.len() + partition.model.len() + partition.adapter.len() + 24,
    );
    for part in [&partition.tenant, &partition.model, &partition.adapter] {
        buf.extend_from_slice(&(part.len() as u64).to_le_bytes());
        buf.extend_from_slice(part.as_bytes());
    }
    xxh3_64_with_seed(&buf, seed)
}

/// The content digest of a block whose tokens digest to `tokens` and whose extra keys (see
/// `event::extra`) digest to `extras`: a block without extras (0) keeps its token digest, so
/// its key is the one it always had.
#[inline(always)]
pub fn with_extras(tokens: u64, extras: u64) -> u64 {
    if extras == 0 {
        tokens
    } else {
        fold_mul(tokens ^ EXTRA_SALT, extras)
    }
}

/// Chain keys for consecutive content digests, starting after `prev`.
pub fn chain_keys(prev: u64, digests: impl IntoIterator<Item = u64>, out: &mut Vec<u64>) {
    let mut key = prev;
    for d in digests {
        key = chain(key, d);
        out.push(key);
    }
}

/// Chain keys for every full block of `token_ids` (a trailing partial block is not keyed:
/// engines only cache full blocks). `extras` holds each block's extras digest, or is empty
/// when no block has extras.
pub fn token_chain_keys(
    prev: u64,
    token_ids: &[u32],
    block_size: usize,
    extras: &[u64],
    out: &mut Vec<u64>,
) {
    if block_size == 0 {
        return;
    }
    let digests = token_ids.chunks_exact(block_size).map(token_digest);
    if extras.is_empty() {
        chain_keys(prev, digests, out);
    } else {
        let extra = extras.iter().copied().chain(std::iter::repeat(0));
        chain_keys(
            prev,
            digests.zip(extra).map(|(t, e)| with_extras(t, e)),
            out,
        );
    }
}

/// A `BuildHasher` for u64 keys: one multiply-fold, enough to spread well-mixed or sequential
/// keys over hashbrown's buckets and control bytes, several times cheaper than SipHash.
#[derive(Clone, Copy, Default, Debug)]
pub struct U64Build;

/// The hasher [`U64Build`] builds. Only `write_u64` is fast; other writes fall back to xxh3.
#[derive(Default)]
pub struct U64Hasher(u64);

impl std::hash::BuildHasher for U64Build {
    type Hasher = U64Hasher;
    #[inline(always)]
    fn build_hasher(&self) -> U64Hasher {
        U64Hasher(0)
    }
}

impl std::hash::Hasher for U64Hasher {
    #[inline(always)]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline(always)]
    fn write_u64(&mut self, v: u64) {
        self.0 = fold_mul(v ^ self.0, 0x2d35_8dcc_aa6c_78a5);
    }
    #[inline(always)]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh3_64_with_seed(bytes, self.0);
    }
}

/// A hashbrown map keyed by u64 with the cheap hasher.
pub type U64Map<V> = hashbrown::HashMap<u64, V, U64Build>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_position_and_partition() {
        let p = partition_seed(7, &PartitionKey::new("t", "m", ""));
        let q = partition_seed(7, &PartitionKey::new("t", "m", "lora"));
        assert_ne!(p, q);
        let a = chain(p, 42);
        let b = chain(a, 42);
        assert_ne!(
            a, b,
            "the same content at another position is another block"
        );
        assert_ne!(chain(q, 42), a);
        assert_ne!(raw(p, 42), chain(p, 42));
    }

    #[test]
    fn partition_seed_is_unambiguous() {
        let a = partition_seed(1, &PartitionKey::new("ab", "c", ""));
        let b = partition_seed(1, &PartitionKey::new("a", "bc", ""));
        assert_ne!(a, b);
        assert_ne!(
            partition_seed(1, &PartitionKey::new("a", "b", "")),
            partition_seed(2, &PartitionKey::new("a", "b", ""))
        );
    }

    #[test]
    fn token_keys_cover_full_blocks_only() {
        let mut out = Vec::new();
        token_chain_keys(1, &[1, 2, 3, 4, 5], 2, &[], &mut out);
        assert_eq!(out.len(), 2);
        let mut again = Vec::new();
        chain_keys(
            1,
            [token_digest(&[1, 2]), token_digest(&[3, 4])],
            &mut again,
        );
        assert_eq!(out, again);
    }

    #[test]
    fn extras_change_a_block_and_every_block_after_it() {
        let tokens = [1, 2, 3, 4, 5, 6];
        let mut plain = Vec::new();
        token_chain_keys(1, &tokens, 2, &[], &mut plain);
        let mut zeros = Vec::new();
        token_chain_keys(1, &tokens, 2, &[0, 0, 0], &mut zeros);
        assert_eq!(plain, zeros, "no extras keep the keys blocks always had");
        let mut salted = Vec::new();
        token_chain_keys(1, &tokens, 2, &[0, 9, 0], &mut salted);
        assert_eq!(salted[0], plain[0]);
        assert_ne!(salted[1], plain[1]);
        assert_ne!(
            salted[2], plain[2],
            "a changed block changes its descendants"
        );
    }
}
