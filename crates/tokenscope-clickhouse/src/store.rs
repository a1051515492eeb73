//! [`ClickHouseStore`]: a synchronous handle on one ClickHouse server (or cluster entry node).
//!
//! Invariants:
//! * **Sync API, own runtime.** The `clickhouse` client is async (hyper); the store owns a
//!   one-worker tokio runtime and every call *spawns* its future there and waits on a std
//!   channel. It never calls `Runtime::block_on`, so it may be called from a plain thread (the
//!   pipeline's writer) or from inside another tokio runtime (the CLI's `main`) without the
//!   "cannot start a runtime from within a runtime" panic. (Called from an async task it blocks
//!   that worker thread for the duration of the request, like any blocking I/O.) The runtime is
//!   shut down in the background when the last clone of the store is dropped, which is also
//!   allowed inside an async context.
//! * **Bounded waits.** Every request is bounded by `request_timeout` (a streamed read: each
//!   chunk), `connect` by `connect_timeout`; a timeout is an
//!   [`Unavailable`](tokenscope_store::ErrorClass::Unavailable)-class error.
//! * **Idempotent writes.** Rows are keyed by `request_id` in a `ReplacingMergeTree(row_version)`
//!   (see [`crate::schema`]): re-sending a batch never doubles a row *as read by tokenscope*,
//!   because every read here uses `FINAL`.
//! * **Streaming reads.** [`ClickHouseStore::for_each_tsv_line`] hands the caller one line at a
//!   time from a bounded channel (at most a few HTTP chunks in memory), never the whole result.
//! * **No password in logs or errors** (see [`crate::config`]).

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clickhouse::{Client, Compression};
use tokenscope_core::RequestRecord;

use crate::error::{error_code, ErrCtx};
use crate::report::ch_string;
use crate::row::{encode_row, LogRow};
use crate::schema::{
    create_database, create_migrations_table, Dialect, MigrationContext, Target, INSERT_COLUMNS,
    MIGRATIONS, MIGRATIONS_TABLE, SCHEMA_VERSION,
};
use crate::{ClickHouseConfig, ClickHouseError};

/// How many trace ids one lookup query carries.
const TRACE_LOOKUP_CHUNK: usize = 500;

struct Inner {
    cfg: ClickHouseConfig,
    client: Client,
    /// The TLS settings of `secure=true` (also for the shards' clients).
    tls: tokenscope_net::ClientTls,
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    ctx: ErrCtx,
    version: String,
    dialect: Dialect,
    insert_sql: String,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            // Never blocks, allowed inside an async context.
            rt.shutdown_background();
        }
    }
}

/// A connection to the ClickHouse store (cheap to clone: clones share one runtime and
/// connection pool). See the module docs.
#[derive(Clone)]
pub struct ClickHouseStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ClickHouseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClickHouseStore")
            .field("config", &self.inner.cfg)
            .field("server_version", &self.inner.version)
            .finish()
    }
}

/// TCP keepalive of the client's connections (as the `clickhouse` crate's default client).
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// Idle connections are dropped after this (the server's `keep_alive_timeout` is 3 s by
/// default; as the `clickhouse` crate's default client).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// A client of the server at `addr` (`host:port`): `http://`, or `https://` with `tls` when
/// `secure=true` (tokenscope-net's connector: rustls, the configured CA and client
/// certificate).
fn make_client(cfg: &ClickHouseConfig, addr: &str, tls: &tokenscope_net::ClientTls) -> Client {
    let connector = tokenscope_net::connector(
        tls,
        tokenscope_net::ConnectOptions {
            keepalive: Some(TCP_KEEPALIVE),
            ..tokenscope_net::ConnectOptions::default()
        },
    );
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .build(connector);
    let mut c = Client::with_http_client(http)
        .with_url(cfg.url_of(addr))
        .with_user(cfg.user.clone())
        .with_validation(false)
        .with_compression(if cfg.compression {
            Compression::Lz4
        } else {
            Compression::None
        });
    if !cfg.password.is_empty() {
        c = c.with_password(cfg.password.clone());
    }
    c
}

