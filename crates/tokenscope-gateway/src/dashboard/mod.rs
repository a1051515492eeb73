//! The built-in dashboard on the admin listener: three pages (overview, performance, cost)
//! at `/`, drawn in the browser with the vendored uPlot (no CDN, works offline), over a JSON
//! API computed from the store.
//!
//! * `GET /` — the single-page app; `GET /assets/…` — its script, styles and uPlot.
//! * `GET /api/dashboard/{overview|performance|cost}?range=5m|1h|24h|7d[&until=UNIX_S]
//!   [&model=…][&request_type=…][&business_line=…]` — the numbers of one page
//!   ([`aggregate`] documents each field and the definitions).
//!
//! Invariants:
//! * The request path never waits on the dashboard: a page runs on a blocking thread of the
//!   background runtime. It first asks the store pipeline to write what this gateway finished
//!   (waiting at most [`FLUSH_WAIT`]), then reads only the store's aggregates ([`aggregate`]:
//!   report, usage sums, the top 10 slowest) — per-bucket and per-group state, never a
//!   window's rows, so its memory does not grow with the rows (`read_memory` test). With
//!   several gateways on one ClickHouse a page shows the fleet. Records the store does not
//!   hold yet (store slow or down) are counted in the page's `not_yet_stored`, not shown. At
//!   most [`MAX_CONCURRENT_QUERIES`] page queries run at once; more wait for a permit.
//! * With `[dashboard] token` (the admin token) set, every `/api/dashboard/*` and
//!   `/api/requests*` call needs `Authorization: Bearer <token>` (`crate::auth`: scheme in any
//!   case, compared in constant time, never logged); the static page holds no data and stays
//!   open. `/healthz` is never behind a token; `/metrics` only with `[admin] metrics_auth`.
//! * A slow request links to its trace only when the tail sampler kept it: the gateway
//!   remembers the last [`KEPT_TRACES`] kept trace ids.

pub mod aggregate;

use crate::shared::Shared;
use aggregate::{BudgetRow, Filters, PageContext, PageWindow, Range, TraceLinks};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::Deserialize;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Page queries running at once (each may read a day or a week of rows).
pub const MAX_CONCURRENT_QUERIES: usize = 2;
/// How long a page waits for the store pipeline to write what this gateway finished before
/// it reads the store (a slow or down store: the page goes on, `not_yet_stored` says how many
/// records it does not show).
pub const FLUSH_WAIT: Duration = Duration::from_millis(1_000);
/// Kept trace ids remembered for the trace links.
pub const KEPT_TRACES: usize = 65_536;

const INDEX_HTML: &str = include_str!("../../assets/dashboard/index.html");
const APP_JS: &str = include_str!("../../assets/dashboard/dashboard.js");
const APP_CSS: &str = include_str!("../../assets/dashboard/dashboard.css");
const UPLOT_JS: &str = include_str!("../../assets/vendor/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../../assets/vendor/uplot/uPlot.min.css");

/// The trace ids the tail sampler kept recently, with the oldest start time remembered (a
/// record older than that has an unknown decision).
#[derive(Default)]
pub(crate) struct KeptTraces {
    inner: Mutex<KeptInner>,
}

#[derive(Default)]
struct KeptInner {
    order: VecDeque<(i64, u128)>,
    ids: HashSet<u128>,
    /// `created_at` of the first decision seen; decisions before it are unknown.
    since_us: Option<i64>,
}

impl KeptTraces {
    /// Notes the decision for a finished record (called once per record while tracing is on).
    pub(crate) fn decided(&self, created_at: i64, trace_id: &str, kept: bool) {
        let Ok(id) = u128::from_str_radix(trace_id, 16) else {
            return;
        };
        let mut g = self.inner.lock();
        if g.since_us.is_none() {
            g.since_us = Some(created_at);
        }
        if !kept {
            return;
        }
        if g.order.len() >= KEPT_TRACES {
            if let Some((at, old)) = g.order.pop_front() {
                g.ids.remove(&old);
                // Decisions up to the evicted entry's start are forgotten.
                g.since_us = Some(at.saturating_add(1));
            }
        }
        g.ids.insert(id);
        g.order.push_back((created_at, id));
    }

