//! Sessions against a real server (PROTOCOL.md 3.11): one keep-alive keeps many locks past
//! their TTL without a renewal; closing frees them all to their waiters; a session whose
//! keep-alives stop is reported lost by the client before the server frees its keys; and in a
//! cluster a session rides through the leader's kill.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tenure::{
    AcquireOptions, AcquireOutcome, Client, ErrorCode, KeyState, LossReason, Session, SessionGuard,
    SessionOptions,
};
use tenure_testkit::{ms, Server, PATIENCE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

use crate::wait_for_waiters;

/// The session TTL of the single-node tests.
const TTL: Duration = Duration::from_secs(1);
/// Locks held in one session by the first test.
const LOCKS: usize = 40;

async fn lock(session: &Session, key: &str) -> SessionGuard {
    match session.lock(key).await.expect("lock in the session") {
        AcquireOutcome::Granted(guard) => guard,
        AcquireOutcome::Locked(by) => panic!("{key} is held by token {}", by.token),
    }
}

async fn stat(client: &Client, name: &str) -> u64 {
    let stats = client.stats().await.expect("stats");
    stats
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in {stats:?}"))
        .1
}

#[tokio::test(start_paused = true)]
async fn one_session_keeps_many_locks_past_their_ttl_without_renewals() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let other = server.client().await;
    let session = holder.session(TTL).await.expect("open");
    let mut guards = Vec::new();
    for i in 0..LOCKS {
        guards.push(lock(&session, &format!("s/{i}")).await);
    }
    // Five TTLs: without its keep-alives every lock would have run out four times over.
    let started = Instant::now();
    while started.elapsed() < TTL * 5 {
        tokio::time::sleep(TTL / 4).await;
        assert!(session.is_valid(), "{:?}", session.loss_reason());
        for guard in &guards {
            assert!(guard.is_valid(), "{:?}", guard.loss_reason());
        }
        let probe = other
            .acquire("s/7", TTL, AcquireOptions::default())
            .await
            .expect("acquire");
        assert!(
            matches!(probe, AcquireOutcome::Locked(by) if by.token == guards[7].fencing_token())
        );
    }
    for guard in &guards {
        let key = String::from_utf8_lossy(guard.key()).into_owned();
        match other.inspect(&key).await.expect("inspect") {
            KeyState::Held { token, .. } => assert_eq!(token, guard.fencing_token()),
            KeyState::Free => panic!("{key} was freed"),
        }
    }
    assert_eq!(stat(&other, "ops_renew").await, 0, "no lease was renewed");
    assert_eq!(stat(&other, "session_leases").await, LOCKS as u64);
    assert!(
        guards[0].deadline() > started + TTL * 4,
        "the deadline moved"
    );
    // A RENEW of a session lease is refused: the session keeps it.
    let renewed = holder
        .renew("s/0", guards[0].lease_id(), TTL)
        .await
        .unwrap_err();
    assert!(
        matches!(
            renewed,
            tenure::Error::Server {
                code: ErrorCode::SessionLease,
                ..
            }
        ),
        "{renewed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn closing_a_session_frees_every_lock_and_the_waiters_get_them() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let session = holder.session(TTL).await.expect("open");
    let a = lock(&session, "c/a").await;
    let b = lock(&session, "c/b").await;
    let (a_lost, b_lost, session_lost) = (a.lost(), b.lost(), session.lost());
    let waiter = server.client().await;
    let wait = AcquireOptions::wait(Duration::from_secs(60));
    let waiting = {
        let waiter = waiter.clone();
        let wait = wait.clone();
        tokio::spawn(async move {
            let a = waiter.acquire("c/a", TTL, wait.clone()).await;
            let b = waiter.acquire("c/b", TTL, wait).await;
            (a, b)
        })
    };
    wait_for_waiters(&holder, "c/a", 1).await;
    let (token_a, token_b) = (a.fencing_token(), b.fencing_token());
    session.close().await.expect("close");
    assert_eq!(
        timeout(PATIENCE, a_lost).await.unwrap(),
        LossReason::Released
    );
    assert_eq!(
        timeout(PATIENCE, b_lost).await.unwrap(),
        LossReason::Released
    );
    assert_eq!(
        timeout(PATIENCE, session_lost).await.unwrap(),
        LossReason::Released
    );
    assert!(!a.is_valid() && !b.is_valid());
    let (got_a, got_b) = timeout(PATIENCE, waiting).await.unwrap().unwrap();
    let got_a = got_a.expect("acquire").granted().expect("a handed on");
    let got_b = got_b.expect("acquire").granted().expect("b free");
    assert!(got_a.fencing_token() > token_a && got_b.fencing_token() > token_b);
    // The session is gone: nothing more can be taken in it.
    let reopened = holder.session(TTL).await.expect("open another");
    drop(reopened);
}

#[tokio::test(start_paused = true)]
async fn a_lock_taken_after_its_session_ended_is_refused() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let session = holder.session(TTL).await.expect("open");
    let id = session.id();
    // Another handle to the same session id, closed behind the first one's back.
    let closing = tenure_protocol_close(&server.addr_string(), id).await;
    assert!(closing.starts_with("OK released=0"), "{closing}");
    let refused = session.lock("e/k").await.unwrap_err();
    assert!(
        matches!(
            refused,
            tenure::Error::Server {
                code: ErrorCode::NoSession,
                ..
            }
        ),
        "{refused:?}"
    );
    assert_eq!(session.loss_reason(), Some(LossReason::SessionEnded));
}

