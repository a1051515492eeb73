//! Against a real engine: llama.cpp's `llama-server` with Gemma 3 270M, installed by
//! `scripts/install-llama.sh` (cached outside the clone). The gateway binary is started on port
//! 0 in front of it and every number it records is checked against what the engine and the
//! client saw.
//!
//! When the engine is not installed the test is skipped with a message, unless
//! `TOKENSCOPE_REQUIRE_ENGINE=1` (set by `.ci/run`), which turns absence into a failure.

mod common;
mod llama;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

fn chat(prompt: &str, max_tokens: u64, stream: bool) -> serde_json::Value {
    json!({
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": stream,
    })
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

async fn engine_processing(port: u16) -> f64 {
    let (_, text) = get(&format!("http://127.0.0.1:{port}/metrics")).await;
    metric_sum(&text, "llamacpp:requests_processing")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_end_to_end() {
    // 4 parallel slots (continuous batching).
    let Some(llama) = llama::start(&["-np", "4", "-c", "8192"]).await else {
        return;
    };
    let gw = GatewayProc::start(&format!("http://127.0.0.1:{}", llama.port), &[]);
    let mut sent = 0u64;
    let mut streamed_with_output = 0u64;
    let mut ids = Vec::new();

    // 1. Non-streaming chat: token counts equal the engine's usage.
    let (status, headers, body) = post_json(
        &gw.url("/v1/chat/completions"),
        &chat("Name three colours.", 12, false),
        &[
            ("x-tokenscope-user", "alice"),
            ("x-tokenscope-business-line", "search"),
        ],
    )
    .await;
    sent += 1;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let id = headers["x-request-id"].to_str().expect("id").to_owned();
    assert!(headers.contains_key("x-tokenscope-trace-id"));
    let rec = gw.record(&id).await;
    assert_eq!(rec["input_tokens"], resp["usage"]["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], resp["usage"]["completion_tokens"]);
    assert_eq!(rec["input_tokens_source"], "usage");
    assert_eq!(rec["outcome"], "ok");
    assert_eq!(rec["user_id"], "alice");
    assert_eq!(rec["business_line"], "search");
    // llama.cpp's own per-request timings fill prefill/decode.
    assert_eq!(rec["prefill_duration_ms"], resp["timings"]["prompt_ms"]);
    assert_eq!(rec["decode_duration_ms"], resp["timings"]["predicted_ms"]);
    assert!(
        rec["ttft_ms"].is_null(),
        "no TTFT for a non-streamed response"
    );
    ids.push(id);

    // 2. Streaming chat, client asked for usage: passed through untouched; exact TTFT/TPOT.
    let mut body = chat("Count from one to twenty in words.", 24, true);
    body["stream_options"] = json!({"include_usage": true});
    let s = stream(&gw.url("/v1/chat/completions"), &body, &[], None).await;
    sent += 1;
    streamed_with_output += 1;
    assert_eq!(s.status, 200);
    let usage = s
        .events
        .iter()
        .find_map(|e| e.usage().cloned())
        .expect("the client asked for usage and must get it");
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["input_tokens"], usage["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], usage["completion_tokens"]);
    let n_out = u(&usage["completion_tokens"]);
    assert!(n_out >= 2);
    let client_ttft = s.ttft_ms().expect("client ttft");
    let rec_ttft = f(&rec["ttft_ms"]);
    assert!(
        rec_ttft <= client_ttft,
        "recorded TTFT {rec_ttft} > client {client_ttft}"
    );
    assert!(
        client_ttft - rec_ttft <= 5.0,
        "recorded TTFT {rec_ttft} vs client {client_ttft}"
    );
    let client_tpot = s.tpot_ms(n_out).expect("client tpot");
    let rec_tpot = f(&rec["tpot_ms"]);
    assert!(
        (rec_tpot - client_tpot).abs() <= 0.5 + 0.02 * client_tpot,
        "recorded TPOT {rec_tpot} vs formula on client arrivals {client_tpot}"
    );
    // llama.cpp streams one token per chunk: the chunk count equals the usage.
    assert_eq!(s.output_events().len() as u64, n_out);
    ids.push(s.request_id());
    let with_usage_tokens = n_out;

    // 3. Streaming chat without usage: the gateway injects include_usage and strips the
    //    usage-only chunk, so the client sees no usage but the record is exact.
    let s = stream(
        &gw.url("/v1/chat/completions"),
        &chat("Count from one to twenty in words.", 24, true),
        &[],
        None,
    )
    .await;
    sent += 1;
    streamed_with_output += 1;
    assert_eq!(s.status, 200);
    assert!(
        s.events.iter().all(|e| e.usage().is_none()),
        "usage chunk leaked to the client"
    );
    assert!(s
        .events
        .iter()
        .all(|e| e.json.as_ref().is_none_or(|j| j["choices"] != json!([]))));
    assert_eq!(s.events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["output_tokens_source"], "usage");
    assert_eq!(u(&rec["output_tokens"]), s.output_events().len() as u64);
    assert_eq!(
        u(&rec["output_tokens"]),
        with_usage_tokens,
        "same greedy output as with usage"
    );
    let client_ttft = s.ttft_ms().expect("client ttft");
    let rec_ttft = f(&rec["ttft_ms"]);
    assert!(
        rec_ttft <= client_ttft && client_ttft - rec_ttft <= 5.0,
        "recorded TTFT {rec_ttft} vs client {client_ttft}"
    );
    ids.push(s.request_id());

    // 4. Completions, non-streaming and streaming.
    let (status, headers, body) = post_json(
        &gw.url("/v1/completions"),
        &json!({"model": "gemma-3-270m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
        &[],
    )
    .await;
    sent += 1;
    assert_eq!(status, 200);
    let resp: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let id = headers["x-request-id"].to_str().expect("id").to_owned();
    let rec = gw.record(&id).await;
    assert_eq!(rec["input_tokens"], resp["usage"]["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], resp["usage"]["completion_tokens"]);
    assert_eq!(rec["endpoint"], "completions");
    ids.push(id);

    let s = stream(
        &gw.url("/v1/completions"),
        &json!({"model": "gemma-3-270m", "prompt": "One, two, three,", "max_tokens": 10, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
        &[],
        None,
    )
    .await;
    sent += 1;
    streamed_with_output += 1;
    let usage = s
        .events
        .iter()
        .find_map(|e| e.usage().cloned())
        .expect("usage");
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["output_tokens"], usage["completion_tokens"]);
    assert_eq!(rec["input_tokens"], usage["prompt_tokens"]);
    let n_out = u(&usage["completion_tokens"]);
    let client_ttft = s.ttft_ms().expect("client ttft");
    let rec_ttft = f(&rec["ttft_ms"]);
    assert!(
        rec_ttft <= client_ttft && client_ttft - rec_ttft <= 5.0,
        "recorded TTFT {rec_ttft} vs client {client_ttft}"
    );
    if n_out >= 2 {
        let client_tpot = s.tpot_ms(n_out).expect("tpot");
        assert!((f(&rec["tpot_ms"]) - client_tpot).abs() <= 0.5 + 0.02 * client_tpot);
    }
    ids.push(s.request_id());

    // 5. Client disconnect mid-stream: `cancelled` record with the tokens seen so far, and the
    //    engine slot is freed.
    let s = stream(
        &gw.url("/v1/chat/completions"),
        &chat(
            "Write a very long story about a lighthouse keeper.",
            400,
            true,
        ),
        &[],
        Some(3),
    )
    .await;
    sent += 1;
    streamed_with_output += 1;
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["outcome"], "cancelled", "{rec}");
    assert!(u(&rec["output_tokens"]) >= 3, "{rec}");
    assert_eq!(rec["output_tokens_source"], "chunks");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if engine_processing(llama.port).await == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the engine slot was not freed after the client left"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ids.push(s.request_id());

    // 6. Metrics: histogram counts equal the requests.
    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "llm_requests_total"), sent as f64, "{m}");
    assert_eq!(
        metric_sum(&m, "llm_request_latency_seconds_count"),
        sent as f64
    );
    assert_eq!(
        metric_sum(&m, "llm_ttft_seconds_count"),
        streamed_with_output as f64
    );
    assert_eq!(metric_sum(&m, "llm_requests_in_flight"), 0.0);
    assert!(metric_sum(&m, "llm_tokens_total") > 0.0);

    // 7. Store: exactly one row per request, after a graceful stop.
    let (store, _dir) = gw.stop();
    let rows = store_rows(&store);
    assert_eq!(rows.len() as u64, sent);
    for id in &ids {
        assert_eq!(
            rows.iter()
                .filter(|r| r["request_id"] == json!(id) || r["client_request_id"] == json!(id))
                .count(),
            1,
            "row for {id}"
        );
    }
}
