//! # tokenscope-backend
//!
//! The one place that maps a store setting (`store = "…"`, `--store`) to a backend: the
//! embedded SQLite file or a ClickHouse server / cluster.
//!
//! * [`StoreTarget`] — the parsed setting (`clickhouse://…` → ClickHouse; `sqlite://PATH` or a
//!   plain path → SQLite), its default spool directory and its display form without
//!   credentials.
//! * [`open_sink`] — the write side: the pipeline's [`RecordSink`] for a target (SQLite opened
//!   read-write and migrated; ClickHouse connected and migrated lazily, so a server that is
//!   down at start-up only delays writes).
//! * [`open_reader`] / [`open_reader_with`] — the read side: a
//!   [`RecordReader`](tokenscope_store::RecordReader) (records of a window, grouped reports) for
//!   a target, used by the dashboard, the budget seed, the analysis commands and
//!   `tokenscope report`.
//!
//! Dependencies point down: this crate uses `tokenscope-store` (the traits, SQLite) and
//! `tokenscope-clickhouse`; the gateway and the CLI use this crate, never a backend directly
//! to choose one.
//!
//! Invariants:
//! * Readers never create, migrate or write a store: a missing SQLite file is
//!   [`BackendError::Missing`] (nothing is created), an existing one is opened read-only.
//! * No password appears in a [`StoreTarget::display`], a log line or a [`BackendError`].
#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The ClickHouse store (re-exported for what only it does, e.g. the fleet's alert claims).
pub use tokenscope_clickhouse::ClickHouseStore;
use tokenscope_clickhouse::{ClickHouseConfig, ClickHouseError, ClickHouseSink};
use tokenscope_core::{redact_url, PhaseUpdate, RequestRecord};
use tokenscope_store::{
    ErrorClass, RecordReader, RecordSink, SqliteStore, StoreError, UnmatchedCounts,
};

/// Where records are stored, from the `store` setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreTarget {
    /// The embedded SQLite file.
    Sqlite(PathBuf),
    /// A ClickHouse server or cluster (the `clickhouse://` URL).
    ClickHouse(String),
}

impl StoreTarget {
    /// `clickhouse://…` → ClickHouse; `sqlite://PATH` or a plain path → SQLite.
    pub fn parse(s: &str) -> Self {
        if s.starts_with("clickhouse://") {
            StoreTarget::ClickHouse(s.to_owned())
        } else {
            StoreTarget::Sqlite(s.strip_prefix("sqlite://").unwrap_or(s).into())
        }
    }

    /// A file or directory kept beside the store: `<sqlite file><suffix>`, or `elsewhere`
    /// (relative to the working directory) for ClickHouse.
    fn beside(&self, suffix: &str, elsewhere: &str) -> PathBuf {
        match self {
            StoreTarget::Sqlite(p) => {
                let mut s = p.clone().into_os_string();
                s.push(suffix);
                s.into()
            }
            StoreTarget::ClickHouse(_) => elsewhere.into(),
        }
    }

    /// The spool directory used unless `[spool] dir` says otherwise.
    pub fn default_spool_dir(&self) -> PathBuf {
        self.beside(".spool", "./tokenscope-spool")
    }

    /// The business-metric sidecar file (`POST /api/business-metrics` appends to it,
    /// `tokenscope budget` reads it): `<sqlite file>.business-metrics.jsonl`, or
    /// `./tokenscope-business-metrics.jsonl` for ClickHouse.
    pub fn business_metrics_path(&self) -> PathBuf {
        self.beside(
            ".business-metrics.jsonl",
            "./tokenscope-business-metrics.jsonl",
        )
    }

    /// The location without credentials, for logs.
    pub fn display(&self) -> String {
        match self {
            StoreTarget::Sqlite(p) => p.display().to_string(),
            StoreTarget::ClickHouse(url) => redact_url(url),
        }
    }
}

/// Why a store could not be opened for reading.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The SQLite file does not exist (nothing was written yet).
    #[error("store {} does not exist (run `tokenscope serve` or `tokenscope demo` first)", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// The SQLite file exists but cannot be read as a tokenscope store.
    #[error("opening store {}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: StoreError,
    },
    /// The ClickHouse server cannot be reached or refused us (or the URL is malformed).
    #[error("connecting to {url}")]
    Connect {
        /// The URL without its password.
        url: String,
        /// Why.
        #[source]
        source: ClickHouseError,
    },
}

