use super::*;
use crate::test_support::*;

const PROTOBUF: Option<&str> = Some("application/x-protobuf");
const JSON: Option<&str> = Some("application/json");

fn expected_vllm(service: Option<&str>) -> EngineSpan {
    EngineSpan {
        trace_id: TRACE_ID_HEX.to_owned(),
        span_id: SPAN_ID_HEX.to_owned(),
        name: "llm_request".to_owned(),
        request_id: Some("cmpl-abc-0".to_owned()),
        update: PhaseUpdate {
            trace_id: TRACE_ID_HEX.to_owned(),
            queue_duration_ms: Some(125.0),
            prefill_duration_ms: Some(187.5),
            decode_duration_ms: Some(1062.5),
            input_tokens: Some(42),
            output_tokens: Some(17),
            per_step: false,
        },
        ttft_ms: Some(312.5),
        e2e_ms: Some(1500.0),
        service_name: service.map(str::to_owned),
    }
}

#[test]
fn protobuf_vllm_span_maps_every_field() {
    let body = request("vllm", vec![vllm_span()]).encode_to_vec();
    let spans = decode_request(PROTOBUF, &body).expect("valid protobuf");
    assert_eq!(spans, vec![expected_vllm(Some("vllm"))]);
}

/// The real thing: the OTLP/HTTP protobuf body a vLLM 0.32.0 server posted
/// (`scripts/capture-vllm-fixtures.py`), holding the `llm_request` spans of the captured chat
/// request (trace `4bf92f…`, its response `chat.json`) and of other requests. Every span
/// decodes; the chat one carries exactly the numbers vLLM put in that response's `metrics`.
#[test]
fn real_vllm_0_32_protobuf_export_decodes() {
    let body = include_bytes!(
        "../../../tokenscope-cli/tests/fixtures/vllm/span-4bf92f3577b34da6a3ce929d0e0e4736.pb"
    );
    let decoded = decode_request_with_stats(PROTOBUF, body).expect("vLLM's own protobuf");
    assert!(decoded.stats.spans_total >= 1);
    assert_eq!(decoded.stats.engine_spans, decoded.stats.spans_total);
    assert_eq!(decoded.stats.rejected_spans, 0);
    let chat = decoded
        .spans
        .iter()
        .find(|s| s.trace_id == TRACE_ID_HEX)
        .expect("the chat request's span");
    assert_eq!(chat.name, "llm_request");
    assert_eq!(
        chat.request_id.as_deref(),
        Some("chatcmpl-8f1e9477a38e47dc")
    );
    assert_eq!(chat.service_name.as_deref(), Some("unknown_service:python"));
    let response: serde_json::Value = serde_json::from_slice(include_bytes!(
        "../../../tokenscope-cli/tests/fixtures/vllm/chat.json"
    ))
    .expect("chat.json");
    assert_eq!(
        response["id"], "chatcmpl-8f1e9477a38e47dc",
        "the same request"
    );
    let m = &response["metrics"];
    let near = |a: Option<f64>, b: &serde_json::Value| {
        let (a, b) = (a.expect("a value"), b.as_f64().expect("a number"));
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    };
    near(chat.update.queue_duration_ms, &m["queue_time_ms"]);
    near(chat.update.decode_duration_ms, &m["generation_time_ms"]);
    // vLLM's body TTFT runs from scheduling: the span's prefill.
    near(
        chat.update.prefill_duration_ms,
        &m["time_to_first_token_ms"],
    );
    assert_eq!(chat.update.input_tokens, Some(17));
    assert_eq!(chat.update.output_tokens, Some(8));
    // The span's TTFT runs from arrival: queue + prefill + the frontend time before queueing.
    let ttft = chat.ttft_ms.expect("ttft");
    let (q, p) = (
        chat.update.queue_duration_ms.expect("q"),
        chat.update.prefill_duration_ms.expect("p"),
    );
    assert!(ttft >= q + p, "{ttft} < {q} + {p}");
}

/// A hand-written OTLP/JSON body as the spec shapes it: hex ids, lowerCamelCase, enums as
/// integers, int64 as strings (and one as a plain number, which receivers must accept too).
const VLLM_JSON: &str = r#"{
  "resourceSpans": [{
    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
    "scopeSpans": [{
      "scope": {"name": "vllm.llm_engine"},
      "spans": [{
        "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
        "spanId": "00f067aa0ba902b7",
        "parentSpanId": "b7ad6b7169203331",
        "name": "llm_request",
        "kind": 2,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001500000000",
        "attributes": [
          {"key": "gen_ai.latency.time_to_first_token", "value": {"doubleValue": 0.3125}},
          {"key": "gen_ai.latency.e2e", "value": {"doubleValue": 1.5}},
          {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.125}},
          {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "42"}},
          {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": 17}},
          {"key": "gen_ai.latency.time_in_model_prefill", "value": {"doubleValue": 0.1875}},
          {"key": "gen_ai.latency.time_in_model_decode", "value": {"doubleValue": 1.0625}},
          {"key": "gen_ai.latency.time_in_model_inference", "value": {"doubleValue": 1.25}},
          {"key": "gen_ai.request.id", "value": {"stringValue": "cmpl-abc-0"}}
        ],
        "status": {"code": 0},
        "someFutureField": {"ignored": true}
      }, {
        "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
        "spanId": "1111111111111111",
        "name": "tokenize",
        "attributes": [{"key": "http.route", "value": {"stringValue": "/v1/completions"}}]
      }]
    }]
  }]
}"#;

