//! Benchmark machinery the `kvindex bench` commands, `benches/` and the tests share: the
//! recorded-trace replay ([`trace`]), the harness that drives a real `kvindex` process over
//! HTTP ([`harness`]), and an engine's ZeroMQ KV-event publisher ([`engine`]) for the bridge.

pub mod engine;
pub mod harness;
pub mod trace;
