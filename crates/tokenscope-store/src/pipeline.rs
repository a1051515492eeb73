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
//!
//! ## Late engine data
//!
//! [`Recorder::update`] hands a [`PhaseUpdate`] (engine phases joined by trace id, from an
//! OTLP span that arrives after the record) to the writer through the **same** bounded queue,
//! with the same guarantees: never blocks, and a full or closed queue drops it through the
//! same accounting as a record ([`PipelineObserver::on_dropped`], [`Recorder::dropped`],
//! [`ShutdownReport::dropped`] count records and updates together). Accepted updates are
//! counted apart ([`Recorder::updates_queued`]) so that [`Recorder::pending`] stays a count
//! of records.
//! * Ordering: a flush writes the batch's records first, then applies its updates
//!   ([`RecordSink::apply_updates`]); so an update and its record in the same batch always
//!   meet. An update whose record is not stored yet is the sink's to keep (the SQLite sink
//!   parks it in a bounded, TTL-limited map and applies it when the row arrives; see
//!   [`crate::pending`]).
//! * The batch size bounds records + updates together; a failed `apply_updates` is retried
//!   like a batch (updates are idempotent), and on final failure its updates are counted
//!   as unmatched ([`UnmatchedReason::WriteFailed`]).
//! * Updates the sink gives up on (overflow, expiry, still parked at shutdown) are collected
//!   after every flush, every [`HOUSEKEEPING_INTERVAL`] and at shutdown through
//!   [`RecordSink::take_unmatched`], and reported via
//!   [`PipelineObserver::on_update_unmatched`] and [`Recorder::updates_unmatched`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokenscope_core::{PhaseUpdate, RequestRecord};

use crate::pending::{UnmatchedCounts, UnmatchedReason};
use crate::{SqliteStore, StoreError};

/// Where batches of records end up. Implementations run on the writer thread only.
pub trait RecordSink: Send + 'static {
    /// Writes one batch. Must be idempotent per `request_id`: a batch may be retried after
    /// an error.
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError>;
    /// Applies late engine values to already written records, joined by trace id (see
    /// [`PhaseUpdate`]). Called after the same flush's `write_batch`. Must be idempotent (it
    /// may be retried). An update whose record is not written yet should be kept and applied
    /// when it is; what the sink gives up on is reported by
    /// [`take_unmatched`](RecordSink::take_unmatched). The default ignores updates.
    fn apply_updates(&mut self, _updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Updates given up on since the last call (overflow, expiry; with `shutting_down`, every
    /// update still kept, which the sink then forgets). Default: none.
    fn take_unmatched(&mut self, _shutting_down: bool) -> UnmatchedCounts {
        UnmatchedCounts::default()
    }
    /// Short name for logs and errors.
    fn name(&self) -> &'static str;
}

impl RecordSink for SqliteStore {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        self.insert_batch(batch).map(|_| ())
    }

    fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        SqliteStore::apply_updates(self, updates).map(|_| ())
    }

    fn take_unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        SqliteStore::take_unmatched(self, shutting_down)
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
    /// A record or an update was dropped before reaching the writer.
    fn on_dropped(&self, _reason: DropReason) {}
    /// A batch of `rows` was written; `latency` is the successful `write_batch` call's duration.
    fn on_written(&self, _rows: usize, _latency: Duration) {}
    /// A batch of `rows` failed for good (after all retries): those rows are lost.
    fn on_write_error(&self, _rows: usize, _err: &StoreError) {}
    /// `updates` engine updates will never be applied, for `reason` (their record never
    /// arrived in time, the pending map overflowed, the store shut down, or the sink kept
    /// failing). Runs on the writer thread.
    fn on_update_unmatched(&self, _reason: UnmatchedReason, _updates: u64) {}
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

/// How often an idle writer asks the sink for updates it gave up on (expiry is lazy).
pub const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(5);

const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

enum Msg {
    Record(Box<RequestRecord>),
    Update(Box<PhaseUpdate>),
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
    updates_enqueued: AtomicU64,
    updates_unmatched: AtomicU64,
    warned_drop: AtomicBool,
}

