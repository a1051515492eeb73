//! Cost of the SDK on the engine thread, against a naive baseline that observes a labelled
//! Prometheus histogram synchronously per token (what the article measured at 3–5 % CPU).
//!
//! * `token_event/*`: one token event. SDK: `Tracker::token_at` on one of 256 live requests
//!   in decode, flushing every 100 tokens to a real exporter thread (flush cost included).
//!   Naive: `Family<{model,token_type}, Histogram>::get_or_create(..).observe(itl)`.
//! * `lifecycle/*`: one request from arrival to finish with 200 output tokens (arrive,
//!   schedule, one prefill step that samples the first token, 199 token events, finish); the
//!   naive one observes per token and the request histograms at the end.
//! * `threads/*`: the same token event on N engine threads at once (each its own tracker; the
//!   naive baseline shares one registry, as a multi-threaded engine would).
//! * `exporter/prometheus_100_requests`: the exporter thread's cost for a batch of 100 finished
//!   requests (off the engine thread).
//!
//! Run: `cargo bench -p tokenscope-sdk --bench tracker -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_sdk::prometheus::PrometheusExporter;
use tokenscope_sdk::{
    spawn_exporters, Batch, Clock, Exporter, FinishReason, PipelineConfig, RequestHandle,
    RequestInfo, StepEntry, Tracker, TrackerConfig, Work,
};

const LIVE: usize = 256;
const EVENTS: u64 = 10_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    model: String,
    token_type: &'static str,
}

type HistFamily = Family<TokenLabels, Histogram, fn() -> Histogram>;

fn naive_family(registry: &mut Registry) -> HistFamily {
    fn mk() -> Histogram {
        Histogram::new(tokenscope_telemetry::TPOT_BUCKETS)
    }
    let f: HistFamily = Family::new_with_constructor(mk);
    registry.register("llm_inter_token_latency_seconds", "naive", f.clone());
    f
}

/// A tracker with a real exporter thread (a no-op exporter) and `LIVE` requests in decode.
fn sdk_tracker() -> (Tracker, Vec<RequestHandle>, tokenscope_sdk::ExporterThread) {
    let exporters: Vec<Box<dyn Exporter>> = vec![Box::new(|b: &Batch| {
        black_box(b.tokens.len());
    })];
    let (sink, thread) =
        spawn_exporters(PipelineConfig::default(), exporters).expect("exporter thread");
    let mut t = Tracker::with_sink(TrackerConfig::default(), Clock::new(), sink);
    let m = t.model("llama-3-8b");
    let hs: Vec<RequestHandle> = (0..LIVE)
        .map(|_| t.arrive_at(0, RequestInfo::new(m, 100)))
        .collect();
    for &h in &hs {
        t.schedule_at(h, 1);
        t.token_at(h, 2);
    }
    (t, hs, thread)
}

fn token_event(c: &mut Criterion) {
    let mut g = c.benchmark_group("token_event");
    g.throughput(Throughput::Elements(EVENTS));
    {
        let (mut t, hs, _thread) = sdk_tracker();
        let mut now = 10u64;
        g.bench_function("sdk", |b| {
            b.iter(|| {
                for i in 0..EVENTS as usize {
                    now += 1_000;
                    t.token_at(hs[i % LIVE], black_box(now));
                }
            })
        });
    }
    for (name, flush_tokens, sink) in [
        ("sdk_flush_every_1000_tokens", 1000u32, true),
        ("sdk_without_sink", 100, false),
    ] {
        let cfg = TrackerConfig {
            flush_tokens,
            ..TrackerConfig::default()
        };
        let exporters: Vec<Box<dyn Exporter>> = vec![Box::new(|b: &Batch| {
            black_box(b.tokens.len());
        })];
        let (s, _thread) = spawn_exporters(PipelineConfig::default(), exporters).expect("thread");
        let mut t = if sink {
            Tracker::with_sink(cfg, Clock::new(), s)
        } else {
            Tracker::new(cfg, Clock::new())
        };
        let m = t.model("llama-3-8b");
        let hs: Vec<RequestHandle> = (0..LIVE)
            .map(|_| t.arrive_at(0, RequestInfo::new(m, 100)))
            .collect();
        let mut now = 10u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                for i in 0..EVENTS as usize {
                    now += 1_000;
                    t.token_at(hs[i % LIVE], black_box(now));
                }
            })
        });
    }
    {
        // The step API: one `step_at` with LIVE decode entries (one token each) per step.
        let (mut t, hs, _thread) = sdk_tracker();
        let entries: Vec<StepEntry> = hs
            .iter()
            .map(|&h| StepEntry::new(h, Work::decode()))
            .collect();
        let mut now = 10u64;
        g.throughput(Throughput::Elements(LIVE as u64 * 40));
        g.bench_function("sdk_step_api", |b| {
            b.iter(|| {
                for _ in 0..40 {
                    t.step_at(now, now + 1_000, black_box(&entries));
                    now += 1_000;
                }
            })
        });
        g.throughput(Throughput::Elements(EVENTS));
    }
    {
        let mut reg = Registry::default();
        let fam = naive_family(&mut reg);
        let mut last = vec![0u64; LIVE];
        let labels = TokenLabels {
            model: "llama-3-8b".to_owned(),
            token_type: "output",
        };
        let mut now = 10u64;
        g.bench_function("naive_prometheus_labels_built_per_token", |b| {
            b.iter(|| {
                for i in 0..EVENTS as usize {
                    now += 1_000;
                    let itl = (black_box(now) - last[i % LIVE]) as f64 / 1e9;
                    last[i % LIVE] = now;
                    fam.get_or_create(&TokenLabels {
                        model: black_box("llama-3-8b").to_owned(),
                        token_type: "output",
                    })
                    .observe(itl);
                }
            })
        });
        g.bench_function("naive_prometheus", |b| {
            b.iter(|| {
                for i in 0..EVENTS as usize {
                    now += 1_000;
                    let itl = (black_box(now) - last[i % LIVE]) as f64 / 1e9;
                    last[i % LIVE] = now;
                    fam.get_or_create(&labels).observe(itl);
                }
            })
        });
    }
    g.finish();
}

