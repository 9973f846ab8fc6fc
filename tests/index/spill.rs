//! The bounded L1 in the live service: with an L1 budget far below what the traffic stores,
//! most of the index lives in RocksDB (L2), and yet every lookup, every count and every engine
//! equals an unbounded in-memory reference fed the same events: during churn (stores, LRU
//! removals, clears, adapters) and after a restart. Lookups bring hot L2 blocks back
//! (`restore_on_read`); a failing L2 opens the breaker and pauses the sources at the hard cap
//! without losing an event; `/v1/stats` reports it all. (`tests/serve_crash.rs` kills a
//! tiny-L1 `kvindex serve` 24 times.)

use crate::support::{Fingerprint, fingerprint, wait_for};
use kvindex::config::Config;
use kvindex::event::{DecodeSettings, Event, TierSet, encode};
use kvindex::index::ShardL1;
use kvindex::index::shard::{L1Key, ReadThroughSettings, ReadThroughStats};
use kvindex::index::{Index, IndexSettings, QueryBlocks};
use kvindex::service::Service;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::Message;
use kvindex::spill::testing::{Fault, FaultInjector, ManualClock};
use kvindex::spill::{
    CircuitBreaker, L2ReadError, L2Reader, L2Row, L2Sink, SpillController, SpillL1, SpillSettings,
    Stamp, Stop, StoredBlock,
};
use kvindex::store::{Store, StoreSettings, StoreSink};
use std::sync::Arc;
use std::time::Duration;

const SOURCE: &str = "kafka:kv-spill";
const BLOCK_SIZE: u32 = 16;

fn config(dir: &std::path::Path, l1_max_bytes: u64) -> Config {
    let mut c = Config {
        data_dir: dir.to_path_buf(),
        ..Config::default()
    };
    c.index.shards = 2;
    c.index.l1_max_bytes = l1_max_bytes;
    c
}

/// A fleet whose engines store far more than a tiny L1 holds, evict (LRU removals), clear,
/// and use LoRA adapters.
fn fleet(seed: u64) -> Fleet {
    Fleet::new(FleetSettings {
        engines: 6,
        adapters: 3,
        capacity_blocks: 1_500,
        block_size: BLOCK_SIZE,
        clear_every: 700,
        seed,
        // Blocks held on GPU and CPU at once, evictions that leave the CPU copy.
        cpu_offload: true,
        ..FleetSettings::default()
    })
}

/// The same traffic for the service (as messages) and the reference (as events).
struct Traffic {
    fleet: Fleet,
    next_offset: i64,
}

impl Traffic {
    fn batch(&mut self, n: usize) -> (Vec<Message>, Vec<Event>) {
        let mut messages = Vec::with_capacity(n);
        let mut events = Vec::new();
        for _ in 0..n {
            let evs = self.fleet.next_request();
            messages.push(Message {
                partition: 0,
                offset: self.next_offset,
                payload: encode::to_proto(&evs),
                ..Message::default()
            });
            self.next_offset += 1;
            events.extend(evs);
        }
        (messages, events)
    }
}

fn reference(c: &Config) -> Index {
    Index::new(IndexSettings {
        shards: 2,
        seed: c.index.seed,
    })
}

fn feed(service: &Service, reference: &Index, traffic: &mut Traffic, n: usize) {
    let (messages, events) = traffic.batch(n);
    let opts = DecodeSettings::from(&Config::default().source);
    service
        .pipeline
        .ingest_batch(SOURCE, &messages, &opts)
        .unwrap();
    for ev in &events {
        let _ = reference.apply(ev, 0);
    }
}

fn queries(traffic: &mut Traffic, n: usize) -> Vec<(kvindex::event::PartitionKey, Vec<u32>)> {
    (0..n).map(|_| traffic.fleet.sample_query()).collect()
}

fn assert_same(
    service: &Service,
    reference: &Index,
    q: &[(kvindex::event::PartitionKey, Vec<u32>)],
    when: &str,
) {
    assert!(service.pipeline.persist(), "{when}: commit failed");
    let got: Fingerprint = fingerprint(&service.index, q, BLOCK_SIZE);
    let want = fingerprint(reference, q, BLOCK_SIZE);
    assert!(
        want.answers.iter().any(|a| !a.is_empty()),
        "{when}: vacuous queries"
    );
    assert_eq!(got, want, "{when}: tiered index differs from the reference");
}

