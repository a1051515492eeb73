//! Start-up: everything [`crate::Gateway::bind`] builds before serving, in order.
//!
//! 1. the configuration validated; the store and the spool opened and proved writable (an
//!    unwritable one refuses the start with its path and cause, before anything else started);
//! 2. the background runtime ([`background_runtime`]) and, on it, the metrics registry, the
//!    engine-state and GPU scrapers, alerting and trace export;
//! 3. the store pipeline (its own writer thread) and both listeners;
//! 4. the request path's state: the pass-through client, tokenizers, budgets (seeded from the
//!    store), model labels, and [`Shared`] with its [`Fanout`].
//!
//! Invariants: nothing here runs per request; a failure at any step drops what was started
//! (the background runtime shuts down without blocking, [`BgRuntime`]).

use crate::config::{self, ConfigError, DurationSetting, GatewayConfig};
use crate::finished::{Fanout, Tracing};
use crate::replicas::{EjectPolicy, Replica, Replicas};
use crate::shared::{Shared, Upstream};
use crate::{
    alerting, auth, cost, models, redact_url, server, upconn, Gateway, GatewayError, StoreTarget,
};
use http::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_engine_state::{
    EngineStateHandle, EngineTarget, GpuConfig, GpuStateHandle, ScrapeConfig,
};
use tokenscope_store::{
    spawn_pipeline, spawn_pipeline_with_spool, DropReason, ErrorClass, LossReason, PipelineConfig,
    PipelineObserver, Spool, SpoolConfig, SpoolState, StoreError,
};
use tokenscope_telemetry::{Metrics, MetricsConfig, UserLabelMode};

/// Idle upstream connections of measured requests kept per engine after a burst (more are
/// closed when released).
const POOL_MAX_IDLE_PER_HOST: usize = 256;
/// Idle connections of the pass-through client (`/v1/models`, `/health`, …) per engine.
const PASSTHROUGH_MAX_IDLE_PER_HOST: usize = 32;

/// The connection pool of one replica at `base` (the one place a pool is made).
fn replica_pool(
    cfg: &GatewayConfig,
    base: &Uri,
    tls: &tokenscope_net::ClientTls,
) -> Arc<upconn::UpPool> {
    upconn::UpPool::new(
        base,
        cfg.connect_timeout(),
        POOL_MAX_IDLE_PER_HOST,
        cfg.upstream_idle_timeout(),
        tls,
    )
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

/// The key and extra headers of upstream `u`, read now from the environment and files (a
/// missing one refuses the start, naming the variable or file, never a value); logged by
/// header name only.
fn resolve_credentials(
    u: &config::UpstreamConfig,
) -> Result<config::UpstreamCredentials, ConfigError> {
    let creds = config::UpstreamCredentials::resolve(u, |var| std::env::var(var).ok())
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
    if !creds.is_empty() {
        tracing::info!(
            upstream = %u.name,
            headers = ?creds.names().collect::<Vec<_>>(),
            client_authorization = creds.mode().as_str(),
            "Upstream credentials."
        );
    }
    Ok(creds)
}

/// Starts the exporter for `[tracing]` (on the current runtime), if an endpoint is set.
fn start_tracing(
    cfg: &config::TracingSection,
    metrics: &Arc<Metrics>,
) -> Result<Option<Tracing>, ConfigError> {
    let Some((endpoint, endpoint_as_is)) = cfg.endpoint() else {
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
            endpoint: endpoint.to_owned(),
            endpoint_as_is,
            // The CA file and client certificate are read now: a bad file refuses the start.
            tls: tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions::from_paths(
                cfg.ca_file.as_deref(),
                cfg.client_cert.as_deref(),
                cfg.client_key.as_deref(),
            ))
            .map_err(|e| invalid("TLS", e.to_string()))?,
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
        endpoint = %crate::redact_url(endpoint),
        protocol = protocol.as_str(),
        ratio = cfg.sample_ratio,
        "Trace export on (tail-sampled)."
    );
    Ok(Some(Tracing { sampler, exporter }))
}

