//! The hot-path / sink boundary: a bounded queue fed by the request path, a batcher thread
//! that cuts it into batches, and a sender thread that writes them into a [`RecordSink`] —
//! or, when the store is slow, failing or down, spills them to an on-disk [`Spool`] and
//! replays them, oldest first, when it recovers.
//!
//! ```text
//!  request path ──Recorder::record()──▶ [ bounded channel ] ──▶ batcher ──▶ [ handoff, K batches ] ──▶ sender ──▶ sink
//!    (try_send, never waits)              full → counted drop      │ size / interval / flush        ▲   │ failure
//!                                                                  └── handoff full, store failing ──▶ spool ◀┘
//!                                                                        or spool not empty        (replayed)
//! ```
//!
//! Invariants:
//! * **The request path never waits.** [`Recorder::record`] is a `try_send` into a bounded
//!   queue (std's linked-block `mpsc` channel plus a depth counter) plus a few atomic operations: no lock held across I/O, no
//!   `.await`, no blocking call. It is safe to call from async code. Neither the batcher nor
//!   the sender is ever waited on by it: the spool's lock is shared by those two threads only.
//! * **Bounded memory.** At most [`PipelineConfig::capacity`] records wait in the queue (its
//!   memory follows what is queued: nothing is allocated for empty slots), one
//!   batch is being cut, [`PipelineConfig::handoff_batches`] batches wait for the sender and
//!   one is being written. Everything beyond goes to disk (with a spool) or waits in the queue
//!   (without one, where a full queue drops).
//! * **Durable delivery (with a spool).** A batch goes straight to the sink only while the
//!   store is healthy and the spool is empty; otherwise (handoff full because the store is
//!   slow, a failed write, a non-empty spool) it is appended to the spool. The sender replays
//!   the spool oldest-first with exponential backoff ([`PipelineConfig::retry_backoff_max`]),
//!   acknowledging each batch only after the sink accepted it; after a crash the next start
//!   replays what was not acknowledged (at-least-once: the sinks are idempotent per
//!   `request_id`, so a replayed batch never doubles rows). A batch that failed a direct write
//!   is spooled after the batches spooled meanwhile (order is only per-batch FIFO: rows are
//!   keyed, and an engine update that overtakes its row waits for it in the sink).
//! * **Every record is accounted for.** Each record passed to `record` ends up in exactly one
//!   of: *written* (the sink inserted it, possibly after a replay — [`Recorder::written`]
//!   counts rows the store really added), *duplicate* (the sink already held a row with its
//!   `request_id`: a replay of a batch it had taken — [`Recorder::duplicates`],
//!   [`PipelineObserver::on_duplicate`]), *dropped* (queue full or pipeline closed —
//!   [`PipelineObserver::on_dropped`], [`Recorder::dropped`]), *spooled* and still on disk
//!   (replayed later or on the next start), *held* in memory (below), or *lost*
//!   ([`PipelineObserver::on_lost`], [`Recorder::lost`]) for one of the [`LossReason`]s: the
//!   spool is full (its cap is hit), a batch could not be encoded or a spooled one decoded,
//!   there is no spool and the batch failed every retry, the store rejected the batch's data
//!   itself ([`ErrorClass::Rejected`]) on every attempt, the in-memory hold was full, or the
//!   shutdown deadline passed while a batch was held. With a spool and a store that
//!   eventually accepts the data, nothing is lost unless the spool cap or the hold bound is
//!   hit.
//! * **A failing disk holds, it does not lose.** A batch the spool cannot take because the
//!   disk refuses the write (full, I/O error) — after the store refused it too, or while the
//!   store is marked failing — is *held* in memory ([`SpoolState::held_rows`]), at most
//!   [`PipelineConfig::capacity`] rows (records + updates) in all; beyond that bound a batch
//!   is lost ([`LossReason::HoldFull`]). The sender retries held batches oldest first with
//!   exponential backoff (100 ms doubling up to [`PipelineConfig::retry_backoff_max`]): the
//!   sink first (when nothing spooled waits before them), then the spool. At shutdown it
//!   keeps retrying until shortly before the deadline; what is still held then is lost
//!   ([`LossReason::Shutdown`]). New batches are not sent straight to the sink while
//!   anything is held.
//! * Only the first drop is logged (`warn`); later ones are only counted, so a saturated
//!   pipeline cannot flood the logs. Store errors are logged when their class changes and
//!   then at most every 30 s while they persist; recovery is logged once.
//! * The sink lives on the sender thread and nowhere else.
//! * The batcher flushes when a batch reaches `batch_size` rows, or `flush_interval` after the
//!   first row of a partial batch arrived, whichever comes first, or on
//!   [`PipelineHandle::flush`] (which returns once everything recorded before it is written or
//!   safely spooled, after at most one replay attempt). A panic inside the sink is contained
//!   and treated as a failure.
//! * [`PipelineHandle::shutdown`] stops intake (later `record` calls count as
//!   [`DropReason::Closed`]), delivers everything queued, tries to drain the spool until the
//!   deadline, and leaves what the store did not take in the spool for the next start
//!   ([`ShutdownReport::spooled_batches`]).
//!
//! ## Late engine data
//!
//! [`Recorder::update`] hands a [`PhaseUpdate`] (engine phases joined by trace id, from an
//! OTLP span that arrives after the record) to the batcher through the **same** bounded queue,
//! with the same guarantees: never blocks, and a full or closed queue drops it through the
//! same accounting as a record ([`PipelineObserver::on_dropped`], [`Recorder::dropped`],
//! [`ShutdownReport::dropped`] count records and updates together). Accepted updates are
//! counted apart ([`Recorder::updates_queued`]) so that [`Recorder::pending`] stays a count
//! of records.
//! * A batch carries records and updates; writing it writes the records first, then applies
//!   the updates ([`RecordSink::apply_updates`]); so an update and its record in the same
//!   batch always meet, and a spooled batch keeps its updates. An update whose record is not
//!   stored yet is the sink's to keep (see [`crate::pending`]).
//! * The batch size bounds records + updates together. Updates of a lost batch are counted as
//!   unmatched ([`UnmatchedReason::WriteFailed`]).
//! * Updates the sink gives up on (overflow, expiry, still parked at shutdown) are collected
//!   after every write, every [`HOUSEKEEPING_INTERVAL`] and at shutdown through
//!   [`RecordSink::take_unmatched`], and reported via
//!   [`PipelineObserver::on_update_unmatched`] and [`Recorder::updates_unmatched`].

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokenscope_core::{PhaseUpdate, RequestRecord};

use crate::pending::{UnmatchedCounts, UnmatchedReason};
use crate::spool::{Append, Spool};
use crate::{ErrorClass, FileChange, SqliteStore, StoreError};

/// Where batches of records end up. Implementations run on the writer thread only.
pub trait RecordSink: Send + 'static {
    /// Writes one batch. Must be idempotent per `request_id`: a batch may be retried after
    /// an error.
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError>;
    /// Writes one batch like [`write_batch`](RecordSink::write_batch) and returns how many of
    /// its records the store did not hold yet (the others were already stored under their
    /// `request_id`: a batch replayed after a crash, or retried after an ambiguous failure).
    /// The pipeline counts those as written and the rest as duplicates. Default: every record
    /// counts as new (ClickHouse: keys are unique per request, and a re-sent row collapses
    /// with its first copy at merge time, so rows sent are rows stored).
    fn write_batch_counted(&mut self, batch: &[RequestRecord]) -> Result<usize, StoreError> {
        self.write_batch(batch).map(|()| batch.len())
    }
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
    /// Errors the sink ran into and recovered from by itself since the last call (e.g. a
    /// dropped table it recreated before writing the batch), so that they still show in the
    /// error metrics. Default: none.
    fn take_recovered(&mut self) -> Vec<StoreError> {
        Vec::new()
    }
    /// Times since the last call that the sink found its file unlinked or replaced under it
    /// and reopened (recreated) it. Default: none.
    fn take_reopened(&mut self) -> Vec<FileChange> {
        Vec::new()
    }
    /// Short name for logs and errors.
    fn name(&self) -> &'static str;
}

impl RecordSink for SqliteStore {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        self.insert_batch(batch).map(|_| ())
    }

    fn write_batch_counted(&mut self, batch: &[RequestRecord]) -> Result<usize, StoreError> {
        self.insert_batch(batch)
    }

    fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        SqliteStore::apply_updates(self, updates).map(|_| ())
    }

    fn take_reopened(&mut self) -> Vec<FileChange> {
        SqliteStore::take_reopened(self)
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

/// Why accepted records were lost (never written and not kept anywhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// The spool's size cap was hit: the batch could not be spilled.
    SpoolFull,
    /// Writing to (or reading from) the spool failed (disk error, undecodable entry).
    SpoolError,
    /// No spool is configured and the batch failed every retry.
    WriteFailed,
    /// The store rejected the batch's data itself ([`ErrorClass::Rejected`]) on every attempt.
    Rejected,
    /// Neither the store nor the spool took the batch (e.g. a full disk) and the in-memory
    /// hold was already at its bound ([`PipelineConfig::capacity`] rows).
    HoldFull,
    /// The batch was held in memory (store and spool failing) when the shutdown deadline
    /// passed.
    Shutdown,
}

