//! The spans of one kept request, built from its finished record (OpenTelemetry GenAI
//! semantic conventions).
//!
//! Tree (all in the request's trace):
//! ```text
//! {operation} {model}     SERVER  root; parent = the caller's span from `traceparent`, if any
//! ├── upstream            CLIENT  request handed to the engine → response end; its id is the
//! │                               parent in the `traceparent` the engine received
//! ├── queue               INTERNAL  when the engine reported (or tokenscope derived) it
//! ├── prefill             INTERNAL
//! └── decode              INTERNAL
//! ```
//! plus a `first_token` event on the root at TTFT.
//!
//! A streamed request with a TTFT carries the convention's
//! `gen_ai.response.time_to_first_chunk` (seconds) and `gen_ai.response.id` (the engine's
//! response id, `chatcmpl-…`, when the response carried one; it is not a column of the
//! record) on the root.
//!
//! Invariants:
//! * Times: the root starts at the record's wall-clock arrival (`created_at`); every other
//!   instant is that plus a monotonic offset measured by the gateway, so span durations are
//!   the record's durations exactly (to the nanosecond rounding of the offsets).
//! * Engine phases are laid out back to back from the moment the request was handed to the
//!   engine (queue, then prefill, then decode), each with its measured length, clamped to the
//!   root span; the engine reports lengths, not start times.
//! * No prompt or completion text and no raw user id ever goes into a span: the user appears
//!   only as the metrics' bucket label.

use crate::context::{RequestTrace, SpanId};
use crate::sampler::KeepReason;
use opentelemetry_proto::tonic::common::v1::{any_value::Value, AnyValue, ArrayValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::{Event, SpanKind};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{Span, Status};
use tokenscope_core::{Endpoint, Outcome, PhaseSource, RequestRecord};

/// Offsets (ms from arrival, monotonic) the record does not carry itself.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpanTimes {
    /// The request was handed to the upstream connection; `None` when it never was (e.g. a
    /// 413 answered by the gateway).
    pub upstream_sent_ms: Option<f64>,
}

/// Everything besides the record that the spans need.
#[derive(Debug, Clone, Copy)]
pub struct SpanInput<'a> {
    /// The request's trace ids.
    pub trace: &'a RequestTrace,
    /// Gateway-side offsets.
    pub times: SpanTimes,
    /// The user's bucket label (never the raw id).
    pub user_bucket: &'a str,
    /// The engine's host and port.
    pub server: Option<(&'a str, u16)>,
    /// Why the trace was kept.
    pub reason: KeepReason,
    /// The engine's response id (`chatcmpl-…`), when the response carried one.
    pub response_id: Option<&'a str>,
}

fn kv(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

fn s(key: &str, v: &str) -> KeyValue {
    kv(key, Value::StringValue(v.to_owned()))
}

fn i(key: &str, v: u64) -> KeyValue {
    kv(key, Value::IntValue(i64::try_from(v).unwrap_or(i64::MAX)))
}

fn f(key: &str, v: f64) -> KeyValue {
    kv(key, Value::DoubleValue(v))
}

/// `gen_ai.operation.name` of an endpoint.
pub fn operation_name(e: Endpoint) -> &'static str {
    match e {
        Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages => "chat",
        Endpoint::Completions => "text_completion",
        Endpoint::Embeddings => "embeddings",
    }
}

/// Nanoseconds since the epoch at `offset_ms` after arrival.
fn at(rec: &RequestRecord, offset_ms: f64) -> u64 {
    let base = u64::try_from(rec.created_at)
        .unwrap_or(0)
        .saturating_mul(1000);
    let off = if offset_ms.is_finite() && offset_ms > 0.0 {
        (offset_ms * 1e6).round() as u64
    } else {
        0
    };
    base.saturating_add(off)
}

struct Builder<'a> {
    input: &'a SpanInput<'a>,
}

