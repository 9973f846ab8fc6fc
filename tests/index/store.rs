//! The durable store: a restart reloads exactly the committed state, commits are assignments
//! (state at a checkpoint + replay of the events after it == the full state), layout
//! mismatches are refused by name, and a full disk is an error, not a panic.

use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use kvindex::index::{EngineInfo, EngineMatch, Index, IndexSettings, PartitionStats, QueryBlocks};
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::store::{Store, StoreError, StoreSettings};
use std::collections::BTreeMap;
use std::path::Path;

const SHARDS: usize = 3;
const SEED: u64 = 7;
const SOURCE: &str = "fleet";
/// Source partitions: events are spread by engine, so each engine's events stay in order.
const SOURCE_PARTITIONS: i32 = 2;

fn fleet_config() -> FleetSettings {
    FleetSettings {
        engines: 6,
        adapters: 2,
        // Small caches and frequent restarts: evictions and clears all along the stream.
        capacity_blocks: 96,
        clear_every: 60,
        seed: 11,
        // Blocks held on GPU and CPU at once, evictions that leave the CPU copy.
        cpu_offload: true,
        ..FleetSettings::default()
    }
}

/// A positioned event: (source partition, offset, event).
type Positioned = (i32, i64, Event);

/// About `min_events` fleet events with their source positions, some stored at CPU or disk
/// tier and some re-stored at another tier, plus 200 lookup queries.
fn stream(min_events: usize) -> (Vec<Positioned>, Vec<(PartitionKey, Vec<u32>)>) {
    let mut fleet = Fleet::new(fleet_config());
    let mut next = [0i64; SOURCE_PARTITIONS as usize];
    let mut out = Vec::new();
    let mut stored = 0u64;
    while out.len() < min_events {
        for mut ev in fleet.next_request() {
            let mut extra = None;
            if ev.kind == EventKind::Stored {
                stored += 1;
                ev.tier = match stored % 5 {
                    0 => Some(Tier::Cpu),
                    1 => Some(Tier::Disk),
                    2 => None,
                    _ => Some(Tier::Gpu),
                };
                if stored.is_multiple_of(7) {
                    // The engine offloads the chain it just stored: it now holds it on CPU
                    // too.
                    let mut moved = ev.clone();
                    moved.tier = Some(Tier::Cpu);
                    extra = Some(moved);
                }
            }
            for ev in std::iter::once(ev).chain(extra) {
                let p = source_partition(&ev.engine);
                let off = next[p as usize];
                next[p as usize] += 1;
                out.push((p, off, ev));
            }
        }
    }
    let queries = (0..200).map(|_| fleet.sample_query()).collect();
    (out, queries)
}

fn source_partition(engine: &str) -> i32 {
    (xxhash_rust::xxh3::xxh3_64(engine.as_bytes()) % SOURCE_PARTITIONS as u64) as i32
}

fn new_index() -> Index {
    Index::new(IndexSettings {
        shards: SHARDS,
        seed: SEED,
    })
}

fn options() -> StoreSettings {
    StoreSettings {
        shards: SHARDS,
        seed: SEED,
        sync: false,
    }
}

fn open(dir: &Path) -> Store {
    Store::open(dir, &options()).expect("store opens")
}

/// Everything observable about an index: lookups, stats (but L1 bytes, which depend on table
/// history), per-shard counts and engines.
#[derive(Debug, PartialEq)]
struct Snapshot {
    lookups: Vec<Vec<EngineMatch>>,
    block_entries: u64,
    memberships: u64,
    engines_count: usize,
    partitions: Vec<PartitionStats>,
    per_shard: Vec<(u64, u64, usize)>,
    /// (shard, engine, partition, entries) of every engine hash map: they resolve removals and
    /// parents, so a stale or missing entry changes what later events do.
    maps: Vec<(usize, String, PartitionKey, usize)>,
    engines: Vec<EngineInfo>,
}

