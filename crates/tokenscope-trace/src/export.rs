//! OTLP export of kept traces: a bounded queue, one batching task, retries.
//!
//! Invariants:
//! * [`TraceExporter::submit`] never blocks and never allocates beyond the spans it is given:
//!   it checks a span budget (`queue_spans`, counting spans queued *and* being exported) and
//!   either enqueues or drops and counts (`queue_full`). Memory is bounded by the budget
//!   whatever the collector does.
//! * One task batches (`batch_spans` or `batch_timeout`, whichever first) and exports one
//!   batch at a time, over OTLP/HTTP (protobuf, `POST …/v1/traces`) or OTLP/gRPC
//!   (`TraceService/Export`, cargo feature `grpc`, on by default; without it
//!   [`Protocol::Grpc`] is refused when parsed and when an exporter is built —
//!   [`ExportError::GrpcNotBuilt`], a configuration error, never a panic).
//! * A failed export is retried with exponential backoff (honouring `Retry-After`) on the
//!   errors the OTLP spec calls retryable (HTTP 429/502/503/504, gRPC UNAVAILABLE etc.,
//!   connection errors, timeouts) until `export_timeout` has passed since the first attempt;
//!   then the batch is dropped and counted (`export_failed`). Non-retryable answers drop it at
//!   once (`rejected`). Spans the collector reports as rejected in a partial success are counted
//!   as `rejected` too.
//! * Shutdown exports what is queued within the grace period; the rest is counted as
//!   `shutdown`. Every submitted span ends up exported or counted as dropped exactly once.
//! * `https://` endpoints use TLS (tokenscope-net: rustls, the system's roots plus
//!   [`ExporterConfig::tls`]'s CA file, its client certificate for mutual TLS; ALPN `h2` for
//!   gRPC). A failed handshake is a `transport` error, retried like a refused connection.
//! * Header values are never logged (`Debug` of [`ExporterConfig`] shows their names only).

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
#[cfg(feature = "grpc")]
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{
    any_value::Value, AnyValue, InstrumentationScope, KeyValue,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
use prost::Message;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenscope_net::{ClientTls, ConnectOptions, HttpsConnect, Versions};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

/// OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention).
    #[default]
    Http,
    /// OTLP/gRPC (port 4317 by convention). Needs the cargo feature `grpc`.
    Grpc,
}

impl FromStr for Protocol {
    type Err = ExportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "http" | "http/protobuf" | "http-proto" => Ok(Protocol::Http),
            "grpc" if cfg!(feature = "grpc") => Ok(Protocol::Grpc),
            "grpc" => Err(ExportError::GrpcNotBuilt),
            other => Err(ExportError::Protocol(other.to_owned())),
        }
    }
}

impl Protocol {
    /// `http` or `grpc`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Grpc => "grpc",
        }
    }
}

/// Configuration errors of the exporter.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The endpoint is not an `http[s]://host:port[/path]` URL.
    #[error("invalid OTLP endpoint {url:?}: {why}")]
    Endpoint {
        /// The value given.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// Unknown protocol name.
    #[error("unknown OTLP protocol {0:?} (use http or grpc)")]
    Protocol(String),
    /// OTLP/gRPC was asked for, but this binary was built without the cargo feature `grpc`.
    #[error("OTLP protocol \"grpc\" is not built into this binary (built without the cargo feature \"grpc\" of tokenscope-trace); use \"http\"")]
    GrpcNotBuilt,
    /// A header name or value is not valid.
    #[error("invalid OTLP export header {0:?}")]
    Header(String),
}

/// Exporter settings.
#[derive(Clone)]
pub struct ExporterConfig {
    /// `http[s]://host:4318` (HTTP; `/v1/traces` is appended unless the path already ends with
    /// it, or `endpoint_as_is`) or `http[s]://host:4317` (gRPC).
    pub endpoint: String,
    /// OTLP/HTTP: `endpoint` is the full traces URL (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
    /// nothing is appended.
    pub endpoint_as_is: bool,
    /// TLS of an `https://` endpoint (trust roots, client certificate).
    pub tls: ClientTls,
    /// Transport.
    pub protocol: Protocol,
    /// Span budget of the queue (queued + being exported).
    pub queue_spans: usize,
    /// Spans per export request.
    pub batch_spans: usize,
    /// Longest wait to fill a batch.
    pub batch_timeout: Duration,
    /// Time allowed for one batch, retries included.
    pub export_timeout: Duration,
    /// Extra request headers (gRPC metadata), e.g. authentication for a hosted backend.
    pub headers: Vec<(String, String)>,
    /// Resource attributes (`service.name`, `service.version`, `service.instance.id`, …).
    pub resource: Vec<(String, String)>,
}

