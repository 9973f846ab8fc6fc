//! Reading engines' block extra keys: vLLM's per-block `extra_keys` and SGLang's `metadata`
//! map, into the [`BlockExtras`] every decoder produces (see `event::extra` for what they mean).
//!
//! vLLM has published `extra_keys` in two shapes, both read here:
//! * bare values (before typed keys): a LoRA name or a cache salt as a string, a multimodal
//!   input as `[identifier, offset]`, a prompt-embeds hash as bytes. A string is the LoRA name
//!   when it equals the event's adapter (vLLM lists it first), the salt otherwise;
//! * typed keys: maps tagged by `type` (`lora` {name}, `cache_salt` {salt}, `prompt_embeds`
//!   {hash}, `mm` {modality, hash, block_offset}, `legacy` {value}).
//!
//! Keys of a shape kvindex does not know are kept as their msgpack bytes ([`BlockExtras::other`]):
//! they still make the block distinct, so it is never reported for a request that lacks them.
//! SGLang's salt (`BlockStoredWithMetadata.metadata.cache_salt`) namespaces a whole request;
//! it is put on the first block of a chain that starts at the root, which is where a lookup's
//! `cache_salt` goes too (a chain with a parent inherits it through the parent's key).

use super::{Mp, Reader, field_err, wrong_type};
use crate::event::{BlockExtras, DecodeError, MmKey};
use smallvec::SmallVec;

/// One extra key as the engine published it, before the event's adapter is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RawExtra<'a> {
    /// A bare string: the LoRA name if it equals the adapter, else the cache salt; with its
    /// msgpack bytes, which is what a block's second salt is kept as.
    Str(&'a str, &'a [u8]),
    Lora,
    /// A typed salt, with its map's msgpack bytes.
    Salt(&'a str, &'a [u8]),
    PromptEmbeds(&'a [u8]),
    Mm(&'a str, i64),
    /// Any other shape, as its msgpack bytes.
    Other(&'a [u8]),
}

/// One block's keys (`None`: the block has none).
pub(super) type RawBlockKeys<'a> = SmallVec<[RawExtra<'a>; 2]>;

impl<'a> Reader<'a> {
    /// `extra_keys`: nil, or an array with one entry per block, each nil or an array of keys.
    /// The list sits at nesting depth 3.
    pub(super) fn extra_keys(&mut self) -> Result<Vec<RawBlockKeys<'a>>, DecodeError> {
        let blocks = match self.next()? {
            Mp::Nil => return Ok(Vec::new()),
            Mp::Array(n) => n,
            other => return Err(wrong_type("extra_keys", "an array or nil", &other)),
        };
        let mut out = Vec::with_capacity(blocks);
        for _ in 0..blocks {
            let keys = match self.next()? {
                Mp::Nil => 0,
                Mp::Array(n) => n,
                other => {
                    return Err(wrong_type(
                        "extra_keys",
                        "an array of keys or nil per block",
                        &other,
                    ));
                }
            };
            let mut block = RawBlockKeys::new();
            for _ in 0..keys {
                block.push(self.extra_key()?);
            }
            out.push(block);
        }
        Ok(out)
    }

    /// One key (depth 5).
    fn extra_key(&mut self) -> Result<RawExtra<'a>, DecodeError> {
        let start = self.pos;
        let key = match self.next()? {
            Mp::Str(s) => RawExtra::Str(utf8(s)?, &self.buf[start..self.pos]),
            Mp::Bin(b) => RawExtra::PromptEmbeds(b),
            Mp::Array(2) => {
                let first = self.next()?;
                let second = self.next()?;
                match (first, int_of(second)) {
                    (Mp::Str(id), Some(offset)) => RawExtra::Mm(utf8(id)?, offset),
                    _ => {
                        self.pos = start;
                        self.other()?
                    }
                }
            }
            Mp::Map(n) => self.typed_key(start, n)?,
            _ => {
                self.pos = start;
                self.other()?
            }
        };
        Ok(key)
    }

    /// A typed key `{"type": tag, ...}` of `n` entries whose header started at `start`.
    fn typed_key(&mut self, start: usize, n: usize) -> Result<RawExtra<'a>, DecodeError> {
        let (mut tag, mut text, mut bytes, mut offset, mut legacy) = (None, None, None, None, None);
        for _ in 0..n {
            let key_at = self.pos;
            let key = match self.next()? {
                Mp::Str(k) => k,
                _ => {
                    // Any other key (a container's contents too) and its value.
                    self.pos = key_at;
                    self.skip(6)?;
                    self.skip(6)?;
                    continue;
                }
            };
            let at = self.pos;
            let value = self.next()?;
            match (key, value) {
                (b"type", Mp::Str(t)) => tag = Some(t),
                (b"name" | b"salt", Mp::Str(s)) => text = Some(utf8(s)?),
                (b"hash", Mp::Str(s)) => text = Some(utf8(s)?),
                (b"hash", Mp::Bin(b)) => bytes = Some(b),
                (b"block_offset", v) if int_of(v).is_some() => offset = int_of(v),
                (b"value", _) => {
                    self.pos = at;
                    self.skip(6)?;
                    legacy = self.buf.get(at..self.pos);
                }
                _ => {
                    self.pos = at;
                    self.skip(6)?;
                }
            }
        }
        let whole = self.buf.get(start..self.pos).unwrap_or_default();
        Ok(match (tag, text, bytes, offset) {
            (Some(b"lora"), Some(_), _, _) => RawExtra::Lora,
            (Some(b"cache_salt"), Some(salt), _, _) => RawExtra::Salt(salt, whole),
            (Some(b"prompt_embeds"), _, Some(hash), _) => RawExtra::PromptEmbeds(hash),
            (Some(b"mm"), Some(hash), _, Some(offset)) => RawExtra::Mm(hash, offset),
            (Some(b"legacy"), _, _, _) if legacy.is_some() => {
                RawExtra::Other(legacy.unwrap_or_default())
            }
            _ => RawExtra::Other(whole),
        })
    }

    /// The item at the cursor, skipped, as its bytes.
    fn other(&mut self) -> Result<RawExtra<'a>, DecodeError> {
        let start = self.pos;
        self.skip(5)?;
        Ok(RawExtra::Other(
            self.buf.get(start..self.pos).unwrap_or_default(),
        ))
    }

    /// SGLang's `metadata` map (depth 3): its `cache_salt`, other entries skipped.
    pub(super) fn sglang_metadata(&mut self) -> Result<Option<&'a str>, DecodeError> {
        let n = match self.next()? {
            Mp::Nil => return Ok(None),
            Mp::Map(n) => n,
            other => return Err(wrong_type("metadata", "a map or nil", &other)),
        };
        let mut salt = None;
        for _ in 0..n {
            let key_at = self.pos;
            let key = self.next()?;
            let at = self.pos;
            match (key, self.next()?) {
                (Mp::Str(b"cache_salt"), Mp::Str(s)) => salt = Some(utf8(s)?),
                (Mp::Str(b"cache_salt"), Mp::Nil) => {}
                (Mp::Str(b"cache_salt"), other) => {
                    return Err(wrong_type("metadata.cache_salt", "a string", &other));
                }
                (Mp::Str(_), _) => {
                    self.pos = at;
                    self.skip(4)?;
                }
                _ => {
                    // Any other key (a container's contents too) and its value.
                    self.pos = key_at;
                    self.skip(4)?;
                    self.skip(4)?;
                }
            }
        }
        Ok(salt.filter(|s| !s.is_empty()))
    }
}

