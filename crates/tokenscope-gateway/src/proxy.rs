//! The request path: measured OpenAI endpoints and blind pass-through of everything else.
//!
//! A measured request, in order (see ARCHITECTURE.md for the picture); each step's rules live
//! in the module named:
//! 1. arrival instant (monotonic) and `created_at` (wall clock); request id and trace id,
//!    attribution from the headers ([`crate::attribution`]); the record starts
//!    ([`crate::recording::RecordGuard`]);
//! 2. body read with a size limit and a deadline (413 / 408, [`crate::failure`]);
//! 3. the request plan: one JSON parse for model / stream / usage options / user, prompt hash
//!    and entry token estimate ([`crate::plan`]);
//! 4. routing by model, then to a replica of the upstream ([`crate::replicas`]: least
//!    outstanding requests among the healthy ones; a request whose connection could not be
//!    opened goes to the next replica); the forwarded body (`include_usage` injected for
//!    streams that did not ask for it, `include_metrics` for upstreams that report them)
//!    serialised at most once; the entry tokenizer count started beside forwarding;
//! 5. the upstream request ([`crate::forward`]) on a connection of the replica's
//!    [`crate::upconn::UpPool`] that this request's task drives, with a header timeout (502 /
//!    504 with a JSON error body: every failure goes through [`crate::failure::fail`]);
//! 6. the response body is wrapped in [`MeteredBody`], which drives that connection, forwards
//!    and measures each frame (what arrived together in one write) and finishes the record at
//!    its end.
//!
//! A malformed request body is forwarded as received (the engine answers it), still recorded.

use crate::attribution::{header_str, Attribution, RequestIds};
use crate::body::{MeteredBody, Mode};
use crate::failure::{error_response, fail, Failure};
use crate::plan::RequestPlan;
use crate::recording::RecordGuard;
use crate::replicas::{Loaded, Replica, Sent};
use crate::shared::{Shared, Upstream};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::StatusCode;
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokenscope_core::sse::EventSplitter;
use tokenscope_core::{Endpoint, RequestRecord};

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Why a request body could not be read.
enum BodyError {
    /// Over the size limit.
    TooLarge,
    /// Did not arrive within `limits.body_timeout_ms`.
    Timeout,
    /// The client's stream failed.
    Failed,
}

/// Reads a request body whole: at most `limit` bytes, within `timeout`.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, BodyError> {
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

/// The `content-length` the client declared, if any.
fn declared_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

fn body_timeout(shared: &Shared) -> Duration {
    Duration::from_millis(shared.cfg.limits.body_timeout_ms)
}

