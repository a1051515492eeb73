//! The gateway's own alerting, as pure logic: thresholds ([`AlertThresholds`], shared with the
//! Prometheus rules of [`crate::rules`]) and an evaluator ([`AlertEvaluator`]) over a sliding
//! window of recent request summaries ([`AlertSample`]), evaluated at a `now` the caller
//! passes, with the de-duplication state that makes one incident one alert.
//!
//! Conditions (names in [`crate::rules::names`], same thresholds as the rules):
//! * success ratio by model over `rate_window` (`1 - (upstream_error + timeout) / (all −
//!   client_error − cancelled)`) below `success_ratio_min` — P0;
//! * TTFT / TPOT P99 by model over `rate_window` above their thresholds — P1. The gateway
//!   uses the exact nearest-rank P99 of its records where Prometheus interpolates inside a
//!   histogram bucket, so the two agree to a bucket's width;
//! * queue: the rules read the engine's `llm_engine_requests_waiting`; the gateway, which has
//!   the records, uses the queue-time P99 by model (`queue_p99_seconds`) — P1;
//! * budget burn / budget exceeded by business line, from usage ratios the caller passes (the
//!   same values as `llm_budget_usage_ratio`) — P2 / P1;
//! * per caller (`user_id`, else API key, else tenant; at most [`MAX_TRACKED_CALLERS`]
//!   tracked, the rest counted in [`AlertEvaluator::callers_untracked`]): the same test on
//!   this replica's samples (`LLMCallerTokenRateAnomaly`, P2, label `caller`, the business
//!   line in the text); a caller with no baseline must exceed `token_anomaly_caller_min_rate`;
//! * token rate by model over `rate_window` above `token_anomaly_factor` × its average rate
//!   over the `baseline` that ended `baseline` ago, and above `token_anomaly_min_rate` — P2.
//!   Only evaluated once the history covers that baseline (Prometheus has no value either).
//!   In a fleet ([`AlertEvaluator::set_fleet_tokens`]) both rates are the fleet's, read from
//!   the shared store (every replica's requests), and the history counts as covered when this
//!   replica's does or the fleet's baseline window holds requests.
//!
//! Invariants:
//! * `for:` semantics as Prometheus: a condition becomes pending at the first evaluation where
//!   it holds and fires at the first evaluation where it has held continuously for `for`
//!   (`for = 0` fires at once); one evaluation where it does not hold resets it.
//! * One incident (alert name + labels) gives exactly one firing notification, and one
//!   resolved notification (same labels, same `starts_at`, `ends_at` set) when it stops
//!   holding; nothing in between unless a `repeat_interval` is set.
//! * Memory is bounded: at most `max_samples` samples (the oldest go first), and per model
//!   at most about 120 token buckets (bucket = max(1 s, baseline / 60), at most the baseline;
//!   the baseline's edges are rounded to buckets).
//! * No I/O and no clock: the caller passes the times.

use crate::rules::names;
use crate::AnalysisError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use tokenscope_core::success::SuccessCount;
use tokenscope_core::{Outcome, RequestRecord};

/// Callers tracked at most by the per-caller token anomaly (each holds ≤ ~120 buckets).
pub const MAX_TRACKED_CALLERS: usize = 1000;

/// Severity label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Severity {
    /// Page now: the service is failing.
    P0,
    /// Urgent: users are served badly, or data is being lost.
    P1,
    /// Look today: cost or traffic anomalies.
    P2,
}

impl Severity {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::P0 => "P0",
            Severity::P1 => "P1",
            Severity::P2 => "P2",
        }
    }
}

/// Thresholds of the alerts, shared by the exported Prometheus rules and the gateway's
/// evaluator (`[alerts.thresholds]` in the gateway config). Durations are seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlertThresholds {
    /// Window of the rates and percentiles (`rate(…[5m])`). Default 300.
    pub rate_window_seconds: u64,
    /// Success ratio below which `LLMSuccessRateLow` (P0) holds. Default 0.99.
    pub success_ratio_min: f64,
    /// `for:` of the success-ratio alert. Default 300.
    pub success_for_seconds: u64,
    /// TTFT P99 above which `LLMTTFTP99High` (P1) holds. Default 2 s.
    pub ttft_p99_seconds: f64,
    /// `for:` of the TTFT alert. Default 600.
    pub ttft_for_seconds: u64,
    /// TPOT P99 above which `LLMTPOTP99High` (P1) holds. Default 0.1 s (10 tokens/s per
    /// stream: below that, streamed text reads slower than people read).
    pub tpot_p99_seconds: f64,
    /// `for:` of the TPOT alert. Default 600.
    pub tpot_for_seconds: u64,
    /// Prometheus rule: `llm_engine_requests_waiting` above which `LLMEngineQueueHigh` holds.
    /// Default 32.
    pub queue_waiting_max: f64,
    /// Gateway evaluator: queue-time P99 above which `LLMEngineQueueHigh` holds. Default 5 s.
    pub queue_p99_seconds: f64,
    /// `for:` of the queue alert. Default 600.
    pub queue_for_seconds: u64,
    /// `llm_budget_usage_ratio` above which `LLMBudgetBurnHigh` (P2) holds. Default 0.9.
    pub budget_warning_ratio: f64,
    /// `llm_budget_usage_ratio` above which `LLMBudgetExceeded` (P1) holds. Default 1.
    pub budget_exceeded_ratio: f64,
    /// `for:` of both budget alerts. Default 300.
    pub budget_for_seconds: u64,
    /// Token rate over its baseline above which `LLMTokenRateAnomaly` (P2) holds. Default 3.
    pub token_anomaly_factor: f64,
    /// Token rate (tokens/s) below which no anomaly is reported. Default 1.
    pub token_anomaly_min_rate: f64,
    /// Gateway evaluator, `LLMCallerTokenRateAnomaly`: the token rate (tokens/s) a caller
    /// without a baseline (a new caller) must exceed. Default 100.
    pub token_anomaly_caller_min_rate: f64,
    /// Length of the baseline and how long ago it ended. Default 3600.
    pub token_anomaly_baseline_seconds: u64,
    /// `for:` of the token anomaly alert. Default 600.
    pub token_anomaly_for_seconds: u64,
    /// `for:` of `TokenscopeStoreDown`. Default 300.
    pub store_down_for_seconds: u64,
}

