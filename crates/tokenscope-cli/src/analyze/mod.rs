//! The analysis commands (`cost`, `budget`, `anomalies`, `waste`, `diagnose`, `capacity`,
//! `export prometheus-rules`): load the records of a window from the embedded store or
//! ClickHouse (same rows, same order on both), run a pure analysis from
//! `tokenscope-analysis`, print a table, JSON or CSV.

pub mod anomalies;
pub mod budget;
pub mod capacity;
pub mod cost;
pub mod diagnose;
pub mod grafana;
pub mod rules;
pub mod waste;

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use tokenscope_analysis::{Format, PriceTable, Window};
use tokenscope_backend::{open_reader, StoreTarget};
use tokenscope_config::GatewayConfig;
use tokenscope_core::RequestRecord;

/// Options every analysis command takes.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Store: path of the SQLite file, or `clickhouse://[user:pass@]host:8123/database`
    /// (same answers on both for the same records).
    #[arg(long, env = "TOKENSCOPE_STORE", default_value = "./tokenscope.db")]
    pub store: String,
    /// Window start: a duration before now (e.g. 15m, 1h, 7d) or `@UNIX_SECONDS`.
    #[arg(long, default_value = "1h")]
    pub since: String,
    /// Window end, like --since (default: now).
    #[arg(long)]
    pub until: Option<String>,
    /// Output format (csv: the report's main table; json: the whole report).
    #[arg(long, value_enum, default_value_t)]
    pub format: tokenscope_core::Format,
    /// The gateway's TOML configuration (prices, budgets, SLOs are read from it).
    #[arg(long, env = "TOKENSCOPE_CONFIG")]
    pub config: Option<PathBuf>,
}

/// What a command works on: the window, its records, the configuration.
pub struct Input {
    /// The analysed window.
    pub window: Window,
    /// "Now" for projections (the window end).
    pub now_us: i64,
    /// Records in the window, by `created_at`, `request_id`.
    pub records: Vec<RequestRecord>,
    /// The configuration (defaults when no file is given).
    pub config: GatewayConfig,
    /// Output format.
    pub format: Format,
    /// The store argument, to load other windows (e.g. the previous one).
    pub store: String,
}

impl Input {
    /// Loads the window of `args` (and the config) and its records.
    pub fn load(args: &CommonArgs) -> Result<Self> {
        let mut input = Self::open(args)?;
        input.records = load_records(&args.store, input.window)?;
        Ok(input)
    }

    /// The window of `args` and the config, without loading any record (for the commands
    /// the store answers itself, e.g. `cost`).
    pub fn open(args: &CommonArgs) -> Result<Self> {
        let now = crate::now_us();
        let since_us = crate::time_arg(&args.since, now).context("--since")?;
        let until_us = match &args.until {
            Some(u) => crate::time_arg(u, now).context("--until")?,
            None => now,
        };
        if until_us <= since_us {
            bail!("the window is empty: --until must be after --since");
        }
        let window = Window { since_us, until_us };
        let config = GatewayConfig::load(args.config.as_deref())?;
        let format: Format = args.format;
        Ok(Self {
            window,
            now_us: until_us,
            records: Vec::new(),
            config,
            format,
            store: args.store.clone(),
        })
    }

    /// The price table from the configuration.
    pub fn prices(&self) -> PriceTable {
        PriceTable::new(self.config.prices.clone())
    }

    /// Records of another window from the same store.
    pub fn load_window(&self, window: Window) -> Result<Vec<RequestRecord>> {
        load_records(&self.store, window)
    }
}

/// The store named by `store` (a SQLite path or a `clickhouse://` URL), for reading.
pub fn reader(store: &str) -> Result<Box<dyn tokenscope_store::RecordReader>> {
    Ok(open_reader(&StoreTarget::parse(store))?)
}

/// Every record of `window` from the store named by `store` (a SQLite path or a
/// `clickhouse://` URL), ordered by `created_at`, `request_id`.
pub fn load_records(store: &str, window: Window) -> Result<Vec<RequestRecord>> {
    let reader = open_reader(&StoreTarget::parse(store))?;
    Ok(reader.records_between(window)?)
}
