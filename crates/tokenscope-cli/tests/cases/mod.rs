//! The article's cases as load shapes for a real engine behind the gateway, and `tokenscope
//! diagnose` run over what the gateway stored. Shared by the llama.cpp and vLLM test binaries.
//!
//! * **Case 1, long prompts among short ones** ([`head_of_line`]): short streamed prompts
//!   alone, and short ones arriving while a long prompt prefills (closed-loop rounds sized by
//!   the long prefill's measured time, so a slow machine never turns it into an overload). With a small
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
///
/// The load is closed-loop, so that it shows the blocking and never an overload whatever the
/// engine's speed (the CI's two shared cores run the engine several times slower than an idle
/// machine): two long prompts alone first measure how long a long prefill takes here (the
/// faster of the two: the first pays the engine's warm-up); then each of `rounds` rounds sends
/// `alone` short requests with nothing long in flight and waits for them, then one long prompt
/// and, while it prefills, `beside` short ones spread over the first 60 % of the measured long
/// TTFT (the long request only gets slower beside them, so each of them arrives before its
/// first token), and waits for all of them.
pub struct HeadOfLine<'a> {
    /// The served model name.
    pub model: &'a str,
    /// Words of a long prompt (~1 token each with the tests' Gemma tokenizer).
    pub long_words: usize,
    /// Words of a short prompt.
    pub short_words: usize,
    /// Rounds after the two measuring long prompts.
    pub rounds: usize,
    /// Short requests alone per round.
    pub alone: usize,
    /// Short requests beside the long prefill per round.
    pub beside: usize,
    /// Between two arrivals of short requests alone.
    pub gap: Duration,
    /// Output tokens of each request.
    pub max_tokens: u64,
}

impl HeadOfLine<'_> {
    /// Requests the load sends in all.
    pub fn requests(&self) -> usize {
        2 + self.rounds * (self.alone + 1 + self.beside)
    }
}

/// One request of a case-1 load, in arrival order.
pub struct Sent {
    /// Whether it was a long prompt.
    pub long: bool,
    /// What the client saw.
    pub stream: ClientStream,
}

/// The caller and business line of a case-1 load's long prompts (headers).
pub const LONG_CALLER: &str = "batch-job";
/// See [`LONG_CALLER`].
pub const LONG_LINE: &str = "offline";
/// The business line of a case-1 load's short prompts.
pub const SHORT_LINE: &str = "search";

/// The attribution headers of a case-1 request.
fn who(long: bool) -> &'static [(&'static str, &'static str)] {
    if long {
        &[
            ("x-tokenscope-user", LONG_CALLER),
            ("x-tokenscope-business-line", LONG_LINE),
        ]
    } else {
        &[("x-tokenscope-business-line", SHORT_LINE)]
    }
}

