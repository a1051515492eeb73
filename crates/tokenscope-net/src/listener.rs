//! [`TlsListener`]: an axum [`Listener`] that accepts TLS connections.
//!
//! Invariants:
//! * Handshakes run on tasks of their own, [`HANDSHAKE_TIMEOUT`] at most each: a client that
//!   connects and sends nothing never delays the others.
//! * A failed handshake (wrong CA on the client's side, a client without the required
//!   certificate, plain HTTP sent to the TLS port) closes that connection and is logged at
//!   debug; the listener goes on.
//! * Accepted sockets get `TCP_NODELAY` (streamed tokens are small writes).

use axum::serve::Listener;
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// Longest time a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS listener for `axum::serve`. See the module docs.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accept_task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Accepts TCP connections on `tcp` and completes their handshake with `config`. Must be
    /// called inside a tokio runtime.
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (tx, rx) = mpsc::channel(64);
        let accept_task = tokio::spawn(async move {
            loop {
                let (sock, peer) = match tcp.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: wait a little, go on.
                        tracing::debug!(error = %e, "TLS listener: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(sock)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS listener: handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "TLS listener: handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            rx,
            local,
            accept_task,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task never ends on its own (it holds a sender); only an abort does,
            // and that drops the listener first.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
