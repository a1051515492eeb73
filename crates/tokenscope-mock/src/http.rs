//! The HTTP face of the mock: OpenAI-compatible routes over the simulated [`Engine`].

use crate::engine::{scaled, Engine, EngineParams, Event, Job, Meta, Summary};
use crate::fault::Fault;
use crate::metrics::Stats;
use crate::rng::{natural_len, SplitMix64};
use crate::tokenizer::{chat_prompt_tokens, count_tokens, tokenize};
use crate::{MockConfig, DELAY_HEADER, FAULT_HEADER};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Token chunks a stream fault sends before it misbehaves.
const FAULT_TOKENS: u64 = 3;
/// How long `hang` waits when no shutdown comes.
const HANG_FOR: Duration = Duration::from_secs(3600);
/// Pause before `drop_mid_stream` cuts the connection, so its last chunk is on the wire.
const DROP_FLUSH_PAUSE: Duration = Duration::from_millis(20);
/// Dimensions of the mock embeddings.
const EMBEDDING_DIMS: usize = 8;

#[derive(Clone)]
struct App(Arc<AppInner>);

struct AppInner {
    cfg: MockConfig,
    engine: Engine,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    /// The SDK's last finished requests (`/debug/sdk/requests`).
    sdk_ring: crate::sdk::Ring,
    /// The SDK's engine-side `llm_*` metrics, appended to `/metrics`.
    sdk_metrics: tokenscope_sdk::prometheus::Registry,
    /// Sequence number of inference requests: ids and the output-length PRNG.
    next_request: AtomicU64,
}

/// Builds the router. `shutdown` ends `hang` and `stall_mid_stream` requests when cancelled.
pub(crate) fn app(cfg: MockConfig, shutdown: CancellationToken) -> Router {
    let stats = Arc::new(Stats::default());
    let sdk_ring = crate::sdk::Ring::default();
    let (sdk_metrics, prometheus) = crate::sdk::prometheus();
    let engine = Engine::with_tracker(
        EngineParams::from_config(&cfg),
        stats.clone(),
        crate::sdk::tracker_factory(&cfg, sdk_ring.clone(), prometheus),
    );
    let state = App(Arc::new(AppInner {
        cfg,
        engine,
        stats,
        shutdown,
        sdk_ring,
        sdk_metrics,
        next_request: AtomicU64::new(0),
    }));
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize_route))
        .route("/debug/sdk/requests", get(sdk_requests))
        .fallback(not_found)
        .with_state(state)
}

// ---------------------------------------------------------------------------------------------
// Errors

/// An OpenAI-shaped error response.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.status.as_u16(),
            }
        });
        (self.status, axum::Json(body)).into_response()
    }
}

// ---------------------------------------------------------------------------------------------
// Request parsing

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    /// OpenAI Responses API (`/v1/responses`).
    Responses,
    /// Anthropic Messages API (`/v1/messages`).
    Messages,
}

/// A non-empty array of objects (`messages`, `input` items).
fn object_list<'a>(v: Option<&'a Value>, key: &str) -> Result<&'a [Value], ApiError> {
    match v {
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.iter().all(Value::is_object) {
                Ok(items)
            } else {
                Err(ApiError::bad_request(format!(
                    "each item of '{key}' must be an object"
                )))
            }
        }
        Some(Value::Array(_)) => Err(ApiError::bad_request(format!("'{key}' must not be empty"))),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be an array"))),
        None => Err(ApiError::bad_request(format!("'{key}' is required"))),
    }
}

/// What the mock needs from a generation request (chat, completion, Responses, Messages).
#[derive(Debug, Clone)]
struct GenRequest {
    model: String,
    stream: bool,
    include_usage: bool,
    max_tokens: Option<u64>,
    forced_output: Option<u64>,
    prompt_tokens: u64,
}

fn parse_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_request("request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!(
            "request body is not valid JSON: {e}"
        ))),
    }
}

fn opt_bool(o: &serde_json::Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(format!("'{key}' must be a boolean"))),
    }
}

fn opt_u64(o: &serde_json::Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad_request(format!("'{key}' must be a non-negative integer"))
        }),
    }
}

fn model_of(o: &serde_json::Map<String, Value>, default: &str) -> String {
    o.get("model")
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
        .unwrap_or(default)
        .to_owned()
}

