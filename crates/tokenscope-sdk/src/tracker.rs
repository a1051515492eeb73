//! The engine-thread tracker: every request's state, phases accumulated as the state changes.
//!
//! Invariants (see the crate docs for the phase definitions):
//! * Each live request has one [`State`] and `since`, the time it entered it. A transition at
//!   `t` adds `t − since` to the phase of the *old* state and sets `since = t`; `t` is first
//!   clamped to `≥ since`. Hence `queue + prefill + decode = last event − arrival` at all times,
//!   and `= finish − arrival` once finished, in exact integer nanoseconds.
//! * Per token: no lock, no atomic, no allocation (unless the request is sampled for per-token
//!   detail), no clock read. Per flush: one `Vec` swap and one `try_send`.
//! * Handles carry a generation: a stale handle (finished request, reused slot) never touches
//!   another request; such events are counted in [`Tracker::stale_events`].

use crate::clock::{Clock, Nanos};
use crate::pipeline::{Batch, Sink, TokenDelta};
use crate::trace_context::TraceContext;
use std::sync::Arc;
use std::time::Duration;

/// Tracker settings.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    /// Flush aggregates and finished requests at least this often (checked on every event
    /// and [`Tracker::tick_at`]). Default 100 ms.
    pub flush_interval: Duration,
    /// … or after this many token events, whichever comes first. Default 100.
    pub flush_tokens: u32,
    /// Keep every token's timestamp for one request in `N` ([`FinishedRequest::token_times_ns`]);
    /// 0 = never (the default). Sampled requests allocate per token.
    pub token_detail_every: u32,
    /// Distinct model names kept; later ones share the id of `other` (bounds memory and label
    /// cardinality when model names come from clients). Default 64.
    pub max_models: usize,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            flush_interval: Duration::from_millis(100),
            flush_tokens: 100,
            token_detail_every: 0,
            max_models: 64,
        }
    }
}

/// A model registered with [`Tracker::model`] (an index into the tracker's model table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelId(u32);

/// A request tracked by a [`Tracker`]. Cheap to copy; invalid once the request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestHandle {
    index: u32,
    generation: u32,
}

/// Where a request is. See the crate docs for the phase each state counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Arrived or queued, never scheduled yet (queue).
    Waiting,
    /// Scheduled, no token since (prefill): prefill chunks, the gaps between them, recompute
    /// after a preemption.
    Prefill,
    /// After a token (decode).
    Decode,
    /// Preempted, waiting to be scheduled again (queue).
    Preempted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Queue,
    Prefill,
    Decode,
}

impl State {
    fn phase(self) -> Phase {
        match self {
            State::Waiting | State::Preempted => Phase::Queue,
            State::Prefill => Phase::Prefill,
            State::Decode => Phase::Decode,
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token or stop string (`"stop"`).
    Stop,
    /// The output limit (`"length"`).
    Length,
    /// Aborted: the client went away or the engine cancelled it (`"abort"`).
    Abort,
    /// The engine failed the request (`"error"`).
    Error,
}

impl FinishReason {
    /// `stop`, `length`, `abort`, `error` (vLLM's finish reason names).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    /// The gateway's outcome for this reason (`ok`, `cancelled`, `upstream_error`).
    pub fn outcome(self) -> tokenscope_core::Outcome {
        match self {
            FinishReason::Stop | FinishReason::Length => tokenscope_core::Outcome::Ok,
            FinishReason::Abort => tokenscope_core::Outcome::Cancelled,
            FinishReason::Error => tokenscope_core::Outcome::UpstreamError,
        }
    }
}

/// What a new request is.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    /// Its model ([`Tracker::model`]).
    pub model: ModelId,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The engine's request id (`gen_ai.request.id`).
    pub request_id: Option<String>,
    /// The trace it belongs to (from the `traceparent` it arrived with).
    pub trace: Option<TraceContext>,
    /// Request type label (the gateway's `request_type`: `chat`, `completion`, …).
    /// Default `"unknown"`.
    pub request_type: &'static str,
}

impl RequestInfo {
    /// A request of `model` with `prompt_tokens`, no id, no trace.
    pub fn new(model: ModelId, prompt_tokens: u64) -> Self {
        Self {
            model,
            prompt_tokens,
            request_id: None,
            trace: None,
            request_type: "unknown",
        }
    }

