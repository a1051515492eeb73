//! `tokenscope diagnose`: walks the article's decision tree over the records of a window and
//! says, step by step, what is wrong, with the numbers it decided from.
//!
//! ## Method
//!
//! Five steps, in tree order. Each has a verdict (`ok`, `problem`, or `unknown` when the data
//! it needs is missing), named evidence, the thresholds it compared against, the findings it
//! made and the remedies for them:
//!
//! 1. **success** — `ok` outcomes / requests; problem below [`DiagnoseOptions::min_success_rate`];
//!    the top error types with their counts.
//! 2. **ttft** — nearest-rank P50/P99 of TTFT (the gateway's; for a request without one — not
//!    streamed — the engine's queue + prefill where both are known; `ttft_source` says which), overall and per input bucket; the queue share
//!    of TTFT (Σ queue / Σ TTFT over rows having both) and the prefill share; concurrency from
//!    the request intervals `[created_at, created_at + total]` (mean = Σ durations / window,
//!    peak by a sweep). **Starvation check**: the *long* bucket is `2048+` when it has
//!    requests, else `512-2048`; its requests' prefill intervals `[created_at, created_at +
//!    TTFT]` are merged; a short request (`0-128`, `128-512`) *overlaps* when its own `[created_at,
//!    created_at + TTFT]` intersects that union. When both groups have at least
//!    [`DiagnoseOptions::min_samples`] requests and P50(overlapping) / P50(alone) ≥
//!    [`DiagnoseOptions::starvation_ratio`], the finding is `starvation` ("long prompts starve
//!    short ones") naming the long bucket. `queueing` when the queue share ≥
//!    [`DiagnoseOptions::queue_share`] and the mean queue ≥ [`DiagnoseOptions::queue_min_ms`], and before it `queue_kv_bound` (the queue is the KV
//!    cache's: admission waits for cache room) when, without starvation, the queue share or
//!    the P99 TTFT is beyond its threshold, at least one request was waiting and the KV cache
//!    *holds the batch* (below); `slow_ttft` when P99 TTFT > [`DiagnoseOptions::ttft_p99_ms`]
//!    (with `prefill_bound` when the prefill share dominates instead). **Time the engine did
//!    not account for** (`ttft_unaccounted_ms`, `RequestRecord::split_times`): a request whose
//!    unaccounted time is ≥ [`DiagnoseOptions::unaccounted_share`] of its TTFT and ≥
//!    [`DiagnoseOptions::unaccounted_min_ms`] is *dominated* by it; those that arrived with
//!    requests waiting in the engine (`engine_waiting ≥ 1`) queued there (an engine that
//!    reports no queue, llama.cpp) and are left to the queue share; when at least
//!    [`DiagnoseOptions::unaccounted_min_requests`] others remain the finding is
//!    `unaccounted_wait`, caused by *step blocking* (the gateway's blame covers ≥ half of their
//!    wait: the engine was busy with a step — a long prefill — that began before they arrived,
//!    named with the blocker's caller) or else the engine's *frontend* (HTTP / API server,
//!    tokenisation, network). Engine phases flagged `exceeds_gateway` are left out of the
//!    shares and of the engine TTFT; `engine_timing` counts each kind. Any finding → problem.
//! 3. **tpot** — P50/P99 of TPOT; decode share (Σ decode / Σ total); KV-cache usage at
//!    arrival (P50/P90 of `engine_kv_usage`); batch size proxy (`engine_running` at arrival:
//!    mean, P50, max); GPU memory bandwidth P50 when known. Problem when P99 TPOT >
//!    [`DiagnoseOptions::tpot_p99_ms`]; the finding is `decode_kv_bound` when the KV cache
//!    holds the batch, `memory_bandwidth_bound` when bandwidth P50 ≥ 0.8, `decode_batch_bound`
//!    when the batch is large (P50 running > [`DiagnoseOptions::small_batch`]) and the cache is
//!    not what holds it, else `slow_decode`.
//!
//! **What holds the batch.** A batch is judged against what the engine can run: the configured
//! maximum ([`DiagnoseOptions::max_batch`], `--max-batch`) or, without one, the largest
//! `engine_running` seen in the window (`batch_limit`, `batch_limit_source`). The KV cache
//! holds it (`batch_held_by: kv_cache`) when KV P90 ≥ [`DiagnoseOptions::kv_high`] and either
//! the batch is small in absolute terms (P50 running ≤ [`DiagnoseOptions::small_batch`]) or
//! requests waited while the batch was below 90 % of the configured maximum (a slot was free,
//! cache room was not; with no configured maximum a near-full cache with requests waiting is
//! taken as the cache's). The slots hold it (`slots`) when the cache is not near full, requests
//! waited and the batch is at ≥ 90 % of its maximum. Where GPU telemetry is known, GPU P50 ≥
//! 90 % busy at ≤ 50 % memory bandwidth is named with a cache-held batch (the article's case).
//! A cache-held batch never gets "lower max_num_seqs": the slots are not what limits it.
//! 4. **tokens** — top callers (`user_id`, else `tenant`, else `(unknown)`) by input + output
//!    tokens with their share; tokens per request in the first vs the second half of the
//!    window (`token_growth` when the ratio ≥ [`DiagnoseOptions::token_growth_ratio`] with
//!    enough samples in both halves); and what the anomaly detector
//!    ([`crate::anomalies`], the window's first half as baseline, default thresholds) finds:
//!    `token_spike` (a caller's tokens per bucket ≥ 3× its own baseline; new callers are
//!    listed only), `caller_loop` (one caller, one prompt, a fixed period, at ≥
//!    [`DiagnoseOptions::loop_problem_rate`] requests/s; slower loops — health checks, crons —
//!    are listed only), `duplicate_burst` (one prompt resubmitted irregularly, holding ≥ 10 %
//!    of the window's tokens), `request_drop` (requests per bucket below half the baseline for
//!    3+ buckets, with the requests sent during the drop that failed or were discarded, by
//!    outcome). Spikes and drops are judged only when the first half holds ≥ 10 buckets (a
//!    window of seconds padded with idle time is no baseline). Any finding → problem; the
//!    summary names the caller and its business line.
//! 5. **network** — P99 of `gateway_overhead_ms` and of an upstream connect/transfer proxy:
//!    `upstream_headers_ms` for streamed requests (engines send headers before queueing), and
//!    `upstream_headers_ms − (queue + prefill + decode)` (clamped at 0) for non-streamed ones
//!    whose phases are known. Problem above [`DiagnoseOptions::gateway_overhead_p99_ms`] /
//!    [`DiagnoseOptions::network_p99_ms`].
//!
//! The conclusion is the first problem step in tree order with its findings and remedies (the
//! others are listed as `also`), or `healthy`. One exception: when the TTFT problem is
//! queueing / slow TTFT *without* starvation and the TPOT step finds `decode_kv_bound`, the
//! conclusion is the TPOT step — a full KV cache makes admission wait, so the queueing is a
//! symptom of the KV cache, not a cause. (When TPOT is fine but the TTFT step finds
//! `queue_kv_bound`, the TTFT step is the conclusion and names the cache itself.)
//!
//! ## Invariants
//!
//! * Pure and deterministic: the same records, options and window give byte-identical JSON
//!   (maps are `BTreeMap`s, lists have a defined order, ties broken by name).
//! * Percentiles are exact nearest-rank (`P(q) = x_k`, `k = ⌈q·n⌉`), never interpolated.
//! * O(n log n) in the number of records.

use crate::{table, total_tokens, CsvRows, Report, Window};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use tokenscope_core::success::SuccessCount;
use tokenscope_core::{InputBucket, Outcome, RequestRecord};

/// Thresholds of the decision tree (all overridable from the CLI).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnoseOptions {
    /// Success rate below this is a problem. Default 0.99.
    pub min_success_rate: f64,
    /// P99 TTFT above this (ms) is a problem. Default 2000.
    pub ttft_p99_ms: f64,
    /// Queue share of TTFT at or above this means queueing. Default 0.5.
    pub queue_share: f64,
    /// …when the mean engine queue per request (over the requests with one) is at least this
    /// many ms: a 2 ms wait in a 4 ms TTFT is half of it and still nobody's problem. Default 10.
    pub queue_min_ms: f64,
    /// P50 TTFT of short requests beside long prefills / alone at or above this means
    /// starvation. Default 2.0.
    pub starvation_ratio: f64,
    /// Fewest samples per compared group (starvation, token trend). Default 10.
    pub min_samples: usize,
    /// P99 TPOT above this (ms) is a problem. Default 50 (20 tokens/s per stream, the usual
    /// floor for interactive chat).
    pub tpot_p99_ms: f64,
    /// KV-cache usage P90 at or above this is "near full". Default 0.9.
    pub kv_high: f64,
    /// Running requests (P50 at arrival) at or below this is a small batch in absolute terms.
    /// Default 4.
    pub small_batch: f64,
    /// The most requests the engine may run at once as configured (vLLM `max_num_seqs`,
    /// llama.cpp `-np`, SGLang `max_running_requests`). `None`: the largest `engine_running`
    /// seen in the window stands in for it. Default `None`.
    pub max_batch: Option<f64>,
    /// Second-half / first-half tokens per request at or above this is abnormal growth.
    /// Default 2.0.
    pub token_growth_ratio: f64,
    /// P99 gateway overhead above this (ms) is a problem. Default 50.
    pub gateway_overhead_p99_ms: f64,
    /// P99 upstream connect/transfer proxy above this (ms) is a problem. Default 500.
    pub network_p99_ms: f64,
    /// Callers listed in the tokens step. Default 5.
    pub top_callers: usize,
    /// A loop (one caller, one prompt, a fixed period) at or above this many requests per
    /// second is a problem; slower ones (health checks, crons) are listed only. Default 1.
    pub loop_problem_rate: f64,
    /// A request's TTFT is *dominated by time the engine did not account for* when its
    /// `ttft_unaccounted_ms` is at least this share of its TTFT… Default 0.5.
    pub unaccounted_share: f64,
    /// …and at least this many ms. Default 100.
    pub unaccounted_min_ms: f64,
    /// Fewest such requests (outside the engine's own queue) for the `unaccounted_wait`
    /// finding. Default 3.
    pub unaccounted_min_requests: usize,
}

impl Default for DiagnoseOptions {
    fn default() -> Self {
        Self {
            min_success_rate: 0.99,
            ttft_p99_ms: 2000.0,
            queue_share: 0.5,
            queue_min_ms: 10.0,
            starvation_ratio: 2.0,
            min_samples: 10,
            tpot_p99_ms: 50.0,
            kv_high: 0.9,
            small_batch: 4.0,
            max_batch: None,
            token_growth_ratio: 2.0,
            gateway_overhead_p99_ms: 50.0,
            network_p99_ms: 500.0,
            top_callers: 5,
            loop_problem_rate: 1.0,
            unaccounted_share: 0.5,
            unaccounted_min_ms: 100.0,
            unaccounted_min_requests: 3,
        }
    }
}

/// A step's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Within thresholds.
    Ok,
    /// A threshold is crossed; see the findings.
    Problem,
    /// The data this step needs is missing.
    Unknown,
}

impl Verdict {
    fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Problem => "problem",
            Verdict::Unknown => "unknown",
        }
    }
}

/// One step of the tree.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    /// `success`, `ttft`, `tpot`, `tokens`, `network`.
    pub step: String,
    /// The verdict.
    pub verdict: Verdict,
    /// Machine-readable findings (e.g. `starvation`, `queueing`, `decode_kv_bound`).
    pub findings: Vec<String>,
    /// One sentence saying what was found.
    pub summary: String,
    /// Named numbers the verdict was decided from.
    pub evidence: BTreeMap<String, Value>,
    /// The thresholds compared against.
    pub thresholds: BTreeMap<String, f64>,
    /// What to do about the findings.
    pub remedies: Vec<String>,
}

/// The end of the walk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Conclusion {
    /// `problem` or `healthy`.
    pub verdict: String,
    /// The first problem step in tree order.
    pub step: Option<String>,
    /// Its findings.
    pub findings: Vec<String>,
    /// Its summary (or "healthy").
    pub summary: String,
    /// Its remedies.
    pub remedies: Vec<String>,
    /// Other problem steps, in tree order.
    pub also: Vec<String>,
}

/// The `tokenscope diagnose` report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnoseReport {
    /// The analysed window.
    pub window: Window,
    /// Records analysed.
    pub requests: u64,
    /// The steps, in tree order.
    pub steps: Vec<Step>,
    /// The conclusion.
    pub conclusion: Conclusion,
}

/// Exact nearest-rank percentile of `sorted` (ascending) `f64`s: the one definition,
/// [`tokenscope_core::query::nearest_rank`], under the name the diagnosis uses.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    tokenscope_core::query::nearest_rank(sorted, q)
}

