//! The running service, assembled from a [`Config`]: the durable store, the index warm-loaded
//! from it, the apply pipeline, and the source feeding it. `kvindex serve`, `demo` and
//! `replay` all start here; the HTTP API is put on top by the binary (`cli/serve.rs`).
//!
//! Start order matters for warm restarts:
//! 1. open RocksDB (`<data_dir>/index`), checking shard count and seed;
//! 2. with the embedded broker, forget its old offsets (its log is new on every start);
//! 3. restore every shard's partitions and engines and put the store behind it as L2, and
//!    restore each shard's offsets: lookups are answered from durable state at once (reading
//!    L2), however large the index and however long the topic's history;
//! 4. start the shard workers, which first load their shard's rows into L1 in the background
//!    (`pipeline/warm_up.rs`), then the source, which resumes from the stored offsets.

use crate::config::{Config, SourceKind};
use crate::event::DecodeSettings;
use crate::index::Index;
use crate::index::IndexSettings;
use crate::ingest::{Ingest, IngestContext, SourceReport};
use crate::metrics::Metrics;
use crate::pipeline::{CommitSettings, Liveness, Pipeline, Progress, Spill, WarmUpFailed};
use crate::source::{
    Checkpoints, EmbeddedBroker, KafkaSettings, NatsSettings, SourceError, SourceSpec, kafka,
};
use crate::spill::{Clock, SystemClock};
use crate::store::{LoadStats, ShardLoad, Store, StoreError, StoreSettings};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("source: {0}")]
    Source(#[from] SourceError),
    #[error("configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Options that come from the command line rather than the config file.
#[derive(Clone, Debug, Default)]
pub struct StartSettings {
    /// Abandon a diverged checkpoint and restart the partition from the configured start.
    pub reset_on_divergence: bool,
}

/// The durable index: store, index, pipeline. Dropping it stops the shard workers after a
/// last commit.
pub struct Service {
    pub config: Config,
    pub index: Arc<Index>,
    pub metrics: Arc<Metrics>,
    pub store: Arc<Store>,
    pub pipeline: Arc<Pipeline>,
    /// The bounded L1's write-back to the store.
    pub spill: Arc<Spill>,
    pub ready: Arc<AtomicBool>,
    /// What was restored before the service answers (partitions and engines; the rows follow
    /// in the background: [`Service::wait_warm`]), and how long opening took.
    pub loaded: LoadStats,
    pub load_time: Duration,
}

/// The store directory inside `data_dir`.
pub fn store_dir(config: &Config) -> PathBuf {
    config.data_dir.join("index")
}

/// Opens the store; `index.shards = 0` (auto) adopts the shard count the store was written
/// with, so a data dir moves between machines with different core counts.
fn open_store(config: &Config) -> Result<Store, ServiceError> {
    let dir = store_dir(config);
    std::fs::create_dir_all(&dir)
        .map_err(|e| std::io::Error::new(e.kind(), format!("creating {}: {e}", dir.display())))?;
    let mut opts = StoreSettings {
        shards: IndexSettings::from(&config.index).shards,
        seed: config.index.seed,
        sync: false,
    };
    let store = match Store::open(&dir, &opts) {
        Err(StoreError::ShardCountMismatch { stored, .. }) if config.index.shards == 0 => {
            opts.shards = stored as usize;
            Store::open(&dir, &opts)
        }
        other => other,
    };
    Ok(store?)
}

impl Service {
    /// Opens the store and loads the index from it (steps 1–3 above). `forget_source` names a
    /// source whose stored offsets are dropped first (the embedded broker's).
    pub fn open(config: Config, forget_source: Option<&str>) -> Result<Service, ServiceError> {
        Service::open_on(config, forget_source, Arc::new(SystemClock))
    }

    /// [`Service::open`] with the clock of the L2 circuit breaker and flush schedule given
    /// (tests skip through the breaker's pauses with a manual clock; `testing` builds only).
    #[cfg(any(test, feature = "testing"))]
    pub fn open_with_clock(
        config: Config,
        forget_source: Option<&str>,
        clock: Arc<dyn Clock>,
    ) -> Result<Service, ServiceError> {
        Service::open_on(config, forget_source, clock)
    }

    fn open_on(
        config: Config,
        forget_source: Option<&str>,
        clock: Arc<dyn Clock>,
    ) -> Result<Service, ServiceError> {
        let started = Instant::now();
        let store = Arc::new(open_store(&config)?);
        let store_open = started.elapsed();
        if let Some(source) = forget_source {
            let n = store.forget_source(source)?;
            if n > 0 {
                tracing::info!(
                    source,
                    rows = n,
                    "the embedded broker's log is new: its stored offsets are reset to the new log's start (the index is kept)"
                );
            }
        }
        let mut index_config = IndexSettings::from(&config.index);
        index_config.shards = store.shards() as usize;
        let index = Arc::new(Index::new(index_config));
        let spill = Arc::new(Spill::new(&config, index.clone(), store.clone(), clock));
        let (loads, loaded) = begin_load(&store, &index, &spill)?;
        for (tenant, model, size) in store.block_sizes()? {
            index.pin_block_size(&tenant, &model, size);
        }
        let progress = Arc::new(Progress::new(index.shard_count()));
        for shard in 0..store.shards() {
            for (source, partition, next) in store.shard_offsets(shard)? {
                progress.restore(shard as usize, &source, partition, next);
            }
        }
        let metrics = Arc::new(Metrics::new());
        let ready = Arc::new(AtomicBool::new(false));
        let pipeline = Arc::new(Pipeline::start(
            index.clone(),
            metrics.clone(),
            store.clone(),
            progress,
            CommitSettings {
                max_inflight_bytes: config.source.max_inflight_bytes,
                ..CommitSettings::from(&config.checkpoint)
            },
            &spill,
            Liveness {
                ttl: config.index.engine_ttl(),
                ready: ready.clone(),
            },
            loads,
        ));
        let load_time = started.elapsed();
        tracing::info!(
            dir = %store.path().display(),
            shards = index.shard_count(),
            engines = loaded.engines,
            partitions = loaded.partitions,
            open_ms = load_time.as_millis() as u64,
            rocksdb_open_ms = store_open.as_millis() as u64,
            "index opened from disk; its rows load into L1 in the background"
        );
        Ok(Service {
            config,
            index,
            metrics,
            store,
            pipeline,
            spill,
            ready,
            loaded,
            load_time,
        })
    }

    /// Blocks until every shard's rows are loaded (see `pipeline/warm_up.rs`); the totals
    /// of the whole load, or why a shard could not be loaded.
    pub fn wait_warm(&self) -> Result<LoadStats, WarmUpFailed> {
        self.pipeline.warm_up().wait()
    }

    /// Starts the ingest loop for `spec`, resuming from the store's offsets.
    pub fn start_ingest(
        &self,
        spec: SourceSpec,
        bootstrap: Option<String>,
    ) -> Result<(Ingest, Arc<SourceReport>), ServiceError> {
        self.start_ingest_from(spec, bootstrap, self.pipeline.clone())
    }

    /// Starts the ingest loop for `spec`, positioning partitions from `checkpoints`.
    pub fn start_ingest_from(
        &self,
        spec: SourceSpec,
        bootstrap: Option<String>,
        checkpoints: Arc<dyn Checkpoints>,
    ) -> Result<(Ingest, Arc<SourceReport>), ServiceError> {
        let report = Arc::new(SourceReport::new(
            &spec,
            bootstrap,
            self.pipeline.progress().clone(),
        ));
        let ingest = Ingest::start(
            spec,
            IngestContext {
                pipeline: self.pipeline.clone(),
                checkpoints,
                metrics: self.metrics.clone(),
                decode: DecodeSettings::from(&self.config.source),
                report: report.clone(),
                ready: self.ready.clone(),
            },
        )?;
        Ok((ingest, report))
    }
}

/// A clean stop: everything applied is committed and the memtables are flushed, so the next
/// start has no WAL to replay.
impl Drop for Service {
    fn drop(&mut self) {
        // Workers holding events back at L1's hard cap (L2 down) must take what is queued,
        // or the last persist below would wait for L2 to come back.
        self.pipeline.close();
        if !self.pipeline.persist() {
            tracing::warn!(
                "the last commit before shutdown failed; the next start resumes from the previous one"
            );
        }
        if let Err(e) = self.store.flush() {
            tracing::warn!(error = %e, "flushing the store at shutdown failed (the WAL still holds everything)");
        }
    }
}

/// Step 1 of every shard's load (partitions and engines; see `store/load.rs`), each shard put
/// behind the store as a spilled L1, so lookups read through to L2 until its worker has
/// loaded the rest (`pipeline/warm_up.rs`). Returns the loads to finish and their totals.
fn begin_load(
    store: &Store,
    index: &Index,
    spill: &Spill,
) -> Result<(Vec<ShardLoad>, LoadStats), StoreError> {
    let budget = spill.load_budget();
    let mut loads = Vec::with_capacity(index.shard_count());
    let mut total = LoadStats::default();
    for shard in 0..index.shard_count() {
        let mut guard = index.shard(shard).write();
        let load = store.begin_load(shard as u16, &mut guard, budget)?;
        spill.attach(&mut guard, shard, true);
        total.add(load.stats());
        loads.push(load);
    }
    Ok((loads, total))
}

/// The configured source: an embedded broker (started here; keep it alive as long as the
/// source) or an external Kafka / NATS.
pub struct SourceSetup {
    pub spec: SourceSpec,
    pub embedded: Option<EmbeddedBroker>,
}

impl SourceSetup {
    /// Builds the source of `config`, starting the embedded broker if that is the kind.
    /// The consumer names must be resolved ([`crate::cluster::resolve_replica_id`]).
    pub fn from_config(config: &Config, opts: &StartSettings) -> Result<SourceSetup, ServiceError> {
        if config.replica_id_unresolved() {
            return Err(ServiceError::Config(crate::config::ConfigError::invalid(
                "cluster.replica_id",
                "the consumer names still hold `{replica_id}`: resolve the replica id first",
            )));
        }
        Ok(match config.source.kind {
            SourceKind::Embedded => {
                let topic = &config.source.kafka.topic;
                let broker = EmbeddedBroker::start(topic, kafka::DEFAULT_PARTITIONS)?;
                let mut settings = KafkaSettings::try_from(&config.source.kafka)?;
                settings.brokers = broker.bootstrap_servers();
                settings.group_id = None;
                settings.partitions = Some((0..broker.partitions()).collect());
                settings.log_is_ephemeral = true;
                settings.reset_on_divergence = opts.reset_on_divergence;
                // The mock does not wake a waiting fetch when data arrives (see
                // `kafka::embedded`): keep each wait short, unless the config says otherwise.
                settings
                    .properties
                    .entry("fetch.wait.max.ms".into())
                    .or_insert_with(|| kafka::EMBEDDED_FETCH_WAIT_MS.to_string());
                SourceSetup {
                    spec: SourceSpec::Kafka {
                        settings,
                        embedded: true,
                    },
                    embedded: Some(broker),
                }
            }
            SourceKind::Kafka => {
                let mut settings = KafkaSettings::try_from(&config.source.kafka)?;
                settings.reset_on_divergence = opts.reset_on_divergence;
                SourceSetup {
                    spec: SourceSpec::Kafka {
                        settings,
                        embedded: false,
                    },
                    embedded: None,
                }
            }
            SourceKind::Nats => {
                let mut settings = NatsSettings::from(&config.source.nats);
                settings.owner = config.cluster.replica_id.clone();
                settings.reset_on_divergence = opts.reset_on_divergence;
                SourceSetup {
                    spec: SourceSpec::Nats(settings),
                    embedded: None,
                }
            }
        })
    }

    /// The source whose stored offsets are meaningless at this start: the embedded broker's
    /// (a new log every start) and core NATS's (a local counter restarting at 1).
    pub fn forget_on_start(&self) -> Option<String> {
        let core_nats = matches!(&self.spec, SourceSpec::Nats(s) if !s.jetstream);
        (self.embedded.is_some() || core_nats).then(|| self.spec.name())
    }

    pub fn bootstrap(&self) -> Option<String> {
        match &self.spec {
            SourceSpec::Kafka { settings, .. } => Some(settings.brokers.clone()),
            SourceSpec::Nats(_) => None,
        }
    }
}
