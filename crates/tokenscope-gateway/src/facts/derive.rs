//! The record's measured fields, derived from [`ResponseFacts`]: a pure function.
//!
//! Rules (each stated once, here):
//! * Input tokens: `usage` (in the chat meaning, every prompt token: the Messages API's
//!   `input_tokens` plus its cache reads and writes) > engine (llama.cpp `timings.prompt_n + cache_n`, TGI
//!   `x-prompt-tokens`) > entry estimate > none. The entry tokenizer count, when it arrives
//!   later, replaces only an estimate (see [`crate::finished`]).
//! * Output tokens: `usage` > engine (`timings.predicted_n`, TGI `x-generated-tokens`) >
//!   streamed content chunks > output text length / 4 > none; an embeddings answer with
//!   prompt usage has 0 output tokens.
//! * Phases: an engine value (finite, ≥ 0) wins; queue is otherwise derived as
//!   TTFT − prefill − gateway overhead (never negative) when prefill is known, and for a
//!   request not streamed (no TTFT) as time to the response head − prefill − decode −
//!   gateway overhead when both engine phases are known (the engine answers at the end).
//! * Outcome: from the HTTP status (2xx ok, 429 rate limited, other 4xx client error, else
//!   upstream error; no status = `no_response`); an ok answer that was malformed or carried a
//!   stream error is an upstream error; a forced outcome (the request path's failures, cuts)
//!   wins, and gives the record a status when it has none (504 timeout, 499 cancelled,
//!   503 shutdown, 400 client error, else 502).
//! * TPOT, inter-token latencies and chunk counts are set for streams only.
//! * TTFT and end to end are split into the gateway's time, the time the engine did not
//!   account for and the engine's reported phases (`RequestRecord::split_times`, the one rule).

use super::ResponseFacts;
use std::time::Instant;
use tokenscope_core::{Endpoint, InputBucket, Outcome, PhaseSource, RequestRecord, TokenSource};

/// Outcome and error type for an upstream HTTP status.
fn outcome_for_status(status: u16) -> (Outcome, Option<String>) {
    match status {
        200..=299 => (Outcome::Ok, None),
        429 => (Outcome::UpstreamError, Some("rate_limited".into())),
        400..=499 => (Outcome::ClientError, Some(format!("http_{status}"))),
        _ => (Outcome::UpstreamError, Some(format!("http_{status}"))),
    }
}

