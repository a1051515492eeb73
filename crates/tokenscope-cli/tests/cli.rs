//! The command line as a user meets it: bad flag values refused by clap (exit 2, allowed values
//! named), `bench`'s exit status and failure causes, `diagnose --fail-on-problem`, CSV output
//! of the analysis commands, and the logs on stderr (no colour when piped, JSON lines).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use tokenscope_core::{Outcome, RequestRecord};

const BIN: &str = env!("CARGO_BIN_EXE_tokenscope");
/// Window start of the fixture, Unix seconds.
const T0: i64 = 1_764_633_600;

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("TOKENSCOPE_LOG", "warn")
        .env_remove("TOKENSCOPE_LOG_FORMAT")
        .env_remove("TOKENSCOPE_STORE")
        .env_remove("TOKENSCOPE_CONFIG")
        .output()
        .expect("run tokenscope")
}

/// 40 records in `[T0, T0 + 40 s)`: two models, two request types; 10 upstream errors (a 75 %
/// success rate, below diagnose's 99 %) and 2 client errors (left out of the rate).
fn fixture(dir: &std::path::Path) -> String {
    let recs: Vec<RequestRecord> = (0..40)
        .map(|i: u64| RequestRecord {
            request_id: format!("r{i:03}"),
            created_at: (T0 + i as i64) * 1_000_000,
            model: if i.is_multiple_of(2) {
                "m-a"
            } else {
                "m, \"quoted\""
            }
            .into(),
            request_type: if i.is_multiple_of(3) {
                "summary"
            } else {
                "chat"
            }
            .into(),
            business_line: Some("search".into()),
            user_id: Some(format!("u{}", i % 4)),
            outcome: match i {
                0..=9 => Outcome::UpstreamError,
                10 | 11 => Outcome::ClientError,
                _ => Outcome::Ok,
            },
            http_status: 200,
            input_tokens: Some(100 + i),
            output_tokens: Some(20 + i % 5),
            finish_reason: Some("stop".into()),
            ttft_ms: Some(50.0 + i as f64),
            tpot_ms: Some(10.0),
            total_duration_ms: 300.0,
            ..RequestRecord::default()
        })
        .collect();
    let db = dir.join("cli.db");
    tokenscope_store::SqliteStore::open(&db)
        .expect("open store")
        .insert_batch(&recs)
        .expect("insert");
    db.to_string_lossy().into_owned()
}

fn window() -> [String; 4] {
    [
        "--since".into(),
        format!("@{T0}"),
        "--until".into(),
        format!("@{}", T0 + 60),
    ]
}

fn analysis(cmd: &str, store: &str, extra: &[&str]) -> Output {
    let w = window();
    let mut args = vec![cmd, "--store", store];
    args.extend(w.iter().map(String::as_str));
    args.extend(extra);
    run(&args)
}

