//! The cost column: every finished record gets `cost_usd` from the configured `[[prices]]`.
//!
//! * API-priced models: [`PriceTable::token_cost`] — (input − cached) × input price + cached
//!   × cached price + output × output price, per 1M tokens.
//! * Self-hosted models (`gpu_hourly_usd`): the deployment costs its hourly price whether it
//!   is busy or not, so a token costs `hourly / 3600 × window_seconds / tokens served in the
//!   window`, and a record costs that rate × its own tokens (input + output). The window is
//!   the last [`WINDOW_SECS`] seconds, counted in [`BUCKET_SECS`]-second buckets per model
//!   (this record's tokens included); shortly after start it is the time since the gateway
//!   started, at least one bucket. This is the measured-throughput method of
//!   [`PriceTable::self_hosted_rate`], evaluated online at the moment the request finished.
//! * Unpriced models: `None`.
//!
//! Cost: one short mutex section per self-hosted record (a bucket add and a sum over at most
//! 30 buckets), nothing for API-priced ones; no I/O.
//!
//! ## Budget gauge
//!
//! [`BudgetTracker`] keeps, per explicit `[[budgets]]` entry, the tokens and USD of its
//! business line in the current UTC period (the period of each record's `created_at`; a
//! record of a newer period starts it afresh, one of an older period is ignored), updated in
//! the fan-out of a finished record (`finished.rs`; one short mutex per budget of the
//! record's line), and sets `llm_budget_usage_ratio{business_line}` = the largest used/budget
//! of the line's budgets.
//! At startup the current periods are seeded from the store by a background thread
//! (usage created before the gateway started, summed by the store one UTC day at a time —
//! the gateway never loads the records; later ones arrive through that fan-out, so none is
//! counted twice). Automatic (`auto = true`) budgets: the tracker also keeps the
//! line's usage per UTC day (the seed reads the 30 days before the period too) and the budget
//! of a period is 1.2 (`auto_factor`) × the mean daily use of the 30 days before it × days in
//! the period — the method of `tokenscope budget`. The seed reads the embedded store or
//! ClickHouse alike. Not done: a period rollover without traffic (the gauge keeps the last
//! period's value until the next request of the line).

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_analysis::budget::BudgetConfig;
use tokenscope_analysis::PriceTable;
use tokenscope_core::RequestRecord;
use tokenscope_telemetry::Metrics;

/// Bucket width of the throughput counter, seconds.
pub const BUCKET_SECS: u64 = 10;
/// Throughput window for self-hosted prices, seconds.
pub const WINDOW_SECS: u64 = 300;

/// Tokens a model served, per [`BUCKET_SECS`] bucket, over the last [`WINDOW_SECS`].
#[derive(Debug, Default)]
struct Rolling {
    /// `(bucket index since start, tokens)`, oldest first.
    buckets: VecDeque<(u64, u64)>,
}

impl Rolling {
    /// Adds `tokens` at bucket `b` and returns the tokens in the window ending at `b`.
    fn add(&mut self, b: u64, tokens: u64) -> u64 {
        let n = WINDOW_SECS / BUCKET_SECS;
        while self.buckets.front().is_some_and(|(old, _)| old + n <= b) {
            self.buckets.pop_front();
        }
        match self.buckets.back_mut() {
            Some((last, t)) if *last == b => *t += tokens,
            _ => self.buckets.push_back((b, tokens)),
        }
        self.buckets.iter().map(|(_, t)| t).sum()
    }
}

/// Prices records as they finish.
#[derive(Debug)]
pub struct CostMeter {
    prices: PriceTable,
    start: Instant,
    served: Mutex<HashMap<String, Rolling>>,
}

impl CostMeter {
    /// A meter over `prices`, its clock starting now.
    pub fn new(prices: PriceTable) -> Self {
        Self::starting_at(prices, Instant::now())
    }

    fn starting_at(prices: PriceTable, start: Instant) -> Self {
        Self {
            prices,
            start,
            served: Mutex::new(HashMap::new()),
        }
    }

