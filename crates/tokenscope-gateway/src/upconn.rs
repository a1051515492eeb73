//! Upstream HTTP/1 connections of measured requests, driven by the request's own task.
//!
//! hyper-util's pooled client runs every upstream connection in a task of its own, so each
//! response chunk crosses from that task to the request's task (a wake-up and a re-schedule
//! per SSE event) and becomes its own write to the client. Here a connection's future is
//! polled by whoever holds it — the handler while it waits for the response head, then
//! [`crate::body::MeteredBody`] while it forwards the body — so the chunks already read from
//! the socket are decoded, measured and forwarded in one pass (fewer wake-ups, one write for
//! what arrived together; nothing ever waits for more data).
//!
//! Invariants:
//! * A connection is polled only by its holder ([`UpConn::drive`]). Idle connections in the
//!   [`UpPool`] are not polled: a connection the engine closed meanwhile is found at checkout
//!   (its future is complete or its sender is closed) and dropped.
//! * A connection returns to the pool only after its response ended and it is ready for the
//!   next request ([`UpConn::release`]); dropped mid-response (client gone, upstream error,
//!   idle timeout) it is closed, which also tells the engine to stop generating.
//! * At most `max_idle` idle connections per upstream. A connection is reused only before
//!   its reuse deadline: the pool's idle limit (`upstream_idle_timeout_ms`), shortened by the
//!   engine's own `Keep-Alive: timeout=T` (to `max(T − 1 s, T / 2)`) and ended by `max=0`,
//!   counted from the end of its last response. Engines close idle connections after a few
//!   seconds (llama.cpp and uvicorn: 5 s); a request written on a connection the engine is
//!   closing at that moment is lost, and cannot be sent again (nothing tells whether the
//!   engine read it), so the pool retires a connection before the engine would.
//! * Some engines close the connection right after every streamed (chunked) response without
//!   saying so (llama.cpp's server: still `Keep-Alive: timeout=5, max=100`, no
//!   `Connection: close`); pooled, such a connection would take the next request just as the
//!   close arrives. So the pool learns, per upstream, what happens after a chunked response:
//!   the first ones are watched for [`PROBE`] before pooling; one closed meanwhile (or found
//!   closed at checkout within [`EARLY_CLOSE`] of its response) → connections are never reused
//!   after a chunked response; [`PROBES_TO_TRUST`] still open → pooled like any other.
//! * A request that a stale pooled connection refused before writing it is sent again on
//!   another connection (hyper hands the request back); a request that was written is never
//!   sent twice.
//! * The pool's lock is held for a `VecDeque` push or pop only, never across I/O.
//! * `https://` upstreams: the connection is TLS over TCP ([`UpStream`] =
//!   `tokenscope_net::MaybeTls`; rustls, SNI from the URL's host, ALPN `http/1.1`, the
//!   upstream's CA file and client certificate), opened and handshaken within
//!   `connect_timeout`; a failed handshake is [`UpError::Tls`] (nothing was sent). `http://`
//!   connections are plain TCP: one `match` per I/O call is all they pay for TLS support.

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{Builder, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokenscope_net::rustls::pki_types::ServerName;
use tokenscope_net::tokio_rustls::{client::TlsStream, TlsConnector};
use tokio::net::TcpStream;

/// How long a connection is watched after a chunked response while the pool does not know yet
/// whether the upstream closes connections after those (module docs).
pub(crate) const PROBE: Duration = Duration::from_millis(250);
/// A connection found closed at checkout this soon after its chunked response was closed by
/// the upstream because of that response, not for being idle.
pub(crate) const EARLY_CLOSE: Duration = Duration::from_secs(1);
/// Chunked responses after which the connection stayed open for [`PROBE`] before the pool
/// reuses connections after chunked responses without watching them first.
pub(crate) const PROBES_TO_TRUST: u8 = 3;

/// What the pool knows about the upstream's connections after a chunked response.
const AFTER_CHUNKED_UNKNOWN: u8 = 0;
const AFTER_CHUNKED_REUSABLE: u8 = 1;
const AFTER_CHUNKED_CLOSED: u8 = 2;

/// What a response's `Keep-Alive` header says about reusing its connection (RFC 2068 §19.7.1;
/// sent by llama.cpp's cpp-httplib as `timeout=5, max=100`, by Apache, nginx as upstream…).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct KeepAlive {
    /// `timeout=`: seconds the server keeps an idle connection open.
    pub timeout: Option<Duration>,
    /// `max=`: requests the server still accepts on the connection.
    pub max: Option<u64>,
}

