#!/usr/bin/env python3
"""Ingest harness: `kvindex produce` into a broker + `kvindex serve`, rates read
from `/v1/stats`.

  scripts/bench_ingest.py --bin BIN --source kafka --requests 20000
  scripts/bench_ingest.py --bin BIN --source nats  --requests 20000
  scripts/bench_ingest.py --bin BIN --source kafka --kafka-property fetch.wait.max.ms=500

kafka: `kvindex serve` runs its embedded broker (the librdkafka mock cluster, a real Kafka
protocol broker on loopback); the producer connects to the bootstrap address it prints.
nats:  `kvindex serve` consumes a fresh JetStream stream on 127.0.0.1:4222.

The durable path is the real one: every shard commits index rows and offsets to RocksDB
every 100 ms (the default `checkpoint.interval_ms`). The script samples `/v1/stats` every
0.25 s and reports block events applied per second (`events.block_ops`: memberships added or
removed) over the whole run, from the first applied event until every partition has caught
up, and the best 2-second window. It also reports the CPU time each side spent (the server's
from /proc, the producer's from its rusage) per block event: on a machine whose cores the
producer and the server share, that is the figure that compares two servers. Run with a
release binary.
"""

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request


def stats(http):
    with urllib.request.urlopen(f"http://{http}/v1/stats", timeout=10) as r:
        return json.load(r)


def caught_up(s):
    parts = s["sources"].get("partitions") or []
    if not parts:
        return False
    for p in parts:
        applied = p.get("applied_offset")
        if applied is None:
            applied = p.get("position", -1)
        if p.get("high_watermark", -1) < 0 or applied < p["high_watermark"]:
            return False
    return True


def start_serve(args, data, config):
    cmd = [args.bin, "serve", "--data-dir", data, "--listen", "127.0.0.1:0"]
    if config:
        cmd += ["--config", config]
    env = dict(os.environ, KVINDEX_LOG=os.environ.get("KVINDEX_LOG", "warn"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    bootstrap = http = None
    for line in proc.stdout:
        m = re.match(r"embedded Kafka broker on (\S+)", line)
        if m:
            bootstrap = m.group(1)
        m = re.match(r"kvindex listening on http://(\S+)", line)
        if m:
            http = m.group(1)
            break
    if http is None:
        sys.exit("kvindex serve did not start")
    return proc, bootstrap, http


def cpu_seconds(pid):
    """User + system CPU time of a running process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def delete_stream(url, stream):
    """Deletes a JetStream stream with the raw NATS protocol (no client library needed)."""
    import socket
    host, port = url.replace("nats://", "").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.recv(4096)  # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\nSUB _kvbench_reply 1\r\n')
        s.sendall(f"PUB $JS.API.STREAM.DELETE.{stream} _kvbench_reply 0\r\n\r\nPING\r\n".encode())
        reply = b""
        while b"MSG _kvbench_reply" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="kvindex binary (release)")
    ap.add_argument("--source", choices=["kafka", "nats"], default="kafka")
    ap.add_argument("--requests", type=int, default=20000, help="simulated requests to produce")
    ap.add_argument("--engines", type=int, default=32)
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--format", default="proto")
    ap.add_argument("--kafka-property", action="append", default=[], metavar="KEY=VALUE",
                    help="a librdkafka property for the server's consumer (repeatable)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvindex-bench-")
    data = os.path.join(tmp, "data")
    config = None
    stream = f"KVBENCH_{os.getpid()}"
    prefix = f"kvbench.{os.getpid()}"
    if args.source == "nats":
        config = os.path.join(tmp, "kvindex.toml")
        with open(config, "w") as f:
            f.write(
                f'[source]\nkind = "nats"\n[source.nats]\nurl = "{args.nats_url}"\n'
                f'stream = "{stream}"\nsubjects = ["{prefix}.>"]\ndurable = "kvindex"\n'
            )
    if args.source == "kafka" and args.kafka_property:
        config = os.path.join(tmp, "kvindex.toml")
        with open(config, "w") as f:
            f.write("[source.kafka.properties]\n")
            for prop in args.kafka_property:
                key, value = prop.split("=", 1)
                f.write(f'"{key}" = "{value}"\n')
    serve, bootstrap, http = start_serve(args, data, config)
    produce = [args.bin, "produce", "--requests", str(args.requests), "--engines", str(args.engines),
               "--format", args.format]
    if args.source == "kafka":
        produce += ["--kafka", bootstrap, "--topic", "kv-events"]
    else:
        produce += ["--nats", args.nats_url, "--stream", stream, "--subject-prefix", prefix]
    t0 = time.time()
    serve_cpu0 = cpu_seconds(serve.pid)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    producer = subprocess.Popen(produce, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples = []
    produced_at = None
    try:
        while True:
            s = stats(http)
            now = time.time()
            samples.append((now, s["events"]["block_ops"], s["events"]["applied_total"]))
            if produced_at is None and producer.poll() is not None:
                produced_at = now
            if produced_at is not None and caught_up(s) and s["sources"]["lag"] == 0:
                break
            if now - t0 > 1800:
                sys.exit("timed out")
            time.sleep(0.25)
    finally:
        out = producer.communicate()[0] if producer.poll() is not None else ""
    final = stats(http)
    serve_cpu = cpu_seconds(serve.pid) - serve_cpu0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    producer_cpu = (children.ru_utime + children.ru_stime) - (children0.ru_utime + children0.ru_stime)
    serve.terminate()
    serve.wait(timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)
    if args.source == "nats":
        delete_stream(args.nats_url, stream)

    first = next(i for i, x in enumerate(samples) if x[1] > 0)
    t_first, t_last = samples[first - 1 if first else 0][0], samples[-1][0]
    ops = samples[-1][1]
    best = 0.0
    for i in range(len(samples)):
        for j in range(i + 1, len(samples)):
            if samples[j][0] - samples[i][0] >= 2.0:
                best = max(best, (samples[j][1] - samples[i][1]) / (samples[j][0] - samples[i][0]))
                break
    print(f"source={args.source} requests={args.requests} engines={args.engines} format={args.format}"
          + "".join(f" {p}" for p in args.kafka_property))
    summary = [l for l in out.splitlines() if l.startswith('produced')]
    print(f"producer: {summary[-1] if summary else '(no summary)'}")
    print(f"applied: {final['events']['applied_total']} events, {ops} block events, "
          f"{final['index']['memberships']} memberships at end")
    print(f"duplicates skipped: {sum(p['duplicates_skipped'] for p in final['sources']['partitions'])}, "
          f"malformed: {final['events']['malformed']}")
    print(f"block events/s, first applied -> caught up ({t_last - t_first:.1f} s): {ops / (t_last - t_first):,.0f}")
    print(f"block events/s, best 2 s window: {best:,.0f}")
    print(f"CPU: server {serve_cpu:.2f} s ({serve_cpu / ops * 1e6:.3f} us per block event), "
          f"producer {producer_cpu:.2f} s")


if __name__ == "__main__":
    main()
