//! `kvindex bench ingest`: how close `kvindex serve` comes to the broker's delivery limit.
//!
//! One JetStream stream is pre-filled with `--messages` Stored events (`--blocks` blocks of
//! `--block-size` tokens each, in `--format`; [`kvindex::bench::ingest`]). Then, in
//! `--pairs` alternating pairs on that same stream:
//!
//! * **drain**: a plain async-nats pull consumer reads it from the start, acks and discards
//!   (the baseline: what the broker delivers to one consumer on this machine);
//! * **ingest**: a fresh `kvindex serve` (empty data dir, its own durable) indexes it with the
//!   default checkpoint cadence, timed until every message is durable (`/v1/stats`: the
//!   partition's `stored_offset` past the last sequence). The serve process starts consuming
//!   before its HTTP API listens, so the rate is taken over what it applied after the first
//!   `/v1/stats` answer: startup is excluded, the final commit is not.
//!
//! The ratio ingest / drain of each pair is printed, and the medians.

use super::{SPAWN_TIMEOUT, STOP_TIMEOUT};
use anyhow::Context;
use kvindex::bench::harness::{HttpClient, Spawned};
use kvindex::bench::ingest::{self, Workload};
use kvindex::event::Format;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct IngestArgs {
    /// Scratch directory for the served indexes (emptied first).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// NATS server with JetStream.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub nats: String,
    /// Messages in the pre-filled stream.
    #[arg(long, default_value_t = 100_000)]
    pub messages: usize,
    /// Blocks per message (one Stored event each).
    #[arg(long, default_value_t = 16)]
    pub blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Engines the messages are spread over (round-robin; one subject each).
    #[arg(long, default_value_t = 32)]
    pub engines: usize,
    /// Encoding: json, proto or vllm.
    #[arg(long, default_value = "json")]
    pub format: Format,
    /// Alternating (drain, ingest) pairs.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
}

/// How long one phase may take before the bench gives up.
const PHASE_LIMIT: Duration = Duration::from_secs(600);

/// What `/v1/stats` says about the (single) NATS partition.
struct Progress {
    applied_events: u64,
    block_ops: u64,
    /// Malformed payloads and skipped events, every reason summed.
    rejected: u64,
    stored_offset: i64,
}

fn progress(client: &mut HttpClient) -> anyhow::Result<Progress> {
    let (status, body) = client.request("GET", "/v1/stats", b"")?;
    anyhow::ensure!(status == 200, "/v1/stats answered {status}");
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    let events = &v["events"];
    let number = |x: &serde_json::Value, what: &str| {
        x.as_u64()
            .with_context(|| format!("no {what} in /v1/stats"))
    };
    let sum = |x: &serde_json::Value, what: &str| -> anyhow::Result<u64> {
        let reasons = x
            .as_object()
            .with_context(|| format!("no {what} in /v1/stats"))?;
        Ok(reasons.values().filter_map(serde_json::Value::as_u64).sum())
    };
    Ok(Progress {
        applied_events: number(&events["applied_total"], "events.applied_total")?,
        block_ops: number(&events["block_ops"], "events.block_ops")?,
        rejected: sum(&events["malformed"], "events.malformed")?
            + sum(&events["skipped"], "events.skipped")?,
        stored_offset: v["sources"]["partitions"][0]["stored_offset"]
            .as_i64()
            .unwrap_or(-1),
    })
}

/// One ingest phase: messages per second from the first stats answer until all is durable.
fn ingest_phase(
    args: &IngestArgs,
    dir: &Path,
    stream: &str,
    prefix: &str,
    last: u64,
    round: usize,
) -> anyhow::Result<f64> {
    let data = dir.join(format!("ingest-{round}"));
    let config = dir.join(format!("ingest-{round}.toml"));
    std::fs::write(
        &config,
        format!(
            "[source]\nkind = \"nats\"\n[source.nats]\nurl = \"{}\"\nstream = \"{stream}\"\n\
             subjects = [\"{prefix}.>\"]\ndurable = \"kvindex-bench-{round}\"\n",
            args.nats
        ),
    )?;
    let served = Spawned::serve(
        &std::env::current_exe()?,
        &data,
        Some(&config),
        SPAWN_TIMEOUT,
    )?;
    let result = time_until_durable(served.http, last);
    served.terminate(STOP_TIMEOUT)?;
    std::fs::remove_dir_all(&data)?;
    let (messages, took, end) = result?;
    anyhow::ensure!(
        end.rejected == 0,
        "{} payloads or events were malformed or skipped: the bench's encoding and the service \
         disagree",
        end.rejected
    );
    let expected = args.messages as u64 * args.blocks as u64;
    anyhow::ensure!(
        end.block_ops == expected,
        "the index applied {} block events, the stream holds {expected}",
        end.block_ops
    );
    Ok(messages as f64 / took.as_secs_f64())
}

