//! Anomalies: what changed, and who did it.
//!
//! Four detectors over the records of a window, each finding carrying the numbers and
//! thresholds it was decided from.
//!
//! * **Caller** = `user_id`, else `api_key_id` (`key:` prefix), else `tenant` (`tenant:`
//!   prefix), else `(none)`. A caller's business line is the most frequent one of its requests.
//! * **Token-rate spikes.** The window is cut into buckets of `bucket_us` (the first bucket starts
//!   at the window start; a trailing bucket shorter than half a bucket is ignored; a partial
//!   bucket's counts are scaled to a full bucket). Each caller's tokens (input + output) per
//!   bucket are compared with the caller's **baseline**: the median and MAD of its tokens per
//!   bucket over the baseline period (every baseline bucket counts, empty ones as 0). A bucket
//!   is a spike when `tokens ≥ max(spike_factor × median, median + mad_k × 1.4826 × MAD,
//!   min_spike_tokens)`. A caller with no token in the baseline has median 0: only the floor
//!   applies (reported as a new caller, factor `null`). All spike buckets of a caller make one
//!   finding: first/last spike bucket, peak factor, tokens, excess over the median, the share of
//!   the excess of all spiking callers ("traced to one service"), the request-count factor and
//!   the tokens-per-request factor (so "more requests" and "larger requests" are told apart),
//!   and the top prompt hash and request type of the spike requests.
//!   *Growth rule:* the thresholds are relative to the caller's own baseline, so a load whose
//!   requests and tokens grow together by less than `spike_factor` (e.g. +20 %) is growth, not
//!   an anomaly; a rise of `spike_factor` or more in one bucket is reported whatever its cause,
//!   with `cause` saying whether requests, their size, or both rose.
//! * **Loops.** Per (caller, prompt hash) with at least `loop_min_requests` requests: the
//!   inter-arrival intervals' coefficient of variation (population σ / mean) ≤ `loop_max_cv`
//!   and the median interval ≥ `loop_min_period_s` → a loop with that period.
//! * **Duplicate bursts.** Per prompt hash (any caller): the most requests within any span of
//!   `burst_span_us` (two pointers over the sorted times) ≥ `burst_min_requests`, unless the
//!   hash is already reported as a loop (periodic repeats are loops, not bursts).
//! * **Sudden drops.** Requests per bucket, in total and per business line, against the
//!   baseline median of the same series: a run of at least `drop_min_buckets` consecutive
//!   buckets below `drop_fraction × median` while the median is at least
//!   `drop_min_baseline_requests` is a drop.
//!
//! Baseline: either records of an earlier period (the CLI loads the windows before the
//! analysed one) or the analysed window's own first half ([`Baseline::FirstHalf`]).
//!
//! Invariants: pure (no clock, no I/O); output sorted (findings by severity then name), so the
//! JSON is the same for the same records on every store; linear in the records plus
//! O(callers × buckets) and a sort per group.

use crate::{table, total_tokens, AnalysisError, CsvRows, Report, Window};
use serde::Serialize;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use tokenscope_core::time::format_date_time;
use tokenscope_core::RequestRecord;

/// Where the spike and drop baselines come from.
#[derive(Debug, Clone, Copy)]
pub enum Baseline<'a> {
    /// Records of an earlier period (`window` must not overlap the analysed window).
    Prior {
        /// The baseline period.
        window: Window,
        /// Its records.
        records: &'a [RequestRecord],
    },
    /// The analysed window's own first half.
    FirstHalf,
}

/// Options (defaults in [`AnomalyOptions::default`]).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AnomalyOptions {
    /// Bucket length, µs (`None`: window / 60, at least 1 s).
    pub bucket_us: Option<i64>,
    /// Spike: at least this many times the baseline median (3).
    pub spike_factor: f64,
    /// Spike: at least median + k × 1.4826 × MAD (6).
    pub mad_k: f64,
    /// Spike: at least this many tokens in the bucket (1000).
    pub min_spike_tokens: u64,
    /// Loop: minimum requests of one caller with one prompt hash (5).
    pub loop_min_requests: usize,
    /// Loop: maximum coefficient of variation of the intervals (0.1).
    pub loop_max_cv: f64,
    /// Loop: minimum period, seconds (0.1; faster repeats are bursts).
    pub loop_min_period_s: f64,
    /// Burst: minimum requests with one prompt hash within `burst_span_us` (10).
    pub burst_min_requests: usize,
    /// Burst: span, µs (5 min).
    pub burst_span_us: i64,
    /// Drop: a bucket below this fraction of the baseline median (0.5).
    pub drop_fraction: f64,
    /// Drop: at least this many consecutive low buckets (3).
    pub drop_min_buckets: usize,
    /// Drop: only when the baseline median is at least this many requests per bucket (5).
    pub drop_min_baseline_requests: f64,
}

impl Default for AnomalyOptions {
    fn default() -> Self {
        Self {
            bucket_us: None,
            spike_factor: 3.0,
            mad_k: 6.0,
            min_spike_tokens: 1000,
            loop_min_requests: 5,
            loop_max_cv: 0.1,
            loop_min_period_s: 0.1,
            burst_min_requests: 10,
            burst_span_us: 300_000_000,
            drop_fraction: 0.5,
            drop_min_buckets: 3,
            drop_min_baseline_requests: 5.0,
        }
    }
}

