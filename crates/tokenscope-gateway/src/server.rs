//! The listeners' accept loops and client connections: caps, timeouts and shutdown.
//!
//! `axum::serve` has no connection cap, no header-read timeout, no write timeout and no way to
//! cut the connections it spawned, so both listeners are served here with hyper-util's
//! connection builder (HTTP/1 and HTTP/2, as before):
//!
//! * **Connection cap with eviction** (`max_connections`). At the cap, a new connection evicts
//!   the connection that has been *reusable* longest — no request in flight: still sending its
//!   headers, or idle between keep-alive requests — the way nginx drains reusable connections
//!   when it runs out (`ngx_drain_connections`). Slow-header and idle connections therefore
//!   never lock out a client that sends a request; only when every connection carries a
//!   request in flight is the new one answered `503` and closed. The cap defaults to what the
//!   open-file limit allows (each proxied request also holds an upstream socket).
//! * **Header timeout** (`header_timeout`): a request's headers must arrive within it, counted
//!   from the connection's start or the end of the previous response (so it is also the
//!   keep-alive idle timeout); hyper closes the connection past it.
//! * **Header size** (`max_header_bytes`): larger request heads get `431` from hyper.
//! * **Write timeout** (`write_timeout`): a client that stops reading makes our writes pend;
//!   after `write_timeout` without progress the connection fails, its response body is dropped
//!   (which closes the upstream connection and frees the engine's slot) and the record says
//!   `client_write_timeout` ([`ConnState::write_stalled`]).
//! * **TLS** (`[listen_tls]`, the proxy listener): the handshake runs on the connection's own
//!   task, within the header timeout, and a connection still handshaking is reusable (evictable)
//!   like one still sending its headers; a failed handshake closes only that connection
//!   (counted in `tokenscope_connections_tls_handshake_failures_total`). Plain listeners pay
//!   one `match` per I/O call for it ([`tokenscope_net::MaybeTls`]).
//! * **Shutdown** ([`Connections`]): stop accepting, ask every connection to finish its
//!   in-flight requests (HTTP/1 keep-alive off, HTTP/2 GOAWAY), and after the grace period cut
//!   the rest: their futures are dropped, so each measured request's guard writes its record
//!   (`shutdown`, with the tokens seen so far) before [`Connections::wait`] returns.
//!
//! Invariants: the registry's lock is held for a map insert, remove or scan, never across
//! I/O; a connection's task removes its own entry when it ends (drop guard), so the count is
//! exact; per request the only extra work is one `Arc` clone and two atomic updates.

use axum::body::Body;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Limits of one listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnLimits {
    /// Open client connections at most (≥ 1).
    pub max_connections: usize,
    /// Time for a request's headers (also the keep-alive idle timeout).
    pub header_timeout: Duration,
    /// Longest a write to the client may make no progress; `None` = unlimited.
    pub write_timeout: Option<Duration>,
    /// Largest request head (hyper answers 431 beyond it).
    pub max_header_bytes: usize,
    /// `TCP_NODELAY` on accepted connections.
    pub nodelay: bool,
}

/// What a handler can learn about the client connection its request came on (a request
/// extension).
#[derive(Debug, Default)]
pub(crate) struct ConnState {
    /// Requests of this connection whose response has not ended.
    active: AtomicUsize,
    /// Nanoseconds since the registry's epoch when the connection last became reusable.
    reusable_since: AtomicU64,
    /// A write to the client made no progress for the write timeout.
    pub write_stalled: AtomicBool,
    /// Asked to close (at the cap); not picked again.
    evicting: AtomicBool,
}

/// Counters of one listener's connections (`tokenscope_connections_*{listener}` on
/// `/metrics`).
#[derive(Debug, Default, Clone)]
pub(crate) struct ConnCounters {
    /// Accepted over the listener's life.
    pub accepted: Counter,
    /// Closed to make room for a new connection.
    pub evicted: Counter,
    /// Refused (`503`) because every connection had a request in flight.
    pub rejected: Counter,
    /// Failed writes to clients that stopped reading.
    pub write_timeouts: Counter,
    /// TLS handshakes that failed or timed out (`[listen_tls]`).
    pub tls_failures: Counter,
    /// Open now.
    pub open: Gauge,
}

type Labels = Vec<(String, String)>;

/// The `tokenscope_connections_*` families, one series per listener.
pub(crate) struct ConnMetrics {
    accepted: Family<Labels, Counter>,
    evicted: Family<Labels, Counter>,
    rejected: Family<Labels, Counter>,
    write_timeouts: Family<Labels, Counter>,
    tls_failures: Family<Labels, Counter>,
    open: Family<Labels, Gauge>,
}

