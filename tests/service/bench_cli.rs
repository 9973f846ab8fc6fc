//! The service-level bench subcommands of the real binary, on small inputs: they must build
//! their index, serve it and report, so the figures in BENCHMARKS.md stay reproducible.

use std::process::Command;

fn kvindex(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvindex"))
        .args(args)
        .env("KVINDEX_LOG", "warn")
        .output()
        .expect("running kvindex");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kvindex {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A number printed right before `suffix` in `text`.
fn figure_before(text: &str, suffix: &str) -> f64 {
    let at = text
        .find(suffix)
        .unwrap_or_else(|| panic!("no `{suffix}` in:\n{text}"));
    let number = text[..at].trim_end().rsplit(' ').next().unwrap();
    number
        .parse()
        .unwrap_or_else(|_| panic!("`{number}` before `{suffix}`"))
}

#[test]
fn bench_http_serves_an_index_larger_than_its_l1_from_l2() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let out = kvindex(&[
        "bench",
        "http",
        "--data-dir",
        data,
        "--memberships",
        "40000",
        "--l1-max-bytes",
        "262144",
        "--connections",
        "2",
        "--warmup",
        "0",
        "--seconds",
        "1",
    ]);
    assert!(figure_before(&out, "lookups/s") > 0.0, "{out}");
    assert_eq!(figure_before(&out, "non-200"), 0.0, "{out}");
    // The index is several times its budget, and lookups had to read L2.
    assert!(figure_before(&out, "× the L1 budget") > 2.0, "{out}");
    assert!(figure_before(&out, "point reads") > 0.0, "{out}");
    // The server's own CPU per lookup is measured (a 1 s run of a debug build uses some).
    assert!(figure_before(&out, "µs per lookup") > 0.0, "{out}");
    // A second run reuses the built index, asking for the best 3 engines only, and holds
    // the lookups against the same server's fixed answer of their size.
    let again = kvindex(&[
        "bench",
        "http",
        "--data-dir",
        data,
        "--l1-max-bytes",
        "262144",
        "--connections",
        "1",
        "--warmup",
        "0",
        "--seconds",
        "1",
        "--limit",
        "3",
        "--baseline",
        "--pairs",
        "2",
    ]);
    assert!(again.contains("reusing the index"), "{again}");
    assert!(!again.contains("[1] lookups: 0 "), "{again}");
    assert!(figure_before(&again, "lookups/s") > 0.0, "{again}");
    for phase in ["[1] baseline", "[2] lookups", "[2] baseline"] {
        let line = again
            .lines()
            .find(|l| l.starts_with(phase))
            .unwrap_or_else(|| panic!("no `{phase}` phase in:\n{again}"));
        assert!(line.ends_with("; 0 non-200"), "{line}");
        assert!(figure_before(line, "lookups/s") > 0.0, "{line}");
    }
    assert!(figure_before(&again, "× of 2 pairs") > 0.0, "{again}");
}

#[test]
fn bench_restart_times_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let out = kvindex(&[
        "bench",
        "restart",
        "--data-dir",
        data,
        "--memberships",
        "20000",
        "--history",
        "30000",
        "--runs",
        "2",
    ]);
    assert!(out.contains("built "), "{out}");
    assert!(figure_before(&out, "ms (min") > 0.0, "{out}");
}

/// Against the local NATS server (JetStream), which the tests need anyway: every format the
/// bench takes is indexed completely (the bench itself checks the block count and that nothing
/// was malformed) and both rates are reported.
#[test]
fn bench_ingest_holds_serve_against_a_plain_drain_of_the_same_stream() {
    for format in ["json", "proto", "vllm"] {
        let dir = tempfile::tempdir().unwrap();
        let out = kvindex(&[
            "bench",
            "ingest",
            "--data-dir",
            dir.path().join("bench").to_str().unwrap(),
            "--messages",
            "300",
            "--engines",
            "4",
            "--pairs",
            "2",
            "--format",
            format,
        ]);
        assert!(out.contains("300 "), "{out}");
        assert!(figure_before(&out, "k msgs/s, kvindex") > 0.0, "{out}");
        assert!(figure_before(&out, "k msgs/s (") > 0.0, "{out}");
        assert!(out.contains("pair 1:"), "{out}");
        let ratio: f64 = out
            .rsplit("ratio ")
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("no closing ratio in:\n{out}"));
        assert!(ratio > 0.0, "{out}");
    }
}

/// `kvindex bench soak`, shortened: it probes the capacity, offers half of it (ingest through
/// the local JetStream, lookups over HTTP) and reports every window; the run must be clean (no
/// stall, nothing logged at warning level or above) and every window must have applied events
/// and answered lookups.
#[test]
fn bench_soak_reports_every_window_of_a_clean_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvindex(&[
        "bench",
        "soak",
        "--data-dir",
        dir.path().join("soak").to_str().unwrap(),
        "--seconds",
        "40",
        "--window-seconds",
        "20",
        "--probe-seconds",
        "5",
        "--sample-seconds",
        "4",
        "--engines",
        "8",
        "--capacity-blocks",
        "512",
        "--connections",
        "2",
    ]);
    let rows: Vec<Vec<f64>> = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .filter(|l| l.contains('-'))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .map(|x| x.parse().unwrap_or_else(|_| panic!("`{x}` in `{l}`")))
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), 2, "two windows:\n{out}");
    for row in &rows {
        // k block events/s, max lag, lookups/s, p50, p99, max, non-200, RSS MiB.
        assert!(
            row[0] > 0.0 && row[2] > 0.0,
            "a window without traffic:\n{out}"
        );
        assert_eq!(row[6], 0.0, "lookups refused:\n{out}");
        assert!(row[7] > 0.0, "{out}");
    }
    assert!(out.contains("stalls: 0"), "{out}");
    assert!(
        out.contains("log lines at warning level or above: 0"),
        "{out}"
    );
    assert!(out.contains("slope"), "{out}");
}
