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
