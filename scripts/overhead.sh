#!/usr/bin/env bash
# tokenscope's own overhead (issue 7): the same load against the mock engine directly and
# through the gateway (metrics, SQLite store and OTLP tracing on), in one run.
#
#   scripts/overhead.sh [OUT.md]        (default: $CARGO_TARGET_DIR/overhead.md)
#
# What it does (docs/benchmarks.md, "tokenscope's own overhead", has a run and its reading):
#  1. builds `tokenscope` (release) and starts two mock engines on 127.0.0.1:0:
#     * "fast": --slots 256 --time-scale 0 (MOCK_TIME_SCALE), for the latency runs: every
#       simulated duration is zero, so a 100-token stream is generated as fast as it is read
#       (~0.8 ms end to end direct) and the mock's first token never waits for a timer. With a
#       time scale > 0 the mock's steps sleep on tokio's 1 ms timer, its TTFT is quantised in
#       ~1.2 ms steps, and the load generator's sends appear synchronised with the mock's
#       bursts, which turns a ~0.3 ms proxy delay into "missed the burst: +1 ms" for most
#       requests (docs/benchmarks.md). Its own CPU is reported per run;
#     * "slow": --slots 1024 --decode-base-ms 500 (one token per stream every 0.5 – 1 s), for
#       the memory run: 1 000 streams stay open for 10 s and more while producing only
#       ~1 500 events/s in all;
#  2. starts an OTLP/HTTP sink (crates/tokenscope-trace/tests/otlp_receiver.py in the venv of
#     crates/tokenscope-otlp/scripts/install-python-otel.sh) and `tokenscope serve` with the
#     SQLite store, Prometheus metrics (always on) and `--otlp-endpoint` at the sink,
#     `--trace-sample-ratio 0.01` (the default, written out; errors, slow requests and
#     requests above the running P99 are kept as well). The gateway gets both mocks through a
#     config file: the fast one is the default upstream, the slow one serves models `slow-*`;
#     A second, identical gateway runs with `--worker-priority $GW_PRIORITY` (nice value of
#     its runtime threads, like nginx's `worker_priority`; needs CAP_SYS_NICE, e.g. root —
#     the script checks /proc and says whether it took effect; GW_PRIORITY=0 skips it).
#     With BASE_BIN=PATH that second gateway is instead another build of tokenscope (e.g. the
#     commit before a change) at the default priority, labelled "baseline": a before/after
#     comparison of the gateway in one run, both against the same direct rounds.
#     With TLS=1 that second gateway is instead the same build whose default upstream is the
#     same fast mock over HTTPS (the mock also serves TLS, --tls-listen, one engine behind
#     both ports; a CA and a certificate for localhost are made with openssl): the added TTFT
#     with an https:// upstream beside the plain http:// one, against the same direct rounds;
#  3. `tokenscope bench` at $RATE req/s (constant arrivals, seed 1, the bench's default
#     prompt mix 80:64-256,20:2048-4096), streamed, $TOKENS output tokens, $DURATION per run:
#     warm-up (direct, gateway, prioritised gateway), then $PAIRS interleaved rounds (direct,
#     gateway, prioritised gateway, direct, …). The verdict compares the percentiles of all
#     direct requests pooled with those of all requests through each gateway (every request's
#     client-side result is written with --requests-out): on a shared VM the P50 of identical
#     direct runs drifts by ±0.07 ms from run to run, so many short interleaved runs expose
#     every side to the same drift, where long runs compare different moments. The per-round
#     differences are printed too;
#  4. the gateway's CPU (utime + stime from /proc/PID/stat) over each gateway run → CPU per
#     request and per SSE event (the mock sends role + $TOKENS tokens + finish + usage +
#     [DONE] = $TOKENS + 4 events per streamed request);
#  5. 1 000 concurrent streams through the same gateway (500 req/s for 2 s against the slow
#     mock): samples llm_requests_in_flight and VmRSS every 200 ms; reports the peak;
#  6. prints a markdown table and writes it to OUT.md.
#
# Side by side with nginx (issue 23; NGINX=1, the default): the honest floor for a streaming
# proxy is a well-tuned one that measures nothing. nginx from Debian (`nginx-light`, installed
# by this script with apt-get when missing) runs with 1 worker, `proxy_buffering off`,
# `proxy_request_buffering off`, HTTP/1.1 upstream keepalive (256 idle connections) and no
# access log, in front of the same fast mock, in the same interleaved rounds; its worker's CPU
# is read like the gateway's. A traces-off gateway (NOTRACE=1, the default: the same build and
# config without `--otlp-endpoint`) runs in the same rounds too. The verdict compares each
# gateway with nginx: added TTFT P50 and P99 and added e2e P99 at or below nginx's, CPU per
# request at most 0.75x nginx's (pooled over the rounds).
#
# Environment: CARGO_TARGET_DIR (default $HOME/.cache/tokenscope/target), TOKENSCOPE_CACHE
# (default $HOME/.cache/tokenscope), RATE (500), DURATION (4s), WARMUP (10s, each side),
# TOKENS (100), PAIRS (10, rounds), GW_PRIORITY (-5; 0 = no prioritised gateway),
# BASE_BIN (a baseline tokenscope binary for the second gateway instead of the prioritised one),
# TLS (1: the second gateway reaches the mock over HTTPS; wins over BASE_BIN and GW_PRIORITY),
# NGINX (1: nginx side by side; 0: none), NOTRACE (1: a traces-off gateway too; 0: none),
# STREAMS (1000), MOCK_TIME_SCALE (0), GW_WORKERS (the gateway's --worker-threads; default:
# its own default), TOKENSCOPE_BIN (use this binary, no build),
# KEEP=1 keeps the work directory (bench JSON, logs, spans).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tokenscope/target}"
TOKENSCOPE_CACHE="${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}"
OUT="${1:-$CARGO_TARGET_DIR/overhead.md}"
RATE="${RATE:-500}"
DURATION="${DURATION:-4s}"
WARMUP="${WARMUP:-10s}"
TOKENS="${TOKENS:-100}"
PAIRS="${PAIRS:-10}"
STREAMS="${STREAMS:-1000}"
MOCK_TIME_SCALE="${MOCK_TIME_SCALE:-0}"
GW_PRIORITY="${GW_PRIORITY:-0}"
NGINX="${NGINX:-1}"
NOTRACE="${NOTRACE:-1}"
EVENTS_PER_REQ=$((TOKENS + 4))
# Targets (issue 7).
T_TTFT_P50_MS=0.2
T_TTFT_P99_MS=1
T_RSS_BYTES=64000000   # 64 MB (10^6 bytes; = 61.0 MiB), the stricter reading

