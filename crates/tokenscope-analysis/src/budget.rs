//! `tokenscope budget`: token / USD budgets per business line, and growth that is not
//! explained by volume.
//!
//! Method:
//! * **Periods** are UTC calendar periods: `daily` = the UTC day containing "now", `monthly` =
//!   the UTC calendar month containing "now". "Now" is an argument (the CLI passes the end of
//!   its window, so `--until` evaluates a past moment).
//! * **Used** = the tokens (input + output) and cost of the business line's records with
//!   `period_start ≤ created_at < now`. Cost is the record's `cost_usd`, else the current price
//!   table ([`crate::cost::record_costs`]).
//! * **Budget**: explicit (`tokens`, `usd`, or both), or `auto = true`: baseline = mean daily
//!   usage of the business line over the 30 full UTC days before the period start (days
//!   without a request count as 0), budget = `auto_factor` (default 1.2) × baseline × days in
//!   the period. No history (baseline 0) → no budget, status `no_baseline`.
//! * **Ratio** = the larger of used/budget for tokens and for USD (each when budgeted).
//!   Status `ok` < 0.9 ≤ `warning` < 1.0 ≤ `exceeded` (the warning threshold is an option).
//! * **Projected exhaustion** (not yet exceeded): linear extrapolation of the period's rate so
//!   far, `period_start + elapsed × budget / used`; `null` when it falls after the period end
//!   or nothing was used. **Exhausted at** (exceeded): `created_at` of the record at which the
//!   cumulative usage reached the budget.
//! * **Growth check** (every business line seen in either window): the growth window (the
//!   CLI's `--since/--until`) against the previous window of the same length. Token growth
//!   `g_t` and request growth `g_r`, percent; `abnormal_growth` when `g_t ≥ min_token_growth_pct`
//!   (default 20) and `g_t ≥ factor × max(g_r, 0)` (default 1.5): tokens grow much faster than
//!   volume. When a business metric is given for the line (e.g. orders per window: the sums of
//!   the [`BusinessMetricPoint`]s sent to the gateway in each window, [`business_metric_sums`]),
//!   its growth replaces `g_r` as the volume. An empty previous window gives
//!   `insufficient_data`.
//!
//! Invariants: no clock and no I/O; outputs sorted (budgets by business line then period,
//! growth by business line), so the JSON is deterministic.

use crate::{
    csv_opt, serde_name, total_tokens, AnalysisError, CsvRows, PriceTable, Report, Window,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use tokenscope_core::RequestRecord;

use tokenscope_core::time::{self, format_rfc3339_seconds, DAY_US};

/// Budget period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// The UTC calendar day.
    #[default]
    Daily,
    /// The UTC calendar month.
    Monthly,
}

impl Period {
    /// `[start, end)` of the period containing `now_us`, epoch µs.
    pub fn bounds(self, now_us: i64) -> (i64, i64) {
        match self {
            Period::Daily => time::utc_day_bounds(now_us),
            Period::Monthly => time::utc_month_bounds(now_us),
        }
    }

    /// The name used in the config and the report.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Daily => "daily",
            Period::Monthly => "monthly",
        }
    }
}

/// One `[[budgets]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// The business line (the `x-tokenscope-business-line` value).
    pub business_line: String,
    /// `daily` or `monthly` (UTC calendar periods).
    #[serde(default)]
    pub period: Period,
    /// Token budget (input + output) per period.
    #[serde(default)]
    pub tokens: Option<u64>,
    /// USD budget per period.
    #[serde(default)]
    pub usd: Option<f64>,
    /// Automatic budget from the last 30 days (replaces `tokens` / `usd`).
    #[serde(default)]
    pub auto: bool,
    /// Automatic budget = this × mean daily baseline × days in period (default 1.2).
    #[serde(default)]
    pub auto_factor: Option<f64>,
}

impl BudgetConfig {
    /// Checks the entry (a business line, and a budget or `auto`).
    pub fn validate(&self) -> Result<(), AnalysisError> {
        if self.business_line.is_empty() {
            return Err(AnalysisError::InvalidOption(
                "[[budgets]]: business_line is empty".into(),
            ));
        }
        if !self.auto && self.tokens.is_none() && self.usd.is_none() {
            return Err(AnalysisError::InvalidOption(format!(
                "[[budgets]] {}: set tokens, usd, or auto = true",
                self.business_line
            )));
        }
        if self.usd.is_some_and(|u| u.is_nan() || u <= 0.0) || self.tokens == Some(0) {
            return Err(AnalysisError::InvalidOption(format!(
                "[[budgets]] {}: budgets must be positive",
                self.business_line
            )));
        }
        Ok(())
    }
}

