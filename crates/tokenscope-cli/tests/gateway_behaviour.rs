//! Behaviour of the real `tokenscope` binary in front of an in-test fixture upstream (fixed
//! bytes, scripted chunking and timing, every request it receives kept) or the mock engine:
//! byte-exact pass-through, streaming without buffering, ids and trace context, attribution,
//! privacy, unmeasured paths, bounded metric labels, promtool, and the `report` command.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokenscope_core::prompt::{normalised_prompt, prompt_hash};
use tokenscope_core::Endpoint;

const ROLE: &str = r#"{"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fx-served","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
const TOK1: &str = r#"{"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fx-served","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}"#;
const TOK2: &str = r#"{"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fx-served","choices":[{"index":0,"delta":{"content":"lo!"},"finish_reason":null}]}"#;
const FINISH: &str = r#"{"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fx-served","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
const USAGE: &str = r#"{"id":"fx-1","object":"chat.completion.chunk","created":1,"model":"fx-served","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":42,"total_tokens":53}}"#;

/// A non-streamed answer, formatted oddly on purpose (byte-exactness is visible).
const JSON_BODY: &str = "{\n  \"id\": \"fx-json\",  \"object\":\"chat.completion\",\"created\":1,\"model\":\"fx-served\",\n \"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"Hello there\"},\"finish_reason\":\"stop\"}],\n\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n";

fn chat(model: &str, content: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
    })
}

fn with_usage(mut body: Value) -> Value {
    body["stream_options"] = json!({"include_usage": true});
    body
}

fn hdr<'a>(h: &'a http::HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("response header {name} missing"))
}

fn json_reply() -> Reply {
    Reply::sized("application/json", JSON_BODY)
}

async fn json_fixture() -> Fixture {
    Fixture::start(|_| json_reply()).await
}

/// The SSE fixture stream, and the same without its usage-only event. Mixed CRLF / LF endings,
/// a comment line inside an event, a comment-only event and an `event:` field.
fn sse_fixture() -> (Vec<u8>, Vec<u8>) {
    let events = [
        format!(": fixture stream\ndata: {ROLE}\r\n\r\n"),
        format!("data: {TOK1}\n\n"),
        ": keep-alive\r\n\r\n".to_owned(),
        format!("data: {TOK2}\r\n\n"),
        format!("event: message\ndata: {FINISH}\n\n"),
        format!("data: {USAGE}\r\n\r\n"),
        "data: [DONE]\n\n".to_owned(),
    ];
    let full = events.concat().into_bytes();
    let stripped = events
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 5)
        .map(|(_, e)| e.as_str())
        .collect::<String>()
        .into_bytes();
    (full, stripped)
}

