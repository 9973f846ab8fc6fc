//! The L2 write seam: the [`L2Sink`] trait the write-back controller writes through, its
//! RocksDB implementation ([`RocksSink`]), and a [`FaultInjector`] that makes any sink fail,
//! partially fail or hang on command.
//!
//! # Why a trait
//! The controller's one job is to never drop an entry from L1 before it is durable in L2. The
//! only way to test that is to make L2 misbehave at will, at exactly the step a test chooses,
//! while still writing to a real RocksDB the rest of the time. So the controller sees L2 only
//! as "write this batch by that deadline", and the faults wrap the real thing.
//!
//! # Outcomes
//! A write either succeeds (every row of the batch is durable), fails for real
//! ([`L2Error::is_failure`]: I/O error, disk full, partial write), or does not finish in time
//! or is refused as busy ([`L2Error::DeadlineExceeded`], [`L2Error::Busy`]). The circuit breaker
//! counts only real failures; see `breaker.rs`.
//!
//! # Atomicity
//! A RocksDB `WriteBatch` is atomic: after a crash or an error either all its rows are there or
//! none is, and a failed write leaves nothing behind. A different sink (a remote KV store, a
//! sink that splits big batches) might not be, and [`Fault::Partial`] models exactly that: a
//! prefix of the batch lands and the write reports failure. The controller therefore treats a
//! partial write like any failure: it keeps *every* entry of the batch in L1 (still dirty), so
//! whatever prefix landed is simply rewritten by a later attempt. Rows are current values, not
//! deltas, so writing one twice is harmless.

use parking_lot::{Condvar, Mutex};
use rocksdb::{
    BlockBasedOptions, ColumnFamilyDescriptor, DB, DBCompressionType, ErrorKind, Options,
    WriteBatch, WriteOptions,
};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One row of a write-back batch, in its L2 form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2Row {
    pub key: Vec<u8>,
    /// The entry's current value, or `None` when the entry no longer exists and L2 must forget
    /// it (a tombstone: the L1 entry was emptied after its last write-back).
    pub value: Option<Vec<u8>>,
}

impl L2Row {
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> L2Row {
        L2Row {
            key: key.into(),
            value: Some(value.into()),
        }
    }

    pub fn delete(key: impl Into<Vec<u8>>) -> L2Row {
        L2Row {
            key: key.into(),
            value: None,
        }
    }
}

/// A stored (key, value) pair as [`RocksSink::scan`] returns it.
pub type KeyValue = (Vec<u8>, Vec<u8>);

/// Why a batch is not (known to be) durable.
#[derive(Debug, thiserror::Error)]
pub enum L2Error {
    /// RocksDB refused the batch (I/O error, no space left, corruption, …). Nothing of it is
    /// applied: a `WriteBatch` is atomic.
    #[error("rocksdb write failed: {0}")]
    Rocks(#[source] rocksdb::Error),
    /// RocksDB is alive but refused for now (write stall with `no_slowdown`, busy, try again).
    /// Like a deadline, this says nothing about L2's health.
    #[error("rocksdb busy: {0}")]
    Busy(#[source] rocksdb::Error),
    /// Only the first `written` of `total` rows landed (a non-atomic sink; see the module doc).
    #[error("partial write: {written} of {total} rows landed before the sink failed")]
    Partial { written: usize, total: usize },
    /// The sink was built over a database that lacks its column family (a wiring bug, but a
    /// write that did not happen all the same).
    #[error("rocksdb column family `{0}` is missing")]
    MissingColumnFamily(String),
    /// A failure ordered by a [`FaultInjector`].
    #[error("injected L2 failure")]
    Injected,
    /// The write did not complete by its deadline; the caller regained control and must assume
    /// nothing about the batch.
    #[error("L2 write did not finish within its deadline ({waited:?})")]
    DeadlineExceeded { waited: Duration },
}

impl L2Error {
    /// A real failure, which the circuit breaker counts. Deadlines and busy refusals are not.
    pub fn is_failure(&self) -> bool {
        match self {
            L2Error::Rocks(_)
            | L2Error::MissingColumnFamily(_)
            | L2Error::Partial { .. }
            | L2Error::Injected => true,
            L2Error::Busy(_) | L2Error::DeadlineExceeded { .. } => false,
        }
    }

    pub(crate) fn from_rocks(e: rocksdb::Error) -> L2Error {
        match e.kind() {
            ErrorKind::Busy | ErrorKind::TryAgain | ErrorKind::Incomplete | ErrorKind::TimedOut => {
                L2Error::Busy(e)
            }
            _ => L2Error::Rocks(e),
        }
    }
}

/// Where write-back batches go. A successful return means every row is durable (survives a
/// process kill); anything else means the caller must keep every entry of the batch.
pub trait L2Sink {
    /// Writes `rows` (puts and deletes) as one batch. Implementations should not *start* a
    /// write after `deadline`, and should give control back by then when they can; a write
    /// that completes late but completes is a success.
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error>;
}

impl<S: L2Sink + ?Sized> L2Sink for &S {
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        (**self).write_batch(rows, deadline)
    }
}

impl<S: L2Sink + ?Sized> L2Sink for Arc<S> {
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        (**self).write_batch(rows, deadline)
    }
}