#[test]
fn json_vllm_span_maps_every_field() {
    let decoded = decode_request_with_stats(JSON, VLLM_JSON.as_bytes()).expect("valid OTLP/JSON");
    assert_eq!(decoded.spans, vec![expected_vllm(Some("vllm"))]);
    assert_eq!(
        decoded.stats,
        DecodeStats {
            spans_total: 2,
            engine_spans: 1,
            rejected_spans: 0
        }
    );
    assert_eq!(decoded.stats.ignored_spans(), 1);
}

#[test]
fn json_with_base64_ids_is_refused() {
    // What protobuf's json_format writes for bytes; OTLP/JSON needs hex.
    let body = VLLM_JSON.replace(
        "\"4bf92f3577b34da6a3ce929d0e0e4736\"",
        "\"S/kvNXezTaajzpKdDg5HNg==\"",
    );
    let err = decode_request(JSON, body.as_bytes()).expect_err("base64 ids are not OTLP/JSON");
    assert!(matches!(err, OtlpError::Json(_)), "{err:?}");
    assert!(err.to_string().contains("hex"), "{err}");
}

#[test]
fn content_types() {
    let body = request("vllm", vec![vllm_span()]).encode_to_vec();
    for ct in [
        "application/x-protobuf",
        "Application/X-Protobuf",
        "application/protobuf",
        "application/x-protobuf; charset=binary",
    ] {
        let spans = decode_request(Some(ct), &body).expect(ct);
        assert_eq!(spans.len(), 1, "{ct}");
    }
    let spans = decode_request(
        Some("application/json; charset=utf-8"),
        VLLM_JSON.as_bytes(),
    )
    .expect("json with charset");
    assert_eq!(spans.len(), 1);

    let err = decode_request(None, &body).expect_err("no content type");
    assert!(matches!(err, OtlpError::MissingContentType));
    assert!(err.is_unsupported_media_type());
    let err = decode_request(Some("text/plain"), &body).expect_err("text/plain");
    assert!(matches!(&err, OtlpError::UnsupportedContentType(ct) if ct == "text/plain"));
    assert!(err.is_unsupported_media_type());
    assert_eq!(
        Encoding::from_content_type(Some("application/json")).expect("json"),
        Encoding::Json
    );
    assert_eq!(Encoding::Json.content_type(), "application/json");
    assert_eq!(Encoding::Protobuf.content_type(), "application/x-protobuf");
}

#[test]
fn garbage_is_refused() {
    // An unterminated varint: never a valid message.
    let err = decode_request(PROTOBUF, &[0xff, 0xff, 0xff, 0xff]).expect_err("garbage protobuf");
    assert!(matches!(err, OtlpError::Protobuf(_)), "{err:?}");
    assert!(!err.is_unsupported_media_type());
    let err = decode_request(JSON, b"{not json").expect_err("garbage json");
    assert!(matches!(err, OtlpError::Json(_)), "{err:?}");
    let err = decode_request(JSON, b"").expect_err("empty json");
    assert!(matches!(err, OtlpError::Json(_)), "{err:?}");
}

#[test]
fn empty_requests_decode_to_nothing() {
    // An empty protobuf body is a valid empty message.
    let decoded = decode_request_with_stats(PROTOBUF, b"").expect("empty protobuf");
    assert_eq!(decoded, Decoded::default());
    let decoded = decode_request_with_stats(JSON, b"{}").expect("empty json object");
    assert_eq!(decoded, Decoded::default());
}

#[test]
fn spans_without_gen_ai_attributes_are_ignored() {
    let other = span(
        "http_request",
        &TRACE_ID,
        &[1, 2, 3, 4, 5, 6, 7, 8],
        vec![
            string("http.method", "POST"),
            // `gen_ai.request.*` alone does not make an engine span.
            string("gen_ai.request.id", "cmpl-x"),
            int("gen_ai.request.max_tokens", 64),
        ],
    );
    let bare = span("bare", &TRACE_ID, &[9; 8], vec![]);
    let body = request("gateway", vec![other, vllm_span(), bare]).encode_to_vec();
    let decoded = decode_request_with_stats(PROTOBUF, &body).expect("valid");
    assert_eq!(decoded.spans, vec![expected_vllm(Some("gateway"))]);
    assert_eq!(
        decoded.stats,
        DecodeStats {
            spans_total: 3,
            engine_spans: 1,
            rejected_spans: 0
        }
    );
    assert_eq!(decoded.stats.ignored_spans(), 2);
}

