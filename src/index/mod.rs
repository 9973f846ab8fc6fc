//! The index: N shards of block memberships behind read-write locks, the shard routing rule,
//! and the lookup that merges shards into one answer.
//!
//! Shard choice: an event goes to the shard of `hash(tenant, model, engine)`. Sharding by the
//! partition key alone leaves every core but one idle in the common single-model, no-LoRA
//! deployment; keying by engine spreads even one partition over all shards. Leaving the adapter
//! out keeps every adapter partition of one engine's (tenant, model) in one shard, so the
//! adapter-agnostic events (`ALL_CLEARED`, unscoped evictions) also have exactly one shard to go
//! to, in source order, with no broadcast; and each engine's chains and hash maps live in one
//! shard, so parents resolve locally. A lookup reads every shard (their engine sets are
//! disjoint) and concatenates.

pub mod block_sizes;
pub mod changes;
pub mod hash;
pub mod holders;
pub mod l1;
pub mod shard;
pub mod table;
pub mod tiers;

pub use block_sizes::{BlockSizes, Observed, PinnedSize};
pub use changes::{BlockChange, ChangeSet, EngineChange, MapChange};
pub use l1::ShardL1;
use shard::L2Access;
pub use shard::{RawMatch, Shard, SkipReason};
pub use tiers::{TierMix, TierWeights};

use crate::event::{EngineHash, Event, PartitionKey, Tier};
use parking_lot::RwLock;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Index-wide settings.
#[derive(Clone, Debug)]
pub struct IndexSettings {
    /// Number of shards (and shard workers).
    pub shards: usize,
    /// Seed of every chain hash; all kvindex replicas that share answers must share it.
    pub seed: u64,
}

impl Default for IndexSettings {
    fn default() -> Self {
        IndexSettings::from(&crate::config::IndexConfig::default())
    }
}

/// `[index]`: `shards = 0` is the number of cores.
impl From<&crate::config::IndexConfig> for IndexSettings {
    fn from(c: &crate::config::IndexConfig) -> Self {
        let shards = match c.shards {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        IndexSettings {
            shards,
            seed: c.seed,
        }
    }
}

/// The blocks of a lookup query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueryBlocks {
    /// Token ids; every full block of `block_size` is keyed like a stored token chain.
    /// `extras` holds each block's extras digest (`event::extra`: a request's multimodal
    /// inputs and cache salt), or is empty when the request has none.
    Tokens {
        token_ids: Vec<u32>,
        block_size: u32,
        extras: Vec<u64>,
    },
    /// Raw producer hashes, as hash-only producers store them.
    Hashes(Vec<EngineHash>),
    /// Content digests, keyed like a stored digest chain (trace replays).
    Digests(Vec<u64>),
}

/// One engine in a lookup answer, owned (tests, tools). The service reads [`Answer::iter`].
#[derive(Clone, Debug, PartialEq)]
pub struct EngineMatch {
    pub engine_id: String,
    pub matched_blocks: u32,
    /// The fastest tier the engine holds its last matched block on.
    pub tier: Tier,
    /// Matched blocks held on each tier (`Tier as usize`; a block on two tiers counts twice).
    pub blocks_on: [u32; 3],
    /// The weighted prefix score, when the lookup gave [`TierWeights`].
    pub score: Option<f64>,
}

/// One row of an [`Answer`], borrowing the engine's name. Fields as in [`EngineMatch`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Match<'a> {
    pub engine_id: &'a str,
    pub matched_blocks: u32,
    pub tier: Tier,
    pub blocks_on: [u32; 3],
    pub score: Option<f64>,
}

/// Which L2 reads a lookup may make.
#[derive(Clone, Copy, PartialEq, Eq)]
enum L2Reads {
    /// Any, waiting on storage if need be.
    Any,
    /// Only those served from memory.
    MemoryOnly,
}

