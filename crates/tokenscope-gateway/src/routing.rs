//! The model a pass-through request names, so that it is routed like a measured one
//! (`Shared::route`): requests the gateway does not measure (`/tokenize`, `/v1/audio/speech`,
//! `/v1/models/{model}`, an engine's native routes) reach the upstream that serves their
//! model, not always the default one.
//!
//! Where the model is read, in order:
//! 1. a body read whole (a known length, at most `max_body_bytes`) that is JSON — a JSON
//!    `content-type` (`application/json`, `…+json`), or none and a body starting with `{` —
//!    with a top-level string `model`. The body is scanned, not built into a tree (other
//!    fields are skipped), and forwarded unchanged;
//! 2. the path `/v1/models/{model}` or `/models/{model}` (any method; the rest of the path,
//!    percent-decoded, so `meta-llama/Llama-3` and `meta-llama%2FLlama-3` both work).
//!
//! Anything else — a body that is not JSON (multipart forms such as audio transcriptions), a
//! JSON body that does not parse or has no string `model`, a body of unknown length (chunked,
//! or HTTP/2 without `content-length`: it streams through and is not read first) — goes to
//! the default upstream, as before. The query string is not read.
//!
//! Invariant: pure and allocation-light; nothing here changes what is forwarded.

use http::header::{self, HeaderMap};
use serde::Deserialize;

/// Whether `h` declares a JSON body, or declares no type (then the body decides).
fn json_type(h: &HeaderMap) -> Option<bool> {
    let ct = h.get(header::CONTENT_TYPE)?;
    let mime = ct
        .to_str()
        .ok()
        .and_then(|v| v.split(';').next())
        .map(|m| m.trim().to_ascii_lowercase())
        .unwrap_or_default();
    Some(mime == "application/json" || mime.ends_with("+json"))
}

/// The top-level string `model` of a JSON body.
fn body_model(h: &HeaderMap, body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct ModelOnly {
        #[serde(default)]
        model: Option<String>,
    }
    // An object (a derived struct would also read an array's first element as `model`).
    let object = body
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !object || json_type(h) == Some(false) {
        return None;
    }
    let m = serde_json::from_slice::<ModelOnly>(body).ok()?.model?;
    (!m.is_empty()).then_some(m)
}

/// The `{model}` of `/v1/models/{model}` or `/models/{model}`, percent-decoded.
fn path_model(path: &str) -> Option<String> {
    let rest = path
        .strip_prefix("/v1/models/")
        .or_else(|| path.strip_prefix("/models/"))?;
    let m = percent_encoding::percent_decode_str(rest)
        .decode_utf8()
        .ok()?
        .into_owned();
    (!m.is_empty()).then_some(m)
}

/// The model a pass-through request names: its body's (`body`: read whole), else its path's.
pub(crate) fn passthrough_model(
    parts: &http::request::Parts,
    body: Option<&[u8]>,
) -> Option<String> {
    body.and_then(|b| body_model(&parts.headers, b))
        .or_else(|| path_model(parts.uri.path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str, content_type: Option<&str>) -> http::request::Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        if let Some(ct) = content_type {
            b = b.header("content-type", ct);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn model_from_a_json_body() {
        let json = Some("application/json");
        for (ct, body, want) in [
            (json, r#"{"model":"b-model","input":"hi"}"#, Some("b-model")),
            (
                Some("application/json; charset=utf-8"),
                r#"{"content":"x","model":"b"}"#,
                Some("b"),
            ),
            (
                Some("application/vnd.api+json"),
                r#"{"model":"b"}"#,
                Some("b"),
            ),
            (None, r#"  {"model":"b"}"#, Some("b")),
            (json, r#"{"model":"a\u002db"}"#, Some("a-b")),
            (json, r#"{"input":{"model":"nested"}}"#, None),
            (json, r#"{"model":3}"#, None),
            (json, r#"{"model":""}"#, None),
            (json, r#"{"model":"b""#, None),
            (json, r#"["model"]"#, None),
            (json, "", None),
            (
                Some("multipart/form-data; boundary=x"),
                r#"{"model":"b"}"#,
                None,
            ),
            (Some("text/plain"), r#"{"model":"b"}"#, None),
            (None, "model=b", None),
        ] {
            let p = parts("POST", "/tokenize", ct);
            assert_eq!(
                passthrough_model(&p, Some(body.as_bytes())).as_deref(),
                want,
                "{ct:?} {body}"
            );
        }
    }

    #[test]
    fn model_from_the_path() {
        for (uri, want) in [
            ("/v1/models/b-model", Some("b-model")),
            ("/models/b-model", Some("b-model")),
            ("/v1/models/meta-llama/Llama-3", Some("meta-llama/Llama-3")),
            (
                "/v1/models/meta-llama%2FLlama-3?x=1",
                Some("meta-llama/Llama-3"),
            ),
            ("/v1/models/", None),
            ("/v1/models", None),
            ("/v1/modelsX/b", None),
            ("/health", None),
        ] {
            assert_eq!(
                passthrough_model(&parts("GET", uri, None), None).as_deref(),
                want,
                "{uri}"
            );
        }
        // The body's model wins over the path's.
        let p = parts("POST", "/v1/models/a", Some("application/json"));
        assert_eq!(
            passthrough_model(&p, Some(br#"{"model":"b"}"#)).as_deref(),
            Some("b")
        );
    }
}
