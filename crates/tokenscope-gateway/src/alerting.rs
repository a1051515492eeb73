//! The gateway's own alerting (embedded setup, no Prometheus needed): `[alerts]` with a
//! `webhook_url` turns it on. Finished requests are summarised into a bounded in-memory
//! buffer; a background task evaluates the same conditions as the exported Prometheus rules
//! (`tokenscope_analysis::alerts`) every `evaluation_interval` and POSTs new and resolved
//! incidents to the webhook in Alertmanager's v2 API format (`POST /api/v2/alerts`, a JSON
//! array of `{labels, annotations, startsAt, endsAt?, generatorURL}`).
//!
//! Invariants:
//! * The request path never waits: [`Alerting::push`] is one short mutex section that appends
//!   to a bounded `VecDeque` (full → the sample is dropped and counted in
//!   `tokenscope_alert_samples_dropped_total`). Evaluation and HTTP happen on the task.
//! * One incident (alert name + labels) is one firing notification and one resolved
//!   notification (the evaluator's de-duplication); with `repeat_interval` set the firing alert
//!   is re-sent that often (Alertmanager de-duplicates it; set it below Alertmanager's
//!   `resolve_timeout`, 5 m by default, when the receiver is a real Alertmanager, which
//!   otherwise resolves an alert it has not heard of for that long).
//! * A failed POST keeps its notifications (at most [`OUTBOX_MAX`], oldest dropped) and sends
//!   them again with the next evaluation's; `tokenscope_alert_notifications_total{state}`
//!   counts notifications the webhook accepted (2xx), `tokenscope_alert_webhook_errors_total`
//!   failed POSTs.
//! * The task ends when the gateway's shared state is dropped (shutdown).
//! * A fleet (`[fleet]`, several gateways on one ClickHouse): before a firing notification is
//!   sent, its incident (the alert's labels) is claimed in the store
//!   (`ClickHouseStore::claim`): the replica with the earliest claim within the hold sends
//!   it, the others drop it and its resolved notification — one incident, one alert. When the
//!   claim cannot be made (the store is down), the replica sends: an alert may then come
//!   twice, never not at all. Claims run on blocking threads, concurrently, never on the
//!   request path.
//! * An `https://` webhook is trusted through the system's roots plus `webhook_ca_file`, with
//!   `webhook_client_cert` / `webhook_client_key` for mutual TLS; a bad file refuses the start.

use crate::config::ConfigError;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{SystemTime, UNIX_EPOCH};
use tokenscope_analysis::alerts::{
    AlertEvaluator, AlertSample, EvaluatorOptions, FleetTokens, Notification, NotificationState,
};
use tokenscope_core::RequestRecord;

/// Notifications kept for a retry at most (the oldest go first).
pub const OUTBOX_MAX: usize = 1000;

/// `[alerts]` and its checked settings live in the config crate.
pub use tokenscope_config::{AlertSettings, AlertsSection};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone)]
struct AlertMetrics {
    notifications: Family<StateLabels, Counter>,
    webhook_errors: Counter,
    samples_dropped: Counter,
}

/// Reads the budget usage ratio of a business line (the `llm_budget_usage_ratio` value).
type BudgetRatio = Box<dyn Fn(&str) -> f64 + Send + Sync>;

struct Feed {
    buf: Mutex<VecDeque<AlertSample>>,
    cap: usize,
    dropped: Counter,
    /// The tracked business lines and their ratio, set once the budgets exist.
    budgets: std::sync::OnceLock<(Vec<String>, BudgetRatio)>,
    /// Reads the gateway's own health (lost records, store up), set once the metrics exist.
    health: std::sync::OnceLock<HealthFn>,
    /// The fleet's claims, set when `[fleet]` is on with a store that can hold them.
    claims: std::sync::OnceLock<ClaimFn>,
    /// The fleet's token sums (`[fleet]` refresh) and when they were read.
    fleet_tokens: Mutex<Option<(std::time::Instant, FleetTokens)>>,
}

/// Fleet token sums older than this are not used (the store has not been read for that long:
/// the token anomaly falls back to this replica's own requests).
const FLEET_TOKENS_STALE: std::time::Duration = std::time::Duration::from_secs(60);

