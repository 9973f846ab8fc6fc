//! `kvindex produce`: a synthetic engine fleet writing its events in any encoding.

use anyhow::Context;
use kvindex::event::{Event, Format, encode};
use kvindex::produce::{Fleet, FleetConfig};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ProduceArgs {
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    #[arg(long, default_value_t = 2)]
    pub adapters: usize,
    #[arg(long, default_value_t = 1)]
    pub tenants: usize,
    #[arg(long, default_value_t = 1)]
    pub models: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Simulated requests.
    #[arg(long, default_value_t = 10_000)]
    pub requests: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Encoding: proto, json or vllm.
    #[arg(long, default_value = "proto")]
    pub format: Format,
    /// Where to write payloads (`-` = stdout). JSON payloads are one per line; protobuf and
    /// msgpack payloads are framed by a 4-byte big-endian length.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn payloads(events: &[Event], format: Format) -> Vec<Vec<u8>> {
    match format {
        Format::Json => vec![encode::to_json(events)],
        // vLLM batches carry no engine id: one batch per engine, keyed by the transport.
        Format::Vllm => events
            .chunk_by(|a, b| a.engine == b.engine)
            .map(|run| encode::to_vllm(run, 0))
            .collect(),
        Format::Proto | Format::Auto => vec![encode::to_proto(events)],
    }
}

pub fn produce(args: ProduceArgs) -> anyhow::Result<()> {
    let mut fleet = Fleet::new(FleetConfig {
        engines: args.engines,
        adapters: args.adapters,
        tenants: args.tenants,
        models: args.models,
        block_size: args.block_size,
        seed: args.seed,
        ..FleetConfig::default()
    });
    let mut out: Option<Box<dyn Write>> = match &args.out {
        None => None,
        Some(p) if p.as_os_str() == "-" => {
            Some(Box::new(std::io::BufWriter::new(std::io::stdout().lock())))
        }
        Some(p) => Some(Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        ))),
    };
    let (mut payload_count, mut bytes) = (0u64, 0u64);
    let start = std::time::Instant::now();
    for _ in 0..args.requests {
        let events = fleet.next_request();
        if events.is_empty() {
            continue;
        }
        for p in payloads(&events, args.format) {
            payload_count += 1;
            bytes += p.len() as u64;
            if let Some(w) = out.as_mut() {
                if args.format == Format::Json {
                    w.write_all(&p)?;
                    w.write_all(b"\n")?;
                } else {
                    w.write_all(&(p.len() as u32).to_be_bytes())?;
                    w.write_all(&p)?;
                }
            }
        }
    }
    if let Some(mut w) = out {
        w.flush()?;
    }
    let stats = fleet.stats();
    eprintln!(
        "produced {} requests → {payload_count} payloads, {bytes} bytes in {:.2?}: {stats:?}",
        args.requests,
        start.elapsed()
    );
    Ok(())
}
