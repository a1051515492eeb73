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

/// `serve` on port 0 for both listeners, with `upstream` and `store` when given, the spool in
/// `dir`, a 20 ms store flush and stdout piped for [`read_ready_line`].
pub fn serve_args(
    cmd: &mut Command,
    upstream: Option<&str>,
    store: Option<&std::path::Path>,
    dir: &std::path::Path,
) {
    cmd.arg("serve");
    if let Some(u) = upstream {
        cmd.args(["--upstream", u]);
    }
    cmd.args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
    if let Some(s) = store {
        cmd.arg("--store").arg(s);
    }
    cmd.env("TOKENSCOPE_SPOOL__DIR", dir.join("spool"))
        .env("TOKENSCOPE_PIPELINE__FLUSH_INTERVAL_MS", "20")
        .stdout(Stdio::piped());
}

/// Reads `serve`'s ready line from its piped stdout ("tokenscope listening proxy=ADDR
/// admin=ADDR store=PATH") and returns the proxy and admin addresses.
pub fn read_ready_line(child: &mut Child) -> (SocketAddr, SocketAddr) {
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read ready line");
    let field = |name: &str| -> SocketAddr {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
            .parse()
            .expect("socket addr")
    };
    (field("proxy="), field("admin="))
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
        Self::start_with_args(Some(upstream), &[], extra_env)
    }

    /// Starts `tokenscope serve` with a fresh store, `--upstream URL` when given (otherwise the
    /// upstreams come from a `--config` file among `args`), extra command-line `args` and
    /// `TOKENSCOPE_*` overrides in `extra_env`.
    pub fn start_with_args(
        upstream: Option<&str>,
        args: &[&str],
        extra_env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("tokenscope.db");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
        // A `--store` among `args` (e.g. a ClickHouse URL) replaces the fresh SQLite file.
        let own_store = (!args.contains(&"--store")).then_some(store.as_path());
        serve_args(&mut cmd, upstream, own_store, dir.path());
        cmd.args(args)
            .env("TOKENSCOPE_LOG", "warn")
            .stderr(Stdio::inherit());
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tokenscope");
        let (proxy, admin) = read_ready_line(&mut child);
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

    /// SIGKILL (no drain, no shutdown) and reap the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
        (
            self.store.clone(),
            std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tmp")),
        )
    }

    pub async fn metrics(&self) -> String {
        let (_, body) = get(&format!("http://{}/metrics", self.admin)).await;
        body
    }

    /// The record of `request_id` from the admin API (polls until it is final): the record
    /// keyed by it, else the newest whose client sent it as `x-request-id` (the response's
    /// `x-request-id` is the client's own id when it sent one; the key is always ours).
    pub async fn record(&self, request_id: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) =
                get(&format!("http://{}/api/requests/{request_id}", self.admin)).await;
            if status == 200 {
                return serde_json::from_str(&body).expect("record json");
            }
            let (status, body) = get(&format!(
                "http://{}/api/requests?limit=1&client_request_id={request_id}",
                self.admin
            ))
            .await;
            if status == 200 {
                let mut found: Vec<serde_json::Value> =
                    serde_json::from_str(&body).expect("records json");
                if let Some(r) = found.pop() {
                    return r;
                }
            }
            assert!(Instant::now() < deadline, "no record for {request_id}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl GatewayProc {
    /// Every record the admin API holds in memory (newest first).
    pub async fn records(&self) -> Vec<serde_json::Value> {
        let (status, body) = get(&format!("http://{}/api/requests?limit=100000", self.admin)).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).expect("records json")
    }

    /// How many in-memory records carry `request_id`, as their key or as the client's id.
    pub async fn record_count(&self, request_id: &str) -> usize {
        self.records()
            .await
            .iter()
            .filter(|r| r["request_id"] == request_id || r["client_request_id"] == request_id)
            .count()
    }

    /// Writes everything queued to the store now.
    pub async fn flush(&self) {
        let req = http::Request::post(format!("http://{}/api/flush", self.admin))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = client().request(req).await.expect("POST /api/flush");
        assert_eq!(resp.status(), 200, "flush");
    }

    /// [`GatewayProc::flush`] on a gateway with an admin token (`[dashboard] token`): the
    /// write routes need it.
    pub async fn flush_with_token(&self, token: &str) {
        let req = http::Request::post(format!("http://{}/api/flush", self.admin))
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = client().request(req).await.expect("POST /api/flush");
        assert_eq!(resp.status(), 200, "flush");
    }
}

