//! Tail sampling: whether a finished request's trace is kept, decided when it ends.
//!
//! Rules, first match wins (the reason is a metric label and a span attribute):
//! 1. `error` — any outcome other than `ok` and `cancelled` (client errors, upstream errors,
//!    timeouts);
//! 2. `cancelled` — the client went away;
//! 3. `slow` — end-to-end latency at or above the absolute threshold, when one is set;
//! 4. `slow_p99` — latency above the running P99 estimate of the request's model and input
//!    bucket, once that key has seen `p99_min_samples` successful requests;
//! 5. `ratio` — `ratio` of everything else, decided from the trace id (the lower 64 bits, as
//!    OpenTelemetry's `TraceIdRatioBased` does), so every replica decides the same for a trace;
//! 6. otherwise dropped.
//!
//! Invariants:
//! * Deciding never blocks on I/O: one short mutex section per request, for the P99 window.
//! * The P99 estimate of a key is computed *before* the request's own latency is added, and
//!   only successful requests feed it (errors and cancellations are kept anyway, and a burst
//!   of timeouts must not raise the bar for slow successes).
//! * Memory is bounded: at most [`MAX_KEYS`] (model, bucket) windows, each a fixed array.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Duration;
use tokenscope_core::{Outcome, RequestRecord};

use crate::context::TraceId;

/// Most (model, input bucket) keys with their own P99 window; later keys share one window.
pub const MAX_KEYS: usize = 4096;

/// Why a trace was kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeepReason {
    /// An error outcome.
    Error,
    /// The client cancelled.
    Cancelled,
    /// At or above the absolute slow threshold.
    Slow,
    /// Above the running P99 of its model and input bucket.
    SlowP99,
    /// The random fraction of the rest.
    Ratio,
}

impl KeepReason {
    /// Metric label / span attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            KeepReason::Error => "error",
            KeepReason::Cancelled => "cancelled",
            KeepReason::Slow => "slow",
            KeepReason::SlowP99 => "slow_p99",
            KeepReason::Ratio => "ratio",
        }
    }
}

/// The sampler's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Export the trace.
    Keep(KeepReason),
    /// Drop it (no span is built).
    Drop,
}

impl Decision {
    /// The keep reason, if kept.
    pub fn kept(self) -> Option<KeepReason> {
        match self {
            Decision::Keep(r) => Some(r),
            Decision::Drop => None,
        }
    }
}

/// Sampler settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Fraction of the remaining requests kept, in `[0, 1]`.
    pub ratio: f64,
    /// Keep every request at least this slow.
    pub slow_threshold: Option<Duration>,
    /// Keep requests above the running P99 of their model and input bucket.
    pub slow_above_p99: bool,
    /// Successful requests a key needs before its P99 is used.
    pub p99_min_samples: u32,
    /// Requests per window half: the estimate covers the last one to two windows.
    pub p99_window: u32,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            ratio: 0.01,
            slow_threshold: None,
            slow_above_p99: true,
            p99_min_samples: 200,
            p99_window: 5000,
        }
    }
}

/// Whether `trace_id` falls in the kept `ratio` (deterministic per trace id).
pub fn ratio_keeps(trace_id: &TraceId, ratio: f64) -> bool {
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 || ratio.is_nan() {
        return false;
    }
    let mut low = [0u8; 8];
    low.copy_from_slice(&trace_id[8..16]);
    // Compare on 63 bits, as the OpenTelemetry SDKs do.
    let x = u64::from_be_bytes(low) >> 1;
    let bound = (ratio * (1u64 << 63) as f64) as u64;
    x < bound
}

/// Log-scale latency histogram: bins 5 % wide from 0.1 ms to beyond an hour.
const BINS: usize = 420;
const MIN_MS: f64 = 0.1;
const GROWTH: f64 = 1.05;

fn bin_of(ms: f64) -> usize {
    // NaN and everything up to MIN_MS fall in bin 0.
    if ms.is_nan() || ms <= MIN_MS {
        return 0;
    }
    let b = ((ms / MIN_MS).ln() / GROWTH.ln()).floor() as usize + 1;
    b.min(BINS - 1)
}

