//! Read/write locks and semaphores end to end (PROTOCOL.md 3.10): the console and the wire
//! against a real server, the FIFO rules across connections, and holders surviving a
//! `kill -9` and restart of the daemon.

use tenure_protocol::{AcquireId, EndedHow, LeaseId, LeaseKind, Request, Response};
use tenure_testkit::console::Console;
use tenure_testkit::daemon::{Daemon, Tenured};
use tenure_testkit::raw::{bytes, Raw};
use tenure_testkit::reply::field;
use tenure_testkit::Server;

use super::tenured_bin;

fn acquire(key: &str, wait_ms: u32, kind: LeaseKind) -> Request {
    acquire_with_id(key, wait_ms, kind, None)
}

fn acquire_with_id(
    key: &str,
    wait_ms: u32,
    kind: LeaseKind,
    acquire_id: Option<AcquireId>,
) -> Request {
    Request::Acquire {
        key: bytes(key),
        ttl_ms: 30_000,
        wait_ms,
        release_on_disconnect: false,
        meta: bytes(""),
        acquire_id,
        kind,
        session_id: None,
    }
}

fn regranted(response: Response) -> (u64, LeaseId) {
    match response {
        Response::Regranted {
            token, lease_id, ..
        } => (token, lease_id),
        other => panic!("expected REGRANTED, got {other:?}"),
    }
}

/// A repeat of an acquire id whose lease is a read lease is answered REGRANTED with that
/// lease among several readers, and ACQUIRE_ENDED once it was released; the same for a
/// permit lease, whose repeat is never a KIND_MISMATCH (PROTOCOL.md 3.9, "Read leases and
/// permits").
#[tokio::test]
async fn a_repeat_of_a_read_or_permit_lease_is_regranted_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let (mut b, _) = Raw::connect(server.addr).await;
    let id = Some(AcquireId::from_u128(0x5e11));
    let read = |id| acquire_with_id("doc", 0, LeaseKind::Shared, id);
    let (r1, r1_lease) = granted(a.call(1, read(id)).await);
    let (r2, _) = granted(a.call(2, read(None)).await);
    assert!(r2 > r1);
    // The repeat, on another connection, names the first reader, not the newest holder.
    assert_eq!(regranted(b.call(3, read(id)).await), (r1, r1_lease));
    // Another id on the same key is a new reader.
    let other = Some(AcquireId::from_u128(0x5e12));
    let (r3, _) = granted(b.call(4, read(other)).await);
    assert!(r3 > r2);
    let release = Request::Release {
        key: bytes("doc"),
        lease_id: r1_lease,
    };
    assert_eq!(a.call(5, release).await, Response::Released);
    assert_eq!(
        b.call(6, read(id)).await,
        Response::AcquireEnded {
            how: EndedHow::Released,
            token: r1
        }
    );

    let permits =
        |count, limit, id| acquire_with_id("pool", 0, LeaseKind::Permits { count, limit }, id);
    let pid = Some(AcquireId::from_u128(0x9001));
    let (p1, p1_lease) = granted(a.call(7, permits(2, 3, pid)).await);
    assert!(matches!(
        a.call(8, permits(2, 3, None)).await,
        Response::Locked { .. }
    ));
    assert_eq!(
        regranted(b.call(9, permits(2, 3, pid)).await),
        (p1, p1_lease)
    );
    // Answered by the lease, not compared: a repeat naming another limit is not refused.
    assert_eq!(
        regranted(b.call(10, permits(1, 5, pid)).await),
        (p1, p1_lease)
    );
    let inspect = Request::Inspect {
        key: bytes("pool"),
        kinds: true,
    };
    match a.call(11, inspect).await {
        Response::HeldKinds { kinds, .. } => {
            assert_eq!((kinds.holders, kinds.in_use), (1, 2), "{kinds:?}")
        }
        other => panic!("expected HELD_KINDS, got {other:?}"),
    }
    server.stop().await;
}

