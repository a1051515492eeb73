//! `[fleet]`: several gateways writing to one store answer with the fleet's numbers.
//!
//! Every `refresh_interval_ms` (on by default with a ClickHouse store) a task on the
//! background runtime asks the store — which aggregates, so the gateway reads one row per
//! group — for:
//!
//! * **Budget usage**: per business line, the tokens and USD of each explicit budget's current
//!   period, summed over every replica's records created before `as_of` (a whole second,
//!   `flush_interval + 1 s` before now, so rows still in a pipeline are not expected yet).
//!   The [`BudgetTracker`](crate::cost::BudgetTracker) then shows that sum plus this
//!   replica's own records created at or after `as_of`, so `llm_budget_usage_ratio` and the
//!   budget alerts are the fleet's. Another replica's requests show up within one refresh.
//!   Automatic budgets keep their baseline from the start-up seed (already every replica's
//!   history) and count this replica's requests only.
//! * **Sampler P99**: per tail-sampler key (bounded model label, input bucket), the exact P99
//!   of end-to-end latency of the fleet's successful requests over the last `p99_window_s`
//!   ([`TailSampler::set_fleet_p99`](tokenscope_trace::TailSampler::set_fleet_p99)), so a
//!   replica that sees few requests of a key still keeps the ones slow for the fleet.
//! * **Token rates** (with `[alerts]`): per bounded model label, the tokens of the fleet's
//!   requests created in the alert's rate window ending at `as_of` and in its baseline window
//!   (`baseline` long, ending `baseline` before `as_of`), so the live `LLMTokenRateAnomaly`
//!   compares the fleet's rate with the fleet's baseline: a surge spread thinly over the
//!   replicas fires, and the claims below make it one alert. Sums older than 60 s (the store
//!   unreadable that long) are dropped: each replica then judges its own requests again.
//! * **Alert claims** (ClickHouse only): before a firing alert is sent, the incident is
//!   claimed in the store (`crate::alerting`), so one incident is one notification.
//!
//! While the store is down or slow: the last sums stay in use (a refresh that fails is
//! logged, at most once a minute, and tried again next interval); this replica's own requests
//! keep adding to the budget usage on top of the last sum; the sampler keeps the last fleet
//! P99 (its local window decides for keys the fleet has too few samples of); an alert whose
//! claim fails is sent by every replica that sees it — twice rather than never.
//!
//! Invariants: nothing here runs on the request path (the store is read on a blocking thread
//! of the background runtime); the gateway holds one row per (line, model) and per sampler
//! key, whatever the store's row count.

use crate::cost::FleetUsage;
use crate::shared::Shared;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokenscope_analysis::alerts::FleetTokens;
use tokenscope_analysis::PriceTable;
use tokenscope_core::query::{Dimension, Window};
use tokenscope_core::usage::UsageQuery;
use tokenscope_core::InputBucket;
use tokenscope_store::{RecordReader, ReportQuery};

/// The refresh interval of `[fleet]` for this configuration (`None` = off).
pub(crate) fn refresh_interval(shared: &Shared) -> Option<Duration> {
    let target = tokenscope_backend::StoreTarget::parse(&shared.cfg.store);
    let ms = match shared.cfg.fleet.refresh_interval_ms {
        Some(ms) => ms,
        None if matches!(target, tokenscope_backend::StoreTarget::ClickHouse(_)) => 10_000,
        None => 0,
    };
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// This gateway's name in the alert claims.
fn replica_id(shared: &Shared) -> String {
    if let Some(id) = &shared.cfg.fleet.replica_id {
        return id.clone();
    }
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "gateway".to_owned());
    format!("{host}:{}:{}", shared.cfg.admin_listen, std::process::id())
}

/// Starts the fleet view (see the module docs) when `[fleet]` is on: turns the budget
/// tracker's fleet mode on, installs the alert claims (ClickHouse stores) and spawns the
/// refresh task on `rt`.
pub(crate) fn start(shared: &Arc<Shared>, rt: &tokio::runtime::Handle) {
    let Some(every) = refresh_interval(shared) else {
        return;
    };
    shared.fanout.budgets.enable_fleet();
    let target = tokenscope_backend::StoreTarget::parse(&shared.cfg.store);
    if let tokenscope_backend::StoreTarget::ClickHouse(url) = &target {
        let url = url.clone();
        let replica = replica_id(shared);
        let settle = Duration::from_millis(shared.cfg.fleet.claim_settle_ms);
        let hold_us = i64::try_from(shared.cfg.fleet.claim_hold_s)
            .unwrap_or(i64::MAX / 1_000_000)
            .saturating_mul(1_000_000);
        let store: Arc<parking_lot::Mutex<Option<tokenscope_backend::ClickHouseStore>>> =
            Arc::default();
        tracing::info!(replica = %replica, "Fleet: alerts are claimed in ClickHouse before they are sent.");
        shared
            .fanout
            .alerting
            .set_claims(Arc::new(move |fingerprint: &str, now_us: i64| {
                let mut g = store.lock();
                if g.is_none() {
                    *g = Some(
                        tokenscope_backend::ClickHouseStore::connect_url(&url)
                            .map_err(|e| e.to_string())?,
                    );
                }
                let s = g.clone().ok_or("no store")?;
                drop(g);
                s.claim(fingerprint, &replica, now_us, settle, hold_us)
                    .map_err(|e| e.to_string())
            }));
    }
    let weak = Arc::downgrade(shared);
    rt.spawn(run(weak, every));
}