impl BackendError {
    /// The message with its causes, `: `-separated (for logs and JSON errors, which show one
    /// line).
    pub fn detail(&self) -> String {
        let mut s = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            s.push_str(": ");
            s.push_str(&c.to_string());
            cause = c.source();
        }
        s
    }
}

/// How a reader uses memory (SQLite only; ClickHouse readers are the same either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadProfile {
    /// One-shot commands (reports, analyses): the store's read-only defaults, a large page
    /// cache and a memory-mapped file for big scans.
    #[default]
    Batch,
    /// Inside the long-running gateway (dashboard, budget seed): a small page cache and no
    /// memory map, so reading a window does not add up to 64 MiB of cache and the mapped file
    /// to the gateway's RSS.
    Resident,
}

/// A reader for `target` with the [`ReadProfile::Batch`] profile (see [`open_reader_with`]).
pub fn open_reader(target: &StoreTarget) -> Result<Box<dyn RecordReader>, BackendError> {
    open_reader_with(target, ReadProfile::Batch)
}

/// A reader for `target`: SQLite opened read-only (a missing file is
/// [`BackendError::Missing`]; nothing is created), ClickHouse connected (checks the server
/// answers).
pub fn open_reader_with(
    target: &StoreTarget,
    profile: ReadProfile,
) -> Result<Box<dyn RecordReader>, BackendError> {
    match target {
        StoreTarget::Sqlite(path) => Ok(Box::new(open_sqlite_reader(path, profile)?)),
        StoreTarget::ClickHouse(url) => ClickHouseStore::connect_url(url)
            .map(|ch| Box::new(ch) as Box<dyn RecordReader>)
            .map_err(|source| BackendError::Connect {
                url: redact_url(url),
                source,
            }),
    }
}

fn open_sqlite_reader(path: &Path, profile: ReadProfile) -> Result<SqliteStore, BackendError> {
    if !path.exists() {
        return Err(BackendError::Missing {
            path: path.to_path_buf(),
        });
    }
    let open = |source| BackendError::Open {
        path: path.to_path_buf(),
        source,
    };
    let db = SqliteStore::open_read_only(path).map_err(open)?;
    if profile == ReadProfile::Resident {
        db.conn()
            .pragma_update(None, "cache_size", -2048)
            .and_then(|()| db.conn().pragma_update(None, "mmap_size", 0))
            .map_err(|e| open(StoreError::from(e)))?;
    }
    Ok(db)
}

/// Opens the configured store as a record sink (creating / migrating its schema). SQLite is
/// opened (and proved writable) now; ClickHouse is connected now if it answers, else on the
/// first batch (records wait in the spool meanwhile). A malformed ClickHouse URL is an error.
pub fn open_sink(target: &StoreTarget) -> Result<Box<dyn RecordSink>, StoreError> {
    match target {
        StoreTarget::Sqlite(path) => Ok(Box::new(SqliteStore::open(path)?)),
        StoreTarget::ClickHouse(url) => {
            // A malformed URL is a configuration error: refuse to start.
            let cfg = ClickHouseConfig::from_url(url)?;
            let mut sink = LazyClickHouse {
                cfg,
                url: redact_url(url),
                inner: None,
                next_sweep: std::time::Instant::now(),
            };
            // A server that is down (or refuses us) at startup must not stop the gateway:
            // records spool until it answers.
            if let Err(e) = sink.ready() {
                tracing::warn!(store = %sink.url, error = %e, "ClickHouse is not usable at startup; serving anyway, records go to the spool until it is");
            }
            Ok(Box::new(sink))
        }
    }
}

/// The ClickHouse sink, connected (and the schema migrated) on first use and again after a
/// failed connection, so that a store that is down when the gateway starts only delays the
/// writes (they wait in the spool).
struct LazyClickHouse {
    cfg: ClickHouseConfig,
    /// Redacted, for logs.
    url: String,
    inner: Option<ClickHouseSink>,
    /// When retention (`ttl_days`) is next enforced by dropping old daily partitions (servers
    /// without `TTL`; a no-op safety net on those with it). Hourly, on the writer thread.
    next_sweep: std::time::Instant,
}

