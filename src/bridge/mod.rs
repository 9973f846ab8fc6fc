//! The engine bridge: takes KV events straight from the engines' ZeroMQ publishers (vLLM,
//! SGLang, TensorRT-LLM's vLLM-compatible one) and publishes them into Kafka, NATS JetStream
//! or kvindex's embedded broker, so they reach the index through the durable log, the
//! checkpoints and the normal pipeline. It runs inside `kvindex serve` (publishing into the
//! service's own source) or as `kvindex bridge`, a sidecar.
//!
//! The rule it keeps: **the index may be incomplete after a loss it could not repair, but it
//! never names an engine for a block that engine dropped**, and every loss is counted. Gaps
//! are replayed from the engine's buffer; a loss the buffer no longer covers, an engine
//! restart, an engine gone too long, or a record the sink refused **fences** the engine:
//! `AllBlocksCleared` for it before anything newer, then (where a replay endpoint exists)
//! everything the engine still buffers.
//!
//! Files, one concern each:
//! - `frames` (from the wire crate): the ZeroMQ frames (live, replay request, both replay
//!   reply forms);
//! - `sequencer.rs`: the sequence rules per stream (forward, duplicate, gap, restart, probe);
//! - `link.rs`: one engine endpoint's thread (SUB socket, monitor, replays, fences);
//! - `replay.rs`: the bounded DEALER replay client;
//! - `output.rs`: what is published (`partition_by` engine or adapter) and the fence records;
//! - `sink.rs`: the Kafka / NATS writer and its delivery reports;
//! - `ledger.rs`: durable positions per stream, kept across restarts;
//! - `stats.rs`: the counters behind `/v1/stats`, `/v1/engines` and `kvindex_bridge_*`.

pub use kvindex_wire::frames;
pub mod ledger;
pub mod link;
pub mod output;
pub mod replay;
pub mod sequencer;
pub mod sink;
pub mod stats;

pub use ledger::{DurableOffsets, Ledger, LedgerError};
pub use output::{PartitionBy, adapter_key};
pub use sink::SinkSpec;
pub use stats::{BridgeStats, FenceReason, StreamReport};

use crate::config::{Config, ConfigError, SourceKind};
use crate::event::VllmSettings;
use crate::source::nats::NatsAuth;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

/// Records queued between the engine threads and the sink (each is one batch or fence).
const SINK_QUEUE: usize = 4096;

/// One configured engine (all its DP ranks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSettings {
    pub id: String,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub dp_size: u32,
    pub topic: String,
    pub model: String,
    pub tenant: String,
}

/// The runtime form of `[bridge]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeSettings {
    pub partition_by: PartitionBy,
    /// Fence an engine disconnected this long (`None`: never).
    pub gone_after: Option<Duration>,
    pub engines: Vec<EngineSettings>,
}

/// `[bridge]`; an engine without `model` takes `source.vllm.model`.
impl TryFrom<&Config> for BridgeSettings {
    type Error = ConfigError;

    fn try_from(config: &Config) -> Result<BridgeSettings, ConfigError> {
        let c = &config.bridge;
        let partition_by = PartitionBy::parse(&c.partition_by).ok_or_else(|| {
            ConfigError::invalid(
                "bridge.partition_by",
                format!(
                    "must be one of {}, got `{}`",
                    PartitionBy::NAMES.join(" | "),
                    c.partition_by
                ),
            )
        })?;
        Ok(BridgeSettings {
            partition_by,
            gone_after: (c.gone_after_s > 0).then(|| Duration::from_secs(c.gone_after_s)),
            engines: c
                .engines
                .iter()
                .map(|e| EngineSettings {
                    id: e.id.clone(),
                    endpoint: e.endpoint.clone(),
                    replay_endpoint: Some(e.replay_endpoint.clone()).filter(|r| !r.is_empty()),
                    dp_size: e.dp_size,
                    topic: e.topic.clone(),
                    model: if e.model.is_empty() {
                        config.source.vllm.model.clone()
                    } else {
                        e.model.clone()
                    },
                    tenant: e.tenant.clone(),
                })
                .collect(),
        })
    }
}

/// Whether the bridge binds `endpoint` (engines connect to it) rather than connecting: a
/// wildcard host, as in vLLM's own rule for its publisher.
pub fn binds(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    rest.starts_with('*') || rest.starts_with("0.0.0.0:") || rest.starts_with("[::]:")
}

/// `endpoint` for DP rank `rank`, as the engines offset it: `tcp://host:P` → port `P + rank`,
/// `ipc://path` / `inproc://name` → `_dp<rank>` appended. Rank 0 is the endpoint itself.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("`{endpoint}` has no port"))?;
        let port: u32 = port
            .parse()
            .map_err(|_| format!("`{endpoint}`: port `{port}` is not a number"))?;
        let shifted = port + rank;
        if shifted > 65_535 {
            return Err(format!(
                "`{endpoint}`: port {port} + rank {rank} exceeds 65535"
            ));
        }
        return Ok(format!("tcp://{host}:{shifted}"));
    }
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    Err(format!(
        "`{endpoint}`: expected tcp://, ipc:// or inproc://"
    ))
}

