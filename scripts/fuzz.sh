#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for a while against its committed seed corpus.
#
#   scripts/fuzz.sh [seconds per target, default 30] [target ...]
#
# Installs what a fresh machine lacks (a nightly toolchain, cargo-fuzz). The targets link only
# the wire and config crates, so a cold build takes a minute or two and never compiles RocksDB.
# Neither crate has `unsafe`, so the targets build without AddressSanitizer (twice the
# executions per second) and with debug assertions (integer overflow panics). New inputs the run finds go
# to a scratch copy of the corpus, not into the repository; a crash or a hang leaves its input
# under fuzz/artifacts/<target>/ and fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
shift || true
targets=("$@")
((${#targets[@]})) || targets=(proto json vllm frames lookup_body config)

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
export CARGO_TARGET_DIR="${KVINDEX_FUZZ_TARGET_DIR:-$HOME/.cache/kvindex-fuzz}"
flags=(--fuzz-dir fuzz --sanitizer none --debug-assertions)

cargo +nightly fuzz build "${flags[@]}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
  mkdir -p "$scratch/$target"
  cp -r "fuzz/corpus/$target/." "$scratch/$target/"
  echo "fuzz: $target for ${seconds}s"
  log="$scratch/$target.log"
  if ! cargo +nightly fuzz run "${flags[@]}" "$target" "$scratch/$target" -- \
    -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $target failed; its input is under fuzz/artifacts/$target/" >&2
    exit 1
  fi
  grep -E '^(stat::number_of_executed_units|Done)' "$log" || true
done
