//! The replicas of one upstream (`urls = [...]`; a single `url` is one replica): which one a
//! request goes to, their passive health, and the retry of a request that never reached one.
//!
//! Choice ([`Replicas::choose`]): the healthy replica with the fewest outstanding requests
//! (sent, response not ended: a stream counts until its end), ties broken round-robin; a
//! replica whose ejection is over gets the next request as its probe, before any healthy one;
//! when every replica is ejected, the one whose ejection ends first is tried anyway — a
//! request is never refused only because all replicas are ejected.
//!
//! Passive health: a replica that refuses a connection, does not accept it within
//! `connect_timeout_ms`, or sends no response head within `upstream_timeout_ms`, is ejected
//! for `eject_ms`; when that is over, one request is let through as a probe (half-open): its
//! response head restores the replica, its failure ejects it again for twice as long (up to
//! `eject_max_ms`). A request that failed after it was written (connection reset, closed
//! mid-response) is no verdict on the replica.
//!
//! Retry ([`send`]): only a request whose connection could not be opened — its bytes never
//! left — is sent again, to the next replica chosen the same way, each replica at most once,
//! all within the one `upstream_timeout_ms`. A request that was written is never sent twice.
//!
//! Invariants:
//! * Lock-free: the choice reads atomics (outstanding counts, ejection deadlines, probe flags);
//!   nothing is held across I/O.
//! * An outstanding count is held by a [`Load`] guard, owned by the response body
//!   ([`Loaded`]) once the head came: it drops when the body ends, fails or is dropped.
//! * At most one probe per replica is in flight; a probe abandoned without a verdict (the
//!   client went away) frees the probe slot ([`Attempt`]'s `Drop`).
//! * Failures of requests sent before an ejection do not extend it: only the first failure of
//!   a healthy replica and the failure of a probe eject.

use crate::failure::Failure;
use crate::upconn::{UpConn, UpPool};
use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokenscope_engine_state::EngineStateHandle;
use tokenscope_telemetry::replicas::ReplicaMetrics;

/// How long ejections last.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EjectPolicy {
    /// The first ejection.
    pub eject: Duration,
    /// The longest one (each failed probe doubles the last).
    pub max: Duration,
}

impl EjectPolicy {
    /// The `n`-th ejection in a row (0-based): `eject · 2ⁿ`, at most `max`.
    fn duration(&self, n: u32) -> Duration {
        self.eject
            .saturating_mul(1u32 << n.min(20))
            .min(self.max.max(self.eject))
    }
}

/// One replica: its address, connections, load, health and engine state.
pub(crate) struct Replica {
    /// `host:port` (records, metrics, logs).
    pub name: String,
    /// Its base URL.
    pub base: Uri,
    /// Connections of requests to it.
    pub pool: Arc<UpPool>,
    /// Its engine's state, scraped from its metrics endpoint (lock-free reads).
    pub state: Option<EngineStateHandle>,
    /// Its requests in flight and the last ones finished, for each request's blame.
    pub board: Arc<crate::blame::Board>,
    /// The upstream's name (logs).
    upstream: String,
    policy: EjectPolicy,
    /// The origin of [`Self::ejected_until`].
    epoch: Instant,
    outstanding: AtomicUsize,
    /// 0 while healthy; else 1 + nanoseconds from `epoch` to the end of the ejection.
    ejected_until: AtomicU64,
    /// Ejections in a row (reset when a probe succeeds).
    ejections: AtomicU32,
    /// A probe request is in flight.
    probing: AtomicBool,
    metrics: ReplicaMetrics,
}

impl Replica {
    pub(crate) fn new(
        upstream: &str,
        name: String,
        base: Uri,
        pool: Arc<UpPool>,
        state: Option<EngineStateHandle>,
        policy: EjectPolicy,
        metrics: ReplicaMetrics,
    ) -> Self {
        Self {
            name,
            base,
            pool,
            state,
            board: Arc::default(),
            upstream: upstream.to_owned(),
            policy,
            epoch: Instant::now(),
            outstanding: AtomicUsize::new(0),
            ejected_until: AtomicU64::new(0),
            ejections: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            metrics,
        }
    }

    /// Requests sent to it whose response has not ended.
    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether it takes requests (not ejected, not awaiting its probe).
    pub(crate) fn is_healthy(&self) -> bool {
        self.ejected_until.load(Ordering::Acquire) == 0
    }

