//! TLS end to end, with the real binary: the built-in mock engine behind HTTPS
//! (`mock-engine --tls-cert/--tls-key[/--tls-client-ca]`), a CA and certificates made at test
//! time (`tokenscope_net::test_util::TestPki`, rcgen), and the gateway's `https://` clients:
//! the upstream pool (measured and pass-through requests), the hyper-util pass-through client,
//! the engine-state scraper, OTLP export (HTTP and gRPC, to the independent Python receiver
//! serving TLS with Python's `ssl` and grpcio) and the alert webhook.

mod common;
#[path = "../../tokenscope-trace/tests/common/receiver.rs"]
mod receiver;

use bytes::Bytes;
use common::{metric_sum, post_json, stream, GatewayProc, MockProc};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenscope_net::test_util::TestPki;

const RECEIVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tokenscope-trace/tests/otlp_receiver.py"
);

fn pki() -> (tempfile::TempDir, TestPki) {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::generate(dir.path()).expect("test PKI");
    (dir, pki)
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The mock engine serving HTTPS with the PKI's server certificate (`client_ca`: requiring
/// client certificates signed by it).
fn tls_mock(pki: &TestPki, client_ca: Option<&Path>) -> MockProc {
    let mut args = vec![
        "--tls-cert",
        path(&pki.server_cert),
        "--tls-key",
        path(&pki.server_key),
    ];
    if let Some(ca) = client_ca {
        args.extend(["--tls-client-ca", path(ca)]);
    }
    MockProc::start(&args)
}

/// A gateway whose one upstream `tls` is `https://localhost:PORT` of `mock`, with `extra` TOML
/// lines in its `[[upstreams]]` entry (e.g. `ca_file = "…"`) and `more` after it.
fn gateway(mock: &MockProc, extra: &str, more: &str, env: &[(&str, &str)]) -> GatewayProc {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"tls\"\nurl = \"https://localhost:{}\"\n\
             scrape_interval_ms = 200\n{extra}\n{more}\n",
            mock.addr.port()
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(None, &["--config", path(&cfg)], env);
    drop(dir);
    gw
}

fn chat(stream: bool) -> Value {
    json!({
        "model": "mock-llm",
        "stream": stream,
        "max_tokens": 50,
        "mock_output_tokens": 12,
        "messages": [{"role": "user", "content": "Tell me something about TLS."}],
    })
}

fn request_id(headers: &http::HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("x-request-id")
        .to_owned()
}

/// Measured chat (whole and streamed), pass-through on the pool and through the hyper-util
/// client, and the engine-state scrape, all over HTTPS with the upstream's CA file. The
/// records hold the engine's token counts and a TTFT as for plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_stream_through_an_https_upstream() {
    let (_dir, pki) = pki();
    let mock = tls_mock(&pki, None);
    let gw = gateway(&mock, &format!("ca_file = \"{}\"", path(&pki.ca)), "", &[]);
    let url = gw.url("/v1/chat/completions");

    // Whole response: the usage the client got is the record's.
    let (status, headers, body) = post_json(&url, &chat(false), &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let resp: Value = serde_json::from_slice(&body).expect("json");
    let rec = gw.record(&request_id(&headers)).await;
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["upstream"], "tls");
    assert_eq!(rec["input_tokens"], resp["usage"]["prompt_tokens"]);
    assert_eq!(rec["output_tokens"], 12);
    assert_eq!(resp["usage"]["completion_tokens"], 12);

    // Streamed: one record, tokens from the engine's usage, TTFT within the request.
    let s = stream(&url, &chat(true), &[], None).await;
    assert_eq!(s.status, 200);
    assert_eq!(s.output_events().len(), 12);
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["output_tokens"], 12);
    assert_eq!(rec["output_tokens_source"], "usage");
    let ttft = rec["ttft_ms"].as_f64().expect("ttft");
    let total = rec["total_duration_ms"].as_f64().expect("total");
    let client_ttft = s.ttft_ms().expect("client ttft");
    assert!(ttft > 0.0 && ttft <= total, "ttft {ttft} total {total}");
    assert!(
        ttft <= client_ttft + 1.0,
        "the gateway saw the first token before the client: {ttft} vs {client_ttft}"
    );

    // Pass-through with a known body (the upstream pool) and with a chunked one (the
    // hyper-util client and its per-upstream connector).
    let (status, body) = common::get(&gw.url("/v1/models")).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("mock-llm"), "{body}");
    let chunks = vec![
        Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from_static(
            b"{\"content\": ",
        ))),
        Ok(http_body::Frame::data(Bytes::from_static(
            b"\"hello tls\"}",
        ))),
    ];
    let req = http::Request::post(gw.url("/tokenize"))
        .header("content-type", "application/json")
        .body(http_body_util::StreamBody::new(futures_util::stream::iter(
            chunks,
        )))
        .expect("request");
    let client: hyper_util::client::legacy::Client<_, _> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let resp = client.request(req).await.expect("chunked pass-through");
    let status = resp.status();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(
        v["tokens"].as_array().map(Vec::len),
        Some(tokenscope_mock::count_tokens("hello tls") as usize)
    );

    // The engine's state, scraped over HTTPS.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = gw.metrics().await;
        if metric_sum(&m, "llm_engine_state_up{upstream=\"tls\"}") == 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "engine state never known:\n{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gw.stop();
}

