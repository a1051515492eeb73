//! The numbers of the built-in dashboard: each page is built from the store's own aggregates
//! — [`RecordReader::report`] (exact percentiles, means, counts, token sums; with an interval
//! for the series), [`RecordReader::usage`] (cost and engine-state sums) and
//! [`RecordReader::slowest`] (the top 10) — so the gateway holds per-group and per-bucket
//! state only, never a window's rows (no clock here: the caller passes the window).
//!
//! Invariants:
//! * A record belongs to the window `[since, until)` by its `created_at` (request start, Unix
//!   µs), and to the time bucket `⌊created_at / step⌋` (epoch-aligned; the window's ends are
//!   whole steps, so the buckets tile it).
//! * Percentiles are exact nearest-rank over the records that have the value (the definition
//!   of `tokenscope report`, computed by the store: ClickHouse SQL or the embedded store's
//!   bounded scan); means are the report's order-independent means. A bucket or summary
//!   without a value is `null`, never 0.
//! * Rates are per second of the window (or bucket), not of the span the records happen to
//!   cover: 60 requests in a 1 h window is 0.0167 req/s.
//! * Filters (model, request type, business line) are exact matches; the options offered for
//!   each are the distinct values of the unfiltered window.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use tokenscope_core::query::{Dimension, Window};
use tokenscope_core::usage::{UsageQuery, UsageRow, UsageSums};
use tokenscope_core::{InputBucket, RequestRecord};
use tokenscope_store::{RecordReader, ReportQuery, ReportRow, StoreError};

/// A dashboard time range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Range {
    /// Last 5 minutes.
    #[serde(rename = "5m")]
    M5,
    /// Last hour.
    #[serde(rename = "1h")]
    H1,
    /// Last day.
    #[serde(rename = "24h")]
    H24,
    /// Last week.
    #[serde(rename = "7d")]
    D7,
}

impl Range {
    /// Parses `5m`, `1h`, `24h`, `7d`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "5m" => Some(Range::M5),
            "1h" => Some(Range::H1),
            "24h" => Some(Range::H24),
            "7d" => Some(Range::D7),
            _ => None,
        }
    }

    /// Length in seconds.
    pub fn seconds(self) -> i64 {
        match self {
            Range::M5 => 300,
            Range::H1 => 3_600,
            Range::H24 => 86_400,
            Range::D7 => 604_800,
        }
    }

    /// Time-series step in seconds (30 to 96 points per chart).
    pub fn step_seconds(self) -> i64 {
        match self {
            Range::M5 => 10,
            Range::H1 => 60,
            Range::H24 => 900,
            Range::D7 => 7_200,
        }
    }
}

/// Exact-match filters; `None` = all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Filters {
    /// Requested model.
    pub model: Option<String>,
    /// Request type (`chat`, `completion`, … or the caller's `x-request-type`).
    pub request_type: Option<String>,
    /// Business line.
    pub business_line: Option<String>,
}

impl Filters {
    /// The filters as the store's exact-match filters.
    pub fn to_store(&self) -> Vec<(Dimension, String)> {
        [
            (Dimension::Model, &self.model),
            (Dimension::RequestType, &self.request_type),
            (Dimension::BusinessLine, &self.business_line),
        ]
        .into_iter()
        .filter_map(|(d, v)| v.clone().map(|v| (d, v)))
        .collect()
    }
}

/// The window of one page: its span `[since_us, until_us)` and its bucket step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageWindow {
    /// The time range, Unix µs.
    pub span: Window,
    /// Bucket width, µs.
    pub step_us: i64,
}

impl PageWindow {
    /// The window of `range` ending at `until_us`. The end is aligned up to a whole step so
    /// that successive refreshes keep the same bucket boundaries.
    pub fn ending_at(range: Range, until_us: i64) -> Self {
        let step_us = range.step_seconds() * 1_000_000;
        let until_us = until_us.div_euclid(step_us) * step_us
            + if until_us.rem_euclid(step_us) == 0 {
                0
            } else {
                step_us
            };
        PageWindow {
            span: Window::new(until_us - range.seconds() * 1_000_000, until_us),
            step_us,
        }
    }

    /// The trailing `secs` seconds of this window, same step.
    fn trailing(&self, secs: i64) -> Self {
        PageWindow {
            span: Window::new(self.span.until_us - secs * 1_000_000, self.span.until_us),
            step_us: self.step_us,
        }
    }

    fn buckets(&self) -> usize {
        (self.span.len_us() / self.step_us).max(1) as usize
    }

    /// The slot of a bucket start in the series (`None` outside the window).
    fn slot(&self, bucket_start_us: i64) -> Option<usize> {
        let i = (bucket_start_us - self.span.since_us).div_euclid(self.step_us);
        usize::try_from(i).ok().filter(|i| *i < self.buckets())
    }

    /// Bucket start times, Unix seconds.
    fn times(&self) -> Vec<f64> {
        (0..self.buckets())
            .map(|i| (self.span.since_us + i as i64 * self.step_us) as f64 / 1e6)
            .collect()
    }
}

/// P50/P95/P99 of one value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 95th percentile.
    pub p95: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl Quantiles {
    fn of(q: &tokenscope_store::Quantiles) -> Self {
        Quantiles {
            p50: q.p50,
            p90: q.p90,
            p95: q.p95,
            p99: q.p99,
        }
    }
}

/// Distinct values of the unfiltered window, for the filter menus.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Options {
    /// Models seen.
    pub models: Vec<String>,
    /// Request types seen.
    pub request_types: Vec<String>,
    /// Business lines seen.
    pub business_lines: Vec<String>,
}

