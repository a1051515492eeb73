//! Input tokens at the entry, counted with the model's own tokenizer.
//!
//! [`Tokenizers`] is built once at startup from the `[[tokenizers]]` entries of the config
//! ([`TokenizerConfig`]) and maps model names to one of three kinds of tokenizer:
//!
//! | kind | what counts | exact? |
//! |---|---|---|
//! | `hf` | a local Hugging Face `tokenizer.json` (`tokenizers` crate, pure Rust; cargo feature `tokenizers`) | completions/embeddings: yes; chat: content + documented template overhead |
//! | `tiktoken` | OpenAI encodings built into the binary (`tiktoken-rs` crate; cargo feature `tiktoken`) | same as `hf` |
//! | `engine` | the engine's tokenize endpoint (llama.cpp, vLLM, TGI) | yes, chat template included |
//!
//! Invariants:
//! - **Startup, not per request**: local tokenizers are loaded (and engine URLs checked) by
//!   [`Tokenizers::new`]; a missing file or unknown encoding is a startup error, and so is a
//!   kind this binary was built without (both features are on by default;
//!   [`TokenizeError::NotBuilt`]). Nothing is ever downloaded.
//! - **Never on the async worker**: local tokenization runs on tokio's blocking pool, at most
//!   [`std::thread::available_parallelism`] counts at once (further counts wait for a slot, so
//!   counting cannot take more CPUs than the machine has). Engine counts are HTTP calls with a
//!   short timeout ([`DEFAULT_ENGINE_TIMEOUT`], see [`Tokenizers::with_engine_timeout`]).
//! - **Bounded work**: at most [`MAX_COUNT_BYTES`] (1 MiB) of text is counted per call; a larger
//!   prompt yields [`TokenizeError::TooLong`] instead of a count (the gateway then keeps its
//!   length-based estimate). An engine count makes at most [`MAX_ENGINE_CALLS`] calls.
//! - **Usage is authoritative**: a count here is the entry-time figure. For chat requests with a
//!   local tokenizer it adds a fixed per-message overhead for the chat template
//!   ([`CHAT_TOKENS_PER_MESSAGE`] …, see the `request` module docs), which is exact for OpenAI
//!   models and an estimate within a few tokens per message for others; when the engine reports
//!   `usage`, the gateway records that and compares the two within a tolerance.
//! - **Routing** ([`Tokenizers::has`]): an exact model name beats the longest matching
//!   `"prefix*"`, which beats `"*"`; a pattern may appear only once. Unrouted models get `None`.
//!
//! Callers should run [`Tokenizers::count_request`] alongside the upstream request (spawned or
//! joined), not before forwarding it, so that counting never adds to the request's latency.

mod config;
pub mod engine;
mod error;
mod local;
mod request;
mod router;

pub use config::{EngineFlavor, TokenizerConfig, TokenizerSpec};
pub use error::TokenizeError;
pub use local::LocalTokenizer;
pub use request::{CHAT_REPLY_PRIMING, CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_NAME};

use engine::Engine;
use request::check_len;
use router::Router;
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_core::Endpoint;
use tokio::sync::Semaphore;

/// Most bytes of text counted in one call (1 MiB); larger prompts are not counted.
pub const MAX_COUNT_BYTES: usize = 1 << 20;

/// Most tokenize calls one engine count makes (one per prompt of a batched completion).
pub const MAX_ENGINE_CALLS: usize = 64;

/// Default limit for all engine calls of one count, connect included.
pub const DEFAULT_ENGINE_TIMEOUT: Duration = Duration::from_secs(2);

/// The configured tokenizers, routed by model name. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct Tokenizers {
    inner: Arc<Inner>,
    engine_timeout: Duration,
}

#[derive(Debug)]
struct Inner {
    backends: Vec<Backend>,
    router: Router,
    /// Bounds concurrent local counts on the blocking pool.
    blocking: Arc<Semaphore>,
}

#[derive(Debug)]
enum Backend {
    Local(Arc<LocalTokenizer>),
    Engine(Box<Engine>),
}

/// Key under which loaded local tokenizers are shared between entries.
#[derive(PartialEq, Eq, Hash)]
enum LocalKey {
    Hf(PathBuf),
    Tiktoken(String),
}

/// A local count to run on the blocking pool.
struct LocalJob {
    texts: Vec<String>,
    add_special: bool,
    fixed: u64,
}

impl LocalJob {
    fn run(&self, tok: &LocalTokenizer) -> Result<u64, TokenizeError> {
        let mut total = self.fixed;
        for t in &self.texts {
            total += tok.count(t, self.add_special)?;
        }
        Ok(total)
    }
}

