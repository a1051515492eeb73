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
//!
//! The same lists answer a client's `GET /v1/models` when several upstreams
//! are configured ([`union`]): each upstream is asked on the request's task, at once, with
//! the client's headers and the upstream's credentials (`crate::forward::listing`), within
//! [`FETCH_TIMEOUT`] and [`MAX_BODY_BYTES`]; the answer is `{"object":"list","data":[…]}`, the
//! `data` items in upstream order, each exactly as its upstream wrote it, an id listed by two
//! upstreams given once (the first upstream's item). An upstream that fails, times out or
//! answers something else is skipped (logged at debug); none answering → `502`. The
//! upstreams' literal `models` names are not added to that list: an engine that does not list
//! a model may still not serve it, and the item would be the gateway's invention. With one
//! upstream `/v1/models` is an ordinary pass-through (its answer byte for byte, llama.cpp's
//! extra `models` key included).

use crate::failure::error_response;
use crate::shared::{Shared, Upstream};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::value::RawValue;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_config::UpstreamCredentials;
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
    creds: &UpstreamCredentials,
) -> Result<Vec<String>, String> {
    let mut req = http::Request::get(uri.clone())
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, "tokenscope-gateway")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    creds.apply(req.headers_mut());
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

/// One upstream, as the model-label task sees it.
pub(crate) struct Served {
    pub name: String,
    pub base: Uri,
    /// Its `models` patterns.
    pub patterns: Vec<String>,
    /// Polled in the background (`scrape_interval_ms > 0`).
    pub polled: bool,
    /// Sent with each fetch (an upstream behind a key answers `/v1/models` only with it).
    pub creds: UpstreamCredentials,
}

