//! The seam of the spill: the types and traits its two sides and its rules agree on, and
//! nothing else. The index implements the L1 side ([`SpillL1`], over a shard's tables), the store
//! implements the L2 side ([`L2Sink`] to write rows, [`L2Reader`] to read them back), and the
//! [`SpillController`](super::SpillController) is written against these traits only. Neither
//! side names the other: a field added to [`L2Row`] touches this file and its two implementors.
//!
//! # The L1 side: why these operations, and why `&self`
//! The controller needs four things from L1, and nothing else: how big it is, which entries
//! are coldest, "drop these unless they changed", and a walk over the dirty entries. Every
//! method takes `&self` so an implementation can lock its shard *per call* and the controller
//! can hold no lock while a batch is in flight to RocksDB: lookups and event application go on
//! meanwhile (no lock a lookup needs is held across L2 I/O). That is also why removal is
//! conditional: an entry changed (or read, if the implementation chooses to count reads)
//! during the flight carries a new version, and must stay.
//!
//! # Versions
//! Every entry carries a `version` that moves on every change of its value (a global counter
//! works). Implementations may also move it on reads, to keep an entry being read from leaving
//! (an entry being read *or* changed during the flight is not deleted); the cost is only that
//! such an entry stays dirty one round longer.
//!
//! # Dirty
//! An entry is dirty while L2 lacks its current value. [`Resident::dirty`] carries the row to
//! write (`Some`) so clean entries cost no encoding. An entry emptied in L1 after its last
//! write-back is a dirty tombstone (`L2Row::value == None`): L2 must forget it before L1 may.
//!
//! # The L2 side: outcomes
//! A write either succeeds (every row of the batch is durable), fails for real
//! ([`L2Error::is_failure`]: I/O error, disk full, partial write), or does not finish in time
//! or is refused as busy ([`L2Error::DeadlineExceeded`], [`L2Error::Busy`]). The circuit breaker
//! counts only real failures; see `breaker.rs`.
//!
//! # Atomicity
//! A RocksDB `WriteBatch` is atomic: after a crash or an error either all its rows are there or
//! none is, and a failed write leaves nothing behind. A different sink (a remote KV store, a
//! sink that splits big batches) might not be, and [`L2Error::Partial`] names exactly that: a
//! prefix of the batch landed and the write reports failure. The controller therefore treats a
//! partial write like any failure: it keeps *every* entry of the batch in L1 (still dirty), so
//! whatever prefix landed is simply rewritten by a later attempt. Rows are current values, not
//! deltas, so writing one twice is harmless.

use crate::event::TierSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A boxed error of the store behind L2 (the seam does not name the store's own types).
pub type BackendError = Box<dyn std::error::Error + Send + Sync>;

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

/// Why a batch is not (known to be) durable.
#[derive(Debug, thiserror::Error)]
pub enum L2Error {
    /// The store refused the batch (I/O error, no space left, corruption, …). Nothing of it is
    /// applied: a RocksDB `WriteBatch` is atomic.
    #[error("L2 write failed: {0}")]
    Failed(#[source] BackendError),
    /// The store is alive but refused for now (a write stall, busy, try again). Like a
    /// deadline, this says nothing about L2's health.
    #[error("L2 busy: {0}")]
    Busy(#[source] BackendError),
    /// Only the first `written` of `total` rows landed (a non-atomic sink; see the module doc).
    #[error("partial write: {written} of {total} rows landed before the sink failed")]
    Partial { written: usize, total: usize },
    /// A row the store has no place for (a row key of no known kind, a missing column family):
    /// a wiring bug, but a write that did not happen all the same.
    #[error("L2 cannot store this batch: {0}")]
    Unplaceable(String),
    /// A failure ordered by a test's fault switchboard (`spill::testing`).
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
            L2Error::Failed(_)
            | L2Error::Unplaceable(_)
            | L2Error::Partial { .. }
            | L2Error::Injected => true,
            L2Error::Busy(_) | L2Error::DeadlineExceeded { .. } => false,
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

/// One L1 entry as the controller sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident<K> {
    /// The entry's key in L1's own terms (what [`SpillL1::remove_if_unchanged`] takes back).
    pub key: K,
    pub version: u64,
    /// What the entry counts against `l1_max_bytes`.
    pub bytes: u64,
    /// `Some(row)` while L2 lacks the current value: the row to write. `None`: clean.
    pub dirty: Option<L2Row>,
}

impl<K: Clone> Resident<K> {
    /// The (key, version) pair that identifies this exact state of the entry.
    pub fn stamp(&self) -> Stamp<K> {
        Stamp {
            key: self.key.clone(),
            version: self.version,
        }
    }
}

/// An entry as it was when a batch was planned: remove / mark clean only if still so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stamp<K> {
    pub key: K,
    pub version: u64,
}

/// What [`SpillL1::remove_if_unchanged`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    pub removed: usize,
    /// Entries left in place because their version moved (or they were gone already).
    pub kept: usize,
    pub bytes_freed: u64,
}

/// One page of [`SpillL1::dirty_after`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyPage<K, C> {
    /// Dirty entries (every `dirty` is `Some`), at most the limit asked for.
    pub entries: Vec<Resident<K>>,
    /// Where the next page starts; `None` when this page reached the end of the keyspace (the
    /// next walk starts again from `C::default()`).
    pub next: Option<C>,
}

