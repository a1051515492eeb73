//! Incremental Server-Sent-Events splitting and parsing.
//!
//! [`EventSplitter`] receives the response body frame by frame, exactly as the network delivered
//! it, and yields each complete *raw* event (its bytes including the terminating blank line).
//! The gateway forwards raw events unchanged, so what the client receives is byte-for-byte what
//! the engine sent; [`parse_event`] reads the fields of one raw event.
//!
//! Invariants:
//! * Memory is bounded: at most one incomplete event is buffered, capped at `max_event_bytes`.
//!   Beyond that the splitter reports [`SplitError::EventTooLarge`] and the caller falls back to
//!   blind pass-through.
//! * The concatenation of all yielded raw events plus [`EventSplitter::finish`] equals the input.
//! * No input makes it panic (property-tested and fuzzed).

use bytes::{Bytes, BytesMut};
use std::borrow::Cow;

/// Errors of [`EventSplitter::push`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SplitError {
    /// An event grew beyond the configured limit without a terminating blank line.
    #[error("SSE event larger than {limit} bytes")]
    EventTooLarge {
        /// The configured limit.
        limit: usize,
    },
}

/// Splits a byte stream into raw SSE events. See the module docs.
#[derive(Debug)]
pub struct EventSplitter {
    pending: BytesMut,
    /// Where to resume searching for a boundary in `pending` (avoids rescans).
    scan_from: usize,
    max_event_bytes: usize,
}

impl EventSplitter {
    /// A splitter that buffers at most `max_event_bytes` of one incomplete event.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            pending: BytesMut::new(),
            scan_from: 0,
            max_event_bytes,
        }
    }

    /// Bytes currently held back (an incomplete event).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Appends `chunk` and calls `on_event` with each event completed by it, in order.
    pub fn push(
        &mut self,
        chunk: &[u8],
        mut on_event: impl FnMut(Bytes),
    ) -> Result<(), SplitError> {
        self.pending.extend_from_slice(chunk);
        loop {
            match find_boundary(&self.pending, self.scan_from) {
                Some(end) => {
                    let raw = self.pending.split_to(end).freeze();
                    self.scan_from = 0;
                    on_event(raw);
                }
                None => {
                    // A boundary can straddle the previous scan position by up to 3 bytes.
                    self.scan_from = self.pending.len().saturating_sub(3);
                    break;
                }
            }
        }
        if self.pending.len() > self.max_event_bytes {
            return Err(SplitError::EventTooLarge {
                limit: self.max_event_bytes,
            });
        }
        Ok(())
    }

    /// Like [`EventSplitter::push`] for a chunk already in a [`Bytes`]: when nothing is pending
    /// (the common case: engines write whole events) complete events are yielded as zero-copy
    /// slices of `chunk`, and only a trailing incomplete event is copied.
    pub fn push_bytes(
        &mut self,
        chunk: &Bytes,
        mut on_event: impl FnMut(Bytes),
    ) -> Result<(), SplitError> {
        if !self.pending.is_empty() {
            return self.push(chunk, on_event);
        }
        let mut start = 0;
        while let Some(end) = find_boundary(&chunk[start..], 0) {
            on_event(chunk.slice(start..start + end));
            start += end;
        }
        if start < chunk.len() {
            self.push(&chunk[start..], on_event)?;
        }
        Ok(())
    }

    /// Takes whatever is left at end of stream (an event without its blank line), if any.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.scan_from = 0;
        (!self.pending.is_empty()).then(|| self.pending.split().freeze())
    }
}

/// Index just past the first event terminator (`\n\n`, `\r\n\r\n`, `\r\r`, or mixed) at or
/// after `from`.
fn find_boundary(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < buf.len() {
        // Jump to the next line terminator (memchr is SIMD-accelerated).
        match memchr::memchr2(b'\n', b'\r', &buf[i..]) {
            Some(off) => i += off,
            None => return None,
        }
        // Position after a line terminator starting at i, if any.
        let after_first = match buf[i] {
            b'\n' => i + 1,
            b'\r' => {
                if buf.get(i + 1) == Some(&b'\n') {
                    i + 2
                } else if i + 1 < buf.len() {
                    i + 1
                } else {
                    // A lone trailing '\r' may be the start of "\r\n": wait for more bytes.
                    return None;
                }
            }
            _ => {
                i += 1;
                continue;
            }
        };
        // A terminator immediately followed by another one is a blank line.
        match buf.get(after_first) {
            Some(b'\n') => return Some(after_first + 1),
            Some(b'\r') => match buf.get(after_first + 1) {
                Some(b'\n') => return Some(after_first + 2),
                Some(_) => return Some(after_first + 1),
                None => return None,
            },
            _ => {}
        }
        i = after_first;
    }
    None
}

/// The fields of one SSE event that the gateway cares about (borrowed from the raw event when
/// it is a single valid UTF-8 `data:` line, the common case: no allocation).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent<'a> {
    /// The `event:` field, if present.
    pub event: Option<Cow<'a, str>>,
    /// The `data:` lines joined with `\n`; `None` when the event has no data line.
    pub data: Option<Cow<'a, str>>,
}

