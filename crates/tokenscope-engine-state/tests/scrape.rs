//! End-to-end: recorded expositions served by a small axum server on 127.0.0.1, scraped by the
//! real scrapers, read back through the snapshots and through the registry's encoded gauges.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenscope_engine_state::exposition;
use tokenscope_engine_state::{
    nvml_probe, register_metrics, Engine, EngineKind, EngineSnapshot, EngineStateHandle,
    EngineTarget, GpuSource, GpuStateHandle, ScrapeConfig, TargetError,
};

const VLLM: &str = include_str!("fixtures/vllm_metrics.txt");
/// A real vLLM 0.32.0 (CPU) `/metrics`, captured by `scripts/capture-vllm-fixtures.py` after
/// three requests (43 prompt tokens, 24 generated); the flags it ran with are in
/// `requests.json` beside it.
const VLLM_REAL: &str = include_str!("../../tokenscope-cli/tests/fixtures/vllm/metrics.txt");
const SGLANG: &str = include_str!("fixtures/sglang_metrics.txt");
const TGI: &str = include_str!("fixtures/tgi_metrics.txt");
const LLAMACPP: &str = include_str!("fixtures/llamacpp_metrics.txt");
const DCGM: &str = include_str!("fixtures/dcgm_metrics.txt");

const MIB: u64 = 1024 * 1024;

/// A `/metrics` endpoint whose body can be swapped (`None` → 404) and whose hits are counted.
#[derive(Clone)]
struct Endpoint {
    body: Arc<Mutex<Option<String>>>,
    hits: Arc<AtomicU64>,
    delay: Duration,
}

