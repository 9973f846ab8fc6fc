//! kvindex: an exact, durable, always-warm index of where LLM KV-cache blocks live, so a router
//! can send each request to the engine that already holds the longest prefix of it.
//!
//! Data flows one way: a [`source`] delivers payloads with their offsets, [`ingest`] runs the
//! source and hands batches to the [`pipeline`], which decodes them ([`event`]), routes each
//! event to its [`index`] shard and applies it there, skipping offsets already applied; each
//! shard commits its changes with its offsets to the RocksDB [`store`] in one batch, and
//! [`checkpoint`] tracks what is applied and durable per source partition. [`service`]
//! assembles all of it from a [`config`] (warm-loading the index from disk first), and [`api`]
//! answers lookups over HTTP. [`metrics`] holds the counters, [`produce`] a synthetic engine
//! fleet, [`replay`] the trace-replay benchmark. [`writeback`] is the bounded-L1 write-back
//! machinery (breaker, L2 sink, controller), tested on its own and not yet wired into the shards.

pub mod api;
pub mod checkpoint;
pub mod config;
pub mod event;
pub mod index;
pub mod ingest;
pub mod metrics;
pub mod pipeline;
pub mod produce;
pub mod replay;
pub mod service;
pub mod source;
pub mod store;
pub mod writeback;
