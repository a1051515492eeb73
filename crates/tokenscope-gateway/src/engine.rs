//! What each engine tells about a request beyond the OpenAI `usage`: the reference table of
//! where each engine's per-request numbers come from. The mapping onto the record is applied
//! in one place, `facts::derive` (pure, table-tested); this module holds the reader of TGI's
//! response headers and re-exports the engine kinds.
//!
//! | engine | where | queue | prefill | decode | tokens |
//! |---|---|---|---|---|---|
//! | llama.cpp | `timings` in the body (last SSE chunk) | — (derived, see below) | `prompt_ms` | `predicted_ms` | `prompt_n + cache_n`, `predicted_n`, cached `cache_n` |
//! | vLLM | `metrics` in the body (server flag `--enable-per-request-metrics`; usage chunk when streaming) | `queue_time_ms` | `time_to_first_token_ms` (from scheduling) | `generation_time_ms` | usage |
//! | vLLM / SGLang | OTLP spans joined by trace id later (see `tokenscope-otlp`, `tokenscope_store::late`) | `gen_ai.latency.time_in_queue` | `…time_in_model_prefill` | `…time_in_model_decode` | `gen_ai.usage.*` |
//! | TGI | response headers (router `server.rs`: whole ms) | `x-queue-time` | — | — | `x-prompt-tokens`, `x-generated-tokens` |
//!
//! Every phase value states its source (`engine`, `derived`, `none`). When no engine number
//! gives the queue and the request has a TTFT (streamed) and an engine prefill, the queue is
//! derived as TTFT − prefill − the gateway's own overhead (at least 0), source `derived`: it
//! then also holds whatever the engine does not account for (HTTP, tokenisation, waiting for
//! the current step). `kind = "auto"` detects the engine from what the response carries; a
//! configured kind is trusted (the kinds: [`EngineKind`], defined in `tokenscope_core::engine`).

use http::HeaderMap;

/// The engine enum and an upstream's configured kind live in `tokenscope-core` (one
/// definition for the gateway, engine state and the config).
pub use tokenscope_core::engine::{Engine, EngineKind};

/// TGI's timing and token headers (all optional; TGI writes them as whole milliseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct TgiHeaders {
    pub queue_ms: Option<f64>,
    pub inference_ms: Option<f64>,
    pub validation_ms: Option<f64>,
    pub total_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub generated_tokens: Option<u64>,
}

impl TgiHeaders {
    /// Reads the headers; `None` when the response carries none of TGI's timing headers.
    pub fn read(h: &HeaderMap) -> Option<Self> {
        let num = |name: &str| -> Option<f64> {
            h.get(name)?
                .to_str()
                .ok()?
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
        };
        let t = TgiHeaders {
            queue_ms: num("x-queue-time"),
            inference_ms: num("x-inference-time"),
            validation_ms: num("x-validation-time"),
            total_ms: num("x-total-time"),
            prompt_tokens: num("x-prompt-tokens").map(|v| v as u64),
            generated_tokens: num("x-generated-tokens").map(|v| v as u64),
        };
        (t.queue_ms.is_some() || t.inference_ms.is_some()).then_some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn tgi_headers_as_its_router_writes_them() {
        // text-generation-inference router/src/server.rs (`generate`): whole milliseconds.
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("x-compute-type", "gpu+optimized"),
            ("x-compute-time", "1"),
            ("x-compute-characters", "52"),
            ("x-total-time", "1203"),
            ("x-validation-time", "2"),
            ("x-queue-time", "35"),
            ("x-inference-time", "1166"),
            ("x-time-per-token", "58"),
            ("x-prompt-tokens", "11"),
            ("x-generated-tokens", "20"),
        ] {
            h.insert(k, HeaderValue::from_static(v));
        }
        let t = TgiHeaders::read(&h).expect("tgi");
        assert_eq!(t.queue_ms, Some(35.0));
        assert_eq!(t.inference_ms, Some(1166.0));
        assert_eq!(t.validation_ms, Some(2.0));
        assert_eq!(t.total_ms, Some(1203.0));
        assert_eq!(t.prompt_tokens, Some(11));
        assert_eq!(t.generated_tokens, Some(20));
        assert_eq!(TgiHeaders::read(&HeaderMap::new()), None);
        let mut bad = HeaderMap::new();
        bad.insert("x-queue-time", HeaderValue::from_static("soon"));
        assert_eq!(TgiHeaders::read(&bad), None);
    }
}
