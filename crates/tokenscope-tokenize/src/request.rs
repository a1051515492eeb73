//! What to count in an OpenAI request body.
//!
//! - Completions `prompt` and embeddings `input`: a string, a list of strings, a token-id list or
//!   a list of token-id lists (llama.cpp also accepts a mix, and `{"prompt_string": …}` objects
//!   for multimodal prompts; their text is counted). Each string is one *prompt*, tokenized on its
//!   own with special tokens (BOS …) as the engine does; token ids count one each, untokenized.
//! - Chat `messages` with a local tokenizer: the text the client wrote — role, `name`, `content`
//!   (a string or the `text` of content parts), tool-call function names and arguments, and the
//!   request's `tools`/`functions` definitions as JSON — each tokenized without special tokens,
//!   plus a fixed template overhead per message ([`CHAT_TOKENS_PER_MESSAGE`],
//!   [`CHAT_TOKENS_PER_NAME`]) and per reply ([`CHAT_REPLY_PRIMING`]). Those constants are
//!   OpenAI's documented accounting for its chat format ("How to count tokens with tiktoken",
//!   OpenAI cookbook: 3 per message, 1 per name, 3 to prime the reply); other models' templates
//!   differ by a few tokens per message, and non-text parts (images, audio) are not counted. A
//!   local chat count is therefore an estimate: the gateway treats the engine's `usage` as
//!   authoritative and compares the two within a tolerance. An engine tokenizer applies the
//!   model's real template instead (see [`engine`](crate::engine)).
//! - The Responses API (`instructions`, `input`) and the Messages API (`system`, `messages`) are
//!   first written as the chat conversation the engine runs ([`chat_body`]) and counted as chat:
//!   `instructions` / `system` (a string or text blocks, joined) is a leading `system` message;
//!   a Responses `input` string is one `user` message; message items and Anthropic messages keep
//!   their role and their text parts (`input_text`, `output_text`, `text`); a tool call
//!   (`function_call` item, `tool_use` block) becomes an assistant `tool_calls` entry, a tool
//!   output (`function_call_output` item, `tool_result` block) a `tool` message; `tools` become
//!   chat function tools. Other items and blocks (images, files, reasoning) are not counted.
//!   This is how llama.cpp itself converts both APIs before applying the chat template, so an
//!   engine count of a text conversation equals its usage.
//!
//! Invariant: at most [`MAX_COUNT_BYTES`](crate::MAX_COUNT_BYTES) of text is ever handed to a
//! tokenizer for one call; larger prompts are refused with
//! [`TokenizeError::TooLong`] before anything is copied or sent.

use crate::error::TokenizeError;
use serde_json::{json, Value};
use tokenscope_core::Endpoint;

/// Template tokens per chat message (OpenAI format: `<|start|>{role}<|message|>…<|end|>`).
pub const CHAT_TOKENS_PER_MESSAGE: u64 = 3;
/// Extra template tokens when a message has a `name`.
pub const CHAT_TOKENS_PER_NAME: u64 = 1;
/// Template tokens that open the assistant's reply (`<|start|>assistant<|message|>`).
pub const CHAT_REPLY_PRIMING: u64 = 3;

/// Independent prompts of a completions/embeddings request.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Prompts<'a> {
    /// Texts, each tokenized separately with special tokens.
    pub texts: Vec<&'a str>,
    /// Tokens given as ids (counted as they are).
    pub pre_tokenized: u64,
}

/// The countable parts of a chat request for a local tokenizer.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ChatParts<'a> {
    /// Texts tokenized without special tokens.
    pub texts: Vec<&'a str>,
    /// Serialized `tools`/`functions` definitions, tokenized without special tokens.
    pub tools_json: Option<String>,
    /// Template overhead in tokens.
    pub overhead: u64,
}

impl ChatParts<'_> {
    pub(crate) fn bytes(&self) -> usize {
        self.texts.iter().map(|t| t.len()).sum::<usize>()
            + self.tools_json.as_ref().map_or(0, String::len)
    }
}

impl Prompts<'_> {
    pub(crate) fn bytes(&self) -> usize {
        self.texts.iter().map(|t| t.len()).sum()
    }
}

