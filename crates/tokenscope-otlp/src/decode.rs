//! Decoding an OTLP `ExportTraceServiceRequest` and reading engine spans out of it.
//!
//! Invariants:
//! - Pure: no I/O, no clock, no state; the same body always gives the same result.
//! - Protobuf bodies are decoded with prost; JSON bodies follow OTLP/JSON (trace and span ids
//!   as hex, not base64; lowerCamelCase keys; enums as integers; 64-bit integers as strings or
//!   numbers; unknown fields ignored).
//! - A span is an engine span iff it has at least one `gen_ai.latency.*` or `gen_ai.usage.*`
//!   attribute; of those, only spans with joinable ids (16-byte trace id, 8-byte span id, both
//!   non-zero) are returned, the others are counted as rejected.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokenscope_core::PhaseUpdate;

use crate::attrs;

/// The two OTLP/HTTP body encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Binary protobuf, `application/x-protobuf`.
    Protobuf,
    /// OTLP/JSON, `application/json`.
    Json,
}

impl Encoding {
    /// Reads a `Content-Type` value: `application/x-protobuf` (or `application/protobuf`) and
    /// `application/json`, case-insensitive, parameters such as `charset` ignored.
    pub fn from_content_type(content_type: Option<&str>) -> Result<Self, OtlpError> {
        let raw = content_type.ok_or(OtlpError::MissingContentType)?;
        let media = raw.split(';').next().unwrap_or_default().trim();
        if media.eq_ignore_ascii_case("application/x-protobuf")
            || media.eq_ignore_ascii_case("application/protobuf")
        {
            Ok(Encoding::Protobuf)
        } else if media.eq_ignore_ascii_case("application/json") {
            Ok(Encoding::Json)
        } else {
            Err(OtlpError::UnsupportedContentType(raw.to_owned()))
        }
    }

    /// The `Content-Type` of a response in this encoding.
    pub fn content_type(self) -> &'static str {
        match self {
            Encoding::Protobuf => "application/x-protobuf",
            Encoding::Json => "application/json",
        }
    }
}

/// Why a body could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    /// No `Content-Type` was given.
    #[error("missing Content-Type: OTLP/HTTP needs application/x-protobuf or application/json")]
    MissingContentType,
    /// A `Content-Type` other than protobuf or JSON.
    #[error(
        "unsupported Content-Type {0:?}: OTLP/HTTP needs application/x-protobuf or application/json"
    )]
    UnsupportedContentType(String),
    /// The body is not a protobuf `ExportTraceServiceRequest`.
    #[error("body is not a protobuf ExportTraceServiceRequest: {0}")]
    Protobuf(#[source] prost::DecodeError),
    /// The body is not an OTLP/JSON `ExportTraceServiceRequest`.
    #[error("body is not an OTLP/JSON ExportTraceServiceRequest (ids must be hex): {0}")]
    Json(#[source] serde_json::Error),
}

impl OtlpError {
    /// `true` when the content type, not the body, is at fault (HTTP 415 rather than 400).
    pub fn is_unsupported_media_type(&self) -> bool {
        matches!(
            self,
            OtlpError::MissingContentType | OtlpError::UnsupportedContentType(_)
        )
    }
}

/// One engine-side request span: its ids and the phase values it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpan {
    /// Trace id, 32 lower-case hex characters; equal to `update.trace_id`.
    pub trace_id: String,
    /// Span id, 16 lower-case hex characters.
    pub span_id: String,
    /// Span name (`llm_request` for vLLM).
    pub name: String,
    /// `gen_ai.request.id`: the engine's request id.
    pub request_id: Option<String>,
    /// Queue (`time_in_queue`), prefill (`time_in_model_prefill`) and decode
    /// (`time_in_model_decode`) in ms; tokens from `gen_ai.usage.*`.
    pub update: PhaseUpdate,
    /// `gen_ai.latency.time_to_first_token` in ms (the engine's TTFT, from its own arrival).
    pub ttft_ms: Option<f64>,
    /// `gen_ai.latency.e2e` in ms.
    pub e2e_ms: Option<f64>,
    /// The `service.name` resource attribute of the exporter.
    pub service_name: Option<String>,
}

/// Counts for one decoded request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Every span in the request.
    pub spans_total: u64,
    /// Spans returned as [`EngineSpan`]s.
    pub engine_spans: u64,
    /// Spans with `gen_ai.*` attributes whose ids cannot be joined (wrong length or all zeros).
    pub rejected_spans: u64,
}

impl DecodeStats {
    /// Spans without any `gen_ai.latency.*`/`gen_ai.usage.*` attribute.
    pub fn ignored_spans(&self) -> u64 {
        self.spans_total - self.engine_spans - self.rejected_spans
    }
}

/// The engine spans of one request and the counts behind them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decoded {
    /// Engine spans, in request order.
    pub spans: Vec<EngineSpan>,
    /// Counts.
    pub stats: DecodeStats,
}

