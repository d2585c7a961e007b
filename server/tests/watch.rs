//! End-to-end tests of watches and of the protocol rules PROTOCOL.md pins down for clients
//! written from it alone: the state a WATCH starts from, event order around WATCH_LIMIT,
//! watching a key twice, request id 0, the in-flight count, and leases used from another
//! connection. Real TCP on port 0, a server in this process.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tenure_protocol::frame::{decode_response, encode_request, split_frame};
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tenure_protocol::{ErrorCode, EventKind, Holder, LeaseId, Request, Response};
use tenure_server::Config;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;

/// Longest wait for any one frame or line.
const PATIENCE: Duration = Duration::from_secs(10);

/// A server running in this test process.
struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tenure_server::ServerError>>,
}

impl Server {
    async fn start(dir: &Path) -> Server {
        Server::start_with(Config::for_tests(dir)).await
    }

    async fn start_with(config: Config) -> Server {
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

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// A bare binary-protocol client.
struct Raw {
    stream: TcpStream,
    buf: BytesMut,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Raw {
        Raw::handshake(TcpStream::connect(addr).await.unwrap()).await
    }

    /// A client whose socket takes in little before the server must wait for it to read.
    async fn connect_small_window(addr: SocketAddr) -> Raw {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        Raw::handshake(socket.connect(addr).await.unwrap()).await
    }

    async fn handshake(mut stream: TcpStream) -> Raw {
        let mut out = BytesMut::new();
        Hello { version: VERSION }.encode(&mut out);
        stream.write_all(&out).await.unwrap();
        let mut buf = BytesMut::new();
        loop {
            if HelloAck::decode(&mut buf).unwrap().is_some() {
                return Raw { stream, buf };
            }
            assert!(
                stream.read_buf(&mut buf).await.unwrap() > 0,
                "closed during handshake"
            );
        }
    }

    async fn send(&mut self, id: u64, request: &Request) {
        let mut out = BytesMut::new();
        encode_request(id, request, &mut out);
        self.stream.write_all(&out).await.unwrap();
    }

    async fn recv(&mut self) -> (u64, Response) {
        loop {
            if let Some((opcode, id, body)) = split_frame(&mut self.buf).unwrap() {
                return (id, decode_response(opcode, body).unwrap());
            }
            let read = tokio::time::timeout(PATIENCE, self.stream.read_buf(&mut self.buf)).await;
            assert!(
                read.expect("no frame within 10 s").unwrap() > 0,
                "connection closed"
            );
        }
    }

    async fn call(&mut self, id: u64, request: Request) -> Response {
        self.send(id, &request).await;
        let (got, response) = self.recv().await;
        assert_eq!(got, id, "reply to another request: {response:?}");
        response
    }
}

/// A console session: one line out, one line back.
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

    async fn line(&mut self) -> String {
        let mut line = String::new();
        let n = tokio::time::timeout(PATIENCE, self.reader.read_line(&mut line))
            .await
            .expect("no line within 10 s")
            .unwrap();
        assert!(n > 0, "connection closed");
        line.trim_end().to_string()
    }

    async fn cmd(&mut self, text: &str) -> String {
        self.writer
            .write_all(format!("{text}\n").as_bytes())
            .await
            .unwrap();
        self.line().await
    }
}

fn bytes(text: &str) -> Bytes {
    Bytes::copy_from_slice(text.as_bytes())
}

fn acquire(key: &str, ttl_ms: u32, wait_ms: u32, meta: &str) -> Request {
    Request::Acquire {
        key: bytes(key),
        ttl_ms,
        wait_ms,
        release_on_disconnect: false,
        meta: bytes(meta),
    }
}

fn watch(key: &str) -> Request {
    Request::Watch { key: bytes(key) }
}

fn granted(response: Response) -> (u64, LeaseId) {
    match response {
        Response::Granted {
            token, lease_id, ..
        } => (token, lease_id),
        other => panic!("expected a grant, got {other:?}"),
    }
}

fn event(response: Response) -> (EventKind, u64) {
    match response {
        Response::Event { kind, token, .. } => (kind, token),
        other => panic!("expected an event, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_reply_carries_the_current_holder() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut holder = Raw::connect(server.addr).await;
    let (token, _) = granted(holder.call(1, acquire("k", 30_000, 0, "leader-1")).await);
    let mut watcher = Raw::connect(server.addr).await;
    match watcher.call(7, watch("k")).await {
        Response::Watching {
            holder:
                Some(Holder {
                    token: t,
                    ttl_left_ms,
                    waiters: 0,
                    meta,
                }),
        } => {
            assert_eq!(t, token);
            assert!((20_000..=30_000).contains(&ttl_left_ms), "{ttl_left_ms}");
            assert_eq!(&meta[..], b"leader-1");
        }
        other => panic!("expected WATCHING with the holder, got {other:?}"),
    }
    assert_eq!(
        watcher.call(8, watch("free")).await,
        Response::Watching { holder: None }
    );
    // The console says the same on its reply line.
    let mut console = Console::connect(server.addr).await;
    let line = console.cmd("WATCH k").await;
    assert!(
        line.starts_with(&format!("OK watching HELD token={token} ttl_ms=")),
        "{line}"
    );
    assert!(line.ends_with(" waiters=0 meta=leader-1"), "{line}");
    assert_eq!(console.cmd("WATCH free").await, "OK watching FREE");
    server.stop().await;
}

#[tokio::test]
async fn a_lease_over_by_the_clock_is_free_in_the_watch_reply_and_sends_no_late_expiry() {
    let dir = tempfile::tempdir().unwrap();
    // The ticker stays out of the way: only requests find the lease over.
    let config = Config {
        tick_interval: Duration::from_secs(3600),
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    let mut holder = Raw::connect(server.addr).await;
    granted(holder.call(1, acquire("short", 10, 0, "")).await);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut watcher = Raw::connect(server.addr).await;
    assert_eq!(
        watcher.call(2, watch("short")).await,
        Response::Watching { holder: None }
    );
    // The next change is a grant: no EXPIRED of the lease the reply already showed as over.
    let (token, _) = granted(holder.call(2, acquire("short", 30_000, 0, "")).await);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, token));
    server.stop().await;
}

/// Events of one watch as the client reads them, checked to be a gap-free run of
/// granted/released pairs.
fn check_run(events: &[(EventKind, u64)]) {
    for pair in events.windows(2) {
        let ((kind_a, token_a), (kind_b, token_b)) = (pair[0], pair[1]);
        match (kind_a, kind_b) {
            (EventKind::Granted, EventKind::Released) => assert_eq!(token_a, token_b),
            (EventKind::Released, EventKind::Granted) => assert!(token_b > token_a),
            other => panic!("gap in the events: {other:?} in {pair:?}"),
        }
    }
}

#[tokio::test]
async fn watch_limit_comes_after_every_event_delivered_and_nothing_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        watch_queue_max: 16,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    // Long keys and metadata fill the sockets fast.
    let hot = "h".repeat(1000);
    let mut watcher = Raw::connect_small_window(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch(&hot)).await,
        Response::Watching { .. }
    ));
    // The watcher reads nothing meanwhile.
    let meta = "m".repeat(1000);
    let mut changer = Raw::connect(server.addr).await;
    for i in 0..3_000u64 {
        let (_, lease_id) = granted(changer.call(10 + i, acquire(&hot, 30_000, 0, &meta)).await);
        let release = Request::Release {
            key: bytes(&hot),
            lease_id,
        };
        assert_eq!(changer.call(10 + i, release).await, Response::Released);
    }
    // Now read: events, then the end of the watch, then nothing of it.
    let mut events = Vec::new();
    loop {
        let (id, response) = watcher.recv().await;
        assert_eq!(id, 1, "{response:?}");
        match response {
            Response::Error { code, .. } => {
                assert_eq!(code, ErrorCode::WatchLimit);
                break;
            }
            other => events.push(event(other)),
        }
        assert!(events.len() <= 6_000, "the watch never overflowed");
    }
    check_run(&events);
    assert!(events.len() < 6_000, "some events must have been dropped");
    assert_eq!(watcher.call(2, Request::Ping).await, Response::Pong);
    // A new watch on the same connection works again.
    assert_eq!(
        watcher.call(3, watch(&hot)).await,
        Response::Watching { holder: None }
    );
    let (token, _) = granted(changer.call(9, acquire(&hot, 30_000, 0, "")).await);
    let (id, response) = watcher.recv().await;
    assert_eq!((id, event(response)), (3, (EventKind::Granted, token)));
    server.stop().await;
}

