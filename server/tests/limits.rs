//! Server-wide limits over real TCP at the default shard count: each is exact (exactly N
//! granted or queued, the N+1th refused with a message naming the limit), and every way a
//! lock or a waiter goes away gives its place back exactly.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tenure_protocol::frame::{decode_response, encode_request, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tenure_protocol::{ErrorCode, Request, Response};
use tenure_server::wal::{FaultPlan, Faults, FaultyStorage, FsStorage};
use tenure_server::Config;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// Distinct keys tried against a limit: many more than the limit, spread over the shards.
const KEYS_TRIED: usize = 40;
/// Longest a test polls STATS for a count to settle.
const SETTLE_MAX: Duration = Duration::from_secs(5);

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tenure_server::ServerError>>,
}

impl Server {
    async fn start(config: Config) -> Server {
        assert_eq!(config.shards, Config::default().shards, "default shards");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tenure_server::run(config, listener, async move {
            let _ = stopped.await;
        }));
        Server {
            addr,
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) -> Result<(), tenure_server::ServerError> {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap()
    }
}

struct Console {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
}

impl Console {
    async fn connect(addr: SocketAddr) -> Console {
        let (r, w) = TcpStream::connect(addr).await.unwrap().into_split();
        Console {
            reader: BufReader::new(r),
            writer: w,
        }
    }

    async fn cmd(&mut self, text: &str) -> String {
        self.writer
            .write_all(format!("{text}\n").as_bytes())
            .await
            .unwrap();
        let mut line = String::new();
        let n = tokio::time::timeout(Duration::from_secs(10), self.reader.read_line(&mut line))
            .await
            .expect("no reply within 10 s")
            .unwrap();
        assert!(n > 0, "connection closed");
        line.trim_end().to_string()
    }

    /// A STATS counter.
    async fn stat(&mut self, name: &str) -> u64 {
        let stats = self.cmd("STATS").await;
        let value = stats
            .split_whitespace()
            .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')));
        value
            .unwrap_or_else(|| panic!("no {name} in {stats}"))
            .parse()
            .unwrap()
    }

