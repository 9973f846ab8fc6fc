//! `kvindex serve` and `kvindex demo`: wiring the index, the apply pipeline and the HTTP API
//! into one running service.

use anyhow::Context;
use kvindex::api::{self, AppState};
use kvindex::config::{Config, Overrides};
use kvindex::index::{Index, QueryBlocks};
use kvindex::metrics::Metrics;
use kvindex::pipeline::Pipeline;
use kvindex::produce::{Fleet, FleetConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// TOML config file (see kvindex.example.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Directory for durable state (overrides `data_dir`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// HTTP listen address (overrides `http.listen`).
    #[arg(long)]
    pub listen: Option<String>,
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

/// The running pieces shared by `serve` and `demo`.
struct Service {
    config: Config,
    index: Arc<Index>,
    metrics: Arc<Metrics>,
    pipeline: Arc<Pipeline>,
    ready: Arc<AtomicBool>,
}

fn load_config(args: &ServeArgs) -> anyhow::Result<Config> {
    let overrides = Overrides {
        data_dir: args.data_dir.clone(),
        listen: args.listen.clone(),
        ..Overrides::default()
    };
    Config::load(args.config.as_deref(), std::env::vars(), &overrides)
        .context("invalid configuration")
}

fn start(config: Config) -> Service {
    let index = Arc::new(Index::new(config.index_config()));
    let metrics = Arc::new(Metrics::new());
    let pipeline = Arc::new(Pipeline::start(index.clone(), metrics.clone()));
    Service {
        config,
        index,
        metrics,
        pipeline,
        ready: Arc::new(AtomicBool::new(false)),
    }
}

async fn run_http(
    service: &Service,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listen = &service.config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding http.listen {listen}"))?;
    let addr = listener.local_addr()?;
    let mut state = AppState::new(service.index.clone(), service.metrics.clone());
    state.ready = service.ready.clone();
    state.default_block_size = service.config.index.default_block_size;
    state.max_body_bytes = service.config.http.max_body_bytes;
    tracing::info!(%addr, shards = service.index.shard_count(), "kvindex listening");
    println!("kvindex listening on http://{addr}");
    api::serve(listener, state, shutdown)
        .await
        .context("http server")
}

async fn shutdown_signal() {
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

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    let service = start(config);
    // Sources arrive with the sources work; until then the index is ready as soon as it is up.
    service.ready.store(true, Ordering::Relaxed);
    run_http(&service, shutdown_signal()).await
}

pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let config = load_config(&args.serve)?;
    let service = start(config);
    service.ready.store(true, Ordering::Relaxed);
    let fleet_cfg = FleetConfig {
        engines: args.engines,
        adapters: args.adapters,
        seed: args.seed,
        ..FleetConfig::default()
    };
    let mut fleet = Fleet::new(fleet_cfg);
    // Warm the index so the first curl already finds prefixes.
    for _ in 0..2_000 {
        service.pipeline.submit(fleet.next_request());
    }
    service.pipeline.flush();
    // Show a query whose answer is interesting: engines holding prefixes of different lengths.
    let block_size = FleetConfig::default().block_size;
    let (partition, tokens) = (0..64)
        .map(|_| fleet.sample_query())
        .max_by_key(|(partition, tokens)| {
            let blocks = QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size,
            };
            let (_, rows) = service.index.lookup(partition, &blocks);
            let distinct: std::collections::BTreeSet<u32> =
                rows.iter().map(|r| r.matched_blocks).collect();
            (distinct.len(), rows.len())
        })
        .unwrap_or_default();
    let listen = service.config.http.listen.clone();
    let query = serde_json::json!({
        "model": partition.model, "tenant": partition.tenant, "adapter": partition.adapter,
        "token_ids": tokens,
    });
    // The query is thousands of tokens: write it to a file for `curl -d @file`.
    let data_dir = &service.config.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating data_dir {}", data_dir.display()))?;
    let query_file = data_dir.join("demo-query.json");
    std::fs::write(&query_file, serde_json::to_vec_pretty(&query)?)
        .with_context(|| format!("writing {}", query_file.display()))?;
    println!(
        "\nkvindex demo: {} engines, {} adapters, {} requests/s of simulated traffic",
        args.engines, args.adapters, args.rate
    );
    println!("Try:");
    println!(
        "  curl -s http://{listen}/v1/lookup -d @{}",
        query_file.display()
    );
    println!("  curl -s http://{listen}/v1/stats");
    println!("  curl -s http://{listen}/v1/engines");
    println!("  curl -s http://{listen}/metrics\n");

    let pipeline = service.pipeline.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = stop.clone();
        let rate = args.rate.max(1);
        std::thread::spawn(move || {
            let tick = Duration::from_millis(100);
            let per_tick = rate.div_ceil(10);
            while !stop.load(Ordering::Relaxed) {
                let mut batch = Vec::new();
                for _ in 0..per_tick {
                    batch.extend(fleet.next_request());
                }
                pipeline.submit(batch);
                std::thread::sleep(tick);
            }
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
    let result = run_http(&service, shutdown).await;
    stop.store(true, Ordering::Relaxed);
    let _ = producer.join();
    result
}