#[test]
fn a_tiny_l1_answers_like_an_unbounded_index_through_churn_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    // ~16 KiB per shard: a few hundred entries, against tens of thousands stored.
    let c = config(dir.path(), 32 << 10);
    let mut traffic = Traffic {
        fleet: fleet(7),
        next_offset: 0,
    };
    let reference = reference(&c);
    let service = Service::open(c.clone(), None).unwrap();
    for round in 0..12 {
        feed(&service, &reference, &mut traffic, 60);
        let q = queries(&mut traffic, 24);
        assert_same(&service, &reference, &q, &format!("round {round}"));
    }
    let stats = service.spill.stats();
    assert!(stats.entries_evicted > 1_000, "nothing left L1: {stats:?}");
    assert!(stats.l2_hits > 0, "no lookup or event read L2: {stats:?}");
    assert!(
        stats.l1_bytes <= stats.l1_hard_cap_bytes,
        "L1 over its hard cap: {stats:?}"
    );
    let memberships = service.index.stats().memberships;
    assert!(
        stats.l1_entries * 4 < memberships,
        "most of the index should live in L2: {} L1 entries for {memberships} memberships",
        stats.l1_entries
    );
    drop(service);

    // Clean restart: a bounded load, the rest read through.
    let service = Service::open(c.clone(), None).unwrap();
    let loaded = service.wait_warm().expect("the store loads");
    assert!(loaded.left_in_l2 > 0, "{loaded:?}");
    let q = queries(&mut traffic, 32);
    assert_same(&service, &reference, &q, "after restart");
    for round in 0..4 {
        feed(&service, &reference, &mut traffic, 60);
        let q = queries(&mut traffic, 24);
        assert_same(
            &service,
            &reference,
            &q,
            &format!("after restart, round {round}"),
        );
    }
    drop(service);
}

/// Eviction never writes a row the checkpoint has not committed with its offsets: the worker
/// commits first, so every entry that leaves L1 is clean. With commits otherwise rare (a long
/// interval), write-back would have written thousands of dirty rows ahead of the offsets.
#[test]
fn eviction_commits_first_so_l2_never_runs_ahead_of_the_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), 32 << 10);
    c.checkpoint.interval_ms = 3_600_000;
    c.checkpoint.max_events = u64::MAX / 2;
    let mut traffic = Traffic {
        fleet: fleet(11),
        next_offset: 0,
    };
    let reference = reference(&c);
    let service = Service::open(c.clone(), None).unwrap();
    for round in 0..6 {
        feed(&service, &reference, &mut traffic, 60);
        let q = queries(&mut traffic, 16);
        assert_same(&service, &reference, &q, &format!("round {round}"));
    }
    let stats = service.spill.stats();
    assert!(stats.entries_evicted > 1_000, "nothing left L1: {stats:?}");
    assert_eq!(
        stats.entries_written, 0,
        "rows written outside a checkpoint commit: {stats:?}"
    );
    drop(service);
    let service = Service::open(c, None).unwrap();
    let q = queries(&mut traffic, 32);
    assert_same(&service, &reference, &q, "after restart");
}

#[test]
fn lookups_of_l2_blocks_bring_them_back_and_stats_report_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), 64 << 10);
    let mut traffic = Traffic {
        fleet: fleet(11),
        next_offset: 0,
    };
    let reference = reference(&c);
    let service = Service::open(c, None).unwrap();
    feed(&service, &reference, &mut traffic, 400);
    assert!(service.pipeline.persist());
    let q = queries(&mut traffic, 64);
    let before = service.spill.stats();
    assert_same(&service, &reference, &q, "first lookups");
    // The worker restores what the lookups read from L2 at its next maintenance.
    feed(&service, &reference, &mut traffic, 1);
    service.pipeline.flush();
    let after = service.spill.stats();
    assert!(after.l2_hits > before.l2_hits, "{after:?}");
    assert!(
        after.restored > before.restored,
        "nothing restored: {after:?}"
    );
    assert_same(&service, &reference, &q, "after restores");

    let state = kvindex::api::AppState::over(&service, None).expect("no token file to read");
    let json = serde_json::to_value(state.spill.as_ref().unwrap().stats()).unwrap();
    for field in [
        "l1_bytes",
        "l1_entries",
        "l2_entries",
        "batches",
        "failures",
        "breaker",
    ] {
        assert!(json.get(field).is_some(), "{field} missing in {json}");
    }
    assert_eq!(json["breaker"]["state"], "closed");
}

