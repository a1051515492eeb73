//! `tokenscope` — per-request token and latency observability for LLM inference.
//!
//! This binary is glue: argument parsing, logging, signals, and wiring of the library crates.
//! `anyhow` is used here only.

mod analyze;
mod args;
mod bench;
mod demo;
mod duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};
use tokenscope_gateway::{redact_url, Gateway, GatewayConfig, StoreTarget};
use tokenscope_store::{render, Dimension, ReportQuery};

#[derive(Parser)]
#[command(
    name = "tokenscope",
    version,
    about = "Per-request token and latency observability for LLM inference",
    after_help = LOG_HELP
)]
struct Cli {
    /// Log format on stderr (the filter is TOKENSCOPE_LOG, EnvFilter syntax, default `info`).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "TOKENSCOPE_LOG_FORMAT",
        default_value_t
    )]
    log_format: args::LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The logging environment, shown under every command's `--help`.
const LOG_HELP: &str = "Logging: messages go to stderr. TOKENSCOPE_LOG sets the filter \
(tracing-subscriber EnvFilter syntax, e.g. `debug` or `info,tokenscope_gateway=debug`; default \
`info`); TOKENSCOPE_LOG_FORMAT (or --log-format) chooses `text` or `json`. Colours only when \
stderr is a terminal.";

#[derive(Subcommand)]
enum Cmd {
    /// Run the measuring gateway (OpenAI-compatible reverse proxy).
    Serve(ServeArgs),
    /// Report latency and token percentiles from the store.
    Report(ReportArgs),
    /// Run the built-in simulated engine (OpenAI-compatible).
    MockEngine(MockArgs),
    /// Mock engine + gateway + mixed traffic, then print the report.
    Demo(demo::DemoArgs),
    /// Tokens and cost by business line, tenant, user, model, request type, with trends.
    Cost(analyze::cost::CostArgs),
    /// Budgets per business line: status, projected exhaustion, abnormal growth.
    Budget(analyze::budget::BudgetArgs),
    /// Token spikes, request loops, duplicate bursts and sudden drops, per caller.
    Anomalies(analyze::anomalies::AnomaliesArgs),
    /// Duplicate prompts, truncated or overlong outputs, bloated prompts; estimated saving.
    Waste(analyze::waste::WasteArgs),
    /// Walk the decision tree: success rate, TTFT, TPOT, tokens, network; verdict + remedies
    /// (exit status 3 on a problem with --fail-on-problem).
    Diagnose(analyze::diagnose::DiagnoseArgs),
    /// The load knee (sustainable QPS under the SLO) and when growth reaches it.
    Capacity(analyze::capacity::CapacityArgs),
    /// Export configuration for other systems (`prometheus-rules`).
    Export(analyze::rules::ExportArgs),
    /// Open-loop load test of an OpenAI-compatible endpoint: percentiles per rate, the knee
    /// (exits 1 naming the causes when every request failed).
    Bench(bench::BenchArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Upstream engine base URL (one; for several upstreams routed by model use --config).
    /// Without any upstream, the built-in mock engine is started and used.
    #[arg(long, env = "TOKENSCOPE_UPSTREAM")]
    upstream: Option<String>,
    /// Proxy listen address [default: 127.0.0.1:4000].
    #[arg(long)]
    listen: Option<String>,
    /// Admin listen address for /metrics and the admin API [default: 127.0.0.1:9464].
    #[arg(long)]
    admin_listen: Option<String>,
    /// Store: path of the SQLite file [default: ./tokenscope.db], or
    /// `clickhouse://[user:pass@]host:8123/database[?cluster=NAME&shards=h1:8123,h2:8123]`.
    #[arg(long)]
    store: Option<String>,
    /// TOML configuration file.
    #[arg(long, env = "TOKENSCOPE_CONFIG")]
    config: Option<PathBuf>,
    /// Export one OpenTelemetry trace per kept request to this OTLP endpoint
    /// (`http[s]://HOST:4318` for OTLP/HTTP, `http[s]://HOST:4317` for OTLP/gRPC) [config:
    /// tracing.otlp_endpoint; env: OTEL_EXPORTER_OTLP_ENDPOINT].
    #[arg(long)]
    otlp_endpoint: Option<String>,
    /// OTLP transport: `http` (protobuf) or `grpc` [default: http].
    #[arg(long, value_enum, ignore_case = true)]
    otlp_protocol: Option<args::OtlpProtocol>,
    /// Fraction of ordinary requests whose trace is kept (errors, cancellations and slow
    /// requests are always kept) [default: 0.01].
    #[arg(long)]
    trace_sample_ratio: Option<f64>,
    /// Keep the trace of every request at least this slow end to end, e.g. `2s`, `750ms`.
    #[arg(long)]
    trace_slow_threshold: Option<String>,
    /// Worker threads of the gateway's runtime [config: worker_threads; default: one per core
    /// but one, at least one].
    #[arg(long)]
    worker_threads: Option<usize>,
    /// Nice value of the runtime's threads, -20 ..= 19 (like nginx's `worker_priority`; a
    /// negative value needs CAP_SYS_NICE or RLIMIT_NICE) [config: worker_priority; default: 0,
    /// unchanged].
    #[arg(long, allow_negative_numbers = true)]
    worker_priority: Option<i32>,
}

#[derive(Args)]
struct ReportArgs {
    /// Store: path of the SQLite file, or `clickhouse://[user:pass@]host:8123/database`
    /// (same results on both for the same records).
    #[arg(long, env = "TOKENSCOPE_STORE", default_value = "./tokenscope.db")]
    store: String,
    /// Window start: a duration before now (e.g. 15m, 1h, 7d) or an absolute Unix time
    /// `@SECONDS`.
    #[arg(long, default_value = "1h")]
    since: String,
    /// Window end, like --since (default: now).
    #[arg(long)]
    until: Option<String>,
    /// Group by these dimensions (comma-separated, in column order).
    #[arg(long, value_enum, value_delimiter = ',', ignore_case = true)]
    by: Vec<Dimension>,
    /// Split the window into buckets of this length (e.g. 1h, 1d).
    #[arg(long)]
    interval: Option<String>,
    /// Keep only rows where DIMENSION=VALUE (repeatable).
    #[arg(long = "filter", value_name = "DIM=VALUE")]
    filters: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t)]
    format: tokenscope_core::Format,
}

