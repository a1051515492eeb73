//! Per-request client timings → per-level summaries → the knee.
//!
//! Definitions (the gateway's, `tokenscope_core::timing`, seen from the client):
//! * TTFT = request sent → first SSE event carrying output (non-streamed: the whole response).
//! * TPOT = (t_last − t_first) / (n_out − 1) for n_out ≥ 2; n_out = `usage.completion_tokens`
//!   when the response reports it, else the number of output-bearing events.
//! * ITL = every gap between consecutive output-bearing events (all requests of a level pooled).
//! * e2e = request sent → end of the response body.
//! * Percentiles are nearest-rank: P(q) = x_k, k = ⌈q·n⌉ (`tokenscope_core::query::
//!   nearest_rank`, the one definition the report and the analyses use), over the level's
//!   successful requests.
//!
//! ## Invariants
//!
//! * `requests = ok + failed + dropped` for every level.
//! * `achieved_qps = ok / max(duration, last completion − level start − shortest e2e)`:
//!   completions per second over the time the level took to serve what it was offered. A
//!   level that cannot keep up takes longer than its duration to drain (its backlog), which
//!   lowers its achieved QPS; a request's own service time is not backlog, so the fastest
//!   successful request's end to end is taken off the drain — long requests at a rate far
//!   under capacity (2 req/s of 2.5 s requests on an idle engine) are not a knee.
//! * `offered_qps = requests / duration`: the rate actually scheduled (for Poisson arrivals
//!   it differs from `rate` by the Poisson noise of the count, ± √(rate·duration) requests).
//! * The knee is the lowest-rate level that breaches: P99 TTFT > SLO, or achieved QPS < 90 %
//!   of `offered_qps` (the schedule it was given, so Poisson noise in a short level is not
//!   mistaken for a server that cannot keep up), or more than 1 % of its requests failed or were dropped (the error
//!   rule `tokenscope capacity` applies too). Sustainable = the highest-rate level below the
//!   knee that does not breach (no knee: the highest level).

use serde::Serialize;
use std::time::Duration;
use tokenscope_core::query::nearest_rank as percentile;

/// Achieved QPS below this fraction of the offered rate breaches.
pub const MIN_ACHIEVED_FRACTION: f64 = 0.9;
/// Failed + dropped requests above this fraction breach.
pub const MAX_ERROR_FRACTION: f64 = 0.01;

/// What the client saw for one request (one JSON line of `--requests-out`).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct RequestResult {
    /// Offered rate of the level it belongs to.
    pub rate: f64,
    /// The `x-request-id` sent.
    pub request_id: String,
    /// Completed with a 2xx status and output.
    pub ok: bool,
    /// Not sent: the concurrency cap was reached at its scheduled time.
    pub dropped: bool,
    /// TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// TPOT, ms.
    pub tpot_ms: Option<f64>,
    /// Gaps between consecutive output events, ms.
    #[serde(skip)]
    pub itl_ms: Vec<f64>,
    /// Sent → end of body, ms.
    pub e2e_ms: Option<f64>,
    /// Output tokens (usage, else output events).
    pub output_tokens: u64,
    /// Prompt tokens requested from the mix.
    pub prompt_tokens: u64,
    /// Level start → completion (for the achieved QPS).
    #[serde(skip)]
    pub done_after: Option<Duration>,
    /// Why a request failed or was dropped (`HTTP 503`, `timeout`, `connection failed`, …);
    /// `None` for a request that succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Failed and dropped requests counted by cause, over one or more levels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Failures {
    /// Requests scheduled (sent or dropped).
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Cause → count of the others (`failed` when a request has no recorded cause).
    pub causes: std::collections::BTreeMap<String, u64>,
}

impl Failures {
    /// Counts a level's results.
    pub fn add(&mut self, results: &[RequestResult]) {
        for r in results {
            self.requests += 1;
            if r.ok {
                self.ok += 1;
            } else {
                let cause = r.error.as_deref().unwrap_or("failed");
                *self.causes.entry(cause.to_owned()).or_default() += 1;
            }
        }
    }

