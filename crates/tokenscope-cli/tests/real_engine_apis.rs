//! The OpenAI Responses API (`/v1/responses`) and the Anthropic Messages API (`/v1/messages`)
//! against the real llama.cpp server (Gemma 3 270M, installed by `scripts/install-llama.sh`),
//! measured exactly as `real_engine.rs` measures chat: token counts equal the engine's usage as
//! the client saw it, TTFT and TPOT follow their definitions on the client's own chunk arrival
//! times, streamed and not; the entry count (the engine's tokenizer, both APIs written as chat)
//! equals the usage; the Messages API's input total (uncached + cache reads) equals what
//! `/v1/chat/completions` reports for the same conversation; `report --by endpoint` shows both.
//!
//! Separate test binary so that it never loads the CPU together with the other real-engine
//! tests. Skipped with a message when the engine is not installed, unless
//! `TOKENSCOPE_REQUIRE_ENGINE=1`.

mod common;
mod llama;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MODEL: &str = "gemma-3-270m";

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn responses(input: &str, max: u64, stream: bool) -> Value {
    json!({"model": MODEL, "input": input, "max_output_tokens": max, "temperature": 0,
           "seed": 1, "stream": stream})
}

fn messages(prompt: &str, max: u64, stream: bool) -> Value {
    json!({"model": MODEL, "system": "You answer briefly.",
           "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
           "max_tokens": max, "temperature": 0, "seed": 1, "stream": stream,
           "metadata": {"user_id": "anthropic-user"}})
}

/// The client's own output events (`ClientEvent::has_output`: a non-empty Responses
/// `….delta`, a non-empty Anthropic `text_delta` / `thinking_delta` / `input_json_delta`),
/// TTFT and TPOT (for `n_out` tokens).
struct Seen {
    outputs: usize,
    ttft_ms: f64,
    tpot_ms: Option<f64>,
}

fn seen(s: &ClientStream, n_out: u64) -> Seen {
    Seen {
        outputs: s.output_events().len(),
        ttft_ms: s.ttft_ms().expect("an output event"),
        tpot_ms: s.tpot_ms(n_out),
    }
}

/// The recorded TTFT and TPOT against the client's, with `real_engine.rs`'s relations: the
/// gateway sees each chunk before the client (at most 5 ms before), and its TPOT is the
/// formula on nearly the same instants.
fn assert_timing(rec: &Value, client: &Seen, what: &str) {
    let rec_ttft = f(&rec["ttft_ms"]);
    assert!(
        rec_ttft <= client.ttft_ms && client.ttft_ms - rec_ttft <= 5.0,
        "{what}: recorded TTFT {rec_ttft} vs client {}",
        client.ttft_ms
    );
    let client_tpot = client.tpot_ms.expect("two tokens or more");
    let rec_tpot = f(&rec["tpot_ms"]);
    assert!(
        (rec_tpot - client_tpot).abs() <= 0.5 + 0.02 * client_tpot,
        "{what}: recorded TPOT {rec_tpot} vs formula on client arrivals {client_tpot}"
    );
}

/// The Messages API's usage in a stream as the client saw it: `message_start`'s, updated by
/// `message_delta`'s (cumulative counts).
fn streamed_messages_usage(s: &ClientStream) -> Value {
    let mut usage = serde_json::Map::new();
    for e in &s.events {
        let Some(j) = &e.json else { continue };
        let part = match j["type"].as_str() {
            Some("message_start") => &j["message"]["usage"],
            Some("message_delta") => &j["usage"],
            _ => continue,
        };
        for (k, v) in part.as_object().into_iter().flatten() {
            usage.insert(k.clone(), v.clone());
        }
    }
    Value::Object(usage)
}