/// Days of history an automatic budget averages.
pub const BASELINE_DAYS: i64 = 30;

/// Thresholds of the report.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetOptions {
    /// Ratio from which the status is `warning` (default 0.9).
    pub warning_ratio: f64,
    /// Token growth (percent) from which growth may be abnormal (default 20).
    pub min_token_growth_pct: f64,
    /// Token growth must be at least this × the volume growth (default 1.5).
    pub growth_factor: f64,
}

impl Default for BudgetOptions {
    fn default() -> Self {
        Self {
            warning_ratio: 0.9,
            min_token_growth_pct: 20.0,
            growth_factor: 1.5,
        }
    }
}

/// The records the CLI must load for `budgets` at `now_us`: from 30 days before the earliest
/// period start up to now.
pub fn history_window(budgets: &[BudgetConfig], now_us: i64) -> Window {
    let start = budgets
        .iter()
        .map(|b| b.period.bounds(now_us).0)
        .min()
        .unwrap_or(Period::Daily.bounds(now_us).0);
    Window {
        since_us: start - BASELINE_DAYS * DAY_US,
        until_us: now_us.max(start + 1),
    }
}

/// Budget status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Below the warning ratio.
    Ok,
    /// At or above the warning ratio.
    Warning,
    /// At or above the budget.
    Exceeded,
    /// An automatic budget without history.
    NoBaseline,
}

/// The automatic budget's evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Baseline {
    /// `[since, until)` of the baseline days.
    pub window: Window,
    /// Days averaged.
    pub days: i64,
    /// Mean tokens per day.
    pub mean_daily_tokens: f64,
    /// Mean USD per day.
    pub mean_daily_usd: f64,
    /// Budget factor applied.
    pub factor: f64,
}

/// One budget's state.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetStatus {
    /// Business line.
    pub business_line: String,
    /// Period kind.
    pub period: Period,
    /// Period start (µs) …
    pub period_start_us: i64,
    /// … and end (µs, exclusive).
    pub period_end_us: i64,
    /// Period start, ISO 8601 UTC.
    pub period_start: String,
    /// Period end, ISO 8601 UTC.
    pub period_end: String,
    /// Whether the budget is automatic.
    pub auto: bool,
    /// The automatic budget's baseline.
    pub baseline: Option<Baseline>,
    /// Token budget of the period.
    pub budget_tokens: Option<f64>,
    /// USD budget of the period.
    pub budget_usd: Option<f64>,
    /// Requests so far in the period.
    pub used_requests: u64,
    /// Tokens so far in the period.
    pub used_tokens: u64,
    /// USD so far in the period.
    pub used_usd: f64,
    /// used / budget for tokens.
    pub tokens_ratio: Option<f64>,
    /// used / budget for USD.
    pub usd_ratio: Option<f64>,
    /// The larger of the two ratios.
    pub ratio: Option<f64>,
    /// Status from `ratio`.
    pub status: Status,
    /// Linear projection of when the budget runs out this period (µs), if it does.
    pub projected_exhaustion_us: Option<i64>,
    /// The same, ISO 8601 UTC.
    pub projected_exhaustion: Option<String>,
    /// When an exceeded budget was reached (µs of the record that crossed it).
    pub exhausted_at_us: Option<i64>,
}

/// Growth status of a business line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GrowthStatus {
    /// Tokens grow with volume (or not enough to matter).
    Normal,
    /// Tokens grow much faster than volume.
    AbnormalGrowth,
    /// Nothing in the previous window.
    InsufficientData,
}

/// The growth check of one business line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GrowthCheck {
    /// Business line.
    pub business_line: String,
    /// Requests in the growth window.
    pub requests: u64,
    /// Requests in the previous window.
    pub previous_requests: u64,
    /// Tokens in the growth window.
    pub tokens: u64,
    /// Tokens in the previous window.
    pub previous_tokens: u64,
    /// Token growth, percent.
    pub token_growth_pct: Option<f64>,
    /// Request growth, percent.
    pub request_growth_pct: Option<f64>,
    /// Business-metric values (current, previous), when given.
    pub business_metric: Option<(f64, f64)>,
    /// Business-metric growth, percent.
    pub business_metric_growth_pct: Option<f64>,
    /// The volume growth compared against (business metric if given, else requests).
    pub volume_growth_pct: Option<f64>,
    /// Verdict.
    pub status: GrowthStatus,
}

/// An alert of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    /// Business line.
    pub business_line: String,
    /// `budget_warning`, `budget_exceeded` or `abnormal_growth`.
    pub kind: String,
    /// A sentence with the numbers.
    pub message: String,
}

