//! The read side on ClickHouse: reports aggregated by ClickHouse itself, and [`RecordReader`]
//! for [`ClickHouseStore`].
//!
//! [`ClickHouseStore::report`] runs [`clickhouse_aggregate`]: one `GROUP BY` over the report's
//! time range and filters (read with `FINAL`, so a retried or re-inserted row counts once)
//! that returns **one row per group** — counts, the success classes, per metric its value
//! count, exact quantiles and the fixed-point sum of its mean, the queue-share sums and the
//! token sums. [`tokenscope_store::finish_groups`] then orders the groups and computes rates
//! exactly as the embedded store does, so the same records give the same report, bit for bit,
//! on both stores (the parity tests hold this), while the process that asked holds one small
//! struct per group whatever the row count.
//!
//! ## Exact quantiles in SQL
//!
//! The report's percentiles are nearest-rank: `P(q) = x_k`, `k = ⌈q·n⌉` (1-based).
//! ClickHouse's `quantilesExact(level)` returns the 0-based element `⌊level·n⌋` of the sorted
//! values (every version from 18.16 to 26.x; the tests check it on both). With
//! `level = q − 10⁻¹²` that is `⌈q·n⌉ − 1` for every `n < 10⁹`: when `q·n` is an integer `m`
//! the product is just under `m`; otherwise (for the report's levels its fractional part is
//! at least 0.01) it stays above `⌊q·n⌋`. No approximate quantile is used anywhere.
//!
//! ## Means bit for bit
//!
//! The embedded store sums each value as the integer `⌊x·2³² + ½⌋`
//! ([`tokenscope_store::exact_sum_units`]), so a mean does not depend on row order. The SQL
//! sums the same integers, split into a high and a low part (`intDiv` by 2³² and the
//! remainder) so that `Int64` never overflows (old servers have no `Int128`), and the reader
//! adds them back in `i128`.
//!
//! Invariants:
//! * Memory of the caller is one [`GroupAgg`] per result row; the result is streamed.
//! * A field that does not decode (a schema drift) fails the report with a clear error; it is
//!   never silently read as `NULL`.
//! * Every literal in the SQL is a number or a [`ch_string`] (escaped); dimension names map to
//!   fixed column names ([`Dimension::column`]), never to user text.
//! * The filters have the embedded store's semantics ([`filter_value`]); band dimensions use
//!   the same half-open bands ([`tokenscope_store::report::KV_BANDS`]).

use tokenscope_core::query::Window;
use tokenscope_core::success::SQL_CLASS;
use tokenscope_core::RequestRecord;
use tokenscope_store::report::{filter_value, validate};
use tokenscope_store::{
    finish_groups, mean_of_units, Dimension, FilterValue, GroupAgg, Quantiles, RecordReader,
    ReportQuery, ReportRow, UnitSum, UsageAcc, UsageQuery, UsageRow, UsageSums,
};
use tokenscope_store::{ErrorClass, StoreError};

use crate::{ClickHouseError, ClickHouseStore};

/// The metric columns of a report, in [`GroupAgg`] order.
const METRIC_COLUMNS: [&str; 7] = [
    "ttft_ms",
    "tpot_ms",
    "total_duration_ms",
    "queue_duration_ms",
    "prefill_duration_ms",
    "decode_duration_ms",
    "ttft_unaccounted_ms",
];

/// `quantilesExact` levels giving the nearest-rank P50, P90, P95, P99 (see the module docs).
const EXACT_LEVELS: &str = "0.499999999999, 0.899999999999, 0.949999999999, 0.989999999999";

