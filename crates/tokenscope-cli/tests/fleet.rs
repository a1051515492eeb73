//! A fleet: three gateways on one ClickHouse (`[fleet]`), the mock engine behind them, one
//! Alertmanager-style receiver for all three.
//!
//! The load is uneven on purpose — 100 requests through gateway A, 10 through B, 10 through
//! C — and the `search` budget is sized so that the fleet's usage lands at ~95 % of it while
//! no single gateway sees more than ~83 %:
//! * `report`, `cost` and the store's rows count every request once (the sum of what was sent);
//! * every gateway's `llm_budget_usage_ratio{business_line="search"}` is the fleet's (≥ 0.9);
//! * the 90 % crossing gives exactly one `LLMBudgetBurnHigh` notification, though all three
//!   gateways see it (the alert is claimed in ClickHouse before it is sent);
//! * a request that is slow for the fleet is kept by the tail sampler of gateway C, which has
//!   seen only 10 requests of its key (too few for a P99 of its own): it uses the fleet's P99.
//!
//! Without the fleet view each gateway would count its own traffic (A: 83 %, no alert at
//! all) and C would drop the slow request.

mod common;

use common::*;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};

fn chat() -> Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "stream": false,
    })
}

fn tokens_of(body: &[u8]) -> u64 {
    let v: Value = serde_json::from_slice(body).expect("json");
    v["usage"]["prompt_tokens"].as_u64().expect("prompt")
        + v["usage"]["completion_tokens"]
            .as_u64()
            .expect("completion")
}

fn firing<'a>(alerts: &'a [Value], name: &str) -> Vec<&'a Value> {
    alerts
        .iter()
        .filter(|a| a["labels"]["alertname"] == name && a.get("endsAt").is_none())
        .collect()
}

