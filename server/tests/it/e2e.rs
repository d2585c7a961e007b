//! End-to-end tests over real TCP on port 0: the console, the binary protocol, and restarts of
//! the real `tenured` binary after `kill -9`.

use std::process::Command;
use std::time::Duration;

use bytes::BytesMut;
use tenure_protocol::frame::encode_request;
use tenure_protocol::handshake::VERSION;
use tenure_protocol::{ErrorCode, Request, Response};
use tenure_server::Config;
use tenure_testkit::raw::{acquire, granted, release};
use tenure_testkit::{field, free_port, token, Console, Raw, Server};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::tenured;

#[tokio::test]
async fn console_speaks_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    assert_eq!(c.cmd("PING").await, "PONG");
    assert_eq!(c.cmd("ping").await, "PONG");
    let granted = c.cmd("ACQUIRE order:1842 30000").await;
    assert!(granted.starts_with("OK token="), "{granted}");
    assert_eq!(field(&granted, "ttl_ms"), "30000");
    let lease = field(&granted, "lease").to_string();
    assert_eq!(lease.len(), 32);
    let t = token(&granted);

    let locked = c.cmd("ACQUIRE order:1842 30000").await;
    assert!(locked.starts_with("LOCKED token="), "{locked}");
    assert_eq!(token(&locked), t);
    let held = c.cmd("INSPECT order:1842").await;
    assert!(
        held.starts_with(&format!("HELD token={t} ttl_ms=")),
        "{held}"
    );
    assert_eq!(field(&held, "waiters"), "0");
    assert_eq!(c.cmd(&format!("CHECK order:1842 {t}")).await, "CURRENT");
    assert_eq!(c.cmd(&format!("CHECK order:1842 {}", t - 1)).await, "STALE");
    assert_eq!(
        c.cmd(&format!("RENEW order:1842 {lease} 5000")).await,
        "OK ttl_ms=5000"
    );
    let wrong = "0".repeat(32);
    assert_eq!(
        c.cmd(&format!("RENEW order:1842 {wrong} 5000")).await,
        "LOST"
    );
    assert_eq!(
        c.cmd(&format!("RELEASE order:1842 {wrong}")).await,
        "NOT_OWNER"
    );
    assert_eq!(c.cmd(&format!("RELEASE order:1842 {lease}")).await, "OK");
    assert_eq!(
        c.cmd(&format!("RELEASE order:1842 {lease}")).await,
        "NOT_OWNER"
    );
    assert_eq!(
        c.cmd(&format!("RENEW order:1842 {lease} 5000")).await,
        "LOST"
    );
    assert_eq!(c.cmd("INSPECT order:1842").await, "FREE");
    assert_eq!(c.cmd(&format!("CHECK order:1842 {t}")).await, "STALE");

    let again = c.cmd("ACQUIRE order:1842 30000").await;
    assert!(token(&again) > t, "tokens strictly increase per key");

    let stats = c.cmd("STATS").await;
    assert!(
        stats.starts_with("OK held=1 waiters=0 connections=1"),
        "{stats}"
    );
    assert!(c.cmd("HELP").await.contains("ACQUIRE <key> <ttl_ms>"));
    assert!(c.cmd("FROB").await.starts_with("ERR UNKNOWN_COMMAND "));
    assert!(c.cmd("ACQUIRE k").await.starts_with("ERR BAD_ARGS "));
    assert_eq!(
        c.cmd("ACQUIRE k 1").await,
        "ERR BAD_TTL ttl_ms 1 under the shortest lease, 10"
    );
    // Over the wire format's range or only over this server's (`--ttl-max-ms`, 3 600 000
    // by default): either way the one bound named is the server's.
    for ttl in ["99999999", "5000000"] {
        assert_eq!(
            c.cmd(&format!("ACQUIRE k {ttl}")).await,
            format!("ERR BAD_TTL ttl_ms {ttl} over this server's limit of 3600000")
        );
    }
    assert_eq!(
        c.cmd("SESSION_OPEN 99999999").await,
        "ERR BAD_TTL ttl_ms 99999999 over this server's limit of 3600000"
    );
    assert_eq!(c.cmd("QUIT").await, "BYE");
    let mut rest = String::new();
    assert_eq!(
        c.reader().read_line(&mut rest).await.unwrap(),
        0,
        "closed after BYE"
    );
    server.stop().await;
}

#[tokio::test]
async fn console_answers_pipelined_lines_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let mut batch = String::new();
    for i in 0..500 {
        batch.push_str(&format!(
            "ACQUIRE key:{i} 30000\r\nINSPECT key:{i}\nPING\n\n"
        ));
    }
    c.send(&batch).await;
    for i in 0..500 {
        let granted = c.line().await;
        assert!(granted.starts_with("OK token="), "line {i}: {granted}");
        let held = c.line().await;
        assert_eq!(
            held,
            format!(
                "HELD token={} ttl_ms={} waiters=0",
                token(&granted),
                field(&held, "ttl_ms")
            )
        );
        assert_eq!(c.line().await, "PONG");
    }
    server.stop().await;
}

