//! Engine state: scrape each upstream's Prometheus endpoint and normalise what the engine
//! says about its load into one shape.
//!
//! | signal | vLLM | SGLang | llama.cpp (`--metrics`) | TGI |
//! |---|---|---|---|---|
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` | `llamacpp:requests_processing` | `tgi_batch_current_size` |
//! | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `llamacpp:requests_deferred` | `tgi_queue_size` |
//! | KV-cache usage (0–1) | `vllm:kv_cache_usage_perc`, else the pre-0.10 `vllm:gpu_cache_usage_perc` (both documented "1 means 100 percent usage") | `sglang:token_usage` | `llamacpp:kv_cache_usage_ratio` (older builds only) | — |
//! | prefix-cache hits / queries | `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (else the deprecated `vllm:gpu_prefix_cache_*`) | `sglang:cached_tokens_total` / `sglang:prompt_tokens_total`; recent ratio from the `sglang:cache_hit_rate` gauge | `llamacpp:prompt_tokens_cached_total` / (`…cached_total` + `llamacpp:prompt_tokens_total`): llama.cpp's `prompt_tokens_total` *excludes* cached tokens | — |
//!
//! Invariants:
//! * **Aggregation over label sets.** Counts (running, waiting, counters) are summed over the
//!   distinct series of a name (several models or data-parallel engines behind one URL);
//!   ratios (KV usage, SGLang's hit-rate gauge) are averaged over them. Series that differ only
//!   in `tp_rank` / `pp_rank` / `moe_ep_rank` are replicas of one scheduler and count once (the
//!   lowest rank); when a name has series broken down by `priority` or `dp_rank` *and* series
//!   without that label (SGLang's aggregates), only the aggregates count. Non-finite values are
//!   ignored.
//! * **Kind.** A configured kind reads only that engine's names; `auto` picks the engine whose
//!   prefix (`vllm:`, `sglang:`, `llamacpp:`, `tgi_`) has the most samples. An exposition with
//!   none of the chosen engine's samples is an error (state unknown), never zeros. Once the
//!   engine is identified, a missing running/waiting gauge reads as 0 (engines create some
//!   series lazily, TGI on its first request).
//! * **Prefix-cache hit ratio.** `prefix_cache_hit_ratio` is the ratio over the most recent
//!   scrape window whose query counter moved (SGLang: its own recent-batch gauge); before any
//!   such window it is the cumulative ratio since the engine started.
//!   `prefix_cache_hit_ratio_cumulative` is hits / queries since start. A counter that goes
//!   down (engine restart) starts a new window from zero. All ratios are clamped to 0–1.
//! * **Unknown.** A failed scrape (unreachable, non-2xx, timeout, no engine metrics) clears the
//!   snapshot to `None`; the scraper keeps retrying on its interval. The first failure after
//!   start-up or after a success logs one `warn` for the upstream; repeats log at `debug`; a
//!   recovery logs one `info`.
//! * **Request path.** [`EngineStateHandle::snapshot`] is lock-free (see `cell.rs`) and
//!   allocation-free.

use crate::cell::StateCell;
use crate::exposition::{self, Exposition, Sample};
use crate::fetch::{self, FetchError};
use crate::{ScrapeConfig, TargetError};
use http::Uri;
use std::sync::{Arc, Weak};
use std::time::Duration;
pub use tokenscope_core::engine::{Engine, EngineKind, UnknownKind};
use tokio::time::MissedTickBehavior;

/// The metric names of `kind`.
fn spec(kind: Engine) -> &'static Spec {
    match kind {
        Engine::Vllm => &VLLM,
        Engine::Sglang => &SGLANG,
        Engine::LlamaCpp => &LLAMACPP,
        Engine::Tgi => &TGI,
    }
}

/// Where the metric names of one engine live.
#[derive(Debug)]
struct Spec {
    kind: Engine,
    prefix: &'static str,
    running: &'static str,
    waiting: &'static str,
    /// KV-cache usage gauges (0–1), first present wins.
    kv: &'static [&'static str],
    /// (hits, queries) counter pairs, first pair with both present wins.
    prefix_counters: &'static [(&'static str, &'static str)],
    /// The queries counter excludes the hits (llama.cpp): queries = hits + counter.
    queries_exclude_hits: bool,
    /// An engine-computed recent hit-ratio gauge.
    recent_ratio_gauge: Option<&'static str>,
}