fn snapshot(index: &Index, queries: &[(PartitionKey, Vec<u32>)]) -> Snapshot {
    let bs = fleet_config().block_size;
    let lookups = queries
        .iter()
        .map(|(p, tokens)| {
            let q = QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size: bs,
                extras: Vec::new(),
            };
            index.lookup(p, &q).1.to_vec()
        })
        .collect();
    let stats = index.stats();
    Snapshot {
        lookups,
        block_entries: stats.block_entries,
        memberships: stats.memberships,
        engines_count: stats.engines,
        partitions: stats.partitions,
        per_shard: (0..index.shard_count())
            .map(|s| {
                let sh = index.shard(s).read();
                (sh.blocks(), sh.memberships(), sh.partitions().count())
            })
            .collect(),
        maps: {
            let mut maps = Vec::new();
            for s in 0..index.shard_count() {
                let sh = index.shard(s).read();
                for e in sh.engines() {
                    for (p, n) in e.map_sizes() {
                        let key = sh.partition(p).key.clone();
                        maps.push((s, e.name.to_string(), key, n));
                    }
                }
            }
            maps.sort();
            maps
        },
        engines: index.engines(),
    }
}

/// Applies events in order, tracking the next offset delivered per source partition (what
/// the pipeline tells every shard, routed to it or not).
struct Feeder {
    index: Index,
    delivered: BTreeMap<i32, i64>,
}

impl Feeder {
    fn new() -> Feeder {
        let index = new_index();
        index.enable_change_tracking();
        Feeder {
            index,
            delivered: BTreeMap::new(),
        }
    }

    fn apply(&mut self, (p, off, ev): &Positioned) {
        // Skips (unknown parents after a clear) are part of the semantics; both sides skip.
        let _ = self.index.apply(ev, 1);
        self.delivered.insert(*p, off + 1);
    }

    fn offsets(&self) -> Vec<(String, i32, i64)> {
        self.delivered
            .iter()
            .map(|(&p, &o)| (SOURCE.to_string(), p, o))
            .collect()
    }

    /// Takes shard `s`'s changes and commits them with the offsets delivered so far.
    fn commit(&self, store: &Store, s: usize) -> kvindex::index::ChangeSet {
        let cs = self.index.shard(s).write().take_changes();
        store
            .commit(s as u16, &cs, &self.offsets())
            .expect("commit succeeds");
        store.after_commit(&mut self.index.shard(s).write(), &cs);
        cs
    }
}

fn load(store: &Store) -> Index {
    let index = new_index();
    for s in 0..SHARDS {
        let mut shard = index.shard(s).write();
        store.load_shard(s as u16, &mut shard).expect("shard loads");
        shard.enable_change_tracking();
    }
    index
}

fn reference(events: &[Positioned]) -> Index {
    let index = new_index();
    for (_, _, ev) in events {
        let _ = index.apply(ev, 1);
    }
    index
}

#[test]
fn restart_reloads_exactly_the_committed_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (events, queries) = stream(4000);
    let kinds = |k: EventKind| events.iter().filter(|(_, _, e)| e.kind == k).count();
    assert!(kinds(EventKind::Removed) > 50, "the stream evicts");
    assert!(kinds(EventKind::AllCleared) > 3, "the stream clears");

    let (before, committed) = {
        let store = open(dir.path());
        let mut f = Feeder::new();
        for (i, ev) in events.iter().enumerate() {
            f.apply(ev);
            if (i + 1).is_multiple_of(500) || i + 1 == events.len() {
                for s in 0..SHARDS {
                    f.commit(&store, s);
                }
            }
        }
        assert!(!f.index.shard(0).read().has_changes());
        let before = snapshot(&f.index, &queries);
        assert!(before.memberships > 500, "{before:?}");
        assert!(
            before.lookups.iter().filter(|l| !l.is_empty()).count() > 50,
            "most queries hit"
        );
        (before, f.delivered)
    };

    let store = open(dir.path());
    let index = load(&store);
    let after = snapshot(&index, &queries);
    assert_eq!(after.lookups, before.lookups);
    assert_eq!(after, before);
    for (&p, &o) in &committed {
        assert_eq!(store.next_offset(SOURCE, p).expect("reads"), Some(o));
        for s in 0..SHARDS as u16 {
            assert_eq!(store.shard_offset(s, SOURCE, p).expect("reads"), Some(o));
        }
    }
    assert_eq!(store.next_offset("other", 0).expect("reads"), None);
    assert_eq!(
        store.shard_offsets(1).expect("reads").len(),
        committed.len()
    );

    // A restored shard keeps working: tracking on, the same events again are all no-ops or
    // re-assignments, and reloading a second time still gives the same state.
    let again = load(&store);
    assert_eq!(snapshot(&again, &queries), before);
}