impl Drop for GatewayProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn get(url: &str) -> (u16, String) {
    try_get(url)
        .await
        .unwrap_or_else(|| panic!("GET {url} failed"))
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
    /// Carries output text (content / text / reasoning), by each API's own rules: chat and
    /// completions choices; a non-empty Responses API `response.….delta`; a non-empty Messages
    /// API `text_delta` / `thinking_delta` / `input_json_delta`.
    pub fn has_output(&self) -> bool {
        let Some(j) = &self.json else { return false };
        let non_empty = |v: &serde_json::Value| v.as_str().is_some_and(|s| !s.is_empty());
        let kind = j["type"].as_str().unwrap_or("");
        if kind.starts_with("response.") && kind.ends_with(".delta") {
            return non_empty(&j["delta"]);
        }
        if kind == "content_block_delta" {
            return ["text", "thinking", "partial_json"]
                .iter()
                .any(|k| non_empty(&j["delta"][k]));
        }
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
        self.json
            .as_ref()
            .and_then(|j| j.get("usage"))
            .filter(|u| !u.is_null())
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
        let Ok(data) = frame.into_data() else {
            continue;
        };
        raw.extend_from_slice(&data);
        splitter
            .push(&data, |ev| {
                let parsed = parse_event(&ev);
                if let Some(d) = parsed.data {
                    let json = serde_json::from_str(&d).ok();
                    let e = ClientEvent {
                        at,
                        data: d.to_string(),
                        json,
                    };
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
        .prepare("SELECT request_id, outcome, input_tokens, output_tokens, ttft_ms, tpot_ms, client_request_id FROM llm_inference_log")
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
                "client_request_id": r.get::<_, Option<String>>(6)?,
            }))
        })
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows");
    rows
}

/// Every row of the store as a JSON object keyed by column name.
pub fn store_table(path: &std::path::Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    use rusqlite::types::ValueRef;
    let conn = rusqlite::Connection::open(path).expect("open store");
    let mut stmt = conn
        .prepare("SELECT * FROM llm_inference_log")
        .expect("prepare");
    let names: Vec<String> = stmt.column_names().map(str::to_owned).collect();
    let rows = stmt
        .query_map([], |r| {
            let mut o = serde_json::Map::new();
            for (i, name) in names.iter().enumerate() {
                let v = match r.get_ref(i)? {
                    ValueRef::Null => serde_json::Value::Null,
                    ValueRef::Integer(n) => serde_json::json!(n),
                    ValueRef::Real(x) => serde_json::json!(x),
                    ValueRef::Text(t) => serde_json::json!(String::from_utf8_lossy(t)),
                    ValueRef::Blob(b) => serde_json::json!(b),
                };
                o.insert(name.clone(), v);
            }
            Ok(o)
        })
        .expect("query")
        .collect::<Result<Vec<_>, _>>()
        .expect("rows");
    rows
}

