//! Engine adapters through the real gateway binary, against upstreams that answer exactly as
//! vLLM and TGI do (shapes cited per test). The llama.cpp adapter is exercised against the
//! real engine in `real_engine.rs`.

mod common;

use common::*;
use serde_json::json;

/// vLLM `--enable-per-request-metrics`, non-streaming. Shape from vLLM
/// `docs/features/per_request_metrics.md` ("Response Format").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_per_request_metrics_fill_the_phases() {
    let body = r#"{"id":"chatcmpl-abc123","object":"chat.completion","created":1796224255,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"message":{"role":"assistant","content":"Paris."},"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":128,"total_tokens":170},"metrics":{"time_to_first_token_ms":85.2,"generation_time_ms":1240.5,"queue_time_ms":12.3,"mean_itl_ms":9.1,"tokens_per_second":103.2}}"#;
    let fx = Fixture::start(move |_| Reply::sized("application/json", body)).await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req =
        json!({"model": "llama", "messages": [{"role": "user", "content": "capital of France?"}]});
    let (status, headers, got) = post_json(&gw.url("/v1/chat/completions"), &req, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(got, body.as_bytes(), "passed through byte for byte");
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["engine"], "vllm");
    assert_eq!(rec["queue_duration_ms"], 12.3);
    assert_eq!(rec["queue_source"], "engine");
    assert_eq!(rec["prefill_duration_ms"], 85.2);
    assert_eq!(rec["prefill_source"], "engine");
    assert_eq!(rec["decode_duration_ms"], 1240.5);
    assert_eq!(rec["decode_source"], "engine");
    assert_eq!(rec["input_tokens"], 42);
    assert_eq!(rec["output_tokens"], 128);
}

