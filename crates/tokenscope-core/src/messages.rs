//! Reading Anthropic Messages API bodies and streamed events (`/v1/messages`), into the same
//! [`PayloadInfo`] the OpenAI-compatible endpoints give.
//!
//! A body and a streamed event are told apart by their `type`, so one function reads both:
//!
//! | `type` | what it tells |
//! |---|---|
//! | `message` (a non-streamed body) | id, model, `stop_reason`, `usage`; output from its `content` blocks |
//! | `message_start` | id, model, the first `usage`: input and cache tokens (its output count is a placeholder, 0 or 1, and is not read: a stream cut before `message_delta` has no output count from usage, the gateway counts its chunks) |
//! | `content_block_start` | an output chunk when the block already carries generated tokens: non-empty `text` / `thinking`, or a tool call's `name` (as chat's first `tool_calls` chunk) |
//! | `content_block_delta` | an output chunk for a non-empty `text_delta`, `thinking_delta` or `input_json_delta`; `signature_delta` and `citations_delta` carry no generated tokens |
//! | `message_delta` | `stop_reason`, `usage` (cumulative: a newer value replaces the older one, field by field; newer API versions repeat the input and cache counts here) |
//! | `error` | the stream failed (`overloaded_error`, …) |
//! | `ping`, `content_block_stop`, `message_stop`, anything else | nothing |
//!
//! Token accounting ([`MessagesUsage`]): Anthropic's `input_tokens` **excludes** the prompt
//! tokens read from (`cache_read_input_tokens`) or written to (`cache_creation_input_tokens`)
//! the prompt cache. The record keeps the chat meaning — input = every prompt token — so the
//! [`Usage`] it becomes has `prompt_tokens = input + cache read + cache creation`,
//! `cached_tokens = cache read` and `cache_creation_tokens = cache creation`. (llama.cpp
//! reports its KV-cache hits as `cache_read_input_tokens`: the sum equals the `prompt_tokens`
//! its `/v1/chat/completions` reports for the same conversation.)
//!
//! Stop reasons are mapped onto the chat vocabulary the record and the analyses use:
//! `end_turn` and `stop_sequence` → `stop`, `max_tokens` and `model_context_window_exceeded` →
//! `length`, `tool_use` → `tool_calls`, `refusal` → `content_filter`; others are kept as sent.
//!
//! Like [`crate::openai`], nothing here panics, counts are never invented, and strings are
//! borrowed from the input when they have no escapes.

use crate::openai::{lenient_u64, BStr, LlamaTimings, PayloadError, PayloadInfo, Usage};
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::borrow::Cow;

/// Anthropic's `usage` object, as sent (`input_tokens` excludes cache reads and writes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct MessagesUsage {
    /// Prompt tokens neither read from nor written to the cache.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub input_tokens: Option<u64>,
    /// Output tokens so far (cumulative in a stream).
    #[serde(default, deserialize_with = "lenient_u64")]
    pub output_tokens: Option<u64>,
    /// Prompt tokens read from the cache.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub cache_read_input_tokens: Option<u64>,
    /// Prompt tokens written to the cache.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub cache_creation_input_tokens: Option<u64>,
}

impl MessagesUsage {
    /// Merges a `newer` usage of the same message: each count it carries replaces this one's
    /// (Anthropic's streamed counts are cumulative), the others stay.
    pub fn merge(&mut self, newer: &MessagesUsage) {
        fn pick(old: &mut Option<u64>, new: Option<u64>) {
            if new.is_some() {
                *old = new;
            }
        }
        pick(&mut self.input_tokens, newer.input_tokens);
        pick(&mut self.output_tokens, newer.output_tokens);
        pick(
            &mut self.cache_read_input_tokens,
            newer.cache_read_input_tokens,
        );
        pick(
            &mut self.cache_creation_input_tokens,
            newer.cache_creation_input_tokens,
        );
    }

    /// The usage in the chat meaning (see the module docs): prompt tokens are the sum of the
    /// three input counts, known when `input_tokens` is.
    pub fn to_usage(&self) -> Usage {
        let read = self.cache_read_input_tokens;
        let created = self.cache_creation_input_tokens;
        let prompt = self.input_tokens.map(|n| {
            n.saturating_add(read.unwrap_or(0))
                .saturating_add(created.unwrap_or(0))
        });
        Usage {
            prompt_tokens: prompt,
            completion_tokens: self.output_tokens,
            total_tokens: match (prompt, self.output_tokens) {
                (Some(p), Some(o)) => Some(p.saturating_add(o)),
                _ => None,
            },
            prompt_tokens_details: read.map(|n| crate::openai::PromptDetails {
                cached_tokens: Some(n),
            }),
            completion_tokens_details: None,
            cache_creation_tokens: created,
        }
    }
}

