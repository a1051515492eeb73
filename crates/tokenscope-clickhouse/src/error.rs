//! [`ClickHouseError`] and its mapping to the store's [`ErrorClass`].
//!
//! ClickHouse reports failures as an HTTP status plus a body `Code: N, … DB::Exception: …`
//! (18.x) or `Code: N. DB::Exception: …` (newer, also in the `X-ClickHouse-Exception-Code`
//! header). The class is decided by the code:
//!
//! | class | codes / conditions |
//! |---|---|
//! | `Unavailable` | connection refused / reset, timeout, HTTP 5xx without a code, server overload (memory limit 241, too many parts 252, too many queries 202, timeouts 159/209, network 210/279, read-only table 242) |
//! | `Auth` | unknown user 192, wrong password 193, required password 194, authentication failed 516, HTTP 401/403 |
//! | `Schema` | unknown table 60, unknown database 81, schema newer than this build |
//! | `Rejected` | the data or statement itself (parse errors 6/26/27/33/38/41/72, type mismatch 53, unknown column 16/47, syntax 62, unknown setting 115, incorrect data 117) |
//! | `Other` | anything else |
//!
//! Invariant: messages never contain the password (it is scrubbed where an error is made).

use std::time::Duration;

use tokenscope_store::{ErrorClass, StoreError};

/// Everything that can go wrong talking to ClickHouse.
#[derive(Debug, thiserror::Error)]
pub enum ClickHouseError {
    /// The `clickhouse://` URL is malformed.
    #[error("invalid ClickHouse URL: {0}")]
    InvalidUrl(String),
    /// The connection failed (refused, reset, closed before the answer).
    #[error("ClickHouse at {addr} unreachable: {message}")]
    Unreachable {
        /// `host:port`.
        addr: String,
        /// What happened.
        message: String,
    },
    /// The server answered that it cannot serve now (5xx, overloaded).
    #[error("ClickHouse at {addr} unavailable: {message}")]
    Unavailable {
        /// `host:port`.
        addr: String,
        /// What happened.
        message: String,
    },
    /// No answer within the timeout.
    #[error("ClickHouse at {addr} did not answer within {timeout:?}")]
    Timeout {
        /// `host:port`.
        addr: String,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The server refused the credentials.
    #[error("ClickHouse authentication failed for user {user}: {message}")]
    Auth {
        /// The user name.
        user: String,
        /// The server's message.
        message: String,
    },
    /// A table or database is missing.
    #[error("ClickHouse schema missing: {message}")]
    MissingSchema {
        /// The server's error code (60 unknown table, 81 unknown database).
        code: u32,
        /// The server's message.
        message: String,
    },
    /// The schema in the database is newer than this build knows.
    #[error("ClickHouse schema version {found} in {database} is newer than this build supports ({supported})")]
    SchemaTooNew {
        /// The database.
        database: String,
        /// Highest applied migration found.
        found: u32,
        /// Newest migration this build knows.
        supported: u32,
    },
    /// The server rejected the data or the statement itself.
    #[error("ClickHouse rejected the request (code {code}): {message}")]
    Rejected {
        /// The server's error code.
        code: u32,
        /// The server's message.
        message: String,
    },
    /// Any other server-side error.
    #[error("ClickHouse error{}: {message}", code.map(|c| format!(" (code {c})")).unwrap_or_default())]
    Server {
        /// The server's error code, when it sent one.
        code: Option<u32>,
        /// The server's message.
        message: String,
    },
    /// The server's version string could not be read, or it is too old.
    #[error("unsupported ClickHouse server version {0:?}")]
    UnsupportedVersion(String),
    /// A stored value could not be mapped back to a record field.
    #[error("column {column}: unexpected stored value {value:?}")]
    Decode {
        /// The column.
        column: &'static str,
        /// The offending value.
        value: String,
    },
    /// A callback of [`crate::ClickHouseStore::for_each_tsv_line`] failed.
    #[error("{0}")]
    Callback(String),
    /// The store's runtime is gone (the store is being dropped).
    #[error("ClickHouse store runtime stopped")]
    RuntimeStopped,
}

impl ClickHouseError {
    /// The store-level class of this error (retry decisions, metrics).
    pub fn class(&self) -> ErrorClass {
        match self {
            ClickHouseError::Unreachable { .. }
            | ClickHouseError::Unavailable { .. }
            | ClickHouseError::Timeout { .. } => ErrorClass::Unavailable,
            ClickHouseError::Auth { .. } => ErrorClass::Auth,
            ClickHouseError::MissingSchema { .. } | ClickHouseError::SchemaTooNew { .. } => {
                ErrorClass::Schema
            }
            ClickHouseError::Rejected { .. }
            | ClickHouseError::Decode { .. }
            | ClickHouseError::InvalidUrl(_) => ErrorClass::Rejected,
            ClickHouseError::Server { .. }
            | ClickHouseError::UnsupportedVersion(_)
            | ClickHouseError::Callback(_)
            | ClickHouseError::RuntimeStopped => ErrorClass::Other,
        }
    }

