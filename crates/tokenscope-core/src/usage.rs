//! Token and cost sums per group, computed by the store: the input of `tokenscope cost` (and
//! anything else that only needs sums), without loading a window's records into the process.
//!
//! A [`UsageQuery`] names a window and the text dimensions to group by; the store returns one
//! [`UsageRow`] per (group, model) — the model is always part of the key, because a record
//! without a stored `cost_usd` is priced by its model (`tokenscope_analysis::PriceTable`),
//! and prices are linear in the token sums, so per-model sums price exactly what per-record
//! pricing would (up to float rounding, the same on every store).
//!
//! Invariants (every store):
//! * The rows partition the window's records: their `requests` add up to the records of
//!   `[since, until)`, each request once (its newest version).
//! * Sums are integers, and the stored-cost sum is the fixed-point sum of [`cost_units`]
//!   (`⌊x·2⁴⁴ + ½⌋` per value: 6·10⁻¹⁴ USD, exact for costs up to 5·10⁵ USD a request), so
//!   the same records give the same rows, bit for bit, on every store and in any row order.
//! * The caller's memory is one row per (group, model): the embedded store streams its rows
//!   through [`UsageAcc`] (one pass, the needed columns only); ClickHouse aggregates in SQL
//!   (`tokenscope_clickhouse::clickhouse_usage`).
//! * Rows are ordered by labels then model (byte order, `None` last), so output is
//!   deterministic.

use std::collections::BTreeMap;

use crate::query::{Dimension, InvalidQuery, Window};
use crate::RequestRecord;

/// `2⁴⁴`: the fixed-point scale of cost sums.
pub const COST_SCALE: f64 = 17_592_186_044_416.0;

/// The fixed-point units a cost sum adds per value: `⌊x·2⁴⁴ + ½⌋` (a float holding an
/// integer) — IEEE operations a SQL engine reproduces bit for bit (ClickHouse's
/// `floor(x * 17592186044416 + 0.5)`).
pub fn cost_units(x: f64) -> f64 {
    (x * COST_SCALE + 0.5).floor()
}

/// What to sum: the records of `window`, grouped by `group_by` (each one of
/// [`USAGE_DIMENSIONS`], no repeats) and by model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    /// The window.
    pub window: Window,
    /// Grouping dimensions, in order (may be empty: one group per model).
    pub group_by: Vec<Dimension>,
}

/// The dimensions a usage query may group by (the text columns that say who or what spent).
pub const USAGE_DIMENSIONS: [Dimension; 5] = [
    Dimension::BusinessLine,
    Dimension::Tenant,
    Dimension::User,
    Dimension::Model,
    Dimension::RequestType,
];

/// Checks a usage query.
pub fn validate_usage(q: &UsageQuery) -> Result<(), InvalidQuery> {
    if q.window.until_us <= q.window.since_us {
        return Err(InvalidQuery("usage: until must be after since".to_owned()));
    }
    for (i, d) in q.group_by.iter().enumerate() {
        if !USAGE_DIMENSIONS.contains(d) {
            return Err(InvalidQuery(format!(
                "usage: cannot group by {d} (use business_line, tenant, user, model or request_type)"
            )));
        }
        if q.group_by[..i].contains(d) {
            return Err(InvalidQuery(format!("usage: {d} twice")));
        }
    }
    Ok(())
}

/// Sums of one (group, model).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageSums {
    /// Requests.
    pub requests: u64,
    /// Σ input tokens (unknown = 0).
    pub input_tokens: u64,
    /// Σ cached tokens.
    pub cached_tokens: u64,
    /// Σ output tokens.
    pub output_tokens: u64,
    /// Requests with a stored `cost_usd`.
    pub stored_cost_requests: u64,
    /// Σ [`cost_units`] of their `cost_usd`.
    pub stored_cost_units: i128,
    /// Of the requests without a stored cost: Σ input tokens.
    pub unpriced_input_tokens: u64,
    /// Of those: Σ min(cached, input) (the cached part a price table charges).
    pub unpriced_cached_within_input: u64,
    /// Of those: Σ output tokens.
    pub unpriced_output_tokens: u64,
}

