//! `tokenscope cost`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope cost` options.
#[derive(Args, Debug)]
pub struct CostArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: CostArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope cost is not built yet")
}