impl Endpoint {
    fn set(&self, body: Option<&str>) {
        *self.body.lock().expect("endpoint body lock") = body.map(str::to_owned);
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn metrics(State(ep): State<Endpoint>) -> impl IntoResponse {
    ep.hits.fetch_add(1, Ordering::SeqCst);
    if !ep.delay.is_zero() {
        tokio::time::sleep(ep.delay).await;
    }
    let body = ep.body.lock().expect("endpoint body lock").clone();
    match body {
        Some(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "Not Found").into_response(),
    }
}

async fn serve(body: Option<&str>, delay: Duration) -> (SocketAddr, Endpoint) {
    let ep = Endpoint {
        body: Arc::new(Mutex::new(body.map(str::to_owned))),
        hits: Arc::new(AtomicU64::new(0)),
        delay,
    };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(ep.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("test server runs");
    });
    (addr, ep)
}

fn fast() -> ScrapeConfig {
    ScrapeConfig {
        interval: Duration::from_millis(40),
        timeout: Duration::from_millis(500),
        ..ScrapeConfig::default()
    }
}

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn engine(name: &str, addr: SocketAddr, kind: EngineKind) -> EngineStateHandle {
    let mut target = EngineTarget::new(name, format!("http://{addr}"));
    target.kind = kind;
    EngineStateHandle::spawn(target, fast()).expect("scraper starts")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// The registry's text encoding, parsed back with our own parser.
fn encoded(
    engines: &[EngineStateHandle],
    gpu: Option<&GpuStateHandle>,
) -> (String, exposition::Exposition) {
    let mut registry = Registry::default();
    register_metrics(&mut registry, engines, gpu);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("registry encodes");
    let parsed = exposition::parse(&text);
    assert_eq!(
        parsed.skipped_lines, 0,
        "encoded registry parses cleanly:\n{text}"
    );
    (text, parsed)
}

fn gauge(parsed: &exposition::Exposition, name: &str, label: &str, value: &str) -> Option<f64> {
    parsed
        .named(name)
        .find(|s| s.label(label) == Some(value))
        .map(|s| s.value)
}

#[tokio::test]
async fn recorded_vllm_exposition_yields_the_normalised_gauges() {
    let (addr, ep) = serve(Some(VLLM), Duration::ZERO).await;
    let handle = engine("vllm-a", addr, EngineKind::Auto);
    let snap: EngineSnapshot = eventually("a vLLM snapshot", || handle.snapshot()).await;
    assert_eq!(snap.kind, Some("vllm"));
    assert_eq!(
        snap.running, 8.0,
        "5 + 3 over the two data-parallel engines"
    );
    assert_eq!(snap.waiting, 2.0);
    assert!(
        close(snap.kv_usage.expect("kv usage"), 0.30),
        "{:?}",
        snap.kv_usage
    );
    assert!(close(
        snap.prefix_cache_hit_ratio_cumulative.expect("cumulative"),
        0.40
    ));
    assert!(
        close(snap.prefix_cache_hit_ratio.expect("recent"), 0.40),
        "first scrape: no window yet, cumulative stands in"
    );
    assert!(snap.age < Duration::from_secs(5));
    assert_eq!(handle.last_error(), None);
    assert_eq!(
        handle.metrics_url(),
        Some(format!("http://{addr}/metrics").as_str())
    );

    let (text, parsed) = encoded(std::slice::from_ref(&handle), None);
    assert!(
        text.contains("# TYPE llm_engine_requests_running gauge"),
        "{text}"
    );
    assert_eq!(
        gauge(&parsed, "llm_engine_state_up", "upstream", "vllm-a"),
        Some(1.0)
    );
    assert_eq!(
        gauge(&parsed, "llm_engine_requests_running", "upstream", "vllm-a"),
        Some(8.0)
    );
    assert_eq!(
        gauge(&parsed, "llm_engine_requests_waiting", "upstream", "vllm-a"),
        Some(2.0)
    );
    let kv = gauge(
        &parsed,
        "llm_engine_kv_cache_usage_ratio",
        "upstream",
        "vllm-a",
    )
    .expect("kv gauge");
    assert!(close(kv, 0.30), "{kv}");
    let hit = gauge(
        &parsed,
        "llm_engine_prefix_cache_hit_ratio",
        "upstream",
        "vllm-a",
    )
    .expect("hit gauge");
    assert!(close(hit, 0.40), "{hit}");
    assert_eq!(
        parsed.named("llm_gpu_utilization_ratio").count(),
        0,
        "no GPU handle given"
    );

    // Engine 0 answers 1000 more queried tokens, 900 of them from the cache: the window ratio
    // moves to 0.9, the cumulative one to 32900 / 81000.
    let next = VLLM
        .replace(
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 48000.0",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 49000.0",
        )
        .replace(
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 18000.0",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 18900.0",
        );
    assert_ne!(next, VLLM, "the fixture carries the counters being edited");
    ep.set(Some(&next));
    let snap = eventually("the windowed ratio", || {
        handle
            .snapshot()
            .filter(|s| s.prefix_cache_hit_ratio.is_some_and(|r| close(r, 0.9)))
    })
    .await;
    assert!(close(
        snap.prefix_cache_hit_ratio_cumulative.expect("cumulative"),
        32_900.0 / 81_000.0
    ));
    let (_, parsed) = encoded(std::slice::from_ref(&handle), None);
    let hit = gauge(
        &parsed,
        "llm_engine_prefix_cache_hit_ratio",
        "upstream",
        "vllm-a",
    )
    .expect("hit gauge");
    assert!(close(hit, 0.9), "{hit}");
}

/// The real vLLM 0.32.0 exposition, as captured: one engine, idle, 43 prefix-cache queries and
/// no hits. Then the same text with its gauge lines set to a busy engine's values (the line
/// format is the real one; only the numbers change).
#[tokio::test]
async fn real_vllm_0_32_exposition_yields_its_own_numbers() {
    let line =
        |name: &str, v: &str| format!("{name}{{engine=\"0\",model_name=\"gemma-3-270m\"}} {v}");
    for (name, v) in [
        ("vllm:num_requests_running", "0.0"),
        ("vllm:num_requests_waiting", "0.0"),
        ("vllm:kv_cache_usage_perc", "0.0"),
        ("vllm:prefix_cache_queries_total", "43.0"),
        ("vllm:prefix_cache_hits_total", "0.0"),
    ] {
        assert!(
            VLLM_REAL.lines().any(|l| l == line(name, v)),
            "the capture has {}",
            line(name, v)
        );
    }
    let (addr, ep) = serve(Some(VLLM_REAL), Duration::ZERO).await;
    let handle = engine("vllm-real", addr, EngineKind::Auto);
    let snap = eventually("a snapshot of the real exposition", || handle.snapshot()).await;
    assert_eq!(snap.kind, Some("vllm"), "detected from the real names");
    assert_eq!(snap.running, 0.0);
    assert_eq!(snap.waiting, 0.0);
    assert_eq!(snap.kv_usage, Some(0.0));
    assert_eq!(snap.prefix_cache_hit_ratio_cumulative, Some(0.0), "0 / 43");
    assert_eq!(handle.last_error(), None);

    let busy = VLLM_REAL
        .replace(
            &line("vllm:num_requests_running", "0.0"),
            &line("vllm:num_requests_running", "4.0"),
        )
        .replace(
            &line("vllm:num_requests_waiting", "0.0"),
            &line("vllm:num_requests_waiting", "7.0"),
        )
        .replace(
            &line("vllm:kv_cache_usage_perc", "0.0"),
            &line("vllm:kv_cache_usage_perc", "0.9245283018867925"),
        )
        .replace(
            &line("vllm:prefix_cache_queries_total", "43.0"),
            &line("vllm:prefix_cache_queries_total", "143.0"),
        )
        .replace(
            &line("vllm:prefix_cache_hits_total", "0.0"),
            &line("vllm:prefix_cache_hits_total", "25.0"),
        );
    ep.set(Some(&busy));
    let snap = eventually("the busy values", || {
        handle.snapshot().filter(|s| s.running == 4.0)
    })
    .await;
    assert_eq!(snap.waiting, 7.0);
    assert!(close(snap.kv_usage.expect("kv"), 0.924_528_301_886_792_5));
    assert!(close(
        snap.prefix_cache_hit_ratio.expect("windowed"),
        25.0 / 100.0
    ));
    assert!(close(
        snap.prefix_cache_hit_ratio_cumulative.expect("cumulative"),
        25.0 / 143.0
    ));
    let (_, parsed) = encoded(std::slice::from_ref(&handle), None);
    assert_eq!(
        gauge(
            &parsed,
            "llm_engine_requests_waiting",
            "upstream",
            "vllm-real"
        ),
        Some(7.0)
    );
}

#[tokio::test]
async fn recorded_dcgm_exposition_yields_the_normalised_gauges() {
    let (addr, _ep) = serve(Some(DCGM), Duration::ZERO).await;
    let gpu = GpuStateHandle::spawn_dcgm(&format!("http://{addr}/metrics"), fast())
        .expect("scraper starts");
    assert_eq!(gpu.source(), GpuSource::Dcgm);
    let snap = eventually("a DCGM snapshot", || gpu.snapshot()).await;
    assert_eq!(snap.source, GpuSource::Dcgm);
    assert_eq!(snap.gpus.len(), 2);
    let g0 = &snap.gpus[0];
    let g1 = &snap.gpus[1];
    assert_eq!(g0.gpu, "0");
    assert_eq!(
        g0.uuid.as_deref(),
        Some("GPU-5f6c1d6e-3b9a-8c2e-71d4-0a9e4b2c7f11")
    );
    assert_eq!(g0.model_name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(g0.utilization, Some(0.87));
    assert_eq!(g1.utilization, Some(0.45));
    assert_eq!(g0.memory_used_bytes, Some(61_234 * MIB));
    assert_eq!(
        g0.memory_total_bytes,
        Some(81_559 * MIB),
        "used + free + reserved"
    );
    assert_eq!(g1.memory_used_bytes, Some(40_000 * MIB));
    assert_eq!(g0.memory_bandwidth_utilization, Some(0.690789));
    assert_eq!(g1.memory_bandwidth_utilization, Some(0.312201));
    assert_eq!(g0.sm_active, Some(0.912345));
    assert!(close(snap.mean_utilization.expect("mean util"), 0.66));
    assert!(close(
        snap.mean_memory_bandwidth.expect("mean bw"),
        0.501495
    ));
    assert!(close(
        snap.mean_sm_active.expect("mean sm"),
        (0.912345 + 0.401122) / 2.0
    ));
    assert_eq!(snap.memory_used_bytes, 101_234 * MIB);
    assert_eq!(snap.memory_total_bytes, 2 * 81_559 * MIB);

    let (text, parsed) = encoded(&[], Some(&gpu));
    assert!(
        text.contains("# TYPE llm_gpu_memory_used_bytes gauge"),
        "{text}"
    );
    assert_eq!(
        gauge(&parsed, "llm_gpu_utilization_ratio", "gpu", "0"),
        Some(0.87)
    );
    assert_eq!(
        gauge(&parsed, "llm_gpu_utilization_ratio", "gpu", "1"),
        Some(0.45)
    );
    assert_eq!(
        gauge(&parsed, "llm_gpu_memory_used_bytes", "gpu", "0"),
        Some((61_234 * MIB) as f64)
    );
    assert_eq!(
        gauge(&parsed, "llm_gpu_memory_total_bytes", "gpu", "1"),
        Some((81_559 * MIB) as f64)
    );
    assert_eq!(
        gauge(
            &parsed,
            "llm_gpu_memory_bandwidth_utilization_ratio",
            "gpu",
            "0"
        ),
        Some(0.690789)
    );
    assert_eq!(
        parsed.named("llm_engine_state_up").count(),
        0,
        "no engines given"
    );
}

#[tokio::test]
async fn recorded_sglang_tgi_and_llamacpp_expositions() {
    let (a, _ea) = serve(Some(SGLANG), Duration::ZERO).await;
    let (b, _eb) = serve(Some(TGI), Duration::ZERO).await;
    let (c, _ec) = serve(Some(LLAMACPP), Duration::ZERO).await;
    let sglang = engine("sglang", a, EngineKind::Auto);
    let tgi = engine("tgi", b, EngineKind::Engine(Engine::Tgi));
    let llama = engine("llama", c, "llamacpp".parse().expect("kind name"));

    let s = eventually("an SGLang snapshot", || sglang.snapshot()).await;
    assert_eq!(s.kind, Some("sglang"));
    assert_eq!(
        s.running, 12.0,
        "dp 0 (7) + dp 1 (5); tp replicas count once"
    );
    assert_eq!(s.waiting, 3.0);
    assert!(close(s.kv_usage.expect("token usage"), 0.57));
    assert!(close(
        s.prefix_cache_hit_ratio.expect("hit-rate gauge"),
        0.64
    ));
    assert!(close(
        s.prefix_cache_hit_ratio_cumulative.expect("cumulative"),
        0.60
    ));

    let t = eventually("a TGI snapshot", || tgi.snapshot()).await;
    assert_eq!(t.kind, Some("tgi"));
    assert_eq!((t.running, t.waiting), (6.0, 4.0));
    assert_eq!(t.kv_usage, None);
    assert_eq!(t.prefix_cache_hit_ratio, None);

    let l = eventually("a llama.cpp snapshot", || llama.snapshot()).await;
    assert_eq!(l.kind, Some("llamacpp"));
    assert_eq!((l.running, l.waiting), (2.0, 1.0));
    assert_eq!(
        l.kv_usage, None,
        "this llama.cpp build has no kv_cache_usage_ratio"
    );
    assert!(close(
        l.prefix_cache_hit_ratio_cumulative.expect("cumulative"),
        83.0 / 242.0
    ));

    let handles = [sglang.clone(), tgi.clone(), llama.clone()];
    let (_, parsed) = encoded(&handles, None);
    assert_eq!(
        gauge(&parsed, "llm_engine_requests_running", "upstream", "sglang"),
        Some(12.0)
    );
    assert_eq!(
        gauge(&parsed, "llm_engine_requests_waiting", "upstream", "tgi"),
        Some(4.0)
    );
    assert_eq!(
        gauge(&parsed, "llm_engine_requests_running", "upstream", "llama"),
        Some(2.0)
    );
    assert_eq!(
        gauge(
            &parsed,
            "llm_engine_kv_cache_usage_ratio",
            "upstream",
            "tgi"
        ),
        None,
        "no KV signal, no series"
    );
    let kv = gauge(
        &parsed,
        "llm_engine_kv_cache_usage_ratio",
        "upstream",
        "sglang",
    )
    .expect("kv");
    assert!(close(kv, 0.57));
}

/// A `Write` sink for the tracing subscriber, shared with the test.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .expect("log buffer lock")
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer lock")).into_owned()
    }
}

#[tokio::test]
async fn missing_endpoint_is_unknown_warns_once_and_recovers() {
    let logs = LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let (addr, ep) = serve(None, Duration::ZERO).await;
    let handle = engine("nometrics", addr, EngineKind::Auto);
    eventually("five failed scrapes", || {
        (handle.failed_scrapes() >= 5).then_some(())
    })
    .await;
    assert_eq!(handle.snapshot(), None, "state unknown");
    let error = handle.last_error().expect("an error is kept");
    assert!(error.contains("404"), "{error}");
    let text = logs.text();
    let warns = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("engine state unknown"))
        .count();
    assert_eq!(warns, 1, "one warn per outage, not per scrape:\n{text}");
    assert!(
        text.lines().filter(|l| l.contains("still unknown")).count() >= 4,
        "{text}"
    );
    assert!(text.contains("nometrics"), "the upstream is named:\n{text}");