/// The filter menus: the distinct models, request types and business lines of the
/// unfiltered window (one usage query: one row per combination).
fn options(reader: &dyn RecordReader, w: &PageWindow) -> Result<Options, StoreError> {
    let rows = reader.usage(&UsageQuery::new(
        w.span,
        vec![Dimension::RequestType, Dimension::BusinessLine],
    ))?;
    let mut m = BTreeSet::new();
    let mut t = BTreeSet::new();
    let mut b = BTreeSet::new();
    for r in rows {
        m.insert(r.model);
        if let Some(x) = r.labels.first().cloned().flatten() {
            t.insert(x);
        }
        if let Some(x) = r.labels.get(1).cloned().flatten() {
            b.insert(x);
        }
    }
    Ok(Options {
        models: m.into_iter().collect(),
        request_types: t.into_iter().collect(),
        business_lines: b.into_iter().collect(),
    })
}

/// What every page's JSON starts with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Frame {
    /// Page name.
    pub page: &'static str,
    /// Range asked for.
    pub range: Range,
    /// Window start, Unix seconds.
    pub since: f64,
    /// Window end, Unix seconds.
    pub until: f64,
    /// Bucket width of the series, seconds.
    pub step_seconds: f64,
    /// Filters applied.
    pub filters: Filters,
    /// Values offered by the filter menus.
    pub options: Options,
    /// Records this gateway finished that the store did not hold yet when the page was read
    /// (queued, being written, or spooled while the store is slow or down): not in the page's
    /// numbers. 0 normally — the page flushes the pipeline first.
    pub not_yet_stored: u64,
}

/// One request in a "slowest requests" table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowRequest {
    /// Gateway request id.
    pub request_id: String,
    /// Start, Unix seconds.
    pub created_at: f64,
    /// Requested model.
    pub model: String,
    /// Outcome.
    pub outcome: &'static str,
    /// Input tokens.
    pub input_tokens: Option<u64>,
    /// Output tokens.
    pub output_tokens: Option<u64>,
    /// End to end, ms.
    pub total_ms: f64,
    /// TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// Queue, ms.
    pub queue_ms: Option<f64>,
    /// Prefill, ms.
    pub prefill_ms: Option<f64>,
    /// Decode, ms.
    pub decode_ms: Option<f64>,
    /// Where the queue time comes from: `engine`, `engine_span`, `derived` (the gateway's
    /// TTFT − prefill: not an engine number) or `none`.
    pub queue_source: &'static str,
    /// The part of TTFT the engine did not account for, ms (`ttft_unaccounted_ms`: TTFT =
    /// gateway + this + the engine's reported queue + prefill).
    pub ttft_unaccounted_ms: Option<f64>,
    /// The gateway's own part of TTFT, ms.
    pub gateway_ms: Option<f64>,
    /// Whether the engine's numbers are this request's: `consistent`, `per_step` (shared by
    /// the requests of one engine step), `exceeds_gateway`; `None` without engine numbers.
    pub engine_timing: Option<String>,
    /// W3C trace id.
    pub trace_id: String,
    /// Whether the tail sampler kept (exported) this request's trace; `None` = not known
    /// (tracing off, or the decision is older than the gateway's memory of it).
    pub trace_kept: Option<bool>,
    /// Link to the trace in the configured trace UI, when kept and `[dashboard] trace_url`
    /// is set.
    pub trace_url: Option<String>,
    /// What it waited behind on its replica (the record's per-request blame; `None` when not
    /// measured).
    pub blame: Option<SlowBlame>,
}

/// A slow request's blame: the requests in prefill on its replica while it waited.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlowBlame {
    /// How many.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: Option<u64>,
    /// The part of its wait they covered, ms.
    pub blocked_ms: Option<f64>,
    /// The largest of them: request id, caller, business line, prompt tokens.
    pub blocker_request_id: Option<String>,
    /// See [`SlowBlame::blocker_request_id`].
    pub blocker_caller: Option<String>,
    /// See [`SlowBlame::blocker_request_id`].
    pub blocker_business_line: Option<String>,
    /// See [`SlowBlame::blocker_request_id`].
    pub blocker_prompt_tokens: Option<u64>,
}

/// How a slow request's trace is linked: `kept(trace_id)` and the URL template.
pub struct TraceLinks<'a> {
    /// Whether the trace of (trace id, `created_at`) was kept (`None` = unknown).
    pub kept: &'a dyn Fn(&str, i64) -> Option<bool>,
    /// `[dashboard] trace_url` with `{trace_id}`.
    pub url_template: Option<&'a str>,
}

/// What a page reads besides the store: the trace links, the pipeline's backlog and the GPUs'
/// current reading.
pub struct PageContext<'a> {
    /// Trace links of the slowest requests.
    pub links: TraceLinks<'a>,
    /// Records not in the store yet ([`Frame::not_yet_stored`]).
    pub not_yet_stored: u64,
    /// The gateway's last `[gpu]` reading (empty without GPU telemetry).
    pub gpus: Vec<GpuNow>,
}

/// One GPU as the gateway read it last (`[gpu]`: NVML or a DCGM exporter).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuNow {
    /// Index / id.
    pub gpu: String,
    /// Model name.
    pub model_name: Option<String>,
    /// Utilisation, 0–1.
    pub utilization: Option<f64>,
    /// Memory-bandwidth utilisation, 0–1.
    pub memory_bandwidth: Option<f64>,
    /// Memory used, bytes.
    pub memory_used_bytes: Option<u64>,
    /// Memory total, bytes.
    pub memory_total_bytes: Option<u64>,
    /// Used / total, 0–1.
    pub memory_used_ratio: Option<f64>,
}

