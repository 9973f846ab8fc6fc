//! The configuration loader: a TOML file, then `KVINDEX_*` environment variables (the input's
//! lines after a `---` line, as `NAME=value`). Beyond "no panic": a configuration that loads
//! without secrets is a fixed point: writing it out as TOML and loading that gives the same
//! configuration (secrets are environment-only and never written out, so a configuration
//! with one cannot be written back whole).
#![no_main]

use kvindex_config::{Config, Overrides};
use libfuzzer_sys::fuzz_target;
use std::path::Path;

const FILE: &str = "fuzz.toml";

fn env_pairs(lines: &str) -> Vec<(String, String)> {
    lines
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn reload(config: &Config) -> Config {
    let mut table = toml::Table::try_from(config).expect("a loaded config serializes");
    for (key, ..) in kvindex_config::ENV_ONLY {
        let (section, field) = key.rsplit_once('.').expect("a dotted key");
        let mut at = Some(&mut table);
        for part in section.split('.') {
            at = at
                .and_then(|t| t.get_mut(part))
                .and_then(toml::Value::as_table_mut);
        }
        if let Some(t) = at {
            t.remove(field);
        }
    }
    let text = toml::to_string(&table).expect("a TOML table writes");
    Config::from_toml(Some((Path::new(FILE), &text)), [], &Overrides::default())
        .unwrap_or_else(|e| panic!("a loaded config does not reload: {e}\n{text}"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (file, env) = text.split_once("\n---\n").unwrap_or((text, ""));
    let loaded = Config::from_toml(
        Some((Path::new(FILE), file)),
        env_pairs(env),
        &Overrides::default(),
    );
    if let Ok(config) = loaded {
        let secrets = [
            &config.http.auth_token,
            &config.source.nats.password,
            &config.source.nats.token,
        ];
        if secrets.iter().all(|s| s.is_empty()) {
            assert_eq!(
                reload(&config),
                config,
                "a loaded config is not a fixed point"
            );
        }
    }
});