impl KeepAlive {
    /// Reads `timeout=` and `max=` from every `Keep-Alive` header of `headers`; parameters it
    /// does not know, or values that are not integers, are ignored. The last value wins.
    pub(crate) fn parse(headers: &http::HeaderMap) -> Self {
        let mut ka = KeepAlive::default();
        for v in headers.get_all(http::header::HeaderName::from_static("keep-alive")) {
            let Ok(v) = v.to_str() else { continue };
            for param in v.split(',') {
                let Some((k, val)) = param.split_once('=') else {
                    continue;
                };
                let val = val.trim().trim_matches('"');
                let k = k.trim();
                if k.eq_ignore_ascii_case("timeout") {
                    if let Ok(t) = val.parse::<u64>() {
                        ka.timeout = Some(Duration::from_secs(t));
                    }
                } else if k.eq_ignore_ascii_case("max") {
                    if let Ok(m) = val.parse::<u64>() {
                        ka.max = Some(m);
                    }
                }
            }
        }
        ka
    }

    /// How long after its last response a connection may still be reused: `limit` (the
    /// configured idle limit), shortened by an advertised `timeout=T` to `max(T − 1 s, T / 2)`
    /// — a margin for the close already travelling towards us and for our own request
    /// travelling towards the engine — and zero when the server accepts no more requests
    /// (`max=0`).
    pub(crate) fn reuse_within(&self, limit: Duration) -> Duration {
        if self.max == Some(0) {
            return Duration::ZERO;
        }
        match self.timeout {
            Some(t) => limit.min(t.saturating_sub(Duration::from_secs(1)).max(t / 2)),
            None => limit,
        }
    }
}

/// The byte stream of an upstream connection: plain TCP (`http://`) or TLS over TCP
/// (`https://`).
pub(crate) type UpStream = tokenscope_net::MaybeTls<TlsStream<TcpStream>>;

type Conn = Connection<TokioIo<UpStream>, Full<Bytes>>;

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpError {
    /// No connection could be opened (refused, unreachable, connect timeout).
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    /// The TLS handshake with an `https://` upstream failed (untrusted or mismatched
    /// certificate, a client certificate refused, no common protocol…); nothing was sent.
    #[error("TLS with {addr}: {reason}")]
    Tls { addr: String, reason: String },
    /// The connection failed while sending the request or reading the response head (hyper's
    /// error and its causes, e.g. a TLS alert: `connection error: received fatal alert: …`).
    #[error("{}", tokenscope_net::error_chain(.0))]
    Http(#[from] hyper::Error),
}

impl UpError {
    /// `true` when no connection could be opened (refused, unreachable, timed out, or its TLS
    /// handshake failed): nothing of the request was sent.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, UpError::Connect { .. } | UpError::Tls { .. })
    }

    /// The error code a client (and the record's `error_type`) gets for it.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            UpError::Connect { .. } => "upstream_unreachable",
            UpError::Tls { .. } => "upstream_tls",
            UpError::Http(_) => "upstream_failed",
        }
    }
}

/// How the pool's connections to an `https://` upstream are made.
struct TlsTarget {
    connector: TlsConnector,
    /// SNI and the name the certificate must carry; `Err`: the URL's host cannot be one
    /// (every connection attempt fails with that).
    name: Result<ServerName<'static>, String>,
}

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    conn: Pin<Box<Conn>>,
    /// Not reused from this instant on (see the module docs).
    expires: Instant,
    /// When its last response ended.
    released: Instant,
    /// Its last response was chunked.
    chunked: bool,
}

/// The idle connections of one upstream. See the module docs.
pub(crate) struct UpPool {
    /// `host:port` to connect to.
    addr: String,
    /// `Some` for an `https://` upstream.
    tls: Option<TlsTarget>,
    /// `Host` header value.
    host: Option<HeaderValue>,
    connect_timeout: Duration,
    max_idle: usize,
    /// The configured idle limit (`upstream_idle_timeout_ms`); zero = never reuse.
    idle_timeout: Duration,
    idle: Mutex<VecDeque<Idle>>,
    /// `AFTER_CHUNKED_*`: whether connections stay open after a chunked response.
    after_chunked: AtomicU8,
    /// Chunked responses whose connection stayed open for [`PROBE`] (up to
    /// [`PROBES_TO_TRUST`]).
    probes_ok: AtomicU8,
}

