//! Grouped reports with exact percentiles.
//!
//! [`run_report`] selects the rows whose `created_at` lies in `[since_us, until_us)` (index
//! range scan, only the columns the report needs), optionally filtered by dimension values,
//! groups them by the requested [`Dimension`]s and, when [`ReportQuery::interval`] is set, by
//! time bucket, and computes per group: request count, `ok` count, success rate, QPS, exact
//! TTFT / TPOT / end-to-end quantiles, exact engine-phase (queue / prefill / decode)
//! quantiles, the queue share of TTFT and token sums.
//!
//! ## Percentile definition
//!
//! Percentiles are **exact nearest-rank** percentiles over every value in the group — never
//! averaged across groups, never interpolated from a histogram: for `n` values sorted
//! ascending `x₁ ≤ … ≤ xₙ`, `P(q) = x_k` with `k = ⌈q·n⌉` (and `k ≥ 1`). So P50 of
//! `[1, 2, 3, 4]` is `2`, P99 of 100 values is the 99th smallest, and every reported
//! percentile is a value that was actually measured. `q·n` is computed in integer arithmetic
//! (q in millionths), so there is no floating-point off-by-one at exact ranks.
//!
//! Missing values are excluded from that metric only: a non-streamed request has no TTFT and
//! no TPOT, so it counts in `count` and in `e2e`, but not in `ttft.n` or `tpot.n`. A group
//! whose metric has no value at all reports `None` (`null` in JSON, empty in CSV, `-` in the
//! table).
//!
//! ## Semantics of the other columns
//!
//! * `count` — requests in the group; `ok` — those with `outcome = 'ok'`;
//!   `success_rate = ok / (count − client errors − cancellations)`, the one definition of
//!   `tokenscope_core::success` (`null` when no request counts).
//! * `qps = count / window seconds`. The window is the query range `[since, until)` (`until`
//!   defaults to now). With an interval, it is the bucket `[start, start + interval)`
//!   clipped to the query range, so a partial first or last bucket is not under-reported.
//! * Time buckets are aligned to the Unix epoch (UTC): with a 1-day interval a bucket is one
//!   UTC calendar day. `bucket_start_us` is the bucket's start in epoch µs.
//! * Token columns are sums of the known values (`NULL` counts as 0).
//! * `queue`, `prefill`, `decode` are the engine phases (`queue_duration_ms`,
//!   `prefill_duration_ms`, `decode_duration_ms`), whatever their source (engine-reported or
//!   derived by the gateway; late engine updates included once applied); rows without the
//!   phase are left out of that phase only, like TTFT.
//! * `queue_share_of_ttft = Σ queue_ms / Σ ttft_ms` over the group's rows that have **both**
//!   a queue time and a TTFT; `None` when there is no such row (or the TTFT sum is 0). It is
//!   a ratio of sums, not a mean of per-request ratios: the fraction of all
//!   waiting-for-the-first-token time that was spent queued in the engine, so slow requests
//!   weigh more. Not clamped: engine queue time is measured on the engine's clock and TTFT
//!   on the gateway's, so in principle it can exceed 1.
//! * `kv_band` groups by the engine's KV-cache usage at the request's arrival
//!   (`engine_kv_usage`, 0–1) into half-open bands `0-50%` (< 0.5, negatives included),
//!   `50-80%` ([0.5, 0.8)), `80-95%` ([0.8, 0.95)), `95-100%` (≥ 0.95, values above 1
//!   included) and `(none)` when unknown; see [`kv_band`]. A `kv_band` filter selects the
//!   same half-open range.
//! * A `NULL` dimension value (e.g. no `user_id`) forms its own group, shown as `(none)`; a
//!   filter value of `(none)` selects it. `stream` groups are `true` / `false`.
//! * Rows are ordered by bucket, then by group values: text ascending (byte order),
//!   input buckets shortest first, `false` before `true`, `(none)` last.
//!
//! ## Output formats ([`render`])
//!
//! JSON is an array of flat objects, CSV has one header row with the same names; the field
//! names are stable: `bucket_start_us`, `bucket_start` (RFC 3339, only with an interval), one
//! field per group dimension named as the dimension (`model`, `input_bucket`, `user`, …),
//! `count`, `ok`, `success_rate`, `qps`, then for each of `ttft`, `tpot`, `e2e`:
//! `<m>_n`, `<m>_p50_ms`, `<m>_p90_ms`, `<m>_p95_ms`, `<m>_p99_ms`, `<m>_mean_ms`, then
//! `input_tokens`, `output_tokens`, `cached_tokens`, then (appended in schema v2, so the
//! earlier columns keep their positions) the same six fields for each of `queue`,
//! `prefill`, `decode` (`queue_n`, `queue_p50_ms`, …, `decode_mean_ms`), then
//! `queue_share_of_ttft` (a fraction, 0–1), then (appended in schema v10) the six fields of
//! `unaccounted` — the part of TTFT the engine did not account for (`ttft_unaccounted_ms`,
//! `RequestRecord::split_times`: TTFT = gateway + unaccounted + the engine's reported queue +
//! prefill; rows without a split are left out). The table (comfy-table) shows a human-sized
//! subset: P50/P95/P99 of TTFT, TPOT and end-to-end, and — only when some row has a phase
//! value — P50/P99 of queue, prefill and decode, the queue share of TTFT in percent and P50/P99
//! of the time not seen by the engine (`unaccounted`).
//!
//! ## Other stores
//!
//! The aggregation is store-independent: [`Scanner`] takes the report SELECT's rows as
//! [`ScanValue`]s. The embedded store feeds it from SQLite; an external store
//! (`tokenscope_clickhouse`) runs the same columns, range and filters in its own dialect
//! (built from [`validate`], [`filter_value`] and [`Dimension::column`]), decodes each row per
//! [`ColKind`] and feeds the same scanner, so both stores give identical reports for the same
//! records. The vocabulary ([`Dimension`], [`Format`], the nearest-rank definition) is
//! `tokenscope_core::query`'s, re-exported here.
//!
//! ## Performance
//!
//! One pass over the selected rows; group keys are small integer vectors (dimension values
//! are interned per distinct value, so no `String` is allocated per row), values go into
//! per-group `Vec<f64>`s and quantiles are taken with `select_nth_unstable_by` (linear time).
//!
//! ## Memory
//!
//! The scans run lean (no memory map, a small page cache) and hold at most
//! [`VALUE_BUDGET`] rows' values (`TOKENSCOPE_REPORT_VALUE_BUDGET` overrides it). Past it the
//! scan drops the values it held and keeps, per group and metric, only the count and the
//! exact sum; the percentiles then come from one sorted pass per metric ([`sorted_quantiles`]:
//! `ORDER BY group, value` through SQLite's external sorter, which spills to temporary files),
//! picking each group's nearest ranks as the rows stream by. Same definition, same bits (a
//! test compares budgets 0, 100 and unlimited on 1–4 threads), and the process holds
//! per-group state only: memory does not grow with the window's rows
//! (`tests/read_memory.rs` in the CLI).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use comfy_table::{presets, Cell, CellAlignment, ContentArrangement, Table};
use rusqlite::types::ValueRef;
use rusqlite::Connection;
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use tokenscope_core::query::nearest_rank_index;
pub use tokenscope_core::query::{Dimension, Format, NONE_LABEL};
use tokenscope_core::success::{class_of_sql, SuccessClass, SQL_CLASS};
use tokenscope_core::{InputBucket, Outcome};

use crate::sqlite::{parse_endpoint, parse_input_bucket, TABLE};
use crate::{SqliteStore, StoreError};

/// The `kv_band` labels, lowest first.
pub const KV_BANDS: [&str; 4] = ["0-50%", "50-80%", "80-95%", "95-100%"];

/// Lower bounds (inclusive) of [`KV_BANDS`] 1…3; band 0 has no lower bound, band 3 no upper.
const KV_BAND_LOWER: [f64; 3] = [0.5, 0.8, 0.95];

/// Index into [`KV_BANDS`] of a KV-cache usage (0–1); `None` for NaN. Bands are half-open:
/// `< 0.5`, `[0.5, 0.8)`, `[0.8, 0.95)`, `≥ 0.95`.
pub fn kv_band_index(usage: f64) -> Option<usize> {
    if usage.is_nan() {
        return None;
    }
    Some(KV_BAND_LOWER.iter().take_while(|lo| usage >= **lo).count())
}

/// The `kv_band` label of a KV-cache usage: one of [`KV_BANDS`], or [`NONE_LABEL`] when
/// unknown (`None` or NaN).
pub fn kv_band(usage: Option<f64>) -> &'static str {
    usage
        .and_then(kv_band_index)
        .map_or(NONE_LABEL, |i| KV_BANDS[i])
}

/// A bad dimension or format name is an invalid report query.
impl From<tokenscope_core::query::InvalidQuery> for StoreError {
    fn from(e: tokenscope_core::query::InvalidQuery) -> Self {
        StoreError::InvalidQuery(e.0)
    }
}

/// What to report on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReportQuery {
    /// Start of the range, inclusive, epoch µs.
    pub since_us: i64,
    /// End of the range, exclusive, epoch µs; `None` = up to now.
    pub until_us: Option<i64>,
    /// Grouping dimensions, in output order (may be empty: one row per bucket).
    pub group_by: Vec<Dimension>,
    /// Time-bucket length (epoch-aligned); `None` = the whole range is one bucket.
    pub interval: Option<Duration>,
    /// Equality filters, ANDed. The value [`NONE_LABEL`] selects `NULL`.
    pub filters: Vec<(Dimension, String)>,
}

/// Exact quantiles of one metric over one group, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Quantiles {
    /// Number of values (rows where the metric is known).
    pub n: u64,
    /// Nearest-rank P50.
    pub p50: Option<f64>,
    /// Nearest-rank P90.
    pub p90: Option<f64>,
    /// Nearest-rank P95.
    pub p95: Option<f64>,
    /// Nearest-rank P99.
    pub p99: Option<f64>,
    /// Arithmetic mean (summed in fixed point, so it does not depend on row order).
    pub mean: Option<f64>,
}

impl Quantiles {
    /// Computes the quantiles of `values` (reordered in place; NaNs must not be present).
    pub fn from_values(values: &mut [f64]) -> Self {
        let n = values.len();
        if n == 0 {
            return Self::default();
        }
        let ks = [
            nearest_rank_index(n, 0.50) - 1,
            nearest_rank_index(n, 0.90) - 1,
            nearest_rank_index(n, 0.95) - 1,
            nearest_rank_index(n, 0.99) - 1,
        ];
        let mut out = [0.0; 4];
        let mut lo = 0;
        for (slot, &k) in out.iter_mut().zip(&ks) {
            if k >= lo {
                let (_, v, _) = values[lo..].select_nth_unstable_by(k - lo, f64::total_cmp);
                *slot = *v;
                lo = k + 1;
            } else {
                // Same rank as the previous quantile: already in place.
                *slot = values[k];
            }
        }
        let mut sum = ExactSum::default();
        for v in values.iter() {
            sum.add(*v);
        }
        Self {
            n: n as u64,
            p50: Some(out[0]),
            p90: Some(out[1]),
            p95: Some(out[2]),
            p99: Some(out[3]),
            mean: Some(sum.value() / n as f64),
        }
    }
}

/// An order-independent sum: values are added in fixed point (2⁻³² units, i.e. ~2·10⁻¹⁰ ms),
/// so a mean or ratio does not depend on the order rows arrive in — the same records give the
/// same bits on every store and with any number of scan threads. Exact for |x| < 2⁶³ units
/// per value and far more sums than a report can hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ExactSum(i128);

impl ExactSum {
    const SCALE: f64 = 4_294_967_296.0; // 2^32

    #[inline]
    fn add(&mut self, x: f64) {
        if x.is_finite() {
            self.0 = self.0.saturating_add(Self::units(x) as i128);
        }
    }

    /// [`exact_sum_units`]: `⌊x·2³² + ½⌋`.
    #[inline]
    fn units(x: f64) -> f64 {
        exact_sum_units(x)
    }

    fn merge(&mut self, other: ExactSum) {
        self.0 = self.0.saturating_add(other.0);
    }

    fn value(self) -> f64 {
        self.0 as f64 / Self::SCALE
    }
}

