//! The hot-path / sink boundary: a bounded queue fed by the request path, drained by one
//! dedicated writer thread that writes batches into a [`RecordSink`].
//!
//! ```text
//!  request path ──Recorder::record()──▶ [ bounded channel, capacity N ] ──▶ writer thread ──▶ sink
//!    (try_send, never waits)               full → counted drop               batch + retry
//! ```
//!
//! Invariants:
//! * **The request path never waits.** [`Recorder::record`] is a `try_send` into a
//!   `std::sync::mpsc::sync_channel` plus a few atomic operations: no lock held across I/O, no
//!   `.await`, no blocking call. It is safe to call from async code.
//! * **Bounded.** At most [`PipelineConfig::capacity`] records wait in the queue, plus at most
//!   one batch ([`PipelineConfig::batch_size`]) held by the writer.
//! * **Every record is accounted for.** Each record passed to `record` ends up in exactly one of:
//!   *written* (the sink accepted its batch), *dropped* (queue full, or the pipeline already
//!   shut down — [`PipelineObserver::on_dropped`] + [`Recorder::dropped`]), or *lost* (its
//!   batch still failed after [`PipelineConfig::retry_attempts`] retries —
//!   [`PipelineObserver::on_write_error`] + [`Recorder::lost`]). The only exception is a
//!   shutdown whose deadline expires while the sink is stuck; [`ShutdownReport::timed_out`]
//!   then says so and [`ShutdownReport::abandoned`] counts what was still pending.
//! * Only the first drop is logged (`warn`); later ones are only counted, so a saturated
//!   pipeline cannot flood the logs.
//! * The sink (e.g. the SQLite connection) lives on the writer thread and nowhere else.
//! * The writer flushes when a batch reaches `batch_size` rows, or `flush_interval` after the
//!   first row of a partial batch arrived, whichever comes first, or on
//!   [`PipelineHandle::flush`]. A failed batch is retried with exponential backoff (50 ms,
//!   100 ms, 200 ms, …, capped at 2 s); a panic inside the sink is contained and treated as a
//!   failure.
//! * [`PipelineHandle::shutdown`] stops intake (later `record` calls count as
//!   [`DropReason::Closed`]), writes everything already queued, then joins the thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokenscope_core::RequestRecord;

use crate::{SqliteStore, StoreError};

/// Where batches of records end up. Implementations run on the writer thread only.
pub trait RecordSink: Send + 'static {
    /// Writes one batch. Must be idempotent per `request_id`: a batch may be retried after
    /// an error.
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError>;
    /// Short name for logs and errors.
    fn name(&self) -> &'static str;
}

impl RecordSink for SqliteStore {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        self.insert_batch(batch).map(|_| ())
    }

    fn name(&self) -> &'static str {
        "sqlite"
    }
}

/// Why a record was dropped before reaching the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The bounded queue was full (the sink is slower than the request rate).
    QueueFull,
    /// The pipeline was shutting down or already shut down.
    Closed,
}

impl DropReason {
    /// Stable lower-case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::Closed => "closed",
        }
    }
}

/// Hooks for metrics (implemented by the telemetry crate). Every method has a no-op default.
/// `on_enqueued` and `on_dropped` run on the request path: keep them to an atomic increment.
pub trait PipelineObserver: Send + Sync + 'static {
    /// A record was accepted into the queue.
    fn on_enqueued(&self) {}
    /// A record was dropped before reaching the writer.
    fn on_dropped(&self, _reason: DropReason) {}
    /// A batch of `rows` was written; `latency` is the successful `write_batch` call's duration.
    fn on_written(&self, _rows: usize, _latency: Duration) {}
    /// A batch of `rows` failed for good (after all retries): those rows are lost.
    fn on_write_error(&self, _rows: usize, _err: &StoreError) {}
}

/// A [`PipelineObserver`] that observes nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopObserver;

impl PipelineObserver for NoopObserver {}

/// Pipeline tuning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Queue capacity in records (default 65 536).
    pub capacity: usize,
    /// Rows per write (default 1024).
    pub batch_size: usize,
    /// Longest time a row waits in a partial batch (default 200 ms).
    pub flush_interval: Duration,
    /// Retries of a failed batch before its rows are counted as lost (default 3).
    pub retry_attempts: u32,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            capacity: 65_536,
            batch_size: 1024,
            flush_interval: Duration::from_millis(200),
            retry_attempts: 3,
        }
    }
}

