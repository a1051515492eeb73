//! Reading OpenAI-compatible request and response bodies; [`parse_payload_for`] dispatches to
//! the readers of the Responses ([`crate::responses`]) and Messages ([`crate::messages`]) APIs,
//! which give the same [`PayloadInfo`].
//!
//! Everything here is tolerant: unknown fields are ignored, a field of the wrong type is treated
//! as absent where possible, and no input panics. Token counts are never invented: a count is
//! only reported when the payload carries it.

use crate::messages::MessagesUsage;
use crate::record::Endpoint;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;

/// What the gateway needs to know about a request body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestInfo {
    /// `model`.
    pub model: Option<String>,
    /// `stream` (false when absent).
    pub stream: bool,
    /// `stream_options.include_usage` (false when absent).
    pub include_usage: bool,
    /// `max_tokens`, else `max_completion_tokens`, else `max_output_tokens` (Responses API).
    pub max_tokens: Option<u64>,
    /// The body's `user` field (Messages API: `metadata.user_id`).
    pub user: Option<String>,
}

impl RequestInfo {
    /// Reads the fields from a parsed JSON body of a request to `endpoint`.
    pub fn for_endpoint(endpoint: Endpoint, v: &Value) -> Self {
        let mut info = Self::from_json(v);
        if endpoint == Endpoint::Messages {
            info.user = v
                .get("metadata")
                .and_then(|m| m.get("user_id"))
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        info
    }

    /// Reads the fields from a parsed JSON body (of a chat request; see
    /// [`RequestInfo::for_endpoint`]).
    pub fn from_json(v: &Value) -> Self {
        let str_field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        RequestInfo {
            model: str_field("model"),
            stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: v
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_tokens: v
                .get("max_tokens")
                .and_then(Value::as_u64)
                .or_else(|| v.get("max_completion_tokens").and_then(Value::as_u64))
                .or_else(|| v.get("max_output_tokens").and_then(Value::as_u64)),
            user: str_field("user"),
        }
    }
}

/// Sets `stream_options.include_usage = true` in a request body, keeping every other field.
/// Returns `false` (and changes nothing) when the body is not a JSON object or
/// `stream_options` exists but is not an object.
pub fn inject_include_usage(body: &mut Value) -> bool {
    let Some(obj) = body.as_object_mut() else {
        return false;
    };
    let opts = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Default::default()));
    match opts.as_object_mut() {
        Some(o) => {
            o.insert("include_usage".into(), Value::Bool(true));
            true
        }
        None => false,
    }
}

/// The OpenAI `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    /// Prompt tokens (including cached).
    #[serde(default, deserialize_with = "lenient_u64")]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens (including reasoning).
    #[serde(default, deserialize_with = "lenient_u64")]
    pub completion_tokens: Option<u64>,
    /// Total tokens.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub total_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptDetails>,
    /// `completion_tokens_details.reasoning_tokens`.
    #[serde(default)]
    pub completion_tokens_details: Option<CompletionDetails>,
    /// Prompt tokens written to the prompt cache (not an OpenAI field: Anthropic's
    /// `cache_creation_input_tokens`, see [`MessagesUsage::to_usage`]).
    #[serde(skip)]
    pub cache_creation_tokens: Option<u64>,
}

impl Usage {
    /// Cached prompt tokens, when reported.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
    /// Reasoning tokens, when reported.
    pub fn reasoning_tokens(&self) -> Option<u64> {
        self.completion_tokens_details
            .and_then(|d| d.reasoning_tokens)
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct PromptDetails {
    /// Cached prompt tokens.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub cached_tokens: Option<u64>,
}

/// `usage.completion_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct CompletionDetails {
    /// Reasoning tokens.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub reasoning_tokens: Option<u64>,
}

/// llama.cpp's per-request `timings` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct LlamaTimings {
    /// Prompt tokens processed (not served from cache).
    #[serde(default, deserialize_with = "lenient_u64")]
    pub prompt_n: Option<u64>,
    /// Prefill time, ms.
    #[serde(default)]
    pub prompt_ms: Option<f64>,
    /// Tokens generated.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub predicted_n: Option<u64>,
    /// Decode time, ms.
    #[serde(default)]
    pub predicted_ms: Option<f64>,
    /// Prompt tokens served from the KV cache.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub cache_n: Option<u64>,
    /// Speculative decoding: draft tokens.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub draft_n: Option<u64>,
    /// Speculative decoding: accepted draft tokens.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub draft_n_accepted: Option<u64>,
}