    /// `Some(true)` kept, `Some(false)` decided and not kept, `None` unknown.
    fn kept(&self, created_at: i64, trace_id: &str) -> Option<bool> {
        let id = u128::from_str_radix(trace_id, 16).ok()?;
        let g = self.inner.lock();
        if g.ids.contains(&id) {
            return Some(true);
        }
        match g.since_us {
            Some(since) if created_at >= since => Some(false),
            _ => None,
        }
    }
}

/// `[dashboard]`: the built-in dashboard (its schema lives in the config crate).
pub use tokenscope_config::DashboardSection;

#[derive(Clone)]
struct DashState {
    shared: Arc<Shared>,
    permits: Arc<tokio::sync::Semaphore>,
}

/// The dashboard's routes (already with their state).
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    if !shared.cfg.dashboard.enabled {
        return Router::new();
    }
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/assets/dashboard.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/assets/dashboard.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            "/assets/uPlot.iife.min.js",
            get(|| async { asset("text/javascript; charset=utf-8", UPLOT_JS) }),
        )
        .route(
            "/assets/uPlot.min.css",
            get(|| async { asset("text/css; charset=utf-8", UPLOT_CSS) }),
        )
        .route("/api/dashboard/config", get(config))
        .route("/api/dashboard/{page}", get(page))
        .with_state(DashState {
            shared,
            permits: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_QUERIES)),
        })
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `None` when the request may read dashboard data (the admin token, `crate::auth`), else
/// the 401 answer.
pub(crate) fn refused(shared: &Shared, headers: &HeaderMap) -> Option<Response> {
    crate::auth::check(&shared.cfg, crate::auth::Access::Read, headers)
}

/// What the page needs before its first query.
async fn config(State(s): State<DashState>, headers: HeaderMap) -> Response {
    if let Some(r) = refused(&s.shared, &headers) {
        return r;
    }
    let d = &s.shared.cfg.dashboard;
    Json(serde_json::json!({
        "refresh_seconds": d.refresh_seconds,
        "trace_url": d.trace_url,
        "tracing": s.shared.fanout.tracing_on(),
        "ranges": ["5m", "1h", "24h", "7d"],
        "pages": ["overview", "performance", "cost"],
    }))
    .into_response()
}

#[derive(Deserialize)]
struct PageQuery {
    range: Option<String>,
    until: Option<f64>,
    model: Option<String>,
    request_type: Option<String>,
    business_line: Option<String>,
}

fn nonempty(s: Option<String>) -> Option<String> {
    s.filter(|v| !v.is_empty())
}

async fn page(
    State(s): State<DashState>,
    Path(page): Path<String>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    if let Some(r) = refused(&s.shared, &headers) {
        return r;
    }
    if !matches!(page.as_str(), "overview" | "performance" | "cost") {
        return (StatusCode::NOT_FOUND, "pages: overview, performance, cost").into_response();
    }
    let range_s = q.range.as_deref().unwrap_or("1h");
    let Some(range) = Range::parse(range_s) else {
        return (
            StatusCode::BAD_REQUEST,
            format!("range {range_s:?}: use 5m, 1h, 24h or 7d"),
        )
            .into_response();
    };
    let until_us = match q.until {
        Some(u) if u.is_finite() && u > 0.0 => (u * 1e6) as i64,
        Some(u) => {
            return (StatusCode::BAD_REQUEST, format!("until {u}: Unix seconds")).into_response()
        }
        None => now_us(),
    };
    let filters = Filters {
        model: nonempty(q.model),
        request_type: nonempty(q.request_type),
        business_line: nonempty(q.business_line),
    };
    let window = PageWindow::ending_at(range, until_us);
    let Ok(_permit) = s.permits.clone().acquire_owned().await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response();
    };
    let shared = s.shared.clone();
    // Flushing the pipeline and reading the store's aggregates are blocking I/O and CPU
    // work: off the runtime, on a blocking thread of the background runtime (nice +10), so
    // neither a request nor the admin listener waits behind a page.
    let done = tokio::task::spawn_blocking(move || {
        // What this gateway finished so far goes to the store first (bounded wait: a slow or
        // down store leaves it counted in `not_yet_stored`, never waited on).
        shared.fanout.recorder.flush_within(FLUSH_WAIT);
        let not_yet_stored = shared.fanout.recorder.pending();
        render(&shared, &page, range, &window, &filters, not_yet_stored)
    })
    .await;
    match done {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reading the store failed: {e}"),
        )
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "query failed").into_response(),
    }
}

