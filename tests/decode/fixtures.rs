//! Decodes every real producer fixture in `tests/fixtures` (vLLM msgpack, inference-cache
//! protobuf + JSON twins) and checks it field by field against the `.json` describing it; also
//! the vLLM LoRA/medium/dp-rank rules, auto-detection, the JSON schema (fixtures and encoder
//! output must validate; wrong documents must not) and encode → decode round trips.

use kvindex::event::decode::{self, DecodeSettings, Decoded, Format};
use kvindex::event::{
    BlockContent, DecodeError, EngineHash, Envelope, Event, EventKind, PartitionKey, Tier,
    VllmSettings, decode_payload, encode, engine_id,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
const SCHEMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/schemas/cache_event.schema.json"
);
const ENGINE: &str = "engine-a";
const MODEL: &str = "llama-3-8b";
const TENANT: &str = "acme";
/// Every fixture's batch `ts` is 1767225600.25 s.
const FIXTURE_TS_US: i64 = 1_767_225_600_250_000;

fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let dir = Path::new(FIXTURES).join(dir);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no .{ext} fixtures in {}", dir.display());
    out
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&read(p)).unwrap_or_else(|e| panic!("parse {}: {e}", p.display()))
}

fn opts(format: Format, lora_names: &[(i64, &str)]) -> DecodeSettings {
    DecodeSettings {
        format,
        vllm: VllmSettings {
            model: Some(MODEL.into()),
            tenant: TENANT.into(),
            lora_names: lora_names
                .iter()
                .map(|(k, v)| (*k, v.to_string()))
                .collect(),
        },
        ..DecodeSettings::default()
    }
}

fn env() -> Envelope<'static> {
    Envelope {
        engine: Some(ENGINE),
        ..Envelope::default()
    }
}

fn decode(bytes: &[u8], format: Format, lora_names: &[(i64, &str)]) -> Decoded {
    decode_payload(bytes, &env(), &opts(format, lora_names))
        .unwrap_or_else(|e| panic!("decode as {format}: {e}"))
}

/// A fixture hash: an integer, or hex of the raw bytes.
fn hash_of(v: &Value) -> EngineHash {
    match v {
        Value::Number(n) => EngineHash(n.as_u64().expect("u64 hash")),
        Value::String(s) => EngineHash::from_bytes(&hex::decode(s).expect("hex hash")),
        other => panic!("bad hash {other}"),
    }
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_default()
}

// ---------------------------------------------------------------- inference-cache

/// The Event an inference-cache fixture `.json` describes (built independently of the decoder).
fn expected_ic(doc: &Value) -> Event {
    let kind = match str_of(doc, "type") {
        "PREFIX_ADDED" => EventKind::Stored,
        "PREFIX_EVICTED" => EventKind::Removed,
        "REPLICA_UPDATED" => EventKind::ReplicaUpdated,
        "ALL_CLEARED" => EventKind::AllCleared,
        other => panic!("fixture type {other}"),
    };
    let mut ev = Event::new(
        kind,
        str_of(doc, "replica_id"),
        PartitionKey::new(
            str_of(doc, "tenant_id"),
            str_of(doc, "model_id"),
            str_of(doc, "adapter_id"),
        ),
    );
    ev.adapter_scoped = doc["adapter_scoped"].as_bool().unwrap_or(false);
    ev.timestamp_us = doc["timestamp_us"].as_i64().unwrap_or(0);
    let prefix = str_of(doc, "prefix_hash");
    if !prefix.is_empty() {
        ev.block_hashes = vec![EngineHash::from_bytes(&hex::decode(prefix).unwrap())];
    }
    ev
}