/// A service whose L2 fails every write-back batch, fed until its breaker is open and L1 sits
/// at the hard cap, with the feeder blocked (backpressure).
struct Outage {
    dir: tempfile::TempDir,
    service: Arc<Service>,
    clock: Arc<ManualClock>,
    reference: Index,
    traffic: Traffic,
    feeder: std::thread::JoinHandle<()>,
}

/// Ingests `messages` in batches of `chunk` on a thread of its own (the source side, which
/// blocks under backpressure), then waits until they are applied.
fn spawn_feeder(
    service: &Arc<Service>,
    messages: Vec<Message>,
    chunk: usize,
) -> std::thread::JoinHandle<()> {
    let service = service.clone();
    std::thread::spawn(move || {
        let opts = DecodeSettings::from(&Config::default().source);
        for batch in messages.chunks(chunk) {
            service.pipeline.ingest_batch(SOURCE, batch, &opts).unwrap();
        }
        service.pipeline.flush();
    })
}

/// The in-flight budget of the outage tests (small, so it binds before the queue length).
const INFLIGHT: u64 = 1 << 20;

fn outage_at_the_hard_cap() -> Outage {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), 32 << 10);
    c.source.max_inflight_bytes = INFLIGHT;
    let clock = Arc::new(ManualClock::new());
    let service = Arc::new(Service::open_with_clock(c.clone(), None, clock.clone()).unwrap());
    let mut traffic = Traffic {
        fleet: fleet(3),
        next_offset: 0,
    };
    let reference = reference(&c);
    feed(&service, &reference, &mut traffic, 100);
    assert!(service.pipeline.persist());

    // RocksDB starts failing every write-back batch.
    service.store.faults().set_sticky(Fault::Fail);
    let (messages, events) = traffic.batch(600);
    for ev in &events {
        let _ = reference.apply(ev, 0);
    }
    // In source-sized batches: L1 may overshoot its cap by one batch at most.
    let feeder = spawn_feeder(&service, messages, 5);
    let open = wait_for(
        "the breaker to open and L1 to reach its hard cap",
        Duration::from_secs(60),
        || {
            let s = service.spill.stats();
            (s.breaker_open() && s.backpressure).then_some(s)
        },
    );
    assert!(open.failures >= 1, "{open:?}");
    assert_eq!(open.breaker.backoff, Duration::from_secs(2), "{open:?}");
    assert!(open.l1_bytes <= 4 * open.l1_hard_cap_bytes, "{open:?}");
    // Backpressure: the source's batch is not taken while L1 is full and L2 is down, and
    // what waits for the paused shard stays within the in-flight byte budget (plus the one
    // batch it admits when nothing else is in flight), not 64 queued batches per shard.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!feeder.is_finished(), "events were taken past the hard cap");
    let (inflight, limit) = service.pipeline.inflight_bytes();
    assert_eq!(limit, INFLIGHT);
    assert!(inflight > 0, "vacuous: nothing waits");
    assert!(inflight <= 2 * INFLIGHT, "{inflight} bytes in flight");
    Outage {
        dir,
        service,
        clock,
        reference,
        traffic,
        feeder,
    }
}

#[test]
fn a_failing_l2_opens_the_breaker_pauses_the_sources_and_loses_nothing() {
    let Outage {
        dir: _dir,
        service,
        clock,
        reference,
        mut traffic,
        feeder,
    } = outage_at_the_hard_cap();

    // L2 heals; once the breaker's pause has run out, everything drains.
    service.store.faults().clear();
    clock.advance(Duration::from_secs(3));
    feeder.join().unwrap();
    let q = queries(&mut traffic, 32);
    assert_same(&service, &reference, &q, "after the outage");
    let healed = service.spill.stats();
    assert!(!healed.breaker_open(), "{healed:?}");
    assert!(healed.breaker_rejections > 0, "{healed:?}");
}

