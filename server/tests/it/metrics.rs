//! `--metrics-listen`: `/metrics` through `promtool check metrics`, counters that move with
//! the traffic, `/healthz` and `/readyz` (during the token-only RECOVERING window and after a
//! WAL failure), the shipped dashboard and alert rules, and a clear bind error.
//!
//! `promtool` (Debian package `prometheus`) must be installed: the tests that need it fail,
//! not skip, without it (`.ci/run` installs it).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenure_server::wal::{FaultPlan, Faults, FaultyStorage, FsStorage, Storage};
use tenure_server::{Config, Durability};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// What `/metrics` and `/readyz` say until the WAL is replayed.
const RECOVERING: &str = "not ready: recovering from the WAL\n";
/// Longest any single read in these tests may take before the test fails.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A server in this process with its metrics endpoint, stopped through its shutdown future.
struct Server {
    addr: SocketAddr,
    metrics: SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), tenure_server::ServerError>>,
}

impl Server {
    async fn start(config: Config, storage: Option<Arc<dyn Storage>>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = metrics_listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let run = tenure_server::run_with_metrics(
            config,
            storage,
            listener,
            Some(metrics_listener),
            shutdown,
        );
        let server = Server {
            addr,
            metrics,
            stop,
            task: tokio::spawn(run),
        };
        server.wait_recovered().await;
        server
    }

    /// Waits until recovery is over: until then `/metrics` answers 503 and says so.
    async fn wait_recovered(&self) {
        let deadline = Instant::now() + READ_TIMEOUT;
        loop {
            let (status, body) = self.get("/metrics").await;
            if status == 200 {
                return;
            }
            assert_eq!((status, body.as_str()), (503, RECOVERING));
            assert!(Instant::now() < deadline, "recovery took too long");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn stop(self) {
        self.stop_with_result().await.unwrap();
    }

    /// Stops it and returns what `run` returned (an error after the WAL failed).
    async fn stop_with_result(self) -> Result<(), tenure_server::ServerError> {
        let _ = self.stop.send(());
        self.task.await.unwrap()
    }

    /// `GET path`: the status code and the body.
    async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics, path).await
    }

    /// The scraped metrics, after waiting until the endpoint serves them.
    async fn scrape(&self) -> String {
        let (status, body) = self.get("/metrics").await;
        assert_eq!(status, 200, "{body}");
        body
    }
}

pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    http_raw(addr, &request).await
}

async fn http_raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut all = String::new();
    tokio::time::timeout(READ_TIMEOUT, stream.read_to_string(&mut all))
        .await
        .expect("the HTTP answer took too long")
        .unwrap();
    let (head, body) = all.split_once("\r\n\r\n").expect("an HTTP head");
    let status = head.split(' ').nth(1).expect("a status").parse().unwrap();
    (status, body.to_string())
}

/// Whether `GET path` is answered 200 (false if the connection is closed unanswered).
async fn answers_ok(addr: SocketAddr, path: &str) -> bool {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let _ = stream.write_all(request.as_bytes()).await;
    let mut all = Vec::new();
    let _ = tokio::time::timeout(READ_TIMEOUT, stream.read_to_end(&mut all)).await;
    all.starts_with(b"HTTP/1.1 200")
}

/// A console connection: one line out, one line back.
struct Console {
    reader: BufReader<TcpStream>,
}

impl Console {
    async fn connect(addr: SocketAddr) -> Console {
        let stream = TcpStream::connect(addr).await.unwrap();
        Console {
            reader: BufReader::new(stream),
        }
    }

    async fn send(&mut self, line: &str) {
        let stream = self.reader.get_mut();
        stream
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
    }

    async fn recv(&mut self) -> String {
        let mut line = String::new();
        tokio::time::timeout(READ_TIMEOUT, self.reader.read_line(&mut line))
            .await
            .expect("no reply in time")
            .unwrap();
        line.trim_end().to_string()
    }

    async fn call(&mut self, line: &str) -> String {
        self.send(line).await;
        self.recv().await
    }
}

/// The `lease=` field of a console grant.
fn lease_of(reply: &str) -> &str {
    let field = reply.split(' ').find(|w| w.starts_with("lease="));
    field.unwrap_or_else(|| panic!("not a grant: {reply}"))["lease=".len()..].trim()
}

/// The value of the sample `series` (name plus labels exactly as exported).
pub(crate) fn sample(text: &str, series: &str) -> f64 {
    let line = text.lines().find(|l| {
        l.strip_prefix(series)
            .is_some_and(|rest| rest.starts_with(' '))
    });
    let line = line.unwrap_or_else(|| panic!("no sample {series} in:\n{text}"));
    line[series.len()..].trim().parse().unwrap()
}

