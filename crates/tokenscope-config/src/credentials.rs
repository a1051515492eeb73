//! Credentials per upstream: an API key and extra headers sent to one `[[upstreams]]` entry,
//! and what happens to the client's own credentials there.
//!
//! ```toml
//! [[upstreams]]
//! name = "openai"
//! url = "http://egress-proxy:8080"
//! api_key_env = "OPENAI_API_KEY"          # or api_key_file = "/run/secrets/openai"
//! client_authorization = "replace"        # the default when credentials are configured
//! [upstreams.headers]
//! "OpenAI-Organization" = "org-1"         # a literal value
//! "x-api-key" = { env = "ANTHROPIC_KEY" } # or { file = "/run/secrets/k" }
//! ```
//!
//! * `api_key_env` / `api_key_file` — sent as `Authorization: Bearer <key>`; a file's contents
//!   are trimmed.
//! * `headers` — extra headers; each value is a literal string, `{ env = "VAR" }` or
//!   `{ file = "PATH" }` (trimmed).
//! * `client_authorization` — `"replace"`: the client's credential headers
//!   ([`CLIENT_CREDENTIAL_HEADERS`]: `Authorization`, `x-api-key`, `api-key`, the headers the
//!   gateway reads a client's API key from) are removed and the configured headers are sent;
//!   `"keep"`: the client's headers are forwarded as they are and a configured header is sent
//!   only when the client sent none of that name. Default: `"replace"` when the upstream has
//!   a key or a configured credential header (a client's gateway key must not reach a
//!   third-party upstream), else `"keep"` (the client's `Authorization` passes unchanged, as
//!   without any of these settings).
//!
//! Invariants:
//! * Values are resolved once, at start-up ([`UpstreamCredentials::resolve`]); a missing
//!   variable, an unreadable or empty file, or a value a header cannot carry refuses the start
//!   with an error naming the upstream, the header and the variable or file — never the value.
//! * Resolved values are [`HeaderValue`]s marked sensitive (never indexed by HTTP/2 HPACK,
//!   printed as `Sensitive` by `Debug`); [`UpstreamCredentials`]'s `Debug` shows header names
//!   only, and [`SecretSource`]'s `Debug` hides a literal value. Logs show header names only.
//! * The configured names are checked at load ([`validate`]): a valid header name, not one the
//!   gateway manages itself (hop-by-hop headers, `host`, `content-length`, `x-tokenscope-*`),
//!   not given twice (names are case-insensitive), and `authorization` not beside a key.

use crate::UpstreamConfig;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// The client headers that carry an API key (the ones the gateway reads a client's key
/// from); removed on an upstream with `client_authorization = "replace"`.
pub const CLIENT_CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "x-api-key", "api-key"];

/// Headers the gateway sets or drops itself: not configurable per upstream.
const MANAGED: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
    "traceparent",
    "x-request-id",
];

/// What happens to the client's own credentials on an upstream (`client_authorization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuthorization {
    /// The client's credential headers are removed; the configured ones are sent.
    Replace,
    /// The client's headers are forwarded as they are; a configured header is sent only when
    /// the client sent none of that name.
    #[default]
    Keep,
}

impl ClientAuthorization {
    /// The setting's name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientAuthorization::Replace => "replace",
            ClientAuthorization::Keep => "keep",
        }
    }
}

/// Where a configured header value comes from: a literal string, `{ env = "VAR" }` or
/// `{ file = "PATH" }`. `Debug` never prints a literal value.
#[derive(Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// The value itself.
    Value(String),
    /// An environment variable read at start-up.
    Env(String),
    /// A file read at start-up (its contents trimmed).
    File(PathBuf),
}

impl fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecretSource::Value(_) => f.write_str("Value(<redacted>)"),
            SecretSource::Env(v) => f.debug_tuple("Env").field(v).finish(),
            SecretSource::File(p) => f.debug_tuple("File").field(p).finish(),
        }
    }
}

const SOURCE_SHAPE: &str =
    "a string, { env = \"VARIABLE\" } or { file = \"PATH\" } (exactly one key)";

