//! Span attribute names read from engine spans.
//!
//! Names and value types as vLLM writes them: `SpanAttributes` in vLLM's `vllm/tracing.py`,
//! set in `OutputProcessor.do_tracing` (`vllm/v1/engine/output_processor.py`) on a span named
//! `llm_request` (kind `SERVER`): every `gen_ai.latency.*` value is a Python `float` of seconds
//! (an OTLP `doubleValue`), the two `gen_ai.usage.*` counts are Python `int`s (`intValue`) and
//! `gen_ai.request.id` is the external request id (`stringValue`). SGLang writes the same names
//! (its `SpanAttributes` copies vLLM's; `convert_to_gen_ai_span_attrs` in its request time
//! stats), also in seconds, but omits attributes whose timestamps it lacks.
//!
//! Invariant: the prefix constants decide whether a span is an engine span at all; the named
//! constants decide which field a value fills.

/// Prefix of the latency attributes (all seconds).
pub(crate) const LATENCY_PREFIX: &str = "gen_ai.latency.";
/// Prefix of the usage attributes (token counts).
pub(crate) const USAGE_PREFIX: &str = "gen_ai.usage.";

/// Scheduler queue: queued → scheduled.
pub(crate) const TIME_IN_QUEUE: &str = "gen_ai.latency.time_in_queue";
/// Frontend arrival → first token (includes tokenisation and queueing).
pub(crate) const TIME_TO_FIRST_TOKEN: &str = "gen_ai.latency.time_to_first_token";
/// Frontend arrival → finish.
pub(crate) const E2E: &str = "gen_ai.latency.e2e";
/// Scheduled → first token.
pub(crate) const TIME_IN_MODEL_PREFILL: &str = "gen_ai.latency.time_in_model_prefill";
/// First token → last token.
pub(crate) const TIME_IN_MODEL_DECODE: &str = "gen_ai.latency.time_in_model_decode";
/// The engine's request id (string).
pub(crate) const REQUEST_ID: &str = "gen_ai.request.id";
/// Prompt tokens (vLLM's name).
pub(crate) const USAGE_PROMPT_TOKENS: &str = "gen_ai.usage.prompt_tokens";
/// Completion tokens (vLLM's name).
pub(crate) const USAGE_COMPLETION_TOKENS: &str = "gen_ai.usage.completion_tokens";
/// Input tokens (current OpenTelemetry GenAI semantic conventions), used when
/// `gen_ai.usage.prompt_tokens` is absent.
pub(crate) const USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Output tokens (current OpenTelemetry GenAI semantic conventions), used when
/// `gen_ai.usage.completion_tokens` is absent.
pub(crate) const USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// Resource attribute naming the exporting service (`vllm`, `sglang`, …).
pub(crate) const SERVICE_NAME: &str = "service.name";
