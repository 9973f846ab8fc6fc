//! The one validated [`Config`]: defaults < TOML file < `KVINDEX_*` environment < CLI flags.
//!
//! # One code path for file and environment
//!
//! The defaults are serialized into a `toml::Table`; the file's table and then every
//! `KVINDEX_<SECTION>__<KEY>` variable are merged into it, and the merged tree is deserialized
//! once. The default tree doubles as the schema: a key it lacks is unknown (an error naming the
//! dotted key, or the variable), and each value is checked against the type of the default it
//! replaces, so type errors name their field too (serde's own messages do not say which field
//! failed). Only the two free-form maps, `source.kafka.properties` and
//! `source.vllm.lora_names`, accept keys the defaults do not have. CLI flags ([`Overrides`])
//! are applied to the typed value last, then [`Config::validate`] checks the cross-field rules.
//!
//! Environment values are read as TOML scalars (`4`, `0.7`, `true`, `"quoted"`), falling back
//! to the raw string; string keys always take the raw text, list keys (`source.nats.subjects`)
//! take a TOML array or a comma-separated list. For the free-form maps the variable names the
//! entry: `KVINDEX_SOURCE__KAFKA__PROPERTIES__SECURITY_PROTOCOL=SASL_SSL` sets the librdkafka
//! property `security.protocol` (lowercased, `_` → `.`: librdkafka names use dots only), and
//! `KVINDEX_SOURCE__VLLM__LORA_NAMES__3=sql-lora` maps lora id 3.
//!
//! Secrets are environment-only ([`ENV_ONLY`]): `http.auth_token` (`KVINDEX_HTTP__AUTH_TOKEN`),
//! the API's bearer token, and `source.nats.password` / `source.nats.token` are refused in a
//! file (which would end up in version control); a file can name a file holding a secret
//! instead (`http.auth_token_file`, `source.nats.credentials_file`, `nkey_seed_file`). Each is
//! a [`Secret`]: never printed.
//!
//! # Files and conventions
//! Here: the sections (`*Config`, one per file section) and their defaults; `load.rs`: the
//! merge; `validate.rs`: the rules. Each component turns its section into its runtime
//! `*Settings` beside itself (`impl From<&IndexConfig> for IndexSettings` in `index`, …); the
//! decoder's is here, because the event contract depends on nothing.
//!
//! A crate of its own, depending on the wire crate only, so the loader can be fuzzed (the
//! `config` target in `fuzz/`) without building the service's storage and broker clients.

mod load;
mod secret;
mod time;
mod validate;

pub use load::ENV_ONLY;
pub use secret::{REDACTED, Secret};
pub use time::parse_rfc3339_us;

use kvindex_wire::event::{self, DecodeSettings, Format, VllmSettings};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// Prefix of every configuration environment variable.
pub const ENV_PREFIX: &str = "KVINDEX_";

/// `KVINDEX_*` variables that are not configuration keys (read elsewhere by the binary) and
/// that [`Config::load`] therefore ignores instead of rejecting.
pub const NON_CONFIG_ENV: &[&str] = &[
    "KVINDEX_CONFIG",
    "KVINDEX_LOG",
    "KVINDEX_LOG_FORMAT",
    "KVINDEX_CRASH_AT",
];

/// Why a configuration could not be loaded. Every message starts with the field (dotted key)
/// or environment variable at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read config file: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: invalid TOML: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("{key}: unknown configuration key (in {origin})")]
    UnknownKey { key: String, origin: String },
    #[error("{var}: unknown kvindex environment variable (there is no configuration key `{key}`)")]
    UnknownEnv { var: String, key: String },
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
}

impl ConfigError {
    /// The dotted key (or environment variable) the error is about, if it is about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } | ConfigError::Parse { .. } => None,
            ConfigError::UnknownKey { key, .. } => Some(key),
            ConfigError::UnknownEnv { var, .. } => Some(var),
            ConfigError::Invalid { field, .. } => Some(field),
        }
    }

    /// An error about `field` (a dotted key); components use it for their own checks.
    pub fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            field: field.to_string(),
            reason: reason.into(),
        }
    }
}