/// vLLM's per-request `metrics` object (server flag `--enable-per-request-metrics`; on the
/// final usage chunk when streaming). Source: vLLM `docs/features/per_request_metrics.md`.
/// `time_to_first_token_ms` runs from *scheduling* to the first token, so it is the prefill
/// time; `generation_time_ms` is first → last token (decode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct VllmMetrics {
    /// Scheduled → first output token (prefill), ms.
    #[serde(default)]
    pub time_to_first_token_ms: Option<f64>,
    /// First → last output token (decode), ms.
    #[serde(default)]
    pub generation_time_ms: Option<f64>,
    /// Waiting in the scheduler queue, ms.
    #[serde(default)]
    pub queue_time_ms: Option<f64>,
    /// Mean inter-token latency in decode, ms.
    #[serde(default)]
    pub mean_itl_ms: Option<f64>,
    /// Output tokens per second over scheduling → last token.
    #[serde(default)]
    pub tokens_per_second: Option<f64>,
}

pub(crate) fn lenient_u64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(v.and_then(|v| match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| *f >= 0.0 && f.is_finite())
                .map(|f| f as u64)
        }),
        _ => None,
    }))
}

/// What one response body (non-streaming) or one SSE `data:` payload (streaming) says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PayloadInfo<'a> {
    /// `model` (borrowed from the input when possible).
    pub model: Option<Cow<'a, str>>,
    /// The response's `id` (`chatcmpl-…`, `cmpl-…`; borrowed when possible).
    pub id: Option<Cow<'a, str>>,
    /// At least one choice carries output (text, reasoning, tool call, refusal).
    pub has_output: bool,
    /// `choices` is present and empty (the usage-only chunk when usage is also present).
    pub empty_choices: bool,
    /// `finish_reason` of the first choice that has one.
    pub finish_reason: Option<Cow<'a, str>>,
    /// The `usage` object.
    pub usage: Option<Usage>,
    /// llama.cpp's `timings`.
    pub timings: Option<LlamaTimings>,
    /// vLLM's per-request `metrics`.
    pub metrics: Option<VllmMetrics>,
    /// The payload is an error object (`{"error": ...}`).
    pub is_error: bool,
    /// Bytes of output text in this payload (for estimates when no usage arrives).
    pub output_bytes: usize,
    /// The first choice's output text in this payload (content, else reasoning, else text).
    pub text: Option<Cow<'a, str>>,
    /// The Messages API's `usage` (cumulative counts, merged across a stream's events and then
    /// turned into a [`Usage`] by [`MessagesUsage::to_usage`]); `None` for the other APIs.
    pub messages_usage: Option<MessagesUsage>,
}

impl PayloadInfo<'_> {
    /// The usage-only chunk the gateway adds with `include_usage`: empty `choices` and a usage.
    pub fn is_usage_only(&self) -> bool {
        self.empty_choices && self.usage.is_some()
    }
}

/// `metrics` of another shape (some servers use the name for other things) is ignored.
fn lenient_metrics<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<VllmMetrics>, D::Error> {
    let v = Option::<Value>::deserialize(d)?;
    Ok(v.and_then(|v| serde_json::from_value(v).ok()))
}

/// A string borrowed from the input when it has no escapes (no allocation per chunk).
pub(crate) struct BStr<'a>(pub(crate) Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for BStr<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = BStr<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(BStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(BStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(BStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

impl BStr<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Deserialize)]
struct RawPayload<'a> {
    #[serde(borrow, default)]
    id: Option<BStr<'a>>,
    #[serde(borrow, default)]
    model: Option<BStr<'a>>,
    #[serde(borrow, default)]
    choices: Option<Choices<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    timings: Option<LlamaTimings>,
    #[serde(default, deserialize_with = "lenient_metrics")]
    metrics: Option<VllmMetrics>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct RawChoice<'a> {
    #[serde(borrow, default)]
    delta: Option<RawMessage<'a>>,
    #[serde(borrow, default)]
    message: Option<RawMessage<'a>>,
    #[serde(borrow, default)]
    text: Option<BStr<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<BStr<'a>>,
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow, default)]
    content: Option<RawContent<'a>>,
    #[serde(borrow, default)]
    reasoning_content: Option<BStr<'a>>,
    #[serde(borrow, default)]
    reasoning: Option<BStr<'a>>,
    #[serde(borrow, default)]
    refusal: Option<BStr<'a>>,
    #[serde(default, deserialize_with = "tool_call_count")]
    tool_calls: Option<usize>,
}