/// Sends the case-1 load (see [`HeadOfLine`]) to `url` (a `/v1/completions` URL, streamed with
/// usage) and returns every request in arrival order. Every request must succeed. Long
/// prompts come from [`LONG_CALLER`] of [`LONG_LINE`], short ones from [`SHORT_LINE`].
pub async fn head_of_line(url: &str, load: &HeadOfLine<'_>) -> Vec<Sent> {
    let mut n = 0usize;
    let mut body = |long: bool| {
        n += 1;
        json!({
            "model": load.model,
            "prompt": prose(
                if long { load.long_words } else { load.short_words },
                &format!("case one {n}"),
            ),
            "max_tokens": load.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    fn ok(s: ClientStream) -> ClientStream {
        assert_eq!(s.status, 200, "{}", String::from_utf8_lossy(&s.raw));
        s
    }
    let mut out = Vec::new();
    let mut long_ttft = f64::INFINITY;
    for _ in 0..2 {
        let s = ok(stream(url, &body(true), who(true), None).await);
        long_ttft = long_ttft.min(s.ttft_ms().expect("long TTFT"));
        out.push(Sent {
            long: true,
            stream: s,
        });
    }
    let spread = Duration::from_secs_f64(long_ttft * 0.6 / 1000.0);
    let step = spread / load.beside.max(1) as u32;
    for _ in 0..load.rounds {
        let mut tasks = Vec::new();
        for k in 0..load.alone {
            let (url, b, at) = (url.to_owned(), body(false), load.gap * k as u32);
            tasks.push((
                false,
                tokio::spawn(async move {
                    tokio::time::sleep(at).await;
                    stream(&url, &b, who(false), None).await
                }),
            ));
        }
        for (long, t) in tasks.drain(..) {
            out.push(Sent {
                long,
                stream: ok(t.await.expect("task")),
            });
        }
        let (u, b) = (url.to_owned(), body(true));
        tasks.push((
            true,
            tokio::spawn(async move { stream(&u, &b, who(true), None).await }),
        ));
        for k in 1..=load.beside {
            let (url, b, at) = (url.to_owned(), body(false), step * k as u32);
            tasks.push((
                false,
                tokio::spawn(async move {
                    tokio::time::sleep(at).await;
                    stream(&url, &b, who(false), None).await
                }),
            ));
        }
        for (long, t) in tasks {
            out.push(Sent {
                long,
                stream: ok(t.await.expect("task")),
            });
        }
    }
    out
}

/// Asserts that `report` names head-of-line blocking with its numbers: the TTFT step finds
/// `starvation` for the long bucket `long_bucket`, P50 TTFT of short requests beside long
/// prefills ≥ 2 × that of short requests alone, each group with enough samples, and the
/// conclusion is that step. Returns the starvation ratio.
pub fn assert_names_starvation(report: &Value, text: &str, long_bucket: &str) -> f64 {
    let ttft = step(report, "ttft");
    let e = &ttft["evidence"];
    // What failed comes first, in a line (a CI log shows the beginning of a failing test's
    // output), then the whole report.
    let short = format!(
        "ttft: {} {} ({}); conclusion: {} {}; starvation ratio {}, short beside long n={}, alone \
         n={}, long bucket {}",
        ttft["verdict"],
        ttft["findings"],
        ttft["summary"],
        report["conclusion"]["step"],
        report["conclusion"]["findings"],
        e["starvation_ratio"],
        e["short_beside_long_n"],
        e["short_alone_n"],
        e["long_bucket"],
    );
    let check = |ok: bool, what: &str| assert!(ok, "{what}: {short}\n{text}");
    check(ttft["verdict"] == "problem", "the TTFT step is no problem");
    check(
        has(&ttft["findings"], "starvation"),
        "no starvation finding",
    );
    check(e["long_bucket"] == long_bucket, "another long bucket");
    let ratio = e["starvation_ratio"].as_f64().unwrap_or(0.0);
    check(ratio >= 2.0, "starvation ratio under 2");
    check(
        e["short_beside_long_n"].as_u64().unwrap_or(0) >= 10,
        "under 10 short requests beside long ones",
    );
    check(
        e["short_alone_n"].as_u64().unwrap_or(0) >= 10,
        "under 10 short requests alone",
    );
    check(
        report["conclusion"]["step"] == "ttft",
        "the conclusion is not the TTFT step",
    );
    check(
        has(&report["conclusion"]["findings"], "starvation"),
        "the conclusion does not name starvation",
    );
    check(
        report["conclusion"]["summary"]
            .as_str()
            .is_some_and(|s| s.contains("long prompts starve short ones")),
        "the conclusion's summary does not say it",
    );
    ratio
}

/// Asserts the per-request blame of a case-1 run, from the store's rows (`store_table`): every
/// short request whose wait (`[created_at, created_at + TTFT]`, TTFT = the engine's queue +
/// prefill when not streamed) overlapped a long request's
/// prefill (the same interval of the long one) by at least 5 ms names a long request as its
/// largest blocker, with that request's caller and business line, a positive blocked time
/// and at least one blocker. Returns how many short requests were checked.
pub fn assert_short_requests_name_the_long_one(
    rows: &[serde_json::Map<String, Value>],
    is_long: impl Fn(&serde_json::Map<String, Value>) -> bool,
    long_caller: &str,
    long_line: &str,
) -> usize {
    // The gateway's TTFT, else (not streamed) the engine's queue + prefill.
    let span = |r: &serde_json::Map<String, Value>| -> Option<(f64, f64)> {
        let at = r["created_at"].as_f64()? / 1000.0;
        let t = r["ttft_ms"].as_f64().or_else(|| {
            Some(r["queue_duration_ms"].as_f64()? + r["prefill_duration_ms"].as_f64()?)
        })?;
        Some((at, at + t))
    };
    let longs: Vec<(String, (f64, f64))> = rows
        .iter()
        .filter(|r| is_long(r))
        .filter_map(|r| Some((r["request_id"].as_str()?.to_owned(), span(r)?)))
        .collect();
    assert!(!longs.is_empty(), "no long request with a TTFT");
    let mut checked = 0;
    for r in rows.iter().filter(|r| !is_long(r)) {
        let Some((s, e)) = span(r) else { continue };
        let overlaps = longs
            .iter()
            .any(|(_, (ls, le))| s.max(*ls) + 5.0 <= e.min(*le));
        if !overlaps {
            continue;
        }
        checked += 1;
        let id = r["request_id"].as_str().unwrap_or("?");
        let blocker = r["blocker_request_id"].as_str().unwrap_or("");
        assert!(
            longs.iter().any(|(l, _)| l == blocker),
            "short request {id} waited beside a long prefill but names {blocker:?} as its largest blocker: {r:?}"
        );
        assert_eq!(r["blocker_caller"], json!(long_caller), "{r:?}");
        assert_eq!(r["blocker_business_line"], json!(long_line), "{r:?}");
        assert!(r["blocked_by_requests"].as_i64().unwrap_or(0) >= 1, "{r:?}");
        assert!(r["blocked_ms"].as_f64().unwrap_or(0.0) > 0.0, "{r:?}");
        assert!(
            r["blocker_prompt_tokens"].as_i64().unwrap_or(0) > 500,
            "{r:?}"
        );
    }
    checked
}