    /// `40 × HTTP 503, 2 × timeout`: most frequent first, ties by name.
    pub fn causes_line(&self) -> String {
        let mut v: Vec<(&String, &u64)> = self.causes.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        v.iter()
            .map(|(c, n)| format!("{n} × {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// TPOT from the first/last output offsets (ms) and n_out; `None` for n_out < 2.
pub fn tpot_ms(first_ms: f64, last_ms: f64, n_out: u64) -> Option<f64> {
    (n_out >= 2).then(|| (last_ms - first_ms) / (n_out - 1) as f64)
}

/// P50/P90/P99 of a set of values, ms (`None` when empty).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct Pcts {
    /// P50.
    pub p50: Option<f64>,
    /// P90.
    pub p90: Option<f64>,
    /// P99.
    pub p99: Option<f64>,
}

impl Pcts {
    /// Nearest-rank percentiles of `values` (non-finite values ignored).
    pub fn of(values: impl Iterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        Pcts {
            p50: percentile(&v, 0.50),
            p90: percentile(&v, 0.90),
            p99: percentile(&v, 0.99),
        }
    }
}

/// One level's summary. Its JSON is a superset of `tokenscope_analysis::capacity::BenchLevel`
/// (that parser ignores the extra fields).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelSummary {
    /// Offered rate, requests/s.
    pub rate: f64,
    /// Successful completions / max(duration, drain time), requests/s.
    pub achieved_qps: f64,
    /// Requests scheduled / duration (the realised offered rate), requests/s.
    pub offered_qps: f64,
    /// P99 TTFT, ms (0 when no request succeeded; such a level breaches on errors).
    pub ttft_p99_ms: f64,
    /// P99 TPOT, ms.
    pub tpot_p99_ms: Option<f64>,
    /// Failed + dropped requests.
    pub errors: u64,
    /// Requests scheduled at this level (sent + dropped).
    pub requests: u64,
    /// Successful requests.
    pub ok: u64,
    /// Failed requests (status, transport, timeout, no output).
    pub failed: u64,
    /// Dropped at the concurrency cap (never sent).
    pub dropped: u64,
    /// The level's nominal duration, s.
    pub duration_s: f64,
    /// Level start → last completion (or the duration, if longer), s.
    pub elapsed_s: f64,
    /// TTFT percentiles, ms.
    pub ttft_ms: Pcts,
    /// TPOT percentiles, ms.
    pub tpot_ms: Pcts,
    /// Inter-token latency percentiles (all gaps pooled), ms.
    pub itl_ms: Pcts,
    /// End-to-end latency percentiles, ms.
    pub e2e_ms: Pcts,
    /// Output tokens of successful requests / elapsed, tokens/s.
    pub output_tokens_per_s: f64,
    /// Why this level breaches (`None`: within the SLO).
    pub breach: Option<String>,
    /// This level is the knee.
    pub knee: bool,
    /// This level is the highest sustainable one.
    pub sustainable: bool,
}

/// Summarises one level (`breach` is set here; `knee`/`sustainable` by [`mark_knee`]).
pub fn summarize(
    rate: f64,
    duration: Duration,
    results: &[RequestResult],
    slo_ttft_p99_ms: f64,
) -> LevelSummary {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.ok).collect();
    let dropped = results.iter().filter(|r| r.dropped).count() as u64;
    let requests = results.len() as u64;
    let failed = requests - ok.len() as u64 - dropped;
    let last_done = results
        .iter()
        .filter_map(|r| r.done_after)
        .max()
        .unwrap_or_default();
    // The shortest end to end a request of this level needed: no completion can come sooner
    // after its send, so it is service time, not backlog (see the module docs).
    let service = ok
        .iter()
        .filter_map(|r| r.e2e_ms)
        .filter(|e| e.is_finite() && *e >= 0.0)
        .fold(None, |m: Option<f64>, e| Some(m.map_or(e, |m| m.min(e))))
        .map_or(Duration::ZERO, |ms| Duration::from_secs_f64(ms / 1e3));
    let elapsed = last_done
        .saturating_sub(service)
        .max(duration)
        .as_secs_f64();
    let ttft = Pcts::of(ok.iter().filter_map(|r| r.ttft_ms));
    let tpot = Pcts::of(ok.iter().filter_map(|r| r.tpot_ms));
    let itl = Pcts::of(ok.iter().flat_map(|r| r.itl_ms.iter().copied()));
    let e2e = Pcts::of(ok.iter().filter_map(|r| r.e2e_ms));
    let out_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let (achieved, tps) = if elapsed > 0.0 {
        (ok.len() as f64 / elapsed, out_tokens as f64 / elapsed)
    } else {
        (0.0, 0.0)
    };
    let mut s = LevelSummary {
        rate,
        achieved_qps: achieved,
        offered_qps: requests as f64 / duration.as_secs_f64().max(f64::MIN_POSITIVE),
        ttft_p99_ms: ttft.p99.unwrap_or(0.0),
        tpot_p99_ms: tpot.p99,
        errors: failed + dropped,
        requests,
        ok: ok.len() as u64,
        failed,
        dropped,
        duration_s: duration.as_secs_f64(),
        elapsed_s: elapsed,
        ttft_ms: ttft,
        tpot_ms: tpot,
        itl_ms: itl,
        e2e_ms: e2e,
        output_tokens_per_s: tps,
        breach: None,
        knee: false,
        sustainable: false,
    };
    s.breach = breach_reason(&s, slo_ttft_p99_ms);
    s
}

/// Why a level breaches, if it does (see the module invariants).
pub fn breach_reason(s: &LevelSummary, slo_ttft_p99_ms: f64) -> Option<String> {
    let mut why = Vec::new();
    if s.ok > 0 && s.ttft_p99_ms > slo_ttft_p99_ms {
        why.push(format!(
            "P99 TTFT {:.0} ms > {:.0} ms",
            s.ttft_p99_ms, slo_ttft_p99_ms
        ));
    }
    if s.achieved_qps < MIN_ACHIEVED_FRACTION * s.offered_qps {
        why.push(format!(
            "achieved {:.2} < {:.0} % of offered {:.2}",
            s.achieved_qps,
            MIN_ACHIEVED_FRACTION * 100.0,
            s.offered_qps
        ));
    }
    if s.requests > 0 && s.errors as f64 / s.requests as f64 > MAX_ERROR_FRACTION {
        why.push(format!("{} of {} failed or dropped", s.errors, s.requests));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// Marks the knee (lowest-rate breaching level) and the sustainable level (highest-rate
/// non-breaching level below it); returns their indices in `levels`.
pub fn mark_knee(levels: &mut [LevelSummary]) -> (Option<usize>, Option<usize>) {
    let mut order: Vec<usize> = (0..levels.len()).collect();
    order.sort_by(|&a, &b| levels[a].rate.total_cmp(&levels[b].rate));
    let knee = order.iter().copied().find(|&i| levels[i].breach.is_some());
    let knee_rate = knee.map_or(f64::INFINITY, |i| levels[i].rate);
    let sustainable = order
        .iter()
        .copied()
        .rfind(|&i| levels[i].breach.is_none() && levels[i].rate < knee_rate);
    for (i, l) in levels.iter_mut().enumerate() {
        l.knee = Some(i) == knee;
        l.sustainable = Some(i) == sustainable;
    }
    (knee, sustainable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_counted_most_frequent_first() {
        let failed = |e: Option<&str>| RequestResult {
            error: e.map(str::to_owned),
            ..RequestResult::default()
        };
        let results = vec![
            failed(Some("timeout")),
            failed(Some("HTTP 503")),
            failed(Some("HTTP 503")),
            failed(None),
            RequestResult {
                ok: true,
                ..RequestResult::default()
            },
        ];
        let mut f = Failures::default();
        f.add(&results);
        assert_eq!((f.requests, f.ok), (5, 1));
        assert_eq!(f.causes_line(), "2 × HTTP 503, 1 × failed, 1 × timeout");
    }

    fn ok(ttft: f64, done_ms: u64) -> RequestResult {
        RequestResult {
            ok: true,
            ttft_ms: Some(ttft),
            e2e_ms: Some(ttft + 10.0),
            output_tokens: 5,
            done_after: Some(Duration::from_millis(done_ms)),
            ..RequestResult::default()
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        // 1..=100: P50 = 50, P90 = 90, P99 = 99.
        let p = Pcts::of((1..=100).map(f64::from));
        assert_eq!((p.p50, p.p90, p.p99), (Some(50.0), Some(90.0), Some(99.0)));
        // n = 10: k = ceil(0.99 × 10) = 10 → the max; ceil(0.5 × 10) = 5.
        let p = Pcts::of([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 10.0, 4.0, 8.0, 6.0].into_iter());
        assert_eq!((p.p50, p.p90, p.p99), (Some(5.0), Some(9.0), Some(10.0)));
        // n = 3: ceil(1.5) = 2.
        assert_eq!(Pcts::of([30.0, 10.0, 20.0].into_iter()).p50, Some(20.0));
        assert_eq!(Pcts::of(std::iter::empty()).p99, None);
        assert_eq!(Pcts::of([f64::NAN, 4.0].into_iter()).p50, Some(4.0));
    }

    #[test]
    fn tpot_definition() {
        assert_eq!(tpot_ms(100.0, 100.0, 1), None);
        assert_eq!(tpot_ms(100.0, 190.0, 10), Some(10.0));
        assert_eq!(tpot_ms(0.0, 5.0, 2), Some(5.0));
    }

    #[test]
    fn summary_counts_and_rates() {
        let mut rs: Vec<RequestResult> = (0..8u32)
            .map(|i| ok(f64::from(i) + 1.0, 500 + 100 * u64::from(i)))
            .collect();
        rs.push(RequestResult {
            dropped: true,
            ..RequestResult::default()
        });
        rs.push(RequestResult {
            done_after: Some(Duration::from_millis(3000)),
            ..RequestResult::default()
        });
        rs[0].itl_ms = vec![1.0, 3.0];
        rs[1].itl_ms = vec![2.0];
        rs[0].tpot_ms = Some(2.0);
        let s = summarize(5.0, Duration::from_secs(2), &rs, 2000.0);
        assert_eq!(
            (s.requests, s.ok, s.failed, s.dropped, s.errors),
            (10, 8, 1, 1, 2)
        );
        // The failed request finished at 3 s, the fastest request took 11 ms end to end:
        // elapsed = 2.989 s.
        assert!((s.elapsed_s - 2.989).abs() < 1e-9, "{}", s.elapsed_s);
        assert_eq!(s.offered_qps, 5.0);
        assert!((s.achieved_qps - 8.0 / 2.989).abs() < 1e-9);
        assert!((s.output_tokens_per_s - 40.0 / 2.989).abs() < 1e-9);
        assert_eq!(s.ttft_ms.p50, Some(4.0));
        assert_eq!(s.ttft_p99_ms, 8.0);
        assert_eq!(s.e2e_ms.p99, Some(18.0));
        assert_eq!(s.itl_ms.p50, Some(2.0));
        assert_eq!(s.tpot_p99_ms, Some(2.0));
        let why = s.breach.expect("breach");
        assert!(why.contains("achieved") && why.contains("2 of 10"), "{why}");
    }

    #[test]
    fn achieved_is_judged_against_the_realised_schedule() {
        // Poisson at 4 req/s gave only 7 arrivals in 2 s, all served: no breach.
        let rs: Vec<RequestResult> = (0..7).map(|i| ok(5.0, 200 * i + 100)).collect();
        let s = summarize(4.0, Duration::from_secs(2), &rs, 2000.0);
        assert_eq!((s.offered_qps, s.achieved_qps), (3.5, 3.5));
        assert_eq!(s.breach, None);
    }

    #[test]
    fn long_requests_far_under_capacity_are_not_a_knee() {
        // Issue 21: 2 req/s for 10 s of 2.5 s requests on an idle engine. Each finishes 2.5 s
        // after its send; the last at 12 s. Before: 20 / 12 s = 1.67 < 90 % of 2 → "knee".
        let rs: Vec<RequestResult> = (0..20u64)
            .map(|i| RequestResult {
                e2e_ms: Some(2_500.0),
                ..ok(40.0, 500 * i + 2_500)
            })
            .collect();
        let s = summarize(2.0, Duration::from_secs(10), &rs, 2_000.0);
        assert_eq!(s.offered_qps, 2.0);
        assert!((s.achieved_qps - 2.0).abs() < 1e-9, "{}", s.achieved_qps);
        assert_eq!(s.breach, None);
        // A server that cannot keep up (one completion every 0.8 s, whatever the arrivals)
        // still breaches: its backlog drains long after the schedule.
        let rs: Vec<RequestResult> = (0..20u64)
            .map(|i| RequestResult {
                e2e_ms: Some(2_500.0 + 300.0 * i as f64),
                ..ok(40.0, 2_500 + 800 * i)
            })
            .collect();
        let s = summarize(2.0, Duration::from_secs(10), &rs, 2_000.0);
        assert!(s.achieved_qps < 1.5, "{}", s.achieved_qps);
        assert!(s.breach.is_some_and(|b| b.contains("achieved")));
    }

    #[test]
    fn knee_is_lowest_breaching_level() {
        let level = |rate: f64, achieved: f64, ttft: f64| {
            let n = (rate * 2.0) as usize;
            let mut s = summarize(rate, Duration::from_secs(2), &vec![ok(ttft, 100); n], 500.0);
            s.achieved_qps = achieved;
            s.breach = breach_reason(&s, 500.0);
            s
        };
        let mut lv = vec![
            level(30.0, 22.0, 100.0), // throughput breach
            level(6.0, 6.0, 10.0),
            level(18.0, 17.0, 20.0), // 17 ≥ 0.9 × 18
            level(40.0, 23.0, 900.0),
            level(12.0, 12.0, 600.0), // TTFT breach below a fine level: still the knee
        ];
        assert_eq!(mark_knee(&mut lv), (Some(4), Some(1)));
        lv[4] = level(12.0, 12.0, 15.0);
        assert_eq!(mark_knee(&mut lv), (Some(0), Some(2)));
        assert!(lv[0].knee && lv[2].sustainable && !lv[3].knee);
        let mut fine = vec![level(6.0, 6.0, 10.0), level(12.0, 11.0, 10.0)];
        assert_eq!(mark_knee(&mut fine), (None, Some(1)));
    }
}
