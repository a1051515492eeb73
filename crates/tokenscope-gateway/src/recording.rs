//! The per-request record under construction, and the guarantee of exactly one record.
//!
//! A [`RecordGuard`] is created when a measured request arrives and travels with it: first in the
//! handler, then inside the response body ([`crate::body::MeteredBody`]). It is finished exactly
//! once, by whichever comes first:
//! * [`RecordGuard::finish`] — the handler failed early (413, 502, 504) or the body reached its
//!   end of stream, its idle timeout, or an upstream error;
//! * `Drop` — the request was abandoned (client disconnect while waiting for the upstream or
//!   mid-stream, a client that stopped reading past `client_write_timeout_ms`, or the end of
//!   the shutdown grace period): the record says `cancelled` (`client_disconnected`,
//!   `client_write_timeout`) or `shutdown`, with the tokens seen so far.
//!
//! Finishing derives the record's fields from the exchange's facts
//! ([`crate::facts::derive::derive`]) and hands the record to [`crate::finished::Fanout`];
//! it never blocks (in-memory metrics, the recent-records ring, a `try_send` into the bounded
//! store pipeline, [`RecordOut`]).
//!
//! The handler and the body reach the pending record only through the guard's methods
//! ([`RecordGuard::record`], [`RecordGuard::facts`], …); all of them are no-ops once the
//! record is finished.

use crate::blame::{Blame, StepKey, Ticket, Who};
use crate::facts::{derive::derive, ResponseFacts};
use crate::finished::{Counts, EntryCount, Fanout, TraceFacts};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_core::{Outcome, PhaseSource, PhaseUpdate, RequestRecord};
use tokenscope_telemetry::InFlightGuard;

/// Where finished records go (the store pipeline). Must not block.
pub trait RecordOut: Send + Sync + 'static {
    /// Hands over one finished record.
    fn submit(&self, rec: RequestRecord);
}

/// A record under construction and what finishing it needs.
struct Pending {
    fanout: Arc<Fanout>,
    rec: RequestRecord,
    facts: ResponseFacts,
    /// Entry-time input estimate (text length), used when the engine reports no usage.
    entry_input_tokens: Option<u64>,
    /// The entry count with the model's own tokenizer, computed beside forwarding.
    entry_count: Option<EntryCount>,
    /// The request's trace ids (W3C context continued or started at arrival).
    trace: tokenscope_trace::RequestTrace,
    /// The client connection the request came on (to tell a stalled client from one that
    /// left).
    conn: Option<Arc<crate::server::ConnState>>,
    in_flight: Option<InFlightGuard>,
    /// Its place on the board of the replica it was sent to ([`crate::blame`]).
    ticket: Option<Ticket>,
    /// The first token was told to the ticket.
    first_noted: bool,
}

/// Owns a record until it is finished. See the module docs.
pub(crate) struct RecordGuard(Option<Box<Pending>>);

impl RecordGuard {
    /// Starts the record of a request that arrived at `arrival` on connection `conn`.
    pub fn new(
        fanout: Arc<Fanout>,
        rec: RequestRecord,
        arrival: Instant,
        trace: tokenscope_trace::RequestTrace,
        conn: Option<Arc<crate::server::ConnState>>,
    ) -> Self {
        let facts = ResponseFacts::new(arrival, rec.endpoint);
        RecordGuard(Some(Box::new(Pending {
            trace,
            fanout,
            rec,
            facts,
            entry_input_tokens: None,
            entry_count: None,
            conn,
            in_flight: None,
            ticket: None,
            first_noted: false,
        })))
    }

    /// The record under construction (`None` once finished).
    pub fn record(&mut self) -> Option<&mut RequestRecord> {
        self.0.as_deref_mut().map(|p| &mut p.rec)
    }

    /// The exchange's facts (`None` once finished).
    pub fn facts(&mut self) -> Option<&mut ResponseFacts> {
        self.0.as_deref_mut().map(|p| &mut p.facts)
    }

    /// The record and the facts together (`None` once finished).
    pub fn parts(&mut self) -> Option<(&mut RequestRecord, &mut ResponseFacts)> {
        self.0.as_deref_mut().map(|p| (&mut p.rec, &mut p.facts))
    }

    /// Sets the entry-time input estimate.
    pub fn set_entry_estimate(&mut self, estimate: Option<u64>) {
        if let Some(p) = self.0.as_deref_mut() {
            p.entry_input_tokens = estimate;
        }
    }

    /// Sets the entry tokenizer count that finishing waits for.
    pub fn set_entry_count(&mut self, rx: EntryCount) {
        if let Some(p) = self.0.as_deref_mut() {
            p.entry_count = Some(rx);
        }
    }

    /// Starts counting this request in `llm_requests_in_flight` (once the model is known).
    pub fn start_in_flight(&mut self) {
        if let Some(p) = self.0.as_deref_mut() {
            p.in_flight = Some(p.fanout.start_request(&p.rec.model));
        }
    }

