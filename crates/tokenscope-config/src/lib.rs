//! # tokenscope-config
//!
//! The gateway's configuration: the schema ([`GatewayConfig`] and its sections), defaults,
//! validation, and the layering of its sources. It depends on the vocabulary crates (core,
//! analysis for prices / budgets / alert thresholds, tokenize for tokenizer entries) and on
//! nothing that runs: the gateway, the CLI's analyses and the rule export all read it.
//!
//! * [`layer`] — defaults → `--config FILE` → `TOKENSCOPE_*` environment, merged and
//!   deserialized with the origin of every value; [`otel`] — the standard
//!   `OTEL_EXPORTER_OTLP_*` variables as a layer of `[tracing]` (below `TOKENSCOPE_*`).
//! * [`alerts`] — `[alerts]`; [`auth`] — `[admin]`, `[dashboard]` and their token checks.
//!
//! Precedence (lowest first): built-in defaults → `--config FILE` → environment → command-line
//! flags (applied by the binary). Unknown keys are rejected so a typo is an error, not a silent
//! default; errors name the key and where it came from (the file or the variable).
//!
//! Environment overrides: `TOKENSCOPE_<KEY>` sets a top-level key (`TOKENSCOPE_LISTEN`,
//! `TOKENSCOPE_STORE`, `TOKENSCOPE_MAX_BODY_BYTES`, …) and `TOKENSCOPE_<TABLE>__<KEY>` a key in a
//! table, at any depth (`TOKENSCOPE_METRICS__USER_BUCKETS=32`,
//! `TOKENSCOPE_ALERTS__THRESHOLDS__SUCCESS_RATIO_MIN=0.99`). A value is read as the type of the
//! key it sets: a string setting keeps `123456` as text. Variables whose first key names no
//! top-level setting (`TOKENSCOPE_LOG`, `TOKENSCOPE_CONFIG`, scripts' own) are not the
//! configuration's and are ignored; below a top-level setting, a key that names nothing is an
//! error. `TOKENSCOPE_UPSTREAM=URL` replaces the upstream list with one default upstream.
//!
//! Upstream credentials: `api_key_env` / `api_key_file`, `client_authorization` and
//! `[upstreams.headers]` on an `[[upstreams]]` entry ([`credentials`]), resolved when the
//! gateway starts, never logged.
//!
//! API keys: `[[api_keys]]` entries map a key to a tenant and business line. Give `key_sha256`
//! (hex SHA-256 of the key) to keep raw keys out of the file; a raw `key` is accepted and hashed
//! at load. Records only ever carry a short fingerprint (`api_key_id`), never a key.
#![deny(missing_docs)]

pub mod alerts;
pub mod auth;
pub mod credentials;
pub mod layer;
pub mod otel;

pub use alerts::{AlertSettings, AlertsSection};
pub use auth::{AdminSection, DashboardSection};
pub use credentials::{ClientAuthorization, SecretSource, UpstreamCredentials};
pub use tokenscope_core::engine::{Engine, EngineKind};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenscope_core::redact_url;
use tokenscope_core::time::BareNumber;

/// Errors while loading or validating the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("invalid configuration: {0}")]
    Parse(String),
    /// A value does not fit the schema (wrong type, or a key that names no setting).
    #[error("invalid configuration: {0}")]
    Value(layer::LayerError),
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl From<layer::LayerError> for ConfigError {
    fn from(e: layer::LayerError) -> Self {
        // Not a `source`: the message already carries the whole cause (printed once).
        ConfigError::Value(e)
    }
}

/// How a user becomes a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UserLabel {
    /// Hash users into `user_buckets` buckets.
    #[default]
    Hash,
    /// Keep the `user_top_k` heaviest users, the rest are `other`.
    TopK,
}

/// `[metrics]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// Distinct model label values before `other`.
    pub max_models: usize,
    /// Distinct request types before `other`.
    pub max_request_types: usize,
    /// `hash` or `top_k`.
    pub user_label: UserLabel,
    /// Buckets for `hash`.
    pub user_buckets: u32,
    /// K for `top_k`.
    pub user_top_k: usize,
    /// Distinct business lines (`llm_business_line_tokens_total`, `llm_cost_usd_total`)
    /// before `other`.
    pub max_business_lines: usize,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            max_models: 50,
            max_request_types: 20,
            user_label: UserLabel::Hash,
            user_buckets: 16,
            user_top_k: 10,
            max_business_lines: 50,
        }
    }
}

/// `[pipeline]`: the bounded queue between requests and the store.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineSection {
    /// Queue capacity in records.
    pub capacity: usize,
    /// Rows per batch write (a batch is written when full or after `flush_interval_ms`).
    pub batch_size: usize,
    /// Flush at least this often (ms).
    pub flush_interval_ms: u64,
    /// Batches waiting in memory for the store before new ones spill to the spool.
    pub handoff_batches: usize,
    /// Longest pause between two replay attempts while the store fails (ms).
    pub retry_backoff_max_ms: u64,
    /// While batches spill to the spool, how long a partial batch keeps filling (ms): fewer,
    /// larger spool entries replay faster.
    pub spill_interval_ms: u64,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            capacity: 65_536,
            batch_size: 8192,
            flush_interval_ms: 200,
            handoff_batches: 4,
            retry_backoff_max_ms: 5_000,
            spill_interval_ms: 1_000,
        }
    }
}

/// `[fleet]`: several gateways on one store. Every `refresh_interval_ms` the gateway reads
/// the fleet's numbers from the store (aggregated there): the usage of each budget's current
/// period (so the budget gauge and its alerts count every replica's requests) and the P99 per
/// tail-sampler key over the last `p99_window_s` seconds (so "slower than the P99 of its key"
/// is the fleet's P99). Alerts are claimed in the store before they are sent, so one incident
/// gives one notification, not one per replica. On by default with a ClickHouse store, off
/// with SQLite unless `refresh_interval_ms` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetSection {
    /// How often the fleet's numbers are read (ms); `0` = never; unset = 10 000 with a
    /// ClickHouse store, never with SQLite.
    pub refresh_interval_ms: Option<u64>,
    /// Window of the fleet P99 per sampler key, seconds.
    pub p99_window_s: u64,
    /// This gateway's name in the alert claims (default: host name and process id).
    pub replica_id: Option<String>,
    /// How long a replica waits after claiming an alert for the others' claims (ms).
    pub claim_settle_ms: u64,
    /// How long a claim holds: within it, the first claimant of an incident is the only one
    /// that notifies (s).
    pub claim_hold_s: u64,
}

impl Default for FleetSection {
    fn default() -> Self {
        Self {
            refresh_interval_ms: None,
            p99_window_s: 600,
            replica_id: None,
            claim_settle_ms: 2_000,
            claim_hold_s: 3_600,
        }
    }
}

/// `[spool]`: the on-disk buffer for batches the store cannot take now (slow, failing, down),
/// replayed oldest-first when it recovers and after a restart.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpoolSection {
    /// Spill to disk (default). Off: a batch that fails every retry is lost (counted).
    pub enabled: bool,
    /// Directory (default: `<store file>.spool` beside an embedded store,
    /// `./tokenscope-spool` for ClickHouse). One gateway per directory (it is locked).
    pub dir: Option<String>,
    /// Cap on unsent bytes; beyond it new batches are lost and counted as `spool_full`.
    pub max_bytes: u64,
    /// Segment file size.
    pub segment_bytes: u64,
    /// `fsync` every append and acknowledgement (survives power loss, not only a crash).
    pub fsync: bool,
}

