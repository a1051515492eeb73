//! Config shape (TOML `[[tokenizers]]`), routing of models to tokenizers, startup errors, and
//! local chat counting.

use serde::Deserialize;
use serde_json::json;
use std::path::PathBuf;
use tokenscope_core::Endpoint;
use tokenscope_tokenize::{
    EngineFlavor, TokenizeError, TokenizerConfig, TokenizerSpec, Tokenizers, CHAT_REPLY_PRIMING,
    CHAT_TOKENS_PER_MESSAGE,
};

#[derive(Deserialize)]
struct File {
    tokenizers: Vec<TokenizerConfig>,
}

fn parse(toml_text: &str) -> Result<Vec<TokenizerConfig>, toml::de::Error> {
    toml::from_str::<File>(toml_text).map(|f| f.tokenizers)
}

#[test]
fn toml_shape() {
    let cfgs = parse(
        r#"
        [[tokenizers]]
        models = ["gemma*"]
        kind = "engine"
        url = "http://127.0.0.1:8080"
        flavor = "llamacpp"

        [[tokenizers]]
        models = ["qwen*", "mistral-7b"]
        kind = "engine"
        url = "http://10.0.0.1:8000"
        flavor = "vllm"

        [[tokenizers]]
        models = ["tgi-model"]
        kind = "engine"
        url = "http://tgi:80"
        flavor = "tgi"

        [[tokenizers]]
        models = ["deepseek-chat"]
        kind = "hf"
        path = "/models/deepseek/tokenizer.json"

        [[tokenizers]]
        models = ["*"]
        kind = "tiktoken"
        encoding = "o200k_base"
        "#,
    )
    .expect("valid config");
    assert_eq!(
        cfgs,
        vec![
            TokenizerConfig {
                models: vec!["gemma*".into()],
                spec: TokenizerSpec::Engine {
                    base_url: "http://127.0.0.1:8080".into(),
                    flavor: EngineFlavor::LlamaCpp,
                    ca_file: None,
                    client_cert: None,
                    client_key: None,
                },
            },
            TokenizerConfig {
                models: vec!["qwen*".into(), "mistral-7b".into()],
                spec: TokenizerSpec::Engine {
                    base_url: "http://10.0.0.1:8000".into(),
                    flavor: EngineFlavor::Vllm,
                    ca_file: None,
                    client_cert: None,
                    client_key: None,
                },
            },
            TokenizerConfig {
                models: vec!["tgi-model".into()],
                spec: TokenizerSpec::Engine {
                    base_url: "http://tgi:80".into(),
                    flavor: EngineFlavor::Tgi,
                    ca_file: None,
                    client_cert: None,
                    client_key: None,
                },
            },
            TokenizerConfig {
                models: vec!["deepseek-chat".into()],
                spec: TokenizerSpec::HuggingFace {
                    path: PathBuf::from("/models/deepseek/tokenizer.json")
                },
            },
            TokenizerConfig {
                models: vec!["*".into()],
                spec: TokenizerSpec::Tiktoken {
                    encoding: "o200k_base".into()
                },
            },
        ]
    );
}

#[test]
fn toml_rejects_unknown_and_missing_keys() {
    let bad = [
        // a typo in a variant field
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"engine\"\nurl=\"http://x\"\nflavour=\"vllm\"",
        // an extra key
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"tiktoken\"\nencoding=\"o200k_base\"\ntimeout=3",
        // a field of another variant
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"hf\"\npath=\"/x\"\nencoding=\"o200k_base\"",
        // unknown kind / flavor
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"sentencepiece\"\npath=\"/x\"",
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"engine\"\nurl=\"http://x\"\nflavor=\"ollama\"",
        // missing models / kind / field
        "[[tokenizers]]\nkind=\"tiktoken\"\nencoding=\"o200k_base\"",
        "[[tokenizers]]\nmodels=[\"a\"]\nencoding=\"o200k_base\"",
        "[[tokenizers]]\nmodels=[\"a\"]\nkind=\"engine\"\nurl=\"http://x\"",
    ];
    for text in bad {
        assert!(parse(text).is_err(), "accepted:\n{text}");
    }
}

