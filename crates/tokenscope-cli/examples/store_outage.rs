//! Request-path latency while the store is down.
//!
//! ```text
//! cargo run --release -p tokenscope-cli --example store_outage -- --phase-secs 20 --concurrency 16
//! ```
//!
//! One process runs the built-in mock engine, the gateway in front of it (store: a real
//! `clickhouse-server` started by the `test-util` harness, spool in a temporary directory, every
//! other setting at its default) and a closed-loop load generator: `--concurrency` workers
//! (default 16), each sending one request at a time, alternating non-streamed and streamed chat
//! completions with `max_tokens` = `--max-tokens` (default 8) to a mock engine running at
//! `--time-scale` (default 0.02, so a request takes a few milliseconds in the engine). The
//! client latency of every request is measured with `Instant` from just before the request is
//! sent to the end of its body.
//!
//! After a warm-up (`--warmup-secs`, default 5, not counted) come three phases of
//! `--phase-secs` (default 20) each, with load running throughout:
//!
//! 1. **up** — ClickHouse running;
//! 2. **down** — ClickHouse stopped (`SIGTERM`, waited for): writes fail, batches spill to the
//!    spool;
//! 3. **back** — ClickHouse started again on the same data: the spool replays while the load
//!    continues.
//!
//! The time it takes to stop and to restart the server lies between the phases; requests that
//! start then are reported on their own rows (`stopping`, `starting`), not in a phase. A request
//! belongs to the window in which it started. Per window: requests, req/s, client P50 / P90 /
//! P99 / P99.9 / max (exact nearest rank over all samples), errors (anything but a complete 200
//! answer), and from the gateway's `/metrics` at the window's end the spooled / replayed /
//! lost / dropped record counters (cumulative, summed over labels), the spool's batch gauge and
//! the mean of `tokenscope_gateway_overhead` over the window (Δsum / Δcount; arrival to the
//! request leaving for the upstream). A second table splits P50 / P99 / P99.9 by kind
//! (non-streamed, streamed) and gives the CPU used over the window by this process, by the
//! ClickHouse server (found in `/proc` by its config path) and by the whole machine. Each window
//! is also printed as one `RESULT {json}` line, with its five slowest requests (latency, start
//! offset in the window, streamed or not).
//!
//! At the end the load stops, the example waits for the spool and queue to drain, and checks
//! that the store holds exactly one row per 200-answered request (`SELECT count() FROM
//! db.llm_inference_log FINAL`); it exits non-zero when it does not, or when any request failed.
//!
//! `--outage pause` hangs the server instead (`SIGSTOP`: it keeps its sockets and answers
//! nothing; writes wait for the client's timeout) and resumes it (`SIGCONT`) for **back**.
//!
//! `--store sqlite` puts the embedded SQLite store behind the gateway instead. A SQLite file
//! cannot be made to fail in the middle of a run from outside, so only the **up** phase is
//! measured then (a baseline); ClickHouse is the real case.
//!
//! The ClickHouse server runs in its own process group and is killed when this program ends
//! (also on Ctrl-C and on errors). Logging follows `TOKENSCOPE_LOG` (default `warn`).

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
use tokenscope_gateway::{Gateway, GatewayConfig};

/// The ClickHouse database the gateway writes to.
const DB: &str = "tokenscope_outage";
/// Longest a single request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a `/metrics` scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the spool may take to drain after the load stops.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    Clickhouse,
    Sqlite,
}

/// How the store goes down.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Outage {
    /// `SIGTERM`, waited for (connections refused), then started again on the same data.
    Stop,
    /// `SIGSTOP` (a hung server: connections accepted, nothing answered), then `SIGCONT`.
    Pause,
}

#[derive(Parser)]
#[command(about = "Gateway request-path latency while the store is up, down and back")]
struct Args {
    /// Length of each phase (up, down, back), seconds.
    #[arg(long, default_value_t = 20)]
    phase_secs: u64,
    /// Closed-loop workers (requests in flight at once).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Store behind the gateway (sqlite: the "up" phase only).
    #[arg(long, value_enum, default_value_t = StoreKind::Clickhouse)]
    store: StoreKind,
    /// How ClickHouse goes down in the "down" phase.
    #[arg(long, value_enum, default_value_t = Outage::Stop)]
    outage: Outage,
    /// Warm-up before the first phase, not counted, seconds.
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
    /// Mock engine time scale (smaller = faster engine).
    #[arg(long, default_value_t = 0.02)]
    time_scale: f64,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u64,
}

