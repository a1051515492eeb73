use std::io::Write;
use std::sync::Mutex;

use axum::body::Body;
use flate2::write::{GzEncoder, ZlibEncoder};
use flate2::Compression;
use http::{Method, Request};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use tower::ServiceExt;

use super::*;
use crate::test_support::*;

type Calls = Arc<Mutex<Vec<Vec<EngineSpan>>>>;

fn app() -> (Router, Calls, Arc<ReceiverStats>) {
    let calls: Calls = Arc::default();
    let stats = Arc::new(ReceiverStats::default());
    let seen = Arc::clone(&calls);
    let sink: SpanSink = Arc::new(move |spans| {
        seen.lock().expect("sink lock").push(spans);
    });
    (router_with_stats(sink, Arc::clone(&stats)), calls, stats)
}

async fn post(
    app: Router,
    content_type: Option<&str>,
    content_encoding: Option<&str>,
    body: Vec<u8>,
) -> (StatusCode, Option<String>, Bytes) {
    let mut req = Request::builder().method(Method::POST).uri(TRACES_PATH);
    if let Some(ct) = content_type {
        req = req.header(CONTENT_TYPE, ct);
    }
    if let Some(ce) = content_encoding {
        req = req.header(CONTENT_ENCODING, ce);
    }
    let req = req.body(Body::from(body)).expect("request");
    let resp = app.oneshot(req).await.expect("infallible");
    let status = resp.status();
    let ct = resp
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("response body");
    (status, ct, body)
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(data).expect("gzip write");
    enc.finish().expect("gzip finish")
}

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut enc = ZlibEncoder::new(Vec::new(), Compression::default());
    enc.write_all(data).expect("zlib write");
    enc.finish().expect("zlib finish")
}

fn vllm_protobuf() -> Vec<u8> {
    request("vllm", vec![vllm_span()]).encode_to_vec()
}

fn vllm_json() -> Vec<u8> {
    serde_json::to_vec(&request("vllm", vec![vllm_span()])).expect("serialize OTLP/JSON")
}

fn sunk(calls: &Calls) -> Vec<Vec<EngineSpan>> {
    calls.lock().expect("calls lock").clone()
}

fn assert_one_vllm_call(calls: &Calls) {
    let calls = sunk(calls);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].len(), 1);
    let span = &calls[0][0];
    assert_eq!(span.trace_id, TRACE_ID_HEX);
    assert_eq!(span.span_id, SPAN_ID_HEX);
    assert_eq!(span.update.trace_id, TRACE_ID_HEX);
    assert_eq!(span.update.queue_duration_ms, Some(125.0));
    assert_eq!(span.update.prefill_duration_ms, Some(187.5));
    assert_eq!(span.update.decode_duration_ms, Some(1062.5));
    assert_eq!(span.update.input_tokens, Some(42));
    assert_eq!(span.update.output_tokens, Some(17));
    assert_eq!(span.ttft_ms, Some(312.5));
    assert_eq!(span.e2e_ms, Some(1500.0));
    assert_eq!(span.request_id.as_deref(), Some("cmpl-abc-0"));
    assert_eq!(span.service_name.as_deref(), Some("vllm"));
}

#[tokio::test]
async fn protobuf_export_is_accepted_with_empty_response() {
    let (app, calls, stats) = app();
    let (status, ct, body) = post(app, Some("application/x-protobuf"), None, vllm_protobuf()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ct.as_deref(), Some("application/x-protobuf"));
    let resp = ExportTraceServiceResponse::decode(body.as_ref()).expect("response message");
    assert_eq!(resp, ExportTraceServiceResponse::default());
    assert!(body.is_empty(), "an empty message encodes to no bytes");
    assert_one_vllm_call(&calls);
    assert_eq!(
        stats.snapshot(),
        ReceiverSnapshot {
            requests: 1,
            failed_requests: 0,
            spans_total: 1,
            engine_spans: 1,
            rejected_spans: 0
        }
    );
}

#[tokio::test]
async fn json_export_is_accepted_with_empty_json_object() {
    let (app, calls, _) = app();
    let (status, ct, body) = post(app, Some("application/json"), None, vllm_json()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ct.as_deref(), Some("application/json"));
    assert_eq!(body.as_ref(), b"{}");
    assert_one_vllm_call(&calls);
}