/// One output row: one group in one time bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportRow {
    /// Start of the time bucket (epoch µs), when the query has an interval.
    pub bucket_start_us: Option<i64>,
    /// The group's value for each `group_by` dimension, in query order.
    pub group: Vec<(Dimension, String)>,
    /// Requests.
    pub count: u64,
    /// Requests with outcome `ok`.
    pub ok: u64,
    /// `ok / counted` (`tokenscope_core::success`; NaN — `null` in JSON, empty in CSV, `-` in
    /// the table — when no request counts).
    pub success_rate: f64,
    /// `count` per second of the row's window.
    pub qps: f64,
    /// Time to first token.
    pub ttft: Quantiles,
    /// Time per output token.
    pub tpot: Quantiles,
    /// End-to-end duration (`total_duration_ms`).
    pub e2e: Quantiles,
    /// Engine queue time (`queue_duration_ms`).
    pub queue: Quantiles,
    /// Engine prefill time (`prefill_duration_ms`).
    pub prefill: Quantiles,
    /// Engine decode time (`decode_duration_ms`).
    pub decode: Quantiles,
    /// The part of TTFT the engine did not account for (`ttft_unaccounted_ms`).
    pub unaccounted: Quantiles,
    /// `Σ queue_ms / Σ ttft_ms` over the rows having both (see the module docs); `None`
    /// without such rows.
    pub queue_share_of_ttft: Option<f64>,
    /// Sum of `input_tokens`.
    pub input_tokens: u64,
    /// Sum of `output_tokens`.
    pub output_tokens: u64,
    /// Sum of `cached_tokens`.
    pub cached_tokens: u64,
}

// ---------------------------------------------------------------------------------------------
// Query execution
// ---------------------------------------------------------------------------------------------

/// Runs `q` against a store (see the module docs for the semantics). For a file-backed
/// store the `created_at` range is split into one slice per available core (at most 4), each
/// scanned on its own read-only connection in parallel; results are identical to a
/// single-threaded run because partial groups are merged before any quantile is taken.
pub fn run_report(store: &SqliteStore, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(4);
    run_report_threads(store, q, threads)
}

/// [`run_report`] with an explicit number of scanning threads (1 = single-threaded).
pub fn run_report_threads(
    store: &SqliteStore,
    q: &ReportQuery,
    threads: usize,
) -> Result<Vec<ReportRow>, StoreError> {
    run_report_budget(store, q, threads, value_budget())
}

/// [`VALUE_BUDGET`], or `TOKENSCOPE_REPORT_VALUE_BUDGET` when set to a number (rows; 0 makes
/// every report take its percentiles from sorted passes).
pub fn value_budget() -> usize {
    std::env::var("TOKENSCOPE_REPORT_VALUE_BUDGET")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(VALUE_BUDGET)
}

/// [`run_report_threads`] with an explicit [`VALUE_BUDGET`] (rows whose values are held
/// before the report takes its percentiles from sorted passes instead; 0 = always sorted).
/// The scans run lean (no memory map, a small page cache): with the budget, the report's
/// memory does not grow with the window's row count.
pub fn run_report_budget(
    store: &SqliteStore,
    q: &ReportQuery,
    threads: usize,
    budget: usize,
) -> Result<Vec<ReportRow>, StoreError> {
    validate(q)?;
    let now = now_us();
    let in_memory = store.path() == Path::new(":memory:");
    let conn = store.conn();
    crate::sqlite::lean(conn, || {
        if threads <= 1 || in_memory {
            let part = scan(conn, q, q.since_us, q.until_us, budget)?;
            return finish(q, vec![part], now, Some(conn));
        }
        let slices = match split_range(conn, q, threads)? {
            Some(s) => s,
            None => return Ok(Vec::new()), // no rows in range
        };
        let share = budget / slices.len();
        let path = store.path();
        let parts = std::thread::scope(|scope| {
            let workers: Vec<_> = slices[1..]
                .iter()
                .map(|&(lo, hi)| {
                    scope.spawn(move || -> Result<Partial, StoreError> {
                        let worker = SqliteStore::open_read_only(path)?;
                        crate::sqlite::lean(worker.conn(), || scan(worker.conn(), q, lo, hi, share))
                    })
                })
                .collect();
            let mut parts = Vec::with_capacity(slices.len());
            let (lo, hi) = slices[0];
            parts.push(scan(conn, q, lo, hi, share));
            for w in workers {
                parts.push(w.join().unwrap_or(Err(StoreError::InvalidQuery(
                    "report worker thread panicked".to_owned(),
                ))));
            }
            parts
        });
        let parts = parts.into_iter().collect::<Result<Vec<_>, _>>()?;
        finish(q, parts, now, Some(conn))
    })
}

/// [`run_report`] on a raw connection holding the tokenscope schema (single-threaded).
pub fn run_report_on(conn: &Connection, q: &ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
    run_report_at(conn, q, now_us())
}

/// [`run_report_on`] with an explicit "now" (used when `until_us` is `None`).
pub fn run_report_at(
    conn: &Connection,
    q: &ReportQuery,
    now_us: i64,
) -> Result<Vec<ReportRow>, StoreError> {
    validate(q)?;
    let part = scan(conn, q, q.since_us, q.until_us, value_budget())?;
    finish(q, vec![part], now_us, Some(conn))
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// A `[lo, hi)` slice of `created_at` (`hi = None`: unbounded).
type Slice = (i64, Option<i64>);

/// Splits the query range into up to `n` contiguous `[lo, hi)` slices of equal time span
/// between the first and last matching `created_at` (two index lookups). `None` when the range
/// holds no rows. The first slice starts at `since_us`, the last ends at `until_us`.
fn split_range(
    conn: &Connection,
    q: &ReportQuery,
    n: usize,
) -> Result<Option<Vec<Slice>>, StoreError> {
    let bounded = |agg: &str| -> Result<Option<i64>, StoreError> {
        let sql = match q.until_us {
            Some(_) => format!(
                "SELECT {agg}(created_at) FROM {TABLE} WHERE created_at >= ?1 AND created_at < ?2"
            ),
            None => format!("SELECT {agg}(created_at) FROM {TABLE} WHERE created_at >= ?1"),
        };
        let mut stmt = conn.prepare_cached(&sql)?;
        let v = match q.until_us {
            Some(u) => stmt.query_row([q.since_us, u], |r| r.get(0))?,
            None => stmt.query_row([q.since_us], |r| r.get(0))?,
        };
        Ok(v)
    };
    let (Some(first), Some(last)) = (bounded("MIN")?, bounded("MAX")?) else {
        return Ok(None);
    };
    let span = i128::from(last) - i128::from(first) + 1;
    let n = (n as i128).clamp(1, span.max(1));
    let mut cuts: Vec<i64> = (1..n)
        .map(|k| (i128::from(first) + span * k / n) as i64)
        .collect();
    cuts.dedup();
    let mut slices = Vec::with_capacity(cuts.len() + 1);
    let mut lo = q.since_us;
    for c in cuts {
        if c > lo {
            slices.push((lo, Some(c)));
            lo = c;
        }
    }
    slices.push((lo, q.until_us));
    Ok(Some(slices))
}

/// A small, fast, non-cryptographic hasher (FxHash) for the per-row group lookups.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// Interns one dimension's values: id ≥ 0 per distinct text, -1 for NULL.
#[derive(Default)]
struct Interner {
    ids: FxMap<Vec<u8>, i64>,
    names: Vec<String>,
}

impl Interner {
    #[inline]
    fn id_of(&mut self, dim: Dimension, v: ScanValue<'_>) -> i64 {
        if matches!(dim, Dimension::KvUsageBand | Dimension::GpuBand) {
            // Ids are band indexes; anything not a number counts as unknown.
            return real(v).and_then(kv_band_index).map_or(-1, |b| b as i64);
        }
        match v {
            ScanValue::Null => -1,
            ScanValue::Int(i) if dim == Dimension::Stream => i64::from(i != 0),
            ScanValue::Text(b) => self.text_id(b),
            ScanValue::Int(i) => self.text_id(i.to_string().as_bytes()),
            ScanValue::Real(f) => self.text_id(f.to_string().as_bytes()),
        }
    }

    #[inline]
    fn text_id(&mut self, b: &[u8]) -> i64 {
        if let Some(&id) = self.ids.get(b) {
            return id;
        }
        let id = self.names.len() as i64;
        self.names.push(String::from_utf8_lossy(b).into_owned());
        self.ids.insert(b.to_vec(), id);
        id
    }

    /// The value's text; `None` for NULL.
    fn label(&self, dim: Dimension, id: i64) -> Option<String> {
        if id < 0 {
            return None;
        }
        if dim == Dimension::Stream {
            return Some(if id == 1 { "true" } else { "false" }.to_owned());
        }
        if matches!(dim, Dimension::KvUsageBand | Dimension::GpuBand) {
            return usize::try_from(id)
                .ok()
                .and_then(|i| KV_BANDS.get(i))
                .map(|b| (*b).to_owned());
        }
        Some(
            usize::try_from(id)
                .ok()
                .and_then(|i| self.names.get(i))
                .cloned()
                .unwrap_or_default(),
        )
    }
}

/// The per-row metrics kept for quantiles, in [`Acc::values`] order.
const METRICS: usize = 7;
const M_TTFT: usize = 0;
const M_TPOT: usize = 1;
const M_E2E: usize = 2;
const M_QUEUE: usize = 3;
const M_PREFILL: usize = 4;
const M_DECODE: usize = 5;
const M_UNACCOUNTED: usize = 6;

#[derive(Default)]
struct Acc {
    count: u64,
    ok: u64,
    /// Rows in the success rate's denominator (`tokenscope_core::success`).
    counted: u64,
    /// One entry per row: TTFT, TPOT, e2e, queue, prefill, decode; NaN = unknown. One
    /// contiguous push per row (rather than one per metric into six vectors) keeps the scan
    /// to one cache line per row when rows hit many groups in turn.
    values: Vec<[f64; METRICS]>,
    /// Once the scan spilled (see [`VALUE_BUDGET`]): per metric, values seen and their exact
    /// sum, of the rows whose values are no longer held (`values` is then empty).
    metric_n: [u64; METRICS],
    metric_sum: [ExactSum; METRICS],
    /// Σ queue and Σ TTFT over the `share_n` rows having both.
    share_queue_ms: ExactSum,
    share_ttft_ms: ExactSum,
    share_n: u64,
    input_tokens: u64,
    output_tokens: u64,
    cached_tokens: u64,
}

#[inline]
fn real(v: ScanValue<'_>) -> Option<f64> {
    match v {
        ScanValue::Real(f) if !f.is_nan() => Some(f),
        ScanValue::Int(i) => Some(i as f64),
        _ => None,
    }
}

#[inline]
fn tokens(v: ScanValue<'_>) -> u64 {
    match v {
        ScanValue::Int(i) => u64::try_from(i).unwrap_or(0),
        _ => 0,
    }
}

/// Checks a query before it runs: `until` after `since`, an interval of at least 1 µs, no
/// dimension grouped twice. Every store's report path calls it.
pub fn validate(q: &ReportQuery) -> Result<(), StoreError> {
    if let Some(until) = q.until_us {
        if until <= q.since_us {
            return Err(StoreError::InvalidQuery(format!(
                "until ({until}) must be after since ({})",
                q.since_us
            )));
        }
    }
    if let Some(iv) = q.interval {
        if iv.as_micros() == 0 {
            return Err(StoreError::InvalidQuery(
                "interval must be at least 1 µs".to_owned(),
            ));
        }
    }
    for (i, d) in q.group_by.iter().enumerate() {
        if q.group_by[..i].contains(d) {
            return Err(StoreError::InvalidQuery(format!(
                "dimension {d} is grouped twice"
            )));
        }
    }
    Ok(())
}

/// A filter's value, normalised for SQL (the same for every store's dialect).
#[derive(Debug, Clone, PartialEq)]
pub enum FilterValue {
    /// `column IS NULL` (the filter value [`NONE_LABEL`]).
    Null,
    /// `column = 'text'`.
    Text(String),
    /// `column = n` (`stream`).
    Int(i64),
    /// `lo <= column < hi`, either bound optional (and never NULL).
    Range(Option<f64>, Option<f64>),
}

/// The SQL value of the filter `dim = raw`: `(none)` selects `NULL`; `stream`, `status`,
/// `input_bucket`, `endpoint` and the bands are checked and normalised; any other text is
/// compared as is.
pub fn filter_value(dim: Dimension, raw: &str) -> Result<FilterValue, StoreError> {
    if raw == NONE_LABEL {
        return Ok(FilterValue::Null);
    }
    let bad = |expected: &str| {
        StoreError::InvalidQuery(format!("filter {dim}={raw:?}: expected {expected}"))
    };
    match dim {
        Dimension::Stream => match raw.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Ok(FilterValue::Int(1)),
            "false" | "0" | "no" => Ok(FilterValue::Int(0)),
            _ => Err(bad("true or false")),
        },
        Dimension::Status => Outcome::parse(raw)
            .map(|o| FilterValue::Text(o.as_str().to_owned()))
            .ok_or_else(|| bad("ok, client_error, upstream_error, timeout or cancelled")),
        Dimension::InputBucket => parse_input_bucket(raw)
            .map(|b| FilterValue::Text(b.as_str().to_owned()))
            .ok_or_else(|| bad("0-128, 128-512, 512-2048 or 2048+")),
        Dimension::Endpoint => parse_endpoint(raw)
            .map(|e| FilterValue::Text(e.as_str().to_owned()))
            .ok_or_else(|| bad("chat_completions, completions, embeddings, responses or messages")),
        Dimension::KvUsageBand | Dimension::GpuBand => {
            let i = KV_BANDS
                .iter()
                .position(|b| *b == raw)
                .ok_or_else(|| bad("0-50%, 50-80%, 80-95% or 95-100%"))?;
            let lo = i.checked_sub(1).map(|j| KV_BAND_LOWER[j]);
            let hi = KV_BAND_LOWER.get(i).copied();
            Ok(FilterValue::Range(lo, hi))
        }
        _ => Ok(FilterValue::Text(raw.to_owned())),
    }
}

