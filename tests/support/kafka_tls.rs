//! A TLS front for a plaintext Kafka broker. librdkafka's mock cluster (the embedded broker)
//! listens in plaintext only; the front terminates TLS, requires a client certificate signed
//! by a given CA, and forwards the bytes both ways.
//!
//! A Kafka broker tells its clients where to connect: Metadata and FindCoordinator answers name
//! a host and a port. So the front rewrites the broker's own `127.0.0.1` + port in every answer
//! to `localhost` + its own port. Both host names have nine bytes, so every frame keeps its
//! length; `localhost` is a name the server certificate holds, so clients verify it as they
//! would a real broker's. A client given only the front's address reaches the cluster through
//! TLS and nothing else.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

pub struct KafkaTlsFront {
    /// Where clients connect, as `localhost:<port>`.
    pub port: u16,
    /// TLS handshakes completed (clients let in).
    pub handshakes: Arc<AtomicU64>,
    /// TLS handshakes that failed (clients refused, or clients that refused the front).
    pub refused: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl KafkaTlsFront {
    /// Starts a front for the broker at `bootstrap` (`127.0.0.1:<port>`, a one-broker
    /// cluster), presenting `cert`/`key` and requiring client certificates signed by
    /// `client_ca`.
    pub async fn start(bootstrap: &str, cert: &Path, key: &Path, client_ca: &Path) -> Self {
        let broker_port: u16 = bootstrap
            .strip_prefix("127.0.0.1:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("a one-broker loopback cluster, not `{bootstrap}`"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = TlsAcceptor::from(server_config(cert, key, client_ca));
        let broker_address = [
            b"127.0.0.1".as_slice(),
            &i32::from(broker_port).to_be_bytes(),
        ]
        .concat();
        let front_address = [b"localhost".as_slice(), &i32::from(port).to_be_bytes()].concat();
        let rewrite = Arc::new((broker_address, front_address));
        let (handshakes, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (ok, failed) = (handshakes.clone(), refused.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, rewrite) = (acceptor.clone(), rewrite.clone());
                let (ok, failed) = (ok.clone(), failed.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    ok.fetch_add(1, Ordering::SeqCst);
                    let Ok(upstream) = TcpStream::connect(("127.0.0.1", broker_port)).await else {
                        return;
                    };
                    let (mut client_reads, mut client_writes) = tokio::io::split(tls);
                    let (mut broker_reads, mut broker_writes) = upstream.into_split();
                    let (from, to) = (&rewrite.0, &rewrite.1);
                    tokio::select! {
                        _ = tokio::io::copy(&mut client_reads, &mut broker_writes) => {}
                        _ = forward_answers(&mut broker_reads, &mut client_writes, from, to) => {}
                    }
                });
            }
        });
        KafkaTlsFront {
            port,
            handshakes,
            refused,
            task,
        }
    }

    /// The bootstrap address to give clients.
    pub fn bootstrap(&self) -> String {
        format!("localhost:{}", self.port)
    }
}

impl Drop for KafkaTlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies the broker's answers (4-byte big-endian length, then the frame) to the client, with
/// every `from` in a frame replaced by `to` (of the same length).
async fn forward_answers(
    broker: &mut (impl AsyncRead + Unpin),
    client: &mut (impl AsyncWrite + Unpin),
    from: &[u8],
    to: &[u8],
) -> std::io::Result<()> {
    loop {
        let mut length = [0u8; 4];
        broker.read_exact(&mut length).await?;
        let mut frame = vec![0u8; u32::from_be_bytes(length) as usize];
        broker.read_exact(&mut frame).await?;
        let mut at = 0;
        while let Some(found) = frame[at..].windows(from.len()).position(|w| w == from) {
            frame[at + found..at + found + to.len()].copy_from_slice(to);
            at += found + to.len();
        }
        client.write_all(&length).await?;
        client.write_all(&frame).await?;
        client.flush().await?;
    }
}

fn server_config(cert: &Path, key: &Path, client_ca: &Path) -> Arc<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(client_ca).unwrap() {
        roots.add(ca.unwrap()).unwrap();
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .unwrap();
    let chain = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap())
        .unwrap();
    Arc::new(config)
}