    /// With the engine's request id.
    pub fn request_id(mut self, id: impl Into<String>) -> Self {
        self.request_id = Some(id.into());
        self
    }

    /// With a trace context (`None` keeps it untraced).
    pub fn trace(mut self, trace: Option<TraceContext>) -> Self {
        self.trace = trace;
        self
    }

    /// With a request type label.
    pub fn request_type(mut self, request_type: &'static str) -> Self {
        self.request_type = request_type;
        self
    }
}

/// The work one request did in one engine step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// A prefill (or recompute) chunk of `tokens`; `sampled`: the chunk completed the prefill
    /// and the engine sampled a token from it (the token is emitted at the step's end).
    Prefill {
        /// Tokens in the chunk.
        tokens: u32,
        /// A token was sampled at the end of the chunk.
        sampled: bool,
    },
    /// `tokens` generated tokens (1; more with speculative decoding), emitted at the step's end.
    Decode {
        /// Tokens emitted.
        tokens: u32,
    },
}

impl Work {
    /// A prefill chunk that does not complete the prompt.
    pub fn prefill(tokens: u32) -> Self {
        Work::Prefill {
            tokens,
            sampled: false,
        }
    }

    /// The last prefill chunk: a token is sampled at the step's end.
    pub fn prefill_last(tokens: u32) -> Self {
        Work::Prefill {
            tokens,
            sampled: true,
        }
    }

    /// One decoded token.
    pub fn decode() -> Self {
        Work::Decode { tokens: 1 }
    }
}

/// One request's part in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEntry {
    /// The request.
    pub request: RequestHandle,
    /// What it did.
    pub work: Work,
}

impl StepEntry {
    /// `request` did `work`.
    pub fn new(request: RequestHandle, work: Work) -> Self {
        Self { request, work }
    }
}

/// A finished (or aborted) request: its timeline and phases, in nanoseconds of the tracker's
/// clock. `queue_ns + prefill_ns + decode_ns == e2e_ns()` always.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedRequest {
    /// The engine's request id.
    pub request_id: Option<String>,
    /// Trace context it arrived with.
    pub trace: Option<TraceContext>,
    /// Model name.
    pub model: Arc<str>,
    /// Request type label.
    pub request_type: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens prefilled (recompute included).
    pub prefilled_tokens: u64,
    /// Prefill chunks run (recompute included).
    pub prefill_chunks: u32,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Times preempted.
    pub preemptions: u32,
    /// Arrival.
    pub arrival_ns: Nanos,
    /// First [`Tracker::queued_at`], if called.
    pub queued_ns: Option<Nanos>,
    /// First scheduling.
    pub scheduled_ns: Option<Nanos>,
    /// First token.
    pub first_token_ns: Option<Nanos>,
    /// Last token.
    pub last_token_ns: Option<Nanos>,
    /// Finish (or abort).
    pub finish_ns: Nanos,
    /// Time in queue (waiting + preempted).
    pub queue_ns: Nanos,
    /// Time in prefill.
    pub prefill_ns: Nanos,
    /// Time in decode.
    pub decode_ns: Nanos,
    /// Largest gap between two consecutive tokens.
    pub max_itl_ns: Nanos,
    /// How it ended.
    pub reason: FinishReason,
    /// Every token's time, for requests sampled by [`TrackerConfig::token_detail_every`].
    pub token_times_ns: Option<Vec<Nanos>>,
    /// Unix time (ns) of the arrival, from the tracker's [`Clock`].
    pub arrival_unix_ns: u64,
    /// Unix time (ns) of the finish.
    pub finish_unix_ns: u64,
}

impl FinishedRequest {
    /// `finish − arrival`.
    pub fn e2e_ns(&self) -> Nanos {
        self.finish_ns - self.arrival_ns
    }

    /// `first token − arrival`.
    pub fn ttft_ns(&self) -> Option<Nanos> {
        self.first_token_ns.map(|f| f - self.arrival_ns)
    }

