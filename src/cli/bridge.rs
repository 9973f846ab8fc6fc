//! `kvindex bridge --config FILE`: the engine bridge as a sidecar. It subscribes to the
//! engines listed in `[[bridge.engines]]` and publishes into the source the same file
//! configures (`source.kind` kafka or nats), where any number of `kvindex serve` replicas
//! consume it. Its positions live in `data_dir`; `http.listen` serves `/healthz`,
//! `/metrics` and `/v1/stats`.

use anyhow::Context;
use kvindex::api::sidecar;
use kvindex::bridge::{self, Bridge, BridgeSettings};

#[derive(clap::Args, Debug)]
pub struct BridgeArgs {
    /// The file names `[[bridge.engines]]` and the `[source]` to publish into; `data_dir`
    /// holds the bridge's positions, `http.listen` its health, metrics and stats.
    #[command(flatten)]
    pub config: super::ConfigArgs,
}

pub async fn bridge(args: BridgeArgs) -> anyhow::Result<()> {
    let config = args.config.load()?;
    anyhow::ensure!(
        !config.bridge.engines.is_empty(),
        "bridge.engines: no engine configured (add [[bridge.engines]] entries)"
    );
    let sink = bridge::sink_for(&config, None).context("invalid configuration")?;
    let settings = BridgeSettings::try_from(&config).context("invalid configuration")?;
    let running = Bridge::start(
        &settings,
        sink,
        &kvindex::event::DecodeSettings::from(&config.source).vllm,
        Some(bridge::ledger_path(&config.data_dir)),
        None,
    )
    .context("starting the engine bridge")?;
    let listen = &config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding http.listen {listen}"))?;
    let addr = listener.local_addr()?;
    println!(
        "kvindex bridge: following {} engine(s) into {} `{}`; stats on http://{addr}",
        settings.engines.len(),
        config.source.kind.as_str(),
        match config.source.kind {
            kvindex::config::SourceKind::Nats => config.source.nats.stream.as_str(),
            _ => config.source.kafka.topic.as_str(),
        }
    );
    println!("{}{addr}", kvindex::bench::harness::LISTENING);
    let result = axum::serve(listener, sidecar::router(running.stats()))
        .with_graceful_shutdown(super::serve::shutdown_signal())
        .await
        .context("http server");
    running.stop().await;
    result
}