/// Every prompt token of an Anthropic usage (its `input_tokens` excludes the cache's).
fn anthropic_prompt(usage: &Value) -> u64 {
    [
        "input_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ]
    .iter()
    .map(|k| usage[*k].as_u64().unwrap_or(0))
    .sum()
}

/// Fields that differ from one call to the next whatever the path (ids, clocks, the engine's
/// timings) or with the engine's cache state (usage: compared on its own).
const PER_CALL: &[&str] = &[
    "id",
    "item_id",
    "created",
    "completed_at",
    "created_at",
    "timings",
    "usage",
    "system_fingerprint",
];

/// Keys whose string values are generated text. llama.cpp at temperature 0 is not
/// deterministic across slots and batches (the same prompt decoded beside another request can
/// pick another token), so the text is compared by presence, not by content; every other field
/// (event types, indices, roles, stop reasons, models, statuses) must be equal.
const GENERATED: &[&str] = &["text", "delta", "content", "arguments", "reasoning_content"];

/// A response body or event with the per-call fields removed and generated text masked, at
/// any depth.
fn stable(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !PER_CALL.contains(&k.as_str()))
                .map(|(k, v)| {
                    let v = match v {
                        Value::String(_) if GENERATED.contains(&k.as_str()) => {
                            Value::String("<generated>".to_owned())
                        }
                        _ => stable(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(stable).collect()),
        _ => v.clone(),
    }
}

/// A usage object reduced to what the cache state does not move: every prompt token (OpenAI's
/// `input_tokens` counts cache reads, Anthropic's does not) and the output tokens.
fn usage_totals(usage: &Value) -> (u64, u64) {
    let input = if usage.get("input_tokens_details").is_some() {
        usage["input_tokens"].as_u64().unwrap_or(0)
    } else {
        anthropic_prompt(usage)
    };
    (input, usage["output_tokens"].as_u64().unwrap_or(0))
}

/// The final usage of a stream: `response.completed`'s, or the Messages API's merged one.
fn stream_usage(s: &ClientStream) -> Value {
    if let Some(done) = s
        .events
        .iter()
        .filter_map(|e| e.json.as_ref())
        .find(|j| j["type"] == "response.completed")
    {
        return done["response"]["usage"].clone();
    }
    streamed_messages_usage(s)
}

async fn post(gw: &GatewayProc, path: &str, body: &Value) -> (Value, String) {
    let (status, headers, bytes) = post_json(&gw.url(path), body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let id = headers["x-request-id"].to_str().expect("id").to_owned();
    (serde_json::from_slice(&bytes).expect("json"), id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_and_messages_on_the_real_engine() {
    // One slot: a repeated prompt is served from the same slot's KV cache.
    let Some(llama) = llama::start(&["-np", "1", "-c", "4096"]).await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("llama.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"llama\"\nurl = \"{url}\"\nkind = \"llamacpp\"\n\
             [[tokenizers]]\nmodels = [\"*\"]\nkind = \"engine\"\nurl = \"{url}\"\nflavor = \"llamacpp\"\n",
            url = llama.url()
        ),
    )
    .expect("write config");
    let gw = GatewayProc::start_with_args(None, &["--config", cfg.to_str().expect("utf8")], &[]);
    let mut ids = Vec::new();

    // 1. Responses, not streamed: the record's tokens are the body's usage.
    let (resp, id) = post(
        &gw,
        "/v1/responses",
        &responses("Name three colours.", 12, false),
    )
    .await;
    let rec = gw.record(&id).await;
    let usage = &resp["usage"];
    assert_eq!(rec["endpoint"], "responses");
    assert_eq!(rec["request_type"], "chat");
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["input_tokens"], usage["input_tokens"]);
    assert_eq!(rec["output_tokens"], usage["output_tokens"]);
    assert_eq!(
        rec["cached_tokens"],
        usage["input_tokens_details"]["cached_tokens"]
    );
    assert_eq!(rec["input_tokens_source"], "usage");
    assert_eq!(rec["max_tokens"], 12);
    assert_eq!(rec["stream"], false);
    assert!(rec["ttft_ms"].is_null() && rec["chunks"].is_null(), "{rec}");
    assert_eq!(rec["input_tokens_entry"], rec["input_tokens"], "{rec}");
    ids.push(id);

    // 2. Responses, streamed: usage from `response.completed`, prefill/decode from llama.cpp's
    //    timings beside it, TTFT/TPOT against the client's `response.output_text.delta`s.
    let s = stream(
        &gw.url("/v1/responses"),
        &responses("Count from one to twenty in words.", 24, true),
        &[],
        None,
    )
    .await;
    assert_eq!(s.status, 200);
    let completed = s
        .events
        .iter()
        .filter_map(|e| e.json.as_ref())
        .find(|j| j["type"] == "response.completed")
        .expect("response.completed")
        .clone();
    let usage = &completed["response"]["usage"];
    let n_out = u(&usage["output_tokens"]);
    assert!(n_out >= 2, "{usage}");
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["endpoint"], "responses");
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(rec["input_tokens"], usage["input_tokens"]);
    assert_eq!(rec["output_tokens"], usage["output_tokens"]);
    assert_eq!(
        rec["cached_tokens"],
        usage["input_tokens_details"]["cached_tokens"]
    );
    assert_eq!(
        rec["prefill_duration_ms"],
        completed["timings"]["prompt_ms"]
    );
    assert_eq!(
        rec["decode_duration_ms"],
        completed["timings"]["predicted_ms"]
    );
    assert_eq!(rec["engine"], "llamacpp");
    let client = seen(&s, n_out);
    // llama.cpp streams one token per delta.
    assert_eq!(client.outputs as u64, n_out);
    assert_eq!(u(&rec["chunks"]), n_out);
    assert_timing(&rec, &client, "responses");
    assert_eq!(rec["input_tokens_entry"], rec["input_tokens"], "{rec}");
    assert!(
        !String::from_utf8_lossy(&s.raw).contains("include_usage"),
        "nothing added"
    );
    ids.push(s.request_id());

    // 3. Messages, not streamed: input = uncached + cache reads (+ writes), cached = reads.
    let (resp, id) = post(&gw, "/v1/messages", &messages("Name a colour.", 8, false)).await;
    let rec = gw.record(&id).await;
    let usage = &resp["usage"];
    assert_eq!(rec["endpoint"], "messages");
    assert_eq!(rec["request_type"], "chat");
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(u(&rec["input_tokens"]), anthropic_prompt(usage), "{usage}");
    assert_eq!(rec["output_tokens"], usage["output_tokens"]);
    assert_eq!(
        u(&rec["cached_tokens"]),
        usage["cache_read_input_tokens"].as_u64().unwrap_or(0)
    );
    assert_eq!(rec["user_id"], "anthropic-user");
    assert_eq!(rec["max_tokens"], 8);
    assert_eq!(
        rec["finish_reason"], "length",
        "max_tokens is the chat's length"
    );
    assert_eq!(rec["input_tokens_entry"], rec["input_tokens"], "{rec}");
    let messages_input = u(&rec["input_tokens"]);
    ids.push(id);

    // The same conversation through chat: the same prompt total.
    let (chat, id) = post(
        &gw,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a colour."}]}),
    )
    .await;
    assert_eq!(u(&chat["usage"]["prompt_tokens"]), messages_input);
    ids.push(id);

    // The same again: served from the KV cache, still every prompt token in the input.
    let (resp, id) = post(&gw, "/v1/messages", &messages("Name a colour.", 8, false)).await;
    let rec = gw.record(&id).await;
    let read = u(&resp["usage"]["cache_read_input_tokens"]);
    assert!(read > 0, "a repeated prompt reads the cache: {resp}");
    assert_eq!(u(&rec["cached_tokens"]), read);
    assert_eq!(u(&rec["input_tokens"]), messages_input);
    ids.push(id);

    // 4. Messages, streamed: `message_start` + `message_delta` usage, TTFT/TPOT against the
    //    client's `content_block_delta`s.
    let s = stream(
        &gw.url("/v1/messages"),
        &messages("Count from one to twenty in words.", 24, true),
        &[],
        None,
    )
    .await;
    assert_eq!(s.status, 200);
    let usage = streamed_messages_usage(&s);
    let n_out = u(&usage["output_tokens"]);
    assert!(n_out >= 2, "{usage}");
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["endpoint"], "messages");
    assert_eq!(rec["outcome"], "ok", "{rec}");
    assert_eq!(u(&rec["input_tokens"]), anthropic_prompt(&usage), "{usage}");
    assert_eq!(rec["output_tokens"], usage["output_tokens"]);
    assert_eq!(rec["output_tokens_source"], "usage");
    let client = seen(&s, n_out);
    assert_eq!(client.outputs as u64, n_out);
    assert_eq!(u(&rec["chunks"]), n_out);
    assert_timing(&rec, &client, "messages");
    assert_eq!(rec["input_tokens_entry"], rec["input_tokens"], "{rec}");
    ids.push(s.request_id());

    // 5. A client that leaves a Messages stream: `cancelled`, the chunks seen so far.
    let s = stream(
        &gw.url("/v1/messages"),
        &messages(
            "Write a very long story about a lighthouse keeper.",
            400,
            true,
        ),
        &[],
        Some(3),
    )
    .await;
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["outcome"], "cancelled", "{rec}");
    // No usage came (`message_start`'s output count is a placeholder): the streamed chunks,
    // counted again with the engine's tokenizer.
    assert!(u(&rec["output_tokens"]) >= 3, "{rec}");
    assert!(u(&rec["chunks"]) >= 3, "{rec}");
    assert_eq!(rec["output_tokens_source"], "tokenizer", "{rec}");
    assert_eq!(rec["input_tokens_source"], "usage", "{rec}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = get(&format!("{}/metrics", llama.url())).await;
        if metric_sum(&text, "llamacpp:requests_processing") == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the engine slot was not freed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ids.push(s.request_id());

    // 6. The direct path: the same requests sent to the engine itself and through the gateway,
    //    back to back, get the same status, the same body (but for ids, clocks and the
    //    engine's timings, and generated text: see `GENERATED`) or the same events in the same order,
    //    and the same token totals. A request the engine refuses is refused the same way.
    let cases = [
        ("/v1/responses", responses("Name three colours.", 12, false)),
        (
            "/v1/responses",
            responses("Count from one to twenty in words.", 24, true),
        ),
        ("/v1/messages", messages("Name a colour.", 8, false)),
        (
            "/v1/messages",
            messages("Count from one to twenty in words.", 24, true),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 4}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 4, "messages": "x"}),
        ),
    ];
    for (path, body) in &cases {
        let what = format!("{path} {body}");
        if body["stream"] == true {
            let direct = stream(&format!("{}{path}", llama.url()), body, &[], None).await;
            let through = stream(&gw.url(path), body, &[], None).await;
            assert_eq!(through.status, direct.status, "{what}");
            let events = |s: &ClientStream| -> Vec<Value> {
                s.events
                    .iter()
                    .map(|e| e.json.as_ref().map(stable).unwrap_or(json!(e.data)))
                    .collect()
            };
            assert_eq!(events(&through), events(&direct), "{what}");
            assert_eq!(
                usage_totals(&stream_usage(&through)),
                usage_totals(&stream_usage(&direct)),
                "{what}"
            );
            ids.push(through.request_id());
        } else {
            let (d_status, _, d_bytes) =
                post_json(&format!("{}{path}", llama.url()), body, &[]).await;
            let (status, headers, bytes) = post_json(&gw.url(path), body, &[]).await;
            assert_eq!(
                status,
                d_status,
                "{what}: {}",
                String::from_utf8_lossy(&bytes)
            );
            let direct: Value = serde_json::from_slice(&d_bytes).expect("direct json");
            let through: Value = serde_json::from_slice(&bytes).expect("gateway json");
            assert_eq!(stable(&through), stable(&direct), "{what}");
            if status == 200 {
                assert_eq!(
                    usage_totals(&through["usage"]),
                    usage_totals(&direct["usage"]),
                    "{what}"
                );
            }
            let id = headers["x-request-id"].to_str().expect("id").to_owned();
            let rec = gw.record(&id).await;
            let outcome = match status {
                200 => "ok",
                400..=499 => "client_error",
                _ => "upstream_error",
            };
            assert_eq!(rec["outcome"], outcome, "{what}: {rec}");
            assert_eq!(rec["http_status"], status, "{what}: {rec}");
            ids.push(id);
        }
    }

    // 7. One row per request, and the report groups by endpoint: per endpoint the requests,
    //    their tokens and their TTFTs are the records'.
    let mut recs = Vec::new();
    for id in &ids {
        recs.push(gw.record(id).await);
    }
    let (store, _dir) = gw.stop();
    let rows = store_rows(&store);
    assert_eq!(rows.len(), ids.len());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["report", "--store", store.to_str().expect("utf8")])
        .args(["--by", "endpoint", "--format", "json"])
        .output()
        .expect("report");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("report json");
    let groups = report.as_array().expect("groups");
    assert_eq!(groups.len(), 3, "{report:#}");
    for endpoint in ["responses", "messages", "chat_completions"] {
        let g = groups
            .iter()
            .find(|g| g["endpoint"] == endpoint)
            .unwrap_or_else(|| panic!("{endpoint} in {report:#}"));
        let mine: Vec<&Value> = recs.iter().filter(|r| r["endpoint"] == endpoint).collect();
        let sum = |k: &str| mine.iter().map(|r| r[k].as_u64().unwrap_or(0)).sum::<u64>();
        assert_eq!(u(&g["count"]), mine.len() as u64, "{endpoint}");
        assert_eq!(u(&g["input_tokens"]), sum("input_tokens"), "{endpoint}");
        assert_eq!(u(&g["output_tokens"]), sum("output_tokens"), "{endpoint}");
        let ttfts = mine.iter().filter(|r| r["ttft_ms"].is_number()).count();
        assert_eq!(u(&g["ttft_n"]), ttfts as u64, "{endpoint}");
    }
}
