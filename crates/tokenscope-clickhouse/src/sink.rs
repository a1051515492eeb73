//! [`ClickHouseSink`]: the pipeline's [`RecordSink`] for ClickHouse.
//!
//! * `write_batch` inserts the batch in one RowBinary `INSERT` (row version 1). A batch may be
//!   retried: the rows collapse by key (`FINAL`). If the table or database is missing (dropped
//!   by an operator), the sink logs "table … does not exist — recreating", runs
//!   [`ClickHouseStore::migrate`] and retries the insert once, inside the same call.
//! * **Late engine values** (`apply_updates`, [`PhaseUpdate`] joined by trace id) follow
//!   [`tokenscope_store::late`] — the rule, merging, waiting and the insert-time join, shared
//!   with the SQLite store. This sink supplies the I/O ([`LateRows`]): the rows of a trace
//!   are found in a bounded cache of recently written records ([`DEFAULT_CACHE_ROWS`], oldest
//!   evicted first), else by one query per 500 trace ids (`… FINAL WHERE trace_id IN (…)`,
//!   restricted to rows created in the last [`DEFAULT_LOOKBACK`]); a row the rule changed is
//!   re-inserted with `row_version + 1`, so the `ReplacingMergeTree` keeps the updated row (an
//!   unchanged one is not re-inserted). A record that gets a waiting update before its first
//!   insert is written with version 2.
//!
//! Caveat: the cache only knows rows this sink wrote. If two gateways apply *different*
//! updates to the same row at the same time, both write the same next version and either may
//! win; send a request's engine spans to the gateway that served it (the usual deployment:
//! the engine exports to its own gateway) to avoid that.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokenscope_core::{PhaseUpdate, RequestRecord};
use tokenscope_store::{LateRows, LateUpdates, RecordSink, StoreError, UnmatchedCounts};

use crate::store::now_us;
use crate::{ClickHouseError, ClickHouseStore};

/// Default number of recently written rows kept to apply late updates without a query.
pub const DEFAULT_CACHE_ROWS: usize = 50_000;
/// Default age limit of the rows a late update is looked up among (by `created_at`).
pub const DEFAULT_LOOKBACK: Duration = Duration::from_secs(2 * 86_400);

/// Recently written records by trace id, bounded, oldest evicted first.
#[derive(Debug, Default)]
struct RecentRows {
    by_trace: HashMap<String, Vec<(RequestRecord, u64)>>,
    order: VecDeque<(String, String)>,
    len: usize,
    capacity: usize,
}

impl RecentRows {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    fn get(&self, trace_id: &str) -> Option<&Vec<(RequestRecord, u64)>> {
        self.by_trace.get(trace_id)
    }

    /// Inserts or replaces (same request id) a record.
    fn put(&mut self, r: RequestRecord, version: u64) {
        if self.capacity == 0 {
            return;
        }
        let rows = self.by_trace.entry(r.trace_id.clone()).or_default();
        if let Some(slot) = rows.iter_mut().find(|(x, _)| x.request_id == r.request_id) {
            if version >= slot.1 {
                *slot = (r, version);
            }
            return;
        }
        self.order
            .push_back((r.trace_id.clone(), r.request_id.clone()));
        rows.push((r, version));
        self.len += 1;
        while self.len > self.capacity {
            let Some((trace, id)) = self.order.pop_front() else {
                break;
            };
            if let Some(rows) = self.by_trace.get_mut(&trace) {
                let before = rows.len();
                rows.retain(|(x, _)| x.request_id != id);
                self.len -= before - rows.len();
                if rows.is_empty() {
                    self.by_trace.remove(&trace);
                }
            }
        }
    }
}

/// The ClickHouse [`RecordSink`] (`name() = "clickhouse"`). See the module docs.
#[derive(Debug)]
pub struct ClickHouseSink {
    store: ClickHouseStore,
    cache: RecentRows,
    late: LateUpdates,
    lookback: Duration,
    /// Errors recovered from inside a write (a recreated table), for the pipeline's metrics.
    recovered: Vec<ClickHouseError>,
}

impl ClickHouseSink {
    /// A sink writing through `store` (whose schema should be migrated already; a missing
    /// table is recreated on the first failing write).
    pub fn new(store: ClickHouseStore) -> Self {
        Self {
            store,
            cache: RecentRows::new(DEFAULT_CACHE_ROWS),
            late: LateUpdates::default(),
            lookback: DEFAULT_LOOKBACK,
            recovered: Vec::new(),
        }
    }

    /// Keeps at most `rows` recently written records for late updates (0 disables the cache:
    /// every update is looked up by a query).
    pub fn with_cache_rows(mut self, rows: usize) -> Self {
        self.cache = RecentRows::new(rows);
        self
    }

    /// Looks late updates up among rows created at most `lookback` ago.
    pub fn with_lookback(mut self, lookback: Duration) -> Self {
        self.lookback = lookback;
        self
    }

    /// Sets the pending map's limits (see [`LateUpdates::set_limits`]).
    pub fn set_pending_limits(&mut self, capacity: usize, ttl: Duration) {
        self.late.set_limits(capacity, ttl);
    }

    /// Updates waiting for their row.
    pub fn pending_updates(&self) -> usize {
        self.late.waiting()
    }

    /// Rows held in the recent-rows cache.
    pub fn cached_rows(&self) -> usize {
        self.cache.len
    }

    /// The store this sink writes through.
    pub fn store(&self) -> &ClickHouseStore {
        &self.store
    }