impl Default for AlertThresholds {
    fn default() -> Self {
        Self {
            rate_window_seconds: 300,
            success_ratio_min: 0.99,
            success_for_seconds: 300,
            ttft_p99_seconds: 2.0,
            ttft_for_seconds: 600,
            tpot_p99_seconds: 0.1,
            tpot_for_seconds: 600,
            queue_waiting_max: 32.0,
            queue_p99_seconds: 5.0,
            queue_for_seconds: 600,
            budget_warning_ratio: 0.9,
            budget_exceeded_ratio: 1.0,
            budget_for_seconds: 300,
            token_anomaly_factor: 3.0,
            token_anomaly_min_rate: 1.0,
            token_anomaly_caller_min_rate: 100.0,
            token_anomaly_baseline_seconds: 3600,
            token_anomaly_for_seconds: 600,
            store_down_for_seconds: 300,
        }
    }
}

impl AlertThresholds {
    /// Checks that every number is usable.
    pub fn validate(&self) -> Result<(), AnalysisError> {
        let bad = |m: String| Err(AnalysisError::InvalidOption(format!("alerts: {m}")));
        for (name, v) in [
            ("success_ratio_min", self.success_ratio_min),
            ("ttft_p99_seconds", self.ttft_p99_seconds),
            ("tpot_p99_seconds", self.tpot_p99_seconds),
            ("queue_waiting_max", self.queue_waiting_max),
            ("queue_p99_seconds", self.queue_p99_seconds),
            ("budget_warning_ratio", self.budget_warning_ratio),
            ("budget_exceeded_ratio", self.budget_exceeded_ratio),
            ("token_anomaly_factor", self.token_anomaly_factor),
            ("token_anomaly_min_rate", self.token_anomaly_min_rate),
            (
                "token_anomaly_caller_min_rate",
                self.token_anomaly_caller_min_rate,
            ),
        ] {
            if !v.is_finite() || v < 0.0 {
                return bad(format!("{name} = {v} must be a finite number >= 0"));
            }
        }
        if self.rate_window_seconds == 0 || self.token_anomaly_baseline_seconds == 0 {
            return bad(
                "rate_window_seconds and token_anomaly_baseline_seconds must be > 0".into(),
            );
        }
        Ok(())
    }
}

/// What the evaluator keeps of a finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct AlertSample {
    /// When the request finished, epoch µs.
    pub at_us: i64,
    /// Model (the bounded metric label, ideally).
    pub model: String,
    /// Outcome.
    pub outcome: Outcome,
    /// TTFT, seconds.
    pub ttft_s: Option<f64>,
    /// TPOT, seconds.
    pub tpot_s: Option<f64>,
    /// Queue time, seconds.
    pub queue_s: Option<f64>,
    /// Input + output tokens (cached tokens are part of input, as on `llm_tokens_total`
    /// without `token_type="cached"`).
    pub tokens: u64,
    /// The caller (`user_id`, else `key:<api_key_id>`, else `tenant:<tenant>`), for the
    /// per-caller token anomaly.
    pub caller: Option<String>,
    /// The request's business line (named in the per-caller alert).
    pub business_line: Option<String>,
}

impl AlertSample {
    /// The sample of `r`, finished at `finished_at_us`.
    pub fn from_record(r: &RequestRecord, finished_at_us: i64) -> Self {
        Self {
            at_us: finished_at_us,
            model: r.model.clone(),
            outcome: r.outcome,
            ttft_s: r.ttft_ms.map(|v| v / 1000.0),
            tpot_s: r.tpot_ms.map(|v| v / 1000.0),
            queue_s: r.queue_duration_ms.map(|v| v / 1000.0),
            tokens: crate::total_tokens(r),
            caller: r
                .user_id
                .clone()
                .or_else(|| r.api_key_id.as_ref().map(|k| format!("key:{k}")))
                .or_else(|| r.tenant.as_ref().map(|t| format!("tenant:{t}"))),
            business_line: r.business_line.clone(),
        }
    }
}

/// One alert, as sent (Alertmanager's fields, times in epoch µs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AlertInstance {
    /// `alertname`, `severity`, `tier` and the grouping labels (`model`, `business_line`).
    pub labels: BTreeMap<String, String>,
    /// `summary`, `description`.
    pub annotations: BTreeMap<String, String>,
    /// When the condition started to hold (pending since).
    pub starts_at_us: i64,
    /// Set on the resolved notification.
    pub ends_at_us: Option<i64>,
    /// The value at the last evaluation that sent it.
    pub value: f64,
}

impl AlertInstance {
    /// The `alertname` label.
    pub fn name(&self) -> &str {
        self.labels.get("alertname").map_or("", String::as_str)
    }
}

/// Firing or resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum NotificationState {
    /// The incident started (or is repeated).
    Firing,
    /// The incident ended.
    Resolved,
}

impl NotificationState {
    /// `firing` / `resolved`.
    pub fn as_str(self) -> &'static str {
        match self {
            NotificationState::Firing => "firing",
            NotificationState::Resolved => "resolved",
        }
    }
}

/// A notification to send.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notification {
    /// Firing or resolved.
    pub state: NotificationState,
    /// The alert.
    pub alert: AlertInstance,
}

/// Options of the evaluator besides the thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluatorOptions {
    /// Re-send a firing alert every this many µs while it lasts (`None`: never).
    pub repeat_interval_us: Option<i64>,
    /// Samples kept at most (the oldest are dropped first).
    pub max_samples: usize,
}

impl Default for EvaluatorOptions {
    fn default() -> Self {
        Self {
            repeat_interval_us: None,
            max_samples: 200_000,
        }
    }
}

#[derive(Debug)]
struct Incident {
    pending_since_us: i64,
    firing: Option<AlertInstance>,
    last_sent_us: i64,
}

