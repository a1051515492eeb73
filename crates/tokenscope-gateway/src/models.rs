//! The models the upstreams serve, reserved as metric labels so that client-chosen names
//! cannot push them into `other` (`tokenscope_telemetry::ModelLabeler`).
//!
//! Sources: the upstreams' `models` entries that are literal names (not `prefix*` / `*`),
//! reserved before the gateway serves, and the ids each upstream lists at `GET /v1/models`
//! (`{"data": [{"id": …}]}`, the OpenAI shape that vLLM, SGLang, llama.cpp, TGI and the mock
//! engine answer), fetched by one background task at start-up and every [`REFRESH`] from each
//! upstream polled in the background (`scrape_interval_ms > 0`; 0 turns both the engine-state
//! scrape and this fetch off for that upstream).
//!
//! Invariants:
//! * Never on the request path: the task runs beside the listeners. Start-up waits for its
//!   first round at most [`FIRST_ROUND_WAIT`] (an engine that is down answers at once; one that
//!   hangs delays the start by that much, 2 s).
//! * Each fetch is bounded: [`FETCH_TIMEOUT`] for the whole exchange, a body of at most
//!   [`MAX_BODY_BYTES`]. A failed fetch is logged at debug (an upstream without `/v1/models`
//!   is normal) and retried at the next round.
//! * At most `max_models` names are ever reserved (the labeler's bound).
//! * URLs in logs are redacted (`crate::redact_url`).

use bytes::Bytes;
use http::Uri;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_telemetry::Metrics;

/// Period of the `/v1/models` refresh.
pub const REFRESH: Duration = Duration::from_secs(60);
/// Longest wait of start-up for the first round (one fetch's timeout: the upstreams are
/// fetched at once).
pub const FIRST_ROUND_WAIT: Duration = FETCH_TIMEOUT;
/// Time allowed for one fetch.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest `/v1/models` body read.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The literal model names of an upstream's `models` patterns.
pub fn literal_names(patterns: &[String]) -> impl Iterator<Item = &str> {
    patterns
        .iter()
        .map(String::as_str)
        .filter(|p| !p.is_empty() && !p.ends_with('*'))
}

/// The ids of a `/v1/models` answer (`data[].id`), `None` when it is not that shape.
pub fn parse_model_ids(body: &[u8]) -> Option<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let ids = v
        .get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("id")?.as_str())
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    Some(ids)
}

/// `{base path}/v1/models` of an upstream base URL.
fn models_uri(base: &Uri) -> Option<Uri> {
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(format!("{prefix}/v1/models").parse().ok()?);
    Uri::from_parts(parts).ok()
}

async fn fetch(
    client: &Client<tokenscope_net::ConnectorSet, Empty<Bytes>>,
    uri: &Uri,
) -> Result<Vec<String>, String> {
    let req = http::Request::get(uri.clone())
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, "tokenscope-gateway")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| tokenscope_net::error_chain(&e))?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        parse_model_ids(&body).ok_or_else(|| "not a {\"data\": [{\"id\": …}]} list".to_owned())
    };
    tokio::time::timeout(FETCH_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {FETCH_TIMEOUT:?}"))?
}

/// Reserves the upstreams' literal model names now, starts the `/v1/models` task for the
/// upstreams polled in the background (`true`: `scrape_interval_ms > 0`) and waits for its
/// first round (at most [`FIRST_ROUND_WAIT`]). `connectors`: each upstream's TLS (`https://`
/// upstreams are fetched with their CA file and client certificate).
pub(crate) async fn start(
    metrics: Arc<Metrics>,
    upstreams: &[(String, Uri, Vec<String>, bool)],
    connectors: tokenscope_net::ConnectorSet,
) {
    metrics.reserve_models(upstreams.iter().flat_map(|(_, _, m, _)| literal_names(m)));
    let targets: Vec<(String, Uri, String)> = upstreams
        .iter()
        .filter(|(_, _, _, polled)| *polled)
        .filter_map(|(name, base, _, _)| {
            let uri = models_uri(base)?;
            let shown = crate::redact_url(&uri.to_string());
            Some((name.clone(), uri, shown))
        })
        .collect();
    if targets.is_empty() {
        return;
    }
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let client: Client<tokenscope_net::ConnectorSet, Empty<Bytes>> =
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connectors);
        let mut first = Some(tx);
        loop {
            // The upstreams at once: a round lasts at most one FETCH_TIMEOUT.
            let round = targets.iter().map(|(_, uri, _)| fetch(&client, uri));
            let results = futures_util::future::join_all(round).await;
            for ((name, _, shown), result) in targets.iter().zip(results) {
                match result {
                    Ok(ids) => {
                        let added = metrics.reserve_models(&ids);
                        if added > 0 {
                            tracing::debug!(upstream = %name, url = %shown, added, "model labels reserved");
                        }
                    }
                    Err(e) => {
                        tracing::debug!(upstream = %name, url = %shown, error = %e, "no model list")
                    }
                }
            }
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
            tokio::time::sleep(REFRESH).await;
        }
    });
    let _ = tokio::time::timeout(FIRST_ROUND_WAIT, rx).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_lists_and_literal_names() {
        let body =
            br#"{"object":"list","data":[{"id":"llama-3-8b"},{"id":""},{"x":1},{"id":"qwen"}]}"#;
        assert_eq!(
            parse_model_ids(body),
            Some(vec!["llama-3-8b".to_owned(), "qwen".to_owned()])
        );
        assert_eq!(parse_model_ids(b"not json"), None);
        assert_eq!(parse_model_ids(br#"{"models":[]}"#), None);
        let pats = vec!["gemma*".to_owned(), "llama-3-8b".to_owned(), "*".to_owned()];
        assert_eq!(literal_names(&pats).collect::<Vec<_>>(), vec!["llama-3-8b"]);
        let base: Uri = "http://u:p@127.0.0.1:8080/prefix/".parse().expect("uri");
        assert_eq!(
            models_uri(&base).expect("uri").to_string(),
            "http://u:p@127.0.0.1:8080/prefix/v1/models"
        );
    }
}
