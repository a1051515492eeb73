#!/usr/bin/env bash
# Installs the official OpenTelemetry Python SDK and OTLP/HTTP + OTLP/gRPC exporters into a venv
# used by
#   * crates/tokenscope-otlp/tests/otel_python.rs (via tests/emit_spans.py), and
#   * the trace export tests of tokenscope-trace / tokenscope-cli, through the independent OTLP
#     receiver crates/tokenscope-trace/tests/otlp_receiver.py (opentelemetry-proto's generated
#     classes, grpcio for OTLP/gRPC).
#
#   venv: ${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/otel-venv
#
# Idempotent: a venv that already imports the pinned versions is left alone. Needs python3 with
# the venv module and access to PyPI. Run it before `cargo test` with
# TOKENSCOPE_REQUIRE_OTEL_PY=1 (CI), otherwise the test skips when the venv is missing.
set -euo pipefail

OTEL_VERSION="1.45.2"
CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
VENV="$CACHE/otel-venv"
PY="$VENV/bin/python"

check() {
    [ -x "$PY" ] && "$PY" - "$OTEL_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
want = sys.argv[1]
for dist in (
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-proto",
):
    if version(dist) != want:
        sys.exit(1)
import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
import opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc  # noqa: F401
import grpc  # noqa: F401
import opentelemetry.exporter.otlp.proto.common.trace_encoder  # noqa: F401
import google.protobuf.json_format  # noqa: F401
PYEOF
}

if check; then
    echo "otel venv ready: $VENV (opentelemetry $OTEL_VERSION)"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "error: $PYTHON not found" >&2; exit 1; }
mkdir -p "$CACHE"
if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$PY" -m pip install --quiet --disable-pip-version-check \
    "opentelemetry-api==$OTEL_VERSION" \
    "opentelemetry-sdk==$OTEL_VERSION" \
    "opentelemetry-exporter-otlp-proto-http==$OTEL_VERSION" \
    "opentelemetry-exporter-otlp-proto-grpc==$OTEL_VERSION"

if check; then
    echo "otel venv ready: $VENV (opentelemetry $OTEL_VERSION)"
else
    echo "error: otel venv at $VENV does not import the expected packages" >&2
    exit 1
fi
