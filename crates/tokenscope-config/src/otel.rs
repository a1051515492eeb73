//! The OpenTelemetry exporter variables (`OTEL_EXPORTER_OTLP_*`) as a configuration layer of
//! `[tracing]`, as the OTLP exporter specification defines them.
//!
//! | variable (generic, then `…_TRACES_…`)                     | key                               |
//! |-----------------------------------------------------------|-----------------------------------|
//! | `OTEL_EXPORTER_OTLP_ENDPOINT`                             | `tracing.otlp_endpoint` (base URL: OTLP/HTTP appends `/v1/traces`) |
//! | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`                      | `tracing.otlp_traces_endpoint` (used as is) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`                    | `tracing.otlp_protocol` (`grpc`, `http/protobuf`) |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`                     | `tracing.headers.<name>`          |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE`                 | `tracing.ca_file`                 |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]CLIENT_CERTIFICATE`          | `tracing.client_cert`             |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]CLIENT_KEY`                  | `tracing.client_key`              |
//! | `OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT` (milliseconds)      | `tracing.export_timeout`          |
//!
//! Invariants:
//! * Precedence, lowest first: defaults → file → generic `OTEL_EXPORTER_OTLP_*` → signal-specific
//!   `OTEL_EXPORTER_OTLP_TRACES_*` → `TOKENSCOPE_TRACING__*` → command-line flags. Headers merge
//!   by name (a later source replaces one header, not the list).
//! * `…_HEADERS` is a comma-separated list of `name=value` (W3C Baggage style); names are
//!   trimmed and lower-cased, values trimmed and percent-decoded. A malformed entry is an error
//!   that names the variable and the entry's position, never its value: header values are
//!   secrets (API keys) and are never logged or echoed.
//! * Empty variables are ignored (unset).

use std::fmt;
use tokenscope_core::percent_decode;

/// The prefix of the exporter variables.
pub const OTEL_PREFIX: &str = "OTEL_EXPORTER_OTLP_";

/// The `[tracing]` key each variable suffix sets (the headers are handled apart).
const KEYS: [(&str, &str); 6] = [
    ("PROTOCOL", "otlp_protocol"),
    ("CERTIFICATE", "ca_file"),
    ("CLIENT_CERTIFICATE", "client_cert"),
    ("CLIENT_KEY", "client_key"),
    ("TIMEOUT", "export_timeout"),
    ("HEADERS", "headers"),
];

/// A malformed `OTEL_EXPORTER_OTLP_*HEADERS` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadersError {
    /// The variable.
    pub var: String,
    /// Position of the entry (1-based).
    pub entry: usize,
    /// What is wrong (never the value).
    pub why: &'static str,
}

impl fmt::Display for HeadersError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "environment variable {}: entry {} {} (expected name=value,name2=value2)",
            self.var, self.entry, self.why
        )
    }
}

impl std::error::Error for HeadersError {}

/// An exporter variable that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OtelError {
    /// A malformed headers list.
    #[error("{0}")]
    Headers(HeadersError),
    /// A timeout that is not an integer number of milliseconds.
    #[error("environment variable {var}: {value:?} is not a timeout (an integer number of milliseconds)")]
    Timeout {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
    },
}

/// Parses an OTLP headers list: `k=v,k2=v2`, values percent-decoded. See the module docs.
pub fn parse_headers(var: &str, text: &str) -> Result<Vec<(String, String)>, HeadersError> {
    let mut out = Vec::new();
    for (i, item) in text.split(',').enumerate() {
        if item.trim().is_empty() {
            continue;
        }
        let err = |why| HeadersError {
            var: var.to_owned(),
            entry: i + 1,
            why,
        };
        let (k, v) = item.split_once('=').ok_or_else(|| err("has no '='"))?;
        let k = k.trim();
        if k.is_empty() || !k.bytes().all(is_token_char) {
            return Err(err("has an invalid header name"));
        }
        let v = percent_decode(v.trim()).ok_or_else(|| err("has a malformed %-escape"))?;
        out.push((k.to_ascii_lowercase(), v));
    }
    Ok(out)
}

/// An HTTP token character (RFC 9110 `tchar`).
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// One setting from an exporter variable: the key path below the root and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtelSetting {
    /// The variable it came from.
    pub var: String,
    /// The key path (`["tracing", "headers", "authorization"]`).
    pub path: Vec<String>,
    /// The value (text, typed by the field that reads it).
    pub value: String,
}

