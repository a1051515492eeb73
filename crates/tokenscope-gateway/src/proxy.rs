//! The request path: measured OpenAI endpoints and blind pass-through of everything else.
//!
//! Measured request, in order (see ARCHITECTURE.md for the picture):
//! 1. arrival instant (monotonic) and `created_at` (wall clock); request id and trace id;
//! 2. body read with a size limit (413 beyond it);
//! 3. JSON read for model / stream / usage options / user; prompt hash and entry token estimate;
//! 4. attribution (headers, body `user`, API-key map; raw keys never leave this function);
//! 5. routing by model; `include_usage` injected for streams that did not ask for it;
//! 6. upstream call with connect and header timeouts (502 / 504 with a JSON error body), on a
//!    connection of the upstream's [`crate::upconn::UpPool`] that this request's task drives;
//! 7. the response body is wrapped in [`MeteredBody`], which drives that connection, forwards
//!    and measures each frame (what arrived together in one write) and finishes the record at
//!    its end.
//!
//! A malformed request body is forwarded as received (the engine answers it), still recorded.

use crate::body::{MeteredBody, Mode};
use crate::recording::RecordGuard;
use crate::Shared;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Uri};
use http_body_util::BodyExt;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokenscope_core::openai::{inject_include_usage, RequestInfo};
use tokenscope_core::prompt::{estimate_tokens, normalised_prompt, prompt_hash};
use tokenscope_core::sse::EventSplitter;
use tokenscope_core::{Endpoint, InputBucket, Outcome, RequestRecord};

/// Header carrying the client's request id (in, forwarded to the engine unchanged, and out):
/// the client's own when it sent a valid one, the gateway's otherwise.
pub const REQUEST_ID: &str = "x-request-id";
/// Response header carrying the gateway's own request id: the store's key (`request_id`),
/// always a UUIDv7 the gateway generated, whatever the client sent.
pub const TOKENSCOPE_REQUEST_ID: &str = "x-tokenscope-request-id";
/// Response header carrying the trace id.
pub const TRACE_ID: &str = "x-tokenscope-trace-id";
const H_USER: &str = "x-tokenscope-user";
const H_TENANT: &str = "x-tokenscope-tenant";
const H_BUSINESS_LINE: &str = "x-tokenscope-business-line";
const H_REQUEST_TYPE: &str = "x-tokenscope-request-type";

/// Headers that describe one hop only and must not be forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
];

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// JSON error body in the OpenAI shape.
pub(crate) fn error_response(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "error": {"message": message, "type": "tokenscope_error", "code": code}
    });
    (status, axum::Json(body)).into_response()
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// Marks an attribution value cut at `max_attribution_bytes`.
pub(crate) const TRUNCATED: &str = "…[truncated]";

/// An attribution value as stored and labelled: at most `max` bytes of it (cut at a character
/// boundary) followed by [`TRUNCATED`] when it was longer — never silently cut, never
/// unbounded (a client sending 390 KB headers must not make every record 390 KB).
pub(crate) fn bounded(v: &str, max: usize) -> String {
    if v.len() <= max {
        return v.to_owned();
    }
    let mut end = max;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{TRUNCATED}", &v[..end])
}

fn valid_request_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Builds the upstream URI: base URL (with an optional path prefix) + path and query.
fn upstream_uri(base: &Uri, original: &Uri) -> Result<Uri, http::Error> {
    let pq = original.path_and_query().map_or("/", |p| p.as_str());
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(format!("{prefix}{pq}").parse()?);
    Ok(Uri::from_parts(parts)?)
}

/// The upstream request target in origin-form: the base URL's path prefix + path and query.
fn origin_form(base: &Uri, original: &Uri) -> Result<Uri, http::Error> {
    let pq = original.path_and_query().map_or("/", |p| p.as_str());
    let prefix = base.path().trim_end_matches('/');
    Ok(format!("{prefix}{pq}").parse()?)
}

