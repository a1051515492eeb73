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
//! * At most `max_idle` idle connections per upstream, each for at most [`IDLE_TIMEOUT`].
//! * A request that a stale pooled connection refused before writing it is sent again on
//!   another connection (hyper hands the request back); a request that was written is never
//!   sent twice.
//! * The pool's lock is held for a `VecDeque` push or pop only, never across I/O.

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
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// How long an idle connection stays pooled.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

type Conn = Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpError {
    /// No connection could be opened (refused, unreachable, connect timeout).
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    /// The connection failed while sending the request or reading the response head.
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

impl UpError {
    /// `true` when no connection could be opened.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, UpError::Connect { .. })
    }
}

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    conn: Pin<Box<Conn>>,
    since: Instant,
}

/// The idle connections of one upstream. See the module docs.
pub(crate) struct UpPool {
    /// `host:port` to connect to.
    addr: String,
    /// `Host` header value.
    host: Option<HeaderValue>,
    connect_timeout: Duration,
    max_idle: usize,
    idle: Mutex<VecDeque<Idle>>,
}

/// One upstream connection held by a request.
pub(crate) struct UpConn {
    sender: SendRequest<Full<Bytes>>,
    /// `None` once the connection future completed (closed or failed).
    conn: Option<Pin<Box<Conn>>>,
    pool: Arc<UpPool>,
}

impl UpPool {
    /// A pool for the upstream at `base` (`http://host[:port][/prefix]`).
    pub(crate) fn new(base: &Uri, connect_timeout: Duration, max_idle: usize) -> Arc<Self> {
        let host = base.host().unwrap_or("127.0.0.1");
        let port = base.port_u16().unwrap_or(80);
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
            host: host_header,
            connect_timeout,
            max_idle,
            idle: Mutex::new(VecDeque::new()),
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
                while q
                    .front()
                    .is_some_and(|i| now.duration_since(i.since) > IDLE_TIMEOUT)
                {
                    q.pop_front();
                }
                q.pop_back()?
            };
            if idle.sender.is_closed() {
                continue;
            }
            // A closed connection's future is ready (EOF or error): look without waiting.
            let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
            if idle.conn.as_mut().poll(&mut cx).is_ready() || !idle.sender.is_ready() {
                continue;
            }
            return Some(UpConn {
                sender: idle.sender,
                conn: Some(idle.conn),
                pool: Arc::clone(self),
            });
        }
    }

    async fn connect(self: &Arc<Self>) -> Result<UpConn, UpError> {
        let err = |reason: String| UpError::Connect {
            addr: self.addr.clone(),
            reason,
        };
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
        {
            Err(_) => return Err(err(format!("timed out after {:?}", self.connect_timeout))),
            Ok(Err(e)) => return Err(err(e.to_string())),
            Ok(Ok(t)) => t,
        };
        // Streamed tokens are small writes: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        let (sender, conn) = Builder::new()
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(UpError::Http)?;
        Ok(UpConn {
            sender,
            conn: Some(Box::pin(conn)),
            pool: Arc::clone(self),
        })
    }

    fn put(&self, sender: SendRequest<Full<Bytes>>, conn: Pin<Box<Conn>>) {
        let mut q = self.idle.lock();
        if q.len() < self.max_idle {
            q.push_back(Idle {
                sender,
                conn,
                since: Instant::now(),
            });
        }
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
        res.map_err(|mut e| match e.take_message() {
            Some(r) => Refused::Again(Box::new(r)),
            None => Refused::Failed(e.into_error()),
        })
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
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        self.drive(&mut cx);
        let Some(conn) = self.conn.take() else {
            return;
        };
        let (mut sender, pool) = (self.sender, self.pool);
        if sender.is_ready() {
            pool.put(sender, conn);
            return;
        }
        let mut conn = Some(conn);
        tokio::spawn(async move {
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
                pool.put(sender, c);
            }
        });
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
                            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n{}\r\nok",
                            if close { "connection: close\r\n" } else { "" }
                        );
                        if s.write_all(resp.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn pool_for(addr: &str) -> Arc<UpPool> {
        UpPool::new(
            &format!("http://{addr}").parse().expect("uri"),
            Duration::from_secs(1),
            8,
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
}