/// The settings of the exporter variables among `vars`, in the order they apply (generic
/// first, then the traces-specific ones). See the module docs.
pub fn settings(vars: &[(String, String)]) -> Result<Vec<OtelSetting>, OtelError> {
    let mut out = Vec::new();
    for traces in [false, true] {
        let lookup = |suffix: &str| {
            let var = if traces {
                format!("{OTEL_PREFIX}TRACES_{suffix}")
            } else {
                format!("{OTEL_PREFIX}{suffix}")
            };
            vars.iter()
                .rev()
                .find(|(k, _)| *k == var)
                .filter(|(_, v)| !v.trim().is_empty())
                .map(|(_, v)| (var, v.trim().to_owned()))
        };
        let key = |k: &str| vec!["tracing".to_owned(), k.to_owned()];
        if let Some((var, value)) = lookup("ENDPOINT") {
            let k = if traces {
                "otlp_traces_endpoint"
            } else {
                "otlp_endpoint"
            };
            out.push(OtelSetting {
                var,
                path: key(k),
                value,
            });
        }
        for (suffix, k) in KEYS {
            let Some((var, value)) = lookup(suffix) else {
                continue;
            };
            if suffix == "TIMEOUT" && value.parse::<u64>().is_err() {
                return Err(OtelError::Timeout { var, value });
            }
            if suffix == "HEADERS" {
                for (name, v) in parse_headers(&var, &value).map_err(OtelError::Headers)? {
                    out.push(OtelSetting {
                        var: var.clone(),
                        path: vec!["tracing".into(), "headers".into(), name],
                        value: v,
                    });
                }
            } else {
                out.push(OtelSetting {
                    var,
                    path: key(k),
                    value,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn headers_list() {
        assert_eq!(
            parse_headers(
                "V",
                " Authorization = Bearer%20abc%3D ,x-team=infra,, api-key=a=b"
            )
            .expect("valid"),
            vec![
                ("authorization".to_owned(), "Bearer abc=".to_owned()),
                ("x-team".to_owned(), "infra".to_owned()),
                ("api-key".to_owned(), "a=b".to_owned()),
            ]
        );
        assert_eq!(parse_headers("V", "").expect("empty"), vec![]);
        for (bad, why) in [
            ("a=1,secret-without-equals", "has no '='"),
            ("a=1,=x", "has an invalid header name"),
            ("a b=x", "has an invalid header name"),
            ("a=%zz-secret", "has a malformed %-escape"),
        ] {
            let err = parse_headers("OTEL_EXPORTER_OTLP_HEADERS", bad).expect_err(bad);
            assert_eq!(err.why, why, "{bad}");
            let msg = err.to_string();
            assert!(msg.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{msg}");
            assert!(!msg.contains("secret") && !msg.contains("zz"), "{msg}");
        }
    }

    #[test]
    fn generic_then_traces_specific() {
        let got = settings(&vars(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://c:4318/custom",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "a=1,b=2"),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "b=3"),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/ca.pem"),
            ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "/c.pem"),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/k.pem"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://other"),
            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", " "),
        ]))
        .expect("valid");
        let flat: Vec<(String, String)> = got
            .iter()
            .map(|s| (s.path.join("."), s.value.clone()))
            .collect();
        let want = [
            ("tracing.otlp_endpoint", "https://collector:4318"),
            ("tracing.otlp_protocol", "grpc"),
            ("tracing.ca_file", "/ca.pem"),
            ("tracing.client_key", "/k.pem"),
            ("tracing.export_timeout", "2500"),
            ("tracing.headers.a", "1"),
            ("tracing.headers.b", "2"),
            ("tracing.otlp_traces_endpoint", "https://c:4318/custom"),
            ("tracing.otlp_protocol", "http/protobuf"),
            ("tracing.client_cert", "/c.pem"),
            ("tracing.headers.b", "3"),
        ];
        assert_eq!(
            flat,
            want.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<Vec<_>>()
        );
        assert_eq!(got[0].var, "OTEL_EXPORTER_OTLP_ENDPOINT");
        assert!(settings(&vars(&[("OTEL_EXPORTER_OTLP_HEADERS", "nope")])).is_err());
        assert!(matches!(
            settings(&vars(&[("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2s")])),
            Err(OtelError::Timeout { .. })
        ));
    }
}
