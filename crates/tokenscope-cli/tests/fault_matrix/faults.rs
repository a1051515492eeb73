//! Fault handling of the real `tokenscope` binary: every way a request can fail gives the client
//! a well-defined answer AND exactly one record that says what happened.
//!
//! One gateway serves the whole sequence (so the totals at the end cover every request): it
//! routes `dead-model` to a port nobody listens on and everything else to the mock engine, with
//! short timeouts (`upstream_timeout_ms = 300`, `stream_idle_timeout_ms = 300`) and a 2000-byte
//! body limit. Faults come from the mock's `x-mock-fault` header.

use crate::common::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::{Duration, Instant};

const TIMEOUT_MS: f64 = 300.0;

fn chat(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "stream": stream,
    })
}

/// What a request's record must say, checked again in the store after shutdown.
struct Expected {
    id: String,
    outcome: &'static str,
    error_type: Option<&'static str>,
    http_status: u16,
}

/// Fetches the record of `id`, checks it is the only one, and checks outcome / error type /
/// status against `exp`.
async fn check_record(gw: &GatewayProc, exp: &Expected) -> Value {
    let rec = gw.record(&exp.id).await;
    assert_eq!(
        gw.record_count(&exp.id).await,
        1,
        "exactly one record for {}",
        exp.id
    );
    assert_eq!(rec["outcome"], exp.outcome, "outcome of {}: {rec}", exp.id);
    assert_eq!(
        rec["error_type"],
        exp.error_type.map_or(Value::Null, |e| json!(e)),
        "error_type of {}: {rec}",
        exp.id
    );
    assert_eq!(
        rec["http_status"], exp.http_status,
        "http_status of {}: {rec}",
        exp.id
    );
    rec
}

fn header<'a>(h: &'a http::HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("response header {name} missing"))
}

