//! `tokenscope demo`: the built-in mock engine, the gateway in front of it, a mixed traffic of
//! short and long prompts from several users and business lines, then the report.
//!
//! Everything runs in this process on loopback ports chosen by the OS; the store is a normal
//! SQLite file, so `tokenscope report --store <file>` works on it afterwards.

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenscope_gateway::{Gateway, GatewayConfig};
use tokenscope_store::{render, run_report, Dimension, Format, ReportQuery, SqliteStore};

#[derive(Args)]
pub struct DemoArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 300)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 24)]
    concurrency: u64,
    /// Store file (the same default as `serve` and `report`).
    #[arg(long, default_value = "./tokenscope.db")]
    store: String,
    /// Mock engine time scale (smaller = faster demo).
    #[arg(long, default_value_t = 0.25)]
    time_scale: f64,
    /// Keep the gateway and mock engine running after the traffic (Ctrl-C to stop).
    #[arg(long)]
    keep_running: bool,
    /// Seed of the traffic mix.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// (user, business line, request type)
const CALLERS: [(&str, &str, &str); 5] = [
    ("alice", "search", "chat"),
    ("bob", "search", "summary"),
    ("carol", "support", "chat"),
    ("dave", "ads", "translation"),
    ("erin", "ads", "chat"),
];
const WORDS: [&str; 16] = [
    "the", "latency", "of", "every", "token", "is", "measured", "per", "request", "queue",
    "prefill", "decode", "cost", "user", "model", "batch",
];

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn prompt(words: u64, rng: &mut u64) -> String {
    let mut s = String::with_capacity(words as usize * 7);
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(splitmix(rng) % WORDS.len() as u64) as usize]);
    }
    s
}

pub async fn run(args: DemoArgs) -> Result<()> {
    let mock_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let mock_addr = mock_listener.local_addr()?;
    let (mock_stop, mock_rx) = tokio::sync::oneshot::channel::<()>();
    let mock_cfg = tokenscope_mock::MockConfig {
        time_scale: args.time_scale,
        slots: 8,
        ..tokenscope_mock::MockConfig::default()
    };
    let mock = tokio::spawn(tokenscope_mock::serve(
        mock_listener,
        mock_cfg,
        async move {
            let _ = mock_rx.await;
        },
    ));

    let mut cfg = GatewayConfig::load(None)?;
    cfg.set_single_upstream(&format!("http://{mock_addr}"));
    cfg.store.clone_from(&args.store);
    if !args.keep_running {
        cfg.listen = "127.0.0.1:0".into();
        cfg.admin_listen = "127.0.0.1:0".into();
    }
    let gw = Gateway::bind(cfg).await?;
    let proxy = gw.proxy_addr();
    let admin = gw.admin_addr();
    eprintln!(
        "mock engine  http://{mock_addr}  (simulated, time scale {})",
        args.time_scale
    );
    eprintln!("gateway      http://{proxy}   metrics http://{admin}/metrics");
    eprintln!("store        {}", args.store);
    let (gw_stop, gw_rx) = tokio::sync::oneshot::channel::<()>();
    let gateway = tokio::spawn(gw.run(async move {
        let _ = gw_rx.await;
    }));

    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    eprintln!(
        "sending {} requests ({} at a time): 80% short, 20% long prompts, 60% streamed…",
        args.requests, args.concurrency
    );
    let mut workers = Vec::new();
    for w in 0..args.concurrency.max(1) {
        let client = client.clone();
        let next = next.clone();
        let failed = failed.clone();
        let total = args.requests;
        let seed = args.seed;
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let mut rng = seed ^ (i.wrapping_mul(0x2545_F491_4F6C_DD1D)) ^ w;
                let (user, line, rtype) =
                    CALLERS[(splitmix(&mut rng) % CALLERS.len() as u64) as usize];
                let long = splitmix(&mut rng) % 100 < 20;
                let words = if long {
                    600 + splitmix(&mut rng) % 1900
                } else {
                    10 + splitmix(&mut rng) % 90
                };
                let stream = splitmix(&mut rng) % 100 < 60;
                let model = if splitmix(&mut rng).is_multiple_of(3) {
                    "mock-llm-large"
                } else {
                    "mock-llm"
                };
                let max_tokens = 16 + splitmix(&mut rng) % 180;
                let body = serde_json::json!({
                    "model": model,
                    "stream": stream,
                    "max_tokens": max_tokens,
                    "messages": [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": prompt(words, &mut rng)}
                    ]
                });
                let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .header("x-tokenscope-user", user)
                    .header("x-tokenscope-business-line", line)
                    .header("x-tokenscope-request-type", rtype)
                    .body(Full::new(Bytes::from(body.to_string())));
                let ok = match req {
                    Ok(req) => match client.request(req).await {
                        Ok(resp) => {
                            let status = resp.status();
                            resp.into_body().collect().await.is_ok() && status.is_success()
                        }
                        Err(_) => false,
                    },
                    Err(_) => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for w in workers {
        let _ = w.await;
    }
    let elapsed = started.elapsed();
    eprintln!(
        "done: {} requests in {:.1} s ({} failed)\n",
        args.requests,
        elapsed.as_secs_f64(),
        failed.load(Ordering::Relaxed)
    );

    if args.keep_running {
        eprintln!("Still serving; press Ctrl-C to stop.");
        let _ = tokio::signal::ctrl_c().await;
    }
    let _ = gw_stop.send(());
    let summary = gateway.await.context("gateway task")??;
    let _ = mock_stop.send(());
    let _ = mock.await;

    let store = SqliteStore::open_read_only(&args.store)?;
    let window = elapsed + Duration::from_secs(60);
    let since_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
        - window.as_micros() as i64;
    for group in [
        vec![Dimension::Model, Dimension::InputBucket],
        vec![Dimension::User, Dimension::BusinessLine],
    ] {
        let q = ReportQuery {
            since_us,
            until_us: None,
            group_by: group,
            interval: None,
            filters: Vec::new(),
        };
        let rows = run_report(&store, &q)?;
        println!("{}", render(&rows, &q, Format::Table));
    }
    eprintln!(
        "{} records written, {} dropped. Try:\n  tokenscope report --store {} --since 1h --by user --format json",
        summary.store.written, summary.store.dropped, args.store
    );
    Ok(())
}