/// How to open a [`RocksSink`] on its own database.
#[derive(Clone, Debug, Default)]
pub struct RocksSinkOptions {
    /// fsync every batch (power-loss safety) instead of leaving the WAL in the page cache
    /// (`kill -9` safety, the store's default too).
    pub sync: bool,
    /// Fail a batch with [`L2Error::Busy`] instead of blocking when RocksDB stalls writes
    /// (compaction behind): the controller then keeps the entries and retries later, and the
    /// shard thread is never parked inside RocksDB.
    pub no_slowdown: bool,
}

/// L2 in RocksDB: rows go to one column family (the default one, or a named one of a shared
/// database) in one atomic `WriteBatch` per call.
pub struct RocksSink {
    db: Arc<DB>,
    /// `None`: the default column family.
    cf: Option<String>,
    write_opts: WriteOptions,
}

impl RocksSink {
    /// Opens (or creates) a database of its own in `dir`: LZ4 (the only codec compiled in) and
    /// bloom filters, so the read path's misses rarely touch a data block.
    pub fn open(dir: &Path, opts: &RocksSinkOptions) -> Result<RocksSink, L2Error> {
        let mut o = Options::default();
        o.create_if_missing(true);
        o.set_compression_type(DBCompressionType::Lz4);
        let mut table = BlockBasedOptions::default();
        table.set_bloom_filter(10.0, false);
        o.set_block_based_table_factory(&table);
        let db = DB::open(&o, dir).map_err(L2Error::Rocks)?;
        Ok(RocksSink::with_db(Arc::new(db), None, opts))
    }

    /// Opens `dir` with a column family `cf` (created if missing) and writes there.
    pub fn open_cf(dir: &Path, cf: &str, opts: &RocksSinkOptions) -> Result<RocksSink, L2Error> {
        let mut o = Options::default();
        o.create_if_missing(true);
        o.create_missing_column_families(true);
        o.set_compression_type(DBCompressionType::Lz4);
        let cfs = [ColumnFamilyDescriptor::new(cf, o.clone())];
        let db = DB::open_cf_descriptors(&o, dir, cfs).map_err(L2Error::Rocks)?;
        Ok(RocksSink::with_db(Arc::new(db), Some(cf.to_string()), opts))
    }

    /// Writes into an already open database (e.g. the store's), into column family `cf`.
    pub fn with_db(db: Arc<DB>, cf: Option<String>, opts: &RocksSinkOptions) -> RocksSink {
        let mut write_opts = WriteOptions::default();
        write_opts.set_sync(opts.sync);
        write_opts.disable_wal(false);
        write_opts.set_no_slowdown(opts.no_slowdown);
        RocksSink { db, cf, write_opts }
    }

    pub fn db(&self) -> &Arc<DB> {
        &self.db
    }

