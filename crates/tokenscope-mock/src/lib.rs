//! # tokenscope-mock
//!
//! A simulated, OpenAI-compatible inference engine for tests, demos and load. It speaks the same
//! HTTP shapes as llama.cpp / vLLM servers (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings`, the OpenAI Responses API `/v1/responses`, the Anthropic Messages API
//! `/v1/messages`, `/v1/models`, `/health`, `/metrics`, `/tokenize`) and produces *plausible,
//! per-request* latencies from a small continuous-batching model, so a gateway in front of it sees
//! queueing, prefill and decode phases that differ from request to request.
//!
//! ## The engine model
//!
//! One engine task runs a step loop (see [`MockConfig`] for the parameters):
//!
//! * Requests enter a FIFO **waiting** queue. At the start of every step, waiting requests are
//!   admitted into free **slots** (at most [`MockConfig::slots`] are running). A request's
//!   `scheduled_at` is the start of the step that admitted it.
//! * In a step, running requests that are still **prefilling** get a prefill chunk: they share
//!   [`MockConfig::max_prefill_tokens_per_step`] in FIFO (admission) order (chunked prefill).
//!   Running requests in **decode** get exactly one token.
//! * The step lasts `decode_base_ms + decode_ms_per_seq × (batch − 1) +
//!   prefill_ms_per_token × prefill_tokens_in_step` milliseconds, all multiplied by
//!   [`MockConfig::time_scale`]; `batch` is the number of sequences that do work in the step.
//!   The engine sleeps with `tokio::time::sleep` (never spins), so virtual time
//!   (`tokio::time::pause`) makes every duration exact in tests.
//! * At the end of the step, the step that completes a request's prefill also yields its first
//!   token (as real engines sample from the prefill logits); later steps yield one token each.
//!   Tokens go to the request's handler through a bounded per-request channel as each step ends.
//! * Each request keeps its **own** timestamps: `queued_at`, `scheduled_at`, `first_token_at`,
//!   `last_token_at`, `finished_at`. A long prompt prefilling in the same step inflates the TTFT
//!   of short requests beside it, and more running sequences make every decode step slower.
//! * A request whose receiver was dropped (client disconnected) is removed at the start of the
//!   next step, freeing its slot. A client that stops reading without disconnecting only stalls
//!   its own sequence once its channel is full (backpressure); the others keep going.
//! * When idle (nothing waiting or running), the engine awaits the next request.
//!
//! ## KV cache (optional)
//!
//! With [`MockConfig::kv_tokens`] `> 0` the engine models a KV cache of that many tokens:
//!
//! * a running sequence holds `prompt + generated` tokens of KV (its whole prompt is reserved
//!   at admission, as paged-attention engines allocate the prompt's blocks);
//! * admission (still FIFO, still at most `slots`) also waits while the cache cannot hold the
//!   next request's prompt — unless nothing is running, so a prompt larger than the cache still
//!   runs alone. Long contexts therefore keep batches small and requests queue;
//! * generated tokens are never refused (no preemption), so usage can briefly exceed the
//!   capacity; `/metrics` reports `min(used / capacity, 1)` as the KV usage in both the
//!   llama.cpp and vLLM gauges (without a KV model: occupied slots / slots, as before);
//! * every step also costs [`MockConfig::decode_ms_per_kv_token`] × the KV tokens of the
//!   sequences decoding in it (attention reads the whole context per generated token), so TPOT
//!   rises as contexts grow — a memory-bandwidth-bound decode.
//!
//! With the defaults (`kv_tokens = 0`, `decode_ms_per_kv_token = 0`) nothing of this applies.
//!
//! ## Output length
//!
//! * `"mock_output_tokens": N` in the request body forces the length: exactly `N` tokens, finish
//!   reason `"stop"` — unless `max_tokens` (or `max_completion_tokens`) `M ≤ N` is also given, in
//!   which case `M` tokens with `"length"`.
//! * Otherwise a *natural* length is drawn from a log-normal-ish distribution (median ≈ 120,
//!   σ ≈ 0.7 in log space, clamped to `1..=8192`) by a splitmix64 PRNG seeded with
//!   [`MockConfig::seed`] and the request's sequence number. The limit is `max_tokens` when
//!   given, else [`MockConfig::default_max_tokens`]; the request generates
//!   `min(natural, limit)` tokens, finishing `"length"` when `natural ≥ limit`, else `"stop"`.
//! * Output text is deterministic: token `i` (0-based) is the word `"tok{i} "`; one token per
//!   streamed chunk.
//!
//! ## The toy tokenizer ([`count_tokens`])
//!
//! Text is split on Unicode whitespace; each word counts `ceil(chars / 4)` tokens (at least 1).
//! Chat prompts add 4 tokens per message for the role/template. `/tokenize` returns exactly
//! [`count_tokens`] ids (one per 4-character piece of each word). A prompt is always prefilled as
//! at least one token.
//!
//! ## Responses
//!
//! Non-streaming responses carry `usage` (with `prompt_tokens_details.cached_tokens: 0`) and a
//! llama.cpp-style `timings` object: `prompt_ms` = scheduled → first token, `predicted_ms` =
//! first → last token, both in real (time-scaled) milliseconds for *this* request;
//! `predicted_per_token_ms = predicted_ms / predicted_n` as llama.cpp computes it.
//!
//! Streaming (`"stream": true`) sends, for chat: a role chunk
//! (`{"role":"assistant","content":""}`), one chunk per token, a chunk with an empty delta and
//! `finish_reason`, then — only with `stream_options.include_usage` — a chunk with
//! `"choices": []`, `usage` and `timings`, then `data: [DONE]`. Without `include_usage` the
//! `timings` ride on the `finish_reason` chunk, like llama.cpp. `/v1/completions` streams
//! `text_completion` chunks (choices carry `text`) and has no role chunk.
//!
//! `/v1/responses` (`input`: a string or message items, `instructions`, `max_output_tokens`) and
//! `/v1/messages` (`messages`, `system`, `max_tokens`) count their prompt like chat (the system
//! prompt is one more message). Their streams name every event (`event:` line) as llama.cpp does:
//! `response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, one `response.output_text.delta` per token, the `….done`
//! events and `response.completed` (`response.incomplete` at the limit) with the usage and,
//! beside the response, llama.cpp-style `timings`; `message_start` (input usage, output 1),
//! `content_block_start`, `ping`, one `content_block_delta` per token, `content_block_stop`,
//! `message_delta` (`stop_reason` `end_turn` / `max_tokens`, output usage), `message_stop`.
//! No `[DONE]`; cache counts are 0. Their bodies are the API's response objects.
//!
//! ## Fault injection
//!
//! The header `x-mock-fault` selects a [`Fault`] (see [`Fault::NAMES`]) for the inference
//! endpoints; an unknown name is a 400. `x-mock-delay-ms: N` waits N real milliseconds before the
//! request is processed (not counted as queue time).
//!
//! ## SDK (phase accounting, OTLP)
//!
//! The engine's phases are computed by the `tokenscope-sdk` tracker (the mock is its dog
//! food): arrival = the request's `queued_at`, scheduled at the start of the admitting step,
//! each step reported with its per-request work (prefill chunk or decode token), finish at the
//! step that produced the last token. `timings` (`prompt_ms` = the SDK's prefill,
//! `predicted_ms` = its decode) come from the tracker's integer nanoseconds. The last 10 000
//! finished requests are served at `GET /debug/sdk/requests` (phases in ns, trace id, request
//! id), and `/metrics` also carries the SDK's engine-side `llm_*` request metrics (the gateway's
//! names, labels and buckets; `user_bucket="anonymous"`). With [`MockConfig::otlp_endpoint`], every request that arrived with a valid
//! `traceparent` is exported as a vLLM-style `llm_request` span (parent = the caller's span),
//! so a tokenscope gateway in front joins the engine-side queue/prefill/decode into its record.
//!
//! ## Invariants
//!
//! * Timestamps of every request are ordered: `queued ≤ scheduled ≤ first ≤ last ≤ finished`.
//! * `usage.completion_tokens` = number of streamed token chunks = `timings.predicted_n`.
//! * No input-dependent path panics; malformed requests get an OpenAI error JSON (400).
//! * Shutdown (of [`serve`]) ends `hang` and `stall_mid_stream` requests; other in-flight
//!   requests complete.
#![deny(missing_docs)]