/// `PING` padded with spaces to `len` bytes of content.
fn padded_ping(len: usize) -> String {
    format!("PING{}", " ".repeat(len - 4))
}

/// Reads until the server closes; panics if it does not within a few seconds.
async fn assert_closed(c: &mut Console) {
    let mut rest = String::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), c.reader().read_line(&mut rest))
        .await
        .expect("not closed in time");
    assert!(matches!(closed, Ok(0) | Err(_)), "{rest:?}");
}

/// The console's line limit counts the content, not its `\n` or `\r\n`: 4096 bytes are
/// served with either end (as the opening line and as a later one, and with the `\r` and
/// the `\n` arriving apart), 4097 are `LINE_TOO_LONG` with either.
#[tokio::test]
async fn console_line_limit_counts_content_without_its_line_end() {
    use tenure_protocol::limits::LINE_LEN_MAX;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    for end in ["\n", "\r\n"] {
        let mut c = Console::connect(server.addr).await;
        for _ in 0..2 {
            c.send(&format!("{}{end}", padded_ping(LINE_LEN_MAX))).await;
            assert_eq!(c.line().await, "PONG", "{end:?}");
        }
        c.send(&format!("{}\r", padded_ping(LINE_LEN_MAX))).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.send("\n").await;
        assert_eq!(c.line().await, "PONG", "a \\r\\n arriving in two parts");
        c.send(&format!("{}{end}", padded_ping(LINE_LEN_MAX + 1)))
            .await;
        let reply = c.line().await;
        assert!(reply.starts_with("ERR LINE_TOO_LONG "), "{end:?}: {reply}");
        assert_closed(&mut c).await;
        // One byte over as the opening line, too.
        let mut c = Console::connect(server.addr).await;
        c.send(&format!("{}{end}", padded_ping(LINE_LEN_MAX + 1)))
            .await;
        let reply = c.line().await;
        assert!(reply.starts_with("ERR LINE_TOO_LONG "), "{end:?}: {reply}");
        assert_closed(&mut c).await;
    }
    server.stop().await;
}

/// PROTOCOL.md 4: a line of white space only is blank (no reply), as the opening and
/// later; `\xNN` typed in a key or metadata is not unescaped; a lease id may be typed in
/// capitals.
#[tokio::test]
async fn console_blank_lines_escapes_and_lease_case() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    c.send(" \t \x0c \r\n\n   \n").await;
    assert_eq!(c.cmd("PING").await, "PONG", "white space got a reply");
    c.send("\t\t\n \r\n").await;
    assert_eq!(c.cmd("ping").await, "PONG", "white space got a reply");
    let granted = c.cmd(r"ACQUIRE a\x41 30000 0 META=\x41").await;
    let held = c.cmd(r"INSPECT a\x41").await;
    assert!(held.ends_with(r" meta=\x5cx41"), "{held}");
    assert_eq!(c.cmd("INSPECT aA").await, "FREE", "input is not unescaped");
    let lease = field(&granted, "lease").to_ascii_uppercase();
    assert_eq!(c.cmd(&format!(r"RELEASE a\x41 {lease}")).await, "OK");
    server.stop().await;
}

/// STATS `errors` counts what PROTOCOL.md 3.3 lists: BAD_ARGS to AUTH (without identities,
/// and on a connection already authenticated), a CLUSTER request's UNKNOWN_COMMAND and the
/// LINE_TOO_LONG that closes a connection; not refusals by identity.
#[tokio::test]
async fn stats_errors_counts_what_protocol_md_lists() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let errors =
        async |c: &mut Console| -> u64 { field(&c.cmd("STATS").await, "errors").parse().unwrap() };
    let before = errors(&mut c).await;
    assert!(c
        .cmd("AUTH someone secret")
        .await
        .starts_with("ERR BAD_ARGS "));
    assert_eq!(errors(&mut c).await, before + 1, "BAD_ARGS to AUTH");
    assert!(c
        .cmd("CLUSTER STATUS")
        .await
        .starts_with("ERR UNKNOWN_COMMAND "));
    assert_eq!(
        errors(&mut c).await,
        before + 2,
        "CLUSTER's UNKNOWN_COMMAND"
    );
    let mut long = Console::connect(server.addr).await;
    long.send(&format!("{}\n", padded_ping(5000))).await;
    assert!(long.line().await.starts_with("ERR LINE_TOO_LONG "));
    assert_closed(&mut long).await;
    assert_eq!(errors(&mut c).await, before + 3, "LINE_TOO_LONG");
    server.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let identities = crate::auth::identities_file(dir.path());
    let server = Server::start_in(dir.path(), |config| config.identities = Some(identities)).await;
    let mut c = Console::connect(server.addr).await;
    assert!(c
        .cmd("INSPECT orders/1")
        .await
        .starts_with("ERR UNAUTHENTICATED "));
    assert_eq!(
        c.cmd("AUTH admin admin-secret").await,
        "OK authenticated admin"
    );
    let before = errors(&mut c).await;
    assert!(c
        .cmd("AUTH admin admin-secret")
        .await
        .starts_with("ERR BAD_ARGS "));
    assert_eq!(
        errors(&mut c).await,
        before + 1,
        "BAD_ARGS to a second AUTH"
    );
    assert_eq!(before, 0, "UNAUTHENTICATED is not counted");
    server.stop().await;
}

