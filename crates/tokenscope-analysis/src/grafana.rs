//! Grafana dashboards (`tokenscope export grafana`).
//!
//! [`dashboards`] builds three importable dashboards (Grafana JSON model, `schemaVersion`
//! [`SCHEMA_VERSION`]) from the same [`AlertThresholds`] as [`crate::rules`], so the panels
//! read the recorded series the exported rules produce:
//!
//! * `overview.json` — success rate, QPS, in-flight requests, TTFT and TPOT P50/P95/P99 over
//!   the rules' window (recorded series) and over 1 h side by side, token rate in/out;
//! * `performance.json` — the queue / prefill / decode split (ClickHouse: the gateway exports
//!   no per-phase histogram), TTFT by input-length bucket, end-to-end latency by request type,
//!   engine running / waiting / KV-cache usage, gateway overhead;
//! * `cost.json` — tokens by model and type and by user bucket, budget usage per business
//!   line (Prometheus), tokens and cost by business line and by user (ClickHouse: business
//!   line and user are not Prometheus labels, on purpose — unbounded cardinality).
//!
//! Data sources are dashboard variables: `datasource` (type `prometheus`) and `clickhouse`
//! (type [`CLICKHOUSE_TYPE`]), so an import needs no `__inputs` mapping. Filters: `model`,
//! `request_type`, `upstream`, `business_line` (`label_values` over the metrics that carry the
//! label; "All" is the regex `.*`).
//!
//! Invariants:
//! * Deterministic: the same thresholds give the same JSON (ids, positions, order).
//! * Only metric names and labels the gateway exports (`tokenscope-telemetry`,
//!   `tokenscope-engine-state`'s collector) and series recorded by [`crate::rules`]; every
//!   PromQL target and every ClickHouse SQL target is executed against a real Prometheus and
//!   ClickHouse by `crates/tokenscope-cli/tests/grafana.rs`.
//! * Panel ids are unique per dashboard, grid positions fit the 24-column grid and never
//!   overlap (panels are laid out left to right, row by row).

use crate::alerts::AlertThresholds;
use crate::rules::{prom_duration, EXCLUDED_STATUSES, SUCCESS_STATUS};
use serde_json::{json, Value};

/// Grafana dashboard JSON schema version written (Grafana 10.4 / 11.0).
pub const SCHEMA_VERSION: u64 = 39;
/// Plugin id of the Prometheus data source.
pub const PROMETHEUS_TYPE: &str = "prometheus";
/// Plugin id of the ClickHouse data source (Grafana Labs' plugin, v4).
pub const CLICKHOUSE_TYPE: &str = "grafana-clickhouse-datasource";
/// Table the SQL panels read, unqualified: the ClickHouse data source's default database
/// must be the store's database.
pub const CLICKHOUSE_TABLE: &str = "llm_inference_log";
/// Window of the long-term quantile panels (beside the rules' window).
pub const LONG_WINDOW: &str = "1h";

/// One dashboard file.
#[derive(Debug, Clone, PartialEq)]
pub struct DashboardFile {
    /// File name (`overview.json`, …).
    pub file_name: &'static str,
    /// The dashboard (Grafana JSON model).
    pub dashboard: Value,
}

/// The three dashboards, in the order overview, performance, cost.
pub fn dashboards(t: &AlertThresholds) -> Vec<DashboardFile> {
    let w = prom_duration(t.rate_window_seconds.max(1));
    vec![
        DashboardFile {
            file_name: "overview.json",
            dashboard: overview(t, &w),
        },
        DashboardFile {
            file_name: "performance.json",
            dashboard: performance(),
        },
        DashboardFile {
            file_name: "cost.json",
            dashboard: cost(t, &w),
        },
    ]
}

/// A PromQL target of a dashboard (template variables left in place).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Title of the panel it belongs to.
    pub panel: String,
    /// `refId`.
    pub ref_id: String,
    /// Data source plugin id ([`PROMETHEUS_TYPE`] or [`CLICKHOUSE_TYPE`]).
    pub datasource: String,
    /// The query: PromQL `expr` or ClickHouse `rawSql`.
    pub query: String,
}

/// Every target of every panel of `dashboard`, in panel order.
pub fn targets(dashboard: &Value) -> Vec<Target> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().into_iter().flatten() {
        let title = p["title"].as_str().unwrap_or_default();
        for t in p["targets"].as_array().into_iter().flatten() {
            let ds = t["datasource"]["type"]
                .as_str()
                .or_else(|| p["datasource"]["type"].as_str())
                .unwrap_or_default();
            let query = t["expr"]
                .as_str()
                .or_else(|| t["rawSql"].as_str())
                .unwrap_or_default();
            out.push(Target {
                panel: title.to_owned(),
                ref_id: t["refId"].as_str().unwrap_or_default().to_owned(),
                datasource: ds.to_owned(),
                query: query.to_owned(),
            });
        }
    }
    out
}

