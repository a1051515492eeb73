//! The read side's shared vocabulary: what every consumer of stored records (the report, the
//! analyses, the dashboard, the CLI, the benchmark) means by a time window, a grouping
//! dimension, an output format and a percentile. Defined once here; the store, the analyses,
//! the gateway's dashboard and the CLI all use these types.
//!
//! * [`Window`] — a half-open range `[since_us, until_us)` of epoch microseconds.
//! * [`Dimension`] — a group-by / filter dimension of the per-request records (the report's
//!   set; the cost analysis accepts a subset, see `tokenscope_analysis::cost`).
//! * [`Format`] — `table`, `json` or `csv`.
//! * [`nearest_rank`] / [`nearest_rank_index`] — the one percentile definition.
//!
//! ## Percentile definition
//!
//! Percentiles are **exact nearest-rank** percentiles: for `n` values sorted ascending
//! `x₁ ≤ … ≤ xₙ`, `P(q) = x_k` with `k = ⌈q·n⌉` clamped to `1 ≤ k ≤ n`. So P50 of
//! `[1, 2, 3, 4]` is `2`, P99 of 100 values is the 99th smallest, and every percentile is a
//! value that was actually measured. `q·n` is computed in integer arithmetic (q in
//! millionths), so there is no floating-point off-by-one at exact ranks.
//!
//! Invariants:
//! * Pure: no I/O, no clock.
//! * A [`Dimension`]'s name ([`Dimension::as_str`]) is stable: it is the output field name of
//!   reports, the accepted `--by` value and the serialised form.
//! * [`nearest_rank_index`] always returns a rank in `1..=max(n, 1)`; [`nearest_rank`] is
//!   `None` only for an empty slice.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

/// How a `NULL` (unset) dimension value is shown, and the filter value that selects it.
pub const NONE_LABEL: &str = "(none)";

/// A bad query option (unknown dimension or format). Displays as
/// `invalid report query: <message>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid report query: {0}")]
pub struct InvalidQuery(pub String);

/// A time range `[since_us, until_us)`, epoch microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Window {
    /// Start, inclusive.
    pub since_us: i64,
    /// End, exclusive.
    pub until_us: i64,
}

impl Window {
    /// The window `[since_us, until_us)`.
    pub fn new(since_us: i64, until_us: i64) -> Self {
        Self { since_us, until_us }
    }

    /// Length in microseconds (may be ≤ 0 for an empty window).
    pub fn len_us(&self) -> i64 {
        self.until_us.saturating_sub(self.since_us)
    }

    /// Length in seconds (at least 1 µs).
    pub fn seconds(&self) -> f64 {
        self.len_us().max(1) as f64 / 1e6
    }

    /// The window of the same length just before this one (for trends).
    pub fn previous(&self) -> Window {
        Window {
            since_us: self.since_us - self.len_us(),
            until_us: self.since_us,
        }
    }

    /// Whether `t_us` lies in the window.
    pub fn contains(&self, t_us: i64) -> bool {
        t_us >= self.since_us && t_us < self.until_us
    }
}

/// A grouping / filtering dimension of the per-request records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Dimension {
    /// `model` (as requested by the client).
    #[cfg_attr(feature = "clap", value(name = "model"))]
    Model,
    /// `input_bucket` (`0-128`, `128-512`, `512-2048`, `2048+`).
    #[cfg_attr(feature = "clap", value(name = "input_bucket", alias = "input-bucket"))]
    InputBucket,
    /// `user_id`.
    #[cfg_attr(feature = "clap", value(name = "user", aliases = ["user_id", "user-id"]))]
    User,
    /// `tenant`.
    #[cfg_attr(feature = "clap", value(name = "tenant"))]
    Tenant,
    /// `business_line`.
    #[cfg_attr(
        feature = "clap",
        value(name = "business_line", alias = "business-line")
    )]
    BusinessLine,
    /// `request_type`.
    #[cfg_attr(feature = "clap", value(name = "request_type", alias = "request-type"))]
    RequestType,
    /// `outcome` (`ok`, `client_error`, `upstream_error`, `timeout`, `cancelled`).
    #[cfg_attr(feature = "clap", value(name = "status", alias = "outcome"))]
    Status,
    /// `endpoint` (`chat_completions`, `completions`, `embeddings`, `responses`, `messages`).
    #[cfg_attr(feature = "clap", value(name = "endpoint"))]
    Endpoint,
    /// `upstream`.
    #[cfg_attr(feature = "clap", value(name = "upstream"))]
    Upstream,
    /// `replica`: the upstream replica (`host:port`) that served the request.
    #[cfg_attr(feature = "clap", value(name = "replica"))]
    Replica,
    /// `stream` (`true` / `false`).
    #[cfg_attr(feature = "clap", value(name = "stream"))]
    Stream,
    /// `engine` (the adapter that read the response: `llamacpp`, `vllm`, …).
    #[cfg_attr(feature = "clap", value(name = "engine"))]
    Engine,
    /// `kv_band`: the band of `engine_kv_usage` at arrival (`0-50%`, `50-80%`, `80-95%`,
    /// `95-100%`).
    #[cfg_attr(
        feature = "clap",
        value(
            name = "kv_band",
            aliases = [
                "kv-band",
                "engine_kv_usage",
                "engine-kv-usage",
                "kv_usage_band",
                "kv-usage-band",
                "kv_usage",
                "kv-usage"
            ]
        )
    )]
    KvUsageBand,
    /// `gpu_band`: the band of `gpu_utilization` at arrival (same bands as `kv_band`).
    #[cfg_attr(
        feature = "clap",
        value(
            name = "gpu_band",
            aliases = ["gpu-band", "gpu_utilization", "gpu-utilization", "gpu_util", "gpu-util"]
        )
    )]
    GpuBand,
    /// `blocker_line`: the business line of the request's largest blocker (per-request blame:
    /// the request in prefill on its replica with the most prompt tokens while it waited).
    #[cfg_attr(
        feature = "clap",
        value(name = "blocker_line", aliases = ["blocker-line", "blocker_business_line"])
    )]
    BlockerLine,
    /// `blocker_caller`: the caller of the request's largest blocker.
    #[cfg_attr(
        feature = "clap",
        value(name = "blocker_caller", alias = "blocker-caller")
    )]
    BlockerCaller,
}