/// Upper edge (ms) of bin `b`.
fn bin_upper(b: usize) -> f64 {
    MIN_MS * GROWTH.powi(b as i32)
}

/// Two alternating halves: the estimate reads both, the newer fills until `window`, then the
/// older is cleared and becomes the newer.
#[derive(Clone)]
struct LatencyWindow {
    halves: [Box<[u32; BINS]>; 2],
    counts: [u32; 2],
    current: usize,
}

impl LatencyWindow {
    fn new() -> Self {
        Self {
            halves: [Box::new([0; BINS]), Box::new([0; BINS])],
            counts: [0; 2],
            current: 0,
        }
    }

    fn samples(&self) -> u32 {
        self.counts[0] + self.counts[1]
    }

    /// Upper edge of the bin holding the nearest-rank P99 (an overestimate by < 5 %, so a
    /// request "above P99" is really above it).
    fn p99_ms(&self) -> f64 {
        let n = self.samples();
        let rank = ((f64::from(n) * 0.99).ceil() as u32).max(1);
        let mut seen = 0u32;
        for b in 0..BINS {
            seen += self.halves[0][b] + self.halves[1][b];
            if seen >= rank {
                return bin_upper(b);
            }
        }
        f64::INFINITY
    }

    fn add(&mut self, ms: f64, window: u32) {
        if self.counts[self.current] >= window {
            self.current ^= 1;
            self.halves[self.current].fill(0);
            self.counts[self.current] = 0;
        }
        self.halves[self.current][bin_of(ms)] += 1;
        self.counts[self.current] += 1;
    }
}