    let (_, parsed) = encoded(std::slice::from_ref(&handle), None);
    assert_eq!(
        gauge(&parsed, "llm_engine_state_up", "upstream", "nometrics"),
        Some(0.0)
    );
    assert_eq!(
        parsed.named("llm_engine_requests_running").count(),
        0,
        "unknown is absent, not 0"
    );

    // The endpoint appears: the next scrape knows the state again, and says so once.
    ep.set(Some(TGI));
    let snap = eventually("recovery", || handle.snapshot()).await;
    assert_eq!(snap.kind, Some("tgi"));
    assert_eq!(handle.last_error(), None);
    let text = logs.text();
    assert_eq!(
        text.matches("engine state known again").count(),
        1,
        "{text}"
    );

    // And a new outage warns again, once.
    ep.set(None);
    eventually("the next outage", || {
        handle.snapshot().is_none().then_some(())
    })
    .await;
    let before = handle.failed_scrapes();
    eventually("more failures", || {
        (handle.failed_scrapes() >= before + 3).then_some(())
    })
    .await;
    let warns = logs
        .text()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("engine state unknown"))
        .count();
    assert_eq!(warns, 2);
}

#[tokio::test]
async fn unreachable_slow_and_foreign_endpoints_are_unknown() {
    // Nothing listens on a port we bound and released.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let refused = engine(
        "refused",
        SocketAddr::from(([127, 0, 0, 1], port)),
        EngineKind::Auto,
    );

    // An endpoint slower than the timeout.
    let (slow_addr, _slow) = serve(Some(VLLM), Duration::from_secs(3)).await;
    let mut target = EngineTarget::new("slow", format!("http://{slow_addr}"));
    target.kind = EngineKind::Auto;
    let slow = EngineStateHandle::spawn(
        target,
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(150),
            ..ScrapeConfig::default()
        },
    )
    .expect("scraper starts");

    // A Prometheus endpoint that is no engine, and a vLLM one read as TGI.
    let (foreign_addr, _f) = serve(Some("process_cpu_seconds_total 3.5\n"), Duration::ZERO).await;
    let foreign = engine("foreign", foreign_addr, EngineKind::Auto);
    let (vllm_addr, _v) = serve(Some(VLLM), Duration::ZERO).await;
    let mislabelled = engine("mislabelled", vllm_addr, EngineKind::Engine(Engine::Tgi));

    for (h, needle) in [
        (&refused, "cannot reach"),
        (&slow, "no answer within"),
        (&foreign, "no known engine metrics"),
        (&mislabelled, "no tgi metrics"),
    ] {
        let err = eventually("a failed scrape", || h.last_error()).await;
        assert!(err.contains(needle), "{}: {err}", h.name());
        assert_eq!(h.snapshot(), None, "{}", h.name());
    }
}

