//! The one error type of this crate, [`TokenizeError`].
//!
//! Startup errors ([`Tokenizers::new`](crate::Tokenizers::new): a tokenizer that does not load,
//! a bad model pattern or engine URL) and per-request errors (a body without a prompt, a prompt
//! over the counting limit, an engine that failed or timed out) share the type because the public
//! API returns it from both; the variants say which operation failed and carry what is needed to
//! act on it. No variant holds request text.

use std::path::PathBuf;
use std::time::Duration;

/// Why a tokenizer could not be built, or a count could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// A Hugging Face `tokenizer.json` could not be read or parsed (startup).
    #[error("loading Hugging Face tokenizer {path}: {message}")]
    LoadHuggingFace {
        /// The configured path.
        path: PathBuf,
        /// The loader's message.
        message: String,
    },
    /// The tiktoken encoding name is not one that is built in (startup).
    #[error(
        "unknown tiktoken encoding {0:?} (built in: cl100k_base, o200k_base, p50k_base, r50k_base)"
    )]
    UnknownEncoding(String),
    /// A built-in tiktoken encoding failed to load (startup).
    #[error("loading tiktoken encoding {encoding}: {message}")]
    LoadTiktoken {
        /// The encoding name.
        encoding: String,
        /// The loader's message.
        message: String,
    },
    /// The configured tokenizer kind is not built into this binary: it was compiled without
    /// the cargo feature that brings it (startup).
    #[error("tokenizer kind {kind:?} is not built into this binary (built without the cargo feature {feature:?} of tokenscope-tokenize)")]
    NotBuilt {
        /// The configured kind (`hf`, `tiktoken`).
        kind: &'static str,
        /// The cargo feature that brings it.
        feature: &'static str,
    },
    /// A `models` entry is not an exact name, `prefix*` or `*` (startup).
    #[error("invalid model pattern {pattern:?}: {reason}")]
    InvalidPattern {
        /// The pattern as configured.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The same model pattern appears in two `[[tokenizers]]` entries (startup).
    #[error("model pattern {0:?} is configured for more than one tokenizer")]
    DuplicatePattern(String),
    /// An engine `url` is not an `http[s]://host:port[/path]` URL, or its TLS files cannot be
    /// used (startup).
    #[error("engine url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The request body has none of the fields that carry the prompt of its endpoint
    /// (`messages`, `prompt`, `input`) in a shape that can be counted.
    #[error("request body has no countable prompt for {endpoint}")]
    NoPrompt {
        /// The endpoint's stable name.
        endpoint: &'static str,
    },
    /// The text to count is larger than [`MAX_COUNT_BYTES`](crate::MAX_COUNT_BYTES); it is not
    /// counted (the gateway falls back to its estimate, and the engine's usage stays
    /// authoritative).
    #[error("text of {len} bytes is over the counting limit of {limit} bytes")]
    TooLong {
        /// Bytes that would have been counted.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// More separate prompts than [`MAX_ENGINE_CALLS`](crate::MAX_ENGINE_CALLS) would each need
    /// an engine call.
    #[error("{count} prompts would need one engine call each; the limit is {limit}")]
    TooManyPrompts {
        /// Prompts in the request.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A local tokenizer returned an error for this text.
    #[error("tokenizer failed: {0}")]
    Encode(String),
    /// The blocking task that ran a local tokenizer panicked or was cancelled.
    #[error("tokenizer task failed: {0}")]
    Task(String),
    /// The HTTP request to the engine failed (connect, send or read).
    #[error("engine request to {url} failed: {message}")]
    EngineRequest {
        /// The engine endpoint called.
        url: String,
        /// The client's message.
        message: String,
    },
    /// The engine did not answer all calls of one count within the timeout.
    #[error("engine tokenize calls to {base_url} took longer than {timeout:?}")]
    EngineTimeout {
        /// The engine's base URL.
        base_url: String,
        /// The limit.
        timeout: Duration,
    },
    /// The engine answered with a non-success status.
    #[error("engine {url} answered HTTP {status}: {body}")]
    EngineStatus {
        /// The engine endpoint called.
        url: String,
        /// The status code.
        status: u16,
        /// The start of the answer's body (at most 256 bytes), for the log.
        body: String,
    },
    /// The engine answered 2xx with a body of an unexpected shape.
    #[error("engine {url} answered an unexpected body: {reason}")]
    EngineBody {
        /// The engine endpoint called.
        url: String,
        /// What did not match.
        reason: String,
    },
}