#[tokio::test]
async fn over_long_console_line_is_refused_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut bystander = Console::connect(server.addr).await;
    let mine = bystander.cmd("ACQUIRE mine 30000").await;
    let mut c = Console::connect(server.addr).await;
    // Far more than the line limit, with no newline: the server must not buffer it all.
    let junk = vec![b'x'; 1 << 20];
    let _ = c.writer().write_all(&junk).await;
    let reply = c.line().await;
    assert!(reply.starts_with("ERR LINE_TOO_LONG "), "{reply}");
    let mut rest = String::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), c.reader().read_line(&mut rest))
        .await
        .unwrap();
    assert!(matches!(closed, Ok(0) | Err(_)));
    // The bystander's lock and connection are untouched.
    let held = bystander.cmd("INSPECT mine").await;
    assert!(
        held.starts_with(&format!("HELD token={} ", token(&mine))),
        "{held}"
    );
    assert!(held.ends_with(" waiters=0"), "{held}");
    assert_eq!(bystander.cmd("PING").await, "PONG");
    server.stop().await;
}

#[tokio::test]
async fn binary_pipelines_and_answers_blocking_acquires_out_of_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let (mut a, ack) = Raw::connect(server.addr).await;
    assert_eq!(ack.version, VERSION);
    let (t1, lease) = granted(a.call(1, acquire("hot", 30_000, 0)).await);

    // Three waiters on three connections, queued in a known order.
    let mut waiters = Vec::new();
    for i in 0..3u64 {
        let (mut w, _) = Raw::connect(server.addr).await;
        w.send(100 + i, &acquire("hot", 30_000, 10_000)).await;
        // A PING behind the blocking acquire is answered first: replies are out of order.
        assert_eq!(w.call(200 + i, Request::Ping).await, Response::Pong);
        waiters.push(w);
    }
    match a
        .call(
            2,
            Request::Inspect {
                key: "hot".into(),
                kinds: Default::default(),
            },
        )
        .await
    {
        Response::Held { waiters, token, .. } => assert_eq!((waiters, token), (3, t1)),
        other => panic!("{other:?}"),
    }
    // Each release hands the lock straight to the next waiter, first in first out.
    let mut last = t1;
    let mut lease = lease;
    assert_eq!(a.call(3, release("hot", lease)).await, Response::Released);
    for (i, w) in waiters.iter_mut().enumerate() {
        let (id, response) = w.recv().await.unwrap();
        assert_eq!(id, 100 + i as u64);
        let (t, l) = granted(response);
        assert!(t > last);
        last = t;
        lease = l;
        assert_eq!(w.call(300, release("hot", lease)).await, Response::Released);
    }
    // Many requests in flight on one connection, answered by id (0 is reserved).
    let mut batch = BytesMut::new();
    for id in 1..=1000u64 {
        encode_request(
            id,
            &Request::Check {
                key: "hot".into(),
                token: last,
            },
            &mut batch,
        );
    }
    a.stream().write_all(&batch).await.unwrap();
    for id in 1..=1000u64 {
        assert_eq!(a.recv().await.unwrap(), (id, Response::Stale));
    }
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn waiter_that_disconnects_or_times_out_leaves_the_queue() {
    let server = Server::start_virtual().await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let (t1, lease) = granted(a.call(1, acquire("q", 30_000, 0)).await);
    let (mut gone, _) = Raw::connect(server.addr).await;
    gone.send(1, &acquire("q", 30_000, 60_000)).await;
    let (mut timed, _) = Raw::connect(server.addr).await;
    let started = Instant::now();
    timed.send(1, &acquire("q", 30_000, 150)).await;
    let (mut patient, _) = Raw::connect(server.addr).await;
    patient.send(1, &acquire("q", 30_000, 60_000)).await;
    // The short wait runs out: LOCKED with the holder's token.
    match timed.recv().await.unwrap().1 {
        Response::Locked { token, .. } => assert_eq!(token, t1),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(150));
    drop(gone);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Response::Held { waiters: 1, .. } = a
            .call(
                2,
                Request::Inspect {
                    key: "q".into(),
                    kinds: Default::default(),
                },
            )
            .await
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "disconnected waiter never left the queue"
        );
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(a.call(3, release("q", lease)).await, Response::Released);
    let (t2, _) = granted(patient.recv().await.unwrap().1);
    assert!(t2 > t1);
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn expiry_frees_the_lock_and_hands_it_to_the_next_waiter() {
    let server = Server::start_virtual().await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let sent_at = Instant::now();
    let (t1, lease) = granted(a.call(1, acquire("e", 100, 0)).await);
    let (mut b, _) = Raw::connect(server.addr).await;
    let (t2, _) = granted(b.call(1, acquire("e", 30_000, 5_000)).await);
    assert!(t2 > t1);
    // Virtual time: handed over when the 100 ms ran out, within a tick of the expiry ticker
    // and a hop or two over loopback (2 ms each), never before.
    let held = sent_at.elapsed();
    assert!(
        held >= Duration::from_millis(100),
        "granted early: {held:?}"
    );
    assert!(held <= Duration::from_millis(110), "hand-off took {held:?}");
    assert_eq!(
        a.call(
            2,
            Request::Renew {
                key: "e".into(),
                lease_id: lease,
                ttl_ms: 1000
            }
        )
        .await,
        Response::Lost
    );
    assert_eq!(
        a.call(
            3,
            Request::Check {
                key: "e".into(),
                token: t1
            }
        )
        .await,
        Response::Stale
    );
    server.stop().await;
}

