//! Upstream connections (issue 16, item 1): the gateway must not add errors in front of an
//! engine that closes idle keep-alive connections.
//!
//! Engines close a keep-alive connection after a few idle seconds (llama.cpp's cpp-httplib:
//! 5 s, advertised as `Keep-Alive: timeout=5, max=100`; vLLM/SGLang's uvicorn: 5 s, not
//! advertised). A pooled connection reused just as the engine closes it carries a request the
//! engine never answers — and that request cannot be sent again, because nothing tells the
//! gateway whether the engine read it. The gateway therefore retires pooled connections before
//! the engine does.
//!
//! Cases:
//! * `real_llama_idle_gaps_through_gateway_equal_direct`: 240 requests (streamed and not,
//!   concurrency 4, `max_tokens` 4) to the real llama.cpp in three rounds separated by idle
//!   gaps straddling its 5 s keep-alive timeout, once directly and once through the gateway:
//!   both error counts 0; one store row per request through the gateway, each `ok`.
//! * `closing_server_*`: an in-test HTTP/1.1 server that closes a connection after N ms of
//!   idle time — modelling a real network, the close reaches the client only `FIN_DELAY`
//!   later, and whatever the client writes meanwhile is never read — with and without
//!   advertising `Keep-Alive: timeout`. Measured and pass-through requests are sent at idle
//!   gaps below, inside and after the closing window: 0 failures, and every request reaches
//!   the server exactly once.

use super::common::*;
use super::llama;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request with a fresh client connection (so the client side never reuses a connection
/// the gateway or the engine closed); `Err` describes a failure as the client saw it.
async fn send(
    method: &str,
    url: &str,
    body: Option<&serde_json::Value>,
    id: &str,
) -> Result<Bytes, String> {
    let mut req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("x-request-id", id);
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Bytes::from(b.to_string())
        }
        None => Bytes::new(),
    };
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = client()
        .request(req)
        .await
        .map_err(|e| format!("transport: {e:?}"))?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    if status != 200 {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
    }
    Ok(bytes)
}

// ---------------------------------------------------------------------------------------------
// The real llama.cpp

fn chat(i: usize, stream: bool) -> serde_json::Value {
    json!({
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": format!("Count to {}.", i % 7 + 2)}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
    })
}

/// Sends `per_round` requests per round (every other one streamed) with 4 in flight, sleeping
/// `gaps[k]` after round `k`. Returns the request ids and the failures.
async fn rounds(
    base: &str,
    tag: &str,
    per_round: usize,
    gaps: &[Duration],
) -> (Vec<String>, Vec<String>) {
    let mut ids = Vec::new();
    let mut errors = Vec::new();
    for round in 0..=gaps.len() {
        let next = Arc::new(AtomicUsize::new(0));
        let mut workers = Vec::new();
        for _ in 0..4 {
            let (next, base, tag) = (next.clone(), base.to_owned(), tag.to_owned());
            workers.push(tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= per_round {
                        return out;
                    }
                    let n = round * per_round + i;
                    let stream = n % 2 == 1;
                    let id = format!("{tag}-{n}");
                    let res = send(
                        "POST",
                        &format!("{base}/v1/chat/completions"),
                        Some(&chat(n, stream)),
                        &id,
                    )
                    .await
                    .and_then(|b| {
                        let text = String::from_utf8_lossy(&b);
                        let complete = if stream {
                            text.contains("data: [DONE]")
                        } else {
                            serde_json::from_slice::<serde_json::Value>(&b)
                                .is_ok_and(|v| v["choices"][0].is_object())
                        };
                        if complete {
                            Ok(())
                        } else {
                            Err(format!("incomplete response: {text}"))
                        }
                    });
                    out.push((id, res));
                }
            }));
        }
        for w in workers {
            for (id, res) in w.await.expect("worker") {
                if let Err(e) = res {
                    errors.push(format!("{id}: {e}"));
                }
                ids.push(id);
            }
        }
        if let Some(gap) = gaps.get(round) {
            tokio::time::sleep(*gap).await;
        }
    }
    (ids, errors)
}

