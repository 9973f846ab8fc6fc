//! Encoders: [`Event`]s to the three wire encodings the decoders read (used by
//! `kvindex produce` and the round-trip tests).
//!
//! Round-trip property: `decode(encode(events)) == events` for every event the encoding can
//! express. What an encoding cannot express:
//!
//! * all: [`BlockContent::Digests`] has no wire form and is written as hash-only;
//! * protobuf / JSON: an engine id is split back into `replica_id` + `dp_rank`
//!   ([`split_engine_id`](super::proto::split_engine_id)); `Unknown(v)` kinds keep `v` in
//!   protobuf but are written as `"TYPE_UNSPECIFIED"` in JSON;
//! * vLLM: no engine, model, tenant, `seq` or per-event timestamp (the batch `ts` is the first
//!   event's); `ReplicaUpdated` and `Unknown` events have no vLLM form and are left out; an
//!   extra key of an unknown shape is written back only if it is one msgpack item (as the vLLM
//!   decoder keeps them; protobuf and JSON carry arbitrary bytes there);
//!   BlockRemoved is adapter-scoped exactly when it names an adapter.

use super::proto::{self, pb};
use super::vllm;
use super::{BlockContent, Event, EventKind, Tier};
use prost::Message;

/// Protobuf: one event → a `CacheEvent`; any other count → a `CacheEventBatch`. An event whose
/// every field is its default encodes to no bytes at all, which reads back as a missing body
/// ([`DecodeError::Empty`](super::DecodeError::Empty)): it is written as a batch of one.
pub fn to_proto(events: &[Event]) -> Vec<u8> {
    if let [ev] = events {
        let single = proto::to_pb(ev).encode_to_vec();
        if !single.is_empty() {
            return single;
        }
    }
    pb::CacheEventBatch {
        events: events.iter().map(proto::to_pb).collect(),
    }
    .encode_to_vec()
}

/// JSON: one event → an object; any other count → an array of objects. Hashes are written as
/// lowercase hex of their 8-byte big-endian form (as in protobuf).
pub fn to_json(events: &[Event]) -> Vec<u8> {
    let value = match events {
        [ev] => json_value(ev),
        _ => serde_json::Value::Array(events.iter().map(json_value).collect()),
    };
    serde_json::to_vec(&value).unwrap_or_default()
}