/// Reserves the upstreams' literal model names now, starts the `/v1/models` task for the
/// upstreams polled in the background and waits for its first round (at most
/// [`FIRST_ROUND_WAIT`]). `connectors`: each upstream's TLS (`https://` upstreams are fetched
/// with their CA file and client certificate).
pub(crate) async fn start(
    metrics: Arc<Metrics>,
    upstreams: &[Served],
    connectors: tokenscope_net::ConnectorSet,
) {
    metrics.reserve_models(upstreams.iter().flat_map(|u| literal_names(&u.patterns)));
    let targets: Vec<(String, Uri, String, UpstreamCredentials)> = upstreams
        .iter()
        .filter(|u| u.polled)
        .filter_map(|u| {
            let uri = models_uri(&u.base)?;
            let shown = crate::redact_url(&uri.to_string());
            Some((u.name.clone(), uri, shown, u.creds.clone()))
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
            let round = targets
                .iter()
                .map(|(_, uri, _, creds)| fetch(&client, uri, creds));
            let results = futures_util::future::join_all(round).await;
            for ((name, _, shown, _), result) in targets.iter().zip(results) {
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

/// Whether a request asks for the model list: `GET /v1/models` (the query string is passed
/// on). Other spellings (`/models`, llama.cpp's) stay pass-through to the default upstream:
/// not every engine serves them, and its own answer (a 404) is then the faithful one.
pub(crate) fn is_listing(parts: &Parts) -> bool {
    parts.method == http::Method::GET && parts.uri.path() == "/v1/models"
}

/// The `data` items of a model list, each as written.
fn list_items(body: &[u8]) -> Option<Vec<&RawValue>> {
    #[derive(serde::Deserialize)]
    struct List<'a> {
        #[serde(borrow)]
        data: Vec<&'a RawValue>,
    }
    serde_json::from_slice::<List<'_>>(body)
        .ok()
        .map(|l| l.data)
}

/// The `id` of one item, if it is a string.
fn item_id(item: &RawValue) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Id {
        id: Option<String>,
    }
    serde_json::from_str::<Id>(item.get()).ok()?.id
}

/// `{"object":"list","data":[…]}` of the lists in order: items as written, an id given once
/// (its first item), items without an id kept.
fn merge<'a>(lists: impl IntoIterator<Item = Vec<&'a RawValue>>) -> Vec<u8> {
    let mut seen = std::collections::HashSet::new();
    let mut out = br#"{"object":"list","data":["#.to_vec();
    let mut first = true;
    for item in lists.into_iter().flatten() {
        if let Some(id) = item_id(item) {
            if !seen.insert(id) {
                continue;
            }
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(item.get().as_bytes());
    }
    out.extend_from_slice(b"]}");
    out
}

/// One upstream's answer to the client's list request (2xx, at most [`MAX_BODY_BYTES`],
/// within [`FETCH_TIMEOUT`]).
async fn fetch_list(upstream: &Upstream, parts: &Parts) -> Result<Bytes, String> {
    let exchange = async {
        let sent = crate::replicas::send(
            &upstream.name,
            &upstream.replicas,
            FETCH_TIMEOUT,
            |r| crate::forward::listing(parts, &r.base, &upstream.creds),
            |_| {},
        )
        .await
        .map_err(|f| f.answer().2.into_owned())?;
        let crate::replicas::Sent { resp, conn, load } = sent;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        let body = crate::upconn::PooledBody::new(resp.into_body(), conn);
        Limited::new(crate::replicas::Loaded::new(body, load), MAX_BODY_BYTES)
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| e.to_string())
    };
    tokio::time::timeout(FETCH_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {FETCH_TIMEOUT:?}"))?
}

/// The answer to a client's `GET /v1/models` with several upstreams: the union of their lists
/// (see the module docs).
pub(crate) async fn union(shared: &Shared, parts: &Parts) -> Response {
    let answers =
        futures_util::future::join_all(shared.upstreams.iter().map(|u| fetch_list(u, parts))).await;
    let mut lists = Vec::new();
    let mut failed = Vec::new();
    for (u, answer) in shared.upstreams.iter().zip(&answers) {
        let why = match answer {
            Ok(body) => match list_items(body) {
                Some(items) => {
                    lists.push(items);
                    continue;
                }
                None => "not a {\"data\": […]} list".to_owned(),
            },
            Err(e) => e.clone(),
        };
        tracing::debug!(upstream = %u.name, path = parts.uri.path(), error = %why, "no model list");
        failed.push(format!("{}: {why}", u.name));
    }
    if lists.is_empty() {
        return error_response(
            StatusCode::BAD_GATEWAY,
            "upstream_failed",
            &format!(
                "no upstream answered with a model list ({})",
                failed.join("; ")
            ),
        );
    }
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        merge(lists),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_merge_in_upstream_order_first_id_wins() {
        let a = br#"{"object":"list","data":[{"id":"m1","owned_by":"a", "x":{"z":1,"a":2}},{"id":"shared","owned_by":"a"}],"models":[{"name":"m1"}]}"#;
        let b = br#"{"data":[{"owned_by":"b","id":"shared"},{"id":"m2","object":"model"},{"no_id":true}]}"#;
        let merged = merge([
            list_items(a).expect("list a"),
            list_items(b).expect("list b"),
        ]);
        assert_eq!(
            std::str::from_utf8(&merged).expect("utf-8"),
            r#"{"object":"list","data":[{"id":"m1","owned_by":"a", "x":{"z":1,"a":2}},{"id":"shared","owned_by":"a"},{"id":"m2","object":"model"},{"no_id":true}]}"#,
            "items as written (key order and spacing), the first upstream's item of an id"
        );
        assert!(list_items(b"{\"models\":[]}").is_none());
        assert!(list_items(b"nope").is_none());
        assert_eq!(
            merge(Vec::<Vec<&RawValue>>::new()),
            br#"{"object":"list","data":[]}"#
        );
        let get = |uri: &str, method: &str| {
            http::Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .expect("request")
                .into_parts()
                .0
        };
        assert!(is_listing(&get("/v1/models", "GET")));
        assert!(is_listing(&get("/v1/models?x=1", "GET")));
        assert!(!is_listing(&get("/models", "GET")));
        assert!(!is_listing(&get("/v1/models", "POST")));
        assert!(!is_listing(&get("/v1/models/m1", "GET")));
    }

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