#[test]
fn inference_cache_fixtures_decode_field_by_field() {
    for json_path in files("inference-cache", "json") {
        let pb_path = json_path.with_extension("pb");
        let name = json_path.display().to_string();
        let want = expected_ic(&read_json(&json_path));
        let pb = read(&pb_path);
        let js = read(&json_path);

        assert_eq!(decode::detect(&pb), Format::Proto, "{name}");
        assert_eq!(decode::detect(&js), Format::Json, "{name}");
        for (bytes, format) in [
            (&pb, Format::Auto),
            (&pb, Format::Proto),
            (&js, Format::Auto),
            (&js, Format::Json),
        ] {
            let got = decode(bytes, format, &[]);
            assert!(got.skipped.is_empty(), "{name} {format}");
            assert_eq!(got.events, vec![want.clone()], "{name} as {format}");
        }
    }
}

#[test]
fn inference_cache_eviction_scope_cases() {
    let ev = |file: &str| {
        let p = Path::new(FIXTURES).join("inference-cache").join(file);
        decode(&read(&p), Format::Auto, &[]).events.remove(0)
    };
    let legacy = ev("cache-event-evicted-legacy-sweep.pb");
    assert!(!legacy.is_scoped() && legacy.is_adapter_agnostic());
    let base = ev("cache-event-evicted-base-scoped.pb");
    assert!(base.is_scoped() && base.partition.adapter.is_empty());
    let lora = ev("cache-event-evicted-lora-unflagged.pb");
    assert!(!lora.adapter_scoped && lora.is_scoped());
    assert_eq!(lora.block_hashes, vec![EngineHash(0xa11ce)]);
    let cleared = ev("cache-event-all-cleared.pb");
    assert_eq!(cleared.kind, EventKind::AllCleared);
    assert!(cleared.block_hashes.is_empty() && cleared.is_adapter_agnostic());
}

// ---------------------------------------------------------------- vLLM

/// The events a vLLM fixture `.json` describes, with `lora_names` applied; unmapped lora ids
/// come back as the expected `skipped` reasons.
fn expected_vllm(doc: &Value, lora_names: &HashMap<i64, String>) -> (Vec<Event>, Vec<DecodeError>) {
    let dp = doc["data_parallel_rank"].as_u64().unwrap_or(0) as u32;
    let engine = engine_id(ENGINE, dp);
    let mut events = Vec::new();
    let mut skipped = Vec::new();
    for e in doc["events"].as_array().expect("events") {
        let adapter = match (e["lora_name"].as_str(), e["lora_id"].as_i64()) {
            (Some(name), _) => name.to_string(),
            (None, Some(id)) => match lora_names.get(&id) {
                Some(name) => name.clone(),
                None => {
                    skipped.push(DecodeError::UnmappedLora(id));
                    continue;
                }
            },
            (None, None) => String::new(),
        };
        let tier = match e["medium"].as_str() {
            None => None,
            Some("GPU") => Some(Tier::Gpu),
            Some("CPU") => Some(Tier::Cpu),
            Some("STORAGE") | Some("DISK") => Some(Tier::Disk),
            Some(other) => panic!("medium {other}"),
        };
        let hashes: Vec<EngineHash> = e["block_hashes"]
            .as_array()
            .map(|a| a.iter().map(hash_of).collect())
            .unwrap_or_default();
        let mut ev = match str_of(e, "type") {
            "BlockStored" => {
                let mut ev = Event::new(
                    EventKind::Stored,
                    &engine,
                    PartitionKey::new(TENANT, MODEL, adapter),
                );
                ev.parent_hash = match &e["parent_block_hash"] {
                    Value::Null => None,
                    v => Some(hash_of(v)),
                };
                let tokens: Vec<u32> = e["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                ev.content = if tokens.is_empty() {
                    BlockContent::HashesOnly
                } else {
                    BlockContent::Tokens {
                        token_ids: tokens,
                        block_size: e["block_size"].as_u64().unwrap() as u32,
                    }
                };
                ev.tier = tier;
                ev
            }
            "BlockRemoved" => {
                let mut ev = Event::new(
                    EventKind::Removed,
                    &engine,
                    PartitionKey::new(TENANT, MODEL, adapter.clone()),
                );
                ev.adapter_scoped = !adapter.is_empty();
                ev.tier = tier;
                ev
            }
            "AllBlocksCleared" => Event::new(
                EventKind::AllCleared,
                &engine,
                PartitionKey::new(TENANT, MODEL, ""),
            ),
            other => panic!("vllm type {other}"),
        };
        ev.block_hashes = hashes;
        ev.timestamp_us = FIXTURE_TS_US;
        events.push(ev);
    }
    (events, skipped)
}

