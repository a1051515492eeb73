//! Engine flavor against small in-test axum servers shaped like llama.cpp, vLLM and TGI.
//!
//! Each fake engine "tokenizes" by whitespace (one token per word, +1 for a BOS when special
//! tokens are asked for) and records every request it receives, so the tests check both the
//! counts and the exact request shapes sent (paths and JSON fields, see `src/engine.rs` for the
//! engine sources they follow).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenscope_core::Endpoint;
use tokenscope_tokenize::{
    EngineFlavor, TokenizeError, TokenizerConfig, TokenizerSpec, Tokenizers, MAX_COUNT_BYTES,
    MAX_ENGINE_CALLS,
};

type Log = Arc<Mutex<Vec<(String, Value)>>>;

fn words(s: &str) -> usize {
    s.split_whitespace().count()
}

fn record(log: &Log, path: &str, body: &Value) {
    log.lock()
        .expect("log lock")
        .push((path.to_owned(), body.clone()));
}

fn taken(log: &Log) -> Vec<(String, Value)> {
    std::mem::take(&mut *log.lock().expect("log lock"))
}

/// The fake chat template: "<role> <content>" per message, then "model".
fn template(messages: &Value) -> String {
    let mut s = String::new();
    for m in messages.as_array().expect("messages array") {
        s.push_str(m["role"].as_str().unwrap_or(""));
        s.push(' ');
        s.push_str(m["content"].as_str().unwrap_or(""));
        s.push('\n');
    }
    s.push_str("model");
    s
}

fn llama_router(log: Log) -> Router {
    Router::new()
        .route(
            "/tokenize",
            post(|State(log): State<Log>, Json(b): Json<Value>| async move {
                record(&log, "/tokenize", &b);
                let content = b["content"].as_str().unwrap_or("");
                let special = b["add_special"].as_bool().unwrap_or(false);
                let n = words(content) + usize::from(special);
                Json(json!({ "tokens": (0..n).collect::<Vec<_>>() }))
            }),
        )
        .route(
            "/apply-template",
            post(|State(log): State<Log>, Json(b): Json<Value>| async move {
                record(&log, "/apply-template", &b);
                Json(json!({ "prompt": template(&b["messages"]) }))
            }),
        )
        .with_state(log)
}

fn vllm_router(log: Log) -> Router {
    Router::new()
        .route(
            "/tokenize",
            post(|State(log): State<Log>, Json(b): Json<Value>| async move {
                record(&log, "/tokenize", &b);
                let n = match b.get("messages") {
                    Some(m) => words(&template(m)),
                    None => {
                        words(b["prompt"].as_str().unwrap_or(""))
                            + usize::from(b["add_special_tokens"].as_bool().unwrap_or(true))
                    }
                };
                Json(json!({ "count": n, "max_model_len": 4096, "tokens": (0..n).collect::<Vec<_>>() }))
            }),
        )
        .with_state(log)
}

fn tgi_tokens(text: &str) -> Value {
    Value::Array(
        text.split_whitespace()
            .enumerate()
            .map(|(i, w)| json!({ "id": i, "text": w, "start": 0, "stop": 0 }))
            .collect(),
    )
}

fn tgi_router(log: Log) -> Router {
    Router::new()
        .route(
            "/tokenize",
            post(|State(log): State<Log>, Json(b): Json<Value>| async move {
                record(&log, "/tokenize", &b);
                Json(tgi_tokens(b["inputs"].as_str().unwrap_or("")))
            }),
        )
        .route(
            "/chat_tokenize",
            post(|State(log): State<Log>, Json(b): Json<Value>| async move {
                record(&log, "/chat_tokenize", &b);
                let text = template(&b["messages"]);
                Json(json!({ "tokenize_response": tgi_tokens(&text), "templated_text": text }))
            }),
        )
        .with_state(log)
}

/// Serves `router` on 127.0.0.1:0; the task ends with the test's runtime.
async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    format!("http://{addr}")
}

fn engine(url: &str, flavor: EngineFlavor) -> Tokenizers {
    Tokenizers::new(&[TokenizerConfig {
        models: vec!["m*".into()],
        spec: TokenizerSpec::Engine {
            base_url: url.to_owned(),
            flavor,
            ca_file: None,
            client_cert: None,
            client_key: None,
        },
    }])
    .expect("engine tokenizer")
}

fn chat_body() -> Value {
    json!({
        "model": "m1",
        "stream": true,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is a token"}
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": false}
    })
}

async fn count(t: &Tokenizers, endpoint: Endpoint, body: &Value) -> Result<u64, TokenizeError> {
    t.count_request("m1", endpoint, body)
        .await
        .expect("m1 is routed")
}

