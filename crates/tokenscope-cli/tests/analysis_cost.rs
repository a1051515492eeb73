//! `tokenscope cost` end to end: gateway + mock engine with `[[prices]]`, every record priced
//! at finish (`cost_usd`), and the command's JSON equal to the prices × the engine's counts.

mod common;

use common::{post_json, store_table, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::process::Command;

const CONFIG: &str = r#"
[[prices]]
model = "priced-*"
input_per_mtok = 3.0
cached_input_per_mtok = 0.3
output_per_mtok = 15.0
"#;

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn cost_json(
    store: &std::path::Path,
    config: &std::path::Path,
    since: i64,
    until: i64,
    by: &str,
) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["cost", "--store"])
        .arg(store)
        .arg("--config")
        .arg(config)
        .args([
            "--since",
            &format!("@{since}"),
            "--until",
            &format!("@{until}"),
            "--format",
            "json",
            "--by",
            by,
        ])
        .output()
        .expect("run tokenscope cost");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cost_by_business_line_is_prices_times_engine_counts() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("prices.toml");
    std::fs::write(&config, CONFIG).expect("write config");
    let cfg_arg = config.to_str().expect("utf-8 path");
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", cfg_arg], &[]);
    let since = now_s() - 1;
    let sends = [
        ("search", "priced-large", 7u64),
        ("search", "priced-large", 3),
        ("ads", "priced-small", 20),
        ("ads", "free-model", 5),
    ];
    for (bl, model, n_out) in sends {
        let (status, _, _) = post_json(
            &gw.url("/v1/chat/completions"),
            &json!({
                "model": model,
                "messages": [{"role": "user", "content": "how much does this cost"}],
                "mock_output_tokens": n_out,
            }),
            &[("x-tokenscope-business-line", bl)],
        )
        .await;
        assert_eq!(status, 200);
    }
    let (store, _dir) = gw.stop();
    let until = now_s() + 2;

    // Every priced row carries its cost; the unpriced one has NULL.
    let rows = store_table(&store);
    assert_eq!(rows.len(), 4);
    let mut expect: std::collections::BTreeMap<String, (u64, f64)> = Default::default();
    for r in &rows {
        let input = r["input_tokens"].as_u64().expect("input");
        let output = r["output_tokens"].as_u64().expect("output");
        let cached = r["cached_tokens"].as_u64().unwrap_or(0);
        let model = r["model"].as_str().expect("model");
        let bl = r["business_line"].as_str().expect("bl").to_owned();
        let e = expect.entry(bl).or_default();
        e.0 += input + output;
        if model.starts_with("priced-") {
            let want =
                ((input - cached) as f64 * 3.0 + cached as f64 * 0.3 + output as f64 * 15.0) / 1e6;
            let got = r["cost_usd"].as_f64().expect("cost_usd");
            assert!((got - want).abs() < 1e-12, "{got} vs {want}");
            e.1 += want;
        } else {
            assert_eq!(r["cost_usd"], Value::Null);
        }
    }

    let j = cost_json(&store, &config, since, until, "business_line");
    let groups = j["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 2);
    let total_cost: f64 = expect.values().map(|v| v.1).sum();
    for g in groups {
        let bl = g["key"]["business_line"].as_str().expect("bl");
        let (tokens, cost) = expect[bl];
        assert_eq!(g["tokens"].as_u64(), Some(tokens), "{bl}");
        assert!(
            (g["cost_usd"].as_f64().expect("cost") - cost).abs() < 1e-12,
            "{bl}"
        );
        assert!((g["cost_share"].as_f64().expect("share") - cost / total_cost).abs() < 1e-9);
        // The previous window is empty: no trend percentage.
        assert_eq!(g["trend"]["previous_tokens"], 0);
        assert_eq!(g["trend"]["tokens_change_pct"], Value::Null);
    }
    // Ordered by cost, descending.
    let costs: Vec<f64> = groups
        .iter()
        .map(|g| g["cost_usd"].as_f64().expect("c"))
        .collect();
    assert!(costs[0] >= costs[1]);
    assert_eq!(j["total"]["requests"], 4);
    assert!((j["total"]["cost_usd"].as_f64().expect("total") - total_cost).abs() < 1e-12);
    assert_eq!(j["unpriced_models"], json!(["free-model"]));
    assert_eq!(j["records_with_stored_cost"], 3);

    // Nested grouping by business line and model.
    let j = cost_json(&store, &config, since, until, "business_line,model");
    assert_eq!(j["groups"].as_array().expect("groups").len(), 3);
    // The command refuses an unknown dimension.
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["cost", "--store"])
        .arg(&store)
        .args(["--by", "colour"])
        .output()
        .expect("run");
    assert!(!out.status.success());
}

fn run_json(cmd: &str, store: &str, config: &std::path::Path, since: i64, until: i64) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args([cmd, "--store", store, "--config"])
        .arg(config)
        .args([
            "--since",
            &format!("@{since}"),
            "--until",
            &format!("@{until}"),
            "--format",
            "json",
        ])
        .output()
        .expect("run tokenscope");
    assert!(
        out.status.success(),
        "{cmd} on {store}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// The same records in the embedded store and in ClickHouse give the same `cost` and
/// `budget` JSON (stored costs, computed costs and unpriced models alike).
#[test]
fn same_answers_on_sqlite_and_clickhouse() {
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let until = 1_710_504_000i64; // 2024-03-15T12:00:00Z
    let since = until - 3_600;
    let mut recs = Vec::new();
    for i in 0..200i64 {
        let t = (since - 3_600 + i * 36) * 1_000_000 + i;
        recs.push(tokenscope_core::RequestRecord {
            request_id: format!("r{i:04}"),
            trace_id: format!("{i:032x}"),
            created_at: t,
            model: ["priced-a", "priced-b", "free"][(i % 3) as usize].into(),
            upstream: "u".into(),
            business_line: Some(["search", "ads"][(i % 2) as usize].into()),
            tenant: (i % 5 != 0).then(|| "acme".to_owned()),
            request_type: "chat".into(),
            input_tokens: Some(100 + i as u64),
            cached_tokens: Some(i as u64 % 50),
            output_tokens: Some(10 + i as u64 % 7),
            cost_usd: (i % 4 == 0 && i % 3 != 2).then_some(0.001 * i as f64),
            total_duration_ms: 1.0,
            ..Default::default()
        });
    }
    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("same.db");
    tokenscope_store::SqliteStore::open(&db)
        .expect("open")
        .insert_batch(&recs)
        .expect("insert sqlite");
    let url = ch.url("same_answers");
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    store.insert(&recs).expect("insert clickhouse");
    let config = dir.path().join("cfg.toml");
    std::fs::write(
        &config,
        format!(
            "{CONFIG}\n[[budgets]]\nbusiness_line = \"search\"\ntokens = 5000\n\n[[budgets]]\nbusiness_line = \"ads\"\nperiod = \"monthly\"\nusd = 0.5\n"
        ),
    )
    .expect("config");
    let db = db.to_str().expect("utf-8");
    for cmd in ["cost", "budget"] {
        let a = run_json(cmd, db, &config, since, until);
        let b = run_json(cmd, &url, &config, since, until);
        assert_eq!(a, b, "{cmd}: embedded store and ClickHouse disagree");
    }
    let c = run_json("cost", db, &config, since, until);
    assert_eq!(c["total"]["requests"], 100);
    assert_eq!(c["total_trend"]["previous_requests"], 100);
}