#[tokio::test]
async fn watching_a_key_twice_replaces_the_watch() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        watches_per_connection_max: 2,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    let mut watcher = Raw::connect(server.addr).await;
    let mut changer = Raw::connect(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch("a")).await,
        Response::Watching { holder: None }
    ));
    let (token, lease_id) = granted(changer.call(1, acquire("a", 30_000, 0, "x")).await);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, token));
    // Watching again replaces the first watch, and does not count twice against the limit.
    match watcher.call(2, watch("a")).await {
        Response::Watching { holder: Some(h) } => assert_eq!(h.token, token),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        watcher.call(3, watch("b")).await,
        Response::Watching { .. }
    ));
    // Events now carry the second watch's id, once.
    let release = Request::Release {
        key: bytes("a"),
        lease_id,
    };
    assert_eq!(changer.call(3, release).await, Response::Released);
    let (id, response) = watcher.recv().await;
    assert_eq!((id, event(response)), (2, (EventKind::Released, token)));
    assert_eq!(watcher.call(4, Request::Ping).await, Response::Pong);
    // One UNWATCH ends it.
    let unwatch = Request::Unwatch { key: bytes("a") };
    assert_eq!(watcher.call(5, unwatch).await, Response::Unwatched);
    assert!(matches!(
        watcher.call(6, watch("c")).await,
        Response::Watching { .. }
    ));
    server.stop().await;
}

