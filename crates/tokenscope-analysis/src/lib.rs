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
//! * [`render`] — the table house style (units in headers, fits the terminal) and the CSV
//!   form shared by every report.
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
pub mod render;
pub mod rules;
pub mod waste;

pub use prices::{ModelPrice, PriceTable};
pub(crate) use render::serde_name;
pub use render::{csv_opt, table, CsvRows};
use serde::Serialize;
use tokenscope_core::RequestRecord;

/// The analysed time range and the output format are the read side's shared vocabulary
/// (`tokenscope_core::query`), re-exported here; so is the one percentile definition.
pub use tokenscope_core::query::{nearest_rank, Format, Window};

/// Errors of the analyses (bad options; the analyses themselves cannot fail).
#[derive(Debug, thiserror::Error)]
pub enum AnalysisError {
    /// An option value is not valid.
    #[error("{0}")]
    InvalidOption(String),
}

/// A report every analysis command prints: JSON, a table or CSV.
pub trait Report: Serialize {
    /// The human-readable rendering.
    fn render_table(&self) -> String;

    /// The report's main table as CSV rows (JSON carries the whole report).
    fn csv_rows(&self) -> CsvRows;

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
            Format::Csv => self.csv_rows().to_csv(),
        }
    }
}

/// Total tokens of a record (input + output; unknown counts as 0).
pub fn total_tokens(r: &RequestRecord) -> u64 {
    r.input_tokens.unwrap_or(0) + r.output_tokens.unwrap_or(0)
}
