//! Dates, times and durations: the one calendar helper of the workspace (built on `jiff`) and
//! the one parser of human durations and of report bounds.
//!
//! * Calendar: [`UtcTime`] breaks an epoch-µs time into UTC fields; [`utc_day_bounds`] and
//!   [`utc_month_bounds`] give the UTC calendar day / month containing a time;
//!   [`format_rfc3339`], [`format_rfc3339_seconds`], [`format_rfc3339_millis`],
//!   [`format_date`], [`format_date_time`] and [`yyyymmdd`] render it.
//! * Durations: [`parse_duration`] reads `750ms`, `2s`, `1.5h`, `7d`, `2w`, `1h 30m`, and a
//!   bare number in the unit the caller names ([`BareNumber`]).
//! * Report bounds: [`parse_time_bound`] reads `@UNIX_SECONDS`, an absolute date or timestamp
//!   (`2026-12-01`, `2026-12-01T10:00:00Z`, RFC 3339 with an offset) or a duration before now.
//!
//! Invariants:
//! * Every function is total over `i64` epoch microseconds: the proleptic Gregorian calendar
//!   repeats every 400 years (146 097 days), so a time is shifted by whole cycles into the
//!   years jiff represents (1970–2369), converted there, and its year shifted back. Outputs are
//!   exact, never clamped, and never panic (arithmetic at the very ends of `i64` saturates).
//! * Formatting writes the fields itself (`{year:04}-{month:02}-…`) so the text is stable:
//!   four-digit years, `Z` for UTC, a fractional part only where a function says so.
//! * No clock is read: "now" is always an argument.

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::Timestamp;
use std::time::Duration;

/// Microseconds in a day.
pub const DAY_US: i64 = 86_400_000_000;
/// Days in 400 Gregorian years, after which the calendar repeats.
const CYCLE_DAYS: i64 = 146_097;

/// A time in UTC, broken into calendar fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtcTime {
    /// Year (proleptic Gregorian; may be ≤ 0 or above 9999 for extreme inputs).
    pub year: i64,
    /// Month, 1–12.
    pub month: u8,
    /// Day of the month, 1–31.
    pub day: u8,
    /// Hour, 0–23.
    pub hour: u8,
    /// Minute, 0–59.
    pub minute: u8,
    /// Second, 0–59.
    pub second: u8,
    /// Microseconds within the second.
    pub micros: u32,
}

/// The civil date of a day number since 1970-01-01, as (years to add, date in 1970–2369).
fn civil_day(day: i64) -> (i64, Date) {
    let cycles = day.div_euclid(CYCLE_DAYS);
    let within = day.rem_euclid(CYCLE_DAYS);
    let date = Timestamp::from_second(within * 86_400)
        .map(|t| TimeZone::UTC.to_datetime(t).date())
        .expect("days 0..146097 after 1970 are within jiff's range");
    (cycles.saturating_mul(400), date)
}

impl UtcTime {
    /// The UTC fields of epoch microseconds `us`.
    pub fn from_us(us: i64) -> Self {
        let (shift, date) = civil_day(us.div_euclid(DAY_US));
        let in_day = us.rem_euclid(DAY_US);
        let secs = in_day / 1_000_000;
        UtcTime {
            year: i64::from(date.year()).saturating_add(shift),
            month: date.month().unsigned_abs(),
            day: date.day().unsigned_abs(),
            hour: (secs / 3600) as u8,
            minute: (secs / 60 % 60) as u8,
            second: (secs % 60) as u8,
            micros: (in_day % 1_000_000) as u32,
        }
    }