/// The finite values of `it`, sorted ascending.
pub fn sorted_values(it: impl Iterator<Item = Option<f64>>) -> Vec<f64> {
    let mut v: Vec<f64> = it.flatten().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Rounds to 4 decimals for readable, stable JSON.
pub(crate) fn r4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn num(x: Option<f64>) -> Value {
    match x {
        Some(v) if v.is_finite() => json!(r4(v)),
        _ => Value::Null,
    }
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

struct StepBuilder {
    step: Step,
}

impl StepBuilder {
    fn new(name: &str) -> Self {
        Self {
            step: Step {
                step: name.to_owned(),
                verdict: Verdict::Ok,
                findings: Vec::new(),
                summary: String::new(),
                evidence: BTreeMap::new(),
                thresholds: BTreeMap::new(),
                remedies: Vec::new(),
            },
        }
    }
    fn ev(&mut self, k: &str, v: Value) {
        self.step.evidence.insert(k.to_owned(), v);
    }
    fn th(&mut self, k: &str, v: f64) {
        self.step.thresholds.insert(k.to_owned(), v);
    }
    fn find(&mut self, f: &str, remedies: &[String]) {
        self.step.verdict = Verdict::Problem;
        self.step.findings.push(f.to_owned());
        for r in remedies {
            if !self.step.remedies.contains(r) {
                self.step.remedies.push(r.clone());
            }
        }
    }
}

/// Runs the decision tree over `records` (those inside `window` are used).
pub fn diagnose(
    records: &[RequestRecord],
    window: Window,
    opts: &DiagnoseOptions,
) -> DiagnoseReport {
    let recs: Vec<&RequestRecord> = records
        .iter()
        .filter(|r| window.contains(r.created_at))
        .collect();
    let steps = vec![
        success_step(&recs, opts),
        ttft_step(&recs, window, opts),
        tpot_step(&recs, opts),
        tokens_step(&recs, records, window, opts),
        network_step(&recs, opts),
    ];
    let problems: Vec<&Step> = steps
        .iter()
        .filter(|s| s.verdict == Verdict::Problem)
        .collect();
    // A full KV cache makes admission wait: queueing / slow TTFT without starvation is then
    // a symptom, and the TPOT step holds the root cause.
    let kv_root = problems
        .first()
        .is_some_and(|s| s.step == "ttft" && !s.findings.iter().any(|f| f == "starvation"))
        && problems
            .iter()
            .any(|s| s.step == "tpot" && s.findings.iter().any(|f| f == "decode_kv_bound"));
    let chosen = if kv_root {
        problems.iter().find(|s| s.step == "tpot").copied()
    } else {
        problems.first().copied()
    };
    let conclusion = match chosen {
        Some(first) => Conclusion {
            verdict: "problem".to_owned(),
            step: Some(first.step.clone()),
            findings: first.findings.clone(),
            summary: if kv_root {
                format!(
                    "{} (the TTFT queueing is a consequence: admission waits for KV-cache room)",
                    first.summary
                )
            } else {
                first.summary.clone()
            },
            remedies: first.remedies.clone(),
            also: problems
                .iter()
                .filter(|s| s.step != first.step)
                .map(|s| s.step.clone())
                .collect(),
        },
        None => Conclusion {
            verdict: "healthy".to_owned(),
            step: None,
            findings: Vec::new(),
            summary: if recs.is_empty() {
                "no requests in the window".to_owned()
            } else {
                "healthy: every step is within its thresholds".to_owned()
            },
            remedies: Vec::new(),
            also: Vec::new(),
        },
    };
    DiagnoseReport {
        window,
        requests: recs.len() as u64,
        steps,
        conclusion,
    }
}

fn success_step(recs: &[&RequestRecord], opts: &DiagnoseOptions) -> Step {
    let mut b = StepBuilder::new("success");
    b.th("min_success_rate", opts.min_success_rate);
    let n = recs.len();
    b.ev("requests", json!(n));
    if n == 0 {
        b.step.verdict = Verdict::Unknown;
        b.step.summary = "no requests".to_owned();
        return b.step;
    }
    // The one definition (`tokenscope_core::success`): client errors and cancellations are
    // left out of the rate (they stay in `outcomes` below).
    let mut count = SuccessCount::default();
    recs.iter().for_each(|r| count.add(r.outcome));
    let Some(rate) = count.rate() else {
        b.ev("ok", json!(0));
        b.ev("success_rate", Value::Null);
        b.step.verdict = Verdict::Unknown;
        b.step.summary = "no request that counts in the success rate (client errors and \
                          cancellations only)"
            .to_owned();
        return b.step;
    };
    b.ev("ok", json!(count.ok));
    b.ev("success_rate", num(Some(rate)));
    let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
    let mut errors: HashMap<String, u64> = HashMap::new();
    for r in recs.iter().filter(|r| r.outcome != Outcome::Ok) {
        *outcomes.entry(r.outcome.as_str()).or_default() += 1;
        let e = r
            .error_type
            .clone()
            .unwrap_or_else(|| r.outcome.as_str().to_owned());
        *errors.entry(e).or_default() += 1;
    }
    let mut top: Vec<(String, u64)> = errors.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(5);
    b.ev("outcomes", json!(outcomes));
    b.ev(
        "top_error_types",
        Value::Array(
            top.iter()
                .map(|(e, c)| json!({"error_type": e, "count": c}))
                .collect(),
        ),
    );
    if rate < opts.min_success_rate {
        let worst = top.first().map_or("unknown", |t| t.0.as_str()).to_owned();
        b.find(
            "low_success_rate",
            &[
                format!("fix the top error type first: {worst}"),
                "timeouts / 429 / 5xx under load mean the engine is saturated: add capacity or limit concurrency at the gateway".to_owned(),
                "client errors (4xx) point at callers: check request validation and context-length limits".to_owned(),
            ],
        );
        b.step.summary = format!(
            "success rate {:.2}% < {:.2}%; top error type {worst}",
            rate * 100.0,
            opts.min_success_rate * 100.0
        );
    } else {
        b.step.summary = format!("success rate {:.2}%", rate * 100.0);
    }
    b.step
}

/// Merges `[start, end]` intervals sorted by start into disjoint ones.
fn merge(mut iv: Vec<(i64, i64)>) -> Vec<(i64, i64)> {
    iv.sort_unstable();
    let mut out: Vec<(i64, i64)> = Vec::with_capacity(iv.len());
    for (s, e) in iv {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Whether `[s, e]` intersects one of the disjoint, sorted `merged` intervals.
fn overlaps(merged: &[(i64, i64)], s: i64, e: i64) -> bool {
    // First interval whose end ≥ s.
    let i = merged.partition_point(|iv| iv.1 < s);
    merged.get(i).is_some_and(|iv| iv.0 <= e)
}

fn ms_to_us(ms: f64) -> i64 {
    (ms * 1000.0).round() as i64
}

fn ttft_step(recs: &[&RequestRecord], window: Window, opts: &DiagnoseOptions) -> Step {
    let mut b = StepBuilder::new("ttft");
    b.th("ttft_p99_ms", opts.ttft_p99_ms);
    b.th("queue_share", opts.queue_share);
    b.th("queue_min_ms", opts.queue_min_ms);
    b.th("starvation_ratio", opts.starvation_ratio);
    b.th("min_samples", opts.min_samples as f64);
    // A request without a gateway TTFT (not streamed, or nothing streamed) is judged on the
    // engine's time to first token, queue + prefill, where the engine (or the gateway's
    // derivation from its timings) gives both — the record's own phases, never a guess.
    let engine_ttft: Vec<RequestRecord> = recs
        .iter()
        .filter(|r| r.ttft_ms.is_none() && !exceeds_gateway(r))
        .filter_map(|r| {
            let t = r.queue_duration_ms? + r.prefill_duration_ms?;
            let mut c = (**r).clone();
            c.ttft_ms = Some(t);
            Some(c)
        })
        .collect();
    let with: Vec<&RequestRecord> = recs
        .iter()
        .copied()
        .filter(|r| r.ttft_ms.is_some())
        .chain(engine_ttft.iter())
        .collect();
    let from_gateway = with.len() - engine_ttft.len();
    b.ev("requests_with_ttft", json!(with.len()));
    b.ev("requests_with_engine_ttft", json!(engine_ttft.len()));
    b.ev(
        "ttft_source",
        json!(match (from_gateway, engine_ttft.len()) {
            (_, 0) => "gateway",
            (0, _) => "engine_queue_plus_prefill",
            _ => "gateway_and_engine_queue_plus_prefill",
        }),
    );
    // Concurrency from request intervals.
    let mut events: Vec<(i64, i32)> = Vec::with_capacity(recs.len() * 2);
    let mut busy_us = 0f64;
    for r in recs {
        let end = r.created_at + ms_to_us(r.total_duration_ms.max(0.0));
        events.push((r.created_at, 1));
        events.push((end, -1));
        busy_us += r.total_duration_ms.max(0.0) * 1000.0;
    }
    events.sort_unstable();
    let (mut cur, mut peak) = (0i64, 0i64);
    for (_, d) in &events {
        cur += i64::from(*d);
        peak = peak.max(cur);
    }
    b.ev(
        "concurrency_mean",
        num(Some(busy_us / (window.seconds() * 1e6))),
    );
    b.ev("concurrency_peak", json!(peak));
    if with.is_empty() {
        b.step.verdict = Verdict::Unknown;
        b.step.summary =
            "no request has a TTFT (none streamed, and no engine queue + prefill)".to_owned();
        return b.step;
    }
    let all = sorted_values(with.iter().map(|r| r.ttft_ms));
    let p50 = percentile(&all, 0.5);
    let p99 = percentile(&all, 0.99);
    b.ev("ttft_p50_ms", num(p50));
    b.ev("ttft_p99_ms", num(p99));
    let mut per_bucket = BTreeMap::new();
    for bucket in InputBucket::ALL {
        let v = sorted_values(
            with.iter()
                .filter(|r| r.input_bucket == Some(bucket))
                .map(|r| r.ttft_ms),
        );
        if !v.is_empty() {
            per_bucket.insert(
                bucket.as_str(),
                json!({"n": v.len(), "p50_ms": num(percentile(&v, 0.5)), "p99_ms": num(percentile(&v, 0.99))}),
            );
        }
    }
    b.ev("per_bucket", json!(per_bucket));
    // Shares.
    let (mut q_sum, mut qt_sum, mut p_sum, mut pt_sum) = (0.0, 0.0, 0.0, 0.0);
    let mut q_n = 0usize;
    // Engine phases above the gateway's measure are not this request's: out of the shares.
    for r in with.iter().filter(|r| !exceeds_gateway(r)) {
        let t = r.ttft_ms.unwrap_or(0.0);
        if let Some(q) = r.queue_duration_ms {
            q_sum += q;
            qt_sum += t;
            q_n += 1;
        }
        if let Some(p) = r.prefill_duration_ms {
            p_sum += p;
            pt_sum += t;
        }
    }
    let queue_share = ratio(q_sum, qt_sum);
    let prefill_share = ratio(p_sum, pt_sum);
    let queue_mean_ms = (q_n > 0).then(|| q_sum / q_n as f64);
    b.ev("queue_share", num(queue_share));
    b.ev("queue_mean_ms", num(queue_mean_ms));
    b.ev("prefill_share", num(prefill_share));

    // Starvation.
    let long_bucket = if with
        .iter()
        .any(|r| r.input_bucket == Some(InputBucket::B2048Plus))
    {
        Some(InputBucket::B2048Plus)
    } else if with
        .iter()
        .any(|r| r.input_bucket == Some(InputBucket::B512To2048))
    {
        Some(InputBucket::B512To2048)
    } else {
        None
    };
    let mut starvation = None;
    if let Some(lb) = long_bucket {
        let long_iv: Vec<(i64, i64)> = with
            .iter()
            .filter(|r| r.input_bucket == Some(lb))
            .map(|r| {
                (
                    r.created_at,
                    r.created_at + ms_to_us(r.ttft_ms.unwrap_or(0.0)),
                )
            })
            .collect();
        let merged = merge(long_iv);
        let (mut beside, mut alone) = (Vec::new(), Vec::new());
        for r in with.iter().filter(|r| {
            matches!(
                r.input_bucket,
                Some(InputBucket::B0To128 | InputBucket::B128To512)
            )
        }) {
            let t = r.ttft_ms.unwrap_or(0.0);
            if overlaps(&merged, r.created_at, r.created_at + ms_to_us(t)) {
                beside.push(t);
            } else {
                alone.push(t);
            }
        }
        beside.sort_by(f64::total_cmp);
        alone.sort_by(f64::total_cmp);
        let pb = percentile(&beside, 0.5);
        let pa = percentile(&alone, 0.5);
        let rat = match (pb, pa) {
            (Some(x), Some(y)) if y > 0.0 => Some(x / y),
            _ => None,
        };
        b.ev("long_bucket", json!(lb.as_str()));
        b.ev("short_beside_long_n", json!(beside.len()));
        b.ev("short_beside_long_ttft_p50_ms", num(pb));
        b.ev("short_alone_n", json!(alone.len()));
        b.ev("short_alone_ttft_p50_ms", num(pa));
        b.ev("starvation_ratio", num(rat));
        let enough = beside.len() >= opts.min_samples && alone.len() >= opts.min_samples;
        if enough && rat.is_some_and(|x| x >= opts.starvation_ratio) {
            starvation = Some((lb, rat.unwrap_or(0.0)));
        }
    }
    b.ev("engine_timing", engine_timing_counts(&with));
    let unacc = Unaccounted::of(&with, opts);
    if let Some(u) = &unacc {
        b.ev("unaccounted", u.json());
    }
    let queueing = queue_share.is_some_and(|s| s >= opts.queue_share)
        && queue_mean_ms.is_some_and(|m| m >= opts.queue_min_ms);
    let slow = p99.is_some_and(|x| x > opts.ttft_p99_ms);
    let blame = blame_evidence(&with);
    if let Some(bl) = &blame {
        b.ev("blame", bl.json());
    }
    let isolate = |lb: &str| {
        format!("isolation: route {lb} prompts to a separate pool / replica (or a separate priority class) so short requests never share a batch with them")
    };
    let cap = "cap prefill per step: chunked prefill with a smaller token budget (vLLM max_num_batched_tokens, SGLang chunked_prefill_size, llama.cpp --ubatch-size)".to_owned();
    let limit = "limit concurrency at the gateway (admission control per caller / per request class) or add replicas".to_owned();
    let mut parts = Vec::new();
    if let Some((lb, rat)) = starvation {
        b.find(
            "starvation",
            &[isolate(lb.as_str()), cap.clone(), limit.clone()],
        );
        parts.push(format!(
            "long prompts starve short ones: short requests overlapping {} prefills have {:.1}x the P50 TTFT of the others",
            lb.as_str(),
            rat
        ));
    }
    if let Some(bl) = blame
        .as_ref()
        .filter(|_| starvation.is_some() || queueing || slow)
    {
        parts.push(bl.sentence());
    }
    // Time the engine did not account for (issue 22): its own verdict, with the requests in
    // flight on the replica (the blame) as evidence.
    if let Some(u) = unacc
        .as_ref()
        .filter(|u| u.candidates >= opts.unaccounted_min_requests.max(1))
    {
        b.find("unaccounted_wait", &u.remedies(&cap));
        parts.push(u.sentence());
    }
    // Engine state at arrival: a queue that forms while the KV cache holds the batch is the
    // cache's (admission waits for cache room, not for a slot).
    let lim = BatchLimit::of(&with, opts);
    if lim.kv90.is_some() || lim.run50.is_some() {
        b.ev("kv_usage_p90", num(lim.kv90));
        b.ev("running_p50", num(lim.run50));
        b.ev("waiting_max", num(lim.wait_max));
        lim.evidence(&mut b);
    }
    let kv_bound = (queueing || slow)
        && starvation.is_none()
        && lim.kv_held
        && lim.wait_max.is_some_and(|w| w >= 1.0);
    if kv_bound {
        b.find("queue_kv_bound", &kv_remedies());
        parts.push(format!(
            "queueing behind a full KV cache (admission waits for cache room): {}",
            lim.kv_phrase(opts)
        ));
        if queueing {
            b.find("queueing", std::slice::from_ref(&limit));
            parts.push(format!(
                "{:.0}% of TTFT is spent waiting in the engine queue",
                queue_share.unwrap_or(0.0) * 100.0
            ));
        }
    } else if queueing {
        let mut rem = vec![limit.clone(), cap.clone()];
        if lim.at_slots {
            rem.insert(0, "the batch is at its slot limit: raise the engine's maximum batch (max_num_seqs / -np) if the KV cache has room, or add replicas".to_owned());
        }
        b.find("queueing", &rem);
        parts.push(format!(
            "queueing: {:.0}% of TTFT is spent waiting in the engine queue",
            queue_share.unwrap_or(0.0) * 100.0
        ));
    }
    if slow {
        let prefill_bound = !queueing && prefill_share.is_some_and(|s| s >= 0.5);
        if kv_bound {
            // Named above; the remedies are the cache's.
        } else if prefill_bound {
            b.find(
                "prefill_bound",
                &[
                    "prefix caching for shared system prompts / conversation history".to_owned(),
                    "shorter prompts (trim history, fewer retrieved chunks)".to_owned(),
                    cap.clone(),
                ],
            );
        } else {
            b.find("slow_ttft", std::slice::from_ref(&limit));
        }
        parts.push(format!(
            "P99 TTFT {:.0} ms > {:.0} ms",
            p99.unwrap_or(0.0),
            opts.ttft_p99_ms
        ));
    }
    b.step.summary = if parts.is_empty() {
        format!(
            "P50 {:.1} ms, P99 {:.1} ms; no queueing or starvation",
            p50.unwrap_or(0.0),
            p99.unwrap_or(0.0)
        )
    } else {
        parts.join("; ")
    };
    b.step
}

/// `engine_timing = exceeds_gateway`: the engine's phases add up to more than the gateway saw.
fn exceeds_gateway(r: &RequestRecord) -> bool {
    r.engine_timing.as_deref() == Some("exceeds_gateway")
}

/// How many requests' engine numbers are their own (`consistent`), their step's (`per_step`)
/// or above the gateway's measure (`exceeds_gateway`).
fn engine_timing_counts(recs: &[&RequestRecord]) -> Value {
    let mut m: BTreeMap<&str, u64> = BTreeMap::new();
    for r in recs {
        if let Some(t) = r.engine_timing.as_deref() {
            *m.entry(t).or_default() += 1;
        }
    }
    json!(m)
}

/// The requests whose TTFT is mostly time the engine did not account for
/// (`ttft_unaccounted_ms`, [`RequestRecord::split_times`]): at least
/// [`DiagnoseOptions::unaccounted_share`] of their TTFT and
/// [`DiagnoseOptions::unaccounted_min_ms`]. Those that arrived while the engine said requests
/// were waiting (`engine_waiting ≥ 1`) queued in the engine, which reports no per-request
/// queue (llama.cpp): they are the queueing finding's, not this one's. The others are the
/// *candidates*; their wait is **step blocking** (the engine busy with a step that started
/// before they arrived — a long prefill) when the gateway's blame covers at least half of it,
/// else the engine's **frontend** (its HTTP / API server, tokenisation, the network).
#[derive(Debug, Clone)]
struct Unaccounted {
    with_split: usize,
    share: Option<f64>,
    dominated: usize,
    engine_waiting: usize,
    candidates: usize,
    sum_ms: f64,
    p50_ms: f64,
    ttft_p50_ms: f64,
    /// Σ min(blocked, unaccounted) / Σ unaccounted over the candidates.
    blame_cover: f64,
    step_blocking: bool,
    /// The blocker group with the most blocked time: caller, business line, its largest
    /// request id and that request's prompt tokens.
    blocker: Option<(String, String, String, u64)>,
}

impl Unaccounted {
    fn of(recs: &[&RequestRecord], opts: &DiagnoseOptions) -> Option<Unaccounted> {
        let split: Vec<(&RequestRecord, f64, f64)> = recs
            .iter()
            .filter_map(|r| Some((*r, r.ttft_unaccounted_ms?, r.ttft_ms?)))
            .filter(|(_, u, t)| u.is_finite() && t.is_finite() && *t > 0.0)
            .collect();
        if split.is_empty() {
            return None;
        }
        let (su, st) = split
            .iter()
            .fold((0.0, 0.0), |(a, b), (_, u, t)| (a + u, b + t));
        type Row<'a> = (&'a RequestRecord, f64, f64);
        let dominated: Vec<Row<'_>> = split
            .iter()
            .copied()
            .filter(|(_, u, t)| *u >= opts.unaccounted_min_ms && *u >= opts.unaccounted_share * t)
            .collect();
        let (queued, cands): (Vec<Row<'_>>, Vec<Row<'_>>) = dominated
            .iter()
            .copied()
            .partition(|(r, _, _)| r.engine_waiting.is_some_and(|w| w >= 1.0));
        let mut us: Vec<f64> = cands.iter().map(|(_, u, _)| *u).collect();
        us.sort_by(f64::total_cmp);
        let mut ts: Vec<f64> = cands.iter().map(|(_, _, t)| *t).collect();
        ts.sort_by(f64::total_cmp);
        let sum: f64 = us.iter().sum();
        let covered: f64 = cands
            .iter()
            .map(|(r, u, _)| r.blocked_ms.unwrap_or(0.0).clamp(0.0, *u))
            .sum();
        let blame_cover = if sum > 0.0 { covered / sum } else { 0.0 };
        // Behind whom: the blocker (caller, line) holding the most of the candidates' wait.
        type Group = (f64, Option<(u64, String)>);
        let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
        for (r, u, _) in &cands {
            let (Some(ms), Some(id)) = (r.blocked_ms, r.blocker_request_id.as_deref()) else {
                continue;
            };
            if ms <= 0.0 {
                continue;
            }
            let key = (
                r.blocker_caller
                    .clone()
                    .unwrap_or_else(|| "(unknown)".to_owned()),
                r.blocker_business_line
                    .clone()
                    .unwrap_or_else(|| "(none)".to_owned()),
            );
            let g = groups.entry(key).or_default();
            g.0 += ms.min(*u);
            let t = r.blocker_prompt_tokens.unwrap_or(0);
            let better = match &g.1 {
                None => true,
                Some((bt, bid)) => t > *bt || (t == *bt && id < bid.as_str()),
            };
            if better {
                g.1 = Some((t, id.to_owned()));
            }
        }
        let blocker = groups
            .into_iter()
            .max_by(|a, b| a.1 .0.total_cmp(&b.1 .0).then_with(|| b.0.cmp(&a.0)))
            .map(|((caller, line), (_, ex))| {
                let (t, id) = ex.unwrap_or_default();
                (caller, line, id, t)
            });
        Some(Unaccounted {
            with_split: split.len(),
            share: ratio(su, st),
            dominated: dominated.len(),
            engine_waiting: queued.len(),
            candidates: cands.len(),
            sum_ms: sum,
            p50_ms: percentile(&us, 0.5).unwrap_or(0.0),
            ttft_p50_ms: percentile(&ts, 0.5).unwrap_or(0.0),
            blame_cover,
            step_blocking: blame_cover >= 0.5,
            blocker,
        })
    }

    fn cause(&self) -> &'static str {
        if self.step_blocking {
            "step_blocking"
        } else {
            "frontend"
        }
    }

    fn json(&self) -> Value {
        let mut v = json!({
            "requests_with_split": self.with_split,
            "share_of_ttft": num(self.share.map(r4)),
            "dominated": self.dominated,
            "dominated_engine_waiting": self.engine_waiting,
            "candidates": self.candidates,
            "candidates_unaccounted_ms_sum": r4(self.sum_ms),
            "candidates_unaccounted_ms_p50": r4(self.p50_ms),
            "candidates_ttft_ms_p50": r4(self.ttft_p50_ms),
            "blame_cover": r4(self.blame_cover),
            "cause": self.cause(),
        });
        if let Some((caller, line, id, tokens)) = &self.blocker {
            v["blocker_caller"] = json!(caller);
            v["blocker_business_line"] = json!(line);
            v["blocker_request_id"] = json!(id);
            v["blocker_prompt_tokens"] = json!(tokens);
        }
        v
    }

    /// "3 requests spent most of their TTFT in time the engine did not account for (1.5 s in
    /// all, P50 495 ms of a P50 TTFT of 573 ms): step blocking — waiting for the engine's
    /// current step to end, behind batch-job's (offline) prompt of 1503 tokens (request r-1)".
    fn sentence(&self) -> String {
        let head = format!(
            "{} requests spent most of their TTFT in time the engine did not account for ({:.1} s in all, P50 {:.0} ms of a P50 TTFT of {:.0} ms)",
            self.candidates,
            self.sum_ms / 1000.0,
            self.p50_ms,
            self.ttft_p50_ms
        );
        if self.step_blocking {
            let behind = match &self.blocker {
                Some((caller, line, id, tokens)) => {
                    format!(", behind {caller}'s ({line}) prompt of {tokens} tokens (request {id})")
                }
                None => String::new(),
            };
            format!(
                "{head}: step blocking — waiting for the engine's current step to end{behind}; the engine's own queue time does not show it"
            )
        } else {
            format!(
                "{head}: the engine's frontend — its HTTP / API server, tokenisation or the network before it (no long prefill was in flight beside them)"
            )
        }
    }

    fn remedies(&self, cap: &str) -> Vec<String> {
        if self.step_blocking {
            vec![
                format!("{cap}: a request that arrives during a long prefill then joins at the next chunk instead of after the whole prompt"),
                "isolate long prompts on their own replica / pool, or give interactive traffic its own priority class".to_owned(),
            ]
        } else {
            vec![
                "the engine's API server is the bottleneck: more API-server processes (vLLM --api-server-count), a fast tokenizer, or fewer concurrent connections per engine".to_owned(),
                "check the network between the gateway and the engine (upstream connect / transfer time)".to_owned(),
            ]
        }
    }
}

/// Who the short requests waited behind, from the records' per-request blame (the gateway's
/// view of each replica): the short requests (`0-128`, `128-512`) that waited behind at least
/// one prefill, grouped by (their business line, the largest blocker's caller and business
/// line); the group with the most blocked time first.
#[derive(Debug, Clone)]
struct BlameEvidence {
    short_line: String,
    blocker_caller: String,
    blocker_line: String,
    /// Short requests in the group.
    requests: usize,
    /// Σ and P50 of their blocked time, ms.
    blocked_ms_sum: f64,
    blocked_ms_p50: f64,
    /// P50 of the largest blocker's prompt tokens.
    blocker_tokens_p50: f64,
    /// The largest blocker seen in the group (most tokens; ties: smallest id).
    example_request_id: String,
    /// Short requests that waited behind someone / that have a blame at all.
    blocked_short: usize,
    measured_short: usize,
}

fn blame_evidence(recs: &[&RequestRecord]) -> Option<BlameEvidence> {
    let short = |r: &&&RequestRecord| {
        matches!(
            r.input_bucket,
            Some(InputBucket::B0To128 | InputBucket::B128To512)
        )
    };
    let measured: Vec<&&RequestRecord> = recs
        .iter()
        .filter(short)
        .filter(|r| r.blocked_by_requests.is_some())
        .collect();
    type Group<'a> = (Vec<f64>, Vec<f64>, Option<(u64, &'a str)>);
    let mut groups: BTreeMap<(String, String, String), Group<'_>> = BTreeMap::new();
    let mut blocked = 0usize;
    for r in &measured {
        let (Some(ms), Some(id)) = (r.blocked_ms, r.blocker_request_id.as_deref()) else {
            continue;
        };
        if ms <= 0.0 {
            continue;
        }
        blocked += 1;
        let key = (
            r.business_line
                .clone()
                .unwrap_or_else(|| "(none)".to_owned()),
            r.blocker_caller
                .clone()
                .unwrap_or_else(|| "(unknown)".to_owned()),
            r.blocker_business_line
                .clone()
                .unwrap_or_else(|| "(none)".to_owned()),
        );
        let g = groups.entry(key).or_default();
        g.0.push(ms);
        let t = r.blocker_prompt_tokens.unwrap_or(0);
        g.1.push(t as f64);
        let better = match g.2 {
            None => true,
            Some((bt, bid)) => t > bt || (t == bt && id < bid),
        };
        if better {
            g.2 = Some((t, id));
        }
    }
    let best = groups.into_iter().max_by(|a, b| {
        let sa: f64 = a.1 .0.iter().sum();
        let sb: f64 = b.1 .0.iter().sum();
        sa.total_cmp(&sb).then_with(|| b.0.cmp(&a.0))
    })?;
    let ((short_line, blocker_caller, blocker_line), (mut ms, mut tokens, ex)) = best;
    ms.sort_by(f64::total_cmp);
    tokens.sort_by(f64::total_cmp);
    Some(BlameEvidence {
        short_line,
        blocker_caller,
        blocker_line,
        requests: ms.len(),
        blocked_ms_sum: ms.iter().sum(),
        blocked_ms_p50: percentile(&ms, 0.5).unwrap_or(0.0),
        blocker_tokens_p50: percentile(&tokens, 0.5).unwrap_or(0.0),
        example_request_id: ex.map(|(_, id)| id.to_owned()).unwrap_or_default(),
        blocked_short: blocked,
        measured_short: measured.len(),
    })
}