/// The report query as one ClickHouse aggregation over `table` (see the module docs): one
/// result row per (time bucket, group), the columns [`decode_group`] reads.
pub fn clickhouse_aggregate(q: &ReportQuery, table: &str) -> Result<String, StoreError> {
    validate(q)?;
    // Fixed-point units of a value, and their high and low parts.
    let units = |c: &str| format!("toInt64(floor({c} * 4294967296 + 0.5))");
    let hi = |c: &str| format!("intDiv({}, toInt64(4294967296))", units(c));
    let lo = |c: &str| format!("({} - {} * toInt64(4294967296))", units(c), hi(c));
    let mut cols: Vec<String> = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    match q.interval {
        Some(_) => {
            let iv = tokenscope_store::report::interval_micros(q);
            cols.push(format!("intDiv(created_at_us, {iv}) * {iv} AS ts_bucket"));
            keys.push("ts_bucket".to_owned());
        }
        None => cols.push("toInt64(0) AS ts_bucket".to_owned()),
    }
    for (i, d) in q.group_by.iter().enumerate() {
        let c = d.column();
        let e = match d {
            Dimension::Stream => format!("toInt64({c})"),
            Dimension::KvUsageBand | Dimension::GpuBand => format!(
                "multiIf(isNull({c}), -1, isNaN(assumeNotNull({c})), -1, {c} < 0.5, 0, \
                 {c} < 0.8, 1, {c} < 0.95, 2, 3)"
            ),
            _ => format!("toString({c})"),
        };
        cols.push(format!("{e} AS ts_d{i}"));
        keys.push(format!("ts_d{i}"));
    }
    let class = format!("toInt64({SQL_CLASS})");
    cols.push("count()".to_owned());
    cols.push(format!("countIf({class} = 1)"));
    cols.push(format!("countIf({class} IN (0, 1))"));
    for m in METRIC_COLUMNS {
        cols.push(format!("count({m})"));
        cols.push(format!("quantilesExact({EXACT_LEVELS})({m})"));
        cols.push(format!("sum({})", hi(m)));
        cols.push(format!("sum({})", lo(m)));
    }
    let both = "isNotNull(queue_duration_ms) AND isNotNull(ttft_ms)";
    cols.push(format!("countIf({both})"));
    for m in ["queue_duration_ms", "ttft_ms"] {
        cols.push(format!("sumIf({}, {both})", hi(m)));
        cols.push(format!("sumIf({}, {both})", lo(m)));
    }
    for t in ["input_tokens", "output_tokens", "cached_tokens"] {
        cols.push(format!("sum(toUInt64(greatest(ifNull({t}, 0), 0)))"));
    }
    let mut sql = format!("SELECT {} FROM {table} FINAL", cols.join(", "));
    sql.push_str(&where_clause(q)?);
    if keys.is_empty() {
        // One group: without GROUP BY an empty range still returns one row (count 0).
        sql.push_str(" GROUP BY ts_bucket");
    } else {
        sql.push_str(&format!(" GROUP BY {}", keys.join(", ")));
    }
    Ok(sql)
}

/// ` WHERE …`: the report's range and filters in ClickHouse's dialect.
fn where_clause(q: &ReportQuery) -> Result<String, StoreError> {
    where_range_filters(q.since_us, q.until_us, &q.filters)
}

/// ` WHERE …`: a `created_at` range and the report's filters ([`filter_value`]'s semantics).
pub(crate) fn where_range_filters(
    since_us: i64,
    until_us: Option<i64>,
    filters: &[(Dimension, String)],
) -> Result<String, StoreError> {
    let mut sql = format!(" WHERE created_at_us >= {since_us}");
    if let Some(until) = until_us {
        sql.push_str(&format!(" AND created_at_us < {until}"));
    }
    for (d, raw) in filters {
        let c = d.column();
        match filter_value(*d, raw)? {
            FilterValue::Null => sql.push_str(&format!(" AND isNull({c})")),
            FilterValue::Text(t) => sql.push_str(&format!(" AND {c} = {}", ch_string(&t))),
            FilterValue::Int(i) => sql.push_str(&format!(" AND {c} = {i}")),
            FilterValue::Range(lo, hi) => {
                sql.push_str(&format!(" AND isNotNull({c})"));
                if let Some(lo) = lo {
                    sql.push_str(&format!(" AND {c} >= {lo:?}"));
                }
                if let Some(hi) = hi {
                    sql.push_str(&format!(" AND {c} < {hi:?}"));
                }
            }
        }
    }
    Ok(sql)
}

