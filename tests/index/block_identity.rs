//! Block identity beyond tokens: multimodal inputs, cache salts and LoRA names, checked against
//! a reference model of vLLM's own rule.
//!
//! The reference is written here from vLLM's prefix-cache description, independent of
//! kvindex's code: a block's identity is (parent identity, its tokens, its extra keys), where
//! the extra keys are the LoRA name, `(mm hash, input offset − block start)` for every input
//! whose placeholder range overlaps the block, and the cache salt on the request's first block.
//! An engine "caches" requests by that rule and publishes them as vLLM's msgpack (extra keys
//! as bare values, as vLLM's releases write them); kvindex decodes and applies those events
//! and must then answer every lookup (tokens + `cache_salt` + `mm_inputs`) with exactly the
//! prefix the engine's own cache would reuse.

use crate::support::events::decode_vllm_batch;
use kvindex::event::PartitionKey;
use kvindex::event::extra::{self, MmInput};
use kvindex::index::{Index, IndexSettings, QueryBlocks};
use kvindex::sim::Rng;
use rmpv::Value;
use std::collections::HashSet;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

const BS: usize = 4;
/// A placeholder token: every image's tokens look the same, only the extra keys tell them apart.
const PLACEHOLDER: u32 = 9;

/// One request as a client and the engine see it.
#[derive(Clone, Debug)]
struct Request {
    tokens: Vec<u32>,
    images: Vec<(String, usize, usize)>,
    salt: Option<String>,
}

/// vLLM's extra-key element, as its `generate_block_hash_extra_keys` builds it.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Key {
    Lora(String),
    Mm(String, i64),
    Salt(String),
}

/// The reference rule, block by block.
fn reference_keys(req: &Request, lora: Option<&str>) -> Vec<Vec<Key>> {
    (0..req.tokens.len() / BS)
        .map(|b| {
            let (start, end) = (b * BS, (b + 1) * BS);
            let mut keys = Vec::new();
            if let Some(l) = lora {
                keys.push(Key::Lora(l.to_string()));
            }
            for (hash, offset, length) in &req.images {
                if end > *offset && start < offset + length {
                    keys.push(Key::Mm(hash.clone(), *offset as i64 - start as i64));
                }
            }
            if b == 0
                && let Some(s) = &req.salt
            {
                keys.push(Key::Salt(s.clone()));
            }
            keys
        })
        .collect()
}

/// The engine's chained block identities (its "block hashes").
fn reference_hashes(req: &Request, lora: Option<&str>) -> Vec<u64> {
    let keys = reference_keys(req, lora);
    let mut parent = 0u64;
    keys.iter()
        .enumerate()
        .map(|(b, k)| {
            let mut h = DefaultHasher::new();
            (parent, &req.tokens[b * BS..(b + 1) * BS], k).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

fn random_request(rng: &mut Rng) -> Request {
    // Two prompt families (so prefixes are shared), a random length, up to two images from a
    // small pool at random places, one salt of two or none.
    let blocks = rng.range(1, 7);
    let family = rng.below(2) as u32;
    let mut tokens: Vec<u32> = (0..blocks * BS).map(|i| family * 100 + i as u32).collect();
    let mut images = Vec::new();
    for _ in 0..rng.below(3) {
        let length = rng.range(1, 2 * BS);
        let offset = rng.below(tokens.len());
        let length = length.min(tokens.len() - offset);
        if images
            .iter()
            .any(|&(_, o, l): &(String, usize, usize)| offset < o + l && o < offset + length)
        {
            continue;
        }
        for t in &mut tokens[offset..offset + length] {
            *t = PLACEHOLDER;
        }
        images.push((format!("img{}", rng.below(2)), offset, length));
    }
    images.sort_by_key(|i| i.1);
    let salt = match rng.below(3) {
        0 => Some("tenant-a".to_string()),
        1 => Some("tenant-b".to_string()),
        _ => None,
    };
    Request {
        tokens,
        images,
        salt,
    }
}

fn s(v: &str) -> Value {
    Value::from(v)
}

/// vLLM's `BlockStored` for blocks `from..` of `req` (map form, bare-value `extra_keys`).
fn block_stored(req: &Request, lora: Option<&str>, from: usize) -> Value {
    let hashes = reference_hashes(req, lora);
    let keys = reference_keys(req, lora);
    let extra_keys: Vec<Value> = keys[from..]
        .iter()
        .map(|k| {
            if k.is_empty() {
                return Value::Nil;
            }
            Value::Array(
                k.iter()
                    .map(|key| match key {
                        Key::Lora(l) => s(l),
                        Key::Mm(h, o) => Value::Array(vec![s(h), Value::from(*o)]),
                        Key::Salt(x) => s(x),
                    })
                    .collect(),
            )
        })
        .collect();
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(hashes[from..].iter().map(|&h| Value::from(h)).collect()),
        ),
        (
            s("parent_block_hash"),
            if from == 0 {
                Value::Nil
            } else {
                Value::from(hashes[from - 1])
            },
        ),
        (
            s("token_ids"),
            Value::Array(
                req.tokens[from * BS..]
                    .iter()
                    .map(|&t| Value::from(t))
                    .collect(),
            ),
        ),
        (s("block_size"), Value::from(BS)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), lora.map_or(Value::Nil, s)),
        (s("extra_keys"), Value::Array(extra_keys)),
    ])
}

