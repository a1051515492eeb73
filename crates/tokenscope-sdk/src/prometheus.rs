//! Prometheus exporter: the gateway's request metrics, fed from the engine.
//!
//! Invariants:
//! * Same names, label names, bucket boundaries and types as the gateway
//!   (`tokenscope-telemetry`): `llm_request_latency_seconds{model,request_type,status}`,
//!   `llm_ttft_seconds{model,input_bucket}`, `llm_tpot_seconds{model}`,
//!   `llm_tokens_total{model,token_type,user_bucket}`, `llm_requests_total{model,request_type,status}`,
//!   `llm_request_phase_seconds{model,phase}` (queue / prefill / decode; the families are
//!   registered by `tokenscope_telemetry::RequestFamilies`, the gateway's own code)
//!   — so dashboards and alert rules work unchanged on an engine's `/metrics`. The engine has
//!   no user: `user_bucket` is `anonymous`, as the gateway labels requests without a user.
//! * Updated on the exporter thread only, one batch at a time; the engine thread never
//!   touches the registry. Output tokens are counted as they are generated (per flush),
//!   input tokens when the request finishes.
//! * Model labels are bounded like the gateway's (first 50 names, then `other`).
//! * `tokenscope_sdk_batches_dropped_total` / `tokenscope_sdk_requests_dropped_total` count
//!   what the engine dropped because this thread fell behind.
//!
//! ```
//! use tokenscope_sdk::prometheus::{encode, PrometheusExporter, Registry};
//! use tokenscope_sdk::{spawn_exporters, Clock, FinishReason, PipelineConfig, RequestInfo};
//! use tokenscope_sdk::{Tracker, TrackerConfig};
//!
//! let mut registry = Registry::default();
//! let prom = PrometheusExporter::register(&mut registry);
//! let (sink, thread) = spawn_exporters(PipelineConfig::default(), vec![Box::new(prom)])?;
//! let mut t = Tracker::with_sink(TrackerConfig::default(), Clock::new(), sink);
//! let m = t.model("llama");
//! let h = t.arrive_at(0, RequestInfo::new(m, 1000).request_type("chat"));
//! t.schedule_at(h, 5_000_000);
//! t.token_at(h, 60_000_000); // TTFT 60 ms
//! t.token_at(h, 80_000_000);
//! t.finish_at(h, 80_000_000, FinishReason::Stop);
//! drop(t); // final flush
//! thread.join();
//! let text = encode(&registry);
//! assert!(text.contains(
//!     r#"llm_ttft_seconds_bucket{le="0.1",model="llama",input_bucket="512-2048"} 1"#
//! ));
//! assert!(text.contains(r#"llm_requests_total{model="llama",request_type="chat",status="ok"} 1"#));
//! # Ok::<(), tokenscope_sdk::SdkError>(())
//! ```

use crate::pipeline::{Batch, Exporter, SinkStats};
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use tokenscope_core::InputBucket;
use tokenscope_telemetry::{
    ModelLabeler, ModelLabels, PhaseLabels, RequestFamilies, RequestLabels, SeenBy, TokenLabels,
    TraceExemplar, TtftLabels,
};

/// `user_bucket` of engine-side token counts (the gateway's label for an unknown user).
pub const USER_BUCKET: &str = "anonymous";

/// Feeds the gateway's `llm_*` metrics from finished requests. Register it in the engine's
/// registry with [`PrometheusExporter::register`].
pub struct PrometheusExporter {
    models: ModelLabeler,
    /// The gateway's request-level families (names, units, buckets: tokenscope-telemetry).
    f: RequestFamilies,
    batches_dropped: Counter,
    requests_dropped: Counter,
    sink: Option<Arc<SinkStats>>,
    seen_dropped: (u64, u64),
}

impl PrometheusExporter {
    /// Registers the metrics in `registry` (the engine's own `/metrics` registry).
    pub fn register(registry: &mut Registry) -> Self {
        let f = RequestFamilies::register(registry, SeenBy::Engine);
        let batches_dropped = Counter::default();
        let requests_dropped = Counter::default();
        registry.register(
            "tokenscope_sdk_batches_dropped",
            "Tracker flushes dropped because the exporter thread fell behind (bounded channel full)",
            batches_dropped.clone(),
        );
        registry.register(
            "tokenscope_sdk_requests_dropped",
            "Finished requests inside dropped flushes (missing from these metrics)",
            requests_dropped.clone(),
        );
        Self {
            models: ModelLabeler::new(50),
            f,
            batches_dropped,
            requests_dropped,
            sink: None,
            seen_dropped: (0, 0),
        }
    }

    /// Also reports the drops of this sink (`spawn_exporters`' [`SinkStats`]).
    pub fn with_sink_stats(mut self, stats: Arc<SinkStats>) -> Self {
        self.sink = Some(stats);
        self
    }

