//! Read-side benchmark (issue 20): the same N gateway-shaped rows in ClickHouse (a real
//! clickhouse-server started by the test harness on this machine) and in SQLite, then the
//! commands users run, as child processes of `/usr/bin/time` (wall time and the peak RSS of
//! the process that asked):
//!
//! * `tokenscope report --by model,input_bucket --since 8d`
//! * `tokenscope cost --by business_line,user --since 30d`
//! * the dashboard's 7-day overview (`GET /api/dashboard/overview?range=7d`) from a
//!   `tokenscope serve` over the same store: the page's time, and the gateway's peak RSS
//!   (`VmHWM`) and how far the page raised it; then the proxy's TTFT and end-to-end P99 under a
//!   steady streamed load (`tokenscope bench`, mock engine) in alternating rounds without and
//!   with pages being read back to back — the page must not move the proxy's P99.
//!
//! ```text
//! cargo build --release -p tokenscope-cli --bin tokenscope --example bench_read
//! target/release/examples/bench_read --rows 10000000 --bin target/release/tokenscope
//! ```
//!
//! Options: `--rows N` (default 10 000 000), `--days N` (spread of the rows, default 7),
//! `--repeat N` (runs per command, default 3: the median time and the largest RSS are
//! printed), `--bin PATH` (the `tokenscope` binary), `--skip-sqlite`, `--skip-clickhouse`.
//!
//! Data: 5 models with skewed popularity, 500 users, 8 tenants, 5 business lines, input
//! lengths over the four buckets, ~5 % errors, 75 % streamed, engine phases, stored costs on
//! half the rows; deterministic (xorshift).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokenscope_clickhouse::testutil::ClickHouseServer;
use tokenscope_clickhouse::ClickHouseStore;
use tokenscope_core::{InputBucket, Outcome, RequestRecord};
use tokenscope_store::SqliteStore;

struct Args {
    rows: u64,
    days: u64,
    repeat: usize,
    bin: String,
    sqlite: bool,
    clickhouse: bool,
}

fn args() -> Args {
    let mut a = Args {
        rows: 10_000_000,
        days: 7,
        repeat: 3,
        bin: "target/release/tokenscope".to_owned(),
        sqlite: true,
        clickhouse: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_default();
        match k.as_str() {
            "--rows" => a.rows = v().parse().unwrap_or(a.rows),
            "--days" => a.days = v().parse().unwrap_or(a.days),
            "--repeat" => a.repeat = v().parse().unwrap_or(a.repeat),
            "--bin" => a.bin = v(),
            "--skip-sqlite" => a.sqlite = false,
            "--skip-clickhouse" => a.clickhouse = false,
            other => eprintln!("ignored argument {other}"),
        }
    }
    a
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

const MODELS: [&str; 5] = [
    "llama-3-8b",
    "llama-3-70b",
    "qwen-7b",
    "mistral-7b",
    "gpt-4o",
];

fn record(i: u64, rng: &mut Rng, now: i64, span_us: i64) -> RequestRecord {
    let r = rng.next();
    let m = match r % 100 {
        0..=49 => 0,
        50..=74 => 1,
        75..=89 => 2,
        90..=96 => 3,
        _ => 4,
    };
    let input = 16 + (r >> 8) % 12_000 / (1 + (r >> 30) % 8);
    let output = 1 + (r >> 20) % 700;
    let stream = !r.is_multiple_of(4);
    let ttft = 20.0 + input as f64 * 0.08 + ((r >> 40) % 300) as f64;
    let tpot = 5.0 + ((r >> 12) % 40) as f64 * 0.5;
    RequestRecord {
        request_id: format!("{:016x}-{i:012}", i),
        trace_id: format!("{:032x}", u128::from(r) << 1 | 1),
        created_at: now - 60_000_000 - (i as i64 * 7_919_993_311) % span_us,
        model: MODELS[m].to_owned(),
        upstream: "vllm".to_owned(),
        user_id: Some(format!("user-{}", (r >> 3) % 500)),
        tenant: Some(format!("tenant-{}", (r >> 5) % 8)),
        business_line: Some(format!("bl-{}", (r >> 7) % 5)),
        request_type: "chat".to_owned(),
        stream,
        http_status: if r.is_multiple_of(20) { 502 } else { 200 },
        outcome: if r.is_multiple_of(20) {
            Outcome::UpstreamError
        } else {
            Outcome::Ok
        },
        input_tokens: Some(input),
        output_tokens: Some(output),
        cached_tokens: Some(input / 4),
        input_bucket: Some(InputBucket::of(input)),
        queue_duration_ms: Some(((r >> 44) % 200) as f64),
        prefill_duration_ms: Some(input as f64 * 0.08),
        decode_duration_ms: Some(output as f64 * tpot),
        ttft_ms: stream.then_some(ttft),
        tpot_ms: stream.then_some(tpot),
        total_duration_ms: ttft + output as f64 * tpot,
        engine_kv_usage: Some(((r >> 50) % 100) as f64 / 100.0),
        cost_usd: r
            .is_multiple_of(2)
            .then_some((input + 4 * output) as f64 * 1e-7),
        ..RequestRecord::default()
    }
}

/// Generates the rows in batches of `batch` and hands each to `sink`.
fn fill(a: &Args, batch: usize, mut sink: impl FnMut(&[RequestRecord])) -> Duration {
    let now = now_us();
    let span = a.days as i64 * 86_400_000_000;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let t = Instant::now();
    let mut buf = Vec::with_capacity(batch);
    for i in 0..a.rows {
        buf.push(record(i, &mut rng, now, span));
        if buf.len() == batch {
            sink(&buf);
            buf.clear();
        }
    }
    if !buf.is_empty() {
        sink(&buf);
    }
    t.elapsed()
}

/// Runs `tokenscope ARGS` under `/usr/bin/time` `repeat` times: (median seconds, max RSS MB).
fn measure(a: &Args, cmd: &[&str]) -> (f64, f64) {
    let mut times = Vec::new();
    let mut rss: f64 = 0.0;
    for _ in 0..a.repeat {
        let out = Command::new("/usr/bin/time")
            .args(["-f", "TIME %e %M"])
            .arg(&a.bin)
            .args(cmd)
            .env("TOKENSCOPE_LOG", "warn")
            .output()
            .expect("run /usr/bin/time");
        let err = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            panic!("{cmd:?} failed: {err}");
        }
        let line = err
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("TIME "))
            .unwrap_or_else(|| panic!("no time output: {err}"));
        let mut p = line.split_whitespace();
        let secs: f64 = p.next().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN);
        let kb: f64 = p.next().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN);
        times.push(secs);
        rss = rss.max(kb / 1024.0);
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], rss)
}

