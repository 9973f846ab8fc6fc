//! The events a fake engine publishes and their msgpack encoding, as msgspec writes vLLM's
//! and SGLang's batches (integers in their smallest form, map headers as msgspec sizes them).

use super::{Encoding, HashForm};

/// One KV-cache event as the engine publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineEvent {
    /// Blocks stored, root first; `tokens` holds `hashes.len() * block_size` token ids.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        lora_name: Option<String>,
        medium: String,
    },
    /// Blocks evicted.
    Removed {
        hashes: Vec<u64>,
        medium: Option<String>,
    },
    /// Everything dropped.
    Cleared,
}

impl EngineEvent {
    /// `hashes` evicted from the GPU.
    pub fn removed(hashes: Vec<u64>) -> EngineEvent {
        EngineEvent::Removed {
            hashes,
            medium: Some("GPU".to_string()),
        }
    }
}

/// The hash of each full `block_size`-token block of `tokens`, chained after `parent` (FNV-1a over
/// the previous hash, `salt` and the block's tokens, then a 64-bit finalizer). Deterministic: the
/// same tokens, parent and salt give the same hashes on every engine, as vLLM's do.
pub fn block_hashes_of(
    tokens: &[u32],
    block_size: u32,
    parent: Option<u64>,
    salt: u64,
) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be positive");
    let mut prev = parent.unwrap_or(0x6b76_696e_6465_7821); // the chain's root seed
    tokens
        .chunks_exact(block_size as usize)
        .map(|block| {
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            let words = [prev, salt]
                .into_iter()
                .chain(block.iter().map(|&t| u64::from(t)));
            for word in words {
                for byte in word.to_le_bytes() {
                    h = (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
            prev = mix64(h);
            prev
        })
        .collect()
}

/// A `Stored` of the full `block_size`-token blocks of `tokens` (a partial tail is left out, as
/// engines only publish full blocks), chained after `parent`, on the GPU, without LoRA.
pub fn chain(tokens: &[u32], block_size: u32, parent: Option<u64>, salt: u64) -> EngineEvent {
    let hashes = block_hashes_of(tokens, block_size, parent, salt);
    let full = hashes.len() * block_size as usize;
    EngineEvent::Stored {
        hashes,
        parent,
        tokens: tokens[..full].to_vec(),
        lora_name: None,
        medium: "GPU".to_string(),
    }
}

/// The msgpack payload of one batch, as the engine's msgspec encoder writes it:
/// `[ts, events, dp_rank]` (`[ts, events]` in [`Encoding::ArrayV09`]; a `None` rank is written as
/// nil, as for a batch whose rank was never set), events in `encoding`, hashes in `hash_form`.
/// Panics on an event the encoding cannot carry (see [`Encoding`]).
pub fn encode_batch(
    ts: f64,
    events: &[EngineEvent],
    dp_rank: Option<u32>,
    encoding: Encoding,
    hash_form: HashForm,
    block_size: u32,
) -> Vec<u8> {
    if let Err(why) = check_encodable(events, encoding) {
        panic!("{why}");
    }
    let mut w = MsgPack(Vec::with_capacity(64 + 16 * events.len()));
    w.array(if encoding == Encoding::ArrayV09 { 2 } else { 3 });
    w.f64(ts);
    w.array(events.len());
    for event in events {
        match encoding {
            Encoding::Map => write_map_event(&mut w, event, hash_form, block_size),
            _ => write_array_event(&mut w, event, encoding, hash_form, block_size),
        }
    }
    if encoding != Encoding::ArrayV09 {
        match dp_rank {
            Some(rank) => w.uint(u64::from(rank)),
            None => w.nil(),
        }
    }
    w.0
}

/// Whether every event can be written in `encoding` without losing a field.
pub(super) fn check_encodable(events: &[EngineEvent], encoding: Encoding) -> Result<(), String> {
    for event in events {
        let (lora_name, medium) = match event {
            EngineEvent::Stored {
                lora_name, medium, ..
            } => (lora_name.as_deref(), Some(&medium[..])),
            EngineEvent::Removed { medium, .. } => (None, medium.as_deref()),
            EngineEvent::Cleared => (None, None),
        };
        if let (Some(name), Encoding::ArrayV09 | Encoding::ArrayV011) = (lora_name, encoding) {
            return Err(format!(
                "{encoding:?} has no lora_name field, cannot publish {name:?}"
            ));
        }
        if let (Some(m), Encoding::ArrayV09) = (medium, encoding)
            && m != "GPU"
        {
            return Err(format!(
                "ArrayV09 has no medium field, cannot publish {m:?}"
            ));
        }
    }
    Ok(())
}

fn write_array_event(
    w: &mut MsgPack,
    event: &EngineEvent,
    enc: Encoding,
    hf: HashForm,
    block_size: u32,
) {
    match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            lora_name,
            medium,
        } => {
            w.array(match enc {
                Encoding::ArrayV09 => 6,
                Encoding::ArrayV011 => 7,
                _ => 8,
            });
            w.str("BlockStored");
            w.hashes(hashes, hf);
            w.opt_hash(*parent, hf);
            w.tokens(tokens);
            w.uint(u64::from(block_size));
            w.nil(); // lora_id
            if enc != Encoding::ArrayV09 {
                w.str(medium);
            }
            if enc == Encoding::Array {
                w.opt_str(lora_name.as_deref());
            }
        }
        EngineEvent::Removed { hashes, medium } => {
            w.array(if enc == Encoding::ArrayV09 { 2 } else { 3 });
            w.str("BlockRemoved");
            w.hashes(hashes, hf);
            if enc != Encoding::ArrayV09 {
                w.opt_str(medium.as_deref());
            }
        }
        EngineEvent::Cleared => {
            w.array(1);
            w.str("AllBlocksCleared");
        }
    }
}

