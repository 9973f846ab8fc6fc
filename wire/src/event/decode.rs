//! Encoding detection and the single entry point [`decode_payload`]: every source hands its
//! message bodies here and gets [`Event`]s back, whichever encoding the producer used.
//!
//! # Auto-detection rule ([`Format::Auto`])
//!
//! The first byte tells the three encodings apart; their first bytes never overlap:
//!
//! * **JSON**: `{` (0x7b) or `[` (0x5b), optionally after ASCII whitespace. Neither byte can
//!   start one of our protobuf messages (0x5b = field 11, 0x7b = field 15, both wire type 3,
//!   the deprecated group start), so such a body is JSON, and if it does not parse its error
//!   is a [`DecodeError::Json`].
//! * **vLLM msgpack**: a batch is an array or a map: fixarray 0x90–0x9f, array16/32 0xdc/0xdd,
//!   fixmap 0x80–0x8f, map16/32 0xde/0xdf. A protobuf `CacheEvent` starts with a field tag
//!   (0x08 `type`, 0x12 `replica_id`, 0x1a, ... up to 0x78 for field 15) and a batch with 0x0a,
//!   all below 0x80, so msgpack and protobuf never collide.
//! * **protobuf**: anything else.
//!
//! One ambiguity remains: 0x0a is both `\n` and the `CacheEventBatch` tag, and its next byte
//! (the first event's length) may be 0x5b / 0x7b or whitespace. A body starting with 0x0a whose
//! first non-whitespace byte is `{` / `[` is therefore tried as JSON first and as protobuf if
//! that fails; when both fail, the error of the encoding the body looks more like is returned
//! (JSON if the byte after the bracket can continue a JSON document, else protobuf).
//!
//! When detection picks an encoding and it fails, that encoding's error is returned.

use super::vllm;
pub use super::vllm::VllmSettings;
use super::{DecodeError, Envelope, Event, json, proto};
use std::fmt;
use std::str::FromStr;

/// Which encoding a source's payloads are in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Detect per payload (see the module docs).
    #[default]
    Auto,
    /// `kvindex.v1.CacheEvent` / `CacheEventBatch` protobuf.
    Proto,
    /// The JSON twin of `CacheEvent`.
    Json,
    /// vLLM's msgpack `KVEventBatch`.
    Vllm,
}

impl Format {
    /// The configuration name (`"auto"`, `"proto"`, `"json"`, `"vllm"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Auto => "auto",
            Format::Proto => "proto",
            Format::Json => "json",
            Format::Vllm => "vllm",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Format, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Format::Auto),
            "proto" => Ok(Format::Proto),
            "json" => Ok(Format::Json),
            "vllm" => Ok(Format::Vllm),
            _ => Err(format!(
                "unknown format `{s}` (expected auto, proto, json or vllm)"
            )),
        }
    }
}

/// Default [`DecodeSettings::max_payload_bytes`]: 4 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;

/// How a source decodes its payloads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeSettings {
    pub format: Format,
    /// Larger payloads are rejected with [`DecodeError::TooLarge`] before any parsing.
    pub max_payload_bytes: usize,
    /// Context for vLLM payloads (model, tenant, LoRA id table).
    pub vllm: VllmSettings,
}

impl Default for DecodeSettings {
    fn default() -> Self {
        DecodeSettings {
            format: Format::Auto,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            vllm: VllmSettings::default(),
        }
    }
}

/// The outcome of decoding one payload.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    /// The events, in payload order.
    pub events: Vec<Event>,
    /// Events dropped on purpose while the rest of the payload decoded (e.g. vLLM events with
    /// an unmapped `lora_id`); each is a counted reason.
    pub skipped: Vec<DecodeError>,
}

impl From<(Vec<Event>, Vec<DecodeError>)> for Decoded {
    fn from((events, skipped): (Vec<Event>, Vec<DecodeError>)) -> Decoded {
        Decoded { events, skipped }
    }
}

/// The encoding [`Format::Auto`] picks for `bytes` (never `Auto`); see the module docs.
pub fn detect(bytes: &[u8]) -> Format {
    match bytes.first() {
        Some(b'{' | b'[') => Format::Json,
        Some(0x80..=0x9f | 0xdc..=0xdf) => Format::Vllm,
        Some(b' ' | b'\t' | b'\r' | b'\n') if matches!(first_non_ws(bytes), Some(b'{' | b'[')) => {
            Format::Json
        }
        _ => Format::Proto,
    }
}

fn first_non_ws(bytes: &[u8]) -> Option<u8> {
    bytes
        .iter()
        .copied()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

/// Whether `bytes` (a JSON-looking body) continues like a JSON document after its opening
/// bracket.
fn json_like(bytes: &[u8]) -> bool {
    let mut rest = bytes
        .iter()
        .copied()
        .skip_while(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'));
    let open = rest.next();
    let next = rest.find(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'));
    matches!(
        (open, next),
        (Some(b'{'), Some(b'"' | b'}')) | (Some(b'['), Some(b'{' | b']'))
    )
}

/// Decodes one message body into events. The single entry point for every source.
pub fn decode_payload(
    bytes: &[u8],
    env: &Envelope<'_>,
    opts: &DecodeSettings,
) -> Result<Decoded, DecodeError> {
    if bytes.is_empty() {
        return Err(DecodeError::Empty);
    }
    if bytes.len() > opts.max_payload_bytes {
        return Err(DecodeError::TooLarge {
            size: bytes.len(),
            limit: opts.max_payload_bytes,
        });
    }
    match opts.format {
        Format::Proto => proto::decode_skipping(bytes).map(Decoded::from),
        Format::Json => json::decode_skipping(bytes).map(Decoded::from),
        Format::Vllm => decode_vllm(bytes, env, &opts.vllm),
        Format::Auto => match detect(bytes) {
            Format::Json if bytes.first() == Some(&b'\n') => {
                // JSON after a newline, or a protobuf batch whose first event is 91 / 123
                // bytes long: try both (see the module docs).
                match json::decode_skipping(bytes) {
                    Ok(decoded) => Ok(Decoded::from(decoded)),
                    Err(json_err) => match proto::decode_skipping(bytes) {
                        Ok(decoded) => Ok(Decoded::from(decoded)),
                        Err(_) if json_like(bytes) => Err(json_err),
                        Err(proto_err) => Err(proto_err),
                    },
                }
            }
            Format::Json => json::decode_skipping(bytes).map(Decoded::from),
            Format::Vllm => decode_vllm(bytes, env, &opts.vllm),
            Format::Proto | Format::Auto => proto::decode_skipping(bytes).map(Decoded::from),
        },
    }
}

fn decode_vllm(
    bytes: &[u8],
    env: &Envelope<'_>,
    opts: &VllmSettings,
) -> Result<Decoded, DecodeError> {
    vllm::decode(bytes, env, opts).map(|(events, skipped)| Decoded { events, skipped })
}
