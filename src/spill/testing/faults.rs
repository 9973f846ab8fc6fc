//! A fault switchboard for L2 writes: [`FaultInjector`] wraps any [`L2Sink`] and makes it fail,
//! partially fail or hang on command, at exactly the write a test chooses, while still writing
//! to the real store the rest of the time. The store consults the same [`FaultHandle`] before
//! its own writes (checkpoint commits and write-back batches) in builds with the `testing`
//! feature, so a whole service can be driven through an L2 outage.

use crate::spill::{L2Error, L2Row, L2Sink};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

/// What a [`FaultInjector`] does to a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Write nothing and report a failure.
    Fail,
    /// Write the first `written` rows (at most all but one) and report a failure.
    Partial { written: usize },
    /// Block until [`FaultHandle::release`] (then write normally) or the deadline (then report
    /// [`L2Error::DeadlineExceeded`] having written nothing).
    Hang,
}

#[derive(Debug, Default)]
struct FaultState {
    /// One-shot faults, applied to the next writes in order.
    queue: VecDeque<Fault>,
    /// Applied to every write while set (after the queue is empty).
    sticky: Option<Fault>,
    /// Bumped by `release`: a hang waiting on an older generation ends.
    generation: u64,
    calls: u64,
    /// Writes currently blocked in a hang.
    hanging: usize,
}

/// The control side of a [`FaultInjector`]; clone it freely (e.g. into another thread).
#[derive(Clone, Debug, Default)]
pub struct FaultHandle {
    shared: Arc<(Mutex<FaultState>, Condvar)>,
}

impl FaultHandle {
    /// The next write suffers `fault` (after any faults queued before).
    pub fn inject_next(&self, fault: Fault) {
        self.shared.0.lock().queue.push_back(fault);
    }

    /// Every write suffers `fault` until [`FaultHandle::clear`].
    pub fn set_sticky(&self, fault: Fault) {
        self.shared.0.lock().sticky = Some(fault);
    }

    /// Forgets queued and sticky faults (hangs in progress keep waiting; see `release`).
    pub fn clear(&self) {
        let mut s = self.shared.0.lock();
        s.queue.clear();
        s.sticky = None;
    }

    /// Clears every fault and lets every hanging write proceed to the real sink.
    pub fn release(&self) {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock();
        s.queue.clear();
        s.sticky = None;
        s.generation += 1;
        cv.notify_all();
    }

    /// The fault ordered for the next write, consumed, for an L2 writer that is not an
    /// [`L2Sink`] (the checkpoint commit): it must then not write. A `Hang` is reported as such
    /// and does not block (the commit has no deadline to wait out).
    pub fn take_fault(&self) -> Option<Fault> {
        self.next_fault().0
    }

    /// Writes attempted through the injector so far.
    pub fn calls(&self) -> u64 {
        self.shared.0.lock().calls
    }

    /// Writes currently blocked in a hang.
    pub fn hanging(&self) -> usize {
        self.shared.0.lock().hanging
    }

    fn next_fault(&self) -> (Option<Fault>, u64) {
        let mut s = self.shared.0.lock();
        s.calls += 1;
        let fault = s.queue.pop_front().or(s.sticky);
        (fault, s.generation)
    }

    /// Blocks until released (true) or `deadline` (false).
    fn hang(&self, generation: u64, deadline: Instant) -> bool {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock();
        s.hanging += 1;
        while s.generation == generation {
            if cv.wait_until(&mut s, deadline).timed_out() {
                break;
            }
        }
        s.hanging -= 1;
        s.generation != generation
    }
}

/// Wraps a sink and misbehaves on command (see [`Fault`]); with no fault pending it passes
/// every write through untouched.
pub struct FaultInjector<S> {
    inner: S,
    handle: FaultHandle,
}

impl<S: L2Sink> FaultInjector<S> {
    pub fn new(inner: S) -> FaultInjector<S> {
        FaultInjector {
            inner,
            handle: FaultHandle::default(),
        }
    }

    /// Wraps `inner`, obeying an existing `handle` (several sinks, one switchboard).
    pub fn with_handle(inner: S, handle: FaultHandle) -> FaultInjector<S> {
        FaultInjector { inner, handle }
    }

    /// The switchboard: keep a clone to inject faults while the controller owns the sink.
    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

impl<S: L2Sink> L2Sink for FaultInjector<S> {
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        self.handle.intercept(rows, deadline, |rows| {
            self.inner.write_batch(rows, deadline)
        })
    }
}

