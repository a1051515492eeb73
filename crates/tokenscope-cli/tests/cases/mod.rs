//! The article's cases as load shapes for a real engine behind the gateway, and `tokenscope
//! diagnose` run over what the gateway stored. Shared by the llama.cpp and vLLM test binaries.
//!
//! * **Case 1, long prompts among short ones** ([`head_of_line`]): short streamed prompts
//!   arrive every `gap`; every `long_every`-th arrival is a long prompt instead. With a small
//!   prefill batch (llama.cpp `-b 256`, vLLM `--max-num-batched-tokens 256`) a long prompt
//!   needs several engine steps to prefill, and short requests that arrive meanwhile wait for
//!   them: their TTFT is several times that of short requests that arrive alone.
//!
//! The assertions are relations (a ratio of medians, counts), never absolute times: the
//! engines run on the CI's two shared cores.

#![allow(dead_code)]

use crate::common::{prose, stream, ClientStream};
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;

/// Wall-clock seconds since the epoch (for `diagnose --since/--until`).
pub fn unix_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

/// Runs `tokenscope diagnose --format json` over `[since, until]` with extra `args`.
pub fn diagnose(store: &str, since: f64, until: f64, args: &[&str]) -> (Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenscope"))
        .args(["diagnose", "--store", store, "--format", "json"])
        .arg("--since")
        .arg(format!("@{}", since.floor() - 1.0))
        .arg("--until")
        .arg(format!("@{}", until.ceil() + 1.0))
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .output()
        .expect("run diagnose");
    assert!(
        out.status.success(),
        "diagnose failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    (serde_json::from_str(&text).expect("json"), text)
}

/// The step `name` of a diagnose report.
pub fn step<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["steps"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["step"] == name))
        .unwrap_or_else(|| panic!("no step {name}: {report}"))
}

/// Whether the array `v` has a string containing `s`.
pub fn has(v: &Value, s: &str) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|x| x.contains(s))))
}

/// A case-1 load: what to send.
pub struct HeadOfLine<'a> {
    /// The served model name.
    pub model: &'a str,
    /// Words of a long prompt (~1 token each with the tests' Gemma tokenizer).
    pub long_words: usize,
    /// Words of a short prompt.
    pub short_words: usize,
    /// Requests in all.
    pub requests: usize,
    /// Every `long_every`-th request is long (the rest short).
    pub long_every: usize,
    /// Between two arrivals.
    pub gap: Duration,
    /// Output tokens of each request.
    pub max_tokens: u64,
}

impl HeadOfLine<'_> {
    /// Whether request `i` is a long one.
    pub fn is_long(&self, i: usize) -> bool {
        i % self.long_every == self.long_every / 2
    }
}

/// Sends the case-1 load to `url` (a `/v1/completions` URL, streamed with usage), one arrival
/// every `gap`, and returns every stream in arrival order. Every request must succeed.
pub async fn head_of_line(url: &str, load: &HeadOfLine<'_>) -> Vec<ClientStream> {
    let mut tasks = Vec::new();
    for i in 0..load.requests {
        let words = if load.is_long(i) {
            load.long_words
        } else {
            load.short_words
        };
        let body = json!({
            "model": load.model,
            "prompt": prose(words, &format!("case one {i}")),
            "max_tokens": load.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let url = url.to_owned();
        let at = load.gap * i as u32;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(at).await;
            stream(&url, &body, &[], None).await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        let s = t.await.expect("task");
        assert_eq!(s.status, 200, "{}", String::from_utf8_lossy(&s.raw));
        out.push(s);
    }
    out
}

/// Asserts that `report` names head-of-line blocking with its numbers: the TTFT step finds
/// `starvation` for the long bucket `long_bucket`, P50 TTFT of short requests beside long
/// prefills ≥ 2 × that of short requests alone, each group with enough samples, and the
/// conclusion is that step. Returns the starvation ratio.
pub fn assert_names_starvation(report: &Value, text: &str, long_bucket: &str) -> f64 {
    let ttft = step(report, "ttft");
    assert_eq!(ttft["verdict"], "problem", "{text}");
    assert!(has(&ttft["findings"], "starvation"), "{text}");
    assert_eq!(ttft["evidence"]["long_bucket"], long_bucket, "{text}");
    let ratio = ttft["evidence"]["starvation_ratio"]
        .as_f64()
        .unwrap_or_else(|| panic!("no starvation ratio: {text}"));
    assert!(ratio >= 2.0, "{text}");
    assert!(
        ttft["evidence"]["short_beside_long_n"].as_u64().expect("n") >= 10,
        "{text}"
    );
    assert!(
        ttft["evidence"]["short_alone_n"].as_u64().expect("n") >= 10,
        "{text}"
    );
    assert_eq!(report["conclusion"]["step"], "ttft", "{text}");
    assert!(
        has(&report["conclusion"]["findings"], "starvation"),
        "{text}"
    );
    assert!(
        report["conclusion"]["summary"]
            .as_str()
            .expect("summary")
            .contains("long prompts starve short ones"),
        "{text}"
    );
    ratio
}
