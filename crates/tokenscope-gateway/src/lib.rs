//! # tokenscope-gateway
//!
//! The OpenAI-compatible reverse proxy that measures every inference request.
//!
//! * [`config`] — TOML + environment configuration.
//! * `proxy` — the request path (measured endpoints and pass-through).
//! * `body` — [`body::MeteredBody`], the response body wrapper that forwards and measures.
//! * `recording` — the exactly-one-record guarantee ([`recording::RecordOut`]).
//! * `admin` — `/metrics` and the admin API on a separate listener; [`auth`] — who may call
//!   which admin route.
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
pub mod auth;
pub mod body;
/// The configuration (its own crate, `tokenscope-config`; `crate::config::…` paths resolve).
pub use tokenscope_config as config;
pub mod cost;
pub mod dashboard;
pub mod engine;
pub mod models;
mod proxy;
pub mod recording;
mod server;
mod upconn;

pub use config::{ConfigError, DurationSetting, GatewayConfig, TracingSection, UpstreamConfig};
pub use proxy::{REQUEST_ID, TRACE_ID};

use axum::routing::{any, post};
use axum::Router;
use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use recording::RecordOut;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_core::{PhaseUpdate, RequestRecord};
use tokenscope_engine_state::{
    EngineStateHandle, EngineTarget, GpuConfig, GpuStateHandle, ScrapeConfig,
};
use tokenscope_store::{
    spawn_pipeline, spawn_pipeline_with_spool, DropReason, ErrorClass, LossReason, PipelineConfig,
    PipelineHandle, PipelineObserver, RecordSink, Recorder, ShutdownReport, Spool, SpoolConfig,
    SpoolState, SqliteStore, StoreError,
};
use tokenscope_telemetry::{Metrics, MetricsConfig, UserLabelMode};

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

pub(crate) struct Upstream {
    name: String,
    base: Uri,
    cfg: UpstreamConfig,
    /// The engine's state, scraped from its metrics endpoint (lock-free reads).
    state: Option<EngineStateHandle>,
    /// Connections of measured requests (driven by the request's task, see `upconn`).
    pool: Arc<upconn::UpPool>,
}

/// Idle upstream connections of measured requests kept per engine after a burst (more are
/// closed when released).
const POOL_MAX_IDLE_PER_HOST: usize = 256;
/// Idle connections of the pass-through client (`/v1/models`, `/health`, …) per engine.
const PASSTHROUGH_MAX_IDLE_PER_HOST: usize = 32;

/// State shared by every request. Nothing in it is locked across I/O.
pub(crate) struct Shared {
    cfg: GatewayConfig,
    client: Client<HttpConnector, axum::body::Body>,
    upstreams: Vec<Upstream>,
    api_keys: HashMap<String, config::ApiKeyConfig>,
    metrics: Arc<Metrics>,
    out: Arc<dyn RecordOut>,
    recent: Mutex<VecDeque<Arc<RequestRecord>>>,
    gpu: Option<GpuStateHandle>,
    recorder: Recorder,
    tokenizers: tokenscope_tokenize::Tokenizers,
    /// Tail sampling and OTLP export (`[tracing]` with an endpoint), else `None`.
    tracing: Option<Tracing>,
    /// `cost_usd` of finished records (`[[prices]]`).
    cost: cost::CostMeter,
    /// Usage of the current budget periods (`llm_budget_usage_ratio`).
    budgets: Arc<cost::BudgetTracker>,
    /// Business-metric values from `POST /api/business-metrics` (sidecar file).
    business_metrics: Arc<cost::BusinessMetricsFile>,
    /// The gateway's own alerting (`[alerts] webhook_url`): a bounded sample buffer.
    alerting: alerting::Alerting,
    /// Trace ids the tail sampler kept recently (the dashboard's trace links).
    kept_traces: dashboard::KeptTraces,
    /// Set when the shutdown grace period is over: requests cut from then on are recorded as
    /// `shutdown`, not `cancelled`.
    shutting_down: std::sync::atomic::AtomicBool,
    /// Records whose finishing waits for a tokenizer count (`recording::finalize`); shutdown
    /// waits for them before it drains the store pipeline.
    finishing: tokio_util::task::TaskTracker,
}

/// The trace side of the gateway: decisions on the request path, export on its own task.
pub(crate) struct Tracing {
    sampler: tokenscope_trace::TailSampler,
    exporter: Arc<tokenscope_trace::TraceExporter>,
}

