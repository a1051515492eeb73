//! `tokenscope cost`: tokens and cost by business line, tenant, user, model or request type
//! over the window, with shares and the trend against the previous window of the same length
//! (see `tokenscope_analysis::cost` for the method).

use super::{CommonArgs, Input};
use anyhow::Result;
use clap::Args;
use tokenscope_analysis::cost::{analyze, parse_dimensions};
use tokenscope_analysis::Report;

/// `tokenscope cost` options.
#[derive(Args, Debug)]
pub struct CostArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Grouping: business_line, tenant, user, model, request_type, or a comma list for nested
    /// groups (e.g. `business_line,model`).
    #[arg(long, default_value = "business_line")]
    pub by: String,
}

/// Runs the command.
pub fn run(args: CostArgs) -> Result<()> {
    let by = parse_dimensions(&args.by)?;
    let input = Input::load(&args.common)?;
    let previous_window = input.window.previous();
    let previous = input.load_window(previous_window)?;
    let report = analyze(
        &input.records,
        input.window,
        &previous,
        previous_window,
        &input.prices(),
        &by,
    );
    print!("{}", report.render(input.format));
    Ok(())
}
