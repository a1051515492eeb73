//! What a measured request's exchange told the gateway: [`ResponseFacts`], absorbed in one
//! place, and the pure derivation of the record's fields from them ([`derive`]).
//!
//! Invariants:
//! * One type owns the facts; the handler ([`crate::proxy`]) and the response body
//!   ([`crate::body::MeteredBody`]) only call its methods, and the record is derived from the
//!   facts only at the end ([`derive::derive`]), never updated piecemeal.
//! * Absorbing is cheap and bounded: per SSE event one parse of its `data:` JSON and no
//!   allocation besides what a field keeps (the finish reason, the served model once, output
//!   text up to [`MAX_OUTPUT_TEXT`] only when a tokenizer may count it).
//! * Each payload is read by its endpoint's parser (chat-style, Responses API, Messages API:
//!   [`parse_payload_for`]); what counts as an output chunk for TTFT/TPOT is that parser's
//!   `has_output` (the first token-bearing delta of any kind: text, reasoning, tool call).
//! * A later `usage` / `timings` / `metrics` replaces an earlier one (the final chunk is the
//!   complete one), except the Messages API's usage, whose counts are merged field by field
//!   (`message_start` has the input, `message_delta` the cumulative output); the served model
//!   is the first one seen in a stream.

pub(crate) mod derive;

use crate::engine::{EngineKind, TgiHeaders};
use http::HeaderMap;
use std::time::Instant;
use tokenscope_core::messages::MessagesUsage;
use tokenscope_core::openai::{parse_payload_for, LlamaTimings, PayloadInfo, Usage, VllmMetrics};
use tokenscope_core::sse::{event_data, parse_event};
use tokenscope_core::{Endpoint, StreamTimer};

/// Largest streamed output text kept for counting a cancelled stream's tokens.
pub(crate) const MAX_OUTPUT_TEXT: usize = 256 * 1024;

/// What the request's exchange told so far. See the module docs.
#[derive(Debug)]
pub(crate) struct ResponseFacts {
    /// Arrival, body received, upstream sent, headers, content chunks.
    timer: StreamTimer,
    /// The endpoint, whose API's parser reads the payloads.
    endpoint: Endpoint,
    /// The request asked for a stream.
    stream: bool,
    /// The configured engine kind of the upstream.
    kind: EngineKind,
    status: Option<u16>,
    usage: Option<Usage>,
    /// The Messages API's usage merged so far (`usage` is its chat form).
    messages_usage: Option<MessagesUsage>,
    timings: Option<LlamaTimings>,
    metrics: Option<VllmMetrics>,
    tgi: Option<TgiHeaders>,
    finish_reason: Option<String>,
    model_served: Option<String>,
    /// The engine's response id (the first payload that carries one).
    response_id: Option<String>,
    output_bytes: usize,
    /// A body or event that should have been JSON was not.
    malformed: bool,
    /// The stream carried an `{"error": …}` event.
    stream_error: bool,
    /// Streamed output text, kept (capped) only when a tokenizer can count it for a cancelled
    /// stream.
    output_text: Option<String>,
}

impl ResponseFacts {
    /// No facts yet about a request to `endpoint` that arrived at `arrival`.
    pub(crate) fn new(arrival: Instant, endpoint: Endpoint) -> Self {
        ResponseFacts {
            timer: StreamTimer::new(arrival),
            endpoint,
            stream: false,
            kind: EngineKind::Auto,
            status: None,
            usage: None,
            messages_usage: None,
            timings: None,
            metrics: None,
            tgi: None,
            finish_reason: None,
            model_served: None,
            response_id: None,
            output_bytes: 0,
            malformed: false,
            stream_error: false,
            output_text: None,
        }
    }

    /// The request body had been received whole at `at`.
    pub(crate) fn body_received(&mut self, at: Instant) {
        self.timer.mark_body_received(at);
    }

    /// The request asks for a stream (a non-streamed body's output then counts as a chunk).
    pub(crate) fn set_stream(&mut self, stream: bool) {
        self.stream = stream;
    }

    /// Keep the streamed output text (capped) so that a tokenizer can count a cancelled
    /// stream's tokens.
    pub(crate) fn keep_output_text(&mut self) {
        self.output_text = Some(String::new());
    }

    /// The upstream chosen and its configured engine kind.
    pub(crate) fn set_kind(&mut self, kind: EngineKind) {
        self.kind = kind;
    }

    /// The request was handed to the upstream connection at `at`.
    pub(crate) fn upstream_sent(&mut self, at: Instant) {
        self.timer.mark_upstream_sent(at);
    }

