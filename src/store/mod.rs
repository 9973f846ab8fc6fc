//! The durable state: every shard's rows and its source offsets in RocksDB, written together,
//! and the warm reload of the in-memory index at restart.
//!
//! # What is stored
//! Each shard commits the rows its [`ChangeSet`] names (blocks with their holders, engine-map
//! entries, engine and partition rows) and the source offsets it has been delivered up to, in
//! ONE `WriteBatch` ([`Store::commit`]). A batch is atomic, so after any crash a shard's rows
//! are exactly its state at some committed offset. Rows are current values, not deltas:
//! writing a batch twice is harmless. Layouts are in `codec.rs`; durable engine and partition
//! ids in `registry.rs`.
//!
//! # Offsets contract (for the pipeline)
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
//!
//! # Durability
//! The WAL is always on. `sync = false` (the default) survives `kill -9`: a written batch is in
//! the OS page cache. Power-loss safety needs `sync = true` (an fsync per commit). RocksDB
//! recovers a prefix of the WAL, so a batch is never half there.

mod codec;
mod l2;
mod registry;

pub use l2::StoreSink;

use crate::event::{PartitionKey, Tier};
use crate::index::holders::EngineIdx;
use crate::index::shard::{BLOCK_ENTRY_BYTES, MAP_ENTRY_BYTES};
use crate::index::{BlockChange, ChangeSet, Shard, SkipReason};
use codec::*;
use parking_lot::Mutex;
use registry::Registry;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DB, DBCompressionType, Options,
    ReadOptions, WriteBatch, WriteOptions,
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
    #[error("corrupt {what} in the store: {detail}")]
    Corrupt { what: &'static str, detail: String },
    /// A fault ordered through the write-back fault seam (tests of a failing L2).
    #[error("injected L2 fault: {0}")]
    InjectedFault(String),
    #[error("restoring shard {shard}: {source}")]
    Restore {
        shard: u16,
        #[source]
        source: SkipReason,
    },
}

/// How to open a [`Store`].
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// `index.shards`: must equal what the store was created with.
    pub shards: usize,
    /// `index.seed`: must equal what the store was created with (block keys depend on it).
    pub seed: u64,
    /// fsync every commit (power-loss safety) instead of leaving the WAL in the page cache
    /// (`kill -9` safety).
    pub sync: bool,
}

/// What [`Store::load_shard`] restored.
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