/// Decodes one result row of [`clickhouse_aggregate`] for `q`.
pub fn decode_group(line: &[u8], q: &ReportQuery) -> Result<GroupAgg, String> {
    let fields: Vec<&[u8]> = line.split(|b| *b == b'\t').collect();
    let ndims = q.group_by.len();
    let want = 1 + ndims + 3 + 4 * METRIC_COLUMNS.len() + 5 + 3;
    if fields.len() != want {
        return Err(format!("expected {want} columns, got {}", fields.len()));
    }
    let text = |i: usize| -> Result<&str, String> {
        std::str::from_utf8(fields[i]).map_err(|_| format!("column {i}: not UTF-8"))
    };
    let int = |i: usize| -> Result<i64, String> {
        let s = text(i)?;
        if s == "\\N" {
            return Ok(0); // an aggregate over no value
        }
        s.parse::<i64>()
            .map_err(|_| format!("column {i}: {s:?} is not an integer"))
    };
    let uint = |i: usize| -> Result<u64, String> {
        let v = int(i)?;
        u64::try_from(v).map_err(|_| format!("column {i}: {v} is negative"))
    };
    let mut labels = Vec::with_capacity(ndims);
    for (k, d) in q.group_by.iter().enumerate() {
        let i = 1 + k;
        let f = fields[i];
        labels.push(match d {
            _ if f == b"\\N" => None,
            Dimension::Stream => Some(if int(i)? != 0 { "true" } else { "false" }.to_owned()),
            Dimension::KvUsageBand | Dimension::GpuBand => {
                let b = int(i)?;
                usize::try_from(b)
                    .ok()
                    .and_then(|b| tokenscope_store::report::KV_BANDS.get(b))
                    .map(|s| (*s).to_owned())
            }
            _ => {
                let mut out = Vec::with_capacity(f.len());
                unescape_into(f, &mut out);
                Some(String::from_utf8_lossy(&out).into_owned())
            }
        });
    }
    let mut i = 1 + ndims;
    let (count, ok, counted) = (uint(i)?, uint(i + 1)?, uint(i + 2)?);
    i += 3;
    let mut qs: Vec<Quantiles> = Vec::with_capacity(METRIC_COLUMNS.len());
    for _ in METRIC_COLUMNS {
        let n = uint(i)?;
        let units = i128::from(int(i + 2)?) * (1_i128 << 32) + i128::from(int(i + 3)?);
        qs.push(if n == 0 {
            Quantiles::default()
        } else {
            let levels = parse_floats(text(i + 1)?)
                .ok_or_else(|| format!("column {}: not an array of 4 numbers", i + 1))?;
            Quantiles {
                n,
                p50: Some(levels[0]),
                p90: Some(levels[1]),
                p95: Some(levels[2]),
                p99: Some(levels[3]),
                mean: mean_of_units(units, n),
            }
        });
        i += 4;
    }
    let share_n = uint(i)?;
    let share_queue_units = i128::from(int(i + 1)?) * (1_i128 << 32) + i128::from(int(i + 2)?);
    let share_ttft_units = i128::from(int(i + 3)?) * (1_i128 << 32) + i128::from(int(i + 4)?);
    i += 5;
    let mut qs = qs.into_iter();
    let mut next = || qs.next().unwrap_or_default();
    Ok(GroupAgg {
        bucket_start_us: int(0)?,
        labels,
        count,
        ok,
        counted,
        ttft: next(),
        tpot: next(),
        e2e: next(),
        queue: next(),
        prefill: next(),
        decode: next(),
        unaccounted: next(),
        share_n,
        share_queue_units,
        share_ttft_units,
        input_tokens: uint(i)?,
        output_tokens: uint(i + 1)?,
        cached_tokens: uint(i + 2)?,
    })
}