impl<'de> Deserialize<'de> for SecretSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SecretSource;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(SOURCE_SHAPE)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SecretSource, E> {
                Ok(SecretSource::Value(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SecretSource, A::Error> {
                let mut found = None;
                while let Some(key) = map.next_key::<String>()? {
                    let text: String = map.next_value()?;
                    let source = match key.as_str() {
                        "env" => SecretSource::Env(text),
                        "file" => SecretSource::File(PathBuf::from(text)),
                        other => {
                            return Err(de::Error::custom(format!(
                                "unknown key {other:?} in a header value: expected {SOURCE_SHAPE}"
                            )))
                        }
                    };
                    if found.replace(source).is_some() {
                        return Err(de::Error::custom(format!("expected {SOURCE_SHAPE}")));
                    }
                }
                found.ok_or_else(|| de::Error::custom(format!("expected {SOURCE_SHAPE}")))
            }
        }
        d.deserialize_any(V)
    }
}

/// Why an upstream's credentials could not be resolved at start-up. Messages name the
/// upstream, the header and the variable or file, never a value.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// The environment variable is not set (or not UTF-8).
    #[error("upstream {upstream:?}: {what} reads environment variable {var}, which is not set")]
    EnvMissing {
        /// The upstream.
        upstream: String,
        /// The setting (`api_key_env`, `headers."x-api-key"`).
        what: String,
        /// The variable.
        var: String,
    },
    /// The file could not be read.
    #[error("upstream {upstream:?}: {what} reads file {path}: {source}")]
    File {
        /// The upstream.
        upstream: String,
        /// The setting.
        what: String,
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The value is empty (after trimming).
    #[error("upstream {upstream:?}: {what} ({from}) is empty")]
    Empty {
        /// The upstream.
        upstream: String,
        /// The setting.
        what: String,
        /// `environment variable X`, `file P` or `the literal value`.
        from: String,
    },
    /// The value holds characters a header cannot carry (control characters, non-ASCII).
    #[error(
        "upstream {upstream:?}: {what} ({from}) cannot be sent in a header (control or non-ASCII characters)"
    )]
    BadValue {
        /// The upstream.
        upstream: String,
        /// The setting.
        what: String,
        /// Where it came from.
        from: String,
    },
}

/// An upstream's resolved credentials: the headers it gets and what happens to the client's.
/// `Debug` shows the header names only.
#[derive(Clone, Default)]
pub struct UpstreamCredentials {
    mode: ClientAuthorization,
    /// The key's `Authorization` first, then `headers` in name order; every value sensitive.
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl fmt::Debug for UpstreamCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamCredentials")
            .field("client_authorization", &self.mode)
            .field("headers", &self.names().collect::<Vec<_>>())
            .finish()
    }
}

impl UpstreamCredentials {
    /// Reads `u`'s key and headers (environment variables through `env`, files from disk).
    pub fn resolve(
        u: &UpstreamConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, CredentialError> {
        let mut headers = Vec::new();
        let key = match (&u.api_key_env, &u.api_key_file) {
            (Some(var), _) => Some(("api_key_env", SecretSource::Env(var.clone()))),
            (None, Some(path)) => Some(("api_key_file", SecretSource::File(path.clone()))),
            (None, None) => None,
        };
        if let Some((what, source)) = key {
            let key = read(&u.name, what, &source, &env)?;
            let value = header_value(&format!("Bearer {key}"), &u.name, what, &source)?;
            headers.push((http::header::AUTHORIZATION, value));
        }
        for (name, source) in &u.headers {
            let what = format!("headers.{name:?}");
            // Checked at load ([`validate`]); an error rather than a panic all the same.
            let header =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| CredentialError::BadValue {
                    upstream: u.name.clone(),
                    what: what.clone(),
                    from: "its name".into(),
                })?;
            let text = read(&u.name, &what, source, &env)?;
            headers.push((header, header_value(&text, &u.name, &what, source)?));
        }
        Ok(Self {
            mode: u.client_authorization(),
            headers,
        })
    }

    /// What happens to the client's credentials on this upstream.
    pub fn mode(&self) -> ClientAuthorization {
        self.mode
    }

