//! # tokenscope-telemetry
//!
//! The Prometheus side of tokenscope: every metric the gateway exposes on `/metrics`, with
//! typed label sets (prometheus-client), and the rules that keep label cardinality bounded.
//!
//! Invariants:
//! * Metrics are updated once per request, when its record is final ([`Metrics::observe`]),
//!   plus the in-flight gauge at start/end. Nothing here is touched per streamed chunk.
//! * No label takes unbounded values: request ids never appear; users become a `user_bucket`
//!   ([`UserLabeler`]); models beyond `max_models` distinct names become `other`, the models
//!   the upstreams serve reserved first ([`ModelLabeler`]); no label value is longer than
//!   [`MAX_NAME_LABEL_BYTES`] ([`MAX_USER_LABEL_BYTES`] for users) nor holds a control
//!   character — longer or odd values are replaced by a marked hash ([`bounded_label`]).
//! * Names follow R2/R4 of the requirements: `llm_request_latency_seconds{model,request_type,status}`,
//!   `llm_ttft_seconds{model,input_bucket}`, `llm_tpot_seconds{model}`,
//!   `llm_tokens_total{model,token_type,user_bucket}`, `llm_requests_total{model,request_type,status}`,
//!   `llm_requests_in_flight{model}`, the engine layer `llm_request_phase_seconds{model,phase}`
//!   (queue / prefill / decode), the business layer
//!   `llm_business_line_tokens_total{business_line,token_type}` and
//!   `llm_cost_usd_total{model,business_line}` (business lines bounded like models), and the
//!   gateway's own `tokenscope_*` health metrics; per upstream replica ([`replicas`]):
//!   outstanding requests, health and ejections.
#![deny(missing_docs)]

mod labels;
pub mod replicas;

pub use labels::{
    bounded_label, ModelLabeler, UserLabelMode, UserLabeler, MAX_NAME_LABEL_BYTES,
    MAX_USER_LABEL_BYTES,
};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tokenscope_core::RequestRecord;

/// End-to-end latency buckets (seconds), from the requirements (R2).
pub const LATENCY_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// TTFT buckets (seconds), from the requirements (R2).
pub const TTFT_BUCKETS: [f64; 9] = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// TPOT buckets (seconds).
pub const TPOT_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
];
/// Phase (queue, prefill, decode) buckets (seconds): the latency buckets of R2 with the
/// millisecond range that queue and prefill times of a healthy engine live in.
pub const PHASE_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// The `phase` label values of `llm_request_phase_seconds`.
pub const PHASES: [&str; 3] = ["queue", "prefill", "decode"];
/// Store write latency buckets (seconds).
pub const STORE_WRITE_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5,
];

/// `{model, request_type, status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Bounded model label.
    pub model: String,
    /// Request type (chat, summary, …) — bounded by [`ModelLabeler`]-style limiting too.
    pub request_type: String,
    /// Outcome (`ok`, `client_error`, `upstream_error`, `timeout`, `cancelled`).
    pub status: &'static str,
}

/// `{model, input_bucket}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TtftLabels {
    /// Bounded model label.
    pub model: String,
    /// `0-128`, `128-512`, `512-2048`, `2048+`, or `unknown`.
    pub input_bucket: &'static str,
}

/// `{model}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// Bounded model label.
    pub model: String,
}

/// `{model, token_type, user_bucket}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    /// Bounded model label.
    pub model: String,
    /// `input`, `output` or `cached`.
    pub token_type: &'static str,
    /// Hashed or top-K user label.
    pub user_bucket: String,
}

/// `{model, phase}` of `llm_request_phase_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// Bounded model label.
    pub model: String,
    /// `queue`, `prefill` or `decode`.
    pub phase: &'static str,
}

/// `{business_line, token_type}` of `llm_business_line_tokens_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LineTokenLabels {
    /// Bounded business line (`none` when the request has none).
    pub business_line: String,
    /// `input`, `output` or `cached`.
    pub token_type: &'static str,
}

/// `{model, business_line}` of `llm_cost_usd_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CostLabels {
    /// Bounded model label.
    pub model: String,
    /// Bounded business line (`none` when the request has none).
    pub business_line: String,
}

/// `{reason}` for dropped or lost records.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Why the record was dropped (`queue_full`, `closed`) or lost (`spool_full`,
    /// `spool_error`, `write_failed`, `rejected`, `hold_full`, `shutdown`; store reopened:
    /// `unlinked`, `replaced`).
    pub reason: &'static str,
}

/// `{kind}` for store errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `unavailable`, `auth`, `schema`, `rejected`, `other`.
    pub kind: &'static str,
}

/// The exemplar on request histograms: the trace id of a kept (exported) trace.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceExemplar {
    /// 32 lowercase hex characters.
    pub trace_id: String,
}

/// `{decision, reason}` of the tail sampler.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceDecisionLabels {
    /// `kept` or `dropped`.
    pub decision: &'static str,
    /// Keep reason (`error`, `cancelled`, `slow`, `slow_p99`, `ratio`) or `none`.
    pub reason: &'static str,
}