/// Sets the record's measured fields from `f` (the request ended at `end`; `entry_estimate`
/// is the entry-time input estimate; `forced` overrides the outcome derived from the
/// response). Reads nothing but its arguments.
pub(crate) fn derive(
    rec: &mut RequestRecord,
    f: &ResponseFacts,
    entry_estimate: Option<u64>,
    end: Instant,
    forced: Option<(Outcome, &'static str)>,
) {
    let t = &f.timer;
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

    (rec.input_tokens, rec.input_tokens_source) = if let Some(n) = usage.prompt_tokens {
        (Some(n), TokenSource::Usage)
    } else if let Some(n) = timings.prompt_n {
        (Some(n + timings.cache_n.unwrap_or(0)), TokenSource::Engine)
    } else if let Some(n) = f.tgi.and_then(|t| t.prompt_tokens) {
        (Some(n), TokenSource::Engine)
    } else if let Some(n) = entry_estimate {
        (Some(n), TokenSource::Estimate)
    } else {
        (None, TokenSource::None)
    };
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
    } else if rec.endpoint == Endpoint::Embeddings && usage.prompt_tokens.is_some() {
        (Some(0), TokenSource::Usage)
    } else {
        (None, TokenSource::None)
    };
    rec.cached_tokens = usage.cached_tokens().or(timings.cache_n);
    rec.cache_creation_tokens = usage.cache_creation_tokens;
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
        let overhead = rec.gateway_overhead_ms.unwrap_or(0.0);
        if let (Some(ttft), Some(prefill)) = (rec.ttft_ms, rec.prefill_duration_ms) {
            rec.queue_duration_ms = Some((ttft - prefill - overhead).max(0.0));
            rec.queue_source = PhaseSource::Derived;
        } else if let (false, Some(headers), Some(prefill), Some(decode)) = (
            rec.stream,
            rec.upstream_headers_ms,
            rec.prefill_duration_ms,
            rec.decode_duration_ms,
        ) {
            // Not streamed: the engine answers once generation is over, so the time to its
            // response head is queue + prefill + decode (plus the engine's HTTP front end).
            rec.queue_duration_ms = Some((headers - prefill - decode - overhead).max(0.0));
            rec.queue_source = PhaseSource::Derived;
        }
    }
    // TTFT and end to end in parts that add up: gateway, unaccounted, engine phases.
    rec.split_times();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineKind, TgiHeaders};
    use std::time::Duration;
    use tokenscope_core::openai::{LlamaTimings, Usage, VllmMetrics};

    #[test]
    fn status_mapping() {
        assert_eq!(outcome_for_status(200).0, Outcome::Ok);
        assert_eq!(outcome_for_status(400).0, Outcome::ClientError);
        assert_eq!(outcome_for_status(429).0, Outcome::UpstreamError);
        assert_eq!(outcome_for_status(503).0, Outcome::UpstreamError);
    }

    /// The instant `ms` milliseconds after arrival.
    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    fn usage(prompt: Option<u64>, completion: Option<u64>) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            ..Usage::default()
        }
    }

    fn llama(
        prompt_n: Option<u64>,
        cache_n: Option<u64>,
        predicted_n: Option<u64>,
    ) -> LlamaTimings {
        LlamaTimings {
            prompt_n,
            cache_n,
            predicted_n,
            ..LlamaTimings::default()
        }
    }

    fn tgi(prompt: Option<u64>, generated: Option<u64>, queue_ms: Option<f64>) -> TgiHeaders {
        TgiHeaders {
            queue_ms,
            inference_ms: Some(1.0),
            validation_ms: None,
            total_ms: None,
            prompt_tokens: prompt,
            generated_tokens: generated,
        }
    }

    /// One row of the table: the facts (built from a fresh `ResponseFacts` whose request
    /// arrived at `t0`), what the request path knew, and the expected fields.
    struct Row {
        name: &'static str,
        endpoint: Endpoint,
        stream: bool,
        facts: fn(&mut ResponseFacts, Instant),
        estimate: Option<u64>,
        forced: Option<(Outcome, &'static str)>,
        /// The record's status before deriving (the request path's failures set it).
        status_before: u16,
        input: (Option<u64>, TokenSource),
        output: (Option<u64>, TokenSource),
        outcome: (Outcome, Option<&'static str>),
        http_status: u16,
        engine: Option<&'static str>,
    }

    fn ok(f: &mut ResponseFacts, t0: Instant) {
        f.status = Some(200);
        f.timer.mark_headers(at(t0, 5));
    }

    fn rows() -> Vec<Row> {
        let base = Row {
            name: "",
            endpoint: Endpoint::ChatCompletions,
            stream: false,
            facts: |f, t0| ok(f, t0),
            estimate: None,
            forced: None,
            status_before: 0,
            input: (None, TokenSource::None),
            output: (None, TokenSource::None),
            outcome: (Outcome::Ok, None),
            http_status: 200,
            engine: None,
        };
        vec![
            Row {
                name: "nothing known",
                ..base
            },
            Row {
                name: "usage wins over everything",
                estimate: Some(3),
                facts: |f, t0| {
                    ok(f, t0);
                    f.usage = Some(usage(Some(10), Some(20)));
                    f.timings = Some(llama(Some(1), Some(1), Some(2)));
                    f.tgi = Some(tgi(Some(5), Some(6), None));
                    f.timer.on_token_chunk(at(t0, 10));
                    f.output_bytes = 400;
                },
                input: (Some(10), TokenSource::Usage),
                output: (Some(20), TokenSource::Usage),
                engine: Some("llamacpp"),
                ..base
            },
            Row {
                name: "llama.cpp timings: prompt + cache, predicted",
                estimate: Some(3),
                facts: |f, t0| {
                    ok(f, t0);
                    f.timings = Some(llama(Some(4), Some(6), Some(9)));
                    f.tgi = Some(tgi(Some(5), Some(6), None));
                },
                input: (Some(10), TokenSource::Engine),
                output: (Some(9), TokenSource::Engine),
                engine: Some("llamacpp"),
                ..base
            },
            Row {
                name: "llama.cpp without cache_n",
                facts: |f, t0| {
                    ok(f, t0);
                    f.timings = Some(llama(Some(4), None, None));
                },
                input: (Some(4), TokenSource::Engine),
                engine: Some("llamacpp"),
                ..base
            },
            Row {
                name: "TGI headers",
                estimate: Some(3),
                facts: |f, t0| {
                    ok(f, t0);
                    f.tgi = Some(tgi(Some(5), Some(6), Some(2.0)));
                    f.timer.on_token_chunk(at(t0, 10));
                },
                input: (Some(5), TokenSource::Engine),
                output: (Some(6), TokenSource::Engine),
                engine: Some("tgi"),
                ..base
            },
            Row {
                name: "usage input, engine output",
                facts: |f, t0| {
                    ok(f, t0);
                    f.usage = Some(usage(Some(10), None));
                    f.timings = Some(llama(None, None, Some(7)));
                },
                input: (Some(10), TokenSource::Usage),
                output: (Some(7), TokenSource::Engine),
                engine: Some("llamacpp"),
                ..base
            },
            Row {
                name: "estimate input, streamed chunks output",
                stream: true,
                estimate: Some(12),
                facts: |f, t0| {
                    ok(f, t0);
                    for ms in [10, 20, 30] {
                        f.timer.on_token_chunk(at(t0, ms));
                    }
                    f.output_bytes = 400;
                },
                input: (Some(12), TokenSource::Estimate),
                output: (Some(3), TokenSource::Chunks),
                ..base
            },
            Row {
                name: "output text estimate: bytes / 4, rounded up",
                facts: |f, t0| {
                    ok(f, t0);
                    f.output_bytes = 9;
                },
                output: (Some(3), TokenSource::Estimate),
                ..base
            },
            Row {
                name: "embeddings: prompt usage means no output",
                endpoint: Endpoint::Embeddings,
                facts: |f, t0| {
                    ok(f, t0);
                    f.usage = Some(usage(Some(8), None));
                },
                input: (Some(8), TokenSource::Usage),
                output: (Some(0), TokenSource::Usage),
                ..base
            },
            Row {
                name: "chat with prompt usage only: no output count",
                facts: |f, t0| {
                    ok(f, t0);
                    f.usage = Some(usage(Some(8), None));
                },
                input: (Some(8), TokenSource::Usage),
                ..base
            },
            Row {
                name: "configured kind is trusted",
                facts: |f, t0| {
                    ok(f, t0);
                    f.kind = EngineKind::Engine(tokenscope_core::Engine::Vllm);
                    f.timings = Some(llama(None, None, None));
                },
                engine: Some("vllm"),
                ..base
            },
            Row {
                name: "vLLM metrics detected",
                facts: |f, t0| {
                    ok(f, t0);
                    f.metrics = Some(VllmMetrics::default());
                },
                engine: Some("vllm"),
                ..base
            },
            Row {
                name: "429 is rate limited",
                facts: |f, _| f.status = Some(429),
                outcome: (Outcome::UpstreamError, Some("rate_limited")),
                http_status: 429,
                ..base
            },
            Row {
                name: "4xx is a client error",
                facts: |f, _| f.status = Some(404),
                outcome: (Outcome::ClientError, Some("http_404")),
                http_status: 404,
                ..base
            },
            Row {
                name: "5xx is an upstream error",
                facts: |f, _| f.status = Some(503),
                outcome: (Outcome::UpstreamError, Some("http_503")),
                http_status: 503,
                ..base
            },
            Row {
                name: "no response",
                facts: |_, _| {},
                outcome: (Outcome::UpstreamError, Some("no_response")),
                http_status: 0,
                ..base
            },
            Row {
                name: "malformed ok answer",
                facts: |f, t0| {
                    ok(f, t0);
                    f.malformed = true;
                    f.stream_error = true;
                },
                outcome: (Outcome::UpstreamError, Some("malformed_response")),
                ..base
            },
            Row {
                name: "stream error in an ok answer",
                facts: |f, t0| {
                    ok(f, t0);
                    f.stream_error = true;
                },
                outcome: (Outcome::UpstreamError, Some("stream_error")),
                ..base
            },
            Row {
                name: "malformed error answer keeps the status's outcome",
                facts: |f, _| {
                    f.status = Some(500);
                    f.malformed = true;
                },
                outcome: (Outcome::UpstreamError, Some("http_500")),
                http_status: 500,
                ..base
            },
            Row {
                name: "forced after headers keeps the upstream's status",
                facts: |f, t0| ok(f, t0),
                forced: Some((Outcome::Cancelled, "client_disconnected")),
                outcome: (Outcome::Cancelled, Some("client_disconnected")),
                ..base
            },
            Row {
                name: "forced timeout without a status: 504",
                facts: |_, _| {},
                forced: Some((Outcome::Timeout, "upstream_header_timeout")),
                outcome: (Outcome::Timeout, Some("upstream_header_timeout")),
                http_status: 504,
                ..base
            },
            Row {
                name: "forced cancel without a status: 499",
                facts: |_, _| {},
                forced: Some((Outcome::Cancelled, "client_body_error")),
                outcome: (Outcome::Cancelled, Some("client_body_error")),
                http_status: 499,
                ..base
            },
            Row {
                name: "forced shutdown without a status: 503",
                facts: |_, _| {},
                forced: Some((Outcome::Shutdown, "gateway_shutdown")),
                outcome: (Outcome::Shutdown, Some("gateway_shutdown")),
                http_status: 503,
                ..base
            },
            Row {
                name: "forced client error without a status: 400",
                facts: |_, _| {},
                forced: Some((Outcome::ClientError, "bad_uri")),
                outcome: (Outcome::ClientError, Some("bad_uri")),
                http_status: 400,
                ..base
            },
            Row {
                name: "forced upstream error without a status: 502",
                facts: |_, _| {},
                forced: Some((Outcome::UpstreamError, "upstream_unreachable")),
                outcome: (Outcome::UpstreamError, Some("upstream_unreachable")),
                http_status: 502,
                ..base
            },
            Row {
                name: "a status set by the request path is kept",
                facts: |_, _| {},
                status_before: 413,
                forced: Some((Outcome::ClientError, "body_too_large")),
                outcome: (Outcome::ClientError, Some("body_too_large")),
                http_status: 413,
                ..base
            },
        ]
    }

    #[test]
    fn derivation_table() {
        for row in rows() {
            let t0 = Instant::now();
            let mut f = ResponseFacts::new(t0, row.endpoint);
            (row.facts)(&mut f, t0);
            let mut rec = RequestRecord {
                endpoint: row.endpoint,
                stream: row.stream,
                http_status: row.status_before,
                ..RequestRecord::default()
            };
            derive(&mut rec, &f, row.estimate, at(t0, 100), row.forced);
            let n = row.name;
            assert_eq!(
                (rec.input_tokens, rec.input_tokens_source),
                row.input,
                "{n}: input"
            );
            assert_eq!(
                (rec.output_tokens, rec.output_tokens_source),
                row.output,
                "{n}: output"
            );
            assert_eq!(
                (rec.outcome, rec.error_type.as_deref()),
                row.outcome,
                "{n}: outcome"
            );
            assert_eq!(rec.http_status, row.http_status, "{n}: status");
            assert_eq!(rec.engine.as_deref(), row.engine, "{n}: engine");
            assert_eq!(
                rec.input_bucket,
                rec.input_tokens.map(InputBucket::of),
                "{n}"
            );
            assert_eq!(rec.total_duration_ms, 100.0, "{n}: total");
            if row.stream {
                assert_eq!(rec.chunks, Some(f.timer.token_chunks()), "{n}: chunks");
            } else {
                assert_eq!(rec.chunks, None, "{n}: chunks");
                assert_eq!(rec.tpot_ms, None, "{n}: tpot");
            }
        }
    }

    #[test]
    fn stream_timings() {
        let t0 = Instant::now();
        let mut f = ResponseFacts::new(t0, Endpoint::ChatCompletions);
        f.set_stream(true);
        f.body_received(at(t0, 2));
        f.upstream_sent(at(t0, 3));
        f.headers(at(t0, 10), 200, &http::HeaderMap::new());
        for ms in [20, 30, 60] {
            f.timer.on_token_chunk(at(t0, ms));
        }
        f.usage = Some(usage(Some(5), Some(5)));
        let mut rec = RequestRecord {
            stream: true,
            ..RequestRecord::default()
        };
        derive(&mut rec, &f, None, at(t0, 70), None);
        assert_eq!(rec.ttft_ms, Some(20.0));
        assert_eq!(rec.upstream_headers_ms, Some(10.0));
        assert_eq!(rec.gateway_overhead_ms, Some(1.0));
        assert_eq!(rec.total_duration_ms, 70.0);
        assert_eq!(rec.itl_max_ms, Some(30.0));
        assert_eq!(rec.itl_mean_ms, Some(20.0));
        assert_eq!(rec.chunks, Some(3));
        // (last − first) / (n − 1)
        assert_eq!(rec.tpot_ms, Some(10.0));
        assert_eq!(f.upstream_sent_ms(), Some(3.0));
    }

    #[test]
    fn phases_table() {
        // (name, facts, queue, prefill, decode)
        type Phase = (Option<f64>, PhaseSource);
        type Facts = fn(&mut ResponseFacts, Instant);
        let rows: Vec<(&str, Facts, Phase, Phase, Phase)> = vec![
            (
                "none known",
                |f, t0| ok(f, t0),
                (None, PhaseSource::None),
                (None, PhaseSource::None),
                (None, PhaseSource::None),
            ),
            (
                "vLLM metrics",
                |f, t0| {
                    ok(f, t0);
                    f.metrics = Some(VllmMetrics {
                        queue_time_ms: Some(4.0),
                        time_to_first_token_ms: Some(8.0),
                        generation_time_ms: Some(16.0),
                        ..VllmMetrics::default()
                    });
                },
                (Some(4.0), PhaseSource::Engine),
                (Some(8.0), PhaseSource::Engine),
                (Some(16.0), PhaseSource::Engine),
            ),
            (
                "negative and non-finite engine values are dropped",
                |f, t0| {
                    ok(f, t0);
                    f.metrics = Some(VllmMetrics {
                        queue_time_ms: Some(-1.0),
                        time_to_first_token_ms: Some(f64::NAN),
                        generation_time_ms: Some(f64::INFINITY),
                        ..VllmMetrics::default()
                    });
                },
                (None, PhaseSource::None),
                (None, PhaseSource::None),
                (None, PhaseSource::None),
            ),
            (
                "llama.cpp: queue derived from TTFT − prefill − overhead",
                |f, t0| {
                    ok(f, t0);
                    f.body_received(at(t0, 0));
                    f.upstream_sent(at(t0, 2));
                    f.timer.on_token_chunk(at(t0, 50));
                    f.timings = Some(LlamaTimings {
                        prompt_ms: Some(30.0),
                        predicted_ms: Some(40.0),
                        ..LlamaTimings::default()
                    });
                },
                (Some(18.0), PhaseSource::Derived),
                (Some(30.0), PhaseSource::Engine),
                (Some(40.0), PhaseSource::Engine),
            ),
            (
                "llama.cpp not streamed: queue from the response head − prefill − decode − overhead",
                |f, t0| {
                    f.status = Some(200);
                    f.body_received(at(t0, 0));
                    f.upstream_sent(at(t0, 2));
                    f.timer.mark_headers(at(t0, 90));
                    f.timings = Some(LlamaTimings {
                        prompt_ms: Some(30.0),
                        predicted_ms: Some(40.0),
                        ..LlamaTimings::default()
                    });
                },
                (Some(18.0), PhaseSource::Derived),
                (Some(30.0), PhaseSource::Engine),
                (Some(40.0), PhaseSource::Engine),
            ),
            (
                "derived queue is never negative",
                |f, t0| {
                    ok(f, t0);
                    f.timer.on_token_chunk(at(t0, 10));
                    f.timings = Some(LlamaTimings {
                        prompt_ms: Some(30.0),
                        ..LlamaTimings::default()
                    });
                },
                (Some(0.0), PhaseSource::Derived),
                (Some(30.0), PhaseSource::Engine),
                (None, PhaseSource::None),
            ),
            (
                "TGI queue header",
                |f, t0| {
                    ok(f, t0);
                    f.tgi = Some(tgi(None, None, Some(7.0)));
                },
                (Some(7.0), PhaseSource::Engine),
                (None, PhaseSource::None),
                (None, PhaseSource::None),
            ),
        ];
        for (name, facts, queue, prefill, decode) in rows {
            let t0 = Instant::now();
            let mut f = ResponseFacts::new(t0, Endpoint::ChatCompletions);
            facts(&mut f, t0);
            let mut rec = RequestRecord::default();
            derive(&mut rec, &f, None, at(t0, 100), None);
            assert_eq!(
                (rec.queue_duration_ms, rec.queue_source),
                queue,
                "{name}: queue"
            );
            assert_eq!(
                (rec.prefill_duration_ms, rec.prefill_source),
                prefill,
                "{name}: prefill"
            );
            assert_eq!(
                (rec.decode_duration_ms, rec.decode_source),
                decode,
                "{name}: decode"
            );
        }
    }

    #[test]
    fn records_carry_the_ttft_split() {
        // llama.cpp streamed: TTFT 50, gateway 2, prefill 30 (engine), decode 40 (engine);
        // the derived queue is not an engine number: 18 ms unaccounted.
        let t0 = Instant::now();
        let mut f = ResponseFacts::new(t0, Endpoint::ChatCompletions);
        ok(&mut f, t0);
        f.body_received(at(t0, 0));
        f.upstream_sent(at(t0, 2));
        f.timer.on_token_chunk(at(t0, 50));
        f.timings = Some(LlamaTimings {
            prompt_ms: Some(30.0),
            predicted_ms: Some(40.0),
            ..LlamaTimings::default()
        });
        let mut rec = RequestRecord::default();
        derive(&mut rec, &f, None, at(t0, 100), None);
        assert_eq!(rec.ttft_unaccounted_ms, Some(18.0));
        assert_eq!(rec.e2e_unaccounted_ms, Some(100.0 - 2.0 - 30.0 - 40.0));
        assert_eq!(rec.engine_timing.as_deref(), Some("consistent"));
        // vLLM metrics claiming more than the gateway saw: flagged, not split.
        let mut f = ResponseFacts::new(t0, Endpoint::ChatCompletions);
        ok(&mut f, t0);
        f.timer.on_token_chunk(at(t0, 50));
        f.metrics = Some(VllmMetrics {
            queue_time_ms: Some(0.0),
            time_to_first_token_ms: Some(900.0),
            generation_time_ms: Some(10.0),
            ..VllmMetrics::default()
        });
        let mut rec = RequestRecord::default();
        derive(&mut rec, &f, None, at(t0, 100), None);
        assert_eq!(rec.engine_timing.as_deref(), Some("exceeds_gateway"));
        assert_eq!(rec.ttft_unaccounted_ms, None);
    }

    #[test]
    fn absorbing_events() {
        let t0 = Instant::now();
        let mut f = ResponseFacts::new(t0, Endpoint::ChatCompletions);
        f.set_stream(true);
        f.keep_output_text();
        let chunk = br#"data: {"model":"served","choices":[{"delta":{"content":"hi"}}]}"#;
        assert!(!f.absorb_event(chunk, at(t0, 10), true));
        let usage_only =
            br#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
        assert!(f.absorb_event(usage_only, at(t0, 11), true));
        assert!(!f.absorb_event(usage_only, at(t0, 11), false));
        assert!(!f.absorb_event(b"data: [DONE]", at(t0, 12), true));
        assert!(!f.malformed);
        assert!(!f.absorb_event(b"data: {oops", at(t0, 12), true));
        assert!(f.malformed);
        assert_eq!(f.model_served.as_deref(), Some("served"));
        assert_eq!(f.timer.token_chunks(), 1);
        assert_eq!(f.take_output_text().as_deref(), Some("hi"));
        let mut rec = RequestRecord {
            stream: true,
            ..RequestRecord::default()
        };
        f.headers(at(t0, 5), 200, &http::HeaderMap::new());
        derive(&mut rec, &f, None, at(t0, 20), None);
        assert_eq!(rec.input_tokens, Some(3));
        assert_eq!(rec.output_tokens, Some(1));
        assert_eq!(rec.outcome, Outcome::UpstreamError);
    }

    /// Feeds `events` (raw SSE, one per line, `at` ms after arrival) to fresh facts for a
    /// stream to `endpoint` answered 200, and derives the record at 100 ms.
    fn streamed(endpoint: Endpoint, events: &[(u64, &str)]) -> (RequestRecord, ResponseFacts) {
        let t0 = Instant::now();
        let mut f = ResponseFacts::new(t0, endpoint);
        f.set_stream(true);
        f.keep_output_text();
        f.headers(at(t0, 5), 200, &http::HeaderMap::new());
        for (ms, ev) in events {
            assert!(!f.absorb_event(ev.as_bytes(), at(t0, *ms), false));
        }
        let mut rec = RequestRecord {
            endpoint,
            stream: true,
            ..RequestRecord::default()
        };
        derive(&mut rec, &f, Some(3), at(t0, 100), None);
        (rec, f)
    }

    #[test]
    fn responses_api_stream() {
        let (rec, mut f) = streamed(
            Endpoint::Responses,
            &[
                (6, "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\"}}\n\n"),
                (7, "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"item\":{\"type\":\"message\",\"content\":[]}}\n\n"),
                (20, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hel\"}\n\n"),
                (30, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"lo\"}\n\n"),
                (50, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"!\"}\n\n"),
                (51, "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"text\":\"Hello!\"}\n\n"),
                (52, "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"model\":\"served\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hello!\"}]}],\"usage\":{\"input_tokens\":26,\"output_tokens\":3,\"total_tokens\":29,\"input_tokens_details\":{\"cached_tokens\":21}}},\"timings\":{\"cache_n\":21,\"prompt_n\":5,\"prompt_ms\":12.5,\"predicted_n\":3,\"predicted_ms\":30.0}}\n\n"),
            ],
        );
        assert_eq!(
            (rec.outcome, rec.error_type.as_deref()),
            (Outcome::Ok, None)
        );
        assert_eq!(
            (rec.input_tokens, rec.input_tokens_source),
            (Some(26), TokenSource::Usage)
        );
        assert_eq!(
            (rec.output_tokens, rec.output_tokens_source),
            (Some(3), TokenSource::Usage)
        );
        assert_eq!(
            (rec.cached_tokens, rec.cache_creation_tokens),
            (Some(21), None)
        );
        assert_eq!(rec.ttft_ms, Some(20.0));
        assert_eq!(rec.tpot_ms, Some(15.0), "(50 − 20) / (3 − 1)");
        assert_eq!(rec.chunks, Some(3));
        assert_eq!(rec.finish_reason.as_deref(), Some("stop"));
        assert_eq!(rec.model_served.as_deref(), Some("served"));
        assert_eq!(rec.engine.as_deref(), Some("llamacpp"));
        assert_eq!(rec.prefill_duration_ms, Some(12.5));
        assert_eq!(rec.decode_duration_ms, Some(30.0));
        assert_eq!(f.take_output_text().as_deref(), Some("Hello!"));
        assert_eq!(f.take_response_id().as_deref(), Some("resp_1"));
    }

    #[test]
    fn messages_api_stream_merges_usage_and_counts_cache_tokens() {
        let (rec, mut f) = streamed(
            Endpoint::Messages,
            &[
                (6, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"claude\",\"usage\":{\"input_tokens\":5,\"cache_read_input_tokens\":21,\"cache_creation_input_tokens\":4,\"output_tokens\":1}}}\n\n"),
                (7, "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n"),
                (8, "event: ping\ndata: {\"type\": \"ping\"}\n\n"),
                (20, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Hm\"}}\n\n"),
                (25, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"x\"}}\n\n"),
                (40, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"),
                (41, "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":2}}\n\n"),
                (42, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            ],
        );
        assert_eq!(rec.outcome, Outcome::Ok);
        // Every prompt token: 5 uncached + 21 read + 4 written.
        assert_eq!(
            (rec.input_tokens, rec.input_tokens_source),
            (Some(30), TokenSource::Usage)
        );
        assert_eq!(rec.input_bucket, Some(InputBucket::of(30)));
        assert_eq!(
            (rec.output_tokens, rec.output_tokens_source),
            (Some(2), TokenSource::Usage)
        );
        assert_eq!(
            (rec.cached_tokens, rec.cache_creation_tokens),
            (Some(21), Some(4))
        );
        // The first thinking delta is the first token; the signature is none.
        assert_eq!(rec.ttft_ms, Some(20.0));
        assert_eq!(rec.chunks, Some(2));
        assert_eq!(rec.tpot_ms, Some(20.0));
        assert_eq!(rec.finish_reason.as_deref(), Some("stop"));
        assert_eq!(rec.model_served.as_deref(), Some("claude"));
        assert_eq!(f.take_output_text().as_deref(), Some("HmHi"));
        assert_eq!(f.take_response_id().as_deref(), Some("msg_1"));
    }

    #[test]
    fn error_events_and_usage_less_streams() {
        // Anthropic `error` event mid-stream: an upstream error with what was seen (the
        // start's placeholder output count is no count).
        let (rec, _) = streamed(
            Endpoint::Messages,
            &[
                (5, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":1}}}\n\n"),
                (10, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"),
                (20, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"),
            ],
        );
        assert_eq!(
            (rec.outcome, rec.error_type.as_deref()),
            (Outcome::UpstreamError, Some("stream_error"))
        );
        assert_eq!(
            (rec.output_tokens, rec.output_tokens_source),
            (Some(1), TokenSource::Chunks)
        );
        assert_eq!(
            (rec.input_tokens, rec.input_tokens_source),
            (Some(7), TokenSource::Usage)
        );
        for failure in [
            "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"server_error\"}}}\n\n",
            "event: error\ndata: {\"type\":\"error\",\"code\":\"ERR\",\"message\":\"x\"}\n\n",
        ] {
            let (rec, _) = streamed(Endpoint::Responses, &[(10, failure)]);
            assert_eq!(rec.error_type.as_deref(), Some("stream_error"), "{failure}");
        }
        // A Responses stream that ends before `response.completed`: chunks and the estimate.
        let (rec, _) = streamed(
            Endpoint::Responses,
            &[
                (10, "data: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n"),
                (30, "data: {\"type\":\"response.function_call_arguments.delta\",\"delta\":\"{}\"}\n\n"),
            ],
        );
        assert_eq!(rec.outcome, Outcome::Ok);
        assert_eq!(
            (rec.output_tokens, rec.output_tokens_source),
            (Some(2), TokenSource::Chunks)
        );
        assert_eq!(rec.tpot_ms, Some(20.0));
        // `incomplete` at the output limit is the chat's `length`.
        let (rec, _) = streamed(
            Endpoint::Responses,
            &[(10, "data: {\"type\":\"response.incomplete\",\"response\":{\"status\":\"incomplete\",\"incomplete_details\":{\"reason\":\"max_output_tokens\"},\"usage\":{\"input_tokens\":4,\"output_tokens\":9}}}\n\n")],
        );
        assert_eq!(
            (rec.finish_reason.as_deref(), rec.output_tokens),
            (Some("length"), Some(9))
        );
    }

    #[test]
    fn non_streamed_bodies_of_both_apis() {
        let body = |endpoint, buf: &str| {
            let t0 = Instant::now();
            let mut f = ResponseFacts::new(t0, endpoint);
            f.headers(at(t0, 5), 200, &http::HeaderMap::new());
            f.absorb_body(buf.as_bytes(), at(t0, 50));
            let mut rec = RequestRecord {
                endpoint,
                ..RequestRecord::default()
            };
            derive(&mut rec, &f, None, at(t0, 60), None);
            rec
        };
        let r = body(
            Endpoint::Messages,
            r#"{"id":"chatcmpl-1","type":"message","content":[{"type":"text","text":"hi"}],"stop_reason":"max_tokens","usage":{"cache_read_input_tokens":21,"input_tokens":5,"output_tokens":8}}"#,
        );
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.cached_tokens),
            (Some(26), Some(8), Some(21))
        );
        assert_eq!(
            (r.finish_reason.as_deref(), r.ttft_ms, r.chunks),
            (Some("length"), None, None)
        );
        let r = body(
            Endpoint::Responses,
            r#"{"id":"resp_1","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],"usage":{"input_tokens":26,"output_tokens":8,"input_tokens_details":{"cached_tokens":0}}}"#,
        );
        assert_eq!(
            (r.input_tokens, r.output_tokens, r.cached_tokens),
            (Some(26), Some(8), Some(0))
        );
        assert_eq!(r.outcome, Outcome::Ok);
        // A chat-shaped body sent to the Responses API is no Responses body: no output.
        let r = body(
            Endpoint::Responses,
            r#"{"choices":[{"message":{"content":"hi"}}]}"#,
        );
        assert_eq!(r.output_tokens, None);
    }
}
