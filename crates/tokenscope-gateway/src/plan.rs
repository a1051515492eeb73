//! A measured request's plan, read from its body: what it asks for and what is forwarded.
//!
//! Invariants:
//! * The body is parsed as JSON once ([`RequestPlan::parse`]) and serialised at most once
//!   ([`RequestPlan::forward_body`]), only when the gateway changes it (`include_usage`
//!   injected for a stream that did not ask for usage, `include_metrics` for an upstream with
//!   `request_metrics`). Otherwise the bytes forwarded are the bytes received. The Responses and
//!   Messages APIs know neither option (their streams always carry usage): their bodies are
//!   never changed.
//! * A body that is not JSON is forwarded as received (the engine answers it); the plan is then
//!   empty (no model, not a stream, no prompt).
//! * The model and the body's `user` are bounded like header attribution
//!   ([`crate::attribution::bounded`]); the prompt hash is computed over the bounded model.
//! * The prompt's hash and sketch are not needed to forward the request: [`RequestPlan::fill`]
//!   hands them over as a [`PromptFacts`] job, which the handler runs while the engine works on
//!   the request (after the request is written upstream, never before it) and puts on the
//!   record before the record can end.

use crate::attribution::bounded;
use bytes::Bytes;
use serde_json::Value;
use tokenscope_core::openai::{inject_include_usage, RequestInfo};
use tokenscope_core::prompt::{estimate_tokens, normalised_prompt, prompt_hash, prompt_sketch};
use tokenscope_core::{Endpoint, InputBucket, RequestRecord};

/// What a request body asks for. See the module docs.
#[derive(Debug)]
pub(crate) struct RequestPlan {
    /// The endpoint the body was sent to.
    endpoint: Endpoint,
    /// The body as received.
    body: Bytes,
    /// The body parsed, when it is JSON.
    json: Option<Value>,
    /// Model, stream, usage options, `max_tokens` (`max_output_tokens`), `user`
    /// (`metadata.user_id`).
    pub info: RequestInfo,
    /// The normalised prompt, when the endpoint has one.
    prompt: Option<String>,
}

/// What the plan put on the record.
#[derive(Debug, PartialEq)]
pub(crate) struct Entry {
    /// Entry-time input estimate (from the prompt's length).
    pub estimate: Option<u64>,
    /// The prompt's hash, sketch and kept text, still to compute.
    pub prompt: Option<PromptFacts>,
}

/// The prompt's facts for the record, computed off the forwarding path
/// ([`PromptFacts::compute`]) and put on the record with [`PromptFacts::apply`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PromptFacts {
    model: String,
    norm: String,
    store: bool,
    hash: Option<String>,
    sketch: Option<u64>,
}

impl PromptFacts {
    /// Hashes and sketches the normalised prompt (idempotent).
    pub(crate) fn compute(mut self) -> Self {
        if self.hash.is_none() {
            self.hash = Some(prompt_hash(&self.model, &self.norm));
            self.sketch = prompt_sketch(&self.norm);
        }
        self
    }

    /// Puts the hash, the sketch and (when prompts are stored) the text on `rec`.
    pub(crate) fn apply(self, rec: &mut RequestRecord) {
        let done = self.compute();
        rec.prompt_hash = done.hash;
        rec.prompt_sketch = done.sketch;
        if done.store {
            rec.prompt_text = Some(done.norm);
        }
    }
}

impl RequestPlan {
    /// Parses the body (once) for a request to `endpoint`.
    pub(crate) fn parse(endpoint: Endpoint, body: Bytes) -> Self {
        let json: Option<Value> = serde_json::from_slice(&body).ok();
        let info = json
            .as_ref()
            .map(|v| RequestInfo::for_endpoint(endpoint, v))
            .unwrap_or_default();
        let prompt = json.as_ref().and_then(|v| normalised_prompt(endpoint, v));
        RequestPlan {
            endpoint,
            body,
            json,
            info,
            prompt,
        }
    }

    /// The requested model, unbounded (routing and tokenizer choice use it as sent).
    pub(crate) fn model(&self) -> Option<&str> {
        self.info.model.as_deref()
    }

    /// Whether the gateway asks for streamed usage itself: a stream that did not ask for it,
    /// with `inject_stream_usage` on, to an endpoint that reports usage only when asked.
    pub(crate) fn asks_usage(&self, inject_stream_usage: bool) -> bool {
        self.info.stream
            && !self.info.include_usage
            && inject_stream_usage
            && self.endpoint.usage_on_request()
    }

