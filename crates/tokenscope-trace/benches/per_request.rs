//! Per-request cost of tracing on the request path: the W3C context at arrival, the tail
//! sampling decision at the end, and — for kept requests only — building the span tree and
//! handing it to the exporter queue.
//!
//! `cargo bench -p tokenscope-trace --bench per_request`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::sync::Arc;
use tokenscope_core::{Endpoint, InputBucket, Outcome, PhaseSource, RequestRecord, TokenSource};
use tokenscope_trace::{
    build_spans, ExporterConfig, KeepReason, NoopExportObserver, RequestTrace, SamplerConfig,
    SpanInput, SpanTimes, TailSampler, TraceExporter,
};

fn record() -> RequestRecord {
    RequestRecord {
        request_id: "0193a5c2-7b1e-7cc3-9a6e-3f1f2b9d8e11".into(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        created_at: 1_700_000_000_000_000,
        model: "llama-3-8b".into(),
        model_served: Some("llama-3-8b-instruct".into()),
        upstream: "vllm-a".into(),
        business_line: Some("search".into()),
        request_type: "chat".into(),
        endpoint: Endpoint::ChatCompletions,
        stream: true,
        http_status: 200,
        outcome: Outcome::Ok,
        finish_reason: Some("stop".into()),
        max_tokens: Some(256),
        input_tokens: Some(812),
        output_tokens: Some(40),
        cached_tokens: Some(512),
        input_tokens_source: TokenSource::Usage,
        output_tokens_source: TokenSource::Usage,
        input_bucket: Some(InputBucket::of(812)),
        queue_duration_ms: Some(20.0),
        queue_source: PhaseSource::Engine,
        prefill_duration_ms: Some(80.0),
        prefill_source: PhaseSource::Engine,
        decode_duration_ms: Some(280.0),
        decode_source: PhaseSource::Engine,
        ttft_ms: Some(102.0),
        tpot_ms: Some(7.0),
        total_duration_ms: 385.0,
        engine: Some("vllm".into()),
        ..RequestRecord::default()
    }
}

fn per_request(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let mut g = c.benchmark_group("trace_per_request");
    g.throughput(Throughput::Elements(1));
    g.bench_function("arrival: parse traceparent + new span ids", |b| {
        b.iter(|| {
            RequestTrace::start(black_box(Some(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )))
        })
    });
    let sampler = TailSampler::new(SamplerConfig::default());
    let rec = record();
    let trace = RequestTrace::start(None);
    g.bench_function("end: tail-sampling decision (P99 window update)", |b| {
        b.iter(|| sampler.decide(black_box(&rec), "llama-3-8b", &trace.trace_id))
    });
    let input = SpanInput {
        trace: &trace,
        times: SpanTimes {
            upstream_sent_ms: Some(0.4),
        },
        user_bucket: "u07",
        server: Some(("10.0.0.7", 8000)),
        reason: KeepReason::Ratio,
        response_id: None,
    };
    g.bench_function("kept: build 5 spans", |b| {
        b.iter(|| build_spans(black_box(&rec), &input))
    });
    // Submit into a real exporter whose endpoint is down: the queue hand-over (a span-budget
    // CAS and a channel send). Once the 262 144-span budget is used up, submissions are
    // refused and counted instead — the path a request takes while the collector is down.
    let exporter = rt.block_on(async {
        TraceExporter::spawn(
            ExporterConfig {
                endpoint: "http://127.0.0.1:9".into(),
                queue_spans: 1 << 18,
                ..ExporterConfig::default()
            },
            Arc::new(NoopExportObserver),
        )
        .expect("exporter")
    });
    g.bench_function("kept: build 5 spans + submit", |b| {
        b.iter(|| exporter.submit(build_spans(black_box(&rec), &input)))
    });
    g.finish();
}

criterion_group!(benches, per_request);
criterion_main!(benches);
