//! The event-semantics contract (the README's "Events" section: stores, removals, clears and
//! the eviction-scope rule), pinned rule by rule against the real `Index`, plus a randomized
//! comparison with an independent reference model.

use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use kvindex::index::{Index, IndexSettings, LookupOptions, QueryBlocks, SkipReason, TierWeights};
use std::collections::{BTreeSet, HashMap};

const BS: u32 = 4;

fn part(adapter: &str) -> PartitionKey {
    PartitionKey::new("acme", "llama", adapter)
}

/// Tokens of block `b` of a synthetic prompt family `family`.
fn block_tokens(family: u32, b: u32) -> Vec<u32> {
    (0..BS).map(|i| family * 1000 + b * BS + i).collect()
}

fn tokens(family: u32, blocks: u32) -> Vec<u32> {
    (0..blocks).flat_map(|b| block_tokens(family, b)).collect()
}

/// An engine's own hash of block `b` of `family` (engines hash differently: salt by engine).
fn ehash(engine: &str, family: u32, b: u32) -> EngineHash {
    EngineHash(xxhash_rust::xxh3::xxh3_64(
        format!("{engine}/{family}/{b}").as_bytes(),
    ))
}

fn store(engine: &str, p: PartitionKey, family: u32, from: u32, to: u32, tier: Tier) -> Event {
    let mut ev = Event::new(EventKind::Stored, engine, p);
    ev.block_hashes = (from..to).map(|b| ehash(engine, family, b)).collect();
    ev.parent_hash = (from > 0).then(|| ehash(engine, family, from - 1));
    ev.content = BlockContent::Tokens {
        token_ids: (from..to).flat_map(|b| block_tokens(family, b)).collect(),
        block_size: BS,
    };
    ev.tier = Some(tier);
    ev
}

fn remove(
    engine: &str,
    p: PartitionKey,
    scoped: bool,
    family: u32,
    blocks: impl IntoIterator<Item = u32>,
) -> Event {
    let mut ev = Event::new(EventKind::Removed, engine, p);
    ev.adapter_scoped = scoped;
    ev.block_hashes = blocks
        .into_iter()
        .map(|b| ehash(engine, family, b))
        .collect();
    ev
}

fn lookup(index: &Index, p: &PartitionKey, family: u32, blocks: u32) -> Vec<(String, u32)> {
    let q = QueryBlocks::Tokens {
        token_ids: tokens(family, blocks),
        block_size: BS,
        extras: Vec::new(),
    };
    index
        .lookup(p, &q)
        .1
        .iter()
        .map(|m| (m.engine_id.to_string(), m.matched_blocks))
        .collect()
}

fn apply(index: &Index, ev: &Event) {
    index.apply(ev, 1).expect("event applies");
}

fn indexes() -> Vec<Index> {
    [1, 2, 3]
        .into_iter()
        .map(|shards| Index::new(IndexSettings { shards, seed: 7 }))
        .collect()
}

fn rows(v: &[(&str, u32)]) -> Vec<(String, u32)> {
    v.iter().map(|(e, m)| (e.to_string(), *m)).collect()
}

#[test]
fn longest_prefix_per_engine_sorted_by_match_then_id() {
    for index in indexes() {
        apply(&index, &store("b", part(""), 1, 0, 4, Tier::Gpu));
        apply(&index, &store("a", part(""), 1, 0, 2, Tier::Gpu));
        apply(&index, &store("c", part(""), 1, 0, 4, Tier::Cpu));
        apply(&index, &store("d", part(""), 2, 0, 4, Tier::Gpu));
        assert_eq!(
            lookup(&index, &part(""), 1, 4),
            rows(&[("b", 4), ("c", 4), ("a", 2)])
        );
        // A query longer than what is held stops at what is held; a shorter one caps it.
        assert_eq!(
            lookup(&index, &part(""), 1, 6),
            rows(&[("b", 4), ("c", 4), ("a", 2)])
        );
        assert_eq!(
            lookup(&index, &part(""), 1, 1),
            rows(&[("a", 1), ("b", 1), ("c", 1)])
        );
        let (_, full) = index.lookup(
            &part(""),
            &QueryBlocks::Tokens {
                token_ids: tokens(1, 4),
                block_size: BS,
                extras: Vec::new(),
            },
        );
        assert_eq!(
            full.iter().find(|m| m.engine_id == "c").map(|m| m.tier),
            Some(Tier::Cpu)
        );
    }
}

