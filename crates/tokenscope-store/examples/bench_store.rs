//! Embedded-store benchmark: insert throughput through `insert_batch`, report latency, and
//! the pipeline's hot-path cost.
//!
//! ```text
//! cargo run --release -p tokenscope-store --example bench_store -- --rows 1000000
//! ```
//!
//! Options: `--rows N` (default 1 000 000), `--batch N` (insert batch size, default 16 384:
//! the size the writer should use under load; `--batch 1024` for the pipeline's old default),
//! `--days N` (time span of the synthetic data, default 7), `--db PATH` (keep the database
//! there instead of a temp dir), `--pipeline-rows N` (records pushed through
//! `spawn_pipeline`, default 200 000, 0 to skip), `--repeat N` (runs per report, default 3),
//! `--reuse` (with `--db`: keep the existing database and only run the reports; `--rows` must
//! match how it was filled), `--drop-index NAME` (repeatable: drop that index right after
//! opening, to measure what it costs on insert), `--update-every N` (after the inserts, one
//! late engine update per N rows through `apply_updates`, default 10, 0 to skip; the writer
//! remembers every row's trace id for it — capacity 1 048 576, not the gateway's default
//! 65 536, so updates to rows from the whole run find them; `--trace-rows N` changes it),
//! `--pragma NAME=VALUE` (repeatable: run `PRAGMA NAME=VALUE` on the writer after opening,
//! e.g. `cache_size=-262144`). Besides wall time inside `insert_batch`, the insert phase's
//! process CPU time (user + sys, `/proc/self/stat`) is printed: the load-independent cost.
//!
//! The data is deterministic (fixed-seed xorshift): 5 models with skewed popularity, 500
//! users (skewed), 8 tenants, 5 business lines, 75 % streamed, ~5 % errors, input lengths
//! spread over the four buckets, TTFT growing with input length, engine phases, engine and GPU
//! state at arrival (KV usage skewed high: all four KV bands), random trace ids, time-ordered
//! ids like the gateway's UUIDv7s. After the inserts, late engine updates go through
//! `apply_updates`; reports (a)–(d) include the phase split and an `engine,kv_band` grouping;
//! the pipeline run mixes in engine updates (some before their record).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokenscope_core::{
    Endpoint, InputBucket, Outcome, PhaseSource, PhaseUpdate, RequestRecord, TokenSource,
};
use tokenscope_store::{
    run_report, spawn_pipeline, Dimension, NoopObserver, PipelineConfig, ReportQuery, SqliteStore,
};