/// Tokens of a completions `prompt` (or embeddings `input`): a string, a list of strings, a list
/// of token ids, or a list of token-id lists. Several prompts count as one concatenated prompt.
fn prompt_like_tokens(v: &Value, key: &str) -> Result<u64, ApiError> {
    let bad = || {
        ApiError::bad_request(format!(
            "'{key}' must be a string, an array of strings, or token ids"
        ))
    };
    match v {
        Value::String(s) => Ok(count_tokens(s)),
        Value::Array(items) if !items.is_empty() => {
            let mut total = 0u64;
            for item in items {
                total += match item {
                    Value::String(s) => count_tokens(s),
                    Value::Number(n) if n.is_u64() => 1,
                    Value::Array(ids) if ids.iter().all(Value::is_u64) => ids.len() as u64,
                    _ => return Err(bad()),
                };
            }
            Ok(total)
        }
        _ => Err(bad()),
    }
}

fn parse_gen(kind: Kind, body: &[u8], default_model: &str) -> Result<GenRequest, ApiError> {
    let o = parse_object(body)?;
    // A system prompt (`instructions`, `system`) counts as one more message.
    let system = |key: &str| {
        o.get(key)
            .filter(|v| !v.is_null())
            .map_or(0, |v| chat_prompt_tokens(&[json!({ "content": v })]))
    };
    let prompt_tokens = match kind {
        Kind::Chat => chat_prompt_tokens(object_list(o.get("messages"), "messages")?),
        Kind::Completion => match o.get("prompt") {
            Some(p) => prompt_like_tokens(p, "prompt")?,
            None => return Err(ApiError::bad_request("'prompt' is required")),
        },
        Kind::Responses => {
            system("instructions")
                + match o.get("input") {
                    Some(Value::String(s)) => chat_prompt_tokens(&[json!({ "content": s })]),
                    input => chat_prompt_tokens(object_list(input, "input")?),
                }
        }
        Kind::Messages => {
            system("system") + chat_prompt_tokens(object_list(o.get("messages"), "messages")?)
        }
    };
    let include_usage = match o.get("stream_options") {
        Some(Value::Object(so)) => opt_bool(so, "include_usage")?,
        None | Some(Value::Null) => false,
        Some(_) => return Err(ApiError::bad_request("'stream_options' must be an object")),
    };
    let max_tokens = match kind {
        Kind::Responses => opt_u64(&o, "max_output_tokens")?,
        _ => match opt_u64(&o, "max_tokens")? {
            Some(m) => Some(m),
            None => opt_u64(&o, "max_completion_tokens")?,
        },
    };
    Ok(GenRequest {
        model: model_of(&o, default_model),
        stream: opt_bool(&o, "stream")?,
        include_usage,
        max_tokens,
        forced_output: opt_u64(&o, crate::OUTPUT_TOKENS_FIELD)?,
        prompt_tokens,
    })
}

/// Output tokens and finish reason (see the crate docs).
fn plan_output(cfg: &MockConfig, req: &GenRequest, request_no: u64) -> (u64, &'static str) {
    match req.forced_output {
        Some(n) => match req.max_tokens {
            Some(m) if n >= m => (m, "length"),
            _ => (n, "stop"),
        },
        None => {
            let natural = natural_len(cfg.seed, request_no);
            let limit = req.max_tokens.unwrap_or(cfg.default_max_tokens);
            if natural >= limit {
                (limit, "length")
            } else {
                (natural, "stop")
            }
        }
    }
}

fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("header {name} is not ASCII"))),
    }
}

fn parse_fault(headers: &HeaderMap) -> Result<Option<Fault>, ApiError> {
    match header_str(headers, FAULT_HEADER)? {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|e: crate::fault::UnknownFault| ApiError::bad_request(e.to_string())),
    }
}

/// Applies `x-mock-delay-ms`. Ends early (with a 503) when the server shuts down.
async fn apply_delay(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(v) = header_str(headers, DELAY_HEADER)? else {
        return Ok(());
    };
    let ms: u64 = v.trim().parse().map_err(|_| {
        ApiError::bad_request(format!("{DELAY_HEADER} must be a non-negative integer"))
    })?;
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => Ok(()),
        _ = app.0.shutdown.cancelled() => Err(ApiError::unavailable("server shutting down")),
    }
}

