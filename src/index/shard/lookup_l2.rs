//! A lookup's reads of L2, taken outside the shard's lock.
//!
//! A lookup of a spilled shard may need blocks only L2 holds. Reading them under the shard's
//! read lock would let one slow RocksDB read stall the shard's writer, and since the lock is
//! writer-fair, every later lookup of the shard would queue behind that writer. A lookup
//! first tries with reads RocksDB serves from memory only, under the lock as the walk goes
//! ([`super::L2Access::MemoryOnly`]: as quick as L1). One that would wait on storage runs
//! again, where blocking is allowed, in three steps:
//! 1. under the read lock, [`Shard::l2_plan`] lists the query's blocks L1 lacks;
//! 2. under no lock, [`L2Plan::read`] reads their rows in query order, up to the first row L2
//!    lacks too (no engine holds a prefix past a block nobody holds);
//! 3. under the read lock again, the walk takes those rows ([`L2Prefetch`]) where L1 has
//!    nothing to say.
//!
//! A prefetched row is still the truth at step 3 unless the shard evicted something or
//! started a commit in between: only then can a block's row change, or a block come to live
//! only in L2, without the block being resident (and L1 wins for a resident block). The shard
//! counts both in its *L2 epoch*; a prefetch of another epoch is ignored and the walk reads L2
//! itself, as it does for blocks past the prefetch's end.

use super::Shard;
use super::spill::ReadThroughStats;
use crate::spill::{L2ReadError, L2Reader, StoredBlock};
use hashbrown::HashMap;
use std::sync::Arc;

/// The blocks a lookup needs from L2, and what to read them with (no borrow of the shard).
pub struct L2Plan {
    l2: Arc<dyn L2Reader>,
    shard: u16,
    stats: Arc<ReadThroughStats>,
    epoch: u64,
    keys: Vec<u64>,
}

/// Rows read by an [`L2Plan`]: `None` for a block L2 does not hold (or could not read: a
/// lookup degrades to a shorter match rather than failing).
pub struct L2Prefetch {
    epoch: u64,
    rows: HashMap<u64, Option<StoredBlock>>,
}

impl L2Plan {
    /// Reads the planned rows, in query order, up to the first one L2 lacks.
    pub fn read(self) -> L2Prefetch {
        let mut rows = HashMap::with_capacity(self.keys.len());
        for &key in &self.keys {
            let row = read_counted(&*self.l2, self.shard, &self.stats, key).unwrap_or(None);
            let last = row.is_none();
            rows.insert(key, row);
            if last {
                break;
            }
        }
        L2Prefetch {
            epoch: self.epoch,
            rows,
        }
    }

    /// How many blocks the plan would read (at most).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// One point read of block `key`, counted in `stats`.
pub(super) fn read_counted(
    l2: &dyn L2Reader,
    shard: u16,
    stats: &Arc<ReadThroughStats>,
    key: u64,
) -> Result<Option<StoredBlock>, L2ReadError> {
    count_read(stats, l2.block(shard, key))
}

/// Counts block read `r` in `stats`.
pub(super) fn count_read(
    stats: &ReadThroughStats,
    r: Result<Option<StoredBlock>, L2ReadError>,
) -> Result<Option<StoredBlock>, L2ReadError> {
    use std::sync::atomic::Ordering::Relaxed;
    stats.l2_reads.fetch_add(1, Relaxed);
    match &r {
        Ok(Some(_)) => {
            stats.l2_hits.fetch_add(1, Relaxed);
        }
        Ok(None) => {}
        Err(_) => {
            stats.l2_read_errors.fetch_add(1, Relaxed);
        }
    }
    r
}

impl Shard {
    /// Step 1 (under the read lock): the blocks of `keys` a lookup would read from L2, or
    /// `None` when it reads none (nothing spilled, or every block it reaches is resident).
    pub fn l2_plan(&self, keys: &[u64]) -> Option<L2Plan> {
        let t = self.spill.as_deref().filter(|t| t.spilled)?;
        let mut missing = Vec::new();
        for &key in keys {
            if self.table.blocks.get(key).is_some() {
                continue;
            }
            if self.block_pending(key) {
                // Removed since the last commit: nobody holds it, the walk ends here.
                break;
            }
            missing.push(key);
        }
        (!missing.is_empty()).then(|| L2Plan {
            l2: t.l2.clone(),
            shard: t.shard,
            stats: t.stats.clone(),
            epoch: t.epoch,
            keys: missing,
        })
    }

    /// Step 3: what `pre` says of block `key`, if it still holds and covers the block: the
    /// row (`Some(None)`: no row). `None`: read L2 for it.
    pub(super) fn prefetched<'p>(
        &self,
        pre: Option<&'p L2Prefetch>,
        key: u64,
    ) -> Option<Option<&'p StoredBlock>> {
        let pre = pre?;
        let t = self.spill.as_deref()?;
        if pre.epoch != t.epoch {
            return None;
        }
        pre.rows.get(&key).map(Option::as_ref)
    }
}
