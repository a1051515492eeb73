//! The ClickHouse schema: the two SQL dialects and the versioned migrations.
//!
//! ## Table
//!
//! `llm_inference_log` has one column per [`RequestRecord`](tokenscope_core::RequestRecord)
//! field under the same name as the SQLite table (enums as their `as_str()` text, `bool` as
//! `UInt8`, `Option` as `Nullable`), except time: `created_at_us Int64` holds the record's
//! `created_at` exactly (µs since the Unix epoch) and `created_at` is a time column computed
//! from it by a `DEFAULT` expression (`DateTime64(6, 'UTC')` on modern servers, `DateTime('UTC')`
//! — whole seconds — on old ones), so one RowBinary row layout ([`INSERT_COLUMNS`]) serves both
//! dialects. `row_version UInt64` orders versions of a row.
//!
//! The columns are a superset of the article's `llm_inference_log` (same names: `request_id,
//! user_id, model, request_type, input_tokens, output_tokens, queue_duration_ms,
//! prefill_duration_ms, decode_duration_ms, ttft_ms, tpot_ms, total_duration_ms, created_at`),
//! so its queries run unchanged; no alias columns are needed.
//!
//! Engine: `ReplacingMergeTree(row_version)`, `PARTITION BY toYYYYMMDD(created_at)` (one
//! partition per UTC day: retention drops whole days), `ORDER BY (toDate(created_at), model,
//! created_at_us, request_id)` — time-range and per-model scans read a contiguous range, and
//! the key ends with `request_id`, so a retried batch (same rows, same key) and a re-insert with
//! a higher `row_version` collapse to one row. Collapsing happens at merge time: every read of
//! tokenscope uses `FINAL`. Key columns are non-`Nullable`.
//!
//! ## Dialects
//!
//! [`Dialect::from_version`] reads `SELECT version()`. A server **≥ 20.8** gets the modern
//! dialect: `LowCardinality` for low-cardinality text, `DateTime64(6, 'UTC')` via
//! `fromUnixTimestamp64Micro`, `CODEC(Delta, ZSTD)` on the time columns and `ZSTD` on the prompt
//! text, a `bloom_filter` skipping index on `trace_id` (late engine updates look rows up by
//! trace id) and, with `ttl_days`, `TTL toStartOfDay(toDateTime(created_at)) + INTERVAL N+1 DAY`
//! (whole UTC days: the rows the old servers' retention sweep keeps). Each of those
//! appeared between 19.1 and 20.5 (the last, `fromUnixTimestamp64Micro`, in 20.5); 20.8 is the
//! first LTS release that has all of them, and we did not test anything older than that on the
//! modern path. Older servers (the test server is Debian's 18.16) get plain types with the same
//! names and no TTL: [`crate::ClickHouseStore::retention_sweep`] drops old daily partitions
//! instead.
//!
//! ## Cluster
//!
//! With `cluster=NAME` the data table is `llm_inference_log_local` on each node and
//! `llm_inference_log` is `Distributed(NAME, db, llm_inference_log_local, sipHash64(request_id))`:
//! sharding by request id keeps every version of a row on one shard, so `FINAL` (applied per
//! shard) still collapses them. With `shards=` the DDL is run on every listed node; without,
//! with `ON CLUSTER NAME` (needs ZooKeeper / Keeper).
//!
//! ## Migrations
//!
//! [`MIGRATIONS`] is append-only; the applied versions are recorded in
//! `tokenscope_schema_migrations` (a `ReplacingMergeTree` keyed by version, so two gateways
//! recording the same version leave one row). Every statement is idempotent (`IF NOT EXISTS`;
//! an "already exists" answer from a racing gateway counts as success), and
//! [`crate::ClickHouseStore::migrate`] runs **all** statements every time (a handful of cheap
//! DDL), then records the versions not yet recorded: several gateways may migrate at once, and a
//! dropped table is recreated by the next migrate. Future migrations must keep that property
//! (`ADD COLUMN IF NOT EXISTS`, …).
//!
//! * v1 — the table (above).
//! * v2 — `cost_usd Nullable(Float64)` after `gpu_memory_bandwidth` (USD at the configured
//!   prices; `NULL` = unpriced, and for rows written before v2), on the data table and, in a
//!   cluster, on the `Distributed` table too.
//! * v3 — `client_request_id Nullable(String)` after `cost_usd` (the client's own
//!   `x-request-id`; `NULL` when it sent none, and for rows written before v3). Data, never
//!   part of the key: `request_id` is always the gateway's own UUIDv7, so the sorting key's
//!   last column is unique per request and rows of different requests never collapse. On
//!   modern servers a `bloom_filter` skipping index `idx_client_request_id` makes lookups by
//!   it cheap (added with `ADD INDEX IF NOT EXISTS`; old servers have no skipping indexes
//!   and scan).
//! * v4 — `cache_creation_tokens Nullable(UInt64)` after `client_request_id` (prompt tokens
//!   written to the engine's prompt cache; `NULL` when unknown, and for rows written before
//!   v4) and `replica` (`LowCardinality(String)`, plain `String` on old servers) after it:
//!   the upstream replica that served the request, `host:port`; `''` when none was chosen,
//!   and for older rows. On the data table and, in a cluster, on the `Distributed` table.
//! * v6 — `tokenscope_alert_claims (fingerprint, replica, claimed_at_us)`: before a gateway of
//!   a fleet sends a firing alert it claims the incident there; the earliest claim within
//!   the hold time sends, the others stay quiet (`ClickHouseStore::claim`).
//! * v7 — the per-request blame columns after `replica`: `blocked_by_requests`,
//!   `blocked_by_prompt_tokens` (`Nullable(UInt64)`), `blocked_ms` (`Nullable(Float64)`),
//!   `blocker_request_id`, `blocker_caller`, `blocker_business_line` (`Nullable(String)`),
//!   `blocker_prompt_tokens` (`Nullable(UInt64)`); `NULL` when not measured, and for older
//!   rows. On the data table and, in a cluster, on the `Distributed` table.
//! * v8 — `prompt_sketch Nullable(UInt64)` after `blocker_prompt_tokens`: the prompt's
//!   similarity sketch (near-duplicate prompts in `waste`); `NULL` for older rows.
//! * v9 — `ttft_unaccounted_ms`, `e2e_unaccounted_ms` (`Nullable(Float64)`) and
//!   `engine_timing` (`Nullable(String)`) after `prompt_sketch`: the TTFT / end-to-end split
//!   (`RequestRecord::split_times`); `NULL` for older rows.
//! * v5 — on modern servers, `bloom_filter` skipping indexes on `user_id`, `tenant` and
//!   `business_line` (data tables; none on old servers, which have no skipping indexes).
//!   How the table serves the article's queries: per model and time by the sorting key
//!   `(toDate(created_at), model, created_at_us, …)` and the daily partitions; per caller
//!   and time by the daily partitions plus these indexes, which skip the granules (8 192
//!   rows) that hold no row of the caller. A projection ordered by caller would serve that
//!   better, but every read here is `FINAL` (`ReplacingMergeTree`), which projections do
//!   not serve. Indexes added to an existing table cover parts written after the migration
//!   (`ALTER TABLE … MATERIALIZE INDEX idx_user_id` covers the old ones, a background
//!   rewrite).