/// `[a,b,c,d]` (ClickHouse's text form of an `Array(Float64)`) as four numbers.
fn parse_floats(s: &str) -> Option<[f64; 4]> {
    let inner = s.strip_prefix('[')?.strip_suffix(']')?;
    let mut out = [0.0; 4];
    let mut it = inner.split(',');
    for slot in &mut out {
        *slot = it.next()?.trim().parse().ok()?;
    }
    it.next().is_none().then_some(out)
}

/// A usage query ([`tokenscope_store::usage`]) as one ClickHouse aggregation over `table`:
/// one row per (group, model), the columns [`decode_usage`] reads. Sums are integers; the
/// stored cost is summed as fixed-point units (2⁻⁴⁴ USD) split hi/lo at 2³², as the report's
/// means.
pub fn clickhouse_usage(q: &UsageQuery, table: &str) -> Result<String, StoreError> {
    tokenscope_store::usage::validate_usage(q).map_err(|e| StoreError::InvalidQuery(e.0))?;
    // tokenscope_core::usage::cost_units.
    let units = "toInt64(floor(assumeNotNull(cost_usd) * 17592186044416 + 0.5))";
    let hi = format!("intDiv({units}, toInt64(4294967296))");
    let lo = format!("({units} - {hi} * toInt64(4294967296))");
    let stored = "isNotNull(cost_usd) AND isFinite(assumeNotNull(cost_usd))";
    let tok = |c: &str| format!("toUInt64(ifNull({c}, 0))");
    let mut cols: Vec<String> = Vec::new();
    let mut keys: Vec<String> = vec!["ts_bucket".to_owned()];
    match q.interval_us {
        Some(iv) => cols.push(format!("intDiv(created_at_us, {iv}) * {iv} AS ts_bucket")),
        None => cols.push("toInt64(0) AS ts_bucket".to_owned()),
    }
    for (i, d) in q.group_by.iter().enumerate() {
        cols.push(format!("toString({}) AS ts_d{i}", d.column()));
        keys.push(format!("ts_d{i}"));
    }
    cols.push("toString(model) AS ts_model".to_owned());
    keys.push("ts_model".to_owned());
    cols.push("count()".to_owned());
    for c in ["input_tokens", "cached_tokens", "output_tokens"] {
        cols.push(format!("sum({})", tok(c)));
    }
    cols.push("countIf(isNotNull(cost_usd))".to_owned());
    cols.push(format!("sumIf({hi}, {stored})"));
    cols.push(format!("sumIf({lo}, {stored})"));
    cols.push(format!("sumIf({}, isNull(cost_usd))", tok("input_tokens")));
    cols.push(format!(
        "sumIf(least({}, {}), isNull(cost_usd))",
        tok("cached_tokens"),
        tok("input_tokens")
    ));
    cols.push(format!("sumIf({}, isNull(cost_usd))", tok("output_tokens")));
    // Engine state at arrival: count and 2⁻³² fixed-point sum (exact_sum_units) split hi/lo.
    for c in ["engine_running", "engine_waiting", "engine_kv_usage"] {
        let known = format!("isNotNull({c}) AND isFinite(assumeNotNull({c}))");
        let units = format!("toInt64(floor(assumeNotNull({c}) * 4294967296 + 0.5))");
        let hi = format!("intDiv({units}, toInt64(4294967296))");
        let lo = format!("({units} - {hi} * toInt64(4294967296))");
        cols.push(format!("countIf({known})"));
        cols.push(format!("sumIf({hi}, {known})"));
        cols.push(format!("sumIf({lo}, {known})"));
    }
    let (a, b) = (q.window.since_us, q.window.until_us);
    let mut filters = where_range_filters(a, Some(b), &q.filters)?;
    // Daily partitions first (the part of the WHERE that prunes).
    filters = filters.replacen(
        " WHERE ",
        &format!(
            " WHERE toYYYYMMDD(created_at) >= {} AND toYYYYMMDD(created_at) <= {} AND ",
            crate::store::utc_day(a),
            crate::store::utc_day(b)
        ),
        1,
    );
    Ok(format!(
        "SELECT {} FROM {table} FINAL{filters} GROUP BY {}",
        cols.join(", "),
        keys.join(", ")
    ))
}