impl BlameEvidence {
    fn json(&self) -> Value {
        json!({
            "short_business_line": self.short_line,
            "blocker_caller": self.blocker_caller,
            "blocker_business_line": self.blocker_line,
            "short_requests": self.requests,
            "blocked_ms_sum": r4(self.blocked_ms_sum),
            "blocked_ms_p50": r4(self.blocked_ms_p50),
            "blocker_prompt_tokens_p50": r4(self.blocker_tokens_p50),
            "blocker_request_id": self.example_request_id,
            "short_blocked": self.blocked_short,
            "short_measured": self.measured_short,
        })
    }

    /// "short requests of business line search waited 2.1 s (P50 420 ms) behind batch-job's
    /// (offline) prompts of 8000 tokens (e.g. request r-17)".
    fn sentence(&self) -> String {
        format!(
            "{} short requests of business line {} waited {:.1} s in all (P50 {:.0} ms each) behind {}'s ({}) prompts of {:.0} tokens (largest: request {})",
            self.requests,
            self.short_line,
            self.blocked_ms_sum / 1000.0,
            self.blocked_ms_p50,
            self.blocker_caller,
            self.blocker_line,
            self.blocker_tokens_p50,
            self.example_request_id
        )
    }
}

/// What holds the engine's batch where it is, from the engine state at the requests' arrival.
///
/// A batch is judged against what the engine can run — the configured maximum
/// ([`DiagnoseOptions::max_batch`]) or, without one, the largest batch seen in the window —
/// never against an absolute size alone: a full KV cache on a 64-slot engine holds the batch at
/// 15, far above "small" and far below the slots.
#[derive(Debug, Clone, Copy)]
struct BatchLimit {
    /// The maximum the batch is judged against, and where it comes from.
    limit: Option<f64>,
    configured: bool,
    run50: Option<f64>,
    kv90: Option<f64>,
    wait_max: Option<f64>,
    gpu_util50: Option<f64>,
    bw50: Option<f64>,
    /// The KV cache is what limits: near full, and the batch small or requests waiting while
    /// it is below the configured maximum (a slot is free, cache room is not).
    kv_held: bool,
    /// The slot limit is what limits: the batch at ≥ 90 % of its maximum with requests waiting
    /// and the cache not near full.
    at_slots: bool,
    /// The article's signature of a cache-held batch: GPU busy (P50 ≥ 0.9), memory bandwidth
    /// low (P50 ≤ 0.5).
    busy_low_bandwidth: bool,
}

