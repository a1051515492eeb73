//! [`ClickHouseConfig`]: where the store is and how to talk to it, parsed from a
//! `clickhouse://` URL.
//!
//! ```text
//! clickhouse://[user[:password]@]host[:port]/database[?option=value&…]
//! ```
//!
//! * `user`, `password` and `database` are percent-decoded (`%40` → `@`). Without a user the
//!   server's `default` user is used; without a password none is sent.
//! * `port` is the server's **HTTP** port (default 8123); `host` may be a name, an IPv4
//!   address or an IPv6 address in brackets (`[::1]`).
//! * `database` defaults to `default` when the path is empty. Database and cluster names must
//!   be plain identifiers (`[A-Za-z0-9_]`, not starting with a digit): they are written into
//!   DDL and queries.
//! * Options: `cluster=NAME` (a `Distributed` table over a cluster), `shards=h1:8123,h2:8124`
//!   (the shards' HTTP addresses, so the schema is created on each without `ON CLUSTER`),
//!   `ttl_days=N` (retention), `timeout_ms=N` (per request, default 30 000),
//!   `connect_timeout_ms=N` (the first contact in [`crate::ClickHouseStore::connect`], default
//!   5 000) — both milliseconds, or a duration with a unit (`2s`) — `compression=lz4|none` (request/response compression, default `none`). Unknown
//!   options are refused, so a typo does not silently change behaviour.
//! * TLS: `secure=true` talks HTTPS to the server's `https_port` (default port 8443 then);
//!   the server's certificate is checked against the system's roots plus `ca_file=PATH` (a PEM
//!   bundle), and `client_cert=PATH&client_key=PATH` present a client certificate (mutual TLS).
//!   Paths are percent-decoded like every option. `shards=` addresses use the same scheme and
//!   TLS settings. The files are read when the store is opened (a bad file refuses the start).
//!
//! Invariant: the password is never printed — `Debug` shows `***`, and every error message
//! built by this crate has it scrubbed.

use std::fmt;
use std::time::Duration;
use tokenscope_core::percent_decode;

use crate::ClickHouseError;

/// Default HTTP port of clickhouse-server.
pub const DEFAULT_PORT: u16 = 8123;
/// Default HTTPS port of clickhouse-server (`secure=true`).
pub const DEFAULT_SECURE_PORT: u16 = 8443;
/// Default per-request timeout.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default timeout of the first contact (`SELECT version()` in `connect`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connection and schema settings of the ClickHouse store. See the module docs for the URL
/// syntax.
#[derive(Clone, PartialEq, Eq)]
pub struct ClickHouseConfig {
    /// Server host name or address (IPv6 without brackets).
    pub host: String,
    /// The server's HTTP port.
    pub port: u16,
    /// User name (`default` when the URL names none).
    pub user: String,
    /// Password; empty means none. Never logged.
    pub password: String,
    /// Database holding `llm_inference_log` and the migrations table.
    pub database: String,
    /// Cluster name (`remote_servers` in the server config): when set, the data lives in
    /// `llm_inference_log_local` on every shard and `llm_inference_log` is a `Distributed`
    /// table over them.
    pub cluster: Option<String>,
    /// The shards' HTTP addresses (`host:port`); when non-empty, migrations run on each of them
    /// directly instead of with `ON CLUSTER` (which needs ZooKeeper / Keeper).
    pub shards: Vec<String>,
    /// Keep rows this many days (`TTL` on servers that support it, else
    /// [`crate::ClickHouseStore::retention_sweep`]).
    pub ttl_days: Option<u32>,
    /// Timeout of the first contact in `connect`.
    pub connect_timeout: Duration,
    /// Timeout of every other request (a streamed read: of each chunk).
    pub request_timeout: Duration,
    /// LZ4-compress request and response bodies.
    pub compression: bool,
    /// HTTPS (`secure=true`).
    pub secure: bool,
    /// PEM CA bundle trusted beside the system's roots (`ca_file=`).
    pub ca_file: Option<String>,
    /// PEM client certificate (`client_cert=`, mutual TLS).
    pub client_cert: Option<String>,
    /// Its PEM key (`client_key=`).
    pub client_key: Option<String>,
}

impl Default for ClickHouseConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: DEFAULT_PORT,
            user: "default".to_owned(),
            password: String::new(),
            database: "default".to_owned(),
            cluster: None,
            shards: Vec::new(),
            ttl_days: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            compression: false,
            secure: false,
            ca_file: None,
            client_cert: None,
            client_key: None,
        }
    }
}