use crate::ClickHouseError;

/// The table tokenscope writes to and reads from.
pub const TABLE: &str = "llm_inference_log";
/// The per-node data table in a cluster.
pub const LOCAL_TABLE: &str = "llm_inference_log_local";
/// The table recording applied migrations.
pub const MIGRATIONS_TABLE: &str = "tokenscope_schema_migrations";

/// The columns of an insert (and of every full-row read), in RowBinary order: the SQLite
/// column list with `created_at` replaced by `created_at_us`, plus `row_version`.
pub const INSERT_COLUMNS: [&str; 66] = [
    "request_id",
    "trace_id",
    "created_at_us",
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
    "row_version",
];

/// The oldest server version given the modern dialect.
pub const MODERN_SINCE: (u32, u32) = (20, 8);

/// Which SQL features the server supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dialect {
    /// `(major, minor, patch)` of the server.
    pub version: (u32, u32, u32),
    /// `LowCardinality(String)`.
    pub low_cardinality: bool,
    /// `DateTime64(6, 'UTC')` for `created_at`.
    pub datetime64: bool,
    /// Table `TTL`.
    pub ttl: bool,
    /// Column `CODEC`s.
    pub codecs: bool,
    /// `bloom_filter` data-skipping index on `trace_id`.
    pub skip_index: bool,
}

impl Dialect {
    /// The dialect of a server whose `SELECT version()` is `v` (`"23.8.1.1"`, `"18.16.1"`).
    pub fn from_version(v: &str) -> Result<Self, ClickHouseError> {
        let mut it = v.trim().split('.').map(|p| p.parse::<u32>());
        let (Some(Ok(major)), Some(Ok(minor))) = (it.next(), it.next()) else {
            return Err(ClickHouseError::UnsupportedVersion(v.to_owned()));
        };
        let patch = it.next().and_then(Result::ok).unwrap_or(0);
        let modern = (major, minor) >= MODERN_SINCE;
        Ok(Self {
            version: (major, minor, patch),
            low_cardinality: modern,
            datetime64: modern,
            ttl: modern,
            codecs: modern,
            skip_index: modern,
        })
    }

