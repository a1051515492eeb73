//! The read side on ClickHouse: the report's SQL in ClickHouse's dialect, the embedded store's
//! report computed by the same code, and [`RecordReader`] for [`ClickHouseStore`].
//!
//! [`ClickHouseStore::report`] runs [`clickhouse_select`] (the report's columns, time range and
//! filters in ClickHouse's dialect, read with `FINAL` so a retried or re-inserted row counts
//! once), streams the `TabSeparated` result and feeds every row, decoded per column kind, to the
//! store-independent [`Scanner`]. Grouping, exact nearest-rank percentiles, rates and ordering
//! are therefore the embedded store's, bit for bit: the same records give the same report on
//! both stores.
//!
//! Invariants:
//! * The result is streamed, never held as a whole; memory is one value per row and metric
//!   (what exact percentiles need), as on the embedded store.
//! * A value that does not decode as its column's kind (a schema drift) fails the report with a
//!   clear error; it is never silently read as `NULL`.
//! * Every literal in the SQL is a number or a [`ch_string`] (escaped); dimension names map to
//!   fixed column names ([`Dimension::column`]), never to user text.
//! * [`clickhouse_select`] selects the same columns in the same order, with the same range and
//!   filter semantics ([`filter_value`]) as the embedded store's query.

use tokenscope_core::query::Window;
use tokenscope_core::success::SQL_CLASS;
use tokenscope_core::RequestRecord;
use tokenscope_store::report::{filter_value, validate};
use tokenscope_store::{
    ColKind, Dimension, FilterValue, RecordReader, ReportQuery, ReportRow, ScanValue, Scanner,
};
use tokenscope_store::{ErrorClass, StoreError};

use crate::{ClickHouseError, ClickHouseStore};

/// A report's SELECT in ClickHouse's dialect, with literals inlined, and the kind of each
/// selected column, in order. Feed every result row, decoded per [`ReportSelect::kinds`], to a
/// [`Scanner`] built from the same query.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportSelect {
    /// The complete `SELECT … FROM … FINAL WHERE …` (no `FORMAT` clause).
    pub sql: String,
    /// Kind of each column.
    pub kinds: Vec<ColKind>,
}