#[tokio::test]
async fn garbage_and_oversized_frames_close_only_that_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let (mut good, _) = Raw::connect(server.addr).await;
    let (t, _) = granted(good.call(1, acquire("safe", 30_000, 0)).await);

    // A well-framed but malformed body: an error reply, and the connection goes on.
    let (mut bad, _) = Raw::connect(server.addr).await;
    let mut frame = BytesMut::new();
    frame.extend_from_slice(&10u32.to_be_bytes());
    frame.extend_from_slice(&[0x02]);
    frame.extend_from_slice(&7u64.to_be_bytes());
    frame.extend_from_slice(&[0xff]);
    bad.stream().write_all(&frame).await.unwrap();
    match bad.recv().await.unwrap() {
        (7, Response::Error { code, .. }) => assert_eq!(code, ErrorCode::BadFrame),
        other => panic!("{other:?}"),
    }
    assert_eq!(bad.call(8, Request::Ping).await, Response::Pong);
    // An over-long length prefix: an error, then the connection closes.
    bad.stream()
        .write_all(&u32::MAX.to_be_bytes())
        .await
        .unwrap();
    match bad.recv().await.unwrap() {
        (_, Response::Error { code, .. }) => assert_eq!(code, ErrorCode::FrameTooLarge),
        other => panic!("{other:?}"),
    }
    assert!(
        bad.recv().await.is_none(),
        "connection should close after a broken frame"
    );

    // Unknown opcode: error, connection stays.
    let (mut odd, _) = Raw::connect(server.addr).await;
    let mut frame = BytesMut::new();
    frame.extend_from_slice(&9u32.to_be_bytes());
    frame.extend_from_slice(&[0x55]);
    frame.extend_from_slice(&3u64.to_be_bytes());
    odd.stream().write_all(&frame).await.unwrap();
    assert!(matches!(
        odd.recv().await.unwrap(),
        (
            3,
            Response::Error {
                code: ErrorCode::UnknownOpcode,
                ..
            }
        )
    ));

    // The well-behaved client's lock is untouched.
    assert_eq!(
        good.call(
            2,
            Request::Check {
                key: "safe".into(),
                token: t
            }
        )
        .await,
        Response::Current
    );
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn watch_reports_grants_releases_and_expiries() {
    let server = Server::start_virtual().await;
    let mut watcher = Console::connect(server.addr).await;
    assert_eq!(watcher.cmd("WATCH w").await, "OK watching FREE");
    let mut c = Console::connect(server.addr).await;
    let g = c.cmd("ACQUIRE w 30000 META=leader-1").await;
    assert_eq!(
        watcher.line().await,
        format!("EVENT GRANTED key=w token={} meta=leader-1", token(&g))
    );
    assert!(c.cmd("INSPECT w").await.ends_with("meta=leader-1"));
    assert_eq!(
        c.cmd(&format!("RELEASE w {}", field(&g, "lease"))).await,
        "OK"
    );
    assert_eq!(
        watcher.line().await,
        format!("EVENT RELEASED key=w token={}", token(&g))
    );
    let g2 = c.cmd("ACQUIRE w 50").await;
    assert_eq!(
        watcher.line().await,
        format!("EVENT GRANTED key=w token={}", token(&g2))
    );
    assert_eq!(
        watcher.line().await,
        format!("EVENT EXPIRED key=w token={}", token(&g2))
    );
    assert_eq!(watcher.cmd("UNWATCH w").await, "OK");
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn release_on_disconnect_frees_the_lock_for_the_next_waiter() {
    let server = Server::start_virtual().await;
    let mut leader = Console::connect(server.addr).await;
    let g = leader.cmd("ACQUIRE lead 30000 RELEASE_ON_DISCONNECT").await;
    let mut next = Console::connect(server.addr).await;
    // The PING behind the blocking acquire is answered after it: console replies keep order.
    next.send("ACQUIRE lead 30000 20000\nPING\n").await;
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dropped = Instant::now();
    drop(leader);
    let g2 = next.line().await;
    assert!(token(&g2) > token(&g), "{g2}");
    assert_eq!(next.line().await, "PONG");
    assert!(
        dropped.elapsed() < Duration::from_secs(2),
        "took {:?}",
        dropped.elapsed()
    );
    server.stop().await;
}

#[tokio::test]
async fn held_locks_and_tokens_survive_an_in_process_restart() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let kept = c.cmd("ACQUIRE kept 30000 META=10.0.0.7:8080").await;
    let gone = c.cmd("ACQUIRE gone 30000").await;
    assert_eq!(
        c.cmd(&format!("RELEASE gone {}", field(&gone, "lease")))
            .await,
        "OK"
    );
    drop(c);
    server.stop().await;

    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let held = c.cmd("INSPECT kept").await;
    assert!(
        held.starts_with(&format!("HELD token={} ", token(&kept))),
        "{held}"
    );
    assert!(
        held.ends_with(" meta=10.0.0.7:8080"),
        "metadata survives a restart: {held}"
    );
    assert_eq!(c.cmd("INSPECT gone").await, "FREE");
    assert_eq!(
        c.cmd(&format!("RENEW kept {} 30000", field(&kept, "lease")))
            .await,
        "OK ttl_ms=30000"
    );
    assert!(c.cmd("ACQUIRE kept 30000").await.starts_with("LOCKED "));
    let fresh = c.cmd("ACQUIRE gone 30000").await;
    assert!(token(&fresh) > token(&gone).max(token(&kept)));
    server.stop().await;
}