impl Default for SpoolSection {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: None,
            max_bytes: 1 << 30,
            segment_bytes: 64 << 20,
            fsync: true,
        }
    }
}

/// A duration setting: a string with a unit (`"2s"`, `"750ms"`, `"1m"`, `"1h 30m"`; the
/// workspace's one parser, `tokenscope_core::time::parse_duration`) or an integer number of
/// milliseconds.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum DurationSetting {
    /// Milliseconds.
    Millis(u64),
    /// Human-readable, e.g. `2s`.
    Text(String),
}

impl DurationSetting {
    /// The duration, or why the value is not one.
    pub fn get(&self) -> Result<Duration, String> {
        match self {
            DurationSetting::Millis(ms) => Ok(Duration::from_millis(*ms)),
            DurationSetting::Text(t) => {
                tokenscope_core::time::parse_duration(t, BareNumber::Reject).map_err(|e| {
                    format!("{t:?} is not a duration ({e}); write e.g. \"2s\" or \"750ms\"")
                })
            }
        }
    }
}

/// `[tracing]`: one OpenTelemetry trace per request, tail-sampled, exported over OTLP.
/// Off unless `otlp_endpoint` (or `otlp_traces_endpoint`) is set. The standard
/// `OTEL_EXPORTER_OTLP_*` variables set these keys too ([`otel`]).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingSection {
    /// `http[s]://HOST:4318` (OTLP/HTTP; `/v1/traces` is appended unless the path ends with
    /// it) or `http[s]://HOST:4317` (OTLP/gRPC). `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub otlp_endpoint: Option<String>,
    /// The full OTLP/HTTP traces URL, used as is (no `/v1/traces` appended); when set it is used
    /// instead of `otlp_endpoint`. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`.
    pub otlp_traces_endpoint: Option<String>,
    /// `http` (also `http/protobuf`: protobuf over HTTP) or `grpc`.
    pub otlp_protocol: String,
    /// Fraction of the requests not kept for another reason that are kept anyway.
    pub sample_ratio: f64,
    /// Keep every request at least this slow (end to end).
    pub slow_threshold: Option<DurationSetting>,
    /// Keep requests above the running P99 of their model and input bucket.
    pub slow_above_p99: bool,
    /// Successful requests a (model, input bucket) needs before its P99 is used.
    pub p99_min_samples: u32,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Span budget of the export queue; beyond it spans are dropped and counted.
    pub queue_spans: usize,
    /// Spans per export request.
    pub batch_spans: usize,
    /// Longest wait to fill an export batch.
    pub batch_timeout: DurationSetting,
    /// Time allowed for one batch, retries included.
    pub export_timeout: DurationSetting,
    /// Extra export headers (gRPC metadata), e.g. `authorization`. Values are never logged.
    pub headers: std::collections::BTreeMap<String, String>,
    /// PEM CA bundle trusted for an `https://` endpoint, beside the system's roots.
    pub ca_file: Option<String>,
    /// PEM client certificate for a collector that asks for one (mutual TLS).
    pub client_cert: Option<String>,
    /// PEM key of `client_cert`.
    pub client_key: Option<String>,
}

impl std::fmt::Debug for TracingSection {
    /// Header values are secrets (API keys): only their names are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TracingSection")
            .field(
                "otlp_endpoint",
                &self.otlp_endpoint.as_deref().map(redact_url),
            )
            .field(
                "otlp_traces_endpoint",
                &self.otlp_traces_endpoint.as_deref().map(redact_url),
            )
            .field("otlp_protocol", &self.otlp_protocol)
            .field("sample_ratio", &self.sample_ratio)
            .field("slow_threshold", &self.slow_threshold)
            .field("slow_above_p99", &self.slow_above_p99)
            .field("p99_min_samples", &self.p99_min_samples)
            .field("service_name", &self.service_name)
            .field("queue_spans", &self.queue_spans)
            .field("batch_spans", &self.batch_spans)
            .field("batch_timeout", &self.batch_timeout)
            .field("export_timeout", &self.export_timeout)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .finish()
    }
}

impl Default for TracingSection {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            otlp_traces_endpoint: None,
            otlp_protocol: "http".into(),
            sample_ratio: 0.01,
            slow_threshold: None,
            slow_above_p99: true,
            p99_min_samples: 200,
            service_name: "tokenscope".into(),
            queue_spans: 16_384,
            batch_spans: 512,
            batch_timeout: DurationSetting::Millis(1000),
            export_timeout: DurationSetting::Millis(10_000),
            headers: std::collections::BTreeMap::new(),
            ca_file: None,
            client_cert: None,
            client_key: None,
        }
    }
}

/// Checks that a certificate and its key are given together (`what` names the section).
fn check_pair(what: &str, cert: Option<&str>, key: Option<&str>) -> Result<(), ConfigError> {
    let set = |v: Option<&str>| v.is_some_and(|v| !v.trim().is_empty());
    match (set(cert), set(key)) {
        (true, false) => Err(ConfigError::Invalid(format!(
            "{what}: client_cert is set but client_key is not (a client certificate needs its key)"
        ))),
        (false, true) => Err(ConfigError::Invalid(format!(
            "{what}: client_key is set but client_cert is not"
        ))),
        _ => Ok(()),
    }
}

/// Checks that `url` is an absolute `http://` or `https://` URL with a host.
fn check_http_url(what: &str, url: &str) -> Result<http::Uri, ConfigError> {
    let shown = redact_url(url);
    let uri: http::Uri = url
        .parse()
        .map_err(|e| ConfigError::Invalid(format!("{what} {shown:?}: {e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        Some("http" | "https") => Err(ConfigError::Invalid(format!("{what} {shown:?}: no host"))),
        Some(other) => Err(ConfigError::Invalid(format!(
            "{what} {shown:?}: the scheme {other:?} is not supported; use http:// or https://"
        ))),
        None => Err(ConfigError::Invalid(format!(
            "{what} {shown:?}: expected an absolute http:// or https:// URL"
        ))),
    }
}

impl TracingSection {
    /// Whether traces are exported.
    pub fn enabled(&self) -> bool {
        self.endpoint().is_some()
    }

    /// The endpoint traces are exported to and whether it is used as is (`true`:
    /// `otlp_traces_endpoint`) or as a base URL (`false`: `otlp_endpoint`, OTLP/HTTP appends
    /// `/v1/traces`).
    pub fn endpoint(&self) -> Option<(&str, bool)> {
        fn set(e: &Option<String>) -> Option<&str> {
            e.as_deref().map(str::trim).filter(|e| !e.is_empty())
        }
        set(&self.otlp_traces_endpoint)
            .map(|e| (e, true))
            .or_else(|| set(&self.otlp_endpoint).map(|e| (e, false)))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(format!("tracing: {m}")));
        let invalid = |m: String| ConfigError::Invalid(format!("tracing: {m}"));
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return bad(format!(
                "sample_ratio = {} must be within [0, 1]",
                self.sample_ratio
            ));
        }
        if let Some(t) = &self.slow_threshold {
            t.get()
                .map_err(|e| invalid(format!("slow_threshold: {e}")))?;
        }
        self.batch_timeout
            .get()
            .map_err(|e| invalid(format!("batch_timeout: {e}")))?;
        self.export_timeout
            .get()
            .map_err(|e| invalid(format!("export_timeout: {e}")))?;
        if self.queue_spans == 0 || self.batch_spans == 0 {
            return bad("queue_spans and batch_spans must be > 0".into());
        }
        match self.otlp_protocol.trim().to_ascii_lowercase().as_str() {
            "http" | "http/protobuf" | "grpc" => {}
            "http/json" => {
                return bad(
                    "otlp_protocol = \"http/json\" is not supported; use \"http/protobuf\" \
                     (or \"http\") or \"grpc\""
                        .into(),
                )
            }
            _ => {
                return bad(format!(
                    "otlp_protocol = {:?}: use \"http\" (http/protobuf) or \"grpc\"",
                    self.otlp_protocol
                ))
            }
        }
        for (key, ep) in [
            ("otlp_endpoint", &self.otlp_endpoint),
            ("otlp_traces_endpoint", &self.otlp_traces_endpoint),
        ] {
            if let Some(ep) = ep.as_deref().filter(|e| !e.trim().is_empty()) {
                check_http_url(&format!("tracing: {key}"), ep.trim())?;
            }
        }
        check_pair(
            "tracing",
            self.client_cert.as_deref(),
            self.client_key.as_deref(),
        )?;
        Ok(())
    }
}

