//! The receiver against spans made and exported by the official OpenTelemetry Python SDK.
//!
//! `tests/emit_spans.py` builds vLLM-shaped `llm_request` spans (names and Python types as vLLM
//! sets them; parent from the traceparent this test gives) and sends them with the SDK's
//! OTLP/HTTP protobuf exporter (plain and gzip) and as OTLP/JSON (plain and gzip) to the
//! [`router`] served on a loopback port. The test asserts every decoded value exactly.
//!
//! Needs the venv made by `scripts/install-python-otel.sh`
//! (`${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/otel-venv`). Without it the test prints a
//! skip message and passes, unless `TOKENSCOPE_REQUIRE_OTEL_PY=1` (CI), where it fails.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokenscope_core::PhaseUpdate;
use tokenscope_otlp::{router_with_stats, EngineSpan, ReceiverSnapshot, ReceiverStats, SpanSink};

/// The gateway's trace id and span id, as it would send them upstream in `traceparent`.
const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT_SPAN_ID: &str = "b7ad6b7169203331";

const VARIANTS: [&str; 4] = ["protobuf", "protobuf-gzip", "json", "json-gzip"];

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn venv_python() -> PathBuf {
    let cache = std::env::var_os("TOKENSCOPE_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/tokenscope")))
        .unwrap_or_else(|| PathBuf::from(".cache/tokenscope"));
    cache.join("otel-venv/bin/python")
}

fn required() -> bool {
    std::env::var("TOKENSCOPE_REQUIRE_OTEL_PY").is_ok_and(|v| v == "1")
}

/// The expected engine spans, from `tests/fixtures/engine_spans.json` (the third fixture span
/// has no `gen_ai.latency/usage` attribute and must not appear). Seconds × 1000 is written out
/// so that the comparison is exact for any double.
fn expected(span_ids: &[String]) -> Vec<EngineSpan> {
    let span = |i: usize,
                request_id: &str,
                update: PhaseUpdate,
                ttft_ms: f64,
                e2e_ms: f64|
     -> EngineSpan {
        EngineSpan {
            trace_id: TRACE_ID.to_owned(),
            span_id: span_ids[i].clone(),
            name: "llm_request".to_owned(),
            request_id: Some(request_id.to_owned()),
            update,
            ttft_ms: Some(ttft_ms),
            e2e_ms: Some(e2e_ms),
            service_name: Some("vllm".to_owned()),
        }
    };
    vec![
        span(
            0,
            "chatcmpl-7f3a9c1e2b4d4e5f9a0b1c2d3e4f5a6b",
            PhaseUpdate {
                trace_id: TRACE_ID.to_owned(),
                queue_duration_ms: Some(0.0017 * 1000.0),
                prefill_duration_ms: Some(0.0214 * 1000.0),
                decode_duration_ms: Some(0.7689 * 1000.0),
                input_tokens: Some(128),
                output_tokens: Some(64),
                per_step: false,
            },
            0.0431 * 1000.0,
            0.8125 * 1000.0,
        ),
        span(
            1,
            "sgl-0042",
            PhaseUpdate {
                trace_id: TRACE_ID.to_owned(),
                queue_duration_ms: None,
                prefill_duration_ms: None,
                decode_duration_ms: Some(750.0),
                input_tokens: Some(7),
                output_tokens: Some(20),
                per_step: false,
            },
            250.0,
            1000.0,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_spans_decode_exactly() {
    let python = venv_python();
    if !python.is_file() {
        let msg = format!(
            "OpenTelemetry Python venv not found at {}; run \
             crates/tokenscope-otlp/scripts/install-python-otel.sh",
            python.display()
        );
        assert!(!required(), "TOKENSCOPE_REQUIRE_OTEL_PY=1: {msg}");
        eprintln!("SKIP python_sdk_spans_decode_exactly: {msg}");
        return;
    }

    let calls: Arc<Mutex<Vec<Vec<EngineSpan>>>> = Arc::default();
    let seen = Arc::clone(&calls);
    let sink: SpanSink = Arc::new(move |spans| seen.lock().expect("sink lock").push(spans));
    let stats = Arc::new(ReceiverStats::default());
    let app: axum::Router = router_with_stats(sink, Arc::clone(&stats));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback port");
    let addr = listener.local_addr().expect("local addr");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = crate_dir();
    let mut cmd = tokio::process::Command::new(&python);
    cmd.arg(dir.join("tests/emit_spans.py"))
        .arg("--endpoint")
        .arg(format!("http://{addr}/v1/traces"))
        .arg("--traceparent")
        .arg(format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01"))
        .arg("--fixture")
        .arg(dir.join("tests/fixtures/engine_spans.json"))
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .kill_on_drop(true);
    for var in [
        "OTEL_SDK_DISABLED",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_COMPRESSION",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    ] {
        cmd.env_remove(var);
    }
    for variant in VARIANTS {
        cmd.arg("--variant").arg(variant);
    }
    let output = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("emit_spans.py finishes within 120 s")
        .expect("run emit_spans.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "emit_spans.py failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
        output.status
    );

    // What the SDK made: the trace id and parent come from the traceparent we gave.
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("report JSON");
    assert_eq!(report["trace_id"], TRACE_ID);
    let made = report["spans"].as_array().expect("spans");
    assert_eq!(made.len(), 3, "{report}");
    let names: Vec<_> = made.iter().map(|s| s["name"].as_str()).collect();
    assert_eq!(
        names,
        vec![Some("llm_request"), Some("llm_request"), Some("preprocess")]
    );
    for s in made {
        assert_eq!(s["parent_span_id"], PARENT_SPAN_ID, "{s}");
    }
    let span_ids: Vec<String> = made
        .iter()
        .map(|s| s["span_id"].as_str().expect("span_id").to_owned())
        .collect();
    let outcomes: Vec<_> = report["variants"]
        .as_array()
        .expect("variants")
        .iter()
        .map(|v| (v["variant"].as_str(), v["ok"].as_bool()))
        .collect();
    assert_eq!(
        outcomes,
        VARIANTS.map(|v| (Some(v), Some(true))).to_vec(),
        "{report}"
    );
    // The OTLP/JSON responses are the empty ExportTraceServiceResponse.
    for v in &report["variants"].as_array().expect("variants")[2..] {
        assert_eq!(v["status"], 200);
        assert_eq!(v["response"], "{}");
    }

    // What the receiver decoded: one sink call per export request, values exact.
    let calls = calls.lock().expect("calls lock").clone();
    assert_eq!(calls.len(), VARIANTS.len(), "{calls:#?}");
    let expected = expected(&span_ids);
    for (variant, got) in VARIANTS.iter().zip(&calls) {
        assert_eq!(got, &expected, "variant {variant}");
    }
    assert_eq!(
        stats.snapshot(),
        ReceiverSnapshot {
            requests: 4,
            failed_requests: 0,
            spans_total: 12,
            engine_spans: 8,
            rejected_spans: 0,
        }
    );

    server.abort();
}