/// Latency of the requests that arrived while the GPUs' utilisation was in one band.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuBandLatency {
    /// `0-50%`, `50-80%`, `80-95%`, `95-100%`.
    pub gpu_band: &'static str,
    /// Requests.
    pub requests: u64,
    /// TTFT, ms.
    pub ttft_ms: Quantiles,
    /// TPOT, ms.
    pub tpot_ms: Quantiles,
}

/// The performance page's GPU panel.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPanel {
    /// The GPUs now.
    pub now: Vec<GpuNow>,
    /// Latency by GPU utilisation at arrival (every band, lowest first; from the store).
    pub by_gpu_band: Vec<GpuBandLatency>,
}

fn slow_request(r: &RequestRecord, links: &TraceLinks<'_>) -> SlowRequest {
    let kept = (links.kept)(&r.trace_id, r.created_at);
    SlowRequest {
        request_id: r.request_id.clone(),
        created_at: r.created_at as f64 / 1e6,
        model: r.model.clone(),
        outcome: r.outcome.as_str(),
        input_tokens: r.input_tokens,
        output_tokens: r.output_tokens,
        total_ms: r.total_duration_ms,
        ttft_ms: r.ttft_ms,
        queue_ms: r.queue_duration_ms,
        prefill_ms: r.prefill_duration_ms,
        decode_ms: r.decode_duration_ms,
        queue_source: r.queue_source.as_str(),
        ttft_unaccounted_ms: r.ttft_unaccounted_ms,
        gateway_ms: r.gateway_overhead_ms,
        engine_timing: r.engine_timing.clone(),
        trace_id: r.trace_id.clone(),
        trace_kept: kept,
        trace_url: match (kept, links.url_template) {
            (Some(true), Some(t)) => Some(t.replace("{trace_id}", &r.trace_id)),
            _ => None,
        },
        blame: r.blocked_by_requests.map(|n| SlowBlame {
            requests: n,
            prompt_tokens: r.blocked_by_prompt_tokens,
            blocked_ms: r.blocked_ms,
            blocker_request_id: r.blocker_request_id.clone(),
            blocker_caller: r.blocker_caller.clone(),
            blocker_business_line: r.blocker_business_line.clone(),
            blocker_prompt_tokens: r.blocker_prompt_tokens,
        }),
    }
}

/// The 10 slowest requests of the window (end to end; ties by request id), from the store.
fn slowest(
    reader: &dyn RecordReader,
    w: &PageWindow,
    f: &Filters,
    links: &TraceLinks<'_>,
) -> Result<Vec<SlowRequest>, StoreError> {
    Ok(reader
        .slowest(w.span, &f.to_store(), 10)?
        .iter()
        .map(|r| slow_request(r, links))
        .collect())
}

fn frame(
    page: &'static str,
    range: Range,
    w: &PageWindow,
    f: &Filters,
    options: Options,
    not_yet_stored: u64,
) -> Frame {
    Frame {
        page,
        range,
        since: w.span.since_us as f64 / 1e6,
        until: w.span.until_us as f64 / 1e6,
        step_seconds: w.step_us as f64 / 1e6,
        filters: f.clone(),
        options,
        not_yet_stored,
    }
}

/// The store's report over the window, filtered, grouped by `by`, per bucket with `series`.
fn report(
    reader: &dyn RecordReader,
    w: &PageWindow,
    f: &Filters,
    by: Vec<Dimension>,
    series: bool,
) -> Result<Vec<ReportRow>, StoreError> {
    reader.report(&ReportQuery {
        since_us: w.span.since_us,
        until_us: Some(w.span.until_us),
        group_by: by,
        interval: series.then(|| std::time::Duration::from_micros(w.step_us as u64)),
        filters: f.to_store(),
    })
}

/// The store's usage sums over the window, filtered, grouped by `by` (and model), per bucket
/// with `series`.
fn usage(
    reader: &dyn RecordReader,
    w: &PageWindow,
    f: &Filters,
    by: Vec<Dimension>,
    series: bool,
) -> Result<Vec<UsageRow>, StoreError> {
    let mut q = UsageQuery::new(w.span, by);
    q.interval_us = series.then_some(w.step_us);
    q.filters = f.to_store();
    reader.usage(&q)
}

/// Report rows per series slot (rows outside the window are ignored).
fn per_slot<'a>(rows: &'a [ReportRow], w: &PageWindow) -> Vec<Option<&'a ReportRow>> {
    let mut out = vec![None; w.buckets()];
    for r in rows {
        if let Some(slot) = r.bucket_start_us.and_then(|b| w.slot(b)) {
            out[slot] = Some(r);
        }
    }
    out
}

/// Usage sums per series slot, models merged.
fn usage_per_slot(rows: &[UsageRow], w: &PageWindow) -> Vec<UsageSums> {
    let mut out = vec![UsageSums::default(); w.buckets()];
    for r in rows {
        if let Some(slot) = r.bucket_start_us.and_then(|b| w.slot(b)) {
            out[slot].merge(&r.sums);
        }
    }
    out
}

fn merged(rows: &[UsageRow]) -> UsageSums {
    let mut s = UsageSums::default();
    for r in rows {
        s.merge(&r.sums);
    }
    s
}

/// The report's success rate (`NaN` when no request counts) as the page's `null`.
fn rate(r: &ReportRow) -> Option<f64> {
    (!r.success_rate.is_nan()).then_some(r.success_rate)
}