/// The crash test's property: state at checkpoint k + replay of the events after k == full
/// state, with shards checkpointing at different times and one change set committed twice.
#[test]
fn checkpoint_plus_replay_equals_full_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (events, queries) = stream(5000);
    let crash_at = events.len() * 2 / 3 + 17;
    {
        let store = open(dir.path());
        let mut f = Feeder::new();
        for (i, ev) in events[..crash_at].iter().enumerate() {
            f.apply(ev);
            // Each shard on its own cadence, so their offsets differ at the crash.
            for s in 0..SHARDS {
                if (i + 1 + s * 97).is_multiple_of(400) {
                    let cs = f.commit(&store, s);
                    if s == 1 && i > 1000 && i < 1500 {
                        // Assignments: writing the same set again changes nothing.
                        store
                            .commit(s as u16, &cs, &f.offsets())
                            .expect("commit succeeds");
                    }
                }
            }
        }
        // Crash: everything applied since each shard's last commit is lost.
    }

    let store = open(dir.path());
    let index = load(&store);
    let shard_next: Vec<BTreeMap<i32, i64>> = (0..SHARDS as u16)
        .map(|s| {
            (0..SOURCE_PARTITIONS)
                .filter_map(|p| Some((p, store.shard_offset(s, SOURCE, p).ok()??)))
                .collect()
        })
        .collect();
    let seek: BTreeMap<i32, i64> = (0..SOURCE_PARTITIONS)
        .filter_map(|p| Some((p, store.next_offset(SOURCE, p).ok()??)))
        .collect();
    assert_eq!(seek.len(), SOURCE_PARTITIONS as usize);
    let mut skipped_by_shard = 0;
    let mut replayed = 0;
    for (p, off, ev) in &events {
        if *off < seek[p] {
            continue; // the source seeks past these
        }
        let s = index.route(ev);
        if shard_next[s].get(p).is_some_and(|&next| *off < next) {
            skipped_by_shard += 1; // already in this shard's loaded state
            continue;
        }
        let _ = index.apply(ev, 1);
        replayed += 1;
    }
    assert!(
        skipped_by_shard > 0,
        "staggered checkpoints make shards skip"
    );
    assert!(replayed > events.len() / 3);
    assert_eq!(
        snapshot(&index, &queries),
        snapshot(&reference(&events), &queries)
    );
}

#[test]
fn untracked_shards_report_no_changes_and_requeue_restores_marks() {
    let (events, _) = stream(300);
    let plain = new_index();
    for (_, _, ev) in &events {
        let _ = plain.apply(ev, 1);
    }
    for s in 0..SHARDS {
        let mut sh = plain.shard(s).write();
        assert!(!sh.is_tracking_changes());
        assert!(sh.take_changes().is_empty());
    }

    let mut f = Feeder::new();
    for ev in &events {
        f.apply(ev);
    }
    let s = f.index.route(&events[0].2);
    let mut sh = f.index.shard(s).write();
    let cs = sh.take_changes();
    assert!(!cs.is_empty());
    assert!(!sh.has_changes());
    sh.requeue_changes(&cs);
    let again = sh.take_changes();
    let keys = |c: &kvindex::index::ChangeSet| {
        let mut b: Vec<u64> = c.blocks.iter().map(|b| b.key).collect();
        b.sort_unstable();
        let mut m: Vec<_> = c
            .maps
            .iter()
            .map(|m| (m.engine, m.partition, m.hash))
            .collect();
        m.sort_unstable();
        (b, m, c.engines.len(), c.new_partitions.clone())
    };
    assert_eq!(keys(&again), keys(&cs));
}

