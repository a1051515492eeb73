//! The one definition of the success rate, used by the report, the dashboard, `diagnose`,
//! the gateway's alert evaluator, the exported Prometheus rules and the Grafana dashboards.
//!
//! ```text
//! success rate = ok / (ok + upstream_error + timeout + shutdown)
//! ```
//!
//! * **Success**: [`Outcome::Ok`].
//! * **Failure**: [`Outcome::UpstreamError`], [`Outcome::Timeout`], [`Outcome::Shutdown`] —
//!   the service (engine or gateway) did not deliver a response the client waited for.
//! * **Excluded**: [`Outcome::ClientError`] (the request itself was wrong) and
//!   [`Outcome::Cancelled`] (the client left before the end) say nothing about the service's
//!   health, so they are in neither term.
//!
//! Invariants:
//! * Every outcome is in exactly one class; [`success_rate`] is `None` when no request counts.
//! * The PromQL label matchers below select exactly the classes of [`Outcome::success_class`]
//!   (checked by a test over [`Outcome::ALL`]), and [`SQL_CLASS`] computes the same class in
//!   SQLite and ClickHouse.

use crate::Outcome;

/// How an outcome counts in the success rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SuccessClass {
    /// In the numerator and the denominator.
    Success,
    /// In the denominator only.
    Failure,
    /// In neither.
    Excluded,
}

impl Outcome {
    /// This outcome's class in the success rate (module docs).
    pub fn success_class(self) -> SuccessClass {
        match self {
            Outcome::Ok => SuccessClass::Success,
            Outcome::UpstreamError | Outcome::Timeout | Outcome::Shutdown => SuccessClass::Failure,
            Outcome::ClientError | Outcome::Cancelled => SuccessClass::Excluded,
        }
    }

    /// Whether this outcome counts as a success.
    pub fn counts_as_success(self) -> bool {
        self.success_class() == SuccessClass::Success
    }

    /// Whether this outcome is in the success rate's denominator.
    pub fn counts_in_success_rate(self) -> bool {
        self.success_class() != SuccessClass::Excluded
    }
}

/// Successes and counted requests, to be summed and divided once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SuccessCount {
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests in the denominator (successes and failures).
    pub counted: u64,
}

impl SuccessCount {
    /// Counts one outcome.
    pub fn add(&mut self, o: Outcome) {
        match o.success_class() {
            SuccessClass::Success => {
                self.ok += 1;
                self.counted += 1;
            }
            SuccessClass::Failure => self.counted += 1,
            SuccessClass::Excluded => {}
        }
    }

    /// `ok / counted`, `None` when nothing counts.
    pub fn rate(&self) -> Option<f64> {
        (self.counted > 0).then(|| self.ok as f64 / self.counted as f64)
    }
}

/// The success rate of some outcomes (`None` when none counts).
pub fn success_rate(outcomes: impl IntoIterator<Item = Outcome>) -> Option<f64> {
    let mut c = SuccessCount::default();
    outcomes.into_iter().for_each(|o| c.add(o));
    c.rate()
}

/// PromQL `status` matcher value of the successes (`status="ok"`).
pub const PROMQL_SUCCESS_STATUS: &str = "ok";
/// PromQL `status=~` regex of the failures.
pub const PROMQL_FAILURE_STATUSES: &str = "upstream_error|timeout|shutdown";
/// PromQL `status!~` regex of the excluded outcomes (the denominator is every other status).
pub const PROMQL_EXCLUDED_STATUSES: &str = "client_error|cancelled";

/// SQL expression (SQLite and ClickHouse) of a row's class from its `outcome` column:
/// 1 success, 0 failure, 2 excluded.
pub const SQL_CLASS: &str =
    "(outcome = 'ok') + 2 * (outcome = 'client_error' OR outcome = 'cancelled')";

/// The [`SQL_CLASS`] value of each class.
pub fn sql_class_value(c: SuccessClass) -> i64 {
    match c {
        SuccessClass::Success => 1,
        SuccessClass::Failure => 0,
        SuccessClass::Excluded => 2,
    }
}

/// The class of a [`SQL_CLASS`] value (`None` for any other value).
pub fn class_of_sql(v: i64) -> Option<SuccessClass> {
    match v {
        1 => Some(SuccessClass::Success),
        0 => Some(SuccessClass::Failure),
        2 => Some(SuccessClass::Excluded),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_regex(regex: &str, s: &str) -> bool {
        regex.split('|').any(|x| x == s)
    }

    #[test]
    fn promql_matchers_select_the_classes() {
        for o in Outcome::ALL {
            let s = o.as_str();
            let class = o.success_class();
            assert_eq!(
                s == PROMQL_SUCCESS_STATUS,
                class == SuccessClass::Success,
                "{s}"
            );
            assert_eq!(
                in_regex(PROMQL_FAILURE_STATUSES, s),
                class == SuccessClass::Failure,
                "{s}"
            );
            assert_eq!(
                in_regex(PROMQL_EXCLUDED_STATUSES, s),
                class == SuccessClass::Excluded,
                "{s}"
            );
        }
    }

    #[test]
    fn sql_class_names_the_excluded_outcomes() {
        for o in Outcome::ALL {
            let quoted = format!("'{}'", o.as_str());
            let excluded = SQL_CLASS
                .split_once("2 *")
                .is_some_and(|(_, tail)| tail.contains(&quoted));
            assert_eq!(
                excluded,
                o.success_class() == SuccessClass::Excluded,
                "{o:?}"
            );
            assert_eq!(
                class_of_sql(sql_class_value(o.success_class())),
                Some(o.success_class())
            );
        }
    }

    #[test]
    fn rate_leaves_out_excluded_outcomes() {
        use Outcome::*;
        assert_eq!(
            success_rate([Ok, Ok, Ok, UpstreamError, ClientError, Cancelled]),
            Some(0.75)
        );
        assert_eq!(success_rate([Ok, Timeout, Shutdown, Ok]), Some(0.5));
        assert_eq!(success_rate([ClientError, Cancelled]), None);
        assert_eq!(success_rate([]), None);
    }
}
