//! From the engine thread to the exporters: one bounded channel, one exporter thread.
//!
//! Invariants:
//! * [`Sink::send`] never blocks: `try_send` on a bounded `sync_channel`; a full (or closed)
//!   channel drops the batch and counts it, and the finished requests in it, in [`SinkStats`]
//!   (two relaxed atomic adds, only on a drop, i.e. per flush at most — never per token).
//! * The exporter thread polls: it drains the channel every [`PipelineConfig::poll_interval`]
//!   and sleeps in between, never blocked in `recv`. So a send never has a waiting receiver to
//!   wake: no futex syscall on the engine thread (a blocking receiver would cost a wake-up
//!   per flush, microseconds each).
//! * Every batch received goes to every [`Exporter`] in order; [`Exporter::shutdown`] is called
//!   once after the last sender is gone and the channel is drained.

use crate::clock::Nanos;
use crate::tracker::FinishedRequest;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Tokens counted for one model since the previous flush.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDelta {
    /// Model name.
    pub model: Arc<str>,
    /// Prompt tokens of requests that finished since the previous flush.
    pub input: u64,
    /// Tokens generated since the previous flush.
    pub output: u64,
}

/// One flush of a tracker.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Tracker time of the flush.
    pub at_ns: Nanos,
    /// Token counters per model (only models with activity).
    pub tokens: Vec<TokenDelta>,
    /// Requests finished since the previous flush.
    pub finished: Vec<FinishedRequest>,
}

/// Counters of one sink (shared with the exporter thread and whoever reads them).
#[derive(Debug, Default)]
pub struct SinkStats {
    sent: AtomicU64,
    dropped_batches: AtomicU64,
    dropped_requests: AtomicU64,
}

impl SinkStats {
    /// Batches handed to the channel.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    /// Batches dropped because the channel was full or closed.
    pub fn dropped_batches(&self) -> u64 {
        self.dropped_batches.load(Ordering::Relaxed)
    }
    /// Finished requests inside dropped batches.
    pub fn dropped_requests(&self) -> u64 {
        self.dropped_requests.load(Ordering::Relaxed)
    }
}

/// The engine side of the channel. Owned by the [`crate::Tracker`].
#[derive(Debug)]
pub struct Sink {
    tx: SyncSender<Batch>,
    stats: Arc<SinkStats>,
    sent: u64,
}

impl Sink {
    /// Hands `batch` over without blocking; drops and counts it when the channel is full.
    pub fn send(&mut self, batch: Batch) {
        let n = batch.finished.len() as u64;
        match self.tx.try_send(batch) {
            Ok(()) => {
                self.sent += 1;
                // One relaxed store per flush, so readers see progress.
                self.stats.sent.store(self.sent, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.dropped_batches.fetch_add(1, Ordering::Relaxed);
                self.stats.dropped_requests.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// This sink's counters.
    pub fn stats(&self) -> Arc<SinkStats> {
        self.stats.clone()
    }
}

/// Receives every batch on the exporter thread.
pub trait Exporter: Send + 'static {
    /// One batch. Runs on the exporter thread; may block on I/O (the engine does not wait).
    fn export(&mut self, batch: &Batch);
    /// Called once when the tracker is gone and every batch was exported.
    fn shutdown(&mut self) {}
}

impl<F: FnMut(&Batch) + Send + 'static> Exporter for F {
    fn export(&mut self, batch: &Batch) {
        self(batch)
    }
}

/// Settings of [`spawn_exporters`].
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    /// Batches the channel holds before new ones are dropped. Default 1024 (at one flush per
    /// 100 tokens and 100 000 tokens/s: one second of exporter stall).
    pub capacity: usize,
    /// Name of the exporter thread. Default `tokenscope-sdk-export`.
    pub thread_name: String,
    /// How often the exporter thread drains the channel. Default 20 ms (batches reach the
    /// exporters at most this long after a flush).
    pub poll_interval: std::time::Duration,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            capacity: 1024,
            thread_name: "tokenscope-sdk-export".to_owned(),
            poll_interval: std::time::Duration::from_millis(20),
        }
    }
}

