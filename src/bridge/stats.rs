//! What the bridge counts, per publisher stream (engine and DP rank): atomics the stream's
//! thread and the sink write, read by `/v1/stats`, `/v1/engines` and `/metrics`. Every drop,
//! gap, replay, truncation, fence and restart is counted here; nothing is lost silently.

use parking_lot::RwLock;
use serde::Serialize;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};

/// Why a stream was fenced (its engine's blocks cleared before anything newer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceReason {
    /// No durable position for this stream: the index may hold anything for it.
    FirstContact,
    /// A gap the engine's replay buffer no longer covered.
    Truncated,
    /// A gap that could not be replayed (no replay endpoint, replay failed or in cooldown).
    Unrepaired,
    /// The publisher restarted (seq went back, or a probe found another publisher life).
    Restarted,
    /// The engine was disconnected longer than `bridge.gone_after_s`.
    Gone,
    /// The sink refused a record of this stream.
    DeliveryFailed,
    /// The connection came back and the publisher could not be verified as the same one
    /// (no replay endpoint, or the probe replay failed).
    Unverified,
}

impl FenceReason {
    pub const ALL: [FenceReason; 7] = [
        FenceReason::FirstContact,
        FenceReason::Truncated,
        FenceReason::Unrepaired,
        FenceReason::Restarted,
        FenceReason::Gone,
        FenceReason::DeliveryFailed,
        FenceReason::Unverified,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FenceReason::FirstContact => "first_contact",
            FenceReason::Truncated => "truncated",
            FenceReason::Unrepaired => "unrepaired",
            FenceReason::Restarted => "restarted",
            FenceReason::Gone => "gone",
            FenceReason::DeliveryFailed => "delivery_failed",
            FenceReason::Unverified => "unverified",
        }
    }
}

/// How a replay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Every batch asked for came back.
    Ok,
    /// The buffer started above the seq asked for: batches were lost.
    Truncated,
    /// No answer in time, or a malformed one.
    Failed,
}

/// One stream's counters.
#[derive(Default)]
pub struct StreamStats {
    pub connected: AtomicBool,
    /// Last seq forwarded (-1: none).
    pub last_seq: AtomicI64,
    pub epoch: AtomicU64,
    /// Last seq the sink holds durably (-1: none in this epoch).
    pub durable_seq: AtomicI64,
    pub batches_forwarded: AtomicU64,
    pub events_forwarded: AtomicU64,
    pub duplicates: AtomicU64,
    pub gaps: AtomicU64,
    pub replays_ok: AtomicU64,
    pub replays_truncated: AtomicU64,
    pub replays_failed: AtomicU64,
    pub restarts: AtomicU64,
    /// Messages that were not a well-formed batch (wrong frames), skipped.
    pub malformed: AtomicU64,
    /// Records handed to the sink and not yet durable.
    pub pending: AtomicI64,
    /// Wall-clock time of the last batch forwarded, µs since the epoch (0: never).
    pub last_event_us: AtomicI64,
    fences: [AtomicU64; FenceReason::ALL.len()],
}

impl StreamStats {
    fn new() -> StreamStats {
        let s = StreamStats::default();
        s.last_seq.store(-1, Relaxed);
        s.durable_seq.store(-1, Relaxed);
        s
    }

    pub fn count_fence(&self, reason: FenceReason) {
        self.fences[reason as usize].fetch_add(1, Relaxed);
    }

    pub fn fences(&self, reason: FenceReason) -> u64 {
        self.fences[reason as usize].load(Relaxed)
    }

    pub fn count_replay(&self, outcome: ReplayOutcome) {
        match outcome {
            ReplayOutcome::Ok => &self.replays_ok,
            ReplayOutcome::Truncated => &self.replays_truncated,
            ReplayOutcome::Failed => &self.replays_failed,
        }
        .fetch_add(1, Relaxed);
    }
}

/// A stream's identity and counters.
pub struct StreamEntry {
    /// The engine id as the bridge keys it (a DP rank's suffix is added by the consumer).
    pub engine: String,
    pub dp_rank: u32,
    /// The topic of a stream on a bound socket (empty otherwise).
    pub topic: String,
    pub stats: StreamStats,
}

/// Every stream the bridge runs; cheap to clone.
#[derive(Clone, Default)]
pub struct BridgeStats {
    streams: Arc<RwLock<Vec<Arc<StreamEntry>>>>,
}

/// One stream as `/v1/stats` and `/v1/engines` show it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct StreamReport {
    pub engine: String,
    pub dp_rank: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub topic: String,
    pub connected: bool,
    pub epoch: u64,
    pub last_seq: Option<u64>,
    pub durable_seq: Option<u64>,
    pub batches_forwarded: u64,
    pub events_forwarded: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub replays: ReplayCounts,
    pub fences: std::collections::BTreeMap<&'static str, u64>,
    pub restarts: u64,
    pub malformed: u64,
    pub pending: u64,
    /// Wall-clock time of the last batch forwarded, µs since the unix epoch.
    pub last_event_us: Option<i64>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ReplayCounts {
    pub ok: u64,
    pub truncated: u64,
    pub failed: u64,
}