/// The report's SELECT: only the needed columns, the `created_at` range `[lo, hi)` (served by the
/// covering `idx_log_created_at`), and the filters. Column order: 0 the success class
/// ([`SQL_CLASS`]: an integer, cheaper per row than reading the text), 1 ttft,
/// 2 tpot, 3 total, 4 input, 5 output, 6 cached, 7 queue, 8 prefill, 9 decode,
/// 10 ttft_unaccounted, [11 created_at, only with an interval], then the group dimensions from
/// the returned offset
/// on.
fn report_sql(
    q: &ReportQuery,
    lo: i64,
    hi: Option<i64>,
) -> Result<(String, Vec<rusqlite::types::Value>, usize), StoreError> {
    let mut sql = format!(
        "SELECT {SQL_CLASS}, ttft_ms, tpot_ms, total_duration_ms, input_tokens, output_tokens, \
         cached_tokens, queue_duration_ms, prefill_duration_ms, decode_duration_ms, \
         ttft_unaccounted_ms",
    );
    let mut fixed = 11;
    if q.interval.is_some() {
        sql.push_str(", created_at");
        fixed += 1;
    }
    for d in &q.group_by {
        sql.push_str(", ");
        sql.push_str(d.column());
    }
    sql.push_str(&format!(" FROM {TABLE} WHERE created_at >= ?"));
    let mut params: Vec<rusqlite::types::Value> = vec![lo.into()];
    if let Some(until) = hi {
        sql.push_str(" AND created_at < ?");
        params.push(until.into());
    }
    push_filters(&q.filters, &mut sql, &mut params)?;
    Ok((sql, params, fixed))
}

/// Appends ` AND …` for each filter ([`filter_value`]'s semantics) to a SQLite `WHERE`, with
/// its parameters.
pub(crate) fn push_filters(
    filters: &[(Dimension, String)],
    sql: &mut String,
    params: &mut Vec<rusqlite::types::Value>,
) -> Result<(), StoreError> {
    for (d, raw) in filters {
        match filter_value(*d, raw)? {
            FilterValue::Null => sql.push_str(&format!(" AND {} IS NULL", d.column())),
            FilterValue::Text(s) => {
                sql.push_str(&format!(" AND {} = ?", d.column()));
                params.push(s.into());
            }
            FilterValue::Int(i) => {
                sql.push_str(&format!(" AND {} = ?", d.column()));
                params.push(i.into());
            }
            FilterValue::Range(lo, hi) => {
                sql.push_str(&format!(" AND {} IS NOT NULL", d.column()));
                if let Some(lo) = lo {
                    sql.push_str(&format!(" AND {} >= ?", d.column()));
                    params.push(lo.into());
                }
                if let Some(hi) = hi {
                    sql.push_str(&format!(" AND {} < ?", d.column()));
                    params.push(hi.into());
                }
            }
        }
    }
    Ok(())
}

/// One scan's accumulators: group keys are interned ids, local to this scan.
struct Partial {
    interners: Vec<Interner>,
    accs: Vec<(Vec<i64>, Acc)>,
    /// Rows whose values may still be held before the scan spills.
    values_left: usize,
    /// Whether values were dropped: quantiles then come from the store's sorted passes.
    spilled: bool,
}

/// Rows whose six values a report holds in memory (48 bytes each: 24 MB) before it drops
/// them and takes its percentiles from sorted passes in SQLite instead ([`sorted_quantiles`]),
/// so the report's memory is bounded whatever the window's row count.
pub const VALUE_BUDGET: usize = 500_000;

impl Acc {
    /// Folds the held values into the per-metric counts and sums and drops them.
    fn spill(&mut self) {
        for v in self.values.drain(..) {
            for (m, x) in v.iter().enumerate() {
                if !x.is_nan() {
                    self.metric_n[m] += 1;
                    self.metric_sum[m].add(*x);
                }
            }
        }
        self.values = Vec::new();
    }
}

impl Partial {
    fn spill(&mut self) {
        for (_, acc) in &mut self.accs {
            acc.spill();
        }
        self.spilled = true;
        self.values_left = 0;
    }
}

/// Scans `[lo, hi)` (plus the query's filters) of a SQLite store and accumulates per group.
fn scan(
    conn: &Connection,
    q: &ReportQuery,
    lo: i64,
    hi: Option<i64>,
    budget: usize,
) -> Result<Partial, StoreError> {
    let (sql, params, _) = report_sql(q, lo, hi)?;
    let mut stmt = conn.prepare_cached(&sql)?;
    let ncols = stmt.column_count();
    let mut rows = stmt.query(rusqlite::params_from_iter(params))?;
    let mut scanner = Scanner::new(q)?;
    scanner.partial.values_left = budget;
    // At most 12 fixed columns + every dimension once.
    const MAX_COLS: usize = 11 + Dimension::ALL.len();
    let ncols = ncols.min(MAX_COLS);
    while let Some(row) = rows.next()? {
        let mut vals = [ScanValue::Null; MAX_COLS];
        for (i, slot) in vals.iter_mut().enumerate().take(ncols) {
            *slot = match row.get_ref(i)? {
                ValueRef::Null => ScanValue::Null,
                ValueRef::Integer(i) => ScanValue::Int(i),
                ValueRef::Real(f) => ScanValue::Real(f),
                ValueRef::Text(b) | ValueRef::Blob(b) => ScanValue::Text(b),
            };
        }
        scanner.push(&vals[..ncols]);
    }
    Ok(scanner.partial)
}

/// One value of a report row fed to a [`Scanner`] (any store's native value, mapped).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScanValue<'a> {
    /// SQL `NULL`.
    Null,
    /// An integer (tokens, the success class 0/1/2, `stream` as 0/1, `created_at` µs).
    Int(i64),
    /// A float (durations in ms, KV usage, GPU utilisation).
    Real(f64),
    /// Text (dimension values), raw bytes (UTF-8 expected; invalid bytes are shown lossily).
    Text(&'a [u8]),
}

/// How a column of a [`ReportSelect`] must be decoded into a [`ScanValue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColKind {
    /// Integer ([`ScanValue::Int`]).
    Int,
    /// Float ([`ScanValue::Real`]).
    Real,
    /// Text ([`ScanValue::Text`]), never parsed as a number.
    Text,
}

/// Accumulates report rows from any store. Build it from the query, [`push`](Scanner::push)
/// each row of the report SELECT (columns: the success class 0/1/2, ttft, tpot, total,
/// input, output, cached, queue, prefill, decode, ttft_unaccounted, [`created_at` µs only with
/// an interval],
/// then one column per `group_by` dimension — the columns of every store's report SELECT), then
/// [`finish`](Scanner::finish). Rows must already satisfy the query's range and filters.
pub struct Scanner {
    interval_us: Option<i64>,
    fixed: usize,
    dims: Vec<Dimension>,
    index: FxMap<Vec<i64>, usize>,
    key: Vec<i64>,
    partial: Partial,
    q: ReportQuery,
}

impl Scanner {
    /// A scanner for `q` (validated).
    pub fn new(q: &ReportQuery) -> Result<Self, StoreError> {
        validate(q)?;
        let ndims = q.group_by.len();
        Ok(Self {
            interval_us: interval_us(q),
            fixed: if q.interval.is_some() { 12 } else { 11 },
            dims: q.group_by.clone(),
            index: FxMap::default(),
            key: Vec::with_capacity(ndims + 1),
            partial: Partial {
                interners: (0..ndims).map(|_| Interner::default()).collect(),
                accs: Vec::new(),
                values_left: usize::MAX,
                spilled: false,
            },
            q: q.clone(),
        })
    }

