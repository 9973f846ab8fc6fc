//! The bounded L1 and its spill to the RocksDB L2: the rules that keep each shard's in-memory
//! tables (L1) within a byte budget by writing cold entries back to the store (L2) and
//! dropping them only once durable, and the seam both sides implement.
//!
//! Dependencies point one way: this module names neither the index nor the store.
//!
//! - [`seam`]: what the two sides agree on: [`SpillL1`] (implemented by the index, over a
//!   shard's tables: `index/l1.rs` and `index/shard/evict.rs`), [`L2Sink`] and [`L2Reader`]
//!   (implemented by the store: `store/l2.rs`), and the row and entry types between them.
//! - [`controller`]: the rules: watermarks, 128-key batches removed only once durable, hard
//!   cap and backpressure, periodic backup flush with a rotating cursor, emergency eviction.
//! - [`breaker`]: the circuit breaker in front of every L2 write (2, 4, 8, … 60 s pauses after
//!   consecutive failures) and the injectable [`Clock`].
//! - [`stats`]: counters and the `/v1/stats` / `/metrics` view of them.
//! - `testing` (tests and the `testing` feature only): test doubles of the seams.
//!
//! The one place that names both the index and the store is the wiring, `pipeline/spill.rs`:
//! the budget split over shards, one controller per shard worker over the store, one shared
//! breaker.
//!
//! Words: *spill* is L1 ↔ L2 (memory ↔ RocksDB); *tier* is where an engine holds a block
//! (GPU, CPU, disk; [`crate::event::Tier`]).

pub mod breaker;
pub mod controller;
pub mod seam;
pub mod stats;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use breaker::{BreakerSnapshot, BreakerState, CircuitBreaker, Clock, SystemClock};
pub use controller::{
    EmergencyError, EmergencyReport, EvictReport, FlushReport, SpillController, SpillSettings, Stop,
};
pub use seam::{
    BackendError, DirtyPage, L2Error, L2ReadError, L2Reader, L2Row, L2Sink, Removal, Resident,
    SpillL1, Stamp, StoredBlock,
};
pub use stats::{SpillMetrics, SpillStats};
