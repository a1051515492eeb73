//! Against a real clickhouse-server (Debian 18.16 in CI): started per test on free loopback
//! ports by the `testutil` harness. Without the binary every test prints a skip message and
//! returns, unless `TOKENSCOPE_REQUIRE_CLICKHOUSE=1` (then it fails).
//!
//! Every test of the store's statements — DDL and migrations, inserts, `FINAL` reads, the
//! late-update sink, streaming, retention, reports — runs twice ([`on_both`]): on that server
//! (module `on_clickhouse_server`, the old dialect) and on a current ClickHouse engine, PyPI's
//! chdb 26.x behind ClickHouse's HTTP interface (module `on_modern_engine`, the modern dialect:
//! LowCardinality, DateTime64, TTL, codecs, skip indexes), skipped without chdb unless
//! `TOKENSCOPE_REQUIRE_CHDB=1`. What only a server has (passwords, HTTPS, compression, a hung
//! or killed server, two shards) runs on the server only.

use std::time::{Duration, Instant};

use tokenscope_clickhouse::testutil::{
    chdb_or_skip, clickhouse_or_skip, ChdbServer, ClickHouseCluster, ClickHouseServer, Engine,
};
use tokenscope_clickhouse::{
    ClickHouseConfig, ClickHouseError, ClickHouseSink, ClickHouseStore, SCHEMA_VERSION,
};
use tokenscope_core::{
    Endpoint, InputBucket, Outcome, PhaseSource, PhaseUpdate, RequestRecord, TokenSource,
};
use tokenscope_store::{ErrorClass, RecordSink, StoreError, UnmatchedCounts};

fn server() -> Option<ClickHouseServer> {
    if !clickhouse_or_skip() {
        return None;
    }
    Some(ClickHouseServer::start().expect("start clickhouse-server"))
}

fn chdb() -> Option<ChdbServer> {
    if !chdb_or_skip() {
        return None;
    }
    Some(ChdbServer::start().expect("start chdb-http"))
}

/// Each named test `fn name(ch: &dyn Engine)` as `on_clickhouse_server::name` and
/// `on_modern_engine::name` (the latter also checks that it runs the modern dialect).
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod on_clickhouse_server {
            $(#[test]
            fn $name() {
                if let Some(ch) = super::server() {
                    super::$name(&ch);
                }
            })*
        }
        mod on_modern_engine {
            use tokenscope_clickhouse::testutil::Engine as _;
            $(#[test]
            fn $name() {
                if let Some(ch) = super::chdb() {
                    let dialect = tokenscope_clickhouse::Dialect::from_version(&ch.version())
                        .expect("dialect");
                    assert!(dialect.is_modern(), "{}", ch.version());
                    super::$name(&ch);
                }
            })*
        }
    };
}

on_both!(
    round_trip_full_and_sparse,
    batches_retries_and_versions,
    late_updates_after_and_before_the_row,
    concurrent_migrate_on_a_fresh_database,
    dropped_table_is_a_schema_error_and_the_sink_recreates_it,
    streaming_lines_and_sync_use_inside_a_runtime,
    retention_sweep_drops_old_days,
    report_matches_the_embedded_store,
    records_and_traces_read_back_like_the_embedded_store,
    usage_sums_match_the_embedded_store,
    slowest_records_match_the_embedded_store,
    one_claim_wins_an_alert_incident,
    v2_table_gains_client_request_id_and_keeps_its_rows,
);

