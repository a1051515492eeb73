//! Engine-side truth against the real llama.cpp server with continuous batching: per-request
//! prefill / decode equal that request's own engine timings (never one shared batch value), a
//! short prompt beside a long prefill shows its inflated TTFT and queue, a repeated prompt shows
//! cached tokens, the entry count through the engine's `/tokenize` equals the usage, and each
//! record carries the engine state at its arrival.
//!
//! Separate test binary from `real_engine.rs` so the two never load the CPU at the same time.

mod common;
mod llama;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

fn completion(prompt: &str, max_tokens: u64) -> serde_json::Value {
    json!({
        "model": "gemma-3-270m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

fn timings_of(s: &ClientStream) -> serde_json::Value {
    s.events
        .iter()
        .find_map(|e| e.json.as_ref().and_then(|j| j.get("timings")).cloned())
        .expect("llama.cpp sends timings on the usage chunk")
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_phases_under_continuous_batching() {
    // 4 slots, logical batch 256 tokens: a 1,500-token prompt needs ~6 batches to prefill.
    let Some(llama) = llama::start(&["-np", "4", "-b", "256", "-ub", "256", "-c", "8192"]).await
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("llama.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"llama\"\nurl = \"{url}\"\nkind = \"llamacpp\"\n\
             scrape_interval_ms = 100\n\
             [[tokenizers]]\nmodels = [\"*\"]\nkind = \"engine\"\nurl = \"{url}\"\nflavor = \"llamacpp\"\n",
            url = llama.url()
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let url = gw.url("/v1/completions");

    // Baseline: a short prompt alone.
    let short_alone = stream(&url, &completion(&prose(16, "alone"), 4), &[], None).await;
    let alone = gw.record(&short_alone.request_id()).await;
    let alone_ttft = f(&alone["ttft_ms"]);

    // A long prompt, and a short one sent while the long one is prefilling.
    let long_prompt = prose(1500, "long");
    let long_body = completion(&long_prompt, 4);
    let url2 = url.clone();
    let long_task = tokio::spawn(async move { stream(&url2, &long_body, &[], None).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let short_started = Instant::now();
    let short = stream(&url, &completion(&prose(16, "beside"), 4), &[], None).await;
    let short_elapsed = short_started.elapsed();
    let long = long_task.await.expect("long request");

    let rs = gw.record(&short.request_id()).await;
    let rl = gw.record(&long.request_id()).await;
    let (ts, tl) = (timings_of(&short), timings_of(&long));

    // Every record's prefill/decode equal that request's own engine timings.
    assert_eq!(rs["prefill_duration_ms"], ts["prompt_ms"]);
    assert_eq!(rs["decode_duration_ms"], ts["predicted_ms"]);
    assert_eq!(rl["prefill_duration_ms"], tl["prompt_ms"]);
    assert_eq!(rl["decode_duration_ms"], tl["predicted_ms"]);
    assert_eq!(rs["prefill_source"], "engine");
    assert_eq!(rs["queue_source"], "derived");
    assert_ne!(
        rs["prefill_duration_ms"], rl["prefill_duration_ms"],
        "per request, never one shared batch value"
    );
    assert!(f(&rl["prefill_duration_ms"]) > f(&rs["prefill_duration_ms"]));

    // The short request beside the long prefill waited: its TTFT is inflated.
    let beside_ttft = f(&rs["ttft_ms"]);
    eprintln!(
        "short alone TTFT {alone_ttft:.1} ms; beside a {}-token prefill: TTFT {beside_ttft:.1} ms \
         (prefill {:.1}, queue {:.1}); long prefill {:.1} ms; short request took {:?}",
        rl["input_tokens"],
        f(&rs["prefill_duration_ms"]),
        f(&rs["queue_duration_ms"]),
        f(&rl["prefill_duration_ms"]),
        short_elapsed
    );
    assert!(
        beside_ttft > 2.0 * alone_ttft && beside_ttft - alone_ttft > 200.0,
        "short TTFT beside the long prefill ({beside_ttft:.1} ms) should be inflated vs alone ({alone_ttft:.1} ms)"
    );
    assert!(rl["input_tokens"].as_u64().expect("n") >= 1400);

    // Engine state at arrival: the long request was running when the short one arrived.
    assert!(
        rs["engine_running"].as_f64().unwrap_or(0.0) >= 1.0,
        "engine state at arrival: {rs}"
    );

    // The entry count through the engine's /tokenize equals the usage's prompt tokens.
    for r in [&alone, &rs, &rl] {
        assert_eq!(r["input_tokens_entry"], r["input_tokens"], "{r}");
    }

    // A repeated prompt is served from the KV cache.
    let again = stream(&url, &completion(&long_prompt, 4), &[], None).await;
    let ra = gw.record(&again.request_id()).await;
    assert!(
        ra["cached_tokens"].as_u64().unwrap_or(0) > 1000,
        "repeated prompt should show cached tokens: {ra}"
    );
    assert!(f(&ra["prefill_duration_ms"]) < f(&rl["prefill_duration_ms"]));
}