/// Parses one raw event (as yielded by [`EventSplitter`]). Lines that are not valid UTF-8 are
/// decoded lossily; comment lines (`:`) and unknown fields are ignored.
pub fn parse_event(raw: &[u8]) -> SseEvent<'_> {
    let mut ev = SseEvent::default();
    for line in split_lines(raw) {
        if line.is_empty() || line[0] == b':' {
            continue;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(p) => {
                let v = &line[p + 1..];
                (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field != b"data" && field != b"event" {
            continue;
        }
        // Valid UTF-8 (every engine's case) is borrowed after the fast check; invalid bytes
        // become U+FFFD as before.
        let value = match std::str::from_utf8(value) {
            Ok(v) => std::borrow::Cow::Borrowed(v),
            Err(_) => String::from_utf8_lossy(value),
        };
        match field {
            b"data" => match &mut ev.data {
                Some(d) => {
                    let d = d.to_mut();
                    d.push('\n');
                    d.push_str(&value);
                }
                None => ev.data = Some(value),
            },
            b"event" => ev.event = Some(value),
            _ => {}
        }
    }
    ev
}

/// The `data:` lines of one raw event joined with `\n`, as bytes: what [`parse_event`] gives
/// as `data`, without its UTF-8 check (a JSON parser checks its strings itself). Borrowed when
/// the event has one `data:` line (every engine's case); `None` without a data line.
pub fn event_data(raw: &[u8]) -> Option<Cow<'_, [u8]>> {
    let mut data: Option<Cow<'_, [u8]>> = None;
    for line in split_lines(raw) {
        let Some(v) = line.strip_prefix(b"data") else {
            continue;
        };
        let v = match v.first() {
            None => &b""[..],
            Some(b':') => v[1..].strip_prefix(b" ").unwrap_or(&v[1..]),
            Some(_) => continue, // another field whose name starts with "data"
        };
        match &mut data {
            Some(d) => {
                let d = d.to_mut();
                d.push(b'\n');
                d.extend_from_slice(v);
            }
            None => data = Some(Cow::Borrowed(v)),
        }
    }
    data
}

fn split_lines(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = raw;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        match rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(p) => {
                let line = &rest[..p];
                let skip = if rest[p] == b'\r' && rest.get(p + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                rest = &rest[p + skip..];
                Some(line)
            }
            None => {
                let line = rest;
                rest = &[];
                Some(line)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split_all(chunks: &[&[u8]]) -> (Vec<Bytes>, Option<Bytes>) {
        let mut s = EventSplitter::new(1 << 20);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, |e| out.push(e)).expect("within limit");
        }
        let rest = s.finish();
        (out, rest)
    }

    #[test]
    fn splits_on_blank_lines() {
        let (evs, rest) = split_all(&[b"data: a\n\ndata: b\n", b"\ndata: c"]);
        assert_eq!(
            evs,
            vec![Bytes::from("data: a\n\n"), Bytes::from("data: b\n\n")]
        );
        assert_eq!(rest, Some(Bytes::from("data: c")));
    }

    #[test]
    fn crlf_split_across_frames() {
        let (evs, rest) = split_all(&[b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"]);
        assert_eq!(
            evs,
            vec![
                Bytes::from("data: a\r\n\r\n"),
                Bytes::from("data: b\r\n\r\n")
            ]
        );
        assert_eq!(rest, None);
    }

    #[test]
    fn parses_fields() {
        let ev = parse_event(b": comment\nevent: x\ndata: {\"a\":1}\ndata:two\n\n");
        assert_eq!(ev.event.as_deref(), Some("x"));
        assert_eq!(ev.data.as_deref(), Some("{\"a\":1}\ntwo"));
        assert_eq!(
            parse_event(b"data: [DONE]\n\n").data.as_deref(),
            Some("[DONE]")
        );
        assert_eq!(parse_event(b": keepalive\n\n").data, None);
    }

    #[test]
    fn too_large_is_reported() {
        let mut s = EventSplitter::new(8);
        assert!(s.push(b"data: 0123456789", |_| {}).is_err());
    }

    proptest! {
        /// `event_data` is `parse_event`'s data, as bytes, for every valid UTF-8 event
        /// (fields, comments, `data` without a colon, CR/LF/CRLF, several data lines).
        #[test]
        fn event_data_is_parse_events_data(raw in "(data|data:|data: |datum:|event: |:|id: )?[a-z \"{}]{0,12}([\r\n]{1,2}(data|data:|data: |datax:|event:|:)?[a-z {}]{0,12}){0,5}") {
            let want = parse_event(raw.as_bytes()).data.map(|d| d.into_owned().into_bytes());
            let got = event_data(raw.as_bytes()).map(|d| d.into_owned());
            prop_assert_eq!(got, want, "{:?}", raw);
        }

        /// Splitting is independent of how the stream is cut into frames, and loses no byte.
        #[test]
        fn framing_invariant(
            events in proptest::collection::vec("[a-z {}:\"\r\n]{0,40}", 0..20),
            cuts in proptest::collection::vec(0usize..400, 0..10),
        ) {
            let stream: Vec<u8> = events.join("\n\n").into_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c <= stream.len()).collect();
            cuts.sort_unstable();
            let mut chunks: Vec<&[u8]> = Vec::new();
            let mut prev = 0;
            for c in cuts { chunks.push(&stream[prev..c]); prev = c; }
            chunks.push(&stream[prev..]);
            let (evs, rest) = split_all(&chunks);
            let (whole, whole_rest) = split_all(&[&stream]);
            // The zero-copy path yields the same events.
            let mut s = EventSplitter::new(1 << 20);
            let mut zc = Vec::new();
            for c in &chunks {
                s.push_bytes(&Bytes::copy_from_slice(c), |e| zc.push(e)).expect("within limit");
            }
            prop_assert_eq!(&zc, &evs);
            prop_assert_eq!(&s.finish(), &rest);
            prop_assert_eq!(&evs, &whole);
            prop_assert_eq!(&rest, &whole_rest);
            let mut joined: Vec<u8> = evs.iter().flat_map(|b| b.to_vec()).collect();
            if let Some(r) = rest { joined.extend_from_slice(&r); }
            prop_assert_eq!(joined, stream);
        }

        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_event(&raw);
            let mut s = EventSplitter::new(64);
            let _ = s.push(&raw, |e| { let _ = parse_event(&e); });
        }
    }
}