// ----- the real binary, killed with SIGKILL -----

#[tokio::test]
async fn tokens_never_reused_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut highest_seen = 0u64;
    let mut kept: Option<(String, u64)> = None;
    for round in 0..4 {
        let mut daemon = tenured(dir.path(), &[]);
        let mut c = Console::connect(daemon.addr).await;
        if let Some((lease, t)) = &kept {
            // The lock granted before the crash is still held, by the same lease.
            assert!(
                c.cmd("INSPECT kept")
                    .await
                    .starts_with(&format!("HELD token={t} ")),
                "round {round}"
            );
            assert_eq!(
                c.cmd(&format!("RENEW kept {lease} 60000")).await,
                "OK ttl_ms=60000"
            );
        } else {
            let g = c.cmd("ACQUIRE kept 60000").await;
            kept = Some((field(&g, "lease").to_string(), token(&g)));
            highest_seen = highest_seen.max(token(&g));
        }
        // Pipeline a burst of grants and releases, then crash mid-stream.
        let mut batch = String::new();
        for i in 0..200 {
            batch.push_str(&format!("ACQUIRE r{round}k{i} 60000\n"));
        }
        c.send(&batch).await;
        for _ in 0..200 {
            let g = c.line().await;
            let t = token(&g);
            assert!(
                t > highest_seen,
                "round {round}: token {t} not above {highest_seen}"
            );
            highest_seen = t;
        }
        c.send(&batch).await; // in flight when the server dies
        daemon.kill9();
    }
    let daemon = tenured(dir.path(), &[]);
    let mut c = Console::connect(daemon.addr).await;
    assert!(token(&c.cmd("ACQUIRE after 1000").await) > highest_seen);
}