fn connect(url: &str) -> ClickHouseStore {
    let store = ClickHouseStore::connect_url(url).expect("connect");
    assert_eq!(store.migrate().expect("migrate"), SCHEMA_VERSION);
    store
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

fn full_record(id: &str) -> RequestRecord {
    RequestRecord {
        request_id: id.to_owned(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
        created_at: 1_700_000_000_123_456,
        model: "llama-3.1-8b".to_owned(),
        model_served: Some("meta-llama/Llama-3.1-8B-Instruct".to_owned()),
        upstream: "vllm-a".to_owned(),
        user_id: Some("alice".to_owned()),
        tenant: Some("acme".to_owned()),
        business_line: Some("search".to_owned()),
        request_type: "chat".to_owned(),
        api_key_id: Some("k_9f8e7d6c".to_owned()),
        endpoint: Endpoint::Completions,
        stream: true,
        http_status: 502,
        outcome: Outcome::UpstreamError,
        error_type: Some("upstream_5xx".to_owned()),
        finish_reason: Some("length".to_owned()),
        max_tokens: Some(512),
        input_tokens: Some(1234),
        output_tokens: Some(u64::MAX),
        cached_tokens: Some(1024),
        reasoning_tokens: Some(12),
        input_tokens_source: TokenSource::Usage,
        output_tokens_source: TokenSource::Chunks,
        input_bucket: Some(InputBucket::B512To2048),
        queue_duration_ms: Some(12.5),
        prefill_duration_ms: Some(80.25),
        decode_duration_ms: Some(900.125),
        queue_source: PhaseSource::Engine,
        prefill_source: PhaseSource::Derived,
        decode_source: PhaseSource::Engine,
        ttft_ms: Some(95.001),
        tpot_ms: Some(11.75),
        itl_max_ms: Some(40.5),
        itl_mean_ms: Some(1.0 / 3.0),
        total_duration_ms: 1000.5,
        upstream_headers_ms: Some(3.25),
        gateway_overhead_ms: Some(0.125),
        chunks: Some(76),
        prompt_hash: Some("0123456789abcdef0123456789abcdef".to_owned()),
        prompt_text: Some("hello, \"world\" — ünïcode\ttab\nnewline 'quote' \\ \0 nul".to_owned()),
        draft_tokens: Some(40),
        draft_accepted_tokens: Some(31),
        engine: Some("vllm".to_owned()),
        input_tokens_entry: Some(1230),
        engine_running: Some(17.0),
        engine_waiting: Some(3.0),
        engine_kv_usage: Some(0.8125),
        gpu_utilization: Some(0.9375),
        gpu_memory_bandwidth: Some(0.625),
        cost_usd: Some(0.001_234_5),
        client_request_id: Some("client-id".to_owned()),
        cache_creation_tokens: Some(64),
        replica: "10.0.0.7:8000".to_owned(),
        blocked_by_requests: Some(3),
        blocked_by_prompt_tokens: Some(1620),
        blocked_ms: Some(412.5),
        blocker_request_id: Some(format!("long-{id}")),
        blocker_caller: Some("batch-job".to_owned()),
        blocker_business_line: Some("offline".to_owned()),
        blocker_prompt_tokens: Some(1500),
        prompt_sketch: Some(0x8000_0000_dead_beef),
        ttft_unaccounted_ms: Some(490.5),
        e2e_unaccounted_ms: Some(512.25),
        engine_timing: Some("consistent".to_owned()),
    }
}

fn sparse_record(id: &str) -> RequestRecord {
    RequestRecord {
        request_id: id.to_owned(),
        trace_id: "00000000000000000000000000000001".to_owned(),
        created_at: 1_700_000_000_000_000,
        model: "m".to_owned(),
        upstream: "u".to_owned(),
        request_type: "chat".to_owned(),
        total_duration_ms: 1.0,
        ..RequestRecord::default()
    }
}

/// `n` distinct records spread over a few models and days ending now.
fn batch(prefix: &str, n: usize) -> Vec<RequestRecord> {
    let now = now_us();
    (0..n)
        .map(|i| {
            let mut r = full_record(&format!("{prefix}-{i}"));
            r.trace_id = format!("{prefix}-trace-{i}");
            r.created_at = now - (i as i64 % 3) * 86_400_000_000 - i as i64;
            r.model = format!("model-{}", i % 4);
            r.input_tokens = Some(i as u64);
            r.output_tokens = Some(1);
            r
        })
        .collect()
}

fn round_trip_full_and_sparse(ch: &dyn Engine) {
    let store = connect(&ch.url("rt"));
    assert_eq!(store.server_version(), ch.query("SELECT version()").trim());
    let full = full_record("req-full");
    let sparse = sparse_record("req-sparse");
    store
        .insert(&[full.clone(), sparse.clone()])
        .expect("insert");
    assert_eq!(store.get("req-full").expect("get"), Some(full));
    assert_eq!(store.get("req-sparse").expect("get"), Some(sparse));
    assert_eq!(store.get("nope").expect("get"), None);
    assert_eq!(store.count().expect("count"), 2);
    // The derived time column and the article's columns answer plain SQL.
    assert_eq!(
        store
            .query_text("SELECT toString(created_at), created_at_us, user_id, input_tokens, total_duration_ms FROM rt.llm_inference_log FINAL WHERE request_id = 'req-full'")
            .expect("query"),
        if store.dialect().datetime64 {
            // DateTime64(6): the µs survive in the time column too.
            "2023-11-14 22:13:20.123456\t1700000000123456\talice\t1234\t1000.5\n"
        } else {
            "2023-11-14 22:13:20\t1700000000123456\talice\t1234\t1000.5\n"
        }
    );
    assert_eq!(store.schema_version().expect("version"), SCHEMA_VERSION);
    if store.dialect().skip_index {
        // The per-caller indexes exist, and a per-user query over time uses them.
        assert_eq!(
            ch.query(
                "SELECT name FROM system.data_skipping_indices WHERE database = 'rt' AND \
                 table = 'llm_inference_log' ORDER BY name"
            ),
            "idx_business_line\nidx_client_request_id\nidx_tenant\nidx_trace_id\nidx_user_id\n"
        );
        let plan = ch.query(
            "EXPLAIN indexes = 1 SELECT count() FROM rt.llm_inference_log \
             WHERE user_id = 'alice' AND created_at_us >= 0",
        );
        assert!(plan.contains("idx_user_id"), "{plan}");
    }
    // Migrating again is a no-op.
    assert_eq!(store.migrate().expect("migrate"), SCHEMA_VERSION);
    assert_eq!(
        ch.query("SELECT count() FROM rt.tokenscope_schema_migrations FINAL")
            .trim(),
        SCHEMA_VERSION.to_string()
    );
}

fn batches_retries_and_versions(ch: &dyn Engine) {
    let store = connect(&ch.url("b"));
    let rows = batch("r", 10_000);
    let t = Instant::now();
    store.insert(&rows).expect("insert");
    eprintln!("10 000 rows inserted in {:?}", t.elapsed());
    let expected_sum: u64 = (0..10_000u64).sum();
    let sums = || {
        store
            .query_text("SELECT count(), sum(input_tokens), uniqExact(request_id) FROM b.llm_inference_log FINAL")
            .expect("query")
    };
    assert_eq!(sums(), format!("10000\t{expected_sum}\t10000\n"));
    // A retried batch (same rows) does not double anything.
    store.insert(&rows).expect("retry");
    store.insert(&rows[..10]).expect("partial retry");
    assert_eq!(store.count().expect("count"), 10_000);
    assert_eq!(sums(), format!("10000\t{expected_sum}\t10000\n"));
    // Without FINAL the unmerged duplicates are visible: proof that FINAL does the work.
    let raw: u64 = ch
        .query("SELECT count() FROM b.llm_inference_log")
        .trim()
        .parse()
        .expect("n");
    assert!(raw >= 10_000, "{raw}");
    // A higher row version wins, whatever the insert order.
    let mut newer = rows[5].clone();
    newer.output_tokens = Some(999);
    store.insert_versioned([(&newer, 2)]).expect("v2");
    store.insert(&rows[5..6]).expect("stale v1 again");
    assert_eq!(
        store.get(&rows[5].request_id).expect("get"),
        Some(newer.clone())
    );
    ch.query("OPTIMIZE TABLE b.llm_inference_log FINAL");
    assert_eq!(store.get(&rows[5].request_id).expect("get"), Some(newer));
    assert_eq!(
        ch.query("SELECT count() FROM b.llm_inference_log").trim(),
        "10000"
    );
}

fn engine_update(trace: &str) -> PhaseUpdate {
    PhaseUpdate {
        trace_id: trace.to_owned(),
        queue_duration_ms: Some(40.0),
        prefill_duration_ms: Some(55.5),
        decode_duration_ms: None,
        input_tokens: Some(700),
        output_tokens: Some(99),
        per_step: false,
    }
}

fn gateway_record(id: &str, trace: &str) -> RequestRecord {
    let mut r = sparse_record(id);
    r.created_at = now_us();
    r.trace_id = trace.to_owned();
    r.ttft_ms = Some(120.0);
    r.queue_duration_ms = Some(10.0);
    r.queue_source = PhaseSource::Derived;
    r.decode_duration_ms = Some(500.0);
    r.decode_source = PhaseSource::Engine;
    r.output_tokens = Some(12);
    r.output_tokens_source = TokenSource::Chunks;
    r.input_bucket = Some(InputBucket::B0To128);
    r
}

fn joined(r: &RequestRecord) -> RequestRecord {
    let mut r = r.clone();
    r.queue_duration_ms = Some(40.0);
    r.queue_source = PhaseSource::EngineSpan;
    r.prefill_duration_ms = Some(55.5);
    r.prefill_source = PhaseSource::EngineSpan;
    r.input_tokens = Some(700);
    r.input_tokens_source = TokenSource::Engine;
    r.input_bucket = Some(InputBucket::B512To2048);
    r.output_tokens = Some(99);
    r.output_tokens_source = TokenSource::Engine;
    r.split_times(); // the one rule, recomputed by every late update
    r
}

fn late_updates_after_and_before_the_row(ch: &dyn Engine) {
    let store = connect(&ch.url("u"));
    let mut sink = ClickHouseSink::new(store.clone());
    assert_eq!(sink.name(), "clickhouse");
    let a = gateway_record("a", "t1");
    let b = gateway_record("b", "t2");
    let c = gateway_record("c", "t3");
    sink.write_batch(&[a.clone(), b.clone(), c.clone()])
        .expect("write");
    assert_eq!(sink.cached_rows(), 3);

    // After the row, found in the cache.
    assert_eq!(sink.update(&[engine_update("t1")]).expect("update"), 1);
    assert_eq!(
        store.get_versioned("a").expect("get"),
        Some((joined(&a), 2))
    );
    assert_eq!(store.get("b").expect("get"), Some(b.clone()));
    // Idempotent: the same update again changes nothing and writes nothing.
    assert_eq!(
        sink.update(&[engine_update("t1"), engine_update("t1")])
            .expect("update"),
        1
    );
    assert_eq!(
        store.get_versioned("a").expect("get"),
        Some((joined(&a), 2))
    );

    // After the row, not cached (another gateway's row, or after a restart): found by query.
    let mut cold = ClickHouseSink::new(store.clone()).with_cache_rows(0);
    cold.apply_updates(&[engine_update("t2")]).expect("update");
    assert_eq!(
        store.get_versioned("b").expect("get"),
        Some((joined(&b), 2))
    );
    // A second update on top of the first bumps the version again.
    let later = PhaseUpdate {
        trace_id: "t2".to_owned(),
        decode_duration_ms: Some(7.0),
        ..PhaseUpdate::default()
    };
    cold.apply_updates(&[later]).expect("update");
    let mut b3 = joined(&b);
    b3.decode_duration_ms = Some(7.0);
    b3.decode_source = PhaseSource::EngineSpan;
    assert_eq!(store.get_versioned("b").expect("get"), Some((b3, 3)));
    assert_eq!(cold.pending_updates(), 0);

    // Before the row: parked, then applied when the row is written.
    let mut first = engine_update("t9");
    first.prefill_duration_ms = None;
    let second = PhaseUpdate {
        trace_id: "t9".to_owned(),
        prefill_duration_ms: Some(55.5),
        ..PhaseUpdate::default()
    };
    assert_eq!(sink.update(&[first]).expect("update"), 0);
    assert_eq!(sink.update(&[second]).expect("update"), 0);
    assert_eq!(sink.pending_updates(), 1);
    let d = gateway_record("d", "t9");
    sink.write_batch(&[gateway_record("other", "t8")])
        .expect("write");
    assert_eq!(sink.pending_updates(), 1);
    sink.write_batch(std::slice::from_ref(&d)).expect("write");
    assert_eq!(sink.pending_updates(), 0);
    assert_eq!(
        store.get_versioned("d").expect("get"),
        Some((joined(&d), 2))
    );
    assert_eq!(sink.take_unmatched(true), UnmatchedCounts::default());

    // Unmatched at shutdown is reported.
    sink.update(&[engine_update("never")]).expect("update");
    assert_eq!(sink.take_unmatched(true).shutdown, 1);
    assert_eq!(store.count().expect("count"), 5);
}

fn concurrent_migrate_on_a_fresh_database(ch: &dyn Engine) {
    let url = ch.url("conc");
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || {
                let store = ClickHouseStore::connect_url(&url).expect("connect");
                store.migrate()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().expect("join").expect("migrate"), SCHEMA_VERSION);
    }
    assert_eq!(
        ch.query("SELECT count() FROM conc.tokenscope_schema_migrations FINAL")
            .trim(),
        SCHEMA_VERSION.to_string()
    );
    assert_eq!(
        ch.query("SELECT name FROM system.tables WHERE database = 'conc' ORDER BY name"),
        "llm_inference_log\ntokenscope_alert_claims\ntokenscope_schema_migrations\n"
    );
    let store = connect(&url);
    store.insert(&[sparse_record("x")]).expect("insert");
    assert_eq!(store.count().expect("count"), 1);
}

fn dropped_table_is_a_schema_error_and_the_sink_recreates_it(ch: &dyn Engine) {
    let store = connect(&ch.url("dr"));
    store.insert(&[sparse_record("before")]).expect("insert");
    ch.query("DROP TABLE dr.llm_inference_log");
    let e = store.insert(&[sparse_record("x")]).expect_err("no table");
    assert_eq!(e.class(), ErrorClass::Schema, "{e}");
    let se: StoreError = e.into();
    assert_eq!(se.class(), ErrorClass::Schema);
    assert!(se.to_string().contains("dr.llm_inference_log"), "{se}");
    // The sink recreates the table inside write_batch and writes the batch.
    let mut sink = ClickHouseSink::new(store.clone());
    sink.write_batch(&[sparse_record("x"), sparse_record("y")])
        .expect("write after repair");
    assert_eq!(store.count().expect("count"), 2);
    // Even the database.
    ch.query("DROP DATABASE dr");
    let e = store.count().expect_err("no database");
    assert_eq!(e.class(), ErrorClass::Schema, "{e}");
    sink.write_batch(&[sparse_record("z")])
        .expect("write after repair");
    assert_eq!(store.count().expect("count"), 1);
}

#[test]
fn wrong_password_is_an_auth_error_without_the_password() {
    if !clickhouse_or_skip() {
        return;
    }
    let mut ch = ClickHouseServer::builder()
        .user("ts", "right-pw")
        .start()
        .expect("start");
    let url = ch.url("au");
    assert!(
        url.starts_with("clickhouse://ts:right-pw@127.0.0.1:"),
        "{url}"
    );
    let store = connect(&url);
    store.insert(&[sparse_record("ok")]).expect("insert");
    // Wrong password at connect.
    let bad = url.replace("right-pw", "wrong-pw");
    let e = ClickHouseStore::connect_url(&bad).expect_err("wrong password");
    assert_eq!(e.class(), ErrorClass::Auth, "{e}");
    let msg = e.to_string();
    assert!(msg.contains("authentication failed for user ts"), "{msg}");
    assert!(!msg.contains("wrong-pw"), "{msg}");
    // The password changes server-side while the store runs.
    ch.set_password("ts", "new-pw");
    let e: StoreError = store
        .insert(&[sparse_record("x")])
        .expect_err("stale password")
        .into();
    assert_eq!(e.class(), ErrorClass::Auth, "{e}");
    assert!(!e.to_string().contains("right-pw"), "{e}");
    let store = connect(&ch.url("au"));
    assert_eq!(store.count().expect("count"), 1);
}

#[test]
fn server_down_is_unavailable_within_the_timeout() {
    let Some(mut ch) = server() else { return };
    // A tight request timeout for the hung-server check; the default one for the rest (a
    // freshly restarted server on a loaded 2-core machine can take longer than 700 ms).
    let fast_url = format!("{}?timeout_ms=700", ch.url("dn"));
    let fast = connect(&fast_url);
    let store = connect(&ch.url("dn"));
    fast.insert(&[sparse_record("a")]).expect("insert");
    // Hung (SIGSTOP): accepted connections, no answer → timeout.
    ch.pause();
    let t = Instant::now();
    let e = fast.insert(&[sparse_record("b")]).expect_err("paused");
    let took = t.elapsed();
    ch.resume();
    assert!(matches!(e, ClickHouseError::Timeout { .. }), "{e:?}");
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // Killed: connection refused → unavailable at once (not after the timeout).
    ch.kill();
    for s in [&fast, &store] {
        let t = Instant::now();
        let e = s.count().expect_err("down");
        assert!(matches!(e, ClickHouseError::Unreachable { .. }), "{e:?}");
        assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(700),
            "{:?}",
            t.elapsed()
        );
    }
    let e = ClickHouseStore::connect_url(&fast_url).expect_err("down");
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    // Back on the same data directory: the store reconnects by itself (its pooled
    // connections are dead; the transport error is retried once on a fresh one).
    ch.start_again().expect("restart");
    store
        .insert(&[sparse_record("c")])
        .expect("insert after restart");
    let n = store.count().expect("count");
    // "b" may or may not have been written before the pause took effect.
    assert!(n == 2 || n == 3, "{n}");
    assert!(store.get("a").expect("get").is_some() && store.get("c").expect("get").is_some());
}

