//! Starts the real vLLM server (CPU build) installed by `scripts/install-vllm.sh`, cached
//! outside the clone, serving the Hugging Face copy of the tests' Gemma 3 270M. Absent install:
//! the caller skips with a message, unless `TOKENSCOPE_REQUIRE_VLLM=1` (set by `.ci/run`), which
//! turns absence into a failure that says why (a CPU that cannot run vLLM fails the install
//! itself, before any test).
//!
//! One server at a time per test binary ([`exclusive`]): each holds ~2 GB resident plus its KV
//! cache, and two would share the CI machine's two cores.
#![allow(dead_code)]

use super::common::try_get;
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The served model name.
pub const MODEL: &str = "gemma-vllm";

pub struct Vllm {
    child: Child,
    pub port: u16,
    /// The server's stdout and stderr.
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Vllm {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The last `n` lines of the server's log (for failure messages).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // The API server, its engine core and its worker are one process group.
        let pgid = self.child.id() as i32;
        signal_group(pgid, "TERM");
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Whatever is left of the group.
        signal_group(pgid, "KILL");
        let _ = self.child.wait();
    }
}

/// Signals a whole process group with the `kill` command (no `unsafe` in tests).
fn signal_group(pgid: i32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

fn vllm_env() -> Option<HashMap<String, String>> {
    let cache = std::env::var("TOKENSCOPE_CACHE").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tokenscope",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let text = std::fs::read_to_string(format!("{cache}/vllm.env")).ok()?;
    let vars: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let ok = ["VLLM_PYTHON", "VLLM_MODEL"].iter().all(|k| {
        vars.get(*k)
            .is_some_and(|p| std::path::Path::new(p).exists())
    });
    ok.then_some(vars)
}

/// Whether vLLM is installed; panics when it is required and is not.
pub fn available() -> bool {
    if vllm_env().is_some() {
        return true;
    }
    if std::env::var("TOKENSCOPE_REQUIRE_VLLM").as_deref() == Ok("1") {
        panic!(
            "vLLM is required (TOKENSCOPE_REQUIRE_VLLM=1) but not installed: run \
             scripts/install-vllm.sh (it says why when this machine cannot run vLLM)"
        );
    }
    eprintln!("SKIPPED: vLLM not installed (run scripts/install-vllm.sh)");
    false
}

/// One vLLM test at a time in this binary.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// How a server is started.
#[derive(Default)]
pub struct Options<'a> {
    /// Extra server flags (after `--max-model-len 2048 --dtype bfloat16 --enforce-eager`).
    pub args: &'a [&'a str],
    /// The KV cache in bytes (`--kv-cache-memory-bytes`); default 2 GiB
    /// (`VLLM_CPU_KVCACHE_SPACE=2`, ~110 000 tokens of this model).
    pub kv_bytes: Option<u64>,
}

/// Starts `python -m vllm.entrypoints.openai.api_server` on a free loopback port and waits
/// for `/health` (up to 6 minutes: ~60 s on an idle 2-core machine). `None` when vLLM is not
/// installed and not required.
pub async fn start(opts: Options<'_>) -> Option<Vllm> {
    if !available() {
        return None;
    }
    let vars = vllm_env().expect("vllm.env");
    let port = free_port();
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("vllm.log");
    let out = std::fs::File::create(&log).expect("log file");
    let err = out.try_clone().expect("log file");
    let (cache, tmp) = (dir.path().join("cache"), dir.path().join("tmp"));
    std::fs::create_dir_all(&cache).expect("cache dir");
    std::fs::create_dir_all(&tmp).expect("tmp dir");
    let mut cmd = Command::new(&vars["VLLM_PYTHON"]);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server"])
        .args(["--model", &vars["VLLM_MODEL"], "--served-model-name", MODEL])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--max-model-len",
            "2048",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
        ])
        .args(["--seed", "1"])
        .args(opts.args);
    match opts.kv_bytes {
        // The variable would override the flag (vLLM's CPU platform reads it last).
        Some(bytes) => {
            cmd.args(["--kv-cache-memory-bytes", &bytes.to_string()])
                .env_remove("VLLM_CPU_KVCACHE_SPACE");
        }
        None => {
            cmd.env("VLLM_CPU_KVCACHE_SPACE", "2");
        }
    }
    cmd
        // Its caches and socket files in this server's own folder, not the home cache or the
        // system temp directory; nothing fetched.
        .env("VLLM_CACHE_ROOT", &cache)
        .env("TMPDIR", &tmp)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0);
    let child = cmd.spawn().expect("start vLLM");
    let mut vllm = Vllm {
        child,
        port,
        log,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(360);
    loop {
        let ok = tokio::time::timeout(
            Duration::from_secs(2),
            try_get(&format!("{}/health", vllm.url())),
        )
        .await
        .ok()
        .flatten()
        .is_some_and(|(s, _)| s == 200);
        if ok {
            return Some(vllm);
        }
        if let Ok(Some(status)) = vllm.child.try_wait() {
            panic!("vLLM exited ({status}):\n{}", vllm.log_tail(40));
        }
        assert!(
            Instant::now() < deadline,
            "vLLM did not become healthy in 6 minutes:\n{}",
            vllm.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
