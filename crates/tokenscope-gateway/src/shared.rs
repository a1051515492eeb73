//! What every request handler shares: [`Shared`] (built once by [`crate::startup`]) and the
//! upstreams it routes to.
//!
//! Invariants:
//! * Nothing in it is locked across I/O; engine and GPU state are lock-free snapshots of the
//!   last scrape.
//! * Routing is by model: the first upstream whose patterns match, else the default, else the
//!   first one; measured requests by their body's `model`, pass-through requests by the model
//!   [`crate::routing`] finds in them; then to one of its replicas (`crate::replicas`).
//! * What happens after a record is final belongs to [`Fanout`]; start-up and shutdown state
//!   (listeners, the pipeline handle, the background runtime) stays in [`crate::Gateway`].

use crate::config::{self, GatewayConfig, UpstreamConfig};
use crate::finished::Fanout;
use hyper_util::client::legacy::Client;
use std::collections::HashMap;
use std::sync::Arc;
use tokenscope_engine_state::GpuStateHandle;
use tokenscope_telemetry::Metrics;

/// One configured engine: one replica per URL (`url`, or each of `urls`).
pub(crate) struct Upstream {
    pub name: String,
    pub cfg: UpstreamConfig,
    /// Its replicas, each with its connections (driven by the request's task, see `upconn`),
    /// load, health and engine state (`crate::replicas`).
    pub replicas: crate::replicas::Replicas,
    /// Its key and extra headers, resolved at start-up (`tokenscope_config::credentials`).
    pub creds: config::UpstreamCredentials,
    /// Its TLS settings (`https://`: the system's roots plus `ca_file`, and `client_cert`).
    pub tls: tokenscope_net::ClientTls,
}

/// State shared by every request. Nothing in it is locked across I/O.
pub(crate) struct Shared {
    pub cfg: GatewayConfig,
    /// The pass-through client for bodies of unknown length (`http://` and `https://`, each
    /// upstream with its own TLS settings).
    pub client: Client<tokenscope_net::ConnectorSet, axum::body::Body>,
    pub upstreams: Vec<Upstream>,
    /// `[[api_keys]]` by the SHA-256 of the key.
    pub api_keys: HashMap<String, config::ApiKeyConfig>,
    pub metrics: Arc<Metrics>,
    pub gpu: Option<GpuStateHandle>,
    /// Counts entry tokens with the model's own tokenizer.
    pub tokenizers: tokenscope_tokenize::Tokenizers,
    /// Business-metric values from `POST /api/business-metrics` (sidecar file).
    pub business_metrics: Arc<crate::cost::BusinessMetricsFile>,
    /// Everything a finished record feeds.
    pub fanout: Arc<Fanout>,
}

impl Shared {
    /// The upstream for `model`: the first whose patterns match, else the default.
    pub(crate) fn route(&self, model: Option<&str>) -> Option<&Upstream> {
        model
            .and_then(|m| self.upstreams.iter().find(|u| u.cfg.serves(m)))
            .or_else(|| self.upstreams.iter().find(|u| u.cfg.default))
            .or_else(|| self.upstreams.first())
    }
}