/// Where events come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// The in-process Kafka-protocol broker (librdkafka's mock cluster): for demos and
    /// single-node development; its log does not survive a restart.
    #[default]
    Embedded,
    Kafka,
    Nats,
}

impl SourceKind {
    pub const NAMES: [&'static str; 3] = ["embedded", "kafka", "nats"];

    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Embedded => "embedded",
            SourceKind::Kafka => "kafka",
            SourceKind::Nats => "nats",
        }
    }
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SourceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<SourceKind, String> {
        match s.to_ascii_lowercase().as_str() {
            "embedded" => Ok(SourceKind::Embedded),
            "kafka" => Ok(SourceKind::Kafka),
            "nats" => Ok(SourceKind::Nats),
            _ => Err(format!(
                "unknown source kind `{s}` (expected embedded, kafka or nats)"
            )),
        }
    }
}

/// Where a Kafka consumer group starts when no checkpoint exists (`source.kafka.start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartPosition {
    Earliest,
    Latest,
    /// The first message at or after this time (unix microseconds).
    TimeUs(i64),
}

impl StartPosition {
    /// Parses `earliest`, `latest` or an RFC 3339 time.
    pub fn parse(s: &str) -> Option<StartPosition> {
        match s {
            "earliest" => Some(StartPosition::Earliest),
            "latest" => Some(StartPosition::Latest),
            _ => time::parse_rfc3339_us(s).map(StartPosition::TimeUs),
        }
    }
}

/// CLI flags that override everything else (`--data-dir`, `--listen`, `--source`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub source_kind: Option<SourceKind>,
}

/// The whole configuration. Field names are the TOML keys (see `kvindex.example.toml`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// RocksDB state (L2 and checkpoints).
    pub data_dir: PathBuf,
    pub http: HttpConfig,
    pub source: SourceConfig,
    pub index: IndexConfig,
    pub writeback: WritebackConfig,
    pub checkpoint: CheckpointConfig,
    /// Engines whose ZeroMQ publishers the bridge subscribes to (`kvindex bridge`, or inside
    /// `serve` when any is listed).
    pub bridge: BridgeConfig,
    /// This process among the replicas of one index.
    pub cluster: ClusterConfig,
}

/// Written in `source.kafka.group_id` and `source.nats.durable` (their defaults do), replaced
/// by the replica id at start, so that replicas never share a consumer by accident.
pub const REPLICA_ID_PLACEHOLDER: &str = "{replica_id}";

/// The `[cluster]` section.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Names this replica to the brokers (its consumer group and durable consumer, through
    /// [`REPLICA_ID_PLACEHOLDER`]). `""` = the id kept in the data dir (generated on first
    /// start): stable across restarts, distinct between replicas with their own data dirs.
    /// Letters, digits, `-` and `_`, at most 64.
    pub replica_id: String,
}

/// Whether `id` can be a replica id: 1 to 64 letters, digits, `-` and `_` (it goes into
/// consumer group and JetStream consumer names).
pub fn is_valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

impl Config {
    /// Fixes the replica id (`cluster.replica_id` when set, else `generated`) and writes it
    /// wherever [`REPLICA_ID_PLACEHOLDER`] stands. Returns the id.
    pub fn resolve_replica_id(&mut self, generated: impl FnOnce() -> String) -> String {
        if self.cluster.replica_id.is_empty() {
            self.cluster.replica_id = generated();
        }
        let id = self.cluster.replica_id.clone();
        for name in [
            &mut self.source.kafka.group_id,
            &mut self.source.nats.durable,
        ] {
            *name = name.replace(REPLICA_ID_PLACEHOLDER, &id);
        }
        id
    }

