//! Loading: the defaults serialized into a TOML tree, the file's table and then every
//! `KVINDEX_<SECTION>__<KEY>` variable merged into it with each value checked against the
//! type of the default it replaces, and the merged tree deserialized once (see the module docs
//! of `config` for the rules).

use super::{
    BridgeEngineConfig, Config, ConfigError, ENV_PREFIX, NON_CONFIG_ENV, Overrides, SourceKind,
};
use std::path::Path;
use toml::{Table, Value};

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
    ("bridge.partition_by", &["engine", "adapter"]),
];
/// Arrays of tables (`[[bridge.engines]]`): each item is merged over the item defaults, so its
/// keys and types are checked like any section's (errors name `bridge.engines[i].key`).
pub(super) const BRIDGE_ENGINES: &str = "bridge.engines";
pub(super) const KAFKA_PROPERTIES: &str = "source.kafka.properties";
pub(super) const LORA_NAMES: &str = "source.vllm.lora_names";
/// Secrets a config file may not carry (it would end up in version control), with the
/// environment variable that gives each and, where there is one, the key naming a file that
/// holds it.
pub const ENV_ONLY: &[(&str, &str, &str)] = &[
    (
        "http.auth_token",
        "KVINDEX_HTTP__AUTH_TOKEN",
        "http.auth_token_file",
    ),
    ("source.nats.password", "KVINDEX_SOURCE__NATS__PASSWORD", ""),
    ("source.nats.token", "KVINDEX_SOURCE__NATS__TOKEN", ""),
];

/// Whether the dotted `key` is in `table`.
fn has_key(table: &Table, key: &str) -> bool {
    let mut at = table;
    let mut parts = key.split('.').peekable();
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            return at.contains_key(part);
        }
        match at.get(part).and_then(Value::as_table) {
            Some(next) => at = next,
            None => return false,
        }
    }
    false
}

impl Config {
    /// Loads and validates: defaults < `file` < `env` (`KVINDEX_*` pairs; other names are
    /// ignored) < `overrides`. Pass `std::env::vars()` as `env` in the binary.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let text = match file {
            Some(path) => {
                Some(
                    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                        path: path.to_path_buf(),
                        source,
                    })?,
                )
            }
            None => None,
        };
        Config::from_toml(file.zip(text.as_deref()), env, overrides)
    }

    /// [`Config::load`] with the file already read: `file` is its path (for messages) and its
    /// text.
    pub fn from_toml(
        file: Option<(&Path, &str)>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &Overrides,
    ) -> Result<Config, ConfigError> {
        let mut tree = default_tree();
        if let Some((path, text)) = file {
            let table: Table = text
                .parse()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            let origin = path.display().to_string();
            if let Some((key, var, file_key)) =
                ENV_ONLY.iter().find(|(key, ..)| has_key(&table, key))
            {
                let or_file = if file_key.is_empty() {
                    String::new()
                } else {
                    format!(" or name a file holding it in {file_key}")
                };
                return Err(ConfigError::invalid(
                    key,
                    format!("is not read from a config file ({origin}): set {var}{or_file}"),
                ));
            }
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
        // An unreadable or empty token file fails the load, not the first request.
        config.http.bearer_token()?;
        Ok(config)
    }
}

/// The defaults as a TOML tree: the base of every merge and the schema keys are checked
/// against.
fn default_tree() -> Table {
    // Serializing plain structs of strings and numbers cannot fail; an empty table would only
    // make every key "unknown", which the tests would catch at once.
    Table::try_from(Config::default()).unwrap_or_default()
}

/// One `[[bridge.engines]]` item's defaults as a TOML table.
fn engine_defaults() -> Table {
    Table::try_from(BridgeEngineConfig::default()).unwrap_or_default()
}

/// `[[bridge.engines]]` items merged over the item defaults, each checked.
fn engine_items(field: &str, v: Value, origin: &str) -> Result<Value, ConfigError> {
    let Value::Array(items) = v else {
        return Err(mistyped(field, "an array of tables", &v, origin));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let path = format!("{field}[{i}]");
        let Value::Table(t) = item else {
            return Err(mistyped(&path, "a table", &item, origin));
        };
        let mut base = engine_defaults();
        merge(&mut base, t, &path, origin)?;
        out.push(Value::Table(base));
    }
    Ok(Value::Array(out))
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
        if field == BRIDGE_ENGINES {
            *slot = engine_items(&field, value, origin)?;
            continue;
        }
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
    let mut parents = parents.iter();
    while let Some(seg) = parents.next() {
        path = join(&path, seg);
        table = match table.get_mut(seg.as_str()) {
            Some(Value::Table(t)) => t,
            // `KVINDEX_BRIDGE__ENGINES__<n>__<KEY>`: item n (n = the count adds one).
            Some(Value::Array(items)) if path == BRIDGE_ENGINES => {
                let index = parents
                    .next()
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(unknown)?;
                if index > items.len() {
                    return Err(ConfigError::invalid(
                        &format!("{path}[{index}]"),
                        format!(
                            "{var}: items are numbered from 0 without holes; {} exist",
                            items.len()
                        ),
                    ));
                }
                if index == items.len() {
                    items.push(Value::Table(engine_defaults()));
                }
                path = format!("{path}[{index}]");
                match &mut items[index] {
                    Value::Table(t) => t,
                    _ => return Err(unknown()),
                }
            }
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
    if field == BRIDGE_ENGINES {
        let parsed = raw.trim().parse::<Value>().map_err(|e| {
            ConfigError::invalid(
                &field,
                format!("{var}: expected a TOML array of tables: {e}"),
            )
        })?;
        *slot = engine_items(&field, parsed, var)?;
        return Ok(());
    }
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
