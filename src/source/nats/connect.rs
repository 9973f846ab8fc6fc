//! How kvindex's NATS clients reach the server: TLS (server verification against extra CA
//! certificates, an optional client certificate) and one way to authenticate (a `.creds`
//! file, an nkey seed file, a user and password, or a token), from `[source.nats]`. The
//! source, the bridge's sink and the publishers all connect through [`NatsAuth::options`], so
//! a secured server needs one section of configuration, and no secret is ever logged (the
//! secrets are [`Secret`]s; errors name files, never their contents).

use crate::config::{NatsConfig, Secret};
use crate::source::SourceError;
use async_nats::ConnectOptions;
use std::path::PathBuf;

/// TLS and credentials for NATS connections; the default is plain and anonymous.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsAuth {
    pub credentials_file: Option<PathBuf>,
    pub nkey_seed_file: Option<PathBuf>,
    /// User and password.
    pub user: Option<(String, Secret)>,
    pub token: Option<Secret>,
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain and key (mutual TLS).
    pub tls_client: Option<(PathBuf, PathBuf)>,
    pub tls_required: bool,
}

fn path(p: &std::path::Path) -> Option<PathBuf> {
    (!p.as_os_str().is_empty()).then(|| p.to_path_buf())
}

impl From<&NatsConfig> for NatsAuth {
    fn from(cfg: &NatsConfig) -> NatsAuth {
        NatsAuth {
            credentials_file: path(&cfg.credentials_file),
            nkey_seed_file: path(&cfg.nkey_seed_file),
            user: (!cfg.user.is_empty()).then(|| (cfg.user.clone(), cfg.password.clone())),
            token: (!cfg.token.is_empty()).then(|| cfg.token.clone()),
            tls_ca: path(&cfg.tls_ca),
            tls_client: path(&cfg.tls_cert).zip(path(&cfg.tls_key)),
            tls_required: cfg.tls_required,
        }
    }
}

impl NatsAuth {
    /// Connect options carrying this TLS and authentication; callers add their own name,
    /// timeouts and callbacks. Fails (naming the file) when a credentials or seed file
    /// cannot be read.
    pub async fn options(&self) -> Result<ConnectOptions, SourceError> {
        let unreadable = |what: &str, file: &PathBuf, e: std::io::Error| {
            SourceError::Config(format!(
                "source.nats.{what}: cannot read {}: {e}",
                file.display()
            ))
        };
        let mut opts = ConnectOptions::new();
        if let Some(file) = &self.credentials_file {
            opts = opts
                .credentials_file(file)
                .await
                .map_err(|e| unreadable("credentials_file", file, e))?;
        }
        if let Some(file) = &self.nkey_seed_file {
            let seed =
                std::fs::read_to_string(file).map_err(|e| unreadable("nkey_seed_file", file, e))?;
            opts = opts.nkey(seed.trim().to_string());
        }
        if let Some((user, password)) = &self.user {
            opts = opts.user_and_password(user.clone(), password.expose().to_string());
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.expose().to_string());
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls_client {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        let tls = self.tls_required || self.tls_ca.is_some() || self.tls_client.is_some();
        // async-nats builds its rustls client with the process's default crypto provider,
        // which rustls cannot pick by itself when more than one is linked (a dependency may
        // enable aws-lc-rs beside ring): name ring, which the HTTP listener uses too. An
        // already installed provider stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(opts.require_tls(tls))
    }
}