fn copy_request_headers(src: &HeaderMap, dst: &mut HeaderMap, measured: bool) {
    for (k, v) in src {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || name == "content-length" {
            continue;
        }
        if measured && (name.starts_with("x-tokenscope-") || name == "accept-encoding") {
            // Our attribution headers stay here; responses must stay readable (identity).
            continue;
        }
        dst.append(k.clone(), v.clone());
    }
}

fn copy_response_headers(src: &HeaderMap, dst: &mut HeaderMap, drop_length: bool) {
    for (k, v) in src {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || (drop_length && name == "content-length") {
            continue;
        }
        dst.append(k.clone(), v.clone());
    }
}

/// The response's id headers: `x-request-id` = `shown_id` (the client's own id when it sent
/// one, ours otherwise), `x-tokenscope-request-id` = `key` (ours, the store's key), and the
/// trace id.
fn set_ids(h: &mut HeaderMap, shown_id: &str, key: &str, trace_id: &str) {
    if let Ok(v) = HeaderValue::from_str(shown_id) {
        h.insert(HeaderName::from_static(REQUEST_ID), v);
    }
    if let Ok(v) = HeaderValue::from_str(key) {
        h.insert(HeaderName::from_static(TOKENSCOPE_REQUEST_ID), v);
    }
    if let Ok(v) = HeaderValue::from_str(trace_id) {
        h.insert(HeaderName::from_static(TRACE_ID), v);
    }
}

/// `r` with the id headers of [`set_ids`].
fn with_ids(mut r: Response, shown_id: &str, key: &str, trace_id: &str) -> Response {
    set_ids(r.headers_mut(), shown_id, key, trace_id);
    r
}

/// The ids a measured request's answers carry: what the client sees as `x-request-id`, the
/// gateway's key, the trace id.
struct Ids<'a> {
    shown: &'a str,
    key: &'a str,
    trace: &'a str,
}

