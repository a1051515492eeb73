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
//! * Rows are ordered by time bucket (with [`UsageQuery::interval_us`]), then labels, then
//!   model (byte order, `None` last), so output is deterministic.
//! * [`UsageQuery::filters`] are exact matches on usage dimensions ([`NONE_LABEL`] selects
//!   an unset value); a time bucket is `⌊created_at / interval⌋ · interval` (epoch-aligned,
//!   as the report's).
//! * The engine-state sums (running, waiting, KV usage at arrival) are fixed-point
//!   ([`exact_sum_units`], 2⁻³²), so their means are the same bits on every store too.

use std::collections::BTreeMap;

use crate::query::{exact_sum_units, Dimension, InvalidQuery, Window, NONE_LABEL};
use crate::RequestRecord;

/// `2⁴⁴`: the fixed-point scale of cost sums.
pub const COST_SCALE: f64 = 17_592_186_044_416.0;

/// The fixed-point units a cost sum adds per value: `⌊x·2⁴⁴ + ½⌋` (a float holding an
/// integer) — IEEE operations a SQL engine reproduces bit for bit (ClickHouse's
/// `floor(x * 17592186044416 + 0.5)`).
pub fn cost_units(x: f64) -> f64 {
    (x * COST_SCALE + 0.5).floor()
}

/// What to sum: the records of `window` passing `filters`, grouped by time bucket (with an
/// interval), by `group_by` (each one of [`USAGE_DIMENSIONS`], no repeats) and by model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    /// The window.
    pub window: Window,
    /// Grouping dimensions, in order (may be empty: one group per model).
    pub group_by: Vec<Dimension>,
    /// Time-bucket length in µs (epoch-aligned); `None` = the window is one bucket.
    pub interval_us: Option<i64>,
    /// Exact-match filters on usage dimensions, ANDed ([`NONE_LABEL`] selects unset).
    pub filters: Vec<(Dimension, String)>,
}

impl UsageQuery {
    /// The records of `window` grouped by `group_by` and model: no interval, no filter.
    pub fn new(window: Window, group_by: Vec<Dimension>) -> Self {
        Self {
            window,
            group_by,
            interval_us: None,
            filters: Vec::new(),
        }
    }

    /// Whether `r` passes the filters (the window is checked by the caller).
    pub fn matches(&self, r: &RequestRecord) -> bool {
        self.filters.iter().all(|(d, v)| match usage_label(*d, r) {
            Some(x) => x == v,
            None => v == NONE_LABEL,
        })
    }

    /// The bucket start of a `created_at` (µs), `None` without an interval.
    pub fn bucket_of(&self, created_at: i64) -> Option<i64> {
        self.interval_us
            .map(|iv| created_at.div_euclid(iv.max(1)) * iv.max(1))
    }
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
    for (d, _) in &q.filters {
        if !USAGE_DIMENSIONS.contains(d) {
            return Err(InvalidQuery(format!(
                "usage: cannot filter on {d} (use business_line, tenant, user, model or request_type)"
            )));
        }
    }
    if q.interval_us.is_some_and(|iv| iv <= 0) {
        return Err(InvalidQuery(
            "usage: interval must be at least 1 µs".to_owned(),
        ));
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
    /// Requests running in the engine at arrival (`engine_running`).
    pub engine_running: UnitSum,
    /// Requests waiting in the engine at arrival (`engine_waiting`).
    pub engine_waiting: UnitSum,
    /// KV-cache usage at arrival, 0–1 (`engine_kv_usage`).
    pub engine_kv_usage: UnitSum,
}

/// An order-independent sum of the known values of one column: their count and the sum of
/// their [`exact_sum_units`] (2⁻³²), so the mean is the same bits on every store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnitSum {
    /// Values (rows where the column is known and finite).
    pub n: u64,
    /// Σ [`exact_sum_units`] of the values.
    pub units: i128,
}

impl UnitSum {
    /// Adds a value (unknown or not finite: skipped).
    pub fn add(&mut self, v: Option<f64>) {
        if let Some(x) = v.filter(|x| x.is_finite()) {
            self.n += 1;
            self.units += exact_sum_units(x) as i128;
        }
    }

    /// Adds another sum.
    pub fn merge(&mut self, o: UnitSum) {
        self.n += o.n;
        self.units += o.units;
    }

    /// The mean, `None` without a value.
    pub fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.units as f64 / 4_294_967_296.0 / self.n as f64)
    }
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
        self.engine_running.add(r.engine_running);
        self.engine_waiting.add(r.engine_waiting);
        self.engine_kv_usage.add(r.engine_kv_usage);
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
        self.engine_running.merge(o.engine_running);
        self.engine_waiting.merge(o.engine_waiting);
        self.engine_kv_usage.merge(o.engine_kv_usage);
    }

    /// Σ stored `cost_usd` (from the fixed-point sum).
    pub fn stored_cost_usd(&self) -> f64 {
        self.stored_cost_units as f64 / COST_SCALE
    }
}

/// One (bucket, group, model) of a usage query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    /// Start of the time bucket (epoch µs), when the query has an interval.
    pub bucket_start_us: Option<i64>,
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

/// Sort key: bucket, labels with `None` last, then the model.
type Key = (Option<i64>, Vec<(bool, String)>, String);

/// Accumulates usage rows in one pass (per-group state only).
#[derive(Debug, Default)]
pub struct UsageAcc {
    by: Vec<Dimension>,
    groups: BTreeMap<Key, UsageSums>,
}

