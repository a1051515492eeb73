//! `[alerts]`: the gateway's own alert evaluation and its webhook (the evaluator lives in the
//! gateway's `alerting` module; this is its configuration and validation).
//!
//! Invariant: [`AlertsSection::settings`] is the one place the section's values are checked
//! and turned into durations and a URI; `validate` and the gateway's start-up both use it.

use crate::{ConfigError, DurationSetting};
use serde::Deserialize;
use std::time::Duration;
use tokenscope_analysis::alerts::AlertThresholds;
use tokenscope_core::redact_url;

/// `[alerts]`: the gateway evaluates the alert conditions itself and POSTs to a webhook.
/// Off unless `webhook_url` is set. Thresholds (also used by `tokenscope export
/// prometheus-rules --config`) are in `[alerts.thresholds]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsSection {
    /// `http[s]://HOST:PORT/api/v2/alerts` (Alertmanager) or any receiver of that format.
    pub webhook_url: Option<String>,
    /// `https://` webhooks: a PEM CA bundle trusted beside the system's roots.
    pub webhook_ca_file: Option<String>,
    /// A PEM client certificate for a webhook that asks for one (mutual TLS).
    pub webhook_client_cert: Option<String>,
    /// The PEM key of `webhook_client_cert`.
    pub webhook_client_key: Option<String>,
    /// How often the conditions are evaluated (default `15s`).
    pub evaluation_interval: DurationSetting,
    /// Time allowed for one POST (default `5s`).
    pub webhook_timeout: DurationSetting,
    /// Re-send firing alerts this often (default: never; one POST per incident).
    pub repeat_interval: Option<DurationSetting>,
    /// Finished requests buffered between two evaluations (default 100000).
    pub buffer: usize,
    /// Requests kept in the evaluation window at most (default 200000).
    pub max_samples: usize,
    /// `generatorURL` of the alerts (default `http://ADMIN_LISTEN/metrics`).
    pub generator_url: Option<String>,
    /// Thresholds and `for:` windows.
    pub thresholds: AlertThresholds,
}

impl Default for AlertsSection {
    fn default() -> Self {
        Self {
            webhook_url: None,
            webhook_ca_file: None,
            webhook_client_cert: None,
            webhook_client_key: None,
            evaluation_interval: DurationSetting::Text("15s".into()),
            webhook_timeout: DurationSetting::Text("5s".into()),
            repeat_interval: None,
            buffer: 100_000,
            max_samples: 200_000,
            generator_url: None,
            thresholds: AlertThresholds::default(),
        }
    }
}

/// The checked settings of an enabled `[alerts]` section.
#[derive(Debug, Clone)]
pub struct AlertSettings {
    /// The webhook.
    pub url: http::Uri,
    /// Evaluation period.
    pub interval: Duration,
    /// Time allowed for one POST.
    pub timeout: Duration,
    /// Re-send period of firing alerts.
    pub repeat: Option<Duration>,
    /// `webhook_ca_file` (`https://` webhooks).
    pub ca_file: Option<String>,
    /// `webhook_client_cert`.
    pub client_cert: Option<String>,
    /// `webhook_client_key`.
    pub client_key: Option<String>,
}