#[derive(Args)]
struct MockArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Parallel slots (continuous batching).
    #[arg(long, default_value_t = 8)]
    slots: usize,
    /// Seed of the output-length distribution.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Multiply every simulated duration (0.1 = ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Prefill cost per input token, ms [default: 0.05].
    #[arg(long)]
    prefill_ms_per_token: Option<f64>,
    /// Chunked-prefill budget per step, tokens [default: 512].
    #[arg(long)]
    max_prefill_tokens_per_step: Option<usize>,
    /// One decode step with a batch of one, ms [default: 8].
    #[arg(long)]
    decode_base_ms: Option<f64>,
    /// KV-cache capacity in tokens; admission waits while a prompt does not fit [default: 0 =
    /// unlimited, no KV model].
    #[arg(long)]
    kv_tokens: Option<u64>,
    /// Decode cost per KV token held by the sequences decoding in a step, ms [default: 0].
    #[arg(long)]
    decode_ms_per_kv_token: Option<f64>,
    /// Export one vLLM-style `llm_request` span (gen_ai.latency.* from the tokenscope SDK) per
    /// request that arrives with a traceparent, to this OTLP/HTTP endpoint (e.g. a gateway's
    /// admin listener, http://127.0.0.1:9464) [default: off].
    #[arg(long)]
    otlp_endpoint: Option<String>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by a CA of this PEM file (mutual TLS; with
    /// --tls-cert).
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Serve HTTPS on this address and plain HTTP on --listen, one engine behind both (with
    /// --tls-cert; without it HTTPS is served on --listen).
    #[arg(long, requires = "tls_cert")]
    tls_listen: Option<String>,
}

/// Logs to stderr, filtered by `TOKENSCOPE_LOG` (default `info`), as text or JSON lines.
/// Text is coloured only when stderr is a terminal and `NO_COLOR` is unset, so piped or
/// captured logs carry no escape codes; JSON is never coloured.
fn init_logging(format: args::LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("TOKENSCOPE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        args::LogFormat::Json => builder.json().with_ansi(false).init(),
        args::LogFormat::Text => {
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            builder.with_ansi(colour).init();
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

async fn serve(args: ServeArgs) -> Result<()> {
    let mut cfg = GatewayConfig::load(args.config.as_deref())?;
    if let Some(u) = &args.upstream {
        cfg.set_single_upstream(u);
    }
    if let Some(l) = args.listen {
        cfg.listen = l;
    }
    if let Some(l) = args.admin_listen {
        cfg.admin_listen = l;
    }
    if let Some(s) = args.store {
        cfg.store = s;
    }
    if let Some(e) = args.otlp_endpoint {
        // The flag wins over every other source, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` included.
        cfg.tracing.otlp_endpoint = Some(e);
        cfg.tracing.otlp_traces_endpoint = None;
    }
    if let Some(p) = args.worker_priority {
        // The runtime's threads got it in `main`; the background runtime derives its own.
        cfg.worker_priority = p;
    }
    if let Some(p) = args.otlp_protocol {
        cfg.tracing.otlp_protocol = p.as_str().to_owned();
    }
    if let Some(r) = args.trace_sample_ratio {
        cfg.tracing.sample_ratio = r;
    }
    if let Some(t) = args.trace_slow_threshold {
        cfg.tracing.slow_threshold = Some(tokenscope_gateway::DurationSetting::Text(t));
    }
    // Flags are applied after the file and the environment: check the result again.
    cfg.validate()?;
    let mut mock_task = None;
    if cfg.upstreams.is_empty() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "No upstream given: serving the built-in mock engine.");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(tokenscope_mock::serve(
            listener,
            tokenscope_mock::MockConfig::default(),
            async move {
                let _ = rx.await;
            },
        ));
        mock_task = Some((tx, task));
        cfg.set_single_upstream(&format!("http://{addr}"));
    }
    let gw = Gateway::bind(cfg.clone()).await?;
    // One machine-readable line on stdout: tests and scripts read the bound ports from it.
    println!(
        "tokenscope listening proxy={} admin={} store={}",
        gw.proxy_addr(),
        gw.admin_addr(),
        redact_url(&cfg.store)
    );
    tracing::info!(proxy = %gw.proxy_addr(), admin = %gw.admin_addr(), store = %redact_url(&cfg.store),
        upstreams = ?cfg.upstreams.iter().flat_map(|u| u.replica_urls().iter().map(|r| redact_url(r))).collect::<Vec<_>>(), "Gateway ready.");
    let summary = gw.run(shutdown_signal()).await?;
    if let Some((tx, task)) = mock_task {
        let _ = tx.send(());
        let _ = task.await;
    }
    tracing::info!(
        written = summary.store.written,
        duplicates = summary.store.duplicates,
        dropped = summary.store.dropped,
        lost = summary.store.lost,
        "Stopped."
    );
    Ok(())
}

/// A report bound (`--since`, `--until`): a duration before `now` (`15m`, `7d`), a date or
/// RFC 3339 timestamp (`2026-12-01`, `2026-12-01T10:00:00Z`) or `@UNIX_SECONDS`
/// ([`tokenscope_core::time::parse_time_bound`]).
fn time_arg(s: &str, now_us: i64) -> Result<i64> {
    Ok(tokenscope_core::time::parse_time_bound(s, now_us)?)
}

fn report(args: ReportArgs) -> Result<()> {
    let now = now_us();
    let since_us = time_arg(&args.since, now).context("--since")?;
    let until_us = match &args.until {
        Some(u) => Some(time_arg(u, now).context("--until")?),
        None => None,
    };
    let group_by: Vec<Dimension> = args.by.clone();
    let mut filters = Vec::new();
    for f in &args.filters {
        let Some((k, v)) = f.split_once('=') else {
            bail!("--filter expects DIMENSION=VALUE, got {f:?}");
        };
        filters.push((k.parse::<Dimension>()?, v.to_owned()));
    }
    let interval = args
        .interval
        .as_deref()
        .map(duration::parse)
        .transpose()
        .context("--interval")?;
    let q = ReportQuery {
        since_us,
        until_us,
        group_by,
        interval,
        filters,
    };
    let rows = tokenscope_backend::open_reader(&StoreTarget::parse(&args.store))?.report(&q)?;
    print!("{}", render(&rows, &q, args.format));
    Ok(())
}

async fn mock_engine(args: MockArgs) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    // Certificate files are read before the ready line: a bad file is reported at once.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(tokenscope_net::server_config(
            cert,
            key,
            args.tls_client_ca.as_deref(),
            &[b"http/1.1"],
        )?),
        _ => None,
    };
    let tls_listener = match &args.tls_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?,
        ),
        None => None,
    };
    // One line per listener; the first is --listen's.
    match &tls_listener {
        Some(t) => {
            println!(
                "tokenscope mock-engine listening on {}",
                listener.local_addr()?
            );
            println!(
                "tokenscope mock-engine listening on {} (https)",
                t.local_addr()?
            );
        }
        None => println!(
            "tokenscope mock-engine listening on {}{}",
            listener.local_addr()?,
            if tls.is_some() { " (https)" } else { "" }
        ),
    }
    let d = tokenscope_mock::MockConfig::default();
    let cfg = tokenscope_mock::MockConfig {
        slots: args.slots,
        seed: args.seed,
        time_scale: args.time_scale,
        prefill_ms_per_token: args.prefill_ms_per_token.unwrap_or(d.prefill_ms_per_token),
        max_prefill_tokens_per_step: args
            .max_prefill_tokens_per_step
            .unwrap_or(d.max_prefill_tokens_per_step),
        decode_base_ms: args.decode_base_ms.unwrap_or(d.decode_base_ms),
        kv_tokens: args.kv_tokens.unwrap_or(d.kv_tokens),
        decode_ms_per_kv_token: args
            .decode_ms_per_kv_token
            .unwrap_or(d.decode_ms_per_kv_token),
        otlp_endpoint: args.otlp_endpoint,
        ..d
    };
    match (tls, tls_listener) {
        (Some(tls), Some(secure)) => {
            tokenscope_mock::serve_tls(secure, tls, Some(listener), cfg, shutdown_signal()).await?
        }
        (Some(tls), None) => {
            tokenscope_mock::serve_tls(listener, tls, None, cfg, shutdown_signal()).await?
        }
        (None, _) => tokenscope_mock::serve(listener, cfg, shutdown_signal()).await?,
    }
    Ok(())
}

