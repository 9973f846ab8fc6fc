//! Bad input through the real durable pipeline (a service on a temp dir): every malformed
//! payload, in every encoding, is rejected with a counted reason that `/v1/stats` and
//! `/metrics` show, and the next good event is still applied. Nothing panics, nothing blocks.

use crate::support::events;
use http_body_util::BodyExt;
use kvindex::api::{AppState, router};
use kvindex::config::Config;
use kvindex::event::{DecodeSettings, EngineHash, Event, EventKind, Format, PartitionKey, encode};
use kvindex::index::{Index, QueryBlocks};
use kvindex::service::Service;
use kvindex::source::Message;
use tower::ServiceExt;

const SOURCE: &str = "test";

/// A durable service of two shards on `dir`.
fn service(dir: &std::path::Path) -> Service {
    let mut c = Config {
        data_dir: dir.to_path_buf(),
        ..Config::default()
    };
    c.index.shards = 2;
    c.index.seed = 9;
    Service::open(c, None).expect("open the service")
}

/// Feeds `payload` as the next message of the source (a vLLM engine's key: `vllm-1`);
/// returns how many events it yielded.
fn ingest(service: &Service, offset: &mut i64, payload: &[u8], opts: &DecodeSettings) -> usize {
    let msg = Message {
        partition: 0,
        offset: *offset,
        engine: Some("vllm-1".into()),
        payload: payload.to_vec(),
        ..Message::default()
    };
    *offset += 1;
    service
        .pipeline
        .ingest_batch(SOURCE, &[msg], opts)
        .expect("the store takes the batch")
        .events
}

fn stored(engine: &str, first_token: u32) -> Event {
    events::stored(engine, PartitionKey::new("t", "m", ""))
        .hashes([u64::from(first_token) + 1])
        .tokens(first_token..first_token + 4, 4)
        .event()
}

fn holds(index: &Index, engine: &str, first_token: u32) -> bool {
    let q = QueryBlocks::Tokens {
        token_ids: (first_token..first_token + 4).collect(),
        block_size: 4,
        extras: Vec::new(),
    };
    index
        .lookup(&PartitionKey::new("t", "m", ""), &q)
        .1
        .iter()
        .any(|m| m.engine_id == engine)
}

#[tokio::test]
async fn malformed_payloads_are_counted_and_skipped_and_good_ones_still_apply() {
    let dir = tempfile::tempdir().unwrap();
    let service = service(dir.path());
    let (index, metrics) = (&service.index, &service.metrics);
    let mut offset = 0;
    let mut opts = DecodeSettings {
        max_payload_bytes: 64 * 1024,
        ..DecodeSettings::default()
    };
    opts.vllm.model = Some("m".into());
    opts.vllm.tenant = "t".into();

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
        assert_eq!(
            ingest(&service, &mut offset, payload, &opts),
            0,
            "{name} must not yield events"
        );
        // The next good event, in each encoding, still applies.
        let base = 1000 + 10 * round as u32;
        for payload in [
            encode::to_proto(&[stored("p", base)]),
            encode::to_json(&[stored("j", base)]),
            encode::to_vllm(&[stored("vllm-1", base)], 0),
        ] {
            assert_eq!(ingest(&service, &mut offset, &payload, &opts), 1);
        }
        service.pipeline.flush();
        for engine in ["p", "j", "vllm-1"] {
            assert!(
                holds(index, engine, base),
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
    let forced = DecodeSettings {
        format: Format::Proto,
        ..opts.clone()
    };
    assert_eq!(ingest(&service, &mut offset, &good_json, &forced), 0);

    // /v1/stats and /metrics show the reasons.
    let app = router(AppState::over(&service, None).expect("no token file to read"));
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
    let dir = tempfile::tempdir().unwrap();
    let service = service(dir.path());
    let mut orphan = stored("e", 7);
    orphan.parent_hash = Some(EngineHash(424242));
    let events = [
        Event::new(EventKind::Unknown(42), "e", PartitionKey::default()),
        orphan,
        stored("e", 50),
    ];
    let opts = DecodeSettings::default();
    assert_eq!(
        ingest(&service, &mut 0, &encode::to_proto(&events), &opts),
        2,
        "the unknown type is skipped at routing; the orphan reaches its shard"
    );
    service.pipeline.flush();
    let skipped = service.metrics.skipped();
    assert_eq!(skipped.get("unknown_type"), Some(&1));
    assert_eq!(skipped.get("unknown_parent"), Some(&1));
    assert!(holds(&service.index, "e", 50));
    assert_eq!(service.metrics.applied().get("stored"), Some(&1));
}
