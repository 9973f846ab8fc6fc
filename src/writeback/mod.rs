//! Bounded L1 with durable write-back to the RocksDB L2 (issue 4): the machinery, independent
//! of the shard's data structures, which plug in through [`L1Tier`].
//!
//! - [`breaker`]: the circuit breaker (2, 4, 8, … 60 s pauses after consecutive failures) and
//!   the injectable [`Clock`].
//! - [`l2`]: the [`L2Sink`] write seam, its RocksDB implementation, and the [`FaultInjector`].
//! - [`l1`]: the [`L1Tier`] trait a shard implements; [`mem`] is an in-memory implementation
//!   used by the tests and as a reference.
//! - [`controller`]: the rules: watermarks, 128-key batches removed only once durable, hard
//!   cap and backpressure, periodic backup flush with a rotating cursor, emergency eviction.
//! - [`stats`]: counters and the `/v1/stats` / `/metrics` view of them.
//!
//! # Wiring into a shard (for the integrator)
//! 1. Implement [`L1Tier`] for a handle on the shard's L1 that locks per call (every method
//!    takes `&self`, so no lock is held while a batch is in flight to RocksDB).
//! 2. Build one [`CircuitBreaker`] per L2 (shared by `Arc` among the shards) with
//!    [`SystemClock`], one [`RocksSink`] over the store's database, and one
//!    [`WritebackController`] per shard from [`WritebackSettings::from_config`].
//! 3. On the shard's worker thread, after each commit: [`WritebackController::maintain`]; if
//!    [`WritebackController::must_pause`], stop pulling events and call `maintain` again
//!    after a short sleep (the breaker's `remaining` says how long a retry is pointless).
//! 4. Serve [`WritebackController::stats`] in `/v1/stats` and render it in `/metrics`.

pub mod breaker;
pub mod controller;
pub mod l1;
pub mod l2;
pub mod live;
pub mod mem;
pub mod shard_l1;
pub mod stats;

pub use breaker::{BreakerSnapshot, BreakerState, CircuitBreaker, Clock, ManualClock, SystemClock};
pub use controller::{
    EmergencyError, EmergencyReport, EvictReport, FlushReport, Stop, WritebackController,
    WritebackSettings,
};
pub use l1::{DirtyPage, L1Tier, Removal, Resident, Stamp};
pub use l2::{
    Fault, FaultHandle, FaultInjector, L2Error, L2Row, L2Sink, RocksSink, RocksSinkOptions,
};
pub use live::{ShardWriteback, Tiering};
pub use mem::MemL1;
pub use shard_l1::ShardL1;
pub use stats::{WritebackMetrics, WritebackStats};
