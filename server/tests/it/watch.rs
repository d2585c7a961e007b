//! End-to-end tests of watches and of the protocol rules PROTOCOL.md pins down for clients
//! written from it alone: the state a WATCH starts from, event order around WATCH_LIMIT,
//! watching a key twice, request id 0, the in-flight count, and leases used from another
//! connection. Real TCP on port 0, a server in this process.

use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, EventKind, Holder, Request, Response};
use tenure_testkit::raw::{acquire_meta as acquire, bytes, granted};
use tenure_testkit::server::Heartbeat;
use tenure_testkit::{Console, Raw, Server};

fn watch(key: &str) -> Request {
    Request::Watch { key: bytes(key) }
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
    let mut holder = Raw::connect(server.addr).await.0;
    let (token, _) = granted(holder.call(1, acquire("k", 30_000, 0, "leader-1")).await);
    let mut watcher = Raw::connect(server.addr).await.0;
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

#[tokio::test(start_paused = true)]
async fn a_lease_over_by_the_clock_is_free_in_the_watch_reply_and_sends_no_late_expiry() {
    // The ticker stays out of the way: only requests find the lease over. A heartbeat stands
    // in for it as the next timer, so a hop costs a millisecond of virtual time, not an hour.
    let _heartbeat = Heartbeat::start();
    let server =
        Server::start_virtual_with(|config| config.tick_interval = Duration::from_secs(3600)).await;
    let mut holder = Raw::connect(server.addr).await.0;
    granted(holder.call(1, acquire("short", 10, 0, "")).await);
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut watcher = Raw::connect(server.addr).await.0;
    assert_eq!(
        watcher.call(2, watch("short")).await,
        Response::Watching { holder: None }
    );
    // The next change is a grant: no EXPIRED of the lease the reply already showed as over.
    let (token, _) = granted(holder.call(2, acquire("short", 30_000, 0, "")).await);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, token));
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

/// A watcher whose socket is full of events it has not read, and the connection that made them.
struct Flood {
    server: Server,
    watcher: Raw,
    changer: Raw,
    /// The watched key (long, as is its metadata, so the sockets fill fast).
    hot: String,
    /// The token of the last grant.
    last: u64,
}

/// Watches a long key (request id 1) from a connection with a small receive window, then
/// grants and releases it 3 000 times from another connection without reading the watch.
async fn flood(dir: &std::path::Path, watch_queue_max: usize) -> Flood {
    let server = Server::start_in(dir, |config| config.watch_queue_max = watch_queue_max).await;
    let hot = "h".repeat(1000);
    let mut watcher = Raw::connect_small_window(server.addr).await;
    assert!(matches!(
        watcher.call(1, watch(&hot)).await,
        Response::Watching { .. }
    ));
    let meta = "m".repeat(1000);
    let mut changer = Raw::connect(server.addr).await.0;
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
    Flood {
        server,
        watcher,
        changer,
        hot,
        last,
    }
}

#[tokio::test]
async fn watch_limit_comes_after_every_event_delivered_and_nothing_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    // The watcher reads nothing meanwhile.
    let Flood {
        server,
        mut watcher,
        mut changer,
        hot,
        ..
    } = flood(dir.path(), 16).await;
    // Now read: events, then the end of the watch, then nothing of it.
    let mut events = Vec::new();
    loop {
        let (id, response) = watcher.frame().await;
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
    let (id, response) = watcher.frame().await;
    assert_eq!((id, event(response)), (3, (EventKind::Granted, token)));
    server.stop().await;
}

#[tokio::test]
async fn watching_a_key_twice_replaces_the_watch() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), |config| config.watches_per_connection_max = 2).await;
    let mut watcher = Raw::connect(server.addr).await.0;
    let mut changer = Raw::connect(server.addr).await.0;
    assert!(matches!(
        watcher.call(1, watch("a")).await,
        Response::Watching { holder: None }
    ));
    let (token, lease_id) = granted(changer.call(1, acquire("a", 30_000, 0, "x")).await);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, token));
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
    let (id, response) = watcher.frame().await;
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
    let mut watcher = Raw::connect(server.addr).await.0;
    assert!(matches!(
        watcher.call(1, watch("h")).await,
        Response::Watching { .. }
    ));
    let mut first = Raw::connect(server.addr).await.0;
    let (t1, lease_id) = granted(first.call(1, acquire("h", 30_000, 0, "")).await);
    let mut second = Raw::connect(server.addr).await.0;
    second.send(1, &acquire("h", 30_000, 60_000, "")).await;
    let release = Request::Release {
        key: bytes("h"),
        lease_id,
    };
    // The waiter is queued once INSPECT counts it.
    for _ in 0..100 {
        match first
            .call(
                2,
                Request::Inspect {
                    key: bytes("h"),
                    kinds: Default::default(),
                },
            )
            .await
        {
            Response::Held { waiters: 1, .. } => break,
            // Real time, polling until the server has read the waiter (no lease runs out here).
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    assert_eq!(first.call(3, release).await, Response::Released);
    let (t2, _) = granted(second.frame().await.1);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, t1));
    assert_eq!(event(watcher.frame().await.1), (EventKind::Released, t1));
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, t2));
    // Release on disconnect shows as a release.
    let mut leaver = Raw::connect(server.addr).await.0;
    let on_disconnect = Request::Acquire {
        key: bytes("d"),
        ttl_ms: 30_000,
        wait_ms: 0,
        release_on_disconnect: true,
        meta: Bytes::new(),
        acquire_id: None,
        kind: Default::default(),
        session_id: None,
    };
    assert!(matches!(
        watcher.call(2, watch("d")).await,
        Response::Watching { holder: None }
    ));
    let (t3, _) = granted(leaver.call(1, on_disconnect).await);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, t3));
    drop(leaver);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Released, t3));
    server.stop().await;
}

