//! The circuit breaker in front of the L2 write path, and the [`Clock`] it reads time from.
//!
//! # Why a breaker
//! When RocksDB fails (disk full, I/O errors) every write-back attempt fails too, and retrying
//! each 128-key batch at full speed would only burn CPU and flood the log. The breaker turns a
//! run of failures into a pause: after the n-th consecutive *real* failure no L2 write is
//! attempted for `min(60 s, 2^min(n, 6) s)`, i.e. 2, 4, 8, 16, 32, 60, 60, … seconds. Once the
//! pause is over the breaker is *half-open*: exactly one write (the probe) may go through. A
//! success closes it (the count starts again from zero); a failure opens it again for the next,
//! longer, pause.
//!
//! A write that runs out of its deadline is neither: the breaker cannot tell a slow-but-healthy
//! L2 from a broken one, so it neither resets the count (that would hide a sick disk behind an
//! occasional slow write) nor extends the pause (a burst of compaction stalls must not lock L2
//! out for a minute).
//!
//! # Permits
//! [`CircuitBreaker::try_acquire`] hands out a [`Permit`]; the caller reports the outcome by
//! consuming it ([`Permit::succeeded`], [`Permit::failed`], [`Permit::timed_out`]). A permit
//! dropped without an outcome counts as a timeout, so a panic or an early return can never
//! leave the breaker stuck "probing" forever.
//!
//! # Time
//! The breaker never calls `Instant::now()` itself: it asks an injected [`Clock`]. Production
//! uses [`SystemClock`]; tests use `spill::testing::ManualClock` and step through a 60 s
//! backoff instantly.

use parking_lot::Mutex;
use serde::Serialize;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest pause, reached at the 6th consecutive failure (2^6 = 64 s is capped to 60 s).
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The exponent stops growing here: 2^6 s already exceeds [`MAX_BACKOFF`].
const MAX_EXPONENT: u32 = 6;

/// A source of monotonic time, injectable so tests control the breaker's pauses.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// The real monotonic clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The pause after the `n`-th consecutive failure: `min(60 s, 2^min(n, 6) s)`; zero for n = 0.
pub fn backoff_for(consecutive_failures: u32) -> Duration {
    if consecutive_failures == 0 {
        return Duration::ZERO;
    }
    let secs = 1u64 << consecutive_failures.min(MAX_EXPONENT);
    Duration::from_secs(secs).min(MAX_BACKOFF)
}