mod engine;
mod fault;
mod http;
mod metrics;
mod rng;
mod sdk;
mod tokenizer;

pub use fault::{Fault, UnknownFault};
pub use tokenizer::{count_tokens, tokenize};

/// Request header selecting a [`Fault`] by name (see [`Fault::NAMES`]).
pub const FAULT_HEADER: &str = "x-mock-fault";
/// Request header adding a delay of N real milliseconds before the request is processed.
pub const DELAY_HEADER: &str = "x-mock-delay-ms";
/// Request body field forcing the exact output length (see the crate docs).
pub const OUTPUT_TOKENS_FIELD: &str = "mock_output_tokens";

use std::future::Future;
use tokio_util::sync::CancellationToken;

/// Parameters of the simulated engine. See the crate docs for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct MockConfig {
    /// Parallel decode slots (continuous batching). Default 8.
    pub slots: usize,
    /// Seed of the output-length PRNG. Default 42.
    pub seed: u64,
    /// Multiplies every simulated duration; `0.1` runs 10× faster. Default 1.0.
    pub time_scale: f64,
    /// Model id reported when the request names none. Default `"mock-llm"`.
    pub model: String,
    /// Prefill cost per input token, ms. Default 0.05.
    pub prefill_ms_per_token: f64,
    /// One decode step with a batch of one, ms. Default 8.0.
    pub decode_base_ms: f64,
    /// Each extra sequence in a step adds this, ms. Default 0.5.
    pub decode_ms_per_seq: f64,
    /// Chunked-prefill budget per step, tokens. Default 512.
    pub max_prefill_tokens_per_step: usize,
    /// Output limit when the request has no `max_tokens`. Default 256.
    pub default_max_tokens: u64,
    /// KV-cache capacity in tokens; 0 = unlimited (no KV model, the default). See the crate
    /// docs, "KV cache".
    pub kv_tokens: u64,
    /// Decode cost per KV token resident in the sequences decoding in a step, ms
    /// (memory-bandwidth-bound attention). Default 0.
    pub decode_ms_per_kv_token: f64,
    /// OTLP endpoint (`http://host:4318`, or a tokenscope gateway's admin listener) that
    /// receives one `llm_request` span per request that came with a `traceparent`, with the
    /// SDK's `gen_ai.latency.*` phases. Default `None` (off). See the crate docs, "SDK".
    pub otlp_endpoint: Option<String>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            slots: 8,
            seed: 42,
            time_scale: 1.0,
            model: "mock-llm".to_owned(),
            prefill_ms_per_token: 0.05,
            decode_base_ms: 8.0,
            decode_ms_per_seq: 0.5,
            max_prefill_tokens_per_step: 512,
            default_max_tokens: 256,
            kv_tokens: 0,
            decode_ms_per_kv_token: 0.0,
            otlp_endpoint: None,
        }
    }
}

