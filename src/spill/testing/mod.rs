//! Test doubles of the spill's seams, compiled only for tests (`cfg(test)`) and for builds
//! with the `testing` feature (the integration tests and benches turn it on):
//!
//! - [`MemL1`]: a small, obviously-correct in-memory [`SpillL1`](super::SpillL1), the
//!   reference a real L1 is held to;
//! - [`FaultInjector`] / [`FaultHandle`]: L2 writes that fail, partially fail or hang on
//!   command (the store obeys the same switchboard in these builds);
//! - [`ManualClock`]: time that moves only when a test says so, to step through the circuit
//!   breaker's pauses.

mod faults;
mod mem_l1;

pub use faults::{Fault, FaultHandle, FaultInjector};
pub use mem_l1::MemL1;

use super::Clock;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A clock that moves only when told to ([`ManualClock::advance`]). Cloning shares the time.
#[derive(Clone, Debug)]
pub struct ManualClock {
    /// `Instant` has no public constructor, so manual time is an offset from a real instant
    /// captured once.
    base: Instant,
    offset: Arc<Mutex<Duration>>,
}

impl ManualClock {
    pub fn new() -> ManualClock {
        ManualClock {
            base: Instant::now(),
            offset: Arc::new(Mutex::new(Duration::ZERO)),
        }
    }

    /// Moves time forward by `d` for every clone of this clock.
    pub fn advance(&self, d: Duration) {
        *self.offset.lock() += d;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + *self.offset.lock()
    }
}
