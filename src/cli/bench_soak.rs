//! `kvindex bench soak`: a long run of steady traffic at a share of the measured capacity, to
//! show that nothing drifts: memory, lag, latency, the logs.
//!
//! 1. **Serve** `kvindex serve` on a fresh JetStream stream (capped at `--stream-max-bytes`,
//!    oldest messages dropped first: the consumer reads near its head), logging warnings and
//!    errors to `serve.log` in `--data-dir`.
//! 2. **Probe** the capacity of the whole workload on this machine: `kvindex produce`
//!    publishes the fleet's events as fast as it can (for three times `--probe-seconds`) while
//!    the server indexes them; once the index has reached its steady size (the fleet's stores
//!    have filled every cache twice over), for `--probe-seconds` `--connections` client
//!    threads post lookups back to back beside. What the server applied and answered per
//!    second in that window is the capacity of the machine with its load generators on it,
//!    which share its cores in the soak too. Then the rest is drained.
//! 3. **Soak** for `--seconds`: the producer paced at `--load` × the probed block events per
//!    second (a new fleet, whose caches evict, so the index reaches a steady size) and lookups
//!    paced at `--load` × the probed lookup rate, open loop: each request has a scheduled send
//!    time and its latency counts from then, so a stalled server shows as latency, not as
//!    fewer requests. Every `--sample-seconds` the server's `/v1/stats` and resident set are
//!    read.
//!
//! Printed: one row per `--window-seconds` window (block events applied per second, the
//! largest lag, lookups due per second (every one is sent, a late one at once), p50 / p99 /
//! max latency, non-200 answers, resident set), the resident set's slope after the first
//! window (least squares, MiB per hour; after the first fifth of a run shorter than five
//! windows), stalls (a partition with messages waiting whose applied offset did not move for
//! three samples), and every line the server and the producers logged at warning level or
//! above.

use super::bench_build::lookup_body;
use super::bench_load::{LoadGenerator, percentile};
use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
use anyhow::{Context, bail};
use kvindex::bench::harness::{HttpClient, Spawned};
use kvindex::bench::ingest;
use kvindex::sim::{Fleet, FleetSettings};
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// Scratch directory (emptied first): the served index and the logs.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// NATS server with JetStream.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub nats: String,
    /// Seconds of soak, after the probe.
    #[arg(long, default_value_t = 3600)]
    pub seconds: u64,
    /// Seconds per reported window.
    #[arg(long, default_value_t = 300)]
    pub window_seconds: u64,
    /// Share of the probed capacity offered during the soak (ingest and lookups alike).
    #[arg(long, default_value_t = 0.5)]
    pub load: f64,
    /// Seconds of the capacity probe.
    #[arg(long, default_value_t = 30)]
    pub probe_seconds: u64,
    /// Seconds between two readings of the server's stats and resident set.
    #[arg(long, default_value_t = 10)]
    pub sample_seconds: u64,
    /// Engines of the simulated fleet.
    #[arg(long, default_value_t = 64)]
    pub engines: usize,
    /// Blocks each engine's cache holds (the index's steady size is about engines × this).
    #[arg(long, default_value_t = 16_384)]
    pub capacity_blocks: usize,
    /// Encoding of the events: proto, json or vllm.
    #[arg(long, default_value = "proto")]
    pub format: String,
    /// Lookup client connections (one thread each).
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// The stream's cap, in bytes.
    #[arg(long, default_value_t = 4 << 30)]
    pub stream_max_bytes: i64,
}

/// Lookup bodies drawn from the soak fleet's live prompts.
const QUERIES: usize = 4096;
/// How long the backlog of the probe (or the soak's tail) may take to drain.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(600);
/// The probe's producer runs this many times `--probe-seconds`: the warm-up and the window
/// must end before it does.
const PROBE_PRODUCER_FACTOR: u64 = 3;
/// Samples without progress, with messages waiting, that count as a stall.
const STALL_SAMPLES: usize = 3;

