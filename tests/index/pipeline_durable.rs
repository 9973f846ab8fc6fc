//! The durable pipeline in process: redelivered messages (a whole batch again, and a consumer
//! seeking back to the start of a real Kafka-protocol log) are skipped and counted as
//! duplicates and leave the state unchanged; offsets survive a reopen, and events below a
//! shard's durable offset are not applied twice after it.

use crate::support::fingerprint;
use kvindex::config::Config;
use kvindex::event::{DecodeSettings, encode};
use kvindex::service::Service;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::{EventSource, Message};
use std::sync::atomic::Ordering::Relaxed;

const SOURCE: &str = "kafka:kv-test";

fn config(dir: &std::path::Path) -> Config {
    let mut c = Config {
        data_dir: dir.to_path_buf(),
        ..Config::default()
    };
    c.index.shards = 2;
    c
}

/// `n` messages of fleet traffic on partition 0 from `offset`, one request each.
fn messages(fleet: &mut Fleet, offset: i64, n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let events = fleet.next_request();
            Message {
                partition: 0,
                offset: offset + i as i64,
                payload: encode::to_proto(&events),
                ..Message::default()
            }
        })
        .collect()
}

#[test]
fn redelivery_is_skipped_counted_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = Fleet::new(FleetSettings {
        capacity_blocks: 128,
        ..FleetSettings::default()
    });
    let batch = messages(&mut fleet, 0, 200);
    let later = messages(&mut fleet, 200, 50);
    let queries: Vec<_> = (0..16).map(|_| fleet.sample_query()).collect();
    let opts = DecodeSettings::from(&Config::default().source);

    let service = Service::open(config(dir.path()), None).unwrap();
    let p = &service.pipeline;
    let first = p.ingest_batch(SOURCE, &batch, &opts).unwrap();
    assert!(first.events > 200);
    assert!(p.persist());
    let before = fingerprint(&service.index, &queries, 16);
    assert!(before.answers.iter().any(|a| !a.is_empty()), "vacuous");
    assert_eq!(service.metrics.duplicates.load(Relaxed), 0);

    // A seek back / redelivery of the whole batch: every event is a duplicate.
    p.ingest_batch(SOURCE, &batch, &opts).unwrap();
    assert!(p.persist());
    assert_eq!(
        service.metrics.duplicates.load(Relaxed) as usize,
        first.events
    );
    let part = p.progress().of_source(SOURCE);
    assert_eq!(part[0].duplicates.load(Relaxed) as usize, first.events);
    assert_eq!(part[0].durable_next(), Some(200));
    assert_eq!(fingerprint(&service.index, &queries, 16), before);
    drop(service);

    // Reopened: answers at once (from L2 while rows load), then warm; and a re-read from
    // below the checkpoint applies only what is new.
    let service = Service::open(config(dir.path()), None).unwrap();
    assert_eq!(
        fingerprint(&service.index, &queries, 16).answers,
        before.answers,
        "answers while warming"
    );
    let loaded = service.wait_warm().expect("the store loads");
    assert!(loaded.blocks > 0 && loaded.engines > 0, "{loaded:?}");
    assert_eq!(
        fingerprint(&service.index, &queries, 16),
        before,
        "warm reload"
    );
    use kvindex::source::Checkpoints;
    assert_eq!(service.pipeline.next_offset(SOURCE, 0), Some(200));
    let mut overlap = batch[150..].to_vec();
    overlap.extend(later.iter().cloned());
    let stats = service
        .pipeline
        .ingest_batch(SOURCE, &overlap, &opts)
        .unwrap();
    assert!(service.pipeline.persist());
    let replayed: usize = stats.events;
    let dups = service.metrics.duplicates.load(Relaxed) as usize;
    assert!(dups > 0 && dups < replayed, "{dups} of {replayed}");
    assert_eq!(service.pipeline.next_offset(SOURCE, 0), Some(250));

    // The same state as applying everything once, in memory only.
    let reference = kvindex::index::Index::new(kvindex::index::IndexSettings {
        shards: 2,
        seed: Config::default().index.seed,
    });
    let mut fleet = Fleet::new(FleetSettings {
        capacity_blocks: 128,
        ..FleetSettings::default()
    });
    for _ in 0..250 {
        for ev in fleet.next_request() {
            let _ = reference.apply(&ev, 0);
        }
    }
    assert_eq!(
        fingerprint(&service.index, &queries, 16),
        fingerprint(&reference, &queries, 16)
    );
}

