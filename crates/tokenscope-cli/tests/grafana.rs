//! `tokenscope export grafana`, end to end against the real data sources:
//! * the binary writes exactly three dashboards (`--out DIR`), the same ones it prints as a JSON
//!   array without `--out`, and they are the library's (whose unit tests check them against the
//!   schema in `crates/tokenscope-analysis/tests/data/`);
//! * a real Prometheus server (Debian's `prometheus`, started here on loopback with a temporary
//!   data dir) scrapes the gateway's admin `/metrics` every second and evaluates the rules of
//!   `tokenscope export prometheus-rules` every second, while the gateway proxies a mixed load
//!   (two models, two request types, two business lines, three users, streaming and not, some
//!   upstream errors) to the built-in mock engine, with a recorded DCGM exporter exposition
//!   (two H100s) as its `[gpu]` source. Then every PromQL target of every panel
//!   (template variables substituted: `.*` and concrete values), every variable's
//!   `label_values` query, every recording rule's `expr` and every recorded series returns a
//!   non-empty result from Prometheus' HTTP API, and the key numbers are the load's;
//! * with a real `clickhouse-server` as the gateway's store, every SQL target (Grafana macros
//!   expanded the way the ClickHouse plugin does) runs and returns rows whose totals are the
//!   load's.
//!
//! Absent Prometheus: prints SKIPPED and returns, unless `TOKENSCOPE_REQUIRE_PROMETHEUS=1`.
//! Absent ClickHouse: the SQL part is skipped the same way (`TOKENSCOPE_REQUIRE_CLICKHOUSE=1`).

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tokenscope"))
}

/// The dashboards written by `tokenscope export grafana --out DIR`, by file name.
fn export_dashboards(dir: &Path) -> Vec<(String, Value)> {
    let out = bin()
        .args(["export", "grafana", "--out"])
        .arg(dir)
        .output()
        .expect("run tokenscope export grafana");
    assert!(
        out.status.success(),
        "export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("read out dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["cost.json", "overview.json", "performance.json"]);
    ["overview.json", "performance.json", "cost.json"]
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(dir.join(f)).expect("read dashboard");
            (
                (*f).to_owned(),
                serde_json::from_str(&text).expect("dashboard JSON"),
            )
        })
        .collect()
}

#[test]
fn grafana_export_writes_three_dashboards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = export_dashboards(dir.path());
    let lib = tokenscope_analysis::grafana::dashboards(
        &tokenscope_analysis::alerts::AlertThresholds::default(),
    );
    for ((name, d), l) in files.iter().zip(&lib) {
        assert_eq!(name, l.file_name);
        assert_eq!(d, &l.dashboard, "{name}");
    }
    // Without --out: one JSON array of the same three.
    let out = bin()
        .args(["export", "grafana"])
        .output()
        .expect("run export");
    assert!(out.status.success());
    let arr: Vec<Value> = serde_json::from_slice(&out.stdout).expect("JSON array");
    let want: Vec<Value> = files.into_iter().map(|(_, d)| d).collect();
    assert_eq!(arr, want);
    // The rules' window from --config reaches the recorded series the panels read.
    let cfg = dir.path().join("gw.toml");
    std::fs::write(&cfg, "[alerts.thresholds]\nrate_window_seconds = 120\n").expect("config");
    let out = bin()
        .args(["export", "grafana", "--config"])
        .arg(&cfg)
        .output()
        .expect("run export");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("llm:ttft_seconds:p99_2m"), "{text}");
    assert!(!text.contains("llm:ttft_seconds:p99_5m"));
}

/// `None` (after a SKIPPED line) when prometheus is absent and not required.
fn prometheus_binary() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("prometheus"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if std::env::var("TOKENSCOPE_REQUIRE_PROMETHEUS").as_deref() == Ok("1") {
            panic!("prometheus is required (TOKENSCOPE_REQUIRE_PROMETHEUS=1) but not on PATH");
        }
        eprintln!("SKIPPED: prometheus not on PATH (Debian package `prometheus`)");
    }
    found
}

