//! `POST /v1/traces`: the OTLP/HTTP trace endpoint.
//!
//! Invariants:
//! - Responses follow OTLP/HTTP: 200 with an `ExportTraceServiceResponse` in the request's
//!   encoding (empty, or a partial success naming the rejected spans); 400 for a body that does
//!   not decode, 413 for one over [`MAX_BODY_BYTES`] (raw or decompressed), 415 for a content
//!   type or content encoding we do not read. Error bodies are a `google.rpc.Status` in the
//!   request's encoding when that is known, plain text otherwise; each carries a message that
//!   says what was wrong.
//! - The sink is called once per request that has at least one engine span, after the whole
//!   body decoded: a request is taken whole or not at all.
//! - Counters in [`ReceiverStats`] are relaxed atomics; nothing here takes a lock.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTracePartialSuccess, ExportTraceServiceResponse,
};
use prost::Message;

use crate::decode::{decode_body, engine_spans, DecodeStats, Encoding, EngineSpan, OtlpError};

/// Path of the endpoint, as OTLP/HTTP exporters default to it.
pub const TRACES_PATH: &str = "/v1/traces";

/// Largest body accepted, both as received and after decompression: 16 MiB.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Receives the engine spans of one export request.
pub type SpanSink = Arc<dyn Fn(Vec<EngineSpan>) + Send + Sync>;

/// Why an export request was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// Content type or body (see [`OtlpError`]).
    #[error(transparent)]
    Decode(#[from] OtlpError),
    /// A `Content-Encoding` other than gzip, deflate or identity.
    #[error("unsupported Content-Encoding {0:?}: use gzip, deflate or none")]
    UnsupportedContentEncoding(String),
    /// A compressed body that does not decompress.
    #[error("{encoding} body does not decompress: {source}")]
    Decompress {
        /// `gzip` or `deflate`.
        encoding: &'static str,
        /// The decoder's error.
        #[source]
        source: std::io::Error,
    },
    /// A compressed body whose content is larger than [`MAX_BODY_BYTES`].
    #[error("decompressed body is larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
}

impl ReceiveError {
    /// The HTTP status for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ReceiveError::Decode(e) if e.is_unsupported_media_type() => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            ReceiveError::Decode(_) | ReceiveError::Decompress { .. } => StatusCode::BAD_REQUEST,
            ReceiveError::UnsupportedContentEncoding(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ReceiveError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        }
    }
}

/// Running totals of the receiver, for metrics.
#[derive(Debug, Default)]
pub struct ReceiverStats {
    requests: AtomicU64,
    failed_requests: AtomicU64,
    spans_total: AtomicU64,
    engine_spans: AtomicU64,
    rejected_spans: AtomicU64,
}

/// A copy of [`ReceiverStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverSnapshot {
    /// Export requests received.
    pub requests: u64,
    /// Requests refused (4xx).
    pub failed_requests: u64,
    /// Spans in accepted requests.
    pub spans_total: u64,
    /// Engine spans handed to the sink.
    pub engine_spans: u64,
    /// Engine spans with ids that cannot be joined.
    pub rejected_spans: u64,
}

impl ReceiverStats {
    /// Current values.
    pub fn snapshot(&self) -> ReceiverSnapshot {
        ReceiverSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            failed_requests: self.failed_requests.load(Ordering::Relaxed),
            spans_total: self.spans_total.load(Ordering::Relaxed),
            engine_spans: self.engine_spans.load(Ordering::Relaxed),
            rejected_spans: self.rejected_spans.load(Ordering::Relaxed),
        }
    }

    fn add(&self, stats: &DecodeStats) {
        self.spans_total
            .fetch_add(stats.spans_total, Ordering::Relaxed);
        self.engine_spans
            .fetch_add(stats.engine_spans, Ordering::Relaxed);
        self.rejected_spans
            .fetch_add(stats.rejected_spans, Ordering::Relaxed);
    }
}

/// `POST /v1/traces` handing engine spans to `sink`.
pub fn router<S>(sink: SpanSink) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router_with_stats(sink, Arc::new(ReceiverStats::default()))
}