/// One `[[upstreams]]` entry.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Name used in records and logs.
    pub name: String,
    /// Base URL, e.g. `http://127.0.0.1:8080` (a path prefix such as `/v1` is not added).
    /// Exactly one of `url` and `urls` is set.
    #[serde(default)]
    pub url: String,
    /// Several replicas of the same engine, e.g. `["http://a:8080", "http://b:8080"]`, instead
    /// of `url`: each request goes to the healthy replica with the fewest outstanding
    /// requests; a replica that refuses connections or times out is ejected for a while
    /// (`eject_ms`) and probed back (docs/operations.md, "Upstream replicas").
    #[serde(default)]
    pub urls: Vec<String>,
    /// Model patterns served here: exact names, or `prefix*`, or `*`.
    #[serde(default)]
    pub models: Vec<String>,
    /// Used when no pattern matches (the first upstream is the default when none says so).
    #[serde(default)]
    pub default: bool,
    /// The engine behind it (`auto`, `llamacpp`, `vllm`, `tgi`, `sglang`, `openai`).
    #[serde(default)]
    pub kind: EngineKind,
    /// vLLM: add `"include_metrics": true` to requests, for vLLM builds that gate the
    /// per-request `metrics` object per request as well as by `--enable-per-request-metrics`.
    /// vLLM 0.32 has no such field: the server flag alone fills `metrics`, and the field is
    /// ignored with a warning logged per request (checked on the real server: leave this off).
    #[serde(default)]
    pub request_metrics: bool,
    /// Engine metrics URL to scrape instead of `{url}/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// Scrape the engine's metrics this often (ms); 0 turns engine-state scraping off, and the
    /// `/v1/models` fetch of the model labels (`crate::models`) with it.
    #[serde(default = "default_scrape_interval_ms")]
    pub scrape_interval_ms: u64,
    /// An API key sent as `Authorization: Bearer <key>`, read from this environment variable
    /// at start-up ([`credentials`]).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The same, read from this file (contents trimmed).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// What happens to the client's credentials here: `replace` or `keep` (default: `replace`
    /// when credentials are configured, else `keep`; [`credentials`]).
    #[serde(default)]
    pub client_authorization: Option<credentials::ClientAuthorization>,
    /// Extra headers sent here: a literal value, `{ env = "VAR" }` or `{ file = "PATH" }`.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, credentials::SecretSource>,
    /// How long a replica is left out after it refused a connection (or the connect or the
    /// response head timed out), ms; each failed probe doubles it, up to `eject_max_ms`.
    #[serde(default = "default_eject_ms")]
    pub eject_ms: u64,
    /// The longest ejection, ms.
    #[serde(default = "default_eject_max_ms")]
    pub eject_max_ms: u64,
    /// `https://` upstreams: a PEM CA bundle trusted beside the system's roots (the requests,
    /// the pass-through, the metrics scrape and the `/v1/models` fetch of this upstream).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// `https://` upstreams asking for a client certificate (mutual TLS): its PEM chain.
    #[serde(default)]
    pub client_cert: Option<String>,
    /// The PEM key of `client_cert`.
    #[serde(default)]
    pub client_key: Option<String>,
}

fn default_scrape_interval_ms() -> u64 {
    2000
}

fn default_eject_ms() -> u64 {
    10_000
}

fn default_eject_max_ms() -> u64 {
    120_000
}

/// The name of a replica in records, metrics and logs: its URL's `host:port` (the scheme's
/// default port when none is given; never userinfo), or the URL's text with its userinfo
/// removed when it does not parse.
pub fn replica_name(url: &str) -> String {
    match url.parse::<http::Uri>() {
        Ok(uri) => match uri.host() {
            Some(host) => {
                let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
                    Some("https") => 443,
                    _ => 80,
                });
                format!("{host}:{port}")
            }
            None => redact_url(url),
        },
        Err(_) => redact_url(url),
    }
}

/// `[gpu]`: the resource layer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuSection {
    /// A DCGM exporter metrics URL (preferred when set).
    pub dcgm_url: Option<String>,
    /// Read NVML (loaded at run time) when no DCGM URL is set; absent library → feature off.
    pub nvml: bool,
    /// Read interval (ms).
    pub interval_ms: u64,
}

impl Default for GpuSection {
    fn default() -> Self {
        Self {
            dcgm_url: None,
            nvml: true,
            interval_ms: 2000,
        }
    }
}

impl UpstreamConfig {
    /// The URLs of the upstream's replicas: `urls`, or `url` alone.
    pub fn replica_urls(&self) -> &[String] {
        if self.urls.is_empty() {
            std::slice::from_ref(&self.url)
        } else {
            &self.urls
        }
    }

    /// The first ejection of a replica.
    pub fn eject(&self) -> Duration {
        Duration::from_millis(self.eject_ms)
    }

    /// The longest ejection of a replica (at least [`Self::eject`]).
    pub fn eject_max(&self) -> Duration {
        Duration::from_millis(self.eject_max_ms.max(self.eject_ms))
    }

    /// Checks `url` / `urls`: exactly one of them, every URL an `http://` or `https://` URL with a host,
    /// no replica twice, and no `metrics_url` beside several replicas.
    fn validate(&self) -> Result<(), ConfigError> {
        let name = &self.name;
        let bad = |m: String| Err(ConfigError::Invalid(format!("upstream {name:?}: {m}")));
        match (self.url.trim().is_empty(), self.urls.is_empty()) {
            (true, true) => return bad("set url (one engine) or urls (its replicas)".into()),
            (false, false) => return bad("set either url or urls, not both".into()),
            _ => {}
        }
        let mut seen = std::collections::HashSet::new();
        for url in self.replica_urls() {
            check_http_url(&format!("upstream {name:?} url"), url)?;
            if !seen.insert(replica_name(url)) {
                return bad(format!("replica {} is listed twice", replica_name(url)));
            }
        }
        if self.urls.len() > 1 && self.metrics_url.is_some() {
            return bad(
                "metrics_url names one endpoint: with several urls each replica is scraped \
                 at {replica}/metrics; remove metrics_url"
                    .into(),
            );
        }
        if self.eject_ms == 0 {
            return bad("eject_ms must be > 0".into());
        }
        Ok(())
    }

