//! Block extra keys: what besides its tokens makes a cached block distinct.
//!
//! An engine keys a block by its parent, its tokens and its *extra keys*: the multimodal inputs
//! the block overlaps (each with its first token's offset relative to the block's first token,
//! negative when the input began in an earlier block), the request's cache salt (on the
//! request's first block only) and prompt-embedding hashes. Two requests whose images differ
//! but whose placeholder tokens are the same share no blocks on the engine, nor do two
//! requests with different salts, so they must not share index keys either. vLLM also counts
//! the LoRA adapter as an extra key; kvindex keeps adapters apart by partition instead, so
//! decoders drop it here.
//!
//! [`BlockExtras`] is the decoded form (what encoders write back out);
//! [`BlockExtras::digest`] is what enters the block key (see `index::hash`). A block without
//! extras has digest 0 and keeps the key it always had. [`request_extras`] derives a request's
//! extras by vLLM's rule, so a token lookup that names its `cache_salt` and `mm_inputs` keys
//! its blocks exactly as the engine's events key them.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Domain separator of extras digests.
const EXTRA_SEED: u64 = 0x5851_f42d_4c95_7f2d;

/// One multimodal input a block overlaps.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct MmKey {
    /// The input's identity as the engine publishes it (vLLM: the multimodal hash).
    pub hash: String,
    /// The input's first token relative to the block's first token (negative: it began in an
    /// earlier block).
    pub offset: i64,
}

/// The extra keys of one block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras {
    /// Multimodal inputs the block overlaps.
    pub mm: Vec<MmKey>,
    /// The request's cache salt; empty for none.
    pub cache_salt: String,
    /// Hashes of the prompt embeddings the block covers.
    pub prompt_embeds: Vec<Vec<u8>>,
    /// Extra keys of a kind kvindex does not know, as the producer's bytes: they still make
    /// the block distinct (no lookup reproduces them, so such blocks are never overstated).
    pub other: Vec<Vec<u8>>,
}

impl BlockExtras {
    /// Whether the block has no extra key at all.
    pub fn is_empty(&self) -> bool {
        self.mm.is_empty()
            && self.cache_salt.is_empty()
            && self.prompt_embeds.is_empty()
            && self.other.is_empty()
    }

    /// The digest that enters the block's key: 0 exactly when [`is_empty`](Self::is_empty).
    /// Multimodal keys are taken in (offset, hash) order, so producers that list a block's
    /// inputs in another order still agree.
    pub fn digest(&self) -> u64 {
        if self.is_empty() {
            return 0;
        }
        let mut buf = Vec::with_capacity(64);
        let mut mm: Vec<&MmKey> = self.mm.iter().collect();
        mm.sort_by(|a, b| (a.offset, &a.hash).cmp(&(b.offset, &b.hash)));
        for m in mm {
            push_field(&mut buf, b'm', m.hash.as_bytes());
            buf.extend_from_slice(&m.offset.to_le_bytes());
        }
        if !self.cache_salt.is_empty() {
            push_field(&mut buf, b's', self.cache_salt.as_bytes());
        }
        for e in &self.prompt_embeds {
            push_field(&mut buf, b'e', e);
        }
        for o in &self.other {
            push_field(&mut buf, b'o', o);
        }
        match xxh3_64_with_seed(&buf, EXTRA_SEED) {
            0 => 1,
            d => d,
        }
    }

    /// Heap bytes this value holds (for the in-flight memory bound).
    pub fn heap_bytes(&self) -> usize {
        self.mm.iter().map(|m| m.hash.len() + 32).sum::<usize>()
            + self.cache_salt.len()
            + self.prompt_embeds.iter().map(Vec::len).sum::<usize>()
            + self.other.iter().map(Vec::len).sum::<usize>()
    }
}

fn push_field(buf: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    buf.push(tag);
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// The digests of an event's per-block extras: empty when no block has any (the usual case,
/// and then no allocation), else one per block.
pub fn digests(extras: &[BlockExtras]) -> Vec<u64> {
    if extras.iter().all(BlockExtras::is_empty) {
        return Vec::new();
    }
    extras.iter().map(BlockExtras::digest).collect()
}

/// A multimodal input of a request: its hash and the token range its placeholders occupy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmInput {
    pub hash: String,
    /// First placeholder token, counted from the request's first token.
    pub offset: u64,
    /// Placeholder tokens.
    pub length: u64,
}

