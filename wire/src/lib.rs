//! kvindex's wire contract, in a crate of its own: what producers put on a broker and what
//! engines put on their ZeroMQ sockets, and the pure functions that read and write it.
//!
//! - [`event`]: the one domain event every decoder produces (protobuf `CacheEvent`, its JSON
//!   twin, vLLM's and SGLang's msgpack `KVEventBatch`), with its encoders;
//! - [`frames`]: the engines' ZeroMQ frame sets (live messages, replay requests and replies);
//! - [`lookup`]: the body of the HTTP API's `POST /v1/lookup` (a fast scanner for the usual
//!   body, serde for the rest), what routers send.
//!
//! It depends on no storage, broker or runtime crate. That keeps it cheap to build where the
//! service is not wanted: Rust producers link it to speak the contract, and the fuzz targets
//! (`fuzz/`) build it with sanitizers in a minute instead of recompiling RocksDB.

pub mod event;
pub mod frames;
pub mod lookup;