PY="$TOKENSCOPE_CACHE/otel-venv/bin/python"
RECEIVER=crates/tokenscope-trace/tests/otlp_receiver.py
if [ ! -x "$PY" ]; then
  echo "overhead.sh: no $PY; run crates/tokenscope-otlp/scripts/install-python-otel.sh" >&2
  exit 1
fi
TOOLS="jq curl awk getconf"
[ "${TLS:-0}" = 1 ] && TOOLS="$TOOLS openssl"
if [ "$NGINX" = 1 ] && ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
  echo "overhead.sh: installing nginx-light (Debian) for the side-by-side rounds" >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q nginx-light >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q nginx-light >/dev/null; } \
    || { echo "overhead.sh: could not install nginx (NGINX=0 runs without it)" >&2; exit 1; }
  # The package starts a server on :80 we do not need.
  ($SUDO systemctl stop nginx 2>/dev/null || $SUDO service nginx stop 2>/dev/null || true) >/dev/null 2>&1
fi
NGINX_BIN="$(command -v nginx || echo /usr/sbin/nginx)"
for tool in $TOOLS; do
  command -v "$tool" >/dev/null || { echo "overhead.sh: $tool is required" >&2; exit 1; }
done

log() { printf '==> %s (%s)\n' "$*" "$(date -u +%H:%M:%S)" >&2; }

if [ -n "${TOKENSCOPE_BIN:-}" ]; then
  BIN="$TOKENSCOPE_BIN"
else
  log "cargo build --release -p tokenscope-cli"
  cargo build --release -p tokenscope-cli
  BIN="$CARGO_TARGET_DIR/release/tokenscope"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tokenscope-overhead.XXXXXX")"
PIDS=()
cleanup() {
  local rc=$?
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "${KEEP:-0}" = "1" ] || [ "$rc" != 0 ]; then
    echo "overhead.sh: work directory kept: $WORK" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ulimit -n 16384 2>/dev/null || true   # 1 000 streams = ~2 000 sockets in the gateway

