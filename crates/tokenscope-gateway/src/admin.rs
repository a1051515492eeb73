//! The admin listener (localhost by default): `/metrics` for Prometheus, health, and a small
//! JSON API over the most recent records.
//!
//! * `GET /metrics` — OpenMetrics text when the `Accept` header asks for it, else the
//!   Prometheus 0.0.4 text format.
//! * `GET /healthz` — `ok`.
//! * `GET /` — the built-in dashboard and `GET /api/dashboard/…` its JSON API
//!   ([`crate::dashboard`]; `[dashboard] token` guards the API and `/api/requests*`).
//! * `GET /api/requests?limit=N[&client_request_id=ID]` — the last N finished records, newest
//!   first (in memory); with `client_request_id`, only those whose client sent
//!   `x-request-id: ID` (not unique: the key is the gateway's own `request_id`).
//! * `GET /api/requests/{request_id}` — one recent record, 404 when not in memory.
//! * `POST /v1/traces` — OTLP/HTTP (protobuf or JSON) receiver for engine spans; their
//!   `gen_ai.latency.*` values are joined to the record with the same trace id.
//! * `POST /api/flush` — write everything queued to the store now (blocks this admin call only).
//! * `POST /api/business-metrics` — business-metric values per business line for the budget
//!   growth check: `{"business_line": "search", "value": 1200, "at": UNIX_SECONDS}` (`at`
//!   optional, default now) or an array of them; appended to the store's sidecar file
//!   (`StoreTarget::business_metrics_path`), read by `tokenscope budget`. Bounded: at most
//!   `[admin] business_metrics_max_points` values per call (413), `business_metrics_max_lines`
//!   distinct business lines (429) and `business_metrics_max_bytes` of file (507), each a JSON
//!   error; nothing of a refused call is written.
//!
//! Access (`crate::auth`): `/healthz` open; `/metrics` open unless `[admin] metrics_auth`;
//! `/api/requests*` and the dashboard API need the admin token (`[dashboard] token`) when set;
//! `/api/flush` and `/api/business-metrics` likewise (403 on an exposed address without one);
//! `/v1/traces` needs `[admin] ingest_token` or the admin token when either is set.

use crate::auth::Access;
use crate::shared::Shared;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use std::sync::Arc;
use tokenscope_store::PipelineHandle;

#[derive(Clone)]
struct AdminState {
    shared: Arc<Shared>,
    pipeline: Arc<PipelineHandle>,
}

pub(crate) fn router(shared: Arc<Shared>, pipeline: Arc<PipelineHandle>) -> Router {
    // OTLP/HTTP receiver for engine spans (vLLM, SGLang): joined to records by trace id.
    let sink_shared = shared.clone();
    let otlp = tokenscope_otlp::router::<AdminState>(Arc::new(
        move |spans: Vec<tokenscope_otlp::EngineSpan>| {
            for s in spans {
                sink_shared.fanout.apply_engine_update(s.update);
            }
        },
    ));
    let dashboard = crate::dashboard::router(shared.clone());
    // One guard per class of routes (`crate::auth`); `route_layer` guards only the routes
    // present, and an unknown path stays a 404.
    let guard = |access: Access| {
        axum::middleware::from_fn_with_state((shared.clone(), access), crate::auth::guard)
    };
    let ingest = otlp.route_layer(guard(Access::Ingest));
    let metrics_routes = Router::new()
        .route("/metrics", get(metrics))
        .route_layer(guard(Access::Metrics));
    let read = Router::new()
        .route("/api/requests", get(recent))
        .route("/api/requests/{id}", get(one))
        .route_layer(guard(Access::Read));
    let write = Router::new()
        .route("/api/flush", post(flush))
        .route("/api/business-metrics", post(business_metrics))
        .route_layer(guard(Access::Write));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .merge(ingest)
        .merge(metrics_routes)
        .merge(read)
        .merge(write)
        .with_state(AdminState { shared, pipeline })
        .merge(dashboard)
}

