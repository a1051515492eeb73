//! Exhaustion (issue 16, item 6): no client can stall the gateway or make it hold unbounded
//! memory; every limit answers clearly and measured requests still leave exactly one row.
//!
//! Cases (requests sent → rows, and what the client sees):
//! * 1,100 connections to the proxy and 200 to the admin listener that never finish their
//!   headers, open-file limit 1024 → a normal request succeeds within a second, `/healthz`
//!   answers, the evictions are counted; 1 row (the normal request).
//! * A client that stops reading a long stream → after `client_write_timeout_ms` the
//!   connection is closed and the engine's slot freed; 1 row, `cancelled` /
//!   `client_write_timeout`.
//! * A request body that stops arriving → `408` after `body_timeout_ms`; 1 row,
//!   `client_error` / `client_body_timeout`.
//! * Headers that stop arriving → the connection is closed after `header_timeout_ms`; 0 rows.
//! * A 10 KB attribution header → stored cut at `max_attribution_bytes` and marked; a head over
//!   `max_header_bytes` → `431`, 0 rows.

use crate::common::*;
use crate::shutdown::LoggedGateway;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Holds `n` connections to each address open with an unfinished request head, from a Python
/// child process (which raises its own open-file limit). Killed on drop.
struct Holder(std::process::Child);

