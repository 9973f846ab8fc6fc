//! kvindex: an exact, durable, always-warm index of where LLM KV-cache blocks live, so a router
//! can send each request to the engine that already holds the longest prefix of it.
//!
//! `ARCHITECTURE.md` is the map; each module's doc comment is its detailed design. In the order
//! an event flows:
//!
//! - [`bridge`]: the engines' ZeroMQ publishers (vLLM, SGLang, TensorRT-LLM) into a source,
//!   with gap replay and restart fencing;
//! - [`source`]: Kafka (and the embedded broker) and NATS: payloads in, with their positions;
//!   publishers out; the engine contract of each transport;
//! - [`ingest`]: the loop that drives the source and reports its status;
//! - [`event`]: the event contract and its decoders (protobuf, JSON, vLLM msgpack);
//! - [`pipeline`]: decode, route to shards, apply on shard workers, commit with offsets;
//! - [`index`]: the in-memory shards (L1) and the longest-prefix lookup;
//! - [`spill`]: the bounded L1's rules and the seam to its RocksDB L2;
//! - [`store`]: every RocksDB call: checkpoint commits, offsets, warm reload, L2 rows;
//! - [`service`]: assembly from a [`config`], warm start, clean stop; [`cluster`]: this
//!   process among the replicas of one index (its replica id);
//! - [`api`]: the HTTP read API; [`metrics`]: counters and the Prometheus text.
//!
//! Tools beside the data path: [`sim`] (a synthetic engine fleet), [`bench`] (benchmark
//! machinery), [`util`] (backoff, rate-limited logs, time).

pub mod api;
pub mod bench;
pub mod bridge;
pub mod cluster;
pub use kvindex_config as config;
pub use kvindex_wire::event;
pub mod index;
pub mod ingest;
pub mod metrics;
pub mod pipeline;
pub mod service;
pub mod sim;
pub mod source;
pub mod spill;
pub mod store;
pub mod util;
