//! One HTTP GET of a metrics endpoint with hyper-util's legacy client.
//!
//! Invariants:
//! * The whole exchange (connect, headers, body) is bounded by one timeout; the body is read
//!   up to a byte limit and refused past it, so a misbehaving endpoint cannot stall a scraper
//!   or grow its memory.
//! * `http://` and `https://` (tokenscope-net's connector: rustls, the target's CA file and
//!   client certificate, or the system's roots); the timeout covers the TLS handshake too.
//!   Another scheme is refused when a target is built ([`crate::TargetError::UnsupportedScheme`]),
//!   not at every scrape.
//! * The request asks for the classic text format (`text/plain; version=0.0.4`); the parser
//!   reads OpenMetrics as well, should a server answer with it anyway.

use bytes::Bytes;
use http::{header, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;
use tokenscope_net::{ClientTls, ConnectOptions, HttpsConnect};

/// The client every scraper uses (one per scraper task; connections are kept alive).
pub(crate) type HttpClient = Client<HttpsConnect, Empty<Bytes>>;

pub(crate) fn client(connect_timeout: Duration, tls: &ClientTls) -> HttpClient {
    let connector = tokenscope_net::connector(
        tls,
        ConnectOptions {
            timeout: Some(connect_timeout),
            nodelay: true,
            ..ConnectOptions::default()
        },
    );
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        .build(connector)
}

/// Why one scrape got no exposition.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The request could not be built (should not happen for a validated URL).
    #[error("cannot build the request: {0}")]
    Request(#[from] http::Error),
    /// Connecting or sending failed (refused, unreachable, reset, DNS, TLS handshake).
    #[error("cannot reach the endpoint: {}", tokenscope_net::error_chain(.0))]
    Connect(hyper_util::client::legacy::Error),
    /// The endpoint answered with a non-success status (404/501: no metrics there).
    #[error("the endpoint answered HTTP {0}")]
    Status(StatusCode),
    /// Reading the body failed, or it exceeded the byte limit.
    #[error("cannot read the body: {0}")]
    Body(String),
    /// The body is not UTF-8 text.
    #[error("the body is not UTF-8 text")]
    NotText,
    /// Nothing came back within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// GETs `uri` and returns the body as text.
pub(crate) async fn fetch_text(
    client: &HttpClient,
    uri: &Uri,
    timeout: Duration,
    max_bytes: usize,
) -> Result<String, FetchError> {
    match tokio::time::timeout(timeout, fetch_inner(client, uri, max_bytes)).await {
        Ok(result) => result,
        Err(_) => Err(FetchError::Timeout(timeout)),
    }
}

async fn fetch_inner(
    client: &HttpClient,
    uri: &Uri,
    max_bytes: usize,
) -> Result<String, FetchError> {
    let request = Request::get(uri.clone())
        .header(header::ACCEPT, "text/plain; version=0.0.4, */*;q=0.1")
        .header(header::USER_AGENT, "tokenscope-engine-state")
        .body(Empty::<Bytes>::new())?;
    let response = client.request(request).await.map_err(FetchError::Connect)?;
    let status = response.status();
    if !status.is_success() {
        return Err(FetchError::Status(status));
    }
    let body = Limited::new(response.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|e| FetchError::Body(e.to_string()))?
        .to_bytes();
    String::from_utf8(body.to_vec()).map_err(|_| FetchError::NotText)
}
