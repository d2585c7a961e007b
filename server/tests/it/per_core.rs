//! `--runtime per-core`: the real `tenured` with two core threads, each with its own runtime
//! and `SO_REUSEPORT` listener. The kernel picks each connection's thread, so tests that must
//! cross threads use many connections: with 16, all on one thread has odds of 2^-15.
//!
//! Real time throughout (a daemon per test); every wait is bounded by `PATIENCE` or more.

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tenure_protocol::{ErrorCode, Request, Response};
use tenure_testkit::raw::acquire;
use tenure_testkit::{field, free_port, token, Console, Daemon, LineConn, Raw, PATIENCE};

use crate::lifecycle::server_side_timer;
use crate::{tenured, tenured_bin};

/// Two core threads: enough to cross threads, as many as the test machine's cores.
const PER_CORE: [&str; 5] = ["--runtime", "per-core", "--threads", "2", "--no-fsync"];
/// Connections a test opens to reach both threads (see the module docs).
const SPREAD: usize = 16;
/// The daemon's shutdown grace period (`Config::default().shutdown_grace`, no flag).
const GRACE: Duration = Duration::from_secs(5);

fn per_core(dir: &Path, more: &[&str]) -> Daemon {
    let mut args = PER_CORE.to_vec();
    args.extend_from_slice(more);
    tenured(dir, &args)
}

/// Threads of process `pid` named `tenure-core-<i>`.
fn core_threads(pid: u32) -> usize {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the daemon's threads");
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("tenure-core-"))
        .count()
}

/// Waits up to `limit` for `daemon` to exit; `None` if it is still running.
fn exit_within(daemon: &mut Daemon, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(exit) = daemon.child.try_wait().expect("try_wait") {
            return Some(exit);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls INSPECT on `c` until `key` has `count` waiters.
async fn until_waiters(c: &mut Console, key: &str, count: usize) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let held = c.cmd(&format!("INSPECT {key}")).await;
        if held.starts_with("HELD ") && field(&held, "waiters") == count.to_string() {
            return;
        }
        assert!(Instant::now() < deadline, "{key} never had {count} waiters");
        // Real time: the other connections' acquires are on their way.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn per_core_starts_one_named_thread_per_listener_and_serves_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_arg = metrics.to_string();
    let daemon = per_core(dir.path(), &["--metrics-listen", &metrics_arg]);
    assert_eq!(
        core_threads_once_serving(&daemon, 2).await,
        2,
        "--threads 2"
    );
    // The HTTP endpoint stays on the main thread's runtime.
    let mut http = std::net::TcpStream::connect(metrics).unwrap();
    http.set_read_timeout(Some(PATIENCE)).unwrap();
    http.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    http.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(daemon);

    // The shared runtime has none.
    let dir = tempfile::tempdir().unwrap();
    let shared = tenured(
        dir.path(),
        &["--runtime", "shared", "--threads", "2", "--no-fsync"],
    );
    assert_eq!(core_threads_once_serving(&shared, 0).await, 0);
    drop(shared);

    // A single node without --runtime runs per-core.
    let dir = tempfile::tempdir().unwrap();
    let default = tenured(dir.path(), &["--threads", "2", "--no-fsync"]);
    assert_eq!(core_threads_once_serving(&default, 2).await, 2);
}

/// Waits until a console PING is answered and `count` core threads run; returns how many do.
async fn core_threads_once_serving(daemon: &Daemon, count: usize) -> usize {
    let mut c = Console::connect(daemon.addr).await;
    assert_eq!(c.cmd("PING").await, "PONG");
    let deadline = Instant::now() + PATIENCE;
    while core_threads(daemon.pid()) < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    core_threads(daemon.pid())
}

/// The config-file key, as every setting has one (`runtime = "per-core"`).
#[tokio::test]
async fn the_config_file_key_selects_per_core() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenured.toml");
    std::fs::write(
        &path,
        "runtime = \"per-core\"\nthreads = 3\nno-fsync = true\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let daemon = tenured(&data, &["--config", path.to_str().unwrap()]);
    assert_eq!(core_threads_once_serving(&daemon, 3).await, 3);
}

#[tokio::test]
async fn per_core_serves_many_connections_at_once() {
    const CONNECTIONS: usize = 64;
    let dir = tempfile::tempdir().unwrap();
    let daemon = per_core(dir.path(), &[]);
    let mut consoles = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        consoles.push(Console::connect(daemon.addr).await);
    }
    for (i, c) in consoles.iter_mut().enumerate() {
        c.send(&format!("ACQUIRE many:{i} 60000\n")).await;
    }
    for c in &mut consoles {
        let granted = c.line().await;
        assert!(granted.starts_with("OK token="), "{granted}");
    }
    let stats = consoles[0].cmd("STATS").await;
    assert_eq!(field(&stats, "held"), CONNECTIONS.to_string(), "{stats}");
    assert_eq!(
        field(&stats, "connections"),
        CONNECTIONS.to_string(),
        "{stats}"
    );
}