/// Trace sampler reasons, pre-created at 0 (with `decision="kept"`).
pub const TRACE_KEEP_REASONS: [&str; 5] = ["error", "cancelled", "slow", "slow_p99", "ratio"];
/// Span drop reasons of the trace exporter, pre-created at 0.
pub const SPAN_DROP_REASONS: [&str; 4] = ["queue_full", "export_failed", "rejected", "shutdown"];

/// Drop reasons (before the queue), pre-created at 0.
pub const DROP_REASONS: [&str; 2] = ["queue_full", "closed"];
/// Loss reasons (accepted records never stored), pre-created at 0.
pub const LOSS_REASONS: [&str; 6] = [
    "spool_full",
    "spool_error",
    "write_failed",
    "rejected",
    "hold_full",
    "shutdown",
];

/// Why the store's writer reopened its file (`tokenscope_store_reopened_total{reason}`).
pub const REOPEN_REASONS: [&str; 2] = ["unlinked", "replaced"];
/// Store error kinds, pre-created at 0.
pub const STORE_ERROR_KINDS: [&str; 5] = ["unavailable", "auth", "schema", "rejected", "other"];

/// Label options.
#[derive(Debug, Clone)]
pub struct MetricsConfig {
    /// Distinct model label values before new ones become `other`.
    pub max_models: usize,
    /// Distinct request types before new ones become `other`.
    pub max_request_types: usize,
    /// How users become a label.
    pub user_label: UserLabelMode,
    /// Distinct business lines before new ones become `other`.
    pub max_business_lines: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            max_models: 50,
            max_request_types: 20,
            user_label: UserLabelMode::Hash { buckets: 16 },
            max_business_lines: 50,
        }
    }
}

/// A histogram whose exemplar is a kept trace's id.
pub type ExemplarHist = HistogramWithExemplars<TraceExemplar>;
/// A family of [`ExemplarHist`].
pub type ExemplarFamily<L> = Family<L, ExemplarHist, fn() -> ExemplarHist>;
/// A family of plain histograms.
pub type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Who measured the request-level metrics (only the help texts differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeenBy {
    /// The gateway, in front of the engine.
    Gateway,
    /// The engine itself (`tokenscope-sdk`).
    Engine,
}

/// The request-level families — `llm_request_latency_seconds`, `llm_ttft_seconds`,
/// `llm_tpot_seconds`, `llm_tokens_total`, `llm_requests_total`,
/// `llm_request_phase_seconds` — registered with their names, units and buckets in one place,
/// shared by the gateway's [`Metrics`] and the engine SDK's Prometheus exporter so that
/// dashboards and rules read both unchanged.
#[derive(Clone)]
pub struct RequestFamilies {
    /// `llm_request_latency_seconds{model,request_type,status}`.
    pub request_latency: ExemplarFamily<RequestLabels>,
    /// `llm_ttft_seconds{model,input_bucket}`.
    pub ttft: ExemplarFamily<TtftLabels>,
    /// `llm_tpot_seconds{model}`.
    pub tpot: ExemplarFamily<ModelLabels>,
    /// `llm_tokens_total{model,token_type,user_bucket}`.
    pub tokens: Family<TokenLabels, Counter>,
    /// `llm_requests_total{model,request_type,status}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `llm_request_phase_seconds{model,phase}`.
    pub phases: HistFamily<PhaseLabels>,
}

impl RequestFamilies {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry, seen_by: SeenBy) -> Self {
        let f = RequestFamilies {
            request_latency: Family::new_with_constructor(|| {
                HistogramWithExemplars::new(LATENCY_BUCKETS.into_iter())
            }),
            ttft: Family::new_with_constructor(|| {
                HistogramWithExemplars::new(TTFT_BUCKETS.into_iter())
            }),
            tpot: Family::new_with_constructor(|| {
                HistogramWithExemplars::new(TPOT_BUCKETS.into_iter())
            }),
            tokens: Family::default(),
            requests: Family::default(),
            phases: Family::new_with_constructor(|| Histogram::new(PHASE_BUCKETS)),
        };
        let (latency_help, phase_help) = match seen_by {
            SeenBy::Gateway => (
                "End-to-end request latency as seen by the gateway",
                "Time per request phase (queue, prefill, decode), from the engine's per-request timing when it reports one, else the gateway's estimate",
            ),
            SeenBy::Engine => (
                "End-to-end request latency as seen by the engine (arrival to finish)",
                "Time per request phase (queue, prefill, decode), from the engine's per-request timing",
            ),
        };
        registry.register_with_unit(
            "llm_request_phase",
            phase_help,
            Unit::Seconds,
            f.phases.clone(),
        );
        registry.register_with_unit(
            "llm_request_latency",
            latency_help,
            Unit::Seconds,
            f.request_latency.clone(),
        );
        registry.register_with_unit(
            "llm_ttft",
            "Time to first token (arrival to first content chunk), streamed requests",
            Unit::Seconds,
            f.ttft.clone(),
        );
        registry.register_with_unit(
            "llm_tpot",
            "Time per output token, (t_last - t_first)/(n_out - 1), n_out >= 2",
            Unit::Seconds,
            f.tpot.clone(),
        );
        registry.register(
            "llm_tokens",
            "Tokens by type (input includes cached; cached is also counted alone)",
            f.tokens.clone(),
        );
        registry.register(
            "llm_requests",
            "Measured requests by outcome",
            f.requests.clone(),
        );
        f
    }
}