impl Shared {
    fn drop_one(&self, reason: DropReason) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
        self.obs.on_dropped(reason);
        if !self.warned_drop.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                reason = reason.as_str(),
                "tokenscope record pipeline dropped a record or update (further drops are only \
                 counted)"
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
        if self.send(Msg::Record(Box::new(rec))) {
            self.shared.enqueued.fetch_add(1, Ordering::Relaxed);
            self.shared.obs.on_enqueued();
        }
    }

    /// Hands late engine values for an already recorded (or still in-flight) request to the
    /// writer, through the same bounded queue as records. Never blocks, never awaits: when
    /// the queue is full or the pipeline is closed the update is dropped and counted like a
    /// record ([`Recorder::dropped`], [`PipelineObserver::on_dropped`]).
    pub fn update(&self, update: PhaseUpdate) {
        if self.send(Msg::Update(Box::new(update))) {
            self.shared.updates_enqueued.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `try_send` with the shutdown handshake; `false` (and a counted drop) when not queued.
    fn send(&self, msg: Msg) -> bool {
        let s = &*self.shared;
        // SeqCst pairs with the writer's `closing` store + `in_flight` load at shutdown: a
        // message either sees `closing` (counted drop) or is waited for and drained.
        s.in_flight.fetch_add(1, Ordering::SeqCst);
        if s.closing.load(Ordering::SeqCst) {
            s.in_flight.fetch_sub(1, Ordering::SeqCst);
            s.drop_one(DropReason::Closed);
            return false;
        }
        let res = self.tx.try_send(msg);
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        match res {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                s.drop_one(DropReason::QueueFull);
                false
            }
            Err(TrySendError::Disconnected(_)) => {
                s.drop_one(DropReason::Closed);
                false
            }
        }
    }

    /// Engine updates accepted into the queue so far (monotonic).
    pub fn updates_queued(&self) -> u64 {
        self.shared.updates_enqueued.load(Ordering::Relaxed)
    }

    /// Engine updates that will never be applied (monotonic; see
    /// [`PipelineObserver::on_update_unmatched`]).
    pub fn updates_unmatched(&self) -> u64 {
        self.shared.updates_unmatched.load(Ordering::Relaxed)
    }

    /// Records accepted into the queue so far (monotonic).
    pub fn queued(&self) -> u64 {
        self.shared.enqueued.load(Ordering::Relaxed)
    }

    /// Records and updates dropped before the queue so far (monotonic).
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
    /// Records and updates dropped before the queue over the pipeline's life.
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
        updates_enqueued: AtomicU64::new(0),
        updates_unmatched: AtomicU64::new(0),
        warned_drop: AtomicBool::new(false),
    });
    let mut writer = Writer {
        rx,
        sink,
        batch: Vec::with_capacity(cfg.batch_size.max(1)),
        updates: Vec::new(),
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
    /// Updates of the current flush, applied after `batch`.
    updates: Vec<PhaseUpdate>,
    cfg: PipelineConfig,
    shared: Arc<Shared>,
    /// Shutdown deadline, once shutdown began: no more backoff sleeps past it.
    deadline: Option<Instant>,
}