#[tokio::test]
async fn a_release_on_one_connection_hands_the_lock_to_waiters_on_others() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = per_core(dir.path(), &[]);
    let mut holder = Console::connect(daemon.addr).await;
    let first = holder.cmd("ACQUIRE chain 60000").await;
    assert!(first.starts_with("OK token="), "{first}");
    let mut waiters = Vec::with_capacity(SPREAD);
    for i in 0..SPREAD {
        let mut w = Console::connect(daemon.addr).await;
        w.send("ACQUIRE chain 60000 30000\n").await;
        // Queued one at a time, so the hand-offs go in this order (FIFO).
        until_waiters(&mut holder, "chain", i + 1).await;
        waiters.push(w);
    }
    let lease = field(&first, "lease").to_string();
    assert_eq!(holder.cmd(&format!("RELEASE chain {lease}")).await, "OK");
    // Each waiter is granted by the previous one's release, on whichever thread that was.
    let mut last = token(&first);
    for w in &mut waiters {
        let granted = w.line().await;
        assert!(granted.starts_with("OK token="), "{granted}");
        assert!(token(&granted) > last, "tokens grow: {granted}");
        last = token(&granted);
        let lease = field(&granted, "lease").to_string();
        assert_eq!(w.cmd(&format!("RELEASE chain {lease}")).await, "OK");
    }
    assert_eq!(holder.cmd("INSPECT chain").await, "FREE");
}

/// The one expiry ticker runs on the main thread's runtime: without it a waiter behind an
/// expired lease would wait out its own wait (30 s), since nobody else asks for the key.
#[tokio::test]
async fn an_expiry_hands_the_lock_to_a_waiter() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = per_core(dir.path(), &[]);
    let mut holder = Console::connect(daemon.addr).await;
    assert!(holder.cmd("ACQUIRE short 300").await.starts_with("OK "));
    let mut waiter = Console::connect(daemon.addr).await;
    let granted = waiter.cmd("ACQUIRE short 60000 30000").await;
    assert!(granted.starts_with("OK token="), "{granted}");
}

/// Connection ids name a connection's watches: two accept loops handing out the same id
/// would let one connection's WATCH replace another's.
#[tokio::test]
async fn watchers_on_every_thread_each_get_their_events() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = per_core(dir.path(), &[]);
    let mut watchers = Vec::with_capacity(SPREAD);
    for _ in 0..SPREAD {
        let mut w = Console::connect(daemon.addr).await;
        assert_eq!(w.cmd("WATCH watched").await, "OK watching FREE");
        watchers.push(w);
    }
    let mut c = Console::connect(daemon.addr).await;
    let granted = c.cmd("ACQUIRE watched 60000").await;
    for w in &mut watchers {
        let event = w.line().await;
        let expected = format!("EVENT GRANTED key=watched token={}", token(&granted));
        assert_eq!(event, expected);
    }
}

/// `--connections-max` holds for the server, not per thread.
#[tokio::test]
async fn the_connection_limit_is_one_for_all_threads() {
    const LIMIT: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let limit = LIMIT.to_string();
    let daemon = per_core(dir.path(), &["--connections-max", &limit]);
    let mut open = Vec::with_capacity(LIMIT);
    for _ in 0..LIMIT {
        let mut c = Console::connect(daemon.addr).await;
        assert_eq!(c.cmd("PING").await, "PONG");
        open.push(c);
    }
    for _ in 0..2 * LIMIT {
        let mut over = Console::connect(daemon.addr).await;
        let refused = over.line().await;
        assert!(refused.starts_with("ERR CONNECTIONS_LIMIT "), "{refused}");
    }
    assert_eq!(open[0].cmd("PING").await, "PONG");
}

