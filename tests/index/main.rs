//! The state: the index's event semantics against a reference model, the durable store,
//! the bounded L1 and its spill to L2, the write path (pipeline) over a temp dir, the trace
//! replay and the fleet simulator.

#[path = "../support/mod.rs"]
mod support;

mod block_identity;
mod fleet;
mod pipeline_bad_input;
mod pipeline_durable;
mod reclaim;
mod semantics;
mod spill;
mod spill_controller;
mod store;
mod tiers;
mod trace;
