#!/usr/bin/env python3
"""Emit vLLM-shaped spans with the official OpenTelemetry Python SDK to an OTLP/HTTP endpoint.

Used by crates/tokenscope-otlp/tests/otel_python.rs; the venv comes from
crates/tokenscope-otlp/scripts/install-python-otel.sh.

The spans are made the way vLLM makes its per-request span (vllm/v1/engine/output_processor.py,
OutputProcessor.do_tracing, attribute names from SpanAttributes in vllm/tracing.py): the parent
context is extracted from a W3C `traceparent` with TraceContextTextMapPropagator, the span is
`llm_request` of kind SERVER started at the request's arrival time, and each attribute is set
with span.set_attribute (Python float -> doubleValue, int -> intValue, str -> stringValue).
The spans to make are read from a JSON fixture (name, arrival offset, [key, value] pairs).

Each --variant sends all finished spans in one export request:
  protobuf       OTLPSpanExporter (opentelemetry-exporter-otlp-proto-http), no compression
  protobuf-gzip  the same exporter with Compression.Gzip
  json           OTLP/JSON: the SDK's own protobuf encoding (encode_spans) turned into JSON by
                 google.protobuf.json_format with enums as integers, then trace/span ids turned
                 from base64 (protobuf's JSON mapping for bytes) into hex (OTLP/JSON), POSTed
                 with urllib
  json-gzip      the same, gzip-compressed with Content-Encoding: gzip

Prints one JSON object on stdout: the trace id, the spans made (ids as hex) and, per variant,
the HTTP outcome. Exits non-zero if any export fails.
"""

import argparse
import base64
import gzip
import json
import sys
import time
import urllib.request

import requests
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

VARIANTS = ("protobuf", "protobuf-gzip", "json", "json-gzip")


def make_spans(fixture, traceparent):
    """Finished SDK spans, made like vLLM's do_tracing, kept in memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": fixture["service_name"]})
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(fixture["scope"])
    context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    now_ns = time.time_ns()
    for spec in fixture["spans"]:
        arrival_ns = now_ns + int(spec["arrival_offset_ms"]) * 1_000_000
        with tracer.start_as_current_span(
            spec["name"],
            kind=SpanKind.SERVER,
            context=context,
            start_time=arrival_ns,
        ) as span:
            for key, value in spec["attributes"]:
                span.set_attribute(key, value)
    provider.shutdown()
    return memory.get_finished_spans()


def ids_to_hex(node):
    """protobuf's JSON mapping writes bytes as base64; OTLP/JSON wants trace/span ids in hex."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                ids_to_hex(value)
    elif isinstance(node, list):
        for item in node:
            ids_to_hex(item)


def otlp_json(spans):
    message = encode_spans(spans)
    body = json_format.MessageToDict(message, use_integers_for_enums=True)
    ids_to_hex(body)
    return json.dumps(body).encode("utf-8")


def send_protobuf(endpoint, spans, compress):
    session = requests.Session()
    session.trust_env = False  # loopback only: never through a proxy from the environment
    exporter = OTLPSpanExporter(
        endpoint=endpoint,
        compression=Compression.Gzip if compress else Compression.NoCompression,
        session=session,
        timeout=10,
    )
    try:
        result = exporter.export(spans)
    finally:
        exporter.shutdown()
    return {"ok": result == SpanExportResult.SUCCESS, "result": result.name}


def send_json(endpoint, spans, compress):
    body = otlp_json(spans)
    headers = {"Content-Type": "application/json"}
    if compress:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            status = response.status
            text = response.read().decode("utf-8")
    except urllib.error.HTTPError as err:
        status = err.code
        text = err.read().decode("utf-8", "replace")
    return {"ok": status == 200, "status": status, "response": text}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="e.g. http://127.0.0.1:4318/v1/traces")
    parser.add_argument("--traceparent", required=True, help="W3C traceparent of the parent span")
    parser.add_argument("--fixture", required=True, help="JSON file describing the spans")
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS, help="repeatable; default: all"
    )
    parser.add_argument(
        "--print-json", action="store_true", help="print the OTLP/JSON body and exit"
    )
    args = parser.parse_args()

    with open(args.fixture, encoding="utf-8") as f:
        fixture = json.load(f)
    spans = make_spans(fixture, args.traceparent)
    if args.print_json:
        print(json.dumps(json.loads(otlp_json(spans)), indent=2))
        return 0

    report = {
        "trace_id": format(spans[0].context.trace_id, "032x") if spans else None,
        "spans": [
            {
                "name": s.name,
                "span_id": format(s.context.span_id, "016x"),
                "parent_span_id": format(s.parent.span_id, "016x") if s.parent else None,
            }
            for s in spans
        ],
        "variants": [],
    }
    for variant in args.variant or VARIANTS:
        compress = variant.endswith("-gzip")
        if variant.startswith("protobuf"):
            outcome = send_protobuf(args.endpoint, spans, compress)
        else:
            outcome = send_json(args.endpoint, spans, compress)
        outcome["variant"] = variant
        report["variants"].append(outcome)
    print(json.dumps(report))
    return 0 if all(v["ok"] for v in report["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
