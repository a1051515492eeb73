//! Admin access (issue 16, item 4): who may write, ingest and read on the admin listener.
//!
//! Cases:
//! * `token_guards_writes_and_ingest`: with `[dashboard] token` and `[admin] ingest_token`,
//!   `/api/flush`, `/api/business-metrics` and `/v1/traces` answer 401 without a token (and
//!   with a wrong one); a forged OTLP span sent without a token leaves the record as it was;
//!   the admin token opens the write routes with the scheme in lower case (`bearer`); the
//!   ingest token opens `/v1/traces` (the forged phase lands) but not the write or read routes;
//!   `/healthz` and `/metrics` stay open.
//! * `metrics_token_guards_metrics`: `[admin] metrics_auth = true` → `/metrics` 401 without a
//!   token, 200 with the metrics token or the admin token; the metrics token opens nothing else.
//! * `empty_token_refuses_to_start`: a whitespace token → the process exits non-zero with a
//!   message naming the key, before it listens.
//! * `exposed_open_admin_warns_and_refuses_writes`: `--admin-listen 0.0.0.0:0` without a token
//!   → a WARN on stderr naming what is open; writes and ingest answer 403, reads work.
//! * `business_metrics_flood_is_bounded`: per-call values (413), distinct business lines (429)
//!   and the sidecar's size (507) are capped, each with a JSON error; the file stays under its
//!   cap and keeps the values accepted before.

use crate::common::{self, post_bytes, post_json, GatewayProc, MockProc};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ADMIN: &str = "adm-7f3c9e1a";
const INGEST: &str = "ing-2b8d4f60";
const PROM: &str = "prom-5e1a7c3d";

/// GET with headers: status and body.
async fn get_with(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = http::Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::new())).expect("request");
    let resp = common::client().request(req).await.expect("GET");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn config_file(dir: &std::path::Path, text: &str) -> String {
    let p = dir.join("gw.toml");
    std::fs::write(&p, text).expect("config");
    p.to_str().expect("utf-8").to_owned()
}

/// An OTLP/JSON export with one engine span for `trace_id` saying the request queued
/// `queue_s` seconds.
fn forged_span(trace_id: &str, queue_s: f64) -> String {
    json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
        "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": [{
            "traceId": trace_id, "spanId": "1111222233334444", "parentSpanId": "5555666677778888",
            "name": "llm_request", "kind": 2,
            "startTimeUnixNano": "1796224255000000000", "endTimeUnixNano": "1796224256000000000",
            "attributes": [
                {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": queue_s}}
            ]
        }]}]
    }]})
    .to_string()
}

