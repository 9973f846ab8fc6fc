//! What the service-level benches (`kvindex bench restart`, `kvindex bench http`) share:
//!
//! * [`build_once`]: a durable index of a given size in a data dir, built through the real
//!   pipeline (`Pipeline::ingest_batch`, commits of index rows + offsets to RocksDB), plus a
//!   file of lookup queries that real traffic would send against it;
//! * [`Served`]: `kvindex serve` spawned on that data dir, stopped with SIGTERM;
//! * [`HttpClient`]: a minimal keep-alive HTTP/1.1 client (one request in flight per
//!   connection), so a load generator measures the server rather than a client library.

use anyhow::{Context, bail};
use kvindex::config::Config;
use kvindex::event::DecodeSettings;
use kvindex::event::{BlockContent, EngineHash, Event, EventKind, encode};
use kvindex::service::{Service, store_dir};
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::Message;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The source name the built history is checkpointed under.
const HISTORY: &str = "bench:history";
/// Blocks each simulated engine caches.
const CAPACITY: usize = 4096;
const BATCH: usize = 512;
/// Lookup bodies sampled from the fleet once the index is built.
const QUERIES: usize = 4096;

fn config(data_dir: &Path) -> Config {
    Config {
        data_dir: data_dir.to_path_buf(),
        ..Config::default()
    }
}

/// The file of lookup bodies (one JSON object per line) written beside a built index.
pub fn queries_file(data_dir: &Path) -> PathBuf {
    data_dir.join("bench-queries.jsonl")
}

/// Size of the built index, unbounded (`{"memberships": n, "l1_bytes": n}`), written by
/// [`build_once`].
pub fn built_file(data_dir: &Path) -> PathBuf {
    data_dir.join("bench-index.json")
}

/// Builds the index in `data_dir` unless one is there already.
pub fn build_once(data_dir: &Path, memberships: u64, history: u64) -> anyhow::Result<()> {
    let built =
        std::fs::read_dir(store_dir(&config(data_dir))).is_ok_and(|mut d| d.next().is_some());
    if built {
        println!("reusing the index in {}", data_dir.display());
        return Ok(());
    }
    build(data_dir, memberships, history)
}

/// Feeds `events` (one message each) through the pipeline at `*offset`.
fn feed(service: &Service, events: Vec<Event>, offset: &mut i64) -> anyhow::Result<()> {
    let opts = DecodeSettings::from(&service.config.source);
    let messages: Vec<Message> = events
        .chunk_by(|a, b| a.engine == b.engine)
        .map(|run| {
            *offset += 1;
            Message {
                offset: *offset - 1,
                payload: encode::to_proto(run),
                ..Message::default()
            }
        })
        .collect();
    service.pipeline.ingest_batch(HISTORY, &messages, &opts)?;
    Ok(())
}

/// A store of one block by `engine` and its removal: history without growth.
fn churn_pair(fleet_cfg: &FleetSettings, engine: &str, i: u64) -> [Event; 2] {
    let partition = kvindex::event::PartitionKey::new("", "model-0", "");
    let hash = EngineHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut stored = Event::new(EventKind::Stored, engine, partition.clone());
    stored.block_hashes = vec![hash];
    stored.content = BlockContent::Tokens {
        token_ids: (0..fleet_cfg.block_size)
            .map(|t| (i as u32).wrapping_add(t) % 128_000)
            .collect(),
        block_size: fleet_cfg.block_size,
    };
    let mut removed = Event::new(EventKind::Removed, engine, partition);
    removed.block_hashes = vec![hash];
    removed.adapter_scoped = true;
    [stored, removed]
}