/// One request as the client saw it.
struct Sample {
    start: Instant,
    latency: Duration,
    ok: bool,
    stream: bool,
}

/// A window of the run: samples that started in `[from, to)`, metrics scraped at both ends.
struct Window {
    name: &'static str,
    from: Instant,
    to: Instant,
    start: Metrics,
    end: Metrics,
    cpu_start: Cpu,
    cpu_end: Cpu,
}

/// CPU counters at one instant, in clock ticks (`USER_HZ`, 100 per second on Linux).
#[derive(Clone, Copy, Default)]
struct Cpu {
    /// This process, user + system (`/proc/self/stat`).
    process: u64,
    /// All CPUs, not idle (`/proc/stat`: everything but idle and iowait).
    machine_busy: u64,
    /// All CPUs, all states.
    machine_total: u64,
    /// The ClickHouse server: `(pid, user + system ticks)`, when it runs.
    clickhouse: Option<(u32, u64)>,
}

/// utime + stime of `/proc/<pid>/stat` (all threads), in ticks.
fn proc_ticks(stat_path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // Fields after the parenthesised command name; utime and stime are fields 14, 15.
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    (f.len() == 2).then(|| f.iter().sum())
}

/// The ClickHouse server whose command line names `config` (the harness starts it with
/// `--config-file=<its dir>/config.xml`): `(pid, ticks)`.
fn clickhouse_ticks(config: &str) -> Option<(u32, u64)> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(config) {
            if let Some(t) = proc_ticks(&format!("/proc/{pid}/stat")) {
                return Some((pid, t));
            }
        }
    }
    None
}

impl Cpu {
    /// Reads the counters; zeros where `/proc` cannot be read (then the CPU columns say 0).
    fn now(clickhouse_config: Option<&str>) -> Self {
        let mut c = Cpu {
            process: proc_ticks("/proc/self/stat").unwrap_or(0),
            clickhouse: clickhouse_config.and_then(clickhouse_ticks),
            ..Cpu::default()
        };
        if let Ok(stat) = std::fs::read_to_string("/proc/stat") {
            if let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) {
                let f: Vec<u64> = line
                    .split_whitespace()
                    .skip(1)
                    .take(8)
                    .filter_map(|v| v.parse().ok())
                    .collect();
                c.machine_total = f.iter().sum();
                let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
                c.machine_busy = c.machine_total.saturating_sub(idle);
            }
        }
        c
    }
}

/// Everything noted at a window boundary.
struct Mark {
    at: Instant,
    metrics: Metrics,
    cpu: Cpu,
}

/// A `/metrics` scrape: metric name → value summed over its label sets.
#[derive(Clone, Default)]
struct Metrics(HashMap<String, f64>);

impl Metrics {
    fn parse(text: &str) -> Self {
        let mut m: HashMap<String, f64> = HashMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some(i) = line.find(['{', ' ']) else {
                continue;
            };
            let (name, mut rest) = line.split_at(i);
            if rest.starts_with('{') {
                match rest.rfind('}') {
                    Some(j) => rest = &rest[j + 1..],
                    None => continue,
                }
            }
            if let Some(v) = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
            {
                *m.entry(name.to_owned()).or_default() += v;
            }
        }
        Self(m)
    }

    fn get(&self, name: &str) -> Result<f64> {
        self.0
            .get(name)
            .copied()
            .with_context(|| format!("metric {name} missing from /metrics"))
    }
}

