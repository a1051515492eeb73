//! Memory of the read side is flat in the row count: `tokenscope cost --since 30d` over a
//! store with N rows and one with 10·N rows (the same groups) peaks at the same resident size,
//! on the embedded store and on ClickHouse — the store sums, the process holds one row per
//! group. (Before the sums moved into the stores, the command loaded every record of both
//! windows: ~150 MB more at 10·N here.)
//!
//! The built-in dashboard is held to the same rule inside the serving gateway: its three
//! pages over 7 days of a store with N and with 10·N rows (same groups) raise the gateway's
//! peak RSS (`VmHWM`) by the same amount — the pages read the store's aggregates, never the
//! window's rows (before, a 7-day page over 300 000 rows peaked at 360 MB).
//!
//! Peak RSS is the child's `ru_maxrss`, read by a two-line Python wrapper (`getrusage` of
//! the children). The bound is a relation — the big store may cost at most a few MB more than
//! the small one — never an absolute size.

mod common;

use serde_json::Value;
use std::process::Command;
use tokenscope_core::{InputBucket, RequestRecord};

const N: usize = 20_000;
/// Slack for allocator and page-cache noise between two runs of the same command.
const SLACK_KB: i64 = 16 * 1024;

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// `n` records over the last 29 days: 4 business lines × 25 users × 3 models, whatever `n`.
fn records(n: usize, now: i64) -> Vec<RequestRecord> {
    let span = 29 * 86_400_000_000i64;
    (0..n)
        .map(|i| {
            let input = 50 + (i as u64 * 37) % 3_000;
            RequestRecord {
                request_id: format!("m{n}-{i:08}"),
                trace_id: format!("{:032x}", i),
                created_at: now - 60_000_000 - (i as i64 * 7_919_993) % span,
                model: ["llama-3-8b", "qwen-7b", "other"][i % 3].to_owned(),
                upstream: "u".to_owned(),
                business_line: Some(format!("bl{}", i % 4)),
                user_id: Some(format!("user{}", i % 25)),
                request_type: "chat".to_owned(),
                input_tokens: Some(input),
                output_tokens: Some(1 + i as u64 % 400),
                cached_tokens: Some(input / 3),
                input_bucket: Some(InputBucket::of(input)),
                total_duration_ms: 100.0 + (i % 1_000) as f64,
                ttft_ms: Some(20.0 + (i % 300) as f64),
                prompt_text: None,
                ..RequestRecord::default()
            }
        })
        .collect()
}

/// Runs `tokenscope cost --since 30d …` on `store`; returns (peak RSS in KB, JSON).
fn cost_peak(store: &str, config: &std::path::Path) -> (i64, Value) {
    peak(
        &[
            "cost",
            "--since",
            "30d",
            "--by",
            "business_line,user",
            "--format",
            "json",
        ],
        store,
        Some(config),
    )
}

/// Runs `tokenscope report --since 30d --by model,input_bucket` on `store`, holding at most
/// 10,000 rows' values (`TOKENSCOPE_REPORT_VALUE_BUDGET`): both row counts take their
/// percentiles from the store's sorted passes; returns (peak RSS in KB, JSON).
fn report_peak(store: &str) -> (i64, Value) {
    peak(
        &[
            "report",
            "--since",
            "30d",
            "--by",
            "model,input_bucket",
            "--format",
            "json",
        ],
        store,
        None,
    )
}

/// Runs `tokenscope ARGS --store STORE [--config CONFIG]`; returns (peak RSS in KB, JSON).
fn peak(args: &[&str], store: &str, config: Option<&std::path::Path>) -> (i64, Value) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import resource, subprocess, sys\n\
             p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)\n\
             sys.stderr.write('maxrss=%d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n\
             sys.stdout.buffer.write(p.stdout)\n\
             sys.exit(p.returncode)",
        )
        .arg(env!("CARGO_BIN_EXE_tokenscope"))
        .args(args)
        .arg("--store")
        .arg(store)
        .args(config.map(|c| ["--config".as_ref(), c.as_os_str()]).into_iter().flatten())
        .env("TOKENSCOPE_LOG", "warn")
        .env("TOKENSCOPE_REPORT_VALUE_BUDGET", "10000")
        .output()
        .expect("run python3");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let kb = err
        .lines()
        .find_map(|l| l.strip_prefix("maxrss="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no maxrss: {err}"));
    (kb, serde_json::from_slice(&out.stdout).expect("json"))
}

fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("prices.toml");
    std::fs::write(
        &p,
        "[[prices]]\nmodel = \"llama-3-8b\"\ninput_per_mtok = 0.2\noutput_per_mtok = 0.6\n\
         [[prices]]\nmodel = \"qwen*\"\ngpu_hourly_usd = 2.5\n",
    )
    .expect("config");
    p
}