    /// Puts what the body says on the record: model, stream, `max_tokens`, the body's `user`
    /// (when no header set one), input bucket from the entry estimate; the prompt's hash,
    /// sketch and (when `store_prompts`) text come back in [`Entry::prompt`], to put on the
    /// record with [`PromptFacts::apply`]. Values are bounded at `max_attr` bytes.
    pub(crate) fn fill(
        &mut self,
        rec: &mut RequestRecord,
        max_attr: usize,
        store_prompts: bool,
    ) -> Entry {
        rec.model = self
            .info
            .model
            .as_deref()
            .map(|m| bounded(m, max_attr))
            .unwrap_or_default();
        rec.stream = self.info.stream;
        rec.max_tokens = self.info.max_tokens;
        if rec.user_id.is_none() {
            rec.user_id = self.info.user.as_deref().map(|u| bounded(u, max_attr));
        }
        let mut entry = Entry {
            estimate: None,
            prompt: None,
        };
        if let Some(norm) = self.prompt.take() {
            let est = estimate_tokens(&norm);
            entry.estimate = Some(est);
            rec.input_bucket = Some(InputBucket::of(est));
            entry.prompt = Some(PromptFacts {
                model: rec.model.clone(),
                norm,
                store: store_prompts,
                hash: None,
                sketch: None,
            });
        }
        entry
    }

    /// The body to forward, serialised at most once: with `stream_options.include_usage` set
    /// when `ask_usage`, and `include_metrics: true` when `ask_metrics` (a JSON object only).
    /// With `keep_parsed`, [`Forward::parsed`] is the body as the client sent it (for the entry
    /// count; copied only when the gateway changed the forwarded body).
    pub(crate) fn forward_body(
        self,
        ask_usage: bool,
        ask_metrics: bool,
        keep_parsed: bool,
    ) -> Forward {
        let RequestPlan {
            endpoint,
            body,
            json,
            ..
        } = self;
        // The Responses and Messages APIs know neither option (see the module docs).
        let ask_usage = ask_usage && endpoint.usage_on_request();
        let ask_metrics =
            ask_metrics && !matches!(endpoint, Endpoint::Responses | Endpoint::Messages);
        let Some(mut v) = json else {
            return Forward {
                body,
                strip_usage: false,
                parsed: None,
            };
        };
        let is_object = v.is_object();
        let usage_possible = is_object && v.get("stream_options").is_none_or(Value::is_object);
        let changes = (ask_usage && usage_possible) || (ask_metrics && is_object);
        if !changes {
            return Forward {
                body,
                strip_usage: false,
                parsed: keep_parsed.then_some(v),
            };
        }
        let parsed = keep_parsed.then(|| v.clone());
        let injected = ask_usage && inject_include_usage(&mut v);
        if let (true, Some(obj)) = (ask_metrics, v.as_object_mut()) {
            obj.insert("include_metrics".into(), Value::Bool(true));
        }
        match serde_json::to_vec(&v) {
            Ok(b) => Forward {
                body: Bytes::from(b),
                strip_usage: injected,
                parsed,
            },
            Err(_) => Forward {
                body,
                strip_usage: false,
                parsed,
            },
        }
    }
}

/// The body forwarded to the upstream (see [`RequestPlan::forward_body`]).
#[derive(Debug)]
pub(crate) struct Forward {
    /// The bytes to send.
    pub body: Bytes,
    /// `include_usage` was injected: the usage-only event is stripped from what the client
    /// sees.
    pub strip_usage: bool,
    /// The body as the client sent it, parsed (when asked for and JSON).
    pub parsed: Option<Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(body: &str) -> RequestPlan {
        RequestPlan::parse(
            Endpoint::ChatCompletions,
            Bytes::copy_from_slice(body.as_bytes()),
        )
    }

    #[test]
    fn forward_body_table() {
        let chat = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        // (body, ask_usage, ask_metrics, forwarded, stripped)
        let rows: &[(&str, bool, bool, &str, bool)] = &[
            (chat, false, false, chat, false),
            (
                chat,
                true,
                false,
                r#"{"messages":[{"content":"hi","role":"user"}],"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
                true,
            ),
            (
                chat,
                false,
                true,
                r#"{"include_metrics":true,"messages":[{"content":"hi","role":"user"}],"model":"m","stream":true}"#,
                false,
            ),
            (
                chat,
                true,
                true,
                r#"{"include_metrics":true,"messages":[{"content":"hi","role":"user"}],"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
                true,
            ),
            // Not JSON: forwarded as received.
            ("{not json", true, true, "{not json", false),
            // JSON but not an object: nothing to add.
            ("[1,2]", true, true, "[1,2]", false),
            // `stream_options` that is not an object: usage cannot be injected.
            (
                r#"{"stream":true,"stream_options":3}"#,
                true,
                false,
                r#"{"stream":true,"stream_options":3}"#,
                false,
            ),
            (
                r#"{"stream":true,"stream_options":3}"#,
                true,
                true,
                r#"{"include_metrics":true,"stream":true,"stream_options":3}"#,
                false,
            ),
        ];
        for (i, (body, usage, metrics, want, strip)) in rows.iter().enumerate() {
            let f = plan(body).forward_body(*usage, *metrics, true);
            let (got, stripped) = (f.body, f.strip_usage);
            // What the entry count reads is the body as sent, whatever was forwarded.
            assert_eq!(
                f.parsed,
                serde_json::from_str::<Value>(body).ok(),
                "row {i}"
            );
            if want == body {
                // Unchanged: the very bytes received.
                assert_eq!(&got[..], body.as_bytes(), "row {i}");
            } else {
                let got: Value = serde_json::from_slice(&got).expect("json");
                let want: Value = serde_json::from_str(want).expect("json");
                assert_eq!(got, want, "row {i}");
            }
            assert_eq!(stripped, *strip, "row {i}");
        }
    }