/// Every metric tokenscope exposes. Cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    models: ModelLabeler,
    request_types: ModelLabeler,
    users: UserLabeler,
    business_lines: ModelLabeler,
    phases: HistFamily<PhaseLabels>,
    line_tokens: Family<LineTokenLabels, Counter>,
    cost_usd: Family<CostLabels, Counter<f64, AtomicU64>>,
    request_latency: ExemplarFamily<RequestLabels>,
    ttft: ExemplarFamily<TtftLabels>,
    tpot: ExemplarFamily<ModelLabels>,
    tokens: Family<TokenLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    in_flight: Family<ModelLabels, Gauge>,
    records_enqueued: Counter,
    records_written: Counter,
    records_dropped: Family<ReasonLabels, Counter>,
    records_queued: Gauge<i64, std::sync::atomic::AtomicI64>,
    store_write: Histogram,
    records_lost: Family<ReasonLabels, Counter>,
    records_spooled: Counter,
    records_replayed: Counter,
    records_duplicate: Counter,
    records_held: Gauge<i64, std::sync::atomic::AtomicI64>,
    store_reopened: Family<ReasonLabels, Counter>,
    store_errors: Family<KindLabels, Counter>,
    store_retries: Counter,
    spool_bytes: Gauge<i64, std::sync::atomic::AtomicI64>,
    spool_batches: Gauge<i64, std::sync::atomic::AtomicI64>,
    spool_oldest_age: Gauge<f64, AtomicU64>,
    store_up: Gauge<i64, std::sync::atomic::AtomicI64>,
    gateway_overhead: Histogram,
    upstream_bytes: Counter<u64, AtomicU64>,
    token_mismatch: Family<ModelLabels, Counter>,
    updates_unmatched: Family<UnmatchedLabels, Counter>,
    traces: Family<TraceDecisionLabels, Counter>,
    trace_spans_exported: Counter,
    trace_spans_dropped: Family<ReasonLabels, Counter>,
    trace_export_errors: Family<KindLabels, Counter>,
    trace_queue_spans: Gauge<i64, std::sync::atomic::AtomicI64>,
    budget_usage: Family<BusinessLineLabels, Gauge<f64, AtomicU64>>,
}

/// `{business_line}` of the budget gauge (bounded: only business lines with a `[[budgets]]`
/// entry).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BusinessLineLabels {
    /// The business line.
    pub business_line: String,
}

/// `{reason}` for late engine updates that never found their row.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UnmatchedLabels {
    /// `overflow`, `expired`, `shutdown` or `writefailed`.
    pub reason: String,
}