#[test]
fn shutdown_does_not_wait_for_a_failing_l2_at_the_hard_cap() {
    let o = outage_at_the_hard_cap();
    // Shutdown begins while L2 is still down and the breaker open (the clock stands still):
    // the held-back batch is taken, and the service drops (its last commit fails) promptly.
    o.service.pipeline.close();
    wait_for(
        "the blocked source to hand over its batch",
        Duration::from_secs(30),
        || o.feeder.is_finished().then_some(()),
    );
    o.feeder.join().unwrap();
    let service = o.service;
    let dropped = std::thread::spawn(move || drop(service));
    wait_for("the service to drop", Duration::from_secs(30), || {
        dropped.is_finished().then_some(())
    });
    dropped.join().unwrap();
}

/// One tiered shard (`restore_on_read` off) with change tracking, over a fresh store.
pub(crate) fn tiered_shard(dir: &std::path::Path) -> (Arc<Index>, Arc<Store>) {
    tiered_shard_reading(dir, |store| store as Arc<dyn L2Reader>)
}

/// [`tiered_shard`], reading L2 through what `reader` makes of the store.
fn tiered_shard_reading(
    dir: &std::path::Path,
    reader: impl FnOnce(Arc<Store>) -> Arc<dyn L2Reader>,
) -> (Arc<Index>, Arc<Store>) {
    let opts = StoreSettings {
        shards: 1,
        seed: 1,
        sync: false,
    };
    let store = Arc::new(Store::open(dir, &opts).unwrap());
    let index = Arc::new(Index::new(IndexSettings { shards: 1, seed: 1 }));
    {
        let mut shard = index.shard(0).write();
        shard.attach_l2(
            reader(store.clone()),
            0,
            ReadThroughSettings {
                restore_on_read: false,
            },
            Arc::new(ReadThroughStats::default()),
            false,
        );
        shard.enable_change_tracking();
    }
    (index, store)
}

/// Commits shard 0's changes and tells it the durable ids the commit wrote, as the pipeline
/// does after each commit.
pub(crate) fn commit_and_learn_ids(index: &Index, store: &Store) {
    let changes = index.shard(0).write().take_changes();
    store.commit(0, &changes, &[]).unwrap();
    store.after_commit(&mut index.shard(0).write(), &changes);
}

/// Evicts everything shard 0 holds (an L1 budget of one byte): from here on it lives in L2 only.
pub(crate) fn evict_all(index: &Arc<Index>, store: &Arc<Store>) {
    let mut ctl = SpillController::new(
        ShardL1::new(index.clone(), 0),
        StoreSink::new(store.clone()),
        Arc::new(CircuitBreaker::new(Arc::new(ManualClock::new()))),
        SpillSettings::for_budget(1),
    );
    ctl.evict();
    assert!(index.any_spilled(), "vacuous: nothing spilled");
}

/// One tiered shard over a fresh store: traffic committed once (durable ids), then more
/// traffic applied since (dirty entries); and an untiered reference fed the same events.
fn live_shard(dir: &std::path::Path) -> (Arc<Index>, Arc<Store>, Traffic, Index) {
    let (index, store) = tiered_shard(dir);
    let mut traffic = Traffic {
        fleet: fleet(5),
        next_offset: 0,
    };
    let reference = Index::new(IndexSettings { shards: 1, seed: 1 });
    let apply = |traffic: &mut Traffic, n| {
        for ev in traffic.batch(n).1 {
            let _ = index.apply(&ev, 0);
            let _ = reference.apply(&ev, 0);
        }
    };
    apply(&mut traffic, 50);
    commit_and_learn_ids(&index, &store);
    apply(&mut traffic, 50);
    (index, store, traffic, reference)
}