/// The `tokenscope budget` report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetReport {
    /// "Now".
    pub now_us: i64,
    /// Thresholds used.
    pub options: BudgetOptions,
    /// Budgets, by business line then period.
    pub budgets: Vec<BudgetStatus>,
    /// Growth window.
    pub growth_window: Window,
    /// Previous window of the growth check.
    pub growth_previous_window: Window,
    /// Growth per business line.
    pub growth: Vec<GrowthCheck>,
    /// Alerts (budgets first, then growth), sorted by business line.
    pub alerts: Vec<Alert>,
}

/// The growth-check inputs.
#[derive(Debug, Clone, Copy)]
pub struct GrowthInput<'a> {
    /// The growth window…
    pub window: Window,
    /// …its records…
    pub current: &'a [RequestRecord],
    /// …and those of the previous window of the same length.
    pub previous: &'a [RequestRecord],
    /// Per business line: business-metric values (current window, previous window).
    pub business_metrics: &'a BTreeMap<String, (f64, f64)>,
}

fn bl(r: &RequestRecord) -> &str {
    r.business_line.as_deref().unwrap_or(crate::cost::NONE)
}

fn growth_pct(cur: f64, prev: f64) -> Option<f64> {
    (prev > 0.0).then(|| (cur - prev) / prev * 100.0)
}

/// Per-business-line growth verdicts (see the module docs).
pub fn growth_checks(g: &GrowthInput<'_>, opts: &BudgetOptions) -> Vec<GrowthCheck> {
    let mut sums: BTreeMap<&str, [u64; 4]> = BTreeMap::new();
    for r in g.current {
        let e = sums.entry(bl(r)).or_default();
        e[0] += 1;
        e[1] += total_tokens(r);
    }
    for r in g.previous {
        let e = sums.entry(bl(r)).or_default();
        e[2] += 1;
        e[3] += total_tokens(r);
    }
    sums.into_iter()
        .map(|(line, [req, tok, preq, ptok])| {
            let token_growth_pct = growth_pct(tok as f64, ptok as f64);
            let request_growth_pct = growth_pct(req as f64, preq as f64);
            let business_metric = g.business_metrics.get(line).copied();
            let business_metric_growth_pct = business_metric.and_then(|(c, p)| growth_pct(c, p));
            let volume_growth_pct = business_metric_growth_pct.or(request_growth_pct);
            let status = match (token_growth_pct, volume_growth_pct) {
                (Some(t), Some(v)) => {
                    if t >= opts.min_token_growth_pct && t >= opts.growth_factor * v.max(0.0) {
                        GrowthStatus::AbnormalGrowth
                    } else {
                        GrowthStatus::Normal
                    }
                }
                _ => GrowthStatus::InsufficientData,
            };
            GrowthCheck {
                business_line: line.to_owned(),
                requests: req,
                previous_requests: preq,
                tokens: tok,
                previous_tokens: ptok,
                token_growth_pct,
                request_growth_pct,
                business_metric,
                business_metric_growth_pct,
                volume_growth_pct,
                status,
            }
        })
        .collect()
}

/// Computes the report. `history` holds at least the records of [`history_window`] (records
/// outside a budget's period or baseline are ignored for it).
pub fn analyze(
    history: &[RequestRecord],
    history_window: Window,
    budgets: &[BudgetConfig],
    prices: &PriceTable,
    now_us: i64,
    growth: &GrowthInput<'_>,
    opts: &BudgetOptions,
) -> BudgetReport {
    let (costs, _) = crate::cost::record_costs(history, prices, history_window);
    let mut out: Vec<BudgetStatus> = budgets
        .iter()
        .map(|b| budget_status(history, &costs, b, now_us, opts))
        .collect();
    out.sort_by(|a, b| {
        a.business_line
            .cmp(&b.business_line)
            .then(a.period.cmp(&b.period))
    });
    let growth_checks = growth_checks(growth, opts);
    let mut alerts = Vec::new();
    for s in &out {
        let kind = match s.status {
            Status::Exceeded => "budget_exceeded",
            Status::Warning => "budget_warning",
            _ => continue,
        };
        alerts.push(Alert {
            business_line: s.business_line.clone(),
            kind: kind.to_owned(),
            message: format!(
                "{} budget of {} at {:.1}% (used {} tokens / {:.4} USD; budget {} tokens / {} USD; warning at {:.0}%)",
                s.period.as_str(),
                s.business_line,
                s.ratio.unwrap_or(0.0) * 100.0,
                s.used_tokens,
                s.used_usd,
                s.budget_tokens.map_or("-".into(), |t| format!("{t:.0}")),
                s.budget_usd.map_or("-".into(), |u| format!("{u:.4}")),
                opts.warning_ratio * 100.0
            ),
        });
    }
    for g in &growth_checks {
        if g.status == GrowthStatus::AbnormalGrowth {
            alerts.push(Alert {
                business_line: g.business_line.clone(),
                kind: "abnormal_growth".to_owned(),
                message: format!(
                    "tokens {:+.1}% ({} → {}) while {} {:+.1}% (thresholds: tokens ≥ {:.0}% and ≥ {:.2}× volume growth)",
                    g.token_growth_pct.unwrap_or(0.0),
                    g.previous_tokens,
                    g.tokens,
                    if g.business_metric_growth_pct.is_some() { "the business metric" } else { "requests" },
                    g.volume_growth_pct.unwrap_or(0.0),
                    opts.min_token_growth_pct,
                    opts.growth_factor
                ),
            });
        }
    }
    alerts.sort_by(|a, b| a.business_line.cmp(&b.business_line));
    BudgetReport {
        now_us,
        options: *opts,
        budgets: out,
        growth_window: growth.window,
        growth_previous_window: growth.window.previous(),
        growth: growth_checks,
        alerts,
    }
}