/// Decodes one result row of [`clickhouse_usage`] for `q`.
pub fn decode_usage(line: &[u8], q: &UsageQuery) -> Result<UsageRow, String> {
    let fields: Vec<&[u8]> = line.split(|b| *b == b'\t').collect();
    let fields = fields.get(1..).ok_or("no bucket column")?;
    let bucket = std::str::from_utf8(fields_bucket(line))
        .ok()
        .and_then(|b| b.parse::<i64>().ok())
        .ok_or("column 0: not a bucket start")?;
    let n = q.group_by.len();
    if fields.len() != n + 20 {
        return Err(format!(
            "expected {} columns, got {}",
            n + 21,
            fields.len() + 1
        ));
    }
    let label = |i: usize| -> Option<String> {
        (fields[i] != b"\\N").then(|| {
            let mut out = Vec::with_capacity(fields[i].len());
            unescape_into(fields[i], &mut out);
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let int = |i: usize| -> Result<i128, String> {
        let s = std::str::from_utf8(fields[i]).map_err(|_| format!("column {i}: not UTF-8"))?;
        if s == "\\N" {
            return Ok(0);
        }
        s.parse::<i128>()
            .map_err(|_| format!("column {i}: {s:?} is not an integer"))
    };
    let uint = |i: usize| -> Result<u64, String> {
        let v = int(i)?;
        u64::try_from(v).map_err(|_| format!("column {i}: {v} out of range"))
    };
    let b = n + 1;
    let unit_sum = |i: usize| -> Result<UnitSum, String> {
        Ok(UnitSum {
            n: uint(i)?,
            units: int(i + 1)? * (1_i128 << 32) + int(i + 2)?,
        })
    };
    Ok(UsageRow {
        bucket_start_us: q.interval_us.map(|_| bucket),
        labels: (0..n).map(label).collect(),
        model: label(n).unwrap_or_default(),
        sums: UsageSums {
            requests: uint(b)?,
            input_tokens: uint(b + 1)?,
            cached_tokens: uint(b + 2)?,
            output_tokens: uint(b + 3)?,
            stored_cost_requests: uint(b + 4)?,
            stored_cost_units: int(b + 5)? * (1_i128 << 32) + int(b + 6)?,
            unpriced_input_tokens: uint(b + 7)?,
            unpriced_cached_within_input: uint(b + 8)?,
            unpriced_output_tokens: uint(b + 9)?,
            engine_running: unit_sum(b + 10)?,
            engine_waiting: unit_sum(b + 13)?,
            engine_kv_usage: unit_sum(b + 16)?,
        },
    })
}

/// The first tab-separated field of a line.
fn fields_bucket(line: &[u8]) -> &[u8] {
    line.split(|b| *b == b'\t').next().unwrap_or_default()
}

/// A ClickHouse string literal: single-quoted, with `\` and `'` escaped.
pub fn ch_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            _ => out.push(c),
        }
    }
    out.push('\'');
    out
}

impl RecordReader for ClickHouseStore {
    fn records_between(&self, window: Window) -> Result<Vec<RequestRecord>, StoreError> {
        Ok(ClickHouseStore::records_between(
            self,
            window.since_us,
            window.until_us,
        )?)
    }

    fn report(&self, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        ClickHouseStore::report(self, q)
    }

    fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        ClickHouseStore::usage(self, q)
    }

    fn slowest(
        &self,
        window: Window,
        filters: &[(Dimension, String)],
        limit: usize,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        ClickHouseStore::slowest(self, window.since_us, window.until_us, filters, limit)
    }

    fn kind(&self) -> &'static str {
        "clickhouse"
    }
}