    fn stamp(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn claim_probe(&self) -> bool {
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// A request to it failed before it was written (or got no response head in time): eject
    /// it, unless it is ejected already and this was not its probe.
    fn eject(&self, now: Instant, probe: bool) {
        if !probe && !self.is_healthy() {
            return;
        }
        let n = self.ejections.fetch_add(1, Ordering::AcqRel);
        let for_ = self.policy.duration(n);
        let until = self.stamp(now + for_);
        if probe {
            self.ejected_until.store(until, Ordering::Release);
            self.probing.store(false, Ordering::Release);
        } else if self
            .ejected_until
            .compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Another request ejected it meanwhile: one ejection, not two.
            self.ejections.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        self.metrics.ejections.inc();
        self.metrics.healthy.set(0);
        tracing::warn!(
            upstream = %self.upstream,
            replica = %self.name,
            ejected_for_ms = for_.as_millis() as u64,
            in_a_row = n + 1,
            "upstream replica ejected (connection refused or timed out, or no response head in time); \
             probed again when the ejection is over"
        );
    }

    /// Its probe got a response head: back in service.
    fn restore(&self) {
        self.ejections.store(0, Ordering::Release);
        self.probing.store(false, Ordering::Release);
        self.ejected_until.store(0, Ordering::Release);
        self.metrics.healthy.set(1);
        tracing::info!(
            upstream = %self.upstream,
            replica = %self.name,
            "upstream replica answered its probe: back in service"
        );
    }
}

/// The replicas of one upstream.
pub(crate) struct Replicas {
    list: Vec<Arc<Replica>>,
    /// Where the next choice starts looking (round-robin among equals).
    next: AtomicUsize,
}

impl Replicas {
    /// `list` must not be empty (the configuration has at least one URL per upstream).
    pub(crate) fn new(list: Vec<Replica>) -> Self {
        Self {
            list: list.into_iter().map(Arc::new).collect(),
            next: AtomicUsize::new(0),
        }
    }

    /// Every replica, in configuration order.
    pub(crate) fn all(&self) -> &[Arc<Replica>] {
        &self.list
    }

    /// The first healthy replica (else the first): for what is fetched from one replica of
    /// each upstream.
    pub(crate) fn first_healthy(&self) -> Option<&Arc<Replica>> {
        self.list
            .iter()
            .find(|r| r.is_healthy())
            .or_else(|| self.list.first())
    }

    /// The replica for the next request (see the module docs), leaving out the indexes in
    /// `tried`; `None` when every replica was tried.
    pub(crate) fn choose(&self, tried: &[usize], now: Instant) -> Option<Attempt> {
        let n = self.list.len();
        let start = if n > 1 {
            self.next.fetch_add(1, Ordering::Relaxed) % n
        } else {
            0
        };
        let mut healthy: Option<(usize, usize)> = None;
        // (probe in flight, end of the ejection): replicas without a probe first.
        let mut ejected: Option<(usize, (bool, u64))> = None;
        for k in 0..n {
            let i = (start + k) % n;
            if tried.contains(&i) {
                continue;
            }
            let r = &self.list[i];
            let until = r.ejected_until.load(Ordering::Acquire);
            if until == 0 {
                let load = r.outstanding();
                if healthy.is_none_or(|(_, l)| load < l) {
                    healthy = Some((i, load));
                }
                continue;
            }
            if r.stamp(now) >= until && r.claim_probe() {
                return Some(Attempt::new(r, i, true));
            }
            let key = (r.probing.load(Ordering::Acquire), until);
            if ejected.is_none_or(|(_, k)| key < k) {
                ejected = Some((i, key));
            }
        }
        if let Some((i, _)) = healthy {
            return Some(Attempt::new(&self.list[i], i, false));
        }
        // Every replica left is ejected: the one back soonest (one without a probe in flight
        // first), as its probe when none is in flight.
        let (i, _) = ejected?;
        let r = &self.list[i];
        Some(Attempt::new(r, i, r.claim_probe()))
    }
}

/// One outstanding request on a replica; dropping it ends it.
pub(crate) struct Load(Arc<Replica>);

impl Load {
    fn new(r: &Arc<Replica>) -> Self {
        r.outstanding.fetch_add(1, Ordering::Relaxed);
        r.metrics.outstanding.inc();
        Self(Arc::clone(r))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.outstanding.dec();
    }
}

/// A request on its way to a replica, until its verdict: [`Attempt::succeeded`] (response
/// head), [`Attempt::failed`] (not written, or no head in time), or dropped (written and
/// failed, or abandoned: no verdict).
pub(crate) struct Attempt {
    replica: Arc<Replica>,
    index: usize,
    /// This request is the replica's probe.
    probe: bool,
    load: Option<Load>,
}

impl Attempt {
    fn new(r: &Arc<Replica>, index: usize, probe: bool) -> Self {
        Self {
            replica: Arc::clone(r),
            index,
            probe,
            load: Some(Load::new(r)),
        }
    }

    /// The replica.
    pub(crate) fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }

    /// The replica answered with a response head: a probe restores it. The load stays until
    /// the response ends.
    pub(crate) fn succeeded(mut self) -> Load {
        if std::mem::take(&mut self.probe) {
            self.replica.restore();
        }
        match self.load.take() {
            Some(l) => l,
            None => Load::new(&self.replica),
        }
    }

    /// The request never reached the replica, or its head did not come in time: eject it.
    pub(crate) fn failed(mut self, now: Instant) {
        let probe = std::mem::take(&mut self.probe);
        self.replica.eject(now, probe);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if self.probe {
            // Abandoned without a verdict: the next request probes instead.
            self.replica.probing.store(false, Ordering::Release);
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds its replica's [`Load`] until it ends, fails or is dropped.
    pub(crate) struct Loaded<B> {
        #[pin]
        body: B,
        load: Option<Load>,
    }
}

impl<B> Loaded<B> {
    pub(crate) fn new(body: B, load: Load) -> Self {
        Self {
            body,
            load: Some(load),
        }
    }
}

impl<B: http_body::Body> http_body::Body for Loaded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let r = this.body.poll_frame(cx);
        if matches!(r, Poll::Ready(None | Some(Err(_)))) {
            *this.load = None;
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

/// A request a replica answered with a response head.
pub(crate) struct Sent {
    pub resp: Response<Incoming>,
    pub conn: UpConn,
    /// Held until the response ends ([`Loaded`]).
    pub load: Load,
}

/// Sends a request to a replica of `upstream` (named `name` in errors) chosen by
/// [`Replicas::choose`]: `build` makes the request for a replica, `chosen` is told each
/// replica tried, in order (the last one is the one that answered or failed). A connection
/// that could not be opened sends it to the next replica (module docs); the whole exchange
/// up to the response head has `timeout`.
pub(crate) async fn send(
    name: &str,
    replicas: &Replicas,
    timeout: Duration,
    mut build: impl FnMut(&Replica) -> Result<Request<Full<Bytes>>, Failure>,
    mut chosen: impl FnMut(&Replica),
) -> Result<Sent, Failure> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut tried: Vec<usize> = Vec::new();
    let mut last: Option<crate::upconn::UpError> = None;
    while let Some(attempt) = replicas.choose(&tried, Instant::now()) {
        tried.push(attempt.index);
        let replica = Arc::clone(attempt.replica());
        chosen(&replica);
        let req = build(&replica)?;
        match tokio::time::timeout_at(deadline, crate::upconn::send(&replica.pool, req)).await {
            Err(_) => {
                attempt.failed(Instant::now());
                return Err(Failure::UpstreamTimeout);
            }
            Ok(Ok((resp, conn))) => {
                let load = attempt.succeeded();
                return Ok(Sent { resp, conn, load });
            }
            Ok(Err(e)) if e.is_connect() => {
                attempt.failed(Instant::now());
                last = Some(e);
            }
            // Written, then failed: never sent twice, no verdict on the replica.
            Ok(Err(e)) => {
                return Err(Failure::Upstream {
                    code: e.code(),
                    message: format!("upstream {name}: {e}"),
                })
            }
        }
    }
    Err(match last {
        Some(e) => Failure::Upstream {
            code: e.code(),
            message: format!("upstream {name}: {e}"),
        },
        None => Failure::NoUpstream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica named `name` at `base`, without engine state or metrics.
    fn test_replica(name: String, base: &Uri, policy: EjectPolicy) -> Replica {
        let pool = UpPool::new(
            base,
            Duration::from_secs(1),
            1,
            Duration::ZERO,
            &tokenscope_net::ClientTls::system(),
        );
        Replica::new(
            "pool",
            name,
            base.clone(),
            pool,
            None,
            policy,
            ReplicaMetrics::default(),
        )
    }

    fn pool(n: usize, eject_ms: u64, max_ms: u64) -> Replicas {
        let policy = EjectPolicy {
            eject: Duration::from_millis(eject_ms),
            max: Duration::from_millis(max_ms),
        };
        Replicas::new(
            (0..n)
                .map(|i| {
                    let base: Uri = format!("http://127.0.0.1:{}", 1000 + i)
                        .parse()
                        .expect("uri");
                    test_replica(format!("r{i}"), &base, policy)
                })
                .collect(),
        )
    }

    fn pick(p: &Replicas, now: Instant) -> Attempt {
        p.choose(&[], now).expect("a replica")
    }

    #[test]
    fn least_outstanding_with_round_robin_ties() {
        let p = pool(3, 1000, 8000);
        let now = Instant::now();
        // Equal loads: every replica in turn, not always the first.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let a = pick(&p, now);
            seen.insert(a.index);
            drop(a);
        }
        assert_eq!(seen.len(), 3, "ties go round");
        // Held loads steer the next choices to the least loaded.
        let a = pick(&p, now).succeeded();
        let b = pick(&p, now).succeeded();
        let (ia, ib) = (a.0.name.clone(), b.0.name.clone());
        assert_ne!(ia, ib);
        let c = pick(&p, now);
        let ic = c.replica().name.clone();
        assert!(ic != ia && ic != ib, "the idle one: {ic}");
        let c = c.succeeded();
        // 1/1/1 → another on any; then the one left with 1 gets the next.
        let d = pick(&p, now).succeeded();
        let e = pick(&p, now);
        assert_ne!(e.replica().name, d.0.name);
        assert_eq!(e.replica().outstanding(), 2, "counted already (dispatched)");
        drop(e);
        // Loads drop with their guards.
        drop((a, b, c, d));
        assert!(p.all().iter().all(|r| r.outstanding() == 0));
    }

    #[test]
    fn ejection_probe_and_restore() {
        let p = pool(2, 100, 400);
        let t0 = Instant::now();
        // r0 refuses: ejected; every request goes to r1 meanwhile.
        let a = p.choose(&[1], t0).expect("r0");
        assert_eq!(a.replica().name, "r0");
        a.failed(t0);
        assert!(!p.all()[0].is_healthy());
        for _ in 0..4 {
            assert_eq!(pick(&p, t0).replica().name, "r1");
        }
        // A late failure of a request sent before the ejection does not extend it.
        p.all()[0].eject(t0 + Duration::from_millis(50), false);
        assert_eq!(p.all()[0].ejections.load(Ordering::Relaxed), 1);
        // The ejection is over: the next request is r0's probe (before r1, whatever the
        // loads); only one probe at a time.
        let t1 = t0 + Duration::from_millis(100);
        let probe = pick(&p, t1);
        assert_eq!(probe.replica().name, "r0");
        assert!(probe.probe);
        assert_eq!(pick(&p, t1).replica().name, "r1", "probe in flight");
        // The probe fails: ejected for twice as long.
        probe.failed(t1);
        let t2 = t1 + Duration::from_millis(199);
        assert_eq!(pick(&p, t2).replica().name, "r1");
        let t3 = t1 + Duration::from_millis(200);
        let probe = pick(&p, t3);
        assert_eq!(probe.replica().name, "r0");
        // Abandoned without a verdict: the next request probes instead.
        drop(probe);
        let probe = pick(&p, t3);
        assert_eq!(probe.replica().name, "r0");
        // Its response head restores it.
        let load = probe.succeeded();
        assert!(p.all()[0].is_healthy());
        assert_eq!(p.all()[0].ejections.load(Ordering::Relaxed), 0);
        // Healthy again: least outstanding decides (r0 holds one).
        assert_eq!(pick(&p, t3).replica().name, "r1");
        drop(load);
    }

    #[test]
    fn ejections_double_up_to_the_cap() {
        let policy = EjectPolicy {
            eject: Duration::from_millis(100),
            max: Duration::from_millis(350),
        };
        let ms = |n| policy.duration(n).as_millis();
        assert_eq!(
            [ms(0), ms(1), ms(2), ms(3), ms(40)],
            [100, 200, 350, 350, 350]
        );
    }

    #[test]
    fn all_ejected_still_serves_the_one_back_soonest() {
        let p = pool(3, 1000, 8000);
        let t0 = Instant::now();
        for (i, at) in [(0, 30), (1, 10), (2, 20)] {
            let a = p.choose(&[0, 1, 2].map(|j| if j == i { 99 } else { j }), t0);
            let a = a.expect("replica");
            assert_eq!(a.index, i);
            a.failed(t0 + Duration::from_millis(at));
        }
        assert!(p.all().iter().all(|r| !r.is_healthy()));
        // None is due: the one whose ejection ends first (r1), as its probe.
        let a = pick(&p, t0 + Duration::from_millis(100));
        assert_eq!(a.replica().name, "r1");
        assert!(a.probe);
        // With that probe in flight, the next soonest is probed.
        let b = pick(&p, t0 + Duration::from_millis(100));
        assert_eq!(b.replica().name, "r2");
        // Tried ones are left out; nothing left: None.
        assert!(p.choose(&[0, 1, 2], t0).is_none());
        let _ = b.succeeded();
        assert!(p.all()[2].is_healthy());
        drop(a);
    }

    /// A replica that accepts and reads but never answers: the request times out (504),
    /// is not sent elsewhere, and the replica is ejected.
    #[tokio::test]
    async fn no_response_head_in_time_ejects_without_retry() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = silent.local_addr().expect("addr");
        let held = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let h = held.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = silent.accept().await {
                h.lock().push(s);
            }
        });
        let base: Uri = format!("http://{addr}").parse().expect("uri");
        let policy = EjectPolicy {
            eject: Duration::from_secs(10),
            max: Duration::from_secs(10),
        };
        // The same silent replica twice under two names: a retry would show as a second try.
        let p = Replicas::new(
            ["s0", "s1"]
                .iter()
                .map(|n| test_replica((*n).to_owned(), &base, policy))
                .collect(),
        );
        let mut tried = Vec::new();
        let got = send(
            "pool",
            &p,
            Duration::from_millis(300),
            |_| {
                Ok(Request::get("/")
                    .body(Full::new(Bytes::new()))
                    .expect("request"))
            },
            |r| tried.push(r.name.clone()),
        )
        .await;
        assert!(matches!(got, Err(Failure::UpstreamTimeout)));
        assert_eq!(tried.len(), 1, "{tried:?}");
        let r = p.all().iter().find(|r| r.name == tried[0]).expect("tried");
        assert!(!r.is_healthy());
        assert_eq!(r.outstanding(), 0);
    }

    #[tokio::test]
    async fn a_refused_connection_is_retried_on_the_next_replica() {
        // r0: nobody listens; r1: answers.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let dead_addr = dead.local_addr().expect("addr");
        drop(dead);
        let live = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let live_addr = live.local_addr().expect("addr");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = live.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                });
            }
        });
        let policy = EjectPolicy {
            eject: Duration::from_secs(10),
            max: Duration::from_secs(10),
        };
        let p = Replicas::new(
            [dead_addr, live_addr]
                .iter()
                .map(|a| {
                    let base: Uri = format!("http://{a}").parse().expect("uri");
                    test_replica(a.to_string(), &base, policy)
                })
                .collect(),
        );
        for _ in 0..4 {
            let mut order = Vec::new();
            let sent = send(
                "pool",
                &p,
                Duration::from_secs(10),
                |_| {
                    Ok(Request::get("/")
                        .body(Full::new(Bytes::new()))
                        .expect("request"))
                },
                |r| order.push(r.name.clone()),
            )
            .await
            .unwrap_or_else(|f| panic!("{f:?}"));
            assert_eq!(sent.resp.status(), 200);
            assert_eq!(order.last(), Some(&live_addr.to_string()));
            assert!(order.len() <= 2);
        }
        assert!(!p.all()[0].is_healthy());
        assert_eq!(p.all()[0].ejections.load(Ordering::Relaxed), 1);
        assert!(p.all()[1].is_healthy());
    }
}
