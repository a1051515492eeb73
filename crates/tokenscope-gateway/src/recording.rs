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
//! Finishing never blocks: it updates in-memory metrics, pushes into the recent-records ring,
//! and `try_send`s the record into the bounded store pipeline ([`RecordOut`]).

use crate::engine::{EngineKind, TgiHeaders};
use crate::Shared;
use std::sync::Arc;
use std::time::Instant;
use tokenscope_core::openai::{LlamaTimings, Usage, VllmMetrics};
use tokenscope_core::{InputBucket, Outcome, PhaseSource, RequestRecord, StreamTimer, TokenSource};
use tokenscope_telemetry::InFlightGuard;

/// The result of the entry tokenizer count, delivered by the task that computes it.
pub(crate) type EntryCount =
    tokio::sync::oneshot::Receiver<Option<Result<u64, tokenscope_tokenize::TokenizeError>>>;

/// Largest streamed output text kept for counting a cancelled stream's tokens.
pub(crate) const MAX_OUTPUT_TEXT: usize = 256 * 1024;

/// Where finished records go (the store pipeline). Must not block.
pub trait RecordOut: Send + Sync + 'static {
    /// Hands over one finished record.
    fn submit(&self, rec: RequestRecord);
}

/// What the response told us so far.
#[derive(Debug, Default)]
pub(crate) struct ResponseFacts {
    pub status: Option<u16>,
    pub usage: Option<Usage>,
    pub timings: Option<LlamaTimings>,
    pub metrics: Option<VllmMetrics>,
    pub tgi: Option<TgiHeaders>,
    /// The configured engine kind of the upstream.
    pub kind: EngineKind,
    pub finish_reason: Option<String>,
    pub model_served: Option<String>,
    pub output_bytes: usize,
    /// A body or event that should have been JSON was not.
    pub malformed: bool,
    /// The stream carried an `{"error": …}` event.
    pub stream_error: bool,
}

pub(crate) struct Pending {
    shared: Arc<Shared>,
    pub rec: RequestRecord,
    pub timer: StreamTimer,
    pub facts: ResponseFacts,
    /// Entry-time input estimate (text length), used when the engine reports no usage.
    pub entry_input_tokens: Option<u64>,
    /// The entry count with the model's own tokenizer, computed beside forwarding.
    pub entry_count: Option<EntryCount>,
    /// Streamed output text, kept (capped) only when a tokenizer can count it for a cancelled
    /// stream.
    pub output_text: Option<String>,
    /// The request's trace ids (W3C context continued or started at arrival).
    pub trace: tokenscope_trace::RequestTrace,
    /// The client connection the request came on (to tell a stalled client from one that
    /// left).
    pub conn: Option<Arc<crate::server::ConnState>>,
    in_flight: Option<InFlightGuard>,
}

/// Owns a record until it is finished. See the module docs.
pub(crate) struct RecordGuard(Option<Box<Pending>>);

impl RecordGuard {
    pub fn new(
        shared: Arc<Shared>,
        rec: RequestRecord,
        arrival: Instant,
        trace: tokenscope_trace::RequestTrace,
    ) -> Self {
        RecordGuard(Some(Box::new(Pending {
            trace,
            shared,
            rec,
            timer: StreamTimer::new(arrival),
            facts: ResponseFacts::default(),
            entry_input_tokens: None,
            entry_count: None,
            output_text: None,
            conn: None,
            in_flight: None,
        })))
    }

    /// Access to the pending state (always present until finished).
    pub fn get(&mut self) -> Option<&mut Pending> {
        self.0.as_deref_mut()
    }

