#!/usr/bin/env python3
"""An independent OTLP trace receiver (OTLP/HTTP protobuf and OTLP/gRPC) for tests.

Used by the trace export tests of tokenscope-trace and tokenscope-cli (through
`tests/common/receiver.rs`) to check what tokenscope's exporter really sends. It decodes with the
official generated classes of the PyPI package `opentelemetry-proto`
(`ExportTraceServiceRequest`, `TraceServiceServicer`) and serves gRPC with `grpcio`, so the Rust
code is checked against the reference schema, not against a decoder of our own. Runs in the venv
made by `crates/tokenscope-otlp/scripts/install-python-otel.sh`.

    otlp_receiver.py --protocol http|grpc --out FILE [--port N] [--fail-first N] [--delay-ms N]
                     [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] [--require-header K=V]

* prints exactly one line `LISTENING <port>` on stdout once bound to 127.0.0.1 (port 0 =
  ephemeral); everything else goes to stderr;
* HTTP: `POST /v1/traces`, `Content-Type: application/x-protobuf` (optionally
  `Content-Encoding: gzip`) → 200 with an `ExportTraceServiceResponse`; 415 for another content
  type or encoding, 400 for an undecodable body, 404 for another path, 405 for another method.
  HTTP/1.1 keep-alive (every response has a Content-Length). Error bodies are `google.rpc.Status`
  messages, as the OTLP specification asks;
* gRPC: `opentelemetry.proto.collector.trace.v1.TraceService/Export`;
* `--fail-first N`: the first N export calls get HTTP 503 / gRPC UNAVAILABLE and are not
  recorded (to test the exporter's retries); `--delay-ms N`: sleep before answering each call;
* every span of a recorded call becomes one JSON line appended to `--out` (keys: protocol,
  resource, scope, scope_version, trace_id, span_id, parent_span_id, name, kind, start_ns,
  end_ns, attributes, events, links, status_code, status_message, trace_state, flags). One
  call's lines are written with one write and then flushed, under a lock; a concurrent reader
  can at worst see a trailing partial line, never lines of a call interleaved with another's;
* `--tls-cert` / `--tls-key`: serve HTTPS / gRPC over TLS with that certificate (Python's `ssl`
  module and grpcio's own TLS: stacks independent of the exporter's); `--tls-client-ca`: also
  require a client certificate signed by that CA (mutual TLS);
* `--require-header NAME=VALUE`: a call without that header (gRPC: metadata) is refused with
  401 / UNAUTHENTICATED and not recorded (checks that configured headers arrive);
* SIGTERM / SIGINT: stops serving and exits with status 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import sys
import threading
import time
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

try:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
except ImportError as e:  # pragma: no cover - environment problem
    sys.stderr.write(
        f"otlp_receiver: cannot import opentelemetry-proto ({e}); run "
        "crates/tokenscope-otlp/scripts/install-python-otel.sh and use its venv python\n"
    )
    sys.exit(3)

try:
    from google.rpc import code_pb2, status_pb2
except ImportError:  # googleapis-common-protos comes with the OTLP exporters; optional here
    code_pb2 = None
    status_pb2 = None

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
MAX_BODY = 64 * 1024 * 1024


def log(msg: str) -> None:
    sys.stderr.write(f"otlp_receiver: {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Conversion of the decoded request to JSON lines
# ---------------------------------------------------------------------------------------------


def any_value(v: Any) -> Any:
    """Maps an `AnyValue` to a JSON value (bytes → lowercase hex, unset → None)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return int(v.int_value)
    if which == "double_value":
        return float(v.double_value)
    if which == "bool_value":
        return bool(v.bool_value)
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if which == "bytes_value":
        return bytes(v.bytes_value).hex()
    log(f"unknown AnyValue field {which!r}; recorded as null")
    return None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def span_lines(protocol: str, req: Any) -> list[str]:
    lines = []
    for rs in req.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                obj = {
                    "protocol": protocol,
                    "resource": resource,
                    "scope": ss.scope.name,
                    "scope_version": ss.scope.version,
                    "trace_id": bytes(span.trace_id).hex(),
                    "span_id": bytes(span.span_id).hex(),
                    "parent_span_id": bytes(span.parent_span_id).hex(),
                    "name": span.name,
                    "kind": int(span.kind),
                    "start_ns": int(span.start_time_unix_nano),
                    "end_ns": int(span.end_time_unix_nano),
                    "attributes": attributes(span.attributes),
                    "events": [
                        {
                            "name": ev.name,
                            "time_ns": int(ev.time_unix_nano),
                            "attributes": attributes(ev.attributes),
                        }
                        for ev in span.events
                    ],
                    "links": len(span.links),
                    "status_code": int(span.status.code),
                    "status_message": span.status.message,
                    "trace_state": span.trace_state,
                    "flags": int(span.flags),
                }
                lines.append(json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n")
    return lines


class Recorder:
    """Appends one call's spans at once; counts calls for `--fail-first`; applies `--delay-ms`."""

    def __init__(
        self, out: str, fail_first: int, delay_ms: int, require: tuple[str, str] | None = None
    ) -> None:
        self.require = require
        try:
            self._fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise SystemExit(f"otlp_receiver: cannot open --out {out}: {e}") from e
        self._lock = threading.Lock()
        self._fail_left = fail_first
        self._delay = delay_ms / 1000.0
        self.calls = 0
        self.spans = 0

    def before_answer(self) -> bool:
        """Sleeps the configured delay; True when this call must fail (one of the first N)."""
        if self._delay > 0:
            time.sleep(self._delay)
        with self._lock:
            self.calls += 1
            if self._fail_left > 0:
                self._fail_left -= 1
                return True
            return False

    def record(self, protocol: str, req: Any) -> int:
        lines = span_lines(protocol, req)
        if not lines:
            return 0
        blob = "".join(lines).encode("utf-8")
        with self._lock:
            view = memoryview(blob)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            self.spans += len(lines)
        return len(lines)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)