/// The ClickHouse form of the report query over `table` (a `ReplacingMergeTree`, read with
/// `FINAL`), where the record's `created_at` (µs) is the column `created_at_us` and every other
/// column has the SQLite name. Same columns, same order and same filter semantics as the
/// embedded store's query, so the same [`Scanner`] gives identical rows.
pub fn clickhouse_select(q: &ReportQuery, table: &str) -> Result<ReportSelect, StoreError> {
    validate(q)?;
    let mut cols: Vec<(String, ColKind)> = vec![
        (format!("toInt64({SQL_CLASS})"), ColKind::Int),
        ("ttft_ms".to_owned(), ColKind::Real),
        ("tpot_ms".to_owned(), ColKind::Real),
        ("total_duration_ms".to_owned(), ColKind::Real),
        ("input_tokens".to_owned(), ColKind::Int),
        ("output_tokens".to_owned(), ColKind::Int),
        ("cached_tokens".to_owned(), ColKind::Int),
        ("queue_duration_ms".to_owned(), ColKind::Real),
        ("prefill_duration_ms".to_owned(), ColKind::Real),
        ("decode_duration_ms".to_owned(), ColKind::Real),
    ];
    if q.interval.is_some() {
        cols.push(("created_at_us".to_owned(), ColKind::Int));
    }
    for d in &q.group_by {
        let kind = match d {
            Dimension::Stream => ColKind::Int,
            Dimension::KvUsageBand | Dimension::GpuBand => ColKind::Real,
            _ => ColKind::Text,
        };
        cols.push((d.column().to_owned(), kind));
    }
    let mut sql = String::from("SELECT ");
    sql.push_str(
        &cols
            .iter()
            .map(|(c, _)| c.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    );
    sql.push_str(&format!(
        " FROM {table} FINAL WHERE created_at_us >= {}",
        q.since_us
    ));
    if let Some(until) = q.until_us {
        sql.push_str(&format!(" AND created_at_us < {until}"));
    }
    for (d, raw) in &q.filters {
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
    Ok(ReportSelect {
        sql,
        kinds: cols.into_iter().map(|(_, k)| k).collect(),
    })
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

    fn kind(&self) -> &'static str {
        "clickhouse"
    }
}

impl ClickHouseStore {
    /// Runs `q` (see [`tokenscope_store::report`] for the semantics).
    pub fn report(&self, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        let sel = clickhouse_select(q, &self.config().table())?;
        let mut scanner = Scanner::new(q)?;
        let mut text: Vec<Vec<u8>> = vec![Vec::new(); sel.kinds.len()];
        let mut bad: Option<String> = None;
        self.for_each_tsv_line(&sel.sql, |line| {
            match decode_row(line, &sel.kinds, &mut text) {
                Ok(vals) => scanner.push(&vals),
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
        Ok(scanner.finish_now())
    }
}

/// Splits a `TabSeparated` line and decodes each field per `kinds`; text fields are unescaped
/// into `buf` (one buffer per column, reused across rows).
fn decode_row<'a>(
    line: &[u8],
    kinds: &[ColKind],
    buf: &'a mut [Vec<u8>],
) -> Result<Vec<ScanValue<'a>>, String> {
    let fields: Vec<&[u8]> = line.split(|b| *b == b'\t').collect();
    if fields.len() != kinds.len() {
        return Err(format!(
            "expected {} columns, got {}",
            kinds.len(),
            fields.len()
        ));
    }
    // First unescape every text field (mutable borrows), then build the values (shared).
    for ((f, k), b) in fields.iter().zip(kinds).zip(buf.iter_mut()) {
        b.clear();
        if *k == ColKind::Text && *f != b"\\N" {
            unescape_into(f, b);
        }
    }
    let mut out = Vec::with_capacity(kinds.len());
    for (i, (f, k)) in fields.iter().zip(kinds).enumerate() {
        if *f == b"\\N" {
            out.push(ScanValue::Null);
            continue;
        }
        let v = match k {
            ColKind::Text => ScanValue::Text(&buf[i]),
            ColKind::Int => {
                let s = std::str::from_utf8(f).map_err(|_| format!("column {i}: not UTF-8"))?;
                ScanValue::Int(
                    s.parse::<i64>()
                        .map_err(|_| format!("column {i}: {s:?} is not an integer"))?,
                )
            }
            ColKind::Real => {
                let s = std::str::from_utf8(f).map_err(|_| format!("column {i}: not UTF-8"))?;
                ScanValue::Real(
                    s.parse::<f64>()
                        .map_err(|_| format!("column {i}: {s:?} is not a number"))?,
                )
            }
        };
        out.push(v);
    }
    Ok(out)
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
    fn clickhouse_select_text() {
        let mut q = ReportQuery {
            since_us: 0,
            until_us: None,
            group_by: vec![Dimension::User, Dimension::KvUsageBand],
            interval: None,
            filters: vec![],
        };
        q.since_us = 5;
        q.until_us = Some(10);
        q.filters = vec![
            (Dimension::Model, "it's\\x".to_owned()),
            (Dimension::Tenant, NONE_LABEL.to_owned()),
            (Dimension::GpuBand, "50-80%".to_owned()),
            (Dimension::Stream, "true".to_owned()),
        ];
        let sel = clickhouse_select(&q, "db.llm_inference_log").expect("select");
        assert_eq!(
            sel.sql,
            "SELECT toInt64((outcome = 'ok') + 2 * (outcome = 'client_error' OR outcome = \
             'cancelled')), ttft_ms, tpot_ms, total_duration_ms, input_tokens, output_tokens, cached_tokens, queue_duration_ms, prefill_duration_ms, \
             decode_duration_ms, user_id, engine_kv_usage FROM db.llm_inference_log FINAL WHERE \
             created_at_us >= 5 AND created_at_us < 10 AND model = 'it\\'s\\\\x' AND \
             isNull(tenant) AND isNotNull(gpu_utilization) AND gpu_utilization >= 0.5 AND \
             gpu_utilization < 0.8 AND stream = 1"
        );
        assert_eq!(sel.kinds.len(), 12);
        assert_eq!(sel.kinds[10], ColKind::Text);
        assert_eq!(sel.kinds[11], ColKind::Real);
        q.interval = Some(Duration::from_secs(60));
        let sel = clickhouse_select(&q, "t").expect("select");
        assert!(sel
            .sql
            .contains("decode_duration_ms, created_at_us, user_id"));
        assert_eq!(sel.kinds[10], ColKind::Int);
    }

    #[test]
    fn decodes_nulls_numbers_and_escaped_text() {
        let kinds = [ColKind::Int, ColKind::Real, ColKind::Text, ColKind::Text];
        let mut buf = vec![Vec::new(); 4];
        let line = b"1\t2.5\ta\\tb\\\\c\\nd\t\\N";
        let vals = decode_row(line, &kinds, &mut buf).expect("decode");
        assert_eq!(vals[0], ScanValue::Int(1));
        assert_eq!(vals[1], ScanValue::Real(2.5));
        assert_eq!(vals[2], ScanValue::Text(b"a\tb\\c\nd"));
        assert_eq!(vals[3], ScanValue::Null);
        let mut buf = vec![Vec::new(); 4];
        assert!(decode_row(b"x\t1\ta\tb", &kinds, &mut buf).is_err());
        let mut buf = vec![Vec::new(); 4];
        assert!(decode_row(b"1\t1\ta", &kinds, &mut buf).is_err());
    }
}