#[test]
fn bad_flag_values_exit_2_with_the_allowed_values() {
    for args in [
        vec!["report", "--format", "xml"],
        vec!["cost", "--format", "yaml"],
        vec!["cost", "--by", "colour"],
        vec!["report", "--by", "model,colour"],
        vec!["anomalies", "--baseline", "yesterday"],
        vec![
            "bench",
            "--target",
            "http://x",
            "--rates",
            "1",
            "--arrival",
            "burst",
        ],
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("invalid value"), "{args:?}: {err}");
        assert!(err.contains("possible values"), "{args:?}: {err}");
    }
    let out = run(&["report", "--format", "xml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("table, json, csv"), "{err}");
    // The allowed values are in --help too.
    let help = run(&["cost", "--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("business_line") && text.contains("csv"),
        "{text}"
    );
}

#[test]
fn old_spellings_are_still_accepted() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = fixture(dir.path());
    let w = window();
    let mut args = vec!["report", "--store", &store, "--by", "Input-Bucket,user_id"];
    args.extend(w.iter().map(String::as_str));
    args.extend(["--format", "json"]);
    let out = run(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = analysis("cost", &store, &["--by", "user_id", "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bench_exits_non_zero_naming_the_causes_when_every_request_failed() {
    // A port nothing listens on: every request fails to connect.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let target = format!("http://127.0.0.1:{port}");
    let out = run(&[
        "bench",
        "--target",
        &target,
        "--rates",
        "10",
        "--duration",
        "500ms",
        "--arrival",
        "uniform",
        "--model",
        "m",
        "--timeout",
        "5s",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("every request failed (5)"), "{err}");
    assert!(err.contains("5 × connection failed"), "{err}");
}

#[test]
fn diagnose_fail_on_problem_sets_the_exit_status() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = fixture(dir.path());
    // Without the flag: the problem is reported, the exit status is 0.
    let out = analysis("diagnose", &store, &["--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(j["conclusion"]["step"], "success", "{j}");
    // The rate leaves the two client errors out: 28 / 38.
    let rate = j["steps"][0]["evidence"]["success_rate"]
        .as_f64()
        .expect("rate");
    assert!((rate - 28.0 / 38.0).abs() < 1e-3, "{rate}");
    // With it: 3, and the report is still printed.
    let out = analysis("diagnose", &store, &["--fail-on-problem"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Conclusion: problem"));
    // A healthy bar: 0 with the flag.
    let out = analysis(
        "diagnose",
        &store,
        &["--fail-on-problem", "--min-success-rate", "0.5"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let problem = text.contains("Conclusion: problem");
    assert_eq!(
        out.status.code(),
        Some(if problem { 3 } else { 0 }),
        "{text}"
    );
}

fn parse_csv(bytes: &[u8]) -> (Vec<String>, Vec<Vec<String>>) {
    let mut r = csv::Reader::from_reader(bytes);
    let header = r
        .headers()
        .expect("header")
        .iter()
        .map(str::to_owned)
        .collect();
    let rows = r
        .records()
        .map(|x| x.expect("row").iter().map(str::to_owned).collect())
        .collect();
    (header, rows)
}

#[test]
fn analysis_csv_parses_back_to_the_json_numbers() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = fixture(dir.path());

    // cost by model: one row per group, the same numbers as the JSON.
    let out = analysis("cost", &store, &["--by", "model", "--format", "csv"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (header, rows) = parse_csv(&out.stdout);
    assert_eq!(header[0], "model");
    assert!(header.contains(&"cost_usd".to_owned()), "{header:?}");
    let json = analysis("cost", &store, &["--by", "model", "--format", "json"]);
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).expect("json");
    let groups = j["groups"].as_array().expect("groups");
    assert_eq!(rows.len(), groups.len());
    let col = |name: &str| header.iter().position(|h| h == name).expect(name);
    for (row, g) in rows.iter().zip(groups) {
        assert_eq!(row.len(), header.len());
        assert_eq!(row[0], g["key"]["model"].as_str().expect("model"));
        assert_eq!(
            row[col("tokens")].parse::<u64>().expect("tokens"),
            g["tokens"]
                .as_u64()
                .or(g["usage"]["tokens"].as_u64())
                .expect("tokens")
        );
    }
    // The model with a comma and quotes survives the round trip.
    assert!(rows.iter().any(|r| r[0] == "m, \"quoted\""), "{rows:?}");

    // diagnose: one row per step.
    let out = analysis("diagnose", &store, &["--format", "csv"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (header, rows) = parse_csv(&out.stdout);
    assert_eq!(header, ["step", "verdict", "finding", "evidence"]);
    assert_eq!(rows[0][0], "success");
    assert_eq!(rows[0][1], "problem");
    assert_eq!(rows.len(), 5, "{rows:?}");

    // waste: one row per request type.
    let out = analysis("waste", &store, &["--format", "csv", "--min-samples", "5"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (header, rows) = parse_csv(&out.stdout);
    assert_eq!(header[0], "request_type");
    let types: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert!(
        types.contains(&"chat") && types.contains(&"summary"),
        "{types:?}"
    );
}

#[test]
fn tables_name_their_units() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = fixture(dir.path());
    let out = analysis("cost", &store, &["--by", "model"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("cost (USD)") && text.contains("token share (%)"),
        "{text}"
    );
}

/// Starts `serve` (built-in mock engine) with stderr piped, reads stderr until the ready log
/// line, stops it and returns what it logged.
fn serve_logs(extra: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("tmp");
    let store = dir.path().join("s.db");
    let mut cmd = Command::new(BIN);
    common::serve_args(&mut cmd, None, Some(&store), dir.path());
    cmd.args(extra)
        .env("TOKENSCOPE_LOG", "info")
        .env_remove("TOKENSCOPE_LOG_FORMAT")
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn");
    let _ = common::read_ready_line(&mut child);
    let stderr = child.stderr.take().expect("stderr");
    let mut logged = String::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.expect("line");
        logged.push_str(&line);
        logged.push('\n');
        if line.contains("Gateway ready") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    logged
}

#[test]
fn logs_have_no_colour_when_piped() {
    let logged = serve_logs(&[], &[]);
    assert!(logged.contains("Gateway ready"), "{logged}");
    assert!(!logged.contains("\x1b["), "{logged:?}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    for (args, env) in [
        (vec!["--log-format", "json"], vec![]),
        (vec![], vec![("TOKENSCOPE_LOG_FORMAT", "json")]),
    ] {
        let logged = serve_logs(&args, &env);
        let lines: Vec<serde_json::Value> = logged
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        assert!(!lines.is_empty());
        let ready = lines
            .iter()
            .find(|v| v["fields"]["message"] == "Gateway ready.")
            .expect("ready line");
        assert_eq!(ready["level"], "INFO");
        assert!(!logged.contains("\x1b["));
    }
}

/// `--since` / `--until` take a date (its UTC midnight), an RFC 3339 time with `Z` or an
/// offset, `@UNIX_SECONDS` and a duration before now: the same window written four ways gives
/// the same report.
#[test]
fn since_and_until_accept_dates_and_rfc3339() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = fixture(dir.path());
    let report = |since: &str, until: &str| -> serde_json::Value {
        let out = run(&[
            "report", "--store", &store, "--since", since, "--until", until, "--format", "json",
        ]);
        assert!(
            out.status.success(),
            "{since} .. {until}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json")
    };
    // T0 is 2025-12-02T00:00:00Z.
    let unix = report(&format!("@{T0}"), &format!("@{}", T0 + 60));
    assert_eq!(unix[0]["count"], 40, "{unix}");
    assert_eq!(report("2025-12-02", "2025-12-02T00:01:00Z"), unix);
    assert_eq!(
        report("2025-12-02T01:00:00+01:00", "2025-12-02T00:01:00.000Z"),
        unix
    );
    // A window that ends before the fixture starts holds nothing.
    let before = report("2025-12-01", "2025-12-01T23:59:59Z");
    assert!(
        before.as_array().is_none_or(|rows| rows.is_empty()) || before[0]["count"] == 0,
        "{before}"
    );
    // A bad bound names the accepted forms and exits non-zero.
    let bad = run(&["report", "--store", &store, "--since", "yesterday"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--since"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}