fn budget_status(
    history: &[RequestRecord],
    costs: &[Option<f64>],
    b: &BudgetConfig,
    now_us: i64,
    opts: &BudgetOptions,
) -> BudgetStatus {
    let (start, end) = b.period.bounds(now_us);
    let mine = || {
        history
            .iter()
            .zip(costs)
            .filter(move |(r, _)| r.business_line.as_deref() == Some(b.business_line.as_str()))
    };
    let baseline = b.auto.then(|| {
        let w = Window {
            since_us: start - BASELINE_DAYS * DAY_US,
            until_us: start,
        };
        let (mut tok, mut usd) = (0u64, 0.0);
        for (r, c) in mine().filter(|(r, _)| w.contains(r.created_at)) {
            tok += total_tokens(r);
            usd += c.unwrap_or(0.0);
        }
        Baseline {
            window: w,
            days: BASELINE_DAYS,
            mean_daily_tokens: tok as f64 / BASELINE_DAYS as f64,
            mean_daily_usd: usd / BASELINE_DAYS as f64,
            factor: b.auto_factor.unwrap_or(1.2),
        }
    });
    let days = ((end - start) / DAY_US) as f64;
    let (budget_tokens, budget_usd) = match &baseline {
        Some(bl) => (
            Some(bl.factor * bl.mean_daily_tokens * days).filter(|v| *v > 0.0),
            Some(bl.factor * bl.mean_daily_usd * days).filter(|v| *v > 0.0),
        ),
        None => (b.tokens.map(|t| t as f64), b.usd),
    };
    let (mut used_requests, mut used_tokens, mut used_usd) = (0u64, 0u64, 0.0);
    let mut exhausted_at_us = None;
    for (r, c) in mine().filter(|(r, _)| r.created_at >= start && r.created_at < now_us) {
        used_requests += 1;
        used_tokens += total_tokens(r);
        used_usd += c.unwrap_or(0.0);
        let crossed = budget_tokens.is_some_and(|t| used_tokens as f64 >= t)
            || budget_usd.is_some_and(|u| used_usd >= u);
        if crossed && exhausted_at_us.is_none() {
            exhausted_at_us = Some(r.created_at);
        }
    }
    let tokens_ratio = budget_tokens.map(|t| used_tokens as f64 / t);
    let usd_ratio = budget_usd.map(|u| used_usd / u);
    let ratio = match (tokens_ratio, usd_ratio) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let status = match ratio {
        None => Status::NoBaseline,
        Some(r) if r >= 1.0 => Status::Exceeded,
        Some(r) if r >= opts.warning_ratio => Status::Warning,
        Some(_) => Status::Ok,
    };
    let elapsed = (now_us.min(end) - start).max(0);
    let projected_exhaustion_us = match ratio {
        Some(r) if r > 0.0 && r < 1.0 => {
            let t = start + (elapsed as f64 / r).round() as i64;
            (t < end).then_some(t)
        }
        _ => None,
    };
    BudgetStatus {
        business_line: b.business_line.clone(),
        period: b.period,
        period_start_us: start,
        period_end_us: end,
        period_start: format_rfc3339_seconds(start),
        period_end: format_rfc3339_seconds(end),
        auto: b.auto,
        baseline,
        budget_tokens,
        budget_usd,
        used_requests,
        used_tokens,
        used_usd,
        tokens_ratio,
        usd_ratio,
        ratio,
        status,
        projected_exhaustion_us,
        projected_exhaustion: projected_exhaustion_us.map(format_rfc3339_seconds),
        exhausted_at_us: exhausted_at_us.filter(|_| status == Status::Exceeded),
    }
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:+.1}%"))
}

