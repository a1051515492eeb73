//! `tokenscope diagnose`: loads the window, walks the decision tree
//! (`tokenscope_analysis::diagnose`), prints the steps, the conclusion and the remedies.
//!
//! Exit status: 0 whatever the verdicts, unless `--fail-on-problem` is given; then
//! [`PROBLEM_EXIT`] (3) when a step's verdict is `problem` (success rate, TTFT, TPOT, tokens or
//! network beyond its threshold). `unknown` steps (data missing) and `ok` ones exit 0. Errors
//! (no store, bad window) exit 1 and bad flags 2, as for every command.

use super::{CommonArgs, Input};
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use tokenscope_analysis::diagnose::{diagnose, DiagnoseOptions};
use tokenscope_analysis::Report;

/// `tokenscope diagnose` options.
#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Success rate below this is a problem (0–1).
    #[arg(long, default_value_t = 0.99)]
    pub min_success_rate: f64,
    /// P99 TTFT above this is a problem (e.g. 2s, 800ms).
    #[arg(long, default_value = "2s")]
    pub ttft_p99: String,
    /// P99 TPOT above this is a problem (e.g. 50ms).
    #[arg(long, default_value = "50ms")]
    pub tpot_p99: String,
    /// Queue share of TTFT at or above this means queueing (0–1).
    #[arg(long, default_value_t = 0.5)]
    pub queue_share: f64,
    /// …when the mean engine queue per request is at least this long (e.g. 10ms).
    #[arg(long, default_value = "10ms")]
    pub queue_min: String,
    /// Short requests beside long prefills / alone, P50 TTFT ratio meaning starvation.
    #[arg(long, default_value_t = 2.0)]
    pub starvation_ratio: f64,
    /// Fewest samples per compared group (starvation check, token trend).
    #[arg(long, default_value_t = 10)]
    pub min_samples: usize,
    /// KV-cache usage P90 at or above this is "near full" (0–1).
    #[arg(long, default_value_t = 0.9)]
    pub kv_high: f64,
    /// Running requests (P50 at arrival) at or below this is a small batch.
    #[arg(long, default_value_t = 4.0)]
    pub small_batch: f64,
    /// The most requests the engine may run at once as configured (vLLM max_num_seqs,
    /// llama.cpp -np). Without it the largest batch seen in the window stands in.
    #[arg(long)]
    pub max_batch: Option<f64>,
    /// A request's TTFT is dominated by time the engine did not account for when that time is
    /// at least this share of it (0–1)…
    #[arg(long, default_value_t = 0.5)]
    pub unaccounted_share: f64,
    /// …and at least this long.
    #[arg(long, default_value = "100ms")]
    pub unaccounted_min: String,
    /// Fewest such requests for the `unaccounted_wait` finding.
    #[arg(long, default_value_t = 3)]
    pub unaccounted_min_requests: usize,
    /// P99 gateway overhead above this is a problem.
    #[arg(long, default_value = "50ms")]
    pub gateway_overhead_p99: String,
    /// P99 upstream connect/transfer time above this is a problem.
    #[arg(long, default_value = "500ms")]
    pub network_p99: String,
    /// Exit with status 3 when a step's verdict is `problem` (after printing the report);
    /// `ok` and `unknown` (data missing) steps exit 0.
    #[arg(long)]
    pub fail_on_problem: bool,
}

/// Exit status of `--fail-on-problem` when a problem is found (1 is an error, 2 a bad flag).
pub const PROBLEM_EXIT: i32 = 3;

fn ms(s: &str, flag: &str) -> Result<f64> {
    Ok(crate::duration::parse(s)
        .with_context(|| format!("{flag} {s:?}"))?
        .as_secs_f64()
        * 1000.0)
}

/// Runs the command.
pub fn run(args: DiagnoseArgs) -> Result<()> {
    let opts = DiagnoseOptions {
        min_success_rate: args.min_success_rate,
        ttft_p99_ms: ms(&args.ttft_p99, "--ttft-p99")?,
        tpot_p99_ms: ms(&args.tpot_p99, "--tpot-p99")?,
        queue_share: args.queue_share,
        queue_min_ms: ms(&args.queue_min, "--queue-min")?,
        starvation_ratio: args.starvation_ratio,
        min_samples: args.min_samples,
        kv_high: args.kv_high,
        small_batch: args.small_batch,
        max_batch: args.max_batch,
        gateway_overhead_p99_ms: ms(&args.gateway_overhead_p99, "--gateway-overhead-p99")?,
        network_p99_ms: ms(&args.network_p99, "--network-p99")?,
        unaccounted_share: args.unaccounted_share,
        unaccounted_min_ms: ms(&args.unaccounted_min, "--unaccounted-min")?,
        unaccounted_min_requests: args.unaccounted_min_requests,
        ..DiagnoseOptions::default()
    };
    let input = Input::load(&args.common)?;
    let report = diagnose(&input.records, input.window, &opts);
    print!("{}", report.render(input.format));
    if args.fail_on_problem && report.has_problem() {
        std::io::stdout().flush().context("writing the report")?;
        std::process::exit(PROBLEM_EXIT);
    }
    Ok(())
}