fn assert_flat(kind: &str, small: (i64, Value), big: (i64, Value)) {
    let (rs, js) = small;
    let (rb, jb) = big;
    assert_eq!(js["total"]["requests"], N as u64, "{kind}: {js}");
    assert_eq!(jb["total"]["requests"], 10 * N as u64, "{kind}");
    assert_eq!(
        js["groups"].as_array().map(Vec::len),
        jb["groups"].as_array().map(Vec::len),
        "{kind}: same groups"
    );
    eprintln!(
        "{kind}: cost --since 30d peak RSS {} MB at {N} rows, {} MB at {} rows",
        rs / 1024,
        rb / 1024,
        10 * N
    );
    assert!(
        rb <= rs + SLACK_KB,
        "{kind}: peak RSS grew with the rows: {rs} KB at {N} rows, {rb} KB at {} rows",
        10 * N
    );
}

/// `report` over both stores: the same groups, every row counted, peak RSS flat.
fn assert_report_flat(kind: &str, small: (i64, Value), big: (i64, Value)) {
    let (rs, js) = small;
    let (rb, jb) = big;
    let count = |j: &Value| -> u64 {
        j.as_array()
            .map(|rows| rows.iter().filter_map(|r| r["count"].as_u64()).sum())
            .unwrap_or(0)
    };
    assert_eq!(count(&js), N as u64, "{kind}: {js}");
    assert_eq!(count(&jb), 10 * N as u64, "{kind}");
    assert_eq!(
        js.as_array().map(Vec::len),
        jb.as_array().map(Vec::len),
        "{kind}: same groups"
    );
    // Every group's percentiles are values of the group (the sorted passes found each rank).
    for row in jb.as_array().into_iter().flatten() {
        for k in ["ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"] {
            assert!(row[k].is_number(), "{kind}: {k} missing: {row}");
        }
    }
    eprintln!(
        "{kind}: report --since 30d peak RSS {} MB at {N} rows, {} MB at {} rows",
        rs / 1024,
        rb / 1024,
        10 * N
    );
    assert!(
        rb <= rs + SLACK_KB,
        "{kind}: report peak RSS grew with the rows: {rs} KB at {N} rows, {rb} KB at {} rows",
        10 * N
    );
}

#[test]
fn cost_memory_is_flat_in_rows_on_sqlite() {
    let dir = tempfile::tempdir().expect("tmp");
    let now = now_us();
    let cfg = config(dir.path());
    let (mut peaks, mut reports) = (Vec::new(), Vec::new());
    for n in [N, 10 * N] {
        let db = dir.path().join(format!("m{n}.db"));
        let mut s = tokenscope_store::SqliteStore::open(&db).expect("open");
        for chunk in records(n, now).chunks(5_000) {
            s.insert_batch(chunk).expect("insert");
        }
        drop(s);
        peaks.push(cost_peak(&db.to_string_lossy(), &cfg));
        reports.push(report_peak(&db.to_string_lossy()));
    }
    let big = peaks.pop().expect("big");
    let small = peaks.pop().expect("small");
    assert_flat("sqlite", small, big);
    let big = reports.pop().expect("big");
    let small = reports.pop().expect("small");
    assert_report_flat("sqlite", small, big);
}

#[test]
fn cost_memory_is_flat_in_rows_on_clickhouse() {
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let dir = tempfile::tempdir().expect("tmp");
    let now = now_us();
    let cfg = config(dir.path());
    let (mut peaks, mut reports) = (Vec::new(), Vec::new());
    for n in [N, 10 * N] {
        let url = ch.url(&format!("mem{n}"));
        let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
        store.migrate().expect("migrate");
        for chunk in records(n, now).chunks(20_000) {
            store.insert(chunk).expect("insert");
        }
        peaks.push(cost_peak(&url, &cfg));
        reports.push(report_peak(&url));
    }
    let big = peaks.pop().expect("big");
    let small = peaks.pop().expect("small");
    assert_flat("clickhouse", small, big);
    let big = reports.pop().expect("big");
    let small = reports.pop().expect("small");
    assert_report_flat("clickhouse", small, big);
}

