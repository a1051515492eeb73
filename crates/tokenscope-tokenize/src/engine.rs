//! Counting with the serving engine's own tokenizer over HTTP.
//!
//! The engine knows the model's exact vocabulary and chat template, so these counts are what the
//! engine itself will report as `usage.prompt_tokens` (modulo the caveats per flavor below).
//! Shapes followed (request → answer):
//!
//! **llama.cpp** (`tools/server/README.md`, "POST /tokenize" and "POST /apply-template", in
//! ggml-org/llama.cpp):
//! - `POST /tokenize {"content": text, "add_special": bool, "parse_special": bool}` →
//!   `{"tokens": [id, …]}`.
//! - `POST /apply-template` takes a chat request "in the same format as /v1/chat/completions" and
//!   answers `{"prompt": "…"}` without running inference. We send the client's chat body as it is
//!   (so `tools`, `chat_template_kwargs`, … shape the prompt exactly as for the real request),
//!   then tokenize the prompt with `add_special: true, parse_special: true`, which is how the
//!   server tokenizes a chat prompt; the template output does not repeat a BOS that tokenization
//!   adds, so the count equals the engine's `usage.prompt_tokens`.
//! - Completions/embeddings: each prompt string is tokenized with `add_special: true`.
//!
//! **vLLM** (`vllm/entrypoints/openai/protocol.py`: `TokenizeCompletionRequest`,
//! `TokenizeChatRequest`, `TokenizeResponse`):
//! - `POST /tokenize {"model", "prompt", "add_special_tokens"}` or
//!   `{"model", "messages", …chat options}` → `{"count": n, "max_model_len": …, "tokens": […]}`.
//!   For chat we forward the options of `TokenizeChatRequest` that the client set (`tools`,
//!   `chat_template`, `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`,
//!   `add_special_tokens`); vLLM's defaults match its chat completion defaults.
//!
//! **TGI** (`router/src/server.rs` in huggingface/text-generation-inference: `tokenize`,
//! `get_chat_tokenize`):
//! - `POST /tokenize {"inputs": text}` → `[{"id", "text", "start", "stop"}, …]`.
//! - `POST /chat_tokenize` takes the chat request (`ChatRequest`) → `{"tokenize_response": [...],
//!   "templated_text": "…"}`; we send the client's chat body as it is.
//! - TGI's `/tokenize` has no switch for special tokens, so a count of plain text (the output of
//!   a cancelled stream) may include the model's BOS.
//!
//! Invariants:
//! - One count makes at most [`MAX_ENGINE_CALLS`] calls, sequentially,
//!   all under one timeout (default [`DEFAULT_ENGINE_TIMEOUT`](crate::DEFAULT_ENGINE_TIMEOUT));
//!   the connect timeout is the same value. A slow engine yields an error, never a stall.
//! - Answers are read up to [`MAX_RESPONSE_BYTES`]; only their length/count is kept.
//! - The base URL is `http://` or `https://` (checked at startup; TLS through tokenscope-net:
//!   the system's roots plus the entry's `ca_file`, its client certificate; the connect timeout
//!   covers the handshake). Give the server root (`http://host:8000`), not `…/v1`.

use crate::error::TokenizeError;
use crate::request::{self, check_len};
use crate::{EngineFlavor, MAX_COUNT_BYTES, MAX_ENGINE_CALLS};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::time::Duration;
use tokenscope_core::Endpoint;

/// Largest engine answer read (a token list of a 1 MiB prompt is well below).
pub const MAX_RESPONSE_BYTES: usize = 32 << 20;

/// Options of vLLM's `TokenizeChatRequest` forwarded from a chat body.
const VLLM_CHAT_OPTIONS: [&str; 6] = [
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
];