/// Two sends of one SHARED ACQUIRE queued behind a writer are served in one pass when the
/// writer leaves: one is granted, the other answered REGRANTED with that lease, and only
/// one read lease holds the key.
#[tokio::test]
async fn a_queued_repeat_of_a_read_lease_granted_in_the_same_pass_is_regranted() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let (mut b, _) = Raw::connect(server.addr).await;
    let (mut c, _) = Raw::connect(server.addr).await;
    let (mut d, _) = Raw::connect(server.addr).await;
    // A reader first, so the key is a read/write key, then the writer that holds it.
    let (_, r0_lease) = granted(a.call(1, acquire("doc", 0, LeaseKind::Shared)).await);
    a.send(2, &acquire("doc", 20_000, LeaseKind::Exclusive))
        .await;
    let release = |lease_id| Request::Release {
        key: bytes("doc"),
        lease_id,
    };
    assert_eq!(d.call(1, release(r0_lease)).await, Response::Released);
    let (id, writer) = a.frame().await;
    assert_eq!(id, 2);
    let (_, w_lease) = granted(writer);
    let acquire_id = Some(AcquireId::from_u128(0xab));
    let read = acquire_with_id("doc", 20_000, LeaseKind::Shared, acquire_id);
    b.send(10, &read).await;
    assert!(matches!(b.call(11, Request::Ping).await, Response::Pong));
    c.send(20, &read).await;
    assert!(matches!(c.call(21, Request::Ping).await, Response::Pong));
    assert_eq!(a.call(3, release(w_lease)).await, Response::Released);
    // Both are granted in one pass; whichever hand-off is made first holds, and the other
    // send hears REGRANTED with that same lease.
    let (id, b_answer) = b.frame().await;
    assert_eq!(id, 10);
    let (id, c_answer) = c.frame().await;
    assert_eq!(id, 20);
    let (granted_lease, repeat) = match (&b_answer, &c_answer) {
        (Response::Granted { .. }, _) => (granted(b_answer), regranted(c_answer)),
        _ => (granted(c_answer), regranted(b_answer)),
    };
    assert_eq!(repeat, granted_lease);
    let inspect = Request::Inspect {
        key: bytes("doc"),
        kinds: true,
    };
    match d.call(2, inspect).await {
        Response::HeldKinds { kinds, .. } => assert_eq!(kinds.holders, 1, "{kinds:?}"),
        other => panic!("expected HELD_KINDS, got {other:?}"),
    }
    server.stop().await;
}

fn granted(response: Response) -> (u64, LeaseId) {
    match response {
        Response::Granted {
            token, lease_id, ..
        } => (token, lease_id),
        other => panic!("expected GRANTED, got {other:?}"),
    }
}