impl Holder {
    fn start(targets: &[(SocketAddr, usize)]) -> Self {
        let spec: Vec<String> = targets
            .iter()
            .map(|(a, n)| format!("{}:{}:{n}", a.ip(), a.port()))
            .collect();
        let script = r#"
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = []
for spec in sys.argv[1:]:
    host, port, n = spec.rsplit(":", 2)
    for _ in range(int(n)):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
print("held", len(socks), flush=True)
time.sleep(600)
"#;
        let mut child = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .args(&spec)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
            &mut line,
        )
        .expect("holder line");
        assert!(line.starts_with("held"), "holder: {line:?}");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn chat(stream: bool) -> serde_json::Value {
    json!({"model": "m", "stream": stream, "max_tokens": 5,
           "messages": [{"role": "user", "content": "hello"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_do_not_lock_out_clients_or_healthz() {
    let mock = MockProc::start(&[]);
    let gw = LoggedGateway::start_limited(&mock.url(), &[], Some(1024));
    let holder = tokio::task::spawn_blocking({
        let (p, a) = (gw.proxy, gw.admin);
        move || Holder::start(&[(p, 1100), (a, 200)])
    })
    .await
    .expect("holder");

    let t = Instant::now();
    let (status, _, body) = post_json(&gw.url("/v1/chat/completions"), &chat(false), &[]).await;
    let took = t.elapsed();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(
        took < Duration::from_secs(1),
        "a normal request took {took:?}"
    );
    let (hs, hb) = get(&format!("http://{}/healthz", gw.admin)).await;
    assert_eq!((hs, hb.as_str()), (200, "ok"));
    let m = get(&format!("http://{}/metrics", gw.admin)).await.1;
    assert!(
        metric_where(
            &m,
            "tokenscope_connections_evicted_total",
            &[("listener", "proxy")]
        ) >= 1.0,
        "{m}"
    );
    assert!(
        metric_where(
            &m,
            "tokenscope_connections_evicted_total",
            &[("listener", "admin")]
        ) >= 1.0
    );
    drop(holder);
    let mut gw = gw;
    let _ = tokio::task::spawn_blocking(move || {
        gw.terminate();
        gw
    })
    .await
    .map(|gw| {
        let rows = store_rows(&gw.store);
        assert_eq!(rows.len(), 1, "only the normal request is a row");
        assert_eq!(rows[0]["outcome"], "ok");
    });
}

/// Reads a response head from a raw socket: (status, head text).
async fn read_head(s: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut b = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut b).await {
            Ok(1) => buf.push(b[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head)
}

fn header_value(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_and_frees_the_engine() {
    let mock = MockProc::start(&["--time-scale", "0"]);
    let gw = GatewayProc::start(
        &mock.url(),
        &[("TOKENSCOPE_LIMITS__CLIENT_WRITE_TIMEOUT_MS", "1000")],
    );
    let body = json!({"model": "m", "stream": true, "max_tokens": 2_000_000,
        "mock_output_tokens": 2_000_000,
        "messages": [{"role": "user", "content": "everything"}]})
    .to_string();
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    let mut s = sock.connect(gw.proxy).await.expect("connect");
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("send");
    let t = Instant::now();
    let (status, head) = read_head(&mut s).await;
    assert_eq!(status, 200, "{head}");
    let id = header_value(&head, "x-request-id").expect("request id");
    // Stop reading. The record appears once the gateway gave up on us.
    let rec = gw.record(&id).await;
    let waited = t.elapsed();
    assert_eq!(rec["outcome"], "cancelled", "{rec}");
    assert_eq!(rec["error_type"], "client_write_timeout", "{rec}");
    let out = rec["output_tokens"].as_u64().unwrap_or(0);
    assert!(out > 0 && out < 2_000_000, "{rec}");
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    // Nothing of it is left in flight, at the gateway or at the engine.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let g = metric_sum(&gw.metrics().await, "llm_requests_in_flight");
        let e = mock.metrics().await;
        let running = metric_sum(&e, "vllm:num_requests_running")
            + metric_sum(&e, "llamacpp:requests_processing");
        if g == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "gateway {g} / engine {running} still busy"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = metric_where(
        &gw.metrics().await,
        "tokenscope_connections_write_timeouts_total",
        &[("listener", "proxy")],
    );
    assert_eq!(c, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_gets_408_and_one_row() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(
        &mock.url(),
        &[("TOKENSCOPE_LIMITS__BODY_TIMEOUT_MS", "800")],
    );
    let mut s = TcpStream::connect(gw.proxy).await.expect("connect");
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .expect("send");
    let t = Instant::now();
    let (status, head) = read_head(&mut s).await;
    assert_eq!(status, 408, "{head}");
    assert!(t.elapsed() >= Duration::from_millis(700));
    let id = header_value(&head, "x-request-id").expect("request id");
    let rec = gw.record(&id).await;
    assert_eq!(rec["outcome"], "client_error");
    assert_eq!(rec["error_type"], "client_body_timeout");
    assert_eq!(rec["http_status"], 408);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_stop_arriving_are_closed_after_the_header_timeout() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(
        &mock.url(),
        &[("TOKENSCOPE_LIMITS__HEADER_TIMEOUT_MS", "800")],
    );
    let mut s = TcpStream::connect(gw.proxy).await.expect("connect");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("send");
    let t = Instant::now();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await;
    let took = t.elapsed();
    assert!(read.is_ok(), "the connection stayed open");
    assert!(took >= Duration::from_millis(700), "closed after {took:?}");
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
    let (_, body) = get(&format!("http://{}/api/requests", gw.admin)).await;
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    let n = v
        .as_array()
        .or_else(|| v["requests"].as_array())
        .map_or(0, Vec::len);
    assert_eq!(n, 0, "no request reached the handler: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_attribution_is_cut_and_marked_and_huge_heads_get_431() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let long_user = "u".repeat(10 * 1024);
    let long_line = "b".repeat(300);
    let (status, headers, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &chat(false),
        &[
            ("x-tokenscope-user", &long_user),
            ("x-tokenscope-business-line", &long_line),
        ],
    )
    .await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().expect("id").to_owned();
    let rec = gw.record(&id).await;
    let user = rec["user_id"].as_str().expect("user");
    assert_eq!(user, format!("{}…[truncated]", "u".repeat(256)));
    let line = rec["business_line"].as_str().expect("line");
    assert_eq!(line, format!("{}…[truncated]", "b".repeat(256)));

    // A head over max_header_bytes (64 KiB): 431, no record.
    let huge = "h".repeat(100 * 1024);
    let mut s = TcpStream::connect(gw.proxy).await.expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-tokenscope-user: {huge}\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    // The gateway may answer (and close) before it has read everything.
    let _ = s.write_all(head.as_bytes()).await;
    let (status, head) = read_head(&mut s).await;
    assert_eq!(status, 431, "{head}");
    let (_, body) = get(&format!("http://{}/api/requests", gw.admin)).await;
    assert_eq!(body.matches("\"request_id\"").count(), 1, "{body}");
}

/// A ~15 MB OTLP export posted to the admin listener while a client streams through the proxy:
/// the admin work runs on the background runtime, so the stream's inter-token gaps during the
/// post stay far below the post's own duration (on one shared runtime they grew to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_otlp_export_does_not_stall_proxying() {
    use http_body_util::BodyExt;
    let mock = MockProc::start(&["--time-scale", "1"]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    // ~15 MB of spans that join nothing (unknown trace ids).
    let span = |i: usize| {
        json!({"traceId": format!("{:032x}", i + 1), "spanId": format!("{:016x}", i + 1),
        "name": "llm_request", "kind": 2,
        "startTimeUnixNano": "1796224255000000000", "endTimeUnixNano": "1796224256000000000",
        "attributes": [
            {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.5}},
            {"key": "gen_ai.latency.time_in_model_prefill", "value": {"doubleValue": 0.25}},
            {"key": "padding", "value": {"stringValue": "p".repeat(100)}}
        ]})
    };
    let spans: Vec<_> = (0..30_000).map(span).collect();
    let export = json!({"resourceSpans": [{"resource": {"attributes": []},
        "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": spans}]}]})
    .to_string();
    assert!(
        (14_000_000..16 << 20).contains(&export.len()),
        "{}",
        export.len()
    );

    let (max_gap, post, frames) = stream_gaps_during(&gw, async {
        let req = http::Request::post(format!("http://{}/v1/traces", gw.admin))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(export)))
            .expect("otlp");
        let resp = client().request(req).await.expect("otlp post");
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        assert!(status.is_success(), "{status}");
    })
    .await;
    assert!(
        post >= Duration::from_millis(150),
        "the export took only {post:?}: not a load"
    );
    assert!(
        frames >= 3 && max_gap * 3 < post,
        "stream gaps up to {max_gap:?} during a {post:?} export ({frames} frames)"
    );
}

/// Streams through the gateway (one token every ~8 ms from a `--time-scale 1` mock) while
/// `work` runs: (the largest gap between the stream's frames while it ran, how long it ran,
/// frames received meanwhile).
async fn stream_gaps_during(
    gw: &GatewayProc,
    work: impl std::future::Future<Output = ()>,
) -> (Duration, Duration, usize) {
    use http_body_util::BodyExt;
    let body = json!({"model": "m", "stream": true, "max_tokens": 5000, "mock_output_tokens": 5000,
        "messages": [{"role": "user", "content": "go"}]});
    let req = http::Request::post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = client().request(req).await.expect("stream");
    assert_eq!(resp.status(), 200);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let reader = tokio::spawn(async move {
        let mut body = resp.into_body();
        let mut arrivals = Vec::new();
        let mut rx = rx;
        loop {
            tokio::select! {
                _ = &mut rx => break,
                f = body.frame() => match f {
                    Some(Ok(_)) => arrivals.push(Instant::now()),
                    _ => break,
                },
            }
        }
        arrivals
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    work.await;
    let t1 = Instant::now();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = tx.send(());
    let arrivals = reader.await.expect("reader");
    let during: Vec<_> = arrivals
        .iter()
        .copied()
        .filter(|a| *a >= t0 && *a <= t1 + Duration::from_millis(200))
        .collect();
    let took = t1 - t0;
    let max_gap = during.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(took);
    (max_gap, took, during.len())
}

/// A 7-day dashboard page over 300 000 stored rows while a client streams through the proxy:
/// the page is computed on the background runtime, so the stream's gaps stay far below the
/// page's own duration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seven_day_dashboard_page_does_not_stall_proxying() {
    use tokenscope_core::{InputBucket, Outcome, RequestRecord};
    let dir = tempfile::tempdir().expect("tmp");
    let store = dir.path().join("big.db");
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    {
        let mut db = tokenscope_store::SqliteStore::open(&store).expect("open store");
        let span_us = 7 * 86_400 * 1_000_000i64 - 60_000_000;
        for chunk in 0..30 {
            let rows: Vec<RequestRecord> = (0..10_000)
                .map(|j| {
                    let i = chunk * 10_000 + j;
                    RequestRecord {
                        request_id: format!("big-{i}"),
                        trace_id: format!("{:032x}", i + 1),
                        created_at: now_us - 60_000_000 - (i as i64 * span_us / 300_000),
                        model: format!("m-{}", i % 3),
                        request_type: "chat".into(),
                        business_line: Some(format!("line-{}", i % 5)),
                        user_id: Some(format!("user-{}", i % 97)),
                        input_tokens: Some(100 + (i % 900) as u64),
                        output_tokens: Some(20 + (i % 200) as u64),
                        input_bucket: Some(InputBucket::B0To128),
                        total_duration_ms: 500.0 + (i % 1000) as f64,
                        ttft_ms: Some(50.0 + (i % 100) as f64),
                        tpot_ms: Some(5.0),
                        outcome: Outcome::Ok,
                        http_status: 200,
                        ..RequestRecord::default()
                    }
                })
                .collect();
            db.insert_batch(&rows).expect("seed rows");
        }
    }
    let mock = MockProc::start(&["--time-scale", "1"]);
    let store_arg = store.to_string_lossy().into_owned();
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--store", &store_arg], &[]);
    let (max_gap, page, frames) = stream_gaps_during(&gw, async {
        let (status, body) = get(&format!(
            "http://{}/api/dashboard/overview?range=7d",
            gw.admin
        ))
        .await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert!(body.len() > 100, "{v}");
    })
    .await;
    assert!(
        page >= Duration::from_millis(150),
        "the page took only {page:?}: not a load"
    );
    assert!(
        frames >= 3 && max_gap * 8 < page,
        "stream gaps up to {max_gap:?} during a {page:?} dashboard page ({frames} frames)"
    );
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// 1,000 requests, each with 60 KB attribution headers (under the head limit): every record,
/// the recent-records ring and the labels hold the bounded values, so the gateway's memory
/// does not grow with what clients send (it grew by ~400 KB per request before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_attribution_headers_do_not_grow_memory() {
    let mock = MockProc::start(&["--time-scale", "0"]);
    let gw = GatewayProc::start(&mock.url(), &[("TOKENSCOPE_METRICS__USER_LABEL", "top_k")]);
    let url = gw.url("/v1/chat/completions");
    let send = |i: usize| {
        let url = url.clone();
        async move {
            let user = format!("{i:06}{}", "x".repeat(30_000));
            let line = format!("{i:06}{}", "y".repeat(30_000));
            let (status, _, _) = post_json(
                &url,
                &chat(false),
                &[
                    ("x-tokenscope-user", &user),
                    ("x-tokenscope-business-line", &line),
                ],
            )
            .await;
            assert_eq!(status, 200);
        }
    };
    for i in 0..50 {
        send(i).await;
    }
    let before = rss_kib(gw.child.id());
    for chunk in (50..1050).collect::<Vec<_>>().chunks(8) {
        futures_util::future::join_all(chunk.iter().map(|&i| send(i))).await;
    }
    let after = rss_kib(gw.child.id());
    let grown_mib = after.saturating_sub(before) as f64 / 1024.0;
    assert!(
        grown_mib < 24.0,
        "RSS {before} → {after} KiB over 1 000 requests with 60 KB of attribution each"
    );
}
