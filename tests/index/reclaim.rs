//! Reclaiming what empties: an engine cleared (by its own `ALL_CLEARED`, an operator or the
//! liveness TTL) and a partition left empty give back their slots, their durable ids and their
//! rows. A fleet whose engine ids churn keeps tables as large as the engines live at once, in
//! memory and on disk, and a reused slot never inherits what its previous engine held.

use crate::spill::{commit_and_learn_ids, evict_all, tiered_shard};
use crate::support::events::stored;
use kvindex::event::{Event, EventKind, PartitionKey};
use kvindex::index::{Index, IndexSettings, QueryBlocks};
use kvindex::spill::testing::Fault;
use kvindex::store::{Store, StoreSettings};
use std::sync::Arc;

const BS: u32 = 4;

fn adapter(a: &str) -> PartitionKey {
    PartitionKey::new("", "m", a)
}

/// `engine` stores `blocks` blocks of tokens starting at `first` in `partition`.
fn chain(engine: &str, partition: PartitionKey, first: u32, blocks: u32) -> Event {
    stored(engine, partition)
        .hashes((0..blocks as u64).map(|i| 1000 + u64::from(first) + i))
        .tokens(first..first + blocks * BS, BS)
        .event()
}

fn cleared(engine: &str) -> Event {
    Event::new(EventKind::AllCleared, engine, adapter(""))
}

/// Engines matching the chain of `blocks` blocks from token `first`, with their match length.
fn holders(index: &Index, partition: &PartitionKey, first: u32, blocks: u32) -> Vec<(String, u32)> {
    let q = QueryBlocks::Tokens {
        token_ids: (first..first + blocks * BS).collect(),
        block_size: BS,
        extras: Vec::new(),
    };
    let mut rows: Vec<_> = index
        .lookup(partition, &q)
        .1
        .to_vec()
        .into_iter()
        .map(|m| (m.engine_id, m.matched_blocks))
        .collect();
    rows.sort();
    rows
}

fn listed(index: &Index) -> Vec<String> {
    index.engines().into_iter().map(|e| e.engine_id).collect()
}

fn reload(store: &Store) -> Index {
    let index = Index::new(IndexSettings { shards: 1, seed: 1 });
    store
        .load_shard(0, &mut index.shard(0).write())
        .expect("loads");
    index.shard(0).write().enable_change_tracking();
    index
}

#[test]
fn churning_engine_ids_keep_the_tables_and_the_registry_as_large_as_the_live_fleet() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    index.apply(&chain("keeper", adapter(""), 0, 3), 1).unwrap();
    for round in 0..300u32 {
        // A pod comes up under a new name, serves an adapter of its own, and goes away.
        let (engine, lora) = (format!("pod-{round}"), adapter(&format!("lora-{round}")));
        index
            .apply(&chain(&engine, lora.clone(), 100, 2), 1)
            .unwrap();
        index.apply(&chain(&engine, adapter(""), 0, 2), 1).unwrap();
        if round % 3 == 0 {
            commit_and_learn_ids(&index, &store); // durable while it lives, every third pod
            if round % 2 == 0 {
                evict_all(&index, &store); // and in L2 only when it goes, every sixth
            }
        }
        assert_eq!(holders(&index, &lora, 100, 2), [(engine.clone(), 2)]);
        index.apply(&cleared(&engine), 1).unwrap();
        assert!(holders(&index, &lora, 100, 2).is_empty());
        assert_eq!(listed(&index), ["keeper"], "round {round}");
        commit_and_learn_ids(&index, &store);
    }
    let shard = index.shard(0).read();
    assert_eq!(shard.engines().count(), 1);
    assert_eq!(shard.partitions().count(), 1);
    // One slot for the keeper, one for the pod of the moment (and one per partition).
    assert_eq!(shard.slots(), (2, 2), "slots are reused");
    assert_eq!(store.durable_names(), (1, 1), "durable ids are released");
    drop(shard);
    assert_eq!(holders(&index, &adapter(""), 0, 3), [("keeper".into(), 3)]);

    // On disk: the registry and the shard's rows hold the keeper and its partition only.
    drop(index);
    let store = Arc::into_inner(store).expect("the only handle");
    let path = dir.path().to_path_buf();
    drop(store);
    let store = Store::open(
        &path,
        &StoreSettings {
            shards: 1,
            seed: 1,
            sync: false,
        },
    )
    .unwrap();
    assert_eq!(store.durable_names(), (1, 1));
    let again = reload(&store);
    assert_eq!(listed(&again), ["keeper"]);
    assert_eq!(again.shard(0).read().slots(), (1, 1));
    assert_eq!(holders(&again, &adapter(""), 0, 3), [("keeper".into(), 3)]);
    assert!(holders(&again, &adapter("lora-299"), 100, 2).is_empty());
}