#[test]
fn begin_partition_gives_every_shard_a_row_before_any_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    assert_eq!(store.begin_partition("k", 4, 100).expect("writes"), SHARDS);
    assert_eq!(store.next_offset("k", 4).expect("reads"), Some(100));
    let empty = kvindex::index::ChangeSet::default();
    store
        .commit(0, &empty, &[("k".into(), 4, 250)])
        .expect("commit");
    store
        .commit(2, &empty, &[("k".into(), 4, 180)])
        .expect("commit");
    // Shard 1 has not committed since: the minimum stays at its begin row.
    assert_eq!(store.next_offset("k", 4).expect("reads"), Some(100));
    store
        .commit(1, &empty, &[("k".into(), 4, 300)])
        .expect("commit");
    assert_eq!(store.next_offset("k", 4).expect("reads"), Some(180));
    assert_eq!(store.shard_offset(0, "k", 4).expect("reads"), Some(250));
    // Rows exist now: beginning again (e.g. after a restart) keeps them.
    assert_eq!(store.begin_partition("k", 4, 999).expect("writes"), 0);
    assert_eq!(store.next_offset("k", 4).expect("reads"), Some(180));
    assert!(matches!(
        store.commit(SHARDS as u16, &empty, &[]),
        Err(StoreError::NoSuchShard { .. })
    ));
}

#[test]
fn reopening_with_another_shard_count_or_seed_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    drop(open(dir.path()));
    let err = Store::open(
        dir.path(),
        &StoreSettings {
            shards: SHARDS + 1,
            ..options()
        },
    )
    .err()
    .expect("a different shard count is refused");
    let msg = err.to_string();
    assert!(matches!(
        err,
        StoreError::ShardCountMismatch {
            stored: 3,
            configured: 4,
            ..
        }
    ));
    assert!(msg.contains("index.shards"), "{msg}");
    assert!(msg.contains("kvindex replay"), "{msg}");
    let err = Store::open(
        dir.path(),
        &StoreSettings {
            seed: SEED + 1,
            ..options()
        },
    )
    .err()
    .expect("a different seed is refused");
    assert!(err.to_string().contains("index.seed"), "{err}");
    // The right layout still opens.
    drop(open(dir.path()));
}

