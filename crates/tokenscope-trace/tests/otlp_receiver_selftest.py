#!/usr/bin/env python3
"""Self-check of `otlp_receiver.py`, with the official OpenTelemetry Python SDK as the sender.

Starts the receiver as a subprocess for each protocol, exports spans with the SDK's OTLP/HTTP
and OTLP/gRPC exporters, and checks the JSON lines it writes (ids, parent, attributes of each
type, an event, status, resource, scope, flags). Also checks the HTTP edge cases on one kept-alive
connection (gzip, 415, 400, 404), `--fail-first` (503 / UNAVAILABLE, then the SDK's retry is
recorded once), `--delay-ms`, and a clean exit on SIGTERM.

    "${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/otel-venv/bin/python" \\
        crates/tokenscope-trace/tests/otlp_receiver_selftest.py

Exits 0 and prints `OK` when everything holds; a failed check raises with a message.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for var in list(os.environ):
    if var.startswith("OTEL_"):
        del os.environ[var]
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: E402
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: E402
    OTLPSpanExporter as HttpExporter,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import (  # noqa: E402
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

RECEIVER = Path(__file__).with_name("otlp_receiver.py")
CALLER_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN_ID = 0xB7AD6B7169203331


class Receiver:
    def __init__(self, protocol: str, out: Path, *extra: str) -> None:
        self.protocol = protocol
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(RECEIVER), "--protocol", protocol, "--out", str(out), *extra],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("LISTENING "), f"first stdout line {line!r}"
        self.port = int(line.split()[1])
        assert self.port > 0

    def lines(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=10)
        assert rc == 0, f"{self.protocol} receiver exited with {rc} on SIGTERM"
        rest = self.proc.stdout.read() if self.proc.stdout else ""
        assert rest == "", f"unexpected stdout after LISTENING: {rest!r}"


def make_spans() -> list:
    """A SERVER root continuing a remote caller (with tracestate) and an INTERNAL child."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": "selftest", "service.instance.id": "i-1"})
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("selftest.scope", "9.9.9")
    caller = SpanContext(
        trace_id=CALLER_TRACE_ID,
        span_id=CALLER_SPAN_ID,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "v1")]),
    )
    parent_ctx = trace.set_span_in_context(NonRecordingSpan(caller))
    with tracer.start_as_current_span(
        "chat llama-3-8b", context=parent_ctx, kind=SpanKind.SERVER
    ) as root:
        root.set_attribute("gen_ai.request.model", "llama-3-8b")
        root.set_attribute("gen_ai.usage.input_tokens", 128)
        root.set_attribute("ratio", 0.25)
        root.set_attribute("stream", True)
        root.set_attribute("gen_ai.response.finish_reasons", ["stop", "length"])
        root.set_attribute("ints", [1, 2, 3])
        root.add_event("first_token", {"tokens": 1, "note": "ttft"})
        with tracer.start_as_current_span("upstream", kind=SpanKind.CLIENT) as child:
            child.set_attribute("server.port", 8000)
        root.set_status(Status(StatusCode.ERROR, "upstream_error"))
    provider.shutdown()
    spans = memory.get_finished_spans()
    assert [s.name for s in spans] == ["upstream", "chat llama-3-8b"]
    return list(spans)


def check_lines(protocol: str, lines: list[dict], spans: list) -> None:
    assert len(lines) == 2, f"{protocol}: {len(lines)} lines: {lines}"
    by_name = {x["name"]: x for x in lines}
    root, child = by_name["chat llama-3-8b"], by_name["upstream"]
    sdk_root = next(s for s in spans if s.name == "chat llama-3-8b")
    sdk_child = next(s for s in spans if s.name == "upstream")
    trace_hex = f"{CALLER_TRACE_ID:032x}"
    for x in lines:
        assert x["protocol"] == protocol
        assert x["trace_id"] == trace_hex, x["trace_id"]
        assert x["resource"]["service.name"] == "selftest"
        assert x["resource"]["service.instance.id"] == "i-1"
        assert x["scope"] == "selftest.scope" and x["scope_version"] == "9.9.9"
        assert x["links"] == 0
        assert 0 < x["start_ns"] <= x["end_ns"]
    assert root["span_id"] == f"{sdk_root.context.span_id:016x}"
    assert root["parent_span_id"] == f"{CALLER_SPAN_ID:016x}"
    assert child["span_id"] == f"{sdk_child.context.span_id:016x}"
    assert child["parent_span_id"] == root["span_id"]
    assert root["kind"] == trace_pb2.Span.SPAN_KIND_SERVER == 2
    assert child["kind"] == trace_pb2.Span.SPAN_KIND_CLIENT == 3
    assert root["attributes"] == {
        "gen_ai.request.model": "llama-3-8b",
        "gen_ai.usage.input_tokens": 128,
        "ratio": 0.25,
        "stream": True,
        "gen_ai.response.finish_reasons": ["stop", "length"],
        "ints": [1, 2, 3],
    }, root["attributes"]
    assert isinstance(root["attributes"]["gen_ai.usage.input_tokens"], int)
    assert isinstance(root["attributes"]["ratio"], float)
    assert child["attributes"] == {"server.port": 8000}
    assert len(root["events"]) == 1
    ev = root["events"][0]
    assert ev["name"] == "first_token" and ev["attributes"] == {"tokens": 1, "note": "ttft"}
    assert root["start_ns"] <= ev["time_ns"] <= root["end_ns"]
    assert root["status_code"] == trace_pb2.Status.STATUS_CODE_ERROR == 2
    assert root["status_message"] == "upstream_error"
    assert child["status_code"] == 0 and child["status_message"] == ""
    assert root["trace_state"] == "vendor=v1" and child["trace_state"] == "vendor=v1"
    # SpanFlags: 0x100 = "has is_remote", 0x200 = parent is remote.
    assert root["flags"] == 0x300 and child["flags"] == 0x100, (root["flags"], child["flags"])