/// Fleet traffic until the index holds `memberships`, then churn (one engine stores a block and
/// removes it again) until the history counts `history` events. Churn leaves the state's size
/// unchanged but leaves RocksDB what a long history leaves: overwritten rows and tombstones.
fn build(data_dir: &Path, memberships: u64, history: u64) -> anyhow::Result<()> {
    let service = Service::open(config(data_dir), None)?;
    let engines = memberships.div_ceil(CAPACITY as u64).max(1) as usize;
    let fleet_cfg = FleetSettings {
        engines,
        adapters: 0,
        capacity_blocks: CAPACITY,
        clear_every: u64::MAX,
        ..FleetSettings::default()
    };
    let mut fleet = Fleet::new(fleet_cfg.clone());
    let started = Instant::now();
    let (mut offset, mut events) = (0i64, 0u64);
    while service.index.stats().memberships < memberships {
        let mut batch = Vec::new();
        for _ in 0..BATCH {
            batch.extend(fleet.next_request());
        }
        events += batch.len() as u64;
        feed(&service, batch, &mut offset)?;
        service.pipeline.flush();
    }
    let names: Vec<String> = fleet.engines().into_iter().map(|(e, _)| e).collect();
    let mut i = 0u64;
    while events < history {
        let mut batch = Vec::with_capacity(BATCH * 2);
        for _ in 0..BATCH {
            batch.extend(churn_pair(
                &fleet_cfg,
                &names[(i as usize) % names.len()],
                i,
            ));
            i += 1;
        }
        events += batch.len() as u64;
        feed(&service, batch, &mut offset)?;
    }
    if !service.pipeline.persist() {
        bail!("the final commit failed");
    }
    write_queries(&mut fleet, &queries_file(data_dir))?;
    let stats = service.index.stats();
    // What the whole index takes in memory, unbounded: the yardstick for an L1 budget.
    let built = serde_json::json!({ "memberships": stats.memberships, "l1_bytes": stats.l1_bytes });
    std::fs::write(built_file(data_dir), built.to_string())?;
    println!(
        "built {}: {} memberships, {} blocks, {} engines, {events} events of history in {:.1} s",
        store_dir(&service.config).display(),
        stats.memberships,
        stats.block_entries,
        stats.engines,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Lookup bodies for prompts of live conversations and system prompts, as the fleet's traffic
/// would send them now.
fn write_queries(fleet: &mut Fleet, path: &Path) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for _ in 0..QUERIES {
        let (p, tokens) = fleet.sample_query();
        let body = serde_json::json!({
            "model": p.model, "tenant": p.tenant, "adapter": p.adapter, "token_ids": tokens,
        });
        serde_json::to_writer(&mut out, &body)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

/// The lookup bodies written by [`build_once`].
pub fn read_queries(data_dir: &Path) -> anyhow::Result<Vec<Vec<u8>>> {
    let path = queries_file(data_dir);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (an index built by an older kvindex has none: use a fresh --data-dir)",
            path.display()
        )
    })?;
    Ok(text
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.as_bytes().to_vec())
        .collect())
}

/// A `kvindex serve` child process.
pub struct Served {
    child: Child,
    /// `host:port` of its HTTP API.
    pub addr: String,
}

impl Served {
    /// Spawns this executable's `serve` on `data_dir` (with `config` if given) and waits until it
    /// prints its listen address.
    pub fn spawn(data_dir: &Path, config: Option<&Path>) -> anyhow::Result<Served> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .env("KVINDEX_LOG", "warn")
            .stdout(Stdio::piped());
        if let Some(config) = config {
            cmd.arg("--config").arg(config);
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().context("piped stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = lines.by_ref().find_map(|line| {
            line.ok()?
                .strip_prefix("kvindex listening on http://")
                .map(|a| a.trim().to_string())
        });
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let Some(addr) = addr else {
            let _ = child.kill();
            bail!("serve exited before listening");
        };
        Ok(Served { child, addr })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until a small lookup is answered with `200`.
    pub fn wait_answering(&self, limit: Duration) -> anyhow::Result<()> {
        let body = br#"{"model":"model-0","token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}"#;
        let started = Instant::now();
        loop {
            let status = HttpClient::connect(&self.addr)
                .and_then(|mut c| c.request("POST", "/v1/lookup", body))
                .map(|(status, _)| status);
            if status.is_ok_and(|s| s == 200) {
                return Ok(());
            }
            if started.elapsed() > limit {
                bail!("no lookup answered within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
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

    /// CPU time the server has used so far, all threads, user and system (`/proc/<pid>/stat`,
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

    /// SIGTERM (a clean shutdown), then waits for the exit.
    pub fn stop(mut self) -> anyhow::Result<()> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        self.child.wait()?;
        Ok(())
    }
}

/// One keep-alive HTTP/1.1 connection, one request at a time. Responses must carry a
/// `Content-Length` (kvindex's do).
pub struct HttpClient {
    stream: BufReader<TcpStream>,
    head: Vec<u8>,
}

impl HttpClient {
    pub fn connect(addr: &str) -> std::io::Result<HttpClient> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(HttpClient {
            stream: BufReader::new(stream),
            head: Vec::with_capacity(1024),
        })
    }

    /// Sends one request and reads its response: `(status, body)`.
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
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut line = String::new();
        self.stream.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("no HTTP status line"))?;
        let mut length = None;
        loop {
            line.clear();
            if self.stream.read_line(&mut line)? == 0 {
                return Err(bad("connection closed in the response head"));
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse::<usize>().ok();
            }
        }
        let mut body = vec![0; length.ok_or_else(|| bad("response without Content-Length"))?];
        self.stream.read_exact(&mut body)?;
        Ok((status, body))
    }
}
