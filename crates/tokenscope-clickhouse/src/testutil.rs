//! Test harness (feature `test-util`): real `clickhouse-server` processes on loopback.
//!
//! * [`ClickHouseServer`] — one server in a temporary directory (config, users, data, logs)
//!   on free ports, started in its own process group and killed (`SIGKILL` to the group) when
//!   the value drops, so no server outlives its test (unless the test process itself is
//!   killed with `SIGKILL`).
//! * [`ClickHouseCluster`] — two such servers that know each other as the two shards of the
//!   cluster [`CLUSTER_NAME`] (`remote_servers`, no ZooKeeper).
//! * [`ChdbServer`] — a current ClickHouse engine (PyPI's chdb, 26.x) behind ClickHouse's HTTP
//!   interface (`scripts/chdb-http.py`), so the store's statements run on a modern engine too;
//!   [`chdb_or_skip`] follows the convention below with `TOKENSCOPE_REQUIRE_CHDB`.
//! * [`Engine`] — what a test that runs on either needs (a store URL, SQL).
//! * [`clickhouse_available`] / [`clickhouse_or_skip`] — the repository's convention: an absent
//!   binary skips the test with a message, unless `TOKENSCOPE_REQUIRE_CLICKHOUSE=1`, which turns
//!   absence into a failure. `scripts/install-clickhouse.sh` installs the server.
//!
//! The binary is `$TOKENSCOPE_CLICKHOUSE_SERVER`, else `clickhouse-server` on `PATH`, else
//! `/usr/sbin/clickhouse-server` or `/usr/bin/clickhouse-server`. Servers are kept small for
//! 2-core CI machines (`max_threads` 2, small caches and background pool). Startup waits for
//! `GET /ping` (30 s) and prints the server's log on failure.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Name of the cluster of [`ClickHouseCluster`].
pub const CLUSTER_NAME: &str = "ts_cluster";
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The server binary, if one is installed.
pub fn clickhouse_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TOKENSCOPE_CLICKHOUSE_SERVER") {
        let p = PathBuf::from(p);
        return p.exists().then_some(p);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let p = dir.join("clickhouse-server");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    ["/usr/sbin/clickhouse-server", "/usr/bin/clickhouse-server"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// `true` when a `clickhouse-server` binary is found.
pub fn clickhouse_available() -> bool {
    clickhouse_binary().is_some()
}

/// `true` when the server is available. Otherwise prints a skip message and returns `false`,
/// or panics when `TOKENSCOPE_REQUIRE_CLICKHOUSE=1`.
pub fn clickhouse_or_skip() -> bool {
    if clickhouse_available() {
        return true;
    }
    if std::env::var("TOKENSCOPE_REQUIRE_CLICKHOUSE").as_deref() == Ok("1") {
        panic!(
            "clickhouse-server is required (TOKENSCOPE_REQUIRE_CLICKHOUSE=1) but not installed: run scripts/install-clickhouse.sh"
        );
    }
    eprintln!("SKIPPED: clickhouse-server not installed (run scripts/install-clickhouse.sh)");
    false
}

/// Harness failures (startup, I/O).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// No binary.
    #[error("clickhouse-server not found (set TOKENSCOPE_CLICKHOUSE_SERVER or run scripts/install-clickhouse.sh)")]
    NotInstalled,
    /// File or process error.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The server did not answer `/ping` in time or exited; carries its log.
    #[error("clickhouse-server did not start: {0}")]
    Startup(String),
}

