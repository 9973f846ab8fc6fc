//! The index as the spill controller's L1: [`ShardL1`] is one shard of the live index behind
//! the [`SpillL1`] seam (see `shard/evict.rs` for what each call does there). Each call takes
//! the shard's lock for its own duration only, so no lock is held while a batch is in flight
//! to RocksDB and lookups go on meanwhile.

use super::Index;
use super::shard::{DirtyCursor, L1Key};
use crate::spill::{DirtyPage, Removal, Resident, SpillL1, Stamp};
use std::sync::Arc;

/// Shard `shard` of `index`, as an [`SpillL1`].
#[derive(Clone)]
pub struct ShardL1 {
    index: Arc<Index>,
    shard: usize,
}

impl ShardL1 {
    pub fn new(index: Arc<Index>, shard: usize) -> ShardL1 {
        ShardL1 { index, shard }
    }
}

impl SpillL1 for ShardL1 {
    type Key = L1Key;
    type Cursor = DirtyCursor;

    fn bytes_used(&self) -> u64 {
        self.index.shard(self.shard).read().l1_bytes()
    }
    fn entry_count(&self) -> usize {
        self.index.shard(self.shard).read().l1_entries()
    }
    fn coldest(&self, max: usize) -> Vec<Resident<L1Key>> {
        self.index.shard(self.shard).write().coldest(max)
    }
    fn remove_if_unchanged(&self, victims: &[Stamp<L1Key>]) -> Removal {
        self.index
            .shard(self.shard)
            .write()
            .evict_if_unchanged(victims)
    }
    fn dirty_after(&self, cursor: &DirtyCursor, max: usize) -> DirtyPage<L1Key, DirtyCursor> {
        self.index.shard(self.shard).read().dirty_after(cursor, max)
    }
    fn mark_clean_if_unchanged(&self, written: &[Stamp<L1Key>]) -> usize {
        self.index
            .shard(self.shard)
            .write()
            .mark_clean_if_unchanged(written)
    }
}