#[tokio::test]
async fn torn_tail_recovers_and_corruption_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    {
        let daemon = tenured(dir.path(), &[]);
        let mut c = Console::connect(daemon.addr).await;
        for i in 0..50 {
            assert!(c
                .cmd(&format!("ACQUIRE k{i} 60000"))
                .await
                .starts_with("OK "));
        }
    }
    let segment = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .max()
        .expect("a WAL segment");
    // A torn tail: half a record appended, as a crash mid-write leaves it.
    let mut bytes = std::fs::read(&segment).unwrap();
    let good_len = bytes.len();
    bytes.extend_from_slice(&[0, 0, 0, 40, 1, 2, 3]);
    std::fs::write(&segment, &bytes).unwrap();
    {
        let daemon = tenured(dir.path(), &[]);
        let mut c = Console::connect(daemon.addr).await;
        assert!(
            c.cmd("INSPECT k49").await.starts_with("HELD "),
            "recovered past the torn tail"
        );
    }
    // Corruption in the middle: flip a byte well inside the first segment.
    let first = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .min()
        .unwrap();
    let mut bytes = std::fs::read(&first).unwrap();
    let middle = good_len.min(bytes.len()) / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&first, &bytes).unwrap();
    let out = Command::new(crate::tenured_bin())
        .args([
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--data-dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "must refuse to start on a corrupt WAL"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = first.file_name().unwrap().to_string_lossy();
    assert!(
        stderr.contains("corrupt") && stderr.contains(&*name) && stderr.contains("offset"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_second_server_on_the_same_data_dir_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let first = Server::start(dir.path()).await;
    assert_eq!(
        Console::connect(first.addr).await.cmd("PING").await,
        "PONG",
        "first server is up"
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = tenure_server::run(Config::for_tests(dir.path()), listener, async {})
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("in use by another tenured"),
        "{err:#}"
    );
    first.stop().await;
}

/// Disk use follows the live locks, not history: segments rotate, snapshots let old ones go,
/// and a restart after that brings back exactly the live locks.
#[tokio::test]
async fn snapshots_bound_the_wal_and_restart_recovers_the_live_locks() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        wal_segment_bytes_max: 64 * 1024,
        ..Config::for_tests(dir.path())
    };
    // A background snapshot may delete a segment between the listing and its metadata: a
    // file gone by then counts as nothing.
    let wal_bytes = || -> u64 {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum()
    };
    let server = Server::start_with(config.clone()).await;
    let mut c = Console::connect(server.addr).await;
    let mut kept = Vec::new();
    for i in 0..50 {
        let g = c.cmd(&format!("ACQUIRE live:{i} 60000")).await;
        kept.push((format!("live:{i}"), token(&g)));
    }
    // About 8 MB of grants and releases on other keys: far more history than live state.
    let mut written_bytes = 0;
    for round in 0..100 {
        let mut batch = String::new();
        for i in 0..500 {
            batch.push_str(&format!("ACQUIRE churn:{round}:{i} 60000\n"));
        }
        c.send(&batch).await;
        let mut releases = String::new();
        for i in 0..500 {
            let g = c.line().await;
            releases.push_str(&format!(
                "RELEASE churn:{round}:{i} {}\n",
                field(&g, "lease")
            ));
        }
        c.send(&releases).await;
        for _ in 0..500 {
            assert_eq!(c.line().await, "OK");
        }
        written_bytes += 500 * 160;
    }
    // Snapshots run in the background; give them a moment to finish and delete. Real time:
    // the snapshot and the WAL's syncer run on threads of their own, on real disk I/O.
    let deadline = Instant::now() + Duration::from_secs(10);
    while wal_bytes() > 1024 * 1024 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let on_disk = wal_bytes();
    assert!(
        on_disk < 1024 * 1024,
        "WAL holds {on_disk} bytes after ~{written_bytes} bytes of history"
    );
    drop(c);
    server.stop().await;

    let server = Server::start_with(config).await;
    let mut c = Console::connect(server.addr).await;
    for (key, t) in &kept {
        assert!(
            c.cmd(&format!("INSPECT {key}"))
                .await
                .starts_with(&format!("HELD token={t} ")),
            "{key}"
        );
    }
    assert_eq!(c.cmd("INSPECT churn:99:499").await, "FREE");
    let stats = c.cmd("STATS").await;
    assert_eq!(field(&stats, "held"), "50", "{stats}");
    server.stop().await;
}

/// Restarts of the snapshot test below: each stops the server while a snapshot is likely
/// still copying.
const SNAPSHOT_RESTARTS: usize = 12;

/// `run` returns only once a snapshot in progress has finished, so the data directory is
/// free at once and a server started on it in the same process starts (a snapshot still
/// copying on its blocking thread used to keep the directory locked: `DataDirInUse`).
#[tokio::test]
async fn a_restart_right_after_a_snapshot_began_finds_the_data_directory_free() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        wal_segment_bytes_max: 64 * 1024,
        fsync: true, // every shard of a snapshot waits for a sync: the copy takes a while
        ..Config::for_tests(dir.path())
    };
    for round in 0..=SNAPSHOT_RESTARTS {
        let server = Server::start_with(config.clone()).await;
        if let Err(e) = tokio::net::TcpStream::connect(server.addr).await {
            panic!("start {round}: {e}: {:?}", server.stop_result().await);
        }
        let mut c = Console::connect(server.addr).await;
        // Live locks for the snapshot to copy (they come back at every restart).
        if round == 0 {
            let mut held = String::new();
            for i in 0..5_000 {
                held.push_str(&format!("ACQUIRE live:{i} 600000\n"));
            }
            c.send(&held).await;
            for _ in 0..5_000 {
                assert!(c.line().await.starts_with("OK "));
            }
        }
        // Grants and releases of other keys until the log outgrows the live state.
        let mut batch = String::new();
        for i in 0..2_000 {
            batch.push_str(&format!("ACQUIRE churn:{round}:{i} 60000\n"));
        }
        c.send(&batch).await;
        let mut releases = String::new();
        for i in 0..2_000 {
            let g = c.line().await;
            releases.push_str(&format!(
                "RELEASE churn:{round}:{i} {}\n",
                field(&g, "lease")
            ));
        }
        c.send(&releases).await;
        for _ in 0..2_000 {
            assert_eq!(c.line().await, "OK");
        }
        drop(c);
        server.stop().await;
    }
}

