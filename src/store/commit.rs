//! The checkpoint commit: one shard's changed rows and the source offsets they cover, in one
//! atomic `WriteBatch` (see the offsets contract in the module docs of `store`).

use super::codec::*;
use super::registry::{Ids, Registry};
use super::{Store, StoreError};
use crate::index::{BlockChange, ChangeSet, Shard};
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
        // Durable ids by shard-local id: allocated for live engines and partitions, looked up
        // (never allocated) for those this set retires, `NO_ID` where there is none.
        let mut engine_ids: Vec<u32> = changes
            .engine_names
            .iter()
            .map(|n| n.as_ref().map_or(NO_ID, |n| reg.engines.id_or_insert(n)))
            .collect();
        let mut partition_ids: Vec<u32> = changes
            .partitions
            .iter()
            .map(|p| p.as_ref().map_or(NO_ID, |p| reg.partitions.id_or_insert(p)))
            .collect();
        for (e, name) in &changes.retired_engines {
            if let (Some(slot), Some(id)) = (engine_ids.get_mut(*e as usize), reg.engines.id(name))
            {
                *slot = id;
            }
        }
        for (p, key) in &changes.retired_partitions {
            if let (Some(slot), Some(id)) =
                (partition_ids.get_mut(*p as usize), reg.partitions.id(key))
            {
                *slot = id;
            }
        }

        // Shard-local ids come from the shard the set was taken from; an id outside its name
        // tables is a caller bug (a set from another shard), reported rather than panicking.
        let bad = || StoreError::Corrupt {
            what: "change set",
            detail: format!("shard {shard}: an engine or partition id outside its name tables"),
        };
        let id_of = |ids: &[u32], local: u32| match ids.get(local as usize) {
            Some(&NO_ID) => Ok(None),
            Some(&id) => Ok(Some(id)),
            None => Err(bad()),
        };
        // A row written must name durable ids; a row deleted whose engine or partition never
        // had one was never written either.
        let eng = |e: u32| id_of(&engine_ids, e)?.ok_or_else(bad);
        let part = |p: u32| id_of(&partition_ids, p)?.ok_or_else(bad);

        // The shard rows this batch adds and deletes, and the ids it releases.
        let ids = ShardRows::new(&reg, shard, changes, &engine_ids, &partition_ids);
        // Ids without durable rows: write them in this batch and keep the registry locked until
        // it is written, so no other shard's batch can use them first (see registry.rs). The
        // same holds for a batch that adds or deletes shard rows: the row counts stay exact.
        let hold = reg.has_unwritten() || !ids.is_empty();
        if reg.has_unwritten() {
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
        // After the puts above: an id allocated and released before its rows were written.
        for &id in &ids.engines.released {
            if let Some(name) = reg.engines.key(id) {
                batch.delete_cf(meta, id_key(TAG_ENGINE_BY_ID, id));
                batch.delete_cf(meta, tagged(TAG_ENGINE_BY_NAME, name.as_bytes()));
            }
        }
        for &id in &ids.partitions.released {
            if let Some(key) = reg.partitions.key(id) {
                batch.delete_cf(meta, id_key(TAG_PARTITION_BY_ID, id));
                batch.delete_cf(meta, tagged(TAG_PARTITION_BY_KEY, &encode_partition(key)));
            }
        }
        for &id in &ids.engines.left {
            batch.delete_cf(meta, shard_row_key(TAG_SHARD_ENGINE, shard, id));
        }
        for &id in &ids.partitions.left {
            batch.delete_cf(meta, shard_row_key(TAG_SHARD_PARTITION, shard, id));
        }
        let reg = hold.then_some(reg);

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
            let (Some(e), Some(p)) = (id_of(&engine_ids, e)?, id_of(&partition_ids, p)?) else {
                continue; // never committed: no row to delete
            };
            let prefix = map_prefix(shard, e, p);
            match prefix_end(&prefix) {
                Some(end) => batch.delete_range_cf(maps, &prefix[..], &end[..]),
                None => return Err(bad()),
            }
        }
        // Rows go into the batch in key order: RocksDB's memtable (a skip list) then inserts
        // each next to the previous one instead of searching from the top, which made random
        // order the largest cost of a commit (perf: ~60% of a shard worker under ingest load).
        let mut map_rows = Vec::with_capacity(changes.maps.len());
        for m in &changes.maps {
            let ids = (
                id_of(&engine_ids, m.engine)?,
                id_of(&partition_ids, m.partition)?,
            );
            match (ids, m.block) {
                ((Some(e), Some(p)), block) => {
                    map_rows.push((map_key(shard, e, p, m.hash), block));
                }
                (_, None) => {} // never committed: no row to delete
                (_, Some(_)) => return Err(bad()),
            }
        }
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

        crate::util::crash_point("commit.built");
        let written = self.db.write_opt(batch, &self.write_opts);
        if let (Some(mut reg), Ok(())) = (reg, &written) {
            reg.engines.mark_written();
            reg.partitions.mark_written();
            ids.engines.record(&mut reg.engines, shard);
            ids.partitions.record(&mut reg.partitions, shard);
        }
        Ok(written?)
    }
}