const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

enum Msg {
    Record(Box<RequestRecord>),
    Flush(SyncSender<()>),
    Shutdown(Instant),
}

struct Shared {
    obs: Arc<dyn PipelineObserver>,
    /// Set when shutdown starts: `record` stops enqueueing.
    closing: AtomicBool,
    /// `record` calls between their `closing` check and the end of their `try_send`.
    in_flight: AtomicU64,
    enqueued: AtomicU64,
    dropped: AtomicU64,
    written: AtomicU64,
    lost: AtomicU64,
    warned_drop: AtomicBool,
}

impl Shared {
    fn drop_one(&self, reason: DropReason) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.obs.on_dropped(reason);
        if !self.warned_drop.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reason = reason.as_str(),
                "tokenscope record pipeline dropped a record (further drops are only counted)"
            );
        }
    }
}

/// The request path's handle: cheap to clone, never blocks.
#[derive(Clone)]
pub struct Recorder {
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("queued", &self.queued())
            .field("dropped", &self.dropped())
            .field("written", &self.written())
            .field("lost", &self.lost())
            .finish()
    }
}

impl Recorder {
    /// Hands a record to the writer. Never blocks, never awaits: when the queue is full or
    /// the pipeline is closed the record is dropped and counted.
    pub fn record(&self, rec: RequestRecord) {
        let s = &*self.shared;
        // SeqCst pairs with the writer's `closing` store + `in_flight` load at shutdown: a
        // record either sees `closing` (counted drop) or is waited for and drained.
        s.in_flight.fetch_add(1, Ordering::SeqCst);
        if s.closing.load(Ordering::SeqCst) {
            s.in_flight.fetch_sub(1, Ordering::SeqCst);
            s.drop_one(DropReason::Closed);
            return;
        }
        let res = self.tx.try_send(Msg::Record(Box::new(rec)));
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        match res {
            Ok(()) => {
                s.enqueued.fetch_add(1, Ordering::Relaxed);
                s.obs.on_enqueued();
            }
            Err(TrySendError::Full(_)) => s.drop_one(DropReason::QueueFull),
            Err(TrySendError::Disconnected(_)) => s.drop_one(DropReason::Closed),
        }
    }

    /// Records accepted into the queue so far (monotonic).
    pub fn queued(&self) -> u64 {
        self.shared.enqueued.load(Ordering::Relaxed)
    }

    /// Records dropped before the queue so far (monotonic).
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Records written by the sink so far (monotonic).
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::Relaxed)
    }

    /// Records whose batch failed after every retry (monotonic).
    pub fn lost(&self) -> u64 {
        self.shared.lost.load(Ordering::Relaxed)
    }

    /// Records accepted but neither written nor lost yet (queue + the writer's batch).
    pub fn pending(&self) -> u64 {
        let done = self.written() + self.lost();
        self.queued().saturating_sub(done)
    }
}

/// Owner's handle: flush and shut down the writer.
pub struct PipelineHandle {
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PipelineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineHandle")
            .field("running", &self.thread.is_some())
            .finish()
    }
}

/// What [`PipelineHandle::shutdown`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShutdownReport {
    /// Records accepted into the queue over the pipeline's life.
    pub enqueued: u64,
    /// Records written over the pipeline's life.
    pub written: u64,
    /// Records dropped before the queue over the pipeline's life.
    pub dropped: u64,
    /// Records lost to failed batches over the pipeline's life.
    pub lost: u64,
    /// Records still pending when the deadline expired (0 unless `timed_out`).
    pub abandoned: u64,
    /// The writer did not finish before the deadline (it was left running, detached).
    pub timed_out: bool,
    /// How long the shutdown took.
    pub elapsed: Duration,
}

impl PipelineHandle {
    /// Forces a flush of everything queued so far and waits until it is written (or lost).
    /// Blocking: for tests and the admin API, never the request path.
    pub fn flush(&self) {
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        if self.send_control(Msg::Flush(ack_tx), None) {
            // Err only if the writer is gone; nothing left to wait for then.
            let _ = ack_rx.recv();
        }
    }

