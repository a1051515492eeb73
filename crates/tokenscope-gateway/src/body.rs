//! [`MeteredBody`]: the upstream response body, forwarded to the client frame by frame while it
//! is measured.
//!
//! Invariants:
//! * Frames are forwarded as they arrive; nothing waits for the end of the response or for more
//!   data. What is already available when the body is polled (the upstream chunks decoded from
//!   one socket read) is forwarded as one frame, up to [`COALESCE_MAX`] bytes: one write to the
//!   client instead of one per SSE event. In pass-through mode the bytes are unchanged, so the
//!   client receives byte-for-byte what the engine sent (HTTP/1.1 chunk boundaries are per hop).
//! * The upstream connection ([`UpConn`]) is driven here, by the client connection's task: no
//!   other task is woken per chunk. It returns to its pool when the body ended cleanly and is
//!   closed otherwise (dropped with this body).
//! * In strip mode (the gateway added `include_usage`), frames are cut at SSE event boundaries and
//!   only the usage-only event the client did not ask for is removed; an incomplete event is held
//!   until its terminating blank line arrives (at most `max_sse_event_bytes`).
//! * Per frame the work is: stamp the instant, split events, parse each `data:` JSON. No lock is
//!   shared with other requests, no I/O besides forwarding, memory bounded by one event (SSE) or
//!   `max_response_parse_bytes` (non-streamed JSON, kept to read its `usage`).
//! * The record is finished at end of stream, on an upstream error, on the idle timeout, or —
//!   through [`RecordGuard`]'s `Drop` — when the client goes away.

use crate::recording::RecordGuard;
use crate::upconn::UpConn;
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokenscope_core::sse::EventSplitter;
use tokenscope_core::Outcome;
use tokio::time::Sleep;

/// Boxed error type returned to hyper (which then aborts the client connection).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Error surfaced to the client connection when the upstream misbehaves mid-response.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// No bytes from the upstream for longer than the idle timeout.
    #[error("upstream sent nothing for {0:?}")]
    IdleTimeout(Duration),
    /// The upstream connection failed mid-response.
    #[error("upstream response body failed: {0}")]
    Upstream(#[from] hyper::Error),
}

pub(crate) enum Mode {
    /// `text/event-stream`.
    Sse {
        splitter: EventSplitter,
        /// Remove the usage-only event (the client did not ask for usage).
        strip: bool,
        /// An event exceeded the size limit: stop parsing, forward blindly.
        blind: bool,
    },
    /// Anything else: forwarded unchanged, and kept (up to a cap) to read its usage at the end.
    Whole {
        buf: Vec<u8>,
        cap: usize,
        overflow: bool,
    },
}

/// Most bytes forwarded as one frame when several upstream chunks are available at once.
pub const COALESCE_MAX: usize = 64 * 1024;

/// The instrumented response body. See the module docs.
pub struct MeteredBody {
    inner: Incoming,
    /// The upstream connection the body comes from (`None` once released or closed).
    up: Option<UpConn>,
    /// A non-data frame or an error that followed data forwarded in the same poll.
    stashed: Option<Result<Frame<Bytes>, BoxError>>,
    mode: Mode,
    guard: RecordGuard,
    idle: Pin<Box<Sleep>>,
    idle_timeout: Duration,
    /// When the last frame arrived (the idle deadline is `last_data + idle_timeout`).
    last_data: Instant,
    done: bool,
}

impl MeteredBody {
    pub(crate) fn new(
        inner: Incoming,
        up: Option<UpConn>,
        mode: Mode,
        guard: RecordGuard,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            inner,
            up,
            stashed: None,
            mode,
            guard,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            idle_timeout,
            last_data: Instant::now(),
            done: false,
        }
    }

    /// Handles one data frame; returns the bytes to forward (possibly empty). The first
    /// output token, once seen, is told to the replica's blame board.
    fn on_data(&mut self, data: Bytes, now: Instant) -> Bytes {
        let out = self.on_data_inner(data, now);
        if matches!(self.mode, Mode::Sse { .. }) {
            self.guard.note_first_token();
        }
        out
    }

    fn on_data_inner(&mut self, data: Bytes, now: Instant) -> Bytes {
        let Some(f) = self.guard.facts() else {
            return data;
        };
        match &mut self.mode {
            Mode::Whole { buf, cap, overflow } => {
                if !*overflow {
                    if buf.len() + data.len() <= *cap {
                        buf.extend_from_slice(&data);
                    } else {
                        *overflow = true;
                        buf.clear();
                        buf.shrink_to_fit();
                    }
                }
                data
            }
            Mode::Sse { blind: true, .. } => data,
            Mode::Sse {
                splitter,
                strip,
                blind,
            } => {
                if !*strip {
                    let res = splitter.push_bytes(&data, |raw| {
                        f.absorb_event(&raw, now, false);
                    });
                    if res.is_err() {
                        *blind = true;
                    }
                    return data;
                }
                let mut out: Option<Bytes> = None;
                let mut joined: Option<BytesMut> = None;
                let res = splitter.push_bytes(&data, |raw| {
                    if f.absorb_event(&raw, now, true) {
                        return; // the usage-only event the client did not ask for
                    }
                    match (&mut out, &mut joined) {
                        (None, None) => out = Some(raw),
                        (Some(first), None) => {
                            let mut j = BytesMut::with_capacity(first.len() + raw.len());
                            j.extend_from_slice(first);
                            j.extend_from_slice(&raw);
                            joined = Some(j);
                            out = None;
                        }
                        (_, Some(j)) => j.extend_from_slice(&raw),
                    }
                });
                let mut forward = match (out, joined) {
                    (_, Some(j)) => j.freeze(),
                    (Some(o), None) => o,
                    (None, None) => Bytes::new(),
                };
                if res.is_err() {
                    // An oversized event: give up on event alignment and forward everything.
                    *blind = true;
                    if let Some(rest) = splitter.finish() {
                        let mut j = BytesMut::from(&forward[..]);
                        j.extend_from_slice(&rest);
                        forward = j.freeze();
                    }
                }
                forward
            }
        }
    }

    /// End of the upstream body: parse what is left and finish the record.
    fn on_end(&mut self, now: Instant) -> Bytes {
        let mut tail = Bytes::new();
        if let Some(f) = self.guard.facts() {
            match &mut self.mode {
                Mode::Sse {
                    splitter,
                    strip,
                    blind,
                } => {
                    if let Some(rest) = splitter.finish() {
                        let stripped = !*blind && f.absorb_event(&rest, now, *strip);
                        if *strip && !stripped {
                            tail = rest;
                        }
                    }
                }
                Mode::Whole { buf, overflow, .. } => {
                    if !*overflow && !buf.is_empty() {
                        f.absorb_body(buf, now);
                    }
                }
            }
        }
        self.guard.finish(now, None);
        tail
    }
}