/// A running `tokenscope mock-engine` process.
pub struct MockProc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl MockProc {
    /// Starts `tokenscope mock-engine --listen 127.0.0.1:0` with `args` (`--time-scale 0.05`
    /// unless `args` sets one).
    pub fn start(args: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
        cmd.args(["mock-engine", "--listen", "127.0.0.1:0"])
            .args(args);
        if !args.contains(&"--time-scale") {
            cmd.args(["--time-scale", "0.05"]);
        }
        cmd.env("TOKENSCOPE_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn tokenscope mock-engine");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read ready line");
        let addr = line
            .trim()
            .strip_prefix("tokenscope mock-engine listening on ")
            .map(|a| a.trim_end_matches(" (https)"))
            .unwrap_or_else(|| panic!("unexpected mock-engine line {line:?}"))
            .parse()
            .expect("socket addr");
        MockProc { child, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn metrics(&self) -> String {
        get(&format!("http://{}/metrics", self.addr)).await.1
    }
}

impl Drop for MockProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request as the fixture upstream received it.
#[derive(Debug, Clone)]
pub struct Captured {
    pub method: http::Method,
    pub path: String,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Captured {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("the fixture received a JSON body")
    }
}

/// One step of a fixture response body.
#[derive(Debug, Clone)]
pub enum Step {
    /// Write these bytes (one HTTP chunk).
    Send(Bytes),
    /// Wait before the next step.
    Pause(Duration),
}

/// What the fixture answers.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub steps: Vec<Step>,
    /// One piece with a `content-length` (pauses ignored) instead of chunked encoding.
    pub sized: bool,
    /// Extra response headers.
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    /// A fixed body sent in one piece with a `content-length`.
    pub fn sized(content_type: &'static str, body: impl Into<Bytes>) -> Self {
        Reply {
            status: 200,
            content_type,
            steps: vec![Step::Send(body.into())],
            sized: true,
            headers: Vec::new(),
        }
    }

    /// A chunked body written step by step.
    pub fn chunked(content_type: &'static str, steps: Vec<Step>) -> Self {
        Reply {
            status: 200,
            content_type,
            steps,
            sized: false,
            headers: Vec::new(),
        }
    }

    /// `body` cut at the byte offsets `cuts`, one write per piece with `pause` between them.
    pub fn cut(content_type: &'static str, body: &[u8], cuts: &[usize], pause: Duration) -> Self {
        let mut cuts: Vec<usize> = cuts
            .iter()
            .copied()
            .filter(|c| *c > 0 && *c < body.len())
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut steps = Vec::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([body.len()]) {
            if !steps.is_empty() {
                steps.push(Step::Pause(pause));
            }
            steps.push(Step::Send(Bytes::copy_from_slice(&body[prev..c])));
            prev = c;
        }
        Self::chunked(content_type, steps)
    }
}

type Responder = dyn Fn(&Captured) -> Reply + Send + Sync;

#[derive(Clone)]
struct FixtureState {
    respond: std::sync::Arc<Responder>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Captured>>>,
}

/// An in-test upstream: answers every request with the [`Reply`] its closure picks, writing the
/// body exactly as scripted, and keeps every request it received.
pub struct Fixture {
    pub addr: SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Captured>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Fixture {
    pub async fn start(respond: impl Fn(&Captured) -> Reply + Send + Sync + 'static) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fixture");
        let addr = listener.local_addr().expect("fixture addr");
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let state = FixtureState {
            respond: std::sync::Arc::new(respond),
            seen: seen.clone(),
        };
        let app = axum::Router::new()
            .fallback(fixture_handler)
            .with_state(state);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        Fixture {
            addr,
            seen,
            stop: Some(tx),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far, oldest first.
    pub fn requests(&self) -> Vec<Captured> {
        self.seen.lock().expect("fixture lock").clone()
    }

    /// The request that carried `x-request-id: id`.
    pub fn request(&self, id: &str) -> Captured {
        self.requests()
            .into_iter()
            .find(|c| c.header("x-request-id") == Some(id))
            .unwrap_or_else(|| panic!("the fixture received no request {id}"))
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

async fn fixture_handler(
    axum::extract::State(st): axum::extract::State<FixtureState>,
    req: axum::extract::Request,
) -> axum::response::Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .expect("fixture reads the request body");
    let cap = Captured {
        method: parts.method,
        path: parts.uri.path().to_owned(),
        headers: parts.headers,
        body,
    };
    let reply = (st.respond)(&cap);
    st.seen.lock().expect("fixture lock").push(cap);
    let body = if reply.sized {
        let mut all = Vec::new();
        for s in &reply.steps {
            if let Step::Send(b) = s {
                all.extend_from_slice(b);
            }
        }
        axum::body::Body::from(all)
    } else {
        let stream = futures_util::stream::unfold(reply.steps.into_iter(), |mut it| async move {
            loop {
                match it.next()? {
                    Step::Send(b) => return Some((Ok::<_, std::io::Error>(b), it)),
                    Step::Pause(d) => tokio::time::sleep(d).await,
                }
            }
        });
        axum::body::Body::from_stream(stream)
    };
    let mut resp = axum::response::Response::new(body);
    *resp.status_mut() = http::StatusCode::from_u16(reply.status).expect("status");
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(reply.content_type),
    );
    for (k, v) in reply.headers {
        resp.headers_mut().insert(
            http::HeaderName::from_static(k),
            http::HeaderValue::from_str(&v).expect("header value"),
        );
    }
    resp
}

/// A POST with raw bytes; returns status, headers and body.
pub async fn post_bytes(
    url: &str,
    body: impl Into<Bytes>,
    headers: &[(&str, &str)],
) -> (u16, http::HeaderMap, Bytes) {
    let mut req = http::Request::post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).expect("request");
    let resp = client().request(req).await.expect("POST");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, headers, body)
}

/// Writes `request` on a fresh TCP connection, then reads until the server closes it (the
/// request should say `connection: close`). Returns status, header block and body bytes.
pub async fn raw_http(addr: SocketAddr, request: &[u8]) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write request");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("the server closed the connection in time")
        .expect("read response");
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete header block");
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    (status, head, buf[end + 4..].to_vec())
}

/// The labels of one exposition sample line (`name{k="v",…} value`), with the name.
pub fn sample_labels(line: &str) -> Option<(&str, Vec<(String, String)>)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = Vec::new();
    if line[name_end..].starts_with('{') {
        let mut rest = &line[name_end + 1..];
        loop {
            rest = rest.trim_start_matches(',');
            if rest.starts_with('}') {
                break;
            }
            let eq = rest.find("=\"")?;
            let key = rest[..eq].to_owned();
            rest = &rest[eq + 2..];
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let close = loop {
                let (i, c) = chars.next()?;
                match c {
                    '\\' => {
                        let (_, n) = chars.next()?;
                        value.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                    '"' => break i,
                    other => value.push(other),
                }
            };
            labels.push((key, value));
            rest = &rest[close + 1..];
        }
    }
    Some((name, labels))
}

/// Distinct values of `label` over every sample whose name starts with `prefix`.
pub fn label_values(text: &str, prefix: &str, label: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(sample_labels)
        .filter(|(n, _)| n.starts_with(prefix))
        .flat_map(|(_, ls)| ls.into_iter().filter(|(k, _)| k == label).map(|(_, v)| v))
        .collect()
}

/// Sum of the samples named exactly `name` whose labels include every pair of `want`.
pub fn metric_where(text: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter_map(|l| {
            let (n, ls) = sample_labels(l)?;
            let ok = n == name
                && want
                    .iter()
                    .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v));
            if !ok {
                return None;
            }
            l.rsplit(' ').next()?.parse::<f64>().ok()
        })
        .sum()
}