    fn apply(&mut self, batch: &Batch) {
        for d in &batch.tokens {
            let model = self.models.label(&d.model);
            for (token_type, n) in [("input", d.input), ("output", d.output)] {
                if n > 0 {
                    self.f
                        .tokens
                        .get_or_create(&TokenLabels {
                            model: model.clone(),
                            token_type,
                            user_bucket: USER_BUCKET.to_owned(),
                        })
                        .inc_by(n);
                }
            }
        }
        for f in &batch.finished {
            let model = self.models.label(&f.model);
            let exemplar = || f.trace_id_hex().map(|trace_id| TraceExemplar { trace_id });
            let now = f.trace.map(|_| std::time::SystemTime::now());
            let req = RequestLabels {
                model: model.clone(),
                request_type: f.request_type.to_owned(),
                status: f.reason.outcome().as_str(),
            };
            self.f.request_latency.get_or_create(&req).observe(
                f.e2e_ns() as f64 / 1e9,
                exemplar(),
                now,
            );
            self.f.requests.get_or_create(&req).inc();
            for (phase, ns) in [
                ("queue", f.queue_ns),
                ("prefill", f.prefill_ns),
                ("decode", f.decode_ns),
            ] {
                // ms first, then s: the gateway's arithmetic on the record's `*_duration_ms`.
                self.f
                    .phases
                    .get_or_create(&PhaseLabels {
                        model: model.clone(),
                        phase,
                    })
                    .observe(ns as f64 / 1e6 / 1000.0);
            }
            if let Some(ttft) = f.ttft_ns() {
                self.f
                    .ttft
                    .get_or_create(&TtftLabels {
                        model: model.clone(),
                        input_bucket: InputBucket::of(f.prompt_tokens).as_str(),
                    })
                    .observe(ttft as f64 / 1e9, exemplar(), now);
            }
            if let Some(tpot) = f.tpot_ns() {
                self.f.tpot.get_or_create(&ModelLabels { model }).observe(
                    tpot / 1e9,
                    exemplar(),
                    now,
                );
            }
        }
        if let Some(s) = &self.sink {
            let now = (s.dropped_batches(), s.dropped_requests());
            self.batches_dropped
                .inc_by(now.0.saturating_sub(self.seen_dropped.0));
            self.requests_dropped
                .inc_by(now.1.saturating_sub(self.seen_dropped.1));
            self.seen_dropped = now;
        }
    }
}

impl Exporter for PrometheusExporter {
    fn export(&mut self, batch: &Batch) {
        self.apply(batch);
    }
}

pub use prometheus_client::registry::Registry;
pub use tokenscope_telemetry::openmetrics_to_prometheus_text;

/// The registry in the OpenMetrics text format, as the gateway serves it (see
/// [`openmetrics_to_prometheus_text`] for the classic 0.0.4 format).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Clock, FinishReason, RequestInfo, Tracker, TrackerConfig, Work};
    use tokenscope_telemetry::{Metrics, MetricsConfig};

    /// The gateway's and the SDK's exposition of the same request agree line by line on the
    /// `llm_*` series (names, labels, buckets, values).
    #[test]
    fn same_series_as_the_gateway() {
        let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
        let m = t.model("llama");
        let h = t.arrive_at(0, RequestInfo::new(m, 300).request_type("chat"));
        t.step_at(
            20_000_000,
            70_000_000,
            &[crate::StepEntry::new(h, Work::prefill_last(300))],
        );
        for i in 1..=4u64 {
            t.token_at(h, 70_000_000 + i * 20_000_000);
        }
        t.finish_at(h, 150_000_000, FinishReason::Stop);
        let f = t.take_finished().remove(0);
        let batch = Batch {
            at_ns: 150_000_000,
            tokens: vec![crate::TokenDelta {
                model: f.model.clone(),
                input: 300,
                output: 5,
            }],
            finished: vec![f.clone()],
        };
        let mut reg = Registry::default();
        let mut exp = PrometheusExporter::register(&mut reg);
        exp.export(&batch);
        let sdk = encode(&reg);

        let gw = Metrics::new(MetricsConfig::default());
        let mut rec = f.to_record();
        rec.user_id = None;
        gw.observe(&rec, None);
        let gw_text = gw.encode();
        let series = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| {
                    let name = l
                        .trim_start_matches("# TYPE ")
                        .trim_start_matches("# UNIT ");
                    [
                        "llm_request_latency",
                        "llm_ttft",
                        "llm_tpot",
                        "llm_tokens",
                        "llm_requests",
                        "llm_request_phase",
                    ]
                    .iter()
                    .any(|p| name.starts_with(p))
                        && !name.starts_with("llm_requests_in_flight")
                })
                .map(str::to_owned)
                .collect()
        };
        // Series order inside a family is a hash map's: compare as sets.
        let (mut a, mut b) = (series(&sdk), series(&gw_text));
        a.sort();
        b.sort();
        assert!(a.len() > 30, "{sdk}");
        assert_eq!(a, b, "sdk:\n{sdk}\ngateway:\n{gw_text}");
        assert!(sdk.contains(
            "llm_ttft_seconds_bucket{le=\"0.1\",model=\"llama\",input_bucket=\"128-512\"} 1"
        ));
        assert!(sdk.contains(
            "llm_tokens_total{model=\"llama\",token_type=\"output\",user_bucket=\"anonymous\"} 5"
        ));
        assert!(sdk.contains("llm_request_phase_seconds_count{model=\"llama\",phase=\"decode\"} 1"));
    }
}
