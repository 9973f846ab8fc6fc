//! The real `kvindex serve` binary end to end: the embedded default, warm restarts, readiness,
//! per-partition stats, Kafka commits after durability, divergence with and without
//! `--reset-on-divergence`, broker faults, and NATS JetStream (at 127.0.0.1:4222; these
//! tests fail if it is not running).

use crate::harness::*;
use crate::support::*;
use kvindex::event::Event;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::nats::NatsPublisher;
use kvindex::source::{EmbeddedBroker, KafkaPublisher};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_default_consumes_answers_and_restarts_warm() {
    let dir = tempfile::tempdir().unwrap();
    let kv = blocking(|| spawn_kvindex(&["serve"], dir.path(), &[], START));
    let bootstrap = kv
        .bootstrap
        .clone()
        .expect("the embedded broker's address is printed");
    let stats = kv.stats();
    assert_eq!(stats["sources"]["kind"], "embedded");
    assert_eq!(stats["sources"]["bootstrap_servers"], bootstrap.as_str());

    let publisher = KafkaPublisher::new(&bootstrap, "kv-events", &Default::default()).unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let messages = produce(&publisher, &mut fleet, &reference, 300).await;
    let stats = blocking(|| wait_caught_up(&kv, messages));
    assert_eq!(
        stats["sources"]["messages"].as_u64().unwrap() as usize,
        messages
    );
    assert_eq!(sum(&stats, "duplicates_skipped"), 0);
    blocking(|| wait_ready(&kv));
    let queries: Vec<_> = (0..16).map(|_| fleet.sample_query()).collect();
    let before: Vec<_> = queries
        .iter()
        .map(|(p, t)| http_answer(&kv, p, t))
        .collect();
    let want: Vec<_> = queries
        .iter()
        .map(|(p, t)| reference_answer(&reference, p, t))
        .collect();
    assert_eq!(before, want, "HTTP answers differ from the reference index");
    assert!(
        before.iter().any(|a| !a.is_empty()),
        "vacuous: nothing matched"
    );
    let memberships = stats["index"]["memberships"].clone();
    let (_, metrics) = kv.get("/metrics");
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(metrics.contains("kvindex_commits_total"), "{metrics}");
    assert!(
        metrics.contains("kvindex_source_lag{source=\"kafka:kv-events\",partition=\"0\"} 0"),
        "{metrics}"
    );
    // The whole page (index, sources, L1/L2 families) as Prometheus itself parses it.
    crate::support::assert_promtool_accepts(&metrics);
    blocking(|| kv.terminate());

    // Restart: a new, empty embedded log; the index answers from disk at once.
    let kv = blocking(|| spawn_kvindex(&["serve"], dir.path(), &[], START));
    let after: Vec<_> = queries
        .iter()
        .map(|(p, t)| http_answer(&kv, p, t))
        .collect();
    assert_eq!(after, before, "answers after the restart differ");
    // Counters are exact once every shard's rows are loaded.
    let stats = crate::support::wait_for("the warm-up", START, || {
        let stats = kv.stats();
        (stats["warm_up"]["done"] == true).then_some(stats)
    });
    assert_eq!(stats["index"]["memberships"], memberships, "warm restart");
    // The new log's offsets start at 0 again and are not mistaken for duplicates.
    let bootstrap = kv.bootstrap.clone().unwrap();
    let publisher = KafkaPublisher::new(&bootstrap, "kv-events", &Default::default()).unwrap();
    let messages = produce(&publisher, &mut fleet, &reference, 50).await;
    let stats = blocking(|| wait_caught_up(&kv, messages));
    assert_eq!(
        stats["sources"]["messages"].as_u64().unwrap() as usize,
        messages
    );
    assert_eq!(sum(&stats, "duplicates_skipped"), 0);
    let (p, t) = fleet.sample_query();
    assert_eq!(
        http_answer(&kv, &p, &t),
        reference_answer(&reference, &p, &t)
    );
    blocking(|| kv.terminate());
}

