//! `tokenscope budget` on a synthetic history (explicit and automatic budgets, projection,
//! quiet vs abnormal growth), and `llm_budget_usage_ratio` on a running gateway (live
//! updates and the seed from the store after a restart).

mod common;

use common::{metric_where, post_json, store_table, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};
use tokenscope_core::RequestRecord;

const DAY: i64 = 86_400_000_000;
const HOUR: i64 = 3_600_000_000;
/// 2024-03-15T12:00:00Z.
const NOW: i64 = 1_710_504_000_000_000;

fn rec(id: String, bl: &str, t: i64, input: u64, output: u64) -> RequestRecord {
    RequestRecord {
        request_id: id,
        trace_id: "0".repeat(32),
        created_at: t,
        model: "m".into(),
        upstream: "u".into(),
        business_line: Some(bl.into()),
        request_type: "chat".into(),
        input_tokens: Some(input),
        output_tokens: Some(output),
        total_duration_ms: 1.0,
        ..RequestRecord::default()
    }
}

fn budget_json(store: &std::path::Path, config: &std::path::Path, extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["budget", "--store"])
        .arg(store)
        .arg("--config")
        .arg(config)
        .args([
            "--since",
            &format!("@{}", (NOW - HOUR) / 1_000_000),
            "--until",
            &format!("@{}", NOW / 1_000_000),
            "--format",
            "json",
        ])
        .args(extra)
        .output()
        .expect("run tokenscope budget");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn budgets_projection_and_growth_on_synthetic_history() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = dir.path().join("hist.db");
    let day_start = NOW - NOW.rem_euclid(DAY);
    let mut recs = Vec::new();
    let mut n = 0;
    let mut id = || {
        n += 1;
        format!("r{n:06}")
    };
    // "auto": 30 days × 4 000 tokens/day of history, 2 400 tokens today (half of 1.2 × 4 000).
    for d in 1..=30 {
        recs.push(rec(id(), "auto", day_start - d * DAY + HOUR, 3_000, 1_000));
    }
    recs.push(rec(id(), "auto", day_start + 2 * HOUR, 2_000, 400));
    // "search": explicit 10 000 tokens/day, 9 500 used by 12:00 → warning, runs out at
    // 12 h × 10 000 / 9 500 = 12:37:53.
    recs.push(rec(id(), "search", day_start + HOUR, 5_000, 0));
    recs.push(rec(id(), "search", day_start + 3 * HOUR, 4_500, 0));
    // Growth window (the last hour) vs the hour before. "quiet": requests and tokens +20 %.
    // "burst": the same requests, tokens +60 %.
    for i in 0..12 {
        recs.push(rec(id(), "quiet", NOW - HOUR + i * 1_000_000, 100, 0));
    }
    for i in 0..10 {
        recs.push(rec(id(), "quiet", NOW - 2 * HOUR + i * 1_000_000, 100, 0));
    }
    for i in 0..10 {
        recs.push(rec(id(), "burst", NOW - HOUR + i * 1_000_000, 160, 0));
        recs.push(rec(id(), "burst", NOW - 2 * HOUR + i * 1_000_000, 100, 0));
    }
    tokenscope_store::SqliteStore::open(&store)
        .expect("open")
        .insert_batch(&recs)
        .expect("insert");
    let config = dir.path().join("budgets.toml");
    std::fs::write(
        &config,
        r#"
[[budgets]]
business_line = "search"
period = "daily"
tokens = 10000

[[budgets]]
business_line = "auto"
auto = true
"#,
    )
    .expect("config");
    let j = budget_json(&store, &config, &[]);
    let budgets: BTreeMap<&str, &Value> = j["budgets"]
        .as_array()
        .expect("budgets")
        .iter()
        .map(|b| (b["business_line"].as_str().expect("bl"), b))
        .collect();
    let auto = budgets["auto"];
    assert_eq!(auto["baseline"]["mean_daily_tokens"], 4000.0);
    assert_eq!(auto["budget_tokens"].as_f64(), Some(4_800.0));
    assert_eq!(auto["used_tokens"], 2_400);
    assert_eq!(auto["ratio"].as_f64(), Some(0.5));
    assert_eq!(auto["status"], "ok");
    assert_eq!(auto["period_start"], "2024-03-15T00:00:00Z");
    let search = budgets["search"];
    assert_eq!(search["used_tokens"], 9_500);
    assert_eq!(search["ratio"].as_f64(), Some(0.95));
    assert_eq!(search["status"], "warning");
    assert_eq!(search["projected_exhaustion"], "2024-03-15T12:37:53Z");
    let growth: BTreeMap<&str, &Value> = j["growth"]
        .as_array()
        .expect("growth")
        .iter()
        .map(|g| (g["business_line"].as_str().expect("bl"), g))
        .collect();
    assert_eq!(growth["quiet"]["status"], "normal");
    assert!((growth["quiet"]["token_growth_pct"].as_f64().expect("g") - 20.0).abs() < 1e-9);
    assert!((growth["quiet"]["request_growth_pct"].as_f64().expect("g") - 20.0).abs() < 1e-9);
    assert_eq!(growth["burst"]["status"], "abnormal_growth");
    let kinds: Vec<(String, String)> = j["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|a| {
            (
                a["business_line"].as_str().expect("bl").to_owned(),
                a["kind"].as_str().expect("kind").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("burst".to_owned(), "abnormal_growth".to_owned()),
            ("search".to_owned(), "budget_warning".to_owned())
        ]
    );
    // A business metric that grew 60 % as well explains the burst: no growth alert.
    let j = budget_json(&store, &config, &["--business-metric", "burst=160:100"]);
    let kinds: Vec<&str> = j["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .map(|a| a["kind"].as_str().expect("kind"))
        .collect();
    assert_eq!(kinds, ["budget_warning"]);
}