impl LossReason {
    /// Every reason, in label order.
    pub const ALL: [LossReason; 6] = [
        LossReason::SpoolFull,
        LossReason::SpoolError,
        LossReason::WriteFailed,
        LossReason::Rejected,
        LossReason::HoldFull,
        LossReason::Shutdown,
    ];

    /// Stable lower-case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            LossReason::SpoolFull => "spool_full",
            LossReason::SpoolError => "spool_error",
            LossReason::WriteFailed => "write_failed",
            LossReason::Rejected => "rejected",
            LossReason::HoldFull => "hold_full",
            LossReason::Shutdown => "shutdown",
        }
    }
}

/// The spool's state, published by the sender after every change and every second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpoolState {
    /// Unacknowledged batches on disk.
    pub batches: u64,
    /// Their size on disk, bytes.
    pub bytes: u64,
    /// Age of the oldest unsent batch (zero when the spool is empty).
    pub oldest_age: Duration,
    /// The store accepted the last write (and the spool is empty, or draining).
    pub store_up: bool,
    /// Rows (records + updates) held in memory because neither the store nor the spool took
    /// their batch (a full or failing disk); retried with backoff.
    pub held_rows: u64,
}

/// Hooks for metrics (implemented by the telemetry crate). Every method has a no-op default.
/// `on_enqueued` and `on_dropped` run on the request path: keep them to an atomic increment.
/// The others run on the pipeline's threads.
pub trait PipelineObserver: Send + Sync + 'static {
    /// A record was accepted into the queue.
    fn on_enqueued(&self) {}
    /// A record or an update was dropped before reaching the writer.
    fn on_dropped(&self, _reason: DropReason) {}
    /// A batch of `rows` was written; `latency` is the successful `write_batch` call's
    /// duration; `replayed` when the batch came from the spool (its rows had already left
    /// memory when they were spooled).
    fn on_written(&self, _rows: usize, _latency: Duration, _replayed: bool) {}
    /// `rows` records of a written batch were already in the store under their `request_id`
    /// (a replay or retry of a batch it had taken) and were not inserted again; `replayed` as
    /// for [`on_written`](PipelineObserver::on_written).
    fn on_duplicate(&self, _rows: usize, _replayed: bool) {}
    /// The sink found its file unlinked or replaced under it and reopened (recreated) it.
    fn on_store_reopened(&self, _change: FileChange) {}
    /// `rows` records left memory for the spool.
    fn on_spooled(&self, _rows: usize) {}
    /// A store call failed (every attempt, including those retried later).
    fn on_store_error(&self, _class: ErrorClass, _err: &StoreError) {}
    /// A failed batch will be tried again (a retry or a spool replay attempt).
    fn on_retry(&self) {}
    /// `rows` accepted records were lost for `reason`; `in_memory` when they were still in
    /// memory (not spooled) at that point.
    fn on_lost(&self, _rows: usize, _reason: LossReason, _in_memory: bool) {}
    /// The spool changed (see [`SpoolState`]).
    fn on_spool_state(&self, _state: SpoolState) {}
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
    /// Rows (records + updates) per write (default 8192: large transactions are what makes
    /// the embedded store fast under load, see docs/benchmarks.md; at normal rates the flush
    /// interval cuts batches long before they fill).
    pub batch_size: usize,
    /// Longest time a row waits in a partial batch (default 200 ms).
    pub flush_interval: Duration,
    /// Without a spool: retries of a failed batch before its rows are counted as lost. With a
    /// spool: attempts of a batch the store *rejects* ([`ErrorClass::Rejected`]) before it is
    /// dropped (other failures are retried until the store recovers). Default 3.
    pub retry_attempts: u32,
    /// Batches waiting in memory for the sender before new ones spill to the spool (default 4).
    pub handoff_batches: usize,
    /// Longest pause between two replay attempts while the store fails (default 5 s; the
    /// backoff starts at 100 ms and doubles).
    pub retry_backoff_max: Duration,
    /// While batches go to the spool, how long a partial batch keeps filling before it is
    /// spilled (default 1 s; at least `flush_interval`). Larger spool entries replay faster
    /// (one store insert each); records still in memory are not yet crash-safe.
    pub spill_interval: Duration,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            capacity: 65_536,
            batch_size: 8192,
            flush_interval: Duration::from_millis(200),
            retry_attempts: 3,
            handoff_batches: 4,
            retry_backoff_max: Duration::from_secs(5),
            spill_interval: Duration::from_secs(1),
        }
    }
}

/// How often an idle writer asks the sink for updates it gave up on (expiry is lazy).
pub const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(5);

const BACKOFF_BASE: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// First pause between replay attempts of the spool.
const REPLAY_BACKOFF_BASE: Duration = Duration::from_millis(100);
/// How often the sender republishes the spool state (the oldest-age gauge moves).
const STATE_INTERVAL: Duration = Duration::from_secs(1);
/// Longest time one replay round runs before the sender looks at its handoff again.
const REPLAY_ROUND: Duration = Duration::from_millis(500);
/// Repeated identical store errors are logged at most this often.
const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(30);

/// Sending half of the bounded queue between the request path and the batcher.
///
/// `std::sync::mpsc::sync_channel(capacity)` allocates and writes every slot when it is
/// created (2 MiB resident for the default 65 536 slots, before the first request); this is
/// std's unbounded channel, which allocates blocks of slots as messages arrive and frees them
/// as they are received, bounded by a depth counter shared with [`QueueRx`].
#[derive(Clone)]
struct QueueTx {
    tx: mpsc::Sender<Msg>,
    depth: Arc<AtomicUsize>,
    cap: usize,
}

impl QueueTx {
    /// Never blocks: `Full` when `cap` messages are queued, `Disconnected` when the batcher is
    /// gone.
    fn try_send(&self, msg: Msg) -> Result<(), TrySendError<Msg>> {
        if self.depth.fetch_add(1, Ordering::AcqRel) >= self.cap {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            return Err(TrySendError::Full(msg));
        }
        self.tx.send(msg).map_err(|mpsc::SendError(m)| {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            TrySendError::Disconnected(m)
        })
    }
}

/// Receiving half of the bounded queue (see [`QueueTx`]).
struct QueueRx {
    rx: Receiver<Msg>,
    depth: Arc<AtomicUsize>,
}

impl QueueRx {
    fn took<E>(&self, r: Result<Msg, E>) -> Result<Msg, E> {
        if r.is_ok() {
            self.depth.fetch_sub(1, Ordering::AcqRel);
        }
        r
    }
    fn recv(&self) -> Result<Msg, mpsc::RecvError> {
        self.took(self.rx.recv())
    }
    fn recv_timeout(&self, d: Duration) -> Result<Msg, RecvTimeoutError> {
        self.took(self.rx.recv_timeout(d))
    }
    fn try_recv(&self) -> Result<Msg, TryRecvError> {
        self.took(self.rx.try_recv())
    }
}

/// The bounded queue: at most `cap` messages (`cap` ≥ 1).
fn queue(cap: usize) -> (QueueTx, QueueRx) {
    let (tx, rx) = mpsc::channel();
    let depth = Arc::new(AtomicUsize::new(0));
    (
        QueueTx {
            tx,
            depth: Arc::clone(&depth),
            cap,
        },
        QueueRx { rx, depth },
    )
}

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
    /// Records the sink already held (not inserted again).
    duplicates: AtomicU64,
    lost: AtomicU64,
    updates_enqueued: AtomicU64,
    updates_unmatched: AtomicU64,
    warned_drop: AtomicBool,
    /// Records spilled to the spool by this process.
    spooled: AtomicU64,
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
    tx: QueueTx,
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

    /// Asks the writer to flush everything queued before this call and waits at most
    /// `timeout` for it to be written, spooled or held ([`PipelineHandle::flush`]'s meaning).
    /// `false` when the queue is full or closed, or the time ran out. Blocking (never on the
    /// request path: the dashboard calls it from a blocking thread before it reads the store).
    pub fn flush_within(&self, timeout: Duration) -> bool {
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        if self.tx.try_send(Msg::Flush(ack_tx)).is_err() {
            return false;
        }
        ack_rx.recv_timeout(timeout).is_ok()
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

    /// Records the sink inserted so far (monotonic): rows really added to the store, not
    /// records it already held ([`Recorder::duplicates`]).
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::Relaxed)
    }

    /// Records delivered to the sink that it already held under their `request_id` (a spool
    /// replay of a batch it had taken), so not inserted again (monotonic).
    pub fn duplicates(&self) -> u64 {
        self.shared.duplicates.load(Ordering::Relaxed)
    }

    /// Records whose batch failed after every retry (monotonic).
    pub fn lost(&self) -> u64 {
        self.shared.lost.load(Ordering::Relaxed)
    }

    /// Records accepted but neither written nor lost yet (queue + the writer's batch).
    pub fn pending(&self) -> u64 {
        let done = self.written() + self.duplicates() + self.lost();
        self.queued().saturating_sub(done)
    }
}

/// Owner's handle: flush and shut down the pipeline.
pub struct PipelineHandle {
    tx: QueueTx,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    link: Arc<Link>,
}