/// One upstream connection held by a request.
pub(crate) struct UpConn {
    sender: SendRequest<Full<Bytes>>,
    /// `None` once the connection future completed (closed or failed).
    conn: Option<Pin<Box<Conn>>>,
    pool: Arc<UpPool>,
    /// From the last response's `Keep-Alive` header.
    keep_alive: KeepAlive,
    /// The last response had no `Content-Length` (chunked, e.g. a stream).
    chunked: bool,
}

impl UpPool {
    /// A pool for the upstream at `base` (`http[s]://host[:port][/prefix]`) that reuses a
    /// connection for at most `idle_timeout` after its last response (zero: never); `tls` is
    /// used for an `https://` base.
    pub(crate) fn new(
        base: &Uri,
        connect_timeout: Duration,
        max_idle: usize,
        idle_timeout: Duration,
        tls: &tokenscope_net::ClientTls,
    ) -> Arc<Self> {
        let host = base.host().unwrap_or("127.0.0.1");
        let https = base.scheme_str() == Some("https");
        let port = base.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = https.then(|| TlsTarget {
            connector: tls.tokio_connector(&[b"http/1.1"]),
            name: tokenscope_net::server_name(host).map_err(|e| e.to_string()),
        });
        let addr = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let host_header = base
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok());
        Arc::new(Self {
            addr,
            tls,
            host: host_header,
            connect_timeout,
            max_idle,
            idle_timeout,
            idle: Mutex::new(VecDeque::new()),
            after_chunked: AtomicU8::new(AFTER_CHUNKED_UNKNOWN),
            probes_ok: AtomicU8::new(0),
        })
    }

    /// Idle connections now (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn idle_len(&self) -> usize {
        self.idle.lock().len()
    }

    /// The most recently used idle connection that is still open.
    fn checkout(self: &Arc<Self>) -> Option<UpConn> {
        let now = Instant::now();
        loop {
            let mut idle = {
                let mut q = self.idle.lock();
                // Expired connections are closed outside the lock.
                let mut expired = Vec::new();
                while q.front().is_some_and(|i| i.expires <= now) {
                    expired.extend(q.pop_front());
                }
                let next = q.pop_back();
                drop(q);
                drop(expired);
                next?
            };
            // Deadlines differ per connection (`Keep-Alive`): the front is not always first.
            if idle.expires <= now {
                continue;
            }
            // A closed connection's future is ready (EOF or error): look without waiting.
            let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
            if idle.sender.is_closed()
                || idle.conn.as_mut().poll(&mut cx).is_ready()
                || !idle.sender.is_ready()
            {
                if idle.chunked && now.duration_since(idle.released) < EARLY_CLOSE {
                    self.learn_closed_after_chunked();
                }
                continue;
            }
            return Some(UpConn {
                sender: idle.sender,
                conn: Some(idle.conn),
                pool: Arc::clone(self),
                keep_alive: KeepAlive::default(),
                chunked: false,
            });
        }
    }

    /// Opens a connection: TCP, and for `https://` the TLS handshake, both within
    /// `connect_timeout`.
    async fn open(&self) -> Result<UpStream, UpError> {
        let tcp = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| UpError::Connect {
                addr: self.addr.clone(),
                reason: e.to_string(),
            })?;
        // Streamed tokens are small writes: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(UpStream::Plain(tcp));
        };
        let tls_err = |reason: String| UpError::Tls {
            addr: self.addr.clone(),
            reason,
        };
        let name = tls.name.clone().map_err(tls_err)?;
        let s = tls
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| tls_err(e.to_string()))?;
        Ok(UpStream::Tls(Box::new(s)))
    }

    async fn connect(self: &Arc<Self>) -> Result<UpConn, UpError> {
        let stream = match tokio::time::timeout(self.connect_timeout, self.open()).await {
            Err(_) => {
                let what = if self.tls.is_some() {
                    " (TCP connect and TLS handshake)"
                } else {
                    ""
                };
                return Err(UpError::Connect {
                    addr: self.addr.clone(),
                    reason: format!("timed out after {:?}{what}", self.connect_timeout),
                });
            }
            Ok(r) => r?,
        };
        let (sender, conn) = Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(UpError::Http)?;
        Ok(UpConn {
            sender,
            conn: Some(Box::pin(conn)),
            pool: Arc::clone(self),
            keep_alive: KeepAlive::default(),
            chunked: false,
        })
    }

    /// Pools a connection that may be reused until `end.expires`; one expired by `now` (or
    /// one over `max_idle`) is closed instead.
    fn put(
        &self,
        sender: SendRequest<Full<Bytes>>,
        conn: Pin<Box<Conn>>,
        end: ResponseEnd,
        now: Instant,
    ) {
        if end.expires <= now {
            return;
        }
        let mut q = self.idle.lock();
        if q.len() < self.max_idle {
            q.push_back(Idle {
                sender,
                conn,
                expires: end.expires,
                released: end.at,
                chunked: end.chunked,
            });
        }
    }

    /// The upstream closes connections after chunked responses: stop reusing those.
    fn learn_closed_after_chunked(&self) {
        if self
            .after_chunked
            .swap(AFTER_CHUNKED_CLOSED, Ordering::Relaxed)
            != AFTER_CHUNKED_CLOSED
        {
            tracing::info!(
                upstream = %self.addr,
                "the upstream closes connections after streamed (chunked) responses; \
                 a new connection is opened for the request after each"
            );
        }
    }

    /// A connection stayed open for [`PROBE`] after a chunked response.
    fn learn_open_after_chunked(&self) {
        let ok = self
            .probes_ok
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if ok >= PROBES_TO_TRUST {
            let _ = self.after_chunked.compare_exchange(
                AFTER_CHUNKED_UNKNOWN,
                AFTER_CHUNKED_REUSABLE,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }
}

/// How a response ended, for pooling its connection.
#[derive(Clone, Copy)]
struct ResponseEnd {
    /// When the response ended.
    at: Instant,
    /// Reuse deadline.
    expires: Instant,
    /// It had no `Content-Length`.
    chunked: bool,
}

/// Waits (at most 5 s) until `conn` is ready for another request, then pools it; watches it
/// for [`PROBE`] first when `probe` (learning what the upstream does after chunked responses).
async fn settle(
    pool: Arc<UpPool>,
    mut sender: SendRequest<Full<Bytes>>,
    conn: Pin<Box<Conn>>,
    end: ResponseEnd,
    probe: bool,
) {
    let mut conn = Some(conn);
    // Ready(()) once the connection closed (EOF or error).
    let mut closed = std::future::poll_fn(|cx| {
        if let Some(c) = conn.as_mut() {
            if c.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        conn = None;
        Poll::Ready(())
    });
    if probe {
        if tokio::time::timeout(PROBE, &mut closed).await.is_ok() {
            pool.learn_closed_after_chunked();
            return;
        }
        pool.learn_open_after_chunked();
    }
    drop(closed);
    let ready = tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| {
            if let Some(c) = conn.as_mut() {
                if c.as_mut().poll(cx).is_ready() {
                    conn = None;
                    return Poll::Ready(false);
                }
            }
            sender.poll_ready(cx).map(|r| r.is_ok())
        }),
    )
    .await;
    if let (Ok(true), Some(c)) = (ready, conn) {
        pool.put(sender, c, end, Instant::now());
    }
}

