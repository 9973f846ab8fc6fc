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
    BlockContent, BlockExtras, DecodeError, EngineHash, Event, EventKind, MmKey, PartitionKey,
    Tier, engine_id,
};
use prost::Message;
use smallvec::SmallVec;

/// The prost-generated `kvindex.v1` messages (from `proto/kvindex/v1/events.proto`).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/kvindex.v1.rs"));
}

use pb::cache_event::{Tier as PbTier, Type as PbType};

/// Tag byte of `CacheEventBatch.events` (field 1, wire type 2).
const BATCH_TAG: u8 = 0x0a;

/// Decodes a protobuf body (one `CacheEvent` or a `CacheEventBatch`) into events.
///
/// The hand-written reader in [`proto_fast`](super::proto_fast) handles the common case; when
/// it gives up (malformed input, a wire feature it leaves to prost, an event that fails
/// conversion) the body is decoded again by [`decode_prost`], so every error and corner case
/// keeps prost's exact behaviour.
pub fn decode(bytes: &[u8]) -> Result<Vec<Event>, DecodeError> {
    match decode_fast(bytes) {
        Some(events) => Ok(events),
        None => decode_prost(bytes),
    }
}

/// Like [`decode`], but an event of a batch that fails conversion (e.g. an empty
/// `replica_id`) is skipped into the second list instead of failing the whole batch; only a
/// body whose framing is broken fails as a whole.
pub fn decode_skipping(bytes: &[u8]) -> Result<(Vec<Event>, Vec<DecodeError>), DecodeError> {
    if let Some(events) = decode_fast(bytes) {
        return Ok((events, Vec::new()));
    }
    if bytes.first() == Some(&BATCH_TAG) {
        let buf = bytes::Bytes::copy_from_slice(bytes);
        if let Ok(batch) = pb::CacheEventBatch::decode(buf) {
            let mut events = Vec::with_capacity(batch.events.len());
            let mut skipped = Vec::new();
            for msg in batch.events {
                match from_pb(msg) {
                    Ok(ev) => events.push(ev),
                    Err(e) => skipped.push(e),
                }
            }
            // A body that is also a valid single event with no good batch event is one.
            if !events.is_empty() || decode_prost(bytes).is_err() {
                return Ok((events, skipped));
            }
        }
    }
    decode_prost(bytes).map(|events| (events, Vec::new()))
}

/// The fast path alone: the events of a well-formed body, or `None` where [`decode`] would
/// fall back to [`decode_prost`]. Public so tests can check it against the reference decoder.
#[doc(hidden)]
pub fn decode_fast(bytes: &[u8]) -> Option<Vec<Event>> {
    if bytes.is_empty() {
        // Not an empty message: the whole body is missing (`DecodeError::Empty`).
        return None;
    }
    if bytes.first() == Some(&BATCH_TAG) {
        super::proto_fast::decode_batch(bytes)
    } else {
        super::proto_fast::decode_event(bytes).map(|ev| vec![ev])
    }
}

/// The reference decoder: prost-generated messages, then [`from_pb`], with the batch-or-event
/// rule of the module docs. Slower than [`decode`] but the definition of its behaviour.
pub fn decode_prost(bytes: &[u8]) -> Result<Vec<Event>, DecodeError> {
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
        Ok(PbType::AdapterCleared) => EventKind::AdapterCleared,
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
        EventKind::AdapterCleared => PbType::AdapterCleared as i32,
        EventKind::Unknown(v) => v,
    }
}

/// Maps a proto `Tier` value to the [`Tier`] it names: `None` for unspecified; an unknown
/// value is GPU.
pub fn tier_from_i32(v: i32) -> Option<Tier> {
    match PbTier::try_from(v) {
        Ok(PbTier::Unspecified) => None,
        Ok(PbTier::Cpu) => Some(Tier::Cpu),
        Ok(PbTier::Disk) => Some(Tier::Disk),
        Ok(PbTier::Gpu) | Err(_) => Some(Tier::Gpu),
    }
}