/// Handler for `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`,
/// `/v1/messages`.
pub(crate) async fn measured(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let arrival = Instant::now();
    let created_at = now_us();
    let (parts, body) = req.into_parts();
    let cfg = &shared.cfg;
    let max_attr = cfg.limits.max_attribution_bytes;
    let endpoint = Endpoint::from_path(parts.uri.path()).unwrap_or_default();
    let (mut guard, ids, traceparent) = arrive(&shared, &parts, endpoint, arrival, created_at);

    // Body, with a size limit.
    let limit = cfg.max_body_bytes;
    if declared_length(&parts.headers).is_some_and(|n| n > limit as u64) {
        return fail(guard, Failure::TooLarge { limit }, &ids);
    }
    let body_bytes = match read_body(body, limit, body_timeout(&shared)).await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => return fail(guard, Failure::TooLarge { limit }, &ids),
        Err(BodyError::Timeout) => return fail(guard, Failure::BodyTimeout, &ids),
        // The client's stream broke: it went away (499 in the record), answered 400.
        Err(BodyError::Failed) => return fail(guard, Failure::BodyFailed, &ids),
    };
    if let Some(f) = guard.facts() {
        f.body_received(Instant::now());
    }

    // What the request asks for.
    let mut plan = RequestPlan::parse(endpoint, body_bytes);
    let stream = plan.info.stream;
    let entry = guard.parts().map(|(rec, facts)| {
        facts.set_stream(stream);
        plan.fill(rec, max_attr, cfg.store_prompts)
    });
    let mut prompt = None;
    if let Some(entry) = entry {
        guard.set_entry_estimate(entry.estimate);
        prompt = entry.prompt;
    }
    guard.start_in_flight();

    // Routing, and the body forwarded (exact streamed usage asked for and removed from what the
    // client sees; engine metrics asked for where the upstream reports them).
    let upstream = shared.route(plan.model());
    let count_model = plan
        .model()
        .filter(|m| shared.tokenizers.has(m))
        .map(str::to_owned);
    let ask_usage = plan.asks_usage(cfg.inject_stream_usage);
    let forward = plan.forward_body(
        ask_usage,
        upstream.is_some_and(|u| u.cfg.request_metrics),
        count_model.is_some(),
    );

    // Entry count with the model's own tokenizer: runs beside forwarding, never before it.
    if let (Some(model), Some(body)) = (count_model, forward.parsed) {
        start_entry_count(&shared, &mut guard, model, endpoint, body, stream);
    }

    let Some(upstream) = upstream else {
        put_prompt(&mut guard, prompt);
        return fail(guard, Failure::NoUpstream, &ids);
    };
    note_upstream(&mut guard, upstream, shared.gpu.as_ref());
    let strip_usage = forward.strip_usage;
    if let Some(f) = guard.facts() {
        f.upstream_sent(Instant::now());
    }
    let body = forward.body;
    let send = crate::replicas::send(
        &upstream.name,
        &upstream.replicas,
        cfg.upstream_timeout(),
        |r| {
            crate::forward::measured(
                &parts,
                &r.base,
                &upstream.creds,
                body.clone(),
                &traceparent,
                ids.shown(),
            )
        },
        |r| note_replica(&mut guard, r),
    );
    // The prompt's hash and sketch while the engine works: `join` polls the send first (the
    // request is written upstream), then computes them, then waits for the response head.
    let (sent, prompt) = futures_util::future::join(send, async move {
        prompt.map(crate::plan::PromptFacts::compute)
    })
    .await;
    put_prompt(&mut guard, prompt);
    match sent {
        Ok(sent) => respond(cfg, guard, sent, strip_usage, &ids),
        Err(failure) => fail(guard, failure, &ids),
    }
}

/// The prompt's hash, sketch and kept text on the record.
fn put_prompt(guard: &mut RecordGuard, prompt: Option<crate::plan::PromptFacts>) {
    if let (Some(p), Some((rec, _))) = (prompt, guard.parts()) {
        p.apply(rec);
    }
}

/// Step 1: the record of a request that arrived at `arrival`: its ids, the attribution from
/// its headers, its guard; and the `traceparent` the upstream gets.
fn arrive(
    shared: &Shared,
    parts: &http::request::Parts,
    endpoint: Endpoint,
    arrival: Instant,
    created_at: i64,
) -> (RecordGuard, RequestIds, String) {
    let trace = tokenscope_trace::RequestTrace::start(header_str(&parts.headers, "traceparent"));
    let ids = RequestIds::new(&parts.headers, trace.trace_id_hex());
    let traceparent = trace.upstream_traceparent();
    let mut rec = RequestRecord {
        request_id: ids.key.clone(),
        client_request_id: ids.client.clone(),
        trace_id: ids.trace.clone(),
        created_at,
        endpoint,
        ..RequestRecord::default()
    };
    let max_attr = shared.cfg.limits.max_attribution_bytes;
    Attribution::from_headers(&parts.headers, endpoint, max_attr, &shared.api_keys).apply(&mut rec);
    let conn = parts
        .extensions
        .get::<Arc<crate::server::ConnState>>()
        .cloned();
    let guard = RecordGuard::new(shared.fanout.clone(), rec, arrival, trace, conn);
    (guard, ids, traceparent)
}