impl MockConfig {
    /// Checks that the parameters describe a runnable engine: at least one slot, a positive
    /// prefill budget, and finite, non-negative time parameters.
    pub fn validate(&self) -> Result<(), MockError> {
        let bad = |what: &str| Err(MockError::InvalidConfig(what.to_owned()));
        if self.slots == 0 {
            return bad("slots must be at least 1");
        }
        if self.max_prefill_tokens_per_step == 0 {
            return bad("max_prefill_tokens_per_step must be at least 1");
        }
        for (name, v) in [
            ("time_scale", self.time_scale),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("decode_base_ms", self.decode_base_ms),
            ("decode_ms_per_seq", self.decode_ms_per_seq),
            ("decode_ms_per_kv_token", self.decode_ms_per_kv_token),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(&format!("{name} must be finite and non-negative, got {v}"));
            }
        }
        Ok(())
    }

    /// A copy with out-of-range values replaced by the nearest usable ones (used by [`router`],
    /// which cannot fail).
    fn sanitized(&self) -> Self {
        let fix = |v: f64, default: f64| {
            if v.is_finite() && v >= 0.0 {
                v
            } else {
                default
            }
        };
        let d = Self::default();
        Self {
            slots: self.slots.max(1),
            max_prefill_tokens_per_step: self.max_prefill_tokens_per_step.max(1),
            time_scale: fix(self.time_scale, d.time_scale),
            prefill_ms_per_token: fix(self.prefill_ms_per_token, d.prefill_ms_per_token),
            decode_base_ms: fix(self.decode_base_ms, d.decode_base_ms),
            decode_ms_per_seq: fix(self.decode_ms_per_seq, d.decode_ms_per_seq),
            decode_ms_per_kv_token: fix(self.decode_ms_per_kv_token, d.decode_ms_per_kv_token),
            ..self.clone()
        }
    }
}