#[tokio::test]
async fn a_hand_off_shows_as_released_then_granted_and_a_disconnect_as_released() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut watcher = Raw::connect(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch("h")).await,
        Response::Watching { .. }
    ));
    let mut first = Raw::connect(server.addr).await;
    let (t1, lease_id) = granted(first.call(1, acquire("h", 30_000, 0, "")).await);
    let mut second = Raw::connect(server.addr).await;
    second.send(1, &acquire("h", 30_000, 60_000, "")).await;
    let release = Request::Release {
        key: bytes("h"),
        lease_id,
    };
    // The waiter is queued once INSPECT counts it.
    for _ in 0..100 {
        match first.call(2, Request::Inspect { key: bytes("h") }).await {
            Response::Held { waiters: 1, .. } => break,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    assert_eq!(first.call(3, release).await, Response::Released);
    let (t2, _) = granted(second.recv().await.1);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, t1));
    assert_eq!(event(watcher.recv().await.1), (EventKind::Released, t1));
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, t2));
    // Release on disconnect shows as a release.
    let mut leaver = Raw::connect(server.addr).await;
    let on_disconnect = Request::Acquire {
        key: bytes("d"),
        ttl_ms: 30_000,
        wait_ms: 0,
        release_on_disconnect: true,
        meta: Bytes::new(),
    };
    assert!(matches!(
        watcher.call(2, watch("d")).await,
        Response::Watching { holder: None }
    ));
    let (t3, _) = granted(leaver.call(1, on_disconnect).await);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, t3));
    drop(leaver);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Released, t3));
    server.stop().await;
}

#[tokio::test]
async fn request_id_0_is_refused_as_a_bad_frame() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut client = Raw::connect(server.addr).await;
    client.send(0, &acquire("zero", 30_000, 0, "")).await;
    match client.recv().await {
        (0, Response::Error { code, .. }) => assert_eq!(code, ErrorCode::BadFrame),
        other => panic!("expected BAD_FRAME for id 0, got {other:?}"),
    }
    // Nothing ran: the key is free, and the connection goes on.
    let inspect = Request::Inspect { key: bytes("zero") };
    assert_eq!(client.call(1, inspect).await, Response::Free);
    server.stop().await;
}