    fn date_text(&self) -> String {
        format!("{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }

    fn time_text(&self) -> String {
        format!("{:02}:{:02}:{:02}", self.hour, self.minute, self.second)
    }
}

/// `[start, end)` of the UTC calendar day containing `us` (epoch µs).
pub fn utc_day_bounds(us: i64) -> (i64, i64) {
    let day = us.div_euclid(DAY_US);
    (
        day.saturating_mul(DAY_US),
        day.saturating_add(1).saturating_mul(DAY_US),
    )
}

/// `[start, end)` of the UTC calendar month containing `us` (epoch µs).
pub fn utc_month_bounds(us: i64) -> (i64, i64) {
    let day = us.div_euclid(DAY_US);
    let (_, date) = civil_day(day);
    let start = day - i64::from(date.day() - 1);
    let end = start + i64::from(date.days_in_month());
    (start.saturating_mul(DAY_US), end.saturating_mul(DAY_US))
}

/// RFC 3339 UTC: `2024-01-07T00:00:00Z`, with `.ffffff` microseconds only when non-zero.
pub fn format_rfc3339(us: i64) -> String {
    let t = UtcTime::from_us(us);
    if t.micros == 0 {
        format!("{}T{}Z", t.date_text(), t.time_text())
    } else {
        format!("{}T{}.{:06}Z", t.date_text(), t.time_text(), t.micros)
    }
}

/// RFC 3339 UTC to the second (sub-second part dropped): `2024-03-15T12:00:00Z`.
pub fn format_rfc3339_seconds(us: i64) -> String {
    let t = UtcTime::from_us(us);
    format!("{}T{}Z", t.date_text(), t.time_text())
}

/// RFC 3339 UTC with milliseconds: `2023-11-14T22:13:20.000Z`.
pub fn format_rfc3339_millis(us: i64) -> String {
    let t = UtcTime::from_us(us);
    format!(
        "{}T{}.{:03}Z",
        t.date_text(),
        t.time_text(),
        t.micros / 1000
    )
}

/// The UTC date: `2024-03-01`.
pub fn format_date(us: i64) -> String {
    UtcTime::from_us(us).date_text()
}

/// The UTC date and time to the second, for tables: `2023-11-14 22:13:20`.
pub fn format_date_time(us: i64) -> String {
    let t = UtcTime::from_us(us);
    format!("{} {}", t.date_text(), t.time_text())
}

/// The UTC date as the number `YYYYMMDD` (0 when it does not fit a `u32`).
pub fn yyyymmdd(us: i64) -> u32 {
    let t = UtcTime::from_us(us);
    t.year
        .checked_mul(10_000)
        .and_then(|y| y.checked_add(i64::from(t.month) * 100 + i64::from(t.day)))
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(0)
}

/// What a number without a unit means to [`parse_duration`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareNumber {
    /// Seconds (the command line: `--interval 60`).
    Seconds,
    /// Milliseconds (settings named `…_ms`).
    Millis,
    /// An error: a unit is required (text settings of the configuration).
    Reject,
}

/// Why a text is not a duration or a time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimeError {
    /// Not a duration.
    #[error(
        "invalid duration {0:?}: expected a number followed by ms, s, m, h, d or w (e.g. 1h, 750ms, 1h 30m)"
    )]
    Duration(String),
    /// Not a report bound.
    #[error(
        "invalid time {0:?}: expected a duration before now (15m, 7d), a date or RFC 3339 timestamp (2026-12-01, 2026-12-01T10:00:00Z, 2026-12-01T12:00:00+02:00) or @UNIX_SECONDS"
    )]
    Time(String),
}

/// The nanoseconds of one unit, or `None` for an unknown unit. Calendar units of varying
/// length (months, years) are not durations and are refused.
fn unit_nanos(unit: &str) -> Option<u128> {
    const S: u128 = 1_000_000_000;
    Some(match unit {
        "ns" | "nsec" | "nanos" => 1,
        "us" | "µs" | "usec" | "micros" => 1_000,
        "ms" | "msec" | "millis" => 1_000_000,
        "s" | "sec" | "secs" | "second" | "seconds" => S,
        "m" | "min" | "mins" | "minute" | "minutes" => 60 * S,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3600 * S,
        "d" | "day" | "days" => 86_400 * S,
        "w" | "week" | "weeks" => 7 * 86_400 * S,
        _ => return None,
    })
}

