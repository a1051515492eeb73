//! W3C trace context (`traceparent`) for one request.
//!
//! Invariants:
//! * An incoming `traceparent` is continued only when it is valid per the W3C Trace Context
//!   spec (version not `ff`, lowercase hex, non-zero trace id and parent id, exactly four
//!   fields for version `00`); anything else starts a new trace, as the spec requires.
//! * Every id this module makes is non-zero. The root span and the `upstream` span have their
//!   own ids; the engine receives the `upstream` span as its parent, so engine spans (vLLM,
//!   SGLang) land inside the gateway's trace.
//! * The caller's sampled flag is forwarded unchanged; a new trace is marked sampled (`01`),
//!   because the gateway decides at the end of the request (tail sampling) and the engine must
//!   not drop its spans before that decision is made.

/// A 16-byte trace id.
pub type TraceId = [u8; 16];
/// An 8-byte span id.
pub type SpanId = [u8; 8];

/// The trace identity of one request: the ids of the spans the gateway will export (if the
/// request is kept) and the caller's parent, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTrace {
    /// The trace (continued or new).
    pub trace_id: TraceId,
    /// The gateway's root (SERVER) span.
    pub root_span_id: SpanId,
    /// The `upstream` (CLIENT) span: the parent the engine sees.
    pub upstream_span_id: SpanId,
    /// The caller's span, when a valid `traceparent` came in.
    pub parent_span_id: Option<SpanId>,
    /// Trace flags sent upstream (the caller's, or `01` for a new trace).
    pub flags: u8,
}

/// Lowercase hex of `bytes`.
pub use tokenscope_core::w3c::hex;
/// Parses a lowercase-hex trace id (32 characters, not all zero).
pub use tokenscope_core::w3c::parse_trace_id;
/// A parsed, valid `traceparent` (tokenscope-core's W3C parser, shared with the OTLP receiver
/// and the engine SDK).
pub use tokenscope_core::w3c::TraceParent;

/// A random non-zero span id.
pub fn new_span_id() -> SpanId {
    loop {
        let id = fastrand::u64(..).to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// A random non-zero trace id.
pub fn new_trace_id() -> TraceId {
    loop {
        let id = fastrand::u128(..).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

impl RequestTrace {
    /// Continues the caller's trace (a valid `traceparent`) or starts a new one.
    pub fn start(traceparent: Option<&str>) -> Self {
        let incoming = traceparent.and_then(TraceParent::parse);
        let root_span_id = new_span_id();
        let mut upstream_span_id = new_span_id();
        while upstream_span_id == root_span_id {
            upstream_span_id = new_span_id();
        }
        match incoming {
            Some(tp) => RequestTrace {
                trace_id: tp.trace_id,
                root_span_id,
                upstream_span_id,
                parent_span_id: Some(tp.parent_id),
                flags: tp.flags,
            },
            None => RequestTrace {
                trace_id: new_trace_id(),
                root_span_id,
                upstream_span_id,
                parent_span_id: None,
                flags: 0x01,
            },
        }
    }

    /// The trace id as 32 lowercase hex characters (the `x-tokenscope-trace-id` header and the
    /// record's `trace_id`).
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The `traceparent` sent to the engine: this trace, the `upstream` span as parent.
    pub fn upstream_traceparent(&self) -> String {
        TraceParent {
            trace_id: self.trace_id,
            parent_id: self.upstream_span_id,
            flags: self.flags,
        }
        .to_header()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn valid_traceparent_is_continued() {
        let t = RequestTrace::start(Some(TP));
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(
            t.parent_span_id.map(|p| hex(&p)).as_deref(),
            Some("00f067aa0ba902b7")
        );
        assert_eq!(t.flags, 1);
        let up = t.upstream_traceparent();
        assert!(up.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(up.ends_with("-01"));
        assert_eq!(&up[36..52], hex(&t.upstream_span_id));
        assert_ne!(t.root_span_id, t.upstream_span_id);
        // Unsampled callers stay unsampled upstream.
        let t = RequestTrace::start(Some(&TP.replace("-01", "-00")));
        assert!(t.upstream_traceparent().ends_with("-00"));
    }

    #[test]
    fn invalid_traceparents_start_a_new_trace() {
        for bad in [
            "",
            "garbage",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
            let t = RequestTrace::start(Some(bad));
            assert_eq!(t.parent_span_id, None);
            assert_ne!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
            assert_eq!(t.flags, 1);
        }
        // The parser itself (round trip, later versions) is tested in tokenscope_core::w3c.
    }

    proptest! {
        #[test]
        fn never_panics(s in ".{0,80}") {
            let _ = TraceParent::parse(&s);
            let t = RequestTrace::start(Some(&s));
            prop_assert_ne!(t.trace_id, [0u8; 16]);
            prop_assert_eq!(t.upstream_traceparent().len(), 55);
        }
    }
}
