//! End-to-end tests of the mock over real sockets: `serve` on port 0, a hyper client, and raw
//! TCP where a test needs to drop a connection on purpose.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokenscope_mock::{count_tokens, serve, MockConfig, MockError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const LONG: Duration = Duration::from_secs(10);

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), MockError>>,
}

impl Server {
    async fn start(cfg: MockConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, cfg, async move {
            let _ = rx.await;
        }));
        Self {
            addr,
            stop: Some(tx),
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Signals shutdown and waits for `serve` to return.
    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(LONG, &mut self.task)
            .await
            .expect("serve returns after shutdown")
            .expect("serve task")
            .expect("serve ok");
    }
}

fn fast() -> MockConfig {
    MockConfig {
        time_scale: 0.05,
        ..MockConfig::default()
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Bytes,
    headers: &[(&str, &str)],
) -> http::Response<Incoming> {
    let mut b = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body)).expect("request");
    tokio::time::timeout(LONG, c.request(req))
        .await
        .expect("response in time")
        .expect("response")
}

async fn post(
    c: &HttpClient,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> http::Response<Incoming> {
    send(c, "POST", url, Bytes::from(body.to_string()), headers).await
}

async fn get(c: &HttpClient, url: &str) -> (StatusCode, String) {
    let r = send(c, "GET", url, Bytes::new(), &[]).await;
    let status = r.status();
    (status, text(r).await)
}

async fn text(r: http::Response<Incoming>) -> String {
    let bytes = tokio::time::timeout(LONG, r.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).expect("utf-8 body")
}

async fn json_body(r: http::Response<Incoming>) -> Value {
    serde_json::from_str(&text(r).await).expect("JSON body")
}

/// The `data:` payloads of an event stream, in order; checks the framing.
fn events(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "stream ends with a blank line: {body:?}"
    );
    body.split_terminator("\n\n")
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event is one data line: {e:?}"))
                .to_owned()
        })
        .collect()
}

fn parse(e: &str) -> Value {
    serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"))
}

fn chat_body(n: u64, extra: Value) -> Value {
    let mut v = json!({
        "model": "test-model",
        "messages": [{"role": "user", "content": "hello mock engine"}],
        "mock_output_tokens": n,
    });
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}

/// Prompt tokens of `chat_body`: 4 for the message + "hello"(2) "mock"(1) "engine"(2).
const CHAT_PROMPT_TOKENS: u64 = 4 + 2 + 1 + 2;