/// A Prometheus server on loopback, killed on drop.
struct PromProc {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for PromProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PromProc {
    /// Scrapes `targets` every second and evaluates `rules` every second.
    async fn start(binary: &Path, targets: &[String], rules: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("rules.yml"), rules).expect("write rules");
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             rule_files:\n  - rules.yml\n\
             scrape_configs:\n  - job_name: tokenscope\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(&cfg, config).expect("write prometheus.yml");
        let port = dead_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus");
        let p = PromProc { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some((200, _)) = try_get(&p.url("/-/ready")).await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready: {}",
                p.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        p
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path?query` as JSON, asserting `status: success`; returns `data`.
    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let qs: Vec<String> = query
            .iter()
            .map(|(k, v)| format!("{k}={}", pct(v)))
            .collect();
        let (status, body) = get(&self.url(&format!("{path}?{}", qs.join("&")))).await;
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path} {query:?}: {e}: {body}"));
        assert_eq!(status, 200, "{path} {query:?}: {body}");
        assert_eq!(v["status"], "success", "{path} {query:?}: {body}");
        v["data"].clone()
    }

    /// An instant query's result vector.
    async fn query(&self, promql: &str) -> Vec<Value> {
        let data = self.api("/api/v1/query", &[("query", promql)]).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// The one value of a query that returns one series.
    async fn scalar(&self, promql: &str) -> f64 {
        let r = self.query(promql).await;
        assert_eq!(r.len(), 1, "{promql}: {r:?}");
        r[0]["value"][1]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{promql}: {r:?}"))
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Grafana's interval and filter variables replaced for an instant query.
fn substitute(q: &str, filters: &[(&str, &str)]) -> String {
    let mut q = q
        .replace("$__rate_interval", "30s")
        .replace("$__interval", "5s")
        .replace("$__range", "1m");
    for (name, value) in filters {
        q = q
            .replace(&format!("${{{name}:regex}}"), value)
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    // A `$` is left only as a regex anchor (`...)$'`), never before a name or `{`.
    let unsubstituted = q
        .match_indices('$')
        .any(|(i, _)| q[i + 1..].starts_with(|c: char| c.is_alphabetic() || c == '_' || c == '{'));
    assert!(!unsubstituted, "unsubstituted variable in {q}");
    q
}

/// The ClickHouse plugin's macros expanded the way it does (over the last hour, 5 s buckets),
/// plus filters. `modern`: the server has `toStartOfInterval` (the plugin's expansion of
/// `$__timeInterval`); Debian's 18.16 lacks it, so the same 5 s buckets are computed with
/// `intDiv` there.
fn substitute_sql(q: &str, filters: &[(&str, &str)], modern: bool) -> String {
    let mut q = q.to_owned();
    let interval = if modern {
        "toStartOfInterval(toDateTime({c}), INTERVAL 5 second)"
    } else {
        "toDateTime(intDiv(toUInt32(toDateTime({c})), 5) * 5)"
    };
    for (macro_name, expand) in [
        (
            "$__timeFilter(",
            "{c} >= toDateTime(now() - INTERVAL 1 HOUR) AND {c} <= toDateTime(now() + INTERVAL 1 MINUTE)",
        ),
        ("$__timeInterval(", interval),
    ] {
        while let Some(start) = q.find(macro_name) {
            let rest = &q[start + macro_name.len()..];
            let end = rest.find(')').expect("macro closes");
            let col = rest[..end].trim().to_owned();
            let tail = rest[end + 1..].to_owned();
            q = format!("{}{}{}", &q[..start], expand.replace("{c}", &col), tail);
        }
    }
    substitute(&q, filters)
}

const MODELS: [&str; 2] = ["tsg-alpha", "tsg-beta"];
const REQUEST_TYPES: [&str; 2] = ["chat", "summary"];
const LINES: [&str; 2] = ["search", "ads"];
const USERS: [&str; 3] = ["alice", "bob", "carol"];

/// Request `i` of the load: (body, headers); every 10th asks the mock for an HTTP 500.
fn request(i: u64) -> (Value, Vec<(&'static str, &'static str)>) {
    let n = usize::try_from(i).unwrap_or(0);
    let body = json!({
        "model": MODELS[n % 2],
        "messages": [{"role": "user", "content": "word ".repeat(1 + (n % 7) * 40)}],
        "max_tokens": 4 + (n % 5) as u64 * 3,
        "stream": n % 3 != 0,
    });
    let mut headers = vec![
        ("x-tokenscope-request-type", REQUEST_TYPES[(n / 2) % 2]),
        ("x-tokenscope-business-line", LINES[(n / 4) % 2]),
        ("x-tokenscope-user", USERS[n % 3]),
    ];
    if i % 10 == 9 {
        headers.push(("x-mock-fault", "error_500"));
    }
    (body, headers)
}

/// Sends requests from `workers` tasks until `stop`; counts them in `sent`.
fn start_load(
    url: String,
    workers: u64,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|_| {
            let (url, stop, sent) = (url.clone(), stop.clone(), sent.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let i = sent.fetch_add(1, Ordering::SeqCst);
                    let (body, headers) = request(i);
                    let _ = post_json(&url, &body, &headers).await;
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
            })
        })
        .collect()
}