    /// Whether a name still waits for [`Config::resolve_replica_id`].
    pub fn replica_id_unresolved(&self) -> bool {
        self.source.kafka.group_id.contains(REPLICA_ID_PLACEHOLDER)
            || self.source.nats.durable.contains(REPLICA_ID_PLACEHOLDER)
    }
}

/// The `[bridge]` section and its `[[bridge.engines]]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    /// `engine`: key = engine id, payload as is; `adapter`: re-encoded per adapter partition.
    pub partition_by: String,
    /// Fence an engine disconnected this long, in seconds (0 = never).
    pub gone_after_s: u64,
    pub engines: Vec<BridgeEngineConfig>,
}

/// One `[[bridge.engines]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeEngineConfig {
    /// Engine id in the index; DP rank r > 0 becomes `<id>#dp<r>`.
    pub id: String,
    /// The engine's PUB endpoint; a wildcard host (`tcp://*:5557`) binds instead, for engines
    /// that connect.
    pub endpoint: String,
    /// The engine's ROUTER replay endpoint (`""`: none).
    pub replay_endpoint: String,
    /// Ranks 0..dp_size, rank r at port + r on both endpoints.
    pub dp_size: u32,
    /// ZeroMQ subscription prefix.
    pub topic: String,
    /// The model (vLLM and SGLang payloads name none).
    pub model: String,
    pub tenant: String,
}