    #[test]
    fn responses_and_messages_bodies_are_never_changed() {
        for (endpoint, body) in [
            (
                Endpoint::Responses,
                r#"{"model":"m","stream":true,"input":"hi","max_output_tokens":5,"user":"u"}"#,
            ),
            (
                Endpoint::Messages,
                r#"{"model":"m","stream":true,"max_tokens":5,"metadata":{"user_id":"u"},"messages":[{"role":"user","content":"hi"}]}"#,
            ),
        ] {
            let p = RequestPlan::parse(endpoint, Bytes::copy_from_slice(body.as_bytes()));
            assert!(!p.asks_usage(true), "{endpoint:?}");
            let f = p.forward_body(true, true, true);
            assert_eq!(&f.body[..], body.as_bytes(), "{endpoint:?}");
            assert!(!f.strip_usage);
            let mut p = RequestPlan::parse(endpoint, Bytes::copy_from_slice(body.as_bytes()));
            let mut rec = RequestRecord::default();
            let mut entry = p.fill(&mut rec, 64, false);
            entry.prompt.take().expect("a prompt").apply(&mut rec);
            assert_eq!(rec.max_tokens, Some(5), "{endpoint:?}");
            assert_eq!(rec.user_id.as_deref(), Some("u"), "{endpoint:?}");
            assert!(rec.stream && rec.prompt_hash.is_some() && entry.estimate.is_some());
        }
    }

    #[test]
    fn asks_usage_only_for_streams_without_it() {
        assert!(plan(r#"{"stream":true}"#).asks_usage(true));
        assert!(!plan(r#"{"stream":true}"#).asks_usage(false));
        assert!(!plan(r#"{"stream":false}"#).asks_usage(true));
        assert!(
            !plan(r#"{"stream":true,"stream_options":{"include_usage":true}}"#).asks_usage(true)
        );
    }

    #[test]
    fn fill_puts_the_body_on_the_record() {
        let mut p = plan(
            r#"{"model":"a-long-model","user":"u","max_tokens":7,"stream":true,"messages":[{"role":"user","content":"hello there"}]}"#,
        );
        let mut rec = RequestRecord::default();
        let mut entry = p.fill(&mut rec, 6, true);
        assert_eq!(rec.prompt_hash, None, "computed off the forwarding path");
        let facts = entry.prompt.take().expect("a prompt").compute();
        // Computed once; applying computes nothing more and gives the same hash.
        assert_eq!(facts.clone().compute(), facts);
        facts.apply(&mut rec);
        assert_eq!(
            rec.model,
            format!("a-long{}", crate::attribution::TRUNCATED)
        );
        assert!(rec.stream);
        assert_eq!(rec.max_tokens, Some(7));
        assert_eq!(rec.user_id.as_deref(), Some("u"));
        let est = entry.estimate.expect("estimate");
        assert_eq!(rec.input_bucket, Some(InputBucket::of(est)));
        let text = rec.prompt_text.clone().expect("prompts kept");
        assert!(text.contains("hello there"), "{text}");
        assert_eq!(
            rec.prompt_hash.as_deref(),
            Some(prompt_hash(&rec.model, &text).as_str()),
            "over the bounded model"
        );
        assert_eq!(rec.prompt_sketch, prompt_sketch(&text));

        // A header's user wins; prompts are not kept unless asked.
        let mut p = plan(r#"{"user":"body","messages":[{"role":"user","content":"x"}]}"#);
        let mut rec = RequestRecord {
            user_id: Some("header".into()),
            ..RequestRecord::default()
        };
        if let Some(f) = p.fill(&mut rec, 64, false).prompt {
            f.apply(&mut rec);
        }
        assert_eq!(rec.user_id.as_deref(), Some("header"));
        assert_eq!(rec.prompt_text, None);
        assert_eq!(rec.model, "");

        // Not JSON: nothing but the defaults.
        let mut p = plan("nope");
        let mut rec = RequestRecord::default();
        assert_eq!(
            p.fill(&mut rec, 64, true),
            Entry {
                estimate: None,
                prompt: None
            }
        );
        assert_eq!(rec.prompt_hash, None);
        assert!(!rec.stream);
    }
}
