//! `tokenscope cost`: tokens and cost grouped by one or more dimensions, with shares of the
//! total and the trend against the previous window of the same length.
//!
//! Method:
//! * A record's cost is its stored `cost_usd` (priced by the gateway when the request
//!   finished) when present; otherwise it is computed from the current price table with
//!   [`PriceTable::costs`] over the records of the window (self-hosted models: the window's
//!   GPU cost spread over the tokens they served in the window). A record of a model with no
//!   price has no cost; its model is listed in `unpriced_models`.
//! * Tokens = input + output (cached tokens are part of input and shown separately).
//! * Groups are keyed by the values of the `--by` dimensions (missing → `"(none)"`); the
//!   previous window is grouped the same way and joined by key.
//! * Shares are fractions (0–1) of the window's totals; `change_pct` is
//!   `(current − previous) / previous × 100`, `null` when the previous value is 0.
//!
//! * Computed by the store: [`analyze_usage`] takes the store's sums per (group, model)
//!   (`RecordReader::usage`, aggregated in ClickHouse SQL or streamed from SQLite), so the
//!   process holds one row per group whatever the window's row count. Prices are linear in
//!   the tokens, so pricing a model's token sums equals pricing its records one by one (up to
//!   float rounding; the stored costs are summed exactly, in fixed point).
//!
//! Invariants: the groups partition the records (their sums are the totals); the order is
//! cost desc, tokens desc, then key asc, so the JSON is deterministic.

use crate::{csv_opt, AnalysisError, CsvRows, PriceTable, Report, Window};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use tokenscope_core::usage::{UsageAcc, UsageQuery, UsageRow};
use tokenscope_core::RequestRecord;

/// The grouping dimensions of `tokenscope cost` ([`DIMENSIONS`], a subset of the report's
/// [`Dimension`]s: the text dimensions that identify who or what spent the tokens).
pub use tokenscope_core::query::Dimension;

/// The dimensions `tokenscope cost` groups by.
pub const DIMENSIONS: [Dimension; 5] = [
    Dimension::BusinessLine,
    Dimension::Tenant,
    Dimension::User,
    Dimension::Model,
    Dimension::RequestType,
];

/// Parses a comma-separated list of cost dimensions (`business_line,model`): each of
/// [`DIMENSIONS`] by its name (`user_id` also names `user`), duplicates dropped, order kept.
pub fn parse_dimensions(s: &str) -> Result<Vec<Dimension>, AnalysisError> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let d = match part {
            "user_id" => Dimension::User,
            name => DIMENSIONS
                .into_iter()
                .find(|d| d.as_str() == name)
                .ok_or_else(|| {
                    AnalysisError::InvalidOption(format!(
                        "--by {name:?}: use business_line, tenant, user, model or request_type"
                    ))
                })?,
        };
        if !out.contains(&d) {
            out.push(d);
        }
    }
    if out.is_empty() {
        return Err(AnalysisError::InvalidOption("--by is empty".into()));
    }
    Ok(out)
}

/// The value of cost dimension `d` in `r` ([`NONE`] when unset; also for a dimension outside
/// [`DIMENSIONS`]).
pub fn dimension_value(d: Dimension, r: &RequestRecord) -> &str {
    tokenscope_core::usage::usage_label(d, r).unwrap_or(NONE)
}

/// The key value of an unset dimension.
pub const NONE: &str = tokenscope_core::query::NONE_LABEL;

/// Sums of one group (or of the whole window).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Usage {
    /// Requests.
    pub requests: u64,
    /// Input tokens (cached included).
    pub input_tokens: u64,
    /// Cached input tokens.
    pub cached_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Input + output tokens.
    pub tokens: u64,
    /// USD of the priced records.
    pub cost_usd: f64,
    /// Records with no cost (unpriced model).
    pub unpriced_requests: u64,
}

impl Usage {
    fn merge(&mut self, o: &Usage) {
        self.requests += o.requests;
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(o.cached_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.tokens = self.tokens.saturating_add(o.tokens);
        self.cost_usd += o.cost_usd;
        self.unpriced_requests += o.unpriced_requests;
    }
}

/// The trend of a group against the previous window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trend {
    /// Tokens in the previous window.
    pub previous_tokens: u64,
    /// USD in the previous window.
    pub previous_cost_usd: f64,
    /// Requests in the previous window.
    pub previous_requests: u64,
    /// Token change, percent (`null` when the previous window had none).
    pub tokens_change_pct: Option<f64>,
    /// Cost change, percent (`null` when the previous window cost nothing).
    pub cost_change_pct: Option<f64>,
}

