//! `tokenscope anomalies` end to end, with the mock engine behind the real gateway.
//!
//! **Time is compressed**: the article's case unfolds over minutes to hours; here it is
//! seconds, and the command is run with `--bucket 1s` and `--min-spike-tokens 100` (the
//! default floor, 1000 tokens per bucket, suits minute-long buckets). The baseline is the
//! analysed window's own first half (`--baseline window`) or the window before it
//! (`--baseline prior --baseline-windows 1`), both recorded through the gateway too.
//!
//! * `one_callers_token_spike_and_loop_are_named`: three callers send steady traffic
//!   (4 requests/s each, distinct prompts, 20 output tokens) for 6 s; for the next 6 s
//!   `batch-job` also repeats one long prompt (≈ 600 input + 200 output tokens) every 500 ms —
//!   its tokens rise ≈ 9× (a cron bug). `anomalies` must report exactly one spike, for
//!   `batch-job` (business line `reporting`), starting in the first bucket of the second half,
//!   with 100 % of the spike excess, the loop's prompt hash as top prompt; and exactly one loop,
//!   `batch-job` on that hash, 12 requests, period 0.5 s ± 0.05 s (gateway arrival jitter is a
//!   few ms); no burst, no drop.
//!   When `clickhouse-server` is available, the stored records are copied into ClickHouse and
//!   the command's JSON from both stores must be byte-identical.
//! * `steady_growing_load_has_no_anomaly`: the same three callers for 12 s with distinct prompts,
//!   the request rate growing linearly by 20 % (tokens grow with it) → zero findings.

mod common;

use common::{post_json, GatewayProc, MockProc};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The records of `store` copied into a fresh ClickHouse database; `None` without a server.
fn clickhouse_copy(
    store: &std::path::Path,
    db: &str,
) -> Option<(tokenscope_clickhouse::testutil::ClickHouseServer, String)> {
    if !tokenscope_clickhouse::testutil::clickhouse_or_skip() {
        return None;
    }
    let ch = tokenscope_clickhouse::testutil::ClickHouseServer::start().expect("clickhouse");
    let recs = tokenscope_store::SqliteStore::open_read_only(store)
        .expect("sqlite")
        .records_between(0, i64::MAX)
        .expect("records");
    let url = ch.url(db);
    let c = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    c.migrate().expect("migrate");
    c.insert(&recs).expect("insert");
    Some((ch, url))
}

fn anomalies_json(store: &std::path::Path, since: f64, until: f64, extra: &[&str]) -> Value {
    let out = anomalies_cli(store, since, until, "json", extra);
    serde_json::from_str(&out).expect("json")
}

fn anomalies_cli(
    store: &std::path::Path,
    since: f64,
    until: f64,
    format: &str,
    extra: &[&str],
) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["anomalies", "--store"])
        .arg(store)
        .args([
            "--since",
            &format!("@{since:.6}"),
            "--until",
            &format!("@{until:.6}"),
            "--format",
            format,
            "--bucket",
            "1s",
            "--min-spike-tokens",
            "100",
        ])
        .args(extra)
        .output()
        .expect("run tokenscope anomalies");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// One scheduled request: offset from the start, caller, business line, body.
struct Planned {
    at: Duration,
    user: &'static str,
    line: &'static str,
    body: Value,
}

const CALLERS: [(&str, &str, u64); 3] = [
    ("web-app", "search", 0),
    ("mobile", "assistant", 80),
    ("batch-job", "reporting", 160),
];

fn steady_body(user: &str, i: usize) -> Value {
    json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": format!("{user} question {i:05} about the weekly numbers please")}],
        "mock_output_tokens": 20,
    })
}

