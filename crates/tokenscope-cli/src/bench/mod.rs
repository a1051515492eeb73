//! `tokenscope bench`: an open-loop load generator for any OpenAI-compatible endpoint.
//!
//! Levels run one after another. Within a level, requests are sent at the offsets of its
//! arrival schedule ([`plan::schedule`]) whatever the earlier requests are doing (open loop);
//! when `--concurrency` requests are already in flight at a request's scheduled time, that
//! request is **dropped** (not sent, counted in `dropped` and in `errors`) — never delayed, so
//! the offered schedule is not bent by the server's speed. After its last send a level waits
//! for its in-flight requests (each bounded by `--timeout`) before the next level starts, so
//! levels do not overlap.
//!
//! Every request is a streamed (or, without `--stream`, plain) chat completion with a prompt of
//! real words ([`plan::prompt_text`]) whose length comes from the mix, `stream_options.
//! include_usage`, an `x-request-id` of `PREFIX-L<level>-<n>` (so the gateway's records can be
//! matched by their `client_request_id`), and `max_tokens` / `mock_output_tokens` when asked. Timings use [`Instant`] only.
//! Definitions and the knee: [`stats`]; usage: `docs/bench.md`.
//!
//! Exit status: 1 when no request of any level succeeded, the error naming the causes
//! counted ([`stats::Failures`]: `HTTP 503`, `timeout`, `connection failed`, `dropped`, …);
//! otherwise 0, with one stderr line of the causes when some requests failed.

pub mod plan;
pub mod stats;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use plan::{Arrival, Mix};
use stats::{LevelSummary, RequestResult};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_core::messages::MessagesUsage;
use tokenscope_core::openai::parse_payload_for;
use tokenscope_core::sse::{parse_event, EventSplitter};
use tokenscope_core::Endpoint;

type HttpClient = Client<tokenscope_net::HttpsConnect, Full<Bytes>>;

/// `tokenscope bench` options.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Base URL of the endpoint (e.g. http://127.0.0.1:4000, or https://…); the `--endpoint`'s path
    /// (`/v1/chat/completions`, …) is appended unless the URL already ends in a path.
    #[arg(long)]
    pub target: String,
    /// The API the requests speak: chat completions, the OpenAI Responses API
    /// (`/v1/responses`) or the Anthropic Messages API (`/v1/messages`).
    #[arg(long, value_enum, default_value_t)]
    pub endpoint: BenchEndpoint,
    /// `https://` targets: a PEM CA bundle trusted beside the system's roots.
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Offered rates, requests/s, one level each (e.g. 2,4,8).
    #[arg(long, value_delimiter = ',', required = true)]
    pub rates: Vec<f64>,
    /// Duration of each level (e.g. 30s, 500ms).
    #[arg(long, default_value = "30s")]
    pub duration: String,
    /// Arrival process.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: Arrival,
    /// Seed of arrivals, prompt lengths and prompt words.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prompt-length mix: PCT:MIN-MAX tokens, comma-separated (e.g. 80:64-256,20:2048-4096).
    #[arg(long, default_value = "80:64-256,20:2048-4096")]
    pub mix: String,
    /// `max_tokens` of every request.
    #[arg(long)]
    pub max_tokens: Option<u64>,
    /// Exact output length for the mock engine (`mock_output_tokens`; other engines ignore it).
    #[arg(long)]
    pub output_tokens: Option<u64>,
    /// Stream responses (SSE); TTFT/TPOT/ITL need it.
    #[arg(long)]
    pub stream: bool,
    /// Most requests in flight; at the cap, a scheduled request is dropped (counted).
    #[arg(long, default_value_t = 1024)]
    pub concurrency: usize,
    /// Model name [default: the first of GET /v1/models, else "default"].
    #[arg(long)]
    pub model: Option<String>,
    /// SLO on P99 TTFT that defines the knee (e.g. 2s, 800ms).
    #[arg(long, default_value = "2s")]
    pub slo_ttft_p99: String,
    /// Per-request timeout (counted as failed).
    #[arg(long, default_value = "300s")]
    pub timeout: String,
    /// Prefix of the `x-request-id`s [default: bench-<random hex>].
    #[arg(long)]
    pub request_id_prefix: Option<String>,
    /// Also write every request's client-side result as JSON lines to this file
    /// (request_id, rate, ok, dropped, ttft_ms, tpot_ms, e2e_ms, output_tokens, prompt_tokens).
    #[arg(long)]
    pub requests_out: Option<std::path::PathBuf>,
    /// Output format (json: the array `tokenscope capacity --from-bench` reads).
    #[arg(long, value_enum, default_value_t)]
    pub format: crate::args::BenchFormat,
}

