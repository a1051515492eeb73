//! `tokenscope cost`: tokens and cost by business line, tenant, user, model or request type
//! over the window, with shares and the trend against the previous window of the same length
//! (see `tokenscope_analysis::cost` for the method).

use super::{CommonArgs, Input};
use crate::args::CostDimension;
use anyhow::Result;
use clap::Args;
use tokenscope_analysis::cost::{analyze_usage, usage_query, Dimension};
use tokenscope_analysis::Report;

/// `tokenscope cost` options.
#[derive(Args, Debug)]
pub struct CostArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Grouping, or a comma list for nested groups (e.g. `business_line,model`).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "business_line"
    )]
    pub by: Vec<CostDimension>,
}

/// Runs the command.
pub fn run(args: CostArgs) -> Result<()> {
    let mut by: Vec<Dimension> = Vec::with_capacity(args.by.len());
    for d in args.by.iter().map(|d| Dimension::from(*d)) {
        if !by.contains(&d) {
            by.push(d);
        }
    }
    // The store sums per (group, model): no record is loaded here, so memory does not grow
    // with the window's row count.
    let input = Input::open(&args.common)?;
    let previous_window = input.window.previous();
    let reader = super::reader(&input.store)?;
    let rows = reader.usage(&usage_query(&by, input.window))?;
    let previous = reader.usage(&usage_query(&by, previous_window))?;
    let report = analyze_usage(
        &rows,
        input.window,
        &previous,
        previous_window,
        &input.prices(),
        &by,
    );
    print!("{}", report.render(input.format));
    Ok(())
}
