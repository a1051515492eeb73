//! Entry token counts through the real gateway binary against the mock engine: the count runs
//! beside forwarding, is kept on the record, fills records that have no usage, is compared with
//! the engine's usage (mismatches counted), and a cancelled stream's output is counted from the
//! streamed text with the model's tokenizer.

mod common;

use common::*;
use serde_json::json;

fn config(dir: &tempfile::TempDir, mock: &MockProc) -> String {
    let cfg = dir.path().join("tok.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[upstreams]]\nname = \"mock\"\nurl = \"{url}\"\nscrape_interval_ms = 0\n\
             [[tokenizers]]\nmodels = [\"engine-model\"]\nkind = \"engine\"\nurl = \"{url}\"\nflavor = \"llamacpp\"\n\
             [[tokenizers]]\nmodels = [\"gpt-4o*\"]\nkind = \"tiktoken\"\nencoding = \"o200k_base\"\n",
            url = mock.url()
        ),
    )
    .expect("write config");
    cfg.to_str().expect("utf8").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_counts_fill_compare_and_count_cancelled_output() {
    let mock = MockProc::start(&["--time-scale", "0.2"]);
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = config(&dir, &mock);
    let gw = GatewayProc::start_with_args(None, &["--config", &cfg], &[]);

    // 1. Plain completion, engine tokenizer: the entry count equals the engine's usage.
    let (status, headers, body) = post_json(
        &gw.url("/v1/completions"),
        &json!({"model": "engine-model", "prompt": "counting the tokens of this prompt exactly", "max_tokens": 3}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let usage: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["input_tokens_entry"], usage["usage"]["prompt_tokens"]);
    assert_eq!(rec["input_tokens"], usage["usage"]["prompt_tokens"]);
    assert_eq!(rec["input_tokens_source"], "usage");

    // 2. A tokenizer that disagrees with the engine (o200k vs the mock's own): usage stays
    //    authoritative, both numbers are kept, the mismatch is counted.
    let (status, headers, _) = post_json(
        &gw.url("/v1/chat/completions"),
        &json!({"model": "gpt-4o-mini", "max_tokens": 2, "messages": [
            {"role": "user", "content": "Internationalisation of 東京 and Zürich costs tokens 🙂"}]}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    let entry = rec["input_tokens_entry"].as_u64().expect("entry count");
    let usage = rec["input_tokens"].as_u64().expect("usage");
    assert_eq!(rec["input_tokens_source"], "usage");
    assert_ne!(entry, usage, "the two tokenizers differ on this text");
    let m = gw.metrics().await;
    assert_eq!(
        metric_where(
            &m,
            "llm_token_count_mismatch_total",
            &[("model", "gpt-4o-mini")]
        ),
        1.0
    );

    // 3. An upstream failure has no usage: the entry count becomes the input count.
    let (status, headers, _) = post_json(
        &gw.url("/v1/completions"),
        &json!({"model": "engine-model", "prompt": "this request fails upstream", "max_tokens": 3}),
        &[("x-mock-fault", "error_500")],
    )
    .await;
    assert_eq!(status, 500);
    let rec = gw
        .record(headers["x-request-id"].to_str().expect("id"))
        .await;
    assert_eq!(rec["outcome"], "upstream_error");
    assert_eq!(rec["input_tokens_source"], "tokenizer");
    assert_eq!(rec["input_tokens"], rec["input_tokens_entry"]);
    // The mock tokenizer counts ceil(len/4) per word: this=1 request=2 fails=2 upstream=2.
    assert_eq!(rec["input_tokens"], 7);

    // 4. A cancelled stream: output tokens counted from the streamed text with the tokenizer.
    let s = stream(
        &gw.url("/v1/completions"),
        &json!({"model": "engine-model", "prompt": "write", "stream": true, "mock_output_tokens": 200}),
        &[],
        Some(5),
    )
    .await;
    let rec = gw.record(&s.request_id()).await;
    assert_eq!(rec["outcome"], "cancelled");
    assert_eq!(rec["output_tokens_source"], "tokenizer", "{rec}");
    let seen_text: String = s
        .output_events()
        .iter()
        .filter_map(|e| {
            e.json.as_ref()?["choices"][0]["text"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    let words = seen_text.split_whitespace().count() as u64;
    assert!(
        rec["output_tokens"].as_u64().expect("n") >= words,
        "{rec} vs {seen_text:?}"
    );
}