# wait_line FILE PATTERN: prints the first line of FILE matching the extended regex (30 s max).
wait_line() {
  local i
  for i in $(seq 300); do
    if grep -Eq "$2" "$1" 2>/dev/null; then grep -Em1 "$2" "$1"; return 0; fi
    sleep 0.1
  done
  echo "overhead.sh: no line /$2/ in $1:" >&2; cat "$1" >&2; return 1
}
# cpu_ticks PID: utime + stime (fields 14, 15 of /proc/PID/stat), in CLK_TCK units.
cpu_ticks() { sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
status_kb() { awk -v k="$2:" '$1==k{print $2}' "/proc/$1/status"; }
now_s() { date +%s.%N; }
calc() { awk "BEGIN{printf \"%s\", $*}"; }
f2() { awk -v x="$1" 'BEGIN{printf "%.2f", x}'; }
f3() { awk -v x="$1" 'BEGIN{printf "%.3f", x}'; }
CLK_TCK="$(getconf CLK_TCK)"

# ---- processes -------------------------------------------------------------------------------
log "starting the mock engines, the OTLP sink and the gateway"
export TOKENSCOPE_LOG=warn
MOCK_TLS_ARGS=()
if [ "${TLS:-0}" = 1 ]; then
  # A CA and a server certificate for localhost / 127.0.0.1 (EC P-256, as rcgen makes them).
  mkdir -p "$WORK/tls"
  ( cd "$WORK/tls"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
      -subj "/CN=overhead test CA" -keyout ca-key.pem -out ca.pem
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
      -subj "/CN=localhost" -keyout server-key.pem -out server.csr
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >ext.cnf
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 2 \
      -extfile ext.cnf -out server.pem ) >"$WORK/openssl.log" 2>&1 \
    || { cat "$WORK/openssl.log" >&2; exit 1; }
  MOCK_TLS_ARGS=(--tls-cert "$WORK/tls/server.pem" --tls-key "$WORK/tls/server-key.pem"
    --tls-listen 127.0.0.1:0)
fi
"$BIN" mock-engine --listen 127.0.0.1:0 --slots 256 --time-scale "$MOCK_TIME_SCALE" \
  "${MOCK_TLS_ARGS[@]}" >"$WORK/mock.out" 2>"$WORK/mock.err" &
MOCK_PID=$!; PIDS+=("$MOCK_PID")
"$BIN" mock-engine --listen 127.0.0.1:0 --slots 1024 --time-scale 1 --decode-base-ms 500 \
  --prefill-ms-per-token 0 --max-prefill-tokens-per-step 1000000 \
  >"$WORK/slow.out" 2>"$WORK/slow.err" &
SLOW_PID=$!; PIDS+=("$SLOW_PID")
"$PY" "$RECEIVER" --protocol http --port 0 --out "$WORK/spans.jsonl" \
  >"$WORK/otlp.out" 2>"$WORK/otlp.err" &
OTLP_PID=$!; PIDS+=("$OTLP_PID")

MOCK="$(wait_line "$WORK/mock.out" '^tokenscope mock-engine listening on [^ ]+$' | awk '{print $NF}')"
if [ "${TLS:-0}" = 1 ]; then
  MOCK_TLS="$(wait_line "$WORK/mock.out" 'listening on .* \(https\)$' | awk '{print $(NF-1)}')"
fi
SLOW="$(wait_line "$WORK/slow.out" '^tokenscope mock-engine listening on ' | awk '{print $NF}')"
OTLP_PORT="$(wait_line "$WORK/otlp.out" '^LISTENING ' | awk '{print $2}')"

cat >"$WORK/gateway.toml" <<EOF
[[upstreams]]
name = "mock"
url = "http://$MOCK"
default = true

[[upstreams]]
name = "mock-slow"
url = "http://$SLOW"
models = ["slow-*"]
EOF
if [ "${TLS:-0}" = 1 ]; then
  cat >"$WORK/gateway-tls.toml" <<EOF
[[upstreams]]
name = "mock"
url = "https://localhost:${MOCK_TLS##*:}"
ca_file = "$WORK/tls/ca.pem"
default = true

[[upstreams]]
name = "mock-slow"
url = "http://$SLOW"
models = ["slow-*"]
EOF
fi
GW_ARGS=()
[ -n "${GW_WORKERS:-}" ] && GW_ARGS+=(--worker-threads "$GW_WORKERS")
# start_gateway TAG [ARGS…]: `tokenscope serve` with the shared config and every layer on (its
# own store, spool and logs); sets ${TAG}_PID, ${TAG}_PROXY and ${TAG}_ADMIN.
start_gateway() {
  local tag=$1 pid ready
  shift
  local otlp=(--otlp-endpoint "http://127.0.0.1:$OTLP_PORT" --otlp-protocol http --trace-sample-ratio 0.01)
  [ "${NO_OTLP:-0}" = 1 ] && otlp=()
  TOKENSCOPE_SPOOL__DIR="$WORK/spool-$tag" "${GWBIN:-$BIN}" serve "${GW_ARGS[@]}" "$@" \
    --config "${GWCONF:-$WORK/gateway.toml}" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
    --store "$WORK/ts-$tag.db" "${otlp[@]}" \
    >"$WORK/$tag.out" 2>"$WORK/$tag.err" &
  pid=$!; PIDS+=("$pid")
  ready="$(wait_line "$WORK/$tag.out" '^tokenscope listening proxy=')"
  printf -v "${tag}_PID" '%s' "$pid"
  printf -v "${tag}_PROXY" '%s' "$(sed -n 's/.*proxy=\([^ ]*\).*/\1/p' <<<"$ready")"
  printf -v "${tag}_ADMIN" '%s' "$(sed -n 's/.*admin=\([^ ]*\).*/\1/p' <<<"$ready")"
}
start_gateway GW
PROXY=$GW_PROXY; ADMIN=$GW_ADMIN
log "mock http://$MOCK${MOCK_TLS:+ (and https://$MOCK_TLS)}, slow mock http://$SLOW, OTLP sink :$OTLP_PORT, gateway http://$PROXY (admin $ADMIN)"
# The prioritised gateway: the same, with --worker-priority.
SIDES="direct gateway"
PRIO_NOTE=""
SECOND_NAME="prioritised gateway"
if [ "${TLS:-0}" = 1 ]; then
  SECOND_NAME="https gateway"
  GWCONF="$WORK/gateway-tls.toml" start_gateway PRIO
  PRIO_NOTE="the same build, its default upstream the same mock over HTTPS (https://localhost:${MOCK_TLS##*:}, rustls, CA file)"
  log "https gateway http://$PRIO_PROXY (admin $PRIO_ADMIN) → mock https://$MOCK_TLS"
  SIDES="direct gateway prio"
elif [ -n "${BASE_BIN:-}" ]; then
  SECOND_NAME="baseline gateway"
  GWBIN="$BASE_BIN" start_gateway PRIO
  PRIO_NOTE="baseline build \`$("$BASE_BIN" --version 2>/dev/null || echo "$BASE_BIN")\` ($BASE_BIN) at the default priority"
  log "baseline gateway http://$PRIO_PROXY (admin $PRIO_ADMIN): $PRIO_NOTE"
  SIDES="direct gateway prio"
elif [ "$GW_PRIORITY" != 0 ]; then
  start_gateway PRIO --worker-priority "$GW_PRIORITY"
  # Did it take effect? The nice value (field 19 of /proc/PID/task/TID/stat) of the runtime
  # threads; without CAP_SYS_NICE they stay at the inherited value and the gateway warns.
  NICES="$(for t in /proc/"$PRIO_PID"/task/*; do
    if [ "$(cat "$t/comm")" = tokio-rt-worker ]; then sed 's/^.*) //' "$t/stat" | awk '{print $17}'; fi
  done | sort -u | tr '\n' ' ')"
  if [ "$NICES" = "$GW_PRIORITY " ]; then
    PRIO_NOTE="runtime threads at nice $GW_PRIORITY (checked in /proc)"
  else
    PRIO_NOTE="**not applied** (runtime threads at nice ${NICES:-?}; needs CAP_SYS_NICE)"
  fi
  log "prioritised gateway http://$PRIO_PROXY (admin $PRIO_ADMIN): $PRIO_NOTE"
  SIDES="direct gateway prio"