fn engine_cfg(models: &[&str], port: u16) -> TokenizerConfig {
    TokenizerConfig {
        models: models.iter().map(|s| (*s).to_owned()).collect(),
        spec: TokenizerSpec::Engine {
            base_url: format!("http://127.0.0.1:{port}"),
            flavor: EngineFlavor::LlamaCpp,
            ca_file: None,
            client_cert: None,
            client_key: None,
        },
    }
}

#[test]
fn routing_exact_prefix_and_wildcard() {
    let t = Tokenizers::new(&[
        engine_cfg(&["gemma*"], 1),
        engine_cfg(&["gemma-3-270m", "other"], 2),
        engine_cfg(&["gemma-3*"], 3),
    ])
    .expect("valid");
    let port = |m: &str| t.describe(m);
    assert_eq!(
        port("gemma-3-270m").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:2")
    );
    assert_eq!(
        port("other").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:2")
    );
    assert_eq!(
        port("gemma-3-1b").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:3")
    );
    assert_eq!(
        port("gemma-2b").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:1")
    );
    assert!(t.has("gemma"));
    assert!(!t.has("llama-3"));
    assert!(!t.has("Gemma-2b"), "matching is case-sensitive");
    assert_eq!(port("llama-3"), None);

    let with_wildcard =
        Tokenizers::new(&[engine_cfg(&["*"], 9), engine_cfg(&["a"], 1)]).expect("valid");
    assert!(with_wildcard.has("anything"));
    assert_eq!(
        with_wildcard.describe("a").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:1")
    );
    assert_eq!(
        with_wildcard.describe("b").as_deref(),
        Some("engine:llamacpp:http://127.0.0.1:9")
    );
}

#[tokio::test]
async fn unrouted_models_get_none() {
    let t = Tokenizers::new(&[engine_cfg(&["a"], 1)]).expect("valid");
    let body = json!({ "model": "b", "prompt": "hi" });
    assert!(t
        .count_request("b", Endpoint::Completions, &body)
        .await
        .is_none());
    assert!(t.count_text("b", "hi").await.is_none());
    let empty = Tokenizers::new(&[]).expect("empty is valid");
    assert!(!empty.has("a"));
    assert!(empty.count_text("a", "hi").await.is_none());
}

#[test]
fn startup_errors() {
    let err = Tokenizers::new(&[engine_cfg(&["a*"], 1), engine_cfg(&["a*"], 2)]);
    assert!(matches!(err, Err(TokenizeError::DuplicatePattern(p)) if p == "a*"));
    let err = Tokenizers::new(&[engine_cfg(&["a*b"], 1)]);
    assert!(matches!(err, Err(TokenizeError::InvalidPattern { .. })));
    let err = Tokenizers::new(&[engine_cfg(&[], 1)]);
    assert!(matches!(err, Err(TokenizeError::InvalidPattern { .. })));

    let err = Tokenizers::new(&[TokenizerConfig {
        models: vec!["*".into()],
        spec: TokenizerSpec::Tiktoken {
            encoding: "gpt2_base".into(),
        },
    }]);
    assert!(matches!(err, Err(TokenizeError::UnknownEncoding(e)) if e == "gpt2_base"));

    let missing = PathBuf::from("/nonexistent/tokenizer.json");
    let err = Tokenizers::new(&[TokenizerConfig {
        models: vec!["*".into()],
        spec: TokenizerSpec::HuggingFace {
            path: missing.clone(),
        },
    }]);
    assert!(matches!(err, Err(TokenizeError::LoadHuggingFace { path, .. }) if path == missing));

    let not_json = std::env::temp_dir().join(format!("tokenscope-bad-{}.json", std::process::id()));
    std::fs::write(&not_json, "{\"model\": 1}").expect("write temp file");
    let err = Tokenizers::new(&[TokenizerConfig {
        models: vec!["*".into()],
        spec: TokenizerSpec::HuggingFace {
            path: not_json.clone(),
        },
    }]);
    std::fs::remove_file(&not_json).expect("remove temp file");
    assert!(matches!(err, Err(TokenizeError::LoadHuggingFace { .. })));
}

