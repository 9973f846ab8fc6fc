//! `kvindex bench http`: lookups per second over HTTP from an index much larger than its L1
//! budget (the bounded L1's harness).
//!
//! 1. **Build** (once per data dir, [`bench_build::build_once`]): `--memberships` through the
//!    real durable pipeline, unbounded; what that index takes in memory is recorded as the
//!    yardstick (`bench-index.json`), with 4,096 lookup bodies sampled from the fleet's live
//!    prompts (`bench-queries.jsonl`).
//! 2. **Serve bounded**: `kvindex serve` on that data dir with `index.l1_max_bytes =
//!    --l1-max-bytes`; its bounded load leaves what does not fit in RocksDB (L2).
//! 3. **Load**: once the server's warm-up is done, `--connections` keep-alive connections (one
//!    thread each, one request in flight each) post the bodies round-robin (`--batch` of them
//!    per request to `/v1/lookup/batch`) for `--warmup` then `--seconds` seconds. Printed:
//!    lookups/s, latency percentiles, non-200 answers, how many lookups went to L2 (from
//!    `/v1/stats`), and the server's resident set against its budget.

use super::bench_build;
use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
use anyhow::{Context, bail};
use kvindex::bench::harness::{HttpClient, Spawned};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct HttpArgs {
    /// Data dir: built if it holds no index yet, reused otherwise.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Memberships to build.
    #[arg(long, default_value_t = 5_000_000)]
    pub memberships: u64,
    /// The served index's L1 budget, in bytes (`index.l1_max_bytes`).
    #[arg(long, default_value_t = 32 << 20)]
    pub l1_max_bytes: u64,
    /// Concurrent connections (one client thread each).
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// Seconds measured.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Ask for at most this many engines per answer (the lookup's `limit`), as a router
    /// picking among the best few would; default: whole answers.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Queries per request: above 1, each request posts that many to `/v1/lookup/batch`.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
}

/// `{"queries": [...]}` of the given lookup bodies.
fn batch_body(queries: &[Vec<u8>]) -> Vec<u8> {
    let mut out = b"{\"queries\":[".to_vec();
    for (i, q) in queries.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(q);
    }
    out.extend_from_slice(b"]}");
    out
}

/// `body` (a JSON object) with `"limit": n` as its first field.
fn with_limit(body: &[u8], n: usize) -> anyhow::Result<Vec<u8>> {
    let rest = body
        .strip_prefix(b"{")
        .context("a bench query is not a JSON object")?;
    let mut out = format!("{{\"limit\":{n},").into_bytes();
    out.extend_from_slice(rest);
    Ok(out)
}

/// What one load phase did.
#[derive(Default)]
struct LoadReport {
    /// Latencies of answered lookups, in microseconds.
    latencies_us: Vec<u32>,
    non_200: u64,
    /// Answers naming at least one engine.
    matched: u64,
    elapsed: Duration,
}

impl LoadReport {
    fn merge(&mut self, other: LoadReport) {
        self.latencies_us.extend(other.latencies_us);
        self.non_200 += other.non_200;
        self.matched += other.matched;
    }

    fn percentile_us(&self, q: f64) -> u32 {
        let n = self.latencies_us.len();
        if n == 0 {
            return 0;
        }
        self.latencies_us[((n - 1) as f64 * q).round() as usize]
    }
}

/// One client thread: posts `queries` to `path` (starting at `first`) until `stop`.
fn client(
    addr: SocketAddr,
    path: &str,
    queries: &[Vec<u8>],
    first: usize,
    stop: &AtomicBool,
) -> anyhow::Result<LoadReport> {
    let mut http = HttpClient::connect(addr)?;
    let mut report = LoadReport::default();
    let mut i = first;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let (status, body) = http.request("POST", path, &queries[i % queries.len()])?;
        let took = started.elapsed();
        if status == 200 {
            report
                .latencies_us
                .push(took.as_micros().min(u32::MAX as u128) as u32);
            report.matched += u64::from(body.windows(11).any(|w| w == b"\"engine_id\""));
        } else {
            report.non_200 += 1;
        }
        i += 1;
    }
    Ok(report)
}

