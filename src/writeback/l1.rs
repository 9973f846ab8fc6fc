//! The L1 side of write-back: the [`L1Tier`] trait a shard implements so the controller can
//! pick cold entries, write them back, and drop them once durable.
//!
//! # Why these operations, and why `&self`
//! The controller needs four things from L1, and nothing else: how big it is, which entries
//! are coldest, "drop these unless they changed", and a walk over the dirty entries. Every
//! method takes `&self` so an implementation can lock its shard *per call* and the controller
//! can hold no lock while a batch is in flight to RocksDB: lookups and event application go on
//! meanwhile (DESIGN.md: no lock held across RocksDB I/O that a lookup needs). That is also
//! why removal is conditional: an entry changed (or read, if the implementation chooses to
//! count reads) during the flight carries a new version, and must stay.
//!
//! # Versions
//! Every entry carries a `version` that moves on every change of its value (a global counter
//! works). Implementations may also move it on reads, to keep an entry being read from leaving
//! (the issue asks that an entry being read *or* changed during the flight is not deleted);
//! the cost is only that such an entry stays dirty one round longer.
//!
//! # Dirty
//! An entry is dirty while L2 lacks its current value. [`Resident::dirty`] carries the row to
//! write (`Some`) so clean entries cost no encoding. An entry emptied in L1 after its last
//! write-back is a dirty tombstone (`L2Row::value == None`): L2 must forget it before L1 may.

use super::l2::L2Row;
use std::fmt::Debug;
use std::sync::Arc;

/// One L1 entry as the controller sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident<K> {
    /// The entry's key in L1's own terms (what [`L1Tier::remove_if_unchanged`] takes back).
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

/// What [`L1Tier::remove_if_unchanged`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    pub removed: usize,
    /// Entries left in place because their version moved (or they were gone already).
    pub kept: usize,
    pub bytes_freed: u64,
}

/// One page of [`L1Tier::dirty_after`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyPage<K, C> {
    /// Dirty entries (every `dirty` is `Some`), at most the limit asked for.
    pub entries: Vec<Resident<K>>,
    /// Where the next page starts; `None` when this page reached the end of the keyspace (the
    /// next walk starts again from `C::default()`).
    pub next: Option<C>,
}

/// What a shard's L1 must offer the write-back controller. See the module doc for the rules.
pub trait L1Tier {
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
impl<T: L1Tier + ?Sized> L1Tier for Arc<T> {
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