/// Parses a human duration: one or more `NUMBER UNIT` parts (`90s`, `1.5h`, `1h 30m`,
/// `1h30m`); units `ns`, `us`, `ms`, `s`, `m`/`min`, `h`, `d`, `w` and their long names. A
/// lone number without a unit is read as `bare` says. Exact (decimal, no float rounding);
/// negative, empty or overflowing values are errors.
pub fn parse_duration(text: &str, bare: BareNumber) -> Result<Duration, TimeError> {
    let err = || TimeError::Duration(text.to_owned());
    let t = text.trim();
    if t.is_empty() {
        return Err(err());
    }
    let mut rest = t;
    let mut total: u128 = 0;
    let mut parts = 0;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_len);
        let after = after.trim_start();
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.' || c.is_whitespace())
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let nanos = match (unit, parts, next.trim().is_empty()) {
            ("", 0, true) => match bare {
                BareNumber::Seconds => 1_000_000_000,
                BareNumber::Millis => 1_000_000,
                BareNumber::Reject => return Err(err()),
            },
            ("", _, _) => return Err(err()),
            (u, _, _) => unit_nanos(u).ok_or_else(err)?,
        };
        total = total
            .checked_add(decimal_times(num, nanos).ok_or_else(err)?)
            .ok_or_else(err)?;
        parts += 1;
        rest = next.trim_start();
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| err())?;
    Ok(Duration::new(secs, (total % 1_000_000_000) as u32))
}

/// `num × unit` for a decimal `num` (`12`, `1.5`, `.5`), exact to the nanosecond (truncated).
fn decimal_times(num: &str, unit: u128) -> Option<u128> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if !digits(int) || !digits(frac) || frac.len() > 18 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let mut value = int.checked_mul(unit)?;
    if !frac.is_empty() {
        let f: u128 = frac.parse().ok()?;
        value = value.checked_add(f.checked_mul(unit)? / 10u128.pow(frac.len() as u32))?;
    }
    Some(value)
}

/// Parses a report bound (`--since`, `--until`) into epoch µs:
/// * `@SECONDS`: an absolute Unix time (`@1764633600`, fractions allowed);
/// * a date (`2026-12-01`: its UTC midnight), an RFC 3339 timestamp (`2026-12-01T10:00:00Z`,
///   `2026-12-01T12:00:00+02:00`), or a date and time without offset (read as UTC);
/// * otherwise a duration before `now_us` (`15m`, `7d`, `90` = seconds).
pub fn parse_time_bound(text: &str, now_us: i64) -> Result<i64, TimeError> {
    let t = text.trim();
    if let Some(abs) = t.strip_prefix('@') {
        let secs: f64 = abs
            .trim()
            .parse()
            .map_err(|_| TimeError::Time(text.to_owned()))?;
        if !secs.is_finite() {
            return Err(TimeError::Time(text.to_owned()));
        }
        return Ok((secs * 1e6).round() as i64);
    }
    if t.starts_with(|c: char| c.is_ascii_digit()) && t.contains('-') {
        return parse_absolute(t).ok_or_else(|| TimeError::Time(text.to_owned()));
    }
    let d = parse_duration(t, BareNumber::Seconds).map_err(|_| TimeError::Time(text.to_owned()))?;
    let us = i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
    Ok(now_us.saturating_sub(us))
}