/// `(VmRSS, VmHWM)` of a process, KB.
fn rss_hwm_kb(pid: u32) -> (i64, i64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| -> i64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Starts a gateway on `store` (holding at most 10 000 rows' values in a report, as the CLI
/// runs above), opens the overview, performance and cost pages for 7 days, and returns how
/// far they raised its peak RSS (KB) and the overview's JSON.
fn dashboard_growth(store: &str) -> (i64, Value) {
    let mock = common::MockProc::start(&[]);
    let gw = common::GatewayProc::start_with_args(
        Some(&mock.url()),
        &["--store", store],
        &[("TOKENSCOPE_REPORT_VALUE_BUDGET", "10000")],
    );
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let pid = gw.child.id();
    // Warm up (first connection, first store open), then measure from the settled RSS.
    let (st, body) = rt.block_on(common::get(&format!(
        "http://{}/api/dashboard/overview?range=5m",
        gw.admin
    )));
    assert_eq!(st, 200, "{body}");
    let (before, _) = rss_hwm_kb(pid);
    let mut overview = Value::Null;
    for page in ["overview", "performance", "cost"] {
        let (st, body) = rt.block_on(common::get(&format!(
            "http://{}/api/dashboard/{page}?range=7d",
            gw.admin
        )));
        assert_eq!(st, 200, "{page}: {body}");
        if page == "overview" {
            overview = serde_json::from_str(&body).expect("json");
        }
    }
    let (_, hwm) = rss_hwm_kb(pid);
    (hwm - before, overview)
}

fn assert_dashboard_flat(kind: &str, now: i64, small: (i64, Value), big: (i64, Value)) {
    let in_7d = |n: usize| -> u64 {
        let until = small.1["until"].as_f64().expect("until") * 1e6;
        records(n, now)
            .iter()
            .filter(|r| (r.created_at as f64) >= until - 7.0 * 86_400e6)
            .count() as u64
    };
    assert_eq!(
        small.1["summary"]["requests"],
        in_7d(N),
        "{kind}: {}",
        small.1
    );
    assert_eq!(big.1["summary"]["requests"], in_7d(10 * N), "{kind}");
    assert_eq!(
        big.1["slowest"].as_array().map(Vec::len),
        Some(10),
        "{kind}: the top 10"
    );
    eprintln!(
        "{kind}: 7-day dashboard pages raised the gateway's peak RSS by {} KB at {N} rows, {} KB at {} rows",
        small.0,
        big.0,
        10 * N
    );
    assert!(
        big.0 <= small.0 + SLACK_KB,
        "{kind}: the dashboard's memory grew with the rows: +{} KB at {N} rows, +{} KB at {} rows",
        small.0,
        big.0,
        10 * N
    );
}

#[test]
fn dashboard_memory_is_flat_in_rows_on_sqlite() {
    let dir = tempfile::tempdir().expect("tmp");
    let now = now_us();
    let mut growth = Vec::new();
    for n in [N, 10 * N] {
        let db = dir.path().join(format!("d{n}.db"));
        let mut s = tokenscope_store::SqliteStore::open(&db).expect("open");
        for chunk in records(n, now).chunks(5_000) {
            s.insert_batch(chunk).expect("insert");
        }
        drop(s);
        growth.push(dashboard_growth(&db.to_string_lossy()));
    }
    let big = growth.pop().expect("big");
    let small = growth.pop().expect("small");
    assert_dashboard_flat("sqlite", now, small, big);
}

#[test]
fn dashboard_memory_is_flat_in_rows_on_clickhouse() {
    use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let now = now_us();
    let mut growth = Vec::new();
    for n in [N, 10 * N] {
        let url = ch.url(&format!("dash{n}"));
        let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
        store.migrate().expect("migrate");
        for chunk in records(n, now).chunks(20_000) {
            store.insert(chunk).expect("insert");
        }
        growth.push(dashboard_growth(&url));
    }
    let big = growth.pop().expect("big");
    let small = growth.pop().expect("small");
    assert_dashboard_flat("clickhouse", now, small, big);
}
