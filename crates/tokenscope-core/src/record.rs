//! The per-request record: exactly one is produced for every request the gateway measures,
//! whatever happens to it (success, upstream failure, timeout, client disconnect).
//!
//! Column names follow the article's `llm_inference_log` (`request_id, user_id, model,
//! request_type, input_tokens, output_tokens, queue_duration_ms, prefill_duration_ms,
//! decode_duration_ms, ttft_ms, tpot_ms, total_duration_ms, created_at`) and extend it.
//! Durations are milliseconds as `f64` (microsecond resolution), measured on the monotonic
//! clock; `created_at` is the only wall-clock value (Unix epoch, microseconds).

use serde::{Deserialize, Serialize};

/// How a request ended, from the point of view of the person who sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The upstream answered 2xx and the response was delivered completely.
    #[default]
    Ok,
    /// The request was rejected because of the client (4xx other than 429, body too large).
    ClientError,
    /// The upstream failed: unreachable, 5xx, 429, or a malformed response.
    UpstreamError,
    /// The upstream did not answer (or stalled mid-stream) within the configured timeout.
    Timeout,
    /// The client went away before the response was complete.
    Cancelled,
    /// The gateway shut down before the response was complete (cut at the end of
    /// `shutdown_grace_ms`; the record has the tokens seen so far).
    Shutdown,
}

impl Outcome {
    /// Every variant, in a stable order.
    pub const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::ClientError,
        Outcome::UpstreamError,
        Outcome::Timeout,
        Outcome::Cancelled,
        Outcome::Shutdown,
    ];

    /// The stable lower-case name used in the store and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ClientError => "client_error",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Shutdown => "shutdown",
        }
    }

    /// Parses [`Outcome::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// The measured endpoint (other paths are passed through unmeasured): the OpenAI-compatible
/// ones, OpenAI's Responses API and Anthropic's Messages API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `/v1/chat/completions`
    #[default]
    ChatCompletions,
    /// `/v1/completions`
    Completions,
    /// `/v1/embeddings`
    Embeddings,
    /// `/v1/responses` (OpenAI Responses API)
    Responses,
    /// `/v1/messages` (Anthropic Messages API)
    Messages,
}

impl Endpoint {
    /// Every variant, in a stable order.
    pub const ALL: [Endpoint; 5] = [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Embeddings,
        Endpoint::Responses,
        Endpoint::Messages,
    ];

    /// Maps a request path to a measured endpoint.
    pub fn from_path(path: &str) -> Option<Self> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" | "/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" | "/completions" => Some(Endpoint::Completions),
            "/v1/embeddings" | "/embeddings" => Some(Endpoint::Embeddings),
            "/v1/responses" | "/responses" => Some(Endpoint::Responses),
            "/v1/messages" | "/messages" => Some(Endpoint::Messages),
            _ => None,
        }
    }

    /// Stable name stored in the `endpoint` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }

    /// Parses [`Endpoint::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == s)
    }

    /// The default `request_type` when the caller did not set one (the OpenTelemetry GenAI
    /// operation name: both the Responses and the Messages API are `chat`).
    pub fn default_request_type(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages => "chat",
            Endpoint::Completions => "text_completion",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// Whether a stream of this endpoint reports usage only when asked with
    /// `stream_options.include_usage` (the OpenAI-compatible endpoints). The Responses and
    /// Messages APIs always send it (`response.completed`, `message_start` / `message_delta`)
    /// and know no such option.
    pub fn usage_on_request(self) -> bool {
        matches!(self, Endpoint::ChatCompletions | Endpoint::Completions)
    }
}

/// Where a token count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// The engine's `usage` object (authoritative).
    Usage,
    /// Engine-specific fields other than `usage` (llama.cpp `timings`, TGI headers).
    Engine,
    /// Counted by the gateway with the model's tokenizer.
    Tokenizer,
    /// Counted from streamed chunks (one content-bearing chunk ≈ one token).
    Chunks,
    /// Estimated from text length (≈ 4 bytes per token).
    Estimate,
    /// Unknown.
    #[default]
    None,
}

impl TokenSource {
    /// Stable name stored in the `*_tokens_source` columns.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenSource::Usage => "usage",
            TokenSource::Engine => "engine",
            TokenSource::Tokenizer => "tokenizer",
            TokenSource::Chunks => "chunks",
            TokenSource::Estimate => "estimate",
            TokenSource::None => "none",
        }
    }

    /// Parses [`TokenSource::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        [
            TokenSource::Usage,
            TokenSource::Engine,
            TokenSource::Tokenizer,
            TokenSource::Chunks,
            TokenSource::Estimate,
            TokenSource::None,
        ]
        .into_iter()
        .find(|t| t.as_str() == s)
    }
}

