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

use crate::event::{DecodeOptions, Format, VllmOptions};
use crate::index::IndexConfig;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use toml::{Table, Value};

/// Prefix of every configuration environment variable.
pub const ENV_PREFIX: &str = "KVINDEX_";

/// `KVINDEX_*` variables that are not configuration keys (read elsewhere by the binary) and
/// that [`Config::load`] therefore ignores instead of rejecting.
pub const NON_CONFIG_ENV: &[&str] = &["KVINDEX_CONFIG", "KVINDEX_LOG", "KVINDEX_LOG_FORMAT"];

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

    fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
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
    /// In-process queue (`demo`, tests, and the HTTP ingest path).
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
            _ => parse_rfc3339_us(s).map(StartPosition::TimeUs),
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
    pub index: IndexSection,
    pub writeback: WritebackConfig,
    pub checkpoint: CheckpointConfig,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Socket address of the HTTP API; loopback by default so a laptop run exposes nothing.
    pub listen: String,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    pub kind: SourceKind,
    #[serde(with = "format_serde")]
    pub format: Format,
    /// Larger payloads are rejected before parsing.
    pub max_payload_bytes: usize,
    pub kafka: KafkaConfig,
    pub nats: NatsConfig,
    pub vllm: VllmSection,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic: String,
    pub group_id: String,
    /// `earliest`, `latest` or an RFC 3339 time; used only where no checkpoint exists.
    pub start: String,
    /// Partitions to consume, assigned explicitly (no group rebalancing; the group, if any, is
    /// used for offset commits only). Empty: the group's assignment, or every partition
    /// without a group.
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
    pub durable: String,
    /// Which subject token is the engine id for vLLM payloads; negative counts from the end
    /// (-1 = last), as in Python indexing.
    pub engine_token: i64,
    /// `true`: a JetStream durable pull consumer (resumable). `false`: plain core NATS
    /// subscriptions, AT-MOST-ONCE (no replay, no resume: what is published while kvindex is
    /// down is lost).
    pub jetstream: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VllmSection {
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
pub struct IndexSection {
    /// Shards (worker threads); 0 = number of cores.
    pub shards: usize,
    /// Chain-hash seed; every replica that shares answers must share it.
    pub seed: u64,
    /// Block size assumed for token lookups of a (tenant, model) no event has told us about.
    pub default_block_size: u32,
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
            index: IndexSection::default(),
            writeback: WritebackConfig::default(),
            checkpoint: CheckpointConfig::default(),
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 1024 * 1024,
        }
    }
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            kind: SourceKind::Embedded,
            format: Format::Auto,
            max_payload_bytes: crate::event::detect::DEFAULT_MAX_PAYLOAD_BYTES,
            kafka: KafkaConfig::default(),
            nats: NatsConfig::default(),
            vllm: VllmSection::default(),
        }
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: "kv-events".into(),
            group_id: "kvindex".into(),
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
            durable: "kvindex".into(),
            engine_token: -1,
            jetstream: true,
        }
    }
}