/// Headline numbers of a set of records over `seconds`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Requests.
    pub requests: u64,
    /// Success rate, `ok / (ok + upstream_error + timeout + shutdown)` (`null` without a
    /// request that counts; `tokenscope_core::success`).
    pub success_rate: Option<f64>,
    /// Requests per second of the window.
    pub qps: f64,
    /// Input tokens per second of the window.
    pub input_tokens_per_s: f64,
    /// Output tokens per second of the window.
    pub output_tokens_per_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: Quantiles,
    /// Time per output token, ms.
    pub tpot_ms: Quantiles,
    /// End to end, ms.
    pub e2e_ms: Quantiles,
}

fn summary(row: Option<&ReportRow>, seconds: f64) -> Summary {
    let Some(r) = row else {
        return Summary {
            requests: 0,
            success_rate: None,
            qps: 0.0,
            input_tokens_per_s: 0.0,
            output_tokens_per_s: 0.0,
            ttft_ms: Quantiles::default(),
            tpot_ms: Quantiles::default(),
            e2e_ms: Quantiles::default(),
        };
    };
    Summary {
        requests: r.count,
        success_rate: rate(r),
        qps: r.count as f64 / seconds,
        input_tokens_per_s: r.input_tokens as f64 / seconds,
        output_tokens_per_s: r.output_tokens as f64 / seconds,
        ttft_ms: Quantiles::of(&r.ttft),
        tpot_ms: Quantiles::of(&r.tpot),
        e2e_ms: Quantiles::of(&r.e2e),
    }
}

/// Quantiles over a fixed trailing window (5 min and 1 h side by side), whatever the range.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrailingWindow {
    /// `5m` or `1h`.
    pub window: &'static str,
    /// The numbers over that window (rates per second of it).
    #[serde(flatten)]
    pub summary: Summary,
}

/// Overview time series (one value per bucket; `null` = no value in the bucket).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverviewSeries {
    /// Bucket start, Unix seconds.
    pub t: Vec<f64>,
    /// Requests per second.
    pub qps: Vec<f64>,
    /// Success rate per bucket (as in the summary).
    pub success_rate: Vec<Option<f64>>,
    /// TTFT P50, ms.
    pub ttft_p50: Vec<Option<f64>>,
    /// TTFT P90, ms.
    pub ttft_p90: Vec<Option<f64>>,
    /// TTFT P95, ms.
    pub ttft_p95: Vec<Option<f64>>,
    /// TTFT P99, ms.
    pub ttft_p99: Vec<Option<f64>>,
    /// TPOT P50, ms.
    pub tpot_p50: Vec<Option<f64>>,
    /// TPOT P90, ms.
    pub tpot_p90: Vec<Option<f64>>,
    /// TPOT P95, ms.
    pub tpot_p95: Vec<Option<f64>>,
    /// TPOT P99, ms.
    pub tpot_p99: Vec<Option<f64>>,
    /// Input tokens per second.
    pub input_tokens_per_s: Vec<f64>,
    /// Output tokens per second.
    pub output_tokens_per_s: Vec<f64>,
}

/// `GET /api/dashboard/overview`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Overview {
    /// Window, filters, options.
    #[serde(flatten)]
    pub frame: Frame,
    /// Numbers over the range.
    pub summary: Summary,
    /// The last 5 minutes and the last hour, ending at the range's end.
    pub trailing: Vec<TrailingWindow>,
    /// Per bucket.
    pub series: OverviewSeries,
    /// The slowest requests of the range (end to end).
    pub slowest: Vec<SlowRequest>,
}

/// Builds the overview page from the store's aggregates.
pub fn overview(
    reader: &dyn RecordReader,
    range: Range,
    w: &PageWindow,
    f: &Filters,
    cx: &PageContext<'_>,
) -> Result<Overview, StoreError> {
    let step_s = w.step_us as f64 / 1e6;
    let rows = report(reader, w, f, vec![], true)?;
    let slots = per_slot(&rows, w);
    let col = |g: fn(&ReportRow) -> Option<f64>| -> Vec<Option<f64>> {
        slots.iter().map(|r| r.and_then(g)).collect()
    };
    let per_s = |g: fn(&ReportRow) -> u64| -> Vec<f64> {
        slots
            .iter()
            .map(|r| r.map_or(0.0, |r| g(r) as f64 / step_s))
            .collect()
    };
    let series = OverviewSeries {
        t: w.times(),
        qps: per_s(|r| r.count),
        success_rate: col(rate),
        ttft_p50: col(|r| r.ttft.p50),
        ttft_p90: col(|r| r.ttft.p90),
        ttft_p95: col(|r| r.ttft.p95),
        ttft_p99: col(|r| r.ttft.p99),
        tpot_p50: col(|r| r.tpot.p50),
        tpot_p90: col(|r| r.tpot.p90),
        tpot_p95: col(|r| r.tpot.p95),
        tpot_p99: col(|r| r.tpot.p99),
        input_tokens_per_s: per_s(|r| r.input_tokens),
        output_tokens_per_s: per_s(|r| r.output_tokens),
    };
    let mut trailing = Vec::with_capacity(2);
    for (name, secs) in [("5m", 300i64), ("1h", 3_600)] {
        let rows = report(reader, &w.trailing(secs), f, vec![], false)?;
        trailing.push(TrailingWindow {
            window: name,
            summary: summary(rows.first(), secs as f64),
        });
    }
    let whole = report(reader, w, f, vec![], false)?;
    Ok(Overview {
        summary: summary(whole.first(), w.span.seconds()),
        trailing,
        series,
        slowest: slowest(reader, w, f, &cx.links)?,
        frame: frame(
            "overview",
            range,
            w,
            f,
            options(reader, w)?,
            cx.not_yet_stored,
        ),
    })
}

