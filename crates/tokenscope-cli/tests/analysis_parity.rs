//! The analyses give the same answers on the embedded store and on ClickHouse: the same
//! records are written to both (ClickHouse with a retried batch on top, which must not count
//! twice), the records each store returns for a window are identical, and every analysis
//! command prints byte-identical JSON from both.
//!
//! Needs `clickhouse-server` (skips without it unless `TOKENSCOPE_REQUIRE_CLICKHOUSE=1`).

use tokenscope_clickhouse::testutil::{clickhouse_or_skip, ClickHouseServer};
use tokenscope_core::{Endpoint, InputBucket, Outcome, PhaseSource, RequestRecord, TokenSource};

/// Deterministic, varied records over the last two days: several callers and business lines,
/// repeated prompts (one caller looping on one prompt every 60 s), truncated outputs, engine
/// state, some fields missing.
fn records(now_us: i64) -> Vec<RequestRecord> {
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut out: Vec<RequestRecord> = (0..4000)
        .map(|i| {
            let r = next();
            let input = 10 + r % 6000;
            let streamed = r % 4 != 0;
            let outcome = match r % 29 {
                0 => Outcome::UpstreamError,
                1 => Outcome::Timeout,
                2 => Outcome::Cancelled,
                3 => Outcome::ClientError,
                _ => Outcome::Ok,
            };
            let ttft = 20.0 + (r % 997) as f64 * 1.25 + input as f64 * 0.05;
            let max_tokens = (r % 3 == 0).then_some(256);
            let output = (r % 13 != 0).then_some(1 + (r >> 9) % 600);
            let truncated = matches!((max_tokens, output), (Some(m), Some(o)) if o >= m);
            RequestRecord {
                request_id: format!("req-{i:06}"),
                trace_id: format!("{:032x}", u128::from(r) * 31 + i as u128),
                created_at: now_us - ((r >> 8) % (2 * 86_400_000_000)) as i64,
                model: ["llama-3-8b", "qwen-7b", "gemma-2b"][(r >> 3) as usize % 3].to_owned(),
                upstream: "up".to_owned(),
                user_id: (r % 7 != 0).then(|| format!("user-{}", (r >> 5) % 30)),
                tenant: (r % 3 == 0).then(|| "acme".to_owned()),
                business_line: Some(["search", "chat", "ads"][(r >> 7) as usize % 3].to_owned()),
                request_type: ["chat", "summary", "rewrite"][(r >> 12) as usize % 3].to_owned(),
                endpoint: Endpoint::ChatCompletions,
                stream: streamed,
                http_status: match outcome {
                    Outcome::Ok => 200,
                    Outcome::ClientError => 400,
                    _ => 502,
                },
                outcome,
                error_type: (outcome != Outcome::Ok).then(|| "http_502".to_owned()),
                finish_reason: output.map(|_| if truncated { "length" } else { "stop" }.to_owned()),
                max_tokens,
                input_tokens: Some(input),
                output_tokens: output.map(|o| max_tokens.map_or(o, |m| o.min(m))),
                cached_tokens: (r % 5 == 0).then_some(input / 2),
                input_tokens_source: TokenSource::Usage,
                output_tokens_source: TokenSource::Usage,
                input_bucket: Some(InputBucket::of(input)),
                ttft_ms: streamed.then_some(ttft),
                tpot_ms: streamed.then_some(5.0 + (r % 91) as f64 / 7.0),
                total_duration_ms: ttft + (r % 3000) as f64 / 3.0,
                queue_duration_ms: (r % 2 == 0).then_some((r % 300) as f64 / 3.0),
                prefill_duration_ms: (r % 2 == 0).then_some(ttft / 2.0),
                decode_duration_ms: (r % 2 == 0).then_some(100.0 + (r % 50) as f64),
                queue_source: PhaseSource::Engine,
                prefill_source: PhaseSource::Engine,
                decode_source: PhaseSource::Engine,
                upstream_headers_ms: Some(1.0 + (r % 17) as f64),
                gateway_overhead_ms: Some(0.05 + (r % 7) as f64 / 100.0),
                prompt_hash: Some(format!("{:016x}", (r >> 20) % 900)),
                engine: Some(["vllm", "llamacpp"][(r >> 11) as usize % 2].to_owned()),
                engine_running: Some(((r >> 15) % 16) as f64),
                engine_waiting: Some(((r >> 19) % 5) as f64),
                engine_kv_usage: (r % 4 != 1).then_some(((r >> 13) % 1000) as f64 / 999.0),
                gpu_utilization: (r % 5 != 1).then_some(((r >> 17) % 101) as f64 / 100.0),
                cache_creation_tokens: (r % 6 == 0).then_some(input / 3),
                replica: ["10.0.0.1:8000", "10.0.0.2:8000"][(r >> 21) as usize % 2].to_owned(),
                ..RequestRecord::default()
            }
        })
        .collect();
    // One caller looping on one prompt every 60 s for the last hour.
    for k in 0..60 {
        out.push(RequestRecord {
            request_id: format!("loop-{k:03}"),
            trace_id: format!("{:032x}", 0xabcd_0000_u128 + k as u128),
            created_at: now_us - 3_600_000_000 + k * 60_000_000,
            model: "llama-3-8b".to_owned(),
            upstream: "up".to_owned(),
            user_id: Some("cron-job".to_owned()),
            business_line: Some("ads".to_owned()),
            request_type: "summary".to_owned(),
            http_status: 200,
            outcome: Outcome::Ok,
            finish_reason: Some("stop".to_owned()),
            input_tokens: Some(1500),
            output_tokens: Some(200),
            input_tokens_source: TokenSource::Usage,
            output_tokens_source: TokenSource::Usage,
            input_bucket: Some(InputBucket::of(1500)),
            total_duration_ms: 900.0,
            prompt_hash: Some("c0ffee00c0ffee00".to_owned()),
            ..RequestRecord::default()
        });
    }
    out
}

