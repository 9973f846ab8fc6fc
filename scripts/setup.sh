#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test kvindex, and makes sure the local
# NATS server (JetStream) that the integration tests talk to is running. Idempotent.
set -euo pipefail

missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
dpkg -s libzmq3-dev >/dev/null 2>&1 || missing+=(libzmq3-dev)
# librdkafka with TLS (the rdkafka crate's `ssl` feature) links the system OpenSSL.
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
# promtool (Prometheus's own checker) validates /metrics in the tests.
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# NATS with JetStream on 127.0.0.1:4222 (tests fail loudly without it).
if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  echo "setup: starting nats-server -js on 127.0.0.1:4222"
  nats=$(command -v nats-server || echo /usr/sbin/nats-server)
  mkdir -p /var/lib/nats-server 2>/dev/null || true
  start-stop-daemon --start --oknodo --background --exec "$nats" -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log \
    || (nohup "$nats" -a 127.0.0.1 -p 4222 -js -sd "${TMPDIR:-/tmp}/nats-js" >/dev/null 2>&1 &)
  for _ in $(seq 1 50); do
    (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && break
    sleep 0.2
  done
fi