/// The running exporter thread.
#[derive(Debug)]
pub struct ExporterThread {
    handle: Option<JoinHandle<()>>,
    stats: Arc<SinkStats>,
}

impl ExporterThread {
    /// The sink's counters.
    pub fn stats(&self) -> &SinkStats {
        &self.stats
    }

    /// Waits until the thread has exported everything and shut the exporters down. Returns
    /// once every [`Sink`] (i.e. its tracker) has been dropped.
    pub fn join(mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Starts the exporter thread; give the returned [`Sink`] to [`crate::Tracker::with_sink`].
pub fn spawn_exporters(
    cfg: PipelineConfig,
    exporters: Vec<Box<dyn Exporter>>,
) -> Result<(Sink, ExporterThread), crate::SdkError> {
    let (tx, rx) = sync_channel(cfg.capacity.max(1));
    let stats = Arc::new(SinkStats::default());
    let poll = cfg.poll_interval;
    let handle = std::thread::Builder::new()
        .name(cfg.thread_name)
        .spawn(move || run(rx, exporters, poll))
        .map_err(crate::SdkError::Thread)?;
    Ok((
        Sink {
            tx,
            stats: stats.clone(),
            sent: 0,
        },
        ExporterThread {
            handle: Some(handle),
            stats,
        },
    ))
}

fn run(rx: Receiver<Batch>, mut exporters: Vec<Box<dyn Exporter>>, poll: std::time::Duration) {
    loop {
        match rx.try_recv() {
            Ok(batch) => {
                for e in &mut exporters {
                    e.export(&batch);
                }
            }
            Err(TryRecvError::Empty) => std::thread::sleep(poll),
            Err(TryRecvError::Disconnected) => break,
        }
    }
    for e in &mut exporters {
        e.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Clock, FinishReason, RequestInfo, Tracker, TrackerConfig};
    use std::sync::Mutex;

    #[test]
    fn batches_reach_the_exporter_and_drops_are_counted() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let (sink, thread) = spawn_exporters(
            PipelineConfig::default(),
            vec![Box::new(move |b: &Batch| {
                s.lock().expect("lock").push(b.clone());
            })],
        )
        .expect("spawn");
        let cfg = TrackerConfig {
            flush_tokens: 2,
            ..TrackerConfig::default()
        };
        let mut t = Tracker::with_sink(cfg, Clock::new(), sink);
        let m = t.model("m");
        let h = t.arrive_at(0, RequestInfo::new(m, 3));
        t.schedule_at(h, 1);
        t.token_at(h, 2);
        t.token_at(h, 3); // second token: flush (2 tokens)
        t.finish_at(h, 3, FinishReason::Stop);
        drop(t); // flushes the finished request
        thread.join();
        let seen = seen.lock().expect("lock");
        let out: u64 = seen.iter().flat_map(|b| &b.tokens).map(|d| d.output).sum();
        let inp: u64 = seen.iter().flat_map(|b| &b.tokens).map(|d| d.input).sum();
        let fin: usize = seen.iter().map(|b| b.finished.len()).sum();
        assert_eq!((out, inp, fin), (2, 3, 1));
    }

    #[test]
    fn full_channel_drops_and_counts() {
        let (tx, rx) = sync_channel(1);
        let stats = Arc::new(SinkStats::default());
        let mut sink = Sink {
            tx,
            stats: stats.clone(),
            sent: 0,
        };
        let batch = Batch {
            at_ns: 0,
            tokens: Vec::new(),
            finished: Vec::new(),
        };
        sink.send(batch.clone());
        sink.send(batch.clone());
        assert_eq!((stats.sent(), stats.dropped_batches()), (1, 1));
        drop(rx);
        sink.send(batch);
        assert_eq!(stats.dropped_batches(), 2);
    }
}
