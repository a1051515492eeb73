//! Serving and shutting down: [`run`] behind [`crate::Gateway::run`].
//!
//! Invariants:
//! * The proxy listener serves on the request path's runtime, the admin listener (dashboard,
//!   `/metrics`, OTLP receiver) on the background runtime.
//! * Shutdown, in order: stop accepting; let in-flight requests finish within
//!   `shutdown_grace_ms`; cut the rest (each recorded as `shutdown`); wait for records whose
//!   finishing waits for a tokenizer count; flush trace export; drain the store pipeline. Every
//!   record is handed to the pipeline before it drains.

use crate::{admin, config, proxy, server, Gateway, GatewayError, ShutdownSummary};
use axum::routing::{any, post};
use axum::Router;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_store::ShutdownReport;

/// Serves until `shutdown` resolves, then shuts down (see the module docs).
pub(crate) async fn run(
    gw: Gateway,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<ShutdownSummary, GatewayError> {
    let Gateway {
        shared,
        proxy,
        admin,
        pipeline,
        bg,
        proxy_conns,
        admin_conns,
        proxy_tls,
    } = gw;
    let pipeline = Arc::new(pipeline);
    let app = Router::new()
        .route("/v1/chat/completions", post(proxy::measured))
        .route("/v1/completions", post(proxy::measured))
        .route("/v1/embeddings", post(proxy::measured))
        .route("/v1/responses", post(proxy::measured))
        .route("/v1/messages", post(proxy::measured))
        .route("/chat/completions", post(proxy::measured))
        .route("/completions", post(proxy::measured))
        .route("/embeddings", post(proxy::measured))
        .route("/responses", post(proxy::measured))
        .route("/messages", post(proxy::measured))
        .fallback(any(proxy::passthrough))
        .with_state(shared.clone());
    let admin_app = admin::router(shared.clone(), pipeline.clone());
    let (proxy_limits, admin_limits) = conn_limits(&shared.cfg.limits);
    tracing::debug!(
        proxy_max_connections = proxy_limits.max_connections,
        admin_max_connections = admin_limits.max_connections,
        "connection caps"
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let proxy_task = tokio::spawn(server::serve(
        proxy,
        app,
        proxy_limits,
        stop_rx.clone(),
        proxy_conns.clone(),
        proxy_tls,
    ));
    // The admin listener (dashboard, /metrics, OTLP receiver) on the background runtime.
    let bg_handle = bg
        .handle()
        .cloned()
        .unwrap_or_else(tokio::runtime::Handle::current);
    let admin_task = bg_handle.spawn(server::serve(
        admin,
        admin_app,
        admin_limits,
        stop_rx.clone(),
        admin_conns.clone(),
        None,
    ));
    shutdown.await;
    let in_flight = proxy_conns.in_flight();
    tracing::info!(
        in_flight,
        grace_ms = shared.cfg.shutdown_grace_ms,
        "Shutting down: no new connections; waiting for in-flight requests."
    );
    let _ = stop_tx.send(true);
    // The accept loops end first, so no connection starts after the waits below.
    let _ = proxy_task.await;
    let _ = admin_task.await;
    proxy_conns.drain();
    admin_conns.drain();
    let grace = Duration::from_millis(shared.cfg.shutdown_grace_ms);
    let mut cut = 0;
    if tokio::time::timeout(grace, proxy_conns.wait())
        .await
        .is_err()
    {
        cut = proxy_conns.in_flight();
        tracing::warn!(
            cut,
            "In-flight requests outlived the grace period; closing them (recorded as `shutdown`)."
        );
        shared.fanout.begin_cut();
        proxy_conns.cut();
        proxy_conns.wait().await;
    }
    if tokio::time::timeout(Duration::from_secs(2), admin_conns.wait())
        .await
        .is_err()
    {
        admin_conns.cut();
        admin_conns.wait().await;
    }
    // Records waiting for a tokenizer count (bounded by its own 5 s deadline).
    shared.fanout.finishing.close();
    if tokio::time::timeout(Duration::from_secs(6), shared.fanout.finishing.wait())
        .await
        .is_err()
    {
        tracing::warn!("Records still waiting for a tokenizer count at shutdown.");
    }
    // Every record is final and handed to the pipeline now.
    if let Some(t) = shared.fanout.tracing.as_ref() {
        t.exporter.shutdown(Duration::from_secs(5)).await;
    }
    drop(shared);
    let store = tokio::task::spawn_blocking(move || match Arc::try_unwrap(pipeline) {
        Ok(p) => p.shutdown(Duration::from_secs(30)),
        Err(p) => {
            tracing::error!("the store pipeline is still referenced at shutdown; flushing only");
            p.flush();
            ShutdownReport::default()
        }
    })
    .await
    .unwrap_or_default();
    drop(bg);
    tracing::info!(
        in_flight_at_signal = in_flight,
        cut_at_deadline = cut,
        enqueued = store.enqueued,
        written = store.written,
        dropped = store.dropped,
        lost = store.lost,
        spooled_batches_left = store.spooled_batches,
        "Store drained."
    );
    Ok(ShutdownSummary {
        cut_in_flight: cut > 0,
        in_flight_at_signal: in_flight,
        cut,
        store,
    })
}

/// The connection limits of both listeners from `[limits]` and the open-file limit.
fn conn_limits(l: &config::LimitsSection) -> (server::ConnLimits, server::ConnLimits) {
    let nofile = raise_nofile_limit();
    let admin_max = l.admin_max_connections.max(1);
    let proxy_max = if l.max_connections > 0 {
        l.max_connections
    } else {
        // Each proxied request holds a client and an upstream socket; keep 64 descriptors for
        // the store, the spool, the listeners and the scrapers.
        (nofile.saturating_sub(64 + admin_max as u64) / 2).clamp(16, 65_536) as usize
    };
    let write_timeout =
        (l.client_write_timeout_ms > 0).then(|| Duration::from_millis(l.client_write_timeout_ms));
    let proxy = server::ConnLimits {
        max_connections: proxy_max,
        header_timeout: Duration::from_millis(l.header_timeout_ms),
        write_timeout,
        max_header_bytes: l.max_header_bytes,
        nodelay: true,
    };
    let admin = server::ConnLimits {
        max_connections: admin_max,
        nodelay: false,
        ..proxy
    };
    (proxy, admin)
}

/// Raises the soft open-file limit to the hard one (as Go's runtime and nginx's
/// `worker_rlimit_nofile` do) and returns the soft limit in force.
fn raise_nofile_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (lim.current, lim.maximum) {
        if cur < max {
            let raised = rustix::process::Rlimit {
                current: Some(max),
                maximum: Some(max),
            };
            if setrlimit(Resource::Nofile, raised).is_ok() {
                lim = getrlimit(Resource::Nofile);
            }
        }
    }
    lim.current.unwrap_or(1 << 20)
}
