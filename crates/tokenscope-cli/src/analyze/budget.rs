//! `tokenscope budget`: the `[[budgets]]` of the config at "now" (the end of the window:
//! `--until`, default now), and the growth check over `--since/--until` against the previous
//! window of the same length (see `tokenscope_analysis::budget` for the method). The budget
//! periods themselves are UTC calendar periods containing "now", whatever `--since` says;
//! the records of the periods and of their 30-day baselines are loaded separately.

use super::{CommonArgs, Input};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use tokenscope_analysis::budget::{
    analyze, business_metric_sums, history_window, BudgetOptions, BusinessMetricPoint, GrowthInput,
};
use tokenscope_analysis::Report;

/// `tokenscope budget` options.
#[derive(Args, Debug)]
pub struct BudgetArgs {
    /// Store, window (the growth check's; "now" = its end), format, config (`[[budgets]]`).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Ratio of the budget from which the status is `warning`.
    #[arg(long, default_value_t = 0.9)]
    pub warning_ratio: f64,
    /// Token growth (percent) from which growth can be abnormal.
    #[arg(long, default_value_t = 20.0)]
    pub min_token_growth_pct: f64,
    /// Abnormal when token growth ≥ this × the volume (request or business-metric) growth.
    #[arg(long, default_value_t = 1.5)]
    pub growth_factor: f64,
    /// A business metric per business line for the growth check, `LINE=CURRENT:PREVIOUS`
    /// (values of the window and of the previous one, e.g. orders); repeatable. Its growth
    /// replaces the request growth as the volume for that line.
    #[arg(long = "business-metric")]
    pub business_metric: Vec<String>,
    /// The business-metric file written by the gateway's `POST /api/business-metrics` (JSON
    /// lines); default: the store's sidecar (`<store>.business-metrics.jsonl`, or
    /// `./tokenscope-business-metrics.jsonl` for ClickHouse) when it exists. Values are summed
    /// per window; `--business-metric` overrides a line.
    #[arg(long)]
    pub business_metrics: Option<std::path::PathBuf>,
}

/// Business-metric points of `path` (missing default file → none).
fn read_points(path: &std::path::Path, explicit: bool) -> Result<Vec<BusinessMetricPoint>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow!("reading {}: {e}", path.display())),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{} line {}: not a business-metric point",
                    path.display(),
                    i + 1
                )
            })
        })
        .collect()
}

fn parse_metric(s: &str) -> Result<(String, (f64, f64))> {
    let err = || anyhow!("--business-metric {s:?}: use LINE=CURRENT:PREVIOUS");
    let (line, vals) = s.split_once('=').ok_or_else(err)?;
    let (c, p) = vals.split_once(':').ok_or_else(err)?;
    Ok((
        line.to_owned(),
        (
            c.trim().parse().map_err(|_| err())?,
            p.trim().parse().map_err(|_| err())?,
        ),
    ))
}

/// Runs the command.
pub fn run(args: BudgetArgs) -> Result<()> {
    let flags: BTreeMap<String, (f64, f64)> = args
        .business_metric
        .iter()
        .map(|s| parse_metric(s))
        .collect::<Result<_>>()?;
    let input = Input::load(&args.common)?;
    let (path, explicit) = match &args.business_metrics {
        Some(p) => (p.clone(), true),
        None => (
            tokenscope_backend::StoreTarget::parse(&input.store).business_metrics_path(),
            false,
        ),
    };
    let mut metrics = business_metric_sums(&read_points(&path, explicit)?, input.window);
    metrics.extend(flags);
    let budgets = &input.config.budgets;
    let history_w = history_window(budgets, input.now_us);
    let history = input.load_window(history_w)?;
    let previous = input.load_window(input.window.previous())?;
    let opts = BudgetOptions {
        warning_ratio: args.warning_ratio,
        min_token_growth_pct: args.min_token_growth_pct,
        growth_factor: args.growth_factor,
    };
    let report = analyze(
        &history,
        history_w,
        budgets,
        &input.prices(),
        input.now_us,
        &GrowthInput {
            window: input.window,
            current: &input.records,
            previous: &previous,
            business_metrics: &metrics,
        },
        &opts,
    );
    print!("{}", report.render(input.format));
    Ok(())
}
