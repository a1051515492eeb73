//! Sustained insert throughput of [`ClickHouseStore::insert`].
//!
//! ```text
//! cargo run --release -p tokenscope-clickhouse --example bench_clickhouse -- \
//!     --rows 2000000 [--batch 50000[,100000,…]] [--writers N] [--url clickhouse://…] [--lz4]
//! ```
//!
//! Without `--url` it starts a clickhouse-server of its own (the test harness) and drops it at
//! the end. Rows look like gateway records (every column filled, 40 models, 1000 users, a
//! prompt hash, no prompt text), spread over the last 24 hours. For each batch size it prints
//! rows/s (wall clock over all batches, serialization included) and the process and machine
//! CPU use during the run (from `/proc`).

use std::fmt::Write as _;
use std::time::Instant;

use tokenscope_clickhouse::testutil::ClickHouseServer;
use tokenscope_clickhouse::ClickHouseStore;
use tokenscope_core::{Endpoint, InputBucket, Outcome, PhaseSource, RequestRecord, TokenSource};

fn record(i: u64, now_us: i64) -> RequestRecord {
    RequestRecord {
        request_id: format!("0190f3a2-{i:012x}-7000-8000-{:012x}", i * 7919),
        trace_id: format!("{:032x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        created_at: now_us - (i as i64 * 43_200) % 86_400_000_000,
        model: format!("model-{}", i % 40),
        model_served: Some(format!("org/model-{}-instruct", i % 40)),
        upstream: format!("vllm-{}", i % 8),
        user_id: Some(format!("user-{}", i % 1000)),
        tenant: Some(format!("tenant-{}", i % 20)),
        business_line: Some(["search", "chat", "ads"][(i % 3) as usize].to_owned()),
        request_type: "chat".to_owned(),
        api_key_id: Some(format!("k_{:08x}", i % 300)),
        endpoint: Endpoint::ChatCompletions,
        stream: !i.is_multiple_of(4),
        http_status: 200,
        outcome: Outcome::Ok,
        error_type: None,
        finish_reason: Some("stop".to_owned()),
        max_tokens: Some(512),
        input_tokens: Some(100 + i % 3000),
        output_tokens: Some(10 + i % 500),
        cached_tokens: Some(i % 64),
        reasoning_tokens: None,
        input_tokens_source: TokenSource::Usage,
        output_tokens_source: TokenSource::Usage,
        input_bucket: Some(InputBucket::of(100 + i % 3000)),
        queue_duration_ms: Some((i % 100) as f64 * 0.5),
        prefill_duration_ms: Some((i % 300) as f64 * 0.25),
        decode_duration_ms: Some((i % 5000) as f64),
        queue_source: PhaseSource::Engine,
        prefill_source: PhaseSource::Engine,
        decode_source: PhaseSource::Engine,
        ttft_ms: Some(50.0 + (i % 700) as f64),
        tpot_ms: Some(8.0 + (i % 30) as f64 * 0.1),
        itl_max_ms: Some(40.0),
        itl_mean_ms: Some(9.5),
        total_duration_ms: 1000.0 + (i % 9000) as f64,
        upstream_headers_ms: Some(2.5),
        gateway_overhead_ms: Some(0.2),
        chunks: Some(10 + i % 500),
        prompt_hash: Some(format!("{:032x}", i % 5000)),
        prompt_text: None,
        draft_tokens: None,
        draft_accepted_tokens: None,
        engine: Some("vllm".to_owned()),
        input_tokens_entry: Some(100 + i % 3000),
        engine_running: Some((i % 64) as f64),
        engine_waiting: Some((i % 8) as f64),
        engine_kv_usage: Some((i % 100) as f64 / 100.0),
        gpu_utilization: Some(0.9),
        gpu_memory_bandwidth: Some(0.5),
        cost_usd: Some(0.0001),
        client_request_id: None,
        cache_creation_tokens: None,
        replica: format!("10.0.0.{}:8000", i % 8),
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

/// (total jiffies of the machine, idle jiffies) from /proc/stat.
fn machine_jiffies() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (v.iter().sum(), idle)
}

/// utime + stime of this process, jiffies.
fn self_jiffies() -> u64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0)
}