/// The RocksDB-backed durable state. Share it behind an `Arc`: every method takes `&self`, and
/// shards commit concurrently (RocksDB serializes the writes; only registry allocation takes a
/// lock).
pub struct Store {
    db: DB,
    path: PathBuf,
    shards: u16,
    write_opts: WriteOptions,
    /// Durable engine and partition ids. A mutex, not a lock-free map: it is held for a few
    /// hash lookups per commit, and across a write only when that write carries new ids (new
    /// engines are rare), which is what keeps an id from being used before its row is durable.
    registry: Mutex<Registry>,
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
    pub fn open(dir: &Path, opts: &StoreOptions) -> Result<Store, StoreError> {
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
        let store = Store {
            db,
            path: dir.to_path_buf(),
            shards,
            write_opts,
            registry: Mutex::new(Registry::default()),
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
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn shards(&self) -> u16 {
        self.shards
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

    /// Rebuilds `shard`'s in-memory state into `into` (an empty shard) from its rows: blocks
    /// with their holders and tiers, engine maps, engines (liveness, partitions) and partition
    /// counters, so lookups, stats and engines after a restart equal those before it. Enable
    /// change tracking on `into` afterwards. Shards load independently (in parallel if wanted).
    pub fn load_shard(&self, shard: u16, into: &mut Shard) -> Result<LoadStats, StoreError> {
        self.load_shard_bounded(shard, into, u64::MAX)
    }

    /// [`Store::load_shard`] into an L1 of `l1_budget` bytes: engine-map rows may take half
    /// of it, block rows the rest; rows beyond are counted (blocks, memberships, tiers are
    /// L1 ∪ L2 counts) but stay in L2 (`left_in_l2`), for the shard to read through.
    pub fn load_shard_bounded(
        &self,
        shard: u16,
        into: &mut Shard,
        l1_budget: u64,
    ) -> Result<LoadStats, StoreError> {
        self.check_shard(shard)?;
        if !into.is_empty() {
            return Err(StoreError::ShardNotEmpty(shard));
        }
        let mut l = Loader {
            store: self,
            shard,
            into,
            engines: hashbrown::HashMap::new(),
            partitions: hashbrown::HashMap::new(),
            stats: LoadStats::default(),
        };
        // Partitions, then engines (their rows name partitions), then maps and blocks.
        self.scan(
            CF_META,
            &shard_row_prefix(TAG_SHARD_PARTITION, shard),
            |k, _| {
                let id = u32_at(k, 3).ok_or_else(|| corrupt("partition row", k))?;
                l.partition(id).map(drop)
            },
        )?;
        let mut pids = Vec::new();
        let mut l1_bytes = 0u64;
        self.scan(
            CF_META,
            &shard_row_prefix(TAG_SHARD_ENGINE, shard),
            |k, v| {
                let id = u32_at(k, 3).ok_or_else(|| corrupt("engine row", k))?;
                let last_seen = i64_at(v, 0).ok_or_else(|| corrupt("engine row", v))?;
                if !(v.len() - 8).is_multiple_of(4) {
                    return Err(corrupt("engine row", v));
                }
                pids.clear();
                for c in v[8..].chunks_exact(4) {
                    pids.push(l.partition(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))?);
                }
                l.engine_row(id, last_seen, &pids).map(drop)
            },
        )?;
        self.scan(CF_MAPS, &shard.to_be_bytes(), |k, v| {
            let (Some(e), Some(p), Some(hash)) = (u32_at(k, 2), u32_at(k, 6), u64_at(k, 10)) else {
                return Err(corrupt("map key", k));
            };
            let block = u64_at(v, 0).ok_or_else(|| corrupt("map value", v))?;
            let (eid, pid) = (l.engine(e)?, l.partition(p)?);
            l.stats.map_entries += 1;
            if l1_bytes + MAP_ENTRY_BYTES > l1_budget / 2 {
                l.stats.left_in_l2 += 1;
                return Ok(());
            }
            l1_bytes += MAP_ENTRY_BYTES;
            l.into.restore_map_entry(eid, pid, hash, block);
            Ok(())
        })?;
        // RocksDB's estimate of the blocks column family's rows, shared evenly by the shards:
        // the block table is sized once instead of doubling ~20 times on the way.
        let estimate = self
            .db
            .property_int_value_cf(self.cf(CF_BLOCKS)?, "rocksdb.estimate-num-keys")?
            .unwrap_or(0);
        // Capped: the estimate counts overwritten rows too, and the table never shrinks. A
        // bounded load reserves only what its budget lets in: sizing the table for every row
        // in L2 would touch memory for all of them (the peak RSS of a spilled start-up).
        let fits = l1_budget.saturating_sub(l1_bytes) / BLOCK_ENTRY_BYTES;
        let per_shard = (estimate / u64::from(self.shards)).min(fits).min(1 << 26) as usize;
        l.into.reserve_blocks(per_shard);
        // Rows arrive in key order but land in random table slots: they are restored in
        // groups whose slots are prefetched first, so the cache misses overlap.
        let mut pending: Vec<(u64, u32, EngineIdx, Tier)> = Vec::with_capacity(RESTORE_GROUP * 2);
        self.scan(CF_BLOCKS, &shard.to_be_bytes(), |k, v| {
            let block = u64_at(k, 2).ok_or_else(|| corrupt("block key", k))?;
            let (p, holders) = decode_block(v)?;
            let pid = l.partition(p)?;
            l.stats.blocks += 1;
            if l1_bytes.saturating_add(BLOCK_ENTRY_BYTES) > l1_budget {
                l.stats.left_in_l2 += 1;
                for (i, (e, tier)) in holders.enumerate() {
                    let eid = l.engine(e)?;
                    l.into.count_stored_membership(pid, eid, tier, i == 0);
                    l.stats.memberships += 1;
                }
                return Ok(());
            }
            l1_bytes += BLOCK_ENTRY_BYTES;
            l.into.prefetch_block(block);
            for (e, tier) in holders {
                pending.push((block, pid, l.engine(e)?, tier));
            }
            if pending.len() >= RESTORE_GROUP {
                l.restore_memberships(&mut pending);
            }
            Ok(())
        })?;
        l.restore_memberships(&mut pending);
        Ok(l.stats)
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

/// Memberships restored per prefetched group during a reload.
const RESTORE_GROUP: usize = 16;

/// Durable id → shard-local id translation during one [`Store::load_shard`].
struct Loader<'a> {
    store: &'a Store,
    shard: u16,
    into: &'a mut Shard,
    engines: hashbrown::HashMap<u32, u32>,
    partitions: hashbrown::HashMap<u32, u32>,
    stats: LoadStats,
}

impl Loader<'_> {
    /// Restores the buffered (block, partition, engine, tier) memberships, whose block slots
    /// were prefetched as they were read.
    fn restore_memberships(&mut self, pending: &mut Vec<(u64, u32, EngineIdx, Tier)>) {
        for (block, pid, eid, tier) in pending.drain(..) {
            self.into.restore_membership(pid, eid, block, tier);
            self.stats.memberships += 1;
        }
    }

    fn partition(&mut self, id: u32) -> Result<u32, StoreError> {
        if let Some(&pid) = self.partitions.get(&id) {
            return Ok(pid);
        }
        let key: PartitionKey = self
            .store
            .registry
            .lock()
            .partitions
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("partition id", &id.to_be_bytes()))?;
        let pid = self.into.restore_partition(&key);
        self.into.learn_durable_partition(pid, id);
        self.partitions.insert(id, pid);
        self.stats.partitions += 1;
        Ok(pid)
    }

    fn engine_row(&mut self, id: u32, last_seen: i64, pids: &[u32]) -> Result<u32, StoreError> {
        let name = self
            .store
            .registry
            .lock()
            .engines
            .key(id)
            .cloned()
            .ok_or_else(|| corrupt("engine id", &id.to_be_bytes()))?;
        let eid = self
            .into
            .restore_engine(&name, last_seen, pids)
            .map_err(|source| StoreError::Restore {
                shard: self.shard,
                source,
            })?;
        self.into.learn_durable_engine(eid, id);
        if self.engines.insert(id, eid).is_none() {
            self.stats.engines += 1;
        }
        Ok(eid)
    }

    /// An engine named by a map or block row. Its engine row is written in the same batch as
    /// the rows that first use it, so it is normally loaded already; if not, it is restored
    /// with no liveness rather than failing the load.
    fn engine(&mut self, id: u32) -> Result<u32, StoreError> {
        match self.engines.get(&id) {
            Some(&eid) => Ok(eid),
            None => self.engine_row(id, 0, &[]),
        }
    }
}
