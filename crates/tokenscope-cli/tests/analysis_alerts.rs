//! Alert rules and the gateway's own alerting, end to end with the real binary:
//! * `tokenscope export prometheus-rules` passes `promtool check rules` and the committed unit
//!   tests (`crates/tokenscope-analysis/tests/rules/alerts_test.yml`, one test per alert);
//!   `--config` thresholds reach the rules;
//! * gateway + mock engine + an in-test Alertmanager-style receiver: an error burst lasting
//!   several evaluation intervals is exactly one firing alert (even though the first POST is
//!   refused and retried) and exactly one resolved alert; a quiet load growing 20 % is none.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tokenscope"))
}

/// `promtool ARGS`; `None` when promtool is absent and not required.
fn promtool(args: &[&str]) -> Option<(bool, String)> {
    match Command::new("promtool").args(args).output() {
        Ok(out) => {
            let mut msg = String::from_utf8_lossy(&out.stdout).into_owned();
            msg.push_str(&String::from_utf8_lossy(&out.stderr));
            Some((out.status.success(), msg))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var("TOKENSCOPE_REQUIRE_PROMTOOL").as_deref() == Ok("1") {
                panic!("promtool is required (TOKENSCOPE_REQUIRE_PROMTOOL=1) but not on PATH");
            }
            eprintln!("SKIPPED: promtool not on PATH (Debian package `prometheus`)");
            None
        }
        Err(e) => panic!("cannot run promtool: {e}"),
    }
}

fn export_rules(dir: &Path, config: Option<&Path>) -> String {
    let mut cmd = bin();
    cmd.args(["export", "prometheus-rules"]);
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let out = cmd.output().expect("run tokenscope export");
    assert!(
        out.status.success(),
        "export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout).expect("utf-8");
    std::fs::write(dir.join("rules.yml"), &yaml).expect("write rules.yml");
    yaml
}

#[test]
fn alerts_rules_pass_promtool_check_and_unit_tests() {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = export_rules(dir.path(), None);
    assert!(yaml.contains("- alert: LLMSuccessRateLow"));
    let rules = dir.path().join("rules.yml");
    let Some((ok, msg)) = promtool(&["check", "rules", rules.to_str().expect("path")]) else {
        return;
    };
    assert!(ok, "promtool check rules:\n{msg}");
    let test_src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tokenscope-analysis/tests/rules/alerts_test.yml");
    let test = dir.path().join("alerts_test.yml");
    std::fs::copy(&test_src, &test).expect("copy alerts_test.yml");
    let (ok, msg) =
        promtool(&["test", "rules", test.to_str().expect("path")]).expect("promtool ran before");
    assert!(ok, "promtool test rules:\n{msg}");
    // Every alerting rule has its test group.
    let tests = std::fs::read_to_string(&test_src).expect("read tests");
    for line in yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {line}\n")),
            "no promtool test for {line}"
        );
    }
}

#[test]
fn alerts_rules_take_thresholds_from_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        "[alerts.thresholds]\nsuccess_ratio_min = 0.995\nttft_p99_seconds = 1.5\n\
         ttft_for_seconds = 120\nrate_window_seconds = 120\n",
    )
    .expect("write config");
    let yaml = export_rules(dir.path(), Some(&cfg));
    assert!(
        yaml.contains("llm:request_success_ratio:rate2m < 0.995'"),
        "{yaml}"
    );
    assert!(yaml.contains("llm:ttft_seconds:p99_2m > 1.5'"), "{yaml}");
    assert!(yaml.contains("rate(llm_ttft_seconds_bucket[2m])"), "{yaml}");
    if let Some((ok, msg)) = promtool(&[
        "check",
        "rules",
        dir.path().join("rules.yml").to_str().expect("path"),
    ]) {
        assert!(ok, "{msg}");
    }
    // An unknown threshold is refused.
    std::fs::write(&cfg, "[alerts.thresholds]\nsucess_ratio_min = 0.9\n").expect("write");
    let out = bin()
        .args(["export", "prometheus-rules", "--config"])
        .arg(&cfg)
        .output()
        .expect("run");
    assert!(!out.status.success());
}