    /// The cost of `rec` finishing at `now` (see the module docs).
    pub fn cost(&self, rec: &RequestRecord, now: Instant) -> Option<f64> {
        if let Some(c) = self.prices.token_cost(rec) {
            return Some(c);
        }
        let hourly = self.prices.find(&rec.model)?.gpu_hourly_usd?;
        let elapsed = now.saturating_duration_since(self.start);
        let tokens = tokenscope_analysis::total_tokens(rec);
        let b = elapsed.as_secs() / BUCKET_SECS;
        let in_window = self
            .served
            .lock()
            .entry(rec.model.clone())
            .or_default()
            .add(b, tokens);
        if in_window == 0 {
            return Some(0.0);
        }
        let window_s = elapsed
            .min(Duration::from_secs(WINDOW_SECS))
            .max(Duration::from_secs(BUCKET_SECS))
            .as_secs_f64();
        Some(hourly / 3600.0 * window_s / in_window as f64 * tokens as f64)
    }
}

/// Usage of one budget's current period.
#[derive(Debug, Default, Clone, Copy)]
struct PeriodUsage {
    start_us: i64,
    tokens: u64,
    usd: f64,
}

const DAY_US: i64 = 86_400_000_000;

/// The fleet's usage of a budget's period as the store summed it (`[fleet]`): every
/// replica's records created in `[start_us, as_of_us)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetUsage {
    /// The period's start.
    pub start_us: i64,
    /// The end of what the store summed (a whole second).
    pub as_of_us: i64,
    /// Tokens.
    pub tokens: u64,
    /// USD.
    pub usd: f64,
}

/// A tracked budget's fleet view (see [`Tracked::fleet`]).
#[derive(Debug, Default)]
struct FleetState {
    /// The store's last sum.
    snap: Option<FleetUsage>,
    /// This replica's usage per second of `created_at` (recorded while the fleet view is
    /// on; kept from the last sum's end, at most [`OWN_KEEP_US`] without a sum).
    own: std::collections::BTreeMap<i64, (u64, f64)>,
}

/// How long this replica's own per-second usage is kept before any fleet sum arrives.
const OWN_KEEP_US: i64 = 3_600_000_000;

#[derive(Debug)]
struct Tracked {
    cfg: BudgetConfig,
    usage: Mutex<PeriodUsage>,
    /// With `[fleet]`: the store's last sum of the period, and this gateway's own usage per
    /// second of `created_at` since it (so the gauge is the fleet's sum plus what this
    /// replica added after it; pruned at each new sum).
    fleet: Mutex<FleetState>,
    /// Automatic budgets: tokens and USD of the line per UTC day (day index), the last
    /// `BASELINE_DAYS` + 31 days, for the baseline of the current period.
    daily: Option<Mutex<std::collections::BTreeMap<i64, (u64, f64)>>>,
}

impl Tracked {
    /// `(tokens, usd)` budget of the current period: explicit, or for `auto` the factor ×
    /// mean daily use over the `BASELINE_DAYS` days before the period start × days in the
    /// period (the method of `tokenscope budget`); a zero baseline gives no budget.
    fn budget(&self, period_start_us: i64) -> (Option<f64>, Option<f64>) {
        let Some(daily) = &self.daily else {
            return (self.cfg.tokens.map(|t| t as f64), self.cfg.usd);
        };
        let days_in_period = {
            let (start, end) = self.cfg.period.bounds(period_start_us);
            ((end - start) / DAY_US) as f64
        };
        let first = period_start_us.div_euclid(DAY_US);
        let base = tokenscope_analysis::budget::BASELINE_DAYS;
        let (tok, usd) = daily
            .lock()
            .range(first - base..first)
            .fold((0u64, 0.0), |(t, u), (_, (dt, du))| (t + dt, u + du));
        let factor = self.cfg.auto_factor.unwrap_or(1.2);
        let per_day = |v: f64| factor * v / base as f64 * days_in_period;
        (
            Some(per_day(tok as f64)).filter(|v| *v > 0.0),
            Some(per_day(usd)).filter(|v| *v > 0.0),
        )
    }