#[test]
fn vllm_fixtures_decode_field_by_field() {
    for table in [&[][..], &[(3, "sql-lora")][..]] {
        let names: HashMap<i64, String> = table.iter().map(|(k, v)| (*k, v.to_string())).collect();
        for mp in files("vllm", "msgpack") {
            let name = mp.display().to_string();
            let bytes = read(&mp);
            assert_eq!(decode::detect(&bytes), Format::Vllm, "{name}");
            let (want, want_skipped) =
                expected_vllm(&read_json(&mp.with_extension("json")), &names);
            for format in [Format::Auto, Format::Vllm] {
                let got = decode(&bytes, format, table);
                assert_eq!(got.events, want, "{name} as {format} with {table:?}");
                assert_eq!(got.skipped, want_skipped, "{name} as {format}");
            }
        }
    }
}

fn vllm_fixture(name: &str) -> Vec<u8> {
    read(&Path::new(FIXTURES).join("vllm").join(name))
}

#[test]
fn vllm_lora_id_table_fails_closed() {
    let bytes = vllm_fixture("vllm-0.11.0-lora-id-bytes-hashes.msgpack");
    let unmapped = decode(&bytes, Format::Vllm, &[(7, "other")]);
    assert!(unmapped.events.is_empty());
    assert_eq!(unmapped.skipped, vec![DecodeError::UnmappedLora(3)]);
    assert_eq!(unmapped.skipped[0].reason(), "unmapped_lora");

    let mapped = decode(&bytes, Format::Vllm, &[(3, "sql-lora")]);
    assert!(mapped.skipped.is_empty());
    let ev = &mapped.events[0];
    assert_eq!(ev.partition, PartitionKey::new(TENANT, MODEL, "sql-lora"));
    assert_eq!(ev.tier, Some(Tier::Cpu));
    assert_eq!(ev.engine, "engine-a#dp1");
    // 32-byte hashes are folded with xxh3.
    let raw =
        hex::decode("66160227173714726c1672297608d9425d111a9d5e6c9992b5fb12e0d9090b89").unwrap();
    assert_eq!(ev.block_hashes[0], EngineHash::from_bytes(&raw));
}

#[test]
fn vllm_lora_name_wins_storage_is_disk_extra_fields_ignored() {
    let bytes = vllm_fixture("vllm-0.34.0-lora-name-extra-fields.msgpack");
    let got = decode(&bytes, Format::Auto, &[(3, "not-this-one")]);
    assert!(got.skipped.is_empty());
    assert_eq!(got.events.len(), 1);
    let ev = &got.events[0];
    assert_eq!(ev.partition.adapter, "sql-lora");
    assert_eq!(ev.tier, Some(Tier::Disk));
    assert_eq!(ev.engine, "engine-a#dp1");
    assert_eq!(
        ev.block_hashes,
        vec![
            EngineHash(16168106435925852760),
            EngineHash(12986056638402218427)
        ]
    );
}

