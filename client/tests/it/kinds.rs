//! Semaphores and read/write locks (PROTOCOL.md 3.10) through the library and the command
//! line, against a real server: at most N permit holders, the next one waiting and served on
//! release; readers together, a writer alone and FIFO between them; tokens rising; guards
//! reporting loss; the typed errors of a kind that does not fit.

use std::time::Duration;

use tenure::{
    AcquireOptions, AcquireOutcome, CheckOutcome, Client, Error, Fence, LeaseGuard, LossReason,
};
use tenure_testkit::{field, ms, Server, ThreadServer as TestServer, PATIENCE};
use tokio::task::JoinHandle;
use tokio::time::timeout;

use crate::cli::{cli, Console};
use crate::wait_for_waiters;

const TTL: Duration = Duration::from_secs(2);

fn wait() -> AcquireOptions {
    AcquireOptions::wait(Duration::from_secs(30))
}

fn now() -> AcquireOptions {
    AcquireOptions::default()
}

/// The guard of an outcome that must be a grant.
fn guard(outcome: tenure::Result<AcquireOutcome<LeaseGuard>>) -> LeaseGuard {
    match outcome.expect("acquire") {
        AcquireOutcome::Granted(guard) => guard,
        AcquireOutcome::Locked(by) => panic!("locked by token {}", by.token),
    }
}

fn is_locked(outcome: tenure::Result<AcquireOutcome<LeaseGuard>>) -> bool {
    matches!(outcome.expect("acquire"), AcquireOutcome::Locked(_))
}

/// A permit of `key` (of `permits`) asked for by another task, waiting in line.
fn waiting_permit(client: &Client, key: &'static str, permits: u32) -> JoinHandle<LeaseGuard> {
    let client = client.clone();
    tokio::spawn(async move { guard(client.semaphore(key, permits, TTL, wait()).await) })
}

#[tokio::test(start_paused = true)]
async fn a_semaphore_holds_n_permits_and_hands_one_to_the_next_on_release() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(guard(client.semaphore("pool", 3, TTL, now()).await));
    }
    let tokens: Vec<u64> = held.iter().map(LeaseGuard::fencing_token).collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    assert!(is_locked(client.semaphore("pool", 3, TTL, now()).await));
    let kinds = client.inspect_kinds("pool").await.expect("inspect");
    let by_kind = kinds.kinds.expect("a semaphore answers HELD_KINDS");
    assert_eq!(
        (
            by_kind.limit,
            by_kind.holders,
            by_kind.in_use,
            by_kind.writer
        ),
        (3, 3, 3, false)
    );

    let fourth = waiting_permit(&client, "pool", 3);
    wait_for_waiters(&client, "pool", 1).await;
    // The permits stay held past their TTL: the guards renew them.
    tokio::time::sleep(3 * TTL).await;
    assert!(!fourth.is_finished(), "a fourth permit beside three");
    assert!(held.iter().all(LeaseGuard::is_valid));
    held.remove(0).release().await.expect("release");
    let fourth = timeout(PATIENCE, fourth)
        .await
        .expect("handed a permit")
        .unwrap();
    assert!(fourth.fencing_token() > tokens[2], "tokens rise");
    let by_kind = client.inspect_kinds("pool").await.unwrap().kinds.unwrap();
    assert_eq!((by_kind.in_use, by_kind.waiting_shared), (3, 0));

    // Two permits at once wait for two to be free, and nobody smaller overtakes them.
    let client2 = client.clone();
    let pair =
        tokio::spawn(
            async move { guard(client2.semaphore_permits("pool", 2, 3, TTL, wait()).await) },
        );
    wait_for_waiters(&client, "pool", 1).await;
    let single = waiting_permit(&client, "pool", 3);
    wait_for_waiters(&client, "pool", 2).await;
    held.remove(0).release().await.expect("release");
    tokio::time::sleep(ms(100)).await;
    assert!(
        !single.is_finished(),
        "a later single permit overtook the pair"
    );
    held.remove(0).release().await.expect("release");
    let pair = timeout(PATIENCE, pair).await.expect("the pair").unwrap();
    assert!(pair.fencing_token() > fourth.fencing_token());
    fourth.release().await.expect("release");
    let single = timeout(PATIENCE, single)
        .await
        .expect("the single")
        .unwrap();
    assert!(single.fencing_token() > pair.fencing_token());
}

