//! Subcommands of the `kvindex` binary, one file each.

pub mod bench;
pub mod bench_http;
pub mod bench_restart;
pub mod bench_setup;
pub mod produce;
pub mod rebuild;
pub mod serve;
