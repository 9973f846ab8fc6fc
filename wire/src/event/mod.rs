//! The event contract: the one domain [`Event`] every decoder produces and the index applies.
//!
//! Producers speak three encodings (our protobuf `CacheEvent`, its JSON twin, and vLLM's msgpack
//! `KVEventBatch`); each decoder in this module turns its bytes into these plain Rust values, so
//! nothing downstream knows or cares which wire format an event came from.

pub mod decode;
pub mod encode;
pub mod extra;
pub mod json;
pub mod proto;
mod proto_fast;
mod tier;
pub mod vllm;

pub use decode::{DecodeSettings, Decoded, Format, VllmSettings, decode_payload};
pub use extra::{BlockExtras, MmKey};
pub use tier::{Tier, TierSet, TierWeights};

/// What an event does to the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The engine now holds these blocks (proto `PREFIX_ADDED`, vLLM `BlockStored`).
    Stored,
    /// The engine dropped these blocks (proto `PREFIX_EVICTED`, vLLM `BlockRemoved`).
    Removed,
    /// The engine dropped everything it held for this (tenant, model).
    AllCleared,
    /// The engine dropped everything it held in this one (tenant, model, adapter) partition
    /// (proto `ADAPTER_CLEARED`; what the bridge splits a clear into per adapter partition).
    AdapterCleared,
    /// Liveness only: the engine is alive; no membership changes.
    ReplicaUpdated,
    /// A type this build does not know (the raw enum value); counted and skipped.
    Unknown(i32),
}

/// An engine's own block hash, normalized to 64 bits.
///
/// Engines hash blocks their own way (vLLM: 64-bit ints, or 32-byte digests; inference-cache:
/// bytes). kvindex treats them as opaque per-engine ids, so folding them to a u64 is enough:
/// an 8-byte value is read big-endian (the proto contract for integer hashes), anything else
/// is digested with xxh3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl EngineHash {
    /// From raw hash bytes as a producer sent them.
    pub fn from_bytes(bytes: &[u8]) -> EngineHash {
        match <[u8; 8]>::try_from(bytes) {
            Ok(b) => EngineHash(u64::from_be_bytes(b)),
            Err(_) => EngineHash(xxhash_rust::xxh3::xxh3_64(bytes)),
        }
    }

    /// From a signed 64-bit integer hash (vLLM may emit negative Python ints): same bits.
    pub fn from_i64(v: i64) -> EngineHash {
        EngineHash(v as u64)
    }
}

/// The LoRA adapter partition an event belongs to. `adapter == ""` is the base model.
/// A lookup only ever matches inside its own partition.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    pub tenant: String,
    pub model: String,
    pub adapter: String,
}

impl PartitionKey {
    pub fn new(
        tenant: impl Into<String>,
        model: impl Into<String>,
        adapter: impl Into<String>,
    ) -> Self {
        PartitionKey {
            tenant: tenant.into(),
            model: model.into(),
            adapter: adapter.into(),
        }
    }
}

/// What the producer told us about the content of a stored chain's blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BlockContent {
    /// Hash-only producer: each block is keyed by the producer's hash bytes as given.
    #[default]
    HashesOnly,
    /// The token ids of every block, concatenated (`len == blocks * block_size`).
    Tokens {
        token_ids: Vec<u32>,
        block_size: u32,
    },
    /// One content digest per block, standing in for its tokens (trace replays).
    Digests(Vec<u64>),
}

/// One decoded KV-cache event, whatever encoding it arrived in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// The engine (proto `replica_id`); `"{replica}#dp{rank}"` when `dp_rank > 0`.
    pub engine: String,
    pub partition: PartitionKey,
    /// Proto `adapter_scoped`: an eviction with this set (or with a non-empty adapter) only
    /// touches its own partition; otherwise it sweeps every adapter of (tenant, model).
    pub adapter_scoped: bool,
    /// The chain's engine hashes, root first.
    pub block_hashes: Vec<EngineHash>,
    /// Engine hash of the block before `block_hashes[0]`; `None` for a root chain.
    pub parent_hash: Option<EngineHash>,
    pub content: BlockContent,
    /// Per-block extra keys (multimodal inputs, cache salt, ...; see [`extra`]): empty when
    /// no block has any, else one per block of `block_hashes`. Only stores read them.
    pub block_extras: Vec<BlockExtras>,
    /// The medium the event names (vLLM / SGLang `medium`, proto `tier`), if any. A store
    /// naming none lands on GPU; a removal naming none drops the blocks from every tier.
    pub tier: Option<Tier>,
    pub timestamp_us: i64,
    /// Producer sequence number, per replica (0 when the producer has none).
    pub seq: u64,
}

