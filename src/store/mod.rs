//! The durable state: every shard's rows and its source offsets in RocksDB, written together,
//! and the warm reload of the in-memory index at restart.
//!
//! # What is stored
//! Each shard commits the rows its [`ChangeSet`](crate::index::ChangeSet) names (blocks with
//! their holders, engine-map entries, engine and partition rows) and the source offsets it has
//! been delivered up to, in ONE `WriteBatch` ([`Store::commit`]). A batch is atomic, so after any crash a shard's rows
//! are exactly its state at some committed offset. Rows are current values, not deltas:
//! writing a batch twice is harmless. Layouts are in `codec.rs`; durable engine and partition
//! ids in `registry.rs`.
//!
//! # Files
//! - `mod.rs`: opening the database and checking its layout (shard count, seed);
//! - `commit.rs`: the checkpoint commit (rows + offsets in one batch);
//! - `offsets.rs`: the offsets rows and the contract below;
//! - `load.rs`: the warm reload of a shard at start (catalog first, then rows in chunks);
//! - `l2.rs`: the store as the spill's L2 (point reads, write-back rows);
//! - `codec.rs`, `registry.rs`: key/value layouts, durable engine and partition ids.
//!
//! # Offsets
//! Offsets rows and the contract the pipeline relies on: `offsets.rs`.
//!
//! # Durability
//! The WAL is always on. `sync = false` (the default) survives `kill -9`: a written batch is in
//! the OS page cache. Power-loss safety needs `sync = true` (an fsync per commit). RocksDB
//! recovers the longest consistent prefix of the WAL (point-in-time recovery), so a batch is
//! never half there, even when a power loss garbled the WAL's tail. A table file that fails
//! its checksums is never served from: opening it (footer, index) or the warm-up reading it
//! (data blocks) fails the start with RocksDB's error, which names the file.

mod codec;
mod commit;
mod l2;
mod load;
mod offsets;
mod registry;

pub use l2::{ROW_BLOCKS, ROW_MAPS, StoreSink};
pub use load::{LOAD_CHUNK, LoadTarget, ShardLoad};

use crate::event::PartitionKey;
use crate::index::SkipReason;
use codec::*;
use parking_lot::Mutex;
use registry::Registry;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DB, DBCompressionType,
    DBRecoveryMode, Options, ReadOptions, WriteBatch, WriteOptions,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why the store could not do something.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("rocksdb: {0}")]
    Rocks(#[from] rocksdb::Error),
    #[error(
        "index.shards is {configured}, but the store in {} was written with {stored} shards: set \
         index.shards = {stored}, or reshard by rebuilding the state with `kvindex replay` into an \
         empty data_dir",
        path.display()
    )]
    ShardCountMismatch {
        path: PathBuf,
        stored: u32,
        configured: u32,
    },
    #[error(
        "index.seed is {configured:#x}, but the store in {} was written with seed {stored:#x}: \
         every stored block key depends on it; set index.seed back, or rebuild the state with \
         `kvindex replay` into an empty data_dir",
        path.display()
    )]
    SeedMismatch {
        path: PathBuf,
        stored: u64,
        configured: u64,
    },
    #[error("index.shards must be between 1 and 65535 to be stored, got {0}")]
    BadShardCount(usize),
    #[error("shard {shard} is out of range: the store has {shards} shards")]
    NoSuchShard { shard: u16, shards: u16 },
    #[error("shard {0} must be empty before it is loaded")]
    ShardNotEmpty(u16),
    #[error("the load of shard {0} was stopped before it finished")]
    LoadInterrupted(u16),
    #[error("corrupt {what} in the store: {detail}")]
    Corrupt { what: &'static str, detail: String },
    /// A fault ordered through the test switchboard ([`Store::faults`]; `testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    #[error("injected L2 fault: {0}")]
    InjectedFault(String),
    #[error("restoring shard {shard}: {source}")]
    Restore {
        shard: u16,
        #[source]
        source: SkipReason,
    },
}

impl StoreError {
    /// RocksDB was busy or ran out of time (a write stall, `no_slowdown`): no verdict on the
    /// store's health, so the breaker treats it like a deadline, not a failure.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Rocks(e) if !l2::l2_error(e.clone()).is_failure())
    }
}

/// How to open a [`Store`].
#[derive(Clone, Debug)]
pub struct StoreSettings {
    /// `index.shards`: must equal what the store was created with.
    pub shards: usize,
    /// `index.seed`: must equal what the store was created with (block keys depend on it).
    pub seed: u64,
    /// fsync every commit (power-loss safety) instead of leaving the WAL in the page cache
    /// (`kill -9` safety).
    pub sync: bool,
}