    /// `(last token − first token) / (output tokens − 1)`, with ≥ 2 output tokens.
    pub fn tpot_ns(&self) -> Option<f64> {
        match (self.first_token_ns, self.last_token_ns) {
            (Some(f), Some(l)) if self.output_tokens >= 2 => {
                Some((l - f) as f64 / (self.output_tokens - 1) as f64)
            }
            _ => None,
        }
    }

    /// The trace id as 32 hex characters.
    pub fn trace_id_hex(&self) -> Option<String> {
        self.trace.map(|t| t.trace_id_hex())
    }

    /// The record a tokenscope store holds for this request (engine-side values; phases and
    /// tokens with source `engine`; `created_at` = arrival, wall clock).
    pub fn to_record(&self) -> tokenscope_core::RequestRecord {
        use tokenscope_core::{InputBucket, PhaseSource, RequestRecord, TokenSource};
        let ms = |ns: Nanos| ns as f64 / 1e6;
        let request_id = self.request_id.clone().unwrap_or_else(|| {
            format!(
                "sdk-{}-{}",
                self.arrival_unix_ns,
                self.trace_id_hex().unwrap_or_default()
            )
        });
        RequestRecord {
            request_id,
            trace_id: self.trace_id_hex().unwrap_or_default(),
            created_at: i64::try_from(self.arrival_unix_ns / 1000).unwrap_or(i64::MAX),
            model: self.model.to_string(),
            model_served: Some(self.model.to_string()),
            upstream: "engine".to_owned(),
            request_type: self.request_type.to_owned(),
            outcome: self.reason.outcome(),
            http_status: 200,
            error_type: (self.reason == FinishReason::Error).then(|| "engine_error".to_owned()),
            finish_reason: Some(self.reason.as_str().to_owned()),
            input_tokens: Some(self.prompt_tokens),
            output_tokens: Some(self.output_tokens),
            input_tokens_source: TokenSource::Engine,
            output_tokens_source: TokenSource::Engine,
            input_bucket: Some(InputBucket::of(self.prompt_tokens)),
            queue_duration_ms: Some(ms(self.queue_ns)),
            prefill_duration_ms: Some(ms(self.prefill_ns)),
            decode_duration_ms: Some(ms(self.decode_ns)),
            queue_source: PhaseSource::Engine,
            prefill_source: PhaseSource::Engine,
            decode_source: PhaseSource::Engine,
            ttft_ms: self.ttft_ns().map(ms),
            tpot_ms: self.tpot_ns().map(|t| t / 1e6),
            itl_max_ms: (self.output_tokens >= 2).then(|| ms(self.max_itl_ns)),
            itl_mean_ms: self.tpot_ns().map(|t| t / 1e6),
            total_duration_ms: ms(self.e2e_ns()),
            chunks: Some(self.output_tokens),
            engine: Some("tokenscope-sdk".to_owned()),
            ..RequestRecord::default()
        }
    }
}

/// A finished request's timeline and phases (a `Copy` summary of [`FinishedRequest`], returned
/// by [`Tracker::finish_at`] so the engine can use the values at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    /// Arrival.
    pub arrival_ns: Nanos,
    /// First token.
    pub first_token_ns: Option<Nanos>,
    /// Last token.
    pub last_token_ns: Option<Nanos>,
    /// Finish.
    pub finish_ns: Nanos,
    /// Queue time.
    pub queue_ns: Nanos,
    /// Prefill time.
    pub prefill_ns: Nanos,
    /// Decode time.
    pub decode_ns: Nanos,
    /// Tokens generated.
    pub output_tokens: u64,
}

impl Phases {
    /// `finish − arrival` (= queue + prefill + decode).
    pub fn e2e_ns(&self) -> Nanos {
        self.finish_ns - self.arrival_ns
    }

    /// `first token − arrival`.
    pub fn ttft_ns(&self) -> Option<Nanos> {
        self.first_token_ns.map(|f| f - self.arrival_ns)
    }
}