/// What the trace of a finished request needs besides its record.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TraceFacts {
    pub trace: tokenscope_trace::RequestTrace,
    pub times: tokenscope_trace::SpanTimes,
}

/// Feeds trace exporter events into the Prometheus metrics.
struct TraceMetricsObserver(Arc<Metrics>);

impl tokenscope_trace::ExportObserver for TraceMetricsObserver {
    fn exported(&self, spans: usize) {
        self.0.trace_spans_exported(spans as u64);
    }
    fn dropped(&self, reason: tokenscope_trace::SpanDropReason, spans: usize) {
        self.0.trace_spans_dropped(reason.as_str(), spans as u64);
    }
    fn export_error(&self, kind: &'static str) {
        self.0.trace_export_error(kind);
    }
    fn queue_depth(&self, spans: usize) {
        self.0.trace_queue_spans(spans);
    }
}

/// Starts the exporter for `[tracing]` (on the current runtime), if an endpoint is set.
fn start_tracing(
    cfg: &config::TracingSection,
    metrics: &Arc<Metrics>,
) -> Result<Option<Tracing>, ConfigError> {
    let Some(endpoint) = cfg
        .otlp_endpoint
        .as_deref()
        .filter(|e| !e.trim().is_empty())
    else {
        return Ok(None);
    };
    let invalid = |what: &str, e: String| ConfigError::Invalid(format!("tracing: {what}: {e}"));
    let protocol: tokenscope_trace::Protocol = cfg
        .otlp_protocol
        .parse()
        .map_err(|e: tokenscope_trace::ExportError| invalid("otlp_protocol", e.to_string()))?;
    let sampler = tokenscope_trace::TailSampler::new(tokenscope_trace::SamplerConfig {
        ratio: cfg.sample_ratio,
        slow_threshold: cfg
            .slow_threshold
            .as_ref()
            .map(DurationSetting::get)
            .transpose()
            .map_err(|e| invalid("slow_threshold", e))?,
        slow_above_p99: cfg.slow_above_p99,
        p99_min_samples: cfg.p99_min_samples.max(1),
        ..tokenscope_trace::SamplerConfig::default()
    });
    let instance = format!(
        "{}-{}",
        std::env::var("HOSTNAME").unwrap_or_else(|_| "tokenscope".into()),
        std::process::id()
    );
    let exporter = tokenscope_trace::TraceExporter::spawn(
        tokenscope_trace::ExporterConfig {
            endpoint: endpoint.trim().to_owned(),
            protocol,
            queue_spans: cfg.queue_spans,
            batch_spans: cfg.batch_spans,
            batch_timeout: cfg
                .batch_timeout
                .get()
                .map_err(|e| invalid("batch_timeout", e))?,
            export_timeout: cfg
                .export_timeout
                .get()
                .map_err(|e| invalid("export_timeout", e))?,
            headers: cfg
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            resource: vec![
                ("service.name".into(), cfg.service_name.clone()),
                ("service.version".into(), env!("CARGO_PKG_VERSION").into()),
                ("service.instance.id".into(), instance),
                ("telemetry.sdk.name".into(), "tokenscope".into()),
                ("telemetry.sdk.language".into(), "rust".into()),
            ],
        },
        Arc::new(TraceMetricsObserver(metrics.clone())),
    )
    .map_err(|e| ConfigError::Invalid(format!("tracing: {e}")))?;
    metrics.enable_trace_metrics();
    tracing::info!(
        endpoint = %redact_url(endpoint),
        protocol = protocol.as_str(),
        ratio = cfg.sample_ratio,
        "Trace export on (tail-sampled)."
    );
    Ok(Some(Tracing { sampler, exporter }))
}

impl Shared {
    /// The upstream for `model`: the first whose patterns match, else the default.
    fn route(&self, model: Option<&str>) -> Option<&Upstream> {
        model
            .and_then(|m| self.upstreams.iter().find(|u| u.cfg.serves(m)))
            .or_else(|| self.upstreams.iter().find(|u| u.cfg.default))
            .or_else(|| self.upstreams.first())
    }