/// What a shard's L1 must offer the spill controller. See the module doc for the rules.
pub trait SpillL1 {
    /// The entry key in L1 terms (e.g. partition id + block key).
    type Key: Clone + Debug;
    /// A position in the keyspace for the rotating flush walk; `Default` is the start. Any
    /// stable order works (key order, hash-table bucket index); it need not survive a resize
    /// exactly, only keep covering the keyspace over rotations.
    type Cursor: Clone + Default + Debug;

    /// Bytes currently accounted against `l1_max_bytes`.
    fn bytes_used(&self) -> u64;

    /// Entries currently resident.
    fn entry_count(&self) -> usize;

    /// Up to `max` least recently used entries, coldest first.
    fn coldest(&self, max: usize) -> Vec<Resident<Self::Key>>;

    /// Removes each entry whose version still equals its stamp's; leaves the others.
    fn remove_if_unchanged(&self, victims: &[Stamp<Self::Key>]) -> Removal;

    /// Up to `max` dirty entries at or after `cursor`, in the cursor's order.
    fn dirty_after(&self, cursor: &Self::Cursor, max: usize) -> DirtyPage<Self::Key, Self::Cursor>;

    /// Marks clean each entry whose version still equals its stamp's (its row is now durable);
    /// returns how many were marked.
    fn mark_clean_if_unchanged(&self, written: &[Stamp<Self::Key>]) -> usize;
}

/// Share one L1 between the controller and its owner.
impl<T: SpillL1 + ?Sized> SpillL1 for Arc<T> {
    type Key = T::Key;
    type Cursor = T::Cursor;

    fn bytes_used(&self) -> u64 {
        (**self).bytes_used()
    }
    fn entry_count(&self) -> usize {
        (**self).entry_count()
    }
    fn coldest(&self, max: usize) -> Vec<Resident<Self::Key>> {
        (**self).coldest(max)
    }
    fn remove_if_unchanged(&self, victims: &[Stamp<Self::Key>]) -> Removal {
        (**self).remove_if_unchanged(victims)
    }
    fn dirty_after(&self, cursor: &Self::Cursor, max: usize) -> DirtyPage<Self::Key, Self::Cursor> {
        (**self).dirty_after(cursor, max)
    }
    fn mark_clean_if_unchanged(&self, written: &[Stamp<Self::Key>]) -> usize {
        (**self).mark_clean_if_unchanged(written)
    }
}

/// An L2 read failed (the store's error, as text).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct L2ReadError(pub String);

/// A block row as L2 stores it: durable partition id, holders by durable engine id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredBlock {
    pub partition: u32,
    pub holders: Vec<(u32, TierSet)>,
}

/// The L1 side's view of L2: point reads of a shard's rows, and the encoding of the rows
/// write-back writes (in the store's layout, with durable ids). Implemented by the store.
pub trait L2Reader: Send + Sync {
    fn block(&self, shard: u16, key: u64) -> Result<Option<StoredBlock>, L2ReadError>;
    /// [`L2Reader::block`] if it can be answered from memory (the store's memtables, block
    /// cache and filters), without waiting on storage; `None` if it would have to. A caller
    /// that must not block (an async worker) tries this first. By default nothing can.
    fn block_if_cached(
        &self,
        _shard: u16,
        _key: u64,
    ) -> Option<Result<Option<StoredBlock>, L2ReadError>> {
        None
    }
    fn map_entry(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        hash: u64,
    ) -> Result<Option<u64>, L2ReadError>;
    /// Calls `each(hash, block)` for every stored entry of one engine's map in one partition.
    fn map_entries(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        each: &mut dyn FnMut(u64, u64),
    ) -> Result<(), L2ReadError>;
    fn block_row(&self, shard: u16, key: u64, partition: u32, holders: &[(u32, TierSet)]) -> L2Row;
    fn map_row(&self, shard: u16, engine: u32, partition: u32, hash: u64, block: u64) -> L2Row;
}
