//! JSON bodies (one event object or an array of them). Beyond "no panic":
//! - the skipping decoder agrees with the strict one on every body the strict one accepts;
//! - decode → encode → decode is stable (JSON writes unknown types as `TYPE_UNSPECIFIED`, so
//!   the first re-encoding may normalise; after it nothing changes);
//! - JSON and protobuf express the same events: encoding to either and decoding back agree.
#![no_main]

use kvindex_wire::event::{DecodeSettings, Envelope, Format, decode_payload, encode, json, proto};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let strict = json::decode(data);
    let skipping = json::decode_skipping(data);
    if let Ok(events) = &strict {
        let (kept, skipped) = skipping.as_ref().expect("a body decode accepts");
        assert_eq!(kept, events, "the skipping decoder lost or changed events");
        assert!(
            skipped.is_empty(),
            "the skipping decoder skipped a good event"
        );
    }
    if let Ok((events, _)) = &skipping {
        if !events.is_empty() {
            let once = json::decode(&encode::to_json(events)).expect("re-encoded events decode");
            let twice = json::decode(&encode::to_json(&once)).expect("re-encoded events decode");
            assert_eq!(twice, once, "decode -> encode -> decode is not stable");
            let via_proto = proto::decode(&encode::to_proto(&once)).expect("protobuf decodes");
            assert_eq!(
                via_proto, once,
                "JSON and protobuf disagree on the same events"
            );
        }
    }
    let settings = DecodeSettings {
        format: Format::Json,
        ..DecodeSettings::default()
    };
    let _ = decode_payload(data, &Envelope::default(), &settings);
});