/// Sends every planned request at its time (concurrently), all must answer 200.
async fn play(gw: &GatewayProc, mut plan: Vec<Planned>) {
    plan.sort_by_key(|p| p.at);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for p in plan {
        tokio::time::sleep_until(start + p.at).await;
        let url = gw.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            let (status, _, body) = post_json(
                &url,
                &p.body,
                &[
                    ("x-tokenscope-user", p.user),
                    ("x-tokenscope-business-line", p.line),
                    ("x-tokenscope-request-type", "chat"),
                ],
            )
            .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        }));
    }
    for t in tasks {
        t.await.expect("request task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_callers_token_spike_and_loop_are_named() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let mut plan = Vec::new();
    for (user, line, offset_ms) in CALLERS {
        for i in 0..48 {
            plan.push(Planned {
                at: Duration::from_millis(offset_ms + 250 * i as u64),
                user,
                line,
                body: steady_body(user, i),
            });
        }
    }
    let long_prompt = "quarterly ".repeat(200);
    for k in 0..12 {
        plan.push(Planned {
            at: Duration::from_millis(6_040 + 500 * k),
            user: "batch-job",
            line: "reporting",
            body: json!({
                "model": "mock-model",
                "messages": [{"role": "user", "content": long_prompt}],
                "mock_output_tokens": 200,
            }),
        });
    }
    let t0 = now_s();
    play(&gw, plan).await;
    let (store, _dir) = gw.stop();
    let (since, until) = (t0, t0 + 12.0);

    let r = anomalies_json(&store, since, until, &["--baseline", "window"]);
    assert_eq!(r["records"], 48 * 3 + 12, "{r:#}");
    let spikes = r["spikes"].as_array().expect("spikes");
    assert_eq!(spikes.len(), 1, "{r:#}");
    let s = &spikes[0];
    assert_eq!(s["caller"], "batch-job");
    assert_eq!(s["business_line"], "reporting");
    // The window start as the command parsed `@since` (µs).
    let since_us = r["window"]["since_us"].as_i64().expect("since_us");
    assert!((since_us as f64 - since * 1e6).abs() <= 1.0);
    assert_eq!(
        s["first_spike_us"].as_i64(),
        Some(since_us + 6_000_000),
        "{s:#}"
    );
    assert_eq!(s["share_of_excess"], 1.0);
    assert!(s["factor"].as_f64().expect("factor") > 3.0, "{s:#}");
    let loops = r["loops"].as_array().expect("loops");
    assert_eq!(loops.len(), 1, "{r:#}");
    let l = &loops[0];
    assert_eq!(l["caller"], "batch-job");
    assert_eq!(l["requests"], 12);
    let period = l["period_s"].as_f64().expect("period");
    assert!((period - 0.5).abs() <= 0.05, "period {period}");
    assert_eq!(s["top_prompt_hash"], l["prompt_hash"]);
    assert_eq!(r["bursts"].as_array().map(Vec::len), Some(0));
    assert_eq!(r["drops"].as_array().map(Vec::len), Some(0));
    assert_eq!(r["anomalies"], 2);

    // The same with the window before as baseline.
    let r2 = anomalies_json(
        &store,
        since + 6.0,
        until,
        &["--baseline", "prior", "--baseline-windows", "1"],
    );
    assert_eq!(r2["settings"]["baseline_records"], 48 * 3 / 2, "{r2:#}");
    assert_eq!(r2["spikes"].as_array().map(Vec::len), Some(1), "{r2:#}");
    assert_eq!(r2["spikes"][0]["caller"], "batch-job");
    assert_eq!(r2["loops"][0]["caller"], "batch-job");

    // Same JSON from ClickHouse holding the same records.
    if let Some((_ch, url)) = clickhouse_copy(&store, "ts_anomalies_scenario") {
        for extra in [
            vec!["--baseline", "window"],
            vec!["--baseline", "prior", "--baseline-windows", "1"],
        ] {
            let s6 = if extra[1] == "window" {
                since
            } else {
                since + 6.0
            };
            let left = anomalies_cli(&store, s6, until, "json", &extra);
            let right = anomalies_cli(std::path::Path::new(&url), s6, until, "json", &extra);
            assert_eq!(left, right, "{extra:?}: SQLite and ClickHouse differ");
        }
    }

    // The table names the caller and the period.
    let table = anomalies_cli(&store, since, until, "table", &["--baseline", "window"]);
    assert!(
        table.contains("batch-job") && table.contains("every 0.5"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn steady_growing_load_has_no_anomaly() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let mut plan = Vec::new();
    let mut sent = 0;
    for (user, line, offset_ms) in CALLERS {
        // Interval 250 ms shrinking so that the rate is 20 % higher at the end of 12 s.
        let (mut t, mut i) = (offset_ms as f64, 0);
        while t < 11_900.0 {
            plan.push(Planned {
                at: Duration::from_millis(t as u64),
                user,
                line,
                body: steady_body(user, i),
            });
            t += 250.0 / (1.0 + 0.2 * t / 12_000.0);
            i += 1;
            sent += 1;
        }
    }
    let t0 = now_s();
    play(&gw, plan).await;
    let (store, _dir) = gw.stop();
    let r = anomalies_json(&store, t0, t0 + 12.0, &["--baseline", "window"]);
    assert_eq!(r["records"], sent);
    assert_eq!(r["anomalies"], 0, "{r:#}");
}
