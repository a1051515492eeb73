#!/usr/bin/env bash
# Installs what the dashboard's browser tests need:
#   * Debian's chromium and chromium-driver (headless Chromium driven over WebDriver), and
#   * Selenium (PyPI) in a venv: ${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/browser-venv.
# Used by crates/tokenscope-cli/tests/dashboard.rs through tests/dashboard_browser.py.
#
# Idempotent: an installed chromium/chromedriver and a venv that imports the pinned Selenium are
# left alone. Run it before `cargo test` with TOKENSCOPE_REQUIRE_BROWSER=1 (CI); otherwise the
# test skips when a part is missing.
set -euo pipefail

SELENIUM_VERSION="4.27.1"
CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
VENV="$CACHE/browser-venv"
PY="$VENV/bin/python"

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "no apt-get: install chromium and chromedriver yourself" >&2
    exit 1
  fi
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi

check() {
  [ -x "$PY" ] && "$PY" -c "import selenium, sys; sys.exit(selenium.__version__ != '$SELENIUM_VERSION')" >/dev/null 2>&1
}
if ! check; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "selenium==$SELENIUM_VERSION"
  check
fi
echo "chromium: $(chromium --version 2>/dev/null | head -1); chromedriver: $(chromedriver --version | head -1); selenium $SELENIUM_VERSION in $VENV"