impl fmt::Debug for ClickHouseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClickHouseConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field(
                "password",
                &if self.password.is_empty() { "" } else { "***" },
            )
            .field("database", &self.database)
            .field("cluster", &self.cluster)
            .field("shards", &self.shards)
            .field("ttl_days", &self.ttl_days)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("compression", &self.compression)
            .field("secure", &self.secure)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .finish()
    }
}

impl fmt::Display for ClickHouseConfig {
    /// The URL without the password (`clickhouse://user@host:port/db`), for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "clickhouse://{}@{}/{}",
            self.user,
            self.http_addr(),
            self.database
        )?;
        let mut sep = '?';
        if let Some(c) = &self.cluster {
            write!(f, "{sep}cluster={c}")?;
            sep = '&';
        }
        if self.secure {
            write!(f, "{sep}secure=true")?;
        }
        Ok(())
    }
}

impl ClickHouseConfig {
    /// Parses a `clickhouse://` URL (see the module docs).
    pub fn from_url(s: &str) -> Result<Self, ClickHouseError> {
        let bad = |why: &str| ClickHouseError::InvalidUrl(format!("{why} (in {})", redact_url(s)));
        let rest = s
            .strip_prefix("clickhouse://")
            .ok_or_else(|| bad("expected clickhouse://[user[:password]@]host[:port]/database"))?;
        let (before_query, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.split_once('/') {
            Some((a, p)) => (a, p),
            None => (before_query, ""),
        };
        let mut cfg = ClickHouseConfig::default();
        let hostport = match authority.rsplit_once('@') {
            Some((userinfo, hp)) => {
                let (u, p) = match userinfo.split_once(':') {
                    Some((u, p)) => (u, Some(p)),
                    None => (userinfo, None),
                };
                let u = percent_decode(u).ok_or_else(|| bad("bad percent-encoding in user"))?;
                if !u.is_empty() {
                    cfg.user = u;
                }
                if let Some(p) = p {
                    cfg.password =
                        percent_decode(p).ok_or_else(|| bad("bad percent-encoding in password"))?;
                }
                hp
            }
            None => authority,
        };
        let (host, port) = split_host_port(hostport).ok_or_else(|| bad("bad host or port"))?;
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        cfg.host = host;
        let db = percent_decode(path.trim_end_matches('/'))
            .ok_or_else(|| bad("bad percent-encoding in database"))?;
        if !db.is_empty() {
            cfg.database = db;
        }
        if !is_identifier(&cfg.database) {
            return Err(bad("database name must be [A-Za-z_][A-Za-z0-9_]*"));
        }
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| bad("bad percent-encoding in an option"))?;
            match k {
                "cluster" => {
                    if !is_identifier(&v) {
                        return Err(bad("cluster name must be [A-Za-z_][A-Za-z0-9_]*"));
                    }
                    cfg.cluster = Some(v);
                }
                "shards" => {
                    for sh in v.split(',').filter(|s| !s.is_empty()) {
                        match split_host_port(sh) {
                            Some((h, Some(p))) if !h.is_empty() => {
                                cfg.shards.push(join_host_port(&h, p))
                            }
                            _ => return Err(bad("shards must be host:http_port,host:http_port")),
                        }
                    }
                }
                "ttl_days" => {
                    let n: u32 = v
                        .parse()
                        .map_err(|_| bad("ttl_days must be a positive integer"))?;
                    if n == 0 {
                        return Err(bad("ttl_days must be a positive integer"));
                    }
                    cfg.ttl_days = Some(n);
                }
                "timeout_ms" => {
                    cfg.request_timeout =
                        parse_ms(&v).ok_or_else(|| bad("timeout_ms must be a positive duration (milliseconds, or with a unit: 2s)"))?
                }
                "connect_timeout_ms" => {
                    cfg.connect_timeout = parse_ms(&v)
                        .ok_or_else(|| bad("connect_timeout_ms must be a positive duration (milliseconds, or with a unit: 2s)"))?
                }
                "compression" => {
                    cfg.compression = match v.as_str() {
                        "lz4" => true,
                        "none" | "" => false,
                        _ => return Err(bad("compression must be lz4 or none")),
                    }
                }
                "secure" => {
                    cfg.secure = match v.as_str() {
                        "true" | "1" => true,
                        "false" | "0" => false,
                        _ => return Err(bad("secure must be true or false")),
                    }
                }
                "ca_file" | "client_cert" | "client_key" if v.is_empty() => {
                    return Err(bad(&format!("{k} needs a path")))
                }
                "ca_file" => cfg.ca_file = Some(v),
                "client_cert" => cfg.client_cert = Some(v),
                "client_key" => cfg.client_key = Some(v),
                other => return Err(bad(&format!("unknown option {other:?}"))),
            }
        }
        if !cfg.shards.is_empty() && cfg.cluster.is_none() {
            return Err(bad("shards= needs cluster="));
        }
        cfg.port = port.unwrap_or(if cfg.secure {
            DEFAULT_SECURE_PORT
        } else {
            DEFAULT_PORT
        });
        if !cfg.secure
            && (cfg.ca_file.is_some() || cfg.client_cert.is_some() || cfg.client_key.is_some())
        {
            return Err(bad(
                "ca_file, client_cert and client_key need secure=true (HTTPS)",
            ));
        }
        if cfg.client_cert.is_some() != cfg.client_key.is_some() {
            return Err(bad("client_cert and client_key go together"));
        }
        Ok(cfg)
    }

    /// `host:port` of the HTTP interface (IPv6 in brackets).
    pub fn http_addr(&self) -> String {
        join_host_port(&self.host, self.port)
    }

    /// `http://host:port` (or `https://` with `secure=true`) of the HTTP interface.
    pub fn http_url(&self) -> String {
        self.url_of(&self.http_addr())
    }

    /// The base URL of the HTTP interface at `addr` (`host:port`): `http://` or, with
    /// `secure=true`, `https://`.
    pub fn url_of(&self, addr: &str) -> String {
        let scheme = if self.secure { "https" } else { "http" };
        format!("{scheme}://{addr}")
    }

    /// The TLS settings of `secure=true` (system roots plus `ca_file`, the client certificate),
    /// the files read now.
    pub fn tls(&self) -> Result<tokenscope_net::ClientTls, ClickHouseError> {
        tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions::from_paths(
            self.ca_file.as_deref(),
            self.client_cert.as_deref(),
            self.client_key.as_deref(),
        ))
        .map_err(|e| ClickHouseError::InvalidUrl(format!("TLS settings: {e}")))
    }

    /// The table rows are written to and read from (`llm_inference_log`; the `Distributed`
    /// table in a cluster).
    pub fn table(&self) -> String {
        format!("{}.{}", self.database, crate::schema::TABLE)
    }

    /// The table holding the data on each node (`llm_inference_log_local` in a cluster).
    pub fn data_table_name(&self) -> &'static str {
        if self.cluster.is_some() {
            crate::schema::LOCAL_TABLE
        } else {
            crate::schema::TABLE
        }
    }
}