fn prom_ds() -> Value {
    json!({"type": PROMETHEUS_TYPE, "uid": "${datasource}"})
}

fn ch_ds() -> Value {
    json!({"type": CLICKHOUSE_TYPE, "uid": "${clickhouse}"})
}

/// Panels placed left to right on the 24-column grid, wrapping to a new row.
#[derive(Default)]
struct Grid {
    panels: Vec<Value>,
    x: u64,
    y: u64,
    row_h: u64,
}

impl Grid {
    fn add(&mut self, w: u64, h: u64, mut panel: Value) {
        let w = w.clamp(1, 24);
        if self.x + w > 24 {
            self.y += self.row_h;
            self.x = 0;
            self.row_h = 0;
        }
        panel["id"] = json!(self.panels.len() + 1);
        panel["gridPos"] = json!({"h": h, "w": w, "x": self.x, "y": self.y});
        self.x += w;
        self.row_h = self.row_h.max(h);
        self.panels.push(panel);
    }

    /// A full-width row header.
    fn row(&mut self, title: &str) {
        if self.x > 0 {
            self.y += self.row_h;
            self.x = 0;
            self.row_h = 0;
        }
        let id = self.panels.len() + 1;
        self.panels.push(json!({
            "type": "row",
            "id": id,
            "title": title,
            "collapsed": false,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            "panels": [],
        }));
        self.y += 1;
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Viz {
    TimeSeries,
    Stat,
    BarGauge,
    Table,
}

impl Viz {
    fn id(self) -> &'static str {
        match self {
            Viz::TimeSeries => "timeseries",
            Viz::Stat => "stat",
            Viz::BarGauge => "bargauge",
            Viz::Table => "table",
        }
    }

    fn options(self) -> Value {
        let reduce = json!({"calcs": ["lastNotNull"], "fields": "", "values": false});
        match self {
            Viz::TimeSeries => json!({
                "legend": {"displayMode": "table", "placement": "bottom", "showLegend": true,
                           "calcs": ["lastNotNull", "max"]},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }),
            Viz::Stat => json!({
                "reduceOptions": reduce, "colorMode": "value", "graphMode": "area",
                "justifyMode": "auto", "orientation": "auto", "textMode": "auto",
            }),
            Viz::BarGauge => json!({
                "reduceOptions": reduce, "displayMode": "gradient", "orientation": "horizontal",
                "showUnfilled": true,
            }),
            Viz::Table => json!({"showHeader": true, "cellHeight": "sm"}),
        }
    }
}

fn ref_id(i: usize) -> String {
    char::from(b'A' + u8::try_from(i % 26).unwrap_or(0)).to_string()
}

/// A panel's field config. With `thresholds` (absolute steps, the alert thresholds) the
/// values are coloured by the step they fall in (`color.mode = "thresholds"`), and a time
/// series also draws the steps as lines; without, the classic palette and one green step.
fn field_config(unit: &str, thresholds: Option<Value>) -> Value {
    let by_threshold = thresholds.is_some();
    let steps = thresholds.unwrap_or_else(|| json!([{"color": "green", "value": null}]));
    let mut defaults = json!({
        "unit": unit,
        "color": {"mode": if by_threshold { "thresholds" } else { "palette-classic" }},
        "thresholds": {"mode": "absolute", "steps": steps},
    });
    if by_threshold {
        defaults["custom"] = json!({"thresholdsStyle": {"mode": "line"}});
    }
    json!({
        "defaults": defaults,
        "overrides": [],
    })
}

/// A Prometheus panel: `queries` are `(expr, legend)`.
fn prom(viz: Viz, title: &str, description: &str, unit: &str, queries: &[(String, &str)]) -> Value {
    prom_with(viz, title, description, unit, None, queries)
}

fn prom_with(
    viz: Viz,
    title: &str,
    description: &str,
    unit: &str,
    thresholds: Option<Value>,
    queries: &[(String, &str)],
) -> Value {
    let instant = viz != Viz::TimeSeries;
    let targets: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (expr, legend))| {
            json!({
                "refId": ref_id(i),
                "datasource": prom_ds(),
                "editorMode": "code",
                "expr": expr,
                "legendFormat": legend,
                "range": !instant,
                "instant": instant,
            })
        })
        .collect();
    json!({
        "type": viz.id(),
        "title": title,
        "description": description,
        "datasource": prom_ds(),
        "targets": targets,
        "fieldConfig": field_config(unit, thresholds),
        "options": viz.options(),
    })
}