/// `label_values(metric{sel}, label)` → (series selector, label).
fn parse_label_values(q: &str) -> (String, String) {
    let inner = q
        .strip_prefix("label_values(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or_else(|| panic!("not label_values: {q}"));
    let (sel, label) = inner
        .rsplit_once(',')
        .expect("label_values(selector, label)");
    (sel.trim().to_owned(), label.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grafana_every_panel_query_returns_data() {
    let Some(prometheus) = prometheus_binary() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let dashboards = export_dashboards(&dir.path().join("dashboards"));
    let rules = {
        let out = bin()
            .args(["export", "prometheus-rules"])
            .output()
            .expect("export rules");
        assert!(out.status.success());
        String::from_utf8(out.stdout).expect("utf-8")
    };

    // The store: a real ClickHouse when installed (the SQL panels are checked against it).
    let ch = if clickhouse_or_skip() {
        Some(ClickHouseServer::start().expect("start clickhouse"))
    } else {
        eprintln!("SKIPPED (part): the ClickHouse SQL panels are not run");
        None
    };
    let mock = MockProc::start(&[]);
    // The GPU panels read a DCGM exporter: a recorded exposition of two H100s, served as is.
    let dcgm = Fixture::start(|_| {
        Reply::sized(
            "text/plain; version=0.0.4",
            include_str!("../../tokenscope-engine-state/tests/fixtures/dcgm_metrics.txt"),
        )
    })
    .await;
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[prices]]\nmodel = \"*\"\ninput_per_mtok = 1.0\noutput_per_mtok = 4.0\n\n\
             [[budgets]]\nbusiness_line = \"search\"\ntokens = 1000000\n\n\
             [[budgets]]\nbusiness_line = \"ads\"\nusd = 10.0\n\n\
             [gpu]\ndcgm_url = \"{}/metrics\"\ninterval_ms = 500\n",
            dcgm.url()
        ),
    )
    .expect("write gateway config");
    let mut args = vec!["--config".to_owned(), cfg.display().to_string()];
    if let Some(ch) = &ch {
        args.extend(["--store".to_owned(), ch.url("default")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &args, &[]);
    let prom = PromProc::start(&prometheus, &[gw.admin.to_string()], &rules).await;

    // Load for 15 s while Prometheus scrapes and evaluates every second.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers = start_load(
        gw.url("/v1/chat/completions"),
        4,
        stop.clone(),
        sent.clone(),
    );
    tokio::time::sleep(Duration::from_secs(15)).await;

    // While the load runs: every panel target, with "All" and with concrete filter values.
    let all: Vec<(&str, &str)> = ["model", "request_type", "upstream", "business_line"]
        .iter()
        .map(|v| (*v, ".*"))
        .collect();
    let upstream_names = {
        let m = gw.metrics().await;
        label_values(&m, "llm_engine_state_up", "upstream")
    };
    assert_eq!(upstream_names.len(), 1, "{upstream_names:?}");
    let upstream = upstream_names.iter().next().expect("one upstream").clone();
    let concrete: Vec<(&str, &str)> = vec![
        ("model", MODELS[0]),
        ("request_type", REQUEST_TYPES[1]),
        ("upstream", &upstream),
        ("business_line", LINES[0]),
    ];
    let mut checked = 0;
    let mut sql_targets = Vec::new();
    for (file, d) in &dashboards {
        for t in tokenscope_analysis::grafana::targets(d) {
            if t.datasource == tokenscope_analysis::grafana::CLICKHOUSE_TYPE {
                sql_targets.push((file.clone(), t));
                continue;
            }
            assert_eq!(t.datasource, "prometheus", "{t:?}");
            for filters in [&all, &concrete] {
                let q = substitute(&t.query, filters);
                let r = prom.query(&q).await;
                assert!(
                    !r.is_empty(),
                    "{file} / {} / {}: no data for {q}",
                    t.panel,
                    t.ref_id
                );
                checked += 1;
            }
        }
        // Every variable's label_values query finds values.
        for v in d["templating"]["list"].as_array().expect("variables") {
            if v["type"] != "query" {
                continue;
            }
            let (sel, label) = parse_label_values(v["query"]["query"].as_str().expect("query"));
            let sel = substitute(&sel, &all);
            let data = prom
                .api(
                    &format!("/api/v1/label/{label}/values"),
                    &[("match[]", &sel)],
                )
                .await;
            let got: BTreeSet<String> = data
                .as_array()
                .expect("values")
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            let want: BTreeSet<String> = match label.as_str() {
                "model" => MODELS.iter().map(|s| (*s).to_owned()).collect(),
                "request_type" => REQUEST_TYPES.iter().map(|s| (*s).to_owned()).collect(),
                "business_line" => LINES.iter().map(|s| (*s).to_owned()).collect(),
                "upstream" => upstream_names.clone(),
                other => panic!("unexpected variable label {other}"),
            };
            assert_eq!(got, want, "{file}: variable {}", v["name"]);
        }
    }
    assert!(checked >= 40, "only {checked} PromQL checks");
    // The GPU panels show the exporter's numbers (two H100s: 87 % / 45 % busy, 0.69 / 0.31
    // memory bandwidth).
    let gpu = |q: &'static str| {
        let prom = &prom;
        async move {
            let mut v: Vec<(String, f64)> = prom
                .query(q)
                .await
                .iter()
                .map(|s| {
                    (
                        s["metric"]["gpu"].as_str().unwrap_or("").to_owned(),
                        s["value"][1]
                            .as_str()
                            .and_then(|x| x.parse().ok())
                            .unwrap_or(f64::NAN),
                    )
                })
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        }
    };
    assert_eq!(
        gpu("max by (gpu) (llm_gpu_utilization_ratio)").await,
        [("0".to_owned(), 0.87), ("1".to_owned(), 0.45)]
    );
    assert_eq!(
        gpu("max by (gpu) (llm_gpu_memory_bandwidth_utilization_ratio)").await,
        [("0".to_owned(), 0.690789), ("1".to_owned(), 0.312201)]
    );

    // Every recording rule: its expression and its recorded series, evaluated by Prometheus.
    let mut recorded = Vec::new();
    let mut lines = rules.lines();
    while let Some(l) = lines.next() {
        if let Some(name) = l.trim().strip_prefix("- record: ") {
            let expr = lines
                .next()
                .and_then(|e| e.trim().strip_prefix("expr: '"))
                .and_then(|e| e.strip_suffix('\''))
                .expect("expr after record")
                .replace("''", "'");
            recorded.push((name.to_owned(), expr));
        }
    }
    assert!(recorded.len() >= 15, "{recorded:?}");
    for (name, expr) in &recorded {
        assert!(!prom.query(expr).await.is_empty(), "no data for {expr}");
        assert!(
            !prom.query(name).await.is_empty(),
            "recorded series {name} is empty (rule not evaluated?)\n{}",
            prom.log()
        );
    }
    let rule_health = prom.api("/api/v1/rules", &[("type", "record")]).await;
    for g in rule_health["groups"].as_array().expect("groups") {
        for r in g["rules"].as_array().expect("rules") {
            assert_eq!(r["health"], "ok", "{r}");
        }
    }

    // The numbers are the load's: the request rate Prometheus sees is the one sent, the
    // success ratio counts the injected 500s, engine state and budgets are there.
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs_f64()
    };
    let (ta, sent_a) = (Instant::now(), sent.load(Ordering::SeqCst));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (tb, sent_b, tb_unix) = (Instant::now(), sent.load(Ordering::SeqCst), unix_now());
    let client_rate = (sent_b - sent_a) as f64 / (tb - ta).as_secs_f64();
    // Let the scrapes of that window land, then evaluate at its end.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let data = prom
        .api(
            "/api/v1/query",
            &[
                ("query", "sum(rate(llm_requests_total[10s]))"),
                ("time", &format!("{tb_unix:.3}")),
            ],
        )
        .await;
    let qps: f64 = data["result"][0]["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{data}"));
    eprintln!(
        "grafana: {checked} PromQL panel queries, {} recording rules checked in {:.1} s of load; \
         QPS client {client_rate:.1} vs Prometheus {qps:.1}",
        recorded.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        qps > 0.7 * client_rate && qps < 1.3 * client_rate,
        "Prometheus QPS {qps} vs client {client_rate}"
    );
    let ok = prom
        .scalar(&substitute(
            "sum(rate(llm_requests_total{status=\"ok\"}[$__rate_interval])) / sum(rate(llm_requests_total[$__rate_interval]))",
            &[],
        ))
        .await;
    assert!(ok > 0.8 && ok < 0.98, "success ratio {ok} with 10 % errors");
    let kv = prom.scalar("max(llm_engine_kv_cache_usage_ratio)").await;
    assert!((0.0..=1.0).contains(&kv), "{kv}");
    let budget = prom
        .scalar("max(llm_budget_usage_ratio{business_line=\"search\"})")
        .await;
    assert!(budget > 0.0, "search budget usage {budget}");

    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.expect("load task");
    }
    let total = sent.load(Ordering::SeqCst);
    // Every request is counted once: wait for a scrape after the last one.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = prom.scalar("sum(llm_requests_total)").await;
        if (n - total as f64).abs() < 0.5 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus counts {n} requests, {total} were sent"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // The SQL panels against the real store.
    if let Some(ch) = &ch {
        gw.flush().await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let n: u64 = ch
                .query("SELECT count() FROM default.llm_inference_log FINAL")
                .trim()
                .parse()
                .expect("count");
            if n == total {
                break;
            }
            assert!(Instant::now() < deadline, "{n} of {total} rows stored");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(sql_targets.len() >= 5, "{sql_targets:?}");
        let modern = ch
            .query("SELECT count() FROM system.functions WHERE name = 'toStartOfInterval'")
            .trim()
            == "1";
        for (file, t) in &sql_targets {
            let q = substitute_sql(&t.query, &all, modern);
            let body = ch.query(&format!("{q}\nFORMAT JSON"));
            let v: Value = serde_json::from_str(&body).expect("ClickHouse JSON");
            let rows = v["data"].as_array().cloned().unwrap_or_default();
            assert!(!rows.is_empty(), "{file} / {}: no rows for\n{q}", t.panel);
            let col = |name: &str| -> Vec<&Value> { rows.iter().map(|r| &r[name]).collect() };
            let num = |x: &Value| -> f64 {
                x.as_f64()
                    .or_else(|| x.as_str().and_then(|s| s.parse().ok()))
                    .unwrap_or(0.0)
            };
            if t.panel.starts_with("Tokens and cost by") {
                let requests: f64 = col("requests").into_iter().map(num).sum();
                assert_eq!(requests, total as f64, "{}", t.panel);
                let cost: f64 = col("cost_usd_total").into_iter().map(num).sum();
                assert!(cost > 0.0, "{}: cost {cost}", t.panel);
                let keys: BTreeSet<String> = rows
                    .iter()
                    .filter_map(|r| {
                        r.get("user_label")
                            .or_else(|| r.get("line"))
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    })
                    .collect();
                let want: BTreeSet<String> = if t.panel.contains("by user") {
                    USERS.iter().map(|s| (*s).to_owned()).collect()
                } else {
                    LINES.iter().map(|s| (*s).to_owned()).collect()
                };
                assert_eq!(keys, want, "{}", t.panel);
            }
        }
        // A concrete model keeps only its rows.
        let by_user = sql_targets
            .iter()
            .find(|(_, t)| t.panel.contains("by user"))
            .expect("per-user panel");
        let q = substitute_sql(&by_user.1.query, &concrete, modern);
        let v: Value = serde_json::from_str(&ch.query(&format!("{q}\nFORMAT JSON"))).expect("JSON");
        let rows = v["data"].as_array().cloned().unwrap_or_default();
        assert!(!rows.is_empty(), "{q}");
    }
    drop(prom);
    gw.stop();
}