fn streaming_lines_and_sync_use_inside_a_runtime(ch: &dyn Engine) {
    let store = connect(&ch.url("st"));
    let (mut n, mut sum, mut longest) = (0u64, 0u64, 0usize);
    store
        .for_each_tsv_line("SELECT number, arrayStringConcat(arrayMap(x -> 'x', range(number % 1000))) FROM system.numbers LIMIT 200000", |line| {
            let (num, pad) = std::str::from_utf8(line)
                .ok()
                .and_then(|l| l.split_once('\t'))
                .expect("two fields");
            let v: u64 = num.parse().expect("number");
            assert_eq!(pad.len() as u64, v % 1000);
            n += 1;
            sum += v;
            longest = longest.max(line.len());
            Ok(())
        })
        .expect("stream");
    assert_eq!((n, sum), (200_000, (0..200_000u64).sum()));
    // A callback error stops the stream and is returned.
    let mut seen = 0;
    let e = store
        .for_each_tsv_line("SELECT number FROM system.numbers LIMIT 1000000", |_| {
            seen += 1;
            if seen == 10 {
                Err(ClickHouseError::Callback("enough".to_owned()))
            } else {
                Ok(())
            }
        })
        .expect_err("stopped");
    assert_eq!((seen, e.to_string()), (10, "enough".to_owned()));
    // A bad statement is an error, not an empty result.
    let e = store.query_text("SELEC 1").expect_err("syntax");
    assert_eq!(e.class(), ErrorClass::Rejected, "{e}");

    // Called (and dropped) from inside a tokio runtime: no "runtime within a runtime" panic.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let url = ch.url("st");
    rt.block_on(async move {
        let store = ClickHouseStore::connect_url(&url).expect("connect");
        store.insert(&[sparse_record("in-rt")]).expect("insert");
        assert_eq!(store.count().expect("count"), 1);
        drop(store);
    });
}