// ---------------------------------------------------------------------------------------------
// Response shapes

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn token_text(index: u64) -> String {
    format!("tok{index} ")
}

fn per(ms: f64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        ms / n as f64
    }
}

fn rate(n: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

fn usage_json(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    })
}

/// llama.cpp's `timings`: prompt = scheduled → first token, predicted = first → last token.
fn timings_json(s: &Summary) -> Value {
    let prompt_ms = s.prompt_ms();
    let predicted_ms = s.predicted_ms();
    json!({
        "cache_n": 0,
        "prompt_n": s.prompt_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per(prompt_ms, s.prompt_tokens),
        "prompt_per_second": rate(s.prompt_tokens, prompt_ms),
        "predicted_n": s.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per(predicted_ms, s.completion_tokens),
        "predicted_per_second": rate(s.completion_tokens, predicted_ms),
    })
}

/// Builds the JSON of one response or chunk for one request.
#[derive(Debug, Clone)]
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// Prompt tokens (the Messages API's `message_start` reports them before the end).
    prompt_tokens: u64,
}

impl Shape {
    fn new(kind: Kind, request_no: u64, model: String, prompt_tokens: u64) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
            Kind::Responses => "resp",
            Kind::Messages => "msg",
        };
        Self {
            kind,
            id: format!("{prefix}-mock-{request_no}"),
            created: unix_now(),
            model,
            prompt_tokens,
        }
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
        }
    }

    /// The item id of the Responses API's one output message.
    fn item_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    /// What a stream sends before the first token.
    fn opening(&self) -> Vec<Bytes> {
        match self.kind {
            Kind::Chat => vec![sse(&self.chunk(
                json!({"role": "assistant", "content": ""}),
                "",
                None,
            ))],
            Kind::Completion => Vec::new(),
            Kind::Responses => {
                let r = json!({"id": self.id, "object": "response", "created_at": self.created,
                               "status": "in_progress", "model": self.model, "output": []});
                let item = json!({"id": self.item_id(), "type": "message", "role": "assistant",
                                  "status": "in_progress", "content": []});
                vec![
                    sse_event(
                        "response.created",
                        &json!({"type": "response.created", "response": r}),
                    ),
                    sse_event(
                        "response.in_progress",
                        &json!({"type": "response.in_progress", "response": r}),
                    ),
                    sse_event(
                        "response.output_item.added",
                        &json!({"type": "response.output_item.added",
                        "output_index": 0, "item": item}),
                    ),
                    sse_event(
                        "response.content_part.added",
                        &json!({"type": "response.content_part.added",
                        "item_id": self.item_id(), "output_index": 0, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}),
                    ),
                ]
            }
            Kind::Messages => vec![
                sse_event(
                    "message_start",
                    &json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "content": [],
                    "model": self.model, "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": 0,
                              "cache_creation_input_tokens": 0, "output_tokens": 1}}}),
                ),
                sse_event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
                ),
                sse_event("ping", &json!({"type": "ping"})),
            ],
        }
    }

    /// The streamed event of token `index`.
    fn token(&self, index: u64) -> Bytes {
        let text = token_text(index);
        match self.kind {
            Kind::Chat | Kind::Completion => {
                sse(&self.chunk(json!({ "content": text }), &text, None))
            }
            Kind::Responses => sse_event(
                "response.output_text.delta",
                &json!({
                "type": "response.output_text.delta", "item_id": self.item_id(),
                "output_index": 0, "content_index": 0, "delta": text}),
            ),
            Kind::Messages => sse_event(
                "content_block_delta",
                &json!({
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": text}}),
            ),
        }
    }

    /// What a stream sends after its last token (`include_usage` matters to chat and
    /// completions only: the other APIs always report usage).
    fn closing(&self, finish: &str, include_usage: bool, s: &Summary) -> Vec<Bytes> {
        match self.kind {
            Kind::Chat | Kind::Completion if include_usage => vec![
                sse(&self.finish_chunk(finish, None)),
                sse(&self.usage_chunk(s)),
                Bytes::from_static(SSE_DONE),
            ],
            Kind::Chat | Kind::Completion => vec![
                sse(&self.finish_chunk(finish, Some(timings_json(s)))),
                Bytes::from_static(SSE_DONE),
            ],
            Kind::Responses => {
                let text = output_text(s.completion_tokens);
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                let item = json!({"id": self.item_id(), "type": "message", "role": "assistant",
                                  "status": "completed", "content": [part]});
                let done = self.full(text.clone(), finish, s);
                let status = done["status"].as_str().unwrap_or("completed");
                let kind = format!("response.{status}");
                // llama.cpp puts its `timings` beside the final response.
                let last = json!({"type": kind, "response": done, "timings": timings_json(s)});
                vec![
                    sse_event(
                        "response.output_text.done",
                        &json!({"type": "response.output_text.done",
                        "item_id": self.item_id(), "output_index": 0, "content_index": 0, "text": text}),
                    ),
                    sse_event(
                        "response.content_part.done",
                        &json!({"type": "response.content_part.done",
                        "item_id": self.item_id(), "output_index": 0, "content_index": 0, "part": part}),
                    ),
                    sse_event(
                        "response.output_item.done",
                        &json!({"type": "response.output_item.done",
                        "output_index": 0, "item": item}),
                    ),
                    sse_event(&kind, &last),
                ]
            }
            Kind::Messages => vec![
                sse_event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": 0}),
                ),
                sse_event(
                    "message_delta",
                    &json!({"type": "message_delta",
                    "delta": {"stop_reason": anthropic_stop(finish), "stop_sequence": null},
                    "usage": {"output_tokens": s.completion_tokens}}),
                ),
                sse_event("message_stop", &json!({"type": "message_stop"})),
            ],
        }
    }

    /// A streamed chunk with one choice carrying `text` (or, for chat, the delta `delta`).
    fn chunk(&self, delta: Value, text: &str, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish,
            }),
            _ => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    fn finish_chunk(&self, finish: &str, timings: Option<Value>) -> Value {
        let mut v = self.chunk(json!({}), "", Some(finish));
        if let (Some(t), Some(o)) = (timings, v.as_object_mut()) {
            o.insert("timings".into(), t);
        }
        v
    }

    fn usage_chunk(&self, s: &Summary) -> Value {
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(s),
            "timings": timings_json(s),
        })
    }

    fn full(&self, text: String, finish: &str, s: &Summary) -> Value {
        let (prompt, completion) = (s.prompt_tokens, s.completion_tokens);
        let (object, choice) = match self.kind {
            Kind::Responses => {
                let length = finish == "length";
                return json!({
                    "id": self.id, "object": "response", "created_at": self.created,
                    "model": self.model,
                    "status": if length { "incomplete" } else { "completed" },
                    "incomplete_details": if length { json!({"reason": "max_output_tokens"}) } else { Value::Null },
                    "error": null,
                    "output": [{"id": self.item_id(), "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                    "usage": {"input_tokens": prompt, "output_tokens": completion,
                        "total_tokens": prompt + completion,
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens_details": {"reasoning_tokens": 0}},
                });
            }
            Kind::Messages => {
                return json!({
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": anthropic_stop(finish), "stop_sequence": null,
                    "usage": {"input_tokens": prompt, "cache_read_input_tokens": 0,
                        "cache_creation_input_tokens": 0, "output_tokens": completion},
                });
            }
            Kind::Chat => (
                "chat.completion",
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish,
                }),
            ),
            Kind::Completion => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(s),
            "timings": timings_json(s),
        })
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// An SSE event with an `event:` line (the Responses and Messages APIs name every event).
fn sse_event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