/// Rows of the store, polled until `want` are there (the pipeline writes asynchronously).
async fn rows_when(
    gw: &GatewayProc,
    want: usize,
) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        gw.flush().await;
        let rows = store_table(&gw.store);
        if rows.len() >= want || Instant::now() > deadline {
            return rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_llama_idle_gaps_through_gateway_equal_direct() {
    let Some(llama) = llama::start(&["-np", "4", "-c", "4096"]).await else {
        return;
    };
    // llama.cpp closes a connection idle for 5 s (it says so: `Keep-Alive: timeout=5`). The
    // gaps straddle that: the pooled connections are idle a little less, then a little more
    // than 5 s when the next round starts (a round's last requests end up to ~0.1 s apart).
    let gaps = [Duration::from_millis(4_900), Duration::from_millis(5_000)];
    let per_round = 80;

    let (_, direct_errors) = rounds(&llama.url(), "direct", per_round, &gaps).await;

    let gw = GatewayProc::start(&llama.url(), &[]);
    let (ids, gw_errors) = rounds(&format!("http://{}", gw.proxy), "gw", per_round, &gaps).await;

    assert_eq!(ids.len(), 3 * per_round);
    assert_eq!(direct_errors, Vec::<String>::new(), "direct to llama.cpp");
    assert_eq!(
        gw_errors,
        Vec::<String>::new(),
        "through the gateway (direct: 0 errors)"
    );
    let rows = rows_when(&gw, ids.len()).await;
    assert_eq!(
        rows.len(),
        ids.len(),
        "one row per request through the gateway"
    );
    // Each request sent its own `x-request-id`: kept as the row's `client_request_id`.
    let by_id: HashMap<&str, &str> = rows
        .iter()
        .map(|r| {
            (
                r["client_request_id"].as_str().expect("client_request_id"),
                r["outcome"].as_str().expect("outcome"),
            )
        })
        .collect();
    for id in &ids {
        assert_eq!(by_id.get(id.as_str()), Some(&"ok"), "row of {id}");
    }
}

// ---------------------------------------------------------------------------------------------
// An in-test server that closes idle connections

/// How long a close takes to reach the client (one-way latency of a real network): in this
/// window the connection looks open to the gateway, but the server no longer reads from it.
const FIN_DELAY: Duration = Duration::from_millis(300);

/// How long after a streamed response the llama.cpp-like server's close reaches the client.
const STREAM_FIN_DELAY: Duration = Duration::from_millis(100);

/// How the in-test server closes connections.
#[derive(Clone, Copy)]
struct Closing {
    /// Closes a connection idle this long, `FIN_DELAY` after deciding to (bytes that arrive
    /// meanwhile are never read).
    idle: Duration,
    /// Adds `Keep-Alive: timeout=<idle in s>, max=100` to every response.
    advertise: bool,
    /// Closes the connection after every streamed (chunked) response, `STREAM_FIN_DELAY`
    /// after its end, without saying so — what llama.cpp's server does.
    after_stream: bool,
}

/// An HTTP/1.1 server that answers every request with a small chat completion (an SSE stream
/// when the request says `"stream":true`) and closes connections as [`Closing`] says.
struct ClosingServer {
    addr: std::net::SocketAddr,
    /// `x-request-id` of every request the server read, in order.
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ClosingServer {
    async fn start(closing: Closing) -> Self {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = l.accept().await {
                tokio::spawn(serve_conn(sock, closing, s2.clone()));
            }
        });
        Self { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn serve_conn(
    mut s: tokio::net::TcpStream,
    closing: Closing,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let Closing {
        idle,
        advertise,
        after_stream,
    } = closing;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 8192];
    loop {
        // Read one request (head + content-length body), giving up after `idle` of silence
        // between requests.
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let read = if buf.is_empty() {
                match tokio::time::timeout(idle, s.read(&mut chunk)).await {
                    Ok(r) => r,
                    Err(_) => {
                        // Idle: the close is on its way; nothing more is read.
                        tokio::time::sleep(FIN_DELAY).await;
                        return;
                    }
                }
            } else {
                s.read(&mut chunk).await
            };
            match read {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let header = |name: &str| {
            head.lines().find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(':'))
                    .map(|v| v.trim().to_owned())
            })
        };
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        if let Some(id) = header("x-request-id") {
            seen.lock().expect("seen").push(id);
        }
        let stream = String::from_utf8_lossy(&buf[head_end..head_end + len])
            .replace(' ', "")
            .contains("\"stream\":true");
        buf.drain(..head_end + len);
        let body = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
        let keep_alive = if advertise {
            format!("keep-alive: timeout={}, max=100\r\n", idle.as_secs())
        } else {
            String::new()
        };
        let resp = if stream {
            let mut r = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n{keep_alive}\r\n"
            );
            for ev in [
                r#"data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}"#,
                r#"data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#,
                "data: [DONE]",
            ] {
                let ev = format!("{ev}\n\n");
                r.push_str(&format!("{:x}\r\n{ev}\r\n", ev.len()));
            }
            r.push_str("0\r\n\r\n");
            r
        } else {
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{keep_alive}\r\n{body}",
                body.len()
            )
        };
        if s.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
        if stream && after_stream {
            // Done with this connection; the close is on its way, nothing more is read.
            tokio::time::sleep(STREAM_FIN_DELAY).await;
            return;
        }
    }
}