    /// Adds one row. A row with fewer columns than expected is ignored (never panics).
    #[inline]
    pub fn push(&mut self, row: &[ScanValue<'_>]) {
        if row.len() < self.fixed + self.dims.len() {
            return;
        }
        self.key.clear();
        let bucket = match self.interval_us {
            Some(iv) => {
                let at = match row[11] {
                    ScanValue::Int(at) => at,
                    _ => 0,
                };
                at - at.rem_euclid(iv)
            }
            None => 0,
        };
        self.key.push(bucket);
        for (i, d) in self.dims.iter().enumerate() {
            let v = row[self.fixed + i];
            let id = self.partial.interners[i].id_of(*d, v);
            self.key.push(id);
        }
        let slot = match self.index.get(self.key.as_slice()) {
            Some(&s) => s,
            None => {
                let s = self.partial.accs.len();
                self.partial.accs.push((self.key.clone(), Acc::default()));
                self.index.insert(self.key.clone(), s);
                s
            }
        };
        let acc = &mut self.partial.accs[slot].1;
        acc.count += 1;
        if let ScanValue::Int(v) = row[0] {
            match class_of_sql(v) {
                Some(SuccessClass::Success) => {
                    acc.ok += 1;
                    acc.counted += 1;
                }
                Some(SuccessClass::Failure) => acc.counted += 1,
                Some(SuccessClass::Excluded) | None => {}
            }
        }
        let mut v = [f64::NAN; METRICS];
        let ttft = real(row[1]);
        let queue = real(row[7]);
        for (slot, x) in [
            (M_TTFT, ttft),
            (M_TPOT, real(row[2])),
            (M_E2E, real(row[3])),
            (M_QUEUE, queue),
            (M_PREFILL, real(row[8])),
            (M_DECODE, real(row[9])),
            (M_UNACCOUNTED, real(row[10])),
        ] {
            if let Some(x) = x {
                v[slot] = x;
            }
        }
        if self.partial.values_left > 0 {
            self.partial.values_left -= 1;
            acc.values.push(v);
        } else {
            if !self.partial.spilled {
                self.partial.spill();
            }
            let acc = &mut self.partial.accs[slot].1;
            for (m, x) in v.iter().enumerate() {
                if !x.is_nan() {
                    acc.metric_n[m] += 1;
                    acc.metric_sum[m].add(*x);
                }
            }
        }
        let acc = &mut self.partial.accs[slot].1;
        if let (Some(q), Some(t)) = (queue, ttft) {
            acc.share_queue_ms.add(q);
            acc.share_ttft_ms.add(t);
            acc.share_n += 1;
        }
        acc.input_tokens += tokens(row[4]);
        acc.output_tokens += tokens(row[5]);
        acc.cached_tokens += tokens(row[6]);
    }

    /// The report rows (`now_us` closes an open-ended range).
    pub fn finish(self, now_us: i64) -> Vec<ReportRow> {
        // This scanner holds every value (no budget): it never needs the store again.
        finish(&self.q, vec![self.partial], now_us, None).unwrap_or_default()
    }

    /// [`finish`](Scanner::finish) at the current time.
    pub fn finish_now(self) -> Vec<ReportRow> {
        self.finish(now_us())
    }
}

/// The query's interval in µs (saturating), as the report's time buckets use it; 0 without
/// an interval.
pub fn interval_micros(q: &ReportQuery) -> i64 {
    interval_us(q).unwrap_or(0)
}

fn interval_us(q: &ReportQuery) -> Option<i64> {
    q.interval
        .map(|iv| i64::try_from(iv.as_micros()).unwrap_or(i64::MAX))
}

impl Acc {
    fn merge(&mut self, other: Acc) {
        self.count += other.count;
        self.ok += other.ok;
        self.counted += other.counted;
        self.values.extend(other.values);
        for m in 0..METRICS {
            self.metric_n[m] += other.metric_n[m];
            self.metric_sum[m].merge(other.metric_sum[m]);
        }
        self.share_queue_ms.merge(other.share_queue_ms);
        self.share_ttft_ms.merge(other.share_ttft_ms);
        self.share_n += other.share_n;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_tokens += other.cached_tokens;
    }
}

/// (bucket, labels) → accumulator; labels are `None` for NULL.
type GroupKey = (i64, Vec<Option<String>>);

/// Merges partial scans by group label, computes each group's quantiles, then
/// [`finish_groups`]. When a scan spilled its values, the quantiles come from sorted passes
/// over `conn` (which must then be given) and the means from the exact per-metric sums.
fn finish(
    q: &ReportQuery,
    parts: Vec<Partial>,
    now_us: i64,
    conn: Option<&Connection>,
) -> Result<Vec<ReportRow>, StoreError> {
    let spilled = parts.iter().any(|p| p.spilled);
    let mut merged: HashMap<GroupKey, Acc> = HashMap::new();
    for mut part in parts {
        if spilled && !part.spilled {
            part.spill();
        }
        for (k, acc) in part.accs {
            let labels: Vec<Option<String>> = q
                .group_by
                .iter()
                .enumerate()
                .map(|(i, d)| part.interners[i].label(*d, k[i + 1]))
                .collect();
            match merged.entry((k[0], labels)) {
                std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().merge(acc),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(acc);
                }
            }
        }
    }
    let mut sorted = match (spilled, conn) {
        (false, _) => None,
        (true, Some(conn)) => Some(sorted_quantiles(conn, q, &merged)?),
        (true, None) => {
            return Err(StoreError::InvalidQuery(
                "report spilled its values without a store to sort them".to_owned(),
            ))
        }
    };
    let mut buf: Vec<f64> = Vec::new();
    let groups = merged
        .into_iter()
        .map(|(key, a)| {
            let qs: [Quantiles; METRICS] = match sorted.as_mut() {
                None => std::array::from_fn(|m| quantiles_of(&a.values, m, &mut buf)),
                Some(found) => {
                    let ranks = found.remove(&key).unwrap_or_default();
                    std::array::from_fn(|m| {
                        let n = a.metric_n[m];
                        if n == 0 {
                            return Quantiles::default();
                        }
                        let v = ranks.get(m).copied().unwrap_or([None; 4]);
                        Quantiles {
                            n,
                            p50: v[0],
                            p90: v[1],
                            p95: v[2],
                            p99: v[3],
                            mean: Some(a.metric_sum[m].value() / n as f64),
                        }
                    })
                }
            };
            let (bucket, labels) = key;
            GroupAgg {
                bucket_start_us: bucket,
                labels,
                count: a.count,
                ok: a.ok,
                counted: a.counted,
                ttft: qs[M_TTFT],
                tpot: qs[M_TPOT],
                e2e: qs[M_E2E],
                queue: qs[M_QUEUE],
                prefill: qs[M_PREFILL],
                decode: qs[M_DECODE],
                unaccounted: qs[M_UNACCOUNTED],
                share_n: a.share_n,
                share_queue_units: a.share_queue_ms.0,
                share_ttft_units: a.share_ttft_ms.0,
                input_tokens: a.input_tokens,
                output_tokens: a.output_tokens,
                cached_tokens: a.cached_tokens,
            }
        })
        .collect();
    Ok(finish_groups(q, groups, now_us))
}

/// The metric columns, in the order of the `M_*` indexes.
const METRIC_COLUMNS: [&str; METRICS] = [
    "ttft_ms",
    "tpot_ms",
    "total_duration_ms",
    "queue_duration_ms",
    "prefill_duration_ms",
    "decode_duration_ms",
    "ttft_unaccounted_ms",
];

/// Per group, per metric: the values at the nearest ranks of P50, P90, P95, P99.
type RankValues = HashMap<GroupKey, Vec<[Option<f64>; 4]>>;

/// The exact percentiles of every group by sorted passes, one per metric: `SELECT group
/// columns, value … ORDER BY group, value` streamed through SQLite's sorter (which spills to
/// temporary files, so memory stays bounded), picking the values at each group's nearest
/// ranks (`n` per group and metric from the first pass, `groups`). A group's values must come
/// in ascending order; the ORDER BY groups by the same key the scan does (the bands as their
/// index, `stream` as a boolean, other columns as text), and a value below its predecessor in
/// the same group is an error rather than a wrong percentile.
fn sorted_quantiles(
    conn: &Connection,
    q: &ReportQuery,
    groups: &HashMap<GroupKey, Acc>,
) -> Result<RankValues, StoreError> {
    let (_, params, _) = report_sql(q, q.since_us, q.until_us)?;
    let (base, _, _) = report_sql(q, q.since_us, q.until_us)?;
    // The WHERE clause of the report's SELECT, reused as is.
    let where_at = base.find(" FROM ").unwrap_or(0);
    let from_where = &base[where_at..];
    let iv = interval_us(q);
    let bucket_expr = match iv {
        Some(iv) => format!("(created_at - ((created_at % {iv}) + {iv}) % {iv})"),
        None => "0".to_owned(),
    };
    let order_of = |d: Dimension| -> String {
        let c = d.column();
        match d {
            Dimension::KvUsageBand | Dimension::GpuBand => format!(
                "CASE WHEN typeof({c}) NOT IN ('integer', 'real') THEN -1 WHEN {c} < {} THEN 0 \
                 WHEN {c} < {} THEN 1 WHEN {c} < {} THEN 2 ELSE 3 END",
                KV_BAND_LOWER[0], KV_BAND_LOWER[1], KV_BAND_LOWER[2]
            ),
            Dimension::Stream => format!("({c} <> 0)"),
            _ => format!("CAST({c} AS TEXT)"),
        }
    };
    let mut out: RankValues = HashMap::with_capacity(groups.len());
    for (m, col) in METRIC_COLUMNS.iter().enumerate() {
        let mut sql = format!("SELECT {bucket_expr}, {col}");
        for d in &q.group_by {
            sql.push_str(", ");
            sql.push_str(d.column());
        }
        sql.push_str(from_where);
        sql.push_str(&format!(
            " AND typeof({col}) IN ('integer', 'real') ORDER BY "
        ));
        // (A constant ORDER BY term would be read as a column number.)
        if iv.is_some() {
            sql.push_str(&bucket_expr);
            sql.push_str(", ");
        }
        for d in &q.group_by {
            sql.push_str(&order_of(*d));
            sql.push_str(", ");
        }
        sql.push_str(col);
        let mut stmt = conn.prepare(&sql)?;
        let mut rows = stmt.query(rusqlite::params_from_iter(params.iter()))?;
        let mut interners: Vec<Interner> =
            (0..q.group_by.len()).map(|_| Interner::default()).collect();
        let mut ids: Vec<i64> = Vec::new();
        let mut prev_ids: Option<Vec<i64>> = None;
        // The current group: its key, ranks wanted, position, last value.
        let mut cur: Option<(GroupKey, [usize; 4], usize, f64)> = None;
        let mut seen: std::collections::HashSet<GroupKey> = std::collections::HashSet::new();
        while let Some(row) = rows.next()? {
            let bucket: i64 = row.get(0)?;
            let value = match row.get_ref(1)? {
                ValueRef::Integer(i) => i as f64,
                ValueRef::Real(f) => f,
                _ => continue,
            };
            ids.clear();
            ids.push(bucket);
            for (i, d) in q.group_by.iter().enumerate() {
                let v = match row.get_ref(2 + i)? {
                    ValueRef::Null => ScanValue::Null,
                    ValueRef::Integer(x) => ScanValue::Int(x),
                    ValueRef::Real(f) => ScanValue::Real(f),
                    ValueRef::Text(b) | ValueRef::Blob(b) => ScanValue::Text(b),
                };
                ids.push(interners[i].id_of(*d, v));
            }
            if prev_ids.as_deref() != Some(ids.as_slice()) {
                let labels: Vec<Option<String>> = q
                    .group_by
                    .iter()
                    .enumerate()
                    .map(|(i, d)| interners[i].label(*d, ids[i + 1]))
                    .collect();
                let key: GroupKey = (bucket, labels);
                if !seen.insert(key.clone()) {
                    return Err(StoreError::InvalidQuery(format!(
                        "report: the rows of group {key:?} do not come together in SQLite's \
                         order (mixed value types in a group column)"
                    )));
                }
                let n = groups.get(&key).map_or(0, |a| a.metric_n[m]) as usize;
                let ranks = if n == 0 {
                    [usize::MAX; 4]
                } else {
                    [0.50, 0.90, 0.95, 0.99].map(|p| nearest_rank_index(n, p) - 1)
                };
                cur = Some((key, ranks, 0, f64::NEG_INFINITY));
                prev_ids = Some(ids.clone());
            }
            let Some((key, ranks, pos, last)) = cur.as_mut() else {
                continue;
            };
            if value < *last {
                return Err(StoreError::InvalidQuery(
                    "report: SQLite returned a group's values out of order".to_owned(),
                ));
            }
            *last = value;
            for (j, &k) in ranks.iter().enumerate() {
                if k == *pos {
                    let slot = out
                        .entry(key.clone())
                        .or_insert_with(|| vec![[None; 4]; METRICS]);
                    slot[m][j] = Some(value);
                }
            }
            *pos += 1;
        }
    }
    Ok(out)
}

/// One group of a report, already aggregated — what a store that aggregates in its own
/// engine (ClickHouse) hands back, one per group and time bucket, so that the caller holds
/// per-group state only. [`finish_groups`] turns them into [`ReportRow`]s exactly as the
/// embedded store's scan does.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupAgg {
    /// Start of the time bucket (epoch µs, aligned to the epoch); 0 without an interval.
    pub bucket_start_us: i64,
    /// The group's label per `group_by` dimension, in query order (`None` for NULL): the
    /// column's text, `true`/`false` for `stream`, a [`KV_BANDS`] label for the bands.
    pub labels: Vec<Option<String>>,
    /// Requests.
    pub count: u64,
    /// Requests with outcome `ok`.
    pub ok: u64,
    /// Requests in the success rate's denominator.
    pub counted: u64,
    /// Quantiles of each metric (see [`Quantiles`]: nearest-rank, mean from the exact sum).
    pub ttft: Quantiles,
    /// TPOT.
    pub tpot: Quantiles,
    /// End-to-end.
    pub e2e: Quantiles,
    /// Engine queue.
    pub queue: Quantiles,
    /// Engine prefill.
    pub prefill: Quantiles,
    /// Engine decode.
    pub decode: Quantiles,
    /// The part of TTFT the engine did not account for.
    pub unaccounted: Quantiles,
    /// Rows having both a queue time and a TTFT.
    pub share_n: u64,
    /// Σ over those rows of [`exact_sum_units`] of the queue time.
    pub share_queue_units: i128,
    /// Σ over those rows of [`exact_sum_units`] of the TTFT.
    pub share_ttft_units: i128,
    /// Σ input tokens.
    pub input_tokens: u64,
    /// Σ output tokens.
    pub output_tokens: u64,
    /// Σ cached tokens.
    pub cached_tokens: u64,
}

pub use tokenscope_core::query::exact_sum_units;

/// The mean of `n` values whose [`exact_sum_units`] add up to `units` — the report's mean,
/// bit for bit.
pub fn mean_of_units(units: i128, n: u64) -> Option<f64> {
    (n > 0).then(|| ExactSum(units).value() / n as f64)
}

