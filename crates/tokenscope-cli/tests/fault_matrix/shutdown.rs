//! Shutdown (issue 16, item 2): every request that reached the gateway ends as exactly one row,
//! and the shutdown summary counts what it did.
//!
//! Cases:
//! * 100 long streams in flight, `shutdown_grace_ms` 1500, SIGTERM → the gateway exits 0; 100
//!   rows, each `shutdown` / `gateway_shutdown` with the output tokens it forwarded (≥ what the
//!   client read); the summary line says 100 in flight, 100 cut, 100 written.
//! * SIGTERM during a load of short requests → every request either completes (`ok`, the client
//!   got its whole response) or was never accepted (connection refused): rows == completed
//!   requests, and the summary's `written` equals the rows.

use crate::common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A gateway whose log (stderr, level info) goes to a file, so the shutdown summary can be read.
pub(crate) struct LoggedGateway {
    pub child: Child,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    pub store: PathBuf,
    pub log: PathBuf,
    pub _dir: tempfile::TempDir,
}

impl LoggedGateway {
    pub(crate) fn start(upstream: &str, env: &[(&str, &str)]) -> Self {
        Self::start_limited(upstream, env, None)
    }

    /// Like [`LoggedGateway::start`], with the open-file limit (soft and hard) set to `nofile`.
    pub(crate) fn start_limited(upstream: &str, env: &[(&str, &str)], nofile: Option<u64>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("ts.db");
        let log = dir.path().join("stderr.log");
        let bin = env!("CARGO_BIN_EXE_tokenscope");
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), bin]);
                c
            }
            None => Command::new(bin),
        };
        serve_args(&mut cmd, Some(upstream), Some(&store), dir.path());
        cmd.env("TOKENSCOPE_LOG", "info")
            .env("NO_COLOR", "1")
            .stderr(std::fs::File::create(&log).expect("log file"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn tokenscope");
        let (proxy, admin) = read_ready_line(&mut child);
        Self {
            proxy,
            admin,
            child,
            store,
            log,
            _dir: dir,
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    /// SIGTERM, then waits (≤ 60 s) for a clean exit; returns the log.
    pub(crate) fn terminate(&mut self) -> String {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill")
            .success());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                assert!(st.success(), "gateway exited with {st}");
                break;
            }
            assert!(Instant::now() < deadline, "gateway did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::read_to_string(&self.log).expect("log")
    }
}

impl Drop for LoggedGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `key=value` of the log line containing `marker` (tracing's plain format).
pub(crate) fn log_field(log: &str, marker: &str, key: &str) -> u64 {
    let line = log
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no {marker:?} line in the log:\n{log}"));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .trim_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or_else(|_| panic!("{key} in {line:?}"))
}

/// One streamed request: bumps `started` at its first output event, then reads until the
/// connection ends. Returns the output events it read.
async fn long_stream(url: String, started: Arc<AtomicUsize>) -> usize {
    use http_body_util::BodyExt;
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": true,
        "max_tokens": 200000,
        "mock_output_tokens": 200000,
    });
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let c = client();
    let resp = c.request(req).await.expect("POST");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut splitter = tokenscope_core::sse::EventSplitter::new(1 << 24);
    let mut outputs = 0usize;
    let mut first = true;
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let _ = splitter.push(&data, |ev| {
            let ev = String::from_utf8_lossy(&ev);
            if ev.contains("\"content\":\"") && !ev.contains("\"content\":\"\"") {
                outputs += 1;
            }
        });
        if first && outputs > 0 {
            first = false;
            started.fetch_add(1, Ordering::SeqCst);
        }
    }
    outputs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_with_long_streams_in_flight_leaves_one_shutdown_row_each() {
    const STREAMS: usize = 100;
    let mock = MockProc::start(&["--slots", "128", "--time-scale", "0.2"]);
    let mut gw = LoggedGateway::start(&mock.url(), &[("TOKENSCOPE_SHUTDOWN_GRACE_MS", "1500")]);
    let started = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..STREAMS)
        .map(|_| tokio::spawn(long_stream(gw.url("/v1/chat/completions"), started.clone())))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.load(Ordering::SeqCst) < STREAMS {
        assert!(Instant::now() < deadline, "streams did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = tokio::task::spawn_blocking(move || {
        let log = gw.terminate();
        (gw, log)
    })
    .await
    .expect("join");
    let (gw, log) = log;
    let mut client_outputs = Vec::new();
    for t in tasks {
        client_outputs.push(t.await.expect("stream task"));
    }

    let rows = store_table(&gw.store);
    assert_eq!(rows.len(), STREAMS, "one row per request");
    let mut forwarded = Vec::new();
    for r in &rows {
        assert_eq!(r["outcome"], "shutdown", "{r:?}");
        assert_eq!(r["error_type"], "gateway_shutdown", "{r:?}");
        let out = r["output_tokens"].as_u64().expect("output tokens counted");
        assert!((1..200_000).contains(&out), "{r:?}");
        forwarded.push(out);
    }
    // What the gateway counted is what it forwarded: at least what the clients read.
    forwarded.sort_unstable();
    client_outputs.sort_unstable();
    for (f, c) in forwarded.iter().zip(&client_outputs) {
        assert!(
            *f >= *c as u64,
            "forwarded {forwarded:?} vs read {client_outputs:?}"
        );
    }
    assert_eq!(
        log_field(&log, "Store drained.", "in_flight_at_signal"),
        STREAMS as u64
    );
    assert_eq!(
        log_field(&log, "Store drained.", "cut_at_deadline"),
        STREAMS as u64
    );
    assert_eq!(
        log_field(&log, "Store drained.", "written"),
        rows.len() as u64
    );
    assert_eq!(log_field(&log, "Store drained.", "lost"), 0);
    assert_eq!(log_field(&log, "Store drained.", "dropped"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_during_load_every_completed_request_is_a_row() {
    let mock = MockProc::start(&["--slots", "64"]);
    let mut gw = LoggedGateway::start(&mock.url(), &[("TOKENSCOPE_SHUTDOWN_GRACE_MS", "10000")]);
    let url = gw.url("/v1/chat/completions");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut ok, mut refused) = (0u64, 0u64);
                // Until the gateway stops accepting (bounded: at most 100 000 requests).
                for n in 0..100_000 {
                    let body = json!({"model": "m", "stream": i % 2 == 0, "max_tokens": 6,
                        "messages": [{"role": "user", "content": format!("hi {n}")}]});
                    match try_post(&url, &body).await {
                        Some(200) => ok += 1,
                        Some(s) => panic!("status {s} during shutdown"),
                        None => refused += 1,
                    }
                    if refused > 0 || stop.load(Ordering::SeqCst) {
                        break;
                    }
                }
                (ok, refused)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (gw, log) = tokio::task::spawn_blocking(move || {
        let log = gw.terminate();
        (gw, log)
    })
    .await
    .expect("join");
    stop.store(true, Ordering::SeqCst);
    let mut completed = 0;
    for w in workers {
        completed += w.await.expect("worker").0;
    }
    let rows = store_rows(&gw.store);
    assert!(completed > 0);
    assert_eq!(rows.len() as u64, completed, "rows == completed requests");
    assert!(rows.iter().all(|r| r["outcome"] == "ok"));
    assert_eq!(log_field(&log, "Store drained.", "written"), completed);
    assert_eq!(log_field(&log, "Store drained.", "cut_at_deadline"), 0);
}

/// POST that reads the whole response; `None` when the connection was refused or closed
/// before a response (the gateway stopped accepting).
async fn try_post(url: &str, body: &serde_json::Value) -> Option<u16> {
    use http_body_util::BodyExt;
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = client().request(req).await.ok()?;
    let status = resp.status().as_u16();
    // A response that started must complete: the gateway lets it finish.
    resp.into_body()
        .collect()
        .await
        .expect("a started response completes");
    Some(status)
}
