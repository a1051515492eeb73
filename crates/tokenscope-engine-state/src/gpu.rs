//! GPU state: per-GPU utilisation, memory and memory-bandwidth utilisation, from a DCGM
//! exporter's Prometheus endpoint or, without one, from NVML loaded at run time.
//!
//! DCGM exporter fields read (names and units from dcgm-exporter's `etc/default-counters.csv`
//! and `etc/dcp-metrics-included.csv`):
//!
//! | field | unit | becomes |
//! |---|---|---|
//! | `DCGM_FI_DEV_GPU_UTIL` | percent | `utilization` (÷ 100) |
//! | `DCGM_FI_DEV_FB_USED` / `DCGM_FI_DEV_FB_FREE` / `DCGM_FI_DEV_FB_RESERVED` | MiB | bytes; total = used + free (+ reserved when exported) |
//! | `DCGM_FI_PROF_DRAM_ACTIVE` | ratio 0–1 | `memory_bandwidth_utilization` |
//! | `DCGM_FI_PROF_SM_ACTIVE` | ratio 0–1 | `sm_active` (not in the exporter's default set) |
//!
//! NVML (see `nvml.rs`): `utilization.gpu` → `utilization`; `utilization.memory` — "percent of
//! time over the past sample period during which global (device) memory was being read or
//! written" — → `memory_bandwidth_utilization`. It is a duty cycle, not bytes per second
//! against peak, so it reads higher than DCGM's `DRAM_ACTIVE` under the same load; it is the
//! closest proxy NVML offers. `memory_info()` gives used/total bytes.
//!
//! Invariants:
//! * One [`GpuSample`] per physical GPU, keyed by the `gpu` label (else `UUID`, else `device`),
//!   sorted by index. MIG-instance series (non-empty `GPU_I_ID`) are skipped: they describe a
//!   slice, not the GPU. A field a GPU does not export stays `None`.
//! * Means are over the GPUs that report the field; byte totals are sums over GPUs that
//!   report them. Ratios are clamped to 0–1.
//! * The snapshot is lock-free to read and `None` while unknown, like engine state. NVML
//!   absent (no `libnvidia-ml`) is not an error: one `info` line per process and no handle.

use crate::cell::StateCell;
use crate::engine::{clamp01, parse_http_url};
use crate::exposition::{self, Exposition};
use crate::fetch::{self, FetchError};
use crate::{nvml, ScrapeConfig, TargetError};
use http::Uri;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::time::MissedTickBehavior;

const MIB: f64 = 1024.0 * 1024.0;

/// Where GPU state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuSource {
    /// A DCGM exporter's `/metrics`.
    Dcgm,
    /// NVML (`libnvidia-ml`) loaded at run time.
    Nvml,
}

impl GpuSource {
    /// `dcgm` or `nvml`.
    pub fn as_str(self) -> &'static str {
        match self {
            GpuSource::Dcgm => "dcgm",
            GpuSource::Nvml => "nvml",
        }
    }
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuSample {
    /// GPU index as the source names it (the `gpu` label value).
    pub gpu: String,
    /// GPU UUID, when known.
    pub uuid: Option<String>,
    /// Product name (`modelName` in DCGM), when known.
    pub model_name: Option<String>,
    /// Share of time a kernel was running, 0–1.
    pub utilization: Option<f64>,
    /// Device memory in use, bytes.
    pub memory_used_bytes: Option<u64>,
    /// Device memory in all, bytes.
    pub memory_total_bytes: Option<u64>,
    /// Memory-bandwidth utilisation 0–1 (DCGM `DRAM_ACTIVE`, or NVML's memory duty cycle).
    pub memory_bandwidth_utilization: Option<f64>,
    /// Share of cycles with at least one warp on an SM, 0–1 (DCGM only).
    pub sm_active: Option<f64>,
}

/// GPU state at the last successful read.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSnapshot {
    /// Per GPU, sorted by index.
    pub gpus: Vec<GpuSample>,
    /// Mean utilisation 0–1 over GPUs reporting it.
    pub mean_utilization: Option<f64>,
    /// Mean memory-bandwidth utilisation 0–1 over GPUs reporting it.
    pub mean_memory_bandwidth: Option<f64>,
    /// Mean SM activity 0–1 over GPUs reporting it.
    pub mean_sm_active: Option<f64>,
    /// Memory in use, bytes, summed over GPUs.
    pub memory_used_bytes: u64,
    /// Memory in all, bytes, summed over GPUs.
    pub memory_total_bytes: u64,
    /// Where this came from.
    pub source: GpuSource,
    /// Time since the read that produced this snapshot completed.
    pub age: Duration,
}