/// Where a phase duration (queue, prefill, decode) came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PhaseSource {
    /// Reported by the engine for this very request, in its response (vLLM's `metrics`,
    /// llama.cpp's `timings`, TGI's headers) or by the engine-side SDK.
    Engine,
    /// Reported by the engine for this very request in its own trace span (vLLM / SGLang OTLP
    /// `gen_ai.latency.*`), joined to the record by trace id after the response. When the
    /// response carried the same phase too, the span's value replaces it and the source says
    /// so (on vLLM 0.32 both are the same engine timestamps: checked on the real server,
    /// `tests/real_vllm.rs`).
    EngineSpan,
    /// Derived by the gateway from other measurements (e.g. TTFT − prefill).
    Derived,
    /// Not known.
    #[default]
    None,
}

impl PhaseSource {
    /// Stable name stored in the `*_source` columns.
    pub fn as_str(self) -> &'static str {
        match self {
            PhaseSource::Engine => "engine",
            PhaseSource::EngineSpan => "engine_span",
            PhaseSource::Derived => "derived",
            PhaseSource::None => "none",
        }
    }

    /// Parses [`PhaseSource::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        [
            PhaseSource::Engine,
            PhaseSource::EngineSpan,
            PhaseSource::Derived,
            PhaseSource::None,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
    }
}

/// Input-length bucket, the article's four classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum InputBucket {
    /// 0–127 input tokens.
    #[serde(rename = "0-128")]
    B0To128,
    /// 128–511 input tokens.
    #[serde(rename = "128-512")]
    B128To512,
    /// 512–2047 input tokens.
    #[serde(rename = "512-2048")]
    B512To2048,
    /// 2048 and more input tokens.
    #[serde(rename = "2048+")]
    B2048Plus,
}

impl InputBucket {
    /// Every bucket, shortest first.
    pub const ALL: [InputBucket; 4] = [
        InputBucket::B0To128,
        InputBucket::B128To512,
        InputBucket::B512To2048,
        InputBucket::B2048Plus,
    ];

    /// The bucket of a given input-token count. Lower bounds are inclusive:
    /// 127 → `0-128`, 128 → `128-512`.
    pub fn of(input_tokens: u64) -> Self {
        match input_tokens {
            0..=127 => InputBucket::B0To128,
            128..=511 => InputBucket::B128To512,
            512..=2047 => InputBucket::B512To2048,
            _ => InputBucket::B2048Plus,
        }
    }

    /// Parses [`InputBucket::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == s)
    }

    /// The label value (`0-128`, `128-512`, `512-2048`, `2048+`).
    pub fn as_str(self) -> &'static str {
        match self {
            InputBucket::B0To128 => "0-128",
            InputBucket::B128To512 => "128-512",
            InputBucket::B512To2048 => "512-2048",
            InputBucket::B2048Plus => "2048+",
        }
    }
}

