#!/usr/bin/env python3
"""Capture real vLLM responses as test fixtures.

Starts the vLLM that scripts/install-vllm.sh installed (its Python and model from
$TOKENSCOPE_CACHE/vllm.env), with per-request metrics and OTLP traces to a receiver run here,
sends a few requests with a fixed traceparent, and writes what came back, byte for byte, to
the output folder (default crates/tokenscope-cli/tests/fixtures/vllm):

  chat.json            non-streamed /v1/chat/completions (usage + metrics)
  completion.sse       streamed /v1/completions with include_usage (metrics on the usage chunk)
  chat-stream.sse      streamed /v1/chat/completions with include_usage
  metrics.txt          GET /metrics after the requests (engine state, histograms)
  span-<trace>.pb      the OTLP/HTTP protobuf export that carried the chat request's span
  requests.json        what was sent, the traceparents, vLLM's version and flags

The fixture tests name these files; rerun this script after a vLLM upgrade and let them say
what changed. Usage: scripts/capture-vllm-fixtures.py [OUT_DIR]
"""

import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    ROOT, "crates", "tokenscope-cli", "tests", "fixtures", "vllm")
CACHE = os.environ.get("TOKENSCOPE_CACHE", os.path.expanduser("~/.cache/tokenscope"))
MODEL = "gemma-3-270m"
CHAT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
STREAM_TRACE = "0af7651916cd43dd8448eb211c80319c"


def env_file():
    path = os.path.join(CACHE, "vllm.env")
    vals = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.strip().split("=", 1)
                vals[k] = v
    return vals


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


exports = []


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        exports.append(self.rfile.read(n))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def post(url, body, traceparent):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "traceparent": traceparent})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read()


def main():
    vals = env_file()
    os.makedirs(OUT, exist_ok=True)
    otlp_port, port = free_port(), free_port()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", otlp_port), Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    flags = ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager", "--seed", "1",
             "--enable-per-request-metrics",
             "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces",
             "--collect-detailed-traces", "all"]
    work = tempfile.mkdtemp(prefix="vllm-capture-")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CACHE_ROOT=os.path.join(work, "c"),
               TMPDIR=work, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
    log = open(os.path.join(work, "vllm.log"), "w")
    proc = subprocess.Popen([vals["VLLM_PYTHON"], "-m", "vllm.entrypoints.openai.api_server",
                             "--model", vals["VLLM_MODEL"], "--served-model-name", MODEL,
                             "--host", "127.0.0.1", "--port", str(port)] + flags,
                            env=env, stdout=log, stderr=log, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 360
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                sys.exit(f"vLLM did not start; see {log.name}")
            time.sleep(1)
        tp = lambda trace: f"00-{trace}-00f067aa0ba902b7-01"
        prompt = "The capital of France is a city that"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        completion = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                      "ignore_eos": True, "stream": True,
                      "stream_options": {"include_usage": True}}
        chat_stream = dict(chat, stream=True, stream_options={"include_usage": True})
        with open(os.path.join(OUT, "chat.json"), "wb") as f:
            f.write(post(base + "/v1/chat/completions", chat, tp(CHAT_TRACE)))
        with open(os.path.join(OUT, "completion.sse"), "wb") as f:
            f.write(post(base + "/v1/completions", completion, tp(STREAM_TRACE)))
        with open(os.path.join(OUT, "chat-stream.sse"), "wb") as f:
            f.write(post(base + "/v1/chat/completions", chat_stream,
                         tp("5b8efff798038103d269b633813fc60c")))
        with urllib.request.urlopen(base + "/metrics") as r, \
                open(os.path.join(OUT, "metrics.txt"), "wb") as f:
            f.write(r.read())
        # vLLM's batch span processor exports every 5 s.
        deadline = time.time() + 30
        want = bytes.fromhex(CHAT_TRACE)
        while not any(want in e for e in exports) and time.time() < deadline:
            time.sleep(0.5)
        found = [e for e in exports if want in e]
        if not found:
            sys.exit("no span from vLLM for the chat request")
        with open(os.path.join(OUT, f"span-{CHAT_TRACE}.pb"), "wb") as f:
            f.write(found[0])
        version = vals.get("VLLM_VERSION", "unknown")
        with open(os.path.join(OUT, "requests.json"), "w") as f:
            json.dump({"vllm": version, "flags": flags[:-4] + ["--otlp-traces-endpoint", "…",
                                                             "--collect-detailed-traces", "all"],
                       "env": {"VLLM_CPU_KVCACHE_SPACE": "2"},
                       "chat.json": {"body": chat, "traceparent": tp(CHAT_TRACE)},
                       "completion.sse": {"body": completion, "traceparent": tp(STREAM_TRACE)},
                       "chat-stream.sse": {"body": chat_stream}},
                      f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"captured vLLM {version} responses in {OUT}")
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        srv.shutdown()


if __name__ == "__main__":
    main()
