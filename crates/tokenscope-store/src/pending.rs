//! [`PendingUpdates`]: engine updates ([`PhaseUpdate`]) that arrived before the row they
//! belong to, waiting for that row.
//!
//! An engine span (vLLM / SGLang OTLP) can reach the store while the gateway still holds the
//! request's record (the stream is finishing, the record is queued): the update then matches
//! no row. The store keeps it here, keyed by trace id, and applies it when a row with that
//! trace id is inserted.
//!
//! Invariants:
//! * **Bounded**: at most [`PendingUpdates::capacity`] trace ids are held. Inserting a new
//!   trace id into a full map evicts the oldest entry first (counted as
//!   [`UnmatchedCounts::overflow`]).
//! * **Bounded in time**: an entry older than [`PendingUpdates::ttl`] (measured from its
//!   first arrival, on the monotonic clock) is removed by the next call that takes a `now`
//!   and counted as [`UnmatchedCounts::expired`]. Expiry is lazy: nothing happens while the
//!   store is idle.
//! * **One entry per trace id**: a second update for a trace id already waiting is merged
//!   into it ([`PhaseUpdate::merge`]: each `Some` field of the newer update replaces the older
//!   value, `None` keeps it) without renewing the entry's age.
//! * Every update handed to [`PendingUpdates::insert`] ends up in exactly one of: taken back
//!   by [`PendingUpdates::take`] (to be applied), merged into another one, or counted as
//!   unmatched (overflow, expired, or [`PendingUpdates::drain_all`] at shutdown).
//! * Pure data structure: no I/O, the clock is passed in. What is parked, when, and what is
//!   done with it when the row arrives is decided by [`crate::late`].

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokenscope_core::PhaseUpdate;

/// Default capacity of the pending map (trace ids).
pub const DEFAULT_PENDING_CAPACITY: usize = 10_000;
/// Default time an update waits for its row.
pub const DEFAULT_PENDING_TTL: Duration = Duration::from_secs(600);

/// Why an update was given up on without being applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnmatchedReason {
    /// The pending map was full; the oldest waiting update was evicted.
    Overflow,
    /// No row with its trace id arrived within the TTL.
    Expired,
    /// The store shut down while it was still waiting.
    Shutdown,
    /// The sink failed to apply it (after every retry).
    WriteFailed,
}

impl UnmatchedReason {
    /// Every variant, in a stable order.
    pub const ALL: [UnmatchedReason; 4] = [
        UnmatchedReason::Overflow,
        UnmatchedReason::Expired,
        UnmatchedReason::Shutdown,
        UnmatchedReason::WriteFailed,
    ];

    /// Stable lower-case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            UnmatchedReason::Overflow => "overflow",
            UnmatchedReason::Expired => "expired",
            UnmatchedReason::Shutdown => "shutdown",
            UnmatchedReason::WriteFailed => "write_failed",
        }
    }
}

/// Updates given up on since the last [`take_unmatched`](crate::RecordSink::take_unmatched).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UnmatchedCounts {
    /// Evicted because the map was full.
    pub overflow: u64,
    /// Expired after the TTL.
    pub expired: u64,
    /// Still waiting at shutdown.
    pub shutdown: u64,
}

