//! Upstream replicas (issue 18, item 3): one upstream with several `urls`.
//!
//! Cases:
//! * `mock_load_follows_outstanding_requests`: two mock engines. A long stream held on one
//!   replica sends every following request to the other; concurrent streams are spread over
//!   both; the records' `replica` agrees with what each mock served.
//! * `mock_dead_replica_is_ejected_and_no_request_fails`: one replica a dead port — every
//!   request succeeds (retried on the live one), every record names the live replica, the
//!   dead one is ejected once (metrics) and, after the ejection, probed by one request that
//!   still succeeds.
//! * `mock_request_reset_after_it_was_written_is_not_retried`: a replica that reads the
//!   request and closes the connection — that request fails (`upstream_error`, the record
//!   names that replica), is never sent to the other replica, and does not eject it.
//! * `real_llama_replicas_spread_fail_over_and_probe_back` (the acceptance test): two real
//!   llama.cpp servers behind one upstream. Load spread by outstanding requests, the engine
//!   state on a record is its replica's; one replica killed while requests keep arriving —
//!   no request fails that had not reached it —; restarted on the same port, it is probed back
//!   after its ejection and serves again.

mod common;
#[path = "llama/mod.rs"]
mod llama;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A gateway whose one upstream `pool` has `urls`, with `extra` TOML lines in its table.
fn gateway(urls: &[String], extra: &str) -> (GatewayProc, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("replicas.toml");
    let list = urls
        .iter()
        .map(|u| format!("\"{u}\""))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        &cfg,
        format!("[[upstreams]]\nname = \"pool\"\nurls = [{list}]\n{extra}\n"),
    )
    .expect("write config");
    let gw =
        GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf-8 path")], &[]);
    (gw, dir)
}

/// A chat request that generates exactly `max_tokens` tokens: the mock's
/// `mock_output_tokens`, llama.cpp's `ignore_eos` (each ignores the other's field).
fn chat(max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "mock_output_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0,
        "stream": stream,
    })
}

/// `tokenscope_upstream_*{replica}` of the gateway.
async fn replica_metric(gw: &GatewayProc, name: &str, replica: &str) -> f64 {
    metric_where(&gw.metrics().await, name, &[("replica", replica)])
}

/// Waits until `cond` holds on the gateway's metrics (at most `within`).
async fn wait_metrics(gw: &GatewayProc, within: Duration, what: &str, cond: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        if cond(&gw.metrics().await) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One non-streamed request; returns its status and the record.
async fn one(gw: &GatewayProc, max_tokens: u64) -> (u16, Value) {
    let (status, headers, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &chat(max_tokens, false),
        &[],
    )
    .await;
    let id = headers["x-tokenscope-request-id"]
        .to_str()
        .expect("id")
        .to_owned();
    (status, gw.record(&id).await)
}

/// Records per replica, over every record the gateway holds.
async fn by_replica(gw: &GatewayProc) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in gw.records().await {
        *out.entry(r["replica"].as_str().unwrap_or("").to_owned())
            .or_default() += 1;
    }
    out
}