async fn run(weak: Weak<Shared>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reader: Option<Box<dyn RecordReader>> = None;
    let mut last_warn: Option<Instant> = None;
    loop {
        tick.tick().await;
        let Some(shared) = weak.upgrade() else {
            break;
        };
        let done = tokio::task::spawn_blocking(move || {
            let r = refresh(&shared, &mut reader);
            (r, reader)
        })
        .await;
        let Ok((result, back)) = done else {
            break;
        };
        reader = back;
        if let Err(e) = result {
            reader = None;
            if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                last_warn = Some(Instant::now());
                tracing::warn!(error = %e, "Fleet: reading the fleet's numbers from the store failed; the last ones stay in use.");
            }
        }
    }
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// One refresh: budgets, then the sampler's P99s.
fn refresh(shared: &Shared, reader: &mut Option<Box<dyn RecordReader>>) -> Result<(), String> {
    if reader.is_none() {
        let target = tokenscope_backend::StoreTarget::parse(&shared.cfg.store);
        *reader = Some(
            tokenscope_backend::open_reader_with(
                &target,
                tokenscope_backend::ReadProfile::Resident,
            )
            .map_err(|e| e.detail())?,
        );
    }
    let Some(r) = reader.as_deref() else {
        return Ok(());
    };
    let now = now_us();
    let lag_us = i64::try_from(shared.cfg.pipeline.flush_interval_ms)
        .unwrap_or(0)
        .saturating_add(1_000)
        .saturating_mul(1_000);
    let as_of = (now - lag_us).div_euclid(1_000_000) * 1_000_000;
    let budgets = &shared.fanout.budgets;
    let prices = PriceTable::new(shared.cfg.prices.clone());
    for start in budgets.fleet_periods(now) {
        if as_of <= start {
            continue;
        }
        let per_line = crate::cost::line_usage(r, start, as_of, &prices)?;
        for line in budgets.lines() {
            let (tokens, usd) = per_line.get(&line).copied().unwrap_or((0, 0.0));
            budgets.set_fleet(
                &line,
                FleetUsage {
                    start_us: start,
                    as_of_us: as_of,
                    tokens,
                    usd,
                },
                now,
            );
        }
    }
    if shared.fanout.alerting.is_on() {
        let th = &shared.cfg.alerts.thresholds;
        let secs = |s: u64| {
            i64::try_from(s)
                .unwrap_or(0)
                .saturating_mul(1_000_000)
                .max(1_000_000)
        };
        let (rate_us, base_us) = (
            secs(th.rate_window_seconds),
            secs(th.token_anomaly_baseline_seconds),
        );
        let tokens =
            |since: i64, until: i64| -> Result<std::collections::BTreeMap<String, u64>, String> {
                let rows = r
                    .usage(&UsageQuery::new(Window::new(since, until), vec![]))
                    .map_err(|e| e.to_string())?;
                let mut out = std::collections::BTreeMap::new();
                for row in rows {
                    *out.entry(shared.metrics.model_label(&row.model))
                        .or_insert(0u64) +=
                        row.sums.input_tokens.saturating_add(row.sums.output_tokens);
                }
                Ok(out)
            };
        shared.fanout.alerting.set_fleet_tokens(FleetTokens {
            window: tokens(as_of - rate_us, as_of)?,
            baseline: tokens(as_of - 2 * base_us, as_of - base_us)?,
        });
    }
    if let Some(t) = &shared.fanout.tracing {
        if t.sampler.config().slow_above_p99 {
            let window_us = i64::try_from(shared.cfg.fleet.p99_window_s)
                .unwrap_or(0)
                .saturating_mul(1_000_000)
                .max(1_000_000);
            let rows = r
                .report(&ReportQuery {
                    since_us: as_of - window_us,
                    until_us: Some(as_of),
                    group_by: vec![Dimension::Model, Dimension::InputBucket],
                    interval: None,
                    filters: vec![(Dimension::Status, "ok".to_owned())],
                })
                .map_err(|e| e.to_string())?;
            let entries: Vec<(String, &'static str, u64, f64)> = rows
                .iter()
                .filter_map(|row| {
                    let model = &row.group.first()?.1;
                    let bucket = InputBucket::parse(&row.group.get(1)?.1)
                        .map_or("unknown", InputBucket::as_str);
                    Some((
                        shared.metrics.model_label(model),
                        bucket,
                        row.e2e.n,
                        row.e2e.p99?,
                    ))
                })
                .collect();
            t.sampler.set_fleet_p99(entries);
        }
    }
    Ok(())
}