fn change_pct(cur: f64, prev: f64) -> Option<f64> {
    (prev > 0.0).then(|| (cur - prev) / prev * 100.0)
}

impl Trend {
    fn of(cur: &Usage, prev: &Usage) -> Self {
        Self {
            previous_tokens: prev.tokens,
            previous_cost_usd: prev.cost_usd,
            previous_requests: prev.requests,
            tokens_change_pct: change_pct(cur.tokens as f64, prev.tokens as f64),
            cost_change_pct: change_pct(cur.cost_usd, prev.cost_usd),
        }
    }
}

/// One group of the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostGroup {
    /// Dimension name → value (one entry per `--by` dimension).
    pub key: BTreeMap<String, String>,
    /// Sums in the window.
    #[serde(flatten)]
    pub usage: Usage,
    /// Fraction of the window's tokens (0–1).
    pub token_share: f64,
    /// Fraction of the window's cost (0–1; 0 when nothing cost anything).
    pub cost_share: f64,
    /// Against the previous window.
    pub trend: Trend,
}

/// The `tokenscope cost` report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostReport {
    /// The analysed window.
    pub window: Window,
    /// The previous window (same length) used for trends.
    pub previous_window: Window,
    /// Grouping dimensions, in order.
    pub by: Vec<Dimension>,
    /// Groups: cost desc, tokens desc, key asc.
    pub groups: Vec<CostGroup>,
    /// Sums of the window.
    pub total: Usage,
    /// Trend of the totals.
    pub total_trend: Trend,
    /// Groups present only in the previous window (their key and previous usage).
    pub vanished: Vec<VanishedGroup>,
    /// Models of the window with no price (sorted).
    pub unpriced_models: Vec<String>,
    /// Records whose cost came from the stored `cost_usd` column.
    pub records_with_stored_cost: u64,
    /// Records whose cost was computed from the current price table.
    pub records_with_computed_cost: u64,
}

/// A group of the previous window absent from the current one.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VanishedGroup {
    /// Dimension name → value.
    pub key: BTreeMap<String, String>,
    /// Its usage in the previous window.
    pub previous: Usage,
}

/// Per-record costs: stored `cost_usd` first, else the price table (see the module docs).
/// Returns the costs and the number of stored ones.
pub fn record_costs(
    records: &[RequestRecord],
    prices: &PriceTable,
    window: Window,
) -> (Vec<Option<f64>>, u64) {
    let computed = prices.costs(records, window.seconds());
    let mut stored = 0;
    let costs = records
        .iter()
        .zip(computed)
        .map(|(r, c)| match r.cost_usd {
            Some(s) => {
                stored += 1;
                Some(s)
            }
            None => c,
        })
        .collect();
    (costs, stored)
}

fn key_map(by: &[Dimension], key: &[String]) -> BTreeMap<String, String> {
    by.iter()
        .zip(key)
        .map(|(d, v)| (d.as_str().to_owned(), v.clone()))
        .collect()
}

/// The `by` dimensions as a store usage query over `window`.
pub fn usage_query(by: &[Dimension], window: Window) -> UsageQuery {
    UsageQuery::new(window, by.to_vec())
}

/// Prices the usage rows of one window and folds them into groups keyed by their labels.
/// Returns the groups, the total, the unpriced models and the number of stored costs.
fn price_rows(
    rows: &[UsageRow],
    prices: &PriceTable,
    window: Window,
) -> (BTreeMap<Vec<String>, Usage>, Usage, BTreeSet<String>, u64) {
    // Tokens each model served in the window (for the self-hosted rate).
    let mut served: BTreeMap<&str, u64> = BTreeMap::new();
    for r in rows {
        *served.entry(r.model.as_str()).or_default() +=
            r.sums.input_tokens.saturating_add(r.sums.output_tokens);
    }
    let mut groups: BTreeMap<Vec<String>, Usage> = BTreeMap::new();
    let mut total = Usage::default();
    let mut unpriced_models = BTreeSet::new();
    let mut stored = 0;
    for r in rows {
        let s = &r.sums;
        let unpriced_n = s.requests - s.stored_cost_requests;
        let computed = if unpriced_n == 0 {
            Some(0.0)
        } else {
            prices.token_cost_of_sums(&r.model, s).or_else(|| {
                prices
                    .self_hosted_rate(
                        &r.model,
                        window.seconds(),
                        served.get(r.model.as_str()).copied().unwrap_or(0),
                    )
                    .map(|rate| {
                        rate * s
                            .unpriced_input_tokens
                            .saturating_add(s.unpriced_output_tokens)
                            as f64
                    })
            })
        };
        let u = Usage {
            requests: s.requests,
            input_tokens: s.input_tokens,
            cached_tokens: s.cached_tokens,
            output_tokens: s.output_tokens,
            tokens: s.input_tokens.saturating_add(s.output_tokens),
            cost_usd: s.stored_cost_usd() + computed.unwrap_or(0.0),
            unpriced_requests: if computed.is_some() { 0 } else { unpriced_n },
        };
        if computed.is_none() {
            unpriced_models.insert(r.model.clone());
        }
        stored += s.stored_cost_requests;
        let key: Vec<String> = r
            .labels
            .iter()
            .map(|l| l.clone().unwrap_or_else(|| NONE.to_owned()))
            .collect();
        groups.entry(key).or_default().merge(&u);
        total.merge(&u);
    }
    (groups, total, unpriced_models, stored)
}

