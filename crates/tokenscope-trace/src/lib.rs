//! # tokenscope-trace
//!
//! One OpenTelemetry trace per request, decided at its end.
//!
//! * [`context`] — W3C `traceparent`: continue the caller's trace or start one; the ids of the
//!   root and `upstream` spans, and the `traceparent` the engine receives.
//! * [`sampler`] — [`TailSampler`]: keep every error and cancellation, every slow request
//!   (absolute threshold or above the running P99 of its model × input bucket), and a ratio
//!   of the rest.
//! * [`spans`] — [`build_spans`]: the GenAI-convention span tree of a kept request, from its
//!   finished [`RequestRecord`](tokenscope_core::RequestRecord).
//! * [`export`] — [`TraceExporter`]: bounded queue, batching, OTLP/HTTP or OTLP/gRPC, retries.
//!
//! Invariants (the hot-path/export boundary):
//! * The request path only parses a header at arrival and, at the end, takes one decision and
//!   (for kept requests) builds a few spans and hands them over with a non-blocking
//!   [`TraceExporter::submit`]. Nothing on the request path waits for the network.
//! * Spans of dropped requests are never built; spans of kept requests are exported or counted
//!   as dropped, never lost silently.
#![deny(missing_docs)]

pub mod context;
pub mod export;
pub mod sampler;
pub mod spans;

pub use context::{RequestTrace, SpanId, TraceId, TraceParent};
pub use export::{
    ExportError, ExportObserver, ExporterConfig, NoopExportObserver, Protocol, SpanDropReason,
    TraceExporter,
};
pub use opentelemetry_proto::tonic::trace::v1::Span;
pub use sampler::{Decision, KeepReason, SamplerConfig, TailSampler};
pub use spans::{build_spans, operation_name, SpanInput, SpanTimes};