/// Unmounts a tmpfs on drop (lazily, so a failing test never leaves it busy).
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A full filesystem, for real: a small tmpfs (needs root or CAP_SYS_ADMIN; the test says so
/// and passes trivially where mounting is not allowed).
#[test]
fn full_disk_makes_commit_fail_without_touching_the_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m", "tmpfs"])
        .arg(&mnt)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIPPED: cannot mount a tmpfs here (not root?); no full-disk check ran");
        return;
    }
    let _mount = Mount(mnt.clone());
    let db = mnt.join("db");
    let (events, queries) = stream(3000);
    let half = events.len() / 2;

    let store = open(&db);
    let mut f = Feeder::new();
    for ev in &events[..half] {
        f.apply(ev);
    }
    for s in 0..SHARDS {
        f.commit(&store, s);
    }
    let committed = snapshot(&f.index, &queries);

    // Fill the filesystem.
    let filler = mnt.join("filler");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).expect("create filler");
        let chunk = vec![0xa5u8; 64 * 1024];
        while file.write_all(&chunk).is_ok() {}
        let _ = file.flush();
    }

    for ev in &events[half..] {
        f.apply(ev);
    }
    let live = snapshot(&f.index, &queries);
    let mut failures = 0;
    for s in 0..SHARDS {
        let cs = f.index.shard(s).write().take_changes();
        match store.commit(s as u16, &cs, &f.offsets()) {
            Ok(()) => store.after_commit(&mut f.index.shard(s).write(), &cs),
            Err(e) => {
                failures += 1;
                eprintln!("shard {s}: commit failed as expected: {e}");
                // Hand the rows back so a later commit carries them.
                f.index.shard(s).write().requeue_changes(&cs);
                assert!(f.index.shard(s).read().has_changes());
            }
        }
    }
    assert!(failures > 0, "a commit on a full disk must fail");
    assert_eq!(
        snapshot(&f.index, &queries),
        live,
        "the index is unaffected"
    );

    // After space is freed, a reopen finds the last successful commits, never a torn batch.
    drop(store);
    std::fs::remove_file(&filler).expect("free space");
    let store = open(&db);
    let reloaded = load(&store);
    let after = snapshot(&reloaded, &queries);
    if failures == SHARDS {
        assert_eq!(after, committed);
    }
    for p in 0..SOURCE_PARTITIONS {
        let next = store.next_offset(SOURCE, p).expect("reads");
        assert!(next.is_some());
    }
}

/// A bounded load sizes its block table for what its budget lets in, not for every row in L2:
/// a table sized from RocksDB's row estimate touches memory for all of them (a start-up RSS
/// peak far above `l1_max_bytes`).
#[test]
fn bounded_load_sizes_tables_for_its_budget_not_for_l2() {
    use kvindex::index::Shard;
    use kvindex::index::shard::BLOCK_ENTRY_BYTES;

    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let f = Feeder::new();
    long_chains(&f);
    for s in 0..SHARDS {
        f.commit(&store, s);
    }
    store.flush().expect("flush");

    let mut full = Shard::new(SEED);
    let all = store.load_shard(0, &mut full).expect("loads");
    assert!(all.blocks > 5_000, "{all:?}");
    // A budget for about 5% of the shard's blocks.
    let budget = all.blocks / 20 * BLOCK_ENTRY_BYTES;
    let mut bounded = Shard::new(SEED);
    let stats = store
        .load_shard_bounded(0, &mut bounded, budget)
        .expect("loads");
    assert!(stats.left_in_l2 > all.blocks / 2, "{stats:?}");
    assert_eq!(stats.memberships, all.memberships);
    let (bounded_bytes, full_bytes) = (bounded.memory_bytes(), full.memory_bytes());
    assert!(
        bounded_bytes * 4 < full_bytes && (bounded_bytes as u64) < 4 * budget + (64 << 10),
        "bounded load took {bounded_bytes} B for a {budget} B budget (unbounded: {full_bytes} B)"
    );
}

/// 4 engines × 1,000 chains of 8 blocks (32,000 distinct blocks, several load chunks per
/// shard), each chain's tokens its own, with the queries that hit each chain's prefixes.
fn long_chains(f: &Feeder) -> Vec<(PartitionKey, Vec<u32>)> {
    let partition = PartitionKey::new("t", "m", "");
    let tokens = |e: u64, chain: u64, n: u64| -> Vec<u32> {
        (0..n)
            .map(|t| (e * 1_000_000 + chain * 1_000 + t) as u32)
            .collect()
    };
    for e in 0..4u64 {
        for chain in 0..1_000u64 {
            let mut ev = Event::new(EventKind::Stored, format!("engine-{e}"), partition.clone());
            ev.block_hashes = (0..8)
                .map(|b| EngineHash(e << 40 | chain << 8 | b))
                .collect();
            ev.tier = [Some(Tier::Gpu), Some(Tier::Cpu), None][(chain % 3) as usize];
            ev.content = BlockContent::Tokens {
                token_ids: tokens(e, chain, 8 * fleet_config().block_size as u64),
                block_size: fleet_config().block_size,
            };
            f.index.apply(&ev, 1).expect("stores");
        }
    }
    (0..200u64)
        .map(|i| {
            let blocks = 1 + i % 10; // up to 2 blocks past a chain's end
            let tokens = tokens(i % 4, i * 5, blocks * fleet_config().block_size as u64);
            (partition.clone(), tokens)
        })
        .collect()
}

