//! W3C Trace Context: the `traceparent` header and the lower-case hex of trace and span ids.
//! One implementation for the gateway's tracing (`tokenscope-trace`), the OTLP receiver and the
//! engine SDK.
//!
//! Invariant: [`TraceParent::parse`] accepts only what the W3C Trace Context spec calls valid —
//! version not `ff`, lower-case hex fields of the exact widths, non-zero trace id and parent
//! id, exactly four fields for version `00` (later versions may append more) — so a span built
//! from it always joins the caller's trace.

/// A parsed, valid `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// 16-byte trace id.
    pub trace_id: [u8; 16],
    /// 8-byte id of the sender's span.
    pub parent_id: [u8; 8],
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

/// Decodes lower-case hex into `out`: exactly `2 * out.len()` characters, else `None`.
pub fn decode_hex(s: &str, out: &mut [u8]) -> Option<()> {
    let b = s.as_bytes();
    if b.len() != out.len() * 2 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = (hex_val(b[2 * i])? << 4) | hex_val(b[2 * i + 1])?;
    }
    Some(())
}

/// Lower-case hex of `bytes` (the `trace_id` column's form).
pub fn hex(bytes: &[u8]) -> String {
    crate::prompt::hex(bytes)
}

/// Parses a non-zero trace id written as 32 lower-case hex characters.
pub fn parse_trace_id(s: &str) -> Option<[u8; 16]> {
    let mut id = [0u8; 16];
    decode_hex(s, &mut id)?;
    (id != [0; 16]).then_some(id)
}

impl TraceParent {
    /// Parses a `traceparent` header value (surrounding whitespace allowed); `None` when it is
    /// not valid.
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let parent = parts.next()?;
        let flags = parts.next()?;
        let mut ver = [0u8; 1];
        decode_hex(version, &mut ver)?;
        if ver[0] == 0xff || (ver[0] == 0 && parts.next().is_some()) {
            return None;
        }
        let trace_id = parse_trace_id(trace)?;
        let mut parent_id = [0u8; 8];
        decode_hex(parent, &mut parent_id)?;
        if parent_id == [0; 8] {
            return None;
        }
        let mut fl = [0u8; 1];
        decode_hex(flags, &mut fl)?;
        Some(TraceParent {
            trace_id,
            parent_id,
            flags: fl[0],
        })
    }

    /// The header value for this context (version `00`).
    pub fn to_header(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.parent_id),
            self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_spec_example_and_rejects_invalid_values() {
        let tp = TraceParent::parse(TP).expect("valid");
        assert_eq!(hex(&tp.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&tp.parent_id), "00f067aa0ba902b7");
        assert_eq!(tp.flags, 1);
        assert_eq!(tp.to_header(), TP);
        for bad in [
            "",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A later version may carry more fields.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future"
        )
        .is_some());
    }

    proptest! {
        #[test]
        fn round_trips(t in any::<u128>(), p in any::<u64>(), f in any::<u8>()) {
            prop_assume!(t != 0 && p != 0);
            let tp = TraceParent { trace_id: t.to_be_bytes(), parent_id: p.to_be_bytes(), flags: f };
            prop_assert_eq!(TraceParent::parse(&tp.to_header()), Some(tp));
        }

        #[test]
        fn never_panics(s in ".{0,80}") {
            let _ = TraceParent::parse(&s);
        }
    }
}