/// What a lookup returns and how it ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LookupOptions {
    /// The most rows (the best ones).
    pub limit: usize,
    /// Only engines kvindex applied an event of at or after this time (its own clock; an
    /// engine loaded from disk and silent since counts as heard when the index was created).
    /// `None`: every engine.
    pub heard_since_us: Option<i64>,
    /// Rank by the weighted prefix score ([`TierMix::score`]) instead of the prefix length.
    pub tier_weights: Option<TierWeights>,
}

impl Default for LookupOptions {
    fn default() -> Self {
        LookupOptions {
            limit: usize::MAX,
            heard_since_us: None,
            tier_weights: None,
        }
    }
}

/// A lookup's rows, sorted by `matched_blocks` descending (or by score, with tier weights),
/// then `engine_id` ascending.
///
/// Rows name engines by (shard, id) and the answer keeps one shared reference to each shard's
/// name list: a thousand-engine answer costs a few refcounts, not a thousand string copies.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    rows: Vec<(u16, RawMatch)>,
    names: Vec<Arc<Vec<Arc<str>>>>,
    weights: Option<TierWeights>,
}

impl Answer {
    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    /// Whether rows carry a score (the lookup gave tier weights).
    pub fn is_scored(&self) -> bool {
        self.weights.is_some()
    }
    /// Total bytes of the engine ids the rows name (to size a rendered answer).
    pub fn engine_id_bytes(&self) -> usize {
        self.rows
            .iter()
            .map(|(s, m)| self.names[*s as usize][m.engine as usize].len())
            .sum()
    }
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Match<'_>> + '_ {
        self.rows.iter().map(|(s, m)| Match {
            engine_id: &self.names[*s as usize][m.engine as usize],
            matched_blocks: m.matched,
            tier: m.tier,
            blocks_on: Tier::ALL.map(|t| m.mix.on(t, m.matched)),
            score: self.weights.map(|w| m.mix.score(m.matched, &w)),
        })
    }
    /// Owned rows.
    pub fn to_vec(&self) -> Vec<EngineMatch> {
        self.iter()
            .map(|m| EngineMatch {
                engine_id: m.engine_id.to_string(),
                matched_blocks: m.matched_blocks,
                tier: m.tier,
                blocks_on: m.blocks_on,
                score: m.score,
            })
            .collect()
    }
    /// Whether row `a` ranks before row `b` among rows of different shards: score (with
    /// weights) or prefix length descending, then engine name.
    fn ranks_before(&self, a: &(u16, RawMatch), b: &(u16, RawMatch)) -> bool {
        let by_score = self.weights.map_or(std::cmp::Ordering::Equal, |w| {
            let score = |r: &(u16, RawMatch)| r.1.mix.score(r.1.matched, &w);
            score(b).total_cmp(&score(a))
        });
        by_score
            .then_with(|| b.1.matched.cmp(&a.1.matched))
            .then_with(|| self.name(a).cmp(self.name(b)))
            .is_lt()
    }
    fn name(&self, row: &(u16, RawMatch)) -> &str {
        &self.names[row.0 as usize][row.1.engine as usize]
    }
}

/// Counts of one partition, summed over shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionStats {
    pub key: PartitionKey,
    /// Distinct blocks per shard, summed: a block held by engines on two shards counts once in
    /// each (shards split engines, not blocks). With one shard: distinct blocks.
    pub block_entries: u64,
    pub memberships: u64,
}

/// One engine as `/v1/engines` shows it, merged over shards.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineInfo {
    pub engine_id: String,
    pub blocks: u64,
    pub blocks_by_tier: [u64; 3],
    /// (tenant, model, adapter) partitions the engine stored into.
    pub partitions: BTreeSet<PartitionKey>,
    pub last_seen_us: i64,
    /// Events whose producer `seq` went below the highest applied for the engine.
    pub seq_regressions: u64,
}

/// The L1 side of one shard: what counts against its share of `l1_max_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L1Usage {
    pub bytes: u64,
    pub entries: usize,
}