/// The gateway with `[alerts]` posting to `rx`, `thresholds` in `[alerts.thresholds]` and
/// `extra` TOML after them.
fn gateway_with_alerts(
    mock: &MockProc,
    rx: &AlertReceiver,
    thresholds: &str,
    extra: &str,
) -> GatewayProc {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[alerts]\nwebhook_url = \"http://{}/api/v2/alerts\"\nevaluation_interval = \
             \"200ms\"\nwebhook_timeout = \"2s\"\n\n[alerts.thresholds]\n{thresholds}\n{extra}",
            rx.addr
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--config", cfg.to_str().expect("path")],
        &[],
    );
    // The config file is read at start-up; the directory can go.
    drop(dir);
    gw
}

fn chat() -> Value {
    json!({
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "stream": false,
    })
}

/// Sends requests for `secs` seconds at `rate(elapsed)` per second; `fault(elapsed)` adds the
/// mock's `error_500` fault.
async fn load(
    url: &str,
    secs: f64,
    rate: impl Fn(f64) -> f64,
    fault: impl Fn(f64) -> bool,
) -> (u32, u32) {
    let start = Instant::now();
    let mut tasks = Vec::new();
    let mut next = 0.0_f64;
    let (mut sent, mut faulty) = (0, 0);
    while next < secs {
        let at = start + Duration::from_secs_f64(next);
        tokio::time::sleep_until(at.into()).await;
        let url = url.to_owned();
        let f = fault(next);
        sent += 1;
        faulty += u32::from(f);
        tasks.push(tokio::spawn(async move {
            let headers: &[(&str, &str)] = if f {
                &[("x-mock-fault", "error_500")]
            } else {
                &[]
            };
            post_json(&url, &chat(), headers).await.0
        }));
        next += 1.0 / rate(next);
    }
    for t in tasks {
        let _ = t.await;
    }
    (sent, faulty)
}