/// `content`: a string, or anything else (an array of parts, an object) skipped in place —
/// visited directly rather than through an untagged enum, which would first buffer the value.
enum RawContent<'a> {
    Text(BStr<'a>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for RawContent<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawContent<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(RawContent::Text(BStr(Cow::Borrowed(v))))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(RawContent::Text(BStr(Cow::Owned(v.to_owned()))))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(RawContent::Text(BStr(Cow::Owned(v))))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(RawContent::Other)
            }
            fn visit_some<D2: serde::Deserializer<'de>>(
                self,
                d: D2,
            ) -> Result<Self::Value, D2::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(RawContent::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(RawContent::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// `choices`, folded one element at a time as the array is read (no `Vec` per payload).
#[derive(Default)]
struct Choices<'a> {
    empty: bool,
    output_bytes: usize,
    has_output: bool,
    text: Option<Cow<'a, str>>,
    finish_reason: Option<Cow<'a, str>>,
}

impl<'a> Choices<'a> {
    fn fold(&mut self, c: RawChoice<'a>) {
        let mut bytes = c.text.as_ref().map_or(0, |t| t.len());
        let mut tools = false;
        let mut piece: Option<Cow<'a, str>> = None;
        for m in [c.delta, c.message].into_iter().flatten() {
            if let Some(RawContent::Text(t)) = m.content {
                bytes += t.len();
                if !t.0.is_empty() && piece.is_none() {
                    piece = Some(t.0);
                }
            }
            bytes += m.reasoning_content.as_ref().map_or(0, |t| t.len());
            bytes += m.reasoning.as_ref().map_or(0, |t| t.len());
            bytes += m.refusal.as_ref().map_or(0, |t| t.len());
            if piece.is_none() {
                piece = m.reasoning_content.or(m.reasoning).map(|t| t.0);
            }
            tools |= m.tool_calls.is_some_and(|n| n > 0);
        }
        self.output_bytes += bytes;
        self.has_output |= bytes > 0 || tools;
        if self.text.is_none() {
            self.text = piece.or_else(|| c.text.map(|t| t.0));
        }
        if self.finish_reason.is_none() {
            self.finish_reason = c.finish_reason.map(|r| r.0);
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Choices<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Choices<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut acc = Choices {
                    empty: true,
                    ..Choices::default()
                };
                while let Some(c) = seq.next_element::<RawChoice<'de>>()? {
                    acc.empty = false;
                    acc.fold(c);
                }
                Ok(acc)
            }
        }
        d.deserialize_seq(V)
    }
}

fn tool_call_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    Ok(Option::<Count>::deserialize(d)?.map(|c| c.0))
}

/// `tool_calls`: how many, each skipped in place.
struct Count(usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Count(n))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Error of [`parse_payload`].
#[derive(Debug, thiserror::Error)]
#[error("malformed JSON payload: {0}")]
pub struct PayloadError(#[from] serde_json::Error);

/// Reads a response body or one streamed `data:` payload of `endpoint`'s API: the
/// OpenAI-compatible endpoints with [`parse_payload`], the Responses API with
/// [`crate::responses::parse`], the Messages API with [`crate::messages::parse`].
pub fn parse_payload_for(endpoint: Endpoint, data: &[u8]) -> Result<PayloadInfo<'_>, PayloadError> {
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Embeddings => {
            parse_payload(data)
        }
        Endpoint::Responses => crate::responses::parse(data),
        Endpoint::Messages => crate::messages::parse(data),
    }
}