/// The one failure path of a measured request before its response: the record is finished
/// with `outcome` / `error_type` and `status`, and the client gets the JSON error with the ids.
fn fail(
    mut guard: RecordGuard,
    (outcome, error_type): (Outcome, &'static str),
    status: StatusCode,
    message: &str,
    ids: &Ids<'_>,
) -> Response {
    if let Some(p) = guard.get() {
        p.rec.http_status = status.as_u16();
    }
    guard.finish(Instant::now(), Some((outcome, error_type)));
    with_ids(
        error_response(status, error_type, message),
        ids.shown,
        ids.key,
        ids.trace,
    )
}

/// Why a request body could not be read.
enum BodyError {
    /// Over the size limit (413).
    TooLarge,
    /// Did not arrive within `limits.body_timeout_ms` (408).
    Timeout,
    /// The client's stream failed.
    Failed,
}

/// Reads a request body whole: at most `limit` bytes, within `timeout`.
async fn read_body(
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<Bytes, BodyError> {
    match tokio::time::timeout(timeout, http_body_util::Limited::new(body, limit).collect()).await {
        Err(_) => Err(BodyError::Timeout),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(BodyError::TooLarge)
        }
        Ok(Err(_)) => Err(BodyError::Failed),
    }
}

const BODY_TIMEOUT_MESSAGE: &str = "the request body did not arrive within limits.body_timeout_ms";
const UPSTREAM_TIMEOUT_MESSAGE: &str = "the upstream did not answer in time";

/// The API key presented by the client, if any (`Authorization: Bearer`, `x-api-key`, `api-key`).
fn api_key(h: &HeaderMap) -> Option<&str> {
    header_str(h, "authorization")
        .and_then(|a| {
            a.strip_prefix("Bearer ")
                .or_else(|| a.strip_prefix("bearer "))
        })
        .map(str::trim)
        .or_else(|| header_str(h, "x-api-key"))
        .or_else(|| header_str(h, "api-key"))
        .filter(|k| !k.is_empty())
}

/// Handler for `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.
pub(crate) async fn measured(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let arrival = Instant::now();
    let created_at = now_us();
    let (parts, body) = req.into_parts();
    let max_attr = shared.cfg.limits.max_attribution_bytes;
    let attr = |name: &str| header_str(&parts.headers, name).map(|v| bounded(v, max_attr));
    let endpoint = Endpoint::from_path(parts.uri.path()).unwrap_or_default();
    // The key is always ours: a client's id is data (a reused or forged one must neither
    // collapse rows nor suppress another client's row). The client's id travels on unchanged.
    let request_id = uuid::Uuid::now_v7().to_string();
    let client_request_id = header_str(&parts.headers, REQUEST_ID)
        .filter(|s| valid_request_id(s))
        .map(str::to_owned);
    let shown_id = client_request_id
        .clone()
        .unwrap_or_else(|| request_id.clone());
    let trace = tokenscope_trace::RequestTrace::start(header_str(&parts.headers, "traceparent"));
    let trace_id = trace.trace_id_hex();
    let traceparent = trace.upstream_traceparent();

    let rec = RequestRecord {
        request_id: request_id.clone(),
        client_request_id,
        trace_id: trace_id.clone(),
        created_at,
        endpoint,
        request_type: attr(H_REQUEST_TYPE)
            .unwrap_or_else(|| endpoint.default_request_type().to_owned()),
        ..RequestRecord::default()
    };
    let mut guard = RecordGuard::new(shared.clone(), rec, arrival, trace);

    // Attribution that does not need the body.
    if let Some(p) = guard.get() {
        p.conn = parts
            .extensions
            .get::<Arc<crate::server::ConnState>>()
            .cloned();
        p.rec.user_id = attr(H_USER);
        p.rec.tenant = attr(H_TENANT);
        p.rec.business_line = attr(H_BUSINESS_LINE);
        if let Some(key) = api_key(&parts.headers) {
            let h = crate::config::sha256_hex(key);
            p.rec.api_key_id = Some(h[..16].to_owned());
            if let Some(entry) = shared.api_keys.get(&h) {
                if p.rec.tenant.is_none() {
                    p.rec.tenant.clone_from(&entry.tenant);
                }
                if p.rec.business_line.is_none() {
                    p.rec.business_line.clone_from(&entry.business_line);
                }
            }
        }
    }

    // Body, with a size limit.
    let limit = shared.cfg.max_body_bytes;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large(guard, limit, &shown_id, &request_id, &trace_id);
    }
    let ids = Ids {
        shown: &shown_id,
        key: &request_id,
        trace: &trace_id,
    };
    let body_timeout = std::time::Duration::from_millis(shared.cfg.limits.body_timeout_ms);
    let body_bytes = match read_body(body, limit, body_timeout).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            return too_large(guard, limit, &shown_id, &request_id, &trace_id)
        }
        Err(BodyError::Timeout) => {
            return fail(
                guard,
                (Outcome::ClientError, "client_body_timeout"),
                StatusCode::REQUEST_TIMEOUT,
                BODY_TIMEOUT_MESSAGE,
                &ids,
            )
        }
        Err(BodyError::Failed) => {
            // The client's stream broke: it went away (499 in the record), answered 400.
            guard.finish(
                Instant::now(),
                Some((Outcome::Cancelled, "client_body_error")),
            );
            return with_ids(
                error_response(
                    StatusCode::BAD_REQUEST,
                    "client_body_error",
                    "could not read the request body",
                ),
                &shown_id,
                &request_id,
                &trace_id,
            );
        }
    };
    if let Some(p) = guard.get() {
        p.timer.mark_body_received(Instant::now());
    }

    // What the request asks for.
    let mut json: Option<Value> = serde_json::from_slice(&body_bytes).ok();
    let info = json
        .as_ref()
        .map(RequestInfo::from_json)
        .unwrap_or_default();
    let mut strip_usage = false;
    if let Some(p) = guard.get() {
        p.rec.model = info
            .model
            .as_deref()
            .map(|m| bounded(m, max_attr))
            .unwrap_or_default();
        p.rec.stream = info.stream;
        p.rec.max_tokens = info.max_tokens;
        if p.rec.user_id.is_none() {
            p.rec.user_id = info.user.as_deref().map(|u| bounded(u, max_attr));
        }
        if let Some(v) = &json {
            if let Some(norm) = normalised_prompt(endpoint, v) {
                let est = estimate_tokens(&norm);
                p.entry_input_tokens = Some(est);
                p.rec.input_bucket = Some(InputBucket::of(est));
                p.rec.prompt_hash = Some(prompt_hash(&p.rec.model, &norm));
                if shared.cfg.store_prompts {
                    p.rec.prompt_text = Some(norm);
                }
            }
        }
    }
    guard.start_in_flight();

    // Entry count with the model's own tokenizer: runs beside forwarding, never before it.
    if let (Some(model), Some(v)) = (info.model.as_deref(), json.as_ref()) {
        if shared.tokenizers.has(model) {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let tokenizers = shared.tokenizers.clone();
            let (model, body) = (model.to_owned(), v.clone());
            tokio::spawn(async move {
                let _ = tx.send(tokenizers.count_request(&model, endpoint, &body).await);
            });
            if let Some(p) = guard.get() {
                p.entry_count = Some(rx);
                if p.rec.stream {
                    p.output_text = Some(String::new());
                }
            }
        }
    }

    // Exact streamed usage: ask the engine for it, remove it from what the client sees.
    let mut forward_body = body_bytes;
    if info.stream && !info.include_usage && shared.cfg.inject_stream_usage {
        if let Some(v) = json.as_mut() {
            if inject_include_usage(v) {
                if let Ok(b) = serde_json::to_vec(v) {
                    forward_body = Bytes::from(b);
                    strip_usage = true;
                }
            }
        }
    }

    // Routing.
    let Some(upstream) = shared.route(info.model.as_deref()) else {
        return fail(
            guard,
            (Outcome::UpstreamError, "no_upstream"),
            StatusCode::BAD_GATEWAY,
            "no upstream is configured for this model",
            &ids,
        );
    };
    if let Some(p) = guard.get() {
        p.rec.upstream.clone_from(&upstream.name);
        p.facts.kind = upstream.cfg.kind;
        // Engine and GPU state at arrival (lock-free snapshots of the last scrape).
        if let Some(snap) = upstream.state.as_ref().and_then(|s| s.snapshot()) {
            p.rec.engine_running = Some(snap.running);
            p.rec.engine_waiting = Some(snap.waiting);
            p.rec.engine_kv_usage = snap.kv_usage;
        }
        if let Some(g) = shared.gpu.as_ref().and_then(|g| g.snapshot()) {
            p.rec.gpu_utilization = g.mean_utilization;
            p.rec.gpu_memory_bandwidth = g.mean_memory_bandwidth;
        }
    }
    if upstream.cfg.request_metrics {
        if let Some(obj) = json.as_mut().and_then(|v| v.as_object_mut()) {
            obj.insert("include_metrics".into(), Value::Bool(true));
            if let Ok(b) = serde_json::to_vec(&obj) {
                forward_body = Bytes::from(b);
            }
        }
    }
    // Origin-form: the connection is to the upstream itself (`Host` is set by the pool).
    let uri = match origin_form(&upstream.base, &parts.uri) {
        Ok(u) => u,
        Err(e) => {
            return fail(
                guard,
                (Outcome::ClientError, "bad_uri"),
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                &ids,
            )
        }
    };
    let mut up = http::Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .version(http::Version::HTTP_11);
    if let Some(h) = up.headers_mut() {
        copy_request_headers(&parts.headers, h, true);
        if let Ok(v) = HeaderValue::from_str(&traceparent) {
            h.insert(HeaderName::from_static("traceparent"), v);
        }
        if let Ok(v) = HeaderValue::from_str(&shown_id) {
            h.insert(HeaderName::from_static(REQUEST_ID), v);
        }
        h.insert(
            header::CONTENT_LENGTH,
            HeaderValue::from(forward_body.len()),
        );
    }
    let up = match up.body(http_body_util::Full::new(forward_body)) {
        Ok(r) => r,
        Err(e) => {
            return fail(
                guard,
                (Outcome::ClientError, "bad_request"),
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                &ids,
            )
        }
    };

    if let Some(p) = guard.get() {
        p.timer.mark_upstream_sent(Instant::now());
    }
    let resp = tokio::time::timeout(
        shared.cfg.upstream_timeout(),
        crate::upconn::send(&upstream.pool, up),
    )
    .await;
    let resp = match resp {
        Err(_) => {
            guard.finish(
                Instant::now(),
                Some((Outcome::Timeout, "upstream_header_timeout")),
            );
            let r = error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                UPSTREAM_TIMEOUT_MESSAGE,
            );
            return with_ids(r, &shown_id, &request_id, &trace_id);
        }
        Ok(Err(e)) => {
            return fail(
                guard,
                (Outcome::UpstreamError, e.code()),
                StatusCode::BAD_GATEWAY,
                &format!("upstream {}: {e}", upstream.name),
                &ids,
            )
        }
        Ok(Ok(r)) => r,
    };
    let (resp, upconn) = resp;

    let headers_at = Instant::now();
    let status = resp.status();
    if let Some(p) = guard.get() {
        p.timer.mark_headers(headers_at);
        p.facts.status = Some(status.as_u16());
        p.facts.tgi = crate::engine::TgiHeaders::read(resp.headers());
    }
    let is_sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.trim_start().starts_with("text/event-stream"));
    let mode = if is_sse {
        Mode::Sse {
            splitter: EventSplitter::new(shared.cfg.max_sse_event_bytes),
            strip: strip_usage,
            blind: false,
        }
    } else {
        Mode::Whole {
            buf: Vec::new(),
            cap: shared.cfg.max_response_parse_bytes,
            overflow: false,
        }
    };
    let drop_length = is_sse && strip_usage;
    let (rparts, rbody) = resp.into_parts();
    let metered = MeteredBody::new(
        rbody,
        Some(upconn),
        mode,
        guard,
        shared.cfg.stream_idle_timeout(),
    );
    let mut out = Response::new(Body::new(metered));
    *out.status_mut() = rparts.status;
    copy_response_headers(&rparts.headers, out.headers_mut(), drop_length);
    set_ids(out.headers_mut(), &shown_id, &request_id, &trace_id);
    out
}