impl UnmatchedCounts {
    /// `(reason, count)` for every non-zero count.
    pub fn nonzero(self) -> impl Iterator<Item = (UnmatchedReason, u64)> {
        [
            (UnmatchedReason::Overflow, self.overflow),
            (UnmatchedReason::Expired, self.expired),
            (UnmatchedReason::Shutdown, self.shutdown),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
    }

    /// Sum of all counts.
    pub fn total(self) -> u64 {
        self.overflow + self.expired + self.shutdown
    }
}

#[derive(Debug)]
struct Entry {
    update: PhaseUpdate,
    /// Distinguishes this entry from an older one with the same trace id in `order`.
    seq: u64,
}

/// Bounded, TTL-limited map trace id → waiting update. See the module docs.
#[derive(Debug)]
pub struct PendingUpdates {
    map: HashMap<String, Entry>,
    /// `(arrival, seq, trace id)`, oldest first. May hold stale items (taken or re-inserted
    /// trace ids), recognised by a `seq` mismatch and skipped.
    order: VecDeque<(Instant, u64, String)>,
    next_seq: u64,
    capacity: usize,
    ttl: Duration,
    unmatched: UnmatchedCounts,
}

impl Default for PendingUpdates {
    fn default() -> Self {
        Self::new(DEFAULT_PENDING_CAPACITY, DEFAULT_PENDING_TTL)
    }
}

impl PendingUpdates {
    /// An empty map holding at most `capacity` (at least 1) trace ids for at most `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            next_seq: 0,
            capacity: capacity.max(1),
            ttl,
            unmatched: UnmatchedCounts::default(),
        }
    }

    /// Maximum number of trace ids held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How long an update waits for its row.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Changes the limits; when the map holds more than the new capacity, the oldest
    /// entries are evicted (counted as overflow). The new TTL applies to waiting entries too.
    pub fn set_limits(&mut self, capacity: usize, ttl: Duration) {
        self.capacity = capacity.max(1);
        self.ttl = ttl;
        while self.map.len() > self.capacity {
            if self.pop_oldest().is_none() {
                break;
            }
            self.unmatched.overflow += 1;
        }
    }

    /// Trace ids currently waiting.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// `true` when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// `true` when an update for `trace_id` waits.
    pub fn contains(&self, trace_id: &str) -> bool {
        self.map.contains_key(trace_id)
    }

    /// Parks `update` (arrived at `now`), merging it into a waiting one with the same trace
    /// id. Expires old entries first; evicts the oldest when full.
    pub fn insert(&mut self, update: PhaseUpdate, now: Instant) {
        self.expire(now);
        if let Some(e) = self.map.get_mut(&update.trace_id) {
            e.update.merge(&update);
            return;
        }
        while self.map.len() >= self.capacity {
            match self.pop_oldest() {
                Some(_) => self.unmatched.overflow += 1,
                None => break,
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.push_back((now, seq, update.trace_id.clone()));
        self.map
            .insert(update.trace_id.clone(), Entry { update, seq });
    }

    /// The update waiting for `trace_id`, if any (left in place).
    pub fn get(&self, trace_id: &str) -> Option<&PhaseUpdate> {
        self.map.get(trace_id).map(|e| &e.update)
    }

    /// Removes and returns the update waiting for `trace_id`, if any.
    pub fn take(&mut self, trace_id: &str) -> Option<PhaseUpdate> {
        let e = self.map.remove(trace_id)?;
        // Its `order` item is now stale; drop stale items at the front eagerly so `order`
        // does not grow past the live entries by more than the out-of-order removals.
        self.trim_stale_front();
        Some(e.update)
    }

    /// Removes entries older than the TTL at `now`, counting them as expired.
    pub fn expire(&mut self, now: Instant) {
        while let Some((at, _, _)) = self.order.front() {
            if now.saturating_duration_since(*at) < self.ttl {
                break;
            }
            if self.pop_oldest().is_some() {
                self.unmatched.expired += 1;
            }
        }
        self.trim_stale_front();
        // `order` only grows with inserts and shrinks from the front; after many
        // out-of-order `take`s it can hold many stale items: compact when it is mostly stale.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(_, seq, id)| map.get(id).is_some_and(|e| e.seq == *seq));
        }
    }

    /// Empties the map (shutdown), counting every waiting update as unmatched.
    pub fn drain_all(&mut self) {
        self.unmatched.shutdown += self.map.len() as u64;
        self.map.clear();
        self.order.clear();
    }

    /// The unmatched counts accumulated since the last call, resetting them.
    pub fn take_unmatched(&mut self) -> UnmatchedCounts {
        std::mem::take(&mut self.unmatched)
    }

    /// Removes the oldest live entry.
    fn pop_oldest(&mut self) -> Option<PhaseUpdate> {
        while let Some((_, seq, id)) = self.order.pop_front() {
            if self.map.get(&id).is_some_and(|e| e.seq == seq) {
                return self.map.remove(&id).map(|e| e.update);
            }
        }
        None
    }

    fn trim_stale_front(&mut self) {
        while let Some((_, seq, id)) = self.order.front() {
            if self.map.get(id).is_some_and(|e| e.seq == *seq) {
                break;
            }
            self.order.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(trace: &str, queue: Option<f64>, prefill: Option<f64>) -> PhaseUpdate {
        PhaseUpdate {
            trace_id: trace.to_owned(),
            queue_duration_ms: queue,
            prefill_duration_ms: prefill,
            ..PhaseUpdate::default()
        }
    }

    #[test]
    fn insert_take_and_merge() {
        let t0 = Instant::now();
        let mut p = PendingUpdates::new(10, Duration::from_secs(60));
        assert!(p.is_empty());
        p.insert(up("a", Some(1.0), None), t0);
        p.insert(up("a", None, Some(2.0)), t0);
        p.insert(up("a", Some(3.0), None), t0);
        assert_eq!(p.len(), 1);
        assert!(p.contains("a"));
        assert_eq!(p.take("a"), Some(up("a", Some(3.0), Some(2.0))));
        assert_eq!(p.take("a"), None);
        assert!(p.is_empty());
        assert_eq!(p.take_unmatched(), UnmatchedCounts::default());
    }

    #[test]
    fn overflow_evicts_oldest_and_counts() {
        let t0 = Instant::now();
        let mut p = PendingUpdates::new(3, Duration::from_secs(60));
        for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            p.insert(
                up(id, Some(i as f64), None),
                t0 + Duration::from_millis(i as u64),
            );
        }
        assert_eq!(p.len(), 3);
        assert!(!p.contains("a") && !p.contains("b"));
        assert!(p.contains("c") && p.contains("d") && p.contains("e"));
        let u = p.take_unmatched();
        assert_eq!((u.overflow, u.expired, u.shutdown), (2, 0, 0));
        // Counts are reset by take_unmatched.
        assert_eq!(p.take_unmatched().total(), 0);
        // A taken entry frees its slot and is not evicted later (stale order item skipped).
        assert!(p.take("d").is_some());
        p.insert(up("f", None, None), t0);
        assert_eq!(p.len(), 3);
        assert_eq!(p.take_unmatched().overflow, 0);
        p.insert(up("g", None, None), t0);
        assert!(!p.contains("c"));
        assert!(p.contains("e") && p.contains("f") && p.contains("g"));
        assert_eq!(p.take_unmatched().overflow, 1);
    }

    #[test]
    fn ttl_expiry_is_counted_and_merge_keeps_age() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(600);
        let mut p = PendingUpdates::new(100, ttl);
        p.insert(up("old", Some(1.0), None), t0);
        p.insert(up("young", Some(1.0), None), t0 + Duration::from_secs(300));
        // A merge does not renew "old".
        p.insert(up("old", None, Some(5.0)), t0 + Duration::from_secs(599));
        p.expire(t0 + ttl - Duration::from_micros(1));
        assert_eq!(p.len(), 2);
        p.expire(t0 + ttl);
        assert_eq!(p.len(), 1);
        assert!(p.contains("young"));
        assert_eq!(p.take_unmatched().expired, 1);
        // insert() expires too.
        p.insert(up("new", None, None), t0 + Duration::from_secs(900));
        assert!(!p.contains("young"));
        assert_eq!(p.take_unmatched().expired, 1);
        p.drain_all();
        assert!(p.is_empty());
        assert_eq!(p.take_unmatched().shutdown, 1);
    }

    #[test]
    fn order_stays_bounded_under_out_of_order_takes() {
        let t0 = Instant::now();
        let mut p = PendingUpdates::new(10_000, Duration::from_secs(60));
        p.insert(up("anchor", None, None), t0);
        for i in 0..10_000 {
            let id = format!("t{i}");
            p.insert(up(&id, None, None), t0);
            assert!(p.take(&id).is_some());
        }
        assert_eq!(p.len(), 1);
        assert!(p.order.len() <= 2 * p.len() + 65, "{}", p.order.len());
        assert_eq!(p.take_unmatched().total(), 0);
    }

    #[test]
    fn capacity_zero_is_one() {
        let p = PendingUpdates::new(0, Duration::from_secs(1));
        assert_eq!(p.capacity(), 1);
        assert_eq!(p.ttl(), Duration::from_secs(1));
        assert_eq!(
            UnmatchedReason::ALL.map(UnmatchedReason::as_str),
            ["overflow", "expired", "shutdown", "write_failed"]
        );
    }
}
