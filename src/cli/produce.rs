//! `kvindex produce`: a synthetic engine fleet ([`Fleet`]) writing its events in any encoding to
//! a file, to stdout, to a Kafka topic (`--kafka`) or to a NATS JetStream stream (`--nats`). It is
//! the load generator of the performance harness, so it is built for throughput:
//!
//! * the fleet simulation and the encoding run on their own thread, handing finished payloads
//!   to the sender over a bounded channel, so generating overlaps with sending;
//! * sends are pipelined: Kafka sends only enqueue (librdkafka batches and delivers in the
//!   background), JetStream publishes keep a window of acks in flight; everything is awaited
//!   once, at the end, before the summary is printed.
//!
//! Each payload holds one engine's events of one simulated request, so it can be keyed by its
//! engine: the Kafka message key and the last NATS subject token are the engine id (vLLM
//! payloads name no engine; the transport does). vLLM payloads also carry `model` and `tenant`
//! headers, which they do not name either.

use anyhow::Context;
use kvindex::config::{Config, Secret};
use kvindex::event::{Event, EventKind, Format, encode};
use kvindex::sim::{Fleet, FleetSettings, FleetStats};
use kvindex::source::{KafkaPublisher, NatsPublisher, labels, nats};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ProduceArgs {
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    #[arg(long, default_value_t = 2)]
    pub adapters: usize,
    #[arg(long, default_value_t = 1)]
    pub tenants: usize,
    #[arg(long, default_value_t = 1)]
    pub models: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Blocks each engine's cache holds; beyond that it evicts (so the index reaches a steady
    /// size).
    #[arg(long, default_value_t = FleetSettings::default().capacity_blocks)]
    pub capacity_blocks: usize,
    /// Simulated requests (0 = until Ctrl-C or `--seconds`). Ctrl-C stops early, still with a
    /// flush and the summary.
    #[arg(long, default_value_t = 10_000)]
    pub requests: u64,
    /// Stop after this many seconds (0 = no time limit).
    #[arg(long, default_value_t = 0)]
    pub seconds: u64,
    /// Cap on events per second (0 = as fast as possible).
    #[arg(long, default_value_t = 0, conflicts_with = "block_rate")]
    pub rate: u64,
    /// Cap on block events (blocks stored or removed) per second instead (0 = no cap): the
    /// unit of the performance targets.
    #[arg(long, default_value_t = 0)]
    pub block_rate: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Encoding: proto, json or vllm.
    #[arg(long, default_value = "proto")]
    pub format: Format,
    /// Where to write payloads (`-` = stdout). JSON payloads are one per line; protobuf and
    /// msgpack payloads are framed by a 4-byte big-endian length.
    #[arg(long, conflicts_with_all = ["kafka", "nats"])]
    pub out: Option<PathBuf>,
    /// Publish to Kafka: comma-separated bootstrap brokers. Messages are keyed by engine id.
    #[arg(long, value_name = "BROKERS", conflicts_with = "nats")]
    pub kafka: Option<String>,
    /// Kafka topic (with `--kafka`).
    #[arg(long, default_value = "kv-events")]
    pub topic: String,
    /// A librdkafka producer property (with `--kafka`), repeatable, e.g.
    /// `-X security.protocol=SASL_SSL`.
    #[arg(short = 'X', long = "kafka-property", value_name = "KEY=VALUE", value_parser = parse_property)]
    pub kafka_properties: Vec<(String, String)>,
    /// Publish to NATS JetStream at this URL. Subjects are `<subject-prefix>.<engine id>`.
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
    /// Subject prefix (with `--nats`).
    #[arg(long, default_value = "kv.events")]
    pub subject_prefix: String,
    /// JetStream stream (with `--nats`), created with subjects `<subject-prefix>.>` if missing.
    #[arg(long, default_value = "KV_EVENTS")]
    pub stream: String,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
}

