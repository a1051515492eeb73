//! Reading OpenAI Responses API bodies and streamed events (`/v1/responses`), into the same
//! [`PayloadInfo`] the chat endpoints give.
//!
//! A streamed response is a sequence of typed events (`data.type`; there is no `[DONE]`). A
//! non-streamed body is the response object itself, without a `type`; so one function reads
//! both:
//!
//! | `type` | what it tells |
//! |---|---|
//! | none (a body) | id, model, usage, status; output from its `output` items (message text and refusals, reasoning text and summaries, tool calls) |
//! | `response.created`, `response.in_progress`, `response.queued` | id, model |
//! | any `response.….delta` whose `delta` is a non-empty string: output text, refusal, reasoning text or summary, function-call / custom-tool / MCP arguments, code, audio transcript, audio | one output chunk (its text for the text kinds) |
//! | `response.output_item.added` of an item with a `name` (a function, custom tool or MCP call) | one output chunk: the name is generated, as in chat's first `tool_calls` chunk |
//! | `response.completed`, `response.incomplete`, `response.failed` | usage, model, finish reason; `failed` is an error. The repeated `output` is not output again (the deltas were) |
//! | `error` | the stream failed |
//! | anything else | nothing |
//!
//! Usage keeps OpenAI's meaning, the record's: `input_tokens` includes the cached
//! `input_tokens_details.cached_tokens`, `output_tokens` the reasoning
//! `output_tokens_details.reasoning_tokens`. llama.cpp puts its `timings` at the top level of
//! `response.completed` (not in a non-streamed body).
//!
//! The finish reason is written in the chat vocabulary the record and the analyses use:
//! `completed` → `stop` (`tool_calls` when the output holds a tool call), `incomplete` →
//! `length` for `max_output_tokens`, `content_filter` for `content_filter`, else the reason as
//! sent; `failed` and unfinished statuses have none.
//!
//! Like [`crate::openai`], nothing here panics, counts are never invented, and strings are
//! borrowed from the input when they have no escapes.

use crate::openai::{lenient_u64, BStr, LlamaTimings, PayloadError, PayloadInfo, Usage};
use serde::de::IgnoredAny;
use serde::Deserialize;
use std::borrow::Cow;

/// The Responses API's `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
struct RawUsage {
    #[serde(default, deserialize_with = "lenient_u64")]
    input_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient_u64")]
    output_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient_u64")]
    total_tokens: Option<u64>,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
    #[serde(default)]
    output_tokens_details: Option<OutputDetails>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
struct InputDetails {
    #[serde(default, deserialize_with = "lenient_u64")]
    cached_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
struct OutputDetails {
    #[serde(default, deserialize_with = "lenient_u64")]
    reasoning_tokens: Option<u64>,
}

impl RawUsage {
    fn to_usage(self) -> Usage {
        Usage {
            prompt_tokens: self.input_tokens,
            completion_tokens: self.output_tokens,
            total_tokens: self.total_tokens,
            prompt_tokens_details: self.input_tokens_details.map(|d| {
                crate::openai::PromptDetails {
                    cached_tokens: d.cached_tokens,
                }
            }),
            completion_tokens_details: self.output_tokens_details.map(|d| {
                crate::openai::CompletionDetails {
                    reasoning_tokens: d.reasoning_tokens,
                }
            }),
            cache_creation_tokens: None,
        }
    }
}

#[derive(Deserialize)]
struct RawEvent<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<BStr<'a>>,
    #[serde(borrow, default)]
    delta: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    item: Option<RawItem<'a>>,
    #[serde(borrow, default)]
    response: Option<RawResponse<'a>>,
    #[serde(default)]
    timings: Option<LlamaTimings>,
    // A non-streamed body: the response object's own fields (as in `RawResponse`).
    #[serde(borrow, default)]
    id: Option<BStr<'a>>,
    #[serde(borrow, default)]
    model: Option<BStr<'a>>,
    #[serde(borrow, default)]
    status: Option<BStr<'a>>,
    #[serde(borrow, default)]
    output: Option<Vec<RawItem<'a>>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(borrow, default)]
    incomplete_details: Option<Incomplete<'a>>,
}

#[derive(Deserialize)]
struct RawResponse<'a> {
    #[serde(borrow, default)]
    id: Option<BStr<'a>>,
    #[serde(borrow, default)]
    model: Option<BStr<'a>>,
    #[serde(borrow, default)]
    status: Option<BStr<'a>>,
    #[serde(borrow, default)]
    output: Option<Vec<RawItem<'a>>>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(borrow, default)]
    incomplete_details: Option<Incomplete<'a>>,
}