fn kafka_config(
    dir: &std::path::Path,
    broker: &EmbeddedBroker,
    topic: &str,
    group: &str,
) -> String {
    write_config(
        dir,
        &format!(
            r#"
[source]
kind = "kafka"
[source.kafka]
brokers = "{}"
topic = "{topic}"
group_id = "{group}"
[source.kafka.properties]
"session.timeout.ms" = "6000"
[index]
shards = 2
seed = {SEED}
"#,
            broker.bootstrap_servers()
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_group_commits_durable_offsets_and_rides_out_broker_faults() {
    let topic = "kv-group";
    let broker = EmbeddedBroker::start(topic, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = kafka_config(dir.path(), &broker, topic, "kvindex-test");
    let data = dir.path().join("data");
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut total = produce(&publisher, &mut fleet, &reference, 100).await;
    let stats = blocking(|| wait_caught_up(&kv, total));
    let highs: Vec<i64> = stats["sources"]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["high_watermark"].as_i64().unwrap())
        .collect();
    // The group's offsets follow the durable ones.
    blocking(|| {
        wait_for("the group commit", Duration::from_secs(20), || {
            (committed(&broker, topic, "kvindex-test", 2) == highs).then_some(())
        })
    });

    // The broker goes down: lookups keep being answered; production resumes when it is back.
    broker.mock().broker_down(1).unwrap();
    let (p, t) = fleet.sample_query();
    let during = http_answer(&kv, &p, &t);
    assert_eq!(during, reference_answer(&reference, &p, &t));
    let (status, _) = kv.get("/readyz");
    assert_eq!(status, 200, "ready stays latched through broker trouble");
    // Another fleet's traffic (same engine names, new hash seeds, as after engine restarts).
    let mut fleet2 = Fleet::new(FleetSettings {
        seed: 9,
        ..FleetSettings::default()
    });
    let pending: Vec<Vec<Event>> = (0..50).map(|_| fleet2.next_request()).collect();
    let publisher2 =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    for events in &pending {
        for ev in events {
            let _ = reference.apply(ev, 0);
        }
        total += publish_kafka(&publisher2, events).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        kv.get("/v1/stats").0,
        200,
        "stats answered while the broker is down"
    );
    broker.mock().broker_up(1).unwrap();
    publisher2.flush(Duration::from_secs(60)).await.unwrap();
    // Injected request errors on fetches are retried by the client.
    broker.mock().request_errors(
        rdkafka::types::RDKafkaApiKey::Fetch,
        &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION; 3],
    );
    total += produce(&publisher, &mut fleet, &reference, 20).await;
    blocking(|| wait_caught_up(&kv, total));
    for _ in 0..8 {
        let (p, t) = fleet.sample_query();
        assert_eq!(
            http_answer(&kv, &p, &t),
            reference_answer(&reference, &p, &t)
        );
    }
    blocking(|| kv.terminate());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_shorter_topic_is_a_divergence_unless_reset() {
    let topic = "kv-diverge";
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut fleet = Fleet::new(FleetSettings::default());
    {
        let broker = EmbeddedBroker::start(topic, 1).unwrap();
        let config = kafka_config(dir.path(), &broker, topic, "");
        let publisher =
            KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
        let n = produce(&publisher, &mut fleet, &reference_index(2), 60).await;
        let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
        blocking(|| wait_caught_up(&kv, n));
        blocking(|| kv.terminate());
    }
    // The "topic" is recreated: a new broker whose log is shorter than the checkpoint.
    let broker = EmbeddedBroker::start(topic, 1).unwrap();
    let config = kafka_config(dir.path(), &broker, topic, "");
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    let short = produce(&publisher, &mut fleet, &reference_index(2), 5).await;
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    let stats = blocking(|| {
        wait_for("the divergence to be reported", CATCH_UP, || {
            let s = kv.stats();
            let d = &s["sources"]["partitions"][0]["divergence"];
            (!d.is_null()).then_some(s)
        })
    });
    let d = &stats["sources"]["partitions"][0]["divergence"];
    assert_eq!(d["kind"], "ahead_of_log", "{d}");
    assert_eq!(d["high_watermark"].as_u64().unwrap() as usize, short);
    assert_eq!(stats["sources"]["divergences_total"], 1);
    let (status, body) = kv.get("/readyz");
    assert_eq!(status, 503, "{body}");
    let (_, metrics) = kv.get("/metrics");
    assert!(
        metrics.as_str().unwrap().contains(&format!(
            "kvindex_source_diverged{{source=\"kafka:{topic}\",partition=\"0\"}} 1"
        )),
        "{metrics}"
    );
    // Lookups are still answered from the durable state.
    assert!(stats["index"]["memberships"].as_u64().unwrap() > 0);
    blocking(|| kv.terminate());

    // With --reset-on-divergence the partition restarts from the configured start.
    let kv = blocking(|| {
        spawn_kvindex(
            &["serve", "--config", &config, "--reset-on-divergence"],
            &data,
            &[],
            START,
        )
    });
    let stats = blocking(|| wait_caught_up(&kv, short));
    assert!(stats["sources"]["partitions"][0]["divergence"].is_null());
    assert!(sum(&stats, "events_applied") as usize >= short);
    assert_eq!(
        sum(&stats, "duplicates_skipped"),
        0,
        "the new log is not mistaken for a replay"
    );
    blocking(|| wait_ready(&kv));
    blocking(|| kv.terminate());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_jetstream_end_to_end_with_restart_and_purge() {
    let stream = unique("KVSERVE");
    let prefix = format!("kvserve.{}", stream.to_lowercase());
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "nats"
[source.nats]
url = "nats://127.0.0.1:4222"
stream = "{stream}"
subjects = ["{prefix}.>"]
durable = "kvindex"
[index]
shards = 2
seed = {SEED}
"#
        ),
    );
    let mut p = nats_publisher().await;
    p.ensure_stream(&stream, &[format!("{prefix}.>")])
        .await
        .unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut sent = produce_nats(&mut p, &prefix, &mut fleet, &reference, 100).await;
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    let stats = blocking(|| wait_caught_up(&kv, sent + 1));
    assert_eq!(stats["sources"]["kind"], "nats");
    blocking(|| wait_ready(&kv));
    let queries: Vec<_> = (0..8).map(|_| fleet.sample_query()).collect();
    for (part, t) in &queries {
        assert_eq!(
            http_answer(&kv, part, t),
            reference_answer(&reference, part, t)
        );
    }
    blocking(|| kv.kill9());

    // Restart after kill -9: warm, resumes from the checkpoint, applies new messages.
    sent += produce_nats(&mut p, &prefix, &mut fleet, &reference, 20).await;
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    blocking(|| wait_caught_up(&kv, sent + 1));
    for (part, t) in &queries {
        assert_eq!(
            http_answer(&kv, part, t),
            reference_answer(&reference, part, t)
        );
    }
    blocking(|| kv.terminate());

    // Unread messages purged while kvindex was down: reported as events deleted.
    for _ in 0..10 {
        publish_nats(&mut p, &prefix, &fleet.next_request()).await;
    }
    p.flush().await.unwrap();
    let js = async_nats::jetstream::new(p.client().clone());
    js.get_stream(&stream).await.unwrap().purge().await.unwrap();
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    let stats = blocking(|| {
        wait_for("the purge to be reported", CATCH_UP, || {
            let s = kv.stats();
            (!s["sources"]["partitions"][0]["divergence"].is_null()).then_some(s)
        })
    });
    assert_eq!(
        stats["sources"]["partitions"][0]["divergence"]["kind"],
        "events_deleted"
    );
    assert_eq!(kv.get("/readyz").0, 503);
    blocking(|| kv.terminate());
    let _ = js.delete_stream(&stream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restart_mid_stream_loses_nothing() {
    let mut server = PrivateServer::start();
    let stream = unique("KVRESTART");
    let prefix = format!("kvrestart.{}", stream.to_lowercase());
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "nats"
[source.nats]
url = "{}"
stream = "{stream}"
subjects = ["{prefix}.>"]
[index]
shards = 2
seed = {SEED}
"#,
            server.url()
        ),
    );
    let mut p = NatsPublisher::connect(&server.url(), true).await.unwrap();
    p.ensure_stream(&stream, &[format!("{prefix}.>")])
        .await
        .unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let mut sent = produce_nats(&mut p, &prefix, &mut fleet, &reference, 60).await;
    let kv = blocking(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data"),
            &[],
            START,
        )
    });
    blocking(|| wait_caught_up(&kv, sent + 1));

    // The server goes away: lookups keep being answered from the index.
    server.kill();
    let (part, tokens) = fleet.sample_query();
    let want = reference_answer(&reference, &part, &tokens);
    for _ in 0..5 {
        assert_eq!(blocking(|| http_answer(&kv, &part, &tokens)), want);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.spawn();
    // Publish more once JetStream answers again; kvindex resumes by itself.
    let mut p = wait_for_publisher(&server.url(), &stream, &prefix).await;
    sent += produce_nats(&mut p, &prefix, &mut fleet, &reference, 30).await;
    blocking(|| wait_caught_up(&kv, sent + 1));
    for _ in 0..8 {
        let (part, tokens) = fleet.sample_query();
        assert_eq!(
            blocking(|| http_answer(&kv, &part, &tokens)),
            reference_answer(&reference, &part, &tokens)
        );
    }
    blocking(|| kv.terminate());
}

/// A JetStream publisher on a server that is (re)starting; retries for up to 30 s.
async fn wait_for_publisher(url: &str, stream: &str, prefix: &str) -> NatsPublisher {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(p) = NatsPublisher::connect(url, true).await
            && p.ensure_stream(stream, &[format!("{prefix}.>")])
                .await
                .is_ok()
        {
            return p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "JetStream did not come back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_rebuilds_from_a_topic_and_serve_resumes_from_it() {
    let topic = "kv-replay";
    let broker = EmbeddedBroker::start(topic, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = kafka_config(dir.path(), &broker, topic, "kvindex");
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    let reference = reference_index(2);
    let total = produce(&publisher, &mut fleet, &reference, 120).await;

    let run_replay = |from: &str, data: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"))
            .args(["replay", "--config", &config, "--from", from, "--data-dir"])
            .arg(data)
            .env("KVINDEX_LOG", "warn")
            .output()
            .expect("running kvindex replay")
    };
    let data = dir.path().join("rebuilt");
    let out = blocking(|| run_replay("earliest", &data));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("replayed kafka:kv-replay"), "{stdout}");
    // Replaying into a data dir that holds an index is refused.
    let again = blocking(|| run_replay("earliest", &data));
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds an index"));

    // `serve` on the rebuilt dir is warm and has nothing left to read.
    let kv = blocking(|| spawn_kvindex(&["serve", "--config", &config], &data, &[], START));
    let stats = blocking(|| wait_caught_up(&kv, total));
    assert_eq!(
        stats["sources"]["messages"], 0,
        "resumed from the replay's checkpoint"
    );
    for _ in 0..8 {
        let (p, t) = fleet.sample_query();
        assert_eq!(
            http_answer(&kv, &p, &t),
            reference_answer(&reference, &p, &t)
        );
    }
    blocking(|| kv.terminate());

    // From an offset: every partition starts there, so what is below it is not indexed.
    let partial = dir.path().join("partial");
    let out = blocking(|| run_replay("offset:1000000", &partial));
    assert!(
        !out.status.success(),
        "an offset past the log end is a divergence"
    );
    let out = blocking(|| run_replay("offset:10", &dir.path().join("from10")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied: u64 = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .skip_while(|w| *w != "into")
        .nth(2)
        .and_then(|n| n.parse().ok())
        .expect("the summary names the events applied");
    let all: u64 = stdout
        .split_whitespace()
        .skip_while(|w| *w != "into")
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(
        applied < all,
        "offset:10 skipped the first messages ({applied} of {all})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_is_consumed_live() {
    let prefix = format!("kvcore.{}", unique("c").to_lowercase());
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "nats"
[source.nats]
subjects = ["{prefix}.>"]
jetstream = false
"#
        ),
    );
    let kv = blocking(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data"),
            &[],
            START,
        )
    });
    blocking(|| {
        wait_for("the core subscription", CATCH_UP, || {
            let s = kv.stats();
            (s["sources"]["kind"] == "nats-core" && s["sources"]["connected"] == true).then_some(())
        })
    });
    let mut p = NatsPublisher::connect("nats://127.0.0.1:4222", false)
        .await
        .expect("NATS must be running at 127.0.0.1:4222 (scripts/setup.sh starts it)");
    let mut fleet = Fleet::new(FleetSettings::default());
    let mut events = 0;
    for _ in 0..20 {
        let request = fleet.next_request();
        events += request.len() as u64;
        publish_nats(&mut p, &prefix, &request).await;
    }
    p.flush().await.unwrap();
    blocking(|| {
        wait_for("the live messages to be applied", CATCH_UP, || {
            (kv.stats()["events"]["applied_total"].as_u64() == Some(events)).then_some(())
        })
    });
    blocking(|| kv.terminate());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_partition_list_is_consumed_alone() {
    let topic = "kv-explicit";
    let broker = EmbeddedBroker::start(topic, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = kafka_config(dir.path(), &broker, topic, "");
    let config = write_config(
        dir.path(),
        &std::fs::read_to_string(&config)
            .unwrap()
            .replace("group_id = \"\"", "group_id = \"\"\npartitions = [1]"),
    );
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), topic, &Default::default()).unwrap();
    let mut fleet = Fleet::new(FleetSettings::default());
    produce(&publisher, &mut fleet, &reference_index(2), 40).await;
    let kv = blocking(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data"),
            &[],
            START,
        )
    });
    let stats = blocking(|| {
        wait_for("partition 1 to be consumed", CATCH_UP, || {
            let s = kv.stats();
            let high = s["sources"]["partitions"][0]["high_watermark"]
                .as_i64()
                .unwrap_or(0);
            (high > 0 && caught_up(&s, high)).then_some(s)
        })
    });
    let parts = stats["sources"]["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 1, "{parts:?}");
    assert_eq!(parts[0]["partition"], 1);
    assert_eq!(
        stats["sources"]["messages"].as_i64().unwrap(),
        parts[0]["high_watermark"].as_i64().unwrap()
    );
    blocking(|| kv.terminate());
}
