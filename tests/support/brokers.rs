//! The brokers tests talk to: the embedded Kafka-protocol broker (publishing to it), the NATS
//! server at 127.0.0.1:4222 (which must be running: tests fail loudly without it), private
//! `nats-server`s a test can kill, and names no other test uses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The shared NATS server every NATS test talks to (`scripts/setup.sh` starts it).
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A client of the NATS server (JetStream) at `url`; fails the test, saying how to start one,
/// when none answers.
pub async fn require_nats(url: &str) -> async_nats::Client {
    let connect = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .connect(url);
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(c)) => c,
        other => panic!(
            "these tests need a NATS server with JetStream at {url} (scripts/setup.sh starts \
             one: nats-server -a 127.0.0.1 -p 4222 -js); connecting failed: {:?}",
            other.map(|r| r.err())
        ),
    }
}

/// A name no other test (or earlier run) uses: streams, subjects, topics, groups.
pub fn unique_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}{}x{nanos:x}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Publishes `events` to Kafka, one protobuf payload per run of one engine's events, keyed by
/// the engine id (so each engine's events stay ordered in one partition); returns how many
/// messages were enqueued.
pub async fn publish_kafka(
    publisher: &kvindex::source::KafkaPublisher,
    events: &[kvindex::event::Event],
) -> usize {
    let mut n = 0;
    for run in events.chunk_by(|a, b| a.engine == b.engine) {
        publisher
            .send(
                Some(&run[0].engine),
                &[],
                &kvindex::event::encode::to_proto(run),
            )
            .await
            .expect("enqueue");
        n += 1;
    }
    n
}

/// Publishes `events` to JetStream as protobuf, one message per run of one engine's events on
/// `<subject_prefix>.<engine>`; returns how many messages (the stream's sequence grows by as
/// many).
pub async fn publish_nats(
    p: &mut kvindex::source::NatsPublisher,
    subject_prefix: &str,
    events: &[kvindex::event::Event],
) -> usize {
    let mut n = 0;
    for run in events.chunk_by(|a, b| a.engine == b.engine) {
        n += 1;
        p.send(
            &format!("{subject_prefix}.{}", run[0].engine),
            &[],
            kvindex::event::encode::to_proto(run),
        )
        .await
        .unwrap();
    }
    n
}

/// Where Debian's nats-server lives (scripts/setup.sh installs it).
const NATS_SERVER: &str = "/usr/sbin/nats-server";

/// A private nats-server (JetStream) the test can kill and restart on the same port and store.
pub struct PrivateServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    /// A configuration file to run with (TLS, authorization), if any.
    conf: Option<std::path::PathBuf>,
}

impl PrivateServer {
    pub fn start() -> PrivateServer {
        PrivateServer::start_with("")
    }

    /// A server whose configuration file holds `conf` (nats-server syntax, e.g. `tls { … }`
    /// and `authorization { … }` blocks) beside its port and JetStream store.
    pub fn start_with(conf: &str) -> PrivateServer {
        assert!(
            std::path::Path::new(NATS_SERVER).exists(),
            "the fault test needs {NATS_SERVER}"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let conf = (!conf.is_empty()).then(|| {
            let path = dir.path().join("nats-server.conf");
            let store = dir.path().join("js");
            std::fs::write(
                &path,
                format!(
                    "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {store:?} }}\n{conf}\n"
                ),
            )
            .unwrap();
            path
        });
        let mut s = PrivateServer {
            port,
            dir,
            child: None,
            conf,
        };
        s.spawn();
        s
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn spawn(&mut self) {
        let mut cmd = std::process::Command::new(NATS_SERVER);
        match &self.conf {
            Some(conf) => cmd.arg("-c").arg(conf),
            None => cmd
                .args([
                    "-js",
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-sd",
                ])
                .arg(self.dir.path()),
        };
        let child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawning nats-server");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "private nats-server did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
    }
}
