//! Reference equality: token ids of every line of `tests/fixtures/corpus.txt` (and of the whole
//! file) must equal what the reference implementations produce — Python `tiktoken` for
//! `cl100k_base`/`o200k_base`, Python `tokenizers` for the DeepSeek `tokenizer.json`.
//!
//! The expected ids are committed in `tests/fixtures/reference_counts.json` (written by
//! `tests/gen_reference.py` through `scripts/reference.sh`), so this test needs no Python. When
//! the Python reference environment that `scripts/reference.sh` prepares is present (venv and
//! offline tiktoken cache under `$TOKENSCOPE_CACHE`), the generator is also re-run into a
//! temporary file and the Rust ids are compared with that live output too.
//!
//! The Hugging Face fixture (4.3 MB) is not committed: `scripts/fetch-fixtures.sh` extracts it
//! from the PyPI `litellm` wheel into `$TOKENSCOPE_CACHE/tokenizers/`. Without it the HF part is
//! skipped with a message, unless `TOKENSCOPE_REQUIRE_FIXTURES=1`, which makes absence a failure.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tokenscope_core::Endpoint;
use tokenscope_tokenize::{LocalTokenizer, TokenizerConfig, TokenizerSpec, Tokenizers};

const ENCODINGS: [&str; 2] = ["cl100k_base", "o200k_base"];
const HF: &str = "deepseek";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cache_dir() -> PathBuf {
    match std::env::var_os("TOKENSCOPE_CACHE") {
        Some(p) => PathBuf::from(p),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tokenscope")
        }
    }
}

fn committed() -> Value {
    let path = crate_dir().join("tests/fixtures/reference_counts.json");
    let text = std::fs::read_to_string(&path).expect("reference_counts.json is committed");
    serde_json::from_str(&text).expect("reference_counts.json is JSON")
}

fn cases(reference: &Value) -> &Vec<Value> {
    reference["cases"].as_array().expect("cases array")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| {
            let n = x.as_u64().expect("id is a number");
            u32::try_from(n).expect("id fits u32")
        })
        .collect()
}

/// The HF fixture, or `None` (skip) when absent and not required.
fn hf_fixture() -> Option<PathBuf> {
    let path = cache_dir().join("tokenizers/deepseek_tokenizer.json");
    if path.exists() {
        return Some(path);
    }
    let msg = format!(
        "{} is missing: run crates/tokenscope-tokenize/scripts/fetch-fixtures.sh",
        path.display()
    );
    if std::env::var("TOKENSCOPE_REQUIRE_FIXTURES").as_deref() == Ok("1") {
        panic!("{msg} (TOKENSCOPE_REQUIRE_FIXTURES=1)");
    }
    eprintln!("skipping the Hugging Face reference comparison: {msg}");
    None
}

