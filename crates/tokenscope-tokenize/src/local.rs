//! Tokenizers that run in-process: a Hugging Face `tokenizer.json` or a built-in tiktoken
//! encoding.
//!
//! Invariants:
//! - Everything is loaded by [`LocalTokenizer::load`] at startup; counting never touches the
//!   file system or the network.
//! - Hugging Face tokenizers are loaded with truncation and padding switched off, whatever the
//!   file says, so a count is the length of the whole text, never a model's `max_length`.
//! - tiktoken counts use `encode_ordinary`: text that looks like a special token
//!   (`<|endoftext|>`) is counted as ordinary text, as user content is.
//! - These calls are CPU-bound (≈ 1 µs per token); [`Tokenizers`](crate::Tokenizers) runs them on
//!   tokio's blocking pool, never on an async worker.

use crate::error::TokenizeError;
use std::fmt;
use std::path::Path;

/// A loaded in-process tokenizer.
pub struct LocalTokenizer {
    kind: Kind,
    name: String,
}

enum Kind {
    HuggingFace(Box<tokenizers::Tokenizer>),
    Tiktoken(Box<tiktoken_rs::CoreBPE>),
}

impl fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl LocalTokenizer {
    /// Loads a Hugging Face `tokenizer.json` from disk (offline).
    pub fn hugging_face(path: &Path) -> Result<Self, TokenizeError> {
        let load_err = |message: String| TokenizeError::LoadHuggingFace {
            path: path.to_owned(),
            message,
        };
        let mut tok =
            tokenizers::Tokenizer::from_file(path).map_err(|e| load_err(e.to_string()))?;
        tok.with_truncation(None)
            .map_err(|e| load_err(e.to_string()))?;
        tok.with_padding(None);
        Ok(LocalTokenizer {
            kind: Kind::HuggingFace(Box::new(tok)),
            name: format!("hf:{}", path.display()),
        })
    }

    /// Loads a tiktoken encoding built into the binary: `cl100k_base`, `o200k_base`,
    /// `p50k_base`, `r50k_base`.
    pub fn tiktoken(encoding: &str) -> Result<Self, TokenizeError> {
        let bpe = match encoding {
            "cl100k_base" => tiktoken_rs::cl100k_base(),
            "o200k_base" => tiktoken_rs::o200k_base(),
            "p50k_base" => tiktoken_rs::p50k_base(),
            "r50k_base" => tiktoken_rs::r50k_base(),
            other => return Err(TokenizeError::UnknownEncoding(other.to_owned())),
        }
        .map_err(|e| TokenizeError::LoadTiktoken {
            encoding: encoding.to_owned(),
            message: e.to_string(),
        })?;
        Ok(LocalTokenizer {
            kind: Kind::Tiktoken(Box::new(bpe)),
            name: format!("tiktoken:{encoding}"),
        })
    }

    /// `hf:<path>` or `tiktoken:<encoding>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Token ids of `text`. `add_special` adds the tokenizer's special tokens (BOS, …) as its
    /// post-processor says; tiktoken encodings have none to add.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.kind {
            Kind::HuggingFace(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            Kind::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text)),
        }
    }

    /// Number of tokens of `text` (see [`encode`](Self::encode)).
    pub fn count(&self, text: &str, add_special: bool) -> Result<u64, TokenizeError> {
        if text.is_empty() && !add_special {
            return Ok(0);
        }
        match &self.kind {
            Kind::HuggingFace(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.len() as u64)
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            Kind::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text).len() as u64),
        }
    }
}