impl UsageSums {
    /// Adds one record.
    pub fn add(&mut self, r: &RequestRecord) {
        let input = r.input_tokens.unwrap_or(0);
        let cached = r.cached_tokens.unwrap_or(0);
        let output = r.output_tokens.unwrap_or(0);
        self.requests += 1;
        self.input_tokens = self.input_tokens.saturating_add(input);
        self.cached_tokens = self.cached_tokens.saturating_add(cached);
        self.output_tokens = self.output_tokens.saturating_add(output);
        match r.cost_usd {
            Some(c) if c.is_finite() => {
                self.stored_cost_requests += 1;
                self.stored_cost_units += cost_units(c) as i128;
            }
            Some(_) => self.stored_cost_requests += 1,
            None => {
                self.unpriced_input_tokens = self.unpriced_input_tokens.saturating_add(input);
                self.unpriced_cached_within_input = self
                    .unpriced_cached_within_input
                    .saturating_add(cached.min(input));
                self.unpriced_output_tokens = self.unpriced_output_tokens.saturating_add(output);
            }
        }
    }

    /// Adds another group's sums.
    pub fn merge(&mut self, o: &UsageSums) {
        self.requests += o.requests;
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(o.cached_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.stored_cost_requests += o.stored_cost_requests;
        self.stored_cost_units += o.stored_cost_units;
        self.unpriced_input_tokens = self
            .unpriced_input_tokens
            .saturating_add(o.unpriced_input_tokens);
        self.unpriced_cached_within_input = self
            .unpriced_cached_within_input
            .saturating_add(o.unpriced_cached_within_input);
        self.unpriced_output_tokens = self
            .unpriced_output_tokens
            .saturating_add(o.unpriced_output_tokens);
    }

    /// Σ stored `cost_usd` (from the fixed-point sum).
    pub fn stored_cost_usd(&self) -> f64 {
        self.stored_cost_units as f64 / COST_SCALE
    }
}

/// One (group, model) of a usage query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    /// Value per `group_by` dimension, in order (`None` when unset).
    pub labels: Vec<Option<String>>,
    /// The model.
    pub model: String,
    /// Its sums.
    pub sums: UsageSums,
}

/// The value of a usage dimension in a record (`None` when unset).
pub fn usage_label(d: Dimension, r: &RequestRecord) -> Option<&str> {
    match d {
        Dimension::BusinessLine => r.business_line.as_deref(),
        Dimension::Tenant => r.tenant.as_deref(),
        Dimension::User => r.user_id.as_deref(),
        Dimension::Model => Some(r.model.as_str()),
        Dimension::RequestType => Some(r.request_type.as_str()),
        _ => None,
    }
}

/// Sort key: labels with `None` last, then the model.
type Key = (Vec<(bool, String)>, String);

/// Accumulates usage rows in one pass (per-group state only).
#[derive(Debug, Default)]
pub struct UsageAcc {
    by: Vec<Dimension>,
    groups: BTreeMap<Key, UsageSums>,
}

impl UsageAcc {
    /// An accumulator for `q` (validated).
    pub fn new(q: &UsageQuery) -> Result<Self, InvalidQuery> {
        validate_usage(q)?;
        Ok(Self {
            by: q.group_by.clone(),
            groups: BTreeMap::new(),
        })
    }

    /// Adds a record (the caller filters the window).
    pub fn add(&mut self, r: &RequestRecord) {
        let key: Vec<(bool, String)> = self
            .by
            .iter()
            .map(|d| match usage_label(*d, r) {
                Some(v) => (false, v.to_owned()),
                None => (true, String::new()),
            })
            .collect();
        self.add_sums(key, r.model.clone(), |s| s.add(r));
    }

    /// The grouping dimensions.
    pub fn dimensions(&self) -> &[Dimension] {
        &self.by
    }

    /// Adds one row's values: `labels` per grouping dimension, then the model and the token
    /// and cost columns (what a store's scan reads).
    pub fn add_values(
        &mut self,
        labels: &[Option<&str>],
        model: &str,
        input: Option<u64>,
        cached: Option<u64>,
        output: Option<u64>,
        cost_usd: Option<f64>,
    ) {
        let key: Vec<(bool, String)> = labels
            .iter()
            .map(|l| match l {
                Some(v) => (false, (*v).to_owned()),
                None => (true, String::new()),
            })
            .collect();
        let r = RequestRecord {
            input_tokens: input,
            cached_tokens: cached,
            output_tokens: output,
            cost_usd,
            ..RequestRecord::default()
        };
        self.add_sums(key, model.to_owned(), |s| s.add(&r));
    }

