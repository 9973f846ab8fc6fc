//! Protobuf decoder: `kvindex.v1.CacheEvent` / `CacheEventBatch` (wire-compatible with
//! inference-cache's `CacheEvent`) to [`Event`], plus the [`Event`] → message mapping the
//! encoder uses.
//!
//! # Single event or batch
//!
//! A body holds either one `CacheEvent` or one `CacheEventBatch`. They are told apart by the
//! first byte: a batch's only field is `events = 1` (length-delimited), tag `0x0a`, while a
//! `CacheEvent`'s field 1 (`type`) is a varint, tag `0x08`. A well-formed `CacheEvent` can
//! therefore never start with `0x0a` (a length-delimited field 1 is a wire-type error for it);
//! whatever field a `CacheEvent` writes first (`0x08`, `0x12` for `replica_id`, `0x1a`, ...),
//! its first byte differs from a batch's. The rule:
//!
//! 1. first byte `0x0a`: decode as `CacheEventBatch`; if that succeeds and every inner event
//!    converts, that is the result;
//! 2. otherwise decode as a single `CacheEvent`; if that fails too after step 1 was tried, the
//!    batch's error is returned (it is the more meaningful one for a body starting `0x0a`).

use super::{
    BlockContent, DecodeError, EngineHash, Event, EventKind, PartitionKey, Tier, engine_id,
};
use prost::Message;

/// The prost-generated `kvindex.v1` messages (from `proto/kvindex/v1/events.proto`).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/kvindex.v1.rs"));
}

use pb::cache_event::{Tier as PbTier, Type as PbType};

/// Tag byte of `CacheEventBatch.events` (field 1, wire type 2).
const BATCH_TAG: u8 = 0x0a;

/// Decodes a protobuf body (one `CacheEvent` or a `CacheEventBatch`) into events.
pub fn decode(bytes: &[u8]) -> Result<Vec<Event>, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    // One copy of the payload into a shared buffer; every `bytes` field is then a slice of it.
    let buf = bytes::Bytes::copy_from_slice(bytes);
    let mut batch_err = None;
    if bytes.first() == Some(&BATCH_TAG) {
        match decode_batch(buf.clone()) {
            Ok(events) => return Ok(events),
            Err(e) => batch_err = Some(e),
        }
    }
    match pb::CacheEvent::decode(buf) {
        Ok(msg) => from_pb(msg).map(|ev| vec![ev]),
        Err(e) => Err(batch_err.unwrap_or_else(|| DecodeError::Protobuf(e.to_string()))),
    }
}

fn decode_batch(bytes: bytes::Bytes) -> Result<Vec<Event>, DecodeError> {
    let batch =
        pb::CacheEventBatch::decode(bytes).map_err(|e| DecodeError::Protobuf(e.to_string()))?;
    batch.events.into_iter().map(from_pb).collect()
}

/// Maps a proto `Type` value to an [`EventKind`]; values this build does not know (including
/// `TYPE_UNSPECIFIED`) become `Unknown(v)`.
pub fn kind_from_i32(v: i32) -> EventKind {
    match PbType::try_from(v) {
        Ok(PbType::PrefixAdded) => EventKind::Stored,
        Ok(PbType::PrefixEvicted) => EventKind::Removed,
        Ok(PbType::ReplicaUpdated) => EventKind::ReplicaUpdated,
        Ok(PbType::AllCleared) => EventKind::AllCleared,
        Ok(PbType::Unspecified) | Err(_) => EventKind::Unknown(v),
    }
}

/// The proto `Type` value of an [`EventKind`] (`Unknown(v)` keeps `v`).
pub fn kind_to_i32(kind: EventKind) -> i32 {
    match kind {
        EventKind::Stored => PbType::PrefixAdded as i32,
        EventKind::Removed => PbType::PrefixEvicted as i32,
        EventKind::ReplicaUpdated => PbType::ReplicaUpdated as i32,
        EventKind::AllCleared => PbType::AllCleared as i32,
        EventKind::Unknown(v) => v,
    }
}

/// Maps a proto `Tier` value to a [`Tier`]: unspecified and unknown values are GPU.
pub fn tier_from_i32(v: i32) -> Tier {
    match PbTier::try_from(v) {
        Ok(PbTier::Cpu) => Tier::Cpu,
        Ok(PbTier::Disk) => Tier::Disk,
        Ok(PbTier::Gpu) | Ok(PbTier::Unspecified) | Err(_) => Tier::Gpu,
    }
}

/// The proto `Tier` value of a [`Tier`].
pub fn tier_to_i32(tier: Tier) -> i32 {
    match tier {
        Tier::Gpu => PbTier::Gpu as i32,
        Tier::Cpu => PbTier::Cpu as i32,
        Tier::Disk => PbTier::Disk as i32,
    }
}

/// Whether an event of `kind` must name its replica.
pub(crate) fn needs_replica(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::Stored | EventKind::Removed | EventKind::AllCleared
    )
}