/// Fails with [`TokenizeError::TooLong`] when `len` is over `limit`.
pub(crate) fn check_len(len: usize, limit: usize) -> Result<(), TokenizeError> {
    if len > limit {
        Err(TokenizeError::TooLong { len, limit })
    } else {
        Ok(())
    }
}

/// The prompts of a completions (`prompt`) or embeddings (`input`) body.
pub(crate) fn prompts(endpoint: Endpoint, body: &Value) -> Result<Prompts<'_>, TokenizeError> {
    let no_prompt = || TokenizeError::NoPrompt {
        endpoint: endpoint.as_str(),
    };
    let field = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Embeddings => "input",
        Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages => {
            return Err(no_prompt())
        }
    };
    let v = body.get(field).ok_or_else(no_prompt)?;
    let mut out = Prompts::default();
    match v {
        Value::String(s) => out.texts.push(s),
        Value::Array(items) => {
            for item in items {
                match item {
                    Value::String(s) => out.texts.push(s),
                    Value::Number(_) => out.pre_tokenized += 1,
                    Value::Array(ids) if ids.iter().all(Value::is_number) => {
                        out.pre_tokenized += ids.len() as u64;
                    }
                    Value::Object(o) => match o.get("prompt_string").and_then(Value::as_str) {
                        Some(s) => out.texts.push(s),
                        None => return Err(no_prompt()),
                    },
                    _ => return Err(no_prompt()),
                }
            }
        }
        _ => return Err(no_prompt()),
    }
    Ok(out)
}

/// The countable parts of a chat body (see the module docs).
pub(crate) fn chat_parts(body: &Value) -> Result<ChatParts<'_>, TokenizeError> {
    let messages =
        body.get("messages")
            .and_then(Value::as_array)
            .ok_or(TokenizeError::NoPrompt {
                endpoint: Endpoint::ChatCompletions.as_str(),
            })?;
    let mut out = ChatParts {
        overhead: CHAT_REPLY_PRIMING,
        ..ChatParts::default()
    };
    for m in messages {
        out.overhead += CHAT_TOKENS_PER_MESSAGE;
        if let Some(role) = m.get("role").and_then(Value::as_str) {
            out.texts.push(role);
        }
        if let Some(name) = m.get("name").and_then(Value::as_str) {
            out.texts.push(name);
            out.overhead += CHAT_TOKENS_PER_NAME;
        }
        match m.get("content") {
            Some(Value::String(s)) => out.texts.push(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    match p {
                        Value::String(s) => out.texts.push(s),
                        _ => {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                out.texts.push(t);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            for c in calls {
                let f = c.get("function");
                for key in ["name", "arguments"] {
                    if let Some(s) = f.and_then(|f| f.get(key)).and_then(Value::as_str) {
                        out.texts.push(s);
                    }
                }
            }
        }
    }
    let tools: Vec<&Value> = ["tools", "functions"]
        .iter()
        .filter_map(|k| body.get(*k))
        .filter(|v| !v.is_null())
        .collect();
    if !tools.is_empty() {
        let mut s = String::new();
        for t in tools {
            s.push_str(&t.to_string());
        }
        out.tools_json = Some(s);
    }
    Ok(out)
}

/// A Responses or Messages API body written as a chat body (`messages`, `tools`; see the module
/// docs); `None` for the other endpoints, whose bodies are counted as they are.
pub(crate) fn chat_body(endpoint: Endpoint, body: &Value) -> Result<Option<Value>, TokenizeError> {
    let no_prompt = || TokenizeError::NoPrompt {
        endpoint: endpoint.as_str(),
    };
    let mut messages = Vec::new();
    let tools: Vec<Value>;
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Embeddings => {
            return Ok(None)
        }
        Endpoint::Responses => {
            let input = body.get("input").ok_or_else(no_prompt)?;
            if let Some(i) = body.get("instructions").filter(|i| !i.is_null()) {
                messages.push(json!({"role": "system", "content": joined_text(i)}));
            }
            match input {
                Value::String(s) => messages.push(json!({"role": "user", "content": s})),
                Value::Array(items) => {
                    for item in items {
                        responses_item(item, &mut messages);
                    }
                }
                _ => return Err(no_prompt()),
            }
            tools = list(body, "tools")
                .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
                .map(|t| {
                    let mut f = t.clone();
                    if let Some(o) = f.as_object_mut() {
                        o.remove("type");
                    }
                    json!({"type": "function", "function": f})
                })
                .collect();
        }
        Endpoint::Messages => {
            let msgs = body
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(no_prompt)?;
            if let Some(s) = body.get("system").filter(|s| !s.is_null()) {
                messages.push(json!({"role": "system", "content": joined_text(s)}));
            }
            for m in msgs {
                anthropic_message(m, &mut messages);
            }
            tools = list(body, "tools")
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.get("name").cloned().unwrap_or(Value::Null),
                        "description": t.get("description").cloned().unwrap_or(Value::Null),
                        "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({})),
                    }})
                })
                .collect();
        }
    }
    let mut chat = serde_json::Map::new();
    if let Some(model) = body.get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(messages));
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
    }
    Ok(Some(Value::Object(chat)))
}

