//! Benchmark machinery the `kvindex bench` commands, `benches/` and the tests share: the
//! recorded-trace replay ([`trace`]), the harness that drives a real `kvindex` process over
//! HTTP ([`harness`]), an engine's ZeroMQ KV-event publisher ([`engine`]) for the bridge, and
//! the JetStream ingest bench's pre-filled stream and plain-drain baseline ([`ingest`]).

pub mod engine;
pub mod harness;
pub mod ingest;
pub mod trace;