    /// Late engine data (OTLP spans) for a record: joined in the recent-records ring and sent
    /// to the store, which applies it to the row (now or when the row arrives).
    /// A phase the record did not have when it was final is observed in
    /// `llm_request_phase_seconds` now (a phase is observed once per request).
    fn apply_engine_update(&self, update: PhaseUpdate) {
        let mut late: Vec<(String, &'static str, f64)> = Vec::new();
        {
            let mut recent = self.recent.lock();
            if let Some(slot) = recent
                .iter_mut()
                .rev()
                .find(|r| r.trace_id == update.trace_id)
            {
                for (phase, had, new) in [
                    ("queue", slot.queue_duration_ms, update.queue_duration_ms),
                    (
                        "prefill",
                        slot.prefill_duration_ms,
                        update.prefill_duration_ms,
                    ),
                    ("decode", slot.decode_duration_ms, update.decode_duration_ms),
                ] {
                    if let (None, Some(ms)) = (had, new) {
                        late.push((slot.model.clone(), phase, ms));
                    }
                }
                let mut rec = (**slot).clone();
                rec.apply_update(&update);
                *slot = Arc::new(rec);
            }
        }
        for (model, phase, ms) in late {
            self.metrics.observe_phase(&model, phase, ms);
        }
        self.recorder.update(update);
    }

    /// Called exactly once per request by [`recording`].
    fn finish_record(&self, mut rec: RequestRecord, trace: TraceFacts) {
        rec.cost_usd = self.cost.cost(&rec, std::time::Instant::now());
        self.budgets.add(&rec);
        // Tail sampling first: a kept trace's id becomes the histograms' exemplar.
        let decision = self.tracing.as_ref().map(|t| {
            let model_label = self.metrics.model_label(&rec.model);
            let d = t.sampler.decide(&rec, &model_label, &trace.trace.trace_id);
            self.metrics.trace_decision(d.kept().map(|r| r.as_str()));
            d
        });
        let kept = decision.and_then(tokenscope_trace::Decision::kept);
        if decision.is_some() {
            self.kept_traces
                .decided(rec.created_at, &rec.trace_id, kept.is_some());
        }
        let user_bucket = self
            .metrics
            .observe(&rec, kept.map(|_| rec.trace_id.as_str()));
        if let (Some(t), Some(reason)) = (self.tracing.as_ref(), kept) {
            let server = self
                .upstreams
                .iter()
                .find(|u| u.name == rec.upstream)
                .and_then(|u| Some((u.base.host()?, u.base.port_u16().unwrap_or(80))));
            let spans = tokenscope_trace::build_spans(
                &rec,
                &tokenscope_trace::SpanInput {
                    trace: &trace.trace,
                    times: trace.times,
                    user_bucket: &user_bucket,
                    server,
                    reason,
                },
            );
            t.exporter.submit(spans);
        }
        if self.cfg.recent_records > 0 {
            let mut recent = self.recent.lock();
            if recent.len() >= self.cfg.recent_records {
                recent.pop_front();
            }
            recent.push_back(Arc::new(rec.clone()));
        }
        self.alerting
            .push(&rec, || self.metrics.model_label(&rec.model));
        self.out.submit(rec);
    }
}

/// Feeds pipeline events into the Prometheus metrics.
struct MetricsObserver(Arc<Metrics>);

impl PipelineObserver for MetricsObserver {
    fn on_enqueued(&self) {
        self.0.record_enqueued();
    }
    fn on_dropped(&self, reason: DropReason) {
        self.0.record_dropped(reason.as_str(), 1, false);
    }
    fn on_written(&self, rows: usize, latency: Duration, replayed: bool) {
        self.0.records_written(rows as u64, latency, replayed);
    }
    fn on_spooled(&self, rows: usize) {
        self.0.records_spooled(rows as u64);
    }
    fn on_duplicate(&self, rows: usize, replayed: bool) {
        self.0.records_duplicate(rows as u64, replayed);
    }
    fn on_store_reopened(&self, change: tokenscope_store::FileChange) {
        self.0.store_reopened(change.as_str());
    }
    fn on_store_error(&self, class: ErrorClass, _err: &StoreError) {
        self.0.store_error(class.as_str());
    }
    fn on_retry(&self) {
        self.0.store_retry();
    }
    fn on_lost(&self, rows: usize, reason: LossReason, in_memory: bool) {
        self.0.records_lost(reason.as_str(), rows as u64, in_memory);
    }
    fn on_spool_state(&self, st: SpoolState) {
        self.0
            .spool_state(st.bytes, st.batches, st.oldest_age, st.store_up);
        self.0.records_held(st.held_rows);
    }
    fn on_update_unmatched(
        &self,
        reason: tokenscope_store::pending::UnmatchedReason,
        updates: u64,
    ) {
        self.0
            .engine_update_unmatched(&format!("{reason:?}").to_ascii_lowercase(), updates);
    }
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

impl RecordOut for Recorder {
    fn submit(&self, rec: RequestRecord) {
        self.record(rec);
    }
}

/// A bound, not yet running gateway.
pub struct Gateway {
    shared: Arc<Shared>,
    proxy: tokio::net::TcpListener,
    admin: tokio::net::TcpListener,
    pipeline: PipelineHandle,
    /// The background runtime (see [`background_runtime`]).
    bg: BgRuntime,
    proxy_conns: Arc<server::Connections>,
    admin_conns: Arc<server::Connections>,
}

/// The runtime of everything that is not a proxied request: the admin listener (dashboard,
/// `/metrics`, OTLP receiver), engine-state and GPU scrapers, alert evaluation and trace
/// export. One worker thread at nice `worker_priority` + 10 (at least 10; raising one's own nice value needs no privilege),
/// so under contention the kernel favours the request path's threads.
fn background_runtime(worker_priority: i32) -> Result<BgRuntime, GatewayError> {
    let nice = (worker_priority + 10).clamp(10, 19);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(4)
        .thread_name("tokenscope-bg")
        // On Linux the nice value is per thread (PRIO_PROCESS of the calling thread).
        .on_thread_start(move || {
            let _ = rustix::process::setpriority_process(None, nice);
        })
        .enable_all()
        .build()
        .map(|rt| BgRuntime(Some(rt)))
        .map_err(GatewayError::Serve)
}

/// The background runtime, shut down without blocking when dropped (a plain `Runtime` panics
/// when dropped inside async code, e.g. when `bind` fails after creating it).
pub(crate) struct BgRuntime(Option<tokio::runtime::Runtime>);

impl BgRuntime {
    fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.0.as_ref().map(tokio::runtime::Runtime::handle)
    }
}

impl Drop for BgRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
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
        cfg.validate()?;
        // The store and the spool first, each proved writable with a real write (SQLite: a
        // committed header update; spool: a probe file): an unwritable one refuses the start
        // with its path and cause, before anything (runtime, scrapers, listeners) started.
        let target = StoreTarget::parse(&cfg.store);
        let store_err = |source: StoreError| GatewayError::Store {
            path: target.display(),
            source,
        };
        let sink = {
            let t = target.clone();
            tokio::task::spawn_blocking(move || open_sink(&t))
                .await
                .map_err(|e| {
                    store_err(StoreError::Sink {
                        sink: "store",
                        class: ErrorClass::Other,
                        message: format!("opening the store panicked: {e}"),
                    })
                })?
                .map_err(store_err)?
        };
        let spool = if cfg.spool.enabled {
            let dir = cfg
                .spool
                .dir
                .as_ref()
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| target.default_spool_dir());
            let spool = Spool::open(SpoolConfig {
                dir: dir.clone(),
                max_bytes: cfg.spool.max_bytes,
                segment_bytes: cfg.spool.segment_bytes,
                fsync: cfg.spool.fsync,
            })
            .map_err(|e| GatewayError::Spool {
                dir: dir.display().to_string(),
                source: e,
            })?;
            Some(spool)
        } else {
            None
        };
        // Background work (engine-state and GPU scrapers, alert evaluation, trace export and
        // later the admin listener) runs on its own runtime: a dashboard page or a large OTLP
        // body never waits in line with a request (docs/operations.md).
        let bg = background_runtime(cfg.worker_priority)?;
        let (metrics, upstreams, gpu, alerting, tracing, conn_metrics) = {
            let _bg = bg.handle().map(tokio::runtime::Handle::enter);
            let mut metrics = Metrics::new(MetricsConfig {
                max_models: cfg.metrics.max_models,
                max_request_types: cfg.metrics.max_request_types,
                max_business_lines: cfg.metrics.max_business_lines,
                user_label: match cfg.metrics.user_label {
                    config::UserLabel::Hash => UserLabelMode::Hash {
                        buckets: cfg.metrics.user_buckets,
                    },
                    config::UserLabel::TopK => UserLabelMode::TopK {
                        k: cfg.metrics.user_top_k,
                    },
                },
            });
            // Engine and GPU state: background scrapers, read lock-free at request arrival.
            let mut states = Vec::new();
            let mut upstreams = Vec::new();
            for u in &cfg.upstreams {
                let base: Uri = u
                    .url
                    .parse()
                    .map_err(|e| ConfigError::Invalid(format!("upstream {:?}: {e}", u.name)))?;
                let state = if u.scrape_interval_ms > 0 {
                    let target = EngineTarget {
                        name: u.name.clone(),
                        base_url: u.url.clone(),
                        metrics_url: u.metrics_url.clone(),
                        kind: u.kind,
                    };
                    let scrape = ScrapeConfig {
                        interval: Duration::from_millis(u.scrape_interval_ms),
                        ..ScrapeConfig::default()
                    };
                    match EngineStateHandle::spawn(target, scrape) {
                        Ok(h) => Some(h),
                        Err(e) => {
                            return Err(
                                ConfigError::Invalid(format!("upstream {:?}: {e}", u.name)).into()
                            )
                        }
                    }
                } else {
                    None
                };
                states.extend(state.clone());
                upstreams.push(Upstream {
                    name: u.name.clone(),
                    pool: upconn::UpPool::new(
                        &base,
                        cfg.connect_timeout(),
                        POOL_MAX_IDLE_PER_HOST,
                        cfg.upstream_idle_timeout(),
                    ),
                    base,
                    cfg: u.clone(),
                    state,
                });
            }
            let gpu = GpuStateHandle::spawn(&GpuConfig {
                dcgm_url: cfg.gpu.dcgm_url.clone(),
                nvml: cfg.gpu.nvml,
                scrape: ScrapeConfig {
                    interval: Duration::from_millis(cfg.gpu.interval_ms.max(100)),
                    ..ScrapeConfig::default()
                },
            })
            .map_err(|e| ConfigError::Invalid(format!("gpu: {e}")))?;
            tokenscope_engine_state::register_metrics(
                metrics.registry_mut(),
                &states,
                gpu.as_ref(),
            );
            let alerting = alerting::start(&cfg.alerts, &cfg.admin_listen, metrics.registry_mut())?;
            let conn_metrics = server::ConnMetrics::register(metrics.registry_mut());
            let metrics = Arc::new(metrics);
            {
                let m = metrics.clone();
                alerting.set_health(move || tokenscope_analysis::alerts::SelfHealth {
                    lost_total: m
                        .records_lost_totals()
                        .into_iter()
                        .map(|(r, n)| (r.to_owned(), n))
                        .collect(),
                    store_up: m.store_is_up(),
                });
            }
            let tracing = start_tracing(&cfg.tracing, &metrics)?;
            (metrics, upstreams, gpu, alerting, tracing, conn_metrics)
        };
        let pipeline_cfg = PipelineConfig {
            capacity: cfg.pipeline.capacity,
            batch_size: cfg.pipeline.batch_size,
            flush_interval: Duration::from_millis(cfg.pipeline.flush_interval_ms),
            handoff_batches: cfg.pipeline.handoff_batches,
            retry_backoff_max: Duration::from_millis(cfg.pipeline.retry_backoff_max_ms.max(100)),
            spill_interval: Duration::from_millis(
                cfg.pipeline
                    .spill_interval_ms
                    .max(cfg.pipeline.flush_interval_ms),
            ),
            ..PipelineConfig::default()
        };
        let observer = Arc::new(MetricsObserver(metrics.clone()));
        let (recorder, pipeline) = match spool {
            Some(spool) => spawn_pipeline_with_spool(sink, pipeline_cfg, spool, observer),
            None => spawn_pipeline(sink, pipeline_cfg, observer),
        };
        let bind = |addr: String| async move {
            tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|source| GatewayError::Bind { addr, source })
        };
        let proxy = bind(cfg.listen.clone()).await?;
        let admin = bind(cfg.admin_listen.clone()).await?;
        if let Some(w) = admin
            .local_addr()
            .ok()
            .and_then(|a| auth::open_admin_warning(&cfg, a))
        {
            tracing::warn!("{w}");
        }

        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout()));
        connector.set_nodelay(true);
        // The pass-through client (unmeasured paths; measured requests use `upconn`): at most
        // `PASSTHROUGH_MAX_IDLE_PER_HOST` idle connections per engine (each holds hyper's
        // buffers, ~30 KiB), each reused for at most `upstream_idle_timeout_ms` (below the
        // engine's keep-alive timeout; 0 = never: hyper-util reads a zero timeout as none).
        let idle = cfg.upstream_idle_timeout();
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle)
            .pool_max_idle_per_host(if idle.is_zero() {
                0
            } else {
                PASSTHROUGH_MAX_IDLE_PER_HOST
            })
            .build(connector);
        let tokenizers = tokenscope_tokenize::Tokenizers::new(&cfg.tokenizers)
            .map_err(|e| ConfigError::Invalid(format!("tokenizers: {e}")))?;
        let budgets = Arc::new(cost::BudgetTracker::new(
            &cfg.budgets,
            Some(metrics.clone()),
        ));
        let b = budgets.clone();
        alerting.set_budgets(
            cfg.budgets
                .iter()
                .map(|c| c.business_line.clone())
                .collect(),
            move |l| b.ratio(l),
        );
        if !budgets.is_empty() {
            let started_us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as i64)
                .unwrap_or(0);
            cost::seed_from_store(
                budgets.clone(),
                target.clone(),
                tokenscope_analysis::PriceTable::new(cfg.prices.clone()),
                started_us,
            );
        }
        // Model labels for the models the upstreams serve (config names now, `/v1/models` in
        // the background): client-chosen names cannot push them into `other`.
        let served: Vec<(String, Uri, Vec<String>, bool)> = upstreams
            .iter()
            .map(|u| {
                let polled = u.cfg.scrape_interval_ms > 0;
                (u.name.clone(), u.base.clone(), u.cfg.models.clone(), polled)
            })
            .collect();
        models::start(metrics.clone(), &served).await;
        let shared = Arc::new(Shared {
            api_keys: cfg.api_key_map(),
            cost: cost::CostMeter::new(tokenscope_analysis::PriceTable::new(cfg.prices.clone())),
            budgets: budgets.clone(),
            business_metrics: Arc::new(cost::BusinessMetricsFile::with_limits(
                cost::business_metrics_path(&target),
                cost::BusinessMetricsLimits {
                    max_bytes: cfg.admin.business_metrics_max_bytes,
                    max_lines: cfg.admin.business_metrics_max_lines,
                },
            )),
            cfg,
            client,
            upstreams,
            metrics,
            out: Arc::new(recorder.clone()),
            recent: Mutex::new(VecDeque::new()),
            gpu,
            recorder,
            tokenizers,
            tracing,
            alerting,
            kept_traces: dashboard::KeptTraces::default(),
            shutting_down: std::sync::atomic::AtomicBool::new(false),
            finishing: tokio_util::task::TaskTracker::new(),
        });
        Ok(Self {
            shared,
            proxy,
            admin,
            pipeline,
            bg,
            proxy_conns: server::Connections::new(conn_metrics.listener("proxy")),
            admin_conns: server::Connections::new(conn_metrics.listener("admin")),
        })
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
        let Gateway {
            shared,
            proxy,
            admin,
            pipeline,
            bg,
            proxy_conns,
            admin_conns,
        } = self;
        let pipeline = Arc::new(pipeline);
        let app = Router::new()
            .route("/v1/chat/completions", post(proxy::measured))
            .route("/v1/completions", post(proxy::measured))
            .route("/v1/embeddings", post(proxy::measured))
            .route("/chat/completions", post(proxy::measured))
            .route("/completions", post(proxy::measured))
            .route("/embeddings", post(proxy::measured))
            .fallback(any(proxy::passthrough))
            .with_state(shared.clone());
        let admin_app = admin::router(shared.clone(), pipeline.clone());
        let (proxy_limits, admin_limits) = conn_limits(&shared.cfg.limits);
        tracing::debug!(
            proxy_max_connections = proxy_limits.max_connections,
            admin_max_connections = admin_limits.max_connections,
            "connection caps"
        );

        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let proxy_task = tokio::spawn(server::serve(
            proxy,
            app,
            proxy_limits,
            stop_rx.clone(),
            proxy_conns.clone(),
        ));
        // The admin listener (dashboard, /metrics, OTLP receiver) on the background runtime.
        let bg_handle = bg
            .handle()
            .cloned()
            .unwrap_or_else(tokio::runtime::Handle::current);
        let admin_task = bg_handle.spawn(server::serve(
            admin,
            admin_app,
            admin_limits,
            stop_rx.clone(),
            admin_conns.clone(),
        ));
        shutdown.await;
        let in_flight = proxy_conns.in_flight();
        tracing::info!(
            in_flight,
            grace_ms = shared.cfg.shutdown_grace_ms,
            "Shutting down: no new connections; waiting for in-flight requests."
        );
        let _ = stop_tx.send(true);
        // The accept loops end first, so no connection starts after the waits below.
        let _ = proxy_task.await;
        let _ = admin_task.await;
        proxy_conns.drain();
        admin_conns.drain();
        let grace = Duration::from_millis(shared.cfg.shutdown_grace_ms);
        let mut cut = 0;
        if tokio::time::timeout(grace, proxy_conns.wait())
            .await
            .is_err()
        {
            cut = proxy_conns.in_flight();
            tracing::warn!(
                cut,
                "In-flight requests outlived the grace period; closing them (recorded as `shutdown`)."
            );
            shared
                .shutting_down
                .store(true, std::sync::atomic::Ordering::SeqCst);
            proxy_conns.cut();
            proxy_conns.wait().await;
        }
        if tokio::time::timeout(Duration::from_secs(2), admin_conns.wait())
            .await
            .is_err()
        {
            admin_conns.cut();
            admin_conns.wait().await;
        }
        // Records waiting for a tokenizer count (bounded by its own 5 s deadline).
        shared.finishing.close();
        if tokio::time::timeout(Duration::from_secs(6), shared.finishing.wait())
            .await
            .is_err()
        {
            tracing::warn!("Records still waiting for a tokenizer count at shutdown.");
        }
        // Every record is final and handed to the pipeline now.
        if let Some(t) = shared.tracing.as_ref() {
            t.exporter.shutdown(Duration::from_secs(5)).await;
        }
        drop(shared);
        let store = tokio::task::spawn_blocking(move || match Arc::try_unwrap(pipeline) {
            Ok(p) => p.shutdown(Duration::from_secs(30)),
            Err(p) => {
                tracing::error!(
                    "the store pipeline is still referenced at shutdown; flushing only"
                );
                p.flush();
                ShutdownReport::default()
            }
        })
        .await
        .unwrap_or_default();
        drop(bg);
        tracing::info!(
            in_flight_at_signal = in_flight,
            cut_at_deadline = cut,
            enqueued = store.enqueued,
            written = store.written,
            dropped = store.dropped,
            lost = store.lost,
            spooled_batches_left = store.spooled_batches,
            "Store drained."
        );
        Ok(ShutdownSummary {
            cut_in_flight: cut > 0,
            in_flight_at_signal: in_flight,
            cut,
            store,
        })
    }
}