/// One reading of the server.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Duration,
    block_ops: u64,
    applied: i64,
    lag: i64,
    memberships: u64,
    rss: u64,
}

/// One answered (or refused) lookup of the soak: when it was due, and its latency.
#[derive(Clone, Copy)]
struct Request {
    due_ms: u32,
    latency_us: u32,
    ok: bool,
}

pub fn soak(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.load > 0.0 && args.load <= 1.0,
        "--load is a share of the capacity, in (0, 1]"
    );
    anyhow::ensure!(
        args.seconds > 0 && args.window_seconds > 0 && args.sample_seconds > 0,
        "--seconds, --window-seconds and --sample-seconds must be at least 1"
    );
    let _ = std::fs::remove_dir_all(&args.data_dir);
    std::fs::create_dir_all(&args.data_dir)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tag = super::run_tag();
    let stream = format!("KVSOAK_{tag}");
    let prefix = format!("kvsoak.{tag}");
    runtime
        .block_on(ingest::create_capped_stream(
            &args.nats,
            &stream,
            &prefix,
            args.stream_max_bytes,
        ))
        .context("creating the soak stream")?;
    let result = run(&args, &stream, &prefix);
    let deleted = runtime.block_on(ingest::delete_stream(&args.nats, &stream));
    let _ = std::fs::remove_dir_all(args.data_dir.join("index"));
    result?;
    deleted.context("deleting the soak stream")?;
    Ok(())
}