/// A live request's phases so far (up to its last event), from [`Tracker::snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Current state.
    pub state: State,
    /// Queue time so far.
    pub queue_ns: Nanos,
    /// Prefill time so far.
    pub prefill_ns: Nanos,
    /// Decode time so far.
    pub decode_ns: Nanos,
    /// Time of the last event (the phases cover `[arrival, last_event]`).
    pub last_event_ns: Nanos,
    /// Tokens generated so far.
    pub output_tokens: u64,
}

#[derive(Debug)]
/// Hot fields (touched per token) first, in declaration order, so a token event touches one
/// or two cache lines; the request's identity is boxed to keep slots small.
#[repr(C)]
struct Req {
    state: State,
    model: u32,
    since: Nanos,
    phases: [Nanos; 3],
    last_token: Option<Nanos>,
    output_tokens: u64,
    max_itl: Nanos,
    first_token: Option<Nanos>,
    token_times: Option<Vec<Nanos>>,
    arrival: Nanos,
    queued: Option<Nanos>,
    scheduled: Option<Nanos>,
    prefilled: u64,
    chunks: u32,
    preemptions: u32,
    info: Box<RequestInfo>,
}

impl Req {
    /// Moves to `state` at `t` (clamped to `≥ since`), crediting the elapsed time to the old
    /// state's phase. Returns the clamped `t`.
    #[inline]
    fn enter(&mut self, state: State, t: Nanos) -> Nanos {
        let t = t.max(self.since);
        self.phases[self.state.phase() as usize] += t - self.since;
        self.since = t;
        self.state = state;
        t
    }

    /// `n ≥ 1` tokens emitted at `t`.
    #[inline]
    fn tokens(&mut self, t: Nanos, n: u32) {
        let t = self.enter(State::Decode, t);
        match self.last_token {
            Some(last) => self.max_itl = self.max_itl.max(t - last),
            None => self.first_token = Some(t),
        }
        self.last_token = Some(t);
        self.output_tokens += u64::from(n);
        if let Some(v) = &mut self.token_times {
            v.extend(std::iter::repeat_n(t, n as usize));
        }
    }
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    req: Option<Req>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ModelCounts {
    input: u64,
    output: u64,
}

/// Per-request phase tracking on the engine's thread. See the crate docs.
#[derive(Debug)]
pub struct Tracker {
    cfg: TrackerConfig,
    clock: Clock,
    flush_interval_ns: Nanos,
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
    models: Vec<Arc<str>>,
    counts: Vec<ModelCounts>,
    finished: Vec<FinishedRequest>,
    tokens_since_flush: u32,
    next_flush: Nanos,
    arrivals: u64,
    stale: u64,
    sink: Option<Sink>,
}

impl Tracker {
    /// A tracker without a sink: finished requests accumulate until [`Tracker::take_finished`].
    pub fn new(cfg: TrackerConfig, clock: Clock) -> Self {
        let flush_interval_ns = crate::clock::duration_ns(cfg.flush_interval).max(1);
        Self {
            cfg,
            clock,
            flush_interval_ns,
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            models: Vec::new(),
            counts: Vec::new(),
            finished: Vec::new(),
            tokens_since_flush: 0,
            next_flush: flush_interval_ns,
            arrivals: 0,
            stale: 0,
            sink: None,
        }
    }

    /// A tracker that ships each flush to `sink` (see [`crate::spawn_exporters`]).
    pub fn with_sink(cfg: TrackerConfig, clock: Clock, sink: Sink) -> Self {
        let mut t = Self::new(cfg, clock);
        t.sink = Some(sink);
        t
    }

    /// The tracker's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Now on the tracker's clock.
    #[inline]
    pub fn now(&self) -> Nanos {
        self.clock.now()
    }

    /// The id of `name`, registering it on first use (a linear search over at most
    /// [`TrackerConfig::max_models`] + 1 names: cache the id on hot paths). Beyond the limit,
    /// new names get the id of `other`.
    pub fn model(&mut self, name: &str) -> ModelId {
        if let Some(i) = self.models.iter().position(|m| &**m == name) {
            return ModelId(i as u32);
        }
        if self.models.len() >= self.cfg.max_models.max(1) && name != "other" {
            return self.model("other");
        }
        self.models.push(Arc::from(name));
        self.counts.push(ModelCounts::default());
        ModelId((self.models.len() - 1) as u32)
    }