/// A certificate the gateway does not trust: 502 with a JSON error naming TLS and the
/// certificate problem; the record is an `upstream_error` of type `upstream_tls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_a_502_naming_the_certificate() {
    let (_dir, pki) = pki();
    let mock = tls_mock(&pki, None);
    let gw = gateway(
        &mock,
        &format!("ca_file = \"{}\"", path(&pki.other_ca)),
        "",
        &[],
    );
    let url = gw.url("/v1/chat/completions");
    for streamed in [false, true] {
        let (status, headers, body) = post_json(&url, &chat(streamed), &[]).await;
        assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
        let err: Value = serde_json::from_slice(&body).expect("JSON error body");
        assert_eq!(err["error"]["type"], "tokenscope_error");
        assert_eq!(err["error"]["code"], "upstream_tls");
        let msg = err["error"]["message"].as_str().expect("message");
        assert!(
            msg.starts_with("upstream tls: TLS with localhost:")
                && msg.contains("invalid peer certificate")
                && msg.contains("UnknownIssuer"),
            "{msg}"
        );
        let rec = gw.record(&request_id(&headers)).await;
        assert_eq!(rec["outcome"], "upstream_error", "{rec}");
        assert_eq!(rec["error_type"], "upstream_tls");
        assert_eq!(rec["http_status"], 502);
    }
    // Pass-through requests are refused the same way (no record).
    let (status, body) = common::get(&gw.url("/v1/models")).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("UnknownIssuer"), "{body}");
    gw.stop();
}

/// An upstream that requires a client certificate: served with `client_cert`/`client_key`,
/// refused (502, an `upstream_error` record) without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_for_an_upstream_that_requires_them() {
    let (_dir, pki) = pki();
    let mock = tls_mock(&pki, Some(&pki.ca));
    let with = gateway(
        &mock,
        &format!(
            "ca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"",
            path(&pki.ca),
            path(&pki.client_cert),
            path(&pki.client_key)
        ),
        "",
        &[],
    );
    let s = stream(&with.url("/v1/chat/completions"), &chat(true), &[], None).await;
    assert_eq!(s.status, 200);
    let rec = with.record(&s.request_id()).await;
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["output_tokens"], 12);
    with.stop();

    let without = gateway(&mock, &format!("ca_file = \"{}\"", path(&pki.ca)), "", &[]);
    let (status, headers, body) =
        post_json(&without.url("/v1/chat/completions"), &chat(false), &[]).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    // TLS 1.3: the server refuses the missing certificate after the client's side of the
    // handshake, with an alert read as the response is awaited.
    let err: Value = serde_json::from_slice(&body).expect("JSON error body");
    let msg = err["error"]["message"].as_str().expect("message");
    assert!(msg.contains("CertificateRequired"), "{msg}");
    let rec = without.record(&request_id(&headers)).await;
    assert_eq!(rec["outcome"], "upstream_error", "{rec}");
    without.stop();
}

