//! Block extra keys as engines publish them: vLLM's `extra_keys` in both shapes (bare values,
//! typed maps) and both event forms, SGLang's salted `metadata`, and the protobuf / JSON field
//! that carries them, each decoded into the same `BlockExtras`.

use crate::support::events::decode_vllm_batch;
use kvindex::event::{
    BlockExtras, DecodeError, DecodeSettings, Envelope, Event, EventKind, Format, MmKey,
    VllmSettings, decode_payload, encode,
};
use rmpv::Value;

fn s(v: &str) -> Value {
    Value::from(v)
}

fn decode(events: Vec<Value>) -> (Vec<Event>, Vec<DecodeError>) {
    let batch = Value::Array(vec![Value::from(1.0), Value::Array(events)]);
    let d = decode_vllm_batch(&batch, "llava").expect("payload decodes");
    (d.events, d.skipped)
}

fn stored(blocks: u64, lora: Option<&str>, extra_keys: Value) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array((1..=blocks).map(Value::from).collect()),
        ),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((0..blocks * 2).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(2)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), lora.map_or(Value::Nil, s)),
        (s("extra_keys"), extra_keys),
    ])
}

fn mm(hash: &str, offset: i64) -> MmKey {
    MmKey {
        hash: hash.into(),
        offset,
    }
}

fn expected() -> Vec<BlockExtras> {
    vec![
        BlockExtras {
            mm: vec![mm("img", 1)],
            cache_salt: "salt".into(),
            prompt_embeds: vec![vec![7, 7]],
            ..BlockExtras::default()
        },
        BlockExtras {
            mm: vec![mm("img", -1)],
            ..BlockExtras::default()
        },
    ]
}

#[test]
fn bare_and_typed_extra_keys_decode_alike_and_the_lora_name_is_the_partition() {
    let bare = Value::Array(vec![
        Value::Array(vec![
            s("ad"),
            Value::Array(vec![s("img"), Value::from(1)]),
            s("salt"),
            Value::Binary(vec![7, 7]),
        ]),
        Value::Array(vec![s("ad"), Value::Array(vec![s("img"), Value::from(-1)])]),
    ]);
    let typed_key = |kind: &str, fields: Vec<(Value, Value)>| {
        let mut all = vec![(s("type"), s(kind))];
        all.extend(fields);
        Value::Map(all)
    };
    let typed = Value::Array(vec![
        Value::Array(vec![
            typed_key("lora", vec![(s("name"), s("ad"))]),
            typed_key(
                "mm",
                vec![
                    (s("modality"), s("image")),
                    (s("hash"), s("img")),
                    (s("block_offset"), Value::from(1)),
                ],
            ),
            typed_key("cache_salt", vec![(s("salt"), s("salt"))]),
            typed_key(
                "prompt_embeds",
                vec![(s("hash"), Value::Binary(vec![7, 7]))],
            ),
        ]),
        Value::Array(vec![
            typed_key("lora", vec![(s("name"), s("ad"))]),
            typed_key(
                "mm",
                vec![
                    (s("modality"), s("image")),
                    (s("hash"), s("img")),
                    (s("block_offset"), Value::from(-1)),
                ],
            ),
        ]),
    ]);
    let (events, skipped) = decode(vec![
        stored(2, Some("ad"), bare),
        stored(2, Some("ad"), typed),
    ]);
    assert!(skipped.is_empty(), "{skipped:?}");
    for ev in &events {
        assert_eq!(ev.partition.adapter, "ad");
        assert_eq!(ev.block_extras, expected());
    }
}

#[test]
fn adapter_only_or_nil_extra_keys_leave_blocks_without_extras() {
    let lora_only = Value::Array(vec![
        Value::Array(vec![s("ad")]),
        Value::Array(vec![s("ad")]),
    ]);
    let nils = Value::Array(vec![Value::Nil, Value::Nil]);
    let (events, skipped) = decode(vec![
        stored(2, Some("ad"), lora_only),
        stored(2, None, nils),
        stored(2, None, Value::Nil),
    ]);
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|ev| ev.block_extras.is_empty()));
}