impl ConnMetrics {
    /// Registers the families in `registry`.
    pub(crate) fn register(registry: &mut prometheus_client::registry::Registry) -> Self {
        let m = Self {
            accepted: Family::default(),
            evicted: Family::default(),
            rejected: Family::default(),
            write_timeouts: Family::default(),
            tls_failures: Family::default(),
            open: Family::default(),
        };
        registry.register(
            "tokenscope_connections_accepted",
            "Client connections accepted, per listener",
            m.accepted.clone(),
        );
        registry.register(
            "tokenscope_connections_evicted",
            "Reusable client connections (headers not sent yet, or idle keep-alive) closed to admit a new one at the connection cap",
            m.evicted.clone(),
        );
        registry.register(
            "tokenscope_connections_rejected",
            "Client connections answered 503 at the connection cap (every connection had a request in flight)",
            m.rejected.clone(),
        );
        registry.register(
            "tokenscope_connections_write_timeouts",
            "Client connections closed because the client stopped reading for client_write_timeout_ms",
            m.write_timeouts.clone(),
        );
        registry.register(
            "tokenscope_connections_tls_handshake_failures",
            "Client connections closed because their TLS handshake failed or timed out ([listen_tls])",
            m.tls_failures.clone(),
        );
        registry.register(
            "tokenscope_connections_open",
            "Open client connections, per listener",
            m.open.clone(),
        );
        m
    }

    /// The counters of one listener.
    pub(crate) fn listener(&self, name: &str) -> ConnCounters {
        let l: Labels = vec![("listener".to_owned(), name.to_owned())];
        ConnCounters {
            accepted: self.accepted.get_or_create(&l).clone(),
            evicted: self.evicted.get_or_create(&l).clone(),
            rejected: self.rejected.get_or_create(&l).clone(),
            write_timeouts: self.write_timeouts.get_or_create(&l).clone(),
            tls_failures: self.tls_failures.get_or_create(&l).clone(),
            open: self.open.get_or_create(&l).clone(),
        }
    }
}

struct Entry {
    state: Arc<ConnState>,
    evict: Arc<Notify>,
}

/// The open connections of one listener: the registry behind the cap, the tasks that serve
/// them and the tokens that end them.
pub(crate) struct Connections {
    epoch: Instant,
    entries: Mutex<HashMap<u64, Entry>>,
    /// Notified whenever a connection ends (a slot and a descriptor are free again).
    freed: Notify,
    next_id: AtomicU64,
    tasks: TaskTracker,
    /// Set when shutdown starts: connections finish their requests, then close.
    drain: CancellationToken,
    /// Set when the grace period is over: connections close now.
    cut: CancellationToken,
    /// Counters.
    pub counters: ConnCounters,
}

impl Connections {
    pub(crate) fn new(counters: ConnCounters) -> Arc<Self> {
        Arc::new(Self {
            epoch: Instant::now(),
            entries: Mutex::new(HashMap::new()),
            freed: Notify::new(),
            next_id: AtomicU64::new(0),
            tasks: TaskTracker::new(),
            drain: CancellationToken::new(),
            cut: CancellationToken::new(),
            counters,
        })
    }

    /// Open connections now.
    pub(crate) fn open(&self) -> usize {
        self.entries.lock().len()
    }

