//! Closed sets of flag values as clap value enums, so `--help` lists the allowed values and a
//! bad value is refused by clap (exit status 2, the allowed values in the message) before any
//! work starts.
//!
//! Invariants:
//! * The accepted spellings are those the commands accepted as free text before: the names
//!   below, case-insensitive where they were, `-` for `_` in report dimensions, and the old
//!   aliases (`user_id`, `outcome`, `uniform`, …) kept as hidden aliases.
//! * These enums are the CLI's vocabulary only; each converts into the library type at the
//!   boundary (`From`), so the libraries never see clap.

use clap::ValueEnum;

/// `--format` of `report` and of the analysis commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum OutputFormat {
    /// A table for people (fits the terminal; units in the headers).
    #[default]
    Table,
    /// JSON for machines (the full report).
    Json,
    /// CSV: one header row, then the report's main rows.
    Csv,
}

impl From<OutputFormat> for tokenscope_analysis::Format {
    fn from(f: OutputFormat) -> Self {
        match f {
            OutputFormat::Table => Self::Table,
            OutputFormat::Json => Self::Json,
            OutputFormat::Csv => Self::Csv,
        }
    }
}

impl From<OutputFormat> for tokenscope_store::Format {
    fn from(f: OutputFormat) -> Self {
        match f {
            OutputFormat::Table => Self::Table,
            OutputFormat::Json => Self::Json,
            OutputFormat::Csv => Self::Csv,
        }
    }
}

/// `bench --format`: the table, or the JSON array `capacity --from-bench` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BenchFormat {
    /// A table for people.
    #[default]
    Table,
    /// The levels as a JSON array.
    Json,
}

/// `report --by` / `--filter` dimensions (see `tokenscope_store::Dimension`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportDimension {
    /// The model as requested.
    Model,
    /// Input-length bucket.
    #[value(name = "input_bucket", alias = "input-bucket")]
    InputBucket,
    /// The caller (`user_id`).
    #[value(alias = "user_id", alias = "user-id")]
    User,
    /// Tenant.
    Tenant,
    /// Business line.
    #[value(name = "business_line", alias = "business-line")]
    BusinessLine,
    /// Request type.
    #[value(name = "request_type", alias = "request-type")]
    RequestType,
    /// Outcome (ok, client_error, upstream_error, timeout, cancelled).
    #[value(alias = "outcome")]
    Status,
    /// Endpoint.
    Endpoint,
    /// Upstream.
    Upstream,
    /// Streamed or not.
    Stream,
    /// The engine adapter that read the response.
    Engine,
    /// KV-cache usage band at arrival.
    #[value(
        name = "kv_band",
        alias = "kv-band",
        alias = "engine_kv_usage",
        alias = "engine-kv-usage",
        alias = "kv_usage_band",
        alias = "kv-usage-band",
        alias = "kv_usage",
        alias = "kv-usage"
    )]
    KvBand,
    /// GPU utilisation band at arrival.
    #[value(
        name = "gpu_band",
        alias = "gpu-band",
        alias = "gpu_utilization",
        alias = "gpu-utilization",
        alias = "gpu_util",
        alias = "gpu-util"
    )]
    GpuBand,
}

impl From<ReportDimension> for tokenscope_store::Dimension {
    fn from(d: ReportDimension) -> Self {
        use tokenscope_store::Dimension as D;
        match d {
            ReportDimension::Model => D::Model,
            ReportDimension::InputBucket => D::InputBucket,
            ReportDimension::User => D::User,
            ReportDimension::Tenant => D::Tenant,
            ReportDimension::BusinessLine => D::BusinessLine,
            ReportDimension::RequestType => D::RequestType,
            ReportDimension::Status => D::Status,
            ReportDimension::Endpoint => D::Endpoint,
            ReportDimension::Upstream => D::Upstream,
            ReportDimension::Stream => D::Stream,
            ReportDimension::Engine => D::Engine,
            ReportDimension::KvBand => D::KvUsageBand,
            ReportDimension::GpuBand => D::GpuBand,
        }
    }
}

/// `cost --by` dimensions (see `tokenscope_analysis::cost::Dimension`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CostDimension {
    /// Business line.
    #[value(name = "business_line")]
    BusinessLine,
    /// Tenant.
    Tenant,
    /// The caller.
    #[value(alias = "user_id")]
    User,
    /// The model as requested.
    Model,
    /// Request type.
    #[value(name = "request_type")]
    RequestType,
}

impl From<CostDimension> for tokenscope_analysis::cost::Dimension {
    fn from(d: CostDimension) -> Self {
        use tokenscope_analysis::cost::Dimension as D;
        match d {
            CostDimension::BusinessLine => D::BusinessLine,
            CostDimension::Tenant => D::Tenant,
            CostDimension::User => D::User,
            CostDimension::Model => D::Model,
            CostDimension::RequestType => D::RequestType,
        }
    }
}

/// `anomalies --baseline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BaselineMode {
    /// The `--baseline-windows` windows before the analysed one.
    Prior,
    /// The analysed window's own first half.
    Window,
}

/// `serve --otlp-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "lower")]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (port 4318).
    Http,
    /// OTLP/gRPC (port 4317).
    Grpc,
}

impl OtlpProtocol {
    /// The config file's spelling (`tracing.otlp_protocol`).
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Http => "http",
            OtlpProtocol::Grpc => "grpc",
        }
    }
}

/// `--log-format` (every command; `TOKENSCOPE_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// One readable line per event; colours only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), never coloured.
    Json,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_dimensions_match_the_store_names() {
        for d in ReportDimension::value_variants() {
            let name = d.to_possible_value().map(|v| v.get_name().to_owned());
            let lib: tokenscope_store::Dimension = (*d).into();
            assert_eq!(name.as_deref(), Some(lib.as_str()));
        }
    }

    #[test]
    fn cost_dimensions_match_the_analysis_names() {
        for d in CostDimension::value_variants() {
            let name = d.to_possible_value().map(|v| v.get_name().to_owned());
            let lib: tokenscope_analysis::cost::Dimension = (*d).into();
            assert_eq!(name.as_deref(), Some(lib.as_str()));
        }
    }

    #[test]
    fn old_spellings_still_parse() {
        for (s, want) in [
            ("INPUT-BUCKET", ReportDimension::InputBucket),
            ("user_id", ReportDimension::User),
            ("outcome", ReportDimension::Status),
            ("kv_usage", ReportDimension::KvBand),
            ("gpu_util", ReportDimension::GpuBand),
        ] {
            assert_eq!(ReportDimension::from_str(s, true), Ok(want), "{s}");
        }
        assert_eq!(
            CostDimension::from_str("user_id", false),
            Ok(CostDimension::User)
        );
    }
}