impl AnomalyOptions {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), AnalysisError> {
        let bad = |m: &str| Err(AnalysisError::InvalidOption(m.to_string()));
        if self.bucket_us.is_some_and(|b| b < 1_000) {
            return bad("bucket must be at least 1 ms");
        }
        if !(self.spike_factor.is_finite() && self.spike_factor > 1.0) {
            return bad("spike factor must be > 1");
        }
        if !(self.mad_k.is_finite() && self.mad_k >= 0.0) {
            return bad("MAD multiplier must be ≥ 0");
        }
        if self.loop_min_requests < 3 {
            return bad("loop minimum requests must be at least 3");
        }
        if !(self.loop_max_cv.is_finite() && self.loop_max_cv >= 0.0) {
            return bad("loop CV must be ≥ 0");
        }
        if self.burst_min_requests < 2 || self.burst_span_us <= 0 {
            return bad("burst needs at least 2 requests and a positive span");
        }
        if !(self.drop_fraction > 0.0 && self.drop_fraction < 1.0) {
            return bad("drop fraction must be in (0, 1)");
        }
        if self.drop_min_buckets == 0 {
            return bad("drop minimum buckets must be at least 1");
        }
        Ok(())
    }
}

/// The caller of a record (see the module docs).
pub fn caller_of(r: &RequestRecord) -> String {
    caller_key(r).into_owned()
}

/// [`caller_of`] without allocating for the common case (a user id).
pub fn caller_key(r: &RequestRecord) -> Cow<'_, str> {
    if let Some(u) = r.user_id.as_deref().filter(|s| !s.is_empty()) {
        Cow::Borrowed(u)
    } else if let Some(k) = r.api_key_id.as_deref().filter(|s| !s.is_empty()) {
        Cow::Owned(format!("key:{k}"))
    } else if let Some(t) = r.tenant.as_deref().filter(|s| !s.is_empty()) {
        Cow::Owned(format!("tenant:{t}"))
    } else {
        Cow::Borrowed("(none)")
    }
}

/// The baseline statistics a spike was judged against.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SpikeBaseline {
    /// Median tokens per bucket.
    pub median_tokens: f64,
    /// MAD of tokens per bucket.
    pub mad_tokens: f64,
    /// Median requests per bucket.
    pub median_requests: f64,
    /// Baseline tokens per request (total tokens / requests; 0 without requests).
    pub tokens_per_request: f64,
    /// The spike threshold, tokens per bucket.
    pub threshold_tokens: f64,
}

/// One caller's token-rate spike.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Spike {
    /// The caller.
    pub caller: String,
    /// Most frequent business line of the caller's requests.
    pub business_line: Option<String>,
    /// Start of the first spike bucket, epoch µs.
    pub first_spike_us: i64,
    /// End of the last spike bucket, epoch µs.
    pub last_spike_us: i64,
    /// Number of spike buckets.
    pub spike_buckets: usize,
    /// Highest tokens-per-bucket / baseline median (`null` for a new caller).
    pub peak_factor: Option<f64>,
    /// Tokens / baseline tokens over the spike buckets (`null` for a new caller).
    pub factor: Option<f64>,
    /// Tokens in the spike buckets.
    pub spike_tokens: u64,
    /// Requests in the spike buckets.
    pub spike_requests: u64,
    /// Tokens above the baseline median in the spike buckets.
    pub excess_tokens: f64,
    /// This caller's share of the excess of every spiking caller, 0–1.
    pub share_of_excess: f64,
    /// Requests in spike buckets / baseline median requests over as many buckets.
    pub request_factor: Option<f64>,
    /// Tokens per request in spike buckets / baseline tokens per request.
    pub tokens_per_request_factor: Option<f64>,
    /// `more requests`, `larger requests`, `more and larger requests`, or `new caller`.
    pub cause: String,
    /// The prompt hash with the most tokens among the spike requests.
    pub top_prompt_hash: Option<String>,
    /// Its share of the spike tokens, 0–1.
    pub top_prompt_hash_share: f64,
    /// The request type with the most tokens among the spike requests.
    pub top_request_type: Option<String>,
    /// The baseline it was judged against.
    pub baseline: SpikeBaseline,
}

/// One caller repeating one prompt at a fixed period.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Loop {
    /// The caller.
    pub caller: String,
    /// Most frequent business line of the loop's requests.
    pub business_line: Option<String>,
    /// The repeated prompt hash.
    pub prompt_hash: String,
    /// Requests.
    pub requests: usize,
    /// Median interval, seconds.
    pub period_s: f64,
    /// Coefficient of variation of the intervals.
    pub cv: f64,
    /// First request, epoch µs.
    pub first_us: i64,
    /// Last request, epoch µs.
    pub last_us: i64,
    /// Tokens consumed by the loop.
    pub tokens: u64,
}

/// The same prompt resubmitted many times in a short span, irregularly.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Burst {
    /// The prompt hash.
    pub prompt_hash: String,
    /// Requests in the densest span.
    pub requests: usize,
    /// First request of the densest span, epoch µs.
    pub first_us: i64,
    /// Last request of the densest span, epoch µs.
    pub last_us: i64,
    /// `last − first`, seconds.
    pub span_s: f64,
    /// Tokens of the burst's requests.
    pub tokens: u64,
    /// Callers of the burst's requests, sorted.
    pub callers: Vec<String>,
}

/// Requests falling well below the baseline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RateDrop {
    /// `total` or `business_line:NAME`.
    pub scope: String,
    /// Start of the first low bucket, epoch µs.
    pub from_us: i64,
    /// End of the last low bucket, epoch µs.
    pub until_us: i64,
    /// Number of low buckets.
    pub buckets: usize,
    /// Mean requests per bucket in the low run.
    pub requests_per_bucket: f64,
    /// Baseline median requests per bucket.
    pub baseline_median: f64,
    /// `requests_per_bucket / baseline_median`.
    pub ratio: f64,
}

