//! The library against a real server: requests, guards, loss, fencing, watches, elections.

use std::time::Duration;

use tenure::{
    AcquireOptions, AcquireOutcome, CheckOutcome, Client, ClientConfig, Election, ElectionOptions,
    Error, ErrorCode, EventKind, Fence, KeyState, LeaseId, LossReason, ReleaseOutcome,
    RenewOutcome,
};
use tenure_testkit::{ms, Server, ThreadServer as TestServer, PATIENCE};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

use crate::{granted, next_leader, stays_held, wait_for_waiters, PATIENT_TTL};

#[tokio::test(start_paused = true)]
async fn acquire_renew_release_inspect_check() {
    let server = Server::start_virtual().await;
    let a = server.client().await;
    let b = server.client().await;
    let ttl = Duration::from_secs(2);
    let options = AcquireOptions {
        meta: "alice".into(),
        ..AcquireOptions::default()
    };
    let before = Instant::now();
    let outcome = a.acquire("k", ttl, options).await.expect("acquire");
    let after = Instant::now();
    let mut lease = outcome.granted().expect("k is free");
    // Counted from before the send, less the margin for rounding and clock rates.
    let counted = ttl - tenure::lease::deadline_margin(ttl);
    assert!(lease.deadline() >= before + counted && lease.deadline() <= after + counted);
    assert!(lease.time_left() <= ttl);
    let token = lease.fencing_token();

    match b
        .acquire("k", ttl, AcquireOptions::default())
        .await
        .expect("acquire")
    {
        AcquireOutcome::Locked(by) => {
            assert_eq!(by.token, token);
            assert!(by.ttl_left <= ttl);
        }
        AcquireOutcome::Granted(_) => panic!("two holders of k"),
    }
    match b.inspect("k").await.expect("inspect") {
        KeyState::Held {
            token: held, meta, ..
        } => assert_eq!((held, &meta[..]), (token, &b"alice"[..])),
        KeyState::Free => panic!("k should be held"),
    }
    assert_eq!(
        b.check("k", token).await.expect("check"),
        CheckOutcome::Current
    );
    assert_eq!(
        b.check("k", token + 1).await.expect("check"),
        CheckOutcome::Stale
    );

    let old_deadline = lease.deadline();
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(ms(20)).await;
    let renewed = lease
        .renew_for(Duration::from_secs(3))
        .await
        .expect("renew");
    assert_eq!(
        renewed,
        RenewOutcome::Renewed {
            ttl: Duration::from_secs(3)
        }
    );
    assert!(lease.deadline() > old_deadline);

    release_and_check_it_is_gone(&a, &b, lease, ttl).await;
}

/// Releases `lease` (held by `a`) after `b` failed to with a wrong lease id, then checks that
/// the lease is gone everywhere and the next grant has a larger token.
async fn release_and_check_it_is_gone(a: &Client, b: &Client, lease: tenure::Lease, ttl: Duration) {
    let token = lease.fencing_token();
    let wrong = LeaseId::from_u128(1);
    assert_eq!(
        b.release("k", wrong).await.expect("release"),
        ReleaseOutcome::NotOwner
    );
    let lease_id = lease.lease_id();
    assert_eq!(
        lease.release().await.expect("release"),
        ReleaseOutcome::Released
    );
    assert_eq!(
        a.release("k", lease_id).await.expect("release"),
        ReleaseOutcome::NotOwner
    );
    assert_eq!(
        a.renew("k", lease_id, ttl).await.expect("renew"),
        RenewOutcome::Lost
    );
    assert_eq!(a.inspect("k").await.expect("inspect"), KeyState::Free);
    assert_eq!(
        a.check("k", token).await.expect("check"),
        CheckOutcome::Stale
    );

    let next = granted(b, "k", ttl).await;
    assert!(next.fencing_token() > token, "tokens must increase per key");
    assert!(!a.stats().await.expect("stats").is_empty());
    assert!(a.ping().await.expect("ping") < PATIENCE);
}

