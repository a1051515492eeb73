//! Per-chunk cost of the gateway's measurement: what `MeteredBody` does for every streamed
//! frame (split SSE events, parse the `data:` JSON, stamp the timer).
//!
//! `cargo bench -p tokenscope-core --bench chunk`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Instant;
use tokenscope_core::openai::parse_payload;
use tokenscope_core::sse::{event_data, EventSplitter};
use tokenscope_core::StreamTimer;

/// A token chunk exactly as llama.cpp's server sends it.
const LLAMA_CHUNK: &[u8] = br#"data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" lighthouse"}}],"created":1796224255,"id":"chatcmpl-3SK7BDeHjEj31LxKDGv0WWOYI27Ry2ag","model":"gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b0-unknown","object":"chat.completion.chunk"}

"#;

fn per_chunk(c: &mut Criterion) {
    let mut g = c.benchmark_group("per_chunk");
    g.throughput(Throughput::Elements(1));
    g.bench_function("split+parse+stamp (llama.cpp token chunk)", |b| {
        let mut splitter = EventSplitter::new(1 << 20);
        let mut timer = StreamTimer::new(Instant::now());
        let frame = bytes::Bytes::from_static(LLAMA_CHUNK);
        b.iter(|| {
            let now = Instant::now();
            splitter
                .push_bytes(black_box(&frame), |raw| {
                    // As the gateway reads an event (`ResponseFacts::absorb_event`).
                    if let Some(data) = event_data(&raw) {
                        if let Ok(info) = parse_payload(data.trim_ascii()) {
                            if info.has_output {
                                timer.on_token_chunk(now);
                            }
                        }
                    }
                })
                .expect("fits");
        });
        black_box(timer.token_chunks());
    });
    g.bench_function("parse_payload only", |b| {
        let data = &LLAMA_CHUNK[6..LLAMA_CHUNK.len() - 2];
        b.iter(|| parse_payload(black_box(data)).map(|i| i.has_output))
    });
    g.finish();
}

/// Per request at the gateway: the prompt's hash and similarity sketch (issue 21's
/// near-duplicates), for a ~1,500-token prompt (6 KB of prose).
fn per_prompt(c: &mut Criterion) {
    let words = [
        "the",
        "keeper",
        "of",
        "a",
        "lighthouse",
        "watched",
        "ships",
        "pass",
        "in",
        "calm",
        "grey",
        "water",
        "ticket",
        "4711",
        "opened",
        "2026-12-07",
    ];
    let text: String = (0..1500)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let mut g = c.benchmark_group("prompt");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("prompt_hash (1500 words)", |b| {
        b.iter(|| tokenscope_core::prompt::prompt_hash("m", std::hint::black_box(&text)))
    });
    g.bench_function("prompt_sketch (1500 words)", |b| {
        b.iter(|| tokenscope_core::prompt::prompt_sketch(std::hint::black_box(&text)))
    });
    // What the gateway normalises before forwarding: a chat body's messages.
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "You are helpful.\n\n"},
        {"role": "user", "content": text.replace(" ticket ", "\nticket\t")}
    ]});
    g.bench_function("normalised_prompt (chat, 1500 words)", |b| {
        b.iter(|| {
            tokenscope_core::prompt::normalised_prompt(
                tokenscope_core::Endpoint::ChatCompletions,
                std::hint::black_box(&body),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, per_chunk, per_prompt);
criterion_main!(benches);
