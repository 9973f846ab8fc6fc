//! Benchmark machinery the `kvindex bench` commands, `benches/` and the tests share: the
//! recorded-trace replay ([`trace`]) and the harness that drives a real `kvindex` process over
//! HTTP ([`harness`]).

pub mod engine;
pub mod harness;
pub mod trace;