/// The proto `Tier` value naming `tier` (unspecified for none).
pub fn tier_to_i32(tier: Option<Tier>) -> i32 {
    match tier {
        None => PbTier::Unspecified as i32,
        Some(Tier::Gpu) => PbTier::Gpu as i32,
        Some(Tier::Cpu) => PbTier::Cpu as i32,
        Some(Tier::Disk) => PbTier::Disk as i32,
    }
}

/// Whether an event of `kind` must name its replica (every kind that reaches an engine).
pub(crate) fn needs_replica(kind: EventKind) -> bool {
    needs_model(kind) || kind == EventKind::ReplicaUpdated
}

/// Whether an event of `kind` must name its model (every kind that changes memberships: a
/// lookup always names a model, so blocks stored under none could never be found).
pub(crate) fn needs_model(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::Stored | EventKind::Removed | EventKind::AllCleared | EventKind::AdapterCleared
    )
}

/// Longest replica, model, tenant or adapter name accepted (names key in-memory maps).
pub const MAX_NAME_BYTES: usize = 256;

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
    let pb::CacheEvent {
        r#type,
        replica_id,
        model_id,
        tenant_id,
        prefix_hash,
        timestamp_us,
        adapter_id,
        adapter_scoped,
        block_hashes,
        parent_hash,
        token_ids,
        block_size,
        tier,
        seq,
        dp_rank,
        block_extra_keys,
    } = msg;
    EventFields {
        r#type,
        replica_id,
        model_id,
        tenant_id,
        prefix_hash: &prefix_hash,
        timestamp_us,
        adapter_id,
        adapter_scoped,
        block_hashes: block_hashes.iter().map(|h| h.as_ref()).collect(),
        parent_hash: &parent_hash,
        token_ids,
        block_size,
        tier,
        seq,
        dp_rank,
        block_extras: block_extra_keys.into_iter().map(extras_from_pb).collect(),
    }
    .into_event()
}

fn extras_from_pb(pb: pb::BlockExtraKeys) -> BlockExtras {
    BlockExtras {
        mm: pb
            .mm
            .into_iter()
            .map(|m| MmKey {
                hash: m.hash,
                offset: m.offset,
            })
            .collect(),
        cache_salt: pb.cache_salt,
        prompt_embeds: pb.prompt_embeds.into_iter().map(|b| b.to_vec()).collect(),
        other: pb.other.into_iter().map(|b| b.to_vec()).collect(),
    }
}

fn extras_to_pb(extras: &BlockExtras) -> pb::BlockExtraKeys {
    pb::BlockExtraKeys {
        mm: extras
            .mm
            .iter()
            .map(|m| pb::block_extra_keys::Multimodal {
                hash: m.hash.clone(),
                offset: m.offset,
            })
            .collect(),
        cache_salt: extras.cache_salt.clone(),
        prompt_embeds: extras
            .prompt_embeds
            .iter()
            .map(|b| bytes::Bytes::copy_from_slice(b))
            .collect(),
        other: extras
            .other
            .iter()
            .map(|b| bytes::Bytes::copy_from_slice(b))
            .collect(),
    }
}

/// Inline capacity of [`EventFields::block_hashes`]: chains up to this long need no heap.
const INLINE_HASHES: usize = 32;

/// The fields of one `CacheEvent` as decoded, with `bytes` fields borrowed from wherever they
/// were read. Both decoders fill one in and convert it with [`EventFields::into_event`], so the
/// prost path and the fast path share one mapping to [`Event`].
///
/// Strings are generic: prost hands over owned `String`s (moved into the event as they are),
/// the fast path borrows `&str` slices of the payload (copied once, into the event).
#[derive(Debug, Default)]
pub(crate) struct EventFields<'a, S> {
    pub r#type: i32,
    pub replica_id: S,
    pub model_id: S,
    pub tenant_id: S,
    pub prefix_hash: &'a [u8],
    pub timestamp_us: i64,
    pub adapter_id: S,
    pub adapter_scoped: bool,
    pub block_hashes: SmallVec<[&'a [u8]; INLINE_HASHES]>,
    pub parent_hash: &'a [u8],
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub tier: i32,
    pub seq: u64,
    pub dp_rank: u32,
    /// Per-block extra keys (the prost path only: the fast path leaves such events to prost).
    pub block_extras: Vec<BlockExtras>,
}

