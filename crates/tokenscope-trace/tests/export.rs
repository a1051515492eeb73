//! The exporter against an independent OTLP receiver (`otlp_receiver.py`: official Python
//! `opentelemetry-proto` classes, `grpcio` for gRPC): batching, retries on retryable answers
//! (each span delivered exactly once), non-retryable answers dropped and counted, shutdown
//! flush. Skips without the OpenTelemetry Python venv unless `TOKENSCOPE_REQUIRE_OTEL_PY=1`.

mod common;

use common::receiver::{otel_python, require_otel_py, Receiver};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokenscope_core::{Endpoint, Outcome, RequestRecord};
use tokenscope_trace::{
    build_spans, ExportObserver, ExporterConfig, KeepReason, Protocol, RequestTrace,
    SpanDropReason, SpanInput, SpanTimes, TraceExporter,
};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/otlp_receiver.py");

#[derive(Default)]
struct Counts {
    exported: AtomicUsize,
    errors: Mutex<Vec<&'static str>>,
    dropped: Mutex<Vec<(SpanDropReason, usize)>>,
}

impl ExportObserver for Counts {
    fn exported(&self, spans: usize) {
        self.exported.fetch_add(spans, Ordering::SeqCst);
    }
    fn dropped(&self, reason: SpanDropReason, spans: usize) {
        self.dropped.lock().expect("lock").push((reason, spans));
    }
    fn export_error(&self, kind: &'static str) {
        self.errors.lock().expect("lock").push(kind);
    }
    fn queue_depth(&self, _: usize) {}
}

fn trace_spans(n: usize) -> Vec<(String, Vec<tokenscope_trace::Span>)> {
    (0..n)
        .map(|i| {
            let trace = RequestTrace::start(None);
            let rec = RequestRecord {
                request_id: format!("r{i}"),
                trace_id: trace.trace_id_hex(),
                created_at: 1_700_000_000_000_000 + i as i64,
                model: "m".into(),
                endpoint: Endpoint::ChatCompletions,
                outcome: Outcome::Ok,
                total_duration_ms: 10.0,
                http_status: 200,
                ..RequestRecord::default()
            };
            let spans = build_spans(
                &rec,
                &SpanInput {
                    trace: &trace,
                    times: SpanTimes {
                        upstream_sent_ms: Some(1.0),
                    },
                    user_bucket: "u1",
                    server: None,
                    reason: KeepReason::Ratio,
                    response_id: None,
                },
            );
            (trace.trace_id_hex(), spans)
        })
        .collect()
}

fn config(rx: &Receiver, protocol: Protocol) -> ExporterConfig {
    ExporterConfig {
        endpoint: rx.endpoint(),
        protocol,
        batch_spans: 64,
        batch_timeout: Duration::from_millis(50),
        export_timeout: Duration::from_secs(20),
        ..ExporterConfig::default()
    }
}

