//! Prompt normalisation and hashing.
//!
//! The prompt text is not stored by default; its hash is, so that repeated identical prompts
//! (loops, duplicate submissions, cacheable prompts) can be found without keeping user data.
//!
//! Normalisation: for chat requests, each message contributes its role and the concatenation of
//! its text parts; for completions the `prompt` (string or list of strings); for embeddings the
//! `input`. Runs of whitespace collapse to one space and ends are trimmed, so formatting-only
//! differences hash the same. Non-text parts (images, token-id arrays) are included through their
//! canonical JSON, so they still distinguish prompts.

use crate::record::Endpoint;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The normalised prompt text of a request body, or `None` when the body has none.
pub fn normalised_prompt(endpoint: Endpoint, body: &Value) -> Option<String> {
    let mut out = String::new();
    match endpoint {
        Endpoint::ChatCompletions => {
            for m in body.get("messages")?.as_array()? {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                out.push_str(role);
                out.push('\u{1f}');
                match m.get("content") {
                    Some(Value::String(s)) => push_normalised(&mut out, s),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            match p.get("text").and_then(Value::as_str) {
                                Some(t) => push_normalised(&mut out, t),
                                None => out.push_str(&p.to_string()),
                            }
                        }
                    }
                    Some(other) if !other.is_null() => out.push_str(&other.to_string()),
                    _ => {}
                }
                out.push('\u{1e}');
            }
        }
        Endpoint::Completions => push_value(&mut out, body.get("prompt")?),
        Endpoint::Embeddings => push_value(&mut out, body.get("input")?),
    }
    Some(out)
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
        assert_eq!(estimate_tokens("abcde"), 2);
    }
}
