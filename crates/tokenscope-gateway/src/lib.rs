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
//!   forwarded), `forward` (the upstream request and the response head), `failure` (the one
//!   failure path), `body` (`MeteredBody`: forwards and measures the response).
//! * `recording` — the exactly-one-record guarantee (`RecordGuard`); `facts` — what the
//!   exchange told (`ResponseFacts`) and the pure derivation of the record's fields from it.
//! * `finished` — `Fanout`: everything a finished record feeds (cost, budgets, tail sampling,
//!   metrics, spans, the recent ring, alerting, the store pipeline).
//! * `shared` — `Shared`, the state every handler reads, and the upstreams it routes to.
//! * `admin` — `/metrics` and the admin API on a separate listener; [`auth`] — who may call
//!   which admin route; [`dashboard`]; [`alerting`]; [`cost`].
//! * [`models`] — the models the upstreams serve, reserved as metric labels.
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
mod body;
pub mod config;
pub mod cost;
pub mod dashboard;
pub mod engine;
mod facts;
mod failure;
mod finished;
mod forward;
pub mod models;
mod plan;
mod proxy;
mod recording;
mod running;
mod server;
mod shared;
mod startup;
mod upconn;

pub use attribution::{REQUEST_ID, TRACE_ID};
pub use config::{ConfigError, DurationSetting, GatewayConfig, TracingSection, UpstreamConfig};

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_core::{PhaseUpdate, RequestRecord};
use tokenscope_store::{
    ErrorClass, PipelineHandle, RecordSink, ShutdownReport, SqliteStore, StoreError,
};

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

/// Where records are stored, from the `store` setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreTarget {
    /// The embedded SQLite file.
    Sqlite(std::path::PathBuf),
    /// A ClickHouse server or cluster (the `clickhouse://` URL).
    ClickHouse(String),
}

impl StoreTarget {
    /// `clickhouse://…` → ClickHouse; `sqlite://PATH` or a plain path → SQLite.
    pub fn parse(s: &str) -> Self {
        if s.starts_with("clickhouse://") {
            StoreTarget::ClickHouse(s.to_owned())
        } else {
            StoreTarget::Sqlite(s.strip_prefix("sqlite://").unwrap_or(s).into())
        }
    }

    /// The spool directory used unless `[spool] dir` says otherwise.
    pub fn default_spool_dir(&self) -> std::path::PathBuf {
        match self {
            StoreTarget::Sqlite(p) => {
                let mut s = p.clone().into_os_string();
                s.push(".spool");
                s.into()
            }
            StoreTarget::ClickHouse(_) => "./tokenscope-spool".into(),
        }
    }

    /// The location without credentials, for logs.
    pub fn display(&self) -> String {
        match self {
            StoreTarget::Sqlite(p) => p.display().to_string(),
            StoreTarget::ClickHouse(url) => redact_url(url),
        }
    }
}

/// `scheme://user:secret@host…` → `scheme://user:***@host…` (never log a password).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (auth_end, _) = rest
        .char_indices()
        .find(|(_, c)| *c == '/' || *c == '?')
        .unwrap_or((rest.len(), ' '));
    match rest[..auth_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

/// Opens the configured store as a record sink (creating / migrating its schema).
fn open_sink(target: &StoreTarget) -> Result<Box<dyn RecordSink>, StoreError> {
    match target {
        StoreTarget::Sqlite(path) => Ok(Box::new(SqliteStore::open(path)?)),
        StoreTarget::ClickHouse(url) => {
            // A malformed URL is a configuration error: refuse to start.
            let cfg = tokenscope_clickhouse::ClickHouseConfig::from_url(url)?;
            let mut sink = LazyClickHouse {
                cfg,
                url: redact_url(url),
                inner: None,
                next_sweep: std::time::Instant::now(),
            };
            // A server that is down (or refuses us) at startup must not stop the gateway:
            // records spool until it answers.
            if let Err(e) = sink.ready() {
                tracing::warn!(store = %sink.url, error = %e, "ClickHouse is not usable at startup; serving anyway, records go to the spool until it is");
            }
            Ok(Box::new(sink))
        }
    }
}

/// The ClickHouse sink, connected (and the schema migrated) on first use and again after a
/// failed connection, so that a store that is down when the gateway starts only delays the
/// writes (they wait in the spool).
struct LazyClickHouse {
    cfg: tokenscope_clickhouse::ClickHouseConfig,
    /// Redacted, for logs.
    url: String,
    inner: Option<tokenscope_clickhouse::ClickHouseSink>,
    /// When retention (`ttl_days`) is next enforced by dropping old daily partitions (servers
    /// without `TTL`; a no-op safety net on those with it). Hourly, on the writer thread.
    next_sweep: std::time::Instant,
}

impl LazyClickHouse {
    /// Drops partitions past `ttl_days` once an hour (never fails the write).
    fn sweep_if_due(&mut self) {
        let now = std::time::Instant::now();
        if self.cfg.ttl_days.is_none() || now < self.next_sweep {
            return;
        }
        self.next_sweep = now + Duration::from_secs(3600);
        if let Some(sink) = self.inner.as_ref() {
            match sink.store().retention_sweep() {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(store = %self.url, partitions = n, "retention: dropped old daily partitions")
                }
                Err(e) => {
                    tracing::warn!(store = %self.url, error = %e, "retention sweep failed; retried in an hour")
                }
            }
        }
    }

    fn ready(&mut self) -> Result<&mut tokenscope_clickhouse::ClickHouseSink, StoreError> {
        if self.inner.is_none() {
            let store = tokenscope_clickhouse::ClickHouseStore::connect(self.cfg.clone())?;
            let version = store.migrate()?;
            tracing::info!(
                store = %self.url,
                server_version = store.server_version(),
                schema_version = version,
                "ClickHouse store ready"
            );
            self.inner = Some(tokenscope_clickhouse::ClickHouseSink::new(store));
        }
        self.inner.as_mut().ok_or_else(|| StoreError::Sink {
            sink: "clickhouse",
            class: ErrorClass::Other,
            message: "not connected".to_owned(),
        })
    }
}

impl RecordSink for LazyClickHouse {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        self.ready()?.write_batch(batch)?;
        self.sweep_if_due();
        Ok(())
    }

    fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        self.ready()?.apply_updates(updates)
    }

    fn take_unmatched(&mut self, shutting_down: bool) -> tokenscope_store::UnmatchedCounts {
        self.inner
            .as_mut()
            .map(|s| s.take_unmatched(shutting_down))
            .unwrap_or_default()
    }

    fn take_recovered(&mut self) -> Vec<StoreError> {
        self.inner
            .as_mut()
            .map(|s| s.take_recovered())
            .unwrap_or_default()
    }

    fn name(&self) -> &'static str {
        "clickhouse"
    }
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