/// An engine's tokenize API.
#[derive(Clone)]
pub(crate) struct Engine {
    base: String,
    flavor: EngineFlavor,
    client: Client<tokenscope_net::HttpsConnect, Full<Bytes>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("base", &self.base)
            .field("flavor", &self.flavor)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct LlamaTokens {
    tokens: Vec<IgnoredAny>,
}

#[derive(Deserialize)]
struct LlamaTemplate {
    prompt: String,
}

#[derive(Deserialize)]
struct VllmCount {
    count: u64,
}

#[derive(Deserialize)]
struct TgiChat {
    tokenize_response: Vec<IgnoredAny>,
}

/// Checks a configured base URL and returns it without a trailing `/`.
pub(crate) fn normalise_base_url(url: &str) -> Result<String, TokenizeError> {
    let invalid = |reason: &str| TokenizeError::InvalidUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let uri: http::Uri =
        url.parse()
            .map_err(|e: http::uri::InvalidUri| TokenizeError::InvalidUrl {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(_) => return Err(invalid("only http:// and https:// are supported")),
        None => return Err(invalid("missing http:// or https:// scheme")),
    }
    if uri.authority().is_none() {
        return Err(invalid("missing host"));
    }
    if uri.query().is_some() {
        return Err(invalid("a query string is not allowed"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

impl Engine {
    pub(crate) fn new(
        base: String,
        flavor: EngineFlavor,
        timeout: Duration,
        tls: &tokenscope_net::ClientTls,
    ) -> Self {
        let connector = tokenscope_net::connector(
            tls,
            tokenscope_net::ConnectOptions {
                timeout: Some(timeout),
                nodelay: true,
                ..tokenscope_net::ConnectOptions::default()
            },
        );
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(TokioTimer::new())
            .build(connector);
        Engine {
            base,
            flavor,
            client,
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!("engine:{}:{}", self.flavor.as_str(), self.base)
    }

    /// Counts the prompt of a request body; see the module docs for what each flavor sends.
    pub(crate) async fn count_request(
        &self,
        model: &str,
        endpoint: Endpoint,
        body: &Value,
        timeout: Duration,
    ) -> Result<u64, TokenizeError> {
        let work = async {
            match endpoint {
                Endpoint::ChatCompletions => self.count_chat(model, body).await,
                Endpoint::Responses | Endpoint::Messages => {
                    match request::chat_body(endpoint, body)? {
                        Some(chat) => self.count_chat(model, &chat).await,
                        None => Err(TokenizeError::NoPrompt {
                            endpoint: endpoint.as_str(),
                        }),
                    }
                }
                Endpoint::Completions | Endpoint::Embeddings => {
                    let prompts = request::prompts(endpoint, body)?;
                    check_len(prompts.bytes(), MAX_COUNT_BYTES)?;
                    if prompts.texts.len() > MAX_ENGINE_CALLS {
                        return Err(TokenizeError::TooManyPrompts {
                            count: prompts.texts.len(),
                            limit: MAX_ENGINE_CALLS,
                        });
                    }
                    let mut total = prompts.pre_tokenized;
                    for text in &prompts.texts {
                        total += self.count_one(model, text, true).await?;
                    }
                    Ok(total)
                }
            }
        };
        self.with_timeout(timeout, work).await
    }

    /// Counts a plain text without special tokens where the flavor allows it.
    pub(crate) async fn count_text(
        &self,
        model: &str,
        text: &str,
        timeout: Duration,
    ) -> Result<u64, TokenizeError> {
        check_len(text.len(), MAX_COUNT_BYTES)?;
        self.with_timeout(timeout, self.count_one(model, text, false))
            .await
    }

    async fn with_timeout<F>(&self, timeout: Duration, work: F) -> Result<u64, TokenizeError>
    where
        F: std::future::Future<Output = Result<u64, TokenizeError>>,
    {
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| TokenizeError::EngineTimeout {
                base_url: self.base.clone(),
                timeout,
            })?
    }

    async fn count_chat(&self, model: &str, body: &Value) -> Result<u64, TokenizeError> {
        if !body.get("messages").is_some_and(Value::is_array) {
            return Err(TokenizeError::NoPrompt {
                endpoint: Endpoint::ChatCompletions.as_str(),
            });
        }
        match self.flavor {
            EngineFlavor::LlamaCpp => {
                let payload = to_bytes(body)?;
                check_len(payload.len(), MAX_COUNT_BYTES)?;
                let (url, answer) = self.post("/apply-template", payload).await?;
                let t: LlamaTemplate = parse(&url, &answer)?;
                check_len(t.prompt.len(), MAX_COUNT_BYTES)?;
                self.count_one(model, &t.prompt, true).await
            }
            EngineFlavor::Vllm => {
                let mut req = Map::new();
                req.insert("model".into(), Value::String(model.to_owned()));
                req.insert("messages".into(), body["messages"].clone());
                for key in VLLM_CHAT_OPTIONS {
                    if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
                        req.insert(key.into(), v.clone());
                    }
                }
                let payload = to_bytes(&Value::Object(req))?;
                check_len(payload.len(), MAX_COUNT_BYTES)?;
                let (url, answer) = self.post("/tokenize", payload).await?;
                parse::<VllmCount>(&url, &answer).map(|c| c.count)
            }
            EngineFlavor::Tgi => {
                let payload = to_bytes(body)?;
                check_len(payload.len(), MAX_COUNT_BYTES)?;
                let (url, answer) = self.post("/chat_tokenize", payload).await?;
                parse::<TgiChat>(&url, &answer).map(|c| c.tokenize_response.len() as u64)
            }
        }
    }

    /// One tokenize call for one text.
    async fn count_one(
        &self,
        model: &str,
        text: &str,
        add_special: bool,
    ) -> Result<u64, TokenizeError> {
        let (path, payload) = match self.flavor {
            EngineFlavor::LlamaCpp => (
                "/tokenize",
                json!({ "content": text, "add_special": add_special, "parse_special": add_special }),
            ),
            EngineFlavor::Vllm => (
                "/tokenize",
                json!({ "model": model, "prompt": text, "add_special_tokens": add_special }),
            ),
            EngineFlavor::Tgi => ("/tokenize", json!({ "inputs": text })),
        };
        let (url, answer) = self.post(path, to_bytes(&payload)?).await?;
        match self.flavor {
            EngineFlavor::LlamaCpp => parse::<LlamaTokens>(&url, &answer).map(|t| t.tokens.len()),
            EngineFlavor::Vllm => parse::<VllmCount>(&url, &answer).map(|c| c.count as usize),
            EngineFlavor::Tgi => parse::<Vec<IgnoredAny>>(&url, &answer).map(|t| t.len()),
        }
        .map(|n| n as u64)
    }

    /// POSTs JSON to `path` and returns the URL called and the 2xx answer's body.
    async fn post(&self, path: &str, payload: Vec<u8>) -> Result<(String, Bytes), TokenizeError> {
        let url = format!("{}{}", self.base, path);
        let request_err = |message: String| TokenizeError::EngineRequest {
            url: url.clone(),
            message,
        };
        let req = http::Request::post(url.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json")
            .body(Full::new(Bytes::from(payload)))
            .map_err(|e| request_err(e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| request_err(error_chain(&e)))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| request_err(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            let end = body.len().min(256);
            return Err(TokenizeError::EngineStatus {
                url,
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body[..end]).into_owned(),
            });
        }
        Ok((url, body))
    }
}

fn to_bytes(v: &Value) -> Result<Vec<u8>, TokenizeError> {
    serde_json::to_vec(v).map_err(|e| TokenizeError::Encode(e.to_string()))
}

fn parse<T: for<'de> Deserialize<'de>>(url: &str, body: &[u8]) -> Result<T, TokenizeError> {
    serde_json::from_slice(body).map_err(|e| TokenizeError::EngineBody {
        url: url.to_owned(),
        reason: e.to_string(),
    })
}

/// The error and its sources, joined (hyper-util's top-level message alone is vague).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_checked() {
        assert_eq!(
            normalise_base_url("http://127.0.0.1:8080/").expect("valid"),
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            normalise_base_url("http://engine:8000/prefix").expect("valid"),
            "http://engine:8000/prefix"
        );
        assert_eq!(
            normalise_base_url("https://engine:8443/").expect("valid"),
            "https://engine:8443"
        );
        for bad in [
            "ftp://x",
            "127.0.0.1:8080",
            "http://x/?a=b",
            "not a url",
            "",
        ] {
            assert!(
                matches!(
                    normalise_base_url(bad),
                    Err(TokenizeError::InvalidUrl { .. })
                ),
                "{bad:?}"
            );
        }
    }
}
