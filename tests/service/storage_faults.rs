//! A damaged store is refused, not served: `kvindex serve` over a RocksDB whose table files
//! (SSTs) were corrupted exits non-zero with an error naming the damaged file, whether the
//! damage is in what RocksDB reads when it opens (a table's footer) or in a data block that
//! only the warm-up reads. Nothing is answered from a store that cannot be read back; the
//! README says how to rebuild one from the log (`kvindex replay` into an empty data dir).
//! (A torn or cut write-ahead log is the other storage fault; RocksDB recovers a consistent
//! prefix of it, and `crash.rs` holds the index to its reference across such damage.)

use crate::support::*;
use kvindex::config::Config;
use kvindex::service::Service;
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::{EmbeddedBroker, KafkaPublisher};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOPIC: &str = "kv-storage-faults";
const SHARDS: usize = 2;

/// Where the damage goes in the chosen table file.
#[derive(Clone, Copy, Debug)]
enum Damage {
    /// The last bytes (the footer RocksDB reads when it opens the table).
    Footer,
    /// A third of the way in (a data block, read only when its rows are).
    DataBlock,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_table_footer_is_refused_at_start_naming_the_file() {
    refused_after(Damage::Footer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_data_block_is_refused_at_start_naming_the_file() {
    refused_after(Damage::DataBlock).await;
}

async fn refused_after(damage: Damage) {
    let broker = EmbeddedBroker::start(TOPIC, 2).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            r#"
[source]
kind = "kafka"
[source.kafka]
brokers = "{}"
topic = "{TOPIC}"
group_id = ""
start = "earliest"
[index]
shards = {SHARDS}
"#,
            broker.bootstrap_servers()
        ),
    );
    let data = dir.path().join("data");
    let publisher =
        KafkaPublisher::new(&broker.bootstrap_servers(), TOPIC, &Default::default()).unwrap();
    let mut fleet = Fleet::new(FleetSettings {
        engines: 6,
        seed: 5,
        ..FleetSettings::default()
    });
    let mut sent = 0;
    for _ in 0..300 {
        sent += publish_kafka(&publisher, &fleet.next_request()).await;
    }
    publisher.flush(Duration::from_secs(30)).await.unwrap();
    let kv = tokio::task::block_in_place(|| {
        spawn_kvindex(
            &["serve", "--config", &config],
            &data,
            &[],
            Duration::from_secs(60),
        )
    });
    tokio::task::block_in_place(|| {
        wait_for("serve to catch up", Duration::from_secs(120), || {
            caught_up(&kv.stats(), sent as i64).then_some(())
        })
    });
    tokio::task::block_in_place(|| kv.terminate());
    // Opening the store again recovers its write-ahead log into table files.
    let mut cfg = Config {
        data_dir: data.clone(),
        ..Config::default()
    };
    cfg.index.shards = SHARDS;
    drop(Service::open(cfg, None).expect("the undamaged store opens"));

    let table = largest_table(&data.join("index"));
    let name = table.file_name().unwrap().to_string_lossy().into_owned();
    let mut bytes = std::fs::read(&table).unwrap();
    let len = bytes.len();
    let at = match damage {
        Damage::Footer => len - 16,
        Damage::DataBlock => len / 3,
    };
    for b in &mut bytes[at..at + 16] {
        *b ^= 0x5a;
    }
    std::fs::write(&table, bytes).unwrap();

    let (status, stderr) = run_to_exit(
        Command::new(env!("CARGO_BIN_EXE_kvindex"))
            .args(["serve", "--config", &config, "--listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(&data),
        Duration::from_secs(60),
    );
    assert!(
        !status.success(),
        "serve ran on a store with a damaged {damage:?} in {name}:\n{stderr}"
    );
    assert!(
        stderr.contains(&name),
        "the error does not name the damaged file {name}:\n{stderr}"
    );
    assert!(
        stderr.to_lowercase().contains("corrupt"),
        "the error does not say the store is corrupted:\n{stderr}"
    );
    let refusal = stderr
        .lines()
        .rfind(|l| l.contains(&name))
        .unwrap_or_default();
    eprintln!("{damage:?} damaged in {name}: {refusal}");
}

/// The largest table file (`*.sst`) of the store in `dir`.
fn largest_table(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sst"))
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .unwrap_or_else(|| panic!("no table file in {}", dir.display()))
}

/// Runs `cmd` until it exits (killing it after `timeout`); its status and its stderr.
fn run_to_exit(cmd: &mut Command, timeout: Duration) -> (std::process::ExitStatus, String) {
    let mut child = cmd
        .env("KVINDEX_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + timeout;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "serve still running after {timeout:?} on a damaged store:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
