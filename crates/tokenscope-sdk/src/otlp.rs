//! OTLP exporter: one `llm_request` span per finished request, with the attributes vLLM writes.
//!
//! Invariants:
//! * A span is built only for a request with a [`crate::TraceContext`] (it joins the caller's
//!   trace: same trace id, parent = the caller's span, e.g. the gateway's `upstream` span);
//!   untraced requests are skipped and counted ([`OtlpExporter::untraced`]).
//! * Attributes are vLLM's (`SpanAttributes` in `vllm/tracing.py`), as the gateway's OTLP
//!   receiver (`tokenscope-otlp`) reads them: `gen_ai.latency.time_in_queue`,
//!   `…time_to_first_token`, `…e2e`, `…time_in_model_prefill`, `…time_in_model_decode` as
//!   doubles of seconds (the SDK's integer nanoseconds / 1e9), `gen_ai.usage.prompt_tokens` /
//!   `completion_tokens` as ints, `gen_ai.request.id` as a string. Span kind `SERVER`, start =
//!   arrival, end = finish (wall clock = the tracker clock's origin + monotonic offset).
//! * Transport, batching, retries and the bounded span queue are tokenscope-trace's
//!   `TraceExporter`, run on a one-worker tokio runtime owned by this exporter (the engine needs
//!   no runtime). [`crate::Exporter::shutdown`] exports what is queued within 5 s.

use crate::pipeline::{Batch, Exporter};
use crate::tracker::FinishedRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::{status::StatusCode, Span, Status};
use std::sync::Arc;
use std::time::Duration;
use tokenscope_trace::{ExporterConfig, NoopExportObserver, TraceExporter};

pub use tokenscope_trace::{ExportObserver, Protocol};

/// Name of the span (vLLM's).
pub const SPAN_NAME: &str = "llm_request";

fn kv(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
        ..KeyValue::default()
    }
}

fn seconds(ns: u64) -> Value {
    Value::DoubleValue(ns as f64 / 1e9)
}

fn int(n: u64) -> Value {
    Value::IntValue(i64::try_from(n).unwrap_or(i64::MAX))
}

/// The span of one finished request (`None` without a trace context). `span_id` must be
/// non-zero and unique within the trace.
pub fn request_span(f: &FinishedRequest, span_id: [u8; 8]) -> Option<Span> {
    let trace = f.trace?;
    let mut attributes = vec![
        kv("gen_ai.latency.time_in_queue", seconds(f.queue_ns)),
        kv("gen_ai.latency.e2e", seconds(f.e2e_ns())),
        kv(
            "gen_ai.latency.time_in_model_prefill",
            seconds(f.prefill_ns),
        ),
        kv("gen_ai.latency.time_in_model_decode", seconds(f.decode_ns)),
        kv("gen_ai.usage.prompt_tokens", int(f.prompt_tokens)),
        kv("gen_ai.usage.completion_tokens", int(f.output_tokens)),
        kv(
            "gen_ai.response.model",
            Value::StringValue(f.model.to_string()),
        ),
        kv(
            "gen_ai.response.finish_reasons",
            Value::StringValue(f.reason.as_str().to_owned()),
        ),
    ];
    if let Some(ttft) = f.ttft_ns() {
        attributes.push(kv("gen_ai.latency.time_to_first_token", seconds(ttft)));
    }
    if let Some(id) = &f.request_id {
        attributes.push(kv("gen_ai.request.id", Value::StringValue(id.clone())));
    }
    let events = f
        .token_times_ns
        .as_ref()
        .map(|times| {
            let origin = f.arrival_unix_ns - f.arrival_ns;
            times
                .iter()
                .enumerate()
                .map(
                    |(i, &t)| opentelemetry_proto::tonic::trace::v1::span::Event {
                        time_unix_nano: origin + t,
                        name: "gen_ai.token".to_owned(),
                        attributes: vec![kv("gen_ai.token.index", int(i as u64))],
                        dropped_attributes_count: 0,
                    },
                )
                .collect()
        })
        .unwrap_or_default();
    let error = f.reason == crate::FinishReason::Error;
    Some(Span {
        trace_id: trace.trace_id.to_vec(),
        span_id: span_id.to_vec(),
        trace_state: String::new(),
        parent_span_id: trace.parent_span_id.to_vec(),
        flags: u32::from(trace.flags),
        name: SPAN_NAME.to_owned(),
        kind: SpanKind::Server as i32,
        start_time_unix_nano: f.arrival_unix_ns,
        end_time_unix_nano: f.finish_unix_ns,
        attributes,
        dropped_attributes_count: 0,
        events,
        dropped_events_count: 0,
        links: Vec::new(),
        dropped_links_count: 0,
        status: Some(Status {
            message: String::new(),
            code: if error {
                StatusCode::Error as i32
            } else {
                StatusCode::Unset as i32
            },
        }),
    })
}