    /// Reads one row (for tests, restarts and the later read path).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, L2Error> {
        let got = match self.cf_handle()? {
            Some(cf) => self.db.get_cf(cf, key),
            None => self.db.get(key),
        };
        got.map_err(L2Error::Rocks)
    }

    /// Every row, in key order (for tests and restarts; a full scan).
    pub fn scan(&self) -> Result<Vec<KeyValue>, L2Error> {
        let iter = match self.cf_handle()? {
            Some(cf) => self.db.iterator_cf(cf, rocksdb::IteratorMode::Start),
            None => self.db.iterator(rocksdb::IteratorMode::Start),
        };
        iter.map(|kv| kv.map(|(k, v)| (k.to_vec(), v.to_vec())))
            .collect::<Result<_, _>>()
            .map_err(L2Error::Rocks)
    }

    fn cf_handle(&self) -> Result<Option<&rocksdb::ColumnFamily>, L2Error> {
        match &self.cf {
            None => Ok(None),
            Some(name) => self
                .db
                .cf_handle(name)
                .map(Some)
                .ok_or_else(|| L2Error::MissingColumnFamily(name.clone())),
        }
    }

    fn build(&self, rows: &[L2Row]) -> Result<WriteBatch, L2Error> {
        let cf = self.cf_handle()?;
        let mut batch = WriteBatch::default();
        for row in rows {
            match (&row.value, cf) {
                (Some(v), Some(cf)) => batch.put_cf(cf, &row.key, v),
                (Some(v), None) => batch.put(&row.key, v),
                (None, Some(cf)) => batch.delete_cf(cf, &row.key),
                (None, None) => batch.delete(&row.key),
            }
        }
        Ok(batch)
    }
}

impl L2Sink for RocksSink {
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        let start = Instant::now();
        if start >= deadline {
            return Err(L2Error::DeadlineExceeded {
                waited: Duration::ZERO,
            });
        }
        let batch = self.build(rows)?;
        self.db
            .write_opt(batch, &self.write_opts)
            .map_err(L2Error::from_rocks)
    }
}

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
        let (fault, generation) = self.handle.next_fault();
        match fault {
            None => self.inner.write_batch(rows, deadline),
            Some(Fault::Fail) => Err(L2Error::Injected),
            Some(Fault::Partial { written }) => {
                let written = written.min(rows.len().saturating_sub(1));
                if written > 0 {
                    self.inner.write_batch(&rows[..written], deadline)?;
                }
                Err(L2Error::Partial {
                    written,
                    total: rows.len(),
                })
            }
            Some(Fault::Hang) => {
                let start = Instant::now();
                if self.handle.hang(generation, deadline) {
                    self.inner.write_batch(rows, deadline)
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

    fn sink() -> (tempfile::TempDir, FaultInjector<RocksSink>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = RocksSink::open(dir.path(), &RocksSinkOptions::default()).expect("open");
        (dir, FaultInjector::new(s))
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
        assert_eq!(s.inner().get(b"a").expect("get"), None);
        assert_eq!(s.inner().get(b"b").expect("get"), Some(b"2".to_vec()));
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
        let keys: Vec<Vec<u8>> = s
            .inner()
            .scan()
            .expect("scan")
            .into_iter()
            .map(|(k, _)| k)
            .collect();
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
        assert_eq!(s.inner().get(b"k").expect("get"), None);
        // A release lets a hanging write through.
        std::thread::scope(|scope| {
            let t = scope.spawn(|| s.write_batch(&[L2Row::put("k", "v")], far()));
            while h.hanging() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            h.release();
            t.join().expect("join").expect("released write succeeds");
        });
        assert_eq!(s.inner().get(b"k").expect("get"), Some(b"v".to_vec()));
    }

    #[test]
    fn expired_deadline_writes_nothing() {
        let (_d, s) = sink();
        let err = s
            .write_batch(&[L2Row::put("k", "v")], Instant::now())
            .expect_err("expired");
        assert!(matches!(err, L2Error::DeadlineExceeded { .. }));
        assert!(s.inner().scan().expect("scan").is_empty());
    }
}
