//! The write-back controller's handle on one shard of the live index: [`L1Tier`] over the
//! shard's tables (see `index/shard/tiers.rs` for what each call does there). Each call takes
//! the shard's lock for its own duration only, so no lock is held while a batch is in flight
//! to RocksDB and lookups go on meanwhile.

use super::l1::{DirtyPage, L1Tier, Removal, Resident, Stamp};
use crate::index::Index;
use crate::index::shard::{DirtyCursor, L1Key};
use std::sync::Arc;

/// Shard `shard` of `index`, as an [`L1Tier`].
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

impl L1Tier for ShardL1 {
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