    /// Polls STATS until `name` is `want`, for at most `SETTLE_MAX`.
    async fn settle(&mut self, name: &str, want: u64) {
        let deadline = Instant::now() + SETTLE_MAX;
        loop {
            let got = self.stat(name).await;
            if got == want {
                return;
            }
            assert!(Instant::now() < deadline, "{name} stays {got}, not {want}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Acquires `KEYS_TRIED` fresh keys `prefix0..`; returns the lease ids granted and checks
    /// every refusal is `refusal`.
    async fn acquire_many(&mut self, prefix: &str, suffix: &str, refusal: &str) -> Vec<String> {
        let mut leases = Vec::new();
        for i in 0..KEYS_TRIED {
            let reply = self.cmd(&format!("ACQUIRE {prefix}{i} {suffix}")).await;
            if reply.starts_with("OK ") {
                let lease = reply.split_whitespace().nth(2).unwrap();
                let lease = lease.strip_prefix("lease=").unwrap();
                leases.push(format!("{prefix}{i} {lease}"));
            } else {
                assert!(reply.starts_with(refusal), "{reply}");
            }
        }
        leases
    }
}

/// A binary-protocol client that pipelines blocking acquires.
struct Raw {
    stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Raw {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut out = BytesMut::new();
        Hello { version: VERSION }.encode(&mut out);
        stream.write_all(&out).await.unwrap();
        let mut buf = BytesMut::new();
        loop {
            if HelloAck::decode(&mut buf).unwrap().is_some() {
                return Raw { stream, buf };
            }
            assert!(stream.read_buf(&mut buf).await.unwrap() > 0, "closed");
        }
    }

    /// Sends a blocking ACQUIRE of `key` as request `id`.
    async fn wait_for(&mut self, id: u64, key: &str, wait_ms: u32) {
        self.wait_for_many(&[(id, key.to_string())], wait_ms).await;
    }

    /// Sends blocking ACQUIREs in one write, so the server handles them in one pass.
    async fn wait_for_many(&mut self, requests: &[(u64, String)], wait_ms: u32) {
        let mut out = BytesMut::new();
        for (id, key) in requests {
            let request = Request::Acquire {
                key: key.as_bytes().to_vec().into(),
                ttl_ms: 30_000,
                wait_ms,
                release_on_disconnect: false,
                meta: Default::default(),
            };
            encode_request(*id, &request, &mut out);
        }
        self.stream.write_all(&out).await.unwrap();
    }

    async fn recv(&mut self) -> (u64, Response) {
        loop {
            if let Some((opcode, id, body)) = split_frame(&mut self.buf).unwrap() {
                return (id, decode_response(opcode, body).unwrap());
            }
            let read =
                tokio::time::timeout(Duration::from_secs(10), self.stream.read_buf(&mut self.buf))
                    .await;
            assert!(read.expect("no frame within 10 s").unwrap() > 0, "closed");
        }
    }

    /// Reads `count` replies; each must be an ERROR with `code` whose message names `flag`.
    async fn refusals(&mut self, count: usize, code: ErrorCode, flag: &str) {
        for _ in 0..count {
            match self.recv().await {
                (_, Response::Error { code: got, message }) if got == code => {
                    assert!(message.contains(flag), "{message}");
                }
                other => panic!("expected {code:?}, got {other:?}"),
            }
        }
    }
}

/// With `--held-max 3` and 64 shards, exactly 3 of many distinct keys are granted, and each
/// way a lock goes (release, expiry, release on disconnect) gives exactly its place back.
#[tokio::test]
async fn held_max_is_exact_server_wide() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        held_max: 3,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start(config).await;
    let mut c = Console::connect(server.addr).await;
    let refusal = "ERR HELD_LIMIT the server holds 3 locks, its limit (--held-max)";
    let leases = c.acquire_many("a", "30000", refusal).await;
    assert_eq!(leases.len(), 3, "{leases:?}");
    assert_eq!(c.stat("held").await, 3);
    // A release frees exactly one place.
    assert_eq!(c.cmd(&format!("RELEASE {}", leases[0])).await, "OK");
    assert_eq!(c.acquire_many("b", "30000", refusal).await.len(), 1);
    for lease in &leases[1..] {
        assert_eq!(c.cmd(&format!("RELEASE {lease}")).await, "OK");
    }
    c.settle("held", 1).await;
    // Expiries free their places (two places are free, so both are granted however slowly).
    for key in ["c0", "c1"] {
        assert!(c
            .cmd(&format!("ACQUIRE {key} 100"))
            .await
            .starts_with("OK "));
    }
    c.settle("held", 1).await;
    // So does a connection that asked for release on disconnect.
    let mut gone = Console::connect(server.addr).await;
    let held = gone
        .acquire_many("d", "30000 RELEASE_ON_DISCONNECT", refusal)
        .await;
    assert_eq!(held.len(), 2);
    drop(gone);
    c.settle("held", 1).await;
    assert_eq!(c.acquire_many("e", "30000", refusal).await.len(), 2);
    server.stop().await.unwrap();
}

/// With `--waiters-max 3` and 64 shards, exactly 3 blocking acquires on distinct keys queue,
/// and time-outs, hand-offs and closed connections give exactly their places back.
#[tokio::test]
async fn waiters_max_is_exact_server_wide() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        waiters_max: 3,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start(config).await;
    let mut c = Console::connect(server.addr).await;
    let leases = c.acquire_many("k", "30000", "never refused").await;
    let flag = "the server has 3 waiters, its limit (--waiters-max)";
    // 40 waiters on 40 keys: 37 refused at once, 3 queued.
    let waits: Vec<(u64, String)> = (0..KEYS_TRIED)
        .map(|i| (i as u64 + 1, format!("k{i}")))
        .collect();
    let mut w = Raw::connect(server.addr).await;
    w.wait_for_many(&waits, 30_000).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    assert_eq!(c.stat("waiters").await, 3);
    // A closed connection gives its places back.
    drop(w);
    c.settle("waiters", 0).await;
    // Waits that run out give theirs back.
    let mut w = Raw::connect(server.addr).await;
    w.wait_for_many(&waits, 500).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    for _ in 0..3 {
        assert!(matches!(w.recv().await.1, Response::Locked { .. }));
    }
    c.settle("waiters", 0).await;
    // A hand-off gives exactly one back.
    w.wait_for_many(&waits, 30_000).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    // The first three requests (k0, k1, k2) queued: releasing k0 hands it to its waiter.
    assert!(leases[0].starts_with("k0 "));
    assert_eq!(c.cmd(&format!("RELEASE {}", leases[0])).await, "OK");
    assert!(matches!(w.recv().await.1, Response::Granted { .. }));
    assert_eq!(c.stat("waiters").await, 2);
    w.wait_for(100, "k39", 30_000).await;
    w.wait_for(101, "k38", 30_000).await;
    w.refusals(1, ErrorCode::WaitersLimit, flag).await;
    assert_eq!(c.stat("waiters").await, 3);
    drop(w);
    server.stop().await.unwrap();
}

/// The per-key cap is `--waiters-per-key-max`, not the server-wide cap split over shards,
/// and its refusal names it.
#[tokio::test]
async fn waiters_per_key_max_is_its_own_limit() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        waiters_max: 1_000,
        waiters_per_key_max: 200,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start(config).await;
    let mut c = Console::connect(server.addr).await;
    assert!(c.cmd("ACQUIRE hot 30000").await.starts_with("OK "));
    let mut w = Raw::connect(server.addr).await;
    let waits: Vec<(u64, String)> = (1..=201).map(|id| (id, "hot".to_string())).collect();
    w.wait_for_many(&waits, 30_000).await;
    let flag = "this key has 200 waiters, its limit (--waiters-per-key-max)";
    w.refusals(1, ErrorCode::WaitersLimit, flag).await;
    assert_eq!(c.stat("waiters").await, 200);
    assert!(c.cmd("INSPECT hot").await.ends_with("waiters=200"));
    drop(w);
    c.settle("waiters", 0).await;
    server.stop().await.unwrap();
}

