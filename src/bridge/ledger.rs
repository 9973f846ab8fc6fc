//! Where each stream stands durably, across bridge restarts (`kill -9` included).
//!
//! Every batch the bridge forwards becomes a pending entry here; the sink reports each of its
//! records delivered (with the partition and offset it got) or failed. An entry is durable
//! when all its records are delivered and, for the embedded broker (whose log does not
//! survive a restart), when the index has checkpointed past their offsets. Durable entries
//! advance the stream's [`Position`], which is written to a small JSON file in the data dir
//! (atomically: temp file, fsync, rename) every [`FLUSH_EVERY`].
//!
//! Why a file of our own rather than reading the position back from the sink: the embedded
//! broker's log is gone after a restart, and reading the tail of every Kafka partition or
//! NATS subject for headers at start would cost more than it saves. The file may lag the sink
//! by one flush interval; the bridge then forwards a few batches twice after a crash, which is
//! harmless (stores and removals are set operations, so re-applying a suffix of an engine's
//! stream leaves the same state). It is never ahead of the sink, and a fence is written to it
//! before the fence is published, so a crash mid-fence fences again at the next start.

use super::sequencer::Position;
use super::stats::StreamEntry;
use crate::util::write_atomically;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

/// How often durable positions are written to the file.
pub const FLUSH_EVERY: Duration = Duration::from_millis(200);

/// The next offset the index has made durable on a partition of the embedded broker.
pub type DurableOffsets = Arc<dyn Fn(i32) -> Option<i64> + Send + Sync>;

/// A stream's identity in the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamKey {
    pub engine: String,
    pub dp_rank: u32,
    #[serde(default)]
    pub topic: String,
}

#[derive(Serialize, Deserialize)]
struct FileEntry {
    #[serde(flatten)]
    key: StreamKey,
    #[serde(flatten)]
    position: Position,
    /// Adapter partitions this stream has published to (where a fence must go).
    #[serde(default)]
    adapters: BTreeSet<String>,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    streams: Vec<FileEntry>,
}

/// A ledger error (the file could not be read or written).
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("bridge positions file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bridge positions file {path} is corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },
}

struct Pending {
    id: u64,
    epoch: u64,
    /// `None` for a fence record.
    seq: Option<u64>,
    digest: u64,
    expected: usize,
    parts: Vec<(i32, i64)>,
    failed: bool,
}

struct Stream {
    key: StreamKey,
    durable: Position,
    adapters: BTreeSet<String>,
    pending: VecDeque<Pending>,
    next_id: u64,
    entry: Arc<StreamEntry>,
    needs_fence: Arc<AtomicBool>,
}

/// Handle of a registered stream.
pub type StreamId = usize;

/// A pending entry's ticket: the sink passes it back with each record's fate.
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    pub stream: StreamId,
    pub id: u64,
}

/// Durable positions of every stream, and what is in flight.
pub struct Ledger {
    path: Option<PathBuf>,
    loaded: HashMap<StreamKey, (Position, BTreeSet<String>)>,
    streams: parking_lot::Mutex<Vec<Stream>>,
    durable_offsets: Option<DurableOffsets>,
    dirty: AtomicBool,
    /// Held while the file is written (the keeper and fencing threads both write it).
    writing: parking_lot::Mutex<()>,
}

impl Ledger {
    /// Opens the ledger kept at `path` (`None`: in memory only, for tests). `durable_offsets`:
    /// set for the embedded broker (durable = checkpointed by the index).
    pub fn open(
        path: Option<PathBuf>,
        durable_offsets: Option<DurableOffsets>,
    ) -> Result<Ledger, LedgerError> {
        let loaded = match &path {
            Some(p) => read_file(p)?,
            None => HashMap::new(),
        };
        Ok(Ledger {
            path,
            loaded,
            streams: parking_lot::Mutex::new(Vec::new()),
            durable_offsets,
            dirty: AtomicBool::new(false),
            writing: parking_lot::Mutex::new(()),
        })
    }

    /// Registers a stream; returns its id, its durable position (if any) and the adapters it
    /// published to.
    pub fn register(
        &self,
        key: StreamKey,
        entry: Arc<StreamEntry>,
        needs_fence: Arc<AtomicBool>,
    ) -> (StreamId, Option<Position>, BTreeSet<String>) {
        let (position, adapters) = match self.loaded.get(&key) {
            Some((p, a)) => (Some(p.clone()), a.clone()),
            None => (None, BTreeSet::new()),
        };
        if let Some(p) = &position {
            entry.stats.epoch.store(p.epoch, Relaxed);
            entry
                .stats
                .durable_seq
                .store(p.seq.map_or(-1, |s| s as i64), Relaxed);
        }
        let mut streams = self.streams.lock();
        streams.push(Stream {
            key,
            durable: position.clone().unwrap_or_default(),
            adapters: adapters.clone(),
            pending: VecDeque::new(),
            next_id: 0,
            entry,
            needs_fence,
        });
        (streams.len() - 1, position, adapters)
    }

