//! # tokenscope-gateway
//!
//! The OpenAI-compatible reverse proxy that measures every inference request.
//!
//! The public surface is [`Gateway`] (bind, run), its configuration ([`config`]) and errors.
//! Inside, each concern has a home; dependencies point down this list:
//! * `startup` — [`Gateway::bind`]: store, spool, background runtime, scrapers, listeners,
//!   and the request path's state; `running` — [`Gateway::run`]: serving and shutdown.
//! * `proxy` — the request path (measured endpoints and pass-through), composed of:
//!   `attribution` (who the request is for, its ids), `plan` (one parse of the body, the body
//!   forwarded), `forward` (the upstream request with the upstream's credentials, and the
//!   response head), `failure` (the one failure path), `body` (`MeteredBody`: forwards and
//!   measures the response), `routing` (the model a pass-through request names).
//! * `recording` — the exactly-one-record guarantee (`RecordGuard`); `facts` — what the
//!   exchange told (`ResponseFacts`) and the pure derivation of the record's fields from it.
//! * `finished` — `Fanout`: everything a finished record feeds (cost, budgets, tail sampling,
//!   metrics, spans, the recent ring, alerting, the store pipeline).
//! * `shared` — `Shared`, the state every handler reads, and the upstreams it routes to;
//!   `replicas` — an upstream's replicas: least-outstanding choice, passive health, the retry
//!   of a request that never reached one.
//! * `admin` — `/metrics` and the admin API on a separate listener; [`auth`] — who may call
//!   which admin route; [`dashboard`]; [`alerting`]; [`cost`].
//! * [`models`] — the models the upstreams serve, reserved as metric labels, and the union of
//!   their lists answering `GET /v1/models` when there are several upstreams.
//!
//! Invariants (the hot-path/sink boundary):
//! * The request path never awaits a store, an exporter or a lock held across I/O. A finished
//!   record goes to in-memory metrics and a bounded queue (`try_send`); the store writer runs on
//!   its own thread.
//! * Every measured request yields exactly one record, whatever happens to it.
//! * What the client receives is what the engine sent, except the usage-only SSE event that the
//!   gateway itself asked for.
#![deny(missing_docs)]

mod admin;
pub mod alerting;
mod attribution;
pub mod auth;
mod blame;
mod body;
/// The configuration (its own crate, `tokenscope-config`; `crate::config::…` paths resolve).
pub use tokenscope_config as config;
pub mod cost;
pub mod dashboard;
pub mod engine;
mod facts;
mod failure;
mod finished;
mod fleet;
mod forward;
pub mod models;
mod plan;
mod proxy;
mod recording;
mod replicas;
mod routing;
mod running;
mod server;
mod shared;
mod startup;
mod upconn;

pub use attribution::{REQUEST_ID, TRACE_ID};
pub use config::{ConfigError, DurationSetting, GatewayConfig, TracingSection, UpstreamConfig};
/// The store setting and its backends live in `tokenscope-backend`; re-exported for callers.
pub use tokenscope_backend::StoreTarget;
/// Moved to `tokenscope-core`; re-exported so `crate::redact_url` and callers keep working.
pub use tokenscope_core::redact_url;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokenscope_store::{PipelineHandle, ShutdownReport, StoreError};

/// Errors starting or running the gateway.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The spool directory could not be opened (or another gateway holds it).
    #[error("cannot open the spool {dir}: {source}")]
    Spool {
        /// The directory.
        dir: String,
        /// Cause.
        source: tokenscope_store::SpoolError,
    },
    /// The store could not be opened.
    #[error("cannot open store {path}: {source}")]
    Store {
        /// The store location.
        path: String,
        /// Cause.
        source: StoreError,
    },
    /// A server loop failed.
    #[error("server error: {0}")]
    Serve(#[from] std::io::Error),
}

/// A bound, not yet running gateway.
pub struct Gateway {
    pub(crate) shared: Arc<shared::Shared>,
    pub(crate) proxy: tokio::net::TcpListener,
    pub(crate) admin: tokio::net::TcpListener,
    pub(crate) pipeline: PipelineHandle,
    /// The background runtime (see [`startup::background_runtime`]).
    pub(crate) bg: startup::BgRuntime,
    pub(crate) proxy_conns: Arc<server::Connections>,
    pub(crate) admin_conns: Arc<server::Connections>,
    /// `[listen_tls]`: the proxy listener's TLS configuration.
    pub(crate) proxy_tls: Option<Arc<tokenscope_net::rustls::ServerConfig>>,
}

/// What shutdown did.
#[derive(Debug, Clone, Copy)]
pub struct ShutdownSummary {
    /// In-flight requests did not finish within the grace period and were cut.
    pub cut_in_flight: bool,
    /// Requests in flight when the shutdown signal came.
    pub in_flight_at_signal: usize,
    /// Requests cut at the end of the grace period (each recorded as `shutdown`).
    pub cut: usize,
    /// The store pipeline's report.
    pub store: ShutdownReport,
}

impl Gateway {
    /// Opens the store, binds both listeners (port 0 allowed) and prepares the proxy.
    pub async fn bind(cfg: GatewayConfig) -> Result<Self, GatewayError> {
        startup::bind(cfg).await
    }

    /// The proxy's bound address.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// The admin listener's bound address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets in-flight requests finish
    /// (up to `shutdown_grace_ms`), cuts the rest (each cut request is recorded as
    /// `shutdown`), waits for every record to be handed to the store pipeline, drains the
    /// pipeline and returns what it did.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<ShutdownSummary, GatewayError> {
        running::run(self, shutdown).await
    }
}
