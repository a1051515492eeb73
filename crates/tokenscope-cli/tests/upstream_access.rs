//! Issue 18, items 2 and 5, through the real binary on port 0:
//! * credentials per upstream (`api_key_env` / `api_key_file`, `client_authorization`,
//!   `[upstreams.headers]`): what each upstream receives, measured and pass-through alike, and
//!   that no log line of the gateway (at debug) ever holds a key;
//! * pass-through requests routed by the model they name, and `GET /v1/models` answering the
//!   union of the upstreams' lists (a faithful pass-through with one upstream);
//! * the same against the real engine: llama.cpp's own `POST /tokenize` routed to it by model
//!   while a mock engine is the default, and the union of llama.cpp's and the mock's lists.

mod common;
mod llama;

use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KEY_A: &str = "sk-upstream-a-7f3c9e1d";
const KEY_B: &str = "sk-upstream-b-52aa0b4e";
const CLIENT_KEY: &str = "sk-client-gateway-key-91d2";
const CHAT_BODY: &str = r#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

/// A fixture answering every request with a chat completion, and `GET /v1/models` with `list`.
async fn fixture(list: &'static str) -> Fixture {
    Fixture::start(move |c| {
        if c.path == "/v1/models" {
            Reply::sized("application/json", list)
        } else {
            Reply::sized("application/json", CHAT_BODY)
        }
    })
    .await
}