#[test]
fn chains_continue_after_their_parent_and_match_across_engines() {
    for index in indexes() {
        // Engine x stores the chain in two events; y in one. Their engine hashes differ, keys agree.
        apply(&index, &store("x", part(""), 1, 0, 2, Tier::Gpu));
        apply(&index, &store("x", part(""), 1, 2, 5, Tier::Gpu));
        apply(&index, &store("y", part(""), 1, 0, 5, Tier::Gpu));
        assert_eq!(lookup(&index, &part(""), 1, 5), rows(&[("x", 5), ("y", 5)]));
    }
}

#[test]
fn unknown_parent_is_skipped_never_keyed_as_root() {
    for index in indexes() {
        let orphan = store("x", part(""), 1, 2, 4, Tier::Gpu);
        let err = index.apply(&orphan, 1).expect_err("parent never stored");
        assert!(matches!(err, SkipReason::UnknownParent(_)));
        assert_eq!(err.reason(), "unknown_parent");
        assert_eq!(index.stats().memberships, 0);
        // Blocks 2..4 keyed as a root would match a query starting with block 2's tokens.
        let q = QueryBlocks::Tokens {
            token_ids: (2..4).flat_map(|b| block_tokens(1, b)).collect(),
            block_size: BS,
            extras: Vec::new(),
        };
        assert!(index.lookup(&part(""), &q).1.is_empty());
        // A removed parent also cannot be continued.
        apply(&index, &store("x", part(""), 1, 0, 2, Tier::Gpu));
        apply(&index, &remove("x", part(""), true, 1, [1]));
        assert!(matches!(
            index.apply(&orphan, 1),
            Err(SkipReason::UnknownParent(_))
        ));
    }
}

#[test]
fn base_scoped_eviction_spares_lora_entry_with_same_hash() {
    for index in indexes() {
        apply(&index, &store("e", part(""), 1, 0, 3, Tier::Gpu));
        apply(&index, &store("e", part("sql"), 1, 0, 3, Tier::Gpu));
        apply(&index, &remove("e", part(""), true, 1, [0, 1, 2]));
        assert!(lookup(&index, &part(""), 1, 3).is_empty());
        assert_eq!(lookup(&index, &part("sql"), 1, 3), rows(&[("e", 3)]));
    }
}

#[test]
fn lora_eviction_without_flag_narrows_to_its_partition() {
    for index in indexes() {
        apply(&index, &store("e", part(""), 1, 0, 3, Tier::Gpu));
        apply(&index, &store("e", part("sql"), 1, 0, 3, Tier::Gpu));
        apply(&index, &store("e", part("chat"), 1, 0, 3, Tier::Gpu));
        apply(&index, &remove("e", part("sql"), false, 1, [2]));
        assert_eq!(lookup(&index, &part("sql"), 1, 3), rows(&[("e", 2)]));
        assert_eq!(lookup(&index, &part(""), 1, 3), rows(&[("e", 3)]));
        assert_eq!(lookup(&index, &part("chat"), 1, 3), rows(&[("e", 3)]));
    }
}