/// Reads every message of `topic` from the log start with a fresh consumer (a seek back to
/// earliest) and hands them to the service's pipeline as the real ingest loop does.
async fn read_all_from_start(
    broker: &kvindex::source::EmbeddedBroker,
    topic: &str,
    service: &Service,
    expect: usize,
) {
    let settings = kvindex::source::KafkaSettings {
        brokers: broker.bootstrap_servers(),
        topic: topic.into(),
        group_id: None,
        subscribe: false,
        partitions: None,
        start: kvindex::config::StartPosition::Earliest,
        properties: Default::default(),
        reset_on_divergence: false,
        log_is_ephemeral: false,
    };
    let mut source = kvindex::source::KafkaSource::connect(
        settings,
        std::sync::Arc::new(kvindex::source::NoCheckpoints),
    )
    .await
    .unwrap();
    let opts = DecodeSettings::from(&service.config.source);
    let source_name = source.name();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut seen = 0;
    while seen < expect {
        assert!(
            std::time::Instant::now() < deadline,
            "read {seen} of {expect}"
        );
        let batch = source
            .next_batch(512, std::time::Duration::from_millis(200))
            .await
            .unwrap();
        seen += batch.len();
        service
            .pipeline
            .ingest_batch(&source_name, &batch, &opts)
            .unwrap();
    }
    assert!(service.pipeline.persist());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seek_back_on_a_real_broker_is_skipped_and_counted() {
    let topic = "kv-seek-back";
    let broker = kvindex::source::EmbeddedBroker::start(topic, 2).unwrap();
    let publisher = kvindex::source::KafkaPublisher::new(
        &broker.bootstrap_servers(),
        topic,
        &Default::default(),
    )
    .unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let mut messages = 0;
    for _ in 0..80 {
        messages += crate::support::publish_kafka(&publisher, &fleet.next_request()).await;
    }
    publisher
        .flush(std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let queries: Vec<_> = (0..16).map(|_| fleet.sample_query()).collect();

    let dir = tempfile::tempdir().unwrap();
    let service = Service::open(config(dir.path()), None).unwrap();
    read_all_from_start(&broker, topic, &service, messages).await;
    let applied = service.metrics.applied_total();
    let before = fingerprint(&service.index, &queries, 16);
    assert!(before.answers.iter().any(|a| !a.is_empty()), "vacuous");
    assert_eq!(service.metrics.duplicates.load(Relaxed), 0);

    // The same log again from offset 0: every event is a duplicate, nothing changes.
    read_all_from_start(&broker, topic, &service, messages).await;
    assert_eq!(service.metrics.duplicates.load(Relaxed), applied);
    assert_eq!(service.metrics.applied_total(), applied);
    assert_eq!(fingerprint(&service.index, &queries, 16), before);
}

#[test]
fn block_sizes_are_pinned_durably_and_conflicts_counted() {
    use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey};
    use kvindex::index::QueryBlocks;
    let dir = tempfile::tempdir().unwrap();
    let opts = DecodeSettings::from(&Config::default().source);
    let tokens: Vec<u32> = (0..64).collect();
    let stored = |engine: &str, block_size: u32| {
        let mut ev = Event::new(EventKind::Stored, engine, PartitionKey::new("t", "m32", ""));
        let blocks = 64 / block_size as usize;
        ev.block_hashes = (0..blocks as u64).map(EngineHash).collect();
        ev.content = BlockContent::Tokens {
            token_ids: tokens.clone(),
            block_size,
        };
        ev
    };
    let message = |offset: i64, ev: &Event| Message {
        partition: 0,
        offset,
        payload: encode::to_proto(std::slice::from_ref(ev)),
        ..Message::default()
    };
    {
        let service = Service::open(config(dir.path()), None).unwrap();
        let p = &service.pipeline;
        // 32-token blocks first; then another engine of the same model says 16.
        let batch = [message(0, &stored("a", 32)), message(1, &stored("b", 16))];
        p.ingest_batch(SOURCE, &batch, &opts).unwrap();
        assert!(p.persist());
        assert_eq!(
            service.index.block_size("t", "m32"),
            Some(32),
            "the first size is pinned"
        );
        assert_eq!(service.index.block_size_conflicts(), 1);
        let page = service.metrics.render(&service.index.stats());
        assert!(
            page.contains("kvindex_block_size_conflicts_total 1"),
            "{page}"
        );
    }
    // After a restart the pin is back before any event arrives: a token lookup that names no
    // block size is keyed as before.
    let service = Service::open(config(dir.path()), None).unwrap();
    assert_eq!(service.index.block_size("t", "m32"), Some(32));
    let (_, rows) = service.index.lookup(
        &PartitionKey::new("t", "m32", ""),
        &QueryBlocks::Tokens {
            token_ids: tokens.clone(),
            block_size: service.index.block_size("t", "m32").unwrap(),
            extras: Vec::new(),
        },
    );
    assert!(
        rows.iter()
            .any(|r| r.engine_id == "a" && r.matched_blocks == 2),
        "{rows:?}"
    );
    let stats = service.index.stats();
    assert_eq!(stats.block_sizes.len(), 1);
    assert_eq!(stats.block_sizes[0].block_size, 32);
}

#[test]
fn an_engine_silent_past_the_ttl_is_cleared_durably_once_caught_up() {
    use kvindex::event::{Event, EventKind, PartitionKey};
    use kvindex::index::QueryBlocks;
    let dir = tempfile::tempdir().unwrap();
    let opts = DecodeSettings::from(&Config::default().source);
    let mut cfg = config(dir.path());
    cfg.index.engine_ttl_s = 2;
    let partition = PartitionKey::new("", "m", "");
    let tokens: Vec<u32> = (0..32).collect();
    let stored = |engine: &str| {
        crate::support::events::stored(engine, partition.clone())
            .hashes([1, 2])
            .tokens(tokens.clone(), 16)
            .event()
    };
    let message = |offset: i64, ev: &Event| Message {
        partition: 0,
        offset,
        payload: encode::to_proto(std::slice::from_ref(ev)),
        ..Message::default()
    };
    let holders = |service: &Service| -> Vec<String> {
        let (_, rows) = service.index.lookup(
            &partition,
            &QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size: 16,
                extras: Vec::new(),
            },
        );
        let mut ids: Vec<String> = rows.iter().map(|r| r.engine_id.to_string()).collect();
        ids.sort();
        ids
    };
    {
        let service = Service::open(cfg.clone(), None).unwrap();
        let p = &service.pipeline;
        p.ingest_batch(
            SOURCE,
            &[message(0, &stored("a")), message(1, &stored("b"))],
            &opts,
        )
        .unwrap();
        assert!(p.persist());
        // Not caught up yet: a backlog is not silence, nothing expires.
        std::thread::sleep(std::time::Duration::from_millis(2500));
        p.flush();
        assert_eq!(holders(&service), ["a", "b"]);
        // Caught up: both get a full TTL from here (their events are older than the TTL, but
        // they were applied during the backlog); `b` keeps talking, `a` stays silent.
        service.ready.store(true, Relaxed);
        let caught_up = std::time::Instant::now();
        let mut offset = 2;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while holders(&service) != ["b"] {
            assert!(
                std::time::Instant::now() < deadline,
                "a never expired: {:?}",
                holders(&service)
            );
            let heartbeat = Event::new(EventKind::ReplicaUpdated, "b", partition.clone());
            p.ingest_batch(SOURCE, &[message(offset, &heartbeat)], &opts)
                .unwrap();
            offset += 1;
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        assert!(caught_up.elapsed() >= std::time::Duration::from_secs(2));
        assert_eq!(service.metrics.engines_expired.load(Relaxed), 1);
        assert!(p.persist());
        // And on an operator's word: `b` is dropped at once.
        assert_eq!(p.forget_engine("b"), Some(2));
        assert_eq!(p.forget_engine("nobody"), None);
        assert!(holders(&service).is_empty());
        // Both are reclaimed: not listed, and their durable ids and rows are gone.
        assert!(p.persist());
        assert!(service.index.engines().is_empty());
        assert_eq!(service.store.durable_names(), (0, 0));
        // The model's block size is kept: its next engine's token lookups need no event first.
        assert_eq!(service.index.block_size("", "m"), Some(16));
    }
    // Durable: after a restart neither comes back.
    let service = Service::open(cfg, None).unwrap();
    assert!(holders(&service).is_empty(), "{:?}", holders(&service));
    assert!(service.index.engines().is_empty());
    assert_eq!(service.store.durable_names(), (0, 0));
    assert_eq!(service.index.block_size("", "m"), Some(16));
}

#[test]
fn a_stored_offset_that_cannot_be_read_holds_the_assignment_until_it_can() {
    use kvindex::source::Checkpoints;
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let opts = DecodeSettings::from(&Config::default().source);
    let service = Service::open(config(dir.path()), None).unwrap();
    let p = service.pipeline.clone();
    p.ingest_batch(SOURCE, &messages(&mut fleet, 0, 20), &opts)
        .unwrap();
    assert!(p.persist());
    assert_eq!(p.next_offset(SOURCE, 0), Some(20));

    // The store cannot be read: the source's assignment waits rather than falling back to
    // its configured start (which could skip or repeat events).
    service.store.fail_reads(true);
    let (tx, rx) = std::sync::mpsc::channel();
    let asking = p.clone();
    let waiter = std::thread::spawn(move || tx.send(asking.next_offset(SOURCE, 0)).unwrap());
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(500))
            .is_err(),
        "answered while the store could not be read"
    );
    service.store.fail_reads(false);
    let answer = rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    waiter.join().unwrap();
    assert_eq!(answer, Some(20));
}