/// The elements of `body[key]` when it is an array.
fn list<'a>(body: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    body.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// A string, or the `text` of each block joined (an Anthropic `system`, Responses
/// `instructions`).
fn joined_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        _ => list_of(v)
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
    }
}

fn list_of(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

/// Chat text parts of a content (a string stays a string).
fn text_parts(content: &Value) -> Value {
    match content {
        Value::String(s) => Value::String(s.clone()),
        _ => Value::Array(
            list_of(content)
                .filter(|p| {
                    matches!(
                        p.get("type").and_then(Value::as_str),
                        Some("text" | "input_text" | "output_text")
                    )
                })
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(|t| json!({"type": "text", "text": t}))
                .collect(),
        ),
    }
}

/// One Responses `input` item as chat messages.
fn responses_item(item: &Value, out: &mut Vec<Value>) {
    let field = |k: &str| item.get(k).and_then(Value::as_str);
    if let Some(role) = field("role") {
        let content = item.get("content").map_or(Value::Null, text_parts);
        out.push(json!({"role": role, "content": content}));
        return;
    }
    match field("type") {
        Some("function_call") => out.push(json!({"role": "assistant", "content": "",
            "tool_calls": [{"id": field("call_id").unwrap_or(""), "type": "function",
                "function": {"name": field("name").unwrap_or(""),
                             "arguments": field("arguments").unwrap_or("")}}]})),
        Some("function_call_output") => {
            let output = item.get("output").map_or(Value::Null, text_parts);
            out.push(
                json!({"role": "tool", "tool_call_id": field("call_id").unwrap_or(""),
                "content": output}),
            );
        }
        _ => {}
    }
}

/// One Anthropic message as chat messages (its tool results follow it as `tool` messages).
fn anthropic_message(m: &Value, out: &mut Vec<Value>) {
    let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
    let Some(blocks) = m.get("content").and_then(Value::as_array) else {
        let content = m.get("content").cloned().unwrap_or(Value::Null);
        out.push(json!({"role": role, "content": content}));
        return;
    };
    let mut calls = Vec::new();
    let mut results = Vec::new();
    for b in blocks {
        let field = |k: &str| b.get(k).and_then(Value::as_str).unwrap_or("");
        match b.get("type").and_then(Value::as_str) {
            Some("tool_use") => calls.push(json!({"id": field("id"), "type": "function",
                "function": {"name": field("name"),
                             "arguments": b.get("input").map_or_else(|| "{}".to_owned(), Value::to_string)}})),
            Some("tool_result") => results.push(json!({"role": "tool",
                "tool_call_id": field("tool_use_id"),
                "content": b.get("content").map_or_else(String::new, joined_text)})),
            _ => {}
        }
    }
    let text = text_parts(&Value::Array(blocks.clone()));
    let has_text = text.as_array().is_some_and(|t| !t.is_empty());
    if has_text || !calls.is_empty() {
        let mut msg = json!({"role": role, "content": if has_text { text } else { json!("") }});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        out.push(msg);
    }
    out.extend(results);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn completion_prompt_shapes() {
        let p = |v: Value| {
            let body = json!({ "prompt": v });
            let got = prompts(Endpoint::Completions, &body).map(|p| {
                (
                    p.texts.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
                    p.pre_tokenized,
                )
            });
            got.expect("countable")
        };
        assert_eq!(p(json!("hi")), (vec!["hi".to_owned()], 0));
        assert_eq!(
            p(json!(["a", "b"])),
            (vec!["a".to_owned(), "b".to_owned()], 0)
        );
        assert_eq!(p(json!([1, 2, 3])), (vec![], 3));
        assert_eq!(p(json!([[1, 2], [3]])), (vec![], 3));
        assert_eq!(
            p(json!([{"prompt_string": "x", "multimodal_data": []}, 7])),
            (vec!["x".to_owned()], 1)
        );
    }

    #[test]
    fn embeddings_use_input_and_missing_fields_fail() {
        let body = json!({ "input": ["x", [5, 6]] });
        let got = prompts(Endpoint::Embeddings, &body).expect("countable");
        assert_eq!(got.texts, vec!["x"]);
        assert_eq!(got.pre_tokenized, 2);
        assert!(matches!(
            prompts(Endpoint::Completions, &body),
            Err(TokenizeError::NoPrompt {
                endpoint: "completions"
            })
        ));
        assert!(matches!(
            prompts(Endpoint::Embeddings, &json!({ "input": 3 })),
            Err(TokenizeError::NoPrompt { .. })
        ));
        assert!(matches!(
            prompts(Endpoint::Embeddings, &json!({ "input": [null] })),
            Err(TokenizeError::NoPrompt { .. })
        ));
    }

    #[test]
    fn chat_parts_collect_text_and_overhead() {
        let body = json!({
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "name": "ann", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:..."}}
                ]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}]
        });
        let parts = chat_parts(&body).expect("countable");
        assert_eq!(
            parts.texts,
            vec![
                "system",
                "be brief",
                "user",
                "ann",
                "look",
                "assistant",
                "f",
                "{}",
                "tool",
                "42"
            ]
        );
        assert_eq!(
            parts.overhead,
            CHAT_REPLY_PRIMING + 4 * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_NAME
        );
        // Key order depends on serde_json features; compare the parsed value.
        let tools: Value =
            serde_json::from_str(parts.tools_json.as_deref().expect("tools present"))
                .expect("tools JSON");
        assert_eq!(tools, body["tools"]);
        assert!(matches!(
            chat_parts(&json!({"messages": "hi"})),
            Err(TokenizeError::NoPrompt {
                endpoint: "chat_completions"
            })
        ));
    }

    #[test]
    fn length_limit() {
        assert!(check_len(10, 10).is_ok());
        assert!(matches!(
            check_len(11, 10),
            Err(TokenizeError::TooLong { len: 11, limit: 10 })
        ));
    }

    #[test]
    fn responses_and_messages_as_chat() {
        let chat = |endpoint, body: Value| {
            chat_body(endpoint, &body)
                .expect("countable")
                .expect("converted")
        };
        assert_eq!(
            chat(
                Endpoint::Responses,
                json!({"model": "m", "input": "Say hi", "max_output_tokens": 3})
            ),
            json!({"model": "m", "messages": [{"role": "user", "content": "Say hi"}]})
        );
        assert_eq!(
            chat(
                Endpoint::Responses,
                json!({"instructions": "Be terse.", "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Name a colour"},
                                                 {"type": "input_image", "image_url": "x"}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Red"}]},
                    {"type": "reasoning", "summary": []},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "42"}
                ], "tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "web_search"}]})
            ),
            json!({"messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Red"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
        );
        assert_eq!(
            chat(
                Endpoint::Messages,
                json!({"model": "m", "max_tokens": 5,
                    "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
                    "messages": [
                        {"role": "user", "content": "Name a colour"},
                        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "42"}]}]}
                    ],
                    "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]})
            ),
            json!({"model": "m", "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Name a colour"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
                 "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "42"}
            ], "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}}}]})
        );
        // Chat-shaped endpoints are counted as sent; bodies without a prompt are refused.
        assert!(chat_body(Endpoint::ChatCompletions, &json!({}))
            .expect("ok")
            .is_none());
        assert!(matches!(
            chat_body(Endpoint::Responses, &json!({"input": 3})),
            Err(TokenizeError::NoPrompt {
                endpoint: "responses"
            })
        ));
        assert!(matches!(
            chat_body(Endpoint::Messages, &json!({"system": "s"})),
            Err(TokenizeError::NoPrompt {
                endpoint: "messages"
            })
        ));
    }
}