static VLLM: Spec = Spec {
    kind: Engine::Vllm,
    prefix: "vllm:",
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    kv: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    prefix_counters: &[
        (
            "vllm:prefix_cache_hits_total",
            "vllm:prefix_cache_queries_total",
        ),
        (
            "vllm:gpu_prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_queries_total",
        ),
    ],
    queries_exclude_hits: false,
    recent_ratio_gauge: None,
};

static SGLANG: Spec = Spec {
    kind: Engine::Sglang,
    prefix: "sglang:",
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    kv: &["sglang:token_usage"],
    prefix_counters: &[("sglang:cached_tokens_total", "sglang:prompt_tokens_total")],
    queries_exclude_hits: false,
    recent_ratio_gauge: Some("sglang:cache_hit_rate"),
};

static LLAMACPP: Spec = Spec {
    kind: Engine::LlamaCpp,
    prefix: "llamacpp:",
    running: "llamacpp:requests_processing",
    waiting: "llamacpp:requests_deferred",
    kv: &["llamacpp:kv_cache_usage_ratio"],
    prefix_counters: &[(
        "llamacpp:prompt_tokens_cached_total",
        "llamacpp:prompt_tokens_total",
    )],
    queries_exclude_hits: true,
    recent_ratio_gauge: None,
};

static TGI: Spec = Spec {
    kind: Engine::Tgi,
    prefix: "tgi_",
    running: "tgi_batch_current_size",
    waiting: "tgi_queue_size",
    kv: &[],
    prefix_counters: &[],
    queries_exclude_hits: false,
    recent_ratio_gauge: None,
};

/// What one exposition says about prefix caching, before windowing.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixCacheCounters {
    /// Cumulative (hit tokens, queried tokens), summed over series.
    pub counters: Option<(f64, f64)>,
    /// An engine-computed recent ratio (SGLang's `cache_hit_rate`), averaged over series.
    pub recent_ratio: Option<f64>,
}

/// One exposition normalised (no windowing, no age): the pure part of a scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReading {
    /// The engine the names belong to.
    pub kind: Engine,
    /// Requests being processed, summed over engines behind the URL.
    pub running: f64,
    /// Requests queued, summed.
    pub waiting: f64,
    /// KV-cache usage 0–1, averaged over engines.
    pub kv_usage: Option<f64>,
    /// Prefix-cache counters and gauge.
    pub prefix_cache: PrefixCacheCounters,
}

/// Why an exposition could not be normalised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NormalizeError {
    /// None of the known engines' names appear (auto detection).
    #[error("no known engine metrics in the exposition ({samples} samples)")]
    NoEngineMetrics {
        /// How many samples the exposition had.
        samples: usize,
    },
    /// The configured engine's names do not appear.
    #[error("no {kind} metrics in the exposition ({samples} samples)")]
    NoMetricsForKind {
        /// The configured engine.
        kind: &'static str,
        /// How many samples the exposition had.
        samples: usize,
    },
}

/// Normalises one parsed exposition (pure; see the module docs for the rules).
pub fn normalize(expo: &Exposition, hint: EngineKind) -> Result<EngineReading, NormalizeError> {
    let spec = match hint {
        EngineKind::Engine(kind) => {
            let spec = spec(kind);
            if !expo.samples.iter().any(|s| s.name.starts_with(spec.prefix)) {
                return Err(NormalizeError::NoMetricsForKind {
                    kind: kind.as_str(),
                    samples: expo.samples.len(),
                });
            }
            spec
        }
        EngineKind::Auto | EngineKind::OpenAi => {
            detect(expo).ok_or(NormalizeError::NoEngineMetrics {
                samples: expo.samples.len(),
            })?
        }
    };
    let running = aggregate(expo, spec.running).map_or(0.0, |a| a.sum);
    let waiting = aggregate(expo, spec.waiting).map_or(0.0, |a| a.sum);
    let kv_usage = spec
        .kv
        .iter()
        .find_map(|name| aggregate(expo, name))
        .map(|a| clamp01(a.mean()));
    let counters = spec.prefix_counters.iter().find_map(|(hits, queries)| {
        let hits = aggregate(expo, hits)?.sum;
        let queries = aggregate(expo, queries)?.sum;
        let queries = if spec.queries_exclude_hits {
            queries + hits
        } else {
            queries
        };
        Some((hits, queries))
    });
    let recent_ratio = spec
        .recent_ratio_gauge
        .and_then(|name| aggregate(expo, name))
        .map(|a| clamp01(a.mean()));
    Ok(EngineReading {
        kind: spec.kind,
        running,
        waiting,
        kv_usage,
        prefix_cache: PrefixCacheCounters {
            counters,
            recent_ratio,
        },
    })
}

