//! The read side of every store: [`RecordReader`], one trait for loading the records of a
//! window and running a grouped report, so that the dashboard, the budget seed, the analysis
//! commands and `tokenscope report` are written once for all stores.
//!
//! Implemented here by [`SqliteStore`] (opened read-only by the caller) and by
//! `tokenscope_clickhouse::ClickHouseStore`; `tokenscope_backend::open_reader` maps a store
//! URL to the right one.
//!
//! Invariants (every implementation):
//! * [`RecordReader::records_between`] returns every record created in
//!   `[since_us, until_us)`, each request once (its newest version), ordered by `created_at`
//!   then `request_id` — so the same records give the same rows, in the same order, on every
//!   store.
//! * [`RecordReader::usage`] gives [`crate::usage`]'s rows, bit for bit, on every store.
//! * [`RecordReader::slowest`] gives the same records in the same order on every store.
//! * [`RecordReader::report`] gives the result of [`crate::report::run_report`]'s semantics,
//!   bit for bit, on every store (same [`Scanner`](crate::Scanner)).
//! * The trait is object-safe and its implementations are `Send` (a reader may be opened on
//!   one thread and used on a blocking worker).

use tokenscope_core::query::{Dimension, Window};
use tokenscope_core::RequestRecord;

use crate::report::{run_report, ReportQuery, ReportRow};
use crate::{SqliteStore, StoreError};
use tokenscope_core::usage::{UsageQuery, UsageRow};

/// Reads records and runs report queries against one store (see the module docs).
pub trait RecordReader: Send {
    /// Every record created in `window`, ordered by `created_at`, `request_id`.
    fn records_between(&self, window: Window) -> Result<Vec<RequestRecord>, StoreError>;

    /// Runs a grouped report (see [`crate::report`] for the semantics).
    fn report(&self, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError>;

    /// Token and cost sums per (group, model) of a window (see [`crate::usage`]), computed
    /// by the store: the caller holds one row per group.
    fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError>;

    /// The `limit` records of `window` passing `filters` (the report's filter semantics)
    /// with the longest end to end, slowest first, ties by `request_id`: the caller holds
    /// `limit` records, whatever the window's row count.
    fn slowest(
        &self,
        window: Window,
        filters: &[(Dimension, String)],
        limit: usize,
    ) -> Result<Vec<RequestRecord>, StoreError>;

    /// A short name of the store kind (`sqlite`, `clickhouse`), for logs.
    fn kind(&self) -> &'static str;
}

impl RecordReader for SqliteStore {
    fn records_between(&self, window: Window) -> Result<Vec<RequestRecord>, StoreError> {
        SqliteStore::records_between(self, window.since_us, window.until_us)
    }

    fn report(&self, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        run_report(self, q)
    }

    fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        SqliteStore::usage(self, q)
    }

    fn slowest(
        &self,
        window: Window,
        filters: &[(Dimension, String)],
        limit: usize,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        SqliteStore::slowest(self, window, filters, limit)
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Dimension;
    use crate::sqlite::tests::sparse_record;

    #[test]
    fn sqlite_reader_is_a_trait_object() {
        let mut s = SqliteStore::open_in_memory().expect("open");
        let recs: Vec<RequestRecord> = [("b", 20), ("a", 20), ("c", 10), ("d", 99)]
            .iter()
            .map(|(id, at)| {
                let mut r = sparse_record(id);
                r.created_at = *at;
                r
            })
            .collect();
        s.insert_batch(&recs).expect("insert");
        let reader: Box<dyn RecordReader> = Box::new(s);
        let got: Vec<String> = reader
            .records_between(Window::new(10, 50))
            .expect("read")
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(got, ["c", "a", "b"]);
        let q = ReportQuery {
            since_us: 0,
            until_us: Some(100),
            group_by: vec![Dimension::Model],
            ..ReportQuery::default()
        };
        let rows = reader.report(&q).expect("report");
        assert_eq!(rows.iter().map(|r| r.count).sum::<u64>(), 4);
        assert_eq!(reader.kind(), "sqlite");
    }
}