fn error_code(body: &[u8]) -> Value {
    let v: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "JSON error body expected ({e}): {}",
            String::from_utf8_lossy(body)
        )
    });
    v["error"]["code"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_yields_exactly_one_classified_record() {
    let mock = MockProc::start(&[]);
    let cfg_dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = cfg_dir.path().join("gateway.toml");
    std::fs::write(
        &cfg_path,
        format!(
            r#"
[[upstreams]]
name = "dead"
url = "http://127.0.0.1:{dead}"
models = ["dead-model"]

[[upstreams]]
name = "mock"
url = "{mock}"
default = true
"#,
            dead = dead_port(),
            mock = mock.url()
        ),
    )
    .expect("write config");
    let cfg_arg = cfg_path.to_str().expect("utf-8 path");
    let gw = GatewayProc::start_with_args(
        None,
        &["--config", cfg_arg],
        &[
            ("TOKENSCOPE_UPSTREAM_TIMEOUT_MS", "300"),
            ("TOKENSCOPE_STREAM_IDLE_TIMEOUT_MS", "300"),
            ("TOKENSCOPE_MAX_BODY_BYTES", "2000"),
        ],
    );
    let url = gw.url("/v1/chat/completions");
    let mut expected: Vec<Expected> = Vec::new();

    // 1. Dead upstream → 502 with a JSON error; record upstream_error/upstream_unreachable.
    let (status, headers, body) = post_json(&url, &chat("dead-model", false), &[]).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "upstream_unreachable");
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "upstream_error",
        error_type: Some("upstream_unreachable"),
        http_status: 502,
    };
    let rec = check_record(&gw, &exp).await;
    assert_eq!(rec["upstream"], "dead");
    assert_eq!(rec["model"], "dead-model");
    expected.push(exp);

    // 2. The upstream never answers → 504 after the header timeout; record timeout.
    let t0 = Instant::now();
    let (status, headers, body) =
        post_json(&url, &chat("mock-llm", false), &[("x-mock-fault", "hang")]).await;
    let waited = t0.elapsed();
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
    assert_eq!(error_code(&body), "upstream_timeout");
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "answered after {waited:?} with a 300 ms timeout"
    );
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "timeout",
        error_type: Some("upstream_header_timeout"),
        http_status: 504,
    };
    let rec = check_record(&gw, &exp).await;
    let total = rec["total_duration_ms"]
        .as_f64()
        .expect("total_duration_ms");
    assert!(
        (TIMEOUT_MS..5000.0).contains(&total),
        "total_duration_ms {total}"
    );
    expected.push(exp);

    // 3. malformed_json: the client gets exactly the engine's bytes and status.
    let (status, headers, body) = post_json(
        &url,
        &chat("mock-llm", false),
        &[("x-mock-fault", "malformed_json")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "content-type"), "application/json");
    let text = String::from_utf8(body.to_vec()).expect("utf-8 body");
    let id = text
        .strip_prefix("{\"id\": \"")
        .and_then(|r| r.split('"').next())
        .unwrap_or_else(|| panic!("unexpected malformed body {text:?}"));
    assert!(id.starts_with("chatcmpl-mock-"), "{text}");
    assert_eq!(
        text,
        format!(
            "{{\"id\": \"{id}\", \"object\": \"chat.completion\", \"choices\": [{{\"index\": 0, \"message\": {{\"role\": \"assistant\", \"content\": \"tok0 tok1"
        ),
        "the engine's bytes, unchanged"
    );
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "upstream_error",
        error_type: Some("malformed_response"),
        http_status: 200,
    };
    check_record(&gw, &exp).await;
    expected.push(exp);

    // 4. malformed_sse: passed through as received; tokens counted from the chunks seen.
    let s = stream(
        &url,
        &chat("mock-llm", true),
        &[("x-mock-fault", "malformed_sse")],
        None,
    )
    .await;
    assert_eq!(s.status, 200);
    let datas: Vec<&str> = s.events.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(datas.len(), 5, "role, 3 tokens, garbage: {datas:?}");
    assert_eq!(datas[4], "{not json");
    assert_eq!(s.output_events().len(), 3);
    let rebuilt: String = datas.iter().map(|d| format!("data: {d}\n\n")).collect();
    assert_eq!(
        String::from_utf8_lossy(&s.raw),
        rebuilt,
        "every event as the engine framed it"
    );
    let exp = Expected {
        id: s.request_id(),
        outcome: "upstream_error",
        error_type: Some("malformed_response"),
        http_status: 200,
    };
    let rec = check_record(&gw, &exp).await;
    assert_eq!(rec["output_tokens"], 3, "{rec}");
    assert_eq!(rec["output_tokens_source"], "chunks");
    assert_eq!(rec["chunks"], 3);
    expected.push(exp);

    // 5. Engine errors are passed through and classified.
    let (status, headers, body) = post_json(
        &url,
        &chat("mock-llm", false),
        &[("x-mock-fault", "error_500")],
    )
    .await;
    assert_eq!(status, 500);
    let v: Value = serde_json::from_slice(&body).expect("engine error JSON");
    assert_eq!(v["error"]["message"], "mock fault: error_500");
    assert_eq!(v["error"]["code"], 500);
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "upstream_error",
        error_type: Some("http_500"),
        http_status: 500,
    };
    check_record(&gw, &exp).await;
    expected.push(exp);

    let (status, headers, body) = post_json(
        &url,
        &chat("mock-llm", false),
        &[("x-mock-fault", "error_429")],
    )
    .await;
    assert_eq!(status, 429);
    assert_eq!(header(&headers, "retry-after"), "1");
    let v: Value = serde_json::from_slice(&body).expect("engine error JSON");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "upstream_error",
        error_type: Some("rate_limited"),
        http_status: 429,
    };
    check_record(&gw, &exp).await;
    expected.push(exp);

    // A body that is not JSON is forwarded as-is; the engine's 400 is the client's fault.
    let (status, headers, body) = post_bytes(
        &url,
        "this is { not json",
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_slice(&body).expect("engine error JSON");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("request body is not valid JSON")),
        "the engine saw the raw body: {v}"
    );
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "client_error",
        error_type: Some("http_400"),
        http_status: 400,
    };
    let rec = check_record(&gw, &exp).await;
    assert_eq!(rec["model"], "");
    expected.push(exp);

    // 6. A stream that stalls → timeout after the idle limit, with the tokens seen so far.
    let t0 = Instant::now();
    let s = stream(
        &url,
        &chat("mock-llm", true),
        &[("x-mock-fault", "stall_mid_stream")],
        None,
    )
    .await;
    let waited = t0.elapsed();
    assert_eq!(s.status, 200);
    assert_eq!(s.output_events().len(), 3);
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "the stalled stream ended after {waited:?}"
    );
    let exp = Expected {
        id: s.request_id(),
        outcome: "timeout",
        error_type: Some("stream_idle_timeout"),
        http_status: 200,
    };
    let rec = check_record(&gw, &exp).await;
    assert_eq!(rec["output_tokens"], 3, "{rec}");
    assert_eq!(rec["output_tokens_source"], "chunks");
    let total = rec["total_duration_ms"]
        .as_f64()
        .expect("total_duration_ms");
    assert!(total >= TIMEOUT_MS, "total_duration_ms {total}");
    expected.push(exp);

    // 7. The engine drops the connection mid-stream.
    let s = stream(
        &url,
        &chat("mock-llm", true),
        &[("x-mock-fault", "drop_mid_stream")],
        None,
    )
    .await;
    assert_eq!(s.status, 200);
    assert_eq!(s.output_events().len(), 3);
    assert!(s.events.iter().all(|e| e.data != "[DONE]"));
    let exp = Expected {
        id: s.request_id(),
        outcome: "upstream_error",
        error_type: Some("upstream_disconnected"),
        http_status: 200,
    };
    let rec = check_record(&gw, &exp).await;
    assert_eq!(rec["output_tokens"], 3, "{rec}");
    assert_eq!(rec["output_tokens_source"], "chunks");
    expected.push(exp);

    // 8. Bodies over the limit → 413, with a content-length …
    let mut big = chat("mock-llm", false);
    big["messages"][0]["content"] = json!("x".repeat(3000));
    let (status, headers, body) = post_json(&url, &big, &[]).await;
    assert_eq!(status, 413);
    assert_eq!(error_code(&body), "body_too_large");
    let exp = Expected {
        id: header(&headers, "x-request-id").to_owned(),
        outcome: "client_error",
        error_type: Some("body_too_large"),
        http_status: 413,
    };
    check_record(&gw, &exp).await;
    expected.push(exp);

    // … and chunked, without one (sent until the limit is crossed, then the answer is read).
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nx-request-id: chunked-too-large\r\nconnection: close\r\n\r\n",
        gw.proxy
    )
    .into_bytes();
    for _ in 0..5 {
        req.extend_from_slice(format!("{:x}\r\n{}\r\n", 500, "y".repeat(500)).as_bytes());
    }
    let (status, head, body) = raw_http(gw.proxy, &req).await;
    assert_eq!(status, 413, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("x-request-id: chunked-too-large"),
        "{head}"
    );
    let n: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .expect("content-length of the 413");
    assert_eq!(error_code(&body[..n]), "body_too_large");
    let exp = Expected {
        id: "chunked-too-large".to_owned(),
        outcome: "client_error",
        error_type: Some("body_too_large"),
        http_status: 413,
    };
    check_record(&gw, &exp).await;
    expected.push(exp);

    // 9. The client leaves mid-stream → cancelled, and the engine's slot is freed.
    let mut long = chat("mock-llm", true);
    long["mock_output_tokens"] = json!(20_000);
    long["max_tokens"] = json!(20_000);
    let s = stream(&url, &long, &[], Some(3)).await;
    assert_eq!(s.status, 200);
    let exp = Expected {
        id: s.request_id(),
        outcome: "cancelled",
        error_type: Some("client_disconnected"),
        http_status: 200,
    };
    let rec = check_record(&gw, &exp).await;
    let out = rec["output_tokens"].as_u64().expect("output_tokens");
    assert!(
        (3..20_000).contains(&out),
        "tokens seen before the client left: {rec}"
    );
    assert_eq!(rec["output_tokens_source"], "chunks");
    expected.push(exp);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let running = metric_sum(&mock.metrics().await, "vllm:num_requests_running");
        if running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the mock still runs {running} requests"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // … and a client that leaves before the engine has answered at all is cancelled too, when
    // it leaves (not when the engine finally answers).
    let early_body = chat("mock-llm", false);
    let early = post_json(
        &url,
        &early_body,
        &[("x-mock-delay-ms", "1500"), ("x-request-id", "left-early")],
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(150), early)
            .await
            .is_err(),
        "the engine answered despite x-mock-delay-ms"
    );
    let exp = Expected {
        id: "left-early".to_owned(),
        outcome: "cancelled",
        error_type: Some("client_disconnected"),
        http_status: 499,
    };
    let rec = check_record(&gw, &exp).await;
    let total = rec["total_duration_ms"]
        .as_f64()
        .expect("total_duration_ms");
    assert!(total < 1000.0, "cancellation noticed only after {total} ms");
    expected.push(exp);

    // 10. Totals: one record per request, in the metrics, the admin API and the store.
    let sent = expected.len();
    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "llm_requests_total"), sent as f64, "{m}");
    for outcome in [
        "ok",
        "client_error",
        "upstream_error",
        "timeout",
        "cancelled",
    ] {
        let want = expected.iter().filter(|e| e.outcome == outcome).count();
        assert_eq!(
            metric_where(&m, "llm_requests_total", &[("status", outcome)]),
            want as f64,
            "llm_requests_total{{status={outcome}}}"
        );
    }
    assert_eq!(metric_sum(&m, "llm_requests_in_flight"), 0.0);
    assert_eq!(
        metric_sum(&m, "tokenscope_records_dropped_total"),
        0.0,
        "{m}"
    );
    let records = gw.records().await;
    assert_eq!(records.len(), sent, "records in memory");
    let ids: HashSet<&str> = records
        .iter()
        .map(|r| r["request_id"].as_str().expect("request_id"))
        .collect();
    assert_eq!(ids.len(), sent, "request ids are unique");
    gw.flush().await;
    let m = gw.metrics().await;
    assert_eq!(
        metric_sum(&m, "tokenscope_records_written_total"),
        sent as f64
    );
    assert_eq!(
        metric_sum(&m, "tokenscope_records_dropped_total"),
        0.0,
        "{m}"
    );

    let (store, _dir) = gw.stop();
    let rows = store_table(&store);
    assert_eq!(rows.len(), sent, "store rows");
    for exp in &expected {
        let mine: Vec<_> = rows
            .iter()
            .filter(|r| {
                r["request_id"] == exp.id.as_str() || r["client_request_id"] == exp.id.as_str()
            })
            .collect();
        assert_eq!(mine.len(), 1, "one row for {}", exp.id);
        let row = mine[0];
        assert_eq!(row["outcome"], exp.outcome, "{row:?}");
        assert_eq!(
            row["error_type"],
            exp.error_type.map_or(Value::Null, |e| json!(e)),
            "{row:?}"
        );
        assert_eq!(row["http_status"], exp.http_status, "{row:?}");
    }
}
