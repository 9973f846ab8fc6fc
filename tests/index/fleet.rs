//! The synthetic fleet against the real index: consistent chains, shared prefixes, exact
//! membership accounting, evictions, determinism, and the three wire encodings.

use kvindex::event::{DecodeSettings, Envelope, Event, EventKind, Format, decode_payload, encode};
use kvindex::index::{Index, IndexSettings, QueryBlocks};
use kvindex::sim::{Fleet, FleetSettings};
use std::collections::BTreeMap;

fn test_config(seed: u64) -> FleetSettings {
    FleetSettings {
        engines: 8,
        adapters: 3,
        tenants: 1,
        models: 2,
        block_size: 16,
        capacity_blocks: 1024,
        seed,
        clear_every: 2000,
        reuse_hashes: false,
        cpu_offload: false,
    }
}

fn stream(cfg: FleetSettings, requests: usize) -> Vec<Event> {
    let mut fleet = Fleet::new(cfg);
    (0..requests).flat_map(|_| fleet.next_request()).collect()
}

#[test]
fn deterministic() {
    let a = stream(test_config(11), 1500);
    let b = stream(test_config(11), 1500);
    let c = stream(test_config(12), 1500);
    assert!(!a.is_empty());
    assert_eq!(a, b, "same seed, same stream");
    assert_ne!(a, c, "another seed, another stream");
}

#[test]
fn fleet_drives_the_index_consistently() {
    let mut fleet = Fleet::new(test_config(5));
    let index = Index::new(IndexSettings { shards: 2, seed: 5 });
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    let mut last_seq: BTreeMap<String, u64> = BTreeMap::new();
    let mut last_ts = 0;
    for _ in 0..20_000 {
        for ev in fleet.next_request() {
            if let Err(e) = index.apply(&ev, 0) {
                panic!("event does not apply ({e}): {ev:?}");
            }
            let seq = last_seq.entry(ev.engine.clone()).or_default();
            assert!(ev.seq > *seq, "seq increases per engine");
            *seq = ev.seq;
            assert!(ev.timestamp_us >= last_ts, "clock never goes back");
            last_ts = ev.timestamp_us;
            let kind = match ev.kind {
                EventKind::Stored => "stored",
                EventKind::Removed => {
                    if ev.partition.adapter.is_empty() {
                        if ev.adapter_scoped {
                            "removed_base_scoped"
                        } else {
                            "removed_base_unscoped"
                        }
                    } else {
                        assert!(ev.adapter_scoped, "adapter evictions are scoped");
                        "removed_adapter"
                    }
                }
                EventKind::AllCleared | EventKind::AdapterCleared => "cleared",
                EventKind::ReplicaUpdated => "heartbeat",
                EventKind::Unknown(_) => "unknown",
            };
            *kinds.entry(kind).or_default() += 1;
        }
    }
    let stats = fleet.stats();
    println!("{stats:?}\n{kinds:?}\nhit ratio {:.2}", stats.hit_ratio());
    assert_eq!(stats.requests, 20_000);
    for kind in [
        "stored",
        "removed_base_scoped",
        "removed_base_unscoped",
        "removed_adapter",
        "cleared",
        "heartbeat",
    ] {
        assert!(
            kinds.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} events: {kinds:?}"
        );
    }
    assert!(!kinds.contains_key("unknown"));

    // (d) Evictions happen, and the fleet's own accounting adds up.
    assert!(stats.blocks_removed > 1000, "{stats:?}");
    assert_eq!(
        stats.blocks_stored,
        stats.blocks_removed + stats.blocks_cleared + stats.blocks_cached,
        "every stored block is removed, cleared or still cached"
    );
    assert!(stats.hit_ratio() > 0.3, "prefix reuse: {stats:?}");

    // (c) The index holds exactly what the engines hold.
    let istats = index.stats();
    assert_eq!(istats.memberships, stats.blocks_cached);
    let engines = index.engines();
    let fleet_blocks = fleet.engine_blocks();
    assert_eq!(fleet_blocks.len(), 8);
    for (name, held) in &fleet_blocks {
        let indexed = engines
            .iter()
            .find(|e| &e.engine_id == name)
            .map_or(0, |e| e.blocks);
        assert_eq!(indexed, *held as u64, "engine {name}");
        assert!(*held <= 1024, "capacity respected");
    }
    // Partitions: 2 models × 3 adapters, single tenant "".
    let partitions: Vec<_> = istats.partitions.iter().map(|p| p.key.clone()).collect();
    assert_eq!(partitions.len(), 6, "{partitions:?}");

    // (b) Prefixes are shared: sampled queries hit, mostly with several blocks, often on
    // more than one engine.
    let (mut hits, mut multi) = (0, 0);
    let n = 500;
    for _ in 0..n {
        let (partition, token_ids) = fleet.sample_query();
        let (_, rows) = index.lookup(
            &partition,
            &QueryBlocks::Tokens {
                token_ids,
                block_size: 16,
                extras: Vec::new(),
            },
        );
        if rows.iter().next().is_some_and(|r| r.matched_blocks >= 2) {
            hits += 1;
        }
        if rows.iter().filter(|r| r.matched_blocks >= 2).count() >= 2 {
            multi += 1;
        }
    }
    println!("queries: {hits}/{n} hit ≥ 2 blocks, {multi}/{n} on ≥ 2 engines");
    assert!(hits * 10 >= n * 8, "most queries hit: {hits}/{n}");
    assert!(
        multi * 10 >= n,
        "shared prefixes live on several engines: {multi}/{n}"
    );
}