fn too_large(
    mut guard: RecordGuard,
    limit: usize,
    shown_id: &str,
    request_id: &str,
    trace_id: &str,
) -> Response {
    if let Some(p) = guard.get() {
        p.rec.http_status = 413;
    }
    guard.finish(
        Instant::now(),
        Some((Outcome::ClientError, "body_too_large")),
    );
    let mut r = error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        &format!("request body exceeds {limit} bytes"),
    );
    set_ids(r.headers_mut(), shown_id, request_id, trace_id);
    r
}

/// Every other path: forwarded to the default upstream unchanged, streamed both ways, not
/// measured.
pub(crate) async fn passthrough(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let Some(upstream) = shared.route(None) else {
        return error_response(
            StatusCode::BAD_GATEWAY,
            "no_upstream",
            "no upstream configured",
        );
    };
    let (parts, body) = req.into_parts();
    // A body of known size (every ordinary API call) goes over the upstream's own pool, like a
    // measured request: its connections are retired before the engine closes them and are not
    // reused after a stream when the engine closes those (llama.cpp's native `/completion`
    // streams too). Bodies of unknown length (chunked uploads) stream through the hyper-util
    // client.
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let known = match declared {
        Some(n) => n <= shared.cfg.max_body_bytes,
        None => parts.method == http::Method::GET || parts.method == http::Method::HEAD,
    };
    if known && !parts.headers.contains_key(header::TRANSFER_ENCODING) {
        return passthrough_pooled(&shared, upstream, parts, body).await;
    }
    let uri = match upstream_uri(&upstream.base, &parts.uri) {
        Ok(u) => u,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "bad_uri", &e.to_string()),
    };
    let mut up = http::Request::builder().method(parts.method).uri(uri);
    if let Some(h) = up.headers_mut() {
        copy_request_headers(&parts.headers, h, false);
        if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
            h.insert(header::CONTENT_LENGTH, len.clone());
        }
    }
    let up = match up.body(body) {
        Ok(r) => r,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "bad_request", &e.to_string()),
    };
    match tokio::time::timeout(shared.cfg.upstream_timeout(), shared.client.request(up)).await {
        Err(_) => error_response(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            UPSTREAM_TIMEOUT_MESSAGE,
        ),
        Ok(Err(e)) => error_response(
            StatusCode::BAD_GATEWAY,
            "upstream_unreachable",
            &format!("upstream {}: {e}", upstream.name),
        ),
        Ok(Ok(resp)) => {
            let (rparts, rbody) = resp.into_parts();
            let mut out = Response::new(Body::new(rbody));
            *out.status_mut() = rparts.status;
            copy_response_headers(&rparts.headers, out.headers_mut(), false);
            out
        }
    }
}

