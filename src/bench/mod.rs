//! Benchmark machinery the `kvindex bench` commands and `benches/` share: the recorded-trace
//! replay ([`trace`]).

pub mod trace;