impl Metrics {
    /// Builds the registry.
    pub fn new(cfg: MetricsConfig) -> Self {
        let mut registry = Registry::default();
        let RequestFamilies {
            request_latency,
            ttft,
            tpot,
            tokens,
            requests,
            phases,
        } = RequestFamilies::register(&mut registry, SeenBy::Gateway);
        let in_flight = Family::<ModelLabels, Gauge>::default();
        let line_tokens = Family::<LineTokenLabels, Counter>::default();
        let cost_usd = Family::<CostLabels, Counter<f64, AtomicU64>>::default();
        registry.register(
            "llm_business_line_tokens",
            "Tokens by business line and type (input includes cached)",
            line_tokens.clone(),
        );
        registry.register(
            "llm_cost_usd",
            "Cost in USD of priced requests (`[[prices]]`) by model and business line",
            cost_usd.clone(),
        );
        registry.register(
            "llm_requests_in_flight",
            "Requests currently being served",
            in_flight.clone(),
        );

        let records_enqueued = Counter::default();
        let records_written = Counter::default();
        let records_dropped = Family::<ReasonLabels, Counter>::default();
        let records_queued = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        let store_write = Histogram::new(STORE_WRITE_BUCKETS);
        let records_lost = Family::<ReasonLabels, Counter>::default();
        let records_spooled = Counter::default();
        let records_replayed = Counter::default();
        let records_duplicate = Counter::default();
        let records_held = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        let store_reopened = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "tokenscope_records_duplicate",
            "Records delivered to the store that it already held under their request_id (a spool replay of a batch it had taken); not inserted again and not counted as written",
            records_duplicate.clone(),
        );
        registry.register(
            "tokenscope_records_held",
            "Rows held in memory because neither the store nor the spool took their batch (full or failing disk); retried with backoff, bounded by pipeline.capacity",
            records_held.clone(),
        );
        registry.register(
            "tokenscope_store_reopened",
            "Times the SQLite writer found its file unlinked or replaced under it and reopened (recreated) it, by reason",
            store_reopened.clone(),
        );
        for reason in REOPEN_REASONS {
            let _ = store_reopened.get_or_create(&ReasonLabels { reason });
        }
        let store_errors = Family::<KindLabels, Counter>::default();
        let store_retries = Counter::default();
        let spool_bytes = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        let spool_batches = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        let spool_oldest_age = Gauge::<f64, AtomicU64>::default();
        let store_up = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        store_up.set(1);
        let gateway_overhead = Histogram::new([
            0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
        ]);
        let upstream_bytes = Counter::<u64, AtomicU64>::default();
        let token_mismatch = Family::<ModelLabels, Counter>::default();
        let updates_unmatched = Family::<UnmatchedLabels, Counter>::default();
        registry.register(
            "tokenscope_engine_updates_unmatched",
            "Late engine span updates that never found their record, by reason",
            updates_unmatched.clone(),
        );
        registry.register(
            "llm_token_count_mismatch",
            "Requests whose entry tokenizer count disagreed with the engine's usage beyond the tolerance",
            token_mismatch.clone(),
        );
        registry.register(
            "tokenscope_records_enqueued",
            "Records handed to the store pipeline",
            records_enqueued.clone(),
        );
        registry.register(
            "tokenscope_records_written",
            "Records written to the store",
            records_written.clone(),
        );
        registry.register(
            "tokenscope_records_dropped",
            "Records and engine updates refused before the store queue, by reason (queue full, shutting down)",
            records_dropped.clone(),
        );
        registry.register(
            "tokenscope_records_lost",
            "Accepted records that were never stored, by reason; stays 0 unless the spool cap is hit (spool_full), the disk fails and the in-memory hold is full (hold_full) or still holds them at the shutdown deadline (shutdown), there is no spool, or the store rejects the data",
            records_lost.clone(),
        );
        registry.register(
            "tokenscope_records_queued",
            "Records waiting in memory in the store pipeline (queue depth; spooled records excluded)",
            records_queued.clone(),
        );
        registry.register(
            "tokenscope_records_spooled",
            "Records spilled to the on-disk spool because the store was slow, failing or down",
            records_spooled.clone(),
        );
        registry.register(
            "tokenscope_records_replayed",
            "Records written to the store from the spool",
            records_replayed.clone(),
        );
        registry.register(
            "tokenscope_store_errors",
            "Failed store calls, by kind (each failed batch is spooled or retried)",
            store_errors.clone(),
        );
        registry.register(
            "tokenscope_store_retries",
            "Retries of failed batches (replay attempts of the spool included)",
            store_retries.clone(),
        );
        registry.register_with_unit(
            "tokenscope_spool",
            "Unsent bytes in the on-disk spool",
            Unit::Bytes,
            spool_bytes.clone(),
        );
        registry.register(
            "tokenscope_spool_batches",
            "Unsent batches in the on-disk spool",
            spool_batches.clone(),
        );
        registry.register_with_unit(
            "tokenscope_spool_oldest_unsent_age",
            "Age of the oldest unsent batch in the spool (0 when empty)",
            Unit::Seconds,
            spool_oldest_age.clone(),
        );
        registry.register(
            "tokenscope_store_up",
            "1 while the store accepts writes, 0 after a failed write until the spool is replayed",
            store_up.clone(),
        );
        registry.register_with_unit(
            "tokenscope_store_write",
            "Latency of one batch write to the store",
            Unit::Seconds,
            store_write.clone(),
        );
        registry.register_with_unit(
            "tokenscope_gateway_overhead",
            "Time from arrival to the request leaving for the upstream",
            Unit::Seconds,
            gateway_overhead.clone(),
        );
        registry.register_with_unit(
            "tokenscope_response",
            "Response body bytes forwarded to clients",
            Unit::Bytes,
            upstream_bytes.clone(),
        );
        let traces = Family::<TraceDecisionLabels, Counter>::default();
        let trace_spans_exported = Counter::default();
        let trace_spans_dropped = Family::<ReasonLabels, Counter>::default();
        let trace_export_errors = Family::<KindLabels, Counter>::default();
        let trace_queue_spans = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        registry.register(
            "tokenscope_traces",
            "Finished requests by tail-sampling decision and reason (only while trace export is on)",
            traces.clone(),
        );
        registry.register(
            "tokenscope_trace_spans_exported",
            "Spans accepted by the OTLP collector",
            trace_spans_exported.clone(),
        );
        registry.register(
            "tokenscope_trace_spans_dropped",
            "Spans of kept traces that were not exported, by reason",
            trace_spans_dropped.clone(),
        );
        registry.register(
            "tokenscope_trace_export_errors",
            "Failed OTLP export attempts, by kind (transport, timeout, status_retryable, status_rejected)",
            trace_export_errors.clone(),
        );
        registry.register(
            "tokenscope_trace_queue_spans",
            "Spans queued for export or being exported (bounded by tracing.queue_spans)",
            trace_queue_spans.clone(),
        );
        let budget_usage = Family::<BusinessLineLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "llm_budget_usage_ratio",
            "Used / budget of the current budget period per business line (the largest ratio when a line has several budgets; 1 = budget spent)",
            budget_usage.clone(),
        );
        // Every drop reason exists from the start, so `rate()` alerts see the first drop.
        for reason in DROP_REASONS {
            let _ = records_dropped.get_or_create(&ReasonLabels { reason });
        }
        for reason in LOSS_REASONS {
            let _ = records_lost.get_or_create(&ReasonLabels { reason });
        }
        for kind in STORE_ERROR_KINDS {
            let _ = store_errors.get_or_create(&KindLabels { kind });
        }
        Self {
            registry,
            models: ModelLabeler::new(cfg.max_models),
            request_types: ModelLabeler::new(cfg.max_request_types),
            users: UserLabeler::new(cfg.user_label),
            business_lines: ModelLabeler::new(cfg.max_business_lines),
            phases,
            line_tokens,
            cost_usd,
            request_latency,
            ttft,
            tpot,
            tokens,
            requests,
            in_flight,
            records_enqueued,
            records_written,
            records_dropped,
            records_queued,
            store_write,
            records_lost,
            records_spooled,
            records_replayed,
            records_duplicate,
            records_held,
            store_reopened,
            store_errors,
            store_retries,
            spool_bytes,
            spool_batches,
            spool_oldest_age,
            store_up,
            gateway_overhead,
            upstream_bytes,
            token_mismatch,
            updates_unmatched,
            traces,
            trace_spans_exported,
            trace_spans_dropped,
            trace_export_errors,
            trace_queue_spans,
            budget_usage,
        }
    }

    /// Sets `llm_budget_usage_ratio{business_line}`.
    pub fn set_budget_usage_ratio(&self, business_line: &str, ratio: f64) {
        self.budget_usage
            .get_or_create(&BusinessLineLabels {
                business_line: business_line.to_owned(),
            })
            .set(ratio);
    }

    /// The bounded label for a model name.
    pub fn model_label(&self, model: &str) -> String {
        self.models.label(model)
    }

    /// Reserves model labels for the models the upstreams serve (config names, their
    /// `/v1/models`): client-chosen names cannot take them ([`ModelLabeler`]). Returns how
    /// many were newly reserved.
    pub fn reserve_models<S: AsRef<str>>(&self, names: impl IntoIterator<Item = S>) -> usize {
        self.models.reserve(names)
    }

    /// Marks a request as started; the returned guard decrements `llm_requests_in_flight` when
    /// dropped (so a panic or cancellation cannot leak the gauge).
    pub fn start_request(&self, model: &str) -> InFlightGuard {
        let gauge = self
            .in_flight
            .get_or_create(&ModelLabels {
                model: self.models.label(model),
            })
            .clone();
        gauge.inc();
        InFlightGuard { gauge }
    }

    /// Pre-creates the trace metrics at 0 (called when trace export is turned on, so that
    /// they are absent when it is off).
    pub fn enable_trace_metrics(&self) {
        for reason in TRACE_KEEP_REASONS {
            let _ = self.traces.get_or_create(&TraceDecisionLabels {
                decision: "kept",
                reason,
            });
        }
        let _ = self.traces.get_or_create(&TraceDecisionLabels {
            decision: "dropped",
            reason: "none",
        });
        for reason in SPAN_DROP_REASONS {
            let _ = self
                .trace_spans_dropped
                .get_or_create(&ReasonLabels { reason });
        }
    }

    /// One tail-sampling decision (`reason` `None` = dropped).
    pub fn trace_decision(&self, reason: Option<&'static str>) {
        let labels = match reason {
            Some(reason) => TraceDecisionLabels {
                decision: "kept",
                reason,
            },
            None => TraceDecisionLabels {
                decision: "dropped",
                reason: "none",
            },
        };
        self.traces.get_or_create(&labels).inc();
    }

    /// Spans accepted by the collector.
    pub fn trace_spans_exported(&self, n: u64) {
        self.trace_spans_exported.inc_by(n);
    }

    /// Spans of kept traces given up.
    pub fn trace_spans_dropped(&self, reason: &'static str, n: u64) {
        self.trace_spans_dropped
            .get_or_create(&ReasonLabels { reason })
            .inc_by(n);
    }

    /// One failed export attempt.
    pub fn trace_export_error(&self, kind: &'static str) {
        self.trace_export_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// Spans queued or being exported.
    pub fn trace_queue_spans(&self, n: usize) {
        self.trace_queue_spans
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Records a finished request in every request-level metric. `trace_id` is the request's
    /// trace id when its trace is kept: it becomes the exemplar of the latency, TTFT and TPOT
    /// observations. Returns the user's bucket label (as used on `llm_tokens_total`).
    pub fn observe(&self, rec: &RequestRecord, trace_id: Option<&str>) -> String {
        let exemplar = || {
            trace_id.map(|t| TraceExemplar {
                trace_id: t.to_owned(),
            })
        };
        let now = trace_id.map(|_| std::time::SystemTime::now());
        let model = self.models.label(&rec.model);
        let request_type = self.request_types.label(&rec.request_type);
        let status = rec.outcome.as_str();
        let req = RequestLabels {
            model: model.clone(),
            request_type,
            status,
        };
        self.request_latency.get_or_create(&req).observe(
            rec.total_duration_ms / 1000.0,
            exemplar(),
            now,
        );
        self.requests.get_or_create(&req).inc();
        if let Some(ttft) = rec.ttft_ms {
            self.ttft
                .get_or_create(&TtftLabels {
                    model: model.clone(),
                    input_bucket: rec.input_bucket.map_or("unknown", |b| b.as_str()),
                })
                .observe(ttft / 1000.0, exemplar(), now);
        }
        if let Some(tpot) = rec.tpot_ms {
            self.tpot
                .get_or_create(&ModelLabels {
                    model: model.clone(),
                })
                .observe(tpot / 1000.0, exemplar(), now);
        }
        let user_bucket = self.users.label(
            rec.user_id.as_deref(),
            rec.input_tokens.unwrap_or(0) + rec.output_tokens.unwrap_or(0),
        );
        for (token_type, n) in [
            ("input", rec.input_tokens),
            ("output", rec.output_tokens),
            ("cached", rec.cached_tokens),
        ] {
            if let Some(n) = n.filter(|n| *n > 0) {
                self.tokens
                    .get_or_create(&TokenLabels {
                        model: model.clone(),
                        token_type,
                        user_bucket: user_bucket.clone(),
                    })
                    .inc_by(n);
            }
        }
        for (phase, v) in [
            ("queue", rec.queue_duration_ms),
            ("prefill", rec.prefill_duration_ms),
            ("decode", rec.decode_duration_ms),
        ] {
            if let Some(ms) = v {
                self.observe_phase_labelled(&model, phase, ms);
            }
        }
        let line = self
            .business_lines
            .label(rec.business_line.as_deref().unwrap_or("none"));
        for (token_type, n) in [
            ("input", rec.input_tokens),
            ("output", rec.output_tokens),
            ("cached", rec.cached_tokens),
        ] {
            if let Some(n) = n.filter(|n| *n > 0) {
                self.line_tokens
                    .get_or_create(&LineTokenLabels {
                        business_line: line.clone(),
                        token_type,
                    })
                    .inc_by(n);
            }
        }
        if let Some(usd) = rec.cost_usd.filter(|c| c.is_finite() && *c >= 0.0) {
            self.cost_usd
                .get_or_create(&CostLabels {
                    model: model.clone(),
                    business_line: line,
                })
                .inc_by(usd);
        }
        if let Some(o) = rec.gateway_overhead_ms {
            self.gateway_overhead.observe(o / 1000.0);
        }
        user_bucket
    }

    /// Observes one phase of a request whose value arrived after its record was final (an
    /// engine span joined later); `phase` is `queue`, `prefill` or `decode`. The caller makes
    /// sure a request's phase is observed once.
    pub fn observe_phase(&self, model: &str, phase: &'static str, ms: f64) {
        let model = self.models.label(model);
        self.observe_phase_labelled(&model, phase, ms);
    }

    fn observe_phase_labelled(&self, model: &str, phase: &'static str, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            self.phases
                .get_or_create(&PhaseLabels {
                    model: model.to_owned(),
                    phase,
                })
                .observe(ms / 1000.0);
        }
    }

    /// The entry tokenizer count of a request disagreed with the engine's usage.
    pub fn token_count_mismatch(&self, model: &str) {
        self.token_mismatch
            .get_or_create(&ModelLabels {
                model: self.models.label(model),
            })
            .inc();
    }

    /// Late engine updates that never found their record.
    pub fn engine_update_unmatched(&self, reason: &str, n: u64) {
        self.updates_unmatched
            .get_or_create(&UnmatchedLabels {
                reason: reason.to_owned(),
            })
            .inc_by(n);
    }

    /// Adds forwarded response bytes.
    pub fn add_response_bytes(&self, n: u64) {
        self.upstream_bytes.inc_by(n);
    }

    /// A record entered the store pipeline.
    pub fn record_enqueued(&self) {
        self.records_enqueued.inc();
        self.records_queued.inc();
    }

    /// A record was dropped for `reason` before reaching the store.
    pub fn record_dropped(&self, reason: &'static str, rows: u64, was_queued: bool) {
        self.records_dropped
            .get_or_create(&ReasonLabels { reason })
            .inc_by(rows);
        if was_queued {
            self.records_queued.dec_by(rows as i64);
        }
    }

    /// A batch of `rows` was written in `latency`; `replayed` when it came from the spool (its
    /// rows had already left the in-memory queue gauge).
    pub fn records_written(&self, rows: u64, latency: Duration, replayed: bool) {
        self.records_written.inc_by(rows);
        if replayed {
            self.records_replayed.inc_by(rows);
        } else {
            self.records_queued.dec_by(rows as i64);
        }
        self.store_write.observe(latency.as_secs_f64());
    }

    /// `rows` delivered records were already in the store (not inserted again); `replayed`
    /// as for [`Metrics::records_written`].
    pub fn records_duplicate(&self, rows: u64, replayed: bool) {
        self.records_duplicate.inc_by(rows);
        if !replayed {
            self.records_queued.dec_by(rows as i64);
        }
    }

    /// Rows currently held in memory because neither the store nor the spool took them.
    pub fn records_held(&self, rows: u64) {
        self.records_held
            .set(i64::try_from(rows).unwrap_or(i64::MAX));
    }

    /// The store's writer reopened its file, for `reason` (one of [`REOPEN_REASONS`]).
    pub fn store_reopened(&self, reason: &'static str) {
        self.store_reopened
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// `rows` records left memory for the spool.
    pub fn records_spooled(&self, rows: u64) {
        self.records_spooled.inc_by(rows);
        self.records_queued.dec_by(rows as i64);
    }

    /// `rows` accepted records were lost for `reason` (one of [`LOSS_REASONS`]);
    /// `in_memory` when they were still counted in the queue gauge.
    pub fn records_lost(&self, reason: &'static str, rows: u64, in_memory: bool) {
        self.records_lost
            .get_or_create(&ReasonLabels { reason })
            .inc_by(rows);
        if in_memory {
            self.records_queued.dec_by(rows as i64);
        }
    }

    /// A store call failed, of `kind` (one of [`STORE_ERROR_KINDS`]).
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// A failed batch will be tried again.
    pub fn store_retry(&self) {
        self.store_retries.inc();
    }

    /// The spool's state: unsent bytes and batches, age of the oldest, store health.
    pub fn spool_state(&self, bytes: u64, batches: u64, oldest_age: Duration, store_up: bool) {
        self.spool_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.spool_batches
            .set(i64::try_from(batches).unwrap_or(i64::MAX));
        self.spool_oldest_age.set(oldest_age.as_secs_f64());
        self.store_up.set(i64::from(store_up));
    }

    /// Total records dropped before the queue or lost after it, all reasons.
    pub fn dropped_total(&self) -> u64 {
        let dropped: u64 = DROP_REASONS
            .into_iter()
            .map(|reason| {
                self.records_dropped
                    .get_or_create(&ReasonLabels { reason })
                    .get()
            })
            .sum();
        let lost: u64 = LOSS_REASONS
            .into_iter()
            .map(|reason| {
                self.records_lost
                    .get_or_create(&ReasonLabels { reason })
                    .get()
            })
            .sum();
        dropped + lost
    }

    /// Accepted records lost so far, by reason (every reason, zeros included).
    pub fn records_lost_totals(&self) -> Vec<(&'static str, u64)> {
        LOSS_REASONS
            .iter()
            .map(|reason| {
                (
                    *reason,
                    self.records_lost
                        .get_or_create(&ReasonLabels { reason })
                        .get(),
                )
            })
            .collect()
    }

    /// Whether the store accepts writes (`tokenscope_store_up == 1`).
    pub fn store_is_up(&self) -> bool {
        self.store_up.get() != 0
    }

    /// Encodes the registry in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Encodes the registry in the classic Prometheus text format (0.0.4), for scrapers and
    /// tools that do not negotiate OpenMetrics (e.g. `promtool check metrics`). See
    /// [`openmetrics_to_prometheus_text`].
    pub fn encode_prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.encode())
    }

    /// Registry access for other components that add their own metrics.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }
}

