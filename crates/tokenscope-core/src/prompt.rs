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

/// Appends `s` with every run of whitespace (as [`char::is_whitespace`] sees it) made one space
/// and none at either end. ASCII text (the common case) is scanned as bytes, whole words
/// copied at once; any other text goes through `split_whitespace` (Unicode spaces).
fn push_normalised(out: &mut String, s: &str) {
    if !s.is_ascii() {
        return push_normalised_unicode(out, s);
    }
    // The ASCII characters `char::is_whitespace` accepts (`u8::is_ascii_whitespace` lacks \x0B).
    fn ws(b: u8) -> bool {
        matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
    }
    let b = s.as_bytes();
    out.reserve(b.len());
    let mut i = 0;
    let mut first = true;
    while i < b.len() {
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        let start = i;
        while i < b.len() && !ws(b[i]) {
            i += 1;
        }
        if start < i {
            if !first {
                out.push(' ');
            }
            // ASCII: every byte index is a char boundary.
            out.push_str(&s[start..i]);
            first = false;
        }
    }
}

fn push_normalised_unicode(out: &mut String, s: &str) {
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

/// Shingles (runs of consecutive words) read by [`prompt_sketch`] at most: a prompt longer
/// than this many words is sketched from its first and last `SKETCH_MAX_SHINGLES / 2`
/// shingles (templated prompts differ in a few fields; the work per request stays bounded).
pub const SKETCH_MAX_SHINGLES: usize = 2048;

/// A similarity sketch of a normalised prompt: a 64-bit SimHash over its word 3-shingles,
/// with ASCII letters lower-cased and every word that holds a digit masked (ids, dates,
/// counters, amounts). A word is a run of ASCII letters and digits and of non-ASCII bytes.
/// Prompts that differ only in masked words have the same sketch; prompts that differ in a few
/// words have sketches a few bits apart (Hamming distance); unrelated prompts differ in about
/// 32 bits. `None` for a prompt without a word. No text is kept: the sketch cannot be turned
/// back into the prompt. Stable across versions (FNV-1a 64 per word, a fixed mix per shingle).
///
/// Cost: one pass over the bytes, one allocation (the word hashes), and a carry-save count of
/// the shingles' bits (≈ 2 operations per shingle instead of 64); see `benches/chunk.rs`.
pub fn prompt_sketch(normalised: &str) -> Option<u64> {
    const PRIME: u64 = 0x0100_0000_01b3;
    let masked = fnv1a(FNV_OFFSET, b"#");
    let bytes = normalised.as_bytes();
    let mut hashes: Vec<u64> = Vec::with_capacity(bytes.len() / 6 + 1);
    let (mut h, mut in_word, mut digit) = (FNV_OFFSET, false, false);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b >= 0x80 {
            in_word = true;
            digit |= b.is_ascii_digit();
            h = (h ^ u64::from(b.to_ascii_lowercase())).wrapping_mul(PRIME);
        } else if in_word {
            hashes.push(if digit { masked } else { h });
            (h, in_word, digit) = (FNV_OFFSET, false, false);
        }
    }
    if in_word {
        hashes.push(if digit { masked } else { h });
    }
    if hashes.is_empty() {
        return None;
    }
    let n = hashes.len().saturating_sub(2).max(1);
    // Bit-sliced counters: plane k holds bit k of each of the 64 per-position counts.
    let mut planes = [0u64; 16];
    let mut count = 0u32;
    let mut add = |i: usize| {
        let w = &hashes[i..(i + 3).min(hashes.len())];
        let mut x = w[0];
        if let Some(b) = w.get(1) {
            x ^= b.rotate_left(21);
        }
        if let Some(c) = w.get(2) {
            x ^= c.rotate_left(42);
        }
        let mut carry = mix64(x);
        for p in planes.iter_mut() {
            if carry == 0 {
                break;
            }
            let t = *p & carry;
            *p ^= carry;
            carry = t;
        }
        count += 1;
    };
    if n <= SKETCH_MAX_SHINGLES {
        (0..n).for_each(&mut add);
    } else {
        let half = SKETCH_MAX_SHINGLES / 2;
        (0..half).chain(n - half..n).for_each(&mut add);
    }
    let mut out = 0u64;
    for bit in 0..64 {
        let ones: u32 = planes
            .iter()
            .enumerate()
            .map(|(k, p)| (((p >> bit) & 1) as u32) << k)
            .sum();
        if 2 * ones > count {
            out |= 1 << bit;
        }
    }
    Some(out)
}

/// SplitMix64's finaliser: spreads a shingle's combined word hashes over all 64 bits.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Bits in which two sketches differ.
pub fn sketch_distance(a: u64, b: u64) -> u32 {
    (a ^ b).count_ones()
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
mod sketch_tests {
    use super::*;
    use proptest::prelude::*;

    const TEMPLATE: &str = "You are the support assistant of Acme. Summarise the ticket below \
        for the on-call engineer, list the affected services, the customer's plan and the \
        steps already tried, and propose the next action. Ticket {ID} opened on {DATE} by \
        customer {CUST}: the dashboard shows no data since the last deploy and exports fail.";

    fn filled(id: u32) -> String {
        TEMPLATE
            .replace("{ID}", &format!("T-{id}"))
            .replace("{DATE}", &format!("2026-12-{:02}", id % 28 + 1))
            .replace("{CUST}", &format!("c{}", id * 7))
    }

    #[test]
    fn templated_prompts_with_changing_ids_have_one_sketch() {
        let a = prompt_sketch(&filled(1)).expect("sketch");
        for id in 2..50 {
            assert_eq!(prompt_sketch(&filled(id)), Some(a), "{id}");
        }
        // A word changed: a few bits apart; another prompt: far.
        let edited = filled(1).replace("exports fail", "imports fail");
        let d = sketch_distance(a, prompt_sketch(&edited).expect("sketch"));
        assert!((1..=12).contains(&d), "{d}");
        let other = prompt_sketch(
            "Write a haiku about the sea at night, with the moon and a lighthouse keeper.",
        )
        .expect("sketch");
        assert!(
            sketch_distance(a, other) >= 16,
            "{}",
            sketch_distance(a, other)
        );
        assert_eq!(prompt_sketch("  ,;  "), None);
        assert_eq!(prompt_sketch("Hello World"), prompt_sketch("hello world"));
    }

    #[test]
    fn long_prompts_are_bounded() {
        let long = "word ".repeat(50_000) + "tail";
        assert!(prompt_sketch(&long).is_some());
    }

    proptest! {
        /// The ASCII byte scan normalises exactly as `split_whitespace` does.
        #[test]
        fn ascii_normalisation_is_split_whitespaces(s in "[a-c \t\n\r\x0B\x0C.]{0,60}") {
            let mut fast = String::from("x");
            push_normalised(&mut fast, &s);
            let mut slow = String::from("x");
            push_normalised_unicode(&mut slow, &s);
            prop_assert_eq!(fast, slow);
        }

        #[test]
        fn sketches_are_deterministic_and_masking_numbers_is_neutral(
            words in proptest::collection::vec("[a-z]{1,8}", 1..200),
            nums in proptest::collection::vec(0u32..1_000_000, 1..5),
        ) {
            let text = words.join(" ");
            prop_assert_eq!(prompt_sketch(&text), prompt_sketch(&text));
            let a = format!("{text} {}", nums.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" "));
            let b = format!("{text} {}", nums.iter().map(|n| (n + 1).to_string()).collect::<Vec<_>>().join(" "));
            prop_assert_eq!(prompt_sketch(&a), prompt_sketch(&b));
        }
    }
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
