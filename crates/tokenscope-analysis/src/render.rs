//! Rendering shared by the reports: the table house style and the CSV form.
//!
//! Invariants:
//! * Table headers name their unit (`(ms)`, `(USD)`, `(%)`, `(req/s)`); CSV headers carry it
//!   in the name (`_ms`, `_usd`, `_pct`; shares are fractions 0–1).
//! * CSV is RFC 4180 (cells quoted when they hold a comma, quote or newline), `\n` line ends,
//!   one header row, raw unformatted numbers, an empty cell for "none".
//! * On a terminal a table fits its width; off a terminal (pipe, file, test) nothing wraps,
//!   so the output does not depend on where it goes except for that width.

use serde::Serialize;

/// The CSV form of a report: one header row and the rows of its main table, raw values
/// (numbers unformatted, units in the header names, empty cell for "none").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CsvRows {
    /// Column names (units in the name: `_ms`, `_usd`, `_pct`, …).
    pub header: Vec<String>,
    /// One vector per row, as long as `header`.
    pub rows: Vec<Vec<String>>,
}

impl CsvRows {
    /// An empty table with these columns.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (cells beyond the header are kept; the writer is flexible).
    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// RFC 4180 text: a header line, then one line per row; cells quoted when needed.
    pub fn to_csv(&self) -> String {
        let mut w = csv::WriterBuilder::new()
            .flexible(true)
            .terminator(csv::Terminator::Any(b'\n'))
            .from_writer(Vec::new());
        let written = std::iter::once(&self.header)
            .chain(&self.rows)
            .try_for_each(|r| w.write_record(r));
        if let Err(e) = written {
            return format!("error\n{e}\n");
        }
        match w.into_inner() {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("error\n{}\n", e.error()),
        }
    }
}

/// A CSV cell of an optional number ("" for none).
pub fn csv_opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(String::new, |x| x.to_string())
}

/// The JSON name of a unit enum value (`Status::NoBaseline` → `no_baseline`), for CSV cells.
pub(crate) fn serde_name<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

/// A new table in the house style. Column headers name their unit (`(ms)`, `(USD)`, `(%)`).
///
/// On a terminal the table fits its width (comfy-table's dynamic arrangement wraps the widest
/// cells); when stdout is not a terminal (a pipe, a file, a test) no width is known and
/// nothing is wrapped: every row stays on one line, as scripts reading the table expect.
pub fn table(header: &[&str]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(comfy_table::ContentArrangement::Dynamic)
        .set_header(header.iter().copied());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_and_empties() {
        let mut t = CsvRows::new(&["name", "value_ms"]);
        t.push(vec!["a,b \"q\"".into(), csv_opt(Some(1.5))]);
        t.push(vec!["line\nbreak".into(), csv_opt(None::<f64>)]);
        assert_eq!(
            t.to_csv(),
            "name,value_ms\n\"a,b \"\"q\"\"\",1.5\n\"line\nbreak\",\n"
        );
    }

    #[test]
    fn enum_names_are_the_json_names() {
        #[derive(Serialize)]
        #[serde(rename_all = "snake_case")]
        enum E {
            NoBaseline,
        }
        assert_eq!(serde_name(&E::NoBaseline), "no_baseline");
    }

    #[test]
    fn tables_off_a_terminal_do_not_wrap() {
        let mut t = table(&["a (ms)", "b"]);
        let long = "x".repeat(300);
        t.add_row(vec!["1".to_owned(), long.clone()]);
        let text = t.to_string();
        assert!(text.lines().any(|l| l.contains(&long)), "{text}");
    }
}