/// The `[http]` section: where the API listens and how it guards itself (see the README,
/// *Securing the API*).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Socket address of the HTTP API; loopback by default so a laptop run exposes nothing.
    pub listen: String,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// A file holding the API's bearer token (trailing line breaks are dropped); `""` = none.
    /// Exclusive with `auth_token`.
    pub auth_token_file: PathBuf,
    /// The bearer token itself, from `KVINDEX_HTTP__AUTH_TOKEN` only (a config file may not
    /// carry it); `""` = none. Never printed: `Debug` and `Serialize` redact it.
    ///
    /// With a token, mutating routes (`DELETE /v1/engines/{id}`) need `Authorization: Bearer
    /// <token>`; without one they are served to loopback peers only.
    pub auth_token: Secret,
    /// Require the token on the read routes and `/metrics` too (`/healthz` and `/readyz` stay
    /// open). Needs a token.
    pub auth_reads: bool,
    /// PEM certificate chain for HTTPS; with `tls_key`, or neither (plain HTTP).
    pub tls_cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `tls_cert`.
    pub tls_key: PathBuf,
    /// A request not answered within this many milliseconds gets a 503 (at least 1).
    pub request_timeout_ms: u64,
    /// Requests served at once, probes excepted; one more is answered 503 with `Retry-After: 1`
    /// at once rather than queued (at least 1).
    pub max_concurrent_requests: usize,
    /// Most engines in one `GET /v1/engines` page; a larger `limit` is lowered to it (at least
    /// 1).
    pub max_page_size: usize,
    /// Also serve `POST /bench/static?bytes=N` (read the body, answer `N` bytes of fixed
    /// JSON) behind the read routes' guards: the HTTP stack's own rate on this machine, the
    /// baseline `kvindex bench http --baseline` holds lookups against. Off in production.
    pub baseline_route: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    pub kind: SourceKind,
    #[serde(with = "format_serde")]
    pub format: Format,
    /// Larger payloads are rejected before parsing.
    pub max_payload_bytes: usize,
    /// Budget of decoded events queued for the shard workers, in bytes: the source is not
    /// read further while it is spent (part of the process memory bound).
    pub max_inflight_bytes: u64,
    pub kafka: KafkaConfig,
    pub nats: NatsConfig,
    pub vllm: VllmConfig,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic: String,
    /// The consumer group kvindex commits durable offsets to, for lag tools only (positions
    /// come from kvindex's own checkpoint); `""` = commit nowhere. It is never used to split
    /// partitions: each replica reads every partition. The default, `kvindex-{replica_id}`,
    /// gives each replica its own.
    pub group_id: String,
    /// `earliest`, `latest` or an RFC 3339 time; used only where no checkpoint exists.
    pub start: String,
    /// Partitions to consume; empty = every partition of the topic.
    pub partitions: Vec<i32>,
    /// librdkafka properties passed through verbatim.
    pub properties: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    pub url: String,
    pub stream: String,
    pub subjects: Vec<String>,
    /// Name of the JetStream durable consumer. Each replica needs its own (two sharing one
    /// would split the stream between them): the default, `kvindex-{replica_id}`, sees to it,
    /// and kvindex refuses to take over a durable another replica is pulling from.
    pub durable: String,
    /// Which subject token is the engine id for vLLM payloads; negative counts from the end
    /// (-1 = last), as in Python indexing.
    pub engine_token: i64,
    /// `true`: a JetStream durable pull consumer (resumable). `false`: plain core NATS
    /// subscriptions, AT-MOST-ONCE (no replay, no resume: what is published while kvindex is
    /// down is lost).
    pub jetstream: bool,
    /// How kvindex authenticates to the server: at most one of a credentials file, an nkey
    /// seed file, a user and password, or a token. Every NATS client kvindex makes (the
    /// source, the bridge's sink, `kvindex produce`) uses it.
    /// A NATS credentials file (`.creds`: a user JWT and its nkey seed); `""` = none.
    pub credentials_file: PathBuf,
    /// A file holding a user nkey seed (`SU…`); `""` = none.
    pub nkey_seed_file: PathBuf,
    /// User name of user/password authentication, with `password`.
    pub user: String,
    /// The user's password, from `KVINDEX_SOURCE__NATS__PASSWORD` only (a config file may not
    /// carry it). Never printed.
    pub password: Secret,
    /// A server token, from `KVINDEX_SOURCE__NATS__TOKEN` only. Never printed.
    pub token: Secret,
    /// PEM CA certificates that verify the server's certificate (added to the system roots).
    pub tls_ca: PathBuf,
    /// PEM client certificate chain for mutual TLS, with `tls_key` (both or neither).
    pub tls_cert: PathBuf,
    /// PEM private key of `tls_cert`.
    pub tls_key: PathBuf,
    /// Refuse a connection that is not TLS (a `tls://` URL, `tls_ca` or `tls_cert` imply TLS
    /// too).
    pub tls_required: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VllmConfig {
    /// Model for vLLM payloads without a `model` header; `""` = none (such payloads are
    /// rejected rather than indexed under a guessed model).
    pub model: String,
    pub tenant: String,
    /// vLLM `lora_id` → adapter name. TOML keys are strings; they are parsed as i64.
    #[serde(with = "lora_serde")]
    pub lora_names: BTreeMap<i64, String>,
}

/// The `[index]` section (see [`Config::index_config`] for the runtime form).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexConfig {
    /// Shards (worker threads); 0 = number of cores.
    pub shards: usize,
    /// Chain-hash seed; every replica that shares answers must share it.
    pub seed: u64,
    /// Block size assumed for token lookups of a (tenant, model) no event has told us about;
    /// 0 = none (such a lookup is a 400 that says so).
    pub default_block_size: u32,
    /// An engine no event has reached for this many seconds (kvindex's clock, once the
    /// sources have caught up) is cleared durably; 0 = never.
    pub engine_ttl_s: u64,
    /// L1 memory budget.
    pub l1_max_bytes: u64,
    /// Fraction of `l1_max_bytes` at which write-back eviction starts ...
    pub high_watermark: f64,
    /// ... and the fraction it evicts down to.
    pub low_watermark: f64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WritebackConfig {
    pub write_back_on_evict: bool,
    pub batch_size: usize,
    /// Seconds; 0 = off. Signed in the file so a negative value is reported, not wrapped.
    pub periodic_flush_interval: i64,
    pub restore_on_read: bool,
    pub emergency_evict_for_restore: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub interval_ms: u64,
    pub max_events: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("./kvindex-data"),
            http: HttpConfig::default(),
            source: SourceConfig::default(),
            index: IndexConfig::default(),
            writeback: WritebackConfig::default(),
            checkpoint: CheckpointConfig::default(),
            bridge: BridgeConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            partition_by: "engine".into(),
            gone_after_s: 60,
            engines: Vec::new(),
        }
    }
}

