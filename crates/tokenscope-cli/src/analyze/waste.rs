//! `tokenscope waste`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope waste` options.
#[derive(Args, Debug)]
pub struct WasteArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: WasteArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope waste is not built yet")
}