async fn wait_ratio(gw: &GatewayProc, line: &str, want: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = metric_where(
            &gw.metrics().await,
            "llm_budget_usage_ratio",
            &[("business_line", line)],
        );
        if (v - want).abs() < 1e-9 || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budget_usage_ratio_gauge_live_and_seeded() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("budgets.toml");
    std::fs::write(
        &config,
        r#"
[[budgets]]
business_line = "search"
period = "monthly"
tokens = 100000
"#,
    )
    .expect("config");
    let cfg = config.to_str().expect("utf-8");
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", cfg], &[]);
    assert_eq!(wait_ratio(&gw, "search", 0.0).await, 0.0);
    for (bl, n) in [("search", 7), ("search", 11), ("other", 5)] {
        let (status, _, _) = post_json(
            &gw.url("/v1/chat/completions"),
            &json!({
                "model": "m",
                "messages": [{"role": "user", "content": "count me"}],
                "mock_output_tokens": n,
            }),
            &[("x-tokenscope-business-line", bl)],
        )
        .await;
        assert_eq!(status, 200);
    }
    // Live: exactly the recorded tokens of the line over the budget.
    let search_tokens = |store: &std::path::Path| -> u64 {
        store_table(store)
            .iter()
            .filter(|r| r["business_line"] == "search")
            .map(|r| {
                r["input_tokens"].as_u64().expect("in") + r["output_tokens"].as_u64().expect("out")
            })
            .sum()
    };
    gw.flush().await;
    let tokens = search_tokens(&gw.store);
    assert!(tokens > 18);
    let want = tokens as f64 / 100_000.0;
    assert_eq!(wait_ratio(&gw, "search", want).await, want);
    assert_eq!(
        metric_where(
            &gw.metrics().await,
            "llm_budget_usage_ratio",
            &[("business_line", "other")]
        ),
        0.0
    );
    let (store, _keep) = gw.stop();
    // Restart on the same store: the gauge is seeded from the rows of this month…
    let store_arg = store.to_str().expect("utf-8").to_owned();
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--config", cfg, "--store", &store_arg],
        &[],
    );
    assert_eq!(wait_ratio(&gw, "search", want).await, want);
    // …and a live request adds to the seeded usage.
    let (status, _, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &json!({
            "model": "m",
            "messages": [{"role": "user", "content": "count me"}],
            "mock_output_tokens": 3,
        }),
        &[("x-tokenscope-business-line", "search")],
    )
    .await;
    assert_eq!(status, 200);
    gw.flush().await;
    let tokens = search_tokens(&store);
    let want2 = tokens as f64 / 100_000.0;
    assert!(want2 > want);
    assert_eq!(wait_ratio(&gw, "search", want2).await, want2);
}