/// Feeds `input` to `promtool` with `args`; panics (never skips) if promtool is missing.
pub(crate) fn promtool(args: &[&str], input: &str) -> std::process::Output {
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed (Debian package `prometheus`; .ci/run installs it)");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn config(dir: &Path) -> Config {
    Config {
        tick_interval: Duration::from_millis(2),
        ..Config::for_tests(dir)
    }
}

#[tokio::test]
async fn scraped_metrics_pass_promtool_check_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let mut c = Console::connect(server.addr).await;
    assert!(c.call("ACQUIRE k 60000").await.starts_with("OK token="));
    assert!(c.call("ACQUIRE k 60000").await.starts_with("LOCKED"));
    assert_eq!(c.call("PING").await, "PONG");
    let text = server.scrape().await;
    let out = promtool(&["check", "metrics"], &text);
    let report =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "promtool: {report}\n{text}");
    assert!(
        report.trim().is_empty(),
        "promtool found problems: {report}\n{text}"
    );
    assert!(
        text.contains("tenure_request_duration_seconds_bucket{"),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn counters_move_for_grant_locked_expiry_handoff_and_lost_renewal() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let mut first = Console::connect(server.addr).await;
    let mut second = Console::connect(server.addr).await;
    let granted = first.call("ACQUIRE k 300").await;
    let lease = lease_of(&granted).to_string();
    assert!(second.call("ACQUIRE k 300").await.starts_with("LOCKED"));
    // Waits in line; the lease expires and the lock is handed to it.
    let handed = second.call("ACQUIRE k 60000 10000").await;
    assert!(handed.starts_with("OK token="), "{handed}");
    // The first holder renews after its lease expired: the number that pages someone.
    assert_eq!(first.call(&format!("RENEW k {lease} 300")).await, "LOST");
    let stranger = "0123456789abcdef0123456789abcdef";
    assert_eq!(first.call(&format!("RENEW k {stranger} 300")).await, "LOST");
    let text = server.scrape().await;
    let acquire = |outcome: &str| {
        sample(
            &text,
            &format!("tenure_requests_total{{op=\"acquire\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(acquire("granted"), 2.0);
    assert_eq!(acquire("locked"), 1.0);
    assert_eq!(
        sample(
            &text,
            "tenure_requests_total{op=\"renew\",outcome=\"lost\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &text,
            "tenure_request_duration_seconds_count{op=\"acquire\"}"
        ),
        3.0
    );
    assert_eq!(sample(&text, "tenure_expirations_total"), 1.0);
    assert_eq!(sample(&text, "tenure_handoffs_total"), 1.0);
    assert_eq!(
        sample(&text, "tenure_renewals_lost_total{reason=\"expired\"}"),
        1.0
    );
    assert_eq!(
        sample(&text, "tenure_renewals_lost_total{reason=\"unknown\"}"),
        1.0
    );
    assert_eq!(sample(&text, "tenure_held_locks"), 1.0);
    assert_eq!(
        sample(&text, "tenure_connections{surface=\"console\"}"),
        2.0
    );
    assert_eq!(sample(&text, "tenure_connections{surface=\"binary\"}"), 0.0);
    assert!(sample(&text, "tenure_token_high_water") >= 2.0);
    assert!(sample(&text, "tenure_wal_records_per_batch_count") >= 1.0);
    assert_eq!(sample(&text, "tenure_wal_failed"), 0.0);
    server.stop().await;
}

/// A RENEW that comes after the deadline but before the ticker reaped the lease is the most
/// common late renewal; it must count as expired too.
#[tokio::test]
async fn a_late_renewal_counts_as_expired_before_the_ticker_reaps_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        tick_interval: Duration::from_secs(60), // the ticker never gets to this lease
        ..config(dir.path())
    };
    let server = Server::start(config, None).await;
    let mut c = Console::connect(server.addr).await;
    let lease = lease_of(&c.call("ACQUIRE k 100").await).to_string();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.call(&format!("RENEW k {lease} 100")).await, "LOST");
    let text = server.scrape().await;
    assert_eq!(
        sample(&text, "tenure_renewals_lost_total{reason=\"expired\"}"),
        1.0
    );
    assert_eq!(
        sample(&text, "tenure_renewals_lost_total{reason=\"unknown\"}"),
        0.0
    );
    assert_eq!(sample(&text, "tenure_expirations_total"), 1.0);
    server.stop().await;
}