/// Checks every rank's endpoints the way the links will use them, naming the field at fault
/// (the rest of `[bridge]` is checked when the configuration is loaded).
pub fn validate(settings: &BridgeSettings) -> Result<(), ConfigError> {
    for (i, e) in settings.engines.iter().enumerate() {
        let field = |k: &str| format!("bridge.engines[{i}].{k}");
        for r in 0..e.dp_size {
            rank_endpoint(&e.endpoint, r)
                .map_err(|m| ConfigError::invalid(&field("endpoint"), m))?;
            if let Some(replay) = &e.replay_endpoint {
                rank_endpoint(replay, r)
                    .map_err(|m| ConfigError::invalid(&field("replay_endpoint"), m))?;
            }
        }
    }
    Ok(())
}

/// The sink for the source `config` names. `embedded`: the embedded broker's bootstrap
/// address when the source is the embedded broker (inside `serve` only).
pub fn sink_for(config: &Config, embedded: Option<String>) -> Result<SinkSpec, ConfigError> {
    let kafka = &config.source.kafka;
    match (config.source.kind, embedded) {
        (SourceKind::Embedded, Some(bootstrap)) => Ok(SinkSpec::Kafka {
            brokers: bootstrap,
            topic: kafka.topic.clone(),
            properties: Default::default(),
        }),
        (SourceKind::Embedded, None) => Err(ConfigError::invalid(
            "source.kind",
            "the embedded broker lives inside `kvindex serve`: run the bridge there (list \
             [[bridge.engines]] in serve's config) or set source.kind = kafka | nats",
        )),
        (SourceKind::Kafka, _) => Ok(SinkSpec::Kafka {
            brokers: kafka.brokers.clone(),
            topic: kafka.topic.clone(),
            properties: kafka.properties.clone(),
        }),
        (SourceKind::Nats, _) => {
            let nats = &config.source.nats;
            if !nats.jetstream {
                return Err(ConfigError::invalid(
                    "source.nats.jetstream",
                    "the bridge publishes to JetStream only (core NATS would lose what it cannot deliver)",
                ));
            }
            let first = nats
                .subjects
                .first()
                .map(String::as_str)
                .unwrap_or_default();
            let prefix = first
                .strip_suffix(".>")
                .or_else(|| first.strip_suffix(".*"))
                .filter(|p| !p.is_empty() && !p.contains(['*', '>']))
                .ok_or_else(|| {
                    ConfigError::invalid(
                        "source.nats.subjects",
                        format!(
                            "the bridge publishes to `<prefix>.<engine>`, so the first subject must \
                             end in `.>` or `.*`, got `{first}`"
                        ),
                    )
                })?;
            Ok(SinkSpec::Nats {
                url: nats.url.clone(),
                stream: nats.stream.clone(),
                subjects: nats.subjects.clone(),
                prefix: prefix.to_string(),
                auth: Box::new(NatsAuth::from(nats)),
            })
        }
    }
}

/// Why the bridge could not start.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("engine `{engine}` rank {rank} ({endpoint}): {source}")]
    Socket {
        engine: String,
        rank: u32,
        endpoint: String,
        source: zmq::Error,
    },
}

/// A running bridge: one thread per engine rank, the sink task, the ledger keeper.
pub struct Bridge {
    stop: Arc<AtomicBool>,
    links: Vec<std::thread::JoinHandle<()>>,
    sink: Option<tokio::task::JoinHandle<()>>,
    keeper: Option<tokio::task::JoinHandle<()>>,
    stats: BridgeStats,
    ledger: Arc<Ledger>,
}

/// Where the bridge keeps its positions inside a data dir.
pub fn ledger_path(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("bridge").join("positions.json")
}

