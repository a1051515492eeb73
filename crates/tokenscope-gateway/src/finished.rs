//! After a record is final: [`Fanout`], the one owner of everything a finished record feeds.
//!
//! In order, exactly once per record ([`Fanout::finish`]): cost, budget usage, tail-sampling
//! decision (a kept trace's id becomes the histograms' exemplar and a dashboard link),
//! Prometheus metrics, span export of a kept trace, the recent-records ring, alerting samples,
//! and the store pipeline (`try_send`).
//!
//! Invariants:
//! * Nothing here blocks or awaits I/O on the request path: metrics are in memory, the ring is a
//!   short lock, spans and records go to bounded queues.
//! * A record whose entry tokenizer count (or cancelled-stream output count) is still running
//!   is finished by a task tracked in [`Fanout::finishing`], with a 5 s deadline per count;
//!   shutdown waits for those tasks before it drains the store pipeline.
//! * The entry tokenizer count replaces only an estimate; it never replaces usage or an
//!   engine's count (a disagreement beyond `token_mismatch_tolerance` is counted).
//! * Late engine data ([`Fanout::apply_engine_update`]) is joined in the ring and handed to the
//!   store; a phase first known late is observed in the phase histogram then (once).

use crate::recording::RecordOut;
use http::Uri;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokenscope_core::{InputBucket, Outcome, PhaseUpdate, RequestRecord, TokenSource};
use tokenscope_store::Recorder;
use tokenscope_telemetry::{InFlightGuard, Metrics};

/// The result of the entry tokenizer count, delivered by the task that computes it.
pub(crate) type EntryCount =
    tokio::sync::oneshot::Receiver<Option<Result<u64, tokenscope_tokenize::TokenizeError>>>;

/// How long finishing a record waits for each tokenizer count.
const COUNT_DEADLINE: Duration = Duration::from_secs(5);

/// The trace side of the gateway: decisions on the request path, export on its own task.
pub(crate) struct Tracing {
    pub sampler: tokenscope_trace::TailSampler,
    pub exporter: Arc<tokenscope_trace::TraceExporter>,
}

/// What the trace of a finished request needs besides its record.
#[derive(Debug, Clone)]
pub(crate) struct TraceFacts {
    pub trace: tokenscope_trace::RequestTrace,
    pub times: tokenscope_trace::SpanTimes,
    /// The engine's response id (`gen_ai.response.id`), not a column of the record.
    pub response_id: Option<String>,
}

/// What finishing a record may still wait for (see the module docs).
pub(crate) struct Counts {
    /// The entry count with the model's own tokenizer, if one was started.
    pub entry: Option<EntryCount>,
    /// The streamed output text kept for counting a cancelled stream.
    pub output_text: Option<String>,
}

/// Everything a finished record feeds. See the module docs.
pub(crate) struct Fanout {
    pub metrics: Arc<Metrics>,
    /// `cost_usd` of finished records (`[[prices]]`).
    pub cost: crate::cost::CostMeter,
    /// Usage of the current budget periods (`llm_budget_usage_ratio`).
    pub budgets: Arc<crate::cost::BudgetTracker>,
    /// Tail sampling and OTLP export (`[tracing]` with an endpoint), else `None`.
    pub tracing: Option<Tracing>,
    /// Trace ids the tail sampler kept recently (the dashboard's trace links).
    pub kept_traces: crate::dashboard::KeptTraces,
    /// The last `recent_records` finished records (dashboard, late engine updates).
    pub recent: Mutex<VecDeque<Arc<RequestRecord>>>,
    /// Size of [`Self::recent`] (0 = none kept).
    pub recent_cap: usize,
    /// The gateway's own alerting (`[alerts] webhook_url`): a bounded sample buffer.
    pub alerting: crate::alerting::Alerting,
    /// The store pipeline.
    pub out: Arc<dyn RecordOut>,
    /// The store pipeline's handle for late engine updates.
    pub recorder: Recorder,
    /// Each upstream's name and first replica's base URL (the spans' `server.address` /
    /// `server.port` when a record names no replica).
    pub servers: Vec<(String, Uri)>,
    /// Counts tokens of entries and of cancelled streams' output.
    pub tokenizers: tokenscope_tokenize::Tokenizers,
    /// Relative difference between the engine's and the tokenizer's input count counted as a
    /// mismatch.
    pub mismatch_tolerance: f64,
    /// Records whose finishing waits for a tokenizer count; shutdown waits for them before it
    /// drains the store pipeline.
    pub finishing: tokio_util::task::TaskTracker,
    /// Set when the shutdown grace period is over: requests cut from then on are recorded as
    /// `shutdown`, not `cancelled`.
    shutting_down: AtomicBool,
}

