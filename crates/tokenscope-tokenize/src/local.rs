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
//! - Each kind is a default-on cargo feature of this crate (`tokenizers` for `hf`, `tiktoken`
//!   for `tiktoken`). A binary built without one answers [`TokenizeError::NotBuilt`] when such
//!   a tokenizer is configured: a startup error, never a panic or a silent fallback.
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
    #[cfg(feature = "tokenizers")]
    HuggingFace(Box<tokenizers::Tokenizer>),
    #[cfg(feature = "tiktoken")]
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
    #[cfg(feature = "tokenizers")]
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

    /// Built without the `tokenizers` feature: [`TokenizeError::NotBuilt`].
    #[cfg(not(feature = "tokenizers"))]
    pub fn hugging_face(_path: &Path) -> Result<Self, TokenizeError> {
        Err(TokenizeError::NotBuilt {
            kind: "hf",
            feature: "tokenizers",
        })
    }

    /// Loads a tiktoken encoding built into the binary: `cl100k_base`, `o200k_base`,
    /// `p50k_base`, `r50k_base`.
    #[cfg(feature = "tiktoken")]
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

    /// Built without the `tiktoken` feature: [`TokenizeError::NotBuilt`].
    #[cfg(not(feature = "tiktoken"))]
    pub fn tiktoken(_encoding: &str) -> Result<Self, TokenizeError> {
        Err(TokenizeError::NotBuilt {
            kind: "tiktoken",
            feature: "tiktoken",
        })
    }

    /// `hf:<path>` or `tiktoken:<encoding>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Token ids of `text`. `add_special` adds the tokenizer's special tokens (BOS, …) as its
    /// post-processor says; tiktoken encodings have none to add.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizeError> {
        let _ = (text, add_special);
        match &self.kind {
            #[cfg(feature = "tokenizers")]
            Kind::HuggingFace(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            #[cfg(feature = "tiktoken")]
            Kind::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text)),
            #[cfg(not(any(feature = "tokenizers", feature = "tiktoken")))]
            _ => unreachable_kind(),
        }
    }

    /// Number of tokens of `text` (see [`encode`](Self::encode)).
    pub fn count(&self, text: &str, add_special: bool) -> Result<u64, TokenizeError> {
        if text.is_empty() && !add_special {
            return Ok(0);
        }
        match &self.kind {
            #[cfg(feature = "tokenizers")]
            Kind::HuggingFace(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.len() as u64)
                .map_err(|e| TokenizeError::Encode(e.to_string())),
            #[cfg(feature = "tiktoken")]
            Kind::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text).len() as u64),
            #[cfg(not(any(feature = "tokenizers", feature = "tiktoken")))]
            _ => unreachable_kind(),
        }
    }
}

/// Built without any local kind, no [`LocalTokenizer`] can exist (both constructors fail).
#[cfg(not(any(feature = "tokenizers", feature = "tiktoken")))]
fn unreachable_kind<T>() -> Result<T, TokenizeError> {
    Err(TokenizeError::Encode(
        "no local tokenizer is built in".to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kind this build lacks is a clear startup error naming the feature, never a panic.
    #[test]
    fn kinds_not_built_are_startup_errors() {
        let hf = LocalTokenizer::hugging_face(Path::new("/nonexistent/tokenizer.json"));
        #[cfg(feature = "tokenizers")]
        assert!(matches!(hf, Err(TokenizeError::LoadHuggingFace { .. })));
        #[cfg(not(feature = "tokenizers"))]
        {
            let e = hf.expect_err("not built");
            assert!(matches!(e, TokenizeError::NotBuilt { kind: "hf", .. }));
            assert!(e.to_string().contains("\"tokenizers\""), "{e}");
        }
        let tt = LocalTokenizer::tiktoken("cl100k_base");
        #[cfg(feature = "tiktoken")]
        assert_eq!(tt.expect("built in").name(), "tiktoken:cl100k_base");
        #[cfg(not(feature = "tiktoken"))]
        assert!(matches!(
            tt,
            Err(TokenizeError::NotBuilt {
                kind: "tiktoken",
                ..
            })
        ));
    }
}
