//! [`SqliteStore`]: the embedded per-request store.
//!
//! One table, `llm_inference_log`, with one column per [`RequestRecord`] field under the
//! same name. Units follow the record: `created_at` is Unix epoch **microseconds**
//! (`INTEGER`), every `*_ms` column is milliseconds as `REAL`, token counts are `INTEGER`,
//! enums are stored as their `as_str()` text (`outcome = 'ok'`, `input_bucket = '0-128'`,
//! `endpoint = 'chat_completions'`…), `stream` is `0`/`1`. Optional fields are `NULL` when
//! unknown — a `NULL` `ttft_ms` means "not measured", never zero.
//!
//! Invariants:
//! * The schema is versioned with `PRAGMA user_version`; [`SqliteStore::open`] applies the
//!   pending entries of an ordered migration list in one `IMMEDIATE` transaction, so opening
//!   is idempotent and two processes opening the same file concurrently cannot both migrate.
//!   A file with a newer version than this build knows is refused
//!   ([`StoreError::SchemaTooNew`]).
//! * The database runs in WAL mode with `synchronous=NORMAL` and a busy timeout, so one
//!   writer (the gateway's pipeline thread) and any number of readers (reports, opened with
//!   [`SqliteStore::open_read_only`]) coexist without blocking each other.
//! * Rows are keyed by `request_id` (the gateway's own UUIDv7, never the client's
//!   `x-request-id`, which is the `client_request_id` column) and inserted with
//!   `INSERT OR IGNORE`: re-inserting a batch (a retry after an ambiguous failure, a spool
//!   replay) never doubles a row, and [`SqliteStore::insert_batch`] returns how many rows
//!   were really added.
//! * [`SqliteStore::open`] proves the file writable with a real write (a committed header
//!   update) and refuses it otherwise ([`StoreError::NotWritable`], naming the path and the
//!   cause): a store SQLite could only open read-only is never accepted.
//! * The writer compares `stat(path)` (device, inode) with the file it opened before every
//!   write (one system call): when the file was unlinked or replaced, it closes the old
//!   connection, removes the stale `-wal` / `-shm` beside the path (SQLite would replay the
//!   old file's pages into the new one), opens the path again (created and migrated) and
//!   reports the reopen ([`SqliteStore::take_reopened`]). A batch committed while the file
//!   was being replaced (detected by the same check right after the commit) is written again
//!   into the new file. Rows written to the old file before the unlink stay in it.
//! * [`SqliteStore::insert_batch`] writes a whole batch in one transaction (cached
//!   multi-row prepared statements, 32 rows each, then the remainder row by row): a batch
//!   is all-or-nothing.
//! * Late engine values ([`PhaseUpdate`]) follow [`crate::late`] (the rule, merging, waiting
//!   and the insert-time join, stated once for every store). This store supplies the I/O: the
//!   rows of a trace are found through the writer's trace map ([`crate::trace_rows`]: the
//!   `created_at` range of the rows of each of the last 65 536 trace ids by default, rebuilt
//!   from the newest rows on open) and a seek on the time index, read, updated by
//!   [`RequestRecord::apply_update`] and written back by `rowid`, all in one transaction
//!   ([`SqliteStore::apply_updates`]); an update for an older row, or for a trace never seen,
//!   waits in the pending map and expires there (counted). Updates waiting for a row are
//!   applied to the records of a batch before it is inserted, and forgotten only once that
//!   transaction committed. If a client reuses one trace id for several requests, an update
//!   reaches every row of that trace (the span carries nothing finer to join on).
//!
//! ## Schema versions
//!
//! * v1 — the table and its indexes.
//! * v2 — columns `engine TEXT`, `input_tokens_entry INTEGER`, `engine_running REAL`,
//!   `engine_waiting REAL`, `engine_kv_usage REAL`, `gpu_utilization REAL`,
//!   `gpu_memory_bandwidth REAL` (`ALTER TABLE … ADD COLUMN`: existing rows read `NULL`);
//!   `idx_log_created_at` rebuilt (`DROP` + `CREATE`) with the phase columns and the
//!   `engine` / `engine_kv_usage` dimensions the report reads; new `idx_log_trace_id`.
//!   Migrating an existing file rebuilds that index once (a full scan of the table, inside
//!   the migration transaction).
//! * v3 — `idx_log_trace_id` (the full 32-character id) replaced by `idx_log_trace_prefix`,
//!   an expression index on `substr(trace_id, 1, 8)`; lookups by trace id filter on that
//!   prefix (index seek) and then on the full id. Migrating builds the smaller index once.
//! * v4 — every index but the primary key and `idx_log_created_at` dropped:
//!   `(model | user_id | tenant | business_line, created_at)`, `prompt_hash` and the trace
//!   id prefix. Each took one insert at a scattered position per row; together they held the
//!   insert rate at ~9 000 rows/s at 1 M rows, against ~175 000 without them
//!   (`docs/benchmarks.md`).
//! * v5 — column `cost_usd REAL` (USD at the configured prices; `NULL` = unpriced, and for
//!   rows written before v5). Readers need v5 (the reads name it): a read-only open of an
//!   older file is refused until a writer migrated it.
//! * v6 — column `client_request_id TEXT` (the client's `x-request-id`, `NULL` when it sent
//!   none, and for rows written before v6) and the partial index
//!   `idx_log_client_request_id` on it (rows with a client id only). Readers need v6.
//! * v7 — columns `cache_creation_tokens INTEGER` (prompt tokens written to the engine's
//!   prompt cache; `NULL` when unknown, and for rows written before v7) and
//!   `replica TEXT NOT NULL DEFAULT ''` (the upstream replica that served the request,
//!   `host:port`; empty when none was chosen, and for older rows). Not in the covering time
//!   index (a report by `replica` reads table rows, like `gpu_band`). Readers need v7.
//! * v8 — the per-request blame columns `blocked_by_requests INTEGER`,
//!   `blocked_by_prompt_tokens INTEGER`, `blocked_ms REAL`, `blocker_request_id TEXT`,
//!   `blocker_caller TEXT`, `blocker_business_line TEXT`, `blocker_prompt_tokens INTEGER`
//!   (`NULL` when not measured, and for rows written before v8). Not in the covering time
//!   index. Readers need v8.
//! * v9 — column `prompt_sketch INTEGER` (the prompt's 64-bit similarity sketch, stored as
//!   the signed integer with the same bits; `NULL` when the prompt had no word, and for rows
//!   written before v9). Readers need v9.
//! * v10 — columns `ttft_unaccounted_ms REAL`, `e2e_unaccounted_ms REAL` (the parts of TTFT
//!   and end to end the engine did not account for) and `engine_timing TEXT` (`consistent` /
//!   `per_step` / `exceeds_gateway`); `NULL` for rows written before v10. Readers need v10.
//! * v11 — `idx_log_created_at` rebuilt with `ttft_unaccounted_ms` (every report reads it).
//!
//! Indexes: the primary key (`request_id`: idempotent inserts, [`SqliteStore::get`]) and
//! `idx_log_created_at`, led by `created_at` and carrying every column a
//! [report](crate::report) reads — every dimension included — so a report, and any query on a
//! time range grouped or filtered by dimensions (the two documented below), is one range
//! scan of that index and never touches the wide table rows. Both are appended to in
//! near-sequential order (time-ordered UUIDv7 request ids, records arriving roughly in
//! `created_at` order), so a batch dirties few pages. A query by user or model without a
//! time range scans the whole index. The writer checkpoints every 32 MiB of WAL instead of
//! SQLite's default 4 MiB; see `docs/benchmarks.md` for measured throughput.
//!
//! ## Two questions, one SQL statement each
//!
//! "This user's tokens per day over the last 7 days" (bind `:user_id` and `:now_us`, the end
//! of the window in epoch microseconds; a range scan of the covering time index) —
//! [`SQL_USER_TOKENS_PER_DAY`]:
//!
#![doc = concat!("```sql\n", include_str!("sql/user_tokens_per_day.sql"), "```")]
//!
//! "Mean TTFT per input-length bucket for model X" (bind `:model` and `:since_us`; a range
//! scan of the covering time index; non-streamed requests have a `NULL` TTFT and are left
//! out) — [`SQL_MEAN_TTFT_BY_BUCKET`]:
//!
#![doc = concat!("```sql\n", include_str!("sql/mean_ttft_by_bucket.sql"), "```")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::types::Type;
use rusqlite::{
    params, Connection, ErrorCode, OpenFlags, OptionalExtension, Row, Statement, ToSql,
    TransactionBehavior,
};
use tokenscope_core::{
    Endpoint, InputBucket, Outcome, PhaseSource, PhaseUpdate, RequestRecord, TokenSource,
};

use crate::late::{LateRows, LateUpdates};
use crate::pending::UnmatchedCounts;
use crate::trace_rows::TraceRows;
use crate::StoreError;
use tokenscope_core::usage::{UsageAcc, UsageQuery, UsageRow};

/// Name of the per-request table.
pub const TABLE: &str = "llm_inference_log";

/// "This user's tokens per day over 7 days", one statement. Parameters: `:user_id`,
/// `:now_us` (window end, epoch µs). Columns: `day` (`YYYY-MM-DD`, UTC), `requests`,
/// `input_tokens`, `output_tokens`, `total_tokens`.
pub const SQL_USER_TOKENS_PER_DAY: &str = include_str!("sql/user_tokens_per_day.sql");

/// "Mean TTFT per input bucket for model X", one statement. Parameters: `:model`,
/// `:since_us` (epoch µs). Columns: `input_bucket`, `n`, `mean_ttft_ms`; buckets shortest
/// first.
pub const SQL_MEAN_TTFT_BY_BUCKET: &str = include_str!("sql/mean_ttft_by_bucket.sql");

/// Every column of [`TABLE`], in the order [`record_from_row`] expects them.
pub const COLUMNS: [&str; 65] = [
    "request_id",
    "trace_id",
    "created_at",
    "model",
    "model_served",
    "upstream",
    "user_id",
    "tenant",
    "business_line",
    "request_type",
    "api_key_id",
    "endpoint",
    "stream",
    "http_status",
    "outcome",
    "error_type",
    "finish_reason",
    "max_tokens",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "input_tokens_source",
    "output_tokens_source",
    "input_bucket",
    "queue_duration_ms",
    "prefill_duration_ms",
    "decode_duration_ms",
    "queue_source",
    "prefill_source",
    "decode_source",
    "ttft_ms",
    "tpot_ms",
    "itl_max_ms",
    "itl_mean_ms",
    "total_duration_ms",
    "upstream_headers_ms",
    "gateway_overhead_ms",
    "chunks",
    "prompt_hash",
    "prompt_text",
    "draft_tokens",
    "draft_accepted_tokens",
    "engine",
    "input_tokens_entry",
    "engine_running",
    "engine_waiting",
    "engine_kv_usage",
    "gpu_utilization",
    "gpu_memory_bandwidth",
    "cost_usd",
    "client_request_id",
    "cache_creation_tokens",
    "replica",
    "blocked_by_requests",
    "blocked_by_prompt_tokens",
    "blocked_ms",
    "blocker_request_id",
    "blocker_caller",
    "blocker_business_line",
    "blocker_prompt_tokens",
    "prompt_sketch",
    "ttft_unaccounted_ms",
    "e2e_unaccounted_ms",
    "engine_timing",
];