/// Exports finished requests as OTLP spans. See the module docs.
pub struct OtlpExporter {
    runtime: tokio::runtime::Runtime,
    exporter: Arc<TraceExporter>,
    untraced: u64,
}

impl OtlpExporter {
    /// Starts the transport: `cfg.endpoint` is `http://host:4318` for OTLP/HTTP (or a gateway's
    /// admin listener, which receives `POST /v1/traces`), `http://host:4317` for gRPC. Set
    /// `cfg.resource` to name the service (`service.name`).
    pub fn new(cfg: ExporterConfig) -> Result<Self, crate::SdkError> {
        Self::with_observer(cfg, Arc::new(NoopExportObserver))
    }

    /// [`OtlpExporter::new`] with an observer of exported and dropped spans.
    pub fn with_observer(
        cfg: ExporterConfig,
        observer: Arc<dyn ExportObserver>,
    ) -> Result<Self, crate::SdkError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tokenscope-sdk-otlp")
            .enable_all()
            .build()
            .map_err(crate::SdkError::Runtime)?;
        let exporter = {
            let _guard = runtime.enter();
            TraceExporter::spawn(cfg, observer)?
        };
        Ok(Self {
            runtime,
            exporter,
            untraced: 0,
        })
    }

    /// Finished requests skipped because they had no trace context.
    pub fn untraced(&self) -> u64 {
        self.untraced
    }
}

/// Default exporter settings for an endpoint: short batches (100 ms), so spans reach the
/// gateway soon after the request ends; `service.name` = `service`.
pub fn config(endpoint: &str, service: &str) -> ExporterConfig {
    ExporterConfig {
        endpoint: endpoint.to_owned(),
        batch_timeout: Duration::from_millis(100),
        resource: vec![("service.name".to_owned(), service.to_owned())],
        ..ExporterConfig::default()
    }
}

impl Exporter for OtlpExporter {
    fn export(&mut self, batch: &Batch) {
        let mut spans = Vec::with_capacity(batch.finished.len());
        for f in &batch.finished {
            match request_span(f, tokenscope_trace::context::new_span_id()) {
                Some(s) => spans.push(s),
                None => self.untraced += 1,
            }
        }
        // Never blocks: the span budget is checked, overflow is dropped and counted by the
        // observer.
        self.exporter.submit(spans);
    }

    fn shutdown(&mut self) {
        let exporter = self.exporter.clone();
        self.runtime
            .block_on(async move { exporter.shutdown(Duration::from_secs(5)).await });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Clock, FinishReason, RequestInfo, TraceContext, Tracker, TrackerConfig, Work};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
    use prost::Message as _;

    /// The gateway's own OTLP decoder reads the SDK's span back into exactly the SDK's values.
    #[test]
    fn the_gateway_decoder_reads_the_sdk_values() {
        let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
        let m = t.model("m");
        let tc = TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        let h = t.arrive_at(
            1_000,
            RequestInfo::new(m, 700).request_id("req-1").trace(tc),
        );
        t.step_at(
            3_333,
            9_999_999,
            &[crate::StepEntry::new(h, Work::prefill_last(700))],
        );
        t.token_at(h, 12_345_678);
        t.finish_at(h, 12_345_678, FinishReason::Stop);
        let f = t.take_finished().remove(0);
        let span = request_span(&f, [1; 8]).expect("traced");
        let req = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: None,
                scope_spans: vec![ScopeSpans {
                    scope: None,
                    spans: vec![span],
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        let body = req.encode_to_vec();
        let spans =
            tokenscope_otlp::decode_request(Some("application/x-protobuf"), &body).expect("decode");
        let s = &spans[0];
        assert_eq!(s.trace_id, "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(s.request_id.as_deref(), Some("req-1"));
        let ms = |ns: u64| ns as f64 / 1e6;
        let close = |a: Option<f64>, b: f64| (a.expect("present") - b).abs() < 1e-9;
        assert!(close(s.update.queue_duration_ms, ms(f.queue_ns)));
        assert!(close(s.update.prefill_duration_ms, ms(f.prefill_ns)));
        assert!(close(s.update.decode_duration_ms, ms(f.decode_ns)));
        assert!(close(s.ttft_ms, ms(f.ttft_ns().expect("ttft"))));
        assert!(close(s.e2e_ms, ms(f.e2e_ns())));
        assert_eq!(s.update.input_tokens, Some(700));
        assert_eq!(s.update.output_tokens, Some(2));
    }
}