#[derive(Deserialize)]
struct Incomplete<'a> {
    #[serde(borrow, default)]
    reason: Option<BStr<'a>>,
}

/// An output item: a message, reasoning, or a tool call.
#[derive(Deserialize)]
struct RawItem<'a> {
    #[serde(borrow, default)]
    name: Option<BStr<'a>>,
    #[serde(borrow, default)]
    arguments: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    content: Option<Vec<RawPart<'a>>>,
    #[serde(borrow, default)]
    summary: Option<Vec<RawPart<'a>>>,
}

/// A content part (`output_text`, `refusal`, `reasoning_text`, `summary_text`).
#[derive(Deserialize)]
struct RawPart<'a> {
    #[serde(borrow, default)]
    text: Option<BStr<'a>>,
    #[serde(borrow, default)]
    refusal: Option<BStr<'a>>,
}

/// A string, or anything else (ignored): an unknown event's `delta` may be an object.
#[derive(Deserialize)]
#[serde(untagged)]
enum Lenient<'a> {
    Text(#[serde(borrow)] BStr<'a>),
    Other(IgnoredAny),
}

impl<'a> Lenient<'a> {
    fn text(self) -> Option<Cow<'a, str>> {
        match self {
            Lenient::Text(t) if !t.0.is_empty() => Some(t.0),
            _ => None,
        }
    }
}

/// The finish reason of a finished response, in the chat vocabulary (see the module docs).
fn finish_reason<'a>(
    status: Option<&str>,
    incomplete: Option<Incomplete<'a>>,
    tool_call: bool,
) -> Option<Cow<'a, str>> {
    match status? {
        "completed" if tool_call => Some(Cow::Borrowed("tool_calls")),
        "completed" => Some(Cow::Borrowed("stop")),
        "incomplete" => {
            let reason = incomplete.and_then(|i| i.reason).map(|r| r.0);
            Some(match reason.as_deref() {
                Some("max_output_tokens") | None => Cow::Borrowed("length"),
                Some("content_filter") => Cow::Borrowed("content_filter"),
                Some(_) => reason.unwrap_or_default(),
            })
        }
        _ => None,
    }
}

