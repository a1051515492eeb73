#!/usr/bin/env bash
# Installs clickhouse-server and clickhouse-client (Debian packages) when missing, for the
# ClickHouse store's tests (crates/tokenscope-clickhouse) and the CLI's ClickHouse tests.
# Idempotent: does nothing when a server binary is already there. The tests start their own
# servers on free loopback ports (never the packaged service), so the service the package may
# start is stopped again.
#
# Debian 12 ships 18.16 (the oldest dialect tokenscope supports); newer servers from
# ClickHouse's own repository work too — point TOKENSCOPE_CLICKHOUSE_SERVER at the binary.
set -euo pipefail

have_server() {
  [ -n "${TOKENSCOPE_CLICKHOUSE_SERVER:-}" ] && [ -x "$TOKENSCOPE_CLICKHOUSE_SERVER" ] && return 0
  command -v clickhouse-server >/dev/null 2>&1 && return 0
  [ -x /usr/sbin/clickhouse-server ] || [ -x /usr/bin/clickhouse-server ]
}

if have_server; then
  echo "clickhouse-server already installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "no apt-get: install clickhouse-server yourself and set TOKENSCOPE_CLICKHOUSE_SERVER" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clickhouse-server clickhouse-client >/dev/null
# The package may start a system server we do not need (and that holds ports 8123/9000).
($SUDO systemctl stop clickhouse-server 2>/dev/null || $SUDO service clickhouse-server stop 2>/dev/null || true) >/dev/null 2>&1
have_server && echo "clickhouse-server installed: $(clickhouse-server --help 2>&1 | head -1 || true)"