/// What [`Store::load_shard`] (or a [`ShardLoad`]) restored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    pub partitions: u64,
    pub engines: u64,
    pub map_entries: u64,
    pub blocks: u64,
    pub memberships: u64,
    /// Rows counted but left in L2 because L1's load budget was full.
    pub left_in_l2: u64,
}

impl LoadStats {
    /// Adds another shard's load to this total.
    pub fn add(&mut self, other: &LoadStats) {
        self.partitions += other.partitions;
        self.engines += other.engines;
        self.map_entries += other.map_entries;
        self.blocks += other.blocks;
        self.memberships += other.memberships;
        self.left_in_l2 += other.left_in_l2;
    }
}

/// The RocksDB-backed durable state. Share it behind an `Arc`: every method takes `&self`, and
/// shards commit concurrently (RocksDB serializes the writes; only registry allocation takes a
/// lock).
pub struct Store {
    db: DB,
    path: PathBuf,
    shards: u16,
    write_opts: WriteOptions,
    /// Write-back batches: as `write_opts`, plus `no_slowdown`, so a RocksDB write stall fails
    /// the batch at once (`Incomplete`, counted as busy, not as a failure) instead of parking
    /// the shard's worker for the stall's length; the entries stay in L1 and the next pass
    /// tries again.
    writeback_opts: WriteOptions,
    /// Durable engine and partition ids. A mutex, not a lock-free map: it is held for a few
    /// hash lookups per commit, and across a write only when that write carries new ids (new
    /// engines are rare), which is what keeps an id from being used before its row is durable.
    registry: Mutex<Registry>,
    /// The fault switchboard every L2 write of the store obeys (`testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    faults: crate::spill::testing::FaultHandle,
    /// Set: every L2 *read* fails (`testing` builds only; see [`Store::fail_reads`]).
    #[cfg(any(test, feature = "testing"))]
    read_faults: std::sync::atomic::AtomicBool,
}

/// RocksDB's block cache (data blocks), shared by the column families that hold index rows.
/// Index and bloom-filter blocks stay in the table readers, outside it: caching them here too
/// (so they could be evicted) made spilled lookups' point reads 6.7× slower (BENCHMARKS.md).
const BLOCK_CACHE_BYTES: usize = 64 << 20;
/// Memtables of all column families together (RocksDB's write buffer manager): without it each
/// column family could hold two 64 MiB memtables. With the block cache, this is the fixed
/// overhead the L1 budget (`index.l1_max_bytes`) does not count.
const MEMTABLE_BYTES: usize = 64 << 20;

/// The options of a column family: LZ4 (the only codec compiled in); for the two big ones, bloom
/// filters, so point reads of absent keys (lookups and events falling through to L2) rarely
/// touch a data block, and the shared block cache.
fn cf_options(cache: Option<&Cache>) -> Options {
    let mut o = Options::default();
    o.set_compression_type(DBCompressionType::Lz4);
    o.set_bottommost_compression_type(DBCompressionType::Lz4);
    if let Some(cache) = cache {
        let mut t = BlockBasedOptions::default();
        t.set_bloom_filter(10.0, false);
        t.set_block_cache(cache);
        o.set_block_based_table_factory(&t);
    }
    o
}

