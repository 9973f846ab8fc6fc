//! Subcommands of the `kvindex` binary, one file each.

pub mod bench;
pub mod produce;
pub mod serve;