impl Report for BudgetReport {
    fn render_table(&self) -> String {
        let mut t = crate::table(&[
            "business line",
            "period",
            "start",
            "used tokens",
            "budget tokens",
            "used (USD)",
            "budget (USD)",
            "ratio (%)",
            "status",
            "projected exhaustion (UTC)",
        ]);
        for b in &self.budgets {
            t.add_row(vec![
                b.business_line.clone(),
                format!(
                    "{}{}",
                    b.period.as_str(),
                    if b.auto { " (auto)" } else { "" }
                ),
                b.period_start.clone(),
                b.used_tokens.to_string(),
                b.budget_tokens.map_or("-".into(), |v| format!("{v:.0}")),
                format!("{:.4}", b.used_usd),
                b.budget_usd.map_or("-".into(), |v| format!("{v:.4}")),
                b.ratio.map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
                format!("{:?}", b.status).to_lowercase(),
                match (b.exhausted_at_us, &b.projected_exhaustion) {
                    (Some(t), _) => format!("reached {}", format_rfc3339_seconds(t)),
                    (None, Some(p)) => p.clone(),
                    (None, None) => "-".into(),
                },
            ]);
        }
        let mut g = crate::table(&[
            "business line",
            "requests",
            "prev",
            "Δ requests (%)",
            "tokens",
            "prev",
            "Δ tokens (%)",
            "Δ business metric (%)",
            "growth",
        ]);
        for c in &self.growth {
            g.add_row(vec![
                c.business_line.clone(),
                c.requests.to_string(),
                c.previous_requests.to_string(),
                opt_pct(c.request_growth_pct),
                c.tokens.to_string(),
                c.previous_tokens.to_string(),
                opt_pct(c.token_growth_pct),
                opt_pct(c.business_metric_growth_pct),
                match c.status {
                    GrowthStatus::Normal => "normal",
                    GrowthStatus::AbnormalGrowth => "ABNORMAL",
                    GrowthStatus::InsufficientData => "insufficient data",
                }
                .to_owned(),
            ]);
        }
        let mut out = format!("Budgets at {}\n{t}\n", format_rfc3339_seconds(self.now_us));
        out.push_str(&format!(
            "Growth: {:.0} s window vs the previous one (abnormal: tokens ≥ {:.0}% and ≥ {:.2}× volume growth)\n{g}\n",
            self.growth_window.seconds(),
            self.options.min_token_growth_pct,
            self.options.growth_factor
        ));
        if self.alerts.is_empty() {
            out.push_str("No alerts.\n");
        }
        for a in &self.alerts {
            out.push_str(&format!(
                "ALERT {} [{}]: {}\n",
                a.kind, a.business_line, a.message
            ));
        }
        out
    }

    /// One row per budget (the growth checks are in the JSON form).
    fn csv_rows(&self) -> CsvRows {
        let mut out = CsvRows::new(&[
            "business_line",
            "period",
            "auto",
            "period_start",
            "period_end",
            "used_requests",
            "used_tokens",
            "budget_tokens",
            "used_usd",
            "budget_usd",
            "ratio",
            "status",
            "projected_exhaustion",
            "exhausted_at",
        ]);
        for b in &self.budgets {
            out.push(vec![
                b.business_line.clone(),
                b.period.as_str().to_owned(),
                b.auto.to_string(),
                b.period_start.clone(),
                b.period_end.clone(),
                b.used_requests.to_string(),
                b.used_tokens.to_string(),
                csv_opt(b.budget_tokens),
                b.used_usd.to_string(),
                csv_opt(b.budget_usd),
                csv_opt(b.ratio),
                serde_name(&b.status),
                b.projected_exhaustion.clone().unwrap_or_default(),
                csv_opt(b.exhausted_at_us.map(format_rfc3339_seconds)),
            ]);
        }
        out
    }
}

/// One business-metric value sent to the gateway (`POST /api/business-metrics`), e.g. the
/// orders of a business line over some interval; one JSON object per line of the sidecar file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BusinessMetricPoint {
    /// Business line.
    pub business_line: String,
    /// When the value was taken, epoch µs.
    pub at_us: i64,
    /// The value (a count, revenue…; summed per window).
    pub value: f64,
}

impl BusinessMetricPoint {
    /// Checks the point (a business line of 1–128 bytes, a finite value ≥ 0).
    pub fn validate(&self) -> Result<(), AnalysisError> {
        if self.business_line.is_empty() || self.business_line.len() > 128 {
            return Err(AnalysisError::InvalidOption(
                "business_line must have 1 to 128 bytes".into(),
            ));
        }
        if !self.value.is_finite() || self.value < 0.0 {
            return Err(AnalysisError::InvalidOption(
                "value must be a finite number ≥ 0".into(),
            ));
        }
        Ok(())
    }
}

