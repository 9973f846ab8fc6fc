//! What the integration tests share, one concern per file:
//! - [`process`]: the real `kvindex` binary on a temp data dir and a random port, and one-shot
//!   JSON requests to it (both over `kvindex::bench::harness`, which the benches use too);
//! - [`brokers`]: publishing to Kafka, the shared NATS server and private ones, unique names;
//! - [`events`]: building events;
//! - [`state`]: comparing indexes ([`Fingerprint`]) and reading a service's catch-up state;
//! - [`tls`]: certificates made in the test; [`kafka_tls`]: a TLS front for the embedded
//!   Kafka broker;
//! - here: polling, config files, and the seeded generator.
#![allow(dead_code, unused_imports)] // each test binary uses a different subset

pub mod brokers;
pub mod events;
pub mod kafka_tls;
pub mod process;
pub mod state;
pub mod tls;

pub use brokers::{PrivateServer, publish_kafka, publish_nats, require_nats, unique_id};
pub use process::{Kvindex, http, spawn_kvindex, spawn_kvindex_logging_to};
pub use state::{Fingerprint, caught_up, fingerprint};

use std::path::Path;
use std::time::{Duration, Instant};

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

/// Writes `toml` to `<dir>/kvindex.toml` and returns its path as a string.
pub fn write_config(dir: &Path, toml: &str) -> String {
    let path = dir.join("kvindex.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_string_lossy().into_owned()
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

/// Checks a `/metrics` page with Prometheus's own `promtool check metrics` (installed by
/// `scripts/setup.sh`): well-formed, no duplicate family, HELP and TYPE for each.
pub fn assert_promtool_accepts(page: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`; scripts/setup.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(page.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Lint findings (naming conventions) count too: the page must be clean.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n{page}"
    );
}