/// One malloc arena for the gateway process (glibc), unless `MALLOC_ARENA_MAX` says otherwise.
///
/// glibc gives each thread that allocates its own arena (up to 8 per core); memory freed into
/// one arena is not reused by another, so a gateway whose connections move between worker
/// threads keeps several partly empty heaps. With one arena the gateway holding 1 000 streams
/// measured 57 MiB instead of 62 MiB (docs/benchmarks.md); small allocations still go through
/// each thread's lock-free cache (tcache), so the shared arena's lock is rarely taken.
#[allow(unsafe_code)] // the workspace's only unsafe block: a libc call with no pointers
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: called first thing in `main`, before any other thread exists; `mallopt` only
        // sets an allocator parameter.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// Sets the calling thread's nice value (on Linux a per-thread attribute, which is what
/// `setpriority(PRIO_PROCESS, 0)` changes). Failure (a negative value without `CAP_SYS_NICE`
/// or `RLIMIT_NICE`) is logged once; the thread keeps its inherited priority.
fn set_thread_nice(nice: i32) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Err(e) = rustix::process::setpriority_process(None, nice) {
        WARNED.call_once(|| {
            tracing::warn!(
                worker_priority = nice,
                error = %e,
                "could not set the runtime threads' priority (a negative value needs \
                 CAP_SYS_NICE or LimitNICE=); running at the inherited priority"
            );
        });
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Serve(_)) {
        // Before the runtime (or anything else) starts a thread.
        one_malloc_arena();
    }
    init_logging(cli.log_format);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Cmd::Serve(a) = &cli.cmd {
        let mut cfg = GatewayConfig::load(a.config.as_deref())?;
        let workers = match a.worker_threads {
            Some(n) if n > 0 => n,
            _ => cfg.runtime_workers(),
        };
        builder.worker_threads(workers);
        if let Some(p) = a.worker_priority {
            // The flag goes through the config's own range check.
            cfg.worker_priority = p;
            cfg.validate().context("--worker-priority")?;
        }
        let nice = cfg.worker_priority;
        if nice != 0 {
            // Every runtime thread: they run the listeners and all requests. The main thread
            // (it only awaits the shutdown signal) and the threads it starts (store writer,
            // spool I/O) keep the inherited priority.
            builder.on_thread_start(move || set_thread_nice(nice));
        }
    }
    let rt = builder.build().context("starting the runtime")?;
    match cli.cmd {
        Cmd::Serve(a) => rt.block_on(serve(a)),
        Cmd::Report(a) => report(a),
        Cmd::MockEngine(a) => rt.block_on(mock_engine(a)),
        Cmd::Demo(a) => rt.block_on(demo::run(a)),
        Cmd::Cost(a) => analyze::cost::run(a),
        Cmd::Budget(a) => analyze::budget::run(a),
        Cmd::Anomalies(a) => analyze::anomalies::run(a),
        Cmd::Waste(a) => analyze::waste::run(a),
        Cmd::Diagnose(a) => analyze::diagnose::run(a),
        Cmd::Capacity(a) => analyze::capacity::run(a),
        Cmd::Export(a) => analyze::rules::run(a),
        Cmd::Bench(a) => rt.block_on(bench::run(a)),
    }
}