impl Writer {
    fn run(&mut self) {
        let mut flush_at: Option<Instant> = None;
        let mut housekeeping_at = Instant::now() + HOUSEKEEPING_INTERVAL;
        loop {
            let wake = flush_at.map_or(housekeeping_at, |f| f.min(housekeeping_at));
            let msg = self
                .rx
                .recv_timeout(wake.saturating_duration_since(Instant::now()));
            match msg {
                Ok(Msg::Record(rec)) => {
                    if self.is_empty() {
                        flush_at = Some(Instant::now() + self.cfg.flush_interval);
                    }
                    self.batch.push(*rec);
                    if self.is_full() {
                        self.write();
                        flush_at = None;
                    }
                }
                Ok(Msg::Update(up)) => {
                    if self.is_empty() {
                        flush_at = Some(Instant::now() + self.cfg.flush_interval);
                    }
                    self.updates.push(*up);
                    if self.is_full() {
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
                    let now = Instant::now();
                    if flush_at.is_some_and(|f| now >= f) {
                        self.write();
                        flush_at = None;
                    }
                    if now >= housekeeping_at {
                        self.collect_unmatched(false);
                        housekeeping_at = now + HOUSEKEEPING_INTERVAL;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.write();
                    self.collect_unmatched(true);
                    return;
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.batch.is_empty() && self.updates.is_empty()
    }

    fn is_full(&self) -> bool {
        self.batch.len() + self.updates.len() >= self.cfg.batch_size
    }

    /// Shutdown: intake is closed; wait for `record` / `update` calls racing the close, then
    /// write everything still queued, then report the updates the sink still kept.
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
                    if self.is_full() {
                        self.write();
                    }
                }
                Ok(Msg::Update(up)) => {
                    self.updates.push(*up);
                    if self.is_full() {
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
        self.collect_unmatched(true);
    }

    /// Writes the current batch's records, then applies its updates, each with retries; on
    /// final failure counts the records as lost and the updates as unmatched.
    fn write(&mut self) {
        if !self.batch.is_empty() {
            let rows = self.batch.len();
            let batch = std::mem::take(&mut self.batch);
            let res = self.with_retries("batch write", rows, |sink| sink.write_batch(&batch));
            self.batch = batch;
            self.batch.clear();
            match res {
                Ok(latency) => {
                    self.shared.written.fetch_add(rows as u64, Ordering::SeqCst);
                    self.shared.obs.on_written(rows, latency);
                }
                Err(err) => {
                    self.shared.lost.fetch_add(rows as u64, Ordering::SeqCst);
                    self.shared.obs.on_write_error(rows, &err);
                }
            }
        }
        if !self.updates.is_empty() {
            let n = self.updates.len();
            let updates = std::mem::take(&mut self.updates);
            let res = self.with_retries("update", n, |sink| sink.apply_updates(&updates));
            self.updates = updates;
            self.updates.clear();
            if res.is_err() {
                self.unmatched(UnmatchedReason::WriteFailed, n as u64);
            }
        }
        self.collect_unmatched(false);
    }

    /// Runs `op` on the sink until it succeeds (returning its duration) or has failed
    /// `1 + retry_attempts` times, with exponential backoff; a panic counts as a failure.
    fn with_retries(
        &mut self,
        what: &'static str,
        items: usize,
        mut op: impl FnMut(&mut dyn RecordSink) -> Result<(), StoreError>,
    ) -> Result<Duration, StoreError> {
        let name = self.sink.name();
        let mut attempt: u32 = 0;
        loop {
            let start = Instant::now();
            let res = catch_unwind(AssertUnwindSafe(|| op(self.sink.as_mut())))
                .unwrap_or(Err(StoreError::SinkPanicked(name)));
            match res {
                Ok(()) => {
                    let latency = start.elapsed();
                    tracing::trace!(sink = name, what, items, ?latency, "sink call succeeded");
                    return Ok(latency);
                }
                Err(err) => {
                    let backoff = BACKOFF_BASE
                        .saturating_mul(1_u32 << attempt.min(16))
                        .min(BACKOFF_MAX);
                    let past_deadline =
                        self.deadline.is_some_and(|d| Instant::now() + backoff >= d);
                    if attempt >= self.cfg.retry_attempts || past_deadline {
                        tracing::error!(
                            sink = name,
                            what,
                            items,
                            attempts = attempt + 1,
                            error = %err,
                            "tokenscope sink call failed for good; items lost"
                        );
                        return Err(err);
                    }
                    tracing::warn!(
                        sink = name,
                        what,
                        items,
                        attempt = attempt + 1,
                        error = %err,
                        ?backoff,
                        "tokenscope sink call failed; retrying"
                    );
                    std::thread::sleep(backoff);
                    attempt += 1;
                }
            }
        }
    }

    /// Asks the sink for updates it gave up on and reports them.
    fn collect_unmatched(&mut self, shutting_down: bool) {
        let sink = &mut self.sink;
        let counts = catch_unwind(AssertUnwindSafe(|| sink.take_unmatched(shutting_down)))
            .unwrap_or_default();
        for (reason, n) in counts.nonzero() {
            self.unmatched(reason, n);
        }
    }

    fn unmatched(&self, reason: UnmatchedReason, n: u64) {
        self.shared.updates_unmatched.fetch_add(n, Ordering::SeqCst);
        self.shared.obs.on_update_unmatched(reason, n);
        tracing::debug!(
            reason = reason.as_str(),
            updates = n,
            "tokenscope engine updates left unapplied"
        );
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
        unmatched: Mutex<Vec<(UnmatchedReason, u64)>>,
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
        fn on_update_unmatched(&self, reason: UnmatchedReason, updates: u64) {
            self.unmatched
                .lock()
                .expect("unmatched")
                .push((reason, updates));
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
        /// `w<n>` per write_batch, `u<n>` per apply_updates, in call order.
        events: Arc<Mutex<Vec<String>>>,
        /// Fail this many apply_updates calls before succeeding.
        fail_updates: Arc<AtomicU64>,
        updates: Arc<Mutex<Vec<PhaseUpdate>>>,
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
                    class: crate::ErrorClass::Unavailable,
                    message: "injected failure".to_owned(),
                });
            }
            self.batches.lock().expect("batches").push(batch.len());
            self.events
                .lock()
                .expect("events")
                .push(format!("w{}", batch.len()));
            self.rows
                .lock()
                .expect("rows")
                .extend(batch.iter().map(|r| r.request_id.clone()));
            Ok(())
        }
        fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
            if self
                .fail_updates
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(StoreError::Sink {
                    sink: "mem",
                    class: crate::ErrorClass::Unavailable,
                    message: "injected update failure".to_owned(),
                });
            }
            self.events
                .lock()
                .expect("events")
                .push(format!("u{}", updates.len()));
            self.updates
                .lock()
                .expect("updates")
                .extend_from_slice(updates);
            Ok(())
        }
        fn name(&self) -> &'static str {
            "mem"
        }
    }

    fn up(i: usize) -> PhaseUpdate {
        PhaseUpdate {
            trace_id: format!("{i:032x}"),
            queue_duration_ms: Some(i as f64),
            ..PhaseUpdate::default()
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
    fn a_flush_writes_records_before_updates() {
        let sink = MemSink::default();
        let mut c = cfg(1000, 1000);
        c.flush_interval = Duration::from_secs(3600);
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), c, Arc::new(NoopObserver));
        // The update is queued before its record, yet applied after it.
        rec_tx.update(up(1));
        rec_tx.record(rec(1));
        rec_tx.update(up(2));
        rec_tx.record(rec(2));
        handle.flush();
        assert_eq!(*sink.events.lock().expect("events"), ["w2", "u2"]);
        assert_eq!(*sink.updates.lock().expect("updates"), [up(1), up(2)]);
        // Accounting: records and updates apart.
        assert_eq!((rec_tx.queued(), rec_tx.updates_queued()), (2, 2));
        assert_eq!((rec_tx.written(), rec_tx.pending()), (2, 0));
        // Updates alone flush too; a flush with no records makes no write_batch call.
        rec_tx.update(up(3));
        handle.flush();
        assert_eq!(*sink.events.lock().expect("events"), ["w2", "u2", "u1"]);
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn updates_count_towards_batch_size_and_flush_interval() {
        let sink = MemSink::default();
        let mut c = cfg(1000, 4);
        c.flush_interval = Duration::from_millis(20);
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), c, Arc::new(NoopObserver));
        for i in 0..4 {
            rec_tx.update(up(i));
        }
        rec_tx.update(up(4));
        let t0 = Instant::now();
        while sink.updates.lock().expect("updates").len() < 5 {
            assert!(t0.elapsed() < Duration::from_secs(5), "never flushed");
            std::thread::sleep(Duration::from_millis(2));
        }
        // One full batch of 4, then the interval flush of the 5th.
        assert_eq!(*sink.events.lock().expect("events"), ["u4", "u1"]);
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn update_drops_use_the_record_drop_accounting() {
        let sink = MemSink::default();
        sink.block();
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), cfg(4, 1), obs.clone());
        rec_tx.record(rec(0));
        let t0 = Instant::now();
        while sink.calls.load(Ordering::SeqCst) == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "writer never started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let start = Instant::now();
        for i in 0..10 {
            rec_tx.update(up(i));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!((rec_tx.updates_queued(), rec_tx.dropped()), (4, 6));
        assert_eq!(obs.dropped_full.load(Ordering::SeqCst), 6);
        // Not counted as queued records.
        assert_eq!(
            (rec_tx.queued(), obs.enqueued.load(Ordering::SeqCst)),
            (1, 1)
        );
        sink.unblock();
        let report = handle.shutdown(Duration::from_secs(10));
        assert_eq!((report.written, report.dropped), (1, 6));
        assert_eq!(sink.updates.lock().expect("updates").len(), 4);
        rec_tx.update(up(99));
        assert_eq!(obs.dropped_closed.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn failing_updates_retry_then_count_as_unmatched() {
        let sink = MemSink::default();
        sink.fail_updates.store(2, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(sink.clone()), cfg(100, 10), obs.clone());
        rec_tx.update(up(1));
        handle.flush();
        assert_eq!(sink.updates.lock().expect("updates").len(), 1);
        assert_eq!(rec_tx.updates_unmatched(), 0);

        sink.fail_updates.store(u64::MAX, Ordering::SeqCst);
        rec_tx.record(rec(1));
        rec_tx.update(up(2));
        rec_tx.update(up(3));
        handle.flush();
        // The records were written; the updates given up on after 1 + 3 attempts.
        assert_eq!((rec_tx.written(), rec_tx.lost()), (1, 0));
        assert_eq!(rec_tx.updates_unmatched(), 2);
        assert_eq!(
            *obs.unmatched.lock().expect("unmatched"),
            [(UnmatchedReason::WriteFailed, 2)]
        );
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn sqlite_sink_joins_late_and_early_updates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("u.db");
        let store = SqliteStore::open(&path).expect("open");
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(store), cfg(10_000, 100), obs.clone());
        let traced = |i: usize| {
            let mut r = rec(i);
            r.trace_id = format!("{i:032x}");
            r
        };
        // Early: the span arrives while the record is still in the gateway.
        rec_tx.update(up(1));
        handle.flush();
        rec_tx.record(traced(1));
        // Late: record first, span later, in a later batch.
        rec_tx.record(traced(2));
        handle.flush();
        rec_tx.update(up(2));
        // A span whose record never comes.
        rec_tx.update(up(3));
        handle.flush();
        let reader = SqliteStore::open_read_only(&path).expect("reader");
        for i in [1, 2] {
            let got = reader.get(&format!("r{i:06}")).expect("get").expect("row");
            assert_eq!(
                (got.queue_duration_ms, got.queue_source),
                (Some(i as f64), tokenscope_core::PhaseSource::Engine)
            );
        }
        assert_eq!(rec_tx.updates_unmatched(), 0);
        let report = handle.shutdown(Duration::from_secs(10));
        assert_eq!((report.written, report.dropped), (2, 0));
        // The span still parked at shutdown is reported.
        assert_eq!(rec_tx.updates_unmatched(), 1);
        assert_eq!(
            *obs.unmatched.lock().expect("unmatched"),
            [(UnmatchedReason::Shutdown, 1)]
        );
    }

    #[test]
    fn default_sink_methods_ignore_updates() {
        struct Plain;
        impl RecordSink for Plain {
            fn write_batch(&mut self, _batch: &[RequestRecord]) -> Result<(), StoreError> {
                Ok(())
            }
            fn name(&self) -> &'static str {
                "plain"
            }
        }
        let mut p = Plain;
        assert!(p.apply_updates(&[up(1)]).is_ok());
        assert_eq!(p.take_unmatched(true), UnmatchedCounts::default());
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline(Box::new(Plain), cfg(10, 10), obs.clone());
        rec_tx.update(up(1));
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!((report.dropped, rec_tx.updates_unmatched()), (0, 0));
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