fn by_name<'a>(alerts: &'a [Value], name: &str) -> Vec<&'a Value> {
    alerts
        .iter()
        .filter(|a| a["labels"]["alertname"] == name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_error_burst_is_one_firing_and_one_resolved_alert() {
    let mock = MockProc::start(&[]);
    let rx = alert_receiver(1).await;
    let gw = gateway_with_alerts(
        &mock,
        &rx,
        "rate_window_seconds = 2\nsuccess_for_seconds = 1\nttft_for_seconds = 1\n\
         tpot_for_seconds = 1\nqueue_for_seconds = 1\ntoken_anomaly_for_seconds = 3600\n",
        "",
    );
    let url = gw.url("/v1/chat/completions");
    // 2 s healthy, 3 s with half the requests failing (15 evaluation intervals), 4 s healthy.
    let (sent, faulty) = load(
        &url,
        9.0,
        |_| 20.0,
        |t| (2.0..5.0).contains(&t) && ((t * 20.0).round() as u64).is_multiple_of(2),
    )
    .await;
    assert!(faulty > 10 && sent > 100, "sent {sent}, faulty {faulty}");
    // The window (2 s) forgets the burst; wait for the resolved notification.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let done = by_name(&rx.alerts.lock().expect("lock"), "LLMSuccessRateLow")
            .iter()
            .any(|a| a.get("endsAt").is_some());
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A few more evaluations: nothing else may arrive.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let alerts = rx.alerts.lock().expect("lock").clone();
    let ours = by_name(&alerts, "LLMSuccessRateLow");
    assert_eq!(ours.len(), 2, "{alerts:#?}");
    assert_eq!(
        alerts.len(),
        2,
        "only the success-rate incident: {alerts:#?}"
    );
    let (firing, resolved) = (ours[0], ours[1]);
    assert!(firing.get("endsAt").is_none(), "{firing}");
    assert_eq!(firing["labels"]["severity"], "P0");
    assert_eq!(firing["labels"]["tier"], "availability");
    assert_eq!(firing["labels"]["model"], "mock-llm");
    assert!(firing["annotations"]["description"]
        .as_str()
        .is_some_and(|d| d.contains("Success ratio of model mock-llm is")));
    assert!(firing["generatorURL"]
        .as_str()
        .is_some_and(|u| u.ends_with("/metrics")));
    assert_eq!(resolved["labels"], firing["labels"]);
    assert_eq!(resolved["startsAt"], firing["startsAt"]);
    assert!(resolved["endsAt"]
        .as_str()
        .is_some_and(|e| e > firing["startsAt"].as_str().unwrap_or("")));
    // The refused first POST was retried (same incident, no duplicate).
    assert!(*rx.posts.lock().expect("lock") >= 3);
    let m = gw.metrics().await;
    assert_eq!(
        metric_sum(&m, "tokenscope_alert_webhook_errors_total"),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, "tokenscope_alert_notifications_total{state=\"firing\"}"),
        1.0
    );
    assert_eq!(
        metric_sum(
            &m,
            "tokenscope_alert_notifications_total{state=\"resolved\"}"
        ),
        1.0
    );
    gw.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_quiet_growing_load_sends_nothing() {
    let mock = MockProc::start(&[]);
    let rx = alert_receiver(0).await;
    // Every condition evaluated with short windows, the token anomaly included.
    let gw = gateway_with_alerts(
        &mock,
        &rx,
        "rate_window_seconds = 2\nsuccess_for_seconds = 1\nttft_for_seconds = 1\n\
         tpot_for_seconds = 1\nqueue_for_seconds = 1\ntoken_anomaly_for_seconds = 1\n\
         token_anomaly_baseline_seconds = 2\n",
        "",
    );
    let url = gw.url("/v1/chat/completions");
    // 10 s of load growing 20 % (10 → 12 requests/s) with no faults.
    let (sent, _) = load(&url, 10.0, |t| 10.0 + 2.0 * t / 10.0, |_| false).await;
    assert!(sent > 90, "sent {sent}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let alerts = rx.alerts.lock().expect("lock").clone();
    assert!(alerts.is_empty(), "{alerts:#?}");
    assert_eq!(*rx.posts.lock().expect("lock"), 0);
    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "tokenscope_alert_notifications_total"), 0.0);
    assert_eq!(metric_sum(&m, "tokenscope_alert_webhook_errors_total"), 0.0);
    gw.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_budget_exceeded_fires_once_per_line_and_severity() {
    let mock = MockProc::start(&[]);
    let rx = alert_receiver(0).await;
    let gw = gateway_with_alerts(
        &mock,
        &rx,
        "budget_for_seconds = 1\ntoken_anomaly_for_seconds = 3600\n",
        "[[budgets]]\nbusiness_line = \"search\"\ntokens = 100\n\n\
         [[budgets]]\nbusiness_line = \"ads\"\ntokens = 1000000\n",
    );
    let url = gw.url("/v1/chat/completions");
    for line in ["search", "ads"] {
        for _ in 0..15 {
            post_json(&url, &chat(), &[("x-tokenscope-business-line", line)]).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while rx.alerts.lock().expect("lock").len() < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let alerts = rx.alerts.lock().expect("lock").clone();
    let exceeded = by_name(&alerts, "LLMBudgetExceeded");
    let burn = by_name(&alerts, "LLMBudgetBurnHigh");
    assert_eq!(
        (exceeded.len(), burn.len(), alerts.len()),
        (1, 1, 2),
        "{alerts:#?}"
    );
    assert_eq!(exceeded[0]["labels"]["business_line"], "search");
    assert_eq!(exceeded[0]["labels"]["severity"], "P1");
    assert_eq!(burn[0]["labels"]["severity"], "P2");
    assert_eq!(burn[0]["labels"]["tier"], "cost");
    gw.stop();
}