/// The engine whose prefix has the most samples (ties in [`Engine::ALL`] order).
fn detect(expo: &Exposition) -> Option<&'static Spec> {
    let mut best: Option<(&'static Spec, usize)> = None;
    for kind in Engine::ALL {
        let spec = spec(kind);
        let count = expo
            .samples
            .iter()
            .filter(|s| s.name.starts_with(spec.prefix))
            .count();
        if count > 0 && best.is_none_or(|(_, c)| count > c) {
            best = Some((spec, count));
        }
    }
    best.map(|(spec, _)| spec)
}

pub(crate) fn clamp01(v: f64) -> f64 {
    v.clamp(0.0, 1.0)
}

/// Sum and count over the distinct series of one name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Aggregate {
    pub(crate) sum: f64,
    pub(crate) count: usize,
}

impl Aggregate {
    pub(crate) fn mean(self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }
}

/// Labels that only name a replica of one scheduler (tensor/pipeline/expert parallel ranks).
const REPLICA_LABELS: [&str; 3] = ["tp_rank", "pp_rank", "moe_ep_rank"];

/// Labels that split a total into parts (SGLang's per-priority queues, per-DP-rank series).
const BREAKDOWN_LABELS: [&str; 2] = ["priority", "dp_rank"];

/// Aggregates the distinct series of `name` (see the module docs); `None` if there is none.
pub(crate) fn aggregate(expo: &Exposition, name: &str) -> Option<Aggregate> {
    let mut series: Vec<&Sample> = expo.named(name).filter(|s| s.value.is_finite()).collect();
    if series.is_empty() {
        return None;
    }
    // A breakdown label present on some series and absent on others: the ones without it are
    // the aggregate, the others its parts.
    for label in BREAKDOWN_LABELS {
        let broken_down = series.iter().any(|s| s.label(label).is_some());
        let overall = series.iter().any(|s| s.label(label).is_none());
        if broken_down && overall {
            series.retain(|s| s.label(label).is_none());
        }
    }
    // Group by the labels that are not replica ranks; keep the lowest-rank replica per group.
    struct Group<'a> {
        key: Vec<(&'a str, &'a str)>,
        rank: [u64; 3],
        value: f64,
    }
    let mut groups: Vec<Group<'_>> = Vec::new();
    for s in series {
        let mut key: Vec<(&str, &str)> = s
            .labels
            .iter()
            .filter(|(k, v)| !v.is_empty() && !REPLICA_LABELS.contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        key.sort_unstable();
        let rank = REPLICA_LABELS.map(|l| s.label(l).and_then(|v| v.parse().ok()).unwrap_or(0));
        match groups.iter_mut().find(|g| g.key == key) {
            Some(group) => {
                if rank < group.rank {
                    group.rank = rank;
                    group.value = s.value;
                }
            }
            None => groups.push(Group {
                key,
                rank,
                value: s.value,
            }),
        }
    }
    Some(Aggregate {
        sum: groups.iter().map(|g| g.value).sum(),
        count: groups.len(),
    })
}

/// Turns successive cumulative counters into the recent and cumulative hit ratios.
#[derive(Debug, Clone, Default)]
pub struct PrefixWindow {
    last: Option<(f64, f64)>,
    recent: Option<f64>,
}

