//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the store, the pipeline or a report.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An error from SQLite.
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The database was written by a newer tokenscope with a schema this build does not know.
    #[error("database schema version {found} is newer than this build supports ({supported})")]
    SchemaTooNew {
        /// `PRAGMA user_version` found in the file.
        found: u32,
        /// The newest schema version this build knows.
        supported: u32,
    },
    /// A read-only open found an older schema than this build reads; opening it read-write
    /// once (e.g. starting the gateway) migrates it.
    #[error(
        "database schema version {found} is older than this build reads (at least {expected}); \
         open it read-write once (start the gateway on it) to migrate it"
    )]
    SchemaTooOld {
        /// `PRAGMA user_version` found in the file.
        found: u32,
        /// The oldest schema version this build reads.
        expected: u32,
    },
    /// The store cannot be written (checked with a real write when the writer opens it).
    #[error("{}: the store cannot be written: {cause}", path.display())]
    NotWritable {
        /// The database file.
        path: PathBuf,
        /// What the write attempt answered.
        cause: String,
    },
    /// A read-only open found no tokenscope schema in the file.
    #[error("{0}: not a tokenscope database (no schema); open it read-write once to create it")]
    NoSchema(PathBuf),
    /// A stored value could not be mapped back to a record field.
    #[error("column {column}: unexpected stored value {value:?}")]
    Decode {
        /// Column name.
        column: &'static str,
        /// The offending value.
        value: String,
    },
    /// A report query is malformed (bad range, zero interval, unknown dimension…).
    #[error("invalid report query: {0}")]
    InvalidQuery(String),
    /// A record sink other than SQLite failed.
    #[error("sink {sink} ({}): {message}", class.as_str())]
    Sink {
        /// [`RecordSink::name`](crate::RecordSink::name) of the sink.
        sink: &'static str,
        /// What kind of failure (drives retries and the `kind` label of the error metric).
        class: ErrorClass,
        /// What went wrong.
        message: String,
    },
    /// A sink panicked while writing a batch (the panic was contained).
    #[error("sink {0} panicked while writing a batch")]
    SinkPanicked(&'static str),
    /// File-system error (creating the database directory).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// The kind of a store failure, for retry decisions, logs and the `kind` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The store cannot be reached or timed out (connection refused, reset, 5xx, timeout):
    /// retry with backoff, the data waits in the spool.
    Unavailable,
    /// The store refused our credentials: retried (an operator may fix the password
    /// server-side), logged as an error.
    Auth,
    /// The table or database is missing (dropped): the sink recreates the schema and retries.
    Schema,
    /// The store rejected the data itself (a malformed row): retrying the same batch cannot
    /// succeed.
    Rejected,
    /// Anything else (local I/O, SQLite busy/full, a panic): retried.
    Other,
}

impl ErrorClass {
    /// Every class, in label order.
    pub const ALL: [ErrorClass; 5] = [
        ErrorClass::Unavailable,
        ErrorClass::Auth,
        ErrorClass::Schema,
        ErrorClass::Rejected,
        ErrorClass::Other,
    ];

    /// Stable lower-case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Unavailable => "unavailable",
            ErrorClass::Auth => "auth",
            ErrorClass::Schema => "schema",
            ErrorClass::Rejected => "rejected",
            ErrorClass::Other => "other",
        }
    }
}

impl StoreError {
    /// The failure's [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            StoreError::Sink { class, .. } => *class,
            StoreError::Decode { .. } | StoreError::InvalidQuery(_) => ErrorClass::Rejected,
            StoreError::SchemaTooNew { .. }
            | StoreError::SchemaTooOld { .. }
            | StoreError::NoSchema(_) => ErrorClass::Schema,
            _ => ErrorClass::Other,
        }
    }
}