/// Per-window numbers.
struct Stats {
    n: usize,
    errors: usize,
    secs: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
    max: f64,
    /// The 5 slowest: `(latency ms, start in s after the window's start, streamed)`.
    slowest: Vec<(f64, f64, bool)>,
    /// `[P50, P99, P99.9]` of the non-streamed requests alone.
    plain: [f64; 3],
    /// `[P50, P99, P99.9]` of the streamed requests alone.
    streamed: [f64; 3],
    overhead_mean_us: Option<f64>,
    /// CPU of this process (gateway + mock + load generator) over the window, % of one core.
    process_cpu_pct: f64,
    /// Busy share of all CPUs of the machine over the window, %.
    machine_busy_pct: f64,
    /// CPU of the ClickHouse server over the window, % of one core: measured when the same
    /// server process ran at both ends, 0 when none ran, unknown across a stop or restart.
    clickhouse_cpu_pct: Option<f64>,
    spooled: f64,
    replayed: f64,
    spool_batches: f64,
    lost: f64,
    dropped: f64,
}

/// Exact nearest rank (`tokenscope_core::query::nearest_rank`: the `k`-th smallest with
/// `k = ⌈q·n⌉`, `1 ≤ k ≤ n`) of `q_per_100k` parts per 100 000; NaN without values.
fn nearest_rank(sorted: &[f64], q_per_100k: u64) -> f64 {
    tokenscope_core::query::nearest_rank(sorted, q_per_100k as f64 / 100_000.0).unwrap_or(f64::NAN)
}

/// `[P50, P99, P99.9]` of a sorted slice.
fn p50_99_999(sorted: &[f64]) -> [f64; 3] {
    [
        nearest_rank(sorted, 50_000),
        nearest_rank(sorted, 99_000),
        nearest_rank(sorted, 99_900),
    ]
}

fn stats(w: &Window, samples: &[Sample]) -> Result<Stats> {
    let mut all: Vec<f64> = Vec::new();
    let mut kinds: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut errors = 0;
    let mut slowest: Vec<(f64, f64, bool)> = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.start >= w.from && s.start < w.to)
    {
        let v = s.latency.as_secs_f64() * 1e3;
        all.push(v);
        slowest.push((v, (s.start - w.from).as_secs_f64(), s.stream));
        kinds[usize::from(s.stream)].push(v);
        if !s.ok {
            errors += 1;
        }
    }
    all.sort_by(f64::total_cmp);
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    slowest.truncate(5);
    for k in &mut kinds {
        k.sort_by(f64::total_cmp);
    }
    let d = |name: &str| -> Result<f64> { Ok(w.end.get(name)? - w.start.get(name)?) };
    let d_count = d("tokenscope_gateway_overhead_seconds_count")?;
    let overhead_mean_us = (d_count > 0.0)
        .then(|| d("tokenscope_gateway_overhead_seconds_sum").map(|s| s / d_count * 1e6))
        .transpose()?;
    Ok(Stats {
        n: all.len(),
        errors,
        secs: (w.to - w.from).as_secs_f64(),
        p50: nearest_rank(&all, 50_000),
        p90: nearest_rank(&all, 90_000),
        p99: nearest_rank(&all, 99_000),
        p999: nearest_rank(&all, 99_900),
        max: all.last().copied().unwrap_or(f64::NAN),
        slowest,
        plain: p50_99_999(&kinds[0]),
        streamed: p50_99_999(&kinds[1]),
        overhead_mean_us,
        process_cpu_pct: (w.cpu_end.process.saturating_sub(w.cpu_start.process)) as f64
            / (w.to - w.from).as_secs_f64(),
        machine_busy_pct: 100.0
            * (w.cpu_end
                .machine_busy
                .saturating_sub(w.cpu_start.machine_busy)) as f64
            / (w.cpu_end
                .machine_total
                .saturating_sub(w.cpu_start.machine_total))
            .max(1) as f64,
        clickhouse_cpu_pct: match (w.cpu_start.clickhouse, w.cpu_end.clickhouse) {
            (Some((p0, t0)), Some((p1, t1))) if p0 == p1 => {
                Some(t1.saturating_sub(t0) as f64 / (w.to - w.from).as_secs_f64())
            }
            (None, None) => Some(0.0),
            _ => None,
        },
        spooled: w.end.get("tokenscope_records_spooled_total")?,
        replayed: w.end.get("tokenscope_records_replayed_total")?,
        spool_batches: w.end.get("tokenscope_spool_batches")?,
        lost: w.end.get("tokenscope_records_lost_total")?,
        dropped: w.end.get("tokenscope_records_dropped_total")?,
    })
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn scrape(client: &HttpClient, admin: SocketAddr) -> Result<Metrics> {
    let req = http::Request::get(format!("http://{admin}/metrics"))
        .body(Full::new(Bytes::new()))
        .context("building the /metrics request")?;
    let text = tokio::time::timeout(SCRAPE_TIMEOUT, async {
        let resp = client.request(req).await.context("GET /metrics")?;
        if resp.status() != http::StatusCode::OK {
            bail!("GET /metrics: status {}", resp.status());
        }
        let body = resp.into_body().collect().await.context("/metrics body")?;
        Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
    })
    .await
    .context("GET /metrics timed out")??;
    Ok(Metrics::parse(&text))
}