fi
if [ "$NOTRACE" = 1 ]; then
  NO_OTLP=1 start_gateway NT
  log "traces-off gateway http://$NT_PROXY (admin $NT_ADMIN)"
  SIDES="$SIDES notrace"
fi
if [ "$NGINX" = 1 ]; then
  NGINX_PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  mkdir -p "$WORK/nginx"
  cat >"$WORK/nginx/nginx.conf" <<NGINXCONF
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  upstream mock { server $MOCK; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
NGINXCONF
  "$NGINX_BIN" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" >"$WORK/nginx/out" 2>&1 &
  NGINX_MASTER=$!; PIDS+=("$NGINX_MASTER")
  NGINX_PID=""
  for _ in $(seq 100); do
    NGINX_PID="$(pgrep -P "$NGINX_MASTER" | head -1 || true)"
    [ -n "$NGINX_PID" ] && curl -s -o /dev/null "http://127.0.0.1:$NGINX_PORT/v1/models" && break
    sleep 0.1
  done
  [ -n "$NGINX_PID" ] || { echo "overhead.sh: nginx did not start:" >&2; cat "$WORK/nginx/out" "$WORK/nginx/error.log" >&2; exit 1; }
  NGINX_VERSION="$("$NGINX_BIN" -v 2>&1 | sed 's/^nginx version: //')"
  log "nginx ($NGINX_VERSION) http://127.0.0.1:$NGINX_PORT, worker pid $NGINX_PID -> mock http://$MOCK"
  SIDES="$SIDES nginx"
fi
sleep 1
RSS_IDLE_KB="$(status_kb "$GW_PID" VmRSS)"

metric_sum() { # metric_sum ADMIN NAME: sum of the samples of NAME (all label sets) on /metrics
  curl -sf "http://$1/metrics" | awk -v n="$2" '($1==n || index($1, n"{")==1){s+=$NF} END{printf "%.9f", s+0}'
}

# ---- latency runs ----------------------------------------------------------------------------
BENCH_ARGS=(--rates "$RATE" --duration "$DURATION" --arrival constant --seed 1
  --mix 80:64-256,20:2048-4096 --stream --output-tokens "$TOKENS" --format json)

# run_bench NAME SIDE: one level against SIDE (direct | gateway | prio); writes
# $WORK/NAME.json, $WORK/NAME.jsonl (per request) and $WORK/NAME.env (CPU etc.).
run_bench() {
  local name=$1 side=$2 target gpid admin g0 m0 t0 oc0 os0 g1 m1 t1 oc1 os1
  case $side in
    direct) target=$MOCK; gpid=$GW_PID; admin=$ADMIN;;
    gateway) target=$PROXY; gpid=$GW_PID; admin=$ADMIN;;
    prio) target=$PRIO_PROXY; gpid=$PRIO_PID; admin=$PRIO_ADMIN;;
    notrace) target=$NT_PROXY; gpid=$NT_PID; admin=$NT_ADMIN;;
    nginx) target=127.0.0.1:$NGINX_PORT; gpid=$NGINX_PID; admin=$ADMIN;;
  esac
  log "bench $name → $target ($RATE req/s, $DURATION)"
  oc0="$(metric_sum "$admin" tokenscope_gateway_overhead_seconds_count)"
  os0="$(metric_sum "$admin" tokenscope_gateway_overhead_seconds_sum)"
  g0="$(cpu_ticks "$gpid")"; m0="$(cpu_ticks "$MOCK_PID")"; t0="$(now_s)"
  "$BIN" bench --target "http://$target" --request-id-prefix "ovh-$name" "${BENCH_ARGS[@]}" \
    --requests-out "$WORK/$name.jsonl" >"$WORK/$name.json" 2>"$WORK/$name.err"
  t1="$(now_s)"; g1="$(cpu_ticks "$gpid")"; m1="$(cpu_ticks "$MOCK_PID")"
  oc1="$(metric_sum "$admin" tokenscope_gateway_overhead_seconds_count)"
  os1="$(metric_sum "$admin" tokenscope_gateway_overhead_seconds_sum)"
  {
    echo "wall=$(calc "$t1 - $t0")"
    echo "gw_ticks=$((g1 - g0))"
    echo "mock_ticks=$((m1 - m0))"
    echo "ovh_n=$(calc "$oc1 - $oc0")"
    echo "ovh_s=$(calc "$os1 - $os0")"
  } >"$WORK/$name.env"
  sleep 1   # let the store writer and the exporter catch up before the next run
}

