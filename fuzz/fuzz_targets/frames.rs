//! The engines' ZeroMQ frame sets, as a SUB socket (live) or a DEALER (replay replies) would
//! receive them. Beyond "no panic": whatever parses carries exactly the frames it came from,
//! and a replay request's sequence frame reads back as the sequence asked for.
#![no_main]

use kvindex_wire::frames::{self, ReplayReply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<Vec<u8>>, u64)| {
    let (set, from) = input;
    if let Ok(batch) = frames::parse_live(set.clone()) {
        assert_eq!(set.len(), 3);
        assert_eq!(batch.topic, set[0]);
        assert_eq!(batch.seq.to_be_bytes().as_slice(), set[1].as_slice());
        assert_eq!(batch.payload, set[2]);
    }
    match frames::parse_replay(set.clone()) {
        Ok(ReplayReply::Batch(batch)) => {
            assert!(set[0].is_empty(), "a reply without its delimiter parsed");
            assert_eq!(batch.payload.as_slice(), set.last().unwrap().as_slice());
            assert_eq!(
                batch.seq.to_be_bytes().as_slice(),
                set[set.len() - 2].as_slice()
            );
        }
        Ok(ReplayReply::End) => assert!(set.last().is_some_and(Vec::is_empty)),
        Err(_) => {}
    }
    let [delimiter, seq] = frames::replay_request(from);
    assert!(delimiter.is_empty());
    assert_eq!(frames::parse_seq(&seq), Ok(from));
});