/// The TLS settings of an upstream (`ca_file`, `client_cert`, `client_key`; the system's roots
/// when none is set), its files read now.
fn upstream_tls(u: &config::UpstreamConfig) -> Result<tokenscope_net::ClientTls, ConfigError> {
    tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions::from_paths(
        u.ca_file.as_deref(),
        u.client_cert.as_deref(),
        u.client_key.as_deref(),
    ))
    .map_err(|e| ConfigError::Invalid(format!("upstream {:?}: {e}", u.name)))
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
    pub(crate) fn handle(&self) -> Option<&tokio::runtime::Handle> {
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

/// Opens the store, binds both listeners (port 0 allowed) and prepares the proxy.
pub(crate) async fn bind(cfg: GatewayConfig) -> Result<Gateway, GatewayError> {
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
        tokio::task::spawn_blocking(move || tokenscope_backend::open_sink(&t))
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
        // Engine and GPU state: background scrapers (one per replica), read lock-free at
        // request arrival.
        let replica_metrics = tokenscope_telemetry::replicas::ReplicaMetricsFamilies::register(
            metrics.registry_mut(),
        );
        let mut states = Vec::new();
        let mut upstreams = Vec::new();
        for u in &cfg.upstreams {
            let several = u.replica_urls().len() > 1;
            // Its CA file and client certificate, read now: a bad file refuses the start.
            let tls = upstream_tls(u)?;
            let policy = EjectPolicy {
                eject: u.eject(),
                max: u.eject_max(),
            };
            let creds = resolve_credentials(u)?;
            let mut replicas = Vec::new();
            for url in u.replica_urls() {
                let base: Uri = url.parse().map_err(|e| {
                    ConfigError::Invalid(format!("upstream {:?}: {}: {e}", u.name, redact_url(url)))
                })?;
                let name = config::replica_name(url);
                let state = if u.scrape_interval_ms > 0 {
                    let target = EngineTarget {
                        name: u.name.clone(),
                        base_url: url.clone(),
                        metrics_url: u.metrics_url.clone(),
                        kind: u.kind,
                        replica: several.then(|| name.clone()),
                        tls: tls.clone(),
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
                let m = replica_metrics.replica(&u.name, &name);
                replicas.push(Replica::new(
                    &u.name,
                    name,
                    base.clone(),
                    replica_pool(&cfg, &base, &tls),
                    state,
                    policy,
                    m,
                ));
            }
            if several {
                tracing::info!(
                    upstream = %u.name,
                    replicas = ?u.replica_urls().iter().map(|r| redact_url(r)).collect::<Vec<_>>(),
                    eject_ms = u.eject_ms,
                    eject_max_ms = u.eject_max().as_millis() as u64,
                    "upstream replicas: least outstanding requests, passive health"
                );
            }
            upstreams.push(Upstream {
                name: u.name.clone(),
                cfg: u.clone(),
                replicas: Replicas::new(replicas),
                creds,
                tls,
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
        tokenscope_engine_state::register_metrics(metrics.registry_mut(), &states, gpu.as_ref());
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
    // `[listen_tls]`: the certificate and key read now (a bad file refuses the start).
    let proxy_tls = match &cfg.listen_tls {
        None => None,
        Some(t) => Some(
            tokenscope_net::server_config(
                std::path::Path::new(&t.cert_file),
                std::path::Path::new(&t.key_file),
                t.client_ca_file.as_deref().map(std::path::Path::new),
                &[b"h2", b"http/1.1"],
            )
            .map_err(|e| ConfigError::Invalid(format!("listen_tls: {e}")))?,
        ),
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

    // Each upstream's TLS settings, by origin (the pass-through client and the `/v1/models`
    // fetch); the connect timeout covers TCP and the TLS handshake.
    let connectors = |timeout: Duration| {
        let opts = tokenscope_net::ConnectOptions {
            timeout: Some(timeout),
            nodelay: true,
            ..tokenscope_net::ConnectOptions::default()
        };
        let mut set = tokenscope_net::ConnectorSet::new(tokenscope_net::connector(
            &tokenscope_net::ClientTls::system(),
            opts,
        ));
        for u in &upstreams {
            for r in u.replicas.all() {
                set.insert(&r.base, tokenscope_net::connector(&u.tls, opts));
            }
        }
        set
    };
    let connector = connectors(cfg.connect_timeout());
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
    let served: Vec<models::Served> = upstreams
        .iter()
        .filter_map(|u| {
            Some(models::Served {
                name: u.name.clone(),
                base: u.replicas.first_healthy()?.base.clone(),
                patterns: u.cfg.models.clone(),
                polled: u.cfg.scrape_interval_ms > 0,
                creds: u.creds.clone(),
            })
        })
        .collect();
    models::start(metrics.clone(), &served, connectors(models::FETCH_TIMEOUT)).await;
    let fanout = Arc::new(Fanout::new(
        metrics.clone(),
        cost::CostMeter::new(tokenscope_analysis::PriceTable::new(cfg.prices.clone())),
        budgets,
        tracing,
        cfg.recent_records,
        alerting,
        recorder,
        upstreams
            .iter()
            .filter_map(|u| Some((u.name.clone(), u.replicas.first_healthy()?.base.clone())))
            .collect(),
        tokenizers.clone(),
        cfg.token_mismatch_tolerance,
    ));
    let shared = Arc::new(Shared {
        api_keys: cfg.api_key_map(),
        business_metrics: Arc::new(cost::BusinessMetricsFile::with_limits(
            target.business_metrics_path(),
            cost::BusinessMetricsLimits {
                max_bytes: cfg.admin.business_metrics_max_bytes,
                max_lines: cfg.admin.business_metrics_max_lines,
            },
        )),
        cfg,
        client,
        upstreams,
        metrics,
        gpu,
        tokenizers,
        fanout,
    });
    if let Some(h) = bg.handle() {
        crate::fleet::start(&shared, h);
    }
    Ok(Gateway {
        shared,
        proxy,
        admin,
        pipeline,
        bg,
        proxy_conns: server::Connections::new(conn_metrics.listener("proxy")),
        admin_conns: server::Connections::new(conn_metrics.listener("admin")),
        proxy_tls,
    })
}