/// A grant taken back because its WAL record could not be synced gives its place back.
#[tokio::test]
async fn grant_undone_after_a_failed_sync_gives_its_place_back() {
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let storage = FaultyStorage::new(FsStorage::new(dir.path()).unwrap(), Arc::clone(&faults));
    let config = Config {
        fsync: true,
        held_max: 2,
        ..Config::for_tests(dir.path())
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(tenure_server::run_with_storage(
        config,
        Arc::new(storage),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut c = Console::connect(addr).await;
    assert!(c.cmd("ACQUIRE before 60000").await.starts_with("OK "));
    faults.set(FaultPlan {
        sync_fails_from: Some(faults.syncs() + 1),
        ..FaultPlan::default()
    });
    let failed = c.cmd("ACQUIRE x 60000").await;
    assert!(failed.starts_with("ERR UNAVAILABLE "), "{failed}");
    c.settle("held", 1).await;
    drop(c);
    let _ = stop.send(());
    let stopped = task.await.unwrap();
    assert!(stopped.is_err(), "the final sync must report the failure");
}

/// Watching the same key again replaces the watch: it neither counts twice against
/// `watches_per_connection_max` nor keeps the connection from watching other keys.
#[tokio::test]
async fn rewatching_a_key_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        watches_per_connection_max: 2,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start(config).await;
    let mut c = Console::connect(server.addr).await;
    for _ in 0..3 {
        assert_eq!(c.cmd("WATCH a").await, "OK watching FREE");
    }
    assert_eq!(c.cmd("WATCH b").await, "OK watching FREE");
    let refused = c.cmd("WATCH c").await;
    assert!(refused.starts_with("ERR WATCH_LIMIT "), "{refused}");
    // Unwatching and watching again, many times, stays within the limit.
    for _ in 0..5 {
        assert_eq!(c.cmd("UNWATCH b").await, "OK");
        assert_eq!(c.cmd("WATCH b").await, "OK watching FREE");
    }
    assert_eq!(c.cmd("UNWATCH a").await, "OK");
    assert_eq!(c.cmd("WATCH c").await, "OK watching FREE");
    assert_eq!(c.stat("watches").await, 2);
    server.stop().await.unwrap();
}