/// The whole output text of `n` tokens.
fn output_text(n: u64) -> String {
    (0..n).map(token_text).collect()
}

/// An Anthropic stop reason for the mock's finish reason.
fn anthropic_stop(finish: &str) -> &'static str {
    if finish == "length" {
        "max_tokens"
    } else {
        "end_turn"
    }
}

const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

fn event_stream(body: Body) -> Response {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

// ---------------------------------------------------------------------------------------------
// Chat and completions

async fn chat(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    generate(app, Kind::Chat, headers, body).await
}

async fn completions(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    generate(app, Kind::Completion, headers, body).await
}

async fn responses(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    generate(app, Kind::Responses, headers, body).await
}

async fn messages(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    generate(app, Kind::Messages, headers, body).await
}

async fn generate(app: App, kind: Kind, headers: HeaderMap, body: Bytes) -> Response {
    match generate_inner(&app, kind, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(
    app: &App,
    kind: Kind,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let fault = parse_fault(headers)?;
    apply_delay(app, headers).await?;
    let cfg = &app.0.cfg;
    let req = parse_gen(kind, body, &cfg.model)?;
    let request_no = app.0.next_request.fetch_add(1, Ordering::Relaxed);
    let shape = Shape::new(kind, request_no, req.model.clone(), req.prompt_tokens);
    if let Some(f) = fault {
        return Ok(fault_response(app, f, Some(&shape)).await);
    }
    let (output_tokens, finish) = plan_output(cfg, &req, request_no);
    let meta = Meta {
        request_id: Some(shape.id.clone()),
        model: req.model.clone(),
        // An invalid traceparent starts no span (nothing could join it).
        trace: header_str(headers, "traceparent")
            .ok()
            .flatten()
            .and_then(tokenscope_sdk::TraceContext::parse),
        reason: if finish == "length" {
            tokenscope_sdk::FinishReason::Length
        } else {
            tokenscope_sdk::FinishReason::Stop
        },
        request_type: match kind {
            Kind::Chat | Kind::Responses | Kind::Messages => "chat",
            Kind::Completion => "completion",
        },
    };
    let rx = app
        .0
        .engine
        .submit_with(
            Job {
                prompt_tokens: req.prompt_tokens,
                output_tokens,
            },
            meta,
        )
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    if req.stream {
        Ok(stream_response(shape, finish, req.include_usage, rx))
    } else {
        full_response(shape, finish, rx).await
    }
}

async fn full_response(
    shape: Shape,
    finish: &'static str,
    mut rx: mpsc::Receiver<Event>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { index } => text.push_str(&token_text(index)),
            Event::Finished(s) => {
                return Ok(axum::Json(shape.full(text, finish, &s)).into_response());
            }
        }
    }
    Err(ApiError::unavailable("the mock engine stopped"))
}

/// State of one normal event stream.
struct StreamState {
    rx: mpsc::Receiver<Event>,
    shape: Shape,
    finish: &'static str,
    include_usage: bool,
    ready: VecDeque<Bytes>,
    done: bool,
}

fn stream_response(
    shape: Shape,
    finish: &'static str,
    include_usage: bool,
    rx: mpsc::Receiver<Event>,
) -> Response {
    let ready: VecDeque<Bytes> = shape.opening().into();
    let state = StreamState {
        rx,
        shape,
        finish,
        include_usage,
        ready,
        done: false,
    };
    // Dropping the body (client gone) drops `rx`, which aborts the request in the engine.
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(b) = st.ready.pop_front() {
                return Some((Ok::<_, Infallible>(b), st));
            }
            if st.done {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Token { index }) => {
                    st.ready.push_back(st.shape.token(index));
                }
                Some(Event::Finished(s)) => {
                    st.done = true;
                    st.ready
                        .extend(st.shape.closing(st.finish, st.include_usage, &s));
                }
                // The engine went away: end the stream without its closing events.
                None => st.done = true,
            }
        }
    });
    event_stream(Body::from_stream(stream))
}