/// A condition that holds at one evaluation.
struct Condition {
    name: &'static str,
    severity: Severity,
    tier: &'static str,
    key: &'static str,
    key_value: String,
    value: f64,
    for_s: u64,
    summary: String,
    description: String,
}

/// The gateway's own health, read from its metrics at each evaluation (the conditions of
/// the `TokenscopeRecordsLost` and `TokenscopeStoreDown` rules).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelfHealth {
    /// `tokenscope_records_lost_total` by reason (running totals).
    pub lost_total: Vec<(String, u64)>,
    /// `tokenscope_store_up == 1`.
    pub store_up: bool,
}

/// The token sums of a whole fleet of gateways (every replica's requests, summed by the shared
/// store), by bounded model label, for the token-anomaly condition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FleetTokens {
    /// Tokens of the requests created in the rate window ending at the sums' time.
    pub window: BTreeMap<String, u64>,
    /// Tokens of the requests created in the baseline window (`baseline` long, ended
    /// `baseline` before the sums' time).
    pub baseline: BTreeMap<String, u64>,
}

/// The sliding-window evaluator with its de-duplication state.
#[derive(Debug)]
pub struct AlertEvaluator {
    /// The fleet's token sums, when set (see [`AlertEvaluator::set_fleet_tokens`]).
    fleet_tokens: Option<FleetTokens>,
    t: AlertThresholds,
    opts: EvaluatorOptions,
    samples: VecDeque<AlertSample>,
    /// Tokens by model and bucket index (`at_us / bucket_us`), for the anomaly baseline.
    token_buckets: BTreeMap<String, BTreeMap<i64, u64>>,
    /// The same by caller, for at most [`MAX_TRACKED_CALLERS`] callers.
    caller_buckets: BTreeMap<String, BTreeMap<i64, u64>>,
    /// Samples of callers beyond [`MAX_TRACKED_CALLERS`] (not in the per-caller anomaly).
    callers_untracked: u64,
    bucket_us: i64,
    /// Length of the anomaly baseline (and how long ago it ended), µs.
    baseline_us: i64,
    first_at_us: Option<i64>,
    incidents: BTreeMap<String, Incident>,
    samples_dropped: u64,
    /// Lost-record totals seen at past evaluations (within the rate window), oldest first.
    lost_history: VecDeque<(i64, BTreeMap<String, u64>)>,
}

