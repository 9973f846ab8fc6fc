//! Hybrid models (vLLM's `group_idx` / `kv_cache_spec_kind`): only the full-attention group's
//! blocks are indexed; events of other groups are dropped (counted as `other_kv_group`), in
//! both the map and the positional forms.

use kvindex::event::{DecodeSettings, Envelope, EventKind, Format, VllmSettings, decode_payload};
use rmpv::Value;

fn s(v: &str) -> Value {
    Value::from(v)
}

fn stored_map(hash: u64, group: Option<i64>, kind: Option<&str>) -> Value {
    let mut fields = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::from(hash)])),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((0..4).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(4)),
    ];
    if let Some(g) = group {
        fields.push((s("group_idx"), Value::from(g)));
    }
    if let Some(k) = kind {
        fields.push((s("kv_cache_spec_kind"), s(k)));
    }
    Value::Map(fields)
}

#[test]
fn only_the_full_attention_group_is_indexed() {
    // Positional, vLLM's full layout: [tag, hashes, parent, tokens, block_size, lora_id,
    // medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind].
    let positional = |group: i64, kind: &str| {
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(9u64)]),
            Value::Nil,
            Value::Array((0..4).map(Value::from).collect()),
            Value::from(4),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Array(vec![Value::Nil]),
            Value::from(group),
            s(kind),
        ])
    };
    let removed_group_1 = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(9u64)]),
        s("GPU"),
        Value::from(1),
    ]);
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            stored_map(1, None, None),
            stored_map(2, Some(0), Some("full_attention")),
            stored_map(3, Some(1), Some("sliding_window")),
            stored_map(4, Some(0), Some("mamba")),
            positional(0, "mla_attention"),
            positional(2, "sliding_window"),
            removed_group_1,
        ]),
        Value::Nil,
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let opts = DecodeSettings {
        format: Format::Auto,
        vllm: VllmSettings {
            model: Some("m".into()),
            ..VllmSettings::default()
        },
        ..DecodeSettings::default()
    };
    let env = Envelope {
        engine: Some("e"),
        ..Envelope::default()
    };
    let d = decode_payload(&bytes, &env, &opts).unwrap();
    let kept: Vec<u64> = d.events.iter().map(|e| e.block_hashes[0].0).collect();
    assert_eq!(kept, [1, 2, 9], "{:?}", d.events);
    assert!(d.events.iter().all(|e| e.kind == EventKind::Stored));
    let reasons: Vec<&str> = d.skipped.iter().map(|e| e.reason()).collect();
    assert_eq!(reasons, ["other_kv_group"; 4]);
}
