//! `kvindex bench http`: lookups per second over HTTP from an index much larger than its L1
//! budget (the bounded L1's harness).
//!
//! 1. **Build** (once per data dir, [`bench_build::build_once`]): `--memberships` through the
//!    real durable pipeline, unbounded; what that index takes in memory is recorded as the
//!    yardstick (`bench-index.json`), with 4,096 lookup bodies sampled from the fleet's live
//!    prompts (`bench-queries.jsonl`).
//! 2. **Serve bounded**: `kvindex serve` on that data dir with `index.l1_max_bytes =
//!    --l1-max-bytes`; its bounded load leaves what does not fit in RocksDB (L2).
//! 3. **Load**: once the server's warm-up is done, every body is posted once (the answers'
//!    mean size, and how many name an engine); then `--connections` keep-alive connections
//!    (client threads, or `wrk` with `--wrk`; see `bench_load.rs`) post the bodies round-robin
//!    (`--batch` of them per request to `/v1/lookup/batch`) for `--warmup` then `--seconds`
//!    seconds, `--pairs` times. With `--baseline`, each phase is followed by one against the
//!    same server's fixed-answer route of the answers' mean size (`api/baseline.rs`), so the
//!    lookups' rate reads as a share of the HTTP stack's own. Printed: rates, latency
//!    percentiles, non-200 answers, the server's CPU per lookup (and per static answer, which
//!    the load generator's share of the cores does not skew), how many lookups went to L2
//!    (from `/v1/stats`), and the server's resident set against its budget.

use super::bench_build;
use super::bench_load::{LoadGenerator, Phase};
use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
use anyhow::{Context, bail};
use kvindex::bench::harness::{HttpClient, Spawned};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// Also load the same server's baseline route (`POST /bench/static`, a fixed answer of the
    /// lookups' mean size: the HTTP stack's own limit) in phases alternating with the
    /// lookups', and print the lookups' rate as a share of it.
    #[arg(long)]
    pub baseline: bool,
    /// Measured phases of lookups (each followed by one of the baseline with `--baseline`).
    #[arg(long, default_value_t = 1)]
    pub pairs: usize,
    /// Send the load with `wrk -t<wrk-threads> -c<connections>` instead of one client thread
    /// per connection.
    #[arg(long)]
    pub wrk: bool,
    /// wrk's threads (`-t`).
    #[arg(long, default_value_t = 2)]
    pub wrk_threads: usize,
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

/// Posts every body once: the mean answer size in bytes and the share of 200 answers that
/// named an engine (a bench whose queries miss measures nothing).
fn survey_answers(
    addr: SocketAddr,
    path: &str,
    bodies: &[Vec<u8>],
) -> anyhow::Result<(usize, f64)> {
    let mut http = HttpClient::connect(addr)?;
    let (mut bytes, mut answered, mut matched) = (0usize, 0usize, 0usize);
    for body in bodies {
        let (status, answer) = http.request("POST", path, body)?;
        if status != 200 {
            bail!(
                "{path} answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        bytes += answer.len();
        answered += 1;
        matched += usize::from(answer.windows(11).any(|w| w == b"\"engine_id\""));
    }
    let n = answered.max(1);
    Ok((bytes / n, matched as f64 / n as f64))
}

fn print_phase(label: &str, p: &Phase, per_request: usize) {
    println!(
        "{label}: {:.0} lookups/s in {:.0} requests/s over {:.1} s; latency p50 {:.0} µs, p99 \
         {:.0} µs, p99.9 {:.0} µs, max {:.0} µs; {} non-200",
        p.requests_per_s() * per_request as f64,
        p.requests_per_s(),
        p.elapsed.as_secs_f64(),
        p.p50_us,
        p.p99_us,
        p.p999_us,
        p.max_us,
        p.non_200,
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
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
        format!(
            "[index]\nl1_max_bytes = {}\n[http]\nbaseline_route = {}\n",
            args.l1_max_bytes, args.baseline
        ),
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

    let generator = match args.wrk {
        true => LoadGenerator::Wrk {
            threads: args.wrk_threads,
            dir: args.data_dir.clone(),
        },
        false => LoadGenerator::Threads,
    };
    let (answer_bytes, matched) = survey_answers(served.http, path, &queries)?;
    println!(
        "answers: {answer_bytes} bytes per request on average; {:.1}% named an engine",
        100.0 * matched
    );
    let static_path = format!("/bench/static?bytes={answer_bytes}");
    let run = |path: &str, seconds| {
        let duration = Duration::from_secs(seconds);
        generator.run(served.http, path, &queries, args.connections, duration)
    };
    run(path, args.warmup)?;
    if args.baseline {
        run(&static_path, args.warmup)?;
    }
    let start = get_stats(served.http)?;
    let (mut cpu, mut answered, mut lookup_time) = (Duration::ZERO, 0u64, Duration::ZERO);
    // The same for the baseline's phases: its requests and the server's CPU over them.
    let (mut static_cpu, mut static_answered) = (Duration::ZERO, 0u64);
    let (mut ratios, mut p99s) = (Vec::new(), Vec::new());
    for pair in 1..=args.pairs.max(1) {
        let cpu_start = served.cpu_time();
        let lookups = run(path, args.seconds)?;
        if let (Some(a), Some(b)) = (cpu_start, served.cpu_time()) {
            cpu += b.saturating_sub(a);
        }
        answered += lookups.answered * args.batch as u64;
        lookup_time += lookups.elapsed;
        p99s.push(lookups.p99_us);
        print_phase(&format!("[{pair}] lookups"), &lookups, args.batch);
        if args.baseline {
            let cpu_start = served.cpu_time();
            let baseline = run(&static_path, args.seconds)?;
            if let (Some(a), Some(b)) = (cpu_start, served.cpu_time()) {
                static_cpu += b.saturating_sub(a);
            }
            static_answered += baseline.answered;
            print_phase(&format!("[{pair}] baseline"), &baseline, 1);
            let ratio = lookups.requests_per_s() / baseline.requests_per_s().max(1e-9);
            println!("[{pair}] lookups / baseline = {ratio:.2}×");
            ratios.push(ratio);
        }
    }
    let end = get_stats(served.http)?;
    let delta = |path: &str| number(&end, path).saturating_sub(number(&start, path));
    println!(
        "over {} connections ({}): {:.0} lookups/s in {} per request; median p99 {:.0} µs",
        args.connections,
        match args.wrk {
            true => format!("wrk -t{}", args.wrk_threads),
            false => "client threads".to_owned(),
        },
        answered as f64 / lookup_time.as_secs_f64().max(1e-9),
        args.batch,
        median(p99s),
    );
    if args.baseline {
        println!(
            "lookups / baseline: median {:.2}× of {} pairs",
            median(ratios.clone()),
            ratios.len()
        );
    }
    // The server's own CPU per lookup: what the load generator sharing the cores, and the
    // machine's other tenants, do not change much (throughput they do).
    if served.cpu_time().is_some() {
        println!(
            "server CPU: {:.1} µs per lookup ({:.2} cores busy on average)",
            cpu.as_secs_f64() * 1e6 / answered.max(1) as f64,
            cpu.as_secs_f64() / lookup_time.as_secs_f64().max(1e-9),
        );
        if args.baseline {
            let per_static = static_cpu.as_secs_f64() * 1e6 / static_answered.max(1) as f64;
            let per_request =
                cpu.as_secs_f64() * 1e6 / (answered / args.batch as u64).max(1) as f64;
            println!(
                "server CPU: {per_static:.1} µs per static answer; a lookup request costs {:.2}× one",
                per_request / per_static.max(1e-9),
            );
        }
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