    /// Requests being tracked.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Events ignored because their handle was stale or unknown.
    pub fn stale_events(&self) -> u64 {
        self.stale
    }

    #[inline]
    fn req(&mut self, h: RequestHandle) -> Option<&mut Req> {
        let slot = self.slots.get_mut(h.index as usize)?;
        if slot.generation != h.generation {
            return None;
        }
        slot.req.as_mut()
    }

    /// A request arrived at `t` (state [`State::Waiting`]).
    pub fn arrive_at(&mut self, t: Nanos, info: RequestInfo) -> RequestHandle {
        self.arrivals += 1;
        let sampled = self.cfg.token_detail_every > 0
            && self
                .arrivals
                .is_multiple_of(u64::from(self.cfg.token_detail_every));
        let model = if (info.model.0 as usize) < self.models.len() {
            info.model.0
        } else {
            self.model("unknown").0
        };
        let req = Req {
            state: State::Waiting,
            since: t,
            phases: [0; 3],
            arrival: t,
            queued: None,
            scheduled: None,
            first_token: None,
            last_token: None,
            max_itl: 0,
            output_tokens: 0,
            prefilled: 0,
            chunks: 0,
            preemptions: 0,
            model,
            token_times: sampled.then(Vec::new),
            info: Box::new(info),
        };
        self.live += 1;
        let index = match self.free.pop() {
            Some(i) => {
                let slot = &mut self.slots[i as usize];
                slot.req = Some(req);
                i
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    req: Some(req),
                });
                (self.slots.len() - 1) as u32
            }
        };
        RequestHandle {
            index,
            generation: self.slots[index as usize].generation,
        }
    }

    /// [`Tracker::arrive_at`] now.
    pub fn arrive(&mut self, info: RequestInfo) -> RequestHandle {
        let t = self.now();
        self.arrive_at(t, info)
    }

    /// The request entered the scheduler's queue at `t` (still queue; recorded as
    /// [`FinishedRequest::queued_ns`]).
    pub fn queued_at(&mut self, h: RequestHandle, t: Nanos) {
        match self.req(h) {
            Some(r) => {
                let state = r.state;
                let t = r.enter(state, t);
                r.queued.get_or_insert(t);
            }
            None => self.stale += 1,
        }
    }

    /// The scheduler admitted the request at `t`: [`State::Prefill`] (a request already in a
    /// scheduled state is unchanged).
    pub fn schedule_at(&mut self, h: RequestHandle, t: Nanos) {
        match self.req(h) {
            Some(r) => {
                if matches!(r.state, State::Waiting | State::Preempted) {
                    let t = r.enter(State::Prefill, t);
                    r.scheduled.get_or_insert(t);
                }
            }
            None => self.stale += 1,
        }
    }

    /// The request was preempted at `t`: [`State::Preempted`] (queue) until resumed.
    pub fn preempt_at(&mut self, h: RequestHandle, t: Nanos) {
        match self.req(h) {
            Some(r) => {
                if r.state != State::Preempted && r.state != State::Waiting {
                    r.enter(State::Preempted, t);
                    r.preemptions += 1;
                }
            }
            None => self.stale += 1,
        }
    }

    /// A preempted request was scheduled again at `t`: [`State::Prefill`] (recompute) until
    /// its next token.
    pub fn resume_at(&mut self, h: RequestHandle, t: Nanos) {
        self.schedule_at(h, t);
    }

    /// A prefill chunk of `tokens` ran on `[start, end]` for this request alone (use
    /// [`Tracker::step_at`] for batches). `sampled`: it completed the prompt and a token was
    /// sampled at `end`.
    pub fn prefill_chunk_at(
        &mut self,
        h: RequestHandle,
        start: Nanos,
        end: Nanos,
        tokens: u32,
        sampled: bool,
    ) {
        self.entry(
            start,
            end,
            StepEntry::new(h, Work::Prefill { tokens, sampled }),
        );
        self.after_tokens(end, u32::from(sampled));
    }

    /// One token emitted at `t` (the first one ends prefill).
    #[inline]
    pub fn token_at(&mut self, h: RequestHandle, t: Nanos) {
        let Some(slot) = self.slots.get_mut(h.index as usize) else {
            self.stale += 1;
            return;
        };
        let Some(r) = slot
            .req
            .as_mut()
            .filter(|_| slot.generation == h.generation)
        else {
            self.stale += 1;
            return;
        };
        r.tokens(t, 1);
        self.counts[r.model as usize].output += 1;
        self.after_tokens(t, 1);
    }

    #[inline]
    fn after_tokens(&mut self, t: Nanos, n: u32) {
        self.tokens_since_flush = self.tokens_since_flush.saturating_add(n);
        if self.tokens_since_flush >= self.cfg.flush_tokens || t >= self.next_flush {
            self.flush_at(t);
        }
    }

    fn entry(&mut self, start: Nanos, end: Nanos, e: StepEntry) -> u32 {
        let Some(r) = self.req(e.request) else {
            self.stale += 1;
            return 0;
        };
        let model = r.model as usize;
        // Before the step: whatever the request was doing; a waiting one is scheduled now.
        if matches!(r.state, State::Waiting | State::Preempted) {
            let t = r.enter(State::Prefill, start);
            r.scheduled.get_or_insert(t);
        }
        let emitted = match e.work {
            Work::Prefill { tokens, sampled } => {
                r.enter(State::Prefill, start);
                r.prefilled += u64::from(tokens);
                r.chunks += 1;
                u32::from(sampled)
            }
            Work::Decode { tokens } => {
                // Decode work before any token is still prefill (no token yet).
                let during = if r.first_token.is_some() {
                    State::Decode
                } else {
                    State::Prefill
                };
                r.enter(during, start);
                tokens
            }
        };
        if emitted > 0 {
            r.tokens(end, emitted);
        } else {
            // Credit the step to its phase; the request stays in it.
            let state = r.state;
            r.enter(state, end);
        }
        self.counts[model].output += u64::from(emitted);
        emitted
    }

    /// One engine step on `[start, end]` with the requests it contained: each entry's interval
    /// is credited to prefill or decode according to that request's work (see the crate docs);
    /// tokens are emitted at `end`. Requests not in `entries` are unaffected.
    pub fn step_at(&mut self, start: Nanos, end: Nanos, entries: &[StepEntry]) {
        let mut emitted = 0u32;
        for e in entries {
            emitted = emitted.saturating_add(self.entry(start, end, *e));
        }
        self.after_tokens(end, emitted);
    }

    /// The request finished at `t` for `reason`; its handle becomes stale. Returns its
    /// phases (`None` for a stale handle).
    pub fn finish_at(
        &mut self,
        h: RequestHandle,
        t: Nanos,
        reason: FinishReason,
    ) -> Option<Phases> {
        let Some(slot) = self.slots.get_mut(h.index as usize) else {
            self.stale += 1;
            return None;
        };
        if slot.generation != h.generation {
            self.stale += 1;
            return None;
        }
        let Some(mut r) = slot.req.take() else {
            self.stale += 1;
            return None;
        };
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(h.index);
        self.live -= 1;
        let state = r.state;
        let t = r.enter(state, t);
        let info = *r.info;
        self.counts[r.model as usize].input += info.prompt_tokens;
        let [queue_ns, prefill_ns, decode_ns] = r.phases;
        let phases = Phases {
            arrival_ns: r.arrival,
            first_token_ns: r.first_token,
            last_token_ns: r.last_token,
            finish_ns: t,
            queue_ns,
            prefill_ns,
            decode_ns,
            output_tokens: r.output_tokens,
        };
        self.finished.push(FinishedRequest {
            request_id: info.request_id,
            trace: info.trace,
            model: self.models[r.model as usize].clone(),
            request_type: info.request_type,
            prompt_tokens: info.prompt_tokens,
            prefilled_tokens: r.prefilled,
            prefill_chunks: r.chunks,
            output_tokens: r.output_tokens,
            preemptions: r.preemptions,
            arrival_ns: r.arrival,
            queued_ns: r.queued,
            scheduled_ns: r.scheduled,
            first_token_ns: r.first_token,
            last_token_ns: r.last_token,
            finish_ns: t,
            queue_ns,
            prefill_ns,
            decode_ns,
            max_itl_ns: r.max_itl,
            reason,
            token_times_ns: r.token_times,
            arrival_unix_ns: self.clock.unix_ns(r.arrival),
            finish_unix_ns: self.clock.unix_ns(t),
        });
        if t >= self.next_flush {
            self.flush_at(t);
        }
        Some(phases)
    }

    /// [`Tracker::finish_at`] with [`FinishReason::Abort`].
    pub fn abort_at(&mut self, h: RequestHandle, t: Nanos) -> Option<Phases> {
        self.finish_at(h, t, FinishReason::Abort)
    }

    /// A live request's phases up to its last event.
    pub fn snapshot(&self, h: RequestHandle) -> Option<Snapshot> {
        let slot = self.slots.get(h.index as usize)?;
        if slot.generation != h.generation {
            return None;
        }
        let r = slot.req.as_ref()?;
        Some(Snapshot {
            state: r.state,
            queue_ns: r.phases[0],
            prefill_ns: r.phases[1],
            decode_ns: r.phases[2],
            last_event_ns: r.since,
            output_tokens: r.output_tokens,
        })
    }

    /// Flushes if the interval has passed (call it from an idle loop, so finished requests do
    /// not wait for the next token).
    #[inline]
    pub fn tick_at(&mut self, t: Nanos) {
        if t >= self.next_flush {
            self.flush_at(t);
        }
    }

    /// Ships what accumulated (finished requests, token counts) to the sink now. Without a
    /// sink, finished requests stay for [`Tracker::take_finished`] and counters reset.
    pub fn flush_at(&mut self, t: Nanos) {
        self.tokens_since_flush = 0;
        self.next_flush = t.saturating_add(self.flush_interval_ns);
        let Some(sink) = &mut self.sink else {
            self.counts
                .iter_mut()
                .for_each(|c| *c = ModelCounts::default());
            return;
        };
        let tokens: Vec<TokenDelta> = self
            .counts
            .iter_mut()
            .zip(&self.models)
            .filter(|(c, _)| c.input > 0 || c.output > 0)
            .map(|(c, m)| {
                let d = TokenDelta {
                    model: m.clone(),
                    input: c.input,
                    output: c.output,
                };
                *c = ModelCounts::default();
                d
            })
            .collect();
        if tokens.is_empty() && self.finished.is_empty() {
            return;
        }
        let batch = Batch {
            at_ns: t,
            tokens,
            finished: std::mem::take(&mut self.finished),
        };
        sink.send(batch);
    }

    /// Takes the finished requests not shipped yet (all of them when there is no sink).
    pub fn take_finished(&mut self) -> Vec<FinishedRequest> {
        std::mem::take(&mut self.finished)
    }
}

