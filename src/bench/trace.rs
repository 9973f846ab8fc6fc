//! `kvindex bench replay`: replays a recorded KV-cache op stream (the workloads' JSONL format)
//! through the real [`Index`], checks every lookup against the trace's reference answer, and
//! measures throughput and latency.
//!
//! The file is loaded and turned into ordinary [`Event`]s before the clock starts. A `store`
//! becomes a chain event whose block keys come from `parent` + each block's `content` digest,
//! exactly as token-derived keys come from tokens; a `remove` is a removal by the worker's own
//! (`seq`) hashes, resolved through the engine-hash map; a `find` is a lookup by content digests.

use crate::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, engine_id};
use crate::index::{Index, IndexSettings, RawMatch};
use serde::Deserialize;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Why a trace could not be loaded or replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("line {line}: {source}")]
    Parse {
        line: usize,
        source: serde_json::Error,
    },
    #[error(
        "line {line}: lookup answer differs from the trace's reference:\n  expected {expected:?}\n  got      {got:?}"
    )]
    Mismatch {
        line: usize,
        expected: Vec<(String, u32)>,
        got: Vec<(String, u32)>,
    },
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Line {
    Store {
        worker: u64,
        #[serde(default)]
        dp_rank: u32,
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Remove {
        worker: u64,
        #[serde(default)]
        dp_rank: u32,
        hashes: Vec<u64>,
    },
    Clear {
        worker: u64,
        #[serde(default)]
        dp_rank: u32,
    },
    Find {
        hashes: Vec<u64>,
        expect: Vec<(u64, u32)>,
    },
}

/// One replayable operation.
#[derive(Clone, Debug)]
pub enum Op {
    Apply(Arc<Event>),
    Find(Arc<Find>),
}

/// A lookup and its reference answer.
#[derive(Debug)]
pub struct Find {
    /// 1-based line number in the trace.
    pub line: usize,
    pub digests: Vec<u64>,
    /// (engine id, matched blocks), sorted by engine id.
    pub expect: Vec<(String, u32)>,
}

/// A loaded trace.
pub struct Trace {
    pub ops: Vec<Op>,
    /// Query + stored + removed blocks: the numerator of block ops/s.
    pub block_ops: u64,
    pub finds: usize,
}

/// The partition every trace op lives in (the trace names no tenant, model or adapter).
pub fn trace_partition() -> PartitionKey {
    PartitionKey::new("", "trace", "")
}

/// Loads a plain or gzip-compressed JSONL trace (`limit` = max lines).
pub fn load(path: &Path, limit: Option<usize>) -> Result<Trace, ReplayError> {
    let io = |source| ReplayError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut magic = [0u8; 2];
    let n = file.read(&mut magic).map_err(io)?;
    let file = std::fs::File::open(path).map_err(io)?;
    let reader: Box<dyn Read> = if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    parse(BufReader::with_capacity(1 << 20, reader), limit).map_err(|e| match e {
        ReplayError::Io { source, .. } => io(source),
        other => other,
    })
}

/// Parses JSONL trace lines from `reader`.
pub fn parse(reader: impl BufRead, limit: Option<usize>) -> Result<Trace, ReplayError> {
    let partition = trace_partition();
    let mut trace = Trace {
        ops: Vec::new(),
        block_ops: 0,
        finds: 0,
    };
    for (i, line) in reader.lines().enumerate() {
        if limit.is_some_and(|l| i >= l) {
            break;
        }
        let line_no = i + 1;
        let text = line.map_err(|source| ReplayError::Io {
            path: String::new(),
            source,
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(&text).map_err(|source| ReplayError::Parse {
            line: line_no,
            source,
        })?;
        let op = match parsed {
            Line::Store {
                worker,
                dp_rank,
                parent,
                blocks,
            } => {
                let mut ev = Event::new(
                    EventKind::Stored,
                    engine_id(&worker.to_string(), dp_rank),
                    partition.clone(),
                );
                ev.parent_hash = parent.map(EngineHash);
                ev.block_hashes = blocks.iter().map(|&(_, seq)| EngineHash(seq)).collect();
                ev.content =
                    BlockContent::Digests(blocks.iter().map(|&(content, _)| content).collect());
                trace.block_ops += blocks.len() as u64;
                Op::Apply(Arc::new(ev))
            }
            Line::Remove {
                worker,
                dp_rank,
                hashes,
            } => {
                let mut ev = Event::new(
                    EventKind::Removed,
                    engine_id(&worker.to_string(), dp_rank),
                    partition.clone(),
                );
                ev.block_hashes = hashes.into_iter().map(EngineHash).collect();
                trace.block_ops += ev.block_hashes.len() as u64;
                Op::Apply(Arc::new(ev))
            }
            Line::Clear { worker, dp_rank } => Op::Apply(Arc::new(Event::new(
                EventKind::AllCleared,
                engine_id(&worker.to_string(), dp_rank),
                partition.clone(),
            ))),
            Line::Find { hashes, expect } => {
                trace.block_ops += hashes.len() as u64;
                trace.finds += 1;
                let mut expect: Vec<(String, u32)> = expect
                    .into_iter()
                    .map(|(w, m)| (w.to_string(), m))
                    .collect();
                expect.sort();
                Op::Find(Arc::new(Find {
                    line: line_no,
                    digests: hashes,
                    expect,
                }))
            }
        };
        trace.ops.push(op);
    }
    Ok(trace)
}

/// Figures of one replay.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub elapsed: Duration,
    pub block_ops_per_sec: f64,
    pub lookups_per_sec: f64,
    /// Lookup latencies, sorted ascending.
    pub latencies: Vec<Duration>,
    pub memberships: u64,
    pub l1_bytes: usize,
    pub skipped: u64,
    /// Time spent in stores, removes (and clears), finds: where the closed loop goes (one
    /// shard, and only when asked for: zero otherwise).
    pub split: [Duration; 3],
}

impl RunReport {
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)]
    }
    pub fn bytes_per_membership(&self) -> f64 {
        self.l1_bytes as f64 / self.memberships.max(1) as f64
    }
}

