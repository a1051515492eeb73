//! OTLP/HTTP trace receiver for engine-side phase timings (vLLM, SGLang).
//!
//! vLLM and SGLang started with `--otlp-traces-endpoint` export one span per request whose
//! parent is taken from the incoming W3C `traceparent`. The gateway sends its own traceparent
//! upstream, so the engine's span carries the trace id of the gateway's record; the span's
//! `gen_ai.latency.*` attributes (seconds) and `gen_ai.usage.*` token counts are turned into a
//! [`tokenscope_core::PhaseUpdate`] joined to that record by trace id.
//!
//! - [`decode_request`] / [`decode_request_with_stats`]: pure decoding of an
//!   `ExportTraceServiceRequest` body, protobuf (`application/x-protobuf`) or OTLP/JSON
//!   (`application/json`: hex trace/span ids, lowerCamelCase keys, 64-bit integers as strings
//!   or numbers).
//! - [`router`] / [`router_with_stats`]: `POST /v1/traces` for the admin listener; gzip and
//!   deflate request bodies accepted; every request with at least one engine span calls the sink
//!   once.
//!
//! # Invariants
//! - Only spans with at least one `gen_ai.latency.*` or `gen_ai.usage.*` attribute become an
//!   [`EngineSpan`]; every other span is counted in [`DecodeStats::spans_total`] and dropped.
//! - Durations: a latency attribute is read only when it is a finite, non-negative number
//!   (double, or integer taken as seconds); it becomes milliseconds by `× 1000`. Anything else
//!   (string, negative, NaN) leaves the field `None`: no value is guessed.
//! - Token counts: non-negative integers (or integral doubles up to 2^53); anything else `None`.
//! - [`EngineSpan::trace_id`] and [`tokenscope_core::PhaseUpdate::trace_id`] are the same 32
//!   lower-case hex characters. An engine span whose trace id is not 16 bytes, whose span id is
//!   not 8 bytes, or either of which is all zeros, cannot be joined: it is rejected (counted in
//!   [`DecodeStats::rejected_spans`] and reported to the exporter as a partial success), never
//!   passed to the sink.
//! - Decoding does no I/O and keeps no state; the router's only side effects are the sink call
//!   and the [`ReceiverStats`] counters. The sink runs on the request's task: it must not block.
//! - Bodies are limited to [`MAX_BODY_BYTES`] both as received and after decompression.

mod attrs;
mod decode;
mod http;
#[cfg(test)]
mod test_support;

pub use decode::{
    decode_request, decode_request_with_stats, engine_spans, DecodeStats, Decoded, Encoding,
    EngineSpan, OtlpError,
};
pub use http::{
    router, router_with_stats, ReceiveError, ReceiverSnapshot, ReceiverStats, SpanSink,
    MAX_BODY_BYTES, TRACES_PATH,
};

/// The OTLP message types used here (`tonic` module: prost + serde types, no gRPC transport),
/// re-exported so that callers and tests can build requests without a direct dependency.
pub use opentelemetry_proto;