#[test]
fn vllm_versions_agree_and_dp_rank_suffixes_engine() {
    for kind in ["chain", "remove-clear"] {
        let decoded: Vec<Vec<Event>> = ["0.9.0", "0.11.0", "0.34.0"]
            .iter()
            .map(|v| {
                decode(
                    &vllm_fixture(&format!("vllm-{v}-{kind}.msgpack")),
                    Format::Auto,
                    &[],
                )
                .events
            })
            .collect();
        // 0.9.0 names no medium: its stores land on GPU (the only tier it had) and its
        // removals drop every tier, which for a GPU-only engine is what the later versions'
        // removals naming GPU do. Otherwise all three versions decode alike.
        assert!(decoded[0].iter().all(|e| e.tier.is_none()), "{kind}");
        let named = |e: &&Event| e.kind != EventKind::AllCleared;
        assert!(
            decoded[1]
                .iter()
                .filter(named)
                .all(|e| e.tier == Some(Tier::Gpu)),
            "{kind}"
        );
        let without_medium = |events: &[Event]| -> Vec<Event> {
            events
                .iter()
                .map(|e| Event {
                    tier: None,
                    ..e.clone()
                })
                .collect()
        };
        assert_eq!(decoded[0], without_medium(&decoded[1]), "{kind}");
        assert_eq!(decoded[1], decoded[2], "{kind}");
        assert!(decoded[0].iter().all(|e| e.engine == ENGINE));
    }
    let chain = decode(
        &vllm_fixture("vllm-0.34.0-chain.msgpack"),
        Format::Auto,
        &[],
    )
    .events;
    assert_eq!(chain[1].parent_hash, Some(chain[0].block_hashes[1]));
    assert!(chain[0].block_hashes[1].0 > 1 << 63);
}

#[test]
fn vllm_context_from_envelope_or_options() {
    let bytes = vllm_fixture("vllm-0.34.0-remove-clear.msgpack");
    let envelope = Envelope {
        engine: Some("e9"),
        model: Some("qwen"),
        tenant: Some("t2"),
        dp_rank: None,
    };
    let got = decode_payload(&bytes, &envelope, &opts(Format::Auto, &[])).unwrap();
    assert!(
        got.events
            .iter()
            .all(|e| e.engine == "e9" && e.partition == PartitionKey::new("t2", "qwen", ""))
    );
    assert_eq!(got.events[1].kind, EventKind::AllCleared);

    let no_engine = decode_payload(&bytes, &Envelope::default(), &opts(Format::Auto, &[]));
    assert_eq!(no_engine, Err(DecodeError::MissingEngine));
    let mut no_model = opts(Format::Vllm, &[]);
    no_model.vllm.model = None;
    assert_eq!(
        decode_payload(&bytes, &env(), &no_model),
        Err(DecodeError::MissingModel)
    );
}

// ---------------------------------------------------------------- schema

fn schema() -> jsonschema::Validator {
    let schema: Value = serde_json::from_slice(&read(Path::new(SCHEMA))).expect("schema JSON");
    jsonschema::draft202012::new(&schema).expect("valid 2020-12 schema")
}

fn assert_valid(v: &jsonschema::Validator, doc: &Value, what: &str) {
    if let Err(e) = v.validate(doc) {
        panic!("{what} does not match the schema: {e}\n{doc}");
    }
}

#[test]
fn schema_accepts_fixtures_and_encoder_output() {
    let v = schema();
    for p in files("inference-cache", "json") {
        assert_valid(&v, &read_json(&p), &p.display().to_string());
    }
    let events = sample_events();
    for ev in &events {
        let doc: Value =
            serde_json::from_slice(&encode::to_json(std::slice::from_ref(ev))).unwrap();
        assert_valid(&v, &doc, "to_json(one event)");
    }
    let doc: Value = serde_json::from_slice(&encode::to_json(&events)).unwrap();
    assert!(doc.is_array());
    assert_valid(&v, &doc, "to_json(all events)");
    assert_valid(
        &v,
        &json!({"type": "PREFIX_ADDED", "replica_id": "r", "model_id": "m", "block_hashes": [1, "00ff"], "future_field": {"x": 1}}),
        "int and hex hashes",
    );
}

