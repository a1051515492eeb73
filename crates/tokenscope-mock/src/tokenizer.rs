//! The toy tokenizer: each whitespace-separated word is `ceil(chars / 4)` tokens (at least 1).

/// Vocabulary size of the toy tokenizer's ids.
const VOCAB: u64 = 32_000;
/// Characters per token piece.
const PIECE_CHARS: usize = 4;

/// Number of tokens in `text`: each whitespace-separated word counts `ceil(chars / 4)`, at least 1.
/// Empty or all-whitespace text is 0 tokens.
pub fn count_tokens(text: &str) -> u64 {
    text.split_whitespace()
        .map(|w| (w.chars().count().div_ceil(PIECE_CHARS)).max(1) as u64)
        .sum()
}

/// Token ids of `text`, one per 4-character piece of each word; `tokenize(t).len() ==
/// count_tokens(t)`. Ids are a hash of the piece, so equal pieces get equal ids.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for word in text.split_whitespace() {
        let chars: Vec<char> = word.chars().collect();
        for piece in chars.chunks(PIECE_CHARS) {
            // FNV-1a over the piece's UTF-8 bytes.
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            let mut buf = [0u8; 4];
            for c in piece {
                for b in c.encode_utf8(&mut buf).bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
            // The modulo keeps the id below VOCAB, which fits in u32.
            out.push((h % VOCAB) as u32);
        }
    }
    out
}

/// Prompt tokens of a chat message list: 4 per message (role/template) plus its content.
pub(crate) fn chat_prompt_tokens(messages: &[serde_json::Value]) -> u64 {
    messages
        .iter()
        .map(|m| 4 + m.get("content").map_or(0, content_tokens))
        .sum()
}

/// Tokens of a message `content`: a string, or an array of parts (text parts by their `text`,
/// other parts by their JSON).
fn content_tokens(content: &serde_json::Value) -> u64 {
    use serde_json::Value;
    match content {
        Value::String(s) => count_tokens(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text").and_then(Value::as_str) {
                Some(t) => count_tokens(t),
                None => count_tokens(&p.to_string()),
            })
            .sum(),
        Value::Null => 0,
        other => count_tokens(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_words_by_four_chars() {
        assert_eq!(count_tokens(""), 0);
        assert_eq!(count_tokens("   \n"), 0);
        assert_eq!(count_tokens("a"), 1);
        assert_eq!(count_tokens("abcd"), 1);
        assert_eq!(count_tokens("abcde"), 2);
        assert_eq!(count_tokens("hello  world\tfoo"), 2 + 2 + 1);
        // Chars, not bytes.
        assert_eq!(count_tokens("ééééé"), 2);
    }

    #[test]
    fn tokenize_matches_count() {
        for t in [
            "",
            "a",
            "hello world",
            "The quick brown fox jumps",
            "ééééé x",
        ] {
            assert_eq!(tokenize(t).len() as u64, count_tokens(t), "{t:?}");
        }
        assert_eq!(tokenize("abcd abcd"), {
            let one = tokenize("abcd");
            [one.clone(), one].concat()
        });
        assert!(tokenize("some words here")
            .iter()
            .all(|&id| u64::from(id) < VOCAB));
    }

    #[test]
    fn chat_adds_four_per_message() {
        let msgs = vec![
            serde_json::json!({"role": "system", "content": "be brief"}),
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": "hello"}]}),
            serde_json::json!({"role": "assistant", "content": null}),
        ];
        assert_eq!(chat_prompt_tokens(&msgs), (4 + 1 + 2) + (4 + 2) + 4);
    }
}