fn retention_sweep_drops_old_days(ch: &dyn Engine) {
    let store = connect(&format!("{}?ttl_days=2", ch.url("ret")));
    let day = 86_400_000_000i64;
    let now = now_us();
    let rows: Vec<RequestRecord> = (0..5)
        .map(|d| {
            let mut r = sparse_record(&format!("d{d}"));
            r.created_at = now - d * day;
            r
        })
        .collect();
    store.insert(&rows).expect("insert");
    // Today − 2 days is the oldest day kept: d0, d1, d2 stay; d3, d4 go.
    assert_eq!(store.retention_sweep().expect("sweep"), 2);
    assert_eq!(store.count().expect("count"), 3);
    assert_eq!(store.retention_sweep().expect("sweep"), 0);
    assert!(store.get("d2").expect("get").is_some());
    assert!(store.get("d3").expect("get").is_none());
    // No ttl_days: nothing to do.
    let plain = connect(&ch.url("ret"));
    assert_eq!(plain.retention_sweep().expect("sweep"), 0);
}

#[test]
fn lz4_compression_round_trip() {
    let Some(ch) = server() else { return };
    let store = connect(&format!("{}?compression=lz4", ch.url("lz")));
    assert!(store.config().compression);
    let rows = batch("z", 2000);
    store.insert(&rows).expect("insert");
    assert_eq!(store.count().expect("count"), 2000);
    assert_eq!(store.get("z-7").expect("get"), Some(rows[7].clone()));
}