/// Starts the entry count of `body` with `model`'s tokenizer on its own task; a stream's
/// output text is then kept too (a cancelled stream's output is counted with it).
fn start_entry_count(
    shared: &Shared,
    guard: &mut RecordGuard,
    model: String,
    endpoint: Endpoint,
    body: serde_json::Value,
    stream: bool,
) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tokenizers = shared.tokenizers.clone();
    tokio::spawn(async move {
        let _ = tx.send(tokenizers.count_request(&model, endpoint, &body).await);
    });
    guard.set_entry_count(rx);
    if stream {
        if let Some(f) = guard.facts() {
            f.keep_output_text();
        }
    }
}

/// The chosen upstream on the record, with the GPUs' state at arrival (a lock-free snapshot
/// of the last scrape).
fn note_upstream(
    guard: &mut RecordGuard,
    upstream: &Upstream,
    gpu: Option<&tokenscope_engine_state::GpuStateHandle>,
) {
    let Some((rec, facts)) = guard.parts() else {
        return;
    };
    rec.upstream.clone_from(&upstream.name);
    facts.set_kind(upstream.cfg.kind);
    if let Some(g) = gpu.and_then(|g| g.snapshot()) {
        rec.gpu_utilization = g.mean_utilization;
        rec.gpu_memory_bandwidth = g.mean_memory_bandwidth;
    }
}

/// The replica a request is sent to on the record, with its engine's state (a lock-free
/// snapshot of its last scrape; unknown fields cleared): told again for each replica tried,
/// so the record names the one that served the request, or the last one that failed.
fn note_replica(guard: &mut RecordGuard, replica: &Replica) {
    guard.on_replica(replica);
    let Some((rec, _)) = guard.parts() else {
        return;
    };
    rec.replica.clone_from(&replica.name);
    let snap = replica.state.as_ref().and_then(|s| s.snapshot());
    rec.engine_running = snap.map(|s| s.running);
    rec.engine_waiting = snap.map(|s| s.waiting);
    rec.engine_kv_usage = snap.and_then(|s| s.kv_usage);
}

/// Step 6: the client's response, its body wrapped in [`MeteredBody`] (which now owns the
/// guard and the upstream connection).
fn respond(
    cfg: &crate::config::GatewayConfig,
    mut guard: RecordGuard,
    sent: Sent,
    strip_usage: bool,
    ids: &RequestIds,
) -> Response {
    let Sent {
        resp,
        conn: upconn,
        load,
    } = sent;
    let (rparts, rbody) = resp.into_parts();
    if let Some(f) = guard.facts() {
        f.headers(Instant::now(), rparts.status.as_u16(), &rparts.headers);
    }
    let is_sse = rparts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.trim_start().starts_with("text/event-stream"));
    let mode = if is_sse {
        Mode::Sse {
            splitter: EventSplitter::new(cfg.max_sse_event_bytes),
            strip: strip_usage,
            blind: false,
        }
    } else {
        Mode::Whole {
            buf: Vec::new(),
            cap: cfg.max_response_parse_bytes,
            overflow: false,
        }
    };
    let metered = MeteredBody::new(rbody, Some(upconn), mode, guard, cfg.stream_idle_timeout());
    let body = Body::new(Loaded::new(metered, load));
    let mut out = crate::forward::response(&rparts, body, is_sse && strip_usage);
    ids.set_on(out.headers_mut());
    out
}

