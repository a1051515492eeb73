//! Engine adapters through the real gateway binary, against upstreams that answer exactly as
//! vLLM and TGI do. The vLLM tests replay real vLLM 0.32.0 responses captured by
//! `scripts/capture-vllm-fixtures.py` (`fixtures/vllm/`); the TGI one cites its source. The llama.cpp adapter is exercised against the
//! real engine in `real_engine.rs`.

mod common;

use common::*;
use serde_json::json;

/// A real vLLM 0.32.0 (CPU, Gemma 3 270M) response, captured by
/// `scripts/capture-vllm-fixtures.py`; the request and flags that produced it are in
/// `fixtures/vllm/requests.json`.
fn vllm_capture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/vllm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// vLLM `--enable-per-request-metrics`, non-streaming: the real `fixtures/vllm/chat.json`
/// replayed. The record's phases are its `metrics` (queue, scheduled→first token, generation),
/// its tokens its `usage`, and the client gets it byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_per_request_metrics_fill_the_phases() {
    let body = vllm_capture("chat.json");
    let real: serde_json::Value = serde_json::from_slice(&body).expect("chat.json");
    let m = &real["metrics"];
    let fx = {
        let body = body.clone();
        Fixture::start(move |_| Reply::sized("application/json", body.clone())).await
    };
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req = json!({"model": "gemma-3-270m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "The capital of France is a city that"}]});
    let (status, headers, got) = post_json(&gw.url("/v1/chat/completions"), &req, &[]).await;
    assert_eq!(status, 200);
    assert_eq!(got, body, "passed through byte for byte");
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["engine"], "vllm", "detected from the real body");
    assert_eq!(rec["queue_duration_ms"], m["queue_time_ms"]);
    assert_eq!(rec["queue_source"], "engine");
    assert_eq!(rec["prefill_duration_ms"], m["time_to_first_token_ms"]);
    assert_eq!(rec["prefill_source"], "engine");
    assert_eq!(rec["decode_duration_ms"], m["generation_time_ms"]);
    assert_eq!(rec["decode_source"], "engine");
    assert_eq!(rec["input_tokens"], real["usage"]["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], real["usage"]["completion_tokens"]);
    assert_eq!(rec["input_tokens"], 17);
    assert_eq!(rec["output_tokens"], 8);
    assert_eq!(rec["finish_reason"], "length");
}

/// vLLM streaming: `metrics` rides on the final usage chunk. The real
/// `fixtures/vllm/completion.sse` replayed event by event; this client did not ask for usage,
/// so the gateway asked for it, strips that chunk (the client gets the real stream minus it),
/// and the record has the chunk's phases and tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_streamed_metrics_from_the_stripped_usage_chunk() {
    let full = String::from_utf8(vllm_capture("completion.sse")).expect("utf8");
    let events: Vec<&str> = full.split_inclusive("\n\n").collect();
    let usage_event = events
        .iter()
        .find(|e| e.contains("\"usage\""))
        .expect("the capture has the usage chunk");
    let usage: serde_json::Value = serde_json::from_str(
        usage_event
            .trim()
            .strip_prefix("data: ")
            .expect("a data line"),
    )
    .expect("usage chunk json");
    let expected_client: String = events
        .iter()
        .filter(|e| !e.contains("\"usage\""))
        .copied()
        .collect();
    assert_eq!(expected_client.len() + usage_event.len(), full.len());
    let fx = {
        let events: Vec<String> = events.iter().map(|e| (*e).to_owned()).collect();
        Fixture::start(move |_| {
            Reply::chunked(
                "text/event-stream",
                events
                    .iter()
                    .map(|e| Step::Send(bytes::Bytes::from(e.clone())))
                    .collect(),
            )
        })
        .await
    };
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req = json!({"model": "gemma-3-270m", "stream": true, "max_tokens": 8,
        "prompt": "The capital of France is a city that"});
    let s = stream(&gw.url("/v1/completions"), &req, &[], None).await;
    assert_eq!(String::from_utf8_lossy(&s.raw), expected_client);
    let sent = fx.request(&s.request_id()).json();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    let rec = gw.record(&s.request_id()).await;
    let m = &usage["metrics"];
    assert_eq!(rec["engine"], "vllm");
    assert_eq!(rec["queue_duration_ms"], m["queue_time_ms"]);
    assert_eq!(rec["prefill_duration_ms"], m["time_to_first_token_ms"]);
    assert_eq!(rec["decode_duration_ms"], m["generation_time_ms"]);
    assert_eq!(rec["queue_source"], "engine");
    assert_eq!(rec["input_tokens"], usage["usage"]["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], usage["usage"]["completion_tokens"]);
    assert_eq!(rec["output_tokens"], 8);
    assert_eq!(rec["output_tokens_source"], "usage");
}

/// Both paths at once, from real captures: the chat response of `fixtures/vllm/chat.json`
/// (per-request `metrics`) and, afterwards, vLLM's own OTLP/HTTP protobuf export of that very
/// request (`fixtures/vllm/span-<trace>.pb`, the bytes vLLM posted) sent to the gateway's
/// receiver. The span joins by trace id and wins: the record's phases are the span's
/// `gen_ai.latency.*` values, read here from the protobuf, and its sources say `engine_span`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_real_otlp_protobuf_span_joins_and_wins() {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value;
    use prost::Message;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let pb = vllm_capture(&format!("span-{trace}.pb"));
    let export = ExportTraceServiceRequest::decode(pb.as_slice()).expect("vLLM's protobuf");
    // vLLM's batch exporter posted this request's span together with others' (other traces):
    // the gateway gets the whole body, as from vLLM.
    let hex = |id: &[u8]| -> String { id.iter().map(|b| format!("{b:02x}")).collect() };
    let ours: Vec<_> = export
        .resource_spans
        .iter()
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
        .filter(|s| hex(&s.trace_id) == trace)
        .collect();
    assert_eq!(ours.len(), 1, "one llm_request span per request");
    let span = ours[0];
    assert_eq!(span.name, "llm_request");
    let attr = |k: &str| -> f64 {
        span.attributes
            .iter()
            .find(|kv| kv.key == k)
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
            .map(|v| match v {
                any_value::Value::DoubleValue(d) => *d,
                any_value::Value::IntValue(i) => *i as f64,
                other => panic!("{k}: {other:?}"),
            })
            .unwrap_or_else(|| panic!("the span has {k}"))
    };

    let body = vllm_capture("chat.json");
    let real: serde_json::Value = serde_json::from_slice(&body).expect("chat.json");
    let fx = {
        let body = body.clone();
        Fixture::start(move |_| Reply::sized("application/json", body.clone())).await
    };
    let gw = GatewayProc::start(&fx.url(), &[]);
    let req = json!({"model": "gemma-3-270m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "The capital of France is a city that"}]});
    let tp = format!("00-{trace}-00f067aa0ba902b7-01");
    let (status, _, got) = post_json(
        &gw.url("/v1/chat/completions"),
        &req,
        &[("traceparent", tp.as_str()), ("x-request-id", "vllm-pb-1")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(got, body);
    let rec = gw.record("vllm-pb-1").await;
    assert_eq!(rec["queue_source"], "engine", "the body's metrics first");
    assert_eq!(
        rec["prefill_duration_ms"],
        real["metrics"]["time_to_first_token_ms"]
    );

    let (status, _, resp) = post_bytes(
        &format!("http://{}/v1/traces", gw.admin),
        pb.clone(),
        &[("content-type", "application/x-protobuf")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    let rec = gw.record("vllm-pb-1").await;
    let ms = |k: &str| 1000.0 * attr(k);
    let close = |a: &serde_json::Value, b: f64| {
        let a = a.as_f64().expect("a number");
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    };
    assert_eq!(rec["queue_source"], "engine_span");
    assert_eq!(rec["prefill_source"], "engine_span");
    assert_eq!(rec["decode_source"], "engine_span");
    close(
        &rec["queue_duration_ms"],
        ms("gen_ai.latency.time_in_queue"),
    );
    close(
        &rec["prefill_duration_ms"],
        ms("gen_ai.latency.time_in_model_prefill"),
    );
    close(
        &rec["decode_duration_ms"],
        ms("gen_ai.latency.time_in_model_decode"),
    );
    // vLLM states the same request both ways: the span's numbers are the body's.
    let m = &real["metrics"];
    close(&m["queue_time_ms"], ms("gen_ai.latency.time_in_queue"));
    close(
        &m["generation_time_ms"],
        ms("gen_ai.latency.time_in_model_decode"),
    );
    assert_eq!(
        attr("gen_ai.usage.prompt_tokens"),
        real["usage"]["prompt_tokens"].as_f64().expect("usage")
    );
    assert_eq!(rec["input_tokens"], 17);
    assert_eq!(rec["output_tokens"], 8);
}

/// `request_metrics = true` on a vLLM upstream adds `include_metrics` to the forwarded body.
/// (The real vLLM 0.32.0 ignores that field with a warning and fills `metrics` from its server
/// flag alone — see `fixtures/vllm/requests.json`, whose requests did not send it; the option
/// stays opt-in for builds that read it. The body here is a minimal completion.)
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
/// (hex ids; vLLM itself exports protobuf, see `vllm_real_otlp_protobuf_span_joins_and_wins`),
/// with vLLM's attribute names and types, checked against the real vLLM 0.32.0 export
/// `fixtures/vllm/span-4bf92f3577b34da6a3ce929d0e0e4736.pb`: span `llm_request`, scope
/// `vllm.llm_engine`, `gen_ai.latency.*` seconds as doubles, `gen_ai.usage.*` as ints.
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
