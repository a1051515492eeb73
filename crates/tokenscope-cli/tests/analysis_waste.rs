//! `tokenscope waste` end to end, with the mock engine behind the real gateway and a price
//! table (`[[prices]]`, $1 / $2 per million input / output tokens).
//!
//! Traffic (request type by `x-tokenscope-request-type`, output length forced with
//! `mock_output_tokens`):
//! * `summarize`: 20 distinct prompts answered in 50 tokens + 2 answered in 400 (> 4 × the
//!   median of 50: overlong). Suggested `max_tokens` = P99 of the normal `stop` outputs (50)
//!   rounded up to 16 = 64; saving 2 × (400 − 64) = 672 output tokens.
//! * `faq`: one prompt sent 5 times → 4 repeats; a response cache saves their input + output.
//! * `extract`: 4 requests with `max_tokens = 16`, three of which would run to 100 tokens →
//!   3 truncated (`length`) of 4 (reported, not a saving).
//! * `classify`: 20 short prompts of identical length answered in 10 tokens, one prompt ≈ 100×
//!   longer answered in 10 → bloated: the fence ratio is 2 × the others' (IQR 0, so the ln 2
//!   floor applies); excess = its input − 2 × a short prompt's input.
//!
//! * near-identical prompts: the templated `summarize doc N`, `summarize long N`,
//!   `extract item N`, `classify item N` form four groups (numbers masked in the gateway's
//!   prompt sketch).
//!
//! Expected token numbers are computed from the rows the gateway stored (the engine's usage),
//! then compared exactly with the command's JSON. When `clickhouse-server` is available, the
//! records are copied into ClickHouse and the JSON from both stores must be byte-identical.

mod common;