#[tokio::test]
async fn arguments_outside_the_wire_limits_are_rejected_before_sending() {
    let server = TestServer::start();
    let client = server.client().await;
    let ttl = Duration::from_secs(1);
    let cases: [(Vec<u8>, Duration, AcquireOptions, ErrorCode); 4] = [
        (vec![], ttl, AcquireOptions::default(), ErrorCode::BadKey),
        (
            vec![b'k'; 1025],
            ttl,
            AcquireOptions::default(),
            ErrorCode::BadKey,
        ),
        (
            b"k".to_vec(),
            ms(5),
            AcquireOptions::default(),
            ErrorCode::BadTtl,
        ),
        (
            b"k".to_vec(),
            ttl,
            AcquireOptions {
                meta: vec![b'm'; 1025].into(),
                ..AcquireOptions::default()
            },
            ErrorCode::MetaTooLong,
        ),
    ];
    for (key, ttl, options, expected) in cases {
        match client.acquire(&key, ttl, options).await {
            Err(Error::Invalid { code, .. }) => assert_eq!(code, expected),
            other => panic!("expected Invalid({expected}), got {other:?}"),
        }
    }
    let long_wait = AcquireOptions::wait(Duration::from_secs(3601));
    assert!(matches!(
        client.acquire("k", ttl, long_wait).await,
        Err(Error::Invalid {
            code: ErrorCode::BadWait,
            ..
        })
    ));
    // The connection is unharmed.
    client.ping().await.expect("ping after rejected arguments");
}

#[tokio::test]
async fn a_thousand_pipelined_requests_from_many_tasks_share_one_connection() {
    // A small server cap makes the client's in-flight semaphore do its job: without it the
    // server would answer TOO_MANY_IN_FLIGHT.
    let server = TestServer::start_with(|config| config.in_flight_max = 32);
    let client = server.client().await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000u32 {
        let client = client.clone();
        tasks.spawn(async move {
            let key = format!("pipe/{i}");
            match i % 4 {
                0 => {
                    let lease = granted(&client, &key, Duration::from_secs(10)).await;
                    match client.inspect(&key).await.expect("inspect") {
                        KeyState::Held { token, .. } => assert_eq!(token, lease.fencing_token()),
                        KeyState::Free => panic!("{key} should be held"),
                    }
                }
                1 => assert_eq!(client.inspect(&key).await.expect("inspect"), KeyState::Free),
                2 => {
                    client.ping().await.expect("ping");
                }
                _ => {
                    let outcome = client.check(&key, 1).await.expect("check");
                    assert_eq!(outcome, CheckOutcome::Stale);
                }
            }
        });
    }
    let started = Instant::now();
    while let Some(result) = timeout(PATIENCE, tasks.join_next())
        .await
        .expect("tasks hang")
    {
        result.expect("request task failed");
    }
    assert!(started.elapsed() < PATIENCE);
    assert!(client.is_connected(), "one connection throughout");
}

#[tokio::test(start_paused = true)]
async fn blocking_acquires_are_handed_off_in_arrival_order() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let holder = granted(&client, "fifo", Duration::from_secs(5)).await;
    let first_token = holder.fencing_token();
    let (tx, mut rx) = mpsc::unbounded_channel();
    for waiter in 1..=3u32 {
        let waiter_client = client.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let client = waiter_client;
            let options = AcquireOptions::wait(Duration::from_secs(5));
            let outcome = client
                .acquire("fifo", Duration::from_secs(5), options)
                .await;
            let lease = outcome
                .expect("acquire")
                .granted()
                .expect("granted after waiting");
            tx.send((waiter, lease.fencing_token()))
                .expect("test alive");
            lease.release().await.expect("release");
        });
        // Wait until this waiter is in line before starting the next one.
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let KeyState::Held { waiters, .. } = client.inspect("fifo").await.expect("inspect") {
                if waiters == waiter {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "waiter {waiter} never queued");
            // Virtual time (paused clock): costs no real time.
            tokio::time::sleep(ms(5)).await;
        }
    }
    holder.release().await.expect("release");
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(
            timeout(PATIENCE, rx.recv())
                .await
                .expect("hand-off")
                .expect("sender"),
        );
    }
    let waiters: Vec<u32> = order.iter().map(|(w, _)| *w).collect();
    assert_eq!(waiters, [1, 2, 3], "first come, first served");
    let tokens: Vec<u64> = order.iter().map(|(_, t)| *t).collect();
    assert!(first_token < tokens[0] && tokens[0] < tokens[1] && tokens[1] < tokens[2]);
}