/// A row that cannot be read back stops its shard's warm-up with an error naming the shard
/// and the row: the shard takes no event meanwhile, so none of its offsets moves, and the
/// next start (after a repair) resumes where the store's offsets say.
#[test]
fn a_corrupt_row_fails_the_warm_up_by_name_and_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let opts = DecodeSettings::from(&Config::default().source);
    {
        let service = Service::open(config(dir.path()), None).unwrap();
        let p = &service.pipeline;
        p.ingest_batch(SOURCE, &messages(&mut fleet, 0, 50), &opts)
            .unwrap();
        assert!(p.persist());
    }
    // Shard 0's first block row loses its holders' bytes.
    {
        let path = dir.path().join("index");
        let cfs = ["blocks", "maps", "offsets", "meta"];
        let db = rocksdb::DB::open_cf(&rocksdb::Options::default(), &path, cfs).unwrap();
        let blocks = db.cf_handle("blocks").unwrap();
        let key = {
            let mut it = db.raw_iterator_cf(blocks);
            it.seek([0u8, 0]);
            it.key().expect("shard 0 has a block row").to_vec()
        };
        assert_eq!(key[..2], [0, 0]);
        db.put_cf(blocks, &key, [0u8, 0, 0]).unwrap();
    }
    let service = Service::open(config(dir.path()), None).unwrap();
    let failed = service.wait_warm().expect_err("a corrupt row");
    assert_eq!(failed.shard, 0);
    assert!(failed.error.contains("corrupt block row"), "{failed}");
    let report = service.pipeline.warm_up().report();
    assert!(!report.done && report.error.is_some(), "{report:?}");
    // Shard 0 takes no event: its offset stays where the store has it.
    let p = &service.pipeline;
    p.ingest_batch(SOURCE, &messages(&mut fleet, 50, 20), &opts)
        .unwrap();
    assert!(p.persist());
    let part = &p.progress().of_source(SOURCE)[0];
    assert_eq!(part.applied_at(0), 50, "shard 0 applied nothing");
    assert_eq!(part.applied_at(1), 70, "shard 1 goes on");
    assert_eq!(part.durable_next(), Some(50));
}