fn assert_chunk_header(v: &Value, object: &str) {
    assert!(v["id"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    assert_eq!(v["object"], object, "{v}");
    assert!(v["created"].as_u64().is_some(), "{v}");
    assert_eq!(v["model"], "test-model", "{v}");
}

fn assert_timings(t: &Value, prompt_n: u64, predicted_n: u64) {
    assert_eq!(t["prompt_n"], prompt_n, "{t}");
    assert_eq!(t["predicted_n"], predicted_n, "{t}");
    assert_eq!(t["cache_n"], 0, "{t}");
    for k in [
        "prompt_ms",
        "prompt_per_token_ms",
        "predicted_ms",
        "predicted_per_token_ms",
    ] {
        assert!(t[k].as_f64().is_some_and(|v| v >= 0.0), "{k} in {t}");
    }
    assert!(t["prompt_ms"].as_f64().is_some_and(|v| v > 0.0), "{t}");
}

#[tokio::test]
async fn chat_stream_with_include_usage() {
    let srv = Server::start(fast()).await;
    let c = client();
    let body = chat_body(
        5,
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let r = post(&c, &srv.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let ev = events(&text(r).await);
    // role, 5 tokens, finish, usage, [DONE]
    assert_eq!(ev.len(), 1 + 5 + 1 + 1 + 1, "{ev:#?}");
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| parse(e)).collect();
    let id = chunks[0]["id"].clone();
    for ch in &chunks {
        assert_chunk_header(ch, "chat.completion.chunk");
        assert_eq!(ch["id"], id);
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
    for (i, ch) in chunks[1..6].iter().enumerate() {
        assert_eq!(
            ch["choices"][0]["delta"],
            json!({"content": format!("tok{i} ")})
        );
        assert!(ch["choices"][0]["finish_reason"].is_null());
    }
    let fin = &chunks[6];
    assert_eq!(fin["choices"][0]["delta"], json!({}));
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert!(
        fin.get("timings").is_none(),
        "timings go on the usage chunk"
    );
    assert!(fin.get("usage").is_none());
    let usage_chunk = &chunks[7];
    assert_eq!(usage_chunk["choices"], json!([]));
    let token_chunks = chunks[1..6].len() as u64;
    assert_eq!(
        usage_chunk["usage"],
        json!({
            "prompt_tokens": CHAT_PROMPT_TOKENS,
            "completion_tokens": token_chunks,
            "total_tokens": CHAT_PROMPT_TOKENS + 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        })
    );
    assert_timings(&usage_chunk["timings"], CHAT_PROMPT_TOKENS, 5);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    srv.stop().await;
}

#[tokio::test]
async fn chat_stream_without_include_usage() {
    let srv = Server::start(fast()).await;
    let c = client();
    let body = chat_body(4, json!({"stream": true, "max_tokens": 3}));
    let r = post(&c, &srv.url("/v1/chat/completions"), &body, &[]).await;
    let ev = events(&text(r).await);
    // role, 3 tokens (max_tokens < mock_output_tokens), finish with timings, [DONE]
    assert_eq!(ev.len(), 1 + 3 + 1 + 1, "{ev:#?}");
    assert_eq!(ev[5], "[DONE]");
    let fin = parse(&ev[4]);
    assert_chunk_header(&fin, "chat.completion.chunk");
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert!(fin.get("usage").is_none());
    assert_timings(&fin["timings"], CHAT_PROMPT_TOKENS, 3);
    for e in &ev[..5] {
        assert!(parse(e).get("usage").is_none());
    }
    srv.stop().await;
}

#[tokio::test]
async fn completions_stream_and_full() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/completions");
    let body = json!({
        "model": "test-model", "prompt": "once upon a time", "stream": true,
        "stream_options": {"include_usage": true}, "mock_output_tokens": 2,
    });
    let ev = events(&text(post(&c, &url, &body, &[]).await).await);
    // 2 tokens, finish, usage, [DONE]; no role chunk for completions.
    assert_eq!(ev.len(), 2 + 1 + 1 + 1, "{ev:#?}");
    for (i, e) in ev[..2].iter().enumerate() {
        let v = parse(e);
        assert_chunk_header(&v, "text_completion");
        assert_eq!(v["choices"][0]["text"], format!("tok{i} "));
    }
    let fin = parse(&ev[2]);
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert_eq!(fin["choices"][0]["text"], "");
    let usage = parse(&ev[3]);
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        count_tokens("once upon a time")
    );
    assert_eq!(usage["usage"]["completion_tokens"], 2);

    let body =
        json!({"model": "test-model", "prompt": "once upon a time", "mock_output_tokens": 3});
    let v = json_body(post(&c, &url, &body, &[]).await).await;
    assert_chunk_header(&v, "text_completion");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 ");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    srv.stop().await;
}

#[tokio::test]
async fn chat_non_streaming() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/chat/completions");
    let r = post(&c, &url, &chat_body(3, json!({})), &[]).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v = json_body(r).await;
    assert_chunk_header(&v, "chat.completion");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "tok0 tok1 tok2 "})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({
            "prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 3,
            "total_tokens": CHAT_PROMPT_TOKENS + 3,
            "prompt_tokens_details": {"cached_tokens": 0},
        })
    );
    assert_timings(&v["timings"], CHAT_PROMPT_TOKENS, 3);

    // No model in the request: the configured one. No mock_output_tokens: a seeded natural
    // length capped by max_tokens.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7});
    let v = json_body(post(&c, &url, &body, &[]).await).await;
    assert_eq!(v["model"], "mock-llm");
    let n = v["usage"]["completion_tokens"].as_u64().expect("count");
    assert!((1..=7).contains(&n));
    assert_eq!(v["choices"][0]["finish_reason"] == "length", n == 7);
    srv.stop().await;
}