impl std::fmt::Debug for ExporterConfig {
    /// Header values are secrets: only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExporterConfig")
            .field("endpoint", &tokenscope_core::redact_url(&self.endpoint))
            .field("endpoint_as_is", &self.endpoint_as_is)
            .field("tls", &self.tls)
            .field("protocol", &self.protocol)
            .field("queue_spans", &self.queue_spans)
            .field("batch_spans", &self.batch_spans)
            .field("batch_timeout", &self.batch_timeout)
            .field("export_timeout", &self.export_timeout)
            .field(
                "headers",
                &self.headers.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("resource", &self.resource)
            .finish()
    }
}

impl Default for ExporterConfig {
    fn default() -> Self {
        Self {
            endpoint: "http://127.0.0.1:4318".into(),
            endpoint_as_is: false,
            tls: ClientTls::system(),
            protocol: Protocol::Http,
            queue_spans: 16_384,
            batch_spans: 512,
            batch_timeout: Duration::from_secs(1),
            export_timeout: Duration::from_secs(10),
            headers: Vec::new(),
            resource: vec![("service.name".into(), "tokenscope".into())],
        }
    }
}

/// Why spans were not exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanDropReason {
    /// The queue's span budget was used up.
    QueueFull,
    /// Every retry failed until `export_timeout`.
    ExportFailed,
    /// The collector refused them (non-retryable status, or partial success).
    Rejected,
    /// Still queued when shutdown's grace period ended.
    Shutdown,
}

impl SpanDropReason {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            SpanDropReason::QueueFull => "queue_full",
            SpanDropReason::ExportFailed => "export_failed",
            SpanDropReason::Rejected => "rejected",
            SpanDropReason::Shutdown => "shutdown",
        }
    }
}

/// Receives the exporter's events (metrics). Called from the exporter task and, for
/// `QueueFull`, from the request path: implementations must not block.
pub trait ExportObserver: Send + Sync + 'static {
    /// Spans the collector accepted.
    fn exported(&self, spans: usize);
    /// Spans given up.
    fn dropped(&self, reason: SpanDropReason, spans: usize);
    /// One failed export attempt, by kind (`transport`, `timeout`, `status_retryable`,
    /// `status_rejected`).
    fn export_error(&self, kind: &'static str);
    /// Spans now queued or being exported.
    fn queue_depth(&self, spans: usize);
}

/// An observer that ignores everything.
#[derive(Debug, Default)]
pub struct NoopExportObserver;

impl ExportObserver for NoopExportObserver {
    fn exported(&self, _: usize) {}
    fn dropped(&self, _: SpanDropReason, _: usize) {}
    fn export_error(&self, _: &'static str) {}
    fn queue_depth(&self, _: usize) {}
}

struct Inner {
    queued: AtomicUsize,
    cap: usize,
    closed: AtomicBool,
    shutdown: Notify,
    done: Notify,
    finished: AtomicBool,
    /// Shutdown's grace ran out: the spans left were counted as `shutdown`; the task reports
    /// nothing more.
    abandoned: AtomicBool,
    observer: Arc<dyn ExportObserver>,
}

/// The exporter handle (cheap to share behind an `Arc`).
pub struct TraceExporter {
    tx: mpsc::UnboundedSender<Vec<Span>>,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TraceExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceExporter")
            .field("queued", &self.inner.queued.load(Ordering::Relaxed))
            .field("cap", &self.inner.cap)
            .finish_non_exhaustive()
    }
}

enum Transport {
    Http {
        client: Box<Client<HttpsConnect, Full<Bytes>>>,
        uri: Uri,
        headers: Vec<(HeaderName, HeaderValue)>,
    },
    #[cfg(feature = "grpc")]
    Grpc {
        client: TraceServiceClient<tonic::transport::Channel>,
        metadata: Vec<(
            tonic::metadata::MetadataKey<tonic::metadata::Ascii>,
            tonic::metadata::AsciiMetadataValue,
        )>,
    },
}

