//! Closed sets of flag values as clap value enums, so `--help` lists the allowed values and a
//! bad value is refused by clap (exit status 2, the allowed values in the message) before any
//! work starts.
//!
//! Invariants:
//! * The accepted spellings are those the commands accepted as free text before: the names
//!   below, case-insensitive where they were, `-` for `_` in report dimensions, and the old
//!   aliases (`user_id`, `outcome`, `uniform`, …) kept as hidden aliases.
//! * These enums are the CLI's own vocabulary; each converts into the library type at the
//!   boundary (`From`). The read side's shared vocabulary — `--format` (`Format`) and the
//!   report's dimensions (`Dimension`) — is `tokenscope_core::query`'s, whose `clap` feature
//!   derives the value enums, so those sets are defined once.

use clap::ValueEnum;

/// `bench --format`: the table, or the JSON array `capacity --from-bench` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BenchFormat {
    /// A table for people.
    #[default]
    Table,
    /// The levels as a JSON array.
    Json,
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
    use tokenscope_core::Dimension;

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
            ("INPUT-BUCKET", Dimension::InputBucket),
            ("user_id", Dimension::User),
            ("outcome", Dimension::Status),
            ("kv_usage", Dimension::KvUsageBand),
            ("gpu_util", Dimension::GpuBand),
        ] {
            // `report --by` parses core's value enum case-insensitively.
            assert_eq!(Dimension::from_str(s, true), Ok(want), "{s}");
        }
        assert_eq!(
            CostDimension::from_str("user_id", false),
            Ok(CostDimension::User)
        );
    }
}
