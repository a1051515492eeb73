//! Starts the real llama.cpp server installed by `scripts/install-llama.sh` (cached outside the
//! clone). Absent engine: the caller skips with a message, unless `TOKENSCOPE_REQUIRE_ENGINE=1`
//! (set by `.ci/run`), which turns absence into a failure.
#![allow(dead_code)]

use super::common::try_get;
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Llama {
    child: Child,
    pub port: u16,
}

impl Llama {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Llama {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn llama_env() -> Option<HashMap<String, String>> {
    let path = std::env::var("TOKENSCOPE_LLAMA_ENV").unwrap_or_else(|_| {
        let cache = std::env::var("TOKENSCOPE_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/tokenscope",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        format!("{cache}/llama.env")
    });
    let text = std::fs::read_to_string(&path).ok()?;
    let vars: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let ok = ["LLAMA_SERVER", "LLAMA_MODEL"].iter().all(|k| {
        vars.get(*k)
            .is_some_and(|p| std::path::Path::new(p).exists())
    });
    ok.then_some(vars)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Starts `llama-server` on a free loopback port with `--metrics --slots -t 1` plus `args`
/// (one thread: the gateway and the test client keep the other core, so client-side timing
/// comparisons are not distorted by the engine's busy threads).
pub async fn start(args: &[&str]) -> Option<Llama> {
    start_on(free_port(), args).await
}

/// [`start`] on `port` (e.g. to restart an engine where the gateway expects it).
pub async fn start_on(port: u16, args: &[&str]) -> Option<Llama> {
    let Some(vars) = llama_env() else {
        if std::env::var("TOKENSCOPE_REQUIRE_ENGINE").as_deref() == Ok("1") {
            panic!("llama.cpp is required (TOKENSCOPE_REQUIRE_ENGINE=1) but not installed: run scripts/install-llama.sh");
        }
        eprintln!("SKIPPED: llama.cpp not installed (run scripts/install-llama.sh)");
        return None;
    };
    let child = Command::new(&vars["LLAMA_SERVER"])
        .env(
            "LD_LIBRARY_PATH",
            vars.get("LLAMA_LIB_DIR").cloned().unwrap_or_default(),
        )
        .args(["-m", &vars["LLAMA_MODEL"], "--host", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .args(["--metrics", "--slots", "-t", "1"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start llama-server");
    let llama = Llama { child, port };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ok = tokio::time::timeout(
            Duration::from_secs(2),
            try_get(&format!("http://127.0.0.1:{port}/health")),
        )
        .await
        .ok()
        .flatten()
        .is_some_and(|(s, _)| s == 200);
        if ok {
            return Some(llama);
        }
        assert!(
            Instant::now() < deadline,
            "llama-server did not become healthy"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