/// A restart answers before its rows are loaded: the shards are attached to the store as
/// spilled L1s after the first step of their load, and lookups read through to L2 while the
/// second step loads rows a chunk at a time. Every answer, before the first chunk, between
/// any two and after the last, equals the committed state's.
#[test]
fn lookups_during_a_chunked_load_answer_as_the_committed_state() {
    use kvindex::index::shard::{ReadThroughSettings, ReadThroughStats};
    use std::sync::Arc;

    let dir = tempfile::tempdir().expect("tempdir");
    let (events, mut queries) = stream(2000);
    let want = {
        let store = open(dir.path());
        let mut f = Feeder::new();
        for ev in &events {
            f.apply(ev);
        }
        queries.extend(long_chains(&f));
        for s in 0..SHARDS {
            f.commit(&store, s);
        }
        store.flush().expect("flush");
        snapshot(&f.index, &queries)
    };
    assert!(
        want.lookups.iter().filter(|l| !l.is_empty()).count() > 200,
        "the queries must hit"
    );

    let store = Arc::new(open(dir.path()));
    let index = new_index();
    let stats = Arc::new(ReadThroughStats::default());
    let mut loads = Vec::new();
    for s in 0..SHARDS {
        let mut shard = index.shard(s).write();
        loads.push(
            store
                .begin_load(s as u16, &mut shard, u64::MAX)
                .expect("begins"),
        );
        let settings = ReadThroughSettings {
            restore_on_read: true,
        };
        shard.attach_l2(store.clone(), s as u16, settings, stats.clone(), true);
    }
    let answers = |index: &Index| snapshot(index, &queries).lookups;
    assert_eq!(
        answers(&index),
        want.lookups,
        "no row loaded yet: all from L2"
    );
    assert!(index.stats().block_entries < want.block_entries / 100);

    let mut chunks = 0;
    for (s, mut load) in loads.into_iter().enumerate() {
        let total = store
            .finish_load(&mut load, index.shard(s), |_| {
                // The shard's lock is released between chunks.
                assert_eq!(answers(&index), want.lookups, "shard {s}, chunk {chunks}");
                chunks += 1;
                true
            })
            .expect("loads");
        assert_eq!(total.left_in_l2, 0);
        let mut shard = index.shard(s).write();
        shard.end_load(false);
        shard.enable_change_tracking();
    }
    assert!(chunks >= 3 * SHARDS, "only {chunks} chunks");
    assert!(stats.l2_reads.load(std::sync::atomic::Ordering::Relaxed) > 0);
    assert_eq!(snapshot(&index, &queries), want, "loaded");
}

/// A load stopped between chunks says so, and a load into a shard that is not empty is refused.
#[test]
fn a_stopped_load_is_an_error_and_loads_need_an_empty_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let f = Feeder::new();
    long_chains(&f);
    for s in 0..SHARDS {
        f.commit(&store, s);
    }
    let index = new_index();
    let mut load = store
        .begin_load(0, &mut index.shard(0).write(), u64::MAX)
        .expect("begins");
    let mut seen = 0;
    let stopped = store.finish_load(&mut load, index.shard(0), |_| {
        seen += 1;
        false
    });
    assert!(
        matches!(stopped, Err(StoreError::LoadInterrupted(0))),
        "{stopped:?}"
    );
    assert_eq!(seen, 1, "stops after the first chunk");
    assert!(
        matches!(
            store.begin_load(0, &mut index.shard(0).write(), u64::MAX),
            Err(StoreError::ShardNotEmpty(0))
        ),
        "half loaded"
    );
}