/// `host:port` (`[v6]:port`) → the spans' `server.address` and `server.port`.
fn replica_address(replica: &str) -> Option<(&str, u16)> {
    let (host, port) = replica.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then_some(())?;
    Some((host, port.parse().ok()?))
}

impl Fanout {
    /// A fan-out whose optional parts are off: no tracing, no kept traces yet, an empty ring.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        cost: crate::cost::CostMeter,
        budgets: Arc<crate::cost::BudgetTracker>,
        tracing: Option<Tracing>,
        recent_cap: usize,
        alerting: crate::alerting::Alerting,
        recorder: Recorder,
        servers: Vec<(String, Uri)>,
        tokenizers: tokenscope_tokenize::Tokenizers,
        mismatch_tolerance: f64,
    ) -> Self {
        Fanout {
            metrics,
            cost,
            budgets,
            tracing,
            kept_traces: crate::dashboard::KeptTraces::default(),
            recent: Mutex::new(VecDeque::new()),
            recent_cap,
            alerting,
            out: Arc::new(recorder.clone()),
            recorder,
            servers,
            tokenizers,
            mismatch_tolerance,
            finishing: tokio_util::task::TaskTracker::new(),
            shutting_down: AtomicBool::new(false),
        }
    }

    /// Whether trace export is on.
    pub(crate) fn tracing_on(&self) -> bool {
        self.tracing.is_some()
    }

    /// Counts a request in `llm_requests_in_flight` until the guard drops.
    pub(crate) fn start_request(&self, model: &str) -> InFlightGuard {
        self.metrics.start_request(model)
    }

    /// The shutdown grace period is over: requests cut from now on are `shutdown`.
    pub(crate) fn begin_cut(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Whether the shutdown grace period is over.
    pub(crate) fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// Finishes `rec` now, or — when a tokenizer count is still running — in a tracked task
    /// once it arrives (each count within [`COUNT_DEADLINE`]).
    pub(crate) fn complete(
        self: &Arc<Self>,
        mut rec: RequestRecord,
        trace: TraceFacts,
        counts: Counts,
    ) {
        let mut entry = counts.entry;
        if let Some(rx) = entry.as_mut() {
            match rx.try_recv() {
                Ok(res) => {
                    self.apply_entry_count(&mut rec, res);
                    entry = None;
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => entry = None,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
            }
        }
        let count_output = (matches!(rec.outcome, Outcome::Cancelled | Outcome::Shutdown)
            && rec.output_tokens_source == TokenSource::Chunks)
            .then_some(counts.output_text)
            .flatten()
            .filter(|t| !t.is_empty() && self.tokenizers.has(&rec.model));
        if entry.is_none() && count_output.is_none() {
            self.finish(rec, trace);
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.finish(rec, trace);
            return;
        };
        let this = self.clone();
        self.finishing.spawn_on(
            async move {
                if let Some(rx) = entry {
                    if let Ok(Ok(res)) = tokio::time::timeout(COUNT_DEADLINE, rx).await {
                        this.apply_entry_count(&mut rec, res);
                    }
                }
                if let Some(text) = count_output {
                    let counted = tokio::time::timeout(
                        COUNT_DEADLINE,
                        this.tokenizers.count_text(&rec.model, &text),
                    )
                    .await;
                    if let Ok(Some(Ok(n))) = counted {
                        rec.output_tokens = Some(n);
                        rec.output_tokens_source = TokenSource::Tokenizer;
                    }
                }
                this.finish(rec, trace);
            },
            &rt,
        );
    }

    /// Puts the entry tokenizer count on the record: kept as `input_tokens_entry`; it becomes
    /// the input count when the engine gave none; a disagreement with the engine's count beyond
    /// the tolerance is counted in `llm_token_count_mismatch_total`.
    fn apply_entry_count(
        &self,
        rec: &mut RequestRecord,
        res: Option<Result<u64, tokenscope_tokenize::TokenizeError>>,
    ) {
        let n = match res {
            Some(Ok(n)) => n,
            Some(Err(e)) => {
                tracing::debug!(model = %rec.model, error = %e, "Entry token count failed.");
                return;
            }
            None => return,
        };
        rec.input_tokens_entry = Some(n);
        match rec.input_tokens_source {
            TokenSource::Usage | TokenSource::Engine => {
                let engine = rec.input_tokens.unwrap_or(0) as f64;
                let diff = (engine - n as f64).abs();
                if diff > self.mismatch_tolerance * engine.max(1.0) {
                    self.metrics.token_count_mismatch(&rec.model);
                }
            }
            _ => {
                rec.input_tokens = Some(n);
                rec.input_tokens_source = TokenSource::Tokenizer;
                rec.input_bucket = Some(InputBucket::of(n));
            }
        }
    }

    /// Feeds a final record to everything (see the module docs). Called exactly once per
    /// record.
    fn finish(&self, mut rec: RequestRecord, trace: TraceFacts) {
        rec.cost_usd = self.cost.cost(&rec, std::time::Instant::now());
        self.budgets.add(&rec);
        // Tail sampling first: a kept trace's id becomes the histograms' exemplar.
        let decision = self.tracing.as_ref().map(|t| {
            let model_label = self.metrics.model_label(&rec.model);
            let d = t.sampler.decide(&rec, &model_label, &trace.trace.trace_id);
            self.metrics.trace_decision(d.kept().map(|r| r.as_str()));
            d
        });
        let kept = decision.and_then(tokenscope_trace::Decision::kept);
        if decision.is_some() {
            self.kept_traces
                .decided(rec.created_at, &rec.trace_id, kept.is_some());
        }
        let user_bucket = self
            .metrics
            .observe(&rec, kept.map(|_| rec.trace_id.as_str()));
        if let (Some(t), Some(reason)) = (self.tracing.as_ref(), kept) {
            // The replica that served the request (`host:port`), else the upstream's first.
            let server = replica_address(&rec.replica).or_else(|| {
                self.servers
                    .iter()
                    .find(|(name, _)| *name == rec.upstream)
                    .and_then(|(_, base)| Some((base.host()?, base.port_u16().unwrap_or(80))))
            });
            let spans = tokenscope_trace::build_spans(
                &rec,
                &tokenscope_trace::SpanInput {
                    trace: &trace.trace,
                    times: trace.times,
                    user_bucket: &user_bucket,
                    server,
                    reason,
                    response_id: trace.response_id.as_deref(),
                },
            );
            t.exporter.submit(spans);
        }
        if self.recent_cap > 0 {
            let mut recent = self.recent.lock();
            if recent.len() >= self.recent_cap {
                recent.pop_front();
            }
            recent.push_back(Arc::new(rec.clone()));
        }
        self.alerting
            .push(&rec, || self.metrics.model_label(&rec.model));
        self.out.submit(rec);
    }

    /// Late engine data (OTLP spans) for a record: joined in the recent-records ring and sent
    /// to the store, which applies it to the row (now or when the row arrives).
    /// A phase the record did not have when it was final is observed in
    /// `llm_request_phase_seconds` now (a phase is observed once per request).
    pub(crate) fn apply_engine_update(&self, update: PhaseUpdate) {
        let mut late: Vec<(String, &'static str, f64)> = Vec::new();
        {
            let mut recent = self.recent.lock();
            if let Some(slot) = recent
                .iter_mut()
                .rev()
                .find(|r| r.trace_id == update.trace_id)
            {
                for (phase, had, new) in [
                    ("queue", slot.queue_duration_ms, update.queue_duration_ms),
                    (
                        "prefill",
                        slot.prefill_duration_ms,
                        update.prefill_duration_ms,
                    ),
                    ("decode", slot.decode_duration_ms, update.decode_duration_ms),
                ] {
                    if let (None, Some(ms)) = (had, new) {
                        late.push((slot.model.clone(), phase, ms));
                    }
                }
                let mut rec = (**slot).clone();
                rec.apply_update(&update);
                *slot = Arc::new(rec);
            }
        }
        for (model, phase, ms) in late {
            self.metrics.observe_phase(&model, phase, ms);
        }
        self.recorder.update(update);
    }
}

impl RecordOut for Recorder {
    fn submit(&self, rec: RequestRecord) {
        self.record(rec);
    }
}

#[cfg(test)]
mod tests {
    use super::replica_address;

    #[test]
    fn replica_addresses_for_spans() {
        assert_eq!(replica_address("10.0.0.7:8000"), Some(("10.0.0.7", 8000)));
        assert_eq!(replica_address("[::1]:9"), Some(("::1", 9)));
        assert_eq!(replica_address(""), None);
        assert_eq!(replica_address("host"), None);
        assert_eq!(replica_address(":80"), None);
    }
}
