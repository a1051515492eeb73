//! Builders for hand-made OTLP requests used by the unit tests.
//!
//! Invariant: every builder produces exactly what its arguments say; values that tests assert
//! on are binary fractions, so seconds × 1000 is exact.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

pub(crate) const TRACE_ID: [u8; 16] = [
    0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36,
];
pub(crate) const TRACE_ID_HEX: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
pub(crate) const SPAN_ID: [u8; 8] = [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7];
pub(crate) const SPAN_ID_HEX: &str = "00f067aa0ba902b7";

pub(crate) fn kv(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

pub(crate) fn double(key: &str, v: f64) -> KeyValue {
    kv(key, Value::DoubleValue(v))
}

pub(crate) fn int(key: &str, v: i64) -> KeyValue {
    kv(key, Value::IntValue(v))
}

pub(crate) fn string(key: &str, v: &str) -> KeyValue {
    kv(key, Value::StringValue(v.to_owned()))
}

/// The attributes vLLM's `do_tracing` sets, with exact binary-fraction values. Names and types
/// checked against a real vLLM 0.32.0 export
/// (`tokenscope-cli/tests/fixtures/vllm/span-4bf92f3577b34da6a3ce929d0e0e4736.pb`, decoded in
/// `decode::tests::real_vllm_0_32_protobuf_export_decodes`).
pub(crate) fn vllm_attributes() -> Vec<KeyValue> {
    vec![
        double("gen_ai.latency.time_to_first_token", 0.3125),
        double("gen_ai.latency.e2e", 1.5),
        double("gen_ai.latency.time_in_queue", 0.125),
        int("gen_ai.usage.prompt_tokens", 42),
        int("gen_ai.usage.completion_tokens", 17),
        double("gen_ai.latency.time_in_model_prefill", 0.1875),
        double("gen_ai.latency.time_in_model_decode", 1.0625),
        double("gen_ai.latency.time_in_model_inference", 1.25),
        string("gen_ai.request.id", "cmpl-abc-0"),
        double("gen_ai.request.top_p", 0.9),
        int("gen_ai.request.max_tokens", 64),
    ]
}

pub(crate) fn span(name: &str, trace_id: &[u8], span_id: &[u8], attributes: Vec<KeyValue>) -> Span {
    Span {
        trace_id: trace_id.to_vec(),
        span_id: span_id.to_vec(),
        name: name.to_owned(),
        kind: 2,
        start_time_unix_nano: 1_700_000_000_000_000_000,
        end_time_unix_nano: 1_700_000_001_500_000_000,
        attributes,
        ..Default::default()
    }
}

pub(crate) fn vllm_span() -> Span {
    span("llm_request", &TRACE_ID, &SPAN_ID, vllm_attributes())
}

pub(crate) fn request(service: &str, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![string("service.name", service)],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}