/// TLS and credentials for `--nats`, as `[source.nats]` gives them to `serve` (the same rules:
/// at most one way to log in; secrets from the environment only, never from the command line).
#[derive(clap::Args, Debug)]
pub struct NatsAuthArgs {
    /// A NATS credentials file (`.creds`: a user JWT and its nkey seed).
    #[arg(long, value_name = "FILE", requires = "nats")]
    pub nats_creds: Option<PathBuf>,
    /// A file holding a user nkey seed (`SU…`).
    #[arg(long, value_name = "FILE", requires = "nats")]
    pub nats_nkey: Option<PathBuf>,
    /// User name; the password comes from `KVINDEX_SOURCE__NATS__PASSWORD`. (A server token,
    /// from `KVINDEX_SOURCE__NATS__TOKEN`, needs no flag.)
    #[arg(long, value_name = "USER", requires = "nats")]
    pub nats_user: Option<String>,
    /// PEM CA certificates that verify the server (added to the system roots).
    #[arg(long, value_name = "FILE", requires = "nats")]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate chain for mutual TLS, with `--nats-tls-key`.
    #[arg(long, value_name = "FILE", requires_all = ["nats", "nats_tls_key"])]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM private key of `--nats-tls-cert`.
    #[arg(long, value_name = "FILE", requires_all = ["nats", "nats_tls_cert"])]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse a connection that is not TLS.
    #[arg(long, requires = "nats")]
    pub nats_tls_required: bool,
}

impl NatsAuthArgs {
    /// The flags and the secrets in the environment, checked by the configuration's rules.
    fn auth(&self) -> anyhow::Result<nats::NatsAuth> {
        let mut config = Config::default();
        let n = &mut config.source.nats;
        n.credentials_file = self.nats_creds.clone().unwrap_or_default();
        n.nkey_seed_file = self.nats_nkey.clone().unwrap_or_default();
        n.user = self.nats_user.clone().unwrap_or_default();
        n.tls_ca = self.nats_tls_ca.clone().unwrap_or_default();
        n.tls_cert = self.nats_tls_cert.clone().unwrap_or_default();
        n.tls_key = self.nats_tls_key.clone().unwrap_or_default();
        n.tls_required = self.nats_tls_required;
        for (var, secret) in [
            ("KVINDEX_SOURCE__NATS__PASSWORD", &mut n.password),
            ("KVINDEX_SOURCE__NATS__TOKEN", &mut n.token),
        ] {
            if let Ok(value) = std::env::var(var) {
                *secret = Secret::new(value);
            }
        }
        config.validate().context("NATS credentials")?;
        Ok(nats::NatsAuth::from(&config.source.nats))
    }
}

fn parse_property(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got `{s}`")),
    }
}

/// One engine's events of one request, encoded.
struct Payload {
    /// The engine id: Kafka key, last NATS subject token.
    engine: String,
    /// `(model, tenant)` headers, for encodings whose payloads name neither (vLLM).
    headers: Option<(String, String)>,
    bytes: Vec<u8>,
    events: u64,
    block_events: u64,
}

/// What was produced, for the closing summary.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    payloads: u64,
    events: u64,
    block_events: u64,
    bytes: u64,
}

impl Totals {
    fn add(&mut self, p: &Payload) {
        self.payloads += 1;
        self.events += p.events;
        self.block_events += p.block_events;
        self.bytes += p.bytes.len() as u64;
    }
}

/// Whether `format` can express an event of this kind (vLLM has no heartbeat).
fn expressible(format: Format, kind: &EventKind) -> bool {
    format != Format::Vllm
        || matches!(
            kind,
            EventKind::Stored | EventKind::Removed | EventKind::AllCleared
        )
}

/// Splits one request's events into per-engine runs and encodes each run as one payload.
fn payloads(events: &[Event], format: Format) -> impl Iterator<Item = Payload> + '_ {
    events
        .chunk_by(|a, b| a.engine == b.engine)
        .filter_map(move |run| {
            let kept: Vec<&Event> = run
                .iter()
                .filter(|e| expressible(format, &e.kind))
                .collect();
            let first = kept.first()?;
            let bytes = match format {
                Format::Json => encode::to_json(run),
                Format::Vllm => encode::to_vllm(run, 0),
                Format::Proto | Format::Auto => encode::to_proto(run),
            };
            let headers = (format == Format::Vllm).then(|| {
                (
                    first.partition.model.clone(),
                    first.partition.tenant.clone(),
                )
            });
            Some(Payload {
                engine: first.engine.clone(),
                headers,
                bytes,
                events: kept.len() as u64,
                block_events: kept.iter().map(|e| e.block_ops() as u64).sum(),
            })
        })
}

/// What a rate cap counts.
#[derive(Clone, Copy, Debug)]
enum Rate {
    Unlimited,
    Events(u64),
    BlockEvents(u64),
}

impl Rate {
    fn of(args: &ProduceArgs) -> Rate {
        match (args.rate, args.block_rate) {
            (0, 0) => Rate::Unlimited,
            (0, b) => Rate::BlockEvents(b),
            (e, _) => Rate::Events(e),
        }
    }
}

