//! Who a measured request is for, read from its headers, and the ids it carries.
//!
//! Invariants:
//! * Every attribution value is bounded: at most `limits.max_attribution_bytes` bytes, cut at a
//!   character boundary and marked with [`TRUNCATED`] ([`bounded`]); never silently cut, never
//!   unbounded.
//! * A raw API key never leaves [`Attribution::from_headers`]: only the first 16 hex digits of
//!   its SHA-256 are kept (`api_key_id`); the configured key map is looked up by the full hash.
//! * Headers win over the API-key map (a key's tenant / business line fills only what the
//!   headers left empty); the body's `user` (see [`crate::plan`]) fills only an absent user.
//! * The store's key is always the gateway's own UUIDv7: a client's `x-request-id` is data,
//!   kept when valid (printable ASCII, at most 128 bytes) and shown back to the client.
//!
//! Everything here but [`RequestIds::new`] (which draws a UUID) is pure.

use crate::config::ApiKeyConfig;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use std::collections::HashMap;
use tokenscope_core::{Endpoint, RequestRecord};

/// Header carrying the client's request id (in, forwarded to the engine unchanged, and out):
/// the client's own when it sent a valid one, the gateway's otherwise.
pub const REQUEST_ID: &str = "x-request-id";
/// Response header carrying the gateway's own request id: the store's key (`request_id`),
/// always a UUIDv7 the gateway generated, whatever the client sent.
pub const TOKENSCOPE_REQUEST_ID: &str = "x-tokenscope-request-id";
/// Response header carrying the trace id.
pub const TRACE_ID: &str = "x-tokenscope-trace-id";

const H_USER: &str = "x-tokenscope-user";
const H_TENANT: &str = "x-tokenscope-tenant";
const H_BUSINESS_LINE: &str = "x-tokenscope-business-line";
const H_REQUEST_TYPE: &str = "x-tokenscope-request-type";

/// Marks an attribution value cut at `max_attribution_bytes`.
pub(crate) const TRUNCATED: &str = "…[truncated]";

/// An attribution value as stored and labelled: at most `max` bytes of it (cut at a character
/// boundary) followed by [`TRUNCATED`] when it was longer — never silently cut, never
/// unbounded (a client sending 390 KB headers must not make every record 390 KB).
pub(crate) fn bounded(v: &str, max: usize) -> String {
    if v.len() <= max {
        return v.to_owned();
    }
    let mut end = max;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{TRUNCATED}", &v[..end])
}

/// A header's value, trimmed; `None` when absent, empty or not visible ASCII/UTF-8.
pub(crate) fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// The API key presented by the client, if any (`Authorization: Bearer`, `x-api-key`, `api-key`).
fn api_key(h: &HeaderMap) -> Option<&str> {
    header_str(h, "authorization")
        .and_then(|a| {
            a.strip_prefix("Bearer ")
                .or_else(|| a.strip_prefix("bearer "))
        })
        .map(str::trim)
        .or_else(|| header_str(h, "x-api-key"))
        .or_else(|| header_str(h, "api-key"))
        .filter(|k| !k.is_empty())
}

fn valid_request_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// Attribution read from the request headers and the API-key map (bounded values).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Attribution {
    /// `x-tokenscope-user`.
    pub user_id: Option<String>,
    /// `x-tokenscope-tenant`, else the API key's tenant.
    pub tenant: Option<String>,
    /// `x-tokenscope-business-line`, else the API key's business line.
    pub business_line: Option<String>,
    /// `x-tokenscope-request-type`, else the endpoint's default.
    pub request_type: String,
    /// The first 16 hex digits of the presented API key's SHA-256.
    pub api_key_id: Option<String>,
}

impl Attribution {
    /// Reads the attribution headers of a request to `endpoint`; values longer than `max`
    /// bytes are [`bounded`].
    pub(crate) fn from_headers(
        h: &HeaderMap,
        endpoint: Endpoint,
        max: usize,
        keys: &HashMap<String, ApiKeyConfig>,
    ) -> Self {
        let attr = |name: &str| header_str(h, name).map(|v| bounded(v, max));
        let mut a = Attribution {
            user_id: attr(H_USER),
            tenant: attr(H_TENANT),
            business_line: attr(H_BUSINESS_LINE),
            request_type: attr(H_REQUEST_TYPE)
                .unwrap_or_else(|| endpoint.default_request_type().to_owned()),
            api_key_id: None,
        };
        if let Some(key) = api_key(h) {
            let hash = crate::config::sha256_hex(key);
            a.api_key_id = Some(hash[..16].to_owned());
            if let Some(entry) = keys.get(&hash) {
                if a.tenant.is_none() {
                    a.tenant.clone_from(&entry.tenant);
                }
                if a.business_line.is_none() {
                    a.business_line.clone_from(&entry.business_line);
                }
            }
        }
        a
    }

    /// Puts the attribution on a record.
    pub(crate) fn apply(self, rec: &mut RequestRecord) {
        rec.user_id = self.user_id;
        rec.tenant = self.tenant;
        rec.business_line = self.business_line;
        rec.request_type = self.request_type;
        rec.api_key_id = self.api_key_id;
    }
}

/// The ids a measured request's answers carry (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestIds {
    /// The gateway's own id, the store's key (`request_id`, a UUIDv7).
    pub key: String,
    /// The client's valid `x-request-id`, if it sent one.
    pub client: Option<String>,
    /// The trace id (hex).
    pub trace: String,
}

/// A UUIDv7 key: the Unix time in ms and random bits from the thread's `fastrand` generator
/// (`Uuid::now_v7` reads the OS generator: a `getrandom` syscall on every request).
fn new_key() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut rnd = [0u8; 10];
    fastrand::fill(&mut rnd);
    uuid::Builder::from_unix_timestamp_millis(ms, &rnd)
        .into_uuid()
        .to_string()
}