/// The mock's own count of requests it ran to completion.
async fn mock_finished(m: &MockProc) -> usize {
    metric_sum(
        &m.metrics().await,
        "tokenscope_mock_requests_finished_total",
    ) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_load_follows_outstanding_requests() {
    // Real-time mocks (8 ms per decode step): a 300-token stream lasts seconds.
    let a = MockProc::start(&["--time-scale", "1"]);
    let b = MockProc::start(&["--time-scale", "1"]);
    let (ra, rb) = (a.addr.to_string(), b.addr.to_string());
    let (gw, _dir) = gateway(&[a.url(), b.url()], "");
    let url = gw.url("/v1/chat/completions");

    // A long stream holds one replica…
    let long = {
        let url = url.clone();
        tokio::spawn(async move { stream(&url, &chat(300, true), &[], None).await })
    };
    wait_metrics(
        &gw,
        Duration::from_secs(20),
        "one outstanding request",
        |m| metric_sum(m, "tokenscope_upstream_outstanding_requests") == 1.0,
    )
    .await;
    let held = if replica_metric(&gw, "tokenscope_upstream_outstanding_requests", &ra).await == 1.0
    {
        ra.clone()
    } else {
        rb.clone()
    };
    let other = if held == ra { rb.clone() } else { ra.clone() };
    // …so every request meanwhile goes to the other one (fewer outstanding), whatever the
    // round-robin tie-break would say.
    for _ in 0..6 {
        let (status, rec) = one(&gw, 3).await;
        assert_eq!(status, 200);
        assert_eq!(rec["replica"], other.as_str(), "{rec}");
        assert_eq!(rec["upstream"], "pool");
    }
    let long = long.await.expect("long stream");
    assert_eq!(long.status, 200);
    assert_eq!(
        gw.record(&long.request_id()).await["replica"],
        held.as_str()
    );

    // Concurrent streams are spread over both.
    let n = 12;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { stream(&url, &chat(40, true), &[], None).await })
        })
        .collect();
    for t in tasks {
        let s = t.await.expect("stream");
        assert_eq!(s.status, 200);
        assert!(!s.output_events().is_empty());
    }
    let ids: Vec<String> = gw
        .records()
        .await
        .iter()
        .filter_map(|r| r["request_id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(ids.len(), 1 + 6 + n);
    let counts = by_replica(&gw).await;
    let (ca, cb) = (counts[&ra], counts[&rb]);
    assert_eq!(ca + cb, 1 + 6 + n, "{counts:?}");
    // The 12 concurrent ones: each replica took a fair share (least outstanding alternates
    // while they overlap).
    let (concurrent_a, concurrent_b) = if held == ra {
        (ca - 1, cb - 6)
    } else {
        (ca - 6, cb - 1)
    };
    assert!(concurrent_a >= n / 4 && concurrent_b >= n / 4, "{counts:?}");
    // What the records say each replica served is what each engine counted.
    assert_eq!(mock_finished(&a).await, ca);
    assert_eq!(mock_finished(&b).await, cb);
    // Nothing outstanding once every response ended.
    wait_metrics(
        &gw,
        Duration::from_secs(10),
        "no outstanding request",
        |m| metric_sum(m, "tokenscope_upstream_outstanding_requests") == 0.0,
    )
    .await;
    assert_eq!(
        metric_sum(&gw.metrics().await, "tokenscope_upstream_ejections_total"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_dead_replica_is_ejected_and_no_request_fails() {
    let live = MockProc::start(&[]);
    let dead = format!("127.0.0.1:{}", dead_port());
    let rl = live.addr.to_string();
    // Every ejection lasts 1.5 s.
    let (gw, _dir) = gateway(
        &[format!("http://{dead}"), live.url()],
        "eject_ms = 1500\neject_max_ms = 1500",
    );
    let url = gw.url("/v1/chat/completions");
    // Concurrent and sequential requests: none fails.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { stream(&url, &chat(5, i % 2 == 0), &[], None).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("request").status, 200);
    }
    for _ in 0..4 {
        let (status, rec) = one(&gw, 3).await;
        assert_eq!(status, 200);
        assert_eq!(rec["replica"], rl.as_str());
    }
    let records = gw.records().await;
    assert_eq!(records.len(), 12);
    for r in &records {
        assert_eq!(r["outcome"], "ok", "{r}");
        assert_eq!(r["replica"], rl.as_str(), "{r}");
    }
    assert_eq!(mock_finished(&live).await, 12);
    let ejected = replica_metric(&gw, "tokenscope_upstream_ejections_total", &dead).await;
    assert!(ejected >= 1.0, "the dead replica was ejected");
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_replica_healthy", &dead).await,
        0.0
    );
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_replica_healthy", &rl).await,
        1.0
    );
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_ejections_total", &rl).await,
        0.0
    );
    // After the ejection the next request probes the dead replica first: refused, ejected
    // again, and the request still succeeds on the live one.
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let (status, rec) = one(&gw, 3).await;
    assert_eq!(status, 200);
    assert_eq!(rec["replica"], rl.as_str());
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_ejections_total", &dead).await,
        ejected + 1.0,
        "the failed probe ejected it again"
    );
    assert_eq!(mock_finished(&live).await, 13);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_request_reset_after_it_was_written_is_not_retried() {
    // Reads a request head, then closes the connection without answering; counts the chat
    // requests it took.
    let resetter = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let rr = resetter.local_addr().expect("addr").to_string();
    let taken = Arc::new(AtomicUsize::new(0));
    {
        let taken = taken.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = resetter.accept().await {
                let taken = taken.clone();
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    // (Engine-state scrapes and the model list are refused the same way.)
                    if got.starts_with(b"POST /v1/chat/completions ") {
                        taken.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = s.shutdown().await;
                });
            }
        });
    }
    let live = MockProc::start(&[]);
    let rl = live.addr.to_string();
    let (gw, _dir) = gateway(&[format!("http://{rr}"), live.url()], "");
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..6 {
        let (status, rec) = one(&gw, 3).await;
        if status == 200 {
            ok += 1;
            assert_eq!(rec["replica"], rl.as_str());
            assert_eq!(rec["outcome"], "ok");
        } else {
            failed += 1;
            assert_eq!(status, 502, "{rec}");
            assert_eq!(rec["replica"], rr.as_str(), "{rec}");
            assert_eq!(rec["outcome"], "upstream_error");
            assert_eq!(rec["error_type"], "upstream_failed");
        }
    }
    // Idle replicas alternate: both were used; each failed request reached the resetter
    // once and never the live engine.
    assert!(failed >= 1 && ok >= 1, "ok {ok}, failed {failed}");
    assert_eq!(taken.load(Ordering::SeqCst), failed);
    assert_eq!(mock_finished(&live).await, ok);
    // A request that was written is no verdict on the replica.
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_ejections_total", &rr).await,
        0.0
    );
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_replica_healthy", &rr).await,
        1.0
    );
}