#[test]
fn legacy_unscoped_eviction_sweeps_every_adapter_of_the_model_only() {
    for index in indexes() {
        for a in ["", "sql", "chat"] {
            apply(&index, &store("e", part(a), 1, 0, 3, Tier::Gpu));
        }
        let other_model = PartitionKey::new("acme", "mistral", "");
        apply(&index, &store("e", other_model.clone(), 1, 0, 3, Tier::Gpu));
        apply(&index, &store("f", part("sql"), 1, 0, 3, Tier::Gpu));
        apply(&index, &remove("e", part(""), false, 1, [1, 2]));
        for a in ["", "sql", "chat"] {
            let got = lookup(&index, &part(a), 1, 3);
            let e = got.iter().find(|(id, _)| id == "e").map(|r| r.1);
            assert_eq!(e, Some(1), "adapter {a:?}");
        }
        assert_eq!(
            lookup(&index, &part("sql"), 1, 3)[0],
            ("f".to_string(), 3),
            "only the event's engine is removed"
        );
        assert_eq!(
            lookup(&index, &other_model, 1, 3),
            rows(&[("e", 3)]),
            "another model is untouched"
        );
    }
}

#[test]
fn all_cleared_ignores_the_adapter_and_other_engines() {
    for index in indexes() {
        for a in ["", "sql"] {
            apply(&index, &store("e", part(a), 1, 0, 3, Tier::Gpu));
            apply(&index, &store("f", part(a), 1, 0, 2, Tier::Gpu));
        }
        let mut clear = Event::new(EventKind::AllCleared, "e", part("sql"));
        clear.adapter_scoped = true;
        apply(&index, &clear);
        for a in ["", "sql"] {
            assert_eq!(lookup(&index, &part(a), 1, 3), rows(&[("f", 2)]));
        }
        let stats = index.stats();
        assert_eq!(stats.memberships, 4);
        // `e` holds nothing any more: it is reclaimed, no longer listed.
        let engines: Vec<String> = index.engines().into_iter().map(|e| e.engine_id).collect();
        assert_eq!(engines, ["f"]);
    }
}

#[test]
fn partitions_never_match_each_other() {
    for index in indexes() {
        apply(&index, &store("base", part(""), 1, 0, 3, Tier::Gpu));
        apply(&index, &store("lora", part("x"), 1, 0, 3, Tier::Gpu));
        assert_eq!(lookup(&index, &part(""), 1, 3), rows(&[("base", 3)]));
        assert_eq!(lookup(&index, &part("x"), 1, 3), rows(&[("lora", 3)]));
        assert!(lookup(&index, &PartitionKey::new("other", "llama", ""), 1, 3).is_empty());
    }
}

#[test]
fn eviction_then_restore_returns_every_counter() {
    for index in indexes() {
        apply(&index, &store("keep", part(""), 1, 0, 2, Tier::Gpu));
        let before = (
            index.stats().block_entries,
            index.stats().memberships,
            index.stats().partitions.clone(),
        );
        apply(&index, &store("e", part(""), 1, 0, 3, Tier::Disk));
        apply(&index, &store("e", part(""), 2, 0, 2, Tier::Gpu));
        assert_eq!(index.stats().memberships, 7);
        apply(&index, &remove("e", part(""), false, 1, [0, 1, 2]));
        apply(&index, &remove("e", part(""), false, 2, [0, 1]));
        let after = index.stats();
        assert_eq!(
            (
                after.block_entries,
                after.memberships,
                after.partitions.clone()
            ),
            before
        );
        assert_eq!(lookup(&index, &part(""), 1, 3), rows(&[("keep", 2)]));
        // Re-storing after the eviction restores the match.
        apply(&index, &store("e", part(""), 1, 0, 3, Tier::Gpu));
        assert_eq!(
            lookup(&index, &part(""), 1, 3),
            rows(&[("e", 3), ("keep", 2)])
        );
    }
}