    /// The request is being sent to `replica` now: it enters that replica's board (leaving
    /// the board of a replica tried before, without a trace).
    pub fn on_replica(&mut self, replica: &crate::replicas::Replica) {
        if let Some(p) = self.0.as_deref_mut() {
            let who = Who {
                request_id: p.rec.request_id.clone(),
                caller: crate::blame::caller_of(&p.rec),
                business_line: p.rec.business_line.clone(),
            };
            let est = p.entry_input_tokens.unwrap_or(0);
            p.ticket = None;
            p.ticket = Some(replica.board.enter(who, est, Instant::now()));
        }
    }

    /// Tells the replica's board of the first output token, once (after each frame).
    pub fn note_first_token(&mut self) {
        if let Some(p) = self.0.as_deref_mut() {
            if !p.first_noted {
                if let (Some(t), Some(at)) = (&p.ticket, p.facts.first_token()) {
                    t.first_token(at);
                    p.first_noted = true;
                }
            }
        }
    }

    /// Finishes the record now. `forced` overrides the outcome derived from the response.
    pub fn finish(&mut self, end: Instant, forced: Option<(Outcome, &'static str)>) {
        if let Some(p) = self.0.take() {
            finalize(*p, end, forced);
        }
    }
}

impl Drop for RecordGuard {
    /// Abandoned before it finished: cut by the gateway's shutdown, failed writes to a client
    /// that stopped reading, or the client left.
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let why = if p.fanout.shutting_down() {
                (Outcome::Shutdown, "gateway_shutdown")
            } else if p
                .conn
                .as_ref()
                .is_some_and(|c| c.write_stalled.load(std::sync::atomic::Ordering::Acquire))
            {
                (Outcome::Cancelled, "client_write_timeout")
            } else {
                (Outcome::Cancelled, "client_disconnected")
            };
            finalize(*p, Instant::now(), Some(why));
        }
    }
}

/// Derives the record's fields and hands it to the fan-out.
fn finalize(mut p: Pending, end: Instant, forced: Option<(Outcome, &'static str)>) {
    derive(&mut p.rec, &p.facts, p.entry_input_tokens, end, forced);
    if let Some(t) = p.ticket.take() {
        if let Some(at) = p.facts.first_token() {
            t.first_token(at);
        }
        let engine_prefill_end = match (p.rec.queue_duration_ms, p.rec.prefill_duration_ms) {
            (Some(q), Some(f)) if q.is_finite() && f.is_finite() && q + f >= 0.0 => {
                Duration::try_from_secs_f64((q + f) / 1000.0)
                    .ok()
                    .map(|d| t.sent() + d)
            }
            _ => None,
        };
        let trace_id = Some(p.rec.trace_id.clone()).filter(|t| !t.is_empty());
        let step = engine_step_key(&p.rec).map(|k| (k, trace_id));
        let (blame, mates) = t.leave_step(engine_prefill_end, p.rec.input_tokens, end, step);
        apply_blame(&mut p.rec, blame);
        if mates.per_step {
            p.rec.mark_per_step();
            for trace_id in mates.flag {
                p.fanout.recorder.update(PhaseUpdate {
                    trace_id,
                    per_step: true,
                    ..PhaseUpdate::default()
                });
            }
        }
    }
    let trace = TraceFacts {
        trace: p.trace,
        times: tokenscope_trace::SpanTimes {
            upstream_sent_ms: p.facts.upstream_sent_ms(),
        },
        response_id: p.facts.take_response_id(),
    };
    drop(p.in_flight.take());
    let counts = Counts {
        entry: p.entry_count,
        output_text: p.facts.take_output_text(),
    };
    p.fanout.complete(p.rec, trace, counts);
}

/// The record's engine-reported prefill and decode as a [`StepKey`] (`None` when the prefill
/// is not the engine's own number).
fn engine_step_key(rec: &RequestRecord) -> Option<StepKey> {
    let engine = |s: PhaseSource| matches!(s, PhaseSource::Engine | PhaseSource::EngineSpan);
    if !engine(rec.prefill_source) {
        return None;
    }
    let decode = rec.decode_duration_ms.filter(|_| engine(rec.decode_source));
    StepKey::of(rec.prefill_duration_ms, decode)
}

/// The blame's fields on the record (`None` leaves them unmeasured).
fn apply_blame(rec: &mut RequestRecord, blame: Option<Blame>) {
    let Some(b) = blame else {
        return;
    };
    rec.blocked_by_requests = Some(b.requests);
    rec.blocked_by_prompt_tokens = Some(b.prompt_tokens);
    rec.blocked_ms = Some((b.blocked_ms * 1000.0).round() / 1000.0);
    if let Some((who, tokens)) = b.top {
        rec.blocker_request_id = Some(who.request_id);
        rec.blocker_caller = who.caller;
        rec.blocker_business_line = who.business_line;
        rec.blocker_prompt_tokens = Some(tokens);
    }
}
