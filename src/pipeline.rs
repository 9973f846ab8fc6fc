//! The apply pipeline: routes decoded events to per-shard worker threads, which apply them in
//! source order under their shard's write lock, and counts what was applied or skipped.
//!
//! Workers are plain threads (index work is CPU-bound Rust on owned data, no `.await`); the
//! bounded queues give backpressure: a producer that outruns the index blocks in `submit`
//! instead of growing memory without bound. The `Pipeline` owns its workers and stops them
//! on drop.

use crate::event::{DecodeOptions, Decoded, Envelope, Event, EventKind, decode_payload};
use crate::index::{Index, SkipReason};
use crate::metrics::Metrics;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

/// Batches waiting per shard before `submit` blocks.
const QUEUE_BATCHES: usize = 64;

enum Msg {
    Events(Vec<Event>),
    /// Acknowledged once everything sent before it is applied.
    Barrier(Sender<()>),
}

/// Where a payload came from, for logs of what could not be decoded.
#[derive(Clone, Debug, Default)]
pub struct Position<'a> {
    pub source: &'a str,
    pub partition: i64,
    pub offset: i64,
}

/// Shard workers plus the router in front of them.
pub struct Pipeline {
    index: Arc<Index>,
    metrics: Arc<Metrics>,
    senders: Vec<SyncSender<Msg>>,
    workers: Vec<JoinHandle<()>>,
}

pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn kind_slot(kind: EventKind) -> Option<usize> {
    match kind {
        EventKind::Stored => Some(0),
        EventKind::Removed => Some(1),
        EventKind::AllCleared => Some(2),
        EventKind::ReplicaUpdated => Some(3),
        EventKind::Unknown(_) => None,
    }
}

impl Pipeline {
    /// Starts one worker thread per shard of `index`.
    pub fn start(index: Arc<Index>, metrics: Arc<Metrics>) -> Pipeline {
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        for shard in 0..index.shard_count() {
            let (tx, rx) = sync_channel(QUEUE_BATCHES);
            let (index, metrics) = (index.clone(), metrics.clone());
            let handle = std::thread::Builder::new()
                .name(format!("kvindex-shard-{shard}"))
                .spawn(move || run_worker(shard, rx, &index, &metrics))
                .expect("spawning a shard worker thread");
            senders.push(tx);
            workers.push(handle);
        }
        Pipeline {
            index,
            metrics,
            senders,
            workers,
        }
    }

    pub fn index(&self) -> &Arc<Index> {
        &self.index
    }

    /// Routes `events` (in source order) to their shards. Blocks while a shard's queue is full.
    pub fn submit(&self, events: Vec<Event>) {
        let mut batches: Vec<Vec<Event>> = vec![Vec::new(); self.senders.len()];
        for ev in events {
            if let EventKind::Unknown(t) = ev.kind {
                let reason = SkipReason::UnknownType(t);
                self.metrics.count_skipped(reason.reason());
                tracing::debug!(engine = %ev.engine, kind = t, "skipping event of unknown type");
                continue;
            }
            self.index.learn_block_size(&ev);
            batches[self.index.route(&ev)].push(ev);
        }
        for (tx, batch) in self.senders.iter().zip(batches) {
            if !batch.is_empty() {
                // A send fails only if the worker died, which it does only on shutdown.
                let _ = tx.send(Msg::Events(batch));
            }
        }
    }

    /// Decodes one payload and submits its events; bad input is counted and logged with its
    /// position, never fatal. Returns how many events were submitted.
    pub fn ingest(
        &self,
        payload: &[u8],
        env: &Envelope<'_>,
        opts: &DecodeOptions,
        pos: &Position<'_>,
    ) -> usize {
        match decode_payload(payload, env, opts) {
            Ok(Decoded { events, skipped }) => {
                for e in &skipped {
                    self.metrics.count_malformed(e.reason());
                    tracing::warn!(source = pos.source, partition = pos.partition, offset = pos.offset, error = %e, "event dropped");
                }
                let n = events.len();
                self.submit(events);
                n
            }
            Err(e) => {
                self.metrics.count_malformed(e.reason());
                tracing::warn!(source = pos.source, partition = pos.partition, offset = pos.offset, bytes = payload.len(), error = %e, "payload skipped");
                0
            }
        }
    }

    /// Waits until every event submitted before this call is applied.
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut pending = 0;
        for s in &self.senders {
            if s.send(Msg::Barrier(tx.clone())).is_ok() {
                pending += 1;
            }
        }
        drop(tx);
        for _ in 0..pending {
            if rx.recv().is_err() {
                break;
            }
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.senders.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn run_worker(shard: usize, rx: Receiver<Msg>, index: &Index, metrics: &Metrics) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Events(batch) => {
                let now = now_us();
                let mut guard = index.shard(shard).write();
                for ev in &batch {
                    match guard.apply(ev, now) {
                        Ok(ops) => {
                            if let Some(slot) = kind_slot(ev.kind) {
                                metrics.count_applied(slot, ops);
                            }
                        }
                        Err(reason) => {
                            metrics.count_skipped(reason.reason());
                            tracing::warn!(shard, engine = %ev.engine, model = %ev.partition.model, adapter = %ev.partition.adapter, reason = reason.reason(), error = %reason, "event not applied");
                        }
                    }
                }
            }
            Msg::Barrier(ack) => {
                let _ = ack.send(());
            }
        }
    }
}