enum Failure {
    Retry(&'static str, Option<Duration>),
    Reject(&'static str),
}

/// The connect timeout of both transports (TCP and the TLS handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The traces URL of an OTLP/HTTP `endpoint`: `…/v1/traces` appended (unless the path already
/// ends with it), or the URL as it is when `as_is`.
fn http_uri(endpoint: &str, as_is: bool) -> Result<Uri, ExportError> {
    let bad = |why: &str| ExportError::Endpoint {
        url: tokenscope_core::redact_url(endpoint),
        why: why.to_owned(),
    };
    let uri: Uri = endpoint
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(bad("expected http://host:port or https://host:port"));
    }
    if uri.host().is_none() {
        return Err(bad("no host"));
    }
    if as_is {
        return Ok(uri);
    }
    let path = uri.path().trim_end_matches('/');
    let path = if path.ends_with("/v1/traces") {
        path.to_owned()
    } else {
        format!("{path}/v1/traces")
    };
    let mut parts = uri.into_parts();
    parts.path_and_query = Some(
        path.parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?,
    );
    Uri::from_parts(parts).map_err(|e| bad(&e.to_string()))
}

fn string_kv(k: &str, v: &str) -> KeyValue {
    KeyValue {
        key: k.to_owned(),
        value: Some(AnyValue {
            value: Some(Value::StringValue(v.to_owned())),
        }),
        ..Default::default()
    }
}

fn retry_after(h: &http::HeaderMap) -> Option<Duration> {
    h.get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// The OTLP/gRPC transport (a lazily connected tonic channel).
#[cfg(feature = "grpc")]
fn grpc_transport(cfg: &ExporterConfig) -> Result<Transport, ExportError> {
    // Validates the URL the same way (scheme, host).
    http_uri(&cfg.endpoint, true)?;
    let ep = tonic::transport::Endpoint::from_shared(cfg.endpoint.clone())
        .map_err(|e| ExportError::Endpoint {
            url: tokenscope_core::redact_url(&cfg.endpoint),
            why: e.to_string(),
        })?
        .connect_timeout(CONNECT_TIMEOUT);
    // http:// in the clear (HTTP/2 with prior knowledge), https:// with TLS and ALPN h2.
    let connector = tokenscope_net::connector(
        &cfg.tls,
        ConnectOptions {
            timeout: Some(CONNECT_TIMEOUT),
            nodelay: true,
            versions: Versions::Http2,
            ..ConnectOptions::default()
        },
    );
    let client = TraceServiceClient::new(ep.connect_with_connector_lazy(connector));
    let mut metadata = Vec::new();
    for (k, v) in &cfg.headers {
        let key = tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
            .map_err(|_| ExportError::Header(k.clone()))?;
        let value = v.parse().map_err(|_| ExportError::Header(k.clone()))?;
        metadata.push((key, value));
    }
    Ok(Transport::Grpc { client, metadata })
}

/// Built without the `grpc` feature: a configuration error.
#[cfg(not(feature = "grpc"))]
fn grpc_transport(_cfg: &ExporterConfig) -> Result<Transport, ExportError> {
    Err(ExportError::GrpcNotBuilt)
}

impl Transport {
    fn new(cfg: &ExporterConfig) -> Result<Self, ExportError> {
        match cfg.protocol {
            Protocol::Http => {
                let uri = http_uri(&cfg.endpoint, cfg.endpoint_as_is)?;
                let mut headers = Vec::new();
                for (k, v) in &cfg.headers {
                    let name = HeaderName::from_bytes(k.as_bytes())
                        .map_err(|_| ExportError::Header(k.clone()))?;
                    let value =
                        HeaderValue::from_str(v).map_err(|_| ExportError::Header(k.clone()))?;
                    headers.push((name, value));
                }
                let connector = tokenscope_net::connector(
                    &cfg.tls,
                    ConnectOptions {
                        timeout: Some(CONNECT_TIMEOUT),
                        nodelay: true,
                        versions: Versions::Any,
                        ..ConnectOptions::default()
                    },
                );
                let client = Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build(connector);
                Ok(Transport::Http {
                    client: Box::new(client),
                    uri,
                    headers,
                })
            }
            Protocol::Grpc => grpc_transport(cfg),
        }
    }

    /// One attempt. `Ok(rejected spans)` when the collector answered with success.
    #[cfg_attr(not(feature = "grpc"), allow(unused_variables))]
    async fn export(
        &mut self,
        req: &ExportTraceServiceRequest,
        body: &Bytes,
        timeout: Duration,
    ) -> Result<u64, Failure> {
        match self {
            Transport::Http {
                client,
                uri,
                headers,
            } => {
                let mut b = Request::builder()
                    .method(Method::POST)
                    .uri(uri.clone())
                    .header(http::header::CONTENT_TYPE, "application/x-protobuf");
                for (k, v) in headers.iter() {
                    b = b.header(k, v);
                }
                let request = b
                    .body(Full::new(body.clone()))
                    .map_err(|_| Failure::Reject("request"))?;
                let call = async {
                    let resp = client
                        .request(request)
                        .await
                        .map_err(|_| Failure::Retry("transport", None))?;
                    let status = resp.status();
                    let after = retry_after(resp.headers());
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map_err(|_| Failure::Retry("transport", None))?
                        .to_bytes();
                    if status.is_success() {
                        let rejected = ExportTraceServiceResponse::decode(body)
                            .ok()
                            .and_then(|r| r.partial_success)
                            .map_or(0, |p| u64::try_from(p.rejected_spans).unwrap_or(0));
                        Ok(rejected)
                    } else if matches!(
                        status,
                        StatusCode::TOO_MANY_REQUESTS
                            | StatusCode::BAD_GATEWAY
                            | StatusCode::SERVICE_UNAVAILABLE
                            | StatusCode::GATEWAY_TIMEOUT
                    ) {
                        Err(Failure::Retry("status_retryable", after))
                    } else {
                        tracing::warn!(status = %status, "OTLP/HTTP export refused; batch dropped");
                        Err(Failure::Reject("status_rejected"))
                    }
                };
                tokio::time::timeout(timeout, call)
                    .await
                    .unwrap_or(Err(Failure::Retry("timeout", None)))
            }
            #[cfg(feature = "grpc")]
            Transport::Grpc { client, metadata } => {
                let mut request = tonic::Request::new(req.clone());
                request.set_timeout(timeout);
                for (k, v) in metadata.iter() {
                    request.metadata_mut().insert(k.clone(), v.clone());
                }
                let call = client.export(request);
                match tokio::time::timeout(timeout, call).await {
                    Err(_) => Err(Failure::Retry("timeout", None)),
                    Ok(Ok(resp)) => Ok(resp
                        .into_inner()
                        .partial_success
                        .map_or(0, |p| u64::try_from(p.rejected_spans).unwrap_or(0))),
                    Ok(Err(status)) => {
                        use tonic::Code;
                        match status.code() {
                            Code::Cancelled
                            | Code::DeadlineExceeded
                            | Code::ResourceExhausted
                            | Code::Aborted
                            | Code::OutOfRange
                            | Code::Unavailable
                            | Code::DataLoss
                            | Code::Unknown => Err(Failure::Retry(
                                if status.code() == Code::Unavailable
                                    && status.message().contains("transport")
                                {
                                    "transport"
                                } else {
                                    "status_retryable"
                                },
                                None,
                            )),
                            _ => {
                                tracing::warn!(code = ?status.code(), message = status.message(), "OTLP/gRPC export refused; batch dropped");
                                Err(Failure::Reject("status_rejected"))
                            }
                        }
                    }
                }
            }
        }
    }
}

impl TraceExporter {
    /// Validates the configuration and starts the exporter task on the current tokio runtime.
    pub fn spawn(
        cfg: ExporterConfig,
        observer: Arc<dyn ExportObserver>,
    ) -> Result<Arc<Self>, ExportError> {
        let transport = Transport::new(&cfg)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            queued: AtomicUsize::new(0),
            cap: cfg.queue_spans.max(1),
            closed: AtomicBool::new(false),
            shutdown: Notify::new(),
            done: Notify::new(),
            finished: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            observer,
        });
        let resource = Resource {
            attributes: cfg.resource.iter().map(|(k, v)| string_kv(k, v)).collect(),
            ..Default::default()
        };
        let task = Task {
            cfg,
            transport,
            rx,
            inner: inner.clone(),
            resource,
        };
        tokio::spawn(task.run());
        Ok(Arc::new(TraceExporter { tx, inner }))
    }