    /// Requests in flight over all connections now.
    pub(crate) fn in_flight(&self) -> usize {
        self.entries
            .lock()
            .values()
            .map(|e| e.state.active.load(Ordering::Relaxed))
            .sum()
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Asks the connection reusable for longest to close. `false` when none is reusable.
    fn evict_one(&self) -> bool {
        let entries = self.entries.lock();
        let victim = entries
            .values()
            .filter(|e| {
                e.state.active.load(Ordering::Acquire) == 0
                    && !e.state.evicting.load(Ordering::Relaxed)
            })
            .min_by_key(|e| e.state.reusable_since.load(Ordering::Relaxed));
        match victim {
            Some(e) => {
                e.state.evicting.store(true, Ordering::Relaxed);
                // notify_one stores a permit: the task sees it even if it is not waiting yet.
                e.evict.notify_one();
                true
            }
            None => false,
        }
    }

    /// Starts shutdown: no new connections (the accept loops watch `stop`), every open
    /// connection finishes the requests it has and closes.
    pub(crate) fn drain(&self) {
        self.drain.cancel();
    }

    /// Ends every connection now (after the grace period).
    pub(crate) fn cut(&self) {
        self.cut.cancel();
    }

    /// Resolves when every connection task has ended (after [`Connections::drain`] or
    /// [`Connections::cut`]).
    pub(crate) async fn wait(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Removes a connection's entry when its task ends, however it ends.
struct Registration {
    conns: Arc<Connections>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.conns.entries.lock().remove(&self.id);
        self.conns.counters.open.dec();
        self.conns.freed.notify_waiters();
    }
}

/// Counts a request as in flight on its connection until its response body is dropped.
struct ActiveGuard {
    state: Arc<ConnState>,
    conns: Arc<Connections>,
}

impl ActiveGuard {
    fn new(state: &Arc<ConnState>, conns: &Arc<Connections>) -> Self {
        state.active.fetch_add(1, Ordering::AcqRel);
        Self {
            state: state.clone(),
            conns: conns.clone(),
        }
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.state
            .reusable_since
            .store(self.conns.now_ns(), Ordering::Relaxed);
        self.state.active.fetch_sub(1, Ordering::AcqRel);
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted as in flight until it is dropped.
    struct Tracked {
        #[pin]
        inner: Body,
        guard: ActiveGuard,
    }
}

impl http_body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A client connection: TCP in the clear, or TLS over TCP (`[listen_tls]`).
type ClientIo =
    tokenscope_net::MaybeTls<tokenscope_net::tokio_rustls::server::TlsStream<TcpStream>>;

/// A client socket whose writes fail after `timeout` without progress.
struct StallIo {
    io: ClientIo,
    timeout: Option<Duration>,
    /// Armed when a write pends; cleared by any write that makes progress.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    state: Arc<ConnState>,
    conns: Arc<Connections>,
}

impl StallIo {
    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let Some(t) = self.timeout else {
            return Poll::Pending;
        };
        let sleep = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(t)));
        if sleep.as_mut().poll(cx).is_ready() {
            if !self.state.write_stalled.swap(true, Ordering::AcqRel) {
                self.conns.counters.write_timeouts.inc();
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading (write timeout)",
            )));
        }
        Poll::Pending
    }

    fn progress<T>(&mut self, r: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stall = None;
                ready
            }
        }
    }
}

use std::future::Future as _;

impl AsyncRead for StallIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for StallIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// `true` for accept errors that mean "out of file descriptors" (retry after freeing one).
fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(23 | 24)) // ENFILE, EMFILE
}

const REJECT_503: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 120\r\n\r\n{\"error\":{\"message\":\"too many open connections; retry shortly\",\"type\":\"tokenscope_error\",\"code\":\"too_many_connections\"}}";

/// Refused connections being answered at once (each holds a socket for at most a second).
const MAX_LINGERING_REJECTS: usize = 64;

/// Answers `503` and closes. Closing a socket with unread request bytes makes the kernel send
/// a reset, which can destroy the answer before the client reads it; so the answer is
/// written, our side shut down and the request read and discarded (≤ 64 KiB, ≤ 1 s) before
/// the close — for at most [`MAX_LINGERING_REJECTS`] connections at once (beyond that they
/// are just closed).
fn reject(tcp: TcpStream, lingering: &Arc<AtomicUsize>) {
    if lingering.fetch_add(1, Ordering::AcqRel) >= MAX_LINGERING_REJECTS {
        lingering.fetch_sub(1, Ordering::AcqRel);
        let _ = tcp.try_write(REJECT_503);
        return;
    }
    let lingering = lingering.clone();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tcp;
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let mut buf = [0u8; 4096];
            // Read the request head first (the client may wait for its write to complete).
            let _ = tokio::time::timeout(Duration::from_millis(200), tcp.read(&mut buf)).await;
            tcp.write_all(REJECT_503).await?;
            tcp.shutdown().await?;
            let mut drained = 0usize;
            while drained < 64 * 1024 {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => drained += n,
                }
            }
            Ok::<_, io::Error>(())
        })
        .await;
        lingering.fetch_sub(1, Ordering::AcqRel);
    });
}

