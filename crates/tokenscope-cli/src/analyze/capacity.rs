//! `tokenscope capacity`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope capacity` options.
#[derive(Args, Debug)]
pub struct CapacityArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: CapacityArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope capacity is not built yet")
}
