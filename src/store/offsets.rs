//! The offsets rows: per (shard, source, source partition), the next offset the shard has made
//! durable, written in the same batch as the index rows they cover (`commit.rs`), and the
//! operations the pipeline needs: the resume point, a shard's skip table, beginning and
//! forgetting partitions.
//!
//! # The contract (for the pipeline)
//! Offsets are *next* offsets (last applied + 1), per (shard, source, source partition).
//! - Every shard must write a row for every (source, partition) it has been *delivered up to*,
//!   including batches of which no event routed to it: the pipeline tells each shard the
//!   offsets of every batch it routes, and the shard commits them with its next changes. A
//!   shard whose row lags (it saw nothing of the partition for a while) would otherwise hold
//!   the minimum back and make a restart re-read more than needed.
//! - Before routing the first batch of a (source, partition) in a process, the pipeline calls
//!   [`Store::begin_partition`], which writes, in one batch, a row for every shard that has
//!   none. So either every shard has a row for a partition or none has, and the minimum in
//!   [`Store::next_offset`] can never skip events of a shard that had not committed yet.
//! - At restart the source seeks to [`Store::next_offset`] (`None`: nothing checkpointed; use
//!   the configured start), and each shard skips events at offsets below its own
//!   [`Store::shard_offset`], so nothing is applied twice and nothing is lost.

use super::codec::*;
use super::{Store, StoreError};
use rocksdb::WriteBatch;

impl Store {
    /// Where the source resumes (source partition `partition` of `source`): the minimum over
    /// shards of their next offsets, `None` if no shard has checkpointed it. See the module
    /// docs for why every shard has a row once any has.
    pub fn next_offset(&self, source: &str, partition: i32) -> Result<Option<i64>, StoreError> {
        let mut min: Option<i64> = None;
        for shard in 0..self.shards {
            if let Some(o) = self.shard_offset(shard, source, partition)? {
                min = Some(min.map_or(o, |m| m.min(o)));
            }
        }
        Ok(min)
    }

    /// The next offset `shard` has persisted for (source, partition): at restart the shard
    /// skips events at offsets below it (they are in its loaded state already).
    pub fn shard_offset(
        &self,
        shard: u16,
        source: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        self.check_shard(shard)?;
        self.read_fault()?;
        let mut key = Vec::with_capacity(8 + source.len());
        offset_key(shard, source, partition, &mut key);
        match self.db.get_pinned_cf(self.cf(CF_OFFSETS)?, &key)? {
            Some(v) => Ok(Some(i64_at(&v, 0).ok_or_else(|| corrupt("offset", &v))?)),
            None => Ok(None),
        }
    }

    /// Every (source, partition, next offset) `shard` has persisted, for its skip table.
    pub fn shard_offsets(&self, shard: u16) -> Result<Vec<(String, i32, i64)>, StoreError> {
        self.check_shard(shard)?;
        let mut out = Vec::new();
        self.scan(CF_OFFSETS, &shard.to_be_bytes(), |k, v| {
            let bad = || corrupt("offset key", k);
            let len = u16_at(k, 2).ok_or_else(bad)? as usize;
            let source = k.get(4..4 + len).ok_or_else(bad)?;
            let source = std::str::from_utf8(source).map_err(|_| bad())?;
            let partition = u32_at(k, 4 + len).ok_or_else(bad)? as i32;
            let next = i64_at(v, 0).ok_or_else(|| corrupt("offset", v))?;
            out.push((source.to_string(), partition, next));
            Ok(())
        })?;
        Ok(out)
    }

    /// Writes, in one batch, `next_offset` as the row of every shard that has no row for
    /// (source, partition) yet. The pipeline calls it before routing the first batch of a
    /// partition in a process, with that batch's first offset; shards that already have a row
    /// keep it. Returns how many rows it wrote.
    pub fn begin_partition(
        &self,
        source: &str,
        partition: i32,
        next_offset: i64,
    ) -> Result<usize, StoreError> {
        let cf = self.cf(CF_OFFSETS)?;
        let mut batch = WriteBatch::default();
        let mut key = Vec::with_capacity(8 + source.len());
        let mut wrote = 0;
        for shard in 0..self.shards {
            offset_key(shard, source, partition, &mut key);
            if self.db.get_pinned_cf(cf, &key)?.is_none() {
                batch.put_cf(cf, &key, next_offset.to_be_bytes());
                wrote += 1;
            }
        }
        if wrote > 0 {
            self.db.write_opt(batch, &self.write_opts)?;
        }
        Ok(wrote)
    }

    /// Deletes every shard's row for (source, partition), in one batch: the partition is
    /// forgotten, as if never checkpointed. Used when a checkpoint is abandoned
    /// (`reset_on_divergence`): the pipeline first makes sure no shard has an uncommitted row
    /// for it, and the next batch of the partition calls [`Store::begin_partition`] again.
    pub fn forget_partition(&self, source: &str, partition: i32) -> Result<(), StoreError> {
        let cf = self.cf(CF_OFFSETS)?;
        let mut batch = WriteBatch::default();
        let mut key = Vec::with_capacity(8 + source.len());
        for shard in 0..self.shards {
            offset_key(shard, source, partition, &mut key);
            batch.delete_cf(cf, &key);
        }
        Ok(self.db.write_opt(batch, &self.write_opts)?)
    }

    /// Deletes every row of `source` (all partitions, all shards), in one batch; returns how
    /// many there were. The embedded broker's log is new on every start, so its old offsets
    /// mean nothing: they are forgotten before the shards load their skip tables.
    pub fn forget_source(&self, source: &str) -> Result<usize, StoreError> {
        let mut keys = Vec::new();
        for shard in 0..self.shards {
            for (s, partition, _) in self.shard_offsets(shard)? {
                if s == source {
                    let mut key = Vec::new();
                    offset_key(shard, source, partition, &mut key);
                    keys.push(key);
                }
            }
        }
        if !keys.is_empty() {
            let cf = self.cf(CF_OFFSETS)?;
            let mut batch = WriteBatch::default();
            for k in &keys {
                batch.delete_cf(cf, k);
            }
            self.db.write_opt(batch, &self.write_opts)?;
        }
        Ok(keys.len())
    }
}
