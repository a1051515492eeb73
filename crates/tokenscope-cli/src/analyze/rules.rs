//! `tokenscope export …`: configuration for other systems (Prometheus alerting and recording
//! rules).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};

/// `tokenscope export` options.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// What to export.
    #[command(subcommand)]
    pub what: ExportWhat,
}

/// Export targets.
#[derive(Subcommand, Debug)]
pub enum ExportWhat {
    /// Prometheus alerting and recording rules (YAML on stdout).
    PrometheusRules,
}

/// Runs the command.
pub fn run(args: ExportArgs) -> Result<()> {
    match args.what {
        ExportWhat::PrometheusRules => bail!("tokenscope export prometheus-rules is not built yet"),
    }
}
