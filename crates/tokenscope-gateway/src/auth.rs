//! Who may call what on the admin listener.
//!
//! Every admin route belongs to one [`Access`] class:
//!
//! | class | routes | needs |
//! |---|---|---|
//! | open | `GET /healthz`, the dashboard's page and assets (they hold no data) | nothing |
//! | [`Access::Metrics`] | `GET /metrics` | nothing, unless `[admin] metrics_auth = true`: then `[admin] metrics_token` or the admin token |
//! | [`Access::Read`] | `GET /api/dashboard/*`, `GET /api/requests*` | the admin token, when one is set |
//! | [`Access::Write`] | `POST /api/flush`, `POST /api/business-metrics` | the admin token, when one is set |
//! | [`Access::Ingest`] | `POST /v1/traces` (engine spans, OTLP/HTTP) | `[admin] ingest_token` or the admin token, when either is set |
//!
//! The admin token is `[dashboard] token` (its historical name; it guards more than the
//! dashboard). The ingest token is a lesser secret for the engines' OTLP exporters
//! (`OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer …`): it can join phases to records, not
//! flush, write business metrics or read records. The metrics token is a read-only secret for
//! Prometheus (`authorization: {credentials: …}`).
//!
//! Invariants:
//! * A token is sent as `Authorization: <scheme> <token>` with the scheme `Bearer` in any case
//!   (RFC 9110: schemes are case-insensitive); the token is compared in constant time (only its
//!   length can be timed), never logged, never echoed in an answer.
//! * A configured token that is empty or only whitespace is a configuration error: the gateway
//!   refuses to start rather than run with a guard that anyone passes or no one does.
//! * A refused call is answered 401 with `WWW-Authenticate: Bearer` and a JSON error naming the
//!   class and the setting that holds its token.
//! * Without an admin token on a non-loopback admin address, start-up logs one WARN naming
//!   what is open, and the write and ingest classes answer 403 (a JSON error naming
//!   `allow_open_admin`) unless `[admin] allow_open_admin = true`; ingest with an
//!   `ingest_token` is guarded, so it keeps working.

use crate::GatewayConfig;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use std::net::SocketAddr;

/// The `[admin]` / `[dashboard]` settings and their start-up validation live in the config
/// crate.
pub use tokenscope_config::auth::{validate, AdminSection, AuthConfigError};

/// The classes of admin routes (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `/metrics`.
    Metrics,
    /// Dashboard API, `/api/requests*`.
    Read,
    /// State-changing routes.
    Write,
    /// Engine data (`/v1/traces`).
    Ingest,
}

impl Access {
    fn as_str(self) -> &'static str {
        match self {
            Access::Metrics => "metrics",
            Access::Read => "read",
            Access::Write => "write",
            Access::Ingest => "ingest",
        }
    }
}

/// The token of an `Authorization` header value: scheme `Bearer` in any case, then the token
/// (surrounding whitespace ignored). `None` for another scheme or an empty token.
pub fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim();
    let (scheme, rest) = value.split_once([' ', '\t'])?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    Some(rest.trim()).filter(|t| !t.is_empty())
}

/// Equal bytes, in time that depends on the lengths only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What the check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Go on.
    Allowed,
    /// No or a wrong token (401).
    Unauthorized,
    /// Open admin on an exposed address refuses this class (403).
    RefusedOpen,
}

/// Whether the admin listener is reachable from elsewhere than this host.
fn exposed(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .map_or(true, |a| !a.ip().is_loopback())
}

/// The tokens that open `access` (empty: the class is open).
fn tokens(cfg: &GatewayConfig, access: Access) -> Vec<&str> {
    let admin = cfg.dashboard.token.as_deref().map(str::trim);
    let list = match access {
        Access::Read | Access::Write => vec![admin],
        Access::Ingest => vec![cfg.admin.ingest_token.as_deref().map(str::trim), admin],
        Access::Metrics if cfg.admin.metrics_auth => {
            vec![cfg.admin.metrics_token.as_deref().map(str::trim), admin]
        }
        Access::Metrics => vec![],
    };
    list.into_iter().flatten().collect()
}

/// Decides a call of class `access` with `headers`.
pub fn decide(cfg: &GatewayConfig, access: Access, headers: &HeaderMap) -> Decision {
    let wanted = tokens(cfg, access);
    if wanted.is_empty() {
        let refuse = matches!(access, Access::Write | Access::Ingest)
            && !cfg.admin.allow_open_admin
            && exposed(&cfg.admin_listen);
        return if refuse {
            Decision::RefusedOpen
        } else {
            Decision::Allowed
        };
    }
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
    else {
        return Decision::Unauthorized;
    };
    // Every configured token is compared (no early exit on the first match).
    let ok = wanted.iter().fold(false, |acc, t| {
        acc | constant_time_eq(given.as_bytes(), t.as_bytes())
    });
    if ok {
        Decision::Allowed
    } else {
        Decision::Unauthorized
    }
}

