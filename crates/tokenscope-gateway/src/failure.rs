//! The one failure path of the request path: every error the gateway itself answers.
//!
//! Invariants:
//! * A measured request that fails before its response goes through [`fail`] only: the record
//!   is finished with the failure's outcome, error type and status, and the client gets the
//!   JSON error (OpenAI shape, `type: tokenscope_error`) with the request's id headers.
//! * What the record says and what the client is answered are both stated by [`Failure`], in
//!   one table ([`Failure::record`], [`Failure::answer`]); they differ only where the client
//!   is gone (`client_body_error`: recorded 499, answered 400) or the record names the phase
//!   (`upstream_header_timeout`, answered `upstream_timeout`).

use crate::attribution::RequestIds;
use crate::recording::RecordGuard;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use std::borrow::Cow;
use std::time::Instant;
use tokenscope_core::Outcome;

/// JSON error body in the OpenAI shape.
pub(crate) fn error_response(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({
        "error": {"message": message, "type": "tokenscope_error", "code": code}
    });
    (status, axum::Json(body)).into_response()
}

const BODY_TIMEOUT_MESSAGE: &str = "the request body did not arrive within limits.body_timeout_ms";
const UPSTREAM_TIMEOUT_MESSAGE: &str = "the upstream did not answer in time";

/// Why the gateway answers a request itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The body is larger than `max_body_bytes` (declared or read).
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The body did not arrive within `limits.body_timeout_ms`.
    BodyTimeout,
    /// The client's body stream broke (it went away).
    BodyFailed,
    /// No upstream to route to.
    NoUpstream,
    /// The upstream URI could not be built.
    BadUri(String),
    /// The upstream request could not be built.
    BadRequest(String),
    /// The upstream sent no response headers within `upstream_timeout_ms`.
    UpstreamTimeout,
    /// The upstream connection or exchange failed.
    Upstream {
        /// The error type (`upconn::UpError::code`).
        code: &'static str,
        /// What failed.
        message: String,
    },
}

impl Failure {
    /// The record's outcome, error type and HTTP status.
    pub(crate) fn record(&self) -> (Outcome, &'static str, u16) {
        match self {
            Failure::TooLarge { .. } => (Outcome::ClientError, "body_too_large", 413),
            Failure::BodyTimeout => (Outcome::ClientError, "client_body_timeout", 408),
            Failure::BodyFailed => (Outcome::Cancelled, "client_body_error", 499),
            Failure::NoUpstream => (Outcome::UpstreamError, "no_upstream", 502),
            Failure::BadUri(_) => (Outcome::ClientError, "bad_uri", 400),
            Failure::BadRequest(_) => (Outcome::ClientError, "bad_request", 400),
            Failure::UpstreamTimeout => (Outcome::Timeout, "upstream_header_timeout", 504),
            Failure::Upstream { code, .. } => (Outcome::UpstreamError, code, 502),
        }
    }

    /// The answer's status, error code and message.
    pub(crate) fn answer(&self) -> (StatusCode, &'static str, Cow<'_, str>) {
        match self {
            Failure::TooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("request body exceeds {limit} bytes").into(),
            ),
            Failure::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "client_body_timeout",
                BODY_TIMEOUT_MESSAGE.into(),
            ),
            Failure::BodyFailed => (
                StatusCode::BAD_REQUEST,
                "client_body_error",
                "could not read the request body".into(),
            ),
            Failure::NoUpstream => (
                StatusCode::BAD_GATEWAY,
                "no_upstream",
                "no upstream is configured for this model".into(),
            ),
            Failure::BadUri(m) => (StatusCode::BAD_REQUEST, "bad_uri", m.as_str().into()),
            Failure::BadRequest(m) => (StatusCode::BAD_REQUEST, "bad_request", m.as_str().into()),
            Failure::UpstreamTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
                UPSTREAM_TIMEOUT_MESSAGE.into(),
            ),
            Failure::Upstream { code, message } => {
                (StatusCode::BAD_GATEWAY, code, message.as_str().into())
            }
        }
    }

    /// The JSON error answer alone (pass-through requests have no record).
    pub(crate) fn response(&self) -> Response {
        let (status, code, message) = self.answer();
        error_response(status, code, &message)
    }
}

/// The one failure path of a measured request before its response. See the module docs.
pub(crate) fn fail(mut guard: RecordGuard, failure: Failure, ids: &RequestIds) -> Response {
    let (outcome, error_type, status) = failure.record();
    if let Some(rec) = guard.record() {
        rec.http_status = status;
    }
    guard.finish(Instant::now(), Some((outcome, error_type)));
    let mut r = failure.response();
    ids.set_on(r.headers_mut());
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_table() {
        // (failure, recorded (outcome, error type, status), answered (status, code, message))
        type Recorded = (Outcome, &'static str, u16);
        type Answered = (u16, &'static str, &'static str);
        let rows: Vec<(Failure, Recorded, Answered)> = vec![
            (
                Failure::TooLarge { limit: 10 },
                (Outcome::ClientError, "body_too_large", 413),
                (413, "body_too_large", "request body exceeds 10 bytes"),
            ),
            (
                Failure::BodyTimeout,
                (Outcome::ClientError, "client_body_timeout", 408),
                (408, "client_body_timeout", BODY_TIMEOUT_MESSAGE),
            ),
            (
                Failure::BodyFailed,
                (Outcome::Cancelled, "client_body_error", 499),
                (400, "client_body_error", "could not read the request body"),
            ),
            (
                Failure::NoUpstream,
                (Outcome::UpstreamError, "no_upstream", 502),
                (
                    502,
                    "no_upstream",
                    "no upstream is configured for this model",
                ),
            ),
            (
                Failure::BadUri("u".into()),
                (Outcome::ClientError, "bad_uri", 400),
                (400, "bad_uri", "u"),
            ),
            (
                Failure::BadRequest("r".into()),
                (Outcome::ClientError, "bad_request", 400),
                (400, "bad_request", "r"),
            ),
            (
                Failure::UpstreamTimeout,
                (Outcome::Timeout, "upstream_header_timeout", 504),
                (504, "upstream_timeout", UPSTREAM_TIMEOUT_MESSAGE),
            ),
            (
                Failure::Upstream {
                    code: "upstream_unreachable",
                    message: "upstream e: refused".into(),
                },
                (Outcome::UpstreamError, "upstream_unreachable", 502),
                (502, "upstream_unreachable", "upstream e: refused"),
            ),
        ];
        for (f, rec, ans) in rows {
            let (o, e, s) = f.record();
            assert_eq!((o, e, s), rec, "{f:?}");
            let (status, code, message) = f.answer();
            assert_eq!((status.as_u16(), code, message.as_ref()), ans, "{f:?}");
        }
    }
}