fn run(args: &SoakArgs, stream: &str, prefix: &str) -> anyhow::Result<()> {
    let dir = &args.data_dir;
    let config = dir.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "[source]\nkind = \"nats\"\n[source.nats]\nurl = \"{}\"\nstream = \"{stream}\"\n\
             subjects = [\"{prefix}.>\"]\ndurable = \"kvindex-soak\"\n",
            args.nats
        ),
    )?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.join("index"))
        .arg("--config")
        .arg(&config)
        .env("KVINDEX_LOG", "warn")
        .stderr(File::create(dir.join("serve.log"))?);
    // The probe: everything the soak runs, at once and unpaced, on the same machine. The
    // producer publishes as fast as it can while the server indexes; once the index has
    // reached its steady size, the window opens and the lookups run flat out beside. What was
    // applied and answered in the window is what this machine sustains with the load
    // generators on it, as in the soak.
    let probe_fleet = fleet_settings(args, 1);
    let bodies = Arc::new(lookup_bodies(&probe_fleet));
    let served = Spawned::start(cmd, SPAWN_TIMEOUT)?;
    let mut client = HttpClient::connect(served.http)?;
    let mut producer = spawn_producer(
        args,
        stream,
        prefix,
        &probe_fleet,
        None,
        PROBE_PRODUCER_FACTOR * args.probe_seconds,
        "probe",
    )?;
    // Capacity at the steady size, not that of a young index: the window opens once the
    // fleet's stores have filled every cache twice over (so evictions run as in the soak).
    let warm_up_events = 2 * (args.engines * args.capacity_blocks) as u64;
    let since = Instant::now();
    while sample(&mut client, &served, since)?.block_ops < warm_up_events {
        anyhow::ensure!(
            producer.try_wait()?.is_none() && since.elapsed() < CATCH_UP_LIMIT,
            "the index did not reach its steady size while the probe's producer ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = sample(&mut client, &served, Instant::now())?;
    let started = Instant::now();
    let lookups = LoadGenerator::Threads.run(
        served.http,
        "/v1/lookup",
        &bodies,
        args.connections,
        Duration::from_secs(args.probe_seconds),
    )?;
    let after = sample(&mut client, &served, started)?;
    let producer_ran_through = producer.try_wait()?.is_none();
    let ingest_rate =
        (after.block_ops - before.block_ops) as f64 / after.at.as_secs_f64().max(1e-9);
    println!(
        "probe ({} s from {} memberships, producer, server and lookups at once, unpaced): \
         {:.1} k block events/s applied (messages waiting: {} at the start, {} at the end: {}), \
         {:.0} lookups/s (p99 {:.2} ms, {} non-200)",
        args.probe_seconds,
        before.memberships,
        ingest_rate / 1e3,
        before.lag,
        after.lag,
        if !producer_ran_through {
            "the producer stopped inside the window, so the ingest figure is a lower bound"
        } else if after.lag > before.lag + 1_000 {
            "the server set the pace"
        } else {
            "the producer set the pace"
        },
        lookups.requests_per_s(),
        lookups.p99_us / 1e3,
        lookups.non_200
    );
    wait_exit(&mut producer, "the probe's producer")?;
    catch_up(&mut client, &served)?;

    // The soak.
    let block_rate = (ingest_rate * args.load).max(1.0) as u64;
    let lookup_rate = (lookups.requests_per_s() * args.load).max(1.0);
    println!(
        "soak: {} s at {:.0}% of the probe: {:.1} k block events/s, {lookup_rate:.0} lookups/s",
        args.seconds,
        args.load * 100.0,
        block_rate as f64 / 1e3,
    );
    let soak_fleet = fleet_settings(args, 2);
    let bodies = Arc::new(lookup_bodies(&soak_fleet));
    let cpu_before = served.cpu_time();
    let started = Instant::now();
    let mut producer = spawn_producer(
        args,
        stream,
        prefix,
        &soak_fleet,
        Some(block_rate),
        args.seconds,
        "soak",
    )?;
    let duration = Duration::from_secs(args.seconds);
    let clients: Vec<_> = (0..args.connections)
        .map(|c| {
            let bodies = bodies.clone();
            let (addr, n) = (served.http, args.connections);
            std::thread::spawn(move || {
                paced_client(addr, &bodies, c, n, lookup_rate, started, duration)
            })
        })
        .collect();
    let mut samples = vec![sample(&mut client, &served, started)?];
    let mut stalls = 0;
    while started.elapsed() < duration {
        std::thread::sleep(Duration::from_secs(args.sample_seconds));
        let s = sample(&mut client, &served, started)?;
        samples.push(s);
        if stalled(&samples) {
            stalls += 1;
            println!(
                "stall at {} s: {} messages waiting, applied offset {} for {STALL_SAMPLES} samples",
                s.at.as_secs(),
                s.lag,
                s.applied
            );
        }
    }
    let mut requests = Vec::new();
    for c in clients {
        requests.extend(
            c.join()
                .map_err(|_| anyhow::anyhow!("a lookup client panicked"))??,
        );
    }
    wait_exit(&mut producer, "the soak's producer")?;
    let cpu = served
        .cpu_time()
        .zip(cpu_before)
        .map(|(a, b)| (a - b).as_secs_f64() / started.elapsed().as_secs_f64());
    catch_up(&mut client, &served)?;
    let last = sample(&mut client, &served, started)?;
    let status = served.terminate(STOP_TIMEOUT)?;
    anyhow::ensure!(status.success(), "kvindex serve stopped with {status}");

    report(args, &samples, &mut requests, stalls);
    println!(
        "end: {} memberships, {} block events applied in all; server CPU {}",
        last.memberships,
        last.block_ops,
        cpu.map_or("unknown".into(), |c| format!("{c:.2} cores on average"))
    );
    let logged = logged_lines(dir)?;
    println!("log lines at warning level or above: {}", logged.len());
    for line in logged.iter().take(20) {
        println!("  {line}");
    }
    Ok(())
}

fn fleet_settings(args: &SoakArgs, seed: u64) -> FleetSettings {
    FleetSettings {
        engines: args.engines,
        capacity_blocks: args.capacity_blocks,
        seed,
        ..FleetSettings::default()
    }
}

/// Lookups of prompts the fleet serves once it has run a while.
fn lookup_bodies(settings: &FleetSettings) -> Vec<Vec<u8>> {
    let mut fleet = Fleet::new(settings.clone());
    for _ in 0..20_000 {
        fleet.next_request();
    }
    (0..QUERIES)
        .map(|_| {
            let (p, tokens) = fleet.sample_query();
            lookup_body(&p, &tokens).to_string().into_bytes()
        })
        .collect()
}

/// `kvindex produce` of `fleet` into the stream for `seconds`, at `block_rate` block events
/// per second or as fast as it can; its output goes to `producer-<name>.log`.
fn spawn_producer(
    args: &SoakArgs,
    stream: &str,
    prefix: &str,
    fleet: &FleetSettings,
    block_rate: Option<u64>,
    seconds: u64,
    name: &str,
) -> anyhow::Result<Child> {
    let log = File::create(args.data_dir.join(format!("producer-{name}.log")))?;
    Command::new(std::env::current_exe()?)
        .args(["produce", "--nats", &args.nats, "--stream", stream])
        .args(["--subject-prefix", prefix, "--format", &args.format])
        .args(["--requests", "0", "--seconds", &seconds.to_string()])
        .args(["--engines", &fleet.engines.to_string()])
        .args(["--capacity-blocks", &fleet.capacity_blocks.to_string()])
        .args(["--seed", &fleet.seed.to_string()])
        .args(["--block-rate", &block_rate.unwrap_or(0).to_string()])
        .env("KVINDEX_LOG", "warn")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting kvindex produce")
}

fn wait_exit(child: &mut Child, what: &str) -> anyhow::Result<()> {
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "{what} exited with {status}");
    Ok(())
}

