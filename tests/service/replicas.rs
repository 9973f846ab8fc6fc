//! Replicas of one index (HA mode): two `kvindex serve` processes, each with its own data dir
//! and the default consumer names, on one NATS stream and on one Kafka topic. Each indexes
//! everything, neither disturbs the other, a `kill -9` of one loses nothing, and every answer
//! says how far its replica had applied. Also: a durable another replica pulls from is not
//! taken over, and `kvindex replay` never touches a serving replica's consumer.

use crate::harness::*;
use crate::support::brokers::NATS_URL;
use crate::support::*;
use kvindex::event::PartitionKey;
use kvindex::index::Index;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::{EmbeddedBroker, KafkaPublisher, NatsPublisher};
use serde_json::{Value, json};
use std::path::Path;

fn nats_config(dir: &Path, stream: &str, prefix: &str, extra: &str) -> String {
    write_config(
        dir,
        &format!(
            r#"
[source]
kind = "nats"
[source.nats]
url = "{NATS_URL}"
stream = "{stream}"
subjects = ["{prefix}.>"]
{extra}
[index]
shards = 2
seed = {SEED}
"#
        ),
    )
}

/// A new stream (name, subject prefix) on the local NATS server and a publisher into it.
async fn new_stream(tag: &str) -> (String, String, NatsPublisher) {
    let stream = unique(tag);
    let prefix = format!("{}.{}", tag.to_lowercase(), stream.to_lowercase());
    let p = nats_publisher().await;
    p.ensure_stream(&stream, &[format!("{prefix}.>")])
        .await
        .unwrap();
    (stream, prefix, p)
}

fn replica_id(kv: &Kvindex) -> String {
    kv.stats()["replica_id"]
        .as_str()
        .expect("/v1/stats names the replica")
        .to_string()
}

/// Both replicas answer every query exactly as the reference does.
fn assert_answers(replicas: &[&Kvindex], reference: &Index, queries: &[(PartitionKey, Vec<u32>)]) {
    for (p, t) in queries {
        let want = reference_answer(reference, p, t);
        for kv in replicas {
            assert_eq!(http_answer(kv, p, t), want, "query of {p:?}");
        }
    }
}

