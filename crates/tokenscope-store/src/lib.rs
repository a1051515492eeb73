//! # tokenscope-store
//!
//! The embedded per-request store and everything between the request path and it.
//!
//! * [`sqlite`] — [`SqliteStore`]: the `llm_inference_log` table (one column per
//!   [`RequestRecord`](tokenscope_core::RequestRecord) field, same names), versioned
//!   migrations, WAL mode, batched idempotent inserts, and the row ↔ record mapping.
//! * [`pipeline`] — the hot-path/sink boundary: a bounded queue that the request path feeds
//!   without ever waiting ([`Recorder::record`]), and a dedicated writer thread that batches
//!   rows into a [`RecordSink`] with retries. Every record is either written, or counted as
//!   dropped / lost. Late engine values ([`PhaseUpdate`](tokenscope_core::PhaseUpdate), joined
//!   by trace id) take the same queue ([`Recorder::update`]) and are applied after the
//!   batch's inserts.
//! * [`late`] — late engine updates, decided once for every store ([`LateUpdates`]: merge,
//!   wait, join on insert; the rule is `RequestRecord::apply_update`); a store supplies only
//!   its I/O ([`LateRows`]).
//! * [`pending`] — engine updates that arrived before their row, kept (bounded, with a TTL)
//!   until the row is inserted.
//! * [`report`] — grouped reports with **exact** nearest-rank percentiles (TTFT, TPOT,
//!   end-to-end, engine queue / prefill / decode), the queue share of TTFT, success rate, QPS
//!   and token sums, rendered as a table, JSON or CSV. The aggregation ([`Scanner`]) is
//!   store-independent; other stores feed it rows read in their own dialect.
//! * [`read`] — [`RecordReader`]: the one read interface (records of a window, a report) that
//!   every store implements ([`SqliteStore`] here, ClickHouse in `tokenscope-clickhouse`).
//!
//! The read side's vocabulary (`Window`, [`Dimension`], [`Format`], the nearest-rank
//! percentile) lives in `tokenscope_core::query`; [`Dimension`], [`Format`] and [`NONE_LABEL`]
//! are re-exported here.
//!
//! Invariants:
//! * The request path never performs I/O, never blocks and never awaits on the store: it only
//!   does a `try_send` into a bounded channel.
//! * The queue is bounded (`PipelineConfig::capacity`); when it is full the record is dropped
//!   and counted (observer + counter), never silently.
//! * A row is keyed by `request_id`; re-inserting a batch (a retry) never doubles rows.
//! * Percentiles are computed from every matching value, never from averages or histograms.
#![deny(missing_docs)]

pub mod error;
pub mod late;
pub mod pending;
pub mod pipeline;
pub mod read;
pub mod report;
pub mod spool;
pub mod sqlite;
pub mod trace_rows;

pub use error::{ErrorClass, StoreError};
pub use late::{Joined, LateRows, LateUpdates};
pub use pending::{PendingUpdates, UnmatchedCounts, UnmatchedReason};
pub use pipeline::{
    spawn_pipeline, spawn_pipeline_with_spool, DropReason, LossReason, NoopObserver,
    PipelineConfig, PipelineHandle, PipelineObserver, RecordSink, Recorder, ShutdownReport,
    SpoolState,
};
pub use read::RecordReader;
pub use report::{
    exact_sum_units, finish_groups, mean_of_units, render, run_report, run_report_on,
    run_report_threads, ColKind, Dimension, FilterValue, Format, GroupAgg, Quantiles, ReportQuery,
    ReportRow, ScanValue, Scanner, NONE_LABEL,
};
pub use spool::{Append, Spool, SpoolConfig, SpoolEntry, SpoolError};
pub use sqlite::{FileChange, SqliteStore};
pub use tokenscope_core::usage::{
    self, UnitSum, UsageAcc, UsageQuery, UsageRow, UsageSums, UsageValues, USAGE_DIMENSIONS,
};