/// The API `tokenscope bench` speaks.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BenchEndpoint {
    /// `/v1/chat/completions` (`stream_options.include_usage` asked for when streaming).
    #[default]
    Chat,
    /// `/v1/responses` (`input`, `max_output_tokens`).
    Responses,
    /// `/v1/messages` (`messages`, `max_tokens`).
    Messages,
}

impl BenchEndpoint {
    fn endpoint(self) -> Endpoint {
        match self {
            BenchEndpoint::Chat => Endpoint::ChatCompletions,
            BenchEndpoint::Responses => Endpoint::Responses,
            BenchEndpoint::Messages => Endpoint::Messages,
        }
    }

    fn path(self) -> &'static str {
        match self {
            BenchEndpoint::Chat => "/v1/chat/completions",
            BenchEndpoint::Responses => "/v1/responses",
            BenchEndpoint::Messages => "/v1/messages",
        }
    }

    /// One request's body in this API.
    fn body(
        self,
        model: &str,
        prompt: &str,
        stream: bool,
        max_tokens: Option<u64>,
    ) -> serde_json::Value {
        let mut body = match self {
            BenchEndpoint::Chat | BenchEndpoint::Messages => serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "stream": stream,
            }),
            BenchEndpoint::Responses => serde_json::json!({
                "model": model, "input": prompt, "stream": stream,
            }),
        };
        if stream && self == BenchEndpoint::Chat {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        if let Some(m) = max_tokens {
            let key = match self {
                BenchEndpoint::Responses => "max_output_tokens",
                _ => "max_tokens",
            };
            body[key] = m.into();
        }
        body
    }
}

/// What a run needs, parsed.
struct Plan {
    url: http::Uri,
    base: String,
    rates: Vec<f64>,
    duration: Duration,
    arrival: Arrival,
    mix: Mix,
    slo_ms: f64,
    timeout: Duration,
    prefix: String,
    json: bool,
}

/// `(base URL, request URL)`: a target without a path gets `path`; a target with one is used
/// as is, its scheme + authority being the base (for `/v1/models`).
fn split_target(target: &str, path: &str) -> (String, String) {
    let target = target.trim_end_matches('/');
    let after_scheme = target.split_once("://").map_or(target, |(_, r)| r);
    match after_scheme.find('/') {
        Some(p) => {
            let cut = target.len() - after_scheme.len() + p;
            (target[..cut].to_owned(), target.to_owned())
        }
        None => (target.to_owned(), format!("{target}{path}")),
    }
}

fn parse_plan(a: &BenchArgs) -> Result<Plan> {
    let (base, url) = split_target(&a.target, a.endpoint.path());
    let url: http::Uri = url
        .parse()
        .with_context(|| format!("--target {:?}", a.target))?;
    if a.rates.is_empty() || a.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
        bail!("--rates must be positive numbers");
    }
    let duration = crate::duration::parse(&a.duration)
        .with_context(|| format!("--duration {:?}", a.duration))?;
    if duration.is_zero() {
        bail!("--duration must be positive");
    }
    let json = a.format == crate::args::BenchFormat::Json;
    if a.concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    Ok(Plan {
        url,
        base,
        rates: a.rates.clone(),
        duration,
        arrival: a.arrival,
        mix: a.mix.parse()?,
        slo_ms: crate::duration::parse(&a.slo_ttft_p99)
            .with_context(|| format!("--slo-ttft-p99 {:?}", a.slo_ttft_p99))?
            .as_secs_f64()
            * 1000.0,
        timeout: crate::duration::parse(&a.timeout)
            .with_context(|| format!("--timeout {:?}", a.timeout))?,
        prefix: a
            .request_id_prefix
            .clone()
            .unwrap_or_else(|| format!("bench-{:08x}", fastrand::u32(..))),
        json,
    })
}

