//! Payload reading (every endpoint's API: chat-style, Responses, Messages) must never panic on
//! any bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tokenscope_core::openai::{parse_payload_for, RequestInfo};
use tokenscope_core::Endpoint;

fuzz_target!(|data: &[u8]| {
    for endpoint in Endpoint::ALL {
        if let Ok(info) = parse_payload_for(endpoint, data) {
            let _ = info.is_usage_only();
            if let Some(u) = info.messages_usage {
                let _ = u.to_usage();
            }
        }
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        for endpoint in Endpoint::ALL {
            let _ = RequestInfo::for_endpoint(endpoint, &v);
            let _ = tokenscope_core::prompt::normalised_prompt(endpoint, &v);
        }
    }
});
