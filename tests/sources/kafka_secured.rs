//! Kafka behind mutual TLS, as production clusters run: `kvindex serve` verifies the brokers
//! against `ssl.ca.location` and shows its own certificate (`ssl.certificate.location`,
//! `ssl.key.location`, which the broker requires), all given in `[source.kafka.properties]`
//! and passed through to librdkafka (built with TLS); `kvindex produce` publishes through the
//! same properties (`-X`). The broker is the embedded one behind a TLS front
//! ([`KafkaTlsFront`]), the only address either of them is given. With a CA that did not sign
//! the broker's certificate, serve indexes nothing and its status says why.

use crate::support::kafka_tls::KafkaTlsFront;
use crate::support::tls::certificates;
use crate::support::*;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::EmbeddedBroker;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

const TOPIC: &str = "kv-events";
const PARTITIONS: i32 = 3;

/// The librdkafka properties of a client that verifies the broker against `ca` and shows the
/// client certificate.
fn tls_properties(ca: &Path, cert: &Path, key: &Path) -> [(&'static str, String); 4] {
    [
        ("security.protocol", "SSL".to_string()),
        ("ssl.ca.location", ca.display().to_string()),
        ("ssl.certificate.location", cert.display().to_string()),
        ("ssl.key.location", key.display().to_string()),
    ]
}

fn serve_config(dir: &Path, name: &str, brokers: &str, tls: &[(&str, String)]) -> String {
    let properties: String = tls
        .iter()
        .map(|(k, v)| format!("{k:?} = {v:?}\n"))
        .collect();
    let path = dir.join(name);
    std::fs::create_dir_all(&path).unwrap();
    write_config(
        &path,
        &format!(
            "[source]\nkind = \"kafka\"\n[source.kafka]\nbrokers = \"{brokers}\"\n\
             topic = \"{TOPIC}\"\n[source.kafka.properties]\n{properties}"
        ),
    )
}

/// Messages in the topic, read from the broker itself (plaintext, behind the front).
fn log_end(broker: &EmbeddedBroker) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap_servers())
        .create()
        .unwrap();
    (0..PARTITIONS)
        .map(|p| {
            c.fetch_watermarks(TOPIC, p, Duration::from_secs(5))
                .unwrap()
                .1
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reads_kafka_over_mutual_tls_and_refuses_a_broker_it_cannot_verify() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] = certificates(dir.path());
    let other = tempfile::tempdir().unwrap();
    let [other_ca, ..] = certificates(other.path());
    let broker = EmbeddedBroker::start(TOPIC, PARTITIONS).unwrap();
    let front =
        KafkaTlsFront::start(&broker.bootstrap_servers(), &server_cert, &server_key, &ca).await;
    let tls = tls_properties(&ca, &client_cert, &client_key);

    let config = serve_config(dir.path(), "good", &front.bootstrap(), &tls);
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data"),
            &[],
            Duration::from_secs(60),
        )
    });

    // `kvindex produce` through the front, with the same properties.
    let (requests, engines, seed) = (60, 4, 5);
    let out = tokio::task::block_in_place(|| {
        let mut produce = std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"));
        produce
            .args(["produce", "--kafka", &front.bootstrap(), "--topic", TOPIC])
            .args(["--requests", &requests.to_string()])
            .args([
                "--engines",
                &engines.to_string(),
                "--seed",
                &seed.to_string(),
            ])
            .env("KVINDEX_LOG", "warn");
        for (k, v) in &tls {
            produce.arg("-X").arg(format!("{k}={v}"));
        }
        produce.output().expect("running kvindex produce")
    });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let end = tokio::task::block_in_place(|| log_end(&broker));
    assert!(end > 0, "produce published nothing");

    // What the fleet holds at the end is what the index must hold.
    let mut fleet = Fleet::new(FleetSettings {
        engines,
        seed,
        ..FleetSettings::default()
    });
    for _ in 0..requests {
        fleet.next_request();
    }
    let expected = fleet.stats().blocks_cached;
    assert!(expected > 0);
    let stats = tokio::task::block_in_place(|| {
        wait_for("serve to index everything", Duration::from_secs(60), || {
            let s = kv.stats();
            caught_up(&s, end).then_some(s)
        })
    });
    assert_eq!(
        stats["index"]["memberships"].as_u64(),
        Some(expected),
        "{stats}"
    );
    assert!(
        front.handshakes.load(Ordering::SeqCst) >= 2,
        "serve and produce came through TLS"
    );
    assert_eq!(front.refused.load(Ordering::SeqCst), 0);
    tokio::task::block_in_place(|| kv.terminate());

    // A CA that did not sign the broker's certificate: the handshake fails on kvindex's side,
    // nothing is indexed, and the status says why.
    let untrusting = tls_properties(&other_ca, &client_cert, &client_key);
    let config = serve_config(dir.path(), "wrong-ca", &front.bootstrap(), &untrusting);
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data-wrong-ca"),
            &[],
            Duration::from_secs(60),
        )
    });
    let error = tokio::task::block_in_place(|| {
        wait_for("the source to report why", Duration::from_secs(30), || {
            kv.stats()["sources"]["error"].as_str().map(str::to_string)
        })
    });
    assert!(error.to_lowercase().contains("ssl"), "{error}");
    assert!(front.refused.load(Ordering::SeqCst) >= 1);
    let stats = kv.stats();
    assert_eq!(stats["index"]["memberships"], 0, "{stats}");
    assert_eq!(kv.get("/readyz").0, 503);
    tokio::task::block_in_place(|| kv.terminate());
}