#[test]
fn encodings_round_trip() {
    let mut fleet = Fleet::new(FleetSettings {
        capacity_blocks: 256,
        clear_every: 50,
        ..test_config(9)
    });
    let mut batch = Vec::new();
    while batch.len() < 600 {
        batch.extend(fleet.next_request());
    }
    assert!(batch.iter().any(|e| e.kind == EventKind::Removed));
    assert!(batch.iter().any(|e| e.kind == EventKind::AllCleared));
    let opts = DecodeSettings::default();
    let none = Envelope::default();

    let decoded = decode_payload(&encode::to_proto(&batch), &none, &opts).expect("proto decodes");
    assert!(decoded.skipped.is_empty());
    assert_eq!(decoded.events, batch, "protobuf round trip");

    let decoded = decode_payload(&encode::to_json(&batch), &none, &opts).expect("json decodes");
    assert_eq!(decoded.events, batch, "JSON round trip");

    // vLLM: one batch per engine (payloads name neither engine nor model; the envelope does).
    // vLLM has no seq, per-event timestamp, heartbeat or base-model adapter_scoped flag:
    // compare what it carries.
    let vllm_opts = DecodeSettings {
        format: Format::Vllm,
        ..DecodeSettings::default()
    };
    for (engine, base) in fleet.engines() {
        let mine: Vec<Event> = batch
            .iter()
            .filter(|e| e.engine == engine && e.kind != EventKind::ReplicaUpdated)
            .cloned()
            .collect();
        if mine.is_empty() {
            continue;
        }
        let env = Envelope {
            engine: Some(&engine),
            model: Some(&base.model),
            tenant: Some(&base.tenant),
            dp_rank: None,
        };
        let decoded =
            decode_payload(&encode::to_vllm(&mine, 0), &env, &vllm_opts).expect("vllm decodes");
        assert!(decoded.skipped.is_empty());
        assert_eq!(decoded.events.len(), mine.len(), "engine {engine}");
        for (got, want) in decoded.events.iter().zip(&mine) {
            assert_eq!(got.kind, want.kind);
            assert_eq!(got.engine, want.engine);
            assert_eq!(got.partition, want.partition);
            assert_eq!(got.block_hashes, want.block_hashes);
            assert_eq!(got.parent_hash, want.parent_hash);
            assert_eq!(got.content, want.content);
            assert_eq!(got.tier, want.tier);
            if !want.partition.adapter.is_empty() {
                assert_eq!(got.adapter_scoped, want.adapter_scoped);
            }
        }
    }
}