#[tokio::test]
async fn a_semaphore_over_the_console_holds_its_limit_and_refuses_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let mut c = Console::connect(server.addr).await;
    let first = c.cmd("ACQUIRE pool 30000 PERMITS=2/3").await;
    assert!(first.starts_with("OK token="), "{first}");
    let second = c.cmd("ACQUIRE pool 30000 PERMITS=3").await;
    assert!(second.starts_with("OK token="), "{second}");
    assert!(c
        .cmd("ACQUIRE pool 30000 PERMITS=3")
        .await
        .starts_with("LOCKED "));
    let wrong = c.cmd("ACQUIRE pool 30000 PERMITS=4").await;
    assert!(wrong.starts_with("ERR KIND_MISMATCH "), "{wrong}");
    assert!(c
        .cmd("ACQUIRE pool 30000")
        .await
        .starts_with("ERR KIND_MISMATCH "));
    assert!(c
        .cmd("ACQUIRE pool 30000 SHARED")
        .await
        .starts_with("ERR KIND_MISMATCH "));
    assert!(c
        .cmd("ACQUIRE pool 30000 PERMITS=0")
        .await
        .starts_with("ERR BAD_PERMITS "));
    // Both permit tokens are current; a release frees its permits at once.
    let (t1, t2) = (field(&first, "token"), field(&second, "token"));
    assert_eq!(c.cmd(&format!("CHECK pool {t1}")).await, "CURRENT");
    assert_eq!(c.cmd(&format!("CHECK pool {t2}")).await, "CURRENT");
    let lease = field(&first, "lease").to_string();
    assert_eq!(c.cmd(&format!("RELEASE pool {lease}")).await, "OK");
    assert_eq!(c.cmd(&format!("CHECK pool {t1}")).await, "STALE");
    let third = c.cmd("ACQUIRE pool 30000 PERMITS=2/3").await;
    assert!(third.starts_with("OK token="), "{third}");
    let kinds = c.cmd("INSPECT pool KINDS").await;
    assert!(kinds.starts_with("HELD token="), "{kinds}");
    for (name, value) in [
        ("limit", "3"),
        ("holders", "2"),
        ("in_use", "3"),
        ("writer", "0"),
    ] {
        assert_eq!(field(&kinds, name), value, "{kinds}");
    }
    let plain = c.cmd("INSPECT pool").await;
    assert!(
        !plain.contains("limit="),
        "INSPECT without KINDS is HELD as before: {plain}"
    );
    let stats = c.cmd("STATS").await;
    assert_eq!(field(&stats, "shared_held"), "2", "{stats}");
    assert_eq!(field(&stats, "permit_grants"), "3", "{stats}");
    server.stop().await;
}

#[tokio::test]
async fn a_writer_waits_for_readers_and_stops_new_ones_then_hands_back() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let (mut a, _) = Raw::connect(server.addr).await;
    let (mut b, _) = Raw::connect(server.addr).await;
    let (mut c, _) = Raw::connect(server.addr).await;
    let (r1, r1_lease) = granted(a.call(1, acquire("doc", 0, LeaseKind::Shared)).await);
    let (r2, r2_lease) = granted(a.call(2, acquire("doc", 0, LeaseKind::Shared)).await);
    // The writer queues behind the readers, and a reader after it queues behind it.
    b.send(10, &acquire("doc", 20_000, LeaseKind::Exclusive))
        .await;
    assert!(matches!(b.call(11, Request::Ping).await, Response::Pong));
    c.send(20, &acquire("doc", 20_000, LeaseKind::Shared)).await;
    assert!(matches!(c.call(21, Request::Ping).await, Response::Pong));
    let locked = a.call(3, acquire("doc", 0, LeaseKind::Shared)).await;
    assert!(
        matches!(locked, Response::Locked { token, .. } if token == r2),
        "{locked:?}"
    );
    let release = |lease_id| Request::Release {
        key: bytes("doc"),
        lease_id,
    };
    assert_eq!(a.call(4, release(r1_lease)).await, Response::Released);
    assert_eq!(a.call(5, release(r2_lease)).await, Response::Released);
    let (id, writer) = b.frame().await;
    let (w, w_lease) = granted(writer);
    assert_eq!(id, 10);
    assert!(
        w > r2 && r2 > r1,
        "a writer's token is above every reader's"
    );
    assert_eq!(check(&mut a, r2).await, Response::Stale);
    assert_eq!(check(&mut a, w).await, Response::Current);
    assert_eq!(b.call(12, release(w_lease)).await, Response::Released);
    let (id, reader) = c.frame().await;
    let (r3, _) = granted(reader);
    assert_eq!(id, 20);
    assert!(r3 > w);
    assert_eq!(check(&mut a, r3).await, Response::Current);
    server.stop().await;
}

async fn check(raw: &mut Raw, token: u64) -> Response {
    raw.call(
        1000 + token,
        Request::Check {
            key: bytes("doc"),
            token,
        },
    )
    .await
}