/// `YYYYMMDD` (UTC) of a Unix time in µs — the partition id of a row created then.
pub fn utc_day(epoch_us: i64) -> u32 {
    tokenscope_core::time::yyyymmdd(epoch_us)
}

pub(crate) fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `f` on the current thread, parking between polls. Only for futures that need no
/// runtime of their own (channel receives): the I/O runs on the store's runtime.
fn park_on<F: Future>(f: F) -> F::Output {
    let waker = Arc::new(ThreadWaker(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

impl ClickHouseStore {
    /// Connects: checks that the server answers (`SELECT version()`, within
    /// `connect_timeout`) and picks the SQL dialect from its version. Creates nothing; call
    /// [`migrate`](Self::migrate) to create or update the schema.
    pub fn connect(cfg: ClickHouseConfig) -> Result<Self, ClickHouseError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tokenscope-clickhouse")
            .enable_all()
            .build()
            .map_err(|e| ClickHouseError::Unavailable {
                addr: cfg.http_addr(),
                message: format!("cannot start the client runtime: {e}"),
            })?;
        let handle = rt.handle().clone();
        let ctx = ErrCtx {
            addr: cfg.http_addr(),
            user: cfg.user.clone(),
            password: cfg.password.clone(),
        };
        let tls = cfg.tls()?;
        let client = make_client(&cfg, &cfg.http_addr(), &tls);
        let insert_sql = format!(
            "INSERT INTO {} ({}) FORMAT RowBinary",
            cfg.table(),
            INSERT_COLUMNS.join(", ")
        );
        let mut inner = Inner {
            cfg,
            client,
            tls,
            rt: Some(rt),
            handle,
            ctx,
            version: String::new(),
            dialect: Dialect::from_version("0.0")?,
            insert_sql,
        };
        let version = {
            let (c, ctx) = (inner.client.clone(), inner.ctx.clone());
            run_on(
                &inner.handle,
                &inner.ctx,
                inner.cfg.connect_timeout,
                move || server_version(c.clone(), ctx.clone()),
            )?
        };
        inner.dialect = Dialect::from_version(&version)?;
        inner.version = version;
        tracing::info!(
            store = %inner.cfg,
            server_version = %inner.version,
            modern = inner.dialect.is_modern(),
            "connected to ClickHouse"
        );
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Shorthand for `connect(ClickHouseConfig::from_url(url)?)`.
    pub fn connect_url(url: &str) -> Result<Self, ClickHouseError> {
        Self::connect(ClickHouseConfig::from_url(url)?)
    }

    /// The configuration this store was connected with.
    pub fn config(&self) -> &ClickHouseConfig {
        &self.inner.cfg
    }

    /// The server's `version()` (e.g. `18.16.1`, `23.8.1.94`).
    pub fn server_version(&self) -> &str {
        &self.inner.version
    }

    /// The SQL dialect chosen for the server.
    pub fn dialect(&self) -> Dialect {
        self.inner.dialect
    }

    fn run<T, F, M>(&self, timeout: Duration, make: M) -> Result<T, ClickHouseError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, ClickHouseError>> + Send + 'static,
        M: Fn() -> F + Send + Sync + 'static,
    {
        run_on(&self.inner.handle, &self.inner.ctx, timeout, make)
    }

    /// Every row of `sql` (sent verbatim, RowBinary) from `client`.
    fn fetch_all_on<T>(&self, client: &Client, sql: String) -> Result<Vec<T>, ClickHouseError>
    where
        T: clickhouse::RowOwned + clickhouse::RowRead + Send + 'static,
    {
        let (c, ctx) = (client.clone(), self.inner.ctx.clone());
        self.run(self.timeout(), move || {
            let (c, ctx, sql) = (c.clone(), ctx.clone(), sql.clone());
            async move {
                c.query_raw(&sql)
                    .fetch_all::<T>()
                    .await
                    .map_err(|e| ctx.map(e))
            }
        })
    }

    /// The single value of `sql` (e.g. `SELECT count() …`) on the entry node.
    fn fetch_one<T>(&self, sql: String) -> Result<T, ClickHouseError>
    where
        T: clickhouse::RowOwned + clickhouse::RowRead + Send + 'static,
    {
        self.fetch_all_on::<T>(&self.inner.client, sql.clone())?
            .into_iter()
            .next()
            .ok_or_else(|| ClickHouseError::Server {
                code: None,
                message: format!("no row returned by {sql}"),
            })
    }

    fn timeout(&self) -> Duration {
        self.inner.cfg.request_timeout
    }

    /// Runs one statement that returns nothing (DDL, `ALTER`, `INSERT … VALUES`).
    pub fn execute(&self, sql: &str) -> Result<(), ClickHouseError> {
        execute_on(self, &self.inner.client, sql)
    }

    /// Creates or updates the schema (see [`crate::schema`]): the database, the migrations
    /// table, then every migration statement (all idempotent; a concurrent gateway's "already
    /// exists" counts as success), then records the versions not yet recorded. In a cluster with
    /// `shards=` this runs on every shard; with only `cluster=`, with `ON CLUSTER`. Returns the
    /// schema version. Refuses a database migrated by a newer build
    /// ([`ClickHouseError::SchemaTooNew`]).
    pub fn migrate(&self) -> Result<u32, ClickHouseError> {
        let cfg = &self.inner.cfg;
        let nodes: Vec<(Client, Target, String)> = match (&cfg.cluster, cfg.shards.is_empty()) {
            (None, _) => vec![(self.inner.client.clone(), Target::Single, cfg.http_addr())],
            (Some(_), true) => vec![(
                self.inner.client.clone(),
                Target::OnCluster,
                cfg.http_addr(),
            )],
            (Some(_), false) => cfg
                .shards
                .iter()
                .map(|a| {
                    (
                        make_client(cfg, a, &self.inner.tls),
                        Target::ClusterNode,
                        a.clone(),
                    )
                })
                .collect(),
        };
        for (client, target, addr) in nodes {
            self.migrate_node(&client, target, &addr)?;
        }
        Ok(SCHEMA_VERSION)
    }

    fn migrate_node(
        &self,
        client: &Client,
        target: Target,
        addr: &str,
    ) -> Result<(), ClickHouseError> {
        let cfg = &self.inner.cfg;
        let db = cfg.database.as_str();
        let (dialect, version) = if addr == cfg.http_addr() {
            (self.inner.dialect, self.inner.version.clone())
        } else {
            let ctx = ErrCtx {
                addr: addr.to_owned(),
                ..self.inner.ctx.clone()
            };
            let c = client.clone();
            let ctx2 = ctx.clone();
            let v = run_on(&self.inner.handle, &ctx, self.timeout(), move || {
                server_version(c.clone(), ctx2.clone())
            })?;
            (Dialect::from_version(&v)?, v)
        };
        let on_cluster = match target {
            Target::OnCluster => cfg.cluster.as_deref(),
            _ => None,
        };
        execute_on(self, client, &create_database(db, on_cluster))?;
        execute_on(self, client, &create_migrations_table(db))?;
        let found: u32 = self
            .fetch_all_on::<u32>(
                client,
                format!("SELECT toUInt32(max(version)) FROM {db}.{MIGRATIONS_TABLE}"),
            )?
            .into_iter()
            .next()
            .unwrap_or(0);
        if found > SCHEMA_VERSION {
            return Err(ClickHouseError::SchemaTooNew {
                database: db.to_owned(),
                found,
                supported: SCHEMA_VERSION,
            });
        }
        let mcx = MigrationContext {
            database: db,
            cluster: cfg.cluster.as_deref(),
            target,
            ttl_days: cfg.ttl_days,
        };
        for m in MIGRATIONS {
            for stmt in (m.statements)(&dialect, &mcx) {
                execute_on(self, client, &stmt)?;
            }
            if m.version > found {
                execute_on(
                    self,
                    client,
                    &format!(
                        "INSERT INTO {db}.{MIGRATIONS_TABLE} (version, applied_at, server_version) SELECT {}, now(), {}",
                        m.version,
                        ch_string(&version)
                    ),
                )?;
                tracing::info!(
                    node = addr,
                    version = m.version,
                    description = m.description,
                    "ClickHouse: applied schema migration"
                );
            }
        }
        Ok(())
    }

    /// The highest schema version recorded on the entry node (0 when none).
    pub fn schema_version(&self) -> Result<u32, ClickHouseError> {
        let sql = format!(
            "SELECT toUInt32(max(version)) FROM {}.{MIGRATIONS_TABLE}",
            self.inner.cfg.database
        );
        self.fetch_one::<u32>(sql)
    }

    /// Inserts `rows` (row version 1) in one RowBinary `INSERT`. Idempotent per
    /// `request_id` as read with `FINAL`.
    pub fn insert(&self, rows: &[RequestRecord]) -> Result<(), ClickHouseError> {
        self.insert_versioned(rows.iter().map(|r| (r, 1)))
    }

    /// Inserts rows with explicit row versions (a higher version replaces a lower one).
    pub fn insert_versioned<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a RequestRecord, u64)>,
    ) -> Result<(), ClickHouseError> {
        let mut buf = Vec::new();
        let mut n = 0usize;
        for (r, v) in rows {
            if n == 0 {
                buf.reserve(512);
            }
            encode_row(&mut buf, r, v);
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        let data = Bytes::from(buf);
        let client = self.inner.client.clone();
        let ctx = self.inner.ctx.clone();
        let sql = self.inner.insert_sql.clone();
        let clustered = self.inner.cfg.cluster.is_some();
        self.run(self.timeout(), move || {
            let (client, ctx, sql, data) = (client.clone(), ctx.clone(), sql.clone(), data.clone());
            async move {
                let mut ins = client.insert_formatted_with(sql);
                if clustered {
                    // Wait until every shard has its rows (no local queue on the entry node).
                    ins = ins.with_setting("insert_distributed_sync", "1");
                }
                ins.send(data).await.map_err(|e| ctx.map(e))?;
                ins.end().await.map_err(|e| ctx.map(e))
            }
        })
    }

    /// Runs `sql` and returns its whole result as `TabSeparated` text (tests, tools; use
    /// [`for_each_tsv_line`](Self::for_each_tsv_line) for big results). The statement is sent
    /// verbatim.
    pub fn query_text(&self, sql: &str) -> Result<String, ClickHouseError> {
        let mut out = String::new();
        self.for_each_tsv_line(sql, |line| {
            out.push_str(&String::from_utf8_lossy(line));
            out.push('\n');
            Ok(())
        })?;
        Ok(out)
    }

    /// Runs `sql` (sent verbatim; `TabSeparated` unless it names another `FORMAT`) and calls `f`
    /// with each line of the result, without its `\n`, as the response streams in — the
    /// result is never held in memory as a whole. An error from `f` stops the query and is
    /// returned.
    pub fn for_each_tsv_line(
        &self,
        sql: &str,
        mut f: impl FnMut(&[u8]) -> Result<(), ClickHouseError>,
    ) -> Result<(), ClickHouseError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, ClickHouseError>>(4);
        let client = self.inner.client.clone();
        let ctx = self.inner.ctx.clone();
        let sql = sql.to_owned();
        let timeout = self.timeout();
        self.inner.handle.spawn(async move {
            let mut cursor = match client.query_raw(&sql).fetch_bytes("TabSeparated") {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(ctx.map(e))).await;
                    return;
                }
            };
            loop {
                let item = match tokio::time::timeout(timeout, cursor.next()).await {
                    Err(_) => Err(ClickHouseError::Timeout {
                        addr: ctx.addr.clone(),
                        timeout,
                    }),
                    Ok(Err(e)) => Err(ctx.map(e)),
                    Ok(Ok(None)) => return,
                    Ok(Ok(Some(chunk))) => Ok(chunk),
                };
                let stop = item.is_err();
                if tx.send(item).await.is_err() || stop {
                    return;
                }
            }
        });
        let mut carry: Vec<u8> = Vec::new();
        while let Some(item) = park_on(rx.recv()) {
            let chunk = item?;
            let mut rest: &[u8] = &chunk;
            while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
                if carry.is_empty() {
                    f(&rest[..nl])?;
                } else {
                    carry.extend_from_slice(&rest[..nl]);
                    let line = std::mem::take(&mut carry);
                    f(&line)?;
                }
                rest = &rest[nl + 1..];
            }
            carry.extend_from_slice(rest);
        }
        if !carry.is_empty() {
            f(&carry)?;
        }
        Ok(())
    }

    /// Claims the alert incident `fingerprint` for `replica` (schema v6): inserts the claim
    /// stamped `now_us`, waits `settle` for the other replicas' claims of the same incident
    /// to land, then answers whether this replica holds the earliest claim of the last
    /// `hold_us` (ties broken by replica name). Exactly one of several replicas that claim
    /// within the hold gets `true`; a replica whose claim arrives after the winner's settle
    /// sees the winner's earlier claim and gets `false`.
    pub fn claim(
        &self,
        fingerprint: &str,
        replica: &str,
        now_us: i64,
        settle: std::time::Duration,
        hold_us: i64,
    ) -> Result<bool, ClickHouseError> {
        let table = format!(
            "{}.{}",
            self.inner.cfg.database,
            crate::schema::CLAIMS_TABLE
        );
        self.execute(&format!(
            "INSERT INTO {table} (fingerprint, replica, claimed_at_us) VALUES ({}, {}, {now_us})",
            ch_string(fingerprint),
            ch_string(replica)
        ))?;
        std::thread::sleep(settle);
        let winner = self.query_text(&format!(
            "SELECT replica FROM {table} WHERE fingerprint = {} AND claimed_at_us >= {} \
             ORDER BY claimed_at_us, replica LIMIT 1",
            ch_string(fingerprint),
            now_us.saturating_sub(hold_us)
        ))?;
        Ok(winner.trim_end_matches('\n') == replica)
    }

    /// Rows in `llm_inference_log` after deduplication (`FINAL`).
    pub fn count(&self) -> Result<u64, ClickHouseError> {
        self.fetch_one::<u64>(format!(
            "SELECT count() FROM {} FINAL",
            self.inner.cfg.table()
        ))
    }

    /// The newest version of the record stored under `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Result<Option<RequestRecord>, ClickHouseError> {
        Ok(self.get_versioned(request_id)?.map(|(r, _)| r))
    }

    /// Like [`get`](Self::get), with the row's `row_version`.
    pub fn get_versioned(
        &self,
        request_id: &str,
    ) -> Result<Option<(RequestRecord, u64)>, ClickHouseError> {
        let sql = format!(
            "SELECT {} FROM {} FINAL WHERE request_id = {} ORDER BY row_version DESC LIMIT 1",
            INSERT_COLUMNS.join(", "),
            self.inner.cfg.table(),
            ch_string(request_id)
        );
        let rows = self.fetch_rows(sql)?;
        rows.into_iter().next().map(LogRow::into_record).transpose()
    }

    /// Every record (newest version, `FINAL`) created in `[since_us, until_us)` (epoch µs),
    /// ordered by `created_at` then `request_id` — the input of the analysis commands, the
    /// same rows in the same order as [`SqliteStore::records_between`]
    /// (tokenscope_store::SqliteStore) returns for the same records.
    pub fn records_between(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> Result<Vec<RequestRecord>, ClickHouseError> {
        let sql = format!(
            "SELECT {} FROM {} FINAL WHERE toYYYYMMDD(created_at) >= {} AND toYYYYMMDD(created_at) <= {} AND created_at_us >= {since_us} AND created_at_us < {until_us} ORDER BY created_at_us, request_id",
            INSERT_COLUMNS.join(", "),
            self.inner.cfg.table(),
            utc_day(since_us),
            utc_day(until_us),
        );
        self.fetch_rows(sql)?
            .into_iter()
            .map(|row| row.into_record().map(|(r, _version)| r))
            .collect()
    }

    /// The `limit` records (newest version, `FINAL`) of `[since_us, until_us)` passing
    /// `filters` with the longest end to end, slowest first, ties by `request_id` — the same
    /// records in the same order as `SqliteStore::slowest`.
    pub fn slowest(
        &self,
        since_us: i64,
        until_us: i64,
        filters: &[(tokenscope_core::query::Dimension, String)],
        limit: usize,
    ) -> Result<Vec<RequestRecord>, tokenscope_store::StoreError> {
        let filters = crate::report::where_range_filters(since_us, Some(until_us), filters)?;
        let sql = format!(
            "SELECT {} FROM {} FINAL{filters} AND toYYYYMMDD(created_at) >= {} AND toYYYYMMDD(created_at) <= {} ORDER BY total_duration_ms DESC, request_id LIMIT {limit}",
            INSERT_COLUMNS.join(", "),
            self.inner.cfg.table(),
            utc_day(since_us),
            utc_day(until_us),
        );
        let rows = self.fetch_rows(sql)?;
        Ok(rows
            .into_iter()
            .map(|row| row.into_record().map(|(r, _version)| r))
            .collect::<Result<Vec<_>, _>>()?)
    }

    /// Every row (newest version, `FINAL`) whose `trace_id` is one of `trace_ids` and which was
    /// created at or after `since_us` (epoch µs; bounds the scan to recent daily partitions).
    pub fn rows_by_trace(
        &self,
        trace_ids: &[&str],
        since_us: i64,
    ) -> Result<Vec<(RequestRecord, u64)>, ClickHouseError> {
        let mut out = Vec::new();
        for chunk in trace_ids.chunks(TRACE_LOOKUP_CHUNK) {
            let list: Vec<String> = chunk.iter().map(|t| ch_string(t)).collect();
            let sql = format!(
                "SELECT {} FROM {} FINAL WHERE toYYYYMMDD(created_at) >= {} AND created_at_us >= {since_us} AND trace_id IN ({})",
                INSERT_COLUMNS.join(", "),
                self.inner.cfg.table(),
                utc_day(since_us),
                list.join(", ")
            );
            for row in self.fetch_rows(sql)? {
                out.push(row.into_record()?);
            }
        }
        Ok(out)
    }

    fn fetch_rows(&self, sql: String) -> Result<Vec<LogRow>, ClickHouseError> {
        self.fetch_all_on::<LogRow>(&self.inner.client, sql)
    }

    /// Retention for servers without `TTL` (and a no-op safety net on those with it): drops
    /// the daily partitions (`toYYYYMMDD(created_at)`) of the data table that lie entirely
    /// before `today (UTC) − ttl_days`, on every node. Returns how many partitions were dropped
    /// (0 without `ttl_days`). Whole days only: a partition is dropped the day after its last
    /// row became older than the limit.
    pub fn retention_sweep(&self) -> Result<usize, ClickHouseError> {
        self.retention_sweep_at(now_us())
    }

    /// [`retention_sweep`](Self::retention_sweep) as if the time were `now_us`.
    pub fn retention_sweep_at(&self, now_us: i64) -> Result<usize, ClickHouseError> {
        let cfg = &self.inner.cfg;
        let Some(days) = cfg.ttl_days else {
            return Ok(0);
        };
        let cutoff = utc_day(now_us - i64::from(days) * 86_400_000_000);
        let table = cfg.data_table_name();
        let db = &cfg.database;
        let nodes: Vec<Client> = if cfg.shards.is_empty() {
            vec![self.inner.client.clone()]
        } else {
            cfg.shards
                .iter()
                .map(|a| make_client(cfg, a, &self.inner.tls))
                .collect()
        };
        let on_cluster = match (&cfg.cluster, cfg.shards.is_empty()) {
            (Some(c), true) => format!(" ON CLUSTER {c}"),
            _ => String::new(),
        };
        let mut dropped = 0;
        for client in nodes {
            let sql = format!(
                "SELECT DISTINCT partition FROM system.parts WHERE database = {} AND table = {} AND active",
                ch_string(db),
                ch_string(table)
            );
            let parts: Vec<String> = self.fetch_all_on::<String>(&client, sql)?;
            for p in parts {
                let Ok(day) = p.trim_matches('\'').parse::<u32>() else {
                    continue;
                };
                if day < cutoff {
                    execute_on(
                        self,
                        &client,
                        &format!("ALTER TABLE {db}.{table}{on_cluster} DROP PARTITION {day}"),
                    )?;
                    tracing::info!(partition = day, "ClickHouse retention: dropped partition");
                    dropped += 1;
                }
            }
        }
        Ok(dropped)
    }
}