/// Errors of [`serve`].
#[derive(Debug, thiserror::Error)]
pub enum MockError {
    /// The configuration cannot run (see [`MockConfig::validate`]).
    #[error("invalid mock configuration: {0}")]
    InvalidConfig(String),
    /// The HTTP server failed.
    #[error("mock server I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves the mock engine on `listener` until `shutdown` completes.
///
/// On shutdown the server stops accepting connections, ends `hang` and `stall_mid_stream`
/// requests, lets other in-flight requests finish, and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: MockConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MockError> {
    cfg.validate()?;
    let token = CancellationToken::new();
    let _cancel_on_exit = token.clone().drop_guard();
    let app = http::app(cfg, token.clone());
    let signal = async move {
        shutdown.await;
        token.cancel();
    };
    // TCP_NODELAY: SSE events are small writes; without it Nagle's algorithm holds each one
    // until the client's delayed ACK (~40 ms) on a reused connection.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(signal)
        .await?;
    Ok(())
}

/// [`serve`] behind TLS: the same engine on `tls_listener`, every connection a TLS session
/// with `tls` (`tokenscope_net::server_config`: the mock's certificate, optionally requiring
/// client certificates), and also in the clear on `plain` when given — one engine behind both
/// (the same batches, slots and metrics), so plain and TLS clients can be compared against
/// it. Handshakes run beside the engine; a failed one closes only its connection.
pub async fn serve_tls(
    tls_listener: tokio::net::TcpListener,
    tls: std::sync::Arc<tokenscope_net::rustls::ServerConfig>,
    plain: Option<tokio::net::TcpListener>,
    cfg: MockConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), MockError> {
    cfg.validate()?;
    let token = CancellationToken::new();
    let _cancel_on_exit = token.clone().drop_guard();
    let app = http::app(cfg, token.clone());
    let stop = token.clone();
    tokio::spawn(async move {
        shutdown.await;
        stop.cancel();
    });
    // TCP_NODELAY is set on every accepted socket by the TLS listener.
    let secure = axum::serve(
        tokenscope_net::TlsListener::new(tls_listener, tls)?,
        app.clone(),
    )
    .with_graceful_shutdown(token.clone().cancelled_owned());
    match plain {
        None => secure.await?,
        Some(listener) => {
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let clear = axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned());
            tokio::try_join!(
                std::future::IntoFuture::into_future(secure),
                std::future::IntoFuture::into_future(clear)
            )?;
        }
    }
    Ok(())
}

/// The same application as [`serve`], for embedding in another server or test harness.
///
/// Invalid parameters are replaced by usable ones (see [`MockConfig::validate`] to check first).
/// The engine task starts on the first inference request (inside the caller's Tokio runtime) and
/// ends when the router and all its clones are dropped and no request is left. Without [`serve`]
/// there is no shutdown signal: `hang` waits one hour and `stall_mid_stream` stays open until the
/// client goes away.
pub fn router(cfg: MockConfig) -> axum::Router {
    http::app(cfg.sanitized(), CancellationToken::new())
}