#[tokio::test]
async fn per_core_sockets_have_tcp_keepalive_armed() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = per_core(dir.path(), &["--keepalive-idle-ms", "30000"]);
    let mut clients = Vec::with_capacity(SPREAD);
    for _ in 0..SPREAD {
        let (mut raw, _) = Raw::connect(daemon.addr).await;
        assert_eq!(raw.call(1, Request::Ping).await, Response::Pong);
        let client = raw.stream().local_addr().unwrap();
        let deadline = Instant::now() + PATIENCE;
        let (kind, when) = loop {
            let Some((kind, when)) = server_side_timer(daemon.addr, client) else {
                panic!("no /proc/net/tcp row for the server side of {client}");
            };
            // Timer kind 1 is the retransmit timer, until the PONG is acknowledged.
            if kind != 1 || Instant::now() > deadline {
                break (kind, when);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        assert_eq!(kind, 2, "keepalive timer not armed on the accepted socket");
        assert!(when <= 30 * 100, "keepalive due in {when} ticks");
        clients.push(raw);
    }
}

/// SIGTERM with idle connections and a waiter open: the waiter hears SHUTTING_DOWN, every
/// connection closes at once, and the process exits well within the grace period, after the
/// final sync (the held lock is back after a restart).
#[tokio::test]
async fn sigterm_with_connections_open_exits_within_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = per_core(dir.path(), &[]);
    let (mut holder, _) = Raw::connect(daemon.addr).await;
    let kept = holder.call(1, acquire("kept", 60_000, 0)).await;
    let Response::Granted { token: kept, .. } = kept else {
        panic!("{kept:?}");
    };
    let (mut waiter, _) = Raw::connect(daemon.addr).await;
    waiter.send(5, &acquire("kept", 1000, 60_000)).await;
    // A PING answered on the same connection proves the acquire was read and queued.
    assert_eq!(waiter.call(6, Request::Ping).await, Response::Pong);
    let mut idle = Vec::with_capacity(SPREAD);
    for _ in 0..SPREAD {
        let mut c = Console::connect(daemon.addr).await;
        assert_eq!(c.cmd("PING").await, "PONG");
        idle.push(c);
    }
    tenure_testkit::signal(daemon.pid(), "TERM");
    let (id, response) = waiter.recv().await.expect("the waiter got no answer");
    match response {
        Response::Error { code, .. } => assert_eq!((id, code), (5, ErrorCode::ShuttingDown)),
        other => panic!("{other:?}"),
    }
    let exit = exit_within(&mut daemon, GRACE).expect("still running after the grace period");
    assert!(exit.success(), "clean shutdown exits 0: {exit:?}");
    let daemon = per_core(dir.path(), &[]);
    let mut c = Console::connect(daemon.addr).await;
    let held = c.cmd("INSPECT kept").await;
    assert!(held.starts_with(&format!("HELD token={kept} ")), "{held}");
}

