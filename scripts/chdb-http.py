#!/usr/bin/env python3
"""A current ClickHouse engine behind ClickHouse's HTTP interface, for the tests.

Debian ships clickhouse-server 18.16; users run 24+. PyPI's `chdb` embeds a current ClickHouse
(26.x) as a library, without a server. This script puts the subset of the HTTP interface that
tokenscope's client (the `clickhouse` crate, compression off) uses in front of one chdb session,
so that the store's own code — its DDL, migrations, RowBinary inserts, FINAL reads, report
aggregations and retention — runs unchanged on a modern engine:

  * `GET /ping` -> `Ok.`
  * `POST /?query=INSERT ... FORMAT <fmt>` with the data in the body (Content-Length or chunked)
  * `POST /` with the statement in the body (optionally `query=` prefix), `default_format`
    (TabSeparated when absent; a FORMAT clause in the statement wins), `database`, and other
    URL parameters applied as settings
  * errors: HTTP 500 with ClickHouse's own `Code: N. DB::Exception: ...` text and the
    `X-ClickHouse-Exception-Code` header, as a server sends them

Not supported (the tests that need them run on the real server): compression, HTTPS, users and
passwords, clusters. One statement runs at a time (one session, one lock).

Usage: chdb-http.py DATA_DIR [PORT]   (PORT 0 = any; prints "listening on <port>" when ready)
"""

import re
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from chdb import session as chdb_session

# URL parameters that are not settings.
NOT_SETTINGS = {
    "query", "default_format", "database", "user", "password", "compress", "decompress",
    "session_id", "query_id", "role", "session_timeout", "session_check",
}
INSERT_RE = re.compile(r"^\s*INSERT\s+INTO\s+(?P<head>.*?)\s+FORMAT\s+(?P<fmt>\w+)\s*$",
                       re.IGNORECASE | re.DOTALL)
CODE_RE = re.compile(r"Code: (\d+)\.")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Engine:
    def __init__(self, path):
        self.session = chdb_session.Session(path)
        self.lock = threading.Lock()

    def run(self, sql, fmt, database, settings, data=None):
        with self.lock:
            self.session.query(f"USE {database or 'default'}", "TabSeparated")
            for k, v in settings.items():
                if IDENT_RE.match(k):
                    self.session.query(f"SET {k} = {quote(v)}", "TabSeparated")
            if data is not None:
                m = INSERT_RE.match(sql)
                ins = self.session.send_insert(f"INSERT INTO {m.group('head')}", m.group("fmt"))
                if data:
                    ins.append(data)
                ins.finish()
                return b""
            return self.session.query(sql, fmt).bytes()


def quote(v):
    if re.fullmatch(r"-?\d+(\.\d+)?", v):
        return v
    return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine = None

    def log_message(self, *_args):
        pass

    def send(self, status, body, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", "text/tab-separated-values; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path in ("/ping", "/"):
            if not urllib.parse.parse_qs(url.query).get("query"):
                self.send(200, b"Ok.\n")
                return
        self.handle_query(b"")

    def do_POST(self):
        self.handle_query(self.body())

    def handle_query(self, body):
        url = urllib.parse.urlsplit(self.path)
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        if params.get("compress") == "1" or params.get("decompress") == "1" or \
                self.headers.get("Content-Encoding"):
            self.send(501, b"Code: 48. DB::Exception: chdb-http: compression is not supported. (NOT_IMPLEMENTED)\n")
            return
        q = params.get("query", "")
        data = None
        if q and INSERT_RE.match(q):
            sql, data = q, body
        elif q:
            sql = q + (" " + body.decode("utf-8") if body else "")
        else:
            sql = body.decode("utf-8")
        settings = {k: v for k, v in params.items() if k not in NOT_SETTINGS}
        try:
            out = self.engine.run(sql, params.get("default_format") or "TabSeparated",
                                  params.get("database"), settings, data)
        except Exception as e:  # chdb raises ChdbError with the server's message
            msg = str(e).strip()
            m = CODE_RE.search(msg)
            code = m.group(1) if m else "1000"
            if not m:
                msg = f"Code: {code}. DB::Exception: {msg}"
            self.send(500, (msg + "\n").encode("utf-8"), [("X-ClickHouse-Exception-Code", code)])
            return
        self.send(200, out)


def main():
    path = sys.argv[1]
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    Handler.engine = Engine(path)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