/// Thresholds and sizes the report was computed with.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AnomalySettings {
    /// Bucket length, seconds.
    pub bucket_s: f64,
    /// Buckets analysed in the window.
    pub buckets: usize,
    /// `prior` or `first_half`.
    pub baseline: String,
    /// The baseline period.
    pub baseline_window: Window,
    /// Buckets in the baseline.
    pub baseline_buckets: usize,
    /// Records in the baseline.
    pub baseline_records: usize,
    /// Spike factor.
    pub spike_factor: f64,
    /// MAD multiplier.
    pub mad_k: f64,
    /// Spike token floor per bucket.
    pub min_spike_tokens: u64,
    /// Loop minimum requests.
    pub loop_min_requests: usize,
    /// Loop maximum CV.
    pub loop_max_cv: f64,
    /// Loop minimum period, seconds.
    pub loop_min_period_s: f64,
    /// Burst minimum requests.
    pub burst_min_requests: usize,
    /// Burst span, seconds.
    pub burst_span_s: f64,
    /// Drop fraction.
    pub drop_fraction: f64,
    /// Drop minimum consecutive buckets.
    pub drop_min_buckets: usize,
    /// Drop minimum baseline median.
    pub drop_min_baseline_requests: f64,
}

/// The anomalies of a window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AnomalyReport {
    /// The analysed window.
    pub window: Window,
    /// Records analysed.
    pub records: usize,
    /// Settings and thresholds.
    pub settings: AnomalySettings,
    /// Spikes and drops need a baseline; set when it had no record (they were skipped).
    pub note: Option<String>,
    /// Token-rate spikes, largest excess first.
    pub spikes: Vec<Spike>,
    /// Loops, most tokens first.
    pub loops: Vec<Loop>,
    /// Duplicate bursts, most requests first.
    pub bursts: Vec<Burst>,
    /// Sudden drops.
    pub drops: Vec<RateDrop>,
    /// Total number of findings.
    pub anomalies: usize,
}

/// Median of `v` (0 for empty); reorders `v`.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median and median absolute deviation of `v`.
pub fn median_mad(v: &[f64]) -> (f64, f64) {
    let mut a = v.to_vec();
    let m = median(&mut a);
    let mut d: Vec<f64> = v.iter().map(|x| (x - m).abs()).collect();
    (m, median(&mut d))
}

/// Buckets of a period: start, length and scale (full length / actual length).
struct Buckets {
    since_us: i64,
    len_us: i64,
    n: usize,
    scale: Vec<f64>,
}

impl Buckets {
    fn new(w: Window, len_us: i64) -> Self {
        let total = (w.until_us - w.since_us).max(0);
        let full = (total / len_us) as usize;
        let rest = total % len_us;
        let mut scale = vec![1.0; full];
        if rest * 2 >= len_us {
            scale.push(len_us as f64 / rest as f64);
        }
        Self {
            since_us: w.since_us,
            len_us,
            n: scale.len(),
            scale,
        }
    }

    fn index(&self, t: i64) -> Option<usize> {
        if t < self.since_us {
            return None;
        }
        let i = ((t - self.since_us) / self.len_us) as usize;
        (i < self.n).then_some(i)
    }

    fn start(&self, i: usize) -> i64 {
        self.since_us + i as i64 * self.len_us
    }
}

fn top_key<K: Ord + Clone>(m: &BTreeMap<K, u64>) -> Option<(K, u64)> {
    // Largest count; ties → smallest key (BTreeMap order, first max kept).
    let mut best: Option<(&K, u64)> = None;
    for (k, &v) in m {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((k, v));
        }
    }
    best.map(|(k, v)| (k.clone(), v))
}

/// Per-caller counts in one bucketing.
#[derive(Default)]
struct CallerSeries {
    tokens: HashMap<usize, f64>,
    requests: HashMap<usize, f64>,
    total_tokens: u64,
    total_requests: u64,
}

fn series<'a>(
    records: impl Iterator<Item = &'a RequestRecord>,
    b: &Buckets,
) -> HashMap<Cow<'a, str>, CallerSeries> {
    let mut out: HashMap<Cow<'a, str>, CallerSeries> = HashMap::new();
    for r in records {
        let Some(i) = b.index(r.created_at) else {
            continue;
        };
        let s = out.entry(caller_key(r)).or_default();
        let t = total_tokens(r);
        *s.tokens.entry(i).or_default() += t as f64 * b.scale[i];
        *s.requests.entry(i).or_default() += b.scale[i];
        s.total_tokens += t;
        s.total_requests += 1;
    }
    out
}

fn dense(m: &HashMap<usize, f64>, n: usize) -> Vec<f64> {
    let mut v = vec![0.0; n];
    for (&i, &x) in m {
        if i < n {
            v[i] = x;
        }
    }
    v
}