/// `true` for a canonical UUID of version 7 (RFC 9562 variant).
pub fn is_uuid_v7(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && [8, 13, 18, 23].iter().all(|&i| b[i] == b'-')
        && b.iter()
            .enumerate()
            .all(|(i, c)| [8, 13, 18, 23].contains(&i) || c.is_ascii_hexdigit())
        && b[14] == b'7'
        && matches!(b[19], b'8' | b'9' | b'a' | b'b' | b'A' | b'B')
}

/// A free port on 127.0.0.1 that nobody listens on (bound, then released).
pub fn dead_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Runs `promtool check metrics` on `text`. `None` when promtool is not on PATH and not
/// required (`TOKENSCOPE_REQUIRE_PROMTOOL=1` makes absence a failure).
pub fn promtool_check(text: &str) -> Option<(bool, String)> {
    use std::io::Write;
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var("TOKENSCOPE_REQUIRE_PROMTOOL").as_deref() == Ok("1") {
                panic!("promtool is required (TOKENSCOPE_REQUIRE_PROMTOOL=1) but not on PATH");
            }
            eprintln!("SKIPPED: promtool not on PATH (Debian package `prometheus`)");
            return None;
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool output");
    let mut msg = String::from_utf8_lossy(&out.stdout).into_owned();
    msg.push_str(&String::from_utf8_lossy(&out.stderr));
    Some((out.status.success(), msg))
}

/// ~`words` tokens of ordinary English prose (Gemma tokenises these words as one token each).
pub fn prose(words: usize, salt: &str) -> String {
    const W: [&str; 12] = [
        "the",
        "keeper",
        "of",
        "a",
        "lighthouse",
        "watched",
        "ships",
        "pass",
        "in",
        "calm",
        "grey",
        "water",
    ];
    let mut s = format!("{salt}: ");
    for i in 0..words {
        s.push_str(W[i % W.len()]);
        s.push(' ');
    }
    s
}

/// An Alertmanager-style receiver: `POST /api/v2/alerts` with a JSON array; the first
/// `refuse_first` POSTs get 503 (and are not kept).
pub struct AlertReceiver {
    pub addr: std::net::SocketAddr,
    pub alerts: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    pub posts: std::sync::Arc<std::sync::Mutex<u32>>,
}

pub async fn alert_receiver(refuse_first: u32) -> AlertReceiver {
    use axum::routing::post;
    let alerts: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>> =
        std::sync::Arc::default();
    let posts: std::sync::Arc<std::sync::Mutex<u32>> = std::sync::Arc::default();
    let (a, p) = (alerts.clone(), posts.clone());
    let app = axum::Router::new().route(
        "/api/v2/alerts",
        post(move |body: axum::body::Bytes| {
            let (a, p) = (a.clone(), p.clone());
            async move {
                let n = {
                    let mut p = p.lock().expect("lock");
                    *p += 1;
                    *p
                };
                if n <= refuse_first {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE;
                }
                let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON body");
                let arr = v.as_array().expect("a JSON array").clone();
                a.lock().expect("lock").extend(arr);
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    AlertReceiver {
        addr,
        alerts,
        posts,
    }
}
