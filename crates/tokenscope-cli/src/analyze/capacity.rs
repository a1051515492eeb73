//! `tokenscope capacity`: the load knee and the sustainable QPS from history (the window's
//! records) or from a load test's levels (`--from-bench FILE`), and with `--growth` the date
//! traffic reaches it (`tokenscope_analysis::capacity`).

use super::{CommonArgs, Input};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use tokenscope_analysis::capacity::{
    capacity_from_bench, capacity_from_history, BenchLevel, CapacityOptions, Growth,
};
use tokenscope_analysis::{Format, Report};

/// `tokenscope capacity` options.
#[derive(Args, Debug)]
pub struct CapacityArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Bucket length for QPS and P99 (history mode), e.g. 1m, 10s.
    #[arg(long, default_value = "1m")]
    pub interval: String,
    /// SLO on P99 TTFT (e.g. 2s, 800ms).
    #[arg(long, default_value = "2s")]
    pub slo_ttft_p99: String,
    /// Optional SLO on P99 TPOT (e.g. 50ms).
    #[arg(long)]
    pub slo_tpot_p99: Option<String>,
    /// QPS band width for pooling buckets [default: highest bucket QPS / 10].
    #[arg(long)]
    pub band: Option<f64>,
    /// Fewest requests for a band to be judged.
    #[arg(long, default_value_t = 20)]
    pub min_requests: usize,
    /// Traffic growth: e.g. 10%/month, 5%/week, 1%/day.
    #[arg(long)]
    pub growth: Option<String>,
    /// Current peak QPS (load-test mode; history mode uses the highest bucket QPS).
    #[arg(long)]
    pub current_qps: Option<f64>,
    /// Read a load test's levels (JSON array, see docs/analysis.md) instead of the store.
    #[arg(long)]
    pub from_bench: Option<PathBuf>,
}

fn ms(s: &str, flag: &str) -> Result<f64> {
    Ok(crate::duration::parse(s)
        .with_context(|| format!("{flag} {s:?}"))?
        .as_secs_f64()
        * 1000.0)
}

/// Runs the command.
pub fn run(args: CapacityArgs) -> Result<()> {
    let interval_us = (ms(&args.interval, "--interval")? * 1000.0).round() as i64;
    if interval_us <= 0 {
        anyhow::bail!("--interval must be positive");
    }
    let opts = CapacityOptions {
        interval_us,
        slo_ttft_p99_ms: ms(&args.slo_ttft_p99, "--slo-ttft-p99")?,
        slo_tpot_p99_ms: args
            .slo_tpot_p99
            .as_deref()
            .map(|s| ms(s, "--slo-tpot-p99"))
            .transpose()?,
        band_qps: args.band,
        min_requests: args.min_requests,
        growth: args
            .growth
            .as_deref()
            .map(str::parse::<Growth>)
            .transpose()?,
        current_qps: args.current_qps,
    };
    if let Some(path) = &args.from_bench {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let levels: Vec<BenchLevel> = serde_json::from_str(&text)
            .with_context(|| format!("{}: expected a JSON array of levels", path.display()))?;
        let format: Format = args.common.format;
        let report = capacity_from_bench(&levels, &opts, crate::now_us());
        print!("{}", report.render(format));
        return Ok(());
    }
    let input = Input::load(&args.common)?;
    let report = capacity_from_history(&input.records, input.window, &opts, input.now_us);
    print!("{}", report.render(input.format));
    Ok(())
}