#[test]
fn serialized_json_uses_hex_ids() {
    // Guards the OTLP/JSON shape the crate relies on: hex, not base64.
    let json = String::from_utf8(vllm_json()).expect("utf-8");
    assert!(
        json.contains(&format!("\"traceId\":\"{TRACE_ID_HEX}\"")),
        "{json}"
    );
    assert!(
        json.contains(&format!("\"spanId\":\"{SPAN_ID_HEX}\"")),
        "{json}"
    );
}

#[tokio::test]
async fn gzip_protobuf_is_accepted() {
    let (app, calls, _) = app();
    let (status, _, _) = post(
        app,
        Some("application/x-protobuf"),
        Some("gzip"),
        gzip(&vllm_protobuf()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_one_vllm_call(&calls);
}

#[tokio::test]
async fn gzip_json_is_accepted() {
    let (app, calls, _) = app();
    let (status, _, body) = post(
        app,
        Some("application/json"),
        Some("GZIP"),
        gzip(&vllm_json()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body.as_ref(), b"{}");
    assert_one_vllm_call(&calls);
}

#[tokio::test]
async fn deflate_protobuf_is_accepted() {
    // The Python exporter's `Compression.Deflate` sends zlib data.
    let (app, calls, _) = app();
    let (status, _, _) = post(
        app,
        Some("application/x-protobuf"),
        Some("deflate"),
        zlib(&vllm_protobuf()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_one_vllm_call(&calls);
}

#[tokio::test]
async fn garbage_protobuf_is_400_with_status_message() {
    let (app, calls, stats) = app();
    let (status, ct, body) = post(
        app,
        Some("application/x-protobuf"),
        None,
        vec![0xff, 0xff, 0xff, 0xff],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(ct.as_deref(), Some("application/x-protobuf"));
    let rpc = RpcStatus::decode(body.as_ref()).expect("google.rpc.Status");
    assert_eq!(rpc.code, RPC_INVALID_ARGUMENT);
    assert!(
        rpc.message
            .starts_with("body is not a protobuf ExportTraceServiceRequest"),
        "{}",
        rpc.message
    );
    assert!(sunk(&calls).is_empty());
    assert_eq!(stats.snapshot().failed_requests, 1);
    assert_eq!(stats.snapshot().requests, 1);
}

#[tokio::test]
async fn garbage_json_is_400_with_json_status() {
    let (app, calls, _) = app();
    let (status, ct, body) = post(
        app,
        Some("application/json"),
        None,
        b"{\"resourceSpans\": 5}".to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(ct.as_deref(), Some("application/json"));
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json error body");
    assert_eq!(v["code"], 3);
    let message = v["message"].as_str().expect("message");
    assert!(
        message.starts_with("body is not an OTLP/JSON ExportTraceServiceRequest"),
        "{message}"
    );
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn corrupt_gzip_is_400() {
    let (app, calls, _) = app();
    let (status, _, body) = post(
        app,
        Some("application/json"),
        Some("gzip"),
        b"definitely not gzip".to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json error body");
    let message = v["message"].as_str().expect("message");
    assert!(
        message.starts_with("gzip body does not decompress"),
        "{message}"
    );
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn wrong_content_type_is_415_plain_text() {
    let (app, calls, _) = app();
    let (status, ct, body) = post(app, Some("text/plain"), None, vllm_protobuf()).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(ct.as_deref(), Some("text/plain; charset=utf-8"));
    let text = std::str::from_utf8(&body).expect("utf-8");
    assert_eq!(
        text,
        "unsupported Content-Type \"text/plain\": OTLP/HTTP needs application/x-protobuf or application/json"
    );
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn missing_content_type_is_415() {
    let (app, _, _) = app();
    let (status, _, body) = post(app, None, None, vllm_protobuf()).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(body.starts_with(b"missing Content-Type"));
}

#[tokio::test]
async fn unknown_content_encoding_is_415() {
    let (app, calls, _) = app();
    let (status, ct, body) = post(
        app,
        Some("application/x-protobuf"),
        Some("br"),
        vllm_protobuf(),
    )
    .await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(ct.as_deref(), Some("application/x-protobuf"));
    let rpc = RpcStatus::decode(body.as_ref()).expect("google.rpc.Status");
    assert_eq!(
        rpc.message,
        "unsupported Content-Encoding \"br\": use gzip, deflate or none"
    );
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn no_engine_spans_means_no_sink_call() {
    let (app, calls, stats) = app();
    let plain = span(
        "tokenize",
        &TRACE_ID,
        &SPAN_ID,
        vec![string("http.route", "/x")],
    );
    let body = request("vllm", vec![plain]).encode_to_vec();
    let (status, _, body) = post(app, Some("application/x-protobuf"), None, body).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.is_empty());
    assert!(sunk(&calls).is_empty());
    let snap = stats.snapshot();
    assert_eq!((snap.spans_total, snap.engine_spans), (1, 0));
}

#[tokio::test]
async fn rejected_spans_are_a_partial_success() {
    let bad = span("llm_request", &[0; 16], &SPAN_ID, vllm_attributes());
    let req = request("vllm", vec![bad, vllm_span()]);

    let (app, calls, stats) = app();
    let (status, _, body) = post(
        app,
        Some("application/x-protobuf"),
        None,
        req.encode_to_vec(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let resp = ExportTraceServiceResponse::decode(body.as_ref()).expect("response");
    let partial = resp.partial_success.expect("partial success");
    assert_eq!(partial.rejected_spans, 1);
    assert!(partial.error_message.contains("invalid trace or span id"));
    assert_one_vllm_call(&calls);
    assert_eq!(stats.snapshot().rejected_spans, 1);

    let (app, _, _) = self::app();
    let json = serde_json::to_vec(&req).expect("json");
    let (status, _, body) = post(app, Some("application/json"), None, json).await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json response");
    assert_eq!(v["partialSuccess"]["rejectedSpans"], "1");
}

#[tokio::test]
async fn body_over_limit_is_413() {
    let (app, calls, _) = app();
    let (status, _, _) = post(
        app,
        Some("application/x-protobuf"),
        None,
        vec![0u8; MAX_BODY_BYTES + 1],
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn decompressed_body_over_limit_is_413() {
    // 16 MiB + 1 of zeros compresses to a few KiB: the limit applies after decompression.
    let bomb = gzip(&vec![0u8; MAX_BODY_BYTES + 1]);
    assert!(bomb.len() < 100_000);
    let (app, calls, _) = app();
    let (status, _, body) = post(app, Some("application/x-protobuf"), Some("gzip"), bomb).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let rpc = RpcStatus::decode(body.as_ref()).expect("google.rpc.Status");
    assert_eq!(rpc.code, RPC_RESOURCE_EXHAUSTED);
    assert_eq!(
        rpc.message,
        format!("decompressed body is larger than {MAX_BODY_BYTES} bytes")
    );
    assert!(sunk(&calls).is_empty());
}

#[tokio::test]
async fn get_is_405() {
    let (app, _, _) = app();
    let req = Request::builder()
        .method(Method::GET)
        .uri(TRACES_PATH)
        .body(Body::empty())
        .expect("request");
    let resp = app.oneshot(req).await.expect("infallible");
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn router_nests_into_a_stateful_router() {
    // The integrator merges this into the admin router, which may carry state.
    #[derive(Clone)]
    struct AdminState;
    let sink: SpanSink = Arc::new(|_| {});
    let admin: Router<AdminState> = Router::new().merge(router::<AdminState>(sink));
    let app = admin.with_state(AdminState);
    let empty = ExportTraceServiceRequest::default().encode_to_vec();
    let (status, _, _) = post(app, Some("application/x-protobuf"), None, empty).await;
    assert_eq!(status, StatusCode::OK);
}

#[test]
fn receive_error_statuses() {
    assert_eq!(
        ReceiveError::from(OtlpError::MissingContentType).status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    assert_eq!(
        ReceiveError::UnsupportedContentEncoding("br".into()).status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
    assert_eq!(
        ReceiveError::TooLarge { limit: 1 }.status(),
        StatusCode::PAYLOAD_TOO_LARGE
    );
    let io = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad");
    assert_eq!(
        ReceiveError::Decompress {
            encoding: "gzip",
            source: io
        }
        .status(),
        StatusCode::BAD_REQUEST
    );
}