#[tokio::test]
async fn request_id_0_is_refused_as_a_bad_frame() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut client = Raw::connect(server.addr).await.0;
    client.send(0, &acquire("zero", 30_000, 0, "")).await;
    match client.frame().await {
        (0, Response::Error { code, .. }) => assert_eq!(code, ErrorCode::BadFrame),
        other => panic!("expected BAD_FRAME for id 0, got {other:?}"),
    }
    // Nothing ran: the key is free, and the connection goes on.
    let inspect = Request::Inspect {
        key: bytes("zero"),
        kinds: Default::default(),
    };
    assert_eq!(client.call(1, inspect).await, Response::Free);
    server.stop().await;
}

/// STATS `errors`, asked on `raw`.
async fn stats_errors(raw: &mut Raw) -> u64 {
    match raw.call(99, Request::Stats).await {
        Response::Stats(pairs) => pairs.iter().find(|(n, _)| n == "errors").unwrap().1,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_waiting_acquire_counts_in_flight_and_a_running_watch_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), |config| config.in_flight_max = 2).await;
    let mut holder = Raw::connect(server.addr).await.0;
    granted(holder.call(1, acquire("busy", 30_000, 0, "")).await);
    let mut client = Raw::connect(server.addr).await.0;
    // Two watches, answered: they no longer count.
    for (id, key) in [(1, "w1"), (2, "w2")] {
        assert!(matches!(
            client.call(id, watch(key)).await,
            Response::Watching { .. }
        ));
    }
    let errors_before = stats_errors(&mut holder).await;
    client.send(3, &acquire("busy", 30_000, 60_000, "")).await;
    client.send(4, &acquire("busy", 30_000, 60_000, "")).await;
    match client.call(5, Request::Ping).await {
        Response::Error { code, .. } => assert_eq!(code, ErrorCode::TooManyInFlight),
        other => panic!("expected TOO_MANY_IN_FLIGHT, got {other:?}"),
    }
    // PROTOCOL.md 3.3: TOO_MANY_IN_FLIGHT counts in STATS `errors`.
    assert_eq!(stats_errors(&mut holder).await, errors_before + 1);
    server.stop().await;
}

#[tokio::test]
async fn renew_and_release_work_from_any_connection_given_the_lease_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut owner = Raw::connect(server.addr).await.0;
    let (_, lease_id) = granted(owner.call(1, acquire("shared", 1_000, 0, "")).await);
    let mut other = Raw::connect(server.addr).await.0;
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
        kinds: Default::default(),
    };
    assert_eq!(owner.call(2, inspect).await, Response::Free);
    server.stop().await;
}

#[tokio::test]
async fn no_event_of_a_watch_follows_its_unwatched_reply() {
    let dir = tempfile::tempdir().unwrap();
    // Enough events that many still wait in the server when UNWATCH arrives.
    let Flood {
        server,
        mut watcher,
        hot,
        ..
    } = flood(dir.path(), 100_000).await;
    watcher
        .send(2, &Request::Unwatch { key: bytes(&hot) })
        .await;
    let mut events = Vec::new();
    loop {
        match watcher.frame().await {
            (2, Response::Unwatched) => break,
            (1, other) => events.push(event(other)),
            other => panic!("unexpected {other:?}"),
        }
    }
    check_run(&events);
    assert_eq!(watcher.call(3, Request::Ping).await, Response::Pong);
    server.stop().await;
}