impl GpuSnapshot {
    pub(crate) fn from_samples(gpus: Vec<GpuSample>, source: GpuSource, age: Duration) -> Self {
        fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
            let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
            (n > 0).then(|| sum / n as f64)
        }
        Self {
            mean_utilization: mean(gpus.iter().filter_map(|g| g.utilization)),
            mean_memory_bandwidth: mean(gpus.iter().filter_map(|g| g.memory_bandwidth_utilization)),
            mean_sm_active: mean(gpus.iter().filter_map(|g| g.sm_active)),
            memory_used_bytes: gpus.iter().filter_map(|g| g.memory_used_bytes).sum(),
            memory_total_bytes: gpus.iter().filter_map(|g| g.memory_total_bytes).sum(),
            gpus,
            source,
            age,
        }
    }
}

/// Why a DCGM exposition gave no GPUs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no DCGM GPU fields in the exposition ({samples} samples)")]
pub struct NoDcgmMetrics {
    /// How many samples the exposition had.
    pub samples: usize,
}

/// Reads the per-GPU fields of a DCGM exporter exposition (pure).
pub fn gpus_from_dcgm(expo: &Exposition) -> Result<Vec<GpuSample>, NoDcgmMetrics> {
    #[derive(Default)]
    struct Raw {
        sample: GpuSample,
        used_mib: Option<f64>,
        free_mib: Option<f64>,
        reserved_mib: Option<f64>,
    }
    let mut gpus: Vec<Raw> = Vec::new();
    for s in &expo.samples {
        let field = match s.name.as_str() {
            "DCGM_FI_DEV_GPU_UTIL"
            | "DCGM_FI_DEV_FB_USED"
            | "DCGM_FI_DEV_FB_FREE"
            | "DCGM_FI_DEV_FB_RESERVED"
            | "DCGM_FI_PROF_DRAM_ACTIVE"
            | "DCGM_FI_PROF_SM_ACTIVE" => s.name.as_str(),
            _ => continue,
        };
        if s.label("GPU_I_ID").is_some() || !s.value.is_finite() {
            continue;
        }
        let Some(key) = s.label("gpu").or(s.label("UUID")).or(s.label("device")) else {
            continue;
        };
        let index = match gpus.iter().position(|g| g.sample.gpu == key) {
            Some(i) => i,
            None => {
                gpus.push(Raw {
                    sample: GpuSample {
                        gpu: key.to_owned(),
                        ..GpuSample::default()
                    },
                    ..Raw::default()
                });
                gpus.len() - 1
            }
        };
        let Some(g) = gpus.get_mut(index) else {
            continue;
        };
        if g.sample.uuid.is_none() {
            g.sample.uuid = s.label("UUID").map(str::to_owned);
        }
        if g.sample.model_name.is_none() {
            g.sample.model_name = s.label("modelName").map(str::to_owned);
        }
        let v = s.value;
        // The first series of a field for a GPU wins (pod-attribution labels can repeat it).
        match field {
            "DCGM_FI_DEV_GPU_UTIL" => {
                g.sample.utilization.get_or_insert(clamp01(v / 100.0));
            }
            "DCGM_FI_DEV_FB_USED" => {
                g.used_mib.get_or_insert(v);
            }
            "DCGM_FI_DEV_FB_FREE" => {
                g.free_mib.get_or_insert(v);
            }
            "DCGM_FI_DEV_FB_RESERVED" => {
                g.reserved_mib.get_or_insert(v);
            }
            "DCGM_FI_PROF_DRAM_ACTIVE" => {
                g.sample
                    .memory_bandwidth_utilization
                    .get_or_insert(clamp01(v));
            }
            _ => {
                g.sample.sm_active.get_or_insert(clamp01(v));
            }
        }
    }
    if gpus.is_empty() {
        return Err(NoDcgmMetrics {
            samples: expo.samples.len(),
        });
    }
    let bytes = |mib: f64| (mib.max(0.0) * MIB).round() as u64;
    let mut out: Vec<GpuSample> = gpus
        .into_iter()
        .map(|raw| {
            let mut sample = raw.sample;
            sample.memory_used_bytes = raw.used_mib.map(bytes);
            sample.memory_total_bytes = match (raw.used_mib, raw.free_mib) {
                (Some(used), Some(free)) => {
                    Some(bytes(used + free + raw.reserved_mib.unwrap_or(0.0)))
                }
                _ => None,
            };
            sample
        })
        .collect();
    sort_by_index(&mut out);
    Ok(out)
}