fn cli(args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run tokenscope");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_on_one_clickhouse_answer_for_the_fleet() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let rx = alert_receiver(0).await;
    let url = ch.url("ts_fleet");
    // The mock's usage for this request (the same every time): size the budget from it.
    let probe: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let (st, _, body) =
                post_json(&format!("{}/v1/chat/completions", mock.url()), &chat(), &[]).await;
            assert_eq!(st, 200);
            v.push(tokens_of(&body));
        }
        v
    };
    assert!(probe.windows(2).all(|w| w[0] == w[1]), "{probe:?}");
    let per_request = probe[0];
    let plan = [100u64, 10, 10];
    let fleet_tokens = plan.iter().sum::<u64>() * per_request;
    // The fleet ends at ~95 % of the budget; gateway A alone at ~79 %.
    let budget = (fleet_tokens as f64 / 0.95).ceil() as u64;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("fleet.toml");
    std::fs::write(
        &cfg,
        format!(
            "[pipeline]\nflush_interval_ms = 100\n\n\
             [fleet]\nrefresh_interval_ms = 300\nclaim_settle_ms = 1000\n\n\
             [alerts]\nwebhook_url = \"http://{}/api/v2/alerts\"\nevaluation_interval = \"200ms\"\n\n\
             [alerts.thresholds]\nbudget_for_seconds = 0\ntoken_anomaly_for_seconds = 3600\n\n\
             [[prices]]\nmodel = \"mock-llm\"\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\n\n\
             [[budgets]]\nbusiness_line = \"search\"\ntokens = {budget}\n",
            rx.addr
        ),
    )
    .expect("config");
    let cfg_s = cfg.to_string_lossy().into_owned();
    let dead = format!("http://127.0.0.1:{}", dead_port());
    let starts: Vec<_> = (0..3)
        .map(|_| {
            let (m, u, c, d) = (mock.url(), url.clone(), cfg_s.clone(), dead.clone());
            std::thread::spawn(move || {
                GatewayProc::start_with_args(
                    Some(&m),
                    &[
                        "--store",
                        &u,
                        "--config",
                        &c,
                        "--otlp-endpoint",
                        &d,
                        "--otlp-protocol",
                        "grpc",
                    ],
                    &[
                        ("TOKENSCOPE_TRACING__SAMPLE_RATIO", "0"),
                        ("TOKENSCOPE_TRACING__P99_MIN_SAMPLES", "50"),
                    ],
                )
            })
        })
        .collect();
    let gws: Vec<GatewayProc> = starts
        .into_iter()
        .map(|t| t.join().expect("gateway start"))
        .collect();

    // The uneven load, all of it billed to `search`.
    let mut tasks = tokio::task::JoinSet::new();
    let sem = Arc::new(tokio::sync::Semaphore::new(8));
    for (g, n) in plan.iter().enumerate() {
        for _ in 0..*n {
            let (u, sem) = (gws[g].url("/v1/chat/completions"), sem.clone());
            tasks.spawn(async move {
                let _p = sem.acquire_owned().await.expect("permit");
                let (st, _, body) =
                    post_json(&u, &chat(), &[("x-tokenscope-business-line", "search")]).await;
                assert_eq!(st, 200);
                tokens_of(&body)
            });
        }
    }
    let mut sent_tokens = 0;
    while let Some(t) = tasks.join_next().await {
        sent_tokens += t.expect("request");
    }
    assert_eq!(sent_tokens, fleet_tokens);
    for (g, gw) in gws.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = gw.metrics().await;
            if metric_sum(&m, "tokenscope_records_written_total") >= plan[g] as f64 {
                break;
            }
            assert!(Instant::now() < deadline, "gateway {g} did not write: {m}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // Every gateway's gauge becomes the fleet's usage (within a few refreshes).
    let want = fleet_tokens as f64 / budget as f64;
    for (g, gw) in gws.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let m = gw.metrics().await;
            let r = metric_where(&m, "llm_budget_usage_ratio", &[("business_line", "search")]);
            if (r - want).abs() < 1e-9 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "gateway {g}: budget ratio {r}, fleet's {want}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert!((0.9..1.0).contains(&want), "{want}");

    // One notification for the fleet: wait for it, then long enough for any duplicate.
    let deadline = Instant::now() + Duration::from_secs(20);
    while firing(&rx.alerts.lock().expect("lock"), "LLMBudgetBurnHigh").is_empty() {
        assert!(Instant::now() < deadline, "no budget alert");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let alerts = rx.alerts.lock().expect("lock").clone();
    assert_eq!(
        firing(&alerts, "LLMBudgetBurnHigh").len(),
        1,
        "one incident, one alert: {alerts:#?}"
    );
    assert!(
        firing(&alerts, "LLMBudgetExceeded").is_empty(),
        "{alerts:#?}"
    );
    assert_eq!(
        firing(&alerts, "LLMBudgetBurnHigh")[0]["labels"]["business_line"],
        "search"
    );

    // Slow for the fleet, seen by the replica that has 10 requests of its key.
    let slow_kept = |m: &str| {
        metric_where(
            m,
            "tokenscope_traces_total",
            &[("decision", "kept"), ("reason", "slow_p99")],
        )
    };
    assert_eq!(slow_kept(&gws[2].metrics().await), 0.0);
    let (st, _, _) = post_json(
        &gws[2].url("/v1/chat/completions"),
        &chat(),
        &[("x-mock-delay-ms", "400")],
    )
    .await;
    assert_eq!(st, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while slow_kept(&gws[2].metrics().await) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "gateway C dropped a request slow for the fleet"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The read side counts every request once.
    let total = plan.iter().sum::<u64>() + 1;
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric_sum(&gws[2].metrics().await, "tokenscope_records_written_total")
        < (plan[2] + 1) as f64
    {
        assert!(Instant::now() < deadline, "gateway C did not write");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = cli(&[
        "report", "--store", &url, "--since", "1h", "--format", "json",
    ]);
    assert_eq!(report[0]["count"], total, "{report}");
    assert_eq!(
        report[0]["input_tokens"].as_u64().unwrap_or(0)
            + report[0]["output_tokens"].as_u64().unwrap_or(0),
        fleet_tokens + per_request,
        "{report}"
    );
    let cost = cli(&[
        "cost", "--store", &url, "--config", &cfg_s, "--since", "1h", "--format", "json",
    ]);
    assert_eq!(cost["total"]["requests"], total, "{cost}");
    assert_eq!(
        cost["total"]["tokens"],
        fleet_tokens + per_request,
        "{cost}"
    );
    let search = cost["groups"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["key"]["business_line"] == "search"))
        .expect("search group");
    assert_eq!(search["tokens"], fleet_tokens, "{cost}");
    let budget_out = cli(&[
        "budget", "--store", &url, "--config", &cfg_s, "--since", "1h", "--format", "json",
    ]);
    let text = budget_out.to_string();
    assert!(text.contains(&fleet_tokens.to_string()), "{text}");
    for gw in gws {
        gw.stop();
    }
}

/// The live token anomaly judges the fleet: a surge spread evenly over three gateways, each of
/// which sees a token rate below `token_anomaly_min_rate` while the fleet's is above it,
/// gives exactly one `LLMTokenRateAnomaly` (before the fleet view: none — no replica alone
/// crossed the minimum).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_surge_spread_over_the_fleet_fires_one_anomaly() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let rx = alert_receiver(0).await;
    let url = ch.url("ts_fleet_tokens");
    let (st, _, body) =
        post_json(&format!("{}/v1/chat/completions", mock.url()), &chat(), &[]).await;
    assert_eq!(st, 200);
    let per_request = tokens_of(&body);
    // Per gateway N requests inside one 4 s rate window: each sees at most N·p/4 tokens/s,
    // the fleet 3·N·p/4; the minimum sits between (N·p/2).
    const N: u64 = 10;
    const WINDOW_S: u64 = 4;
    let min_rate = (N * per_request) as f64 / 2.0;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("fleet.toml");
    std::fs::write(
        &cfg,
        format!(
            "[pipeline]\nflush_interval_ms = 100\n\n\
             [fleet]\nrefresh_interval_ms = 300\nclaim_settle_ms = 1000\n\n\
             [alerts]\nwebhook_url = \"http://{}/api/v2/alerts\"\nevaluation_interval = \"200ms\"\n\n\
             [alerts.thresholds]\nrate_window_seconds = {WINDOW_S}\n\
             token_anomaly_baseline_seconds = {WINDOW_S}\ntoken_anomaly_for_seconds = 0\n\
             token_anomaly_factor = 3.0\ntoken_anomaly_min_rate = {min_rate}\n",
            rx.addr
        ),
    )
    .expect("config");
    let cfg_s = cfg.to_string_lossy().into_owned();
    let starts: Vec<_> = (0..3)
        .map(|_| {
            let (m, u, c) = (mock.url(), url.clone(), cfg_s.clone());
            std::thread::spawn(move || {
                GatewayProc::start_with_args(Some(&m), &["--store", &u, "--config", &c], &[])
            })
        })
        .collect();
    let gws: Vec<GatewayProc> = starts
        .into_iter()
        .map(|t| t.join().expect("gateway start"))
        .collect();
    // A quiet history covering the baseline (2 × 4 s) on every replica.
    tokio::time::sleep(Duration::from_secs(2 * WINDOW_S + 1)).await;
    assert!(
        firing(&rx.alerts.lock().expect("lock"), "LLMTokenRateAnomaly").is_empty(),
        "no traffic, no anomaly"
    );
    // The surge: N requests through each gateway at once.
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for gw in &gws {
        for _ in 0..N {
            let u = gw.url("/v1/chat/completions");
            tasks.spawn(async move {
                let (st, _, body) = post_json(&u, &chat(), &[]).await;
                assert_eq!(st, 200);
                tokens_of(&body)
            });
        }
    }
    let mut sent = 0;
    while let Some(t) = tasks.join_next().await {
        sent += t.expect("request");
    }
    assert_eq!(sent, 3 * N * per_request);
    let burst = started.elapsed();
    assert!(
        burst < Duration::from_secs(WINDOW_S - 1),
        "the surge took {burst:?}: not inside one rate window (machine too slow?)"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while firing(&rx.alerts.lock().expect("lock"), "LLMTokenRateAnomaly").is_empty() {
        assert!(
            Instant::now() < deadline,
            "no token anomaly for the fleet's surge: {:#?}",
            rx.alerts.lock().expect("lock")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let alerts = rx.alerts.lock().expect("lock").clone();
    let fired = firing(&alerts, "LLMTokenRateAnomaly");
    assert_eq!(fired.len(), 1, "one incident, one alert: {alerts:#?}");
    assert_eq!(fired[0]["labels"]["model"], "mock-llm", "{alerts:#?}");
    for gw in gws {
        gw.stop();
    }
}