/// The answer to a refused call, `None` when allowed.
pub(crate) fn check(cfg: &GatewayConfig, access: Access, headers: &HeaderMap) -> Option<Response> {
    match decide(cfg, access, headers) {
        Decision::Allowed => None,
        Decision::Unauthorized => {
            let holder = match access {
                Access::Read | Access::Write => "[dashboard] token",
                Access::Ingest => "[admin] ingest_token or [dashboard] token",
                Access::Metrics => "[admin] metrics_token or [dashboard] token",
            };
            let mut r = crate::failure::error_response(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                &format!(
                    "{} access needs Authorization: Bearer <{holder}>",
                    access.as_str()
                ),
            );
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            Some(r)
        }
        Decision::RefusedOpen => Some(crate::failure::error_response(
            StatusCode::FORBIDDEN,
            "open_admin_refused",
            &format!(
                "{} access is refused: the admin listener is not on loopback and has no token; set [dashboard] token (or [admin] allow_open_admin = true)",
                access.as_str()
            ),
        )),
    }
}

/// An axum middleware guarding every route of its router with `access`.
pub(crate) async fn guard(
    axum::extract::State((shared, access)): axum::extract::State<(
        std::sync::Arc<crate::shared::Shared>,
        Access,
    )>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match check(&shared.cfg, access, req.headers()) {
        Some(refused) => refused,
        None => next.run(req).await,
    }
}

