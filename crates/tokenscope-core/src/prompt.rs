//! Prompt normalisation and hashing.
//!
//! The prompt text is not stored by default; its hash is, so that repeated identical prompts
//! (loops, duplicate submissions, cacheable prompts) can be found without keeping user data.
//!
//! Normalisation: for chat requests, each message contributes its role and the concatenation of
//! its text parts; for completions the `prompt` (string or list of strings); for embeddings the
//! `input`. The Responses API's `instructions` and the Messages API's `system` are a leading
//! `system` message; a Responses `input` string is one `user` message, its items with a role are
//! messages, other items (tool outputs, references) their canonical JSON. Runs of whitespace collapse to one space and ends are trimmed, so formatting-only
//! differences hash the same. Non-text parts (images, token-id arrays) are included through their
//! canonical JSON, so they still distinguish prompts.

use crate::record::Endpoint;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The normalised prompt text of a request body, or `None` when the body has none.
pub fn normalised_prompt(endpoint: Endpoint, body: &Value) -> Option<String> {
    let mut out = String::new();
    match endpoint {
        Endpoint::ChatCompletions => push_messages(&mut out, body.get("messages")?.as_array()?),
        Endpoint::Completions => push_value(&mut out, body.get("prompt")?),
        Endpoint::Embeddings => push_value(&mut out, body.get("input")?),
        Endpoint::Messages => {
            let messages = body.get("messages")?.as_array()?;
            if let Some(system) = body.get("system") {
                push_message(&mut out, "system", Some(system));
            }
            push_messages(&mut out, messages);
        }
        Endpoint::Responses => {
            let input = body.get("input")?;
            if let Some(instructions) = body.get("instructions") {
                push_message(&mut out, "system", Some(instructions));
            }
            match input {
                Value::Array(items) => {
                    for item in items {
                        match item.get("role").and_then(Value::as_str) {
                            Some(role) => push_message(&mut out, role, item.get("content")),
                            None => {
                                out.push_str(&item.to_string());
                                out.push('\u{1e}');
                            }
                        }
                    }
                }
                other => push_message(&mut out, "user", Some(other)),
            }
        }
    }
    Some(out)
}

fn push_messages(out: &mut String, messages: &[Value]) {
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        push_message(out, role, m.get("content"));
    }
}

/// One message: its role, then its text (a string, or the `text` of each part; other parts
/// as canonical JSON).
fn push_message(out: &mut String, role: &str, content: Option<&Value>) {
    out.push_str(role);
    out.push('\u{1f}');
    match content {
        Some(Value::String(s)) => push_normalised(out, s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => push_normalised(out, t),
                    None => out.push_str(&p.to_string()),
                }
            }
        }
        Some(other) if !other.is_null() => out.push_str(&other.to_string()),
        _ => {}
    }
    out.push('\u{1e}');
}

fn push_value(out: &mut String, v: &Value) {
    match v {
        Value::String(s) => push_normalised(out, s),
        Value::Array(items) => {
            for i in items {
                push_value(out, i);
                out.push('\u{1e}');
            }
        }
        other => out.push_str(&other.to_string()),
    }
}

fn push_normalised(out: &mut String, s: &str) {
    let mut first = true;
    for w in s.split_whitespace() {
        if !first {
            out.push(' ');
        }
        out.push_str(w);
        first = false;
    }
}

/// Hex of the first 16 bytes of SHA-256 over the normalised prompt, prefixed by the model so the
/// same text sent to two models hashes differently.
pub fn prompt_hash(model: &str, normalised: &str) -> String {
    let mut h = Sha256::new();
    h.update(model.as_bytes());
    h.update([0u8]);
    h.update(normalised.as_bytes());
    let digest = h.finalize();
    hex(&digest[..16])
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

/// Entry-time estimate of input tokens from text length (≈ 4 bytes per token, at least 1 for a
/// non-empty prompt). Used only until the engine's usage arrives.
pub fn estimate_tokens(normalised: &str) -> u64 {
    (normalised.len() as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn whitespace_does_not_change_hash() {
        let a = json!({"messages":[{"role":"user","content":"Hello   world\n"}]});
        let b =
            json!({"messages":[{"role":"user","content":[{"type":"text","text":" Hello world"}]}]});
        let na = normalised_prompt(Endpoint::ChatCompletions, &a).expect("prompt");
        let nb = normalised_prompt(Endpoint::ChatCompletions, &b).expect("prompt");
        assert_eq!(na, nb);
        assert_eq!(prompt_hash("m", &na), prompt_hash("m", &nb));
        assert_ne!(prompt_hash("m", &na), prompt_hash("other", &na));
        assert_eq!(prompt_hash("m", &na).len(), 32);
    }

    /// The same conversation hashes the same through chat, the Responses API and the Messages
    /// API (the system prompt as `instructions` / `system`, text parts of any kind).
    #[test]
    fn one_conversation_three_apis() {
        let chat = json!({"messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Name a colour"}]});
        let responses = json!({"instructions":"Be terse.","input":[{"role":"user","content":[{"type":"input_text","text":"Name  a colour"}]}]});
        let messages = json!({"system":[{"type":"text","text":"Be terse."}],"messages":[{"role":"user","content":[{"type":"text","text":"Name a colour"}]}]});
        let want = normalised_prompt(Endpoint::ChatCompletions, &chat).expect("prompt");
        assert_eq!(
            normalised_prompt(Endpoint::Responses, &responses).as_deref(),
            Some(want.as_str())
        );
        assert_eq!(
            normalised_prompt(Endpoint::Messages, &messages).as_deref(),
            Some(want.as_str())
        );
        // A bare input string is the user's message.
        let chat = json!({"messages":[{"role":"user","content":"Say hi"}]});
        assert_eq!(
            normalised_prompt(Endpoint::Responses, &json!({"input":"Say hi"})),
            normalised_prompt(Endpoint::ChatCompletions, &chat)
        );
        // Items without a role (tool outputs) still distinguish prompts.
        let a = json!({"input":[{"type":"function_call_output","call_id":"c","output":"1"}]});
        let b = json!({"input":[{"type":"function_call_output","call_id":"c","output":"2"}]});
        assert_ne!(
            normalised_prompt(Endpoint::Responses, &a),
            normalised_prompt(Endpoint::Responses, &b)
        );
    }

    #[test]
    fn roles_matter() {
        let a = json!({"messages":[{"role":"user","content":"x"}]});
        let b = json!({"messages":[{"role":"system","content":"x"}]});
        assert_ne!(
            normalised_prompt(Endpoint::ChatCompletions, &a),
            normalised_prompt(Endpoint::ChatCompletions, &b)
        );
    }

    #[test]
    fn completion_and_embedding_inputs() {
        let c = json!({"prompt":"a  b"});
        assert_eq!(
            normalised_prompt(Endpoint::Completions, &c).as_deref(),
            Some("a b")
        );
        let e = json!({"input":["x","y"]});
        assert_eq!(
            normalised_prompt(Endpoint::Embeddings, &e).as_deref(),
            Some("x\u{1e}y\u{1e}")
        );
        assert_eq!(normalised_prompt(Endpoint::Completions, &json!({})), None);
        assert_eq!(normalised_prompt(Endpoint::Responses, &json!({})), None);
        assert_eq!(
            normalised_prompt(Endpoint::Messages, &json!({"system": "s"})),
            None
        );
        assert_eq!(estimate_tokens("abcde"), 2);
    }
}