#[test]
fn holders_kinds_and_limits_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let what = Tenured {
        bin: tenured_bin(),
        dir: dir.path(),
        logs: None,
        args: &[],
    };
    let mut daemon = Daemon::start(what);
    let mut conn =
        tenure_testkit::console::LineConn::connect(daemon.addr, tenure_testkit::PATIENCE).unwrap();
    let a = conn.cmd("ACQUIRE pool 60000 PERMITS=2").unwrap();
    let b = conn.cmd("ACQUIRE pool 60000 PERMITS=2").unwrap();
    let r = conn.cmd("ACQUIRE doc 60000 SHARED").unwrap();
    for line in [&a, &b, &r] {
        assert!(line.starts_with("OK token="), "{line}");
    }
    daemon.kill9();
    let mut daemon = Daemon::start_on(what, daemon.addr);
    let mut conn =
        tenure_testkit::console::LineConn::connect(daemon.addr, tenure_testkit::PATIENCE).unwrap();
    for (key, line) in [("pool", &a), ("pool", &b), ("doc", &r)] {
        let check = conn
            .cmd(&format!("CHECK {key} {}", field(line, "token")))
            .unwrap();
        assert_eq!(check, "CURRENT", "{key} {line} after kill -9");
    }
    // The limit came back with the permits: the key is full, and still a semaphore of 2.
    assert!(conn
        .cmd("ACQUIRE pool 60000 PERMITS=2")
        .unwrap()
        .starts_with("LOCKED "));
    assert!(conn
        .cmd("ACQUIRE pool 60000 PERMITS=3")
        .unwrap()
        .starts_with("ERR KIND_MISMATCH "));
    // A second reader joins the recovered one; a writer does not; tokens went on rising.
    let r2 = conn.cmd("ACQUIRE doc 60000 SHARED").unwrap();
    assert!(
        field(&r2, "token").parse::<u64>().unwrap() > field(&r, "token").parse::<u64>().unwrap(),
        "{r2}"
    );
    assert!(conn
        .cmd("ACQUIRE doc 60000")
        .unwrap()
        .starts_with("LOCKED "));
    // A recovered permit is released by its own lease id, and only its own.
    let lease = field(&a, "lease");
    assert_eq!(conn.cmd(&format!("RELEASE pool {lease}")).unwrap(), "OK");
    assert_eq!(
        conn.cmd(&format!("RELEASE pool {lease}")).unwrap(),
        "NOT_OWNER"
    );
    assert!(conn
        .cmd("ACQUIRE pool 60000 PERMITS=2")
        .unwrap()
        .starts_with("OK token="));
    daemon.kill9();
}

/// Longest an election and a takeover may take here, on a loaded machine.
const ELECTED_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(20);