impl Event {
    /// A blank event of `kind` for `engine` in `partition`; decoders fill in the rest.
    pub fn new(kind: EventKind, engine: impl Into<String>, partition: PartitionKey) -> Event {
        Event {
            kind,
            engine: engine.into(),
            partition,
            adapter_scoped: false,
            block_hashes: Vec::new(),
            parent_hash: None,
            content: BlockContent::HashesOnly,
            block_extras: Vec::new(),
            tier: None,
            timestamp_us: 0,
            seq: 0,
        }
    }

    /// The eviction-scope rule: `scoped = adapter_scoped || adapter != ""`.
    pub fn is_scoped(&self) -> bool {
        self.adapter_scoped || !self.partition.adapter.is_empty()
    }

    /// Whether the event touches every adapter partition of its (tenant, model): unscoped
    /// evictions and `ALL_CLEARED`.
    pub fn is_adapter_agnostic(&self) -> bool {
        match self.kind {
            EventKind::AllCleared => true,
            EventKind::Removed => !self.is_scoped(),
            _ => false,
        }
    }

    /// Block operations this event carries (stored or removed blocks), for throughput figures.
    pub fn block_ops(&self) -> usize {
        self.block_hashes.len()
    }
}

/// The engine id for a replica and its data-parallel rank (rank 0 is the replica itself).
pub fn engine_id(replica: &str, dp_rank: u32) -> String {
    if dp_rank == 0 {
        replica.to_string()
    } else {
        format!("{replica}#dp{dp_rank}")
    }
}

/// Where an event came from, for decoders that need context the payload lacks (vLLM batches
/// name neither engine nor model) and for error logs.
#[derive(Clone, Debug, Default)]
pub struct Envelope<'a> {
    /// Engine id from the Kafka message key / the NATS subject's engine token.
    pub engine: Option<&'a str>,
    /// Message header `model`, if any.
    pub model: Option<&'a str>,
    /// Message header `tenant`, if any.
    pub tenant: Option<&'a str>,
    /// Message header `dp_rank`, if any: the rank of a vLLM batch that names none itself.
    pub dp_rank: Option<u32>,
}

/// Why a payload could not be decoded. Each variant is a counted reason (`reason()`).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("payload is empty")]
    Empty,
    #[error("payload of {size} bytes exceeds the {limit}-byte limit")]
    TooLarge { size: usize, limit: usize },
    #[error("payload is in no known encoding (not protobuf, JSON or msgpack)")]
    UnknownFormat,
    #[error("invalid protobuf: {0}")]
    Protobuf(String),
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("invalid msgpack: {0}")]
    Msgpack(String),
    #[error("field `{field}`: {reason}")]
    Field { field: &'static str, reason: String },
    #[error("nesting deeper than {0} levels")]
    TooDeep(usize),
    #[error("vLLM payload has no engine id (set the Kafka message key or NATS subject token)")]
    MissingEngine,
    #[error("vLLM payload has no model (set header `model` or [source.vllm] model)")]
    MissingModel,
    #[error("vLLM lora_id {0} is not in [source.vllm.lora_names]; event dropped")]
    UnmappedLora(i64),
    #[error("KV-cache group {group} ({kind}) is not indexed (only the full-attention group is)")]
    OtherKvGroup { group: i64, kind: String },
}

impl DecodeError {
    /// A short, stable label for metrics (`kvindex_events_malformed_total{reason=...}`).
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Empty => "empty",
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::UnknownFormat => "unknown_format",
            DecodeError::Protobuf(_) => "protobuf",
            DecodeError::Json(_) => "json",
            DecodeError::Msgpack(_) => "msgpack",
            DecodeError::Field { .. } => "bad_field",
            DecodeError::TooDeep(_) => "too_deep",
            DecodeError::MissingEngine => "missing_engine",
            DecodeError::MissingModel => "missing_model",
            DecodeError::UnmappedLora(_) => "unmapped_lora",
            DecodeError::OtherKvGroup { .. } => "other_kv_group",
        }
    }
}
