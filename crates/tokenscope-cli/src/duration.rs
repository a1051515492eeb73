//! Human durations for the command line: `90s`, `15m`, `1h`, `7d`, `2w`, `500ms`.

use std::time::Duration;

/// Error of [`parse`].
#[derive(Debug, thiserror::Error)]
#[error("invalid duration {0:?}: expected a number followed by ms, s, m, h, d or w (e.g. 1h)")]
pub struct DurationError(String);

/// Parses a human duration.
pub fn parse(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| DurationError(s.to_owned()))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        "w" => n * 7.0 * 86_400.0,
        _ => return Err(DurationError(s.to_owned())),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(DurationError(s.to_owned()));
    }
    Ok(Duration::from_secs_f64(secs))
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