impl Default for IndexSection {
    fn default() -> Self {
        IndexSection {
            shards: 0,
            seed: 0x6b76_696e_6465_7831,
            default_block_size: 16,
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

/// Integer keys whose value may be negative; every other integer key must be ≥ 0.
const SIGNED_KEYS: &[&str] = &[
    "source.nats.engine_token",
    "writeback.periodic_flush_interval",
];
/// Array keys whose items are integers (partition numbers); every other array holds strings.
const INTEGER_ARRAY_KEYS: &[&str] = &["source.kafka.partitions"];
/// String keys with a closed set of values (checked at merge time, so the error names them).
const ENUM_KEYS: &[(&str, &[&str])] = &[
    ("source.kind", &SourceKind::NAMES),
    ("source.format", &["auto", "proto", "json", "vllm"]),
];
const KAFKA_PROPERTIES: &str = "source.kafka.properties";
const LORA_NAMES: &str = "source.vllm.lora_names";

impl Config {
    /// Loads and validates: defaults < `file` < `env` (`KVINDEX_*` pairs; other names are
    /// ignored) < `overrides`. Pass `std::env::vars()` as `env` in the binary.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let mut tree = default_tree();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let table: Table = text
                .parse()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            let origin = path.display().to_string();
            merge(&mut tree, table, "", &origin)?;
        }
        let mut vars: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX) && !NON_CONFIG_ENV.contains(&k.as_str()))
            .collect();
        // Deterministic order, so the first error reported does not depend on the process env.
        vars.sort();
        for (var, value) in vars {
            merge_env(&mut tree, &var, &value)?;
        }
        let mut config: Config = tree
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::invalid("config", e.to_string()))?;
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

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

    /// Checks every rule; the error names the first field that breaks one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn bad(field: &str, reason: impl Into<String>) -> ConfigError {
            ConfigError::invalid(field, reason)
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(bad("data_dir", "must not be empty"));
        }
        if let Err(e) = self.http.listen.parse::<SocketAddr>() {
            return Err(bad(
                "http.listen",
                format!(
                    "must be a socket address like 127.0.0.1:8080, got `{}` ({e})",
                    self.http.listen
                ),
            ));
        }
        if self.http.max_body_bytes < 1024 {
            return Err(bad(
                "http.max_body_bytes",
                format!("must be at least 1024, got {}", self.http.max_body_bytes),
            ));
        }
        if self.source.max_payload_bytes == 0 {
            return Err(bad("source.max_payload_bytes", "must be at least 1, got 0"));
        }
        let kafka = &self.source.kafka;
        if StartPosition::parse(&kafka.start).is_none() {
            return Err(bad(
                "source.kafka.start",
                format!(
                    "must be earliest, latest or an RFC 3339 time (e.g. 2025-01-31T12:00:00Z), got `{}`",
                    kafka.start
                ),
            ));
        }
        if let Some(p) = kafka.partitions.iter().find(|&&p| p < 0) {
            return Err(bad(
                "source.kafka.partitions",
                format!("partition numbers are ≥ 0, got {p}"),
            ));
        }
        if self.source.kind == SourceKind::Kafka {
            for (field, value) in [
                ("source.kafka.brokers", &kafka.brokers),
                ("source.kafka.topic", &kafka.topic),
            ] {
                if value.trim().is_empty() {
                    return Err(bad(field, "must not be empty when source.kind = \"kafka\""));
                }
            }
        }
        let nats = &self.source.nats;
        if nats.subjects.is_empty() {
            return Err(bad(
                "source.nats.subjects",
                "must list at least one subject",
            ));
        }
        if let Some(s) = nats.subjects.iter().find(|s| s.trim().is_empty()) {
            return Err(bad(
                "source.nats.subjects",
                format!("subjects must not be empty, got `{s}`"),
            ));
        }
        if self.source.kind == SourceKind::Nats {
            for (field, value) in [
                ("source.nats.url", &nats.url),
                ("source.nats.stream", &nats.stream),
                ("source.nats.durable", &nats.durable),
            ] {
                if value.trim().is_empty() {
                    return Err(bad(field, "must not be empty when source.kind = \"nats\""));
                }
            }
        }
        if let Some((id, _)) = self
            .source
            .vllm
            .lora_names
            .iter()
            .find(|(_, n)| n.is_empty())
        {
            return Err(bad(
                &format!("{LORA_NAMES}.{id}"),
                "adapter name must not be empty",
            ));
        }
        let index = &self.index;
        if index.default_block_size == 0 {
            return Err(bad("index.default_block_size", "must be at least 1, got 0"));
        }
        if index.l1_max_bytes == 0 {
            return Err(bad("index.l1_max_bytes", "must be at least 1, got 0"));
        }
        let (high, low) = (index.high_watermark, index.low_watermark);
        if !(high > 0.0 && high <= 1.0) {
            return Err(bad(
                "index.high_watermark",
                format!("must be in (0, 1], got {high}"),
            ));
        }
        if !(low > 0.0 && low < high) {
            return Err(bad(
                "index.low_watermark",
                format!("must be in (0, index.high_watermark = {high}), got {low}"),
            ));
        }
        let wb = &self.writeback;
        if !(1..=65536).contains(&wb.batch_size) {
            return Err(bad(
                "writeback.batch_size",
                format!("must be in 1..=65536, got {}", wb.batch_size),
            ));
        }
        if wb.periodic_flush_interval < 0 {
            return Err(bad(
                "writeback.periodic_flush_interval",
                format!(
                    "must be ≥ 0 seconds (0 = off), got {}",
                    wb.periodic_flush_interval
                ),
            ));
        }
        if wb.periodic_flush_interval > MAX_FLUSH_INTERVAL_S {
            return Err(bad(
                "writeback.periodic_flush_interval",
                format!(
                    "must be at most {MAX_FLUSH_INTERVAL_S} seconds (one year; 0 = off), got {}",
                    wb.periodic_flush_interval
                ),
            ));
        }
        if wb.emergency_evict_for_restore && !wb.write_back_on_evict {
            return Err(bad(
                "writeback.emergency_evict_for_restore",
                "requires writeback.write_back_on_evict = true (evicting without writing back would lose the entries)",
            ));
        }
        if self.checkpoint.interval_ms == 0 {
            return Err(bad("checkpoint.interval_ms", "must be at least 1, got 0"));
        }
        if self.checkpoint.max_events == 0 {
            return Err(bad("checkpoint.max_events", "must be at least 1, got 0"));
        }
        Ok(())
    }

    /// The index settings (`shards = 0` → the number of cores).
    pub fn index_config(&self) -> IndexConfig {
        let shards = match self.index.shards {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        IndexConfig {
            shards,
            seed: self.index.seed,
        }
    }

    /// How the source decodes payloads.
    pub fn decode_options(&self) -> DecodeOptions {
        let vllm = &self.source.vllm;
        DecodeOptions {
            format: self.source.format,
            max_payload_bytes: self.source.max_payload_bytes,
            vllm: VllmOptions {
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

    /// The validated listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.http.listen.parse().map_err(|e| {
            ConfigError::invalid("http.listen", format!("`{}`: {e}", self.http.listen))
        })
    }

    /// The validated Kafka start position.
    pub fn kafka_start(&self) -> Result<StartPosition, ConfigError> {
        StartPosition::parse(&self.source.kafka.start).ok_or_else(|| {
            ConfigError::invalid(
                "source.kafka.start",
                format!("invalid start `{}`", self.source.kafka.start),
            )
        })
    }

    /// `writeback.periodic_flush_interval` as a duration; `None` when off.
    pub fn periodic_flush(&self) -> Option<std::time::Duration> {
        u64::try_from(self.writeback.periodic_flush_interval)
            .ok()
            .filter(|&s| s > 0)
            .map(std::time::Duration::from_secs)
    }
}