fn write_map_event(w: &mut MsgPack, event: &EngineEvent, hf: HashForm, block_size: u32) {
    match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            lora_name,
            medium,
        } => {
            // msgspec sizes a struct's map header for all its fields (16 with the optional ones
            // current vLLM has), so BlockStored always gets a map16 header.
            w.map16(8);
            w.str("type");
            w.str("BlockStored");
            w.str("block_hashes");
            w.hashes(hashes, hf);
            w.str("parent_block_hash");
            w.opt_hash(*parent, hf);
            w.str("token_ids");
            w.tokens(tokens);
            w.str("block_size");
            w.uint(u64::from(block_size));
            w.str("lora_id");
            w.nil();
            w.str("medium");
            w.str(medium);
            w.str("lora_name");
            w.opt_str(lora_name.as_deref());
        }
        EngineEvent::Removed { hashes, medium } => {
            w.map(3);
            w.str("type");
            w.str("BlockRemoved");
            w.str("block_hashes");
            w.hashes(hashes, hf);
            w.str("medium");
            w.opt_str(medium.as_deref());
        }
        EngineEvent::Cleared => {
            w.map(1);
            w.str("type");
            w.str("AllBlocksCleared");
        }
    }
}

/// A minimal msgpack writer: integers in their smallest form, like msgspec.
struct MsgPack(Vec<u8>);

impl MsgPack {
    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if v <= 0xff {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.0.push(v as i8 as u8); // negative fixint
        } else if v >= i64::from(i8::MIN) {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if n <= 0xff {
            self.0.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= 0xffff {
            self.0.push(0xda);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn array(&mut self, n: usize) {
        self.header(n, 0x90, 0xdc, 0xdd);
    }

    fn map(&mut self, n: usize) {
        self.header(n, 0x80, 0xde, 0xdf);
    }

    fn map16(&mut self, n: usize) {
        self.0.push(0xde);
        self.0.extend_from_slice(&(n as u16).to_be_bytes());
    }

    fn header(&mut self, n: usize, fix: u8, x16: u8, x32: u8) {
        if n < 16 {
            self.0.push(fix | n as u8);
        } else if n <= 0xffff {
            self.0.push(x16);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(x32);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn hash(&mut self, h: u64, form: HashForm) {
        match form {
            HashForm::U64 => self.uint(h),
            HashForm::I64 => self.int(h as i64),
            HashForm::U64Wide => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&h.to_be_bytes());
            }
            HashForm::I64Wide => {
                self.0.push(0xd3);
                self.0.extend_from_slice(&(h as i64).to_be_bytes());
            }
        }
    }

    fn hashes(&mut self, hashes: &[u64], form: HashForm) {
        self.array(hashes.len());
        for &h in hashes {
            self.hash(h, form);
        }
    }

    fn opt_hash(&mut self, h: Option<u64>, form: HashForm) {
        match h {
            Some(h) => self.hash(h, form),
            None => self.nil(),
        }
    }

    fn tokens(&mut self, tokens: &[u32]) {
        self.array(tokens.len());
        for &t in tokens {
            self.uint(u64::from(t));
        }
    }
}

/// splitmix64's finalizer.
pub(super) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}
