//! Prometheus alerting and recording rules (`tokenscope export prometheus-rules`).
//!
//! [`prometheus_rules`] writes one rules file (YAML, formatted by hand — no YAML dependency)
//! from [`AlertThresholds`]:
//!
//! * group `tokenscope`: the recording rules behind the dashboard queries (request rate,
//!   success ratio, latency / TTFT / TPOT P50/P95/P99 by model, token rates, engine queue),
//!   then the tiered alerts that read them (rules of a group run in order at the same
//!   evaluation time, so an alert sees the recording rules of the same evaluation);
//! * group `tokenscope-self`: the gateway's own health (records lost, store down).
//!
//! Invariants:
//! * Deterministic: the same thresholds give the same bytes (tests and `git diff` rely on it).
//! * Every alert has a `for:`, `severity` (`P0`/`P1`/`P2`) and `tier` labels, and `summary` /
//!   `description` annotations that show `{{ $value }}` (via `printf "%.3g"`, so the text is
//!   stable across Prometheus versions).
//! * Every string is written single-quoted (`'` doubled), so PromQL and Go templates need no
//!   further escaping.
//! * The alert names, labels and conditions are the ones [`crate::alerts`] evaluates in the
//!   gateway; the test `crates/tokenscope-analysis/tests/rules/alerts_test.yml` pins them with
//!   `promtool test rules` (one test per alert, firing and not firing).

use crate::alerts::{AlertThresholds, Severity};
use std::fmt::Write as _;

/// Alert names (shared with the gateway's evaluator).
pub mod names {
    /// P0: the share of requests that did not fail on the server side is too low.
    pub const SUCCESS_RATE: &str = "LLMSuccessRateLow";
    /// P1: TTFT P99 by model too high.
    pub const TTFT_P99: &str = "LLMTTFTP99High";
    /// P1: TPOT P99 by model too high.
    pub const TPOT_P99: &str = "LLMTPOTP99High";
    /// P1: the engine's queue is long (Prometheus: `llm_engine_requests_waiting`; the
    /// gateway: queue-time P99 of its records).
    pub const QUEUE: &str = "LLMEngineQueueHigh";
    /// P2: a business line has used most of its budget.
    pub const BUDGET_BURN: &str = "LLMBudgetBurnHigh";
    /// P1: a business line is over its budget.
    pub const BUDGET_EXCEEDED: &str = "LLMBudgetExceeded";
    /// P2: token rate of a model far above its baseline.
    pub const TOKEN_ANOMALY: &str = "LLMTokenRateAnomaly";
    /// P2 (gateway evaluator only: Prometheus has no per-caller label): one caller's token
    /// rate far above its own baseline.
    pub const CALLER_TOKEN_ANOMALY: &str = "LLMCallerTokenRateAnomaly";
    /// P1: accepted records were lost.
    pub const RECORDS_LOST: &str = "TokenscopeRecordsLost";
    /// P1: the store does not accept writes.
    pub const STORE_DOWN: &str = "TokenscopeStoreDown";
}

/// Prometheus duration text: `5m`, `90s`, `1h`.
pub fn prom_duration(secs: u64) -> String {
    if secs == 0 {
        "0s".into()
    } else if secs.is_multiple_of(3600) {
        format!("{}h", secs / 3600)
    } else if secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

/// A number as PromQL / YAML text (shortest form that reads back the same value).
fn num(v: f64) -> String {
    format!("{v}")
}

/// Single-quoted YAML scalar.
fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

const VALUE: &str = "{{ $value | printf \"%.3g\" }}";

struct Alert<'a> {
    name: &'a str,
    expr: String,
    for_s: u64,
    severity: Severity,
    tier: &'a str,
    summary: String,
    description: String,
}

fn write_record(out: &mut String, record: &str, expr: &str) {
    let _ = writeln!(out, "      - record: {record}");
    let _ = writeln!(out, "        expr: {}", q(expr));
}

fn write_alert(out: &mut String, a: &Alert<'_>) {
    let _ = writeln!(out, "      - alert: {}", a.name);
    let _ = writeln!(out, "        expr: {}", q(&a.expr));
    let _ = writeln!(out, "        for: {}", prom_duration(a.for_s));
    let _ = writeln!(out, "        labels:");
    let _ = writeln!(out, "          severity: {}", a.severity.as_str());
    let _ = writeln!(out, "          tier: {}", a.tier);
    let _ = writeln!(out, "        annotations:");
    let _ = writeln!(out, "          summary: {}", q(&a.summary));
    let _ = writeln!(out, "          description: {}", q(&a.description));
}

/// Statuses counted as failures (the one definition: `tokenscope_core::success`; client
/// errors and cancellations are neither successes nor failures, so the success ratio is
/// `ok / (all − those)`).
pub const FAILURE_STATUSES: &str = tokenscope_core::success::PROMQL_FAILURE_STATUSES;
/// Statuses left out of the success ratio's denominator.
pub const EXCLUDED_STATUSES: &str = tokenscope_core::success::PROMQL_EXCLUDED_STATUSES;
/// The status of a success.
pub const SUCCESS_STATUS: &str = tokenscope_core::success::PROMQL_SUCCESS_STATUS;