/// A ClickHouse SQL panel; `time_series` selects the plugin's time-series format (a `time`
/// column plus value columns, long format split by the string columns), else a table.
fn sql(
    viz: Viz,
    title: &str,
    description: &str,
    unit: &str,
    time_series: bool,
    query: &str,
) -> Value {
    json!({
        "type": viz.id(),
        "title": title,
        "description": description,
        "datasource": ch_ds(),
        "targets": [{
            "refId": "A",
            "datasource": ch_ds(),
            "editorType": "sql",
            "queryType": if time_series { "timeseries" } else { "table" },
            "format": if time_series { 0 } else { 1 },
            "rawSql": query,
        }],
        "fieldConfig": field_config(unit, None),
        "options": viz.options(),
    })
}

fn datasource_var(name: &str, label: &str, plugin: &str) -> Value {
    json!({
        "type": "datasource",
        "name": name,
        "label": label,
        "query": plugin,
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "includeAll": false,
        "multi": false,
        "options": [],
    })
}

/// A multi-value `label_values` filter whose "All" is `.*`.
fn label_var(name: &str, label: &str, query: &str) -> Value {
    json!({
        "type": "query",
        "name": name,
        "label": label,
        "datasource": prom_ds(),
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "regex": "",
        "includeAll": true,
        "allValue": ".*",
        "multi": true,
        "current": {"selected": true, "text": ["All"], "value": ["$__all"]},
        "options": [],
    })
}

fn model_var() -> Value {
    label_var("model", "Model", "label_values(llm_requests_total, model)")
}

fn request_type_var() -> Value {
    label_var(
        "request_type",
        "Request type",
        "label_values(llm_requests_total{model=~\"$model\"}, request_type)",
    )
}

fn dashboard(uid: &str, title: &str, description: &str, vars: Vec<Value>, grid: Grid) -> Value {
    json!({
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["tokenscope", "llm"],
        "timezone": "browser",
        "editable": true,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {"refresh_intervals": ["10s", "30s", "1m", "5m", "15m", "1h"]},
        "fiscalYearStartMonth": 0,
        "liveNow": false,
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": true,
            "hide": true,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }]},
        "templating": {"list": vars},
        "panels": grid.panels,
    })
}

const M: &str = "model=~\"$model\"";
const MR: &str = "model=~\"$model\",request_type=~\"$request_type\"";