/// Odd cut points: every 41 bytes from 3, between every `\r` and `\n`, inside the usage event.
fn odd_cuts(body: &[u8]) -> Vec<usize> {
    let mut cuts: Vec<usize> = (3..body.len()).step_by(41).collect();
    cuts.extend(
        body.windows(2)
            .enumerate()
            .filter(|(_, w)| w == b"\r\n")
            .map(|(i, _)| i + 1),
    );
    let usage_at = body
        .windows(USAGE.len())
        .position(|w| w == USAGE.as_bytes())
        .expect("usage event in the fixture");
    cuts.extend([usage_at + 7, usage_at + USAGE.len() / 2]);
    cuts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_passes_through_byte_for_byte() {
    let (full, stripped) = sse_fixture();
    let cuts = odd_cuts(&full);
    let reply = Reply::cut("text/event-stream", &full, &cuts, Duration::from_millis(3));
    assert!(
        reply.steps.len() > 30,
        "the stream is written in many pieces"
    );
    // The same stream cut short of its final blank line (`data: [DONE]` unterminated).
    let unterminated = &full[..full.len() - 2];
    let short_reply = Reply::cut(
        "text/event-stream",
        unterminated,
        &odd_cuts(unterminated),
        Duration::from_millis(1),
    );
    // The same pieces with no pause: several HTTP chunks arrive in one read, so the gateway
    // forwards what arrived together as one frame (coalescing, also across the stripped
    // usage event).
    let burst_reply = Reply::cut("text/event-stream", &full, &cuts, Duration::ZERO);
    let fx = Fixture::start(move |c| match c.header("x-fixture") {
        Some("unterminated") => short_reply.clone(),
        Some("burst") => burst_reply.clone(),
        _ => reply.clone(),
    })
    .await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");

    // The client asked for usage: every byte as the engine sent it, the request untouched.
    let body = with_usage(chat("fx", "Say hello.", true));
    let s = stream(&url, &body, &[("x-request-id", "sse-with-usage")], None).await;
    assert_eq!(s.status, 200);
    assert_eq!(
        String::from_utf8_lossy(&s.raw),
        String::from_utf8_lossy(&full),
        "client bytes == fixture bytes"
    );
    assert_eq!(
        fx.request("sse-with-usage").body,
        body.to_string().as_bytes(),
        "request forwarded as sent"
    );
    let rec = gw.record("sse-with-usage").await;
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["output_tokens"], 42);
    assert_eq!(rec["output_tokens_source"], "usage");

    // The client did not ask: the gateway asks upstream and removes exactly the usage event.
    let body = chat("fx", "Say hello.", true);
    let s = stream(&url, &body, &[("x-request-id", "sse-stripped")], None).await;
    assert_eq!(s.status, 200);
    assert_eq!(
        String::from_utf8_lossy(&s.raw),
        String::from_utf8_lossy(&stripped),
        "client bytes == fixture bytes minus the usage-only event"
    );
    let upstream = fx.request("sse-stripped").json();
    assert_eq!(upstream["stream_options"]["include_usage"], true);
    assert_eq!(upstream, with_usage(body), "only include_usage was added");
    let rec = gw.record("sse-stripped").await;
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["error_type"], Value::Null);
    assert_eq!(
        rec["output_tokens"], 42,
        "from the usage, not the 2 content chunks"
    );
    assert_eq!(rec["output_tokens_source"], "usage");
    assert_eq!(rec["input_tokens"], 11);
    assert_eq!(rec["input_tokens_source"], "usage");
    assert_eq!(rec["chunks"], 2);
    assert_eq!(rec["finish_reason"], "stop");
    assert_eq!(rec["model_served"], "fx-served");
    assert!(rec["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{rec}");

    // Burst: the same bytes and the same record, in both modes.
    for (body, want) in [
        (with_usage(chat("fx", "Say hello.", true)), full.clone()),
        (chat("fx", "Say hello.", true), stripped.clone()),
    ] {
        let s = stream(&url, &body, &[("x-fixture", "burst")], None).await;
        assert_eq!(
            String::from_utf8_lossy(&s.raw),
            String::from_utf8_lossy(&want),
            "burst, include_usage={}",
            body["stream_options"]["include_usage"]
        );
        let rec = gw.record(&s.request_id()).await;
        assert_eq!(rec["outcome"], "ok", "{rec}");
        assert_eq!(rec["output_tokens"], 42);
        assert_eq!(rec["chunks"], 2);
        assert_eq!(rec["finish_reason"], "stop");
    }

    // An unterminated last event is still delivered, in both modes.
    for (body, want) in [
        (
            with_usage(chat("fx", "Say hello.", true)),
            unterminated.to_vec(),
        ),
        (
            chat("fx", "Say hello.", true),
            stripped[..stripped.len() - 2].to_vec(),
        ),
    ] {
        let s = stream(&url, &body, &[("x-fixture", "unterminated")], None).await;
        assert_eq!(
            String::from_utf8_lossy(&s.raw),
            String::from_utf8_lossy(&want),
            "unterminated stream, include_usage={}",
            body["stream_options"]["include_usage"]
        );
        let rec = gw.record(&s.request_id()).await;
        assert_eq!(rec["outcome"], "ok", "{rec}");
        assert_eq!(rec["output_tokens"], 42);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_events_are_not_buffered() {
    let fx = Fixture::start(|_| {
        Reply::chunked(
            "text/event-stream",
            vec![
                Step::Send(format!("data: {TOK1}\n\n").into()),
                Step::Pause(Duration::from_millis(400)),
                Step::Send(format!("data: {FINISH}\n\ndata: {USAGE}\n\ndata: [DONE]\n\n").into()),
            ],
        )
    })
    .await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    for (body, events) in [
        (with_usage(chat("fx", "hi", true)), 4), // passed through
        (chat("fx", "hi", true), 3),             // re-framed, usage removed
    ] {
        let s = stream(&url, &body, &[], None).await;
        assert_eq!(s.status, 200);
        assert_eq!(s.events.len(), events, "{:?}", s.events);
        let first = (s.events[0].at - s.sent_at).as_secs_f64() * 1000.0;
        let second = (s.events[1].at - s.sent_at).as_secs_f64() * 1000.0;
        assert!(
            first < 300.0,
            "event 1 arrived after {first:.0} ms: buffered"
        );
        assert!(
            second >= 400.0,
            "event 2 arrived after {second:.0} ms, before it was sent"
        );
        let rec = gw.record(&s.request_id()).await;
        assert_eq!(rec["outcome"], "ok", "{rec}");
        let ttft = rec["ttft_ms"].as_f64().expect("ttft");
        assert!(ttft < 300.0, "recorded TTFT {ttft}");
        let total = rec["total_duration_ms"].as_f64().expect("total");
        assert!(total >= 400.0, "recorded total {total}");
        assert_eq!(rec["output_tokens"], 42);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sized_json_passes_through_and_is_ok() {
    let big = JSON_BODY.replace("Hello there", &"a".repeat(300_000));
    let big_reply = Reply::sized("application/json", big.clone());
    let chunked = Reply::cut(
        "application/json",
        JSON_BODY.as_bytes(),
        &[1, 20, 77, 150],
        Duration::from_millis(2),
    );
    let fx = Fixture::start(move |c| match c.header("x-fixture") {
        Some("big") => big_reply.clone(),
        Some("chunked") => chunked.clone(),
        _ => json_reply(),
    })
    .await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let mut ids = Vec::new();
    for (kind, want, sized) in [
        ("small", JSON_BODY.to_owned(), true),
        ("small", JSON_BODY.to_owned(), true),
        ("small", JSON_BODY.to_owned(), true),
        ("big", big.clone(), true),
        ("chunked", JSON_BODY.to_owned(), false),
    ] {
        let (status, headers, body) =
            post_json(&url, &chat("fx", "hi", false), &[("x-fixture", kind)]).await;
        assert_eq!(status, 200);
        assert!(
            body == want.as_bytes(),
            "{kind}: body differs from the fixture's"
        );
        if sized {
            assert_eq!(
                hdr(&headers, "content-length"),
                want.len().to_string(),
                "{kind}"
            );
        }
        let id = hdr(&headers, "x-request-id").to_owned();
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "ok", "{kind}: {rec}");
        assert_eq!(rec["error_type"], Value::Null, "{kind}");
        assert_eq!(rec["http_status"], 200);
        assert_eq!(rec["output_tokens"], 3, "{kind}");
        assert_eq!(rec["output_tokens_source"], "usage");
        assert_eq!(rec["input_tokens"], 9);
        assert_eq!(rec["finish_reason"], "stop");
        assert_eq!(rec["ttft_ms"], Value::Null, "no TTFT without a stream");
        ids.push(id);
    }
    let (store, _dir) = gw.stop();
    let rows = store_table(&store);
    assert_eq!(rows.len(), ids.len());
    assert!(rows.iter().all(|r| r["outcome"] == "ok"), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_and_trace_context() {
    let fx = json_fixture().await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let body = chat("fx", "hi", false);

    // The client's id is kept as data, returned and forwarded unchanged; the key is ours
    // (a UUIDv7, returned as x-tokenscope-request-id).
    let (status, h, _) = post_json(&url, &body, &[("x-request-id", "client-id-42")]).await;
    assert_eq!(status, 200);
    assert_eq!(hdr(&h, "x-request-id"), "client-id-42");
    assert_eq!(
        fx.request("client-id-42").header("x-request-id"),
        Some("client-id-42")
    );
    let key = hdr(&h, "x-tokenscope-request-id").to_owned();
    assert!(is_uuid_v7(&key), "{key:?} is not a UUIDv7");
    let rec = gw.record("client-id-42").await;
    assert_eq!(rec["request_id"], key.as_str());
    assert_eq!(rec["client_request_id"], "client-id-42");

    // Without one (or with an unusable one) a UUIDv7 is made, and is both ids.
    for headers in [vec![], vec![("x-request-id", "has a space")]] {
        let (_, h, _) = post_json(&url, &body, &headers).await;
        let id = hdr(&h, "x-request-id").to_owned();
        assert!(is_uuid_v7(&id), "{id:?} is not a UUIDv7");
        assert_eq!(hdr(&h, "x-tokenscope-request-id"), id);
        assert_eq!(fx.request(&id).header("x-request-id"), Some(id.as_str()));
        assert_eq!(gw.record(&id).await["client_request_id"], Value::Null);
    }

    // An incoming traceparent is continued: same trace, the gateway's own span.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let (_, h, _) = post_json(
        &url,
        &body,
        &[
            ("x-request-id", "traced"),
            ("traceparent", &format!("00-{trace}-{parent}-01")),
        ],
    )
    .await;
    assert_eq!(hdr(&h, "x-tokenscope-trace-id"), trace);
    let tp = fx
        .request("traced")
        .header("traceparent")
        .expect("traceparent upstream")
        .to_owned();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", trace, "01"), "{tp}");
    assert_eq!(parts[2].len(), 16, "{tp}");
    assert!(parts[2].bytes().all(|b| b.is_ascii_hexdigit()), "{tp}");
    assert_ne!(
        parts[2], parent,
        "the upstream's parent is the gateway's span"
    );
    assert_eq!(gw.record("traced").await["trace_id"], trace);

    // Without one, a new trace starts and is propagated.
    let (_, h, _) = post_json(&url, &body, &[("x-request-id", "fresh-trace")]).await;
    let fresh = hdr(&h, "x-tokenscope-trace-id").to_owned();
    assert_eq!(fresh.len(), 32);
    assert!(
        fresh
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{fresh}"
    );
    let tp = fx
        .request("fresh-trace")
        .header("traceparent")
        .expect("traceparent")
        .to_owned();
    assert_eq!(tp.split('-').nth(1), Some(fresh.as_str()), "{tp}");
    assert_eq!(gw.record("fresh-trace").await["trace_id"], fresh.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribution_headers_body_user_and_api_keys() {
    const KEY: &str = "sk-test-123";
    const OTHER_KEY: &str = "sk-unmapped-987";
    let fx = json_fixture().await;
    let cfg_dir = tempfile::tempdir().expect("tempdir");
    let cfg = cfg_dir.path().join("keys.toml");
    std::fs::write(
        &cfg,
        format!("[[api_keys]]\nkey = \"{KEY}\"\ntenant = \"t1\"\nbusiness_line = \"bl1\"\n"),
    )
    .expect("write config");
    let gw = GatewayProc::start(
        &fx.url(),
        &[("TOKENSCOPE_CONFIG", cfg.to_str().expect("utf-8 path"))],
    );
    let url = gw.url("/v1/chat/completions");
    let bearer = format!("Bearer {KEY}");
    let other = format!("Bearer {OTHER_KEY}");
    let mut body_user = chat("fx", "hi", false);
    body_user["user"] = json!("body-user");

    struct Case<'a> {
        id: &'a str,
        body: &'a Value,
        headers: Vec<(&'a str, &'a str)>,
        user: Option<&'a str>,
        tenant: Option<&'a str>,
        business_line: Option<&'a str>,
        request_type: &'a str,
        key: Option<&'a str>,
    }
    let plain = chat("fx", "hi", false);
    let cases = [
        Case {
            id: "attr-headers",
            body: &plain,
            headers: vec![
                ("x-tokenscope-user", "alice"),
                ("x-tokenscope-tenant", "acme"),
                ("x-tokenscope-business-line", "search"),
                ("x-tokenscope-request-type", "summarize"),
            ],
            user: Some("alice"),
            tenant: Some("acme"),
            business_line: Some("search"),
            request_type: "summarize",
            key: None,
        },
        Case {
            id: "attr-body-user",
            body: &body_user,
            headers: vec![],
            user: Some("body-user"),
            tenant: None,
            business_line: None,
            request_type: "chat",
            key: None,
        },
        Case {
            id: "attr-header-beats-body",
            body: &body_user,
            headers: vec![("x-tokenscope-user", "bob")],
            user: Some("bob"),
            tenant: None,
            business_line: None,
            request_type: "chat",
            key: None,
        },
        Case {
            id: "attr-key",
            body: &plain,
            headers: vec![("authorization", &bearer)],
            user: None,
            tenant: Some("t1"),
            business_line: Some("bl1"),
            request_type: "chat",
            key: Some(KEY),
        },
        Case {
            id: "attr-key-header-tenant",
            body: &plain,
            headers: vec![
                ("authorization", &bearer),
                ("x-tokenscope-tenant", "override"),
            ],
            user: None,
            tenant: Some("override"),
            business_line: Some("bl1"),
            request_type: "chat",
            key: Some(KEY),
        },
        Case {
            id: "attr-unmapped-key",
            body: &plain,
            headers: vec![("authorization", &other)],
            user: None,
            tenant: None,
            business_line: None,
            request_type: "chat",
            key: Some(OTHER_KEY),
        },
    ];
    let opt = |v: Option<&str>| v.map_or(Value::Null, |s| json!(s));
    for c in &cases {
        let mut headers = c.headers.clone();
        headers.push(("x-request-id", c.id));
        let (status, _, _) = post_json(&url, c.body, &headers).await;
        assert_eq!(status, 200);
        let rec = gw.record(c.id).await;
        assert_eq!(rec["user_id"], opt(c.user), "{}: {rec}", c.id);
        assert_eq!(rec["tenant"], opt(c.tenant), "{}", c.id);
        assert_eq!(rec["business_line"], opt(c.business_line), "{}", c.id);
        assert_eq!(rec["request_type"], c.request_type, "{}", c.id);
        let fingerprint = c
            .key
            .map(|k| tokenscope_gateway::config::sha256_hex(k)[..16].to_owned());
        assert_eq!(rec["api_key_id"], opt(fingerprint.as_deref()), "{}", c.id);
        let seen = fx.request(c.id);
        let leaked: Vec<&str> = seen
            .headers
            .keys()
            .map(|k| k.as_str())
            .filter(|k| k.starts_with("x-tokenscope-"))
            .collect();
        assert!(
            leaked.is_empty(),
            "{}: forwarded upstream: {leaked:?}",
            c.id
        );
        // The engine still gets the caller's credentials.
        assert_eq!(
            seen.header("authorization"),
            c.headers
                .iter()
                .find(|(k, _)| *k == "authorization")
                .map(|(_, v)| *v),
            "{}",
            c.id
        );
    }

    let m = gw.metrics().await;
    for key in [KEY, OTHER_KEY] {
        assert!(!m.contains(key), "raw API key in /metrics");
        assert!(
            gw.records()
                .await
                .iter()
                .all(|r| !r.to_string().contains(key)),
            "raw API key in a record"
        );
    }
    let (store, dir) = gw.stop();
    let rows = store_table(&store);
    assert_eq!(rows.len(), cases.len());
    let keyed = rows
        .iter()
        .find(|r| r["client_request_id"] == "attr-key")
        .expect("row attr-key");
    assert_eq!(
        (&keyed["tenant"], &keyed["business_line"]),
        (&json!("t1"), &json!("bl1"))
    );
    // Every file of the store (database, WAL, shared memory), as bytes.
    let prefix = store
        .file_name()
        .and_then(|n| n.to_str())
        .expect("store name")
        .to_owned();
    let mut scanned = 0usize;
    let mut rows_seen = false;
    for entry in std::fs::read_dir(dir.path()).expect("store dir") {
        let path = entry.expect("dir entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if !name.starts_with(&prefix) {
            continue;
        }
        let bytes = std::fs::read(&path).expect("read store file");
        for key in [KEY, OTHER_KEY] {
            assert!(
                !bytes.windows(key.len()).any(|w| w == key.as_bytes()),
                "raw API key found in {}",
                path.display()
            );
        }
        rows_seen |= bytes.windows(8).any(|w| w == b"attr-key");
        scanned += 1;
    }
    assert!(
        scanned >= 1 && rows_seen,
        "the scanned files hold the rows (the scan is not vacuous)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_hashed_and_stored_only_when_enabled() {
    let fx = json_fixture().await;
    let a = chat("fx", "Hello   world,\n  how are\tyou?", false);
    let b = chat("fx", " Hello world, how are you? ", false);
    let c = chat("fx", "Hello world, how are they?", false);
    let norm = normalised_prompt(Endpoint::ChatCompletions, &a).expect("prompt");
    let hash = prompt_hash("fx", &norm);

    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    for (id, body) in [("p-a", &a), ("p-b", &b), ("p-c", &c)] {
        post_json(&url, body, &[("x-request-id", id)]).await;
    }
    let (ra, rb, rc) = (
        gw.record("p-a").await,
        gw.record("p-b").await,
        gw.record("p-c").await,
    );
    assert_eq!(ra["prompt_hash"], hash.as_str());
    assert_eq!(
        rb["prompt_hash"],
        hash.as_str(),
        "whitespace does not change the hash"
    );
    assert_ne!(
        rc["prompt_hash"],
        hash.as_str(),
        "different text, different hash"
    );
    for r in [&ra, &rb, &rc] {
        assert_eq!(
            r["prompt_text"],
            Value::Null,
            "no prompt text by default: {r}"
        );
    }
    let (store, _dir) = gw.stop();
    let rows = store_table(&store);
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r["prompt_text"].is_null()), "{rows:?}");
    assert!(rows.iter().all(|r| r["prompt_hash"].is_string()));

    let gw = GatewayProc::start(&fx.url(), &[("TOKENSCOPE_STORE_PROMPTS", "true")]);
    post_json(
        &gw.url("/v1/chat/completions"),
        &a,
        &[("x-request-id", "p-stored")],
    )
    .await;
    let rec = gw.record("p-stored").await;
    assert_eq!(rec["prompt_text"], norm.as_str());
    assert_eq!(rec["prompt_hash"], hash.as_str());
    let (store, _dir) = gw.stop();
    let rows = store_table(&store);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["prompt_text"], norm.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_pass_through_unmeasured() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let (status, _, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &json!({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    for path in ["/v1/models", "/health"] {
        let direct = get(&format!("{}{path}", mock.url())).await;
        let through = get(&gw.url(path)).await;
        assert_eq!(direct.0, 200, "{path}");
        assert_eq!(through, direct, "{path} through the gateway");
    }
    let (status, _, body) = post_bytes(
        &gw.url("/v1/nope"),
        "{}",
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    let m = gw.metrics().await;
    assert_eq!(
        metric_sum(&m, "llm_requests_total"),
        1.0,
        "only the chat request is measured"
    );
    assert_eq!(gw.records().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_labels_stay_bounded() {
    let fx = json_fixture().await;
    let gw = GatewayProc::start(&fx.url(), &[("TOKENSCOPE_METRICS__MAX_MODELS", "3")]);
    let url = gw.url("/v1/chat/completions");
    let mut ids = Vec::new();
    for i in 0..60 {
        let user = format!("distinct-user-{i}");
        let mut headers = vec![("x-tokenscope-user", user.as_str())];
        let explicit = format!("cardinality-req-{i}");
        if i % 2 == 0 {
            headers.push(("x-request-id", explicit.as_str()));
        }
        let (status, h, _) = post_json(
            &url,
            &chat(&format!("model-{}", i % 6), "hi", false),
            &headers,
        )
        .await;
        assert_eq!(status, 200);
        ids.push(hdr(&h, "x-request-id").to_owned());
    }
    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "llm_requests_total"), 60.0);
    let buckets = label_values(&m, "llm_tokens_total", "user_bucket");
    assert!(
        (2..=16).contains(&buckets.len()),
        "user_bucket values: {buckets:?}"
    );
    for b in &buckets {
        let n: Option<u32> = b.strip_prefix('u').and_then(|d| d.parse().ok());
        assert!(n.is_some_and(|n| n < 16), "unexpected user_bucket {b:?}");
    }
    assert!(
        !m.contains("distinct-user-"),
        "a user name is a label value"
    );
    let models = label_values(&m, "llm_", "model");
    let want: BTreeSet<String> = ["model-0", "model-1", "model-2", "other"]
        .map(str::to_owned)
        .into();
    assert_eq!(models, want);
    assert_eq!(
        metric_where(&m, "llm_requests_total", &[("model", "model-0")]),
        10.0
    );
    assert_eq!(
        metric_where(&m, "llm_requests_total", &[("model", "other")]),
        30.0
    );
    for id in &ids {
        assert!(!m.contains(id.as_str()), "request id {id} in /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let body = json!({"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    post_json(&url, &body, &[("x-tokenscope-user", "u1")]).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    stream(&url, &streamed, &[], None).await;
    post_json(&url, &body, &[("x-mock-fault", "error_500")]).await;
    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "llm_requests_total"), 3.0);
    let Some((ok, out)) = promtool_check(&m) else {
        return;
    };
    assert!(
        ok,
        "promtool check metrics rejected /metrics:\n{out}\n--- exposition ---\n{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_cli_matches_requests() {
    let fx = json_fixture().await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let plan = [
        ("alpha", "ann"),
        ("alpha", "ann"),
        ("alpha", "ann"),
        ("alpha", "bob"),
        ("alpha", "bob"),
        ("beta", "ann"),
        ("beta", "cid"),
        ("beta", "cid"),
        ("gamma", "bob"),
        ("gamma", "bob"),
    ];
    for (model, user) in plan {
        let (status, _, _) = post_json(
            &url,
            &chat(model, "hi", false),
            &[("x-tokenscope-user", user)],
        )
        .await;
        assert_eq!(status, 200);
    }
    let (store, _dir) = gw.stop();
    let store = store.to_str().expect("utf-8 path").to_owned();
    let report = |args: &[&str]| -> String {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
            .args(["report", "--store", &store, "--since", "1h"])
            .args(args)
            .output()
            .expect("run tokenscope report");
        assert!(
            out.status.success(),
            "report {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8 report")
    };

    let rows: Vec<Value> =
        serde_json::from_str(&report(&["--by", "model", "--format", "json"])).expect("JSON report");
    let counts: BTreeMap<String, u64> = rows
        .iter()
        .map(|r| {
            (
                r["model"].as_str().expect("model").to_owned(),
                r["count"].as_u64().expect("count"),
            )
        })
        .collect();
    let want: BTreeMap<String, u64> = [("alpha", 5), ("beta", 3), ("gamma", 2)]
        .map(|(m, n)| (m.to_owned(), n))
        .into();
    assert_eq!(counts, want);
    for r in &rows {
        let n = r["count"].as_u64().expect("count");
        assert_eq!(r["ok"], n, "{r}");
        assert_eq!(r["input_tokens"], 9 * n, "{r}");
        assert_eq!(r["output_tokens"], 3 * n, "{r}");
    }

    let csv = report(&["--by", "model", "--format", "csv"]);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("CSV header").split(',').collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no {name} column in {header:?}"))
    };
    let (model_col, count_col) = (col("model"), col("count"));
    let data: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(data.len(), 3, "one line per model:\n{csv}");
    let csv_counts: BTreeMap<String, u64> = data
        .iter()
        .map(|cells| {
            assert_eq!(cells.len(), header.len(), "{cells:?}");
            (
                cells[model_col].to_owned(),
                cells[count_col].parse().expect("count cell"),
            )
        })
        .collect();
    assert_eq!(csv_counts, want);

    let rows: Vec<Value> = serde_json::from_str(&report(&[
        "--by",
        "user",
        "--filter",
        "model=alpha",
        "--format",
        "json",
    ]))
    .expect("JSON report");
    let by_user: BTreeMap<String, u64> = rows
        .iter()
        .map(|r| {
            (
                r["user"].as_str().expect("user").to_owned(),
                r["count"].as_u64().expect("count"),
            )
        })
        .collect();
    assert_eq!(
        by_user,
        [("ann".to_owned(), 3), ("bob".to_owned(), 2)].into()
    );
}

/// Several upstreams in a `--config` file, routed by model name (exact, prefix pattern, and the
/// default for anything else); each record names the upstream that served it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_model_across_upstreams() {
    let a = MockProc::start(&[]);
    let b = MockProc::start(&[]);
    let cfg_dir = tempfile::tempdir().expect("tempdir");
    let cfg = cfg_dir.path().join("routes.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"engine-a\"\nurl = \"{}\"\nmodels = [\"small-model\", \"llama*\"]\n\
             [[upstreams]]\nname = \"engine-b\"\nurl = \"{}\"\ndefault = true\n",
            a.url(),
            b.url()
        ),
    )
    .expect("write config");
    let cfg_path = cfg.to_str().expect("utf-8 path");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg_path], &[]);
    let url = gw.url("/v1/chat/completions");
    for (model, want) in [
        ("small-model", "engine-a"),
        ("llama-3-8b", "engine-a"),
        ("big-model", "engine-b"),
    ] {
        let body = serde_json::json!({
            "model": model, "max_tokens": 3,
            "messages": [{"role": "user", "content": "route me"}]
        });
        let (status, headers, _) = post_json(&url, &body, &[]).await;
        assert_eq!(status, 200);
        let id = headers["x-request-id"].to_str().expect("id").to_owned();
        let rec = gw.record(&id).await;
        assert_eq!(rec["upstream"], want, "model {model}");
        assert_eq!(rec["model"], model);
    }
    // Both engines really served traffic.
    let served = |text: String| metric_sum(&text, "vllm:generation_tokens_total");
    assert!(served(a.metrics().await) > 0.0);
    assert!(served(b.metrics().await) > 0.0);
}

/// `/v1/embeddings` is measured: input tokens from the engine's usage, zero output tokens,
/// request type `embeddings`, no TTFT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_measured() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let body = serde_json::json!({"model": "embed-model", "input": ["alpha beta", "gamma"]});
    let (status, headers, resp) = post_json(&gw.url("/v1/embeddings"), &body, &[]).await;
    assert_eq!(status, 200);
    let resp: serde_json::Value = serde_json::from_slice(&resp).expect("json");
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["endpoint"], "embeddings");
    assert_eq!(rec["request_type"], "embeddings");
    assert_eq!(rec["input_tokens"], resp["usage"]["prompt_tokens"]);
    assert_eq!(rec["input_tokens_source"], "usage");
    assert_eq!(rec["output_tokens"], 0);
    assert!(rec["ttft_ms"].is_null());
    assert_eq!(rec["outcome"], "ok");
}

/// `/v1/responses` and `/v1/messages` in front of the mock engine: streamed, tokens are the
/// usage and every token is one chunk; an Anthropic client's `x-api-key` finds its
/// `[[api_keys]]` entry; faults mid-stream keep the chunks seen and the outcome the fault
/// deserves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_messages_are_measured() {
    const KEY: &str = "sk-ant-test-1";
    let mock = MockProc::start(&[]);
    let cfg_dir = tempfile::tempdir().expect("tempdir");
    let cfg = cfg_dir.path().join("keys.toml");
    std::fs::write(
        &cfg,
        format!("[[api_keys]]\nkey = \"{KEY}\"\ntenant = \"t-ant\"\n"),
    )
    .expect("write config");
    let gw = GatewayProc::start(
        &mock.url(),
        &[("TOKENSCOPE_CONFIG", cfg.to_str().expect("utf-8 path"))],
    );
    let responses = json!({"model": "m", "input": "hello there", "stream": true,
                           "mock_output_tokens": 4, "max_output_tokens": 9});
    let messages = json!({"model": "m", "max_tokens": 9, "stream": true, "mock_output_tokens": 5,
                          "metadata": {"user_id": "ant-user"},
                          "messages": [{"role": "user", "content": "hello there"}]});
    for (path, body, n, endpoint) in [
        ("/v1/responses", &responses, 4, "responses"),
        ("/v1/messages", &messages, 5, "messages"),
    ] {
        let s = stream(&gw.url(path), body, &[("x-api-key", KEY)], None).await;
        assert_eq!(s.status, 200, "{path}");
        assert!(
            s.events.iter().all(|e| e.json.is_some()),
            "{path}: JSON events only"
        );
        assert_eq!(s.output_events().len(), n, "{path}");
        let rec = gw.record(&s.request_id()).await;
        assert_eq!(rec["endpoint"], endpoint);
        assert_eq!(rec["request_type"], "chat");
        assert_eq!(rec["outcome"], "ok", "{rec}");
        assert_eq!(
            (u(&rec["output_tokens"]), u(&rec["chunks"])),
            (n as u64, n as u64)
        );
        assert_eq!(rec["output_tokens_source"], "usage");
        assert_eq!(rec["input_tokens_source"], "usage");
        assert_eq!(rec["max_tokens"], 9);
        assert_eq!(
            rec["tenant"], "t-ant",
            "x-api-key looked up in [[api_keys]]"
        );
        assert!(
            rec["tpot_ms"].is_number() && rec["ttft_ms"].is_number(),
            "{rec}"
        );
    }
    let rec = gw
        .record(
            &stream(&gw.url("/v1/messages"), &messages, &[], None)
                .await
                .request_id(),
        )
        .await;
    assert_eq!(rec["user_id"], "ant-user");

    // Faults mid-stream: 3 tokens, then the connection drops / a malformed event.
    for (path, body, fault, outcome, error) in [
        (
            "/v1/messages",
            &messages,
            "drop_mid_stream",
            "upstream_error",
            "upstream_disconnected",
        ),
        (
            "/v1/responses",
            &responses,
            "malformed_sse",
            "upstream_error",
            "malformed_response",
        ),
    ] {
        let s = stream(&gw.url(path), body, &[("x-mock-fault", fault)], None).await;
        let rec = gw.record(&s.request_id()).await;
        assert_eq!(
            (rec["outcome"].as_str(), rec["error_type"].as_str()),
            (Some(outcome), Some(error)),
            "{path} {fault}: {rec}"
        );
        assert_eq!(u(&rec["chunks"]), 3, "{path} {fault}: {rec}");
        assert_eq!(
            rec["output_tokens_source"], "chunks",
            "{path} {fault}: {rec}"
        );
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// (name, nice value) of every thread of process `pid`: `/proc/PID/task/TID/stat`, where the
/// nice value is field 19 (the name, field 2, is in parentheses and may contain spaces).
fn thread_nice_values(pid: u32) -> Vec<(String, i32)> {
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).expect("task dir") {
        let stat = std::fs::read_to_string(t.expect("entry").path().join("stat")).expect("stat");
        let open = stat.find('(').expect("(");
        let close = stat.rfind(')').expect(")");
        let nice: i32 = stat[close + 2..]
            .split_whitespace()
            .nth(16)
            .expect("nice field")
            .parse()
            .expect("nice");
        threads.push((stat[open + 1..close].to_string(), nice));
    }
    threads
}

/// `--worker-priority N` (nginx's `worker_priority`): every runtime thread (they run the
/// listeners, all requests and the background tasks) gets nice value N; the store's batcher
/// and writer threads and the main thread keep the inherited priority. A
/// positive value needs no privilege, so the test runs anywhere. Out of range = start-up error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_priority_sets_the_runtime_threads_nice_value() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--worker-threads", "2", "--worker-priority", "7"],
        &[],
    );
    // It serves as usual.
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "stream": true});
    let s = stream(&gw.url("/v1/chat/completions"), &body, &[], None).await;
    assert_eq!(s.status, 200);
    assert_eq!(gw.record(&s.request_id()).await["output_tokens"], 3);

    let threads = thread_nice_values(gw.child.id());
    let workers: Vec<_> = threads
        .iter()
        .filter(|(c, _)| c == "tokio-rt-worker")
        .collect();
    assert!(workers.len() >= 2, "runtime threads: {threads:?}");
    for (comm, nice) in &threads {
        // The background runtime (admin listener, scrapers, exporters) runs 10 below the
        // workers, at most 19.
        let want = match comm.as_str() {
            "tokio-rt-worker" => 7,
            "tokenscope-bg" => 17,
            _ => 0,
        };
        assert_eq!(*nice, want, "thread {comm}: {threads:?}");
    }
    assert!(
        threads
            .iter()
            .any(|(c, n)| c.starts_with("tokenscope-") && *n == 0),
        "the store's threads keep the inherited priority: {threads:?}"
    );

    // Out of range: refused at start, with the reason.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args([
            "serve",
            "--upstream",
            &mock.url(),
            "--worker-priority",
            "25",
        ])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("-20 ..= 19"), "{err}");
}

