//! NATS behind mutual TLS and a password, as production servers run: `kvindex serve` verifies
//! the server against `source.nats.tls_ca`, shows its own client certificate
//! (`tls_cert`/`tls_key`, which the server requires) and logs in as `user` with the password
//! from `KVINDEX_SOURCE__NATS__PASSWORD`; it indexes what a publisher sends through the same
//! settings (a publisher, and `kvindex produce` with its `--nats-*` flags), and the password
//! appears nowhere in its debug log. With a wrong password it indexes nothing and its status
//! says why.

use crate::support::tls::certificates;
use crate::support::*;
use kvindex::config::Secret;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::NatsPublisher;
use kvindex::source::nats::NatsAuth;
use std::time::Duration;

const USER: &str = "kvindex";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reads_a_nats_server_with_mutual_tls_and_a_password_and_never_logs_it() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] = certificates(dir.path());
    let password = format!("pw-{}", unique_id("nats-secured"));
    let server = PrivateServer::start_with(&format!(
        "tls {{ cert_file: {server_cert:?}, key_file: {server_key:?}, ca_file: {ca:?}, verify: true }}\n\
         authorization {{ user: {USER:?}, password: {password:?} }}"
    ));
    let url = format!("tls://127.0.0.1:{}", server.port());
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "nats"
[source.nats]
url = "{url}"
stream = "KV_SECURED"
subjects = ["kvsec.events.>"]
user = "{USER}"
tls_ca = {ca:?}
tls_cert = {client_cert:?}
tls_key = {client_key:?}
[index]
shards = 2
"#
        ),
    );
    let auth = NatsAuth {
        user: Some((USER.into(), Secret::new(password.clone()))),
        tls_ca: Some(ca.clone()),
        tls_client: Some((client_cert.clone(), client_key.clone())),
        ..NatsAuth::default()
    };

    // Not a word without the client certificate, nor with a wrong password.
    let no_cert = NatsAuth {
        tls_client: None,
        ..auth.clone()
    };
    assert!(
        NatsPublisher::connect_with(&url, true, &no_cert)
            .await
            .is_err()
    );
    let wrong = NatsAuth {
        user: Some((USER.into(), Secret::new("wrong"))),
        ..auth.clone()
    };
    assert!(
        NatsPublisher::connect_with(&url, true, &wrong)
            .await
            .is_err()
    );

    let log_path = dir.path().join("stderr.log");
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex_logging_to(
            &["serve", "--config", &config],
            &dir.path().join("data"),
            &[
                ("KVINDEX_SOURCE__NATS__PASSWORD", password.as_str()),
                ("KVINDEX_LOG", "debug"),
            ],
            &log_path,
        )
    });
    // The source creates the stream once connected.
    let mut publisher = NatsPublisher::connect_with(&url, true, &auth)
        .await
        .expect("the publisher connects with TLS and the password");
    let mut fleet = Fleet::new(FleetSettings {
        engines: 4,
        seed: 3,
        ..FleetSettings::default()
    });
    let mut sent = 0i64;
    let mut blocks = 0u64;
    wait_for_stream(&kv);
    for _ in 0..40 {
        let events = fleet.next_request();
        for run in events.chunk_by(|a, b| a.engine == b.engine) {
            blocks += run.iter().map(|e| e.block_ops() as u64).sum::<u64>();
            publisher
                .send(
                    &format!("kvsec.events.{}", run[0].engine),
                    &[],
                    kvindex::event::encode::to_proto(run),
                )
                .await
                .expect("publish");
            sent += 1;
        }
    }
    publisher.flush().await.expect("acks");
    let stats = tokio::task::block_in_place(|| {
        wait_for("serve to index everything", Duration::from_secs(60), || {
            let s = kv.stats();
            caught_up(&s, sent).then_some(s)
        })
    });
    assert!(
        blocks > 0 && stats["index"]["memberships"].as_u64().unwrap_or(0) > 0,
        "{stats}"
    );

    // `kvindex produce` through the same TLS and password (from the environment).
    let produce = |password: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"))
            .args([
                "produce",
                "--requests",
                "30",
                "--engines",
                "3",
                "--nats",
                &url,
            ])
            .args(["--stream", "KV_SECURED", "--subject-prefix", "kvsec.events"])
            .args(["--nats-user", USER, "--nats-tls-ca"])
            .arg(&ca)
            .arg("--nats-tls-cert")
            .arg(&client_cert)
            .arg("--nats-tls-key")
            .arg(&client_key)
            .env("KVINDEX_SOURCE__NATS__PASSWORD", password)
            .env("KVINDEX_LOG", "warn")
            .output()
            .expect("running kvindex produce")
    };
    let out = tokio::task::block_in_place(|| produce("wrong"));
    assert!(!out.status.success(), "a wrong password is refused");
    let out = tokio::task::block_in_place(|| produce(&password));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let js = async_nats::jetstream::new(publisher.client().clone());
    let last = js
        .get_stream("KV_SECURED")
        .await
        .unwrap()
        .cached_info()
        .state
        .last_sequence as i64;
    assert!(last > sent, "produce published nothing");
    tokio::task::block_in_place(|| {
        wait_for(
            "serve to index what produce sent",
            Duration::from_secs(60),
            || caught_up(&kv.stats(), last + 1).then_some(()),
        )
    });
    tokio::task::block_in_place(|| kv.terminate());
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("nats: connected"), "debug log: {log}");
    assert!(!log.contains(&password), "the password is in the log");

    // A wrong password: nothing is indexed, and the status says the source is not connected.
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &dir.path().join("data-wrong"),
            &[("KVINDEX_SOURCE__NATS__PASSWORD", "wrong")],
            Duration::from_secs(60),
        )
    });
    let error = tokio::task::block_in_place(|| {
        wait_for("the source to report why", Duration::from_secs(30), || {
            kv.stats()["sources"]["error"].as_str().map(str::to_string)
        })
    });
    assert!(error.to_lowercase().contains("authorization"), "{error}");
    let stats = kv.stats();
    assert_eq!(stats["sources"]["connected"], false, "{stats}");
    assert_eq!(kv.get("/readyz").0, 503);
    tokio::task::block_in_place(|| kv.terminate());
}

/// Waits until the source reports itself connected (it creates the stream then).
fn wait_for_stream(kv: &Kvindex) {
    wait_for("the source to connect", Duration::from_secs(30), || {
        (kv.stats()["sources"]["connected"] == true).then_some(())
    });
}