    /// `true` for a missing table / database (the sink recreates the schema).
    pub fn is_missing_schema(&self) -> bool {
        matches!(self, ClickHouseError::MissingSchema { .. })
    }
}

impl From<ClickHouseError> for StoreError {
    fn from(e: ClickHouseError) -> Self {
        StoreError::Sink {
            sink: "clickhouse",
            class: e.class(),
            message: e.to_string(),
        }
    }
}

/// Who we talked to, to word errors (and scrub the password out of them).
#[derive(Clone)]
pub(crate) struct ErrCtx {
    pub addr: String,
    pub user: String,
    pub password: String,
}

impl ErrCtx {
    fn scrub(&self, s: &str) -> String {
        let s = s.trim();
        if self.password.is_empty() {
            s.to_owned()
        } else {
            s.replace(&self.password, "***")
        }
    }

    /// Maps an error of the `clickhouse` client.
    pub fn map(&self, e: clickhouse::error::Error) -> ClickHouseError {
        use clickhouse::error::Error as E;
        match e {
            E::Network(inner) => ClickHouseError::Unreachable {
                addr: self.addr.clone(),
                message: self.scrub(&chain(inner.as_ref())),
            },
            E::TimedOut => ClickHouseError::Unavailable {
                addr: self.addr.clone(),
                message: "timed out".to_owned(),
            },
            E::BadResponse(body) => self.classify_response(&body),
            other => ClickHouseError::Server {
                code: None,
                message: self.scrub(&other.to_string()),
            },
        }
    }

    /// Classifies a server error body (`Code: N, …` / `Code: N. …`) or a bare status line
    /// (`401 Unauthorized`).
    pub fn classify_response(&self, body: &str) -> ClickHouseError {
        let message = self.scrub(body);
        let code = error_code(&message);
        let status = if code.is_none() {
            message
                .get(..3)
                .and_then(|s| s.parse::<u16>().ok())
                .filter(|s| (100..600).contains(s))
        } else {
            None
        };
        match (code, status) {
            (Some(192 | 193 | 194 | 516), _) | (None, Some(401 | 403)) => ClickHouseError::Auth {
                user: self.user.clone(),
                message,
            },
            (Some(c @ (60 | 81)), _) => ClickHouseError::MissingSchema { code: c, message },
            (Some(159 | 202 | 209 | 210 | 241 | 242 | 252 | 279), _) | (None, Some(500..=599)) => {
                ClickHouseError::Unavailable {
                    addr: self.addr.clone(),
                    message,
                }
            }
            (Some(c @ (6 | 16 | 26 | 27 | 33 | 38 | 41 | 47 | 53 | 62 | 72 | 115 | 117)), _) => {
                ClickHouseError::Rejected { code: c, message }
            }
            (code, _) => ClickHouseError::Server { code, message },
        }
    }
}

/// The numeric code of a `Code: N…` message.
pub(crate) fn error_code(msg: &str) -> Option<u32> {
    let at = msg.find("Code: ")? + "Code: ".len();
    let digits: String = msg[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ErrCtx {
        ErrCtx {
            addr: "h:8123".to_owned(),
            user: "ts".to_owned(),
            password: "pw123".to_owned(),
        }
    }

    #[test]
    fn classes_by_code_and_status() {
        let c = ctx();
        let cases = [
            (
                "Code: 193, e.displayText() = DB::Exception: Wrong password for user ts",
                ErrorClass::Auth,
            ),
            (
                "Code: 192, e.displayText() = DB::Exception: Unknown user x",
                ErrorClass::Auth,
            ),
            (
                "Code: 516. DB::Exception: ts: Authentication failed",
                ErrorClass::Auth,
            ),
            ("401 Unauthorized", ErrorClass::Auth),
            ("403 Forbidden", ErrorClass::Auth),
            (
                "Code: 60, e.displayText() = DB::Exception: Table db.t doesn't exist.",
                ErrorClass::Schema,
            ),
            (
                "Code: 81. DB::Exception: Database db does not exist",
                ErrorClass::Schema,
            ),
            (
                "Code: 27, e.displayText() = DB::Exception: Cannot parse input",
                ErrorClass::Rejected,
            ),
            (
                "Code: 62. DB::Exception: Syntax error",
                ErrorClass::Rejected,
            ),
            (
                "Code: 241. DB::Exception: Memory limit (total) exceeded",
                ErrorClass::Unavailable,
            ),
            ("503 Service Unavailable", ErrorClass::Unavailable),
            ("Code: 999. DB::Exception: what", ErrorClass::Other),
            ("some proxy page", ErrorClass::Other),
        ];
        for (body, class) in cases {
            assert_eq!(c.classify_response(body).class(), class, "{body}");
        }
        let e =
            c.classify_response("Code: 193, e.displayText() = DB::Exception: Wrong password pw123");
        let msg = e.to_string();
        assert!(
            msg.starts_with("ClickHouse authentication failed for user ts"),
            "{msg}"
        );
        assert!(!msg.contains("pw123"), "{msg}");
        let store: StoreError = e.into();
        assert_eq!(store.class(), ErrorClass::Auth);
        assert!(
            store.to_string().starts_with("sink clickhouse (auth): "),
            "{store}"
        );
        assert_eq!(error_code("Code: 60. x"), Some(60));
        assert_eq!(error_code("no code"), None);
    }
}
