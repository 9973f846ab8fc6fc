//! Bounded L1 with durable write-back to the RocksDB L2 (issue 4): the rules, independent of
//! the shard's data structures, which plug in through [`L1Tier`], and their wiring into the
//! live index.
//!
//! - [`breaker`]: the circuit breaker (2, 4, 8, … 60 s pauses after consecutive failures) and
//!   the injectable [`Clock`].
//! - [`l2`]: the [`L2Sink`] write seam, its RocksDB implementation, and the [`FaultInjector`].
//! - [`l1`]: the [`L1Tier`] trait a shard implements; [`mem`] is an in-memory implementation
//!   used by the tests and as a reference.
//! - [`controller`]: the rules: watermarks, 128-key batches removed only once durable, hard
//!   cap and backpressure, periodic backup flush with a rotating cursor, emergency eviction.
//! - [`stats`]: counters and the `/v1/stats` / `/metrics` view of them.
//! - [`shard_l1`]: [`L1Tier`] over a shard of the live index (its side is
//!   `index/shard/tiers.rs`: sampled LRU, dirty = changed since the last checkpoint commit,
//!   read-through from the store).
//! - [`live`]: the service's wiring: the budget split over shards, one controller per shard
//!   worker over the store ([`crate::store::StoreSink`]) and one shared breaker, the summed
//!   `/v1/stats` view.

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