/// Mean phase split of a set of records, ms (over the records that have each phase).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseSplit {
    /// Mean queue time.
    pub queue_ms: Option<f64>,
    /// Mean prefill time.
    pub prefill_ms: Option<f64>,
    /// Mean decode time.
    pub decode_ms: Option<f64>,
    /// Mean end to end.
    pub e2e_ms: Option<f64>,
    /// Mean part of TTFT the engine did not account for (`ttft_unaccounted_ms`).
    pub unaccounted_ms: Option<f64>,
}

const NO_SPLIT: PhaseSplit = PhaseSplit {
    queue_ms: None,
    prefill_ms: None,
    decode_ms: None,
    e2e_ms: None,
    unaccounted_ms: None,
};

fn split(r: Option<&ReportRow>) -> PhaseSplit {
    r.map_or(NO_SPLIT, |r| PhaseSplit {
        queue_ms: r.queue.mean,
        prefill_ms: r.prefill.mean,
        decode_ms: r.decode.mean,
        e2e_ms: r.e2e.mean,
        unaccounted_ms: r.unaccounted.mean,
    })
}

/// Engine state seen by the requests at their arrival (means).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EngineMeans {
    /// Requests running in the engine.
    pub running: Option<f64>,
    /// Requests waiting in the engine.
    pub waiting: Option<f64>,
    /// KV-cache usage, 0–1.
    pub kv_usage: Option<f64>,
}

fn engine(s: &UsageSums) -> EngineMeans {
    EngineMeans {
        running: s.engine_running.mean(),
        waiting: s.engine_waiting.mean(),
        kv_usage: s.engine_kv_usage.mean(),
    }
}

/// Latency of one input-length bucket.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketLatency {
    /// `0-128`, `128-512`, `512-2048`, `2048+`.
    pub input_bucket: &'static str,
    /// Requests.
    pub requests: u64,
    /// TTFT, ms.
    pub ttft_ms: Quantiles,
    /// End to end, ms.
    pub e2e_ms: Quantiles,
    /// Mean phase split.
    pub split: PhaseSplit,
}

/// Performance time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PerformanceSeries {
    /// Bucket start, Unix seconds.
    pub t: Vec<f64>,
    /// Mean queue, ms.
    pub queue_ms: Vec<Option<f64>>,
    /// Mean prefill, ms.
    pub prefill_ms: Vec<Option<f64>>,
    /// Mean decode, ms.
    pub decode_ms: Vec<Option<f64>>,
    /// Engine running requests (mean at arrival).
    pub engine_running: Vec<Option<f64>>,
    /// Engine waiting requests (mean at arrival).
    pub engine_waiting: Vec<Option<f64>>,
    /// Engine KV usage (mean at arrival), 0–1.
    pub engine_kv_usage: Vec<Option<f64>>,
}

/// `GET /api/dashboard/performance`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Performance {
    /// Window, filters, options.
    #[serde(flatten)]
    pub frame: Frame,
    /// Requests in the range.
    pub requests: u64,
    /// Mean phase split over the range.
    pub split: PhaseSplit,
    /// Engine state means over the range.
    pub engine: EngineMeans,
    /// Latency by input-length bucket (every bucket, shortest first).
    pub by_input_bucket: Vec<BucketLatency>,
    /// Per time bucket.
    pub series: PerformanceSeries,
    /// The slowest requests with their split.
    pub slowest: Vec<SlowRequest>,
    /// The GPUs: now, and latency by their utilisation at the requests' arrival.
    pub gpu: GpuPanel,
}

/// Builds the performance page from the store's aggregates.
pub fn performance(
    reader: &dyn RecordReader,
    range: Range,
    w: &PageWindow,
    f: &Filters,
    cx: &PageContext<'_>,
) -> Result<Performance, StoreError> {
    let whole = report(reader, w, f, vec![], false)?;
    let series_rows = report(reader, w, f, vec![], true)?;
    let slots = per_slot(&series_rows, w);
    let splits: Vec<PhaseSplit> = slots.iter().map(|r| split(*r)).collect();
    let engines: Vec<EngineMeans> = usage_per_slot(&usage(reader, w, f, vec![], true)?, w)
        .iter()
        .map(engine)
        .collect();
    let by_bucket = report(reader, w, f, vec![Dimension::InputBucket], false)?;
    let by_input_bucket = InputBucket::ALL
        .into_iter()
        .map(|ib| {
            let row = by_bucket
                .iter()
                .find(|r| r.group.first().is_some_and(|(_, v)| v == ib.as_str()));
            BucketLatency {
                input_bucket: ib.as_str(),
                requests: row.map_or(0, |r| r.count),
                ttft_ms: row.map_or(Quantiles::default(), |r| Quantiles::of(&r.ttft)),
                e2e_ms: row.map_or(Quantiles::default(), |r| Quantiles::of(&r.e2e)),
                split: split(row),
            }
        })
        .collect();
    let by_gpu = report(reader, w, f, vec![Dimension::GpuBand], false)?;
    let by_gpu_band = tokenscope_store::report::KV_BANDS
        .into_iter()
        .map(|band| {
            let row = by_gpu
                .iter()
                .find(|r| r.group.first().is_some_and(|(_, v)| v == band));
            GpuBandLatency {
                gpu_band: band,
                requests: row.map_or(0, |r| r.count),
                ttft_ms: row.map_or(Quantiles::default(), |r| Quantiles::of(&r.ttft)),
                tpot_ms: row.map_or(Quantiles::default(), |r| Quantiles::of(&r.tpot)),
            }
        })
        .collect();
    Ok(Performance {
        gpu: GpuPanel {
            now: cx.gpus.clone(),
            by_gpu_band,
        },
        requests: whole.first().map_or(0, |r| r.count),
        split: split(whole.first()),
        engine: engine(&merged(&usage(reader, w, f, vec![], false)?)),
        by_input_bucket,
        series: PerformanceSeries {
            t: w.times(),
            queue_ms: splits.iter().map(|s| s.queue_ms).collect(),
            prefill_ms: splits.iter().map(|s| s.prefill_ms).collect(),
            decode_ms: splits.iter().map(|s| s.decode_ms).collect(),
            engine_running: engines.iter().map(|e| e.running).collect(),
            engine_waiting: engines.iter().map(|e| e.waiting).collect(),
            engine_kv_usage: engines.iter().map(|e| e.kv_usage).collect(),
        },
        slowest: slowest(reader, w, f, &cx.links)?,
        frame: frame(
            "performance",
            range,
            w,
            f,
            options(reader, w)?,
            cx.not_yet_stored,
        ),
    })
}