impl AlertsSection {
    /// The checked settings; `None` when alerting is off (no `webhook_url`).
    pub fn settings(&self) -> Result<Option<AlertSettings>, ConfigError> {
        let invalid = |m: String| ConfigError::Invalid(format!("alerts: {m}"));
        self.thresholds
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let interval = self.evaluation_interval.get().map_err(invalid)?;
        let timeout = self.webhook_timeout.get().map_err(invalid)?;
        let repeat = match &self.repeat_interval {
            Some(r) => Some(r.get().map_err(invalid)?),
            None => None,
        };
        if interval.is_zero() || timeout.is_zero() || repeat.is_some_and(|r| r.is_zero()) {
            return Err(invalid(
                "evaluation_interval, webhook_timeout and repeat_interval must be > 0".into(),
            ));
        }
        if self.buffer == 0 || self.max_samples == 0 {
            return Err(invalid("buffer and max_samples must be > 0".into()));
        }
        let Some(url) = self.webhook_url.as_deref() else {
            return Ok(None);
        };
        let uri: http::Uri = url
            .parse()
            .map_err(|e| invalid(format!("webhook_url {:?}: {e}", redact_url(url))))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(invalid(format!(
                "webhook_url {:?}: only http[s]://HOST[:PORT]/PATH is supported",
                redact_url(url)
            )));
        }
        crate::check_pair(
            "alerts (webhook_client_cert / webhook_client_key)",
            self.webhook_client_cert.as_deref(),
            self.webhook_client_key.as_deref(),
        )?;
        Ok(Some(AlertSettings {
            url: uri,
            interval,
            timeout,
            repeat,
            ca_file: self.webhook_ca_file.clone(),
            client_cert: self.webhook_client_cert.clone(),
            client_key: self.webhook_client_key.clone(),
        }))
    }

    /// Checks the section (called by `GatewayConfig::validate`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.settings().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alerts_section_validation() {
        let s = AlertsSection::default();
        assert!(s.settings().expect("valid").is_none());
        let s = AlertsSection {
            webhook_url: Some("ftp://am:9093/api/v2/alerts".into()),
            ..AlertsSection::default()
        };
        assert!(s.validate().is_err());
        let s = AlertsSection {
            webhook_url: Some("https://am:9093/api/v2/alerts".into()),
            webhook_ca_file: Some("/ca.pem".into()),
            ..AlertsSection::default()
        };
        let set = s.settings().expect("https").expect("on");
        assert_eq!(set.ca_file.as_deref(), Some("/ca.pem"));
        let s = AlertsSection {
            webhook_url: Some("https://am:9093/api/v2/alerts".into()),
            webhook_client_key: Some("/k.pem".into()),
            ..AlertsSection::default()
        };
        assert!(s.validate().is_err(), "a key without its certificate");
        let s = AlertsSection {
            webhook_url: Some("http://am:9093/api/v2/alerts".into()),
            evaluation_interval: DurationSetting::Text("0s".into()),
            ..AlertsSection::default()
        };
        assert!(s.validate().is_err());
        let s = AlertsSection {
            webhook_url: Some("http://am:9093/api/v2/alerts".into()),
            evaluation_interval: DurationSetting::Millis(200),
            ..AlertsSection::default()
        };
        let set = s.settings().expect("valid").expect("on");
        assert_eq!(set.interval, Duration::from_millis(200));
    }

    #[test]
    fn alerts_section_from_file_and_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("gw.toml");
        std::fs::write(
            &path,
            "[alerts]\nrepeat_interval = \"1m\"\n[alerts.thresholds]\nsuccess_ratio_min = 0.995\n",
        )
        .expect("write");
        let env = [
            (
                "TOKENSCOPE_ALERTS__WEBHOOK_URL".to_owned(),
                "http://127.0.0.1:9093/api/v2/alerts".to_owned(),
            ),
            (
                "TOKENSCOPE_ALERTS__EVALUATION_INTERVAL".to_owned(),
                "500".to_owned(),
            ),
        ];
        let cfg = crate::GatewayConfig::load_with_env(Some(&path), env).expect("config");
        let set = cfg.alerts.settings().expect("valid").expect("on");
        assert_eq!(set.interval, Duration::from_millis(500));
        assert_eq!(set.repeat, Some(Duration::from_secs(60)));
        assert_eq!(cfg.alerts.thresholds.success_ratio_min, 0.995);
        assert_eq!(cfg.alerts.thresholds.ttft_p99_seconds, 2.0);
        std::fs::write(&path, "[alerts.thresholds]\nsuccess_ratio_min = -1.0\n").expect("write");
        assert!(crate::GatewayConfig::load_with_env(Some(&path), []).is_err());
    }
}
