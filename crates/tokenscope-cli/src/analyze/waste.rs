//! `tokenscope waste`: duplicate and near-identical prompts, truncated and overlong outputs (suggested
//! `max_tokens` per request type), bloated prompts, total estimated saving (method in
//! `tokenscope_analysis::waste` and `docs/analysis.md`).

use super::{CommonArgs, Input};
use anyhow::Result;
use clap::Args;
use tokenscope_analysis::waste::{waste, WasteOptions};
use tokenscope_analysis::Report;

/// `tokenscope waste` options.
#[derive(Args, Debug)]
pub struct WasteArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Minimum requests of a request type for the output-length and bloat statistics.
    #[arg(long, default_value_t = 20)]
    pub min_samples: usize,
    /// An output is overlong above this many times its request type's median.
    #[arg(long, default_value_t = 4.0)]
    pub overlong_factor: f64,
    /// Bloated prompts: ln(input/output) above Q3 + max(k × IQR, ln 2).
    #[arg(long, default_value_t = 3.0)]
    pub bloat_iqr_k: f64,
    /// Duplicate prompts listed.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Near-identical prompts: similarity sketches at most this many bits apart (0–7; numbers
    /// and ids are masked, a one-word edit of a short prompt moves about 8).
    #[arg(long, default_value_t = 7)]
    pub near_max_distance: u32,
}

/// Runs the command.
pub fn run(args: WasteArgs) -> Result<()> {
    let input = Input::load(&args.common)?;
    let opts = WasteOptions {
        min_samples: args.min_samples,
        overlong_factor: args.overlong_factor,
        bloat_iqr_k: args.bloat_iqr_k,
        top: args.top,
        near_max_distance: args.near_max_distance,
    };
    opts.validate()?;
    let report = waste(&input.records, input.window, &input.prices(), &opts);
    print!("{}", report.render(input.format));
    Ok(())
}