/// Ordered schema migrations: entry `i` takes the schema from version `i` to `i + 1`.
/// Append only; never edit a released entry.
const MIGRATIONS: &[&str] = &[
    // v1: the table and its indexes.
    "CREATE TABLE llm_inference_log (
        request_id            TEXT PRIMARY KEY NOT NULL,
        trace_id              TEXT NOT NULL,
        created_at            INTEGER NOT NULL,
        model                 TEXT NOT NULL,
        model_served          TEXT,
        upstream              TEXT NOT NULL,
        user_id               TEXT,
        tenant                TEXT,
        business_line         TEXT,
        request_type          TEXT NOT NULL,
        api_key_id            TEXT,
        endpoint              TEXT NOT NULL,
        stream                INTEGER NOT NULL,
        http_status           INTEGER NOT NULL,
        outcome               TEXT NOT NULL,
        error_type            TEXT,
        finish_reason         TEXT,
        max_tokens            INTEGER,
        input_tokens          INTEGER,
        output_tokens         INTEGER,
        cached_tokens         INTEGER,
        reasoning_tokens      INTEGER,
        input_tokens_source   TEXT NOT NULL,
        output_tokens_source  TEXT NOT NULL,
        input_bucket          TEXT,
        queue_duration_ms     REAL,
        prefill_duration_ms   REAL,
        decode_duration_ms    REAL,
        queue_source          TEXT NOT NULL,
        prefill_source        TEXT NOT NULL,
        decode_source         TEXT NOT NULL,
        ttft_ms               REAL,
        tpot_ms               REAL,
        itl_max_ms            REAL,
        itl_mean_ms           REAL,
        total_duration_ms     REAL NOT NULL,
        upstream_headers_ms   REAL,
        gateway_overhead_ms   REAL,
        chunks                INTEGER,
        prompt_hash           TEXT,
        prompt_text           TEXT,
        draft_tokens          INTEGER,
        draft_accepted_tokens INTEGER
    );
    -- Time index, covering every column a report reads: a report is one sequential range
    -- scan of this index and never touches the wide table rows.
    CREATE INDEX idx_log_created_at ON llm_inference_log (
        created_at, outcome, ttft_ms, tpot_ms, total_duration_ms,
        input_tokens, output_tokens, cached_tokens,
        model, input_bucket, user_id, tenant, business_line, request_type,
        endpoint, upstream, stream
    );
    CREATE INDEX idx_log_model_time ON llm_inference_log (model, created_at);
    CREATE INDEX idx_log_user_time ON llm_inference_log (user_id, created_at);
    CREATE INDEX idx_log_tenant_time ON llm_inference_log (tenant, created_at);
    CREATE INDEX idx_log_business_line_time ON llm_inference_log (business_line, created_at);
    CREATE INDEX idx_log_prompt_hash ON llm_inference_log (prompt_hash);",
    // v2: engine adapter, entry token count, engine/GPU state at arrival; the covering time
    // index is rebuilt with the phase columns and the engine dimensions the report reads; a
    // trace_id index for late engine updates (`PhaseUpdate`, joined by trace id).
    "ALTER TABLE llm_inference_log ADD COLUMN engine TEXT;
    ALTER TABLE llm_inference_log ADD COLUMN input_tokens_entry INTEGER;
    ALTER TABLE llm_inference_log ADD COLUMN engine_running REAL;
    ALTER TABLE llm_inference_log ADD COLUMN engine_waiting REAL;
    ALTER TABLE llm_inference_log ADD COLUMN engine_kv_usage REAL;
    ALTER TABLE llm_inference_log ADD COLUMN gpu_utilization REAL;
    ALTER TABLE llm_inference_log ADD COLUMN gpu_memory_bandwidth REAL;
    DROP INDEX idx_log_created_at;
    CREATE INDEX idx_log_created_at ON llm_inference_log (
        created_at, outcome, ttft_ms, tpot_ms, total_duration_ms,
        input_tokens, output_tokens, cached_tokens,
        queue_duration_ms, prefill_duration_ms, decode_duration_ms,
        model, input_bucket, user_id, tenant, business_line, request_type,
        endpoint, upstream, stream, engine, engine_kv_usage
    );
    CREATE INDEX idx_log_trace_id ON llm_inference_log (trace_id);",
    // v3: the trace id index keeps only the first 8 characters of the id (an expression
    // index): random keys dirty one index page per row, and 8-character keys need ~2.5×
    // fewer pages than 32-character ones, so a batch writes fewer pages to the WAL. Lookups
    // compare the full id on the (rare) rows that share a prefix.
    "DROP INDEX idx_log_trace_id;
    CREATE INDEX idx_log_trace_prefix ON llm_inference_log (substr(trace_id, 1, 8));",
    // v4: only the primary key and the covering time index remain. The per-dimension,
    // prompt-hash and trace-id indexes took one insert at a scattered position per row each
    // and held the insert rate ~20× below what the table and the time index allow; reports
    // and the documented queries range-scan the covering time index (every dimension is in
    // it), and late updates find their rows through the writer's trace map
    // (`crate::trace_rows`) and a seek on `created_at`.
    "DROP INDEX IF EXISTS idx_log_model_time;
    DROP INDEX IF EXISTS idx_log_user_time;
    DROP INDEX IF EXISTS idx_log_tenant_time;
    DROP INDEX IF EXISTS idx_log_business_line_time;
    DROP INDEX IF EXISTS idx_log_prompt_hash;
    DROP INDEX IF EXISTS idx_log_trace_prefix;",
    // v5: the request's cost in USD at the configured prices (`NULL` = unpriced model, and
    // for every row written before v5).
    "ALTER TABLE llm_inference_log ADD COLUMN cost_usd REAL;",
    // v6: the client's own `x-request-id` (data, never the key: `request_id` is always the
    // gateway's UUIDv7), searchable through a partial index that only holds the rows that
    // carry one (a request without it costs the index nothing).
    "ALTER TABLE llm_inference_log ADD COLUMN client_request_id TEXT;
    CREATE INDEX IF NOT EXISTS idx_log_client_request_id ON llm_inference_log (client_request_id)
        WHERE client_request_id IS NOT NULL;",
    // v7: prompt tokens written to the engine's prompt cache (Anthropic
    // `cache_creation_input_tokens`; `NULL` when not reported, and for rows written before
    // v7) and the replica of the upstream that served the request (`host:port`; empty when
    // none was chosen, and for rows written before v7). The covering time index is left as
    // it is (rebuilding it would scan the whole table at start-up): a report grouped or
    // filtered by `replica` reads the table rows, like `gpu_band`.
    "ALTER TABLE llm_inference_log ADD COLUMN cache_creation_tokens INTEGER;
    ALTER TABLE llm_inference_log ADD COLUMN replica TEXT NOT NULL DEFAULT '';",
    // v8: per-request blame (what the request waited behind on its replica; `NULL` when not
    // measured, and for rows written before v8). Not in the covering time index.
    "ALTER TABLE llm_inference_log ADD COLUMN blocked_by_requests INTEGER;
    ALTER TABLE llm_inference_log ADD COLUMN blocked_by_prompt_tokens INTEGER;
    ALTER TABLE llm_inference_log ADD COLUMN blocked_ms REAL;
    ALTER TABLE llm_inference_log ADD COLUMN blocker_request_id TEXT;
    ALTER TABLE llm_inference_log ADD COLUMN blocker_caller TEXT;
    ALTER TABLE llm_inference_log ADD COLUMN blocker_business_line TEXT;
    ALTER TABLE llm_inference_log ADD COLUMN blocker_prompt_tokens INTEGER;",
    // v9: the prompt's similarity sketch (64 bits as a signed integer; `NULL` for rows written
    // before v9).
    "ALTER TABLE llm_inference_log ADD COLUMN prompt_sketch INTEGER;",
    // v10: the TTFT / end-to-end split (`RequestRecord::split_times`; `NULL` for rows written
    // before v10).
    "ALTER TABLE llm_inference_log ADD COLUMN ttft_unaccounted_ms REAL;
    ALTER TABLE llm_inference_log ADD COLUMN e2e_unaccounted_ms REAL;
    ALTER TABLE llm_inference_log ADD COLUMN engine_timing TEXT;",
    // v11: the covering time index is rebuilt with `ttft_unaccounted_ms`, which every report
    // reads (its `unaccounted` quantiles): without it each report would read the wide table
    // rows. Rebuilding scans the table once, at the first start of this version.
    "DROP INDEX idx_log_created_at;
    CREATE INDEX idx_log_created_at ON llm_inference_log (
        created_at, outcome, ttft_ms, tpot_ms, total_duration_ms,
        input_tokens, output_tokens, cached_tokens,
        queue_duration_ms, prefill_duration_ms, decode_duration_ms,
        model, input_bucket, user_id, tenant, business_line, request_type,
        endpoint, upstream, stream, engine, engine_kv_usage, ttft_unaccounted_ms
    );",
];

/// The schema version this build writes and understands.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// The oldest schema a read-only open accepts: v10 added the TTFT split, the last columns the
/// reads name (v3 and v4 only changed indexes). An older file is migrated by the next
/// writer (`tokenscope serve`, or [`SqliteStore::open`]).
pub const MIN_READ_VERSION: u32 = 10;

