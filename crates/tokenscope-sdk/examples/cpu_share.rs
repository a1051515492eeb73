//! CPU share of the instrumentation at a paced load: 500 requests/s × 200 output tokens
//! (100 000 token events/s), decode steps every 10 ms, about 1 000 requests in flight.
//!
//! Three runs of the same engine loop: `none` (the loop's own bookkeeping), `sdk` (tracker +
//! step API + a Prometheus exporter on the exporter thread), `naive` (a labelled Prometheus
//! histogram observed synchronously per token, plus TTFT and e2e histograms per request). Each
//! run's CPU time is read from `/proc/thread-self/schedstat` (ns on CPU, Linux) for the engine
//! thread and, for `sdk`, from the exporter thread's `schedstat`; the share is
//! `(cpu(variant) − cpu(none)) / wall`, as a percentage of one core.
//!
//! Run: `cargo run --release -p tokenscope-sdk --example cpu_share -- [seconds]` (default 10).

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use std::time::{Duration, Instant};
use tokenscope_sdk::prometheus::{PrometheusExporter, Registry};
use tokenscope_sdk::{
    spawn_exporters, Clock, Exporter, FinishReason, PipelineConfig, RequestHandle, RequestInfo,
    StepEntry, Tracker, TrackerConfig, Work,
};

const QPS: u64 = 500;
const TOKENS: u32 = 200;
const STEP: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    None,
    Sdk,
    Naive,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct Labels {
    model: String,
}

struct Live {
    left: u32,
    h: Option<RequestHandle>,
    arrival: Instant,
    last: Instant,
}

/// ns this thread has spent on a CPU.
fn thread_cpu_ns() -> u64 {
    schedstat("/proc/thread-self/schedstat")
}

fn schedstat(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// CPU ns of the thread named `name` in this process.
fn named_thread_cpu_ns(name: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.trim() == name.chars().take(15).collect::<String>())
        })
        .map(|e| schedstat(&e.path().join("schedstat").to_string_lossy()))
        .sum()
}

/// Runs the loop for `secs`; returns (engine CPU ns, exporter CPU ns, wall ns, token events).
fn run(variant: Variant, secs: u64) -> (u64, u64, u64, u64) {
    let mut registry = Registry::default();
    let mut tracker = (variant == Variant::Sdk).then(|| {
        let prom = PrometheusExporter::register(&mut registry);
        let exporters: Vec<Box<dyn Exporter>> = vec![Box::new(prom)];
        let (sink, thread) =
            spawn_exporters(PipelineConfig::default(), exporters).expect("exporter thread");
        (
            Tracker::with_sink(TrackerConfig::default(), Clock::new(), sink),
            thread,
        )
    });
    let model = tracker.as_mut().map(|(t, _)| t.model("llama-3-8b"));
    let itl: Family<Labels, Histogram, fn() -> Histogram> =
        Family::new_with_constructor(|| Histogram::new(tokenscope_telemetry::TPOT_BUCKETS));
    let ttft: Family<Labels, Histogram, fn() -> Histogram> =
        Family::new_with_constructor(|| Histogram::new(tokenscope_telemetry::TTFT_BUCKETS));
    let e2e: Family<Labels, Histogram, fn() -> Histogram> =
        Family::new_with_constructor(|| Histogram::new(tokenscope_telemetry::LATENCY_BUCKETS));
    let labels = Labels {
        model: "llama-3-8b".to_owned(),
    };
    let mut live: Vec<Live> = Vec::new();
    let mut entries: Vec<StepEntry> = Vec::new();
    let per_step = QPS * STEP.as_millis() as u64 / 1000;
    let steps = secs * 1000 / STEP.as_millis() as u64;
    let mut events = 0u64;
    let cpu0 = thread_cpu_ns();
    let wall0 = Instant::now();
    let mut next = wall0;
    for _ in 0..steps {
        next += STEP;
        let start = Instant::now();
        let ts = tracker.as_ref().map_or(0, |(t, _)| t.clock().at(start));
        for _ in 0..per_step {
            let h = tracker.as_mut().zip(model).map(|((t, _), m)| {
                let h = t.arrive_at(ts, RequestInfo::new(m, 512));
                t.schedule_at(h, ts);
                h
            });
            live.push(Live {
                left: TOKENS,
                h,
                arrival: start,
                last: start,
            });
        }
        // The step: new requests prefill and sample their first token, the others decode.
        std::hint::black_box(&live);
        let end = Instant::now();
        let te = tracker.as_ref().map_or(0, |(t, _)| t.clock().at(end));
        entries.clear();
        for r in &mut live {
            let first = r.left == TOKENS;
            r.left -= 1;
            events += 1;
            match variant {
                Variant::Sdk => {
                    if let Some(h) = r.h {
                        let work = if first {
                            Work::prefill_last(512)
                        } else {
                            Work::decode()
                        };
                        entries.push(StepEntry::new(h, work));
                    }
                }
                Variant::Naive => {
                    if first {
                        ttft.get_or_create(&labels)
                            .observe(end.duration_since(r.arrival).as_secs_f64());
                    } else {
                        itl.get_or_create(&labels)
                            .observe(end.duration_since(r.last).as_secs_f64());
                    }
                }
                Variant::None => {}
            }
            r.last = end;
        }
        if let Some((t, _)) = tracker.as_mut() {
            t.step_at(ts, te, &entries);
        }
        live.retain(|r| {
            let done = r.left == 0;
            if done {
                match variant {
                    Variant::Sdk => {
                        if let (Some((t, _)), Some(h)) = (tracker.as_mut(), r.h) {
                            t.finish_at(h, te, FinishReason::Length);
                        }
                    }
                    Variant::Naive => e2e
                        .get_or_create(&labels)
                        .observe(end.duration_since(r.arrival).as_secs_f64()),
                    Variant::None => {}
                }
            }
            !done
        });
        if let Some((t, _)) = tracker.as_mut() {
            t.tick_at(te);
        }
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
    }
    let wall = u64::try_from(wall0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let cpu = thread_cpu_ns() - cpu0;
    let exporter = named_thread_cpu_ns("tokenscope-sdk-export");
    if let Some((t, thread)) = tracker {
        drop(t);
        thread.join();
    }
    (cpu, exporter, wall, events)
}

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let (base, _, wall_b, ev) = run(Variant::None, secs);
    println!(
        "none : engine {:.3} % of a core ({} token events in {:.1} s)",
        base as f64 / wall_b as f64 * 100.0,
        ev,
        wall_b as f64 / 1e9
    );
    for (name, v) in [("sdk  ", Variant::Sdk), ("naive", Variant::Naive)] {
        let (cpu, exp, wall, events) = run(v, secs);
        let extra = cpu.saturating_sub(base) as f64;
        println!(
            "{name}: engine {:.3} % (+{:.3} % over none, {:.1} ns/token event), exporter thread {:.3} %",
            cpu as f64 / wall as f64 * 100.0,
            extra / wall as f64 * 100.0,
            extra / events as f64,
            exp as f64 / wall as f64 * 100.0,
        );
    }
}
