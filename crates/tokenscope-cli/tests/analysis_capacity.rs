//! `tokenscope capacity` scenarios: the mock engine behind the real gateway is driven at
//! increasing open-loop rates; the knee found from the store matches the throughput ceiling
//! the mock's configuration implies. Plus the load-test (`--from-bench`) mode.

mod common;

use common::{stream, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn unix_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

fn capacity(args: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["capacity", "--format", "json"])
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run capacity");
    assert!(
        out.status.success(),
        "capacity failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    (serde_json::from_str(&text).expect("json"), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn knee_matches_the_mock_throughput_ceiling() {
    // 2 slots; a request (10 prompt tokens, 20 output tokens) takes 20 steps (the first one
    // prefills and yields the first token); with both slots busy a step is
    // (8 + 0.5) ms × 0.5 = 4.25 ms, so a request holds its slot 85 ms and the engine completes
    // at most 2 / 0.085 s ≈ 23.5 requests/s. Below that TTFT stays small; above it the queue
    // grows by (rate − 23.5) per second and P99 TTFT passes the 250 ms SLO within the level.
    let ceiling = 2.0 / (20.0 * 8.5 * 0.5 / 1000.0);
    let mock = MockProc::start(&["--slots", "2", "--time-scale", "0.5"]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let url = gw.url("/v1/chat/completions");
    let body = json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "abcd efgh ijkl"}],
        "stream": true,
        "mock_output_tokens": 20,
    });
    let rates = [6u64, 12, 18, 30, 40];
    let level_s = 2u64;
    let t0 = unix_s() + 0.2;
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for (k, rate) in rates.iter().enumerate() {
        for i in 0..rate * level_s {
            let at = start
                + Duration::from_secs(k as u64 * level_s)
                + Duration::from_secs_f64(i as f64 / *rate as f64);
            let (url, body) = (url.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                stream(&url, &body, &[], None).await.status
            }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let (db, _dir) = gw.stop();
    let store = db.to_string_lossy().into_owned();
    let since = format!("@{t0:.6}");
    let until = format!("@{:.6}", t0 + (rates.len() as u64 * level_s) as f64);
    let (r, text) = capacity(&[
        "--store",
        &store,
        "--since",
        &since,
        "--until",
        &until,
        "--interval",
        "1s",
        "--band",
        "6",
        "--min-requests",
        "10",
        "--slo-ttft-p99",
        "250ms",
        "--growth",
        "10%/month",
    ]);
    assert_eq!(r["mode"], "history", "{text}");
    assert_eq!(r["limit_observed"], true, "{text}");
    let knee = r["knee_qps"].as_f64().expect("knee");
    let sustainable = r["sustainable_qps"].as_f64().expect("sustainable");
    // Tolerance: the knee lies above the ceiling's 90 % and at most at the first level past
    // it (30/s, 1.28 × ceiling) plus a band; the sustainable QPS below the ceiling and at
    // least the level two bands under it.
    assert!(
        knee >= 0.9 * ceiling && knee <= 1.5 * ceiling,
        "knee {knee}, ceiling {ceiling:.1}\n{text}"
    );
    assert!(sustainable < knee, "{text}");
    assert!(
        sustainable >= 0.5 * ceiling && sustainable <= ceiling,
        "sustainable {sustainable}, ceiling {ceiling:.1}\n{text}"
    );
    // The peak (40/s) is already past the limit: no days left.
    assert_eq!(r["days_to_limit"], 0.0, "{text}");
    assert_eq!(r["options"]["slo_ttft_p99_ms"], 250.0);

    // The same records in ClickHouse: the same report (skipped without a server).
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let records = tokenscope_store::SqliteStore::open_read_only(&db)
        .expect("open sqlite")
        .records_between(i64::MIN / 2, i64::MAX / 2)
        .expect("records");
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let ch_url = ch.url("ts_capacity");
    let chs = tokenscope_clickhouse::ClickHouseStore::connect_url(&ch_url).expect("connect");
    chs.migrate().expect("migrate");
    chs.insert(&records).expect("insert");
    let (_, ch_text) = capacity(&[
        "--store",
        &ch_url,
        "--since",
        &since,
        "--until",
        &until,
        "--interval",
        "1s",
        "--band",
        "6",
        "--min-requests",
        "10",
        "--slo-ttft-p99",
        "250ms",
        "--growth",
        "10%/month",
    ]);
    assert_eq!(
        ch_text, text,
        "capacity differs between SQLite and ClickHouse"
    );
}

#[test]
fn from_bench_levels() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("bench.json");
    std::fs::write(
        &path,
        json!([
            {"rate": 5.0, "achieved_qps": 5.0, "ttft_p99_ms": 400.0, "tpot_p99_ms": 30.0, "errors": 0},
            {"rate": 20.0, "achieved_qps": 17.5, "ttft_p99_ms": 6000.0, "tpot_p99_ms": 60.0, "errors": 0},
            {"rate": 10.0, "achieved_qps": 10.0, "ttft_p99_ms": 1200.0, "tpot_p99_ms": 40.0, "errors": 0}
        ])
        .to_string(),
    )
    .expect("write");
    let p = path.to_string_lossy().into_owned();
    let (r, text) = capacity(&[
        "--from-bench",
        &p,
        "--current-qps",
        "5",
        "--growth",
        "100%/week",
    ]);
    assert_eq!(r["mode"], "bench", "{text}");
    assert_eq!(r["knee_qps"], 17.5, "{text}");
    assert_eq!(r["sustainable_qps"], 10.0, "{text}");
    // 5 → 10 QPS doubling at 100 %/week: 7 days.
    assert_eq!(r["days_to_limit"], 7.0, "{text}");
    let (r, text) = capacity(&["--from-bench", &p, "--slo-tpot-p99", "35ms"]);
    assert_eq!(r["knee_qps"], 10.0, "{text}");
    assert_eq!(r["sustainable_qps"], 5.0, "{text}");
}