impl BatchLimit {
    fn of(recs: &[&RequestRecord], opts: &DiagnoseOptions) -> Self {
        let kv = sorted_values(recs.iter().map(|r| r.engine_kv_usage));
        let running = sorted_values(recs.iter().map(|r| r.engine_running));
        let waiting = sorted_values(recs.iter().map(|r| r.engine_waiting));
        let gpu = sorted_values(recs.iter().map(|r| r.gpu_utilization));
        let bw = sorted_values(recs.iter().map(|r| r.gpu_memory_bandwidth));
        let configured = opts.max_batch.filter(|m| m.is_finite() && *m > 0.0);
        let limit = configured.or_else(|| running.last().copied().filter(|m| *m > 0.0));
        let (run50, kv90, wait_max) = (
            percentile(&running, 0.5),
            percentile(&kv, 0.9),
            waiting.last().copied(),
        );
        let (gpu_util50, bw50) = (percentile(&gpu, 0.5), percentile(&bw, 0.5));
        let kv_full = kv90.is_some_and(|k| k >= opts.kv_high);
        let waited = wait_max.is_some_and(|w| w >= 1.0);
        let small = run50.is_some_and(|r| r <= opts.small_batch);
        let below_slots = match (configured, run50) {
            (Some(c), Some(r)) => r < 0.9 * c,
            // No configured maximum: with the cache near full and requests waiting, the cache
            // is what refuses them (the slot limit is not known to be reached).
            (None, Some(_)) => true,
            _ => false,
        };
        let kv_held = kv_full && (small || (waited && below_slots));
        let at_slots = !kv_held
            && waited
            && matches!((limit, run50), (Some(l), Some(r)) if r >= 0.9 * l)
            && !kv_full;
        let busy_low_bandwidth =
            gpu_util50.is_some_and(|g| g >= 0.9) && bw50.is_some_and(|b| b <= 0.5);
        Self {
            limit,
            configured: configured.is_some(),
            run50,
            kv90,
            wait_max,
            gpu_util50,
            bw50,
            kv_held,
            at_slots,
            busy_low_bandwidth,
        }
    }

    fn evidence(&self, b: &mut StepBuilder) {
        b.ev("batch_limit", num(self.limit));
        b.ev(
            "batch_limit_source",
            json!(match (self.limit, self.configured) {
                (None, _) => "unknown",
                (Some(_), true) => "configured",
                (Some(_), false) => "observed",
            }),
        );
        b.ev(
            "batch_fill",
            num(match (self.run50, self.limit) {
                (Some(r), Some(l)) => Some(r4(r / l)),
                _ => None,
            }),
        );
        b.ev(
            "batch_held_by",
            json!(if self.kv_held {
                "kv_cache"
            } else if self.at_slots {
                "slots"
            } else {
                "none"
            }),
        );
        if self.gpu_util50.is_some() {
            b.ev("gpu_utilization_p50", num(self.gpu_util50));
        }
    }

    /// "KV usage P90 0.95 ≥ 0.90, batch P50 15 of 64 (configured) with up to 9 waiting".
    fn kv_phrase(&self, opts: &DiagnoseOptions) -> String {
        let of = match (self.limit, self.configured) {
            (Some(l), true) => format!(" of {l:.0} allowed"),
            (Some(l), false) => format!(" (largest seen {l:.0})"),
            (None, _) => String::new(),
        };
        let mut s = format!(
            "KV-cache usage P90 {:.2} ≥ {:.2} holds the batch at P50 {:.1}{of}",
            self.kv90.unwrap_or(0.0),
            opts.kv_high,
            self.run50.unwrap_or(0.0),
        );
        if let Some(w) = self.wait_max.filter(|w| *w >= 1.0) {
            s.push_str(&format!(" with up to {w:.0} requests waiting"));
        }
        if self.busy_low_bandwidth {
            s.push_str(&format!(
                "; GPU {:.0}% busy at {:.0}% memory bandwidth: the batch is too small to use it",
                self.gpu_util50.unwrap_or(0.0) * 100.0,
                self.bw50.unwrap_or(0.0) * 100.0
            ));
        }
        s
    }
}

/// What frees or enlarges the KV cache.
fn kv_remedies() -> [String; 5] {
    [
        "more KV-cache memory: raise gpu_memory_utilization, shard across more GPUs (tensor parallel), or a GPU with more memory".to_owned(),
        "KV-cache quantization (e.g. fp8 KV cache)".to_owned(),
        "smaller maximum context (max_model_len) or trimmed conversation history".to_owned(),
        "fewer concurrent long contexts: route or rate-limit long-context requests separately".to_owned(),
        "prefix caching so shared prefixes hold KV once".to_owned(),
    ]
}