    /// Whether this upstream serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => p == model,
        })
    }
}

/// One `[[api_keys]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Raw key (hashed at load; prefer `key_sha256`).
    #[serde(default)]
    pub key: Option<String>,
    /// Hex SHA-256 of the key.
    #[serde(default)]
    pub key_sha256: Option<String>,
    /// Tenant for requests with this key.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Business line for requests with this key.
    #[serde(default)]
    pub business_line: Option<String>,
}

/// `[limits]`: what one client can hold of the gateway (docs/operations.md lists each limit,
/// its default and what a client sees when it hits it).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    /// Open client connections of the proxy listener at most; 0 = from the open-file limit
    /// (each proxied request also holds an upstream socket): `(nofile − 64 −
    /// admin_max_connections) / 2`. At the cap the connection reusable for longest (no request
    /// in flight: still sending headers, or idle keep-alive) is closed for the new one; when
    /// every connection has a request in flight the new one gets `503`.
    pub max_connections: usize,
    /// The same for the admin listener (`/metrics`, `/healthz`, dashboard, OTLP receiver).
    pub admin_max_connections: usize,
    /// Time for a request's headers, from the connection's start or the end of the previous
    /// response (so also the keep-alive idle timeout); beyond it the connection is closed
    /// (`408` if some of the head arrived).
    pub header_timeout_ms: u64,
    /// Time to read a measured request's body; beyond it `408` (and a `client_error` record).
    pub body_timeout_ms: u64,
    /// Longest a write to a client may make no progress (the client stopped reading); beyond
    /// it the connection is closed, the upstream request cancelled and the record says
    /// `client_write_timeout`. 0 = unlimited.
    pub client_write_timeout_ms: u64,
    /// Largest request head (request line + headers) in bytes; beyond it `431`.
    pub max_header_bytes: usize,
    /// Longest attribution value kept (user, tenant, business line, request type, model);
    /// longer values are cut at a character boundary and end in `…[truncated]`.
    pub max_attribution_bytes: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            max_connections: 0,
            admin_max_connections: 64,
            header_timeout_ms: 60_000,
            body_timeout_ms: 60_000,
            client_write_timeout_ms: 60_000,
            max_header_bytes: 64 * 1024,
            max_attribution_bytes: 256,
        }
    }
}

/// `[listen_tls]`: the proxy listener serves HTTPS (HTTP/1.1 and HTTP/2 by ALPN) instead of
/// plain HTTP. The files are read at start-up; a bad one refuses the start.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ListenTlsSection {
    /// PEM certificate chain of the listener (leaf first).
    pub cert_file: String,
    /// Its PEM private key.
    pub key_file: String,
    /// Require client certificates signed by a CA of this PEM file (mutual TLS).
    #[serde(default)]
    pub client_ca_file: Option<String>,
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// Proxy listener.
    pub listen: String,
    /// Serve the proxy listener over TLS (`[listen_tls]`); unset = plain HTTP.
    pub listen_tls: Option<ListenTlsSection>,
    /// Admin listener (`/metrics`, admin API). Localhost by default.
    pub admin_listen: String,
    /// Store: a SQLite file path (embedded, default `./tokenscope.db`; `sqlite://PATH` also
    /// accepted) or `clickhouse://[user:pass@]host:8123/database[?cluster=…]`.
    pub store: String,
    /// Largest accepted request body; larger → 413.
    pub max_body_bytes: usize,
    /// Time allowed for the upstream to connect.
    pub connect_timeout_ms: u64,
    /// Time allowed until the upstream's response headers; beyond → 504.
    pub upstream_timeout_ms: u64,
    /// Longest silence allowed between two body chunks of a response; beyond → `timeout`.
    pub stream_idle_timeout_ms: u64,
    /// Longest time an idle upstream connection is reused after its last response (measured
    /// and pass-through requests); older ones are closed and a new connection is opened. It
    /// must sit below the engine's own keep-alive timeout (llama.cpp, vLLM, SGLang: 5 s): a
    /// request written on a connection the engine is closing fails with a 502 and cannot be
    /// sent again. A shorter `Keep-Alive: timeout=T` from the engine is honoured on measured
    /// requests (reuse within `max(T − 1 s, T / 2)`). 0 = never reuse a connection.
    pub upstream_idle_timeout_ms: u64,
    /// How long shutdown waits for in-flight requests before closing them.
    pub shutdown_grace_ms: u64,
    /// Add `stream_options.include_usage` upstream for exact streamed token counts.
    pub inject_stream_usage: bool,
    /// Keep the prompt text in the store (off by default: only its hash is stored).
    pub store_prompts: bool,
    /// Largest non-streamed response kept in memory to read its usage.
    pub max_response_parse_bytes: usize,
    /// Largest single SSE event parsed.
    pub max_sse_event_bytes: usize,
    /// Recent records kept in memory for the admin API.
    pub recent_records: usize,
    /// Threads of the gateway's async runtime; 0 = one per core but one (at least one), which
    /// leaves a core to the store writer, the exporters and the processes sharing the machine
    /// (on 2 cores: one worker, no cross-worker wake-ups — docs/benchmarks.md).
    pub worker_threads: usize,
    /// Nice value of the runtime's threads (the request path), like nginx's `worker_priority`:
    /// -20 (most favoured) ..= 19; 0 = unchanged. A negative value needs `CAP_SYS_NICE` or a
    /// matching `RLIMIT_NICE` (systemd `Nice=` / `LimitNICE=`); without it the gateway warns
    /// once and runs at the inherited priority. The store's batcher and writer threads (the
    /// store and spool I/O) keep the inherited priority; the background tasks on the runtime
    /// (OTLP export, engine-state scrapes, alerts) share the workers'. On a host where the
    /// gateway shares few cores with busy processes (the engine's CPU side, a load generator),
    /// a woken worker otherwise waits for the CPU behind them: docs/benchmarks.md, "Fourth
    /// run".
    pub worker_priority: i32,
    /// Prometheus label options.
    pub metrics: MetricsSection,
    /// Store pipeline options.
    pub pipeline: PipelineSection,
    /// On-disk spool options.
    pub spool: SpoolSection,
    /// GPU state (NVML or a DCGM exporter).
    pub gpu: GpuSection,
    /// OpenTelemetry traces (off unless an OTLP endpoint is set).
    pub tracing: TracingSection,
    /// The gateway's own alerting (off unless `webhook_url` is set) and alert thresholds.
    pub alerts: AlertsSection,
    /// Upstream engines, routed by model.
    pub upstreams: Vec<UpstreamConfig>,
    /// Per-model tokenizers for the entry count (`kind = "hf" | "tiktoken" | "engine"`).
    pub tokenizers: Vec<tokenscope_tokenize::TokenizerConfig>,
    /// Relative disagreement between the entry count and the engine's usage above which it is
    /// counted in `llm_token_count_mismatch_total` (the record keeps both numbers).
    pub token_mismatch_tolerance: f64,
    /// API key → tenant / business line.
    pub api_keys: Vec<ApiKeyConfig>,
    /// Prices per model (`[[prices]]`): token prices, or a GPU cost per hour.
    pub prices: Vec<tokenscope_analysis::ModelPrice>,
    /// Budgets per business line (`[[budgets]]`): daily or monthly, explicit or automatic.
    pub budgets: Vec<tokenscope_analysis::budget::BudgetConfig>,
    /// The built-in dashboard (`[dashboard]`; its `token` is the admin token).
    pub dashboard: DashboardSection,
    /// Connection caps, client timeouts and size limits (`[limits]`).
    pub limits: LimitsSection,
    /// Access to the admin listener and limits of its write routes (`[admin]`).
    pub admin: AdminSection,
    /// Several gateways on one store (`[fleet]`).
    pub fleet: FleetSection,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:4000".into(),
            listen_tls: None,
            admin_listen: "127.0.0.1:9464".into(),
            store: "./tokenscope.db".into(),
            max_body_bytes: 10 * 1024 * 1024,
            connect_timeout_ms: 5_000,
            upstream_timeout_ms: 600_000,
            stream_idle_timeout_ms: 300_000,
            upstream_idle_timeout_ms: 4_000,
            shutdown_grace_ms: 30_000,
            inject_stream_usage: true,
            store_prompts: false,
            max_response_parse_bytes: 16 * 1024 * 1024,
            max_sse_event_bytes: 4 * 1024 * 1024,
            recent_records: 1000,
            worker_threads: 0,
            worker_priority: 0,
            metrics: MetricsSection::default(),
            pipeline: PipelineSection::default(),
            spool: SpoolSection::default(),
            gpu: GpuSection::default(),
            tracing: TracingSection::default(),
            alerts: AlertsSection::default(),
            upstreams: Vec::new(),
            tokenizers: Vec::new(),
            token_mismatch_tolerance: 0.02,
            api_keys: Vec::new(),
            prices: Vec::new(),
            budgets: Vec::new(),
            dashboard: DashboardSection::default(),
            limits: LimitsSection::default(),
            admin: AdminSection::default(),
            fleet: FleetSection::default(),
        }
    }
}