    /// Writes a batch (see [`RecordSink::write_batch`]), with the updates waiting for its
    /// records joined in.
    pub fn write(&mut self, batch: &[RequestRecord]) -> Result<(), ClickHouseError> {
        if batch.is_empty() {
            return Ok(());
        }
        let joined = self.late.join(batch);
        let rows: Vec<(RequestRecord, u64)> = joined
            .records()
            .iter()
            .enumerate()
            .map(|(i, r)| (r.clone(), if joined.is_joined(i) { 2 } else { 1 }))
            .collect();
        insert_with_repair(&self.store, &mut self.recovered, &rows)?;
        self.late.inserted(&joined);
        for (r, v) in rows {
            self.cache.put(r, v);
        }
        Ok(())
    }

    /// Applies late engine values (see the module docs); returns how many trace ids found
    /// their row(s) now.
    pub fn update(&mut self, updates: &[PhaseUpdate]) -> Result<usize, ClickHouseError> {
        let lookback_us = i64::try_from(self.lookback.as_micros()).unwrap_or(i64::MAX);
        let mut rows = VersionedRows {
            store: &self.store,
            cache: &mut self.cache,
            recovered: &mut self.recovered,
            since_us: now_us().saturating_sub(lookback_us),
        };
        self.late.apply(updates, &mut rows, Instant::now())
    }

    /// Updates given up on since the last call (see [`RecordSink::take_unmatched`]).
    pub fn unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        self.late.take_unmatched(shutting_down, Instant::now())
    }
}

/// Inserts `rows` with their versions, recreating a missing table once (the error is kept in
/// `recovered` for the pipeline's metrics).
fn insert_with_repair(
    store: &ClickHouseStore,
    recovered: &mut Vec<ClickHouseError>,
    rows: &[(RequestRecord, u64)],
) -> Result<(), ClickHouseError> {
    match store.insert_versioned(rows.iter().map(|(r, v)| (r, *v))) {
        Err(e) if e.is_missing_schema() => {
            tracing::warn!(
                error = %e,
                "table {} does not exist — recreating",
                store.config().table()
            );
            store.migrate()?;
            // Recovered here, but still an error worth counting (see take_recovered).
            recovered.push(e);
            store.insert_versioned(rows.iter().map(|(r, v)| (r, *v)))
        }
        other => other,
    }
}

/// This sink's I/O for late updates (see the module docs): rows from the recent-rows cache,
/// else one query; a changed row is re-inserted with the next version.
struct VersionedRows<'s> {
    store: &'s ClickHouseStore,
    cache: &'s mut RecentRows,
    recovered: &'s mut Vec<ClickHouseError>,
    /// Rows created before this (epoch µs) are not looked up.
    since_us: i64,
}

impl LateRows for VersionedRows<'_> {
    type Tag = u64;
    type Error = ClickHouseError;

    fn find(&mut self, trace_ids: &[&str]) -> Result<Vec<(RequestRecord, u64)>, ClickHouseError> {
        let mut rows = Vec::new();
        let mut missing: Vec<&str> = Vec::new();
        for id in trace_ids {
            match self.cache.get(id) {
                Some(cached) if !cached.is_empty() => rows.extend(cached.iter().cloned()),
                _ => missing.push(id),
            }
        }
        if !missing.is_empty() {
            rows.extend(self.store.rows_by_trace(&missing, self.since_us)?);
        }
        Ok(rows)
    }

    fn write(&mut self, changed: Vec<(RequestRecord, u64)>) -> Result<(), ClickHouseError> {
        let rows: Vec<(RequestRecord, u64)> =
            changed.into_iter().map(|(r, v)| (r, v + 1)).collect();
        if !rows.is_empty() {
            insert_with_repair(self.store, self.recovered, &rows)?;
        }
        for (r, v) in rows {
            self.cache.put(r, v);
        }
        Ok(())
    }
}

impl RecordSink for ClickHouseSink {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        Ok(self.write(batch)?)
    }

    fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        self.update(updates)?;
        Ok(())
    }

    fn take_unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        self.unmatched(shutting_down)
    }

    fn take_recovered(&mut self) -> Vec<StoreError> {
        std::mem::take(&mut self.recovered)
            .into_iter()
            .map(StoreError::from)
            .collect()
    }

    fn name(&self) -> &'static str {
        "clickhouse"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, trace: &str) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            trace_id: trace.to_owned(),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn recent_rows_bounded_and_replacing() {
        let mut c = RecentRows::new(3);
        c.put(rec("a", "t1"), 1);
        c.put(rec("b", "t1"), 1);
        c.put(rec("c", "t2"), 1);
        assert_eq!(c.len, 3);
        // Replacing keeps the count, a lower version never replaces a higher one.
        let mut a2 = rec("a", "t1");
        a2.model = "m".to_owned();
        c.put(a2.clone(), 2);
        c.put(rec("a", "t1"), 1);
        assert_eq!(c.len, 3);
        assert_eq!(c.get("t1").map(|v| v[0].clone()), Some((a2, 2)));
        c.put(rec("d", "t3"), 1);
        assert_eq!(c.len, 3);
        assert_eq!(c.get("t1").map(Vec::len), Some(1)); // "a" evicted
        c.put(rec("e", "t3"), 1);
        assert!(c.get("t1").is_none());
        assert_eq!(c.by_trace.len(), 2);
        let mut off = RecentRows::new(0);
        off.put(rec("a", "t"), 1);
        assert!(off.get("t").is_none());
    }
}