# ---------------------------------------------------------------------------------------------
# OTLP/HTTP
# ---------------------------------------------------------------------------------------------


def status_body(code: int, message: str) -> tuple[bytes, str]:
    """A `google.rpc.Status` (protobuf) when available, else plain text."""
    if status_pb2 is not None:
        return status_pb2.Status(code=code, message=message).SerializeToString(), PROTOBUF
    return message.encode("utf-8"), "text/plain; charset=utf-8"


def make_handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    def rpc_code(name: str) -> int:
        return int(getattr(code_pb2, name)) if code_pb2 is not None else 0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "tokenscope-otlp-test-receiver"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
            log(f"http {self.address_string()} {format % args}")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def _error(self, status: int, code: str, message: str) -> None:
            body, ctype = status_body(rpc_code(code), message)
            self._send(status, body, ctype)

        def _read_body(self) -> bytes | None:
            """Reads the whole body (Content-Length or chunked); None after answering an error."""
            te = self.headers.get("Transfer-Encoding", "")
            if "chunked" in te.lower():
                chunks = []
                total = 0
                while True:
                    line = self.rfile.readline(65537)
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        self.close_connection = True
                        self._error(400, "INVALID_ARGUMENT", "bad chunk size line")
                        return None
                    if size == 0:
                        # trailers, up to the empty line
                        while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    total += size
                    if total > MAX_BODY:
                        self.close_connection = True
                        self._error(413, "RESOURCE_EXHAUSTED", "body too large")
                        return None
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline(3)  # CRLF after the chunk
                return b"".join(chunks)
            length = self.headers.get("Content-Length")
            if length is None:
                return b""
            try:
                n = int(length)
            except ValueError:
                self.close_connection = True
                self._error(400, "INVALID_ARGUMENT", f"bad Content-Length {length!r}")
                return None
            if n < 0 or n > MAX_BODY:
                self.close_connection = True
                self._error(413, "RESOURCE_EXHAUSTED", f"body of {n} bytes refused")
                return None
            return self.rfile.read(n)

        def _not_found(self) -> None:
            # Consume any body so that the kept-alive connection stays in sync.
            if self._read_body() is None:
                return
            if self.path.split("?", 1)[0] == TRACES_PATH:
                self._error(405, "UNIMPLEMENTED", f"{self.command} not allowed on {TRACES_PATH}")
            else:
                self._error(404, "NOT_FOUND", f"no route {self.command} {self.path}")

        do_GET = do_PUT = do_DELETE = do_PATCH = _not_found  # noqa: N815

        def do_POST(self) -> None:  # noqa: N802 (stdlib name)
            body = self._read_body()
            if body is None:
                return
            if self.path.split("?", 1)[0] != TRACES_PATH:
                self._error(404, "NOT_FOUND", f"no route POST {self.path}")
                return
            ctype = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
            if ctype != PROTOBUF:
                self._error(
                    415, "INVALID_ARGUMENT", f"content type {ctype!r} unsupported; want {PROTOBUF}"
                )
                return
            encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
            if encoding == "gzip":
                try:
                    body = gzip.decompress(body)
                except (OSError, EOFError, zlib.error) as e:
                    self._error(400, "INVALID_ARGUMENT", f"bad gzip body: {e}")
                    return
            elif encoding not in ("", "identity"):
                self._error(415, "INVALID_ARGUMENT", f"content encoding {encoding!r} unsupported")
                return
            if recorder.require is not None:
                name, value = recorder.require
                if self.headers.get(name) != value:
                    log(f"http: refusing a call without the required header {name!r}")
                    self._error(401, "UNAUTHENTICATED", f"missing header {name}")
                    return
            if recorder.before_answer():
                log("http: failing this export call with 503 (--fail-first)")
                self._error(503, "UNAVAILABLE", "failing on purpose (--fail-first)")
                return
            req = trace_service_pb2.ExportTraceServiceRequest()
            try:
                req.ParseFromString(body)
            except DecodeError as e:
                self._error(400, "INVALID_ARGUMENT", f"undecodable ExportTraceServiceRequest: {e}")
                return
            n = recorder.record("http", req)
            log(f"http: recorded {n} span(s)")
            resp = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self._send(200, resp, PROTOBUF)

    return Handler