async fn retries_deliver_exactly_once(protocol: Protocol) {
    let Some(rx) = Receiver::start(Path::new(SCRIPT), protocol.as_str(), &["--fail-first", "2"])
    else {
        return;
    };
    let counts = Arc::new(Counts::default());
    let exp = TraceExporter::spawn(config(&rx, protocol), counts.clone()).expect("exporter");
    let traces = trace_spans(100);
    let total: usize = traces.iter().map(|(_, s)| s.len()).sum();
    for (_, spans) in &traces {
        assert!(exp.submit(spans.clone()));
    }
    exp.shutdown(Duration::from_secs(30)).await;
    let got = rx.wait_for_spans(|s| s.len() >= total, Duration::from_secs(5));
    assert_eq!(got.len(), total, "every span once");
    let mut ids: Vec<&str> = got.iter().filter_map(|s| s["span_id"].as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), total, "no span twice");
    assert_eq!(counts.exported.load(Ordering::SeqCst), total);
    assert!(counts.dropped.lock().expect("lock").is_empty());
    let errors = counts.errors.lock().expect("lock").clone();
    assert_eq!(
        errors,
        ["status_retryable", "status_retryable"],
        "{errors:?}"
    );
    assert_eq!(got[0]["resource"]["service.name"], "tokenscope");
    assert_eq!(exp.queued_spans(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_retries_deliver_exactly_once() {
    retries_deliver_exactly_once(Protocol::Http).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_retries_deliver_exactly_once() {
    retries_deliver_exactly_once(Protocol::Grpc).await;
}

/// A non-retryable answer (wrong path → 404) drops the batch at once and counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_batches_are_dropped_and_counted() {
    let Some(rx) = Receiver::start(Path::new(SCRIPT), "http", &[]) else {
        return;
    };
    let counts = Arc::new(Counts::default());
    let mut cfg = config(&rx, Protocol::Http);
    cfg.endpoint = format!("{}/wrong/v1/traces", rx.endpoint());
    let exp = TraceExporter::spawn(cfg, counts.clone()).expect("exporter");
    let traces = trace_spans(10);
    let total: usize = traces.iter().map(|(_, s)| s.len()).sum();
    for (_, spans) in traces {
        exp.submit(spans);
    }
    exp.shutdown(Duration::from_secs(10)).await;
    let dropped: usize = counts
        .dropped
        .lock()
        .expect("lock")
        .iter()
        .map(|(r, n)| {
            assert_eq!(*r, SpanDropReason::Rejected);
            *n
        })
        .sum();
    assert_eq!(dropped, total);
    assert_eq!(counts.exported.load(Ordering::SeqCst), 0);
    assert!(counts
        .errors
        .lock()
        .expect("lock")
        .iter()
        .all(|k| *k == "status_rejected"));
}

/// A full queue refuses (and counts) instead of growing; shutdown with the collector down
/// counts what is left; the sum always equals what was submitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_and_shutdown_account_for_every_span() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port");
    let counts = Arc::new(Counts::default());
    let exp = TraceExporter::spawn(
        ExporterConfig {
            endpoint: format!("http://{dead}"),
            queue_spans: 50,
            batch_spans: 10,
            batch_timeout: Duration::from_millis(10),
            export_timeout: Duration::from_secs(60),
            ..ExporterConfig::default()
        },
        counts.clone(),
    )
    .expect("exporter");
    let traces = trace_spans(100);
    let total: usize = traces.iter().map(|(_, s)| s.len()).sum();
    let mut refused = 0;
    for (_, spans) in traces {
        let n = spans.len();
        if !exp.submit(spans) {
            refused += n;
        }
        assert!(exp.queued_spans() <= 50);
    }
    assert!(refused > 0);
    exp.shutdown(Duration::from_millis(500)).await;
    let dropped = counts.dropped.lock().expect("lock").clone();
    let full: usize = dropped
        .iter()
        .filter(|(r, _)| *r == SpanDropReason::QueueFull)
        .map(|(_, n)| n)
        .sum();
    let at_shutdown: usize = dropped
        .iter()
        .filter(|(r, _)| *r == SpanDropReason::Shutdown)
        .map(|(_, n)| n)
        .sum();
    assert_eq!(full, refused);
    assert_eq!(full + at_shutdown, total, "{dropped:?}");
    assert_eq!(counts.exported.load(Ordering::SeqCst), 0);
    assert!(
        !exp.submit(trace_spans(1).remove(0).1),
        "closed after shutdown"
    );
}

/// The receiver itself, checked against the OpenTelemetry Python SDK's own exporters.
#[test]
fn receiver_selftest_against_the_python_sdk() {
    let Some(python) = otel_python() else {
        assert!(
            !require_otel_py(),
            "TOKENSCOPE_REQUIRE_OTEL_PY=1 but no venv"
        );
        eprintln!("SKIP: no OpenTelemetry Python venv");
        return;
    };
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/otlp_receiver_selftest.py"
        ))
        .output()
        .expect("run selftest");
    assert!(
        out.status.success(),
        "selftest failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
