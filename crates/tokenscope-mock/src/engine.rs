//! The simulated engine: one task, a step loop, continuous batching with chunked prefill.
//!
//! See the crate docs for the model. This module knows nothing about HTTP: a handler submits a
//! [`Job`] and reads [`Event`]s from the returned channel.
//!
//! Phase accounting is the tokenscope SDK's (its own dog food): the engine task owns a
//! [`Tracker`]; a request arrives at its `queued_at`, is scheduled at the start of the step that
//! admits it, and every step is reported with [`Tracker::step_at`] (each running sequence's
//! prefill chunk or decode token); the [`Summary`] a handler receives carries the tracker's
//! [`Phases`], from which `timings` are computed. Times are nanoseconds since the engine's
//! epoch (the first submission), on tokio's clock, so virtual time keeps them exact in tests.

use crate::metrics::Stats;
use crate::MockConfig;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokenscope_sdk::{
    Clock, FinishReason, Phases, RequestHandle, RequestInfo, StepEntry, TraceContext, Tracker, Work,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Capacity of each request's event channel. A client that stops reading stalls only its own
/// sequence once this many events are buffered.
pub(crate) const EVENT_CHANNEL: usize = 64;

/// How far behind its ideal schedule the engine may fall and still catch up by skipping sleeps
/// (the timer has millisecond resolution, so sub-millisecond steps are paid in bursts).
const MAX_CATCH_UP: Duration = Duration::from_millis(5);

/// The timing parameters of the step loop, taken from [`MockConfig`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineParams {
    pub slots: usize,
    pub time_scale: f64,
    pub prefill_ms_per_token: f64,
    pub decode_base_ms: f64,
    pub decode_ms_per_seq: f64,
    pub max_prefill_tokens_per_step: u64,
    /// KV capacity in tokens, 0 = unlimited.
    pub kv_tokens: u64,
    pub decode_ms_per_kv_token: f64,
}

impl EngineParams {
    pub(crate) fn from_config(cfg: &MockConfig) -> Self {
        Self {
            slots: cfg.slots.max(1),
            time_scale: cfg.time_scale,
            prefill_ms_per_token: cfg.prefill_ms_per_token,
            decode_base_ms: cfg.decode_base_ms,
            decode_ms_per_seq: cfg.decode_ms_per_seq,
            max_prefill_tokens_per_step: (cfg.max_prefill_tokens_per_step as u64).max(1),
            kv_tokens: cfg.kv_tokens,
            decode_ms_per_kv_token: cfg.decode_ms_per_kv_token,
        }
    }

    /// Duration of one step, already scaled.
    fn step_duration(&self, batch: usize, prefill_tokens: u64, decode_kv_tokens: u64) -> Duration {
        let ms = self.decode_base_ms
            + self.decode_ms_per_seq * batch.saturating_sub(1) as f64
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_kv_token * decode_kv_tokens as f64;
        scaled(ms, self.time_scale)
    }
}

/// `ms × scale` as a duration; non-finite or negative values are zero, huge ones an hour.
pub(crate) fn scaled(ms: f64, scale: f64) -> Duration {
    let secs = ms * scale / 1000.0;
    if secs.is_finite() && secs > 0.0 {
        Duration::from_secs_f64(secs.min(3600.0))
    } else {
        Duration::ZERO
    }
}

/// What one request asks of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Job {
    /// Prompt tokens (prefill work; at least one token is always prefilled).
    pub prompt_tokens: u64,
    /// Exactly how many tokens to generate.
    pub output_tokens: u64,
}

/// Who a request is, for the SDK's records and spans.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    /// The response id (`chatcmpl-mock-N`), the span's `gen_ai.request.id`.
    pub request_id: Option<String>,
    /// Model name as requested.
    pub model: String,
    /// The `traceparent` the request came with.
    pub trace: Option<TraceContext>,
    /// Finish reason when it runs to completion.
    pub reason: FinishReason,
    /// Request type label (`chat`, `completion`).
    pub request_type: &'static str,
}

impl Default for Meta {
    fn default() -> Self {
        Self {
            request_id: None,
            model: "mock-llm".to_owned(),
            trace: None,
            reason: FinishReason::Stop,
            request_type: "unknown",
        }
    }
}

