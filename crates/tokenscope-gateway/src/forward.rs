//! Building the upstream request and the client's response head.
//!
//! Invariants:
//! * Hop-by-hop headers ([`HOP_BY_HOP`]) are never forwarded, either way; `content-length` is
//!   set from the body actually forwarded.
//! * A measured request keeps the gateway's attribution headers (`x-tokenscope-*`) and
//!   `accept-encoding` to itself (responses must stay readable: identity), carries the
//!   request's `traceparent` and `x-request-id` (the id the client sees), and goes in
//!   origin-form over the upstream's own pool (which sets `Host`).
//! * A pass-through request is forwarded as received otherwise.
//! * Every request to an upstream, measured or not, gets that upstream's credentials in one
//!   place ([`upstream_headers`]): its configured headers, and the client's credential headers
//!   removed or kept as `client_authorization` says (`tokenscope_config::credentials`).

use crate::failure::Failure;
use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::Uri;
use http_body_util::Full;
use tokenscope_config::UpstreamCredentials;

/// Headers that describe one hop only and must not be forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
];

/// Builds the upstream URI: base URL (with an optional path prefix) + path and query.
fn upstream_uri(base: &Uri, original: &Uri) -> Result<Uri, http::Error> {
    let pq = original.path_and_query().map_or("/", |p| p.as_str());
    let prefix = base.path().trim_end_matches('/');
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(format!("{prefix}{pq}").parse()?);
    Ok(Uri::from_parts(parts)?)
}

/// The upstream request target in origin-form: the base URL's path prefix + path and query.
fn origin_form(base: &Uri, original: &Uri) -> Result<Uri, http::Error> {
    let pq = original.path_and_query().map_or("/", |p| p.as_str());
    let prefix = base.path().trim_end_matches('/');
    Ok(format!("{prefix}{pq}").parse()?)
}

/// The headers of a request to an upstream: the client's (less hop-by-hop ones, less the
/// gateway's own on a `measured` request), then the upstream's credentials applied.
fn upstream_headers(
    src: &HeaderMap,
    dst: &mut HeaderMap,
    measured: bool,
    creds: &UpstreamCredentials,
) {
    copy_request_headers(src, dst, measured);
    creds.apply(dst);
}

fn copy_request_headers(src: &HeaderMap, dst: &mut HeaderMap, measured: bool) {
    for (k, v) in src {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || name == "content-length" {
            continue;
        }
        if measured && (name.starts_with("x-tokenscope-") || name == "accept-encoding") {
            // Our attribution headers stay here; responses must stay readable (identity).
            continue;
        }
        dst.append(k.clone(), v.clone());
    }
}

/// The request to the upstream's pool: origin-form, HTTP/1.1, headers of `parts` (see the
/// module docs for what a `measured` request drops), `content-length` when the body is not
/// empty or the client declared one.
fn pooled(
    parts: &Parts,
    base: &Uri,
    creds: &UpstreamCredentials,
    body: Bytes,
    measured: bool,
    extra: impl FnOnce(&mut HeaderMap),
) -> Result<http::Request<Full<Bytes>>, Failure> {
    // Origin-form: the connection is to the upstream itself (`Host` is set by the pool).
    let uri = origin_form(base, &parts.uri).map_err(|e| Failure::BadUri(e.to_string()))?;
    let mut up = http::Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .version(http::Version::HTTP_11);
    if let Some(h) = up.headers_mut() {
        upstream_headers(&parts.headers, h, measured, creds);
        extra(h);
        if measured || !body.is_empty() || parts.headers.contains_key(header::CONTENT_LENGTH) {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        }
    }
    up.body(Full::new(body))
        .map_err(|e| Failure::BadRequest(e.to_string()))
}

/// A measured request to its upstream, with the request's `traceparent` and the id the
/// client sees as `x-request-id`.
pub(crate) fn measured(
    parts: &Parts,
    base: &Uri,
    creds: &UpstreamCredentials,
    body: Bytes,
    traceparent: &str,
    request_id: &str,
) -> Result<http::Request<Full<Bytes>>, Failure> {
    pooled(parts, base, creds, body, true, |h| {
        if let Ok(v) = HeaderValue::from_str(traceparent) {
            h.insert(HeaderName::from_static("traceparent"), v);
        }
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert(HeaderName::from_static(crate::attribution::REQUEST_ID), v);
        }
    })
}