fn lifecycle(c: &mut Criterion) {
    let mut g = c.benchmark_group("lifecycle");
    g.throughput(Throughput::Elements(1));
    {
        let (mut t, _hs, _thread) = sdk_tracker();
        let m = t.model("llama-3-8b");
        let mut now = 10u64;
        g.bench_function("sdk_200_tokens", |b| {
            b.iter(|| {
                let h = t.arrive_at(now, RequestInfo::new(m, 512));
                t.schedule_at(h, now + 10);
                t.step_at(
                    now + 10,
                    now + 100,
                    &[StepEntry::new(h, Work::prefill_last(512))],
                );
                for k in 1..200u64 {
                    t.token_at(h, now + 100 + k * 10);
                }
                t.finish_at(h, now + 2_100, FinishReason::Stop);
                now += 3_000;
            })
        });
    }
    {
        let mut reg = Registry::default();
        let fam = naive_family(&mut reg);
        let ttft: Family<TokenLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(tokenscope_telemetry::TTFT_BUCKETS));
        let e2e: Family<TokenLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(tokenscope_telemetry::LATENCY_BUCKETS));
        let labels = TokenLabels {
            model: "llama-3-8b".to_owned(),
            token_type: "output",
        };
        let mut now = 10u64;
        g.bench_function("naive_prometheus_200_tokens", |b| {
            b.iter(|| {
                let arrival = black_box(now);
                let mut last = now + 100;
                ttft.get_or_create(&labels)
                    .observe((last - arrival) as f64 / 1e9);
                for k in 1..200u64 {
                    let t = black_box(now + 100 + k * 10);
                    fam.get_or_create(&labels).observe((t - last) as f64 / 1e9);
                    last = t;
                }
                e2e.get_or_create(&labels)
                    .observe((last - arrival) as f64 / 1e9);
                now += 3_000;
            })
        });
    }
    g.finish();
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    for n in [1usize, 2, 4] {
        g.throughput(Throughput::Elements(n as u64 * EVENTS));
        g.bench_with_input(BenchmarkId::new("sdk", n), &n, |b, &n| {
            // Wall time of the slowest thread, setup excluded.
            b.iter_custom(|iters| {
                std::thread::scope(|s| {
                    let hs: Vec<_> = (0..n)
                        .map(|_| {
                            s.spawn(move || {
                                let (mut t, hs, _thread) = sdk_tracker();
                                let mut now = 10u64;
                                let go = Instant::now();
                                for _ in 0..iters {
                                    for i in 0..EVENTS as usize {
                                        now += 1_000;
                                        t.token_at(hs[i % LIVE], black_box(now));
                                    }
                                }
                                go.elapsed()
                            })
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().unwrap_or_default())
                        .max()
                        .unwrap_or_default()
                })
            })
        });
        let mut reg = Registry::default();
        let fam = Arc::new(naive_family(&mut reg));
        g.bench_with_input(BenchmarkId::new("naive_prometheus", n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..n {
                        let fam = fam.clone();
                        s.spawn(move || {
                            let labels = TokenLabels {
                                model: "llama-3-8b".to_owned(),
                                token_type: "output",
                            };
                            let mut last = 0u64;
                            for _ in 0..iters {
                                for k in 0..EVENTS {
                                    let now = black_box(last + 1_000 + k % 7);
                                    fam.get_or_create(&labels)
                                        .observe((now - last) as f64 / 1e9);
                                    last = now;
                                }
                            }
                        });
                    }
                });
                start.elapsed()
            })
        });
    }
    g.finish();
}

fn exporter(c: &mut Criterion) {
    let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
    let m = t.model("llama-3-8b");
    for i in 0..100u64 {
        let h = t.arrive_at(i, RequestInfo::new(m, 100 + 10 * i));
        t.step_at(
            i + 10,
            i + 1_000_000,
            &[StepEntry::new(h, Work::prefill_last(100))],
        );
        for k in 1..200u64 {
            t.token_at(h, i + 1_000_000 + k * 20_000_000);
        }
        t.finish_at(h, i + 5_000_000_000, FinishReason::Stop);
    }
    let batch = Batch {
        at_ns: 0,
        tokens: Vec::new(),
        finished: t.take_finished(),
    };
    let mut reg = Registry::default();
    let mut exp = PrometheusExporter::register(&mut reg);
    let mut g = c.benchmark_group("exporter");
    g.throughput(Throughput::Elements(100));
    g.bench_function("prometheus_100_requests", |b| b.iter(|| exp.export(&batch)));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = token_event, lifecycle, threads, exporter
}
criterion_main!(benches);
