//! kvindex: an exact, durable, always-warm index of where LLM KV-cache blocks live, so a router
//! can send each request to the engine that already holds the longest prefix of it.
//!
//! Data flows one way: a source delivers payloads, [`event`] decodes them into [`event::Event`]s,
//! [`pipeline`] routes each to its [`index`] shard and applies it there, and [`api`] answers
//! lookups over HTTP. [`config`] holds the validated settings, [`metrics`] the counters,
//! [`produce`] a synthetic engine fleet, [`replay`] the trace-replay benchmark, [`source`] the
//! Kafka / NATS consumers, and [`store`] the durable RocksDB state the index reloads at restart.

pub mod api;
pub mod config;
pub mod event;
pub mod index;
pub mod metrics;
pub mod pipeline;
pub mod produce;
pub mod replay;
pub mod source;
pub mod store;