/// A TLS file that cannot be used refuses the start, naming the upstream, the file and what
/// is wrong with it.
#[test]
fn a_bad_tls_file_refuses_to_start() {
    let (dir, pki) = pki();
    let not_pem = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello\n").expect("write");
    for (entry, want) in [
        (
            format!("ca_file = \"{}\"", path(&dir.path().join("missing.pem"))),
            vec!["upstream \"tls\"", "missing.pem", "cannot read the CA file"],
        ),
        (
            format!("ca_file = \"{}\"", path(&not_pem)),
            vec!["not-a-cert.pem", "holds no certificate"],
        ),
        (
            format!(
                "client_cert = \"{}\"\nclient_key = \"{}\"",
                path(&pki.client_cert),
                path(&pki.client_cert)
            ),
            vec!["client.pem", "holds no private key"],
        ),
        (
            format!("client_cert = \"{}\"", path(&pki.client_cert)),
            vec!["client_key is not"],
        ),
        (
            format!(
                "[listen_tls]\ncert_file = \"{}\"\nkey_file = \"{}\"",
                path(&pki.server_cert),
                path(&dir.path().join("no-key.pem"))
            ),
            vec!["listen_tls", "no-key.pem", "cannot read the server key"],
        ),
    ] {
        let cfg = dir.path().join("gw.toml");
        std::fs::write(
            &cfg,
            format!("[[upstreams]]\nname = \"tls\"\nurl = \"https://localhost:1\"\n{entry}\n"),
        )
        .expect("write config");
        let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--config")
            .arg(&cfg)
            .arg("--store")
            .arg(dir.path().join("ts.db"))
            .env("TOKENSCOPE_SPOOL__DIR", dir.path().join("spool"))
            .env("TOKENSCOPE_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .expect("run tokenscope serve");
        assert!(!out.status.success(), "started with {entry}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        for w in want {
            assert!(stderr.contains(w), "{w:?} missing for {entry}:\n{stderr}");
        }
    }
}

/// OTLP export to a TLS receiver (Python `ssl` / grpcio) trusted through `ca_file`, with an
/// authorization header the receiver requires; then the same through the standard
/// `OTEL_EXPORTER_OTLP_*` variables only. With `wrong_ca` the gateway trusts another CA: the
/// requests are served as ever, no span arrives, and every failed export is counted.
async fn otlp_over_tls(protocol: &str, by_env: bool) {
    otlp_tls_case(protocol, by_env, false).await;
}

async fn otlp_tls_case(protocol: &str, by_env: bool, wrong_ca: bool) {
    let (_dir, pki) = pki();
    let Some(rx) = receiver::Receiver::start(
        Path::new(RECEIVER),
        protocol,
        &[
            "--tls-cert",
            path(&pki.server_cert),
            "--tls-key",
            path(&pki.server_key),
            "--require-header",
            "authorization=Bearer s3cret token",
        ],
    ) else {
        return;
    };
    let mock = MockProc::start(&[]);
    let endpoint = format!("https://localhost:{}", rx.port);
    let ca = path(if wrong_ca { &pki.other_ca } else { &pki.ca }).to_owned();
    let wire = if protocol == "grpc" {
        "grpc"
    } else {
        "http/protobuf"
    };
    let mut env: Vec<(&str, &str)> = vec![
        ("TOKENSCOPE_TRACING__BATCH_TIMEOUT", "50ms"),
        ("TOKENSCOPE_TRACING__SAMPLE_RATIO", "1.0"),
    ];
    let traces_endpoint = format!("{endpoint}/v1/traces");
    if by_env {
        env.extend([
            ("OTEL_EXPORTER_OTLP_PROTOCOL", wire),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.as_str()),
            // Percent-encoded, as the specification writes header values.
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer%20s3cret%20token",
            ),
        ]);
        if protocol == "grpc" {
            env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()));
        } else {
            // The traces endpoint is used as is (nothing appended).
            env.push((
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                traces_endpoint.as_str(),
            ));
        }
    } else {
        env.extend([
            ("TOKENSCOPE_TRACING__OTLP_ENDPOINT", endpoint.as_str()),
            ("TOKENSCOPE_TRACING__OTLP_PROTOCOL", protocol),
            ("TOKENSCOPE_TRACING__CA_FILE", ca.as_str()),
            (
                "TOKENSCOPE_TRACING__HEADERS__AUTHORIZATION",
                "Bearer s3cret token",
            ),
        ]);
    }
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &[], &env);
    let s = stream(&gw.url("/v1/chat/completions"), &chat(true), &[], None).await;
    assert_eq!(s.status, 200);
    let trace = s
        .headers
        .get("x-tokenscope-trace-id")
        .and_then(|v| v.to_str().ok())
        .expect("trace id")
        .to_owned();
    if wrong_ca {
        // The exporter retries with backoff; its failures are counted, the request path is
        // untouched.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = gw.metrics().await;
            if metric_sum(&m, "tokenscope_trace_export_errors_total") >= 1.0 {
                break;
            }
            assert!(Instant::now() < deadline, "no export error counted:\n{m}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let again = post_json(&gw.url("/v1/chat/completions"), &chat(false), &[]).await;
        assert_eq!(again.0, 200);
        let spans = rx.wait_for_spans(|all| !all.is_empty(), Duration::from_secs(1));
        assert!(
            spans.is_empty(),
            "a span crossed an untrusted TLS: {spans:#?}"
        );
        gw.stop();
        return;
    }
    let spans = rx.wait_for_spans(
        |all| all.iter().any(|sp| sp["trace_id"] == trace.as_str()),
        Duration::from_secs(20),
    );
    let root = spans
        .iter()
        .find(|sp| sp["trace_id"] == trace.as_str() && sp["name"] == "chat mock-llm")
        .unwrap_or_else(|| panic!("no root span in {spans:#?}"));
    assert_eq!(root["protocol"], protocol);
    let m = gw.metrics().await;
    assert_eq!(
        metric_sum(&m, "tokenscope_trace_export_errors_total"),
        0.0,
        "every export call was accepted (TLS and the header):\n{m}"
    );
    gw.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_http_over_tls() {
    otlp_over_tls("http", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_grpc_over_tls() {
    otlp_over_tls("grpc", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_http_over_tls_from_otel_variables() {
    otlp_over_tls("http", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_grpc_over_tls_from_otel_variables() {
    otlp_over_tls("grpc", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_http_to_a_wrong_ca_counts_errors_and_serves() {
    otlp_tls_case("http", false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otlp_grpc_to_a_wrong_ca_counts_errors_and_serves() {
    otlp_tls_case("grpc", false, true).await;
}

/// The alert webhook over HTTPS, trusted through `webhook_ca_file`: an error burst's firing
/// alert arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_webhook_over_tls() {
    webhook_tls_case(false).await;
}

/// The same with another CA trusted: no alert crosses, each failed delivery is counted, and the
/// requests are served as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_webhook_to_a_wrong_ca_counts_errors() {
    webhook_tls_case(true).await;
}

async fn webhook_tls_case(wrong_ca: bool) {
    let (_dir, pki) = pki();
    let alerts: Arc<Mutex<Vec<Value>>> = Arc::default();
    let a = alerts.clone();
    let app = axum::Router::new().route(
        "/api/v2/alerts",
        axum::routing::post(move |body: axum::body::Bytes| {
            let a = a.clone();
            async move {
                let v: Value = serde_json::from_slice(&body).expect("JSON body");
                a.lock()
                    .expect("lock")
                    .extend(v.as_array().cloned().unwrap_or_default());
                axum::http::StatusCode::OK
            }
        }),
    );
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = tcp.local_addr().expect("addr").port();
    let tls = tokenscope_net::server_config(&pki.server_cert, &pki.server_key, None, &[])
        .expect("server config");
    let listener = tokenscope_net::TlsListener::new(tcp, tls).expect("listener");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let mock = MockProc::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[alerts]\nwebhook_url = \"https://localhost:{port}/api/v2/alerts\"\n\
             webhook_ca_file = \"{}\"\nevaluation_interval = \"200ms\"\nwebhook_timeout = \"2s\"\n\
             [alerts.thresholds]\nrate_window_seconds = 2\nsuccess_for_seconds = 1\n\
             token_anomaly_for_seconds = 3600\n",
            path(if wrong_ca { &pki.other_ca } else { &pki.ca })
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", path(&cfg)], &[]);
    let url = gw.url("/v1/chat/completions");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let fault: &[(&str, &str)] = &[("x-mock-fault", "error_500")];
        let _ = post_json(&url, &chat(false), fault).await;
        if wrong_ca {
            let m = gw.metrics().await;
            if metric_sum(&m, "tokenscope_alert_webhook_errors_total") >= 1.0 {
                assert!(alerts.lock().expect("lock").is_empty(), "an alert crossed");
                let ok = post_json(&url, &chat(false), &[]).await;
                assert_eq!(ok.0, 200);
                gw.stop();
                return;
            }
            assert!(Instant::now() < deadline, "no webhook error counted:\n{m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let fired = alerts
            .lock()
            .expect("lock")
            .iter()
            .any(|a| a["labels"]["alertname"] == "LLMSuccessRateLow");
        if fired {
            break;
        }
        assert!(Instant::now() < deadline, "no alert arrived over https");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = gw.metrics().await;
    assert!(
        metric_sum(&m, "tokenscope_alert_notifications_total{state=\"firing\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(metric_sum(&m, "tokenscope_alert_webhook_errors_total"), 0.0);
    gw.stop();
}

/// `[listen_tls]`: clients reach the gateway over HTTPS (HTTP/1.1 and HTTP/2 by ALPN); the
/// streamed response and its record are those of a plain listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_listener_over_tls() {
    let (dir, pki) = pki();
    let mock = MockProc::start(&[]);
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            "[listen_tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            path(&pki.server_cert),
            path(&pki.server_key)
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(Some(&mock.url()), &["--config", path(&cfg)], &[]);
    let tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
        ca_file: Some(pki.ca.clone()),
        ..Default::default()
    })
    .expect("client tls");
    let url = format!("https://localhost:{}/v1/chat/completions", gw.proxy.port());
    for versions in [
        tokenscope_net::Versions::Http1,
        tokenscope_net::Versions::Any,
    ] {
        let client: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(tokenscope_net::connector(
                    &tls,
                    tokenscope_net::ConnectOptions {
                        versions,
                        ..Default::default()
                    },
                ));
        let req = http::Request::post(url.as_str())
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(
                chat(true).to_string(),
            )))
            .expect("request");
        let resp = client.request(req).await.expect("https request");
        assert_eq!(resp.status(), 200);
        let id = request_id(resp.headers());
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert_eq!(text.matches("\"content\":\"tok").count(), 12, "{text}");
        let rec = gw.record(&id).await;
        assert_eq!(rec["outcome"], "ok", "{rec}");
        assert_eq!(rec["output_tokens"], 12);
        assert!(rec["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{rec}");
    }
    // `tokenscope bench` against the HTTPS listener, trusting the CA.
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["bench", "--target"])
        .arg(format!("https://localhost:{}", gw.proxy.port()))
        .arg("--ca-file")
        .arg(&pki.ca)
        .args([
            "--model",
            "mock-llm",
            "--rates",
            "5",
            "--duration",
            "1s",
            "--stream",
        ])
        .args(["--output-tokens", "4", "--format", "json"])
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let levels: Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    assert!(levels[0]["ok"].as_u64().is_some_and(|n| n > 0), "{levels}");
    assert_eq!(levels[0]["failed"], 0, "{levels}");
    // Plain HTTP to the TLS listener gets nothing (the handshake fails), and is counted.
    assert!(common::try_get(&gw.url("/v1/models")).await.is_none());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = gw.metrics().await;
        let failed = metric_sum(
            &m,
            "tokenscope_connections_tls_handshake_failures_total{listener=\"proxy\"}",
        );
        if failed >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gw.stop();
}