impl Bridge {
    /// Starts the bridge on the current tokio runtime. `ledger`: where positions are kept
    /// (`None`: in memory); `durable_offsets`: set when the sink is the embedded broker.
    pub fn start(
        settings: &BridgeSettings,
        sink: SinkSpec,
        vllm: &VllmSettings,
        ledger: Option<PathBuf>,
        durable_offsets: Option<DurableOffsets>,
    ) -> Result<Bridge, BridgeError> {
        validate(settings)?;
        let ledger = Arc::new(Ledger::open(ledger, durable_offsets)?);
        let stats = BridgeStats::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::mpsc::channel(SINK_QUEUE);
        let shared = link::Shared {
            zmq: zmq::Context::new(),
            ledger: ledger.clone(),
            stats: stats.clone(),
            sink: tx,
            stop: stop.clone(),
        };
        let sink_ledger = ledger.clone();
        let sink = tokio::spawn(async move {
            if let Err(e) = sink::run(sink, sink_ledger, rx).await {
                tracing::error!(error = %e, "bridge: the sink stopped");
            }
        });
        let keeper_ledger = ledger.clone();
        let keeper_stop = stop.clone();
        let keeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let mut last_flush = std::time::Instant::now();
            loop {
                tick.tick().await;
                keeper_ledger.advance();
                if last_flush.elapsed() >= ledger::FLUSH_EVERY || keeper_stop.load(Relaxed) {
                    last_flush = std::time::Instant::now();
                    if let Err(e) = keeper_ledger.flush() {
                        tracing::error!(error = %e, "bridge: writing positions failed");
                    }
                }
                if keeper_stop.load(Relaxed) && keeper_ledger.pending() == 0 {
                    break;
                }
            }
        });
        let mut bridge = Bridge {
            stop,
            links: Vec::new(),
            sink: Some(sink),
            keeper: Some(keeper),
            stats,
            ledger,
        };
        for engine in &settings.engines {
            for rank in 0..engine.dp_size {
                let endpoint = rank_endpoint(&engine.endpoint, rank)
                    .map_err(|m| ConfigError::invalid("bridge.engines.endpoint", m))?;
                let replay_endpoint =
                    match &engine.replay_endpoint {
                        Some(r) => Some(rank_endpoint(r, rank).map_err(|m| {
                            ConfigError::invalid("bridge.engines.replay_endpoint", m)
                        })?),
                        None => None,
                    };
                let spec = link::LinkSpec {
                    labels: output::StreamLabels {
                        engine: engine.id.clone(),
                        dp_rank: rank,
                        model: engine.model.clone(),
                        tenant: engine.tenant.clone(),
                        vllm: vllm.clone(),
                    },
                    bind: binds(&endpoint),
                    endpoint: endpoint.clone(),
                    replay_endpoint,
                    topic: engine.topic.clone(),
                    partition_by: settings.partition_by,
                    gone_after: settings.gone_after,
                };
                let shared = shared.clone();
                let (ready_tx, ready_rx) = std::sync::mpsc::channel();
                let name = format!("bridge-{}-{rank}", engine.id);
                let handle = std::thread::Builder::new()
                    .name(name.chars().take(15).collect())
                    .spawn(move || {
                        let engine = spec.labels.engine.clone();
                        if let Err(e) = link::run(spec, shared, ready_tx) {
                            tracing::error!(engine = %engine, rank, error = %e, "bridge: link stopped");
                        }
                    })
                    .expect("spawning a bridge thread");
                bridge.links.push(handle);
                // A socket that cannot bind or connect at all fails the start (an engine not
                // up yet is fine: libzmq connects when it comes).
                if let Ok(Err(source)) = ready_rx.recv() {
                    bridge.stop_blocking();
                    return Err(BridgeError::Socket {
                        engine: engine.id.clone(),
                        rank,
                        endpoint,
                        source,
                    });
                }
            }
        }
        Ok(bridge)
    }

    pub fn stats(&self) -> BridgeStats {
        self.stats.clone()
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    fn stop_blocking(&mut self) {
        self.stop.store(true, Relaxed);
        for l in self.links.drain(..) {
            let _ = l.join();
        }
    }

    /// Stops the links, lets the sink deliver what they handed it, and writes the positions.
    pub async fn stop(mut self) {
        self.stop.store(true, Relaxed);
        let links: Vec<_> = self.links.drain(..).collect();
        let _ = tokio::task::spawn_blocking(move || {
            for l in links {
                let _ = l.join();
            }
        })
        .await;
        if let Some(sink) = self.sink.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), sink).await;
        }
        if let Some(keeper) = self.keeper.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), keeper).await;
        }
        self.ledger.advance();
        if let Err(e) = self.ledger.flush() {
            tracing::error!(error = %e, "bridge: writing positions at stop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ports_and_bind_form() {
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 0).unwrap(),
            "tcp://10.0.0.5:5557"
        );
        assert_eq!(
            rank_endpoint("tcp://10.0.0.5:5557", 3).unwrap(),
            "tcp://10.0.0.5:5560"
        );
        assert_eq!(
            rank_endpoint("tcp://[::1]:5557", 1).unwrap(),
            "tcp://[::1]:5558"
        );
        assert_eq!(
            rank_endpoint("ipc:///tmp/kv", 2).unwrap(),
            "ipc:///tmp/kv_dp2"
        );
        assert!(rank_endpoint("tcp://host", 1).is_err());
        assert!(rank_endpoint("tcp://host:65535", 1).is_err());
        assert!(binds("tcp://*:5557"));
        assert!(binds("tcp://0.0.0.0:5557"));
        assert!(!binds("tcp://10.0.0.5:5557"));
    }
}
