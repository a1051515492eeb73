#!/usr/bin/env bash
# Puts the Hugging Face tokenizer fixture used by tests/reference.rs into the cache:
#   $TOKENSCOPE_CACHE/tokenizers/deepseek_tokenizer.json   (+ its MIT licence)
#
# The file (4.3 MB, too large to commit) is shipped inside the PyPI package `litellm`
# (litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json, MIT, (c) DeepSeek). We download
# only the wheel (`pip download --no-deps`, nothing is installed) and extract the one file with
# Python's zipfile. Its SHA-256 is pinned: the committed reference counts were produced from
# exactly these bytes, so a different file fails here instead of failing the comparison later.
#
# Idempotent: does nothing when the cached file already has the pinned hash.
# Environment: TOKENSCOPE_CACHE (default $HOME/.cache/tokenscope), PYTHON (default python3).
set -euo pipefail

CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
PYTHON="${PYTHON:-python3}"
DEST="$CACHE/tokenizers"
FILE="$DEST/deepseek_tokenizer.json"
SHA256="4607b3d1929c5ca263a81d7153c6d6ecdbc71c9e933c0fb2df2abf181bf6df61"
# The version the hash was taken from; newer versions are tried if the registry no longer has it.
LITELLM_VERSION="1.110.2"

have() { [ -f "$FILE" ] && [ "$(sha256sum "$FILE" | cut -d' ' -f1)" = "$SHA256" ]; }

if have; then
  echo "fixture present: $FILE"
  exit 0
fi

mkdir -p "$DEST"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "litellm==$LITELLM_VERSION"; then
  echo "litellm==$LITELLM_VERSION not available; trying the newest litellm" >&2
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" litellm
fi

"$PYTHON" - "$TMP" "$DEST" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(tmp, "litellm-*.whl"))
if not wheels:
    sys.exit("no litellm wheel was downloaded")
prefix = "litellm/litellm_core_utils/tokenizers/"
with zipfile.ZipFile(wheels[0]) as z:
    for name in ("deepseek_tokenizer.json", "deepseek_tokenizer_LICENSE"):
        data = z.read(prefix + name)
        part = os.path.join(dest, name + ".part")
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, os.path.join(dest, name))
print("extracted from", os.path.basename(wheels[0]))
PY

if ! have; then
  echo "deepseek_tokenizer.json does not have the pinned SHA-256 $SHA256" >&2
  echo "(the reference counts in tests/fixtures/reference_counts.json must be regenerated" >&2
  echo " with scripts/reference.sh after checking the new file)" >&2
  exit 1
fi
echo "fixture ready: $FILE"