/// Builds the [`BlockContent`] of a chain from its token ids and block size, checking the
/// contract `token_ids.len() == blocks * block_size` (empty tokens → hash-only).
pub(crate) fn content_from_tokens(
    token_ids: Vec<u32>,
    block_size: u32,
    blocks: usize,
) -> Result<BlockContent, DecodeError> {
    if token_ids.is_empty() {
        return Ok(BlockContent::HashesOnly);
    }
    if block_size == 0 {
        return Err(DecodeError::Field {
            field: "block_size",
            reason: "must be non-zero when token_ids is set".into(),
        });
    }
    let expected = usize::try_from(block_size)
        .ok()
        .and_then(|bs| bs.checked_mul(blocks));
    if expected != Some(token_ids.len()) {
        return Err(DecodeError::Field {
            field: "token_ids",
            reason: format!(
                "{} token ids for {blocks} blocks of {block_size} tokens",
                token_ids.len()
            ),
        });
    }
    Ok(BlockContent::Tokens {
        token_ids,
        block_size,
    })
}

/// Converts one decoded `CacheEvent` into an [`Event`] (the mapping in the module docs of
/// `event`): legacy `prefix_hash` stands in for an empty `block_hashes`.
pub fn from_pb(msg: pb::CacheEvent) -> Result<Event, DecodeError> {
    let kind = kind_from_i32(msg.r#type);
    if msg.replica_id.is_empty() && needs_replica(kind) {
        return Err(DecodeError::Field {
            field: "replica_id",
            reason: "empty".into(),
        });
    }
    let mut block_hashes = Vec::with_capacity(msg.block_hashes.len().max(1));
    for h in &msg.block_hashes {
        if h.is_empty() {
            return Err(DecodeError::Field {
                field: "block_hashes",
                reason: "empty hash".into(),
            });
        }
        block_hashes.push(EngineHash::from_bytes(h));
    }
    if block_hashes.is_empty() && !msg.prefix_hash.is_empty() {
        block_hashes.push(EngineHash::from_bytes(&msg.prefix_hash));
    }
    let parent_hash = if msg.parent_hash.is_empty() {
        None
    } else {
        Some(EngineHash::from_bytes(&msg.parent_hash))
    };
    let content = content_from_tokens(msg.token_ids, msg.block_size, block_hashes.len())?;
    Ok(Event {
        kind,
        engine: engine_id(&msg.replica_id, msg.dp_rank),
        partition: PartitionKey {
            tenant: msg.tenant_id,
            model: msg.model_id,
            adapter: msg.adapter_id,
        },
        adapter_scoped: msg.adapter_scoped,
        block_hashes,
        parent_hash,
        content,
        tier: tier_from_i32(msg.tier),
        timestamp_us: msg.timestamp_us,
        seq: msg.seq,
    })
}

/// Splits an engine id back into `(replica, dp_rank)`: the inverse of [`engine_id`] (an id
/// that [`engine_id`] could not have produced with a rank > 0 is a plain replica id).
pub fn split_engine_id(engine: &str) -> (&str, u32) {
    if let Some((replica, rank)) = engine.rsplit_once("#dp")
        && let Ok(n) = rank.parse::<u32>()
        && n > 0
        && rank == n.to_string()
    {
        return (replica, n);
    }
    (engine, 0)
}

/// Converts an [`Event`] into a `CacheEvent`. Hashes are written as 8-byte big-endian,
/// `prefix_hash` is set to the last hash of the chain for legacy readers, and
/// [`BlockContent::Digests`] (not expressible on the wire) is written as hash-only.
/// An engine hash on the wire: 8 bytes, big-endian.
fn hash_bytes(h: EngineHash) -> bytes::Bytes {
    bytes::Bytes::copy_from_slice(&h.0.to_be_bytes())
}

pub fn to_pb(ev: &Event) -> pb::CacheEvent {
    let (replica, dp_rank) = split_engine_id(&ev.engine);
    let (token_ids, block_size) = match &ev.content {
        BlockContent::Tokens {
            token_ids,
            block_size,
        } => (token_ids.clone(), *block_size),
        BlockContent::HashesOnly | BlockContent::Digests(_) => (Vec::new(), 0),
    };
    pb::CacheEvent {
        r#type: kind_to_i32(ev.kind),
        replica_id: replica.to_string(),
        model_id: ev.partition.model.clone(),
        tenant_id: ev.partition.tenant.clone(),
        prefix_hash: ev
            .block_hashes
            .last()
            .map(|h| hash_bytes(*h))
            .unwrap_or_default(),
        timestamp_us: ev.timestamp_us,
        adapter_id: ev.partition.adapter.clone(),
        adapter_scoped: ev.adapter_scoped,
        block_hashes: ev.block_hashes.iter().map(|h| hash_bytes(*h)).collect(),
        parent_hash: ev.parent_hash.map(hash_bytes).unwrap_or_default(),
        token_ids,
        block_size,
        tier: tier_to_i32(ev.tier),
        seq: ev.seq,
        dp_rank,
    }
}