/// Holds the generator back to its rate cap.
struct Pacer {
    rate: Rate,
    start: Instant,
    /// Units (events or block events) handed out so far.
    sent: u64,
}

impl Pacer {
    fn new(rate: Rate) -> Pacer {
        Pacer {
            rate,
            start: Instant::now(),
            sent: 0,
        }
    }

    /// Counts `p` and sleeps until it is due.
    fn pace(&mut self, p: &Payload) {
        let (units, per_sec) = match self.rate {
            Rate::Unlimited => return,
            Rate::Events(r) => (p.events, r),
            Rate::BlockEvents(r) => (p.block_events, r),
        };
        self.sent += units;
        let due = Duration::from_secs_f64(self.sent as f64 / per_sec as f64);
        let elapsed = self.start.elapsed();
        if due > elapsed + Duration::from_millis(1) {
            std::thread::sleep(due - elapsed);
        }
    }
}

/// When the generator stops.
struct Limits {
    requests: u64,
    deadline: Option<Instant>,
    stop: Arc<AtomicBool>,
}

impl Limits {
    fn done(&self, requests: u64) -> bool {
        (self.requests > 0 && requests >= self.requests)
            || self.deadline.is_some_and(|d| Instant::now() >= d)
            || self.stop.load(Ordering::Relaxed)
    }
}

/// Runs the fleet on its own thread, sending payloads down `tx` until a limit is hit or the
/// receiver is gone. Returns the fleet's statistics.
fn spawn_generator(
    mut fleet: Fleet,
    format: Format,
    rate: Rate,
    limits: Limits,
    tx: tokio::sync::mpsc::Sender<Payload>,
) -> std::thread::JoinHandle<FleetStats> {
    std::thread::spawn(move || {
        let mut pacer = Pacer::new(rate);
        let mut requests = 0u64;
        'run: while !limits.done(requests) {
            requests += 1;
            let events = fleet.next_request();
            for p in payloads(&events, format) {
                pacer.pace(&p);
                if tx.blocking_send(p).is_err() {
                    break 'run;
                }
            }
        }
        fleet.stats()
    })
}

/// Where payloads go.
enum Sink {
    Discard,
    Writer {
        w: Box<dyn Write + Send>,
        json: bool,
    },
    Kafka(KafkaPublisher),
    Nats {
        /// Boxed: the publisher is large, and there is one sink per run.
        publisher: Box<NatsPublisher>,
        prefix: String,
    },
}

impl Sink {
    async fn open(args: &ProduceArgs) -> anyhow::Result<Sink> {
        if let Some(brokers) = &args.kafka {
            return Self::kafka(brokers, args).await;
        }
        if let Some(url) = &args.nats {
            return Self::nats(url, args).await;
        }
        Ok(match &args.out {
            None => Sink::Discard,
            Some(p) if p.as_os_str() == "-" => Sink::Writer {
                w: Box::new(std::io::BufWriter::new(std::io::stdout())),
                json: args.format == Format::Json,
            },
            Some(p) => Sink::Writer {
                w: Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p)
                        .with_context(|| format!("creating {}", p.display()))?,
                )),
                json: args.format == Format::Json,
            },
        })
    }

    async fn kafka(brokers: &str, args: &ProduceArgs) -> anyhow::Result<Sink> {
        // Fail within 30 s (not librdkafka's 5 min) when the topic or broker is unusable.
        let mut properties = BTreeMap::from([("message.timeout.ms".into(), "30000".into())]);
        properties.extend(args.kafka_properties.iter().cloned());
        let publisher = KafkaPublisher::new(brokers, &args.topic, &properties)
            .with_context(|| format!("kafka producer for {brokers}"))?;
        tracing::info!(brokers, topic = %args.topic, "producing to kafka");
        Ok(Sink::Kafka(publisher))
    }

    async fn nats(url: &str, args: &ProduceArgs) -> anyhow::Result<Sink> {
        let publisher = NatsPublisher::connect_with(url, true, &args.nats_auth.auth()?).await?;
        let prefix = args.subject_prefix.trim_end_matches('.').to_string();
        publisher
            .ensure_stream(&args.stream, &[format!("{prefix}.>")])
            .await
            .with_context(|| format!("stream {}", args.stream))?;
        tracing::info!(url, stream = %args.stream, subjects = %format!("{prefix}.>"), "producing to nats jetstream");
        Ok(Sink::Nats {
            publisher: Box::new(publisher),
            prefix,
        })
    }

    async fn send(&mut self, p: Payload) -> anyhow::Result<()> {
        let labels = p
            .headers
            .as_ref()
            .map(|(model, tenant)| labels(model, tenant));
        let headers: &[(&str, &str)] = labels.as_ref().map_or(&[], |l| l.as_slice());
        match self {
            Sink::Discard => {}
            Sink::Writer { w, json: true } => {
                w.write_all(&p.bytes)?;
                w.write_all(b"\n")?;
            }
            Sink::Writer { w, json: false } => {
                w.write_all(&(p.bytes.len() as u32).to_be_bytes())?;
                w.write_all(&p.bytes)?;
            }
            Sink::Kafka(publisher) => {
                // Deliveries fail late (after `message.timeout.ms`): stop at the first one
                // instead of generating into a broker that is not taking anything.
                if publisher.failed() > 0 {
                    anyhow::bail!("kafka: {} messages were not delivered", publisher.failed());
                }
                publisher.send(Some(&p.engine), headers, &p.bytes).await?
            }
            Sink::Nats { publisher, prefix } => {
                let subject = nats::wire::subject_for(prefix, &p.engine);
                publisher.send(&subject, headers, p.bytes).await?;
            }
        }
        Ok(())
    }

    /// Waits until everything sent is delivered (acknowledged by the broker / written).
    async fn finish(&mut self) -> anyhow::Result<()> {
        match self {
            Sink::Discard => {}
            Sink::Writer { w, .. } => w.flush()?,
            Sink::Kafka(publisher) => publisher
                .flush(Duration::from_secs(60))
                .await
                .context("kafka delivery")?,
            Sink::Nats { publisher, .. } => publisher.flush().await.context("nats delivery")?,
        }
        Ok(())
    }
}

