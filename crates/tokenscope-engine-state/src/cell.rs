//! The lock-free cell a scraper publishes into and the request path reads from.
//!
//! Invariants:
//! * Readers never block and never take a lock: the value is an `ArcSwapOption` (one atomic
//!   load plus a hazard-pointer style debt slot), the counters are atomics.
//! * A reader sees one whole published value or none: fields of a snapshot always come from
//!   the same scrape (no torn reads across fields, unlike per-field atomics).
//! * `None` means "unknown": never scraped yet, or the last scrape failed. A failed scrape
//!   clears the value rather than leaving a stale one behind.
//! * Dropping the last owner cancels the scraper (its task holds only a `Weak`).

use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// A published value and when its scrape completed.
#[derive(Debug)]
pub(crate) struct Timed<T> {
    pub(crate) value: T,
    pub(crate) at: Instant,
}

#[derive(Debug)]
pub(crate) struct StateCell<T> {
    value: ArcSwapOption<Timed<T>>,
    last_error: ArcSwapOption<String>,
    attempts: AtomicU64,
    failures: AtomicU64,
    pub(crate) stop: CancellationToken,
}

impl<T> StateCell<T> {
    pub(crate) fn new() -> Self {
        Self {
            value: ArcSwapOption::empty(),
            last_error: ArcSwapOption::empty(),
            attempts: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            stop: CancellationToken::new(),
        }
    }

    /// Lock-free read through a closure, without cloning the `Arc`.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&Timed<T>) -> R) -> Option<R> {
        let guard = self.value.load();
        guard.as_deref().map(f)
    }

    pub(crate) fn publish(&self, value: T) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.value.store(Some(Arc::new(Timed {
            value,
            at: Instant::now(),
        })));
        self.last_error.store(None);
    }

    pub(crate) fn fail(&self, error: String) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.value.store(None);
        self.last_error.store(Some(Arc::new(error)));
    }

    /// Marks the cell as never going to be scraped, with the reason.
    pub(crate) fn set_reason(&self, reason: String) {
        self.last_error.store(Some(Arc::new(reason)));
    }

    pub(crate) fn last_error(&self) -> Option<String> {
        self.last_error.load().as_deref().cloned()
    }

    pub(crate) fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

impl<T> Drop for StateCell<T> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
