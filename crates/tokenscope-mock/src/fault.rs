//! Fault injection selected by the `x-mock-fault` request header.

use std::fmt;
use std::str::FromStr;

/// A fault the mock injects into one request, selected by the `x-mock-fault` header on
/// `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings`.
///
/// The stream faults (`malformed_sse`, `stall_mid_stream`, `drop_mid_stream`) answer with an
/// event stream whether or not the request asked for `stream`; they are rejected (400) on
/// `/v1/embeddings`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// `error_500`: HTTP 500 with an OpenAI error JSON body.
    Error500,
    /// `error_429`: HTTP 429 with an OpenAI error JSON body and `retry-after: 1`.
    Error429,
    /// `malformed_json`: HTTP 200, `application/json`, a body that is not JSON.
    MalformedJson,
    /// `malformed_sse`: a role chunk and 3 valid token chunks, then `data: {not json`, then the
    /// stream ends (no `[DONE]`).
    MalformedSse,
    /// `hang`: accepts the request and never sends headers until the server shuts down (then a
    /// 503), or one hour.
    Hang,
    /// `stall_mid_stream`: a role chunk and 3 token chunks, then nothing while the connection
    /// stays open, until the server shuts down (then the stream ends, no `[DONE]`).
    StallMidStream,
    /// `drop_mid_stream`: a role chunk and 3 token chunks, then the connection is closed
    /// abruptly (the chunked body is never terminated, no `[DONE]`).
    DropMidStream,
}

impl Fault {
    /// Every fault name, as accepted in the header.
    pub const NAMES: [&'static str; 7] = [
        "error_500",
        "error_429",
        "malformed_json",
        "malformed_sse",
        "hang",
        "stall_mid_stream",
        "drop_mid_stream",
    ];

    const ALL: [Fault; 7] = [
        Fault::Error500,
        Fault::Error429,
        Fault::MalformedJson,
        Fault::MalformedSse,
        Fault::Hang,
        Fault::StallMidStream,
        Fault::DropMidStream,
    ];

    /// The header value for this fault.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Error500 => "error_500",
            Fault::Error429 => "error_429",
            Fault::MalformedJson => "malformed_json",
            Fault::MalformedSse => "malformed_sse",
            Fault::Hang => "hang",
            Fault::StallMidStream => "stall_mid_stream",
            Fault::DropMidStream => "drop_mid_stream",
        }
    }

    /// Whether the fault answers with an event stream.
    pub fn is_stream_fault(self) -> bool {
        matches!(
            self,
            Fault::MalformedSse | Fault::StallMidStream | Fault::DropMidStream
        )
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An `x-mock-fault` value that names no fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown x-mock-fault {0:?}; known: {known}", known = Fault::NAMES.join(", "))]
pub struct UnknownFault(pub String);

impl FromStr for Fault {
    type Err = UnknownFault;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Fault::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownFault(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (name, fault) in Fault::NAMES.iter().zip(Fault::ALL) {
            assert_eq!(name.parse::<Fault>().expect("known"), fault);
            assert_eq!(fault.to_string(), *name);
        }
        assert!(" HANG ".parse::<Fault>().is_ok());
        let err = "nope".parse::<Fault>().expect_err("unknown");
        assert!(err.to_string().contains("drop_mid_stream"));
    }
}