/// Sends `req` (origin-form URI) to the pool's upstream: on an idle connection when one is
/// open, else on a new one. Returns the response head and the connection, which the caller
/// keeps driving while it reads the body.
pub(crate) async fn send(
    pool: &Arc<UpPool>,
    mut req: Request<Full<Bytes>>,
) -> Result<(Response<Incoming>, UpConn), UpError> {
    if let Some(h) = pool.host.clone() {
        req.headers_mut().entry(http::header::HOST).or_insert(h);
    }
    while let Some(mut c) = pool.checkout() {
        match c.send(req).await {
            Ok(resp) => return Ok((resp, c)),
            // Refused before it was written (the connection was closing): try another one.
            Err(Refused::Again(r)) => req = *r,
            Err(Refused::Failed(e)) => return Err(UpError::Http(e)),
        }
    }
    let mut c = pool.connect().await?;
    match c.send(req).await {
        Ok(resp) => Ok((resp, c)),
        Err(Refused::Again(_)) => Err(UpError::Connect {
            addr: pool.addr.clone(),
            reason: "the new connection closed before the request was sent".into(),
        }),
        Err(Refused::Failed(e)) => Err(UpError::Http(e)),
    }
}

enum Refused {
    Again(Box<Request<Full<Bytes>>>),
    Failed(hyper::Error),
}