#[tokio::test]
async fn openai_kind_and_bad_urls_start_no_scraper() {
    let (addr, ep) = serve(Some(VLLM), Duration::ZERO).await;
    let mut target = EngineTarget::new("hosted", format!("http://{addr}"));
    target.kind = EngineKind::OpenAi;
    let handle = EngineStateHandle::spawn(target, fast()).expect("handle");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ep.hits(), 0);
    assert_eq!(handle.scrapes(), 0);
    assert_eq!(handle.snapshot(), None);
    assert_eq!(handle.metrics_url(), None);
    assert!(handle.last_error().expect("reason").contains("openai"));

    // With an explicit metrics URL, an openai upstream is scraped and auto-detected.
    let mut target = EngineTarget::new("hosted-with-metrics", "http://unused.invalid");
    target.kind = EngineKind::OpenAi;
    target.metrics_url = Some(format!("http://{addr}/metrics"));
    let handle = EngineStateHandle::spawn(target, fast()).expect("handle");
    let snap = eventually("a snapshot", || handle.snapshot()).await;
    assert_eq!(snap.kind, Some("vllm"));

    let ftp = EngineStateHandle::spawn(EngineTarget::new("ftp", "ftp://api.example.com"), fast());
    assert!(matches!(ftp, Err(TargetError::UnsupportedScheme { .. })));
    let bad = EngineStateHandle::spawn(EngineTarget::new("bad", "not a url"), fast());
    assert!(matches!(bad, Err(TargetError::InvalidUrl { .. })));
}