fn check(find: &Find, mut got: Vec<(String, u32)>) -> Result<(), ReplayError> {
    got.sort();
    if got != find.expect {
        return Err(ReplayError::Mismatch {
            line: find.line,
            expected: find.expect.clone(),
            got,
        });
    }
    Ok(())
}

/// Replays `trace` on a fresh index of `shards` shards, checking every find. With `split`, a
/// single shard's replay also times every applied event, for [`RunReport::split`]: two clock
/// reads per event, about 2% of the replay, so throughput runs leave it off (finds are timed
/// either way, for their latencies).
pub fn run(trace: &Trace, shards: usize, seed: u64, split: bool) -> Result<RunReport, ReplayError> {
    let index = Arc::new(Index::new(IndexSettings { shards, seed }));
    let partition = trace_partition();
    // Query keys depend only on the query, not on index state: computed inside the timed loop
    // all the same, as the service computes them per request.
    let (elapsed, latencies, skipped, split) = if index.shard_count() == 1 {
        run_inline(trace, &index, &partition, split)?
    } else {
        run_sharded(trace, &index, &partition)?
    };
    let stats = index.stats();
    let mut latencies = latencies;
    latencies.sort_unstable();
    let secs = elapsed.as_secs_f64().max(1e-9);
    Ok(RunReport {
        elapsed,
        block_ops_per_sec: trace.block_ops as f64 / secs,
        lookups_per_sec: trace.finds as f64 / secs,
        latencies,
        memberships: stats.memberships,
        l1_bytes: stats.l1_bytes,
        skipped,
        split,
    })
}

type Timed = (Duration, Vec<Duration>, u64, [Duration; 3]);

/// One thread, closed loop: every op is applied (or answered) before the next starts.
fn run_inline(
    trace: &Trace,
    index: &Index,
    partition: &PartitionKey,
    split_events: bool,
) -> Result<Timed, ReplayError> {
    let mut latencies = Vec::with_capacity(trace.finds);
    let mut skipped = 0;
    let mut keys = Vec::new();
    let mut rows: Vec<RawMatch> = Vec::new();
    let mut results = Vec::with_capacity(trace.finds);
    let mut split = [Duration::ZERO; 3];
    let start = Instant::now();
    {
        let mut shard = index.shard(0).write();
        for op in &trace.ops {
            match op {
                Op::Apply(ev) if split_events => {
                    let t = Instant::now();
                    skipped += shard.apply(ev, 0).is_err() as u64;
                    split[(ev.kind != EventKind::Stored) as usize] += t.elapsed();
                }
                Op::Apply(ev) => skipped += shard.apply(ev, 0).is_err() as u64,
                Op::Find(find) => {
                    let t = Instant::now();
                    keys.clear();
                    crate::index::hash::chain_keys(
                        shard.partition_seed(partition),
                        find.digests.iter().copied(),
                        &mut keys,
                    );
                    rows.clear();
                    shard.lookup(&keys, &mut rows);
                    let took = t.elapsed();
                    latencies.push(took);
                    if split_events {
                        split[2] += took;
                    }
                    results.push((
                        find.clone(),
                        rows.iter()
                            .map(|m| (m.engine, m.matched))
                            .collect::<Vec<_>>(),
                    ));
                }
            }
        }
    }
    let elapsed = start.elapsed();
    let shard = index.shard(0).read();
    for (find, got) in results {
        check(
            &find,
            got.into_iter()
                .map(|(e, m)| (shard.engine_name(e).to_string(), m))
                .collect(),
        )?;
    }
    Ok((elapsed, latencies, skipped, split))
}