fn main() {
    let mut rows: u64 = 2_000_000;
    let mut batches: Vec<usize> = vec![10_000, 50_000, 100_000];
    let mut url: Option<String> = None;
    let mut lz4 = false;
    let mut writers: usize = 1;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rows" => rows = args.next().and_then(|v| v.parse().ok()).expect("--rows N"),
            "--batch" => {
                batches = args
                    .next()
                    .expect("--batch N[,M…]")
                    .split(',')
                    .map(|v| v.parse().expect("batch size"))
                    .collect()
            }
            "--url" => url = args.next(),
            "--lz4" => lz4 = true,
            "--writers" => {
                writers = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--writers N")
            }
            other => panic!("unknown argument {other}"),
        }
    }
    let _server;
    let base = match url {
        Some(u) => u,
        None => {
            let s = ClickHouseServer::start().expect("start clickhouse-server (or pass --url)");
            let u = s.url("bench");
            _server = s;
            u
        }
    };
    let url = if lz4 {
        format!(
            "{base}{}compression=lz4",
            if base.contains('?') { '&' } else { '?' }
        )
    } else {
        base
    };
    let store = ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    println!(
        "server {} ({} dialect), {} cores, lz4 {}",
        store.server_version(),
        if store.dialect().is_modern() {
            "modern"
        } else {
            "plain"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        lz4
    );
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    let hz = 100.0; // USER_HZ
    for batch in batches {
        store
            .execute(&format!("TRUNCATE TABLE {}", store.config().table()))
            .expect("truncate");
        let template: Vec<RequestRecord> = (0..batch as u64).map(|i| record(i, now_us)).collect();
        let base_len: Vec<usize> = template.iter().map(|r| r.request_id.len()).collect();
        let (m0, i0) = machine_jiffies();
        let p0 = self_jiffies();
        let t = Instant::now();
        // `writers` threads insert concurrently (each its own batches, like several gateway
        // replicas or a sink with inserts in flight); rows split evenly.
        std::thread::scope(|scope| {
            for w in 0..writers.max(1) {
                let (store, base_len) = (store.clone(), &base_len);
                let mut all = template.clone();
                let share = rows / writers.max(1) as u64
                    + u64::from((w as u64) < rows % writers.max(1) as u64);
                scope.spawn(move || {
                    let mut written = 0u64;
                    let mut offset = 0u64;
                    while written < share {
                        let n = (share - written).min(batch as u64) as usize;
                        // Fresh request ids per batch (new rows, not a retry): rewrite the id
                        // suffix in place, no per-row allocation in the timed loop.
                        for (r, len) in all[..n].iter_mut().zip(base_len) {
                            r.request_id.truncate(*len);
                            let _ = write!(r.request_id, "-{w}-{offset}");
                        }
                        store.insert(&all[..n]).expect("insert");
                        written += n as u64;
                        offset += 1;
                    }
                });
            }
        });
        let secs = t.elapsed().as_secs_f64();
        let (m1, i1) = machine_jiffies();
        let p1 = self_jiffies();
        let busy = ((m1 - m0) - (i1 - i0)) as f64 / (m1 - m0).max(1) as f64;
        let count = store.count().expect("count");
        assert_eq!(count, rows, "rows after dedup");
        println!(
            "batch {batch:>7} x {writers} writer(s): {rows} rows in {secs:.2} s = {:>9.0} rows/s; machine CPU busy {:.0}%, bench process {:.2} cores",
            rows as f64 / secs,
            busy * 100.0,
            (p1 - p0) as f64 / hz / secs
        );
    }
}