fn tpot_step(recs: &[&RequestRecord], opts: &DiagnoseOptions) -> Step {
    let mut b = StepBuilder::new("tpot");
    b.th("tpot_p99_ms", opts.tpot_p99_ms);
    b.th("kv_high", opts.kv_high);
    b.th("small_batch", opts.small_batch);
    let tpot = sorted_values(recs.iter().map(|r| r.tpot_ms));
    b.ev("requests_with_tpot", json!(tpot.len()));
    let kv = sorted_values(recs.iter().map(|r| r.engine_kv_usage));
    let running = sorted_values(recs.iter().map(|r| r.engine_running));
    let bw = sorted_values(recs.iter().map(|r| r.gpu_memory_bandwidth));
    let (mut dec, mut tot) = (0.0, 0.0);
    for r in recs {
        if let Some(d) = r.decode_duration_ms {
            dec += d;
            tot += r.total_duration_ms;
        }
    }
    b.ev("decode_share", num(ratio(dec, tot)));
    b.ev("kv_usage_n", json!(kv.len()));
    b.ev("kv_usage_p50", num(percentile(&kv, 0.5)));
    b.ev("kv_usage_p90", num(percentile(&kv, 0.9)));
    let run_mean =
        (!running.is_empty()).then(|| running.iter().sum::<f64>() / running.len() as f64);
    b.ev("running_mean", num(run_mean));
    b.ev("running_p50", num(percentile(&running, 0.5)));
    b.ev("running_max", num(running.last().copied()));
    b.ev("gpu_memory_bandwidth_p50", num(percentile(&bw, 0.5)));
    BatchLimit::of(recs, opts).evidence(&mut b);
    if tpot.is_empty() {
        b.step.verdict = Verdict::Unknown;
        b.step.summary = "no request has a TPOT (none streamed ≥ 2 tokens?)".to_owned();
        return b.step;
    }
    let p50 = percentile(&tpot, 0.5);
    let p99 = percentile(&tpot, 0.99);
    b.ev("tpot_p50_ms", num(p50));
    b.ev("tpot_p99_ms", num(p99));
    let p99v = p99.unwrap_or(0.0);
    if p99v <= opts.tpot_p99_ms {
        b.step.summary = format!(
            "P50 {:.1} ms, P99 {:.1} ms ≤ {:.0} ms",
            p50.unwrap_or(0.0),
            p99v,
            opts.tpot_p99_ms
        );
        return b.step;
    }
    let lim = BatchLimit::of(recs, opts);
    let bw_high = lim.bw50.is_some_and(|x| x >= 0.8);
    if lim.kv_held {
        b.find("decode_kv_bound", &kv_remedies());
        b.step.summary = format!(
            "decode bound by the KV cache: P99 TPOT {:.1} ms > {:.0} ms; {}",
            p99v,
            opts.tpot_p99_ms,
            lim.kv_phrase(opts)
        );
    } else if bw_high {
        b.find(
            "memory_bandwidth_bound",
            &[
                "weight / KV quantization to move fewer bytes per token".to_owned(),
                "speculative decoding".to_owned(),
                "a GPU with more memory bandwidth, or more replicas".to_owned(),
            ],
        );
        b.step.summary = format!(
            "decode bound by GPU memory bandwidth: P99 TPOT {p99v:.1} ms > {:.0} ms",
            opts.tpot_p99_ms
        );
    } else if lim.run50.is_some_and(|r| r > opts.small_batch) {
        b.find(
            "decode_batch_bound",
            &[
                "batches are large: lower the maximum batch (max_num_seqs) for latency, or add replicas".to_owned(),
                "speculative decoding".to_owned(),
            ],
        );
        b.step.summary = format!(
            "decode slowed by large batches: P99 TPOT {p99v:.1} ms > {:.0} ms, P50 running {:.1}",
            opts.tpot_p99_ms,
            lim.run50.unwrap_or(0.0)
        );
    } else {
        b.find(
            "slow_decode",
            &["check engine state (KV usage, batch size) and GPU metrics; enable the engine scrape and GPU telemetry".to_owned()],
        );
        b.step.summary = format!("P99 TPOT {p99v:.1} ms > {:.0} ms", opts.tpot_p99_ms);
    }
    b.step
}

fn caller(r: &RequestRecord) -> &str {
    r.user_id
        .as_deref()
        .or(r.tenant.as_deref())
        .unwrap_or("(unknown)")
}

/// Fewest baseline buckets (the window's first half) for a spike or a drop to be judged.
const MIN_BASELINE_BUCKETS: usize = 10;