/// A P99 key: (bounded model label, input bucket).
type Key = (String, &'static str);

/// The tail sampler. Shared by every request (`&self`).
pub struct TailSampler {
    cfg: SamplerConfig,
    windows: Mutex<HashMap<(String, &'static str), LatencyWindow>>,
    /// The fleet's P99 per key (`[fleet]`: computed by the store over every replica's recent
    /// successful requests), with its sample count; used instead of this replica's own window
    /// when it has at least `p99_min_samples` values.
    fleet: Mutex<HashMap<Key, (u64, f64)>>,
}

impl std::fmt::Debug for TailSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TailSampler")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl TailSampler {
    /// A sampler with these settings.
    pub fn new(cfg: SamplerConfig) -> Self {
        Self {
            cfg,
            windows: Mutex::new(HashMap::new()),
            fleet: Mutex::new(HashMap::new()),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Decides for a finished request. `model_label` is the bounded model label (the metrics'
    /// one), so the number of P99 keys stays bounded.
    pub fn decide(&self, rec: &RequestRecord, model_label: &str, trace_id: &TraceId) -> Decision {
        match rec.outcome {
            Outcome::Ok => {}
            Outcome::Cancelled => return Decision::Keep(KeepReason::Cancelled),
            _ => return Decision::Keep(KeepReason::Error),
        }
        let ms = rec.total_duration_ms;
        let slow = self
            .cfg
            .slow_threshold
            .is_some_and(|t| ms >= t.as_secs_f64() * 1000.0);
        let above_p99 = self.cfg.slow_above_p99 && self.observe(rec, model_label, ms);
        if slow {
            Decision::Keep(KeepReason::Slow)
        } else if above_p99 {
            Decision::Keep(KeepReason::SlowP99)
        } else if ratio_keeps(trace_id, self.cfg.ratio) {
            Decision::Keep(KeepReason::Ratio)
        } else {
            Decision::Drop
        }
    }

    /// Adds a successful request's latency to its key's window; whether it was above the
    /// window's P99 before being added.
    fn observe(&self, rec: &RequestRecord, model_label: &str, ms: f64) -> bool {
        if !ms.is_finite() {
            return false;
        }
        let bucket = rec.input_bucket.map_or("unknown", |b| b.as_str());
        let mut windows = self.windows.lock();
        let full = windows.len() >= MAX_KEYS;
        let key_known = windows.contains_key(&(model_label.to_owned(), bucket));
        let key = if full && !key_known {
            ("other".to_owned(), "unknown")
        } else {
            (model_label.to_owned(), bucket)
        };
        let fleet = self
            .fleet
            .lock()
            .get(&(model_label.to_owned(), bucket))
            .copied()
            .filter(|(n, _)| *n >= u64::from(self.cfg.p99_min_samples));
        let w = windows.entry(key).or_insert_with(LatencyWindow::new);
        let above = match fleet {
            Some((_, p99)) => ms > p99,
            None => w.samples() >= self.cfg.p99_min_samples && ms > w.p99_ms(),
        };
        w.add(ms, self.cfg.p99_window.max(1));
        above
    }

    /// Replaces the fleet's P99 per key: `(model label, input bucket, samples, P99 ms)` (the
    /// bucket as `InputBucket::as_str`, or `unknown`). Keys beyond [`MAX_KEYS`] are dropped.
    pub fn set_fleet_p99(
        &self,
        entries: impl IntoIterator<Item = (String, &'static str, u64, f64)>,
    ) {
        let map: HashMap<Key, (u64, f64)> = entries
            .into_iter()
            .filter(|(_, _, _, p)| p.is_finite())
            .take(MAX_KEYS)
            .map(|(m, b, n, p)| ((m, b), (n, p)))
            .collect();
        *self.fleet.lock() = map;
    }

    /// The fleet's P99 of a key, if known with enough samples.
    pub fn fleet_p99(&self, model_label: &str, bucket: &'static str) -> Option<f64> {
        self.fleet
            .lock()
            .get(&(model_label.to_owned(), bucket))
            .filter(|(n, _)| *n >= u64::from(self.cfg.p99_min_samples))
            .map(|(_, p)| *p)
    }

    /// The current P99 estimate (ms) of a key, if it has enough samples.
    pub fn p99_estimate(&self, model_label: &str, bucket: &'static str) -> Option<f64> {
        let windows = self.windows.lock();
        windows
            .get(&(model_label.to_owned(), bucket))
            .filter(|w| w.samples() >= self.cfg.p99_min_samples)
            .map(LatencyWindow::p99_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokenscope_core::InputBucket;

    fn rec(outcome: Outcome, ms: f64) -> RequestRecord {
        let mut r = RequestRecord {
            outcome,
            total_duration_ms: ms,
            ..RequestRecord::default()
        };
        r.input_bucket = Some(InputBucket::of(100));
        r
    }

    fn tid(n: u128) -> TraceId {
        n.to_be_bytes()
    }

    #[test]
    fn errors_and_cancellations_always_kept() {
        let s = TailSampler::new(SamplerConfig {
            ratio: 0.0,
            ..SamplerConfig::default()
        });
        for o in [
            Outcome::ClientError,
            Outcome::UpstreamError,
            Outcome::Timeout,
        ] {
            assert_eq!(
                s.decide(&rec(o, 1.0), "m", &tid(7)),
                Decision::Keep(KeepReason::Error)
            );
        }
        assert_eq!(
            s.decide(&rec(Outcome::Cancelled, 1.0), "m", &tid(7)),
            Decision::Keep(KeepReason::Cancelled)
        );
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 1.0), "m", &tid(7)),
            Decision::Drop
        );
    }

    #[test]
    fn absolute_threshold() {
        let s = TailSampler::new(SamplerConfig {
            ratio: 0.0,
            slow_threshold: Some(Duration::from_millis(500)),
            slow_above_p99: false,
            ..SamplerConfig::default()
        });
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 499.9), "m", &tid(1)),
            Decision::Drop
        );
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 500.0), "m", &tid(1)),
            Decision::Keep(KeepReason::Slow)
        );
    }

    #[test]
    fn running_p99_keeps_the_tail_per_key() {
        let s = TailSampler::new(SamplerConfig {
            ratio: 0.0,
            ..SamplerConfig::default()
        });
        // Before min samples nothing is "above P99".
        for i in 0..199 {
            assert_eq!(
                s.decide(&rec(Outcome::Ok, 10.0 + f64::from(i % 10)), "m", &tid(1)),
                Decision::Drop
            );
        }
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 10.0), "m", &tid(1)),
            Decision::Drop
        );
        let p99 = s.p99_estimate("m", "0-128").expect("enough samples");
        assert!((19.0..20.0 * 1.05).contains(&p99), "{p99}");
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "m", &tid(1)),
            Decision::Keep(KeepReason::SlowP99)
        );
        // Another model has its own window (not enough samples yet).
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "other-model", &tid(1)),
            Decision::Drop
        );
    }

    #[test]
    fn the_fleet_p99_decides_where_this_replica_has_few_samples() {
        let s = TailSampler::new(SamplerConfig {
            ratio: 0.0,
            ..SamplerConfig::default()
        });
        // This replica saw nothing of the key; the fleet saw 5 000 requests, P99 40 ms.
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "m", &tid(1)),
            Decision::Drop
        );
        s.set_fleet_p99([("m".to_owned(), "0-128", 5_000, 40.0)]);
        assert_eq!(s.fleet_p99("m", "0-128"), Some(40.0));
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "m", &tid(1)),
            Decision::Keep(KeepReason::SlowP99)
        );
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 30.0), "m", &tid(1)),
            Decision::Drop
        );
        // The fleet's value wins over a local window that says otherwise.
        for _ in 0..300 {
            s.decide(&rec(Outcome::Ok, 500.0), "m", &tid(1));
        }
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "m", &tid(1)),
            Decision::Keep(KeepReason::SlowP99)
        );
        // Too few fleet samples: the local window decides again.
        s.set_fleet_p99([("m".to_owned(), "0-128", 3, 40.0)]);
        assert_eq!(s.fleet_p99("m", "0-128"), None);
        assert_eq!(
            s.decide(&rec(Outcome::Ok, 100.0), "m", &tid(1)),
            Decision::Drop
        );
    }

    #[test]
    fn ratio_is_deterministic_and_bounded() {
        assert!(ratio_keeps(&tid(0), 0.5));
        assert!(!ratio_keeps(&tid(u128::MAX), 0.5));
        assert!(ratio_keeps(&tid(u128::MAX), 1.0));
        assert!(!ratio_keeps(&tid(0), 0.0));
        // Over random ids the kept fraction is the ratio (binomial 99.9 % interval).
        let n = 100_000u32;
        let p = 0.1;
        let kept = (0..n)
            .filter(|_| ratio_keeps(&fastrand::u128(..).to_be_bytes(), p))
            .count() as f64;
        let mean = f64::from(n) * p;
        let sd = (f64::from(n) * p * (1.0 - p)).sqrt();
        assert!((kept - mean).abs() < 3.29 * sd, "{kept} vs {mean}");
    }

    #[test]
    fn keys_are_bounded() {
        let s = TailSampler::new(SamplerConfig::default());
        for i in 0..(MAX_KEYS + 100) {
            s.decide(&rec(Outcome::Ok, 1.0), &format!("m{i}"), &tid(1));
        }
        assert!(s.windows.lock().len() <= MAX_KEYS + 1);
    }

    proptest! {
        /// The window's P99 is within one bin (5 %) above the exact nearest-rank P99 of the
        /// samples it holds.
        #[test]
        fn p99_bounds_exact(values in proptest::collection::vec(0.01f64..3_600_000.0, 1..3000)) {
            let mut w = LatencyWindow::new();
            for v in &values {
                w.add(*v, u32::MAX);
            }
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let rank = ((sorted.len() as f64 * 0.99).ceil() as usize).max(1);
            let exact = sorted[rank - 1];
            let est = w.p99_ms();
            prop_assert!(est >= exact.max(MIN_MS) * 0.999_999, "{} < {}", est, exact);
            prop_assert!(est <= exact.max(MIN_MS) * GROWTH * 1.000_001, "{} > {}", est, exact);
        }
    }
}
