//! # tokenscope-engine-state
//!
//! What the inference engines and GPUs behind the gateway are doing right now, read from their
//! own Prometheus endpoints (and NVML when present) and handed to the request path as
//! lock-free snapshots and to `/metrics` as gauges.
//!
//! * [`exposition`]: a tolerant Prometheus-text / OpenMetrics parser (samples only).
//! * [`EngineStateHandle::spawn`]: one tokio task per upstream scrapes `{base}/metrics`
//!   every [`ScrapeConfig::interval`] (default 2 s, timeout 1 s) and normalises vLLM, SGLang,
//!   llama.cpp and TGI names into [`EngineSnapshot`] (running, waiting, KV-cache usage,
//!   prefix-cache hit ratio, detected kind, age). The rules are in the `engine` module docs.
//! * [`GpuStateHandle`]: per-GPU utilisation, memory and memory-bandwidth utilisation from a
//!   DCGM exporter URL ([`GpuStateHandle::spawn_dcgm`]) or from NVML loaded at run time
//!   ([`GpuStateHandle::spawn_nvml`]); [`nvml_probe`] describes what NVML finds.
//! * [`register_metrics`]: a `prometheus-client` collector exposing both as
//!   `llm_engine_*{upstream}` and `llm_gpu_*{gpu}` gauges at scrape time.
//!
//! Invariants:
//! * The request path only ever calls `snapshot()`: an atomic load, no lock, no I/O, no
//!   allocation for engines. Scrapes run on their own tasks (NVML on its own thread).
//! * Unknown is explicit: `snapshot()` is `None` until the first good scrape and after any
//!   failed one. A failing endpoint logs one `warn` per outage, not one per scrape, and is
//!   retried on the interval.
//! * Scrapers stop when every handle on them is dropped, or on `shutdown()`.
//! * No `unsafe` here: NVML's FFI lives in the `nvml-wrapper` crate.
#![deny(missing_docs)]

mod cell;
mod collector;
mod engine;
pub mod exposition;
mod fetch;
mod gpu;
mod nvml;

pub use collector::register_metrics;
pub use engine::{
    normalize, Engine, EngineKind, EngineReading, EngineSnapshot, EngineStateHandle, EngineTarget,
    NormalizeError, PrefixCacheCounters, PrefixWindow, ScrapeError, UnknownKind,
};
pub use fetch::FetchError;
pub use gpu::{
    gpus_from_dcgm, GpuConfig, GpuSample, GpuScrapeError, GpuSnapshot, GpuSource, GpuStateHandle,
    NoDcgmMetrics,
};
pub use nvml::nvml_probe;

use std::time::Duration;

/// How often and how patiently to scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time between scrapes (default 2 s).
    pub interval: Duration,
    /// Limit for one scrape: connect, headers and body (default 1 s).
    pub timeout: Duration,
    /// Largest body read (default 8 MiB); larger is a failed scrape.
    pub max_body_bytes: usize,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            max_body_bytes: 8 * 1024 * 1024,
        }
    }
}

/// Why a scraper could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// The metrics URL does not parse as an absolute URL with a host.
    #[error("invalid metrics URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Only `http://` and `https://` endpoints can be scraped.
    #[error("unsupported scheme in metrics URL {url:?}: only http:// and https:// are scraped")]
    UnsupportedScheme {
        /// The URL given.
        url: String,
    },
    /// Called outside a tokio runtime.
    #[error("no tokio runtime to run the scraper on")]
    NoRuntime,
}