impl GatewayConfig {
    /// The runtime's worker threads: `worker_threads`, or for 0 the number of cores minus one
    /// (at least one).
    pub fn runtime_workers(&self) -> usize {
        if self.worker_threads > 0 {
            return self.worker_threads;
        }
        std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .saturating_sub(1)
            .max(1)
    }

    /// Loads `file` (if any), applies the process environment, and validates.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// Like [`GatewayConfig::load`] with an explicit environment (for tests).
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut layers = layer::Layers::default();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_owned(),
                source,
            })?;
            let doc = text
                .parse::<toml::Table>()
                .map_err(|e| ConfigError::Parse(format!("{}: {e}", path.display())))?;
            layers = layers.file(path, doc);
        }
        let mut upstream_env = None;
        let env: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, v)| {
                if k == "TOKENSCOPE_UPSTREAM" {
                    upstream_env = Some(v.clone());
                    return false;
                }
                true
            })
            .collect();
        // The standard OTLP exporter variables, below `TOKENSCOPE_*` (module `otel`).
        let otel = otel::settings(&env).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        layers = layers.otel(otel).env(env, Self::keys());
        let mut cfg: GatewayConfig = layers.extract()?;
        if let Some(url) = upstream_env {
            cfg.set_single_upstream(&url);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The top-level keys, read from the schema: the `TOKENSCOPE_<KEY>` variables the
    /// configuration owns.
    pub fn keys() -> &'static [&'static str] {
        layer::top_level_keys::<GatewayConfig>()
    }

    /// Replaces the upstream list with one default upstream at `url`.
    pub fn set_single_upstream(&mut self, url: &str) {
        self.upstreams = vec![UpstreamConfig {
            name: "default".into(),
            url: url.trim_end_matches('/').to_owned(),
            urls: Vec::new(),
            models: vec!["*".into()],
            default: true,
            kind: EngineKind::Auto,
            request_metrics: false,
            metrics_url: None,
            scrape_interval_ms: default_scrape_interval_ms(),
            api_key_env: None,
            api_key_file: None,
            client_authorization: None,
            headers: std::collections::BTreeMap::new(),
            eject_ms: default_eject_ms(),
            eject_max_ms: default_eject_max_ms(),
            ca_file: None,
            client_cert: None,
            client_key: None,
        }];
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for b in &self.budgets {
            b.validate()
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        for (what, addr) in [
            ("listen", &self.listen),
            ("admin_listen", &self.admin_listen),
        ] {
            addr.parse::<SocketAddr>()
                .map_err(|e| ConfigError::Invalid(format!("{what} = {addr:?}: {e}")))?;
        }
        if !(-20..=19).contains(&self.worker_priority) {
            return Err(ConfigError::Invalid(format!(
                "worker_priority = {}: must be a nice value, -20 ..= 19",
                self.worker_priority
            )));
        }
        let l = &self.limits;
        if l.admin_max_connections == 0
            || l.header_timeout_ms == 0
            || l.body_timeout_ms == 0
            || l.max_header_bytes < 1024
            || l.max_attribution_bytes < 16
        {
            return Err(ConfigError::Invalid(
                "limits: admin_max_connections, header_timeout_ms and body_timeout_ms must be > 0, \
                 max_header_bytes ≥ 1024, max_attribution_bytes ≥ 16"
                    .into(),
            ));
        }
        if self.max_body_bytes == 0 || self.pipeline.capacity == 0 || self.pipeline.batch_size == 0
        {
            return Err(ConfigError::Invalid(
                "max_body_bytes, pipeline.capacity and pipeline.batch_size must be > 0".into(),
            ));
        }
        for u in &self.upstreams {
            u.validate()?;
            credentials::validate(u).map_err(ConfigError::Invalid)?;
            let what = format!("upstream {:?}", u.name);
            check_pair(&what, u.client_cert.as_deref(), u.client_key.as_deref())?;
        }
        self.tracing.validate()?;
        self.alerts.validate()?;
        auth::validate(self).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        for k in &self.api_keys {
            if k.key.is_none() && k.key_sha256.is_none() {
                return Err(ConfigError::Invalid(
                    "each [[api_keys]] entry needs key or key_sha256".into(),
                ));
            }
        }
        Ok(())
    }

    /// The API-key map, keyed by hex SHA-256 of the key.
    pub fn api_key_map(&self) -> HashMap<String, ApiKeyConfig> {
        self.api_keys
            .iter()
            .filter_map(|k| {
                let h = match (&k.key_sha256, &k.key) {
                    (Some(h), _) => h.to_ascii_lowercase(),
                    (None, Some(raw)) => sha256_hex(raw),
                    (None, None) => return None,
                };
                Some((h, k.clone()))
            })
            .collect()
    }

    /// Connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// Header timeout.
    pub fn upstream_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream_timeout_ms)
    }
    /// Idle timeout between body chunks.
    pub fn stream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.stream_idle_timeout_ms)
    }
    /// How long an idle upstream connection may be reused; zero = never.
    pub fn upstream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream_idle_timeout_ms)
    }
}