/// One row per request. See the module docs for units.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct RequestRecord {
    /// The gateway's own id of this request (a UUIDv7), the store's key. Never taken from
    /// the client: a client's id is data ([`client_request_id`](Self::client_request_id)),
    /// so that a reused or forged id can neither collapse rows nor suppress another
    /// client's row.
    pub request_id: String,
    /// W3C trace id (32 lower-case hex digits).
    pub trace_id: String,
    /// Wall-clock arrival time, Unix epoch microseconds.
    pub created_at: i64,
    /// The model the client asked for (`model` in the request body).
    pub model: String,
    /// The model the engine says it served (`model` in the response), when known.
    pub model_served: Option<String>,
    /// Name of the upstream the request was routed to.
    pub upstream: String,
    /// The replica of the upstream that served the request (the last one tried when it
    /// failed): its URL's `host:port`, never userinfo. Empty when no replica was chosen (no
    /// upstream, or a failure before routing).
    #[serde(default)]
    pub replica: String,
    /// End user (header `x-tokenscope-user`, else the body's `user` field).
    pub user_id: Option<String>,
    /// Tenant (header `x-tokenscope-tenant`, else the API-key map).
    pub tenant: Option<String>,
    /// Business line (header `x-tokenscope-business-line`, else the API-key map).
    pub business_line: Option<String>,
    /// Request type (header `x-tokenscope-request-type`, else derived from the endpoint).
    pub request_type: String,
    /// A short, non-reversible fingerprint of the API key used (never the key itself).
    pub api_key_id: Option<String>,
    /// The measured endpoint.
    pub endpoint: Endpoint,
    /// Whether the client asked for a streamed response.
    pub stream: bool,
    /// HTTP status returned to the client.
    pub http_status: u16,
    /// How the request ended.
    pub outcome: Outcome,
    /// A low-cardinality error class when `outcome != ok`.
    pub error_type: Option<String>,
    /// `finish_reason` of the (first) choice, in chat's words (`stop`, `length`, `tool_calls`,
    /// `content_filter`): the Responses and Messages APIs' reasons are mapped onto them (see
    /// [`crate::responses`], [`crate::messages`]).
    pub finish_reason: Option<String>,
    /// `max_tokens` / `max_completion_tokens` the client asked for.
    pub max_tokens: Option<u64>,
    /// Prompt tokens (including cached ones).
    pub input_tokens: Option<u64>,
    /// Completion tokens (including reasoning ones).
    pub output_tokens: Option<u64>,
    /// Prompt tokens served from the engine's prefix/KV cache.
    pub cached_tokens: Option<u64>,
    /// Prompt tokens written to the engine's prompt cache (Anthropic
    /// `cache_creation_input_tokens`).
    #[serde(default)]
    pub cache_creation_tokens: Option<u64>,
    /// Reasoning tokens inside `output_tokens`.
    pub reasoning_tokens: Option<u64>,
    /// Where `input_tokens` came from.
    pub input_tokens_source: TokenSource,
    /// Where `output_tokens` came from.
    pub output_tokens_source: TokenSource,
    /// Input-length bucket of `input_tokens` (or the entry estimate when unknown).
    pub input_bucket: Option<InputBucket>,
    /// Time queued in the engine before scheduling.
    pub queue_duration_ms: Option<f64>,
    /// Prefill time (scheduled → first token) in the engine.
    pub prefill_duration_ms: Option<f64>,
    /// Decode time (first → last token) in the engine.
    pub decode_duration_ms: Option<f64>,
    /// Source of `queue_duration_ms`.
    pub queue_source: PhaseSource,
    /// Source of `prefill_duration_ms`.
    pub prefill_source: PhaseSource,
    /// Source of `decode_duration_ms`.
    pub decode_source: PhaseSource,
    /// Time to first token: arrival at the gateway → first content-bearing chunk.
    pub ttft_ms: Option<f64>,
    /// Time per output token: `(t_last − t_first)/(n_out − 1)`, `n_out ≥ 2` only.
    pub tpot_ms: Option<f64>,
    /// Largest gap between two consecutive content-bearing chunks.
    pub itl_max_ms: Option<f64>,
    /// Mean gap between two consecutive content-bearing chunks.
    pub itl_mean_ms: Option<f64>,
    /// Arrival → last byte delivered (or failure / cancellation).
    pub total_duration_ms: f64,
    /// Arrival → upstream response headers.
    pub upstream_headers_ms: Option<f64>,
    /// Time spent in the gateway itself before the request left for the upstream.
    pub gateway_overhead_ms: Option<f64>,
    /// Number of content-bearing chunks streamed to the client.
    pub chunks: Option<u64>,
    /// Hex SHA-256 (first 16 bytes) of the normalised prompt.
    pub prompt_hash: Option<String>,
    /// The prompt text, only when `store_prompts = true` in the config.
    pub prompt_text: Option<String>,
    /// Speculative decoding: draft tokens proposed (llama.cpp `draft_n`).
    pub draft_tokens: Option<u64>,
    /// Speculative decoding: draft tokens accepted (llama.cpp `draft_n_accepted`).
    pub draft_accepted_tokens: Option<u64>,
    /// Which engine adapter read this response (`llamacpp`, `vllm`, `tgi`, `sglang`, `openai`).
    pub engine: Option<String>,
    /// Input tokens counted at the entry with the model's own tokenizer (or the engine's
    /// `/tokenize`), before the engine answered.
    pub input_tokens_entry: Option<u64>,
    /// Engine state at this request's arrival: requests running.
    pub engine_running: Option<f64>,
    /// Engine state at this request's arrival: requests waiting.
    pub engine_waiting: Option<f64>,
    /// Engine state at this request's arrival: KV-cache usage, 0–1.
    pub engine_kv_usage: Option<f64>,
    /// GPU state at this request's arrival: utilisation, 0–1 (mean over the engine's GPUs).
    pub gpu_utilization: Option<f64>,
    /// GPU state at this request's arrival: memory-bandwidth utilisation, 0–1.
    pub gpu_memory_bandwidth: Option<f64>,
    /// Cost of this request in USD at the prices configured when it finished (`[[prices]]`:
    /// token prices, or a self-hosted model's GPU hourly cost spread over the tokens its
    /// model served recently); `None` = the model has no price (never 0 for "unknown").
    pub cost_usd: Option<f64>,
    /// The client's own `x-request-id` when it sent a valid one (forwarded to the engine and
    /// echoed back unchanged); `None` when it sent none. Not unique: searchable, never a key.
    #[serde(default)]
    pub client_request_id: Option<String>,
    /// Blame: how many other requests were in prefill on this request's replica while it
    /// waited for its first token (see the gateway's `blame` module for the definitions).
    /// `None` when not measured (no replica, or no known end of the wait); `Some(0)`: it
    /// waited behind nobody.
    #[serde(default)]
    pub blocked_by_requests: Option<u64>,
    /// Blame: the prompt tokens of those requests.
    #[serde(default)]
    pub blocked_by_prompt_tokens: Option<u64>,
    /// Blame: the part of this request's wait (ms) during which at least one of them was in
    /// prefill.
    #[serde(default)]
    pub blocked_ms: Option<f64>,
    /// Blame: the largest of them (most prompt tokens): its request id.
    #[serde(default)]
    pub blocker_request_id: Option<String>,
    /// Blame: the largest blocker's caller (`user_id`, else `key:<api_key_id>`, else
    /// `tenant:<tenant>`).
    #[serde(default)]
    pub blocker_caller: Option<String>,
    /// Blame: the largest blocker's business line.
    #[serde(default)]
    pub blocker_business_line: Option<String>,
    /// Blame: the largest blocker's prompt tokens.
    #[serde(default)]
    pub blocker_prompt_tokens: Option<u64>,
    /// Similarity sketch of the normalised prompt ([`crate::prompt::prompt_sketch`]: SimHash
    /// of its word shingles, numbers masked): near-identical prompts are a few bits apart.
    /// Never the text.
    #[serde(default)]
    pub prompt_sketch: Option<u64>,
    /// The part of TTFT the engine did not account for, ms: TTFT − the gateway's own time −
    /// the engine's **reported** queue and prefill (network, the engine's HTTP front end,
    /// tokenisation, waiting for the engine's current step to end). See
    /// [`RequestRecord::split_times`]. `None` when not computable or when the engine's numbers
    /// exceed what the gateway saw ([`RequestRecord::engine_timing`]).
    #[serde(default)]
    pub ttft_unaccounted_ms: Option<f64>,
    /// The same for the end to end: total − gateway time − the engine's reported queue,
    /// prefill and decode, ms.
    #[serde(default)]
    pub e2e_unaccounted_ms: Option<f64>,
    /// Whether the engine's reported phases are this request's own and fit what the gateway
    /// measured: `consistent`; `per_step` (identical, to the bit, to those of another request
    /// of the same engine step on the same replica: the step's times, shared by its requests,
    /// not per-request truth — [`RequestRecord::mark_per_step`]); `exceeds_gateway` (they add
    /// up to more than the gateway's TTFT / end to end: not this request's truth); `None` when
    /// the engine reported none.
    #[serde(default)]
    pub engine_timing: Option<String>,
}