/// Computes the report from records: `records` of `window`, `previous` of
/// `previous_window` (summed the way a store sums them, then [`analyze_usage`]).
pub fn analyze(
    records: &[RequestRecord],
    window: Window,
    previous: &[RequestRecord],
    previous_window: Window,
    prices: &PriceTable,
    by: &[Dimension],
) -> CostReport {
    let rows = |recs: &[RequestRecord], w: Window| {
        let mut acc = UsageAcc::new(&usage_query(by, w)).ok();
        for r in recs {
            if let Some(acc) = acc.as_mut() {
                acc.add(r, None);
            }
        }
        acc.map(UsageAcc::finish).unwrap_or_default()
    };
    analyze_usage(
        &rows(records, window),
        window,
        &rows(previous, previous_window),
        previous_window,
        prices,
        by,
    )
}

/// Computes the report from a store's usage rows ([`RecordReader::usage`] of
/// [`usage_query`]`(by, …)` for each window): per-group state only, whatever the row count.
///
/// [`RecordReader::usage`]: https://docs.rs/tokenscope-store
pub fn analyze_usage(
    rows: &[UsageRow],
    window: Window,
    previous: &[UsageRow],
    previous_window: Window,
    prices: &PriceTable,
    by: &[Dimension],
) -> CostReport {
    let (cur, total, unpriced_models, stored) = price_rows(rows, prices, window);
    let (mut prev, prev_total, _, _) = price_rows(previous, prices, previous_window);
    let share = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 0.0 };
    let mut groups: Vec<(Vec<String>, CostGroup)> = cur
        .into_iter()
        .map(|(key, usage)| {
            let p = prev.remove(&key).unwrap_or_default();
            let g = CostGroup {
                key: key_map(by, &key),
                token_share: share(usage.tokens as f64, total.tokens as f64),
                cost_share: share(usage.cost_usd, total.cost_usd),
                trend: Trend::of(&usage, &p),
                usage,
            };
            (key, g)
        })
        .collect();
    groups.sort_by(|(ka, a), (kb, b)| {
        b.usage
            .cost_usd
            .total_cmp(&a.usage.cost_usd)
            .then(b.usage.tokens.cmp(&a.usage.tokens))
            .then(ka.cmp(kb))
    });
    let vanished = prev
        .into_iter()
        .map(|(key, previous)| VanishedGroup {
            key: key_map(by, &key),
            previous,
        })
        .collect();
    CostReport {
        window,
        previous_window,
        by: by.to_vec(),
        groups: groups.into_iter().map(|(_, g)| g).collect(),
        total_trend: Trend::of(&total, &prev_total),
        records_with_computed_cost: total.requests - stored,
        total,
        vanished,
        unpriced_models: unpriced_models.into_iter().collect(),
        records_with_stored_cost: stored,
    }
}

fn pct(v: Option<f64>) -> String {
    match v {
        Some(v) => format!("{v:+.1}%"),
        None => "n/a".into(),
    }
}

impl CostReport {
    /// A group's key values in `--by` order (empty for a missing one).
    fn key_cells(&self, g: &CostGroup) -> Vec<String> {
        self.by
            .iter()
            .map(|d| g.key.get(d.as_str()).cloned().unwrap_or_default())
            .collect()
    }
}

