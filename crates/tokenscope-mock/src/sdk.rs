//! The mock's SDK exporters: the gateway's `llm_*` request metrics (appended to the mock's
//! `/metrics`), a ring of the last finished requests (served at `GET /debug/sdk/requests`) and,
//! with [`MockConfig::otlp_endpoint`], OTLP spans with vLLM's `gen_ai.latency.*` attributes for
//! every request that came with a `traceparent`.
//!
//! Invariant: everything here runs on the SDK's exporter thread; the engine task only hands
//! over one batch per flush (never blocks, drops counted by the SDK).

use crate::MockConfig;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use tokenscope_sdk::prometheus::{PrometheusExporter, Registry};
use tokenscope_sdk::{
    spawn_exporters, Batch, Clock, Exporter, FinishedRequest, PipelineConfig, Tracker,
    TrackerConfig,
};

/// Finished requests kept for `/debug/sdk/requests`.
pub(crate) const RING: usize = 10_000;

/// The last [`RING`] finished requests, oldest first.
pub(crate) type Ring = Arc<Mutex<VecDeque<Value>>>;

/// One finished request as `/debug/sdk/requests` shows it: integer nanoseconds of the tracker.
pub(crate) fn record_json(f: &FinishedRequest) -> Value {
    json!({
        "request_id": f.request_id,
        "trace_id": f.trace_id_hex(),
        "model": &*f.model,
        "finish_reason": f.reason.as_str(),
        "prompt_tokens": f.prompt_tokens,
        "output_tokens": f.output_tokens,
        "queue_ns": f.queue_ns,
        "prefill_ns": f.prefill_ns,
        "decode_ns": f.decode_ns,
        "e2e_ns": f.e2e_ns(),
        "ttft_ns": f.ttft_ns(),
        "tpot_ns": f.tpot_ns(),
        "prefill_chunks": f.prefill_chunks,
    })
}

/// Builds the tracker when the engine task starts: the ring exporter always, OTLP when
/// configured (an invalid endpoint is logged to stderr and OTLP stays off).
pub(crate) fn tracker_factory(
    cfg: &MockConfig,
    ring: Ring,
    prometheus: PrometheusExporter,
) -> Box<dyn FnOnce(Clock) -> Tracker + Send> {
    let otlp = cfg.otlp_endpoint.clone();
    let service = cfg.model.clone();
    Box::new(move |clock| {
        let mut exporters: Vec<Box<dyn Exporter>> = vec![Box::new(prometheus)];
        exporters.push(Box::new(move |b: &Batch| {
            let mut r = ring.lock();
            for f in &b.finished {
                if r.len() == RING {
                    r.pop_front();
                }
                r.push_back(record_json(f));
            }
        }));
        if let Some(endpoint) = otlp {
            let mut c = tokenscope_sdk::otlp::config(&endpoint, "tokenscope-mock");
            c.resource
                .push(("service.instance.id".to_owned(), service.clone()));
            match tokenscope_sdk::otlp::OtlpExporter::new(c) {
                Ok(e) => exporters.push(Box::new(e)),
                Err(e) => eprintln!("tokenscope mock-engine: OTLP export off: {e}"),
            }
        }
        match spawn_exporters(PipelineConfig::default(), exporters) {
            // The thread ends when the tracker (and its sink) is dropped with the engine task.
            Ok((sink, _thread)) => Tracker::with_sink(TrackerConfig::default(), clock, sink),
            Err(e) => {
                eprintln!("tokenscope mock-engine: SDK exporters off: {e}");
                Tracker::new(TrackerConfig::default(), clock)
            }
        }
    })
}

/// The SDK's Prometheus registry (engine-side `llm_*` metrics) and the exporter that feeds it.
pub(crate) fn prometheus() -> (Registry, PrometheusExporter) {
    let mut registry = Registry::default();
    let exporter = PrometheusExporter::register(&mut registry);
    (registry, exporter)
}

/// The registry in the Prometheus 0.0.4 text format (the mock's `/metrics` format).
pub(crate) fn render(registry: &Registry) -> String {
    tokenscope_sdk::prometheus::openmetrics_to_prometheus_text(&tokenscope_sdk::prometheus::encode(
        registry,
    ))
}