/// Index-wide counts.
#[derive(Clone, Debug, Default)]
pub struct IndexStats {
    pub shards: usize,
    /// See [`PartitionStats::block_entries`].
    pub block_entries: u64,
    pub memberships: u64,
    pub engines: usize,
    pub l1_bytes: usize,
    pub partitions: Vec<PartitionStats>,
    /// Pinned block sizes per (tenant, model), with their conflicts.
    pub block_sizes: Vec<PinnedSize>,
    /// Events whose block size conflicted with their model's pin.
    pub block_size_conflicts: u64,
    /// Events whose producer `seq` went below their engine's highest applied one.
    pub seq_regressions: u64,
}

/// The sharded in-memory index. Cheap to share behind an `Arc`.
pub struct Index {
    shards: Vec<RwLock<Shard>>,
    config: IndexSettings,
    /// The block size each (tenant, model) stores token chains with (`block_sizes.rs`).
    block_sizes: BlockSizes,
    /// When this index was created (kvindex clock): engines loaded from disk and silent since
    /// count as heard then.
    created_us: i64,
}

impl Index {
    pub fn new(config: IndexSettings) -> Index {
        let n = config.shards.max(1);
        Index {
            shards: (0..n)
                .map(|_| RwLock::new(Shard::new(config.seed)))
                .collect(),
            config: IndexSettings {
                shards: n,
                ..config
            },
            block_sizes: BlockSizes::default(),
            created_us: crate::util::now_us(),
        }
    }

    /// What a token-carrying event's block size means for its (tenant, model) (see
    /// [`BlockSizes`]); `Known` for events without tokens.
    pub fn observe_block_size(&self, ev: &Event) -> Observed {
        match &ev.content {
            crate::event::BlockContent::Tokens { block_size, .. } => {
                self.block_sizes
                    .observe(&ev.partition.tenant, &ev.partition.model, *block_size)
            }
            _ => Observed::Known,
        }
    }

    /// Pins the block size of (tenant, model) (first pin wins; see [`BlockSizes::pin`]).
    pub fn pin_block_size(&self, tenant: &str, model: &str, size: u32) -> u32 {
        self.block_sizes.pin(tenant, model, size)
    }

    /// Pins what `ev` tells (tests and tools that apply events without the pipeline).
    pub fn learn_block_size(&self, ev: &Event) {
        if let Observed::New(size) = self.observe_block_size(ev) {
            self.pin_block_size(&ev.partition.tenant, &ev.partition.model, size);
        }
    }

    /// The block size (tenant, model) stores token chains with, if pinned.
    pub fn block_size(&self, tenant: &str, model: &str) -> Option<u32> {
        self.block_sizes.get(tenant, model)
    }

    /// Every pinned block size, with its conflicts.
    pub fn block_sizes(&self) -> Vec<PinnedSize> {
        self.block_sizes.list()
    }

    /// Events whose block size conflicted with their model's pin.
    pub fn block_size_conflicts(&self) -> u64 {
        self.block_sizes.conflicts()
    }