/// A positive duration; a bare number is milliseconds (`timeout_ms=1500`), a unit may be given
/// (`timeout_ms=2s`).
fn parse_ms(v: &str) -> Option<Duration> {
    tokenscope_core::time::parse_duration(v, tokenscope_core::time::BareNumber::Millis)
        .ok()
        .filter(|d| !d.is_zero())
}

/// `[A-Za-z_][A-Za-z0-9_]*`: safe to write into SQL unquoted.
pub(crate) fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// `host`, `host:port`, `[v6]`, `[v6]:port` → (host without brackets, port).
fn split_host_port(s: &str) -> Option<(String, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?.parse().ok()?),
        };
        return Some((h.to_owned(), port));
    }
    match s.split_once(':') {
        Some((h, p)) => Some((h.to_owned(), Some(p.parse().ok()?))),
        None => Some((s.to_owned(), None)),
    }
}

/// The URL with its password replaced by `***` (for error messages); anything that is not a
/// `clickhouse://` URL is not echoed at all.
fn redact_url(s: &str) -> String {
    if s.starts_with("clickhouse://") {
        tokenscope_core::redact_url(s)
    } else {
        "<not a clickhouse:// URL>".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_url() {
        let c = ClickHouseConfig::from_url(
            "clickhouse://ts%40corp:p%3Ass%2Fw@ch.example:9123/tokens?cluster=logs&shards=a:8123,[::1]:8124&ttl_days=30&timeout_ms=1500&connect_timeout_ms=200&compression=lz4",
        )
        .expect("parse");
        assert_eq!(c.host, "ch.example");
        assert_eq!(c.port, 9123);
        assert_eq!(c.user, "ts@corp");
        assert_eq!(c.password, "p:ss/w");
        assert_eq!(c.database, "tokens");
        assert_eq!(c.cluster.as_deref(), Some("logs"));
        assert_eq!(c.shards, vec!["a:8123".to_owned(), "[::1]:8124".to_owned()]);
        assert_eq!(c.ttl_days, Some(30));
        assert_eq!(c.request_timeout, Duration::from_millis(1500));
        assert_eq!(c.connect_timeout, Duration::from_millis(200));
        assert!(c.compression);
        assert_eq!(c.table(), "tokens.llm_inference_log");
        assert_eq!(c.data_table_name(), "llm_inference_log_local");
        assert_eq!(c.http_url(), "http://ch.example:9123");
    }

    #[test]
    fn defaults() {
        let c = ClickHouseConfig::from_url("clickhouse://localhost").expect("parse");
        assert_eq!(
            c,
            ClickHouseConfig {
                host: "localhost".to_owned(),
                ..ClickHouseConfig::default()
            }
        );
        assert_eq!(c.port, 8123);
        assert_eq!(c.database, "default");
        assert_eq!(c.user, "default");
        assert_eq!(c.password, "");
        assert_eq!(c.data_table_name(), "llm_inference_log");
        let c = ClickHouseConfig::from_url("clickhouse://u@[::1]/db/").expect("parse");
        assert_eq!((c.host.as_str(), c.port), ("::1", 8123));
        assert_eq!(c.http_addr(), "[::1]:8123");
        assert_eq!((c.user.as_str(), c.database.as_str()), ("u", "db"));
        let c = ClickHouseConfig::from_url("clickhouse://u:@h:1/").expect("parse");
        assert_eq!((c.password.as_str(), c.port), ("", 1));
    }

    #[test]
    fn errors_never_show_the_password() {
        for bad in [
            "http://h/db",
            "clickhouse://u:secretpw@h:notaport/db",
            "clickhouse://u:secretpw@/db",
            "clickhouse://u:secretpw@h/bad-name",
            "clickhouse://u:secretpw@h/db?ttl_days=0",
            "clickhouse://u:secretpw@h/db?ttl_days=x",
            "clickhouse://u:secretpw@h/db?cluster=a;b",
            "clickhouse://u:secretpw@h/db?cluster=c&shards=nohostport",
            "clickhouse://u:secretpw@h/db?shards=a:1",
            "clickhouse://u:secretpw@h/db?bogus=1",
            "clickhouse://u:secretpw@h/db?compression=gzip",
            "clickhouse://u:secret%zz@h/db",
            "clickhouse://u:secretpw@h/db?ca_file=/ca.pem",
            "clickhouse://u:secretpw@h/db?secure=yes",
            "clickhouse://u:secretpw@h/db?secure=true&client_cert=/c.pem",
            "clickhouse://u:secretpw@h/db?secure=true&ca_file=",
        ] {
            let e = ClickHouseConfig::from_url(bad).expect_err(bad);
            let msg = e.to_string();
            assert!(!msg.contains("secret"), "{msg}");
            assert!(msg.starts_with("invalid ClickHouse URL"), "{msg}");
        }
    }

    #[test]
    fn debug_and_display_redact() {
        let c = ClickHouseConfig::from_url("clickhouse://ts:hunter2@h/db").expect("parse");
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("hunter2") && dbg.contains("***"), "{dbg}");
        assert_eq!(c.to_string(), "clickhouse://ts@h:8123/db");
    }

    #[test]
    fn secure_urls() {
        let c = ClickHouseConfig::from_url(
            "clickhouse://u:p@ch.example/db?secure=true&ca_file=%2Fetc%2Fch%20ca.pem&client_cert=/c.pem&client_key=/k.pem&cluster=x",
        )
        .expect("parse");
        assert!(c.secure);
        assert_eq!(c.port, DEFAULT_SECURE_PORT);
        assert_eq!(c.http_url(), "https://ch.example:8443");
        assert_eq!(c.ca_file.as_deref(), Some("/etc/ch ca.pem"));
        assert_eq!(
            (c.client_cert.as_deref(), c.client_key.as_deref()),
            (Some("/c.pem"), Some("/k.pem"))
        );
        assert_eq!(
            c.to_string(),
            "clickhouse://u@ch.example:8443/db?cluster=x&secure=true"
        );
        let c = ClickHouseConfig::from_url("clickhouse://h:9443/db?secure=1").expect("parse");
        assert_eq!(c.http_url(), "https://h:9443");
        // A CA file that cannot be read is an error naming it, when the store is opened.
        let c = ClickHouseConfig::from_url("clickhouse://h/db?secure=true&ca_file=/nope/ca.pem")
            .expect("parse");
        let err = c.tls().expect_err("missing file").to_string();
        assert!(err.contains("/nope/ca.pem"), "{err}");
    }
}
