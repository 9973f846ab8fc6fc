//! Build script: compiles the event contract `proto/kvindex/v1/events.proto` (kept at the
//! repository's root, beside the JSON Schema) with prost-build into `$OUT_DIR/kvindex.v1.rs`,
//! which `src/event/proto.rs` includes as `pb`.

fn main() -> std::io::Result<()> {
    println!("cargo:rerun-if-changed=../proto/kvindex/v1/events.proto");
    // `bytes` fields as `bytes::Bytes`: decoding from one shared buffer then slices it instead
    // of allocating a Vec per block hash (the decode bench's largest cost).
    prost_build::Config::new()
        .bytes(["."])
        .compile_protos(&["../proto/kvindex/v1/events.proto"], &["../proto"])
}
