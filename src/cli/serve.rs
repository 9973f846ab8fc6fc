//! `kvindex serve` and `kvindex demo`: the durable index, its source and the HTTP API in one
//! running service. The assembly lives in the library (`kvindex::service`); this file parses
//! flags, prints what a user needs, and handles shutdown.

use anyhow::Context;
use kvindex::api;
use kvindex::bridge::{self, Bridge, BridgeSettings, DurableOffsets};
use kvindex::config::{Config, SourceKind};
use kvindex::event::encode;
use kvindex::index::QueryBlocks;
use kvindex::ingest::{Ingest, SourceReport};
use kvindex::pipeline::{WarmUp, WarmUpFailed};
use kvindex::service::{Service, SourceSetup, StartSettings};
use kvindex::sim::{Fleet, FleetSettings};
use kvindex::source::{EmbeddedBroker, KafkaPublisher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: super::ConfigArgs,
    /// When a stored offset no longer fits the log (topic recreated, events deleted, stream
    /// purged), abandon it and restart the partition from `source.kafka.start` / the stream's
    /// first sequence, instead of stopping that partition with an error.
    #[arg(long)]
    pub reset_on_divergence: bool,
}

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Engines in the simulated fleet.
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// LoRA adapters served besides the base model.
    #[arg(long, default_value_t = 2)]
    pub adapters: usize,
    /// Simulated requests per second.
    #[arg(long, default_value_t = 200)]
    pub rate: u64,
    /// Stop after this many seconds (0 = run until Ctrl-C).
    #[arg(long, default_value_t = 0)]
    pub seconds: u64,
    /// Fleet seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn load_config(args: &ServeArgs) -> anyhow::Result<Config> {
    args.config.load()
}

/// The service with its source running, as `serve` and `demo` run it.
struct Running {
    service: Service,
    ingest: Option<Ingest>,
    report: Arc<SourceReport>,
    /// The engine bridge, when `[[bridge.engines]]` lists any (stopped before the source).
    bridge: Option<Bridge>,
    /// Kept alive as long as the source (dropped after it).
    embedded: Option<EmbeddedBroker>,
}

impl Running {
    fn start(mut config: Config, reset_on_divergence: bool) -> anyhow::Result<Running> {
        let opts = StartSettings {
            reset_on_divergence,
        };
        let replica = kvindex::cluster::resolve_replica_id(&mut config)
            .context("reading this data dir's replica id")?;
        tracing::info!(replica_id = %replica, "replica");
        let setup = SourceSetup::from_config(&config, &opts).context("starting the source")?;
        if let Some(b) = &setup.embedded {
            println!(
                "embedded Kafka broker on {} (topic `{}`, {} partitions). It keeps its log in \
                 memory: the log is lost on restart, the index is not.",
                b.bootstrap_servers(),
                b.topic(),
                b.partitions()
            );
        }
        let service = Service::open(config, setup.forget_on_start().as_deref())
            .context("opening the durable index")?;
        println!(
            "index opened from {} in {} ms: {} engines; their blocks load into memory in the \
             background, lookups are answered meanwhile",
            kvindex::service::store_dir(&service.config).display(),
            service.load_time.as_millis(),
            service.loaded.engines
        );
        let (ingest, report) = service
            .start_ingest(setup.spec.clone(), setup.bootstrap())
            .context("starting the ingest loop")?;
        let bridge = start_bridge(&service, &setup)?;
        Ok(Running {
            service,
            ingest: Some(ingest),
            report,
            bridge,
            embedded: setup.embedded,
        })
    }

    /// Stops the bridge (its records delivered), the source (which persists and
    /// acknowledges what was applied), then the broker; the shard workers make a last commit
    /// when the service is dropped.
    async fn stop(mut self) {
        if let Some(b) = self.bridge.take() {
            b.stop().await;
        }
        if let Some(i) = self.ingest.take() {
            i.stop();
        }
        drop(self.embedded.take());
    }
}