#[tokio::test]
async fn binary_requests_are_counted_and_timed_by_surface() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let client = tenure::Client::connect(server.addr.to_string())
        .await
        .unwrap();
    for _ in 0..3 {
        client.ping().await.unwrap();
    }
    let text = server.scrape().await;
    assert_eq!(sample(&text, "tenure_connections{surface=\"binary\"}"), 1.0);
    let pings = "tenure_requests_total{op=\"ping\",outcome=\"ok\"}";
    assert_eq!(sample(&text, pings), 3.0);
    let timed = "tenure_request_duration_seconds_count{op=\"ping\"}";
    assert_eq!(sample(&text, timed), 3.0);
    drop(client);
    server.stop().await;
}

#[tokio::test]
async fn readyz_is_503_in_the_token_only_recovering_window_then_200() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        durability: Durability::Tokens,
        ttl_ms_max: 1500,
        ..config(dir.path())
    };
    let server = Server::start(config.clone(), None).await;
    let (status, body) = server.get("/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "ready\n"),
        "a fresh log has no window"
    );
    server.stop().await;

    let server = Server::start(config, None).await;
    let (status, body) = server.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("token-only"), "{body}");
    assert_eq!(body.lines().count(), 1, "one line: {body}");
    assert_eq!(server.get("/healthz").await.0, 200, "alive while not ready");
    let mut c = Console::connect(server.addr).await;
    assert!(c.call("ACQUIRE k 1000").await.starts_with("ERR RECOVERING"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = server.get("/readyz").await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c.call("ACQUIRE k 1000").await.starts_with("OK token="));
    server.stop().await;
}

#[tokio::test]
async fn readyz_is_503_after_the_wal_failed() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let storage = FaultyStorage::new(FsStorage::new(dir.path()).unwrap(), Arc::clone(&faults));
    let config = Config {
        fsync: true,
        ..config(dir.path())
    };
    let server = Server::start(config, Some(Arc::new(storage))).await;
    assert_eq!(server.get("/readyz").await.0, 200);
    let text = server.scrape().await;
    assert!(sample(&text, "tenure_wal_fsync_duration_seconds_count") >= 1.0);
    faults.set(FaultPlan {
        sync_fails_from: Some(faults.syncs() + 1),
        ..FaultPlan::default()
    });
    let mut c = Console::connect(server.addr).await;
    assert!(c
        .call("ACQUIRE k 60000")
        .await
        .starts_with("ERR UNAVAILABLE"));
    let (status, body) = server.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("WAL failed"), "{body}");
    assert_eq!(sample(&server.scrape().await, "tenure_wal_failed"), 1.0);
    let _ = server.stop_with_result().await; // the final sync fails too
}

#[tokio::test]
async fn http_side_answers_only_its_paths_and_methods() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    assert_eq!(server.get("/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(server.get("/nope").await.0, 404);
    let post = "POST /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(http_raw(server.metrics, post).await.0, 405);
    // Prometheus asks for OpenMetrics and gets it; others get the classic text format.
    let accept = "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
                  Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n";
    let (status, body) = http_raw(server.metrics, accept).await;
    assert_eq!(status, 200);
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(body.contains("# TYPE tenure_requests counter"), "{body}");
    let classic = server.scrape().await;
    assert!(!classic.contains("# EOF"), "{classic}");
    assert!(
        classic.contains("# TYPE tenure_requests_total counter"),
        "{classic}"
    );
    // A request head over the limit is refused, not buffered.
    let huge = format!(
        "GET /metrics HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    let (status, _) = http_raw(server.metrics, &huge).await;
    assert_eq!(status, 431);
    server.stop().await;
}

/// How soon an evicted idle metrics connection is closed, at most, in these tests.
const EVICTED_WAIT_MAX: Duration = Duration::from_secs(2);

/// Idle sockets on the metrics port cannot starve `/healthz` (issue 22: sixteen of them
/// kept every probe out): a connection over the limit closes the oldest one instead of
/// being turned away, so there are never more than the limit open and a probe always gets in.
#[tokio::test]
async fn idle_http_connections_cannot_starve_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let mut idle = Vec::new();
    for _ in 0..tenure_server::http::CONNECTIONS_MAX {
        idle.push(TcpStream::connect(server.metrics).await.unwrap());
    }
    // Give the server time to take all of them in before the probe.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        answers_ok(server.metrics, "/healthz").await,
        "the probe was starved by idle sockets"
    );
    // The probe closed the oldest idle socket, long before the header read timeout would
    // have; the newer ones are still open.
    assert!(EVICTED_WAIT_MAX < tenure_server::http::HEADER_READ_TIMEOUT);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(EVICTED_WAIT_MAX, idle[0].read_to_end(&mut rest)).await;
    assert!(
        read.is_ok(),
        "the oldest idle socket was kept open past the limit"
    );
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    let mut byte = [0u8; 1];
    let still_open = tokio::time::timeout(Duration::from_millis(200), idle[1].read(&mut byte));
    assert!(
        still_open.await.is_err(),
        "a newer idle socket was closed too"
    );
    // And again: each newcomer gets in.
    idle.push(TcpStream::connect(server.metrics).await.unwrap());
    assert!(answers_ok(server.metrics, "/healthz").await);
    drop(idle);
    server.stop().await;
}