/// Sends `command` to each of `clients` until one answers other than NOT_LEADER (or
/// UNAVAILABLE while a leader takes over); that node and its answer.
fn at_leader(clients: &[std::net::SocketAddr], command: &str) -> (std::net::SocketAddr, String) {
    let deadline = std::time::Instant::now() + ELECTED_WAIT_MAX;
    while std::time::Instant::now() < deadline {
        for &addr in clients {
            let Ok(mut conn) = tenure_testkit::LineConn::connect(addr, tenure_testkit::PATIENCE)
            else {
                continue;
            };
            match conn.cmd(command) {
                Ok(reply)
                    if !reply.starts_with("ERR NOT_LEADER")
                        && !reply.starts_with("ERR UNAVAILABLE")
                        && !reply.starts_with("ERR RECOVERING") =>
                {
                    return (addr, reply)
                }
                _ => {}
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("no leader answered {command:?} within {ELECTED_WAIT_MAX:?}");
}

#[test]
fn permits_and_read_leases_survive_a_leader_kill_9() {
    use std::net::SocketAddr;
    let loopback = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<SocketAddr> = (0..3)
        .map(|_| loopback(tenure_testkit::free_port()))
        .collect();
    let clients: Vec<SocketAddr> = (0..3)
        .map(|_| loopback(tenure_testkit::free_port()))
        .collect();
    let mut daemons: Vec<Daemon> = (0..3)
        .map(|i| {
            let (id, peer) = ((i + 1).to_string(), peers[i].to_string());
            let args = ["--cluster", "--node-id", &id, "--peer-listen", &peer];
            let what = Tenured {
                bin: tenured_bin(),
                dir: dirs[i].path(),
                logs: None,
                args: &args,
            };
            Daemon::start_on(what, clients[i])
        })
        .collect();
    let nodes: Vec<String> = (0..3)
        .map(|i| format!("{}={}/{}", i + 1, peers[i], clients[i]))
        .collect();
    let init = std::process::Command::new(tenured_bin())
        .args(["cluster-init", "--peer", &peers[0].to_string()])
        .args(["--nodes", &nodes.join(",")])
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");

    let (leader, a) = at_leader(&clients, "ACQUIRE pool 60000 PERMITS=2");
    let (_, b) = at_leader(&clients, "ACQUIRE pool 60000 PERMITS=2");
    let (_, r) = at_leader(&clients, "ACQUIRE doc 60000 SHARED");
    for line in [&a, &b, &r] {
        assert!(line.starts_with("OK token="), "{line}");
    }
    let index = clients.iter().position(|&c| c == leader).unwrap();
    daemons[index].kill9();
    let rest: Vec<SocketAddr> = clients.iter().copied().filter(|&c| c != leader).collect();
    for (key, line) in [("pool", &a), ("pool", &b), ("doc", &r)] {
        let (_, check) = at_leader(&rest, &format!("CHECK {key} {}", field(line, "token")));
        assert_eq!(check, "CURRENT", "{key} {line} after the leader's kill -9");
    }
    let (_, full) = at_leader(&rest, "ACQUIRE pool 60000 PERMITS=2");
    assert!(full.starts_with("LOCKED "), "{full}");
    let (_, wrong) = at_leader(&rest, "ACQUIRE pool 60000 PERMITS=3");
    assert!(wrong.starts_with("ERR KIND_MISMATCH "), "{wrong}");
    let (_, reader) = at_leader(&rest, "ACQUIRE doc 60000 SHARED");
    assert!(reader.starts_with("OK token="), "{reader}");
    let (_, writer) = at_leader(&rest, "ACQUIRE doc 60000");
    assert!(writer.starts_with("LOCKED "), "{writer}");
}

/// An identity's prefixes apply to read and permit leases, and its `held-max` (3) and
/// `waiters-max` (2) count each of them once.
#[tokio::test]
async fn identity_quotas_count_every_permit_and_read_lease() {
    let dir = tempfile::tempdir().unwrap();
    let identities = super::auth::identities_file(dir.path());
    let server = Server::start_in(dir.path(), |config| config.identities = Some(identities)).await;
    let mut c = Console::connect(server.addr).await;
    assert!(c.cmd("AUTH orders orders-secret").await.starts_with("OK "));
    let outside = c.cmd("ACQUIRE pool 30000 PERMITS=5").await;
    assert!(outside.starts_with("ERR FORBIDDEN "), "{outside}");
    for _ in 0..2 {
        let permit = c.cmd("ACQUIRE jobs/pool 30000 PERMITS=5").await;
        assert!(permit.starts_with("OK token="), "{permit}");
    }
    let reader = c.cmd("ACQUIRE orders/doc 30000 SHARED").await;
    assert!(reader.starts_with("OK token="), "{reader}");
    // Three leases held: a fourth permit is over the quota although the key has room.
    let over = c.cmd("ACQUIRE jobs/pool 30000 PERMITS=5").await;
    assert!(over.starts_with("ERR QUOTA "), "{over}");
    let lease = field(&reader, "lease").to_string();
    assert_eq!(c.cmd(&format!("RELEASE orders/doc {lease}")).await, "OK");
    let again = c.cmd("ACQUIRE jobs/pool 30000 PERMITS=5").await;
    assert!(again.starts_with("OK token="), "{again}");
    server.stop().await;
}
