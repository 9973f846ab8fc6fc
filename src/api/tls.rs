//! HTTPS for the API: the rustls server configuration from `http.tls_cert` and `http.tls_key`
//! (PEM files), on the `ring` provider named explicitly (the process may link more than one),
//! and [`TlsListener`], an axum [`Listener`] whose connections arrive with their handshake
//! done.
//!
//! Handshakes run in tasks of their own, each bounded by [`HANDSHAKE_TIMEOUT`], so a client
//! that stalls its handshake holds neither the accept loop nor other clients.

use crate::config::{ConfigError, HttpConfig};
use axum::serve::Listener;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

pub use rustls::ServerConfig;

/// Longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections handshaken but not yet taken by the server.
const READY_QUEUE: usize = 64;

/// Why the TLS configuration could not be built. Messages name the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: cannot read certificates: {source}", path.display())]
    Certificates {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{}: no PEM certificate in the file", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{}: cannot read a PEM private key: {source}", path.display())]
    Key {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("the certificate and key are not usable together: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The server configuration for `cert` (a PEM chain, leaf first) and `key`, HTTP/1.1 by ALPN.
pub fn load(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|items| items.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Certificates {
            path: cert.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Key {
        path: key.to_path_buf(),
        source,
    })?;
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The configuration `http` asks for: `None` for plain HTTP. Errors name `http.tls_cert`
/// (certificate or pairing) or `http.tls_key`.
pub fn server_config(http: &HttpConfig) -> Result<Option<Arc<ServerConfig>>, ConfigError> {
    if !http.tls() {
        return Ok(None);
    }
    load(&http.tls_cert, &http.tls_key).map(Some).map_err(|e| {
        let field = match e {
            TlsError::Key { .. } => "http.tls_key",
            _ => "http.tls_cert",
        };
        ConfigError::invalid(field, e.to_string())
    })
}

/// TCP accepted and TLS handshaken in the background; [`Listener::accept`] hands out the
/// connections that completed. Dropping it stops the accept loop.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let accept_loop = tokio::spawn(accept_loop(tcp, TlsAcceptor::from(config), tx));
        Ok(TlsListener {
            ready,
            local,
            accept_loop,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors and the like: back off rather than spin.
                tracing::warn!(error = %e, "accepting a TCP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "could not set TCP_NODELAY");
        }
        let (acceptor, handed) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    // The server is gone when this fails; the connection just closes.
                    let _ = handed.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
        if ready.is_closed() {
            return;
        }
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            None => {
                // The accept loop ended (it only does when this listener is dropped): accept
                // nothing more, as a closed socket would.
                tracing::error!("the TLS accept loop stopped");
                std::future::pending().await
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}
