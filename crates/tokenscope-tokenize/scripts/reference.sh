#!/usr/bin/env bash
# Regenerates (or, with --check, verifies) tests/fixtures/reference_counts.json from the live
# reference implementations: Python `tiktoken` and Python `tokenizers`.
#
#   scripts/reference.sh           rewrite the committed JSON
#   scripts/reference.sh --check   generate into a temp file and fail if it differs from the
#                                  committed JSON (CI can run this so the Rust comparison in
#                                  tests/reference.rs is against a live reference)
#
# What it sets up (all under $TOKENSCOPE_CACHE, default $HOME/.cache/tokenscope):
#   tokenize-venv/    a venv with the pinned Python references (from PyPI)
#   tiktoken-cache/   the cl100k/o200k rank files that the Rust crate tiktoken-rs ships, named as
#                     Python tiktoken's load.py expects (sha1 hex of the blob URL), so tiktoken
#                     never goes to the network; it verifies their SHA-256 itself
#   tokenizers/       the Hugging Face fixture (scripts/fetch-fixtures.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
PYTHON="${PYTHON:-python3}"
VENV="$CACHE/tokenize-venv"
TIKTOKEN_VERSION="0.14.0"
TOKENIZERS_VERSION="0.23.3"
CHECK=0
[ "${1:-}" = "--check" ] && CHECK=1

TOKENSCOPE_CACHE="$CACHE" PYTHON="$PYTHON" bash scripts/fetch-fixtures.sh

if ! "$VENV/bin/python" -c "import tiktoken, tokenizers; assert tiktoken.__version__ == '$TIKTOKEN_VERSION' and tokenizers.__version__ == '$TOKENIZERS_VERSION'" 2>/dev/null; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "tiktoken==$TIKTOKEN_VERSION" "tokenizers==$TOKENIZERS_VERSION"
fi

# Where cargo unpacked tiktoken-rs (the version this workspace resolves).
ASSETS="$(cargo metadata --format-version 1 2>/dev/null | "$PYTHON" -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "tiktoken-rs":
        print(os.path.join(os.path.dirname(p["manifest_path"]), "assets"))
        break
')"
if [ -z "$ASSETS" ] || [ ! -d "$ASSETS" ]; then
  echo "tiktoken-rs sources not found (run cargo fetch first)" >&2
  exit 1
fi

export TIKTOKEN_CACHE_DIR="$CACHE/tiktoken-cache"
mkdir -p "$TIKTOKEN_CACHE_DIR"
for enc in cl100k_base o200k_base; do
  key="$("$PYTHON" -c "import hashlib,sys; print(hashlib.sha1(sys.argv[1].encode()).hexdigest())" \
    "https://openaipublic.blob.core.windows.net/encodings/$enc.tiktoken")"
  cp "$ASSETS/$enc.tiktoken" "$TIKTOKEN_CACHE_DIR/$key"
done

HF="$CACHE/tokenizers/deepseek_tokenizer.json"
COMMITTED="tests/fixtures/reference_counts.json"
if [ "$CHECK" = 1 ]; then
  OUT="$(mktemp)"
  trap 'rm -f "$OUT"' EXIT
  "$VENV/bin/python" tests/gen_reference.py --hf "$HF" --out "$OUT"
  if ! diff -q "$COMMITTED" "$OUT" >/dev/null; then
    diff "$COMMITTED" "$OUT" | head -n 20 >&2
    echo "live reference differs from $COMMITTED" >&2
    exit 1
  fi
  echo "live reference matches $COMMITTED"
else
  "$VENV/bin/python" tests/gen_reference.py --hf "$HF" --out "$COMMITTED"
fi