#[test]
fn two_shards_distributed_without_duplicates() {
    if !clickhouse_or_skip() {
        return;
    }
    let cluster = ClickHouseCluster::start_two_shards().expect("cluster");
    let url = cluster.url(0, "cl");
    let cfg = ClickHouseConfig::from_url(&url).expect("url");
    assert_eq!(cfg.shards.len(), 2);
    let store = connect(&url);
    for node in &cluster.nodes {
        assert_eq!(
            node.query("SELECT name, engine FROM system.tables WHERE database = 'cl' ORDER BY name"),
            "llm_inference_log\tDistributed\nllm_inference_log_local\tReplacingMergeTree\ntokenscope_alert_claims\tMergeTree\ntokenscope_schema_migrations\tReplacingMergeTree\n"
        );
    }
    let rows = batch("c", 1000);
    store.insert(&rows).expect("insert");
    store.insert(&rows).expect("retried batch");
    let mut newer = rows[3].clone();
    newer.output_tokens = Some(42);
    store.insert_versioned([(&newer, 2)]).expect("v2");
    assert_eq!(store.count().expect("count"), 1000);
    assert_eq!(store.get(&rows[3].request_id).expect("get"), Some(newer));
    // Every shard holds a part, the parts add up (sharded by request id).
    let per_node: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| {
            n.query("SELECT count() FROM cl.llm_inference_log_local FINAL")
                .trim()
                .parse()
                .expect("n")
        })
        .collect();
    assert!(per_node.iter().all(|n| *n > 0), "{per_node:?}");
    assert_eq!(per_node.iter().sum::<u64>(), 1000);
    // The other node is an entry point too.
    let other = ClickHouseStore::connect_url(&cluster.url(1, "cl")).expect("connect");
    assert_eq!(other.count().expect("count"), 1000);
    // Late updates through the Distributed table.
    let mut sink = ClickHouseSink::new(other).with_cache_rows(0);
    let mut u = engine_update(&rows[10].trace_id);
    u.output_tokens = None;
    sink.update(&[u]).expect("update");
    let got = store.get(&rows[10].request_id).expect("get").expect("row");
    assert_eq!(got.prefill_duration_ms, Some(55.5));
    assert_eq!(store.count().expect("count"), 1000);
}

