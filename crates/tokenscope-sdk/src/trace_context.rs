//! W3C trace context of a request, as the engine received it (`traceparent` header).
//!
//! Invariant: [`TraceContext::parse`] accepts only what the W3C Trace Context spec calls valid
//! (version not `ff`, lower-case hex, non-zero trace id and parent id, exactly four fields for
//! version `00`), so a span built from it always joins the caller's trace.

/// The trace a request belongs to and the caller's span (the gateway's `upstream` span).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// 16-byte trace id.
    pub trace_id: [u8; 16],
    /// 8-byte id of the caller's span: the parent of the engine's span.
    pub parent_span_id: [u8; 8],
    /// Trace flags (`01` = sampled).
    pub flags: u8,
}

pub(crate) use tokenscope_core::w3c::hex;

impl TraceContext {
    /// Parses a `traceparent` header value; `None` when it is not valid.
    pub fn parse(traceparent: &str) -> Option<Self> {
        tokenscope_core::w3c::TraceParent::parse(traceparent).map(|tp| Self {
            trace_id: tp.trace_id,
            parent_span_id: tp.parent_id,
            flags: tp.flags,
        })
    }

    /// The trace id as 32 lower-case hex characters (the gateway's `trace_id` column).
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_valid_and_rejects_invalid() {
        let t = TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
            .expect("valid");
        assert_eq!(t.trace_id_hex(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(
            t.parent_span_id,
            [0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31]
        );
        assert_eq!(t.flags, 1);
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
        ] {
            assert!(TraceContext::parse(bad).is_none(), "{bad}");
        }
        // A future version may carry more fields.
        assert!(
            TraceContext::parse("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x")
                .is_some()
        );
    }
}