/// Finds the anomalies of `records` (the analysed window's records, in `created_at` order).
pub fn anomalies(
    records: &[RequestRecord],
    window: Window,
    baseline: Baseline<'_>,
    opts: &AnomalyOptions,
) -> Result<AnomalyReport, AnalysisError> {
    opts.validate()?;
    let len = window.until_us - window.since_us;
    let bucket_us = opts.bucket_us.unwrap_or((len / 60).max(1_000_000));
    let (base_window, base_records, base_kind): (Window, Vec<&RequestRecord>, &str) = match baseline
    {
        Baseline::Prior {
            window: bw,
            records,
        } => (
            bw,
            records
                .iter()
                .filter(|r| bw.contains(r.created_at))
                .collect(),
            "prior",
        ),
        Baseline::FirstHalf => {
            let half = window.since_us + (len / 2 / bucket_us).max(1) * bucket_us;
            let bw = Window {
                since_us: window.since_us,
                until_us: half.min(window.until_us),
            };
            (
                bw,
                records
                    .iter()
                    .filter(|r| bw.contains(r.created_at))
                    .collect(),
                "first_half",
            )
        }
    };
    let wb = Buckets::new(window, bucket_us);
    let bb = Buckets::new(base_window, bucket_us);
    let in_window: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| window.contains(r.created_at))
        .collect();

    let settings = AnomalySettings {
        bucket_s: bucket_us as f64 / 1e6,
        buckets: wb.n,
        baseline: base_kind.to_string(),
        baseline_window: base_window,
        baseline_buckets: bb.n,
        baseline_records: base_records.len(),
        spike_factor: opts.spike_factor,
        mad_k: opts.mad_k,
        min_spike_tokens: opts.min_spike_tokens,
        loop_min_requests: opts.loop_min_requests,
        loop_max_cv: opts.loop_max_cv,
        loop_min_period_s: opts.loop_min_period_s,
        burst_min_requests: opts.burst_min_requests,
        burst_span_s: opts.burst_span_us as f64 / 1e6,
        drop_fraction: opts.drop_fraction,
        drop_min_buckets: opts.drop_min_buckets,
        drop_min_baseline_requests: opts.drop_min_baseline_requests,
    };

    let mut note = None;
    let (spikes, drops) = if base_records.is_empty() || bb.n == 0 || wb.n == 0 {
        note = Some(match baseline {
            Baseline::Prior { .. } => "no record in the baseline period (the windows before the analysed one): spikes and drops need a baseline; try --baseline window".to_string(),
            Baseline::FirstHalf => "no record in the first half of the window (the baseline): spikes and drops need a baseline".to_string(),
        });
        (Vec::new(), Vec::new())
    } else {
        (
            find_spikes(&in_window, &base_records, &wb, &bb, opts),
            find_drops(&in_window, &base_records, &wb, &bb, opts),
        )
    };
    let loops = find_loops(&in_window, opts);
    let loop_hashes: BTreeSet<&str> = loops.iter().map(|l| l.prompt_hash.as_str()).collect();
    let bursts = find_bursts(&in_window, &loop_hashes, opts);
    let anomalies = spikes.len() + loops.len() + bursts.len() + drops.len();
    Ok(AnomalyReport {
        window,
        records: in_window.len(),
        settings,
        note,
        spikes,
        loops,
        bursts,
        drops,
        anomalies,
    })
}

fn business_line_of<'a>(rs: impl Iterator<Item = &'a RequestRecord>) -> Option<String> {
    let mut m: BTreeMap<String, u64> = BTreeMap::new();
    for r in rs {
        if let Some(b) = &r.business_line {
            *m.entry(b.clone()).or_default() += 1;
        }
    }
    top_key(&m).map(|(k, _)| k)
}

fn find_spikes(
    window: &[&RequestRecord],
    base: &[&RequestRecord],
    wb: &Buckets,
    bb: &Buckets,
    opts: &AnomalyOptions,
) -> Vec<Spike> {
    let cur = series(window.iter().copied(), wb);
    let prev = series(base.iter().copied(), bb);
    struct Flag {
        caller: String,
        buckets: Vec<usize>,
        base: SpikeBaseline,
        peak: Option<f64>,
    }
    let mut flags = Vec::new();
    for (caller, s) in &cur {
        let (median_tokens, mad_tokens, median_requests, tpr) = match prev.get(caller) {
            Some(p) => {
                let (m, mad) = median_mad(&dense(&p.tokens, bb.n));
                let (mr, _) = median_mad(&dense(&p.requests, bb.n));
                let tpr = if p.total_requests > 0 {
                    p.total_tokens as f64 / p.total_requests as f64
                } else {
                    0.0
                };
                (m, mad, mr, tpr)
            }
            None => (0.0, 0.0, 0.0, 0.0),
        };
        let threshold = (opts.spike_factor * median_tokens)
            .max(median_tokens + opts.mad_k * 1.4826 * mad_tokens)
            .max(opts.min_spike_tokens as f64);
        let mut buckets = Vec::new();
        let mut peak: Option<f64> = None;
        for (&i, &t) in &s.tokens {
            if t >= threshold {
                buckets.push(i);
                if median_tokens > 0.0 {
                    let f = t / median_tokens;
                    peak = Some(peak.map_or(f, |p: f64| p.max(f)));
                }
            }
        }
        if !buckets.is_empty() {
            buckets.sort_unstable();
            flags.push(Flag {
                caller: caller.to_string(),
                buckets,
                base: SpikeBaseline {
                    median_tokens,
                    mad_tokens,
                    median_requests,
                    tokens_per_request: tpr,
                    threshold_tokens: threshold,
                },
                peak,
            });
        }
    }
    // Record indices per flagged caller (one pass over the window).
    let flagged: BTreeSet<&str> = flags.iter().map(|f| f.caller.as_str()).collect();
    let mut of_caller: BTreeMap<String, Vec<&RequestRecord>> = BTreeMap::new();
    if !flagged.is_empty() {
        for r in window {
            let c = caller_key(r);
            if flagged.contains(c.as_ref()) {
                of_caller.entry(c.into_owned()).or_default().push(r);
            }
        }
    }
    let mut spikes: Vec<Spike> = flags
        .into_iter()
        .map(|f| {
            let set: BTreeSet<usize> = f.buckets.iter().copied().collect();
            let reqs: Vec<&RequestRecord> = of_caller
                .get(&f.caller)
                .map(|v| {
                    v.iter()
                        .copied()
                        .filter(|r| wb.index(r.created_at).is_some_and(|i| set.contains(&i)))
                        .collect()
                })
                .unwrap_or_default();
            let tokens: u64 = reqs.iter().map(|r| total_tokens(r)).sum();
            let n = reqs.len() as u64;
            let scaled: f64 = {
                cur.get(f.caller.as_str()).map_or(0.0, |s| {
                    f.buckets.iter().filter_map(|i| s.tokens.get(i)).sum()
                })
            };
            let nb = f.buckets.len() as f64;
            let excess = (scaled - nb * f.base.median_tokens).max(0.0);
            let mut by_hash: BTreeMap<&str, u64> = BTreeMap::new();
            let mut by_type: BTreeMap<&str, u64> = BTreeMap::new();
            for r in &reqs {
                if let Some(h) = r.prompt_hash.as_deref() {
                    *by_hash.entry(h).or_default() += total_tokens(r);
                }
                *by_type.entry(r.request_type.as_str()).or_default() += total_tokens(r);
            }
            let top = top_key(&by_hash);
            let factor = (f.base.median_tokens > 0.0).then(|| scaled / (nb * f.base.median_tokens));
            let request_factor =
                (f.base.median_requests > 0.0).then(|| n as f64 / (nb * f.base.median_requests));
            let tpr_factor = (f.base.tokens_per_request > 0.0 && n > 0)
                .then(|| tokens as f64 / n as f64 / f.base.tokens_per_request);
            let more = request_factor.is_some_and(|x| x >= 1.5);
            let larger = tpr_factor.is_some_and(|x| x >= 1.5);
            let cause = match (factor.is_some(), more, larger) {
                (false, _, _) => "new caller",
                (true, true, true) => "more and larger requests",
                (true, false, true) => "larger requests",
                _ => "more requests",
            };
            Spike {
                business_line: business_line_of(reqs.iter().copied()),
                first_spike_us: wb.start(f.buckets[0]),
                last_spike_us: wb.start(f.buckets[f.buckets.len() - 1]) + wb.len_us,
                spike_buckets: f.buckets.len(),
                peak_factor: f.peak,
                factor,
                spike_tokens: tokens,
                spike_requests: n,
                excess_tokens: excess,
                share_of_excess: 0.0,
                request_factor,
                tokens_per_request_factor: tpr_factor,
                cause: cause.to_string(),
                top_prompt_hash_share: top
                    .as_ref()
                    .map_or(0.0, |(_, t)| *t as f64 / tokens.max(1) as f64),
                top_prompt_hash: top.map(|(h, _)| h.to_string()),
                top_request_type: top_key(&by_type).map(|(k, _)| k.to_string()),
                baseline: f.base,
                caller: f.caller,
            }
        })
        .collect();
    spikes.sort_by(|a, b| {
        b.excess_tokens
            .total_cmp(&a.excess_tokens)
            .then_with(|| a.caller.cmp(&b.caller))
    });
    // Summed in the sorted order (deterministic float sum).
    let total_excess: f64 = spikes.iter().map(|s| s.excess_tokens).sum();
    for s in &mut spikes {
        s.share_of_excess = if total_excess > 0.0 {
            s.excess_tokens / total_excess
        } else {
            0.0
        };
    }
    spikes
}