    /// Adds pre-aggregated sums for labels and model.
    pub fn add_row(&mut self, row: UsageRow) {
        let key = row
            .labels
            .into_iter()
            .map(|l| match l {
                Some(v) => (false, v),
                None => (true, String::new()),
            })
            .collect();
        self.add_sums(key, row.model, |s| s.merge(&row.sums));
    }

    fn add_sums(
        &mut self,
        key: Vec<(bool, String)>,
        model: String,
        f: impl FnOnce(&mut UsageSums),
    ) {
        f(self.groups.entry((key, model)).or_default());
    }

    /// The rows, in order.
    pub fn finish(self) -> Vec<UsageRow> {
        self.groups
            .into_iter()
            .map(|((key, model), sums)| UsageRow {
                labels: key
                    .into_iter()
                    .map(|(none, v)| (!none).then_some(v))
                    .collect(),
                model,
                sums,
            })
            .collect()
    }
}

/// Usage rows of `records` (those inside the window) — what every store returns for them.
pub fn usage_of(records: &[RequestRecord], q: &UsageQuery) -> Result<Vec<UsageRow>, InvalidQuery> {
    let mut acc = UsageAcc::new(q)?;
    for r in records
        .iter()
        .filter(|r| r.created_at >= q.window.since_us && r.created_at < q.window.until_us)
    {
        acc.add(r);
    }
    Ok(acc.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, bl: Option<&str>, model: &str, cost: Option<f64>) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            created_at: 10,
            business_line: bl.map(str::to_owned),
            model: model.to_owned(),
            input_tokens: Some(100),
            cached_tokens: Some(150),
            output_tokens: Some(7),
            cost_usd: cost,
            ..RequestRecord::default()
        }
    }

    #[test]
    fn sums_partition_and_order() {
        let q = UsageQuery {
            window: Window::new(0, 100),
            group_by: vec![Dimension::BusinessLine],
        };
        let mut late = rec("z", Some("a"), "m", None);
        late.created_at = 100;
        let recs = [
            rec("1", None, "m", Some(0.5)),
            rec("2", Some("b"), "m", None),
            rec("3", Some("a"), "n", Some(0.25)),
            rec("4", Some("a"), "m", None),
            rec("5", Some("a"), "m", Some(1.0)),
            late,
        ];
        let rows = usage_of(&recs, &q).expect("usage");
        let keys: Vec<(Option<&str>, &str)> = rows
            .iter()
            .map(|r| (r.labels[0].as_deref(), r.model.as_str()))
            .collect();
        assert_eq!(
            keys,
            [
                (Some("a"), "m"),
                (Some("a"), "n"),
                (Some("b"), "m"),
                (None, "m")
            ]
        );
        let am = &rows[0].sums;
        assert_eq!(am.requests, 2);
        assert_eq!(am.stored_cost_requests, 1);
        assert_eq!(am.stored_cost_usd(), 1.0);
        assert_eq!(am.unpriced_input_tokens, 100);
        assert_eq!(
            am.unpriced_cached_within_input, 100,
            "cached clamped to input"
        );
        assert_eq!(am.cached_tokens, 300);
        assert_eq!(rows.iter().map(|r| r.sums.requests).sum::<u64>(), 5);
        // Merging the rows again gives the same rows.
        let mut acc = UsageAcc::new(&q).expect("acc");
        for r in rows.clone() {
            acc.add_row(r);
        }
        assert_eq!(acc.finish(), rows);
    }

    #[test]
    fn bad_queries() {
        let w = Window::new(0, 10);
        for by in [
            vec![Dimension::Stream],
            vec![Dimension::User, Dimension::User],
        ] {
            assert!(validate_usage(&UsageQuery {
                window: w,
                group_by: by
            })
            .is_err());
        }
        assert!(validate_usage(&UsageQuery {
            window: Window::new(5, 5),
            group_by: vec![]
        })
        .is_err());
    }
}
