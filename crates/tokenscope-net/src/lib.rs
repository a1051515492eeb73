//! # tokenscope-net
//!
//! TLS for every HTTP client of tokenscope (the upstream pool, the pass-through client, the
//! engine-state scrapers, the `/v1/models` fetch, OTLP export, the alert webhook, ClickHouse)
//! and for the few servers that offer it (the mock engine, test receivers): one stack, rustls
//! with the `ring` crypto provider.
//!
//! * [`TlsOptions`] → [`ClientTls`]: a `rustls::ClientConfig` built once — the system's trust
//!   roots (`rustls-native-certs`: the platform store, or `SSL_CERT_FILE` / `SSL_CERT_DIR`)
//!   plus an optional PEM CA bundle, and an optional client certificate and key (PEM) for mutual
//!   TLS. [`ClientTls::system`] is the shared default (no options; built once per process).
//! * [`connector`] → [`HttpsConnect`]: a hyper-util legacy-client connector for `http://` and
//!   `https://` URLs (hyper-rustls), whose connect timeout covers the TCP connect **and** the TLS
//!   handshake. It also serves tonic's `Endpoint::connect_with_connector` (OTLP/gRPC, ALPN `h2`).
//! * [`server_name`]: the SNI name of a URL host (a DNS name or an IP address).
//! * [`MaybeTls`]: a TCP stream in the clear or under TLS, one type for connection code that
//!   serves both (the gateway's upstream pool and its proxy listener).
//! * [`server_config`] (and, with the `axum` feature, [`TlsListener`]): a server configuration
//!   from a PEM certificate chain and key, optionally requiring client certificates signed by a
//!   CA.
//!
//! Invariants:
//! * Certificates are verified (webpki, the configured roots); nothing here turns verification
//!   off. Every error names the file and what was wrong with it ([`TlsError`]); a bad file is a
//!   start-up error of the caller, never a failure at the first request.
//! * Files are read once, when the configuration is built.
//! * Only rustls with `ring` is linked (no OpenSSL, no aws-lc).

use http::Uri;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;

pub use hyper_rustls;
pub use rustls;
pub use tokio_rustls;

mod stream;
pub use stream::MaybeTls;

#[cfg(feature = "axum")]
mod listener;
#[cfg(feature = "axum")]
pub use listener::TlsListener;
#[cfg(feature = "test-util")]
pub mod test_util;

