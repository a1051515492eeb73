//! Configuration: which tokenizer counts which models.
//!
//! TOML shape (one `[[tokenizers]]` table per tokenizer; `kind` selects the variant):
//!
//! ```toml
//! [[tokenizers]]
//! models = ["gemma*"]                 # exact name, "prefix*", or "*"
//! kind = "engine"
//! url = "http://127.0.0.1:8080"
//! flavor = "llamacpp"                 # llamacpp | vllm | tgi
//!
//! [[tokenizers]]
//! models = ["deepseek-chat"]
//! kind = "hf"
//! path = "/etc/tokenscope/deepseek/tokenizer.json"
//!
//! [[tokenizers]]
//! models = ["gpt-4o*", "o3*"]
//! kind = "tiktoken"
//! encoding = "o200k_base"
//! ```
//!
//! Invariants: unknown keys are rejected (a typo is a startup error, not a silently ignored
//! setting); `models` and the variant's fields are required. Serde cannot combine
//! `deny_unknown_fields` with `#[serde(flatten)]`, so [`TokenizerConfig`] is deserialized through
//! a private internally tagged enum that holds `models` in every variant and is then split into
//! `models` + [`TokenizerSpec`]; the TOML shape is the one above either way. Patterns and URLs
//! are validated by [`Tokenizers::new`](crate::Tokenizers::new), not here.

use serde::Deserialize;
use std::path::PathBuf;

/// Where the token counts of a model come from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// A local Hugging Face `tokenizer.json` (loaded once, offline).
    #[serde(rename = "hf", alias = "huggingface")]
    HuggingFace {
        /// Path to `tokenizer.json`.
        path: PathBuf,
    },
    /// An OpenAI encoding built into the binary (no rank file download).
    #[serde(rename = "tiktoken")]
    Tiktoken {
        /// `cl100k_base`, `o200k_base` (also `p50k_base`, `r50k_base`).
        encoding: String,
    },
    /// The serving engine's own tokenize endpoint (exact for that engine, chat template
    /// included).
    #[serde(rename = "engine")]
    Engine {
        /// Base URL of the engine, e.g. `http://127.0.0.1:8080` or `https://engine:8443`.
        #[serde(rename = "url")]
        base_url: String,
        /// Which engine API to speak.
        flavor: EngineFlavor,
        /// `https://`: a PEM CA bundle trusted beside the system's roots.
        #[serde(default)]
        ca_file: Option<PathBuf>,
        /// `https://`: a PEM client certificate (mutual TLS), with `client_key`.
        #[serde(default)]
        client_cert: Option<PathBuf>,
        /// The PEM key of `client_cert`.
        #[serde(default)]
        client_key: Option<PathBuf>,
    },
}

/// The engine API spoken by [`TokenizerSpec::Engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum EngineFlavor {
    /// llama.cpp `llama-server`: `POST /tokenize`, `POST /apply-template`.
    #[serde(rename = "llamacpp", alias = "llama.cpp")]
    LlamaCpp,
    /// vLLM OpenAI server: `POST /tokenize` (completion or chat form).
    #[serde(rename = "vllm")]
    Vllm,
    /// Hugging Face text-generation-inference: `POST /tokenize`, `POST /chat_tokenize`.
    #[serde(rename = "tgi")]
    Tgi,
}

impl EngineFlavor {
    /// Stable lower-case name (as in the config).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineFlavor::LlamaCpp => "llamacpp",
            EngineFlavor::Vllm => "vllm",
            EngineFlavor::Tgi => "tgi",
        }
    }
}

/// One `[[tokenizers]]` entry: a tokenizer and the model patterns it counts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "RawTokenizerConfig")]
pub struct TokenizerConfig {
    /// Model patterns: an exact model name, `"prefix*"`, or `"*"` (every model).
    pub models: Vec<String>,
    /// The tokenizer.
    pub spec: TokenizerSpec,
}

/// The wire form of [`TokenizerConfig`]: `models` inside each variant, so that
/// `deny_unknown_fields` sees every key of the table.
#[derive(Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
enum RawTokenizerConfig {
    #[serde(rename = "hf", alias = "huggingface")]
    HuggingFace { models: Vec<String>, path: PathBuf },
    #[serde(rename = "tiktoken")]
    Tiktoken {
        models: Vec<String>,
        encoding: String,
    },
    #[serde(rename = "engine")]
    Engine {
        models: Vec<String>,
        url: String,
        flavor: EngineFlavor,
        #[serde(default)]
        ca_file: Option<PathBuf>,
        #[serde(default)]
        client_cert: Option<PathBuf>,
        #[serde(default)]
        client_key: Option<PathBuf>,
    },
}

impl From<RawTokenizerConfig> for TokenizerConfig {
    fn from(raw: RawTokenizerConfig) -> Self {
        match raw {
            RawTokenizerConfig::HuggingFace { models, path } => TokenizerConfig {
                models,
                spec: TokenizerSpec::HuggingFace { path },
            },
            RawTokenizerConfig::Tiktoken { models, encoding } => TokenizerConfig {
                models,
                spec: TokenizerSpec::Tiktoken { encoding },
            },
            RawTokenizerConfig::Engine {
                models,
                url,
                flavor,
                ca_file,
                client_cert,
                client_key,
            } => TokenizerConfig {
                models,
                spec: TokenizerSpec::Engine {
                    base_url: url,
                    flavor,
                    ca_file,
                    client_cert,
                    client_key,
                },
            },
        }
    }
}
