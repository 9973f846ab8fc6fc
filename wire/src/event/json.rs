//! JSON decoder: the JSON twin of `kvindex.v1.CacheEvent` (one object, or an array of objects
//! per message), described by `schemas/cache_event.schema.json`.
//!
//! Field names are the proto field names (snake_case). `type` and `tier` are enum value names
//! (`"PREFIX_ADDED"`, `"CPU"`); `bytes` fields are lowercase hex strings, and hash fields
//! (`block_hashes` entries, `parent_hash`, `prefix_hash`) may also be unsigned 64-bit integers,
//! read exactly like an 8-byte big-endian hash.
//!
//! The decoder is deliberately a little more lenient than the schema (which describes what
//! producers should send): unknown fields are ignored, `null` stands for a field's default, an
//! unknown `type` name becomes [`EventKind::Unknown(-1)`](super::EventKind::Unknown) (counted
//! downstream, not an error) and an unknown `tier` name is GPU (as an unknown proto value is);
//! an absent or `TIER_UNSPECIFIED` one names no tier.
//! Wrong-typed known fields are [`DecodeError::Field`] naming the field; syntax errors are
//! [`DecodeError::Json`]; nesting deeper than serde_json's recursion limit (128) is
//! [`DecodeError::TooDeep`]. Duplicate keys are rejected.
//!
//! Each object is read straight into the prost `CacheEvent` (hashes as 8-byte big-endian for
//! integers, raw bytes for hex) and converted by [`proto::from_pb`], so both encodings share one
//! mapping to [`Event`].

use super::proto::{self, pb};
use super::{DecodeError, Event};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt;

/// serde_json's default recursion limit, reported by [`DecodeError::TooDeep`].
pub const MAX_DEPTH: usize = 128;

/// Decodes a JSON body (one `CacheEvent` object or an array of them) into events.
pub fn decode(bytes: &[u8]) -> Result<Vec<Event>, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    let failed_field = Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let messages = PayloadSeed {
        failed_field: &failed_field,
    }
    .deserialize(&mut de)
    .map_err(|e| map_error(e, failed_field.get()))?;
    de.end().map_err(|e| map_error(e, None))?;
    messages.into_iter().map(proto::from_pb).collect()
}

/// Like [`decode`], but in an array one event that is bad (a wrong-typed field, a failed
/// conversion) is skipped into the second list instead of failing the whole array; a body
/// that is not well-formed JSON still fails as a whole.
pub fn decode_skipping(bytes: &[u8]) -> Result<(Vec<Event>, Vec<DecodeError>), DecodeError> {
    let whole = match decode(bytes) {
        Ok(events) => return Ok((events, Vec::new())),
        Err(e) => e,
    };
    let items: Vec<serde_json::Value> = match serde_json::from_slice(bytes) {
        Ok(serde_json::Value::Array(items)) => items,
        _ => return Err(whole),
    };
    let mut events = Vec::with_capacity(items.len());
    let mut skipped = Vec::new();
    for item in items {
        if !item.is_object() {
            return Err(whole);
        }
        let one = serde_json::to_vec(&item).map_err(|e| DecodeError::Json(e.to_string()))?;
        match decode(&one) {
            Ok(mut evs) => events.append(&mut evs),
            Err(e) => skipped.push(e),
        }
    }
    Ok((events, skipped))
}

fn map_error(e: serde_json::Error, field: Option<&'static str>) -> DecodeError {
    use serde_json::error::Category;
    if e.to_string().starts_with("recursion limit exceeded") {
        return DecodeError::TooDeep(MAX_DEPTH);
    }
    match (e.classify(), field) {
        (Category::Data, Some(field)) => DecodeError::Field {
            field,
            reason: e.to_string(),
        },
        _ => DecodeError::Json(e.to_string()),
    }
}

/// The whole body: an object or an array of objects.
struct PayloadSeed<'c> {
    failed_field: &'c Cell<Option<&'static str>>,
}

impl<'de> DeserializeSeed<'de> for PayloadSeed<'_> {
    type Value = Vec<pb::CacheEvent>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PayloadSeed<'_> {
    type Value = Vec<pb::CacheEvent>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a CacheEvent JSON object or an array of them")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        EventSeed {
            failed_field: self.failed_field,
        }
        .visit_map(map)
        .map(|ev| vec![ev])
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(ev) = seq.next_element_seed(EventSeed {
            failed_field: self.failed_field,
        })? {
            out.push(ev);
        }
        Ok(out)
    }
}

/// One `CacheEvent` object.
struct EventSeed<'c> {
    failed_field: &'c Cell<Option<&'static str>>,
}

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = pb::CacheEvent;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

/// The known keys of a `CacheEvent` object.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Type,
    ReplicaId,
    ModelId,
    TenantId,
    PrefixHash,
    TimestampUs,
    AdapterId,
    AdapterScoped,
    BlockHashes,
    ParentHash,
    TokenIds,
    BlockSize,
    Tier,
    Seq,
    DpRank,
    BlockExtraKeys,
    Other,
}