/// Compares one tokenizer's ids for every case of `reference`.
fn compare(reference: &Value, key: &str, tok: &LocalTokenizer, source: &str) {
    let mut mismatches = Vec::new();
    for case in cases(reference) {
        let text = case["text"].as_str().expect("case text");
        let want = &case[key];
        let got = tok.encode(text, false).expect("encode");
        let count = tok.count(text, false).expect("count");
        let want_ids = ids(&want["ids"]);
        assert_eq!(want["count"].as_u64(), Some(want_ids.len() as u64));
        if got != want_ids || count != want_ids.len() as u64 {
            mismatches.push(format!(
                "{} ({key}, {source}): got {} tokens {:?}, want {} {:?}",
                case["name"],
                got.len(),
                got,
                want_ids.len(),
                want_ids
            ));
        }
        if let Some(with_special) = want.get("count_with_special") {
            assert_eq!(
                Some(tok.count(text, true).expect("count")),
                with_special.as_u64(),
                "{} ({key}, {source}) with special tokens",
                case["name"]
            );
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn corpus_matches_the_reference_file() {
    let reference = committed();
    let corpus =
        std::fs::read_to_string(crate_dir().join("tests/fixtures/corpus.txt")).expect("corpus.txt");
    let mut lines: Vec<&str> = corpus.split('\n').collect();
    if lines.last() == Some(&"") {
        lines.pop();
    }
    assert!(lines.len() >= 30, "corpus has {} lines", lines.len());
    let cases = cases(&reference);
    assert_eq!(
        cases.len(),
        lines.len() + 1,
        "one case per line + the whole file"
    );
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(
            cases[i]["text"].as_str(),
            Some(*line),
            "line {} of corpus.txt changed: rerun scripts/reference.sh",
            i + 1
        );
    }
    assert_eq!(cases[lines.len()]["text"].as_str(), Some(corpus.as_str()));
    let meta = &reference["meta"];
    assert_eq!(meta["encodings"], json!(ENCODINGS));
    assert_eq!(meta["hf_tokenizer"]["name"], json!(HF));
}

#[test]
fn tiktoken_ids_equal_python_tiktoken() {
    let reference = committed();
    for enc in ENCODINGS {
        let tok = LocalTokenizer::tiktoken(enc).expect("built-in encoding");
        compare(&reference, enc, &tok, "committed");
    }
}

#[test]
fn hugging_face_ids_equal_python_tokenizers() {
    let Some(path) = hf_fixture() else { return };
    let reference = committed();
    assert_eq!(
        reference["meta"]["hf_tokenizer"]["sha256"]
            .as_str()
            .map(str::len),
        Some(64)
    );
    let tok = LocalTokenizer::hugging_face(&path).expect("tokenizer.json loads");
    compare(&reference, HF, &tok, "committed");
}

/// The Python reference, re-run now, when its environment is present.
fn live_reference(hf: &Path) -> Option<Value> {
    let cache = cache_dir();
    let python = cache.join("tokenize-venv/bin/python");
    let tiktoken_cache = cache.join("tiktoken-cache");
    // sha1 of the blob URLs of cl100k_base and o200k_base (tiktoken's load.py cache keys):
    // without them tiktoken would try the network.
    let keys = [
        "9b5ad71b2ce5302211f9c61530b329a4922fc6a4",
        "fb374d419588a4632f3f557e76b4b70aebbca790",
    ];
    if !python.exists() || !keys.iter().all(|k| tiktoken_cache.join(k).exists()) {
        eprintln!("live Python reference not set up (scripts/reference.sh); using the committed JSON only");
        return None;
    }
    let out =
        std::env::temp_dir().join(format!("tokenscope-reference-{}.json", std::process::id()));
    let status = std::process::Command::new(&python)
        .arg(crate_dir().join("tests/gen_reference.py"))
        .arg("--hf")
        .arg(hf)
        .arg("--out")
        .arg(&out)
        .env("TIKTOKEN_CACHE_DIR", &tiktoken_cache)
        .status()
        .expect("run gen_reference.py");
    assert!(status.success(), "gen_reference.py failed: {status}");
    let text = std::fs::read_to_string(&out).expect("live reference written");
    std::fs::remove_file(&out).expect("remove temp file");
    Some(serde_json::from_str(&text).expect("live reference is JSON"))
}

#[test]
fn ids_equal_a_live_python_reference_when_present() {
    let Some(hf) = hf_fixture() else { return };
    let Some(live) = live_reference(&hf) else {
        return;
    };
    for enc in ENCODINGS {
        let tok = LocalTokenizer::tiktoken(enc).expect("built-in encoding");
        compare(&live, enc, &tok, "live");
    }
    let tok = LocalTokenizer::hugging_face(&hf).expect("tokenizer.json loads");
    compare(&live, HF, &tok, "live");
    assert_eq!(
        live["cases"],
        committed()["cases"],
        "committed JSON is stale"
    );
}

/// The public API gives the same counts as the reference: plain text via `count_text`, and
/// completion prompts via `count_request` (with special tokens, as an engine tokenizes them).
#[tokio::test]
async fn public_api_counts_equal_the_reference() {
    let reference = committed();
    let mut cfgs = vec![
        TokenizerConfig {
            models: vec!["gpt-4".into()],
            spec: TokenizerSpec::Tiktoken {
                encoding: "cl100k_base".into(),
            },
        },
        TokenizerConfig {
            models: vec!["gpt-4o*".into()],
            spec: TokenizerSpec::Tiktoken {
                encoding: "o200k_base".into(),
            },
        },
    ];
    let hf = hf_fixture();
    if let Some(path) = &hf {
        cfgs.push(TokenizerConfig {
            models: vec!["deepseek*".into()],
            spec: TokenizerSpec::HuggingFace { path: path.clone() },
        });
    }
    let toks = Tokenizers::new(&cfgs).expect("tokenizers load");
    let mut models = vec![("gpt-4", "cl100k_base"), ("gpt-4o-mini", "o200k_base")];
    if hf.is_some() {
        models.push(("deepseek-chat", HF));
    }
    for case in cases(&reference) {
        let text = case["text"].as_str().expect("case text");
        for (model, key) in &models {
            let want = case[*key]["count"].as_u64();
            let got = toks
                .count_text(model, text)
                .await
                .expect("routed")
                .expect("count");
            assert_eq!(Some(got), want, "{} count_text {model}", case["name"]);
            let want_prompt = case[*key]
                .get("count_with_special")
                .map_or(want, Value::as_u64);
            let body = json!({ "model": model, "prompt": text });
            let got = toks
                .count_request(model, Endpoint::Completions, &body)
                .await
                .expect("routed")
                .expect("count");
            assert_eq!(Some(got), want_prompt, "{} prompt {model}", case["name"]);
        }
    }
}