    /// The names of the headers sent (lowercase).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.headers.iter().map(|(n, _)| n.as_str())
    }

    /// No configured header and the client's headers kept: [`apply`](Self::apply) changes
    /// nothing.
    pub fn is_empty(&self) -> bool {
        self.headers.is_empty() && self.mode == ClientAuthorization::Keep
    }

    /// Applies the credentials to `headers`, the request to the upstream holding what the
    /// client sent: `replace` removes the client's credential headers and sets the configured
    /// ones; `keep` sets a configured header only where the client sent none of that name.
    pub fn apply(&self, headers: &mut HeaderMap) {
        match self.mode {
            ClientAuthorization::Replace => {
                for name in CLIENT_CREDENTIAL_HEADERS {
                    headers.remove(name);
                }
                for (name, value) in &self.headers {
                    headers.insert(name.clone(), value.clone());
                }
            }
            ClientAuthorization::Keep => {
                for (name, value) in &self.headers {
                    if !headers.contains_key(name) {
                        headers.insert(name.clone(), value.clone());
                    }
                }
            }
        }
    }
}

fn from_text(source: &SecretSource) -> String {
    match source {
        SecretSource::Value(_) => "the literal value".into(),
        SecretSource::Env(v) => format!("environment variable {v}"),
        SecretSource::File(p) => format!("file {}", p.display()),
    }
}