#[tokio::test(start_paused = true)]
async fn limits_answer_that_client_with_a_clear_error() {
    let server = Server::start_virtual_with(|config| {
        config.connections_max = 2;
        config.held_max = 1; // one shard below makes this exact
        config.shards = 1;
        config.waiters_max = 1;
        config.waiters_per_key_max = 1;
    })
    .await;
    let mut a = Console::connect(server.addr).await;
    assert!(a.cmd("ACQUIRE one 30000").await.starts_with("OK "));
    let full = a.cmd("ACQUIRE two 30000").await;
    assert!(full.starts_with("ERR HELD_LIMIT "), "{full}");
    // One waiter fits; a second is refused, on its own connection only.
    let mut w1 = Console::connect(server.addr).await;
    w1.send("ACQUIRE one 30000 10000\n").await;
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refused = a.cmd("ACQUIRE one 30000 10000").await;
    assert!(refused.starts_with("ERR WAITERS_LIMIT "), "{refused}");
    // A third connection is told why and closed; the others go on.
    let mut extra = Console::connect(server.addr).await;
    let line = extra.line().await;
    assert!(line.starts_with("ERR CONNECTIONS_LIMIT "), "{line}");
    assert_eq!(a.cmd("PING").await, "PONG");
    let stats = a.cmd("STATS").await;
    assert_eq!(field(&stats, "connections_refused"), "1", "{stats}");
    drop(w1);
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn token_only_durability_refuses_grants_until_old_leases_ran_out() {
    let dir = tempfile::tempdir().unwrap();
    let config = |config: &mut Config| {
        assert_eq!(config.durability, tenure_server::Durability::Tokens);
        config.ttl_ms_max = 400;
    };
    let server = Server::start_virtual_at(dir.path(), config).await;
    let mut c = Console::connect(server.addr).await;
    let before = token(&c.cmd("ACQUIRE k 400").await);
    drop(c);
    server.stop().await;

    let restarted = Instant::now();
    let server = Server::start_virtual_at(dir.path(), config).await;
    let mut c = Console::connect(server.addr).await;
    let refused = c.cmd("ACQUIRE other 400").await;
    assert!(refused.starts_with("ERR RECOVERING "), "{refused}");
    // Naming a session the server does not know: RECOVERING still comes first (3.7 step 7).
    let in_session = c
        .cmd("ACQUIRE other 0 SESSION=0123456789abcdef0123456789abcdef")
        .await;
    assert!(in_session.starts_with("ERR RECOVERING "), "{in_session}");
    // Sessions open, keep alive and close in the window (PROTOCOL.md 3.11); their ACQUIREs
    // are refused as any.
    let opened = c.cmd("SESSION_OPEN 400").await;
    let session = opened
        .strip_prefix("OK session=")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("{opened}"))
        .to_owned();
    let in_open = c.cmd(&format!("ACQUIRE other 0 SESSION={session}")).await;
    assert!(in_open.starts_with("ERR RECOVERING "), "{in_open}");
    let kept = c.cmd(&format!("SESSION_KEEPALIVE {session}")).await;
    assert!(kept.starts_with("OK session="), "{kept}");
    assert_eq!(
        c.cmd(&format!("SESSION_CLOSE {session}")).await,
        "OK released=0"
    );
    assert!(c.cmd("INSPECT other").await == "FREE");
    let granted = loop {
        let reply = c.cmd("ACQUIRE other 400").await;
        if reply.starts_with("OK ") {
            break reply;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(10),
            "never granted again: {reply}"
        );
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(
        restarted.elapsed() >= Duration::from_millis(400),
        "granted within the longest TTL"
    );
    assert!(token(&granted) > before, "tokens still never go back");
    server.stop().await;
}

#[tokio::test]
async fn sigterm_shuts_down_cleanly_and_keeps_held_locks() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = tenured(dir.path(), &[]);
    let mut c = Console::connect(daemon.addr).await;
    let g = c.cmd("ACQUIRE kept 60000").await;
    let exit = daemon.sigterm_and_wait();
    assert!(exit.success(), "clean shutdown exits 0: {exit:?}");
    let daemon = tenured(dir.path(), &[]);
    let mut c = Console::connect(daemon.addr).await;
    assert!(c
        .cmd("INSPECT kept")
        .await
        .starts_with(&format!("HELD token={} ", token(&g))));
}