impl PrefixWindow {
    /// Feeds one scrape's counters; returns (recent ratio, cumulative ratio).
    pub fn observe(&mut self, reading: &PrefixCacheCounters) -> (Option<f64>, Option<f64>) {
        let cumulative = reading
            .counters
            .and_then(|(hits, queries)| (queries > 0.0).then(|| clamp01(hits / queries)));
        if let Some((hits, queries)) = reading.counters {
            let (dh, dq) = match self.last {
                Some((ph, pq)) if hits >= ph && queries >= pq => (hits - ph, queries - pq),
                // First scrape: no window yet. A counter that went down: the engine restarted,
                // the window is everything since then.
                Some(_) => (hits, queries),
                None => (0.0, 0.0),
            };
            if dq > 0.0 {
                self.recent = Some(clamp01(dh / dq));
            }
            self.last = Some((hits, queries));
        }
        let recent = reading.recent_ratio.or(self.recent).or(cumulative);
        (recent, cumulative)
    }
}

/// Which upstream to scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTarget {
    /// The upstream's name (the `upstream` label).
    pub name: String,
    /// The upstream's base URL; the metrics are read from `{base}/metrics`.
    pub base_url: String,
    /// A metrics URL used instead of `{base}/metrics`.
    pub metrics_url: Option<String>,
    /// The configured kind.
    pub kind: EngineKind,
    /// One replica of an upstream with several (the `replica` label, its `host:port`); `None`
    /// gives the series no `replica` label.
    pub replica: Option<String>,
    /// Trust roots and client certificate for `https://` metrics URLs (the upstream's).
    pub tls: tokenscope_net::ClientTls,
}

impl EngineTarget {
    /// A target with the default metrics path and `auto` kind.
    pub fn new(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            base_url: base_url.into(),
            metrics_url: None,
            kind: EngineKind::Auto,
            replica: None,
            tls: tokenscope_net::ClientTls::system(),
        }
    }

    /// The URL that will be scraped, or `None` when nothing is scraped (`openai` without an
    /// explicit metrics URL).
    pub fn scrape_url(&self) -> Option<String> {
        match (&self.metrics_url, self.kind) {
            (Some(url), _) => Some(url.clone()),
            (None, EngineKind::OpenAi) => None,
            (None, _) => Some(format!("{}/metrics", self.base_url.trim_end_matches('/'))),
        }
    }
}

/// `scheme://user:secret@host…` → `scheme://user:***@host…`: URLs in logs and errors never
/// carry a password.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

/// Parses and checks a scrape URL (absolute, `http://`).
pub(crate) fn parse_http_url(url: &str) -> Result<Uri, TargetError> {
    let uri: Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| TargetError::InvalidUrl {
            url: redacted(url),
            reason: e.to_string(),
        })?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(_) => return Err(TargetError::UnsupportedScheme { url: redacted(url) }),
        None => {
            return Err(TargetError::InvalidUrl {
                url: redacted(url),
                reason: "not an absolute URL".to_owned(),
            })
        }
    }
    if uri.authority().is_none() {
        return Err(TargetError::InvalidUrl {
            url: redacted(url),
            reason: "no host".to_owned(),
        });
    }
    Ok(uri)
}

/// What a request path reads: the engine's state at its last successful scrape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSnapshot {
    /// Requests being processed (summed over the engines behind the URL).
    pub running: f64,
    /// Requests queued.
    pub waiting: f64,
    /// KV-cache usage 0–1, if the engine exposes it.
    pub kv_usage: Option<f64>,
    /// Prefix-cache hit ratio 0–1 over the most recent window with queries (see module docs).
    pub prefix_cache_hit_ratio: Option<f64>,
    /// Prefix-cache hit ratio 0–1 since the engine started.
    pub prefix_cache_hit_ratio_cumulative: Option<f64>,
    /// The engine (`vllm`, `sglang`, `llamacpp`, `tgi`); always set in a snapshot today.
    pub kind: Option<&'static str>,
    /// Time since the scrape that produced this snapshot completed.
    pub age: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EngineValues {
    running: f64,
    waiting: f64,
    kv_usage: Option<f64>,
    hit_recent: Option<f64>,
    hit_cumulative: Option<f64>,
    kind: Engine,
}

#[derive(Debug)]
struct EngineShared {
    name: String,
    replica: Option<String>,
    url: Option<String>,
    cell: StateCell<EngineValues>,
}