/// One closed-loop worker: a request at a time until `stop`, alternating non-streamed and
/// streamed.
async fn worker(
    client: HttpClient,
    url: String,
    first: usize,
    bodies: [Bytes; 2],
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let mut out = Vec::with_capacity(64 * 1024);
    let mut i = first;
    while !stop.load(Ordering::Relaxed) {
        let stream = i % 2 == 1;
        i += 1;
        let req = match http::Request::post(url.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(bodies[usize::from(stream)].clone()))
        {
            Ok(r) => r,
            Err(_) => break,
        };
        let start = Instant::now();
        let ok = tokio::time::timeout(REQUEST_TIMEOUT, async {
            let Ok(resp) = client.request(req).await else {
                return false;
            };
            let status = resp.status();
            match resp.into_body().collect().await {
                Ok(body) => {
                    let body = body.to_bytes();
                    status == http::StatusCode::OK
                        && (!stream || body.ends_with(b"data: [DONE]\n\n"))
                }
                Err(_) => false,
            }
        })
        .await
        .unwrap_or(false);
        out.push(Sample {
            start,
            latency: start.elapsed(),
            ok,
            stream,
        });
    }
    out
}

/// Runs a blocking harness call on the server in `slot` (moved to a blocking thread and back).
/// On a timeout the server stays with the blocking call and is killed when that call returns.
async fn with_server<T: Send + 'static>(
    slot: &mut Option<ClickHouseServer>,
    limit: Duration,
    what: &str,
    f: impl FnOnce(&mut ClickHouseServer) -> T + Send + 'static,
) -> Result<T> {
    let mut server = slot.take().context("the ClickHouse server is gone")?;
    let task = tokio::task::spawn_blocking(move || {
        let r = f(&mut server);
        (server, r)
    });
    let (server, r) = tokio::time::timeout(limit, task)
        .await
        .with_context(|| format!("{what}: timed out after {limit:?}"))?
        .with_context(|| format!("{what}: panicked"))?;
    *slot = Some(server);
    Ok(r)
}