/// Reads the response object of a body or a terminal event; `count_output` reads its output
/// items as output (a body; a stream's output came as deltas).
fn read_response<'a>(info: &mut PayloadInfo<'a>, r: RawResponse<'a>, count_output: bool) {
    info.id = r.id.map(|i| i.0);
    info.model = r.model.map(|m| m.0);
    info.usage = r.usage.map(RawUsage::to_usage);
    info.is_error |= r.error.is_some() || r.status.as_ref().is_some_and(|s| s.0 == "failed");
    let mut tool_call = false;
    for item in r.output.into_iter().flatten() {
        let named = item.name.as_ref().is_some_and(|n| !n.0.is_empty());
        tool_call |= named;
        if !count_output {
            continue;
        }
        info.has_output |= named;
        if let Some(args) = item.arguments.and_then(Lenient::text) {
            info.has_output = true;
            info.output_bytes += args.len();
        }
        let parts = item.content.into_iter().chain(item.summary).flatten();
        for t in parts.flat_map(|p| [p.text, p.refusal]).flatten() {
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
    let status = r.status.as_ref().map(|s| s.0.as_ref());
    info.finish_reason = finish_reason(status, r.incomplete_details, tool_call);
}

/// Kinds of `….delta` whose text is the model's text (kept for counting a cancelled stream).
fn is_text_delta(kind: &str) -> bool {
    matches!(
        kind,
        "response.output_text.delta"
            | "response.refusal.delta"
            | "response.reasoning_text.delta"
            | "response.reasoning_summary_text.delta"
    )
}

/// Reads a Responses API body or one streamed event's `data:` (see the module docs).
pub fn parse(data: &[u8]) -> Result<PayloadInfo<'_>, PayloadError> {
    let raw: RawEvent<'_> = serde_json::from_slice(data)?;
    let mut info = PayloadInfo {
        timings: raw.timings,
        ..PayloadInfo::default()
    };
    let Some(kind) = raw.kind else {
        let body = RawResponse {
            id: raw.id,
            model: raw.model,
            status: raw.status,
            output: raw.output,
            usage: raw.usage,
            error: raw.error,
            incomplete_details: raw.incomplete_details,
        };
        read_response(&mut info, body, true);
        return Ok(info);
    };
    let kind = kind.0.as_ref();
    match kind {
        "error" => info.is_error = true,
        "response.completed" | "response.incomplete" | "response.failed" => {
            if let Some(r) = raw.response {
                read_response(&mut info, r, false);
            }
            info.is_error |= kind == "response.failed";
        }
        "response.created" | "response.in_progress" | "response.queued" => {
            if let Some(r) = raw.response {
                info.id = r.id.map(|i| i.0);
                info.model = r.model.map(|m| m.0);
            }
        }
        "response.output_item.added" => {
            info.has_output = raw
                .item
                .is_some_and(|i| i.name.is_some_and(|n| !n.0.is_empty()));
        }
        _ if kind.ends_with(".delta") => {
            if let Some(d) = raw.delta.and_then(Lenient::text) {
                info.has_output = true;
                if kind != "response.audio.delta" {
                    info.output_bytes += d.len();
                }
                if is_text_delta(kind) {
                    info.text = Some(d);
                }
            }
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
            r#"{"completed_at":1796409390,"created_at":1796409390,"id":"resp_Jihn","model":"gemma.gguf","object":"response","output":[{"content":[{"type":"output_text","annotations":[],"logprobs":[],"text":"<|im_end|>\n<"}],"id":"msg_g","role":"assistant","status":"completed","type":"message"}],"status":"completed","usage":{"input_tokens":26,"output_tokens":8,"total_tokens":34,"input_tokens_details":{"cached_tokens":0}}}"#,
        );
        assert!(b.has_output && !b.is_error);
        assert_eq!(b.id.as_deref(), Some("resp_Jihn"));
        assert_eq!(b.model.as_deref(), Some("gemma.gguf"));
        assert_eq!(b.text.as_deref(), Some("<|im_end|>\n<"));
        assert_eq!(b.output_bytes, 12);
        assert_eq!(b.finish_reason.as_deref(), Some("stop"));
        let u = b.usage.expect("usage");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (Some(26), Some(8)));
        assert_eq!(u.cached_tokens(), Some(0));
        assert_eq!(b.timings, None);
    }

    #[test]
    fn body_with_reasoning_tool_call_and_incomplete() {
        let b = p(
            r#"{"id":"resp_1","object":"response","status":"completed","output":[{"type":"reasoning","summary":[{"type":"summary_text","text":"Thinking"}]},{"type":"function_call","name":"get_weather","arguments":"{\"city\":\"Paris\"}","call_id":"c1"}],"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":40},"output_tokens":30,"output_tokens_details":{"reasoning_tokens":20},"total_tokens":80}}"#,
        );
        assert!(b.has_output);
        assert_eq!(b.text.as_deref(), Some("Thinking"));
        assert_eq!(b.output_bytes, 8 + 16);
        assert_eq!(b.finish_reason.as_deref(), Some("tool_calls"));
        let u = b.usage.expect("usage");
        assert_eq!(u.cached_tokens(), Some(40));
        assert_eq!(u.reasoning_tokens(), Some(20));
        let inc = p(
            r#"{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[]}"#,
        );
        assert_eq!(inc.finish_reason.as_deref(), Some("length"));
        assert!(!inc.has_output);
        let filtered =
            p(r#"{"status":"incomplete","incomplete_details":{"reason":"content_filter"}}"#);
        assert_eq!(filtered.finish_reason.as_deref(), Some("content_filter"));
        let refusal = p(
            r#"{"status":"completed","output":[{"type":"message","content":[{"type":"refusal","refusal":"No."}]}]}"#,
        );
        assert!(refusal.has_output);
        assert_eq!(refusal.text.as_deref(), Some("No."));
        assert_eq!(p(r#"{"status":"queued"}"#).finish_reason, None);
    }

    /// Each streamed event, one per line: (data, output chunk?, text, finish reason, error?).
    #[test]
    fn stream_events_table() {
        type Row = (
            &'static str,
            bool,
            Option<&'static str>,
            Option<&'static str>,
            bool,
        );
        let rows: &[Row] = &[
            (
                r#"{"type":"response.created","response":{"id":"resp_N","object":"response","status":"in_progress"}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.in_progress","response":{"id":"resp_N","object":"response","status":"in_progress"}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.output_item.added","item":{"content":[],"id":"msg_x","role":"assistant","status":"in_progress","type":"message"}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.content_part.added","item_id":"msg_x","part":{"type":"output_text","text":""}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.output_text.delta","item_id":"msg_x","delta":"<"}"#,
                true,
                Some("<"),
                None,
                false,
            ),
            (
                r#"{"type":"response.output_text.delta","item_id":"msg_x","delta":""}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.reasoning_text.delta","item_id":"rs_1","delta":"Let"}"#,
                true,
                Some("Let"),
                None,
                false,
            ),
            (
                r#"{"type":"response.reasoning_summary_text.delta","item_id":"rs_1","delta":"Sum"}"#,
                true,
                Some("Sum"),
                None,
                false,
            ),
            (
                r#"{"type":"response.refusal.delta","item_id":"msg_x","delta":"No"}"#,
                true,
                Some("No"),
                None,
                false,
            ),
            (
                r#"{"type":"response.output_item.added","item":{"type":"function_call","name":"get_weather","arguments":"","call_id":"c1"}}"#,
                true,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","delta":"{\"ci"}"#,
                true,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.audio.delta","delta":"UklGR"}"#,
                true,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.future_thing.delta","delta":{"x":1}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.output_text.done","item_id":"msg_x","text":"<|im_end|>\n<"}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.content_part.done","item_id":"msg_x","part":{"type":"output_text","text":"<|im_end|>\n<"}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.output_item.done","item":{"type":"message","status":"completed","content":[{"type":"output_text","text":"<|im_end|>\n<"}],"role":"assistant"}}"#,
                false,
                None,
                None,
                false,
            ),
            (
                r#"{"type":"response.completed","response":{"id":"resp_N","status":"completed","model":"gemma.gguf","output":[{"type":"message","content":[{"type":"output_text","text":"<|im_end|>\n<"}]}],"usage":{"input_tokens":26,"output_tokens":8,"total_tokens":34,"input_tokens_details":{"cached_tokens":21}}},"timings":{"cache_n":21,"prompt_n":5,"prompt_ms":56.921,"predicted_n":8,"predicted_ms":206.434}}"#,
                false,
                None,
                Some("stop"),
                false,
            ),
            (
                r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":3,"output_tokens":4}}}"#,
                false,
                None,
                Some("length"),
                false,
            ),
            (
                r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"boom"}}}"#,
                false,
                None,
                None,
                true,
            ),
            (
                r#"{"type":"error","code":"ERR_SOMETHING","message":"Something went wrong","param":null,"sequence_number":1}"#,
                false,
                None,
                None,
                true,
            ),
        ];
        for (data, output, text, finish, error) in rows {
            let e = p(data);
            assert_eq!(e.has_output, *output, "{data}");
            assert_eq!(e.text.as_deref(), *text, "{data}");
            assert_eq!(e.finish_reason.as_deref(), *finish, "{data}");
            assert_eq!(e.is_error, *error, "{data}");
        }
        let done = p(rows[16].0);
        let u = done.usage.expect("usage");
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens()),
            (Some(26), Some(8), Some(21))
        );
        let t = done.timings.expect("llama.cpp timings");
        assert_eq!(
            (t.prompt_n, t.cache_n, t.predicted_n),
            (Some(5), Some(21), Some(8))
        );
        assert_eq!(t.prompt_ms, Some(56.921));
        assert_eq!(done.model.as_deref(), Some("gemma.gguf"));
        assert_eq!(
            done.output_bytes, 0,
            "the repeated output is not output again"
        );
        let created = p(rows[0].0);
        assert_eq!(created.id.as_deref(), Some("resp_N"));
    }

    #[test]
    fn error_bodies_and_garbage() {
        let e = p(
            r#"{"error":{"code":400,"message":"'input' must be a string or array of objects","type":"invalid_request_error"}}"#,
        );
        assert!(e.is_error && !e.has_output);
        assert!(!p(r#"{"status":"completed","error":null}"#).is_error);
        assert!(p(r#"{"status":"failed"}"#).is_error);
        assert!(parse(b"{oops").is_err());
        assert!(parse(b"[DONE]").is_err());
    }

    proptest! {
        #[test]
        fn never_panics(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&data);
        }

        #[test]
        fn usage_numbers_round_trip(i in 0u64..1_000_000, c in 0u64..1_000_000, o in 0u64..1_000_000) {
            let body = format!(r#"{{"type":"response.completed","response":{{"usage":{{"input_tokens":{i},"output_tokens":{o},"input_tokens_details":{{"cached_tokens":{c}}}}}}}}}"#);
            let u = parse(body.as_bytes()).expect("valid").usage.expect("usage");
            prop_assert_eq!(u.prompt_tokens, Some(i));
            prop_assert_eq!(u.completion_tokens, Some(o));
            prop_assert_eq!(u.cached_tokens(), Some(c));
        }

        /// Any non-empty text delta is exactly one output chunk carrying that text.
        #[test]
        fn text_deltas_are_output(text in "[a-zA-Z0-9 ]{1,20}") {
            let body = format!(r#"{{"type":"response.output_text.delta","delta":"{text}"}}"#);
            let e = parse(body.as_bytes()).expect("valid");
            prop_assert!(e.has_output);
            prop_assert_eq!(e.text.as_deref(), Some(text.as_str()));
            prop_assert_eq!(e.output_bytes, text.len());
        }
    }
}