impl Store {
    /// Opens (or creates) the store in `dir`, checking it was written with the same shard
    /// count and seed.
    pub fn open(dir: &Path, opts: &StoreSettings) -> Result<Store, StoreError> {
        let shards = u16::try_from(opts.shards)
            .ok()
            .filter(|&n| n > 0)
            .ok_or(StoreError::BadShardCount(opts.shards))?;
        let mut db_opts = cf_options(None);
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        // Bounds the WAL a restart after `kill -9` must replay (the offsets and meta column
        // families change little, and would otherwise keep old WAL files alive), so the time to
        // the first lookup does not grow with how much was written since the last flush.
        db_opts.set_max_total_wal_size(64 << 20);
        // A WAL whose tail was lost or garbled (a power loss before the page cache reached
        // the disk) recovers its longest consistent prefix of whole batches, so rows and the
        // offsets written with them stay together and the source is re-read from there.
        db_opts.set_wal_recovery_mode(DBRecoveryMode::PointInTime);
        db_opts.increase_parallelism(2);
        db_opts.set_db_write_buffer_size(MEMTABLE_BYTES);
        // Concurrent writers (one per shard) insert into the memtables without waiting for
        // each other's inserts to be published in sequence order: write-back of two shards at
        // once went from medians of 0.71-0.84 to 0.89-1.13 M entries/s (4 pairs, BENCHMARKS.md).
        // What it relaxes is only snapshot immutability (a snapshot, iterator or MultiGet may
        // later see a write with a lower sequence number land). Nothing here relies on it: a
        // key is still seen either before or after a write, and only once the write is in the
        // WAL; lookups read single keys, and only of entries that left L1, which they do only
        // after the write holding their value returned; a shard's index rows are written only
        // by its own worker, which is also where its scans run (or at load, with no writer);
        // and the WAL still recovers whole batches, so offsets and rows stay atomic in a crash.
        db_opts.set_unordered_write(true);
        let cache = Cache::new_lru_cache(BLOCK_CACHE_BYTES);
        let cfs = [
            (CF_BLOCKS, Some(&cache)),
            (CF_MAPS, Some(&cache)),
            (CF_OFFSETS, None),
            (CF_META, None),
        ]
        .map(|(name, cache)| ColumnFamilyDescriptor::new(name, cf_options(cache)));
        let db = DB::open_cf_descriptors(&db_opts, dir, cfs)?;
        let mut write_opts = WriteOptions::default();
        write_opts.set_sync(opts.sync);
        write_opts.disable_wal(false);
        let mut writeback_opts = WriteOptions::default();
        writeback_opts.set_sync(opts.sync);
        writeback_opts.disable_wal(false);
        writeback_opts.set_no_slowdown(true);
        let store = Store {
            db,
            path: dir.to_path_buf(),
            shards,
            write_opts,
            writeback_opts,
            registry: Mutex::new(Registry::default()),
            #[cfg(any(test, feature = "testing"))]
            faults: Default::default(),
            #[cfg(any(test, feature = "testing"))]
            read_faults: Default::default(),
        };
        store.check_layout(shards, opts.seed)?;
        store.load_registry()?;
        Ok(store)
    }

    /// Records the shard count and seed on first open; rejects a mismatch afterwards.
    fn check_layout(&self, shards: u16, seed: u64) -> Result<(), StoreError> {
        let meta = self.cf(CF_META)?;
        let stored = self.db.get_pinned_cf(meta, KEY_SHARDS)?;
        let stored_seed = self.db.get_pinned_cf(meta, KEY_SEED)?;
        match (stored, stored_seed) {
            (Some(s), Some(sd)) => {
                let s = u32_at(&s, 0).ok_or_else(|| corrupt("shard count", &s))?;
                if s != shards as u32 {
                    return Err(StoreError::ShardCountMismatch {
                        path: self.path.clone(),
                        stored: s,
                        configured: shards as u32,
                    });
                }
                let sd = u64_at(&sd, 0).ok_or_else(|| corrupt("seed", &sd))?;
                if sd != seed {
                    return Err(StoreError::SeedMismatch {
                        path: self.path.clone(),
                        stored: sd,
                        configured: seed,
                    });
                }
                Ok(())
            }
            _ => {
                let mut b = WriteBatch::default();
                b.put_cf(meta, KEY_SHARDS, (shards as u32).to_be_bytes());
                b.put_cf(meta, KEY_SEED, seed.to_be_bytes());
                Ok(self.db.write_opt(b, &self.write_opts)?)
            }
        }
    }

    fn load_registry(&self) -> Result<(), StoreError> {
        let mut reg = self.registry.lock();
        self.scan(CF_META, &[TAG_ENGINE_BY_ID], |k, v| {
            let id = u32_at(k, 1).ok_or_else(|| corrupt("engine id", k))?;
            let name = std::str::from_utf8(v).map_err(|_| corrupt("engine name", v))?;
            reg.engines.load(id, Arc::from(name));
            Ok(())
        })?;
        self.scan(CF_META, &[TAG_PARTITION_BY_ID], |k, v| {
            let id = u32_at(k, 1).ok_or_else(|| corrupt("partition id", k))?;
            reg.partitions.load(id, decode_partition(v)?);
            Ok(())
        })?;
        // The shard rows naming each id, which decide when it is released (see registry.rs).
        self.load_shard_rows(TAG_SHARD_ENGINE, "engine row", &mut reg.engines)?;
        self.load_shard_rows(TAG_SHARD_PARTITION, "partition row", &mut reg.partitions)?;
        Ok(())
    }

    /// Counts the shard rows (`tag`: a shard's engine or partition rows) naming each of `ids`,
    /// then frees the ids no registry row holds.
    fn load_shard_rows<K: std::hash::Hash + Eq + Clone>(
        &self,
        tag: u8,
        what: &'static str,
        ids: &mut registry::Ids<K>,
    ) -> Result<(), StoreError> {
        self.scan(CF_META, &[tag], |k, _| {
            let (Some(shard), Some(id)) = (u16_at(k, 1), u32_at(k, 3)) else {
                return Err(corrupt(what, k));
            };
            ids.add_row(shard, id);
            Ok(())
        })?;
        ids.loaded();
        Ok(())
    }