impl FaultHandle {
    /// Runs one write of `rows` (by `write`) as the next fault says: untouched, failed,
    /// partially written, or held until released or `deadline`.
    pub fn intercept(
        &self,
        rows: &[L2Row],
        deadline: Instant,
        write: impl Fn(&[L2Row]) -> Result<(), L2Error>,
    ) -> Result<(), L2Error> {
        let (fault, generation) = self.next_fault();
        match fault {
            None => write(rows),
            Some(Fault::Fail) => Err(L2Error::Injected),
            Some(Fault::Partial { written }) => {
                let written = written.min(rows.len().saturating_sub(1));
                if written > 0 {
                    write(&rows[..written])?;
                }
                Err(L2Error::Partial {
                    written,
                    total: rows.len(),
                })
            }
            Some(Fault::Hang) => {
                let start = Instant::now();
                if self.hang(generation, deadline) {
                    write(rows)
                } else {
                    Err(L2Error::DeadlineExceeded {
                        waited: start.elapsed(),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeMap;
    use std::time::Duration;

    /// An atomic in-memory sink that, like the store, starts no write past its deadline.
    #[derive(Default)]
    struct MemSink(Mutex<BTreeMap<Vec<u8>, Vec<u8>>>);

    impl L2Sink for MemSink {
        fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
            if Instant::now() >= deadline {
                return Err(L2Error::DeadlineExceeded {
                    waited: Duration::ZERO,
                });
            }
            let mut m = self.0.lock();
            for row in rows {
                match &row.value {
                    Some(v) => m.insert(row.key.clone(), v.clone()),
                    None => m.remove(&row.key),
                };
            }
            Ok(())
        }
    }

    impl MemSink {
        fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
            self.0.lock().get(key).cloned()
        }
        fn keys(&self) -> Vec<Vec<u8>> {
            self.0.lock().keys().cloned().collect()
        }
    }

    fn sink() -> ((), FaultInjector<MemSink>) {
        ((), FaultInjector::new(MemSink::default()))
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn passes_through_and_deletes() {
        let (_d, s) = sink();
        s.write_batch(&[L2Row::put("a", "1"), L2Row::put("b", "2")], far())
            .expect("write");
        s.write_batch(&[L2Row::delete("a")], far()).expect("delete");
        assert_eq!(s.inner().get(b"a"), None);
        assert_eq!(s.inner().get(b"b"), Some(b"2".to_vec()));
    }

    #[test]
    fn partial_writes_a_prefix_and_fails() {
        let (_d, s) = sink();
        s.handle().inject_next(Fault::Partial { written: 2 });
        let rows: Vec<L2Row> = (0..4).map(|i| L2Row::put([i], [i])).collect();
        let err = s.write_batch(&rows, far()).expect_err("partial");
        assert!(err.is_failure());
        assert!(matches!(
            err,
            L2Error::Partial {
                written: 2,
                total: 4
            }
        ));
        let keys = s.inner().keys();
        assert_eq!(keys, vec![vec![0], vec![1]]);
        // Never the whole batch.
        s.handle().inject_next(Fault::Partial { written: 99 });
        let err = s.write_batch(&rows[..1], far()).expect_err("partial");
        assert!(matches!(
            err,
            L2Error::Partial {
                written: 0,
                total: 1
            }
        ));
    }

    #[test]
    fn hang_honours_the_deadline_and_release() {
        let (_d, s) = sink();
        let h = s.handle();
        h.set_sticky(Fault::Hang);
        let start = Instant::now();
        let err = s
            .write_batch(&[L2Row::put("k", "v")], start + Duration::from_millis(50))
            .expect_err("deadline");
        assert!(!err.is_failure());
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(s.inner().get(b"k"), None);
        // A release lets a hanging write through.
        std::thread::scope(|scope| {
            let t = scope.spawn(|| s.write_batch(&[L2Row::put("k", "v")], far()));
            while h.hanging() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            h.release();
            t.join().expect("join").expect("released write succeeds");
        });
        assert_eq!(s.inner().get(b"k"), Some(b"v".to_vec()));
    }

    #[test]
    fn expired_deadline_writes_nothing() {
        let (_d, s) = sink();
        let err = s
            .write_batch(&[L2Row::put("k", "v")], Instant::now())
            .expect_err("expired");
        assert!(matches!(err, L2Error::DeadlineExceeded { .. }));
        assert!(s.inner().keys().is_empty());
    }
}
