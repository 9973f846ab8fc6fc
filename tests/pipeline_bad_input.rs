//! Bad input through the real pipeline: every malformed payload, in every encoding, is rejected
//! with a counted reason that `/v1/stats` and `/metrics` show, and the next good event is still
//! applied. Nothing panics, nothing blocks.

use http_body_util::BodyExt;
use kvindex::api::{AppState, router};
use kvindex::event::{
    BlockContent, DecodeOptions, EngineHash, Envelope, Event, EventKind, Format, PartitionKey,
    encode,
};
use kvindex::index::{Index, IndexConfig, QueryBlocks};
use kvindex::metrics::Metrics;
use kvindex::pipeline::{Pipeline, Position};
use std::sync::Arc;
use tower::ServiceExt;

fn stored(engine: &str, first_token: u32) -> Event {
    let mut ev = Event::new(EventKind::Stored, engine, PartitionKey::new("t", "m", ""));
    ev.block_hashes = vec![EngineHash(first_token as u64 + 1)];
    ev.content = BlockContent::Tokens {
        token_ids: (first_token..first_token + 4).collect(),
        block_size: 4,
    };
    ev
}

fn holds(index: &Index, engine: &str, first_token: u32) -> bool {
    let q = QueryBlocks::Tokens {
        token_ids: (first_token..first_token + 4).collect(),
        block_size: 4,
    };
    index
        .lookup(&PartitionKey::new("t", "m", ""), &q)
        .1
        .iter()
        .any(|m| m.engine_id == engine)
}

#[tokio::test]
async fn malformed_payloads_are_counted_and_skipped_and_good_ones_still_apply() {
    let index = Arc::new(Index::new(IndexConfig { shards: 2, seed: 9 }));
    let metrics = Arc::new(Metrics::new());
    let pipeline = Pipeline::start(index.clone(), metrics.clone());
    let mut opts = DecodeOptions {
        max_payload_bytes: 64 * 1024,
        ..DecodeOptions::default()
    };
    opts.vllm.model = Some("m".into());
    opts.vllm.tenant = "t".into();
    let env = Envelope {
        engine: Some("vllm-1"),
        ..Envelope::default()
    };

    let good_proto = encode::to_proto(&[stored("p", 100)]);
    let good_json = encode::to_json(&[stored("j", 200)]);
    let good_vllm = encode::to_vllm(&[stored("vllm-1", 300)], 0);
    let deep_json = "[".repeat(60_000).into_bytes();
    let deep_msgpack = vec![0x91u8; 60_000];
    let bad: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        (
            "truncated proto",
            good_proto[..good_proto.len() - 3].to_vec(),
        ),
        ("garbage", vec![0xff, 0x00, 0x13, 0x37, 0xfe]),
        (
            "json wrong type",
            br#"{"type": "PREFIX_ADDED", "replica_id": 5}"#.to_vec(),
        ),
        ("json truncated", good_json[..good_json.len() / 2].to_vec()),
        ("json nested", deep_json),
        ("msgpack nested", deep_msgpack),
        (
            "msgpack truncated",
            good_vllm[..good_vllm.len() - 4].to_vec(),
        ),
        ("oversized", vec![b' '; 64 * 1024 + 1]),
    ];
    for (round, (name, payload)) in bad.iter().enumerate() {
        let pos = Position {
            source: "test",
            partition: 0,
            offset: round as i64,
        };
        assert_eq!(
            pipeline.ingest(payload, &env, &opts, &pos),
            0,
            "{name} must not yield events"
        );
        // The next good event, in each encoding, still applies.
        let base = 1000 + 10 * round as u32;
        let pos = Position {
            offset: round as i64 + 1,
            ..pos
        };
        assert_eq!(
            pipeline.ingest(&encode::to_proto(&[stored("p", base)]), &env, &opts, &pos),
            1
        );
        assert_eq!(
            pipeline.ingest(&encode::to_json(&[stored("j", base)]), &env, &opts, &pos),
            1
        );
        assert_eq!(
            pipeline.ingest(
                &encode::to_vllm(&[stored("vllm-1", base)], 0),
                &env,
                &opts,
                &pos
            ),
            1
        );
        pipeline.flush();
        for engine in ["p", "j", "vllm-1"] {
            assert!(
                holds(&index, engine, base),
                "{engine} event after {name} was applied"
            );
        }
    }

    // Each rejection is counted by reason.
    let malformed = metrics.malformed();
    let total: u64 = malformed.values().sum();
    assert_eq!(total, bad.len() as u64, "{malformed:?}");
    for reason in ["empty", "too_large"] {
        assert!(
            malformed.contains_key(reason),
            "{reason} missing from {malformed:?}"
        );
    }

    // Forcing a format rejects the other encodings with that format's error.
    let forced = DecodeOptions {
        format: Format::Proto,
        ..opts.clone()
    };
    let pos = Position::default();
    assert_eq!(pipeline.ingest(&good_json, &env, &forced, &pos), 0);

    // /v1/stats and /metrics show the reasons.
    let app = router(AppState::new(index.clone(), metrics.clone()));
    let res = app
        .clone()
        .oneshot(
            axum::http::Request::get("/v1/stats")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let stats: serde_json::Value =
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let by_reason = &stats["events"]["malformed"];
    assert_eq!(by_reason["too_large"], 1, "{stats}");
    let res = app
        .oneshot(
            axum::http::Request::get("/metrics")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let text =
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(
        text.contains("kvindex_events_malformed_total{reason=\"too_large\"} 1"),
        "{text}"
    );
}

#[test]
fn unknown_types_and_unappliable_chains_are_skipped_by_reason() {
    let index = Arc::new(Index::new(IndexConfig { shards: 2, seed: 9 }));
    let metrics = Arc::new(Metrics::new());
    let pipeline = Pipeline::start(index.clone(), metrics.clone());
    let mut orphan = stored("e", 7);
    orphan.parent_hash = Some(EngineHash(424242));
    pipeline.submit(vec![
        Event::new(EventKind::Unknown(42), "e", PartitionKey::default()),
        orphan,
        stored("e", 50),
    ]);
    pipeline.flush();
    let skipped = metrics.skipped();
    assert_eq!(skipped.get("unknown_type"), Some(&1));
    assert_eq!(skipped.get("unknown_parent"), Some(&1));
    assert!(holds(&index, "e", 50));
    assert_eq!(metrics.applied().get("stored"), Some(&1));
}