#[tokio::test]
async fn validation_errors() {
    let srv = Server::start(fast()).await;
    let c = client();
    let cases: [(&str, &[u8]); 5] = [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", br#"{"model":"x"}"#),
        ("/v1/completions", br#"{"model":"x"}"#),
        ("/v1/embeddings", br#"{"model":"x"}"#),
        ("/tokenize", b"[]"),
    ];
    for (path, body) in cases {
        let r = send(&c, "POST", &srv.url(path), Bytes::from_static(body), &[]).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{path}");
        let v = json_body(r).await;
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(1, json!({})),
        &[("x-mock-fault", "no_such_fault")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    srv.stop().await;
}

#[tokio::test]
async fn other_endpoints() {
    let srv = Server::start(fast()).await;
    let c = client();
    let (s, body) = get(&c, &srv.url("/health")).await;
    assert_eq!((s, parse(&body)), (StatusCode::OK, json!({"status": "ok"})));
    let (s, body) = get(&c, &srv.url("/v1/models")).await;
    assert_eq!(s, StatusCode::OK);
    let v = parse(&body);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "mock-llm");

    let content = "The quick brown fox jumps over";
    let r = post(
        &c,
        &srv.url("/tokenize"),
        &json!({ "content": content }),
        &[],
    )
    .await;
    let v = json_body(r).await;
    let tokens = v["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len() as u64, count_tokens(content));
    assert!(tokens.iter().all(Value::is_u64));

    let body = json!({"model": "emb", "input": ["hello world", "abc"]});
    let v = json_body(post(&c, &srv.url("/v1/embeddings"), &body, &[]).await).await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "emb");
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), 2);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        assert_eq!(d["embedding"].as_array().map(Vec::len), Some(8));
    }
    let n = count_tokens("hello world") + count_tokens("abc");
    assert_eq!(v["usage"], json!({"prompt_tokens": n, "total_tokens": n}));

    let (s, _) = get(&c, &srv.url("/nope")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    srv.stop().await;
}

#[tokio::test]
async fn error_faults() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/chat/completions");
    let body = chat_body(3, json!({"stream": true}));

    let r = post(&c, &url, &body, &[("x-mock-fault", "error_500")]).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let v = json_body(r).await;
    assert!(v["error"]["message"].as_str().is_some());

    let r = post(&c, &url, &body, &[("x-mock-fault", "error_429")]).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(json_body(r).await["error"]["type"], "rate_limit_error");

    let r = post(&c, &url, &body, &[("x-mock-fault", "malformed_json")]).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["content-type"], "application/json");
    let t = text(r).await;
    assert!(serde_json::from_str::<Value>(&t).is_err(), "{t}");

    let r = post(
        &c,
        &srv.url("/v1/embeddings"),
        &json!({"input": "x"}),
        &[("x-mock-fault", "error_500")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    srv.stop().await;
}

#[tokio::test]
async fn malformed_sse_fault() {
    let srv = Server::start(fast()).await;
    let c = client();
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(10, json!({"stream": true})),
        &[("x-mock-fault", "malformed_sse")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let ev = events(&text(r).await);
    assert_eq!(ev.len(), 1 + 3 + 1, "{ev:#?}");
    for e in &ev[..4] {
        assert_chunk_header(&parse(e), "chat.completion.chunk");
    }
    assert_eq!(ev[4], "{not json");
    srv.stop().await;
}

#[tokio::test]
async fn drop_mid_stream_fault() {
    let srv = Server::start(fast()).await;
    let c = client();
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(10, json!({"stream": true})),
        &[("x-mock-fault", "drop_mid_stream")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut body = r.into_body();
    let mut got = String::new();
    let err = loop {
        match tokio::time::timeout(LONG, body.frame())
            .await
            .expect("frame in time")
        {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    got.push_str(std::str::from_utf8(&d).expect("utf-8"));
                }
            }
            Some(Err(e)) => break e,
            None => panic!("the stream ended cleanly: {got:?}"),
        }
    };
    eprintln!("drop_mid_stream error: {err:?}");
    let ev = events(&got);
    assert_eq!(ev.len(), 1 + 3, "{ev:#?}");
    assert!(!got.contains("[DONE]"));
    srv.stop().await;
}

#[tokio::test]
async fn stall_and_hang_end_at_shutdown() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/chat/completions");

    // stall_mid_stream: 4 events (role + 3 tokens), then silence on an open connection.
    let r = post(
        &c,
        &url,
        &chat_body(10, json!({"stream": true})),
        &[("x-mock-fault", "stall_mid_stream")],
    )
    .await;
    let mut stalled = r.into_body();
    let mut got = String::new();
    while got.matches("\n\n").count() < 4 {
        let f = tokio::time::timeout(LONG, stalled.frame())
            .await
            .expect("frame in time")
            .expect("a frame")
            .expect("frame ok");
        if let Ok(d) = f.into_data() {
            got.push_str(std::str::from_utf8(&d).expect("utf-8"));
        }
    }
    assert_eq!(events(&got).len(), 4);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), stalled.frame())
            .await
            .is_err(),
        "stalled stream sent more"
    );

    // hang: no response headers at all.
    let c2 = c.clone();
    let hang_url = url.clone();
    let hang = tokio::spawn(async move {
        let req = Request::post(hang_url)
            .header("x-mock-fault", "hang")
            .body(Full::new(Bytes::from(chat_body(1, json!({})).to_string())))
            .expect("request");
        c2.request(req).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!hang.is_finished(), "hang answered early");

    // Shutdown releases both, and serve returns.
    srv.stop().await;
    let resp = tokio::time::timeout(LONG, hang)
        .await
        .expect("hang ends at shutdown")
        .expect("task")
        .expect("a response");
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let mut rest = String::new();
    while let Some(f) = tokio::time::timeout(LONG, stalled.frame())
        .await
        .expect("stalled stream ends at shutdown")
    {
        if let Ok(d) = f.expect("clean end").into_data() {
            rest.push_str(std::str::from_utf8(&d).expect("utf-8"));
        }
    }
    assert!(!rest.contains("[DONE]"));
}