/// A negative `--worker-priority` without the right to use it (no `CAP_SYS_NICE`, no
/// `RLIMIT_NICE`): one warning, the threads keep the inherited priority, requests are served.
/// As root the capability is dropped from the bounding set with util-linux's `setpriv`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_priority_without_the_capability_warns_once_and_serves() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let is_root = std::fs::read_to_string("/proc/self/status")
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1).map(|euid| euid == "0"))
        .expect("Uid line");
    let bin = env!("CARGO_BIN_EXE_tokenscope");
    let mut cmd = if is_root {
        let mut c = std::process::Command::new("setpriv");
        c.args(["--bounding-set", "-sys_nice", "--", bin]);
        c
    } else {
        std::process::Command::new(bin)
    };
    let err_path = dir.path().join("stderr.log");
    let mut child = cmd
        .args(["serve", "--upstream", &mock.url(), "--worker-threads", "2"])
        .args(["--worker-priority", "-5"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .arg("--store")
        .arg(dir.path().join("ts.db"))
        .env("TOKENSCOPE_SPOOL__DIR", dir.path().join("spool"))
        .env("TOKENSCOPE_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("spawn (setpriv is util-linux's)");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
        &mut line,
    )
    .expect("ready line");
    let proxy = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("proxy="))
        .unwrap_or_else(|| panic!("no proxy= in {line:?}"))
        .to_string();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2, "stream": true});
    let s = stream(
        &format!("http://{proxy}/v1/chat/completions"),
        &body,
        &[],
        None,
    )
    .await;
    assert_eq!(s.status, 200);
    assert_eq!(s.output_events().len(), 2);
    let threads = thread_nice_values(child.id());
    // Every thread keeps the inherited priority but the background runtime's (always +10).
    assert!(
        threads
            .iter()
            .all(|(c, n)| *n == if c == "tokenscope-bg" { 10 } else { 0 }),
        "{threads:?}"
    );
    let _ = child.kill();
    let _ = child.wait();
    let err = std::fs::read_to_string(&err_path).expect("stderr");
    let warnings = err
        .lines()
        .filter(|l| l.contains("could not set the runtime threads' priority"))
        .count();
    assert_eq!(warnings, 1, "{err}");
}