    /// Queues one trace's spans; `false` when they were dropped (queue full or shut down).
    /// Never blocks.
    pub fn submit(&self, spans: Vec<Span>) -> bool {
        let n = spans.len();
        if n == 0 {
            return true;
        }
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            inner.observer.dropped(SpanDropReason::Shutdown, n);
            return false;
        }
        let mut cur = inner.queued.load(Ordering::Relaxed);
        loop {
            if cur + n > inner.cap {
                inner.observer.dropped(SpanDropReason::QueueFull, n);
                return false;
            }
            match inner.queued.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        inner.observer.queue_depth(cur + n);
        if self.tx.send(spans).is_err() {
            inner.queued.fetch_sub(n, Ordering::AcqRel);
            inner.observer.dropped(SpanDropReason::Shutdown, n);
            return false;
        }
        true
    }

    /// Spans queued or being exported.
    pub fn queued_spans(&self) -> usize {
        self.inner.queued.load(Ordering::Relaxed)
    }

    /// Stops accepting spans and exports what is queued, for at most `grace`; what is left
    /// then is counted as dropped (`shutdown`).
    pub async fn shutdown(&self, grace: Duration) {
        self.inner.closed.store(true, Ordering::Release);
        let done = self.inner.done.notified();
        tokio::pin!(done);
        done.as_mut().enable();
        if self.inner.finished.load(Ordering::Acquire) {
            return;
        }
        self.inner.shutdown.notify_one();
        if tokio::time::timeout(grace, done).await.is_err() {
            self.inner.abandoned.store(true, Ordering::Release);
            let left = self.inner.queued.swap(0, Ordering::AcqRel);
            if left > 0 {
                tracing::warn!(
                    spans = left,
                    "trace export did not finish within the shutdown grace; spans dropped"
                );
                self.inner.observer.dropped(SpanDropReason::Shutdown, left);
            }
        }
    }
}