/// The rules file for `t`.
pub fn prometheus_rules(t: &AlertThresholds) -> String {
    let w = prom_duration(t.rate_window_seconds.max(1));
    let base = prom_duration(t.token_anomaly_baseline_seconds.max(1));
    let mut out = String::with_capacity(16 * 1024);
    out.push_str("# Generated by `tokenscope export prometheus-rules`; regenerate, do not edit.\n");
    out.push_str(
        "# Thresholds come from [alerts.thresholds] of the gateway config (docs/analysis.md).\n",
    );
    out.push_str("groups:\n");
    out.push_str("  - name: tokenscope\n    rules:\n");

    // Recording rules (dashboard queries).
    let rec = |out: &mut String, r: &str, e: String| write_record(out, r, &e);
    rec(
        &mut out,
        &format!("llm:requests:rate{w}"),
        format!("sum by (model, status) (rate(llm_requests_total[{w}]))"),
    );
    rec(
        &mut out,
        &format!("llm:request_failures:rate{w}"),
        format!("sum by (model) (rate(llm_requests_total{{status=~\"{FAILURE_STATUSES}\"}}[{w}]))"),
    );
    rec(
        &mut out,
        &format!("llm:request_success_ratio:rate{w}"),
        format!(
            "(sum by (model) (rate(llm_requests_total{{status=\"{SUCCESS_STATUS}\"}}[{w}])) \
             or 0 * sum by (model) (rate(llm_requests_total{{status!~\"{EXCLUDED_STATUSES}\"}}[{w}]))) \
             / sum by (model) (rate(llm_requests_total{{status!~\"{EXCLUDED_STATUSES}\"}}[{w}]))"
        ),
    );
    for (metric, short) in [
        ("llm_request_latency_seconds", "request_latency_seconds"),
        ("llm_ttft_seconds", "ttft_seconds"),
        ("llm_tpot_seconds", "tpot_seconds"),
    ] {
        for (qv, qn) in [(0.5, "p50"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99")] {
            rec(
                &mut out,
                &format!("llm:{short}:{qn}_{w}"),
                format!(
                    "histogram_quantile({qv}, sum by (le, model) (rate({metric}_bucket[{w}])))"
                ),
            );
        }
    }
    rec(
        &mut out,
        &format!("llm:tokens:rate{w}"),
        format!("sum by (model, token_type) (rate(llm_tokens_total[{w}]))"),
    );
    rec(
        &mut out,
        &format!("llm:tokens_by_model:rate{w}"),
        format!("sum by (model) (rate(llm_tokens_total{{token_type!=\"cached\"}}[{w}]))"),
    );
    rec(
        &mut out,
        &format!("llm:tokens_by_model:rate{base}"),
        format!("sum by (model) (rate(llm_tokens_total{{token_type!=\"cached\"}}[{base}]))"),
    );
    rec(
        &mut out,
        "llm:engine_requests_waiting:max",
        "max by (upstream) (llm_engine_requests_waiting)".into(),
    );

    let pct = |v: f64| num((v * 100.0 * 1e6).round() / 1e6);
    let alerts = [
        Alert {
            name: names::SUCCESS_RATE,
            expr: format!(
                "llm:request_success_ratio:rate{w} < {}",
                num(t.success_ratio_min)
            ),
            for_s: t.success_for_seconds,
            severity: Severity::P0,
            tier: "availability",
            summary: format!(
                "Success ratio of {{{{ $labels.model }}}} below {}%",
                pct(t.success_ratio_min)
            ),
            description: format!(
                "Success ratio of model {{{{ $labels.model }}}} is {VALUE} over {w} \
                 (threshold {}; failures are upstream errors and timeouts).",
                num(t.success_ratio_min)
            ),
        },
        Alert {
            name: names::TTFT_P99,
            expr: format!("llm:ttft_seconds:p99_{w} > {}", num(t.ttft_p99_seconds)),
            for_s: t.ttft_for_seconds,
            severity: Severity::P1,
            tier: "latency",
            summary: format!(
                "TTFT P99 of {{{{ $labels.model }}}} above {}s",
                num(t.ttft_p99_seconds)
            ),
            description: format!(
                "TTFT P99 of model {{{{ $labels.model }}}} is {VALUE}s over {w} (threshold {}s).",
                num(t.ttft_p99_seconds)
            ),
        },
        Alert {
            name: names::TPOT_P99,
            expr: format!("llm:tpot_seconds:p99_{w} > {}", num(t.tpot_p99_seconds)),
            for_s: t.tpot_for_seconds,
            severity: Severity::P1,
            tier: "latency",
            summary: format!(
                "TPOT P99 of {{{{ $labels.model }}}} above {}s",
                num(t.tpot_p99_seconds)
            ),
            description: format!(
                "TPOT P99 of model {{{{ $labels.model }}}} is {VALUE}s over {w} (threshold {}s).",
                num(t.tpot_p99_seconds)
            ),
        },
        Alert {
            name: names::QUEUE,
            expr: format!(
                "llm:engine_requests_waiting:max > {}",
                num(t.queue_waiting_max)
            ),
            for_s: t.queue_for_seconds,
            severity: Severity::P1,
            tier: "latency",
            summary: "Engine queue of {{ $labels.upstream }} is long".into(),
            description: format!(
                "Upstream {{{{ $labels.upstream }}}} has {VALUE} requests waiting (threshold {}).",
                num(t.queue_waiting_max)
            ),
        },
        Alert {
            name: names::BUDGET_BURN,
            expr: format!("llm_budget_usage_ratio > {}", num(t.budget_warning_ratio)),
            for_s: t.budget_for_seconds,
            severity: Severity::P2,
            tier: "cost",
            summary: format!(
                "Business line {{{{ $labels.business_line }}}} used over {}% of its budget",
                pct(t.budget_warning_ratio)
            ),
            description: format!(
                "Budget usage of {{{{ $labels.business_line }}}} is {VALUE} (warning at {}).",
                num(t.budget_warning_ratio)
            ),
        },
        Alert {
            name: names::BUDGET_EXCEEDED,
            expr: format!("llm_budget_usage_ratio > {}", num(t.budget_exceeded_ratio)),
            for_s: t.budget_for_seconds,
            severity: Severity::P1,
            tier: "cost",
            summary: "Business line {{ $labels.business_line }} is over its budget".into(),
            description: format!(
                "Budget usage of {{{{ $labels.business_line }}}} is {VALUE} (limit {}).",
                num(t.budget_exceeded_ratio)
            ),
        },
        Alert {
            name: names::TOKEN_ANOMALY,
            expr: format!(
                "llm:tokens_by_model:rate{w} > {} * (llm:tokens_by_model:rate{base} offset {base}) \
                 and llm:tokens_by_model:rate{w} > {}",
                num(t.token_anomaly_factor),
                num(t.token_anomaly_min_rate)
            ),
            for_s: t.token_anomaly_for_seconds,
            severity: Severity::P2,
            tier: "cost",
            summary: "Token rate of {{ $labels.model }} far above its baseline".into(),
            description: format!(
                "Token rate of model {{{{ $labels.model }}}} is {VALUE} tokens/s, over {}x its \
                 average rate of the {base} that ended {base} ago.",
                num(t.token_anomaly_factor)
            ),
        },
    ];
    for a in &alerts {
        write_alert(&mut out, a);
    }

    out.push_str("  - name: tokenscope-self\n    rules:\n");
    let self_alerts = [
        Alert {
            name: names::RECORDS_LOST,
            expr: format!("sum by (reason) (increase(tokenscope_records_lost_total[{w}])) > 0"),
            for_s: 0,
            severity: Severity::P1,
            tier: "self",
            summary: "tokenscope lost records ({{ $labels.reason }})".into(),
            description: format!(
                "{VALUE} accepted records were never stored over {w} (reason {{{{ $labels.reason }}}})."
            ),
        },
        Alert {
            name: names::STORE_DOWN,
            expr: "tokenscope_store_up == 0".into(),
            for_s: t.store_down_for_seconds,
            severity: Severity::P1,
            tier: "self",
            summary: "tokenscope store of {{ $labels.instance }} is down".into(),
            description: format!(
                "tokenscope_store_up is {VALUE}: records go to the spool until the store \
                 accepts writes again."
            ),
        },
    ];
    for a in &self_alerts {
        write_alert(&mut out, a);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alerts_rules_are_deterministic_and_complete() {
        let t = AlertThresholds::default();
        let a = prometheus_rules(&t);
        assert_eq!(a, prometheus_rules(&t));
        for name in [
            names::SUCCESS_RATE,
            names::TTFT_P99,
            names::TPOT_P99,
            names::QUEUE,
            names::BUDGET_BURN,
            names::BUDGET_EXCEEDED,
            names::TOKEN_ANOMALY,
            names::RECORDS_LOST,
            names::STORE_DOWN,
        ] {
            assert!(a.contains(&format!("- alert: {name}\n")), "{name}");
        }
        assert_eq!(a.matches("- alert: ").count(), 9);
        assert_eq!(a.matches("        for: ").count(), 9);
        assert_eq!(a.matches("          severity: ").count(), 9);
        assert!(a.contains("llm:request_success_ratio:rate5m < 0.99'"));
        assert!(a.contains("for: 10m"));
    }

    #[test]
    fn alerts_durations() {
        assert_eq!(prom_duration(300), "5m");
        assert_eq!(prom_duration(3600), "1h");
        assert_eq!(prom_duration(90), "90s");
        assert_eq!(prom_duration(0), "0s");
    }
}
