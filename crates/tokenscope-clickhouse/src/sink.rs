//! [`ClickHouseSink`]: the pipeline's [`RecordSink`] for ClickHouse.
//!
//! * `write_batch` inserts the batch in one RowBinary `INSERT` (row version 1). A batch may be
//!   retried: the rows collapse by key (`FINAL`). If the table or database is missing (dropped
//!   by an operator), the sink logs "table … does not exist — recreating", runs
//!   [`ClickHouseStore::migrate`] and retries the insert once, inside the same call.
//! * **Late engine values** (`apply_updates`, [`PhaseUpdate`] joined by trace id): the rows
//!   with the update's trace id are found in a bounded cache of recently written records
//!   ([`DEFAULT_CACHE_ROWS`], oldest evicted first), else by one query per 500 trace ids
//!   (`… FINAL WHERE trace_id IN (…)`, restricted to rows created in the last
//!   [`DEFAULT_LOOKBACK`]); each is updated with [`RequestRecord::apply_update`] (the rule every
//!   store shares) and re-inserted with `row_version + 1`, so the `ReplacingMergeTree` keeps
//!   the updated row. An update that changes nothing is not re-inserted. Applying an update
//!   twice gives the same row.
//! * An update whose row is not found yet waits in [`PendingUpdates`] (bounded, TTL) and is
//!   applied to the record inside a later `write_batch`, before it is inserted (that row is
//!   written with version 2); it is removed from the map only once that insert succeeded, so a
//!   failed batch is retried with it. Same semantics as the SQLite sink.
//!
//! Caveat: the cache only knows rows this sink wrote. If two gateways apply *different*
//! updates to the same row at the same time, both write the same next version and either may
//! win; send a request's engine spans to the gateway that served it (the usual deployment:
//! the engine exports to its own gateway) to avoid that.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use tokenscope_core::{PhaseUpdate, RequestRecord};
use tokenscope_store::pending::merge;
use tokenscope_store::{PendingUpdates, RecordSink, StoreError, UnmatchedCounts};

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
    pending: PendingUpdates,
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
            pending: PendingUpdates::default(),
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

    /// Sets the pending map's limits (see [`PendingUpdates::set_limits`]).
    pub fn set_pending_limits(&mut self, capacity: usize, ttl: Duration) {
        self.pending.set_limits(capacity, ttl);
    }

    /// Updates waiting for their row.
    pub fn pending_updates(&self) -> usize {
        self.pending.len()
    }

    /// Rows held in the recent-rows cache.
    pub fn cached_rows(&self) -> usize {
        self.cache.len
    }

    /// The store this sink writes through.
    pub fn store(&self) -> &ClickHouseStore {
        &self.store
    }

    /// Inserts, recreating a missing table once.
    fn insert_with_repair(&mut self, rows: &[(RequestRecord, u64)]) -> Result<(), ClickHouseError> {
        match self
            .store
            .insert_versioned(rows.iter().map(|(r, v)| (r, *v)))
        {
            Err(e) if e.is_missing_schema() => {
                tracing::warn!(
                    error = %e,
                    "table {} does not exist — recreating",
                    self.store.config().table()
                );
                self.store.migrate()?;
                // Recovered here, but still an error worth counting (see take_recovered).
                self.recovered.push(e);
                self.store
                    .insert_versioned(rows.iter().map(|(r, v)| (r, *v)))
            }
            other => other,
        }
    }

    /// Writes a batch (see [`RecordSink::write_batch`]).
    pub fn write(&mut self, batch: &[RequestRecord]) -> Result<(), ClickHouseError> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut matched: HashSet<&str> = HashSet::new();
        let rows: Vec<(RequestRecord, u64)> = batch
            .iter()
            .map(|r| match self.pending.get(&r.trace_id) {
                Some(u) if !r.trace_id.is_empty() => {
                    matched.insert(&r.trace_id);
                    let mut r = r.clone();
                    r.apply_update(u);
                    (r, 2)
                }
                _ => (r.clone(), 1),
            })
            .collect();
        self.insert_with_repair(&rows)?;
        for id in matched {
            self.pending.take(id);
        }
        for (r, v) in rows {
            self.cache.put(r, v);
        }
        Ok(())
    }

    /// Applies late engine values (see the module docs); returns how many updates found
    /// their row(s) now.
    pub fn update(&mut self, updates: &[PhaseUpdate]) -> Result<usize, ClickHouseError> {
        let now = Instant::now();
        self.pending.expire(now);
        // One merged update per trace id, including what already waited for it.
        let mut merged: Vec<PhaseUpdate> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for u in updates {
            if u.trace_id.is_empty() {
                continue;
            }
            let u = &sanitize(u);
            match index.get(&u.trace_id) {
                Some(&i) => merge(&mut merged[i], u.clone()),
                None => {
                    let mut m =
                        self.pending
                            .get(&u.trace_id)
                            .cloned()
                            .unwrap_or_else(|| PhaseUpdate {
                                trace_id: u.trace_id.clone(),
                                ..PhaseUpdate::default()
                            });
                    merge(&mut m, u.clone());
                    index.insert(u.trace_id.clone(), merged.len());
                    merged.push(m);
                }
            }
        }
        if merged.is_empty() {
            return Ok(0);
        }
        // Current rows: cache first, then one query for the rest.
        let mut current: HashMap<String, Vec<(RequestRecord, u64)>> = HashMap::new();
        let mut missing: Vec<&str> = Vec::new();
        for u in &merged {
            match self.cache.get(&u.trace_id) {
                Some(rows) if !rows.is_empty() => {
                    current.insert(u.trace_id.clone(), rows.clone());
                }
                _ => missing.push(&u.trace_id),
            }
        }
        if !missing.is_empty() {
            let lookback_us = i64::try_from(self.lookback.as_micros()).unwrap_or(i64::MAX);
            let since = now_us().saturating_sub(lookback_us);
            for (r, v) in self.store.rows_by_trace(&missing, since)? {
                current.entry(r.trace_id.clone()).or_default().push((r, v));
            }
        }
        let mut writes: Vec<(RequestRecord, u64)> = Vec::new();
        let mut applied: Vec<String> = Vec::new();
        let mut unmatched: Vec<PhaseUpdate> = Vec::new();
        for u in merged {
            match current.get(&u.trace_id) {
                Some(rows) => {
                    for (r, v) in rows {
                        let mut nr = r.clone();
                        nr.apply_update(&u);
                        if nr != *r {
                            writes.push((nr, v + 1));
                        }
                    }
                    applied.push(u.trace_id);
                }
                None => unmatched.push(u),
            }
        }
        if !writes.is_empty() {
            self.insert_with_repair(&writes)?;
        }
        for (r, v) in writes {
            self.cache.put(r, v);
        }
        for id in &applied {
            self.pending.take(id);
        }
        for u in unmatched {
            self.pending.insert(u, now);
        }
        Ok(applied.len())
    }

    /// Updates given up on since the last call (see [`RecordSink::take_unmatched`]).
    pub fn unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        self.pending.expire(Instant::now());
        if shutting_down {
            self.pending.drain_all();
        }
        self.pending.take_unmatched()
    }
}

/// Drops durations that are not a finite, non-negative number of milliseconds (so a bad value
/// never overwrites a good one in a merge).
fn sanitize(u: &PhaseUpdate) -> PhaseUpdate {
    let ok = |v: Option<f64>| v.filter(|m| m.is_finite() && *m >= 0.0);
    PhaseUpdate {
        trace_id: u.trace_id.clone(),
        queue_duration_ms: ok(u.queue_duration_ms),
        prefill_duration_ms: ok(u.prefill_duration_ms),
        decode_duration_ms: ok(u.decode_duration_ms),
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
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