/// Tokens and cost of one group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostRow {
    /// Business line or user (`(none)` when the record has none).
    pub key: String,
    /// Requests.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// USD (priced requests only).
    pub cost_usd: f64,
    /// Share of the range's cost, 0–1 (`null` when the range cost nothing).
    pub share: Option<f64>,
}

/// One budget's gauge.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetRow {
    /// Business line.
    pub business_line: String,
    /// `llm_budget_usage_ratio` now (largest used/budget of the line's budgets).
    pub usage_ratio: f64,
}

/// Cost time series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostSeries {
    /// Bucket start, Unix seconds.
    pub t: Vec<f64>,
    /// USD per bucket.
    pub cost_usd: Vec<f64>,
    /// Input tokens per bucket.
    pub input_tokens: Vec<u64>,
    /// Output tokens per bucket.
    pub output_tokens: Vec<u64>,
}

/// Totals of the cost page.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostTotals {
    /// Requests.
    pub requests: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// USD of the priced requests.
    pub cost_usd: f64,
    /// Requests without a price (their model has none).
    pub unpriced_requests: u64,
}

/// `GET /api/dashboard/cost`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cost {
    /// Window, filters, options.
    #[serde(flatten)]
    pub frame: Frame,
    /// Totals over the range.
    pub totals: CostTotals,
    /// By business line, most expensive first (then most tokens).
    pub by_business_line: Vec<CostRow>,
    /// The 20 most expensive users.
    pub by_user: Vec<CostRow>,
    /// Per time bucket.
    pub series: CostSeries,
    /// Budget gauges (every configured business line).
    pub budgets: Vec<BudgetRow>,
}

/// Usage rows of one dimension folded per label (models merged) into cost rows, most
/// expensive first (then most tokens, then the label), at most `limit`.
fn cost_rows(rows: &[UsageRow], total: f64, limit: usize) -> Vec<CostRow> {
    let mut groups: BTreeMap<String, UsageSums> = BTreeMap::new();
    for r in rows {
        let k = r
            .labels
            .first()
            .cloned()
            .flatten()
            .unwrap_or_else(|| "(none)".to_owned());
        groups.entry(k).or_default().merge(&r.sums);
    }
    let mut out: Vec<CostRow> = groups
        .into_iter()
        .map(|(key, s)| {
            let cost_usd = s.stored_cost_usd();
            CostRow {
                key,
                requests: s.requests,
                input_tokens: s.input_tokens,
                output_tokens: s.output_tokens,
                cost_usd,
                share: (total > 0.0).then(|| cost_usd / total),
            }
        })
        .collect();
    out.sort_by(|a, b| {
        b.cost_usd
            .total_cmp(&a.cost_usd)
            .then_with(|| {
                (b.input_tokens + b.output_tokens).cmp(&(a.input_tokens + a.output_tokens))
            })
            .then_with(|| a.key.cmp(&b.key))
    });
    out.truncate(limit);
    out
}