struct Task {
    cfg: ExporterConfig,
    transport: Transport,
    rx: mpsc::UnboundedReceiver<Vec<Span>>,
    inner: Arc<Inner>,
    resource: Resource,
}

impl Task {
    async fn run(mut self) {
        let mut stopping: Option<Instant> = None;
        loop {
            let mut batch: Vec<Span> = Vec::new();
            if stopping.is_none() {
                tokio::select! {
                    biased;
                    () = self.inner.shutdown.notified() => {
                        stopping = Some(Instant::now());
                    }
                    m = self.rx.recv() => match m {
                        Some(spans) => batch.extend(spans),
                        None => stopping = Some(Instant::now()),
                    },
                }
            }
            // Fill the batch: until full, the timeout, or (when stopping) the queue is empty.
            let fill_until = Instant::now() + self.cfg.batch_timeout;
            while batch.len() < self.cfg.batch_spans {
                if stopping.is_some() {
                    match self.rx.try_recv() {
                        Ok(spans) => batch.extend(spans),
                        Err(_) => break,
                    }
                    continue;
                }
                tokio::select! {
                    biased;
                    () = self.inner.shutdown.notified() => stopping = Some(Instant::now()),
                    m = self.rx.recv() => match m {
                        Some(spans) => batch.extend(spans),
                        None => stopping = Some(Instant::now()),
                    },
                    () = tokio::time::sleep_until(fill_until) => break,
                }
            }
            if batch.is_empty() {
                if stopping.is_some() {
                    break;
                }
                continue;
            }
            let n = batch.len();
            self.export_batch(batch).await;
            if !self.inner.abandoned.load(Ordering::Acquire) {
                let left = self
                    .inner
                    .queued
                    .fetch_sub(n, Ordering::AcqRel)
                    .saturating_sub(n);
                self.observe().queue_depth(left);
            }
        }
        self.inner.finished.store(true, Ordering::Release);
        self.inner.done.notify_waiters();
    }