/// An `https://` engine is scraped with the target's CA; without it every scrape fails with
/// the certificate named as the reason.
#[tokio::test]
async fn https_metrics_with_the_targets_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = tokenscope_net::test_util::TestPki::generate(dir.path()).expect("pki");
    let tls = tokenscope_net::server_config(&pki.server_cert, &pki.server_key, None, &[])
        .expect("server config");
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let listener = tokenscope_net::TlsListener::new(tcp, tls).expect("listener");
    let ep = Endpoint {
        body: Arc::new(Mutex::new(Some(VLLM.to_owned()))),
        hits: Arc::new(AtomicU64::new(0)),
        delay: Duration::ZERO,
    };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(ep.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut target = EngineTarget::new("tls", format!("https://localhost:{port}"));
    target.tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
        ca_file: Some(pki.ca.clone()),
        ..Default::default()
    })
    .expect("client tls");
    let handle = EngineStateHandle::spawn(target, fast()).expect("scraper");
    let snap = eventually("an https snapshot", || handle.snapshot()).await;
    assert_eq!(snap.kind, Some("vllm"));

    let untrusted = EngineStateHandle::spawn(
        EngineTarget::new("untrusted", format!("https://localhost:{port}")),
        fast(),
    )
    .expect("scraper");
    let err = eventually("a failed scrape", || untrusted.last_error()).await;
    assert!(err.contains("UnknownIssuer"), "{err}");
    assert_eq!(untrusted.snapshot(), None);
}

