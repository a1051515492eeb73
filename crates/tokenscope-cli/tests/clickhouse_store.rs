//! The real `tokenscope` binary against a real `clickhouse-server` (Debian's, started by the
//! harness on loopback): durable delivery through outages, crashes and store errors, a
//! two-shard `Distributed` cluster fed by two gateways, and reports identical to the embedded
//! store's.
//!
//! Absent server: each test prints SKIPPED and returns, unless `TOKENSCOPE_REQUIRE_CLICKHOUSE=1`
//! (set by `.ci/run`), which turns absence into a failure.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseCluster, ClickHouseServer};

fn chat(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 6,
        "stream": stream,
    })
}

/// One client request; `(status, request id, latency)`.
async fn one_request(gw_url: &str, i: usize) -> (u16, String, Duration) {
    let t0 = Instant::now();
    let model = ["ch-a", "ch-b", "ch-c"][i % 3];
    let (status, headers, _body) = post_json(
        gw_url,
        &chat(model, i.is_multiple_of(2)),
        &[("x-user-id", "u1")],
    )
    .await;
    let id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (status, id, t0.elapsed())
}

type Results = Arc<std::sync::Mutex<Vec<(Instant, u16, String, Duration)>>>;

/// Steady load from `workers` tasks, each pausing `pause` between requests, until `stop`.
fn start_load(
    url: String,
    workers: usize,
    pause: Duration,
    stop: Arc<AtomicBool>,
    out: Results,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..workers)
        .map(|w| {
            let (url, stop, out) = (url.clone(), stop.clone(), out.clone());
            tokio::spawn(async move {
                let mut i = w;
                while !stop.load(Ordering::SeqCst) {
                    let (st, id, lat) = one_request(&url, i).await;
                    out.lock()
                        .expect("results")
                        .push((Instant::now(), st, id, lat));
                    i += workers;
                    tokio::time::sleep(pause).await;
                }
            })
        })
        .collect()
}