    /// The observer, or a no-op once shutdown abandoned the task.
    fn observe(&self) -> &dyn ExportObserver {
        static NOOP: NoopExportObserver = NoopExportObserver;
        if self.inner.abandoned.load(Ordering::Acquire) {
            &NOOP
        } else {
            &*self.inner.observer
        }
    }

    async fn export_batch(&mut self, spans: Vec<Span>) {
        let n = spans.len();
        let req = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "tokenscope".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        let body = match self.transport {
            Transport::Http { .. } => Bytes::from(req.encode_to_vec()),
            #[cfg(feature = "grpc")]
            Transport::Grpc { .. } => Bytes::new(),
        };
        let start = Instant::now();
        let deadline = start + self.cfg.export_timeout;
        let mut backoff = Duration::from_millis(100);
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                self.observe().dropped(SpanDropReason::ExportFailed, n);
                tracing::warn!(
                    spans = n,
                    "OTLP export failed until the export timeout; batch dropped"
                );
                return;
            }
            match self.transport.export(&req, &body, remaining).await {
                Ok(rejected) => {
                    let rejected = usize::try_from(rejected).unwrap_or(n).min(n);
                    if rejected > 0 {
                        self.observe().dropped(SpanDropReason::Rejected, rejected);
                    }
                    self.observe().exported(n - rejected);
                    return;
                }
                Err(Failure::Reject(kind)) => {
                    self.observe().export_error(kind);
                    self.observe().dropped(SpanDropReason::Rejected, n);
                    return;
                }
                Err(Failure::Retry(kind, after)) => {
                    self.observe().export_error(kind);
                    tracing::debug!(kind, "OTLP export attempt failed; retrying");
                    let jitter =
                        Duration::from_millis(fastrand::u64(0..=backoff.as_millis() as u64 / 2));
                    let wait = after.unwrap_or(backoff + jitter);
                    let left = deadline.saturating_duration_since(Instant::now());
                    if wait >= left {
                        self.observe().dropped(SpanDropReason::ExportFailed, n);
                        tracing::warn!(
                            spans = n,
                            "OTLP export failed until the export timeout; batch dropped"
                        );
                        return;
                    }
                    tokio::time::sleep(wait).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_endpoints() {
        let uri = |e: &str| http_uri(e, false).expect("ok").to_string();
        assert_eq!(
            uri("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(uri("http://h:4318/"), "http://h:4318/v1/traces");
        assert_eq!(uri("http://h:4318/otlp"), "http://h:4318/otlp/v1/traces");
        assert_eq!(uri("http://h:4318/v1/traces"), "http://h:4318/v1/traces");
        assert_eq!(uri("https://h:4318"), "https://h:4318/v1/traces");
        // The traces endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is used as is.
        assert_eq!(
            http_uri("https://h/custom/ingest", true)
                .expect("ok")
                .to_string(),
            "https://h/custom/ingest"
        );
        assert!(http_uri("ftp://h:4318", false).is_err());
        assert!(http_uri("h:4318", false).is_err());
        assert!(http_uri("not a url", true).is_err());
        let cfg = ExporterConfig {
            headers: vec![("authorization".into(), "Bearer s3cret".into())],
            ..ExporterConfig::default()
        };
        let shown = format!("{cfg:?}");
        assert!(
            shown.contains("authorization") && !shown.contains("s3cret"),
            "{shown}"
        );
        #[cfg(feature = "grpc")]
        assert_eq!("GRPC".parse::<Protocol>().expect("ok"), Protocol::Grpc);
        assert!("thrift".parse::<Protocol>().is_err());
    }

    /// Without the `grpc` feature, asking for gRPC is a configuration error, both when the
    /// name is parsed and when an exporter is built with `Protocol::Grpc` directly.
    #[cfg(not(feature = "grpc"))]
    #[test]
    fn grpc_without_the_feature_is_a_config_error() {
        assert!(matches!(
            "grpc".parse::<Protocol>(),
            Err(ExportError::GrpcNotBuilt)
        ));
        let cfg = ExporterConfig {
            endpoint: "http://127.0.0.1:4317".into(),
            protocol: Protocol::Grpc,
            ..ExporterConfig::default()
        };
        assert!(matches!(
            Transport::new(&cfg),
            Err(ExportError::GrpcNotBuilt)
        ));
        assert!(ExportError::GrpcNotBuilt.to_string().contains("feature"));
    }
}