struct Args {
    rows: u64,
    batch: usize,
    days: u64,
    db: Option<String>,
    pipeline_rows: u64,
    repeat: usize,
    reuse: bool,
    drop_index: Vec<String>,
    pragma: Vec<String>,
    exec: Vec<String>,
    update_every: u64,
    trace_rows: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        rows: 1_000_000,
        batch: 16_384,
        days: 7,
        db: None,
        pipeline_rows: 200_000,
        repeat: 3,
        reuse: false,
        drop_index: Vec::new(),
        pragma: Vec::new(),
        exec: Vec::new(),
        update_every: 10,
        trace_rows: 1 << 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |s: String| {
            s.replace('_', "")
                .parse::<u64>()
                .map_err(|e| format!("{e}"))
        };
        match flag.as_str() {
            "--rows" => a.rows = num(val()?)?,
            "--batch" => a.batch = num(val()?)?.max(1) as usize,
            "--days" => a.days = num(val()?)?.max(1),
            "--db" => a.db = Some(val()?),
            "--pipeline-rows" => a.pipeline_rows = num(val()?)?,
            "--repeat" => a.repeat = num(val()?)?.max(1) as usize,
            "--reuse" => a.reuse = true,
            "--update-every" => a.update_every = num(val()?)?,
            "--trace-rows" => a.trace_rows = num(val()?)? as usize,
            "--drop-index" => a.drop_index.push(val()?),
            "--pragma" => a.pragma.push(val()?),
            "--exec" => a.exec.push(val()?),
            "-h" | "--help" => {
                return Err(
                    "usage: bench_store [--rows N] [--batch N] [--days N] [--db PATH] \
                            [--pipeline-rows N] [--repeat N] [--reuse] [--drop-index NAME]… \
                            [--pragma NAME=VALUE]… [--update-every N] [--trace-rows N]"
                        .to_owned(),
                )
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Skewed towards 0 (a few heavy users / popular models).
    fn skewed(&mut self, n: u64) -> u64 {
        let x = self.f();
        ((x * x * x) * n as f64) as u64 % n.max(1)
    }
}

const MODELS: [&str; 5] = [
    "llama-3.1-8b-instruct",
    "qwen2.5-7b-instruct",
    "mistral-small-24b",
    "deepseek-r1-distill-32b",
    "gpt-oss-20b",
];
const UPSTREAMS: [&str; 3] = ["vllm-a", "vllm-b", "llamacpp-1"];
const ENGINES: [&str; 3] = ["vllm", "vllm", "llamacpp"];
const BUSINESS: [&str; 5] = ["search", "support", "coding", "marketing", "internal"];

struct Gen {
    rng: Rng,
    start_us: i64,
    step_us: i64,
    i: u64,
}

impl Gen {
    fn new(rows: u64, days: u64, end_us: i64) -> Self {
        let span = (days * 86_400_000_000) as i64;
        Self {
            rng: Rng(0x9e37_79b9_7f4a_7c15),
            start_us: end_us - span,
            step_us: (span / rows.max(1) as i64).max(1),
            i: 0,
        }
    }

    fn record(&mut self) -> RequestRecord {
        let r = &mut self.rng;
        let i = self.i;
        self.i += 1;
        let created_at = self.start_us + i as i64 * self.step_us + r.below(1000) as i64;
        let model_ix = r.skewed(MODELS.len() as u64) as usize;
        let user = r.skewed(500);
        let stream = r.f() < 0.75;
        // Input lengths: log-uniform 16 .. ~12k tokens.
        let input = (16.0 * (r.f() * 6.6).exp()) as u64;
        let output = 10 + r.below(800);
        let cached = if r.f() < 0.3 { input / 2 } else { 0 };
        let roll = r.f();
        let (outcome, status, error_type) = if roll < 0.02 {
            (Outcome::UpstreamError, 502, Some("upstream_5xx"))
        } else if roll < 0.035 {
            (Outcome::Timeout, 504, Some("timeout"))
        } else if roll < 0.045 {
            (Outcome::ClientError, 400, Some("bad_request"))
        } else if roll < 0.05 {
            (Outcome::Cancelled, 499, Some("client_disconnect"))
        } else {
            (Outcome::Ok, 200, None)
        };
        let ok = outcome == Outcome::Ok;
        let queue = r.f() * 50.0 * (1.0 + input as f64 / 2000.0);
        let prefill = 5.0 + input as f64 * 0.08 * (1.0 + model_ix as f64 * 0.3);
        let tpot = 8.0 + r.f() * 20.0 + model_ix as f64 * 3.0;
        let ttft = queue + prefill + r.f() * 10.0;
        let total = if ok {
            ttft + tpot * (output - 1) as f64
        } else {
            r.f() * 30_000.0
        };
        let template = r.below(2000);
        RequestRecord {
            request_id: format!(
                "{:012x}-7{:03x}-{:016x}",
                created_at / 1000,
                i & 0xfff,
                r.next()
            ),
            trace_id: format!("{:016x}{:016x}", r.next(), r.next()),
            created_at,
            model: MODELS[model_ix].to_owned(),
            model_served: ok.then(|| format!("org/{}", MODELS[model_ix])),
            upstream: UPSTREAMS[(i % 3) as usize].to_owned(),
            user_id: Some(format!("user-{user:04}")),
            tenant: Some(format!("tenant-{}", user % 8)),
            business_line: Some(BUSINESS[(user % 5) as usize].to_owned()),
            request_type: "chat".to_owned(),
            api_key_id: Some(format!("k_{:08x}", user * 2_654_435_761 % (1 << 32))),
            endpoint: Endpoint::ChatCompletions,
            stream,
            http_status: status,
            outcome,
            error_type: error_type.map(str::to_owned),
            finish_reason: ok.then(|| "stop".to_owned()),
            max_tokens: Some(1024),
            input_tokens: Some(input),
            output_tokens: ok.then_some(output),
            cached_tokens: Some(cached),
            reasoning_tokens: None,
            input_tokens_source: TokenSource::Usage,
            output_tokens_source: if ok {
                TokenSource::Usage
            } else {
                TokenSource::None
            },
            input_bucket: Some(InputBucket::of(input)),
            queue_duration_ms: Some(queue),
            prefill_duration_ms: Some(prefill),
            decode_duration_ms: ok.then_some(total - ttft),
            queue_source: PhaseSource::Engine,
            prefill_source: PhaseSource::Engine,
            decode_source: PhaseSource::Derived,
            ttft_ms: (stream && ok).then_some(ttft),
            tpot_ms: (stream && ok && output >= 2).then_some(tpot),
            itl_max_ms: (stream && ok).then_some(tpot * 3.0),
            itl_mean_ms: (stream && ok).then_some(tpot),
            total_duration_ms: total,
            upstream_headers_ms: Some(2.0 + r.f() * 5.0),
            gateway_overhead_ms: Some(0.05 + r.f() * 0.2),
            chunks: (stream && ok).then_some(output),
            prompt_hash: Some(format!(
                "{:032x}",
                u128::from(template) * 0x9e37_79b9_7f4a_7c15
            )),
            prompt_text: None,
            draft_tokens: None,
            draft_accepted_tokens: None,
            engine: Some(ENGINES[(i % 3) as usize].to_owned()),
            input_tokens_entry: Some(input),
            engine_running: Some(r.below(64) as f64),
            engine_waiting: Some(r.below(16) as f64),
            // KV usage skewed high: all four bands populated.
            engine_kv_usage: Some(1.0 - r.f() * r.f()),
            gpu_utilization: Some(0.5 + r.f() * 0.5),
            gpu_memory_bandwidth: Some(0.3 + r.f() * 0.6),
            cost_usd: None,
            client_request_id: None,
            cache_creation_tokens: None,
            replica: format!("10.0.0.{}:8000", i % 3),
            blocked_by_requests: None,
            blocked_by_prompt_tokens: None,
            blocked_ms: None,
            blocker_request_id: None,
            blocker_caller: None,
            blocker_business_line: None,
            blocker_prompt_tokens: None,
            prompt_sketch: None,
            ttft_unaccounted_ms: None,
            e2e_unaccounted_ms: None,
            engine_timing: None,
        }
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// User + system CPU time of this process so far (Linux `/proc/self/stat`, clock ticks
/// assumed to be 100 Hz); `None` elsewhere.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

fn fmt_rate(n: u64, d: Duration) -> String {
    format!("{:.0}", n as f64 / d.as_secs_f64().max(1e-9))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_store: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let tmp = tempfile::tempdir()?;
    let path = match &args.db {
        Some(p) if args.reuse => std::path::PathBuf::from(p),
        Some(p) => {
            let _ = std::fs::remove_file(p);
            let _ = std::fs::remove_file(format!("{p}-wal"));
            let _ = std::fs::remove_file(format!("{p}-shm"));
            std::path::PathBuf::from(p)
        }
        None => tmp.path().join("bench.db"),
    };
    let end_us = now_us();

    // ---- insert ------------------------------------------------------------------------------
    println!(
        "== insert: {} rows over {} days, batch {} → {}",
        args.rows,
        args.days,
        args.batch,
        path.display()
    );
    let mut store = SqliteStore::open(&path)?;
    store.set_trace_rows_capacity(args.trace_rows);
    for ix in &args.drop_index {
        store
            .conn()
            .execute_batch(&format!("DROP INDEX IF EXISTS {ix}"))?;
        println!("dropped index {ix}");
    }
    for p in &args.pragma {
        store.conn().execute_batch(&format!("PRAGMA {p}"))?;
        println!("PRAGMA {p}");
    }
    for sql in &args.exec {
        store.conn().execute_batch(sql)?;
        println!("exec {sql}");
    }
    if args.reuse {
        // Reports only, over the existing rows: the range must cover them.
        let (lo, hi): (i64, i64) = store.conn().query_row(
            "SELECT MIN(created_at), MAX(created_at) FROM llm_inference_log",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        drop(store);
        return reports(&args, &path, lo, hi + 1);
    }
    let mut gen = Gen::new(args.rows, args.days, end_us);
    let mut batch = Vec::with_capacity(args.batch);
    let mut insert_time = Duration::ZERO;
    let mut inserted = 0u64;
    let wall = Instant::now();
    let cpu0 = process_cpu();
    while gen.i < args.rows {
        batch.clear();
        while batch.len() < args.batch && gen.i < args.rows {
            batch.push(gen.record());
        }
        let t = Instant::now();
        inserted += store.insert_batch(&batch)? as u64;
        insert_time += t.elapsed();
    }
    let insert_cpu = process_cpu().zip(cpu0).map(|(b, a)| b.saturating_sub(a));
    // ---- late engine updates ----------------------------------------------------------------
    // One update per `--update-every` rows, by trace id, in batches of `--batch`
    // (regenerated: same seed).
    let mut gen = Gen::new(args.rows, args.days, end_us);
    if args.update_every == 0 {
        gen.i = args.rows;
    }
    let mut ups: Vec<PhaseUpdate> = Vec::new();
    let mut update_time = Duration::ZERO;
    let mut updated = 0u64;
    while gen.i < args.rows {
        let rec = gen.record();
        if gen.i.is_multiple_of(args.update_every) {
            ups.push(PhaseUpdate {
                trace_id: rec.trace_id,
                queue_duration_ms: rec.queue_duration_ms.map(|q| q * 1.1),
                prefill_duration_ms: rec.prefill_duration_ms,
                decode_duration_ms: rec.decode_duration_ms,
                input_tokens: rec.input_tokens,
                output_tokens: Some(42),
                per_step: false,
            });
        }
        if ups.len() >= args.batch || (gen.i == args.rows && !ups.is_empty()) {
            let t = Instant::now();
            updated += store.apply_updates(&ups)? as u64;
            update_time += t.elapsed();
            ups.clear();
        }
    }
    println!(
        "applied {updated} engine updates by trace id: {:.2} s in apply_updates → {} updates/s; {} left pending",
        update_time.as_secs_f64(),
        fmt_rate(updated, update_time),
        store.pending_updates()
    );
    drop(store);
    let db_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0)
        + std::fs::metadata(format!("{}-wal", path.display()))
            .map(|m| m.len())
            .unwrap_or(0);
    println!(
        "inserted {inserted} rows: {:.2} s in insert_batch → {} rows/s (wall incl. generation {:.2} s); db {:.0} MiB",
        insert_time.as_secs_f64(),
        fmt_rate(inserted, insert_time),
        wall.elapsed().as_secs_f64(),
        db_bytes as f64 / (1024.0 * 1024.0)
    );
    if let Some(cpu) = insert_cpu {
        // Process CPU (user + sys) over the insert loop, record generation included: the
        // load-independent cost, and the rate one fully available core would sustain.
        println!(
            "insert phase CPU (user+sys, incl. generation): {:.2} s → {} rows per CPU-second",
            cpu.as_secs_f64(),
            fmt_rate(inserted, cpu)
        );
    }

    let since_us = end_us - (args.days as i64 + 1) * 86_400_000_000;
    reports(&args, &path, since_us, end_us + 1)?;
    pipeline(&args, tmp.path(), end_us)
}

/// Runs each report case `--repeat` times over `[since_us, until_us)`.
fn reports(
    args: &Args,
    path: &std::path::Path,
    since_us: i64,
    until_us: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    let reader = SqliteStore::open_read_only(path)?;
    let day = Duration::from_secs(86_400);
    let cases: [(&str, Vec<Dimension>, Option<Duration>); 5] = [
        ("(a) group by model", vec![Dimension::Model], None),
        (
            "(b) group by model,input_bucket, interval 1d",
            vec![Dimension::Model, Dimension::InputBucket],
            Some(day),
        ),
        ("(c) group by user", vec![Dimension::User], None),
        (
            "(d) group by engine,kv_band",
            vec![Dimension::Engine, Dimension::KvUsageBand],
            None,
        ),
        ("(e) group by gpu_band", vec![Dimension::GpuBand], None),
    ];
    println!(
        "== reports over all {} rows ({} runs each)",
        args.rows, args.repeat
    );
    for (name, group_by, interval) in cases {
        let q = ReportQuery {
            since_us,
            until_us: Some(until_us),
            group_by,
            interval,
            filters: vec![],
        };
        let mut times = Vec::new();
        let mut out_rows = 0;
        let mut counted = 0;
        for _ in 0..args.repeat {
            let t = Instant::now();
            let rows = run_report(&reader, &q)?;
            times.push(t.elapsed());
            out_rows = rows.len();
            counted = rows.iter().map(|r| r.count).sum::<u64>();
        }
        times.sort();
        println!(
            "{name}: {out_rows} result rows, {counted} requests; min {:.3} s, median {:.3} s, max {:.3} s",
            times[0].as_secs_f64(),
            times[times.len() / 2].as_secs_f64(),
            times[times.len() - 1].as_secs_f64()
        );
    }
    Ok(())
}

/// Pushes `--pipeline-rows` records (and engine updates) through `spawn_pipeline`.
fn pipeline(
    args: &Args,
    dir: &std::path::Path,
    end_us: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    if args.pipeline_rows > 0 {
        let ppath = dir.join("pipeline.db");
        let sink = SqliteStore::open(&ppath)?;
        let cfg = PipelineConfig::default();
        let cap = cfg.capacity as u64;
        let (recorder, handle) = spawn_pipeline(Box::new(sink), cfg, Arc::new(NoopObserver));
        let mut gen = Gen::new(args.pipeline_rows, args.days, end_us);
        let mut lat_ns: Vec<u64> = Vec::with_capacity(args.pipeline_rows as usize);
        let wall = Instant::now();
        while gen.i < args.pipeline_rows {
            // Keep the queue under half full so the run measures sustained throughput, not
            // drops (a real gateway just drops and counts).
            while recorder.pending() > cap / 2 {
                std::thread::sleep(Duration::from_micros(200));
            }
            let rec = gen.record();
            // Every 5th request gets a late engine span; every 50th one arrives before its
            // record (parked, applied on insert).
            let update = gen.i.is_multiple_of(5).then(|| PhaseUpdate {
                trace_id: rec.trace_id.clone(),
                queue_duration_ms: Some(1.0),
                prefill_duration_ms: Some(2.0),
                decode_duration_ms: Some(3.0),
                input_tokens: None,
                output_tokens: None,
                per_step: false,
            });
            let early = gen.i.is_multiple_of(50);
            if let (Some(u), true) = (&update, early) {
                recorder.update(u.clone());
            }
            let t = Instant::now();
            recorder.record(rec);
            lat_ns.push(t.elapsed().as_nanos() as u64);
            if let (Some(u), false) = (update, early) {
                recorder.update(u);
            }
        }
        let report = handle.shutdown(Duration::from_secs(120));
        let elapsed = wall.elapsed();
        lat_ns.sort_unstable();
        let pct =
            |q: f64| lat_ns[((q * lat_ns.len() as f64).ceil() as usize).clamp(1, lat_ns.len()) - 1];
        println!(
            "== pipeline: {} records (+ {} engine updates) through Recorder → SqliteStore: written {}, dropped {}, lost {}, updates unmatched {}; {} rows/s end to end; record() p50 {} ns, p99 {} ns, max {} ns",
            args.pipeline_rows,
            recorder.updates_queued(),
            report.written,
            report.dropped,
            report.lost,
            recorder.updates_unmatched(),
            fmt_rate(report.written, elapsed),
            pct(0.5),
            pct(0.99),
            lat_ns.last().copied().unwrap_or(0)
        );
    }
    Ok(())
}