    /// `true` when every modern feature is on.
    pub fn is_modern(&self) -> bool {
        self.low_cardinality && self.datetime64 && self.ttl && self.codecs && self.skip_index
    }

    fn lc(&self, nullable: bool) -> &'static str {
        match (self.low_cardinality, nullable) {
            (true, false) => "LowCardinality(String)",
            (true, true) => "LowCardinality(Nullable(String))",
            (false, false) => "String",
            (false, true) => "Nullable(String)",
        }
    }

    /// The column definitions of the data table.
    pub fn columns(&self) -> Vec<String> {
        let codec = |c: &str| {
            if self.codecs {
                format!(" CODEC({c})")
            } else {
                String::new()
            }
        };
        let created_at = if self.datetime64 {
            format!(
                "created_at DateTime64(6, 'UTC') DEFAULT fromUnixTimestamp64Micro(created_at_us, 'UTC'){}",
                codec("Delta, ZSTD(1)")
            )
        } else {
            "created_at DateTime('UTC') DEFAULT toDateTime(intDiv(created_at_us, 1000000), 'UTC')"
                .to_owned()
        };
        let f = "Nullable(Float64)";
        let u = "Nullable(UInt64)";
        let mut cols = vec![
            "request_id String".to_owned(),
            "trace_id String".to_owned(),
            format!("created_at_us Int64{}", codec("Delta, ZSTD(1)")),
            created_at,
            format!("model {}", self.lc(false)),
            format!("model_served {}", self.lc(true)),
            format!("upstream {}", self.lc(false)),
            "user_id Nullable(String)".to_owned(),
            format!("tenant {}", self.lc(true)),
            format!("business_line {}", self.lc(true)),
            format!("request_type {}", self.lc(false)),
            "api_key_id Nullable(String)".to_owned(),
            format!("endpoint {}", self.lc(false)),
            "stream UInt8".to_owned(),
            "http_status UInt16".to_owned(),
            format!("outcome {}", self.lc(false)),
            format!("error_type {}", self.lc(true)),
            format!("finish_reason {}", self.lc(true)),
        ];
        for c in [
            "max_tokens",
            "input_tokens",
            "output_tokens",
            "cached_tokens",
            "reasoning_tokens",
        ] {
            cols.push(format!("{c} {u}"));
        }
        cols.push(format!("input_tokens_source {}", self.lc(false)));
        cols.push(format!("output_tokens_source {}", self.lc(false)));
        cols.push(format!("input_bucket {}", self.lc(true)));
        for c in [
            "queue_duration_ms",
            "prefill_duration_ms",
            "decode_duration_ms",
        ] {
            cols.push(format!("{c} {f}"));
        }
        for c in ["queue_source", "prefill_source", "decode_source"] {
            cols.push(format!("{c} {}", self.lc(false)));
        }
        for c in ["ttft_ms", "tpot_ms", "itl_max_ms", "itl_mean_ms"] {
            cols.push(format!("{c} {f}"));
        }
        cols.push("total_duration_ms Float64".to_owned());
        cols.push(format!("upstream_headers_ms {f}"));
        cols.push(format!("gateway_overhead_ms {f}"));
        cols.push(format!("chunks {u}"));
        cols.push("prompt_hash Nullable(String)".to_owned());
        cols.push(format!("prompt_text Nullable(String){}", codec("ZSTD(3)")));
        cols.push(format!("draft_tokens {u}"));
        cols.push(format!("draft_accepted_tokens {u}"));
        cols.push(format!("engine {}", self.lc(true)));
        cols.push(format!("input_tokens_entry {u}"));
        for c in [
            "engine_running",
            "engine_waiting",
            "engine_kv_usage",
            "gpu_utilization",
            "gpu_memory_bandwidth",
        ] {
            cols.push(format!("{c} {f}"));
        }
        cols.push("row_version UInt64".to_owned());
        if self.skip_index {
            cols.push(
                "INDEX idx_trace_id trace_id TYPE bloom_filter(0.01) GRANULARITY 4".to_owned(),
            );
        }
        cols
    }

    /// `CREATE TABLE IF NOT EXISTS db.<table> [ON CLUSTER c] (…) ENGINE = ReplacingMergeTree…`
    /// for the data table.
    pub fn create_data_table(
        &self,
        database: &str,
        table: &str,
        on_cluster: Option<&str>,
        ttl_days: Option<u32>,
    ) -> String {
        let ttl = match ttl_days {
            // Whole UTC days, as the old servers' retention sweep keeps them: a row expires
            // when its day is before today − N (a row-precise `created_at + N DAY` would
            // delete part of the oldest day the sweep keeps).
            Some(n) if self.ttl => format!(
                "\nTTL toStartOfDay(toDateTime(created_at)) + INTERVAL {} DAY",
                u64::from(n) + 1
            ),
            _ => String::new(),
        };
        format!(
            "CREATE TABLE IF NOT EXISTS {database}.{table}{} (\n    {}\n)\nENGINE = ReplacingMergeTree(row_version)\nPARTITION BY toYYYYMMDD(created_at)\nORDER BY (toDate(created_at), model, created_at_us, request_id){ttl}",
            on_cluster_clause(on_cluster),
            self.columns().join(",\n    "),
        )
    }
}