/// The `applied` member of a lookup answer: (source, partition → next offset).
fn applied(kv: &Kvindex) -> (String, Vec<(String, i64)>) {
    let (status, body) = kv.post(
        "/v1/lookup",
        &json!({"model": "any", "token_ids": [1, 2], "block_size": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let a = &body["applied"];
    let offsets = a["next_offsets"]
        .as_object()
        .unwrap_or_else(|| panic!("no applied offsets in {body}"))
        .iter()
        .map(|(p, n)| (p.clone(), n.as_i64().unwrap()))
        .collect();
    (a["source"].as_str().unwrap().to_string(), offsets)
}

/// Waits until `kv`'s answers reflect every event below `log_end`: the `applied` offsets its
/// lookups carry (what every shard has applied, where a source's position may run ahead of
/// the shards) sum to it.
fn wait_applied(kv: &Kvindex, log_end: usize) {
    wait_for("the answers to reflect the whole log", CATCH_UP, || {
        let applied: i64 = applied(kv).1.iter().map(|(_, next)| next).sum();
        (applied >= log_end as i64).then_some(())
    })
}

async fn consumer_names(stream: &str) -> Vec<String> {
    use futures::TryStreamExt;
    let js = async_nats::jetstream::new(require_nats(NATS_URL).await);
    let mut names: Vec<String> = js
        .get_stream(stream)
        .await
        .unwrap()
        .consumer_names()
        .try_collect()
        .await
        .unwrap();
    names.sort();
    names
}

async fn consumer_created(stream: &str, durable: &str) -> String {
    let js = async_nats::jetstream::new(require_nats(NATS_URL).await);
    let info = js
        .get_stream(stream)
        .await
        .unwrap()
        .consumer_info(durable)
        .await
        .unwrap_or_else(|e| panic!("consumer {durable}: {e}"));
    format!("{:?}", info.created)
}

async fn delete_stream(stream: &str) {
    let js = async_nats::jetstream::new(require_nats(NATS_URL).await);
    let _ = js.delete_stream(stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_stream_each_index_everything_and_survive_a_kill() {
    let (stream, prefix, mut p) = new_stream("KVHA").await;
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let config_a = nats_config(dir_a.path(), &stream, &prefix, "");
    let config_b = nats_config(dir_b.path(), &stream, &prefix, "");
    let (data_a, data_b) = (dir_a.path().join("data"), dir_b.path().join("data"));
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut sent = produce_nats(&mut p, &prefix, &mut fleet, &reference, 60).await;

    let a = blocking(|| spawn_kvindex(&["serve", "--config", &config_a], &data_a, &[], START));
    let b = blocking(|| spawn_kvindex(&["serve", "--config", &config_b], &data_b, &[], START));
    let (id_a, id_b) = (replica_id(&a), replica_id(&b));
    assert_ne!(id_a, id_b, "each data dir has its own replica id");
    for kv in [&a, &b] {
        blocking(|| wait_applied(kv, sent + 1));
    }
    let queries: Vec<_> = (0..12).map(|_| fleet.sample_query()).collect();
    assert_answers(&[&a, &b], &reference, &queries);
    let mut durables = vec![format!("kvindex-{id_a}"), format!("kvindex-{id_b}")];
    durables.sort();
    assert_eq!(
        consumer_names(&stream).await,
        durables,
        "one durable per replica, named after it"
    );
    let source = format!("nats:{stream}");
    for kv in [&a, &b] {
        assert_eq!(
            applied(kv),
            (source.clone(), vec![("0".to_string(), sent as i64 + 1)]),
            "caught up: everything below the next sequence is applied"
        );
    }
    let created_a = consumer_created(&stream, &format!("kvindex-{id_a}")).await;

    // B dies mid-stream; A goes on alone, undisturbed.
    blocking(|| b.kill9());
    sent += produce_nats(&mut p, &prefix, &mut fleet, &reference, 40).await;
    blocking(|| wait_applied(&a, sent + 1));
    assert_answers(&[&a], &reference, &queries);

    // B comes back as itself, resumes from its own checkpoint and converges.
    let b = blocking(|| spawn_kvindex(&["serve", "--config", &config_b], &data_b, &[], START));
    assert_eq!(
        replica_id(&b),
        id_b,
        "the replica id is kept in the data dir"
    );
    sent += produce_nats(&mut p, &prefix, &mut fleet, &reference, 20).await;
    for kv in [&a, &b] {
        blocking(|| wait_applied(kv, sent + 1));
        let stats = kv.stats();
        assert_eq!(
            stats["index"]["memberships"].as_u64().unwrap(),
            reference.stats().memberships
        );
    }
    assert_answers(&[&a, &b], &reference, &queries);
    assert_eq!(applied(&a), applied(&b));
    assert_eq!(
        consumer_names(&stream).await.len(),
        2,
        "B reused its own durable"
    );
    assert_eq!(
        consumer_created(&stream, &format!("kvindex-{id_a}")).await,
        created_a,
        "A's consumer was never recreated"
    );
    blocking(|| a.terminate());
    blocking(|| b.terminate());
    delete_stream(&stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_another_replica_pulls_from_is_left_alone() {
    let (stream, prefix, mut p) = new_stream("KVSHARED").await;
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shared = "durable = \"shared\"";
    let config_a = nats_config(dir_a.path(), &stream, &prefix, shared);
    let config_b = nats_config(dir_b.path(), &stream, &prefix, shared);
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut sent = produce_nats(&mut p, &prefix, &mut fleet, &reference, 30).await;
    let data_a = dir_a.path().join("data");
    let a = blocking(|| spawn_kvindex(&["serve", "--config", &config_a], &data_a, &[], START));
    blocking(|| wait_applied(&a, sent + 1));
    let created = consumer_created(&stream, "shared").await;

    let data_b = dir_b.path().join("data");
    let b = blocking(|| spawn_kvindex(&["serve", "--config", &config_b], &data_b, &[], START));
    let error = blocking(|| {
        wait_for("B to report the conflict", CATCH_UP, || {
            b.stats()["sources"]["error"]
                .as_str()
                .map(str::to_string)
                .filter(|e| e.contains("in use by replica"))
        })
    });
    assert!(error.contains(&replica_id(&a)), "{error}");
    sent += produce_nats(&mut p, &prefix, &mut fleet, &reference, 30).await;
    blocking(|| wait_applied(&a, sent + 1));
    let queries: Vec<_> = (0..8).map(|_| fleet.sample_query()).collect();
    assert_answers(&[&a], &reference, &queries);
    assert_eq!(consumer_created(&stream, "shared").await, created);
    assert_eq!(
        b.stats()["events"]["applied_total"],
        0,
        "B consumed nothing"
    );
    blocking(|| b.terminate());
    blocking(|| a.terminate());
    delete_stream(&stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reads_through_a_consumer_of_its_own() {
    let (stream, prefix, mut p) = new_stream("KVREPLAY").await;
    let dir = tempfile::tempdir().unwrap();
    let config = nats_config(dir.path(), &stream, &prefix, "");
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let sent = produce_nats(&mut p, &prefix, &mut fleet, &reference, 30).await;
    let data = dir.path().join("serving");
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    blocking(|| wait_applied(&kv, sent + 1));
    let serving = format!("kvindex-{}", replica_id(&kv));
    let created = consumer_created(&stream, &serving).await;

    let rebuilt = dir.path().join("rebuilt");
    let out = blocking(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"))
            .args(["replay", "--config", &config, "--data-dir"])
            .arg(&rebuilt)
            .env("KVINDEX_LOG", "warn")
            .output()
            .expect("running kvindex replay")
    });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        consumer_names(&stream).await,
        vec![serving.clone()],
        "the replay's consumer is gone, the serving one is still there"
    );
    assert_eq!(consumer_created(&stream, &serving).await, created);
    let more = produce_nats(&mut p, &prefix, &mut fleet, &reference, 10).await;
    blocking(|| wait_applied(&kv, sent + more + 1));
    let queries: Vec<_> = (0..8).map(|_| fleet.sample_query()).collect();
    assert_answers(&[&kv], &reference, &queries);
    blocking(|| kv.terminate());
    delete_stream(&stream).await;
}

fn high_watermarks(stats: &Value) -> Vec<i64> {
    stats["sources"]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["high_watermark"].as_i64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_topic_each_read_every_partition() {
    let topic = "kv-ha";
    let partitions = 3;
    let broker = EmbeddedBroker::start(topic, partitions).unwrap();
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    let config = |dir: &Path| {
        write_config(
            dir,
            &format!(
                "[source]\nkind = \"kafka\"\n[source.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n\
                 [index]\nshards = 2\nseed = {SEED}\n",
                broker.bootstrap_servers()
            ),
        )
    };
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (config_a, config_b) = (config(dir_a.path()), config(dir_b.path()));
    let (data_a, data_b) = (dir_a.path().join("data"), dir_b.path().join("data"));
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut total = produce(&publisher, &mut fleet, &reference, 60).await;

    let a = blocking(|| spawn_kvindex(&["serve", "--config", &config_a], &data_a, &[], START));
    let b = blocking(|| spawn_kvindex(&["serve", "--config", &config_b], &data_b, &[], START));
    for kv in [&a, &b] {
        blocking(|| wait_applied(kv, total));
        // The source's own view lags the answers' by up to a status refresh.
        let stats = blocking(|| wait_caught_up(kv, total));
        assert_eq!(
            stats["sources"]["partitions"].as_array().unwrap().len(),
            partitions as usize,
            "every replica reads every partition"
        );
    }
    let queries: Vec<_> = (0..12).map(|_| fleet.sample_query()).collect();
    assert_answers(&[&a, &b], &reference, &queries);

    blocking(|| a.kill9());
    total += produce(&publisher, &mut fleet, &reference, 40).await;
    blocking(|| wait_applied(&b, total));
    // The source's view too, for log ends that are fresh.
    let stats = blocking(|| wait_caught_up(&b, total));
    assert_answers(&[&b], &reference, &queries);
    let a = blocking(|| spawn_kvindex(&["serve", "--config", &config_a], &data_a, &[], START));
    blocking(|| wait_applied(&a, total));
    assert_answers(&[&a, &b], &reference, &queries);
    assert_eq!(applied(&a), applied(&b));
    let (source, offsets) = applied(&a);
    assert_eq!(source, format!("kafka:{topic}"));
    let highs = high_watermarks(&stats);
    assert_eq!(
        offsets.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        highs,
        "caught up: next offsets at the high watermarks"
    );

    // Each commits to a group of its own, for lag tools.
    for kv in [&a, &b] {
        let group = format!("kvindex-{}", replica_id(kv));
        blocking(|| {
            wait_for(
                "the replica's own group to hold its offsets",
                CATCH_UP,
                || (committed(&broker, topic, &group, partitions) == highs).then_some(()),
            )
        });
    }
    blocking(|| a.terminate());
    blocking(|| b.terminate());
}