/// Tolerance of [`RequestRecord::split_times`]: engine phases may exceed the gateway's
/// window by this much (clock rounding) and still be consistent, ms.
pub const SPLIT_TOLERANCE_MS: f64 = 1.0;

/// `engine_timing` of a record whose engine values are identical to another request's of the
/// same engine step: the step's numbers, not this request's own ([`RequestRecord::mark_per_step`]).
pub const ENGINE_TIMING_PER_STEP: &str = "per_step";

/// Engine-side phase values that arrive after the response (OTLP spans from vLLM or SGLang),
/// joined to the record by trace id. `None` fields leave the stored value unchanged.
/// What a `Some` field does is [`RequestRecord::apply_update`]'s rule, the only statement of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PhaseUpdate {
    /// Trace id (32 lower-case hex) shared by the gateway's record and the engine's span.
    pub trace_id: String,
    /// Engine queue time, ms.
    pub queue_duration_ms: Option<f64>,
    /// Engine prefill time, ms.
    pub prefill_duration_ms: Option<f64>,
    /// Engine decode time, ms.
    pub decode_duration_ms: Option<f64>,
    /// Engine-side prompt tokens (see [`RequestRecord::apply_update`]).
    pub input_tokens: Option<u64>,
    /// Engine-side completion tokens (see [`RequestRecord::apply_update`]).
    pub output_tokens: Option<u64>,
    /// The record's engine values were found identical to another request's of the same
    /// engine step (the gateway's per-replica board): `engine_timing` becomes `per_step`.
    /// `false` leaves it as it is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub per_step: bool,
}

/// The largest token count an update may carry: every store keeps counts as signed 64-bit
/// integers, and no engine counts anywhere near this. A larger count is garbage and dropped by
/// [`PhaseUpdate::sanitized`].
pub const MAX_UPDATE_TOKENS: u64 = i64::MAX as u64;

impl PhaseUpdate {
    /// The update with every value no store may take set to `None`: a duration that is not a
    /// finite, non-negative number of milliseconds, a token count above
    /// [`MAX_UPDATE_TOKENS`]. Applying and merging go through this, so a bad value never
    /// overwrites a good one, neither in a row nor in a merge.
    pub fn sanitized(&self) -> PhaseUpdate {
        let ms = |v: Option<f64>| v.filter(|m| m.is_finite() && *m >= 0.0);
        let tokens = |v: Option<u64>| v.filter(|n| *n <= MAX_UPDATE_TOKENS);
        PhaseUpdate {
            trace_id: self.trace_id.clone(),
            queue_duration_ms: ms(self.queue_duration_ms),
            prefill_duration_ms: ms(self.prefill_duration_ms),
            decode_duration_ms: ms(self.decode_duration_ms),
            input_tokens: tokens(self.input_tokens),
            output_tokens: tokens(self.output_tokens),
            per_step: self.per_step,
        }
    }