DURATION_RUN="$DURATION"; DURATION="$WARMUP"; BENCH_ARGS[3]="$WARMUP"
for side in $SIDES; do run_bench "warmup-$side" "$side"; done
DURATION="$DURATION_RUN"; BENCH_ARGS[3]="$DURATION"
for i in $(seq "$PAIRS"); do
  for side in $SIDES; do run_bench "$side$i" "$side"; done
done
RSS_AFTER_KB="$(status_kb "$GW_PID" VmRSS)"

# ---- 1 000 concurrent streams ----------------------------------------------------------------
SRATE=500
SDUR_MS=$((STREAMS * 1000 / SRATE))
log "holding $STREAMS streams open through the gateway ($SRATE req/s for ${SDUR_MS}ms, slow mock)"
"$BIN" bench --target "http://$PROXY" --model slow-1 --rates "$SRATE" --duration "${SDUR_MS}ms" \
  --arrival constant --mix 8-16 --stream --output-tokens 20 --concurrency $((STREAMS + 100)) \
  --request-id-prefix ovh-streams --format json >"$WORK/streams.json" 2>"$WORK/streams.err" &
SB_PID=$!; PIDS+=("$SB_PID")
PEAK_RSS_KB=0; PEAK_RSS_INFLIGHT=0; MAX_INFLIGHT=0; RSS_AT_MAX_KB=0
while kill -0 "$SB_PID" 2>/dev/null; do
  inflight="$(metric_sum "$ADMIN" llm_requests_in_flight)"; inflight="${inflight%.*}"
  rss="$(status_kb "$GW_PID" VmRSS)"
  if [ "$rss" -gt "$PEAK_RSS_KB" ]; then PEAK_RSS_KB=$rss; PEAK_RSS_INFLIGHT=$inflight; fi
  if [ "$inflight" -gt "$MAX_INFLIGHT" ] || { [ "$inflight" -eq "$MAX_INFLIGHT" ] && [ "$rss" -gt "$RSS_AT_MAX_KB" ]; }; then
    MAX_INFLIGHT=$inflight; RSS_AT_MAX_KB=$rss
  fi
  echo "$(date +%s.%N) inflight=$inflight rss_kb=$rss" >>"$WORK/streams.samples"
  sleep 0.2
done
wait "$SB_PID" || true
HWM_KB="$(status_kb "$GW_PID" VmHWM)"

