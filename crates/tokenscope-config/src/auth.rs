//! `[admin]` and `[dashboard]`: the admin listener's tokens and write-route limits, and the
//! built-in dashboard. The gateway's `auth` module enforces them per route; this module is
//! their schema and start-up validation.
//!
//! Invariant: a configured token that is empty, only whitespace or not sendable in an
//! `Authorization` header is a configuration error ([`validate`]), so the gateway never runs
//! with a guard that anyone passes or no one does.

use crate::GatewayConfig;
use serde::Deserialize;

/// `[admin]`: access to the admin listener and limits of its write routes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSection {
    /// Token accepted on `POST /v1/traces` besides the admin token (`[dashboard] token`).
    pub ingest_token: Option<String>,
    /// Put `/metrics` behind a token (`metrics_token`, or the admin token).
    pub metrics_auth: bool,
    /// Read-only token for `/metrics` when `metrics_auth = true`.
    pub metrics_token: Option<String>,
    /// Serve the write and ingest routes without a token on a non-loopback admin address.
    pub allow_open_admin: bool,
    /// Size cap of the business-metrics sidecar file; past it `POST /api/business-metrics`
    /// answers 507.
    pub business_metrics_max_bytes: u64,
    /// Values in one `POST /api/business-metrics`; more → 413.
    pub business_metrics_max_points: usize,
    /// Distinct business lines in the sidecar; a value for a new line past it → 429.
    pub business_metrics_max_lines: usize,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            ingest_token: None,
            metrics_auth: false,
            metrics_token: None,
            allow_open_admin: false,
            business_metrics_max_bytes: 64 << 20,
            business_metrics_max_points: 10_000,
            business_metrics_max_lines: 1_000,
        }
    }
}

/// `[dashboard]`: the built-in dashboard.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DashboardSection {
    /// Serve the dashboard and its API at `/` of the admin listener.
    pub enabled: bool,
    /// The admin token: required by the dashboard API, `/api/requests*`, the write routes and
    /// (unless `[admin] ingest_token` is given) `/v1/traces` (none = open; the admin listener
    /// is on localhost by default). See the gateway's `auth` module.
    pub token: Option<String>,
    /// Link template for a kept trace, e.g. `http://jaeger:16686/trace/{trace_id}`.
    pub trace_url: Option<String>,
    /// Auto-refresh period of the pages, seconds (0 = off).
    pub refresh_seconds: u64,
}

impl Default for DashboardSection {
    fn default() -> Self {
        Self {
            enabled: true,
            token: None,
            trace_url: None,
            refresh_seconds: 10,
        }
    }
}

/// Why a configured token or limit is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthConfigError {
    /// A token that is empty or whitespace.
    #[error("{0} is empty: set a token or remove the key (an empty token would guard nothing)")]
    EmptyToken(&'static str),
    /// A token with characters a header cannot carry.
    #[error("{0} must be visible ASCII without spaces (it is sent in an Authorization header)")]
    BadToken(&'static str),
    /// `metrics_auth = true` with no token to check.
    #[error("[admin] metrics_auth = true needs [admin] metrics_token or [dashboard] token")]
    MetricsAuthWithoutToken,
    /// A zero limit.
    #[error("[admin] {0} must be > 0")]
    ZeroLimit(&'static str),
}

/// Checks the `[dashboard] token` and `[admin]` settings (called by `GatewayConfig::validate`).
pub fn validate(cfg: &GatewayConfig) -> Result<(), AuthConfigError> {
    for (key, token) in [
        ("[dashboard] token", cfg.dashboard.token.as_deref()),
        ("[admin] ingest_token", cfg.admin.ingest_token.as_deref()),
        ("[admin] metrics_token", cfg.admin.metrics_token.as_deref()),
    ] {
        if let Some(t) = token {
            if t.trim().is_empty() {
                return Err(AuthConfigError::EmptyToken(key));
            }
            if !t.trim().bytes().all(|b| b.is_ascii_graphic()) {
                return Err(AuthConfigError::BadToken(key));
            }
        }
    }
    if cfg.admin.metrics_auth && cfg.admin.metrics_token.is_none() && cfg.dashboard.token.is_none()
    {
        return Err(AuthConfigError::MetricsAuthWithoutToken);
    }
    for (key, v) in [
        (
            "business_metrics_max_bytes",
            usize::from(cfg.admin.business_metrics_max_bytes > 0),
        ),
        (
            "business_metrics_max_points",
            cfg.admin.business_metrics_max_points,
        ),
        (
            "business_metrics_max_lines",
            cfg.admin.business_metrics_max_lines,
        ),
    ] {
        if v == 0 {
            return Err(AuthConfigError::ZeroLimit(key));
        }
    }
    Ok(())
}