    /// Stops intake, writes everything queued, joins the writer thread. If the writer has not
    /// finished by `deadline` (a stuck sink), it is detached and the report says `timed_out`.
    pub fn shutdown(mut self, deadline: Duration) -> ShutdownReport {
        let start = Instant::now();
        let until = start + deadline;
        self.shared.closing.store(true, Ordering::SeqCst);
        let sent = self.send_control(Msg::Shutdown(until), Some(until));
        let mut timed_out = !sent;
        if let Some(thread) = self.thread.take() {
            if sent {
                while !thread.is_finished() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            if thread.is_finished() {
                if thread.join().is_err() {
                    tracing::error!("tokenscope record writer thread panicked");
                }
                timed_out = false;
            } else {
                timed_out = true;
                tracing::error!(
                    ?deadline,
                    "tokenscope record writer did not finish before the shutdown deadline"
                );
            }
        }
        let s = &self.shared;
        let (enqueued, written, lost) = (
            s.enqueued.load(Ordering::SeqCst),
            s.written.load(Ordering::SeqCst),
            s.lost.load(Ordering::SeqCst),
        );
        ShutdownReport {
            enqueued,
            written,
            dropped: s.dropped.load(Ordering::SeqCst),
            lost,
            abandoned: if timed_out {
                enqueued.saturating_sub(written + lost)
            } else {
                0
            },
            timed_out,
            elapsed: start.elapsed(),
        }
    }

    /// Puts a control message in the (possibly full) queue, waiting for room until `until`.
    /// `false` when the writer is gone or the deadline passed.
    fn send_control(&self, mut msg: Msg, until: Option<Instant>) -> bool {
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => return true,
                Err(TrySendError::Disconnected(_)) => return false,
                Err(TrySendError::Full(m)) => {
                    if until.is_some_and(|u| Instant::now() >= u) {
                        return false;
                    }
                    msg = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

impl Drop for PipelineHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            // Dropped without shutdown(): stop intake and let the writer drain on its own,
            // detached (never block a drop).
            self.shared.closing.store(true, Ordering::SeqCst);
            let _ = self
                .tx
                .try_send(Msg::Shutdown(Instant::now() + Duration::from_secs(5)));
        }
    }
}

/// Starts the writer thread and returns the request path's [`Recorder`] and the owner's
/// [`PipelineHandle`]. `capacity` and `batch_size` of 0 are treated as 1.
pub fn spawn_pipeline(
    sink: Box<dyn RecordSink>,
    cfg: PipelineConfig,
    obs: Arc<dyn PipelineObserver>,
) -> (Recorder, PipelineHandle) {
    let (tx, rx) = mpsc::sync_channel(cfg.capacity.max(1));
    let shared = Arc::new(Shared {
        obs,
        closing: AtomicBool::new(false),
        in_flight: AtomicU64::new(0),
        enqueued: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
        written: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        warned_drop: AtomicBool::new(false),
    });
    let mut writer = Writer {
        rx,
        sink,
        batch: Vec::with_capacity(cfg.batch_size.max(1)),
        cfg: PipelineConfig {
            batch_size: cfg.batch_size.max(1),
            ..cfg
        },
        shared: Arc::clone(&shared),
        deadline: None,
    };
    let thread = std::thread::Builder::new()
        .name("tokenscope-writer".to_owned())
        .spawn(move || writer.run());
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            // The receiver was moved into the failed closure and dropped: every record will
            // count as a `Closed` drop.
            tracing::error!(error = %e, "could not start the tokenscope record writer thread");
            None
        }
    };
    (
        Recorder {
            tx: tx.clone(),
            shared: Arc::clone(&shared),
        },
        PipelineHandle { tx, shared, thread },
    )
}

struct Writer {
    rx: Receiver<Msg>,
    sink: Box<dyn RecordSink>,
    batch: Vec<RequestRecord>,
    cfg: PipelineConfig,
    shared: Arc<Shared>,
    /// Shutdown deadline, once shutdown began: no more backoff sleeps past it.
    deadline: Option<Instant>,
}

