//! `tokenscope diagnose`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope diagnose` options.
#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: DiagnoseArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope diagnose is not built yet")
}