impl Dimension {
    /// Every dimension.
    pub const ALL: [Dimension; 16] = [
        Dimension::Model,
        Dimension::InputBucket,
        Dimension::User,
        Dimension::Tenant,
        Dimension::BusinessLine,
        Dimension::RequestType,
        Dimension::Status,
        Dimension::Endpoint,
        Dimension::Upstream,
        Dimension::Replica,
        Dimension::Stream,
        Dimension::Engine,
        Dimension::KvUsageBand,
        Dimension::GpuBand,
        Dimension::BlockerLine,
        Dimension::BlockerCaller,
    ];

    /// The name accepted by [`FromStr`], used as the output field name and the serialised
    /// form.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Model => "model",
            Dimension::InputBucket => "input_bucket",
            Dimension::User => "user",
            Dimension::Tenant => "tenant",
            Dimension::BusinessLine => "business_line",
            Dimension::RequestType => "request_type",
            Dimension::Status => "status",
            Dimension::Endpoint => "endpoint",
            Dimension::Upstream => "upstream",
            Dimension::Replica => "replica",
            Dimension::Stream => "stream",
            Dimension::Engine => "engine",
            Dimension::KvUsageBand => "kv_band",
            Dimension::GpuBand => "gpu_band",
            Dimension::BlockerLine => "blocker_line",
            Dimension::BlockerCaller => "blocker_caller",
        }
    }

    /// The `llm_inference_log` column behind the dimension (same name in every store).
    pub fn column(self) -> &'static str {
        match self {
            Dimension::Model => "model",
            Dimension::InputBucket => "input_bucket",
            Dimension::User => "user_id",
            Dimension::Tenant => "tenant",
            Dimension::BusinessLine => "business_line",
            Dimension::RequestType => "request_type",
            Dimension::Status => "outcome",
            Dimension::Endpoint => "endpoint",
            Dimension::Upstream => "upstream",
            Dimension::Replica => "replica",
            Dimension::Stream => "stream",
            Dimension::Engine => "engine",
            Dimension::KvUsageBand => "engine_kv_usage",
            Dimension::GpuBand => "gpu_utilization",
            Dimension::BlockerLine => "blocker_business_line",
            Dimension::BlockerCaller => "blocker_caller",
        }
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Dimension {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl FromStr for Dimension {
    type Err = InvalidQuery;

    /// Accepts the [`Dimension::as_str`] names (case-insensitive, `-` or `_`), plus the column
    /// names `user_id`, `outcome`, `engine_kv_usage` and `gpu_utilization`, and
    /// `kv_usage_band`, `kv_usage`, `gpu_util`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        let alias = match norm.as_str() {
            "user_id" => Some(Dimension::User),
            "outcome" => Some(Dimension::Status),
            "engine_kv_usage" | "kv_usage_band" | "kv_usage" => Some(Dimension::KvUsageBand),
            "gpu_utilization" | "gpu_util" => Some(Dimension::GpuBand),
            "blocker_business_line" => Some(Dimension::BlockerLine),
            _ => None,
        };
        alias
            .or_else(|| Dimension::ALL.into_iter().find(|d| d.as_str() == norm))
            .ok_or_else(|| {
                InvalidQuery(format!(
                    "unknown dimension {s:?}; expected one of {}",
                    Dimension::ALL.map(Dimension::as_str).join(", ")
                ))
            })
    }
}

/// Output format of a report or an analysis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Format {
    /// Human-readable table (default).
    #[default]
    Table,
    /// JSON.
    Json,
    /// CSV with one header row.
    Csv,
}

impl Format {
    /// The format's name (`table`, `json`, `csv`).
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Table => "table",
            Format::Json => "json",
            Format::Csv => "csv",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Format {
    type Err = InvalidQuery;

    /// `table`, `json` or `csv` (case-insensitive, surrounding blanks ignored).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "table" => Ok(Format::Table),
            "json" => Ok(Format::Json),
            "csv" => Ok(Format::Csv),
            other => Err(InvalidQuery(format!(
                "unknown format {other:?}; expected table, json or csv"
            ))),
        }
    }
}