const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Page cache of the writer connection, KiB (SQLite's default). 2 MiB inserts as fast as 64 MiB did (the
/// `bench_store` example, docs/benchmarks.md) and keeps the gateway's resident memory flat as
/// the file grows.
pub const WRITER_CACHE_KIB: i64 = 2 * 1024;

/// The SQLite store. Owns one connection; not `Sync` — the writer lives on the pipeline's
/// thread, each report opens its own read-only store.
#[derive(Debug)]
pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    /// Device and inode of the file the writer opened (`None`: in memory or read-only). The
    /// writer compares it with `stat(path)` before each write (see [`Self::file_change`]).
    file_id: Option<FileId>,
    /// The previous connection was closed (its file was unlinked or replaced) and opening
    /// the file at `path` again failed: retried before the next write.
    must_reopen: Option<FileChange>,
    /// Reopens since the last [`Self::take_reopened`], with their reason.
    reopened: Vec<FileChange>,
    /// Late engine updates, and those waiting for their row (writer side only).
    late: LateUpdates,
    /// Where the recent rows of each trace are (writer side only).
    traces: TraceRows,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` for writing: creates the parent
    /// directory, switches to WAL, `synchronous=NORMAL`, sets a busy timeout and applies
    /// pending migrations.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() {
                std::fs::create_dir_all(parent)?;
            }
        }
        let not_writable = |e: StoreError| match e {
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(f, _))
                if matches!(
                    f.code,
                    ErrorCode::CannotOpen
                        | ErrorCode::ReadOnly
                        | ErrorCode::PermissionDenied
                        | ErrorCode::SystemIoFailure
                        | ErrorCode::DiskFull
                ) =>
            {
                StoreError::NotWritable {
                    path: path.to_path_buf(),
                    cause: format!(
                        "{e} (SQLite must write the file and create its -wal and -shm files \
                         beside it)"
                    ),
                }
            }
            other => other,
        };
        let conn = Connection::open(path).map_err(|e| not_writable(e.into()))?;
        let mut store = Self::configure_writer(conn, path.to_path_buf()).map_err(not_writable)?;
        store.probe_write()?;
        store.file_id = file_id(path).ok();
        Ok(store)
    }

    /// A real write (a transaction that rewrites the header's `user_version`, committed to
    /// the WAL): refuses a file SQLite could only open read-only, a directory where the WAL
    /// cannot be created, a file system that refuses writes. [`StoreError::NotWritable`]
    /// names the path and the cause.
    fn probe_write(&mut self) -> Result<(), StoreError> {
        let not_writable = |cause: String| StoreError::NotWritable {
            path: self.path.clone(),
            cause,
        };
        if self.conn.is_readonly(rusqlite::MAIN_DB)? {
            return Err(not_writable(
                "SQLite could only open it read-only (file or directory permissions, \
                 immutable attribute or read-only mount)"
                    .to_owned(),
            ));
        }
        let version = user_version(&self.conn)?;
        let probe = (|| -> rusqlite::Result<()> {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.pragma_update(None, "user_version", i64::from(version))?;
            tx.commit()
        })();
        probe.map_err(|e| not_writable(e.to_string()))
    }

    /// Whether the file at [`Self::path`] is still the one this writer has open: `None` when
    /// it is (or when that cannot be told: in memory, read-only, `stat` refused), else how it
    /// changed. One `stat` call.
    pub fn file_change(&self) -> Option<FileChange> {
        let want = self.file_id?;
        match file_id(&self.path) {
            Ok(now) if now == want => None,
            Ok(_) => Some(FileChange::Replaced),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(FileChange::Unlinked),
            Err(_) => None,
        }
    }

    /// Reopens since the last call (the file was unlinked or replaced under the writer and
    /// the writer recreated / reopened it), oldest first.
    pub fn take_reopened(&mut self) -> Vec<FileChange> {
        std::mem::take(&mut self.reopened)
    }

    /// Before a write: when the file was unlinked or replaced (or a reopen is pending),
    /// closes the old connection and opens the file at the path again (creating and
    /// migrating it). `Ok(true)` when it reopened.
    fn ensure_file(&mut self) -> Result<bool, StoreError> {
        let change = match (self.must_reopen, self.file_change()) {
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => return Ok(false),
        };
        if self.must_reopen.is_none() {
            tracing::warn!(
                path = %self.path.display(),
                change = change.as_str(),
                "the tokenscope store file was {} under the running writer; closing it and \
                 opening {} again (created if missing)",
                change.as_str(),
                self.path.display()
            );
            // Close the old connection first: its WAL and shared-memory files sit at the
            // path's `-wal` / `-shm` names and must not be read as the new file's.
            let old = std::mem::replace(&mut self.conn, Connection::open_in_memory()?);
            self.must_reopen = Some(change);
            self.file_id = None;
            if let Err((_, e)) = old.close() {
                tracing::warn!(error = %e, "closing the old store connection failed");
            }
            // SQLite does not checkpoint nor delete the WAL of a file that moved: the `-wal`
            // / `-shm` files still at the path hold the OLD file's pages, and opening the new
            // file would replay them into it. They belong to a file that is gone: remove them.
            for suffix in ["-wal", "-shm"] {
                let mut side = self.path.clone().into_os_string();
                side.push(suffix);
                match std::fs::remove_file(&side) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(file = ?side, error = %e, "could not remove the old store's WAL file")
                    }
                }
            }
        }
        let fresh = Self::open(&self.path)?;
        self.conn = fresh.conn;
        self.file_id = fresh.file_id;
        self.traces = fresh.traces;
        self.must_reopen = None;
        self.reopened.push(change);
        Ok(true)
    }

    /// An in-memory database with the full schema (tests, dry runs).
    pub fn open_in_memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory()?;
        Self::configure_writer(conn, PathBuf::from(":memory:"))
    }

    fn configure_writer(mut conn: Connection, path: PathBuf) -> Result<Self, StoreError> {
        conn.busy_timeout(BUSY_TIMEOUT)?;
        // Returns the resulting mode ("wal", or "memory" for in-memory databases).
        let _mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // Page cache: rows are appended in near-time order, so the hot pages are the right
        // edges of the table and of the covering index; a small cache holds them (a larger
        // one only grows the gateway's memory with the file, see WRITER_CACHE_KIB).
        conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
        // Checkpoint every 8192 pages (32 MiB of WAL) rather than every 1000: a checkpoint
        // writes each page once however often it changed; fewer, larger checkpoints mean
        // fewer fsyncs. The WAL file is truncated back to 64 MiB after a checkpoint.
        conn.pragma_update(None, "wal_autocheckpoint", 8192)?;
        conn.pragma_update(None, "journal_size_limit", 64_i64 << 20)?;
        conn.set_prepared_statement_cache_capacity(32);
        migrate(&mut conn)?;
        let mut store = Self {
            conn,
            path,
            file_id: None,
            must_reopen: None,
            reopened: Vec::new(),
            late: LateUpdates::default(),
            traces: TraceRows::default(),
        };
        store.load_trace_rows()?;
        Ok(store)
    }

    /// Opens an existing database read-only (reports). Never creates or migrates anything;
    /// refuses a file without the tokenscope schema, with a newer one, or with an older one
    /// ([`StoreError::SchemaTooOld`]: open it read-write once to migrate).
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.pragma_update(None, "cache_size", -65_536)?;
        // Map the file instead of copying pages through the page cache (big scans).
        conn.pragma_update(None, "mmap_size", 1_i64 << 32)?;
        let version = user_version(&conn)?;
        if version == 0 {
            return Err(StoreError::NoSchema(path.to_path_buf()));
        }
        if version > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew {
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        if version < MIN_READ_VERSION {
            // The reads name columns an older file lacks: say so instead of failing later
            // with "no such column".
            return Err(StoreError::SchemaTooOld {
                found: version,
                expected: MIN_READ_VERSION,
            });
        }
        conn.set_prepared_statement_cache_capacity(32);
        Ok(Self {
            conn,
            path: path.to_path_buf(),
            file_id: None,
            must_reopen: None,
            reopened: Vec::new(),
            late: LateUpdates::default(),
            traces: TraceRows::new(1),
        })
    }

    /// The path this store was opened with (`:memory:` for in-memory stores).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The underlying connection, for ad-hoc queries (e.g. the documented SQL statements).
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// `PRAGMA user_version` of the open file.
    pub fn schema_version(&self) -> Result<u32, StoreError> {
        user_version(&self.conn)
    }

    /// Inserts `records` in one transaction with cached multi-row prepared statements
    /// (`INSERT OR IGNORE`, keyed by `request_id`; duplicates inside the batch count once). Returns how many rows were new; rows whose
    /// `request_id` already exists are skipped. All-or-nothing.
    ///
    /// Before writing, the file at the path is checked (one `stat`): when it was unlinked or
    /// replaced, the old connection is closed and the path opened again (created, migrated);
    /// when that happens between this batch's commit and the check after it, the batch is
    /// written again into the new file.
    pub fn insert_batch(&mut self, records: &[RequestRecord]) -> Result<usize, StoreError> {
        if records.is_empty() {
            return Ok(0);
        }
        self.ensure_file()?;
        let inserted = self.insert_batch_here(records)?;
        if self.file_change().is_some() && self.ensure_file()? {
            // Committed into a file that was unlinked/replaced meanwhile: write it again.
            return self.insert_batch_here(records);
        }
        Ok(inserted)
    }

    fn insert_batch_here(&mut self, records: &[RequestRecord]) -> Result<usize, StoreError> {
        // Engine updates that arrived before their row go into the records themselves;
        // forgotten only once the transaction committed (a failed batch is retried with them).
        let joined = self.late.join(records);
        let records = joined.records();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut inserted = 0;
        {
            // Full chunks of `ROWS_PER_INSERT` rows through one multi-row statement, the
            // remainder row by row: one VM run per chunk instead of per row.
            let mut chunks = records.chunks_exact(ROWS_PER_INSERT);
            let mut stmt = tx.prepare_cached(&insert_sql(ROWS_PER_INSERT))?;
            for chunk in &mut chunks {
                for (i, r) in chunk.iter().enumerate() {
                    bind_record(&mut stmt, i * COLUMNS.len(), r)?;
                }
                inserted += stmt.raw_execute()?;
            }
            let rest = chunks.remainder();
            if !rest.is_empty() {
                let mut one = tx.prepare_cached(&insert_sql(1))?;
                for r in rest {
                    bind_record(&mut one, 0, r)?;
                    inserted += one.raw_execute()?;
                }
            }
        }
        // Where this batch's traces are (noted before the commit: an entry for a batch that
        // then fails only makes a later update match nothing, and the retry notes it again).
        for r in records {
            self.traces.note(&r.trace_id, r.created_at);
        }
        tx.commit()?;
        self.late.inserted(&joined);
        Ok(inserted)
    }

    /// Applies late engine values ([`PhaseUpdate`]) to the rows with the same `trace_id`, in
    /// one transaction, as [`crate::late`] states (the rule is
    /// [`RequestRecord::apply_update`]); an update that matches no row (its record is still on
    /// its way) waits in the bounded pending map and is applied when a row with its trace id
    /// is inserted. Returns how many trace ids matched a row now. Updates with an empty trace
    /// id are ignored.
    pub fn apply_updates(&mut self, updates: &[PhaseUpdate]) -> Result<usize, StoreError> {
        self.ensure_file()?;
        let now = Instant::now();
        if updates.is_empty() {
            self.late.expire(now);
            return Ok(0);
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut rows = TraceRowsIo {
            tx: Some(tx),
            traces: &self.traces,
        };
        self.late.apply(updates, &mut rows, now)
    }

    /// Fills the trace map from the newest rows (at most its capacity), so that late updates
    /// reach rows written before this process started.
    fn load_trace_rows(&mut self) -> Result<(), StoreError> {
        let cap = i64::try_from(self.traces.capacity()).unwrap_or(i64::MAX);
        let mut stmt = self.conn.prepare(&format!(
            "SELECT trace_id, created_at FROM {TABLE} ORDER BY created_at DESC LIMIT ?1"
        ))?;
        let rows: Vec<(String, i64)> = stmt
            .query_map([cap], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        drop(stmt);
        // Oldest first, so the newest are evicted last.
        for (trace, at) in rows.iter().rev() {
            self.traces.note(trace, *at);
        }
        Ok(())
    }

    /// How many trace ids the writer remembers for late updates (default
    /// [`DEFAULT_TRACE_ROWS`](crate::trace_rows::DEFAULT_TRACE_ROWS)); an update for a row
    /// older than that waits in the pending map and expires there (counted).
    pub fn set_trace_rows_capacity(&mut self, capacity: usize) {
        self.traces.set_capacity(capacity);
    }

    /// Updates waiting in the pending map for their row.
    pub fn pending_updates(&self) -> usize {
        self.late.waiting()
    }

    /// Sets the pending map's limits (default
    /// [`DEFAULT_PENDING_CAPACITY`](crate::pending::DEFAULT_PENDING_CAPACITY) trace ids,
    /// [`DEFAULT_PENDING_TTL`](crate::pending::DEFAULT_PENDING_TTL)); a smaller capacity evicts the oldest waiting updates
    /// (counted as overflow).
    pub fn set_pending_limits(&mut self, capacity: usize, ttl: Duration) {
        self.late.set_limits(capacity, ttl);
    }

    /// Pending updates given up on since the last call (expired now, evicted on overflow;
    /// with `shutting_down`, every update still waiting, which is then forgotten).
    pub fn take_unmatched(&mut self, shutting_down: bool) -> UnmatchedCounts {
        self.late.take_unmatched(shutting_down, Instant::now())
    }

    /// Inserts one record; `Ok(false)` when its `request_id` was already stored.
    pub fn insert(&mut self, record: &RequestRecord) -> Result<bool, StoreError> {
        Ok(self.insert_batch(std::slice::from_ref(record))? == 1)
    }

    /// The records whose client sent `x-request-id: client_request_id`, oldest first (an
    /// index seek on `idx_log_client_request_id`; the id is not unique).
    pub fn by_client_request_id(
        &self,
        client_request_id: &str,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        let sql = format!(
            "SELECT {} FROM {TABLE} WHERE client_request_id = ?1 ORDER BY created_at, request_id",
            COLUMNS.join(", ")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([client_request_id], record_from_row)?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    /// The record stored under `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Result<Option<RequestRecord>, StoreError> {
        let sql = format!(
            "SELECT {} FROM {TABLE} WHERE request_id = ?1",
            COLUMNS.join(", ")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        Ok(stmt.query_row([request_id], record_from_row).optional()?)
    }

    /// Every record created in `[since_us, until_us)` (epoch µs), ordered by `created_at`
    /// then `request_id` — the input of the analysis commands (the ClickHouse store returns
    /// the same rows in the same order).
    pub fn records_between(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        let sql = format!(
            "SELECT {} FROM {TABLE} WHERE created_at >= ?1 AND created_at < ?2 \
             ORDER BY created_at, request_id",
            COLUMNS.join(", ")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([since_us, until_us], record_from_row)?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    /// The `limit` records of `window` passing `filters` (the report's semantics) with the
    /// longest end to end, slowest first, ties by `request_id` — the dashboard's "slowest
    /// requests". One scan of the window's index range; SQLite keeps only the top `limit`.
    pub fn slowest(
        &self,
        window: tokenscope_core::query::Window,
        filters: &[(tokenscope_core::query::Dimension, String)],
        limit: usize,
    ) -> Result<Vec<RequestRecord>, StoreError> {
        lean(&self.conn, || {
            let mut sql = format!(
                "SELECT {} FROM {TABLE} WHERE created_at >= ? AND created_at < ?",
                COLUMNS.join(", ")
            );
            let mut params: Vec<rusqlite::types::Value> =
                vec![window.since_us.into(), window.until_us.into()];
            crate::report::push_filters(filters, &mut sql, &mut params)?;
            sql.push_str(" ORDER BY total_duration_ms DESC, request_id LIMIT ?");
            params.push(i64::try_from(limit).unwrap_or(i64::MAX).into());
            let mut stmt = self.conn.prepare_cached(&sql)?;
            let rows = stmt.query_map(rusqlite::params_from_iter(params), record_from_row)?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// Token and cost sums per (group, model) of a window (see [`crate::usage`]): one pass
    /// over the window's index range reading only the needed columns, per-group state only.
    /// The scan runs without the read-only connection's memory map and with a small page
    /// cache (restored afterwards), so the process's resident size does not grow with the
    /// file: a month of rows costs what a day does.
    pub fn usage(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        lean(&self.conn, || self.usage_scan(q))
    }

    fn usage_scan(&self, q: &UsageQuery) -> Result<Vec<UsageRow>, StoreError> {
        let mut acc = UsageAcc::new(q).map_err(|e| StoreError::InvalidQuery(e.0))?;
        let mut sql = String::from(
            "SELECT model, input_tokens, cached_tokens, output_tokens, cost_usd, created_at, \
             engine_running, engine_waiting, engine_kv_usage",
        );
        const FIXED: usize = 9;
        for d in &q.group_by {
            sql.push_str(", ");
            sql.push_str(d.column());
        }
        sql.push_str(&format!(
            " FROM {TABLE} WHERE created_at >= ?1 AND created_at < ?2"
        ));
        let mut params: Vec<rusqlite::types::Value> =
            vec![q.window.since_us.into(), q.window.until_us.into()];
        for (d, v) in &q.filters {
            if v == tokenscope_core::query::NONE_LABEL {
                sql.push_str(&format!(" AND {} IS NULL", d.column()));
            } else {
                sql.push_str(&format!(" AND {} = ?", d.column()));
                params.push(v.clone().into());
            }
        }
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
        let n = q.group_by.len();
        let mut labels: Vec<Option<String>> = vec![None; n];
        let tokens = |v: Option<i64>| v.map(|t| u64::try_from(t).unwrap_or(0));
        while let Some(row) = rows.next()? {
            for (i, slot) in labels.iter_mut().enumerate() {
                *slot = row.get::<_, Option<String>>(FIXED + i)?;
            }
            let refs: Vec<Option<&str>> = labels.iter().map(|l| l.as_deref()).collect();
            let model: String = row.get(0)?;
            let created_at: i64 = row.get(5)?;
            acc.add_values(
                &refs,
                tokenscope_core::usage::UsageValues {
                    bucket_start_us: q.bucket_of(created_at),
                    model: &model,
                    input: tokens(row.get(1)?),
                    cached: tokens(row.get(2)?),
                    output: tokens(row.get(3)?),
                    cost_usd: row.get(4)?,
                    engine_running: row.get(6)?,
                    engine_waiting: row.get(7)?,
                    engine_kv_usage: row.get(8)?,
                },
            );
        }
        Ok(acc.finish())
    }

    /// Number of stored rows.
    pub fn count(&self) -> Result<u64, StoreError> {
        let n: i64 = self
            .conn
            .prepare_cached(&format!("SELECT COUNT(*) FROM {TABLE}"))?
            .query_row([], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The most recent records (by `created_at`, newest first), at most `limit`.
    pub fn recent(&self, limit: usize) -> Result<Vec<RequestRecord>, StoreError> {
        let sql = format!(
            "SELECT {} FROM {TABLE} ORDER BY created_at DESC LIMIT ?1",
            COLUMNS.join(", ")
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt.query_map([limit], record_from_row)?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    /// Retention: deletes rows created before `cutoff_us` (epoch µs); returns how many.
    pub fn delete_before(&mut self, cutoff_us: i64) -> Result<usize, StoreError> {
        Ok(self.conn.execute(
            &format!("DELETE FROM {TABLE} WHERE created_at < ?1"),
            [cutoff_us],
        )?)
    }
}

/// How the file at a writer's path differs from the one it has open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileChange {
    /// Nothing is at the path any more (the file was deleted).
    Unlinked,
    /// Another file is at the path (moved or copied over it).
    Replaced,
}

impl FileChange {
    /// Stable lower-case name (metric label, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            FileChange::Unlinked => "unlinked",
            FileChange::Replaced => "replaced",
        }
    }
}

/// Device and inode of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

#[cfg(unix)]
fn file_id(path: &Path) -> std::io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(FileId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

#[cfg(not(unix))]
fn file_id(_path: &Path) -> std::io::Result<FileId> {
    Err(std::io::Error::other(
        "file identity is only checked on Unix",
    ))
}

/// Rows per multi-row `INSERT` statement in [`SqliteStore::insert_batch`]
/// (`ROWS_PER_INSERT × 65` parameters; SQLite allows 32 766).
const ROWS_PER_INSERT: usize = 32;

/// `INSERT OR IGNORE INTO llm_inference_log (<COLUMNS>) VALUES (?,…), …` for `rows` rows,
/// parameters numbered row after row in [`COLUMNS`] order.
fn insert_sql(rows: usize) -> String {
    let n = COLUMNS.len();
    let row = format!("({})", vec!["?"; n].join(","));
    format!(
        "INSERT OR IGNORE INTO {TABLE} ({}) VALUES {}",
        COLUMNS.join(", "),
        vec![row; rows].join(",")
    )
}

/// Binds `r` to parameters `base + 1 ..= base + 65` of `stmt`, in [`COLUMNS`] order.
fn bind_record(stmt: &mut Statement<'_>, base: usize, r: &RequestRecord) -> rusqlite::Result<()> {
    let mut i = base;
    let mut bind = |stmt: &mut Statement<'_>, v: &dyn ToSql| {
        i += 1;
        stmt.raw_bind_parameter(i, v)
    };
    bind(stmt, &r.request_id)?;
    bind(stmt, &r.trace_id)?;
    bind(stmt, &r.created_at)?;
    bind(stmt, &r.model)?;
    bind(stmt, &r.model_served)?;
    bind(stmt, &r.upstream)?;
    bind(stmt, &r.user_id)?;
    bind(stmt, &r.tenant)?;
    bind(stmt, &r.business_line)?;
    bind(stmt, &r.request_type)?;
    bind(stmt, &r.api_key_id)?;
    bind(stmt, &r.endpoint.as_str())?;
    bind(stmt, &r.stream)?;
    bind(stmt, &r.http_status)?;
    bind(stmt, &r.outcome.as_str())?;
    bind(stmt, &r.error_type)?;
    bind(stmt, &r.finish_reason)?;
    bind(stmt, &opt_i64(r.max_tokens))?;
    bind(stmt, &opt_i64(r.input_tokens))?;
    bind(stmt, &opt_i64(r.output_tokens))?;
    bind(stmt, &opt_i64(r.cached_tokens))?;
    bind(stmt, &opt_i64(r.reasoning_tokens))?;
    bind(stmt, &r.input_tokens_source.as_str())?;
    bind(stmt, &r.output_tokens_source.as_str())?;
    bind(stmt, &r.input_bucket.map(InputBucket::as_str))?;
    bind(stmt, &r.queue_duration_ms)?;
    bind(stmt, &r.prefill_duration_ms)?;
    bind(stmt, &r.decode_duration_ms)?;
    bind(stmt, &r.queue_source.as_str())?;
    bind(stmt, &r.prefill_source.as_str())?;
    bind(stmt, &r.decode_source.as_str())?;
    bind(stmt, &r.ttft_ms)?;
    bind(stmt, &r.tpot_ms)?;
    bind(stmt, &r.itl_max_ms)?;
    bind(stmt, &r.itl_mean_ms)?;
    bind(stmt, &r.total_duration_ms)?;
    bind(stmt, &r.upstream_headers_ms)?;
    bind(stmt, &r.gateway_overhead_ms)?;
    bind(stmt, &opt_i64(r.chunks))?;
    bind(stmt, &r.prompt_hash)?;
    bind(stmt, &r.prompt_text)?;
    bind(stmt, &opt_i64(r.draft_tokens))?;
    bind(stmt, &opt_i64(r.draft_accepted_tokens))?;
    bind(stmt, &r.engine)?;
    bind(stmt, &opt_i64(r.input_tokens_entry))?;
    bind(stmt, &r.engine_running)?;
    bind(stmt, &r.engine_waiting)?;
    bind(stmt, &r.engine_kv_usage)?;
    bind(stmt, &r.gpu_utilization)?;
    bind(stmt, &r.gpu_memory_bandwidth)?;
    bind(stmt, &r.cost_usd)?;
    bind(stmt, &r.client_request_id)?;
    bind(stmt, &opt_i64(r.cache_creation_tokens))?;
    bind(stmt, &r.replica)?;
    bind(stmt, &opt_i64(r.blocked_by_requests))?;
    bind(stmt, &opt_i64(r.blocked_by_prompt_tokens))?;
    bind(stmt, &r.blocked_ms)?;
    bind(stmt, &r.blocker_request_id)?;
    bind(stmt, &r.blocker_caller)?;
    bind(stmt, &r.blocker_business_line)?;
    bind(stmt, &opt_i64(r.blocker_prompt_tokens))?;
    // The sketch's 64 bits as SQLite's signed integer (read back bit for bit).
    bind(stmt, &r.prompt_sketch.map(|v| v as i64))?;
    bind(stmt, &r.ttft_unaccounted_ms)?;
    bind(stmt, &r.e2e_unaccounted_ms)?;
    bind(stmt, &r.engine_timing)?;
    debug_assert_eq!(i - base, COLUMNS.len());
    Ok(())
}

/// This store's I/O for [`crate::late`]: the rows of a trace are found through the trace map
/// and a seek on the time index ([`FIND_BY_TRACE_SQL`]) and written back by `rowid`
/// ([`UPDATE_BY_ROWID_SQL`]), inside one transaction that [`LateRows::write`] commits.
struct TraceRowsIo<'c> {
    /// `None` once committed.
    tx: Option<rusqlite::Transaction<'c>>,
    traces: &'c TraceRows,
}

/// The rows of trace `?3` created within `?1 ..= ?2` (the trace map's range for it), as
/// [`COLUMNS`] and then the `rowid`.
static FIND_BY_TRACE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {}, rowid FROM {TABLE} WHERE created_at BETWEEN ?1 AND ?2 AND trace_id = ?3",
        COLUMNS.join(", ")
    )
});

/// Writes a whole record back over the row with `rowid = ?53` (and `request_id = ?1`):
/// parameters bound by [`bind_record`], in [`COLUMNS`] order.
static UPDATE_BY_ROWID_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let set: Vec<String> = COLUMNS
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, c)| format!("{c} = ?{}", i + 1))
        .collect();
    format!(
        "UPDATE {TABLE} SET {} WHERE rowid = ?{} AND request_id = ?1",
        set.join(", "),
        COLUMNS.len() + 1
    )
});