/// Polls the gateway's metrics until `pred` holds (or panics after `secs`).
async fn wait_metrics(gw: &GatewayProc, secs: u64, what: &str, pred: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let m = gw.metrics().await;
        if pred(&m) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; metrics:\n{}",
            m.lines()
                .filter(|l| l.starts_with("tokenscope_") && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn p99(mut v: Vec<Duration>) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let k = (v.len() * 99).div_ceil(100).max(1) - 1;
    v[k]
}

/// `count()` and `uniqExact(request_id)` with `FINAL` (what every tokenscope read sees).
fn counts(ch: &ClickHouseServer, table: &str) -> (u64, u64) {
    let out = ch.query(&format!(
        "SELECT count(), uniqExact(request_id) FROM {table} FINAL"
    ));
    let mut it = out
        .split_whitespace()
        .map(|s| s.parse::<u64>().expect("count"));
    (it.next().expect("count"), it.next().expect("uniq"))
}

/// Raw rows after forcing every merge: duplicates of a retried batch would show here.
/// Rows left once every part is merged. A row's late updates (the gateway's per-step marks,
/// engine spans) are newer versions of it under the same key, so the raw count equals the
/// number of distinct rows only after a merge; `OPTIMIZE … FINAL` does nothing while a
/// background merge runs, so it is repeated (up to 20 times, 0.5 s apart) until the raw count
/// stops above the `FINAL` count. Rows the merge cannot collapse (a replay under another key)
/// stay and fail the caller's comparison.
fn raw_after_merge(ch: &ClickHouseServer, table: &str) -> u64 {
    let count = |sql: String| -> u64 { ch.query(&sql).trim().parse().expect("count") };
    let mut raw = 0;
    for _ in 0..20 {
        ch.query(&format!("OPTIMIZE TABLE {table} FINAL"));
        raw = count(format!("SELECT count() FROM {table}"));
        if raw == count(format!("SELECT count() FROM {table} FINAL")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    raw
}

fn stored_ids(ch: &ClickHouseServer, table: &str) -> HashSet<String> {
    ch.query(&format!("SELECT request_id FROM {table} FINAL"))
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clickhouse_outage_of_30s_keeps_exactly_n_rows() {
    if !clickhouse_or_skip() {
        return;
    }
    let mut ch = ClickHouseServer::start().expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let url = ch.url("ts_outage");
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--store", &url],
        &[("TOKENSCOPE_PIPELINE__RETRY_BACKOFF_MAX_MS", "1000")],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let results: Results = Default::default();
    let load = start_load(
        gw.url("/v1/chat/completions"),
        4,
        Duration::from_millis(40),
        stop.clone(),
        results.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let down_at = Instant::now();
    ch.stop();
    tokio::time::sleep(Duration::from_secs(30)).await;
    ch.start_again().expect("restart clickhouse");
    let up_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.expect("load task");
    }
    let results = results.lock().expect("results").clone();
    let n = results.len();
    assert!(n > 300, "too little load: {n}");
    let failed: Vec<_> = results.iter().filter(|r| r.1 != 200).collect();
    assert!(failed.is_empty(), "client requests failed: {failed:?}");
    let sent: HashSet<String> = results.iter().map(|r| r.2.clone()).collect();
    assert_eq!(sent.len(), n);

    // Everything reaches ClickHouse once the spool is replayed.
    wait_metrics(&gw, 60, "spool replayed", |m| {
        metric_sum(m, "tokenscope_spool_batches") == 0.0
            && metric_sum(m, "tokenscope_records_written_total") == n as f64
    })
    .await;
    let table = "ts_outage.llm_inference_log";
    assert_eq!(counts(&ch, table), (n as u64, n as u64), "exactly N rows");
    assert_eq!(stored_ids(&ch, table), sent, "every client request stored");
    assert_eq!(raw_after_merge(&ch, table), n as u64, "no duplicate rows");

    let m = gw.metrics().await;
    assert_eq!(metric_sum(&m, "tokenscope_records_lost_total"), 0.0);
    assert_eq!(metric_sum(&m, "tokenscope_records_dropped_total"), 0.0);
    assert!(metric_sum(&m, "tokenscope_records_spooled_total") > 0.0);
    assert!(metric_sum(&m, "tokenscope_records_replayed_total") > 0.0);
    assert!(
        metric_where(
            &m,
            "tokenscope_store_errors_total",
            &[("kind", "unavailable")]
        ) > 0.0
    );
    assert!(metric_sum(&m, "tokenscope_store_retries_total") > 0.0);
    assert_eq!(metric_sum(&m, "tokenscope_store_up"), 1.0);
    assert_eq!(
        metric_sum(&m, "tokenscope_spool_oldest_unsent_age_seconds"),
        0.0
    );

    // The request path did not feel the outage (printed; the benchmark measures it properly).
    let lat = |f: &dyn Fn(Instant) -> bool| -> Vec<Duration> {
        results.iter().filter(|r| f(r.0)).map(|r| r.3).collect()
    };
    let before = p99(lat(&|t| t < down_at));
    let during = p99(lat(&|t| t > down_at + Duration::from_secs(1) && t < up_at));
    eprintln!("client P99 before the outage {before:?}, during {during:?} ({n} requests)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_under_load_then_restart_replays_every_spooled_record_once() {
    if !clickhouse_or_skip() {
        return;
    }
    let mut ch = ClickHouseServer::start().expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let url = ch.url("ts_kill");
    let mut gw = GatewayProc::start_with_args(Some(&mock.url()), &["--store", &url], &[]);
    let spool_dir = gw.dir.path().join("spool");
    ch.stop();
    let stop = Arc::new(AtomicBool::new(false));
    let results: Results = Default::default();
    let load = start_load(
        gw.url("/v1/chat/completions"),
        4,
        Duration::from_millis(10),
        stop.clone(),
        results.clone(),
    );
    // Under load, with the store down, until a good number of records sit in the spool.
    wait_metrics(&gw, 60, "records spooled", |m| {
        metric_sum(m, "tokenscope_records_spooled_total") >= 300.0
    })
    .await;
    let spooled = metric_sum(&gw.metrics().await, "tokenscope_records_spooled_total") as u64;
    gw.kill(); // SIGKILL: no drain, no shutdown
    stop.store(true, Ordering::SeqCst);
    for t in load {
        let _ = t.await;
    }
    let sent: HashSet<String> = results
        .lock()
        .expect("results")
        .iter()
        .map(|r| r.2.clone())
        .collect();

    ch.start_again().expect("restart clickhouse");
    let spool_env = spool_dir.to_string_lossy().into_owned();
    let gw2 = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--store", &url],
        &[("TOKENSCOPE_SPOOL__DIR", &spool_env)],
    );
    wait_metrics(&gw2, 60, "spool replayed after restart", |m| {
        metric_sum(m, "tokenscope_spool_batches") == 0.0
            && metric_sum(m, "tokenscope_records_replayed_total") >= spooled as f64
    })
    .await;
    let table = "ts_kill.llm_inference_log";
    let (count, uniq) = counts(&ch, table);
    assert_eq!(count, uniq, "no record twice");
    assert!(
        count >= spooled,
        "every spooled record is back: {count} stored, {spooled} spooled before the kill"
    );
    let stored = stored_ids(&ch, table);
    assert!(
        stored.is_subset(&sent),
        "only records of requests that were made"
    );
    assert_eq!(raw_after_merge(&ch, table), count, "no duplicate rows");
    let m = gw2.metrics().await;
    assert_eq!(metric_sum(&m, "tokenscope_records_lost_total"), 0.0);
    drop(gw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_failure_and_dropped_table_spool_then_recover_by_themselves() {
    if !clickhouse_or_skip() {
        return;
    }
    let mut ch = ClickHouseServer::builder()
        .user("ts", "s3cret")
        .start()
        .expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let url = ch.url_as("ts", "ts_err");
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--store", &url],
        &[("TOKENSCOPE_PIPELINE__RETRY_BACKOFF_MAX_MS", "500")],
    );
    let target = gw.url("/v1/chat/completions");
    let table = "ts_err.llm_inference_log";
    let mut sent = 0usize;
    for i in 0..20 {
        assert_eq!(one_request(&target, i).await.0, 200);
        sent += 1;
    }
    wait_metrics(&gw, 20, "first rows written", |m| {
        metric_sum(m, "tokenscope_records_written_total") == 20.0
    })
    .await;

    // The password is rotated server-side: writes fail with an auth error and spool.
    ch.set_password("ts", "rotated");
    for i in 0..20 {
        assert_eq!(one_request(&target, i).await.0, 200, "clients never see it");
        sent += 1;
    }
    wait_metrics(&gw, 30, "auth errors counted, rows spooled", |m| {
        metric_where(m, "tokenscope_store_errors_total", &[("kind", "auth")]) > 0.0
            && metric_sum(m, "tokenscope_spool_batches") > 0.0
            && metric_sum(m, "tokenscope_store_up") == 0.0
    })
    .await;
    // Fixed server-side: the spool drains with no operator action on the gateway.
    ch.set_password("ts", "s3cret");
    wait_metrics(&gw, 60, "spool drained after the auth fix", |m| {
        metric_sum(m, "tokenscope_spool_batches") == 0.0
            && metric_sum(m, "tokenscope_records_written_total") == sent as f64
    })
    .await;
    assert_eq!(counts(&ch, table), (40, 40));

    // The table is dropped under the gateway: it is recreated and writing resumes.
    ch.query(&format!("DROP TABLE {table}"));
    for i in 0..20 {
        assert_eq!(one_request(&target, i).await.0, 200);
        sent += 1;
    }
    wait_metrics(&gw, 60, "rows written after the table was recreated", |m| {
        metric_sum(m, "tokenscope_spool_batches") == 0.0
            && metric_sum(m, "tokenscope_records_written_total") == sent as f64
    })
    .await;
    assert_eq!(counts(&ch, table), (20, 20), "the rows sent after the drop");
    let m = gw.metrics().await;
    assert!(metric_where(&m, "tokenscope_store_errors_total", &[("kind", "schema")]) > 0.0);
    assert_eq!(metric_sum(&m, "tokenscope_records_lost_total"), 0.0);
}

/// Runs `tokenscope report` and returns stdout (panics with stderr on failure).
fn report_cli(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .arg("report")
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run tokenscope report");
    assert!(
        out.status.success(),
        "tokenscope report {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_shards_and_two_gateways_report_every_request() {
    if !clickhouse_or_skip() {
        return;
    }
    let cluster = ClickHouseCluster::start_two_shards().expect("start cluster");
    let mock = MockProc::start(&[]);
    let (url0, url1) = (cluster.url(0, "ts_dist"), cluster.url(1, "ts_dist"));
    let gw_a = GatewayProc::start_with_args(Some(&mock.url()), &["--store", &url0], &[]);
    let gw_b = GatewayProc::start_with_args(Some(&mock.url()), &["--store", &url1], &[]);
    let (ta, tb) = (
        gw_a.url("/v1/chat/completions"),
        gw_b.url("/v1/chat/completions"),
    );
    let mut tasks = Vec::new();
    for i in 0..60 {
        let t = ta.clone();
        tasks.push(tokio::spawn(async move { one_request(&t, i).await.0 }));
    }
    for i in 0..40 {
        let t = tb.clone();
        tasks.push(tokio::spawn(async move { one_request(&t, i).await.0 }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("request"), 200);
    }
    for (gw, n) in [(&gw_a, 60.0), (&gw_b, 40.0)] {
        wait_metrics(gw, 30, "rows written", |m| {
            metric_sum(m, "tokenscope_records_written_total") == n
        })
        .await;
    }
    // Both shards hold rows; together exactly the 100 requests.
    let local = |i: usize| -> u64 {
        cluster.nodes[i]
            .query("SELECT count() FROM ts_dist.llm_inference_log_local FINAL")
            .trim()
            .parse()
            .expect("count")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while local(0) + local(1) < 100 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (s0, s1) = (local(0), local(1));
    assert_eq!(s0 + s1, 100, "shards hold {s0} + {s1}");
    assert!(s0 > 0 && s1 > 0, "both shards used: {s0} / {s1}");
    // The report through either entry node counts every request, grouped or not.
    for url in [&url0, &url1] {
        let out = report_cli(&["--store", url, "--since", "1h", "--format", "json"]);
        let rows: Vec<Value> = serde_json::from_str(&out).expect("json");
        assert_eq!(rows.len(), 1, "{out}");
        assert_eq!(rows[0]["count"], 100, "{out}");
        let out = report_cli(&[
            "--store", url, "--since", "1h", "--by", "model", "--format", "json",
        ]);
        let rows: Vec<Value> = serde_json::from_str(&out).expect("json");
        let total: u64 = rows
            .iter()
            .map(|r| r["count"].as_u64().expect("count"))
            .sum();
        assert_eq!(total, 100, "{out}");
    }
}

/// Deterministic, varied records over the last two days (some fields missing).
fn parity_records(now_us: i64) -> Vec<tokenscope_core::RequestRecord> {
    use tokenscope_core::{Endpoint, Outcome, PhaseSource, RequestRecord, TokenSource};
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    (0..3000)
        .map(|i| {
            let r = next();
            let input = 10 + r % 5000;
            let streamed = r % 4 != 0;
            let outcome = match r % 23 {
                0 => Outcome::UpstreamError,
                1 => Outcome::Timeout,
                2 => Outcome::Cancelled,
                _ => Outcome::Ok,
            };
            let ttft = 20.0 + (r % 997) as f64 * 1.25 + input as f64 * 0.01;
            RequestRecord {
                request_id: format!("req-{i:06}"),
                trace_id: format!("{:032x}", u128::from(r) * 31 + i as u128),
                created_at: now_us - ((r >> 8) % (2 * 86_400_000_000)) as i64,
                model: ["llama-3-8b", "qwen-7b", "gemma-2b", "it's \"odd\"\tname"]
                    [(r >> 3) as usize % 4]
                    .to_owned(),
                upstream: "up".to_owned(),
                user_id: (r % 7 != 0).then(|| format!("user-{}", (r >> 5) % 40)),
                tenant: (r % 3 == 0).then(|| "acme".to_owned()),
                request_type: "chat".to_owned(),
                endpoint: Endpoint::ChatCompletions,
                stream: streamed,
                http_status: if outcome == Outcome::Ok { 200 } else { 502 },
                outcome,
                input_tokens: Some(input),
                output_tokens: (r % 11 != 0).then_some(1 + (r >> 9) % 400),
                cached_tokens: (r % 5 == 0).then_some(input / 2),
                input_tokens_source: TokenSource::Usage,
                output_tokens_source: TokenSource::Usage,
                input_bucket: Some(tokenscope_core::InputBucket::of(input)),
                ttft_ms: streamed.then_some(ttft),
                tpot_ms: streamed.then_some(5.0 + (r % 91) as f64 / 7.0),
                total_duration_ms: ttft + (r % 3000) as f64 / 3.0,
                queue_duration_ms: (r % 2 == 0).then_some((r % 300) as f64 / 3.0),
                prefill_duration_ms: (r % 2 == 0).then_some(ttft / 2.0),
                decode_duration_ms: (r % 2 == 0).then_some(100.0 + (r % 50) as f64),
                queue_source: PhaseSource::Engine,
                engine: Some(["vllm", "llamacpp"][(r >> 11) as usize % 2].to_owned()),
                engine_kv_usage: (r % 4 != 1).then_some(((r >> 13) % 1000) as f64 / 999.0),
                gpu_utilization: (r % 5 != 1).then_some(((r >> 17) % 101) as f64 / 100.0),
                // Replicas of the one upstream, and records from before replicas (empty).
                replica: ["10.0.0.1:8000", "10.0.0.2:8000", ""][(r >> 21) as usize % 3].to_owned(),
                ..RequestRecord::default()
            }
        })
        .collect()
}

#[test]
fn reports_are_identical_on_the_embedded_store_and_clickhouse() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let now_us = now_s * 1_000_000;
    let records = parity_records(now_us);

    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("parity.db");
    let mut sqlite = tokenscope_store::SqliteStore::open(&db).expect("sqlite");
    sqlite.insert_batch(&records).expect("sqlite insert");
    drop(sqlite);

    let url = ch.url("ts_parity");
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    store.insert(&records).expect("insert");
    // A retried batch: the report must still count each request once.
    store.insert(&records[..500]).expect("insert again");

    let since = format!("@{}", now_s - 3 * 86_400);
    let until = format!("@{}", now_s + 60);
    let db_s = db.to_string_lossy().into_owned();
    let base = ["--since", since.as_str(), "--until", until.as_str()];
    let cases: Vec<Vec<&str>> = vec![
        vec!["--format", "json"],
        vec!["--by", "model,user", "--format", "json"],
        vec![
            "--by",
            "input_bucket,stream,status",
            "--interval",
            "6h",
            "--format",
            "csv",
        ],
        vec!["--by", "engine,kv_band,gpu_band", "--format", "json"],
        vec!["--by", "replica,stream", "--format", "json"],
        vec![
            "--by",
            "model",
            "--filter",
            "replica=10.0.0.2:8000",
            "--format",
            "csv",
        ],
        vec![
            "--by",
            "tenant",
            "--filter",
            "model=llama-3-8b",
            "--filter",
            "user=(none)",
            "--format",
            "json",
        ],
        vec![
            "--by",
            "model",
            "--filter",
            "kv_band=80-95%",
            "--filter",
            "stream=true",
            "--format",
            "table",
        ],
    ];
    for case in cases {
        let mut a: Vec<&str> = vec!["--store", &db_s];
        a.extend(base);
        a.extend(case.iter().copied());
        let mut b: Vec<&str> = vec!["--store", &url];
        b.extend(base);
        b.extend(case.iter().copied());
        let (left, right) = (report_cli(&a), report_cli(&b));
        assert!(
            left.lines().count() > 1 || left.contains("count"),
            "empty report for {case:?}: {left}"
        );
        assert_eq!(
            left, right,
            "report {case:?} differs between SQLite and ClickHouse"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_started_together_share_one_server() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let mock = MockProc::start(&[]);
    let url = ch.url("ts_replicas");
    // Both replicas start (and migrate a fresh database) at the same moment.
    let starts: Vec<_> = (0..2)
        .map(|_| {
            let (m, u) = (mock.url(), url.clone());
            std::thread::spawn(move || {
                GatewayProc::start_with_args(Some(&m), &["--store", &u], &[])
            })
        })
        .collect();
    let gws: Vec<GatewayProc> = starts
        .into_iter()
        .map(|t| t.join().expect("gateway start"))
        .collect();
    let mut tasks = Vec::new();
    for (g, gw) in gws.iter().enumerate() {
        for i in 0..30 {
            let t = gw.url("/v1/chat/completions");
            tasks.push(tokio::spawn(async move { one_request(&t, i + g).await.0 }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.expect("request"), 200);
    }
    for gw in &gws {
        wait_metrics(gw, 30, "rows written", |m| {
            metric_sum(m, "tokenscope_records_written_total") == 30.0
        })
        .await;
    }
    assert_eq!(counts(&ch, "ts_replicas.llm_inference_log"), (60, 60));
    let out = report_cli(&["--store", &url, "--since", "1h", "--format", "json"]);
    let rows: Vec<Value> = serde_json::from_str(&out).expect("json");
    assert_eq!(rows[0]["count"], 60, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_started_while_clickhouse_is_down_serves_and_delivers_later() {
    if !clickhouse_or_skip() {
        return;
    }
    let mut ch = ClickHouseServer::start().expect("start clickhouse");
    let url = ch.url("ts_late");
    ch.stop();
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--store", &url],
        &[("TOKENSCOPE_PIPELINE__RETRY_BACKOFF_MAX_MS", "500")],
    );
    let target = gw.url("/v1/chat/completions");
    for i in 0..25 {
        assert_eq!(
            one_request(&target, i).await.0,
            200,
            "served without a store"
        );
    }
    wait_metrics(&gw, 20, "records spooled", |m| {
        metric_sum(m, "tokenscope_records_spooled_total") == 25.0
    })
    .await;
    ch.start_again().expect("restart clickhouse");
    wait_metrics(&gw, 60, "delivered once the server is up", |m| {
        metric_sum(m, "tokenscope_spool_batches") == 0.0
            && metric_sum(m, "tokenscope_records_written_total") == 25.0
    })
    .await;
    assert_eq!(counts(&ch, "ts_late.llm_inference_log"), (25, 25));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_days_drop_old_partitions_on_a_server_without_ttl() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let url = format!("{}?ttl_days=2", ch.url("ts_ttl"));
    // A row from five days ago, written before the gateway starts.
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64;
    let old = tokenscope_core::RequestRecord {
        request_id: "old-row".to_owned(),
        created_at: now_us - 5 * 86_400_000_000,
        model: "m".to_owned(),
        ..tokenscope_core::RequestRecord::default()
    };
    store.insert(&[old]).expect("insert old row");
    assert_eq!(counts(&ch, "ts_ttl.llm_inference_log").0, 1);

    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--store", &url], &[]);
    assert_eq!(one_request(&gw.url("/v1/chat/completions"), 0).await.0, 200);
    wait_metrics(&gw, 20, "row written", |m| {
        metric_sum(m, "tokenscope_records_written_total") == 1.0
    })
    .await;
    // The first write triggers the sweep: only today's row is left.
    let deadline = Instant::now() + Duration::from_secs(10);
    while counts(&ch, "ts_ttl.llm_inference_log").0 != 1
        || stored_ids(&ch, "ts_ttl.llm_inference_log").contains("old-row")
    {
        assert!(Instant::now() < deadline, "old partition not dropped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
