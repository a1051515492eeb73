//! `tokenscope diagnose` scenarios: the mock engine behind the real gateway reproduces the
//! article's cases, then the real binary diagnoses the store (JSON asserted on values).
//!
//! * long prompts starving short ones → TTFT step, `starvation`, long bucket `2048+`,
//!   isolation and prefill-cap remedies;
//! * KV cache near full, small batches, high TPOT → TPOT step `decode_kv_bound`;
//! * a healthy run → `healthy`;
//! * the same records in ClickHouse give byte-identical JSON (skipped without a server).
//!
//! Time is compressed with the mock's `--time-scale`; where a scenario compares against an
//! absolute latency threshold, the threshold is scaled by the same factor.

mod cases;
mod common;

use cases::{diagnose, has, step, unix_s};
use common::{stream, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;

/// A chat request whose prompt counts `words × 2 + 4` mock tokens.
fn chat(words: usize, out: u64) -> Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "abcdefgh ".repeat(words)}],
        "stream": true,
        "mock_output_tokens": out,
    })
}

/// A config file routing to the mock with a fast engine-state scrape.
fn config(dir: &std::path::Path, url: &str) -> String {
    let p = dir.join("gw.toml");
    std::fs::write(
        &p,
        format!("[[upstreams]]\nname = \"mock\"\nurl = \"{url}\"\nscrape_interval_ms = 100\n"),
    )
    .expect("write config");
    p.to_string_lossy().into_owned()
}

