//! Inputs the fuzz targets (`fuzz/`) found, kept as tests of the behaviour they fixed. Each
//! input also sits in its target's seed corpus, so every fuzz run replays it.

use kvindex_wire::event::{Envelope, Event, VllmSettings, vllm};

fn bytes(hex: &str) -> Vec<u8> {
    hex::decode(hex).expect("test hex")
}

fn decode_vllm(payload: &[u8]) -> Result<Vec<Event>, kvindex_wire::event::DecodeError> {
    let env = Envelope {
        engine: Some("engine-0"),
        model: Some("model"),
        ..Envelope::default()
    };
    vllm::decode(payload, &env, &VllmSettings::default()).map(|(events, _)| events)
}

/// `vllm` target: a typed extra key (a map) whose own key was a container skipped only that
/// container's first item, so the reader lost its place. A payload truncated inside such a
/// map decoded (reading later bytes as the event's remaining fields) while the forwarder's
/// summary, which skips whole items, rightly called it truncated.
#[test]
fn a_truncated_batch_with_a_container_key_in_an_extra_key_is_refused_by_both_readers() {
    let payload = bytes(
        "950891de000ca474797065ab426c6f636b53746f726564732d6c6f7261aa65787472615f6b65797392\
         9b00016c626c6f635e10000891de000cffffffff016589ab426c6f636b53746f72656b626c6f636b5f\
         000101060e01c2c2c2c2c2c2c25dc2c2c2c26c6f72615f6e616501",
    );
    assert!(vllm::batch_summary(&payload).is_err());
    assert!(decode_vllm(&payload).is_err());
}

/// The same rule, well-formed: a container key in a typed extra key (vLLM `extra_keys`) or in
/// SGLang's `metadata` is skipped whole, key and value, and the rest of the map still counts.
#[test]
fn a_container_key_in_an_extra_key_or_sglang_metadata_is_skipped_whole() {
    const HEAD: &str = "93cb3ff80000000000009186a474797065ab426c6f636b53746f726564ac626c6f636b5f\
                        6861736865739101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69\
                        6473920102aa626c6f636b5f73697a6502";
    // `extra_keys: [[{[1, 2]: 3, "type": "cache_salt", "salt": "s"}]]`, and without `[1, 2]: 3`.
    let extra_with =
        "aa65787472615f6b65797391918392010203a474797065aa63616368655f73616c74a473616c74a173c0";
    let extra_without =
        "aa65787472615f6b657973919182a474797065aa63616368655f73616c74a473616c74a173c0";
    // `metadata: {[1, 2]: 3, "cache_salt": "s"}`, and without `[1, 2]: 3`.
    let meta_with = "a86d657461646174618292010203aa63616368655f73616c74a173c0";
    let meta_without = "a86d6574616461746181aa63616368655f73616c74a173c0";
    for (with, without) in [(extra_with, extra_without), (meta_with, meta_without)] {
        let with = decode_vllm(&bytes(&format!("{HEAD}{with}"))).expect("decodes");
        let without = decode_vllm(&bytes(&format!("{HEAD}{without}"))).expect("decodes");
        assert_eq!(with, without);
        assert_eq!(with[0].block_extras[0].cache_salt, "s");
    }
}

/// `vllm` target: decode → encode → decode lost an extra key of an unknown shape (the vLLM
/// encoder wrote none back), and a block's second bare salt was kept as its text, the same
/// bytes as an unrelated item (`"b"` and the integer 98 both became `[0x62]`).
#[test]
fn unknown_extra_keys_survive_a_vllm_round_trip_and_a_second_salt_keeps_its_msgpack_bytes() {
    const HEAD: &str = "93cb3ff80000000000009186a474797065ab426c6f636b53746f726564ac626c6f636b5f\
                        6861736865739101b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69\
                        6473920102aa626c6f636b5f73697a6502aa65787472615f6b657973";
    // `extra_keys: [["a", "b"]]` and `[["a", 98]]`.
    let two_salts = decode_vllm(&bytes(&format!("{HEAD}9192a161a162c0"))).expect("decodes");
    let salt_and_int = decode_vllm(&bytes(&format!("{HEAD}9192a16162c0"))).expect("decodes");
    assert_eq!(two_salts[0].block_extras[0].other, vec![vec![0xa1, 0x62]]);
    assert_eq!(salt_and_int[0].block_extras[0].other, vec![vec![0x62]]);
    for events in [two_salts, salt_and_int] {
        let again =
            decode_vllm(&kvindex_wire::event::encode::to_vllm(&events, 0)).expect("decodes");
        assert_eq!(again[0].block_extras, events[0].block_extras);
    }
}