/// Converts OpenMetrics text (as prometheus-client writes it) to the Prometheus 0.0.4 text
/// format: counter families are named with their `_total` suffix in `# HELP`/`# TYPE`, `# UNIT`
/// and `# EOF` lines are dropped, exemplars (` # {...} v`) are removed from samples.
pub fn openmetrics_to_prometheus_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut pending_help: Option<(&str, &str)> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            pending_help = Some((name, help));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name_out, kind_out) = match kind {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "stateset" => (name.to_owned(), "gauge"),
                "unknown" => (name.to_owned(), "untyped"),
                k => (name.to_owned(), k),
            };
            if let Some((hname, help)) = pending_help.take() {
                if hname == name {
                    out.push_str(&format!("# HELP {name_out} {help}\n"));
                }
            }
            out.push_str(&format!("# TYPE {name_out} {kind_out}\n"));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let sample = match line.find(" # {") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(sample);
        out.push('\n');
    }
    out
}

/// Decrements `llm_requests_in_flight{model}` on drop.
#[derive(Debug)]
pub struct InFlightGuard {
    gauge: Gauge,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_core::{InputBucket, Outcome};

    fn rec(model: &str, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            model: model.into(),
            request_type: "chat".into(),
            outcome,
            total_duration_ms: 120.0,
            ttft_ms: Some(30.0),
            tpot_ms: Some(5.0),
            input_tokens: Some(10),
            output_tokens: Some(20),
            input_bucket: Some(InputBucket::B0To128),
            user_id: Some("alice".into()),
            ..Default::default()
        }
    }

    #[test]
    fn observe_updates_families() {
        let m = Metrics::new(MetricsConfig::default());
        {
            let _g = m.start_request("m1");
            assert!(m
                .encode()
                .contains("llm_requests_in_flight{model=\"m1\"} 1"));
        }
        m.observe(&rec("m1", Outcome::Ok), None);
        m.observe(&rec("m1", Outcome::Timeout), None);
        let text = m.encode();
        assert!(
            text.contains("llm_requests_in_flight{model=\"m1\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("llm_requests_total{model=\"m1\",request_type=\"chat\",status=\"ok\"} 1")
        );
        assert!(text.contains(
            "llm_requests_total{model=\"m1\",request_type=\"chat\",status=\"timeout\"} 1"
        ));
        assert!(text.contains("llm_ttft_seconds_count{model=\"m1\",input_bucket=\"0-128\"} 2"));
        assert!(text.contains("llm_tpot_seconds_count{model=\"m1\"} 2"));
        assert!(text.contains("token_type=\"output\""));
        assert!(!text.contains("alice"), "user ids must not be labels");
    }

    #[test]
    fn phases_business_lines_and_cost() {
        let m = Metrics::new(MetricsConfig {
            max_business_lines: 1,
            ..MetricsConfig::default()
        });
        let mut a = rec("m1", Outcome::Ok);
        a.queue_duration_ms = Some(4.0);
        a.prefill_duration_ms = Some(20.0);
        a.business_line = Some("search".into());
        a.cost_usd = Some(0.25);
        m.observe(&a, None);
        let mut b = rec("m1", Outcome::Ok);
        b.business_line = Some("ads".into()); // beyond max_business_lines → other
        b.cost_usd = Some(0.5);
        m.observe(&b, None);
        m.observe_phase("m1", "decode", 90.0);
        let text = m.encode_prometheus_text();
        for want in [
            "llm_request_phase_seconds_count{model=\"m1\",phase=\"queue\"} 1",
            "llm_request_phase_seconds_bucket{le=\"0.005\",model=\"m1\",phase=\"queue\"} 1",
            "llm_request_phase_seconds_sum{model=\"m1\",phase=\"prefill\"} 0.02",
            "llm_request_phase_seconds_count{model=\"m1\",phase=\"decode\"} 1",
            "llm_business_line_tokens_total{business_line=\"search\",token_type=\"input\"} 10",
            "llm_business_line_tokens_total{business_line=\"other\",token_type=\"output\"} 20",
            "llm_cost_usd_total{model=\"m1\",business_line=\"search\"} 0.25",
            "llm_cost_usd_total{model=\"m1\",business_line=\"other\"} 0.5",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
    }

    #[test]
    fn prometheus_text_conversion() {
        let m = Metrics::new(MetricsConfig::default());
        m.observe(&rec("m1", Outcome::Ok), None);
        let text = m.encode_prometheus_text();
        assert!(text.contains("# TYPE llm_requests_total counter\n"));
        assert!(text.contains("# HELP llm_requests_total "));
        assert!(text.contains("# TYPE llm_ttft_seconds histogram\n"));
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("# UNIT"));
        assert!(text.contains("tokenscope_records_dropped_total{reason=\"queue_full\"} 0"));
        let om = "# HELP x_seconds h\n# TYPE x_seconds histogram\n# UNIT x_seconds seconds\nx_seconds_bucket{le=\"1.0\"} 1 # {trace_id=\"ab\"} 0.5\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus_text(om),
            "# HELP x_seconds h\n# TYPE x_seconds histogram\nx_seconds_bucket{le=\"1.0\"} 1\n"
        );
    }

    #[test]
    fn kept_traces_become_exemplars() {
        let m = Metrics::new(MetricsConfig::default());
        m.enable_trace_metrics();
        m.observe(&rec("m1", Outcome::Ok), None);
        let tid = "4bf92f3577b34da6a3ce929d0e0e4736";
        m.observe(&rec("m1", Outcome::Ok), Some(tid));
        m.trace_decision(Some("slow"));
        m.trace_decision(None);
        let text = m.encode();
        let ex = format!("# {{trace_id=\"{tid}\"}}");
        for family in [
            "llm_request_latency_seconds_bucket",
            "llm_ttft_seconds_bucket",
            "llm_tpot_seconds_bucket",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(family) && l.contains(&ex))
                .unwrap_or_else(|| panic!("no exemplar on {family}: {text}"));
            // The exemplar sits on the bucket the value fell in: value within the bucket's bound.
            let value: f64 = line
                .rsplit(' ')
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("exemplar value with timestamp: {line}"));
            assert!(value > 0.0, "{line}");
        }
        assert!(
            text.contains("tokenscope_traces_total{decision=\"kept\",reason=\"slow\"} 1"),
            "{text}"
        );
        assert!(text.contains("tokenscope_traces_total{decision=\"dropped\",reason=\"none\"} 1"));
        assert!(text.contains("tokenscope_trace_spans_dropped_total{reason=\"queue_full\"} 0"));
        // The classic format drops exemplars.
        assert!(!m.encode_prometheus_text().contains("trace_id"));
    }

    #[test]
    fn models_beyond_limit_become_other() {
        let m = Metrics::new(MetricsConfig {
            max_models: 2,
            ..MetricsConfig::default()
        });
        for name in ["a", "b", "c", "d"] {
            m.observe(&rec(name, Outcome::Ok), None);
        }
        let text = m.encode();
        assert!(text.contains("model=\"a\""));
        assert!(text.contains("model=\"b\""));
        assert!(!text.contains("model=\"c\""));
        assert!(text.contains("model=\"other\""));
    }
}
