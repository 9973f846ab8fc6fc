//! vLLM decoder: msgpack `KVEventBatch` payloads exactly as vLLM's `kv_events.py` writes them.
//!
//! Two shipped encodings, both accepted, even mixed within one batch:
//!
//! * positional (vLLM ≤ 0.11 and SGLang, msgspec `array_like=True` tagged structs): the batch is
//!   `[ts, [events...]]` or `[ts, [events...], dp_rank]`; an event is an array whose first
//!   element is its tag:
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, ...]` (at least the 5 fields up to `lora_id`; later fields are optional and any
//!   further trailing fields are ignored; SGLang's `BlockStoredWithMetadata` has its
//!   `metadata` map where vLLM has `lora_name`), `["BlockRemoved", block_hashes, medium?, ...]`,
//!   `["AllBlocksCleared", ...]`;
//! * named (vLLM 0.34): each event is a map with a `"type"` key and named fields; the batch is
//!   an array as above or a map with keys `ts`, `events`, `data_parallel_rank`.
//!
//! Block hashes are integers (signed or unsigned 64-bit) or bytes (e.g. 32-byte digests), see
//! [`EngineHash`]. `medium` is `GPU`/`CPU`/`STORAGE`/`DISK` (unknown → GPU; nil names no tier:
//! a store lands on GPU, a removal leaves every tier). Of a hybrid model's KV-cache groups
//! (`group_idx`, `kv_cache_spec_kind`) only the full-attention group is indexed; events of other groups are dropped as [`DecodeError::OtherKvGroup`] (see
//! [`indexed_group`]). A block's extra keys (vLLM `extra_keys`, SGLang `metadata.cache_salt`)
//! become [`Event::block_extras`] (`vllm/extra_keys.rs`). Unknown and newer fields
//! (`locality`, `session_id`, ...) are skipped; an unknown event tag becomes an
//! [`EventKind::Unknown(-1)`](EventKind::Unknown) event.
//!
//! vLLM payloads name neither engine nor model: the engine comes from [`Envelope::engine`]
//! (suffixed with the batch's dp rank, see [`engine_id`]), model and tenant from the envelope
//! or else [`VllmSettings`]. The adapter is `lora_name` when set, else `lora_id` mapped through
//! [`VllmSettings::lora_names`]; an unmapped `lora_id` fails closed: that event is dropped and
//! reported as [`DecodeError::UnmappedLora`] (logged once per id per process).
//!
//! # Hostile input
//!
//! The payload is walked in place by a small zero-copy msgpack reader (no intermediate value
//! tree): every declared array/map/string length is checked against the bytes actually left
//! before anything is allocated, nesting is capped at [`MAX_DEPTH`] (skipped values are walked
//! iteratively, never recursively), and trailing bytes after the batch are an error. Malformed
//! structure or wrong-typed fields fail the whole payload ([`DecodeError::Msgpack`] /
//! [`DecodeError::Field`]); an event that is well-formed but unusable (unmapped LoRA, token
//! count not matching its blocks) is dropped into `skipped` and the rest of the batch decodes.

use super::proto::content_from_tokens;
use super::{
    BlockContent, DecodeError, EngineHash, Envelope, Event, EventKind, PartitionKey, Tier,
    engine_id,
};
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet};

mod extra_keys;
use std::sync::{LazyLock, Mutex, PoisonError};

/// Deepest array/map nesting accepted anywhere in a payload (vLLM needs about 6).
pub const MAX_DEPTH: usize = 32;

/// Context vLLM payloads lack, from the source's `[source.vllm]` configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VllmSettings {
    /// Model for payloads whose envelope has no `model` header.
    pub model: Option<String>,
    /// Tenant for payloads whose envelope has no `tenant` header.
    pub tenant: String,
    /// vLLM integer `lora_id` → adapter name, for producers that send no `lora_name`.
    pub lora_names: HashMap<i64, String>,
}

/// Decodes a vLLM `KVEventBatch`. Returns the events and the events dropped on purpose
/// (unmapped LoRA ids, unusable content); fails as a whole on malformed input.
pub fn decode(
    bytes: &[u8],
    env: &Envelope<'_>,
    opts: &VllmSettings,
) -> Result<(Vec<Event>, Vec<DecodeError>), DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let engine = env
        .engine
        .filter(|e| !e.is_empty())
        .ok_or(DecodeError::MissingEngine)?;
    let model = env
        .model
        .filter(|m| !m.is_empty())
        .or(opts.model.as_deref().filter(|m| !m.is_empty()))
        .ok_or(DecodeError::MissingModel)?;
    let tenant = env.tenant.unwrap_or(&opts.tenant);
    let ctx = Ctx {
        tenant,
        model,
        lora_names: &opts.lora_names,
    };

    let mut rd = Reader { buf: bytes, pos: 0 };
    let mut batch = Batch::default();
    match rd.next()? {
        Mp::Array(n) => {
            if n < 2 {
                return Err(field_err(
                    "events",
                    format!("batch array has {n} elements, expected [ts, events, dp_rank?]"),
                ));
            }
            batch.ts_us = rd.read_ts()?;
            rd.read_events(&ctx, &mut batch)?;
            if n >= 3 {
                batch.dp_rank = rd.read_dp_rank()?;
            }
            for _ in 3..n {
                rd.skip(1)?;
            }
        }
        Mp::Map(n) => {
            let mut have_events = false;
            for _ in 0..n {
                match rd.next()? {
                    Mp::Str(b"ts") => batch.ts_us = rd.read_ts()?,
                    Mp::Str(b"events") => {
                        if have_events {
                            return Err(field_err("events", "duplicate key".into()));
                        }
                        have_events = true;
                        rd.read_events(&ctx, &mut batch)?;
                    }
                    Mp::Str(b"data_parallel_rank" | b"attn_dp_rank") => {
                        batch.dp_rank = rd.read_dp_rank()?
                    }
                    Mp::Array(k) | Mp::Map(k) if k > 0 => {
                        return Err(msgpack_err("batch map key is a container"));
                    }
                    _ => rd.skip(1)?,
                }
            }
            if !have_events {
                return Err(field_err("events", "missing from batch map".into()));
            }
        }
        _ => return Err(msgpack_err("batch is neither an array nor a map")),
    }
    if rd.pos != bytes.len() {
        return Err(msgpack_err(&format!(
            "{} trailing bytes after the batch",
            bytes.len().saturating_sub(rd.pos)
        )));
    }

    let engine = engine_id(engine, batch.dp_rank.or(env.dp_rank).unwrap_or(0));
    for ev in &mut batch.events {
        ev.engine.clone_from(&engine);
        ev.timestamp_us = batch.ts_us;
    }
    Ok((batch.events, batch.skipped))
}

/// What a forwarder needs of a batch without decoding its events: how many there are and the
/// rank the batch names (`None` when absent or nil). Fails on the same malformed structure
/// [`decode`] fails on at the batch level.
pub fn batch_summary(bytes: &[u8]) -> Result<(usize, Option<u32>), DecodeError> {
    let mut rd = Reader { buf: bytes, pos: 0 };
    let count_events = |rd: &mut Reader<'_>| -> Result<usize, DecodeError> {
        match rd.next()? {
            Mp::Array(n) => {
                for _ in 0..n {
                    rd.skip(2)?;
                }
                Ok(n)
            }
            other => Err(wrong_type("events", "an array of events", &other)),
        }
    };
    let mut events = None;
    let mut rank = None;
    match rd.next()? {
        Mp::Array(n) if n >= 2 => {
            rd.read_ts()?;
            events = Some(count_events(&mut rd)?);
            if n >= 3 {
                rank = rd.read_dp_rank()?;
            }
            for _ in 3..n {
                rd.skip(1)?;
            }
        }
        Mp::Map(n) => {
            for _ in 0..n {
                match rd.next()? {
                    Mp::Str(b"events") => events = Some(count_events(&mut rd)?),
                    Mp::Str(b"data_parallel_rank" | b"attn_dp_rank") => rank = rd.read_dp_rank()?,
                    _ => rd.skip(1)?,
                }
            }
        }
        _ => {
            return Err(msgpack_err(
                "batch is neither [ts, events, dp_rank?] nor a map",
            ));
        }
    }
    if rd.pos != bytes.len() {
        return Err(msgpack_err("trailing bytes after the batch"));
    }
    let events = events.ok_or_else(|| field_err("events", "missing from batch map".into()))?;
    Ok((events, rank))
}

fn field_err(field: &'static str, reason: String) -> DecodeError {
    DecodeError::Field { field, reason }
}

fn msgpack_err(msg: &str) -> DecodeError {
    DecodeError::Msgpack(msg.to_string())
}

/// Logs an unmapped `lora_id` once per id per process (bounded, so a hostile producer cannot
/// grow the set without limit).
fn warn_unmapped_lora(id: i64) {
    const MAX_TRACKED: usize = 4096;
    static WARNED: LazyLock<Mutex<HashSet<i64>>> = LazyLock::new(Default::default);
    let mut warned = WARNED.lock().unwrap_or_else(PoisonError::into_inner);
    if warned.len() < MAX_TRACKED && warned.insert(id) {
        tracing::warn!(
            lora_id = id,
            "vLLM lora_id is not in [source.vllm.lora_names]; its events are dropped"
        );
    }
}

struct Ctx<'a> {
    tenant: &'a str,
    model: &'a str,
    lora_names: &'a HashMap<i64, String>,
}

#[derive(Default)]
struct Batch {
    ts_us: i64,
    /// The batch's rank; `None` when absent or nil (then the envelope's, else 0).
    dp_rank: Option<u32>,
    events: Vec<Event>,
    skipped: Vec<DecodeError>,
}

/// The event types vLLM emits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Tag {
    fn parse(name: &[u8]) -> Tag {
        match name {
            b"BlockStored" => Tag::Stored,
            b"BlockRemoved" => Tag::Removed,
            b"AllBlocksCleared" => Tag::Cleared,
            _ => Tag::Unknown,
        }
    }
}

/// The fields of one event, as read.
#[derive(Default)]
struct RawEvent<'a> {
    block_hashes: Vec<EngineHash>,
    parent: Option<EngineHash>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    lora_name: Option<&'a str>,
    medium: Option<&'a str>,
    /// vLLM's KV-cache group of a hybrid model (`group_idx`) and its kind
    /// (`kv_cache_spec_kind`); see [`indexed_group`].
    group_idx: Option<i64>,
    group_kind: Option<&'a str>,
    /// vLLM's per-block `extra_keys`, unresolved (see `extra_keys.rs`).
    extra_keys: Vec<extra_keys::RawBlockKeys<'a>>,
    /// SGLang's `metadata.cache_salt`.
    sglang_salt: Option<&'a str>,
}

/// Whether blocks of this KV-cache group are indexed: only the full-attention group, as
/// Dynamo's router does. A hybrid model (sliding-window or Mamba layers beside full attention)
/// publishes one stream of blocks per group; the sliding-window group's blocks are dropped by
/// the engine as the window moves on, so they say nothing about which prefix an engine can
/// reuse, and mixing groups would make one engine's blocks of two groups look like one chain.
fn indexed_group(group_idx: Option<i64>, kind: Option<&str>) -> bool {
    group_idx.is_none_or(|g| g == 0)
        && kind.is_none_or(|k| {
            matches!(
                k,
                "full_attention" | "mla_attention" | "sink_full_attention"
            )
        })
}

impl RawEvent<'_> {
    /// Turns the fields into an [`Event`] (engine and timestamp are filled in per batch), or
    /// the reason this event is dropped.
    fn into_event(self, tag: Tag, ctx: &Ctx<'_>) -> Result<Event, DecodeError> {
        let partition = |adapter: &str| PartitionKey::new(ctx.tenant, ctx.model, adapter);
        let kind = match tag {
            Tag::Stored => EventKind::Stored,
            Tag::Removed => EventKind::Removed,
            Tag::Cleared => {
                return Ok(Event::new(EventKind::AllCleared, "", partition("")));
            }
            Tag::Unknown => return Ok(Event::new(EventKind::Unknown(-1), "", partition(""))),
        };
        if !indexed_group(self.group_idx, self.group_kind) {
            return Err(DecodeError::OtherKvGroup {
                group: self.group_idx.unwrap_or(0),
                kind: self.group_kind.unwrap_or("").to_string(),
            });
        }
        let adapter: &str = match (self.lora_name.filter(|n| !n.is_empty()), self.lora_id) {
            (Some(name), _) => name,
            (None, Some(id)) => match ctx.lora_names.get(&id) {
                Some(name) => name,
                None => {
                    warn_unmapped_lora(id);
                    return Err(DecodeError::UnmappedLora(id));
                }
            },
            (None, None) => "",
        };
        let mut ev = Event::new(kind, "", partition(adapter));
        ev.tier = Tier::from_medium(self.medium);
        if kind == EventKind::Stored {
            let blocks = self.block_hashes.len();
            ev.content = content_from_tokens(self.token_ids, self.block_size, blocks)?;
            ev.block_extras = extra_keys::resolve(
                self.extra_keys,
                adapter,
                self.sglang_salt,
                self.parent.is_none(),
                blocks,
            )?;
            ev.parent_hash = self.parent;
        } else {
            ev.content = BlockContent::HashesOnly;
            ev.adapter_scoped = !adapter.is_empty();
        }
        ev.block_hashes = self.block_hashes;
        Ok(ev)
    }
}

/// One msgpack item: scalars with their value, containers with their length.
#[derive(Clone, Copy, Debug)]
enum Mp<'a> {
    Nil,
    Bool,
    UInt(u64),
    /// A negative integer (non-negative ones are always `UInt`).
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(usize),
    Map(usize),
}

impl Mp<'_> {
    fn type_name(&self) -> &'static str {
        match self {
            Mp::Nil => "nil",
            Mp::Bool => "bool",
            Mp::UInt(_) | Mp::Int(_) => "integer",
            Mp::Float(_) => "float",
            Mp::Str(_) => "string",
            Mp::Bin(_) => "bytes",
            Mp::Ext => "ext",
            Mp::Array(_) => "array",
            Mp::Map(_) => "map",
        }
    }
}

fn wrong_type(field: &'static str, expected: &str, got: &Mp<'_>) -> DecodeError {
    field_err(
        field,
        format!("expected {expected}, got {}", got.type_name()),
    )
}

/// Whether `bytes` are exactly one msgpack item (what the decoder keeps an extra key of an
/// unknown shape as), so an encoder can write them back verbatim.
pub(crate) fn is_one_item(bytes: &[u8]) -> bool {
    let mut rd = Reader { buf: bytes, pos: 0 };
    !bytes.is_empty() && rd.skip(0).is_ok() && rd.pos == bytes.len()
}

/// A zero-copy msgpack cursor over the payload.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| msgpack_err("truncated payload"))?;
        let out = self.buf.get(self.pos..end).unwrap_or_default();
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let bytes = self.take(N)?;
        <[u8; N]>::try_from(bytes).map_err(|_| msgpack_err("truncated payload"))
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        let [b] = self.array::<1>()?;
        Ok(b)
    }

    fn u16(&mut self) -> Result<usize, DecodeError> {
        Ok(u16::from_be_bytes(self.array()?) as usize)
    }

    fn u32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(u32::from_be_bytes(self.array()?))
            .map_err(|_| msgpack_err("length overflows"))
    }

    /// A container of `len` items, each at least one byte: refuse lengths the rest of the
    /// payload cannot hold (so no caller ever reserves memory for a lie).
    fn container(&self, len: usize, per_item: usize) -> Result<usize, DecodeError> {
        if len.saturating_mul(per_item) > self.remaining() {
            return Err(msgpack_err(&format!(
                "declared length {len} exceeds the {} bytes left",
                self.remaining()
            )));
        }
        Ok(len)
    }

    /// Reads one item (a container's header only).
    fn next(&mut self) -> Result<Mp<'a>, DecodeError> {
        let m = self.u8()?;
        Ok(match m {
            0x00..=0x7f => Mp::UInt(u64::from(m)),
            0x80..=0x8f => Mp::Map(self.container(usize::from(m & 0x0f), 2)?),
            0x90..=0x9f => Mp::Array(self.container(usize::from(m & 0x0f), 1)?),
            0xa0..=0xbf => Mp::Str(self.take(usize::from(m & 0x1f))?),
            0xc0 => Mp::Nil,
            0xc1 => return Err(msgpack_err("reserved marker 0xc1")),
            0xc2 | 0xc3 => Mp::Bool,
            0xc4 => {
                let n = self.u8()?;
                Mp::Bin(self.take(usize::from(n))?)
            }
            0xc5 => {
                let n = self.u16()?;
                Mp::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.u32()?;
                Mp::Bin(self.take(n)?)
            }
            0xc7 => {
                let n = self.u8()?;
                self.take(usize::from(n).saturating_add(1))?;
                Mp::Ext
            }
            0xc8 => {
                let n = self.u16()?;
                self.take(n.saturating_add(1))?;
                Mp::Ext
            }
            0xc9 => {
                let n = self.u32()?;
                self.take(n.saturating_add(1))?;
                Mp::Ext
            }
            0xca => Mp::Float(f64::from(f32::from_be_bytes(self.array()?))),
            0xcb => Mp::Float(f64::from_be_bytes(self.array()?)),
            0xcc => Mp::UInt(u64::from(self.u8()?)),
            0xcd => Mp::UInt(u64::from(u16::from_be_bytes(self.array()?))),
            0xce => Mp::UInt(u64::from(u32::from_be_bytes(self.array()?))),
            0xcf => Mp::UInt(u64::from_be_bytes(self.array()?)),
            0xd0 => int(i64::from(i8::from_be_bytes(self.array()?))),
            0xd1 => int(i64::from(i16::from_be_bytes(self.array()?))),
            0xd2 => int(i64::from(i32::from_be_bytes(self.array()?))),
            0xd3 => int(i64::from_be_bytes(self.array()?)),
            0xd4..=0xd8 => {
                // fixext 1/2/4/8/16: type byte + 2^(m-0xd4) data bytes.
                self.take(1 + (1usize << (m - 0xd4)))?;
                Mp::Ext
            }
            0xd9 => {
                let n = self.u8()?;
                Mp::Str(self.take(usize::from(n))?)
            }
            0xda => {
                let n = self.u16()?;
                Mp::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.u32()?;
                Mp::Str(self.take(n)?)
            }
            0xdc => {
                let n = self.u16()?;
                Mp::Array(self.container(n, 1)?)
            }
            0xdd => {
                let n = self.u32()?;
                Mp::Array(self.container(n, 1)?)
            }
            0xde => {
                let n = self.u16()?;
                Mp::Map(self.container(n, 2)?)
            }
            0xdf => {
                let n = self.u32()?;
                Mp::Map(self.container(n, 2)?)
            }
            0xe0..=0xff => Mp::Int(i64::from(m as i8)),
        })
    }

    /// Skips one whole item whose container sits at nesting `depth`, iteratively.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        let mut open: SmallVec<[usize; 8]> = SmallVec::new();
        open.push(1);
        while let Some(left) = open.last_mut() {
            if *left == 0 {
                open.pop();
                continue;
            }
            *left -= 1;
            let items = match self.next()? {
                Mp::Array(n) => n,
                Mp::Map(n) => n.saturating_mul(2),
                _ => continue,
            };
            if depth + open.len() > MAX_DEPTH {
                return Err(DecodeError::TooDeep(MAX_DEPTH));
            }
            open.push(items);
        }
        Ok(())
    }

    fn str_of(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        match self.next()? {
            Mp::Str(b) => {
                std::str::from_utf8(b).map_err(|_| field_err(field, "invalid UTF-8".into()))
            }
            other => Err(wrong_type(field, "a string", &other)),
        }
    }

    fn opt_str(&mut self, field: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.next()? {
            Mp::Nil => Ok(None),
            Mp::Str(b) => std::str::from_utf8(b)
                .map(Some)
                .map_err(|_| field_err(field, "invalid UTF-8".into())),
            other => Err(wrong_type(field, "a string or nil", &other)),
        }
    }

    fn hash_from(field: &'static str, item: Mp<'_>) -> Result<EngineHash, DecodeError> {
        match item {
            Mp::UInt(v) => Ok(EngineHash(v)),
            Mp::Int(v) => Ok(EngineHash::from_i64(v)),
            Mp::Bin(b) | Mp::Str(b) if !b.is_empty() => Ok(EngineHash::from_bytes(b)),
            other => Err(wrong_type(field, "an integer or bytes hash", &other)),
        }
    }

    fn hashes(&mut self, field: &'static str) -> Result<Vec<EngineHash>, DecodeError> {
        let n = match self.next()? {
            Mp::Array(n) => n,
            other => return Err(wrong_type(field, "an array of hashes", &other)),
        };
        // `n` is at most the bytes left (checked by `container`), so this allocation is bounded.
        let mut out = vec![EngineHash(0); n];
        let filled = self.fill_int_hashes(&mut out);
        for slot in out.iter_mut().skip(filled) {
            let item = self.next()?;
            *slot = Self::hash_from(field, item)?;
        }
        Ok(out)
    }

    /// The hot path of [`Reader::hashes`]: fills `slots` from the front with integer hashes in
    /// the forms vLLM writes (uint 64 / int 64, plus the short unsigned forms) and returns how
    /// many it filled. It stops at the first item in any other form, or cut short, leaving it
    /// to the general reader, which reads (or rejects) it exactly as before. An int 64 hash
    /// keeps its bits, as [`EngineHash::from_i64`] does.
    fn fill_int_hashes(&mut self, slots: &mut [EngineHash]) -> usize {
        let mut filled = 0;
        for slot in slots.iter_mut() {
            let Some(rest) = self.buf.get(self.pos..) else {
                break;
            };
            let (value, len) = match *rest {
                [0xcf | 0xd3, a, b, c, d, e, f, g, h, ..] => {
                    (u64::from_be_bytes([a, b, c, d, e, f, g, h]), 9)
                }
                _ => match common_uint(rest) {
                    Some((v, len)) => (u64::from(v), len),
                    None => break,
                },
            };
            *slot = EngineHash(value);
            self.pos += len;
            filled += 1;
        }
        filled
    }

    fn opt_hash(&mut self, field: &'static str) -> Result<Option<EngineHash>, DecodeError> {
        match self.next()? {
            Mp::Nil => Ok(None),
            item => Self::hash_from(field, item).map(Some),
        }
    }

    fn u32_of(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        match self.next()? {
            Mp::UInt(v) => u32::try_from(v).map_err(|_| field_err(field, format!("{v} > 2^32-1"))),
            other => Err(wrong_type(field, "an unsigned 32-bit integer", &other)),
        }
    }

    fn tokens(&mut self, field: &'static str) -> Result<Vec<u32>, DecodeError> {
        let n = match self.next()? {
            Mp::Array(n) => n,
            Mp::Nil => 0,
            other => return Err(wrong_type(field, "an array of token ids", &other)),
        };
        // `n` is at most the bytes left (checked by `container`), so this allocation is bounded.
        let mut out = vec![0; n];
        let filled = self.fill_u32s(&mut out);
        for slot in out.iter_mut().skip(filled) {
            *slot = self.u32_of(field)?;
        }
        Ok(out)
    }

    /// The hot path of [`Reader::tokens`]: fills `slots` from the front with unsigned integers
    /// in msgpack's common forms ([`common_uint`]) in one tight loop, without building an
    /// [`Mp`] per token, and returns how many it filled. It stops at the first item in any
    /// other form, or cut short, leaving it to [`Reader::u32_of`], which reads (or rejects)
    /// it exactly as before.
    fn fill_u32s(&mut self, slots: &mut [u32]) -> usize {
        let mut filled = 0;
        for slot in slots.iter_mut() {
            let Some((value, len)) = self.buf.get(self.pos..).and_then(common_uint) else {
                break;
            };
            *slot = value;
            self.pos += len;
            filled += 1;
        }
        filled
    }

    fn opt_i64(&mut self, field: &'static str) -> Result<Option<i64>, DecodeError> {
        match self.next()? {
            Mp::Nil => Ok(None),
            Mp::Int(v) => Ok(Some(v)),
            Mp::UInt(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| field_err(field, format!("{v} > 2^63-1"))),
            other => Err(wrong_type(field, "an integer or nil", &other)),
        }
    }

    /// The batch `ts` (float seconds) as microseconds.
    fn read_ts(&mut self) -> Result<i64, DecodeError> {
        match self.next()? {
            // `as` saturates (NaN → 0): no overflow on hostile values.
            Mp::Float(s) => Ok((s * 1e6).round() as i64),
            Mp::UInt(s) => Ok(i64::try_from(s)
                .unwrap_or(i64::MAX)
                .saturating_mul(1_000_000)),
            Mp::Int(s) => Ok(s.saturating_mul(1_000_000)),
            Mp::Nil => Ok(0),
            other => Err(wrong_type("ts", "a number", &other)),
        }
    }

    fn read_dp_rank(&mut self) -> Result<Option<u32>, DecodeError> {
        match self.next()? {
            Mp::Nil => Ok(None),
            Mp::UInt(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| field_err("data_parallel_rank", format!("{v} > 2^32-1"))),
            other => Err(wrong_type(
                "data_parallel_rank",
                "an unsigned integer",
                &other,
            )),
        }
    }

    /// Reads the batch's event list (at nesting depth 2).
    fn read_events(&mut self, ctx: &Ctx<'_>, batch: &mut Batch) -> Result<(), DecodeError> {
        let n = match self.next()? {
            Mp::Array(n) => n,
            other => return Err(wrong_type("events", "an array of events", &other)),
        };
        batch.events.reserve(n);
        for _ in 0..n {
            let (tag, raw) = match self.next()? {
                Mp::Array(len) => self.positional_event(len)?,
                Mp::Map(len) => self.named_event(len)?,
                other => return Err(wrong_type("events", "an event array or map", &other)),
            };
            match raw.into_event(tag, ctx) {
                Ok(ev) => batch.events.push(ev),
                Err(e) => batch.skipped.push(e),
            }
        }
        Ok(())
    }

    /// `[tag, fields...]` (depth 3).
    fn positional_event(&mut self, len: usize) -> Result<(Tag, RawEvent<'a>), DecodeError> {
        if len == 0 {
            return Err(field_err("type", "empty event array".into()));
        }
        let tag = Tag::parse(self.str_of("type")?.as_bytes());
        let fields = len - 1;
        let mut raw = RawEvent::default();
        let read = match tag {
            Tag::Stored => {
                if fields < 5 {
                    return Err(field_err(
                        "events",
                        format!("BlockStored has {fields} fields, expected at least 5"),
                    ));
                }
                raw.block_hashes = self.hashes("block_hashes")?;
                raw.parent = self.opt_hash("parent_block_hash")?;
                raw.token_ids = self.tokens("token_ids")?;
                raw.block_size = self.u32_of("block_size")?;
                raw.lora_id = self.opt_i64("lora_id")?;
                if fields > 5 {
                    raw.medium = self.opt_str("medium")?;
                }
                if fields > 6 {
                    // vLLM's `lora_name` (a string or nil), or SGLang's
                    // `BlockStoredWithMetadata` `metadata` map (`{"cache_salt": ...}`) in the
                    // same place: told apart by type.
                    let at = self.pos;
                    if matches!(self.next()?, Mp::Map(_)) {
                        self.pos = at;
                        raw.sglang_salt = self.sglang_metadata()?;
                    } else {
                        self.pos = at;
                        raw.lora_name = self.opt_str("lora_name")?;
                    }
                }
                if fields > 7 {
                    raw.extra_keys = self.extra_keys()?;
                }
                if fields > 8 {
                    raw.group_idx = self.opt_i64("group_idx")?;
                }
                if fields > 9 {
                    raw.group_kind = self.opt_str("kv_cache_spec_kind")?;
                }
                fields.min(10)
            }
            Tag::Removed => {
                if fields < 1 {
                    return Err(field_err(
                        "events",
                        "BlockRemoved has no block_hashes".into(),
                    ));
                }
                raw.block_hashes = self.hashes("block_hashes")?;
                if fields > 1 {
                    raw.medium = self.opt_str("medium")?;
                }
                if fields > 2 {
                    raw.group_idx = self.opt_i64("group_idx")?;
                }
                fields.min(3)
            }
            Tag::Cleared | Tag::Unknown => 0,
        };
        for _ in read..fields {
            self.skip(3)?;
        }
        Ok((tag, raw))
    }

    /// `{"type": tag, field: value, ...}` (depth 3). The tag is usually the first key; if it
    /// is not, the map is scanned for it first so fields are read knowing the event type.
    fn named_event(&mut self, len: usize) -> Result<(Tag, RawEvent<'a>), DecodeError> {
        let start = self.pos;
        let mut tag = None;
        for _ in 0..len {
            match self.next()? {
                Mp::Str(b"type") => {
                    tag = Some(Tag::parse(self.str_of("type")?.as_bytes()));
                    break;
                }
                Mp::Array(k) | Mp::Map(k) if k > 0 => {
                    return Err(msgpack_err("event map key is a container"));
                }
                _ => self.skip(3)?,
            }
        }
        let tag = tag.ok_or_else(|| field_err("type", "event map has no \"type\"".into()))?;
        self.pos = start;

        let mut raw = RawEvent::default();
        for _ in 0..len {
            let key = match self.next()? {
                Mp::Str(k) => k,
                Mp::Array(k) | Mp::Map(k) if k > 0 => {
                    return Err(msgpack_err("event map key is a container"));
                }
                _ => &[],
            };
            match (tag, key) {
                (Tag::Stored | Tag::Removed, b"block_hashes") => {
                    raw.block_hashes = self.hashes("block_hashes")?
                }
                (Tag::Stored, b"parent_block_hash") => {
                    raw.parent = self.opt_hash("parent_block_hash")?
                }
                (Tag::Stored, b"token_ids") => raw.token_ids = self.tokens("token_ids")?,
                (Tag::Stored, b"block_size") => raw.block_size = self.u32_of("block_size")?,
                (Tag::Stored | Tag::Removed, b"lora_id") => {
                    raw.lora_id = self.opt_i64("lora_id")?
                }
                (Tag::Stored | Tag::Removed, b"lora_name") => {
                    raw.lora_name = self.opt_str("lora_name")?
                }
                (Tag::Stored | Tag::Removed, b"medium") => raw.medium = self.opt_str("medium")?,
                (Tag::Stored, b"extra_keys") => raw.extra_keys = self.extra_keys()?,
                (Tag::Stored, b"metadata") => raw.sglang_salt = self.sglang_metadata()?,
                (Tag::Stored | Tag::Removed, b"group_idx") => {
                    raw.group_idx = self.opt_i64("group_idx")?
                }
                (Tag::Stored | Tag::Removed, b"kv_cache_spec_kind") => {
                    raw.group_kind = self.opt_str("kv_cache_spec_kind")?
                }
                _ => self.skip(3)?,
            }
        }
        Ok((tag, raw))
    }
}

/// An unsigned integer of at most 32 bits at the front of `bytes` in one of msgpack's common
/// forms (positive fixint, uint 8, uint 16, uint 32): its value and encoded length. `None` for
/// any other form or if the bytes end early.
#[inline(always)]
fn common_uint(bytes: &[u8]) -> Option<(u32, usize)> {
    match *bytes {
        [m @ 0x00..=0x7f, ..] => Some((u32::from(m), 1)),
        [0xcc, v, ..] => Some((u32::from(v), 2)),
        [0xcd, a, b, ..] => Some((u32::from(u16::from_be_bytes([a, b])), 3)),
        [0xce, a, b, c, d, ..] => Some((u32::from_be_bytes([a, b, c, d]), 5)),
        _ => None,
    }
}

/// A negative-capable integer item (non-negative values normalized to `UInt`).
fn int(v: i64) -> Mp<'static> {
    match u64::try_from(v) {
        Ok(u) => Mp::UInt(u),
        Err(_) => Mp::Int(v),
    }
}
