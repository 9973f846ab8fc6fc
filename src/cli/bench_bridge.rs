//! `kvindex bench bridge`: what the engine bridge costs, inside `serve` on the embedded broker.
//!
//! 1. **Throughput, as a ratio.** `--engines` publishers that behave like vLLM's
//!    (`kvindex::bench::engine`, libzmq PUB + ROUTER, map-encoded batches) feed a `kvindex
//!    serve` whose config lists them. Each round publishes `--batches` batches per engine (one
//!    `BlockStored` of `--blocks` blocks each) through the bridge, and the same number of
//!    batches of the same shape straight into the embedded broker with a Kafka producer (keyed
//!    by engine, as the bridge keys them), in alternating order; each phase is timed from its
//!    first publish until the index has applied all its block operations (`/v1/stats` →
//!    `events.block_ops`). The ratio bridge / direct is the bridge's cost.
//! 2. **Latency.** Background traffic at `--latency-rate` block events/s through the bridge;
//!    every 20 ms one probe batch (a fresh chain) is published and lookups poll for it: the
//!    time from publish to the first lookup that sees it, p50 / p99.

use super::SPAWN_TIMEOUT;
use anyhow::Context;
use kvindex::bench::engine::{EngineEvent, EngineSpec, FakeEngine, encode_batch};
use kvindex::bench::harness::{HttpClient, Spawned};
use kvindex::sim::Rng;
use kvindex::source::{KafkaPublisher, labels};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MODEL: &str = "bench-model";
const BLOCK: u32 = 16;

#[derive(clap::Args, Debug)]
pub struct BridgeArgs {
    /// Data dir for the served index (emptied first).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Publishers (engines) at once.
    #[arg(long, default_value_t = 32)]
    pub engines: usize,
    /// Batches per engine per phase.
    #[arg(long, default_value_t = 1000)]
    pub batches: usize,
    /// Blocks per batch (one stored chain).
    #[arg(long, default_value_t = 16)]
    pub blocks: usize,
    /// Alternating (bridge, direct) pairs.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// Background block events per second during the latency run.
    #[arg(long, default_value_t = 10_000)]
    pub latency_rate: u64,
    /// Seconds of the latency run (0: skip it).
    #[arg(long, default_value_t = 10)]
    pub latency_seconds: u64,
}

/// A batch of one fresh chain of `blocks` blocks.
fn chain_batch(rng: &mut Rng, blocks: usize) -> Vec<EngineEvent> {
    let tokens: Vec<u32> = (0..blocks * BLOCK as usize)
        .map(|_| (rng.next_u64() % 100_000) as u32)
        .collect();
    vec![kvindex::bench::engine::chain(&tokens, BLOCK, None, 0)]
}

fn block_ops(http: SocketAddr) -> anyhow::Result<u64> {
    let (status, body) = HttpClient::connect(http)?.request("GET", "/v1/stats", b"")?;
    anyhow::ensure!(status == 200, "/v1/stats answered {status}");
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    v["events"]["block_ops"]
        .as_u64()
        .context("no events.block_ops in /v1/stats")
}

/// Waits until `block_ops` reaches `target`; returns when it did.
fn wait_ops(http: SocketAddr, target: u64) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if block_ops(http)? >= target {
            return Ok(Instant::now());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the index never applied {target} block ops"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn rate(ops: u64, took: Duration) -> f64 {
    ops as f64 / took.as_secs_f64()
}

/// Every engine publishes its batches through the bridge (one thread each).
fn bridge_phase(
    http: SocketAddr,
    engines: &[FakeEngine],
    work: &[Vec<Vec<EngineEvent>>],
) -> anyhow::Result<f64> {
    let ops: u64 = work.iter().flatten().flatten().map(event_blocks).sum();
    let before = block_ops(http)?;
    let started = Instant::now();
    std::thread::scope(|s| {
        for (engine, batches) in engines.iter().zip(work) {
            s.spawn(move || {
                for b in batches {
                    engine.publish(0, b.clone());
                }
            });
        }
    });
    let done = wait_ops(http, before + ops)?;
    Ok(rate(ops, done - started))
}

/// The same shape of batches straight into the embedded broker.
async fn direct_phase(
    http: SocketAddr,
    publisher: &KafkaPublisher,
    work: &[Vec<Vec<EngineEvent>>],
) -> anyhow::Result<f64> {
    let ops: u64 = work.iter().flatten().flatten().map(event_blocks).sum();
    let payloads: Vec<(String, Vec<u8>)> = work
        .iter()
        .enumerate()
        .flat_map(|(e, batches)| {
            batches.iter().map(move |b| {
                let payload = encode_batch(
                    0.0,
                    b,
                    Some(0),
                    kvindex::bench::engine::Encoding::Map,
                    kvindex::bench::engine::HashForm::U64,
                    BLOCK,
                );
                (format!("direct-{e}"), payload)
            })
        })
        .collect();
    let before = block_ops(http)?;
    let started = Instant::now();
    for (key, payload) in &payloads {
        publisher
            .send(Some(key), &labels(MODEL, ""), payload)
            .await?;
    }
    publisher.flush(Duration::from_secs(120)).await?;
    let done = wait_ops(http, before + ops)?;
    Ok(rate(ops, done - started))
}