#[tokio::test]
async fn delay_header() {
    let srv = Server::start(fast()).await;
    let c = client();
    let t0 = Instant::now();
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(1, json!({})),
        &[("x-mock-delay-ms", "250")],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let _ = text(r).await;
    assert!(t0.elapsed() >= Duration::from_millis(250));
    srv.stop().await;
}

/// Sends a streaming chat request on its own connection; the caller drops the stream to
/// disconnect.
async fn raw_stream(addr: SocketAddr, output_tokens: u64) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let body = chat_body(output_tokens, json!({"stream": true})).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    s
}

/// Reads from `s` until `needle` has been seen.
async fn read_until(s: &mut TcpStream, needle: &str) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + LONG;
    while !String::from_utf8_lossy(&buf).contains(needle) {
        assert!(Instant::now() < deadline, "never saw {needle:?}");
        let n = tokio::time::timeout(LONG, s.read(&mut chunk))
            .await
            .expect("read in time")
            .expect("read");
        assert!(n > 0, "connection closed before {needle:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Polls `/metrics` until `pred` holds.
async fn wait_metrics(c: &HttpClient, srv: &Server, what: &str, pred: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + LONG;
    loop {
        let (_, m) = get(c, &srv.url("/metrics")).await;
        if pred(&m) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn metrics_gauges_and_disconnect() {
    let srv = Server::start(MockConfig {
        slots: 2,
        time_scale: 0.1,
        ..MockConfig::default()
    })
    .await;
    let c = client();
    let (_, m) = get(&c, &srv.url("/metrics")).await;
    for name in [
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(m.contains(&format!("# TYPE {name} ")), "{name}");
        assert_eq!(metric(&m, name), 0.0, "{name}");
    }
    assert!(m.contains("vllm:num_requests_running{model_name=\"mock-llm\"} 0"));

    // Four long streams on two slots: two run, two wait.
    let mut conns = Vec::new();
    for _ in 0..4 {
        conns.push(raw_stream(srv.addr, 1_000_000).await);
    }
    wait_metrics(&c, &srv, "2 running, 2 waiting", |m| {
        metric(m, "vllm:num_requests_running") == 2.0
            && metric(m, "vllm:num_requests_waiting") == 2.0
            && metric(m, "llamacpp:requests_processing") == 2.0
            && metric(m, "llamacpp:requests_deferred") == 2.0
            && metric(m, "vllm:kv_cache_usage_perc") == 1.0
            && metric(m, "llamacpp:tokens_predicted_total") > 0.0
    })
    .await;
    read_until(&mut conns[0], "tok3 ").await;

    // Disconnecting every client frees the slots and empties the queue.
    conns.clear();
    wait_metrics(&c, &srv, "all slots free", |m| {
        metric(m, "vllm:num_requests_running") == 0.0
            && metric(m, "vllm:num_requests_waiting") == 0.0
    })
    .await;
    srv.stop().await;
}

#[tokio::test]
async fn disconnect_frees_the_only_slot() {
    let srv = Server::start(MockConfig {
        slots: 1,
        time_scale: 0.1,
        ..MockConfig::default()
    })
    .await;
    let c = client();
    let mut conn = raw_stream(srv.addr, 1_000_000).await;
    read_until(&mut conn, "tok2 ").await;
    drop(conn);
    // With the slot still taken this would wait for a million tokens.
    let t0 = Instant::now();
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(3, json!({})),
        &[],
    )
    .await;
    let v = json_body(r).await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert!(t0.elapsed() < Duration::from_secs(5));
    wait_metrics(&c, &srv, "slot free", |m| {
        metric(m, "llamacpp:requests_processing") == 0.0
    })
    .await;
    srv.stop().await;
}

#[tokio::test]
async fn concurrent_requests_keep_their_own_timings() {
    let srv = Server::start(MockConfig {
        slots: 4,
        time_scale: 0.1,
        ..MockConfig::default()
    })
    .await;
    let c = client();
    let url = srv.url("/v1/chat/completions");
    // A long prompt beside short ones: their phases differ per request.
    let long_prompt = "word ".repeat(3000);
    let long = json!({
        "model": "test-model", "messages": [{"role": "user", "content": long_prompt}],
        "mock_output_tokens": 20,
    });
    let mut tasks = Vec::new();
    for body in [long, chat_body(5, json!({})), chat_body(40, json!({}))] {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            json_body(post(&c, &url, &body, &[]).await).await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("task"));
    }
    let predicted: Vec<u64> = results
        .iter()
        .map(|v| v["timings"]["predicted_n"].as_u64().expect("n"))
        .collect();
    assert_eq!(predicted, vec![20, 5, 40]);
    assert_eq!(results[0]["usage"]["prompt_tokens"], 3000 + 4);
    let pms = |i: usize| results[i]["timings"]["predicted_ms"].as_f64().expect("ms");
    assert!(pms(2) > pms(1), "40 tokens decode longer than 5");
    srv.stop().await;
}

#[tokio::test]
async fn non_streaming_disconnect_aborts() {
    let srv = Server::start(MockConfig {
        slots: 1,
        time_scale: 0.1,
        ..MockConfig::default()
    })
    .await;
    let c = client();
    let mut s = TcpStream::connect(srv.addr).await.expect("connect");
    let body = chat_body(1_000_000, json!({})).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    wait_metrics(&c, &srv, "the request running", |m| {
        metric(m, "llamacpp:tokens_predicted_total") > 0.0
    })
    .await;
    drop(s);
    wait_metrics(&c, &srv, "slot free", |m| {
        metric(m, "llamacpp:requests_processing") == 0.0
    })
    .await;
    srv.stop().await;
}

#[tokio::test]
async fn time_scale_sets_the_pace() {
    // 0.05 × 8 ms = 0.4 ms per decode step: finer than the timer, paid back in bursts.
    let srv = Server::start(fast()).await;
    let c = client();
    let t0 = Instant::now();
    let v = json_body(
        post(
            &c,
            &srv.url("/v1/chat/completions"),
            &chat_body(501, json!({})),
            &[],
        )
        .await,
    )
    .await;
    let wall = t0.elapsed().as_secs_f64() * 1000.0;
    let predicted = v["timings"]["predicted_ms"].as_f64().expect("ms");
    // 500 decode steps × 0.4 ms = 200 ms.
    assert!(
        (150.0..400.0).contains(&predicted),
        "predicted_ms {predicted}"
    );
    assert!(wall >= predicted, "wall {wall} predicted {predicted}");
    srv.stop().await;
}

/// The SDK tracker's view: `/debug/sdk/requests` holds each finished request's phases (ns),
/// equal to the `timings` the response carried, and with `otlp_endpoint` a vLLM-style span
/// reaches an OTLP receiver with the same values, in the caller's trace.
#[tokio::test]
async fn sdk_records_and_otlp_spans_match_the_timings() {
    use std::sync::{Arc, Mutex};
    // A minimal OTLP/HTTP receiver.
    let bodies: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let b2 = bodies.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let b2 = b2.clone();
            async move {
                b2.lock().expect("lock").push(body);
                ([("content-type", "application/x-protobuf")], Bytes::new())
            }
        }),
    );
    let rx_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let rx_addr = rx_listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(rx_listener, app).await });

    let srv = Server::start(MockConfig {
        otlp_endpoint: Some(format!("http://{rx_addr}")),
        ..fast()
    })
    .await;
    let c = client();
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let tp = format!("00-{trace}-b7ad6b7169203331-01");
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(6, json!({})),
        &[("traceparent", &tp)],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v = json_body(r).await;
    // Untraced requests are tracked but not exported.
    let r = post(
        &c,
        &srv.url("/v1/chat/completions"),
        &chat_body(2, json!({})),
        &[],
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);

    let deadline = Instant::now() + LONG;
    let rec = loop {
        let (status, body) = get(&c, &srv.url("/debug/sdk/requests")).await;
        assert_eq!(status, StatusCode::OK);
        let list: Vec<Value> = serde_json::from_str(&body).expect("json");
        if list.len() == 2 {
            break list
                .into_iter()
                .find(|r| r["trace_id"] == trace)
                .expect("traced record");
        }
        assert!(Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(rec["request_id"], v["id"]);
    assert_eq!(rec["output_tokens"], 6);
    assert_eq!(rec["finish_reason"], "stop");
    let ns = |k: &str| rec[k].as_u64().expect(k);
    assert_eq!(
        ns("queue_ns") + ns("prefill_ns") + ns("decode_ns"),
        ns("e2e_ns")
    );
    let t = &v["timings"];
    let close = |ms: &Value, ns: u64| (ms.as_f64().expect("ms") * 1e6 - ns as f64).abs() < 1.0;
    assert!(close(&t["prompt_ms"], ns("prefill_ns")), "{t} {rec}");
    assert!(close(&t["predicted_ms"], ns("decode_ns")), "{t} {rec}");

    let span = loop {
        let got: Vec<Bytes> = bodies.lock().expect("lock").clone();
        let spans: Vec<_> = got
            .iter()
            .flat_map(|b| {
                tokenscope_otlp::decode_request(Some("application/x-protobuf"), b)
                    .expect("OTLP protobuf")
            })
            .collect();
        if let Some(s) = spans.into_iter().next() {
            break s;
        }
        assert!(Instant::now() < deadline, "no span");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(span.trace_id, trace);
    assert_eq!(span.name, "llm_request");
    assert_eq!(span.request_id.as_deref(), v["id"].as_str());
    let ms = |ns: u64| ns as f64 / 1e6;
    let same = |a: Option<f64>, b: f64| (a.expect("value") - b).abs() < 1e-6;
    assert!(same(span.update.queue_duration_ms, ms(ns("queue_ns"))));
    assert!(same(span.update.prefill_duration_ms, ms(ns("prefill_ns"))));
    assert!(same(span.update.decode_duration_ms, ms(ns("decode_ns"))));
    assert!(same(span.e2e_ms, ms(ns("e2e_ns"))));
    assert_eq!(span.update.output_tokens, Some(6));
    assert_eq!(span.update.input_tokens, Some(CHAT_PROMPT_TOKENS));

    // The SDK's engine-side request metrics ride on /metrics, with the gateway's names.
    let want = "llm_requests_total{model=\"test-model\",request_type=\"chat\",status=\"ok\"} 2";
    loop {
        let (_, m) = get(&c, &srv.url("/metrics")).await;
        if m.contains(want) {
            assert!(m.contains("llm_tokens_total{model=\"test-model\",token_type=\"output\",user_bucket=\"anonymous\"} 8"), "{m}");
            assert!(m.contains("# TYPE llm_ttft_seconds histogram"), "{m}");
            assert!(!m.contains("# EOF"), "0.0.4 text: {m}");
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    srv.stop().await;
}

/// The `(event, data)` pairs of a stream whose events are named (Responses, Messages APIs).
fn named_events(body: &str) -> Vec<(String, Value)> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("an event: line and a data: line: {e:?}"));
            let v = parse(data);
            assert_eq!(v["type"], name, "the data's type is the event's name");
            (name.to_owned(), v)
        })
        .collect()
}

