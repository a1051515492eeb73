//! `tokenscope export grafana [--out DIR]`: the three Grafana dashboards of
//! `tokenscope_analysis::grafana`, as `overview.json`, `performance.json` and `cost.json` in
//! `DIR` (created if missing; existing files of those names are replaced), or as one JSON array
//! of the three dashboards on stdout without `--out`.

use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use tokenscope_analysis::alerts::AlertThresholds;
use tokenscope_analysis::grafana::dashboards;

/// `tokenscope export grafana` options.
#[derive(Args, Debug)]
pub struct GrafanaArgs {
    /// Directory to write overview.json, performance.json and cost.json to (without it: one
    /// JSON array of the three dashboards on stdout).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Writes the dashboards.
pub fn run(args: &GrafanaArgs, thresholds: &AlertThresholds) -> Result<()> {
    let all = dashboards(thresholds);
    match &args.out {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            for d in &all {
                let path = dir.join(d.file_name);
                let mut text = serde_json::to_string_pretty(&d.dashboard)
                    .context("serialising a dashboard")?;
                text.push('\n');
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("{}", path.display());
            }
        }
        None => {
            let array: Vec<&serde_json::Value> = all.iter().map(|d| &d.dashboard).collect();
            let mut text =
                serde_json::to_string_pretty(&array).context("serialising the dashboards")?;
            text.push('\n');
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .context("writing the dashboards to stdout")?;
        }
    }
    Ok(())
}