/// `%.3g`-like text of `v` (as the rules' templates print `$value`).
pub fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    if v == 0.0 {
        return "0".into();
    }
    let exp = v.abs().log10().floor() as i32;
    if !(-4..3).contains(&exp) {
        // Go's `%.3g`: `9.95e+03`, `1e-05` (mantissa without trailing zeros).
        let s = format!("{v:.2e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((s.as_str(), "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", e.abs());
    }
    let decimals = usize::try_from((2 - exp).max(0)).unwrap_or(0);
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// Nearest-rank P99 (as the store's reports define percentiles).
fn p99(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    crate::nearest_rank(&v, 0.99)
}

impl AlertEvaluator {
    /// A new evaluator (thresholds are validated by the caller, see
    /// [`AlertThresholds::validate`]).
    pub fn new(t: AlertThresholds, opts: EvaluatorOptions) -> Self {
        let baseline_us = i64::try_from(t.token_anomaly_baseline_seconds)
            .unwrap_or(i64::MAX / 4_000_000)
            .saturating_mul(1_000_000);
        Self {
            fleet_tokens: None,
            bucket_us: (baseline_us / 60).max(1_000_000).min(baseline_us.max(1)),
            baseline_us: baseline_us.max(1),
            t,
            opts,
            samples: VecDeque::new(),
            token_buckets: BTreeMap::new(),
            caller_buckets: BTreeMap::new(),
            callers_untracked: 0,
            first_at_us: None,
            incidents: BTreeMap::new(),
            samples_dropped: 0,
            lost_history: VecDeque::new(),
        }
    }

    /// The thresholds.
    pub fn thresholds(&self) -> &AlertThresholds {
        &self.t
    }

    /// Samples dropped because `max_samples` was reached.
    pub fn samples_dropped(&self) -> u64 {
        self.samples_dropped
    }

    /// Incidents currently firing.
    pub fn firing(&self) -> Vec<&AlertInstance> {
        self.incidents
            .values()
            .filter_map(|i| i.firing.as_ref())
            .collect()
    }

    /// Uses the fleet's token sums for the token-anomaly condition (`None`: this replica's
    /// own samples, e.g. while the store cannot be read).
    pub fn set_fleet_tokens(&mut self, fleet: Option<FleetTokens>) {
        self.fleet_tokens = fleet;
    }

    /// Samples of callers beyond the tracked ones (see [`MAX_TRACKED_CALLERS`]).
    pub fn callers_untracked(&self) -> u64 {
        self.callers_untracked
    }

    /// Adds a finished request.
    pub fn push(&mut self, s: AlertSample) {
        self.first_at_us = Some(self.first_at_us.map_or(s.at_us, |f| f.min(s.at_us)));
        if s.tokens > 0 {
            let b = s.at_us.div_euclid(self.bucket_us);
            *self
                .token_buckets
                .entry(s.model.clone())
                .or_default()
                .entry(b)
                .or_default() += s.tokens;
            if let Some(c) = &s.caller {
                if self.caller_buckets.len() < MAX_TRACKED_CALLERS
                    || self.caller_buckets.contains_key(c)
                {
                    *self
                        .caller_buckets
                        .entry(c.clone())
                        .or_default()
                        .entry(b)
                        .or_default() += s.tokens;
                } else {
                    self.callers_untracked += 1;
                }
            }
        }
        if self.samples.len() >= self.opts.max_samples.max(1) {
            self.samples.pop_front();
            self.samples_dropped += 1;
        }
        self.samples.push_back(s);
    }

    /// Notes that the history starts at `at_us` even without requests (a gateway that was up
    /// and idle has a zero baseline, not an unknown one).
    pub fn start_at(&mut self, at_us: i64) {
        self.first_at_us = Some(self.first_at_us.map_or(at_us, |f| f.min(at_us)));
    }

    fn window_us(&self) -> i64 {
        i64::try_from(self.t.rate_window_seconds)
            .unwrap_or(i64::MAX / 2_000_000)
            .saturating_mul(1_000_000)
    }

    /// Records the lost totals of `health` and returns, per reason, how many were lost over
    /// the rate window (from the oldest evaluation still inside it).
    fn lost_increase(&mut self, now_us: i64, health: &SelfHealth) -> Vec<(String, u64)> {
        let since = now_us - self.window_us();
        let current: BTreeMap<String, u64> = health.lost_total.iter().cloned().collect();
        while self.lost_history.front().is_some_and(|(at, _)| *at < since) {
            self.lost_history.pop_front();
        }
        let out = match self.lost_history.front() {
            Some((_, base)) => current
                .iter()
                .filter_map(|(reason, n)| {
                    let inc = n.saturating_sub(base.get(reason).copied().unwrap_or(0));
                    (inc > 0).then(|| (reason.clone(), inc))
                })
                .collect(),
            None => Vec::new(),
        };
        self.lost_history.push_back((now_us, current));
        out
    }

    fn health_conditions(&self, lost: &[(String, u64)], store_up: Option<bool>) -> Vec<Condition> {
        let w = crate::rules::prom_duration(self.t.rate_window_seconds);
        let mut out = Vec::new();
        for (reason, n) in lost {
            out.push(Condition {
                name: crate::rules::names::RECORDS_LOST,
                severity: Severity::P1,
                tier: "self",
                key: "reason",
                key_value: reason.clone(),
                value: *n as f64,
                for_s: 0,
                summary: format!("tokenscope lost records ({reason})"),
                description: format!(
                    "{n} accepted records were never stored over {w} (reason {reason})."
                ),
            });
        }
        if store_up == Some(false) {
            out.push(Condition {
                name: crate::rules::names::STORE_DOWN,
                severity: Severity::P1,
                tier: "self",
                key: "instance",
                key_value: "gateway".to_owned(),
                value: 0.0,
                for_s: self.t.store_down_for_seconds,
                summary: "tokenscope store of gateway is down".to_owned(),
                description: "tokenscope_store_up is 0: records go to the spool until the store \
                              accepts writes again."
                    .to_owned(),
            });
        }
        out
    }

    fn conditions(&self, now_us: i64, budget: &[(String, f64)]) -> Vec<Condition> {
        let t = &self.t;
        let w = crate::rules::prom_duration(t.rate_window_seconds);
        let since = now_us - self.window_us();
        let mut by_model: BTreeMap<&str, Vec<&AlertSample>> = BTreeMap::new();
        for s in self
            .samples
            .iter()
            .filter(|s| s.at_us > since && s.at_us <= now_us)
        {
            by_model.entry(s.model.as_str()).or_default().push(s);
        }
        let mut out = Vec::new();
        for (model, ss) in &by_model {
            // The one definition (`tokenscope_core::success`), as in the exported rules.
            let mut count = SuccessCount::default();
            ss.iter().for_each(|s| count.add(s.outcome));
            let (failed, counted) = (count.counted - count.ok, count.counted);
            if let Some(ratio) = count.rate() {
                if ratio < t.success_ratio_min {
                    out.push(Condition {
                        name: names::SUCCESS_RATE,
                        severity: Severity::P0,
                        tier: "availability",
                        key: "model",
                        key_value: (*model).to_owned(),
                        value: ratio,
                        for_s: t.success_for_seconds,
                        summary: format!(
                            "Success ratio of {model} below {}%",
                            t.success_ratio_min * 100.0
                        ),
                        description: format!(
                            "Success ratio of model {model} is {} over {w} ({failed} of {counted} \
                             requests failed; threshold {}).",
                            fmt_value(ratio),
                            t.success_ratio_min
                        ),
                    });
                }
            }
            let lat =
                |f: fn(&AlertSample) -> Option<f64>| p99(ss.iter().filter_map(|s| f(s)).collect());
            for (name, what, v, thr, for_s) in [
                (
                    names::TTFT_P99,
                    "TTFT",
                    lat(|s| s.ttft_s),
                    t.ttft_p99_seconds,
                    t.ttft_for_seconds,
                ),
                (
                    names::TPOT_P99,
                    "TPOT",
                    lat(|s| s.tpot_s),
                    t.tpot_p99_seconds,
                    t.tpot_for_seconds,
                ),
                (
                    names::QUEUE,
                    "Queue time",
                    lat(|s| s.queue_s),
                    t.queue_p99_seconds,
                    t.queue_for_seconds,
                ),
            ] {
                if let Some(v) = v.filter(|v| *v > thr) {
                    out.push(Condition {
                        name,
                        severity: Severity::P1,
                        tier: "latency",
                        key: "model",
                        key_value: (*model).to_owned(),
                        value: v,
                        for_s,
                        summary: format!("{what} P99 of {model} above {thr}s"),
                        description: format!(
                            "{what} P99 of model {model} is {}s over {w} (threshold {thr}s).",
                            fmt_value(v)
                        ),
                    });
                }
            }
        }
        // Token anomaly: rate over the window vs. the baseline that ended `baseline` ago —
        // this replica's samples, or the fleet's sums from the store.
        let base_us = self.baseline_us;
        let local_covered = self.first_at_us.is_some_and(|f| f <= now_us - 2 * base_us);
        let (lo, hi) = (
            (now_us - 2 * base_us).div_euclid(self.bucket_us),
            (now_us - base_us).div_euclid(self.bucket_us),
        );
        let mut rates: Vec<(String, f64, f64)> = Vec::new();
        match &self.fleet_tokens {
            Some(f) => {
                let covered = local_covered || f.baseline.values().any(|n| *n > 0);
                if covered {
                    for (model, n) in &f.window {
                        let base = f.baseline.get(model).copied().unwrap_or(0);
                        rates.push((
                            model.clone(),
                            *n as f64 / t.rate_window_seconds as f64,
                            base as f64 / base_us as f64 * 1e6,
                        ));
                    }
                }
            }
            None if local_covered => {
                for (model, ss) in &by_model {
                    let rate = ss.iter().map(|s| s.tokens).sum::<u64>() as f64
                        / t.rate_window_seconds as f64;
                    let base_tokens: u64 = self
                        .token_buckets
                        .get(*model)
                        .map(|b| b.range(lo..hi).map(|(_, n)| n).sum())
                        .unwrap_or(0);
                    let base_rate =
                        base_tokens as f64 / ((hi - lo).max(1) * self.bucket_us) as f64 * 1e6;
                    rates.push(((*model).to_owned(), rate, base_rate));
                }
            }
            None => {}
        }
        for (model, rate, base_rate) in rates {
            if rate > t.token_anomaly_factor * base_rate && rate > t.token_anomaly_min_rate {
                out.push(Condition {
                    name: names::TOKEN_ANOMALY,
                    severity: Severity::P2,
                    tier: "cost",
                    key: "model",
                    summary: format!("Token rate of {model} far above its baseline"),
                    description: format!(
                        "Token rate of model {model} is {} tokens/s, over {}x its baseline \
                         ({} tokens/s).",
                        fmt_value(rate),
                        t.token_anomaly_factor,
                        fmt_value(base_rate)
                    ),
                    key_value: model,
                    value: rate,
                    for_s: t.token_anomaly_for_seconds,
                });
            }
        }
        // The same per caller, on this replica's samples: a caller whose token rate is far
        // above its own baseline. A caller without a baseline (new) needs
        // `token_anomaly_caller_min_rate`: new users arrive all the time.
        if local_covered {
            let mut by_caller: BTreeMap<&str, (u64, Option<&str>)> = BTreeMap::new();
            for s in self
                .samples
                .iter()
                .filter(|s| s.at_us > since && s.at_us <= now_us)
            {
                if let Some(c) = s.caller.as_deref() {
                    let e = by_caller.entry(c).or_default();
                    e.0 += s.tokens;
                    if s.business_line.is_some() {
                        e.1 = s.business_line.as_deref();
                    }
                }
            }
            for (caller, (tokens, line)) in by_caller {
                let Some(buckets) = self.caller_buckets.get(caller) else {
                    continue; // beyond the tracked callers
                };
                let rate = tokens as f64 / t.rate_window_seconds as f64;
                let base_tokens: u64 = buckets.range(lo..hi).map(|(_, n)| n).sum();
                let base_rate =
                    base_tokens as f64 / ((hi - lo).max(1) * self.bucket_us) as f64 * 1e6;
                let floor = if base_tokens == 0 {
                    t.token_anomaly_caller_min_rate
                } else {
                    t.token_anomaly_min_rate
                };
                if rate > t.token_anomaly_factor * base_rate && rate > floor {
                    let of_line = line.map(|l| format!(" ({l})")).unwrap_or_default();
                    out.push(Condition {
                        name: names::CALLER_TOKEN_ANOMALY,
                        severity: Severity::P2,
                        tier: "cost",
                        key: "caller",
                        summary: format!("Token rate of caller {caller}{of_line} far above its baseline"),
                        description: format!(
                            "Token rate of caller {caller}{of_line} is {} tokens/s over {w}, over {}x \
                             its baseline ({} tokens/s): a loop, a retry storm or a runaway job?",
                            fmt_value(rate),
                            t.token_anomaly_factor,
                            fmt_value(base_rate)
                        ),
                        key_value: caller.to_owned(),
                        value: rate,
                        for_s: t.token_anomaly_for_seconds,
                    });
                }
            }
        }
        for (line, ratio) in budget {
            for (name, severity, thr) in [
                (names::BUDGET_BURN, Severity::P2, t.budget_warning_ratio),
                (
                    names::BUDGET_EXCEEDED,
                    Severity::P1,
                    t.budget_exceeded_ratio,
                ),
            ] {
                if *ratio > thr {
                    out.push(Condition {
                        name,
                        severity,
                        tier: "cost",
                        key: "business_line",
                        key_value: line.clone(),
                        value: *ratio,
                        for_s: t.budget_for_seconds,
                        summary: format!(
                            "Business line {line} used over {}% of its budget",
                            thr * 100.0
                        ),
                        description: format!(
                            "Budget usage of {line} is {} (threshold {thr}).",
                            fmt_value(*ratio)
                        ),
                    });
                }
            }
        }
        out
    }

    fn prune(&mut self, now_us: i64) {
        let since = now_us - self.window_us();
        while self.samples.front().is_some_and(|s| s.at_us <= since) {
            self.samples.pop_front();
        }
        let keep_from = (now_us - 2 * self.baseline_us).div_euclid(self.bucket_us) - 1;
        for buckets in [&mut self.token_buckets, &mut self.caller_buckets] {
            buckets.retain(|_, b| {
                *b = b.split_off(&keep_from);
                !b.is_empty()
            });
        }
    }

    /// Evaluates every condition at `now_us` (with the business lines' budget usage ratios,
    /// if known) and returns the notifications to send: new incidents that have held for their
    /// `for`, repeats (if configured), and incidents that ended.
    pub fn evaluate(&mut self, now_us: i64, budget: &[(String, f64)]) -> Vec<Notification> {
        self.evaluate_with_health(now_us, budget, None)
    }

    /// Like [`evaluate`](Self::evaluate), with the gateway's own health: also the
    /// `TokenscopeRecordsLost` (records lost over the rate window) and `TokenscopeStoreDown`
    /// (store not accepting writes for its `for`) conditions.
    pub fn evaluate_with_health(
        &mut self,
        now_us: i64,
        budget: &[(String, f64)],
        health: Option<&SelfHealth>,
    ) -> Vec<Notification> {
        self.prune(now_us);
        let mut conds = self.conditions(now_us, budget);
        if let Some(h) = health {
            let lost = self.lost_increase(now_us, h);
            conds.extend(self.health_conditions(&lost, Some(h.store_up)));
        }
        let mut out = Vec::new();
        let mut active = std::collections::BTreeSet::new();
        for c in conds {
            let mut labels = BTreeMap::new();
            labels.insert("alertname".to_owned(), c.name.to_owned());
            labels.insert("severity".to_owned(), c.severity.as_str().to_owned());
            labels.insert("tier".to_owned(), c.tier.to_owned());
            labels.insert(c.key.to_owned(), c.key_value.clone());
            let fingerprint = labels
                .iter()
                .map(|(k, v)| format!("{k}={v:?}"))
                .collect::<Vec<_>>()
                .join(",");
            active.insert(fingerprint.clone());
            let inc = self.incidents.entry(fingerprint).or_insert(Incident {
                pending_since_us: now_us,
                firing: None,
                last_sent_us: now_us,
            });
            let for_us = i64::try_from(c.for_s)
                .unwrap_or(i64::MAX / 2_000_000)
                .saturating_mul(1_000_000);
            let instance = || AlertInstance {
                labels: labels.clone(),
                annotations: BTreeMap::from([
                    ("summary".to_owned(), c.summary.clone()),
                    ("description".to_owned(), c.description.clone()),
                ]),
                starts_at_us: inc.pending_since_us,
                ends_at_us: None,
                value: c.value,
            };
            match &inc.firing {
                None if now_us - inc.pending_since_us >= for_us => {
                    let a = instance();
                    inc.firing = Some(a.clone());
                    inc.last_sent_us = now_us;
                    out.push(Notification {
                        state: NotificationState::Firing,
                        alert: a,
                    });
                }
                Some(_)
                    if self
                        .opts
                        .repeat_interval_us
                        .is_some_and(|r| now_us - inc.last_sent_us >= r) =>
                {
                    let a = instance();
                    inc.firing = Some(a.clone());
                    inc.last_sent_us = now_us;
                    out.push(Notification {
                        state: NotificationState::Firing,
                        alert: a,
                    });
                }
                _ => {}
            }
        }
        let ended: Vec<String> = self
            .incidents
            .keys()
            .filter(|k| !active.contains(*k))
            .cloned()
            .collect();
        for k in ended {
            if let Some(Incident {
                firing: Some(mut a),
                ..
            }) = self.incidents.remove(&k)
            {
                a.ends_at_us = Some(now_us);
                out.push(Notification {
                    state: NotificationState::Resolved,
                    alert: a,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;

    fn t_fast() -> AlertThresholds {
        AlertThresholds {
            rate_window_seconds: 10,
            success_for_seconds: 5,
            ttft_for_seconds: 5,
            tpot_for_seconds: 5,
            queue_for_seconds: 5,
            budget_for_seconds: 5,
            token_anomaly_for_seconds: 5,
            token_anomaly_baseline_seconds: 60,
            ..AlertThresholds::default()
        }
    }

    fn sample(at_us: i64, outcome: Outcome) -> AlertSample {
        AlertSample {
            at_us,
            model: "m".into(),
            outcome,
            ttft_s: Some(0.2),
            tpot_s: Some(0.02),
            queue_s: Some(0.01),
            tokens: 100,
            caller: None,
            business_line: None,
        }
    }

    /// Feeds `per_s` requests per second in `[from, to)` seconds, every `fail_every`-th failing
    /// (0 = none), evaluating once per second; returns every notification.
    fn run(
        ev: &mut AlertEvaluator,
        from: i64,
        to: i64,
        per_s: impl Fn(i64) -> u64,
        fail: impl Fn(i64) -> bool,
    ) -> Vec<Notification> {
        let mut out = Vec::new();
        for sec in from..to {
            let n = per_s(sec);
            for i in 0..n {
                let at = sec * S + (i as i64 * S) / n as i64;
                let outcome = if fail(sec) {
                    Outcome::UpstreamError
                } else {
                    Outcome::Ok
                };
                ev.push(sample(at, outcome));
            }
            out.extend(ev.evaluate((sec + 1) * S, &[]));
        }
        out
    }

    #[test]
    fn alerts_error_burst_fires_once_then_resolves_once() {
        let mut ev = AlertEvaluator::new(t_fast(), EvaluatorOptions::default());
        ev.start_at(0);
        let n = run(&mut ev, 0, 100, |_| 10, |s| (20..50).contains(&s));
        let firing: Vec<_> = n
            .iter()
            .filter(|n| n.state == NotificationState::Firing)
            .collect();
        let resolved: Vec<_> = n
            .iter()
            .filter(|n| n.state == NotificationState::Resolved)
            .collect();
        assert_eq!(firing.len(), 1, "{n:#?}");
        assert_eq!(resolved.len(), 1, "{n:#?}");
        let f = &firing[0].alert;
        assert_eq!(f.name(), names::SUCCESS_RATE);
        assert_eq!(f.labels["severity"], "P0");
        assert_eq!(f.labels["model"], "m");
        assert_eq!(f.starts_at_us, 21 * S);
        assert_eq!(resolved[0].alert.labels, f.labels);
        assert_eq!(resolved[0].alert.starts_at_us, f.starts_at_us);
        // The window (10 s) forgets the failures 10 s after the burst.
        assert_eq!(resolved[0].alert.ends_at_us, Some(60 * S));
        assert!(ev.firing().is_empty());
    }

    #[test]
    fn alerts_for_window_needs_continuous_condition() {
        let mut t = t_fast();
        t.rate_window_seconds = 1;
        t.success_for_seconds = 5;
        let mut ev = AlertEvaluator::new(t, EvaluatorOptions::default());
        // Failing 4 s, healthy 1 s, failing 4 s: never 5 s in a row.
        let n = run(
            &mut ev,
            0,
            20,
            |_| 10,
            |s| (0..4).contains(&s) || (5..9).contains(&s),
        );
        assert!(n.is_empty(), "{n:#?}");
        // Failing 7 s in a row fires once (at 5 s of holding).
        let n = run(&mut ev, 20, 40, |_| 10, |s| (20..27).contains(&s));
        assert_eq!(n.len(), 2, "{n:#?}");
        assert_eq!(n[0].state, NotificationState::Firing);
        assert_eq!(n[0].alert.starts_at_us, 21 * S);
        assert_eq!(n[1].state, NotificationState::Resolved);
    }

    #[test]
    fn alerts_zero_for_fires_at_once_and_repeat_interval() {
        let mut t = t_fast();
        t.success_for_seconds = 0;
        let mut ev = AlertEvaluator::new(
            t,
            EvaluatorOptions {
                repeat_interval_us: Some(10 * S),
                ..EvaluatorOptions::default()
            },
        );
        let n = run(&mut ev, 0, 25, |_| 10, |_| true);
        // Fires at 1 s, repeated at 11 s and 21 s: same labels and start.
        assert_eq!(n.len(), 3, "{n:#?}");
        assert!(n.iter().all(|x| x.state == NotificationState::Firing
            && x.alert.starts_at_us == S
            && x.alert.labels == n[0].alert.labels));
    }

    #[test]
    fn alerts_self_health_records_lost_and_store_down() {
        let t = AlertThresholds {
            store_down_for_seconds: 3,
            ..t_fast()
        };
        let mut ev = AlertEvaluator::new(t, EvaluatorOptions::default());
        let health = |lost: u64, up: bool| SelfHealth {
            lost_total: vec![("spool_full".into(), lost), ("write_failed".into(), 0)],
            store_up: up,
        };
        let mut sent = Vec::new();
        // 0..5 s healthy; 5 s: 7 records lost (once); 8..14 s store down; then up again.
        for sec in 0..40 {
            let lost = if sec >= 5 { 7 } else { 0 };
            let up = !(8..14).contains(&sec);
            sent.extend(ev.evaluate_with_health(sec * S, &[], Some(&health(lost, up))));
        }
        let names: Vec<(String, NotificationState, Option<String>)> = sent
            .iter()
            .map(|n| {
                (
                    n.alert.labels["alertname"].clone(),
                    n.state,
                    n.alert.labels.get("reason").cloned(),
                )
            })
            .collect();
        assert_eq!(
            names,
            vec![
                (
                    crate::rules::names::RECORDS_LOST.to_owned(),
                    NotificationState::Firing,
                    Some("spool_full".to_owned())
                ),
                (
                    crate::rules::names::STORE_DOWN.to_owned(),
                    NotificationState::Firing,
                    None
                ),
                (
                    crate::rules::names::STORE_DOWN.to_owned(),
                    NotificationState::Resolved,
                    None
                ),
                (
                    crate::rules::names::RECORDS_LOST.to_owned(),
                    NotificationState::Resolved,
                    Some("spool_full".to_owned())
                ),
            ],
            "{sent:#?}"
        );
        let lost = &sent[0].alert;
        assert_eq!(lost.value, 7.0);
        assert_eq!(lost.labels["severity"], "P1");
        // The store-down incident fired only after it held for its `for` (3 s from 8 s).
        assert_eq!(sent[1].alert.starts_at_us, 8 * S);
    }

    #[test]
    fn alerts_quiet_growth_is_silent() {
        // 3 minutes of 10 req/s growing 20 % linearly, no errors, fast latencies: nothing.
        let mut ev = AlertEvaluator::new(t_fast(), EvaluatorOptions::default());
        ev.start_at(0);
        let n = run(&mut ev, 0, 180, |s| 10 + (2 * s as u64) / 180, |_| false);
        assert!(n.is_empty(), "{n:#?}");
    }

    #[test]
    fn alerts_token_anomaly_and_latency() {
        let mut ev = AlertEvaluator::new(t_fast(), EvaluatorOptions::default());
        ev.start_at(0);
        // 2 minutes steady, then 10x the traffic: the anomaly fires once.
        let n = run(&mut ev, 0, 150, |s| if s < 130 { 2 } else { 20 }, |_| false);
        assert_eq!(n.len(), 1, "{n:#?}");
        assert_eq!(n[0].alert.name(), names::TOKEN_ANOMALY);
        assert_eq!(n[0].alert.labels["severity"], "P2");

        let mut ev = AlertEvaluator::new(t_fast(), EvaluatorOptions::default());
        for sec in 0..20 {
            for i in 0..10 {
                let mut s = sample(sec * S + i * S / 10, Outcome::Ok);
                s.ttft_s = Some(3.0);
                s.tpot_s = Some(0.2);
                ev.push(s);
            }
            let n = ev.evaluate((sec + 1) * S, &[("search".into(), 0.95)]);
            if sec == 5 {
                let mut names: Vec<_> = n.iter().map(|n| n.alert.name().to_owned()).collect();
                names.sort();
                assert_eq!(
                    names,
                    [names::BUDGET_BURN, names::TPOT_P99, names::TTFT_P99],
                    "{n:#?}"
                );
            } else {
                assert!(n.is_empty(), "{sec}: {n:#?}");
            }
        }
    }

    #[test]
    fn alerts_short_baseline_anomaly() {
        // A baseline shorter than a minute (as the gateway's tests use): quiet growth stays
        // silent, a 10x jump fires once.
        let t = AlertThresholds {
            rate_window_seconds: 2,
            token_anomaly_baseline_seconds: 2,
            token_anomaly_for_seconds: 1,
            ..t_fast()
        };
        let mut ev = AlertEvaluator::new(t, EvaluatorOptions::default());
        ev.start_at(0);
        let n = run(&mut ev, 0, 30, |s| 10 + (2 * s as u64) / 30, |_| false);
        assert!(n.is_empty(), "{n:#?}");
        let n = run(&mut ev, 30, 40, |_| 100, |_| false);
        // Fires once; resolves once the baseline (ending 2 s ago) has caught up.
        assert_eq!(n.len(), 2, "{n:#?}");
        assert_eq!(n[0].alert.name(), names::TOKEN_ANOMALY);
        assert_eq!(n[0].state, NotificationState::Firing);
        assert_eq!(n[1].state, NotificationState::Resolved);
    }

    #[test]
    fn alerts_one_callers_token_surge_fires_once_naming_it() {
        // Issue 21: live token alerting per caller. Two callers at a flat 10 req/s each; then
        // "looper" alone jumps 10x while the model's total rises 5.5x: the caller alert names
        // it (and its business line); the quiet caller stays silent.
        let t = AlertThresholds {
            rate_window_seconds: 2,
            token_anomaly_baseline_seconds: 2,
            token_anomaly_for_seconds: 1,
            token_anomaly_factor: 3.0,
            ..t_fast()
        };
        let mut ev = AlertEvaluator::new(t, EvaluatorOptions::default());
        ev.start_at(0);
        let mut out = Vec::new();
        for sec in 0..40i64 {
            for (caller, per_s) in [
                ("quiet", 10u64),
                ("looper", if sec >= 30 { 100 } else { 10 }),
            ] {
                for i in 0..per_s {
                    let mut x = sample(sec * S + (i as i64 * S) / per_s as i64, Outcome::Ok);
                    x.caller = Some(caller.to_owned());
                    x.business_line = Some(format!("{caller}-line"));
                    ev.push(x);
                }
            }
            out.extend(ev.evaluate((sec + 1) * S, &[]));
        }
        let callers: Vec<&Notification> = out
            .iter()
            .filter(|n| n.alert.name() == names::CALLER_TOKEN_ANOMALY)
            .collect();
        let firing: Vec<_> = callers
            .iter()
            .filter(|n| n.state == NotificationState::Firing)
            .collect();
        assert_eq!(firing.len(), 1, "{callers:#?}");
        let a = &firing[0].alert;
        assert_eq!(a.labels["caller"], "looper");
        assert_eq!(a.labels["tier"], "cost");
        assert!(
            a.annotations["summary"].contains("looper (looper-line)"),
            "{a:?}"
        );
        // A new caller needs the higher floor: 20 tokens/s of a newcomer is not an anomaly.
        let mut ev = AlertEvaluator::new(
            AlertThresholds {
                rate_window_seconds: 2,
                token_anomaly_baseline_seconds: 2,
                token_anomaly_for_seconds: 0,
                ..t_fast()
            },
            EvaluatorOptions::default(),
        );
        ev.start_at(0);
        let mut x = sample(9 * S, Outcome::Ok);
        x.caller = Some("newcomer".into());
        ev.push(x);
        let n = ev.evaluate(10 * S, &[]);
        assert!(
            !n.iter()
                .any(|n| n.alert.name() == names::CALLER_TOKEN_ANOMALY),
            "{n:#?}"
        );
        // Bounded: callers beyond the tracked ones are counted, not kept.
        let mut ev = AlertEvaluator::new(t_fast(), EvaluatorOptions::default());
        for i in 0..(MAX_TRACKED_CALLERS + 5) {
            let mut x = sample(S, Outcome::Ok);
            x.caller = Some(format!("c{i}"));
            ev.push(x);
        }
        assert_eq!(ev.callers_untracked(), 5);
    }

    #[test]
    fn alerts_fleet_token_anomaly_uses_the_fleets_sums() {
        // One replica's own traffic is flat and small; the fleet's (from the store) jumps.
        let t = AlertThresholds {
            rate_window_seconds: 2,
            token_anomaly_baseline_seconds: 2,
            token_anomaly_for_seconds: 0,
            token_anomaly_min_rate: 50.0,
            ..t_fast()
        };
        let mut ev = AlertEvaluator::new(t, EvaluatorOptions::default());
        ev.start_at(0);
        assert!(run(&mut ev, 0, 10, |_| 1, |_| false).is_empty());
        let fleet = |window: u64, base: u64| FleetTokens {
            window: [("m".to_owned(), window)].into(),
            baseline: [("m".to_owned(), base)].into(),
        };
        // The fleet at the replica's own rate: quiet.
        ev.set_fleet_tokens(Some(fleet(40, 40)));
        assert!(ev.evaluate(11 * S, &[]).is_empty());
        // The fleet's rate 10x its baseline and above the minimum: fires once, for "m".
        ev.set_fleet_tokens(Some(fleet(400, 40)));
        let n = ev.evaluate(12 * S, &[]);
        assert_eq!(n.len(), 1, "{n:#?}");
        assert_eq!(n[0].alert.name(), names::TOKEN_ANOMALY);
        assert_eq!(n[0].alert.labels["model"], "m");
        assert_eq!(n[0].alert.value, 200.0);
        assert!(
            ev.evaluate(13 * S, &[]).is_empty(),
            "one incident, one alert"
        );
        // Back to the replica's own samples (store unreadable): its flat rate resolves it.
        ev.set_fleet_tokens(None);
        let n = ev.evaluate(14 * S, &[]);
        assert_eq!(n.len(), 1, "{n:#?}");
        assert_eq!(n[0].state, NotificationState::Resolved);
    }

    #[test]
    fn alerts_value_format_and_bounds() {
        assert_eq!(fmt_value(0.9), "0.9");
        assert_eq!(fmt_value(0.899_999_999_9), "0.9");
        assert_eq!(fmt_value(4.95), "4.95");
        assert_eq!(fmt_value(16.666), "16.7");
        assert_eq!(fmt_value(50.0), "50");
        assert_eq!(fmt_value(0.0), "0");
        assert_eq!(fmt_value(9951.0), "9.95e+03");
        assert_eq!(fmt_value(1000.0), "1e+03");
        assert_eq!(fmt_value(0.000_012), "1.2e-05");
        let mut ev = AlertEvaluator::new(
            t_fast(),
            EvaluatorOptions {
                max_samples: 5,
                ..EvaluatorOptions::default()
            },
        );
        for i in 0..10 {
            ev.push(sample(i, Outcome::Ok));
        }
        assert_eq!(ev.samples.len(), 5);
        assert_eq!(ev.samples_dropped(), 5);
        assert!(AlertThresholds::default().validate().is_ok());
        let bad = AlertThresholds {
            success_ratio_min: f64::NAN,
            ..AlertThresholds::default()
        };
        assert!(bad.validate().is_err());
    }
}