/// Writes INSPECTs of a key with long metadata (each reply about 1 KiB) to a socket without
/// reading the replies, until the server stops reading too: it is then stuck writing to a
/// peer that does not read. Bounded in bytes and time.
fn jam(addr: SocketAddr) -> std::net::TcpStream {
    const SENT_MAX: usize = 256 << 20;
    const STALLS_MAX: u32 = 50;
    let stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_nonblocking(true).unwrap();
    let chunk = "INSPECT jammed\n".repeat(1000);
    let (mut at, mut sent, mut stalls) = (0, 0, 0);
    let deadline = Instant::now() + 3 * PATIENCE;
    while stalls < STALLS_MAX {
        assert!(
            sent < SENT_MAX && Instant::now() < deadline,
            "the server kept reading"
        );
        match (&stream).write(&chunk.as_bytes()[at..]) {
            Ok(n) => {
                (at, sent, stalls) = ((at + n) % chunk.len(), sent + n, 0);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                stalls += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    }
    stream
}

/// A connection whose peer does not read cannot finish: the server waits out the grace
/// period, then ends the core threads with it still open, syncs and exits.
#[test]
fn sigterm_ends_a_connection_stuck_writing_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = per_core(dir.path(), &[]);
    let mut c = LineConn::connect(daemon.addr, PATIENCE).unwrap();
    let meta = "m".repeat(1000);
    let granted = c.cmd(&format!("ACQUIRE jammed 60000 META={meta}")).unwrap();
    assert!(granted.starts_with("OK token="), "{granted}");
    let _stuck = jam(daemon.addr);
    tenure_testkit::signal(daemon.pid(), "TERM");
    let exit = exit_within(&mut daemon, GRACE + 3 * PATIENCE).expect("never exited");
    assert!(exit.success(), "exits 0 after the grace period: {exit:?}");
    let daemon = per_core(dir.path(), &[]);
    let mut c = LineConn::connect(daemon.addr, PATIENCE).unwrap();
    let held = c.cmd("INSPECT jammed").unwrap();
    assert!(
        held.starts_with(&format!("HELD token={} ", token(&granted))),
        "{held}"
    );
}

/// Runs `tenured` with `args` and waits up to `PATIENCE` for it to exit: its status and
/// stderr, or `None` (after killing it) if it kept running.
fn exits_with(args: &[&str]) -> Option<(ExitStatus, String)> {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(tenured_bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break Some(exit);
        }
        if Instant::now() >= deadline {
            let _ = child.kill(); // the PID this test started
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    exit.map(|exit| (exit, std::fs::read_to_string(log.path()).unwrap()))
}

#[test]
fn per_core_is_refused_in_cluster_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let args = [
        "--cluster",
        "--node-id",
        "1",
        "--peer-listen",
        "127.0.0.1:0",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data,
        "--runtime",
        "per-core",
    ];
    let (exit, log) = exits_with(&args).expect("started instead of refusing");
    assert!(!exit.success());
    assert!(
        log.contains("--runtime per-core is not served in cluster mode"),
        "{log}"
    );
}

/// Two `SO_REUSEPORT` groups of one user can share a port; a second server on the first
/// one's address would take half its connections with a lock table of its own.
#[test]
fn a_second_per_core_server_on_the_same_address_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = per_core(dir.path(), &[]);
    let other = tempfile::tempdir().unwrap();
    let addr = first.addr.to_string();
    let mut args = PER_CORE.to_vec();
    args.extend([
        "--listen",
        &addr,
        "--data-dir",
        other.path().to_str().unwrap(),
    ]);
    let (exit, log) = exits_with(&args).expect("a second server shares the port");
    assert!(!exit.success());
    assert!(log.contains(&format!("cannot listen on {addr}")), "{log}");
}

/// TLS handshakes and AUTH (its hash check on a blocking thread) work from a core thread's
/// runtime as from the shared one; a wrong secret is still refused.
#[tokio::test]
async fn tls_and_auth_are_served_by_the_core_threads() {
    use tenure::{AcquireOptions, Client, ClientConfig};
    const CLIENTS: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let ca = tenure_testkit::TestCa::new(dir.path(), "trusted");
    let issued = ca.server(dir.path(), "server");
    let identities = crate::auth::identities_file(dir.path());
    let data = dir.path().join("data");
    let [cert, key, identities] =
        [&issued.cert, &issued.key, &identities].map(|path| path.to_str().unwrap().to_string());
    let args = [
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--identities",
        &identities,
    ];
    let daemon = per_core(&data, &args);
    let connect = |secret: &str| {
        let config = ClientConfig::default()
            .with_tls(ca.trust())
            .with_credentials("admin", secret.to_string());
        Client::connect_with(daemon.addr.to_string(), config)
    };
    let mut clients = Vec::with_capacity(CLIENTS);
    for i in 0..CLIENTS {
        let client = connect("admin-secret").await.expect("TLS and AUTH");
        let outcome = client
            .acquire(
                format!("tls/{i}"),
                Duration::from_secs(60),
                AcquireOptions::default(),
            )
            .await
            .unwrap();
        assert!(outcome.granted().is_some(), "tls/{i} granted");
        clients.push(client);
    }
    let refused = match connect("wrong").await {
        Err(e) => Some(e),
        Ok(client) => client
            .acquire("tls/x", Duration::from_secs(60), AcquireOptions::default())
            .await
            .err(),
    };
    assert!(refused.is_some(), "a wrong secret was accepted");
}