/// Accepts connections on `listener` until `stop` turns true, serving each with `app` on a
/// task tracked by `conns` (see the module docs); with `tls`, every connection is a TLS
/// session first.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    conns: Arc<Connections>,
    tls: Option<Arc<tokenscope_net::rustls::ServerConfig>>,
) {
    let acceptor = tls.map(tokenscope_net::tokio_rustls::TlsAcceptor::from);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let mut fd_warned = false;
    let lingering = Arc::new(AtomicUsize::new(0));
    let max = limits.max_connections.max(1);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|v| *v) => break,
            r = listener.accept() => r,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_fd_exhaustion(&e) => {
                if !fd_warned {
                    tracing::warn!(error = %e, open = conns.open(), "Out of file descriptors: closing a reusable connection; raise the open-file limit or lower max_connections.");
                    fd_warned = true;
                }
                if conns.evict_one() {
                    conns.counters.evicted.inc();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                continue;
            }
        };
        conns.counters.accepted.inc();
        if conns.open() >= max {
            // At the cap: the connection reusable for longest makes room, and the loop waits
            // (briefly) until it has closed before taking another descriptor, so a flood of
            // connections never holds more than the cap plus this one. With none reusable the
            // new connection is answered 503.
            let freed = conns.freed.notified();
            tokio::pin!(freed);
            // Registered before the eviction: its close is not missed.
            freed.as_mut().enable();
            if !conns.evict_one() {
                conns.counters.rejected.inc();
                reject(tcp, &lingering);
                continue;
            }
            conns.counters.evicted.inc();
            tokio::select! {
                () = &mut freed => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        if limits.nodelay {
            // Streamed tokens are small writes: no Nagle delay behind the client's delayed ACK.
            let _ = tcp.set_nodelay(true);
        }
        let state = Arc::new(ConnState::default());
        state
            .reusable_since
            .store(conns.now_ns(), Ordering::Relaxed);
        let evict = Arc::new(Notify::new());
        let id = conns.next_id.fetch_add(1, Ordering::Relaxed);
        conns.entries.lock().insert(
            id,
            Entry {
                state: state.clone(),
                evict: evict.clone(),
            },
        );
        conns.counters.open.inc();
        let reg = Registration {
            conns: conns.clone(),
            id,
        };
        let (app, builder, drain, cut) = (
            app.clone(),
            builder.clone(),
            conns.drain.clone(),
            conns.cut.clone(),
        );
        let c2 = conns.clone();
        let acceptor = acceptor.clone();
        let (write_timeout, header_timeout) = (limits.write_timeout, limits.header_timeout);
        conns.tasks.spawn(async move {
            let _reg = reg;
            let stream = match acceptor {
                None => ClientIo::Plain(tcp),
                Some(acceptor) => {
                    // Within the header timeout; evictable and cut like a connection that is
                    // still sending its headers.
                    let handshake = tokio::time::timeout(header_timeout, acceptor.accept(tcp));
                    let done = tokio::select! {
                        r = handshake => r,
                        () = evict.notified() => return,
                        () = cut.cancelled() => return,
                        () = drain.cancelled() => return,
                    };
                    match done {
                        Ok(Ok(s)) => ClientIo::Tls(Box::new(s)),
                        Ok(Err(e)) => {
                            c2.counters.tls_failures.inc();
                            tracing::debug!(error = %e, "TLS handshake with a client failed");
                            return;
                        }
                        Err(_) => {
                            c2.counters.tls_failures.inc();
                            tracing::debug!("TLS handshake with a client timed out");
                            return;
                        }
                    }
                }
            };
            let io = TokioIo::new(StallIo {
                io: stream,
                timeout: write_timeout,
                stall: None,
                state: state.clone(),
                conns: c2.clone(),
            });
            let svc = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
                let guard = ActiveGuard::new(&state, &c2);
                req.extensions_mut().insert(state.clone());
                let fut = tower::ServiceExt::oneshot(app.clone(), req.map(Body::new));
                async move {
                    let resp = fut.await?;
                    Ok::<_, std::convert::Infallible>(
                        resp.map(|inner| Body::new(Tracked { inner, guard })),
                    )
                }
            });
            let conn = builder.serve_connection_with_upgrades(io, svc);
            tokio::pin!(conn);
            let mut draining = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    () = evict.notified() => break,
                    () = cut.cancelled() => break,
                    () = drain.cancelled(), if !draining => {
                        conn.as_mut().graceful_shutdown();
                        draining = true;
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(max: usize) -> (std::net::SocketAddr, Arc<Connections>, watch::Sender<bool>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let conns = Connections::new(ConnCounters::default());
        let (tx, rx) = watch::channel(false);
        let app = Router::new().route("/", get(|| async { "ok" }));
        tokio::spawn(serve(
            l,
            app,
            ConnLimits {
                max_connections: max,
                header_timeout: Duration::from_secs(30),
                write_timeout: Some(Duration::from_secs(30)),
                max_header_bytes: 16 * 1024,
                nodelay: true,
            },
            rx,
            conns.clone(),
            None,
        ));
        (addr, conns, tx)
    }

    /// `[listen_tls]`: HTTP/1.1 and HTTP/2 over TLS (ALPN); a client that does not trust the
    /// certificate, and one speaking plain HTTP, are closed at the handshake and counted.
    #[tokio::test]
    async fn tls_listener_serves_h1_and_h2_and_counts_failed_handshakes() {
        use http_body_util::BodyExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = tokenscope_net::test_util::TestPki::generate(dir.path()).expect("pki");
        let tls = tokenscope_net::server_config(
            &pki.server_cert,
            &pki.server_key,
            None,
            &[b"h2", b"http/1.1"],
        )
        .expect("server config");
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let counters = ConnCounters::default();
        let conns = Connections::new(counters.clone());
        let (_tx, rx) = watch::channel(false);
        let app = Router::new().route("/", get(|| async { "ok" }));
        let limits = ConnLimits {
            max_connections: 16,
            header_timeout: Duration::from_secs(5),
            write_timeout: Some(Duration::from_secs(5)),
            max_header_bytes: 16 * 1024,
            nodelay: true,
        };
        tokio::spawn(serve(l, app, limits, rx, conns, Some(tls)));
        let trusted = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
            ca_file: Some(pki.ca.clone()),
            ..Default::default()
        })
        .expect("client tls");
        let url: http::Uri = format!("https://localhost:{port}/").parse().expect("uri");
        for (versions, want) in [
            (tokenscope_net::Versions::Http1, http::Version::HTTP_11),
            (tokenscope_net::Versions::Any, http::Version::HTTP_2),
        ] {
            let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
                hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(
                    tokenscope_net::connector(
                        &trusted,
                        tokenscope_net::ConnectOptions {
                            versions,
                            ..Default::default()
                        },
                    ),
                );
            let resp = client.get(url.clone()).await.expect("https");
            assert_eq!(resp.version(), want);
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(&body[..], b"ok");
        }
        assert_eq!(counters.tls_failures.get(), 0);
        // Plain HTTP to the TLS port, then a client without the CA.
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf).await;
        let untrusted: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(
                tokenscope_net::connector(
                    &tokenscope_net::ClientTls::system(),
                    tokenscope_net::ConnectOptions::default(),
                ),
            );
        assert!(untrusted.get(url).await.is_err());
        let deadline = Instant::now() + Duration::from_secs(5);
        while counters.tls_failures.get() < 2 {
            assert!(Instant::now() < deadline, "{}", counters.tls_failures.get());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn get_ok(addr: std::net::SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn stalled_header_connections_are_evicted_for_a_real_request() {
        let (addr, conns, _tx) = start(8).await;
        let mut stalled = Vec::new();
        for _ in 0..8 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n")
                .await
                .expect("partial");
            stalled.push(s);
        }
        while conns.open() < 8 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let resp = get_ok(addr).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.ends_with("ok"), "{resp}");
        assert!(conns.counters.evicted.get() >= 1);
        assert!(conns.open() <= 8);
    }

    #[tokio::test]
    async fn full_of_active_requests_answers_503() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let conns = Connections::new(ConnCounters::default());
        let (_tx, rx) = watch::channel(false);
        let release = Arc::new(Notify::new());
        let r2 = release.clone();
        let app = Router::new().route(
            "/",
            get(move || {
                let r = r2.clone();
                async move {
                    r.notified().await;
                    "late"
                }
            }),
        );
        tokio::spawn(serve(
            l,
            app,
            ConnLimits {
                max_connections: 1,
                header_timeout: Duration::from_secs(30),
                write_timeout: None,
                max_header_bytes: 16 * 1024,
                nodelay: true,
            },
            rx,
            conns.clone(),
            None,
        ));
        let busy = tokio::spawn(get_ok(addr));
        while conns.in_flight() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let resp = get_ok(addr).await;
        assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
        assert!(resp.contains("too_many_connections"), "{resp}");
        release.notify_one();
        let first = busy.await.expect("join");
        assert!(first.ends_with("late"), "{first}");
    }

    #[tokio::test]
    async fn drain_then_cut_ends_every_connection() {
        let (addr, conns, tx) = start(16).await;
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n")
            .await
            .expect("partial");
        while conns.open() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = tx.send(true);
        conns.drain();
        conns.cut();
        tokio::time::timeout(Duration::from_secs(5), conns.wait())
            .await
            .expect("connections ended");
        assert_eq!(conns.open(), 0);
        let mut buf = [0u8; 16];
        // The server side is closed: EOF or reset.
        let n = idle.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0);
    }
}
