//! Load generators for `kvindex bench http`: keep-alive connections posting request bodies
//! round-robin to one path for a fixed time, either from client threads of this process (one
//! per connection, one request in flight each) or from `wrk` (Debian's `wrk`, driven by a Lua
//! script written beside the bodies). Both report a [`Phase`].

use anyhow::{Context, bail};
use kvindex::bench::harness::HttpClient;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What one load phase measured.
#[derive(Clone, Debug, Default)]
pub struct Phase {
    /// Requests answered 200.
    pub answered: u64,
    pub non_200: u64,
    pub elapsed: Duration,
    /// Latency percentiles of the answered requests, in microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Phase {
    pub fn requests_per_s(&self) -> f64 {
        self.answered as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Who sends the requests.
pub enum LoadGenerator {
    /// Client threads of this process, one per connection.
    Threads,
    /// `wrk -t<threads> -c<connections> --latency`, with its Lua script and bodies in `dir`.
    Wrk {
        threads: usize,
        dir: std::path::PathBuf,
    },
}

impl LoadGenerator {
    /// `connections` connections post `bodies` round-robin to `path` for `duration`.
    pub fn run(
        &self,
        addr: SocketAddr,
        path: &str,
        bodies: &Arc<Vec<Vec<u8>>>,
        connections: usize,
        duration: Duration,
    ) -> anyhow::Result<Phase> {
        match self {
            LoadGenerator::Threads => threads(addr, path, bodies, connections, duration),
            LoadGenerator::Wrk { threads, dir } => {
                wrk(addr, path, bodies, *threads, connections, duration, dir)
            }
        }
    }
}

/// The `q` quantile of `sorted` latencies (nearest rank; 0 when empty).
pub fn percentile(sorted: &[u32], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => f64::from(sorted[((n - 1) as f64 * q).round() as usize]),
    }
}

/// One client thread: posts `bodies` to `path` (starting at `first`) until `stop`; returns
/// its latencies (µs) and non-200 count.
fn client(
    addr: SocketAddr,
    path: &str,
    bodies: &[Vec<u8>],
    first: usize,
    stop: &AtomicBool,
) -> anyhow::Result<(Vec<u32>, u64)> {
    let mut http = HttpClient::connect(addr)?;
    let (mut latencies, mut non_200) = (Vec::new(), 0);
    let mut i = first;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let (status, _) = http.request("POST", path, &bodies[i % bodies.len()])?;
        if status == 200 {
            latencies.push(started.elapsed().as_micros().min(u32::MAX as u128) as u32);
        } else {
            non_200 += 1;
        }
        i += 1;
    }
    Ok((latencies, non_200))
}

fn threads(
    addr: SocketAddr,
    path: &str,
    bodies: &Arc<Vec<Vec<u8>>>,
    connections: usize,
    duration: Duration,
) -> anyhow::Result<Phase> {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..connections)
        .map(|c| {
            let (bodies, stop, path) = (bodies.clone(), stop.clone(), path.to_owned());
            let first = c * bodies.len() / connections.max(1);
            std::thread::spawn(move || client(addr, &path, &bodies, first, &stop))
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    let (mut latencies, mut non_200) = (Vec::new(), 0);
    for h in handles {
        let (l, n) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        latencies.extend(l);
        non_200 += n;
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    Ok(Phase {
        answered: latencies.len() as u64,
        non_200,
        elapsed,
        p50_us: percentile(&latencies, 0.50),
        p99_us: percentile(&latencies, 0.99),
        p999_us: percentile(&latencies, 0.999),
        max_us: percentile(&latencies, 1.0),
    })
}

/// Posts the bodies of `KVINDEX_WRK_BODIES` (one per line) round-robin, each wrk thread from
/// its own starting point.
const WRK_SCRIPT: &str = r#"
local bodies = {}
for line in io.lines(os.getenv("KVINDEX_WRK_BODIES")) do bodies[#bodies + 1] = line end
i = 0
local headers = { ["Content-Type"] = "application/json" }
function setup(thread) thread:set("i", math.random(#bodies)) end
function request()
  i = i % #bodies + 1
  return wrk.format("POST", nil, headers, bodies[i])
end
function done(summary, latency, requests)
  io.write(string.format(
    "kvindex: p50 %d p99 %d p999 %d max %d requests %d non2xx %d duration %d\n",
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max,
    summary.requests, summary.errors.status, summary.duration))
end
"#;

fn wrk(
    addr: SocketAddr,
    path: &str,
    bodies: &[Vec<u8>],
    threads: usize,
    connections: usize,
    duration: Duration,
    dir: &Path,
) -> anyhow::Result<Phase> {
    let script = dir.join("bench-wrk.lua");
    std::fs::write(&script, WRK_SCRIPT)?;
    let bodies_file = dir.join("bench-wrk-bodies.jsonl");
    let mut lines = Vec::new();
    for b in bodies {
        if b.contains(&b'\n') {
            bail!("a request body spans lines; wrk's script reads one per line");
        }
        lines.extend_from_slice(b);
        lines.push(b'\n');
    }
    std::fs::write(&bodies_file, lines)?;
    let out = Command::new("wrk")
        .arg(format!("-t{}", threads.min(connections).max(1)))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .arg("-s")
        .arg(&script)
        .arg(format!("http://{addr}{path}"))
        .env("KVINDEX_WRK_BODIES", &bodies_file)
        .output()
        .context("running wrk (apt-get install -y wrk)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "wrk failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_wrk(&stdout).with_context(|| format!("reading wrk's output:\n{stdout}"))
}

/// The `kvindex:` line [`WRK_SCRIPT`] prints (latencies and duration in µs, as wrk keeps
/// them).
fn parse_wrk(stdout: &str) -> anyhow::Result<Phase> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("kvindex: "))
        .context("no summary line")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let field = |name: &str| -> anyhow::Result<f64> {
        let at = words
            .iter()
            .position(|w| *w == name)
            .with_context(|| format!("no `{name}`"))?;
        Ok(words.get(at + 1).context("no value")?.parse()?)
    };
    let requests = field("requests")? as u64;
    let non_200 = field("non2xx")? as u64;
    Ok(Phase {
        answered: requests.saturating_sub(non_200),
        non_200,
        elapsed: Duration::from_micros(field("duration")? as u64),
        p50_us: field("p50")?,
        p99_us: field("p99")?,
        p999_us: field("p999")?,
        max_us: field("max")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_summary_line_is_read() {
        let out = "Running 10s test\n  2 threads\nkvindex: p50 812 p99 2051 p999 4100 max 9000 \
                   requests 100000 non2xx 5 duration 10000000\nRequests/sec: 9999\n";
        let p = parse_wrk(out).unwrap();
        assert_eq!((p.answered, p.non_200), (99_995, 5));
        assert_eq!(
            (p.p50_us, p.p99_us, p.p999_us, p.max_us),
            (812.0, 2051.0, 4100.0, 9000.0)
        );
        assert!((p.requests_per_s() - 9999.5).abs() < 1e-6);
        assert!(parse_wrk("Requests/sec: 1\n").is_err());
    }
}