#[tokio::test(start_paused = true)]
async fn a_guard_keeps_the_lock_for_five_ttls() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let other = server.client().await;
    let ttl = ms(500);
    let guard = holder
        .lock("guarded", ttl, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let token = guard.fencing_token();
    let lost = guard.lost();
    let started = Instant::now();
    while started.elapsed() < 5 * ttl {
        assert!(
            guard.is_valid(),
            "guard lost validity at {:?}",
            started.elapsed()
        );
        match other
            .acquire("guarded", ttl, AcquireOptions::default())
            .await
            .expect("acquire")
        {
            AcquireOutcome::Locked(by) => assert_eq!(by.token, token, "token changed"),
            AcquireOutcome::Granted(_) => panic!("lock lost after {:?}", started.elapsed()),
        }
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(ms(50)).await;
    }
    assert!(guard.loss_reason().is_none());
    assert!(guard.time_left() > Duration::ZERO);
    // A renewal answered LOST fires the signal: release the lease behind the guard's back.
    let released = other
        .release("guarded", guard.lease_id())
        .await
        .expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    let reason = timeout(PATIENCE, lost).await.expect("loss signal");
    assert_eq!(reason, LossReason::Revoked);
    assert!(!guard.is_valid());
    assert!(guard.cancellation_token().is_cancelled());
}

// Real time: the server is killed by dropping its runtime, which only a server in a runtime of
// its own allows. So the bounds are generous: the guard gives up a whole second before its
// local deadline, which is the slack a slow machine gets for "loss fires before the deadline".
#[tokio::test]
async fn killing_the_server_fires_the_loss_signal_before_the_local_deadline() {
    let mut server = TestServer::start();
    let client = server.client().await;
    let ttl = ms(2_000);
    let keep_alive = tenure::KeepAliveOptions {
        renew_every: Some(ms(200)),
        margin: Some(ms(1_000)),
    };
    let guard = granted(&client, "crash", ttl)
        .await
        .keep_alive_with(keep_alive);
    let tied_options = AcquireOptions {
        release_on_disconnect: true,
        ..AcquireOptions::default()
    };
    let tied = client
        .lock("crash/tied", ttl, tied_options)
        .await
        .expect("lock")
        .granted()
        .expect("free");
    tokio::time::sleep(ms(250)).await; // real time: let a renewal or two go through
    assert!(guard.is_valid() && tied.is_valid());
    let killed_at = Instant::now();
    server.kill();

    // The lease tied to the connection is gone the moment the connection is.
    let reason = timeout(PATIENCE, tied.lost())
        .await
        .expect("tied loss signal");
    assert!(matches!(reason, LossReason::Disconnected(_)), "{reason:?}");

    // The other one cannot be confirmed any more: loss fires before its local deadline.
    let reason = timeout(PATIENCE, guard.lost()).await.expect("loss signal");
    let fired_at = Instant::now();
    assert!(
        fired_at <= guard.deadline(),
        "fired {:?} after the deadline",
        fired_at - guard.deadline()
    );
    assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
    assert!(!guard.is_valid());
    assert!(fired_at.duration_since(killed_at) <= ttl);
}