impl UpConn {
    async fn send(&mut self, req: Request<Full<Bytes>>) -> Result<Response<Incoming>, Refused> {
        let mut fut = std::pin::pin!(self.sender.try_send_request(req));
        let res = std::future::poll_fn(|cx| {
            if let Some(c) = self.conn.as_mut() {
                if c.as_mut().poll(cx).is_ready() {
                    self.conn = None;
                }
            }
            fut.as_mut().poll(cx)
        })
        .await;
        match res {
            Ok(resp) => {
                self.keep_alive = KeepAlive::parse(resp.headers());
                self.chunked = !resp.headers().contains_key(http::header::CONTENT_LENGTH);
                Ok(resp)
            }
            Err(mut e) => Err(match e.take_message() {
                Some(r) => Refused::Again(Box::new(r)),
                None => Refused::Failed(e.into_error()),
            }),
        }
    }

    /// Polls the connection (reads, decodes, writes what it can); registers `cx` for its I/O.
    pub(crate) fn drive(&mut self, cx: &mut Context<'_>) {
        if let Some(c) = self.conn.as_mut() {
            if c.as_mut().poll(cx).is_ready() {
                self.conn = None;
            }
        }
    }

    /// The response body was read to its end: back to the pool when the connection is ready
    /// for another request, else a short task waits for that (or closes it).
    pub(crate) fn release(mut self) {
        // The idle time starts now, when the response ended (the engine's idle timer started
        // when it wrote the end, a little earlier: the margin in `reuse_within` covers it).
        let at = Instant::now();
        let end = ResponseEnd {
            at,
            expires: at + self.keep_alive.reuse_within(self.pool.idle_timeout),
            chunked: self.chunked,
        };
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        self.drive(&mut cx);
        let (sender, pool) = (self.sender, self.pool);
        let Some(conn) = self.conn.take() else {
            if end.chunked {
                // Closed as soon as the chunked response ended.
                pool.learn_closed_after_chunked();
            }
            return;
        };
        if end.expires <= at {
            return; // never reused (`upstream_idle_timeout_ms = 0`, `Keep-Alive: max=0`)
        }
        let probe = end.chunked
            && match pool.after_chunked.load(Ordering::Relaxed) {
                AFTER_CHUNKED_CLOSED => return,
                AFTER_CHUNKED_REUSABLE => false,
                _ => true,
            };
        if !probe && sender.is_ready() {
            pool.put(sender, conn, end, at);
            return;
        }
        tokio::spawn(settle(pool, sender, conn, end, probe));
    }
}

/// A response body read over an [`UpConn`] that nobody measures (pass-through): drives the
/// connection while it is read, returns it to the pool at the end of the body, closes it when
/// dropped early or on an error.
pub(crate) struct PooledBody {
    body: Incoming,
    conn: Option<UpConn>,
}

impl PooledBody {
    pub(crate) fn new(body: Incoming, conn: UpConn) -> Self {
        Self {
            body,
            conn: Some(conn),
        }
    }
}