/// A dirty entry can leave L1 only once its row can be written, which takes the durable ids
/// of its engines and partition: before the first commit makes them durable, the controller
/// is offered no such entry, and no stamp removes one, whatever version it names.
#[test]
fn an_entry_whose_ids_are_not_durable_yet_never_leaves_l1() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    let mut traffic = Traffic {
        fleet: fleet(9),
        next_offset: 0,
    };
    for ev in traffic.batch(40).1 {
        let _ = index.apply(&ev, 0);
    }
    let mut resident: Vec<u64> = queries(&mut traffic, 40)
        .into_iter()
        .flat_map(|(partition, token_ids)| {
            let blocks = QueryBlocks::Tokens {
                token_ids,
                block_size: BLOCK_SIZE,
                extras: Vec::new(),
            };
            index.query_keys(&partition, &blocks)
        })
        .filter(|&k| index.shard(0).read().l1_blocks_contain(k))
        .collect();
    resident.sort_unstable();
    resident.dedup();
    assert!(resident.len() >= 10, "vacuous: {} blocks", resident.len());
    // Every version the shard's clock can have given them so far.
    let stamps: Vec<Stamp<L1Key>> = resident
        .iter()
        .flat_map(|&k| {
            (0..64).map(move |version| Stamp {
                key: L1Key::Block(k),
                version,
            })
        })
        .collect();
    let l1 = ShardL1::new(index.clone(), 0);
    assert!(l1.coldest(128).is_empty(), "offered an entry without ids");
    let entries = l1.entry_count();
    assert_eq!(l1.remove_if_unchanged(&stamps).removed, 0);
    assert_eq!(l1.entry_count(), entries);

    // Once the ids are durable, the same stamps do remove them: the check was not vacuous.
    commit_and_learn_ids(&index, &store);
    assert!(l1.remove_if_unchanged(&stamps).removed >= resident.len() / 2);
}

/// A holder's removal moves the block's version: the write-back, which sampled the block (and
/// built its row) before the removal, leaves it in L1 rather than evicting it with a row that
/// still names the holder. Lookups never name an engine for a block it dropped.
#[test]
fn a_removal_after_the_sample_keeps_the_block_from_leaving_with_its_old_row() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store, _traffic, reference) = live_shard(dir.path());
    let holders = |index: &Index, k: u64| -> Vec<String> {
        let mut engines: Vec<String> = index
            .lookup_keys(&[k])
            .iter()
            .map(|m| m.engine_id.to_string())
            .collect();
        engines.sort();
        engines
    };
    let l1 = ShardL1::new(index.clone(), 0);
    let victims = l1.coldest(4096);
    let blocks: Vec<u64> = victims
        .iter()
        .filter_map(|v| match v.key {
            L1Key::Block(k) => Some(k),
            L1Key::Map { .. } => None,
        })
        .collect();
    // The engine sharing the most sampled blocks with others (asked of the reference, since a
    // lookup on the tiered index would move the stamps this test is about).
    let mut shared: std::collections::BTreeMap<String, usize> = Default::default();
    for &k in &blocks {
        let engines = holders(&reference, k);
        if engines.len() >= 2 {
            for e in engines {
                *shared.entry(e).or_default() += 1;
            }
        }
    }
    let (leaving, count) = shared.into_iter().max_by_key(|(_, n)| *n).unwrap();
    assert!(count >= 5, "vacuous: {count} shared sampled blocks");
    let stamps: Vec<_> = victims.iter().map(|v| v.stamp()).collect();
    let rows: Vec<_> = victims.iter().filter_map(|v| v.dirty.clone()).collect();
    StoreSink::new(store.clone())
        .write_batch(&rows, std::time::Instant::now() + Duration::from_secs(5))
        .unwrap();

    // Meanwhile the engine goes away, and its blocks with it.
    let forget = index.shard(0).read().forget_events(&leaving);
    for ev in &forget {
        index.apply(ev, 0).unwrap();
        reference.apply(ev, 0).unwrap();
    }
    let removal = l1.remove_if_unchanged(&stamps);
    assert!(removal.removed > 0, "vacuous: nothing evicted: {removal:?}");
    for &k in &blocks {
        assert_eq!(
            holders(&index, k),
            holders(&reference, k),
            "block {k:#x} after {leaving} left"
        );
    }
}

