//! `tokenscope export …`: configuration for other systems (Prometheus alerting and recording
//! rules, Grafana dashboards). Thresholds come from `[alerts.thresholds]` of the gateway config
//! given with `--config` (else the defaults), so the exported rules, the dashboards (which read
//! the recorded series) and the gateway's own alerting agree.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::io::Write;
use std::path::PathBuf;

/// `tokenscope export` options.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Gateway config file whose `[alerts.thresholds]` set the thresholds (TOKENSCOPE_*
    /// environment overrides apply as for `serve`).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// What to export.
    #[command(subcommand)]
    pub what: ExportWhat,
}

/// Export targets.
#[derive(Subcommand, Debug)]
pub enum ExportWhat {
    /// Prometheus alerting and recording rules (YAML on stdout).
    PrometheusRules,
    /// Grafana dashboards: overview.json, performance.json, cost.json in `--out`, or one JSON
    /// array of the three on stdout without it (see docs/grafana.md).
    Grafana(super::grafana::GrafanaArgs),
}

/// Runs the command.
pub fn run(args: ExportArgs) -> Result<()> {
    match args.what {
        ExportWhat::PrometheusRules => {
            let cfg = tokenscope_config::GatewayConfig::load(args.config.as_deref())
                .context("loading the gateway config")?;
            let yaml = tokenscope_analysis::rules::prometheus_rules(&cfg.alerts.thresholds);
            let mut out = std::io::stdout().lock();
            out.write_all(yaml.as_bytes())
                .and_then(|()| out.flush())
                .context("writing the rules to stdout")?;
            Ok(())
        }
        ExportWhat::Grafana(g) => {
            let cfg = tokenscope_config::GatewayConfig::load(args.config.as_deref())
                .context("loading the gateway config")?;
            super::grafana::run(&g, &cfg.alerts.thresholds)
        }
    }
}
