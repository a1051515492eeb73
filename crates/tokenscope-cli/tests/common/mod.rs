//! Test harness: start the real `tokenscope` binary on port 0, talk to it over HTTP, time SSE
//! events as a client sees them, read its metrics and its store.
#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokenscope_core::sse::{parse_event, EventSplitter};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A running `tokenscope serve` process.
pub struct GatewayProc {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub store: PathBuf,
    pub dir: tempfile::TempDir,
}

impl GatewayProc {
    /// Starts `tokenscope serve --upstream URL` with a fresh store; `extra_env` are
    /// `TOKENSCOPE_*` overrides.
    pub fn start(upstream: &str, extra_env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("tokenscope.db");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
        cmd.args([
            "serve",
            "--upstream",
            upstream,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--store",
        ])
        .arg(&store)
        .env("TOKENSCOPE_PIPELINE__FLUSH_INTERVAL_MS", "20")
        .env("TOKENSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tokenscope");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read ready line");
        // "tokenscope listening proxy=ADDR admin=ADDR store=PATH"
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .parse()
                .expect("socket addr")
        };
        let proxy = field("proxy=");
        let admin = field("admin=");
        GatewayProc {
            child,
            proxy,
            admin,
            store,
            dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.proxy, path)
    }

    /// SIGTERM and wait for a clean exit (the store is drained by then).
    pub fn stop(mut self) -> (PathBuf, tempfile::TempDir) {
        let pid = self.child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                assert!(st.success(), "gateway exited with {st}");
                break;
            }
            assert!(Instant::now() < deadline, "gateway did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
        (self.store.clone(), std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tmp")))
    }

    pub async fn metrics(&self) -> String {
        let (_, body) = get(&format!("http://{}/metrics", self.admin)).await;
        body
    }

    /// The record of `request_id` from the admin API (polls until it is final).
    pub async fn record(&self, request_id: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) =
                get(&format!("http://{}/api/requests/{request_id}", self.admin)).await;
            if status == 200 {
                return serde_json::from_str(&body).expect("record json");
            }
            assert!(Instant::now() < deadline, "no record for {request_id}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn get(url: &str) -> (u16, String) {
    try_get(url).await.unwrap_or_else(|| panic!("GET {url} failed"))
}

/// GET that returns `None` when the server cannot be reached.
pub async fn try_get(url: &str) -> Option<(u16, String)> {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = client().request(req).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// A plain JSON POST; returns status, headers and the parsed body (or raw text as a string).
pub async fn post_json(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, Bytes) {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client().request(req).await.expect("POST");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, headers, body)
}

/// One SSE event as the client received it.
#[derive(Debug, Clone)]
pub struct ClientEvent {
    pub at: Instant,
    pub data: String,
    pub json: Option<serde_json::Value>,
}

impl ClientEvent {
    /// Carries output text (content / text / reasoning).
    pub fn has_output(&self) -> bool {
        let Some(j) = &self.json else { return false };
        j["choices"].as_array().is_some_and(|cs| {
            cs.iter().any(|c| {
                ["content", "reasoning_content"]
                    .iter()
                    .any(|k| c["delta"][k].as_str().is_some_and(|s| !s.is_empty()))
                    || c["text"].as_str().is_some_and(|s| !s.is_empty())
            })
        })
    }
    pub fn usage(&self) -> Option<&serde_json::Value> {
        self.json.as_ref().and_then(|j| j.get("usage")).filter(|u| !u.is_null())
    }
}

/// A streamed exchange as the client saw it.
pub struct ClientStream {
    pub sent_at: Instant,
    pub status: u16,
    pub headers: http::HeaderMap,
    pub raw: Vec<u8>,
    pub events: Vec<ClientEvent>,
}

impl ClientStream {
    pub fn output_events(&self) -> Vec<&ClientEvent> {
        self.events.iter().filter(|e| e.has_output()).collect()
    }
    /// Client-observed TTFT in ms (first output-bearing event).
    pub fn ttft_ms(&self) -> Option<f64> {
        self.output_events()
            .first()
            .map(|e| (e.at - self.sent_at).as_secs_f64() * 1000.0)
    }
    /// TPOT by the formula on client arrival times, for `n_out` tokens.
    pub fn tpot_ms(&self, n_out: u64) -> Option<f64> {
        let out = self.output_events();
        let (first, last) = (out.first()?, out.last()?);
        (n_out >= 2).then(|| (last.at - first.at).as_secs_f64() * 1000.0 / (n_out - 1) as f64)
    }
    pub fn request_id(&self) -> String {
        self.headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .expect("x-request-id")
            .to_owned()
    }
}

/// POSTs and reads an SSE response, stamping every event on arrival. Stops early (dropping
/// the connection) after `stop_after_outputs` output events when given.
pub async fn stream(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
    stop_after_outputs: Option<usize>,
) -> ClientStream {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let c = client();
    let sent_at = Instant::now();
    let resp = c.request(req).await.expect("POST");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let mut body = resp.into_body();
    let mut splitter = EventSplitter::new(1 << 24);
    let mut events = Vec::new();
    let mut raw = Vec::new();
    let mut outputs = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        let at = Instant::now();
        let Ok(data) = frame.into_data() else { continue };
        raw.extend_from_slice(&data);
        splitter
            .push(&data, |ev| {
                let parsed = parse_event(&ev);
                if let Some(d) = parsed.data {
                    let json = serde_json::from_str(&d).ok();
                    let e = ClientEvent { at, data: d, json };
                    if e.has_output() {
                        outputs += 1;
                    }
                    events.push(e);
                }
            })
            .expect("event size");
        if stop_after_outputs.is_some_and(|n| outputs >= n) {
            break; // dropping `body` closes the connection
        }
    }
    drop(body);
    drop(c);
    ClientStream {
        sent_at,
        status,
        headers,
        raw,
        events,
    }
}

/// Sum of every sample of `name` (with any labels) in a Prometheus/OpenMetrics exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Rows in the store.
pub fn store_rows(path: &std::path::Path) -> Vec<serde_json::Value> {
    let conn = rusqlite::Connection::open(path).expect("open store");
    let mut stmt = conn
        .prepare("SELECT request_id, outcome, input_tokens, output_tokens, ttft_ms, tpot_ms FROM llm_inference_log")
        .expect("prepare");
    let rows = stmt
        .query_map([], |r| {
            Ok(serde_json::json!({
                "request_id": r.get::<_, String>(0)?,
                "outcome": r.get::<_, String>(1)?,
                "input_tokens": r.get::<_, Option<i64>>(2)?,
                "output_tokens": r.get::<_, Option<i64>>(3)?,
                "ttft_ms": r.get::<_, Option<f64>>(4)?,
                "tpot_ms": r.get::<_, Option<f64>>(5)?,
            }))
        })
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows");
    rows
}