#[test]
fn hash_only_producers_match_by_block_hashes() {
    for index in indexes() {
        let mut ev = Event::new(EventKind::Stored, "ic-0", part(""));
        ev.block_hashes = vec![EngineHash(0xa11ce), EngineHash(0xb0b)];
        apply(&index, &ev);
        let q = QueryBlocks::Hashes(vec![EngineHash(0xa11ce), EngineHash(0xb0b), EngineHash(9)]);
        assert_eq!(index.lookup(&part(""), &q).1.to_vec()[0].matched_blocks, 2);
        assert!(index.lookup(&part("x"), &q).1.is_empty());
        let mut rm = Event::new(EventKind::Removed, "ic-0", part(""));
        rm.block_hashes = vec![EngineHash(0xb0b)];
        apply(&index, &rm);
        assert_eq!(index.lookup(&part(""), &q).1.to_vec()[0].matched_blocks, 1);
    }
}

#[test]
fn replica_updated_is_liveness_only_and_unknown_types_are_skipped() {
    let index = Index::new(IndexSettings { shards: 2, seed: 1 });
    let mut ev = Event::new(EventKind::ReplicaUpdated, "e", part(""));
    ev.timestamp_us = 42;
    apply(&index, &ev);
    let engines = index.engines();
    assert_eq!(
        (
            engines[0].engine_id.as_str(),
            engines[0].last_seen_us,
            engines[0].blocks
        ),
        ("e", 42, 0)
    );
    assert_eq!(index.stats().memberships, 0);
    let unknown = Event::new(EventKind::Unknown(9), "e", part(""));
    assert_eq!(index.apply(&unknown, 1), Err(SkipReason::UnknownType(9)));
}

#[test]
fn malformed_chains_are_skipped_with_reasons() {
    let index = Index::new(IndexSettings { shards: 1, seed: 1 });
    let mut ev = store("e", part(""), 1, 0, 2, Tier::Gpu);
    ev.content = BlockContent::Tokens {
        token_ids: vec![1, 2, 3],
        block_size: BS,
    };
    assert_eq!(
        index.apply(&ev, 1).map_err(|e| e.reason()),
        Err("token_count_mismatch")
    );
    ev.content = BlockContent::Tokens {
        token_ids: vec![],
        block_size: 0,
    };
    assert_eq!(
        index.apply(&ev, 1).map_err(|e| e.reason()),
        Err("zero_block_size")
    );
    assert_eq!(index.stats().memberships, 0);
}

/// One engine's hashes in one partition → (token prefix through that block, its tiers).
type EngineHashes = HashMap<EngineHash, (Vec<u32>, BTreeSet<Tier>)>;

/// A lookup row as the oracle computes it: (engine, matched blocks, fastest tier of the last
/// matched block, matched blocks on each tier).
type Row = (String, u32, Tier, [u32; 3]);

/// Independent oracle: each (partition, engine) holds a set of token prefixes (the full token
/// vector up to and including a block), and maps its engine hashes to them. No hashing.
#[derive(Default)]
struct Model {
    held: HashMap<(PartitionKey, String), EngineHashes>,
}