/// A pass-through request whose body was read whole, for the upstream's pool.
pub(crate) fn passthrough_pooled(
    parts: &Parts,
    base: &Uri,
    creds: &UpstreamCredentials,
    body: Bytes,
) -> Result<http::Request<Full<Bytes>>, Failure> {
    pooled(parts, base, creds, body, false, |_| {})
}

/// The client's `GET` of the model list, sent to one of several upstreams (`crate::models`):
/// a pass-through request without `accept-encoding` (the answers are read and merged).
pub(crate) fn listing(
    parts: &Parts,
    base: &Uri,
    creds: &UpstreamCredentials,
) -> Result<http::Request<Full<Bytes>>, Failure> {
    pooled(parts, base, creds, Bytes::new(), false, |h| {
        h.remove(header::ACCEPT_ENCODING);
    })
}

/// A pass-through request whose body streams (absolute-form, for the hyper-util client).
pub(crate) fn passthrough_streamed(
    parts: Parts,
    base: &Uri,
    creds: &UpstreamCredentials,
    body: Body,
) -> Result<http::Request<Body>, Failure> {
    let uri = upstream_uri(base, &parts.uri).map_err(|e| Failure::BadUri(e.to_string()))?;
    let mut up = http::Request::builder().method(parts.method).uri(uri);
    if let Some(h) = up.headers_mut() {
        upstream_headers(&parts.headers, h, false, creds);
        if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
            h.insert(header::CONTENT_LENGTH, len.clone());
        }
    }
    up.body(body)
        .map_err(|e| Failure::BadRequest(e.to_string()))
}