    fn ratio(&self) -> f64 {
        let mut u = *self.usage.lock();
        let g = self.fleet.lock();
        if let Some(f) = &g.snap {
            if f.start_us == u.start_us {
                let (t, d) = g
                    .own
                    .range(f.as_of_us.div_euclid(1_000_000)..)
                    .fold((0u64, 0.0), |(t, d), (_, (dt, dd))| (t + dt, d + dd));
                u.tokens = f.tokens + t;
                u.usd = f.usd + d;
            }
        }
        let (bt, bu) = self.budget(u.start_us);
        let t = bt.map(|b| u.tokens as f64 / b);
        let d = bu.map(|b| u.usd / b);
        t.unwrap_or(0.0).max(d.unwrap_or(0.0))
    }
}

/// Per-business-line usage of the current budget period and the ratio gauge (module docs).
pub struct BudgetTracker {
    tracked: Vec<Tracked>,
    metrics: Option<Arc<Metrics>>,
    /// Whether the fleet view is on (`[fleet]`): own usage is then kept per second.
    fleet_on: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for BudgetTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetTracker")
            .field("tracked", &self.tracked)
            .finish_non_exhaustive()
    }
}

impl BudgetTracker {
    /// Tracks the budgets of `budgets` (explicit ones, and automatic ones from the daily
    /// usage the tracker sees — seeded from the store's last 30 days); every tracked line's
    /// gauge starts at 0.
    pub fn new(budgets: &[BudgetConfig], metrics: Option<Arc<Metrics>>) -> Self {
        let tracked: Vec<Tracked> = budgets
            .iter()
            .filter(|b| b.auto || b.tokens.is_some() || b.usd.is_some())
            .map(|b| Tracked {
                cfg: b.clone(),
                usage: Mutex::new(PeriodUsage::default()),
                fleet: Mutex::new(FleetState::default()),
                daily: b
                    .auto
                    .then(|| Mutex::new(std::collections::BTreeMap::new())),
            })
            .collect();
        if let Some(m) = &metrics {
            for t in &tracked {
                m.set_budget_usage_ratio(&t.cfg.business_line, 0.0);
            }
        }
        Self {
            tracked,
            metrics,
            fleet_on: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Turns the fleet view on (before the first record): from now on this replica's usage is
    /// also kept per second, for [`set_fleet`](Self::set_fleet).
    pub fn enable_fleet(&self) {
        self.fleet_on
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether any budget is tracked.
    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    /// `[earliest current period start (minus the 30 baseline days for automatic budgets),
    /// now)`: what a seed must read.
    pub fn seed_window(&self, now_us: i64) -> Option<(i64, i64)> {
        self.tracked
            .iter()
            .map(|t| {
                let start = t.cfg.period.bounds(now_us).0;
                if t.daily.is_some() {
                    start - tokenscope_analysis::budget::BASELINE_DAYS * DAY_US
                } else {
                    start
                }
            })
            .min()
            .map(|s| (s, now_us))
    }

    /// Adds a finished record (`cost_usd` already set) and updates its line's gauge.
    pub fn add(&self, rec: &RequestRecord) {
        let Some(line) = rec.business_line.as_deref() else {
            return;
        };
        self.add_usage(
            line,
            rec.created_at,
            tokenscope_analysis::total_tokens(rec),
            rec.cost_usd.unwrap_or(0.0),
        );
    }

    /// Adds `tokens` and `usd` of `line` used at `created_at` (a record, or a store's sum of a
    /// day or period placed at its start) and updates the line's gauge.
    pub fn add_usage(&self, line: &str, created_at: i64, tokens: u64, usd: f64) {
        let mut touched = false;
        for t in self.tracked.iter().filter(|t| t.cfg.business_line == line) {
            if let Some(daily) = &t.daily {
                let day = created_at.div_euclid(DAY_US);
                let mut d = daily.lock();
                let e = d.entry(day).or_insert((0, 0.0));
                e.0 += tokens;
                e.1 += usd;
                // Keep what the baseline of the current or next period can need.
                let keep_from = day - tokenscope_analysis::budget::BASELINE_DAYS - 31;
                while d.first_key_value().is_some_and(|(k, _)| *k < keep_from) {
                    d.pop_first();
                }
            }
            let (start, _) = t.cfg.period.bounds(created_at);
            let mut u = t.usage.lock();
            if start > u.start_us {
                *u = PeriodUsage {
                    start_us: start,
                    ..PeriodUsage::default()
                };
            }
            if start == u.start_us {
                u.tokens += tokens;
                u.usd += usd;
                touched = true;
                drop(u);
                if self.fleet_on.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut g = t.fleet.lock();
                    let keep_from = match &g.snap {
                        Some(f) => f.as_of_us,
                        None => created_at - OWN_KEEP_US,
                    }
                    .div_euclid(1_000_000);
                    if created_at.div_euclid(1_000_000) >= keep_from {
                        let e = g
                            .own
                            .entry(created_at.div_euclid(1_000_000))
                            .or_insert((0, 0.0));
                        e.0 += tokens;
                        e.1 += usd;
                    }
                    while g.own.first_key_value().is_some_and(|(k, _)| *k < keep_from) {
                        g.own.pop_first();
                    }
                }
            }
        }
        if touched {
            self.publish(line);
        }
    }

    /// The explicit (not automatic) budgets' current period starts at `now_us`, each once:
    /// what the fleet refresh sums in the store.
    pub fn fleet_periods(&self, now_us: i64) -> Vec<i64> {
        let mut v: Vec<i64> = self
            .tracked
            .iter()
            .filter(|t| t.daily.is_none())
            .map(|t| t.cfg.period.bounds(now_us).0)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Installs the store's sum of the fleet's usage of `line` for the period starting at
    /// `f.start_us` (the explicit budgets whose period at `now_us` starts there) and
    /// republishes the gauge. From
    /// now on the line's usage is that sum plus this replica's records created at or after
    /// `f.as_of_us`. A sum for an older period than the tracked one is ignored; one for a
    /// newer period starts it.
    pub fn set_fleet(&self, line: &str, f: FleetUsage, now_us: i64) {
        let mut touched = false;
        for t in self
            .tracked
            .iter()
            .filter(|t| t.cfg.business_line == line && t.daily.is_none())
        {
            // Only the budgets whose current period the sum is of (a daily and a monthly
            // budget of one line have different periods, though a month starts on a day).
            if t.cfg.period.bounds(now_us).0 != f.start_us {
                continue;
            }
            {
                let mut u = t.usage.lock();
                if f.start_us > u.start_us {
                    *u = PeriodUsage {
                        start_us: f.start_us,
                        ..PeriodUsage::default()
                    };
                }
                if f.start_us < u.start_us {
                    continue;
                }
            }
            let mut g = t.fleet.lock();
            let keep_from = f.as_of_us.div_euclid(1_000_000);
            g.own.retain(|sec, _| *sec >= keep_from);
            g.snap = Some(f);
            touched = true;
        }
        if touched {
            self.publish(line);
        }
    }

    /// The business lines with a tracked budget.
    pub fn lines(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .tracked
            .iter()
            .map(|t| t.cfg.business_line.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The gauge value of `line` (largest ratio of its budgets).
    pub fn ratio(&self, line: &str) -> f64 {
        self.tracked
            .iter()
            .filter(|t| t.cfg.business_line == line)
            .map(Tracked::ratio)
            .fold(0.0, f64::max)
    }

    fn publish(&self, line: &str) {
        if let Some(m) = &self.metrics {
            m.set_budget_usage_ratio(line, self.ratio(line));
        }
    }
}

/// Tokens and USD per business line of the records created in `[since, until)`, summed by
/// the store (`RecordReader::usage`); rows without a stored cost are priced at the API prices
/// of `prices` (the seed's rule). Used by the start-up seed and the fleet refresh.
pub(crate) fn line_usage(
    reader: &dyn tokenscope_store::RecordReader,
    since: i64,
    until: i64,
    prices: &PriceTable,
) -> Result<HashMap<String, (u64, f64)>, String> {
    let rows = reader
        .usage(&tokenscope_core::usage::UsageQuery::new(
            tokenscope_core::query::Window::new(since, until),
            vec![tokenscope_core::query::Dimension::BusinessLine],
        ))
        .map_err(|e| e.to_string())?;
    let mut per_line: HashMap<String, (u64, f64)> = HashMap::new();
    for row in &rows {
        let Some(line) = row.labels.first().cloned().flatten() else {
            continue;
        };
        let s = &row.sums;
        let e = per_line.entry(line).or_insert((0, 0.0));
        e.0 += s.input_tokens.saturating_add(s.output_tokens);
        e.1 += s.stored_cost_usd() + prices.token_cost_of_sums(&row.model, s).unwrap_or(0.0);
    }
    Ok(per_line)
}

/// Sums `[since, until)` day by day in the store and adds each day's usage per line to the
/// tracker (at the day's start, or `since` for a partial first day). Returns the days read.
fn seed_days(
    tracker: &BudgetTracker,
    target: &crate::StoreTarget,
    prices: &PriceTable,
    since: i64,
    until: i64,
) -> Result<usize, String> {
    let reader = tokenscope_backend::open_reader(target).map_err(|e| e.detail())?;
    let mut days = 0;
    let mut lo = since;
    while lo < until {
        let hi = ((lo.div_euclid(DAY_US) + 1) * DAY_US).min(until);
        let per_line = line_usage(reader.as_ref(), lo, hi, prices)?;
        for (line, (tokens, usd)) in per_line {
            tracker.add_usage(&line, lo, tokens, usd);
        }
        days += 1;
        lo = hi;
    }
    Ok(days)
}

/// Seeds `tracker` from the store (embedded or ClickHouse) in a background thread: the usage
/// of the current periods (and the baseline days of automatic budgets) created before
/// `now_us` (the gateway's start), one UTC day at a time, summed by the store
/// (`RecordReader::usage`: per business line and model; the gateway holds one row per group,
/// never the records). Records without `cost_usd` (written before the cost column) are priced
/// with the API prices of `prices`. A store that cannot be read leaves the usage counted from
/// the start on (logged).
pub fn seed_from_store(
    tracker: Arc<BudgetTracker>,
    target: crate::StoreTarget,
    prices: PriceTable,
    now_us: i64,
) {
    let Some((since, until)) = tracker.seed_window(now_us) else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("tokenscope-budget-seed".into())
        .spawn(move || {
            match seed_days(&tracker, &target, &prices, since, until) {
                Ok(days) => tracing::info!(store = %target.display(), days, "budget usage seeded from the store"),
                Err(e) => tracing::warn!(
                    store = %target.display(),
                    error = %e,
                    "budget usage: seeding from the store failed; counted from this start on"
                ),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "budget usage: could not start the seed thread");
    }
}

/// Bounds of the business-metric sidecar (`[admin] business_metrics_max_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusinessMetricsLimits {
    /// Largest file size; an append that would pass it is refused whole.
    pub max_bytes: u64,
    /// Distinct business lines in the file; a value for a new line past it is refused.
    pub max_lines: usize,
}

impl Default for BusinessMetricsLimits {
    fn default() -> Self {
        let a = crate::auth::AdminSection::default();
        Self {
            max_bytes: a.business_metrics_max_bytes,
            max_lines: a.business_metrics_max_lines,
        }
    }
}

/// Why an append was refused.
#[derive(Debug, thiserror::Error)]
pub enum BusinessMetricsError {
    /// The file would pass `max_bytes`.
    #[error("the business-metrics file holds {bytes} bytes; {adding} more would pass the cap of {max_bytes} bytes ([admin] business_metrics_max_bytes)")]
    Full {
        /// Current size.
        bytes: u64,
        /// Size of the refused values.
        adding: u64,
        /// The cap.
        max_bytes: u64,
    },
    /// A new business line past `max_lines`.
    #[error("the business-metrics file already holds {max_lines} distinct business lines; {line:?} would be one more ([admin] business_metrics_max_lines)")]
    TooManyLines {
        /// The first new line refused (≤ 128 bytes, validated).
        line: String,
        /// The cap.
        max_lines: usize,
    },
    /// Reading or writing the file failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Appends business-metric points (one JSON object per line) to the sidecar file; one writer
/// at a time. Called from the admin API on a blocking thread, never on the request path.
///
/// Invariant: the file never grows past `max_bytes` nor holds more than `max_lines` distinct
/// business lines through this writer; an append is taken whole or refused whole. The size
/// is read from the file at each append (an operator may rotate it); the distinct lines are
/// read from it on the first append and again after it shrank.
#[derive(Debug)]
pub struct BusinessMetricsFile {
    path: std::path::PathBuf,
    limits: BusinessMetricsLimits,
    /// Distinct business lines in the file and the size they were read at (`None` until the
    /// first append).
    lines: Mutex<Option<(u64, std::collections::HashSet<String>)>>,
}

impl BusinessMetricsFile {
    /// The sidecar at `path` (created on the first append) with the default limits.
    pub fn new(path: std::path::PathBuf) -> Self {
        Self::with_limits(path, BusinessMetricsLimits::default())
    }

    /// The sidecar at `path` with `limits`.
    pub fn with_limits(path: std::path::PathBuf, limits: BusinessMetricsLimits) -> Self {
        Self {
            path,
            limits,
            lines: Mutex::new(None),
        }
    }

    /// Its path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn read_lines(&self) -> std::io::Result<std::collections::HashSet<String>> {
        #[derive(serde::Deserialize)]
        struct Line {
            business_line: String,
        }
        let text = match std::fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        Ok(text
            .split(|b| *b == b'\n')
            .filter_map(|l| serde_json::from_slice::<Line>(l).ok())
            .map(|l| l.business_line)
            .collect())
    }

    /// Appends `points` (already validated), or refuses them all past a limit.
    pub fn append(
        &self,
        points: &[tokenscope_analysis::budget::BusinessMetricPoint],
    ) -> Result<(), BusinessMetricsError> {
        use std::io::Write;
        let mut buf = Vec::new();
        for p in points {
            serde_json::to_writer(&mut buf, p).map_err(std::io::Error::from)?;
            buf.push(b'\n');
        }
        let mut g = self.lines.lock();
        let bytes = match std::fs::metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e.into()),
        };
        if g.as_ref().is_none_or(|(at, _)| bytes < *at) {
            *g = Some((bytes, self.read_lines()?));
        }
        let adding = buf.len() as u64;
        if bytes.saturating_add(adding) > self.limits.max_bytes {
            return Err(BusinessMetricsError::Full {
                bytes,
                adding,
                max_bytes: self.limits.max_bytes,
            });
        }
        let Some((at, known)) = g.as_mut() else {
            return Err(std::io::Error::other("business lines not loaded").into());
        };
        let mut new_lines: Vec<&str> = points
            .iter()
            .map(|p| p.business_line.as_str())
            .filter(|l| !known.contains(*l))
            .collect();
        new_lines.sort_unstable();
        new_lines.dedup();
        if known.len() + new_lines.len() > self.limits.max_lines {
            let line = new_lines
                .get(self.limits.max_lines.saturating_sub(known.len()))
                .or(new_lines.first())
                .map_or_else(String::new, |l| (*l).to_owned());
            return Err(BusinessMetricsError::TooManyLines {
                line,
                max_lines: self.limits.max_lines,
            });
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        f.write_all(&buf)?;
        f.flush()?;
        for l in new_lines {
            known.insert(l.to_owned());
        }
        *at = bytes + adding;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_analysis::ModelPrice;

    #[test]
    fn business_metrics_file_is_bounded_and_notices_rotation() {
        use tokenscope_analysis::budget::BusinessMetricPoint;
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("bm.jsonl");
        let f = BusinessMetricsFile::with_limits(
            path.clone(),
            BusinessMetricsLimits {
                max_bytes: 400,
                max_lines: 2,
            },
        );
        let pt = |line: &str| BusinessMetricPoint {
            business_line: line.into(),
            at_us: 1,
            value: 1.0,
        };
        f.append(&[pt("a"), pt("b")]).expect("two lines");
        assert!(matches!(
            f.append(&[pt("a"), pt("c")]),
            Err(BusinessMetricsError::TooManyLines { max_lines: 2, .. })
        ));
        let size = std::fs::metadata(&path).expect("file").len();
        let mut full = false;
        for _ in 0..100 {
            match f.append(&[pt("a")]) {
                Ok(()) => {}
                Err(BusinessMetricsError::Full { max_bytes: 400, .. }) => {
                    full = true;
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(full);
        let len = std::fs::metadata(&path).expect("file").len();
        assert!(len > size && len <= 400, "{len}");
        // The operator rotates the file: room and lines are counted afresh.
        std::fs::remove_file(&path).expect("rotate");
        f.append(&[pt("c"), pt("d")]).expect("after rotation");
        let text = std::fs::read_to_string(&path).expect("file");
        assert_eq!(text.lines().count(), 2, "{text}");
    }

    fn rec(model: &str, input: u64, output: u64) -> RequestRecord {
        RequestRecord {
            model: model.into(),
            input_tokens: Some(input),
            output_tokens: Some(output),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn api_self_hosted_and_unpriced() {
        let start = Instant::now();
        let m = CostMeter::starting_at(
            PriceTable::new(vec![
                ModelPrice {
                    model: "api".into(),
                    input_per_mtok: 1.0,
                    output_per_mtok: 2.0,
                    ..ModelPrice::default()
                },
                ModelPrice {
                    model: "gpu".into(),
                    gpu_hourly_usd: Some(36.0),
                    ..ModelPrice::default()
                },
            ]),
            start,
        );
        let c = m.cost(&rec("api", 1_000, 500), start).expect("priced");
        assert!((c - 0.002).abs() < 1e-12);
        assert_eq!(m.cost(&rec("other", 1, 1), start), None);
        // $36/h = $0.01/s. At 400 s: window 300 s = $3 over the tokens of the window.
        let t = start + Duration::from_secs(400);
        let c1 = m.cost(&rec("gpu", 600, 400), t).expect("self-hosted");
        assert!((c1 - 3.0).abs() < 1e-9, "{c1}");
        let c2 = m.cost(&rec("gpu", 1_000, 1_000), t).expect("self-hosted");
        // 3 000 tokens in the window now: $3 / 3 000 × 2 000.
        assert!((c2 - 2.0).abs() < 1e-9, "{c2}");
        // 5 minutes later the old buckets left the window.
        let later = t + Duration::from_secs(WINDOW_SECS);
        let c3 = m.cost(&rec("gpu", 50, 50), later).expect("self-hosted");
        assert!((c3 - 3.0).abs() < 1e-9, "{c3}");
        // Just after start the window is the time since start (at least one bucket).
        let fresh = CostMeter::starting_at(m.prices.clone(), start);
        let c4 = fresh
            .cost(&rec("gpu", 10, 10), start + Duration::from_secs(1))
            .expect("self-hosted");
        assert!((c4 - 0.1).abs() < 1e-9, "{c4}");
    }

    #[test]
    fn fleet_usage_is_the_stores_sum_plus_own_records_since() {
        let day = 86_400_000_000i64;
        let t0 = 19_000 * day;
        let b = BudgetTracker::new(
            &[BudgetConfig {
                business_line: "s".into(),
                tokens: Some(1_000),
                ..BudgetConfig::default()
            }],
            None,
        );
        b.enable_fleet();
        assert_eq!(b.fleet_periods(t0 + 5), vec![t0]);
        let own = |at: i64, tokens: u64| {
            let mut r = rec("m", tokens, 0);
            r.business_line = Some("s".into());
            r.created_at = at;
            b.add(&r);
        };
        own(t0 + 1_000_000, 100); // second 1
        own(t0 + 3_500_000, 50); // second 3, after the store's sum below
        assert!((b.ratio("s") - 0.15).abs() < 1e-12, "own only before a sum");
        // The fleet's sum up to second 3 (it includes this replica's 100): 600 tokens.
        let f = |as_of_s: i64, tokens: u64| FleetUsage {
            start_us: t0,
            as_of_us: t0 + as_of_s * 1_000_000,
            tokens,
            usd: 0.0,
        };
        b.set_fleet("s", f(3, 600), t0 + 4_000_000);
        assert!((b.ratio("s") - 0.65).abs() < 1e-12, "600 + own 50 since");
        own(t0 + 4_200_000, 25);
        assert!((b.ratio("s") - 0.675).abs() < 1e-12);
        // The next sum includes them; own records before it are not counted twice.
        b.set_fleet("s", f(5, 900), t0 + 6_000_000);
        assert!((b.ratio("s") - 0.9).abs() < 1e-12);
        // A sum for another line or an old period changes nothing.
        b.set_fleet("other", f(6, 5), t0 + 6_000_000);
        b.set_fleet(
            "s",
            FleetUsage {
                start_us: t0 - day,
                ..f(6, 5)
            },
            t0 + 6_000_000,
        );
        assert!((b.ratio("s") - 0.9).abs() < 1e-12);
        // A new day: the daily budget starts again from the new period's sum.
        b.set_fleet(
            "s",
            FleetUsage {
                start_us: t0 + day,
                as_of_us: t0 + day + 1_000_000,
                tokens: 10,
                usd: 0.0,
            },
            t0 + day + 2_000_000,
        );
        assert!((b.ratio("s") - 0.01).abs() < 1e-12);
    }

    #[test]
    fn budget_tracker_periods_and_ratio() {
        use tokenscope_analysis::budget::Period;
        let day = 86_400_000_000i64;
        let t0 = 19_000 * day;
        let b = BudgetTracker::new(
            &[
                BudgetConfig {
                    business_line: "s".into(),
                    tokens: Some(1_000),
                    ..BudgetConfig::default()
                },
                BudgetConfig {
                    business_line: "s".into(),
                    period: Period::Monthly,
                    usd: Some(1.0),
                    ..BudgetConfig::default()
                },
                BudgetConfig {
                    business_line: "auto".into(),
                    auto: true,
                    ..BudgetConfig::default()
                },
            ],
            None,
        );
        let mut r = rec("m", 200, 50);
        r.business_line = Some("s".into());
        r.created_at = t0 + 5;
        r.cost_usd = Some(0.5);
        b.add(&r);
        // Daily 250/1000 = 0.25, monthly 0.5/1 = 0.5 → 0.5.
        assert!((b.ratio("s") - 0.5).abs() < 1e-12);
        r.cost_usd = None;
        b.add(&r);
        assert!((b.ratio("s") - 0.5).abs() < 1e-12);
        // The next day resets the daily budget only (same month: 19 000 days = 2022-01-08).
        r.created_at = t0 + day + 1;
        r.input_tokens = Some(850);
        r.output_tokens = Some(50);
        b.add(&r);
        assert!((b.ratio("s") - 0.9).abs() < 1e-12);
        // An older record (previous day) no longer counts for the daily budget.
        r.created_at = t0 + 1;
        b.add(&r);
        assert!((b.ratio("s") - 0.9).abs() < 1e-12);
        assert_eq!(b.ratio("auto"), 0.0, "no baseline yet: no budget");
        // The seed reads the automatic budget's 30 baseline days too.
        assert_eq!(b.seed_window(t0 + 7), Some((t0 - 30 * day, t0 + 7)));
    }

    #[test]
    fn automatic_budget_from_thirty_days_of_usage() {
        let day = 86_400_000_000i64;
        let t0 = 19_000 * day;
        let b = BudgetTracker::new(
            &[BudgetConfig {
                business_line: "auto".into(),
                auto: true,
                ..BudgetConfig::default()
            }],
            None,
        );
        // 30 days of 1 000 tokens a day (two records each), then 600 today: the budget is
        // 1.2 × 1 000 × 1 day = 1 200 tokens, the ratio 0.5. A day older than the baseline
        // does not count.
        let mut r = rec("m", 400, 100);
        r.business_line = Some("auto".into());
        for d in 1..=31 {
            for half in 0..2 {
                r.created_at = t0 - d * day + half * 1000;
                b.add(&r);
            }
        }
        r.created_at = t0 + 10;
        r.input_tokens = Some(500);
        r.output_tokens = Some(100);
        b.add(&r);
        assert!((b.ratio("auto") - 0.5).abs() < 1e-12, "{}", b.ratio("auto"));
    }
}
