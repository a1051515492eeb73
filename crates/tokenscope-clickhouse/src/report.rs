//! `tokenscope report` on ClickHouse: the embedded store's report, computed by the same code.
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

use tokenscope_store::{clickhouse_select, ColKind, ReportQuery, ReportRow, ScanValue, Scanner};
use tokenscope_store::{ErrorClass, StoreError};

use crate::{ClickHouseError, ClickHouseStore};

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