fn on_cluster_clause(c: Option<&str>) -> String {
    c.map(|c| format!(" ON CLUSTER {c}")).unwrap_or_default()
}

/// `CREATE TABLE IF NOT EXISTS db.llm_inference_log AS db.llm_inference_log_local ENGINE =
/// Distributed(…)`.
pub fn create_distributed_table(database: &str, cluster: &str, on_cluster: bool) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {database}.{TABLE}{} AS {database}.{LOCAL_TABLE} ENGINE = Distributed({cluster}, {database}, {LOCAL_TABLE}, sipHash64(request_id))",
        on_cluster_clause(on_cluster.then_some(cluster)),
    )
}

/// `CREATE DATABASE IF NOT EXISTS db [ON CLUSTER c]`.
pub fn create_database(database: &str, on_cluster: Option<&str>) -> String {
    format!(
        "CREATE DATABASE IF NOT EXISTS {database}{}",
        on_cluster_clause(on_cluster)
    )
}

/// The migrations table (per node).
pub fn create_migrations_table(database: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {database}.{MIGRATIONS_TABLE} (version UInt32, applied_at DateTime, server_version String) ENGINE = ReplacingMergeTree ORDER BY version"
    )
}

/// Where a migration runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A single server (no cluster).
    Single,
    /// One node of a cluster whose nodes are migrated one by one (`shards=`).
    ClusterNode,
    /// The entry node of a cluster, with `ON CLUSTER` DDL.
    OnCluster,
}

/// One schema migration: its statements for a dialect, database, cluster and TTL.
pub struct Migration {
    /// Version reached once applied (1-based).
    pub version: u32,
    /// What it does.
    pub description: &'static str,
    /// The statements, in order; each idempotent.
    pub statements: fn(&Dialect, &MigrationContext<'_>) -> Vec<String>,
}

/// What a migration's statements depend on besides the dialect.
pub struct MigrationContext<'a> {
    /// Database name.
    pub database: &'a str,
    /// Cluster name, when clustered.
    pub cluster: Option<&'a str>,
    /// Where the statements run.
    pub target: Target,
    /// Retention.
    pub ttl_days: Option<u32>,
}

/// The ordered migrations. Append only; never edit a released entry.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "llm_inference_log (ReplacingMergeTree; Distributed over llm_inference_log_local in a cluster)",
        statements: v1,
    },
    Migration {
        version: 2,
        description: "cost_usd Nullable(Float64): the request's cost at the configured prices",
        statements: v2,
    },
    Migration {
        version: 3,
        description: "client_request_id Nullable(String): the client's own x-request-id (data, not the key)",
        statements: v3,
    },
    Migration {
        version: 4,
        description: "cache_creation_tokens Nullable(UInt64) and replica (the upstream replica that served the request)",
        statements: v4,
    },
    Migration {
        version: 5,
        description: "skipping indexes on user_id, tenant and business_line (per-caller queries over time; modern servers)",
        statements: v5,
    },
    Migration {
        version: 6,
        description: "tokenscope_alert_claims: which gateway of a fleet sends an alert",
        statements: v6,
    },
    Migration {
        version: 7,
        description: "per-request blame: blocked_by_requests, blocked_by_prompt_tokens, blocked_ms, blocker_{request_id,caller,business_line,prompt_tokens}",
        statements: v7,
    },
    Migration {
        version: 8,
        description: "prompt_sketch Nullable(UInt64): the prompt's similarity sketch (near-duplicates)",
        statements: v8,
    },
    Migration {
        version: 9,
        description: "ttft_unaccounted_ms, e2e_unaccounted_ms, engine_timing: the part of TTFT / end to end the engine did not account for",
        statements: v9,
    },
];

/// The columns of v9, in order (the first after `prompt_sketch`).
pub const SPLIT_COLUMNS: [(&str, &str); 3] = [
    ("ttft_unaccounted_ms", "Nullable(Float64)"),
    ("e2e_unaccounted_ms", "Nullable(Float64)"),
    ("engine_timing", "Nullable(String)"),
];

fn v9(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    add_columns_after(d, cx, "prompt_sketch", &SPLIT_COLUMNS)
}

fn v8(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    add_columns_after(
        d,
        cx,
        "blocker_prompt_tokens",
        &[("prompt_sketch", "Nullable(UInt64)")],
    )
}