impl Model {
    fn apply(&mut self, ev: &Event) {
        let key = (ev.partition.clone(), ev.engine.clone());
        match ev.kind {
            EventKind::Stored => {
                let BlockContent::Tokens {
                    token_ids,
                    block_size,
                } = &ev.content
                else {
                    unreachable!()
                };
                let map = self.held.entry(key).or_default();
                let mut prefix = match ev.parent_hash {
                    None => Vec::new(),
                    Some(p) => match map.get(&p) {
                        Some(v) => v.0.clone(),
                        None => return,
                    },
                };
                for (h, chunk) in ev
                    .block_hashes
                    .iter()
                    .zip(token_ids.chunks(*block_size as usize))
                {
                    prefix.extend_from_slice(chunk);
                    let tier = ev.tier.unwrap_or(Tier::Gpu);
                    match map.get_mut(h) {
                        // The same block again: one more tier.
                        Some((held, tiers)) if *held == prefix => {
                            tiers.insert(tier);
                        }
                        // New, or the hash reused for other content: replaced.
                        _ => {
                            map.insert(*h, (prefix.clone(), BTreeSet::from([tier])));
                        }
                    }
                }
            }
            EventKind::Removed => {
                for ((p, e), map) in self.held.iter_mut() {
                    let reach = if ev.is_scoped() {
                        *p == ev.partition
                    } else {
                        p.tenant == ev.partition.tenant && p.model == ev.partition.model
                    };
                    if *e == ev.engine && reach {
                        for h in &ev.block_hashes {
                            match (ev.tier, map.get_mut(h)) {
                                (Some(t), Some((_, tiers))) => {
                                    tiers.remove(&t);
                                    if tiers.is_empty() {
                                        map.remove(h);
                                    }
                                }
                                _ => {
                                    map.remove(h);
                                }
                            }
                        }
                    }
                }
            }
            EventKind::AllCleared => {
                for ((p, e), map) in self.held.iter_mut() {
                    if *e == ev.engine
                        && p.tenant == ev.partition.tenant
                        && p.model == ev.partition.model
                    {
                        map.clear();
                    }
                }
            }
            _ => {}
        }
    }

    fn lookup(&self, p: &PartitionKey, query: &[u32]) -> Vec<Row> {
        let mut rows = Vec::new();
        for ((part, engine), map) in &self.held {
            if part != p {
                continue;
            }
            let prefixes: HashMap<&Vec<u32>, &BTreeSet<Tier>> =
                map.values().map(|(v, t)| (v, t)).collect();
            let mut on = [0u32; 3];
            let mut last = None;
            for b in 1..=query.len() / BS as usize {
                let Some(tiers) = prefixes.get(&query[..b * BS as usize].to_vec()) else {
                    break;
                };
                for t in tiers.iter() {
                    on[*t as usize] += 1;
                }
                last = Some((b as u32, *tiers.first().unwrap()));
            }
            if let Some((matched, fastest)) = last {
                rows.push((engine.clone(), matched, fastest, on));
            }
        }
        rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        rows
    }

    /// The rows ranked by the weighted score (each block worth the best weight of its
    /// tiers), then matched blocks, then engine; with each row's score.
    fn lookup_weighted(&self, p: &PartitionKey, query: &[u32], w: [f64; 3]) -> Vec<(Row, f64)> {
        let mut rows: Vec<(Row, f64)> = Vec::new();
        for ((part, engine), map) in &self.held {
            if part != p {
                continue;
            }
            let prefixes: HashMap<&Vec<u32>, &BTreeSet<Tier>> =
                map.values().map(|(v, t)| (v, t)).collect();
            let mut score = 0.0;
            for b in 1..=query.len() / BS as usize {
                let Some(tiers) = prefixes.get(&query[..b * BS as usize].to_vec()) else {
                    break;
                };
                score += tiers.iter().map(|t| w[*t as usize]).fold(0.0, f64::max);
            }
            if let Some(row) = self.lookup(p, query).into_iter().find(|r| r.0 == *engine) {
                rows.push((row, score));
            }
        }
        rows.sort_by(|a, b| {
            b.1.total_cmp(&a.1)
                .then_with(|| b.0.1.cmp(&a.0.1))
                .then_with(|| a.0.0.cmp(&b.0.0))
        });
        rows
    }
}

