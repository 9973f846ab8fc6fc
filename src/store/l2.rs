//! The store as the index's L2: point reads of block and engine-map rows for shards that
//! spilled part of their state ([`L2Reader`]), the rows write-back writes, and the
//! [`StoreSink`] the spill controller writes them through (one `WriteBatch` per batch, in
//! the same database and column families as the checkpoint commits).
//!
//! Write-back rows are tagged with their column family in the first byte of [`L2Row::key`]
//! (`b'b'` blocks, `b'm'` maps), then the key in the layout of `codec.rs`.

use super::codec::*;
use super::{Store, StoreError};
use crate::event::{PartitionKey, TierSet};
use crate::spill::{L2Error, L2ReadError, L2Reader, L2Row, L2Sink, StoredBlock};
use rocksdb::WriteBatch;
use std::sync::Arc;
use std::time::Instant;

/// First byte of a write-back row key: the row belongs to the blocks column family.
pub const ROW_BLOCKS: u8 = b'b';
/// First byte of a write-back row key: the row belongs to the engine-maps column family.
pub const ROW_MAPS: u8 = b'm';

fn read_error(e: StoreError) -> L2ReadError {
    L2ReadError(e.to_string())
}

/// A RocksDB error as the spill seam reports it: busy refusals apart from real failures.
pub(super) fn l2_error(e: rocksdb::Error) -> L2Error {
    use rocksdb::ErrorKind;
    match e.kind() {
        ErrorKind::Busy | ErrorKind::TryAgain | ErrorKind::Incomplete | ErrorKind::TimedOut => {
            L2Error::Busy(Box::new(e))
        }
        _ => L2Error::Failed(Box::new(e)),
    }
}

impl Store {
    /// Block `key` of `shard`, read with `opts`.
    fn read_block(
        &self,
        shard: u16,
        key: u64,
        opts: &rocksdb::ReadOptions,
    ) -> Result<Option<StoredBlock>, StoreError> {
        self.read_fault()?;
        let cf = self.cf(CF_BLOCKS)?;
        let Some(v) = self.db.get_pinned_cf_opt(cf, block_key(shard, key), opts)? else {
            return Ok(None);
        };
        let (partition, holders) = decode_block(&v)?;
        Ok(Some(StoredBlock {
            partition,
            holders: holders.collect(),
        }))
    }
}

impl L2Reader for Store {
    fn block(&self, shard: u16, key: u64) -> Result<Option<StoredBlock>, L2ReadError> {
        self.read_block(shard, key, &rocksdb::ReadOptions::default())
            .map_err(read_error)
    }

    fn block_if_cached(
        &self,
        shard: u16,
        key: u64,
    ) -> Option<Result<Option<StoredBlock>, L2ReadError>> {
        // RocksDB answers from its memtables, block cache and the table readers' filters, and
        // reports `Incomplete` where it would have had to read a file.
        let mut memory_only = rocksdb::ReadOptions::default();
        memory_only.set_read_tier(rocksdb::ReadTier::BlockCache);
        match self.read_block(shard, key, &memory_only) {
            Err(StoreError::Rocks(e)) if e.kind() == rocksdb::ErrorKind::Incomplete => None,
            r => Some(r.map_err(read_error)),
        }
    }

    fn map_entry(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        hash: u64,
    ) -> Result<Option<u64>, L2ReadError> {
        self.read_fault().map_err(read_error)?;
        let cf = self.cf(CF_MAPS).map_err(read_error)?;
        let key = map_key(shard, engine, partition, hash);
        match self
            .db
            .get_pinned_cf(cf, key)
            .map_err(|e| read_error(e.into()))?
        {
            None => Ok(None),
            Some(v) => u64_at(&v, 0)
                .map(Some)
                .ok_or_else(|| read_error(corrupt("map value", &v))),
        }
    }

    fn map_entries(
        &self,
        shard: u16,
        engine: u32,
        partition: u32,
        each: &mut dyn FnMut(u64, u64),
    ) -> Result<(), L2ReadError> {
        self.read_fault().map_err(read_error)?;
        self.scan(CF_MAPS, &map_prefix(shard, engine, partition), |k, v| {
            let (Some(hash), Some(block)) = (u64_at(k, 10), u64_at(v, 0)) else {
                return Err(corrupt("map row", k));
            };
            each(hash, block);
            Ok(())
        })
        .map_err(read_error)
    }

    fn block_row(&self, shard: u16, key: u64, partition: u32, holders: &[(u32, TierSet)]) -> L2Row {
        let mut value = Vec::with_capacity(4 + 5 * holders.len());
        value.extend_from_slice(&partition.to_be_bytes());
        for &(e, tier) in holders {
            push_holder(&mut value, e, tier);
        }
        L2Row::put(tagged(ROW_BLOCKS, &block_key(shard, key)), value)
    }

    fn map_row(&self, shard: u16, engine: u32, partition: u32, hash: u64, block: u64) -> L2Row {
        L2Row::put(
            tagged(ROW_MAPS, &map_key(shard, engine, partition, hash)),
            block.to_be_bytes(),
        )
    }
}