fn tiktoken(encoding: &str) -> Tokenizers {
    Tokenizers::new(&[TokenizerConfig {
        models: vec!["*".into()],
        spec: TokenizerSpec::Tiktoken {
            encoding: encoding.into(),
        },
    }])
    .expect("built-in encoding")
}

/// OpenAI cookbook "How to count tokens with tiktoken": for these six messages the API reports
/// 129 prompt tokens for gpt-4 / gpt-3.5-turbo (cl100k_base); the same accounting gives 124 with
/// o200k_base (value from Python tiktoken with the cookbook's formula).
#[tokio::test]
async fn local_chat_count_follows_openai_accounting() {
    let body = json!({
        "model": "gpt-4",
        "messages": [
            {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
            {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
            {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
            {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
            {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
            {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."}
        ]
    });
    for (encoding, want) in [("cl100k_base", 129), ("o200k_base", 124)] {
        let t = tiktoken(encoding);
        let got = t
            .count_request("gpt-4", Endpoint::ChatCompletions, &body)
            .await
            .expect("routed")
            .expect("count");
        assert_eq!(got, want, "{encoding}");
    }

    // Empty conversation: only the reply priming; one empty message adds the per-message cost
    // plus its role.
    let t = tiktoken("cl100k_base");
    let count = |b| {
        let t = t.clone();
        async move {
            t.count_request("m", Endpoint::ChatCompletions, &b)
                .await
                .expect("routed")
                .expect("count")
        }
    };
    assert_eq!(count(json!({"messages": []})).await, CHAT_REPLY_PRIMING);
    assert_eq!(
        count(json!({"messages": [{"role": "user", "content": ""}]})).await,
        CHAT_REPLY_PRIMING + CHAT_TOKENS_PER_MESSAGE + 1
    );
}

#[tokio::test]
async fn local_prompt_shapes_and_limits() {
    let t = tiktoken("cl100k_base");
    let count = |endpoint, b| {
        let t = t.clone();
        async move { t.count_request("m", endpoint, &b).await.expect("routed") }
    };
    // "hello world" is 2 tokens in cl100k_base.
    assert_eq!(
        count(Endpoint::Completions, json!({"prompt": "hello world"}))
            .await
            .expect("count"),
        2
    );
    assert_eq!(
        count(
            Endpoint::Embeddings,
            json!({"input": ["hello world", [1, 2, 3]]})
        )
        .await
        .expect("count"),
        5
    );
    let big = "x".repeat(tokenscope_tokenize::MAX_COUNT_BYTES + 1);
    assert!(matches!(
        count(Endpoint::Completions, json!({"prompt": big})).await,
        Err(TokenizeError::TooLong { .. })
    ));
    assert!(matches!(
        count(Endpoint::Embeddings, json!({"prompt": "wrong field"})).await,
        Err(TokenizeError::NoPrompt {
            endpoint: "embeddings"
        })
    ));
}

/// The integrator spawns counts next to the upstream request: the futures must be `Send`.
#[test]
fn count_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let t = Tokenizers::new(&[]).expect("empty");
    let body = json!({});
    let f = t.count_request("m", Endpoint::Completions, &body);
    assert_send(&f);
    let g = t.count_text("m", "x");
    assert_send(&g);
    fn assert_sync_clone<T: Send + Sync + Clone + 'static>() {}
    assert_sync_clone::<Tokenizers>();
}