/// A cheap, cloneable handle on one upstream's engine state.
///
/// The scraper task runs while any clone is alive (or until [`EngineStateHandle::shutdown`]).
#[derive(Debug, Clone)]
pub struct EngineStateHandle {
    shared: Arc<EngineShared>,
}

impl EngineStateHandle {
    /// Starts scraping `target` every `config.interval` on the current tokio runtime.
    ///
    /// An `openai` target without an explicit metrics URL gets a handle that stays unknown
    /// and starts no task.
    pub fn spawn(target: EngineTarget, config: ScrapeConfig) -> Result<Self, TargetError> {
        let Some(url) = target.scrape_url() else {
            let handle = Self::idle(target.name, target.replica, None);
            handle
                .shared
                .cell
                .set_reason("not scraped: kind openai has no engine metrics".to_owned());
            return Ok(handle);
        };
        let uri = parse_http_url(&url)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| TargetError::NoRuntime)?;
        let handle = Self::idle(target.name, target.replica, Some(url));
        let weak = Arc::downgrade(&handle.shared);
        let stop = handle.shared.cell.stop.clone();
        runtime.spawn(run(weak, stop, uri, target.kind, target.tls, config));
        Ok(handle)
    }

    fn idle(name: String, replica: Option<String>, url: Option<String>) -> Self {
        Self {
            shared: Arc::new(EngineShared {
                name,
                replica,
                url,
                cell: StateCell::new(),
            }),
        }
    }

    /// The upstream's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The replica's `host:port`, when the target named one.
    pub fn replica(&self) -> Option<&str> {
        self.shared.replica.as_deref()
    }

    /// The URL scraped (`None` when nothing is scraped).
    pub fn metrics_url(&self) -> Option<&str> {
        self.shared.url.as_deref()
    }

    /// The current state, or `None` while unknown. Lock-free; safe on the request path.
    pub fn snapshot(&self) -> Option<EngineSnapshot> {
        self.shared.cell.with(|t| EngineSnapshot {
            running: t.value.running,
            waiting: t.value.waiting,
            kv_usage: t.value.kv_usage,
            prefix_cache_hit_ratio: t.value.hit_recent,
            prefix_cache_hit_ratio_cumulative: t.value.hit_cumulative,
            kind: Some(t.value.kind.as_str()),
            age: t.at.elapsed(),
        })
    }

    /// Why the state is unknown (the last scrape's error), if it is.
    pub fn last_error(&self) -> Option<String> {
        self.shared.cell.last_error()
    }

    /// Scrapes attempted so far.
    pub fn scrapes(&self) -> u64 {
        self.shared.cell.attempts()
    }

    /// Scrapes that failed so far.
    pub fn failed_scrapes(&self) -> u64 {
        self.shared.cell.failures()
    }

    /// Stops the scraper; the last state stays readable.
    pub fn shutdown(&self) {
        self.shared.cell.stop.cancel();
    }
}

/// Why one scrape produced no state.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The endpoint could not be read.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The exposition had no usable engine metrics.
    #[error(transparent)]
    Normalize(#[from] NormalizeError),
}

