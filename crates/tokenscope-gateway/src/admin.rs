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
//!   (`crate::cost::business_metrics_path`), read by `tokenscope budget`.

use crate::Shared;
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
                sink_shared.apply_engine_update(s.update);
            }
        },
    ));
    let dashboard = crate::dashboard::router(shared.clone());
    Router::new()
        .merge(otlp)
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/requests", get(recent))
        .route("/api/requests/{id}", get(one))
        .route("/api/flush", post(flush))
        .route("/api/business-metrics", post(business_metrics))
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

async fn recent(
    State(s): State<AdminState>,
    headers: axum::http::HeaderMap,
    Query(q): Query<Limit>,
) -> Response {
    if !crate::dashboard::authorized(&s.shared, &headers) {
        return crate::dashboard::unauthorized();
    }
    let limit = q.limit.unwrap_or(100);
    let rows: Vec<_> = s
        .shared
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

async fn one(
    State(s): State<AdminState>,
    headers: axum::http::HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if !crate::dashboard::authorized(&s.shared, &headers) {
        return crate::dashboard::unauthorized();
    }
    let found = s
        .shared
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
    let parsed: MetricsIn = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")).into_response(),
    };
    let list = match parsed {
        MetricsIn::One(m) => vec![m],
        MetricsIn::Many(v) => v,
    };
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
            return (StatusCode::BAD_REQUEST, e.to_string()).into_response();
        }
        points.push(p);
    }
    let n = points.len();
    let file = s.shared.business_metrics.clone();
    match tokio::task::spawn_blocking(move || file.append(&points)).await {
        Ok(Ok(())) => Json(serde_json::json!({ "accepted": n })).into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "business metrics: append failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "could not store the values",
            )
                .into_response()
        }
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not store the values",
        )
            .into_response(),
    }
}