/// Decodes an `ExportTraceServiceRequest` body and returns its engine spans (other spans are
/// dropped; see [`decode_request_with_stats`] for the counts).
pub fn decode_request(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Vec<EngineSpan>, OtlpError> {
    decode_request_with_stats(content_type, body).map(|decoded| decoded.spans)
}

/// [`decode_request`] with the span counts.
pub fn decode_request_with_stats(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Decoded, OtlpError> {
    let encoding = Encoding::from_content_type(content_type)?;
    let request = decode_body(encoding, body)?;
    Ok(engine_spans(&request))
}

/// Decodes a body of a known encoding.
pub(crate) fn decode_body(
    encoding: Encoding,
    body: &[u8],
) -> Result<ExportTraceServiceRequest, OtlpError> {
    match encoding {
        Encoding::Protobuf => ExportTraceServiceRequest::decode(body).map_err(OtlpError::Protobuf),
        Encoding::Json => serde_json::from_slice(body).map_err(OtlpError::Json),
    }
}

/// Reads the engine spans out of a decoded request.
pub fn engine_spans(request: &ExportTraceServiceRequest) -> Decoded {
    let mut decoded = Decoded::default();
    for resource_spans in &request.resource_spans {
        let service_name = resource_spans
            .resource
            .as_ref()
            .and_then(|resource| string_attr(&resource.attributes, attrs::SERVICE_NAME));
        for scope_spans in &resource_spans.scope_spans {
            for span in &scope_spans.spans {
                decoded.stats.spans_total += 1;
                match engine_span(span, service_name.as_deref()) {
                    Verdict::Engine(engine) => {
                        decoded.stats.engine_spans += 1;
                        decoded.spans.push(*engine);
                    }
                    Verdict::Rejected => decoded.stats.rejected_spans += 1,
                    Verdict::Ignored => {}
                }
            }
        }
    }
    decoded
}

enum Verdict {
    Engine(Box<EngineSpan>),
    Rejected,
    Ignored,
}

/// The `gen_ai.*` values of one span.
#[derive(Default)]
struct GenAi {
    any: bool,
    queue_ms: Option<f64>,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    prefill_ms: Option<f64>,
    decode_ms: Option<f64>,
    request_id: Option<String>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

impl GenAi {
    fn read(attributes: &[KeyValue]) -> Self {
        let mut g = GenAi::default();
        for kv in attributes {
            let key = kv.key.as_str();
            if key.starts_with(attrs::LATENCY_PREFIX) || key.starts_with(attrs::USAGE_PREFIX) {
                g.any = true;
            }
            let value = kv.value.as_ref();
            match key {
                attrs::TIME_IN_QUEUE => g.queue_ms = value.and_then(seconds_as_ms),
                attrs::TIME_TO_FIRST_TOKEN => g.ttft_ms = value.and_then(seconds_as_ms),
                attrs::E2E => g.e2e_ms = value.and_then(seconds_as_ms),
                attrs::TIME_IN_MODEL_PREFILL => g.prefill_ms = value.and_then(seconds_as_ms),
                attrs::TIME_IN_MODEL_DECODE => g.decode_ms = value.and_then(seconds_as_ms),
                attrs::REQUEST_ID => g.request_id = value.and_then(id_string),
                attrs::USAGE_PROMPT_TOKENS => g.prompt_tokens = value.and_then(count),
                attrs::USAGE_COMPLETION_TOKENS => g.completion_tokens = value.and_then(count),
                attrs::USAGE_INPUT_TOKENS => g.input_tokens = value.and_then(count),
                attrs::USAGE_OUTPUT_TOKENS => g.output_tokens = value.and_then(count),
                _ => {}
            }
        }
        g
    }
}

fn engine_span(span: &Span, service_name: Option<&str>) -> Verdict {
    let g = GenAi::read(&span.attributes);
    if !g.any {
        return Verdict::Ignored;
    }
    if !valid_id(&span.trace_id, 16) || !valid_id(&span.span_id, 8) {
        return Verdict::Rejected;
    }
    let trace_id = lower_hex(&span.trace_id);
    Verdict::Engine(Box::new(EngineSpan {
        span_id: lower_hex(&span.span_id),
        name: span.name.clone(),
        request_id: g.request_id,
        update: PhaseUpdate {
            trace_id: trace_id.clone(),
            queue_duration_ms: g.queue_ms,
            prefill_duration_ms: g.prefill_ms,
            decode_duration_ms: g.decode_ms,
            input_tokens: g.prompt_tokens.or(g.input_tokens),
            output_tokens: g.completion_tokens.or(g.output_tokens),
            per_step: false,
        },
        trace_id,
        ttft_ms: g.ttft_ms,
        e2e_ms: g.e2e_ms,
        service_name: service_name.map(str::to_owned),
    }))
}

/// A duration attribute in seconds → ms; only finite, non-negative numbers.
fn seconds_as_ms(value: &AnyValue) -> Option<f64> {
    let seconds = match value.value.as_ref()? {
        Value::DoubleValue(d) => *d,
        Value::IntValue(i) => *i as f64,
        _ => return None,
    };
    (seconds.is_finite() && seconds >= 0.0).then_some(seconds * 1000.0)
}

/// Largest integer a double holds exactly.
const MAX_EXACT_DOUBLE: f64 = 9_007_199_254_740_992.0;

/// A token count: non-negative integer, or an integral double up to 2^53.
fn count(value: &AnyValue) -> Option<u64> {
    match value.value.as_ref()? {
        Value::IntValue(i) => u64::try_from(*i).ok(),
        Value::DoubleValue(d)
            if d.is_finite() && *d >= 0.0 && d.fract() == 0.0 && *d <= MAX_EXACT_DOUBLE =>
        {
            Some(*d as u64)
        }
        _ => None,
    }
}

/// An id attribute: a string, or an integer written in decimal.
fn id_string(value: &AnyValue) -> Option<String> {
    match value.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

fn string_attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

fn valid_id(id: &[u8], len: usize) -> bool {
    id.len() == len && id.iter().any(|&b| b != 0)
}

use tokenscope_core::w3c::hex as lower_hex;

#[cfg(test)]
mod tests;