impl LateRows for TraceRowsIo<'_> {
    type Tag = i64;
    type Error = StoreError;

    fn find(&mut self, trace_ids: &[&str]) -> Result<Vec<(RequestRecord, i64)>, StoreError> {
        let Some(tx) = &self.tx else {
            return Ok(Vec::new());
        };
        let mut stmt = tx.prepare_cached(&FIND_BY_TRACE_SQL)?;
        let mut rows = Vec::new();
        for id in trace_ids {
            // A trace the writer does not know has no row yet (or only rows older than the
            // trace map): no statement at all.
            let Some((from, to)) = self.traces.range(id) else {
                continue;
            };
            let found = stmt.query_map(params![from, to, id], |row| {
                Ok((record_from_row(row)?, row.get(COLUMNS.len())?))
            })?;
            for r in found {
                rows.push(r?);
            }
        }
        Ok(rows)
    }

    fn write(&mut self, changed: Vec<(RequestRecord, i64)>) -> Result<(), StoreError> {
        let Some(tx) = self.tx.take() else {
            return Ok(());
        };
        {
            let mut stmt = tx.prepare_cached(&UPDATE_BY_ROWID_SQL)?;
            for (r, rowid) in &changed {
                bind_record(&mut stmt, 0, r)?;
                stmt.raw_bind_parameter(COLUMNS.len() + 1, rowid)?;
                stmt.raw_execute()?;
            }
        }
        tx.commit()?;
        Ok(())
    }
}