fn free_port() -> Result<u16, HarnessError> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn pct(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// One HTTP/1.0 request to `127.0.0.1:port`; `(status, body)`.
fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    auth: Option<(&str, &str)>,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some((u, p)) = auth {
        let _ = write!(req, "X-ClickHouse-User: {u}\r\n");
        if !p.is_empty() {
            let _ = write!(req, "X-ClickHouse-Key: {p}\r\n");
        }
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes())?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// What the tests that run on either engine need of it: a store URL and a way to run SQL.
pub trait Engine {
    /// `clickhouse://…/database` of the engine.
    fn url(&self, database: &str) -> String;
    /// Runs `sql` as `default`; returns the body. Panics with the body on an error.
    fn query(&self, sql: &str) -> String;
    /// `SELECT version()`.
    fn version(&self) -> String {
        self.query("SELECT version()").trim().to_owned()
    }
}

impl Engine for ClickHouseServer {
    fn url(&self, database: &str) -> String {
        ClickHouseServer::url(self, database)
    }
    fn query(&self, sql: &str) -> String {
        ClickHouseServer::query(self, sql)
    }
}

/// The Python interpreter of the chdb venv (`$TOKENSCOPE_CACHE/chdb.env`, written by
/// `scripts/install-chdb.sh`), if installed.
pub fn chdb_python() -> Option<PathBuf> {
    let cache = std::env::var("TOKENSCOPE_CACHE").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tokenscope",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let text = std::fs::read_to_string(format!("{cache}/chdb.env")).ok()?;
    let p = text
        .lines()
        .find_map(|l| l.strip_prefix("CHDB_PYTHON="))
        .map(|p| PathBuf::from(p.trim()))?;
    p.exists().then_some(p)
}

/// `true` when chdb is installed. Otherwise prints a skip message and returns `false`, or
/// panics when `TOKENSCOPE_REQUIRE_CHDB=1`.
pub fn chdb_or_skip() -> bool {
    if chdb_python().is_some() {
        return true;
    }
    if std::env::var("TOKENSCOPE_REQUIRE_CHDB").as_deref() == Ok("1") {
        panic!(
            "chdb is required (TOKENSCOPE_REQUIRE_CHDB=1) but not installed: run scripts/install-chdb.sh"
        );
    }
    eprintln!("SKIPPED: chdb not installed (run scripts/install-chdb.sh)");
    false
}

/// A current ClickHouse engine (PyPI's chdb, 26.x) behind ClickHouse's HTTP interface
/// (`scripts/chdb-http.py`), on a free loopback port, with its data in a temporary directory;
/// killed (its process group) when dropped. No compression, TLS, users or clusters.
#[derive(Debug)]
pub struct ChdbServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
}