/// Issue 24, finding 4: a probe that has sent part of its request is not the one a flood
/// of refilled idle sockets closes: the silent ones make way first.
#[tokio::test]
async fn a_probe_mid_request_outlives_a_flood_of_idle_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let mut idle = Vec::new();
    for _ in 0..tenure_server::http::CONNECTIONS_MAX {
        idle.push(TcpStream::connect(server.metrics).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut probe = TcpStream::connect(server.metrics).await.unwrap();
    probe.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Four times the limit of newer idle sockets, each of which makes room for itself.
    for _ in 0..4 * tenure_server::http::CONNECTIONS_MAX {
        idle.push(TcpStream::connect(server.metrics).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    probe.write_all(b"Host: x\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(EVICTED_WAIT_MAX, probe.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "no answer");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    drop(idle);
    server.stop().await;
}

/// Every `tenure_*` series the dashboard and the alerts use is one the server exports, and
/// the rules pass `promtool check rules`.
#[tokio::test]
async fn shipped_dashboard_and_alerts_use_exported_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(config(dir.path()), None).await;
    let text = server.scrape().await;
    server.stop().await;
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let alerts = std::fs::read_to_string(deploy.join("alerts.yml")).unwrap();
    let dashboard = std::fs::read_to_string(deploy.join("grafana-dashboard.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 7));
    for source in [&alerts, &dashboard] {
        let names = source.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
        for name in names.filter(|n| n.starts_with("tenure_")) {
            let exported = text
                .lines()
                .any(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']));
            assert!(exported, "{name} is not exported:\n{text}");
        }
    }
    let path = deploy.join("alerts.yml");
    let out = promtool(&["check", "rules", path.to_str().unwrap()], "");
    let report =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "promtool check rules: {report}");
}

#[test]
fn metrics_bind_error_is_a_clear_startup_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tenured"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            &addr,
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("cannot listen for metrics on {addr}")),
        "{stderr}"
    );
}

#[tokio::test]
async fn locks_held_and_waiters_by_identity_are_gauges_labelled_by_identity() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.identities = Some(crate::auth::identities_file(dir.path()));
    let server = Server::start(config, None).await;
    let mut orders = Console::connect(server.addr).await;
    assert!(orders
        .call("AUTH orders orders-secret")
        .await
        .starts_with("OK"));
    assert!(orders
        .call("ACQUIRE orders/1 60000")
        .await
        .starts_with("OK token="));
    assert!(orders
        .call("ACQUIRE jobs/1 60000")
        .await
        .starts_with("OK token="));
    let mut admin = Console::connect(server.addr).await;
    assert!(admin
        .call("AUTH admin admin-secret")
        .await
        .starts_with("OK"));
    assert!(admin.call("ACQUIRE x 60000").await.starts_with("OK token="));
    // A blocking acquire: a waiter of its own and a held place reserved for its grant.
    admin.send("ACQUIRE orders/1 60000 60000").await;
    let deadline = Instant::now() + READ_TIMEOUT;
    let text = loop {
        let text = server.scrape().await;
        if text.contains("tenure_identity_waiters{identity=\"admin\"} 1") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the waiter never showed:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        text.contains("tenure_identity_held_locks{identity=\"orders\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("tenure_identity_held_locks{identity=\"admin\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("tenure_identity_waiters{identity=\"orders\"} 0"),
        "{text}"
    );
    let out = promtool(&["check", "metrics"], &text);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    server.stop().await;
}

#[tokio::test]
async fn evicted_unauthenticated_connections_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    config.identities = Some(crate::auth::identities_file(dir.path()));
    config.unauthenticated_per_address_max = 2;
    let server = Server::start(config, None).await;
    assert_eq!(
        sample(&server.scrape().await, "tenure_connections_evicted_total"),
        0.0
    );
    let mut silent = Vec::new();
    for _ in 0..3 {
        let mut c = Console::connect(server.addr).await;
        assert_eq!(c.call("PING").await, "PONG");
        silent.push(c);
    }
    let told = silent[0].recv().await;
    assert!(
        told.starts_with("ERR CONNECTIONS_LIMIT closed: 2 connections"),
        "{told}"
    );
    let deadline = Instant::now() + READ_TIMEOUT;
    while sample(&server.scrape().await, "tenure_connections_evicted_total") != 1.0 {
        assert!(Instant::now() < deadline, "the eviction was never counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(silent);
    server.stop().await;
}