impl Store {
    /// What a shard does once [`Store::commit`] of `changes` (taken from it) succeeded: frees
    /// the slots the set retired ([`Shard::reclaim`]), then learns the durable ids of engines
    /// and partitions that just got them, so it can read and write their L2 rows.
    pub fn after_commit(&self, shard: &mut Shard, changes: &ChangeSet) {
        shard.reclaim(changes);
        if !shard.lacks_durable_ids() {
            return;
        }
        let (engines, partitions) = self.durable_ids(&changes.engine_names, &changes.partitions);
        for (local, durable) in engines {
            shard.learn_durable_engine(local, durable);
        }
        for (local, durable) in partitions {
            shard.learn_durable_partition(local, durable);
        }
    }
}

/// No durable id (a free or never-committed slot).
const NO_ID: u32 = u32::MAX;

/// The shard rows (engine or partition) one commit adds and deletes in one id space, and the
/// ids it releases (see `registry.rs`).
#[derive(Default)]
struct RowChanges {
    joined: Vec<u32>,
    left: Vec<u32>,
    released: Vec<u32>,
}

impl RowChanges {
    /// `written`: ids of rows the batch writes; `retired`: ids of slots it retires.
    fn new<K: std::hash::Hash + Eq + Clone>(
        ids: &Ids<K>,
        shard: u16,
        written: impl Iterator<Item = u32>,
        retired: impl Iterator<Item = u32>,
    ) -> RowChanges {
        let mut c = RowChanges::default();
        for id in written {
            // An id listed twice is counted once (`Ids::add_row` records each row once).
            if !ids.has_row(shard, id) {
                c.joined.push(id);
            }
        }
        for id in retired {
            let row = ids.has_row(shard, id);
            if row {
                c.left.push(id);
            }
            // The last row naming it goes (or none ever did): the id is released.
            if ids.users(id) == u32::from(row) {
                c.released.push(id);
            }
        }
        c
    }

    /// Once the batch is written: the registry's row counts, and the released ids.
    fn record<K: std::hash::Hash + Eq + Clone>(&self, ids: &mut Ids<K>, shard: u16) {
        for &id in &self.joined {
            ids.add_row(shard, id);
        }
        for &id in &self.left {
            ids.remove_row(shard, id);
        }
        for &id in &self.released {
            ids.release(id);
        }
    }
}

/// [`RowChanges`] of one commit, for engines and partitions.
struct ShardRows {
    engines: RowChanges,
    partitions: RowChanges,
}

impl ShardRows {
    fn new(
        reg: &Registry,
        shard: u16,
        changes: &ChangeSet,
        engine_ids: &[u32],
        partition_ids: &[u32],
    ) -> ShardRows {
        let known =
            |ids: &[u32], local: u32| ids.get(local as usize).copied().filter(|&i| i != NO_ID);
        ShardRows {
            engines: RowChanges::new(
                &reg.engines,
                shard,
                changes
                    .engines
                    .iter()
                    .filter_map(|e| known(engine_ids, e.engine)),
                changes
                    .retired_engines
                    .iter()
                    .filter_map(|(e, _)| known(engine_ids, *e)),
            ),
            partitions: RowChanges::new(
                &reg.partitions,
                shard,
                changes
                    .new_partitions
                    .iter()
                    .filter_map(|&p| known(partition_ids, p)),
                changes
                    .retired_partitions
                    .iter()
                    .filter_map(|(p, _)| known(partition_ids, *p)),
            ),
        }
    }

    fn is_empty(&self) -> bool {
        [&self.engines, &self.partitions]
            .iter()
            .all(|c| c.joined.is_empty() && c.left.is_empty() && c.released.is_empty())
    }
}
