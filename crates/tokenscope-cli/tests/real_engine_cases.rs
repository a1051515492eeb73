//! The article's case 1 on the real llama.cpp: long prompts arriving among short ones. With
//! four slots and a logical batch of 256 tokens (`-np 4 -b 256 -ub 256`) a 1,500-token prompt
//! needs ~6 batches to prefill, and a short prompt that arrives meanwhile gets no room in them:
//! `diagnose`, run over what the gateway stored, names the starvation with its numbers.
//!
//! (Case 3, a KV cache too small for the load, cannot be shown on llama.cpp: each slot owns a
//! fixed share of the context, so a long prompt is refused or truncated rather than left
//! waiting for cache; it runs on vLLM in `real_vllm.rs`.)
//!
//! Its own test binary, so that it never shares the CPU with the other real-engine tests.

mod cases;
mod common;
mod llama;

use cases::*;
use common::*;
use std::time::Duration;

/// A gateway config in `dir` with one llama.cpp upstream at `url` and `extra` upstream lines.
fn llama_config(dir: &std::path::Path, url: &str, extra: &str) -> std::path::PathBuf {
    let cfg = dir.join("llama.toml");
    std::fs::write(
        &cfg,
        format!("[[upstreams]]\nname = \"llama\"\nurl = \"{url}\"\nkind = \"llamacpp\"\n{extra}"),
    )
    .expect("write config");
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_long_prompts_starve_short_ones() {
    let Some(llama) = llama::start(&["-np", "4", "-b", "256", "-ub", "256", "-c", "8192"]).await
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = llama_config(dir.path(), &llama.url(), "scrape_interval_ms = 250\n");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let load = HeadOfLine {
        model: "gemma-3-270m",
        long_words: 1500,
        short_words: 12,
        // A 1,500-token prefill takes ~4.5 s alone on an idle 2-core machine (more on a busy
        // one; the load measures it): three short requests beside each long one stay within
        // the four slots.
        rounds: 5,
        alone: 4,
        beside: 3,
        gap: Duration::from_millis(400),
        max_tokens: 4,
    };
    let t0 = unix_s();
    let sent = head_of_line(&gw.url("/v1/completions"), &load).await;
    let t1 = unix_s();
    assert_eq!(sent.len(), load.requests());
    let ids: Vec<String> = sent.iter().map(|s| s.stream.request_id()).collect();
    for id in &ids {
        gw.record(id).await;
    }
    let (db, _dir) = gw.stop();
    let rows = store_table(&db);
    assert_eq!(rows.len(), sent.len(), "one row per request");
    // The client never sees a first token before the gateway; it sees it late only when this
    // test process is scheduled late on the two shared cores (a stall, not a measurement
    // error, which would show in the median).
    let mut gaps = Vec::new();
    for (i, s) in sent.iter().enumerate() {
        let row = rows
            .iter()
            .find(|r| r["request_id"] == ids[i])
            .expect("row");
        let client = s.stream.ttft_ms().expect("client TTFT");
        let rec = row["ttft_ms"].as_f64().expect("ttft");
        assert!(
            rec <= client,
            "{}: gateway {rec} vs client {client}",
            ids[i]
        );
        gaps.push(client - rec);
        if s.long {
            assert!(row["input_tokens"].as_u64().expect("n") >= 1400, "{row:?}");
        }
    }
    gaps.sort_by(f64::total_cmp);
    let (median_gap, worst_gap) = (gaps[gaps.len() / 2], gaps[gaps.len() - 1]);
    assert!(
        median_gap <= 10.0 && worst_gap <= 250.0,
        "client TTFT after the gateway's: median {median_gap:.1} ms, worst {worst_gap:.1} ms"
    );
    let (r, text) = diagnose(&db.to_string_lossy(), t0, t1, &[]);
    assert_eq!(r["requests"], sent.len() as u64, "{text}");
    let ratio = assert_names_starvation(&r, &text, "512-2048");
    // Behind whom (issue 21): every short request that waited beside a long prefill names
    // the long one as its largest blocker; the TTFT step says who.
    let long_ids: Vec<&String> = ids
        .iter()
        .zip(&sent)
        .filter(|(_, s)| s.long)
        .map(|(id, _)| id)
        .collect();
    let checked = assert_short_requests_name_the_long_one(
        &rows,
        |r| long_ids.iter().any(|id| r["request_id"] == id.as_str()),
        LONG_CALLER,
        LONG_LINE,
    );
    assert!(
        checked >= 10,
        "only {checked} short requests waited beside a long one"
    );
    let blame = &step(&r, "ttft")["evidence"]["blame"];
    assert_eq!(blame["short_business_line"], SHORT_LINE, "{text}");
    assert_eq!(blame["blocker_caller"], LONG_CALLER, "{text}");
    assert_eq!(blame["blocker_business_line"], LONG_LINE, "{text}");
    eprintln!(
        "llama.cpp case 1: starvation ratio {ratio:.1}; client TTFT after the gateway's: median \
         {median_gap:.1} ms, worst {worst_gap:.1} ms\n{text}"
    );
    non_streamed_requests_get_a_latency_verdict(&llama.url(), &cfg).await;
}

/// Issue 21, item 5, on the same llama.cpp (run after case 1, never beside it): short and long
/// completions, none streamed. The TTFT step judges them on the engine's queue + prefill (from
/// llama.cpp's `timings`) instead of "unknown", and the blame of each short request that
/// waited beside a long prefill names the long one.
async fn non_streamed_requests_get_a_latency_verdict(_engine: &str, cfg: &std::path::Path) {
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let url = gw.url("/v1/completions");
    let body = |words: usize, n: usize| {
        serde_json::json!({
            "model": "gemma-3-270m",
            "prompt": prose(words, &format!("unstreamed {n}")),
            "max_tokens": 4,
            "temperature": 0,
        })
    };
    let send = |b: serde_json::Value, long: bool| {
        let url = url.clone();
        tokio::spawn(async move {
            let hs: &[(&str, &str)] = if long {
                &[
                    ("x-tokenscope-user", LONG_CALLER),
                    ("x-tokenscope-business-line", LONG_LINE),
                ]
            } else {
                &[("x-tokenscope-business-line", SHORT_LINE)]
            };
            let (status, _, bytes) = post_json(&url, &b, hs).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        })
    };
    let t0 = unix_s();
    let mut n = 0;
    let mut requests = 0u64;
    for _ in 0..3 {
        // Short ones alone.
        for _ in 0..3 {
            n += 1;
            send(body(12, n), false).await.expect("short");
            requests += 1;
        }
        // A long one, and short ones while it prefills (~1 s on an idle machine; three
        // arrive within the first 600 ms).
        n += 1;
        let long = send(body(1500, n), true);
        let mut shorts = Vec::new();
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            n += 1;
            shorts.push(send(body(12, n), false));
        }
        long.await.expect("long");
        for s in shorts {
            s.await.expect("short");
        }
        requests += 4;
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let rows = store_table(&db);
    assert_eq!(rows.len() as u64, requests);
    let (r, text) = diagnose(&db.to_string_lossy(), t0, t1, &[]);
    let ttft = step(&r, "ttft");
    assert_ne!(ttft["verdict"], "unknown", "{text}");
    assert_eq!(
        ttft["evidence"]["ttft_source"], "engine_queue_plus_prefill",
        "{text}"
    );
    assert_eq!(ttft["evidence"]["requests_with_ttft"], requests, "{text}");
    // Every record's wait is known from the engine's phases: every one has a blame.
    for row in &rows {
        assert!(row["blocked_by_requests"].as_i64().is_some(), "{row:?}");
    }
    let checked = assert_short_requests_name_the_long_one(
        &rows,
        |r| r["input_tokens"].as_i64().unwrap_or(0) > 1000,
        LONG_CALLER,
        LONG_LINE,
    );
    eprintln!(
        "llama.cpp, not streamed: TTFT step {} {} ({checked} short requests beside a long \
         prefill named it)\n{text}",
        ttft["verdict"], ttft["findings"]
    );
}

/// Issue 22's case on the real llama.cpp: a 1,500-token prompt (not streamed) and, while it
/// prefills, a two-word streamed one. With a batch and micro-batch of 2,048 (`-b 2048 -ub
/// 2048`) the long prompt is one engine step; the server loop takes the short request only
/// after it, so llama.cpp's own `prompt_ms` for the short one is its own ~70 ms and the wait —
/// most of its TTFT — is time the engine did not account for. (With the default `-ub 512`
/// the short prompt joins the long one's next 512-token micro-batch and llama.cpp counts that
/// shared batch as the short one's prompt time: then only the wait for the current
/// micro-batch is unaccounted — measured 1.2–1.6 s of 3.4–4.0 s, docs/operations.md) (llama.cpp reports no queue time: the gateway's
/// derived queue is not an engine number). Its record says so, its parts sum to its TTFT, it
/// names the long request, and `diagnose` names step blocking behind the long request's
/// caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_a_short_request_behind_a_long_prefill_shows_the_unaccounted_wait() {
    let Some(llama) = llama::start(&["-np", "2", "-c", "8192", "-b", "2048", "-ub", "2048"]).await
    else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = llama_config(dir.path(), &llama.url(), "");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let t0 = unix_s();
    let cases = short_behind_long(&gw.url("/v1/completions"), "gemma-3-270m", 1500, 4).await;
    let t1 = unix_s();
    for c in &cases {
        gw.record(&c.short.request_id()).await;
        gw.record(&c.long_id).await;
    }
    let (db, _dir) = gw.stop();
    let rows = store_table(&db);
    let (r, text) = diagnose(&db.to_string_lossy(), t0, t1, &[]);
    let lines = assert_unaccounted_wait(&rows, &cases, &r, &text);
    eprintln!("llama.cpp, issue 22's case:\n{}\n{text}", lines.join("\n"));
}