impl LazyClickHouse {
    /// Drops partitions past `ttl_days` once an hour (never fails the write).
    fn sweep_if_due(&mut self) {
        let now = std::time::Instant::now();
        if self.cfg.ttl_days.is_none() || now < self.next_sweep {
            return;
        }
        self.next_sweep = now + Duration::from_secs(3600);
        if let Some(sink) = self.inner.as_ref() {
            match sink.store().retention_sweep() {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(store = %self.url, partitions = n, "retention: dropped old daily partitions")
                }
                Err(e) => {
                    tracing::warn!(store = %self.url, error = %e, "retention sweep failed; retried in an hour")
                }
            }
        }
    }

    fn ready(&mut self) -> Result<&mut ClickHouseSink, StoreError> {
        if self.inner.is_none() {
            let store = ClickHouseStore::connect(self.cfg.clone())?;
            let version = store.migrate()?;
            tracing::info!(
                store = %self.url,
                server_version = store.server_version(),
                schema_version = version,
                "ClickHouse store ready"
            );
            self.inner = Some(ClickHouseSink::new(store));
        }
        self.inner.as_mut().ok_or_else(|| StoreError::Sink {
            sink: "clickhouse",
            class: ErrorClass::Other,
            message: "not connected".to_owned(),
        })
    }
}

impl RecordSink for LazyClickHouse {
    fn write_batch(&mut self, batch: &[RequestRecord]) -> Result<(), StoreError> {
        self.ready()?.write_batch(batch)?;
        self.sweep_if_due();
        Ok(())
    }

    fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<(), StoreError> {
        self.ready()?.apply_updates(updates)
    }

    fn take_unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        self.inner
            .as_mut()
            .map(|s| s.take_unmatched(shutting_down))
            .unwrap_or_default()
    }

    fn take_recovered(&mut self) -> Vec<StoreError> {
        self.inner
            .as_mut()
            .map(|s| s.take_recovered())
            .unwrap_or_default()
    }

    fn name(&self) -> &'static str {
        "clickhouse"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_core::query::Window;

    #[test]
    fn parses_targets() {
        assert_eq!(
            StoreTarget::parse("sqlite:///tmp/x.db"),
            StoreTarget::Sqlite("/tmp/x.db".into())
        );
        assert_eq!(
            StoreTarget::parse("./t.db"),
            StoreTarget::Sqlite("./t.db".into())
        );
        let ch = StoreTarget::parse("clickhouse://u:pw@h:8123/db");
        assert_eq!(
            ch,
            StoreTarget::ClickHouse("clickhouse://u:pw@h:8123/db".into())
        );
        assert_eq!(ch.display(), "clickhouse://u:***@h:8123/db");
        assert_eq!(ch.default_spool_dir(), PathBuf::from("./tokenscope-spool"));
        assert_eq!(
            StoreTarget::parse("/d/t.db").default_spool_dir(),
            PathBuf::from("/d/t.db.spool")
        );
    }

    #[test]
    fn a_missing_sqlite_file_is_not_created() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("none.db");
        let err = open_reader(&StoreTarget::Sqlite(path.clone())).err();
        assert!(matches!(err, Some(BackendError::Missing { .. })), "{err:?}");
        assert_eq!(
            err.map(|e| e.to_string()).unwrap_or_default(),
            format!(
                "store {} does not exist (run `tokenscope serve` or `tokenscope demo` first)",
                path.display()
            )
        );
        assert!(!path.exists());
    }

    #[test]
    fn sink_then_reader_on_sqlite() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = StoreTarget::Sqlite(dir.path().join("t.db"));
        let mut sink = open_sink(&target).expect("sink");
        let rec = RequestRecord {
            request_id: "r1".to_owned(),
            trace_id: "00000000000000000000000000000001".to_owned(),
            created_at: 42,
            model: "m".to_owned(),
            upstream: "u".to_owned(),
            request_type: "chat".to_owned(),
            total_duration_ms: 1.0,
            ..RequestRecord::default()
        };
        sink.write_batch(std::slice::from_ref(&rec)).expect("write");
        drop(sink);
        for profile in [ReadProfile::Batch, ReadProfile::Resident] {
            let reader = open_reader_with(&target, profile).expect("reader");
            let got = reader.records_between(Window::new(0, 100)).expect("read");
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].request_id, "r1");
            assert_eq!(reader.kind(), "sqlite");
        }
    }

    #[test]
    fn a_bad_clickhouse_url_names_the_host_not_the_password() {
        let err = open_reader(&StoreTarget::parse("clickhouse://u:secret@/")).err();
        let msg = err.map(|e| e.detail()).unwrap_or_default();
        assert!(
            msg.starts_with("connecting to clickhouse://u:***@/"),
            "{msg}"
        );
        assert!(!msg.contains("secret"), "{msg}");
    }
}