/// The client's response: the upstream's status and headers (less hop-by-hop ones, and less
/// `content-length` when `drop_length`: the body is changed) around `body`.
pub(crate) fn response(parts: &http::response::Parts, body: Body, drop_length: bool) -> Response {
    let mut out = Response::new(body);
    *out.status_mut() = parts.status;
    let dst = out.headers_mut();
    for (k, v) in &parts.headers {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || (drop_length && name == "content-length") {
            continue;
        }
        dst.append(k.clone(), v.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_join() {
        let base: Uri = "http://127.0.0.1:8080/prefix/".parse().expect("uri");
        let orig: Uri = "/v1/models?x=1".parse().expect("uri");
        assert_eq!(
            upstream_uri(&base, &orig).expect("join").to_string(),
            "http://127.0.0.1:8080/prefix/v1/models?x=1"
        );
    }

    #[test]
    fn origin_form_keeps_the_prefix() {
        let base: Uri = "http://127.0.0.1:8080/prefix/".parse().expect("uri");
        let orig: Uri = "/v1/chat/completions?x=1".parse().expect("uri");
        assert_eq!(
            origin_form(&base, &orig).expect("join").to_string(),
            "/prefix/v1/chat/completions?x=1"
        );
        let base: Uri = "http://engine:8000".parse().expect("uri");
        assert_eq!(
            origin_form(&base, &orig).expect("join").to_string(),
            "/v1/chat/completions?x=1"
        );
    }

    fn parts(headers: &[(&'static str, &'static str)]) -> Parts {
        let mut b = http::Request::builder()
            .method("POST")
            .uri("/v1/chat/completions");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn measured_headers() {
        let p = parts(&[
            ("connection", "keep-alive"),
            ("content-length", "99"),
            ("accept-encoding", "gzip"),
            ("x-tokenscope-user", "u"),
            ("x-request-id", "theirs"),
            ("authorization", "Bearer k"),
        ]);
        let base: Uri = "http://engine:8000/p".parse().expect("uri");
        let none = UpstreamCredentials::default();
        let r = measured(
            &p,
            &base,
            &none,
            Bytes::from_static(b"{}"),
            "00-tp",
            "shown",
        )
        .expect("req");
        let h = r.headers();
        assert_eq!(r.uri().to_string(), "/p/v1/chat/completions");
        assert_eq!(r.version(), http::Version::HTTP_11);
        assert_eq!(h["content-length"], "2");
        assert_eq!(h["traceparent"], "00-tp");
        assert_eq!(h["x-request-id"], "shown");
        assert_eq!(h["authorization"], "Bearer k");
        for gone in ["connection", "accept-encoding", "x-tokenscope-user"] {
            assert!(!h.contains_key(gone), "{gone}");
        }
    }

    #[test]
    fn passthrough_headers() {
        let base: Uri = "http://engine:8000".parse().expect("uri");
        let p = parts(&[("accept-encoding", "gzip"), ("x-tokenscope-user", "u")]);
        let none = UpstreamCredentials::default();
        let r = passthrough_pooled(&p, &base, &none, Bytes::new()).expect("req");
        assert_eq!(r.headers()["accept-encoding"], "gzip");
        assert_eq!(r.headers()["x-tokenscope-user"], "u");
        // An empty body the client did not declare gets no length.
        assert!(!r.headers().contains_key("content-length"));
        let p = parts(&[("content-length", "0")]);
        let r = passthrough_pooled(&p, &base, &none, Bytes::new()).expect("req");
        assert_eq!(r.headers()["content-length"], "0");
    }

    /// One upstream with a key (`client_authorization` as given) and a literal extra header.
    fn creds(mode: Option<tokenscope_config::ClientAuthorization>) -> UpstreamCredentials {
        let mut cfg = crate::GatewayConfig::default();
        cfg.set_single_upstream("http://engine:8000");
        let u = &mut cfg.upstreams[0];
        u.api_key_env = Some("K".into());
        u.client_authorization = mode;
        u.headers.insert(
            "OpenAI-Organization".into(),
            tokenscope_config::SecretSource::Value("org-1".into()),
        );
        UpstreamCredentials::resolve(u, |_| Some("up-key".into())).expect("resolved")
    }

    /// Measured, pass-through (pooled and streamed) and listing requests get the same
    /// credentials: the upstream's key instead of the client's (replace) or the client's
    /// (keep).
    #[test]
    fn every_request_gets_the_upstream_credentials() {
        use tokenscope_config::ClientAuthorization::{Keep, Replace};
        let base: Uri = "http://engine:8000".parse().expect("uri");
        let p = parts(&[
            ("authorization", "Bearer client"),
            ("x-api-key", "client-x"),
        ]);
        for (mode, auth, x_api_key) in [
            (None, "Bearer up-key", None),
            (Some(Replace), "Bearer up-key", None),
            (Some(Keep), "Bearer client", Some("client-x")),
        ] {
            let c = creds(mode);
            let heads = [
                measured(&p, &base, &c, Bytes::from_static(b"{}"), "00-tp", "id")
                    .expect("req")
                    .headers()
                    .clone(),
                passthrough_pooled(&p, &base, &c, Bytes::new())
                    .expect("req")
                    .headers()
                    .clone(),
                passthrough_streamed(p.clone(), &base, &c, Body::empty())
                    .expect("req")
                    .headers()
                    .clone(),
                listing(&p, &base, &c).expect("req").headers().clone(),
            ];
            for h in heads {
                assert_eq!(h["authorization"], auth, "{mode:?}");
                assert_eq!(
                    h.get("x-api-key").and_then(|v| v.to_str().ok()),
                    x_api_key,
                    "{mode:?}"
                );
                assert_eq!(h["openai-organization"], "org-1");
            }
        }
        // Without credentials the client's headers pass unchanged.
        let none = UpstreamCredentials::default();
        let r = passthrough_pooled(&p, &base, &none, Bytes::new()).expect("req");
        assert_eq!(r.headers()["authorization"], "Bearer client");
        assert_eq!(r.headers()["x-api-key"], "client-x");
    }

    #[test]
    fn listing_asks_for_a_readable_answer() {
        let base: Uri = "http://engine:8000/p".parse().expect("uri");
        let p = http::Request::get("/v1/models?x=1")
            .header("accept-encoding", "gzip")
            .header("accept", "application/json")
            .body(())
            .expect("request")
            .into_parts()
            .0;
        let r = listing(&p, &base, &UpstreamCredentials::default()).expect("req");
        assert_eq!(r.uri().to_string(), "/p/v1/models?x=1");
        assert_eq!(r.method(), http::Method::GET);
        assert!(!r.headers().contains_key("accept-encoding"));
        assert!(!r.headers().contains_key("content-length"));
        assert_eq!(r.headers()["accept"], "application/json");
    }

    #[test]
    fn response_head() {
        let (mut parts, ()) = http::Response::builder()
            .status(201)
            .header("content-length", "5")
            .header("transfer-encoding", "chunked")
            .header("x-a", "1")
            .body(())
            .expect("response")
            .into_parts();
        let r = response(&parts, Body::empty(), true);
        assert_eq!(r.status(), 201);
        assert!(!r.headers().contains_key("content-length"));
        assert!(!r.headers().contains_key("transfer-encoding"));
        assert_eq!(r.headers()["x-a"], "1");
        parts.status = http::StatusCode::OK;
        let r = response(&parts, Body::empty(), false);
        assert_eq!(r.headers()["content-length"], "5");
    }
}