impl Drop for Tracker {
    /// Ships what is left, so the exporters see every finished request.
    fn drop(&mut self) {
        if self.sink.is_some() {
            let t = self.next_flush;
            self.flush_at(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> (Tracker, ModelId) {
        let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
        let m = t.model("m");
        (t, m)
    }

    #[test]
    fn single_request_phases() {
        let (mut t, m) = tracker();
        let h = t.arrive_at(100, RequestInfo::new(m, 10));
        t.queued_at(h, 150);
        t.schedule_at(h, 300);
        t.prefill_chunk_at(h, 300, 500, 10, true);
        t.token_at(h, 600);
        t.token_at(h, 800);
        t.finish_at(h, 800, FinishReason::Length);
        let f = &t.take_finished()[0];
        assert_eq!((f.queue_ns, f.prefill_ns, f.decode_ns), (200, 200, 300));
        assert_eq!(f.e2e_ns(), 700);
        assert_eq!(f.ttft_ns(), Some(400));
        assert_eq!(f.tpot_ns(), Some(150.0));
        assert_eq!(f.max_itl_ns, 200);
        assert_eq!(f.queued_ns, Some(150));
        assert_eq!(f.output_tokens, 3);
        assert_eq!(t.live(), 0);
    }

    #[test]
    fn preemption_is_queue_and_recompute_is_prefill() {
        let (mut t, m) = tracker();
        let h = t.arrive_at(0, RequestInfo::new(m, 4));
        t.step_at(10, 20, &[StepEntry::new(h, Work::prefill_last(4))]);
        t.step_at(20, 30, &[StepEntry::new(h, Work::decode())]);
        t.preempt_at(h, 35);
        t.resume_at(h, 50);
        t.step_at(55, 65, &[StepEntry::new(h, Work::prefill_last(6))]);
        t.finish_at(h, 65, FinishReason::Stop);
        let f = &t.take_finished()[0];
        // queue: 0–10 + 35–50; prefill: 10–20 + 50–65; decode: 20–35.
        assert_eq!((f.queue_ns, f.prefill_ns, f.decode_ns), (25, 25, 15));
        assert_eq!(f.preemptions, 1);
        assert_eq!(f.prefilled_tokens, 10);
        assert_eq!(f.output_tokens, 3);
    }

    #[test]
    fn token_detail_is_sampled() {
        let cfg = TrackerConfig {
            token_detail_every: 2,
            ..TrackerConfig::default()
        };
        let mut t = Tracker::new(cfg, Clock::new());
        let m = t.model("m");
        for _ in 0..4 {
            let h = t.arrive_at(0, RequestInfo::new(m, 1));
            t.step_at(1, 5, &[StepEntry::new(h, Work::prefill_last(1))]);
            t.step_at(5, 9, &[StepEntry::new(h, Work::Decode { tokens: 2 })]);
            t.finish_at(h, 9, FinishReason::Stop);
        }
        let f = t.take_finished();
        let sampled: Vec<_> = f.iter().map(|r| r.token_times_ns.clone()).collect();
        // Every second request keeps its token times (speculative decode: 2 tokens at 9).
        assert_eq!(sampled[0], None);
        assert_eq!(sampled[1], Some(vec![5, 9, 9]));
        assert_eq!(sampled[2], None);
        assert_eq!(sampled[3], Some(vec![5, 9, 9]));
        assert_eq!(f[1].output_tokens, 3);
        assert_eq!(f[1].tpot_ns(), Some(2.0));
    }

    #[test]
    fn model_names_are_bounded() {
        let cfg = TrackerConfig {
            max_models: 2,
            ..TrackerConfig::default()
        };
        let mut t = Tracker::new(cfg, Clock::new());
        let a = t.model("a");
        let b = t.model("b");
        let c = t.model("c");
        assert_ne!(a, b);
        assert_eq!(c, t.model("d"));
        assert_eq!(t.model("a"), a);
        let h = t.arrive_at(0, RequestInfo::new(c, 1));
        t.finish_at(h, 1, FinishReason::Stop);
        assert_eq!(&*t.take_finished()[0].model, "other");
    }

    #[test]
    fn stale_handles_are_ignored() {
        let (mut t, m) = tracker();
        let h = t.arrive_at(0, RequestInfo::new(m, 1));
        t.finish_at(h, 5, FinishReason::Abort);
        let h2 = t.arrive_at(6, RequestInfo::new(m, 1));
        assert_ne!(h, h2);
        t.token_at(h, 7);
        t.finish_at(h, 8, FinishReason::Stop);
        assert_eq!(t.stale_events(), 2);
        assert_eq!(t.snapshot(h2).map(|s| s.output_tokens), Some(0));
    }

    #[test]
    fn clock_steps_back_are_clamped() {
        let (mut t, m) = tracker();
        let h = t.arrive_at(100, RequestInfo::new(m, 1));
        t.schedule_at(h, 90);
        t.token_at(h, 80);
        t.finish_at(h, 70, FinishReason::Stop);
        let f = &t.take_finished()[0];
        assert_eq!(f.e2e_ns(), 0);
        assert_eq!(f.queue_ns + f.prefill_ns + f.decode_ns, 0);
    }
}
