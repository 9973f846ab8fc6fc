//! `POST /v1/lookup` bodies. The fast scanner is an accelerator of the serde parser, not a
//! second set of rules: wherever it answers, it answers exactly what serde answers (the same
//! request or the same error message), and the combined entry point always does.
#![no_main]

use kvindex_wire::lookup::{parse_lookup, parse_lookup_fast, parse_lookup_general};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let general = parse_lookup_general(body);
    if let Some(fast) = parse_lookup_fast(body) {
        assert_eq!(fast, general, "the fast path disagrees with serde");
    }
    assert_eq!(
        parse_lookup(body),
        general,
        "parse_lookup disagrees with serde"
    );
});