/// Orders aggregated groups and computes rates (success rate, QPS over the row's window,
/// queue share): the last step of every store's report. Groups must be distinct by
/// (bucket, labels).
pub fn finish_groups(q: &ReportQuery, groups: Vec<GroupAgg>, now_us: i64) -> Vec<ReportRow> {
    let until_eff = q.until_us.unwrap_or(now_us);
    let interval_us = interval_us(q);
    // Order: bucket, then each dimension's natural order.
    let mut keyed: Vec<(Vec<SortPart>, GroupAgg)> = groups
        .into_iter()
        .map(|g| {
            let sk = q
                .group_by
                .iter()
                .zip(&g.labels)
                .map(|(d, l)| sort_part(*d, l.as_deref()))
                .collect();
            (sk, g)
        })
        .collect();
    keyed.sort_by(|a, b| {
        a.1.bucket_start_us
            .cmp(&b.1.bucket_start_us)
            .then_with(|| a.0.cmp(&b.0))
    });

    let range_secs = (until_eff.saturating_sub(q.since_us)) as f64 / 1e6;
    keyed
        .into_iter()
        .map(|(_, a)| {
            let bucket = a.bucket_start_us;
            let window_s = match interval_us {
                Some(iv) => {
                    let start = bucket.max(q.since_us);
                    let end = bucket.saturating_add(iv).min(until_eff);
                    (end.saturating_sub(start)) as f64 / 1e6
                }
                None => range_secs,
            };
            ReportRow {
                bucket_start_us: interval_us.map(|_| bucket),
                group: q
                    .group_by
                    .iter()
                    .zip(a.labels)
                    .map(|(d, l)| (*d, l.unwrap_or_else(|| NONE_LABEL.to_owned())))
                    .collect(),
                count: a.count,
                ok: a.ok,
                success_rate: if a.count == 0 {
                    0.0
                } else if a.counted == 0 {
                    f64::NAN
                } else {
                    a.ok as f64 / a.counted as f64
                },
                qps: if window_s > 0.0 {
                    a.count as f64 / window_s
                } else {
                    0.0
                },
                ttft: a.ttft,
                tpot: a.tpot,
                e2e: a.e2e,
                queue: a.queue,
                prefill: a.prefill,
                decode: a.decode,
                unaccounted: a.unaccounted,
                queue_share_of_ttft: queue_share(
                    a.share_n,
                    ExactSum(a.share_queue_units).value(),
                    ExactSum(a.share_ttft_units).value(),
                ),
                input_tokens: a.input_tokens,
                output_tokens: a.output_tokens,
                cached_tokens: a.cached_tokens,
            }
        })
        .collect()
}

/// Quantiles of metric `m` over the rows that have it (`buf` is scratch space).
fn quantiles_of(values: &[[f64; METRICS]], m: usize, buf: &mut Vec<f64>) -> Quantiles {
    buf.clear();
    buf.extend(values.iter().map(|r| r[m]).filter(|x| !x.is_nan()));
    Quantiles::from_values(buf)
}

/// `Σ queue / Σ ttft` over `n` rows having both; `None` without rows or with a zero (or
/// non-finite) TTFT sum.
fn queue_share(n: u64, queue_ms: f64, ttft_ms: f64) -> Option<f64> {
    (n > 0 && ttft_ms > 0.0 && ttft_ms.is_finite()).then(|| queue_ms / ttft_ms)
}

/// Per-dimension ordering: (NULL last, numeric rank, text).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct SortPart(bool, u32, String);

fn sort_part(dim: Dimension, label: Option<&str>) -> SortPart {
    let Some(label) = label else {
        return SortPart(true, 0, String::new());
    };
    let rank = match dim {
        Dimension::Stream => u32::from(label == "true"),
        Dimension::InputBucket => parse_input_bucket(label)
            .and_then(|b| InputBucket::ALL.iter().position(|x| *x == b))
            .map_or(u32::MAX, |p| p as u32),
        Dimension::KvUsageBand | Dimension::GpuBand => KV_BANDS
            .iter()
            .position(|b| *b == label)
            .map_or(u32::MAX, |p| p as u32),
        _ => 0,
    };
    SortPart(false, rank, label.to_owned())
}

// ---------------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------------

/// Formats epoch µs as RFC 3339 UTC (`2024-01-07T00:00:00Z`; sub-second part only when
/// non-zero).
pub fn format_utc(us: i64) -> String {
    tokenscope_core::time::format_rfc3339(us)
}

/// One field of the flat (JSON / CSV) form of a row.
enum Field {
    Str(String),
    UInt(u64),
    Int(i64),
    Num(Option<f64>),
}

const METRIC_FIELDS: [&str; 6] = ["n", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "mean_ms"];

fn flat_header(q: &ReportQuery) -> Vec<String> {
    let mut h = Vec::new();
    if q.interval.is_some() {
        h.push("bucket_start_us".to_owned());
        h.push("bucket_start".to_owned());
    }
    h.extend(q.group_by.iter().map(|d| d.as_str().to_owned()));
    h.extend(["count", "ok", "success_rate", "qps"].map(str::to_owned));
    for m in ["ttft", "tpot", "e2e"] {
        h.extend(METRIC_FIELDS.iter().map(|f| format!("{m}_{f}")));
    }
    h.extend(["input_tokens", "output_tokens", "cached_tokens"].map(str::to_owned));
    for m in ["queue", "prefill", "decode"] {
        h.extend(METRIC_FIELDS.iter().map(|f| format!("{m}_{f}")));
    }
    h.push("queue_share_of_ttft".to_owned());
    h.extend(METRIC_FIELDS.iter().map(|f| format!("unaccounted_{f}")));
    h
}

fn push_quantiles(f: &mut Vec<(String, Field)>, m: &str, qs: &Quantiles) {
    f.push((format!("{m}_n"), Field::UInt(qs.n)));
    f.push((format!("{m}_p50_ms"), Field::Num(qs.p50)));
    f.push((format!("{m}_p90_ms"), Field::Num(qs.p90)));
    f.push((format!("{m}_p95_ms"), Field::Num(qs.p95)));
    f.push((format!("{m}_p99_ms"), Field::Num(qs.p99)));
    f.push((format!("{m}_mean_ms"), Field::Num(qs.mean)));
}

impl ReportRow {
    /// The row as ordered `(field name, value)` pairs — the JSON / CSV form.
    fn flat(&self) -> Vec<(String, Field)> {
        let mut f = Vec::with_capacity(64);
        if let Some(b) = self.bucket_start_us {
            f.push(("bucket_start_us".to_owned(), Field::Int(b)));
            f.push(("bucket_start".to_owned(), Field::Str(format_utc(b))));
        }
        for (d, v) in &self.group {
            f.push((d.as_str().to_owned(), Field::Str(v.clone())));
        }
        f.push(("count".to_owned(), Field::UInt(self.count)));
        f.push(("ok".to_owned(), Field::UInt(self.ok)));
        f.push((
            "success_rate".to_owned(),
            Field::Num(Some(self.success_rate)),
        ));
        f.push(("qps".to_owned(), Field::Num(Some(self.qps))));
        for (m, qs) in [
            ("ttft", &self.ttft),
            ("tpot", &self.tpot),
            ("e2e", &self.e2e),
        ] {
            push_quantiles(&mut f, m, qs);
        }
        f.push(("input_tokens".to_owned(), Field::UInt(self.input_tokens)));
        f.push(("output_tokens".to_owned(), Field::UInt(self.output_tokens)));
        f.push(("cached_tokens".to_owned(), Field::UInt(self.cached_tokens)));
        for (m, qs) in [
            ("queue", &self.queue),
            ("prefill", &self.prefill),
            ("decode", &self.decode),
        ] {
            push_quantiles(&mut f, m, qs);
        }
        f.push((
            "queue_share_of_ttft".to_owned(),
            Field::Num(self.queue_share_of_ttft),
        ));
        push_quantiles(&mut f, "unaccounted", &self.unaccounted);
        f
    }
}

/// Serialises as the flat object described in the module docs (stable field order).
impl Serialize for ReportRow {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let flat = self.flat();
        let mut map = serializer.serialize_map(Some(flat.len()))?;
        for (k, v) in &flat {
            match v {
                Field::Str(s) => map.serialize_entry(k, s)?,
                Field::UInt(u) => map.serialize_entry(k, u)?,
                Field::Int(i) => map.serialize_entry(k, i)?,
                Field::Num(n) => map.serialize_entry(k, &n.filter(|x| x.is_finite()))?,
            }
        }
        map.end()
    }
}