    /// Starts counting this request in `llm_requests_in_flight` (once the model is known).
    pub fn start_in_flight(&mut self) {
        if let Some(p) = self.0.as_deref_mut() {
            p.in_flight = Some(p.shared.metrics.start_request(&p.rec.model));
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
            let why = if p
                .shared
                .shutting_down
                .load(std::sync::atomic::Ordering::SeqCst)
            {
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

fn outcome_for_status(status: u16) -> (Outcome, Option<String>) {
    match status {
        200..=299 => (Outcome::Ok, None),
        429 => (Outcome::UpstreamError, Some("rate_limited".into())),
        400..=499 => (Outcome::ClientError, Some(format!("http_{status}"))),
        _ => (Outcome::UpstreamError, Some(format!("http_{status}"))),
    }
}

fn finalize(mut p: Pending, end: Instant, forced: Option<(Outcome, &'static str)>) {
    let f = &p.facts;
    let t = &p.timer;
    let rec = &mut p.rec;
    rec.total_duration_ms = t.elapsed_ms(end);
    rec.ttft_ms = t.ttft_ms();
    rec.upstream_headers_ms = t.headers_ms();
    rec.gateway_overhead_ms = t.overhead_ms();
    if let Some(s) = f.status {
        rec.http_status = s;
    }
    rec.finish_reason.clone_from(&f.finish_reason);
    rec.model_served.clone_from(&f.model_served);

    let usage = f.usage.unwrap_or_default();
    let timings = f.timings.unwrap_or_default();

    // Input tokens: usage > engine timings > entry estimate.
    (rec.input_tokens, rec.input_tokens_source) = if let Some(n) = usage.prompt_tokens {
        (Some(n), TokenSource::Usage)
    } else if let Some(n) = timings.prompt_n {
        (Some(n + timings.cache_n.unwrap_or(0)), TokenSource::Engine)
    } else if let Some(n) = f.tgi.and_then(|t| t.prompt_tokens) {
        (Some(n), TokenSource::Engine)
    } else if let Some(n) = p.entry_input_tokens {
        (Some(n), TokenSource::Estimate)
    } else {
        (None, TokenSource::None)
    };
    // Output tokens: usage > engine timings > streamed chunks > text estimate.
    (rec.output_tokens, rec.output_tokens_source) = if let Some(n) = usage.completion_tokens {
        (Some(n), TokenSource::Usage)
    } else if let Some(n) = timings.predicted_n {
        (Some(n), TokenSource::Engine)
    } else if let Some(n) = f.tgi.and_then(|t| t.generated_tokens) {
        (Some(n), TokenSource::Engine)
    } else if t.token_chunks() > 0 {
        (Some(t.token_chunks()), TokenSource::Chunks)
    } else if f.output_bytes > 0 {
        (
            Some((f.output_bytes as u64).div_ceil(4)),
            TokenSource::Estimate,
        )
    } else if rec.endpoint == tokenscope_core::Endpoint::Embeddings && usage.prompt_tokens.is_some()
    {
        (Some(0), TokenSource::Usage)
    } else {
        (None, TokenSource::None)
    };
    rec.cached_tokens = usage.cached_tokens().or(timings.cache_n);
    rec.reasoning_tokens = usage.reasoning_tokens();
    rec.input_bucket = rec.input_tokens.map(InputBucket::of);
    if rec.stream {
        rec.tpot_ms = rec.output_tokens.and_then(|n| t.tpot_ms(n));
        rec.itl_max_ms = t.itl_max_ms();
        rec.itl_mean_ms = t.itl_mean_ms();
        rec.chunks = Some(t.token_chunks());
    }

    // Engine phases of this very request (see `engine.rs` for the per-engine mapping).
    let set = |v: &mut Option<f64>, src: &mut PhaseSource, val: Option<f64>| {
        if let Some(ms) = val.filter(|m| m.is_finite() && *m >= 0.0) {
            *v = Some(ms);
            *src = PhaseSource::Engine;
        }
    };
    if let Some(m) = f.metrics {
        set(
            &mut rec.queue_duration_ms,
            &mut rec.queue_source,
            m.queue_time_ms,
        );
        set(
            &mut rec.prefill_duration_ms,
            &mut rec.prefill_source,
            m.time_to_first_token_ms,
        );
        set(
            &mut rec.decode_duration_ms,
            &mut rec.decode_source,
            m.generation_time_ms,
        );
    }
    if let Some(tgi) = f.tgi {
        set(
            &mut rec.queue_duration_ms,
            &mut rec.queue_source,
            tgi.queue_ms,
        );
    }
    set(
        &mut rec.prefill_duration_ms,
        &mut rec.prefill_source,
        timings.prompt_ms,
    );
    set(
        &mut rec.decode_duration_ms,
        &mut rec.decode_source,
        timings.predicted_ms,
    );
    if rec.queue_source == PhaseSource::None {
        if let (Some(ttft), Some(prefill)) = (rec.ttft_ms, rec.prefill_duration_ms) {
            let overhead = rec.gateway_overhead_ms.unwrap_or(0.0);
            rec.queue_duration_ms = Some((ttft - prefill - overhead).max(0.0));
            rec.queue_source = PhaseSource::Derived;
        }
    }
    rec.engine = f.kind.name().map(str::to_owned).or_else(|| {
        let detected = if f.timings.is_some() {
            "llamacpp"
        } else if f.metrics.is_some() {
            "vllm"
        } else if f.tgi.is_some() {
            "tgi"
        } else {
            return None;
        };
        Some(detected.to_owned())
    });
    rec.draft_tokens = timings.draft_n;
    rec.draft_accepted_tokens = timings.draft_n_accepted;

    // Outcome.
    let (mut outcome, mut error_type) = match f.status {
        Some(s) => outcome_for_status(s),
        None => (Outcome::UpstreamError, Some("no_response".into())),
    };
    if outcome == Outcome::Ok && f.malformed {
        outcome = Outcome::UpstreamError;
        error_type = Some("malformed_response".into());
    } else if outcome == Outcome::Ok && f.stream_error {
        outcome = Outcome::UpstreamError;
        error_type = Some("stream_error".into());
    }
    if let Some((o, e)) = forced {
        outcome = o;
        error_type = Some(e.into());
        if rec.http_status == 0 {
            rec.http_status = match o {
                Outcome::Timeout => 504,
                Outcome::Cancelled => 499,
                Outcome::Shutdown => 503,
                Outcome::ClientError => 400,
                _ => 502,
            };
        }
    }
    rec.outcome = outcome;
    rec.error_type = error_type;

    let shared = p.shared;
    let trace = crate::TraceFacts {
        trace: p.trace,
        times: tokenscope_trace::SpanTimes {
            upstream_sent_ms: p.timer.upstream_sent_ms(),
        },
    };
    drop(p.in_flight.take());
    let mut rec = p.rec;
    // Tokenizer work that may still be running: the entry count (started at arrival) and, for a
    // cancelled stream, the count of the text streamed so far. Finishing waits for them off the
    // request path, in a task, with a deadline; nothing here blocks.
    let mut entry = p.entry_count;
    if let Some(rx) = entry.as_mut() {
        match rx.try_recv() {
            Ok(res) => {
                apply_entry_count(&shared, &mut rec, res);
                entry = None;
            }
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => entry = None,
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
        }
    }
    let count_output = (matches!(rec.outcome, Outcome::Cancelled | Outcome::Shutdown)
        && rec.output_tokens_source == TokenSource::Chunks)
        .then_some(p.output_text)
        .flatten()
        .filter(|t| !t.is_empty() && shared.tokenizers.has(&rec.model));
    if entry.is_none() && count_output.is_none() {
        shared.finish_record(rec, trace);
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        shared.finish_record(rec, trace);
        return;
    };
    let finishing = shared.finishing.clone();
    finishing.spawn_on(
        async move {
            let deadline = std::time::Duration::from_secs(5);
            if let Some(rx) = entry {
                if let Ok(Ok(res)) = tokio::time::timeout(deadline, rx).await {
                    apply_entry_count(&shared, &mut rec, res);
                }
            }
            if let Some(text) = count_output {
                let counted =
                    tokio::time::timeout(deadline, shared.tokenizers.count_text(&rec.model, &text))
                        .await;
                if let Ok(Some(Ok(n))) = counted {
                    rec.output_tokens = Some(n);
                    rec.output_tokens_source = TokenSource::Tokenizer;
                }
            }
            shared.finish_record(rec, trace);
        },
        &rt,
    );
}

/// Puts the entry tokenizer count on the record: kept as `input_tokens_entry`; it becomes the
/// input count when the engine gave none; a disagreement with the engine's count beyond the
/// tolerance is counted in `llm_token_count_mismatch_total`.
fn apply_entry_count(
    shared: &crate::Shared,
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
            if diff > shared.cfg.token_mismatch_tolerance * engine.max(1.0) {
                shared.metrics.token_count_mismatch(&rec.model);
            }
        }
        _ => {
            rec.input_tokens = Some(n);
            rec.input_tokens_source = TokenSource::Tokenizer;
            rec.input_bucket = Some(InputBucket::of(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping() {
        assert_eq!(outcome_for_status(200).0, Outcome::Ok);
        assert_eq!(outcome_for_status(400).0, Outcome::ClientError);
        assert_eq!(outcome_for_status(429).0, Outcome::UpstreamError);
        assert_eq!(outcome_for_status(503).0, Outcome::UpstreamError);
    }
}