#[tokio::test(start_paused = true)]
async fn a_paused_holders_late_write_is_rejected_by_the_fence() {
    let server = Server::start_virtual().await;
    let a = server.client().await;
    let b = server.client().await;
    let fence = Fence::new();
    let ttl = ms(300);
    let lease_a = granted(&a, "res", ttl).await;
    let token_a = lease_a.fencing_token();
    fence.try_accept("res", token_a).expect("A's first write");

    // A "pauses" past its TTL without renewing; B waits in line and gets the lock.
    let options = AcquireOptions::wait(PATIENCE);
    let lease_b = b
        .acquire("res", ttl, options)
        .await
        .expect("acquire")
        .granted()
        .expect("B");
    let token_b = lease_b.fencing_token();
    assert!(token_b > token_a);
    fence.try_accept("res", token_b).expect("B's write");

    // A wakes up and writes with its old token.
    assert!(lease_a.is_expired(), "A's local deadline has passed too");
    let rejected = fence
        .try_accept("res", token_a)
        .expect_err("A's late write");
    assert_eq!(rejected.highest, token_b);
    assert_eq!(
        a.check("res", token_a).await.expect("check"),
        CheckOutcome::Stale
    );
}

#[tokio::test(start_paused = true)]
async fn watch_reports_grants_releases_and_expiries() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let mut watch = client.watch("watched").await.expect("watch");
    let lease = granted(&client, "watched", Duration::from_secs(5)).await;
    let token = lease.fencing_token();
    lease.release().await.expect("release");
    let short = granted(&client, "watched", ms(50)).await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        let event = timeout(PATIENCE, watch.next())
            .await
            .expect("event")
            .expect("open");
        let event = event.expect("event");
        assert_eq!(&event.key[..], b"watched");
        seen.push((event.kind, event.token));
    }
    let expected = [
        (EventKind::Granted, token),
        (EventKind::Released, token),
        (EventKind::Granted, short.fencing_token()),
        (EventKind::Expired, short.fencing_token()),
    ];
    assert_eq!(seen, expected);
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_sends_an_acquire_in_flight_again_and_the_next_request_reconnects() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let held = granted(&client, "busy", Duration::from_secs(60)).await;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            let options = AcquireOptions::wait(Duration::from_secs(5));
            client
                .acquire("busy", Duration::from_secs(1), options)
                .await
        })
    };
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(ms(100)).await;
    client.disconnect();
    // The blocking ACQUIRE's outcome was unknown: the client sent it again, with its acquire
    // id, on a new connection, waiting what was left of its 5 s, and LOCKED is its one answer.
    let result = timeout(PATIENCE, waiting)
        .await
        .expect("answered")
        .expect("task");
    assert!(
        matches!(result, Ok(AcquireOutcome::Locked(ref by)) if by.token == held.fencing_token()),
        "{result:?}"
    );
    client.disconnect();
    assert!(!client.is_connected());
    client.ping().await.expect("the next request reconnects");
    assert!(client.is_connected());
}

/// A blocking ACQUIRE sent again after a lost connection, and granted after waiting in line
/// again: its lease counts from the send that was granted (the server's `waited_ms` is that
/// send's), so a wait longer than the TTL before the connection was lost does not make it
/// look expired on arrival.
#[tokio::test(start_paused = true)]
async fn a_blocking_acquire_sent_again_counts_its_lease_from_the_send_that_won() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let client = server.client().await;
    let _held = granted(&holder, "line", Duration::from_secs(5)).await;
    let ttl = Duration::from_secs(1);
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            let options = AcquireOptions::wait(Duration::from_secs(30));
            client.acquire("line", ttl, options).await
        })
    };
    // Three seconds in line (three TTLs), then the connection goes; the holder's lease
    // runs out two seconds after that and the re-sent ACQUIRE is granted.
    tokio::time::sleep(Duration::from_secs(3)).await;
    client.disconnect();
    let lease = timeout(PATIENCE, waiting)
        .await
        .expect("answered")
        .expect("task")
        .expect("granted")
        .granted()
        .expect("the key came free");
    assert!(lease.waited() < Duration::from_secs(3), "{lease:?}");
    assert!(
        lease.time_left() > ttl / 2,
        "not expired on arrival: {lease:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_reconnect_backs_off() {
    let server = Server::start_virtual().await;
    let config = ClientConfig {
        reconnect_delay_min: ms(200),
        reconnect_delay_max: ms(400),
        ..ClientConfig::default()
    };
    let client = Client::connect_with(server.addr_string(), config)
        .await
        .expect("connect");
    server.stop().await;
    // The first failure is immediate ...
    for attempt in 0.. {
        assert!(attempt < 100, "server never went away");
        match client.ping().await {
            Err(Error::Io(_)) => break,
            // Virtual time (paused clock): costs no real time.
            Ok(_) | Err(_) => tokio::time::sleep(ms(10)).await,
        }
    }
    // ... the next attempt waits at least half the minimum delay (jitter is in [d/2, d]), and
    // never more than the maximum.
    let started = Instant::now();
    assert!(client.ping().await.is_err());
    let waited = started.elapsed();
    assert!(waited >= ms(100), "retried after {waited:?}");
    assert!(waited <= ms(400), "retried after {waited:?}");
}

