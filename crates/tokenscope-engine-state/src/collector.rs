//! Engine and GPU state as Prometheus gauges, read from the snapshots at scrape time.
//!
//! | metric | labels | value |
//! |---|---|---|
//! | `llm_engine_state_up` | `upstream`, `replica` | 1 when the engine's state is known, 0 when unknown |
//! | `llm_engine_requests_running` | `upstream`, `replica` | requests being processed |
//! | `llm_engine_requests_waiting` | `upstream`, `replica` | requests queued |
//! | `llm_engine_kv_cache_usage_ratio` | `upstream`, `replica` | KV-cache usage 0–1 |
//! | `llm_engine_prefix_cache_hit_ratio` | `upstream`, `replica` | recent prefix-cache hit ratio 0–1 |
//! | `llm_gpu_utilization_ratio` | `gpu` | utilisation 0–1 |
//! | `llm_gpu_memory_used_bytes` | `gpu` | memory in use |
//! | `llm_gpu_memory_total_bytes` | `gpu` | memory in all |
//! | `llm_gpu_memory_bandwidth_utilization_ratio` | `gpu` | memory-bandwidth utilisation 0–1 |
//!
//! Invariants:
//! * Values are read once per Prometheus scrape from the lock-free snapshots; nothing is
//!   cached here, so a gauge is never older than the snapshot it came from.
//! * An unknown engine or GPU state emits no value series (absent, not 0), except
//!   `llm_engine_state_up = 0`; a field the engine does not expose is absent too. A family
//!   with no series at all is left out.
//! * Labels are bounded: one series per configured upstream (per replica of an upstream with
//!   several: `replica` is its `host:port`; a target without one has no `replica` label) and
//!   per GPU.

use crate::engine::EngineStateHandle;
use crate::gpu::GpuStateHandle;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeGaugeValue};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// Registers the engine and GPU gauges (see the module docs) on `registry`.
pub fn register_metrics(
    registry: &mut Registry,
    engines: &[EngineStateHandle],
    gpu: Option<&GpuStateHandle>,
) {
    registry.register_collector(Box::new(StateCollector {
        engines: engines.to_vec(),
        gpu: gpu.cloned(),
    }));
}

#[derive(Debug)]
struct StateCollector {
    engines: Vec<EngineStateHandle>,
    gpu: Option<GpuStateHandle>,
}

/// The label pairs of one series.
type Labels = Vec<(&'static str, String)>;

fn family<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    series: &[(Labels, V)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        metric.encode_family(&labels)?.encode_gauge(value)?;
    }
    Ok(())
}

/// `{upstream}`, plus `{replica}` when the handle names one.
fn engine_labels(h: &EngineStateHandle) -> Labels {
    let mut l = vec![("upstream", h.name().to_owned())];
    if let Some(r) = h.replica() {
        l.push(("replica", r.to_owned()));
    }
    l
}

/// `{gpu}`.
fn gpu_labels(gpu: &str) -> Labels {
    vec![("gpu", gpu.to_owned())]
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snapshots: Vec<(Labels, Option<crate::EngineSnapshot>)> = self
            .engines
            .iter()
            .map(|h| (engine_labels(h), h.snapshot()))
            .collect();
        let pick = |f: &dyn Fn(&crate::EngineSnapshot) -> Option<f64>| -> Vec<(Labels, f64)> {
            snapshots
                .iter()
                .filter_map(|(l, s)| s.as_ref().and_then(f).map(|v| (l.clone(), v)))
                .collect()
        };
        let up: Vec<(Labels, i64)> = snapshots
            .iter()
            .map(|(l, s)| (l.clone(), i64::from(s.is_some())))
            .collect();
        family(
            &mut encoder,
            "llm_engine_state_up",
            "Whether the upstream engine's state is known (its metrics endpoint was read).",
            &up,
        )?;
        family(
            &mut encoder,
            "llm_engine_requests_running",
            "Requests the upstream engine is processing (summed over its engines).",
            &pick(&|s| Some(s.running)),
        )?;
        family(
            &mut encoder,
            "llm_engine_requests_waiting",
            "Requests queued in the upstream engine.",
            &pick(&|s| Some(s.waiting)),
        )?;
        family(
            &mut encoder,
            "llm_engine_kv_cache_usage_ratio",
            "KV-cache usage of the upstream engine, 0 to 1.",
            &pick(&|s| s.kv_usage),
        )?;
        family(
            &mut encoder,
            "llm_engine_prefix_cache_hit_ratio",
            "Prefix-cache hit ratio of the upstream engine over its most recent window, 0 to 1.",
            &pick(&|s| s.prefix_cache_hit_ratio),
        )?;

        let Some(gpu) = self.gpu.as_ref().and_then(GpuStateHandle::snapshot) else {
            return Ok(());
        };
        let ratios = |f: &dyn Fn(&crate::GpuSample) -> Option<f64>| -> Vec<(Labels, f64)> {
            gpu.gpus
                .iter()
                .filter_map(|g| f(g).map(|v| (gpu_labels(&g.gpu), v)))
                .collect()
        };
        let bytes = |f: &dyn Fn(&crate::GpuSample) -> Option<u64>| -> Vec<(Labels, u64)> {
            gpu.gpus
                .iter()
                .filter_map(|g| f(g).map(|v| (gpu_labels(&g.gpu), v)))
                .collect()
        };
        family(
            &mut encoder,
            "llm_gpu_utilization_ratio",
            "GPU utilisation, 0 to 1 (share of time a kernel ran).",
            &ratios(&|g| g.utilization),
        )?;
        family(
            &mut encoder,
            "llm_gpu_memory_used_bytes",
            "GPU device memory in use, bytes.",
            &bytes(&|g| g.memory_used_bytes),
        )?;
        family(
            &mut encoder,
            "llm_gpu_memory_total_bytes",
            "GPU device memory in all, bytes.",
            &bytes(&|g| g.memory_total_bytes),
        )?;
        family(
            &mut encoder,
            "llm_gpu_memory_bandwidth_utilization_ratio",
            "GPU memory-bandwidth utilisation, 0 to 1 (DCGM DRAM_ACTIVE; NVML: memory read/write duty cycle).",
            &ratios(&|g| g.memory_bandwidth_utilization),
        )?;
        Ok(())
    }
}