def wait_lines(rx: Receiver, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        lines = rx.lines()
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def request_bytes(name: str) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id = bytes(range(16))
    span.span_id = bytes(range(8))
    span.name = name
    attr = span.attributes.add()
    attr.key = "raw"
    attr.value.bytes_value = b"\x00\xff"
    kv = span.attributes.add()
    kv.key = "kv"
    inner = kv.value.kvlist_value.values.add()
    inner.key = "a"
    inner.value.int_value = -5
    return req.SerializeToString()


def post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict) -> tuple:
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, resp.getheader("Content-Type"), data


def http_edge_cases(tmp: Path) -> None:
    rx = Receiver("http", tmp / "edge.jsonl")
    pb = {"Content-Type": "application/x-protobuf"}
    conn = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=10)
    status, ctype, data = post(conn, "/v1/traces", request_bytes("plain"), pb)
    assert (status, ctype) == (200, "application/x-protobuf"), (status, ctype)
    trace_service_pb2.ExportTraceServiceResponse().ParseFromString(data)
    gz = {**pb, "Content-Encoding": "gzip"}
    assert post(conn, "/v1/traces", gzip.compress(request_bytes("gzipped")), gz)[0] == 200
    json_ct = {"Content-Type": "application/json"}
    assert post(conn, "/v1/traces", b"{}", json_ct)[0] == 415
    assert post(conn, "/v1/traces", b"\xff\xff\xff\xff", pb)[0] == 400
    assert post(conn, "/v1/traces", b"not gzip", gz)[0] == 400
    assert post(conn, "/v1/metrics", request_bytes("wrong path"), pb)[0] == 404
    conn.request("GET", "/nope")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 404
    # Still the same connection after all the errors (keep-alive stayed in sync).
    sock = conn.sock
    assert post(conn, "/v1/traces", request_bytes("again"), pb)[0] == 200
    assert conn.sock is sock, "the receiver closed a kept-alive connection"
    conn.close()
    lines = wait_lines(rx, 3)
    assert [x["name"] for x in lines] == ["plain", "gzipped", "again"], lines
    assert lines[0]["attributes"] == {"raw": "00ff", "kv": {"a": -5}}
    assert lines[0]["parent_span_id"] == "" and lines[0]["trace_id"] == bytes(range(16)).hex()
    rx.stop()

    # --fail-first 1: the first export call gets 503 and is not recorded; the next one is.
    rx = Receiver("http", tmp / "fail.jsonl", "--fail-first", "1")
    conn = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=10)
    assert post(conn, "/v1/traces", b"\xff", {"Content-Type": "text/plain"})[0] == 415
    status, _, _ = post(conn, "/v1/traces", request_bytes("first"), pb)
    assert status == 503, status
    assert post(conn, "/v1/traces", request_bytes("second"), pb)[0] == 200
    conn.close()
    assert [x["name"] for x in wait_lines(rx, 1)] == ["second"]
    rx.stop()

    # --delay-ms: the answer waits.
    rx = Receiver("http", tmp / "delay.jsonl", "--delay-ms", "300")
    conn = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=10)
    t0 = time.monotonic()
    assert post(conn, "/v1/traces", request_bytes("slow"), pb)[0] == 200
    assert time.monotonic() - t0 >= 0.3
    conn.close()
    rx.stop()
    print("http edge cases: ok (gzip, 415, 400, 404, keep-alive, --fail-first 503, --delay-ms)")


def sdk_export(protocol: str, tmp: Path, spans: list, *extra: str) -> list[dict]:
    rx = Receiver(protocol, tmp / f"{protocol}{'-'.join(extra)}.jsonl", *extra)
    if protocol == "http":
        exporter = HttpExporter(
            endpoint=f"http://127.0.0.1:{rx.port}/v1/traces",
            compression=Compression.Gzip,
            timeout=10,
        )
    else:
        exporter = GrpcExporter(
            endpoint=f"127.0.0.1:{rx.port}",
            insecure=True,
            timeout=10,
            channel_options=(("grpc.enable_http_proxy", 0),),
        )
    result = exporter.export(spans)
    exporter.shutdown()
    assert result == SpanExportResult.SUCCESS, f"{protocol} {extra}: export {result}"
    lines = wait_lines(rx, len(spans))
    rx.stop()
    return lines


def main() -> int:
    spans = make_spans()
    with tempfile.TemporaryDirectory(prefix="otlp-rx-selftest-") as d:
        tmp = Path(d)
        http_edge_cases(tmp)
        for protocol in ("http", "grpc"):
            check_lines(protocol, sdk_export(protocol, tmp, spans), spans)
            print(f"{protocol}: SDK exporter → receiver: ok")
            # The SDK retries the refused first call; the spans are recorded exactly once.
            t0 = time.monotonic()
            lines = sdk_export(protocol, tmp, spans, "--fail-first", "1")
            check_lines(protocol, lines, spans)
            print(f"{protocol}: --fail-first 1, SDK retry recorded once: ok "
                  f"({time.monotonic() - t0:.1f}s)")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