/// Sends one measured request (every other one streamed when `streams`) and, when
/// `passthrough`, one pass-through request after each gap (each pair after the previous
/// pair's responses), through `gw`; returns the ids sent and the failures.
async fn at_gaps(
    gw: &GatewayProc,
    gaps_ms: &[u64],
    tag: &str,
    streams: bool,
    passthrough: bool,
) -> (Vec<String>, Vec<String>) {
    let mut ids = Vec::new();
    let mut errors = Vec::new();
    // Warm-up pair: opens the pooled connections.
    for (k, gap) in std::iter::once(&0).chain(gaps_ms).enumerate() {
        tokio::time::sleep(Duration::from_millis(*gap)).await;
        let stream = streams && k % 2 == 0;
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": stream});
        let m = format!("{tag}-m{k}");
        let p = format!("{tag}-p{k}");
        let (chat_url, models_url) = (gw.url("/v1/chat/completions"), gw.url("/v1/models"));
        let (rm, rp) = tokio::join!(send("POST", &chat_url, Some(&body), &m), async {
            if passthrough {
                Some(send("GET", &models_url, None, &p).await)
            } else {
                None
            }
        });
        let rp = rp.map(|r| (p, r));
        for (id, r) in std::iter::once((m, rm)).chain(rp) {
            if let Err(e) = r {
                errors.push(format!("{id} after {gap} ms idle: {e}"));
            }
            ids.push(id);
        }
    }
    (ids, errors)
}

/// Every request reached the server, none twice.
fn reached_once(server: &ClosingServer, ids: &[String]) {
    let seen = server.seen.lock().expect("seen").clone();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for s in &seen {
        *counts.entry(s.as_str()).or_default() += 1;
    }
    for id in ids {
        assert_eq!(
            counts.get(id.as_str()),
            Some(&1),
            "{id} reached the server: {seen:?}"
        );
    }
}

/// Pass-through requests go through hyper-util's pooled client, which retires connections
/// after `upstream_idle_timeout_ms` but does not read `Keep-Alive`: they are sent only where
/// the server does not advertise a shorter timeout.
async fn closing_case(closing: Closing, env: &[(&str, &str)], gaps_ms: &[u64]) {
    let server = ClosingServer::start(closing).await;
    let gw = GatewayProc::start(&server.url(), env);
    let passthrough = !closing.advertise;
    let (ids, errors) = at_gaps(&gw, gaps_ms, "c", closing.after_stream, passthrough).await;
    assert_eq!(errors, Vec::<String>::new(), "failures through the gateway");
    reached_once(&server, &ids);
}

/// `Keep-Alive: timeout=1` advertised, default configuration (whose idle limit alone, 4 s,
/// would be too long): idle gaps before, inside and after the server's closing window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_server_advertised_keep_alive() {
    let idle = Duration::from_secs(1);
    // The closing window is [1000, 1300) ms of idle time.
    let closing = Closing {
        idle,
        advertise: true,
        after_stream: false,
    };
    closing_case(closing, &[], &[700, 1_150, 1_100, 1_600]).await;
}

/// A server that closes after 5 s without saying so (uvicorn's default, vLLM / SGLang), default
/// configuration: the default `upstream_idle_timeout_ms` retires connections before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_server_silent_5s_default_config() {
    let closing = Closing {
        idle: Duration::from_secs(5),
        advertise: false,
        after_stream: false,
    };
    closing_case(closing, &[], &[4_500, 5_150]).await;
}

/// A silent server with a shorter idle limit, and `upstream_idle_timeout_ms` set below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_server_silent_configured_limit() {
    let closing = Closing {
        idle: Duration::from_secs(1),
        advertise: false,
        after_stream: false,
    };
    closing_case(
        closing,
        &[("TOKENSCOPE_UPSTREAM_IDLE_TIMEOUT_MS", "600")],
        &[500, 1_150, 1_100, 1_600],
    )
    .await;
}

/// llama.cpp's server closes the connection after every streamed response while advertising
/// `Keep-Alive: timeout=5`: streamed and non-streamed requests back to back (the next one
/// arrives inside the close's `STREAM_FIN_DELAY`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_server_closes_after_streams() {
    let closing = Closing {
        idle: Duration::from_secs(5),
        advertise: true,
        after_stream: true,
    };
    closing_case(closing, &[], &[0; 12]).await;
}

/// The same engine behaviour on a path the gateway passes through unmeasured (llama.cpp's
/// native `/completion` streams too): streamed and non-streamed requests back to back go over
/// the upstream's own pool, so none lands on a connection the engine is closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_server_closes_after_streams_passthrough() {
    let server = ClosingServer::start(Closing {
        idle: Duration::from_secs(5),
        advertise: true,
        after_stream: true,
    })
    .await;
    let gw = GatewayProc::start(&server.url(), &[]);
    let url = gw.url("/completion");
    let mut ids = Vec::new();
    let mut errors = Vec::new();
    for k in 0..16 {
        let body = json!({"prompt": "hi", "n_predict": 1, "stream": k % 2 == 0});
        let id = format!("pt-{k}");
        if let Err(e) = send("POST", &url, Some(&body), &id).await {
            errors.push(format!("{id}: {e}"));
        }
        ids.push(id);
    }
    assert_eq!(errors, Vec::<String>::new(), "pass-through failures");
    reached_once(&server, &ids);
}