    /// Merges a `newer` update for the same trace into this one, field by field: a `Some`
    /// (after [sanitising](Self::sanitized)) replaces, `None` keeps. The trace id is kept.
    pub fn merge(&mut self, newer: &PhaseUpdate) {
        fn pick<T: Copy>(old: &mut Option<T>, new: Option<T>) {
            if new.is_some() {
                *old = new;
            }
        }
        let newer = newer.sanitized();
        pick(&mut self.queue_duration_ms, newer.queue_duration_ms);
        pick(&mut self.prefill_duration_ms, newer.prefill_duration_ms);
        pick(&mut self.decode_duration_ms, newer.decode_duration_ms);
        pick(&mut self.input_tokens, newer.input_tokens);
        pick(&mut self.output_tokens, newer.output_tokens);
        self.per_step |= newer.per_step;
    }
}

impl RequestRecord {
    /// Splits TTFT and the end to end into parts that add up to them: **the** rule, applied
    /// by the gateway when a record is finished and again after each late engine update.
    ///
    /// TTFT = gateway + unaccounted + engine queue + engine prefill, where *gateway* is
    /// `gateway_overhead_ms`, the engine parts count only when the engine reported them
    /// ([`PhaseSource::Engine`] / [`PhaseSource::EngineSpan`]; a queue the gateway derived is
    /// not an engine number: then the whole time before the engine's prefill is unaccounted),
    /// and *unaccounted* is the rest: the time before the engine accounts for the request
    /// (network, its HTTP front end, tokenisation, waiting for its current step). The end to
    /// end likewise with the engine's decode. The TTFT split needs a gateway TTFT (a streamed
    /// request) and the engine's prefill; the end-to-end split the engine's prefill and decode.
    ///
    /// When the engine's parts exceed the gateway's measure by more than
    /// [`SPLIT_TOLERANCE_MS`], they cannot be this request's own numbers: `engine_timing` is
    /// `exceeds_gateway` and the unaccounted parts are `None` (nothing is presented as
    /// per-request truth). Within the tolerance the unaccounted part is clamped at 0, so the
    /// parts sum to the whole within 1 ms.
    pub fn split_times(&mut self) {
        let engine = |v: Option<f64>, s: PhaseSource| {
            v.filter(|_| matches!(s, PhaseSource::Engine | PhaseSource::EngineSpan))
        };
        let q = engine(self.queue_duration_ms, self.queue_source);
        let p = engine(self.prefill_duration_ms, self.prefill_source);
        let d = engine(self.decode_duration_ms, self.decode_source);
        let gw = self.gateway_overhead_ms.unwrap_or(0.0);
        let rest = |whole: f64, parts: f64| -> Result<f64, ()> {
            let r = whole - gw - parts;
            if r < -SPLIT_TOLERANCE_MS {
                Err(())
            } else {
                Ok(r.max(0.0))
            }
        };
        let mut exceeds = false;
        self.ttft_unaccounted_ms = match (self.ttft_ms, p) {
            (Some(t), Some(p)) => match rest(t, q.unwrap_or(0.0) + p) {
                Ok(r) => Some(r),
                Err(()) => {
                    exceeds = true;
                    None
                }
            },
            _ => None,
        };
        self.e2e_unaccounted_ms = match (p, d) {
            (Some(p), Some(d)) => match rest(self.total_duration_ms, q.unwrap_or(0.0) + p + d) {
                Ok(r) => Some(r),
                Err(()) => {
                    exceeds = true;
                    None
                }
            },
            _ => None,
        };
        let per_step = self.engine_timing.as_deref() == Some(ENGINE_TIMING_PER_STEP);
        self.engine_timing = if q.or(p).or(d).is_none() {
            None
        } else if exceeds {
            Some("exceeds_gateway".to_owned())
        } else if per_step {
            Some(ENGINE_TIMING_PER_STEP.to_owned())
        } else {
            Some("consistent".to_owned())
        };
    }

    /// Marks the record's engine values as per step, not per request (identical to another
    /// request's of the same engine step): `engine_timing = per_step` while they are
    /// consistent with the gateway's measure (`exceeds_gateway` stays the stronger statement).
    /// Kept by every later [`Self::split_times`].
    pub fn mark_per_step(&mut self) {
        if self.engine_timing.as_deref() == Some("consistent") {
            self.engine_timing = Some(ENGINE_TIMING_PER_STEP.to_owned());
        }
    }

    /// `true` for the `ok` outcome.
    pub fn is_success(&self) -> bool {
        self.outcome == Outcome::Ok
    }