/// SESSION_CLOSE over the text console, as another program holding the session id would.
async fn tenure_protocol_close(addr: &str, id: tenure::SessionId) -> String {
    let mut console = tenure_testkit::console::Console::connect(addr.parse().unwrap()).await;
    console.cmd(&format!("SESSION_CLOSE {id}")).await
}

/// A TCP proxy whose forwarding can be frozen: bytes are held, not dropped, and connections
/// stay open, as for a client process that was stopped (SIGSTOP).
struct FreezingProxy {
    addr: String,
    frozen: Arc<AtomicBool>,
}

impl FreezingProxy {
    async fn start(target: String) -> FreezingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&frozen);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let outbound = TcpStream::connect(&target).await.unwrap();
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(forward(ri, wo, Arc::clone(&stop)));
                tokio::spawn(forward(ro, wi, Arc::clone(&stop)));
            }
        });
        FreezingProxy { addr, frozen }
    }
}

async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let Ok(n) = from.read(&mut buffer).await else {
            return;
        };
        if n == 0 {
            return;
        }
        while frozen.load(Ordering::Acquire) {
            tokio::time::sleep(ms(5)).await;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_session_whose_keep_alives_stop_is_lost_before_the_server_frees_its_keys() {
    let server = Server::start_virtual().await;
    let proxy = FreezingProxy::start(server.addr_string()).await;
    let holder = Client::connect(proxy.addr.clone()).await.expect("connect");
    let session = holder.session(TTL).await.expect("open");
    let guards = [lock(&session, "f/a").await, lock(&session, "f/b").await];
    let lost = guards[1].lost();
    let watcher = server.client().await;
    tokio::time::sleep(TTL * 2).await;
    assert!(session.is_valid(), "kept alive until the freeze");
    proxy.frozen.store(true, Ordering::Release);
    let frozen_at = Instant::now();
    let lost_at = {
        let lost = tokio::spawn(async move {
            let reason = lost.await;
            (Instant::now(), reason)
        });
        // Poll the server until it frees both keys.
        let freed_at = loop {
            let a = watcher.inspect("f/a").await.expect("inspect");
            let b = watcher.inspect("f/b").await.expect("inspect");
            if a == KeyState::Free && b == KeyState::Free {
                break Instant::now();
            }
            assert!(
                frozen_at.elapsed() < TTL * 10,
                "the server never freed them"
            );
            tokio::time::sleep(ms(1)).await;
        };
        let (lost_at, reason) = lost.await.unwrap();
        assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
        assert!(
            lost_at <= freed_at,
            "lost {:?} after the freeze, freed {:?}",
            lost_at - frozen_at,
            freed_at - frozen_at
        );
        lost_at
    };
    assert!(lost_at - frozen_at <= TTL, "{:?}", lost_at - frozen_at);
    for guard in &guards {
        assert!(!guard.is_valid());
    }
    // Someone else gets the keys once they are free.
    assert!(matches!(
        watcher.acquire("f/a", TTL, AcquireOptions::default()).await,
        Ok(AcquireOutcome::Granted(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn session_options_that_leave_no_time_are_refused() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let options = SessionOptions {
        keep_alive_every: Some(TTL),
        margin: None,
    };
    let refused = client.session_with(TTL, options).await.unwrap_err();
    assert!(
        matches!(refused, tenure::Error::Invalid { .. }),
        "{refused:?}"
    );
    let closed = client.session(TTL).await.expect("open");
    let closed_lost = closed.lost();
    drop(closed);
    assert_eq!(closed_lost.await, LossReason::Released);
    let session = client.session(TTL).await.expect("open");
    let tied = AcquireOptions {
        release_on_disconnect: true,
        ..AcquireOptions::default()
    };
    let refused = session.lock_with("o/k", tied).await.unwrap_err();
    assert!(
        matches!(refused, tenure::Error::Invalid { .. }),
        "{refused:?}"
    );
    // A session's lock dropped alone is released; the session and its other locks go on.
    let a = lock(&session, "o/a").await;
    let b = lock(&session, "o/b").await;
    drop(a);
    let deadline = Instant::now() + PATIENCE;
    while client.inspect("o/a").await.unwrap() != KeyState::Free {
        assert!(Instant::now() < deadline, "o/a was never released");
        tokio::time::sleep(ms(5)).await;
    }
    assert!(b.is_valid());
    assert!(matches!(
        client.inspect("o/b").await.unwrap(),
        KeyState::Held { .. }
    ));
}
