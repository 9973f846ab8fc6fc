//! What the service-level benches (`kvindex bench restart`, `kvindex bench http`) are run
//! against: [`build_once`], a durable index of a given size in a data dir, built through the
//! real pipeline (`Pipeline::ingest_batch`, commits of index rows + offsets to RocksDB), plus a
//! file of lookup queries that real traffic would send against it. Serving it and loading it
//! over HTTP is `kvindex::bench::harness`.

use anyhow::{Context, bail};
use kvindex::config::Config;
use kvindex::event::DecodeSettings;
use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, encode};
use kvindex::service::{Service, store_dir};
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::Message;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
        serde_json::to_writer(&mut out, &lookup_body(&p, &tokens))?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

/// The body of a token lookup of `tokens` in partition `p`.
pub fn lookup_body(p: &PartitionKey, tokens: &[u32]) -> serde_json::Value {
    serde_json::json!({
        "model": p.model, "tenant": p.tenant, "adapter": p.adapter, "token_ids": tokens,
    })
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