impl RequestIds {
    /// A new key, the client's id from `h` (when valid) and `trace`.
    pub(crate) fn new(h: &HeaderMap, trace: String) -> Self {
        Self::with_key(new_key(), h, trace)
    }

    fn with_key(key: String, h: &HeaderMap, trace: String) -> Self {
        RequestIds {
            key,
            client: header_str(h, REQUEST_ID)
                .filter(|s| valid_request_id(s))
                .map(str::to_owned),
            trace,
        }
    }

    /// What the client sees as `x-request-id` (and the engine receives): the client's own id
    /// when it sent one, the gateway's otherwise.
    pub(crate) fn shown(&self) -> &str {
        self.client.as_deref().unwrap_or(&self.key)
    }

    /// Sets the response's id headers: `x-request-id` = [`Self::shown`],
    /// `x-tokenscope-request-id` = the key, and the trace id.
    pub(crate) fn set_on(&self, h: &mut HeaderMap) {
        for (name, value) in [
            (REQUEST_ID, self.shown()),
            (TOKENSCOPE_REQUEST_ID, self.key.as_str()),
            (TRACE_ID, self.trace.as_str()),
        ] {
            if let Ok(v) = HeaderValue::from_str(value) {
                h.insert(HeaderName::from_static(name), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_distinct_uuid_v7_of_now() {
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64;
        let keys: std::collections::HashSet<String> = (0..1000).map(|_| new_key()).collect();
        assert_eq!(keys.len(), 1000);
        for k in &keys {
            let u = uuid::Uuid::parse_str(k).expect("a uuid");
            assert_eq!(u.get_version_num(), 7, "{k}");
            let (s, ns) = u.get_timestamp().expect("v7 has a time").to_unix();
            let ms = s * 1000 + u64::from(ns) / 1_000_000;
            assert!(
                ms >= before && ms <= before + 60_000,
                "{k}: {ms} vs {before}"
            );
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn api_key_sources() {
        let h = headers(&[("authorization", "Bearer sk-1")]);
        assert_eq!(api_key(&h), Some("sk-1"));
        let h = headers(&[("authorization", "bearer  sk-2 ")]);
        assert_eq!(api_key(&h), Some("sk-2"));
        let h = headers(&[("x-api-key", "k2")]);
        assert_eq!(api_key(&h), Some("k2"));
        let h = headers(&[("api-key", "k3")]);
        assert_eq!(api_key(&h), Some("k3"));
        let h = headers(&[("authorization", "Basic abc")]);
        assert_eq!(api_key(&h), None);
        assert!(valid_request_id("abc-123"));
        assert!(!valid_request_id("has space"));
        assert!(!valid_request_id(""));
        assert!(!valid_request_id(&"x".repeat(129)));
    }

    #[test]
    fn bounded_values_are_cut_at_a_char_boundary_and_marked() {
        assert_eq!(bounded("short", 10), "short");
        assert_eq!(bounded("abcdef", 3), format!("abc{TRUNCATED}"));
        // 'é' is two bytes: a cut inside it moves back to its start.
        assert_eq!(bounded("aé", 2), format!("a{TRUNCATED}"));
    }

    #[test]
    fn headers_win_over_the_key_map_and_values_are_bounded() {
        let key = "sk-secret";
        let mut keys = HashMap::new();
        keys.insert(
            crate::config::sha256_hex(key),
            ApiKeyConfig {
                tenant: Some("key-tenant".into()),
                business_line: Some("key-line".into()),
                key: None,
                key_sha256: None,
            },
        );
        let h = headers(&[
            ("authorization", "Bearer sk-secret"),
            (H_TENANT, "header-tenant"),
            (H_USER, "  alice  "),
        ]);
        let a = Attribution::from_headers(&h, Endpoint::ChatCompletions, 64, &keys);
        assert_eq!(a.user_id.as_deref(), Some("alice"));
        assert_eq!(a.tenant.as_deref(), Some("header-tenant"));
        assert_eq!(a.business_line.as_deref(), Some("key-line"));
        assert_eq!(a.request_type, "chat");
        let id = a.api_key_id.expect("key id");
        assert_eq!(id.len(), 16);
        assert_eq!(id, crate::config::sha256_hex(key)[..16]);

        let h = headers(&[(H_REQUEST_TYPE, "summary-of-a-very-long-type")]);
        let a = Attribution::from_headers(&h, Endpoint::Embeddings, 7, &HashMap::new());
        assert_eq!(a.request_type, format!("summary{TRUNCATED}"));
        assert_eq!(a.api_key_id, None);
        assert_eq!(a.tenant, None);

        let a = Attribution::from_headers(&HeaderMap::new(), Endpoint::Embeddings, 7, &keys);
        assert_eq!(a.request_type, Endpoint::Embeddings.default_request_type());
    }

    #[test]
    fn ids_show_the_clients_id_and_keep_ours_as_the_key() {
        let h = headers(&[(REQUEST_ID, "client-1")]);
        let ids = RequestIds::with_key("ours".into(), &h, "t".into());
        assert_eq!(ids.shown(), "client-1");
        let mut out = HeaderMap::new();
        ids.set_on(&mut out);
        assert_eq!(out[REQUEST_ID], "client-1");
        assert_eq!(out[TOKENSCOPE_REQUEST_ID], "ours");
        assert_eq!(out[TRACE_ID], "t");

        let h = headers(&[(REQUEST_ID, "not valid")]);
        let ids = RequestIds::with_key("ours".into(), &h, "t".into());
        assert_eq!(ids.client, None);
        assert_eq!(ids.shown(), "ours");
    }
}