/// Same records loaded into ClickHouse: `diagnose` prints the same JSON.
fn same_on_clickhouse(db: &std::path::Path, since: f64, until: f64, sqlite_json: &str) {
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let records = tokenscope_store::SqliteStore::open_read_only(db)
        .expect("open sqlite")
        .records_between(i64::MIN / 2, i64::MAX / 2)
        .expect("records");
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let url = ch.url("ts_diagnose");
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    store.insert(&records).expect("insert");
    let (_, text) = diagnose(&url, since, until, &[]);
    assert_eq!(
        text, sqlite_json,
        "diagnose differs between SQLite and ClickHouse"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_prompts_starve_short_ones() {
    // 8 slots, chunked prefill of 512 tokens/step; a 6004-token prompt takes 12 steps of
    // (8 + 25.6) ms × 0.25 ≈ 100 ms during which short requests beside it get no prefill.
    let mock = MockProc::start(&["--time-scale", "0.25"]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let t0 = unix_s();
    let mut tasks = Vec::new();
    for i in 0..128u64 {
        let url = url.clone();
        // A long prompt every 16th slot (every 320 ms), short ones every 20 ms.
        let long = i % 16 == 3;
        let body = if long { chat(3000, 5) } else { chat(3, 5) };
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20 * i)).await;
            let hs: &[(&str, &str)] = if long {
                &[
                    ("x-tokenscope-user", "batch-job"),
                    ("x-tokenscope-business-line", "offline"),
                ]
            } else {
                &[("x-tokenscope-business-line", "search")]
            };
            stream(&url, &body, hs, None).await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let store = db.to_string_lossy().into_owned();
    let (r, text) = diagnose(&store, t0, t1, &[]);
    assert_eq!(r["requests"], 128, "{text}");
    assert_eq!(step(&r, "success")["verdict"], "ok", "{text}");
    let ttft = step(&r, "ttft");
    assert_eq!(ttft["verdict"], "problem", "{text}");
    assert!(has(&ttft["findings"], "starvation"), "{text}");
    assert_eq!(ttft["evidence"]["long_bucket"], "2048+", "{text}");
    assert!(
        ttft["evidence"]["starvation_ratio"]
            .as_f64()
            .expect("ratio")
            >= 2.0,
        "{text}"
    );
    assert!(ttft["evidence"]["short_beside_long_n"].as_u64().expect("n") >= 10);
    assert!(ttft["evidence"]["short_alone_n"].as_u64().expect("n") >= 10);
    assert_eq!(ttft["thresholds"]["starvation_ratio"], 2.0);
    assert_eq!(r["conclusion"]["step"], "ttft", "{text}");
    assert!(has(&r["conclusion"]["findings"], "starvation"));
    assert!(r["conclusion"]["summary"]
        .as_str()
        .expect("summary")
        .contains("long prompts starve short ones"));
    assert!(has(&r["conclusion"]["remedies"], "isolation"), "{text}");
    assert!(has(&r["conclusion"]["remedies"], "2048+"), "{text}");
    assert!(has(&r["conclusion"]["remedies"], "cap prefill"), "{text}");
    // Behind whom: every short request that waited beside a long prefill names a long one as
    // its largest blocker, and the TTFT step says so.
    let rows = common::store_table(&db);
    let checked = cases::assert_short_requests_name_the_long_one(
        &rows,
        |r| r["input_tokens"].as_i64().unwrap_or(0) > 1000,
        "batch-job",
        "offline",
    );
    assert!(
        checked >= 10,
        "only {checked} short requests waited beside a long one"
    );
    let blame = &ttft["evidence"]["blame"];
    assert_eq!(blame["short_business_line"], "search", "{text}");
    assert_eq!(blame["blocker_caller"], "batch-job", "{text}");
    assert_eq!(blame["blocker_business_line"], "offline", "{text}");
    assert!(
        r["conclusion"]["summary"]
            .as_str()
            .expect("summary")
            .contains("short requests of business line search waited"),
        "{text}"
    );
    same_on_clickhouse(&db, t0, t1, &text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_cache_near_full_small_batches_high_tpot() {
    // KV for 8000 tokens; each request holds a 3700-token prompt (+ ≤ 16 generated), so two
    // fit and the third waits: batches of 2 with the cache > 92 % full. Each decode step reads
    // the resident KV: (8 + 0.5 + 0.02 × ~7400) ms ≈ 157 ms × 0.1 ≈ 15.7 ms per token.
    let mock = MockProc::start(&[
        "--time-scale",
        "0.1",
        "--kv-tokens",
        "8000",
        "--decode-ms-per-kv-token",
        "0.02",
    ]);
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config(dir.path(), &mock.url());
    let gw = GatewayProc::start_with_args(None, &["--config", &cfg], &[]);
    let url = gw.url("/v1/chat/completions");
    // Let the first scrape land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = unix_s();
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..4 {
                let s = stream(&url, &chat(1848, 16), &[], None).await;
                assert_eq!(s.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let store = db.to_string_lossy().into_owned();
    // Thresholds scaled with the mock's time (× 0.1): TPOT 50 ms → 5 ms, TTFT 2 s → 200 ms.
    let (r, text) = diagnose(
        &store,
        t0,
        t1,
        &["--tpot-p99", "5ms", "--ttft-p99", "200ms"],
    );
    assert_eq!(r["requests"], 24, "{text}");
    let tpot = step(&r, "tpot");
    assert_eq!(tpot["verdict"], "problem", "{text}");
    assert!(has(&tpot["findings"], "decode_kv_bound"), "{text}");
    assert!(
        tpot["evidence"]["kv_usage_p90"].as_f64().expect("kv") >= 0.9,
        "{text}"
    );
    assert!(
        tpot["evidence"]["running_p50"].as_f64().expect("running") <= 4.0,
        "{text}"
    );
    assert!(
        tpot["evidence"]["tpot_p99_ms"].as_f64().expect("tpot") > 5.0,
        "{text}"
    );
    assert_eq!(tpot["thresholds"]["kv_high"], 0.9);
    assert_eq!(tpot["thresholds"]["tpot_p99_ms"], 5.0);
    assert_eq!(r["conclusion"]["step"], "tpot", "{text}");
    assert!(has(&r["conclusion"]["remedies"], "KV-cache quantization"));
    assert!(has(
        &r["conclusion"]["remedies"],
        "fewer concurrent long contexts"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthy_run_is_healthy() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let t0 = unix_s();
    let mut tasks = Vec::new();
    for i in 0..60u64 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20 * i)).await;
            // Distinct prompts: sixty identical ones in 1.2 s are a duplicate burst.
            let mut body = chat(20, 8);
            body["messages"][0]["content"] =
                json!(format!("question {i}: {}", "abcdefgh ".repeat(20)));
            stream(&url, &body, &[], None).await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let (r, text) = diagnose(&db.to_string_lossy(), t0, t1, &[]);
    assert_eq!(r["requests"], 60, "{text}");
    assert_eq!(r["conclusion"]["verdict"], "healthy", "{text}");
    for s in r["steps"].as_array().expect("steps") {
        assert_eq!(s["verdict"], "ok", "{text}");
    }
    // The table names every step and the conclusion.
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["diagnose", "--store"])
        .arg(&db)
        .arg("--since")
        .arg(format!("@{}", t0.floor() - 1.0))
        .arg("--until")
        .arg(format!("@{}", t1.ceil() + 1.0))
        .output()
        .expect("run diagnose");
    let table = String::from_utf8_lossy(&out.stdout);
    for s in [
        "success",
        "ttft",
        "tpot",
        "tokens",
        "network",
        "Conclusion: healthy",
    ] {
        assert!(table.contains(s), "{table}");
    }
}

/// Issue 21, case 3 as seen: 64 slots and a 48k-token KV cache under 3k-token prompts. About
/// 15 requests fit the cache at once, so the batch sits far above an absolute "small batch"
/// (4) and far below the engine's 64 slots: the cache, not the slots, holds it there. The
/// verdict must name the KV cache, and no remedy may be "lower max_num_seqs" (a batch held by
/// the cache gets nothing from a lower slot limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_held_by_the_kv_cache_far_below_the_slots_names_the_cache() {
    // Each decode step reads the resident KV: (8 + 0.5 × 14 + 0.01 × ~45 000) ms × 0.1 ≈
    // 46 ms per token, against a 5 ms (scaled 50 ms) TPOT threshold.
    let mock = MockProc::start(&[
        "--time-scale",
        "0.1",
        "--slots",
        "64",
        "--kv-tokens",
        "48000",
        "--decode-ms-per-kv-token",
        "0.01",
    ]);
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config(dir.path(), &mock.url());
    let gw = GatewayProc::start_with_args(None, &["--config", &cfg], &[]);
    let url = gw.url("/v1/chat/completions");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = unix_s();
    let mut tasks = Vec::new();
    // 24 closed-loop clients of 3,000-token prompts: ~15 fit, the rest wait for cache room.
    for _ in 0..24 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let s = stream(&url, &chat(1498, 16), &[], None).await;
                assert_eq!(s.status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let store = db.to_string_lossy().into_owned();
    let scaled = ["--tpot-p99", "5ms", "--ttft-p99", "200ms"];
    // Without the configured maximum (the observed one is used) and with it (`--max-batch`).
    for extra in [&[][..], &["--max-batch", "64"][..]] {
        let args: Vec<&str> = scaled.iter().chain(extra).copied().collect();
        let (r, text) = diagnose(&store, t0, t1, &args);
        assert_eq!(r["requests"], 72, "{text}");
        let tpot = step(&r, "tpot");
        assert_eq!(tpot["verdict"], "problem", "{text}");
        assert_eq!(tpot["findings"], json!(["decode_kv_bound"]), "{text}");
        let run50 = tpot["evidence"]["running_p50"].as_f64().expect("running");
        assert!(run50 > 4.0 && run50 < 32.0, "{text}");
        assert!(tpot["evidence"]["kv_usage_p90"].as_f64().expect("kv") >= 0.9);
        assert!(tpot["summary"]
            .as_str()
            .expect("summary")
            .contains("KV cache"));
        if extra.is_empty() {
            assert_eq!(tpot["evidence"]["batch_limit_source"], "observed", "{text}");
        } else {
            assert_eq!(tpot["evidence"]["batch_limit"], 64.0, "{text}");
            assert_eq!(tpot["evidence"]["batch_limit_source"], "configured");
        }
        assert_eq!(r["conclusion"]["step"], "tpot", "{text}");
        assert_eq!(
            r["conclusion"]["findings"],
            json!(["decode_kv_bound"]),
            "{text}"
        );
        assert!(
            has(&r["conclusion"]["remedies"], "KV-cache quantization"),
            "{text}"
        );
        for s in r["steps"].as_array().expect("steps") {
            assert!(!has(&s["remedies"], "lower the maximum batch"), "{text}");
            assert!(!has(&s["findings"], "decode_batch_bound"), "{text}");
        }
    }
}

/// Issue 21, case 2 as seen: one caller repeating one prompt at 8/s with flat tokens per
/// request, beside ordinary traffic of varied prompts. Tokens per request do not grow, so the
/// tree's old token step said "healthy"; the detector's loop must make it a problem that names
/// the caller and its business line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_looping_on_one_prompt_is_not_healthy() {
    let mock = MockProc::start(&["--time-scale", "0.05"]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let t0 = unix_s();
    let looper = {
        let url = url.clone();
        tokio::spawn(async move {
            // 8/s on a fixed schedule (an interval, so a slow reply does not shift the period).
            let mut tick = tokio::time::interval(Duration::from_millis(125));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for _ in 0..48 {
                tick.tick().await;
                let body = chat(40, 8);
                let hs = [
                    ("x-tokenscope-user", "looper"),
                    ("x-tokenscope-business-line", "search"),
                ];
                assert_eq!(stream(&url, &body, &hs, None).await.status, 200);
            }
        })
    };
    let mut others = Vec::new();
    for i in 0..24u64 {
        let url = url.clone();
        others.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(250 * i)).await;
            let mut body = chat(30 + (i as usize % 7) * 5, 8);
            body["messages"][0]["content"] =
                json!(format!("question {i}: {}", "words ".repeat(30)));
            let user = format!("user{}", i % 4);
            let hs = [("x-tokenscope-user", user.as_str())];
            assert_eq!(stream(&url, &body, &hs, None).await.status, 200);
        }));
    }
    looper.await.expect("looper");
    for t in others {
        t.await.expect("task");
    }
    let t1 = unix_s();
    let (db, _dir) = gw.stop();
    let (r, text) = diagnose(&db.to_string_lossy(), t0, t1, &[]);
    assert_eq!(r["requests"], 72, "{text}");
    let tokens = step(&r, "tokens");
    // Tokens per request are flat: not token growth.
    assert!(!has(&tokens["findings"], "token_growth"), "{text}");
    assert_eq!(tokens["verdict"], "problem", "{text}");
    assert!(has(&tokens["findings"], "caller_loop"), "{text}");
    let summary = tokens["summary"].as_str().expect("summary");
    assert!(
        summary.contains("looper repeats one prompt every 0.1"),
        "{text}"
    );
    assert!(summary.contains("search"), "{text}");
    assert_ne!(r["conclusion"]["verdict"], "healthy", "{text}");
    assert!(has(&tokens["remedies"], "fix looper's client"), "{text}");
}

/// Issue 21 acceptance: `diagnose` over a grid of mock configurations. Closed-loop clients of
/// 1,500-token prompts against slots 4…64 and a KV cache of 8k…64k tokens: the cache fits
/// 5 (8k) or 42 (64k) of them. Each configuration implies what holds the batch:
/// * fewer fit the cache than there are slots, and more clients than fit → the KV cache;
/// * the cache fits every slot, more clients than slots → the slots;
/// * fewer clients than slots and than fit → nothing (no queue to blame).
///
/// Every configuration gets that verdict, and none a remedy that would make it worse: no
/// "lower the maximum batch" anywhere (it only lengthens queues), no "raise the maximum batch"
/// when the cache is what limits (slots the cache cannot fill), no KV-cache remedy where the
/// slots limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn diagnose_over_a_grid_of_engine_configurations() {
    // Real time: the engine state is scraped every 100 ms, so a run must last long enough
    // for the state at the requests' arrival to be the state they met.
    const SCALE: f64 = 1.0;
    let prompt_tokens = 1500u64; // chat(748, ·) counts 748 × 2 + 4
    let out = 16u64;
    let mut seen = Vec::new();
    for (slots, kv, clients) in [
        (4usize, 8_000u64, 8usize),
        (4, 64_000, 8),
        (16, 8_000, 24),
        (16, 64_000, 32),
        (16, 64_000, 6),
        (64, 8_000, 24),
        (64, 64_000, 96),
    ] {
        let fit = (kv / (prompt_tokens + out)) as usize;
        let expect = if fit < slots && clients > fit {
            "kv_cache"
        } else if clients > slots {
            "slots"
        } else {
            "none"
        };
        let mock = MockProc::start(&[
            "--time-scale",
            &SCALE.to_string(),
            "--slots",
            &slots.to_string(),
            "--kv-tokens",
            &kv.to_string(),
        ]);
        let dir = tempfile::tempdir().expect("tmp");
        let cfg = config(dir.path(), &mock.url());
        let gw = GatewayProc::start_with_args(None, &["--config", &cfg], &[]);
        let url = gw.url("/v1/chat/completions");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t0 = unix_s();
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    let s = stream(&url, &chat(748, out), &[], None).await;
                    assert_eq!(s.status, 200);
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        let t1 = unix_s();
        let (db, _dir) = gw.stop();
        // Default thresholds; the configured maximum batch given.
        let (r, text) = diagnose(
            &db.to_string_lossy(),
            t0,
            t1,
            &["--max-batch", &slots.to_string()],
        );
        let label =
            format!("slots {slots}, KV {kv} (fits {fit}), {clients} clients: expected {expect}");
        let ttft = step(&r, "ttft");
        let held = ttft["evidence"]["batch_held_by"].as_str().unwrap_or("?");
        seen.push(format!(
            "{label}: got {held}, conclusion {} {}",
            r["conclusion"]["step"], r["conclusion"]["findings"]
        ));
        assert_eq!(held, expect, "{label}\n{text}");
        let remedies: Vec<String> = r["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .chain(std::iter::once(&r["conclusion"]))
            .flat_map(|s| s["remedies"].as_array().cloned().unwrap_or_default())
            .filter_map(|m| m.as_str().map(str::to_owned))
            .collect();
        let any = |needle: &str| remedies.iter().any(|m| m.contains(needle));
        assert!(!any("lower the maximum batch"), "{label}\n{text}");
        match expect {
            "kv_cache" => {
                assert!(!any("raise the engine's maximum batch"), "{label}\n{text}");
                assert!(has(&ttft["findings"], "queue_kv_bound"), "{label}\n{text}");
                assert!(any("KV-cache quantization"), "{label}\n{text}");
            }
            "slots" => {
                assert!(!any("KV-cache quantization"), "{label}\n{text}");
                if has(&ttft["findings"], "queueing") {
                    assert!(any("raise the engine's maximum batch"), "{label}\n{text}");
                }
            }
            _ => {
                assert!(!has(&ttft["findings"], "queue_kv_bound"), "{label}\n{text}");
                assert!(!has(&ttft["findings"], "queueing"), "{label}\n{text}");
            }
        }
    }
    eprintln!("{}", seen.join("\n"));
}