/// Runs the command.
pub async fn run(args: BenchArgs) -> Result<()> {
    let plan = parse_plan(&args)?;
    let mut client = Client::builder(TokioExecutor::new());
    client.pool_max_idle_per_host(args.concurrency.min(4096));
    let tls = tokenscope_net::ClientTls::new(&tokenscope_net::TlsOptions {
        ca_file: args.ca_file.clone(),
        ..Default::default()
    })
    .context("--ca-file")?;
    // As hyper-util's plain connector before (no connect timeout, Nagle on), plus TLS for
    // https:// targets.
    let client: HttpClient = client.build(tokenscope_net::connector(
        &tls,
        tokenscope_net::ConnectOptions::default(),
    ));
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&client, &plan.base)
            .await
            .unwrap_or_else(|| "default".to_owned()),
    };
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut levels = Vec::with_capacity(plan.rates.len());
    // Failure causes over every level, and how many requests there were / succeeded.
    let mut failures = stats::Failures::default();
    for (li, &rate) in plan.rates.iter().enumerate() {
        let mut results = run_level(&client, &plan, &args, &model, li, rate, &mut rng).await;
        for r in &mut results {
            r.rate = rate;
        }
        if let Some(path) = &args.requests_out {
            write_requests(path, &results, li == 0)?;
        }
        levels.push(stats::summarize(rate, plan.duration, &results, plan.slo_ms));
        failures.add(&results);
    }
    let (knee, sustainable) = stats::mark_knee(&mut levels);
    if plan.json {
        println!("{}", serde_json::to_string_pretty(&levels)?);
    } else {
        print!("{}", render_table(&levels, knee, sustainable, plan.slo_ms));
    }
    if failures.requests > 0 && failures.ok == 0 {
        bail!(
            "every request failed ({}): {}",
            failures.requests,
            failures.causes_line()
        );
    }
    if failures.ok < failures.requests {
        eprintln!(
            "{} of {} requests failed or were dropped: {}",
            failures.requests - failures.ok,
            failures.requests,
            failures.causes_line()
        );
    }
    Ok(())
}

fn write_requests(path: &std::path::Path, results: &[RequestResult], truncate: bool) -> Result<()> {
    use std::io::Write;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(!truncate)
        .truncate(truncate)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for r in results {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))
}

async fn first_model(client: &HttpClient, base: &str) -> Option<String> {
    let uri: http::Uri = format!("{base}/v1/models").parse().ok()?;
    let resp = tokio::time::timeout(Duration::from_secs(10), client.get(uri))
        .await
        .ok()?
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v.get("data")?
        .get(0)?
        .get("id")?
        .as_str()
        .map(str::to_owned)
}

#[allow(clippy::too_many_arguments)]
async fn run_level(
    client: &HttpClient,
    plan: &Plan,
    args: &BenchArgs,
    model: &str,
    level: usize,
    rate: f64,
    rng: &mut fastrand::Rng,
) -> Vec<RequestResult> {
    let offsets = plan::schedule(plan.arrival, rate, plan.duration, rng);
    let bar = indicatif::ProgressBar::new(offsets.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{rate} req/s"));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let start_std = Instant::now();
    let mut tasks = Vec::with_capacity(offsets.len());
    let mut results = Vec::with_capacity(offsets.len());
    for (i, off) in offsets.iter().enumerate() {
        let request_id = format!("{}-L{level}-{i}", plan.prefix);
        let prompt_tokens = plan.mix.sample(rng);
        let prompt = plan::prompt_text(prompt_tokens, rng);
        tokio::time::sleep_until(start + *off).await;
        if in_flight.load(Ordering::SeqCst) >= args.concurrency {
            bar.inc(1);
            results.push(RequestResult {
                request_id,
                dropped: true,
                prompt_tokens,
                error: Some("dropped (--concurrency reached)".to_owned()),
                ..RequestResult::default()
            });
            continue;
        }
        let mut body = args
            .endpoint
            .body(model, &prompt, args.stream, args.max_tokens);
        if let Some(n) = args.output_tokens {
            body[tokenscope_mock::OUTPUT_TOKENS_FIELD] = n.into();
        }
        in_flight.fetch_add(1, Ordering::SeqCst);
        let (client, uri, timeout) = (client.clone(), plan.url.clone(), plan.timeout);
        let (inf, bar) = (in_flight.clone(), bar.clone());
        let endpoint = args.endpoint.endpoint();
        tasks.push(tokio::spawn(async move {
            let mut r = one_request(
                &client,
                endpoint,
                uri,
                body.to_string(),
                &request_id,
                timeout,
            )
            .await;
            r.request_id = request_id;
            r.prompt_tokens = prompt_tokens;
            r.done_after = Some(start_std.elapsed());
            inf.fetch_sub(1, Ordering::SeqCst);
            bar.inc(1);
            r
        }));
    }
    for t in tasks {
        match t.await {
            Ok(r) => results.push(r),
            Err(_) => results.push(RequestResult {
                error: Some("request task failed".to_owned()),
                ..RequestResult::default()
            }),
        }
    }
    bar.finish_and_clear();
    results
}

/// Sends one request and times it (failures give `ok = false`).
async fn one_request(
    client: &HttpClient,
    endpoint: Endpoint,
    uri: http::Uri,
    body: String,
    request_id: &str,
    timeout: Duration,
) -> RequestResult {
    let sent = Instant::now();
    let fut = timed_request(client, endpoint, uri, body, request_id, sent);
    // A timeout is a failed request (ok = false).
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| RequestResult {
            error: Some("timeout".to_owned()),
            ..RequestResult::default()
        })
}