fn user_version(conn: &Connection) -> Result<u32, StoreError> {
    let v: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    Ok(u32::try_from(v).unwrap_or(u32::MAX))
}

fn migrate(conn: &mut Connection) -> Result<u32, StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let found = user_version(&tx)?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)?;
        tracing::info!(
            version = i + 1,
            "tokenscope store: applied schema migration"
        );
    }
    tx.commit()?;
    Ok(SCHEMA_VERSION)
}

/// Token counts never approach `i64::MAX`; saturate rather than fail the batch.
fn opt_i64(v: Option<u64>) -> Option<i64> {
    v.map(|v| i64::try_from(v).unwrap_or(i64::MAX))
}

fn decode_err(idx: usize, column: &'static str, value: &str) -> rusqlite::Error {
    rusqlite::Error::FromSqlConversionFailure(
        idx,
        Type::Text,
        Box::new(StoreError::Decode {
            column,
            value: value.to_owned(),
        }),
    )
}

fn get_u64(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<u64>> {
    match row.get::<_, Option<i64>>(idx)? {
        None => Ok(None),
        Some(v) => u64::try_from(v)
            .map(Some)
            .map_err(|_| decode_err(idx, COLUMNS[idx], &v.to_string())),
    }
}

fn get_enum<T>(
    row: &Row<'_>,
    idx: usize,
    parse: impl Fn(&str) -> Option<T>,
) -> rusqlite::Result<T> {
    let s: String = row.get(idx)?;
    parse(&s).ok_or_else(|| decode_err(idx, COLUMNS[idx], &s))
}

/// Parses [`Endpoint::as_str`] back (kept for callers; see [`Endpoint::parse`]).
pub fn parse_endpoint(s: &str) -> Option<Endpoint> {
    Endpoint::parse(s)
}

/// Parses [`PhaseSource::as_str`] back (kept for callers; see [`PhaseSource::parse`]).
pub fn parse_phase_source(s: &str) -> Option<PhaseSource> {
    PhaseSource::parse(s)
}

/// Parses [`InputBucket::as_str`] back (kept for callers; see [`InputBucket::parse`]).
pub fn parse_input_bucket(s: &str) -> Option<InputBucket> {
    InputBucket::parse(s)
}

/// Maps a row selected as `SELECT <COLUMNS…>` (in [`COLUMNS`] order) back to a record.
pub fn record_from_row(row: &Row<'_>) -> rusqlite::Result<RequestRecord> {
    let input_bucket = match row.get::<_, Option<String>>(24)? {
        None => None,
        Some(s) => Some(parse_input_bucket(&s).ok_or_else(|| decode_err(24, COLUMNS[24], &s))?),
    };
    Ok(RequestRecord {
        request_id: row.get(0)?,
        trace_id: row.get(1)?,
        created_at: row.get(2)?,
        model: row.get(3)?,
        model_served: row.get(4)?,
        upstream: row.get(5)?,
        user_id: row.get(6)?,
        tenant: row.get(7)?,
        business_line: row.get(8)?,
        request_type: row.get(9)?,
        api_key_id: row.get(10)?,
        endpoint: get_enum(row, 11, parse_endpoint)?,
        stream: row.get(12)?,
        http_status: row.get(13)?,
        outcome: get_enum(row, 14, Outcome::parse)?,
        error_type: row.get(15)?,
        finish_reason: row.get(16)?,
        max_tokens: get_u64(row, 17)?,
        input_tokens: get_u64(row, 18)?,
        output_tokens: get_u64(row, 19)?,
        cached_tokens: get_u64(row, 20)?,
        reasoning_tokens: get_u64(row, 21)?,
        input_tokens_source: get_enum(row, 22, TokenSource::parse)?,
        output_tokens_source: get_enum(row, 23, TokenSource::parse)?,
        input_bucket,
        queue_duration_ms: row.get(25)?,
        prefill_duration_ms: row.get(26)?,
        decode_duration_ms: row.get(27)?,
        queue_source: get_enum(row, 28, parse_phase_source)?,
        prefill_source: get_enum(row, 29, parse_phase_source)?,
        decode_source: get_enum(row, 30, parse_phase_source)?,
        ttft_ms: row.get(31)?,
        tpot_ms: row.get(32)?,
        itl_max_ms: row.get(33)?,
        itl_mean_ms: row.get(34)?,
        total_duration_ms: row.get(35)?,
        upstream_headers_ms: row.get(36)?,
        gateway_overhead_ms: row.get(37)?,
        chunks: get_u64(row, 38)?,
        prompt_hash: row.get(39)?,
        prompt_text: row.get(40)?,
        draft_tokens: get_u64(row, 41)?,
        draft_accepted_tokens: get_u64(row, 42)?,
        engine: row.get(43)?,
        input_tokens_entry: get_u64(row, 44)?,
        engine_running: row.get(45)?,
        engine_waiting: row.get(46)?,
        engine_kv_usage: row.get(47)?,
        gpu_utilization: row.get(48)?,
        gpu_memory_bandwidth: row.get(49)?,
        cost_usd: row.get(50)?,
        client_request_id: row.get(51)?,
        cache_creation_tokens: get_u64(row, 52)?,
        replica: row.get(53)?,
        blocked_by_requests: get_u64(row, 54)?,
        blocked_by_prompt_tokens: get_u64(row, 55)?,
        blocked_ms: row.get(56)?,
        blocker_request_id: row.get(57)?,
        blocker_caller: row.get(58)?,
        blocker_business_line: row.get(59)?,
        blocker_prompt_tokens: get_u64(row, 60)?,
        prompt_sketch: row.get::<_, Option<i64>>(61)?.map(|v| v as u64),
        ttft_unaccounted_ms: row.get(62)?,
        e2e_unaccounted_ms: row.get(63)?,
        engine_timing: row.get(64)?,
    })
}

/// Runs `f` with `conn` lean: no memory map and a small page cache (both restored
/// afterwards), so a scan over a large file keeps the process's resident size flat — a month
/// of rows costs what a day does. (An in-memory database has no `mmap_size`: nothing to
/// change or restore.)
pub(crate) fn lean<T>(
    conn: &Connection,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let get = |p: &str| -> Option<i64> {
        conn.query_row(&format!("PRAGMA {p}"), [], |r| r.get(0))
            .ok()
    };
    let (mmap, cache) = (get("mmap_size"), get("cache_size"));
    if mmap.is_some() {
        conn.pragma_update(None, "mmap_size", 0)?;
    }
    if cache.is_some() {
        conn.pragma_update(None, "cache_size", -4096)?;
    }
    let out = f();
    if let Some(m) = mmap {
        conn.pragma_update(None, "mmap_size", m)?;
    }
    if let Some(c) = cache {
        conn.pragma_update(None, "cache_size", c)?;
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every field set, every enum away from its default.
    pub(crate) fn full_record(id: &str) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
            created_at: 1_700_000_000_123_456,
            model: "llama-3.1-8b".to_owned(),
            model_served: Some("meta-llama/Llama-3.1-8B-Instruct".to_owned()),
            upstream: "vllm-a".to_owned(),
            user_id: Some("alice".to_owned()),
            tenant: Some("acme".to_owned()),
            business_line: Some("search".to_owned()),
            request_type: "chat".to_owned(),
            api_key_id: Some("k_9f8e7d6c".to_owned()),
            endpoint: Endpoint::Completions,
            stream: true,
            http_status: 502,
            outcome: Outcome::UpstreamError,
            error_type: Some("upstream_5xx".to_owned()),
            finish_reason: Some("length".to_owned()),
            max_tokens: Some(512),
            input_tokens: Some(1234),
            output_tokens: Some(77),
            cached_tokens: Some(1024),
            reasoning_tokens: Some(12),
            input_tokens_source: TokenSource::Usage,
            output_tokens_source: TokenSource::Chunks,
            input_bucket: Some(InputBucket::B512To2048),
            queue_duration_ms: Some(12.5),
            prefill_duration_ms: Some(80.25),
            decode_duration_ms: Some(900.125),
            queue_source: PhaseSource::Engine,
            prefill_source: PhaseSource::Derived,
            decode_source: PhaseSource::Engine,
            ttft_ms: Some(95.001),
            tpot_ms: Some(11.75),
            itl_max_ms: Some(40.5),
            itl_mean_ms: Some(11.8),
            total_duration_ms: 1000.5,
            upstream_headers_ms: Some(3.25),
            gateway_overhead_ms: Some(0.125),
            chunks: Some(76),
            prompt_hash: Some("0123456789abcdef0123456789abcdef".to_owned()),
            prompt_text: Some("hello, \"world\" — ünïcode".to_owned()),
            draft_tokens: Some(40),
            draft_accepted_tokens: Some(31),
            engine: Some("vllm".to_owned()),
            input_tokens_entry: Some(1230),
            engine_running: Some(17.0),
            engine_waiting: Some(3.0),
            engine_kv_usage: Some(0.8125),
            gpu_utilization: Some(0.9375),
            gpu_memory_bandwidth: Some(0.625),
            cost_usd: Some(0.001_234_5),
            client_request_id: Some(format!("client-{id}")),
            cache_creation_tokens: Some(96),
            replica: "10.0.0.7:8000".to_owned(),
            blocked_by_requests: Some(3),
            blocked_by_prompt_tokens: Some(1620),
            blocked_ms: Some(412.5),
            blocker_request_id: Some(format!("long-{id}")),
            blocker_caller: Some("batch-job".to_owned()),
            blocker_business_line: Some("offline".to_owned()),
            blocker_prompt_tokens: Some(1500),
            // High bit set: stored as a negative integer, read back bit for bit.
            prompt_sketch: Some(0x8000_0000_dead_beef),
            ttft_unaccounted_ms: Some(490.5),
            e2e_unaccounted_ms: Some(512.25),
            engine_timing: Some("consistent".to_owned()),
        }
    }

    /// Only the mandatory fields.
    pub(crate) fn sparse_record(id: &str) -> RequestRecord {
        RequestRecord {
            request_id: id.to_owned(),
            trace_id: "00000000000000000000000000000001".to_owned(),
            created_at: 1_700_000_000_000_000,
            model: "m".to_owned(),
            upstream: "u".to_owned(),
            request_type: "chat".to_owned(),
            total_duration_ms: 1.0,
            ..RequestRecord::default()
        }
    }

    #[test]
    fn columns_match_schema() {
        let store = SqliteStore::open_in_memory().expect("open");
        let stmt = store
            .conn()
            .prepare(&format!("SELECT * FROM {TABLE}"))
            .expect("prepare");
        let names: Vec<String> = stmt.column_names().map(str::to_owned).collect();
        assert_eq!(names, COLUMNS.map(str::to_owned).to_vec());
        drop(stmt);
        assert_eq!(store.schema_version().expect("version"), SCHEMA_VERSION);
    }

    #[test]
    fn round_trip_full_and_sparse() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        let full = full_record("req-full");
        let sparse = sparse_record("req-sparse");
        assert_eq!(
            store
                .insert_batch(&[full.clone(), sparse.clone()])
                .expect("insert"),
            2
        );
        assert_eq!(store.get("req-full").expect("get"), Some(full));
        assert_eq!(store.get("req-sparse").expect("get"), Some(sparse));
        assert_eq!(store.get("nope").expect("get"), None);
        assert_eq!(store.count().expect("count"), 2);
    }

    #[test]
    fn nulls_are_nulls() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.insert(&sparse_record("s")).expect("insert");
        let (ttft, bucket, stream): (Option<f64>, Option<String>, i64) = store
            .conn()
            .query_row(
                "SELECT ttft_ms, input_bucket, stream FROM llm_inference_log",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .expect("row");
        assert_eq!((ttft, bucket, stream), (None, None, 0));
        store.insert(&full_record("f")).expect("insert");
        let (bucket, outcome): (String, String) = store
            .conn()
            .query_row(
                "SELECT input_bucket, outcome FROM llm_inference_log WHERE request_id = 'f'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("row");
        assert_eq!(
            (bucket.as_str(), outcome.as_str()),
            ("512-2048", "upstream_error")
        );
    }

    #[test]
    fn unlinked_file_is_recreated_before_the_next_write() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.db");
        let mut store = SqliteStore::open(&path).expect("open");
        assert_eq!(store.file_change(), None);
        store
            .insert_batch(&[sparse_record("before-1"), sparse_record("before-2")])
            .expect("insert");
        std::fs::remove_file(&path).expect("rm");
        assert_eq!(store.file_change(), Some(FileChange::Unlinked));
        let after: Vec<_> = (0..3)
            .map(|i| sparse_record(&format!("after-{i}")))
            .collect();
        assert_eq!(store.insert_batch(&after).expect("insert after rm"), 3);
        assert_eq!(store.take_reopened(), [FileChange::Unlinked]);
        assert_eq!(store.take_reopened(), []);
        assert_eq!(store.file_change(), None);
        // The recreated file has the schema and exactly the rows written after the unlink.
        let read = SqliteStore::open_read_only(&path).expect("read");
        assert_eq!(read.schema_version().expect("v"), SCHEMA_VERSION);
        let mut ids: Vec<String> = read
            .recent(10)
            .expect("recent")
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        ids.sort();
        assert_eq!(ids, ["after-0", "after-1", "after-2"]);
    }

    #[test]
    fn replaced_file_is_reopened_before_the_next_write() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.db");
        let mut store = SqliteStore::open(&path).expect("open");
        store.insert(&sparse_record("old")).expect("insert");
        // Another database moved over the path (a restore from a backup).
        let other = dir.path().join("other.db");
        {
            let mut o = SqliteStore::open(&other).expect("other");
            o.insert(&sparse_record("restored")).expect("insert");
        }
        std::fs::rename(&other, &path).expect("mv");
        assert_eq!(store.file_change(), Some(FileChange::Replaced));
        assert!(store.insert(&sparse_record("new")).expect("insert"));
        assert_eq!(store.take_reopened(), [FileChange::Replaced]);
        let read = SqliteStore::open_read_only(&path).expect("read");
        let ids: Vec<String> = read
            .recent(10)
            .expect("recent")
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(read.count().expect("count"), 2, "{ids:?}");
        assert!(read.get("restored").expect("get").is_some(), "{ids:?}");
        assert!(read.get("new").expect("get").is_some());
        assert!(read.get("old").expect("get").is_none());
    }

    #[test]
    fn an_in_memory_store_has_no_file_to_check() {
        let mut store = SqliteStore::open_in_memory().expect("mem");
        assert_eq!(store.file_change(), None);
        store.insert(&sparse_record("a")).expect("insert");
        assert_eq!(store.take_reopened(), []);
    }

    #[test]
    fn client_request_id_is_data_and_searchable() {
        let mut store = SqliteStore::open_in_memory().expect("mem");
        let recs: Vec<RequestRecord> = (0..3)
            .map(|i| RequestRecord {
                client_request_id: Some("same-client-id".to_owned()),
                created_at: 1_700_000_000_000_000 + i,
                ..sparse_record(&format!("key-{i}"))
            })
            .collect();
        assert_eq!(store.insert_batch(&recs).expect("insert"), 3);
        let found = store
            .by_client_request_id("same-client-id")
            .expect("search");
        assert_eq!(
            found
                .iter()
                .map(|r| r.request_id.as_str())
                .collect::<Vec<_>>(),
            ["key-0", "key-1", "key-2"]
        );
        assert!(store
            .by_client_request_id("other")
            .expect("search")
            .is_empty());
        let plan = query_plan(
            store.conn(),
            "SELECT request_id FROM llm_inference_log WHERE client_request_id = 'x'",
        );
        assert!(plan.contains("idx_log_client_request_id"), "{plan}");
    }

    #[test]
    fn insert_or_ignore_dedups() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        let a = full_record("a");
        let b = sparse_record("b");
        assert_eq!(store.insert_batch(&[a.clone(), b.clone()]).expect("1st"), 2);
        // A retried batch: nothing new, nothing doubled, the first version wins.
        let mut a2 = a.clone();
        a2.model = "changed".to_owned();
        assert_eq!(store.insert_batch(&[a2, b]).expect("retry"), 0);
        assert_eq!(store.count().expect("count"), 2);
        assert_eq!(store.get("a").expect("get"), Some(a));
        assert!(!store.insert(&full_record("a")).expect("single"));
        assert!(store.insert(&full_record("c")).expect("single"));
        assert_eq!(store.count().expect("count"), 3);
        assert_eq!(store.insert_batch(&[]).expect("empty"), 0);
    }

    #[test]
    fn migrations_idempotent_on_reopen_and_read_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nested/dir/ts.db");
        {
            let mut store = SqliteStore::open(&path).expect("open 1");
            assert_eq!(store.schema_version().expect("v"), SCHEMA_VERSION);
            store.insert(&full_record("x")).expect("insert");
            let mode: String = store
                .conn()
                .query_row("PRAGMA journal_mode", [], |r| r.get(0))
                .expect("mode");
            assert_eq!(mode, "wal");
        }
        {
            let store = SqliteStore::open(&path).expect("open 2");
            assert_eq!(store.schema_version().expect("v"), SCHEMA_VERSION);
            assert_eq!(store.count().expect("count"), 1);
        }
        // A reader and the writer at the same time.
        let mut writer = SqliteStore::open(&path).expect("writer");
        let reader = SqliteStore::open_read_only(&path).expect("reader");
        writer.insert(&full_record("y")).expect("insert");
        assert_eq!(reader.count().expect("count"), 2);
        assert_eq!(reader.get("x").expect("get"), Some(full_record("x")));
        assert!(reader
            .conn()
            .execute("DELETE FROM llm_inference_log", [])
            .is_err());
    }

    #[test]
    fn refuses_newer_schema_and_missing_schema() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ts.db");
        drop(SqliteStore::open(&path).expect("open"));
        {
            let conn = Connection::open(&path).expect("raw");
            conn.pragma_update(None, "user_version", 99).expect("bump");
        }
        assert!(matches!(
            SqliteStore::open(&path),
            Err(StoreError::SchemaTooNew { found: 99, .. })
        ));
        assert!(matches!(
            SqliteStore::open_read_only(&path),
            Err(StoreError::SchemaTooNew { found: 99, .. })
        ));
        let empty = dir.path().join("empty.db");
        drop(Connection::open(&empty).expect("raw"));
        assert!(matches!(
            SqliteStore::open_read_only(&empty),
            Err(StoreError::NoSchema(_))
        ));
        assert!(SqliteStore::open_read_only(dir.path().join("missing.db")).is_err());
    }

    #[test]
    fn recent_and_retention() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        let recs: Vec<RequestRecord> = (0..5)
            .map(|i| {
                let mut r = sparse_record(&format!("r{i}"));
                r.created_at = 1_000 * i;
                r
            })
            .collect();
        store.insert_batch(&recs).expect("insert");
        let recent = store.recent(2).expect("recent");
        assert_eq!(
            recent
                .iter()
                .map(|r| r.request_id.as_str())
                .collect::<Vec<_>>(),
            ["r4", "r3"]
        );
        assert_eq!(store.delete_before(2_000).expect("delete"), 2);
        assert_eq!(store.count().expect("count"), 3);
    }

    #[test]
    fn decode_rejects_unknown_enum_text() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.insert(&sparse_record("z")).expect("insert");
        store
            .conn()
            .execute("UPDATE llm_inference_log SET outcome = 'weird'", [])
            .expect("update");
        assert!(store.get("z").is_err());
    }

    /// A database exactly as schema v1 left it, with one row written by v1.
    fn v1_database(path: &Path) {
        let conn = Connection::open(path).expect("raw");
        conn.execute_batch(MIGRATIONS[0]).expect("v1 schema");
        conn.pragma_update(None, "user_version", 1).expect("v1");
        conn.execute(
            "INSERT INTO llm_inference_log (request_id, trace_id, created_at, model, upstream,
                request_type, endpoint, stream, http_status, outcome, input_tokens_source,
                output_tokens_source, queue_source, prefill_source, decode_source,
                total_duration_ms, ttft_ms, queue_duration_ms)
             VALUES ('old', 'aaaa', 5, 'm', 'u', 'chat', 'chat_completions', 1, 200, 'ok',
                'usage', 'usage', 'derived', 'none', 'none', 10.0, 8.0, 2.0)",
            [],
        )
        .expect("v1 row");
    }

    #[test]
    fn v1_database_migrates_to_the_current_schema_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v1.db");
        v1_database(&path);
        // A read-only open of a v1 file is refused with a clear error (the reads name v2…v5
        // columns)…
        assert!(matches!(
            SqliteStore::open_read_only(&path),
            Err(StoreError::SchemaTooOld {
                found: 1,
                expected: MIN_READ_VERSION
            })
        ));
        // …and a writer migrates it (v1 → … → v5 in one transaction).
        let mut store = SqliteStore::open(&path).expect("migrate");
        assert_eq!(store.schema_version().expect("v"), SCHEMA_VERSION);
        let old = store.get("old").expect("get").expect("row kept");
        assert_eq!(old.ttft_ms, Some(8.0));
        assert_eq!(old.queue_source, PhaseSource::Derived);
        assert_eq!(
            (old.engine, old.engine_kv_usage, old.input_tokens_entry),
            (None, None, None)
        );
        assert_eq!(
            (old.cache_creation_tokens, old.replica.as_str()),
            (None, "")
        );
        assert_eq!(
            (
                old.blocked_by_requests,
                old.blocked_ms,
                old.blocker_request_id
            ),
            (None, None, None)
        );
        // New rows carry every new field.
        store.insert(&full_record("new")).expect("insert");
        assert_eq!(store.get("new").expect("get"), Some(full_record("new")));
        // The covering index was rebuilt with the phase and engine columns; trace id indexed.
        let cols: Vec<String> = store
            .conn()
            .prepare("SELECT name FROM pragma_index_info('idx_log_created_at') ORDER BY seqno")
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("cols");
        for c in [
            "created_at",
            "queue_duration_ms",
            "prefill_duration_ms",
            "decode_duration_ms",
            "engine",
            "engine_kv_usage",
            "ttft_unaccounted_ms",
        ] {
            assert!(cols.iter().any(|x| x == c), "{c} missing from {cols:?}");
        }
        assert_eq!(cols.len(), 23);
        assert_v4_indexes(store.conn());
        // A late update reaches the migrated row.
        store
            .apply_updates(&[PhaseUpdate {
                trace_id: "aaaa".to_owned(),
                queue_duration_ms: Some(3.0),
                ..PhaseUpdate::default()
            }])
            .expect("update");
        let old = store.get("old").expect("get").expect("row");
        assert_eq!(
            (old.queue_duration_ms, old.queue_source),
            (Some(3.0), PhaseSource::EngineSpan)
        );
        drop(store);
        // Reopening is a no-op; readers are accepted now.
        let store = SqliteStore::open(&path).expect("reopen");
        assert_eq!(store.schema_version().expect("v"), SCHEMA_VERSION);
        assert_eq!(store.count().expect("count"), 2);
        let reader = SqliteStore::open_read_only(&path).expect("ro after migration");
        assert_eq!(reader.count().expect("count"), 2);
    }

    /// Schema v4: the primary key and the covering time index, nothing else; the late-update
    /// statement seeks the time index.
    fn assert_v4_indexes(conn: &Connection) {
        let plan = query_plan(conn, &FIND_BY_TRACE_SQL);
        assert!(
            plan.contains("idx_log_created_at (created_at>? AND created_at<?)"),
            "{plan}"
        );
        let names: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name")
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("names");
        // v6 added the partial index on the client's request id.
        assert_eq!(
            names,
            [
                "idx_log_client_request_id",
                "idx_log_created_at",
                "sqlite_autoindex_llm_inference_log_1"
            ]
        );
    }

    #[test]
    fn v2_database_migrates_to_the_current_schema_and_keeps_late_updates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v2.db");
        {
            // A file exactly as schema v2 left it, with a row written by v2.
            let conn = Connection::open(&path).expect("raw");
            conn.execute_batch(MIGRATIONS[0]).expect("v1 schema");
            conn.execute_batch(MIGRATIONS[1]).expect("v2 schema");
            conn.pragma_update(None, "user_version", 2).expect("v2");
            conn.execute(
                "INSERT INTO llm_inference_log (request_id, trace_id, created_at, model,
                    upstream, request_type, endpoint, stream, http_status, outcome,
                    input_tokens_source, output_tokens_source, queue_source, prefill_source,
                    decode_source, total_duration_ms, engine)
                 VALUES ('v2row', '4bf92f3577b34da6a3ce929d0e0e4736', 5, 'm', 'u', 'chat',
                    'chat_completions', 1, 200, 'ok', 'usage', 'usage', 'derived', 'none',
                    'none', 10.0, 'vllm')",
                [],
            )
            .expect("v2 row");
        }
        // A v2 file lacks `cost_usd` (v5), which the reads name: readers refuse it until a
        // writer migrated it.
        assert!(matches!(
            SqliteStore::open_read_only(&path),
            Err(StoreError::SchemaTooOld {
                found: 2,
                expected: MIN_READ_VERSION
            })
        ));
        let mut store = SqliteStore::open(&path).expect("migrate");
        assert_eq!(store.schema_version().expect("v"), SCHEMA_VERSION);
        assert_v4_indexes(store.conn());
        // A row written before the migration is found by its trace id (the trace map is
        // loaded from the newest rows when the store opens)…
        let n = store
            .apply_updates(&[PhaseUpdate {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
                prefill_duration_ms: Some(7.0),
                ..PhaseUpdate::default()
            }])
            .expect("update");
        assert_eq!(n, 1);
        drop(store);
        // …and so is it after a restart (read back through a fresh writer and a reader).
        let mut store = SqliteStore::open(&path).expect("reopen");
        let row = store.get("v2row").expect("get").expect("row");
        assert_eq!(
            (row.prefill_duration_ms, row.prefill_source),
            (Some(7.0), PhaseSource::EngineSpan)
        );
        let n = store
            .apply_updates(&[PhaseUpdate {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".to_owned(),
                decode_duration_ms: Some(9.0),
                ..PhaseUpdate::default()
            }])
            .expect("update after restart");
        assert_eq!(n, 1);
        let reader = SqliteStore::open_read_only(&path).expect("ro");
        assert_eq!(reader.count().expect("count"), 1);
    }

    #[test]
    fn update_matches_the_full_trace_id_not_a_prefix() {
        // Two trace ids sharing an 8-character prefix, plus ids shorter than it.
        let mut store = SqliteStore::open_in_memory().expect("open");
        let a = "4bf92f35aaaaaaaaaaaaaaaaaaaaaaaa";
        let b = "4bf92f35bbbbbbbbbbbbbbbbbbbbbbbb";
        store
            .insert_batch(&[
                gateway_record("a", a),
                gateway_record("b", b),
                gateway_record("c", "4bf9"),
            ])
            .expect("insert");
        assert_eq!(store.apply_updates(&[engine_update(b)]).expect("up"), 1);
        assert_eq!(store.get("a").expect("get"), Some(gateway_record("a", a)));
        assert_eq!(store.get("b").expect("get"), Some(joined_record("b", b)));
        assert_eq!(
            store.get("c").expect("get"),
            Some(gateway_record("c", "4bf9"))
        );
        assert_eq!(
            store.apply_updates(&[engine_update("4bf9")]).expect("up"),
            1
        );
        assert_eq!(
            store.get("c").expect("get"),
            Some(joined_record("c", "4bf9"))
        );
        // A prefix alone matches nothing (it waits in the pending map).
        assert_eq!(
            store
                .apply_updates(&[engine_update("4bf92f35")])
                .expect("up"),
            0
        );
        assert_eq!(store.pending_updates(), 1);
    }

    #[test]
    fn multi_row_insert_chunks_and_remainder() {
        // More than one full multi-row statement plus a remainder, with duplicates inside
        // and across chunks: counts and contents are exactly those of row-by-row inserts.
        let mut store = SqliteStore::open_in_memory().expect("open");
        let n = ROWS_PER_INSERT * 2 + 5;
        let mut recs: Vec<RequestRecord> = (0..n)
            .map(|i| {
                let mut r = if i % 2 == 0 {
                    full_record(&format!("r{i}"))
                } else {
                    sparse_record(&format!("r{i}"))
                };
                r.trace_id = format!("{i:032x}");
                r
            })
            .collect();
        recs.push(full_record("r3")); // duplicate of a row in the first chunk
        assert_eq!(store.insert_batch(&recs).expect("insert"), n);
        assert_eq!(store.count().expect("count"), n as u64);
        for r in &recs[..n] {
            assert_eq!(store.get(&r.request_id).expect("get").as_ref(), Some(r));
        }
        // The whole batch again (a retry): nothing new.
        assert_eq!(store.insert_batch(&recs).expect("retry"), 0);
        assert_eq!(store.count().expect("count"), n as u64);
    }

    fn engine_update(trace: &str) -> PhaseUpdate {
        PhaseUpdate {
            trace_id: trace.to_owned(),
            queue_duration_ms: Some(40.0),
            prefill_duration_ms: Some(55.5),
            decode_duration_ms: None,
            input_tokens: Some(700),
            output_tokens: Some(99),
            per_step: false,
        }
    }

    /// A record as the gateway writes it before the engine span arrives: derived queue, no
    /// prefill, no token counts.
    fn gateway_record(id: &str, trace: &str) -> RequestRecord {
        let mut r = sparse_record(id);
        r.trace_id = trace.to_owned();
        r.ttft_ms = Some(120.0);
        r.queue_duration_ms = Some(10.0);
        r.queue_source = PhaseSource::Derived;
        r.decode_duration_ms = Some(500.0);
        r.decode_source = PhaseSource::Engine;
        r.output_tokens = Some(12);
        r.output_tokens_source = TokenSource::Chunks;
        r.input_bucket = Some(InputBucket::B0To128); // from the entry estimate
        r.split_times(); // as the gateway finishes every record
        r
    }

    /// What [`gateway_record`] becomes once [`engine_update`] is applied.
    fn joined_record(id: &str, trace: &str) -> RequestRecord {
        let mut r = gateway_record(id, trace);
        r.queue_duration_ms = Some(40.0);
        r.queue_source = PhaseSource::EngineSpan;
        r.prefill_duration_ms = Some(55.5);
        r.prefill_source = PhaseSource::EngineSpan;
        // decode: None in the update → unchanged.
        r.input_tokens = Some(700);
        r.input_tokens_source = TokenSource::Engine;
        r.input_bucket = Some(InputBucket::B512To2048);
        // output tokens were only counted from chunks → the engine's count replaces them
        // (a count from `usage` or the engine itself would be kept).
        r.output_tokens = Some(99);
        r.output_tokens_source = TokenSource::Engine;
        // The TTFT / end-to-end split follows the new phases (the one rule).
        r.split_times();
        r
    }

    #[test]
    fn update_after_insert() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store
            .insert_batch(&[gateway_record("a", "t1"), gateway_record("b", "t2")])
            .expect("insert");
        let n = store.apply_updates(&[engine_update("t1")]).expect("update");
        assert_eq!(n, 1);
        assert_eq!(store.get("a").expect("get"), Some(joined_record("a", "t1")));
        // The other row is untouched.
        assert_eq!(
            store.get("b").expect("get"),
            Some(gateway_record("b", "t2"))
        );
        assert_eq!(store.pending_updates(), 0);
        assert_eq!(store.take_unmatched(false), UnmatchedCounts::default());
    }

    #[test]
    fn update_keeps_usage_counts() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        let mut r = gateway_record("a", "t1");
        r.input_tokens = Some(5);
        r.input_tokens_source = TokenSource::Usage;
        r.output_tokens_source = TokenSource::Usage;
        store.insert_batch(&[r]).expect("insert");
        store.apply_updates(&[engine_update("t1")]).expect("update");
        let got = store.get("a").expect("get").expect("row");
        assert_eq!(
            (got.input_tokens, got.input_tokens_source),
            (Some(5), TokenSource::Usage)
        );
        assert_eq!(
            (got.output_tokens, got.output_tokens_source),
            (Some(12), TokenSource::Usage)
        );
        assert_eq!(got.queue_duration_ms, Some(40.0));
    }

    #[test]
    fn update_before_insert_is_applied_on_insert() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        // Two partial spans for the same trace, both before the record.
        let mut first = engine_update("t1");
        first.prefill_duration_ms = None;
        let second = PhaseUpdate {
            trace_id: "t1".to_owned(),
            prefill_duration_ms: Some(55.5),
            ..PhaseUpdate::default()
        };
        assert_eq!(store.apply_updates(&[first]).expect("update"), 0);
        assert_eq!(store.apply_updates(&[second]).expect("update"), 0);
        assert_eq!(store.pending_updates(), 1);
        store
            .insert(&gateway_record("other", "t9"))
            .expect("insert");
        assert_eq!(store.pending_updates(), 1);
        store.insert(&gateway_record("a", "t1")).expect("insert");
        assert_eq!(store.pending_updates(), 0);
        assert_eq!(store.get("a").expect("get"), Some(joined_record("a", "t1")));
        assert_eq!(store.take_unmatched(true), UnmatchedCounts::default());
    }

    #[test]
    fn failed_insert_keeps_pending_update() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.apply_updates(&[engine_update("t1")]).expect("update");
        // A batch that fails (NOT NULL violated by a broken row) rolls back entirely…
        store
            .conn()
            .execute_batch(
                "CREATE TRIGGER boom BEFORE INSERT ON llm_inference_log
                 WHEN NEW.request_id = 'bad' BEGIN SELECT RAISE(ABORT, 'boom'); END;",
            )
            .expect("trigger");
        let batch = [gateway_record("a", "t1"), gateway_record("bad", "t2")];
        assert!(store.insert_batch(&batch).is_err());
        assert_eq!(store.count().expect("count"), 0);
        // …and the update still waits for the retry.
        assert_eq!(store.pending_updates(), 1);
        store
            .conn()
            .execute_batch("DROP TRIGGER boom")
            .expect("drop");
        store.insert_batch(&batch).expect("retry");
        assert_eq!(store.get("a").expect("get"), Some(joined_record("a", "t1")));
        assert_eq!(store.pending_updates(), 0);
    }

    #[test]
    fn updates_are_idempotent() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.insert(&gateway_record("a", "t1")).expect("insert");
        for _ in 0..3 {
            store
                .apply_updates(&[engine_update("t1"), engine_update("t1")])
                .expect("update");
            assert_eq!(store.get("a").expect("get"), Some(joined_record("a", "t1")));
        }
        // A later update with other token counts does not overwrite filled ones.
        let mut later = engine_update("t1");
        later.input_tokens = Some(5);
        later.queue_duration_ms = Some(41.0);
        store.apply_updates(&[later]).expect("update");
        let got = store.get("a").expect("get").expect("row");
        assert_eq!(
            (got.input_tokens, got.queue_duration_ms),
            (Some(700), Some(41.0))
        );
    }

    #[test]
    fn update_ignores_bad_values_and_empty_trace() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.insert(&gateway_record("a", "t1")).expect("insert");
        let bad = PhaseUpdate {
            trace_id: "t1".to_owned(),
            queue_duration_ms: Some(f64::NAN),
            prefill_duration_ms: Some(-1.0),
            decode_duration_ms: Some(f64::INFINITY),
            input_tokens: None,
            output_tokens: None,
            per_step: false,
        };
        let empty = PhaseUpdate::default();
        assert_eq!(store.apply_updates(&[bad, empty]).expect("update"), 1);
        assert_eq!(
            store.get("a").expect("get"),
            Some(gateway_record("a", "t1"))
        );
        assert_eq!(store.pending_updates(), 0);
        assert_eq!(store.apply_updates(&[]).expect("empty"), 0);
    }

    #[test]
    fn update_applies_to_every_row_of_the_trace() {
        // A client that propagates one traceparent over several requests: the span cannot
        // tell them apart, every row of the trace gets the values (documented limitation).
        let mut store = SqliteStore::open_in_memory().expect("open");
        store
            .insert_batch(&[gateway_record("a", "t1"), gateway_record("b", "t1")])
            .expect("insert");
        assert_eq!(
            store.apply_updates(&[engine_update("t1")]).expect("update"),
            1
        );
        assert_eq!(store.get("a").expect("get"), Some(joined_record("a", "t1")));
        assert_eq!(store.get("b").expect("get"), Some(joined_record("b", "t1")));
    }

    #[test]
    fn pending_overflow_and_expiry_are_reported() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        store.set_pending_limits(2, Duration::from_secs(600));
        let ups: Vec<PhaseUpdate> = (0..5).map(|i| engine_update(&format!("t{i}"))).collect();
        store.apply_updates(&ups).expect("update");
        assert_eq!(store.pending_updates(), 2);
        assert_eq!(
            store.take_unmatched(false),
            UnmatchedCounts {
                overflow: 3,
                ..UnmatchedCounts::default()
            }
        );
        // The two newest still wait and are applied on insert.
        store.insert(&gateway_record("x", "t4")).expect("insert");
        assert_eq!(
            store
                .get("x")
                .expect("get")
                .and_then(|r| r.prefill_duration_ms),
            Some(55.5)
        );
        // TTL 0: everything waiting expires at the next look.
        store.set_pending_limits(2, Duration::ZERO);
        assert_eq!(
            store.take_unmatched(false),
            UnmatchedCounts {
                expired: 1,
                ..UnmatchedCounts::default()
            }
        );
        assert_eq!(store.pending_updates(), 0);
        // Shutdown reports what still waits.
        store.set_pending_limits(10, Duration::from_secs(600));
        store.apply_updates(&ups[..2]).expect("update");
        assert_eq!(store.take_unmatched(true).shutdown, 2);
        assert_eq!(store.pending_updates(), 0);
    }

    const DAY_US: i64 = 86_400_000_000;

    #[test]
    fn documented_sql_user_tokens_per_day() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        // now = 2024-01-08T00:00:00Z; the window is 2024-01-01 .. 2024-01-07 inclusive.
        let now_us: i64 = 1_704_672_000 * 1_000_000;
        let mut recs = Vec::new();
        let mut push = |id: &str, at: i64, user: &str, inp: Option<u64>, out: Option<u64>| {
            let mut r = sparse_record(id);
            r.created_at = at;
            r.user_id = Some(user.to_owned());
            r.input_tokens = inp;
            r.output_tokens = out;
            recs.push(r);
        };
        push("a", now_us - DAY_US + 5, "alice", Some(10), Some(1)); // 2024-01-07
        push("b", now_us - DAY_US + 7, "alice", Some(20), Some(2)); // 2024-01-07
        push("c", now_us - 7 * DAY_US, "alice", Some(100), None); // 2024-01-01, first µs
        push(
            "d",
            now_us - 7 * DAY_US - 1,
            "alice",
            Some(1000),
            Some(1000),
        ); // too old
        push("e", now_us, "alice", Some(1000), Some(1000)); // end is exclusive
        push("f", now_us - 3 * DAY_US, "bob", Some(5000), Some(5000)); // other user
        push("g", now_us - 3 * DAY_US, "alice", None, Some(3)); // 2024-01-05
        store.insert_batch(&recs).expect("insert");

        let mut stmt = store
            .conn()
            .prepare(SQL_USER_TOKENS_PER_DAY)
            .expect("prepare");
        let rows: Vec<(String, i64, i64, i64, i64)> = stmt
            .query_map(
                rusqlite::named_params! { ":user_id": "alice", ":now_us": now_us },
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            rows,
            vec![
                ("2024-01-01".to_owned(), 1, 100, 0, 100),
                ("2024-01-05".to_owned(), 1, 0, 3, 3),
                ("2024-01-07".to_owned(), 2, 30, 3, 33),
            ]
        );
        // The plan range-scans the covering time index (user_id is in it): no table row read.
        let plan = query_plan(store.conn(), SQL_USER_TOKENS_PER_DAY);
        assert!(
            plan.contains("USING COVERING INDEX idx_log_created_at"),
            "{plan}"
        );
    }

    #[test]
    fn documented_sql_mean_ttft_by_bucket() {
        let mut store = SqliteStore::open_in_memory().expect("open");
        let mut recs = Vec::new();
        let mut push = |id: &str, model: &str, at: i64, bucket: InputBucket, ttft: Option<f64>| {
            let mut r = sparse_record(id);
            r.model = model.to_owned();
            r.created_at = at;
            r.input_bucket = Some(bucket);
            r.ttft_ms = ttft;
            recs.push(r);
        };
        push("1", "x", 100, InputBucket::B2048Plus, Some(3000.0));
        push("2", "x", 100, InputBucket::B2048Plus, Some(5000.0));
        push("3", "x", 100, InputBucket::B0To128, Some(200.0));
        push("4", "x", 100, InputBucket::B0To128, None); // non-streamed: excluded
        push("5", "x", 100, InputBucket::B128To512, Some(250.0));
        push("6", "y", 100, InputBucket::B0To128, Some(9999.0)); // other model
        push("7", "x", 10, InputBucket::B0To128, Some(9999.0)); // before :since_us
        store.insert_batch(&recs).expect("insert");

        let mut stmt = store
            .conn()
            .prepare(SQL_MEAN_TTFT_BY_BUCKET)
            .expect("prepare");
        let rows: Vec<(String, i64, f64)> = stmt
            .query_map(
                rusqlite::named_params! { ":model": "x", ":since_us": 50_i64 },
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            rows,
            vec![
                ("0-128".to_owned(), 1, 200.0),
                ("128-512".to_owned(), 1, 250.0),
                ("2048+".to_owned(), 2, 4000.0),
            ]
        );
        let plan = query_plan(store.conn(), SQL_MEAN_TTFT_BY_BUCKET);
        assert!(
            plan.contains("USING COVERING INDEX idx_log_created_at"),
            "{plan}"
        );
    }

    fn query_plan(conn: &Connection, sql: &str) -> String {
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .expect("explain");
        let n = stmt.parameter_count();
        let params: Vec<rusqlite::types::Value> =
            (0..n).map(|_| rusqlite::types::Value::Integer(0)).collect();
        let rows: Vec<String> = stmt
            .query_map(rusqlite::params_from_iter(params), |r| {
                r.get::<_, String>(3)
            })
            .expect("plan")
            .collect::<Result<_, _>>()
            .expect("rows");
        rows.join("\n")
    }
}