/// Business metrics sent to the gateway's admin API explain token growth: the same +60 %
/// token growth is abnormal against flat requests, normal against a business metric +60 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn business_metrics_api_feeds_the_growth_check() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let api = format!("http://{}/api/business-metrics", gw.admin);
    let prev_s = (NOW - 2 * HOUR) / 1_000_000 + 10;
    let cur_s = (NOW - HOUR) / 1_000_000 + 10;
    let (status, _, body) = post_json(
        &api,
        &json!([
            {"business_line": "burst", "value": 60, "at": prev_s},
            {"business_line": "burst", "value": 40, "at": prev_s + 60},
            {"business_line": "burst", "value": 160, "at": cur_s},
        ]),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) =
        post_json(&api, &json!({"business_line": "burst", "value": -1}), &[]).await;
    assert_eq!(status, 400);
    let (status, _, _) = post_json(&api, &json!({"nope": 1}), &[]).await;
    assert_eq!(status, 400);
    let (store, _keep) = gw.stop();
    let mut recs = Vec::new();
    for i in 0..10 {
        recs.push(rec(
            format!("c{i}"),
            "burst",
            NOW - HOUR + i * 1_000_000,
            160,
            0,
        ));
        recs.push(rec(
            format!("p{i}"),
            "burst",
            NOW - 2 * HOUR + i * 1_000_000,
            100,
            0,
        ));
    }
    tokenscope_store::SqliteStore::open(&store)
        .expect("open")
        .insert_batch(&recs)
        .expect("insert");
    let config = store.with_extension("toml");
    std::fs::write(&config, "").expect("config");
    let j = budget_json(&store, &config, &[]);
    let g = &j["growth"][0];
    assert_eq!(g["business_line"], "burst");
    assert_eq!(g["business_metric"], json!([160.0, 100.0]));
    assert!((g["business_metric_growth_pct"].as_f64().expect("bm") - 60.0).abs() < 1e-9);
    assert_eq!(g["status"], "normal");
    assert_eq!(j["alerts"], json!([]));
    // Without the metric (flag override to flat) the same growth is abnormal.
    let j = budget_json(&store, &config, &["--business-metric", "burst=100:100"]);
    assert_eq!(j["growth"][0]["status"], "abnormal_growth");
}

/// A gateway on ClickHouse seeds the gauge from the rows already there (an automatic budget
/// from 30 days of history, and this month's usage), like on the embedded store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_usage_ratio_gauge_seeded_from_clickhouse() {
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let url = ch.url("ts_budget_seed");
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    let day = 86_400_000_000i64;
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    let today = now_us.div_euclid(day) * day;
    // 30 days before today: 1 000 tokens a day for "ads"; today 300 so far.
    let mut recs = Vec::new();
    for d in 1..=30 {
        recs.push(tokenscope_core::RequestRecord {
            request_id: format!("hist-{d}"),
            trace_id: format!("{:032x}", d + 1),
            created_at: today - d * day + 3_600_000_000,
            model: "m".into(),
            business_line: Some("ads".into()),
            input_tokens: Some(800),
            output_tokens: Some(200),
            ..tokenscope_core::RequestRecord::default()
        });
    }
    recs.push(tokenscope_core::RequestRecord {
        request_id: "today".into(),
        trace_id: format!("{:032x}", 999),
        created_at: today + 1,
        model: "m".into(),
        business_line: Some("ads".into()),
        input_tokens: Some(200),
        output_tokens: Some(100),
        ..tokenscope_core::RequestRecord::default()
    });
    store.insert(&recs).expect("insert");

    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("budgets.toml");
    std::fs::write(
        &config,
        "[[budgets]]\nbusiness_line = \"ads\"\nperiod = \"daily\"\nauto = true\n",
    )
    .expect("config");
    let cfg = config.to_str().expect("utf-8");
    let gw =
        GatewayProc::start_with_args(Some(&mock.url()), &["--config", cfg, "--store", &url], &[]);
    // Budget 1.2 × 1 000 × 1 day = 1 200 tokens; used 300 → 0.25.
    assert_eq!(wait_ratio(&gw, "ads", 0.25).await, 0.25);
}