impl http_body::Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        if let Some(c) = self.conn.as_mut() {
            c.drive(cx);
        }
        let r = Pin::new(&mut self.body).poll_frame(cx);
        match &r {
            Poll::Ready(None) => {
                if let Some(c) = self.conn.take() {
                    c.release();
                }
            }
            Poll::Ready(Some(Err(_))) => self.conn = None,
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A tiny HTTP/1.1 server: answers every request on a connection with `body`, closing the
    /// connection after `per_conn` responses. Returns its address and the number of accepted
    /// connections.
    async fn server(per_conn: usize) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        server_with(per_conn, "").await
    }

    /// [`server`] that adds `extra` (whole header lines) to every response.
    async fn server_with(
        per_conn: usize,
        extra: &'static str,
    ) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let acc = accepted.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                acc.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(answer(s, per_conn, extra));
            }
        });
        (addr, accepted)
    }

    /// Answers `per_conn` requests on `s` with `ok` (see [`server`]).
    async fn answer<S>(mut s: S, per_conn: usize, extra: &'static str)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let mut buf = vec![0u8; 4096];
        for i in 0..per_conn {
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let close = i + 1 == per_conn;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n{extra}{}\r\nok",
                if close { "connection: close\r\n" } else { "" }
            );
            if s.write_all(resp.as_bytes()).await.is_err() || s.flush().await.is_err() {
                return;
            }
        }
    }

    /// [`server`] behind TLS (a fresh test PKI's server certificate, for `localhost`): its port,
    /// the number of completed handshakes, the PKI and the directory holding it.
    async fn tls_server(
        per_conn: usize,
    ) -> (
        u16,
        Arc<std::sync::atomic::AtomicUsize>,
        tokenscope_net::test_util::TestPki,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = tokenscope_net::test_util::TestPki::generate(dir.path()).expect("pki");
        let cfg =
            tokenscope_net::server_config(&pki.server_cert, &pki.server_key, None, &[b"http/1.1"])
                .expect("server config");
        let acceptor = tokenscope_net::tokio_rustls::TlsAcceptor::from(cfg);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = l.local_addr().expect("addr").port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let acc = accepted.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let acceptor = acceptor.clone();
                let acc = acc.clone();
                tokio::spawn(async move {
                    if let Ok(s) = acceptor.accept(s).await {
                        acc.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        answer(s, per_conn, "").await;
                    }
                });
            }
        });
        (port, accepted, pki, dir)
    }

    fn https_pool(port: u16, tls: &tokenscope_net::ClientTls) -> Arc<UpPool> {
        UpPool::new(
            &format!("https://localhost:{port}").parse().expect("uri"),
            Duration::from_secs(5),
            8,
            Duration::from_secs(60),
            tls,
        )
    }

    #[tokio::test]
    async fn https_upstreams_reuse_tls_connections() {
        let (port, accepted, pki, _dir) = tls_server(3).await;
        let tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
            ca_file: Some(pki.ca.clone()),
            ..Default::default()
        })
        .expect("client tls");
        let pool = https_pool(port, &tls);
        for _ in 0..4 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
        }
        // Three responses per connection: four requests, two handshakes.
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_untrusted_certificate_is_a_tls_error() {
        let (port, accepted, pki, _dir) = tls_server(3).await;
        for tls in [
            tokenscope_net::ClientTls::system(),
            tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
                ca_file: Some(pki.other_ca.clone()),
                ..Default::default()
            })
            .expect("client tls"),
        ] {
            let err = get(&https_pool(port, &tls)).await.expect_err("untrusted");
            assert!(matches!(err, UpError::Tls { .. }), "{err}");
            assert_eq!(err.code(), "upstream_tls");
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!(
                    "TLS with localhost:{port}: invalid peer certificate"
                )) && msg.contains("UnknownIssuer"),
                "{msg}"
            );
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn the_connect_timeout_covers_the_tls_handshake() {
        // Accepts TCP and never answers the ClientHello.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = l.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        let pool = UpPool::new(
            &format!("https://127.0.0.1:{port}").parse().expect("uri"),
            Duration::from_millis(200),
            8,
            Duration::from_secs(60),
            &tokenscope_net::ClientTls::system(),
        );
        let err = get(&pool).await.expect_err("timeout");
        assert!(err.is_connect(), "{err}");
        assert!(err.to_string().contains("TLS handshake"), "{err}");
    }

    fn pool_for(addr: &str) -> Arc<UpPool> {
        pool_idle(addr, Duration::from_secs(60))
    }

    fn pool_idle(addr: &str, idle_timeout: Duration) -> Arc<UpPool> {
        UpPool::new(
            &format!("http://{addr}").parse().expect("uri"),
            Duration::from_secs(1),
            8,
            idle_timeout,
            &tokenscope_net::ClientTls::system(),
        )
    }

    async fn get(pool: &Arc<UpPool>) -> Result<String, UpError> {
        let req = Request::get("/x")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let (resp, mut conn) = send(pool, req).await?;
        let mut body = resp.into_body();
        let mut out = Vec::new();
        loop {
            let frame = std::future::poll_fn(|cx| {
                conn.drive(cx);
                Pin::new(&mut body).poll_frame(cx)
            })
            .await;
            match frame {
                Some(Ok(f)) => out.extend_from_slice(&f.into_data().unwrap_or_default()),
                Some(Err(e)) => return Err(UpError::Http(e)),
                None => break,
            }
        }
        conn.release();
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    #[tokio::test]
    async fn reuses_connections_and_drops_closed_ones() {
        let (addr, accepted) = server(3).await;
        let pool = pool_for(&addr.to_string());
        for _ in 0..7 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
        }
        // 3 responses per connection, the third closes it: 7 requests need 3 connections,
        // and none is sent on a closed one.
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert!(pool.idle_len() <= 1);
    }

    #[tokio::test]
    async fn dead_upstream_is_a_connect_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        let pool = pool_for(&addr.to_string());
        let err = get(&pool).await.expect_err("nobody listens");
        assert!(err.is_connect(), "{err}");
    }

    #[tokio::test]
    async fn dropped_mid_body_closes_the_connection() {
        let (addr, accepted) = server(100).await;
        let pool = pool_for(&addr.to_string());
        let req = Request::get("/x")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let (resp, conn) = send(&pool, req).await.expect("head");
        drop((resp, conn)); // not released: closed, never pooled
        assert_eq!(pool.idle_len(), 0);
        assert_eq!(get(&pool).await.expect("response"), "ok");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(pool.idle_len(), 1);
    }

    fn headers(values: &[&str]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for v in values {
            h.append("keep-alive", HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn keep_alive_header_parsing() {
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(
            KeepAlive::parse(&headers(&["timeout=5, max=100"])),
            KeepAlive {
                timeout: secs(5),
                max: Some(100)
            }
        );
        // Case, spaces, quotes, unknown parameters, several headers (the last value wins).
        assert_eq!(
            KeepAlive::parse(&headers(&[
                " Timeout = \"7\" ;x",
                "foo, MAX=3",
                "timeout=2"
            ])),
            KeepAlive {
                timeout: secs(2),
                max: Some(3)
            }
        );
        // Not integers, no value, absent: nothing known.
        for h in [
            headers(&["timeout=1.5, max=-1"]),
            headers(&["timeout, max"]),
            headers(&[]),
        ] {
            assert_eq!(KeepAlive::parse(&h), KeepAlive::default(), "{h:?}");
        }
    }

    #[test]
    fn reuse_deadline_from_limit_and_keep_alive() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        let ka = |timeout: Option<u64>, max: Option<u64>| KeepAlive {
            timeout: timeout.map(s),
            max,
        };
        // Nothing advertised: the configured limit.
        assert_eq!(ka(None, None).reuse_within(s(4)), s(4));
        assert_eq!(ka(None, Some(100)).reuse_within(ms(0)), ms(0));
        // llama.cpp's `timeout=5`: one second of margin, unless the limit is shorter.
        assert_eq!(ka(Some(5), Some(100)).reuse_within(s(60)), s(4));
        assert_eq!(ka(Some(5), None).reuse_within(s(3)), s(3));
        // Short timeouts: half of it.
        assert_eq!(ka(Some(1), None).reuse_within(s(60)), ms(500));
        assert_eq!(ka(Some(2), None).reuse_within(s(60)), s(1));
        assert_eq!(ka(Some(0), None).reuse_within(s(60)), ms(0));
        // `max=0`: no further request on this connection.
        assert_eq!(ka(Some(5), Some(0)).reuse_within(s(60)), ms(0));
    }

    #[tokio::test]
    async fn pooled_until_the_advertised_keep_alive_allows() {
        let (addr, accepted) = server_with(100, "keep-alive: timeout=1, max=100\r\n").await;
        let pool = pool_for(&addr);
        let before = Instant::now();
        assert_eq!(get(&pool).await.expect("response"), "ok");
        let after = Instant::now();
        let expires = pool.idle.lock().front().map(|i| i.expires).expect("pooled");
        // Reusable for 500 ms after the response ended (`timeout=1`), not the pool's 60 s.
        assert!(
            expires >= before + Duration::from_millis(500),
            "{expires:?}"
        );
        assert!(expires <= after + Duration::from_millis(500), "{expires:?}");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn expired_connections_are_not_reused() {
        let (addr, accepted) = server(100).await;
        let pool = pool_for(&addr);
        assert_eq!(get(&pool).await.expect("response"), "ok");
        assert_eq!(get(&pool).await.expect("response"), "ok");
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "reused"
        );
        // The deadline passes (as it would after the idle limit).
        for i in pool.idle.lock().iter_mut() {
            i.expires = Instant::now();
        }
        assert_eq!(get(&pool).await.expect("response"), "ok");
        assert_eq!(
            accepted.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "a new connection"
        );
        assert_eq!(pool.idle_len(), 1, "the expired one is gone");
    }

    #[tokio::test]
    async fn never_reused_with_a_zero_limit_or_max_0() {
        let (addr, accepted) = server(100).await;
        let pool = pool_idle(&addr, Duration::ZERO);
        for _ in 0..3 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(pool.idle_len(), 0);

        let (addr, accepted) = server_with(100, "keep-alive: timeout=5, max=0\r\n").await;
        let pool = pool_for(&addr);
        for _ in 0..3 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(pool.idle_len(), 0);
    }

    /// A server answering every request with a chunked `ok`; `close_after`: closes the
    /// connection right after each response, without saying so (llama.cpp after a stream).
    async fn chunked_server(close_after: bool) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let acc = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                acc.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    loop {
                        let mut got = Vec::new();
                        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => got.extend_from_slice(&buf[..n]),
                            }
                        }
                        let resp = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\
                                    keep-alive: timeout=5, max=100\r\n\r\n2\r\nok\r\n0\r\n\r\n";
                        if s.write_all(resp.as_bytes()).await.is_err() || close_after {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    async fn after_chunked_settles(pool: &UpPool, want: u8) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.after_chunked.load(Ordering::Relaxed) != want {
            assert!(Instant::now() < deadline, "pool did not learn {want}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn learns_that_the_upstream_closes_after_chunked_responses() {
        let (addr, accepted) = chunked_server(true).await;
        let pool = pool_for(&addr);
        assert_eq!(get(&pool).await.expect("response"), "ok");
        // Watched, not pooled: the close arrives within the probe.
        assert_eq!(pool.idle_len(), 0);
        after_chunked_settles(&pool, AFTER_CHUNKED_CLOSED).await;
        for _ in 0..5 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
            assert_eq!(pool.idle_len(), 0, "never pooled after a chunked response");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 6);
    }

    #[tokio::test]
    async fn trusts_connections_that_stay_open_after_chunked_responses() {
        let (addr, accepted) = chunked_server(false).await;
        let pool = pool_for(&addr);
        for n in 1..=usize::from(PROBES_TO_TRUST) {
            assert_eq!(get(&pool).await.expect("response"), "ok");
            // Pooled once the probe saw it stay open.
            let deadline = Instant::now() + Duration::from_secs(10);
            while pool.idle_len() == 0 {
                assert!(Instant::now() < deadline, "probe {n} never pooled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        after_chunked_settles(&pool, AFTER_CHUNKED_REUSABLE).await;
        // Trusted: pooled as soon as the response ends, one connection for all.
        for _ in 0..5 {
            assert_eq!(get(&pool).await.expect("response"), "ok");
            assert_eq!(pool.idle_len(), 1);
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_trusted_upstream_found_closing_after_chunked_responses_is_distrusted() {
        let (addr, accepted) = chunked_server(true).await;
        let pool = pool_for(&addr);
        pool.after_chunked
            .store(AFTER_CHUNKED_REUSABLE, Ordering::Relaxed);
        assert_eq!(get(&pool).await.expect("response"), "ok");
        // Pooled at once (trusted); the server's close arrives meanwhile.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(get(&pool).await.expect("response"), "ok");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(
            pool.after_chunked.load(Ordering::Relaxed),
            AFTER_CHUNKED_CLOSED,
            "found closed at checkout soon after its chunked response"
        );
        assert_eq!(
            pool.idle_len(),
            0,
            "no longer pooled after a chunked response"
        );
    }
}
