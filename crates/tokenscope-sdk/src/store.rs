//! Store exporter: finished requests written straight to a tokenscope store, for engines that
//! run without a gateway in front (with a gateway, prefer OTLP: the gateway joins the engine's
//! phases into its own record).
//!
//! Invariants:
//! * Runs on the exporter thread: one `write_batch` per tracker flush with finished requests
//!   ([`crate::FinishedRequest::to_record`]: phases and tokens with source `engine`, outcome
//!   from the finish reason, `created_at` = arrival on the wall clock).
//! * Stores are idempotent per `request_id` (the SQLite store inserts or ignores), so give the
//!   tracker unique request ids. A failed write is counted ([`StoreExporter::failed_records`])
//!   and the batch dropped: there is no spool here (use the gateway's pipeline for durable
//!   delivery).

use crate::pipeline::{Batch, Exporter};
use tokenscope_store::pipeline::RecordSink;

/// Writes finished requests to a [`RecordSink`] (e.g. `tokenscope_store::SqliteStore`).
pub struct StoreExporter {
    sink: Box<dyn RecordSink>,
    written: u64,
    failed: u64,
    last_error: Option<String>,
}

impl StoreExporter {
    /// Writes to `sink`.
    pub fn new(sink: Box<dyn RecordSink>) -> Self {
        Self {
            sink,
            written: 0,
            failed: 0,
            last_error: None,
        }
    }

    /// Records written.
    pub fn written_records(&self) -> u64 {
        self.written
    }

    /// Records whose batch failed to write.
    pub fn failed_records(&self) -> u64 {
        self.failed
    }

    /// The last write error, if any.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }
}

impl Exporter for StoreExporter {
    fn export(&mut self, batch: &Batch) {
        if batch.finished.is_empty() {
            return;
        }
        let records: Vec<_> = batch.finished.iter().map(|f| f.to_record()).collect();
        match self.sink.write_batch(&records) {
            Ok(()) => self.written += records.len() as u64,
            Err(e) => {
                self.failed += records.len() as u64;
                self.last_error = Some(e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        spawn_exporters, Clock, FinishReason, PipelineConfig, RequestInfo, Tracker, TrackerConfig,
    };
    use tokenscope_core::PhaseSource;
    use tokenscope_store::SqliteStore;

    #[test]
    fn finished_requests_land_in_sqlite() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        let store = SqliteStore::open(&path).expect("open");
        let (sink, thread) = spawn_exporters(
            PipelineConfig::default(),
            vec![Box::new(StoreExporter::new(Box::new(store)))],
        )
        .expect("spawn");
        let mut t = Tracker::with_sink(TrackerConfig::default(), Clock::new(), sink);
        let m = t.model("m");
        let h = t.arrive_at(0, RequestInfo::new(m, 5).request_id("r1"));
        t.schedule_at(h, 2_000_000);
        t.token_at(h, 5_000_000);
        t.token_at(h, 6_000_000);
        t.finish_at(h, 6_000_000, FinishReason::Length);
        drop(t);
        thread.join();
        let store = SqliteStore::open_read_only(&path).expect("open");
        let r = store.get("r1").expect("get").expect("row");
        assert_eq!(r.queue_duration_ms, Some(2.0));
        assert_eq!(r.prefill_duration_ms, Some(3.0));
        assert_eq!(r.decode_duration_ms, Some(1.0));
        assert_eq!(r.queue_source, PhaseSource::Engine);
        assert_eq!(r.ttft_ms, Some(5.0));
        assert_eq!(r.tpot_ms, Some(1.0));
        assert_eq!(r.total_duration_ms, 6.0);
        assert_eq!((r.input_tokens, r.output_tokens), (Some(5), Some(2)));
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
    }
}
