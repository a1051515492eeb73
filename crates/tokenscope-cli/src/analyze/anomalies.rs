//! `tokenscope anomalies`.

use super::{CommonArgs, Input};
use anyhow::{bail, Result};
use clap::Args;

/// `tokenscope anomalies` options.
#[derive(Args, Debug)]
pub struct AnomaliesArgs {
    /// Store, window, format, config.
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Runs the command.
pub fn run(args: AnomaliesArgs) -> Result<()> {
    let _input = Input::load(&args.common)?;
    bail!("tokenscope anomalies is not built yet")
}