/// The start-up warning for an admin listener reachable from other hosts without a token
/// (`None` when there is nothing to warn about). Names what is open; never a token.
pub fn open_admin_warning(cfg: &GatewayConfig, bound: SocketAddr) -> Option<String> {
    if bound.ip().is_loopback() || cfg.dashboard.token.is_some() {
        return None;
    }
    let mut open = vec!["/api/requests* and /api/dashboard/* (recorded requests)"];
    if !cfg.admin.metrics_auth {
        open.push("/metrics");
    }
    let (writes, verb) = if cfg.admin.allow_open_admin {
        (
            "/api/flush, /api/business-metrics",
            "open (allow_open_admin = true)",
        )
    } else {
        ("/api/flush, /api/business-metrics", "refused with 403")
    };
    let ingest = if cfg.admin.ingest_token.is_some() {
        "/v1/traces guarded by [admin] ingest_token".to_owned()
    } else if cfg.admin.allow_open_admin {
        "/v1/traces open (allow_open_admin = true): anyone can rewrite recorded phases".to_owned()
    } else {
        "/v1/traces refused with 403".to_owned()
    };
    Some(format!(
        "ADMIN LISTENER EXPOSED WITHOUT A TOKEN: {bound} is not a loopback address and [dashboard] token is not set. Open to anyone who can reach it: {}. Writes ({writes}) {verb}; {ingest}. Set [dashboard] token (TOKENSCOPE_DASHBOARD__TOKEN) or bind admin_listen to 127.0.0.1.",
        open.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, auth.parse().expect("header"));
        h
    }

    fn cfg(token: Option<&str>, ingest: Option<&str>, listen: &str) -> GatewayConfig {
        let mut c = GatewayConfig::default();
        c.dashboard.token = token.map(str::to_owned);
        c.admin.ingest_token = ingest.map(str::to_owned);
        c.admin_listen = listen.to_owned();
        c
    }

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc"), Some("abc"));
        assert_eq!(bearer_token("BEARER   abc  "), Some("abc"));
        assert_eq!(bearer_token("Bearer\tabc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert_eq!(bearer_token("Bearerabc"), None);
    }

    #[test]
    fn constant_time_eq_compares_whole_tokens() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn classes_and_tokens() {
        let c = cfg(
            Some("admin-secret"),
            Some("ingest-secret"),
            "127.0.0.1:9464",
        );
        let none = HeaderMap::new();
        let admin = headers("bearer admin-secret");
        let ingest = headers("Bearer ingest-secret");
        for access in [Access::Read, Access::Write, Access::Ingest] {
            assert_eq!(decide(&c, access, &none), Decision::Unauthorized);
            assert_eq!(decide(&c, access, &admin), Decision::Allowed);
        }
        assert_eq!(decide(&c, Access::Ingest, &ingest), Decision::Allowed);
        assert_eq!(decide(&c, Access::Write, &ingest), Decision::Unauthorized);
        assert_eq!(decide(&c, Access::Read, &ingest), Decision::Unauthorized);
        assert_eq!(
            decide(&c, Access::Write, &headers("Bearer admin-secreT")),
            Decision::Unauthorized
        );
        // /metrics is open unless metrics_auth.
        assert_eq!(decide(&c, Access::Metrics, &none), Decision::Allowed);
        let mut m = c.clone();
        m.admin.metrics_auth = true;
        m.admin.metrics_token = Some("prom".into());
        assert_eq!(decide(&m, Access::Metrics, &none), Decision::Unauthorized);
        assert_eq!(
            decide(&m, Access::Metrics, &headers("Bearer prom")),
            Decision::Allowed
        );
        assert_eq!(decide(&m, Access::Metrics, &admin), Decision::Allowed);
        assert_eq!(
            decide(&m, Access::Write, &headers("Bearer prom")),
            Decision::Unauthorized
        );
    }

    #[test]
    fn open_admin_on_an_exposed_address_refuses_writes_and_ingest() {
        let none = HeaderMap::new();
        let local = cfg(None, None, "127.0.0.1:9464");
        for access in [Access::Read, Access::Write, Access::Ingest, Access::Metrics] {
            assert_eq!(decide(&local, access, &none), Decision::Allowed);
        }
        let exposed = cfg(None, None, "0.0.0.0:9464");
        assert_eq!(decide(&exposed, Access::Read, &none), Decision::Allowed);
        assert_eq!(
            decide(&exposed, Access::Write, &none),
            Decision::RefusedOpen
        );
        assert_eq!(
            decide(&exposed, Access::Ingest, &none),
            Decision::RefusedOpen
        );
        let mut allowed = exposed.clone();
        allowed.admin.allow_open_admin = true;
        assert_eq!(decide(&allowed, Access::Write, &none), Decision::Allowed);
        let guarded_ingest = cfg(None, Some("i"), "0.0.0.0:9464");
        assert_eq!(
            decide(&guarded_ingest, Access::Ingest, &headers("Bearer i")),
            Decision::Allowed
        );
        let bound: SocketAddr = "0.0.0.0:9464".parse().expect("addr");
        let w = open_admin_warning(&exposed, bound).expect("warning");
        assert!(
            w.contains("EXPOSED") && w.contains("/metrics") && w.contains("403"),
            "{w}"
        );
        assert!(open_admin_warning(&local, "127.0.0.1:1".parse().expect("addr")).is_none());
        let tokened = cfg(Some("t"), None, "0.0.0.0:9464");
        assert!(open_admin_warning(&tokened, bound).is_none());
    }

    #[test]
    fn numeric_tokens_from_the_environment_stay_text() {
        let env = vec![
            (
                "TOKENSCOPE_DASHBOARD__TOKEN".to_owned(),
                "123456".to_owned(),
            ),
            (
                "TOKENSCOPE_ADMIN__INGEST_TOKEN".to_owned(),
                "1.50".to_owned(),
            ),
            (
                "TOKENSCOPE_ADMIN__METRICS_AUTH".to_owned(),
                "true".to_owned(),
            ),
        ];
        let c = GatewayConfig::load_with_env(None, env).expect("config");
        assert_eq!(c.dashboard.token.as_deref(), Some("123456"));
        assert_eq!(c.admin.ingest_token.as_deref(), Some("1.50"));
        assert!(c.admin.metrics_auth);
        let env = vec![("TOKENSCOPE_DASHBOARD__TOKEN".to_owned(), " ".to_owned())];
        let e = GatewayConfig::load_with_env(None, env).expect_err("empty token");
        assert!(e.to_string().contains("[dashboard] token is empty"), "{e}");
    }

    #[test]
    fn empty_or_odd_tokens_are_config_errors() {
        let mut c = cfg(Some("  "), None, "127.0.0.1:9464");
        assert_eq!(
            validate(&c),
            Err(AuthConfigError::EmptyToken("[dashboard] token"))
        );
        c.dashboard.token = Some("two words".into());
        assert_eq!(
            validate(&c),
            Err(AuthConfigError::BadToken("[dashboard] token"))
        );
        c.dashboard.token = None;
        c.admin.ingest_token = Some(String::new());
        assert_eq!(
            validate(&c),
            Err(AuthConfigError::EmptyToken("[admin] ingest_token"))
        );
        c.admin.ingest_token = None;
        c.admin.metrics_auth = true;
        assert_eq!(validate(&c), Err(AuthConfigError::MetricsAuthWithoutToken));
        c.dashboard.token = Some("ok-token".into());
        assert_eq!(validate(&c), Ok(()));
    }
}