#[tokio::test(start_paused = true)]
async fn election_fails_over_on_disconnect_and_observers_see_every_term_in_order() {
    let server = Server::start_virtual().await;
    let options = ElectionOptions {
        ttl: Duration::from_secs(3), // far longer than the bound: failover is by disconnect
        ..ElectionOptions::default()
    };
    let one = Election::with_options(server.client().await, "g", options);
    let two = Election::with_options(server.client().await, "g", options);
    let three = Election::with_options(server.client().await, "g", options);
    let observer_client = server.client().await;
    let mut observers = vec![
        observer_client.observe("g"),
        Election::new(server.client().await, "g").observe(),
    ];

    let first = one.campaign("one").await.expect("campaign");
    for observer in &mut observers {
        let leader = next_leader(observer).await;
        assert_eq!(
            (leader.term, &leader.value[..]),
            (first.term(), &b"one"[..])
        );
    }
    let second = tokio::spawn(async move { two.campaign("two").await });
    let deadline = Instant::now() + PATIENCE;
    while !matches!(
        observer_client.inspect("election/g").await,
        Ok(KeyState::Held { waiters: 1, .. })
    ) {
        assert!(Instant::now() < deadline, "second candidate never queued");
        // Virtual time (paused clock): costs no real time.
        tokio::time::sleep(ms(5)).await;
    }

    let lost = first.lost();
    let dropped_at = Instant::now();
    one.client().disconnect();
    let second = timeout(PATIENCE, second)
        .await
        .expect("failover")
        .expect("task");
    let failover = dropped_at.elapsed();
    let second = second.expect("campaign");
    // Virtual time: a few hops over loopback, each at most one server tick (2 ms).
    eprintln!("election failover after disconnect: {failover:?} (virtual)");
    assert!(failover < ms(100), "failover took {failover:?}");
    let reason = timeout(PATIENCE, lost)
        .await
        .expect("old leader hears of it");
    assert!(matches!(reason, LossReason::Disconnected(_)), "{reason:?}");
    assert!(second.term() > first.term());

    let third = tokio::spawn(async move { three.campaign("three").await });
    second.resign().await.expect("resign");
    let third = timeout(PATIENCE, third)
        .await
        .expect("hand-off")
        .expect("task")
        .expect("campaign");
    assert!(third.term() > second_term_of(&mut observers).await);
    for observer in &mut observers {
        let leader = next_leader(observer).await;
        assert_eq!(&leader.value[..], b"three");
        assert_eq!(leader.term, third.term());
    }
}

/// Reads the second leader from every observer and checks they agree; returns its term.
async fn second_term_of(observers: &mut [tenure::Observer]) -> u64 {
    let mut terms = Vec::new();
    for observer in observers.iter_mut() {
        let leader = next_leader(observer).await;
        assert_eq!(&leader.value[..], b"two");
        terms.push(leader.term);
    }
    assert!(
        terms.windows(2).all(|w| w[0] == w[1]),
        "observers disagree: {terms:?}"
    );
    terms[0]
}

