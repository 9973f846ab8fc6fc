//! SGLang's msgpack as its `kv_events.py` writes it: the batch's third element is the
//! attention-DP rank, salted stores are `BlockStoredWithMetadata` (tag `BlockStored`, a
//! `metadata` map after `medium`), hashes are signed, media include `CPU_PINNED` and
//! `EXTERNAL`.

use kvindex::event::{
    BlockContent, DecodeSettings, EngineHash, Envelope, EventKind, Format, Tier, VllmSettings,
    decode_payload,
};
use rmpv::Value;

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn settings() -> DecodeSettings {
    DecodeSettings {
        format: Format::Auto,
        vllm: VllmSettings {
            model: Some("qwen".into()),
            ..VllmSettings::default()
        },
        ..DecodeSettings::default()
    }
}

fn env(dp_rank: Option<u32>) -> Envelope<'static> {
    Envelope {
        engine: Some("sg"),
        dp_rank,
        ..Envelope::default()
    }
}

#[test]
fn positional_and_map_salted_stores_with_attention_dp_rank_and_sglang_media() {
    let tokens: Vec<Value> = (0..4).map(Value::from).collect();
    let salted_positional = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(-5i64), Value::from(7i64)]),
        Value::Nil,
        Value::Array(tokens.clone()),
        Value::from(2),
        Value::Nil,
        s("CPU_PINNED"),
        Value::Map(vec![(s("cache_salt"), s("tenant-a"))]),
    ]);
    let salted_map = Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::from(9i64)])),
        (s("parent_block_hash"), Value::from(7i64)),
        (s("token_ids"), Value::Array(tokens[..2].to_vec())),
        (s("block_size"), Value::from(2)),
        (s("medium"), s("EXTERNAL")),
        (s("metadata"), Value::Map(vec![(s("cache_salt"), s("x"))])),
        (s("session_id"), s("abc")),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(-5i64)]),
        s("GPU"),
    ]);
    let batch = Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![salted_positional, salted_map, removed]),
        Value::from(3),
    ]);
    let decoded = decode_payload(&encode(&batch), &env(None), &settings()).unwrap();
    assert!(decoded.skipped.is_empty(), "{:?}", decoded.skipped);
    let events = decoded.events;
    assert_eq!(events.len(), 3);
    assert!(
        events.iter().all(|e| e.engine == "sg#dp3"),
        "attn_dp_rank names the rank"
    );
    assert_eq!(events[0].kind, EventKind::Stored);
    assert_eq!(events[0].tier, Some(Tier::Cpu));
    assert_eq!(
        events[0].partition.adapter, "",
        "the metadata map is not a LoRA name"
    );
    assert_eq!(
        events[0].block_hashes,
        vec![EngineHash::from_i64(-5), EngineHash(7)]
    );
    assert_eq!(
        events[0].content,
        BlockContent::Tokens {
            token_ids: vec![0, 1, 2, 3],
            block_size: 2
        }
    );
    assert_eq!(events[1].tier, Some(Tier::Disk));
    assert_eq!(events[1].parent_hash, Some(EngineHash(7)));
    assert_eq!(events[2].kind, EventKind::Removed);
}

#[test]
fn a_batch_without_a_rank_takes_the_envelopes() {
    // vLLM 0.9 / early SGLang: `[ts, events]`; the bridge says which rank's socket it came
    // from in the `dp_rank` header.
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
    ]);
    let bytes = encode(&batch);
    let on_rank_2 = decode_payload(&bytes, &env(Some(2)), &settings()).unwrap();
    assert_eq!(on_rank_2.events[0].engine, "sg#dp2");
    let unlabelled = decode_payload(&bytes, &env(None), &settings()).unwrap();
    assert_eq!(unlabelled.events[0].engine, "sg");
    // A rank in the batch wins over the header.
    let ranked = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
        Value::from(1),
    ]);
    let d = decode_payload(&encode(&ranked), &env(Some(2)), &settings()).unwrap();
    assert_eq!(d.events[0].engine, "sg#dp1");
}