#[test]
fn engine_spans_with_unjoinable_ids_are_rejected() {
    let zero_trace = span("llm_request", &[0; 16], &SPAN_ID, vllm_attributes());
    let short_trace = span("llm_request", &TRACE_ID[..8], &SPAN_ID, vllm_attributes());
    let zero_span = span("llm_request", &TRACE_ID, &[0; 8], vllm_attributes());
    let body = request(
        "vllm",
        vec![zero_trace, short_trace, zero_span, vllm_span()],
    )
    .encode_to_vec();
    let decoded = decode_request_with_stats(PROTOBUF, &body).expect("valid");
    assert_eq!(decoded.spans, vec![expected_vllm(Some("vllm"))]);
    assert_eq!(
        decoded.stats,
        DecodeStats {
            spans_total: 4,
            engine_spans: 1,
            rejected_spans: 3
        }
    );
    assert_eq!(decoded.stats.ignored_spans(), 0);
}

#[test]
fn partial_sglang_like_span_leaves_missing_fields_none() {
    // SGLang omits attributes whose timestamps it lacks; no resource at all here.
    let mut req = request(
        "sglang",
        vec![span(
            "Req 7",
            &TRACE_ID,
            &SPAN_ID,
            vec![
                double("gen_ai.latency.time_to_first_token", 0.5),
                double("gen_ai.latency.time_in_model_decode", 1.75),
            ],
        )],
    );
    req.resource_spans[0].resource = None;
    let spans = decode_request(PROTOBUF, &req.encode_to_vec()).expect("valid");
    let expected = EngineSpan {
        trace_id: TRACE_ID_HEX.to_owned(),
        span_id: SPAN_ID_HEX.to_owned(),
        name: "Req 7".to_owned(),
        request_id: None,
        update: PhaseUpdate {
            trace_id: TRACE_ID_HEX.to_owned(),
            decode_duration_ms: Some(1750.0),
            ..PhaseUpdate::default()
        },
        ttft_ms: Some(500.0),
        e2e_ms: None,
        service_name: None,
    };
    assert_eq!(spans, vec![expected]);
}

#[test]
fn value_types_are_read_strictly() {
    let attributes = vec![
        // Integer seconds are still seconds.
        int("gen_ai.latency.time_in_queue", 2),
        // Negative (vLLM computes 0 − scheduled_ts for an aborted request) → unknown.
        double("gen_ai.latency.time_in_model_prefill", -1_700_000_000.25),
        // A string is not a duration.
        string("gen_ai.latency.time_in_model_decode", "0.5"),
        double("gen_ai.latency.e2e", f64::NAN),
        double("gen_ai.latency.time_to_first_token", 0.0),
        // Integral doubles are counts; fractional ones and negatives are not.
        double("gen_ai.usage.prompt_tokens", 42.0),
        double("gen_ai.usage.completion_tokens", 1.5),
        int("gen_ai.usage.output_tokens", -3),
        int("gen_ai.request.id", 77),
    ];
    let body = request("x", vec![span("s", &TRACE_ID, &SPAN_ID, attributes)]).encode_to_vec();
    let spans = decode_request(PROTOBUF, &body).expect("valid");
    let [span] = spans.as_slice() else {
        panic!("one span expected, got {spans:?}");
    };
    assert_eq!(span.update.queue_duration_ms, Some(2000.0));
    assert_eq!(span.update.prefill_duration_ms, None);
    assert_eq!(span.update.decode_duration_ms, None);
    assert_eq!(span.e2e_ms, None);
    assert_eq!(span.ttft_ms, Some(0.0));
    assert_eq!(span.update.input_tokens, Some(42));
    assert_eq!(span.update.output_tokens, None);
    assert_eq!(span.request_id.as_deref(), Some("77"));
}

#[test]
fn semconv_token_names_are_a_fallback() {
    let attributes = vec![
        int("gen_ai.usage.input_tokens", 10),
        int("gen_ai.usage.output_tokens", 20),
        int("gen_ai.usage.completion_tokens", 21),
    ];
    let body = request("x", vec![span("s", &TRACE_ID, &SPAN_ID, attributes)]).encode_to_vec();
    let spans = decode_request(PROTOBUF, &body).expect("valid");
    assert_eq!(spans.len(), 1);
    assert_eq!(spans[0].update.input_tokens, Some(10));
    // vLLM's name wins over the semantic-convention one.
    assert_eq!(spans[0].update.output_tokens, Some(21));
    assert_eq!(spans[0].update.queue_duration_ms, None);
}

#[test]
fn several_resources_keep_their_service_names() {
    let mut req = request("vllm-a", vec![vllm_span()]);
    let mut other = request("vllm-b", vec![vllm_span()]);
    req.resource_spans.append(&mut other.resource_spans);
    let spans = decode_request(PROTOBUF, &req.encode_to_vec()).expect("valid");
    let names: Vec<_> = spans.iter().map(|s| s.service_name.as_deref()).collect();
    assert_eq!(names, vec![Some("vllm-a"), Some("vllm-b")]);
}

#[test]
fn hex_is_lower_case() {
    assert_eq!(lower_hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
    assert_eq!(lower_hex(&TRACE_ID), TRACE_ID_HEX);
    assert_eq!(lower_hex(&[]), "");
}