async fn server_version(client: Client, ctx: ErrCtx) -> Result<String, ClickHouseError> {
    client
        .query_raw("SELECT version()")
        .fetch_one::<String>()
        .await
        .map_err(|e| ctx.map(e))
}

/// Spawns `make()` on the store's runtime and waits for it (bounded by `timeout`). A transport
/// failure ([`ClickHouseError::Unreachable`]: typically a pooled keep-alive connection the
/// server closed, e.g. after a restart) is retried once at once — every operation of this
/// crate is idempotent.
fn run_on<T, F, M>(
    handle: &tokio::runtime::Handle,
    ctx: &ErrCtx,
    timeout: Duration,
    make: M,
) -> Result<T, ClickHouseError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, ClickHouseError>> + Send + 'static,
    M: Fn() -> F + Send + Sync + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let addr = ctx.addr.clone();
    handle.spawn(async move {
        let attempt = async {
            match make().await {
                Err(e @ ClickHouseError::Unreachable { .. }) => {
                    tracing::debug!(error = %e, "ClickHouse: retrying once on a fresh connection");
                    make().await
                }
                r => r,
            }
        };
        let r = match tokio::time::timeout(timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(ClickHouseError::Timeout { addr, timeout }),
        };
        let _ = tx.send(r);
    });
    rx.recv().map_err(|_| ClickHouseError::RuntimeStopped)?
}