/// The connection limits of both listeners from `[limits]` and the open-file limit.
fn conn_limits(l: &config::LimitsSection) -> (server::ConnLimits, server::ConnLimits) {
    let nofile = raise_nofile_limit();
    let admin_max = l.admin_max_connections.max(1);
    let proxy_max = if l.max_connections > 0 {
        l.max_connections
    } else {
        // Each proxied request holds a client and an upstream socket; keep 64 descriptors for
        // the store, the spool, the listeners and the scrapers.
        (nofile.saturating_sub(64 + admin_max as u64) / 2).clamp(16, 65_536) as usize
    };
    let write_timeout =
        (l.client_write_timeout_ms > 0).then(|| Duration::from_millis(l.client_write_timeout_ms));
    let proxy = server::ConnLimits {
        max_connections: proxy_max,
        header_timeout: Duration::from_millis(l.header_timeout_ms),
        write_timeout,
        max_header_bytes: l.max_header_bytes,
        nodelay: true,
    };
    let admin = server::ConnLimits {
        max_connections: admin_max,
        nodelay: false,
        ..proxy
    };
    (proxy, admin)
}

/// Raises the soft open-file limit to the hard one (as Go's runtime and nginx's
/// `worker_rlimit_nofile` do) and returns the soft limit in force.
fn raise_nofile_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (lim.current, lim.maximum) {
        if cur < max {
            let raised = rustix::process::Rlimit {
                current: Some(max),
                maximum: Some(max),
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                lim = getrlimit(Resource::Nofile);
            }
        }
    }
    lim.current.unwrap_or(1 << 20)
}