/// Random stores, evictions and clears over many engines (enough to exercise the dense
/// bitset path) and adapters; after every step batch, every lookup equals the oracle's.
#[test]
fn randomized_against_reference_model() {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    for shards in [1, 2] {
        let index = Index::new(IndexSettings { shards, seed: 3 });
        let mut model = Model::default();
        let mut saw_dense = false;
        let adapters = ["", "a", "b"];
        for step in 0..12000 {
            let engine = format!("e{}", next(240));
            let p = part(adapters[next(3) as usize]);
            let family = next(3) as u32;
            let ev = match next(50) {
                0..=34 => {
                    let from = next(6) as u32;
                    store(
                        &engine,
                        p,
                        family,
                        from,
                        from + 1 + next(6) as u32,
                        // Family 0 lives on GPU alone (its dense blocks take the walk's
                        // GPU-only path); the others on any tier.
                        match (family, Tier::ALL[next(3) as usize]) {
                            (0, _) => Tier::Gpu,
                            (_, tier) => tier,
                        },
                    )
                }
                35..=48 => {
                    let first = next(12) as u32;
                    let mut ev = remove(
                        &engine,
                        p,
                        next(2) == 0,
                        family,
                        first..first + 1 + next(3) as u32,
                    );
                    // Half the removals name the medium they leave.
                    ev.tier = [
                        None,
                        None,
                        None,
                        Some(Tier::Gpu),
                        Some(Tier::Cpu),
                        Some(Tier::Disk),
                    ][next(6) as usize];
                    ev
                }
                _ => Event::new(EventKind::AllCleared, engine, p),
            };
            let _ = index.apply(&ev, 1);
            model.apply(&ev);
            if step % 50 == 0 {
                saw_dense |= (0..shards).any(|s| index.shard(s).read().dense_blocks() > 0);
                for a in adapters {
                    for family in 0..4 {
                        let q = tokens(family, 12);
                        let want = model.lookup(&part(a), &q);
                        let q = QueryBlocks::Tokens {
                            token_ids: q,
                            block_size: BS,
                            extras: Vec::new(),
                        };
                        let got: Vec<Row> = index
                            .lookup(&part(a), &q)
                            .1
                            .iter()
                            .map(|m| {
                                (
                                    m.engine_id.to_string(),
                                    m.matched_blocks,
                                    m.tier,
                                    m.blocks_on,
                                )
                            })
                            .collect();
                        assert_eq!(got, want, "step {step} adapter {a:?} family {family}");
                        // Ranked by a weighted score (dyadic weights: sums are exact).
                        let w = [[1.0, 0.75, 0.5], [0.25, 1.0, 0.5]][family as usize % 2];
                        let QueryBlocks::Tokens { token_ids, .. } = &q else {
                            unreachable!()
                        };
                        let want = model.lookup_weighted(&part(a), token_ids, w);
                        let options = LookupOptions {
                            tier_weights: Some(TierWeights(w)),
                            ..LookupOptions::default()
                        };
                        let got: Vec<(Row, f64)> = index
                            .lookup_with(&part(a), &q, &options)
                            .1
                            .iter()
                            .map(|m| {
                                let row = (
                                    m.engine_id.to_string(),
                                    m.matched_blocks,
                                    m.tier,
                                    m.blocks_on,
                                );
                                (row, m.score.unwrap())
                            })
                            .collect();
                        assert_eq!(
                            got, want,
                            "weighted: step {step} adapter {a:?} family {family}"
                        );
                    }
                }
            }
        }
        assert!(
            saw_dense,
            "the run must exercise the dense-bitset lookup path"
        );
    }
}

