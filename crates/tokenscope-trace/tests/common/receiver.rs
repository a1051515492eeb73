//! The Rust side of the OTLP test receiver: runs `tests/otlp_receiver.py` (tokenscope-trace) in
//! the OpenTelemetry Python venv and reads back the spans it decoded with the official
//! `opentelemetry-proto` classes, one JSON object per span (see the script's docstring for the
//! keys).
//!
//! Shared by the integration tests of several crates (std + `serde_json` + `tempfile` only), so
//! the script path is an argument: `Path::new(env!("CARGO_MANIFEST_DIR"))` joined with the way
//! to `crates/tokenscope-trace/tests/otlp_receiver.py` from the calling crate.
//!
//! The venv is `${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/otel-venv`, made by
//! `crates/tokenscope-otlp/scripts/install-python-otel.sh`. Without it [`Receiver::start`]
//! prints a skip message and returns `None`, unless `TOKENSCOPE_REQUIRE_OTEL_PY=1` (CI), where it
//! panics.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

/// How long the receiver may take to print `LISTENING <port>` (a cold Python import of grpc).
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Poll interval of [`Receiver::wait_for_spans`].
const POLL: Duration = Duration::from_millis(50);

/// The venv's python (`${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}/otel-venv/bin/python`), if it
/// exists.
pub fn otel_python() -> Option<PathBuf> {
    let cache = std::env::var_os("TOKENSCOPE_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".cache/tokenscope")))
        .unwrap_or_else(|| PathBuf::from(".cache/tokenscope"));
    let python = cache.join("otel-venv/bin/python");
    python.is_file().then_some(python)
}

/// `TOKENSCOPE_REQUIRE_OTEL_PY=1`: a missing venv is a failure, not a skip (CI).
pub fn require_otel_py() -> bool {
    std::env::var("TOKENSCOPE_REQUIRE_OTEL_PY").is_ok_and(|v| v == "1")
}

/// A running `otlp_receiver.py` on `127.0.0.1:port`; killed on drop.
pub struct Receiver {
    /// The port it listens on.
    pub port: u16,
    /// `"http"` or `"grpc"`.
    pub protocol: &'static str,
    child: Mutex<Child>,
    out: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    /// Starts the receiver script `script` for `protocol` (`"http"` or `"grpc"`) with
    /// `extra_args` (`["--fail-first", "2"]`, `["--delay-ms", "500"]`, …) and waits for its
    /// `LISTENING <port>` line.
    ///
    /// `None` when the venv is missing (the skip is printed); panics when it is missing and
    /// required, or when the receiver does not start.
    pub fn start(script: &Path, protocol: &str, extra_args: &[&str]) -> Option<Receiver> {
        let protocol: &'static str = match protocol {
            "http" => "http",
            "grpc" => "grpc",
            other => {
                panic!("Receiver::start: protocol must be \"http\" or \"grpc\", not {other:?}")
            }
        };
        let Some(python) = otel_python() else {
            let msg = "OpenTelemetry Python venv not found (otel-venv under \
                       ${TOKENSCOPE_CACHE:-$HOME/.cache/tokenscope}); run \
                       crates/tokenscope-otlp/scripts/install-python-otel.sh";
            assert!(!require_otel_py(), "TOKENSCOPE_REQUIRE_OTEL_PY=1: {msg}");
            eprintln!("SKIP (OTLP {protocol} receiver): {msg}");
            return None;
        };
        assert!(
            script.is_file(),
            "OTLP receiver script not found at {}",
            script.display()
        );

        let dir = tempfile::Builder::new()
            .prefix("tokenscope-otlp-rx-")
            .tempdir()
            .expect("create a temporary directory for the receiver");
        let out = dir.path().join("spans.jsonl");
        let log = dir.path().join("receiver.log");
        let log_file = std::fs::File::create(&log).expect("create the receiver log file");

        let mut child = Command::new(&python)
            .arg(script)
            .arg("--protocol")
            .arg(protocol)
            .arg("--out")
            .arg(&out)
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {} {}: {e}", python.display(), script.display())
            });

        // Read stdout on a thread so that the wait has a timeout; the thread keeps draining it.
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = lines.next() {
                let _ = tx.send(first);
            }
            for _ in lines {}
        });

        let first = rx.recv_timeout(START_TIMEOUT);
        let port = match first
            .as_deref()
            .ok()
            .and_then(|l| l.strip_prefix("LISTENING "))
            .and_then(|p| p.trim().parse::<u16>().ok())
        {
            Some(port) if port > 0 => port,
            _ => {
                let _ = child.kill();
                let status = child.wait();
                panic!(
                    "OTLP {protocol} receiver did not announce its port within {START_TIMEOUT:?} \
                     (first stdout line: {first:?}, exit: {status:?}); its log:\n{}",
                    read_lossy(&log)
                );
            }
        };
        Some(Receiver {
            port,
            protocol,
            child: Mutex::new(child),
            out,
            log,
            _dir: dir,
        })
    }

    /// `http://127.0.0.1:PORT` (the base endpoint, for both protocols).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The spans recorded so far, in arrival order. A trailing line still being written is
    /// ignored.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        let mut bytes = Vec::new();
        match std::fs::File::open(&self.out) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes)
                    .unwrap_or_else(|e| panic!("read {}: {e}", self.out.display()));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => panic!("open {}: {e}", self.out.display()),
        }
        let complete = match bytes.iter().rposition(|&b| b == b'\n') {
            Some(i) => &bytes[..=i],
            None => return Vec::new(),
        };
        complete
            .split(|&b| b == b'\n')
            .filter(|line| !line.iter().all(u8::is_ascii_whitespace))
            .map(|line| {
                serde_json::from_slice(line).unwrap_or_else(|e| {
                    panic!(
                        "bad JSON line from the OTLP receiver ({e}): {}",
                        String::from_utf8_lossy(line)
                    )
                })
            })
            .collect()
    }

    /// Polls [`Receiver::spans`] every 50 ms until `pred` holds or `timeout` passes, and returns
    /// the last spans read (the caller asserts on them). Panics if the receiver has exited.
    pub fn wait_for_spans(
        &self,
        pred: impl Fn(&[serde_json::Value]) -> bool,
        timeout: Duration,
    ) -> Vec<serde_json::Value> {
        let start = Instant::now();
        loop {
            let spans = self.spans();
            if pred(&spans) || start.elapsed() >= timeout {
                return spans;
            }
            self.assert_running();
            std::thread::sleep(POLL);
        }
    }

    /// The receiver's stderr so far (its log), for failure messages.
    pub fn log(&self) -> String {
        read_lossy(&self.log)
    }

    /// Panics (with the receiver's log) if the receiver process has exited.
    pub fn assert_running(&self) {
        let mut child = self.child.lock().expect("receiver child lock");
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "OTLP {} receiver on port {} exited ({status}); its log:\n{}",
                self.protocol,
                self.port,
                read_lossy(&self.log)
            );
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let child = match self.child.get_mut() {
            Ok(child) => child,
            Err(poisoned) => poisoned.into_inner(),
        };
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
}