impl Report for CostReport {
    fn render_table(&self) -> String {
        let mut header: Vec<&str> = self.by.iter().map(|d| d.as_str()).collect();
        header.extend([
            "requests",
            "input (tokens)",
            "cached (tokens)",
            "output (tokens)",
            "tokens",
            "token share (%)",
            "cost (USD)",
            "cost share (%)",
            "prev tokens",
            "Δ tokens (%)",
            "prev cost (USD)",
            "Δ cost (%)",
        ]);
        let mut t = crate::table(&header);
        let row = |key: Vec<String>, u: &Usage, ts: f64, cs: f64, tr: &Trend| {
            let mut cells = key;
            cells.extend([
                u.requests.to_string(),
                u.input_tokens.to_string(),
                u.cached_tokens.to_string(),
                u.output_tokens.to_string(),
                u.tokens.to_string(),
                format!("{:.1}%", ts * 100.0),
                format!("{:.4}", u.cost_usd),
                format!("{:.1}%", cs * 100.0),
                tr.previous_tokens.to_string(),
                pct(tr.tokens_change_pct),
                format!("{:.4}", tr.previous_cost_usd),
                pct(tr.cost_change_pct),
            ]);
            cells
        };
        for g in &self.groups {
            t.add_row(row(
                self.key_cells(g),
                &g.usage,
                g.token_share,
                g.cost_share,
                &g.trend,
            ));
        }
        let mut total_key = vec!["TOTAL".to_owned()];
        total_key.resize(self.by.len(), String::new());
        let (ts, cs) = (
            if self.total.tokens > 0 { 1.0 } else { 0.0 },
            if self.total.cost_usd > 0.0 { 1.0 } else { 0.0 },
        );
        t.add_row(row(total_key, &self.total, ts, cs, &self.total_trend));
        let mut out = format!(
            "Cost by {} over {:.0} s (previous window of the same length for Δ)\n{t}\n",
            self.by
                .iter()
                .map(|d| d.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            self.window.seconds()
        );
        if !self.unpriced_models.is_empty() {
            out.push_str(&format!(
                "Unpriced models (no [[prices]] entry; cost not counted): {}\n",
                self.unpriced_models.join(", ")
            ));
        }
        out.push_str(&format!(
            "Cost source: {} records priced at request time (cost_usd), {} from the current price table\n",
            self.records_with_stored_cost, self.records_with_computed_cost
        ));
        out
    }

    /// One row per group (no total row: the rows sum to it).
    fn csv_rows(&self) -> CsvRows {
        let mut header: Vec<&str> = self.by.iter().map(|d| d.as_str()).collect();
        header.extend([
            "requests",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "tokens",
            "token_share",
            "cost_usd",
            "cost_share",
            "previous_tokens",
            "tokens_change_pct",
            "previous_cost_usd",
            "cost_change_pct",
        ]);
        let mut out = CsvRows::new(&header);
        for g in &self.groups {
            let mut cells = self.key_cells(g);
            let (u, tr) = (&g.usage, &g.trend);
            cells.extend([
                u.requests.to_string(),
                u.input_tokens.to_string(),
                u.cached_tokens.to_string(),
                u.output_tokens.to_string(),
                u.tokens.to_string(),
                g.token_share.to_string(),
                u.cost_usd.to_string(),
                g.cost_share.to_string(),
                tr.previous_tokens.to_string(),
                csv_opt(tr.tokens_change_pct),
                tr.previous_cost_usd.to_string(),
                csv_opt(tr.cost_change_pct),
            ]);
            out.push(cells);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelPrice;

    fn rec(bl: Option<&str>, model: &str, input: u64, cached: u64, output: u64) -> RequestRecord {
        RequestRecord {
            business_line: bl.map(str::to_owned),
            model: model.into(),
            request_type: "chat".into(),
            input_tokens: Some(input),
            cached_tokens: Some(cached),
            output_tokens: Some(output),
            ..RequestRecord::default()
        }
    }

    fn prices() -> PriceTable {
        PriceTable::new(vec![ModelPrice {
            model: "gpt".into(),
            input_per_mtok: 2.0,
            cached_input_per_mtok: Some(1.0),
            output_per_mtok: 10.0,
            gpu_hourly_usd: None,
        }])
    }

    const W: Window = Window {
        since_us: 3_600_000_000,
        until_us: 7_200_000_000,
    };

    #[test]
    fn groups_shares_trend_and_order() {
        let mut stored = rec(Some("ads"), "gpt", 100, 0, 100);
        stored.cost_usd = Some(0.5);
        let cur = vec![
            // search: 1M input (0.5M cached) + 0.1M output = 1.0 + 0.5 + 1.0 = $2.5
            rec(Some("search"), "gpt", 1_000_000, 500_000, 100_000),
            // ads: stored cost wins over the table.
            stored,
            rec(None, "local", 10, 0, 10),
        ];
        let prev = vec![
            rec(Some("search"), "gpt", 500_000, 0, 50_000), // $1.5
            rec(Some("gone"), "gpt", 1, 0, 1),
        ];
        let r = analyze(
            &cur,
            W,
            &prev,
            W.previous(),
            &prices(),
            &[Dimension::BusinessLine],
        );
        let keys: Vec<&str> = r
            .groups
            .iter()
            .map(|g| g.key["business_line"].as_str())
            .collect();
        assert_eq!(keys, ["search", "ads", NONE]);
        let s = &r.groups[0];
        assert_eq!(s.usage.tokens, 1_100_000);
        assert!((s.usage.cost_usd - 2.5).abs() < 1e-12);
        assert!((s.cost_share - 2.5 / 3.0).abs() < 1e-12);
        assert!((s.token_share - 1_100_000.0 / 1_100_220.0).abs() < 1e-12);
        assert_eq!(s.trend.previous_tokens, 550_000);
        assert!((s.trend.tokens_change_pct.expect("prev") - 100.0).abs() < 1e-9);
        assert!((s.trend.cost_change_pct.expect("prev") - (2.5 / 1.5 - 1.0) * 100.0).abs() < 1e-9);
        assert!((r.groups[1].usage.cost_usd - 0.5).abs() < 1e-12);
        assert_eq!(r.groups[2].usage.unpriced_requests, 1);
        assert_eq!(r.groups[2].trend.tokens_change_pct, None);
        assert_eq!(r.unpriced_models, ["local"]);
        assert_eq!(r.total.requests, 3);
        assert!((r.total.cost_usd - 3.0).abs() < 1e-12);
        assert_eq!(r.records_with_stored_cost, 1);
        assert_eq!(r.records_with_computed_cost, 2);
        assert_eq!(r.vanished.len(), 1);
        assert_eq!(r.vanished[0].key["business_line"], "gone");
        // JSON is deterministic and the table renders.
        let a = r.render(crate::Format::Json);
        assert_eq!(
            a,
            analyze(
                &cur,
                W,
                &prev,
                W.previous(),
                &prices(),
                &[Dimension::BusinessLine]
            )
            .render(crate::Format::Json)
        );
        assert!(r.render_table().contains("TOTAL"));
    }

    #[test]
    fn nested_grouping_and_parse() {
        assert_eq!(
            parse_dimensions("business_line, model,model").expect("ok"),
            [Dimension::BusinessLine, Dimension::Model]
        );
        assert!(parse_dimensions("color").is_err());
        assert!(parse_dimensions("").is_err());
        let cur = vec![
            rec(Some("a"), "gpt", 10, 0, 0),
            rec(Some("a"), "x", 10, 0, 0),
            rec(Some("a"), "x", 10, 0, 0),
        ];
        let r = analyze(
            &cur,
            W,
            &[],
            W.previous(),
            &prices(),
            &[Dimension::BusinessLine, Dimension::Model],
        );
        assert_eq!(r.groups.len(), 2);
        // gpt costs something, so it is first even with fewer tokens.
        assert_eq!(r.groups[0].key["model"], "gpt");
        assert_eq!(r.groups[1].usage.requests, 2);
        assert_eq!(r.total_trend.tokens_change_pct, None);
    }

    proptest::proptest! {
        #[test]
        fn groups_partition_the_totals(
            rows in proptest::collection::vec((0u8..4, 0u64..1000, 0u64..1000), 0..60)
        ) {
            let recs: Vec<RequestRecord> = rows
                .iter()
                .map(|(b, i, o)| rec(Some(["a", "b", "c", "d"][*b as usize]), if b % 2 == 0 { "gpt" } else { "x" }, *i, 0, *o))
                .collect();
            let r = analyze(&recs, W, &[], W.previous(), &prices(), &[Dimension::BusinessLine]);
            let tokens: u64 = r.groups.iter().map(|g| g.usage.tokens).sum();
            let reqs: u64 = r.groups.iter().map(|g| g.usage.requests).sum();
            let cost: f64 = r.groups.iter().map(|g| g.usage.cost_usd).sum();
            proptest::prop_assert_eq!(tokens, r.total.tokens);
            proptest::prop_assert_eq!(reqs, recs.len() as u64);
            proptest::prop_assert!((cost - r.total.cost_usd).abs() < 1e-9);
            if r.total.tokens > 0 {
                let share: f64 = r.groups.iter().map(|g| g.token_share).sum();
                proptest::prop_assert!((share - 1.0).abs() < 1e-9);
            }
        }
    }
}
