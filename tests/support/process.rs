//! The real `kvindex` binary as a test runs it (over `kvindex::bench::harness`, which the
//! service benches use too), and one-shot JSON requests to it.

use kvindex::bench::harness::{HttpClient, Spawned};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A running `kvindex` process. Killed (SIGKILL) on drop if still running.
pub struct Kvindex {
    process: Spawned,
    pub http: SocketAddr,
    /// The embedded broker's bootstrap address, when it runs one.
    pub bootstrap: Option<String>,
}

/// Starts `kvindex <args>` with `data_dir` and HTTP on a random loopback port, and waits until
/// it listens (at most `timeout`). `env` adds environment variables; its stderr is the test's.
pub fn spawn_kvindex(
    args: &[&str],
    data_dir: &Path,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Kvindex {
    spawn_with_stderr(args, data_dir, env, timeout, Stdio::inherit())
}

/// [`spawn_kvindex`] with its stderr (the log) written to `log` instead, for tests that read
/// what it logged; waits up to a minute.
pub fn spawn_kvindex_logging_to(
    args: &[&str],
    data_dir: &Path,
    env: &[(&str, &str)],
    log: &Path,
) -> Kvindex {
    let file = std::fs::File::create(log).unwrap();
    spawn_with_stderr(args, data_dir, env, Duration::from_secs(60), file.into())
}

fn spawn_with_stderr(
    args: &[&str],
    data_dir: &Path,
    env: &[(&str, &str)],
    timeout: Duration,
    stderr: Stdio,
) -> Kvindex {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvindex"));
    cmd.args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0"])
        .env("KVINDEX_LOG", "warn")
        .stderr(stderr);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let process = Spawned::start(cmd, timeout)
        .unwrap_or_else(|e| panic!("kvindex {args:?}: {e} (its stderr is above)"));
    Kvindex {
        http: process.http,
        bootstrap: process.bootstrap.clone(),
        process,
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
    pub fn kill9(self) {
        self.process.kill9();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(self) {
        match self.process.terminate(Duration::from_secs(30)) {
            Ok(status) => assert!(status.success(), "kvindex exited with {status}"),
            Err(e) => panic!("kvindex did not stop cleanly after SIGTERM: {e}"),
        }
    }

    /// Lines printed so far (after the listening line).
    pub fn printed(&self) -> Vec<String> {
        self.process.printed()
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// One HTTP/1.1 exchange on a fresh connection, JSON in and out (a body that is not JSON comes
/// back as a JSON string).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let (status, bytes) = HttpClient::connect(addr)
        .and_then(|mut c| c.request(method, path, body.as_bytes()))
        .unwrap_or_else(|e| panic!("{method} {path} on {addr}: {e}"));
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, json)
}