# ---- results ---------------------------------------------------------------------------------
sleep 2
curl -sf "http://$ADMIN/metrics" >"$WORK/metrics.txt" || true
# mval FILE NAME: the sum of NAME's samples (all label sets) in a saved /metrics page.
mval() { awk -v n="$2" '($1==n || index($1, n"{")==1){s+=$NF} END{printf "%d", s+0}' "$WORK/$1"; }
REC_WRITTEN="$(mval metrics.txt tokenscope_records_written_total)"
REC_DROPPED="$(mval metrics.txt tokenscope_records_dropped_total)"
REC_LOST="$(mval metrics.txt tokenscope_records_lost_total)"
SPANS_EXPORTED="$(mval metrics.txt tokenscope_trace_spans_exported_total)"
SPANS_DROPPED="$(mval metrics.txt tokenscope_trace_spans_dropped_total)"
SPANS_RECEIVED="$( (wc -l <"$WORK/spans.jsonl") 2>/dev/null || echo 0)"
if [ -n "$PRIO_NOTE" ]; then
  curl -sf "http://$PRIO_ADMIN/metrics" >"$WORK/metrics-prio.txt" || true
  PRIO_WRITTEN="$(mval metrics-prio.txt tokenscope_records_written_total)"
  PRIO_DROPPED="$(mval metrics-prio.txt tokenscope_records_dropped_total)"
  PRIO_LOST="$(mval metrics-prio.txt tokenscope_records_lost_total)"
  PRIO_SPANS="$(mval metrics-prio.txt tokenscope_trace_spans_exported_total)"
  PRIO_SPANS_DROPPED="$(mval metrics-prio.txt tokenscope_trace_spans_dropped_total)"
fi
declare -A CPU_US A50 A99

jf() { jq -r ".[0]$2" "$WORK/$1.json"; }
envv() { awk -F= -v k="$2" '$1==k{print $2}' "$WORK/$1.env"; }
MIB() { awk -v k="$1" 'BEGIN{printf "%.1f", k/1024}'; }
yes_no() { if [ "$1" = 1 ]; then echo "**met**"; else echo "**not met**"; fi; }