async fn run_http(
    running: &Running,
    tls: Option<Arc<api::tls::ServerConfig>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let service = &running.service;
    let listen = &service.config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding http.listen {listen}"))?;
    let addr = listener.local_addr()?;
    let mut state = api::AppState::over(service, Some(running.report.clone()))?;
    state.bridge = running.bridge.as_ref().map(Bridge::stats);
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(
        %addr,
        scheme,
        token = state.auth.has_token(),
        shards = service.index.shard_count(),
        "kvindex listening"
    );
    println!("kvindex listening on {scheme}://{addr}");
    if !state.auth.has_token() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "no API token configured: DELETE /v1/engines/{{id}} is refused to non-loopback \
             peers (set http.auth_token_file or KVINDEX_HTTP__AUTH_TOKEN)"
        );
    }
    match tls {
        Some(tls) => api::serve_tls(listener, tls, state, shutdown).await,
        None => api::serve(listener, state, shutdown).await,
    }
    .context("http server")
}

/// The TLS configuration, loaded before anything starts so that a bad file fails at once.
fn load_tls(config: &Config) -> anyhow::Result<Option<Arc<api::tls::ServerConfig>>> {
    Ok(api::tls::server_config(&config.http)?)
}

pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

/// Resolves when a shard's warm-up failed (never, once every shard is warm).
async fn warm_up_failure(warm_up: Arc<WarmUp>) -> WarmUpFailed {
    loop {
        if let Some(failure) = warm_up.failure() {
            return failure;
        }
        if warm_up.is_done() {
            return std::future::pending().await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    let tls = load_tls(&config)?;
    let running = Running::start(config, args.reset_on_divergence)?;
    // A shard whose rows cannot be read back cannot take events: stop, as a failed start.
    let failed = Arc::new(parking_lot::Mutex::new(None));
    let stop = {
        let (failed, warm_up) = (failed.clone(), running.service.pipeline.warm_up().clone());
        async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                f = warm_up_failure(warm_up) => *failed.lock() = Some(f),
            }
        }
    };
    let result = run_http(&running, tls, stop).await;
    running.stop().await;
    if let Some(failure) = failed.lock().take() {
        return Err(failure).context("loading the durable index");
    }
    result
}

/// Starts the bridge inside `serve` when the config lists engines: it publishes into the
/// service's own source, and for the embedded broker (whose log dies with the process) a
/// position is durable once the index has checkpointed past it.
fn start_bridge(service: &Service, setup: &SourceSetup) -> anyhow::Result<Option<Bridge>> {
    let config = &service.config;
    if config.bridge.engines.is_empty() {
        return Ok(None);
    }
    let embedded = setup
        .embedded
        .as_ref()
        .map(EmbeddedBroker::bootstrap_servers);
    let durable_offsets: Option<DurableOffsets> = setup.embedded.as_ref().map(|_| {
        let progress = service.pipeline.progress().clone();
        let source = setup.spec.name();
        let offsets: DurableOffsets = Arc::new(move |partition| {
            let id = progress.id(&source, partition);
            progress.get(id).durable_next()
        });
        offsets
    });
    let sink = bridge::sink_for(config, embedded).context("configuring the bridge")?;
    let settings = BridgeSettings::try_from(config).context("configuring the bridge")?;
    let started = Bridge::start(
        &settings,
        sink,
        &kvindex::event::DecodeSettings::from(&config.source).vllm,
        Some(bridge::ledger_path(&config.data_dir)),
        durable_offsets,
    )
    .context("starting the engine bridge")?;
    println!(
        "engine bridge: following {} engine(s) over ZeroMQ into the {} source",
        settings.engines.len(),
        setup.spec.kind()
    );
    Ok(Some(started))
}

/// Publishes one simulated request's events to the embedded broker, one protobuf payload per
/// engine, keyed by engine id.
async fn publish(
    publisher: &KafkaPublisher,
    events: &[kvindex::event::Event],
) -> anyhow::Result<usize> {
    let mut n = 0;
    for run in events.chunk_by(|a, b| a.engine == b.engine) {
        publisher
            .send(Some(&run[0].engine), &[], &encode::to_proto(run))
            .await?;
        n += run.len();
    }
    Ok(n)
}