/// Bytes gathered for one outgoing frame: the first chunk as is, more chunks copied together.
#[derive(Default)]
struct Gather {
    one: Option<Bytes>,
    many: Option<BytesMut>,
}

impl Gather {
    fn push(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        if let Some(m) = self.many.as_mut() {
            m.extend_from_slice(&b);
        } else if let Some(first) = self.one.take() {
            let mut m = BytesMut::with_capacity(first.len() + b.len());
            m.extend_from_slice(&first);
            m.extend_from_slice(&b);
            self.many = Some(m);
        } else {
            self.one = Some(b);
        }
    }
    fn len(&self) -> usize {
        self.many
            .as_ref()
            .map_or_else(|| self.one.as_ref().map_or(0, Bytes::len), BytesMut::len)
    }
    fn take(&mut self) -> Option<Bytes> {
        self.many
            .take()
            .map(BytesMut::freeze)
            .or_else(|| self.one.take())
    }
}

impl MeteredBody {
    /// The body ended cleanly: the upstream connection may serve another request.
    fn release_upstream(&mut self) {
        if let Some(up) = self.up.take() {
            up.release();
        }
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(s) = this.stashed.take() {
            return Poll::Ready(Some(s));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let mut out = Gather::default();
        let ready = |out: &mut Gather| out.take().map(|b| Poll::Ready(Some(Ok(Frame::data(b)))));
        loop {
            if let Some(up) = this.up.as_mut() {
                up.drive(cx);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    if let Some(p) = ready(&mut out) {
                        return p;
                    }
                    // The idle deadline moves with the data lazily: the timer is re-armed when
                    // it fires early, not reset per frame.
                    while this.idle.as_mut().poll(cx).is_ready() {
                        let deadline = this.last_data + this.idle_timeout;
                        if deadline > Instant::now() {
                            this.idle
                                .as_mut()
                                .reset(tokio::time::Instant::from_std(deadline));
                            continue;
                        }
                        this.done = true;
                        this.up = None;
                        this.guard.finish(
                            Instant::now(),
                            Some((Outcome::Timeout, "stream_idle_timeout")),
                        );
                        return Poll::Ready(Some(Err(Box::new(BodyError::IdleTimeout(
                            this.idle_timeout,
                        )))));
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let now = Instant::now();
                    this.last_data = now;
                    match frame.into_data() {
                        Ok(data) => {
                            out.push(this.on_data(data, now));
                            if this.inner.is_end_stream() {
                                // A body of known length: the server stops polling once all
                                // bytes are sent, so finish here rather than at `None`.
                                this.done = true;
                                out.push(this.on_end(now));
                                this.release_upstream();
                                return ready(&mut out).unwrap_or(Poll::Ready(None));
                            }
                            if out.len() >= COALESCE_MAX {
                                if let Some(p) = ready(&mut out) {
                                    return p;
                                }
                            }
                        }
                        Err(frame) => {
                            // Trailers: after the data gathered so far.
                            return match ready(&mut out) {
                                Some(p) => {
                                    this.stashed = Some(Ok(frame));
                                    p
                                }
                                None => Poll::Ready(Some(Ok(frame))),
                            };
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    this.up = None;
                    this.guard.finish(
                        Instant::now(),
                        Some((Outcome::UpstreamError, "upstream_disconnected")),
                    );
                    let err: BoxError = Box::new(BodyError::Upstream(e));
                    return match ready(&mut out) {
                        Some(p) => {
                            this.stashed = Some(Err(err));
                            p
                        }
                        None => Poll::Ready(Some(Err(err))),
                    };
                }
                Poll::Ready(None) => {
                    this.done = true;
                    out.push(this.on_end(Instant::now()));
                    this.release_upstream();
                    return ready(&mut out).unwrap_or(Poll::Ready(None));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.stashed.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.mode {
            Mode::Sse { strip: true, .. } => SizeHint::default(),
            _ => self.inner.size_hint(),
        }
    }
}

use std::future::Future as _;