impl Default for BridgeEngineConfig {
    fn default() -> Self {
        BridgeEngineConfig {
            id: String::new(),
            endpoint: String::new(),
            replay_endpoint: String::new(),
            dp_size: 1,
            topic: String::new(),
            model: String::new(),
            tenant: String::new(),
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 1024 * 1024,
            auth_token_file: PathBuf::new(),
            auth_token: Secret::default(),
            auth_reads: false,
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
            request_timeout_ms: 10_000,
            max_concurrent_requests: 1024,
            max_page_size: 1000,
            baseline_route: false,
        }
    }
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            kind: SourceKind::Embedded,
            format: Format::Auto,
            max_payload_bytes: event::decode::DEFAULT_MAX_PAYLOAD_BYTES,
            max_inflight_bytes: 64 << 20,
            kafka: KafkaConfig::default(),
            nats: NatsConfig::default(),
            vllm: VllmConfig::default(),
        }
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: "kv-events".into(),
            group_id: format!("kvindex-{REPLICA_ID_PLACEHOLDER}"),
            start: "earliest".into(),
            partitions: Vec::new(),
            properties: BTreeMap::new(),
        }
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            stream: "KV_EVENTS".into(),
            subjects: vec!["kv.events.>".into()],
            durable: format!("kvindex-{REPLICA_ID_PLACEHOLDER}"),
            engine_token: -1,
            jetstream: true,
            credentials_file: PathBuf::new(),
            nkey_seed_file: PathBuf::new(),
            user: String::new(),
            password: Secret::default(),
            token: Secret::default(),
            tls_ca: PathBuf::new(),
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
            tls_required: false,
        }
    }
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 0,
            seed: 0x6b76_696e_6465_7831,
            default_block_size: 0,
            engine_ttl_s: 0,
            l1_max_bytes: 1 << 30,
            high_watermark: 0.8,
            low_watermark: 0.6,
        }
    }
}

impl Default for WritebackConfig {
    fn default() -> Self {
        WritebackConfig {
            write_back_on_evict: true,
            batch_size: 128,
            periodic_flush_interval: 0,
            restore_on_read: true,
            emergency_evict_for_restore: true,
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            interval_ms: 100,
            max_events: 10_000,
        }
    }
}

/// Longest accepted `writeback.periodic_flush_interval` (one year, in seconds): longer is
/// "off" in all but name, and an absurd value would overflow the monotonic clock when the
/// next flush is scheduled.
pub const MAX_FLUSH_INTERVAL_S: i64 = 365 * 24 * 3600;

impl Config {
    /// Applies CLI flags (they win over file and environment).
    pub fn apply(&mut self, overrides: &Overrides) {
        if let Some(dir) = &overrides.data_dir {
            self.data_dir.clone_from(dir);
        }
        if let Some(listen) = &overrides.listen {
            self.http.listen.clone_from(listen);
        }
        if let Some(kind) = overrides.source_kind {
            self.source.kind = kind;
        }
    }

    /// The validated listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.http.listen.parse().map_err(|e| {
            ConfigError::invalid("http.listen", format!("`{}`: {e}", self.http.listen))
        })
    }
}