/// Why a TLS configuration could not be built. Every variant names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        /// What the file was meant to hold (`CA file`, `client certificate`, …).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not PEM, or a PEM block in it is broken.
    #[error("the {what} {path} is not valid PEM: {reason}")]
    Pem {
        /// What the file was meant to hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The file holds no `CERTIFICATE` block.
    #[error("the {what} {path} holds no certificate (expected PEM \"-----BEGIN CERTIFICATE-----\" blocks)")]
    NoCertificate {
        /// What the file was meant to hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// The file holds no private key.
    #[error("the {what} {path} holds no private key (expected a PEM \"PRIVATE KEY\", \"RSA PRIVATE KEY\" or \"EC PRIVATE KEY\" block)")]
    NoKey {
        /// What the file was meant to hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A certificate of a CA file cannot be used as a trust anchor.
    #[error("the CA file {path}: certificate #{index} cannot be a trust anchor: {reason}")]
    BadCa {
        /// The file.
        path: PathBuf,
        /// Its position in the file (1-based).
        index: usize,
        /// What rustls / webpki said.
        reason: String,
    },
    /// Only one of a certificate / key pair was given.
    #[error("{given} is set but {missing} is not: a client certificate needs its key, and a key its certificate")]
    HalfPair {
        /// The setting that was given.
        given: &'static str,
        /// The one that is missing.
        missing: &'static str,
    },
    /// The certificate and key do not make a usable identity (key does not match, unsupported
    /// key type, …).
    #[error("the certificate {cert} with the key {key}: {reason}")]
    Identity {
        /// The certificate chain file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
    /// A host that cannot be a TLS server name.
    #[error("{host:?} cannot be a TLS server name: {reason}")]
    ServerName {
        /// The host given.
        host: String,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration itself (should not happen with the ring provider).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// Where the trust roots and the client identity of a TLS client come from. All paths are PEM
/// files; an empty value means "not set".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// CA certificates trusted in addition to the system's roots (a PEM bundle).
    pub ca_file: Option<PathBuf>,
    /// The client certificate chain presented to servers that ask for one (mutual TLS).
    pub client_cert: Option<PathBuf>,
    /// The private key of `client_cert` (PKCS#8, PKCS#1 RSA or SEC1 EC, PEM).
    pub client_key: Option<PathBuf>,
}

impl TlsOptions {
    /// Options from optional path strings (configuration values); empty strings are unset.
    pub fn from_paths(
        ca_file: Option<&str>,
        client_cert: Option<&str>,
        client_key: Option<&str>,
    ) -> Self {
        let p = |s: Option<&str>| s.filter(|s| !s.trim().is_empty()).map(PathBuf::from);
        Self {
            ca_file: p(ca_file),
            client_cert: p(client_cert),
            client_key: p(client_key),
        }
    }

    /// `true` when nothing is set (the system roots, no client certificate).
    pub fn is_default(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }
}

/// The crypto provider of every configuration built here.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    static PROVIDER: OnceLock<Arc<rustls::crypto::CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// A client configuration builder with the ring provider and its safe default protocol
/// versions (TLS 1.2 and 1.3).
fn client_builder() -> rustls::ConfigBuilder<ClientConfig, rustls::WantsVerifier> {
    ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports TLS 1.2 and 1.3")
}

/// The system's trust roots, loaded once per process. Certificates the platform store holds
/// but webpki cannot parse are skipped; load errors are logged once.
fn system_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "TLS: could not load some of the system's CA certificates");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            tracing::warn!(
                ignored,
                "TLS: no system CA certificates found; https:// peers are only trusted through a \
                 configured CA file"
            );
        }
        roots
    })
}

/// Reads a file whole, naming it on failure.
fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// The `CERTIFICATE` blocks of a PEM file (at least one).
pub fn load_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what,
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The first private key of a PEM file.
pub fn load_key(path: &Path, what: &'static str) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path, what)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
            what,
            path: path.to_owned(),
        },
        e => TlsError::Pem {
            what,
            path: path.to_owned(),
            reason: e.to_string(),
        },
    })
}

/// The system roots plus the certificates of `ca_file`.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = system_roots().clone();
    if let Some(path) = ca_file {
        for (i, cert) in load_certs(path, "CA file")?.into_iter().enumerate() {
            roots.add(cert).map_err(|e| TlsError::BadCa {
                path: path.to_owned(),
                index: i + 1,
                reason: e.to_string(),
            })?;
        }
    }
    Ok(roots)
}

/// A client TLS configuration, built once and shared (cloning is an `Arc` clone).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    options: Arc<TlsOptions>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_file", &self.options.ca_file)
            .field("client_cert", &self.options.client_cert)
            .finish_non_exhaustive()
    }
}

/// Two handles are equal when they share one configuration.
impl PartialEq for ClientTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.config, &other.config)
    }
}

impl Eq for ClientTls {}

impl Default for ClientTls {
    fn default() -> Self {
        Self::system()
    }
}