/// Where the breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// No failure since the last success: writes go through.
    Closed,
    /// Pausing after a failure: no write until `open_until`.
    Open,
    /// The pause is over: one probe write may go through (or is in flight).
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The value of the `kvindex_writeback_breaker_state` gauge: 0 closed, 1 open, 2 half-open.
    pub fn gauge(self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A point-in-time view of the breaker for `/v1/stats` and `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BreakerSnapshot {
    pub state: BreakerState,
    pub consecutive_failures: u32,
    /// The pause the last failure imposed (zero when closed).
    #[serde(serialize_with = "as_secs_f64")]
    pub backoff: Duration,
    /// Time left until a probe may go through (zero unless open).
    #[serde(serialize_with = "as_secs_f64")]
    pub remaining: Duration,
    /// When the current pause ends (`None` when closed). Not serialized: an `Instant` means
    /// nothing outside the process; `remaining` is its portable form.
    #[serde(skip)]
    pub open_until: Option<Instant>,
    /// A probe permit is out.
    pub probing: bool,
}

fn as_secs_f64<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// Why [`CircuitBreaker::try_acquire`] refused a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    #[error("L2 circuit breaker open for another {retry_in:?}")]
    Open { retry_in: Duration },
    #[error("L2 circuit breaker half-open and its probe write is still in flight")]
    ProbeInFlight,
}

/// The mutable part, behind one mutex: it is touched once per batch (a few per millisecond at
/// most), so a lock is simpler than a lock-free encoding and never contended in practice.
#[derive(Debug, Default)]
struct Inner {
    consecutive_failures: u32,
    /// End of the current pause; meaningful only while `consecutive_failures > 0`.
    open_until: Option<Instant>,
    /// A permit is out while half-open, so no second write piles onto a sick L2.
    probing: bool,
    /// Bumped by every counted failure and every close. A permit remembers the generation it
    /// was taken in: failures of writes that ran *together* (several shards hit by one disk
    /// hiccup) count once, and a success of a write taken before a failure was counted does
    /// not close the breaker.
    generation: u64,
}

/// The L2 circuit breaker. Share it by `Arc` when several shards write to the same L2: one sick
/// disk should pause all of them.
pub struct CircuitBreaker {
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
}

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

impl CircuitBreaker {
    pub fn new(clock: Arc<dyn Clock>) -> CircuitBreaker {
        CircuitBreaker {
            clock,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The clock this breaker (and whoever shares it) reads.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Asks to write to L2. Closed: always granted. Open: refused until the pause ends.
    /// Half-open: granted once (the probe) until that probe's outcome is reported.
    pub fn try_acquire(&self) -> Result<Permit<'_>, Rejected> {
        let now = self.clock.now();
        let mut inner = self.inner.lock();
        match state_at(&inner, now) {
            BreakerState::Closed => Ok(Permit::new(self, false, inner.generation)),
            BreakerState::Open => Err(Rejected::Open {
                retry_in: remaining(&inner, now),
            }),
            BreakerState::HalfOpen if inner.probing => Err(Rejected::ProbeInFlight),
            BreakerState::HalfOpen => {
                inner.probing = true;
                Ok(Permit::new(self, true, inner.generation))
            }
        }
    }

    /// Whether a write would be refused right now (without taking a permit).
    pub fn is_open(&self) -> bool {
        let inner = self.inner.lock();
        state_at(&inner, self.clock.now()) == BreakerState::Open
    }

    pub fn snapshot(&self) -> BreakerSnapshot {
        let now = self.clock.now();
        let inner = self.inner.lock();
        BreakerSnapshot {
            state: state_at(&inner, now),
            consecutive_failures: inner.consecutive_failures,
            backoff: backoff_for(inner.consecutive_failures),
            remaining: remaining(&inner, now),
            open_until: inner.open_until.filter(|_| inner.consecutive_failures > 0),
            probing: inner.probing,
        }
    }

    fn on_success(&self, generation: u64) {
        let mut inner = self.inner.lock();
        if generation != inner.generation {
            // Taken before a failure was counted: says nothing about L2 now.
            return;
        }
        if inner.consecutive_failures > 0 {
            tracing::info!(
                after_failures = inner.consecutive_failures,
                "L2 write succeeded; circuit breaker closed"
            );
        }
        *inner = Inner {
            generation: inner.generation + 1,
            ..Inner::default()
        };
    }

    fn on_failure(&self, probe: bool, generation: u64) {
        let now = self.clock.now();
        let mut inner = self.inner.lock();
        if probe {
            inner.probing = false;
        }
        if generation != inner.generation {
            // Ran together with a write whose failure is already counted.
            return;
        }
        inner.generation += 1;
        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
        let backoff = backoff_for(inner.consecutive_failures);
        inner.open_until = Some(now + backoff);
        tracing::warn!(
            consecutive_failures = inner.consecutive_failures,
            backoff_s = backoff.as_secs(),
            "L2 write failed; circuit breaker open"
        );
    }

    fn on_timeout(&self, probe: bool) {
        if probe {
            self.inner.lock().probing = false;
        }
    }
}

fn state_at(inner: &Inner, now: Instant) -> BreakerState {
    match inner.open_until {
        _ if inner.consecutive_failures == 0 => BreakerState::Closed,
        Some(until) if now < until => BreakerState::Open,
        _ => BreakerState::HalfOpen,
    }
}

fn remaining(inner: &Inner, now: Instant) -> Duration {
    match inner.open_until {
        Some(until) if inner.consecutive_failures > 0 => until.saturating_duration_since(now),
        _ => Duration::ZERO,
    }
}

/// Leave to write to L2 once. Report how it went by consuming it; dropping it unreported
/// counts as a timeout (neither success nor failure).
#[must_use = "report the write's outcome, or it counts as a timeout"]
pub struct Permit<'a> {
    breaker: &'a CircuitBreaker,
    /// This is the single half-open probe (its outcome must clear `probing`).
    probe: bool,
    /// The breaker's generation when the permit was taken.
    generation: u64,
    reported: bool,
}

impl<'a> Permit<'a> {
    fn new(breaker: &'a CircuitBreaker, probe: bool, generation: u64) -> Permit<'a> {
        Permit {
            breaker,
            probe,
            generation,
            reported: false,
        }
    }

    /// Whether this permit is the half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// The write is durable: the breaker closes and the failure count resets.
    pub fn succeeded(mut self) {
        self.reported = true;
        self.breaker.on_success(self.generation);
    }

    /// The write really failed: one more consecutive failure, and a longer pause.
    pub fn failed(mut self) {
        self.reported = true;
        self.breaker.on_failure(self.probe, self.generation);
    }

    /// The write ran out of its deadline: the breaker's state does not change.
    pub fn timed_out(mut self) {
        self.reported = true;
        self.breaker.on_timeout(self.probe);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.reported {
            self.breaker.on_timeout(self.probe);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spill::testing::ManualClock;

    fn breaker() -> (ManualClock, CircuitBreaker) {
        let clock = ManualClock::new();
        let b = CircuitBreaker::new(Arc::new(clock.clone()));
        (clock, b)
    }

    fn fail_once(b: &CircuitBreaker) {
        b.try_acquire().expect("write allowed").failed();
    }

    #[test]
    fn writes_that_fail_together_count_once_and_an_older_success_does_not_close() {
        let (clock, b) = breaker();
        // Three shards' writes in flight when the disk hiccups.
        let permits: Vec<_> = (0..3).map(|_| b.try_acquire().unwrap()).collect();
        let late = b.try_acquire().unwrap();
        for p in permits {
            p.failed();
        }
        let s = b.snapshot();
        assert_eq!(s.consecutive_failures, 1, "one hiccup, not three failures");
        assert_eq!(s.backoff, Duration::from_secs(2));
        // A write taken before the failure was counted, succeeding late, proves nothing.
        late.succeeded();
        assert_eq!(b.snapshot().state, BreakerState::Open);
        // The half-open probe's outcome does count.
        clock.advance(Duration::from_secs(2));
        b.try_acquire().expect("probe").failed();
        assert_eq!(b.snapshot().consecutive_failures, 2);
        clock.advance(Duration::from_secs(4));
        b.try_acquire().expect("probe").succeeded();
        assert_eq!(b.snapshot().state, BreakerState::Closed);
    }

    #[test]
    fn backoff_sequence_is_2_4_8_16_32_60_60() {
        let got: Vec<u64> = (1..=9).map(|n| backoff_for(n).as_secs()).collect();
        assert_eq!(got, [2, 4, 8, 16, 32, 60, 60, 60, 60]);
        assert_eq!(backoff_for(0), Duration::ZERO);
        assert_eq!(backoff_for(u32::MAX), MAX_BACKOFF);
    }

    #[test]
    fn each_failure_pauses_for_its_backoff_exactly() {
        let (clock, b) = breaker();
        for (n, secs) in [2u64, 4, 8, 16, 32, 60, 60].into_iter().enumerate() {
            fail_once(&b);
            let snap = b.snapshot();
            assert_eq!(snap.state, BreakerState::Open);
            assert_eq!(snap.consecutive_failures, n as u32 + 1);
            assert_eq!(snap.backoff, Duration::from_secs(secs));
            assert_eq!(snap.remaining, Duration::from_secs(secs));
            // One millisecond short of the pause: still refused.
            clock.advance(Duration::from_secs(secs) - Duration::from_millis(1));
            assert!(matches!(b.try_acquire(), Err(Rejected::Open { .. })));
            clock.advance(Duration::from_millis(1));
            assert_eq!(b.snapshot().state, BreakerState::HalfOpen);
        }
    }

    #[test]
    fn success_resets_and_timeout_changes_nothing() {
        let (clock, b) = breaker();
        fail_once(&b);
        clock.advance(Duration::from_secs(2));
        fail_once(&b);
        clock.advance(Duration::from_secs(4));
        // The probe runs out of its deadline: still two failures, the probe slot is free again.
        let probe = b.try_acquire().expect("probe");
        assert!(probe.is_probe());
        assert_eq!(b.try_acquire().err(), Some(Rejected::ProbeInFlight));
        probe.timed_out();
        let snap = b.snapshot();
        assert_eq!(snap.consecutive_failures, 2);
        assert_eq!(snap.state, BreakerState::HalfOpen);
        // A timeout while closed does not count either.
        b.try_acquire().expect("probe").succeeded();
        assert_eq!(b.snapshot().state, BreakerState::Closed);
        for _ in 0..10 {
            b.try_acquire().expect("closed").timed_out();
        }
        assert_eq!(b.snapshot().consecutive_failures, 0);
        // After the reset the next failure starts from 2 s again.
        fail_once(&b);
        assert_eq!(b.snapshot().backoff, Duration::from_secs(2));
    }

    #[test]
    fn failed_probe_reopens_longer_and_dropped_permit_is_a_timeout() {
        let (clock, b) = breaker();
        fail_once(&b);
        clock.advance(Duration::from_secs(2));
        b.try_acquire().expect("probe").failed();
        assert_eq!(b.snapshot().backoff, Duration::from_secs(4));
        assert!(b.is_open());
        clock.advance(Duration::from_secs(4));
        drop(b.try_acquire().expect("probe"));
        let snap = b.snapshot();
        assert!(!snap.probing);
        assert_eq!(snap.consecutive_failures, 2);
    }
}