    /// Applies late engine values: **the** rule every store and the gateway share (SQLite and
    /// ClickHouse read the row, call this, and write the row back; see
    /// `tokenscope_store::late`).
    ///
    /// * The update is [sanitised](PhaseUpdate::sanitized) first: a bad value is ignored.
    /// * Every `Some` phase (queue, prefill, decode) replaces the stored one, and its source
    ///   becomes [`PhaseSource::EngineSpan`] (the engine's span is the later, per-request
    ///   statement of the same engine clock; a response's value it replaces is kept nowhere).
    /// * An engine token count replaces the gateway's own — a missing count, an estimate, a
    ///   chunk count, a tokenizer count — but never a [`TokenSource::Usage`] or
    ///   [`TokenSource::Engine`] count; the source becomes `engine`, and the input bucket
    ///   follows a replaced input count. (So the first engine count a row gets stays.)
    /// * The TTFT / end-to-end split is recomputed ([`RequestRecord::split_times`]).
    /// * Idempotent: applying the same update twice gives the same record.
    pub fn apply_update(&mut self, u: &PhaseUpdate) {
        let u = u.sanitized();
        for (val, dst, src) in [
            (
                u.queue_duration_ms,
                &mut self.queue_duration_ms,
                &mut self.queue_source,
            ),
            (
                u.prefill_duration_ms,
                &mut self.prefill_duration_ms,
                &mut self.prefill_source,
            ),
            (
                u.decode_duration_ms,
                &mut self.decode_duration_ms,
                &mut self.decode_source,
            ),
        ] {
            if let Some(v) = val {
                *dst = Some(v);
                *src = PhaseSource::EngineSpan;
            }
        }
        let replaceable = |count: Option<u64>, source: TokenSource| {
            count.is_none() || !matches!(source, TokenSource::Usage | TokenSource::Engine)
        };
        if u.input_tokens.is_some() && replaceable(self.input_tokens, self.input_tokens_source) {
            self.input_tokens = u.input_tokens;
            self.input_tokens_source = TokenSource::Engine;
            self.input_bucket = self.input_tokens.map(InputBucket::of);
        }
        if u.output_tokens.is_some() && replaceable(self.output_tokens, self.output_tokens_source) {
            self.output_tokens = u.output_tokens;
            self.output_tokens_source = TokenSource::Engine;
        }
        if u.per_step {
            // Marked before the split so that the split keeps it (the engine values may
            // arrive in this very update).
            if self.engine_timing.as_deref() != Some("exceeds_gateway") {
                self.engine_timing = Some(ENGINE_TIMING_PER_STEP.to_owned());
            }
        }
        self.split_times();
    }
}

#[cfg(test)]
mod split_tests {
    use super::*;
    use proptest::prelude::*;

    fn rec(ttft: f64, gw: f64, q: Option<f64>, p: f64, d: f64, total: f64) -> RequestRecord {
        RequestRecord {
            ttft_ms: Some(ttft),
            gateway_overhead_ms: Some(gw),
            queue_duration_ms: q,
            queue_source: if q.is_some() {
                PhaseSource::Engine
            } else {
                PhaseSource::None
            },
            prefill_duration_ms: Some(p),
            prefill_source: PhaseSource::Engine,
            decode_duration_ms: Some(d),
            decode_source: PhaseSource::Engine,
            total_duration_ms: total,
            ..RequestRecord::default()
        }
    }

    #[test]
    fn the_issue_22_case_shows_the_wait_vllm_did_not_see() {
        // Gateway TTFT 573 ms; vLLM: queue 0.014 ms, TTFT (prefill) 82 ms; 0.3 ms gateway.
        let mut r = rec(573.0, 0.3, Some(0.014), 82.0, 10.0, 600.0);
        r.split_times();
        let u = r.ttft_unaccounted_ms.expect("split");
        assert!((u - (573.0 - 0.3 - 0.014 - 82.0)).abs() < 1e-9, "{u}");
        assert_eq!(r.engine_timing.as_deref(), Some("consistent"));
        // Engine TTFT above the gateway's: not this request's truth.
        let mut r = rec(80.0, 0.3, Some(0.0), 901.0, 10.0, 1000.0);
        r.split_times();
        assert_eq!(r.ttft_unaccounted_ms, None);
        assert_eq!(r.engine_timing.as_deref(), Some("exceeds_gateway"));
        // A derived queue is not an engine number: all of it is unaccounted.
        let mut r = rec(50.0, 2.0, Some(18.0), 30.0, 40.0, 95.0);
        r.queue_source = PhaseSource::Derived;
        r.split_times();
        assert_eq!(r.ttft_unaccounted_ms, Some(18.0));
        assert_eq!(r.e2e_unaccounted_ms, Some(23.0));
        // No engine phase: nothing to split.
        let mut r = RequestRecord {
            ttft_ms: Some(5.0),
            ..RequestRecord::default()
        };
        r.split_times();
        assert_eq!((r.ttft_unaccounted_ms, r.engine_timing), (None, None));
    }

    #[test]
    fn a_late_span_recomputes_the_split() {
        let mut r = rec(573.0, 0.3, None, 82.0, 10.0, 600.0);
        r.queue_source = PhaseSource::None;
        r.split_times();
        r.apply_update(&PhaseUpdate {
            trace_id: "t".into(),
            queue_duration_ms: Some(400.0),
            ..PhaseUpdate::default()
        });
        assert!(
            (r.ttft_unaccounted_ms.expect("split") - (573.0 - 0.3 - 400.0 - 82.0)).abs() < 1e-9
        );
    }

