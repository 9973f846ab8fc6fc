//! The service as users run it: the HTTP API against its OpenAPI document, its edge (token,
//! TLS, limits, pages), the configuration contract, the real `kvindex` binary (serve, demo,
//! replay, bench), replicas side by side, `kill -9` trials and a damaged store.

#[path = "../support/mod.rs"]
mod support;

mod api;
mod bench_cli;
mod config;
mod crash;
mod demo;
mod edge;
mod harness;
mod replicas;
mod serve;
mod storage_faults;