fn report_matches_the_embedded_store(ch: &dyn Engine) {
    use tokenscope_store::{Dimension, ReportQuery, SqliteStore, NONE_LABEL};
    let store = connect(&ch.url("rep"));
    let day = 86_400_000_000i64;
    let t0 = 1_704_067_200_000_000i64; // 2024-01-01T00:00:00Z
    let rows: Vec<RequestRecord> = (0..3000u64)
        .map(|i| {
            let mut r = sparse_record(&format!("q{i}"));
            r.created_at = t0 + (i as i64 * 7_919_000_123) % (3 * day);
            r.model = ["m0", "m1", "m'2\\x"][(i % 3) as usize].to_owned();
            r.user_id = match i % 5 {
                0 => None,
                1 => Some("tab\there\nnl".to_owned()),
                n => Some(format!("u{n}")),
            };
            r.stream = i % 2 == 0;
            r.outcome = if i % 11 == 0 {
                Outcome::Timeout
            } else {
                Outcome::Ok
            };
            r.ttft_ms = (i % 4 != 0).then_some((i % 997) as f64 * 0.37 + 0.1);
            r.tpot_ms = (i % 3 != 0).then(|| (i % 89) as f64 / 7.0);
            r.total_duration_ms = (i % 1009) as f64 * 1.3;
            r.queue_duration_ms = (i % 6 != 0).then_some((i % 50) as f64 * 0.25);
            r.prefill_duration_ms = Some(i as f64 / 3.0);
            r.input_tokens = (i % 7 != 0).then_some(i * 3);
            r.output_tokens = Some(i % 100);
            r.cached_tokens = (i % 2 == 0).then_some(i % 64);
            r.engine_kv_usage = (i % 9 != 0).then(|| (i % 100) as f64 / 97.0);
            r.gpu_utilization = Some((i % 10) as f64 / 10.0);
            r.input_bucket = r.input_tokens.map(InputBucket::of);
            // Per-request blame: unmeasured, behind nobody, behind one of two callers.
            if i % 4 != 0 {
                r.blocked_by_requests = Some(i % 3);
                if i % 3 != 0 {
                    r.blocker_caller = Some(["batch'job", "chat"][(i % 2) as usize].to_owned());
                    r.blocker_business_line = (i % 5 != 0).then(|| "offline".to_owned());
                }
            }
            r
        })
        .collect();
    store.insert(&rows).expect("insert");
    store.insert(&rows[..500]).expect("retried part"); // FINAL keeps the report exact
    let mut sqlite = SqliteStore::open_in_memory().expect("sqlite");
    sqlite.insert_batch(&rows).expect("sqlite insert");
    let queries = [
        ReportQuery {
            since_us: t0,
            until_us: Some(t0 + 3 * day),
            group_by: vec![
                Dimension::Model,
                Dimension::User,
                Dimension::Stream,
                Dimension::KvUsageBand,
            ],
            interval: Some(Duration::from_secs(86_400)),
            filters: vec![],
        },
        ReportQuery {
            since_us: t0 + day / 2,
            until_us: Some(t0 + 2 * day),
            group_by: vec![
                Dimension::InputBucket,
                Dimension::Status,
                Dimension::GpuBand,
            ],
            interval: None,
            filters: vec![(Dimension::Model, "m'2\\x".to_owned())],
        },
        ReportQuery {
            since_us: t0,
            until_us: Some(t0 + 3 * day),
            group_by: vec![Dimension::Model],
            interval: Some(Duration::from_secs(3600)),
            filters: vec![
                (Dimension::User, NONE_LABEL.to_owned()),
                (Dimension::Stream, "true".to_owned()),
            ],
        },
        ReportQuery {
            since_us: t0,
            until_us: Some(t0 + 3 * day),
            group_by: vec![Dimension::BlockerLine, Dimension::BlockerCaller],
            interval: None,
            filters: vec![(Dimension::BlockerCaller, "batch'job".to_owned())],
        },
        ReportQuery {
            since_us: t0,
            until_us: Some(t0 + 3 * day),
            group_by: vec![Dimension::BlockerLine],
            interval: None,
            filters: vec![(Dimension::BlockerLine, NONE_LABEL.to_owned())],
        },
    ];
    for q in &queries {
        let expected = tokenscope_store::run_report(&sqlite, q).expect("sqlite report");
        let got = store.report(q).expect("clickhouse report");
        assert!(!expected.is_empty());
        assert_eq!(got, expected, "{q:?}");
    }
    // Nearest rank at every group size 1…120 (integer ranks included: 100 values, P99 is the
    // 99th), computed by ClickHouse's `quantilesExact`: the same values as the embedded
    // store's selection, and an empty range gives no rows.
    let t1 = t0 + 10 * day;
    let sweep: Vec<RequestRecord> = (1..=120u64)
        .flat_map(|k| {
            (0..k).map(move |j| {
                let mut r = sparse_record(&format!("s{k}-{j}"));
                r.created_at = t1 + (j as i64) * 1_000;
                r.model = format!("k{k:03}");
                // Shuffled, with ties.
                r.ttft_ms = Some(((j * 7919 + k) % (k + 3)) as f64 * 0.5);
                r.total_duration_ms = ((j * 104_729) % 1_000) as f64 / 3.0;
                r
            })
        })
        .collect();
    store.insert(&sweep).expect("insert sweep");
    sqlite.insert_batch(&sweep).expect("sqlite sweep");
    for q in [
        ReportQuery {
            since_us: t1,
            until_us: Some(t1 + day),
            group_by: vec![Dimension::Model],
            ..ReportQuery::default()
        },
        ReportQuery {
            since_us: t1,
            until_us: Some(t1 + day),
            ..ReportQuery::default()
        },
    ] {
        let expected = tokenscope_store::run_report(&sqlite, &q).expect("sqlite report");
        let got = store.report(&q).expect("clickhouse report");
        assert_eq!(got.len(), if q.group_by.is_empty() { 1 } else { 120 });
        assert_eq!(got, expected, "{q:?}");
    }
    let empty = ReportQuery {
        since_us: t1 + 2 * day,
        until_us: Some(t1 + 3 * day),
        ..ReportQuery::default()
    };
    assert_eq!(store.report(&empty).expect("empty"), Vec::new());
    assert_eq!(
        tokenscope_store::run_report(&sqlite, &empty).expect("empty"),
        Vec::new()
    );
}

/// The analyses' input (`records_between`) and the trace join's lookup (`rows_by_trace`, in
/// chunks of 500 ids): the same records in the same order as the embedded store, the newest
/// version of each.
fn records_and_traces_read_back_like_the_embedded_store(ch: &dyn Engine) {
    use tokenscope_store::SqliteStore;
    let store = connect(&ch.url("rd"));
    let day = 86_400_000_000i64;
    let t0 = 1_704_067_200_000_000i64;
    let rows: Vec<RequestRecord> = (0..1_200u64)
        .map(|i| {
            let mut r = full_record(&format!("r{:04}", 1_199 - i));
            r.trace_id = format!("{:032x}", i % 700);
            // (The embedded store keeps token counts as SQLite integers: ≤ i64::MAX.)
            r.output_tokens = Some(i);
            // Ties on created_at, three UTC days.
            r.created_at = t0 + ((i / 2) as i64 * 6_007_000_013) % (3 * day);
            r
        })
        .collect();
    store.insert(&rows).expect("insert");
    let mut newer = rows[7].clone();
    newer.output_tokens = Some(999);
    store.insert_versioned([(&newer, 5)]).expect("insert newer");
    // The embedded store holds the newest version of each.
    let mut sqlite = SqliteStore::open_in_memory().expect("sqlite");
    let mut newest = rows.clone();
    newest[7] = newer.clone();
    sqlite.insert_batch(&newest).expect("sqlite insert");
    for (a, b) in [
        (t0, t0 + 3 * day),
        (t0 + day / 3, t0 + 2 * day + 5),
        (t0 - day, t0),
    ] {
        let want = sqlite.records_between(a, b).expect("sqlite");
        let got = store.records_between(a, b).expect("clickhouse");
        assert_eq!(got.len(), want.len(), "[{a}, {b})");
        for (g, w) in got.iter().zip(&want) {
            let (gs, ws) = (format!("{g:?}"), format!("{w:?}"));
            let diff: Vec<(&str, &str)> = gs
                .split(", ")
                .zip(ws.split(", "))
                .filter(|(x, y)| x != y)
                .collect();
            assert!(
                diff.is_empty(),
                "[{a}, {b}): {} differs: {diff:?}",
                w.request_id
            );
        }
    }
    assert_eq!(
        store.get_versioned(&newer.request_id).expect("get"),
        Some((newer.clone(), 5))
    );
    let ids: Vec<String> = (0..700u64).map(|i| format!("{i:032x}")).collect();
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut got = store.rows_by_trace(&id_refs, t0).expect("by trace");
    got.sort_by(|a, b| a.0.request_id.cmp(&b.0.request_id));
    assert_eq!(got.len(), rows.len());
    let seven = got
        .iter()
        .find(|(r, _)| r.request_id == newer.request_id)
        .expect("row 7");
    assert_eq!(seven, &(newer, 5));
    assert!(store
        .rows_by_trace(&id_refs[..3], t0 + 4 * day)
        .expect("later")
        .is_empty());
}