/// Waits (up to `limit`) until the index has applied `events` events.
async fn wait_applied(running: &Running, events: u64, limit: Duration) {
    let until = Instant::now() + limit;
    while running.service.metrics.applied_total() < events && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let mut config = load_config(&args.serve)?;
    // The demo is the embedded default: a fleet producing into the in-process broker.
    config.source.kind = SourceKind::Embedded;
    let tls = load_tls(&config)?;
    let running = Running::start(config, false)?;
    let bootstrap = running
        .embedded
        .as_ref()
        .map(EmbeddedBroker::bootstrap_servers)
        .context("the demo needs the embedded broker")?;
    let publisher = KafkaPublisher::new(
        &bootstrap,
        &running.service.config.source.kafka.topic,
        &Default::default(),
    )?;
    let fleet_cfg = FleetSettings {
        engines: args.engines,
        adapters: args.adapters,
        seed: args.seed,
        ..FleetSettings::default()
    };
    let mut fleet = Fleet::new(fleet_cfg);
    // Warm the index through the broker so the first curl already finds prefixes.
    let already = running.service.metrics.applied_total();
    let mut produced = 0;
    for _ in 0..2_000 {
        produced += publish(&publisher, &fleet.next_request()).await?;
    }
    publisher.flush(Duration::from_secs(30)).await?;
    wait_applied(&running, already + produced as u64, Duration::from_secs(60)).await;

    // Show a query whose answer is interesting: engines holding prefixes of different lengths.
    let index = &running.service.index;
    let block_size = FleetSettings::default().block_size;
    let (partition, tokens) = (0..64)
        .map(|_| fleet.sample_query())
        .max_by_key(|(partition, tokens)| {
            let blocks = QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size,
                extras: Vec::new(),
            };
            let (_, rows) = index.lookup(partition, &blocks);
            let distinct: std::collections::BTreeSet<u32> =
                rows.iter().map(|r| r.matched_blocks).collect();
            (distinct.len(), rows.len())
        })
        .unwrap_or_default();
    let config = &running.service.config;
    let listen = config.http.listen.clone();
    let query = serde_json::json!({
        "model": partition.model, "tenant": partition.tenant, "adapter": partition.adapter,
        "token_ids": tokens,
    });
    // The query is thousands of tokens: write it to a file for `curl -d @file`.
    let data_dir = &config.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating data_dir {}", data_dir.display()))?;
    let query_file = data_dir.join("demo-query.json");
    std::fs::write(&query_file, serde_json::to_vec_pretty(&query)?)
        .with_context(|| format!("writing {}", query_file.display()))?;
    println!(
        "\nkvindex demo: {} engines, {} adapters, {} requests/s of simulated traffic, produced \
         to the embedded broker on {bootstrap}",
        args.engines, args.adapters, args.rate
    );
    println!("Try:");
    // With TLS the certificate may be self-signed (`-k`); with auth_reads every read needs the
    // token, which is never printed.
    let (base, insecure) = if config.http.tls() {
        (format!("https://{listen}"), " -k")
    } else {
        (format!("http://{listen}"), "")
    };
    let auth = if config.http.auth_reads {
        " -H \"Authorization: Bearer $KVINDEX_TOKEN\""
    } else {
        ""
    };
    let curl = format!("curl -s{insecure}{auth}");
    println!("  {curl} {base}/v1/lookup -d @{}", query_file.display());
    println!("  {curl} {base}/v1/stats");
    println!("  {curl} {base}/v1/engines");
    println!("  {curl} {base}/metrics\n");

    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let rate = args.rate.max(1);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let per_tick = rate.div_ceil(10);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_tick {
                    if let Err(e) = publish(&publisher, &fleet.next_request()).await {
                        tracing::warn!(error = %e, "demo fleet: publishing failed");
                    }
                }
            }
            let _ = publisher.flush(Duration::from_secs(5)).await;
        })
    };
    let seconds = args.seconds;
    let shutdown = async move {
        if seconds > 0 {
            tokio::select! { _ = shutdown_signal() => {}, _ = tokio::time::sleep(Duration::from_secs(seconds)) => {} }
        } else {
            shutdown_signal().await;
        }
    };
    let result = run_http(&running, tls, shutdown).await;
    stop.store(true, Ordering::Relaxed);
    let _ = producer.await;
    running.stop().await;
    result
}