impl ClientTls {
    /// Builds the configuration of `opts` (reading its files now). Default options give the
    /// shared [`ClientTls::system`].
    pub fn new(opts: &TlsOptions) -> Result<Self, TlsError> {
        if opts.is_default() {
            return Ok(Self::system());
        }
        let builder = client_builder().with_root_certificates(roots(opts.ca_file.as_deref())?);
        let config = match (&opts.client_cert, &opts.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => {
                return Err(TlsError::HalfPair {
                    given: "client_cert",
                    missing: "client_key",
                })
            }
            (None, Some(_)) => {
                return Err(TlsError::HalfPair {
                    given: "client_key",
                    missing: "client_cert",
                })
            }
            (Some(cert), Some(key)) => {
                let chain = load_certs(cert, "client certificate")?;
                let k = load_key(key, "client key")?;
                builder
                    .with_client_auth_cert(chain, k)
                    .map_err(|e| TlsError::Identity {
                        cert: cert.clone(),
                        key: key.clone(),
                        reason: e.to_string(),
                    })?
            }
        };
        Ok(Self {
            config: Arc::new(config),
            options: Arc::new(opts.clone()),
        })
    }

    /// The system's roots, no client certificate: one configuration per process.
    pub fn system() -> Self {
        static SYSTEM: OnceLock<ClientTls> = OnceLock::new();
        SYSTEM
            .get_or_init(|| ClientTls {
                config: Arc::new(
                    client_builder()
                        .with_root_certificates(system_roots().clone())
                        .with_no_client_auth(),
                ),
                options: Arc::new(TlsOptions::default()),
            })
            .clone()
    }

    /// The rustls configuration (no ALPN set).
    pub fn config(&self) -> &Arc<ClientConfig> {
        &self.config
    }

    /// The options it was built from.
    pub fn options(&self) -> &TlsOptions {
        &self.options
    }

    /// A tokio-rustls connector offering `alpn` (e.g. `[b"http/1.1"]`).
    pub fn tokio_connector(&self, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
        let mut c = (*self.config).clone();
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsConnector::from(Arc::new(c))
    }
}

/// The HTTP versions a connector offers over TLS (ALPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Versions {
    /// HTTP/1.1 only (no ALPN: servers default to it).
    #[default]
    Http1,
    /// HTTP/2 (ALPN `h2`; gRPC).
    Http2,
    /// HTTP/2 or HTTP/1.1, as the server prefers.
    Any,
}

/// How a [`connector`] connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectOptions {
    /// Limit of TCP connect + TLS handshake together; `None` = none.
    pub timeout: Option<Duration>,
    /// `TCP_NODELAY` (small writes such as streamed tokens are not delayed).
    pub nodelay: bool,
    /// TCP keepalive interval.
    pub keepalive: Option<Duration>,
    /// HTTP versions offered over TLS.
    pub versions: Versions,
}

/// A connector for hyper-util's legacy client (and tonic): `http://` in the clear, `https://`
/// with `tls`. See [`connector`].
#[derive(Clone)]
pub struct HttpsConnect {
    inner: HttpsConnector<HttpConnector>,
    timeout: Option<Duration>,
}

impl std::fmt::Debug for HttpsConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsConnect")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The stream an [`HttpsConnect`] yields.
pub type HttpsStream = MaybeHttpsStream<TokioIo<TcpStream>>;

/// A boxed error of a connection attempt.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connector for `http://` and `https://` URLs with `tls`: see [`ConnectOptions`].
pub fn connector(tls: &ClientTls, opts: ConnectOptions) -> HttpsConnect {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(opts.nodelay);
    http.set_keepalive(opts.keepalive);
    // The whole connect (TCP + TLS) is bounded below; TCP alone too, for the error message.
    http.set_connect_timeout(opts.timeout);
    let b = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*tls.config).clone())
        .https_or_http();
    let inner = match opts.versions {
        Versions::Http1 => b.enable_http1().wrap_connector(http),
        Versions::Http2 => b.enable_http2().wrap_connector(http),
        Versions::Any => b.enable_all_versions().wrap_connector(http),
    };
    HttpsConnect {
        inner,
        timeout: opts.timeout,
    }
}

/// The connect (TCP + TLS handshake) did not finish within the connector's timeout.
#[derive(Debug, thiserror::Error)]
#[error("connect (TCP and TLS handshake) timed out after {0:?}")]
pub struct ConnectTimeout(pub Duration);