fn sample(client: &mut HttpClient, served: &Spawned, since: Instant) -> anyhow::Result<Sample> {
    let (status, body) = client.request("GET", "/v1/stats", b"")?;
    anyhow::ensure!(status == 200, "/v1/stats answered {status}");
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    let partition = &v["sources"]["partitions"][0];
    Ok(Sample {
        at: since.elapsed(),
        block_ops: v["events"]["block_ops"].as_u64().unwrap_or(0),
        applied: partition["applied_offset"].as_i64().unwrap_or(-1),
        lag: partition["lag"].as_i64().unwrap_or(-1),
        memberships: v["index"]["memberships"].as_u64().unwrap_or(0),
        rss: served.rss().map_or(0, |(rss, _)| rss),
    })
}

/// Waits until the server has applied everything the stream holds.
fn catch_up(client: &mut HttpClient, served: &Spawned) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let s = sample(client, served, started)?;
        if s.lag == 0 {
            return Ok(());
        }
        if started.elapsed() > CATCH_UP_LIMIT {
            bail!("still {} messages behind after {CATCH_UP_LIMIT:?}", s.lag);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The last [`STALL_SAMPLES`] samples had messages waiting and no progress.
fn stalled(samples: &[Sample]) -> bool {
    let Some(recent) = samples
        .len()
        .checked_sub(STALL_SAMPLES + 1)
        .map(|i| &samples[i..])
    else {
        return false;
    };
    recent
        .iter()
        .skip(1)
        .all(|s| s.lag > 0 && s.applied == recent[0].applied)
}

/// Client `index` of `of`: posts lookups at `rate / of` per second from `started` for
/// `duration`, each at its due time (or at once when late), and records every one.
fn paced_client(
    addr: SocketAddr,
    bodies: &[Vec<u8>],
    index: usize,
    of: usize,
    rate: f64,
    started: Instant,
    duration: Duration,
) -> anyhow::Result<Vec<Request>> {
    let interval = Duration::from_secs_f64(of as f64 / rate);
    let mut due = started + interval.mul_f64(index as f64 / of as f64);
    let end = started + duration;
    let mut http = HttpClient::connect(addr)?;
    let mut out = Vec::with_capacity((duration.as_secs_f64() * rate / of as f64) as usize + 1);
    let mut i = index * bodies.len() / of.max(1);
    while due < end {
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let ok = match http.request("POST", "/v1/lookup", &bodies[i % bodies.len()]) {
            Ok((status, _)) => status == 200,
            Err(_) => {
                http = HttpClient::connect(addr)?;
                false
            }
        };
        out.push(Request {
            due_ms: due.duration_since(started).as_millis() as u32,
            latency_us: due.elapsed().as_micros().min(u32::MAX as u128) as u32,
            ok,
        });
        due += interval;
        i += 1;
    }
    Ok(out)
}

fn report(args: &SoakArgs, samples: &[Sample], requests: &mut [Request], stalls: usize) {
    let window = Duration::from_secs(args.window_seconds);
    requests.sort_unstable_by_key(|r| r.due_ms);
    println!(
        "{:>11} {:>14} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "window (s)",
        "k blk ev/s",
        "max lag",
        "due/s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "non-200",
        "RSS MiB"
    );
    let windows = args.seconds.div_ceil(args.window_seconds);
    for w in 0..windows as u32 {
        let (from, to) = (
            window * w,
            (window * (w + 1)).min(Duration::from_secs(args.seconds)),
        );
        let inside: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.at > from && s.at <= to)
            .collect();
        let first = samples
            .iter()
            .rev()
            .find(|s| s.at <= from)
            .or(samples.first());
        let (Some(first), Some(last)) = (first, inside.last()) else {
            continue;
        };
        let applied = (last.block_ops - first.block_ops) as f64
            / (last.at - first.at).as_secs_f64().max(1e-9);
        let max_lag = inside.iter().map(|s| s.lag).max().unwrap_or(0);
        let (lo, hi) = (from.as_millis() as u32, to.as_millis() as u32);
        let in_window: Vec<&Request> = requests
            .iter()
            .filter(|r| r.due_ms >= lo && r.due_ms < hi)
            .collect();
        let mut latencies: Vec<u32> = in_window
            .iter()
            .filter(|r| r.ok)
            .map(|r| r.latency_us)
            .collect();
        latencies.sort_unstable();
        let non_200 = in_window.len() - latencies.len();
        println!(
            "{:>5}-{:<5} {:>14.1} {:>9} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8} {:>9.1}",
            from.as_secs(),
            to.as_secs(),
            applied / 1e3,
            max_lag,
            in_window.len() as f64 / (to - from).as_secs_f64(),
            percentile(&latencies, 0.50) / 1e3,
            percentile(&latencies, 0.99) / 1e3,
            percentile(&latencies, 1.0) / 1e3,
            non_200,
            last.rss as f64 / (1 << 20) as f64
        );
    }
    // Warm-up: the first window, or the first fifth of a short run.
    let warm_from = window.min(Duration::from_secs(args.seconds) / 5);
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.at >= warm_from).collect();
    match rss_slope_mib_per_hour(&warm) {
        Some(slope) => println!(
            "resident set from {} s on: {:.1} → {:.1} MiB (max {:.1}), slope {slope:+.2} MiB/h",
            warm_from.as_secs(),
            warm[0].rss as f64 / (1 << 20) as f64,
            warm[warm.len() - 1].rss as f64 / (1 << 20) as f64,
            warm.iter().map(|s| s.rss).max().unwrap_or(0) as f64 / (1 << 20) as f64
        ),
        None => println!("resident set: too few samples after the warm-up for a slope"),
    }
    println!("stalls: {stalls}");
}

/// Least-squares slope of the resident set over time.
fn rss_slope_mib_per_hour(samples: &[&Sample]) -> Option<f64> {
    if samples.len() < 3 {
        return None;
    }
    let n = samples.len() as f64;
    let xs: Vec<f64> = samples
        .iter()
        .map(|s| s.at.as_secs_f64() / 3600.0)
        .collect();
    let ys: Vec<f64> = samples
        .iter()
        .map(|s| s.rss as f64 / (1 << 20) as f64)
        .collect();
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Every non-empty line of the server's and the producers' logs (they log warnings and
/// errors only).
fn logged_lines(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut lines = Vec::new();
    for name in ["serve.log", "producer-probe.log", "producer-soak.log"] {
        let text = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        lines.extend(
            text.lines()
                .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                .map(|l| format!("{name}: {l}")),
        );
    }
    Ok(lines)
}