label() { case $1 in direct) echo "mock";; nginx) echo "nginx → mock";; notrace) echo "gateway, traces off → mock";; gateway) echo "gateway → mock";; prio) if [ "${TLS:-0}" = 1 ]; then echo "gateway → https mock"; elif [ -n "${BASE_BIN:-}" ]; then echo "baseline gateway → mock"; else echo "gateway (worker_priority $GW_PRIORITY) → mock"; fi;; esac; }
GSIDES="${SIDES#direct }"
{
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs ($(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)), $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+dirty'); load average at the end $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  echo "Load: \`tokenscope bench --rates $RATE --duration $DURATION --arrival constant --seed 1 --mix 80:64-256,20:2048-4096 --stream --output-tokens $TOKENS\`, $PAIRS interleaved rounds ($SIDES) after one warm-up round; gateway \`${GW_ARGS[*]:-(default workers)}\`$( [ -n "$PRIO_NOTE" ] && if [ -n "${BASE_BIN:-}" ] || [ "${TLS:-0}" = 1 ]; then echo "; second gateway: $PRIO_NOTE"; else echo "; prioritised gateway: the same with \`--worker-priority $GW_PRIORITY\`, $PRIO_NOTE"; fi); mock \`--slots 256 --time-scale $MOCK_TIME_SCALE\`; gateways: SQLite store, metrics, OTLP/HTTP tracing at ratio 0.01 to a local sink. Latencies are client-side, ms."
  echo
  echo "| run | target | ok / failed / dropped | achieved req/s | TTFT P50 | TTFT P99 | e2e P50 | e2e P99 | gateway CPU (cores) | mock CPU (cores) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  for name in $(for x in $SIDES; do echo "warmup-$x"; done) $(for i in $(seq "$PAIRS"); do for x in $SIDES; do echo "$x$i"; done; done); do
    side="${name#warmup-}"; side="${side%%[0-9]*}"
    wall="$(envv "$name" wall)"
    gcpu="$(f2 "$(calc "$(envv "$name" gw_ticks) / $CLK_TCK / $wall")")"
    [ "$side" = direct ] && gcpu="–"
    echo "| $name | $(label "$side") | $(jf "$name" .ok) / $(jf "$name" .failed) / $(jf "$name" .dropped) | $(f2 "$(jf "$name" .achieved_qps)") | $(f3 "$(jf "$name" .ttft_ms.p50)") | $(f3 "$(jf "$name" .ttft_ms.p99)") | $(f3 "$(jf "$name" .e2e_ms.p50)") | $(f3 "$(jf "$name" .e2e_ms.p99)") | $gcpu | $(f2 "$(calc "$(envv "$name" mock_ticks) / $CLK_TCK / $wall")") |"
  done
  for g in $GSIDES; do
    echo
    echo "$(label "$g"), per round:"
    echo
    echo "| round | added TTFT P50 | added TTFT P99 | added e2e P50 | added e2e P99 | gateway CPU per request | per SSE event ($EVENTS_PER_REQ per request) | \`tokenscope_gateway_overhead\` mean |"
    echo "|---|---|---|---|---|---|---|---|"
    for i in $(seq "$PAIRS"); do
      d="direct$i"; r="$g$i"
      a50="$(calc "$(jf "$r" .ttft_ms.p50) - $(jf "$d" .ttft_ms.p50)")"
      a99="$(calc "$(jf "$r" .ttft_ms.p99) - $(jf "$d" .ttft_ms.p99)")"
      e50="$(calc "$(jf "$r" .e2e_ms.p50) - $(jf "$d" .e2e_ms.p50)")"
      e99="$(calc "$(jf "$r" .e2e_ms.p99) - $(jf "$d" .e2e_ms.p99)")"
      okg="$(jf "$r" .ok)"
      cpu_req_us="$(calc "$(envv "$r" gw_ticks) / $CLK_TCK / $okg * 1e6")"
      cpu_ev_us="$(calc "$cpu_req_us / $EVENTS_PER_REQ")"
      ovh_us="$(calc "$(envv "$r" ovh_s) / ($(envv "$r" ovh_n) + 1e-9) * 1e6")"
      echo "| $i | $(f3 "$a50") ms | $(f3 "$a99") ms | $(f3 "$e50") ms | $(f3 "$e99") ms | $(awk -v x="$cpu_req_us" 'BEGIN{printf "%.0f", x}') µs | $(f2 "$cpu_ev_us") µs | $(awk -v x="$ovh_us" 'BEGIN{printf "%.1f", x}') µs |"
    done
  done
  echo
  # Pooled: every ok request of the direct runs vs every ok request of each gateway's runs.
  pool() { # pool SIDE FIELD P: nearest-rank percentile P of FIELD over the SIDE runs
    for i in $(seq "$PAIRS"); do cat "$WORK/$1$i.jsonl"; done |
      jq -s --arg f "$2" --argjson p "$3" '[.[] | select(.ok) | .[$f] | select(. != null)] | sort |
        .[((length * $p) | ceil) - 1]'
  }
  declare -A P
  for x in $SIDES; do
    for f in ttft_ms e2e_ms; do for q in 50 99; do P[$x.$f.$q]="$(pool "$x" "$f" "0.$q")"; done; done
  done
  NREQ="$(for i in $(seq "$PAIRS"); do cat "$WORK/gateway$i.jsonl"; done | jq -s '[.[] | select(.ok)] | length')"
  echo "Pooled over the $PAIRS rounds (~$NREQ ok requests per side), client-side, ms:"
  echo
  echo "| | TTFT P50 | TTFT P99 | e2e P50 | e2e P99 | gateway CPU per request |"
  echo "|---|---|---|---|---|---|"
  echo "| direct | $(f3 "${P[direct.ttft_ms.50]}") | $(f3 "${P[direct.ttft_ms.99]}") | $(f3 "${P[direct.e2e_ms.50]}") | $(f3 "${P[direct.e2e_ms.99]}") | |"
  for g in $GSIDES; do
    ticks=0; okn=0
    for i in $(seq "$PAIRS"); do ticks=$((ticks + $(envv "$g$i" gw_ticks))); okn=$((okn + $(jf "$g$i" .ok))); done
    CPU_US[$g]="$(awk -v t="$ticks" -v c="$CLK_TCK" -v n="$okn" 'BEGIN{printf "%.0f", t / c / n * 1e6}')"
    echo "| $(label "$g") | $(f3 "${P[$g.ttft_ms.50]}") | $(f3 "${P[$g.ttft_ms.99]}") | $(f3 "${P[$g.e2e_ms.50]}") | $(f3 "${P[$g.e2e_ms.99]}") | ${CPU_US[$g]} µs |"
  done
  for g in $GSIDES; do
    A50[$g]="$(calc "${P[$g.ttft_ms.50]} - ${P[direct.ttft_ms.50]}")"
    A99[$g]="$(calc "${P[$g.ttft_ms.99]} - ${P[direct.ttft_ms.99]}")"
    echo "| **added**, $(label "$g" | sed 's/ → mock//') | **$(f3 "${A50[$g]}")** | **$(f3 "${A99[$g]}")** | $(f3 "$(calc "${P[$g.e2e_ms.50]} - ${P[direct.e2e_ms.50]}")") | $(f3 "$(calc "${P[$g.e2e_ms.99]} - ${P[direct.e2e_ms.99]}")") | |"
  done
  echo
  OKRSS=0; [ $((PEAK_RSS_KB * 1024)) -le "$T_RSS_BYTES" ] && OKRSS=1
  echo "| target (issue 7) | configuration | measured | verdict |"
  echo "|---|---|---|---|"
  for g in $GSIDES; do
    ok=0; awk -v x="${A50[$g]}" -v t="$T_TTFT_P50_MS" 'BEGIN{exit !(x <= t)}' && ok=1
    echo "| added TTFT P50 ≤ $T_TTFT_P50_MS ms at $RATE streaming req/s, $TOKENS-token outputs | $(label "$g" | sed 's/ → mock//') | $(f3 "${A50[$g]}") ms (pooled) | $(yes_no "$ok") |"
  done
  for g in $GSIDES; do
    ok=0; awk -v x="${A99[$g]}" -v t="$T_TTFT_P99_MS" 'BEGIN{exit !(x <= t)}' && ok=1
    echo "| added TTFT P99 ≤ $T_TTFT_P99_MS ms | $(label "$g" | sed 's/ → mock//') | $(f3 "${A99[$g]}") ms (pooled) | $(yes_no "$ok") |"
  done
  if [ "$NGINX" = 1 ]; then
    echo
    echo "Against nginx (issue 23: at or below nginx's added TTFT P50 / P99 and e2e P99, at most 0.75× its CPU per request; pooled):"
    echo
    echo "| configuration | added TTFT P50 (nginx) | added TTFT P99 (nginx) | added e2e P99 (nginx) | CPU per request (0.75× nginx) | verdict |"
    echo "|---|---|---|---|---|---|"
    NE99="$(calc "${P[nginx.e2e_ms.99]} - ${P[direct.e2e_ms.99]}")"
    CPU_CAP="$(calc "0.75 * ${CPU_US[nginx]}")"
    for g in $GSIDES; do
      [ "$g" = nginx ] && continue
      E99="$(calc "${P[$g.e2e_ms.99]} - ${P[direct.e2e_ms.99]}")"
      v=""
      awk -v x="${A50[$g]}" -v t="${A50[nginx]}" 'BEGIN{exit !(x <= t)}' || v="$v TTFT P50,"
      awk -v x="${A99[$g]}" -v t="${A99[nginx]}" 'BEGIN{exit !(x <= t)}' || v="$v TTFT P99,"
      awk -v x="$E99" -v t="$NE99" 'BEGIN{exit !(x <= t)}' || v="$v e2e P99,"
      awk -v x="${CPU_US[$g]}" -v t="$CPU_CAP" 'BEGIN{exit !(x <= t)}' || v="$v CPU,"
      if [ -z "$v" ]; then v="**met**"; else v="${v# }"; v="**not met** (${v%,})"; fi
      echo "| $(label "$g" | sed 's/ → mock//') | $(f3 "${A50[$g]}") ($(f3 "${A50[nginx]}")) ms | $(f3 "${A99[$g]}") ($(f3 "${A99[nginx]}")) ms | $(f3 "$E99") ($(f3 "$NE99")) ms | ${CPU_US[$g]} ($(awk -v x="$CPU_CAP" 'BEGIN{printf "%.0f", x}')) µs | $v |"
    done
    echo
    echo "nginx: $NGINX_VERSION, 1 worker, proxy_buffering off, upstream keepalive 256, no access log."
    echo
  fi
  echo "| gateway RSS ≤ 64 MB at $STREAMS concurrent streams | gateway | peak $(MIB "$PEAK_RSS_KB") MiB ($(calc "int($PEAK_RSS_KB * 1024 / 1e6 + 0.5)") MB) with $PEAK_RSS_INFLIGHT in flight; $(MIB "$RSS_AT_MAX_KB") MiB at the highest in-flight count sampled, $MAX_INFLIGHT ($(MIB $((RSS_AT_MAX_KB - RSS_AFTER_KB))) MiB above the RSS before the run) | $(yes_no "$OKRSS") |"
  echo
  echo "Gateway RSS: $(MIB "$RSS_IDLE_KB") MiB idle after start, $(MIB "$RSS_AFTER_KB") MiB after the $RATE req/s runs, peak $(MIB "$PEAK_RSS_KB") MiB during the $STREAMS-stream run (VmHWM over the whole process life $(MIB "$HWM_KB") MiB). Streams run: $(jf streams .ok) ok / $(jf streams .failed) failed / $(jf streams .dropped) dropped. Store: $REC_WRITTEN records written, $REC_DROPPED dropped, $REC_LOST lost. Traces: $SPANS_EXPORTED spans exported ($SPANS_DROPPED dropped), $( [ -n "$PRIO_NOTE" ] && echo "$SECOND_NAME: $PRIO_SPANS exported ($PRIO_SPANS_DROPPED dropped); both gateways' spans ")$SPANS_RECEIVED received by the sink.$( [ -n "$PRIO_NOTE" ] && echo " Store of the $SECOND_NAME: $PRIO_WRITTEN records written, $PRIO_DROPPED dropped, $PRIO_LOST lost.")"
} >"$WORK/table.md"

mkdir -p "$(dirname "$OUT")"
cp "$WORK/table.md" "$OUT"
cat "$OUT"
log "written to $OUT"