impl Key {
    fn from_name(name: &str) -> Key {
        match name {
            "type" => Key::Type,
            "replica_id" => Key::ReplicaId,
            "model_id" => Key::ModelId,
            "tenant_id" => Key::TenantId,
            "prefix_hash" => Key::PrefixHash,
            "timestamp_us" => Key::TimestampUs,
            "adapter_id" => Key::AdapterId,
            "adapter_scoped" => Key::AdapterScoped,
            "block_hashes" => Key::BlockHashes,
            "parent_hash" => Key::ParentHash,
            "token_ids" => Key::TokenIds,
            "block_size" => Key::BlockSize,
            "tier" => Key::Tier,
            "seq" => Key::Seq,
            "dp_rank" => Key::DpRank,
            "block_extra_keys" => Key::BlockExtraKeys,
            _ => Key::Other,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Key::Type => "type",
            Key::ReplicaId => "replica_id",
            Key::ModelId => "model_id",
            Key::TenantId => "tenant_id",
            Key::PrefixHash => "prefix_hash",
            Key::TimestampUs => "timestamp_us",
            Key::AdapterId => "adapter_id",
            Key::AdapterScoped => "adapter_scoped",
            Key::BlockHashes => "block_hashes",
            Key::ParentHash => "parent_hash",
            Key::TokenIds => "token_ids",
            Key::BlockSize => "block_size",
            Key::Tier => "tier",
            Key::Seq => "seq",
            Key::DpRank => "dp_rank",
            Key::BlockExtraKeys => "block_extra_keys",
            Key::Other => "",
        }
    }
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key::from_name(v))
            }
        }
        d.deserialize_identifier(KeyVisitor)
    }
}

/// A hash field: an unsigned 64-bit integer (→ 8-byte big-endian) or a hex string, as the
/// raw hash bytes of the proto message. `null` and `""` are empty (no hash).
struct HashBytes(Vec<u8>);

impl<'de> de::Deserialize<'de> for HashBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = HashBytes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (unsigned 64-bit integer or hex string)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HashBytes, E> {
                Ok(HashBytes(v.to_be_bytes().to_vec()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HashBytes, E> {
                u64::try_from(v)
                    .map(|v| HashBytes(v.to_be_bytes().to_vec()))
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HashBytes, E> {
                hex::decode(v)
                    .map(HashBytes)
                    .map_err(|e| E::custom(format!("invalid hex hash: {e}")))
            }
            fn visit_unit<E: de::Error>(self) -> Result<HashBytes, E> {
                Ok(HashBytes(Vec::new()))
            }
        }
        d.deserialize_any(HashVisitor)
    }
}

/// One entry of `block_extra_keys` (`null` entries and fields read as empty).
#[derive(serde::Deserialize)]
struct JsonExtras {
    #[serde(default)]
    mm: Option<Vec<JsonMultimodal>>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    prompt_embeds: Option<Vec<HashBytes>>,
    #[serde(default)]
    other: Option<Vec<HashBytes>>,
}

#[derive(serde::Deserialize)]
struct JsonMultimodal {
    hash: String,
    offset: i64,
}

impl JsonExtras {
    fn into_pb(self) -> pb::BlockExtraKeys {
        pb::BlockExtraKeys {
            mm: or_default(self.mm)
                .into_iter()
                .map(|m| pb::block_extra_keys::Multimodal {
                    hash: m.hash,
                    offset: m.offset,
                })
                .collect(),
            cache_salt: or_default(self.cache_salt),
            prompt_embeds: or_default(self.prompt_embeds)
                .into_iter()
                .map(|b| b.0.into())
                .collect(),
            other: or_default(self.other)
                .into_iter()
                .map(|b| b.0.into())
                .collect(),
        }
    }
}

/// Reads `null` as the type's default.
fn or_default<T: Default>(v: Option<T>) -> T {
    v.unwrap_or_default()
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = pb::CacheEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a CacheEvent JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut msg = pb::CacheEvent::default();
        let mut seen: u32 = 0;
        while let Some(key) = map.next_key::<Key>()? {
            if key == Key::Other {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            self.failed_field.set(Some(key.name()));
            let bit = 1u32 << (key as u32);
            if seen & bit != 0 {
                return Err(de::Error::custom("duplicate field"));
            }
            seen |= bit;
            match key {
                Key::Type => {
                    let name: Option<String> = map.next_value()?;
                    msg.r#type = match name {
                        None => 0,
                        Some(n) => pb::cache_event::Type::from_str_name(&n)
                            .map(|t| t as i32)
                            .unwrap_or(-1),
                    };
                }
                Key::ReplicaId => msg.replica_id = or_default(map.next_value()?),
                Key::ModelId => msg.model_id = or_default(map.next_value()?),
                Key::TenantId => msg.tenant_id = or_default(map.next_value()?),
                Key::PrefixHash => msg.prefix_hash = map.next_value::<HashBytes>()?.0.into(),
                Key::TimestampUs => msg.timestamp_us = or_default(map.next_value()?),
                Key::AdapterId => msg.adapter_id = or_default(map.next_value()?),
                Key::AdapterScoped => msg.adapter_scoped = or_default(map.next_value()?),
                Key::BlockHashes => {
                    let hashes: Option<Vec<HashBytes>> = map.next_value()?;
                    msg.block_hashes = or_default(hashes).into_iter().map(|h| h.0.into()).collect();
                }
                Key::ParentHash => msg.parent_hash = map.next_value::<HashBytes>()?.0.into(),
                Key::TokenIds => msg.token_ids = or_default(map.next_value()?),
                Key::BlockSize => msg.block_size = or_default(map.next_value()?),
                Key::Tier => {
                    let name: Option<String> = map.next_value()?;
                    msg.tier = proto::tier_to_i32(super::Tier::from_medium(name.as_deref()));
                }
                Key::Seq => msg.seq = or_default(map.next_value()?),
                Key::DpRank => msg.dp_rank = or_default(map.next_value()?),
                Key::BlockExtraKeys => {
                    let extras: Option<Vec<Option<JsonExtras>>> = map.next_value()?;
                    msg.block_extra_keys = or_default(extras)
                        .into_iter()
                        .map(|x| x.map(JsonExtras::into_pb).unwrap_or_default())
                        .collect();
                }
                Key::Other => {}
            }
            self.failed_field.set(None);
        }
        Ok(msg)
    }
}