/// Every other path: forwarded unchanged to the upstream of the model it names
/// ([`crate::routing`]; the default upstream when it names none), streamed both ways, not
/// measured. `GET /v1/models` with several upstreams is answered with the union of their lists
/// ([`crate::models::union`]).
pub(crate) async fn passthrough(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    if shared.upstreams.is_empty() {
        return error_response(
            StatusCode::BAD_GATEWAY,
            "no_upstream",
            "no upstream configured",
        );
    }
    let (parts, body) = req.into_parts();
    if shared.upstreams.len() > 1 && crate::models::is_listing(&parts) {
        return crate::models::union(&shared, &parts).await;
    }
    // A body of known size (every ordinary API call) is read whole, routed by its model and
    // goes over the upstream's own pool, like a measured request: its connections are retired
    // before the engine closes them and are not reused after a stream when the engine closes
    // those (llama.cpp's native `/completion` streams too). Bodies of unknown length (chunked
    // uploads) stream through the hyper-util client, routed by the path alone.
    let known = match declared_length(&parts.headers) {
        Some(n) => usize::try_from(n).is_ok_and(|n| n <= shared.cfg.max_body_bytes),
        None => parts.method == http::Method::GET || parts.method == http::Method::HEAD,
    };
    if known && !parts.headers.contains_key(header::TRANSFER_ENCODING) {
        let bytes = match read_body(body, shared.cfg.max_body_bytes, body_timeout(&shared)).await {
            Ok(b) => b,
            Err(BodyError::Timeout) => return Failure::BodyTimeout.response(),
            Err(BodyError::TooLarge | BodyError::Failed) => return Failure::BodyFailed.response(),
        };
        let model = crate::routing::passthrough_model(&parts, Some(&bytes));
        let Some(upstream) = shared.route(model.as_deref()) else {
            return Failure::NoUpstream.response();
        };
        return passthrough_pooled(&shared, upstream, parts, bytes).await;
    }
    let model = crate::routing::passthrough_model(&parts, None);
    let Some(upstream) = shared.route(model.as_deref()) else {
        return Failure::NoUpstream.response();
    };
    // A streamed body cannot be sent twice: one replica, no retry.
    let Some(attempt) = upstream.replicas.choose(&[], Instant::now()) else {
        return Failure::NoUpstream.response();
    };
    let up = match crate::forward::passthrough_streamed(
        parts,
        &attempt.replica().base,
        &upstream.creds,
        body,
    ) {
        Ok(r) => r,
        Err(failure) => return failure.response(),
    };
    match tokio::time::timeout(shared.cfg.upstream_timeout(), shared.client.request(up)).await {
        Err(_) => {
            attempt.failed(Instant::now());
            Failure::UpstreamTimeout.response()
        }
        Ok(Err(e)) => {
            if e.is_connect() {
                attempt.failed(Instant::now());
            }
            Failure::Upstream {
                code: "upstream_unreachable",
                message: format!(
                    "upstream {}: {}",
                    upstream.name,
                    tokenscope_net::error_chain(&e)
                ),
            }
            .response()
        }
        Ok(Ok(resp)) => {
            let load = attempt.succeeded();
            let (rparts, rbody) = resp.into_parts();
            crate::forward::response(&rparts, Body::new(Loaded::new(rbody, load)), false)
        }
    }
}

/// Pass-through of a request whose body has a known size and was read whole (`bytes`), on the
/// upstream's [`UpPool`] (the response is streamed).
///
/// [`UpPool`]: crate::upconn::UpPool
async fn passthrough_pooled(
    shared: &Shared,
    upstream: &Upstream,
    parts: http::request::Parts,
    bytes: Bytes,
) -> Response {
    let sent = crate::replicas::send(
        &upstream.name,
        &upstream.replicas,
        shared.cfg.upstream_timeout(),
        |r| crate::forward::passthrough_pooled(&parts, &r.base, &upstream.creds, bytes.clone()),
        |_| {},
    )
    .await;
    match sent {
        Err(failure) => failure.response(),
        Ok(Sent { resp, conn, load }) => {
            let (rparts, rbody) = resp.into_parts();
            let body = crate::upconn::PooledBody::new(rbody, conn);
            crate::forward::response(&rparts, Body::new(Loaded::new(body, load)), false)
        }
    }
}