/// One page's JSON, computed by the store ([`aggregate`]); a store without a file yet
/// (nothing written) reads as empty.
fn render(
    shared: &Shared,
    page: &str,
    range: Range,
    window: &PageWindow,
    filters: &Filters,
    not_yet_stored: u64,
) -> Result<Response, String> {
    // Inside the gateway: a small page cache and no memory map (`ReadProfile::Resident`).
    let target = tokenscope_backend::StoreTarget::parse(&shared.cfg.store);
    let reader: Box<dyn tokenscope_store::RecordReader> = match tokenscope_backend::open_reader_with(
        &target,
        tokenscope_backend::ReadProfile::Resident,
    ) {
        Ok(reader) => reader,
        Err(tokenscope_backend::BackendError::Missing { .. }) => {
            Box::new(tokenscope_store::SqliteStore::open_in_memory().map_err(|e| e.to_string())?)
        }
        Err(e) => return Err(e.detail()),
    };
    let reader = reader.as_ref();
    let tracing_on = shared.fanout.tracing_on();
    let kept = &shared.fanout.kept_traces;
    let kept_lookup = |t: &str, at: i64| {
        if !tracing_on {
            return None;
        }
        kept.kept(at, t)
    };
    let cx = PageContext {
        links: TraceLinks {
            kept: &kept_lookup,
            url_template: shared.cfg.dashboard.trace_url.as_deref(),
        },
        not_yet_stored,
        gpus: shared
            .gpu
            .as_ref()
            .and_then(|g| g.snapshot())
            .map(|snap| {
                snap.gpus
                    .iter()
                    .map(|g| aggregate::GpuNow {
                        gpu: g.gpu.clone(),
                        model_name: g.model_name.clone(),
                        utilization: g.utilization,
                        memory_bandwidth: g.memory_bandwidth_utilization,
                        memory_used_bytes: g.memory_used_bytes,
                        memory_total_bytes: g.memory_total_bytes,
                        memory_used_ratio: match (g.memory_used_bytes, g.memory_total_bytes) {
                            (Some(u), Some(t)) if t > 0 => Some(u as f64 / t as f64),
                            _ => None,
                        },
                    })
                    .collect()
            })
            .unwrap_or_default(),
    };
    let err = |e: tokenscope_store::StoreError| e.to_string();
    Ok(match page {
        "overview" => Json(aggregate::overview(reader, range, window, filters, &cx).map_err(err)?)
            .into_response(),
        "performance" => {
            Json(aggregate::performance(reader, range, window, filters, &cx).map_err(err)?)
                .into_response()
        }
        _ => {
            let mut lines: Vec<String> = shared
                .cfg
                .budgets
                .iter()
                .map(|b| b.business_line.clone())
                .collect();
            lines.sort();
            lines.dedup();
            let budgets = lines
                .into_iter()
                .map(|l| BudgetRow {
                    usage_ratio: shared.fanout.budgets.ratio(&l),
                    business_line: l,
                })
                .collect();
            Json(
                aggregate::cost(reader, range, window, filters, budgets, not_yet_stored)
                    .map_err(err)?,
            )
            .into_response()
        }
    })
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_traces_know_what_they_forgot() {
        let k = KeptTraces::default();
        assert_eq!(k.kept(5, "0a"), None);
        k.decided(10, "0a", true);
        k.decided(11, "0b", false);
        assert_eq!(k.kept(10, "0a"), Some(true));
        assert_eq!(k.kept(11, "0b"), Some(false));
        assert_eq!(k.kept(9, "0c"), None);
        assert_eq!(k.kept(12, "not hex"), None);
        for i in 0..KEPT_TRACES {
            k.decided(100 + i as i64, &format!("{:032x}", 1000 + i), true);
        }
        // "0a" was evicted: records from before the oldest remembered one are unknown again.
        assert_eq!(k.kept(10, "0a"), None);
        let last = format!("{:032x}", 1000 + KEPT_TRACES - 1);
        assert_eq!(k.kept(100 + KEPT_TRACES as i64 - 1, &last), Some(true));
    }
}
