//! OpenAI payload reading must never panic on any bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tokenscope_core::openai::{parse_payload, RequestInfo};

fuzz_target!(|data: &[u8]| {
    if let Ok(info) = parse_payload(data) {
        let _ = info.is_usage_only();
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = RequestInfo::from_json(&v);
    }
});