    /// The upstream's response headers arrived at `at`.
    pub(crate) fn headers(&mut self, at: Instant, status: u16, headers: &HeaderMap) {
        self.timer.mark_headers(at);
        self.status = Some(status);
        self.tgi = TgiHeaders::read(headers);
    }

    /// Arrival → the request handed to the upstream (the trace's span times).
    /// The instant of the first output token, if one came.
    pub(crate) fn first_token(&self) -> Option<Instant> {
        self.timer.first_token()
    }

    pub(crate) fn upstream_sent_ms(&self) -> Option<f64> {
        self.timer.upstream_sent_ms()
    }

    /// The engine's response id, taken out (the trace's `gen_ai.response.id`).
    pub(crate) fn take_response_id(&mut self) -> Option<String> {
        self.response_id.take()
    }

    /// The kept output text (see [`Self::keep_output_text`]).
    pub(crate) fn take_output_text(&mut self) -> Option<String> {
        self.output_text.take()
    }

    /// Reads one raw SSE event. Returns `true` when the event is the usage-only chunk and
    /// `strip` is set (the caller then drops it).
    pub(crate) fn absorb_event(&mut self, raw: &[u8], now: Instant, strip: bool) -> bool {
        // Fast path: the data bytes straight to the JSON parser (which checks its strings'
        // UTF-8 itself). Whatever it rejects goes through the text path, which decodes invalid
        // UTF-8 lossily and trims any whitespace: a payload parses iff it did before, and to
        // the same result.
        let Some(data) = event_data(raw) else {
            return false;
        };
        let bytes = data.trim_ascii();
        if bytes.is_empty() || bytes == b"[DONE]" {
            return false;
        }
        let text;
        let parsed = match parse_payload_for(self.endpoint, bytes) {
            Ok(info) => Ok(info),
            Err(_) => {
                text = parse_event(raw).data.unwrap_or_default();
                let t = text.trim();
                if t.is_empty() || t == "[DONE]" {
                    return false;
                }
                parse_payload_for(self.endpoint, t.as_bytes())
            }
        };
        match parsed {
            Ok(info) => {
                let strip_this = strip && info.is_usage_only() && !info.has_output;
                if info.has_output {
                    self.timer.on_token_chunk(now);
                }
                if let (Some(buf), Some(t)) = (self.output_text.as_mut(), info.text.as_deref()) {
                    if buf.len() + t.len() <= MAX_OUTPUT_TEXT {
                        buf.push_str(t);
                    }
                }
                self.output_bytes += info.output_bytes;
                self.absorb_usage(&info);
                if info.timings.is_some() {
                    self.timings = info.timings;
                }
                if info.metrics.is_some() {
                    self.metrics = info.metrics;
                }
                if let Some(r) = info.finish_reason {
                    self.finish_reason = Some(r.into_owned());
                }
                if self.model_served.is_none() {
                    self.model_served = info.model.map(|m| m.into_owned());
                }
                if self.response_id.is_none() {
                    self.response_id = info.id.map(|i| i.into_owned());
                }
                self.stream_error |= info.is_error;
                strip_this
            }
            Err(_) => {
                self.malformed = true;
                false
            }
        }
    }

    /// A payload's usage: a later one replaces the earlier one; the Messages API's counts are
    /// merged (see the module docs).
    fn absorb_usage(&mut self, info: &PayloadInfo<'_>) {
        if let Some(u) = &info.messages_usage {
            let merged = self
                .messages_usage
                .get_or_insert_with(MessagesUsage::default);
            merged.merge(u);
            self.usage = Some(merged.to_usage());
        } else if info.usage.is_some() {
            self.usage = info.usage;
        }
    }

    /// Reads a whole (non-SSE) response body that arrived complete at `now`.
    pub(crate) fn absorb_body(&mut self, buf: &[u8], now: Instant) {
        match parse_payload_for(self.endpoint, buf) {
            Ok(info) => {
                if info.has_output && self.stream {
                    self.timer.on_token_chunk(now);
                }
                self.absorb_usage(&info);
                self.timings = info.timings.or(self.timings);
                self.metrics = info.metrics.or(self.metrics);
                if let Some(r) = info.finish_reason {
                    self.finish_reason = Some(r.into_owned());
                }
                if let Some(m) = info.model {
                    self.model_served = Some(m.into_owned());
                }
                if let Some(i) = info.id {
                    self.response_id = Some(i.into_owned());
                }
                self.output_bytes += info.output_bytes;
            }
            Err(_) => self.malformed = true,
        }
    }
}