/// What the engine tells a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Event {
    /// One generated token, 0-based index within this request.
    Token { index: u64 },
    /// The request is complete; always the last event.
    Finished(Summary),
}

/// One request's own timeline, as the engine saw it, and its phases as the SDK tracker
/// computed them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Summary {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub queued_at: Instant,
    pub scheduled_at: Instant,
    pub first_token_at: Option<Instant>,
    pub last_token_at: Option<Instant>,
    pub finished_at: Instant,
    /// The tracker's phases (ns).
    pub phases: Phases,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl Summary {
    /// Queued → scheduled (the tracker's queue phase).
    #[cfg(test)]
    pub(crate) fn queue_ms(&self) -> f64 {
        ms(self.phases.queue_ns)
    }
    /// Scheduled → first token (→ finished when no token was generated): the tracker's prefill.
    pub(crate) fn prompt_ms(&self) -> f64 {
        ms(self.phases.prefill_ns)
    }
    /// First → last token: the tracker's decode (the mock finishes at its last token).
    pub(crate) fn predicted_ms(&self) -> f64 {
        ms(self.phases.decode_ns)
    }
    /// Queued → first token (→ finished when no token was generated).
    #[cfg(test)]
    pub(crate) fn ttft_ms(&self) -> f64 {
        ms(self.phases.ttft_ns().unwrap_or(self.phases.e2e_ns()))
    }
}

/// The engine is gone (its task ended); the request cannot run.
#[derive(Debug, thiserror::Error)]
#[error("the mock engine is not running")]
pub(crate) struct EngineGone;

struct Submission {
    job: Job,
    meta: Meta,
    queued_at: Instant,
    tx: mpsc::Sender<Event>,
}

/// Builds the SDK side of the engine when its task starts: the tracker's sink and exporters.
pub(crate) type TrackerFactory = Box<dyn FnOnce(Clock) -> Tracker + Send>;

/// Handle to the engine task. Cloning shares the same engine. The task starts on the first
/// submission and ends when every handle is dropped and no request is left.
#[derive(Clone)]
pub(crate) struct Engine {
    shared: Arc<Shared>,
}

struct Shared {
    tx: mpsc::UnboundedSender<Submission>,
    /// The receiver and the tracker factory, until the task is spawned.
    unstarted: Mutex<Option<(mpsc::UnboundedReceiver<Submission>, TrackerFactory)>>,
    params: EngineParams,
    stats: Arc<Stats>,
}

impl Engine {
    /// An engine whose tracker keeps no exporters.
    #[cfg(test)]
    pub(crate) fn new(params: EngineParams, stats: Arc<Stats>) -> Self {
        Self::with_tracker(
            params,
            stats,
            Box::new(|clock| Tracker::new(tokenscope_sdk::TrackerConfig::default(), clock)),
        )
    }

    /// An engine whose tracker is built by `tracker` when the task starts.
    pub(crate) fn with_tracker(
        params: EngineParams,
        stats: Arc<Stats>,
        tracker: TrackerFactory,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            shared: Arc::new(Shared {
                tx,
                unstarted: Mutex::new(Some((rx, tracker))),
                params,
                stats,
            }),
        }
    }

    /// [`Engine::submit_with`] with a default identity (no id, no trace).
    #[cfg(test)]
    pub(crate) fn submit(&self, job: Job) -> Result<mpsc::Receiver<Event>, EngineGone> {
        self.submit_with(job, Meta::default())
    }

    /// Queues `job` (who it is: `meta`); its events arrive on the returned receiver. Dropping
    /// the receiver aborts the request (its slot is freed at the start of the next step). Must
    /// be called inside a Tokio runtime (the first call spawns the engine task and builds its
    /// tracker).
    pub(crate) fn submit_with(
        &self,
        job: Job,
        meta: Meta,
    ) -> Result<mpsc::Receiver<Event>, EngineGone> {
        if let Some((rx, factory)) = self.shared.unstarted.lock().take() {
            // The epoch precedes every submission's `queued_at`.
            let epoch = Instant::now();
            let clock = Clock::with_origin(epoch.into_std(), std::time::SystemTime::now());
            let tracker = factory(clock);
            tokio::spawn(run(
                rx,
                self.shared.params,
                self.shared.stats.clone(),
                tracker,
                epoch,
            ));
        }
        let (tx, rx) = mpsc::channel(EVENT_CHANNEL);
        let stats = &self.shared.stats;
        stats.waiting.fetch_add(1, Ordering::Relaxed);
        let sub = Submission {
            job,
            meta,
            queued_at: Instant::now(),
            tx,
        };
        if self.shared.tx.send(sub).is_err() {
            stats.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(EngineGone);
        }
        Ok(rx)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// No work this step (prefill budget exhausted, or the client's channel is full).
    Idle,
    /// Prefill this many prompt tokens.
    Prefill(u64),
    /// Generate one token.
    Decode,
}

