//! Driving a real `kvindex` process from outside, as the service benches (`kvindex bench
//! restart`, `kvindex bench http`) and the integration tests do: [`Spawned`] starts the binary
//! and waits for the line it prints once it listens; [`HttpClient`] is a minimal keep-alive
//! HTTP/1.1 client (one request in flight per connection), so a load generator measures the
//! server rather than a client library.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

/// The line `serve` and `demo` print once their HTTP API listens.
pub const LISTENING: &str = "kvindex listening on http://";
/// The line they print when they start the embedded broker.
pub const EMBEDDED_BROKER: &str = "embedded Kafka broker on ";

fn invalid(what: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.into())
}

/// A running `kvindex` child process, killed (SIGKILL) on drop if still running. Its stdout is
/// read on a thread of its own, so the child never blocks on a full pipe.
pub struct Spawned {
    child: Child,
    /// Its HTTP API.
    pub http: SocketAddr,
    /// The embedded broker's bootstrap address, when it runs one.
    pub bootstrap: Option<String>,
    lines: Receiver<String>,
}

impl Spawned {
    /// Starts `command` (the `kvindex` binary with its arguments and environment; stdout is
    /// taken over here) and waits up to `timeout` until it listens.
    pub fn start(mut command: Command, timeout: Duration) -> std::io::Result<Spawned> {
        let mut child = command.stdout(Stdio::piped()).spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| invalid("no stdout"))?;
        let (tx, lines) = channel();
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
            let line = match lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Disconnected) => {
                    let status = child.wait()?;
                    return Err(invalid(format!(
                        "kvindex exited before listening: {status}"
                    )));
                }
                Err(RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(invalid(format!(
                        "kvindex did not start listening within {timeout:?}"
                    )));
                }
            };
            if let Some(rest) = line.strip_prefix(EMBEDDED_BROKER) {
                bootstrap = rest.split_whitespace().next().map(str::to_string);
            }
            if let Some(addr) = line.strip_prefix(LISTENING) {
                let http = addr
                    .trim()
                    .parse()
                    .map_err(|e| invalid(format!("listen address `{addr}`: {e}")))?;
                return Ok(Spawned {
                    child,
                    http,
                    bootstrap,
                    lines,
                });
            }
        }
    }

    /// `kvindex serve` of `exe` on `data_dir`, HTTP on a random loopback port, logging warnings
    /// only, with `config` if given.
    pub fn serve(
        exe: &Path,
        data_dir: &Path,
        config: Option<&Path>,
        timeout: Duration,
    ) -> std::io::Result<Spawned> {
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .env("KVINDEX_LOG", "warn");
        if let Some(config) = config {
            cmd.arg("--config").arg(config);
        }
        Spawned::start(cmd, timeout)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lines printed since the listening line, so far.
    pub fn printed(&self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Whether it has exited, and how.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (a clean shutdown), then waits up to `timeout` for the exit; a process still
    /// running then is killed and reported.
    pub fn terminate(mut self, timeout: Duration) -> std::io::Result<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return Err(invalid(format!("kvindex did not stop within {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until a small lookup is answered with `200`.
    pub fn wait_answering(&self, limit: Duration) -> std::io::Result<()> {
        let body = br#"{"model":"model-0","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}"#;
        self.wait_answering_to(body, limit).map(drop)
    }

    /// Waits until the lookup `body` is answered with `200`; returns the answer.
    pub fn wait_answering_to(&self, body: &[u8], limit: Duration) -> std::io::Result<Vec<u8>> {
        let started = Instant::now();
        loop {
            let answer = HttpClient::connect(self.http)
                .and_then(|mut c| c.request("POST", "/v1/lookup", body));
            if let Ok((200, answer)) = answer {
                return Ok(answer);
            }
            if started.elapsed() > limit {
                return Err(invalid(format!("no lookup answered within {limit:?}")));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until every shard's rows are loaded after the start (`warm_up.done` in
    /// `/v1/stats`).
    pub fn wait_warm(&self, limit: Duration) -> std::io::Result<()> {
        let started = Instant::now();
        let mut client = HttpClient::connect(self.http)?;
        loop {
            let (status, body) = client.request("GET", "/v1/stats", b"")?;
            let done = serde_json::from_slice::<serde_json::Value>(&body)
                .is_ok_and(|stats| stats["warm_up"]["done"] == true);
            if status == 200 && done {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(invalid(format!(
                    "the index did not warm up within {limit:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Resident set now and its peak (VmRSS, VmHWM), in bytes.
    pub fn rss(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    /// CPU time the process has used so far, all threads, user and system (`/proc/<pid>/stat`,
    /// in Linux's fixed 100 Hz clock ticks).
    pub fn cpu_time(&self) -> Option<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // Fields after the command name (which may hold spaces) start at field 3, `state`;
        // utime and stime are fields 14 and 15.
        let rest = &stat[stat.rfind(')')? + 1..];
        let mut fields = rest.split_whitespace().skip(11);
        let ticks: u64 =
            fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
        Some(Duration::from_millis(ticks * 10))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One keep-alive HTTP/1.1 connection, one request at a time. Responses carry a
/// `Content-Length` or are chunked.
pub struct HttpClient {
    stream: BufReader<TcpStream>,
    head: Vec<u8>,
}

impl HttpClient {
    pub fn connect(addr: impl std::net::ToSocketAddrs) -> std::io::Result<HttpClient> {
        let addr = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| invalid("no address"))?;
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(HttpClient {
            stream: BufReader::new(stream),
            head: Vec::with_capacity(1024),
        })
    }

    /// Sends one request (a JSON body, possibly empty) and reads its response:
    /// `(status, body)`.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        self.head.clear();
        write!(
            self.head,
            "{method} {path} HTTP/1.1\r\nHost: kvindex\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )?;
        self.head.extend_from_slice(body);
        self.stream.get_mut().write_all(&self.head)?;
        self.read_response()
    }

    fn read_response(&mut self) -> std::io::Result<(u16, Vec<u8>)> {
        let mut line = String::new();
        self.stream.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid("no HTTP status line"))?;
        let mut length = None;
        let mut chunked = false;
        loop {
            line.clear();
            if self.stream.read_line(&mut line)? == 0 {
                return Err(invalid("connection closed in the response head"));
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<usize>().ok();
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    chunked = value.trim().eq_ignore_ascii_case("chunked");
                }
            }
        }
        if chunked {
            return Ok((status, self.read_chunked()?));
        }
        let mut body = vec![0; length.ok_or_else(|| invalid("response without a length"))?];
        self.stream.read_exact(&mut body)?;
        Ok((status, body))
    }

    fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            self.stream.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim(), 16)
                .map_err(|_| invalid(format!("chunk size `{}`", line.trim())))?;
            let start = body.len();
            body.resize(start + size, 0);
            self.stream.read_exact(&mut body[start..])?;
            line.clear();
            self.stream.read_line(&mut line)?; // the CRLF after the chunk (or the last one)
            if size == 0 {
                return Ok(body);
            }
        }
    }
}