#[tokio::test]
async fn a_waiting_acquire_counts_in_flight_and_a_running_watch_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        in_flight_max: 2,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    let mut holder = Raw::connect(server.addr).await;
    granted(holder.call(1, acquire("busy", 30_000, 0, "")).await);
    let mut client = Raw::connect(server.addr).await;
    // Two watches, answered: they no longer count.
    for (id, key) in [(1, "w1"), (2, "w2")] {
        assert!(matches!(
            client.call(id, watch(key)).await,
            Response::Watching { .. }
        ));
    }
    client.send(3, &acquire("busy", 30_000, 60_000, "")).await;
    client.send(4, &acquire("busy", 30_000, 60_000, "")).await;
    match client.call(5, Request::Ping).await {
        Response::Error { code, .. } => assert_eq!(code, ErrorCode::TooManyInFlight),
        other => panic!("expected TOO_MANY_IN_FLIGHT, got {other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn renew_and_release_work_from_any_connection_given_the_lease_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut owner = Raw::connect(server.addr).await;
    let (_, lease_id) = granted(owner.call(1, acquire("shared", 1_000, 0, "")).await);
    let mut other = Raw::connect(server.addr).await;
    let renew = Request::Renew {
        key: bytes("shared"),
        lease_id,
        ttl_ms: 30_000,
    };
    assert_eq!(
        other.call(1, renew).await,
        Response::Renewed { ttl_ms: 30_000 }
    );
    let release = Request::Release {
        key: bytes("shared"),
        lease_id,
    };
    assert_eq!(other.call(2, release).await, Response::Released);
    let inspect = Request::Inspect {
        key: bytes("shared"),
    };
    assert_eq!(owner.call(2, inspect).await, Response::Free);
    server.stop().await;
}

#[tokio::test]
async fn no_event_of_a_watch_follows_its_unwatched_reply() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        watch_queue_max: 100_000,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    // Long keys and metadata fill the sockets fast.
    let hot = "h".repeat(1000);
    let mut watcher = Raw::connect_small_window(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch(&hot)).await,
        Response::Watching { .. }
    ));
    // Enough events that many still wait in the server when UNWATCH arrives.
    let meta = "m".repeat(1000);
    let mut changer = Raw::connect(server.addr).await;
    for i in 0..3_000u64 {
        let (_, lease_id) = granted(changer.call(10 + i, acquire(&hot, 30_000, 0, &meta)).await);
        let release = Request::Release {
            key: bytes(&hot),
            lease_id,
        };
        assert_eq!(changer.call(10 + i, release).await, Response::Released);
    }
    watcher
        .send(2, &Request::Unwatch { key: bytes(&hot) })
        .await;
    let mut events = Vec::new();
    loop {
        match watcher.recv().await {
            (2, Response::Unwatched) => break,
            (1, other) => events.push(event(other)),
            other => panic!("unexpected {other:?}"),
        }
    }
    check_run(&events);
    assert_eq!(watcher.call(3, Request::Ping).await, Response::Pong);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_taken_back_after_a_failed_sync_shows_as_granted_again() {
    use std::sync::Arc;
    use tenure_server::wal::{FaultPlan, Faults, FaultyStorage, FsStorage};
    let dir = tempfile::tempdir().unwrap();
    let faults = Arc::new(Faults::default());
    let storage = FaultyStorage::new(FsStorage::new(dir.path()).unwrap(), Arc::clone(&faults));
    let config = Config {
        fsync: true,
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
    let mut watcher = Raw::connect(addr).await;
    assert!(matches!(
        watcher.call(1, watch("k")).await,
        Response::Watching { holder: None }
    ));
    let mut holder = Raw::connect(addr).await;
    let (token, lease_id) = granted(holder.call(1, acquire("k", 30_000, 0, "m")).await);
    assert_eq!(event(watcher.recv().await.1), (EventKind::Granted, token));
    faults.set(FaultPlan {
        sync_fails_from: Some(faults.syncs() + 1),
        ..FaultPlan::default()
    });
    let release = Request::Release {
        key: bytes("k"),
        lease_id,
    };
    match holder.call(2, release).await {
        Response::Error { code, .. } => assert_eq!(code, ErrorCode::Unavailable),
        other => panic!("expected UNAVAILABLE, got {other:?}"),
    }
    // The watcher saw the release; it sees the lease come back, as INSPECT does.
    assert_eq!(event(watcher.recv().await.1), (EventKind::Released, token));
    match watcher.recv().await.1 {
        Response::Event {
            kind: EventKind::Granted,
            token: t,
            meta,
            ..
        } => assert_eq!((t, &meta[..]), (token, &b"m"[..])),
        other => panic!("expected the lease back, got {other:?}"),
    }
    match holder.call(3, Request::Inspect { key: bytes("k") }).await {
        Response::Held { token: t, .. } => assert_eq!(t, token),
        other => panic!("{other:?}"),
    }
    let _ = stop.send(());
    let stopped = task.await.unwrap();
    assert!(stopped.is_err(), "the final sync must report the failure");
}

#[tokio::test]
async fn a_repeated_watch_sends_every_earlier_event_before_its_reply() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        watch_queue_max: 100_000,
        ..Config::for_tests(dir.path())
    };
    let server = Server::start_with(config).await;
    let hot = "h".repeat(1000);
    let mut watcher = Raw::connect_small_window(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch(&hot)).await,
        Response::Watching { .. }
    ));
    // Many events still wait in the server when the second WATCH arrives.
    let meta = "m".repeat(1000);
    let mut changer = Raw::connect(server.addr).await;
    let mut last = 0;
    for i in 0..3_000u64 {
        let (token, lease_id) =
            granted(changer.call(10 + i, acquire(&hot, 30_000, 0, &meta)).await);
        let release = Request::Release {
            key: bytes(&hot),
            lease_id,
        };
        assert_eq!(changer.call(10 + i, release).await, Response::Released);
        last = token;
    }
    watcher.send(2, &watch(&hot)).await;
    let mut events = Vec::new();
    loop {
        match watcher.recv().await {
            (2, Response::Watching { holder: None }) => break,
            (1, other) => events.push(event(other)),
            other => panic!("unexpected {other:?}"),
        }
    }
    check_run(&events);
    assert_eq!(events.first(), Some(&(EventKind::Granted, 1)));
    assert_eq!(events.last(), Some(&(EventKind::Released, last)));
    assert_eq!(watcher.call(3, Request::Ping).await, Response::Pong);
    server.stop().await;
}