#[tokio::test(start_paused = true)]
async fn an_observer_resubscribes_after_its_connection_drops() {
    let server = Server::start_virtual().await;
    let observer_client = server.client().await;
    let mut observer = Election::new(observer_client.clone(), "re").observe();
    let candidates = Election::new(server.client().await, "re");
    let first = candidates.campaign("first").await.expect("campaign");
    assert_eq!(next_leader(&mut observer).await.term, first.term());

    observer_client.disconnect();
    let failed = timeout(PATIENCE, observer.next()).await.expect("an item");
    assert!(
        matches!(failed, Some(Err(Error::ConnectionLost(_)))),
        "{failed:?}"
    );
    first.resign().await.expect("resign");
    let second = candidates.campaign("second").await.expect("campaign");
    // Subscribing again reads the current leader: the observer catches up, in term order.
    let leader = next_leader(&mut observer).await;
    assert_eq!(
        (leader.term, &leader.value[..]),
        (second.term(), &b"second"[..])
    );
}

// ---------------------------------------------------------------------------------------------
// A lease won after a long wait: its lease starts at the grant, not when the request was sent.

#[tokio::test(start_paused = true)]
async fn a_lease_won_after_waiting_five_ttls_is_kept_for_three_more() {
    let server = Server::start_virtual().await;
    let holder = server.client().await;
    let waiter = server.client().await;
    let ttl = PATIENT_TTL;
    let held = holder
        .lock("patient", ttl, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let waiting = tokio::spawn(async move {
        let options = AcquireOptions::wait(PATIENCE);
        waiter.acquire("patient", ttl, options).await
    });
    wait_for_waiters(&holder, "patient", 1).await;
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(5 * ttl).await;
    assert!(held.is_valid(), "the holder kept renewing");
    let released_at = Instant::now();
    held.release().await.expect("release");
    let lease = timeout(PATIENCE, waiting)
        .await
        .expect("hand-off")
        .expect("task")
        .expect("acquire")
        .granted()
        .expect("granted after waiting");
    let granted_at = Instant::now();
    // Virtual time: the wait was five TTLs (and a few ticks), by the server's clock.
    assert!(lease.waited() >= 5 * ttl, "waited {:?}", lease.waited());
    assert!(lease.waited() <= granted_at - released_at + 5 * ttl + PATIENT_TTL / 4);
    // Counted from the grant (after the release), not from the send five TTLs earlier; and
    // never later than the server's, which started no later than the reply arrived.
    assert!(
        lease.deadline() > released_at + ttl / 2,
        "deadline {:?} before the release",
        released_at.saturating_duration_since(lease.deadline())
    );
    assert!(lease.deadline() <= granted_at + ttl);
    assert!(!lease.is_expired());

    let token = lease.fencing_token();
    let guard = lease.keep_alive();
    stays_held(&holder, "patient", token, 3 * ttl, || guard.is_valid()).await;
    assert_eq!(guard.loss_reason(), None, "no loss signalled");
    assert_eq!(
        guard.release().await.expect("release"),
        ReleaseOutcome::Released
    );
}

#[tokio::test(start_paused = true)]
async fn an_election_standby_that_waited_five_ttls_leads_for_three_more() {
    let server = Server::start_virtual().await;
    let observer = server.client().await;
    let ttl = PATIENT_TTL;
    let options = ElectionOptions {
        ttl,
        ..ElectionOptions::default()
    };
    let first = Election::with_options(server.client().await, "patient", options);
    let standby = Election::with_options(server.client().await, "patient", options);
    let leader = first.campaign("first").await.expect("campaign");
    let campaign = tokio::spawn(async move { standby.campaign("second").await });
    wait_for_waiters(&observer, "election/patient", 1).await;
    // Virtual time (paused clock): costs no real time.
    tokio::time::sleep(5 * ttl).await;
    assert!(leader.is_valid(), "the leader kept renewing");
    leader.resign().await.expect("resign");
    let second = timeout(PATIENCE, campaign)
        .await
        .expect("hand-off")
        .expect("task")
        .expect("campaign");
    let term = second.term();
    stays_held(&observer, "election/patient", term, 3 * ttl, || {
        second.is_valid()
    })
    .await;
    assert_eq!(second.guard().loss_reason(), None, "no loss signalled");
    second.resign().await.expect("resign");
}

#[tokio::test]
async fn server_limits_come_from_the_handshake() {
    let server = TestServer::start_with(|config| {
        config.ttl_ms_max = 90_000;
        config.in_flight_max = 33;
    });
    let client = Client::connect(server.addr.clone()).await.expect("connect");
    let limits = client.server_limits().expect("connected");
    assert_eq!((limits.ttl_ms_max, limits.in_flight_max), (90_000, 33));
    assert_eq!(limits.wait_ms_max, tenure_protocol::limits::WAIT_MS_MAX);
    assert_eq!(limits.key_len_max, 1024);
    assert_eq!(limits.meta_len_max, 1024);
    assert_eq!(limits.frame_len_max, 8192);
    client.disconnect();
    assert!(client.server_limits().is_none(), "no connection, no limits");
}

/// The next event of `watch`, as (kind, token).
async fn next_event(watch: &mut tenure::Watch) -> (EventKind, u64) {
    let event = timeout(PATIENCE, watch.next())
        .await
        .expect("an event in time")
        .expect("watch open")
        .expect("event");
    (event.kind, event.token)
}

#[tokio::test(start_paused = true)]
async fn a_watch_starts_from_the_holder_and_a_second_watch_of_the_key_shares_its_events() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let options = AcquireOptions {
        meta: "leader-1".into(),
        ..AcquireOptions::default()
    };
    let lease = client
        .acquire("k", Duration::from_secs(30), options)
        .await
        .expect("acquire")
        .granted()
        .expect("granted");
    let token = lease.fencing_token();
    let mut first = client.watch("k").await.expect("watch");
    match first.initial_state() {
        KeyState::Held {
            token: held,
            ttl_left,
            meta,
            ..
        } => {
            assert_eq!((*held, &meta[..]), (token, &b"leader-1"[..]));
            assert!(*ttl_left > Duration::from_secs(20), "{ttl_left:?}");
        }
        other => panic!("expected the holder, got {other:?}"),
    }
    lease.release().await.expect("release");
    assert_eq!(next_event(&mut first).await, (EventKind::Released, token));
    // A second watch of the key on the same connection starts from the state now, and both
    // see what follows.
    let mut second = client.watch("k").await.expect("second watch");
    assert_eq!(second.initial_state(), &KeyState::Free);
    let lease = granted(&client, "k", Duration::from_secs(30)).await;
    let granted_event = (EventKind::Granted, lease.fencing_token());
    assert_eq!(next_event(&mut first).await, granted_event);
    assert_eq!(next_event(&mut second).await, granted_event);
    // Dropping one leaves the other running.
    drop(second);
    let token = lease.fencing_token();
    lease.release().await.expect("release");
    assert_eq!(next_event(&mut first).await, (EventKind::Released, token));
}