/// `cost`'s input: token and stored-cost sums per (group, model), aggregated by ClickHouse,
/// bit-identical to the embedded store's streamed sums and to the sums of the records.
fn usage_sums_match_the_embedded_store(ch: &dyn Engine) {
    use tokenscope_core::query::{Dimension, Window};
    use tokenscope_store::usage::usage_of;
    use tokenscope_store::{SqliteStore, UsageQuery};
    let store = connect(&ch.url("us"));
    let day = 86_400_000_000i64;
    let t0 = 1_704_067_200_000_000i64;
    let rows: Vec<RequestRecord> = (0..2_500u64)
        .map(|i| {
            let mut r = sparse_record(&format!("u{i}"));
            r.created_at = t0 + (i as i64 * 3_456_789_011) % (2 * day);
            r.model = ["a", "b", "c'\\x"][(i % 3) as usize].to_owned();
            r.business_line = (i % 4 != 0).then(|| format!("bl{}", i % 5));
            r.user_id = (i % 7 != 0).then(|| format!("user\t{}", i % 11));
            r.tenant = Some("t".to_owned());
            r.input_tokens = (i % 9 != 0).then_some(i * 13 % 4_000);
            r.cached_tokens = (i % 2 == 0).then_some(i * 7 % 5_000); // sometimes > input
            r.output_tokens = (i % 10 != 0).then_some(i % 700);
            r.cost_usd = (i % 3 == 1).then_some((i % 97) as f64 * 0.000_137 + 1e-9);
            r.engine_running = (i % 6 != 0).then_some((i % 13) as f64);
            r.engine_waiting = (i % 5 != 0).then_some((i % 4) as f64 * 0.5);
            r.engine_kv_usage = (i % 8 != 0).then_some((i % 101) as f64 / 100.0 + 1e-7);
            r
        })
        .collect();
    store.insert(&rows).expect("insert");
    store.insert(&rows[..300]).expect("retried");
    let mut sqlite = SqliteStore::open_in_memory().expect("sqlite");
    sqlite.insert_batch(&rows).expect("sqlite insert");
    for (w, by) in [
        (
            Window::new(t0, t0 + 2 * day),
            vec![Dimension::BusinessLine, Dimension::User],
        ),
        (Window::new(t0 + day / 2, t0 + day), vec![]),
        (
            Window::new(t0, t0 + 2 * day),
            vec![Dimension::Model, Dimension::Tenant, Dimension::RequestType],
        ),
        (Window::new(t0 - day, t0), vec![Dimension::User]),
    ] {
        let q = UsageQuery::new(w, by);
        let want = usage_of(&rows, &q).expect("records");
        assert_eq!(sqlite.usage(&q).expect("sqlite"), want, "{q:?}");
        assert_eq!(store.usage(&q).expect("clickhouse"), want, "{q:?}");
    }
    // The dashboard's queries: time buckets, filters (one selecting unset values), engine means.
    for (interval_us, filters) in [
        (Some(3_600_000_000i64), vec![]),
        (
            Some(7_200_000_000),
            vec![(Dimension::Model, "c'\\x".to_owned())],
        ),
        (
            None,
            vec![
                (
                    Dimension::BusinessLine,
                    tokenscope_core::query::NONE_LABEL.to_owned(),
                ),
                (Dimension::Tenant, "t".to_owned()),
            ],
        ),
    ] {
        let mut q = UsageQuery::new(Window::new(t0, t0 + 2 * day), vec![Dimension::User]);
        q.interval_us = interval_us;
        q.filters = filters;
        let want = usage_of(&rows, &q).expect("records");
        assert!(want.len() > 3, "{q:?}");
        assert!(want.iter().any(|r| r.sums.engine_kv_usage.n > 0));
        assert_eq!(sqlite.usage(&q).expect("sqlite"), want, "{q:?}");
        assert_eq!(store.usage(&q).expect("clickhouse"), want, "{q:?}");
    }
}

/// The dashboard's "slowest requests": the top-N by end to end (ties by request id) with the
/// report's filters, the same records in the same order on both stores, a retried row once.
fn slowest_records_match_the_embedded_store(ch: &dyn Engine) {
    use tokenscope_core::query::{Dimension, Window, NONE_LABEL};
    use tokenscope_store::{RecordReader, SqliteStore};
    let store = connect(&ch.url("slow"));
    let t0 = 1_704_067_200_000_000i64;
    let rows: Vec<RequestRecord> = (0..400u64)
        .map(|i| {
            let mut r = sparse_record(&format!("s{i:03}"));
            r.created_at = t0 + i as i64 * 997_000_000;
            r.model = ["a", "b"][(i % 2) as usize].to_owned();
            r.business_line = (i % 3 != 0).then(|| format!("bl{}", i % 4));
            r.total_duration_ms = ((i * 37) % 50) as f64 * 10.0; // many ties
            r
        })
        .collect();
    store.insert(&rows).expect("insert");
    store.insert(&rows[..50]).expect("retried");
    let mut sqlite = SqliteStore::open_in_memory().expect("sqlite");
    sqlite.insert_batch(&rows).expect("sqlite insert");
    let w = Window::new(t0 + 10_000_000_000, t0 + 300_000_000_000);
    for filters in [
        vec![],
        vec![(Dimension::Model, "b".to_owned())],
        vec![(Dimension::BusinessLine, NONE_LABEL.to_owned())],
    ] {
        let mut want: Vec<&RequestRecord> = rows
            .iter()
            .filter(|r| w.contains(r.created_at))
            .filter(|r| {
                filters.iter().all(|(d, v)| match d {
                    Dimension::Model => r.model == *v,
                    _ => r.business_line.is_none(),
                })
            })
            .collect();
        want.sort_by(|a, b| {
            b.total_duration_ms
                .total_cmp(&a.total_duration_ms)
                .then_with(|| a.request_id.cmp(&b.request_id))
        });
        let want: Vec<String> = want.iter().take(10).map(|r| r.request_id.clone()).collect();
        let ids = |v: Vec<RequestRecord>| -> Vec<String> {
            v.into_iter().map(|r| r.request_id).collect()
        };
        let lite = RecordReader::slowest(&sqlite, w, &filters, 10).expect("sqlite");
        let click = RecordReader::slowest(&store, w, &filters, 10).expect("clickhouse");
        assert_eq!(lite, click, "{filters:?}");
        assert_eq!(ids(lite), want, "{filters:?}");
    }
}