#[test]
fn a_live_shard_keeps_what_is_read_in_flight_and_everything_when_the_write_fails() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store, mut traffic, _) = live_shard(dir.path());
    let q = queries(&mut traffic, 24);
    let before = fingerprint(&index, &q, BLOCK_SIZE);
    let l1 = ShardL1::new(index.clone(), 0);

    // A block read (by a lookup) while its batch is in flight stays in L1.
    let victims = l1.coldest(128);
    assert!(victims.iter().any(|v| v.dirty.is_some()), "no dirty victim");
    let Some(block) = victims.iter().find_map(|v| match v.key {
        L1Key::Block(k) => Some(k),
        L1Key::Map { .. } => None,
    }) else {
        panic!("no block among the victims")
    };
    let stamps: Vec<_> = victims.iter().map(|v| v.stamp()).collect();
    // The batch in flight (as the controller writes it), and a lookup meanwhile.
    let rows: Vec<_> = victims.iter().filter_map(|v| v.dirty.clone()).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    StoreSink::new(store.clone())
        .write_batch(&rows, deadline)
        .unwrap();
    index.lookup_keys(&[block]);
    let entries = l1.entry_count();
    let removal = l1.remove_if_unchanged(&stamps);
    assert!(removal.kept >= 1, "{removal:?}");
    assert_eq!(entries - removal.removed, l1.entry_count());
    assert!(
        index.shard(0).read().l1_blocks_contain(block),
        "a block read in flight left L1"
    );

    // L2 failing: an eviction pass removes nothing, and says why.
    let sink = FaultInjector::new(StoreSink::new(store));
    let faults = sink.handle();
    faults.set_sticky(Fault::Fail);
    let used = l1.bytes_used();
    let mut ctl = SpillController::new(
        l1.clone(),
        sink,
        Arc::new(CircuitBreaker::new(Arc::new(ManualClock::new()))),
        SpillSettings::for_budget(used),
    );
    let entries = l1.entry_count();
    let r = ctl.evict();
    assert_eq!(r.stopped, Some(Stop::Failed), "{r:?}");
    assert_eq!(r.removed, 0, "{r:?}");
    assert_eq!(l1.entry_count(), entries);
    assert_eq!(fingerprint(&index, &q, BLOCK_SIZE), before);
}

/// A lookup queues the L2 blocks it read for restore; if an event removes one of them before
/// the worker restores it, the removal is pending (L2 still holds the old row until the next
/// commit) and the restore must not bring the old row back.
#[test]
fn a_restore_never_brings_back_a_block_removed_since_the_last_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store, mut traffic, reference) = live_shard(dir.path());
    // Everything committed, then everything evicted: all blocks live only in L2.
    let changes = index.shard(0).write().take_changes();
    store.commit(0, &changes, &[]).unwrap();
    let l1 = ShardL1::new(index.clone(), 0);
    let mut ctl = SpillController::new(
        l1.clone(),
        StoreSink::new(store.clone()),
        Arc::new(CircuitBreaker::new(Arc::new(ManualClock::new()))),
        SpillSettings::for_budget(1),
    );
    ctl.evict();
    let q = queries(&mut traffic, 200);
    let keys: Vec<u64> = q
        .iter()
        .flat_map(|(partition, tokens)| {
            index.query_keys(
                partition,
                &kvindex::index::QueryBlocks::Tokens {
                    token_ids: tokens.clone(),
                    block_size: BLOCK_SIZE,
                    extras: Vec::new(),
                },
            )
        })
        .collect();
    let resident = |keys: &[u64]| {
        let shard = index.shard(0).read();
        keys.iter().filter(|&&k| shard.l1_blocks_contain(k)).count()
    };
    assert!(
        resident(&keys) * 4 < keys.len(),
        "the queried blocks are in L2"
    );

    // More traffic, not committed: removals fault blocks in and drop them (pending).
    for ev in traffic.batch(100).1 {
        let _ = index.apply(&ev, 0);
        let _ = reference.apply(&ev, 0);
    }
    let restored = index.shard(0).write().restore_blocks(&keys);
    assert!(restored > 0, "nothing restored");
    assert_eq!(
        fingerprint(&index, &q, BLOCK_SIZE),
        fingerprint(&reference, &q, BLOCK_SIZE),
        "a restore resurrected a removed block"
    );
}