fn utf8(bytes: &[u8]) -> Result<&str, DecodeError> {
    std::str::from_utf8(bytes).map_err(|_| field_err("extra_keys", "invalid UTF-8".into()))
}

fn int_of(item: Mp<'_>) -> Option<i64> {
    match item {
        Mp::Int(v) => Some(v),
        Mp::UInt(v) => i64::try_from(v).ok(),
        _ => None,
    }
}

/// The event's per-block extras: `keys` resolved against its `adapter` (the LoRA name is the
/// partition, not an extra), SGLang's `salt` put on the first block of a root chain. Empty
/// when no block has any; an `extra_keys` list whose length is not the block count is an error.
pub(super) fn resolve(
    keys: Vec<RawBlockKeys<'_>>,
    adapter: &str,
    sglang_salt: Option<&str>,
    root_chain: bool,
    blocks: usize,
) -> Result<Vec<BlockExtras>, DecodeError> {
    if !keys.is_empty() && keys.len() != blocks {
        return Err(field_err(
            "extra_keys",
            format!("{} entries for {blocks} blocks", keys.len()),
        ));
    }
    let mut out: Vec<BlockExtras> = keys
        .into_iter()
        .map(|block| {
            let mut extras = BlockExtras::default();
            let mut lora_seen = false;
            for key in block {
                match key {
                    RawExtra::Str(s, _) if !lora_seen && !adapter.is_empty() && s == adapter => {
                        lora_seen = true;
                    }
                    RawExtra::Lora => lora_seen = true,
                    RawExtra::Str(s, _) | RawExtra::Salt(s, _) if extras.cache_salt.is_empty() => {
                        extras.cache_salt = s.to_string();
                    }
                    // A second salt is kept as its msgpack bytes, like any key of a shape
                    // kvindex does not know (its text alone could equal another item's bytes).
                    RawExtra::Str(_, raw) | RawExtra::Salt(_, raw) => {
                        extras.other.push(raw.to_vec())
                    }
                    RawExtra::PromptEmbeds(b) => extras.prompt_embeds.push(b.to_vec()),
                    RawExtra::Mm(hash, offset) => extras.mm.push(MmKey {
                        hash: hash.to_string(),
                        offset,
                    }),
                    RawExtra::Other(b) => extras.other.push(b.to_vec()),
                }
            }
            extras
        })
        .collect();
    if let Some(salt) = sglang_salt.filter(|_| root_chain && blocks > 0) {
        out.resize_with(blocks, BlockExtras::default);
        out[0].cache_salt = salt.to_string();
    }
    if out.iter().all(BlockExtras::is_empty) {
        out.clear();
    }
    Ok(out)
}