/// Polls `/v1/stats` until the partition is durable past `last`; returns the messages applied
/// after the first answer, the time they took, and the final stats.
fn time_until_durable(http: SocketAddr, last: u64) -> anyhow::Result<(u64, Duration, Progress)> {
    let mut client = HttpClient::connect(http)?;
    let first = progress(&mut client)?;
    let started = Instant::now();
    loop {
        let now = progress(&mut client)?;
        if now.stored_offset > last as i64 {
            let took = started.elapsed();
            return Ok((now.applied_events - first.applied_events, took, now));
        }
        anyhow::ensure!(
            started.elapsed() < PHASE_LIMIT,
            "kvindex serve did not make the stream durable within {PHASE_LIMIT:?} (stored \
             offset {}, last sequence {last})",
            now.stored_offset
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

pub fn ingest(args: IngestArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.pairs > 0 && args.messages > 0 && args.blocks > 0,
        "--pairs, --messages and --blocks must be at least 1"
    );
    let _ = std::fs::remove_dir_all(&args.data_dir);
    std::fs::create_dir_all(&args.data_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let tag = super::run_tag();
    let stream = format!("KVBENCH_INGEST_{tag}");
    let prefix = format!("kvbench.ingest.{tag}");
    let workload = Workload {
        messages: args.messages,
        blocks: args.blocks,
        block_size: args.block_size,
        engines: args.engines,
        turns: 8,
        format: args.format,
        seed: 1,
    };
    let payloads = workload.payloads();
    let bytes: usize = payloads.iter().map(|p| p.bytes.len()).sum();
    let last = runtime
        .block_on(ingest::fill_stream(&args.nats, &stream, &prefix, payloads))
        .context("pre-filling the stream")?;
    anyhow::ensure!(
        last == args.messages as u64,
        "stream {stream} holds {last} messages, expected {} (was it fresh?)",
        args.messages
    );
    println!(
        "stream {stream}: {} {:?} messages of {} blocks × {} tokens ({:.0} bytes each), {} block events; alternating pairs",
        args.messages,
        args.format,
        args.blocks,
        args.block_size,
        bytes as f64 / args.messages as f64,
        workload.block_events()
    );
    let result = run_pairs(&args, &runtime, &stream, &prefix, last);
    let deleted = runtime.block_on(ingest::delete_stream(&args.nats, &stream));
    let _ = std::fs::remove_dir_all(&args.data_dir);
    let (drains, ingests) = result?;
    deleted.context("deleting the bench stream")?;
    let ratios: Vec<f64> = ingests.iter().zip(&drains).map(|(i, d)| i / d).collect();
    println!(
        "median: plain drain {:.1} k msgs/s, kvindex serve {:.1} k msgs/s ({:.0} k block events/s): ratio {:.2}",
        median(&drains) / 1e3,
        median(&ingests) / 1e3,
        median(&ingests) * args.blocks as f64 / 1e3,
        median(&ratios)
    );
    Ok(())
}

/// The alternating pairs: (drain rates, ingest rates), messages per second.
fn run_pairs(
    args: &IngestArgs,
    runtime: &tokio::runtime::Runtime,
    stream: &str,
    prefix: &str,
    last: u64,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let drain = |round: usize| -> anyhow::Result<f64> {
        let consumer = format!("kvbench-drain-{round}");
        let drained = runtime
            .block_on(ingest::drain(
                &args.nats,
                stream,
                &consumer,
                last,
                PHASE_LIMIT,
            ))
            .context("plain drain")?;
        anyhow::ensure!(
            drained.messages == last,
            "the drain received {} messages, the stream holds {last}",
            drained.messages
        );
        Ok(drained.messages_per_sec())
    };
    let mut drains = Vec::new();
    let mut ingests = Vec::new();
    for pair in 0..args.pairs {
        let (d, i) = if pair % 2 == 0 {
            let d = drain(pair)?;
            (
                d,
                ingest_phase(args, &args.data_dir, stream, prefix, last, pair)?,
            )
        } else {
            let i = ingest_phase(args, &args.data_dir, stream, prefix, last, pair)?;
            (drain(pair)?, i)
        };
        println!(
            "pair {pair}: plain drain {:.1} k msgs/s, kvindex serve {:.1} k msgs/s ({:.0} k block events/s durable): ratio {:.2}",
            d / 1e3,
            i / 1e3,
            i * args.blocks as f64 / 1e3,
            i / d
        );
        drains.push(d);
        ingests.push(i);
    }
    Ok((drains, ingests))
}