/// [`router`] that also counts into `stats`.
pub fn router_with_stats<S>(sink: SpanSink, stats: Arc<ReceiverStats>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let handler = move |headers: HeaderMap, body: Bytes| {
        let sink = Arc::clone(&sink);
        let stats = Arc::clone(&stats);
        async move { receive(&headers, body, sink.as_ref(), &stats) }
    };
    Router::new()
        .route(TRACES_PATH, post(handler))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

fn receive(
    headers: &HeaderMap,
    body: Bytes,
    sink: &(dyn Fn(Vec<EngineSpan>) + Send + Sync),
    stats: &ReceiverStats,
) -> Response {
    stats.requests.fetch_add(1, Ordering::Relaxed);
    let content_type = header_str(headers, CONTENT_TYPE.as_str());
    let encoding = match Encoding::from_content_type(content_type) {
        Ok(encoding) => encoding,
        Err(e) => return refuse(stats, None, &ReceiveError::from(e)),
    };
    let decoded = decompress(header_str(headers, CONTENT_ENCODING.as_str()), body)
        .and_then(|body| decode_body(encoding, &body).map_err(ReceiveError::from))
        .map(|request| engine_spans(&request));
    let decoded = match decoded {
        Ok(decoded) => decoded,
        Err(e) => return refuse(stats, Some(encoding), &e),
    };
    stats.add(&decoded.stats);
    tracing::debug!(
        spans = decoded.stats.spans_total,
        engine_spans = decoded.stats.engine_spans,
        rejected = decoded.stats.rejected_spans,
        "otlp export received"
    );
    let rejected = decoded.stats.rejected_spans;
    if !decoded.spans.is_empty() {
        sink(decoded.spans);
    }
    success(encoding, rejected)
}

/// A header as text; a header that is not visible ASCII counts as absent.
fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Undoes `Content-Encoding` (gzip, deflate = zlib, identity), capped at [`MAX_BODY_BYTES`].
fn decompress(content_encoding: Option<&str>, body: Bytes) -> Result<Bytes, ReceiveError> {
    let coding = content_encoding.map(str::trim).unwrap_or_default();
    let (name, reader): (&'static str, Box<dyn Read + '_>) =
        if coding.is_empty() || coding.eq_ignore_ascii_case("identity") {
            return Ok(body);
        } else if coding.eq_ignore_ascii_case("gzip") || coding.eq_ignore_ascii_case("x-gzip") {
            (
                "gzip",
                Box::new(flate2::read::MultiGzDecoder::new(&body[..])),
            )
        } else if coding.eq_ignore_ascii_case("deflate") {
            (
                "deflate",
                Box::new(flate2::read::ZlibDecoder::new(&body[..])),
            )
        } else {
            return Err(ReceiveError::UnsupportedContentEncoding(coding.to_owned()));
        };
    let mut out = Vec::new();
    let cap = u64::try_from(MAX_BODY_BYTES)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    reader
        .take(cap)
        .read_to_end(&mut out)
        .map_err(|source| ReceiveError::Decompress {
            encoding: name,
            source,
        })?;
    if out.len() > MAX_BODY_BYTES {
        return Err(ReceiveError::TooLarge {
            limit: MAX_BODY_BYTES,
        });
    }
    Ok(Bytes::from(out))
}

/// 200 with an `ExportTraceServiceResponse`: empty, or a partial success for rejected spans.
fn success(encoding: Encoding, rejected_spans: u64) -> Response {
    let partial = (rejected_spans > 0).then(|| ExportTracePartialSuccess {
        rejected_spans: i64::try_from(rejected_spans).unwrap_or(i64::MAX),
        error_message: format!(
            "{rejected_spans} span(s) with gen_ai attributes have an invalid trace or span id \
             and cannot be joined"
        ),
    });
    let body = match encoding {
        Encoding::Protobuf => ExportTraceServiceResponse {
            partial_success: partial,
        }
        .encode_to_vec(),
        // OTLP/JSON: int64 as a string; an absent partial success is an empty object.
        Encoding::Json => match partial {
            None => b"{}".to_vec(),
            Some(p) => serde_json::json!({
                "partialSuccess": {
                    "rejectedSpans": p.rejected_spans.to_string(),
                    "errorMessage": p.error_message,
                }
            })
            .to_string()
            .into_bytes(),
        },
    };
    with_type(StatusCode::OK, encoding.content_type(), body)
}

/// `google.rpc.Status`, the OTLP/HTTP error body.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
}

/// gRPC code `INVALID_ARGUMENT`.
const RPC_INVALID_ARGUMENT: i32 = 3;
/// gRPC code `RESOURCE_EXHAUSTED`.
const RPC_RESOURCE_EXHAUSTED: i32 = 8;

fn refuse(stats: &ReceiverStats, encoding: Option<Encoding>, error: &ReceiveError) -> Response {
    stats.failed_requests.fetch_add(1, Ordering::Relaxed);
    let status = error.status();
    let message = error.to_string();
    tracing::warn!(status = status.as_u16(), error = %message, "otlp export refused");
    let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
        RPC_RESOURCE_EXHAUSTED
    } else {
        RPC_INVALID_ARGUMENT
    };
    match encoding {
        Some(Encoding::Protobuf) => with_type(
            status,
            Encoding::Protobuf.content_type(),
            RpcStatus { code, message }.encode_to_vec(),
        ),
        Some(Encoding::Json) => with_type(
            status,
            Encoding::Json.content_type(),
            serde_json::json!({ "code": code, "message": message })
                .to_string()
                .into_bytes(),
        ),
        None => with_type(status, "text/plain; charset=utf-8", message.into_bytes()),
    }
}

fn with_type(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests;