    /// A fence of `stream` into `epoch` is about to be published: recorded durably first, so
    /// a crash before the fence reaches the sink fences again at the next start.
    pub fn begin_fence(&self, stream: StreamId, epoch: u64) -> Result<(), LedgerError> {
        {
            let mut streams = self.streams.lock();
            let s = &mut streams[stream];
            s.durable = Position {
                epoch,
                seq: None,
                digest: 0,
            };
            s.entry.stats.epoch.store(epoch, Relaxed);
            s.entry.stats.durable_seq.store(-1, Relaxed);
        }
        self.write()
    }

    /// Remembers that `stream` published to adapter partition `adapter`.
    pub fn note_adapter(&self, stream: StreamId, adapter: &str) {
        let mut streams = self.streams.lock();
        if streams[stream].adapters.insert(adapter.to_string()) {
            self.dirty.store(true, Relaxed);
        }
    }

    /// A batch (`seq`) or fence (`None`) of `records` records is handed to the sink.
    pub fn enqueue(
        &self,
        stream: StreamId,
        epoch: u64,
        seq: Option<u64>,
        digest: u64,
        records: usize,
    ) -> Ticket {
        let mut streams = self.streams.lock();
        let s = &mut streams[stream];
        let id = s.next_id;
        s.next_id += 1;
        s.pending.push_back(Pending {
            id,
            epoch,
            seq,
            digest,
            expected: records,
            parts: Vec::with_capacity(records),
            failed: false,
        });
        s.entry.stats.pending.fetch_add(1, Relaxed);
        Ticket { stream, id }
    }

    /// One record of `ticket` is durable in the sink at (`partition`, `offset`).
    pub fn delivered(&self, ticket: Ticket, partition: i32, offset: i64) {
        self.with_pending(ticket, |p| p.parts.push((partition, offset)));
    }

    /// One record of `ticket` could not be delivered: the stream must be fenced.
    pub fn failed(&self, ticket: Ticket) {
        self.with_pending(ticket, |p| p.failed = true);
    }

    fn with_pending(&self, ticket: Ticket, f: impl FnOnce(&mut Pending)) {
        let mut streams = self.streams.lock();
        let s = &mut streams[ticket.stream];
        let Some(front) = s.pending.front().map(|p| p.id) else {
            return;
        };
        let Some(index) = ticket.id.checked_sub(front) else {
            return;
        };
        if let Some(p) = s.pending.get_mut(index as usize) {
            f(p);
        }
    }

    /// Moves every stream's durable position past its entries that are now durable, and
    /// flags streams whose records failed. Returns whether anything changed.
    pub fn advance(&self) -> bool {
        let mut changed = false;
        // Each partition's durable offset, read once per call.
        let mut offsets: HashMap<i32, Option<i64>> = HashMap::new();
        let mut streams = self.streams.lock();
        for s in streams.iter_mut() {
            while let Some(p) = s.pending.front() {
                if p.failed {
                    s.needs_fence.store(true, Relaxed);
                } else if p.parts.len() < p.expected || !self.is_durable(&p.parts, &mut offsets) {
                    break;
                } else if p.epoch >= s.durable.epoch {
                    // A batch from before a fence (older epoch) never moves the position.
                    if let Some(seq) = p.seq {
                        s.durable = Position {
                            epoch: p.epoch,
                            seq: Some(seq),
                            digest: p.digest,
                        };
                        s.entry.stats.durable_seq.store(seq as i64, Relaxed);
                        changed = true;
                    }
                }
                s.pending.pop_front();
                s.entry.stats.pending.fetch_sub(1, Relaxed);
            }
        }
        if changed {
            self.dirty.store(true, Relaxed);
        }
        changed
    }

    fn is_durable(&self, parts: &[(i32, i64)], offsets: &mut HashMap<i32, Option<i64>>) -> bool {
        match &self.durable_offsets {
            None => true,
            Some(next) => parts.iter().all(|&(partition, offset)| {
                offsets
                    .entry(partition)
                    .or_insert_with(|| next(partition))
                    .is_some_and(|n| n > offset)
            }),
        }
    }

    /// Records handed to the sink and not yet durable, over all streams.
    pub fn pending(&self) -> usize {
        self.streams.lock().iter().map(|s| s.pending.len()).sum()
    }

    /// Writes the file if anything changed since the last write.
    pub fn flush(&self) -> Result<(), LedgerError> {
        if self.dirty.swap(false, Relaxed)
            && let Err(e) = self.write()
        {
            self.dirty.store(true, Relaxed);
            return Err(e);
        }
        Ok(())
    }

