//! The mock engine (built on tokenscope-sdk) behind the gateway, exporting its per-request
//! spans over OTLP to the gateway's admin listener: every gateway record carries the SDK's
//! engine-side queue/prefill/decode (source `engine`), equal to the values the SDK computed
//! (read from the mock's `/debug/sdk/requests`, integer nanoseconds).
//!
//! Both processes are the real `tokenscope` binary. The mock runs with 2 slots and prompts
//! beyond the 512-token prefill budget, so requests queue, prefill in chunks and share steps
//! with decoding neighbours: the phases differ from request to request.

mod common;

use common::{get, post_json, stream, GatewayProc};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `tokenscope mock-engine` on a given port (the gateway was started first, pointing at it).
struct Mock(Child);

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_mock(port: u16, otlp_endpoint: &str) -> Mock {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["mock-engine", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--slots", "2", "--time-scale", "0.2"])
        .args(["--otlp-endpoint", otlp_endpoint])
        .env("TOKENSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn mock-engine");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready line");
    assert!(line.contains("listening on"), "{line:?}");
    Mock(child)
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn words(n: usize) -> String {
    // The mock's toy tokenizer: a word of ≤ 4 characters is one token; chat adds 4 per message.
    vec!["abcd"; n].join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_records_carry_the_sdk_phases() {
    let port = free_port();
    let gw = GatewayProc::start(&format!("http://127.0.0.1:{port}"), &[]);
    let _mock = start_mock(port, &format!("http://{}", gw.admin));

    // 12 requests at once on 2 slots: queueing; 1500-token prompts: chunked prefill beside
    // decoding neighbours; streaming and not.
    let mut tasks = Vec::new();
    for i in 0..12usize {
        let url = gw.url("/v1/chat/completions");
        let prompt = if i % 3 == 0 {
            words(1500)
        } else {
            words(20 + i)
        };
        let streamed = i % 2 == 0;
        let body = json!({
            "model": "mock-llm",
            "messages": [{"role": "user", "content": prompt}],
            "stream": streamed,
            "mock_output_tokens": 3 + i,
        });
        tasks.push(tokio::spawn(async move {
            if streamed {
                let s = stream(&url, &body, &[], None).await;
                assert_eq!(s.status, 200);
            } else {
                let (status, _, _) = post_json(&url, &body, &[]).await;
                assert_eq!(status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.expect("request task");
    }

    // The SDK's own values, by trace id.
    let deadline = Instant::now() + Duration::from_secs(20);
    let sdk: HashMap<String, Value> = loop {
        let (status, body) = get(&format!("http://127.0.0.1:{port}/debug/sdk/requests")).await;
        assert_eq!(status, 200, "{body}");
        let list: Vec<Value> = serde_json::from_str(&body).expect("json");
        if list.len() >= 12 {
            break list
                .into_iter()
                .map(|r| (r["trace_id"].as_str().expect("traced").to_owned(), r))
                .collect();
        }
        assert!(Instant::now() < deadline, "SDK has {} records", list.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(sdk.len(), 12, "one trace per request");

    // The gateway's stored records, once every one carries the engine's queue.
    let rows = loop {
        gw.flush().await;
        let rows = common::store_table(&gw.store);
        let joined = rows
            .iter()
            .filter(|r| r["queue_source"] == "engine_span")
            .count();
        if rows.len() == 12 && joined == 12 {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "{} rows, {joined} with engine phases",
            rows.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    let mut queued = 0;
    let mut chunked = 0;
    for r in &rows {
        let trace = r["trace_id"].as_str().expect("trace id");
        let s = sdk
            .get(trace)
            .unwrap_or_else(|| panic!("no SDK record for {trace}"));
        for (column, ns) in [
            ("queue_duration_ms", "queue_ns"),
            ("prefill_duration_ms", "prefill_ns"),
            ("decode_duration_ms", "decode_ns"),
        ] {
            let source = column.replace("duration_ms", "source");
            assert_eq!(r[&source], "engine_span", "{source} of {trace}");
            let got_ms = r[column].as_f64().expect("phase");
            let want_ns = s[ns].as_u64().expect("ns");
            // Exact to well below the records' microsecond resolution (1 ns).
            assert!(
                (got_ms * 1e6 - want_ns as f64).abs() < 1.0,
                "{column} of {trace}: gateway {got_ms} ms, SDK {want_ns} ns"
            );
        }
        // The SDK's invariant, and the engine's time inside the gateway's.
        let sum = s["queue_ns"].as_u64().unwrap_or(0)
            + s["prefill_ns"].as_u64().unwrap_or(0)
            + s["decode_ns"].as_u64().unwrap_or(0);
        assert_eq!(sum, s["e2e_ns"].as_u64().expect("e2e"));
        let total_ms = r["total_duration_ms"].as_f64().expect("total");
        assert!(
            sum as f64 / 1e6 <= total_ms,
            "engine {sum} ns > gateway {total_ms} ms"
        );
        assert_eq!(r["output_tokens"], s["output_tokens"]);
        if s["queue_ns"].as_u64().unwrap_or(0) > 1_000_000 {
            queued += 1;
        }
        if s["prefill_chunks"].as_u64().unwrap_or(0) > 1 {
            chunked += 1;
        }
    }
    // The schedule really exercised queueing and chunked prefill.
    assert!(queued >= 6, "queued {queued}");
    assert!(chunked >= 4, "chunked {chunked}");
}
