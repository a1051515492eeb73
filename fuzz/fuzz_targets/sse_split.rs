//! The SSE splitter must never panic, must lose no byte, and must not depend on framing.
#![no_main]
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tokenscope_core::sse::{parse_event, EventSplitter};

fuzz_target!(|data: &[u8]| {
    // First byte chooses a cut point so framing varies.
    let (cut, body) = match data.split_first() {
        Some((c, rest)) => ((*c as usize) % (rest.len() + 1), rest),
        None => return,
    };
    let mut whole = Vec::new();
    let mut s = EventSplitter::new(1 << 16);
    let mut ok = true;
    for part in [&body[..cut], &body[cut..]] {
        ok &= s
            .push_bytes(&Bytes::copy_from_slice(part), |ev| {
                let _ = parse_event(&ev);
                whole.extend_from_slice(&ev);
            })
            .is_ok();
    }
    if let Some(rest) = s.finish() {
        whole.extend_from_slice(&rest);
    }
    if ok {
        assert_eq!(whole, body);
    }
});
