//! Prints what NVML finds on this machine, then one GPU snapshot.
//!
//! ```text
//! cargo run -p tokenscope-engine-state --example gpu_probe                 # NVML
//! cargo run -p tokenscope-engine-state --example gpu_probe -- http://127.0.0.1:9400/metrics  # DCGM
//! ```
//!
//! Exit status: 0 when a snapshot was read or there is no GPU source at all (a CPU machine);
//! 1 when a source exists but no snapshot came within 5 s; 2 for a bad DCGM URL.

use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokenscope_engine_state::{nvml_probe, GpuConfig, GpuStateHandle, ScrapeConfig};

#[tokio::main]
async fn main() -> ExitCode {
    println!("{}", nvml_probe());
    let config = GpuConfig {
        dcgm_url: std::env::args().nth(1),
        nvml: true,
        scrape: ScrapeConfig {
            interval: Duration::from_millis(500),
            ..ScrapeConfig::default()
        },
    };
    let handle = match GpuStateHandle::spawn(&config) {
        Ok(Some(handle)) => handle,
        Ok(None) => {
            println!("No GPU source: NVML is unavailable and no DCGM exporter URL was given.");
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            eprintln!("gpu_probe: {error}");
            return ExitCode::from(2);
        }
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(snapshot) = handle.snapshot() {
            println!("Snapshot from {}:\n{snapshot:#?}", snapshot.source.as_str());
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "gpu_probe: no snapshot from {} within 5 s: {}",
        handle.source().as_str(),
        handle
            .last_error()
            .unwrap_or_else(|| "no error recorded".to_owned())
    );
    ExitCode::from(1)
}