/// What a step did to one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Still running.
    Running,
    /// Generated everything: finish it.
    Done,
    /// Its client went away.
    Aborted,
}

/// A submission the engine has seen (it has a tracker handle).
struct Waiting {
    sub: Submission,
    h: RequestHandle,
}

/// A running sequence.
struct Seq {
    job: Job,
    reason: FinishReason,
    h: RequestHandle,
    tx: mpsc::Sender<Event>,
    queued_at: Instant,
    scheduled_at: Instant,
    /// Prompt tokens to prefill: `max(prompt_tokens, 1)`.
    prefill_total: u64,
    prefilled: u64,
    generated: u64,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    plan: Plan,
}

impl Seq {
    /// KV tokens this sequence holds: its whole prompt (reserved at admission) + generated.
    fn kv(&self) -> u64 {
        self.prefill_total + self.generated
    }

    fn admit(w: Waiting, now: Instant) -> Self {
        let sub = w.sub;
        Self {
            job: sub.job,
            reason: sub.meta.reason,
            h: w.h,
            tx: sub.tx,
            queued_at: sub.queued_at,
            scheduled_at: now,
            prefill_total: sub.job.prompt_tokens.max(1),
            prefilled: 0,
            generated: 0,
            first_token_at: None,
            last_token_at: None,
            plan: Plan::Idle,
        }
    }

    /// Applies this step's plan at `now`: the work the tracker is told about (`None` when the
    /// sequence was idle) and what became of the sequence.
    fn finish_step(&mut self, now: Instant, stats: &Stats) -> (Option<Work>, Fate) {
        let (emits, chunk) = match std::mem::replace(&mut self.plan, Plan::Idle) {
            Plan::Idle => return (None, Fate::Running),
            Plan::Prefill(chunk) => {
                self.prefilled += chunk;
                let done = self.prefilled >= self.prefill_total;
                if done {
                    stats
                        .prompt_tokens
                        .fetch_add(self.job.prompt_tokens, Ordering::Relaxed);
                }
                (done, Some(u32::try_from(chunk).unwrap_or(u32::MAX)))
            }
            Plan::Decode => (true, None),
        };
        let mut emitted = false;
        let mut fate = Fate::Running;
        if emits && self.generated < self.job.output_tokens {
            // Planning checked the capacity and only this task sends, so this cannot be `Full`;
            // an error means the receiver is gone.
            if self
                .tx
                .try_send(Event::Token {
                    index: self.generated,
                })
                .is_err()
            {
                fate = Fate::Aborted;
            } else {
                emitted = true;
                self.generated += 1;
                stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                self.first_token_at.get_or_insert(now);
                self.last_token_at = Some(now);
            }
        }
        if fate == Fate::Running && emits && self.generated >= self.job.output_tokens {
            fate = Fate::Done;
        }
        let work = match chunk {
            Some(tokens) => Work::Prefill {
                tokens,
                sampled: emitted,
            },
            None => Work::Decode {
                tokens: u32::from(emitted),
            },
        };
        (Some(work), fate)
    }

    fn summary(&self, finished_at: Instant, phases: Phases) -> Summary {
        Summary {
            prompt_tokens: self.job.prompt_tokens,
            completion_tokens: self.generated,
            queued_at: self.queued_at,
            scheduled_at: self.scheduled_at,
            first_token_at: self.first_token_at,
            last_token_at: self.last_token_at,
            finished_at,
            phases,
        }
    }
}