/// Pass-through of a request whose body has a known size, on the upstream's [`UpPool`]
/// (read whole, at most `max_body_bytes`; the response is streamed).
///
/// [`UpPool`]: crate::upconn::UpPool
async fn passthrough_pooled(
    shared: &Shared,
    upstream: &crate::Upstream,
    parts: http::request::Parts,
    body: Body,
) -> Response {
    let body_timeout = std::time::Duration::from_millis(shared.cfg.limits.body_timeout_ms);
    let bytes = match read_body(body, shared.cfg.max_body_bytes, body_timeout).await {
        Ok(b) => b,
        Err(BodyError::Timeout) => {
            return error_response(
                StatusCode::REQUEST_TIMEOUT,
                "client_body_timeout",
                BODY_TIMEOUT_MESSAGE,
            )
        }
        Err(BodyError::TooLarge | BodyError::Failed) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "client_body_error",
                "could not read the request body",
            )
        }
    };
    let uri = match origin_form(&upstream.base, &parts.uri) {
        Ok(u) => u,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "bad_uri", &e.to_string()),
    };
    let mut up = http::Request::builder()
        .method(parts.method)
        .uri(uri)
        .version(http::Version::HTTP_11);
    if let Some(h) = up.headers_mut() {
        copy_request_headers(&parts.headers, h, false);
        if !bytes.is_empty() || parts.headers.contains_key(header::CONTENT_LENGTH) {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        }
    }
    let up = match up.body(http_body_util::Full::new(bytes)) {
        Ok(r) => r,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, "bad_request", &e.to_string()),
    };
    let sent = tokio::time::timeout(
        shared.cfg.upstream_timeout(),
        crate::upconn::send(&upstream.pool, up),
    )
    .await;
    match sent {
        Err(_) => error_response(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            UPSTREAM_TIMEOUT_MESSAGE,
        ),
        Ok(Err(e)) => error_response(
            StatusCode::BAD_GATEWAY,
            e.code(),
            &format!("upstream {}: {e}", upstream.name),
        ),
        Ok(Ok((resp, conn))) => {
            let (rparts, rbody) = resp.into_parts();
            let mut out = Response::new(Body::new(crate::upconn::PooledBody::new(rbody, conn)));
            *out.status_mut() = rparts.status;
            copy_response_headers(&rparts.headers, out.headers_mut(), false);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_join() {
        let base: Uri = "http://127.0.0.1:8080/prefix/".parse().expect("uri");
        let orig: Uri = "/v1/models?x=1".parse().expect("uri");
        assert_eq!(
            upstream_uri(&base, &orig).expect("join").to_string(),
            "http://127.0.0.1:8080/prefix/v1/models?x=1"
        );
    }

    #[test]
    fn origin_form_keeps_the_prefix() {
        let base: Uri = "http://127.0.0.1:8080/prefix/".parse().expect("uri");
        let orig: Uri = "/v1/chat/completions?x=1".parse().expect("uri");
        assert_eq!(
            origin_form(&base, &orig).expect("join").to_string(),
            "/prefix/v1/chat/completions?x=1"
        );
        let base: Uri = "http://engine:8000".parse().expect("uri");
        assert_eq!(
            origin_form(&base, &orig).expect("join").to_string(),
            "/v1/chat/completions?x=1"
        );
    }

    #[test]
    fn api_key_sources() {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer sk-1"));
        assert_eq!(api_key(&h), Some("sk-1"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(api_key(&h), Some("k2"));
        assert!(valid_request_id("abc-123"));
        assert!(!valid_request_id("has space"));
    }
}
