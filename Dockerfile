# syntax=docker/dockerfile:1
# kvindex container image. Multi-stage: the builder compiles the release binary (RocksDB and
# librdkafka are built from source by their crates, hence the C/C++ toolchain, libclang for
# bindgen, protoc for the event contract and OpenSSL's headers for librdkafka's TLS); the
# runtime is a slim Debian with the binary only.
#
#   docker build -t kvindex .          (or: docker compose build)
#
# A cold release build compiles RocksDB and librdkafka from source: expect tens of minutes on a
# small machine. The cache mounts keep the crate registry and target dir between builds.

FROM rust:1-bookworm AS builder
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      protobuf-compiler libclang-dev libssl-dev pkg-config g++ make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY proto ./proto
COPY wire ./wire
COPY config ./config
COPY src ./src
# Cargo.toml names the benches; the manifest does not parse without their files.
COPY benches ./benches
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kvindex \
 && install -m 0755 target/release/kvindex /usr/local/bin/kvindex

FROM debian:bookworm-slim
# libstdc++ (RocksDB, librdkafka), zlib and OpenSSL (librdkafka); curl for the healthcheck and for poking
# the API from inside the container.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libstdc++6 zlib1g libssl3 ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvindex \
 && useradd --system --uid 10001 --gid kvindex --home-dir /var/lib/kvindex --shell /usr/sbin/nologin kvindex \
 && mkdir -p /var/lib/kvindex /etc/kvindex \
 && chown kvindex:kvindex /var/lib/kvindex
COPY --from=builder /usr/local/bin/kvindex /usr/local/bin/kvindex
# The config is expected at /etc/kvindex/kvindex.toml (mount one, see deploy/); its data_dir
# should be /var/lib/kvindex, the volume. (Not set here as KVINDEX_DATA_DIR: the environment
# would override the mounted file.)
ENV KVINDEX_LOG=info
USER kvindex
WORKDIR /var/lib/kvindex
VOLUME ["/var/lib/kvindex"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8080/healthz >/dev/null || exit 1
ENTRYPOINT ["kvindex", "serve", "--config", "/etc/kvindex/kvindex.toml"]