/// The step loop. Ends when every [`Engine`] handle is gone and nothing is waiting or running.
async fn run(
    mut rx: mpsc::UnboundedReceiver<Submission>,
    p: EngineParams,
    stats: Arc<Stats>,
    mut tracker: Tracker,
    epoch: Instant,
) {
    let ns = |t: Instant| {
        tokenscope_sdk::Nanos::try_from(t.duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
    };
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut entries: Vec<StepEntry> = Vec::new();
    let mut ended: Vec<(Seq, Fate)> = Vec::new();
    // Where the step loop would be with a perfect timer.
    let mut ideal = Instant::now();
    let arrive = |tracker: &mut Tracker, sub: Submission| {
        let model = tracker.model(&sub.meta.model);
        let mut info = RequestInfo::new(model, sub.job.prompt_tokens)
            .trace(sub.meta.trace)
            .request_type(sub.meta.request_type);
        info.request_id = sub.meta.request_id.clone();
        let h = tracker.arrive_at(ns(sub.queued_at), info);
        Waiting { sub, h }
    };
    loop {
        if waiting.is_empty() && running.is_empty() {
            // Idle: ship what the tracker holds before waiting.
            tracker.flush_at(ns(Instant::now()));
            match rx.recv().await {
                Some(sub) => {
                    let w = arrive(&mut tracker, sub);
                    waiting.push_back(w);
                }
                None => return,
            }
            ideal = Instant::now();
        }
        while let Ok(sub) = rx.try_recv() {
            let w = arrive(&mut tracker, sub);
            waiting.push_back(w);
        }

        // Drop requests whose client went away.
        let now = ns(Instant::now());
        waiting.retain(|w| {
            let alive = !w.sub.tx.is_closed();
            if !alive {
                stats.waiting.fetch_sub(1, Ordering::Relaxed);
                stats.aborted.fetch_add(1, Ordering::Relaxed);
                tracker.abort_at(w.h, now);
            }
            alive
        });
        running.retain(|s| {
            let alive = !s.tx.is_closed();
            if !alive {
                stats.aborted.fetch_add(1, Ordering::Relaxed);
                tracker.abort_at(s.h, now);
            }
            alive
        });

        // Admit in FIFO order.
        let step_start = Instant::now();
        let start_ns = ns(step_start);
        let mut kv_used: u64 = running.iter().map(Seq::kv).sum();
        while running.len() < p.slots {
            let Some(next) = waiting.front() else {
                break;
            };
            let need = next.sub.job.prompt_tokens.max(1);
            if p.kv_tokens > 0 && !running.is_empty() && kv_used + need > p.kv_tokens {
                break;
            }
            let Some(w) = waiting.pop_front() else {
                break;
            };
            kv_used += need;
            stats.waiting.fetch_sub(1, Ordering::Relaxed);
            tracker.schedule_at(w.h, start_ns);
            running.push(Seq::admit(w, step_start));
        }
        stats.running.store(running.len(), Ordering::Relaxed);
        stats.kv_used.store(kv_used, Ordering::Relaxed);
        if running.is_empty() {
            continue;
        }

        // Plan: prefill chunks share the budget in admission order; decoders get one token.
        let mut budget = p.max_prefill_tokens_per_step;
        let mut prefill_tokens = 0u64;
        let mut batch = 0usize;
        let mut decode_kv = 0u64;
        for s in &mut running {
            // Room for a token and the final event.
            let room = s.tx.capacity() >= 2;
            let remaining = s.prefill_total - s.prefilled;
            s.plan = if remaining > 0 {
                let chunk = remaining.min(budget);
                if chunk == 0 || (chunk == remaining && !room) {
                    Plan::Idle
                } else {
                    budget -= chunk;
                    prefill_tokens += chunk;
                    Plan::Prefill(chunk)
                }
            } else if room {
                decode_kv += s.kv();
                Plan::Decode
            } else {
                Plan::Idle
            };
            if s.plan != Plan::Idle {
                batch += 1;
            }
        }

        // Run the step.
        let floor = step_start.checked_sub(MAX_CATCH_UP).unwrap_or(step_start);
        ideal = ideal.max(floor) + p.step_duration(batch, prefill_tokens, decode_kv);
        if ideal > Instant::now() {
            tokio::time::sleep_until(ideal).await;
        } else {
            tokio::task::yield_now().await;
        }
        let now = Instant::now();
        let end_ns = ns(now);

        // Apply the step; tell the tracker what each sequence did in it.
        entries.clear();
        let mut i = 0;
        while i < running.len() {
            let (work, fate) = running[i].finish_step(now, &stats);
            if let Some(work) = work {
                entries.push(StepEntry::new(running[i].h, work));
            }
            if fate == Fate::Running {
                i += 1;
            } else {
                // Keep admission order for the next plan.
                ended.push((running.remove(i), fate));
            }
        }
        tracker.step_at(start_ns, end_ns, &entries);
        for (s, fate) in ended.drain(..) {
            if fate == Fate::Aborted {
                stats.aborted.fetch_add(1, Ordering::Relaxed);
                tracker.abort_at(s.h, end_ns);
                continue;
            }
            let Some(phases) = tracker.finish_at(s.h, end_ns, s.reason) else {
                continue;
            };
            let counter = match s.tx.try_send(Event::Finished(s.summary(now, phases))) {
                Ok(()) => &stats.finished,
                Err(_) => &stats.aborted,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        tracker.tick_at(end_ns);
        stats.running.store(running.len(), Ordering::Relaxed);
        stats
            .kv_used
            .store(running.iter().map(Seq::kv).sum(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Integral-millisecond parameters so that virtual time gives exact values:
    /// 512 prompt tokens cost 4 ms; a step is 8 ms + 1 ms per extra sequence.
    fn params(slots: usize) -> EngineParams {
        EngineParams {
            slots,
            time_scale: 1.0,
            prefill_ms_per_token: 1.0 / 128.0,
            decode_base_ms: 8.0,
            decode_ms_per_seq: 1.0,
            max_prefill_tokens_per_step: 512,
            kv_tokens: 0,
            decode_ms_per_kv_token: 0.0,
        }
    }

    fn engine(slots: usize) -> (Engine, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        (Engine::new(params(slots), stats.clone()), stats)
    }

    fn job(prompt_tokens: u64, output_tokens: u64) -> Job {
        Job {
            prompt_tokens,
            output_tokens,
        }
    }

    /// Reads a request to its end: token indices and the summary.
    async fn collect(mut rx: mpsc::Receiver<Event>) -> (Vec<u64>, Summary) {
        let mut tokens = Vec::new();
        loop {
            match rx.recv().await.expect("engine ended the request early") {
                Event::Token { index } => tokens.push(index),
                Event::Finished(s) => return (tokens, s),
            }
        }
    }

    async fn run_all(engine: &Engine, jobs: &[Job]) -> Vec<(Vec<u64>, Summary)> {
        let rxs: Vec<_> = jobs
            .iter()
            .map(|j| engine.submit(*j).expect("engine running"))
            .collect();
        let mut out = Vec::new();
        for rx in rxs {
            out.push(collect(rx).await);
        }
        out
    }

    fn assert_ordered(s: &Summary) {
        assert!(s.queued_at <= s.scheduled_at);
        if let (Some(f), Some(l)) = (s.first_token_at, s.last_token_at) {
            assert!(s.scheduled_at <= f && f <= l && l <= s.finished_at);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn single_request_phases() {
        let (e, stats) = engine(8);
        let r = run_all(&e, &[job(128, 10)]).await;
        let (tokens, s) = &r[0];
        assert_eq!(tokens, &(0..10).collect::<Vec<_>>());
        assert_ordered(s);
        assert_eq!(s.completion_tokens, 10);
        assert_eq!(s.queue_ms(), 0.0);
        // One step: 8 ms + 128 × 1/128 ms; it also yields the first token.
        assert_eq!(s.prompt_ms(), 9.0);
        // Nine more decode steps alone.
        assert_eq!(s.predicted_ms(), 72.0);
        assert_eq!(s.last_token_at, Some(s.finished_at));
        assert_eq!(stats.prompt_tokens.load(Ordering::Relaxed), 128);
        assert_eq!(stats.generated_tokens.load(Ordering::Relaxed), 10);
        assert_eq!(stats.finished.load(Ordering::Relaxed), 1);
        assert_eq!(stats.running.load(Ordering::Relaxed), 0);
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn long_prompt_inflates_short_ttft() {
        let (e, _) = engine(8);
        let alone = run_all(&e, &[job(10, 5)]).await[0].1;
        let (e, _) = engine(8);
        // The long prompt is first in FIFO order and takes the whole prefill budget for 4 steps
        // (4 × (8 + 4) ms) before the short one gets its chunk.
        let r = run_all(&e, &[job(2048, 5), job(10, 5)]).await;
        let beside = r[1].1;
        assert_ordered(&beside);
        assert!(alone.ttft_ms() < 10.0, "alone {}", alone.ttft_ms());
        assert!(
            beside.ttft_ms() >= alone.ttft_ms() + 40.0,
            "beside {} alone {}",
            beside.ttft_ms(),
            alone.ttft_ms()
        );
        // Admitted at once (slots are free): the delay is prefill, not queueing.
        assert_eq!(beside.queue_ms(), 0.0);
        assert!(beside.prompt_ms() >= 48.0);
    }

    #[tokio::test(start_paused = true)]
    async fn queues_beyond_slots() {
        let (e, stats) = engine(2);
        let rxs: Vec<_> = (0..4)
            .map(|_| e.submit(job(128, 5)).expect("engine running"))
            .collect();
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 4);
        // Let the engine admit and run its first step.
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(stats.running.load(Ordering::Relaxed), 2);
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 2);
        let mut done = Vec::new();
        for rx in rxs {
            done.push(collect(rx).await.1);
        }
        // First two: step 1 = 8 + 1 + 2 (256 prompt tokens) = 11 ms, then 4 decode steps of 9.
        for s in &done[..2] {
            assert_eq!(s.queue_ms(), 0.0);
            assert_eq!(s.prompt_ms(), 11.0);
            assert_eq!(s.predicted_ms(), 36.0);
        }
        // The other two wait for those to finish at 47 ms, then run the same way.
        for s in &done[2..] {
            assert_ordered(s);
            assert_eq!(s.queue_ms(), 47.0);
            assert_eq!(s.prompt_ms(), 11.0);
        }
        assert_eq!(stats.running.load(Ordering::Relaxed), 0);
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn decode_slows_with_batch_size() {
        let (e, _) = engine(8);
        let alone = run_all(&e, &[job(64, 11)]).await[0].1;
        assert_eq!(alone.predicted_ms(), 10.0 * 8.0);
        let (e, _) = engine(8);
        // 8 × 64 = 512 prompt tokens fit in one step; then decode steps of 8 + 7 ms.
        let crowd = run_all(&e, &[job(64, 11); 8]).await;
        for (_, s) in &crowd {
            assert_eq!(s.prompt_ms(), 8.0 + 7.0 + 4.0);
            assert_eq!(s.predicted_ms(), 10.0 * 15.0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn zero_output_tokens_finishes_after_prefill() {
        let (e, _) = engine(1);
        let (tokens, s) = &run_all(&e, &[job(0, 0)]).await[0];
        assert!(tokens.is_empty());
        assert_eq!(s.completion_tokens, 0);
        assert_eq!(s.first_token_at, None);
        assert_eq!(s.predicted_ms(), 0.0);
        assert!(s.prompt_ms() > 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_receiver_frees_the_slot() {
        let (e, stats) = engine(1);
        let mut first = e.submit(job(8, 1000)).expect("engine running");
        let second = e.submit(job(8, 3)).expect("engine running");
        assert!(matches!(
            first.recv().await,
            Some(Event::Token { index: 0 })
        ));
        assert_eq!(stats.running.load(Ordering::Relaxed), 1);
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 1);
        drop(first);
        let (tokens, s) = collect(second).await;
        assert_eq!(tokens.len(), 3);
        // Scheduled within a step or two of the abort, not after 1000 tokens.
        assert!(s.queue_ms() < 30.0, "queue {}", s.queue_ms());
        assert_eq!(stats.aborted.load(Ordering::Relaxed), 1);
        assert_eq!(stats.running.load(Ordering::Relaxed), 0);
    }

    fn kv_engine(slots: usize, kv_tokens: u64, per_kv: f64) -> (Engine, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        let p = EngineParams {
            kv_tokens,
            decode_ms_per_kv_token: per_kv,
            ..params(slots)
        };
        (Engine::new(p, stats.clone()), stats)
    }

    #[tokio::test(start_paused = true)]
    async fn kv_capacity_limits_the_batch() {
        // Room for one 600-token prompt at a time: requests run one by one despite 8 slots.
        let (e, stats) = kv_engine(8, 1000, 0.0);
        let rxs: Vec<_> = (0..3)
            .map(|_| e.submit(job(600, 4)).expect("engine running"))
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(stats.running.load(Ordering::Relaxed), 1);
        assert_eq!(stats.waiting.load(Ordering::Relaxed), 2);
        assert_eq!(stats.kv_used.load(Ordering::Relaxed), 600);
        let mut done = Vec::new();
        for rx in rxs {
            done.push(collect(rx).await.1);
        }
        // Each: prefill 512 + 88 tokens in 2 steps (12 + 8.6875 ms), 3 decode steps of 8 ms.
        let one = 12.0 + 8.0 + 88.0 / 128.0 + 24.0;
        // (The timer has millisecond resolution: within 1 ms.)
        assert_eq!(done[0].queue_ms(), 0.0);
        assert!(
            (done[1].queue_ms() - one).abs() <= 1.0,
            "{}",
            done[1].queue_ms()
        );
        assert!(
            (done[2].queue_ms() - 2.0 * one).abs() <= 1.0,
            "{}",
            done[2].queue_ms()
        );
        assert_eq!(stats.kv_used.load(Ordering::Relaxed), 0);
        // Without the KV model they all run at once.
        let (e, _) = engine(8);
        let free = run_all(&e, &[job(600, 4); 3]).await;
        assert!(free.iter().all(|(_, s)| s.queue_ms() == 0.0));
    }

    #[tokio::test(start_paused = true)]
    async fn prompt_larger_than_the_cache_runs_alone() {
        let (e, _) = kv_engine(4, 100, 0.0);
        let r = run_all(&e, &[job(500, 2), job(10, 2)]).await;
        assert_eq!(r[0].0.len(), 2);
        assert_eq!(r[1].0.len(), 2);
        assert!(r[1].1.queue_ms() > 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn decode_cost_grows_with_resident_kv() {
        // 1/128 ms per KV token: a decode step of a 1023-token prompt after its first token
        // holds 1024 tokens → 8 + 8 ms, the next 1025 → 8 + 8.0078 ms.
        let (e, _) = kv_engine(8, 0, 1.0 / 128.0);
        let (_, s) = run_all(&e, &[job(1023, 3)]).await[0];
        let want = 2.0 * 8.0 + (1024.0 + 1025.0) / 128.0;
        // (The timer has millisecond resolution: within 1 ms.)
        assert!(
            (s.predicted_ms() - want).abs() <= 1.0,
            "{}",
            s.predicted_ms()
        );
        assert!(s.predicted_ms() >= 31.0);
        // The default (no per-KV cost) is unchanged: 2 decode steps of 8 ms.
        let (e, _) = engine(8);
        let (_, s) = run_all(&e, &[job(1023, 3)]).await[0];
        assert_eq!(s.predicted_ms(), 16.0);
    }

    #[tokio::test(start_paused = true)]
    async fn slow_reader_stalls_only_itself() {
        let (e, stats) = engine(2);
        let slow = e.submit(job(8, 200)).expect("engine running");
        let fast = collect(e.submit(job(8, 100)).expect("engine running")).await;
        assert_eq!(fast.0.len(), 100);
        // The slow one filled its channel and waits, still holding its slot.
        assert_eq!(stats.running.load(Ordering::Relaxed), 1);
        let (tokens, s) = collect(slow).await;
        assert_eq!(tokens, (0..200).collect::<Vec<_>>());
        assert_eq!(s.completion_tokens, 200);
    }
}