fn find_drops(
    window: &[&RequestRecord],
    base: &[&RequestRecord],
    wb: &Buckets,
    bb: &Buckets,
    opts: &AnomalyOptions,
) -> Vec<RateDrop> {
    // Series per scope: total and each business line.
    let count = |rs: &[&RequestRecord], b: &Buckets| {
        let mut total = vec![0.0; b.n];
        let mut lines: HashMap<&str, Vec<f64>> = HashMap::new();
        for r in rs {
            let Some(i) = b.index(r.created_at) else {
                continue;
            };
            total[i] += b.scale[i];
            if let Some(bl) = r.business_line.as_deref() {
                lines.entry(bl).or_insert_with(|| vec![0.0; b.n])[i] += b.scale[i];
            }
        }
        let mut m: BTreeMap<String, Vec<f64>> = lines
            .into_iter()
            .map(|(k, v)| (format!("business_line:{k}"), v))
            .collect();
        m.insert("total".to_string(), total);
        m
    };
    let cur = count(window, wb);
    let prev = count(base, bb);
    let mut drops = Vec::new();
    for (scope, pv) in &prev {
        let (med, _) = median_mad(pv);
        if med < opts.drop_min_baseline_requests {
            continue;
        }
        let zeros = vec![0.0; wb.n];
        let cv = cur.get(scope).unwrap_or(&zeros);
        let limit = opts.drop_fraction * med;
        let mut i = 0;
        while i < cv.len() {
            if cv[i] < limit {
                let start = i;
                while i < cv.len() && cv[i] < limit {
                    i += 1;
                }
                let n = i - start;
                if n >= opts.drop_min_buckets {
                    let mean = cv[start..i].iter().sum::<f64>() / n as f64;
                    drops.push(RateDrop {
                        scope: scope.clone(),
                        from_us: wb.start(start),
                        until_us: wb.start(i),
                        buckets: n,
                        requests_per_bucket: mean,
                        baseline_median: med,
                        ratio: mean / med,
                    });
                }
            } else {
                i += 1;
            }
        }
    }
    drops.sort_by(|a, b| {
        a.from_us
            .cmp(&b.from_us)
            .then_with(|| a.scope.cmp(&b.scope))
    });
    drops
}