fn cli(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run tokenscope");
    assert!(
        out.status.success(),
        "tokenscope {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn analyses_are_identical_on_the_embedded_store_and_clickhouse() {
    if !clickhouse_or_skip() {
        return;
    }
    let ch = ClickHouseServer::start().expect("start clickhouse");
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let now_us = now_s * 1_000_000;
    let recs = records(now_us);

    let dir = tempfile::tempdir().expect("tmp");
    let db = dir.path().join("parity.db");
    let mut sqlite = tokenscope_store::SqliteStore::open(&db).expect("sqlite");
    sqlite.insert_batch(&recs).expect("sqlite insert");
    drop(sqlite);
    let url = ch.url("ts_analysis_parity");
    let store = tokenscope_clickhouse::ClickHouseStore::connect_url(&url).expect("connect");
    store.migrate().expect("migrate");
    store.insert(&recs).expect("insert");
    store.insert(&recs[..700]).expect("a retried batch");

    // The loaded records are identical (the input of every analysis).
    let (since_us, until_us) = (now_us - 3 * 86_400_000_000, now_us + 60_000_000);
    let from_sqlite = tokenscope_store::SqliteStore::open_read_only(&db)
        .expect("ro")
        .records_between(since_us, until_us)
        .expect("sqlite records");
    let from_ch = store
        .records_between(since_us, until_us)
        .expect("clickhouse records");
    assert_eq!(from_sqlite.len(), recs.len());
    assert_eq!(from_sqlite, from_ch, "records differ between the stores");

    // Every analysis command prints the same JSON from both.
    let config = dir.path().join("tokenscope.toml");
    std::fs::write(
        &config,
        r#"
[[prices]]
model = "llama-3-8b"
input_per_mtok = 0.2
output_per_mtok = 0.6
[[prices]]
model = "qwen*"
gpu_hourly_usd = 2.5
[[budgets]]
business_line = "search"
period = "daily"
tokens = 2000000
[[budgets]]
business_line = "ads"
period = "monthly"
auto = true
"#,
    )
    .expect("config");
    let config = config.to_string_lossy().into_owned();
    let db_s = db.to_string_lossy().into_owned();
    let since = format!("@{}", now_s - 86_400);
    let until = format!("@{}", now_s + 60);
    for cmd in [
        vec!["cost"],
        vec!["cost", "--by", "model"],
        vec!["cost", "--by", "business_line,user"],
        vec!["budget"],
        vec!["anomalies"],
        vec!["waste"],
        vec!["diagnose"],
        vec!["capacity"],
    ] {
        let run = |store: &str| {
            let mut a: Vec<&str> = cmd.clone();
            a.extend([
                "--store", store, "--since", &since, "--until", &until, "--format", "json",
                "--config", &config,
            ]);
            cli(&a)
        };
        let (left, right) = (run(&db_s), run(&url));
        assert!(left.len() > 20, "{cmd:?}: empty output {left}");
        assert_eq!(left, right, "{cmd:?} differs between SQLite and ClickHouse");
    }
}