/// `limit` cuts the full answer, exactly: the best `limit` engines in the full answer's order,
/// whatever the cut falls on (inside a group of equal matches, across shards), with the same
/// tiers per row; also over a fleet large enough for the dense bitsets, with CPU copies.
#[test]
fn a_limited_lookup_is_the_full_answer_cut_short() {
    use kvindex::sim::{Fleet, FleetSettings};
    let small = FleetSettings {
        engines: 40,
        capacity_blocks: 400,
        seed: 3,
        ..FleetSettings::default()
    };
    let offloading = FleetSettings {
        engines: 300,
        capacity_blocks: 300,
        seed: 5,
        cpu_offload: true,
        ..FleetSettings::default()
    };
    for (settings, shards, requests, wide) in [(small, 3, 600, 8), (offloading, 2, 3000, 40)] {
        let mut fleet = Fleet::new(settings.clone());
        let index = Index::new(IndexSettings { shards, seed: 1 });
        for _ in 0..requests {
            for ev in fleet.next_request() {
                let _ = index.apply(&ev, 0);
            }
        }
        let mut widest = 0;
        for _ in 0..60 {
            let (p, token_ids) = fleet.sample_query();
            let blocks = QueryBlocks::Tokens {
                token_ids,
                block_size: settings.block_size,
                extras: Vec::new(),
            };
            let full = index.lookup(&p, &blocks).1.to_vec();
            widest = widest.max(full.len());
            for limit in [1, 2, 3, 5, 8, 13, 40, 1000] {
                let cut = index.lookup_limited(&p, &blocks, limit).1.to_vec();
                assert_eq!(cut, full[..full.len().min(limit)], "limit {limit}");
            }
        }
        assert!(
            widest > wide,
            "answers too narrow to test the cut: {widest}"
        );
    }
}

#[test]
fn adapter_cleared_drops_the_engine_from_its_own_partition_only() {
    for index in indexes() {
        for a in ["", "sql", "chat"] {
            apply(&index, &store("e", part(a), 1, 0, 3, Tier::Gpu));
        }
        apply(&index, &store("f", part("sql"), 1, 0, 2, Tier::Gpu));
        apply(
            &index,
            &Event::new(EventKind::AdapterCleared, "e", part("sql")),
        );
        assert_eq!(lookup(&index, &part("sql"), 1, 3), rows(&[("f", 2)]));
        assert_eq!(lookup(&index, &part(""), 1, 3), rows(&[("e", 3)]));
        assert_eq!(lookup(&index, &part("chat"), 1, 3), rows(&[("e", 3)]));
        // The base model's own partition, by the empty adapter.
        apply(
            &index,
            &Event::new(EventKind::AdapterCleared, "e", part("")),
        );
        assert!(lookup(&index, &part(""), 1, 3).is_empty());
        assert_eq!(lookup(&index, &part("chat"), 1, 3), rows(&[("e", 3)]));
    }
}

#[test]
fn producer_seq_regressions_are_counted_per_engine() {
    for index in indexes() {
        for seq in [5, 6, 4, 7, 7, 0, 3] {
            let mut ev = store("e", part(""), 1, 0, 1, Tier::Gpu);
            ev.seq = seq;
            apply(&index, &ev);
        }
        // 4 and 3 went below 6 / 7; a repeated 7 (one seq per batch) and 0 (none) do not count.
        let e = index
            .engines()
            .into_iter()
            .find(|e| e.engine_id == "e")
            .unwrap();
        assert_eq!(e.seq_regressions, 2);
        assert_eq!(index.stats().seq_regressions, 2);
    }
}

#[test]
fn lookups_can_leave_out_engines_not_heard_from_lately() {
    for index in indexes() {
        let now = kvindex::util::now_us();
        // `a` last heard 100 s ago, `b` just now (kvindex's clock: the `now` it applied at).
        index
            .apply(&store("a", part(""), 1, 0, 3, Tier::Gpu), now - 100_000_000)
            .unwrap();
        index
            .apply(&store("b", part(""), 1, 0, 2, Tier::Gpu), now)
            .unwrap();
        let blocks = QueryBlocks::Tokens {
            token_ids: tokens(1, 3),
            block_size: BS,
            extras: Vec::new(),
        };
        let all = index.lookup(&part(""), &blocks).1.to_vec();
        assert_eq!(all.len(), 2);
        let options = LookupOptions {
            heard_since_us: Some(now - 10_000_000),
            ..LookupOptions::default()
        };
        let recent = index.lookup_with(&part(""), &blocks, &options).1.to_vec();
        let ids: Vec<&str> = recent.iter().map(|r| r.engine_id.as_ref()).collect();
        assert_eq!(ids, ["b"]);
    }
}