fn fleet_config(args: &ProduceArgs) -> FleetSettings {
    FleetSettings {
        engines: args.engines,
        adapters: args.adapters,
        tenants: args.tenants,
        models: args.models,
        block_size: args.block_size,
        capacity_blocks: args.capacity_blocks,
        seed: args.seed,
        ..FleetSettings::default()
    }
}

/// The first Ctrl-C sets `stop`, so the run ends with a flush and a summary; a second one
/// exits at once (without waiting for deliveries).
fn stop_on_signal(stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        stop.store(true, Ordering::Relaxed);
        eprintln!("stopping: flushing what was sent (Ctrl-C again to quit now)");
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(130);
        }
    })
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

fn print_summary(t: &Totals, elapsed: Duration, stats: &FleetStats) {
    eprintln!(
        "produced {} payloads, {} events, {} block events, {} bytes in {:.3} s: \
         {:.0} events/s, {:.0} block events/s, {:.0} payloads/s, {:.1} MB/s ({} requests, hit ratio {:.2})",
        t.payloads,
        t.events,
        t.block_events,
        t.bytes,
        elapsed.as_secs_f64(),
        per_sec(t.events, elapsed),
        per_sec(t.block_events, elapsed),
        per_sec(t.payloads, elapsed),
        per_sec(t.bytes, elapsed) / 1e6,
        stats.requests,
        stats.hit_ratio(),
    );
}

pub async fn produce(args: ProduceArgs) -> anyhow::Result<()> {
    let mut sink = Sink::open(&args).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let signals = stop_on_signal(stop.clone());
    let limits = Limits {
        requests: args.requests,
        deadline: (args.seconds > 0).then(|| Instant::now() + Duration::from_secs(args.seconds)),
        stop,
    };
    let start = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::channel(4096);
    let generator = spawn_generator(
        Fleet::new(fleet_config(&args)),
        args.format,
        Rate::of(&args),
        limits,
        tx,
    );
    let mut totals = Totals::default();
    let sent: anyhow::Result<()> = async {
        while let Some(p) = rx.recv().await {
            totals.add(&p);
            sink.send(p).await?;
        }
        sink.finish().await
    }
    .await;
    // A reader that went away (`--out - | head`) ends the run, like any pipe writer.
    let sent = sent.or_else(|e| if is_broken_pipe(&e) { Ok(()) } else { Err(e) });
    // Dropping the receiver unblocks a generator stopped by a failed send.
    drop(rx);
    signals.abort();
    let stats = generator
        .join()
        .map_err(|_| anyhow::anyhow!("the fleet generator panicked"))?;
    sent?;
    print_summary(&totals, start.elapsed(), &stats);
    Ok(())
}