fn commands(store: &str) -> Vec<(&'static str, Vec<String>)> {
    let s = store.to_owned();
    vec![
        (
            "report --by model,input_bucket --since 8d",
            vec![
                "report".into(),
                "--store".into(),
                s.clone(),
                "--by".into(),
                "model,input_bucket".into(),
                "--since".into(),
                "8d".into(),
                "--format".into(),
                "json".into(),
            ],
        ),
        (
            "cost --by business_line,user --since 30d",
            vec![
                "cost".into(),
                "--store".into(),
                s,
                "--by".into(),
                "business_line,user".into(),
                "--since".into(),
                "30d".into(),
                "--format".into(),
                "json".into(),
            ],
        ),
    ]
}

fn run_commands(a: &Args, kind: &str, store: &str) {
    for (name, cmd) in commands(store) {
        let refs: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let (secs, rss) = measure(a, &refs);
        println!(
            "| {kind} | {} rows | `{name}` | {secs:.2} s | {rss:.0} MB |",
            a.rows
        );
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The first line the child prints on stdout.
fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready line");
    line
}

/// `GET path` over HTTP/1.1 (connection closed after); (status, body).
fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `(VmRSS, VmHWM)` of a process, MB.
fn rss_hwm_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(f64::NAN)
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// (TTFT P99, e2e P99) in ms of one `tokenscope bench` level against `proxy`.
fn load_p99(a: &Args, proxy: &str) -> (f64, f64) {
    let out = Command::new(&a.bin)
        .args(["bench", "--target"])
        .arg(format!("http://{proxy}"))
        .args([
            "--rates",
            "20",
            "--duration",
            "15s",
            "--arrival",
            "constant",
            "--stream",
            "--format",
            "json",
        ])
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run bench");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "bench output: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let level = &v[0];
    (
        level["ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
        level["e2e_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
    )
}

/// The dashboard part (see the module docs).
fn run_dashboard(a: &Args, kind: &str, store: &str) {
    let mut mock = Command::new(&a.bin)
        .args([
            "mock-engine",
            "--listen",
            "127.0.0.1:0",
            "--time-scale",
            "0.05",
        ])
        .env("TOKENSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("mock engine");
    let line = first_line(&mut mock);
    let _mock = Proc(mock);
    let mock_addr = line
        .trim()
        .strip_prefix("tokenscope mock-engine listening on ")
        .unwrap_or_else(|| panic!("mock line {line:?}"))
        .to_owned();
    let dir = tempfile::tempdir().expect("tmp");
    let mut gw = Command::new(&a.bin)
        .args(["serve", "--upstream"])
        .arg(format!("http://{mock_addr}"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--store",
            store,
        ])
        .env("TOKENSCOPE_SPOOL__DIR", dir.path().join("spool"))
        .env("TOKENSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("serve");
    let line = first_line(&mut gw);
    let pid = gw.id();
    let _gw = Proc(gw);
    let field = |name: &str| -> String {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
            .to_owned()
    };
    let (proxy, admin) = (field("proxy="), field("admin="));
    let (rss0, _) = rss_hwm_mb(pid);
    let mut times = Vec::new();
    let mut requests = 0;
    for _ in 0..a.repeat {
        let t = Instant::now();
        let (st, body) = http_get(&admin, "/api/dashboard/overview?range=7d");
        times.push(t.elapsed().as_secs_f64());
        assert_eq!(st, 200, "overview: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        requests = v["summary"]["requests"].as_u64().unwrap_or(0);
    }
    let (_, hwm) = rss_hwm_mb(pid);
    times.sort_by(f64::total_cmp);
    println!(
        "| {kind} | {} rows | dashboard overview, 7 days ({requests} requests) | {:.2} s | gateway {hwm:.0} MB peak (+{:.0} MB over its {rss0:.0} MB before the page) |",
        a.rows,
        times[times.len() / 2],
        hwm - rss0
    );
    // The proxy's P99 without and with pages read back to back, alternating rounds.
    let mut quiet = Vec::new();
    let mut busy = Vec::new();
    for round in 0..4 {
        if round % 2 == 0 {
            quiet.push(load_p99(a, &proxy));
            continue;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let pages = {
            let stop = stop.clone();
            let admin = admin.clone();
            std::thread::spawn(move || {
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let (st, _) = http_get(&admin, "/api/dashboard/overview?range=7d");
                    assert_eq!(st, 200);
                    n += 1;
                }
                n
            })
        };
        busy.push(load_p99(a, &proxy));
        stop.store(true, Ordering::Relaxed);
        let n = pages.join().expect("pages");
        eprintln!("{kind}: {n} overview pages during a load round");
    }
    let fmt = |v: &[(f64, f64)]| -> String {
        v.iter()
            .map(|(t, e)| format!("{t:.1} / {e:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "| {kind} | {} rows | proxy TTFT / e2e P99 (ms) at 20 streamed req/s, rounds without pages | {} | with 7-day pages read back to back: {} |",
        a.rows,
        fmt(&quiet),
        fmt(&busy)
    );
}

fn main() {
    let a = args();
    println!(
        "| store | rows | command | time (median of {}) | peak RSS of the CLI |",
        a.repeat
    );
    println!("|---|---|---|---|---|");
    if a.clickhouse {
        let ch = ClickHouseServer::start().expect("start clickhouse-server");
        let url = ch.url("bench_read");
        let store = ClickHouseStore::connect_url(&url).expect("connect");
        store.migrate().expect("migrate");
        let took = fill(&a, 200_000, |b| store.insert(b).expect("insert"));
        eprintln!(
            "clickhouse {}: {} rows inserted in {:.1} s",
            store.server_version(),
            a.rows,
            took.as_secs_f64()
        );
        ch.query("OPTIMIZE TABLE bench_read.llm_inference_log FINAL");
        let kind = format!("ClickHouse {}", store.server_version());
        run_commands(&a, &kind, &url);
        run_dashboard(&a, &kind, &url);
    }
    if a.sqlite {
        let dir = tempfile::tempdir().expect("tmp");
        let db = dir.path().join("bench_read.db");
        let mut s = SqliteStore::open(&db).expect("open");
        let took = fill(&a, 16_384, |b| {
            s.insert_batch(b).expect("insert");
        });
        drop(s);
        eprintln!(
            "sqlite: {} rows inserted in {:.1} s ({} MB)",
            a.rows,
            took.as_secs_f64(),
            std::fs::metadata(&db).map(|m| m.len() >> 20).unwrap_or(0)
        );
        run_commands(&a, "SQLite", &db.to_string_lossy());
        run_dashboard(&a, "SQLite", &db.to_string_lossy());
    }
}