/// `connections` clients for `duration`; latencies sorted.
fn load(
    addr: SocketAddr,
    path: &'static str,
    queries: &Arc<Vec<Vec<u8>>>,
    connections: usize,
    duration: Duration,
) -> anyhow::Result<LoadReport> {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let threads: Vec<_> = (0..connections)
        .map(|c| {
            let (queries, stop) = (queries.clone(), stop.clone());
            let first = c * queries.len() / connections.max(1);
            std::thread::spawn(move || client(addr, path, &queries, first, &stop))
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    let mut report = LoadReport::default();
    for t in threads {
        let r = t
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        report.merge(r);
    }
    report.elapsed = started.elapsed();
    report.latencies_us.sort_unstable();
    Ok(report)
}

fn get_stats(addr: SocketAddr) -> anyhow::Result<Value> {
    let (status, body) = HttpClient::connect(addr)?.request("GET", "/v1/stats", b"")?;
    if status != 200 {
        bail!("/v1/stats answered {status}");
    }
    Ok(serde_json::from_slice(&body)?)
}

fn number(v: &Value, path: &str) -> u64 {
    v.pointer(path).and_then(Value::as_u64).unwrap_or(0)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

pub fn http(args: HttpArgs) -> anyhow::Result<()> {
    if args.connections == 0 || args.seconds == 0 {
        bail!("--connections and --seconds must be at least 1");
    }
    bench_build::build_once(&args.data_dir, args.memberships, 0)?;
    let mut queries = bench_build::read_queries(&args.data_dir)?;
    if let Some(n) = args.limit {
        queries = queries
            .iter()
            .map(|q| with_limit(q, n))
            .collect::<anyhow::Result<_>>()?;
    }
    let path = match args.batch {
        0 => bail!("--batch must be at least 1"),
        1 => "/v1/lookup",
        n => {
            queries = queries.chunks_exact(n).map(batch_body).collect();
            "/v1/lookup/batch"
        }
    };
    let queries = Arc::new(queries);
    let built: Value = serde_json::from_slice(
        &std::fs::read(bench_build::built_file(&args.data_dir))
            .context("reading bench-index.json (use a fresh --data-dir)")?,
    )?;
    let config = args.data_dir.join("bench-http.toml");
    std::fs::write(
        &config,
        format!("[index]\nl1_max_bytes = {}\n", args.l1_max_bytes),
    )?;

    let served = Spawned::serve(
        &std::env::current_exe()?,
        &args.data_dir,
        Some(&config),
        SPAWN_TIMEOUT,
    )?;
    served.wait_answering(Duration::from_secs(300))?;
    served.wait_warm(Duration::from_secs(600))?;
    let before = get_stats(served.http)?;
    let unbounded = number(&built, "/l1_bytes");
    println!(
        "index: {} memberships, {:.1} MiB unbounded = {:.1}× the L1 budget of {:.1} MiB; \
         served: L1 {:.1} MiB in {} entries, L2 ~{} rows",
        number(&before, "/index/memberships"),
        mib(unbounded),
        unbounded as f64 / args.l1_max_bytes as f64,
        mib(args.l1_max_bytes),
        mib(number(&before, "/writeback/l1_bytes")),
        number(&before, "/writeback/l1_entries"),
        number(&before, "/writeback/l2_entries"),
    );

    let run = |seconds| {
        let duration = Duration::from_secs(seconds);
        load(served.http, path, &queries, args.connections, duration)
    };
    run(args.warmup)?;
    let start = get_stats(served.http)?;
    let cpu_start = served.cpu_time();
    let r = run(args.seconds)?;
    let cpu_end = served.cpu_time();
    let end = get_stats(served.http)?;
    let requests = r.latencies_us.len() as u64;
    let answered = requests * args.batch as u64;
    let delta = |path: &str| number(&end, path).saturating_sub(number(&start, path));
    println!(
        "http: {answered} lookups in {requests} requests ({} per request) in {:.1} s over {} \
         connections = {:.0} lookups/s; request latency p50 {} µs, p99 {} µs, p99.9 {} µs, \
         max {} µs; {} non-200; {:.1}% named an engine",
        args.batch,
        r.elapsed.as_secs_f64(),
        args.connections,
        answered as f64 / r.elapsed.as_secs_f64(),
        r.percentile_us(0.50),
        r.percentile_us(0.99),
        r.percentile_us(0.999),
        r.percentile_us(1.0),
        r.non_200,
        100.0 * r.matched as f64 / requests.max(1) as f64,
    );
    // The server's own CPU per lookup: what the load generator sharing the cores, and the
    // machine's other tenants, do not change much (throughput they do).
    if let (Some(a), Some(b)) = (cpu_start, cpu_end) {
        let used = b.saturating_sub(a);
        println!(
            "server CPU: {:.1} µs per lookup ({:.2} cores busy on average)",
            used.as_secs_f64() * 1e6 / answered.max(1) as f64,
            used.as_secs_f64() / r.elapsed.as_secs_f64(),
        );
    }
    println!(
        "L2 during the run: {} point reads ({:.1} per lookup), {} found, {} restored to L1; \
         L1 now {:.1} MiB, {} write-back batches",
        delta("/writeback/l2_reads"),
        delta("/writeback/l2_reads") as f64 / answered.max(1) as f64,
        delta("/writeback/l2_hits"),
        delta("/writeback/restored"),
        mib(number(&end, "/writeback/l1_bytes")),
        delta("/writeback/batches"),
    );
    if let Some((rss, peak)) = served.rss() {
        println!(
            "server memory: RSS {:.0} MiB, peak {:.0} MiB, for an L1 budget of {:.1} MiB",
            mib(rss),
            mib(peak),
            mib(args.l1_max_bytes)
        );
    }
    served.terminate(STOP_TIMEOUT)?;
    Ok(())
}