#[test]
fn schema_rejects_wrong_documents() {
    let v = schema();
    let bad = [
        json!({"type": "PREFIX_EXPLODED", "replica_id": "r"}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "block_hashes": "00ff"}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "block_hashes": [true]}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "block_hashes": [-1]}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "block_hashes": ["0g"]}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "block_hashes": [""]}),
        json!({"type": "PREFIX_ADDED", "replica_id": ""}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "token_ids": [1], "block_size": 0}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "tier": "NVME"}),
        json!({"type": "PREFIX_ADDED", "replica_id": "r", "dp_rank": 4294967296u64}),
        json!({"replica_id": "r"}),
        json!([1, 2]),
        json!("PREFIX_ADDED"),
    ];
    for doc in bad {
        assert!(!v.is_valid(&doc), "schema accepted {doc}");
    }
}

// ---------------------------------------------------------------- round trips

fn tokens(blocks: usize, block_size: u32) -> BlockContent {
    BlockContent::Tokens {
        token_ids: (0..blocks as u32 * block_size).map(|i| i * 7 + 1).collect(),
        block_size,
    }
}

/// Events protobuf and JSON can express exactly.
fn sample_events() -> Vec<Event> {
    let mut stored = Event::new(
        EventKind::Stored,
        engine_id("r1", 2),
        PartitionKey::new("acme", MODEL, "sql-lora"),
    );
    stored.block_hashes = vec![EngineHash(1), EngineHash(u64::MAX), EngineHash(0xdead_beef)];
    stored.parent_hash = Some(EngineHash(42));
    stored.content = tokens(3, 4);
    stored.tier = Some(Tier::Cpu);
    stored.timestamp_us = 1_767_225_600_123_456;
    stored.seq = 99;

    let mut hash_only = Event::new(EventKind::Stored, "r2", PartitionKey::new("", MODEL, ""));
    hash_only.block_hashes = vec![EngineHash(7)];
    hash_only.tier = Some(Tier::Disk);

    let mut removed = Event::new(
        EventKind::Removed,
        "r1",
        PartitionKey::new("acme", MODEL, ""),
    );
    removed.adapter_scoped = true;
    removed.block_hashes = vec![EngineHash(3), EngineHash(4)];
    removed.seq = 100;

    let cleared = Event::new(
        EventKind::AllCleared,
        "r1#dp1x",
        PartitionKey::new("acme", MODEL, "l"),
    );
    let alive = Event::new(EventKind::ReplicaUpdated, "r3", PartitionKey::default());
    vec![stored, hash_only, removed, cleared, alive]
}

#[test]
fn proto_and_json_round_trip() {
    let events = sample_events();
    for ev in &events {
        let one = std::slice::from_ref(ev);
        assert_eq!(
            decode(&encode::to_proto(one), Format::Auto, &[]).events,
            one,
            "proto"
        );
        assert_eq!(
            decode(&encode::to_json(one), Format::Auto, &[]).events,
            one,
            "json"
        );
    }
    let batch = encode::to_proto(&events);
    assert_eq!(batch.first(), Some(&0x0a));
    assert_eq!(decode(&batch, Format::Auto, &[]).events, events);
    assert_eq!(
        decode(&encode::to_json(&events), Format::Auto, &[]).events,
        events
    );

    // Unknown kinds keep their value in protobuf.
    let unknown = [Event::new(
        EventKind::Unknown(9),
        "r",
        PartitionKey::default(),
    )];
    assert_eq!(
        decode(&encode::to_proto(&unknown), Format::Proto, &[]).events,
        unknown
    );
}

#[test]
fn digests_are_encoded_as_hashes_only() {
    let mut ev = sample_events().remove(0);
    ev.content = BlockContent::Digests(vec![1, 2, 3]);
    let mut want = ev.clone();
    want.content = BlockContent::HashesOnly;
    let one = std::slice::from_ref(&ev);
    assert_eq!(
        decode(&encode::to_proto(one), Format::Auto, &[]).events,
        [want.clone()]
    );
    assert_eq!(
        decode(&encode::to_json(one), Format::Auto, &[]).events,
        [want.clone()]
    );
}