/// Builds the cost page from the store's usage sums; `budgets` are the current gauge values.
pub fn cost(
    reader: &dyn RecordReader,
    range: Range,
    w: &PageWindow,
    f: &Filters,
    budgets: Vec<BudgetRow>,
    not_yet_stored: u64,
) -> Result<Cost, StoreError> {
    let lines = usage(reader, w, f, vec![Dimension::BusinessLine], false)?;
    let users = usage(reader, w, f, vec![Dimension::User], false)?;
    let t = merged(&lines);
    let total = t.stored_cost_usd();
    let slots = usage_per_slot(&usage(reader, w, f, vec![], true)?, w);
    Ok(Cost {
        totals: CostTotals {
            requests: t.requests,
            input_tokens: t.input_tokens,
            output_tokens: t.output_tokens,
            cost_usd: total,
            unpriced_requests: t.requests - t.stored_cost_requests,
        },
        by_business_line: cost_rows(&lines, total, usize::MAX),
        by_user: cost_rows(&users, total, 20),
        series: CostSeries {
            t: w.times(),
            cost_usd: slots.iter().map(UsageSums::stored_cost_usd).collect(),
            input_tokens: slots.iter().map(|s| s.input_tokens).collect(),
            output_tokens: slots.iter().map(|s| s.output_tokens).collect(),
        },
        budgets,
        frame: frame("cost", range, w, f, options(reader, w)?, not_yet_stored),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenscope_core::Outcome;

    fn rec(id: &str, at_s: f64, model: &str, total_ms: f64) -> RequestRecord {
        RequestRecord {
            request_id: id.into(),
            trace_id: format!("{id:0>32}"),
            created_at: (at_s * 1e6) as i64,
            model: model.into(),
            request_type: "chat".into(),
            total_duration_ms: total_ms,
            ttft_ms: Some(total_ms / 2.0),
            tpot_ms: Some(total_ms / 100.0),
            input_tokens: Some(100),
            output_tokens: Some(10),
            input_bucket: Some(InputBucket::B0To128),
            ..RequestRecord::default()
        }
    }

    fn no_links() -> PageContext<'static> {
        PageContext {
            links: TraceLinks {
                kept: &|_, _| None,
                url_template: None,
            },
            not_yet_stored: 0,
            gpus: Vec::new(),
        }
    }

    /// The records in an in-memory embedded store: the pages read only its aggregates.
    fn store_of(records: &[RequestRecord]) -> tokenscope_store::SqliteStore {
        let mut s = tokenscope_store::SqliteStore::open_in_memory().expect("store");
        s.insert_batch(records).expect("insert");
        s
    }

    #[test]
    fn window_is_aligned_to_the_step_and_tiles_the_range() {
        let w = PageWindow::ending_at(Range::H1, 1_000_000_030_000_000);
        assert_eq!(w.span.until_us % 60_000_000, 0);
        assert!(w.span.until_us >= 1_000_000_030_000_000);
        assert_eq!(w.span.until_us - w.span.since_us, 3_600_000_000);
        assert_eq!(w.buckets(), 60);
        let exact = PageWindow::ending_at(Range::M5, 600_000_000);
        assert_eq!(exact.span.until_us, 600_000_000);
    }

    #[test]
    fn overview_numbers_are_exact() {
        // 10 requests in the last 5 minutes of a 1 h window: totals 1..=10 × 100 ms.
        let until = 3_600.0;
        let w = PageWindow::ending_at(Range::H1, (until * 1e6) as i64);
        let mut records: Vec<RequestRecord> = (1..=10)
            .map(|i| {
                rec(
                    &i.to_string(),
                    until - 10.0 * i as f64,
                    "m",
                    100.0 * i as f64,
                )
            })
            .collect();
        records[0].outcome = Outcome::UpstreamError;
        records.push(rec("old", until - 7_200.0, "m", 1.0)); // outside the window
        let o = overview(
            &store_of(&records),
            Range::H1,
            &w,
            &Filters::default(),
            &no_links(),
        )
        .expect("page");
        assert_eq!(o.summary.requests, 10);
        assert_eq!(o.summary.success_rate, Some(0.9));
        assert!((o.summary.qps - 10.0 / 3_600.0).abs() < 1e-12);
        assert!((o.summary.input_tokens_per_s - 1_000.0 / 3_600.0).abs() < 1e-12);
        assert_eq!(o.summary.e2e_ms.p50, Some(500.0));
        assert_eq!(o.summary.e2e_ms.p99, Some(1_000.0));
        assert_eq!(o.summary.ttft_ms.p95, Some(500.0));
        // Nearest rank: the 9th of ten.
        assert_eq!(o.summary.e2e_ms.p90, Some(900.0));
        assert!(o.summary.ttft_ms.p90 <= o.summary.ttft_ms.p95);
        assert_eq!(
            o.series.ttft_p90.iter().flatten().count(),
            o.series.ttft_p95.iter().flatten().count()
        );
        assert_eq!(o.trailing[0].window, "5m");
        assert_eq!(o.trailing[0].summary.requests, 10);
        assert!((o.trailing[0].summary.qps - 10.0 / 300.0).abs() < 1e-12);
        assert_eq!(o.series.t.len(), 60);
        assert!((o.series.qps.iter().sum::<f64>() * 60.0 - 10.0).abs() < 1e-9);
        // Buckets without requests have no percentile, not 0.
        assert_eq!(o.series.ttft_p50[0], None);
        assert_eq!(o.slowest[0].request_id, "10");
        assert_eq!(o.slowest.len(), 10);
    }

    #[test]
    fn filters_narrow_and_options_list_the_unfiltered_window() {
        let w = PageWindow::ending_at(Range::M5, 300_000_000);
        let mut a = rec("a", 10.0, "m1", 10.0);
        a.business_line = Some("search".into());
        let mut b = rec("b", 20.0, "m2", 20.0);
        b.request_type = "completion".into();
        let records = vec![a, b];
        let f = Filters {
            model: Some("m2".into()),
            ..Filters::default()
        };
        let o = overview(&store_of(&records), Range::M5, &w, &f, &no_links()).expect("page");
        assert_eq!(o.summary.requests, 1);
        assert_eq!(o.frame.options.models, vec!["m1", "m2"]);
        assert_eq!(o.frame.options.request_types, vec!["chat", "completion"]);
        assert_eq!(o.frame.options.business_lines, vec!["search"]);
        let f = Filters {
            business_line: Some("search".into()),
            ..Filters::default()
        };
        assert_eq!(
            overview(&store_of(&records), Range::M5, &w, &f, &no_links())
                .expect("page")
                .summary
                .requests,
            1
        );
    }

    #[test]
    fn performance_split_by_bucket_and_engine_state() {
        let w = PageWindow::ending_at(Range::M5, 300_000_000);
        let mut a = rec("a", 5.0, "m", 100.0);
        a.queue_duration_ms = Some(10.0);
        a.prefill_duration_ms = Some(20.0);
        a.decode_duration_ms = Some(70.0);
        a.engine_running = Some(4.0);
        a.engine_kv_usage = Some(0.5);
        a.gpu_utilization = Some(0.97);
        let mut b = rec("b", 7.0, "m", 300.0);
        b.input_bucket = Some(InputBucket::B2048Plus);
        b.queue_duration_ms = Some(30.0);
        b.engine_running = Some(8.0);
        b.gpu_utilization = Some(0.3);
        let mut cx = no_links();
        cx.gpus = vec![GpuNow {
            gpu: "0".into(),
            model_name: Some("NVIDIA H100".into()),
            utilization: Some(0.95),
            memory_bandwidth: Some(0.4),
            memory_used_bytes: Some(60),
            memory_total_bytes: Some(80),
            memory_used_ratio: Some(0.75),
        }];
        let p =
            performance(&store_of(&[a, b]), Range::M5, &w, &Filters::default(), &cx).expect("page");
        // GPU: now as read, and latency by utilisation band at arrival.
        assert_eq!(p.gpu.now, cx.gpus);
        let bands: Vec<(&str, u64)> = p
            .gpu
            .by_gpu_band
            .iter()
            .map(|b| (b.gpu_band, b.requests))
            .collect();
        assert_eq!(
            bands,
            [("0-50%", 1), ("50-80%", 0), ("80-95%", 0), ("95-100%", 1)]
        );
        assert_eq!(
            p.gpu.by_gpu_band[3].ttft_ms.p50,
            p.by_input_bucket[0].ttft_ms.p50
        );
        assert_eq!(p.split.queue_ms, Some(20.0));
        assert_eq!(p.split.prefill_ms, Some(20.0));
        assert_eq!(p.engine.running, Some(6.0));
        assert_eq!(p.engine.kv_usage, Some(0.5));
        assert_eq!(p.engine.waiting, None);
        assert_eq!(p.by_input_bucket.len(), 4);
        assert_eq!(p.by_input_bucket[0].requests, 1);
        assert_eq!(p.by_input_bucket[3].e2e_ms.p50, Some(300.0));
        assert_eq!(p.series.queue_ms[0], Some(20.0));
        assert_eq!(p.series.queue_ms[1], None);
    }

    #[test]
    fn cost_groups_shares_and_unpriced() {
        let w = PageWindow::ending_at(Range::M5, 300_000_000);
        let mut a = rec("a", 5.0, "m", 1.0);
        a.business_line = Some("search".into());
        a.user_id = Some("u1".into());
        a.cost_usd = Some(3.0);
        let mut b = rec("b", 6.0, "m", 1.0);
        b.business_line = Some("ads".into());
        b.user_id = Some("u2".into());
        b.cost_usd = Some(1.0);
        let c = rec("c", 7.0, "m", 1.0);
        let budgets = vec![BudgetRow {
            business_line: "search".into(),
            usage_ratio: 0.5,
        }];
        let c = cost(
            &store_of(&[a, b, c]),
            Range::M5,
            &w,
            &Filters::default(),
            budgets,
            0,
        )
        .expect("page");
        assert_eq!(c.totals.cost_usd, 4.0);
        assert_eq!(c.totals.unpriced_requests, 1);
        assert_eq!(c.totals.input_tokens, 300);
        assert_eq!(c.by_business_line[0].key, "search");
        assert_eq!(c.by_business_line[0].share, Some(0.75));
        assert_eq!(c.by_business_line[2].key, "(none)");
        assert_eq!(c.by_user[1].key, "u2");
        assert_eq!(c.series.cost_usd[0], 4.0);
        assert_eq!(c.budgets[0].usage_ratio, 0.5);
    }

    #[test]
    fn a_slow_request_says_what_it_waited_behind() {
        let w = PageWindow::ending_at(Range::M5, 300_000_000);
        let mut a = rec("a", 5.0, "m", 900.0);
        a.blocked_by_requests = Some(2);
        a.blocked_by_prompt_tokens = Some(1510);
        a.blocked_ms = Some(640.5);
        a.blocker_request_id = Some("long-1".into());
        a.blocker_caller = Some("batch-job".into());
        a.blocker_business_line = Some("offline".into());
        a.blocker_prompt_tokens = Some(1500);
        let b = rec("b", 6.0, "m", 20.0);
        let o = overview(
            &store_of(&[a, b]),
            Range::M5,
            &w,
            &Filters::default(),
            &no_links(),
        )
        .expect("page");
        assert_eq!(o.slowest[0].request_id, "a");
        let bl = o.slowest[0].blame.as_ref().expect("blame");
        assert_eq!(
            (bl.requests, bl.blocked_ms, bl.blocker_request_id.as_deref()),
            (2, Some(640.5), Some("long-1"))
        );
        assert_eq!(bl.blocker_caller.as_deref(), Some("batch-job"));
        assert_eq!(bl.blocker_business_line.as_deref(), Some("offline"));
        assert_eq!(bl.blocker_prompt_tokens, Some(1500));
        assert_eq!(o.slowest[1].blame, None, "not measured");
        let json = serde_json::to_value(&o.slowest[0]).expect("json");
        assert_eq!(json["blame"]["blocker_caller"], "batch-job");
    }

    #[test]
    fn trace_links_only_for_kept_traces() {
        let w = PageWindow::ending_at(Range::M5, 300_000_000);
        let a = rec("a", 5.0, "m", 10.0);
        let b = rec("b", 6.0, "m", 20.0);
        let kept_id = a.trace_id.clone();
        let kept = move |t: &str, _at: i64| Some(t == kept_id);
        let links = PageContext {
            links: TraceLinks {
                kept: &kept,
                url_template: Some("http://jaeger/trace/{trace_id}"),
            },
            not_yet_stored: 0,
            gpus: Vec::new(),
        };
        let o = overview(
            &store_of(&[a, b]),
            Range::M5,
            &w,
            &Filters::default(),
            &links,
        )
        .expect("page");
        assert_eq!(o.slowest[0].request_id, "b");
        assert_eq!(o.slowest[0].trace_kept, Some(false));
        assert_eq!(o.slowest[0].trace_url, None);
        assert_eq!(
            o.slowest[1].trace_url,
            Some(format!("http://jaeger/trace/{:0>32}", "a"))
        );
    }
}