type HealthFn = Box<dyn Fn() -> tokenscope_analysis::alerts::SelfHealth + Send + Sync>;

/// Claims an alert incident for this replica among a fleet's gateways (see the module docs):
/// `Ok(true)` send it, `Ok(false)` another replica does, `Err` could not ask (send).
pub(crate) type ClaimFn = Arc<dyn Fn(&str, i64) -> Result<bool, String> + Send + Sync>;

/// The incident key of a notification: its labels, `name="value"` joined by `,`.
fn fingerprint(n: &Notification) -> String {
    n.alert
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={v:?}"))
        .collect::<Vec<_>>()
        .join(",")
}

impl Feed {
    fn budget_usage(&self) -> Vec<(String, f64)> {
        self.budgets
            .get()
            .map(|(lines, ratio)| lines.iter().map(|l| (l.clone(), ratio(l))).collect())
            .unwrap_or_default()
    }
}

/// The request path's side: the bounded buffer (or nothing when alerting is off).
pub(crate) struct Alerting {
    feed: Option<Arc<Feed>>,
}

impl Alerting {
    /// Appends the summary of a finished request; `model_label` gives the bounded model
    /// label (only called when alerting is on). Never blocks beyond one short mutex section.
    pub(crate) fn push(&self, rec: &RequestRecord, model_label: impl FnOnce() -> String) {
        let Some(feed) = &self.feed else {
            return;
        };
        let mut s = AlertSample::from_record(rec, now_us());
        s.model = model_label();
        let mut buf = feed.buf.lock();
        if buf.len() >= feed.cap {
            drop(buf);
            feed.dropped.inc();
            return;
        }
        buf.push_back(s);
    }

    /// Lets the evaluator read the gateway's own health (once; later calls are ignored).
    pub(crate) fn set_health(
        &self,
        health: impl Fn() -> tokenscope_analysis::alerts::SelfHealth + Send + Sync + 'static,
    ) {
        if let Some(feed) = &self.feed {
            let _ = feed.health.set(Box::new(health));
        }
    }

    /// Claims every firing incident among the fleet before it is sent (once; later calls
    /// are ignored).
    pub(crate) fn set_claims(&self, claims: ClaimFn) {
        if let Some(feed) = &self.feed {
            let _ = feed.claims.set(claims);
        }
    }

    /// Whether alerting is on (a webhook is configured).
    pub(crate) fn is_on(&self) -> bool {
        self.feed.is_some()
    }

    /// The fleet's latest token sums (from the `[fleet]` refresh), used by the token anomaly
    /// until they are [`FLEET_TOKENS_STALE`].
    pub(crate) fn set_fleet_tokens(&self, tokens: FleetTokens) {
        if let Some(feed) = &self.feed {
            *feed.fleet_tokens.lock() = Some((std::time::Instant::now(), tokens));
        }
    }