/// An L2 read that an event needs fails: the shard holds that event (retrying) instead of
/// skipping it and committing past it; once reads work again everything applies, and the
/// index answers like one that never spilled.
#[test]
fn a_failed_l2_read_holds_the_shard_and_skips_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), 32 << 10);
    let reference = reference(&c);
    let service = Arc::new(Service::open(c, None).unwrap());
    let mut traffic = Traffic {
        fleet: fleet(21),
        next_offset: 0,
    };
    feed(&service, &reference, &mut traffic, 300);
    assert!(service.pipeline.persist());
    assert!(
        service.spill.stats().l2_entries > 0,
        "vacuous: nothing spilled"
    );

    service.store.fail_reads(true);
    let (messages, events) = traffic.batch(300);
    for ev in &events {
        let _ = reference.apply(ev, 0);
    }
    let feeder = spawn_feeder(&service, messages, 10);
    wait_for(
        "a shard to hold on a failed read",
        Duration::from_secs(60),
        || {
            (service
                .metrics
                .l2_read_holds
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0)
            .then_some(())
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !service.metrics.skipped().contains_key("l2_read_failed"),
        "an event was skipped: {:?}",
        service.metrics.skipped()
    );
    service.store.fail_reads(false);
    feeder.join().unwrap();
    assert!(service.pipeline.persist());
    assert!(!service.metrics.skipped().contains_key("l2_read_failed"));
    let q = queries(&mut traffic, 48);
    assert_same(&service, &reference, &q, "after the read outage");
}

/// The backup flush pages through the dirty entries in key order: small pages, each from a
/// bounded pass over the change set, cover exactly what one unbounded page does, once each.
#[test]
fn dirty_pages_cover_every_dirty_entry_once_in_key_order() {
    let dir = tempfile::tempdir().unwrap();
    let (index, _store, _traffic, _reference) = live_shard(dir.path());
    let l1 = ShardL1::new(index.clone(), 0);
    let all: Vec<L1Key> = l1
        .dirty_after(&Default::default(), usize::MAX)
        .entries
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert!(all.len() > 50, "vacuous: {} dirty entries", all.len());
    assert!(all.is_sorted());
    let mut paged = Vec::new();
    let mut cursor = Default::default();
    let mut pages = 0;
    loop {
        let page = l1.dirty_after(&cursor, 7);
        assert!(page.entries.len() <= 7);
        paged.extend(page.entries.into_iter().map(|r| r.key));
        pages += 1;
        match page.next {
            Some(next) => cursor = next,
            None => break,
        }
    }
    assert!(
        pages > all.len() / 7,
        "{pages} pages for {} entries",
        all.len()
    );
    assert_eq!(paged, all);
}

/// The store as L2, with block reads that wait at a gate while it is closed (and say so).
struct GatedReads {
    store: Arc<Store>,
    closed: parking_lot::Mutex<bool>,
    opened: parking_lot::Condvar,
    waiting: std::sync::atomic::AtomicUsize,
}

impl GatedReads {
    fn open(&self) {
        *self.closed.lock() = false;
        self.opened.notify_all();
    }
}

impl L2Reader for GatedReads {
    fn block(&self, shard: u16, key: u64) -> Result<Option<StoredBlock>, L2ReadError> {
        let mut closed = self.closed.lock();
        if *closed {
            self.waiting
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            while *closed {
                self.opened.wait(&mut closed);
            }
        }
        drop(closed);
        self.store.block(shard, key)
    }
    fn map_entry(&self, shard: u16, e: u32, p: u32, hash: u64) -> Result<Option<u64>, L2ReadError> {
        self.store.map_entry(shard, e, p, hash)
    }
    fn map_entries(
        &self,
        shard: u16,
        e: u32,
        p: u32,
        each: &mut dyn FnMut(u64, u64),
    ) -> Result<(), L2ReadError> {
        self.store.map_entries(shard, e, p, each)
    }
    fn block_row(&self, shard: u16, key: u64, p: u32, holders: &[(u32, TierSet)]) -> L2Row {
        self.store.block_row(shard, key, p, holders)
    }
    fn map_row(&self, shard: u16, e: u32, p: u32, hash: u64, block: u64) -> L2Row {
        self.store.map_row(shard, e, p, hash, block)
    }
}

