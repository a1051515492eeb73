//! Smaller leaks (issue 16, item 7): secrets in start-up output, raw user ids and
//! client-chosen model names in `/metrics`.
//!
//! Cases:
//! * `startup_output_has_no_upstream_password`: an upstream, an alert webhook and an OTLP
//!   endpoint with passwords in their URLs (all unreachable, so the scrapers and fetchers log
//!   their failures): nothing the gateway prints in its first seconds — stdout and stderr, at
//!   debug for our crates — contains the password; the ready log line names the upstream
//!   redacted (`ops:***@`). The same secret as the upstream's key (`api_key_env`) and as a
//!   literal `[upstreams.headers]` value is not printed either: the credentials line names
//!   the headers only.
//! * `top_k_user_labels_are_bounded`: `user_label = "top_k"` and a 1 KiB user id → its
//!   `user_bucket` label is at most 64 bytes, marked with `~`, never the raw id; a short id
//!   keeps its name.
//! * `served_model_keeps_its_label_after_made_up_names`: 60 made-up model names first, then
//!   the model the engine lists at `/v1/models` → that model has its own label; the made-up
//!   ones end in `other`; at most `max_models` (50) labels besides `other`.

use crate::admin::spawn_serve;
use crate::common::{self, label_values, post_json, GatewayProc, MockProc};
use serde_json::json;
use std::io::Read;
use std::time::Duration;

const SECRET: &str = "hunter2-s3cret";

#[test]
fn startup_output_has_no_upstream_password() {
    let dead = common::dead_port();
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("gw.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[[upstreams]]
name = "main"
url = "http://ops:{SECRET}@127.0.0.1:{dead}"
models = ["m"]
scrape_interval_ms = 200
api_key_env = "TS_LEAK_TEST_KEY"
[upstreams.headers]
"x-literal-secret" = "{SECRET}"

[alerts]
webhook_url = "http://hook:{SECRET}@127.0.0.1:{dead}/alerts"

[tracing]
otlp_endpoint = "http://otel:{SECRET}@127.0.0.1:{dead}"
"#
        ),
    )
    .expect("config");
    let mut child = spawn_serve(
        &[
            "--config",
            cfg.to_str().expect("utf-8"),
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[
            (
                "TOKENSCOPE_LOG",
                "info,tokenscope_gateway=debug,tokenscope_engine_state=debug",
            ),
            ("TS_LEAK_TEST_KEY", SECRET),
        ],
        dir.path(),
    );
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    // Long enough for several failed scrapes and the first /v1/models round.
    std::thread::sleep(Duration::from_millis(2500));
    let _ = child.kill();
    let _ = child.wait();
    let out = out_reader.join().expect("stdout");
    let err = err_reader.join().expect("stderr");
    assert!(
        out.contains("tokenscope listening"),
        "did not start: {out}\n{err}"
    );
    assert!(
        !out.contains(SECRET) && !err.contains(SECRET),
        "a password was printed:\n{out}\n{err}"
    );
    let ready = err
        .lines()
        .find(|l| l.contains("Gateway ready."))
        .unwrap_or_else(|| panic!("no ready log line: {err}"));
    assert!(ready.contains("ops:***@127.0.0.1"), "{ready}");
    // The upstream's key and a literal header value: their names only.
    let creds = err
        .lines()
        .find(|l| l.contains("Upstream credentials."))
        .unwrap_or_else(|| panic!("no credentials log line: {err}"));
    assert!(
        creds.contains("authorization") && creds.contains("x-literal-secret"),
        "{creds}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_k_user_labels_are_bounded() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[("TOKENSCOPE_METRICS__USER_LABEL", "top_k")]);
    let long = "u".repeat(1024);
    for user in [long.as_str(), "alice"] {
        let (status, _, _) = post_json(
            &gw.url("/v1/chat/completions"),
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            &[("x-tokenscope-user", user)],
        )
        .await;
        assert_eq!(status, 200);
    }
    let metrics = gw.metrics().await;
    let users = label_values(&metrics, "llm_tokens_total", "user_bucket");
    assert!(users.contains("alice"), "{users:?}");
    assert!(
        users
            .iter()
            .all(|u| u.len() <= 64 && !u.contains(&long[..65])),
        "{users:?}"
    );
    let marked: Vec<&String> = users.iter().filter(|u| u.contains('~')).collect();
    assert_eq!(marked.len(), 1, "{users:?}");
    assert!(marked[0].starts_with("uuuu"), "{marked:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_model_keeps_its_label_after_made_up_names() {
    let mock = MockProc::start(&[]);
    let gw = GatewayProc::start(&mock.url(), &[]);
    let send = |model: String| {
        let url = gw.url("/v1/chat/completions");
        async move {
            let (status, _, _) = post_json(
                &url,
                &json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2}),
                &[],
            )
            .await;
            status
        }
    };
    for i in 0..60 {
        send(format!("made-up-{i}")).await;
    }
    assert_eq!(send("mock-llm".to_owned()).await, 200);
    let metrics = gw.metrics().await;
    let models = label_values(&metrics, "llm_requests_total", "model");
    assert!(models.contains("mock-llm"), "{models:?}");
    assert!(models.contains("other"), "{models:?}");
    assert!(models.len() <= 51, "{} labels: {models:?}", models.len());
}