impl ChdbServer {
    /// Starts it and waits until `GET /ping` answers (60 s: chdb loads a 550 MB library).
    pub fn start() -> Result<Self, HarnessError> {
        let python = chdb_python().ok_or(HarnessError::NotInstalled)?;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/chdb-http.py");
        let dir = tempfile::Builder::new()
            .prefix("tokenscope-chdb-")
            .tempdir()?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("chdb.log"))?;
        let child = Command::new(python)
            .arg(&script)
            .arg(dir.path().join("data"))
            .arg(port.to_string())
            .current_dir(dir.path())
            .env("TMPDIR", dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()?;
        let mut s = ChdbServer {
            child: Some(child),
            dir,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if matches!(http_request(port, "GET", "/ping", "", None), Ok((200, b)) if b.starts_with("Ok."))
            {
                return Ok(s);
            }
            let exited = s
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
            if exited || Instant::now() > deadline {
                let log =
                    std::fs::read_to_string(s.dir.path().join("chdb.log")).unwrap_or_default();
                return Err(HarnessError::Startup(format!("chdb-http: {log}")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its HTTP port.
    pub fn http_port(&self) -> u16 {
        self.port
    }
}

impl Engine for ChdbServer {
    fn url(&self, database: &str) -> String {
        format!("clickhouse://default@127.0.0.1:{}/{database}", self.port)
    }
    fn query(&self, sql: &str) -> String {
        match http_request(self.port, "POST", "/", sql, None) {
            Ok((200, body)) => body,
            Ok((status, body)) => panic!("query failed ({status}): {sql}\n{body}"),
            Err(e) => panic!("query failed: {sql}: {e}"),
        }
    }
}

impl Drop for ChdbServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", c.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Options of a server to start.
#[derive(Debug, Clone, Default)]
pub struct ServerBuilder {
    users: Vec<(String, String)>,
    /// `(cluster name, tcp ports of its shards)`.
    cluster: Option<(String, Vec<u16>)>,
    ports: Option<(u16, u16)>,
    /// `(certificate, key)` PEM files: the server also listens on an `https_port`.
    https: Option<(PathBuf, PathBuf)>,
}

impl ServerBuilder {
    /// Also serves HTTPS (`https_port`) with this PEM certificate chain and key.
    pub fn https(mut self, cert: &Path, key: &Path) -> Self {
        self.https = Some((cert.to_owned(), key.to_owned()));
        self
    }

    /// Adds a user with a password (the first one added is the user of [`ClickHouseServer::url`]).
    pub fn user(mut self, name: &str, password: &str) -> Self {
        self.users.push((name.to_owned(), password.to_owned()));
        self
    }

    fn cluster(mut self, name: &str, tcp_ports: Vec<u16>) -> Self {
        self.cluster = Some((name.to_owned(), tcp_ports));
        self
    }

    fn ports(mut self, http: u16, tcp: u16) -> Self {
        self.ports = Some((http, tcp));
        self
    }

    /// Starts the server and waits until it answers.
    pub fn start(self) -> Result<ClickHouseServer, HarnessError> {
        let binary = clickhouse_binary().ok_or(HarnessError::NotInstalled)?;
        let dir = tempfile::Builder::new()
            .prefix("tokenscope-ch-")
            .tempdir()?;
        let (http_port, tcp_port) = match self.ports {
            Some(p) => p,
            None => (free_port()?, free_port()?),
        };
        let mut users = vec![("default".to_owned(), String::new())];
        for (u, p) in self.users {
            match users.iter_mut().find(|(n, _)| *n == u) {
                Some(slot) => slot.1 = p,
                None => users.push((u, p)),
            }
        }
        let url_user = users
            .get(1)
            .map_or("default", |(u, _)| u.as_str())
            .to_owned();
        let https = match self.https {
            Some((c, k)) => Some((free_port()?, c, k)),
            None => None,
        };
        let mut s = ClickHouseServer {
            child: None,
            binary,
            dir,
            http_port,
            tcp_port,
            https,
            users,
            url_user,
            cluster: self.cluster,
        };
        s.write_config()?;
        s.write_users()?;
        s.spawn()?;
        Ok(s)
    }
}

/// A real `clickhouse-server` on loopback (see the module docs).
#[derive(Debug)]
pub struct ClickHouseServer {
    child: Option<Child>,
    binary: PathBuf,
    dir: tempfile::TempDir,
    http_port: u16,
    tcp_port: u16,
    /// `(https_port, certificate, key)`.
    https: Option<(u16, PathBuf, PathBuf)>,
    users: Vec<(String, String)>,
    url_user: String,
    cluster: Option<(String, Vec<u16>)>,
}

impl ClickHouseServer {
    /// The HTTPS port, when started with [`ServerBuilder::https`].
    pub fn https_port(&self) -> Option<u16> {
        self.https.as_ref().map(|(p, _, _)| *p)
    }

    /// A server with only the passwordless `default` user.
    pub fn start() -> Result<Self, HarnessError> {
        Self::builder().start()
    }

    /// Options (users, …).
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The HTTP port.
    pub fn http_port(&self) -> u16 {
        self.http_port
    }

    /// The native TCP port.
    pub fn tcp_port(&self) -> u16 {
        self.tcp_port
    }

    /// The server's directory (config, data, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `clickhouse://user:pass@127.0.0.1:port/database` for the first configured user (or
    /// `default`), with its current password.
    pub fn url(&self, database: &str) -> String {
        self.url_as(&self.url_user.clone(), database)
    }

    /// Like [`url`](Self::url) for a given user.
    pub fn url_as(&self, user: &str, database: &str) -> String {
        let pass = self.password_of(user);
        let auth = if pass.is_empty() {
            format!("{}@", pct(user))
        } else {
            format!("{}:{}@", pct(user), pct(&pass))
        };
        format!("clickhouse://{auth}127.0.0.1:{}/{database}", self.http_port)
    }

    fn password_of(&self, user: &str) -> String {
        self.users
            .iter()
            .find(|(u, _)| u == user)
            .map(|(_, p)| p.clone())
            .unwrap_or_default()
    }

    fn log_tail(&self) -> String {
        let mut out = String::new();
        for f in ["server.err.log", "server.log", "stdout.log"] {
            if let Ok(t) = std::fs::read_to_string(self.dir().join(f)) {
                let lines: Vec<&str> = t.lines().collect();
                let from = lines.len().saturating_sub(40);
                let _ = writeln!(out, "--- {f} (last {} lines) ---", lines.len() - from);
                for l in &lines[from..] {
                    let _ = writeln!(out, "{l}");
                }
            }
        }
        out
    }

    fn write_config(&self) -> Result<(), HarnessError> {
        let d = self.dir().display().to_string();
        let remote = match &self.cluster {
            None => String::new(),
            Some((name, ports)) => {
                let shards: String = ports
                    .iter()
                    .map(|p| {
                        format!(
                            "<shard><replica><host>127.0.0.1</host><port>{p}</port></replica></shard>"
                        )
                    })
                    .collect();
                format!("<remote_servers><{name}>{shards}</{name}></remote_servers>")
            }
        };
        let https = match &self.https {
            None => String::new(),
            Some((port, cert, key)) => format!(
                "<https_port>{port}</https_port>\n  <openSSL><server><certificateFile>{}</certificateFile>\
                 <privateKeyFile>{}</privateKeyFile><verificationMode>none</verificationMode>\
                 <loadDefaultCAFile>false</loadDefaultCAFile><cacheSessions>true</cacheSessions>\
                 <disableProtocols>sslv2,sslv3</disableProtocols><preferServerCiphers>true</preferServerCiphers>\
                 </server></openSSL>",
                xml_escape(&cert.display().to_string()),
                xml_escape(&key.display().to_string()),
            ),
        };
        let xml = format!(
            r#"<?xml version="1.0"?>
<yandex>
  {https}
  <logger><level>information</level><log>{d}/server.log</log><errorlog>{d}/server.err.log</errorlog><size>20M</size><count>1</count><console>0</console></logger>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{d}/data/</path>
  <tmp_path>{d}/tmp/</tmp_path>
  <user_files_path>{d}/user_files/</user_files_path>
  <format_schema_path>{d}/format_schemas/</format_schema_path>
  <users_config>{d}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <timezone>UTC</timezone>
  <mark_cache_size>134217728</mark_cache_size>
  <uncompressed_cache_size>0</uncompressed_cache_size>
  <max_concurrent_queries>64</max_concurrent_queries>
  <keep_alive_timeout>10</keep_alive_timeout>
  <mlock_executable>false</mlock_executable>
  {remote}
</yandex>
"#,
            http = self.http_port,
            tcp = self.tcp_port,
        );
        std::fs::write(self.dir().join("config.xml"), xml)?;
        Ok(())
    }

    fn write_users(&self) -> Result<(), HarnessError> {
        let mut users = String::new();
        for (u, p) in &self.users {
            let _ = write!(
                users,
                "<{u}><password>{}</password><networks><ip>::/0</ip></networks><profile>default</profile><quota>default</quota></{u}>",
                xml_escape(p)
            );
        }
        let xml = format!(
            r#"<?xml version="1.0"?>
<yandex>
  <profiles><default><max_threads>2</max_threads><background_pool_size>4</background_pool_size><max_memory_usage>4000000000</max_memory_usage></default></profiles>
  <users>{users}</users>
  <quotas><default></default></quotas>
</yandex>
"#
        );
        // Write-then-rename: the server's config reloader never sees a half-written file.
        let tmp = self.dir().join("users.xml.tmp");
        std::fs::write(&tmp, xml)?;
        std::fs::rename(tmp, self.dir().join("users.xml"))?;
        Ok(())
    }

    fn spawn(&mut self) -> Result<(), HarnessError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir().join("stdout.log"))?;
        let child = Command::new(&self.binary)
            .arg(format!(
                "--config-file={}",
                self.dir().join("config.xml").display()
            ))
            .current_dir(self.dir())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.ping() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    self.child = None;
                    return Err(HarnessError::Startup(format!(
                        "exited with {status}\n{}",
                        self.log_tail()
                    )));
                }
            }
            if Instant::now() > deadline {
                let tail = self.log_tail();
                self.kill();
                return Err(HarnessError::Startup(format!(
                    "no answer on /ping within {STARTUP_TIMEOUT:?}\n{tail}"
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `true` when `GET /ping` answers `Ok.`.
    pub fn ping(&self) -> bool {
        matches!(self.http("GET", "/ping", "", None), Ok((200, body)) if body.starts_with("Ok."))
    }

    /// One HTTP/1.0 request; `(status, body)`.
    fn http(
        &self,
        method: &str,
        path: &str,
        body: &str,
        auth: Option<(&str, &str)>,
    ) -> std::io::Result<(u16, String)> {
        http_request(self.http_port, method, path, body, auth)
    }

    /// Runs `sql` as `default` over HTTP; returns the body. Panics with the body on an error.
    pub fn query(&self, sql: &str) -> String {
        let pass = self.password_of("default");
        match self.http("POST", "/", sql, Some(("default", &pass))) {
            Ok((200, body)) => body,
            Ok((status, body)) => panic!("query failed ({status}): {sql}\n{body}"),
            Err(e) => panic!("query failed: {sql}: {e}"),
        }
    }

    /// Runs `sql` as `user`/`password`; `(status, body)` (no panic).
    pub fn try_query_as(&self, user: &str, password: &str, sql: &str) -> (u16, String) {
        self.http("POST", "/", sql, Some((user, password)))
            .unwrap_or((0, String::new()))
    }

    /// Sets `user`'s password (adding the user if new) by rewriting `users.xml`, and waits
    /// until the server has reloaded it (the new password is accepted; up to 30 s).
    pub fn set_password(&mut self, user: &str, password: &str) {
        match self.users.iter_mut().find(|(u, _)| u == user) {
            Some(slot) => slot.1 = password.to_owned(),
            None => self.users.push((user.to_owned(), password.to_owned())),
        }
        // The server's config reloader compares modification times (second resolution on
        // 18.x): a rewrite within the same second as the previous one can go unnoticed, so the
        // file is written again every 2.5 s until the new password works.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut next_write = Instant::now();
        while Instant::now() < deadline {
            if Instant::now() >= next_write {
                if let Err(e) = self.write_users() {
                    panic!("rewriting users.xml: {e}");
                }
                next_write = Instant::now() + Duration::from_millis(2500);
            }
            if self.try_query_as(user, password, "SELECT 1").0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "server did not pick up the new password of {user}\n{}",
            self.log_tail()
        );
    }

    fn signal_group(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, "--", &format!("-{}", c.id())])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }

    /// Sends `SIGSTOP` to the server: it keeps its sockets but answers nothing (a hung server).
    pub fn pause(&self) {
        self.signal_group("-STOP");
    }

    /// Sends `SIGCONT` after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal_group("-CONT");
    }

    /// Stops the server gracefully (`SIGTERM` to its group, then waits; `SIGKILL` after 20 s).
    pub fn stop(&mut self) {
        self.signal_group("-CONT");
        self.signal_group("-TERM");
        let deadline = Instant::now() + Duration::from_secs(20);
        if let Some(c) = self.child.as_mut() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    self.child = None;
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
    }

    /// Kills the server (`SIGKILL` to its group) and reaps it.
    pub fn kill(&mut self) {
        self.signal_group("-KILL");
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same data directory and ports (after `stop`/`kill`).
    pub fn start_again(&mut self) -> Result<(), HarnessError> {
        if self.child.is_some() {
            self.stop();
        }
        self.spawn()
    }
}

impl Drop for ClickHouseServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Two servers forming the two shards of [`CLUSTER_NAME`] (no replication, no ZooKeeper).
#[derive(Debug)]
pub struct ClickHouseCluster {
    /// The nodes; node `i` is shard `i + 1`.
    pub nodes: Vec<ClickHouseServer>,
    /// The cluster name in `remote_servers`.
    pub name: String,
}

impl ClickHouseCluster {
    /// Starts two shards.
    pub fn start_two_shards() -> Result<Self, HarnessError> {
        let ports: Vec<(u16, u16)> = (0..2)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<Result<_, HarnessError>>()?;
        let tcp: Vec<u16> = ports.iter().map(|p| p.1).collect();
        let mut nodes = Vec::new();
        for (http, t) in &ports {
            nodes.push(
                ClickHouseServer::builder()
                    .ports(*http, *t)
                    .cluster(CLUSTER_NAME, tcp.clone())
                    .start()?,
            );
        }
        Ok(Self {
            nodes,
            name: CLUSTER_NAME.to_owned(),
        })
    }

    /// `clickhouse://…` with node `node` as the entry point, `cluster=` and every shard's
    /// HTTP address in `shards=`.
    pub fn url(&self, node: usize, database: &str) -> String {
        let shards: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.http_port()))
            .collect();
        let port = self.nodes.get(node).map_or(0, |n| n.http_port());
        format!(
            "clickhouse://127.0.0.1:{port}/{database}?cluster={}&shards={}",
            self.name,
            shards.join(",")
        )
    }
}