/// The blame columns of v7, in order, each after the one before it (the first after
/// `replica`).
pub const BLAME_COLUMNS: [(&str, &str); 7] = [
    ("blocked_by_requests", "Nullable(UInt64)"),
    ("blocked_by_prompt_tokens", "Nullable(UInt64)"),
    ("blocked_ms", "Nullable(Float64)"),
    ("blocker_request_id", "Nullable(String)"),
    ("blocker_caller", "Nullable(String)"),
    ("blocker_business_line", "Nullable(String)"),
    ("blocker_prompt_tokens", "Nullable(UInt64)"),
];

/// The tables a column migration changes: the data table and, in a cluster, the
/// `Distributed` one, with the `ON CLUSTER` name when the migration runs on every node.
fn column_targets<'a>(cx: &MigrationContext<'a>) -> (Vec<&'static str>, Option<&'a str>) {
    match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => (vec![TABLE], None),
        (Target::ClusterNode, Some(_)) => (vec![LOCAL_TABLE, TABLE], None),
        (Target::OnCluster, Some(c)) => (vec![LOCAL_TABLE, TABLE], Some(c)),
    }
}

/// `ADD COLUMN` of each `(name, type)` in order, the first after `after`, on every table of
/// [`column_targets`].
fn add_columns_after(
    d: &Dialect,
    cx: &MigrationContext<'_>,
    after: &str,
    columns: &[(&str, &str)],
) -> Vec<String> {
    let (tables, on) = column_targets(cx);
    let mut out = Vec::new();
    for t in tables {
        let mut prev = after;
        for (name, ty) in columns {
            out.push(add_column(
                d,
                cx.database,
                t,
                on,
                &format!("{name} {ty}"),
                prev,
            ));
            prev = name;
        }
    }
    out
}

fn v7(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    add_columns_after(d, cx, "replica", &BLAME_COLUMNS)
}

/// The alert claims table (v6): one row per claim, `(fingerprint, replica, claimed_at_us)`.
pub const CLAIMS_TABLE: &str = "tokenscope_alert_claims";

/// v6: the claims table on the node the gateway talks to (also in a cluster: the gateways of
/// a fleet claim through the same entry node; `ON CLUSTER` creates it on every node so any
/// of them can be the entry). A plain `MergeTree`; old claims are small and few (one per
/// alert incident and replica), dropped by `TTL` after 7 days on modern servers.
fn v6(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    let on = match (cx.target, cx.cluster) {
        (Target::OnCluster, Some(c)) => Some(c),
        _ => None,
    };
    let ttl = if d.ttl {
        "\nTTL toDateTime(intDiv(claimed_at_us, 1000000)) + INTERVAL 7 DAY"
    } else {
        ""
    };
    vec![format!(
        "CREATE TABLE IF NOT EXISTS {}.{CLAIMS_TABLE}{} (fingerprint String, replica String, claimed_at_us Int64) ENGINE = MergeTree ORDER BY (fingerprint, claimed_at_us){ttl}",
        cx.database,
        on_cluster_clause(on),
    )]
}

/// The newest schema version this build knows.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

fn v1(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => {
            vec![d.create_data_table(cx.database, TABLE, None, cx.ttl_days)]
        }
        (Target::ClusterNode, Some(c)) => vec![
            d.create_data_table(cx.database, LOCAL_TABLE, None, cx.ttl_days),
            create_distributed_table(cx.database, c, false),
        ],
        (Target::OnCluster, Some(c)) => vec![
            d.create_data_table(cx.database, LOCAL_TABLE, Some(c), cx.ttl_days),
            create_distributed_table(cx.database, c, true),
        ],
    }
}

/// `ALTER TABLE db.<table> [ON CLUSTER c] ADD COLUMN [IF NOT EXISTS] cost_usd … AFTER
/// gpu_memory_bandwidth` (`AFTER` keeps the table's column order equal to
/// [`INSERT_COLUMNS`]). Old servers (18.x) have no `IF NOT EXISTS` on `ADD COLUMN`: there the
/// "column already exists" answer (`DUPLICATE_COLUMN`, 15, or `ILLEGAL_COLUMN`, 44) counts as
/// success, which keeps the migration idempotent.
fn add_cost_column(d: &Dialect, database: &str, table: &str, on_cluster: Option<&str>) -> String {
    format!(
        "ALTER TABLE {database}.{table}{} ADD COLUMN {}cost_usd Nullable(Float64) AFTER gpu_memory_bandwidth",
        on_cluster_clause(on_cluster),
        if d.is_modern() { "IF NOT EXISTS " } else { "" }
    )
}