/// OpenMetrics when the scraper asks for it (Prometheus does), the classic text format
/// otherwise (curl, promtool, older scrapers).
async fn metrics(State(s): State<AdminState>, headers: axum::http::HeaderMap) -> Response {
    let wants_om = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    if wants_om {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            s.shared.metrics.encode(),
        )
            .into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            s.shared.metrics.encode_prometheus_text(),
        )
            .into_response()
    }
}

#[derive(Deserialize)]
struct Limit {
    limit: Option<usize>,
    client_request_id: Option<String>,
}

async fn recent(State(s): State<AdminState>, Query(q): Query<Limit>) -> Response {
    let limit = q.limit.unwrap_or(100);
    let rows: Vec<_> = s
        .shared
        .fanout
        .recent
        .lock()
        .iter()
        .rev()
        .filter(|r| {
            q.client_request_id
                .as_deref()
                .is_none_or(|id| r.client_request_id.as_deref() == Some(id))
        })
        .take(limit)
        .map(|r| (**r).clone())
        .collect::<Vec<_>>();
    Json(rows).into_response()
}

async fn one(State(s): State<AdminState>, Path(id): Path<String>) -> Response {
    let found = s
        .shared
        .fanout
        .recent
        .lock()
        .iter()
        .rev()
        .find(|r| r.request_id == id)
        .map(|r| (**r).clone());
    match found {
        Some(r) => Json(r).into_response(),
        None => (StatusCode::NOT_FOUND, "not in the recent records").into_response(),
    }
}

async fn flush(State(s): State<AdminState>) -> Response {
    let p = s.pipeline.clone();
    match tokio::task::spawn_blocking(move || p.flush()).await {
        Ok(()) => "flushed".into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "flush failed").into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricIn {
    business_line: String,
    value: f64,
    /// Unix seconds (fractions allowed); default now.
    at: Option<f64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MetricsIn {
    One(MetricIn),
    Many(Vec<MetricIn>),
}

async fn business_metrics(State(s): State<AdminState>, body: axum::body::Bytes) -> Response {
    use crate::failure::error_response;
    let parsed: MetricsIn = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                &format!("invalid JSON: {e}"),
            )
        }
    };
    let list = match parsed {
        MetricsIn::One(m) => vec![m],
        MetricsIn::Many(v) => v,
    };
    let max_points = s.shared.cfg.admin.business_metrics_max_points;
    if list.len() > max_points {
        return error_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_many_values",
            &format!(
                "{} values in one call; at most {max_points} ([admin] business_metrics_max_points)",
                list.len()
            ),
        );
    }
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0);
    let mut points = Vec::with_capacity(list.len());
    for m in list {
        let p = tokenscope_analysis::budget::BusinessMetricPoint {
            business_line: m.business_line,
            at_us: m
                .at
                .filter(|a| a.is_finite())
                .map_or(now_us, |a| (a * 1e6) as i64),
            value: m.value,
        };
        if let Err(e) = p.validate() {
            return error_response(StatusCode::BAD_REQUEST, "invalid_value", &e.to_string());
        }
        points.push(p);
    }
    let n = points.len();
    let file = s.shared.business_metrics.clone();
    let stored = |e: &dyn std::fmt::Display| {
        tracing::warn!(error = %e, "business metrics: append failed");
        error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_failed",
            "could not store the values",
        )
    };
    match tokio::task::spawn_blocking(move || file.append(&points)).await {
        Ok(Ok(())) => Json(serde_json::json!({ "accepted": n })).into_response(),
        Ok(Err(e @ crate::cost::BusinessMetricsError::Full { .. })) => error_response(
            StatusCode::INSUFFICIENT_STORAGE,
            "sidecar_full",
            &e.to_string(),
        ),
        Ok(Err(e @ crate::cost::BusinessMetricsError::TooManyLines { .. })) => error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_business_lines",
            &e.to_string(),
        ),
        Ok(Err(e)) => stored(&e),
        Err(e) => stored(&e),
    }
}