    /// Lets the evaluator read the budget usage of `lines` (once; later calls are ignored).
    pub(crate) fn set_budgets(
        &self,
        lines: Vec<String>,
        ratio: impl Fn(&str) -> f64 + Send + Sync + 'static,
    ) {
        if let Some(feed) = &self.feed {
            let mut lines = lines;
            lines.sort();
            lines.dedup();
            let _ = feed.budgets.set((lines, Box::new(ratio)));
        }
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// RFC 3339 with milliseconds, as Alertmanager writes it (times before 1970 read as 1970).
fn rfc3339(us: i64) -> String {
    tokenscope_core::time::format_rfc3339_millis(us.max(0))
}

/// The Alertmanager v2 body for `notes`.
pub fn alertmanager_body(notes: &VecDeque<Notification>, generator_url: &str) -> String {
    let alerts: Vec<serde_json::Value> = notes
        .iter()
        .map(|n| {
            let mut v = serde_json::json!({
                "labels": n.alert.labels,
                "annotations": n.alert.annotations,
                "startsAt": rfc3339(n.alert.starts_at_us),
                "generatorURL": generator_url,
            });
            if let (Some(end), Some(obj)) = (n.alert.ends_at_us, v.as_object_mut()) {
                obj.insert("endsAt".into(), serde_json::Value::String(rfc3339(end)));
            }
            v
        })
        .collect();
    serde_json::Value::Array(alerts).to_string()
}

/// Registers the alert metrics and, when `[alerts] webhook_url` is set, starts the
/// evaluation task (must run inside a tokio runtime).
pub(crate) fn start(
    section: &AlertsSection,
    admin_listen: &str,
    registry: &mut Registry,
) -> Result<Alerting, ConfigError> {
    let Some(settings) = section.settings()? else {
        return Ok(Alerting { feed: None });
    };
    let tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions::from_paths(
        settings.ca_file.as_deref(),
        settings.client_cert.as_deref(),
        settings.client_key.as_deref(),
    ))
    .map_err(|e| ConfigError::Invalid(format!("alerts (webhook TLS): {e}")))?;
    let metrics = AlertMetrics {
        notifications: Family::default(),
        webhook_errors: Counter::default(),
        samples_dropped: Counter::default(),
    };
    registry.register(
        "tokenscope_alert_notifications",
        "Alert notifications accepted by the webhook, by state (firing, resolved)",
        metrics.notifications.clone(),
    );
    registry.register(
        "tokenscope_alert_webhook_errors",
        "Failed alert webhook POSTs (their notifications are sent again with the next evaluation)",
        metrics.webhook_errors.clone(),
    );
    registry.register(
        "tokenscope_alert_samples_dropped",
        "Finished requests left out of alert evaluation because the alert buffer was full",
        metrics.samples_dropped.clone(),
    );
    for state in ["firing", "resolved"] {
        let _ = metrics.notifications.get_or_create(&StateLabels { state });
    }
    let feed = Arc::new(Feed {
        buf: Mutex::new(VecDeque::new()),
        cap: section.buffer,
        dropped: metrics.samples_dropped.clone(),
        budgets: std::sync::OnceLock::new(),
        health: std::sync::OnceLock::new(),
        claims: std::sync::OnceLock::new(),
        fleet_tokens: Mutex::new(None),
    });
    let evaluator = AlertEvaluator::new(
        section.thresholds.clone(),
        EvaluatorOptions {
            repeat_interval_us: settings
                .repeat
                .map(|r| i64::try_from(r.as_micros()).unwrap_or(i64::MAX)),
            max_samples: section.max_samples,
        },
    );
    let generator = section
        .generator_url
        .clone()
        .unwrap_or_else(|| format!("http://{admin_listen}/metrics"));
    tracing::info!(webhook = %crate::redact_url(&settings.url.to_string()), interval = ?settings.interval, "Alerting on.");
    tokio::spawn(run(
        Arc::downgrade(&feed),
        evaluator,
        settings,
        tls,
        generator,
        metrics,
    ));
    Ok(Alerting { feed: Some(feed) })
}

async fn run(
    feed: Weak<Feed>,
    mut evaluator: AlertEvaluator,
    settings: AlertSettings,
    tls: tokenscope_net::ClientTls,
    generator: String,
    metrics: AlertMetrics,
) {
    let client: Client<tokenscope_net::HttpsConnect, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(tokenscope_net::connector(
            &tls,
            tokenscope_net::ConnectOptions {
                timeout: Some(settings.timeout),
                versions: tokenscope_net::Versions::Any,
                ..tokenscope_net::ConnectOptions::default()
            },
        ));
    let mut outbox: VecDeque<Notification> = VecDeque::new();
    // Incidents another replica of the fleet notifies (their resolved notification is its).
    let mut quiet: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    evaluator.start_at(now_us());
    loop {
        tick.tick().await;
        let Some(f) = feed.upgrade() else {
            break;
        };
        let drained = std::mem::take(&mut *f.buf.lock());
        let budget = f.budget_usage();
        let health = f.health.get().map(|h| h());
        let claims = f.claims.get().cloned();
        let fleet_tokens = f
            .fleet_tokens
            .lock()
            .as_ref()
            .filter(|(at, _)| at.elapsed() < FLEET_TOKENS_STALE)
            .map(|(_, t)| t.clone());
        drop(f);
        evaluator.set_fleet_tokens(fleet_tokens);
        for s in drained {
            evaluator.push(s);
        }
        let fresh = evaluator.evaluate_with_health(now_us(), &budget, health.as_ref());
        match claims {
            Some(c) => outbox.extend(claimed(fresh, &c, &mut quiet).await),
            None => outbox.extend(fresh),
        }
        while outbox.len() > OUTBOX_MAX {
            outbox.pop_front();
        }
        if outbox.is_empty() {
            continue;
        }
        let body = alertmanager_body(&outbox, &generator);
        match post(&client, &settings, body).await {
            Ok(()) => {
                for n in outbox.drain(..) {
                    let state = match n.state {
                        NotificationState::Firing => "firing",
                        NotificationState::Resolved => "resolved",
                    };
                    metrics
                        .notifications
                        .get_or_create(&StateLabels { state })
                        .inc();
                }
            }
            Err(e) => {
                metrics.webhook_errors.inc();
                tracing::warn!(
                    webhook = %settings.url,
                    pending = outbox.len(),
                    "Alert webhook failed ({e}); retrying with the next evaluation."
                );
            }
        }
    }
}

/// The notifications of one evaluation this replica sends (see the module docs): firing ones
/// it won the claim of (or could not claim), resolved ones of incidents it did not lose.
async fn claimed(
    fresh: Vec<Notification>,
    claims: &ClaimFn,
    quiet: &mut std::collections::HashSet<String>,
) -> Vec<Notification> {
    let now = now_us();
    let mut pending = Vec::with_capacity(fresh.len());
    for n in fresh {
        let fp = fingerprint(&n);
        match n.state {
            NotificationState::Firing => {
                let c = claims.clone();
                let key = fp.clone();
                let ask = tokio::task::spawn_blocking(move || c(&key, now));
                pending.push((n, fp, Some(ask)));
            }
            NotificationState::Resolved => pending.push((n, fp, None)),
        }
    }
    let mut out = Vec::with_capacity(pending.len());
    for (n, fp, ask) in pending {
        match ask {
            Some(ask) => match ask.await {
                Ok(Ok(true)) => {
                    quiet.remove(&fp);
                    out.push(n);
                }
                Ok(Ok(false)) => {
                    tracing::info!(incident = %fp, "Alert sent by another gateway of the fleet.");
                    quiet.insert(fp);
                }
                Ok(Err(e)) => {
                    tracing::warn!(incident = %fp, "Alert claim failed ({e}); sending it here.");
                    out.push(n);
                }
                Err(_) => out.push(n),
            },
            None => {
                if !quiet.remove(&fp) {
                    out.push(n);
                }
            }
        }
    }
    out
}

async fn post(
    client: &Client<tokenscope_net::HttpsConnect, Full<Bytes>>,
    settings: &AlertSettings,
    body: String,
) -> Result<(), String> {
    let req = http::Request::post(settings.url.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let send = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| tokenscope_net::error_chain(&e))?;
        let status = resp.status();
        // Read the body so the connection can be reused.
        let _ = resp.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    };
    tokio::time::timeout(settings.timeout, send)
        .await
        .map_err(|_| format!("no answer within {:?}", settings.timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_analysis::alerts::AlertInstance;

    #[test]
    fn alerts_alertmanager_body() {
        let alert = AlertInstance {
            labels: [("alertname", "LLMSuccessRateLow"), ("severity", "P0")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            annotations: [("summary".to_owned(), "s".to_owned())].into(),
            starts_at_us: 1_700_000_000_000_000,
            ends_at_us: None,
            value: 0.5,
        };
        let mut resolved = alert.clone();
        resolved.ends_at_us = Some(1_700_000_060_000_000);
        let notes: VecDeque<_> = [
            Notification {
                state: NotificationState::Firing,
                alert,
            },
            Notification {
                state: NotificationState::Resolved,
                alert: resolved,
            },
        ]
        .into();
        let v: serde_json::Value =
            serde_json::from_str(&alertmanager_body(&notes, "http://g/metrics")).expect("json");
        assert_eq!(v[0]["labels"]["alertname"], "LLMSuccessRateLow");
        assert_eq!(v[0]["startsAt"], "2023-11-14T22:13:20.000Z");
        assert!(v[0].get("endsAt").is_none());
        assert_eq!(v[1]["endsAt"], "2023-11-14T22:14:20.000Z");
        assert_eq!(v[1]["generatorURL"], "http://g/metrics");
    }
}