fn v2(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => vec![add_cost_column(d, cx.database, TABLE, None)],
        (Target::ClusterNode, Some(_)) => vec![
            add_cost_column(d, cx.database, LOCAL_TABLE, None),
            add_cost_column(d, cx.database, TABLE, None),
        ],
        (Target::OnCluster, Some(c)) => vec![
            add_cost_column(d, cx.database, LOCAL_TABLE, Some(c)),
            add_cost_column(d, cx.database, TABLE, Some(c)),
        ],
    }
}

/// `ALTER TABLE db.<table> [ON CLUSTER c] ADD COLUMN [IF NOT EXISTS] client_request_id
/// Nullable(String) AFTER cost_usd` (idempotent like [`add_cost_column`]).
fn add_client_id_column(
    d: &Dialect,
    database: &str,
    table: &str,
    on_cluster: Option<&str>,
) -> String {
    format!(
        "ALTER TABLE {database}.{table}{} ADD COLUMN {}client_request_id Nullable(String) AFTER cost_usd",
        on_cluster_clause(on_cluster),
        if d.is_modern() { "IF NOT EXISTS " } else { "" }
    )
}

/// The skipping index on `client_request_id` (modern servers; data tables only).
fn add_client_id_index(database: &str, table: &str, on_cluster: Option<&str>) -> String {
    format!(
        "ALTER TABLE {database}.{table}{} ADD INDEX IF NOT EXISTS idx_client_request_id client_request_id TYPE bloom_filter(0.01) GRANULARITY 4",
        on_cluster_clause(on_cluster),
    )
}

fn v3(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    let (data, dist, on) = match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => (TABLE, None, None),
        (Target::ClusterNode, Some(_)) => (LOCAL_TABLE, Some(TABLE), None),
        (Target::OnCluster, Some(c)) => (LOCAL_TABLE, Some(TABLE), Some(c)),
    };
    let mut out = vec![add_client_id_column(d, cx.database, data, on)];
    if d.skip_index {
        out.push(add_client_id_index(cx.database, data, on));
    }
    if let Some(t) = dist {
        out.push(add_client_id_column(d, cx.database, t, on));
    }
    out
}

/// `ALTER TABLE db.<table> [ON CLUSTER c] ADD COLUMN [IF NOT EXISTS] <definition> AFTER
/// <after>` (idempotent like [`add_cost_column`]).
fn add_column(
    d: &Dialect,
    database: &str,
    table: &str,
    on_cluster: Option<&str>,
    definition: &str,
    after: &str,
) -> String {
    format!(
        "ALTER TABLE {database}.{table}{} ADD COLUMN {}{definition} AFTER {after}",
        on_cluster_clause(on_cluster),
        if d.is_modern() { "IF NOT EXISTS " } else { "" }
    )
}

/// The per-caller skipping indexes of v5 (see the module docs).
pub const CALLER_INDEXES: [(&str, &str); 3] = [
    ("idx_user_id", "user_id"),
    ("idx_tenant", "tenant"),
    ("idx_business_line", "business_line"),
];

fn v5(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    if !d.skip_index {
        return Vec::new();
    }
    let (data, on) = match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => (TABLE, None),
        (Target::ClusterNode, Some(_)) => (LOCAL_TABLE, None),
        (Target::OnCluster, Some(c)) => (LOCAL_TABLE, Some(c)),
    };
    CALLER_INDEXES
        .iter()
        .map(|(name, col)| {
            format!(
                "ALTER TABLE {}.{data}{} ADD INDEX IF NOT EXISTS {name} {col} TYPE bloom_filter(0.01) GRANULARITY 4",
                cx.database,
                on_cluster_clause(on),
            )
        })
        .collect()
}