#[test]
fn the_positional_form_carries_extra_keys_after_lora_name() {
    let positional = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(1), Value::from(2)]),
        Value::Nil,
        Value::Array((0..4).map(Value::from).collect()),
        Value::from(2),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Array(vec![Value::Array(vec![s("salt")]), Value::Nil]),
        Value::from(0),
        s("full_attention"),
    ]);
    let (events, skipped) = decode(vec![positional]);
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(events[0].block_extras.len(), 2);
    assert_eq!(events[0].block_extras[0].cache_salt, "salt");
    assert!(events[0].block_extras[1].is_empty());
}

#[test]
fn unknown_shapes_still_keep_a_block_apart_and_a_wrong_count_skips_only_that_event() {
    let odd = Value::Array(vec![Value::Array(vec![Value::Map(vec![(
        s("type"),
        s("future_kind"),
    )])])]);
    let short = Value::Array(vec![Value::Nil]);
    let (events, skipped) = decode(vec![stored(1, None, odd), stored(2, None, short)]);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].block_extras.len(), 1);
    assert_eq!(events[0].block_extras[0].other.len(), 1);
    assert_ne!(events[0].block_extras[0].digest(), 0);
    assert_eq!(skipped.len(), 1);
    assert!(
        format!("{}", skipped[0]).contains("extra_keys"),
        "{}",
        skipped[0]
    );
}

#[test]
fn hostile_extra_keys_fail_cleanly() {
    // Nested far deeper than any engine writes: an error, never a stack overflow.
    let mut deep = Value::Nil;
    for _ in 0..200 {
        deep = Value::Array(vec![deep]);
    }
    let batch = Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![stored(
            1,
            None,
            Value::Array(vec![Value::Array(vec![deep])]),
        )]),
    ]);
    let got = decode_vllm_batch(&batch, "m");
    assert!(matches!(got, Err(DecodeError::TooDeep(_))), "{got:?}");
}

#[test]
fn sglang_salt_goes_on_the_first_block_of_a_root_chain() {
    let salted = |parent: Value| {
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(-5i64), Value::from(7i64)]),
            parent,
            Value::Array((0..4).map(Value::from).collect()),
            Value::from(2),
            Value::Nil,
            s("GPU"),
            Value::Map(vec![(s("cache_salt"), s("tenant-a"))]),
        ])
    };
    let (events, skipped) = decode(vec![salted(Value::Nil), salted(Value::from(3))]);
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(events[0].block_extras.len(), 2);
    assert_eq!(events[0].block_extras[0].cache_salt, "tenant-a");
    assert!(events[0].block_extras[1].is_empty());
    assert!(
        events[1].block_extras.is_empty(),
        "a chain with a parent inherits the salt through the parent's key"
    );
}

#[test]
fn protobuf_json_and_vllm_encodings_carry_extras_round_trip() {
    let (events, _) = decode(vec![stored(
        2,
        None,
        Value::Array(vec![
            Value::Array(vec![
                Value::Array(vec![s("img"), Value::from(1)]),
                s("salt"),
                Value::Binary(vec![7, 7]),
            ]),
            Value::Array(vec![Value::Array(vec![s("img"), Value::from(-1)])]),
        ]),
    )]);
    let mut ev = events[0].clone();
    ev.engine = "e".into();
    assert_eq!(ev.block_extras, expected());
    let settings = DecodeSettings {
        format: Format::Auto,
        vllm: VllmSettings {
            model: Some("llava".into()),
            ..VllmSettings::default()
        },
        ..DecodeSettings::default()
    };
    let envelope = Envelope {
        engine: Some("e"),
        ..Envelope::default()
    };
    for (name, bytes) in [
        ("proto", encode::to_proto(std::slice::from_ref(&ev))),
        ("json", encode::to_json(std::slice::from_ref(&ev))),
        ("vllm", encode::to_vllm(std::slice::from_ref(&ev), 0)),
    ] {
        let d = decode_payload(&bytes, &envelope, &settings).expect(name);
        assert!(d.skipped.is_empty(), "{name}: {:?}", d.skipped);
        assert_eq!(d.events[0].kind, EventKind::Stored);
        assert_eq!(d.events[0].block_extras, expected(), "{name}");
    }
}