    /// Makes `size` the durable block size of (tenant, model): written (WAL) before any
    /// event carrying it is routed, so no commit can hold such an event without its size.
    pub fn pin_block_size(&self, tenant: &str, model: &str, size: u32) -> Result<(), StoreError> {
        let meta = self.cf(CF_META)?;
        let key = tagged(
            TAG_BLOCK_SIZE,
            &encode_partition(&PartitionKey::new(tenant, model, "")),
        );
        Ok(self
            .db
            .put_cf_opt(meta, key, size.to_be_bytes(), &self.write_opts)?)
    }

    /// Every durable block size: (tenant, model, size).
    pub fn block_sizes(&self) -> Result<Vec<(String, String, u32)>, StoreError> {
        let mut out = Vec::new();
        self.scan(CF_META, &[TAG_BLOCK_SIZE], |k, v| {
            let key = decode_partition(&k[1..])?;
            let size = <[u8; 4]>::try_from(v)
                .map(u32::from_be_bytes)
                .map_err(|_| corrupt("block size", v))?;
            out.push((key.tenant, key.model, size));
            Ok(())
        })?;
        Ok(out)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// Orders faults on the store's L2 writes: checkpoint commits and write-back batches
    /// (`testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    pub fn faults(&self) -> &crate::spill::testing::FaultHandle {
        &self.faults
    }

    /// Makes every L2 read (the index reading spilled rows) and every stored-offset read fail
    /// until turned off (`testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_reads(&self, fail: bool) {
        self.read_faults
            .store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    /// An injected read fault, if reads are set to fail.
    pub(crate) fn read_fault(&self) -> Result<(), StoreError> {
        #[cfg(any(test, feature = "testing"))]
        if self.read_faults.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::Corrupt {
                what: "injected read fault",
                detail: "Store::fail_reads".into(),
            });
        }
        Ok(())
    }

    fn cf(&self, name: &'static str) -> Result<&ColumnFamily, StoreError> {
        self.db.cf_handle(name).ok_or_else(|| StoreError::Corrupt {
            what: "column family",
            detail: format!("{name} is missing"),
        })
    }

    fn check_shard(&self, shard: u16) -> Result<(), StoreError> {
        if shard < self.shards {
            Ok(())
        } else {
            Err(StoreError::NoSuchShard {
                shard,
                shards: self.shards,
            })
        }
    }

    /// Calls `f` on every (key, value) of `cf` starting with `prefix`, in key order.
    fn scan(
        &self,
        cf: &'static str,
        prefix: &[u8],
        mut f: impl FnMut(&[u8], &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut ro = ReadOptions::default();
        if let Some(end) = prefix_end(prefix) {
            ro.set_iterate_upper_bound(end);
        }
        // A load scan reads everything once: keep it from flushing the block cache.
        ro.fill_cache(false);
        let mut it = self.db.raw_iterator_cf_opt(self.cf(cf)?, ro);
        it.seek(prefix);
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            f(k, v)?;
            it.next();
        }
        Ok(it.status()?)
    }

    /// [`Store::scan`] in chunks: `decode` turns each row into items of `chunk`, and `apply`
    /// takes (and drains) the chunk every [`LOAD_CHUNK`] rows and at the end.
    fn scan_chunks<T>(
        &self,
        cf: &'static str,
        prefix: &[u8],
        mut decode: impl FnMut(&[u8], &[u8], &mut Vec<T>) -> Result<(), StoreError>,
        mut apply: impl FnMut(&mut Vec<T>) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut chunk = Vec::with_capacity(LOAD_CHUNK);
        self.scan(cf, prefix, |k, v| {
            decode(k, v, &mut chunk)?;
            if chunk.len() >= LOAD_CHUNK {
                apply(&mut chunk)?;
            }
            Ok(())
        })?;
        if !chunk.is_empty() {
            apply(&mut chunk)?;
        }
        Ok(())
    }

    /// Flushes memtables to SST files (tests, shutdown); durability does not need it (WAL).
    /// Every column family, so a restart has no WAL to replay.
    pub fn flush(&self) -> Result<(), StoreError> {
        let cfs = [CF_BLOCKS, CF_MAPS, CF_OFFSETS, CF_META]
            .into_iter()
            .map(|name| self.cf(name))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self
            .db
            .flush_cfs_opt(&cfs, &rocksdb::FlushOptions::default())?)
    }
}