// ---------------------------------------------------------------------------------------------
// GRANTED tells how long the acquire waited on the server, so a client can count the lease
// from the grant rather than from its send.

fn waited_ms(response: &Response) -> u32 {
    match response {
        Response::Granted { waited_ms, .. } => *waited_ms,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// Polls INSPECT until `key` has `count` waiters: the server has received their acquires.
async fn until_waiters(raw: &mut Raw, key: &str, count: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for id in 1000.. {
        let inspect = Request::Inspect {
            key: key.as_bytes().to_vec().into(),
            kinds: Default::default(),
        };
        if let Response::Held { waiters, .. } = raw.call(id, inspect).await {
            if waiters == count {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never had {count} waiters");
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn granted_carries_the_time_waited_on_the_server() {
    let server = Server::start_virtual().await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let first = a.call(1, acquire("w", 30_000, 0)).await;
    assert_eq!(
        waited_ms(&first),
        0,
        "an immediate grant waited for nothing"
    );
    let (_, lease) = granted(first);

    // Hand-off on release: the waiter is in line from its receipt until the release.
    let (mut b, _) = Raw::connect(server.addr).await;
    let sent_at = Instant::now();
    b.send(1, &acquire("w", 30_000, 10_000)).await;
    until_waiters(&mut a, "w", 1).await;
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(a.call(2, release("w", lease)).await, Response::Released);
    let (id, handed) = b.recv().await.expect("hand-off");
    let elapsed_ms = sent_at.elapsed().as_millis();
    assert_eq!(id, 1);
    let waited = u128::from(waited_ms(&handed));
    // At least the 400 ms since it was seen queued (less 1 ms of clock rounding); at most the
    // whole round trip (plus the same rounding).
    assert!(waited + 1 >= 400, "waited_ms {waited} < 400");
    assert!(
        waited <= elapsed_ms + 1,
        "waited_ms {waited} > {elapsed_ms} ms round trip"
    );

    // Hand-off on expiry: the holder's 300 ms lease runs out while the waiter is in line.
    let (mut c, _) = Raw::connect(server.addr).await;
    let (t1, _) = granted(c.call(1, acquire("x", 300, 0)).await);
    let (mut d, _) = Raw::connect(server.addr).await;
    let sent_at = Instant::now();
    let handed = d.call(1, acquire("x", 30_000, 10_000)).await;
    let elapsed_ms = sent_at.elapsed().as_millis();
    let waited = u128::from(waited_ms(&handed));
    assert!(granted(handed).0 > t1);
    assert!(
        waited >= 100,
        "waited_ms {waited}: counted from the hand-off?"
    );
    assert!(
        waited <= elapsed_ms + 1,
        "waited_ms {waited} > {elapsed_ms} ms round trip"
    );
    server.stop().await;
}

#[tokio::test(start_paused = true)]
async fn console_grants_end_with_waited_ms() {
    let server = Server::start_virtual().await;
    let mut a = Console::connect(server.addr).await;
    let first = a.cmd("ACQUIRE cw 30000").await;
    let words: Vec<&str> = first.split_whitespace().collect();
    assert_eq!(words.len(), 5, "{first}");
    assert_eq!(
        (words[0], words[3], words[4]),
        ("OK", "ttl_ms=30000", "waited_ms=0"),
        "{first}"
    );
    let mut b = Console::connect(server.addr).await;
    let sent_at = Instant::now();
    b.send("ACQUIRE cw 30000 10000\n").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.cmd("INSPECT cw").await.ends_with(" waiters=1") {
        assert!(Instant::now() < deadline, "the waiter never queued");
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lease = field(&first, "lease");
    assert_eq!(a.cmd(&format!("RELEASE cw {lease}")).await, "OK");
    let handed = b.line().await;
    let elapsed_ms = sent_at.elapsed().as_millis();
    assert!(handed.starts_with("OK token="), "{handed}");
    let last = handed.split_whitespace().last().unwrap();
    assert!(
        last.starts_with("waited_ms="),
        "waited_ms is the last field: {handed}"
    );
    let waited: u128 = field(&handed, "waited_ms").parse().unwrap();
    assert!(waited + 1 >= 300, "{handed}");
    assert!(
        waited <= elapsed_ms + 1,
        "{handed}: round trip {elapsed_ms} ms"
    );
    server.stop().await;
}