async fn clickhouse_count(slot: &mut Option<ClickHouseServer>, sql: &'static str) -> Result<u64> {
    let (status, body) = with_server(slot, Duration::from_secs(90), "count query", move |s| {
        s.try_query_as("default", "", sql)
    })
    .await?;
    if status != 200 {
        bail!("{sql}: status {status}: {body}");
    }
    body.trim()
        .parse()
        .with_context(|| format!("{sql}: unexpected answer {body:?}"))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

fn ms(v: f64) -> String {
    format!("{v:.2}")
}

async fn run(args: Args) -> Result<bool> {
    if args.phase_secs == 0 || args.concurrency == 0 {
        bail!("--phase-secs and --concurrency must be at least 1");
    }
    let tmp = tempfile::Builder::new()
        .prefix("tokenscope-outage-")
        .tempdir()
        .context("creating a temporary directory")?;
    let load_start = loadavg();
    println!(
        "store_outage: store={} outage={} phase={}s warmup={}s concurrency={} time_scale={} max_tokens={} cpus={} loadavg={}",
        match args.store {
            StoreKind::Clickhouse => "clickhouse",
            StoreKind::Sqlite => "sqlite",
        },
        match args.outage {
            Outage::Stop => "stop",
            Outage::Pause => "pause",
        },
        args.phase_secs,
        args.warmup_secs,
        args.concurrency,
        args.time_scale,
        args.max_tokens,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_start,
    );

    // The store.
    let mut server: Option<ClickHouseServer> = None;
    let sqlite_path = tmp.path().join("tokenscope.db");
    let store = match args.store {
        StoreKind::Clickhouse => {
            if !clickhouse_or_skip() {
                bail!("clickhouse-server is not installed (scripts/install-clickhouse.sh), or use --store sqlite");
            }
            let s = tokio::time::timeout(
                Duration::from_secs(90),
                tokio::task::spawn_blocking(ClickHouseServer::start),
            )
            .await
            .context("starting clickhouse-server timed out")?
            .context("starting clickhouse-server panicked")?
            .context("starting clickhouse-server")?;
            let url = s.url(DB);
            server = Some(s);
            url
        }
        StoreKind::Sqlite => sqlite_path.display().to_string(),
    };

    // The mock engine: one slot per worker, so the engine itself never queues.
    let mock_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let mock_addr = mock_listener.local_addr()?;
    let (mock_stop, mock_rx) = tokio::sync::oneshot::channel::<()>();
    let mock = tokio::spawn(tokenscope_mock::serve(
        mock_listener,
        tokenscope_mock::MockConfig {
            slots: args.concurrency,
            time_scale: args.time_scale,
            ..tokenscope_mock::MockConfig::default()
        },
        async move {
            let _ = mock_rx.await;
        },
    ));

    // The gateway.
    let mut cfg = GatewayConfig {
        listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        store,
        ..GatewayConfig::default()
    };
    cfg.spool.dir = Some(tmp.path().join("spool").display().to_string());
    cfg.set_single_upstream(&format!("http://{mock_addr}"));
    let gw = tokio::time::timeout(Duration::from_secs(90), Gateway::bind(cfg))
        .await
        .context("binding the gateway timed out")?
        .context("binding the gateway")?;
    let proxy = gw.proxy_addr();
    let admin = gw.admin_addr();
    let (gw_stop, gw_rx) = tokio::sync::oneshot::channel::<()>();
    let gateway = tokio::spawn(gw.run(async move {
        let _ = gw_rx.await;
    }));

    // The load.
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(args.concurrency * 2)
        .build(connector);
    let body = |stream: bool| {
        Bytes::from(
            serde_json::json!({
                "model": "mock-llm",
                "stream": stream,
                "max_tokens": args.max_tokens,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Say a few words about token latency."}
                ]
            })
            .to_string(),
        )
    };
    let bodies = [body(false), body(true)];
    let stop = Arc::new(AtomicBool::new(false));
    let url = format!("http://{proxy}/v1/chat/completions");
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            tokio::spawn(worker(
                client.clone(),
                url.clone(),
                w,
                bodies.clone(),
                stop.clone(),
            ))
        })
        .collect();

    // The timeline.
    let phase = Duration::from_secs(args.phase_secs);
    tokio::time::sleep(Duration::from_secs(args.warmup_secs)).await;
    let mut windows: Vec<Window> = Vec::new();
    let ch_config = server
        .as_ref()
        .map(|s| format!("--config-file={}", s.dir().join("config.xml").display()));
    let mut mark = Mark {
        at: Instant::now(),
        cpu: Cpu::now(ch_config.as_deref()),
        metrics: scrape(&client, admin).await?,
    };
    let mut close = |name: &'static str, mark: &mut Mark, end: Metrics| {
        let next = Mark {
            at: Instant::now(),
            cpu: Cpu::now(ch_config.as_deref()),
            metrics: end,
        };
        windows.push(Window {
            name,
            from: mark.at,
            to: next.at,
            start: mark.metrics.clone(),
            end: next.metrics.clone(),
            cpu_start: mark.cpu,
            cpu_end: next.cpu,
        });
        *mark = next;
    };
    tokio::time::sleep(phase).await;
    close("up", &mut mark, scrape(&client, admin).await?);
    let mut transitions = Vec::new();
    if args.store == StoreKind::Clickhouse {
        let t = Instant::now();
        let outage = args.outage;
        with_server(
            &mut server,
            Duration::from_secs(60),
            "stopping",
            move |s| match outage {
                Outage::Stop => s.stop(),
                Outage::Pause => s.pause(),
            },
        )
        .await?;
        transitions.push((
            match outage {
                Outage::Stop => "stop",
                Outage::Pause => "pause",
            },
            t.elapsed(),
        ));
        close("stopping", &mut mark, scrape(&client, admin).await?);
        tokio::time::sleep(phase).await;
        close("down", &mut mark, scrape(&client, admin).await?);
        let t = Instant::now();
        with_server(
            &mut server,
            Duration::from_secs(90),
            "restarting",
            move |s| match outage {
                Outage::Stop => s.start_again(),
                Outage::Pause => {
                    s.resume();
                    Ok(())
                }
            },
        )
        .await?
        .context("restarting clickhouse-server")?;
        transitions.push((
            match outage {
                Outage::Stop => "start_again",
                Outage::Pause => "resume",
            },
            t.elapsed(),
        ));
        close("starting", &mut mark, scrape(&client, admin).await?);
        tokio::time::sleep(phase).await;
        close("back", &mut mark, scrape(&client, admin).await?);
    }
    stop.store(true, Ordering::Relaxed);
    let load_stopped = Instant::now();
    let mut samples = Vec::new();
    for w in workers {
        let s = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(10), w)
            .await
            .context("a load worker did not stop")?
            .context("a load worker panicked")?;
        samples.extend(s);
    }
    let sent = samples.len() as u64;
    let ok_total = samples.iter().filter(|s| s.ok).count() as u64;
    let failed_total = sent - ok_total;

    // Report.
    println!();
    for (what, d) in &transitions {
        println!("clickhouse {what}: {:.2} s", d.as_secs_f64());
    }
    println!(
        "{:<9} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6} {:>9} {:>8} {:>8} {:>7} {:>5} {:>7}",
        "window",
        "reqs",
        "req/s",
        "p50ms",
        "p90ms",
        "p99ms",
        "p99.9ms",
        "maxms",
        "errors",
        "ovhd_us",
        "spooled",
        "replayed",
        "sp_bat",
        "lost",
        "dropped"
    );
    let mut results: Vec<(&str, Stats)> = Vec::new();
    for w in &windows {
        let s = stats(w, &samples)?;
        println!(
            "{:<9} {:>7} {:>7.0} {:>7} {:>7} {:>7} {:>7} {:>8} {:>6} {:>9} {:>8} {:>8} {:>7} {:>5} {:>7}",
            w.name,
            s.n,
            s.n as f64 / s.secs,
            ms(s.p50),
            ms(s.p90),
            ms(s.p99),
            ms(s.p999),
            ms(s.max),
            s.errors,
            s.overhead_mean_us.map_or("-".to_owned(), |v| format!("{v:.1}")),
            s.spooled,
            s.replayed,
            s.spool_batches,
            s.lost,
            s.dropped
        );
        results.push((w.name, s));
    }
    let find = |name: &str| results.iter().find(|(n, _)| *n == name).map(|(_, s)| s);
    println!(
        "\nby kind, ms          non-streamed P50 / P99 / P99.9     streamed P50 / P99 / P99.9"
    );
    for (name, s) in &results {
        println!(
            "{:<9} {:>14} {:>8} {:>8}    {:>14} {:>8} {:>8}    {:>5.0} {:>5} {:>5.0}",
            name,
            ms(s.plain[0]),
            ms(s.plain[1]),
            ms(s.plain[2]),
            ms(s.streamed[0]),
            ms(s.streamed[1]),
            ms(s.streamed[2]),
            s.process_cpu_pct,
            s.clickhouse_cpu_pct
                .map_or("-".to_owned(), |v| format!("{v:.0}")),
            s.machine_busy_pct
        );
    }
    for (name, s) in &results {
        println!(
            "RESULT {}",
            serde_json::json!({
                "window": name, "secs": s.secs, "requests": s.n,
                "rps": s.n as f64 / s.secs, "p50_ms": s.p50, "p90_ms": s.p90, "p99_ms": s.p99,
                "p999_ms": s.p999, "max_ms": s.max, "errors": s.errors,
                "plain_p50_p99_p999_ms": s.plain, "streamed_p50_p99_p999_ms": s.streamed,
                "overhead_mean_us": s.overhead_mean_us,
                "process_cpu_pct": s.process_cpu_pct, "machine_busy_pct": s.machine_busy_pct,
                "clickhouse_cpu_pct": s.clickhouse_cpu_pct,
                "spooled": s.spooled,
                "replayed": s.replayed, "spool_batches": s.spool_batches, "lost": s.lost,
                "dropped": s.dropped,
                "slowest_ms_at_s_streamed": s.slowest,
            })
        );
    }
    if let (Some(up), Some(down)) = (find("up"), find("down")) {
        println!(
            "P99(down)/P99(up) = {:.3}   P99.9(down)/P99.9(up) = {:.3}",
            down.p99 / up.p99,
            down.p999 / up.p999
        );
    }
    if let (Some(up), Some(back)) = (find("up"), find("back")) {
        println!("P99(back)/P99(up) = {:.3}", back.p99 / up.p99);
    }

    // Drain, then compare the store with what the clients got.
    let mut pass = failed_total == 0;
    let mut rows = None;
    let mut rows_raw = None;
    if args.store == StoreKind::Clickhouse {
        let deadline = load_stopped + DRAIN_TIMEOUT;
        loop {
            let m = scrape(&client, admin).await?;
            let drained = m.get("tokenscope_spool_batches")? == 0.0
                && m.get("tokenscope_records_queued")? == 0.0;
            if drained {
                let n = clickhouse_count(
                    &mut server,
                    "SELECT count() FROM tokenscope_outage.llm_inference_log FINAL",
                )
                .await?;
                if n >= sent || Instant::now() > deadline {
                    rows = Some(n);
                    break;
                }
            } else if Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        println!(
            "drain: {:.1} s after the load stopped",
            load_stopped.elapsed().as_secs_f64()
        );
        rows_raw = Some(
            clickhouse_count(
                &mut server,
                "SELECT count() FROM tokenscope_outage.llm_inference_log",
            )
            .await?,
        );
    }
    let _ = gw_stop.send(());
    let summary = tokio::time::timeout(Duration::from_secs(120), gateway)
        .await
        .context("gateway shutdown timed out")?
        .context("gateway task panicked")?
        .context("gateway")?;
    let _ = mock_stop.send(());
    if tokio::time::timeout(Duration::from_secs(10), mock)
        .await
        .is_err()
    {
        eprintln!("warning: the mock engine did not stop within 10 s");
    }
    if args.store == StoreKind::Sqlite {
        let conn = rusqlite::Connection::open_with_flags(
            &sqlite_path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .context("opening the SQLite store")?;
        let n: i64 = conn
            .query_row("SELECT count(*) FROM llm_inference_log", [], |r| r.get(0))
            .context("counting rows")?;
        rows = Some(n as u64);
    }
    println!(
        "gateway shutdown: written={} dropped={} lost={} spooled_batches_left={}",
        summary.store.written,
        summary.store.dropped,
        summary.store.lost,
        summary.store.spooled_batches
    );
    println!(
        "requests: sent={sent} ok(200)={ok_total} failed={failed_total} (warm-up and transitions included)"
    );
    match rows {
        Some(n) if n == ok_total => println!(
            "store rows: {n}{} = 200-answered requests: OK",
            rows_raw.map_or(String::new(), |r| format!(
                " (FINAL; {r} before deduplication)"
            ))
        ),
        Some(n) => {
            println!(
                "store rows: {n}{} != 200-answered requests {ok_total}: FAIL",
                rows_raw.map_or(String::new(), |r| format!(
                    " (FINAL; {r} before deduplication)"
                ))
            );
            pass = false;
        }
        None => {
            println!("store did not drain within {DRAIN_TIMEOUT:?}: FAIL");
            pass = false;
        }
    }
    if failed_total > 0 {
        println!("{failed_total} requests failed: FAIL");
    }
    println!("loadavg: start {load_start}, end {}", loadavg());
    drop(server);
    Ok(pass)
}

fn main() -> Result<ExitCode> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("TOKENSCOPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // Ctrl-C drops `run`, and with it the ClickHouse server (killed on drop).
    let pass = rt.block_on(async {
        tokio::select! {
            r = run(args) => r,
            _ = tokio::signal::ctrl_c() => bail!("interrupted"),
        }
    })?;
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