/// Reads a chat/completion/embedding response body or one streamed `data:` payload.
pub fn parse_payload(data: &[u8]) -> Result<PayloadInfo<'_>, PayloadError> {
    let raw: RawPayload<'_> = serde_json::from_slice(data)?;
    let mut info = PayloadInfo {
        model: raw.model.map(|m| m.0),
        id: raw.id.map(|i| i.0),
        usage: raw.usage,
        timings: raw.timings,
        metrics: raw.metrics,
        is_error: raw.error.is_some(),
        ..PayloadInfo::default()
    };
    if let Some(c) = raw.choices {
        info.empty_choices = c.empty;
        info.output_bytes = c.output_bytes;
        info.has_output = c.has_output;
        info.text = c.text;
        info.finish_reason = c.finish_reason;
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn request_fields() {
        let v: Value = serde_json::json!({
            "model": "m", "stream": true, "max_completion_tokens": 7, "user": "u",
            "stream_options": {"include_usage": true}
        });
        let r = RequestInfo::from_json(&v);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.user.as_deref(), Some("u"));
        // The Responses API's limit; the Messages API's user.
        let v = serde_json::json!({"max_output_tokens": 9, "user": "u"});
        let r = RequestInfo::for_endpoint(Endpoint::Responses, &v);
        assert_eq!((r.max_tokens, r.user.as_deref()), (Some(9), Some("u")));
        let v = serde_json::json!({"max_tokens": 4, "user": "not-anthropic", "metadata": {"user_id": "a1"}});
        let r = RequestInfo::for_endpoint(Endpoint::Messages, &v);
        assert_eq!((r.max_tokens, r.user.as_deref()), (Some(4), Some("a1")));
        let r = RequestInfo::for_endpoint(Endpoint::Messages, &serde_json::json!({"metadata": 3}));
        assert_eq!(r.user, None);
    }

    #[test]
    fn payloads_are_read_by_their_endpoints_parser() {
        let delta = br#"{"type":"response.output_text.delta","delta":"hi"}"#;
        assert!(
            parse_payload_for(Endpoint::Responses, delta)
                .expect("valid")
                .has_output
        );
        assert!(
            !parse_payload_for(Endpoint::ChatCompletions, delta)
                .expect("valid")
                .has_output
        );
        let block = br#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"hi"}}"#;
        assert!(
            parse_payload_for(Endpoint::Messages, block)
                .expect("valid")
                .has_output
        );
        let chunk = br#"{"choices":[{"delta":{"content":"hi"}}]}"#;
        for e in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Embeddings,
        ] {
            assert!(parse_payload_for(e, chunk).expect("valid").has_output);
        }
    }

    #[test]
    fn inject_usage_keeps_other_options() {
        let mut v = serde_json::json!({"stream_options": {"x": 1}});
        assert!(inject_include_usage(&mut v));
        assert_eq!(
            v,
            serde_json::json!({"stream_options": {"x": 1, "include_usage": true}})
        );
        let mut v = serde_json::json!({});
        assert!(inject_include_usage(&mut v));
        assert_eq!(v["stream_options"]["include_usage"], true);
        let mut v = serde_json::json!([]);
        assert!(!inject_include_usage(&mut v));
    }

    #[test]
    fn chat_chunk() {
        let p = parse_payload(
            br#"{"id":"x","object":"chat.completion.chunk","model":"gemma","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#,
        )
        .expect("valid");
        assert!(p.has_output);
        assert_eq!(p.model.as_deref(), Some("gemma"));
        assert_eq!(p.id.as_deref(), Some("x"));
        assert!(
            matches!(p.id, Some(Cow::Borrowed(_))),
            "no allocation per chunk"
        );
        assert_eq!(p.output_bytes, 2);
        let role_only = parse_payload(
            br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
        )
        .expect("valid");
        assert!(!role_only.has_output);
        assert_eq!(role_only.id, None);
    }

    #[test]
    fn usage_only_chunk_with_timings() {
        let p = parse_payload(br#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":3}},"timings":{"prompt_n":9,"prompt_ms":12.5,"predicted_n":5,"predicted_ms":40.25,"cache_n":3}}"#).expect("valid");
        assert!(p.is_usage_only());
        let u = p.usage.expect("usage");
        assert_eq!(u.prompt_tokens, Some(12));
        assert_eq!(u.cached_tokens(), Some(3));
        let t = p.timings.expect("timings");
        assert_eq!(t.prompt_ms, Some(12.5));
        assert_eq!(t.cache_n, Some(3));
    }

    #[test]
    fn completion_and_embedding_bodies() {
        let p = parse_payload(br#"{"choices":[{"text":"abc","finish_reason":"length"}],"usage":{"prompt_tokens":2,"completion_tokens":3}}"#).expect("valid");
        assert!(p.has_output);
        assert_eq!(p.finish_reason.as_deref(), Some("length"));
        let e = parse_payload(br#"{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#).expect("valid");
        assert_eq!(e.usage.and_then(|u| u.prompt_tokens), Some(4));
        assert!(!e.has_output);
    }

    #[test]
    fn vllm_per_request_metrics() {
        // A real vLLM 0.32.0 response (`--enable-per-request-metrics`), captured by
        // scripts/capture-vllm-fixtures.py.
        let p = parse_payload(include_bytes!(
            "../../tokenscope-cli/tests/fixtures/vllm/chat.json"
        ))
        .expect("valid");
        let m = p.metrics.expect("metrics");
        assert_eq!(m.queue_time_ms, Some(0.04423100472195074));
        assert_eq!(m.time_to_first_token_ms, Some(77.39007399504771));
        assert_eq!(m.generation_time_ms, Some(361.67389700131025));
        assert_eq!(p.usage.and_then(|u| u.prompt_tokens), Some(17));
        assert_eq!(p.finish_reason.as_deref(), Some("length"));
        let odd = parse_payload(br#"{"choices":[],"metrics":"n/a"}"#).expect("valid");
        assert_eq!(odd.metrics, None);
    }

    #[test]
    fn error_payload_and_garbage() {
        assert!(
            parse_payload(br#"{"error":{"message":"x"}}"#)
                .expect("valid")
                .is_error
        );
        assert!(parse_payload(b"{not json").is_err());
        assert!(parse_payload(b"[DONE]").is_err());
    }

    proptest! {
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_payload(&data);
        }

        #[test]
        fn usage_numbers_round_trip(p in 0u64..1_000_000, c in 0u64..1_000_000) {
            let body = format!(r#"{{"choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":{c}}}}}"#);
            let info = parse_payload(body.as_bytes()).expect("valid");
            let u = info.usage.expect("usage");
            prop_assert_eq!(u.prompt_tokens, Some(p));
            prop_assert_eq!(u.completion_tokens, Some(c));
        }
    }
}