def serve_http(port: int, recorder: Recorder, stop: threading.Event, tls: Any = None) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(recorder))
    server.daemon_threads = True
    if tls is not None:
        import ssl

        cert, key, client_ca = tls
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        # The handshake runs at accept (in the serving thread); a failed one drops only that
        # connection (socketserver ignores OSError from get_request).
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.daemon = True
    thread.start()
    announce(server.server_address[1])
    wait(stop)
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# OTLP/gRPC
# ---------------------------------------------------------------------------------------------


def serve_grpc(port: int, recorder: Recorder, stop: threading.Event, tls: Any = None) -> None:
    try:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
    except ImportError as e:
        raise SystemExit(
            f"otlp_receiver: --protocol grpc needs grpcio and trace_service_pb2_grpc ({e}); run "
            "crates/tokenscope-otlp/scripts/install-python-otel.sh"
        ) from e

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (generated name)
            if recorder.require is not None:
                name, value = recorder.require
                got = dict(context.invocation_metadata()).get(name)
                if got != value:
                    log(f"grpc: refusing a call without the required metadata {name!r}")
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing metadata {name}")
            if recorder.before_answer():
                log("grpc: failing this export call with UNAVAILABLE (--fail-first)")
                context.abort(grpc.StatusCode.UNAVAILABLE, "failing on purpose (--fail-first)")
            n = recorder.record("grpc", request)
            log(f"grpc: recorded {n} span(s)")
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_receive_message_length", MAX_BODY),
            ("grpc.so_reuseport", 0),
        ],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    if tls is None:
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        cert, key, client_ca = tls

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_server_credentials(
            [(read(key), read(cert))],
            root_certificates=read(client_ca) if client_ca else None,
            require_client_auth=bool(client_ca),
        )
        bound = server.add_secure_port(f"127.0.0.1:{port}", creds)
    if bound == 0:
        raise SystemExit(f"otlp_receiver: cannot bind 127.0.0.1:{port} for gRPC")
    server.start()
    announce(bound)
    wait(stop)
    server.stop(grace=1).wait(timeout=5)


# ---------------------------------------------------------------------------------------------


def wait(stop: threading.Event) -> None:
    # Short waits so the main thread returns to the interpreter, where signal handlers run.
    while not stop.wait(0.2):
        pass


def announce(port: int) -> None:
    sys.stdout.write(f"LISTENING {port}\n")
    sys.stdout.flush()
    log(f"listening on 127.0.0.1:{port}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--protocol", required=True, choices=["http", "grpc"])
    p.add_argument("--port", type=int, default=0, help="127.0.0.1 port; 0 = ephemeral")
    p.add_argument("--out", required=True, help="JSON-lines file (appended)")
    p.add_argument("--fail-first", type=int, default=0, metavar="N",
                   help="answer the first N export calls with 503 / UNAVAILABLE")
    p.add_argument("--delay-ms", type=int, default=0, metavar="N",
                   help="sleep before answering each export call")
    p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    p.add_argument("--tls-key", metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="PEM",
                   help="require client certificates signed by this CA")
    p.add_argument("--require-header", metavar="NAME=VALUE",
                   help="refuse calls without this header / metadata")
    args = p.parse_args(argv)
    if args.fail_first < 0 or args.delay_ms < 0 or not 0 <= args.port <= 65535:
        p.error("--port, --fail-first and --delay-ms must be non-negative (port ≤ 65535)")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        p.error("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    tls = (args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    require = None
    if args.require_header:
        name, sep, value = args.require_header.partition("=")
        if not sep or not name:
            p.error("--require-header expects NAME=VALUE")
        require = (name.strip().lower(), value)

    recorder = Recorder(args.out, args.fail_first, args.delay_ms, require)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log(f"signal {signum}: stopping")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        if args.protocol == "http":
            serve_http(args.port, recorder, stop, tls)
        else:
            serve_grpc(args.port, recorder, stop, tls)
    except OSError as e:
        log(f"cannot serve on 127.0.0.1:{args.port}: {e}")
        return 1
    finally:
        log(f"stopped after {recorder.calls} export call(s), {recorder.spans} span(s) recorded")
        recorder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
