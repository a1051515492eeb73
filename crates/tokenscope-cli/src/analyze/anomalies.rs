//! `tokenscope anomalies`: token-rate spikes per caller, request loops, duplicate bursts and
//! sudden drops (method in `tokenscope_analysis::anomalies` and `docs/analysis.md`).

use super::{CommonArgs, Input};
use crate::args::BaselineMode;
use anyhow::{bail, Context, Result};
use clap::Args;
use tokenscope_analysis::anomalies::{anomalies, AnomalyOptions, Baseline};
use tokenscope_analysis::{Report, Window};

/// `tokenscope anomalies` options.
#[derive(Args, Debug)]
pub struct AnomaliesArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Bucket length (e.g. 1s, 1m; default: window / 60, at least 1 s).
    #[arg(long)]
    pub bucket: Option<String>,
    /// Baseline of the spike and drop rules.
    #[arg(long, value_enum, default_value = "prior")]
    pub baseline: BaselineMode,
    /// Number of windows of the same length before the analysed one used as baseline.
    #[arg(long, default_value_t = 6)]
    pub baseline_windows: u32,
    /// A bucket is a spike at this many times the caller's baseline median (and above the
    /// MAD rule and the floor).
    #[arg(long, default_value_t = 3.0)]
    pub spike_factor: f64,
    /// MAD multiplier of the spike rule: median + k × 1.4826 × MAD.
    #[arg(long, default_value_t = 6.0)]
    pub mad_k: f64,
    /// Minimum tokens in a bucket for a spike.
    #[arg(long, default_value_t = 1000)]
    pub min_spike_tokens: u64,
    /// Loop: minimum requests of one caller with one prompt hash.
    #[arg(long, default_value_t = 5)]
    pub loop_min_requests: usize,
    /// Loop: maximum coefficient of variation of the intervals.
    #[arg(long, default_value_t = 0.1)]
    pub loop_max_cv: f64,
    /// Burst: minimum requests with one prompt hash within --burst-span.
    #[arg(long, default_value_t = 10)]
    pub burst_min_requests: usize,
    /// Burst: span (e.g. 5m).
    #[arg(long, default_value = "5m")]
    pub burst_span: String,
    /// Drop: a bucket below this fraction of the baseline median requests.
    #[arg(long, default_value_t = 0.5)]
    pub drop_fraction: f64,
    /// Drop: at least this many consecutive low buckets.
    #[arg(long, default_value_t = 3)]
    pub drop_buckets: usize,
}

fn micros(s: &str, what: &str) -> Result<i64> {
    let d = crate::duration::parse(s).with_context(|| format!("{what} {s:?}"))?;
    Ok(d.as_micros() as i64)
}

/// Runs the command.
pub fn run(args: AnomaliesArgs) -> Result<()> {
    let input = Input::load(&args.common)?;
    let opts = AnomalyOptions {
        bucket_us: args
            .bucket
            .as_deref()
            .map(|b| micros(b, "--bucket"))
            .transpose()?,
        spike_factor: args.spike_factor,
        mad_k: args.mad_k,
        min_spike_tokens: args.min_spike_tokens,
        loop_min_requests: args.loop_min_requests,
        loop_max_cv: args.loop_max_cv,
        burst_min_requests: args.burst_min_requests,
        burst_span_us: micros(&args.burst_span, "--burst-span")?,
        drop_fraction: args.drop_fraction,
        drop_min_buckets: args.drop_buckets,
        ..AnomalyOptions::default()
    };
    let w = input.window;
    let prior;
    let baseline = match args.baseline {
        BaselineMode::Window => Baseline::FirstHalf,
        BaselineMode::Prior => {
            if args.baseline_windows == 0 {
                bail!("--baseline-windows must be at least 1");
            }
            let len = w.until_us - w.since_us;
            let bw = Window {
                since_us: w.since_us - len * i64::from(args.baseline_windows),
                until_us: w.since_us,
            };
            prior = (bw, input.load_window(bw)?);
            Baseline::Prior {
                window: prior.0,
                records: &prior.1,
            }
        }
    };
    let report = anomalies(&input.records, w, baseline, &opts)?;
    print!("{}", report.render(input.format));
    Ok(())
}