#[tokio::test]
async fn responses_api_stream_and_body() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/responses");
    let body = json!({"model": "test-model", "instructions": "be brief",
                      "input": "hello mock engine", "stream": true, "mock_output_tokens": 3});
    let ev = named_events(&text(post(&c, &url, &body, &[]).await).await);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (_, v)) in ev[4..7].iter().enumerate() {
        assert_eq!(v["delta"], format!("tok{i} "));
    }
    // 4 + "be"(1) "brief"(2) for the instructions, then the input as a message.
    let prompt = 4 + 1 + 2 + CHAT_PROMPT_TOKENS;
    let done = &ev[10].1;
    assert_eq!(done["response"]["status"], "completed");
    assert_eq!(done["response"]["usage"]["input_tokens"], prompt, "{done}");
    assert_eq!(done["response"]["usage"]["output_tokens"], 3);
    assert_eq!(done["response"]["model"], "test-model");
    assert_timings(&done["timings"], prompt, 3);
    assert_eq!(
        done["response"]["output"][0]["content"][0]["text"],
        "tok0 tok1 tok2 "
    );

    // Not streamed, cut by `max_output_tokens`: `incomplete`.
    let body = json!({"model": "test-model", "input": [{"role": "user", "content": "hello mock engine"}],
                      "mock_output_tokens": 5, "max_output_tokens": 2});
    let v = json_body(post(&c, &url, &body, &[]).await).await;
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["output"][0]["content"][0]["text"], "tok0 tok1 ");
    assert_eq!(v["usage"]["input_tokens"], CHAT_PROMPT_TOKENS);
    assert_eq!(v["usage"]["output_tokens"], 2);
    let bad = post(&c, &url, &json!({"model": "m", "input": 3}), &[]).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    srv.stop().await;
}