    #[test]
    fn per_step_values_stay_marked_and_still_add_up() {
        let mut r = rec(573.0, 0.3, Some(0.014), 82.0, 10.0, 600.0);
        r.split_times();
        r.mark_per_step();
        assert_eq!(r.engine_timing.as_deref(), Some(ENGINE_TIMING_PER_STEP));
        r.split_times();
        assert_eq!(r.engine_timing.as_deref(), Some(ENGINE_TIMING_PER_STEP));
        assert!(r.ttft_unaccounted_ms.is_some(), "the parts still add up");
        // Marked by a late update (the gateway names a step's earlier requests), idempotent.
        let mut r = rec(573.0, 0.3, Some(0.014), 82.0, 10.0, 600.0);
        r.split_times();
        let u = PhaseUpdate {
            trace_id: "t".into(),
            per_step: true,
            ..PhaseUpdate::default()
        };
        r.apply_update(&u);
        let once = r.clone();
        r.apply_update(&u);
        assert_eq!(r, once);
        assert_eq!(r.engine_timing.as_deref(), Some(ENGINE_TIMING_PER_STEP));
        // Values above the gateway's measure: that is the stronger statement.
        let mut r = rec(80.0, 0.3, Some(0.0), 901.0, 10.0, 1000.0);
        r.split_times();
        r.mark_per_step();
        r.apply_update(&u);
        assert_eq!(r.engine_timing.as_deref(), Some("exceeds_gateway"));
        // Merging keeps the mark.
        let mut m = PhaseUpdate::default();
        m.merge(&u);
        assert!(m.per_step);
        m.merge(&PhaseUpdate::default());
        assert!(m.per_step);
    }