impl std::fmt::Debug for PipelineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineHandle")
            .field("running", &!self.threads.is_empty())
            .finish()
    }
}

/// What [`PipelineHandle::shutdown`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShutdownReport {
    /// Records accepted into the queue over the pipeline's life.
    pub enqueued: u64,
    /// Records inserted over the pipeline's life (replayed ones from an earlier run included).
    pub written: u64,
    /// Records delivered that the store already held (not inserted again).
    pub duplicates: u64,
    /// Records and updates dropped before the queue over the pipeline's life.
    pub dropped: u64,
    /// Records lost over the pipeline's life (see [`LossReason`]).
    pub lost: u64,
    /// Records spilled to the spool over the pipeline's life.
    pub spooled: u64,
    /// Batches left in the spool for the next start (the store did not take them in time).
    pub spooled_batches: u64,
    /// Records still pending in memory when the deadline expired (0 unless `timed_out`).
    pub abandoned: u64,
    /// The pipeline did not finish before the deadline (its threads were left running,
    /// detached).
    pub timed_out: bool,
    /// How long the shutdown took.
    pub elapsed: Duration,
}

impl PipelineHandle {
    /// Forces a flush of everything queued so far and waits until it is written, safely
    /// spooled or held in memory because neither the store nor the spool takes it (after at
    /// most one replay attempt of the spool). Blocking: for tests and the
    /// admin API, never the request path.
    pub fn flush(&self) {
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        if self.send_control(Msg::Flush(ack_tx), None) {
            // Err only if the pipeline is gone; nothing left to wait for then.
            let _ = ack_rx.recv();
        }
    }

    /// The spool's current state (zero without a spool).
    pub fn spool_state(&self) -> SpoolState {
        self.link.state()
    }

    /// Stops intake, delivers everything queued, drains the spool until `deadline` and joins
    /// the threads. If they have not finished by `deadline` (a stuck sink), they are detached
    /// and the report says `timed_out`; what is in the spool stays there for the next start.
    pub fn shutdown(mut self, deadline: Duration) -> ShutdownReport {
        let start = Instant::now();
        let until = start + deadline;
        self.shared.closing.store(true, Ordering::SeqCst);
        let sent = self.send_control(Msg::Shutdown(until), Some(until));
        let threads = std::mem::take(&mut self.threads);
        if sent {
            while !threads.iter().all(JoinHandle::is_finished) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let timed_out = !threads.iter().all(JoinHandle::is_finished);
        if !timed_out {
            for t in threads {
                if t.join().is_err() {
                    tracing::error!("a tokenscope record pipeline thread panicked");
                }
            }
        } else {
            tracing::error!(
                ?deadline,
                "tokenscope record pipeline did not finish before the shutdown deadline"
            );
        }
        let s = &self.shared;
        let (enqueued, written, duplicates, lost, spooled) = (
            s.enqueued.load(Ordering::SeqCst),
            s.written.load(Ordering::SeqCst),
            s.duplicates.load(Ordering::SeqCst),
            s.lost.load(Ordering::SeqCst),
            s.spooled.load(Ordering::SeqCst),
        );
        let spooled_batches = self.link.state().batches;
        if spooled_batches > 0 {
            tracing::warn!(
                batches = spooled_batches,
                "store did not take every batch before shutdown; they stay in the spool and are \
                 replayed on the next start"
            );
        }
        ShutdownReport {
            enqueued,
            written,
            duplicates,
            dropped: s.dropped.load(Ordering::SeqCst),
            lost,
            spooled,
            spooled_batches,
            abandoned: if timed_out {
                enqueued.saturating_sub(written + duplicates + lost + spooled)
            } else {
                0
            },
            timed_out,
            elapsed: start.elapsed(),
        }
    }

    /// Puts a control message in the (possibly full) queue, waiting for room until `until`.
    /// `false` when the pipeline is gone or the deadline passed.
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
        if !self.threads.is_empty() {
            // Dropped without shutdown(): stop intake and let the threads drain on their own,
            // detached (never block a drop).
            self.shared.closing.store(true, Ordering::SeqCst);
            let _ = self
                .tx
                .try_send(Msg::Shutdown(Instant::now() + Duration::from_secs(5)));
        }
    }
}

/// Starts the pipeline without a spool: a batch that fails every retry is lost (counted).
/// Returns the request path's [`Recorder`] and the owner's [`PipelineHandle`]. `capacity`,
/// `batch_size` and `handoff_batches` of 0 are treated as 1.
pub fn spawn_pipeline(
    sink: Box<dyn RecordSink>,
    cfg: PipelineConfig,
    obs: Arc<dyn PipelineObserver>,
) -> (Recorder, PipelineHandle) {
    spawn(sink, cfg, None, obs)
}

/// Starts the pipeline with an on-disk [`Spool`] (already opened: it may hold batches of an
/// earlier run, which are replayed first). See the module docs.
pub fn spawn_pipeline_with_spool(
    sink: Box<dyn RecordSink>,
    cfg: PipelineConfig,
    spool: Spool,
    obs: Arc<dyn PipelineObserver>,
) -> (Recorder, PipelineHandle) {
    spawn(sink, cfg, Some(spool), obs)
}

fn spawn(
    sink: Box<dyn RecordSink>,
    cfg: PipelineConfig,
    spool: Option<Spool>,
    obs: Arc<dyn PipelineObserver>,
) -> (Recorder, PipelineHandle) {
    let cfg = PipelineConfig {
        capacity: cfg.capacity.max(1),
        batch_size: cfg.batch_size.max(1),
        handoff_batches: cfg.handoff_batches.max(1),
        ..cfg
    };
    let (tx, rx) = queue(cfg.capacity);
    let (job_tx, job_rx) = mpsc::sync_channel(cfg.handoff_batches);
    let shared = Arc::new(Shared {
        obs,
        closing: AtomicBool::new(false),
        in_flight: AtomicU64::new(0),
        enqueued: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
        written: AtomicU64::new(0),
        duplicates: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        updates_enqueued: AtomicU64::new(0),
        updates_unmatched: AtomicU64::new(0),
        warned_drop: AtomicBool::new(false),
        spooled: AtomicU64::new(0),
    });
    let has_spool = spool.is_some();
    let link = Arc::new(Link {
        delivery: Mutex::new(Delivery {
            healthy: spool.as_ref().is_none_or(Spool::is_empty),
            spool,
            held: VecDeque::new(),
            held_rows: 0,
        }),
        hold_cap: cfg.capacity,
        warned_hold: AtomicBool::new(false),
        state: Mutex::new(SpoolState::default()),
        jobs: job_tx,
        shared: Arc::clone(&shared),
        has_spool,
    });
    {
        let d = link.lock();
        link.publish(&d);
        if let Some(sp) = d.spool.as_ref() {
            if !sp.is_empty() {
                tracing::info!(
                    batches = sp.len(),
                    bytes = sp.bytes(),
                    "tokenscope spool holds batches from an earlier run; replaying them"
                );
            }
        }
    }
    let mut batcher = Batcher {
        rx,
        batch: Batch::default(),
        cfg: cfg.clone(),
        link: Arc::clone(&link),
        started: None,
    };
    let mut sender = Sender {
        jobs: job_rx,
        sink,
        cfg,
        link: Arc::clone(&link),
        deadline: None,
        retry_at: None,
        attempt: 0,
        held_retry_at: None,
        held_attempt: 0,
        last_error: None,
    };
    let mut threads = Vec::with_capacity(2);
    for (name, body) in [
        (
            "tokenscope-batcher",
            Box::new(move || batcher.run()) as Box<dyn FnOnce() + Send>,
        ),
        ("tokenscope-writer", Box::new(move || sender.run())),
    ] {
        match std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(body)
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                // The receiver moved into the failed closure is dropped: every record then
                // counts as a `Closed` drop (or waits in the spool for the next start).
                tracing::error!(error = %e, thread = name, "could not start a tokenscope pipeline thread");
            }
        }
    }
    (
        Recorder {
            tx: tx.clone(),
            shared: Arc::clone(&shared),
        },
        PipelineHandle {
            tx,
            shared,
            threads,
            link,
        },
    )
}

/// One unit of delivery: records, then the updates that arrived with them. Also the spool's
/// payload (JSON).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Batch {
    /// Payload format version.
    #[serde(default)]
    v: u32,
    records: Vec<RequestRecord>,
    updates: Vec<PhaseUpdate>,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.records.is_empty() && self.updates.is_empty()
    }
    fn len(&self) -> usize {
        self.records.len() + self.updates.len()
    }
}

/// What the batcher hands to the sender.
enum Job {
    Batch(Batch),
    Flush(SyncSender<()>),
    Shutdown(Instant),
}

/// The spool and the health flag, shared by the batcher (appends) and the sender (replays).
struct Delivery {
    spool: Option<Spool>,
    /// `false` from a failed write until the spool is drained again: new batches go to the
    /// spool, not to the sink.
    healthy: bool,
    /// Batches neither the sink nor the spool took (a full or failing disk), oldest first;
    /// the sender retries them (sink first, then spool) with backoff.
    held: VecDeque<Batch>,
    /// Rows (records + updates) in `held`; at most `Link::hold_cap`.
    held_rows: usize,
}