/// The fixed-point units an order-independent sum adds per value: `⌊x·2³² + ½⌋` (a float
/// holding an integer; ~2·10⁻¹⁰ of the unit). IEEE operations a SQL engine reproduces bit for
/// bit (ClickHouse's `floor(x * 4294967296 + 0.5)`), so sums of these units — and the means
/// and totals made from them — are the same on every store and in any row order.
pub fn exact_sum_units(x: f64) -> f64 {
    (x * 4_294_967_296.0 + 0.5).floor()
}

/// The 1-based nearest rank `k = ⌈q·n⌉` (at least 1, at most `n`) of quantile `q ∈ [0, 1]`
/// among `n` values (see the module docs). `q` is taken in millionths, so `q·n` is exact.
pub fn nearest_rank_index(n: usize, q: f64) -> usize {
    let q_ppm = (q.clamp(0.0, 1.0) * 1e6).round() as u128;
    let k = (q_ppm * n as u128).div_ceil(1_000_000);
    (k as usize).clamp(1, n.max(1))
}

/// Exact nearest-rank percentile of `sorted` (ascending): `x_k` with
/// `k =` [`nearest_rank_index`]`(n, q)`; `None` for an empty slice.
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    sorted.get(nearest_rank_index(sorted.len(), q) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_definition() {
        assert_eq!(nearest_rank_index(4, 0.5), 2);
        assert_eq!(nearest_rank_index(100, 0.99), 99);
        assert_eq!(nearest_rank_index(101, 0.99), 100);
        assert_eq!(nearest_rank_index(1, 0.99), 1);
        assert_eq!(nearest_rank_index(10, 0.9), 9);
        assert_eq!(nearest_rank_index(20, 0.95), 19);
        assert_eq!(nearest_rank_index(3, 0.0), 1);
        assert_eq!(nearest_rank_index(0, 0.5), 1);
        assert_eq!(nearest_rank_index(7, 1.5), 7);
    }

    #[test]
    fn percentile_of_sorted_values() {
        let h: Vec<u64> = (1..=100).collect();
        let got: Vec<Option<u64>> = [0.0, 0.5, 0.9, 0.99, 1.0]
            .iter()
            .map(|q| nearest_rank(&h, *q))
            .collect();
        assert_eq!(got, [Some(1), Some(50), Some(90), Some(99), Some(100)]);
        assert_eq!(nearest_rank::<u64>(&[], 0.5), None);
    }

    #[test]
    fn window_arithmetic() {
        let w = Window::new(10_000_000, 70_000_000);
        assert_eq!(w.seconds(), 60.0);
        assert_eq!(w.previous(), Window::new(-50_000_000, 10_000_000));
        assert!(w.contains(10_000_000) && !w.contains(70_000_000));
        assert_eq!(Window::new(5, 5).seconds(), 1e-6);
    }

    #[test]
    fn dimension_names_and_aliases() {
        for d in Dimension::ALL {
            assert_eq!(d.as_str().parse::<Dimension>(), Ok(d));
            assert_eq!(
                serde_json::to_value(d).expect("json"),
                serde_json::json!(d.as_str())
            );
        }
        assert_eq!("user_id".parse(), Ok(Dimension::User));
        assert_eq!("Business-Line".parse(), Ok(Dimension::BusinessLine));
        assert_eq!("outcome".parse(), Ok(Dimension::Status));
        assert_eq!("kv_usage".parse(), Ok(Dimension::KvUsageBand));
        assert_eq!("gpu_util".parse(), Ok(Dimension::GpuBand));
        let err = "colour".parse::<Dimension>().expect_err("unknown");
        assert!(err
            .to_string()
            .starts_with("invalid report query: unknown dimension \"colour\""));
    }

    #[test]
    fn format_names() {
        assert_eq!("JSON".parse(), Ok(Format::Json));
        assert_eq!(" csv ".parse(), Ok(Format::Csv));
        assert_eq!("table".parse(), Ok(Format::Table));
        assert_eq!(
            "xml".parse::<Format>().expect_err("xml").to_string(),
            "invalid report query: unknown format \"xml\"; expected table, json or csv"
        );
        assert_eq!(Format::Csv.to_string(), "csv");
    }

    #[cfg(feature = "clap")]
    #[test]
    fn clap_value_names_match_from_str() {
        use clap::ValueEnum;
        for d in Dimension::value_variants() {
            let name = d
                .to_possible_value()
                .map(|p| p.get_name().to_owned())
                .unwrap_or_default();
            assert_eq!(name, d.as_str());
            assert_eq!(<Dimension as ValueEnum>::from_str(&name, false), Ok(*d));
        }
        assert_eq!(
            <Dimension as ValueEnum>::from_str("user_id", false),
            Ok(Dimension::User)
        );
        for f in Format::value_variants() {
            let name = f
                .to_possible_value()
                .map(|p| p.get_name().to_owned())
                .unwrap_or_default();
            assert_eq!(name, f.as_str());
        }
    }
}
