//! # tokenscope-core
//!
//! Pure types and measurement, shared by every other tokenscope crate. Nothing here performs
//! I/O, spawns tasks or reads a clock by itself: callers pass in [`std::time::Instant`]s taken
//! from the monotonic clock, so every function is deterministic and unit-testable.
//!
//! * [`record`] — [`RequestRecord`], the one row written per request, and its enums.
//! * [`timing`] — [`StreamTimer`]: TTFT, TPOT, inter-token gaps, from monotonic instants.
//! * [`sse`] — an incremental, bounded Server-Sent-Events parser.
//! * [`openai`] — reading OpenAI-compatible request and response bodies (usage, model, finish
//!   reason, llama.cpp `timings`), and the `include_usage` rewrite.
//! * [`responses`], [`messages`] — reading OpenAI Responses API and Anthropic Messages API
//!   bodies and streamed events into the same [`openai::PayloadInfo`].
//! * [`prompt`] — prompt normalisation and hashing for duplicate detection.
//! * [`query`] — the read side's vocabulary: [`Window`], [`Dimension`], [`Format`] and the one
//!   nearest-rank percentile ([`nearest_rank`]). With the `clap` feature, `Dimension` and
//!   `Format` are `clap::ValueEnum`s.
//! * [`redact`] — [`redact_url`]: a URL without its password, for logs.
//! * [`time`] — UTC calendar days and months, time formatting, and the one parser of human
//!   durations and report bounds (built on `jiff`).
//! * [`engine`] — the inference engines tokenscope knows ([`Engine`]) and an upstream's
//!   configured kind ([`EngineKind`]).
//! * [`success`] — the one definition of the success rate (which outcomes succeed, fail, or
//!   are left out), with its PromQL and SQL forms.
//!
//! Invariants:
//! * TPOT is `(t_last − t_first) / (n_out − 1)` and only exists for `n_out ≥ 2`.
//! * Durations are computed from monotonic instants only; wall clock is used for `created_at`
//!   alone.
//! * Parsers never panic on any input (property-tested and fuzzed).
#![deny(missing_docs)]

pub mod engine;
pub mod messages;
pub mod openai;
pub mod prompt;
pub mod query;
pub mod record;
pub mod redact;
pub mod responses;
pub mod sse;
pub mod success;
pub mod time;
pub mod timing;
pub mod usage;
pub mod w3c;

pub use engine::{Engine, EngineKind};
pub use query::{nearest_rank, nearest_rank_index, Dimension, Format, InvalidQuery, Window};
pub use record::{
    Endpoint, InputBucket, Outcome, PhaseSource, PhaseUpdate, RequestRecord, TokenSource,
};
pub use redact::{percent_decode, redact_url};
pub use timing::StreamTimer;
