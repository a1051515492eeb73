//! Per-request timing from monotonic instants.
//!
//! A [`StreamTimer`] is owned by exactly one request (no sharing, no locks) and is fed the
//! [`Instant`]s at which things happened to *that* request: arrival at the gateway, the request
//! leaving for the upstream, the upstream's response headers, and every content-bearing chunk.
//! It never reads the clock itself, so tests can feed synthetic instants.
//!
//! Definitions (requirements R2/R3):
//! * TTFT = first content-bearing chunk − arrival.
//! * TPOT = (t_last − t_first) / (n_out − 1), defined only for n_out ≥ 2, where `n_out` is the
//!   number of output tokens (from the engine's usage when known).
//! * Inter-token gaps are measured between consecutive content-bearing chunks.

use std::time::{Duration, Instant};

/// Milliseconds (with sub-microsecond precision) of a [`Duration`].
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// TPOT from first/last token instants and the output-token count; `None` for `n_out < 2`.
pub fn tpot_ms(first: Instant, last: Instant, n_out: u64) -> Option<f64> {
    if n_out < 2 {
        return None;
    }
    let span = last.checked_duration_since(first)?;
    Some(ms(span) / (n_out - 1) as f64)
}

/// Timing state of one request. See the module docs.
#[derive(Debug, Clone)]
pub struct StreamTimer {
    arrival: Instant,
    body_received: Option<Instant>,
    upstream_sent: Option<Instant>,
    headers: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    token_chunks: u64,
    max_gap: Duration,
    sum_gap: Duration,
}

impl StreamTimer {
    /// Starts timing a request that arrived at `arrival`.
    pub fn new(arrival: Instant) -> Self {
        Self {
            arrival,
            body_received: None,
            upstream_sent: None,
            headers: None,
            first_token: None,
            last_token: None,
            token_chunks: 0,
            max_gap: Duration::ZERO,
            sum_gap: Duration::ZERO,
        }
    }

    /// The arrival instant.
    pub fn arrival(&self) -> Instant {
        self.arrival
    }

    /// The whole request body had been received from the client at `t`.
    pub fn mark_body_received(&mut self, t: Instant) {
        self.body_received.get_or_insert(t);
    }

    /// The request was handed to the upstream connection at `t`.
    pub fn mark_upstream_sent(&mut self, t: Instant) {
        self.upstream_sent.get_or_insert(t);
    }

    /// The upstream's response headers arrived at `t`.
    pub fn mark_headers(&mut self, t: Instant) {
        self.headers.get_or_insert(t);
    }

    /// A chunk carrying output (text, reasoning, tool call) arrived at `t`.
    pub fn on_token_chunk(&mut self, t: Instant) {
        if let Some(prev) = self.last_token {
            let gap = t.saturating_duration_since(prev);
            self.max_gap = self.max_gap.max(gap);
            self.sum_gap += gap;
        } else {
            self.first_token = Some(t);
        }
        self.last_token = Some(t);
        self.token_chunks += 1;
    }

    /// Number of content-bearing chunks seen.
    pub fn token_chunks(&self) -> u64 {
        self.token_chunks
    }

    /// Instant of the first content-bearing chunk.
    pub fn first_token(&self) -> Option<Instant> {
        self.first_token
    }

    /// Instant of the last content-bearing chunk.
    pub fn last_token(&self) -> Option<Instant> {
        self.last_token
    }

    /// Time to first token in ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token
            .map(|t| ms(t.saturating_duration_since(self.arrival)))
    }

    /// TPOT in ms for `n_out` output tokens (see [`tpot_ms`]).
    pub fn tpot_ms(&self, n_out: u64) -> Option<f64> {
        tpot_ms(self.first_token?, self.last_token?, n_out)
    }

    /// Largest gap between consecutive content-bearing chunks.
    pub fn itl_max_ms(&self) -> Option<f64> {
        (self.token_chunks >= 2).then(|| ms(self.max_gap))
    }

    /// Mean gap between consecutive content-bearing chunks.
    pub fn itl_mean_ms(&self) -> Option<f64> {
        (self.token_chunks >= 2).then(|| ms(self.sum_gap) / (self.token_chunks - 1) as f64)
    }

    /// Arrival → the request handed to the upstream (`None` if it never was).
    pub fn upstream_sent_ms(&self) -> Option<f64> {
        self.upstream_sent
            .map(|t| ms(t.saturating_duration_since(self.arrival)))
    }

    /// Arrival → upstream response headers.
    pub fn headers_ms(&self) -> Option<f64> {
        self.headers
            .map(|t| ms(t.saturating_duration_since(self.arrival)))
    }

    /// The gateway's own processing before forwarding: request body fully received (or arrival
    /// when not marked) → request handed to the upstream. Excludes the client's upload time.
    pub fn overhead_ms(&self) -> Option<f64> {
        let from = self.body_received.unwrap_or(self.arrival);
        self.upstream_sent
            .map(|t| ms(t.saturating_duration_since(from)))
    }

    /// Arrival → `end`.
    pub fn elapsed_ms(&self, end: Instant) -> f64 {
        ms(end.saturating_duration_since(self.arrival))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tpot_needs_two_tokens() {
        let t0 = Instant::now();
        assert_eq!(tpot_ms(t0, t0, 0), None);
        assert_eq!(tpot_ms(t0, t0, 1), None);
        let t1 = t0 + Duration::from_millis(90);
        assert_eq!(tpot_ms(t0, t1, 10), Some(10.0));
    }

    #[test]
    fn timer_values() {
        let t0 = Instant::now();
        let mut t = StreamTimer::new(t0);
        t.mark_upstream_sent(t0 + Duration::from_micros(150));
        t.mark_headers(t0 + Duration::from_millis(20));
        t.on_token_chunk(t0 + Duration::from_millis(100));
        t.on_token_chunk(t0 + Duration::from_millis(110));
        t.on_token_chunk(t0 + Duration::from_millis(130));
        assert_eq!(t.ttft_ms(), Some(100.0));
        assert_eq!(t.tpot_ms(3), Some(15.0));
        assert_eq!(t.itl_max_ms(), Some(20.0));
        assert_eq!(t.itl_mean_ms(), Some(15.0));
        assert_eq!(t.headers_ms(), Some(20.0));
        assert!((t.overhead_ms().unwrap_or_default() - 0.15).abs() < 1e-9);
        assert_eq!(t.elapsed_ms(t0 + Duration::from_millis(200)), 200.0);
    }

    proptest! {
        #[test]
        fn tpot_matches_formula(gaps in proptest::collection::vec(0u64..5_000, 1..200)) {
            let t0 = Instant::now();
            let mut timer = StreamTimer::new(t0);
            let mut at = t0;
            for g in &gaps {
                at += Duration::from_micros(*g);
                timer.on_token_chunk(at);
            }
            let n = gaps.len() as u64;
            let first = t0 + Duration::from_micros(gaps[0]);
            let expect = if n >= 2 { Some(ms(at - first) / (n - 1) as f64) } else { None };
            prop_assert_eq!(timer.tpot_ms(n), expect);
            // mean gap × (n−1) = last − first
            if let Some(mean) = timer.itl_mean_ms() {
                prop_assert!((mean * (n - 1) as f64 - ms(at - first)).abs() < 1e-6);
                prop_assert!(timer.itl_max_ms().unwrap_or_default() + 1e-9 >= mean);
            }
        }
    }
}
