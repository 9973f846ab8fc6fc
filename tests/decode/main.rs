//! The event contract and the request body: every decoder against real producer bytes,
//! bad input in every encoding, and each fast path held to its reference parser.

#[path = "../support/mod.rs"]
mod support;

mod bad_input;
mod extra_keys;
mod fast_path;
mod fixtures;
mod kv_groups;
mod lookup_body;
mod sglang;
