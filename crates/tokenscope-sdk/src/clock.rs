//! The SDK's monotonic clock: nanoseconds since an origin [`Instant`], plus the wall-clock time
//! of that origin so finished records and spans can carry Unix timestamps.
//!
//! Invariant: [`Clock::now`] never goes backwards (it reads [`Instant`]); wall-clock values are
//! only ever derived as `wall origin + monotonic offset`, so a wall-clock step after the origin
//! does not distort durations.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Nanoseconds on the tracker's monotonic clock.
pub type Nanos = u64;

/// A monotonic clock in `u64` nanoseconds since its creation, and the Unix time of its origin.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
    origin_unix_ns: u64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self::with_origin(Instant::now(), SystemTime::now())
    }

    /// A clock with an explicit origin: `origin` is time 0 and happened at wall time `wall`.
    /// Use it to share one origin with another component, or to convert existing `Instant`s.
    pub fn with_origin(origin: Instant, wall: SystemTime) -> Self {
        let origin_unix_ns = wall
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Self {
            origin,
            origin_unix_ns,
        }
    }

    /// Nanoseconds since the origin.
    #[inline]
    pub fn now(&self) -> Nanos {
        self.at(Instant::now())
    }

    /// `instant` on this clock (0 for instants before the origin).
    #[inline]
    pub fn at(&self, instant: Instant) -> Nanos {
        duration_ns(instant.saturating_duration_since(self.origin))
    }

    /// The origin `Instant`.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Unix time (ns) of clock time `t`.
    pub fn unix_ns(&self, t: Nanos) -> u64 {
        self.origin_unix_ns.saturating_add(t)
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX` (584 years).
#[inline]
pub(crate) fn duration_ns(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_wall() {
        let c = Clock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
        assert_eq!(c.at(c.origin()), 0);
        assert_eq!(c.at(c.origin() + Duration::from_micros(5)), 5_000);
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(10);
        let c = Clock::with_origin(Instant::now(), wall);
        assert_eq!(c.unix_ns(7), 10_000_000_007);
    }
}
