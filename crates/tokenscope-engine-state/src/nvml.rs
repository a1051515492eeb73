//! NVML, loaded at run time through the `nvml-wrapper` crate (it `dlopen`s `libnvidia-ml` and
//! holds all the FFI; this crate has no `unsafe` of its own).
//!
//! Invariants:
//! * Nothing links against NVML: a machine without the NVIDIA driver builds, runs and tests
//!   the same; [`open`] then fails, one `info` line is logged per process, and GPU state from
//!   NVML is simply off.
//! * `libnvidia-ml.so.1` (what the driver and container runtimes install) is tried before the
//!   development symlink `libnvidia-ml.so` (which `nvml-wrapper` would try alone).
//! * NVML calls block (they talk to the driver), so they run on one dedicated thread per
//!   handle, never on the async runtime or the request path. A field a device does not support
//!   (`NotSupported`, e.g. utilisation on a MIG-enabled GPU) stays `None`.
//! * `utilization.memory` is NVML's "percent of time over the past sample period during which
//!   global (device) memory was being read or written": a duty cycle, the closest NVML proxy
//!   for memory-bandwidth utilisation (DCGM's `DCGM_FI_PROF_DRAM_ACTIVE` is the real ratio).

use crate::engine::clamp01;
use crate::gpu::{sort_by_index, GpuSample, WeakGpu};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[cfg(target_os = "linux")]
const LIB_CANDIDATES: &[&str] = &["libnvidia-ml.so.1", "libnvidia-ml.so"];
#[cfg(target_os = "windows")]
const LIB_CANDIDATES: &[&str] = &["nvml.dll"];
#[cfg(not(any(target_os = "linux", target_os = "windows")))]
const LIB_CANDIDATES: &[&str] = &["libnvidia-ml.so"];

/// NVML could not be loaded or initialised.
#[derive(Debug, thiserror::Error)]
#[error("NVML unavailable (tried {tried}): {source}")]
pub(crate) struct NvmlUnavailable {
    tried: String,
    #[source]
    source: NvmlError,
}

/// An initialised NVML and the library name that worked.
pub(crate) struct Opened {
    nvml: Nvml,
    library: &'static str,
}

/// Loads and initialises NVML.
pub(crate) fn open() -> Result<Opened, NvmlUnavailable> {
    let mut last = None;
    for &library in LIB_CANDIDATES {
        match Nvml::builder().lib_path(OsStr::new(library)).init() {
            Ok(nvml) => return Ok(Opened { nvml, library }),
            Err(error) => last = Some(error),
        }
    }
    Err(NvmlUnavailable {
        tried: LIB_CANDIDATES.join(", "),
        source: last.unwrap_or(NvmlError::Uninitialized),
    })
}

static ABSENT_LOGGED: AtomicBool = AtomicBool::new(false);

pub(crate) fn log_absent_once(error: &NvmlUnavailable) {
    if !ABSENT_LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(%error, "NVML not available: GPU state from NVML is off");
    }
}

/// Reads every device once.
pub(crate) fn read(nvml: &Nvml) -> Result<Vec<GpuSample>, NvmlError> {
    let count = nvml.device_count()?;
    let mut gpus = Vec::with_capacity(count as usize);
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        let utilization = device.utilization_rates().ok();
        let memory = device.memory_info().ok();
        gpus.push(GpuSample {
            gpu: index.to_string(),
            uuid: device.uuid().ok(),
            model_name: device.name().ok(),
            utilization: utilization
                .as_ref()
                .map(|u| clamp01(f64::from(u.gpu) / 100.0)),
            memory_used_bytes: memory.as_ref().map(|m| m.used),
            memory_total_bytes: memory.as_ref().map(|m| m.total),
            memory_bandwidth_utilization: utilization
                .as_ref()
                .map(|u| clamp01(f64::from(u.memory) / 100.0)),
            sm_active: None,
        });
    }
    sort_by_index(&mut gpus);
    Ok(gpus)
}

/// The polling thread's body: read, publish, sleep; exits when the handle is gone or stopped.
pub(crate) fn poll_loop(opened: Opened, weak: WeakGpu, interval: Duration) {
    let mut failing = false;
    loop {
        let Some(shared) = weak.upgrade() else { break };
        if shared.stopped() {
            break;
        }
        match read(&opened.nvml) {
            Ok(gpus) => {
                shared.cell.publish(gpus);
                if failing {
                    failing = false;
                    tracing::info!("GPU state (NVML) known again");
                }
            }
            Err(error) => {
                shared.cell.fail(format!("NVML read failed: {error}"));
                if !failing {
                    failing = true;
                    tracing::warn!(%error, "GPU state (NVML) unknown; retrying (repeats logged at debug)");
                } else {
                    tracing::debug!(%error, "GPU state (NVML) still unknown");
                }
            }
        }
        drop(shared);
        let deadline = Instant::now() + interval;
        loop {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            std::thread::park_timeout(deadline - now);
            match weak.upgrade() {
                Some(shared) if !shared.stopped() => {}
                _ => return,
            }
        }
    }
}

/// A one-paragraph description of what NVML finds on this machine: the library, driver and
/// CUDA versions, and per device its name, UUID, utilisation, memory-bandwidth proxy and
/// memory. Meant for a GPU check run by hand (`cargo run -p tokenscope-engine-state
/// --example gpu_probe`).
pub fn nvml_probe() -> String {
    let opened = match open() {
        Ok(opened) => opened,
        Err(error) => {
            return format!(
                "{error}. NVML-based GPU state is off on this machine (no NVIDIA driver \
                 library); GPU state can still come from a DCGM exporter URL."
            )
        }
    };
    let nvml = &opened.nvml;
    let driver = nvml
        .sys_driver_version()
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let nvml_version = nvml
        .sys_nvml_version()
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let cuda = nvml
        .sys_cuda_driver_version()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let mut text = format!(
        "NVML loaded from {} (driver {driver}, NVML {nvml_version}, CUDA driver API {cuda})",
        opened.library
    );
    match read(nvml) {
        Err(error) => text.push_str(&format!("; listing devices failed: {error}.")),
        Ok(gpus) if gpus.is_empty() => text.push_str("; it reports no devices."),
        Ok(gpus) => {
            text.push_str(&format!("; {} device(s): ", gpus.len()));
            let parts: Vec<String> = gpus.iter().map(describe).collect();
            text.push_str(&parts.join("; "));
            text.push_str(
                ". Memory-bandwidth utilisation here is NVML's utilization.memory (percent of \
                 time device memory was read or written), the closest NVML proxy; DCGM's \
                 DCGM_FI_PROF_DRAM_ACTIVE is the exact ratio.",
            );
        }
    }
    text
}

fn describe(g: &GpuSample) -> String {
    let pct = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{:.0}%", v * 100.0));
    let mib = |v: Option<u64>| {
        v.map_or_else(
            || "n/a".to_owned(),
            |v| format!("{} MiB", v / (1024 * 1024)),
        )
    };
    format!(
        "GPU {} {} ({}): utilisation {}, memory-bandwidth proxy {}, memory {} used of {}",
        g.gpu,
        g.model_name.as_deref().unwrap_or("unnamed"),
        g.uuid.as_deref().unwrap_or("no UUID"),
        pct(g.utilization),
        pct(g.memory_bandwidth_utilization),
        mib(g.memory_used_bytes),
        mib(g.memory_total_bytes),
    )
}