fn opt_seq(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

impl BridgeStats {
    /// Registers a stream (the same identity twice returns the first registration).
    pub fn register(&self, engine: &str, dp_rank: u32, topic: &str) -> Arc<StreamEntry> {
        let mut streams = self.streams.write();
        if let Some(s) = streams
            .iter()
            .find(|s| s.engine == engine && s.dp_rank == dp_rank && s.topic == topic)
        {
            return s.clone();
        }
        let entry = Arc::new(StreamEntry {
            engine: engine.to_string(),
            dp_rank,
            topic: topic.to_string(),
            stats: StreamStats::new(),
        });
        streams.push(entry.clone());
        entry
    }

    pub fn streams(&self) -> Vec<Arc<StreamEntry>> {
        self.streams.read().clone()
    }

    /// Every stream's report, in registration order.
    pub fn report(&self) -> Vec<StreamReport> {
        self.streams()
            .iter()
            .map(|s| {
                let st = &s.stats;
                let last_us = st.last_event_us.load(Relaxed);
                StreamReport {
                    engine: s.engine.clone(),
                    dp_rank: s.dp_rank,
                    topic: s.topic.clone(),
                    connected: st.connected.load(Relaxed),
                    epoch: st.epoch.load(Relaxed),
                    last_seq: opt_seq(st.last_seq.load(Relaxed)),
                    durable_seq: opt_seq(st.durable_seq.load(Relaxed)),
                    batches_forwarded: st.batches_forwarded.load(Relaxed),
                    events_forwarded: st.events_forwarded.load(Relaxed),
                    duplicates: st.duplicates.load(Relaxed),
                    gaps: st.gaps.load(Relaxed),
                    replays: ReplayCounts {
                        ok: st.replays_ok.load(Relaxed),
                        truncated: st.replays_truncated.load(Relaxed),
                        failed: st.replays_failed.load(Relaxed),
                    },
                    fences: FenceReason::ALL
                        .iter()
                        .map(|r| (r.as_str(), st.fences(*r)))
                        .collect(),
                    restarts: st.restarts.load(Relaxed),
                    malformed: st.malformed.load(Relaxed),
                    pending: u64::try_from(st.pending.load(Relaxed)).unwrap_or(0),
                    last_event_us: (last_us > 0).then_some(last_us),
                }
            })
            .collect()
    }

    /// The `kvindex_bridge_*` families in Prometheus text format (nothing without streams).
    pub fn render_prometheus(&self, out: &mut String) {
        let streams = self.streams();
        if streams.is_empty() {
            return;
        }
        let label = |s: &StreamEntry| {
            format!(
                "engine=\"{}\",dp_rank=\"{}\"{}",
                escape(&s.engine),
                s.dp_rank,
                if s.topic.is_empty() {
                    String::new()
                } else {
                    format!(",topic=\"{}\"", escape(&s.topic))
                }
            )
        };
        type Get = fn(&StreamStats) -> i64;
        let gauges: [(&str, &str, Get); 5] = [
            (
                "connected",
                "1 while the engine's publisher is connected",
                |s| i64::from(s.connected.load(Relaxed)),
            ),
            (
                "last_seq",
                "last sequence number forwarded (-1: none)",
                |s| s.last_seq.load(Relaxed),
            ),
            ("epoch", "fence epoch (bumped at each fence)", |s| {
                s.epoch.load(Relaxed) as i64
            }),
            (
                "pending",
                "records handed to the sink, not yet durable",
                |s| s.pending.load(Relaxed),
            ),
            (
                "last_event_timestamp_seconds",
                "wall-clock time of the last batch forwarded",
                |s| s.last_event_us.load(Relaxed) / 1_000_000,
            ),
        ];
        let counters: [(&str, &str, Get); 6] = [
            (
                "batches_forwarded_total",
                "batches forwarded to the sink",
                |s| s.batches_forwarded.load(Relaxed) as i64,
            ),
            (
                "events_forwarded_total",
                "events in the batches forwarded",
                |s| s.events_forwarded.load(Relaxed) as i64,
            ),
            (
                "duplicates_total",
                "batches dropped as already forwarded",
                |s| s.duplicates.load(Relaxed) as i64,
            ),
            ("gaps_total", "sequence gaps detected", |s| {
                s.gaps.load(Relaxed) as i64
            }),
            ("restarts_total", "publisher restarts detected", |s| {
                s.restarts.load(Relaxed) as i64
            }),
            (
                "malformed_total",
                "messages that were not a well-formed batch",
                |s| s.malformed.load(Relaxed) as i64,
            ),
        ];
        let families = gauges
            .iter()
            .map(|g| (g, "gauge"))
            .chain(counters.iter().map(|c| (c, "counter")));
        for ((name, help, get), kind) in families {
            let _ = writeln!(out, "# HELP kvindex_bridge_{name} {help}");
            let _ = writeln!(out, "# TYPE kvindex_bridge_{name} {kind}");
            for s in &streams {
                let _ = writeln!(
                    out,
                    "kvindex_bridge_{name}{{{}}} {}",
                    label(s),
                    get(&s.stats)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP kvindex_bridge_replays_total replays by outcome"
        );
        let _ = writeln!(out, "# TYPE kvindex_bridge_replays_total counter");
        for s in &streams {
            let st = &s.stats;
            for (result, v) in [
                ("ok", &st.replays_ok),
                ("truncated", &st.replays_truncated),
                ("failed", &st.replays_failed),
            ] {
                let _ = writeln!(
                    out,
                    "kvindex_bridge_replays_total{{{},result=\"{result}\"}} {}",
                    label(s),
                    v.load(Relaxed)
                );
            }
        }
        let _ = writeln!(out, "# HELP kvindex_bridge_fences_total fences by reason");
        let _ = writeln!(out, "# TYPE kvindex_bridge_fences_total counter");
        for s in &streams {
            for r in FenceReason::ALL {
                let _ = writeln!(
                    out,
                    "kvindex_bridge_fences_total{{{},reason=\"{}\"}} {}",
                    label(s),
                    r.as_str(),
                    s.stats.fences(r)
                );
            }
        }
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