async fn timed_request(
    client: &HttpClient,
    endpoint: Endpoint,
    uri: http::Uri,
    body: String,
    request_id: &str,
    sent: Instant,
) -> RequestResult {
    let mut out = RequestResult::default();
    let fail = |mut out: RequestResult, why: String| {
        out.error = Some(why);
        out
    };
    let req = match http::Request::post(uri)
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(Full::new(Bytes::from(body)))
    {
        Ok(r) => r,
        Err(e) => return fail(out, format!("invalid request: {e}")),
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) if e.is_connect() => return fail(out, "connection failed".to_owned()),
        Err(_) => return fail(out, "request failed (no response)".to_owned()),
    };
    let status = resp.status();
    let status_ok = status.is_success();
    let is_sse = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let mut body = resp.into_body();
    let mut splitter = EventSplitter::new(1 << 24);
    let mut outputs: Vec<Instant> = Vec::new();
    let mut usage_tokens: Option<u64> = None;
    // The Messages API's usage, merged over its events.
    let mut messages_usage = MessagesUsage::default();
    let mut error_event = false;
    let mut whole = Vec::new();
    let mut on_event = |raw: Bytes, at: Instant, outputs: &mut Vec<Instant>| {
        let ev = parse_event(&raw);
        let Some(data) = ev.data else { return };
        if data.trim() == "[DONE]" {
            return;
        }
        if let Ok(p) = parse_payload_for(endpoint, data.as_bytes()) {
            if p.has_output {
                outputs.push(at);
            }
            if let Some(u) = &p.messages_usage {
                messages_usage.merge(u);
            }
            if let Some(n) = p
                .usage
                .and_then(|u| u.completion_tokens)
                .or(messages_usage.output_tokens)
            {
                usage_tokens = Some(n);
            }
            error_event |= p.is_error;
        }
    };
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return fail(out, "response body broken off".to_owned());
        };
        let at = Instant::now();
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if is_sse {
            if splitter
                .push(&data, |raw| on_event(raw, at, &mut outputs))
                .is_err()
            {
                return fail(out, "SSE event too large".to_owned());
            }
        } else {
            whole.extend_from_slice(&data);
        }
    }
    let end = Instant::now();
    if is_sse {
        if let Some(rest) = splitter.finish() {
            on_event(rest, end, &mut outputs);
        }
    } else if let Ok(p) = parse_payload_for(endpoint, &whole) {
        // Non-streamed: the output arrives with the body.
        if p.has_output {
            outputs.push(end);
        }
        usage_tokens = p
            .usage
            .or(p.messages_usage.map(|u| u.to_usage()))
            .and_then(|u| u.completion_tokens);
        error_event |= p.is_error;
    }
    let ms = |t: Instant| tokenscope_core::timing::ms(t.duration_since(sent));
    out.e2e_ms = Some(ms(end));
    let (Some(&first), Some(&last)) = (outputs.first(), outputs.last()) else {
        let why = if status_ok {
            "no output in the response".to_owned()
        } else {
            format!("HTTP {}", status.as_u16())
        };
        return fail(out, why);
    };
    let n_out = usage_tokens.unwrap_or(outputs.len() as u64);
    out.ttft_ms = Some(ms(first));
    out.tpot_ms = if is_sse {
        stats::tpot_ms(ms(first), ms(last), n_out)
    } else {
        None
    };
    out.itl_ms = outputs
        .windows(2)
        .map(|w| tokenscope_core::timing::ms(w[1].duration_since(w[0])))
        .collect();
    out.output_tokens = n_out;
    out.ok = status_ok && !error_event;
    if !status_ok {
        out.error = Some(format!("HTTP {}", status.as_u16()));
    } else if error_event {
        out.error = Some("error event in the response".to_owned());
    }
    out
}