#[tokio::test]
async fn llamacpp_chat_applies_the_template_then_tokenizes_with_special_tokens() {
    let log = Log::default();
    let url = serve(llama_router(log.clone())).await;
    let t = engine(&url, EngineFlavor::LlamaCpp);

    // "system be brief\nuser what is a token\nmodel" = 9 words, + BOS.
    assert_eq!(
        count(&t, Endpoint::ChatCompletions, &chat_body())
            .await
            .expect("count"),
        10
    );
    let calls = taken(&log);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].0, "/apply-template");
    assert_eq!(
        calls[0].1,
        chat_body(),
        "the chat body is forwarded as it is"
    );
    assert_eq!(calls[1].0, "/tokenize");
    assert_eq!(
        calls[1].1,
        json!({
            "content": "system be brief\nuser what is a token\nmodel",
            "add_special": true,
            "parse_special": true
        })
    );
}

#[tokio::test]
async fn llamacpp_completions_embeddings_and_text() {
    let log = Log::default();
    let url = serve(llama_router(log.clone())).await;
    let t = engine(&format!("{url}/"), EngineFlavor::LlamaCpp);

    let body = json!({ "model": "m1", "prompt": ["one two", "three", [7, 8, 9]] });
    // (2 + BOS) + (1 + BOS) + 3 token ids.
    assert_eq!(
        count(&t, Endpoint::Completions, &body)
            .await
            .expect("count"),
        8
    );
    let calls = taken(&log);
    assert_eq!(calls.len(), 2, "token ids need no call");
    assert_eq!(
        calls[0].1,
        json!({ "content": "one two", "add_special": true, "parse_special": true })
    );

    let body = json!({ "model": "m1", "input": "a b c" });
    assert_eq!(
        count(&t, Endpoint::Embeddings, &body).await.expect("count"),
        4
    );
    taken(&log);

    let n = t
        .count_text("m1", "the cancelled output so far")
        .await
        .expect("routed")
        .expect("count");
    assert_eq!(n, 5);
    let calls = taken(&log);
    assert_eq!(
        calls[0].1,
        json!({ "content": "the cancelled output so far", "add_special": false, "parse_special": false })
    );
}

#[tokio::test]
async fn vllm_chat_and_prompts() {
    let log = Log::default();
    let url = serve(vllm_router(log.clone())).await;
    let t = engine(&url, EngineFlavor::Vllm);

    assert_eq!(
        count(&t, Endpoint::ChatCompletions, &chat_body())
            .await
            .expect("count"),
        9
    );
    let calls = taken(&log);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "/tokenize");
    let body = chat_body();
    assert_eq!(
        calls[0].1,
        json!({
            "model": "m1",
            "messages": body["messages"],
            "tools": body["tools"],
            "chat_template_kwargs": body["chat_template_kwargs"]
        }),
        "TokenizeChatRequest fields only"
    );

    let body = json!({ "model": "m1", "prompt": "one two three" });
    assert_eq!(
        count(&t, Endpoint::Completions, &body)
            .await
            .expect("count"),
        4
    );
    assert_eq!(
        taken(&log)[0].1,
        json!({ "model": "m1", "prompt": "one two three", "add_special_tokens": true })
    );

    let n = t
        .count_text("m1", "x y")
        .await
        .expect("routed")
        .expect("count");
    assert_eq!(n, 2);
    assert_eq!(
        taken(&log)[0].1,
        json!({ "model": "m1", "prompt": "x y", "add_special_tokens": false })
    );
}

#[tokio::test]
async fn tgi_chat_and_prompts() {
    let log = Log::default();
    let url = serve(tgi_router(log.clone())).await;
    let t = engine(&url, EngineFlavor::Tgi);

    assert_eq!(
        count(&t, Endpoint::ChatCompletions, &chat_body())
            .await
            .expect("count"),
        9
    );
    let calls = taken(&log);
    assert_eq!(calls[0].0, "/chat_tokenize");
    assert_eq!(calls[0].1, chat_body());

    let body = json!({ "model": "m1", "input": ["a b", "c"] });
    assert_eq!(
        count(&t, Endpoint::Embeddings, &body).await.expect("count"),
        3
    );
    let calls = taken(&log);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[0],
        ("/tokenize".to_owned(), json!({ "inputs": "a b" }))
    );
}