/// Outside test a32, F4: the event of a change this connection made itself must come before
/// the UNWATCHED pipelined right behind it, on the binary protocol and on the console.
#[tokio::test]
async fn an_own_change_pipelined_before_unwatch_is_reported_before_unwatched() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut raw = Raw::connect(server.addr).await.0;
    let mut batch = bytes::BytesMut::new();
    for (id, request) in [
        (1, watch("p")),
        (2, acquire("p", 5_000, 0, "")),
        (3, Request::Unwatch { key: bytes("p") }),
    ] {
        tenure_protocol::frame::encode_request(id, &request, &mut batch);
    }
    raw.send_bytes(&batch).await;
    let mut seen = Vec::new();
    loop {
        match raw.frame().await {
            (3, Response::Unwatched) => break,
            (1, Response::Watching { holder: None }) => seen.push("watching".to_string()),
            (2, response) => seen.push(format!("granted {}", granted(response).0)),
            (1, other) => seen.push(format!("event {:?}", event(other))),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        seen,
        ["watching", "granted 1", "event (Granted, 1)"],
        "the grant's event is missing or out of place"
    );
    let mut console = Console::connect(server.addr).await;
    console.send("WATCH q\nACQUIRE q 5000\nUNWATCH q\n").await;
    assert_eq!(console.line().await, "OK watching FREE");
    assert!(console.line().await.starts_with("OK token=2 "));
    assert!(console
        .line()
        .await
        .starts_with("EVENT GRANTED key=q token=2"));
    assert_eq!(console.line().await, "OK");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_taken_back_after_a_failed_sync_shows_as_granted_again() {
    use tenure_server::wal::FaultPlan;
    let dir = tempfile::tempdir().unwrap();
    let (config, faults, storage) = tenure_testkit::server::faulty_storage(dir.path());
    let server = Server::start_with_storage(config, storage).await;
    let addr = server.addr;
    let mut watcher = Raw::connect(addr).await.0;
    assert!(matches!(
        watcher.call(1, watch("k")).await,
        Response::Watching { holder: None }
    ));
    let mut holder = Raw::connect(addr).await.0;
    let (token, lease_id) = granted(holder.call(1, acquire("k", 30_000, 0, "m")).await);
    assert_eq!(event(watcher.frame().await.1), (EventKind::Granted, token));
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
    assert_eq!(event(watcher.frame().await.1), (EventKind::Released, token));
    match watcher.frame().await.1 {
        Response::Event {
            kind: EventKind::Granted,
            token: t,
            meta,
            ..
        } => assert_eq!((t, &meta[..]), (token, &b"m"[..])),
        other => panic!("expected the lease back, got {other:?}"),
    }
    match holder
        .call(
            3,
            Request::Inspect {
                key: bytes("k"),
                kinds: Default::default(),
            },
        )
        .await
    {
        Response::Held { token: t, .. } => assert_eq!(t, token),
        other => panic!("{other:?}"),
    }
    let stopped = server.stop_result().await;
    assert!(stopped.is_err(), "the final sync must report the failure");
}

#[tokio::test]
async fn a_repeated_watch_sends_every_earlier_event_before_its_reply() {
    let dir = tempfile::tempdir().unwrap();
    // Many events still wait in the server when the second WATCH arrives.
    let Flood {
        server,
        mut watcher,
        hot,
        last,
        ..
    } = flood(dir.path(), 100_000).await;
    watcher.send(2, &watch(&hot)).await;
    let mut events = Vec::new();
    loop {
        match watcher.frame().await {
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

/// Polls INSPECT until `key` has `waiters` waiters in line.
async fn until_waiters(c: &mut Console, key: &str, waiters: usize) {
    let want = format!("waiters={waiters}");
    for _ in 0..500 {
        if c.cmd(&format!("INSPECT {key}")).await.contains(&want) {
            return;
        }
        // Real time, polling until the server has read the waiter (no lease runs out here).
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key} never had {waiters} waiters");
}

/// One release that hands a key to several waiters at once (read leases behind a plain
/// lock, permits behind a full semaphore) shows as RELEASED, then one GRANTED per waiter in
/// the order they were granted, the head of the line first (PROTOCOL.md 3.4: a key's events
/// arrive in the order its changes happened).
#[tokio::test]
async fn a_hand_off_to_several_waiters_shows_their_grants_in_grant_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    for (key, hold, wait) in [("rw", "", "SHARED"), ("sem", "PERMITS=4/4", "PERMITS=1/4")] {
        let mut watcher = Console::connect(server.addr).await;
        assert_eq!(
            watcher.cmd(&format!("WATCH {key}")).await,
            "OK watching FREE"
        );
        let mut holder = Console::connect(server.addr).await;
        let held = holder.cmd(&format!("ACQUIRE {key} 30000 {hold}")).await;
        assert!(held.starts_with("OK token="), "{held}");
        let mut waiters = Vec::new();
        for n in 1..=4 {
            let mut waiter = Console::connect(server.addr).await;
            waiter
                .send(&format!("ACQUIRE {key} 30000 20000 {wait}\n"))
                .await;
            until_waiters(&mut holder, key, n).await;
            waiters.push(waiter);
        }
        let lease = tenure_testkit::field(&held, "lease").to_string();
        assert_eq!(holder.cmd(&format!("RELEASE {key} {lease}")).await, "OK");
        let mut granted = Vec::new();
        for waiter in &mut waiters {
            let reply = waiter.line().await;
            granted.push(tenure_testkit::token(&reply));
        }
        let t0 = tenure_testkit::token(&held);
        assert!(granted.windows(2).all(|w| w[0] < w[1]), "FIFO: {granted:?}");
        let mut events = Vec::new();
        for _ in 0..6 {
            events.push(watcher.line().await);
        }
        let mut want = vec![
            format!("EVENT GRANTED key={key} token={t0}"),
            format!("EVENT RELEASED key={key} token={t0}"),
        ];
        want.extend(
            granted
                .iter()
                .map(|t| format!("EVENT GRANTED key={key} token={t}")),
        );
        assert_eq!(events, want);
    }
    server.stop().await;
}