#[tokio::test]
async fn messages_api_stream_and_body() {
    let srv = Server::start(fast()).await;
    let c = client();
    let url = srv.url("/v1/messages");
    let body = chat_body(4, json!({"stream": true, "max_tokens": 3}));
    let ev = named_events(&text(post(&c, &url, &body, &[]).await).await);
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let usage = &ev[0].1["message"]["usage"];
    assert_eq!(usage["input_tokens"], CHAT_PROMPT_TOKENS);
    assert_eq!(usage["cache_read_input_tokens"], 0);
    for (i, (_, v)) in ev[3..6].iter().enumerate() {
        assert_eq!(
            v["delta"],
            json!({"type": "text_delta", "text": format!("tok{i} ")})
        );
    }
    assert_eq!(ev[7].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(ev[7].1["usage"]["output_tokens"], 3);

    // Not streamed, with a system prompt: 4 + "be"(1) "brief"(2) more input tokens.
    let body = chat_body(2, json!({"system": "be brief", "max_tokens": 8}));
    let v = json_body(post(&c, &url, &body, &[]).await).await;
    assert_eq!(v["type"], "message");
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "tok0 tok1 "}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["input_tokens"], CHAT_PROMPT_TOKENS + 4 + 1 + 2);
    assert_eq!(v["usage"]["output_tokens"], 2);
    srv.stop().await;
}