#[tokio::test]
async fn engine_failures_are_errors_not_stalls() {
    // Non-2xx, a wrong body, a slow engine.
    let router = Router::new()
        .route(
            "/tokenize",
            post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "model not loaded") }),
        )
        .route(
            "/apply-template",
            post(|| async { Json(json!({ "text": "no prompt field" })) }),
        )
        .route(
            "/chat_tokenize",
            post(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Json(json!({ "tokenize_response": [] }))
            }),
        );
    let url = serve(router).await;

    let llama = engine(&url, EngineFlavor::LlamaCpp);
    let err = llama.count_text("m1", "x").await.expect("routed");
    assert!(
        matches!(&err, Err(TokenizeError::EngineStatus { status: 500, body, .. }) if body == "model not loaded"),
        "{err:?}"
    );
    let err = count(&llama, Endpoint::ChatCompletions, &chat_body()).await;
    assert!(
        matches!(&err, Err(TokenizeError::EngineBody { .. })),
        "{err:?}"
    );

    let tgi = engine(&url, EngineFlavor::Tgi).with_engine_timeout(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let err = count(&tgi, Endpoint::ChatCompletions, &chat_body()).await;
    assert!(
        matches!(&err, Err(TokenizeError::EngineTimeout { .. })),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));

    // Nothing listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let gone = engine(&format!("http://{closed}"), EngineFlavor::Vllm);
    let err = gone.count_text("m1", "x").await.expect("routed");
    assert!(
        matches!(&err, Err(TokenizeError::EngineRequest { .. })),
        "{err:?}"
    );
}

#[tokio::test]
async fn limits_are_enforced_before_calling_the_engine() {
    let log = Log::default();
    let url = serve(llama_router(log.clone())).await;
    let t = engine(&url, EngineFlavor::LlamaCpp);

    let big = "a ".repeat(MAX_COUNT_BYTES / 2 + 1);
    let err = count(&t, Endpoint::Completions, &json!({ "prompt": big })).await;
    assert!(
        matches!(err, Err(TokenizeError::TooLong { len, limit }) if len == big.len() && limit == MAX_COUNT_BYTES)
    );
    let err = t.count_text("m1", &big).await.expect("routed");
    assert!(matches!(err, Err(TokenizeError::TooLong { .. })));

    let many: Vec<String> = (0..=MAX_ENGINE_CALLS).map(|i| format!("p{i}")).collect();
    let err = count(&t, Endpoint::Completions, &json!({ "prompt": many })).await;
    assert!(
        matches!(err, Err(TokenizeError::TooManyPrompts { count, limit }) if count == MAX_ENGINE_CALLS + 1 && limit == MAX_ENGINE_CALLS)
    );

    let err = count(&t, Endpoint::ChatCompletions, &json!({ "prompt": "x" })).await;
    assert!(matches!(
        err,
        Err(TokenizeError::NoPrompt {
            endpoint: "chat_completions"
        })
    ));
    assert!(taken(&log).is_empty(), "no engine call was made");
}

#[test]
fn bad_engine_urls_fail_at_startup() {
    for url in ["ftp://engine:443", "engine:8080", "http://x/?q=1"] {
        let err = Tokenizers::new(&[TokenizerConfig {
            models: vec!["*".into()],
            spec: TokenizerSpec::Engine {
                base_url: url.into(),
                flavor: EngineFlavor::LlamaCpp,
                ca_file: None,
                client_cert: None,
                client_key: None,
            },
        }]);
        assert!(
            matches!(err, Err(TokenizeError::InvalidUrl { .. })),
            "{url}"
        );
    }
}

/// An `https://` engine: counted with the entry's `ca_file`; a file that cannot be read is a
/// startup error naming it.
#[tokio::test]
async fn https_engine_with_a_ca_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = tokenscope_net::test_util::TestPki::generate(dir.path()).expect("pki");
    let tls = tokenscope_net::server_config(&pki.server_cert, &pki.server_key, None, &[])
        .expect("server config");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let listener = tokenscope_net::TlsListener::new(tcp, tls).expect("listener");
    let log = Log::default();
    let router = llama_router(log.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let spec = |ca: std::path::PathBuf| TokenizerConfig {
        models: vec!["m*".into()],
        spec: TokenizerSpec::Engine {
            base_url: format!("https://localhost:{port}"),
            flavor: EngineFlavor::LlamaCpp,
            ca_file: Some(ca),
            client_cert: None,
            client_key: None,
        },
    };
    let t = Tokenizers::new(&[spec(pki.ca.clone())]).expect("engine tokenizer");
    let body = json!({ "model": "m1", "prompt": "one two" });
    assert_eq!(
        count(&t, Endpoint::Completions, &body)
            .await
            .expect("count over https"),
        3
    );
    assert_eq!(taken(&log).len(), 1);
    let Err(err) = Tokenizers::new(&[spec(dir.path().join("missing.pem"))]) else {
        panic!("a missing CA file must be refused");
    };
    assert!(err.to_string().contains("missing.pem"), "{err}");
}