/// A stored row: (key, value).
pub type KeyValue = (Vec<u8>, Vec<u8>);

/// `(shard-local id, durable id)` pairs, as [`Store::durable_ids`] returns them.
pub type IdPairs = Vec<(u32, u32)>;

impl Store {
    /// The durable ids of the engines and partitions named (by shard-local index; `None`: a free
    /// slot), for those whose registry rows are written: `(local, durable)` pairs.
    pub fn durable_ids(
        &self,
        engines: &[Option<Arc<str>>],
        partitions: &[Option<PartitionKey>],
    ) -> (IdPairs, IdPairs) {
        let reg = self.registry.lock();
        let e = engines
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((i as u32, reg.engines.written_id(n.as_ref()?)?)))
            .collect();
        let p = partitions
            .iter()
            .enumerate()
            .filter_map(|(i, k)| Some((i as u32, reg.partitions.written_id(k.as_ref()?)?)))
            .collect();
        (e, p)
    }

    /// Engine names and partition keys with a durable id (diagnostics and tests: after a
    /// reopen, the registry rows on disk).
    pub fn durable_names(&self) -> (usize, usize) {
        let reg = self.registry.lock();
        (reg.engines.len(), reg.partitions.len())
    }

    /// RocksDB's estimate of the block and engine-map rows stored (the L2 entry count).
    pub fn l2_entries(&self) -> u64 {
        [CF_BLOCKS, CF_MAPS]
            .into_iter()
            .filter_map(|name| {
                let cf = self.cf(name).ok()?;
                self.db
                    .property_int_value_cf(cf, "rocksdb.estimate-num-keys")
                    .ok()?
            })
            .sum()
    }

    /// The value L2 holds for a tagged row key (see the module docs), as write-back wrote it
    /// (diagnostics and tests).
    pub fn l2_row(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let cf = match key.first() {
            Some(&ROW_BLOCKS) => self.cf(CF_BLOCKS)?,
            Some(&ROW_MAPS) => self.cf(CF_MAPS)?,
            _ => return Ok(None),
        };
        Ok(self.db.get_cf(cf, &key[1..])?)
    }

    /// Every block and engine-map row, by tagged key in key order (diagnostics and tests; a
    /// full scan).
    pub fn l2_rows(&self) -> Result<Vec<KeyValue>, StoreError> {
        let mut rows = Vec::new();
        for (tag, cf) in [(ROW_BLOCKS, CF_BLOCKS), (ROW_MAPS, CF_MAPS)] {
            self.scan(cf, &[], |k, v| {
                rows.push((tagged(tag, k), v.to_vec()));
                Ok(())
            })?;
        }
        Ok(rows)
    }

    /// Writes tagged write-back rows (see the module docs) in one atomic batch.
    pub fn write_rows(&self, rows: &[L2Row]) -> Result<(), L2Error> {
        let blocks = self
            .cf(CF_BLOCKS)
            .map_err(|e| L2Error::Unplaceable(e.to_string()))?;
        let maps = self
            .cf(CF_MAPS)
            .map_err(|e| L2Error::Unplaceable(e.to_string()))?;
        let mut batch = WriteBatch::default();
        for row in rows {
            let cf = match row.key.first() {
                Some(&ROW_BLOCKS) => blocks,
                Some(&ROW_MAPS) => maps,
                _ => {
                    return Err(L2Error::Unplaceable(format!(
                        "row key {} names no column family",
                        hex::encode(&row.key)
                    )));
                }
            };
            let key = &row.key[1..];
            match &row.value {
                Some(v) => batch.put_cf(cf, key, v),
                None => batch.delete_cf(cf, key),
            }
        }
        self.db
            .write_opt(batch, &self.writeback_opts)
            .map_err(l2_error)
    }
}

/// The spill controller's L2: the store itself.
#[derive(Clone)]
pub struct StoreSink {
    store: Arc<Store>,
}

impl StoreSink {
    pub fn new(store: Arc<Store>) -> StoreSink {
        StoreSink { store }
    }

    /// The store it writes to.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// A store of its own in `dir` (one shard), as an L2: for tests and benches of the spill
    /// controller over the production L2 (`testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    pub fn open_scratch(dir: &std::path::Path) -> Result<StoreSink, StoreError> {
        let settings = super::StoreSettings {
            shards: 1,
            seed: 0,
            sync: false,
        };
        Ok(StoreSink::new(Arc::new(Store::open(dir, &settings)?)))
    }
}

impl L2Sink for StoreSink {
    fn write_batch(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        #[cfg(any(test, feature = "testing"))]
        return self
            .store
            .faults
            .intercept(rows, deadline, |rows| self.write_now(rows, deadline));
        #[cfg(not(any(test, feature = "testing")))]
        self.write_now(rows, deadline)
    }
}

impl StoreSink {
    fn write_now(&self, rows: &[L2Row], deadline: Instant) -> Result<(), L2Error> {
        // A RocksDB write cannot be cut short once started: only do not start one late.
        if Instant::now() >= deadline {
            return Err(L2Error::DeadlineExceeded {
                waited: std::time::Duration::ZERO,
            });
        }
        self.store.write_rows(rows)
    }
}