pub(crate) fn sort_by_index(gpus: &mut [GpuSample]) {
    gpus.sort_by(|a, b| match (a.gpu.parse::<u64>(), b.gpu.parse::<u64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        _ => a.gpu.cmp(&b.gpu),
    });
}

/// Where to read GPU state from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuConfig {
    /// A DCGM exporter metrics URL (e.g. `http://127.0.0.1:9400/metrics`); preferred.
    pub dcgm_url: Option<String>,
    /// Fall back to NVML when no DCGM URL is set.
    pub nvml: bool,
    /// Interval, timeout and body limit.
    pub scrape: ScrapeConfig,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            dcgm_url: None,
            nvml: true,
            scrape: ScrapeConfig::default(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct GpuShared {
    source: GpuSource,
    url: Option<String>,
    pub(crate) cell: StateCell<Vec<GpuSample>>,
    thread: std::sync::OnceLock<std::thread::Thread>,
}

/// A cheap, cloneable handle on GPU state.
#[derive(Debug, Clone)]
pub struct GpuStateHandle {
    shared: Arc<GpuShared>,
}

/// Why a DCGM scrape produced no state.
#[derive(Debug, thiserror::Error)]
pub enum GpuScrapeError {
    /// The exporter could not be read.
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The exposition had no DCGM GPU fields.
    #[error(transparent)]
    NoMetrics(#[from] NoDcgmMetrics),
}

impl GpuStateHandle {
    /// DCGM when a URL is configured, else NVML when enabled and present, else `None`.
    pub fn spawn(config: &GpuConfig) -> Result<Option<Self>, TargetError> {
        match &config.dcgm_url {
            Some(url) => Self::spawn_dcgm(url, config.scrape.clone()).map(Some),
            None if config.nvml => Ok(Self::spawn_nvml(config.scrape.interval)),
            None => Ok(None),
        }
    }

    fn new(source: GpuSource, url: Option<String>) -> Self {
        Self {
            shared: Arc::new(GpuShared {
                source,
                url,
                cell: StateCell::new(),
                thread: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Scrapes a DCGM exporter every `config.interval` on the current tokio runtime.
    pub fn spawn_dcgm(url: &str, config: ScrapeConfig) -> Result<Self, TargetError> {
        let uri = parse_http_url(url)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| TargetError::NoRuntime)?;
        let handle = Self::new(GpuSource::Dcgm, Some(url.to_owned()));
        let weak = Arc::downgrade(&handle.shared);
        let stop = handle.shared.cell.stop.clone();
        runtime.spawn(run_dcgm(weak, stop, uri, config));
        Ok(handle)
    }

    /// Polls NVML every `interval` on a dedicated thread. `None` (after one `info` line per
    /// process) when `libnvidia-ml` cannot be loaded or initialised.
    pub fn spawn_nvml(interval: Duration) -> Option<Self> {
        let opened = match nvml::open() {
            Ok(opened) => opened,
            Err(error) => {
                nvml::log_absent_once(&error);
                return None;
            }
        };
        let handle = Self::new(GpuSource::Nvml, None);
        let weak = Arc::downgrade(&handle.shared);
        let spawned = std::thread::Builder::new()
            .name("tokenscope-nvml".to_owned())
            .spawn(move || nvml::poll_loop(opened, weak, interval));
        match spawned {
            Ok(join) => {
                let _ = handle.shared.thread.set(join.thread().clone());
                Some(handle)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot start the NVML polling thread; GPU state off");
                None
            }
        }
    }

    /// Where the state comes from.
    pub fn source(&self) -> GpuSource {
        self.shared.source
    }

    /// The DCGM URL scraped, if any.
    pub fn url(&self) -> Option<&str> {
        self.shared.url.as_deref()
    }

    /// The current state, or `None` while unknown. Lock-free.
    pub fn snapshot(&self) -> Option<GpuSnapshot> {
        let source = self.shared.source;
        self.shared
            .cell
            .with(|t| GpuSnapshot::from_samples(t.value.clone(), source, t.at.elapsed()))
    }

    /// Why the state is unknown, if it is.
    pub fn last_error(&self) -> Option<String> {
        self.shared.cell.last_error()
    }

    /// Reads attempted so far.
    pub fn scrapes(&self) -> u64 {
        self.shared.cell.attempts()
    }

    /// Stops the scraper or poller; the last state stays readable.
    pub fn shutdown(&self) {
        self.shared.cell.stop.cancel();
        if let Some(thread) = self.shared.thread.get() {
            thread.unpark();
        }
    }
}

impl GpuShared {
    pub(crate) fn stopped(&self) -> bool {
        self.cell.stop.is_cancelled()
    }
}

pub(crate) type WeakGpu = Weak<GpuShared>;

async fn run_dcgm(
    weak: Weak<GpuShared>,
    stop: tokio_util::sync::CancellationToken,
    uri: Uri,
    config: ScrapeConfig,
) {
    // A DCGM exporter over https is trusted through the system's roots.
    let client = fetch::client(config.timeout, &tokenscope_net::ClientTls::system());
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
        let outcome = fetched.map_err(GpuScrapeError::from).and_then(|text| {
            gpus_from_dcgm(&exposition::parse(&text)).map_err(GpuScrapeError::from)
        });
        match outcome {
            Ok(gpus) => {
                let count = gpus.len();
                shared.cell.publish(gpus);
                if failing {
                    failing = false;
                    tracing::info!(url = %uri, gpus = count, "GPU state (DCGM) known again");
                }
            }
            Err(error) => {
                shared.cell.fail(error.to_string());
                if failing {
                    tracing::debug!(url = %uri, %error, "GPU state (DCGM) still unknown");
                } else {
                    failing = true;
                    tracing::warn!(
                        url = %uri,
                        %error,
                        "GPU state (DCGM) unknown; retrying every {:?} (repeats logged at debug)",
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
    fn dcgm_fields_per_gpu_and_means() {
        let e = exposition::parse(
            "DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-b\",modelName=\"H200\"} 50\n\
             DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",modelName=\"H200\"} 100\n\
             DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"GPU-a\"} 1024\n\
             DCGM_FI_DEV_FB_FREE{gpu=\"0\",UUID=\"GPU-a\"} 3072\n\
             DCGM_FI_DEV_FB_USED{gpu=\"1\",UUID=\"GPU-b\"} 10\n\
             DCGM_FI_PROF_DRAM_ACTIVE{gpu=\"0\",UUID=\"GPU-a\"} 0.25\n\
             DCGM_FI_PROF_DRAM_ACTIVE{gpu=\"0\",UUID=\"GPU-a\",GPU_I_ID=\"3\"} 0.99\n\
             DCGM_FI_PROF_SM_ACTIVE{gpu=\"1\",UUID=\"GPU-b\"} 0.5\n",
        );
        let gpus = gpus_from_dcgm(&e).expect("gpus");
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].gpu, "0");
        assert_eq!(gpus[0].uuid.as_deref(), Some("GPU-a"));
        assert_eq!(gpus[0].model_name.as_deref(), Some("H200"));
        assert_eq!(gpus[0].utilization, Some(1.0));
        assert_eq!(gpus[0].memory_used_bytes, Some(1024 * 1024 * 1024));
        assert_eq!(gpus[0].memory_total_bytes, Some(4 * 1024 * 1024 * 1024));
        assert_eq!(
            gpus[0].memory_bandwidth_utilization,
            Some(0.25),
            "MIG slice skipped"
        );
        assert_eq!(gpus[1].memory_total_bytes, None, "no FB_FREE, no total");
        let snap = GpuSnapshot::from_samples(gpus, GpuSource::Dcgm, Duration::ZERO);
        assert_eq!(snap.mean_utilization, Some(0.75));
        assert_eq!(snap.mean_memory_bandwidth, Some(0.25));
        assert_eq!(snap.mean_sm_active, Some(0.5));
        assert_eq!(snap.memory_used_bytes, 1034 * 1024 * 1024);
        assert_eq!(snap.memory_total_bytes, 4 * 1024 * 1024 * 1024);
    }

    #[test]
    fn no_dcgm_fields_is_an_error() {
        let e = exposition::parse("vllm:num_requests_running 1\n");
        assert_eq!(gpus_from_dcgm(&e), Err(NoDcgmMetrics { samples: 1 }));
    }
}