fn tokens_step(
    recs: &[&RequestRecord],
    all: &[RequestRecord],
    window: Window,
    opts: &DiagnoseOptions,
) -> Step {
    let mut b = StepBuilder::new("tokens");
    b.th("token_growth_ratio", opts.token_growth_ratio);
    b.th("min_samples", opts.min_samples as f64);
    if recs.is_empty() {
        b.step.verdict = Verdict::Unknown;
        b.step.summary = "no requests".to_owned();
        return b.step;
    }
    let mut by: HashMap<&str, (u64, u64)> = HashMap::new();
    let mut total = 0u64;
    for r in recs {
        let t = total_tokens(r);
        total += t;
        let e = by.entry(caller(r)).or_default();
        e.0 += t;
        e.1 += 1;
    }
    let mut top: Vec<(&str, (u64, u64))> = by.into_iter().collect();
    top.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(b.0)));
    let callers = top.len();
    top.truncate(opts.top_callers);
    b.ev("total_tokens", json!(total));
    b.ev("callers", json!(callers));
    b.ev(
        "top_callers",
        Value::Array(
            top.iter()
                .map(|(c, (t, n))| {
                    json!({"caller": c, "tokens": t, "requests": n,
                           "share": num(ratio(*t as f64, total as f64))})
                })
                .collect(),
        ),
    );
    let mid = window.since_us + (window.until_us - window.since_us) / 2;
    let (mut t1, mut n1, mut t2, mut n2) = (0u64, 0usize, 0u64, 0usize);
    for r in recs {
        if r.created_at < mid {
            t1 += total_tokens(r);
            n1 += 1;
        } else {
            t2 += total_tokens(r);
            n2 += 1;
        }
    }
    let a1 = ratio(t1 as f64, n1 as f64);
    let a2 = ratio(t2 as f64, n2 as f64);
    let growth = match (a1, a2) {
        (Some(x), Some(y)) if x > 0.0 => Some(y / x),
        _ => None,
    };
    b.ev("tokens_per_request_first_half", num(a1));
    b.ev("tokens_per_request_second_half", num(a2));
    b.ev("tokens_per_request_growth", num(growth));
    let enough = n1 >= opts.min_samples && n2 >= opts.min_samples;
    // Anomalies of the window against its own first half (the `tokenscope anomalies`
    // method, default thresholds): spikes per caller, loops, duplicate bursts.
    let found = crate::anomalies::anomalies(
        all,
        window,
        crate::anomalies::Baseline::FirstHalf,
        &crate::anomalies::AnomalyOptions::default(),
    )
    .ok();
    if let Some(a) = &found {
        b.ev(
            "anomaly_spikes",
            Value::Array(
                a.spikes
                    .iter()
                    .take(opts.top_callers)
                    .map(|s| json!({"caller": s.caller, "factor": num(s.factor)}))
                    .collect(),
            ),
        );
        b.ev(
            "anomaly_loops",
            Value::Array(
                a.loops
                    .iter()
                    .take(opts.top_callers)
                    .map(|l| {
                        json!({"caller": l.caller, "prompt_hash": l.prompt_hash,
                                     "requests": l.requests, "period_s": num(Some(l.period_s))})
                    })
                    .collect(),
            ),
        );
        b.ev("anomaly_bursts", json!(a.bursts.len()));
    }
    // Judged: what the anomaly detector found that costs tokens or loses requests. A spike
    // against the caller's own first half (a new caller has no factor: listed only); a loop at
    // ≥ `loop_problem_rate` requests/s (slower fixed-period callers — health checks, crons —
    // are listed only); a duplicate burst holding ≥ 10 % of the window's tokens; a sudden
    // drop, with the requests that failed or were discarded while it lasted.
    let mut parts: Vec<String> = Vec::new();
    let mut listed: Vec<String> = Vec::new();
    if let Some(a) = &found {
        // Spikes and drops compare with the window's first half: judged only when that half
        // holds enough buckets to be a baseline (a window of seconds padded with idle time at
        // either end is not one); else listed.
        let based = a.settings.baseline_buckets >= MIN_BASELINE_BUCKETS;
        let spikes: Vec<_> = a
            .spikes
            .iter()
            .filter(|s| based && s.factor.is_some())
            .collect();
        if !spikes.is_empty() {
            let names: Vec<String> = spikes
                .iter()
                .take(3)
                .map(|s| {
                    format!(
                        "{} {:.1}x its baseline ({}{})",
                        s.caller,
                        s.peak_factor.or(s.factor).unwrap_or(0.0),
                        s.cause,
                        s.business_line
                            .as_deref()
                            .map(|l| format!(", {l}"))
                            .unwrap_or_default()
                    )
                })
                .collect();
            b.find(
                "token_spike",
                &[
                    format!("look at {}: a runaway job, a retry loop or a new feature; `tokenscope anomalies` has the buckets and the top prompt", spikes[0].caller),
                    "per-caller rate limits or budgets (`[budgets]`) so one caller cannot multiply the bill".to_owned(),
                ],
            );
            parts.push(format!("token spike: {}", names.join("; ")));
        }
        listed.extend(
            a.spikes
                .iter()
                .filter(|s| !based || s.factor.is_none())
                .map(|s| match s.factor {
                    Some(f) => format!("{} spike {f:.1}x", s.caller),
                    None => format!("{} new caller", s.caller),
                }),
        );
        let (fast, slow): (Vec<_>, Vec<_>) = a
            .loops
            .iter()
            .partition(|l| l.period_s > 0.0 && 1.0 / l.period_s >= opts.loop_problem_rate);
        if !fast.is_empty() {
            let l = fast[0];
            b.find(
                "caller_loop",
                &[
                    format!("fix {}'s client: it sends one prompt every {:.2} s (a loop or an unbounded retry)", l.caller, l.period_s),
                    "rate-limit or budget the caller; cache the answer if the repeats are intended".to_owned(),
                ],
            );
            parts.push(
                fast.iter()
                    .take(3)
                    .map(|l| {
                        format!(
                            "{} repeats one prompt every {:.2} s ({} requests, {} tokens{})",
                            l.caller,
                            l.period_s,
                            l.requests,
                            l.tokens,
                            l.business_line
                                .as_deref()
                                .map(|x| format!(", {x}"))
                                .unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
            );
        }
        listed.extend(
            slow.iter()
                .map(|l| format!("{} repeats one prompt every {:.1}s", l.caller, l.period_s)),
        );
        let heavy: Vec<_> = a
            .bursts
            .iter()
            .filter(|x| total > 0 && x.tokens as f64 >= 0.1 * total as f64)
            .collect();
        if let Some(x) = heavy.first() {
            b.find(
                "duplicate_burst",
                &[
                    "cache identical requests (an exact-match response cache, or prefix caching for the shared prompt)".to_owned(),
                    format!("de-duplicate at the client: {}", x.callers.join(", ")),
                ],
            );
            parts.push(format!(
                "{} identical prompts within {:.1} s ({} tokens, {:.0}% of the window's; callers {})",
                x.requests,
                x.span_s,
                x.tokens,
                x.tokens as f64 * 100.0 / total as f64,
                x.callers.join(", ")
            ));
        }
        listed.extend(
            a.bursts
                .iter()
                .filter(|x| !(total > 0 && x.tokens as f64 >= 0.1 * total as f64))
                .map(|x| format!("burst of {} identical prompts", x.requests)),
        );
        if !based {
            listed.extend(a.drops.iter().map(|d| format!("{} drop", d.scope)));
        }
        if based && !a.drops.is_empty() {
            let mut drops = Vec::new();
            let mut worst_failed = 0u64;
            for d in &a.drops {
                // The requests that were sent and did not get an answer while it lasted.
                let mut by: BTreeMap<&'static str, u64> = BTreeMap::new();
                let mut sent = 0u64;
                for r in recs.iter().filter(|r| {
                    r.created_at >= d.from_us
                        && r.created_at < d.until_us
                        && (d.scope == "total"
                            || d.scope.strip_prefix("business_line:") == r.business_line.as_deref())
                }) {
                    sent += 1;
                    if r.outcome != Outcome::Ok {
                        *by.entry(r.outcome.as_str()).or_default() += 1;
                    }
                }
                let failed: u64 = by.values().sum();
                worst_failed = worst_failed.max(failed);
                drops.push(json!({
                    "scope": d.scope, "from_us": d.from_us, "until_us": d.until_us,
                    "ratio": num(Some(r4(d.ratio))), "requests": sent,
                    "not_ok": failed, "not_ok_by_outcome": by,
                }));
                parts.push(format!(
                    "requests ({}) fell to {:.0}% of the baseline for {} buckets; {failed} of the {sent} sent then failed or were discarded{}",
                    d.scope,
                    d.ratio * 100.0,
                    d.buckets,
                    if by.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({})",
                            by.iter()
                                .map(|(k, v)| format!("{k} {v}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                ));
            }
            b.ev("anomaly_drops", Value::Array(drops));
            b.find(
                "request_drop",
                &[if worst_failed > 0 {
                    "requests are failing or being discarded during the drop: see the success step's error types and the clients' timeouts / cancellations".to_owned()
                } else {
                    "fewer requests arrive: check the callers of the dropped scope (a client outage, a routing change, a rate limit upstream of the gateway)".to_owned()
                }],
            );
        }
    }
    let noted = if listed.is_empty() {
        String::new()
    } else {
        format!(
            "; also seen: {} (check with `tokenscope anomalies`)",
            listed.into_iter().take(3).collect::<Vec<_>>().join("; ")
        )
    };
    if enough && growth.is_some_and(|g| g >= opts.token_growth_ratio) {
        b.find(
            "token_growth",
            &[
                "find the caller behind the growth: `tokenscope anomalies` (spikes, loops) and `tokenscope waste` (bloated prompts, duplicates)".to_owned(),
                "set max_tokens and per-caller budgets".to_owned(),
            ],
        );
        parts.insert(
            0,
            format!(
                "tokens per request grew {:.1}x between the window's halves",
                growth.unwrap_or(0.0)
            ),
        );
    }
    b.step.summary = if parts.is_empty() {
        let lead = top
            .first()
            .map(|(c, (t, _))| format!("{c} {:.0}%", *t as f64 * 100.0 / (total.max(1)) as f64))
            .unwrap_or_default();
        format!("{total} tokens from {callers} caller(s) (top: {lead}); no abnormal growth, spike, loop or drop{noted}")
    } else {
        format!("{}{noted}", parts.join("; "))
    };
    b.step
}

fn network_step(recs: &[&RequestRecord], opts: &DiagnoseOptions) -> Step {
    let mut b = StepBuilder::new("network");
    b.th("gateway_overhead_p99_ms", opts.gateway_overhead_p99_ms);
    b.th("network_p99_ms", opts.network_p99_ms);
    let gw = sorted_values(recs.iter().map(|r| r.gateway_overhead_ms));
    let connect = sorted_values(recs.iter().map(|r| {
        let h = r.upstream_headers_ms?;
        if r.stream {
            Some(h)
        } else if r.queue_source == tokenscope_core::PhaseSource::Derived {
            // The queue was derived from this very time (the gateway's rule for a response
            // not streamed): nothing is left to tell the network apart.
            None
        } else {
            let engine = r.queue_duration_ms? + r.prefill_duration_ms? + r.decode_duration_ms?;
            Some((h - engine).max(0.0))
        }
    }));
    let gw99 = percentile(&gw, 0.99);
    let c99 = percentile(&connect, 0.99);
    b.ev("gateway_overhead_n", json!(gw.len()));
    b.ev("gateway_overhead_p50_ms", num(percentile(&gw, 0.5)));
    b.ev("gateway_overhead_p99_ms", num(gw99));
    b.ev("upstream_connect_n", json!(connect.len()));
    b.ev("upstream_connect_p50_ms", num(percentile(&connect, 0.5)));
    b.ev("upstream_connect_p99_ms", num(c99));
    if gw.is_empty() && connect.is_empty() {
        b.step.verdict = Verdict::Unknown;
        b.step.summary = "no gateway overhead or upstream header timing recorded".to_owned();
        return b.step;
    }
    let mut parts = Vec::new();
    if gw99.is_some_and(|x| x > opts.gateway_overhead_p99_ms) {
        b.find(
            "gateway_overhead",
            &["gateway overhead is high: check the gateway host's CPU, entry tokenizer configuration and body sizes".to_owned()],
        );
        parts.push(format!(
            "gateway overhead P99 {:.1} ms > {:.0} ms",
            gw99.unwrap_or(0.0),
            opts.gateway_overhead_p99_ms
        ));
    }
    if c99.is_some_and(|x| x > opts.network_p99_ms) {
        b.find(
            "upstream_network",
            &["upstream connect/transfer is slow: keep-alive connection pools, co-locate the gateway with the engines, check DNS/TLS".to_owned()],
        );
        parts.push(format!(
            "upstream connect/transfer P99 {:.1} ms > {:.0} ms",
            c99.unwrap_or(0.0),
            opts.network_p99_ms
        ));
    }
    b.step.summary = if parts.is_empty() {
        format!(
            "gateway overhead P99 {:.2} ms, upstream connect P99 {:.2} ms",
            gw99.unwrap_or(0.0),
            c99.unwrap_or(0.0)
        )
    } else {
        parts.join("; ")
    };
    b.step
}

/// The key evidence of a step for the table (all of it is in the JSON).
fn evidence_line(s: &Step) -> String {
    let keys: &[&str] = match s.step.as_str() {
        "success" => &["requests", "success_rate"],
        "ttft" => &[
            "ttft_p50_ms",
            "ttft_p99_ms",
            "queue_share",
            "prefill_share",
            "concurrency_peak",
            "long_bucket",
            "starvation_ratio",
        ],
        "tpot" => &[
            "tpot_p50_ms",
            "tpot_p99_ms",
            "kv_usage_p90",
            "running_p50",
            "gpu_memory_bandwidth_p50",
        ],
        "tokens" => &["total_tokens", "callers", "tokens_per_request_growth"],
        _ => &["gateway_overhead_p99_ms", "upstream_connect_p99_ms"],
    };
    keys.iter()
        .filter_map(|k| {
            let v = s.evidence.get(*k)?;
            let text = match v {
                Value::Null => return None,
                Value::Number(n) => match n.as_f64() {
                    Some(f) if f.fract() != 0.0 => format!("{f:.2}"),
                    _ => n.to_string(),
                },
                Value::String(t) => t.clone(),
                other => other.to_string(),
            };
            Some(format!("{k}={text}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl DiagnoseReport {
    /// Whether some step's verdict is `problem` (the conclusion names a step). Steps whose
    /// data is missing (`unknown`) are not problems.
    pub fn has_problem(&self) -> bool {
        self.steps.iter().any(|s| s.verdict == Verdict::Problem)
    }
}

impl Report for DiagnoseReport {
    fn render_table(&self) -> String {
        let mut t = table(&["step", "verdict", "finding", "evidence"]);
        for s in &self.steps {
            t.add_row(vec![
                s.step.clone(),
                s.verdict.as_str().to_owned(),
                s.summary.clone(),
                evidence_line(s),
            ]);
        }
        let mut out = format!("{t}\n");
        match &self.conclusion.step {
            Some(step) => {
                out.push_str(&format!(
                    "Conclusion: problem at step {step} ({}): {}\n",
                    self.conclusion.findings.join(", "),
                    self.conclusion.summary
                ));
                if !self.conclusion.remedies.is_empty() {
                    out.push_str("Remedies:\n");
                    for r in &self.conclusion.remedies {
                        out.push_str(&format!("  - {r}\n"));
                    }
                }
                if !self.conclusion.also.is_empty() {
                    out.push_str(&format!(
                        "Also problems at: {}\n",
                        self.conclusion.also.join(", ")
                    ));
                }
            }
            None => out.push_str(&format!("Conclusion: {}\n", self.conclusion.summary)),
        }
        out
    }

    /// One row per step: step, verdict, finding, evidence (`key=value` pairs).
    fn csv_rows(&self) -> CsvRows {
        let mut out = CsvRows::new(&["step", "verdict", "finding", "evidence"]);
        for s in &self.steps {
            out.push(vec![
                s.step.clone(),
                s.verdict.as_str().to_owned(),
                s.summary.clone(),
                evidence_line(s),
            ]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_core::RequestRecord;

    const W: Window = Window {
        since_us: 0,
        until_us: 100_000_000,
    };

    fn rec(i: usize, at_ms: i64, input: u64, ttft: f64) -> RequestRecord {
        RequestRecord {
            request_id: format!("r{i:05}"),
            created_at: at_ms * 1000,
            input_tokens: Some(input),
            output_tokens: Some(20),
            input_bucket: Some(InputBucket::of(input)),
            ttft_ms: Some(ttft),
            tpot_ms: Some(10.0),
            total_duration_ms: ttft + 200.0,
            queue_duration_ms: Some(0.0),
            prefill_duration_ms: Some(ttft),
            decode_duration_ms: Some(190.0),
            stream: true,
            upstream_headers_ms: Some(1.0),
            gateway_overhead_ms: Some(0.2),
            ..RequestRecord::default()
        }
    }

    fn step<'a>(r: &'a DiagnoseReport, name: &str) -> &'a Step {
        r.steps
            .iter()
            .find(|s| s.step == name)
            .expect("step present")
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), Some(2.0));
        assert_eq!(percentile(&v, 0.99), Some(4.0));
        assert_eq!(percentile(&v, 0.25), Some(1.0));
        assert_eq!(percentile(&[], 0.5), None);
        let h: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&h, 0.99), Some(99.0));
        assert_eq!(percentile(&h, 0.9), Some(90.0));
    }

    #[test]
    fn healthy_run_concludes_healthy() {
        let recs: Vec<_> = (0..50).map(|i| rec(i, i as i64 * 1000, 50, 20.0)).collect();
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(r.conclusion.verdict, "healthy");
        assert!(r.steps.iter().all(|s| s.verdict == Verdict::Ok), "{r:#?}");
        assert_eq!(r.requests, 50);
    }

    #[test]
    fn empty_window_is_unknown_not_a_problem() {
        let r = diagnose(&[], W, &DiagnoseOptions::default());
        assert_eq!(r.conclusion.verdict, "healthy");
        assert_eq!(step(&r, "success").verdict, Verdict::Unknown);
        assert_eq!(step(&r, "ttft").verdict, Verdict::Unknown);
    }

    #[test]
    fn low_success_rate_lists_error_types() {
        let mut recs: Vec<_> = (0..100).map(|i| rec(i, i as i64 * 100, 50, 20.0)).collect();
        for r in recs.iter_mut().take(3) {
            r.outcome = Outcome::Timeout;
            r.error_type = Some("upstream_timeout".into());
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "success");
        assert_eq!(s.verdict, Verdict::Problem);
        assert_eq!(s.evidence["success_rate"], json!(0.97));
        assert_eq!(
            s.evidence["top_error_types"][0],
            json!({"error_type": "upstream_timeout", "count": 3})
        );
        assert_eq!(r.conclusion.step.as_deref(), Some("success"));
    }

    #[test]
    fn starvation_names_the_long_bucket() {
        let mut recs = Vec::new();
        // Long prompts every 10 s, each prefilling 2 s.
        for k in 0..10 {
            recs.push(rec(recs.len(), k * 10_000, 6000, 2000.0));
        }
        // Short requests: those inside a long prefill are slow.
        for k in 0..10 {
            for j in 0..4 {
                let at = k * 10_000 + 100 + j * 400;
                recs.push(rec(recs.len(), at, 50, 900.0));
                recs.push(rec(recs.len(), at + 5_000, 50, 30.0));
            }
        }
        recs.sort_by_key(|r| r.created_at);
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(s.verdict, Verdict::Problem);
        assert!(s.findings.contains(&"starvation".to_owned()), "{s:#?}");
        assert_eq!(s.evidence["long_bucket"], json!("2048+"));
        assert_eq!(s.evidence["short_beside_long_n"], json!(40));
        assert_eq!(s.evidence["short_alone_n"], json!(40));
        assert_eq!(s.evidence["starvation_ratio"], json!(30.0));
        assert!(s.remedies.iter().any(|m| m.contains("isolation")));
        assert!(s.remedies.iter().any(|m| m.contains("cap prefill")));
        assert_eq!(r.conclusion.step.as_deref(), Some("ttft"));
        assert!(r.conclusion.summary.contains("2048+"));
    }

    #[test]
    fn non_streamed_requests_are_judged_on_the_engines_time_to_first_token() {
        // Issue 21, item 5: the starvation scenario above, nothing streamed (no gateway TTFT),
        // the engine's queue and prefill on every record: the same verdict, from the engine.
        let mut recs = Vec::new();
        for k in 0..10 {
            recs.push(rec(recs.len(), k * 10_000, 3000, 2000.0));
            for j in 0..4 {
                let at = k * 10_000 + 100 + j * 400;
                recs.push(rec(recs.len(), at, 50, 900.0));
                recs.push(rec(recs.len(), at + 5_000, 50, 30.0));
            }
        }
        for r in &mut recs {
            r.ttft_ms = None;
            r.tpot_ms = None;
            r.stream = false;
        }
        recs.sort_by_key(|r| r.created_at);
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_ne!(s.verdict, Verdict::Unknown, "{s:#?}");
        assert_eq!(
            s.evidence["ttft_source"],
            json!("engine_queue_plus_prefill")
        );
        assert_eq!(s.evidence["requests_with_ttft"], json!(90));
        assert!(s.findings.contains(&"starvation".to_owned()), "{s:#?}");
        // Mixed: the long prompts streamed (gateway TTFT), the short ones not: every request
        // is judged, each on its own source.
        let mut mixed = recs.clone();
        for r in mixed.iter_mut().filter(|r| r.input_tokens == Some(3000)) {
            r.ttft_ms = Some(2000.0);
            r.stream = true;
        }
        let r = diagnose(&mixed, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(
            s.evidence["ttft_source"],
            json!("gateway_and_engine_queue_plus_prefill")
        );
        assert_eq!(s.evidence["requests_with_ttft"], json!(90));
        assert_eq!(s.evidence["requests_with_engine_ttft"], json!(80));
        assert!(s.findings.contains(&"starvation".to_owned()), "{s:#?}");
        // Without the engine's phases there is still nothing to judge.
        for r in &mut recs {
            r.prefill_duration_ms = None;
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(step(&r, "ttft").verdict, Verdict::Unknown);
    }

    #[test]
    fn starvation_needs_samples_and_falls_back_to_512_2048() {
        let mut recs = Vec::new();
        for k in 0..4 {
            recs.push(rec(recs.len(), k * 10_000, 1500, 2000.0));
            recs.push(rec(recs.len(), k * 10_000 + 100, 50, 900.0));
            recs.push(rec(recs.len(), k * 10_000 + 5_000, 50, 30.0));
        }
        recs.sort_by_key(|r| r.created_at);
        // 4 samples per side: below the default 10, no verdict on starvation.
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(s.evidence["long_bucket"], json!("512-2048"));
        assert_eq!(s.evidence["short_beside_long_n"], json!(4));
        assert!(s.findings.is_empty(), "{s:#?}");
        let opts = DiagnoseOptions {
            min_samples: 3,
            ..DiagnoseOptions::default()
        };
        let r = diagnose(&recs, W, &opts);
        assert_eq!(step(&r, "ttft").findings, vec!["starvation".to_owned()]);
        assert!(r.conclusion.remedies[0].contains("512-2048"));
        // Records outside the window are ignored.
        let narrow = Window {
            since_us: 0,
            until_us: 1,
        };
        assert_eq!(diagnose(&recs, narrow, &opts).requests, 1);
    }

    #[test]
    fn a_queue_of_a_few_ms_is_not_queueing_whatever_its_share() {
        // Half of a 4 ms TTFT spent in the queue (a scheduler wake-up on a busy host).
        let mut recs: Vec<_> = (0..20).map(|i| rec(i, i as i64 * 1000, 50, 4.0)).collect();
        for r in &mut recs {
            r.queue_duration_ms = Some(2.0);
            r.prefill_duration_ms = Some(2.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(s.evidence["queue_share"], json!(0.5));
        assert_eq!(s.evidence["queue_mean_ms"], json!(2.0));
        assert!(s.findings.is_empty(), "{s:?}");
        assert_eq!(s.verdict, Verdict::Ok);
        // The same share with the floor lowered is queueing.
        let opts = DiagnoseOptions {
            queue_min_ms: 1.0,
            ..DiagnoseOptions::default()
        };
        let r = diagnose(&recs, W, &opts);
        assert_eq!(step(&r, "ttft").findings, vec!["queueing".to_owned()]);
    }

    #[test]
    fn queueing_from_queue_share() {
        let mut recs: Vec<_> = (0..20)
            .map(|i| rec(i, i as i64 * 1000, 50, 100.0))
            .collect();
        for r in &mut recs {
            r.queue_duration_ms = Some(70.0);
            r.prefill_duration_ms = Some(30.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(s.findings, vec!["queueing".to_owned()]);
        assert_eq!(s.evidence["queue_share"], json!(0.7));
    }

    #[test]
    fn token_step_lists_anomaly_candidates() {
        // One caller repeating one prompt every 5 s over the window: listed (caller, period) in
        // the tokens step's evidence and summary, not judged there.
        let recs: Vec<_> = (0..20)
            .map(|i| {
                let mut r = rec(i, i as i64 * 5000, 100, 20.0);
                r.user_id = Some("cron".into());
                r.prompt_hash = Some("h1".into());
                r
            })
            .collect();
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "tokens");
        assert_eq!(s.evidence["anomaly_loops"][0]["caller"], json!("cron"));
        assert_eq!(s.evidence["anomaly_loops"][0]["period_s"], json!(5.0));
        assert!(
            s.summary.contains("cron repeats one prompt every 5.0s"),
            "{}",
            s.summary
        );
        assert_eq!(s.verdict, Verdict::Ok);
    }

    #[test]
    fn a_fast_loop_a_spike_a_burst_and_a_drop_are_judged() {
        // Issue 21, case 2: one caller repeating one prompt at 8/s with flat tokens per
        // request, beside varied traffic: the tokens step is a problem naming the caller.
        let mut recs: Vec<_> = (0..800)
            .map(|i| {
                let mut r = rec(i, i as i64 * 125, 100, 20.0);
                r.user_id = Some("looper".into());
                r.business_line = Some("search".into());
                r.prompt_hash = Some("same".into());
                r
            })
            .collect();
        recs.extend((0..100).map(|i| {
            let mut r = rec(1000 + i, i as i64 * 1000 + 7, 100, 20.0);
            r.user_id = Some(format!("user{}", i % 6));
            r.prompt_hash = Some(format!("p{i}"));
            r
        }));
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "tokens");
        assert_eq!(s.verdict, Verdict::Problem, "{}", s.summary);
        assert_eq!(s.findings, vec!["caller_loop".to_owned()], "{}", s.summary);
        assert!(
            s.summary
                .contains("looper repeats one prompt every 0.12 s (800 requests"),
            "{}",
            s.summary
        );
        assert!(s.summary.contains("search"));
        assert!(s.remedies[0].contains("fix looper's client"));
        assert_eq!(r.conclusion.step.as_deref(), Some("tokens"));
        assert_ne!(r.conclusion.verdict, "healthy");
        // The same caller every 5 s is a cron: listed, not judged (see the test above).

        // A spike: one caller's tokens ×10 in the second half, requests as before.
        let spike: Vec<_> = (0..200)
            .map(|i| {
                let at = i as i64 * 500;
                let input = if at >= 50_000 { 1000 } else { 100 };
                let mut r = rec(i, at, input, 20.0);
                r.user_id = Some("batch-job".into());
                r.prompt_hash = Some(format!("p{i}"));
                r
            })
            .collect();
        let r = diagnose(&spike, W, &DiagnoseOptions::default());
        let s = step(&r, "tokens");
        assert!(
            s.findings.contains(&"token_spike".to_owned()),
            "{}",
            s.summary
        );
        assert!(s.summary.contains("batch-job"), "{}", s.summary);
        assert!(s.summary.contains("larger requests"), "{}", s.summary);

        // A burst: 30 identical prompts in 3 s, irregular, half the window's tokens.
        let mut burst: Vec<_> = (0..30)
            .map(|i| {
                let mut r = rec(i, 20_000 + (i as i64 * i as i64 * 3) % 3000, 100, 20.0);
                r.user_id = Some(format!("u{}", i % 3));
                r.prompt_hash = Some("dup".into());
                r
            })
            .collect();
        burst.extend((0..50).map(|i| {
            let mut r = rec(100 + i, i as i64 * 2000, 100, 20.0);
            r.prompt_hash = Some(format!("q{i}"));
            r
        }));
        let r = diagnose(&burst, W, &DiagnoseOptions::default());
        let s = step(&r, "tokens");
        assert!(
            s.findings.contains(&"duplicate_burst".to_owned()),
            "{}",
            s.summary
        );
        assert!(s.summary.contains("30 identical prompts"), "{}", s.summary);

        // A drop: 10 requests/s, then for the last 40 s 2/s, and most of those fail.
        let mut drop: Vec<RequestRecord> = Vec::new();
        for i in 0..600usize {
            let at = i as i64 * 100;
            let mut r = rec(i, at, 100, 20.0);
            r.prompt_hash = Some(format!("d{i}"));
            drop.push(r);
        }
        for i in 0..80usize {
            let at = 60_000 + i as i64 * 500;
            let mut r = rec(1000 + i, at, 100, 20.0);
            r.prompt_hash = Some(format!("e{i}"));
            if i % 4 != 0 {
                r.outcome = Outcome::Cancelled;
            }
            drop.push(r);
        }
        let r = diagnose(&drop, W, &DiagnoseOptions::default());
        let s = step(&r, "tokens");
        assert!(
            s.findings.contains(&"request_drop".to_owned()),
            "{}",
            s.summary
        );
        let d = &s.evidence["anomaly_drops"][0];
        assert_eq!(d["scope"], json!("total"));
        assert!(d["not_ok"].as_u64().expect("n") >= 20, "{d}");
        assert!(
            d["not_ok_by_outcome"]["cancelled"].as_u64().is_some(),
            "{d}"
        );
        assert!(
            s.summary.contains("failed or were discarded (cancelled"),
            "{}",
            s.summary
        );
        assert!(s.remedies[0].contains("failing or being discarded"));
    }

    #[test]
    fn the_ttft_step_says_behind_whom_short_requests_waited() {
        // Short search requests queued behind batch-job's long prompts (the gateway's blame).
        let mut recs: Vec<_> = (0..40)
            .map(|i| {
                let mut r = rec(i, i as i64 * 1000, 40, 3000.0);
                r.queue_duration_ms = Some(2800.0);
                r.business_line = Some("search".into());
                r.blocked_by_requests = Some(1);
                r.blocked_ms = Some(2000.0 + i as f64);
                r.blocker_request_id = Some(format!("long{}", i / 10));
                r.blocker_caller = Some("batch-job".into());
                r.blocker_business_line = Some("offline".into());
                r.blocker_prompt_tokens = Some(8000 + (i / 10) as u64);
                r.blocked_by_prompt_tokens = Some(8000);
                r
            })
            .collect();
        // Some waited behind nobody, others behind a smaller caller.
        for r in recs.iter_mut().take(5) {
            r.blocked_ms = Some(0.0);
            r.blocker_request_id = None;
        }
        for r in recs.iter_mut().skip(35) {
            r.blocker_caller = Some("chat".into());
            r.blocker_prompt_tokens = Some(300);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        let b = &s.evidence["blame"];
        assert_eq!(b["short_business_line"], json!("search"));
        assert_eq!(b["blocker_caller"], json!("batch-job"));
        assert_eq!(b["blocker_business_line"], json!("offline"));
        assert_eq!(b["short_requests"], json!(30));
        assert_eq!(b["short_blocked"], json!(35));
        assert_eq!(b["short_measured"], json!(40));
        assert_eq!(b["blocker_request_id"], json!("long3"));
        assert!(
            s.summary
                .contains("short requests of business line search waited")
                && s.summary
                    .contains("behind batch-job's (offline) prompts of 8001 tokens"),
            "{}",
            s.summary
        );
    }

    /// Issue 22's case as records: short streamed requests whose TTFT is mostly time the engine
    /// did not account for, beside a long non-streamed prompt.
    fn unaccounted_case(blamed: bool) -> Vec<RequestRecord> {
        let mut recs = Vec::new();
        for i in 0..4usize {
            let mut long = rec(100 + i, i as i64 * 3000, 1503, 0.0);
            long.ttft_ms = None;
            long.stream = false;
            long.user_id = Some("batch-job".into());
            long.queue_duration_ms = Some(0.04);
            long.prefill_duration_ms = Some(901.0);
            long.total_duration_ms = 1000.0;
            recs.push(long);
            let mut short = rec(i, i as i64 * 3000 + 400, 3, 573.0);
            short.queue_duration_ms = Some(0.014);
            short.queue_source = tokenscope_core::PhaseSource::Engine;
            short.prefill_duration_ms = Some(82.0);
            short.prefill_source = tokenscope_core::PhaseSource::Engine;
            short.decode_source = tokenscope_core::PhaseSource::Engine;
            short.gateway_overhead_ms = Some(0.3);
            if blamed {
                short.blocked_by_requests = Some(1);
                short.blocked_ms = Some(480.0);
                short.blocker_request_id = Some(format!("r{:05}", 100 + i));
                short.blocker_caller = Some("batch-job".into());
                short.blocker_business_line = Some("offline".into());
                short.blocker_prompt_tokens = Some(1503);
            } else {
                short.blocked_by_requests = Some(0);
                short.blocked_ms = Some(0.0);
            }
            short.split_times();
            recs.push(short);
        }
        recs
    }

    #[test]
    fn a_ttft_the_engine_did_not_account_for_is_its_own_verdict() {
        // Behind a long prefill: step blocking, naming the long request's caller.
        let recs = unaccounted_case(true);
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert!(s.findings.contains(&"unaccounted_wait".to_owned()), "{s:?}");
        let u = &s.evidence["unaccounted"];
        assert_eq!(u["cause"], json!("step_blocking"));
        assert_eq!(u["candidates"], json!(4));
        assert_eq!(u["blocker_caller"], json!("batch-job"));
        assert_eq!(u["blocker_request_id"], json!("r00100"));
        let want = 573.0 - 0.3 - 0.014 - 82.0;
        assert!((u["candidates_unaccounted_ms_p50"].as_f64().unwrap_or(0.0) - want).abs() < 1e-3);
        assert!(
            s.summary.contains("step blocking")
                && s.summary
                    .contains("behind batch-job's (offline) prompt of 1503 tokens"),
            "{}",
            s.summary
        );
        assert_eq!(r.conclusion.step.as_deref(), Some("ttft"));
        assert!(s.remedies.iter().any(|m| m.contains("chunked prefill")));
        // Nobody in flight beside them: the engine's frontend.
        let r = diagnose(&unaccounted_case(false), W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert!(s.findings.contains(&"unaccounted_wait".to_owned()));
        assert_eq!(s.evidence["unaccounted"]["cause"], json!("frontend"));
        assert!(s.summary.contains("the engine's frontend"), "{}", s.summary);
        // The engine said requests were waiting: its own (unreported) queue, not this finding.
        let mut recs = unaccounted_case(false);
        for r in &mut recs {
            r.engine_waiting = Some(3.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert!(
            !s.findings.contains(&"unaccounted_wait".to_owned()),
            "{s:?}"
        );
        assert_eq!(
            s.evidence["unaccounted"]["dominated_engine_waiting"],
            json!(4)
        );
        // Small unaccounted times (an idle engine's tokenisation and HTTP) are no verdict.
        let mut recs: Vec<_> = (0..30).map(|i| rec(i, i as i64 * 500, 20, 30.0)).collect();
        for r in &mut recs {
            r.prefill_duration_ms = Some(18.0);
            r.prefill_source = tokenscope_core::PhaseSource::Engine;
            r.split_times();
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(r.conclusion.verdict, "healthy", "{:?}", r.conclusion);
    }

    #[test]
    fn engine_numbers_above_the_gateways_are_out_of_the_shares() {
        let mut recs: Vec<_> = (0..20).map(|i| rec(i, i as i64 * 500, 20, 100.0)).collect();
        for r in recs.iter_mut().take(10) {
            r.queue_duration_ms = Some(5000.0);
            r.engine_timing = Some("exceeds_gateway".into());
        }
        for r in recs.iter_mut().skip(10).take(4) {
            r.engine_timing = Some("per_step".into());
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(s.evidence["queue_share"], json!(0.0), "{s:?}");
        assert_eq!(
            s.evidence["engine_timing"],
            json!({"exceeds_gateway": 10, "per_step": 4})
        );
    }

    #[test]
    fn kv_full_small_batch_is_decode_kv_bound() {
        let mut recs: Vec<_> = (0..20)
            .map(|i| rec(i, i as i64 * 1000, 3000, 20.0))
            .collect();
        for (i, r) in recs.iter_mut().enumerate() {
            r.tpot_ms = Some(80.0 + i as f64);
            r.engine_kv_usage = Some(if i < 2 { 0.5 } else { 0.95 });
            r.engine_running = Some(2.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "tpot");
        assert_eq!(s.findings, vec!["decode_kv_bound".to_owned()]);
        assert_eq!(s.evidence["kv_usage_p90"], json!(0.95));
        assert_eq!(s.evidence["running_p50"], json!(2.0));
        assert_eq!(s.evidence["tpot_p99_ms"], json!(99.0));
        assert!(s
            .remedies
            .iter()
            .any(|m| m.contains("KV-cache quantization")));
        assert_eq!(r.conclusion.step.as_deref(), Some("tpot"));
        // Queueing caused by the full cache still concludes on the KV cache.
        let mut q = recs.clone();
        for r in &mut q {
            r.queue_duration_ms = Some(15.0);
            r.prefill_duration_ms = Some(5.0);
        }
        let r = diagnose(&q, W, &DiagnoseOptions::default());
        assert_eq!(step(&r, "ttft").findings, vec!["queueing".to_owned()]);
        assert_eq!(r.conclusion.step.as_deref(), Some("tpot"));
        assert_eq!(r.conclusion.findings, vec!["decode_kv_bound".to_owned()]);
        assert_eq!(r.conclusion.also, vec!["ttft".to_owned()]);
    }

    #[test]
    fn a_queue_behind_a_full_kv_cache_names_the_cache() {
        // What a real vLLM shows with too small a cache: requests wait while the batch stays
        // small and the cache near full; TPOT within its threshold.
        let mut recs: Vec<_> = (0..20).map(|i| rec(i, i as i64 * 1000, 64, 20.0)).collect();
        for (i, r) in recs.iter_mut().enumerate() {
            r.queue_duration_ms = Some(15.0);
            r.prefill_duration_ms = Some(5.0);
            r.engine_kv_usage = Some(if i < 3 { 0.3 } else { 0.92 });
            r.engine_running = Some(3.0);
            r.engine_waiting = Some(if i < 3 { 0.0 } else { 4.0 });
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let s = step(&r, "ttft");
        assert_eq!(
            s.findings,
            vec!["queue_kv_bound".to_owned(), "queueing".to_owned()]
        );
        assert_eq!(s.evidence["kv_usage_p90"], json!(0.92));
        assert_eq!(s.evidence["running_p50"], json!(3.0));
        assert_eq!(s.evidence["waiting_max"], json!(4.0));
        assert_eq!(s.remedies[0], kv_remedies()[0]);
        assert!(!s.remedies.iter().any(|m| m.contains("chunked prefill")));
        assert_eq!(step(&r, "tpot").verdict, Verdict::Ok);
        assert_eq!(r.conclusion.step.as_deref(), Some("ttft"));
        assert!(
            r.conclusion
                .summary
                .contains("queueing behind a full KV cache (admission waits for cache room)")
                && r.conclusion.summary.contains("up to 4 requests waiting"),
            "{}",
            r.conclusion.summary
        );
        // Nobody waiting: a busy cache is not the queue's cause.
        for r in &mut recs {
            r.engine_waiting = Some(0.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(step(&r, "ttft").findings, vec!["queueing".to_owned()]);
        // A batch at the engine's configured maximum: the slots are full too, so the cache is
        // not known to be what holds it.
        for r in &mut recs {
            r.engine_waiting = Some(4.0);
            r.engine_running = Some(32.0);
        }
        let opts = DiagnoseOptions {
            max_batch: Some(32.0),
            ..DiagnoseOptions::default()
        };
        let r = diagnose(&recs, W, &opts);
        assert_eq!(step(&r, "ttft").findings, vec!["queueing".to_owned()]);
        // The same batch of 32 on an engine allowed 64: a slot is free, cache room is not.
        let opts = DiagnoseOptions {
            max_batch: Some(64.0),
            ..DiagnoseOptions::default()
        };
        let r = diagnose(&recs, W, &opts);
        let s = step(&r, "ttft");
        assert_eq!(s.findings[0], "queue_kv_bound");
        assert_eq!(s.evidence["batch_held_by"], json!("kv_cache"));
        assert_eq!(s.evidence["batch_fill"], json!(0.5));
    }

    #[test]
    fn a_batch_held_by_the_cache_far_above_small_is_kv_bound() {
        // Issue 21, case 3: 64 slots, the cache full at ~15 running, requests waiting, TPOT
        // high. Absolute "small" (≤ 4) would call it decode_batch_bound → "lower max_num_seqs".
        let mut recs: Vec<_> = (0..40)
            .map(|i| rec(i, i as i64 * 1000, 3000, 900.0))
            .collect();
        for (i, r) in recs.iter_mut().enumerate() {
            r.tpot_ms = Some(90.0);
            r.queue_duration_ms = Some(600.0);
            r.prefill_duration_ms = Some(300.0);
            r.engine_kv_usage = Some(0.96);
            r.engine_running = Some(14.0 + (i % 3) as f64);
            r.engine_waiting = Some(9.0);
            r.gpu_utilization = Some(0.95);
            r.gpu_memory_bandwidth = Some(0.4);
        }
        for max_batch in [None, Some(64.0)] {
            let opts = DiagnoseOptions {
                max_batch,
                ..DiagnoseOptions::default()
            };
            let r = diagnose(&recs, W, &opts);
            let t = step(&r, "tpot");
            assert_eq!(t.findings, vec!["decode_kv_bound".to_owned()]);
            assert_eq!(t.evidence["batch_held_by"], json!("kv_cache"));
            assert!(
                t.summary.contains("GPU 95% busy at 40% memory bandwidth"),
                "{}",
                t.summary
            );
            assert_eq!(r.conclusion.step.as_deref(), Some("tpot"));
            for s in &r.steps {
                assert!(!s
                    .remedies
                    .iter()
                    .any(|m| m.contains("max_num_seqs) for latency")));
                assert!(!s.findings.iter().any(|f| f == "decode_batch_bound"));
            }
            let q = step(&r, "ttft");
            assert_eq!(q.findings[0], "queue_kv_bound");
        }
        let r = diagnose(
            &recs,
            W,
            &DiagnoseOptions {
                max_batch: Some(64.0),
                ..DiagnoseOptions::default()
            },
        );
        assert_eq!(
            step(&r, "tpot").evidence["batch_limit_source"],
            json!("configured")
        );
        assert_eq!(step(&r, "tpot").evidence["batch_fill"], json!(0.2344));
        // The same shape with room in the cache and the batch at its 16 slots: the slots hold
        // it, and the queue's first remedy is a larger maximum batch.
        for r in &mut recs {
            r.engine_kv_usage = Some(0.5);
            r.tpot_ms = Some(20.0);
        }
        let r = diagnose(
            &recs,
            W,
            &DiagnoseOptions {
                max_batch: Some(16.0),
                ..DiagnoseOptions::default()
            },
        );
        let q = step(&r, "ttft");
        assert_eq!(q.evidence["batch_held_by"], json!("slots"));
        assert_eq!(q.findings[0], "queueing");
        assert!(q.remedies[0].contains("raise the engine's maximum batch"));
    }

    #[test]
    fn large_batch_is_not_kv_bound() {
        let mut recs: Vec<_> = (0..20).map(|i| rec(i, i as i64 * 1000, 50, 20.0)).collect();
        for r in &mut recs {
            r.tpot_ms = Some(80.0);
            r.engine_kv_usage = Some(0.95);
            r.engine_running = Some(32.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(
            step(&r, "tpot").findings,
            vec!["decode_batch_bound".to_owned()]
        );
    }

    #[test]
    fn token_growth_and_network() {
        let mut recs: Vec<_> = (0..40).map(|i| rec(i, i as i64 * 2500, 50, 20.0)).collect();
        for r in recs.iter_mut().skip(20) {
            r.input_tokens = Some(500);
        }
        for r in recs.iter_mut() {
            r.gateway_overhead_ms = Some(80.0);
        }
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        let t = step(&r, "tokens");
        assert_eq!(t.findings, vec!["token_growth".to_owned()]);
        assert_eq!(t.evidence["tokens_per_request_first_half"], json!(70.0));
        assert_eq!(t.evidence["tokens_per_request_second_half"], json!(520.0));
        let n = step(&r, "network");
        assert_eq!(n.findings, vec!["gateway_overhead".to_owned()]);
        assert_eq!(r.conclusion.step.as_deref(), Some("tokens"));
        assert_eq!(r.conclusion.also, vec!["network".to_owned()]);
    }

    #[test]
    fn deterministic_json_and_table() {
        let recs: Vec<_> = (0..30).map(|i| rec(i, i as i64 * 1000, 50, 20.0)).collect();
        let a = diagnose(&recs, W, &DiagnoseOptions::default());
        let b = diagnose(&recs, W, &DiagnoseOptions::default());
        assert_eq!(a.render(crate::Format::Json), b.render(crate::Format::Json));
        let t = a.render_table();
        assert!(
            t.contains("ttft") && t.contains("Conclusion: healthy"),
            "{t}"
        );
    }

    /// `cargo test --release -p tokenscope-analysis million -- --ignored --nocapture`
    #[test]
    #[ignore = "timing; run in release"]
    fn million_records() {
        let recs: Vec<_> = (0..1_000_000usize)
            .map(|i| {
                let input = if i % 50 == 0 { 4000 } else { 60 };
                let mut r = rec(i, i as i64 / 10, input, 20.0 + (i % 97) as f64);
                r.engine_kv_usage = Some((i % 100) as f64 / 100.0);
                r.engine_running = Some((i % 8) as f64);
                r.user_id = Some(format!("u{}", i % 1000));
                r
            })
            .collect();
        let t = std::time::Instant::now();
        let r = diagnose(&recs, W, &DiagnoseOptions::default());
        eprintln!("diagnose over 1M records: {:?}", t.elapsed());
        assert_eq!(r.requests, 1_000_000);
    }

    #[test]
    fn interval_overlap() {
        let m = merge(vec![(10, 20), (0, 5), (15, 30)]);
        assert_eq!(m, vec![(0, 5), (10, 30)]);
        assert!(overlaps(&m, 5, 7));
        assert!(!overlaps(&m, 6, 9));
        assert!(overlaps(&m, 29, 40));
        assert!(!overlaps(&m, 31, 40));
    }
}