use common::{post_json, store_table, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::process::Command;

const CONFIG: &str = r#"
[[prices]]
model = "mock-model"
input_per_mtok = 1.0
output_per_mtok = 2.0
"#;

fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

async fn send(gw: &GatewayProc, rt: &str, prompt: &str, out: u64, max_tokens: Option<u64>) {
    let mut body = json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": prompt}],
        "mock_output_tokens": out,
    });
    if let Some(m) = max_tokens {
        body["max_tokens"] = json!(m);
    }
    let (status, _, resp) = post_json(
        &gw.url("/v1/chat/completions"),
        &body,
        &[
            ("x-tokenscope-user", "svc"),
            ("x-tokenscope-request-type", rt),
        ],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_truncation_overlong_and_bloat_are_counted_exactly() {
    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("prices.toml");
    std::fs::write(&config, CONFIG).expect("write config");
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--config", config.to_str().expect("utf-8")],
        &[],
    );
    let since = now_s() - 1;
    for i in 0..20 {
        send(&gw, "summarize", &format!("summarize doc {i:04}"), 50, None).await;
    }
    for i in 0..2 {
        send(
            &gw,
            "summarize",
            &format!("summarize long {i:04}"),
            400,
            None,
        )
        .await;
    }
    for _ in 0..5 {
        send(&gw, "faq", "what are the opening hours", 10, None).await;
    }
    for i in 0..4 {
        let out = if i < 3 { 100 } else { 10 };
        send(
            &gw,
            "extract",
            &format!("extract item {i:04}"),
            out,
            Some(16),
        )
        .await;
    }
    for i in 0..20 {
        send(&gw, "classify", &format!("classify item {i:04}"), 10, None).await;
    }
    let big = format!("classify item 9999 {}", "context ".repeat(400));
    send(&gw, "classify", &big, 10, None).await;
    let (store, _store_dir) = gw.stop();
    let until = now_s() + 2;

    // Expected values from the stored rows.
    let rows = store_table(&store);
    assert_eq!(rows.len(), 52);
    let input = |pred: &dyn Fn(&serde_json::Map<String, Value>) -> bool| -> Vec<u64> {
        rows.iter()
            .filter(|r| pred(r))
            .map(|r| r["input_tokens"].as_u64().expect("input tokens"))
            .collect()
    };
    let faq_in = input(&|r| r["request_type"] == "faq");
    assert_eq!(faq_in.len(), 5);
    let dup_input: u64 = faq_in[1..].iter().sum();
    let dup_saved = dup_input + 4 * 10;
    let small = input(&|r| {
        r["request_type"] == "classify" && r["input_tokens"].as_u64().unwrap_or(0) < 100
    });
    assert_eq!(small.len(), 20);
    assert!(small.iter().all(|&x| x == small[0]), "{small:?}");
    let big_in = input(&|r| {
        r["request_type"] == "classify" && r["input_tokens"].as_u64().unwrap_or(0) >= 100
    })[0];
    let bloat_excess = big_in - 2 * small[0];
    let overlong_excess = 2 * (400 - 64);

    let waste_json = |store: &std::path::Path| -> Vec<u8> {
        let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
            .args(["waste", "--store"])
            .arg(store)
            .arg("--config")
            .arg(&config)
            .args([
                "--since",
                &format!("@{since}"),
                "--until",
                &format!("@{until}"),
                "--format",
                "json",
            ])
            .output()
            .expect("run tokenscope waste");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let stdout = waste_json(&store);
    // Same JSON from ClickHouse holding the same records (when a server is available).
    if tokenscope_clickhouse::testutil::clickhouse_or_skip() {
        let ch = tokenscope_clickhouse::testutil::ClickHouseServer::start().expect("clickhouse");
        let recs = tokenscope_store::SqliteStore::open_read_only(&store)
            .expect("sqlite")
            .records_between(0, i64::MAX)
            .expect("records");
        let url = ch.url("ts_waste_scenario");
        let c = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
        c.migrate().expect("migrate");
        c.insert(&recs).expect("insert");
        assert_eq!(
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&waste_json(std::path::Path::new(&url))),
            "SQLite and ClickHouse differ"
        );
    }
    let r: Value = serde_json::from_slice(&stdout).expect("json");
    assert_eq!(r["records"], 52, "{r:#}");

    let d = &r["duplicates"];
    assert_eq!(d["prompts"], 1, "{d:#}");
    assert_eq!(d["repeats"], 4);
    assert_eq!(d["input_tokens"], dup_input);
    assert_eq!(d["saved_tokens"], dup_saved);
    assert_eq!(d["top"][0]["requests"], 5);

    // Near-identical prompts (the gateway's sketches, numbers masked): "summarize doc N"
    // (20), "summarize long N" (2), "extract item N" (4), "classify item N" (20); each
    // group's requests after its first are what a template-aware cache would serve. The
    // bloated "classify item 9999 context …" is another prompt.
    let n = &r["near_duplicates"];
    let mut sizes: Vec<u64> = n["top"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|g| g["requests"].as_u64().expect("n"))
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [2, 4, 20, 20], "{n:#}");
    assert_eq!(n["groups"], 4);
    assert_eq!(n["requests"], 19 + 1 + 3 + 19);
    let mut expected_saved = 0u64;
    for (rt, small_only) in [("summarize", false), ("extract", false), ("classify", true)] {
        for overlong in [false, true] {
            let mut g: Vec<&serde_json::Map<String, Value>> = rows
                .iter()
                .filter(|r| r["request_type"] == rt)
                .filter(|r| !small_only || r["input_tokens"].as_u64().unwrap_or(0) < 100)
                .filter(|r| (r["output_tokens"].as_u64() == Some(400)) == overlong)
                .collect();
            if rt != "summarize" && overlong {
                continue;
            }
            g.sort_by_key(|r| {
                (
                    r["created_at"].as_i64(),
                    r["request_id"].as_str().map(str::to_owned),
                )
            });
            expected_saved += g
                .iter()
                .skip(1)
                .map(|r| {
                    r["input_tokens"].as_u64().unwrap_or(0)
                        + r["output_tokens"].as_u64().unwrap_or(0)
                })
                .sum::<u64>();
        }
    }
    assert_eq!(n["saved_tokens"], expected_saved, "{n:#}");
    assert!(n["top"][0]["top_callers"][0]["caller"] == "svc", "{n:#}");

    let types = r["request_types"].as_array().expect("types");
    let by = |name: &str| -> &Value {
        types
            .iter()
            .find(|t| t["request_type"] == name)
            .unwrap_or_else(|| panic!("no {name} in {r:#}"))
    };
    let sum = by("summarize");
    assert_eq!(sum["median_output"], 50.0);
    assert_eq!(sum["p99_stop_output"], 50);
    assert_eq!(sum["suggested_max_tokens"], 64);
    assert_eq!(sum["overlong"], 2);
    assert_eq!(sum["overlong_excess_tokens"], overlong_excess);
    let ex = by("extract");
    assert_eq!(ex["truncated"], 3);
    assert_eq!(ex["with_finish_reason"], 4);
    assert_eq!(ex["truncated_share"], 0.75);
    assert_eq!(ex["truncated_output_tokens"], 48);
    assert_eq!(ex["median_max_tokens"], 16);
    let cls = by("classify");
    assert_eq!(cls["bloated"], 1, "{cls:#}");
    assert_eq!(cls["bloated_excess_tokens"], bloat_excess);
    // Fewer than 20 samples: no statistics for faq / extract.
    assert_eq!(by("faq")["suggested_max_tokens"], Value::Null);

    let saving = dup_saved + overlong_excess + bloat_excess;
    assert_eq!(r["saving"]["tokens"], saving, "{:#}", r["saving"]);
    let usd =
        (dup_input as f64 + 4.0 * 10.0 * 2.0 + overlong_excess as f64 * 2.0 + bloat_excess as f64)
            / 1e6;
    let got = r["saving"]["usd"].as_f64().expect("usd");
    assert!((got - usd).abs() < 1e-12, "{got} vs {usd}");
}