#[test]
fn spawning_outside_a_runtime_is_an_error() {
    let r = EngineStateHandle::spawn(
        EngineTarget::new("x", "http://127.0.0.1:9"),
        ScrapeConfig::default(),
    );
    assert_eq!(r.err(), Some(TargetError::NoRuntime));
}

#[tokio::test]
async fn dropping_every_handle_stops_the_scraper() {
    let (addr, ep) = serve(Some(TGI), Duration::ZERO).await;
    let handle = engine("short-lived", addr, EngineKind::Auto);
    eventually("a snapshot", || handle.snapshot()).await;
    drop(handle);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after_drop = ep.hits();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        ep.hits(),
        after_drop,
        "no scrapes after the last handle is gone"
    );

    let (addr, ep) = serve(Some(TGI), Duration::ZERO).await;
    let handle = engine("stopped", addr, EngineKind::Auto);
    eventually("a snapshot", || handle.snapshot()).await;
    handle.shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after_stop = ep.hits();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ep.hits(), after_stop, "no scrapes after shutdown");
    assert!(handle.snapshot().is_some(), "the last state stays readable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_read_lock_free_and_never_torn() {
    // Two expositions that differ in every field; the scraper flips between them as fast as it
    // can while reader threads hammer snapshot(). Every snapshot must be wholly one or the other.
    let a = "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 10\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n";
    let b = "vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_waiting{engine=\"0\"} 20\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n";
    let (addr, ep) = serve(Some(a), Duration::ZERO).await;
    let mut target = EngineTarget::new("flip", format!("http://{addr}"));
    target.kind = EngineKind::Engine(Engine::Vllm);
    let handle = EngineStateHandle::spawn(
        target,
        ScrapeConfig {
            interval: Duration::from_millis(1),
            ..ScrapeConfig::default()
        },
    )
    .expect("scraper starts");
    eventually("a snapshot", || handle.snapshot()).await;

    let flipper = {
        let ep = ep.clone();
        tokio::spawn(async move {
            for i in 0..200 {
                ep.set(Some(if i % 2 == 0 { b } else { a }));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let h = handle.clone();
            std::thread::spawn(move || {
                let mut seen = [0u64; 2];
                let start = Instant::now();
                while start.elapsed() < Duration::from_millis(400) {
                    let s = h.snapshot().expect("state stays known");
                    match (s.running, s.waiting, s.kv_usage) {
                        (r, w, Some(k)) if r == 1.0 && w == 10.0 && k == 0.1 => seen[0] += 1,
                        (r, w, Some(k)) if r == 2.0 && w == 20.0 && k == 0.2 => seen[1] += 1,
                        other => panic!("torn snapshot {other:?}"),
                    }
                }
                seen
            })
        })
        .collect();
    let mut total = [0u64; 2];
    for r in readers {
        let seen = r.join().expect("reader thread");
        total[0] += seen[0];
        total[1] += seen[1];
    }
    flipper.await.expect("flipper task");
    assert!(
        total[0] + total[1] > 10_000,
        "reads never wait on the scraper: {total:?}"
    );
    assert!(
        handle.scrapes() > 5,
        "the scraper kept publishing meanwhile"
    );
}

#[tokio::test]
async fn dcgm_endpoint_missing_is_unknown_and_has_no_gauges() {
    let (addr, _ep) = serve(None, Duration::ZERO).await;
    let gpu = GpuStateHandle::spawn_dcgm(&format!("http://{addr}/metrics"), fast())
        .expect("scraper starts");
    let err = eventually("a failed DCGM scrape", || gpu.last_error()).await;
    assert!(err.contains("404"), "{err}");
    assert_eq!(gpu.snapshot(), None);
    let (_, parsed) = encoded(&[], Some(&gpu));
    assert!(
        parsed.samples.is_empty(),
        "unknown GPU state emits nothing: {:?}",
        parsed.samples
    );

    let (addr, _ep) = serve(Some(VLLM), Duration::ZERO).await;
    let gpu = GpuStateHandle::spawn_dcgm(&format!("http://{addr}/metrics"), fast())
        .expect("scraper starts");
    let err = eventually("a failed DCGM scrape", || gpu.last_error()).await;
    assert!(err.contains("no DCGM GPU fields"), "{err}");
}

#[test]
fn nvml_absent_or_present_is_consistent() {
    let probe = nvml_probe();
    assert!(!probe.is_empty());
    let logs = LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let first = tracing::subscriber::with_default(subscriber, || {
        let first = GpuStateHandle::spawn_nvml(Duration::from_millis(100));
        if first.is_none() {
            assert!(GpuStateHandle::spawn_nvml(Duration::from_millis(100)).is_none());
        }
        first
    });
    match first {
        None => {
            assert!(probe.contains("NVML unavailable"), "{probe}");
            let text = logs.text();
            assert_eq!(
                text.lines()
                    .filter(|l| l.contains("INFO") && l.contains("NVML not available"))
                    .count(),
                1,
                "one info line per process, not per attempt:\n{text}"
            );
            assert!(!text.contains("WARN") && !text.contains("ERROR"), "{text}");
        }
        Some(handle) => {
            assert!(probe.starts_with("NVML loaded from"), "{probe}");
            assert_eq!(handle.source(), GpuSource::Nvml);
            let deadline = Instant::now() + Duration::from_secs(5);
            while handle.snapshot().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let snap = handle.snapshot().expect("an NVML snapshot");
            assert!(snap
                .gpus
                .iter()
                .all(|g| g.utilization.is_none_or(|u| (0.0..=1.0).contains(&u))));
            assert!(snap.memory_total_bytes >= snap.memory_used_bytes);
            handle.shutdown();
        }
    }
}

/// Two replicas of one upstream: one series per replica (`replica` label), each with its own
/// engine's values; a target without a replica keeps the `upstream` label alone.
#[tokio::test]
async fn replicas_of_one_upstream_are_series_of_their_own() {
    let (a, _ea) = serve(Some(VLLM), Duration::ZERO).await;
    let (b, _eb) = serve(Some(LLAMACPP), Duration::ZERO).await;
    let replica = |addr: SocketAddr| {
        let mut t = EngineTarget::new("pool", format!("http://{addr}"));
        t.replica = Some(addr.to_string());
        EngineStateHandle::spawn(t, fast()).expect("scraper starts")
    };
    let (ha, hb) = (replica(a), replica(b));
    let single = engine("solo", a, EngineKind::Auto);
    let sa = eventually("replica a", || ha.snapshot()).await;
    let sb = eventually("replica b", || hb.snapshot()).await;
    eventually("solo", || single.snapshot()).await;
    assert_eq!(ha.replica(), Some(a.to_string().as_str()));
    assert_ne!(sa.kind, sb.kind);
    let (_, parsed) = encoded(&[ha, hb, single], None);
    let running: Vec<(Option<String>, Option<String>, f64)> = parsed
        .named("llm_engine_requests_running")
        .map(|s| {
            (
                s.label("upstream").map(str::to_owned),
                s.label("replica").map(str::to_owned),
                s.value,
            )
        })
        .collect();
    assert_eq!(
        running,
        [
            (Some("pool".to_owned()), Some(a.to_string()), sa.running),
            (Some("pool".to_owned()), Some(b.to_string()), sb.running),
            (Some("solo".to_owned()), None, sa.running),
        ]
    );
}