fn v4(d: &Dialect, cx: &MigrationContext<'_>) -> Vec<String> {
    let (data, dist, on) = match (cx.target, cx.cluster) {
        (Target::Single, _) | (_, None) => (TABLE, None, None),
        (Target::ClusterNode, Some(_)) => (LOCAL_TABLE, Some(TABLE), None),
        (Target::OnCluster, Some(c)) => (LOCAL_TABLE, Some(TABLE), Some(c)),
    };
    let replica = format!("replica {}", d.lc(false));
    let mut out = Vec::new();
    for t in std::iter::once(data).chain(dist) {
        out.push(add_column(
            d,
            cx.database,
            t,
            on,
            "cache_creation_tokens Nullable(UInt64)",
            "client_request_id",
        ));
        out.push(add_column(
            d,
            cx.database,
            t,
            on,
            &replica,
            "cache_creation_tokens",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single(ttl: Option<u32>) -> MigrationContext<'static> {
        MigrationContext {
            database: "db",
            cluster: None,
            target: Target::Single,
            ttl_days: ttl,
        }
    }

    #[test]
    fn versions() {
        let d = Dialect::from_version("18.16.1").expect("v");
        assert_eq!(d.version, (18, 16, 1));
        assert!(!d.low_cardinality && !d.datetime64 && !d.ttl && !d.codecs && !d.skip_index);
        let d = Dialect::from_version("23.8.1.94").expect("v");
        assert!(d.is_modern());
        assert!(Dialect::from_version("20.8").expect("v").is_modern());
        assert!(!Dialect::from_version("20.7.9").expect("v").is_modern());
        assert!(Dialect::from_version("x").is_err());
        assert!(Dialect::from_version("").is_err());
    }

    #[test]
    fn plain_ddl_text() {
        let d = Dialect::from_version("18.16.1").expect("v");
        let sql = (MIGRATIONS[0].statements)(&d, &single(Some(30)));
        assert_eq!(sql.len(), 1);
        let s = &sql[0];
        assert!(s.starts_with("CREATE TABLE IF NOT EXISTS db.llm_inference_log (\n    request_id String,\n    trace_id String,\n    created_at_us Int64,\n    created_at DateTime('UTC') DEFAULT toDateTime(intDiv(created_at_us, 1000000), 'UTC'),\n    model String,\n    model_served Nullable(String),"), "{s}");
        assert!(s.ends_with("    row_version UInt64\n)\nENGINE = ReplacingMergeTree(row_version)\nPARTITION BY toYYYYMMDD(created_at)\nORDER BY (toDate(created_at), model, created_at_us, request_id)"), "{s}");
        for absent in ["LowCardinality", "CODEC", "TTL", "DateTime64", "INDEX"] {
            assert!(!s.contains(absent), "{absent} in {s}");
        }
        // Every insert column is declared by v1 or added by v2 (`cost_usd`, placed after
        // `gpu_memory_bandwidth`), v3 (`client_request_id`, after `cost_usd`) or v4
        // (`cache_creation_tokens`, `replica`, after `client_request_id`), in order.
        let mut declared: Vec<String> = d
            .columns()
            .iter()
            .filter_map(|c| c.split(' ').next().map(str::to_owned))
            .filter(|c| c != "created_at")
            .collect();
        let at = declared
            .iter()
            .position(|c| c == "gpu_memory_bandwidth")
            .expect("gpu_memory_bandwidth declared");
        declared.insert(at + 1, "cost_usd".to_owned());
        declared.insert(at + 2, "client_request_id".to_owned());
        declared.insert(at + 3, "cache_creation_tokens".to_owned());
        declared.insert(at + 4, "replica".to_owned());
        for (i, (c, _)) in BLAME_COLUMNS.iter().enumerate() {
            declared.insert(at + 5 + i, (*c).to_owned());
        }
        declared.insert(at + 5 + BLAME_COLUMNS.len(), "prompt_sketch".to_owned());
        for (i, (c, _)) in SPLIT_COLUMNS.iter().enumerate() {
            declared.insert(at + 6 + BLAME_COLUMNS.len() + i, (*c).to_owned());
        }
        assert_eq!(declared, INSERT_COLUMNS.map(str::to_owned).to_vec());
        assert_eq!(
            (MIGRATIONS[1].statements)(&d, &single(None)),
            ["ALTER TABLE db.llm_inference_log ADD COLUMN cost_usd Nullable(Float64) AFTER gpu_memory_bandwidth"]
        );
        let modern = Dialect::from_version("23.8.1").expect("v");
        assert_eq!(
            (MIGRATIONS[1].statements)(&modern, &single(None)),
            ["ALTER TABLE db.llm_inference_log ADD COLUMN IF NOT EXISTS cost_usd Nullable(Float64) AFTER gpu_memory_bandwidth"]
        );
        assert_eq!(
            (MIGRATIONS[2].statements)(&d, &single(None)),
            ["ALTER TABLE db.llm_inference_log ADD COLUMN client_request_id Nullable(String) AFTER cost_usd"]
        );
        assert_eq!(
            (MIGRATIONS[2].statements)(&modern, &single(None)),
            [
                "ALTER TABLE db.llm_inference_log ADD COLUMN IF NOT EXISTS client_request_id Nullable(String) AFTER cost_usd",
                "ALTER TABLE db.llm_inference_log ADD INDEX IF NOT EXISTS idx_client_request_id client_request_id TYPE bloom_filter(0.01) GRANULARITY 4",
            ]
        );
        assert_eq!(
            (MIGRATIONS[3].statements)(&d, &single(None)),
            [
                "ALTER TABLE db.llm_inference_log ADD COLUMN cache_creation_tokens Nullable(UInt64) AFTER client_request_id",
                "ALTER TABLE db.llm_inference_log ADD COLUMN replica String AFTER cache_creation_tokens",
            ]
        );
        assert_eq!(
            (MIGRATIONS[3].statements)(&modern, &single(None)),
            [
                "ALTER TABLE db.llm_inference_log ADD COLUMN IF NOT EXISTS cache_creation_tokens Nullable(UInt64) AFTER client_request_id",
                "ALTER TABLE db.llm_inference_log ADD COLUMN IF NOT EXISTS replica LowCardinality(String) AFTER cache_creation_tokens",
            ]
        );
        let node = MigrationContext {
            database: "db",
            cluster: Some("c2"),
            target: Target::OnCluster,
            ttl_days: None,
        };
        assert_eq!(
            (MIGRATIONS[3].statements)(&d, &node),
            [
                "ALTER TABLE db.llm_inference_log_local ON CLUSTER c2 ADD COLUMN cache_creation_tokens Nullable(UInt64) AFTER client_request_id",
                "ALTER TABLE db.llm_inference_log_local ON CLUSTER c2 ADD COLUMN replica String AFTER cache_creation_tokens",
                "ALTER TABLE db.llm_inference_log ON CLUSTER c2 ADD COLUMN cache_creation_tokens Nullable(UInt64) AFTER client_request_id",
                "ALTER TABLE db.llm_inference_log ON CLUSTER c2 ADD COLUMN replica String AFTER cache_creation_tokens",
            ]
        );
        assert_eq!(
            (MIGRATIONS[2].statements)(&d, &node),
            [
                "ALTER TABLE db.llm_inference_log_local ON CLUSTER c2 ADD COLUMN client_request_id Nullable(String) AFTER cost_usd",
                "ALTER TABLE db.llm_inference_log ON CLUSTER c2 ADD COLUMN client_request_id Nullable(String) AFTER cost_usd",
            ]
        );
    }

    #[test]
    fn modern_ddl_text() {
        let d = Dialect::from_version("23.8.1").expect("v");
        let s = &(MIGRATIONS[0].statements)(&d, &single(Some(30)))[0];
        for present in [
            "    created_at_us Int64 CODEC(Delta, ZSTD(1)),\n",
            "    created_at DateTime64(6, 'UTC') DEFAULT fromUnixTimestamp64Micro(created_at_us, 'UTC') CODEC(Delta, ZSTD(1)),\n",
            "    model LowCardinality(String),\n",
            "    model_served LowCardinality(Nullable(String)),\n",
            "    user_id Nullable(String),\n",
            "    outcome LowCardinality(String),\n",
            "    prompt_text Nullable(String) CODEC(ZSTD(3)),\n",
            "    row_version UInt64,\n    INDEX idx_trace_id trace_id TYPE bloom_filter(0.01) GRANULARITY 4\n)",
            "ORDER BY (toDate(created_at), model, created_at_us, request_id)\nTTL toStartOfDay(toDateTime(created_at)) + INTERVAL 31 DAY",
        ] {
            assert!(s.contains(present), "{present:?} missing in {s}");
        }
        let no_ttl = &(MIGRATIONS[0].statements)(&d, &single(None))[0];
        assert!(!no_ttl.contains("TTL"));
    }

    #[test]
    fn cluster_ddl_text() {
        let d = Dialect::from_version("18.16.1").expect("v");
        let node = MigrationContext {
            database: "db",
            cluster: Some("c2"),
            target: Target::ClusterNode,
            ttl_days: None,
        };
        let sql = (MIGRATIONS[0].statements)(&d, &node);
        assert!(sql[0].starts_with("CREATE TABLE IF NOT EXISTS db.llm_inference_log_local (\n"));
        assert_eq!(sql[1], "CREATE TABLE IF NOT EXISTS db.llm_inference_log AS db.llm_inference_log_local ENGINE = Distributed(c2, db, llm_inference_log_local, sipHash64(request_id))");
        let on = MigrationContext {
            target: Target::OnCluster,
            ..node
        };
        let sql = (MIGRATIONS[0].statements)(&d, &on);
        assert!(sql[0].starts_with(
            "CREATE TABLE IF NOT EXISTS db.llm_inference_log_local ON CLUSTER c2 (\n"
        ));
        assert_eq!(sql[1], "CREATE TABLE IF NOT EXISTS db.llm_inference_log ON CLUSTER c2 AS db.llm_inference_log_local ENGINE = Distributed(c2, db, llm_inference_log_local, sipHash64(request_id))");
        assert_eq!(
            create_database("db", Some("c2")),
            "CREATE DATABASE IF NOT EXISTS db ON CLUSTER c2"
        );
    }

    #[test]
    fn insert_columns_follow_the_sqlite_table() {
        let mapped: Vec<&str> = tokenscope_store::sqlite::COLUMNS
            .iter()
            .map(|c| {
                if *c == "created_at" {
                    "created_at_us"
                } else {
                    c
                }
            })
            .chain(["row_version"])
            .collect();
        assert_eq!(mapped, INSERT_COLUMNS.to_vec());
    }
}