impl ClickHouseStore {
    /// Token and cost sums per (group, model) of a window ([`tokenscope_store::usage`]),
    /// aggregated by ClickHouse ([`clickhouse_usage`]); rows in the usage order.
    pub fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        let sql = clickhouse_usage(q, &self.config().table())?;
        let mut acc = UsageAcc::new(q).map_err(|e| StoreError::InvalidQuery(e.0))?;
        let mut bad: Option<String> = None;
        self.for_each_tsv_line(&sql, |line| {
            match decode_usage(line, q) {
                Ok(r) => acc.add_row(r),
                Err(msg) => {
                    bad = Some(msg);
                    return Err(ClickHouseError::Rejected {
                        code: 0,
                        message: "undecodable usage row".to_owned(),
                    });
                }
            }
            Ok(())
        })
        .map_err(|e| match bad.take() {
            Some(msg) => StoreError::Sink {
                sink: "clickhouse",
                class: ErrorClass::Rejected,
                message: format!("usage: {msg}"),
            },
            None => StoreError::from(e),
        })?;
        Ok(acc.finish())
    }

    /// Runs `q` (see [`tokenscope_store::report`] for the semantics), aggregated by ClickHouse
    /// ([`clickhouse_aggregate`]): this process holds one [`GroupAgg`] per group.
    pub fn report(&self, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        let sql = clickhouse_aggregate(q, &self.config().table())?;
        let now = crate::store::now_us();
        let mut groups = Vec::new();
        let mut bad: Option<String> = None;
        self.for_each_tsv_line(&sql, |line| {
            match decode_group(line, q) {
                Ok(g) if g.count > 0 => groups.push(g),
                Ok(_) => {}
                Err(msg) => {
                    bad = Some(msg);
                    return Err(ClickHouseError::Rejected {
                        code: 0,
                        message: "undecodable report row".to_owned(),
                    });
                }
            }
            Ok(())
        })
        .map_err(|e| match bad.take() {
            Some(msg) => StoreError::Sink {
                sink: "clickhouse",
                class: ErrorClass::Rejected,
                message: format!("report: {msg}"),
            },
            None => StoreError::from(e),
        })?;
        Ok(finish_groups(q, groups, now))
    }
}