/// A lookup reads the blocks only L2 holds with the shard's lock released: while its RocksDB
/// read is stuck, the shard's writer still gets the lock (and lookups queued behind a writer
/// are not stalled by a slow disk); once the read returns, the answer is the reference's.
#[test]
fn a_lookup_reads_l2_without_holding_the_shard_lock() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let mut gate = None;
    let (index, store) = tiered_shard_reading(dir.path(), |store| {
        let g = Arc::new(GatedReads {
            store,
            closed: parking_lot::Mutex::new(false),
            opened: parking_lot::Condvar::new(),
            waiting: Default::default(),
        });
        gate = Some(g.clone());
        g as Arc<dyn L2Reader>
    });
    let gate = gate.unwrap();
    let mut traffic = Traffic {
        fleet: fleet(33),
        next_offset: 0,
    };
    let reference = Index::new(IndexSettings { shards: 1, seed: 1 });
    for ev in traffic.batch(120).1 {
        let _ = index.apply(&ev, 0);
        let _ = reference.apply(&ev, 0);
    }
    commit_and_learn_ids(&index, &store);
    // Everything evicted: the queried blocks live only in L2.
    evict_all(&index, &store);
    let q = queries(&mut traffic, 40);
    let expected = fingerprint(&reference, &q, BLOCK_SIZE);

    *gate.closed.lock() = true;
    let lookups = {
        let index = index.clone();
        let q = q.clone();
        std::thread::spawn(move || fingerprint(&index, &q, BLOCK_SIZE))
    };
    wait_for("a lookup to read L2", Duration::from_secs(30), || {
        (gate.waiting.load(SeqCst) > 0).then_some(())
    });
    let writer = index.shard(0).try_write_for(Duration::from_secs(5));
    assert!(
        writer.is_some(),
        "the shard's writer waited on a lookup's L2 read"
    );
    drop(writer);
    gate.open();
    assert_eq!(lookups.join().unwrap(), expected);
}

/// A lookup that may not wait on storage (the HTTP handler's first try, on an async worker)
/// answers exactly as one that may, or declines: a row only in an SST block RocksDB has not
/// cached declines; once a blocking lookup cached it, the same answer comes from memory; and
/// blocks L2 never stored are ruled out by the filters, from memory too.
#[test]
fn a_memory_only_lookup_answers_as_a_blocking_one_or_declines() {
    use crate::support::events::stored;
    use kvindex::event::PartitionKey;
    use kvindex::index::LookupOptions;
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    let partition = PartitionKey::new("", "m", "");
    for (engine, first) in [("a", 0u32), ("b", 0), ("c", 64)] {
        let chain = stored(engine, partition.clone())
            .hashes((0..8u64).map(|i| u64::from(first) * 100 + i + 1))
            .tokens(first..first + 32, 4)
            .event();
        index.apply(&chain, 1).unwrap();
    }
    commit_and_learn_ids(&index, &store);
    evict_all(&index, &store);
    store.flush().unwrap(); // the rows leave the memtable for a cold SST
    let options = LookupOptions::default();
    let keys = |first: u32| {
        index.query_keys(
            &partition,
            &QueryBlocks::Tokens {
                token_ids: (first..first + 32).collect(),
                block_size: 4,
                extras: Vec::new(),
            },
        )
    };
    let rows = |a: &kvindex::index::Answer| {
        a.to_vec()
            .into_iter()
            .map(|m| (m.engine_id, m.matched_blocks))
            .collect::<Vec<_>>()
    };

    let held = keys(0);
    assert!(
        index.try_lookup_keys_with(&held, &options).is_none(),
        "a cold row must not be read on the caller's thread"
    );
    let blocking = index.lookup_keys_with(&held, &options);
    assert_eq!(rows(&blocking), [("a".into(), 8), ("b".into(), 8)]);
    let cached = index
        .try_lookup_keys_with(&held, &options)
        .expect("the blocking lookup left its rows in the block cache");
    assert_eq!(rows(&cached), rows(&blocking));

    let never_stored = keys(1000);
    let none = index
        .try_lookup_keys_with(&never_stored, &options)
        .expect("the filters rule out absent rows from memory");
    assert!(rows(&none).is_empty());
    assert!(rows(&index.lookup_keys_with(&never_stored, &options)).is_empty());
}