/// One stored row's values as a store's scan reads them (see [`UsageAcc::add_values`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageValues<'a> {
    /// Bucket start (epoch µs), with an interval.
    pub bucket_start_us: Option<i64>,
    /// The model.
    pub model: &'a str,
    /// `input_tokens`.
    pub input: Option<u64>,
    /// `cached_tokens`.
    pub cached: Option<u64>,
    /// `output_tokens`.
    pub output: Option<u64>,
    /// `cost_usd`.
    pub cost_usd: Option<f64>,
    /// `engine_running`.
    pub engine_running: Option<f64>,
    /// `engine_waiting`.
    pub engine_waiting: Option<f64>,
    /// `engine_kv_usage`.
    pub engine_kv_usage: Option<f64>,
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

    /// Adds a record in the bucket `bucket_start_us` (the caller checks the window and the
    /// filters).
    pub fn add(&mut self, r: &RequestRecord, bucket_start_us: Option<i64>) {
        let key: Vec<(bool, String)> = self
            .by
            .iter()
            .map(|d| match usage_label(*d, r) {
                Some(v) => (false, v.to_owned()),
                None => (true, String::new()),
            })
            .collect();
        self.add_sums(bucket_start_us, key, r.model.clone(), |s| s.add(r));
    }

    /// The grouping dimensions.
    pub fn dimensions(&self) -> &[Dimension] {
        &self.by
    }

    /// Adds one row's values: `labels` per grouping dimension, then the columns a store's
    /// scan reads.
    pub fn add_values(&mut self, labels: &[Option<&str>], v: UsageValues<'_>) {
        let key: Vec<(bool, String)> = labels
            .iter()
            .map(|l| match l {
                Some(v) => (false, (*v).to_owned()),
                None => (true, String::new()),
            })
            .collect();
        let r = RequestRecord {
            input_tokens: v.input,
            cached_tokens: v.cached,
            output_tokens: v.output,
            cost_usd: v.cost_usd,
            engine_running: v.engine_running,
            engine_waiting: v.engine_waiting,
            engine_kv_usage: v.engine_kv_usage,
            ..RequestRecord::default()
        };
        self.add_sums(v.bucket_start_us, key, v.model.to_owned(), |s| s.add(&r));
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
        self.add_sums(row.bucket_start_us, key, row.model, |s| s.merge(&row.sums));
    }

    fn add_sums(
        &mut self,
        bucket: Option<i64>,
        key: Vec<(bool, String)>,
        model: String,
        f: impl FnOnce(&mut UsageSums),
    ) {
        f(self.groups.entry((bucket, key, model)).or_default());
    }

    /// The rows, in order.
    pub fn finish(self) -> Vec<UsageRow> {
        self.groups
            .into_iter()
            .map(|((bucket_start_us, key, model), sums)| UsageRow {
                bucket_start_us,
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
    for r in records.iter().filter(|r| {
        r.created_at >= q.window.since_us && r.created_at < q.window.until_us && q.matches(r)
    }) {
        acc.add(r, q.bucket_of(r.created_at));
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
        let q = UsageQuery::new(Window::new(0, 100), vec![Dimension::BusinessLine]);
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
    fn buckets_filters_and_engine_means() {
        let mut recs: Vec<RequestRecord> = (0..6)
            .map(|i| {
                let mut r = rec(
                    &i.to_string(),
                    Some(if i % 2 == 0 { "a" } else { "b" }),
                    "m",
                    None,
                );
                r.created_at = i * 10;
                r.engine_running = Some(i as f64);
                r.engine_kv_usage = (i < 3).then_some(0.25);
                r
            })
            .collect();
        recs[5].business_line = None;
        let mut q = UsageQuery::new(Window::new(0, 60), vec![]);
        q.interval_us = Some(20);
        q.filters.push((Dimension::BusinessLine, "a".into()));
        let rows = usage_of(&recs, &q).expect("usage");
        // a: created 0, 20, 40 → one per bucket.
        let buckets: Vec<Option<i64>> = rows.iter().map(|r| r.bucket_start_us).collect();
        assert_eq!(buckets, [Some(0), Some(20), Some(40)]);
        assert_eq!(rows[1].sums.engine_running.mean(), Some(2.0));
        assert_eq!(rows[2].sums.engine_kv_usage.mean(), None);
        q.filters = vec![(Dimension::BusinessLine, NONE_LABEL.into())];
        q.interval_us = None;
        let rows = usage_of(&recs, &q).expect("usage");
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].sums.requests, 1);
        assert_eq!(rows[0].sums.engine_running.mean(), Some(5.0));
    }

    #[test]
    fn bad_queries() {
        let w = Window::new(0, 10);
        for by in [
            vec![Dimension::Stream],
            vec![Dimension::User, Dimension::User],
        ] {
            assert!(validate_usage(&UsageQuery::new(w, by)).is_err());
        }
        assert!(validate_usage(&UsageQuery::new(Window::new(5, 5), vec![])).is_err());
        let mut q = UsageQuery::new(w, vec![]);
        q.filters.push((Dimension::Stream, "true".into()));
        assert!(validate_usage(&q).is_err());
        let mut q = UsageQuery::new(w, vec![]);
        q.interval_us = Some(0);
        assert!(validate_usage(&q).is_err());
    }
}