/// A slot (and a durable id) freed by one engine and taken by the next: nothing the first held,
/// in L1 or in L2, is ever reported as the second's, before or after a restart.
#[test]
fn a_reused_slot_never_inherits_what_its_previous_engine_held() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    index.apply(&chain("old", adapter(""), 0, 4), 1).unwrap();
    commit_and_learn_ids(&index, &store);
    evict_all(&index, &store);
    index.apply(&cleared("old"), 1).unwrap();
    commit_and_learn_ids(&index, &store);
    assert_eq!(index.shard(0).read().slots(), (1, 1));
    assert_eq!(store.durable_names(), (0, 0));

    index.apply(&chain("new", adapter(""), 50, 3), 1).unwrap();
    commit_and_learn_ids(&index, &store);
    assert_eq!(
        index.shard(0).read().slots(),
        (1, 1),
        "the freed slots were reused"
    );
    assert_eq!(store.durable_names(), (1, 1));
    evict_all(&index, &store);
    for index in [&*index, &reload(&store)] {
        assert!(holders(index, &adapter(""), 0, 4).is_empty());
        assert_eq!(holders(index, &adapter(""), 50, 3), [("new".into(), 3)]);
        assert_eq!(listed(index), ["new"]);
    }
}

/// A commit that fails frees nothing: the engine stays retired in what lookups and listings
/// show, its slot is not reused, and the next commit that succeeds frees it.
#[test]
fn a_slot_is_freed_only_once_the_commit_retiring_it_succeeded() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    index.apply(&chain("a", adapter(""), 0, 2), 1).unwrap();
    commit_and_learn_ids(&index, &store);
    index.apply(&cleared("a"), 1).unwrap();
    assert!(listed(&index).is_empty(), "a cleared engine is not listed");

    let changes = index.shard(0).write().take_changes();
    assert_eq!(changes.retired_engines.len(), 1);
    store.faults().inject_next(Fault::Fail);
    assert!(store.commit(0, &changes, &[]).is_err());
    index.shard(0).write().requeue_changes(&changes);
    assert!(listed(&index).is_empty(), "still retired after the failure");
    // A new engine meanwhile takes a new slot: the old one is not free yet.
    index.apply(&chain("b", adapter(""), 0, 2), 1).unwrap();
    assert_eq!(index.shard(0).read().slots().0, 2);

    commit_and_learn_ids(&index, &store);
    assert_eq!(listed(&index), ["b"]);
    assert_eq!(store.durable_names(), (1, 1));
    index.apply(&chain("c", adapter(""), 0, 2), 1).unwrap();
    assert_eq!(index.shard(0).read().slots().0, 2, "c took a's slot");
    commit_and_learn_ids(&index, &store);
    let again = reload(&store);
    assert_eq!(listed(&again), ["b", "c"]);
    assert_eq!(
        holders(&again, &adapter(""), 0, 2),
        [("b".into(), 2), ("c".into(), 2)]
    );
}

/// A store that is skipped leaves no engine or partition behind, and an engine that only ever
/// reported liveness stays listed (it is not empty for good, only idle).
#[test]
fn skipped_stores_leave_no_names_behind_and_heartbeats_keep_an_engine_listed() {
    let dir = tempfile::tempdir().unwrap();
    let (index, store) = tiered_shard(dir.path());
    let heartbeat = Event::new(EventKind::ReplicaUpdated, "idle", adapter(""));
    index.apply(&heartbeat, 1).unwrap();
    let mut slots = Vec::new();
    for round in 0..3 {
        for i in 0..50 {
            let mut orphan = chain(
                &format!("bad-{round}-{i}"),
                adapter(&format!("x-{i}")),
                0,
                2,
            );
            orphan.parent_hash = Some(kvindex::event::EngineHash(7)); // never stored: skipped
            assert!(index.apply(&orphan, 1).is_err());
        }
        assert_eq!(listed(&index), ["idle"]);
        assert_eq!(index.shard(0).read().partitions().count(), 0);
        commit_and_learn_ids(&index, &store);
        slots.push(index.shard(0).read().slots());
    }
    assert_eq!(slots, [(51, 50); 3], "the skipped stores' slots are reused");
    assert_eq!(store.durable_names(), (1, 0));
    assert_eq!(listed(&reload(&store)), ["idle"]);

    // In a shard that persists nothing, the same holds at once.
    let plain = Index::new(IndexSettings { shards: 1, seed: 1 });
    plain.apply(&chain("gone", adapter("x"), 0, 2), 1).unwrap();
    plain.apply(&cleared("gone"), 1).unwrap();
    plain.apply(&heartbeat, 1).unwrap();
    assert_eq!(listed(&plain), ["idle"]);
    assert_eq!(plain.shard(0).read().partitions().count(), 0);
    plain.apply(&chain("next", adapter("y"), 0, 2), 1).unwrap();
    assert_eq!(plain.shard(0).read().slots(), (2, 1));
}