/// Hex SHA-256 of a string.
pub fn sha256_hex(s: &str) -> String {
    tokenscope_core::prompt::hex(&Sha256::digest(s.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn file_then_env() {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            r#"
listen = "127.0.0.1:5000"
store_prompts = true
[metrics]
user_buckets = 8
[[upstreams]]
name = "llama"
url = "http://127.0.0.1:8080"
models = ["gemma*"]
[[upstreams]]
name = "vllm"
url = "http://127.0.0.1:8000"
default = true
[[api_keys]]
key = "sk-secret"
tenant = "search"
"#
        )
        .expect("write");
        let env = vec![
            (
                "TOKENSCOPE_LISTEN".to_string(),
                "127.0.0.1:6000".to_string(),
            ),
            ("TOKENSCOPE_METRICS__USER_BUCKETS".into(), "32".into()),
            ("OTHER".into(), "x".into()),
        ];
        let cfg = GatewayConfig::load_with_env(Some(f.path()), env).expect("valid");
        assert_eq!(cfg.listen, "127.0.0.1:6000");
        assert!(cfg.store_prompts);
        assert_eq!(cfg.metrics.user_buckets, 32);
        assert_eq!(cfg.upstreams.len(), 2);
        assert!(cfg.upstreams[0].serves("gemma-3-270m"));
        assert!(!cfg.upstreams[0].serves("llama"));
        let keys = cfg.api_key_map();
        assert_eq!(
            keys.get(&sha256_hex("sk-secret"))
                .and_then(|k| k.tenant.clone()),
            Some("search".into())
        );
    }

    #[test]
    fn upstream_idle_timeout_default_file_and_env() {
        let cfg = GatewayConfig::load_with_env(None, Vec::new()).expect("defaults");
        // Below the 5 s keep-alive of llama.cpp, vLLM and SGLang.
        assert_eq!(cfg.upstream_idle_timeout(), Duration::from_millis(4_000));
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(f, "upstream_idle_timeout_ms = 1500").expect("write");
        let cfg = GatewayConfig::load_with_env(Some(f.path()), Vec::new()).expect("file");
        assert_eq!(cfg.upstream_idle_timeout(), Duration::from_millis(1_500));
        let env = vec![(
            "TOKENSCOPE_UPSTREAM_IDLE_TIMEOUT_MS".to_string(),
            "0".to_string(),
        )];
        let cfg = GatewayConfig::load_with_env(Some(f.path()), env).expect("env");
        assert_eq!(cfg.upstream_idle_timeout(), Duration::ZERO);
    }

    #[test]
    fn rejects_unknown_keys_and_bad_values() {
        let env = vec![("TOKENSCOPE_METRICS__NOPE".to_string(), "1".to_string())];
        assert!(GatewayConfig::load_with_env(None, env).is_err());
        let env = vec![("TOKENSCOPE_CACHE".to_string(), "/tmp".to_string())];
        assert!(
            GatewayConfig::load_with_env(None, env).is_ok(),
            "script variables are ignored"
        );
        let env = vec![("TOKENSCOPE_LISTEN".to_string(), "nope".to_string())];
        assert!(GatewayConfig::load_with_env(None, env).is_err());
        let env = vec![("TOKENSCOPE_UPSTREAM".to_string(), "ftp://x".to_string())];
        let err = GatewayConfig::load_with_env(None, env).expect_err("ftp");
        assert!(err.to_string().contains("use http:// or https://"), "{err}");
        let env = vec![("TOKENSCOPE_UPSTREAM".to_string(), "https://x".to_string())];
        assert!(GatewayConfig::load_with_env(None, env).is_ok(), "https");
        for (v, ok) in [
            ("-20", true),
            ("19", true),
            ("-10", true),
            ("-21", false),
            ("20", false),
        ] {
            let env = vec![("TOKENSCOPE_WORKER_PRIORITY".to_string(), v.to_string())];
            let got = GatewayConfig::load_with_env(None, env);
            assert_eq!(got.is_ok(), ok, "worker_priority = {v}");
            if ok {
                assert_eq!(got.expect("valid").worker_priority.to_string(), v);
            }
        }
    }

    #[test]
    fn example_config_parses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/config.example.toml"
        );
        let cfg = GatewayConfig::load_with_env(Some(Path::new(path)), Vec::new()).expect("valid");
        assert_eq!(cfg.upstreams.len(), 2);
        assert_eq!(cfg.api_key_map().len(), 1);
        assert_eq!((cfg.prices.len(), cfg.budgets.len()), (2, 2));
        assert_eq!(cfg.listen, GatewayConfig::default().listen);
    }

    #[test]
    fn tracing_settings_from_env_and_validation() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let cfg = GatewayConfig::load_with_env(
            None,
            env(&[
                ("TOKENSCOPE_TRACING__OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("TOKENSCOPE_TRACING__OTLP_PROTOCOL", "grpc"),
                ("TOKENSCOPE_TRACING__SAMPLE_RATIO", "0.25"),
                ("TOKENSCOPE_TRACING__SLOW_THRESHOLD", "750ms"),
                ("TOKENSCOPE_TRACING__EXPORT_TIMEOUT", "2500"),
            ]),
        )
        .expect("valid");
        assert!(cfg.tracing.enabled());
        assert_eq!(cfg.tracing.sample_ratio, 0.25);
        assert_eq!(
            cfg.tracing
                .slow_threshold
                .as_ref()
                .map(DurationSetting::get),
            Some(Ok(Duration::from_millis(750)))
        );
        assert_eq!(
            cfg.tracing.export_timeout.get(),
            Ok(Duration::from_millis(2500)),
            "an integer is milliseconds"
        );
        assert!(!GatewayConfig::default().tracing.enabled());
        for bad in [
            ("TOKENSCOPE_TRACING__SAMPLE_RATIO", "1.5"),
            ("TOKENSCOPE_TRACING__SLOW_THRESHOLD", "soon"),
            ("TOKENSCOPE_TRACING__OTLP_PROTOCOL", "thrift"),
            ("TOKENSCOPE_TRACING__OTLP_PROTOCOL", "http/json"),
            ("TOKENSCOPE_TRACING__OTLP_ENDPOINT", "unix:///run/otel.sock"),
            ("TOKENSCOPE_TRACING__OTLP_TRACES_ENDPOINT", "collector:4318"),
            ("TOKENSCOPE_TRACING__CLIENT_CERT", "/c.pem"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "novalue"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("TOKENSCOPE_TRACING__QUEUE_SPANS", "0"),
        ] {
            assert!(
                GatewayConfig::load_with_env(None, env(&[bad])).is_err(),
                "{bad:?} must be refused"
            );
        }
    }

    #[test]
    fn otel_exporter_variables_are_a_layer_below_tokenscope_ones() {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            "[tracing]\notlp_endpoint = \"http://file:4318\"\nexport_timeout = \"3s\"\n\
             [tracing.headers]\nx-team = \"infra\"\nauthorization = \"file\""
        )
        .expect("write");
        let cfg = GatewayConfig::load_with_env(
            Some(f.path()),
            vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "authorization=Bearer%20env,x-a=1",
                ),
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/otel/ca.pem"),
                ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/etc/otel/c.pem"),
                ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/otel/k.pem"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
                ("TOKENSCOPE_TRACING__HEADERS__X_A", "2"),
            ]),
        )
        .expect("valid");
        let t = &cfg.tracing;
        // The environment wins over the file; the traces-specific variable over the generic.
        assert_eq!(t.endpoint(), Some(("https://collector:4318", false)));
        assert_eq!(t.otlp_protocol, "grpc");
        assert_eq!(t.export_timeout.get(), Ok(Duration::from_millis(2500)));
        assert_eq!(t.ca_file.as_deref(), Some("/etc/otel/ca.pem"));
        assert_eq!(t.client_cert.as_deref(), Some("/etc/otel/c.pem"));
        assert_eq!(t.client_key.as_deref(), Some("/etc/otel/k.pem"));
        let h: Vec<(&str, &str)> = t
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // Merged by name; `TOKENSCOPE_TRACING__HEADERS__X_A` sets `x_a` (the variable's own
        // spelling), beside the OTLP list's `x-a`.
        assert_eq!(
            h,
            [
                ("authorization", "Bearer env"),
                ("x-a", "1"),
                ("x-team", "infra"),
                ("x_a", "2")
            ]
        );
        // Header values never appear in the section's Debug output.
        let dbg = format!("{t:?}");
        assert!(
            !dbg.contains("Bearer") && dbg.contains("authorization"),
            "{dbg}"
        );
        // The traces endpoint is used as is, and wins over the generic one.
        let cfg = GatewayConfig::load_with_env(
            None,
            vars(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4318"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "https://b/custom/traces",
                ),
            ]),
        )
        .expect("valid");
        assert_eq!(
            cfg.tracing.endpoint(),
            Some(("https://b/custom/traces", true))
        );
        // An error names the variable, never a header value.
        let err = GatewayConfig::load_with_env(
            None,
            vars(&[("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "ok=1,secretvalue")]),
        )
        .expect_err("malformed")
        .to_string();
        assert!(
            err.contains("OTEL_EXPORTER_OTLP_TRACES_HEADERS") && !err.contains("secretvalue"),
            "{err}"
        );
        let err =
            GatewayConfig::load_with_env(None, vars(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")]))
                .expect_err("not a timeout")
                .to_string();
        assert!(err.contains("OTEL_EXPORTER_OTLP_TIMEOUT"), "{err}");
    }

    #[test]
    fn listen_tls_from_env() {
        let cfg = GatewayConfig::load_with_env(
            None,
            vars(&[
                ("TOKENSCOPE_LISTEN_TLS__CERT_FILE", "/c.pem"),
                ("TOKENSCOPE_LISTEN_TLS__KEY_FILE", "/k.pem"),
            ]),
        )
        .expect("valid");
        assert_eq!(
            cfg.listen_tls,
            Some(ListenTlsSection {
                cert_file: "/c.pem".into(),
                key_file: "/k.pem".into(),
                client_ca_file: None,
            })
        );
        assert!(GatewayConfig::default().listen_tls.is_none());
        let err = GatewayConfig::load_with_env(
            None,
            vars(&[("TOKENSCOPE_LISTEN_TLS__CERT_FILE", "/c.pem")]),
        )
        .expect_err("no key");
        assert!(err.to_string().contains("key_file"), "{err}");
    }

    #[test]
    fn upstream_tls_keys() {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            "[[upstreams]]\nname = \"a\"\nurl = \"https://engine:8443\"\nca_file = \"/ca.pem\"\n\
             client_cert = \"/c.pem\"\nclient_key = \"/k.pem\""
        )
        .expect("write");
        let cfg = GatewayConfig::load_with_env(Some(f.path()), Vec::new()).expect("valid");
        let u = &cfg.upstreams[0];
        assert_eq!(u.ca_file.as_deref(), Some("/ca.pem"));
        assert_eq!(
            (u.client_cert.as_deref(), u.client_key.as_deref()),
            (Some("/c.pem"), Some("/k.pem"))
        );
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            "[[upstreams]]\nname = \"a\"\nurl = \"https://engine:8443\"\nclient_cert = \"/c.pem\""
        )
        .expect("write");
        let err = GatewayConfig::load_with_env(Some(f.path()), Vec::new())
            .expect_err("half a pair")
            .to_string();
        assert!(
            err.contains("upstream \"a\"") && err.contains("client_key is not"),
            "{err}"
        );
    }

    #[test]
    fn upstream_env() {
        let env = vec![(
            "TOKENSCOPE_UPSTREAM".to_string(),
            "http://127.0.0.1:1/".to_string(),
        )];
        let cfg = GatewayConfig::load_with_env(None, env).expect("valid");
        assert_eq!(cfg.upstreams[0].url, "http://127.0.0.1:1");
        assert!(cfg.upstreams[0].serves("anything"));
    }

    #[test]
    fn upstream_replicas() {
        let load = |toml: &str| {
            let mut f = tempfile::NamedTempFile::new().expect("tmp");
            writeln!(f, "{toml}").expect("write");
            GatewayConfig::load_with_env(Some(f.path()), Vec::new())
        };
        let cfg = load(
            "[[upstreams]]\nname = \"pool\"\nurls = [\"http://a:8080\", \"http://u:p@b\"]\n\
             eject_ms = 500\neject_max_ms = 100",
        )
        .expect("valid");
        let u = &cfg.upstreams[0];
        assert_eq!(u.replica_urls(), ["http://a:8080", "http://u:p@b"]);
        assert_eq!(u.eject(), Duration::from_millis(500));
        assert_eq!(
            u.eject_max(),
            Duration::from_millis(500),
            "never below eject_ms"
        );
        let one = load("[[upstreams]]\nname = \"one\"\nurl = \"http://a:8080\"").expect("valid");
        assert_eq!(one.upstreams[0].replica_urls(), ["http://a:8080"]);
        assert_eq!(one.upstreams[0].eject(), Duration::from_secs(10));
        assert_eq!(one.upstreams[0].eject_max(), Duration::from_secs(120));
        for (bad, says) in [
            ("name = \"x\"", "set url (one engine) or urls"),
            ("name = \"x\"\nurls = []", "set url (one engine) or urls"),
            (
                "name = \"x\"\nurl = \"http://a:1\"\nurls = [\"http://b:1\"]",
                "not both",
            ),
            (
                "name = \"x\"\nurls = [\"http://a:1\", \"http://a:1/v1\"]",
                "replica a:1 is listed twice",
            ),
            (
                "name = \"x\"\nurls = [\"http://a\", \"http://a:80\"]",
                "replica a:80 is listed twice",
            ),
            ("name = \"x\"\nurls = [\"ftp://k:s@a:1\"]", "not supported"),
            (
                "name = \"x\"\nurls = [\"http://a:1\", \"http://b:1\"]\nmetrics_url = \"http://m/metrics\"",
                "metrics_url",
            ),
            ("name = \"x\"\nurls = [\"http://a:1\"]\neject_ms = 0", "eject_ms"),
        ] {
            let err = load(&format!("[[upstreams]]\n{bad}"))
                .expect_err(bad)
                .to_string();
            assert!(err.contains(says), "{bad}: {err}");
            assert!(!err.contains("k:s@"), "credentials echoed: {err}");
        }
        // One replica may keep its own metrics URL.
        load("[[upstreams]]\nname = \"x\"\nurls = [\"http://a:1\"]\nmetrics_url = \"http://m/metrics\"")
            .expect("one replica, one metrics URL");
        assert_eq!(replica_name("http://u:p@engine:8000/v1"), "engine:8000");
        assert_eq!(replica_name("http://engine"), "engine:80");
        assert_eq!(replica_name("http://[::1]:9"), "[::1]:9");
    }

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn env_values_take_the_type_of_their_key() {
        let cfg = GatewayConfig::load_with_env(
            None,
            vars(&[
                ("TOKENSCOPE_DASHBOARD__TOKEN", "123456"),
                ("TOKENSCOPE_ADMIN__INGEST_TOKEN", "1.50"),
                ("TOKENSCOPE_SPOOL__DIR", "2024"),
                ("TOKENSCOPE_TRACING__SERVICE_NAME", "true"),
                ("TOKENSCOPE_STORE", "42"),
                ("TOKENSCOPE_MAX_BODY_BYTES", "2048"),
                ("TOKENSCOPE_TOKEN_MISMATCH_TOLERANCE", "0.5"),
                ("TOKENSCOPE_SPOOL__FSYNC", "false"),
                ("TOKENSCOPE_METRICS__USER_LABEL", "top_k"),
            ]),
        )
        .expect("valid");
        assert_eq!(cfg.dashboard.token.as_deref(), Some("123456"));
        assert_eq!(cfg.admin.ingest_token.as_deref(), Some("1.50"));
        assert_eq!(cfg.spool.dir.as_deref(), Some("2024"));
        assert_eq!(cfg.tracing.service_name, "true");
        assert_eq!(cfg.store, "42");
        assert_eq!(cfg.max_body_bytes, 2048);
        assert_eq!(cfg.token_mismatch_tolerance, 0.5);
        assert!(!cfg.spool.fsync);
        assert_eq!(cfg.metrics.user_label, UserLabel::TopK);
    }

    #[test]
    fn env_reaches_nested_tables_at_any_depth() {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            "[alerts.thresholds]\nttft_p99_seconds = 3.0\n[tracing.headers]\nx-team = \"infra\""
        )
        .expect("write");
        let cfg = GatewayConfig::load_with_env(
            Some(f.path()),
            vars(&[
                ("TOKENSCOPE_ALERTS__THRESHOLDS__SUCCESS_RATIO_MIN", "0.9"),
                ("TOKENSCOPE_LIMITS__MAX_CONNECTIONS", "100"),
                ("TOKENSCOPE_TRACING__HEADERS__AUTHORIZATION", "Bearer 123"),
                (
                    "TOKENSCOPE_UPSTREAMS",
                    r#"[{ name = "a", url = "http://127.0.0.1:1" }]"#,
                ),
            ]),
        )
        .expect("valid");
        // The file's key beside the environment's in the same table: tables merge.
        assert_eq!(cfg.alerts.thresholds.ttft_p99_seconds, 3.0);
        assert_eq!(cfg.alerts.thresholds.success_ratio_min, 0.9);
        assert_eq!(cfg.limits.max_connections, 100);
        assert_eq!(
            cfg.tracing.headers.get("authorization").map(String::as_str),
            Some("Bearer 123")
        );
        assert_eq!(
            cfg.tracing.headers.get("x-team").map(String::as_str),
            Some("infra")
        );
        assert_eq!(cfg.upstreams.len(), 1);
        assert_eq!(cfg.upstreams[0].name, "a");
    }

    #[test]
    fn env_keys_come_from_the_schema() {
        let keys = GatewayConfig::keys();
        for k in [
            "listen",
            "store",
            "worker_priority",
            "metrics",
            "limits",
            "alerts",
            "admin",
            "dashboard",
            "upstreams",
            "budgets",
        ] {
            assert!(keys.contains(&k), "{k} missing from {keys:?}");
        }
        // Every top-level key is the configuration's: a key below it that names nothing is an
        // error naming the variable.
        for k in keys {
            let var = format!("TOKENSCOPE_{}__NO_SUCH_KEY", k.to_ascii_uppercase());
            let err = GatewayConfig::load_with_env(None, vec![(var.clone(), "1".into())])
                .expect_err("unknown nested key");
            assert!(err.to_string().contains(&var), "{k}: {err}");
        }
        // Variables that name no top-level key belong to scripts and the command line.
        let cfg = GatewayConfig::load_with_env(
            None,
            vars(&[
                ("TOKENSCOPE_LOG", "debug"),
                ("TOKENSCOPE_CONFIG", "/nope.toml"),
                ("TOKENSCOPE_REQUIRE_ENGINE", "1"),
            ]),
        );
        assert!(cfg.is_ok(), "{cfg:?}");
    }

    #[test]
    fn errors_name_the_key_and_its_source() {
        let err = GatewayConfig::load_with_env(
            None,
            vars(&[("TOKENSCOPE_METRICS__USER_BUCKETS", "many")]),
        )
        .expect_err("not a number")
        .to_string();
        assert!(err.contains("`metrics.user_buckets`"), "{err}");
        assert!(
            err.contains("environment variable TOKENSCOPE_METRICS__USER_BUCKETS"),
            "{err}"
        );
        let err = GatewayConfig::load_with_env(None, vars(&[("TOKENSCOPE_STORE_PROMPTS", "yes")]))
            .expect_err("not a boolean")
            .to_string();
        assert!(
            err.contains("`store_prompts`") && err.contains("TOKENSCOPE_STORE_PROMPTS"),
            "{err}"
        );
        let err = GatewayConfig::load_with_env(
            None,
            vars(&[("TOKENSCOPE_ALERTS__THRESHOLDS__NOPE", "1")]),
        )
        .expect_err("unknown key")
        .to_string();
        assert!(err.contains("`alerts.thresholds.nope`"), "{err}");

        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(f, "[metrics]\nuser_buckets = \"x\"").expect("write");
        let err = GatewayConfig::load_with_env(Some(f.path()), Vec::new())
            .expect_err("wrong type")
            .to_string();
        assert!(err.contains("`metrics.user_buckets`"), "{err}");
        assert!(
            err.contains(&format!("file {}", f.path().display())),
            "{err}"
        );
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(f, "[limits]\nnope = 1").expect("write");
        let err = GatewayConfig::load_with_env(Some(f.path()), Vec::new())
            .expect_err("unknown key")
            .to_string();
        assert!(
            err.contains("`limits.nope`") && err.contains("unknown field"),
            "{err}"
        );
    }

    #[test]
    fn precedence_defaults_file_env() {
        let default = GatewayConfig::default();
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(
            f,
            "max_body_bytes = 100\nlisten = \"127.0.0.1:5001\"\n[pipeline]\nbatch_size = 7"
        )
        .expect("write");
        let env = vars(&[
            ("TOKENSCOPE_MAX_BODY_BYTES", "200"),
            ("TOKENSCOPE_PIPELINE__CAPACITY", "99"),
        ]);
        let none = GatewayConfig::load_with_env(None, Vec::new()).expect("defaults");
        assert_eq!(none.max_body_bytes, default.max_body_bytes);
        let file = GatewayConfig::load_with_env(Some(f.path()), Vec::new()).expect("file");
        assert_eq!(file.max_body_bytes, 100);
        assert_eq!(file.pipeline.capacity, default.pipeline.capacity);
        let both = GatewayConfig::load_with_env(Some(f.path()), env).expect("file + env");
        assert_eq!(
            both.max_body_bytes, 200,
            "the environment wins over the file"
        );
        assert_eq!(
            both.listen, "127.0.0.1:5001",
            "the file wins over the defaults"
        );
        assert_eq!((both.pipeline.batch_size, both.pipeline.capacity), (7, 99));
        assert_eq!(
            both.pipeline.flush_interval_ms,
            default.pipeline.flush_interval_ms
        );
    }
}
