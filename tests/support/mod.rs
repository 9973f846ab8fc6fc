//! Shared helpers of the tests that run the real `kvindex` binary: spawning it on a temp data
//! dir and a random port, reading what it prints, a minimal HTTP client, and polling.
#![allow(dead_code)] // each test binary uses a different subset

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// A running `kvindex` process. Killed (SIGKILL) on drop if still running.
pub struct Kvindex {
    pub child: Child,
    pub http: SocketAddr,
    /// The embedded broker's bootstrap address, when it runs one.
    pub bootstrap: Option<String>,
    lines: Receiver<String>,
}

/// Starts `kvindex <args>` with `data_dir` and HTTP on a random loopback port, and waits until
/// it listens (at most `timeout`). `env` adds environment variables.
pub fn spawn_kvindex(
    args: &[&str],
    data_dir: &Path,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Kvindex {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvindex"));
    cmd.args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0"])
        .env("KVINDEX_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawning the kvindex binary");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut bootstrap = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match rx.recv_timeout(left) {
            Ok(l) => l,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait();
                panic!("kvindex exited before listening: {status:?} (its stderr is above)");
            }
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "kvindex did not start listening within {timeout:?} (status {:?})",
                    child.try_wait()
                );
            }
        };
        if let Some(rest) = line.strip_prefix("embedded Kafka broker on ") {
            bootstrap = rest.split_whitespace().next().map(str::to_string);
        }
        if let Some(addr) = line.strip_prefix("kvindex listening on http://") {
            let http = addr.trim().parse().expect("listen address");
            return Kvindex {
                child,
                http,
                bootstrap,
                lines: rx,
            };
        }
    }
}

impl Kvindex {
    pub fn get(&self, path: &str) -> (u16, Value) {
        http(self.http, "GET", path, None)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        http(self.http, "POST", path, Some(body))
    }

    pub fn stats(&self) -> Value {
        let (status, body) = self.get("/v1/stats");
        assert_eq!(status, 200, "{body}");
        body
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                assert!(status.success(), "kvindex exited with {status}");
                return;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("kvindex did not stop within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Lines printed so far (after the listening line).
    pub fn printed(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }
}

impl Drop for Kvindex {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange (`Connection: close`), JSON in and out.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reading the response");
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let payload = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    let json = serde_json::from_str(&payload).unwrap_or(Value::String(payload));
    (status, json)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Polls `f` every 50 ms until it returns `Some`, panicking with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether the source's log ends sum to at least `log_end` (so the watermarks shown are
/// fresh enough to include what the test produced: Kafka = messages produced, NATS JetStream =
/// messages + 1), and every partition has applied everything up to its high watermark.
pub fn caught_up(stats: &Value, log_end: i64) -> bool {
    let Some(parts) = stats["sources"]["partitions"].as_array() else {
        return false;
    };
    let ends: i64 = parts
        .iter()
        .map(|p| p["high_watermark"].as_i64().unwrap_or(0).max(0))
        .sum();
    !parts.is_empty()
        && ends >= log_end
        && parts.iter().all(|p| {
            let high = p["high_watermark"].as_i64().unwrap_or(-1);
            let applied = p["applied_offset"]
                .as_i64()
                .or(p["position"].as_i64())
                .unwrap_or(-2);
            high >= 0 && applied >= high
        })
}

/// The project's seeded generator (`kvindex::sim::Rng`) with the small API randomized
/// tests use; deterministic, so a failing seed reproduces.
pub struct TestRng(kvindex::sim::Rng);

impl TestRng {
    pub fn new(seed: u64) -> TestRng {
        TestRng(kvindex::sim::Rng::new(seed))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// In `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Publishes `events` to Kafka, one protobuf payload per run of one engine's events, keyed by
/// the engine id (so each engine's events stay ordered in one partition); returns how many
/// messages were enqueued.
pub async fn publish_kafka(
    publisher: &kvindex::source::KafkaPublisher,
    events: &[kvindex::event::Event],
) -> usize {
    let mut n = 0;
    for run in events.chunk_by(|a, b| a.engine == b.engine) {
        publisher
            .send(
                Some(&run[0].engine),
                &[],
                &kvindex::event::encode::to_proto(run),
            )
            .await
            .expect("enqueue");
        n += 1;
    }
    n
}

/// Writes `toml` to `<dir>/kvindex.toml` and returns its path as a string.
pub fn write_config(dir: &Path, toml: &str) -> String {
    let path = dir.join("kvindex.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_string_lossy().into_owned()
}

/// What two indexes must agree on to hold the same state: per-partition counts, every
/// engine's blocks by tier, and the answer to every query (as sorted rows). Liveness times
/// are left out (they are wall-clock times of application).
#[derive(Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub partitions: Vec<(String, u64, u64)>,
    pub engines: Vec<(String, u64, [u64; 3])>,
    pub answers: Vec<Vec<(String, u32, String)>>,
}

pub fn fingerprint(
    index: &kvindex::index::Index,
    queries: &[(kvindex::event::PartitionKey, Vec<u32>)],
    block_size: u32,
) -> Fingerprint {
    let stats = index.stats();
    let mut partitions: Vec<_> = stats
        .partitions
        .iter()
        .filter(|p| p.memberships > 0)
        .map(|p| (format!("{:?}", p.key), p.block_entries, p.memberships))
        .collect();
    partitions.sort();
    let mut engines: Vec<_> = index
        .engines()
        .into_iter()
        .filter(|e| e.blocks > 0)
        .map(|e| (e.engine_id, e.blocks, e.blocks_by_tier))
        .collect();
    engines.sort();
    let answers = queries
        .iter()
        .map(|(partition, tokens)| {
            let blocks = kvindex::index::QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size,
            };
            let mut rows: Vec<_> = index
                .lookup(partition, &blocks)
                .1
                .to_vec()
                .into_iter()
                .map(|m| (m.engine_id, m.matched_blocks, format!("{:?}", m.tier)))
                .collect();
            rows.sort();
            rows
        })
        .collect();
    Fingerprint {
        partitions,
        engines,
        answers,
    }
}

/// Where Debian's nats-server lives (scripts/setup.sh installs it).
const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// A private nats-server (JetStream) the test can kill and restart on the same port and store.
pub struct PrivateServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl PrivateServer {
    pub fn start() -> PrivateServer {
        assert!(
            std::path::Path::new(NATS_SERVER).exists(),
            "the fault test needs {NATS_SERVER}"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut s = PrivateServer {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        s.spawn();
        s
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn spawn(&mut self) {
        let child = std::process::Command::new(NATS_SERVER)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(self.dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawning nats-server");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "private nats-server did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
    }
}