#[test]
fn vllm_round_trip() {
    // What a vLLM batch can express: engine / model / tenant come from context, one ts.
    let engine = engine_id(ENGINE, 3);
    let ts = 1_767_225_600_123_456;
    let mut stored = Event::new(
        EventKind::Stored,
        &engine,
        PartitionKey::new(TENANT, MODEL, "sql-lora"),
    );
    stored.block_hashes = vec![EngineHash(u64::MAX), EngineHash(5)];
    stored.parent_hash = Some(EngineHash(1 << 63));
    stored.content = tokens(2, 16);
    stored.tier = Some(Tier::Disk);
    let mut removed = Event::new(
        EventKind::Removed,
        &engine,
        PartitionKey::new(TENANT, MODEL, ""),
    );
    removed.block_hashes = vec![EngineHash(5)];
    removed.tier = Some(Tier::Cpu);
    let mut scoped = Event::new(
        EventKind::Removed,
        &engine,
        PartitionKey::new(TENANT, MODEL, "x"),
    );
    scoped.adapter_scoped = true;
    scoped.block_hashes = vec![EngineHash(9)];
    let cleared = Event::new(
        EventKind::AllCleared,
        &engine,
        PartitionKey::new(TENANT, MODEL, ""),
    );
    let mut events = vec![stored, removed, scoped, cleared];
    for ev in &mut events {
        ev.timestamp_us = ts;
    }
    let bytes = encode::to_vllm(&events, 3);
    assert_eq!(decode::detect(&bytes), Format::Vllm);
    assert_eq!(decode(&bytes, Format::Auto, &[]).events, events);

    // Every fixture survives decode → to_vllm → decode (named form).
    for mp in files("vllm", "msgpack") {
        let dp = read_json(&mp.with_extension("json"))["data_parallel_rank"]
            .as_u64()
            .unwrap_or(0);
        let first = decode(&read(&mp), Format::Vllm, &[(3, "sql-lora")]).events;
        let again = decode(&encode::to_vllm(&first, dp as u32), Format::Vllm, &[]).events;
        assert_eq!(again, first, "{}", mp.display());
    }
}

#[test]
fn format_names() {
    assert_eq!("vllm".parse::<Format>(), Ok(Format::Vllm));
    assert_eq!("JSON".parse::<Format>(), Ok(Format::Json));
    assert!("yaml".parse::<Format>().is_err());
    assert_eq!(Format::default(), Format::Auto);
    let f: Format = serde_json::from_str("\"proto\"").unwrap();
    assert_eq!(f, Format::Proto);
    assert_eq!(DecodeSettings::default().max_payload_bytes, 4 << 20);
}

#[test]
fn newline_led_payloads_json_or_protobuf_batch() {
    // A CacheEventBatch whose first event is 91 ('[') or 123 ('{') bytes long starts
    // "\n[" / "\n{", exactly like JSON after a newline: both must decode.
    for target in [0x5b_usize, 0x7b] {
        let mut ev = Event::new(EventKind::Stored, "r", PartitionKey::new("t", MODEL, ""));
        ev.block_hashes = vec![EngineHash(1)];
        let len = |ev: &Event| encode::to_proto(std::slice::from_ref(ev)).len();
        ev.engine = "r".repeat(target - len(&ev) + 1);
        assert_eq!(len(&ev), target);
        let events = vec![ev.clone(), ev];
        let bytes = encode::to_proto(&events);
        assert_eq!(&bytes[..2], &[0x0a, target as u8]);
        assert_eq!(decode(&bytes, Format::Auto, &[]).events, events);
    }
    let json = b"\n\n  {\"type\":\"ALL_CLEARED\",\"replica_id\":\"r\",\"model_id\":\"m\"}\n";
    assert_eq!(decode(json, Format::Auto, &[]).events.len(), 1);
    let bad_json = b"\n{\"type\":\"ALL_CLEARED\",\"replica_id\":\"r\"";
    let e = decode_payload(bad_json, &env(), &opts(Format::Auto, &[])).unwrap_err();
    assert_eq!(e.reason(), "json", "{e}");
}