/// A date, an RFC 3339 timestamp, or a date and time without offset (UTC), as epoch µs.
fn parse_absolute(t: &str) -> Option<i64> {
    let ts = if let Ok(ts) = t.parse::<Timestamp>() {
        ts
    } else if let Ok(dt) = t.parse::<jiff::civil::DateTime>() {
        TimeZone::UTC.to_timestamp(dt).ok()?
    } else {
        let date = t.parse::<Date>().ok()?;
        TimeZone::UTC
            .to_timestamp(date.to_datetime(jiff::civil::Time::midnight()))
            .ok()?
    };
    Some(ts.as_microsecond())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 1_710_504_000_000_000; // 2024-03-15T12:00:00Z
    const S: i64 = 1_000_000;

    #[test]
    fn formats() {
        assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_rfc3339(1_704_067_200 * S), "2024-01-01T00:00:00Z");
        assert_eq!(
            format_rfc3339(1_704_067_200 * S + 59 * DAY_US + 1),
            "2024-02-29T00:00:00.000001Z"
        );
        assert_eq!(format_rfc3339(-S), "1969-12-31T23:59:59Z");
        assert_eq!(
            format_rfc3339_seconds(NOW + 999_999),
            "2024-03-15T12:00:00Z"
        );
        assert_eq!(
            format_rfc3339_millis(1_700_000_000 * S),
            "2023-11-14T22:13:20.000Z"
        );
        assert_eq!(
            format_rfc3339_millis(1_700_000_060 * S + 123_456),
            "2023-11-14T22:14:20.123Z"
        );
        assert_eq!(format_date(0), "1970-01-01");
        assert_eq!(format_date(1_709_251_200 * S), "2024-03-01");
        assert_eq!(format_date(951_782_400 * S), "2000-02-29");
        assert_eq!(format_date_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_date_time(1_700_000_000 * S), "2023-11-14 22:13:20");
        assert_eq!(yyyymmdd(0), 19_700_101);
        assert_eq!(yyyymmdd(1_704_672_000 * S), 20_240_108);
        assert_eq!(yyyymmdd(1_704_672_000 * S - 1), 20_240_107);
        assert_eq!(yyyymmdd(951_782_400 * S), 20_000_229);
        assert_eq!(yyyymmdd(-1), 19_691_231);
        // Far outside jiff's years: shifted by whole 400-year cycles.
        assert_eq!(format_date(-CYCLE_DAYS * 25 * DAY_US), "-8030-01-01");
        assert_eq!(format_date(CYCLE_DAYS * 100 * DAY_US), "41970-01-01");
    }

    #[test]
    fn calendar_bounds() {
        let f = |(s, e): (i64, i64)| (format_rfc3339(s), format_rfc3339(e));
        assert_eq!(
            f(utc_day_bounds(NOW)),
            ("2024-03-15T00:00:00Z".into(), "2024-03-16T00:00:00Z".into())
        );
        assert_eq!(
            f(utc_month_bounds(NOW)),
            ("2024-03-01T00:00:00Z".into(), "2024-04-01T00:00:00Z".into())
        );
        let dec = 1_704_067_200 * S - DAY_US + 5; // 2023-12-31
        assert_eq!(
            f(utc_month_bounds(dec)),
            ("2023-12-01T00:00:00Z".into(), "2024-01-01T00:00:00Z".into())
        );
        let feb = 951_782_400 * S; // 2000-02-29
        assert_eq!(
            f(utc_month_bounds(feb)),
            ("2000-02-01T00:00:00Z".into(), "2000-03-01T00:00:00Z".into())
        );
    }

    proptest! {
        #[test]
        fn bounds_contain_the_time(t in -4_000_000_000_000_000i64..4_000_000_000_000_000) {
            for (s, e) in [utc_day_bounds(t), utc_month_bounds(t)] {
                prop_assert!(s <= t && t < e);
                prop_assert_eq!(s.rem_euclid(DAY_US), 0);
                prop_assert!(e - s >= DAY_US && e - s <= 31 * DAY_US);
            }
            let (s, _) = utc_month_bounds(t);
            prop_assert_eq!(UtcTime::from_us(s).day, 1);
            prop_assert_eq!(UtcTime::from_us(s).month, UtcTime::from_us(t).month);
        }

        #[test]
        fn fields_match_jiff_in_its_range(t in -200_000_000_000_000_000i64..200_000_000_000_000_000) {
            let ts = Timestamp::from_microsecond(t).expect("in range");
            let dt = TimeZone::UTC.to_datetime(ts);
            let u = UtcTime::from_us(t);
            prop_assert_eq!(u.year, i64::from(dt.year()));
            prop_assert_eq!((u.month, u.day), (dt.month() as u8, dt.day() as u8));
            prop_assert_eq!((u.hour, u.minute, u.second), (dt.hour() as u8, dt.minute() as u8, dt.second() as u8));
        }

        #[test]
        fn durations_never_panic(s in "\\PC{0,12}") {
            let _ = parse_duration(&s, BareNumber::Seconds);
            let _ = parse_time_bound(&s, NOW);
        }
    }

    #[test]
    fn durations() {
        let p = |s: &str| parse_duration(s, BareNumber::Seconds);
        assert_eq!(p("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(p("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(p("15min"), Ok(Duration::from_secs(900)));
        assert_eq!(p("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(p("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(p("2w"), Ok(Duration::from_secs(14 * 86_400)));
        assert_eq!(p("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(p(" 1.5h "), Ok(Duration::from_secs(5400)));
        assert_eq!(p("0.1s"), Ok(Duration::from_millis(100)));
        assert_eq!(p("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(p("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(p("2 seconds"), Ok(Duration::from_secs(2)));
        assert_eq!(p("0s"), Ok(Duration::ZERO));
        assert_eq!(p("60"), Ok(Duration::from_secs(60)));
        assert_eq!(p("250us"), Ok(Duration::from_micros(250)));
        for bad in [
            "", "x", "1y", "1M", "-1s", "1.2.3s", "s", "1h 30", "1 2s", "1e3s", ".",
        ] {
            assert_eq!(p(bad), Err(TimeError::Duration(bad.into())), "{bad:?}");
        }
        assert!(p("99999999999999999999999w").is_err());
        assert_eq!(
            parse_duration("1500", BareNumber::Millis),
            Ok(Duration::from_millis(1500))
        );
        assert!(parse_duration("2", BareNumber::Reject).is_err());
        assert_eq!(
            parse_duration("750ms", BareNumber::Reject),
            Ok(Duration::from_millis(750))
        );
    }

    #[test]
    fn time_bounds() {
        assert_eq!(parse_time_bound("15m", NOW), Ok(NOW - 900 * S));
        assert_eq!(parse_time_bound("7d", NOW), Ok(NOW - 7 * DAY_US));
        assert_eq!(parse_time_bound("@1764633600", NOW), Ok(1_764_633_600 * S));
        assert_eq!(parse_time_bound("@1.5", NOW), Ok(1_500_000));
        assert_eq!(parse_time_bound("2026-12-01", NOW), Ok(1_796_083_200 * S));
        assert_eq!(
            parse_time_bound("2026-12-01T10:00:00Z", NOW),
            Ok(1_796_083_200 * S + 10 * 3600 * S)
        );
        assert_eq!(
            parse_time_bound("2026-12-01T12:00:00+02:00", NOW),
            Ok(1_796_083_200 * S + 10 * 3600 * S)
        );
        assert_eq!(
            parse_time_bound("2026-12-01T10:00:00.25Z", NOW),
            Ok(1_796_083_200 * S + 10 * 3600 * S + 250_000)
        );
        assert_eq!(
            parse_time_bound("2026-12-01T10:00:00", NOW),
            Ok(1_796_083_200 * S + 10 * 3600 * S)
        );
        for bad in [
            "@x",
            "@inf",
            "2026-13-01",
            "2026-12-01T25:00Z",
            "soon",
            "1y",
            "",
        ] {
            assert_eq!(
                parse_time_bound(bad, NOW),
                Err(TimeError::Time(bad.into())),
                "{bad:?}"
            );
        }
    }
}