/// `tokenscope serve --config FILE` with `env` set and the log (`TOKENSCOPE_LOG=debug`) written
/// to `log`.
fn start_logged(cfg: &str, env: &[(&str, &str)], log: &Path) -> GatewayProc {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("gateway.toml");
    std::fs::write(&cfg_path, cfg).expect("write config");
    let store = dir.path().join("tokenscope.db");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
    serve_args(&mut cmd, None, Some(&store), dir.path());
    cmd.arg("--config")
        .arg(&cfg_path)
        .env("TOKENSCOPE_LOG", "debug")
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(log).expect("log file"));
    for (k, v) in env {
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

/// What `tokenscope serve --config` with `cfg` and `env` says when it refuses to start.
fn refused_start(cfg: &str, env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("gateway.toml");
    std::fs::write(&cfg_path, cfg).expect("write config");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenscope"));
    serve_args(&mut cmd, None, Some(&dir.path().join("ts.db")), dir.path());
    cmd.arg("--config")
        .arg(&cfg_path)
        .env("TOKENSCOPE_LOG", "debug")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .spawn()
        .expect("spawn")
        .wait_with_output()
        .expect("wait");
    assert!(!out.status.success(), "the gateway must refuse to start");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("tokenscope listening"),
        "it never served"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn get_with(url: &str, headers: &[(&str, &str)]) -> (u16, http::HeaderMap, bytes::Bytes) {
    use http_body_util::BodyExt;
    let mut req = http::Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .expect("request");
    let resp = client().request(req).await.expect("GET");
    let status = resp.status().as_u16();
    let h = resp.headers().clone();
    (
        status,
        h,
        resp.into_body().collect().await.expect("body").to_bytes(),
    )
}

/// The requests `fx` received on `path`.
fn on(fx: &Fixture, path: &str) -> Vec<Captured> {
    fx.requests()
        .into_iter()
        .filter(|c| c.path == path)
        .collect()
}

/// Upstream A (key from the environment, `replace` by default, a literal extra header) and B
/// (key from a file, `client_authorization = "keep"`) receive what their settings say, on
/// measured, pass-through (sized and chunked) and `/v1/models` requests; the client's gateway
/// key still attributes the request (`[[api_keys]]`); the gateway's log at debug never holds a
/// key, and shows the header names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_upstream_gets_its_own_credentials_never_logged() {
    let a = fixture(r#"{"object":"list","data":[{"id":"a-model"}]}"#).await;
    let b = fixture(r#"{"object":"list","data":[{"id":"b-model"}]}"#).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let key_file = dir.path().join("b.key");
    std::fs::write(&key_file, format!("{KEY_B}\n")).expect("key file");
    let cfg = format!(
        "[[upstreams]]\nname = \"a\"\nurl = \"{}\"\nmodels = [\"a-*\"]\ndefault = true\n\
         scrape_interval_ms = 0\napi_key_env = \"TS_TEST_KEY_A\"\n\
         [upstreams.headers]\n\"OpenAI-Organization\" = \"org-1\"\n\
         [[upstreams]]\nname = \"b\"\nurl = \"{}\"\nmodels = [\"b-*\"]\nscrape_interval_ms = 0\n\
         api_key_file = {:?}\nclient_authorization = \"keep\"\n\
         [[api_keys]]\nkey = \"{CLIENT_KEY}\"\ntenant = \"t1\"\n",
        a.url(),
        b.url(),
        key_file.display().to_string(),
    );
    let log = dir.path().join("gateway.log");
    let gw = start_logged(&cfg, &[("TS_TEST_KEY_A", KEY_A)], &log);
    let client_auth = format!("Bearer {CLIENT_KEY}");
    let with_key = [
        ("authorization", client_auth.as_str()),
        ("x-api-key", CLIENT_KEY),
    ];

    // Measured: A gets its key and not the client's; B (keep) gets the client's own.
    for (model, id) in [("a-1", "req-a"), ("b-1", "req-b")] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        let mut h = with_key.to_vec();
        h.push(("x-request-id", id));
        let (status, _, _) = post_json(&gw.url("/v1/chat/completions"), &body, &h).await;
        assert_eq!(status, 200);
    }
    let got = a.request("req-a");
    assert_eq!(
        got.header("authorization"),
        Some(format!("Bearer {KEY_A}").as_str())
    );
    assert_eq!(
        got.header("x-api-key"),
        None,
        "replace drops every client credential"
    );
    assert_eq!(got.header("openai-organization"), Some("org-1"));
    let got = b.request("req-b");
    assert_eq!(got.header("authorization"), Some(client_auth.as_str()));
    assert_eq!(got.header("x-api-key"), Some(CLIENT_KEY));
    // The client's key attributed the request before it was replaced.
    let rec = gw.record("req-a").await;
    assert_eq!(rec["tenant"], "t1");
    assert_eq!(
        rec["api_key_id"],
        &tokenscope_config::sha256_hex(CLIENT_KEY)[..16]
    );
    assert_eq!(rec["upstream"], "a");

    // keep and a client without credentials: B's key from the file (trimmed) is sent.
    let body = json!({"model": "b-2", "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &body,
        &[("x-request-id", "req-b-nokey")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        b.request("req-b-nokey").header("authorization"),
        Some(format!("Bearer {KEY_B}").as_str())
    );

    // Pass-through with a known length, routed by model: the same rules.
    for (model, id) in [("a-1", "tok-a"), ("b-1", "tok-b")] {
        let mut h = with_key.to_vec();
        h.extend([("x-request-id", id), ("content-type", "application/json")]);
        let (status, _, _) = post_bytes(
            &gw.url("/tokenize"),
            format!(r#"{{"model":"{model}","content":"hello"}}"#),
            &h,
        )
        .await;
        assert_eq!(status, 200);
    }
    let got = a.request("tok-a");
    assert_eq!(got.path, "/tokenize");
    assert_eq!(
        got.header("authorization"),
        Some(format!("Bearer {KEY_A}").as_str())
    );
    assert_eq!(got.header("x-api-key"), None);
    assert_eq!(
        b.request("tok-b").header("authorization"),
        Some(client_auth.as_str())
    );

    // A chunked upload streams to the default upstream (A), with A's credentials.
    let raw = format!(
        "POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: {client_auth}\r\n\
         x-request-id: chunked-a\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         5\r\nhello\r\n0\r\n\r\n"
    );
    let (status, _, _) = raw_http(gw.proxy, raw.as_bytes()).await;
    assert_eq!(status, 200);
    let got = a.request("chunked-a");
    assert_eq!(got.body.as_ref(), b"hello");
    assert_eq!(
        got.header("authorization"),
        Some(format!("Bearer {KEY_A}").as_str())
    );

    // /v1/models over both upstreams: each asked with its own credentials.
    let (status, _, body) = get_with(&gw.url("/v1/models"), &with_key).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let got = on(&a, "/v1/models").pop().expect("A was asked");
    assert_eq!(
        got.header("authorization"),
        Some(format!("Bearer {KEY_A}").as_str())
    );
    let got = on(&b, "/v1/models").pop().expect("B was asked");
    assert_eq!(got.header("authorization"), Some(client_auth.as_str()));

    drop(gw);
    let log = std::fs::read_to_string(&log).expect("log");
    for secret in [KEY_A, KEY_B] {
        assert!(!log.contains(secret), "a key in the log:\n{log}");
    }
    let line = log
        .lines()
        .find(|l| l.contains("Upstream credentials") && l.contains("upstream=a"))
        .unwrap_or_else(|| panic!("no credentials line for a:\n{log}"));
    assert!(
        line.contains("authorization")
            && line.contains("openai-organization")
            && line.contains("replace"),
        "{line}"
    );
    assert!(
        log.lines().any(|l| l.contains("Upstream credentials")
            && l.contains("upstream=b")
            && l.contains("keep")),
        "{log}"
    );
}

/// A missing variable, an unreadable or empty file, refuse the start naming the variable or
/// the file.
#[test]
fn unresolvable_credentials_refuse_the_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty.key");
    std::fs::write(&empty, "\n").expect("write");
    let head =
        "[[upstreams]]\nname = \"a\"\nurl = \"http://127.0.0.1:9\"\nscrape_interval_ms = 0\n";
    let err = refused_start(
        &format!("{head}api_key_env = \"TS_TEST_NO_SUCH_VAR\"\n"),
        &[],
    );
    assert!(
        err.contains("TS_TEST_NO_SUCH_VAR") && err.contains("not set"),
        "{err}"
    );
    let err = refused_start(
        &format!("{head}api_key_file = \"/nonexistent/ts-test.key\"\n"),
        &[],
    );
    assert!(err.contains("/nonexistent/ts-test.key"), "{err}");
    let err = refused_start(
        &format!("{head}api_key_file = {:?}\n", empty.display().to_string()),
        &[],
    );
    assert!(err.contains("empty.key") && err.contains("empty"), "{err}");
    let err = refused_start(
        &format!("{head}[upstreams.headers]\n\"x-api-key\" = {{ env = \"TS_TEST_HDR\" }}\n"),
        &[("TS_TEST_HDR", "bad\u{7f}value-secret")],
    );
    assert!(
        err.contains("TS_TEST_HDR") && !err.contains("value-secret"),
        "{err}"
    );
}

/// Pass-through requests go to the upstream of the model they name: a JSON body's `model`, or
/// `/v1/models/{model}`; anything else (no model, a form, a chunked upload) to the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_is_routed_by_model() {
    let a = fixture(r#"{"data":[]}"#).await;
    let b = fixture(r#"{"data":[]}"#).await;
    let cfg = format!(
        "[[upstreams]]\nname = \"a\"\nurl = \"{}\"\ndefault = true\nscrape_interval_ms = 0\n\
         [[upstreams]]\nname = \"b\"\nurl = \"{}\"\nmodels = [\"b-model\", \"org/b-*\"]\n\
         scrape_interval_ms = 0\n",
        a.url(),
        b.url()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = start_logged(&cfg, &[], &dir.path().join("log"));
    let json_ct = ("content-type", "application/json");
    for (path, body, headers, want) in [
        (
            "/v1/audio/speech",
            r#"{"model":"b-model","input":"hi","voice":"x"}"#,
            vec![json_ct],
            "b",
        ),
        (
            "/tokenize",
            r#"{"content":"hi","model":"org/b-7"}"#,
            vec![json_ct],
            "b",
        ),
        (
            "/tokenize",
            r#"{"model":"other","content":"hi"}"#,
            vec![json_ct],
            "a",
        ),
        ("/tokenize", r#"{"content":"no model"}"#, vec![json_ct], "a"),
        ("/tokenize", r#"{"model":"b-model""#, vec![json_ct], "a"),
        (
            "/detokenize",
            r#"{"model":"b-model","tokens":[1]}"#,
            vec![],
            "b",
        ),
        (
            "/v1/audio/transcriptions",
            "--x\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nb-model\r\n--x--\r\n",
            vec![("content-type", "multipart/form-data; boundary=x")],
            "a",
        ),
    ] {
        let id = format!("{path}-{}", a.requests().len() + b.requests().len());
        let mut h = headers.clone();
        h.push(("x-request-id", &id));
        let (status, _, _) = post_bytes(&gw.url(path), body.to_owned(), &h).await;
        assert_eq!(status, 200, "{path} {body}");
        let (fx, other) = if want == "a" { (&a, &b) } else { (&b, &a) };
        let got = fx.request(&id);
        assert_eq!(got.body.as_ref(), body.as_bytes(), "forwarded unchanged");
        assert!(
            !other
                .requests()
                .iter()
                .any(|c| c.header("x-request-id") == Some(&id)),
            "{path} {body} reached only {want}"
        );
    }
    for (path, want) in [
        ("/v1/models/b-model", "b"),
        ("/v1/models/org%2Fb-1", "b"),
        ("/v1/models/org/b-1", "b"),
        ("/v1/models/other", "a"),
        ("/health", "a"),
    ] {
        let id = format!("get-{path}");
        let (status, _, _) = get_with(&gw.url(path), &[("x-request-id", &id)]).await;
        assert_eq!(status, 200, "{path}");
        let fx = if want == "a" { &a } else { &b };
        fx.request(&id);
    }
    // A chunked upload is not read before it is forwarded: the default upstream.
    let body = r#"{"model":"b-model"}"#;
    let raw = format!(
        "POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-request-id: chunked\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         {:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let (status, _, _) = raw_http(gw.proxy, raw.as_bytes()).await;
    assert_eq!(status, 200);
    assert_eq!(a.request("chunked").body.as_ref(), body.as_bytes());
    assert!(gw.records().await.is_empty(), "nothing here is measured");
}

/// `GET /v1/models` with several upstreams: their `data` items in upstream order, as written,
/// an id given once (the first upstream's); a failing upstream skipped; none answering → 502.
/// With one upstream the answer is the upstream's, byte for byte (an extra `models` key too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_union_of_the_upstreams() {
    let list_a = r#"{"object":"list","data":[{"id":"a-model","object":"model","owned_by":"a"},{"id":"shared","owned_by":"a"}],"models":[{"name":"a-model"}]}"#;
    let list_b = r#"{"data":[{"owned_by":"b", "id":"shared"},{"id":"b-model","created":7}]}"#;
    let a = fixture(list_a).await;
    let b = fixture(list_b).await;
    let failing = Fixture::start(|_| {
        let mut r = Reply::sized("application/json", r#"{"error":"nope"}"#);
        r.status = 500;
        r
    })
    .await;
    let up = |name: &str, url: &str| {
        format!("[[upstreams]]\nname = \"{name}\"\nurl = \"{url}\"\nscrape_interval_ms = 0\n")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = format!(
        "{}{}{}{}",
        up("a", &a.url()),
        up("dead", &format!("http://127.0.0.1:{}", dead_port())),
        up("failing", &failing.url()),
        up("b", &b.url())
    );
    let gw = start_logged(&cfg, &[], &dir.path().join("log"));
    let (status, headers, body) =
        get_with(&gw.url("/v1/models"), &[("accept-encoding", "gzip")]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(
        std::str::from_utf8(&body).expect("utf-8"),
        r#"{"object":"list","data":[{"id":"a-model","object":"model","owned_by":"a"},{"id":"shared","owned_by":"a"},{"id":"b-model","created":7}]}"#
    );
    drop(gw);

    // Every upstream failing: a JSON 502.
    let cfg = format!(
        "{}{}",
        up("dead", &format!("http://127.0.0.1:{}", dead_port())),
        up("failing", &failing.url())
    );
    let gw = start_logged(&cfg, &[], &dir.path().join("log2"));
    let (status, _, body) = get_with(&gw.url("/v1/models"), &[]).await;
    assert_eq!(status, 502);
    let err: Value = serde_json::from_slice(&body).expect("json error");
    let msg = err["error"]["message"].as_str().expect("message");
    assert!(msg.contains("dead") && msg.contains("failing"), "{msg}");
    drop(gw);

    // One upstream: its own answer, byte for byte.
    let gw = start_logged(&up("a", &a.url()), &[], &dir.path().join("log3"));
    let (status, _, body) = get_with(&gw.url("/v1/models"), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(std::str::from_utf8(&body).expect("utf-8"), list_a);
}

/// The real engine: llama.cpp behind the gateway next to a mock engine that is the default.
/// llama.cpp's own `POST /tokenize` naming its model reaches llama.cpp (the tokens equal the
/// direct answer, not the mock's); `/v1/models` lists the mock's items and then llama.cpp's
/// (as each answers them directly); with llama.cpp alone `/v1/models` is llama.cpp's answer
/// byte for byte (its Ollama-style `models` key included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_tokenize_and_models_through_the_gateway() {
    let Some(llama) = llama::start(&["-np", "1", "-c", "2048"]).await else {
        return;
    };
    let mock = MockProc::start(&[]);
    let cfg = format!(
        "[[upstreams]]\nname = \"mock\"\nurl = \"{}\"\ndefault = true\n\
         [[upstreams]]\nname = \"llama\"\nurl = \"{}\"\nkind = \"llamacpp\"\nmodels = [\"gemma*\"]\n",
        mock.url(),
        llama.url()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let gw = start_logged(&cfg, &[], &dir.path().join("log"));
    let tokenize = |base: String, model: &'static str| async move {
        let body = json!({"model": model, "content": "Hello tokenscope world"});
        let (status, _, body) = post_json(&format!("{base}/tokenize"), &body, &[]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice::<Value>(&body).expect("json")
    };
    let direct = tokenize(llama.url(), "gemma-3-270m").await;
    let through = tokenize(format!("http://{}", gw.proxy), "gemma-3-270m").await;
    assert!(
        direct["tokens"].as_array().is_some_and(|t| !t.is_empty()),
        "{direct}"
    );
    assert_eq!(through, direct, "routed to llama.cpp by the body's model");
    let mock_direct = tokenize(mock.url(), "gemma-3-270m").await;
    assert_ne!(
        mock_direct, direct,
        "the default upstream would answer otherwise"
    );
    let to_default = tokenize(format!("http://{}", gw.proxy), "other-model").await;
    assert_eq!(
        to_default, mock_direct,
        "no upstream serves it: the default (mock)"
    );

    // The union in upstream order: the mock's items, then llama.cpp's, each as its engine
    // wrote it. llama.cpp stamps `created` with the current second: compare answers given
    // within the same second, retrying.
    let items = |v: Value| v["data"].as_array().cloned().expect("data");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let llama_list = items(
            serde_json::from_str(&get(&format!("{}/v1/models", llama.url())).await.1)
                .expect("json"),
        );
        let mock_list = items(
            serde_json::from_str(&get(&format!("{}/v1/models", mock.url())).await.1).expect("json"),
        );
        let (status, body) = get(&gw.url("/v1/models")).await;
        assert_eq!(status, 200, "{body}");
        let union: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(union["object"], "list");
        assert!(
            union.get("models").is_none(),
            "only the OpenAI shape: {union}"
        );
        let want: Vec<Value> = mock_list.into_iter().chain(llama_list).collect();
        if items(union.clone()) == want {
            assert!(want.iter().any(|m| m["id"] == "mock-llm"));
            assert!(want.len() >= 2, "{union}");
            break;
        }
        assert!(Instant::now() < deadline, "{union} != {want:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(gw);

    // llama.cpp alone: its answer byte for byte.
    let gw = GatewayProc::start(&llama.url(), &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let direct = get(&format!("{}/v1/models", llama.url())).await;
        let through = get(&gw.url("/v1/models")).await;
        assert_eq!(direct.0, 200);
        assert!(
            direct.1.contains("\"models\""),
            "llama.cpp's own shape: {}",
            direct.1
        );
        if through == direct {
            break;
        }
        assert!(Instant::now() < deadline, "{through:?} != {direct:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