impl Builder<'_> {
    fn span(&self, id: SpanId, parent: Option<SpanId>, name: String, kind: SpanKind) -> Span {
        Span {
            trace_id: self.input.trace.trace_id.to_vec(),
            span_id: id.to_vec(),
            parent_span_id: parent.map(|p| p.to_vec()).unwrap_or_default(),
            name,
            kind: kind as i32,
            // HAS_IS_REMOTE, parent local (the root sets IS_REMOTE itself), trace flags.
            flags: 0x100 | u32::from(self.input.trace.flags),
            ..Default::default()
        }
    }
}

fn error_status(message: &str) -> Option<Status> {
    Some(Status {
        message: message.to_owned(),
        code: StatusCode::Error as i32,
    })
}

/// The spans of one kept request, root first.
pub fn build_spans(rec: &RequestRecord, input: &SpanInput<'_>) -> Vec<Span> {
    let b = Builder { input };
    let trace = input.trace;
    let end_ms = rec.total_duration_ms.max(0.0);
    let op = operation_name(rec.endpoint);

    // Root.
    let mut root = b.span(
        trace.root_span_id,
        trace.parent_span_id,
        format!("{op} {}", rec.model),
        SpanKind::Server,
    );
    // The root's parent is remote when it came from the caller.
    root.flags = 0x100
        | if trace.parent_span_id.is_some() {
            0x200
        } else {
            0
        }
        | u32::from(trace.flags);
    root.start_time_unix_nano = at(rec, 0.0);
    root.end_time_unix_nano = at(rec, end_ms);
    // The engine that served the request; unknown, the API's owner.
    let provider = rec.engine.as_deref().unwrap_or(match rec.endpoint {
        Endpoint::Messages => "anthropic",
        _ => "openai",
    });
    let mut a = vec![
        s("gen_ai.operation.name", op),
        s("gen_ai.provider.name", provider),
        s("gen_ai.request.model", &rec.model),
        s("tokenscope.request_id", &rec.request_id),
        s("tokenscope.user_bucket", input.user_bucket),
        s("tokenscope.request_type", &rec.request_type),
        s("tokenscope.outcome", rec.outcome.as_str()),
        s("tokenscope.upstream", &rec.upstream),
        s("tokenscope.sample.reason", input.reason.as_str()),
        kv("gen_ai.request.stream", Value::BoolValue(rec.stream)),
        f("tokenscope.duration_ms", end_ms),
    ];
    if let Some(m) = &rec.model_served {
        a.push(s("gen_ai.response.model", m));
    }
    if let Some(n) = rec.input_tokens {
        a.push(i("gen_ai.usage.input_tokens", n));
    }
    if let Some(n) = rec.output_tokens {
        a.push(i("gen_ai.usage.output_tokens", n));
    }
    if let Some(n) = rec.cached_tokens {
        a.push(i("gen_ai.usage.cache_read.input_tokens", n));
    }
    if let Some(n) = rec.cache_creation_tokens {
        a.push(i("gen_ai.usage.cache_creation.input_tokens", n));
    }
    if let Some(n) = rec.reasoning_tokens {
        a.push(i("gen_ai.usage.reasoning.output_tokens", n));
    }
    if let Some(n) = rec.max_tokens {
        a.push(i("gen_ai.request.max_tokens", n));
    }
    if let Some(r) = &rec.finish_reason {
        a.push(kv(
            "gen_ai.response.finish_reasons",
            Value::ArrayValue(ArrayValue {
                values: vec![AnyValue {
                    value: Some(Value::StringValue(r.clone())),
                }],
            }),
        ));
    }
    if let Some(e) = &rec.error_type {
        a.push(s("error.type", e));
    }
    if let Some((host, port)) = input.server {
        a.push(s("server.address", host));
        a.push(i("server.port", u64::from(port)));
    }
    if let Some(id) = input.response_id {
        a.push(s("gen_ai.response.id", id));
    }
    if rec.http_status != 0 {
        a.push(i("http.response.status_code", u64::from(rec.http_status)));
    }
    if let Some(bl) = &rec.business_line {
        a.push(s("tokenscope.business_line", bl));
    }
    if let Some(t) = &rec.tenant {
        a.push(s("tokenscope.tenant", t));
    }
    if let Some(bkt) = rec.input_bucket {
        a.push(s("tokenscope.input_bucket", bkt.as_str()));
    }
    if let Some(v) = rec.ttft_ms {
        a.push(f("tokenscope.ttft_ms", v));
        if rec.stream {
            // The GenAI convention's time to the first chunk of a streamed response, seconds.
            a.push(f("gen_ai.response.time_to_first_chunk", v / 1000.0));
        }
    }
    if let Some(v) = rec.tpot_ms {
        a.push(f("tokenscope.tpot_ms", v));
    }
    a.push(s(
        "tokenscope.input_tokens.source",
        rec.input_tokens_source.as_str(),
    ));
    a.push(s(
        "tokenscope.output_tokens.source",
        rec.output_tokens_source.as_str(),
    ));
    root.attributes = a;
    if let Some(ttft) = rec.ttft_ms {
        root.events.push(Event {
            time_unix_nano: at(rec, ttft),
            name: "first_token".to_owned(),
            attributes: vec![f("tokenscope.ttft_ms", ttft)],
            dropped_attributes_count: 0,
        });
    }
    if rec.outcome != Outcome::Ok {
        root.status = error_status(rec.error_type.as_deref().unwrap_or(rec.outcome.as_str()));
    }

    let mut spans = vec![root];
    let Some(sent) = input.times.upstream_sent_ms else {
        return spans;
    };
    let sent = sent.clamp(0.0, end_ms);

    // The call to the engine.
    let mut up = b.span(
        trace.upstream_span_id,
        Some(trace.root_span_id),
        "upstream".to_owned(),
        SpanKind::Client,
    );
    up.start_time_unix_nano = at(rec, sent);
    up.end_time_unix_nano = at(rec, end_ms);
    let mut ua = vec![
        s("tokenscope.upstream", &rec.upstream),
        s("http.request.method", "POST"),
    ];
    if let Some((host, port)) = input.server {
        ua.push(s("server.address", host));
        ua.push(i("server.port", u64::from(port)));
    }
    if rec.http_status != 0 {
        ua.push(i("http.response.status_code", u64::from(rec.http_status)));
    }
    if let Some(h) = rec.upstream_headers_ms {
        ua.push(f("tokenscope.upstream_headers_ms", h));
    }
    up.attributes = ua;
    if rec.http_status >= 500
        || rec.http_status == 0
        || matches!(rec.outcome, Outcome::UpstreamError | Outcome::Timeout)
    {
        up.status = error_status(rec.error_type.as_deref().unwrap_or("upstream_error"));
    }
    spans.push(up);

    // Engine phases, back to back from the hand-over.
    let mut cursor = sent;
    for (name, dur, src) in [
        ("queue", rec.queue_duration_ms, rec.queue_source),
        ("prefill", rec.prefill_duration_ms, rec.prefill_source),
        ("decode", rec.decode_duration_ms, rec.decode_source),
    ] {
        let Some(d) = dur.filter(|d| d.is_finite() && *d >= 0.0) else {
            continue;
        };
        if src == PhaseSource::None {
            continue;
        }
        let start = cursor.min(end_ms);
        let stop = (cursor + d).min(end_ms);
        cursor += d;
        let mut p = b.span(
            crate::context::new_span_id(),
            Some(trace.root_span_id),
            name.to_owned(),
            SpanKind::Internal,
        );
        p.start_time_unix_nano = at(rec, start);
        p.end_time_unix_nano = at(rec, stop);
        p.attributes = vec![
            s("tokenscope.phase.source", src.as_str()),
            f("tokenscope.phase.duration_ms", d),
        ];
        spans.push(p);
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_core::{InputBucket, TokenSource};

    fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a Value> {
        s.attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref())
            .and_then(|v| v.value.as_ref())
    }

    fn record() -> RequestRecord {
        RequestRecord {
            request_id: "req-1".into(),
            trace_id: String::new(),
            created_at: 1_700_000_000_000_000,
            model: "llama".into(),
            model_served: Some("llama-3".into()),
            upstream: "local".into(),
            user_id: Some("alice@example.com".into()),
            business_line: Some("search".into()),
            request_type: "chat".into(),
            endpoint: Endpoint::ChatCompletions,
            stream: true,
            http_status: 200,
            outcome: Outcome::Ok,
            finish_reason: Some("stop".into()),
            max_tokens: Some(64),
            input_tokens: Some(120),
            output_tokens: Some(40),
            cached_tokens: Some(100),
            reasoning_tokens: Some(8),
            input_tokens_source: TokenSource::Usage,
            output_tokens_source: TokenSource::Usage,
            input_bucket: Some(InputBucket::of(120)),
            queue_duration_ms: Some(250.0),
            queue_source: PhaseSource::Derived,
            prefill_duration_ms: Some(50.0),
            prefill_source: PhaseSource::Engine,
            decode_duration_ms: Some(300.0),
            decode_source: PhaseSource::Engine,
            ttft_ms: Some(302.5),
            tpot_ms: Some(7.5),
            total_duration_ms: 605.0,
            upstream_headers_ms: Some(3.0),
            engine: Some("llamacpp".into()),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn time_to_first_chunk_in_seconds_for_streams_only() {
        let trace = RequestTrace::start(None);
        let input = SpanInput {
            trace: &trace,
            times: SpanTimes::default(),
            user_bucket: "u07",
            server: None,
            reason: KeepReason::Ratio,
            response_id: None,
        };
        let mut rec = record();
        rec.stream = true;
        let spans = build_spans(&rec, &input);
        assert_eq!(
            attr(&spans[0], "gen_ai.response.time_to_first_chunk"),
            Some(&Value::DoubleValue(0.3025))
        );
        assert_eq!(attr(&spans[0], "gen_ai.response.id"), None);
        let with_id = SpanInput {
            response_id: Some("chatcmpl-42"),
            ..input
        };
        assert_eq!(
            attr(&build_spans(&rec, &with_id)[0], "gen_ai.response.id"),
            Some(&Value::StringValue("chatcmpl-42".into()))
        );
        rec.stream = false;
        let spans = build_spans(&rec, &input);
        assert_eq!(attr(&spans[0], "gen_ai.response.time_to_first_chunk"), None);
        rec.stream = true;
        rec.ttft_ms = None;
        let spans = build_spans(&rec, &input);
        assert_eq!(attr(&spans[0], "gen_ai.response.time_to_first_chunk"), None);
    }

    #[test]
    fn tree_times_and_attributes() {
        let trace = RequestTrace::start(Some(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ));
        let rec = record();
        let input = SpanInput {
            trace: &trace,
            times: SpanTimes {
                upstream_sent_ms: Some(2.0),
            },
            user_bucket: "u07",
            server: Some(("127.0.0.1", 8080)),
            reason: KeepReason::Ratio,
            response_id: None,
        };
        let spans = build_spans(&rec, &input);
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["chat llama", "upstream", "queue", "prefill", "decode"]
        );
        let root = &spans[0];
        assert_eq!(
            root.parent_span_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(root.kind, SpanKind::Server as i32);
        assert_eq!(root.start_time_unix_nano, 1_700_000_000_000_000_000);
        assert_eq!(root.end_time_unix_nano, 1_700_000_000_605_000_000);
        assert_eq!(root.events[0].name, "first_token");
        assert_eq!(root.events[0].time_unix_nano, 1_700_000_000_302_500_000);
        assert_eq!(
            attr(root, "gen_ai.usage.input_tokens"),
            Some(&Value::IntValue(120))
        );
        assert_eq!(
            attr(root, "gen_ai.usage.reasoning.output_tokens"),
            Some(&Value::IntValue(8))
        );
        assert_eq!(
            attr(root, "gen_ai.usage.cache_read.input_tokens"),
            Some(&Value::IntValue(100))
        );
        assert_eq!(
            attr(root, "gen_ai.provider.name"),
            Some(&Value::StringValue("llamacpp".into()))
        );
        assert_eq!(attr(root, "server.port"), Some(&Value::IntValue(8080)));
        assert_eq!(
            attr(root, "tokenscope.user_bucket"),
            Some(&Value::StringValue("u07".into()))
        );
        assert!(root.status.is_none());
        // No raw user anywhere.
        let dump = format!("{spans:?}");
        assert!(!dump.contains("alice"), "{dump}");
        for child in &spans[1..] {
            assert_eq!(child.parent_span_id, trace.root_span_id);
            assert_eq!(child.trace_id, trace.trace_id);
        }
        assert_eq!(spans[1].span_id, trace.upstream_span_id);
        assert_eq!(spans[1].kind, SpanKind::Client as i32);
        // queue 2 → 252, prefill 252 → 302, decode 302 → 602 ms.
        let ms = |ns: u64| (ns - 1_700_000_000_000_000_000) as f64 / 1e6;
        assert_eq!(
            (
                ms(spans[2].start_time_unix_nano),
                ms(spans[2].end_time_unix_nano)
            ),
            (2.0, 252.0)
        );
        assert_eq!(
            (
                ms(spans[3].start_time_unix_nano),
                ms(spans[3].end_time_unix_nano)
            ),
            (252.0, 302.0)
        );
        assert_eq!(
            (
                ms(spans[4].start_time_unix_nano),
                ms(spans[4].end_time_unix_nano)
            ),
            (302.0, 602.0)
        );
        assert_eq!(
            attr(&spans[2], "tokenscope.phase.source"),
            Some(&Value::StringValue("derived".into()))
        );
    }

    #[test]
    fn errors_have_error_status_and_no_upstream_when_never_sent() {
        let trace = RequestTrace::start(None);
        let mut rec = record();
        rec.outcome = Outcome::ClientError;
        rec.error_type = Some("body_too_large".into());
        rec.http_status = 413;
        let input = SpanInput {
            trace: &trace,
            times: SpanTimes::default(),
            user_bucket: "none",
            server: None,
            reason: KeepReason::Error,
            response_id: None,
        };
        let spans = build_spans(&rec, &input);
        assert_eq!(spans.len(), 1);
        assert!(spans[0].parent_span_id.is_empty());
        let st = spans[0].status.as_ref().expect("status");
        assert_eq!(st.code, StatusCode::Error as i32);
        assert_eq!(st.message, "body_too_large");
        assert_eq!(
            attr(&spans[0], "error.type"),
            Some(&Value::StringValue("body_too_large".into()))
        );
    }

    /// The Responses and Messages APIs are `chat` operations; an Anthropic call whose engine is
    /// unknown names Anthropic as the provider; cache writes have their attribute.
    #[test]
    fn responses_and_messages_spans() {
        assert_eq!(operation_name(Endpoint::Responses), "chat");
        assert_eq!(operation_name(Endpoint::Messages), "chat");
        let trace = RequestTrace::start(None);
        let input = SpanInput {
            trace: &trace,
            times: SpanTimes::default(),
            user_bucket: "u07",
            server: None,
            reason: KeepReason::Ratio,
            response_id: None,
        };
        let mut rec = record();
        rec.endpoint = Endpoint::Messages;
        rec.engine = None;
        rec.cache_creation_tokens = Some(20);
        let spans = build_spans(&rec, &input);
        assert_eq!(spans[0].name, "chat llama");
        assert_eq!(
            attr(&spans[0], "gen_ai.provider.name"),
            Some(&Value::StringValue("anthropic".into()))
        );
        assert_eq!(
            attr(&spans[0], "gen_ai.usage.cache_creation.input_tokens"),
            Some(&Value::IntValue(20))
        );
        rec.endpoint = Endpoint::Responses;
        let spans = build_spans(&rec, &input);
        assert_eq!(
            attr(&spans[0], "gen_ai.provider.name"),
            Some(&Value::StringValue("openai".into()))
        );
        rec.engine = Some("llamacpp".into());
        rec.endpoint = Endpoint::Messages;
        let spans = build_spans(&rec, &input);
        assert_eq!(
            attr(&spans[0], "gen_ai.provider.name"),
            Some(&Value::StringValue("llamacpp".into()))
        );
    }
}