async fn record_with(gw: &GatewayProc, id: &str, token: &str) -> serde_json::Value {
    let auth = format!("Bearer {token}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = get_with(
            &format!("http://{}/api/requests/{id}", gw.admin),
            &[("authorization", &auth)],
        )
        .await;
        if status == 200 {
            return serde_json::from_str(&body).expect("record json");
        }
        assert!(Instant::now() < deadline, "no record {id}: {status} {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn error_code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| panic!("JSON error body: {}", String::from_utf8_lossy(body)));
    v["error"]["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_guards_writes_and_ingest() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config_file(
        dir.path(),
        &format!("[dashboard]\ntoken = \"{ADMIN}\"\n[admin]\ningest_token = \"{INGEST}\"\n"),
    );
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", &cfg], &[]);
    let admin = |p: &str| format!("http://{}{p}", gw.admin);

    let (status, headers, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        &[("x-request-id", "adm-1")],
    )
    .await;
    assert_eq!(status, 200);
    let trace = headers["x-tokenscope-trace-id"]
        .to_str()
        .expect("trace id")
        .to_owned();
    // The row's key is the gateway's own id (the client's `adm-1` is kept as data).
    let key = headers["x-tokenscope-request-id"]
        .to_str()
        .expect("key")
        .to_owned();
    let before = record_with(&gw, &key, ADMIN).await;
    assert_eq!(before["client_request_id"], "adm-1");
    let queue_before = before["queue_duration_ms"].clone();
    assert_ne!(queue_before, json!(12500.0));

    // No token, a wrong token, another scheme: 401 with a JSON error, nothing changes.
    let sidecar = gw.store.with_extension("db.business-metrics.jsonl");
    let metric = json!({"business_line": "search", "value": 5}).to_string();
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong-token")],
        vec![("authorization", "Basic YWRtaW46YWRt")],
        vec![("authorization", "Bearer")],
    ] {
        let mut h = headers.clone();
        h.push(("content-type", "application/json"));
        for path in ["/api/flush", "/api/business-metrics"] {
            let (status, resp_headers, body) = post_bytes(&admin(path), metric.clone(), &h).await;
            assert_eq!(status, 401, "{path} {headers:?}");
            assert_eq!(resp_headers["www-authenticate"], "Bearer");
            assert_eq!(error_code(&body), "unauthorized");
        }
        let (status, _, _) = post_bytes(&admin("/v1/traces"), forged_span(&trace, 12.5), &h).await;
        assert_eq!(status, 401, "/v1/traces {headers:?}");
        let (status, _) = get_with(&admin("/api/requests"), &headers).await;
        assert_eq!(status, 401, "/api/requests {headers:?}");
    }
    assert!(!sidecar.exists(), "no business metric was written");
    let after = record_with(&gw, &key, ADMIN).await;
    assert_eq!(
        after["queue_duration_ms"], queue_before,
        "a forged span without a token must not change the record"
    );
    assert_eq!(after["queue_source"], before["queue_source"]);
    // …nor the stored row.
    gw.flush_with_token(ADMIN).await;
    let rows = common::store_table(&gw.store);
    let row = rows
        .iter()
        .find(|r| r["request_id"] == key.as_str())
        .expect("row adm-1 stored");
    assert_eq!(row["queue_duration_ms"], queue_before, "{row:?}");
    assert_eq!(row["queue_source"], before["queue_source"], "{row:?}");

    // The ingest token opens /v1/traces only.
    let ingest = format!("Bearer {INGEST}");
    for path in ["/api/flush", "/api/business-metrics"] {
        let (status, _, _) = post_bytes(
            &admin(path),
            metric.clone(),
            &[
                ("authorization", &ingest),
                ("content-type", "application/json"),
            ],
        )
        .await;
        assert_eq!(status, 401, "ingest token on {path}");
    }
    let (status, _) = get_with(&admin("/api/requests"), &[("authorization", &ingest)]).await;
    assert_eq!(status, 401, "ingest token cannot read records");
    let (status, _, body) = post_bytes(
        &admin("/v1/traces"),
        forged_span(&trace, 12.5),
        &[
            ("authorization", &ingest),
            ("content-type", "application/json"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let joined = record_with(&gw, &key, ADMIN).await;
    assert_eq!(joined["queue_duration_ms"], 12500.0);
    assert_eq!(joined["queue_source"], "engine_span");

    // The admin token, scheme in lower case, opens the writes.
    let lower = format!("bearer {ADMIN}");
    let (status, _, body) = post_bytes(
        &admin("/api/business-metrics"),
        metric.clone(),
        &[
            ("authorization", &lower),
            ("content-type", "application/json"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).expect("json")["accepted"],
        1
    );
    let (status, _, _) = post_bytes(&admin("/api/flush"), "", &[("authorization", &lower)]).await;
    assert_eq!(status, 200);
    let text = std::fs::read_to_string(&sidecar).expect("sidecar written");
    assert_eq!(text.lines().count(), 1, "{text}");
    // The admin token works for ingest too (fallback).
    let (status, _, _) = post_bytes(
        &admin("/v1/traces"),
        forged_span(&trace, 0.5),
        &[
            ("authorization", &format!("BEARER {ADMIN}")),
            ("content-type", "application/json"),
        ],
    )
    .await;
    assert_eq!(status, 200);

    // Open by design: health and (without metrics_auth) /metrics.
    assert_eq!(get_with(&admin("/healthz"), &[]).await.0, 200);
    let (status, metrics) = get_with(&admin("/metrics"), &[]).await;
    assert_eq!(status, 200);
    assert!(metrics.contains("llm_requests_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_token_guards_metrics() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config_file(
        dir.path(),
        &format!(
            "[dashboard]\ntoken = \"{ADMIN}\"\n[admin]\nmetrics_auth = true\nmetrics_token = \"{PROM}\"\n"
        ),
    );
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", &cfg], &[]);
    let url = format!("http://{}/metrics", gw.admin);
    let (status, body) = get_with(&url, &[]).await;
    assert_eq!(status, 401, "{body}");
    assert!(!body.contains("llm_"), "{body}");
    assert_eq!(
        get_with(&url, &[("authorization", "Bearer nope")]).await.0,
        401
    );
    let (status, body) = get_with(&url, &[("authorization", &format!("Bearer {PROM}"))]).await;
    assert_eq!(status, 200);
    assert!(
        body.contains("llm_requests_in_flight") || body.contains("llm_"),
        "{body}"
    );
    let (status, _) = get_with(&url, &[("authorization", &format!("bearer {ADMIN}"))]).await;
    assert_eq!(status, 200, "the admin token reads /metrics too");
    // The metrics token is read-only.
    let (status, _, _) = post_bytes(
        &format!("http://{}/api/flush", gw.admin),
        "",
        &[("authorization", &format!("Bearer {PROM}"))],
    )
    .await;
    assert_eq!(status, 401);
    assert_eq!(
        get_with(&format!("http://{}/healthz", gw.admin), &[])
            .await
            .0,
        200
    );
}

/// Starts `tokenscope serve` with `args` and `env` (stdout and stderr piped, a fresh store
/// in `dir`).
pub(crate) fn spawn_serve(
    args: &[&str],
    env: &[(&str, &str)],
    dir: &std::path::Path,
) -> std::process::Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0", "--store"])
        .arg(dir.join("tokenscope.db"))
        .args(args)
        .env("TOKENSCOPE_SPOOL__DIR", dir.join("spool"))
        .env("TOKENSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn tokenscope")
}

/// Waits for the child to exit (at most `limit`).
pub(crate) fn wait_exit(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return Some(st);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn empty_token_refuses_to_start() {
    let mock = MockProc::start(&[]);
    for (key, value) in [
        ("TOKENSCOPE_DASHBOARD__TOKEN", "   "),
        ("TOKENSCOPE_DASHBOARD__TOKEN", ""),
        ("TOKENSCOPE_ADMIN__INGEST_TOKEN", " "),
    ] {
        let dir = tempfile::tempdir().expect("tmp");
        let mut child = spawn_serve(
            &["--upstream", &mock.url(), "--admin-listen", "127.0.0.1:0"],
            &[(key, value)],
            dir.path(),
        );
        let status = wait_exit(&mut child, Duration::from_secs(30));
        let Some(status) = status else {
            let _ = child.kill();
            panic!("{key}={value:?}: the gateway started with an empty token");
        };
        let mut out = String::new();
        let mut err = String::new();
        child
            .stdout
            .take()
            .expect("stdout")
            .read_to_string(&mut out)
            .expect("stdout");
        child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .expect("stderr");
        assert!(!status.success(), "{key}={value:?}: exit {status}");
        assert!(!out.contains("listening"), "{key}: it listened: {out}");
        assert!(err.contains("is empty"), "{key}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exposed_open_admin_warns_and_refuses_writes() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let mut child = spawn_serve(
        &["--upstream", &mock.url(), "--admin-listen", "0.0.0.0:0"],
        &[],
        dir.path(),
    );
    let mut line = String::new();
    // Kept open until the end: the gateway must not see a closed stdout.
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    std::io::BufRead::read_line(&mut stdout, &mut line).expect("ready line");
    let port: u16 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("admin="))
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no admin= in {line:?}"));
    let admin = |p: &str| format!("http://127.0.0.1:{port}{p}");
    let (status, _, body) = post_bytes(&admin("/api/flush"), "", &[]).await;
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "open_admin_refused");
    let (status, _, body) = post_bytes(
        &admin("/api/business-metrics"),
        json!({"business_line": "x", "value": 1}).to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = post_bytes(
        &admin("/v1/traces"),
        forged_span("0af7651916cd43dd8448eb211c80319c", 1.0),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(get_with(&admin("/api/requests"), &[]).await.0, 200);
    assert_eq!(get_with(&admin("/metrics"), &[]).await.0, 200);
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    let warning = err
        .lines()
        .find(|l| l.contains("ADMIN LISTENER EXPOSED WITHOUT A TOKEN"))
        .unwrap_or_else(|| panic!("no warning on stderr: {err}"));
    assert!(warning.contains("WARN"), "{warning}");
    for open in ["/metrics", "/api/requests", "403", "[dashboard] token"] {
        assert!(warning.contains(open), "{open} not named: {warning}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_metrics_flood_is_bounded() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config_file(
        dir.path(),
        "[admin]\nbusiness_metrics_max_bytes = 4096\nbusiness_metrics_max_points = 20\nbusiness_metrics_max_lines = 3\n",
    );
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", &cfg], &[]);
    let url = format!("http://{}/api/business-metrics", gw.admin);
    let sidecar = gw.store.with_extension("db.business-metrics.jsonl");
    let ct = [("content-type", "application/json")];
    let points = |line: &str, n: usize| {
        json!((0..n)
            .map(|i| json!({"business_line": line, "value": i, "at": 1_700_000_000 + i}))
            .collect::<Vec<_>>())
        .to_string()
    };

    // Too many values in one call: 413, nothing written.
    let (status, _, body) = post_bytes(&url, points("search", 21), &ct).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "too_many_values");
    assert!(!sidecar.exists());

    // Three lines are fine; a fourth is refused whole (429), the others stay.
    for line in ["search", "ads", "support"] {
        let (status, _, body) = post_bytes(&url, points(line, 1), &ct).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    let mixed = json!([
        {"business_line": "search", "value": 1},
        {"business_line": "flood-1", "value": 1}
    ])
    .to_string();
    let (status, _, body) = post_bytes(&url, mixed, &ct).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "too_many_business_lines");
    let text = std::fs::read_to_string(&sidecar).expect("sidecar");
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(!text.contains("flood-1"));

    // A flood of values for known lines: the file stops at its cap with 507.
    let mut accepted = 3usize;
    let mut full = None;
    for _ in 0..100 {
        let (status, _, body) = post_bytes(&url, points("search", 20), &ct).await;
        match status {
            200 => accepted += 20,
            507 => {
                full = Some(error_code(&body));
                break;
            }
            s => panic!("unexpected {s}: {}", String::from_utf8_lossy(&body)),
        }
    }
    assert_eq!(full.as_deref(), Some("sidecar_full"));
    let size = std::fs::metadata(&sidecar).expect("sidecar").len();
    assert!(size <= 4096, "sidecar grew to {size} bytes");
    let text = std::fs::read_to_string(&sidecar).expect("sidecar");
    assert_eq!(
        text.lines().count(),
        accepted,
        "accepted values are all kept"
    );
    // Still full: a small value is refused too, the file is unchanged.
    let (status, _, _) = post_bytes(&url, points("ads", 1), &ct).await;
    assert_eq!(status, 507);
    assert_eq!(std::fs::metadata(&sidecar).expect("sidecar").len(), size);
}