    pub fn config(&self) -> &IndexSettings {
        &self.config
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// One shard's lock, for the shard's owners only: its worker (`pipeline/worker.rs`), the
    /// warm load at start (`service.rs`), and tests and benches that drive a shard directly.
    /// Everyone else goes through the methods below.
    pub fn shard(&self, i: usize) -> &RwLock<Shard> {
        &self.shards[i]
    }

    /// What each shard's L1 holds now, by shard.
    pub fn l1_usage(&self) -> Vec<L1Usage> {
        (0..self.shards.len())
            .map(|i| self.l1_usage_of(i))
            .collect()
    }

    /// What shard `i`'s L1 holds now.
    pub fn l1_usage_of(&self, i: usize) -> L1Usage {
        let shard = self.shards[i].read();
        L1Usage {
            bytes: shard.l1_bytes(),
            entries: shard.l1_entries(),
        }
    }

    /// Whether some block may live only in L2, so lookups may read RocksDB.
    pub fn any_spilled(&self) -> bool {
        self.shards.iter().any(|s| s.read().is_spilled())
    }

    /// Whether lookups found blocks only in shard `i`'s L2 that wait to be restored.
    pub fn has_promotions(&self, i: usize) -> bool {
        self.shards[i].read().has_promotions()
    }

    /// The blocks lookups found only in shard `i`'s L2 since the last call
    /// (`restore_on_read`).
    pub fn take_promotions(&self, i: usize) -> Vec<u64> {
        self.shards[i].read().take_promotions()
    }

    /// Brings `keys` of shard `i` back from L2 into L1, as many as fit below `limit_bytes`
    /// (the first keys first); returns how many came back. The L2 reads run under the read
    /// lock (lookups go on), only the inserts take the write lock. Call it only from the
    /// shard's worker: nothing may change the shard's L2 rows between the two.
    pub fn restore_within(&self, i: usize, mut keys: Vec<u64>, limit_bytes: u64) -> usize {
        let lock = &self.shards[i];
        let rows = {
            let shard = lock.read();
            let room = limit_bytes.saturating_sub(shard.l1_bytes());
            keys.truncate((room / Shard::restore_cost(&[0])) as usize);
            shard.fetch_restores(&keys)
        };
        if rows.is_empty() {
            return 0;
        }
        lock.write().insert_restored(rows)
    }

    /// Turns on change tracking in every shard (see [`Shard::enable_change_tracking`]): the
    /// durable store commits what each shard changed.
    pub fn enable_change_tracking(&self) {
        for s in &self.shards {
            s.write().enable_change_tracking();
        }
    }

    /// The shard `ev` goes to (see module docs).
    pub fn route(&self, ev: &Event) -> usize {
        shard_of(&ev.partition, &ev.engine, self.shards.len())
    }

    /// Applies one event synchronously on the calling thread (tests, tools). The service
    /// applies through the pipeline's shard workers instead.
    pub fn apply(&self, ev: &Event, now_us: i64) -> Result<usize, SkipReason> {
        self.shards[self.route(ev)].write().apply(ev, now_us)
    }

    /// The block keys `blocks` names in `partition`.
    pub fn query_keys(&self, partition: &PartitionKey, blocks: &QueryBlocks) -> Vec<u64> {
        let seed = hash::partition_seed(self.config.seed, partition);
        let mut keys = Vec::new();
        match blocks {
            QueryBlocks::Tokens {
                token_ids,
                block_size,
                extras,
            } => hash::token_chain_keys(seed, token_ids, *block_size as usize, extras, &mut keys),
            QueryBlocks::Hashes(hashes) => keys.extend(hashes.iter().map(|h| hash::raw(seed, h.0))),
            QueryBlocks::Digests(d) => hash::chain_keys(seed, d.iter().copied(), &mut keys),
        }
        keys
    }

    /// Engines holding the longest runs of leading `keys`, sorted by `matched_blocks`
    /// descending, then `engine_id` ascending.
    pub fn lookup_keys(&self, keys: &[u64]) -> Answer {
        self.lookup_keys_limited(keys, usize::MAX)
    }

    /// [`Index::lookup_keys`] cut to the best `limit` engines, computed as such: each shard
    /// orders only the rows that can make the cut, and the merge stops at `limit`.
    pub fn lookup_keys_limited(&self, keys: &[u64], limit: usize) -> Answer {
        let options = LookupOptions {
            limit,
            ..LookupOptions::default()
        };
        self.lookup_keys_with(keys, &options)
    }

    /// The engines holding the longest runs of leading `keys`, filtered, ranked and cut as
    /// `options` says.
    pub fn lookup_keys_with(&self, keys: &[u64], options: &LookupOptions) -> Answer {
        self.lookup_keys_reading(keys, options, L2Reads::Any)
            .expect("a lookup that may wait on storage always answers")
    }

    /// [`Index::lookup_keys_with`] if it can answer without waiting on storage (its L2 reads
    /// all served from memory: see [`crate::spill::L2Reader::block_if_cached`]); `None` if it
    /// cannot, and the caller should run the lookup where blocking is allowed.
    pub fn try_lookup_keys_with(&self, keys: &[u64], options: &LookupOptions) -> Option<Answer> {
        self.lookup_keys_reading(keys, options, L2Reads::MemoryOnly)
    }

    fn lookup_keys_reading(
        &self,
        keys: &[u64],
        options: &LookupOptions,
        reads: L2Reads,
    ) -> Option<Answer> {
        let limit = options.limit;
        let mut answer = Answer {
            rows: Vec::new(),
            names: Vec::with_capacity(self.shards.len()),
            weights: options.tier_weights,
        };
        let mut raw = Vec::new();
        // Where each shard's rows start in `answer.rows`.
        let mut runs = Vec::with_capacity(self.shards.len() + 1);
        for (i, s) in self.shards.iter().enumerate() {
            raw.clear();
            let mut shard = s.read();
            let mut prefetch = None;
            // Reads from memory are as quick as L1's (under the lock, as the walk goes); reads
            // that may wait on storage are taken with the lock released (`shard::L2Plan`).
            let missed = Cell::new(false);
            if reads == L2Reads::Any
                && let Some(plan) = shard.l2_plan(keys)
            {
                drop(shard);
                prefetch = Some(plan.read());
                shard = s.read();
            }
            let l2 = match reads {
                L2Reads::Any => L2Access::Prefetched(prefetch.as_ref()),
                L2Reads::MemoryOnly => L2Access::MemoryOnly(&missed),
            };
            // Each shard orders its own rows with integer keys (name ranks); only the merge
            // below compares names, and only between rows of two shards. A filter or a score
            // can put any row in the best `limit`, so then every row is kept until it ran.
            let exact = options.heard_since_us.is_none() && options.tier_weights.is_none();
            let keep = if exact { limit } else { usize::MAX };
            shard.lookup_sorted_with(keys, &mut raw, keep, l2);
            if missed.get() {
                return None;
            }
            if let Some(since) = options.heard_since_us {
                raw.retain(|m| shard.engine_heard_us(m.engine, self.created_us) >= since);
            }
            if let Some(w) = &options.tier_weights {
                // Stable: rows of equal score keep the shard's (prefix, name) order.
                raw.sort_by(|a, b| {
                    b.mix
                        .score(b.matched, w)
                        .total_cmp(&a.mix.score(a.matched, w))
                });
            }
            raw.truncate(limit);
            answer.names.push(shard.engine_names().clone());
            runs.push(answer.rows.len());
            answer.rows.reserve(raw.len());
            answer.rows.extend(raw.iter().map(|m| (i as u16, *m)));
        }
        runs.push(answer.rows.len());
        if runs.windows(2).filter(|w| w[0] < w[1]).count() > 1 {
            merge_runs(&mut answer, &runs, limit);
        }
        Some(answer)
    }

    /// [`Index::query_keys`] then [`Index::lookup_keys`].
    pub fn lookup(&self, partition: &PartitionKey, blocks: &QueryBlocks) -> (usize, Answer) {
        self.lookup_limited(partition, blocks, usize::MAX)
    }

    /// [`Index::query_keys`] then [`Index::lookup_keys_limited`].
    pub fn lookup_limited(
        &self,
        partition: &PartitionKey,
        blocks: &QueryBlocks,
        limit: usize,
    ) -> (usize, Answer) {
        let options = LookupOptions {
            limit,
            ..LookupOptions::default()
        };
        self.lookup_with(partition, blocks, &options)
    }

    /// [`Index::query_keys`] then [`Index::lookup_keys_with`].
    pub fn lookup_with(
        &self,
        partition: &PartitionKey,
        blocks: &QueryBlocks,
        options: &LookupOptions,
    ) -> (usize, Answer) {
        let keys = self.query_keys(partition, blocks);
        let rows = self.lookup_keys_with(&keys, options);
        (keys.len(), rows)
    }

    pub fn stats(&self) -> IndexStats {
        let mut stats = IndexStats {
            shards: self.shards.len(),
            block_sizes: self.block_sizes.list(),
            block_size_conflicts: self.block_sizes.conflicts(),
            ..IndexStats::default()
        };
        let mut partitions: BTreeMap<PartitionKey, PartitionStats> = BTreeMap::new();
        let mut engines = BTreeSet::new();
        for s in &self.shards {
            let shard = s.read();
            stats.block_entries += shard.blocks();
            stats.memberships += shard.memberships();
            stats.l1_bytes += shard.memory_bytes();
            stats.seq_regressions += shard.engines().map(|e| e.seq_regressions).sum::<u64>();
            for p in shard.partitions() {
                let e = partitions
                    .entry(p.key.clone())
                    .or_insert_with(|| PartitionStats {
                        key: p.key.clone(),
                        ..PartitionStats::default()
                    });
                e.block_entries += p.blocks;
                e.memberships += p.memberships;
            }
            engines.extend(shard.engines().map(|e| e.name.clone()));
        }
        stats.engines = engines.len();
        stats.partitions = partitions.into_values().collect();
        stats
    }

    /// Every engine, merged over shards, sorted by id.
    pub fn engines(&self) -> Vec<EngineInfo> {
        let mut merged: BTreeMap<String, EngineInfo> = BTreeMap::new();
        for s in &self.shards {
            let shard = s.read();
            for e in shard.engines() {
                let info = merged
                    .entry(e.name.to_string())
                    .or_insert_with(|| EngineInfo {
                        engine_id: e.name.to_string(),
                        ..EngineInfo::default()
                    });
                info.blocks += e.blocks_held();
                for (t, c) in e.holdings.on.iter().enumerate() {
                    info.blocks_by_tier[t] += c;
                }
                info.partitions
                    .extend(e.partition_ids().map(|p| shard.partition(p).key.clone()));
                info.last_seen_us = info.last_seen_us.max(e.last_seen_us);
                info.seq_regressions += e.seq_regressions;
            }
        }
        merged.into_values().collect()
    }
}

/// Merges the sorted per-shard runs of `answer.rows` (bounded by `runs`) into one sorted list
/// of at most `limit` rows, in [`Answer::ranks_before`] order. k (shards) is
/// small, so a linear scan for the best head beats a heap.
fn merge_runs(answer: &mut Answer, runs: &[usize], limit: usize) {
    let mut cursors: Vec<(usize, usize)> = runs.windows(2).map(|w| (w[0], w[1])).collect();
    let mut merged = Vec::with_capacity(answer.rows.len().min(limit));
    while merged.len() < limit {
        let mut best: Option<usize> = None;
        for (c, &(at, end)) in cursors.iter().enumerate() {
            if at == end {
                continue;
            }
            let better = best
                .is_none_or(|b| answer.ranks_before(&answer.rows[at], &answer.rows[cursors[b].0]));
            if better {
                best = Some(c);
            }
        }
        let Some(b) = best else { break };
        merged.push(answer.rows[cursors[b].0]);
        cursors[b].0 += 1;
    }
    answer.rows = merged;
}

/// The shard of `engine`'s events in `partition`'s (tenant, model), among `n`. The adapter is
/// deliberately not part of it (see module docs).
pub fn shard_of(partition: &PartitionKey, engine: &str, n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    for part in [partition.tenant.as_str(), partition.model.as_str(), engine] {
        h.update(&(part.len() as u32).to_le_bytes());
        h.update(part.as_bytes());
    }
    (h.digest() % n as u64) as usize
}