impl Writer {
    fn run(&mut self) {
        let mut flush_at: Option<Instant> = None;
        loop {
            let msg = match flush_at {
                None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => self
                    .rx
                    .recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match msg {
                Ok(Msg::Record(rec)) => {
                    if self.batch.is_empty() {
                        flush_at = Some(Instant::now() + self.cfg.flush_interval);
                    }
                    self.batch.push(*rec);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.write();
                        flush_at = None;
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    // FIFO: everything recorded before the flush request is already batched.
                    self.write();
                    flush_at = None;
                    let _ = ack.try_send(());
                }
                Ok(Msg::Shutdown(deadline)) => {
                    self.deadline = Some(deadline);
                    self.drain_for_shutdown();
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.write();
                    flush_at = None;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.write();
                    return;
                }
            }
        }
    }

    /// Shutdown: intake is closed; wait for `record` calls racing the close, then write
    /// everything still queued.
    fn drain_for_shutdown(&mut self) {
        let s = Arc::clone(&self.shared);
        s.closing.store(true, Ordering::SeqCst);
        while s.in_flight.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        loop {
            match self.rx.try_recv() {
                Ok(Msg::Record(rec)) => {
                    self.batch.push(*rec);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.write();
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    self.write();
                    let _ = ack.try_send(());
                }
                Ok(Msg::Shutdown(_)) => {}
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        self.write();
    }

    /// Writes the current batch with retries; on final failure counts its rows as lost.
    fn write(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let rows = self.batch.len();
        let name = self.sink.name();
        let mut attempt: u32 = 0;
        loop {
            let start = Instant::now();
            let res = catch_unwind(AssertUnwindSafe(|| self.sink.write_batch(&self.batch)))
                .unwrap_or(Err(StoreError::SinkPanicked(name)));
            match res {
                Ok(()) => {
                    let latency = start.elapsed();
                    self.shared.written.fetch_add(rows as u64, Ordering::SeqCst);
                    self.shared.obs.on_written(rows, latency);
                    tracing::trace!(sink = name, rows, ?latency, "batch written");
                    break;
                }
                Err(err) => {
                    let backoff = BACKOFF_BASE
                        .saturating_mul(1_u32 << attempt.min(16))
                        .min(BACKOFF_MAX);
                    let past_deadline =
                        self.deadline.is_some_and(|d| Instant::now() + backoff >= d);
                    if attempt >= self.cfg.retry_attempts || past_deadline {
                        self.shared.lost.fetch_add(rows as u64, Ordering::SeqCst);
                        self.shared.obs.on_write_error(rows, &err);
                        tracing::error!(
                            sink = name,
                            rows,
                            attempts = attempt + 1,
                            error = %err,
                            "tokenscope batch write failed for good; rows lost"
                        );
                        break;
                    }
                    tracing::warn!(
                        sink = name,
                        rows,
                        attempt = attempt + 1,
                        error = %err,
                        ?backoff,
                        "tokenscope batch write failed; retrying"
                    );
                    std::thread::sleep(backoff);
                    attempt += 1;
                }
            }
        }
        self.batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqlite::tests::sparse_record;
    use std::sync::{Condvar, Mutex};

    fn rec(i: usize) -> RequestRecord {
        sparse_record(&format!("r{i:06}"))
    }

    #[derive(Default)]
    struct CountingObserver {
        enqueued: AtomicU64,
        dropped_full: AtomicU64,
        dropped_closed: AtomicU64,
        written: AtomicU64,
        errors: AtomicU64,
    }

    impl PipelineObserver for CountingObserver {
        fn on_enqueued(&self) {
            self.enqueued.fetch_add(1, Ordering::SeqCst);
        }
        fn on_dropped(&self, reason: DropReason) {
            match reason {
                DropReason::QueueFull => self.dropped_full.fetch_add(1, Ordering::SeqCst),
                DropReason::Closed => self.dropped_closed.fetch_add(1, Ordering::SeqCst),
            };
        }
        fn on_written(&self, rows: usize, _latency: Duration) {
            self.written.fetch_add(rows as u64, Ordering::SeqCst);
        }
        fn on_write_error(&self, rows: usize, _err: &StoreError) {
            self.errors.fetch_add(rows as u64, Ordering::SeqCst);
        }
    }

    /// Collects every written id; can be blocked by the test.
    #[derive(Clone, Default)]
    struct MemSink {
        rows: Arc<Mutex<Vec<String>>>,
        batches: Arc<Mutex<Vec<usize>>>,
        gate: Arc<(Mutex<bool>, Condvar)>,
        /// Fail this many calls before succeeding.
        fail_first: Arc<AtomicU64>,
        calls: Arc<AtomicU64>,
    }

    impl MemSink {
        fn block(&self) {
            *self.gate.0.lock().expect("gate") = true;
        }
        fn unblock(&self) {
            *self.gate.0.lock().expect("gate") = false;
            self.gate.1.notify_all();
        }
        fn ids(&self) -> Vec<String> {
            self.rows.lock().expect("rows").clone()
        }
    }

    impl RecordSink for MemSink {
        fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            {
                let (lock, cv) = &*self.gate;
                let mut blocked = lock.lock().expect("gate");
                while *blocked {
                    blocked = cv.wait(blocked).expect("gate");
                }
            }
            if self
                .fail_first
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(StoreError::Sink {
                    sink: "mem",
                    message: "injected failure".to_owned(),
                });
            }
            self.batches.lock().expect("batches").push(batch.len());
            self.rows
                .lock()
                .expect("rows")
                .extend(batch.iter().map(|r| r.request_id.clone()));
            Ok(())
        }
        fn name(&self) -> &'static str {
            "mem"
        }
    }

    fn cfg(capacity: usize, batch_size: usize) -> PipelineConfig {
        PipelineConfig {
            capacity,
            batch_size,
            flush_interval: Duration::from_millis(20),
            retry_attempts: 3,
        }
    }

    #[test]
    fn defaults() {
        let c = PipelineConfig::default();
        assert_eq!(
            (c.capacity, c.batch_size, c.flush_interval, c.retry_attempts),
            (65_536, 1024, Duration::from_millis(200), 3)
        );
    }

    #[test]
    fn queue_full_drops_are_counted_and_never_block() {
        let sink = MemSink::default();
        sink.block();
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), cfg(8, 1), obs.clone());
        // The first record reaches the writer and blocks inside the sink.
        rec_tx.record(rec(0));
        let t0 = Instant::now();
        while sink.calls.load(Ordering::SeqCst) == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "writer never started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // 8 fit in the queue, the remaining 92 are dropped; none of these calls may block.
        let start = Instant::now();
        for i in 1..=100 {
            rec_tx.record(rec(i));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(rec_tx.queued(), 9);
        assert_eq!(rec_tx.dropped(), 92);
        assert_eq!(obs.dropped_full.load(Ordering::SeqCst), 92);
        assert_eq!(obs.enqueued.load(Ordering::SeqCst), 9);
        assert_eq!(rec_tx.pending(), 9);

        sink.unblock();
        let report = handle.shutdown(Duration::from_secs(10));
        assert!(!report.timed_out);
        assert_eq!(
            (report.enqueued, report.written, report.dropped, report.lost),
            (9, 9, 92, 0)
        );
        assert_eq!(sink.ids().len(), 9);
        assert_eq!(obs.written.load(Ordering::SeqCst), 9);
        // After shutdown, records are counted as `Closed` drops.
        rec_tx.record(rec(1000));
        assert_eq!(rec_tx.dropped(), 93);
        assert_eq!(obs.dropped_closed.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn shutdown_drains_everything_in_order() {
        let sink = MemSink::default();
        let mut c = cfg(100_000, 64);
        c.flush_interval = Duration::from_secs(3600); // only size, flush or shutdown write
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), c, Arc::new(NoopObserver));
        let producers: Vec<_> = (0..4)
            .map(|t| {
                let r = rec_tx.clone();
                std::thread::spawn(move || {
                    for i in 0..2_500 {
                        r.record(rec(t * 10_000 + i));
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().expect("producer");
        }
        let report = handle.shutdown(Duration::from_secs(30));
        assert_eq!(
            (
                report.enqueued,
                report.written,
                report.dropped,
                report.lost,
                report.timed_out
            ),
            (10_000, 10_000, 0, 0, false)
        );
        let mut ids = sink.ids();
        assert_eq!(ids.len(), 10_000);
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 10_000);
        assert!(sink
            .batches
            .lock()
            .expect("batches")
            .iter()
            .all(|&n| n <= 64));
        assert_eq!(rec_tx.pending(), 0);
    }

    #[test]
    fn flush_interval_and_explicit_flush() {
        let sink = MemSink::default();
        let mut c = cfg(1000, 1000);
        c.flush_interval = Duration::from_millis(30);
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), c, Arc::new(NoopObserver));
        rec_tx.record(rec(1));
        let t0 = Instant::now();
        while rec_tx.written() < 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "interval flush never happened"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut c = cfg(1000, 1000);
        c.flush_interval = Duration::from_secs(3600);
        let sink2 = MemSink::default();
        let (rec2, handle2) = spawn_pipeline(Box::new(sink2.clone()), c, Arc::new(NoopObserver));
        for i in 0..10 {
            rec2.record(rec(i));
        }
        handle2.flush();
        assert_eq!(sink2.ids().len(), 10);
        assert_eq!(rec2.written(), 10);
        handle2.shutdown(Duration::from_secs(5));
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn failing_sink_retries_then_counts_loss() {
        // Fails twice, then succeeds: nothing lost.
        let sink = MemSink::default();
        sink.fail_first.store(2, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), cfg(100, 10), obs.clone());
        for i in 0..5 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        assert_eq!(sink.calls.load(Ordering::SeqCst), 3);
        assert_eq!((rec_tx.written(), rec_tx.lost()), (5, 0));
        assert_eq!(obs.errors.load(Ordering::SeqCst), 0);
        handle.shutdown(Duration::from_secs(5));

        // Always fails: 1 attempt + 3 retries, then the rows are lost and counted.
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), cfg(100, 10), obs.clone());
        for i in 0..5 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        assert_eq!(sink.calls.load(Ordering::SeqCst), 4);
        assert_eq!((rec_tx.written(), rec_tx.lost()), (0, 5));
        assert_eq!(obs.errors.load(Ordering::SeqCst), 5);
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!((report.lost, report.written, report.abandoned), (5, 0, 0));
    }

    #[test]
    fn panicking_sink_is_contained() {
        struct Panicky;
        impl RecordSink for Panicky {
            fn write_batch(&mut self, _batch: &[RequestRecord]) -> Result<(), StoreError> {
                panic!("boom");
            }
            fn name(&self) -> &'static str {
                "panicky"
            }
        }
        let mut c = cfg(10, 10);
        c.retry_attempts = 0;
        let (rec_tx, handle) = spawn_pipeline(Box::new(Panicky), c, Arc::new(NoopObserver));
        rec_tx.record(rec(1));
        handle.flush();
        assert_eq!(rec_tx.lost(), 1);
        // The writer survived the panic.
        rec_tx.record(rec(2));
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!((report.lost, report.timed_out), (2, false));
    }

    #[test]
    fn stuck_sink_shutdown_times_out() {
        let sink = MemSink::default();
        sink.block();
        let (rec_tx, handle) =
            spawn_pipeline(Box::new(sink.clone()), cfg(10, 1), Arc::new(NoopObserver));
        rec_tx.record(rec(1));
        rec_tx.record(rec(2));
        let report = handle.shutdown(Duration::from_millis(100));
        assert!(report.timed_out);
        assert_eq!(report.abandoned, 2);
        sink.unblock();
    }

    #[test]
    fn sqlite_sink_end_to_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.db");
        let store = SqliteStore::open(&path).expect("open");
        let (rec_tx, handle) =
            spawn_pipeline(Box::new(store), cfg(10_000, 100), Arc::new(NoopObserver));
        for i in 0..1_000 {
            rec_tx.record(rec(i));
        }
        // Duplicates (a client retrying with the same x-request-id) do not double rows.
        for i in 0..10 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        let reader = SqliteStore::open_read_only(&path).expect("reader");
        assert_eq!(reader.count().expect("count"), 1_000);
        let report = handle.shutdown(Duration::from_secs(10));
        assert_eq!(report.written, 1_010);
        assert_eq!(reader.count().expect("count"), 1_000);
    }
}
