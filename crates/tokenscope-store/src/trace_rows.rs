//! Where the rows of a trace are: the writer's in-memory map from trace id to the
//! `created_at` range of the rows that carry it, so a late engine update finds its rows with
//! a seek on the time index instead of a per-row trace id index.
//!
//! Why: a trace id index receives one insert at a random position per row; that alone cost
//! ~40 % of the embedded store's insert rate (see `docs/benchmarks.md`). Engine spans arrive
//! seconds after their request, so the map only needs the recent rows.
//!
//! Invariants:
//! * Bounded: at most `capacity` trace ids (FIFO eviction of the oldest noted); ~55 bytes
//!   each. Updates for traces evicted (or never seen) wait in the pending map and expire
//!   there, counted — they are never applied to a wrong row: the update statement always
//!   compares the full trace id too.
//! * A trace seen on several rows (a client reusing a trace id) keeps the min and max
//!   `created_at` of its rows, so every one of them is updated.
//! * Rebuilt from the newest `capacity` rows when the store is opened, so updates reach rows
//!   written before a restart.

use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;

/// Default number of trace ids remembered: 65 536, ~3.5 MiB at most (u128 key, `created_at`
/// range, FIFO order, hash-table overhead). Engine spans arrive seconds after their request
/// (vLLM's OTLP batch exporter: ≤ 5 s); at 500 req/s this covers the last ~2 minutes. It was
/// 1 048 576 (~55 MiB once full, and allocated at start from a large store) — more than the
/// gateway's whole memory budget.
pub const DEFAULT_TRACE_ROWS: usize = 1 << 16;

/// Compact key of a trace id: its 128 bits when it is 32 hex digits (every id the gateway
/// makes), else a 128-bit hash (the SQL still checks the full id).
fn key(trace_id: &str) -> u128 {
    if trace_id.len() == 32 {
        if let Ok(v) = u128::from_str_radix(trace_id, 16) {
            return v;
        }
    }
    // `DefaultHasher::new()` has fixed keys: the same id maps to the same key every time.
    let h = |seed: u64| {
        let mut s = std::collections::hash_map::DefaultHasher::new();
        s.write_u64(seed);
        s.write(trace_id.as_bytes());
        s.finish()
    };
    (u128::from(h(1)) << 64) | u128::from(h(2))
}

/// The map. See the module docs.
#[derive(Debug)]
pub struct TraceRows {
    capacity: usize,
    ranges: HashMap<u128, (i64, i64)>,
    order: VecDeque<u128>,
}

impl Default for TraceRows {
    fn default() -> Self {
        Self::new(DEFAULT_TRACE_ROWS)
    }
}

impl TraceRows {
    /// An empty map holding at most `capacity` trace ids.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            ranges: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Remembers a row of `trace_id` created at `created_at`.
    pub fn note(&mut self, trace_id: &str, created_at: i64) {
        if trace_id.is_empty() {
            return;
        }
        let k = key(trace_id);
        if let Some(r) = self.ranges.get_mut(&k) {
            r.0 = r.0.min(created_at);
            r.1 = r.1.max(created_at);
            return;
        }
        while self.ranges.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.ranges.remove(&old);
                }
                None => break,
            }
        }
        self.ranges.insert(k, (created_at, created_at));
        self.order.push_back(k);
    }

    /// The `created_at` range `[min, max]` of the rows of `trace_id`, if remembered.
    pub fn range(&self, trace_id: &str) -> Option<(i64, i64)> {
        self.ranges.get(&key(trace_id)).copied()
    }

    /// Trace ids remembered.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Changes the capacity, evicting the oldest entries beyond it.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.ranges.len() > self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.ranges.remove(&old);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ranges_grow_and_oldest_are_evicted() {
        let mut m = TraceRows::new(2);
        m.note("4bf92f3577b34da6a3ce929d0e0e4736", 10);
        m.note("4bf92f3577b34da6a3ce929d0e0e4736", 5);
        m.note("4bf92f3577b34da6a3ce929d0e0e4736", 20);
        assert_eq!(m.range("4bf92f3577b34da6a3ce929d0e0e4736"), Some((5, 20)));
        m.note("not-hex-trace", 7);
        assert_eq!(m.range("not-hex-trace"), Some((7, 7)));
        m.note("00000000000000000000000000000001", 9);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m.range("4bf92f3577b34da6a3ce929d0e0e4736"),
            None,
            "oldest evicted"
        );
        m.note("", 1);
        assert_eq!(m.len(), 2);
        m.set_capacity(1);
        assert_eq!(m.len(), 1);
        assert_eq!(m.range("00000000000000000000000000000001"), Some((9, 9)));
    }

    proptest! {
        /// Against a model: the last `capacity` distinct ids are remembered with the exact
        /// min/max of their noted times since first noted.
        #[test]
        fn matches_model(ops in proptest::collection::vec((0u8..20, -1000i64..1000), 0..300), cap in 1usize..10) {
            let mut m = TraceRows::new(cap);
            let mut model: Vec<(String, i64, i64)> = Vec::new();
            for (id, t) in ops {
                let id = format!("{id:032x}");
                if let Some(e) = model.iter_mut().find(|e| e.0 == id) {
                    e.1 = e.1.min(t);
                    e.2 = e.2.max(t);
                } else {
                    if model.len() >= cap {
                        model.remove(0);
                    }
                    model.push((id.clone(), t, t));
                }
                m.note(&id, t);
            }
            prop_assert_eq!(m.len(), model.len());
            for (id, lo, hi) in &model {
                prop_assert_eq!(m.range(id), Some((*lo, *hi)));
            }
        }
    }
}