/// The extras of a request's first `blocks` blocks of `block_size` tokens, by vLLM's rule: a
/// block carries every input whose placeholder range overlaps it (with the input's offset
/// relative to the block), and the first block carries the cache salt. Empty when the request
/// has neither inputs nor salt.
pub fn request_extras(
    blocks: usize,
    block_size: usize,
    mm_inputs: &[MmInput],
    cache_salt: &str,
) -> Vec<BlockExtras> {
    if mm_inputs.is_empty() && cache_salt.is_empty() {
        return Vec::new();
    }
    let mut inputs: Vec<&MmInput> = mm_inputs.iter().filter(|m| m.length > 0).collect();
    inputs.sort_by_key(|m| m.offset);
    (0..blocks)
        .map(|b| {
            let start = (b * block_size) as u64;
            let end = start + block_size as u64;
            BlockExtras {
                mm: inputs
                    .iter()
                    .filter(|m| m.offset < end && m.offset + m.length > start)
                    .map(|m| MmKey {
                        hash: m.hash.clone(),
                        offset: m.offset as i64 - start as i64,
                    })
                    .collect(),
                cache_salt: if b == 0 {
                    cache_salt.to_string()
                } else {
                    String::new()
                },
                ..BlockExtras::default()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mm(hash: &str, offset: i64) -> MmKey {
        MmKey {
            hash: hash.into(),
            offset,
        }
    }

    #[test]
    fn empty_extras_digest_to_zero_and_anything_else_does_not() {
        assert_eq!(BlockExtras::default().digest(), 0);
        let salted = BlockExtras {
            cache_salt: "s".into(),
            ..BlockExtras::default()
        };
        assert_ne!(salted.digest(), 0);
        assert!(digests(&[BlockExtras::default(), BlockExtras::default()]).is_empty());
        assert_eq!(digests(&[BlockExtras::default(), salted.clone()]).len(), 2);
    }

    #[test]
    fn each_kind_and_value_is_distinct() {
        let salt = |s: &str| BlockExtras {
            cache_salt: s.into(),
            ..BlockExtras::default()
        };
        let image = |h: &str, o: i64| BlockExtras {
            mm: vec![mm(h, o)],
            ..BlockExtras::default()
        };
        let embeds = BlockExtras {
            prompt_embeds: vec![b"a".to_vec()],
            ..BlockExtras::default()
        };
        let other = BlockExtras {
            other: vec![b"a".to_vec()],
            ..BlockExtras::default()
        };
        let all = [
            salt("a"),
            salt("b"),
            image("a", 0),
            image("a", 3),
            image("b", 0),
            embeds,
            other,
        ];
        let digests: std::collections::HashSet<u64> = all.iter().map(|e| e.digest()).collect();
        assert_eq!(digests.len(), all.len());
    }

    #[test]
    fn mm_order_does_not_matter() {
        let a = BlockExtras {
            mm: vec![mm("x", 0), mm("y", 8)],
            ..BlockExtras::default()
        };
        let b = BlockExtras {
            mm: vec![mm("y", 8), mm("x", 0)],
            ..BlockExtras::default()
        };
        assert_eq!(a.digest(), b.digest());
    }

    #[test]
    fn request_extras_follow_the_overlap_rule() {
        // Blocks of 4: an image over tokens 2..9 touches blocks 0, 1 and 2; one over 12..13
        // only block 3; the salt is on block 0 only.
        let inputs = [
            MmInput {
                hash: "img".into(),
                offset: 2,
                length: 7,
            },
            MmInput {
                hash: "pic".into(),
                offset: 12,
                length: 1,
            },
        ];
        let got = request_extras(5, 4, &inputs, "salt");
        assert_eq!(got.len(), 5);
        assert_eq!(got[0].mm, [mm("img", 2)]);
        assert_eq!(got[0].cache_salt, "salt");
        assert_eq!(got[1].mm, [mm("img", -2)]);
        assert_eq!(got[1].cache_salt, "");
        assert_eq!(got[2].mm, [mm("img", -6)]);
        assert_eq!(got[3].mm, [mm("pic", 0)]);
        assert!(got[4].is_empty());
        assert!(request_extras(3, 4, &[], "").is_empty());
    }
}
