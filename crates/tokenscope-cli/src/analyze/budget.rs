//! `tokenscope budget`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope budget` options.
#[derive(Args, Debug)]
pub struct BudgetArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: BudgetArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope budget is not built yet")
}
