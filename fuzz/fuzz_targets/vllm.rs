//! vLLM / SGLang / TensorRT-LLM msgpack `KVEventBatch`es, array and map forms. Beyond "no
//! panic":
//! - the forwarder's summary (event count, rank) accepts every batch the decoder accepts and
//!   counts its events;
//! - decode → encode → decode is stable, timestamps aside (the batch `ts` is a float of
//!   seconds, so microseconds may round).
#![no_main]

use kvindex_wire::event::{Envelope, Event, VllmSettings, encode, vllm};
use libfuzzer_sys::fuzz_target;

const ENGINE: &str = "engine-0";

fn decode(bytes: &[u8], settings: &VllmSettings) -> Option<Vec<Event>> {
    let env = Envelope {
        engine: Some(ENGINE),
        model: Some("model"),
        ..Envelope::default()
    };
    let (mut events, _skipped) = vllm::decode(bytes, &env, settings).ok()?;
    for ev in &mut events {
        ev.timestamp_us = 0;
    }
    Some(events)
}

fuzz_target!(|data: &[u8]| {
    let mut settings = VllmSettings::default();
    settings.lora_names.insert(7, "adapter-7".into());
    let Some(events) = decode(data, &settings) else {
        let _ = vllm::batch_summary(data);
        return;
    };
    let (count, rank) = vllm::batch_summary(data).expect("the summary accepts a decoded batch");
    assert!(
        count >= events.len(),
        "the summary counts fewer events than decode returns"
    );
    let rank = rank.unwrap_or(0);
    let once =
        decode(&encode::to_vllm(&events, rank), &settings).expect("re-encoded batch decodes");
    let twice = decode(&encode::to_vllm(&once, rank), &settings).expect("re-encoded batch decodes");
    assert_eq!(twice, once, "decode -> encode -> decode is not stable");
});