fn fmt_ms(x: Option<f64>) -> String {
    x.map_or("-".to_owned(), |v| format!("{v:.1}"))
}

fn render_table(
    levels: &[LevelSummary],
    knee: Option<usize>,
    sustainable: Option<usize>,
    slo_ms: f64,
) -> String {
    let mut t = tokenscope_analysis::table(&[
        "rate",
        "offered",
        "achieved",
        "requests",
        "errors",
        "dropped",
        "ttft p50/p90/p99 ms",
        "tpot p50/p90/p99 ms",
        "itl p50/p90/p99 ms",
        "e2e p50/p90/p99 ms",
        "out tok/s",
        "verdict",
    ]);
    let three =
        |p: &stats::Pcts| format!("{} / {} / {}", fmt_ms(p.p50), fmt_ms(p.p90), fmt_ms(p.p99));
    for l in levels {
        let verdict = match (&l.breach, l.knee, l.sustainable) {
            (_, _, true) => "ok (sustainable)".to_owned(),
            (Some(w), true, _) => format!("KNEE: {w}"),
            (Some(w), false, _) => format!("breach: {w}"),
            (None, _, _) => "ok".to_owned(),
        };
        t.add_row(vec![
            format!("{}", l.rate),
            format!("{:.2}", l.offered_qps),
            format!("{:.2}", l.achieved_qps),
            l.requests.to_string(),
            l.failed.to_string(),
            l.dropped.to_string(),
            three(&l.ttft_ms),
            three(&l.tpot_ms),
            three(&l.itl_ms),
            three(&l.e2e_ms),
            format!("{:.1}", l.output_tokens_per_s),
            verdict,
        ]);
    }
    let knee_s = knee.map_or("none (every level within the SLO)".to_owned(), |i| {
        format!("{} req/s", levels[i].rate)
    });
    let sus_s = sustainable.map_or("none".to_owned(), |i| format!("{} req/s", levels[i].rate));
    format!(
        "{t}\nknee: {knee_s}   sustainable: {sus_s}   (SLO: P99 TTFT ≤ {slo_ms:.0} ms, achieved ≥ 90 % of offered, failed + dropped ≤ 1 %)\n"
    )
}

#[cfg(test)]
mod tests {
    use super::{split_target, BenchEndpoint};
    use serde_json::json;

    #[test]
    fn target_urls() {
        let own = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            split_target("http://127.0.0.1:4000/", BenchEndpoint::Chat.path()),
            own(
                "http://127.0.0.1:4000",
                "http://127.0.0.1:4000/v1/chat/completions"
            )
        );
        assert_eq!(
            split_target("http://h:8000/v1/chat/completions", "/v1/messages"),
            own("http://h:8000", "http://h:8000/v1/chat/completions")
        );
        assert_eq!(
            split_target("http://h:8000", BenchEndpoint::Responses.path()),
            own("http://h:8000", "http://h:8000/v1/responses")
        );
    }

    #[test]
    fn bodies_per_api() {
        assert_eq!(
            BenchEndpoint::Chat.body("m", "hi", true, Some(5)),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,
                   "stream_options": {"include_usage": true}, "max_tokens": 5})
        );
        assert_eq!(
            BenchEndpoint::Responses.body("m", "hi", true, Some(5)),
            json!({"model": "m", "input": "hi", "stream": true, "max_output_tokens": 5})
        );
        assert_eq!(
            BenchEndpoint::Messages.body("m", "hi", false, None),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false})
        );
    }
}
