//! The durable pipeline in process: redelivered messages are skipped and counted, state is
//! unchanged by them, offsets survive a reopen, and events below a shard's durable offset are
//! not applied twice after it.

mod support;

use kvindex::config::Config;
use kvindex::event::encode;
use kvindex::produce::{Fleet, FleetConfig};
use kvindex::service::Service;
use kvindex::source::Message;
use std::sync::atomic::Ordering::Relaxed;
use support::fingerprint;

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
    let mut fleet = Fleet::new(FleetConfig {
        capacity_blocks: 128,
        ..FleetConfig::default()
    });
    let batch = messages(&mut fleet, 0, 200);
    let later = messages(&mut fleet, 200, 50);
    let queries: Vec<_> = (0..16).map(|_| fleet.sample_query()).collect();
    let opts = Config::default().decode_options();

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

    // Reopened: warm, and a re-read from below the checkpoint applies only what is new.
    let service = Service::open(config(dir.path()), None).unwrap();
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
    let reference = kvindex::index::Index::new(kvindex::index::IndexConfig {
        shards: 2,
        seed: Config::default().index.seed,
    });
    let mut fleet = Fleet::new(FleetConfig {
        capacity_blocks: 128,
        ..FleetConfig::default()
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
