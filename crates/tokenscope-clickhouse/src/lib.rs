//! # tokenscope-clickhouse
//!
//! The ClickHouse store: one row per request in `llm_inference_log`, written over the HTTP
//! interface with the official `clickhouse` client (RowBinary inserts).
//!
//! * [`config`] — [`ClickHouseConfig`], parsed from
//!   `clickhouse://[user[:pass]@]host[:port]/database[?cluster=…&shards=…&ttl_days=…]`.
//! * [`schema`] — the table (same column names as the SQLite store), the plain (≤ 20.7, e.g.
//!   Debian's 18.16) and modern (≥ 20.8: `LowCardinality`, `DateTime64`, `TTL`, codecs)
//!   dialects, the `Distributed` table of a cluster, and the versioned, idempotent migrations.
//! * [`store`] — [`ClickHouseStore`]: a synchronous API (own runtime) to connect, migrate,
//!   insert, read back (`FINAL`), stream `TabSeparated` results and sweep old partitions.
//! * [`sink`] — [`ClickHouseSink`]: the pipeline's [`RecordSink`](tokenscope_store::RecordSink),
//!   with late engine updates (re-insert with a higher `row_version`) and pending updates.
//! * [`report`] — the read side: the report aggregated by ClickHouse itself
//!   ([`clickhouse_aggregate`]: one row per group, exact nearest-rank quantiles in SQL,
//!   decoded by [`decode_group`] and finished by the embedded store's code, so both stores
//!   give the same report bit for bit) and the
//!   [`RecordReader`](tokenscope_store::RecordReader) implementation.
//! * [`error`] — [`ClickHouseError`] and its [`ErrorClass`](tokenscope_store::ErrorClass).
//! * `testutil` (feature `test-util`) — real-server harness for tests.
//!
//! Invariants:
//! * A row is keyed by `request_id` (the last column of the `ReplacingMergeTree` key): a
//!   retried batch or an updated re-insert never doubles a row as read by tokenscope, whose
//!   every read uses `FINAL`.
//! * Every request is bounded by a timeout; failures are classified (unavailable, auth, schema,
//!   rejected, other) for the pipeline's retry decisions.
//! * The password never appears in `Debug` output, logs or error messages.
//!
//! See `docs/clickhouse.md` for operating it (single server, cluster, retention).
#![deny(missing_docs)]

pub mod config;
pub mod error;
pub mod report;
pub mod row;
pub mod schema;
pub mod sink;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testutil;

pub use config::ClickHouseConfig;
pub use error::ClickHouseError;
pub use report::{ch_string, clickhouse_aggregate, clickhouse_usage, decode_group, decode_usage};
pub use schema::{Dialect, SCHEMA_VERSION};
pub use sink::ClickHouseSink;
pub use store::ClickHouseStore;