#[tokio::test]
async fn a_guard_that_lost_touch_releases_the_lease_a_restart_restored_when_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path()).await;
    let addr = server.addr;
    let client = Client::connect(addr.to_string()).await.unwrap();
    // Long enough that the restored lease outlives the checks below by seconds.
    let ttl = Duration::from_secs(3);
    let guard = client
        .lock("restored", ttl, AcquireOptions::default())
        .await
        .unwrap()
        .granted()
        .expect("free");
    server.stop().await;
    let reason = timeout(PATIENCE, guard.lost()).await.expect("loss signal");
    assert!(matches!(reason, LossReason::Expired { .. }), "{reason:?}");
    // The restart restores the lease from the WAL, with its TTL counted again.
    let server = Server::start_at(tenure_server::Config::for_tests(dir.path()), addr).await;
    let observer = Client::connect(addr.to_string()).await.unwrap();
    assert!(matches!(
        observer.inspect("restored").await.unwrap(),
        KeyState::Held { .. }
    ));
    drop(guard);
    let deadline = Instant::now() + Duration::from_secs(2);
    while !matches!(observer.inspect("restored").await.unwrap(), KeyState::Free) {
        assert!(
            Instant::now() < deadline,
            "the dropped guard did not release it"
        );
        tokio::time::sleep(ms(20)).await;
    }
    server.stop().await;
}