fn execute_on(store: &ClickHouseStore, client: &Client, sql: &str) -> Result<(), ClickHouseError> {
    let c = client.clone();
    let ctx = store.inner.ctx.clone();
    let sql = sql.to_owned();
    let r = store.run(store.timeout(), move || {
        let (c, ctx, sql) = (c.clone(), ctx.clone(), sql.clone());
        async move { c.query_raw(&sql).execute().await.map_err(|e| ctx.map(e)) }
    });
    match r {
        // A concurrent gateway created it first: TABLE_ALREADY_EXISTS (57),
        // DATABASE_ALREADY_EXISTS (82); a column added already on an old server without
        // `ADD COLUMN IF NOT EXISTS`: DUPLICATE_COLUMN (15), ILLEGAL_COLUMN (44).
        Err(ClickHouseError::Server {
            code: Some(15 | 44 | 57 | 82),
            ..
        }) => Ok(()),
        Err(ClickHouseError::Server { message, .. })
            if matches!(error_code(&message), Some(15 | 44 | 57 | 82)) =>
        {
            Ok(())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_days() {
        assert_eq!(utc_day(0), 19_700_101);
        assert_eq!(utc_day(1_704_672_000_000_000), 20_240_108);
        assert_eq!(utc_day(1_704_672_000_000_000 - 1), 20_240_107);
        assert_eq!(utc_day(951_782_400_000_000), 20_000_229); // leap day 2000-02-29
        assert_eq!(utc_day(-1), 19_691_231);
    }
}
