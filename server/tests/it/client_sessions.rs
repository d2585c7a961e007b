//! The Rust client's [`tenure::Session`] against the real `tenured` (PROTOCOL.md 3.11): a
//! session with two locks whose server is killed with `kill -9` and restarted on its port,
//! and one whose cluster leader is killed, is kept alive by the client's own retried
//! keep-alives (to the restarted server, to the new leader) and goes on with the same locks
//! and tokens, past the TTL counted from the kill, without its owner doing anything.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tenure::{AcquireOptions, AcquireOutcome, Client, KeyState, Session, SessionGuard};
use tenure_testkit::{Daemon, Tenured};

use super::cluster::three_daemons;
use super::tenured_bin;

/// The session's TTL: a restart or a fail-over (an election, then a takeover) fits well in
/// it on a loaded machine, with keep-alives to spare.
const TTL: Duration = Duration::from_secs(10);
/// Longest the server takes to come back, or a cluster to elect a new leader.
const STEP_MAX: Duration = Duration::from_secs(30);

fn single(dir: &Path) -> Tenured<'_> {
    Tenured {
        bin: tenured_bin(),
        dir,
        logs: None,
        args: &[],
    }
}

async fn lock(session: &Session, key: &str) -> SessionGuard {
    match session.lock(key).await.expect("lock in the session") {
        AcquireOutcome::Granted(guard) => guard,
        AcquireOutcome::Locked(by) => panic!("{key} is held by token {}", by.token),
    }
}

/// Checks, until `until`, that the session and its guards stay valid and that `other` finds
/// each key held under its guard's token (an acquire answered LOCKED by it); retried while
/// the server is down or electing.
async fn stays_held(session: &Session, guards: &[SessionGuard], other: &Client, until: Instant) {
    while Instant::now() < until {
        assert!(session.is_valid(), "{:?}", session.loss_reason());
        for guard in guards {
            assert!(guard.is_valid(), "{:?}", guard.loss_reason());
            let key = String::from_utf8_lossy(guard.key()).into_owned();
            let probe = other.acquire(&key, TTL, AcquireOptions::default()).await;
            match probe {
                Ok(AcquireOutcome::Locked(by)) => assert_eq!(by.token, guard.fencing_token()),
                Ok(AcquireOutcome::Granted(lease)) => {
                    panic!("{key} granted twice: token {}", lease.fencing_token())
                }
                Err(e) => assert!(e.is_transient(), "{key}: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// After the checks: each key held under its guard's token, then all freed by the close.
async fn close_frees_them(session: Session, guards: &[SessionGuard], other: &Client) {
    for guard in guards {
        match other.inspect(guard.key()).await.expect("inspect") {
            KeyState::Held { token, .. } => assert_eq!(token, guard.fencing_token()),
            KeyState::Free => panic!("{:?} was freed", guard.key()),
        }
    }
    tokio::time::timeout(STEP_MAX, session.close())
        .await
        .expect("close in time")
        .expect("close");
    for guard in guards {
        let state = other.inspect(guard.key()).await.expect("inspect");
        assert_eq!(state, KeyState::Free, "{:?}", guard.key());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_with_two_locks_is_kept_alive_through_a_kill_9_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(single(dir.path()));
    let addr = daemon.addr;
    let holder = Client::connect(addr.to_string()).await.unwrap();
    let session = holder.session(TTL).await.expect("open");
    let guards = vec![lock(&session, "job:a").await, lock(&session, "job:b").await];
    let tokens: Vec<u64> = guards.iter().map(SessionGuard::fencing_token).collect();
    let id = session.id();

    let killed_at = Instant::now();
    tokio::task::block_in_place(|| {
        daemon.kill9();
        // Down a while, so that keep-alives meet refused connections.
        std::thread::sleep(Duration::from_secs(1));
        daemon = Daemon::start_on(single(dir.path()), addr);
    });
    let other = Client::connect(addr.to_string()).await.unwrap();
    // A TTL and more past the kill: only keep-alives at the restarted server can have kept
    // the session (and so its locks) alive this long.
    stays_held(&session, &guards, &other, killed_at + TTL + TTL / 2).await;
    assert_eq!(session.id(), id, "the same session");
    let now: Vec<u64> = guards.iter().map(SessionGuard::fencing_token).collect();
    assert_eq!(now, tokens);
    close_frees_them(session, &guards, &other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_kept_alive_through_the_cluster_leaders_kill_9() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (mut daemons, clients) = tokio::task::block_in_place(|| three_daemons(&dirs));
    let all = |addrs: &[SocketAddr]| {
        addrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let holder = Client::connect(all(&clients)).await.unwrap();
    // The first request waits for the election.
    let session = tokio::time::timeout(STEP_MAX, async {
        loop {
            match holder.session(TTL).await {
                Ok(session) => return session,
                Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("open: {e}"),
            }
        }
    })
    .await
    .expect("a leader in time");
    let guards = vec![lock(&session, "job:a").await, lock(&session, "job:b").await];
    // A keep-alive is the leader's to answer (a follower says NOT_LEADER).
    let keep_alive = format!("SESSION_KEEPALIVE {}", session.id());
    let (leader, kept) =
        tokio::task::block_in_place(|| super::cluster::at_leader(&clients, &keep_alive));
    assert!(kept.starts_with("OK session="), "{kept}");
    let index = clients.iter().position(|&c| c == leader).unwrap();
    let killed_at = Instant::now();
    daemons[index].kill9();
    let rest: Vec<SocketAddr> = clients.iter().copied().filter(|&c| c != leader).collect();
    let other = Client::connect(all(&rest)).await.unwrap();
    stays_held(&session, &guards, &other, killed_at + TTL + TTL / 2).await;
    close_frees_them(session, &guards, &other).await;
}