/// One shard's answer to find `.0`: its engines' rows, and how long it took.
type FindPart = (usize, Vec<(String, u32)>, Duration);

/// Per-shard work, in trace order.
enum Work {
    Apply(Arc<Event>),
    Find(usize, Arc<Find>),
}

/// One worker thread per shard, fed in trace order. Events go to their own shard; a find goes
/// to every shard, each answering for its own engines at that point of the stream, and the
/// parts are merged afterwards. No shard ever waits for another.
fn run_sharded(
    trace: &Trace,
    index: &Arc<Index>,
    partition: &PartitionKey,
) -> Result<Timed, ReplayError> {
    const BATCH: usize = 512;
    let n = index.shard_count();
    let (done_tx, done_rx) = mpsc::channel();
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for s in 0..n {
        let (tx, rx) = mpsc::sync_channel::<Vec<Work>>(64);
        senders.push(tx);
        let (index, done_tx, partition) = (index.clone(), done_tx.clone(), partition.clone());
        handles.push(std::thread::spawn(move || {
            let mut parts: Vec<FindPart> = Vec::new();
            let mut skipped = 0u64;
            let mut keys = Vec::new();
            let mut rows = Vec::new();
            let mut shard = index.shard(s).write();
            let seed = shard.partition_seed(&partition);
            while let Ok(batch) = rx.recv() {
                for work in batch {
                    match work {
                        Work::Apply(ev) => skipped += shard.apply(&ev, 0).is_err() as u64,
                        Work::Find(i, find) => {
                            let t = Instant::now();
                            keys.clear();
                            crate::index::hash::chain_keys(
                                seed,
                                find.digests.iter().copied(),
                                &mut keys,
                            );
                            rows.clear();
                            shard.lookup(&keys, &mut rows);
                            let elapsed = t.elapsed();
                            let named = rows
                                .iter()
                                .map(|m| (shard.engine_name(m.engine).to_string(), m.matched))
                                .collect();
                            parts.push((i, named, elapsed));
                        }
                    }
                }
            }
            let _ = done_tx.send((parts, skipped, Instant::now()));
        }));
    }
    drop(done_tx);
    let start = Instant::now();
    let mut batches: Vec<Vec<Work>> = (0..n).map(|_| Vec::with_capacity(BATCH)).collect();
    let mut finds = Vec::with_capacity(trace.finds);
    for op in &trace.ops {
        match op {
            Op::Apply(ev) => {
                let s = crate::index::shard_of(&ev.partition, &ev.engine, n);
                batches[s].push(Work::Apply(ev.clone()));
                if batches[s].len() == BATCH {
                    let full = std::mem::replace(&mut batches[s], Vec::with_capacity(BATCH));
                    let _ = senders[s].send(full);
                }
            }
            Op::Find(find) => {
                let i = finds.len();
                finds.push(find.clone());
                for (s, batch) in batches.iter_mut().enumerate() {
                    batch.push(Work::Find(i, find.clone()));
                    if batch.len() == BATCH {
                        let _ =
                            senders[s].send(std::mem::replace(batch, Vec::with_capacity(BATCH)));
                    }
                }
            }
        }
    }
    for (tx, batch) in senders.iter().zip(batches) {
        let _ = tx.send(batch);
    }
    drop(senders);
    let mut merged: Vec<Vec<(String, u32)>> = vec![Vec::new(); finds.len()];
    let mut latency: Vec<Duration> = vec![Duration::ZERO; finds.len()];
    let mut skipped = 0;
    let mut end = start;
    for (parts, s, finished) in done_rx {
        skipped += s;
        end = end.max(finished);
        for (i, rows, t) in parts {
            merged[i].extend(rows);
            latency[i] = latency[i].max(t);
        }
    }
    for h in handles {
        let _ = h.join();
    }
    let elapsed = end - start;
    for (find, got) in finds.iter().zip(merged) {
        check(find, got)?;
    }
    Ok((elapsed, latency, skipped, [Duration::ZERO; 3]))
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