/// Per business line: the sum of the points inside `window` and inside the previous window of
/// the same length (the growth check's business metric). Lines with no point in either are
/// absent.
pub fn business_metric_sums(
    points: &[BusinessMetricPoint],
    window: Window,
) -> BTreeMap<String, (f64, f64)> {
    let prev = window.previous();
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for p in points {
        if window.contains(p.at_us) {
            out.entry(p.business_line.clone()).or_default().0 += p.value;
        } else if prev.contains(p.at_us) {
            out.entry(p.business_line.clone()).or_default().1 += p.value;
        }
    }
    out
}

/// The business lines named by `budgets` (sorted, deduplicated).
pub fn business_lines(budgets: &[BudgetConfig]) -> BTreeSet<String> {
    budgets.iter().map(|b| b.business_line.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelPrice;

    // 2024-03-15T12:00:00Z
    const NOW: i64 = 1_710_504_000_000_000;
    const HOUR: i64 = 3_600_000_000;

    fn rec(bl: &str, t: i64, input: u64, output: u64) -> RequestRecord {
        RequestRecord {
            business_line: Some(bl.into()),
            created_at: t,
            model: "m".into(),
            input_tokens: Some(input),
            output_tokens: Some(output),
            ..RequestRecord::default()
        }
    }

    fn prices() -> PriceTable {
        // $1 per 1M input and output tokens: cost = tokens / 1e6.
        PriceTable::new(vec![ModelPrice {
            model: "m".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            ..ModelPrice::default()
        }])
    }

    fn no_growth<'a>(
        empty: &'a [RequestRecord],
        bm: &'a BTreeMap<String, (f64, f64)>,
    ) -> GrowthInput<'a> {
        GrowthInput {
            window: Window {
                since_us: NOW - HOUR,
                until_us: NOW,
            },
            current: empty,
            previous: empty,
            business_metrics: bm,
        }
    }

    #[test]
    fn calendar() {
        assert_eq!(format_rfc3339_seconds(NOW), "2024-03-15T12:00:00Z");
        let (s, e) = Period::Daily.bounds(NOW);
        assert_eq!(
            (format_rfc3339_seconds(s), format_rfc3339_seconds(e)),
            ("2024-03-15T00:00:00Z".into(), "2024-03-16T00:00:00Z".into())
        );
        let (s, e) = Period::Monthly.bounds(NOW);
        assert_eq!(
            (format_rfc3339_seconds(s), format_rfc3339_seconds(e)),
            ("2024-03-01T00:00:00Z".into(), "2024-04-01T00:00:00Z".into())
        );
        let dec = 1_703_980_800_000_000 + 5; // 2023-12-31
        let (s, e) = Period::Monthly.bounds(dec);
        assert_eq!(
            (format_rfc3339_seconds(s), format_rfc3339_seconds(e)),
            ("2023-12-01T00:00:00Z".into(), "2024-01-01T00:00:00Z".into())
        );
    }

    proptest::proptest! {
        #[test]
        fn periods_contain_now(t in -4_000_000_000_000_000i64..4_000_000_000_000_000) {
            for p in [Period::Daily, Period::Monthly] {
                let (s, e) = p.bounds(t);
                proptest::prop_assert!(s <= t && t < e);
                proptest::prop_assert_eq!(s.rem_euclid(DAY_US), 0);
            }
        }
    }

    #[test]
    fn explicit_budget_warning_and_projection() {
        let (start, _) = Period::Daily.bounds(NOW);
        // 12 h into the day, 950 tokens used of 1 000 → warning; at this rate the budget runs
        // out at 12 h × 1000/950 = 12.631… h.
        let hist = vec![
            rec("search", start + HOUR, 400, 100),
            rec("search", start + 11 * HOUR, 400, 50),
            rec("search", start - HOUR, 10_000, 0), // yesterday: not counted
            rec("ads", start + HOUR, 10, 10),
        ];
        let budgets = [BudgetConfig {
            business_line: "search".into(),
            tokens: Some(1_000),
            ..BudgetConfig::default()
        }];
        let bm = BTreeMap::new();
        let w = history_window(&budgets, NOW);
        let r = analyze(
            &hist,
            w,
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        let b = &r.budgets[0];
        assert_eq!(b.used_tokens, 950);
        assert_eq!(b.used_requests, 2);
        assert!((b.ratio.expect("ratio") - 0.95).abs() < 1e-12);
        assert_eq!(b.status, Status::Warning);
        let want = start + (12.0 * HOUR as f64 / 0.95).round() as i64;
        assert_eq!(b.projected_exhaustion_us, Some(want));
        assert_eq!(
            b.projected_exhaustion.as_deref(),
            Some("2024-03-15T12:37:53Z")
        );
        assert_eq!(r.alerts.len(), 1);
        assert_eq!(r.alerts[0].kind, "budget_warning");
        // A slower rate runs past the end of the day: no projection.
        let budgets = [BudgetConfig {
            business_line: "search".into(),
            tokens: Some(10_000),
            usd: Some(1.0),
            ..BudgetConfig::default()
        }];
        let r = analyze(
            &hist,
            w,
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        assert_eq!(r.budgets[0].status, Status::Ok);
        assert_eq!(r.budgets[0].projected_exhaustion_us, None);
        assert!((r.budgets[0].usd_ratio.expect("usd") - 0.000_95).abs() < 1e-12);
        assert!(r.alerts.is_empty());
    }

    #[test]
    fn exceeded_reports_when() {
        let (start, _) = Period::Monthly.bounds(NOW);
        let hist = vec![
            rec("a", start + HOUR, 600, 0),
            rec("a", start + 2 * HOUR, 600, 0),
            rec("a", start + 3 * HOUR, 600, 0),
        ];
        let budgets = [BudgetConfig {
            business_line: "a".into(),
            period: Period::Monthly,
            tokens: Some(1_000),
            ..BudgetConfig::default()
        }];
        let bm = BTreeMap::new();
        let r = analyze(
            &hist,
            history_window(&budgets, NOW),
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        let b = &r.budgets[0];
        assert_eq!(b.status, Status::Exceeded);
        assert!((b.ratio.expect("r") - 1.8).abs() < 1e-12);
        assert_eq!(b.exhausted_at_us, Some(start + 2 * HOUR));
        assert_eq!(b.projected_exhaustion_us, None);
        assert_eq!(r.alerts[0].kind, "budget_exceeded");
    }

    #[test]
    fn auto_budget_from_thirty_days() {
        let (start, end) = Period::Daily.bounds(NOW);
        // 30 days of history: 3 000 tokens per day on days −30…−1, plus one day too old.
        let mut hist: Vec<RequestRecord> = (1..=30)
            .map(|d| rec("s", start - d * DAY_US + HOUR, 2_000, 1_000))
            .collect();
        hist.push(rec("s", start - 31 * DAY_US, 1_000_000, 0));
        // Today so far: 1 800 tokens.
        hist.push(rec("s", start + HOUR, 1_000, 800));
        hist.sort_by_key(|r| r.created_at);
        let budgets = [BudgetConfig {
            business_line: "s".into(),
            auto: true,
            ..BudgetConfig::default()
        }];
        let bm = BTreeMap::new();
        let r = analyze(
            &hist,
            history_window(&budgets, NOW),
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        let b = &r.budgets[0];
        let base = b.baseline.as_ref().expect("baseline");
        assert!((base.mean_daily_tokens - 3_000.0).abs() < 1e-9);
        assert!((base.mean_daily_usd - 0.003).abs() < 1e-12);
        assert!((b.budget_tokens.expect("t") - 3_600.0).abs() < 1e-9);
        assert!((b.budget_usd.expect("u") - 0.0036).abs() < 1e-12);
        assert!((b.ratio.expect("r") - 0.5).abs() < 1e-9);
        assert_eq!(b.status, Status::Ok);
        // 12 h for half the budget: runs out exactly at the end of the day → not this period.
        assert_eq!(b.projected_exhaustion_us, None);
        assert_eq!(b.period_end_us, end);
        // Monthly auto: 3 000 × 1.2 × 31 days of March.
        let budgets = [BudgetConfig {
            business_line: "s".into(),
            period: Period::Monthly,
            auto: true,
            ..BudgetConfig::default()
        }];
        let (mstart, _) = Period::Monthly.bounds(NOW);
        let hist: Vec<RequestRecord> = (1..=30)
            .map(|d| rec("s", mstart - d * DAY_US, 3_000, 0))
            .rev()
            .collect();
        let r = analyze(
            &hist,
            history_window(&budgets, NOW),
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        assert!((r.budgets[0].budget_tokens.expect("t") - 3_000.0 * 1.2 * 31.0).abs() < 1e-6);
        // No history at all: no baseline.
        let r = analyze(
            &[],
            history_window(&budgets, NOW),
            &budgets,
            &prices(),
            NOW,
            &no_growth(&[], &bm),
            &BudgetOptions::default(),
        );
        assert_eq!(r.budgets[0].status, Status::NoBaseline);
    }

    fn load(bl: &str, n: usize, tokens_each: u64, t0: i64) -> Vec<RequestRecord> {
        (0..n)
            .map(|i| rec(bl, t0 + i as i64, tokens_each, 0))
            .collect()
    }

    #[test]
    fn growth_quiet_vs_abnormal() {
        let w = Window {
            since_us: NOW - HOUR,
            until_us: NOW,
        };
        let p = w.previous();
        // quiet: +20 % requests and +20 % tokens; abnormal: same requests, +50 % tokens each;
        // small: +10 % tokens with flat volume (below the 20 % floor).
        let mut cur = load("quiet", 120, 100, w.since_us);
        cur.extend(load("abnormal", 100, 150, w.since_us));
        cur.extend(load("small", 100, 110, w.since_us));
        cur.extend(load("new", 5, 1, w.since_us));
        let mut prev = load("quiet", 100, 100, p.since_us);
        prev.extend(load("abnormal", 100, 100, p.since_us));
        prev.extend(load("small", 100, 100, p.since_us));
        let bm = BTreeMap::new();
        let g = GrowthInput {
            window: w,
            current: &cur,
            previous: &prev,
            business_metrics: &bm,
        };
        let r = analyze(&[], w, &[], &prices(), NOW, &g, &BudgetOptions::default());
        let by: BTreeMap<&str, &GrowthCheck> = r
            .growth
            .iter()
            .map(|c| (c.business_line.as_str(), c))
            .collect();
        assert_eq!(by["quiet"].status, GrowthStatus::Normal);
        assert!((by["quiet"].token_growth_pct.expect("t") - 20.0).abs() < 1e-9);
        assert!((by["quiet"].request_growth_pct.expect("r") - 20.0).abs() < 1e-9);
        assert_eq!(by["abnormal"].status, GrowthStatus::AbnormalGrowth);
        assert!((by["abnormal"].token_growth_pct.expect("t") - 50.0).abs() < 1e-9);
        assert_eq!(by["small"].status, GrowthStatus::Normal);
        assert_eq!(by["new"].status, GrowthStatus::InsufficientData);
        assert_eq!(r.alerts.len(), 1);
        assert_eq!(r.alerts[0].business_line, "abnormal");
        // A business metric that grew 50 % too explains the abnormal line's tokens.
        let bm: BTreeMap<String, (f64, f64)> = [("abnormal".to_owned(), (150.0, 100.0))].into();
        let g = GrowthInput {
            business_metrics: &bm,
            ..g
        };
        let r = analyze(&[], w, &[], &prices(), NOW, &g, &BudgetOptions::default());
        assert!(r.alerts.is_empty());
        let a = r
            .growth
            .iter()
            .find(|c| c.business_line == "abnormal")
            .expect("line");
        assert!((a.volume_growth_pct.expect("v") - 50.0).abs() < 1e-9);
        assert!(r.render_table().contains("No alerts."));
    }

    #[test]
    fn business_metric_window_sums() {
        let w = Window {
            since_us: 100,
            until_us: 200,
        };
        let pt = |bl: &str, at_us: i64, value: f64| BusinessMetricPoint {
            business_line: bl.into(),
            at_us,
            value,
        };
        let pts = [
            pt("a", 150, 2.0),
            pt("a", 199, 3.0),
            pt("a", 0, 4.0),
            pt("a", -1, 100.0),
            pt("a", 99, 1.5),
            pt("b", 200, 9.0),
            pt("c", 20, 1.0),
        ];
        let s = business_metric_sums(&pts, w);
        assert_eq!(s["a"], (5.0, 5.5)); // [100, 200) and [0, 100)
        assert_eq!(s["c"], (0.0, 1.0));
        assert!(!s.contains_key("b"));
        assert!(pt("", 0, 1.0).validate().is_err());
        assert!(pt("x", 0, f64::NAN).validate().is_err());
        assert!(pt("x", 0, 1.0).validate().is_ok());
    }

    #[test]
    fn config_validation() {
        let ok = BudgetConfig {
            business_line: "x".into(),
            usd: Some(5.0),
            ..BudgetConfig::default()
        };
        assert!(ok.validate().is_ok());
        assert!(BudgetConfig {
            business_line: "x".into(),
            ..BudgetConfig::default()
        }
        .validate()
        .is_err());
        assert!(BudgetConfig {
            business_line: "x".into(),
            tokens: Some(0),
            ..BudgetConfig::default()
        }
        .validate()
        .is_err());
        let parsed: BudgetConfig =
            serde_json::from_str(r#"{"business_line":"x","period":"monthly","auto":true}"#)
                .expect("parse");
        assert_eq!(parsed.period, Period::Monthly);
    }
}