#[tokio::test(start_paused = true)]
async fn readers_share_a_writer_waits_and_readers_behind_it_wait_too() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let r1 = guard(client.read_lock("doc", TTL, now()).await);
    let r2 = guard(client.read_lock("doc", TTL, now()).await);
    assert!(r2.fencing_token() > r1.fencing_token());
    assert!(is_locked(client.write_lock("doc", TTL, now()).await));

    let c = client.clone();
    let writer = tokio::spawn(async move { guard(c.write_lock("doc", TTL, wait()).await) });
    wait_for_waiters(&client, "doc", 1).await;
    let c = client.clone();
    let r3 = tokio::spawn(async move { guard(c.read_lock("doc", TTL, wait()).await) });
    wait_for_waiters(&client, "doc", 2).await;
    let by_kind = client.inspect_kinds("doc").await.unwrap().kinds.unwrap();
    assert_eq!(
        (by_kind.limit, by_kind.in_use, by_kind.writer),
        (0, 2, false)
    );
    assert_eq!((by_kind.waiting_shared, by_kind.waiting_exclusive), (1, 1));
    // A reader behind the waiting writer is not let in beside the readers.
    assert!(is_locked(client.read_lock("doc", TTL, now()).await));
    tokio::time::sleep(3 * TTL).await;
    assert!(!writer.is_finished() && !r3.is_finished());
    let read_token = r1.fencing_token();
    assert_eq!(
        client.check("doc", read_token).await.unwrap(),
        CheckOutcome::Current
    );

    r1.release().await.unwrap();
    tokio::time::sleep(ms(100)).await;
    assert!(!writer.is_finished(), "a writer beside a reader");
    r2.release().await.unwrap();
    let writer = timeout(PATIENCE, writer)
        .await
        .expect("the writer")
        .unwrap();
    assert!(writer.fencing_token() > read_token);
    assert_eq!(
        client.check("doc", read_token).await.unwrap(),
        CheckOutcome::Stale,
        "a reader's token is stale once a writer was granted"
    );
    // At the resource: the writer's write fences off the earlier reader's late read.
    let fence = Fence::new();
    assert!(fence.check_read("doc", read_token).is_ok());
    fence.try_accept("doc", writer.fencing_token()).unwrap();
    assert!(fence.check_read("doc", read_token).is_err());
    tokio::time::sleep(ms(100)).await;
    assert!(!r3.is_finished(), "a reader beside the writer");
    writer.release().await.unwrap();
    let r3 = timeout(PATIENCE, r3).await.expect("the reader").unwrap();
    assert!(r3.is_valid());
}

#[tokio::test(start_paused = true)]
async fn permit_and_read_guards_report_their_loss() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let other = server.client().await;
    let permit = guard(client.semaphore("lossy/pool", 2, TTL, now()).await);
    let read = guard(client.read_lock("lossy/doc", TTL, now()).await);
    let permit_lost = permit.lost();
    other
        .release("lossy/pool", permit.lease_id())
        .await
        .expect("release behind its back");
    let reason = timeout(PATIENCE, permit_lost).await.expect("loss signal");
    assert_eq!(reason, LossReason::Revoked);
    assert!(!permit.is_valid());

    // The server goes away: the read lease cannot be confirmed and is given up before its
    // local deadline.
    let read_lost = read.lost();
    server.stop().await;
    let reason = timeout(PATIENCE, read_lost).await.expect("loss signal");
    assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
    assert!(!read.is_valid());
}

#[tokio::test(start_paused = true)]
async fn a_kind_that_does_not_fit_is_a_typed_error() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let _permit = guard(client.semaphore("fit", 2, TTL, now()).await);
    let other_limit = client.semaphore("fit", 3, TTL, now()).await;
    assert!(
        matches!(&other_limit, Err(Error::KindMismatch(m)) if m.contains('2')),
        "{other_limit:?}"
    );
    let plain = client.lock("fit", TTL, now()).await;
    assert!(matches!(plain, Err(Error::KindMismatch(_))), "{plain:?}");
    let read = client.read_lock("fit", TTL, now()).await;
    assert!(matches!(read, Err(Error::KindMismatch(_))), "{read:?}");
    let _write = guard(client.write_lock("fit/rw", TTL, now()).await);
    let permits = client.semaphore("fit/rw", 2, TTL, now()).await;
    assert!(
        matches!(permits, Err(Error::KindMismatch(_))),
        "{permits:?}"
    );
    for (count, limit) in [(0, 2), (3, 2), (1, 0), (1, 4097)] {
        let bad = client
            .semaphore_permits("fit/bad", count, limit, TTL, now())
            .await;
        assert!(matches!(bad, Err(Error::BadPermits(_))), "{bad:?}");
    }
    assert!(!Error::KindMismatch(String::new()).is_transient());
}