fn csv_escape(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

/// Renders report rows. `q` supplies the columns (so an empty report still has a header).
pub fn render(rows: &[ReportRow], q: &ReportQuery, format: Format) -> String {
    match format {
        Format::Json => serde_json::to_string_pretty(rows)
            .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string())),
        Format::Csv => {
            let mut out = flat_header(q).join(",");
            out.push('\n');
            for r in rows {
                let cells: Vec<String> = r
                    .flat()
                    .into_iter()
                    .map(|(_, v)| match v {
                        Field::Str(s) => csv_escape(&s),
                        Field::UInt(u) => u.to_string(),
                        Field::Int(i) => i.to_string(),
                        Field::Num(n) => n
                            .filter(|x| x.is_finite())
                            .map_or_else(String::new, |x| x.to_string()),
                    })
                    .collect();
                out.push_str(&cells.join(","));
                out.push('\n');
            }
            out
        }
        Format::Table => {
            let mut table = Table::new();
            table
                .load_style(presets::UTF8_FULL_CONDENSED)
                // The analyses' house style (tokenscope_analysis::render::table): fits the
                // terminal; off a terminal no width is known and no row wraps.
                .set_content_arrangement(ContentArrangement::Dynamic);
            let mut header: Vec<String> = Vec::new();
            if q.interval.is_some() {
                header.push("bucket (UTC)".to_owned());
            }
            header.extend(q.group_by.iter().map(|d| d.as_str().to_owned()));
            let numeric_from = header.len();
            header.extend(
                [
                    "count",
                    "ok (%)",
                    "qps (req/s)",
                    "ttft p50 (ms)",
                    "ttft p95 (ms)",
                    "ttft p99 (ms)",
                    "tpot p50 (ms)",
                    "tpot p95 (ms)",
                    "tpot p99 (ms)",
                    "e2e p50 (ms)",
                    "e2e p95 (ms)",
                    "e2e p99 (ms)",
                ]
                .map(str::to_owned),
            );
            // Phase columns only when there is something to show (many deployments have no
            // engine phases at all).
            let phases = rows
                .iter()
                .any(|r| r.queue.n + r.prefill.n + r.decode.n > 0);
            if phases {
                header.extend(
                    [
                        "queue p50 (ms)",
                        "queue p99 (ms)",
                        "prefill p50 (ms)",
                        "prefill p99 (ms)",
                        "decode p50 (ms)",
                        "decode p99 (ms)",
                        "queue % ttft",
                        "not seen by engine p50 (ms)",
                        "not seen by engine p99 (ms)",
                    ]
                    .map(str::to_owned),
                );
            }
            header.extend(["in (tokens)", "out (tokens)"].map(str::to_owned));
            table.set_header(header.iter().map(Cell::new));
            for r in rows {
                let mut cells: Vec<String> = Vec::with_capacity(header.len());
                if let Some(b) = r.bucket_start_us {
                    cells.push(format_utc(b));
                } else if q.interval.is_some() {
                    cells.push(String::new());
                }
                cells.extend(r.group.iter().map(|(_, v)| v.clone()));
                cells.push(r.count.to_string());
                cells.push(if r.success_rate.is_finite() {
                    format!("{:.2}", r.success_rate * 100.0)
                } else {
                    "-".to_owned()
                });
                cells.push(format!("{:.3}", r.qps));
                for qs in [&r.ttft, &r.tpot, &r.e2e] {
                    cells.push(fmt_ms(qs.p50));
                    cells.push(fmt_ms(qs.p95));
                    cells.push(fmt_ms(qs.p99));
                }
                if phases {
                    for qs in [&r.queue, &r.prefill, &r.decode] {
                        cells.push(fmt_ms(qs.p50));
                        cells.push(fmt_ms(qs.p99));
                    }
                    cells.push(
                        r.queue_share_of_ttft
                            .map_or_else(|| "-".to_owned(), |x| format!("{:.1}", x * 100.0)),
                    );
                    cells.push(fmt_ms(r.unaccounted.p50));
                    cells.push(fmt_ms(r.unaccounted.p99));
                }
                cells.push(r.input_tokens.to_string());
                cells.push(r.output_tokens.to_string());
                table.add_row(cells.into_iter().enumerate().map(|(i, c)| {
                    let cell = Cell::new(c);
                    if i >= numeric_from {
                        cell.set_alignment(CellAlignment::Right)
                    } else {
                        cell
                    }
                }));
            }
            let mut s = table.to_string();
            s.push('\n');
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sqlite::tests::sparse_record;
    use proptest::prelude::*;
    use tokenscope_core::RequestRecord;

    const DAY: i64 = 86_400_000_000;
    const T0: i64 = 1_704_067_200 * 1_000_000; // 2024-01-01T00:00:00Z

    #[allow(clippy::too_many_arguments)]
    fn mk(
        id: &str,
        at: i64,
        model: &str,
        user: Option<&str>,
        outcome: Outcome,
        ttft: Option<f64>,
        total: f64,
        input: Option<u64>,
    ) -> RequestRecord {
        let mut r = sparse_record(id);
        r.created_at = at;
        r.model = model.to_owned();
        r.user_id = user.map(str::to_owned);
        r.outcome = outcome;
        r.ttft_ms = ttft;
        r.stream = ttft.is_some();
        r.tpot_ms = ttft.map(|t| t / 10.0);
        r.total_duration_ms = total;
        r.input_tokens = input;
        r.output_tokens = input.map(|i| i / 2);
        r.cached_tokens = input.map(|_| 1);
        r.input_bucket = input.map(InputBucket::of);
        r
    }

    fn fixture() -> SqliteStore {
        let mut s = SqliteStore::open_in_memory().expect("open");
        let recs = vec![
            // day 0
            mk(
                "1",
                T0 + 10,
                "a",
                Some("u1"),
                Outcome::Ok,
                Some(100.0),
                1000.0,
                Some(50),
            ),
            mk(
                "2",
                T0 + 20,
                "a",
                Some("u2"),
                Outcome::Ok,
                Some(300.0),
                3000.0,
                Some(600),
            ),
            mk(
                "3",
                T0 + 30,
                "a",
                Some("u1"),
                Outcome::Timeout,
                None,
                9000.0,
                Some(3000),
            ),
            mk(
                "4",
                T0 + 40,
                "b",
                None,
                Outcome::Ok,
                Some(50.0),
                500.0,
                None,
            ),
            // day 1
            mk(
                "5",
                T0 + DAY + 5,
                "a",
                Some("u1"),
                Outcome::Ok,
                Some(200.0),
                2000.0,
                Some(100),
            ),
            mk(
                "6",
                T0 + DAY + 6,
                "b",
                Some("u2"),
                Outcome::UpstreamError,
                None,
                10.0,
                Some(10),
            ),
            // day 2 (outside the usual range)
            mk(
                "7",
                T0 + 2 * DAY,
                "a",
                Some("u1"),
                Outcome::Ok,
                Some(1.0),
                1.0,
                Some(1),
            ),
        ];
        s.insert_batch(&recs).expect("insert");
        s
    }

    fn q(group_by: Vec<Dimension>) -> ReportQuery {
        ReportQuery {
            since_us: T0,
            until_us: Some(T0 + 2 * DAY),
            group_by,
            interval: None,
            filters: vec![],
        }
    }

    #[test]
    fn group_by_model() {
        let s = fixture();
        let rows = run_report(&s, &q(vec![Dimension::Model])).expect("report");
        assert_eq!(rows.len(), 2);
        let a = &rows[0];
        assert_eq!(a.group, vec![(Dimension::Model, "a".to_owned())]);
        assert_eq!((a.count, a.ok), (4, 3));
        assert!((a.success_rate - 0.75).abs() < 1e-12);
        assert!((a.qps - 4.0 / (2.0 * 86_400.0)).abs() < 1e-12);
        // ttft values: 100, 300, 200 (the timeout has none) → sorted 100, 200, 300.
        assert_eq!(a.ttft.n, 3);
        assert_eq!(a.ttft.p50, Some(200.0));
        assert_eq!(a.ttft.p90, Some(300.0));
        assert_eq!(a.ttft.mean, Some(200.0));
        // e2e over all 4: 1000, 2000, 3000, 9000 → P50 = 2nd = 2000, P99 = 4th.
        assert_eq!(a.e2e.n, 4);
        assert_eq!(a.e2e.p50, Some(2000.0));
        assert_eq!(a.e2e.p99, Some(9000.0));
        assert_eq!(a.input_tokens, 50 + 600 + 3000 + 100);
        assert_eq!(a.output_tokens, 25 + 300 + 1500 + 50);
        assert_eq!(a.cached_tokens, 4);
        let b = &rows[1];
        assert_eq!(b.group[0].1, "b");
        assert_eq!((b.count, b.ok, b.ttft.n, b.input_tokens), (2, 1, 1, 10));
    }

    #[test]
    fn no_groups_one_row_and_open_until() {
        let s = fixture();
        let mut query = q(vec![]);
        query.until_us = None;
        let rows = run_report_at(s.conn(), &query, T0 + 4 * DAY).expect("report");
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].count, 7);
        assert!(rows[0].group.is_empty());
        assert!((rows[0].qps - 7.0 / (4.0 * 86_400.0)).abs() < 1e-12);
    }

    #[test]
    fn interval_buckets_and_ordering() {
        let s = fixture();
        let mut query = q(vec![Dimension::User]);
        query.interval = Some(Duration::from_secs(86_400));
        let rows = run_report(&s, &query).expect("report");
        let got: Vec<(i64, String, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r.bucket_start_us.expect("bucket"),
                    r.group[0].1.clone(),
                    r.count,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (T0, "u1".to_owned(), 2),
                (T0, "u2".to_owned(), 1),
                (T0, NONE_LABEL.to_owned(), 1),
                (T0 + DAY, "u1".to_owned(), 1),
                (T0 + DAY, "u2".to_owned(), 1),
            ]
        );
        assert!((rows[0].qps - 2.0 / 86_400.0).abs() < 1e-12);
    }

    #[test]
    fn partial_bucket_window_is_clipped() {
        let s = fixture();
        let query = ReportQuery {
            since_us: T0 + DAY / 2,
            until_us: Some(T0 + DAY + DAY / 4),
            group_by: vec![],
            interval: Some(Duration::from_secs(86_400)),
            filters: vec![],
        };
        let rows = run_report(&s, &query).expect("report");
        assert_eq!(rows.len(), 1); // day 0 rows are all before since
        assert_eq!(rows[0].bucket_start_us, Some(T0 + DAY));
        assert_eq!(rows[0].count, 2);
        assert!((rows[0].qps - 2.0 / (86_400.0 / 4.0)).abs() < 1e-12);
    }

    #[test]
    fn filters() {
        let s = fixture();
        let mut query = q(vec![Dimension::Model, Dimension::Status]);
        query.filters = vec![(Dimension::User, "u1".to_owned())];
        let rows = run_report(&s, &query).expect("report");
        let got: Vec<(String, String, u64)> = rows
            .iter()
            .map(|r| (r.group[0].1.clone(), r.group[1].1.clone(), r.count))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".to_owned(), "ok".to_owned(), 2),
                ("a".to_owned(), "timeout".to_owned(), 1),
            ]
        );

        let mut query = q(vec![]);
        query.filters = vec![(Dimension::User, NONE_LABEL.to_owned())];
        assert_eq!(run_report(&s, &query).expect("report")[0].count, 1);

        let mut query = q(vec![Dimension::Stream]);
        query.filters = vec![
            (Dimension::Stream, "true".to_owned()),
            (Dimension::Model, "a".to_owned()),
        ];
        let rows = run_report(&s, &query).expect("report");
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].group[0].1.as_str(), rows[0].count), ("true", 3));

        let mut query = q(vec![]);
        query.filters = vec![(Dimension::Status, "nope".to_owned())];
        assert!(matches!(
            run_report(&s, &query),
            Err(StoreError::InvalidQuery(_))
        ));
        // A filter matching nothing: no rows.
        let mut query = q(vec![]);
        query.filters = vec![(Dimension::Model, "zzz".to_owned())];
        assert!(run_report(&s, &query).expect("report").is_empty());
    }

    #[test]
    fn input_bucket_natural_order() {
        let s = fixture();
        let rows = run_report(&s, &q(vec![Dimension::InputBucket])).expect("report");
        let got: Vec<&str> = rows.iter().map(|r| r.group[0].1.as_str()).collect();
        // Byte order would put "2048+" before "512-2048".
        assert_eq!(got, ["0-128", "512-2048", "2048+", NONE_LABEL]);
    }

    #[test]
    fn invalid_queries() {
        let s = fixture();
        let mut query = q(vec![Dimension::Model, Dimension::Model]);
        assert!(run_report(&s, &query).is_err());
        query = q(vec![]);
        query.until_us = Some(T0);
        assert!(run_report(&s, &query).is_err());
        query = q(vec![]);
        query.interval = Some(Duration::from_nanos(10));
        assert!(run_report(&s, &query).is_err());
    }

    #[test]
    fn dimension_and_format_parsing() {
        for d in Dimension::ALL {
            assert_eq!(d.as_str().parse::<Dimension>().expect("parse"), d);
        }
        assert_eq!(
            "user_id".parse::<Dimension>().expect("alias"),
            Dimension::User
        );
        assert_eq!(
            "Business-Line".parse::<Dimension>().expect("alias"),
            Dimension::BusinessLine
        );
        assert_eq!(
            "outcome".parse::<Dimension>().expect("alias"),
            Dimension::Status
        );
        assert!("colour".parse::<Dimension>().is_err());
        assert_eq!("JSON".parse::<Format>().expect("fmt"), Format::Json);
        assert!("xml".parse::<Format>().is_err());
    }

    #[test]
    fn render_formats() {
        let s = fixture();
        let mut query = q(vec![Dimension::Model]);
        query.interval = Some(Duration::from_secs(86_400));
        let rows = run_report(&s, &query).expect("report");

        let json = render(&rows, &query, Format::Json);
        let v: serde_json::Value = serde_json::from_str(&json).expect("valid json");
        let arr = v.as_array().expect("array");
        assert_eq!(arr.len(), rows.len());
        assert_eq!(arr[0]["model"], "a");
        assert_eq!(arr[0]["bucket_start"], "2024-01-01T00:00:00Z");
        assert_eq!(arr[0]["bucket_start_us"], T0);
        assert_eq!(arr[0]["count"], 3);
        assert_eq!(arr[0]["ttft_p50_ms"], 100.0);
        assert!(arr[1]["ttft_p50_ms"].is_number());
        // model b on day 1 has no TTFT at all → null.
        let b1 = arr
            .iter()
            .find(|o| o["model"] == "b" && o["bucket_start_us"] == T0 + DAY)
            .expect("b day 1");
        assert!(b1["ttft_p50_ms"].is_null());
        assert_eq!(b1["ttft_n"], 0);

        let csv = render(&rows, &query, Format::Csv);
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().expect("header").split(',').collect();
        assert_eq!(header, flat_header(&query));
        assert_eq!(
            header[..4],
            ["bucket_start_us", "bucket_start", "model", "count"]
        );
        assert!(header.contains(&"e2e_p99_ms"));
        let data: Vec<&str> = lines.collect();
        assert_eq!(data.len(), rows.len());
        assert!(data.iter().all(|l| l.split(',').count() == header.len()));
        // JSON keys in the same order as the CSV header.
        let first = arr[0].as_object().expect("object");
        assert_eq!(first.len(), header.len());

        let table = render(&rows, &query, Format::Table);
        assert!(table.contains("ttft p95"));
        assert!(table.contains("2024-01-02T00:00:00Z"));

        let empty = render(&[], &query, Format::Csv);
        assert_eq!(empty.lines().count(), 1);
        assert_eq!(render(&[], &query, Format::Json).trim(), "[]");
    }

    #[test]
    fn report_scans_the_covering_index() {
        let s = fixture();
        // `gpu_band`, `replica` and the blame's `blocker_*` are not in the covering index:
        // grouping by them reads table rows (slower, still correct); every other dimension is
        // covered.
        let covered: Vec<Dimension> = Dimension::ALL
            .into_iter()
            .filter(|d| {
                !matches!(
                    d,
                    Dimension::GpuBand
                        | Dimension::Replica
                        | Dimension::BlockerLine
                        | Dimension::BlockerCaller
                )
            })
            .collect();
        for group_by in [vec![], vec![Dimension::User, Dimension::Stream], covered] {
            let mut query = q(group_by);
            query.interval = Some(Duration::from_secs(3600));
            let (sql, params, _) = report_sql(&query, query.since_us, query.until_us).expect("sql");
            let mut stmt = s
                .conn()
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("explain");
            let plan: Vec<String> = stmt
                .query_map(rusqlite::params_from_iter(params), |r| {
                    r.get::<_, String>(3)
                })
                .expect("plan")
                .collect::<Result<_, _>>()
                .expect("rows");
            let plan = plan.join("\n");
            assert!(
                plan.contains("USING COVERING INDEX idx_log_created_at"),
                "{plan}"
            );
        }
    }

    #[test]
    fn parallel_slices_equal_single_thread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("r.db");
        let mut w = SqliteStore::open(&path).expect("open");
        let mut seed = 0x1234_5678_9abc_def0_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let recs: Vec<RequestRecord> = (0..3000)
            .map(|i| {
                let x = next();
                let outcome = if x % 17 == 0 {
                    Outcome::Timeout
                } else {
                    Outcome::Ok
                };
                let ttft = (x % 3 != 0).then_some((x % 10_000) as f64 / 7.0);
                let user = format!("u{}", x % 13);
                let mut r = mk(
                    &i.to_string(),
                    T0 + (x % (3 * DAY as u64)) as i64,
                    ["a", "b", "c"][(x % 3) as usize],
                    (x % 11 != 0).then_some(user.as_str()),
                    outcome,
                    ttft,
                    (x % 100_000) as f64 / 3.0,
                    Some(x % 5000),
                );
                r.stream = x % 2 == 0;
                r.queue_duration_ms = (x % 7 != 0).then_some((x % 900) as f64 / 9.0);
                r.prefill_duration_ms = (x % 5 != 0).then_some((x % 4000) as f64 / 3.0);
                r.decode_duration_ms = (x % 3 != 1).then_some((x % 80_000) as f64 / 7.0);
                r.engine_kv_usage = (x % 19 != 0).then_some((x % 1000) as f64 / 999.0);
                r.engine = (x % 23 != 0).then(|| ["vllm", "sglang"][(x % 2) as usize].to_owned());
                r
            })
            .collect();
        w.insert_batch(&recs).expect("insert");
        let r = SqliteStore::open_read_only(&path).expect("reader");
        let queries = [
            q(vec![Dimension::Model]),
            q(vec![
                Dimension::User,
                Dimension::Stream,
                Dimension::InputBucket,
            ]),
            ReportQuery {
                interval: Some(Duration::from_secs(6 * 3600)),
                until_us: Some(T0 + 3 * DAY),
                ..q(vec![Dimension::Status])
            },
            ReportQuery {
                filters: vec![(Dimension::Model, "b".to_owned())],
                ..q(vec![Dimension::User])
            },
            q(vec![Dimension::KvUsageBand, Dimension::Engine]),
            ReportQuery {
                filters: vec![(Dimension::KvUsageBand, "80-95%".to_owned())],
                ..q(vec![Dimension::Model])
            },
        ];
        for query in &queries {
            let single = run_report_threads(&r, query, 1).expect("single");
            assert!(!single.is_empty());
            // Values dropped at once (budget 0) or part-way (100 rows): the percentiles come
            // from SQLite's sorted passes and the means from exact sums — the same bits.
            for budget in [0, 100, 2999] {
                for threads in [1, 2, 4] {
                    let spilled = run_report_budget(&r, query, threads, budget).expect("spilled");
                    assert_eq!(
                        spilled, single,
                        "budget {budget}, {threads} threads: {query:?}"
                    );
                }
            }
            for threads in [2, 3, 4] {
                let par = run_report_threads(&r, query, threads).expect("parallel");
                assert_eq!(par.len(), single.len());
                for (a, b) in par.iter().zip(&single) {
                    let strip = |x: &ReportRow| {
                        let mut x = x.clone();
                        for m in [
                            &mut x.ttft,
                            &mut x.tpot,
                            &mut x.e2e,
                            &mut x.queue,
                            &mut x.prefill,
                            &mut x.decode,
                            &mut x.unaccounted,
                        ] {
                            m.mean = m.mean.map(|v| (v * 1e6).round());
                        }
                        x.queue_share_of_ttft = x.queue_share_of_ttft.map(|v| (v * 1e9).round());
                        x
                    };
                    assert_eq!(strip(a), strip(b));
                }
            }
        }
        // Empty range.
        let empty = ReportQuery {
            since_us: T0 + 10 * DAY,
            until_us: Some(T0 + 11 * DAY),
            ..q(vec![])
        };
        assert!(run_report_threads(&r, &empty, 2).expect("empty").is_empty());
    }

    /// Rows with engine phases and state: (id, ttft, queue, prefill, decode, kv, engine).
    fn phase_fixture() -> SqliteStore {
        let mut s = SqliteStore::open_in_memory().expect("open");
        #[allow(clippy::type_complexity)]
        let rows: [(
            &str,
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<&str>,
        ); 6] = [
            (
                "1",
                Some(100.0),
                Some(10.0),
                Some(80.0),
                Some(1000.0),
                Some(0.10),
                Some("vllm"),
            ),
            (
                "2",
                Some(300.0),
                Some(150.0),
                Some(140.0),
                Some(2000.0),
                Some(0.5),
                Some("vllm"),
            ),
            (
                "3",
                None,
                Some(40.0),
                Some(20.0),
                None,
                Some(0.7999),
                Some("sglang"),
            ),
            (
                "4",
                Some(200.0),
                None,
                None,
                Some(3000.0),
                Some(0.8),
                Some("vllm"),
            ),
            ("5", Some(50.0), Some(30.0), None, None, Some(0.97), None),
            (
                "6",
                Some(60.0),
                None,
                Some(5.0),
                Some(500.0),
                None,
                Some("sglang"),
            ),
        ];
        let recs: Vec<RequestRecord> = rows
            .iter()
            .enumerate()
            .map(|(i, (id, ttft, queue, prefill, decode, kv, engine))| {
                let mut r = sparse_record(id);
                r.created_at = T0 + i as i64;
                r.trace_id = format!("trace-{id}");
                r.ttft_ms = *ttft;
                r.queue_duration_ms = *queue;
                r.prefill_duration_ms = *prefill;
                r.decode_duration_ms = *decode;
                r.engine_kv_usage = *kv;
                // GPU utilisation at arrival mirrors KV usage in this fixture.
                r.gpu_utilization = *kv;
                r.engine = engine.map(str::to_owned);
                // The part of TTFT not in the engine's queue + prefill: 10, 10, 55.
                r.ttft_unaccounted_ms = match (ttft, prefill) {
                    (Some(t), Some(p)) => Some(t - queue.unwrap_or(0.0) - p),
                    _ => None,
                };
                r
            })
            .collect();
        s.insert_batch(&recs).expect("insert");
        s
    }

    #[test]
    fn phase_quantiles_and_queue_share() {
        let s = phase_fixture();
        let rows = run_report(&s, &q(vec![])).expect("report");
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        // queue: 10, 150, 40, 30 → sorted 10, 30, 40, 150.
        assert_eq!(r.queue.n, 4);
        assert_eq!((r.queue.p50, r.queue.p99), (Some(30.0), Some(150.0)));
        assert_eq!(r.queue.mean, Some(57.5));
        // prefill: 80, 140, 20, 5 → 5, 20, 80, 140.
        assert_eq!(r.prefill.n, 4);
        assert_eq!((r.prefill.p50, r.prefill.p90), (Some(20.0), Some(140.0)));
        // decode: 1000, 2000, 3000, 500.
        assert_eq!(r.decode.n, 4);
        assert_eq!((r.decode.p50, r.decode.p99), (Some(1000.0), Some(3000.0)));
        // Share over rows with both queue and TTFT (1, 2, 5): (10+150+30) / (100+300+50).
        assert_eq!(r.queue_share_of_ttft, Some(190.0 / 450.0));
        // Not seen by the engine: 10, 10, 55.
        assert_eq!(r.unaccounted.n, 3);
        assert_eq!(
            (r.unaccounted.p50, r.unaccounted.p99, r.unaccounted.mean),
            (Some(10.0), Some(55.0), Some(25.0))
        );
    }

    #[test]
    fn queue_share_is_none_without_rows_having_both() {
        assert_eq!(queue_share(0, 0.0, 0.0), None);
        assert_eq!(queue_share(2, 5.0, 0.0), None);
        assert_eq!(queue_share(1, 5.0, 10.0), Some(0.5));
        let s = phase_fixture();
        let mut query = q(vec![]);
        // Row 3 has a queue but no TTFT, row 4 a TTFT but no queue.
        query.filters = vec![(Dimension::Engine, "sglang".to_owned())];
        let rows = run_report(&s, &query).expect("report");
        assert_eq!(rows[0].count, 2);
        assert_eq!(rows[0].queue.n, 1);
        assert_eq!(rows[0].queue_share_of_ttft, None);
    }

    #[test]
    fn scanner_fed_by_hand_equals_sqlite_report() {
        let store = fixture();
        let mut q = q(vec![Dimension::Model, Dimension::Stream]);
        q.interval = Some(Duration::from_secs(3600));
        let want = run_report_at(store.conn(), &q, 9_000_000_000).expect("report");
        // Feed the same rows through the public scanner, as an external store would.
        let (sql, params, _) = report_sql(&q, q.since_us, q.until_us).expect("report");
        let mut stmt = store.conn().prepare(&sql).expect("report");
        let n = stmt.column_count();
        let mut rows = stmt
            .query(rusqlite::params_from_iter(params))
            .expect("report");
        let mut sc = Scanner::new(&q).expect("report");
        while let Some(r) = rows.next().expect("report") {
            let owned: Vec<rusqlite::types::Value> = (0..n)
                .map(|i| r.get::<_, rusqlite::types::Value>(i).expect("report"))
                .collect();
            let vals: Vec<ScanValue<'_>> = owned
                .iter()
                .map(|v| match v {
                    rusqlite::types::Value::Null => ScanValue::Null,
                    rusqlite::types::Value::Integer(i) => ScanValue::Int(*i),
                    rusqlite::types::Value::Real(f) => ScanValue::Real(*f),
                    rusqlite::types::Value::Text(t) => ScanValue::Text(t.as_bytes()),
                    rusqlite::types::Value::Blob(b) => ScanValue::Text(b),
                })
                .collect();
            sc.push(&vals);
        }
        assert_eq!(sc.finish(9_000_000_000), want);
        assert!(!want.is_empty());
    }

    #[test]
    fn kv_band_boundaries() {
        let cases = [
            (-0.1, "0-50%"),
            (0.0, "0-50%"),
            (0.4999, "0-50%"),
            (0.5, "50-80%"),
            (0.7999, "50-80%"),
            (0.8, "80-95%"),
            (0.9499, "80-95%"),
            (0.95, "95-100%"),
            (1.0, "95-100%"),
            (1.3, "95-100%"),
        ];
        for (usage, band) in cases {
            assert_eq!(kv_band(Some(usage)), band, "{usage}");
        }
        assert_eq!(kv_band(None), NONE_LABEL);
        assert_eq!(kv_band(Some(f64::NAN)), NONE_LABEL);
        assert_eq!(kv_band_index(0.5), Some(1));
    }

    #[test]
    fn group_and_filter_by_gpu_band() {
        let s = phase_fixture();
        let by = |d: Dimension| -> Vec<(String, u64)> {
            run_report(&s, &q(vec![d]))
                .expect("report")
                .iter()
                .map(|r| (r.group[0].1.clone(), r.count))
                .collect()
        };
        assert_eq!(by(Dimension::GpuBand), by(Dimension::KvUsageBand));
        assert_eq!(
            "gpu_band".parse::<Dimension>().expect("dim"),
            Dimension::GpuBand
        );
        let mut query = q(vec![]);
        query.filters = vec![(Dimension::GpuBand, "50-80%".to_owned())];
        assert_eq!(run_report(&s, &query).expect("report")[0].count, 2);
    }

    #[test]
    fn group_and_filter_by_replica() {
        let mut s = SqliteStore::open_in_memory().expect("open");
        let recs: Vec<RequestRecord> = [("a:1", 10.0), ("b:2", 20.0), ("a:1", 30.0), ("", 5.0)]
            .iter()
            .enumerate()
            .map(|(i, (replica, total))| {
                let mut r = mk(
                    &format!("r{i}"),
                    T0 + i as i64,
                    "m",
                    None,
                    Outcome::Ok,
                    None,
                    *total,
                    None,
                );
                r.replica = (*replica).to_owned();
                r
            })
            .collect();
        s.insert_batch(&recs).expect("insert");
        let rows = run_report(&s, &q(vec![Dimension::Replica])).expect("report");
        let got: Vec<(String, u64, Option<f64>)> = rows
            .iter()
            .map(|r| (r.group[0].1.clone(), r.count, r.e2e.p99))
            .collect();
        assert_eq!(
            got,
            [
                (String::new(), 1, Some(5.0)),
                ("a:1".to_owned(), 2, Some(30.0)),
                ("b:2".to_owned(), 1, Some(20.0)),
            ]
        );
        assert_eq!(
            "replica".parse::<Dimension>().expect("dim"),
            Dimension::Replica
        );
        let mut query = q(vec![]);
        query.filters = vec![(Dimension::Replica, "a:1".to_owned())];
        assert_eq!(run_report(&s, &query).expect("report")[0].count, 2);
    }

    #[test]
    fn group_and_filter_by_kv_band_and_engine() {
        let s = phase_fixture();
        let rows = run_report(&s, &q(vec![Dimension::KvUsageBand])).expect("report");
        let got: Vec<(&str, u64)> = rows
            .iter()
            .map(|r| (r.group[0].1.as_str(), r.count))
            .collect();
        assert_eq!(
            got,
            [
                ("0-50%", 1),
                ("50-80%", 2),
                ("80-95%", 1),
                ("95-100%", 1),
                (NONE_LABEL, 1)
            ]
        );
        // The filter selects the same half-open ranges as the grouping.
        for (band, n) in &got {
            let mut query = q(vec![]);
            query.filters = vec![(Dimension::KvUsageBand, (*band).to_owned())];
            let rows = run_report(&s, &query).expect("report");
            assert_eq!(rows[0].count, *n, "{band}");
        }
        let mut query = q(vec![]);
        query.filters = vec![(Dimension::KvUsageBand, "10%".to_owned())];
        assert!(matches!(
            run_report(&s, &query),
            Err(StoreError::InvalidQuery(_))
        ));

        let rows = run_report(&s, &q(vec![Dimension::Engine])).expect("report");
        let got: Vec<(&str, u64)> = rows
            .iter()
            .map(|r| (r.group[0].1.as_str(), r.count))
            .collect();
        assert_eq!(got, [("sglang", 2), ("vllm", 3), (NONE_LABEL, 1)]);
        assert_eq!(
            "kv_band".parse::<Dimension>().expect("parse"),
            Dimension::KvUsageBand
        );
        assert_eq!(
            "engine_kv_usage".parse::<Dimension>().expect("alias"),
            Dimension::KvUsageBand
        );
    }

    #[test]
    fn report_reflects_late_engine_updates() {
        let mut s = phase_fixture();
        let before = run_report(&s, &q(vec![])).expect("report");
        assert_eq!(before[0].queue.n, 4);
        let update = |id: &str, queue: f64| tokenscope_core::PhaseUpdate {
            trace_id: format!("trace-{id}"),
            queue_duration_ms: Some(queue),
            ..tokenscope_core::PhaseUpdate::default()
        };
        // Row 4 gains a queue time, row 2's is corrected.
        s.apply_updates(&[update("4", 100.0), update("2", 50.0)])
            .expect("update");
        let after = run_report(&s, &q(vec![])).expect("report");
        let r = &after[0];
        // queue: 10, 50, 40, 100, 30 → 10, 30, 40, 50, 100.
        assert_eq!(r.queue.n, 5);
        assert_eq!((r.queue.p50, r.queue.p99), (Some(40.0), Some(100.0)));
        // Rows with both: 1, 2, 4, 5 → (10+50+100+30) / (100+300+200+50).
        assert_eq!(r.queue_share_of_ttft, Some(190.0 / 650.0));
    }

    #[test]
    fn render_phase_fields() {
        let s = phase_fixture();
        let query = q(vec![Dimension::Engine]);
        let rows = run_report(&s, &query).expect("report");
        let json = render(&rows, &query, Format::Json);
        let v: serde_json::Value = serde_json::from_str(&json).expect("json");
        let vllm = &v[1];
        assert_eq!(vllm["engine"], "vllm");
        assert_eq!(vllm["queue_n"], 2);
        assert_eq!(vllm["queue_p50_ms"], 10.0);
        assert_eq!(vllm["queue_p99_ms"], 150.0);
        assert_eq!(vllm["prefill_p50_ms"], 80.0);
        assert_eq!(vllm["decode_p99_ms"], 3000.0);
        assert_eq!(vllm["queue_share_of_ttft"], 160.0 / 400.0);
        assert!(v[0]["queue_share_of_ttft"].is_null());
        let csv = render(&rows, &query, Format::Csv);
        let header: Vec<&str> = csv.lines().next().expect("header").split(',').collect();
        // New fields are appended after the v1 ones, which keep their positions.
        let tail: Vec<&str> = header[header.len() - 25..header.len() - 6].to_vec();
        assert_eq!(
            tail,
            [
                "queue_n",
                "queue_p50_ms",
                "queue_p90_ms",
                "queue_p95_ms",
                "queue_p99_ms",
                "queue_mean_ms",
                "prefill_n",
                "prefill_p50_ms",
                "prefill_p90_ms",
                "prefill_p95_ms",
                "prefill_p99_ms",
                "prefill_mean_ms",
                "decode_n",
                "decode_p50_ms",
                "decode_p90_ms",
                "decode_p95_ms",
                "decode_p99_ms",
                "decode_mean_ms",
                "queue_share_of_ttft",
            ]
        );
        assert_eq!(header[header.len() - 26], "cached_tokens");
        // Appended in v10: the part of TTFT the engine did not account for.
        assert_eq!(header[header.len() - 6], "unaccounted_n");
        assert_eq!(header[header.len() - 1], "unaccounted_mean_ms");
        let vllm_line = csv
            .lines()
            .find(|l| l.starts_with("vllm,"))
            .expect("vllm row");
        assert!(vllm_line.ends_with(",0.4,2,10,10,10,10,10"), "{vllm_line}");
        let table = render(&rows, &query, Format::Table);
        for h in [
            "queue p50",
            "queue p99",
            "prefill p99",
            "decode p50",
            "queue % ttft",
        ] {
            assert!(table.contains(h), "{h} missing:\n{table}");
        }
        assert!(!table.contains("queue p95"));
        assert!(table.contains("40.0"), "{table}"); // the vllm queue share in percent
                                                    // Without any phase value the table keeps its old width.
        let plain = fixture();
        let rows = run_report(&plain, &q(vec![])).expect("report");
        let table = render(&rows, &q(vec![]), Format::Table);
        assert!(!table.contains("queue p50"));
        assert!(table.contains("ttft p95"));
    }

    #[test]
    fn csv_escaping() {
        assert_eq!(csv_escape("plain"), "plain");
        assert_eq!(csv_escape("a,b"), "\"a,b\"");
        assert_eq!(csv_escape("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn utc_formatting() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(T0), "2024-01-01T00:00:00Z");
        assert_eq!(format_utc(T0 + 59 * DAY + 1), "2024-02-29T00:00:00.000001Z");
        assert_eq!(format_utc(-1_000_000), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn nearest_rank_definition() {
        // The rank itself is tested with its definition (`tokenscope_core::query`).
        let mut v = [4.0, 1.0, 3.0, 2.0];
        let qs = Quantiles::from_values(&mut v);
        assert_eq!(
            (qs.p50, qs.p90, qs.p99, qs.mean),
            (Some(2.0), Some(4.0), Some(4.0), Some(2.5))
        );
        assert_eq!(Quantiles::from_values(&mut []), Quantiles::default());
    }

    fn naive(values: &[f64], q_pct: u64) -> f64 {
        let mut s = values.to_vec();
        s.sort_by(f64::total_cmp);
        let n = s.len() as u64;
        // k = ceil(q_pct * n / 100) in integers.
        let k = (q_pct * n).div_ceil(100).max(1);
        s[(k - 1) as usize]
    }

    proptest! {
        #[test]
        fn quantiles_match_naive_sort(
            values in prop::collection::vec(-1.0e6f64..1.0e6, 1..400),
            dup in 0usize..4,
        ) {
            // Add duplicates to exercise ties.
            let mut values = values;
            let extra: Vec<f64> = values.iter().take(dup * 10).copied().collect();
            values.extend(extra);
            let mut work = values.clone();
            let qs = Quantiles::from_values(&mut work);
            prop_assert_eq!(qs.n, values.len() as u64);
            prop_assert_eq!(qs.p50, Some(naive(&values, 50)));
            prop_assert_eq!(qs.p90, Some(naive(&values, 90)));
            prop_assert_eq!(qs.p95, Some(naive(&values, 95)));
            prop_assert_eq!(qs.p99, Some(naive(&values, 99)));
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            prop_assert!((qs.mean.unwrap_or(f64::NAN) - mean).abs() <= 1e-6 * mean.abs().max(1.0));
        }

        #[test]
        fn report_percentiles_match_naive_per_group(
            rows in prop::collection::vec((0u8..3, prop::option::of(0.0f64..5000.0)), 1..200),
        ) {
            let mut s = SqliteStore::open_in_memory().expect("open");
            let recs: Vec<RequestRecord> = rows
                .iter()
                .enumerate()
                .map(|(i, (m, t))| {
                    mk(&i.to_string(), T0 + i as i64, &format!("m{m}"), None, Outcome::Ok, *t, 1.0, None)
                })
                .collect();
            s.insert_batch(&recs).expect("insert");
            let out = run_report(&s, &q(vec![Dimension::Model])).expect("report");
            // The same from sorted passes (no value held).
            let sorted = run_report_budget(&s, &q(vec![Dimension::Model]), 1, 0).expect("sorted");
            prop_assert_eq!(&sorted, &out);
            for r in &out {
                let name = &r.group[0].1;
                let vals: Vec<f64> = recs
                    .iter()
                    .filter(|x| &x.model == name)
                    .filter_map(|x| x.ttft_ms)
                    .collect();
                prop_assert_eq!(r.ttft.n, vals.len() as u64);
                if vals.is_empty() {
                    prop_assert_eq!(r.ttft.p50, None);
                } else {
                    prop_assert_eq!(r.ttft.p50, Some(naive(&vals, 50)));
                    prop_assert_eq!(r.ttft.p99, Some(naive(&vals, 99)));
                }
            }
            let total: u64 = out.iter().map(|r| r.count).sum();
            prop_assert_eq!(total, recs.len() as u64);
        }

        #[test]
        fn phase_quantiles_and_share_match_naive(
            rows in prop::collection::vec(
                (
                    prop::option::of(0.0f64..5000.0),
                    prop::option::of(0.0f64..2000.0),
                    prop::option::of(0.0f64..3000.0),
                    prop::option::of(-0.2f64..1.2),
                ),
                1..150,
            ),
        ) {
            let mut s = SqliteStore::open_in_memory().expect("open");
            let recs: Vec<RequestRecord> = rows
                .iter()
                .enumerate()
                .map(|(i, (ttft, queue, prefill, kv))| {
                    let mut r = mk(&i.to_string(), T0 + i as i64, "m", None, Outcome::Ok, *ttft, 1.0, None);
                    r.queue_duration_ms = *queue;
                    r.prefill_duration_ms = *prefill;
                    r.decode_duration_ms = queue.zip(*prefill).map(|(a, b)| a + b);
                    r.engine_kv_usage = *kv;
                    r
                })
                .collect();
            s.insert_batch(&recs).expect("insert");
            let out = run_report(&s, &q(vec![Dimension::KvUsageBand])).expect("report");
            let total: u64 = out.iter().map(|r| r.count).sum();
            prop_assert_eq!(total, recs.len() as u64);
            for r in &out {
                let band = r.group[0].1.as_str();
                let members: Vec<&RequestRecord> = recs
                    .iter()
                    .filter(|x| kv_band(x.engine_kv_usage) == band)
                    .collect();
                prop_assert_eq!(r.count, members.len() as u64);
                for (qs, get) in [
                    (&r.queue, (|x: &RequestRecord| x.queue_duration_ms) as fn(&RequestRecord) -> Option<f64>),
                    (&r.prefill, |x: &RequestRecord| x.prefill_duration_ms),
                    (&r.decode, |x: &RequestRecord| x.decode_duration_ms),
                ] {
                    let vals: Vec<f64> = members.iter().filter_map(|x| get(x)).collect();
                    prop_assert_eq!(qs.n, vals.len() as u64);
                    if vals.is_empty() {
                        prop_assert_eq!(qs.p50, None);
                    } else {
                        prop_assert_eq!(qs.p50, Some(naive(&vals, 50)));
                        prop_assert_eq!(qs.p99, Some(naive(&vals, 99)));
                    }
                }
                let both: Vec<(f64, f64)> = members
                    .iter()
                    .filter_map(|x| x.queue_duration_ms.zip(x.ttft_ms))
                    .collect();
                let (sq, st) = both.iter().fold((0.0, 0.0), |(a, b), (q, t)| (a + q, b + t));
                match r.queue_share_of_ttft {
                    None => prop_assert!(both.is_empty() || st == 0.0),
                    Some(share) => prop_assert!((share - sq / st).abs() <= 1e-9 * (sq / st).max(1.0)),
                }
            }
        }
    }
}