fn find_loops(window: &[&RequestRecord], opts: &AnomalyOptions) -> Vec<Loop> {
    let mut groups: HashMap<(Cow<'_, str>, &str), Vec<&RequestRecord>> = HashMap::new();
    for r in window {
        if let Some(h) = r.prompt_hash.as_deref() {
            groups.entry((caller_key(r), h)).or_default().push(r);
        }
    }
    let mut loops = Vec::new();
    for ((caller, hash), rs) in groups {
        if rs.len() < opts.loop_min_requests {
            continue;
        }
        let intervals: Vec<f64> = rs
            .windows(2)
            .map(|w| (w[1].created_at - w[0].created_at) as f64 / 1e6)
            .collect();
        let Some(cv) = coefficient_of_variation(&intervals) else {
            continue;
        };
        let period = median(&mut intervals.clone());
        if cv <= opts.loop_max_cv && period >= opts.loop_min_period_s {
            loops.push(Loop {
                business_line: business_line_of(rs.iter().copied()),
                prompt_hash: hash.to_string(),
                requests: rs.len(),
                period_s: period,
                cv,
                first_us: rs[0].created_at,
                last_us: rs[rs.len() - 1].created_at,
                tokens: rs.iter().map(|r| total_tokens(r)).sum(),
                caller: caller.into_owned(),
            });
        }
    }
    loops.sort_by(|a, b| {
        b.tokens
            .cmp(&a.tokens)
            .then_with(|| a.caller.cmp(&b.caller))
            .then_with(|| a.prompt_hash.cmp(&b.prompt_hash))
    });
    loops
}

/// Population standard deviation / mean (`None` when the mean is not positive or `v` is empty).
pub fn coefficient_of_variation(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if mean <= 0.0 {
        return None;
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    Some(var.sqrt() / mean)
}

fn find_bursts(
    window: &[&RequestRecord],
    loop_hashes: &BTreeSet<&str>,
    opts: &AnomalyOptions,
) -> Vec<Burst> {
    let mut groups: HashMap<&str, Vec<&RequestRecord>> = HashMap::new();
    for r in window {
        if let Some(h) = r.prompt_hash.as_deref() {
            if !loop_hashes.contains(h) {
                groups.entry(h).or_default().push(r);
            }
        }
    }
    let mut bursts = Vec::new();
    for (hash, rs) in groups {
        if rs.len() < opts.burst_min_requests {
            continue;
        }
        // Densest span: two pointers over times in order (records are sorted by created_at).
        let (mut best, mut best_lo, mut lo) = (0usize, 0usize, 0usize);
        for hi in 0..rs.len() {
            while rs[hi].created_at - rs[lo].created_at > opts.burst_span_us {
                lo += 1;
            }
            if hi + 1 - lo > best {
                best = hi + 1 - lo;
                best_lo = lo;
            }
        }
        if best < opts.burst_min_requests {
            continue;
        }
        let span = &rs[best_lo..best_lo + best];
        let callers: BTreeSet<String> = span.iter().map(|r| caller_of(r)).collect();
        let first = span[0].created_at;
        let last = span[span.len() - 1].created_at;
        bursts.push(Burst {
            prompt_hash: hash.to_string(),
            requests: best,
            first_us: first,
            last_us: last,
            span_s: (last - first) as f64 / 1e6,
            tokens: span.iter().map(|r| total_tokens(r)).sum(),
            callers: callers.into_iter().collect(),
        });
    }
    bursts.sort_by(|a, b| {
        b.requests
            .cmp(&a.requests)
            .then_with(|| a.prompt_hash.cmp(&b.prompt_hash))
    });
    bursts
}

fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

impl Report for AnomalyReport {
    fn render_table(&self) -> String {
        let s = &self.settings;
        let mut out = format!(
            "Anomalies {} → {} UTC: {} records, {} buckets of {} s, baseline {} ({} records)\n",
            format_date_time(self.window.since_us),
            format_date_time(self.window.until_us),
            self.records,
            s.buckets,
            s.bucket_s,
            s.baseline,
            s.baseline_records
        );
        if let Some(n) = &self.note {
            out.push_str(&format!("note: {n}\n"));
        }
        if self.anomalies == 0 {
            out.push_str("No anomaly.\n");
            return out;
        }
        let mut t = table(&["kind", "who", "when (UTC)", "what", "why"]);
        for r in self.rows() {
            t.add_row(r);
        }
        out.push_str(&t.to_string());
        out.push('\n');
        out
    }

    /// The table's rows: kind, who, when (UTC), what, why.
    fn csv_rows(&self) -> CsvRows {
        CsvRows {
            header: ["kind", "who", "when_utc", "what", "why"]
                .map(str::to_owned)
                .to_vec(),
            rows: self.rows(),
        }
    }
}

impl AnomalyReport {
    /// One row per finding (spikes, loops, bursts, drops): kind, who, when, what, why.
    fn rows(&self) -> Vec<Vec<String>> {
        let s = &self.settings;
        let mut rows = Vec::new();
        for x in &self.spikes {
            rows.push(vec![
                "token spike".to_string(),
                format!(
                    "{}{}",
                    x.caller,
                    x.business_line
                        .as_deref()
                        .map(|b| format!(" ({b})"))
                        .unwrap_or_default()
                ),
                format_date_time(x.first_spike_us),
                format!(
                    "{}, {} tokens in {} bucket(s), {:.0} % of the spike excess; {}; top prompt {} ({:.0} %), type {}",
                    x.factor.map_or("no baseline".to_string(), |f| format!("{f:.1} × baseline")),
                    x.spike_tokens,
                    x.spike_buckets,
                    x.share_of_excess * 100.0,
                    x.cause,
                    x.top_prompt_hash.as_deref().map(short).unwrap_or("-"),
                    x.top_prompt_hash_share * 100.0,
                    x.top_request_type.as_deref().unwrap_or("-"),
                ),
                format!(
                    "≥ max({}×median {:.0}, median+{}·1.4826·MAD {:.0}, floor {}) = {:.0} tokens/bucket",
                    s.spike_factor,
                    x.baseline.median_tokens,
                    s.mad_k,
                    x.baseline.mad_tokens,
                    s.min_spike_tokens,
                    x.baseline.threshold_tokens
                ),
            ]);
        }
        for x in &self.loops {
            rows.push(vec![
                "loop".to_string(),
                x.caller.clone(),
                format!(
                    "{} → {}",
                    format_date_time(x.first_us),
                    format_date_time(x.last_us)
                ),
                format!(
                    "prompt {} repeated {} times every {:.2} s, {} tokens",
                    short(&x.prompt_hash),
                    x.requests,
                    x.period_s,
                    x.tokens
                ),
                format!("interval CV {:.3} ≤ {}", x.cv, s.loop_max_cv),
            ]);
        }
        for x in &self.bursts {
            rows.push(vec![
                "duplicate burst".to_string(),
                x.callers.join(", "),
                format_date_time(x.first_us),
                format!(
                    "prompt {} sent {} times in {:.1} s, {} tokens",
                    short(&x.prompt_hash),
                    x.requests,
                    x.span_s,
                    x.tokens
                ),
                format!(
                    "≥ {} in {} s, not periodic",
                    s.burst_min_requests, s.burst_span_s
                ),
            ]);
        }
        for x in &self.drops {
            rows.push(vec![
                "drop".to_string(),
                x.scope.clone(),
                format!(
                    "{} → {}",
                    format_date_time(x.from_us),
                    format_date_time(x.until_us)
                ),
                format!(
                    "{:.1} requests/bucket vs baseline {:.1} ({:.0} %) for {} buckets",
                    x.requests_per_bucket,
                    x.baseline_median,
                    x.ratio * 100.0,
                    x.buckets
                ),
                format!(
                    "< {} × median for ≥ {} buckets",
                    s.drop_fraction, s.drop_min_buckets
                ),
            ]);
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: i64 = 1_000_000;

    fn rec(t: i64, user: &str, hash: &str, input: u64, output: u64) -> RequestRecord {
        RequestRecord {
            request_id: format!("{user}-{t}-{hash}"),
            created_at: t,
            user_id: Some(user.into()),
            business_line: Some(format!("bl-{user}")),
            request_type: "chat".into(),
            prompt_hash: Some(hash.into()),
            input_tokens: Some(input),
            output_tokens: Some(output),
            ..RequestRecord::default()
        }
    }

    fn sorted(mut v: Vec<RequestRecord>) -> Vec<RequestRecord> {
        v.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then_with(|| a.request_id.cmp(&b.request_id))
        });
        v
    }

    /// Steady: 3 callers × 4 requests/s of 60 tokens, distinct prompts.
    fn steady(from: i64, to: i64, growth: f64) -> Vec<RequestRecord> {
        let mut v = Vec::new();
        for (k, u) in ["web", "mobile", "batch"].iter().enumerate() {
            let mut t = from + k as i64 * 37_000;
            let mut i = 0;
            while t < to {
                v.push(rec(t, u, &format!("{u}-{i}"), 40, 20));
                let progress = (t - from) as f64 / (to - from) as f64;
                t += (250_000.0 / (1.0 + growth * progress)) as i64;
                i += 1;
            }
        }
        v
    }

    fn opts() -> AnomalyOptions {
        AnomalyOptions {
            bucket_us: Some(S),
            min_spike_tokens: 500,
            ..AnomalyOptions::default()
        }
    }

    #[test]
    fn spike_and_loop_are_traced_to_one_caller() {
        let w = Window {
            since_us: 0,
            until_us: 20 * S,
        };
        let mut v = steady(0, 20 * S, 0.0);
        for i in 0..20 {
            v.push(rec(10 * S + i * 500_000 + 3, "batch", "LOOP", 400, 200));
        }
        let v = sorted(v);
        let r = anomalies(&v, w, Baseline::FirstHalf, &opts()).expect("valid");
        assert_eq!(r.spikes.len(), 1, "{r:#?}");
        let table = r.render_table();
        eprintln!("{table}");
        assert!(table.contains("batch") && table.contains("every 0.50 s"));
        let s = &r.spikes[0];
        assert_eq!(s.caller, "batch");
        assert_eq!(s.business_line.as_deref(), Some("bl-batch"));
        assert_eq!(s.first_spike_us, 10 * S);
        assert_eq!(s.spike_buckets, 10);
        assert!((s.share_of_excess - 1.0).abs() < 1e-12);
        assert_eq!(s.top_prompt_hash.as_deref(), Some("LOOP"));
        assert!(s.factor.expect("baseline") > 5.0);
        // 4 → 6 requests/s (×1.5) and 60 → 260 tokens per request.
        assert_eq!(s.cause, "more and larger requests");
        assert_eq!(r.loops.len(), 1);
        let l = &r.loops[0];
        assert_eq!((l.caller.as_str(), l.requests), ("batch", 20));
        assert!((l.period_s - 0.5).abs() < 1e-9);
        assert!(r.bursts.is_empty() && r.drops.is_empty());
        // Same with a prior baseline.
        let base = sorted(steady(-10 * S, 0, 0.0));
        let w2 = Window {
            since_us: 10 * S,
            until_us: 20 * S,
        };
        let in_w2: Vec<RequestRecord> = v
            .iter()
            .filter(|r| w2.contains(r.created_at))
            .cloned()
            .collect();
        let r2 = anomalies(
            &in_w2,
            w2,
            Baseline::Prior {
                window: Window {
                    since_us: -10 * S,
                    until_us: 0,
                },
                records: &base,
            },
            &opts(),
        )
        .expect("valid");
        assert_eq!(r2.spikes.len(), 1);
        assert_eq!(r2.spikes[0].caller, "batch");
        assert_eq!(r2.loops.len(), 1);
    }

    #[test]
    fn quiet_growth_is_not_an_anomaly() {
        let w = Window {
            since_us: 0,
            until_us: 30 * S,
        };
        let v = sorted(steady(0, 30 * S, 0.2));
        let r = anomalies(&v, w, Baseline::FirstHalf, &opts()).expect("valid");
        assert_eq!(r.anomalies, 0, "{r:#?}");
    }

    #[test]
    fn burst_and_drop() {
        let w = Window {
            since_us: 0,
            until_us: 20 * S,
        };
        let mut v: Vec<RequestRecord> = steady(0, 15 * S, 0.0);
        // Irregular resubmissions of one prompt by two users.
        for (i, dt) in [0, 10, 15, 200, 210, 900, 905, 1500, 1800, 1810, 2500]
            .iter()
            .enumerate()
        {
            let u = if i.is_multiple_of(2) { "web" } else { "mobile" };
            v.push(rec(5 * S + dt * 1000, u, "DUP", 10, 10));
        }
        let v = sorted(v);
        let r = anomalies(&v, w, Baseline::FirstHalf, &opts()).expect("valid");
        assert_eq!(r.bursts.len(), 1, "{r:#?}");
        assert_eq!(r.bursts[0].requests, 11);
        assert_eq!(r.bursts[0].callers, vec!["mobile", "web"]);
        assert!(r.loops.is_empty());
        let total: Vec<&RateDrop> = r.drops.iter().filter(|d| d.scope == "total").collect();
        assert_eq!(total.len(), 1, "{:#?}", r.drops);
        assert_eq!(total[0].from_us, 15 * S);
        assert_eq!(total[0].buckets, 5);
        // Each business line has a median of 4 requests/bucket, below the 5-request minimum.
        assert_eq!(r.drops.len(), 1);
    }

    #[test]
    fn no_baseline_is_said() {
        let w = Window {
            since_us: 10 * S,
            until_us: 20 * S,
        };
        let v = sorted(steady(10 * S, 20 * S, 0.0));
        let r = anomalies(
            &v,
            w,
            Baseline::Prior {
                window: Window {
                    since_us: 0,
                    until_us: 10 * S,
                },
                records: &[],
            },
            &opts(),
        )
        .expect("valid");
        assert!(r.note.is_some());
        assert_eq!(r.anomalies, 0);
        assert!(r.render_table().contains("No anomaly"));
    }

    /// 1 M records, 1 000 callers, 1 h window + 6 h baseline: `cargo test --release -p
    /// tokenscope-analysis one_million -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn one_million_records() {
        let gen = |from: i64, n: i64| -> Vec<RequestRecord> {
            (0..n)
                .map(|i| {
                    let u = format!("user{}", (i * 7919) % 1000);
                    rec(
                        from + i * 3600,
                        &u,
                        &format!("h{}", (i * 104_729) % 300_000),
                        100 + (i % 97) as u64,
                        50,
                    )
                })
                .collect()
        };
        let gen_spread = |from: i64, n: i64, k: i64| -> Vec<RequestRecord> {
            let mut v = gen(0, n);
            for r in &mut v {
                r.created_at = from + r.created_at * k;
            }
            v
        };
        let w = Window {
            since_us: 0,
            until_us: 1_000_000 * 3600,
        };
        let v = gen(0, 1_000_000);
        let base = gen_spread(-6 * 3600 * S, 1_000_000, 6);
        let t = std::time::Instant::now();
        let r = anomalies(
            &v,
            w,
            Baseline::Prior {
                window: Window {
                    since_us: -6 * 3600 * S,
                    until_us: 0,
                },
                records: &base,
            },
            &AnomalyOptions::default(),
        )
        .expect("valid");
        eprintln!(
            "anomalies over 1M records: {:?}, {} findings",
            t.elapsed(),
            r.anomalies
        );
        let t = std::time::Instant::now();
        let wr = crate::waste::waste(
            &v,
            w,
            &crate::PriceTable::default(),
            &crate::waste::WasteOptions::default(),
        );
        eprintln!(
            "waste over 1M records: {:?}, {} tokens saved",
            t.elapsed(),
            wr.saving.tokens
        );
    }

    #[test]
    fn time_format() {
        assert_eq!(format_date_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_date_time(1_700_000_000 * S), "2023-11-14 22:13:20");
    }

    proptest! {
        #[test]
        fn median_mad_bounds(v in proptest::collection::vec(0.0f64..1e6, 1..200)) {
            let (m, mad) = median_mad(&v);
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(m >= lo && m <= hi);
            prop_assert!(mad >= 0.0 && mad <= hi - lo);
        }

        #[test]
        fn periodic_series_is_a_loop(period_ms in 100i64..10_000, n in 5usize..50, jitter in 0i64..5) {
            let v: Vec<RequestRecord> = (0..n as i64)
                .map(|i| rec(i * period_ms * 1000 + (i % 2) * jitter * 1000, "u", "H", 1, 1))
                .collect();
            let w = Window { since_us: 0, until_us: n as i64 * period_ms * 1000 + 1 };
            let r = anomalies(&v, w, Baseline::FirstHalf, &AnomalyOptions::default()).expect("valid");
            prop_assert_eq!(r.loops.len(), 1);
            prop_assert!((r.loops[0].period_s * 1000.0 - period_ms as f64).abs() <= jitter as f64 + 1e-6);
        }

        #[test]
        fn report_is_deterministic(seed in 0u64..1000) {
            let mut v = steady(0, 10 * S, (seed % 5) as f64 / 10.0);
            v.push(rec((seed as i64 % 10) * S, "x", "H", 5000, 10));
            let v = sorted(v);
            let w = Window { since_us: 0, until_us: 10 * S };
            let a = anomalies(&v, w, Baseline::FirstHalf, &opts()).expect("valid");
            let b = anomalies(&v, w, Baseline::FirstHalf, &opts()).expect("valid");
            prop_assert_eq!(a.render(crate::Format::Json), b.render(crate::Format::Json));
        }
    }
}