/// vLLM streaming: `metrics` rides on the final usage chunk ("In streaming responses, metrics
/// are attached to the final usage chunk", same doc). The client did not ask for usage, so the
/// gateway asked for it and strips that chunk, yet the record has the engine's phases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_streamed_metrics_from_the_stripped_usage_chunk() {
    let chunk = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"
        )
    };
    let mut sse = String::new();
    sse.push_str(&chunk(r#"{"role":"assistant","content":""}"#, "null"));
    sse.push_str(&chunk(r#"{"content":"Hello"}"#, "null"));
    sse.push_str(&chunk(r#"{"content":" world"}"#, "null"));
    sse.push_str(&chunk(r#"{"content":""}"#, "\"stop\""));
    let usage = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":11,\"completion_tokens\":2},\"metrics\":{\"time_to_first_token_ms\":31.5,\"generation_time_ms\":18.25,\"queue_time_ms\":4.0,\"mean_itl_ms\":18.25,\"tokens_per_second\":40.1}}\n\n";
    let done = "data: [DONE]\n\n";
    let full = format!("{sse}{usage}{done}");
    let expected_client = format!("{sse}{done}");
    let fx = {
        let full = full.clone();
        Fixture::start(move |_| {
            Reply::chunked(
                "text/event-stream",
                full.split_inclusive("\n\n")
                    .map(|e| Step::Send(bytes::Bytes::from(e.to_owned())))
                    .collect(),
            )
        })
        .await
    };
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let s = stream(&gw.url("/v1/chat/completions"), &req, &[], None).await;
    assert_eq!(String::from_utf8_lossy(&s.raw), expected_client);
    let sent = fx.request(&s.request_id()).json();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["engine"], "vllm");
    assert_eq!(rec["queue_duration_ms"], 4.0);
    assert_eq!(rec["prefill_duration_ms"], 31.5);
    assert_eq!(rec["decode_duration_ms"], 18.25);
    assert_eq!(rec["output_tokens"], 2);
    assert_eq!(rec["output_tokens_source"], "usage");
}

/// `request_metrics = true` on a vLLM upstream adds `include_metrics` to the forwarded body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_request_metrics_flag_is_forwarded() {
    let fx = Fixture::start(|_| {
        Reply::sized(
            "application/json",
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        )
    })
    .await;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("vllm.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"vllm\"\nurl = \"{}\"\nkind = \"vllm\"\nrequest_metrics = true\n",
            fx.url()
        ),
    )
    .expect("write");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let req = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let (status, headers, _) = post_json(&gw.url("/v1/chat/completions"), &req, &[]).await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().expect("id").to_owned();
    assert_eq!(fx.request(&id).json()["include_metrics"], true);
    let rec = gw.record(&id).await;
    assert_eq!(rec["engine"], "vllm", "a configured kind is trusted");
    assert_eq!(rec["queue_source"], "none");
}

/// TGI: timing and token headers exactly as text-generation-inference's router writes them
/// (`router/src/server.rs`, `generate`: whole milliseconds, `x-prompt-tokens`,
/// `x-generated-tokens`). The body has no usage, so the token counts come from the headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_headers_fill_queue_and_tokens() {
    let fx = Fixture::start(|_| {
        let mut r = Reply::sized(
            "application/json",
            r#"{"object":"chat.completion","id":"","created":1,"model":"tgi","system_fingerprint":"3.0.0-native","choices":[{"index":0,"message":{"role":"assistant","content":"Hi there"},"logprobs":null,"finish_reason":"length"}]}"#,
        );
        r.headers = vec![
            ("x-compute-type", "gpu+optimized".into()),
            ("x-compute-time", "1".into()),
            ("x-compute-characters", "52".into()),
            ("x-total-time", "1203".into()),
            ("x-validation-time", "2".into()),
            ("x-queue-time", "35".into()),
            ("x-inference-time", "1166".into()),
            ("x-time-per-token", "58".into()),
            ("x-prompt-tokens", "11".into()),
            ("x-generated-tokens", "20".into()),
        ];
        r
    })
    .await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req = json!({"model": "tgi", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]});
    let (status, headers, _) = post_json(&gw.url("/v1/chat/completions"), &req, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(
        headers["x-queue-time"], "35",
        "engine headers reach the client"
    );
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["engine"], "tgi");
    assert_eq!(rec["queue_duration_ms"], 35.0);
    assert_eq!(rec["queue_source"], "engine");
    assert_eq!(rec["input_tokens"], 11);
    assert_eq!(rec["input_tokens_source"], "engine");
    assert_eq!(rec["output_tokens"], 20);
    assert_eq!(rec["output_tokens_source"], "engine");
    assert_eq!(rec["finish_reason"], "length");
}

/// vLLM / SGLang OTLP spans arriving at the admin listener after the request finished are
/// joined to its record by trace id, in memory and in the store. The span body is OTLP/JSON
/// (hex ids), with vLLM's attribute names and types (`vllm/tracing.py` `SpanAttributes`;
/// seconds as doubles, token counts as ints).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_engine_spans_are_joined_by_trace_id() {
    let fx = Fixture::start(|_| {
        Reply::sized(
            "application/json",
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#,
        )
    })
    .await;
    let gw = GatewayProc::start(&fx.url(), &[]);
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let req = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let tp = format!("00-{trace}-00f067aa0ba902b7-01");
    let (status, headers, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &req,
        &[
            ("traceparent", tp.as_str()),
            ("x-request-id", "otlp-join-1"),
        ],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(headers["x-tokenscope-trace-id"], trace);
    // The engine saw the gateway's span as parent: its own span carries the same trace id.
    let upstream_tp = fx
        .request("otlp-join-1")
        .header("traceparent")
        .map(str::to_owned);
    let parent = upstream_tp.expect("traceparent sent upstream")[36..52].to_owned();
    let rec = gw.record("otlp-join-1").await;
    assert_eq!(rec["queue_source"], "none");
    assert!(rec["input_tokens"].is_null() || rec["input_tokens_source"] == "estimate");

    let attr_d = |k: &str, v: f64| json!({"key": k, "value": {"doubleValue": v}});
    let attr_i = |k: &str, v: i64| json!({"key": k, "value": {"intValue": v.to_string()}});
    let otlp = json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
        "scopeSpans": [{"scope": {"name": "vllm.llm_engine"}, "spans": [{
            "traceId": trace, "spanId": "1111222233334444", "parentSpanId": parent,
            "name": "llm_request", "kind": 2,
            "startTimeUnixNano": "1796224255000000000", "endTimeUnixNano": "1796224256000000000",
            "attributes": [
                {"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-1"}},
                attr_d("gen_ai.latency.time_in_queue", 0.0125),
                attr_d("gen_ai.latency.time_to_first_token", 0.1),
                attr_d("gen_ai.latency.e2e", 0.75),
                attr_d("gen_ai.latency.time_in_model_prefill", 0.0805),
                attr_d("gen_ai.latency.time_in_model_decode", 0.6),
                attr_d("gen_ai.latency.time_in_model_inference", 0.6805),
                attr_i("gen_ai.usage.prompt_tokens", 17),
                attr_i("gen_ai.usage.completion_tokens", 33)
            ]
        }]}]
    }]});
    let (status, _, body) = post_bytes(
        &format!("http://{}/v1/traces", gw.admin),
        otlp.to_string(),
        &[("content-type", "application/json")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    let rec = gw.record("otlp-join-1").await;
    assert_eq!(rec["queue_duration_ms"], 12.5);
    assert_eq!(rec["queue_source"], "engine_span");
    assert_eq!(rec["prefill_duration_ms"], 80.5);
    assert_eq!(rec["decode_duration_ms"], 600.0);
    assert_eq!(rec["input_tokens"], 17);
    assert_eq!(rec["output_tokens"], 33);

    let (store, _dir) = gw.stop();
    let conn = rusqlite::Connection::open(store).expect("open store");
    let (q, qs, p, d, i, o): (f64, String, f64, f64, i64, i64) = conn
        .query_row(
            "SELECT queue_duration_ms, queue_source, prefill_duration_ms, decode_duration_ms, input_tokens, output_tokens FROM llm_inference_log WHERE client_request_id = 'otlp-join-1'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)),
        )
        .expect("row");
    assert_eq!(
        (q, qs.as_str(), p, d, i, o),
        (12.5, "engine_span", 80.5, 600.0, 17, 33)
    );
}
