//! Row layouts of the store. Every integer is big-endian so keys sort by shard, then by the
//! fields that follow, and one shard's rows (or one engine's map in one partition) are a
//! contiguous key range: loads are prefix scans, a clear is one range delete.
//!
//! | column family | key | value |
//! | --- | --- | --- |
//! | `blocks` | shard u16, block key u64 | partition id u32, then (engine id u32, tiers u8)* |
//! | `maps` | shard u16, engine id u32, partition id u32, engine hash u64 | block key u64 |
//! | `offsets` | shard u16, source len u16, source, partition i32 | next offset i64 |
//! | `meta` | tag u8, ... (see the `TAG_*` constants) | |
//!
//! Engine and partition ids are the store's durable ids (see `registry.rs`), never shard-local
//! ids, so rows mean the same after a restart that interns in another order.
//!
//! A block row carries its partition once (4 bytes per block, not per membership): a block key
//! belongs to exactly one partition (keys are namespaced by the partition seed), and the load
//! needs it to rebuild the per-partition counters without a join against the map rows.

use super::StoreError;
use crate::event::{PartitionKey, Tier, TierSet};

pub const CF_BLOCKS: &str = "blocks";
pub const CF_MAPS: &str = "maps";
pub const CF_OFFSETS: &str = "offsets";
pub const CF_META: &str = "meta";

/// `meta` key of the shard count the store was written with (u32 value).
pub const KEY_SHARDS: &[u8] = b"\0shards";
/// `meta` key of the chain-hash seed the store was written with (u64 value).
pub const KEY_SEED: &[u8] = b"\0seed";
/// `meta`: engine id u32 → engine name.
pub const TAG_ENGINE_BY_ID: u8 = 1;
/// `meta`: engine name → engine id u32.
pub const TAG_ENGINE_BY_NAME: u8 = 2;
/// `meta`: partition id u32 → encoded partition key.
pub const TAG_PARTITION_BY_ID: u8 = 3;
/// `meta`: encoded partition key → partition id u32.
pub const TAG_PARTITION_BY_KEY: u8 = 4;
/// `meta`: shard u16, engine id u32 → last seen i64, then partition id u32*.
pub const TAG_SHARD_ENGINE: u8 = 5;
/// `meta`: shard u16, partition id u32 → empty (the partition exists in the shard, counters
/// or not: `/v1/stats` lists it).
pub const TAG_SHARD_PARTITION: u8 = 6;
/// `meta`: encoded (tenant, model, "") partition key → the model's pinned block size (u32).
pub const TAG_BLOCK_SIZE: u8 = 7;

pub fn block_key(shard: u16, key: u64) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[..2].copy_from_slice(&shard.to_be_bytes());
    k[2..].copy_from_slice(&key.to_be_bytes());
    k
}

pub fn map_key(shard: u16, engine: u32, partition: u32, hash: u64) -> [u8; 18] {
    let mut k = [0u8; 18];
    k[..10].copy_from_slice(&map_prefix(shard, engine, partition));
    k[10..].copy_from_slice(&hash.to_be_bytes());
    k
}

/// The key prefix of one engine's map in one partition.
pub fn map_prefix(shard: u16, engine: u32, partition: u32) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[..2].copy_from_slice(&shard.to_be_bytes());
    k[2..6].copy_from_slice(&engine.to_be_bytes());
    k[6..10].copy_from_slice(&partition.to_be_bytes());
    k
}

/// The key of a (shard, source, partition) offset row, written into `out`.
pub fn offset_key(shard: u16, source: &str, partition: i32, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&shard.to_be_bytes());
    // Sources are config names; a longer one is cut (never happens in practice, never panics).
    let src = &source.as_bytes()[..source.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(src.len() as u16).to_be_bytes());
    out.extend_from_slice(src);
    out.extend_from_slice(&partition.to_be_bytes());
}

/// `tag | shard | id`: the per-shard engine and partition rows in `meta`.
pub fn shard_row_key(tag: u8, shard: u16, id: u32) -> [u8; 7] {
    let mut k = [0u8; 7];
    k[0] = tag;
    k[1..3].copy_from_slice(&shard.to_be_bytes());
    k[3..].copy_from_slice(&id.to_be_bytes());
    k
}

pub fn shard_row_prefix(tag: u8, shard: u16) -> [u8; 3] {
    let mut k = [0u8; 3];
    k[0] = tag;
    k[1..3].copy_from_slice(&shard.to_be_bytes());
    k
}

pub fn id_key(tag: u8, id: u32) -> [u8; 5] {
    let mut k = [0u8; 5];
    k[0] = tag;
    k[1..].copy_from_slice(&id.to_be_bytes());
    k
}

pub fn tagged(tag: u8, bytes: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + bytes.len());
    k.push(tag);
    k.extend_from_slice(bytes);
    k
}

