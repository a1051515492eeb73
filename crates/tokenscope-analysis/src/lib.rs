//! # tokenscope-analysis
//!
//! Answers computed from the per-request records: every analysis is a pure function of a
//! slice of [`RequestRecord`]s (loaded from the embedded store or ClickHouse by the CLI, in
//! `created_at`, `request_id` order) and its options, returning a typed report that
//! serialises to JSON and renders as a table, with the evidence behind each conclusion.
//!
//! * [`prices`] — the price table (per-model token prices, or a GPU hourly cost turned into a
//!   per-token cost from measured throughput) and the cost of a record.
//! * [`cost`] — tokens and cost by business line / tenant / user / model / request type, share
//!   of total, trend against the previous window (`tokenscope cost`).
//! * [`budget`] — daily / monthly budgets per business line (explicit or 120 % of the 30-day
//!   baseline), projected exhaustion, abnormal growth (`tokenscope budget`).
//! * [`anomalies`] — token spikes per caller against a robust (median / MAD) baseline, request
//!   loops, duplicate bursts, sudden drops (`tokenscope anomalies`).
//! * [`waste`] — duplicate prompts, truncated and overlong outputs with suggested `max_tokens`,
//!   bloated prompts, total saving (`tokenscope waste`).
//! * [`diagnose`] — the decision tree: success rate → TTFT → TPOT → tokens → network, verdicts
//!   with evidence, conclusion and remedies (`tokenscope diagnose`).
//! * [`capacity`] — the load knee under an SLO from history or a load test, sustainable QPS,
//!   date a growth rate reaches it (`tokenscope capacity`).
//! * [`rules`] — Prometheus recording and tiered alerting rules
//!   (`tokenscope export prometheus-rules`); [`alerts`] — the same conditions evaluated by the
//!   gateway itself over recent records, with one notification per incident.
//!
//! The window, the output format and the nearest-rank percentile are
//! `tokenscope_core::query`'s ([`Window`], [`Format`], [`nearest_rank`]), re-exported here.
//!
//! Invariants:
//! * No I/O and no clock: the window and "now" are arguments, so the same records give the
//!   same answers on every store and in tests.
//! * Every number in a report is recomputable from the records it names.
#![deny(missing_docs)]

pub mod alerts;
pub mod anomalies;
pub mod budget;
pub mod capacity;
pub mod cost;
pub mod diagnose;
pub mod grafana;
pub mod prices;
pub mod rules;
pub mod waste;

pub use prices::{ModelPrice, PriceTable};
use serde::Serialize;
use tokenscope_core::RequestRecord;

/// The analysed time range and the output format are the read side's shared vocabulary
/// (`tokenscope_core::query`), re-exported here; so is the one percentile definition.
pub use tokenscope_core::query::{nearest_rank, Format, Window};

/// Parses the `--format` of the analysis commands: `table` or `json` (exact names).
pub fn parse_format(s: &str) -> Result<Format, AnalysisError> {
    match s {
        "table" => Ok(Format::Table),
        "json" => Ok(Format::Json),
        other => Err(AnalysisError::InvalidOption(format!(
            "format {other:?}: use table or json"
        ))),
    }
}

/// Errors of the analyses (bad options; the analyses themselves cannot fail).
#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    /// An option value is not valid.
    #[error("{0}")]
    InvalidOption(String),
}

/// A report every analysis command prints: JSON or a table.
pub trait Report: Serialize {
    /// The human-readable rendering.
    fn render_table(&self) -> String;

    /// Renders in `format`.
    fn render(&self, format: Format) -> String {
        match format {
            Format::Table => self.render_table(),
            Format::Json => {
                let mut s = serde_json::to_string_pretty(self)
                    .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
                s.push('\n');
                s
            }
            Format::Csv => self.render_csv(),
        }
    }

    /// The CSV rendering. The default is lossless but generic: a `field,value` header and one
    /// row per scalar of the JSON form, the field named by its path (`groups.0.cost_usd`).
    fn render_csv(&self) -> String {
        let value = serde_json::to_value(self).unwrap_or_else(|e| {
            serde_json::Value::String(format!("cannot serialise the report: {e}"))
        });
        let mut out = String::from("field,value\n");
        flatten_csv(&value, &mut String::new(), &mut out);
        out
    }
}

/// Appends one `path,value` CSV line per scalar of `v` (see [`Report::render_csv`]).
fn flatten_csv(v: &serde_json::Value, path: &mut String, out: &mut String) {
    use serde_json::Value;
    let child = |key: &str, v: &Value, path: &mut String, out: &mut String| {
        let len = path.len();
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(key);
        flatten_csv(v, path, out);
        path.truncate(len);
    };
    match v {
        Value::Object(map) => map.iter().for_each(|(k, v)| child(k, v, path, out)),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .for_each(|(i, v)| child(&i.to_string(), v, path, out)),
        scalar => {
            let text = match scalar {
                Value::Null => String::new(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push_str(&csv_field(path));
            out.push(',');
            out.push_str(&csv_field(&text));
            out.push('\n');
        }
    }
}

/// A CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// Total tokens of a record (input + output; unknown counts as 0).
pub fn total_tokens(r: &RequestRecord) -> u64 {
    r.input_tokens.unwrap_or(0) + r.output_tokens.unwrap_or(0)
}

/// A new table in the house style.
pub fn table(header: &[&str]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Demo {
        name: &'static str,
        rows: Vec<(u32, Option<f64>)>,
    }

    impl Report for Demo {
        fn render_table(&self) -> String {
            String::new()
        }
    }

    #[test]
    fn formats_and_generic_csv() {
        assert_eq!(parse_format("json").expect("json"), Format::Json);
        assert_eq!(
            parse_format("csv").expect_err("csv").to_string(),
            "format \"csv\": use table or json"
        );
        let d = Demo {
            name: "a,b",
            rows: vec![(1, Some(2.5)), (3, None)],
        };
        assert_eq!(
            d.render(Format::Csv),
            "field,value\nname,\"a,b\"\nrows.0.0,1\nrows.0.1,2.5\nrows.1.0,3\nrows.1.1,\n"
        );
    }
}