    fn write(&self) -> Result<(), LedgerError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let _writing = self.writing.lock();
        let file = {
            let streams = self.streams.lock();
            let mut entries: HashMap<&StreamKey, FileEntry> = HashMap::new();
            // Streams not running this time keep their stored position.
            for (key, (position, adapters)) in &self.loaded {
                entries.insert(
                    key,
                    FileEntry {
                        key: key.clone(),
                        position: position.clone(),
                        adapters: adapters.clone(),
                    },
                );
            }
            for s in streams.iter() {
                entries.insert(
                    &s.key,
                    FileEntry {
                        key: s.key.clone(),
                        position: s.durable.clone(),
                        adapters: s.adapters.clone(),
                    },
                );
            }
            let mut streams: Vec<FileEntry> = entries.into_values().collect();
            streams.sort_by(|a, b| {
                (&a.key.engine, a.key.dp_rank, &a.key.topic).cmp(&(
                    &b.key.engine,
                    b.key.dp_rank,
                    &b.key.topic,
                ))
            });
            serde_json::to_vec_pretty(&File {
                version: 1,
                streams,
            })
            .unwrap_or_default()
        };
        write_atomically(path, &file).map_err(|source| LedgerError::Io {
            path: path.clone(),
            source,
        })
    }
}

fn read_file(path: &Path) -> Result<HashMap<StreamKey, (Position, BTreeSet<String>)>, LedgerError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(source) => {
            return Err(LedgerError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let file: File = serde_json::from_slice(&bytes).map_err(|e| LedgerError::Corrupt {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    if file.version != 1 {
        return Err(LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("unknown version {}", file.version),
        });
    }
    Ok(file
        .streams
        .into_iter()
        .map(|e| (e.key, (e.position, e.adapters)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::stats::BridgeStats;

    fn key(engine: &str) -> StreamKey {
        StreamKey {
            engine: engine.into(),
            dp_rank: 0,
            topic: String::new(),
        }
    }

    #[test]
    fn positions_advance_in_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("positions.json");
        let stats = BridgeStats::default();
        let ledger = Ledger::open(Some(path.clone()), None).unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let (id, pos, _) = ledger.register(key("a"), stats.register("a", 0, ""), flag.clone());
        assert_eq!(pos, None);
        let t0 = ledger.enqueue(id, 0, Some(0), 10, 1);
        let t1 = ledger.enqueue(id, 0, Some(1), 11, 2);
        ledger.delivered(t1, 0, 5);
        ledger.delivered(t1, 1, 5);
        assert!(
            !ledger.advance(),
            "entry 0 is not delivered yet: nothing moves"
        );
        ledger.delivered(t0, 0, 4);
        assert!(ledger.advance());
        ledger.note_adapter(id, "sql");
        ledger.flush().unwrap();

        let reopened = Ledger::open(Some(path), None).unwrap();
        let (_, pos, adapters) = reopened.register(key("a"), stats.register("a", 0, ""), flag);
        assert_eq!(
            pos,
            Some(Position {
                epoch: 0,
                seq: Some(1),
                digest: 11
            })
        );
        assert!(adapters.contains("sql"));
    }

    #[test]
    fn a_fence_is_durable_before_it_is_sent_and_older_batches_never_move_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("positions.json");
        let stats = BridgeStats::default();
        let ledger = Ledger::open(Some(path.clone()), None).unwrap();
        let flag = Arc::new(AtomicBool::new(false));
        let (id, _, _) = ledger.register(key("a"), stats.register("a", 0, ""), flag.clone());
        let old = ledger.enqueue(id, 0, Some(7), 1, 1);
        ledger.begin_fence(id, 1).unwrap();
        let on_disk = Ledger::open(Some(path.clone()), None).unwrap();
        let (_, pos, _) = on_disk.register(key("a"), stats.register("a", 0, ""), flag.clone());
        assert_eq!(pos.map(|p| (p.epoch, p.seq)), Some((1, None)));
        ledger.delivered(old, 0, 1);
        ledger.advance();
        ledger.flush().unwrap();
        let on_disk = Ledger::open(Some(path), None).unwrap();
        let (_, pos, _) = on_disk.register(key("a"), stats.register("a", 0, ""), flag);
        assert_eq!(pos.map(|p| (p.epoch, p.seq)), Some((1, None)));
    }

    #[test]
    fn embedded_durability_waits_for_the_checkpoint_and_failures_ask_for_a_fence() {
        let checkpoint = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let seen = checkpoint.clone();
        let offsets: DurableOffsets = Arc::new(move |_| Some(seen.load(Relaxed)));
        let ledger = Ledger::open(None, Some(offsets)).unwrap();
        let stats = BridgeStats::default();
        let flag = Arc::new(AtomicBool::new(false));
        let (id, _, _) = ledger.register(key("a"), stats.register("a", 0, ""), flag.clone());
        let t = ledger.enqueue(id, 0, Some(3), 1, 1);
        ledger.delivered(t, 0, 41);
        assert!(!ledger.advance());
        checkpoint.store(42, Relaxed);
        assert!(ledger.advance());
        let t = ledger.enqueue(id, 0, Some(4), 1, 1);
        ledger.failed(t);
        ledger.advance();
        assert!(flag.load(Relaxed));
        assert_eq!(ledger.pending(), 0);
    }
}