fn json_value(ev: &Event) -> serde_json::Value {
    let msg = proto::to_pb(ev);
    let type_name = pb::cache_event::Type::try_from(msg.r#type)
        .unwrap_or(pb::cache_event::Type::Unspecified)
        .as_str_name();
    let mut value = serde_json::json!({
        "type": type_name,
        "replica_id": msg.replica_id,
        "model_id": msg.model_id,
        "tenant_id": msg.tenant_id,
        "prefix_hash": hex::encode(&msg.prefix_hash),
        "timestamp_us": msg.timestamp_us,
        "adapter_id": msg.adapter_id,
        "adapter_scoped": msg.adapter_scoped,
        "block_hashes": msg.block_hashes.iter().map(hex::encode).collect::<Vec<_>>(),
        "parent_hash": hex::encode(&msg.parent_hash),
        "token_ids": msg.token_ids,
        "block_size": msg.block_size,
        "tier": ev.tier.map_or("TIER_UNSPECIFIED", Tier::as_str),
        "seq": msg.seq,
        "dp_rank": msg.dp_rank,
    });
    if !ev.block_extras.is_empty() {
        let extras: Vec<serde_json::Value> = ev
            .block_extras
            .iter()
            .map(|x| {
                serde_json::json!({
                    "mm": x.mm.iter().map(|m| serde_json::json!({"hash": m.hash, "offset": m.offset})).collect::<Vec<_>>(),
                    "cache_salt": x.cache_salt,
                    "prompt_embeds": x.prompt_embeds.iter().map(hex::encode).collect::<Vec<_>>(),
                    "other": x.other.iter().map(hex::encode).collect::<Vec<_>>(),
                })
            })
            .collect();
        value["block_extra_keys"] = serde_json::Value::Array(extras);
    }
    value
}

/// vLLM msgpack in the named-map form vLLM 0.34 writes:
/// `[ts, [{"type": "BlockStored", ...}, ...], dp_rank]` (dp rank 0 is written as nil, as vLLM
/// does without data parallelism). Block hashes are u64 integers.
pub fn to_vllm(events: &[Event], dp_rank: u32) -> Vec<u8> {
    let mut w = MsgpackWriter::default();
    let events: Vec<&Event> = events
        .iter()
        .filter(|ev| {
            matches!(
                ev.kind,
                EventKind::Stored | EventKind::Removed | EventKind::AllCleared
            )
        })
        .collect();
    let ts = events
        .first()
        .map_or(0.0, |ev| ev.timestamp_us as f64 / 1e6);
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for ev in events {
        let adapter = ev.partition.adapter.as_str();
        match ev.kind {
            EventKind::Stored => {
                let (token_ids, block_size): (&[u32], u32) = match &ev.content {
                    BlockContent::Tokens {
                        token_ids,
                        block_size,
                    } => (token_ids, *block_size),
                    BlockContent::HashesOnly | BlockContent::Digests(_) => (&[], 0),
                };
                let extra_keys = !ev.block_extras.is_empty() || !adapter.is_empty();
                w.map(if extra_keys { 9 } else { 8 });
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.hashes(ev);
                w.str("parent_block_hash");
                match ev.parent_hash {
                    Some(h) => w.uint(h.0),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array(token_ids.len());
                for &t in token_ids {
                    w.uint(u64::from(t));
                }
                w.str("block_size");
                w.uint(u64::from(block_size));
                w.str("lora_id");
                w.nil();
                w.str("medium");
                w.opt_str(ev.tier.map_or("", medium));
                w.str("lora_name");
                w.opt_str(adapter);
                if extra_keys {
                    w.str("extra_keys");
                    w.extra_keys(ev);
                }
            }
            EventKind::Removed => {
                w.map(if adapter.is_empty() { 3 } else { 4 });
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.hashes(ev);
                w.str("medium");
                w.opt_str(ev.tier.map_or("", medium));
                if !adapter.is_empty() {
                    w.str("lora_name");
                    w.str(adapter);
                }
            }
            _ => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    if dp_rank == 0 {
        w.nil();
    } else {
        w.uint(u64::from(dp_rank));
    }
    w.buf
}

/// vLLM's `medium` name for a tier.
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Disk => "STORAGE",
    }
}

/// A minimal msgpack writer (smallest encoding for every length and integer).
#[derive(Default)]
struct MsgpackWriter {
    buf: Vec<u8>,
}

impl MsgpackWriter {
    fn header(&mut self, len: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if len <= fix_max {
            self.buf.push(fix | len as u8);
        } else if let Ok(n) = u16::try_from(len) {
            self.buf.push(m16);
            self.buf.extend_from_slice(&n.to_be_bytes());
        } else {
            self.buf.push(m32);
            let n = u32::try_from(len).unwrap_or(u32::MAX);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
    }

    fn array(&mut self, len: usize) {
        self.header(len, 0x90, 15, 0xdc, 0xdd);
    }

    fn map(&mut self, len: usize) {
        self.header(len, 0x80, 15, 0xde, 0xdf);
    }

    fn str(&mut self, s: &str) {
        if s.len() <= 31 {
            self.buf.push(0xa0 | s.len() as u8);
        } else if let Ok(n) = u8::try_from(s.len()) {
            self.buf.extend_from_slice(&[0xd9, n]);
        } else {
            self.header(s.len(), 0, 0, 0xda, 0xdb);
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: &str) {
        if s.is_empty() {
            self.nil()
        } else {
            self.str(s)
        }
    }

    fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.buf.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        match u64::try_from(v) {
            Ok(u) => self.uint(u),
            Err(_) => {
                self.buf.push(0xd3);
                self.buf.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    fn bin(&mut self, b: &[u8]) {
        self.header(b.len(), 0, 0, 0xc5, 0xc6);
        self.buf.extend_from_slice(b);
    }

    /// vLLM's `extra_keys` in the bare-value form its releases write: per block nil, or
    /// `[lora_name?, [mm_hash, offset]..., cache_salt?, prompt_embeds..., other...]` (the LoRA
    /// name on every block of an adapter's event, as vLLM keys them; keys of other shapes as
    /// the msgpack items they were read from).
    fn extra_keys(&mut self, ev: &Event) {
        let adapter = ev.partition.adapter.as_str();
        let none = crate::event::BlockExtras::default();
        self.array(ev.block_hashes.len());
        for i in 0..ev.block_hashes.len() {
            let x = ev.block_extras.get(i).unwrap_or(&none);
            let other: Vec<&Vec<u8>> = x.other.iter().filter(|o| vllm::is_one_item(o)).collect();
            let len = usize::from(!adapter.is_empty())
                + x.mm.len()
                + usize::from(!x.cache_salt.is_empty())
                + x.prompt_embeds.len()
                + other.len();
            if len == 0 {
                self.nil();
                continue;
            }
            self.array(len);
            if !adapter.is_empty() {
                self.str(adapter);
            }
            for m in &x.mm {
                self.array(2);
                self.str(&m.hash);
                self.int(m.offset);
            }
            if !x.cache_salt.is_empty() {
                self.str(&x.cache_salt);
            }
            for e in &x.prompt_embeds {
                self.bin(e);
            }
            for o in other {
                self.buf.extend_from_slice(o);
            }
        }
    }

    fn hashes(&mut self, ev: &Event) {
        self.array(ev.block_hashes.len());
        for h in &ev.block_hashes {
            self.uint(h.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{PartitionKey, proto};

    /// Found by the `proto` fuzz target: an all-default event (an unknown type 0 with no
    /// fields) encoded to an empty body, which decodes as a missing one.
    #[test]
    fn an_all_default_event_round_trips_through_protobuf() {
        let ev = Event::new(EventKind::Unknown(0), "", PartitionKey::default());
        let bytes = to_proto(std::slice::from_ref(&ev));
        assert!(!bytes.is_empty());
        assert_eq!(proto::decode(&bytes), Ok(vec![ev]));
    }
}