impl tower_service::Service<Uri> for HttpsConnect {
    type Response = HttpsStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<HttpsStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::<Uri>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let fut = tower_service::Service::<Uri>::call(&mut self.inner, dst);
        match self.timeout {
            None => fut,
            Some(t) => Box::pin(async move {
                match tokio::time::timeout(t, fut).await {
                    Ok(r) => r,
                    Err(_) => Err(Box::new(ConnectTimeout(t)) as BoxError),
                }
            }),
        }
    }
}

/// Connectors chosen by the destination's origin (`scheme://host:port`): one hyper-util client
/// for several servers that each have their own TLS settings (the gateway's pass-through
/// client, one entry per upstream). A destination without an entry uses the default. The first
/// connector added for an origin is kept.
#[derive(Clone, Debug)]
pub struct ConnectorSet {
    default: HttpsConnect,
    by_origin: Arc<std::collections::HashMap<String, HttpsConnect>>,
}

impl ConnectorSet {
    /// A set whose destinations all use `default` until [`ConnectorSet::insert`] says otherwise.
    pub fn new(default: HttpsConnect) -> Self {
        Self {
            default,
            by_origin: Arc::default(),
        }
    }

    /// Uses `connector` for the origin of `url` (its path is ignored); an origin already in the
    /// set keeps its connector.
    pub fn insert(&mut self, url: &Uri, connector: HttpsConnect) {
        if let Some(o) = origin(url) {
            Arc::make_mut(&mut self.by_origin)
                .entry(o)
                .or_insert(connector);
        }
    }

    fn pick(&self, dst: &Uri) -> HttpsConnect {
        origin(dst)
            .and_then(|o| self.by_origin.get(&o))
            .unwrap_or(&self.default)
            .clone()
    }
}

/// `scheme://host:port` of a URL, the port made explicit (80 / 443).
fn origin(u: &Uri) -> Option<String> {
    let scheme = u.scheme_str()?.to_ascii_lowercase();
    let host = u.host()?.to_ascii_lowercase();
    let port = u.port_u16().or(match scheme.as_str() {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    })?;
    Some(format!("{scheme}://{host}:{port}"))
}

impl tower_service::Service<Uri> for ConnectorSet {
    type Response = HttpsStream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<HttpsStream, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each call uses a clone of a connector that is always ready (hyper-util's
        // `HttpConnector` has no readiness of its own).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let mut c = self.pick(&dst);
        tower_service::Service::<Uri>::call(&mut c, dst)
    }
}

/// The TLS server name (SNI, and the name the certificate must carry) of a URL host: a DNS
/// name, or an IP address (IPv6 with or without brackets).
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    let h = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(h.to_owned()).map_err(|e| TlsError::ServerName {
        host: host.to_owned(),
        reason: e.to_string(),
    })
}

/// An error and its sources, joined with `": "` (hyper-util's client error alone says
/// `client error (Connect)`; the TLS reason is further down the chain). Repeated messages
/// (a wrapper that prints its source) are shown once.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let m = s.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cur = s.source();
    }
    out
}

/// A server configuration from a PEM certificate chain and its key; with `client_ca`, clients
/// must present a certificate signed by one of its certificates (mutual TLS). `alpn`: the
/// protocols offered, in preference order (e.g. `[b"h2", b"http/1.1"]`).
pub fn server_config(
    cert_file: &Path,
    key_file: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = load_certs(cert_file, "server certificate")?;
    let key = load_key(key_file, "server key")?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for (i, cert) in load_certs(path, "client CA file")?.into_iter().enumerate() {
                roots.add(cert).map_err(|e| TlsError::BadCa {
                    path: path.to_owned(),
                    index: i + 1,
                    reason: e.to_string(),
                })?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.into(),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Identity {
            cert: cert_file.to_owned(),
            key: key_file.to_owned(),
            reason: e.to_string(),
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests;