async fn run(
    weak: Weak<EngineShared>,
    stop: tokio_util::sync::CancellationToken,
    uri: Uri,
    hint: EngineKind,
    tls: tokenscope_net::ClientTls,
    config: ScrapeConfig,
) {
    let client = fetch::client(config.timeout, &tls);
    let shown = redacted(&uri.to_string());
    let mut window = PrefixWindow::default();
    let mut failing = false;
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let fetched = tokio::select! {
            _ = stop.cancelled() => break,
            r = fetch::fetch_text(&client, &uri, config.timeout, config.max_body_bytes) => r,
        };
        let Some(shared) = weak.upgrade() else { break };
        let outcome = fetched
            .map_err(ScrapeError::from)
            .and_then(|text| normalize(&exposition::parse(&text), hint).map_err(ScrapeError::from));
        match outcome {
            Ok(reading) => {
                let (hit_recent, hit_cumulative) = window.observe(&reading.prefix_cache);
                shared.cell.publish(EngineValues {
                    running: reading.running,
                    waiting: reading.waiting,
                    kv_usage: reading.kv_usage,
                    hit_recent,
                    hit_cumulative,
                    kind: reading.kind,
                });
                if failing {
                    failing = false;
                    tracing::info!(upstream = %shared.name, url = %shown, kind = reading.kind.as_str(), "engine state known again");
                }
            }
            Err(error) => {
                shared.cell.fail(error.to_string());
                if failing {
                    tracing::debug!(upstream = %shared.name, url = %shown, %error, "engine state still unknown");
                } else {
                    failing = true;
                    tracing::warn!(
                        upstream = %shared.name,
                        url = %shown,
                        %error,
                        "engine state unknown; retrying every {:?} (repeats logged at debug)",
                        config.interval
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_logs_and_errors_carry_no_password() {
        assert_eq!(
            redacted("http://ops:s3cret@10.0.0.1:8000/metrics"),
            "http://ops:***@10.0.0.1:8000/metrics"
        );
        assert_eq!(
            redacted("http://10.0.0.1:8000/m?a=b@c"),
            "http://10.0.0.1:8000/m?a=b@c"
        );
        let err = parse_http_url("ftp://ops:s3cret@h/metrics").expect_err("ftp");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    fn expo(text: &str) -> Exposition {
        exposition::parse(text)
    }

    #[test]
    fn sums_engines_and_averages_ratios() {
        let e = expo(
            "vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 3.0\n\
             vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 4.0\n\
             vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 1.0\n\
             vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.2\n\
             vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"a\"} 0.6\n\
             vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.9\n",
        );
        let r = normalize(&e, EngineKind::Auto).expect("vllm reading");
        assert_eq!(r.kind, Engine::Vllm);
        assert_eq!(r.running, 7.0);
        assert_eq!(r.waiting, 1.0);
        let kv = r.kv_usage.expect("kv usage");
        assert!((kv - 0.4).abs() < 1e-12, "{kv}");
        assert_eq!(r.prefix_cache.counters, None);
    }

    #[test]
    fn older_vllm_names_are_the_fallback() {
        let e = expo(
            "vllm:num_requests_running{model_name=\"a\"} 1\n\
             vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.5\n\
             vllm:gpu_prefix_cache_hits_total{model_name=\"a\"} 30\n\
             vllm:gpu_prefix_cache_queries_total{model_name=\"a\"} 120\n",
        );
        let r = normalize(&e, EngineKind::Engine(Engine::Vllm)).expect("vllm reading");
        assert_eq!(r.kv_usage, Some(0.5));
        assert_eq!(r.prefix_cache.counters, Some((30.0, 120.0)));
    }

    #[test]
    fn sglang_replicas_and_priorities_count_once() {
        let e = expo(
            "sglang:num_running_reqs{dp_rank=\"0\",engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 4.0\n\
             sglang:num_running_reqs{dp_rank=\"0\",engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"1\"} 4.0\n\
             sglang:num_running_reqs{dp_rank=\"1\",engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 2.0\n\
             sglang:num_queue_reqs{pp_rank=\"0\",priority=\"\",tp_rank=\"0\"} 2.0\n\
             sglang:num_queue_reqs{pp_rank=\"0\",priority=\"-1\",tp_rank=\"0\"} 1.0\n\
             sglang:num_queue_reqs{pp_rank=\"0\",priority=\"0\",tp_rank=\"0\"} 1.0\n\
             sglang:token_usage{tp_rank=\"0\"} 0.25\n\
             sglang:token_usage{tp_rank=\"1\"} 0.75\n\
             sglang:cache_hit_rate{tp_rank=\"0\"} 0.5\n",
        );
        let r = normalize(&e, EngineKind::Auto).expect("sglang reading");
        let with_total = expo(
            "sglang:num_running_reqs{model_name=\"q\",tp_rank=\"0\"} 8\n\
             sglang:num_running_reqs{dp_rank=\"0\",model_name=\"q\",tp_rank=\"0\"} 3\n\
             sglang:num_running_reqs{dp_rank=\"1\",model_name=\"q\",tp_rank=\"0\"} 5\n",
        );
        let total = normalize(&with_total, EngineKind::Auto).expect("sglang reading");
        assert_eq!(
            total.running, 8.0,
            "per-dp parts of an aggregate are not added again"
        );
        assert_eq!(r.kind, Engine::Sglang);
        assert_eq!(r.running, 6.0, "tp_rank 1 replica dropped, dp_rank 1 added");
        assert_eq!(r.waiting, 2.0, "aggregate priority series only");
        assert_eq!(r.kv_usage, Some(0.25), "lowest tp rank only");
        assert_eq!(r.prefix_cache.recent_ratio, Some(0.5));
    }

    #[test]
    fn llamacpp_queries_include_cached_tokens() {
        let e = expo(
            "llamacpp:prompt_tokens_total 159\nllamacpp:prompt_tokens_cached_total 83\n\
             llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n",
        );
        let r = normalize(&e, EngineKind::Auto).expect("llama.cpp reading");
        assert_eq!(r.kind, Engine::LlamaCpp);
        assert_eq!(r.prefix_cache.counters, Some((83.0, 242.0)));
        assert_eq!(r.kv_usage, None);
    }

    #[test]
    fn detection_and_missing_metrics() {
        let e = expo("python_gc_objects_collected_total{generation=\"0\"} 1\n");
        assert_eq!(
            normalize(&e, EngineKind::Auto),
            Err(NormalizeError::NoEngineMetrics { samples: 1 })
        );
        let e = expo("tgi_request_count 3\n");
        assert_eq!(
            normalize(&e, EngineKind::Engine(Engine::Vllm)),
            Err(NormalizeError::NoMetricsForKind {
                kind: "vllm",
                samples: 1
            })
        );
        let r = normalize(&e, EngineKind::Auto).expect("tgi detected");
        assert_eq!(r.kind, Engine::Tgi);
        assert_eq!(
            (r.running, r.waiting),
            (0.0, 0.0),
            "lazily created gauges read as 0"
        );
        let mixed =
            expo("tgi_queue_size 1\nvllm:num_requests_running 1\nvllm:num_requests_waiting 2\n");
        assert_eq!(
            normalize(&mixed, EngineKind::Auto).expect("reading").kind,
            Engine::Vllm
        );
    }

    #[test]
    fn prefix_window_recent_then_cumulative() {
        let mut w = PrefixWindow::default();
        let at = |h: f64, q: f64| PrefixCacheCounters {
            counters: Some((h, q)),
            recent_ratio: None,
        };
        assert_eq!(
            w.observe(&at(25.0, 100.0)),
            (Some(0.25), Some(0.25)),
            "first: cumulative"
        );
        assert_eq!(
            w.observe(&at(75.0, 200.0)),
            (Some(0.5), Some(0.375)),
            "window 50/100"
        );
        assert_eq!(
            w.observe(&at(75.0, 200.0)),
            (Some(0.5), Some(0.375)),
            "idle keeps last window"
        );
        assert_eq!(
            w.observe(&at(9.0, 10.0)),
            (Some(0.9), Some(0.9)),
            "reset: since restart"
        );
        let none = PrefixCacheCounters::default();
        assert_eq!(w.observe(&none), (Some(0.9), None));
        let gauge = PrefixCacheCounters {
            counters: None,
            recent_ratio: Some(0.3),
        };
        assert_eq!(PrefixWindow::default().observe(&gauge), (Some(0.3), None));
    }

    #[test]
    fn scrape_urls() {
        let mut t = EngineTarget::new("a", "http://127.0.0.1:8000/");
        assert_eq!(
            t.scrape_url().as_deref(),
            Some("http://127.0.0.1:8000/metrics")
        );
        t.kind = EngineKind::OpenAi;
        assert_eq!(t.scrape_url(), None);
        t.metrics_url = Some("http://127.0.0.1:9000/m".to_owned());
        assert_eq!(t.scrape_url().as_deref(), Some("http://127.0.0.1:9000/m"));
        assert!(matches!(
            parse_http_url("ftp://api.example/metrics"),
            Err(TargetError::UnsupportedScheme { .. })
        ));
        assert!(matches!(
            parse_http_url("/metrics"),
            Err(TargetError::InvalidUrl { .. })
        ));
        assert!(parse_http_url("http://127.0.0.1:1/metrics").is_ok());
        assert!(parse_http_url("https://engine.example/metrics").is_ok());
    }
}
