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

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

fn decode_hex(s: &str, out: &mut [u8]) -> Option<()> {
    let b = s.as_bytes();
    if b.len() != out.len() * 2 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = (hex_val(b[2 * i])? << 4) | hex_val(b[2 * i + 1])?;
    }
    Some(())
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

impl TraceContext {
    /// Parses a `traceparent` header value; `None` when it is not valid.
    pub fn parse(traceparent: &str) -> Option<Self> {
        let mut parts = traceparent.trim().split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let parent = parts.next()?;
        let flags = parts.next()?;
        let mut v = [0u8; 1];
        decode_hex(version, &mut v)?;
        if v[0] == 0xff || (v[0] == 0 && parts.next().is_some()) {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut parent_span_id = [0u8; 8];
        let mut f = [0u8; 1];
        decode_hex(trace, &mut trace_id)?;
        decode_hex(parent, &mut parent_span_id)?;
        decode_hex(flags, &mut f)?;
        if trace_id.iter().all(|&b| b == 0) || parent_span_id.iter().all(|&b| b == 0) {
            return None;
        }
        Some(Self {
            trace_id,
            parent_span_id,
            flags: f[0],
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
