//! Protobuf bodies (`CacheEvent` or `CacheEventBatch`). Beyond "no panic":
//! - the hand-written fast path answers exactly what prost answers, wherever it answers;
//! - the skipping decoder agrees with the strict one on every body the strict one accepts;
//! - what decodes re-encodes to the same events (decode → encode → decode is the identity).
#![no_main]

use kvindex_wire::event::{DecodeSettings, Envelope, decode_payload, encode, proto};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reference = proto::decode_prost(data);
    if let Some(fast) = proto::decode_fast(data) {
        assert_eq!(
            Ok(&fast),
            reference.as_ref(),
            "the fast path disagrees with prost"
        );
    }
    let strict = proto::decode(data);
    assert_eq!(strict, reference, "decode disagrees with prost");
    if let Ok(events) = &strict {
        let skipping = proto::decode_skipping(data).expect("a body decode accepts");
        assert_eq!(
            &skipping.0, events,
            "the skipping decoder lost or changed events"
        );
        assert!(
            skipping.1.is_empty(),
            "the skipping decoder skipped a good event"
        );
        if !events.is_empty() {
            let again = proto::decode(&encode::to_proto(events)).expect("re-encoded events decode");
            assert_eq!(
                &again, events,
                "decode -> encode -> decode changed the events"
            );
        }
    }
    let _ = decode_payload(data, &Envelope::default(), &DecodeSettings::default());
});