#[tokio::test]
async fn cli_run_with_permits_holds_one_and_waits_for_the_next() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(
        addr,
        &["acquire", "cli/pool", "--ttl", "30s", "--permits", "2"],
    )
    .await;
    assert_eq!((code, field(&out, "result")), (0, "GRANTED"), "{out}");
    let first: u64 = field(&out, "token").parse().unwrap();
    let run = [
        "run",
        "--permits",
        "2",
        "--ttl",
        "5s",
        "cli/pool",
        "--",
        "sh",
        "-c",
        "echo $TENURE_FENCING_TOKEN",
    ];
    let (code, out, err) = cli(addr, &run).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.trim().parse::<u64>().unwrap() > first, "{out}");
    // Both permits held: the second `acquire` gets one, `run` finds none.
    let (code, out, _) = cli(
        addr,
        &["acquire", "cli/pool", "--ttl", "30s", "--permits", "2"],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let lease = field(&out, "lease").to_owned();
    let busy = [
        "run",
        "--permits",
        "2",
        "--ttl",
        "5s",
        "cli/pool",
        "--",
        "true",
    ];
    assert_eq!(cli(addr, &busy).await.0, 3, "LOCKED");
    let mismatch = ["acquire", "cli/pool", "--ttl", "5s", "--permits", "3"];
    let (code, out, _) = cli(addr, &mismatch).await;
    assert_eq!((code, field(&out, "result")), (1, "ERROR"), "{out}");
    assert!(out.contains("kind mismatch"), "{out}");
    let (code, out, _) = cli(addr, &["inspect", "cli/pool", "--kinds"]).await;
    assert_eq!(code, 0);
    assert_eq!(
        (field(&out, "limit"), field(&out, "in_use")),
        ("2", "2"),
        "{out}"
    );
    waiting_run_gets_the_permit_released(&server, &lease).await;
}

/// Both permits of `cli/pool` held, one by `lease`: a waiting `run` gets it once released.
async fn waiting_run_gets_the_permit_released(server: &TestServer, lease: &str) {
    let addr = server.addr.as_str();
    let waiting = [
        "run",
        "--permits",
        "2",
        "--ttl",
        "5s",
        "--wait",
        "20s",
        "cli/pool",
        "--",
        "true",
    ];
    let addr_owned = addr.to_owned();
    let waiter = tokio::spawn(async move { cli(&addr_owned, &waiting).await });
    let client = server.client().await;
    wait_for_waiters(&client, "cli/pool", 1).await;
    assert_eq!(cli(addr, &["release", "cli/pool", lease]).await.0, 0);
    let (code, _, err) = timeout(PATIENCE, waiter).await.expect("granted").unwrap();
    assert_eq!(code, 0, "{err}");
    assert_eq!(field(&err, "result"), "GRANTED");
}

#[tokio::test]
async fn cli_run_shared_beside_a_reader_and_locked_by_a_writer() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let client = server.client().await;
    let reader = guard(
        client
            .read_lock("cli/doc", Duration::from_secs(30), now())
            .await,
    );
    let shared = ["run", "--shared", "--ttl", "5s", "cli/doc", "--", "true"];
    assert_eq!(cli(addr, &shared).await.0, 0, "a reader beside a reader");
    let plain = ["run", "--ttl", "5s", "cli/doc", "--", "true"];
    assert_eq!(cli(addr, &plain).await.0, 3, "a writer beside a reader");
    reader.release().await.unwrap();
    let writer = guard(
        client
            .write_lock("cli/doc", Duration::from_secs(30), now())
            .await,
    );
    assert_eq!(cli(addr, &shared).await.0, 3, "a reader beside a writer");
    writer.release().await.unwrap();
}

#[tokio::test]
async fn cli_console_speaks_shared_permits_and_kinds() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let one = console.ask("ACQUIRE con/pool 30000 PERMITS=2").await;
    assert_eq!(field(&one, "result"), "GRANTED", "{one}");
    let two = console.ask("ACQUIRE con/pool 30000 PERMITS=2").await;
    assert_eq!(field(&two, "result"), "GRANTED", "{two}");
    let three = console.ask("ACQUIRE con/pool 30000 PERMITS=2").await;
    assert_eq!(field(&three, "result"), "LOCKED", "{three}");
    let kinds = console.ask("INSPECT con/pool KINDS").await;
    assert_eq!(
        (field(&kinds, "limit"), field(&kinds, "holders")),
        ("2", "2"),
        "{kinds}"
    );
    let mismatch = console.ask("ACQUIRE con/pool 30000 PERMITS=3").await;
    assert!(mismatch.contains("kind mismatch"), "{mismatch}");
    let bad = console.ask("ACQUIRE con/pool 30000 PERMITS=0").await;
    assert_eq!(field(&bad, "code"), "BAD_PERMITS", "{bad}");
    let r1 = console.ask("ACQUIRE con/doc 30000 SHARED").await;
    let r2 = console.ask("ACQUIRE con/doc 30000 SHARED").await;
    assert_eq!(
        (field(&r1, "result"), field(&r2, "result")),
        ("GRANTED", "GRANTED")
    );
    let w = console.ask("ACQUIRE con/doc 30000").await;
    assert_eq!(field(&w, "result"), "LOCKED", "{w}");
    let kinds = console.ask("INSPECT con/doc KINDS").await;
    assert_eq!(
        (field(&kinds, "in_use"), field(&kinds, "writer")),
        ("2", "0"),
        "{kinds}"
    );
}