/// An Anthropic stop reason in the chat vocabulary (see the module docs).
pub fn finish_reason(stop_reason: &str) -> Cow<'static, str> {
    Cow::Borrowed(match stop_reason {
        "end_turn" | "stop_sequence" => "stop",
        "max_tokens" | "model_context_window_exceeded" => "length",
        "tool_use" => "tool_calls",
        "refusal" => "content_filter",
        other => return Cow::Owned(other.to_owned()),
    })
}

#[derive(Deserialize)]
struct RawEvent<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<BStr<'a>>,
    // `message` body fields (and `message_start`'s `message`).
    #[serde(borrow, default)]
    id: Option<BStr<'a>>,
    #[serde(borrow, default)]
    model: Option<BStr<'a>>,
    #[serde(borrow, default)]
    content: Option<Vec<RawBlock<'a>>>,
    #[serde(borrow, default)]
    stop_reason: Option<BStr<'a>>,
    #[serde(default)]
    usage: Option<MessagesUsage>,
    // Stream events.
    #[serde(borrow, default)]
    message: Option<RawMessage<'a>>,
    #[serde(borrow, default)]
    content_block: Option<RawBlock<'a>>,
    #[serde(borrow, default)]
    delta: Option<RawDelta<'a>>,
    #[serde(default)]
    error: Option<IgnoredAny>,
    /// llama.cpp's per-request timings, should it add them (it does on the Responses API).
    #[serde(default)]
    timings: Option<LlamaTimings>,
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(borrow, default)]
    id: Option<BStr<'a>>,
    #[serde(borrow, default)]
    model: Option<BStr<'a>>,
    #[serde(borrow, default)]
    content: Option<Vec<RawBlock<'a>>>,
    #[serde(borrow, default)]
    stop_reason: Option<BStr<'a>>,
    #[serde(default)]
    usage: Option<MessagesUsage>,
}

/// A content block (`text`, `thinking`, `tool_use`, …) or a block delta (`text_delta`, …).
#[derive(Deserialize)]
struct RawBlock<'a> {
    #[serde(borrow, default)]
    text: Option<BStr<'a>>,
    #[serde(borrow, default)]
    thinking: Option<BStr<'a>>,
    #[serde(borrow, default)]
    name: Option<BStr<'a>>,
}

#[derive(Deserialize)]
struct RawDelta<'a> {
    #[serde(borrow, default)]
    text: Option<BStr<'a>>,
    #[serde(borrow, default)]
    thinking: Option<BStr<'a>>,
    #[serde(borrow, default)]
    partial_json: Option<BStr<'a>>,
    #[serde(borrow, default)]
    stop_reason: Option<BStr<'a>>,
}

fn non_empty<'a, 'b>(s: &'b Option<BStr<'a>>) -> Option<&'b Cow<'a, str>> {
    s.as_ref().map(|s| &s.0).filter(|s| !s.is_empty())
}

/// What one content block (or delta) gives: output bytes, whether it is output, its text.
fn read_block<'a>(info: &mut PayloadInfo<'a>, text: Option<BStr<'a>>, thinking: Option<BStr<'a>>) {
    for t in [text, thinking].into_iter().flatten() {
        if t.0.is_empty() {
            continue;
        }
        info.has_output = true;
        info.output_bytes += t.0.len();
        if info.text.is_none() {
            info.text = Some(t.0);
        }
    }
}

