//! The `kvindex` binary: argument parsing and wiring only; the work lives in the library.

mod cli;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc: under `kvindex bench http` the server spent ~9% of its
/// CPU in glibc's malloc and free (each lookup allocates and frees buffers the size of its
/// body), and with mimalloc its CPU per lookup was ~0.86× (BENCHMARKS.md, paired runs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the index in its v3 `mimalloc.h`; the Rust bindings name
/// no constant for it, and a test below checks the index against the option's default). 0:
/// freed pages go back to the OS at once instead of up to a second later. With the default, a
/// 32 MiB-budget server under `kvindex bench http` sat ~35 MiB above glibc's RSS; with 0, ~18.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[derive(Parser, Debug)]
#[command(
    name = "kvindex",
    version,
    about = "Exact, durable, always-warm index of LLM KV-cache blocks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the service: sources → index → HTTP read API.
    Serve(cli::serve::ServeArgs),
    /// Run the service with a simulated engine fleet feeding it, and print curl commands to try.
    Demo(cli::serve::DemoArgs),
    /// Subscribe to engines' ZeroMQ KV-event publishers and publish into Kafka or NATS.
    Bridge(cli::bridge::BridgeArgs),
    /// Rebuild an index from a Kafka topic or NATS stream into an empty data dir.
    Replay(cli::rebuild::ReplayArgs),
    /// Generate synthetic engine-fleet events in any encoding, to a file or a broker.
    Produce(Box<cli::produce::ProduceArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Replay a recorded KV-cache op stream through the index and check every lookup.
    Replay(cli::bench::ReplayArgs),
    /// Time a restart to the first answered lookup for a durable index of a given size.
    Restart(cli::bench_restart::RestartArgs),
    /// Lookups per second over HTTP from an index far larger than its L1 budget.
    Http(cli::bench_http::HttpArgs),
    /// The engine bridge inside `serve`: throughput against producing straight into the
    /// broker, and publish-to-visible latency.
    Bridge(cli::bench_bridge::BridgeArgs),
    /// JetStream ingest: `kvindex serve` indexing a pre-filled stream durably, against a plain
    /// pull consumer draining the same stream.
    Ingest(cli::bench_ingest::IngestArgs),
    /// A long run of ingest and lookups at a share of the probed capacity: resident set,
    /// lag, latency per window and the logs.
    Soak(cli::bench_soak::SoakArgs),
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KVINDEX_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("KVINDEX_LOG_FORMAT").is_ok_and(|f| f == "json");
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> anyhow::Result<()> {
    // SAFETY: sets a plain integer option; no allocation is in flight on another thread yet.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    let cli = Cli::parse();
    init_tracing();
    match cli.command {
        Command::Serve(args) => runtime()?.block_on(cli::serve::serve(args)),
        Command::Demo(args) => runtime()?.block_on(cli::serve::demo(args)),
        Command::Bridge(args) => runtime()?.block_on(cli::bridge::bridge(args)),
        Command::Replay(args) => runtime()?.block_on(cli::rebuild::replay(args)),
        Command::Produce(args) => runtime()?.block_on(cli::produce::produce(*args)),
        Command::Bench(BenchCommand::Replay(args)) => cli::bench::replay(args),
        Command::Bench(BenchCommand::Restart(args)) => cli::bench_restart::restart(args),
        Command::Bench(BenchCommand::Http(args)) => cli::bench_http::http(args),
        Command::Bench(BenchCommand::Bridge(args)) => cli::bench_bridge::bridge(args),
        Command::Bench(BenchCommand::Ingest(args)) => cli::bench_ingest::ingest(args),
        Command::Bench(BenchCommand::Soak(args)) => cli::bench_soak::soak(args),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::MI_OPTION_PURGE_DELAY;

    #[test]
    fn the_purge_delay_option_index_names_mimallocs_purge_delay() {
        // purge_delay defaults to 1000 (ms) in mimalloc v3; no other option has that default.
        // A mimalloc upgrade that renumbers its options fails here, not silently in production.
        let value = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(value, 1000);
    }
}
