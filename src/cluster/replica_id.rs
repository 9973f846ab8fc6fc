//! The replica id: `cluster.replica_id` when configured, else the one kept in the data dir's
//! [`REPLICA_ID_FILE`], generated on first start as `<host>-<8 hex digits>` (the host name
//! makes consumer listings readable; the random part keeps two data dirs on one host apart).
//! Stable as long as the data dir lives: a restart, even after `kill -9`, comes back under
//! the same name and finds its consumer where it left it.

use crate::config::{Config, is_valid_replica_id};

/// The file in `data_dir` holding the generated id.
pub const REPLICA_ID_FILE: &str = "replica-id";

/// Fixes `config`'s replica id (see the module docs) and writes it into the consumer names
/// that ask for it. Returns the id.
pub fn resolve_replica_id(config: &mut Config) -> std::io::Result<String> {
    let id = replica_id(config)?;
    Ok(config.resolve_replica_id(|| id))
}

/// The replica id of `config`: configured, kept in the data dir, or generated and kept there
/// now (the data dir is created if missing).
pub fn replica_id(config: &Config) -> std::io::Result<String> {
    if !config.cluster.replica_id.is_empty() {
        return Ok(config.cluster.replica_id.clone());
    }
    let path = config.data_dir.join(REPLICA_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(kept) => {
            let kept = kept.trim();
            if is_valid_replica_id(kept) {
                return Ok(kept.to_string());
            }
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} holds `{kept}`, not a replica id (letters, digits, `-`, `_`; at most \
                     64): fix or remove it",
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = format!("{}-{}", host_part(), random_hex()?);
            crate::util::write_atomically(&path, format!("{id}\n").as_bytes())?;
            tracing::info!(replica_id = %id, file = %path.display(), "generated this data dir's replica id");
            Ok(id)
        }
        Err(e) => Err(e),
    }
}

/// The host name, lowercased, reduced to letters, digits and `-`, at most 32 characters
/// (`kvindex` when there is none).
fn host_part() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_default();
    let host: String = raw
        .trim()
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .take(32)
        .collect();
    let host = host.trim_matches('-');
    if host.is_empty() {
        "kvindex".into()
    } else {
        host.to_string()
    }
}

fn random_hex() -> std::io::Result<String> {
    let mut bytes = [0u8; 4];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| std::io::Error::other("the system random source failed"))?;
    Ok(hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn config_in(dir: &Path) -> Config {
        Config {
            data_dir: dir.to_path_buf(),
            ..Config::default()
        }
    }

    #[test]
    fn generated_once_per_data_dir_and_kept() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let first = replica_id(&config_in(a.path())).unwrap();
        assert!(is_valid_replica_id(&first), "{first}");
        assert_eq!(replica_id(&config_in(a.path())).unwrap(), first);
        assert_ne!(replica_id(&config_in(b.path())).unwrap(), first);
    }

    #[test]
    fn configured_id_wins_and_names_the_consumers() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = config_in(dir.path());
        config.cluster.replica_id = "router-a".into();
        assert_eq!(resolve_replica_id(&mut config).unwrap(), "router-a");
        assert_eq!(config.source.nats.durable, "kvindex-router-a");
        assert_eq!(config.source.kafka.group_id, "kvindex-router-a");
        assert!(!config.replica_id_unresolved());
        assert!(!dir.path().join(REPLICA_ID_FILE).exists());
    }

    #[test]
    fn a_damaged_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(REPLICA_ID_FILE), "not an id!\n").unwrap();
        let e = replica_id(&config_in(dir.path())).unwrap_err();
        assert!(e.to_string().contains(REPLICA_ID_FILE), "{e}");
    }
}
