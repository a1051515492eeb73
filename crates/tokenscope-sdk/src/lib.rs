//! # tokenscope-sdk
//!
//! Instrument a self-written inference engine the way the article's R3 asks: time queueing,
//! prefill and decode **inside the engine, per request, as its state changes** — never per
//! batch — and do it so cheaply that it costs well under 2 % of a core.
//!
//! * [`Tracker`] lives on the engine's thread (plain `&mut self` methods, no interior
//!   mutability; move it to another thread if the engine moves): it owns every request's state; a token event is a slab index, a few integer additions and one compare.
//!   No lock, no atomic, no allocation, no clock read per token (timestamps are passed in).
//! * [`Tracker::step_at`] takes one engine step with the requests it contained and attributes
//!   the step to each request according to *that request's* work in it (a prefill chunk, or
//!   decode), so continuous batching with chunked prefill gives correct per-request phases.
//! * Finished requests and token counters are shipped as one [`Batch`] per flush (every
//!   [`TrackerConfig::flush_interval`] or [`TrackerConfig::flush_tokens`] token events) over a
//!   bounded channel with `try_send`: a full channel drops the batch and counts it
//!   ([`SinkStats`]), the engine loop never blocks.
//! * An exporter thread ([`spawn_exporters`]) hands each batch to the [`Exporter`]s:
//!   Prometheus (feature `prometheus`), OTLP spans (feature `otlp`), a tokenscope store
//!   (feature `store`), or any closure.
//!
//! ## Phases (the definitions every exporter uses)
//!
//! All times are `u64` nanoseconds of one monotonic clock ([`Clock`]; any monotonic source
//! works with the `_at` methods). A request is always in exactly one [`State`], and every
//! instant of `[arrival, finish]` belongs to the phase of the state the request was in:
//!
//! | state | phase | entered by |
//! |---|---|---|
//! | [`State::Waiting`] | queue | [`Tracker::arrive_at`] (arrival → queue, tokenisation included), [`Tracker::queued_at`] |
//! | [`State::Preempted`] | queue | [`Tracker::preempt_at`] (waiting to be scheduled again) |
//! | [`State::Prefill`] | prefill | [`Tracker::schedule_at`], [`Tracker::resume_at`], a [`Work::Prefill`] step; gaps between prefill chunks and recompute after a preemption stay here |
//! | [`State::Decode`] | decode | the first token ([`Tracker::token_at`], a step that samples one) |
//!
//! A step is attributed per request: the interval `[start, end]` of a step is prefill for a
//! request doing [`Work::Prefill`] (or any request without its first token yet), decode for a
//! request doing [`Work::Decode`] after its first token. So two requests in one batch get
//! different attributions when their states differ.
//!
//! Consequences, exact in integer nanoseconds:
//!
//! * `queue + prefill + decode = finish − arrival` for every finished or aborted request
//!   ([`FinishedRequest::e2e_ns`]).
//! * TTFT = first token − arrival; TPOT = (last token − first token) / (output tokens − 1),
//!   only with ≥ 2 output tokens (the gateway's definitions).
//! * Without preemption these are vLLM's meanings: `time_in_queue` = scheduled − queued,
//!   `time_in_model_prefill` = first token − scheduled, `time_in_model_decode` = last token −
//!   first token (when the request finishes at its last token; time between the last token and
//!   `finish` is decode). vLLM counts a preempted request's wait inside prefill/decode; here it
//!   is queue, and recompute is prefill.
//! * Timestamps earlier than a request's previous event are clamped to it (a clock that steps
//!   back cannot make a phase negative); the invariants then hold for the clamped values.
//! * Events for an unknown or finished handle are ignored and counted
//!   ([`Tracker::stale_events`]); a handle is never reused (slot generation).
//!
//! ## Example
//!
//! ```
//! use tokenscope_sdk::{Clock, FinishReason, RequestInfo, StepEntry, Tracker, TrackerConfig, Work};
//!
//! let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
//! let model = t.model("llama-3-8b");
//! let a = t.arrive_at(0, RequestInfo::new(model, 600));
//! let b = t.arrive_at(0, RequestInfo::new(model, 10));
//! t.schedule_at(a, 1_000);
//! t.schedule_at(b, 1_000);
//! // One step: a prefills 512 of its 600 tokens, b prefills all 10 and samples its first token.
//! t.step_at(1_000, 9_000, &[
//!     StepEntry::new(a, Work::prefill(512)),
//!     StepEntry::new(b, Work::prefill_last(10)),
//! ]);
//! // Next step: a finishes its prefill (first token), b decodes one token.
//! t.step_at(9_000, 12_000, &[
//!     StepEntry::new(a, Work::prefill_last(88)),
//!     StepEntry::new(b, Work::decode()),
//! ]);
//! t.finish_at(b, 12_000, FinishReason::Stop);
//! let done = t.take_finished();
//! let rb = &done[0];
//! assert_eq!((rb.queue_ns, rb.prefill_ns, rb.decode_ns), (1_000, 8_000, 3_000));
//! assert_eq!(rb.queue_ns + rb.prefill_ns + rb.decode_ns, rb.e2e_ns());
//! assert_eq!(rb.ttft_ns(), Some(9_000));
//! assert_eq!(rb.tpot_ns(), Some(3_000.0));
//! // `a` is still running, in decode since 12 µs, prefill 11 µs.
//! let ra = t.snapshot(a).expect("running");
//! assert_eq!((ra.prefill_ns, ra.state), (11_000, tokenscope_sdk::State::Decode));
//! ```
//!
//! ## Features
//!
//! * `prometheus` (default): [`prometheus::PrometheusExporter`], the gateway's `llm_*`
//!   metrics (same names, labels, buckets) in a `prometheus-client` registry.
//! * `otlp`: `otlp::OtlpExporter`, one `llm_request` span per finished request with a trace
//!   context, carrying vLLM's `gen_ai.latency.*` / `gen_ai.usage.*` attributes, over
//!   OTLP/HTTP or gRPC (tokenscope-trace's batching exporter).
//! * `store`: `store::StoreExporter`, finished records written to a tokenscope store
//!   ([`FinishedRequest::to_record`] is always available).
#![deny(missing_docs)]

mod clock;
mod pipeline;
mod trace_context;
mod tracker;

#[cfg(feature = "otlp")]
pub mod otlp;
#[cfg(feature = "prometheus")]
pub mod prometheus;
#[cfg(feature = "store")]
pub mod store;

pub use clock::{Clock, Nanos};
pub use pipeline::{
    spawn_exporters, Batch, Exporter, ExporterThread, PipelineConfig, Sink, SinkStats, TokenDelta,
};
pub use trace_context::TraceContext;
pub use tracker::{
    FinishReason, FinishedRequest, ModelId, Phases, RequestHandle, RequestInfo, Snapshot, State,
    StepEntry, Tracker, TrackerConfig, Work,
};

/// Errors of the SDK's exporters (the tracker itself never fails).
#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    /// The exporter thread could not be started.
    #[error("starting the exporter thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The OTLP exporter's configuration is invalid.
    #[cfg(feature = "otlp")]
    #[error(transparent)]
    Otlp(#[from] tokenscope_trace::ExportError),
    /// The OTLP exporter's runtime could not be built.
    #[cfg(feature = "otlp")]
    #[error("starting the OTLP exporter runtime: {0}")]
    Runtime(#[source] std::io::Error),
}