// ---------------------------------------------------------------------------------------------
// Faults

/// One step of a scripted (fault) body.
enum Step {
    Send(Bytes),
    Sleep(Duration),
    WaitShutdown(CancellationToken),
    Fail,
}

fn scripted_body(steps: Vec<Step>) -> Body {
    let stream = futures_util::stream::unfold(steps.into_iter(), |mut it| async move {
        loop {
            match it.next()? {
                Step::Send(b) => return Some((Ok(b), it)),
                Step::Sleep(d) => tokio::time::sleep(d).await,
                Step::WaitShutdown(t) => t.cancelled().await,
                Step::Fail => {
                    return Some((
                        Err(std::io::Error::other("mock fault: drop_mid_stream")),
                        it,
                    ))
                }
            }
        }
    });
    Body::from_stream(stream)
}

/// The response for `fault`. `shape` is `None` on endpoints without chunks (embeddings), where
/// stream faults are rejected before this is called.
async fn fault_response(app: &App, fault: Fault, shape: Option<&Shape>) -> Response {
    let error = |status: StatusCode, kind: &'static str| ApiError {
        status,
        kind,
        message: format!("mock fault: {fault}"),
    };
    match fault {
        Fault::Error500 => error(StatusCode::INTERNAL_SERVER_ERROR, "server_error").into_response(),
        Fault::Error429 => {
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error").into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        Fault::MalformedJson => {
            let id = shape.map_or("mock", |s| s.id.as_str());
            let body = format!(
                "{{\"id\": \"{id}\", \"object\": \"chat.completion\", \"choices\": [{{\"index\": 0, \"message\": {{\"role\": \"assistant\", \"content\": \"tok0 tok1"
            );
            let mut r = Response::new(Body::from(body));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Fault::Hang => {
            tokio::select! {
                _ = tokio::time::sleep(HANG_FOR) => {}
                _ = app.0.shutdown.cancelled() => {}
            }
            error(StatusCode::SERVICE_UNAVAILABLE, "server_error").into_response()
        }
        Fault::MalformedSse | Fault::StallMidStream | Fault::DropMidStream => {
            let Some(shape) = shape else {
                return ApiError::bad_request(format!("{fault} is a streaming fault"))
                    .into_response();
            };
            let cfg = &app.0.cfg;
            let step = scaled(cfg.decode_base_ms, cfg.time_scale);
            let mut steps: Vec<Step> = shape.opening().into_iter().map(Step::Send).collect();
            for i in 0..FAULT_TOKENS {
                steps.push(Step::Sleep(step));
                steps.push(Step::Send(shape.token(i)));
            }
            match fault {
                Fault::MalformedSse => {
                    steps.push(Step::Send(Bytes::from_static(b"data: {not json\n\n")));
                }
                Fault::StallMidStream => steps.push(Step::WaitShutdown(app.0.shutdown.clone())),
                _ => {
                    // Let the server flush the last chunk before the connection is cut.
                    steps.push(Step::Sleep(DROP_FLUSH_PAUSE));
                    steps.push(Step::Fail);
                }
            }
            event_stream(scripted_body(steps))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Other routes

/// `GET /debug/sdk/requests`: the SDK tracker's last finished requests (oldest first), with
/// their phases in integer nanoseconds — what the OTLP spans carry.
async fn sdk_requests(State(app): State<App>) -> Response {
    let list: Vec<Value> = app.0.sdk_ring.lock().iter().cloned().collect();
    axum::Json(Value::Array(list)).into_response()
}

async fn embeddings(State(app): State<App>, headers: HeaderMap, body: Bytes) -> Response {
    match embeddings_inner(&app, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn embeddings_inner(
    app: &App,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let fault = parse_fault(headers)?;
    if let Some(f) = fault.filter(|f| f.is_stream_fault()) {
        return Err(ApiError::bad_request(format!(
            "{f} is a streaming fault; /v1/embeddings does not stream"
        )));
    }
    apply_delay(app, headers).await?;
    let cfg = &app.0.cfg;
    let o = parse_object(body)?;
    let input = o
        .get("input")
        .ok_or_else(|| ApiError::bad_request("'input' is required"))?;
    let prompt_tokens = prompt_like_tokens(input, "input")?;
    if let Some(f) = fault {
        return Ok(fault_response(app, f, None).await);
    }
    let inputs: Vec<String> = match input {
        Value::Array(items) if items.iter().all(|i| !i.is_u64()) => {
            items.iter().map(Value::to_string).collect()
        }
        other => vec![other.to_string()],
    };
    // A short, load-independent pause: one step plus prefill of the input.
    let pause = scaled(
        cfg.decode_base_ms + cfg.prefill_ms_per_token * prompt_tokens as f64,
        cfg.time_scale,
    );
    tokio::time::sleep(pause).await;
    app.0
        .stats
        .prompt_tokens
        .fetch_add(prompt_tokens, Ordering::Relaxed);
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            json!({"object": "embedding", "index": i, "embedding": embed(cfg.seed, text)})
        })
        .collect();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": model_of(&o, &cfg.model),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}

/// A deterministic unit vector for `text`.
fn embed(seed: u64, text: &str) -> Vec<f64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut r = SplitMix64::new(h);
    let v: Vec<f64> = (0..EMBEDDING_DIMS)
        .map(|_| r.next_f64() * 2.0 - 1.0)
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.into_iter().map(|x| x / norm).collect()
    } else {
        v
    }
}

async fn models(State(app): State<App>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": app.0.cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "tokenscope-mock",
        }],
    }))
    .into_response()
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(app): State<App>) -> Response {
    let mut text = app
        .0
        .stats
        .render(&app.0.cfg.model, app.0.cfg.slots, app.0.cfg.kv_tokens);
    // The SDK's engine-side request metrics (the gateway's names and buckets).
    text.push_str(&crate::sdk::render(&app.0.sdk_metrics));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

async fn tokenize_route(body: Bytes) -> Response {
    let result = parse_object(&body).and_then(|o| match o.get("content") {
        Some(Value::String(s)) => Ok(tokenize(s)),
        Some(_) => Err(ApiError::bad_request("'content' must be a string")),
        None => Err(ApiError::bad_request("'content' is required")),
    });
    match result {
        Ok(tokens) => axum::Json(json!({ "tokens": tokens })).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        message: "no such route".into(),
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(forced: Option<u64>, max: Option<u64>) -> GenRequest {
        GenRequest {
            model: "m".into(),
            stream: false,
            include_usage: false,
            max_tokens: max,
            forced_output: forced,
            prompt_tokens: 1,
        }
    }

    #[test]
    fn output_plan() {
        let cfg = MockConfig::default();
        assert_eq!(plan_output(&cfg, &req(Some(5), None), 0), (5, "stop"));
        assert_eq!(plan_output(&cfg, &req(Some(500), None), 0), (500, "stop"));
        assert_eq!(plan_output(&cfg, &req(Some(5), Some(10)), 0), (5, "stop"));
        assert_eq!(plan_output(&cfg, &req(Some(5), Some(5)), 0), (5, "length"));
        assert_eq!(plan_output(&cfg, &req(Some(5), Some(2)), 0), (2, "length"));
        for n in 0..200 {
            let (len, finish) = plan_output(&cfg, &req(None, None), n);
            assert!((1..=cfg.default_max_tokens).contains(&len));
            assert_eq!(finish == "length", len == cfg.default_max_tokens);
            let (len, finish) = plan_output(&cfg, &req(None, Some(3)), n);
            assert!(len <= 3);
            assert_eq!(finish == "length", len == 3);
        }
    }

    #[test]
    fn parses_requests() {
        let r = parse_gen(
            Kind::Chat,
            br#"{"messages":[{"role":"user","content":"hello there"}],"stream":true,
                "stream_options":{"include_usage":true},"max_completion_tokens":9,
                "mock_output_tokens":4}"#,
            "d",
        )
        .expect("valid");
        assert_eq!(r.model, "d");
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_tokens, Some(9));
        assert_eq!(r.forced_output, Some(4));
        assert_eq!(r.prompt_tokens, 4 + 2 + 2);
        let c = parse_gen(
            Kind::Completion,
            br#"{"prompt":["ab","cd"],"model":"x"}"#,
            "d",
        )
        .expect("valid");
        assert_eq!((c.prompt_tokens, c.model.as_str()), (2, "x"));
        let c = parse_gen(Kind::Completion, br#"{"prompt":[1,2,3]}"#, "d").expect("valid");
        assert_eq!(c.prompt_tokens, 3);
        for bad in [
            &b"not json"[..],
            b"[]",
            br#"{"model":"x"}"#,
            br#"{"messages":[]}"#,
            br#"{"messages":"hi"}"#,
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            br#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
        ] {
            let e = parse_gen(Kind::Chat, bad, "d").expect_err("invalid");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
        assert!(parse_gen(Kind::Completion, br#"{"prompt":{}}"#, "d").is_err());
    }

    #[test]
    fn embeddings_are_unit_and_deterministic() {
        let a = embed(1, "x");
        assert_eq!(a.len(), EMBEDDING_DIMS);
        assert_eq!(a, embed(1, "x"));
        assert_ne!(a, embed(1, "y"));
        let norm: f64 = a.iter().map(|v| v * v).sum();
        assert!((norm - 1.0).abs() < 1e-9);
    }
}