fn event_blocks(ev: &EngineEvent) -> u64 {
    match ev {
        EngineEvent::Stored { hashes, .. } | EngineEvent::Removed { hashes, .. } => {
            hashes.len() as u64
        }
        EngineEvent::Cleared => 0,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// Background traffic at `rate` block events/s, and probes timed from publish to visible.
fn latency(
    http: SocketAddr,
    engines: &[FakeEngine],
    args: &BridgeArgs,
) -> anyhow::Result<Vec<Duration>> {
    let stop = AtomicBool::new(false);
    let mut samples = Vec::new();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let stop = &stop;
        s.spawn(move || {
            let mut rng = Rng::new(99);
            let batches_per_s = (args.latency_rate as f64 / args.blocks as f64).max(1.0);
            let gap = Duration::from_secs_f64(1.0 / batches_per_s);
            let mut next = Instant::now();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                // Engines 1.. carry the background; engine 0 the probes.
                let e = 1 + i % (engines.len() - 1).max(1);
                engines[e.min(engines.len() - 1)].publish(0, chain_batch(&mut rng, args.blocks));
                i += 1;
                next += gap;
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
        });
        let mut rng = Rng::new(7);
        let mut client = HttpClient::connect(http)?;
        let end = Instant::now() + Duration::from_secs(args.latency_seconds);
        while Instant::now() < end {
            let batch = chain_batch(&mut rng, args.blocks);
            let EngineEvent::Stored { tokens, .. } = &batch[0] else {
                unreachable!("chain_batch stores a chain")
            };
            let query =
                serde_json::json!({"model": MODEL, "token_ids": tokens, "block_size": BLOCK})
                    .to_string();
            let published = Instant::now();
            engines[0].publish(0, batch.clone());
            loop {
                let (status, body) = client.request("POST", "/v1/lookup", query.as_bytes())?;
                anyhow::ensure!(status == 200, "lookup answered {status}");
                if memchr_engine(&body) {
                    samples.push(published.elapsed());
                    break;
                }
                anyhow::ensure!(
                    published.elapsed() < Duration::from_secs(30),
                    "a probe never became visible"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    samples.sort();
    Ok(samples)
}

/// Whether a lookup answer names the probe engine (`bench-0`).
fn memchr_engine(body: &[u8]) -> bool {
    body.windows(b"\"bench-0\"".len())
        .any(|w| w == b"\"bench-0\"")
}

pub fn bridge(args: BridgeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.engines >= 2, "--engines must be at least 2");
    let _ = std::fs::remove_dir_all(&args.data_dir);
    std::fs::create_dir_all(&args.data_dir)?;
    let engines: Vec<FakeEngine> = (0..args.engines)
        .map(|_| FakeEngine::start(EngineSpec::vllm()))
        .collect();
    let mut config = String::from("[bridge]\ngone_after_s = 0\n");
    for (i, e) in engines.iter().enumerate() {
        config.push_str(&format!(
            "[[bridge.engines]]\nid = \"bench-{i}\"\nendpoint = \"{}\"\nreplay_endpoint = \"{}\"\nmodel = \"{MODEL}\"\n",
            e.endpoint(),
            e.replay_endpoint().unwrap_or_default()
        ));
    }
    let config_path = args.data_dir.join("bench-bridge.toml");
    std::fs::write(&config_path, config)?;
    let served = Spawned::serve(
        &std::env::current_exe()?,
        &args.data_dir.join("data"),
        Some(&config_path),
        SPAWN_TIMEOUT,
    )?;
    let http = served.http;
    let bootstrap = served
        .bootstrap
        .clone()
        .context("serve printed no embedded broker")?;
    for e in &engines {
        anyhow::ensure!(
            e.wait_for_subscribers(1, Duration::from_secs(60)),
            "the bridge never subscribed to {}",
            e.endpoint()
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let publisher = KafkaPublisher::new(&bootstrap, "kv-events", &Default::default())?;
    let mut rng = Rng::new(1);
    let mut work = || -> Vec<Vec<Vec<EngineEvent>>> {
        (0..args.engines)
            .map(|_| {
                (0..args.batches)
                    .map(|_| chain_batch(&mut rng, args.blocks))
                    .collect()
            })
            .collect()
    };
    println!(
        "{} engines × {} batches × {} blocks per phase, alternating pairs",
        args.engines, args.batches, args.blocks
    );
    let mut ratios = Vec::new();
    for pair in 0..args.pairs {
        let (bridge_work, direct_work) = (work(), work());
        let (via_bridge, direct) = if pair % 2 == 0 {
            let b = bridge_phase(http, &engines, &bridge_work)?;
            let d = runtime.block_on(direct_phase(http, &publisher, &direct_work))?;
            (b, d)
        } else {
            let d = runtime.block_on(direct_phase(http, &publisher, &direct_work))?;
            let b = bridge_phase(http, &engines, &bridge_work)?;
            (b, d)
        };
        println!(
            "pair {pair}: through the bridge {:.0} k block events/s, straight into the broker {:.0} k/s: ratio {:.2}",
            via_bridge / 1e3,
            direct / 1e3,
            via_bridge / direct
        );
        ratios.push((via_bridge, direct));
    }
    let mut sorted: Vec<f64> = ratios.iter().map(|(b, d)| b / d).collect();
    sorted.sort_by(f64::total_cmp);
    let mut bridged: Vec<f64> = ratios.iter().map(|(b, _)| *b).collect();
    bridged.sort_by(f64::total_cmp);
    println!(
        "median: {:.0} k block events/s through the bridge, {:.2} of the direct rate",
        bridged[bridged.len() / 2] / 1e3,
        sorted[sorted.len() / 2]
    );
    if args.latency_seconds > 0 {
        let samples = latency(http, &engines, &args)?;
        println!(
            "publish → visible in a lookup at {} block events/s: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} probes)",
            args.latency_rate,
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            percentile(&samples, 1.0),
            samples.len()
        );
    }
    served.terminate(super::STOP_TIMEOUT)?;
    Ok(())
}