/// The smallest key greater than every key starting with `prefix` (`None`: no such key, the
/// prefix is all `0xff`).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.last_mut() {
        if *last < 0xff {
            *last += 1;
            return Some(end);
        }
        end.pop();
    }
    None
}

/// `tenant, model, adapter`, each as a u32 length and its bytes.
pub fn encode_partition(key: &PartitionKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + key.tenant.len() + key.model.len() + key.adapter.len());
    for s in [&key.tenant, &key.model, &key.adapter] {
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    out
}

pub fn decode_partition(mut bytes: &[u8]) -> Result<PartitionKey, StoreError> {
    let mut parts: [String; 3] = Default::default();
    for part in &mut parts {
        let len = u32_at(bytes, 0).ok_or_else(|| corrupt("partition key", bytes))? as usize;
        let s = bytes
            .get(4..4 + len)
            .ok_or_else(|| corrupt("partition key", bytes))?;
        *part = String::from_utf8(s.to_vec()).map_err(|_| corrupt("partition key", s))?;
        bytes = &bytes[4 + len..];
    }
    let [tenant, model, adapter] = parts;
    Ok(PartitionKey {
        tenant,
        model,
        adapter,
    })
}

/// The high bit of a holder's tier byte marks a tier set (bits `Tier as u8` below it). Rows
/// written before an engine could hold a block on several tiers carry a single tier's
/// number (0, 1, 2) instead; both read back the same.
const TIER_SET_FLAG: u8 = 0x80;

/// Appends one holder of a block row.
#[inline]
pub fn push_holder(out: &mut Vec<u8>, engine: u32, tiers: TierSet) {
    out.extend_from_slice(&engine.to_be_bytes());
    out.push(TIER_SET_FLAG | tiers.bits());
}

/// The tiers of a holder's tier byte, in either layout (see [`TIER_SET_FLAG`]).
#[inline]
fn tiers_of_byte(b: u8) -> TierSet {
    if b & TIER_SET_FLAG != 0 {
        TierSet::from_bits(b)
    } else {
        TierSet::of(Tier::from_bits(b as u32))
    }
}

/// The partition id and the (engine id, tiers) holders of a block row.
pub fn decode_block(
    value: &[u8],
) -> Result<(u32, impl Iterator<Item = (u32, TierSet)> + '_), StoreError> {
    let partition = u32_at(value, 0).ok_or_else(|| corrupt("block row", value))?;
    let rest = &value[4..];
    if !rest.len().is_multiple_of(5) {
        return Err(corrupt("block row", value));
    }
    let holders = rest.chunks_exact(5).map(|c| {
        let engine = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        (engine, tiers_of_byte(c[4]))
    });
    Ok((partition, holders))
}

pub fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
pub fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}
pub fn i64_at(b: &[u8], at: usize) -> Option<i64> {
    u64_at(b, at).map(|v| v as i64)
}

pub fn corrupt(what: &'static str, bytes: &[u8]) -> StoreError {
    StoreError::Corrupt {
        what,
        detail: hex::encode(&bytes[..bytes.len().min(64)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_by_shard_then_fields() {
        assert!(block_key(1, u64::MAX) < block_key(2, 0));
        assert!(map_key(0, 1, 2, u64::MAX) < map_key(0, 1, 3, 0));
        let p = map_prefix(0, 1, 2);
        let end = prefix_end(&p).expect("end");
        assert!(map_key(0, 1, 2, u64::MAX).as_slice() < end.as_slice());
        assert!(end.as_slice() <= map_key(0, 1, 3, 0).as_slice());
        assert_eq!(prefix_end(&[0x01, 0xff]), Some(vec![0x02]));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
    }

    #[test]
    fn partition_keys_round_trip_and_reject_garbage() {
        let k = PartitionKey::new("t", "llama/3", "");
        assert_eq!(decode_partition(&encode_partition(&k)).ok(), Some(k));
        assert!(decode_partition(&[0, 0, 0, 9, b'x']).is_err());
        assert!(decode_block(&[0, 0, 0, 1, 0, 0]).is_err());
    }

    #[test]
    fn block_rows_carry_tier_sets_and_read_single_tier_rows() {
        let both = TierSet::of(Tier::Gpu).with(Tier::Cpu);
        let mut row = 7u32.to_be_bytes().to_vec();
        push_holder(&mut row, 3, both);
        // A row from before tier sets: engine 4 on disk, engine 5 on GPU.
        row.extend_from_slice(&[0, 0, 0, 4, Tier::Disk as u8, 0, 0, 0, 5, 0]);
        let (partition, holders) = decode_block(&row).unwrap();
        assert_eq!(partition, 7);
        assert_eq!(
            holders.collect::<Vec<_>>(),
            vec![
                (3, both),
                (4, TierSet::of(Tier::Disk)),
                (5, TierSet::of(Tier::Gpu))
            ]
        );
    }
}
