#!/usr/bin/env bash
# Installs PyPI's chdb (a current ClickHouse engine, 26.x, embedded as a library) into a venv
# in the cache OUTSIDE the clone, for the tests that run every ClickHouse statement tokenscope
# issues on a modern engine (scripts/chdb-http.py puts ClickHouse's HTTP interface in front of
# it). Idempotent: a second run with everything in place only prints the env file.
#
#   TOKENSCOPE_CACHE   cache root (default: $HOME/.cache/tokenscope)
#   CHDB_VERSION       the chdb release (default 4.4.0, engine 26.9)
#
# On success prints (and writes to $TOKENSCOPE_CACHE/chdb.env, sourceable):
#   CHDB_PYTHON=<venv python>   runs scripts/chdb-http.py
# ~2 min and ~0.9 GB (chdb-core is one 550 MB library; pandas and pyarrow come with it).
set -euo pipefail
CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
VERSION="${CHDB_VERSION:-4.4.0}"
VENV="$CACHE/chdb-venv"
ENVFILE="$CACHE/chdb.env"
STAMP="$VENV/.tokenscope-chdb-$VERSION"
mkdir -p "$CACHE"
if [ -f "$ENVFILE" ] && [ -f "$STAMP" ]; then
  cat "$ENVFILE"
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" --disable-pip-version-check --no-input install --quiet "chdb==$VERSION"
"$VENV/bin/python" -c 'from chdb import session; import sys; s = session.Session(); print("chdb engine", s.query("SELECT version()", "TSV").bytes().decode().strip(), file=sys.stderr)'
touch "$STAMP"
printf 'CHDB_PYTHON=%s\n' "$VENV/bin/python" | tee "$ENVFILE"