/// How the source's payloads are decoded. The one runtime settings type built here rather than
/// beside its component: the event contract (`kvindex_wire::event`) depends on nothing, so that it
/// can stand alone (fuzzing, producers in Rust).
impl From<&SourceConfig> for DecodeSettings {
    fn from(source: &SourceConfig) -> DecodeSettings {
        let vllm = &source.vllm;
        DecodeSettings {
            format: source.format,
            max_payload_bytes: source.max_payload_bytes,
            vllm: VllmSettings {
                model: (!vllm.model.is_empty()).then(|| vllm.model.clone()),
                tenant: vllm.tenant.clone(),
                lora_names: vllm
                    .lora_names
                    .iter()
                    .map(|(k, v)| (*k, v.clone()))
                    .collect::<HashMap<_, _>>(),
            },
        }
    }
}

impl HttpConfig {
    /// The bearer token: `auth_token`, or the contents of `auth_token_file` without trailing
    /// line breaks; `None` when neither is set. Reads the file on every call.
    pub fn bearer_token(&self) -> Result<Option<Secret>, ConfigError> {
        if !self.auth_token.is_empty() {
            check_token("http.auth_token", self.auth_token.expose())?;
            return Ok(Some(self.auth_token.clone()));
        }
        if self.auth_token_file.as_os_str().is_empty() {
            return Ok(None);
        }
        let field = "http.auth_token_file";
        let path = self.auth_token_file.display();
        let text = std::fs::read_to_string(&self.auth_token_file)
            .map_err(|e| ConfigError::invalid(field, format!("cannot read {path}: {e}")))?;
        let token = text.trim_end_matches(['\n', '\r']);
        if token.is_empty() {
            return Err(ConfigError::invalid(field, format!("{path} is empty")));
        }
        check_token(field, token)?;
        Ok(Some(Secret::new(token)))
    }

    /// Whether HTTPS is configured (`tls_cert` and `tls_key`).
    pub fn tls(&self) -> bool {
        !self.tls_cert.as_os_str().is_empty()
    }

    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.request_timeout_ms)
    }
}

/// A token must fit an `Authorization` header as one word: visible ASCII, no spaces. The
/// error never quotes it.
fn check_token(field: &str, token: &str) -> Result<(), ConfigError> {
    if token.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            "the token must be visible ASCII without spaces or line breaks inside",
        ))
    }
}

impl KafkaConfig {
    /// `start` as a position.
    pub fn start_position(&self) -> Result<StartPosition, ConfigError> {
        StartPosition::parse(&self.start).ok_or_else(|| {
            ConfigError::invalid(
                "source.kafka.start",
                format!("invalid start `{}`", self.start),
            )
        })
    }
}

impl IndexConfig {
    /// `engine_ttl_s` as a duration; `None` when off.
    pub fn engine_ttl(&self) -> Option<std::time::Duration> {
        (self.engine_ttl_s > 0).then(|| std::time::Duration::from_secs(self.engine_ttl_s))
    }
}

impl WritebackConfig {
    /// `periodic_flush_interval` as a duration; `None` when off.
    pub fn periodic_flush(&self) -> Option<std::time::Duration> {
        u64::try_from(self.periodic_flush_interval)
            .ok()
            .filter(|&s| s > 0)
            .map(std::time::Duration::from_secs)
    }
}

/// `Format` has no `Serialize`; (de)serialize it by its configuration name.
mod format_serde {
    use super::Format;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(f: &Format, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(f.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Format, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// TOML keys are strings: lora ids are written as `"3" = "sql-lora"` and parsed as i64.
mod lora_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(m: &BTreeMap<i64, String>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(m.iter().map(|(k, v)| (k.to_string(), v)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<i64, String>, D::Error> {
        BTreeMap::<String, String>::deserialize(d)?
            .into_iter()
            .map(|(k, v)| match k.trim().parse::<i64>() {
                Ok(id) => Ok((id, v)),
                Err(_) => Err(serde::de::Error::custom(format!(
                    "source.vllm.lora_names: key `{k}` is not an integer lora id"
                ))),
            })
            .collect()
    }
}