impl Tokenizers {
    /// Builds the router and loads every local tokenizer (errors here are startup errors).
    /// An empty list is valid: no model has a tokenizer.
    pub fn new(cfgs: &[TokenizerConfig]) -> Result<Self, TokenizeError> {
        let mut router = Router::default();
        let mut backends = Vec::with_capacity(cfgs.len());
        let mut loaded: HashMap<LocalKey, Arc<LocalTokenizer>> = HashMap::new();
        for (index, cfg) in cfgs.iter().enumerate() {
            router.add(&cfg.models, index)?;
            let backend = match &cfg.spec {
                TokenizerSpec::HuggingFace { path } => {
                    let key = LocalKey::Hf(path.clone());
                    let tok = match loaded.get(&key) {
                        Some(t) => Arc::clone(t),
                        None => Arc::new(LocalTokenizer::hugging_face(path)?),
                    };
                    loaded.insert(key, Arc::clone(&tok));
                    Backend::Local(tok)
                }
                TokenizerSpec::Tiktoken { encoding } => {
                    let key = LocalKey::Tiktoken(encoding.clone());
                    let tok = match loaded.get(&key) {
                        Some(t) => Arc::clone(t),
                        None => Arc::new(LocalTokenizer::tiktoken(encoding)?),
                    };
                    loaded.insert(key, Arc::clone(&tok));
                    Backend::Local(tok)
                }
                TokenizerSpec::Engine {
                    base_url,
                    flavor,
                    ca_file,
                    client_cert,
                    client_key,
                } => {
                    let base = engine::normalise_base_url(base_url)?;
                    let tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
                        ca_file: ca_file.clone(),
                        client_cert: client_cert.clone(),
                        client_key: client_key.clone(),
                    })
                    .map_err(|e| TokenizeError::InvalidUrl {
                        url: base.clone(),
                        reason: format!("TLS settings: {e}"),
                    })?;
                    Backend::Engine(Box::new(Engine::new(
                        base,
                        *flavor,
                        DEFAULT_ENGINE_TIMEOUT,
                        &tls,
                    )))
                }
            };
            backends.push(backend);
        }
        let slots = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Tokenizers {
            inner: Arc::new(Inner {
                backends,
                router,
                blocking: Arc::new(Semaphore::new(slots)),
            }),
            engine_timeout: DEFAULT_ENGINE_TIMEOUT,
        })
    }

    /// Sets the limit for all engine calls of one count (default [`DEFAULT_ENGINE_TIMEOUT`]).
    /// The connect timeout stays at the default.
    pub fn with_engine_timeout(mut self, timeout: Duration) -> Self {
        self.engine_timeout = timeout;
        self
    }

    /// Whether a tokenizer is configured for `model`.
    pub fn has(&self, model: &str) -> bool {
        self.inner.router.lookup(model).is_some()
    }

    /// A short description of the tokenizer used for `model` (`hf:<path>`,
    /// `tiktoken:<encoding>`, `engine:<flavor>:<url>`), for logs.
    pub fn describe(&self, model: &str) -> Option<String> {
        self.backend(model).map(|b| match b {
            Backend::Local(t) => t.name().to_owned(),
            Backend::Engine(e) => e.describe(),
        })
    }

    fn backend(&self, model: &str) -> Option<&Backend> {
        let i = self.inner.router.lookup(model)?;
        self.inner.backends.get(i)
    }

    /// Count the prompt of an OpenAI request body (chat messages / completion prompt /
    /// embeddings input) for `model`. Local tokenizers run on tokio's blocking pool (never on
    /// the async worker); engine flavor does HTTP with a short timeout. Returns None when no
    /// tokenizer is configured for the model.
    pub async fn count_request(
        &self,
        model: &str,
        endpoint: Endpoint,
        body: &Value,
    ) -> Option<Result<u64, TokenizeError>> {
        let backend = self.backend(model)?;
        Some(match backend {
            Backend::Local(tok) => match local_job(endpoint, body) {
                Ok(job) => self.run_local(tok, job).await,
                Err(e) => Err(e),
            },
            Backend::Engine(e) => {
                e.count_request(model, endpoint, body, self.engine_timeout)
                    .await
            }
        })
    }

    /// Count a plain text (used for the output of a cancelled stream): no special tokens and no
    /// template. Returns None when no tokenizer is configured for the model.
    pub async fn count_text(&self, model: &str, text: &str) -> Option<Result<u64, TokenizeError>> {
        let backend = self.backend(model)?;
        Some(match backend {
            Backend::Local(tok) => match check_len(text.len(), MAX_COUNT_BYTES) {
                Ok(()) => {
                    let job = LocalJob {
                        texts: vec![text.to_owned()],
                        add_special: false,
                        fixed: 0,
                    };
                    self.run_local(tok, job).await
                }
                Err(e) => Err(e),
            },
            Backend::Engine(e) => e.count_text(model, text, self.engine_timeout).await,
        })
    }

    async fn run_local(
        &self,
        tok: &Arc<LocalTokenizer>,
        job: LocalJob,
    ) -> Result<u64, TokenizeError> {
        if job.texts.is_empty() {
            return Ok(job.fixed);
        }
        let permit = Arc::clone(&self.inner.blocking)
            .acquire_owned()
            .await
            .map_err(|e| TokenizeError::Task(e.to_string()))?;
        let tok = Arc::clone(tok);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job.run(&tok)
        })
        .await
        .map_err(|e| TokenizeError::Task(e.to_string()))?
    }
}

/// What a local tokenizer counts for a request (see the `request` module docs).
fn local_job(endpoint: Endpoint, body: &Value) -> Result<LocalJob, TokenizeError> {
    match endpoint {
        Endpoint::ChatCompletions => {
            let parts = request::chat_parts(body)?;
            check_len(parts.bytes(), MAX_COUNT_BYTES)?;
            let mut texts: Vec<String> = parts.texts.iter().map(|s| (*s).to_owned()).collect();
            texts.extend(parts.tools_json);
            Ok(LocalJob {
                texts,
                add_special: false,
                fixed: parts.overhead,
            })
        }
        Endpoint::Completions | Endpoint::Embeddings => {
            let prompts = request::prompts(endpoint, body)?;
            check_len(prompts.bytes(), MAX_COUNT_BYTES)?;
            Ok(LocalJob {
                texts: prompts.texts.iter().map(|s| (*s).to_owned()).collect(),
                add_special: true,
                fixed: prompts.pre_tokenized,
            })
        }
        Endpoint::Responses | Endpoint::Messages => match request::chat_body(endpoint, body)? {
            Some(chat) => local_job(Endpoint::ChatCompletions, &chat),
            None => Err(TokenizeError::NoPrompt {
                endpoint: endpoint.as_str(),
            }),
        },
    }
}
