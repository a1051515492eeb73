//! A toy continuous-batching engine instrumented with tokenscope-sdk.
//!
//! The engine: requests arrive, wait for one of 4 slots, prefill their prompt in chunks that
//! share a 256-token budget per step, then decode one token per step until done. Every step
//! "runs" for a simulated duration (a busy wait). The instrumentation is every line that ends
//! with the marker comment `[sdk]` — 24 lines including imports, exporter setup and shutdown,
//! counted with `grep -c '// \[sdk\]$' crates/tokenscope-sdk/examples/toy_batching.rs`.
//!
//! Run: `cargo run -p tokenscope-sdk --example toy_batching` — prints each request's phases,
//! then the engine's Prometheus metrics (the gateway's `llm_*` names).

use std::collections::VecDeque;
use std::time::Duration;
use tokenscope_sdk::prometheus::{encode, PrometheusExporter, Registry}; // [sdk]
use tokenscope_sdk::{spawn_exporters, Batch, Exporter, PipelineConfig}; // [sdk]
use tokenscope_sdk::{Clock, FinishReason, RequestInfo, StepEntry, Tracker, TrackerConfig, Work}; // [sdk]

struct Req {
    prompt_left: u32,
    output_left: u32,
    h: tokenscope_sdk::RequestHandle, // [sdk]
}

fn main() -> Result<(), tokenscope_sdk::SdkError> {
    let mut registry = Registry::default(); // [sdk]
    let prom = PrometheusExporter::register(&mut registry); // [sdk]
    let print = |b: &Batch| {
        b.finished.iter().for_each(|f| {
            println!(
                "{:?} queue {} µs prefill {} µs decode {} µs ttft {:?} µs",
                f.request_id,
                f.queue_ns / 1000,
                f.prefill_ns / 1000,
                f.decode_ns / 1000,
                f.ttft_ns().map(|t| t / 1000)
            )
        })
    }; // [sdk]
    let exporters: Vec<Box<dyn Exporter>> = vec![Box::new(prom), Box::new(print)]; // [sdk]
    let (sink, thread) = spawn_exporters(PipelineConfig::default(), exporters)?; // [sdk]
    let mut t = Tracker::with_sink(TrackerConfig::default(), Clock::new(), sink); // [sdk]
    let model = t.model("toy-llm"); // [sdk]

    let mut waiting: VecDeque<Req> = VecDeque::new();
    let mut running: Vec<Req> = Vec::new();
    let mut entries = Vec::new(); // [sdk]
    for i in 0..12u32 {
        let prompt = if i % 4 == 0 { 700 } else { 40 + 10 * i };
        let h = t.arrive(RequestInfo::new(model, u64::from(prompt)).request_id(format!("req-{i}"))); // [sdk]
        waiting.push_back(Req {
            prompt_left: prompt,
            output_left: 5 + i,
            h,
        });
    }
    while !waiting.is_empty() || !running.is_empty() {
        let start = t.now(); // [sdk]
        while running.len() < 4 {
            let Some(r) = waiting.pop_front() else { break };
            t.schedule_at(r.h, start); // [sdk]
            running.push(r);
        }
        // Plan the step: prefill chunks share the budget, decoders get one token.
        let mut budget = 256u32;
        entries.clear(); // [sdk]
        for r in &mut running {
            if r.prompt_left > 0 {
                let chunk = r.prompt_left.min(budget);
                if chunk == 0 {
                    continue;
                }
                budget -= chunk;
                r.prompt_left -= chunk;
                let sampled = r.prompt_left == 0;
                if sampled {
                    r.output_left -= 1;
                }
                entries.push(StepEntry::new(
                    r.h,
                    Work::Prefill {
                        tokens: chunk,
                        sampled,
                    },
                )); // [sdk]
            } else {
                r.output_left -= 1;
                entries.push(StepEntry::new(r.h, Work::decode())); // [sdk]
            }
        }
        // "Run" the model: 2 ms + 5 µs per prefill token.
        busy(Duration::from_micros(2000 + 5 * u64::from(256 - budget)));
        let end = t.now(); // [sdk]
        t.step_at(start, end, &entries); // [sdk]
        running.retain(|r| {
            let done = r.prompt_left == 0 && r.output_left == 0;
            if done {
                t.finish_at(r.h, end, FinishReason::Stop); // [sdk]
            }
            !done
        });
    }
    drop(t); // [sdk]
    thread.join(); // [sdk]
    println!("{}", encode(&registry)); // [sdk]
    Ok(())
}

fn busy(d: Duration) {
    let until = std::time::Instant::now() + d;
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
}