/// One request of the kill phase: when it started, whether the client got a complete answer.
struct Sent {
    started: Instant,
    ok: bool,
    id: Option<String>,
}

async fn send_one(url: &str, i: usize) -> Sent {
    let started = Instant::now();
    let streamed = i.is_multiple_of(2);
    let body = chat(8, streamed);
    if streamed {
        let s = stream(url, &body, &[], None).await;
        let done = s.raw.windows(6).any(|w| w == b"[DONE]");
        let id = s
            .headers
            .get("x-tokenscope-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Sent {
            started,
            ok: s.status == 200 && done,
            id,
        }
    } else {
        let (status, headers, _) = post_json(url, &body, &[]).await;
        let id = headers
            .get("x-tokenscope-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Sent {
            started,
            ok: status == 200,
            id,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llama_replicas_spread_fail_over_and_probe_back() {
    let args = ["-np", "2", "-c", "2048"];
    let Some(a) = llama::start(&args).await else {
        return;
    };
    let Some(b) = llama::start(&args).await else {
        return;
    };
    let (ra, rb) = (
        format!("127.0.0.1:{}", a.port),
        format!("127.0.0.1:{}", b.port),
    );
    let b_port = b.port;
    let (gw, _dir) = gateway(
        &[a.url(), b.url()],
        "eject_ms = 500\neject_max_ms = 2000\nscrape_interval_ms = 300",
    );
    let url = gw.url("/v1/chat/completions");

    // 1. Spread by outstanding requests: a long stream holds one replica; meanwhile every
    //    request goes to the other, and carries that replica's engine state.
    let long = {
        let url = url.clone();
        tokio::spawn(async move { stream(&url, &chat(400, true), &[], None).await })
    };
    wait_metrics(
        &gw,
        Duration::from_secs(60),
        "one outstanding request",
        |m| metric_sum(m, "tokenscope_upstream_outstanding_requests") == 1.0,
    )
    .await;
    let held = if replica_metric(&gw, "tokenscope_upstream_outstanding_requests", &ra).await == 1.0
    {
        ra.clone()
    } else {
        rb.clone()
    };
    let other = if held == ra { rb.clone() } else { ra.clone() };
    // The scrapes see the held replica busy and the other idle.
    wait_metrics(
        &gw,
        Duration::from_secs(30),
        "per-replica engine state",
        |m| {
            metric_where(m, "llm_engine_requests_running", &[("replica", &held)]) >= 1.0
                && metric_where(m, "llm_engine_state_up", &[("replica", &other)]) == 1.0
                && metric_where(m, "llm_engine_requests_running", &[("replica", &other)]) == 0.0
        },
    )
    .await;
    let (status, rec) = one(&gw, 4).await;
    assert_eq!(status, 200);
    assert_eq!(rec["replica"], other.as_str(), "{rec}");
    assert_eq!(
        rec["engine_running"], 0.0,
        "the serving replica's state: {rec}"
    );
    for _ in 0..3 {
        let (status, rec) = one(&gw, 4).await;
        assert_eq!(status, 200);
        assert_eq!(rec["replica"], other.as_str(), "{rec}");
    }
    let long = long.await.expect("long stream");
    assert_eq!(long.status, 200);
    assert_eq!(
        gw.record(&long.request_id()).await["replica"],
        held.as_str()
    );
    // Concurrent streams land on both.
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { stream(&url, &chat(16, true), &[], None).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("stream").status, 200);
    }
    let counts = by_replica(&gw).await;
    assert!(
        counts.get(&ra).copied().unwrap_or(0) >= 2 && counts.get(&rb).copied().unwrap_or(0) >= 2,
        "{counts:?}"
    );

    // 2. B killed while requests keep arriving (concurrency 3).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let mut sent = Vec::new();
                let mut i = w;
                while !stop.load(Ordering::SeqCst) {
                    sent.push(send_one(&url, i).await);
                    i += 3;
                }
                sent
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(b); // SIGKILL, reaped
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::SeqCst);
    let mut sent = Vec::new();
    for w in workers {
        sent.extend(w.await.expect("worker"));
    }
    let after: Vec<&Sent> = sent.iter().filter(|s| s.started >= killed).collect();
    assert!(after.len() >= 3, "requests kept arriving: {}", after.len());
    for s in &after {
        assert!(s.ok, "a request sent after the kill failed: {:?}", s.id);
        let rec = gw.record(s.id.as_deref().expect("id")).await;
        assert_eq!(rec["replica"], ra.as_str(), "{rec}");
        assert_eq!(rec["outcome"], "ok");
    }
    // Failures only of requests in flight on B when it died.
    for s in sent.iter().filter(|s| !s.ok) {
        assert!(s.started < killed);
        if let Some(id) = &s.id {
            let rec = gw.record(id).await;
            assert_eq!(rec["replica"], rb.as_str(), "{rec}");
            assert_eq!(rec["outcome"], "upstream_error", "{rec}");
        }
    }
    assert!(replica_metric(&gw, "tokenscope_upstream_ejections_total", &rb).await >= 1.0);
    eprintln!(
        "kill phase: {} requests, {} after the kill (all ok), {} failed in flight on the killed replica",
        sent.len(),
        after.len(),
        sent.iter().filter(|s| !s.ok).count()
    );

    // 3. B restarted on the same port: after its ejection it is probed and serves again.
    let Some(_b2) = llama::start_on(b_port, &args).await else {
        panic!("llama.cpp vanished");
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut back = None;
    let mut i = 0;
    while back.is_none() {
        assert!(
            Instant::now() < deadline,
            "the restarted replica was never probed back"
        );
        let s = send_one(&url, i).await;
        i += 1;
        assert!(s.ok, "a request failed after the restart: {:?}", s.id);
        let rec = gw.record(s.id.as_deref().expect("id")).await;
        if rec["replica"] == rb.as_str() {
            assert_eq!(rec["outcome"], "ok");
            back = Some(rec);
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_eq!(
        replica_metric(&gw, "tokenscope_upstream_replica_healthy", &rb).await,
        1.0
    );
    eprintln!("restart phase: probed back after {i} requests");
}