/// Why a batch could not be appended to the spool.
enum SpoolFail {
    /// The spool's size cap: retrying cannot help until the store drains it.
    Full,
    /// The batch cannot be encoded: retrying cannot help.
    Encode,
    /// The disk refused the write (full, I/O error): may succeed later.
    Io,
}

struct Link {
    delivery: Mutex<Delivery>,
    /// Last published state (read by [`PipelineHandle::spool_state`]).
    state: Mutex<SpoolState>,
    jobs: SyncSender<Job>,
    shared: Arc<Shared>,
    has_spool: bool,
    /// Most rows held in memory when neither the sink nor the spool takes them.
    hold_cap: usize,
    /// A failed spool append was logged since nothing was last held.
    warned_hold: AtomicBool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Delivery> {
        // A panic while holding the lock leaves the spool usable (its own state is consistent
        // after every call), so poisoning is ignored.
        self.delivery.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// New batches go to the spool now (store failing, or spool not yet replayed).
    fn spool_busy(&self) -> bool {
        if !self.has_spool {
            return false;
        }
        let d = self.lock();
        !d.healthy || d.spool.as_ref().is_some_and(|s| !s.is_empty()) || !d.held.is_empty()
    }

    fn state(&self) -> SpoolState {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Recomputes and publishes the spool state.
    fn publish(&self, d: &Delivery) {
        let st = match d.spool.as_ref() {
            Some(sp) => SpoolState {
                batches: sp.len(),
                bytes: sp.bytes(),
                oldest_age: sp
                    .oldest_appended_at_ms()
                    .map(|at| Duration::from_millis(now_ms().saturating_sub(at)))
                    .unwrap_or_default(),
                store_up: d.healthy,
                held_rows: d.held_rows as u64,
            },
            None => SpoolState {
                store_up: d.healthy,
                held_rows: d.held_rows as u64,
                ..SpoolState::default()
            },
        };
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = st;
        self.shared.obs.on_spool_state(st);
    }

    /// Appends `batch` to the spool (the caller holds the lock and checked there is one).
    /// When the disk refuses the write (full, I/O error) the batch is held in memory and
    /// retried by the sender ([`Link::hold`]); when the spool's cap is hit, or the batch
    /// cannot be encoded, its records are lost and counted.
    fn spill(&self, d: &mut Delivery, batch: Batch, in_memory: bool) {
        match self.try_spool(d, &batch, in_memory) {
            Ok(()) => {}
            Err(SpoolFail::Full) => self.lose(batch, LossReason::SpoolFull, in_memory),
            Err(SpoolFail::Encode) => self.lose(batch, LossReason::SpoolError, in_memory),
            Err(SpoolFail::Io) => self.hold(d, batch, in_memory),
        }
    }

    /// One append of `batch` to the spool; counts it as spooled when it was in memory.
    fn try_spool(&self, d: &mut Delivery, batch: &Batch, in_memory: bool) -> Result<(), SpoolFail> {
        let Some(spool) = d.spool.as_mut() else {
            return Err(SpoolFail::Io);
        };
        let payload = match serde_json::to_vec(batch) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "could not encode a batch for the spool (its records are LOST)");
                return Err(SpoolFail::Encode);
            }
        };
        match spool.append(&payload) {
            Ok(Append::Appended { .. }) => {
                let rows = batch.records.len();
                if in_memory {
                    self.shared.spooled.fetch_add(rows as u64, Ordering::SeqCst);
                    self.shared.obs.on_spooled(rows);
                }
                self.publish(d);
                Ok(())
            }
            Ok(Append::Full) => {
                tracing::error!(
                    rows = batch.records.len(),
                    spool_bytes = spool.bytes(),
                    "tokenscope spool is full (its size cap is hit): the batch's records are LOST"
                );
                Err(SpoolFail::Full)
            }
            Err(e) => {
                // Logged once per episode (until nothing is held any more), then only counted.
                if !self.warned_hold.swap(true, Ordering::Relaxed) {
                    tracing::error!(error = %e, rows = batch.records.len(), "could not write to the tokenscope spool; batches are held in memory (up to the pipeline capacity) and retried, store first, then spool");
                }
                Err(SpoolFail::Io)
            }
        }
    }

    /// Keeps a batch that neither the sink nor the spool took in memory, for the sender to
    /// retry; past `hold_cap` rows it is lost ([`LossReason::HoldFull`]).
    fn hold(&self, d: &mut Delivery, batch: Batch, in_memory: bool) {
        let rows = batch.len();
        if d.held_rows + rows > self.hold_cap {
            tracing::error!(
                rows = batch.records.len(),
                held_rows = d.held_rows,
                bound = self.hold_cap,
                "store and spool both fail and the in-memory hold is full: the batch's records are LOST"
            );
            self.lose(batch, LossReason::HoldFull, in_memory);
            return;
        }
        d.held_rows += rows;
        d.held.push_back(batch);
        d.healthy = false;
        self.publish(d);
    }

    /// Counts a batch's records as lost and its updates as unmatched.
    fn lose(&self, batch: Batch, reason: LossReason, in_memory: bool) {
        let rows = batch.records.len();
        if rows > 0 {
            self.shared.lost.fetch_add(rows as u64, Ordering::SeqCst);
            self.shared.obs.on_lost(rows, reason, in_memory);
        }
        let n = batch.updates.len() as u64;
        if n > 0 {
            self.shared.updates_unmatched.fetch_add(n, Ordering::SeqCst);
            self.shared
                .obs
                .on_update_unmatched(UnmatchedReason::WriteFailed, n);
        }
    }

    /// Blocking send of a job (control messages, or batches without a spool), giving up at
    /// `until`. `false` when the sender is gone or the deadline passed.
    fn send_job(&self, mut job: Job, until: Option<Instant>) -> Result<(), Job> {
        loop {
            match self.jobs.try_send(job) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(j)) => return Err(j),
                Err(TrySendError::Full(j)) => {
                    if until.is_some_and(|u| Instant::now() >= u) {
                        return Err(j);
                    }
                    job = j;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

/// Cuts the queue into batches and routes them: to the sender while the store keeps up, to
/// the spool otherwise.
struct Batcher {
    rx: QueueRx,
    batch: Batch,
    cfg: PipelineConfig,
    link: Arc<Link>,
    /// When the current batch got its first row.
    started: Option<Instant>,
}

/// After a record or update, the batcher sleeps this long and then takes everything that
/// arrived meanwhile, instead of being woken for each message (a futex wake on the request
/// path and a context switch here, per record). Bounds the extra delay of a flush request.
const LINGER: Duration = Duration::from_millis(10);

impl Batcher {
    fn run(&mut self) {
        let mut flush_at: Option<Instant> = None;
        let mut linger = false;
        loop {
            let msg = if flush_at.is_some_and(|f| Instant::now() >= f) {
                // Due: flush (or hold, see below) before taking more, even with more queued.
                Err(RecvTimeoutError::Timeout)
            } else if linger {
                linger = false;
                match self.rx.try_recv() {
                    Ok(m) => Ok(m),
                    Err(TryRecvError::Empty) => {
                        std::thread::sleep(LINGER.min(self.cfg.flush_interval));
                        continue;
                    }
                    Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
                }
            } else {
                match flush_at {
                    Some(f) => self
                        .rx
                        .recv_timeout(f.saturating_duration_since(Instant::now())),
                    None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                }
            };
            if matches!(msg, Ok(Msg::Record(_) | Msg::Update(_))) {
                // Take what is already queued without sleeping; sleep once the queue is empty.
                linger = true;
            }
            match msg {
                Ok(Msg::Record(rec)) => {
                    if self.batch.is_empty() {
                        let now = Instant::now();
                        self.started = Some(now);
                        flush_at = Some(now + self.cfg.flush_interval);
                    }
                    self.batch.records.push(*rec);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.deliver(None);
                        flush_at = None;
                    }
                }
                Ok(Msg::Update(up)) => {
                    if self.batch.is_empty() {
                        let now = Instant::now();
                        self.started = Some(now);
                        flush_at = Some(now + self.cfg.flush_interval);
                    }
                    self.batch.updates.push(*up);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.deliver(None);
                        flush_at = None;
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    // FIFO: everything recorded before the flush request is already batched.
                    self.deliver(None);
                    flush_at = None;
                    if let Err(Job::Flush(ack)) = self.link.send_job(Job::Flush(ack), None) {
                        let _ = ack.try_send(());
                    }
                }
                Ok(Msg::Shutdown(deadline)) => {
                    self.drain_for_shutdown(deadline);
                    let _ = self.link.send_job(Job::Shutdown(deadline), Some(deadline));
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {
                    // While batches go to the spool (the store is failing or catching up), a
                    // partial batch keeps filling up to `spill_interval`: every spool entry is
                    // one insert at replay, so fewer, larger entries replay much faster.
                    let hold_until = self.started.map(|t| t + self.cfg.spill_interval);
                    match hold_until {
                        Some(until) if Instant::now() < until && self.link.spool_busy() => {
                            flush_at = Some(until);
                        }
                        _ => {
                            self.deliver(None);
                            flush_at = None;
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    self.deliver(Some(deadline));
                    let _ = self.link.send_job(Job::Shutdown(deadline), Some(deadline));
                    return;
                }
            }
        }
    }

    /// Shutdown: intake is closed; wait for `record` / `update` calls racing the close, then
    /// deliver everything still queued.
    fn drain_for_shutdown(&mut self, deadline: Instant) {
        let s = Arc::clone(&self.link.shared);
        s.closing.store(true, Ordering::SeqCst);
        while s.in_flight.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        loop {
            match self.rx.try_recv() {
                Ok(Msg::Record(rec)) => {
                    self.batch.records.push(*rec);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.deliver(Some(deadline));
                    }
                }
                Ok(Msg::Update(up)) => {
                    self.batch.updates.push(*up);
                    if self.batch.len() >= self.cfg.batch_size {
                        self.deliver(Some(deadline));
                    }
                }
                Ok(Msg::Flush(ack)) => {
                    self.deliver(Some(deadline));
                    let _ = ack.try_send(());
                }
                Ok(Msg::Shutdown(_)) => {}
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        self.deliver(Some(deadline));
    }

    /// Routes the current batch. Without a spool it waits for room in the handoff (the bounded
    /// queue in front absorbs the wait, and drops when full); `until` bounds that wait at
    /// shutdown, after which the batch counts as lost.
    fn deliver(&mut self, until: Option<Instant>) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        if !self.link.has_spool {
            if let Err(Job::Batch(b)) = self.link.send_job(Job::Batch(batch), until) {
                self.link.lose(b, LossReason::WriteFailed, true);
            }
            return;
        }
        let mut d = self.link.lock();
        let spool_busy = !d.healthy || d.spool.as_ref().is_some_and(|s| !s.is_empty());
        if spool_busy {
            self.link.spill(&mut d, batch, true);
            return;
        }
        match self.link.jobs.try_send(Job::Batch(batch)) {
            Ok(()) => {}
            Err(TrySendError::Full(Job::Batch(b)) | TrySendError::Disconnected(Job::Batch(b))) => {
                // The store is slower than the intake (or the sender is gone): spill.
                self.link.spill(&mut d, b, true);
            }
            Err(_) => {}
        }
    }
}

/// Owns the sink: writes handed-off batches, spills failed ones, replays the spool.
struct Sender {
    jobs: Receiver<Job>,
    sink: Box<dyn RecordSink>,
    cfg: PipelineConfig,
    link: Arc<Link>,
    /// Shutdown deadline, once shutdown began: no more backoff sleeps past it.
    deadline: Option<Instant>,
    /// When the spool may be tried again.
    retry_at: Option<Instant>,
    /// Consecutive failed replay attempts (drives the backoff).
    attempt: u32,
    /// When the held batches may be tried again.
    held_retry_at: Option<Instant>,
    /// Consecutive failed attempts at the held batches (drives their backoff).
    held_attempt: u32,
    /// Class of the last logged error and when it was logged.
    last_error: Option<(ErrorClass, Instant)>,
}

impl Sender {
    fn run(&mut self) {
        let mut housekeeping_at = Instant::now() + HOUSEKEEPING_INTERVAL;
        let mut state_at = Instant::now() + STATE_INTERVAL;
        loop {
            let now = Instant::now();
            let mut wake = housekeeping_at.min(state_at);
            if self.spool_pending() {
                wake = wake.min(self.retry_at.unwrap_or(now));
            }
            if self.held_pending() {
                wake = wake.min(self.held_retry_at.unwrap_or(now));
            }
            match self.jobs.recv_timeout(wake.saturating_duration_since(now)) {
                Ok(Job::Batch(b)) => self.write_direct(b),
                Ok(Job::Flush(ack)) => {
                    self.replay(true);
                    let _ = ack.try_send(());
                }
                Ok(Job::Shutdown(deadline)) => {
                    self.deadline = Some(deadline);
                    // Anything still handed off (racing the shutdown) first.
                    while let Ok(job) = self.jobs.try_recv() {
                        match job {
                            Job::Batch(b) => self.write_direct(b),
                            Job::Flush(ack) => {
                                let _ = ack.try_send(());
                            }
                            Job::Shutdown(_) => {}
                        }
                    }
                    self.retry_at = None;
                    self.replay(false);
                    self.drain_held(deadline);
                    self.collect_unmatched(true);
                    let d = self.link.lock();
                    self.link.publish(&d);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.drain_held(Instant::now() + Duration::from_secs(5));
                    self.collect_unmatched(true);
                    return;
                }
            }
            if self.held_pending() && self.held_retry_at.is_none_or(|r| Instant::now() >= r) {
                self.retry_held();
            }
            let now = Instant::now();
            if self.spool_pending() && self.retry_at.is_none_or(|r| now >= r) {
                self.replay(false);
            }
            if now >= housekeeping_at {
                self.collect_unmatched(false);
                housekeeping_at = now + HOUSEKEEPING_INTERVAL;
            }
            if now >= state_at {
                let d = self.link.lock();
                self.link.publish(&d);
                state_at = now + STATE_INTERVAL;
            }
        }
    }

    fn held_pending(&self) -> bool {
        !self.link.lock().held.is_empty()
    }

    /// Retries the held batches, oldest first: the sink first (it may have room when the
    /// spool's disk has none), then the spool. Stops at the first batch neither takes, which
    /// goes back to the front and is retried after a backoff.
    fn retry_held(&mut self) {
        loop {
            let batch = {
                let mut d = self.link.lock();
                match d.held.pop_front() {
                    Some(b) => {
                        d.held_rows = d.held_rows.saturating_sub(b.len());
                        b
                    }
                    None => {
                        self.held_attempt = 0;
                        self.held_retry_at = None;
                        if !d.healthy && d.spool.as_ref().is_none_or(Spool::is_empty) {
                            // Everything held was taken and nothing waits in the spool.
                            d.healthy = true;
                        }
                        if self.link.warned_hold.swap(false, Ordering::Relaxed) {
                            tracing::info!("tokenscope: every batch held in memory was delivered (store or spool)");
                        }
                        self.link.publish(&d);
                        return;
                    }
                }
            };
            // Only straight to the sink when nothing spooled waits before it.
            if !self.spool_pending() {
                match self.attempt_write(&batch) {
                    Ok((latency, inserted)) => {
                        self.written(&batch, latency, false, inserted);
                        continue;
                    }
                    Err(err) => self.failed(&err),
                }
            }
            let mut d = self.link.lock();
            match self.link.try_spool(&mut d, &batch, true) {
                Ok(()) => {}
                Err(SpoolFail::Full) => self.link.lose(batch, LossReason::SpoolFull, true),
                Err(SpoolFail::Encode) => self.link.lose(batch, LossReason::SpoolError, true),
                Err(SpoolFail::Io) => {
                    d.held_rows += batch.len();
                    d.held.push_front(batch);
                    d.healthy = false;
                    self.link.publish(&d);
                    self.held_attempt += 1;
                    self.link.shared.obs.on_retry();
                    let backoff = REPLAY_BACKOFF_BASE
                        .saturating_mul(1_u32 << self.held_attempt.min(16))
                        .min(self.cfg.retry_backoff_max);
                    self.held_retry_at = Some(Instant::now() + backoff);
                    return;
                }
            }
        }
    }

    /// Shutdown: retries the held batches until they are taken or shortly before `deadline`
    /// (a quarter of the time left, at most 500 ms, is kept to count and exit before the
    /// owner stops waiting); what is still held then is lost ([`LossReason::Shutdown`]).
    fn drain_held(&mut self, deadline: Instant) {
        let now = Instant::now();
        let margin = (deadline.saturating_duration_since(now) / 4).min(Duration::from_millis(500));
        let deadline = deadline.checked_sub(margin).unwrap_or(now).max(now);
        while self.held_pending() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if self.held_retry_at.is_none_or(|r| now >= r) {
                self.retry_held();
            } else {
                let until = self.held_retry_at.unwrap_or(now).min(deadline);
                std::thread::sleep(until.saturating_duration_since(now));
            }
        }
        let mut d = self.link.lock();
        let held = std::mem::take(&mut d.held);
        d.held_rows = 0;
        if !held.is_empty() {
            tracing::error!(
                batches = held.len(),
                "store and spool still fail at the shutdown deadline: the held batches' records are LOST"
            );
        }
        for b in held {
            self.link.lose(b, LossReason::Shutdown, true);
        }
        self.link.publish(&d);
    }

    fn spool_pending(&self) -> bool {
        self.link.has_spool
            && self
                .link
                .lock()
                .spool
                .as_ref()
                .is_some_and(|s| !s.is_empty())
    }

    /// A handed-off batch: written now if the store is healthy and nothing waits before it,
    /// else spooled. Without a spool: retried, then lost.
    fn write_direct(&mut self, batch: Batch) {
        if !self.link.has_spool {
            // Records and updates separately: records whose updates fail are still written.
            let Batch {
                records, updates, ..
            } = batch;
            if !records.is_empty() {
                match self.with_retries(records.len(), |sink| sink.write_batch_counted(&records)) {
                    Ok((latency, inserted)) => {
                        self.written_rows(records.len(), inserted, latency, false)
                    }
                    Err(_) => self.link.lose(
                        Batch {
                            records,
                            ..Batch::default()
                        },
                        LossReason::WriteFailed,
                        true,
                    ),
                }
            }
            if !updates.is_empty()
                && self
                    .with_retries(updates.len(), |sink| {
                        sink.apply_updates(&updates).map(|()| 0)
                    })
                    .is_err()
            {
                self.link.lose(
                    Batch {
                        updates,
                        ..Batch::default()
                    },
                    LossReason::WriteFailed,
                    true,
                );
            }
            self.collect_unmatched(false);
            return;
        }
        {
            let mut d = self.link.lock();
            let busy =
                !d.healthy || d.spool.as_ref().is_some_and(|s| !s.is_empty()) || !d.held.is_empty();
            if busy {
                self.link.spill(&mut d, batch, true);
                return;
            }
        }
        match self.attempt_write(&batch) {
            Ok((latency, inserted)) => self.written(&batch, latency, false, inserted),
            Err(err) => {
                self.failed(&err);
                let mut d = self.link.lock();
                d.healthy = false;
                self.link.spill(&mut d, batch, true);
            }
        }
    }

    /// Replays the spool oldest-first until it is empty, a write fails, the round's time is
    /// up (to look at new jobs) or — with `once` — after one failed attempt.
    fn replay(&mut self, once: bool) {
        let round_end = Instant::now() + REPLAY_ROUND;
        loop {
            let entry = {
                let mut d = self.link.lock();
                let Some(spool) = d.spool.as_mut() else {
                    return;
                };
                match spool.peek() {
                    Ok(Some(e)) => e,
                    Ok(None) => {
                        if !d.healthy && d.held.is_empty() {
                            d.healthy = true;
                            tracing::info!("store recovered; tokenscope spool fully replayed");
                        }
                        self.link.publish(&d);
                        return;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "could not read the tokenscope spool");
                        self.retry_at = Some(Instant::now() + self.cfg.retry_backoff_max);
                        return;
                    }
                }
            };
            let batch: Batch = match serde_json::from_slice(&entry.payload) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, seq = entry.seq, "undecodable batch in the tokenscope spool; skipped (its records are LOST)");
                    self.link
                        .shared
                        .obs
                        .on_lost(0, LossReason::SpoolError, false);
                    self.ack(entry.seq);
                    continue;
                }
            };
            match self.attempt_write(&batch) {
                Ok((latency, inserted)) => {
                    self.ack(entry.seq);
                    self.written(&batch, latency, true, inserted);
                    self.attempt = 0;
                    self.retry_at = None;
                }
                Err(err) => {
                    self.failed(&err);
                    self.attempt += 1;
                    if err.class() == ErrorClass::Rejected && self.attempt > self.cfg.retry_attempts
                    {
                        tracing::error!(error = %err, rows = batch.records.len(), "the store rejects a spooled batch's data on every attempt; dropping it (its records are LOST)");
                        self.ack(entry.seq);
                        self.link.lose(batch, LossReason::Rejected, false);
                        self.attempt = 0;
                        continue;
                    }
                    self.link.shared.obs.on_retry();
                    let backoff = REPLAY_BACKOFF_BASE
                        .saturating_mul(1_u32 << self.attempt.min(16))
                        .min(self.cfg.retry_backoff_max);
                    self.retry_at = Some(Instant::now() + backoff);
                    let mut d = self.link.lock();
                    d.healthy = false;
                    self.link.publish(&d);
                    return;
                }
            }
            if once && Instant::now() >= round_end {
                return;
            }
            if let Some(deadline) = self.deadline {
                if Instant::now() >= deadline {
                    return;
                }
            } else if Instant::now() >= round_end {
                return;
            }
        }
    }

    fn ack(&mut self, seq: u64) {
        let mut d = self.link.lock();
        if let Some(spool) = d.spool.as_mut() {
            if let Err(e) = spool.ack(seq) {
                // Not acknowledged durably: the batch may be replayed once more after a
                // restart, which the idempotent sinks absorb.
                tracing::error!(error = %e, seq, "could not acknowledge a tokenscope spool entry");
            }
        }
        self.link.publish(&d);
    }

    fn written(&mut self, batch: &Batch, latency: Duration, replayed: bool, inserted: usize) {
        self.written_rows(batch.records.len(), inserted, latency, replayed);
        self.collect_unmatched(false);
    }

    /// Counts a written batch of `rows` records, `inserted` of them new to the store (the
    /// rest were already there: duplicates, counted apart).
    fn written_rows(&mut self, rows: usize, inserted: usize, latency: Duration, replayed: bool) {
        let inserted = inserted.min(rows);
        let duplicates = rows - inserted;
        if inserted > 0 {
            self.link
                .shared
                .written
                .fetch_add(inserted as u64, Ordering::SeqCst);
            self.link.shared.obs.on_written(inserted, latency, replayed);
        }
        if duplicates > 0 {
            self.link
                .shared
                .duplicates
                .fetch_add(duplicates as u64, Ordering::SeqCst);
            self.link.shared.obs.on_duplicate(duplicates, replayed);
        }
        if let Some((class, _)) = self.last_error.take() {
            tracing::info!(
                sink = self.sink.name(),
                previous_error = class.as_str(),
                "store accepts writes again"
            );
        }
    }

    /// Counts and (rate-limited) logs a failed store call.
    fn failed(&mut self, err: &StoreError) {
        let class = err.class();
        self.link.shared.obs.on_store_error(class, err);
        let now = Instant::now();
        let log = match self.last_error {
            Some((c, at)) => c != class || now.duration_since(at) >= ERROR_LOG_INTERVAL,
            None => true,
        };
        if log {
            self.last_error = Some((class, now));
            let sink = self.sink.name();
            if self.link.has_spool {
                tracing::error!(sink, kind = class.as_str(), error = %err, "store write failed; batches go to the spool and are replayed when it recovers");
            } else {
                tracing::error!(sink, kind = class.as_str(), error = %err, "store write failed");
            }
        }
    }

    /// One attempt: records, then updates; a panic counts as a failure. Returns the
    /// duration and how many records were new to the store.
    fn attempt_write(&mut self, batch: &Batch) -> Result<(Duration, usize), StoreError> {
        let name = self.sink.name();
        let start = Instant::now();
        let sink = &mut self.sink;
        let res = catch_unwind(AssertUnwindSafe(|| {
            let mut inserted = 0;
            if !batch.records.is_empty() {
                inserted = sink.write_batch_counted(&batch.records)?;
            }
            if !batch.updates.is_empty() {
                sink.apply_updates(&batch.updates)?;
            }
            Ok(inserted)
        }))
        .unwrap_or(Err(StoreError::SinkPanicked(name)));
        self.report_recovered();
        res.map(|n| (start.elapsed(), n))
    }

    /// Counts the errors the sink recovered from by itself (metrics; logged by the sink).
    fn report_recovered(&mut self) {
        let sink = &mut self.sink;
        let recovered =
            catch_unwind(AssertUnwindSafe(|| sink.take_recovered())).unwrap_or_default();
        for err in recovered {
            self.link.shared.obs.on_store_error(err.class(), &err);
        }
        let reopened = catch_unwind(AssertUnwindSafe(|| sink.take_reopened())).unwrap_or_default();
        for change in reopened {
            self.link.shared.obs.on_store_reopened(change);
        }
    }

    /// Without a spool: `1 + retry_attempts` attempts of `op` with exponential backoff; a
    /// panic counts as a failure.
    fn with_retries(
        &mut self,
        items: usize,
        mut op: impl FnMut(&mut dyn RecordSink) -> Result<usize, StoreError>,
    ) -> Result<(Duration, usize), StoreError> {
        let name = self.sink.name();
        let mut attempt: u32 = 0;
        loop {
            let start = Instant::now();
            let res = catch_unwind(AssertUnwindSafe(|| op(self.sink.as_mut())))
                .unwrap_or(Err(StoreError::SinkPanicked(name)));
            self.report_recovered();
            match res {
                Ok(n) => return Ok((start.elapsed(), n)),
                Err(err) => {
                    self.failed(&err);
                    let backoff = BACKOFF_BASE
                        .saturating_mul(1_u32 << attempt.min(16))
                        .min(BACKOFF_MAX);
                    let past_deadline =
                        self.deadline.is_some_and(|d| Instant::now() + backoff >= d);
                    if attempt >= self.cfg.retry_attempts || past_deadline {
                        tracing::error!(
                            sink = name,
                            items,
                            attempts = attempt + 1,
                            error = %err,
                            "tokenscope store write failed for good; the items are LOST (no spool configured)"
                        );
                        return Err(err);
                    }
                    self.link.shared.obs.on_retry();
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
            self.link
                .shared
                .updates_unmatched
                .fetch_add(n, Ordering::SeqCst);
            self.link.shared.obs.on_update_unmatched(reason, n);
            tracing::debug!(
                reason = reason.as_str(),
                updates = n,
                "tokenscope engine updates left unapplied"
            );
        }
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
        duplicates: AtomicU64,
        errors: AtomicU64,
        unmatched: Mutex<Vec<(UnmatchedReason, u64)>>,
        lost_reasons: Mutex<Vec<(LossReason, usize)>>,
        spooled: AtomicU64,
        store_errors: Mutex<Vec<ErrorClass>>,
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
        fn on_duplicate(&self, rows: usize, _replayed: bool) {
            self.duplicates.fetch_add(rows as u64, Ordering::SeqCst);
        }
        fn on_written(&self, rows: usize, _latency: Duration, _replayed: bool) {
            self.written.fetch_add(rows as u64, Ordering::SeqCst);
        }
        fn on_lost(&self, rows: usize, reason: LossReason, _in_memory: bool) {
            self.errors.fetch_add(rows as u64, Ordering::SeqCst);
            self.lost_reasons
                .lock()
                .expect("reasons")
                .push((reason, rows));
        }
        fn on_spooled(&self, rows: usize) {
            self.spooled.fetch_add(rows as u64, Ordering::SeqCst);
        }
        fn on_store_error(&self, class: ErrorClass, _err: &StoreError) {
            self.store_errors.lock().expect("store errors").push(class);
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
            ..PipelineConfig::default()
        }
    }

    #[test]
    fn defaults() {
        let c = PipelineConfig::default();
        assert_eq!(
            (
                c.capacity,
                c.batch_size,
                c.flush_interval,
                c.retry_attempts,
                c.handoff_batches,
                c.retry_backoff_max,
                c.spill_interval
            ),
            (
                65_536,
                8192,
                Duration::from_millis(200),
                3,
                4,
                Duration::from_secs(5),
                Duration::from_secs(1)
            )
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
        // Without a spool, the batcher absorbs one batch per handoff slot (4) plus the one it
        // waits to hand off; give it time to take them.
        for i in 1..=5 {
            rec_tx.record(rec(i));
            std::thread::sleep(Duration::from_millis(30));
        }
        // Then 8 fit in the queue, the remaining 92 are dropped; none of these calls may block.
        let start = Instant::now();
        for i in 6..=105 {
            rec_tx.record(rec(i));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(rec_tx.queued(), 14);
        assert_eq!(rec_tx.dropped(), 92);
        assert_eq!(obs.dropped_full.load(Ordering::SeqCst), 92);
        assert_eq!(obs.enqueued.load(Ordering::SeqCst), 14);
        assert_eq!(rec_tx.pending(), 14);

        sink.unblock();
        let report = handle.shutdown(Duration::from_secs(10));
        assert!(!report.timed_out);
        assert_eq!(
            (report.enqueued, report.written, report.dropped, report.lost),
            (14, 14, 92, 0)
        );
        assert_eq!(sink.ids().len(), 14);
        assert_eq!(obs.written.load(Ordering::SeqCst), 14);
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

    fn spool_at(dir: &std::path::Path, max_bytes: u64) -> Spool {
        Spool::open(crate::SpoolConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            segment_bytes: 64 * 1024,
            fsync: false,
        })
        .expect("open spool")
    }

    fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !f() {
            assert!(t0.elapsed() < Duration::from_secs(20), "timed out: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn spool_cfg() -> PipelineConfig {
        PipelineConfig {
            capacity: 1000,
            batch_size: 10,
            flush_interval: Duration::from_millis(10),
            retry_attempts: 3,
            handoff_batches: 2,
            retry_backoff_max: Duration::from_millis(200),
            spill_interval: Duration::from_millis(10),
        }
    }

    #[test]
    fn store_down_spools_then_replays_exactly_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst); // the store is down
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            spool_cfg(),
            spool_at(dir.path(), 1 << 30),
            obs.clone(),
        );
        for i in 0..500 {
            rec_tx.record(rec(i));
            if i % 100 == 0 {
                rec_tx.update(up(i));
            }
        }
        handle.flush();
        // Nothing written, nothing lost: everything is on disk.
        assert_eq!(
            (rec_tx.written(), rec_tx.lost(), rec_tx.dropped()),
            (0, 0, 0)
        );
        assert_eq!(obs.spooled.load(Ordering::SeqCst), 500);
        let st = handle.spool_state();
        assert!(st.batches >= 50 && st.bytes > 0 && !st.store_up, "{st:?}");
        assert!(obs
            .store_errors
            .lock()
            .expect("errors")
            .iter()
            .all(|c| *c == ErrorClass::Unavailable));
        // The store comes back: replayed oldest-first, every row once.
        sink.fail_first.store(0, Ordering::SeqCst);
        wait_until("replay", || rec_tx.written() == 500);
        wait_until("spool empty", || handle.spool_state().batches == 0);
        // Every row exactly once. (Order is per spool FIFO: a batch whose direct write failed
        // is spooled after those spilled meanwhile.)
        let mut ids = sink.ids();
        ids.sort();
        assert_eq!(
            ids,
            (0..500).map(|i| format!("r{i:06}")).collect::<Vec<_>>()
        );
        assert_eq!(sink.updates.lock().expect("updates").len(), 5);
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!(
            (
                report.written,
                report.lost,
                report.spooled,
                report.spooled_batches
            ),
            (500, 0, 500, 0)
        );
        assert!(handle_state_up(&obs));
    }

    fn handle_state_up(obs: &CountingObserver) -> bool {
        obs.errors.load(Ordering::SeqCst) == 0
    }

    #[test]
    fn slow_store_spills_instead_of_dropping() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.block(); // every write hangs until unblocked
        let obs = Arc::new(CountingObserver::default());
        let mut c = spool_cfg();
        c.capacity = 1024; // a small queue: without the spool most records would be dropped
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            c,
            spool_at(dir.path(), 1 << 30),
            obs.clone(),
        );
        for i in 0..2000 {
            rec_tx.record(rec(i));
            if i % 8 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        wait_until("spilled", || obs.spooled.load(Ordering::SeqCst) > 900);
        assert_eq!(rec_tx.dropped(), 0, "the request path must not drop");
        sink.unblock();
        wait_until("all written", || rec_tx.written() == 2000);
        let mut ids = sink.ids();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 2000);
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!(
            (report.lost, report.dropped, report.spooled_batches),
            (0, 0, 0)
        );
    }

    #[test]
    fn spool_survives_a_restart_and_replays_on_the_next_start() {
        let dir = tempfile::tempdir().expect("tmp");
        let down = MemSink::default();
        down.fail_first.store(u64::MAX, Ordering::SeqCst);
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(down.clone()),
            spool_cfg(),
            spool_at(dir.path(), 1 << 30),
            Arc::new(NoopObserver),
        );
        for i in 0..300 {
            rec_tx.record(rec(i));
        }
        let report = handle.shutdown(Duration::from_millis(500));
        assert_eq!((report.written, report.lost, report.spooled), (0, 0, 300));
        assert!(report.spooled_batches >= 30);
        assert!(down.ids().is_empty());

        // Next start, store up: the earlier run's batches are replayed before anything else.
        let up_sink = MemSink::default();
        let (rec2, handle2) = spawn_pipeline_with_spool(
            Box::new(up_sink.clone()),
            spool_cfg(),
            spool_at(dir.path(), 1 << 30),
            Arc::new(NoopObserver),
        );
        wait_until("replayed", || rec2.written() == 300);
        rec2.record(rec(1000));
        handle2.flush();
        let ids = up_sink.ids();
        assert_eq!(ids.len(), 301);
        // The earlier run's rows come first, each once; the new record after them.
        let mut first: Vec<String> = ids[..300].to_vec();
        first.sort();
        assert_eq!(
            first,
            (0..300).map(|i| format!("r{i:06}")).collect::<Vec<_>>()
        );
        assert_eq!(ids[300], "r001000");
        let report = handle2.shutdown(Duration::from_secs(5));
        assert_eq!((report.spooled_batches, report.lost), (0, 0));
    }

    #[test]
    fn spool_cap_loses_and_says_so() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        // Room for a few batches only.
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            spool_cfg(),
            spool_at(dir.path(), 8 * 1024),
            obs.clone(),
        );
        for i in 0..400 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        let lost = rec_tx.lost();
        assert!(lost > 0, "the cap must be hit");
        assert_eq!(lost + obs.spooled.load(Ordering::SeqCst), 400);
        assert!(obs
            .lost_reasons
            .lock()
            .expect("reasons")
            .iter()
            .all(|(r, _)| *r == LossReason::SpoolFull));
        let report = handle.shutdown(Duration::from_millis(300));
        assert_eq!(report.lost, lost);
    }

    /// A spool whose directory is gone: every append must create a segment (one frame per
    /// segment) and fails — what a full or failing disk looks like to the pipeline.
    fn failing_spool(dir: &std::path::Path) -> Spool {
        let spool_dir = dir.join("spool");
        let spool = Spool::open(crate::SpoolConfig {
            dir: spool_dir.clone(),
            max_bytes: 1 << 20,
            segment_bytes: 1,
            fsync: false,
        })
        .expect("open spool");
        std::fs::remove_dir_all(&spool_dir).expect("remove spool dir");
        spool
    }

    #[test]
    fn failing_spool_holds_batches_in_memory_until_the_store_takes_them() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            spool_cfg(),
            failing_spool(dir.path()),
            obs.clone(),
        );
        for i in 0..30 {
            rec_tx.record(rec(i));
        }
        // Store and spool both fail: nothing is lost, everything is held.
        wait_until("30 rows held", || handle.spool_state().held_rows == 30);
        assert_eq!(rec_tx.lost(), 0);
        assert_eq!(rec_tx.written(), 0);
        assert_eq!(rec_tx.pending(), 30);
        assert!(!handle.spool_state().store_up);
        // Retried with backoff while it fails.
        let calls = sink.calls.load(Ordering::SeqCst);
        wait_until("held batches retried", || {
            sink.calls.load(Ordering::SeqCst) > calls
        });
        // The store recovers: the held batches go straight to it, once each.
        sink.fail_first.store(0, Ordering::SeqCst);
        wait_until("held batches written", || rec_tx.written() == 30);
        let mut ids = sink.ids();
        ids.sort();
        assert_eq!(ids, (0..30).map(|i| rec(i).request_id).collect::<Vec<_>>());
        wait_until("store up again", || {
            let st = handle.spool_state();
            st.store_up && st.held_rows == 0
        });
        // New records flow straight to the store again.
        rec_tx.record(rec(30));
        handle.flush();
        assert_eq!(rec_tx.written(), 31);
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!((report.written, report.lost, report.spooled), (31, 0, 0));
        assert!(obs.lost_reasons.lock().expect("reasons").is_empty());
    }

    #[test]
    fn held_rows_past_the_bound_and_at_the_shutdown_deadline_are_lost_and_counted() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst);
        let obs = Arc::new(CountingObserver::default());
        // The hold is bounded by the pipeline capacity: 25 rows, batches of 10.
        let cfg = PipelineConfig {
            capacity: 25,
            ..spool_cfg()
        };
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            cfg,
            failing_spool(dir.path()),
            obs.clone(),
        );
        for round in 0..2 {
            for i in 0..10 {
                rec_tx.record(rec(round * 10 + i));
            }
            wait_until("batch held", || {
                handle.spool_state().held_rows == (round as u64 + 1) * 10
            });
        }
        for i in 20..30 {
            rec_tx.record(rec(i));
        }
        wait_until("third batch lost", || rec_tx.lost() == 10);
        assert_eq!(
            handle.spool_state().held_rows,
            20,
            "the held rows stay held"
        );
        let report = handle.shutdown(Duration::from_millis(300));
        assert_eq!(report.lost, 30, "{report:?}");
        assert_eq!(report.written, 0);
        let reasons = obs.lost_reasons.lock().expect("reasons").clone();
        let sum = |want: LossReason| -> usize {
            reasons
                .iter()
                .filter(|(r, _)| *r == want)
                .map(|(_, n)| n)
                .sum()
        };
        assert_eq!(sum(LossReason::HoldFull), 10, "{reasons:?}");
        assert_eq!(sum(LossReason::Shutdown), 20, "{reasons:?}");
    }

    #[test]
    fn rows_the_store_already_held_count_as_duplicates_not_written() {
        let obs = Arc::new(CountingObserver::default());
        let store = SqliteStore::open_in_memory().expect("store");
        let (rec_tx, handle) = spawn_pipeline(Box::new(store), cfg(100, 10), obs.clone());
        for i in 0..5 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        // The same five again (what a replay after a crash delivers) plus two new ones.
        for i in 0..7 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        assert_eq!(rec_tx.written(), 7);
        assert_eq!(rec_tx.duplicates(), 5);
        assert_eq!(obs.written.load(Ordering::SeqCst), 7);
        assert_eq!(obs.duplicates.load(Ordering::SeqCst), 5);
        assert_eq!(rec_tx.pending(), 0);
        let report = handle.shutdown(Duration::from_secs(5));
        assert_eq!((report.written, report.duplicates), (7, 5));
    }

    #[test]
    fn rejected_batch_is_dropped_after_retries_and_the_rest_flows() {
        /// Rejects any batch holding record `r000003`, accepts the others.
        #[derive(Clone, Default)]
        struct Picky(Arc<Mutex<Vec<String>>>);
        impl RecordSink for Picky {
            fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
                if batch.iter().any(|r| r.request_id == "r000003") {
                    return Err(StoreError::Sink {
                        sink: "picky",
                        class: ErrorClass::Rejected,
                        message: "bad row".to_owned(),
                    });
                }
                self.0
                    .lock()
                    .expect("rows")
                    .extend(batch.iter().map(|r| r.request_id.clone()));
                Ok(())
            }
            fn name(&self) -> &'static str {
                "picky"
            }
        }
        let dir = tempfile::tempdir().expect("tmp");
        let sink = Picky::default();
        let obs = Arc::new(CountingObserver::default());
        let mut c = spool_cfg();
        c.batch_size = 5;
        c.retry_backoff_max = Duration::from_millis(20);
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            c,
            spool_at(dir.path(), 1 << 30),
            obs.clone(),
        );
        for i in 0..20 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        wait_until("rest written", || rec_tx.written() + rec_tx.lost() == 20);
        assert_eq!(rec_tx.lost(), 5);
        assert_eq!(sink.0.lock().expect("rows").len(), 15);
        assert_eq!(
            *obs.lost_reasons.lock().expect("reasons"),
            vec![(LossReason::Rejected, 5)]
        );
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn errors_the_sink_recovered_from_are_counted() {
        #[derive(Default)]
        struct Repairing(u32);
        impl RecordSink for Repairing {
            fn write_batch(&mut self, _batch: &[RequestRecord]) -> Result<(), StoreError> {
                self.0 += 1;
                Ok(())
            }
            fn take_recovered(&mut self) -> Vec<StoreError> {
                (self.0 == 1)
                    .then(|| StoreError::Sink {
                        sink: "repairing",
                        class: ErrorClass::Schema,
                        message: "table recreated".to_owned(),
                    })
                    .into_iter()
                    .collect()
            }
            fn name(&self) -> &'static str {
                "repairing"
            }
        }
        let obs = Arc::new(CountingObserver::default());
        let (rec_tx, handle) =
            spawn_pipeline(Box::new(Repairing::default()), cfg(10, 1), obs.clone());
        rec_tx.record(rec(1));
        rec_tx.record(rec(2));
        handle.flush();
        assert_eq!(rec_tx.written(), 2);
        assert_eq!(
            *obs.store_errors.lock().expect("errors"),
            vec![ErrorClass::Schema]
        );
        handle.shutdown(Duration::from_secs(5));
    }

    #[test]
    fn while_spilling_batches_fill_up_to_the_spill_interval() {
        let dir = tempfile::tempdir().expect("tmp");
        let sink = MemSink::default();
        sink.fail_first.store(u64::MAX, Ordering::SeqCst);
        let mut c = spool_cfg();
        c.batch_size = 10_000;
        c.flush_interval = Duration::from_millis(10);
        c.spill_interval = Duration::from_millis(400);
        let (rec_tx, handle) = spawn_pipeline_with_spool(
            Box::new(sink.clone()),
            c,
            spool_at(dir.path(), 1 << 30),
            Arc::new(NoopObserver),
        );
        // The first record's direct write fails; from then on the store is known down.
        rec_tx.record(rec(0));
        wait_until("first batch spooled", || handle.spool_state().batches == 1);
        let t0 = Instant::now();
        let mut i = 1;
        while t0.elapsed() < Duration::from_millis(1200) {
            rec_tx.record(rec(i));
            i += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        handle.flush();
        // ~1.2 s of records at a 10 ms flush interval would be >100 entries; held to 400 ms,
        // they are a handful.
        let batches = handle.spool_state().batches;
        assert!((2..=6).contains(&batches), "{batches} spool entries");
        sink.fail_first.store(0, Ordering::SeqCst);
        wait_until("replayed", || rec_tx.written() == i as u64);
        handle.shutdown(Duration::from_secs(5));
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
        // The batcher absorbs 4 handoff slots + the one it waits to hand off.
        for i in 100..105 {
            rec_tx.update(up(i));
            std::thread::sleep(Duration::from_millis(30));
        }
        let start = Instant::now();
        for i in 0..10 {
            rec_tx.update(up(i));
        }
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!((rec_tx.updates_queued(), rec_tx.dropped()), (9, 6));
        assert_eq!(obs.dropped_full.load(Ordering::SeqCst), 6);
        // Not counted as queued records.
        assert_eq!(
            (rec_tx.queued(), obs.enqueued.load(Ordering::SeqCst)),
            (1, 1)
        );
        sink.unblock();
        let report = handle.shutdown(Duration::from_secs(10));
        assert_eq!((report.written, report.dropped), (1, 6));
        assert_eq!(sink.updates.lock().expect("updates").len(), 9);
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
                (Some(i as f64), tokenscope_core::PhaseSource::EngineSpan)
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
        // Records the store already holds (a replayed batch) do not double rows, and count
        // as duplicates, not as written.
        for i in 0..10 {
            rec_tx.record(rec(i));
        }
        handle.flush();
        let reader = SqliteStore::open_read_only(&path).expect("reader");
        assert_eq!(reader.count().expect("count"), 1_000);
        let report = handle.shutdown(Duration::from_secs(10));
        assert_eq!((report.written, report.duplicates), (1_000, 10));
        assert_eq!(reader.count().expect("count"), 1_000);
    }
}