/// Undoes ClickHouse's `TabSeparated` escaping (`\t`, `\n`, `\\`, `\'`, `\b`, `\f`, `\r`,
/// `\0`); an unknown escape keeps the escaped byte.
fn unescape_into(f: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < f.len() {
        let b = f[i];
        if b == b'\\' && i + 1 < f.len() {
            let c = f[i + 1];
            out.push(match c {
                b't' => b'\t',
                b'n' => b'\n',
                b'r' => b'\r',
                b'b' => 0x08,
                b'f' => 0x0c,
                b'0' => 0,
                other => other,
            });
            i += 2;
        } else {
            out.push(b);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokenscope_store::NONE_LABEL;

    #[test]
    fn quoting() {
        assert_eq!(ch_string("a'b\\c"), "'a\\'b\\\\c'");
    }

    #[test]
    fn aggregate_text() {
        let q = ReportQuery {
            since_us: 5,
            until_us: Some(10),
            group_by: vec![Dimension::User, Dimension::KvUsageBand, Dimension::Stream],
            interval: Some(Duration::from_secs(60)),
            filters: vec![
                (Dimension::Model, "it's\\x".to_owned()),
                (Dimension::Tenant, NONE_LABEL.to_owned()),
                (Dimension::GpuBand, "50-80%".to_owned()),
                (Dimension::Stream, "true".to_owned()),
            ],
        };
        let sql = clickhouse_aggregate(&q, "db.llm_inference_log").expect("sql");
        assert!(sql.starts_with(
            "SELECT intDiv(created_at_us, 60000000) * 60000000 AS ts_bucket, \
             toString(user_id) AS ts_d0, multiIf(isNull(engine_kv_usage), -1, "
        ));
        assert!(sql.contains("quantilesExact(0.499999999999, 0.899999999999, 0.949999999999, 0.989999999999)(ttft_ms)"));
        assert!(
            sql.ends_with(
                " FROM db.llm_inference_log FINAL WHERE created_at_us >= 5 AND created_at_us < 10 \
             AND model = 'it\\'s\\\\x' AND isNull(tenant) AND isNotNull(gpu_utilization) AND \
             gpu_utilization >= 0.5 AND gpu_utilization < 0.8 AND stream = 1 \
             GROUP BY ts_bucket, ts_d0, ts_d1, ts_d2"
            ),
            "{sql}"
        );
        let q = ReportQuery {
            since_us: 0,
            ..ReportQuery::default()
        };
        let sql = clickhouse_aggregate(&q, "t").expect("sql");
        assert!(
            sql.starts_with("SELECT toInt64(0) AS ts_bucket, count()"),
            "{sql}"
        );
        assert!(
            sql.ends_with("WHERE created_at_us >= 0 GROUP BY ts_bucket"),
            "{sql}"
        );
    }

    fn line(fields: &[&str]) -> Vec<u8> {
        fields.join("\t").into_bytes()
    }

    #[test]
    fn decodes_a_group_row() {
        let q = ReportQuery {
            since_us: 0,
            group_by: vec![Dimension::User, Dimension::Stream, Dimension::KvUsageBand],
            ..ReportQuery::default()
        };
        let mut f = vec!["120", "a\\tb\\\\c", "1", "2", "3", "2", "3"];
        // ttft: 2 values, 1.5 and 2.5 (units: hi 4, lo 0 = 4·2³² → mean 2.0)
        f.extend(["2", "[1.5,1.5,2.5,2.5]", "4", "0"]);
        // tpot: none
        f.extend(["0", "[nan,nan,nan,nan]", "\\N", "\\N"]);
        for _ in 0..4 {
            f.extend(["1", "[7,7,7,7]", "7", "0"]);
        }
        // unaccounted: one value, 3.
        f.extend(["1", "[3,3,3,3]", "3", "0"]);
        f.extend(["1", "7", "0", "1", "2147483648"]);
        f.extend(["10", "20", "\\N"]);
        let g = decode_group(&line(&f), &q).expect("decode");
        assert_eq!(g.bucket_start_us, 120);
        assert_eq!(
            g.labels,
            [
                Some("a\tb\\c".to_owned()),
                Some("true".to_owned()),
                Some("80-95%".to_owned())
            ]
        );
        assert_eq!((g.count, g.ok, g.counted), (3, 2, 3));
        assert_eq!(g.ttft.n, 2);
        assert_eq!(g.ttft.p50, Some(1.5));
        assert_eq!(g.ttft.p99, Some(2.5));
        assert_eq!(g.ttft.mean, Some(2.0));
        assert_eq!(g.tpot, Quantiles::default());
        assert_eq!(g.e2e.mean, Some(7.0));
        assert_eq!((g.unaccounted.n, g.unaccounted.p99), (1, Some(3.0)));
        assert_eq!(g.share_n, 1);
        assert_eq!(g.share_ttft_units, (1 << 32) + (1 << 31));
        assert_eq!(
            (g.input_tokens, g.output_tokens, g.cached_tokens),
            (10, 20, 0)
        );
        // NULL labels, and drifts fail clearly.
        f[1] = "\\N";
        f[3] = "\\N";
        let g = decode_group(&line(&f), &q).expect("decode");
        assert_eq!(g.labels[0], None);
        assert_eq!(g.labels[2], None);
        assert!(decode_group(b"1\t2", &q).is_err());
        f[4] = "x";
        assert!(decode_group(&line(&f), &q)
            .expect_err("drift")
            .contains("column 4"));
    }

    #[test]
    fn float_arrays() {
        assert_eq!(
            parse_floats("[1,2.5,-3,inf]"),
            Some([1.0, 2.5, -3.0, f64::INFINITY])
        );
        assert_eq!(parse_floats("[1,2,3]"), None);
        assert_eq!(parse_floats("[1,2,3,4,5]"), None);
        assert_eq!(parse_floats("1,2,3,4"), None);
    }
}
