//! Human durations for the command line: `90s`, `15m`, `1h`, `7d`, `2w`, `500ms`, `1h 30m`; a
//! bare number is seconds. The parser is the workspace's one ([`tokenscope_core::time`]).

use std::time::Duration;
use tokenscope_core::time::{parse_duration, BareNumber};

/// Error of [`parse`].
pub use tokenscope_core::time::TimeError as DurationError;

/// Parses a human duration (a bare number is seconds).
pub fn parse(s: &str) -> Result<Duration, DurationError> {
    parse_duration(s, BareNumber::Seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("90s").expect("ok"), Duration::from_secs(90));
        assert_eq!(parse("15m").expect("ok"), Duration::from_secs(900));
        assert_eq!(parse("1h").expect("ok"), Duration::from_secs(3600));
        assert_eq!(parse("7d").expect("ok"), Duration::from_secs(7 * 86_400));
        assert_eq!(parse("500ms").expect("ok"), Duration::from_millis(500));
        assert!(parse("x").is_err());
        assert!(parse("1y").is_err());
    }
}