fn overview(t: &AlertThresholds, w: &str) -> Value {
    let mut g = Grid::default();
    let ok_ratio = format!(
        "sum(rate(llm_requests_total{{{MR},status=\"{SUCCESS_STATUS}\"}}[$__rate_interval])) \
         / sum(rate(llm_requests_total{{{MR},status!~\"{EXCLUDED_STATUSES}\"}}[$__rate_interval]))"
    );
    g.row("Traffic");
    g.add(
        6,
        5,
        prom_with(
            Viz::Stat,
            "Success rate",
            "ok / (all − client errors − cancellations) over the rate interval; red below the \
             alert threshold",
            "percentunit",
            Some(json!([
                {"color": "red", "value": null},
                {"color": "green", "value": t.success_ratio_min},
            ])),
            &[(ok_ratio, "success rate")],
        ),
    );
    g.add(
        6,
        5,
        prom(
            Viz::Stat,
            "QPS",
            "Measured requests per second (all outcomes)",
            "reqps",
            &[(
                format!("sum(rate(llm_requests_total{{{MR}}}[$__rate_interval]))"),
                "req/s",
            )],
        ),
    );
    g.add(
        6,
        5,
        prom(
            Viz::Stat,
            "In flight",
            "Requests being served by the gateway now",
            "short",
            &[(format!("sum(llm_requests_in_flight{{{M}}})"), "in flight")],
        ),
    );
    g.add(
        6,
        5,
        prom(
            Viz::Stat,
            "Tokens / s",
            "Input + output tokens per second (cached tokens are part of input)",
            "short",
            &[(
                format!(
                    "sum(rate(llm_tokens_total{{{M},token_type=~\"input|output\"}}[$__rate_interval]))"
                ),
                "tokens/s",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "QPS by status",
            "Requests per second by outcome",
            "reqps",
            &[(
                format!("sum by (status) (rate(llm_requests_total{{{MR}}}[$__rate_interval]))"),
                "{{status}}",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            &format!("Success rate by model ({w}, recorded)"),
            "llm:request_success_ratio recorded by the exported rules",
            "percentunit",
            &[(
                format!("llm:request_success_ratio:rate{w}{{{M}}}"),
                "{{model}}",
            )],
        ),
    );
    for (metric, name, recorded, unit_note) in [
        (
            "llm_ttft_seconds",
            "TTFT",
            "ttft_seconds",
            "arrival to first content chunk, streamed requests",
        ),
        (
            "llm_tpot_seconds",
            "TPOT",
            "tpot_seconds",
            "(t_last − t_first)/(n_out − 1), n_out ≥ 2",
        ),
    ] {
        g.row(&format!("{name} quantiles ({w} | {LONG_WINDOW})"));
        let short: Vec<(String, &str)> = ["p50", "p90", "p95", "p99"]
            .iter()
            .zip([
                "P50 {{model}}",
                "P90 {{model}}",
                "P95 {{model}}",
                "P99 {{model}}",
            ])
            .map(|(q, legend)| (format!("llm:{recorded}:{q}_{w}{{{M}}}"), legend))
            .collect();
        g.add(
            12,
            8,
            prom(
                Viz::TimeSeries,
                &format!("{name} P50 / P90 / P95 / P99 — {w}"),
                &format!("{name} ({unit_note}); recorded series of the exported rules"),
                "s",
                &short,
            ),
        );
        let long: Vec<(String, &str)> = [
            ("0.5", "P50 {{model}}"),
            ("0.9", "P90 {{model}}"),
            ("0.95", "P95 {{model}}"),
            ("0.99", "P99 {{model}}"),
        ]
            .iter()
            .map(|(q, legend)| {
                (
                    format!(
                        "histogram_quantile({q}, sum by (le, model) (rate({metric}_bucket{{{M}}}[{LONG_WINDOW}])))"
                    ),
                    *legend,
                )
            })
            .collect();
        g.add(
            12,
            8,
            prom(
                Viz::TimeSeries,
                &format!("{name} P50 / P90 / P95 / P99 — {LONG_WINDOW}"),
                &format!("{name} ({unit_note}) over {LONG_WINDOW}"),
                "s",
                &long,
            ),
        );
    }
    g.row("Tokens");
    g.add(
        24,
        8,
        prom(
            Viz::TimeSeries,
            "Token rate in / out",
            "Tokens per second by type and model (input includes cached)",
            "short",
            &[
                (
                    format!(
                        "sum by (model) (rate(llm_tokens_total{{{M},token_type=\"input\"}}[$__rate_interval]))"
                    ),
                    "in {{model}}",
                ),
                (
                    format!(
                        "sum by (model) (rate(llm_tokens_total{{{M},token_type=\"output\"}}[$__rate_interval]))"
                    ),
                    "out {{model}}",
                ),
            ],
        ),
    );
    dashboard(
        "tokenscope-overview",
        "tokenscope — Overview",
        "Success rate, QPS, TTFT / TPOT quantiles and token rates, from the tokenscope gateway's /metrics",
        vec![
            datasource_var("datasource", "Prometheus", PROMETHEUS_TYPE),
            model_var(),
            request_type_var(),
        ],
        g,
    )
}

fn sql_filter() -> String {
    format!(
        "FROM {CLICKHOUSE_TABLE} FINAL\nWHERE $__timeFilter(created_at)\n  \
         AND match(model, '^(${{model:regex}})$')\n  \
         AND match(request_type, '^(${{request_type:regex}})$')"
    )
}

fn performance() -> Value {
    let mut g = Grid::default();
    g.row("Where the time goes");
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "Queue / prefill / decode P95",
            "llm_request_phase_seconds: per-request phase times (the engine's own timing when it \
             reports one, else the gateway's estimate), P95 per phase",
            "s",
            &[(
                format!(
                    "histogram_quantile(0.95, sum by (le, phase) (rate(llm_request_phase_seconds_bucket{{{M}}}[$__rate_interval])))"
                ),
                "{{phase}} P95",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "Queue / prefill / decode (mean)",
            "Mean time per phase: rate of the histogram's sum over the rate of its count",
            "s",
            &[(
                format!(
                    "sum by (phase) (rate(llm_request_phase_seconds_sum{{{M}}}[$__rate_interval])) / sum by (phase) (rate(llm_request_phase_seconds_count{{{M}}}[$__rate_interval]))"
                ),
                "{{phase}}",
            )],
        ),
    );
    g.add(
        12,
        9,
        sql(
            Viz::TimeSeries,
            "Queue / prefill / decode (mean, ClickHouse)",
            "Mean phase durations of the stored records (exact, per record); source of each \
             phase per record in queue_source / prefill_source / decode_source",
            "s",
            true,
            &format!(
                "SELECT $__timeInterval(created_at) AS time,\n  \
                 avg(queue_duration_ms) / 1000 AS queue,\n  \
                 avg(prefill_duration_ms) / 1000 AS prefill,\n  \
                 avg(decode_duration_ms) / 1000 AS decode\n{}\nGROUP BY time\nORDER BY time",
                sql_filter()
            ),
        ),
    );
    g.add(
        12,
        9,
        sql(
            Viz::Table,
            "Phase split by input bucket (ClickHouse)",
            "P50 / P95 of queue, prefill and decode by input-length bucket",
            "s",
            false,
            &format!(
                "SELECT ifNull(input_bucket, 'unknown') AS bucket,\n  count() AS requests,\n  \
                 quantile(0.5)(queue_duration_ms) / 1000 AS queue_p50,\n  \
                 quantile(0.95)(queue_duration_ms) / 1000 AS queue_p95,\n  \
                 quantile(0.5)(prefill_duration_ms) / 1000 AS prefill_p50,\n  \
                 quantile(0.95)(prefill_duration_ms) / 1000 AS prefill_p95,\n  \
                 quantile(0.5)(decode_duration_ms) / 1000 AS decode_p50,\n  \
                 quantile(0.95)(decode_duration_ms) / 1000 AS decode_p95\n{}\n\
                 GROUP BY bucket\nORDER BY bucket",
                sql_filter()
            ),
        ),
    );
    g.row("Latency");
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "TTFT by input-length bucket",
            "TTFT P50 / P95 by input-token bucket (0-128, 128-512, 512-2048, 2048+)",
            "s",
            &[
                (
                    format!(
                        "histogram_quantile(0.5, sum by (le, input_bucket) (rate(llm_ttft_seconds_bucket{{{M}}}[$__rate_interval])))"
                    ),
                    "P50 {{input_bucket}}",
                ),
                (
                    format!(
                        "histogram_quantile(0.95, sum by (le, input_bucket) (rate(llm_ttft_seconds_bucket{{{M}}}[$__rate_interval])))"
                    ),
                    "P95 {{input_bucket}}",
                ),
            ],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "End-to-end latency by request type",
            "Request latency P50 / P95 as seen by the gateway",
            "s",
            &[
                (
                    format!(
                        "histogram_quantile(0.5, sum by (le, request_type) (rate(llm_request_latency_seconds_bucket{{{MR}}}[$__rate_interval])))"
                    ),
                    "P50 {{request_type}}",
                ),
                (
                    format!(
                        "histogram_quantile(0.95, sum by (le, request_type) (rate(llm_request_latency_seconds_bucket{{{MR}}}[$__rate_interval])))"
                    ),
                    "P95 {{request_type}}",
                ),
            ],
        ),
    );
    g.row("Engines");
    let u = "upstream=~\"$upstream\"";
    g.add(
        8,
        8,
        prom(
            Viz::TimeSeries,
            "Engine requests running",
            "Requests in the engine's batches (scraped by the gateway from the engine's /metrics)",
            "short",
            &[(
                format!("sum by (upstream) (llm_engine_requests_running{{{u}}})"),
                "{{upstream}}",
            )],
        ),
    );
    g.add(
        8,
        8,
        prom(
            Viz::TimeSeries,
            "Engine requests waiting",
            "Requests queued in the engine (recorded llm:engine_requests_waiting:max)",
            "short",
            &[(
                format!("llm:engine_requests_waiting:max{{{u}}}"),
                "{{upstream}}",
            )],
        ),
    );
    g.add(
        8,
        8,
        prom_with(
            Viz::TimeSeries,
            "KV-cache usage",
            "KV-cache usage of each engine, 0–1",
            "percentunit",
            Some(json!([
                {"color": "green", "value": null},
                {"color": "orange", "value": 0.8},
                {"color": "red", "value": 0.95},
            ])),
            &[(
                format!("max by (upstream) (llm_engine_kv_cache_usage_ratio{{{u}}})"),
                "{{upstream}}",
            )],
        ),
    );
    g.add(
        12,
        7,
        prom(
            Viz::Stat,
            "Engine state known",
            "1 while the gateway reads the engine's metrics, 0 when its state is unknown",
            "short",
            &[(
                format!("min by (upstream) (llm_engine_state_up{{{u}}})"),
                "{{upstream}}",
            )],
        ),
    );
    g.add(
        12,
        7,
        prom(
            Viz::TimeSeries,
            "Gateway overhead P99",
            "Arrival to the request leaving for the upstream",
            "s",
            &[(
                "histogram_quantile(0.99, sum by (le) (rate(tokenscope_gateway_overhead_seconds_bucket[$__rate_interval])))"
                    .to_owned(),
                "P99",
            )],
        ),
    );
    // The resource layer (article: "GPU 95 % busy but memory bandwidth 40 %": a batch held
    // small by the KV cache). From the gateway's `[gpu]` reading (NVML or a DCGM exporter).
    g.row("GPU");
    g.add(
        8,
        8,
        prom_with(
            Viz::TimeSeries,
            "GPU utilization",
            "Share of time a kernel ran on each GPU, 0–1 (NVML utilization.gpu / DCGM_FI_DEV_GPU_UTIL)",
            "percentunit",
            Some(json!([
                {"color": "green", "value": null},
                {"color": "orange", "value": 0.9},
            ])),
            &[(
                "max by (gpu) (llm_gpu_utilization_ratio)".to_owned(),
                "GPU {{gpu}}",
            )],
        ),
    );
    g.add(
        8,
        8,
        prom(
            Viz::TimeSeries,
            "GPU memory bandwidth",
            "Memory-bandwidth utilization of each GPU, 0–1 (NVML utilization.memory / DCGM_FI_PROF_DRAM_ACTIVE): low while the GPU is busy means small batches",
            "percentunit",
            &[(
                "max by (gpu) (llm_gpu_memory_bandwidth_utilization_ratio)".to_owned(),
                "GPU {{gpu}}",
            )],
        ),
    );
    g.add(
        8,
        8,
        prom(
            Viz::TimeSeries,
            "GPU memory used",
            "Used / total memory of each GPU, 0–1 (the KV cache lives here)",
            "percentunit",
            &[(
                "max by (gpu) (llm_gpu_memory_used_bytes) / max by (gpu) (llm_gpu_memory_total_bytes)"
                    .to_owned(),
                "GPU {{gpu}}",
            )],
        ),
    );
    dashboard(
        "tokenscope-performance",
        "tokenscope — Performance",
        "Queue / prefill / decode split, latency by input length and request type, engine load and KV cache, GPU",
        vec![
            datasource_var("datasource", "Prometheus", PROMETHEUS_TYPE),
            datasource_var("clickhouse", "ClickHouse", CLICKHOUSE_TYPE),
            model_var(),
            request_type_var(),
            label_var(
                "upstream",
                "Upstream",
                "label_values(llm_engine_state_up, upstream)",
            ),
        ],
        g,
    )
}

fn cost(t: &AlertThresholds, w: &str) -> Value {
    let mut g = Grid::default();
    g.row("Tokens (Prometheus)");
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            &format!("Tokens by model and type ({w}, recorded)"),
            "llm:tokens rate recorded by the exported rules",
            "short",
            &[(
                format!("llm:tokens:rate{w}{{{M}}}"),
                "{{model}} {{token_type}}",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "Tokens by user bucket (top 10)",
            "Hashed or top-K user label of llm_tokens_total (users are not Prometheus labels; \
             see the ClickHouse table below for users)",
            "short",
            &[(
                format!(
                    "topk(10, sum by (user_bucket) (rate(llm_tokens_total{{{M},token_type!=\"cached\"}}[$__rate_interval])))"
                ),
                "{{user_bucket}}",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "Tokens by business line",
            "llm_business_line_tokens_total: input / output tokens per business line",
            "short",
            &[(
                "sum by (business_line, token_type) (rate(llm_business_line_tokens_total{business_line=~\"$business_line\",token_type!=\"cached\"}[$__rate_interval]))"
                    .to_owned(),
                "{{business_line}} {{token_type}}",
            )],
        ),
    );
    g.add(
        12,
        8,
        prom(
            Viz::TimeSeries,
            "Cost by business line (USD per hour)",
            "llm_cost_usd_total: cost of priced requests at the configured [[prices]], as USD/h",
            "currencyUSD",
            &[(
                format!(
                    "3600 * sum by (business_line) (rate(llm_cost_usd_total{{{M},business_line=~\"$business_line\"}}[$__rate_interval]))"
                ),
                "{{business_line}}",
            )],
        ),
    );
    g.add(
        24,
        7,
        prom(
            Viz::BarGauge,
            "Cost in the time range by business line",
            "increase of llm_cost_usd_total over the dashboard's time range",
            "currencyUSD",
            &[(
                format!(
                    "sum by (business_line) (increase(llm_cost_usd_total{{{M},business_line=~\"$business_line\"}}[$__range]))"
                ),
                "{{business_line}}",
            )],
        ),
    );
    g.row("Budgets");
    g.add(
        24,
        7,
        prom_with(
            Viz::BarGauge,
            "Budget usage by business line",
            "Used / budget of the current period (llm_budget_usage_ratio; 1 = spent)",
            "percentunit",
            Some(json!([
                {"color": "green", "value": null},
                {"color": "orange", "value": t.budget_warning_ratio},
                {"color": "red", "value": t.budget_exceeded_ratio},
            ])),
            &[(
                "max by (business_line) (llm_budget_usage_ratio{business_line=~\"$business_line\"})"
                    .to_owned(),
                "{{business_line}}",
            )],
        ),
    );
    g.row("Cost (ClickHouse)");
    g.add(
        12,
        9,
        sql(
            Viz::TimeSeries,
            "Cost by business line",
            "USD at the configured prices (cost_usd of each record), per business line",
            "currencyUSD",
            true,
            &format!(
                "SELECT $__timeInterval(created_at) AS time,\n  \
                 ifNull(business_line, '(none)') AS line,\n  \
                 sum(ifNull(cost_usd, 0)) AS cost\n{}\nGROUP BY time, line\nORDER BY time",
                sql_filter()
            ),
        ),
    );
    g.add(
        12,
        9,
        sql(
            Viz::Table,
            "Tokens and cost by business line",
            "Requests, tokens and USD per business line over the time range",
            "short",
            false,
            &format!(
                "SELECT ifNull(business_line, '(none)') AS line,\n  count() AS requests,\n  \
                 sum(ifNull(input_tokens, 0)) AS tokens_in,\n  \
                 sum(ifNull(output_tokens, 0)) AS tokens_out,\n  \
                 round(sum(ifNull(cost_usd, 0)), 6) AS cost_usd_total\n{}\n\
                 GROUP BY line\nORDER BY cost_usd_total DESC, line",
                sql_filter()
            ),
        ),
    );
    g.add(
        24,
        10,
        sql(
            Viz::Table,
            "Tokens and cost by user (top 50)",
            "Per user (user_id of the records): requests, tokens, USD; only the store has users",
            "short",
            false,
            &format!(
                "SELECT ifNull(user_id, '(none)') AS user_label,\n  count() AS requests,\n  \
                 sum(ifNull(input_tokens, 0)) AS tokens_in,\n  \
                 sum(ifNull(output_tokens, 0)) AS tokens_out,\n  \
                 round(sum(ifNull(cost_usd, 0)), 6) AS cost_usd_total\n{}\n\
                 GROUP BY user_label\nORDER BY tokens_in + tokens_out DESC, user_label\nLIMIT 50",
                sql_filter()
            ),
        ),
    );
    dashboard(
        "tokenscope-cost",
        "tokenscope — Cost",
        "Tokens and cost by model, business line and user; budget usage",
        vec![
            datasource_var("datasource", "Prometheus", PROMETHEUS_TYPE),
            datasource_var("clickhouse", "ClickHouse", CLICKHOUSE_TYPE),
            model_var(),
            request_type_var(),
            label_var(
                "business_line",
                "Business line",
                "label_values(llm_business_line_tokens_total, business_line)",
            ),
        ],
        g,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn all() -> Vec<DashboardFile> {
        dashboards(&AlertThresholds::default())
    }

    #[test]
    fn threshold_panels_colour_by_threshold() {
        let mut with = 0;
        for f in all() {
            for p in f.dashboard["panels"].as_array().into_iter().flatten() {
                let d = &p["fieldConfig"]["defaults"];
                let steps = d["thresholds"]["steps"].as_array().map_or(0, Vec::len);
                let mode = d["color"]["mode"].as_str();
                if steps > 1 {
                    with += 1;
                    assert_eq!(mode, Some("thresholds"), "{}", p["title"]);
                    assert!(
                        steps >= 2 && d["thresholds"]["mode"] == "absolute",
                        "{}",
                        p["title"]
                    );
                } else if d.is_object() {
                    assert_eq!(mode, Some("palette-classic"), "{}", p["title"]);
                }
            }
        }
        assert!(
            with >= 3,
            "the success, KV and budget panels have thresholds"
        );
        let ok = field_config(
            "percentunit",
            Some(json!([{"color": "red", "value": null}, {"color": "green", "value": 0.99}])),
        );
        assert_eq!(ok["defaults"]["color"]["mode"], "thresholds");
        assert_eq!(ok["defaults"]["thresholds"]["steps"][1]["value"], 0.99);
    }

    #[test]
    fn grafana_three_deterministic_dashboards() {
        let d = all();
        assert_eq!(d, all());
        let names: Vec<&str> = d.iter().map(|f| f.file_name).collect();
        assert_eq!(names, ["overview.json", "performance.json", "cost.json"]);
        let uids: HashSet<&str> = d
            .iter()
            .filter_map(|f| f.dashboard["uid"].as_str())
            .collect();
        assert_eq!(uids.len(), 3);
        for f in &d {
            assert_eq!(f.dashboard["schemaVersion"], SCHEMA_VERSION);
            let vars = f.dashboard["templating"]["list"]
                .as_array()
                .expect("variables");
            assert!(vars
                .iter()
                .any(|v| v["name"] == "datasource" && v["query"] == PROMETHEUS_TYPE));
        }
    }

    #[test]
    fn grafana_ids_unique_and_grid_does_not_overlap() {
        for f in all() {
            let panels = f.dashboard["panels"].as_array().expect("panels");
            let ids: HashSet<u64> = panels.iter().filter_map(|p| p["id"].as_u64()).collect();
            assert_eq!(ids.len(), panels.len(), "{}", f.file_name);
            let cells: Vec<(u64, u64, u64, u64)> = panels
                .iter()
                .map(|p| {
                    let g = &p["gridPos"];
                    let n = |k: &str| g[k].as_u64().expect("grid number");
                    (n("x"), n("y"), n("w"), n("h"))
                })
                .collect();
            for (i, a) in cells.iter().enumerate() {
                assert!(a.0 + a.2 <= 24, "{}: {a:?}", f.file_name);
                for b in &cells[i + 1..] {
                    let overlap =
                        a.0 < b.0 + b.2 && b.0 < a.0 + a.2 && a.1 < b.1 + b.3 && b.1 < a.1 + a.3;
                    assert!(!overlap, "{}: {a:?} {b:?}", f.file_name);
                }
            }
        }
    }

    #[test]
    fn grafana_targets_use_the_right_data_source_and_recorded_series() {
        let d = all();
        let t: Vec<Target> = d.iter().flat_map(|f| targets(&f.dashboard)).collect();
        assert!(t
            .iter()
            .all(|t| !t.query.is_empty() && !t.ref_id.is_empty()));
        for x in &t {
            match x.datasource.as_str() {
                PROMETHEUS_TYPE => assert!(!x.query.contains("SELECT"), "{x:?}"),
                CLICKHOUSE_TYPE => assert!(x.query.contains(CLICKHOUSE_TABLE), "{x:?}"),
                other => panic!("data source {other}"),
            }
        }
        let all_q: String = t.iter().map(|t| t.query.as_str()).collect();
        for recorded in [
            "llm:ttft_seconds:p99_5m",
            "llm:tpot_seconds:p50_5m",
            "llm:request_success_ratio:rate5m",
            "llm:tokens:rate5m",
            "llm:engine_requests_waiting:max",
        ] {
            assert!(all_q.contains(recorded), "{recorded}");
        }
        // Every recorded series used exists in the exported rules.
        let rules = crate::rules::prometheus_rules(&AlertThresholds::default());
        for x in t.iter().filter(|t| t.datasource == PROMETHEUS_TYPE) {
            for word in x
                .query
                .split(|c: char| !(c.is_alphanumeric() || c == ':' || c == '_'))
            {
                if word.starts_with("llm:") {
                    assert!(rules.contains(&format!("- record: {word}\n")), "{word}");
                }
            }
        }
        // The rules' window follows the thresholds.
        let t2 = AlertThresholds {
            rate_window_seconds: 120,
            ..AlertThresholds::default()
        };
        let o = &dashboards(&t2)[0].dashboard;
        assert!(o.to_string().contains("llm:ttft_seconds:p95_2m"));
    }
}

#[cfg(test)]
mod schema_tests {
    use super::*;

    /// The strict schema of the Grafana dashboard model subset we emit (see its `$comment`).
    const SCHEMA: &str = include_str!("../tests/data/grafana-dashboard.schema.json");

    fn validator() -> jsonschema::Validator {
        let schema: Value = serde_json::from_str(SCHEMA).expect("schema is JSON");
        jsonschema::draft7::new(&schema).expect("schema compiles")
    }

    #[test]
    fn grafana_dashboards_pass_the_schema() {
        let v = validator();
        for f in dashboards(&AlertThresholds::default()) {
            let errors: Vec<String> = v
                .iter_errors(&f.dashboard)
                .map(|e| format!("{}: {e}", e.instance_path()))
                .collect();
            assert!(errors.is_empty(), "{}: {errors:#?}", f.file_name);
        }
    }

    #[test]
    fn grafana_schema_rejects_broken_dashboards() {
        let v = validator();
        let good = dashboards(&AlertThresholds::default())[0].dashboard.clone();
        let broken = |edit: &dyn Fn(&mut Value)| {
            let mut d = good.clone();
            edit(&mut d);
            !v.is_valid(&d)
        };
        assert!(v.is_valid(&good));
        assert!(broken(&|d| d["panels"][1]["gridPos"]["w"] = json!(25)));
        assert!(broken(
            &|d| d["panels"][1]["targets"][0]["refId"] = json!("")
        ));
        assert!(broken(&|d| {
            d["panels"][1]["targets"][0]
                .as_object_mut()
                .expect("target")
                .remove("expr");
        }));
        assert!(broken(
            &|d| d["panels"][1]["fieldConfig"]["defaults"]["unit"] = json!("")
        ));
        assert!(broken(&|d| d["schemaVersion"] = json!("39")));
        assert!(broken(
            &|d| d["templating"]["list"][0]["query"] = json!("influxdb")
        ));
        assert!(broken(
            &|d| d["panels"][1]["targets"][0]["datasource"]["type"] = json!("loki")
        ));
        assert!(broken(&|d| d["panels"][1]["unknown"] = json!(1)));
        assert!(broken(&|d| {
            d.as_object_mut().expect("dashboard").remove("uid");
        }));
    }
}