/// Three replicas claim one incident at once: exactly one wins; a late claim within the hold
/// loses to it; after the hold, a new claim wins again; another incident is independent.
fn one_claim_wins_an_alert_incident(ch: &dyn Engine) {
    let url = ch.url("cl");
    connect(&url);
    let now = now_us();
    let settle = Duration::from_millis(500);
    let hold = 3_600_000_000;
    let wins: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = ["gw-a", "gw-b", "gw-c"]
            .into_iter()
            .enumerate()
            .map(|(i, name)| {
                let url = url.clone();
                s.spawn(move || {
                    let store = ClickHouseStore::connect_url(&url).expect("connect");
                    store
                        .claim("budget|search", name, now + i as i64 * 1_000, settle, hold)
                        .expect("claim")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect()
    });
    assert_eq!(wins, [true, false, false], "the earliest claim wins");
    let store = ClickHouseStore::connect_url(&url).expect("connect");
    // A replica that notices the incident a minute later loses to the winner; the winner
    // claiming again (a repeat) still holds it.
    assert!(!store
        .claim("budget|search", "gw-b", now + 60_000_000, settle, hold)
        .expect("claim"));
    assert!(store
        .claim("budget|search", "gw-a", now + 61_000_000, settle, hold)
        .expect("claim"));
    assert!(store
        .claim("budget|search", "gw-c", now + 2 * hold, settle, hold)
        .expect("claim"));
    assert!(store
        .claim("budget|ads", "gw-b", now, Duration::ZERO, hold)
        .expect("claim"));
}

fn v2_table_gains_client_request_id_and_keeps_its_rows(ch: &dyn Engine) {
    use tokenscope_clickhouse::schema::{MigrationContext, Target, MIGRATIONS};
    let version = ch.query("SELECT version()");
    let dialect = tokenscope_clickhouse::Dialect::from_version(&version).expect("dialect");
    // The table exactly as schema v2 left it, with one row written then (no client id).
    ch.query("CREATE DATABASE IF NOT EXISTS mig");
    let cx = MigrationContext {
        database: "mig",
        cluster: None,
        target: Target::Single,
        ttl_days: None,
    };
    for m in &MIGRATIONS[..2] {
        for sql in (m.statements)(&dialect, &cx) {
            ch.query(&sql);
        }
    }
    ch.query(
        "INSERT INTO mig.llm_inference_log (request_id, trace_id, created_at_us, model, upstream, \
         request_type, endpoint, stream, http_status, outcome, input_tokens_source, \
         output_tokens_source, queue_source, prefill_source, decode_source, total_duration_ms, \
         row_version) VALUES ('v2-row', 't', 1700000000000000, 'm', 'u', 'chat', \
         'chat_completions', 0, 200, 'ok', 'none', 'none', 'none', 'none', 'none', 1.5, 1)",
    );
    let store = ClickHouseStore::connect_url(&ch.url("mig")).expect("connect");
    assert_eq!(store.migrate().expect("migrate"), SCHEMA_VERSION);
    // The columns sit after cost_usd (the RowBinary layout), old rows read NULL / ''.
    let desc = ch.query("DESCRIBE TABLE mig.llm_inference_log");
    let cols: Vec<&str> = desc
        .lines()
        .filter_map(|l| l.split('\t').next())
        .filter(|c| {
            [
                "cost_usd",
                "client_request_id",
                "cache_creation_tokens",
                "replica",
                "row_version",
            ]
            .contains(c)
        })
        .collect();
    assert_eq!(
        cols,
        [
            "cost_usd",
            "client_request_id",
            "cache_creation_tokens",
            "replica",
            "row_version"
        ]
    );
    let old = store.get("v2-row").expect("get").expect("old row");
    assert_eq!(old.client_request_id, None);
    assert_eq!(
        (old.cache_creation_tokens, old.replica.as_str()),
        (None, "")
    );
    // Two requests with the same client id are two rows.
    let mut a = sparse_record("key-a");
    a.client_request_id = Some("shared".to_owned());
    let mut b = sparse_record("key-b");
    b.client_request_id = Some("shared".to_owned());
    store.insert(&[a.clone(), b]).expect("insert");
    assert_eq!(store.get("key-a").expect("get"), Some(a));
    assert_eq!(
        ch.query(
            "SELECT count() FROM mig.llm_inference_log FINAL WHERE client_request_id = 'shared'"
        )
        .trim(),
        "2"
    );
    // Migrating again is a no-op.
    assert_eq!(store.migrate().expect("migrate again"), SCHEMA_VERSION);
}

/// `secure=true`: rows go over HTTPS to the server's `https_port`, its certificate checked
/// against `ca_file`; without that CA the store refuses to open, naming the certificate.
#[test]
fn https_with_a_ca_file() {
    if !clickhouse_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = tokenscope_net::test_util::TestPki::generate(dir.path()).expect("pki");
    let srv = ClickHouseServer::builder()
        .https(&pki.server_cert, &pki.server_key)
        .start()
        .expect("clickhouse-server with https");
    let port = srv.https_port().expect("https port");
    let ca = pki.ca.display().to_string().replace('/', "%2F");
    let url = format!("clickhouse://default@localhost:{port}/default?secure=true&ca_file={ca}");
    let store = connect(&url);
    store.insert(&batch("tls", 3)).expect("insert over https");
    assert_eq!(
        srv.query("SELECT count() FROM default.llm_inference_log WHERE request_id LIKE 'tls%'")
            .trim(),
        "3"
    );
    // The system roots alone do not trust the test CA.
    let untrusted = ClickHouseConfig::from_url(&format!(
        "clickhouse://default@localhost:{port}/default?secure=true&connect_timeout_ms=5000"
    ))
    .expect("url");
    let err = ClickHouseStore::connect(untrusted).expect_err("untrusted certificate");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
}