fn apply_batch(index: &Index, events: Vec<Value>) {
    let batch = Value::Array(vec![Value::from(1.0), Value::Array(events), Value::Nil]);
    let decoded = decode_vllm_batch(&batch, "llava").expect("decodes");
    assert!(decoded.skipped.is_empty(), "{:?}", decoded.skipped);
    for ev in &decoded.events {
        index.learn_block_size(ev);
        index.apply(ev, 1).expect("applies");
    }
}

/// kvindex's answer for `req`: blocks of the longest prefix engine `e` holds.
fn matched(index: &Index, partition: &PartitionKey, req: &Request) -> u32 {
    let inputs: Vec<MmInput> = req
        .images
        .iter()
        .map(|(hash, offset, length)| MmInput {
            hash: hash.clone(),
            offset: *offset as u64,
            length: *length as u64,
        })
        .collect();
    let extras = extra::request_extras(
        req.tokens.len() / BS,
        BS,
        &inputs,
        req.salt.as_deref().unwrap_or(""),
    );
    let query = QueryBlocks::Tokens {
        token_ids: req.tokens.clone(),
        block_size: BS as u32,
        extras: extra::digests(&extras),
    };
    index
        .lookup(partition, &query)
        .1
        .iter()
        .find(|m| m.engine_id == "e")
        .map_or(0, |m| m.matched_blocks)
}

/// What the engine's own prefix cache reuses for `req`.
fn reference_matched(cached: &HashSet<u64>, req: &Request, lora: Option<&str>) -> u32 {
    reference_hashes(req, lora)
        .iter()
        .take_while(|h| cached.contains(h))
        .count() as u32
}

#[test]
fn same_tokens_with_another_image_or_salt_do_not_match_and_the_same_ones_do() {
    let index = Index::new(IndexSettings { shards: 2, seed: 3 });
    let partition = PartitionKey::new("", "llava", "");
    let mut tokens: Vec<u32> = (0..16).collect();
    tokens[4..10].fill(PLACEHOLDER);
    let cat = Request {
        tokens: tokens.clone(),
        images: vec![("cat".into(), 4, 6)],
        salt: Some("a".into()),
    };
    apply_batch(&index, vec![block_stored(&cat, None, 0)]);
    assert_eq!(
        matched(&index, &partition, &cat),
        4,
        "the same request matches whole"
    );

    let dog = Request {
        images: vec![("dog".into(), 4, 6)],
        ..cat.clone()
    };
    assert_eq!(
        matched(&index, &partition, &dog),
        1,
        "another image: only the block before it"
    );
    let moved = Request {
        images: vec![("cat".into(), 5, 5)],
        ..cat.clone()
    };
    assert_eq!(
        matched(&index, &partition, &moved),
        1,
        "the image at another offset"
    );
    let other_salt = Request {
        salt: Some("b".into()),
        ..cat.clone()
    };
    assert_eq!(
        matched(&index, &partition, &other_salt),
        0,
        "another salt: nothing"
    );
    let unsalted = Request {
        salt: None,
        ..cat.clone()
    };
    assert_eq!(
        matched(&index, &partition, &unsalted),
        0,
        "no salt: nothing"
    );
}

#[test]
fn an_engine_stream_with_extra_keys_answers_like_vllm_s_rule() {
    for (seed, lora) in [(1, None), (2, Some("sql-lora")), (3, None), (4, Some("x"))] {
        let mut rng = Rng::new(seed);
        let index = Index::new(IndexSettings {
            shards: 3,
            seed: 11,
        });
        let partition = PartitionKey::new("", "llava", lora.unwrap_or(""));
        let mut cached = HashSet::new();
        let mut events = Vec::new();
        for _ in 0..60 {
            let req = random_request(&mut rng);
            let hashes = reference_hashes(&req, lora);
            // The engine publishes only blocks it did not hold (a chain continuing from its
            // parent), as vLLM does when a prefix was already cached.
            let from = hashes.iter().take_while(|h| cached.contains(*h)).count();
            if from < hashes.len() {
                events.push(block_stored(&req, lora, from));
            }
            cached.extend(hashes);
        }
        apply_batch(&index, events);
        let mut matches = 0;
        for _ in 0..400 {
            let req = random_request(&mut rng);
            let want = reference_matched(&cached, &req, lora);
            assert_eq!(
                matched(&index, &partition, &req),
                want,
                "seed {seed}, lora {lora:?}: {req:?}"
            );
            matches += u32::from(want > 0);
        }
        assert!(matches > 40, "the workload exercises hits too ({matches})");
    }
}