/// Reads a Messages API response body or one streamed event's `data:` (see the module docs).
/// The usage comes as [`PayloadInfo::messages_usage`] (to be merged across a stream's
/// events), never as [`PayloadInfo::usage`].
pub fn parse(data: &[u8]) -> Result<PayloadInfo<'_>, PayloadError> {
    let raw: RawEvent<'_> = serde_json::from_slice(data)?;
    let mut info = PayloadInfo {
        timings: raw.timings,
        ..PayloadInfo::default()
    };
    let kind = raw.kind.as_ref().map(|k| k.0.as_ref());
    info.is_error = kind == Some("error") || raw.error.is_some();
    // A body (`type: message`, or no type at all) and `message_start` carry the message.
    let message = match (kind, raw.message) {
        (Some("message_start"), Some(m)) => Some(m),
        (None | Some("message"), _) => Some(RawMessage {
            id: raw.id,
            model: raw.model,
            content: raw.content,
            stop_reason: raw.stop_reason,
            usage: raw.usage,
        }),
        _ => None,
    };
    if let Some(m) = message {
        info.id = m.id.map(|i| i.0);
        info.model = m.model.map(|m| m.0);
        info.messages_usage = m.usage;
        if kind == Some("message_start") {
            if let Some(u) = info.messages_usage.as_mut() {
                u.output_tokens = None;
            }
        }
        info.finish_reason = m.stop_reason.map(|r| finish_reason(&r.0));
        for block in m.content.into_iter().flatten() {
            info.has_output |= non_empty(&block.name).is_some();
            read_block(&mut info, block.text, block.thinking);
        }
        return Ok(info);
    }
    match kind {
        Some("content_block_start") => {
            if let Some(block) = raw.content_block {
                info.has_output |= non_empty(&block.name).is_some();
                read_block(&mut info, block.text, block.thinking);
            }
        }
        Some("content_block_delta") => {
            if let Some(d) = raw.delta {
                if let Some(json) = non_empty(&d.partial_json) {
                    info.has_output = true;
                    info.output_bytes += json.len();
                }
                read_block(&mut info, d.text, d.thinking);
            }
        }
        Some("message_delta") => {
            info.messages_usage = raw.usage;
            info.finish_reason = raw
                .delta
                .and_then(|d| d.stop_reason)
                .map(|r| finish_reason(&r.0));
        }
        _ => {}
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(data: &str) -> PayloadInfo<'_> {
        parse(data.as_bytes()).expect("valid")
    }

    #[test]
    fn body_as_llama_cpp_sends_it() {
        let b = p(
            r#"{"id":"chatcmpl-7cG8","type":"message","role":"assistant","content":[{"type":"text","text":"<|im_end|>\n<"}],"model":"gemma.gguf","stop_reason":"max_tokens","stop_sequence":null,"usage":{"cache_read_input_tokens":21,"input_tokens":5,"output_tokens":8}}"#,
        );
        assert!(b.has_output && !b.is_error);
        assert_eq!(b.id.as_deref(), Some("chatcmpl-7cG8"));
        assert_eq!(b.model.as_deref(), Some("gemma.gguf"));
        assert_eq!(b.finish_reason.as_deref(), Some("length"));
        assert_eq!(b.text.as_deref(), Some("<|im_end|>\n<"));
        assert_eq!(b.output_bytes, 12);
        assert_eq!(b.usage, None, "Anthropic usage is merged by the caller");
        let u = b.messages_usage.expect("usage").to_usage();
        assert_eq!(u.prompt_tokens, Some(26));
        assert_eq!(u.completion_tokens, Some(8));
        assert_eq!(u.cached_tokens(), Some(21));
        assert_eq!(u.cache_creation_tokens, None);
        assert_eq!(u.total_tokens, Some(34));
    }

    #[test]
    fn body_with_thinking_tool_use_and_cache_writes() {
        let b = p(
            r#"{"id":"msg_1","type":"message","content":[{"type":"thinking","thinking":"hmm","signature":"sig"},{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Paris"}}],"stop_reason":"tool_use","usage":{"input_tokens":100,"cache_creation_input_tokens":20,"cache_read_input_tokens":10,"output_tokens":30}}"#,
        );
        assert!(b.has_output);
        assert_eq!(b.text.as_deref(), Some("hmm"));
        assert_eq!(b.finish_reason.as_deref(), Some("tool_calls"));
        let u = b.messages_usage.expect("usage").to_usage();
        assert_eq!(u.prompt_tokens, Some(130));
        assert_eq!(u.cached_tokens(), Some(10));
        assert_eq!(u.cache_creation_tokens, Some(20));
        // A tool call alone is output too (its name is generated).
        let t = p(r#"{"type":"message","content":[{"type":"tool_use","name":"f","input":{}}]}"#);
        assert!(t.has_output);
        assert_eq!(t.output_bytes, 0);
    }

    /// Each streamed event, one per line: (data, output chunk?, text, finish reason).
    #[test]
    fn stream_events_table() {
        let rows: &[(&str, bool, Option<&str>, Option<&str>)] = &[
            (
                r#"{"type":"message_start","message":{"id":"m1","type":"message","role":"assistant","content":[],"model":"claude","stop_reason":null,"usage":{"input_tokens":5,"cache_read_input_tokens":21,"output_tokens":0}}}"#,
                false,
                None,
                None,
            ),
            (r#"{"type":"ping"}"#, false, None, None),
            (
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
                true,
                Some("Hi"),
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"thinking","thinking":""}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"thinking_delta","thinking":"Let me"}}"#,
                true,
                Some("Let me"),
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"signature_delta","signature":"EqQB"}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}"#,
                true,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":""}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"city\":"}}"#,
                true,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","citation":{"type":"char_location","cited_text":"x"}}}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"content_block_stop","index":0}"#,
                false,
                None,
                None,
            ),
            (
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}"#,
                false,
                None,
                Some("stop"),
            ),
            (r#"{"type":"message_stop"}"#, false, None, None),
            (
                r#"{"type":"some_future_event","delta":{"text":"x"}}"#,
                false,
                None,
                None,
            ),
        ];
        for (data, output, text, finish) in rows {
            let e = p(data);
            assert_eq!(e.has_output, *output, "{data}");
            assert_eq!(e.text.as_deref(), *text, "{data}");
            assert_eq!(e.finish_reason.as_deref(), *finish, "{data}");
            assert!(!e.is_error, "{data}");
        }
        let start = p(rows[0].0);
        assert_eq!(start.id.as_deref(), Some("m1"));
        assert_eq!(start.model.as_deref(), Some("claude"));
        assert!(
            matches!(start.id, Some(Cow::Borrowed(_))),
            "no allocation per event"
        );
    }

    #[test]
    fn usage_merges_across_the_stream() {
        let start = p(
            r#"{"type":"message_start","message":{"usage":{"input_tokens":5,"cache_read_input_tokens":21,"output_tokens":1}}}"#,
        );
        let mut u = start.messages_usage.expect("usage");
        // The start's output count is a placeholder: not a count.
        assert_eq!(u.to_usage().completion_tokens, None);
        assert_eq!(u.to_usage().prompt_tokens, Some(26));
        // Older API versions: the delta carries only the (cumulative) output.
        let delta = p(
            r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"output_tokens":8}}"#,
        );
        u.merge(&delta.messages_usage.expect("usage"));
        let total = u.to_usage();
        assert_eq!(
            (
                total.prompt_tokens,
                total.completion_tokens,
                total.cached_tokens()
            ),
            (Some(26), Some(8), Some(21))
        );
        // Newer ones repeat every count there (here with a cache write the start lacked).
        let delta = p(
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":5,"cache_creation_input_tokens":3,"cache_read_input_tokens":21,"output_tokens":9}}"#,
        );
        u.merge(&delta.messages_usage.expect("usage"));
        let total = u.to_usage();
        assert_eq!(total.prompt_tokens, Some(29));
        assert_eq!(total.completion_tokens, Some(9));
        assert_eq!(total.cache_creation_tokens, Some(3));
        // No input count: no prompt total is invented from the cache counts alone.
        let only_cache = MessagesUsage {
            cache_read_input_tokens: Some(4),
            ..MessagesUsage::default()
        };
        assert_eq!(only_cache.to_usage().prompt_tokens, None);
    }

    #[test]
    fn errors() {
        let e = p(r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#);
        assert!(e.is_error && !e.has_output);
        assert!(p(r#"{"type":"error"}"#).is_error);
        assert!(parse(b"{oops").is_err());
        assert!(parse(br#"{"type":"message_start","message":3}"#).is_err());
    }

    #[test]
    fn stop_reasons() {
        for (from, to) in [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("max_tokens", "length"),
            ("model_context_window_exceeded", "length"),
            ("tool_use", "tool_calls"),
            ("refusal", "content_filter"),
            ("pause_turn", "pause_turn"),
        ] {
            assert_eq!(finish_reason(from), to);
        }
    }

    proptest! {
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&data);
        }

        /// The record's input is every prompt token, whichever way Anthropic splits them.
        #[test]
        fn prompt_total_is_the_sum(
            input in 0u64..1_000_000, read in proptest::option::of(0u64..1_000_000),
            created in proptest::option::of(0u64..1_000_000), out in 0u64..2,
        ) {
            let mut fields = vec![format!(r#""input_tokens":{input}"#), format!(r#""output_tokens":{out}"#)];
            if let Some(r) = read { fields.push(format!(r#""cache_read_input_tokens":{r}"#)); }
            if let Some(c) = created { fields.push(format!(r#""cache_creation_input_tokens":{c}"#)); }
            let body = format!(r#"{{"type":"message_start","message":{{"usage":{{{}}}}}}}"#, fields.join(","));
            let u = parse(body.as_bytes()).expect("valid").messages_usage.expect("usage").to_usage();
            prop_assert_eq!(u.prompt_tokens, Some(input + read.unwrap_or(0) + created.unwrap_or(0)));
            prop_assert_eq!(u.completion_tokens, None, "the start's output is a placeholder");
            prop_assert_eq!(u.cached_tokens(), read);
            prop_assert_eq!(u.cache_creation_tokens, created);
        }
    }
}