/// The defaults as a TOML tree: the base of every merge and the schema keys are checked
/// against.
fn default_tree() -> Table {
    // Serializing plain structs of strings and numbers cannot fail; an empty table would only
    // make every key "unknown", which the tests would catch at once.
    Table::try_from(Config::default()).unwrap_or_default()
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Boolean(_) => "a boolean",
        Value::Datetime(_) => "a datetime",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// Merges `overlay` into `base` (both at dotted `path`), checking keys and types against what
/// `base` holds. `origin` (file or variable) is named in errors.
fn merge(base: &mut Table, overlay: Table, path: &str, origin: &str) -> Result<(), ConfigError> {
    for (key, value) in overlay {
        let field = join(path, &key);
        if path == KAFKA_PROPERTIES || path == LORA_NAMES {
            let (k, v) = free_entry(path, &key, value, origin)?;
            base.insert(k, v);
            continue;
        }
        let Some(slot) = base.get_mut(&key) else {
            return Err(ConfigError::UnknownKey {
                key: field,
                origin: origin.to_string(),
            });
        };
        match (slot, value) {
            (Value::Table(sub), Value::Table(v)) => merge(sub, v, &field, origin)?,
            (Value::Table(_), v) => {
                return Err(mistyped(&field, "a table", &v, origin));
            }
            (slot, v) => *slot = coerce(&field, slot, v, origin)?,
        }
    }
    Ok(())
}

fn mistyped(field: &str, expected: &str, got: &Value, origin: &str) -> ConfigError {
    ConfigError::invalid(
        field,
        format!(
            "expected {expected}, got {} {got} (in {origin})",
            type_name(got)
        ),
    )
}

/// `v` converted to the type of the default it replaces, or an error naming `field`.
fn coerce(field: &str, default: &Value, v: Value, origin: &str) -> Result<Value, ConfigError> {
    let out = match (default, v) {
        (Value::String(_), Value::String(s)) => {
            if let Some((_, allowed)) = ENUM_KEYS.iter().find(|(k, _)| *k == field) {
                let lower = s.to_ascii_lowercase();
                if !allowed.contains(&lower.as_str()) {
                    return Err(ConfigError::invalid(
                        field,
                        format!(
                            "must be one of {}, got `{s}` (in {origin})",
                            allowed.join(" | ")
                        ),
                    ));
                }
                Value::String(lower)
            } else {
                Value::String(s)
            }
        }
        // An unquoted TOML datetime (start = 2025-01-31T12:00:00Z) is meant as the string.
        (Value::String(_), Value::Datetime(d)) => Value::String(d.to_string()),
        (Value::Integer(_), Value::Integer(i)) => {
            if i < 0 && !SIGNED_KEYS.contains(&field) {
                return Err(ConfigError::invalid(
                    field,
                    format!("must be a non-negative integer, got {i} (in {origin})"),
                ));
            }
            Value::Integer(i)
        }
        (Value::Float(_), Value::Float(f)) => Value::Float(f),
        (Value::Float(_), Value::Integer(i)) => Value::Float(i as f64),
        (Value::Boolean(_), Value::Boolean(b)) => Value::Boolean(b),
        (Value::Array(_), Value::Array(items)) if INTEGER_ARRAY_KEYS.contains(&field) => {
            if let Some(bad) = items
                .iter()
                .find(|i| !matches!(i, Value::Integer(n) if *n >= 0))
            {
                return Err(mistyped(
                    field,
                    "an array of non-negative integers",
                    bad,
                    origin,
                ));
            }
            Value::Array(items)
        }
        (Value::Array(_), Value::Array(items)) => {
            if let Some(bad) = items.iter().find(|i| !matches!(i, Value::String(_))) {
                return Err(mistyped(field, "an array of strings", bad, origin));
            }
            Value::Array(items)
        }
        (default, v) => {
            let expected = match default {
                Value::Integer(_) => "an integer",
                Value::Float(_) => "a number",
                Value::Array(_) => "an array of strings",
                other => type_name(other),
            };
            return Err(mistyped(field, expected, &v, origin));
        }
    };
    Ok(out)
}

/// One entry of a free-form map (`map` is its dotted path): librdkafka properties take any
/// scalar as its string form; lora names need an integer key and a string name.
fn free_entry(
    map: &str,
    key: &str,
    v: Value,
    origin: &str,
) -> Result<(String, Value), ConfigError> {
    let field = join(map, key);
    if map == LORA_NAMES {
        if key.trim().parse::<i64>().is_err() {
            return Err(ConfigError::invalid(
                &field,
                format!("lora_names keys must be integer lora ids, got `{key}` (in {origin})"),
            ));
        }
        return match v {
            Value::String(s) => Ok((key.trim().to_string(), Value::String(s))),
            other => Err(mistyped(
                &field,
                "a string (the adapter name)",
                &other,
                origin,
            )),
        };
    }
    let s = match v {
        Value::String(s) => s,
        Value::Integer(i) => i.to_string(),
        Value::Float(f) => f.to_string(),
        Value::Boolean(b) => b.to_string(),
        other => return Err(mistyped(&field, "a string", &other, origin)),
    };
    Ok((key.to_string(), Value::String(s)))
}

/// Merges one `KVINDEX_A__B__C=value` variable.
fn merge_env(tree: &mut Table, var: &str, raw: &str) -> Result<(), ConfigError> {
    let rest = &var[ENV_PREFIX.len()..];
    let segments: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    let dotted = segments.join(".");
    let unknown = || ConfigError::UnknownEnv {
        var: var.to_string(),
        key: dotted.clone(),
    };
    if segments.iter().any(String::is_empty) {
        return Err(unknown());
    }
    // Walk to the parent table of the last segment.
    let (last, parents) = segments.split_last().ok_or_else(unknown)?;
    let mut table = &mut *tree;
    let mut path = String::new();
    for seg in parents {
        path = join(&path, seg);
        table = match table.get_mut(seg.as_str()) {
            Some(Value::Table(t)) => t,
            _ => return Err(unknown()),
        };
    }
    if path == KAFKA_PROPERTIES || path == LORA_NAMES {
        let key = if path == KAFKA_PROPERTIES {
            last.replace('_', ".")
        } else {
            last.clone()
        };
        let (k, v) = free_entry(&path, &key, Value::String(raw.to_string()), var)?;
        table.insert(k, v);
        return Ok(());
    }
    let field = join(&path, last);
    let Some(slot) = table.get_mut(last.as_str()) else {
        return Err(unknown());
    };
    let value = match slot {
        Value::Table(_) => {
            return Err(ConfigError::invalid(
                &field,
                format!("is a section; set its keys ({var}__<KEY>) instead"),
            ));
        }
        Value::String(_) => match raw.trim().parse::<Value>() {
            Ok(Value::String(s)) if raw.trim().starts_with(['"', '\'']) => Value::String(s),
            _ => Value::String(raw.to_string()),
        },
        Value::Array(_) => {
            if raw.trim_start().starts_with('[') {
                raw.trim().parse::<Value>().map_err(|e| {
                    ConfigError::invalid(&field, format!("invalid TOML array in {var}: {e}"))
                })?
            } else {
                Value::Array(
                    raw.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(|s| match s.parse::<i64>() {
                            Ok(n) if INTEGER_ARRAY_KEYS.contains(&field.as_str()) => {
                                Value::Integer(n)
                            }
                            _ => Value::String(s.to_string()),
                        })
                        .collect(),
                )
            }
        }
        _ => raw
            .trim()
            .parse::<Value>()
            .unwrap_or_else(|_| Value::String(raw.to_string())),
    };
    *slot = coerce(&field, slot, value, var)?;
    Ok(())
}

/// Parses a strict RFC 3339 time, `YYYY-MM-DDTHH:MM:SS(.frac)?(Z|±HH:MM)` (`T`/`Z` may be
/// lowercase, `T` may be a space), into unix microseconds. Fractions beyond microseconds are
/// truncated; a leap second (`:60`) is read as the following second.
pub fn parse_rfc3339_us(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<i64> {
        let digits = b.get(range)?;
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(
            digits
                .iter()
                .fold(0i64, |acc, d| acc * 10 + i64::from(d - b'0')),
        )
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut pos = 19;
    let mut micros = 0i64;
    if b[pos] == b'.' {
        let start = pos + 1;
        let mut end = start;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
        if end == start {
            return None;
        }
        for i in 0..6 {
            let d = if start + i < end {
                i64::from(b[start + i] - b'0')
            } else {
                0
            };
            micros = micros * 10 + d;
        }
        pos = end;
    }
    let offset_s = match b.get(pos..)? {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let digits = [*h1, *h2, *m1, *m2];
            if !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let oh = i64::from((h1 - b'0') * 10 + (h2 - b'0'));
            let om = i64::from((m1 - b'0') * 10 + (m2 - b'0'));
            if oh > 23 || om > 59 {
                return None;
            }
            let off = oh * 3600 + om * 60;
            if *sign == b'-' { -off } else { off }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    secs.checked_mul(1_000_000)?.checked_add(micros)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
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