/// The value of `source`, trimmed when it comes from a file or the environment.
fn read(
    upstream: &str,
    what: &str,
    source: &SecretSource,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<String, CredentialError> {
    let text = match source {
        SecretSource::Value(v) => v.clone(),
        SecretSource::Env(var) => env(var)
            .ok_or_else(|| CredentialError::EnvMissing {
                upstream: upstream.to_owned(),
                what: what.to_owned(),
                var: var.clone(),
            })?
            .trim()
            .to_owned(),
        SecretSource::File(path) => std::fs::read_to_string(path)
            .map_err(|source| CredentialError::File {
                upstream: upstream.to_owned(),
                what: what.to_owned(),
                path: path.clone(),
                source,
            })?
            .trim()
            .to_owned(),
    };
    if text.trim().is_empty() {
        return Err(CredentialError::Empty {
            upstream: upstream.to_owned(),
            what: what.to_owned(),
            from: from_text(source),
        });
    }
    Ok(text)
}

fn header_value(
    text: &str,
    upstream: &str,
    what: &str,
    source: &SecretSource,
) -> Result<HeaderValue, CredentialError> {
    // Visible ASCII and spaces only: `HeaderValue` would also take obs-text bytes, which
    // engines and proxies read differently.
    let ok = text
        .bytes()
        .all(|b| b == b' ' || b == b'\t' || b.is_ascii_graphic());
    let mut v = HeaderValue::from_str(text)
        .ok()
        .filter(|_| ok)
        .ok_or_else(|| CredentialError::BadValue {
            upstream: upstream.to_owned(),
            what: what.to_owned(),
            from: from_text(source),
        })?;
    v.set_sensitive(true);
    Ok(v)
}

/// Checks an upstream's credential settings at load (see the module docs); the values are
/// read at start-up, not here (commands that only read the store need no secret).
pub fn validate(u: &UpstreamConfig) -> Result<(), String> {
    let at = |m: String| format!("upstream {:?}: {m}", u.name);
    if u.api_key_env.is_some() && u.api_key_file.is_some() {
        return Err(at("give api_key_env or api_key_file, not both".into()));
    }
    if u.api_key_env
        .as_deref()
        .is_some_and(|v| v.trim().is_empty())
    {
        return Err(at("api_key_env is empty: name a variable".into()));
    }
    if u.api_key_file
        .as_deref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return Err(at("api_key_file is empty: name a file".into()));
    }
    let mut seen = BTreeMap::new();
    for (name, source) in &u.headers {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| at(format!("headers: {name:?} is not a header name")))?;
        let lower = header.as_str();
        if MANAGED.contains(&lower) || lower.starts_with("x-tokenscope-") {
            return Err(at(format!(
                "headers: {name:?} is set by the gateway itself and cannot be configured"
            )));
        }
        if let Some(first) = seen.insert(lower.to_owned(), name) {
            return Err(at(format!(
                "headers: {first:?} and {name:?} name the same header"
            )));
        }
        if lower == "authorization" && (u.api_key_env.is_some() || u.api_key_file.is_some()) {
            return Err(at(
                "headers: \"authorization\" beside api_key_env / api_key_file: give one".into(),
            ));
        }
        match source {
            SecretSource::Env(v) if v.trim().is_empty() => {
                return Err(at(format!("headers: {name:?}: env is empty")));
            }
            SecretSource::File(p) if p.as_os_str().is_empty() => {
                return Err(at(format!("headers: {name:?}: file is empty")));
            }
            SecretSource::Value(v) if HeaderValue::from_str(v).is_err() || v.trim().is_empty() => {
                return Err(at(format!(
                    "headers: {name:?}: the value is empty or cannot be sent in a header"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

impl UpstreamConfig {
    /// Whether credentials are configured: a key, or a header named like a client credential.
    pub fn has_credentials(&self) -> bool {
        self.api_key_env.is_some()
            || self.api_key_file.is_some()
            || self
                .headers
                .keys()
                .any(|n| CLIENT_CREDENTIAL_HEADERS.contains(&n.to_ascii_lowercase().as_str()))
    }

    /// `client_authorization`, or its default: `replace` when credentials are configured
    /// ([`UpstreamConfig::has_credentials`]), else `keep`.
    pub fn client_authorization(&self) -> ClientAuthorization {
        self.client_authorization
            .unwrap_or(if self.has_credentials() {
                ClientAuthorization::Replace
            } else {
                ClientAuthorization::Keep
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GatewayConfig;
    use std::io::Write;

    const KEY: &str = "sk-upstream-secret-0123";

    fn load(toml: &str) -> Result<GatewayConfig, crate::ConfigError> {
        let mut f = tempfile::NamedTempFile::new().expect("tmp");
        f.write_all(toml.as_bytes()).expect("write");
        GatewayConfig::load_with_env(Some(f.path()), Vec::new())
    }

    fn upstream(extra: &str) -> Result<UpstreamConfig, crate::ConfigError> {
        let cfg = load(&format!(
            "[[upstreams]]\nname = \"up\"\nurl = \"http://127.0.0.1:1\"\n{extra}"
        ))?;
        Ok(cfg.upstreams[0].clone())
    }

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
            .collect()
    }

    fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
        h.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn header_values_from_literal_env_and_file() {
        let mut key_file = tempfile::NamedTempFile::new().expect("tmp");
        writeln!(key_file, "  file-secret  \n").expect("write");
        let u = upstream(&format!(
            "api_key_env = \"UP_KEY\"\n[upstreams.headers]\n\"OpenAI-Organization\" = \"org-1\"\n\
             \"x-from-env\" = {{ env = \"UP_HDR\" }}\n\"x-from-file\" = {{ file = {:?} }}\n",
            key_file.path().display().to_string()
        ))
        .expect("valid");
        assert_eq!(u.api_key_env.as_deref(), Some("UP_KEY"));
        assert_eq!(
            u.headers.get("OpenAI-Organization"),
            Some(&SecretSource::Value("org-1".into()))
        );
        let creds = UpstreamCredentials::resolve(
            &u,
            env(&[
                ("UP_KEY", " sk-upstream-secret-0123\n"),
                ("UP_HDR", "h-env"),
            ]),
        )
        .expect("resolved");
        assert_eq!(creds.mode(), ClientAuthorization::Replace);
        let mut h = HeaderMap::new();
        creds.apply(&mut h);
        assert_eq!(
            get(&h, "authorization"),
            Some("Bearer sk-upstream-secret-0123")
        );
        assert_eq!(get(&h, "openai-organization"), Some("org-1"));
        assert_eq!(get(&h, "x-from-env"), Some("h-env"));
        assert_eq!(
            get(&h, "x-from-file"),
            Some("file-secret"),
            "a file is trimmed"
        );
        assert!(h.values().all(HeaderValue::is_sensitive));
        assert_eq!(
            creds.names().collect::<Vec<_>>(),
            [
                "authorization",
                "openai-organization",
                "x-from-env",
                "x-from-file"
            ]
        );

        // The key from a file.
        let u = upstream(&format!(
            "api_key_file = {:?}\n",
            key_file.path().display().to_string()
        ))
        .expect("valid");
        let creds = UpstreamCredentials::resolve(&u, env(&[])).expect("resolved");
        let mut h = HeaderMap::new();
        creds.apply(&mut h);
        assert_eq!(get(&h, "authorization"), Some("Bearer file-secret"));
    }

    #[test]
    fn unresolvable_values_name_their_source_never_the_value() {
        let u = upstream("api_key_env = \"UP_KEY\"\n").expect("valid");
        let err = UpstreamCredentials::resolve(&u, env(&[]))
            .expect_err("unset")
            .to_string();
        assert!(err.contains("UP_KEY") && err.contains("\"up\""), "{err}");
        let err = UpstreamCredentials::resolve(&u, env(&[("UP_KEY", "  \n")]))
            .expect_err("empty")
            .to_string();
        assert!(err.contains("empty") && err.contains("UP_KEY"), "{err}");
        let err =
            UpstreamCredentials::resolve(&u, env(&[("UP_KEY", "sk-upstream-secret-0123\nx")]))
                .expect_err("a newline inside")
                .to_string();
        assert!(err.contains("UP_KEY") && !err.contains(KEY), "{err}");

        let u = upstream("api_key_file = \"/nonexistent/tokenscope/key\"\n").expect("valid");
        let err = UpstreamCredentials::resolve(&u, env(&[]))
            .expect_err("no file")
            .to_string();
        assert!(err.contains("/nonexistent/tokenscope/key"), "{err}");

        let u = upstream("[upstreams.headers]\n\"x-api-key\" = { env = \"ANTHROPIC_KEY\" }\n")
            .expect("valid");
        let err = UpstreamCredentials::resolve(&u, env(&[]))
            .expect_err("unset")
            .to_string();
        assert!(
            err.contains("ANTHROPIC_KEY") && err.contains("x-api-key"),
            "{err}"
        );
    }

    #[test]
    fn replace_and_keep() {
        let client = [
            ("authorization", "Bearer client-gateway-key"),
            ("x-api-key", "client-x"),
            ("api-key", "client-azure"),
            ("x-other", "kept"),
        ];
        /// (settings, the headers the upstream then gets: name, value or absent).
        type Case = (
            &'static str,
            &'static [(&'static str, Option<&'static str>)],
        );
        let cases: &[Case] = &[
            // A key configured: replace by default, every client credential removed.
            (
                "api_key_env = \"K\"\n",
                &[
                    ("authorization", Some("Bearer sk-upstream-secret-0123")),
                    ("x-api-key", None),
                    ("api-key", None),
                    ("x-other", Some("kept")),
                ],
            ),
            (
                "api_key_env = \"K\"\nclient_authorization = \"replace\"\n",
                &[
                    ("authorization", Some("Bearer sk-upstream-secret-0123")),
                    ("x-api-key", None),
                ],
            ),
            // keep: the client's own headers win.
            (
                "api_key_env = \"K\"\nclient_authorization = \"keep\"\n",
                &[
                    ("authorization", Some("Bearer client-gateway-key")),
                    ("x-api-key", Some("client-x")),
                    ("api-key", Some("client-azure")),
                ],
            ),
            // No key: the client's headers pass unchanged (as before this setting existed).
            (
                "",
                &[
                    ("authorization", Some("Bearer client-gateway-key")),
                    ("x-api-key", Some("client-x")),
                ],
            ),
            // A non-credential header alone keeps the client's credentials and is set.
            (
                "[upstreams.headers]\n\"OpenAI-Organization\" = \"org-1\"\n",
                &[
                    ("authorization", Some("Bearer client-gateway-key")),
                    ("openai-organization", Some("org-1")),
                ],
            ),
            // A credential header (Anthropic's x-api-key) replaces the client's credentials.
            (
                "[upstreams.headers]\n\"X-Api-Key\" = { env = \"K\" }\n",
                &[
                    ("authorization", None),
                    ("x-api-key", Some("sk-upstream-secret-0123")),
                    ("api-key", None),
                ],
            ),
            // replace without anything configured: the upstream sees no client credential.
            (
                "client_authorization = \"replace\"\n",
                &[
                    ("authorization", None),
                    ("x-api-key", None),
                    ("x-other", Some("kept")),
                ],
            ),
        ];
        for (extra, want) in cases {
            let u = upstream(extra).expect("valid");
            let creds = UpstreamCredentials::resolve(&u, env(&[("K", KEY)])).expect("resolved");
            let mut h = map(&client);
            creds.apply(&mut h);
            for (name, value) in *want {
                assert_eq!(get(&h, name), *value, "{name} with {extra:?}");
            }
        }
        // keep and a client without credentials: the key is sent.
        let u = upstream("api_key_env = \"K\"\nclient_authorization = \"keep\"\n").expect("valid");
        let creds = UpstreamCredentials::resolve(&u, env(&[("K", KEY)])).expect("resolved");
        let mut h = map(&[("x-other", "1")]);
        creds.apply(&mut h);
        assert_eq!(
            get(&h, "authorization"),
            Some("Bearer sk-upstream-secret-0123")
        );
        assert!(UpstreamCredentials::default().is_empty());
    }

    #[test]
    fn debug_never_shows_a_value() {
        let cfg = load(
            "[[upstreams]]\nname = \"up\"\nurl = \"http://127.0.0.1:1\"\napi_key_env = \"K\"\n\
             [upstreams.headers]\n\"x-literal\" = \"sk-upstream-secret-0123\"\n",
        )
        .expect("valid");
        let shown = format!("{cfg:?}");
        assert!(!shown.contains(KEY), "{shown}");
        assert!(shown.contains("x-literal") && shown.contains("<redacted>"));
        let creds =
            UpstreamCredentials::resolve(&cfg.upstreams[0], env(&[("K", KEY)])).expect("resolved");
        let shown = format!("{creds:?} {creds:#?}");
        assert!(!shown.contains(KEY) && !shown.contains("Bearer"), "{shown}");
        assert!(
            shown.contains("authorization") && shown.contains("x-literal"),
            "{shown}"
        );
    }

    #[test]
    fn bad_settings_are_refused_at_load() {
        for (extra, needle) in [
            ("api_key_env = \"A\"\napi_key_file = \"/k\"\n", "not both"),
            ("api_key_env = \" \"\n", "api_key_env is empty"),
            (
                "[upstreams.headers]\n\"bad header\" = \"v\"\n",
                "not a header name",
            ),
            ("[upstreams.headers]\nHost = \"v\"\n", "set by the gateway"),
            (
                "[upstreams.headers]\n\"x-tokenscope-user\" = \"v\"\n",
                "set by the gateway",
            ),
            (
                "[upstreams.headers]\nX-A = \"1\"\nx-a = \"2\"\n",
                "same header",
            ),
            (
                "api_key_env = \"K\"\n[upstreams.headers]\nAuthorization = \"Bearer x\"\n",
                "beside api_key_env",
            ),
            ("[upstreams.headers]\nx-a = \"\"\n", "empty"),
            (
                "[upstreams.headers]\nx-a = { env = \"A\", file = \"/b\" }\n",
                "exactly one",
            ),
            (
                "[upstreams.headers]\nx-a = { nope = \"A\" }\n",
                "unknown key",
            ),
            ("[upstreams.headers]\nx-a = 3\n", "env = "),
            ("client_authorization = \"drop\"\n", "unknown variant"),
        ] {
            let err = upstream(extra).expect_err(extra).to_string();
            assert!(err.contains(needle), "{extra:?}: {err}");
        }
    }

    #[test]
    fn env_layer_sets_upstreams_with_credentials() {
        let cfg = GatewayConfig::load_with_env(
            None,
            vec![(
                "TOKENSCOPE_UPSTREAMS".to_owned(),
                r#"[{ name = "a", url = "http://127.0.0.1:1", api_key_env = "K", headers = { "x-b" = { file = "/f" } } }]"#
                    .to_owned(),
            )],
        )
        .expect("valid");
        let u = &cfg.upstreams[0];
        assert_eq!(u.api_key_env.as_deref(), Some("K"));
        assert_eq!(u.headers.get("x-b"), Some(&SecretSource::File("/f".into())));
        assert_eq!(u.client_authorization(), ClientAuthorization::Replace);
    }
}
