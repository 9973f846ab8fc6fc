//! The checkpoint commit: one shard's changed rows and the source offsets they cover, in one
//! atomic `WriteBatch` (see the offsets contract in the module docs of `store`).

use super::codec::*;
use super::{Store, StoreError};
use crate::index::{BlockChange, ChangeSet};
use rocksdb::WriteBatch;

impl Store {
    /// Persists `changes` of `shard` and the `(source, source partition, next offset)` it has
    /// been delivered up to, in one atomic `WriteBatch` (plus the registry rows of engines and
    /// partitions seen for the first time). On error nothing of it is applied and the
    /// in-memory index is untouched: hand the set back with [`Shard::requeue_changes`] and
    /// retry later (the offsets are re-sent with the next commit anyway).
    pub fn commit(
        &self,
        shard: u16,
        changes: &ChangeSet,
        offsets: &[(String, i32, i64)],
    ) -> Result<(), StoreError> {
        self.check_shard(shard)?;
        #[cfg(any(test, feature = "testing"))]
        if let Some(fault) = self.faults.take_fault() {
            return Err(StoreError::InjectedFault(format!("{fault:?}")));
        }
        let (blocks, maps, offsets_cf, meta) = (
            self.cf(CF_BLOCKS)?,
            self.cf(CF_MAPS)?,
            self.cf(CF_OFFSETS)?,
            self.cf(CF_META)?,
        );
        let mut batch = WriteBatch::default();

        let mut reg = self.registry.lock();
        let engine_ids: Vec<u32> = changes
            .engine_names
            .iter()
            .map(|n| reg.engines.id_or_insert(n))
            .collect();
        let partition_ids: Vec<u32> = changes
            .partitions
            .iter()
            .map(|p| reg.partitions.id_or_insert(p))
            .collect();
        // Ids without durable rows: write them in this batch and keep the registry locked until
        // it is written, so no other shard's batch can use them first (see registry.rs).
        let new_ids = reg.has_unwritten();
        if new_ids {
            for (id, name) in reg.engines.unwritten() {
                batch.put_cf(meta, id_key(TAG_ENGINE_BY_ID, id), name.as_bytes());
                batch.put_cf(
                    meta,
                    tagged(TAG_ENGINE_BY_NAME, name.as_bytes()),
                    id.to_be_bytes(),
                );
            }
            for (id, key) in reg.partitions.unwritten() {
                let enc = encode_partition(key);
                batch.put_cf(meta, id_key(TAG_PARTITION_BY_ID, id), &enc);
                batch.put_cf(meta, tagged(TAG_PARTITION_BY_KEY, &enc), id.to_be_bytes());
            }
        }
        let reg = new_ids.then_some(reg);

        // Shard-local ids come from the shard the set was taken from; an id outside its name
        // tables is a caller bug (a set from another shard), reported rather than panicking.
        let bad = || StoreError::Corrupt {
            what: "change set",
            detail: format!("shard {shard}: an engine or partition id outside its name tables"),
        };
        let eng = |e: u32| engine_ids.get(e as usize).copied().ok_or_else(bad);
        let part = |p: u32| partition_ids.get(p as usize).copied().ok_or_else(bad);

        for &p in &changes.new_partitions {
            batch.put_cf(
                meta,
                shard_row_key(TAG_SHARD_PARTITION, shard, part(p)?),
                b"",
            );
        }
        let mut value = Vec::with_capacity(64);
        for e in &changes.engines {
            value.clear();
            value.extend_from_slice(&e.last_seen_us.to_be_bytes());
            for &p in &e.partitions {
                value.extend_from_slice(&part(p)?.to_be_bytes());
            }
            batch.put_cf(
                meta,
                shard_row_key(TAG_SHARD_ENGINE, shard, eng(e.engine)?),
                &value,
            );
        }
        // Range deletes of cleared maps first: map entries re-added after the clear follow.
        for &(e, p) in &changes.cleared {
            let prefix = map_prefix(shard, eng(e)?, part(p)?);
            match prefix_end(&prefix) {
                Some(end) => batch.delete_range_cf(maps, &prefix[..], &end[..]),
                None => return Err(bad()),
            }
        }
        // Rows go into the batch in key order: RocksDB's memtable (a skip list) then inserts
        // each next to the previous one instead of searching from the top, which made random
        // order the largest cost of a commit (perf: ~60% of a shard worker under ingest load).
        let mut map_rows = changes
            .maps
            .iter()
            .map(|m| {
                Ok((
                    map_key(shard, eng(m.engine)?, part(m.partition)?, m.hash),
                    m.block,
                ))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        map_rows.sort_unstable_by_key(|row| row.0);
        for (key, block) in &map_rows {
            match block {
                Some(b) => batch.put_cf(maps, key, b.to_be_bytes()),
                None => batch.delete_cf(maps, key),
            }
        }
        let mut block_rows: Vec<&BlockChange> = changes.blocks.iter().collect();
        block_rows.sort_unstable_by_key(|b| b.key);
        for b in block_rows {
            let key = block_key(shard, b.key);
            let holders = changes.holders_of(b);
            if holders.is_empty() {
                batch.delete_cf(blocks, key);
                continue;
            }
            value.clear();
            value.extend_from_slice(&part(b.partition)?.to_be_bytes());
            for &(e, tier) in holders {
                push_holder(&mut value, eng(e)?, tier);
            }
            batch.put_cf(blocks, key, &value);
        }
        for (source, partition, next) in offsets {
            offset_key(shard, source, *partition, &mut value);
            batch.put_cf(offsets_cf, &value, next.to_be_bytes());
        }

        let written = self.db.write_opt(batch, &self.write_opts);
        if let (Some(mut reg), Ok(())) = (reg, &written) {
            reg.engines.mark_written();
            reg.partitions.mark_written();
        }
        Ok(written?)
    }
}