impl<S: AsRef<str> + Into<String>> EventFields<'_, S> {
    /// Validates the fields and builds the [`Event`]: legacy `prefix_hash` stands in for an
    /// empty `block_hashes`; the checks run in a fixed order so each bad event reports the same
    /// error whichever decoder read it.
    pub fn into_event(self) -> Result<Event, DecodeError> {
        let kind = kind_from_i32(self.r#type);
        let replica = self.replica_id.as_ref();
        if replica.is_empty() && needs_replica(kind) {
            return Err(DecodeError::Field {
                field: "replica_id",
                reason: "empty".into(),
            });
        }
        let mut block_hashes = engine_hashes(&self.block_hashes)?;
        if block_hashes.is_empty() && !self.prefix_hash.is_empty() {
            block_hashes.push(EngineHash::from_bytes(self.prefix_hash));
        }
        let parent_hash =
            (!self.parent_hash.is_empty()).then(|| EngineHash::from_bytes(self.parent_hash));
        let content = content_from_tokens(self.token_ids, self.block_size, block_hashes.len())?;
        let block_extras = if self.block_extras.iter().all(BlockExtras::is_empty) {
            Vec::new()
        } else if self.block_extras.len() != block_hashes.len() {
            return Err(DecodeError::Field {
                field: "block_extra_keys",
                reason: format!(
                    "{} entries for {} blocks",
                    self.block_extras.len(),
                    block_hashes.len()
                ),
            });
        } else {
            self.block_extras
        };
        if self.model_id.as_ref().is_empty() && needs_model(kind) {
            return Err(DecodeError::Field {
                field: "model_id",
                reason: "empty (a lookup always names a model: such blocks could never be found)"
                    .into(),
            });
        }
        for (field, name) in [
            ("replica_id", replica),
            ("model_id", self.model_id.as_ref()),
            ("tenant_id", self.tenant_id.as_ref()),
            ("adapter_id", self.adapter_id.as_ref()),
        ] {
            if name.len() > MAX_NAME_BYTES {
                return Err(DecodeError::Field {
                    field,
                    reason: format!("{} bytes, at most {MAX_NAME_BYTES}", name.len()),
                });
            }
        }
        Ok(Event {
            kind,
            engine: engine_id(replica, self.dp_rank),
            partition: PartitionKey {
                tenant: self.tenant_id.into(),
                model: self.model_id.into(),
                adapter: self.adapter_id.into(),
            },
            adapter_scoped: self.adapter_scoped,
            block_hashes,
            parent_hash,
            content,
            block_extras,
            tier: tier_from_i32(self.tier),
            timestamp_us: self.timestamp_us,
            seq: self.seq,
        })
    }
}

/// The chain's engine hashes, in one exactly sized allocation (one spare slot for the legacy
/// `prefix_hash` of a hash-less event); an empty hash is an error.
fn engine_hashes(raw: &[&[u8]]) -> Result<Vec<EngineHash>, DecodeError> {
    let mut out = Vec::with_capacity(raw.len().max(1));
    for h in raw {
        if h.is_empty() {
            return Err(DecodeError::Field {
                field: "block_hashes",
                reason: "empty hash".into(),
            });
        }
        out.push(EngineHash::from_bytes(h));
    }
    Ok(out)
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
        block_extra_keys: ev.block_extras.iter().map(extras_to_pb).collect(),
    }
}