    proptest! {
        /// Issue 22: for random parts the stored parts sum to TTFT and to the end to end
        /// (within the tolerance), or the engine's numbers are flagged and nothing is split.
        #[test]
        fn stored_parts_always_sum_to_ttft_and_e2e(
            gw in 0.0f64..50.0,
            q in proptest::option::of(0.0f64..5_000.0),
            p in 0.0f64..5_000.0,
            d in 0.0f64..20_000.0,
            unseen in -10.0f64..5_000.0,
            tail in -10.0f64..1_000.0,
            derived in any::<bool>(),
        ) {
            let ttft = (gw + q.unwrap_or(0.0) + p + unseen).max(0.0);
            let total = (ttft + d + tail).max(0.0);
            let mut r = rec(ttft, gw, q, p, d, total);
            if derived && q.is_some() {
                r.queue_source = PhaseSource::Derived;
            }
            r.split_times();
            let eq = if r.queue_source == PhaseSource::Derived { 0.0 } else { q.unwrap_or(0.0) };
            match r.ttft_unaccounted_ms {
                Some(u) => {
                    prop_assert!(u >= 0.0);
                    prop_assert!((gw + u + eq + p - ttft).abs() <= SPLIT_TOLERANCE_MS + 1e-9);
                }
                None => prop_assert_eq!(r.engine_timing.as_deref(), Some("exceeds_gateway")),
            }
            match r.e2e_unaccounted_ms {
                Some(u) => {
                    prop_assert!(u >= 0.0);
                    prop_assert!((gw + u + eq + p + d - total).abs() <= SPLIT_TOLERANCE_MS + 1e-9);
                }
                None => prop_assert_eq!(r.engine_timing.as_deref(), Some("exceeds_gateway")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_boundaries() {
        assert_eq!(InputBucket::of(0), InputBucket::B0To128);
        assert_eq!(InputBucket::of(127), InputBucket::B0To128);
        assert_eq!(InputBucket::of(128), InputBucket::B128To512);
        assert_eq!(InputBucket::of(511), InputBucket::B128To512);
        assert_eq!(InputBucket::of(512), InputBucket::B512To2048);
        assert_eq!(InputBucket::of(2047), InputBucket::B512To2048);
        assert_eq!(InputBucket::of(2048), InputBucket::B2048Plus);
        assert_eq!(InputBucket::of(u64::MAX), InputBucket::B2048Plus);
    }

    #[test]
    fn outcome_round_trip() {
        for o in Outcome::ALL {
            assert_eq!(Outcome::parse(o.as_str()), Some(o));
        }
    }

    #[test]
    fn enum_names_round_trip() {
        for b in InputBucket::ALL {
            assert_eq!(InputBucket::parse(b.as_str()), Some(b));
        }
        for e in Endpoint::ALL {
            assert_eq!(Endpoint::parse(e.as_str()), Some(e));
            assert_eq!(
                Endpoint::from_path(&format!("/v1/{}", e.as_str().replace('_', "/"))),
                Some(e)
            );
        }
        for p in [PhaseSource::Engine, PhaseSource::Derived, PhaseSource::None] {
            assert_eq!(PhaseSource::parse(p.as_str()), Some(p));
        }
        assert_eq!(InputBucket::parse("nope"), None);
    }

    fn update(queue: Option<f64>, input: Option<u64>, output: Option<u64>) -> PhaseUpdate {
        PhaseUpdate {
            trace_id: "t".to_owned(),
            queue_duration_ms: queue,
            input_tokens: input,
            output_tokens: output,
            ..PhaseUpdate::default()
        }
    }

    /// The late-update rule, one case per line: (stored count, stored source, engine count)
    /// → (count, source) after the update.
    #[test]
    fn engine_counts_replace_estimates_never_usage() {
        use TokenSource as S;
        type Case = (Option<u64>, S, Option<u64>, Option<u64>, S);
        let cases: [Case; 10] = [
            (None, S::None, Some(7), Some(7), S::Engine),
            (Some(3), S::Estimate, Some(7), Some(7), S::Engine),
            (Some(3), S::Chunks, Some(7), Some(7), S::Engine),
            (Some(3), S::Tokenizer, Some(7), Some(7), S::Engine),
            (Some(3), S::Usage, Some(7), Some(3), S::Usage),
            (Some(3), S::Engine, Some(7), Some(3), S::Engine),
            // A missing count is filled whatever its (inconsistent) source says.
            (None, S::Usage, Some(7), Some(7), S::Engine),
            // No engine count, or an absurd one: nothing changes.
            (Some(3), S::Estimate, None, Some(3), S::Estimate),
            (Some(3), S::Estimate, Some(u64::MAX), Some(3), S::Estimate),
            (
                None,
                S::None,
                Some(MAX_UPDATE_TOKENS),
                Some(MAX_UPDATE_TOKENS),
                S::Engine,
            ),
        ];
        for (had, src, engine, want, want_src) in cases {
            let mut r = RequestRecord {
                input_tokens: had,
                input_tokens_source: src,
                output_tokens: had,
                output_tokens_source: src,
                ..RequestRecord::default()
            };
            r.apply_update(&update(None, engine, engine));
            let case = (had, src, engine);
            assert_eq!(
                (r.input_tokens, r.input_tokens_source),
                (want, want_src),
                "{case:?}"
            );
            assert_eq!(
                (r.output_tokens, r.output_tokens_source),
                (want, want_src),
                "{case:?}"
            );
            let bucket = if want_src == S::Engine && src != S::Engine {
                want.map(InputBucket::of)
            } else {
                None
            };
            assert_eq!(r.input_bucket, bucket, "{case:?}");
        }
    }

    #[test]
    fn phases_take_sane_engine_values_and_the_rule_is_idempotent() {
        let mut r = RequestRecord {
            queue_duration_ms: Some(10.0),
            queue_source: PhaseSource::Derived,
            ..RequestRecord::default()
        };
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.5] {
            r.apply_update(&update(Some(bad), None, None));
            assert_eq!(
                (r.queue_duration_ms, r.queue_source),
                (Some(10.0), PhaseSource::Derived)
            );
        }
        let u = PhaseUpdate {
            prefill_duration_ms: Some(0.0),
            ..update(Some(40.0), Some(300), None)
        };
        r.apply_update(&u);
        let once = r.clone();
        r.apply_update(&u);
        assert_eq!(r, once);
        assert_eq!(
            (r.queue_duration_ms, r.queue_source),
            (Some(40.0), PhaseSource::EngineSpan)
        );
        assert_eq!(
            (r.prefill_duration_ms, r.prefill_source),
            (Some(0.0), PhaseSource::EngineSpan)
        );
        assert_eq!(
            (r.decode_duration_ms, r.decode_source),
            (None, PhaseSource::None)
        );
        assert_eq!(r.input_bucket, Some(InputBucket::B128To512));
        // The first engine count stays.
        r.apply_update(&update(None, Some(5), None));
        assert_eq!(r.input_tokens, Some(300));
    }

    #[test]
    fn merge_keeps_older_values_the_newer_lacks_and_drops_bad_ones() {
        let mut a = update(Some(1.0), Some(10), None);
        a.merge(&update(None, Some(20), Some(5)));
        assert_eq!(a, update(Some(1.0), Some(20), Some(5)));
        a.merge(&update(Some(f64::NAN), Some(u64::MAX), None));
        assert_eq!(a, update(Some(1.0), Some(20), Some(5)));
        let mut other = update(None, None, None);
        other.trace_id = "other".to_owned();
        a.merge(&other);
        assert_eq!(a.trace_id, "t");
        assert_eq!(
            update(Some(-1.0), Some(u64::MAX), Some(3)).sanitized(),
            update(None, None, Some(3))
        );
    }

    #[test]
    fn endpoint_paths() {
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/completions/"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/embeddings"),
            Some(Endpoint::Embeddings)
        );
        assert_eq!(
            Endpoint::from_path("/v1/responses"),
            Some(Endpoint::Responses)
        );
        assert_eq!(
            Endpoint::from_path("/v1/messages/"),
            Some(Endpoint::Messages)
        );
        assert_eq!(Endpoint::from_path("/v1/messages/count_tokens"), None);
        assert_eq!(Endpoint::from_path("/v1/models"), None);
        assert_eq!(Endpoint::Messages.default_request_type(), "chat");
        assert!(!Endpoint::Responses.usage_on_request());
        assert!(Endpoint::Completions.usage_on_request());
    }
}
