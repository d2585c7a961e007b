//! End-to-end tests: the client, the lease guard, elections and the `tenure` binary against a
//! real `tenure-server` on port 0.
//!
//! Tests of leases, guards, expiry, renewals and elections run on a paused clock
//! (`#[tokio::test(start_paused = true)]`) with the server in the test's own runtime
//! ([`Server::start_virtual`]): a lease runs out in virtual time, so the tests wait for nothing
//! and their bounds hold on any machine, however slow. Tests that kill the server
//! ([`ThreadServer`], a runtime of its own that is dropped at once, as a crash would) or run
//! the `tenure` binary (a process of its own, on the real clock) run in real time, with bounds
//! in seconds.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tenure::{
    AcquireOptions, AcquireOutcome, CheckOutcome, Client, ClientConfig, Election, ElectionOptions,
    Error, ErrorCode, EventKind, Fence, KeyState, Leader, LeaseId, LossReason, ReleaseOutcome,
    RenewOutcome,
};
use tenure_testkit::{field, ms, Server, ThreadServer as TestServer, PATIENCE};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

async fn granted(client: &Client, key: &str, ttl: Duration) -> tenure::Lease {
    match client
        .acquire(key, ttl, AcquireOptions::default())
        .await
        .expect("acquire")
    {
        AcquireOutcome::Granted(lease) => lease,
        AcquireOutcome::Locked(by) => panic!("{key} is held by token {}", by.token),
    }
}

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
    // Counted from before the send, less the server's whole-millisecond rounding.
    let counted = ttl - tenure::lease::SERVER_ROUNDING;
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
async fn a_lost_connection_fails_requests_in_flight_and_the_next_request_reconnects() {
    let server = Server::start_virtual().await;
    let client = server.client().await;
    let _held = granted(&client, "busy", Duration::from_secs(5)).await;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            let options = AcquireOptions::wait(Duration::from_secs(5));
            client
                .acquire("busy", Duration::from_secs(1), options)
                .await
        })
    };
    tokio::time::sleep(ms(100)).await;
    client.disconnect();
    let result = timeout(PATIENCE, waiting)
        .await
        .expect("fails promptly")
        .expect("task");
    assert!(
        matches!(result, Err(Error::ConnectionLost(_))),
        "{result:?}"
    );
    assert!(!client.is_connected());
    client.ping().await.expect("the next request reconnects");
    assert!(client.is_connected());
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

/// Waits until `observer` yields a leader; errors of a failed watch are skipped.
async fn next_leader(observer: &mut tenure::Observer) -> Leader {
    loop {
        match timeout(PATIENCE, observer.next()).await.expect("a leader") {
            Some(Ok(leader)) => return leader,
            Some(Err(e)) => eprintln!("observer: {e}"),
            None => panic!("observer ended"),
        }
    }
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

fn tenure_cli(addr: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
    command.arg("--addr").arg(addr).kill_on_drop(true);
    command
}

/// Runs the CLI with `args`; returns exit code, stdout and stderr.
async fn cli(addr: &str, args: &[&str]) -> (i32, String, String) {
    let output = timeout(PATIENCE, tenure_cli(addr).args(args).output())
        .await
        .expect("tenure finishes")
        .expect("tenure runs");
    (
        output.status.code().expect("exited normally"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn cli_commands_print_key_values_and_exit_with_the_documented_codes() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "c", "--ttl", "5s", "--meta", "me"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(field(&out, "result"), "GRANTED");
    let token = field(&out, "token").to_owned();
    let lease = field(&out, "lease").to_owned();
    let (code, out, _) = cli(addr, &["acquire", "c", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "result")), (3, "LOCKED"));
    assert_eq!(field(&out, "token"), token);
    assert_eq!(cli(addr, &["check", "c", &token]).await.0, 0);
    assert_eq!(cli(addr, &["check", "c", "999999"]).await.0, 6);
    assert_eq!(cli(addr, &["renew", "c", &lease, "--ttl", "5s"]).await.0, 0);
    let other = LeaseId::from_u128(7).to_string();
    assert_eq!(cli(addr, &["release", "c", &other]).await.0, 5);
    let (code, out, _) = cli(addr, &["inspect", "c"]).await;
    assert_eq!((code, field(&out, "meta")), (0, "me"));
    assert_eq!(cli(addr, &["release", "c", &lease]).await.0, 0);
    assert_eq!(cli(addr, &["renew", "c", &lease, "--ttl", "1s"]).await.0, 4);
    let (code, out, _) = cli(addr, &["--json", "inspect", "c"]).await;
    assert_eq!((code, out.trim()), (0, r#"{"result":"FREE","key":"c"}"#));
    assert_eq!(cli(addr, &["ping"]).await.0, 0);
    assert_eq!(cli(addr, &["stats"]).await.0, 0);
    assert_eq!(cli(addr, &["acquire", "c"]).await.0, 1, "missing --ttl");
    assert_eq!(
        cli(addr, &["acquire", "c", "--ttl", "1x"]).await.0,
        1,
        "bad duration"
    );
    assert_eq!(cli("127.0.0.1:1", &["ping"]).await.0, 1, "nothing listens");
    assert_eq!(cli(addr, &["--help"]).await.0, 0);
}

#[tokio::test]
async fn cli_run_passes_the_token_and_returns_the_commands_status() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("token");
    let script = format!(
        "echo $TENURE_FENCING_TOKEN $TENURE_KEY $TENURE_LEASE_ID > {}",
        file.display()
    );
    let args = [
        "run", "--key", "cli/run", "--ttl", "1s", "--", "sh", "-c", &script,
    ];
    let (code, _, err) = cli(addr, &args).await;
    assert_eq!(code, 0, "{err}");
    let written = std::fs::read_to_string(&file).expect("the command wrote its env");
    let words: Vec<&str> = written.split_whitespace().collect();
    assert_eq!(words.len(), 3, "{written:?}");
    assert_eq!(words[0], field(&err, "token"));
    assert_eq!(words[1], "cli/run");
    assert_eq!(words[2], field(&err, "lease"));
    let client = server.client().await;
    assert_eq!(
        client.inspect("cli/run").await.expect("inspect"),
        KeyState::Free,
        "released"
    );

    let exit_7 = [
        "run", "--key", "cli/run", "--ttl", "1s", "--", "sh", "-c", "exit 7",
    ];
    assert_eq!(cli(addr, &exit_7).await.0, 7);
    let killed = [
        "run",
        "--key",
        "cli/run",
        "--ttl",
        "1s",
        "--",
        "sh",
        "-c",
        "kill -TERM $$",
    ];
    assert_eq!(cli(addr, &killed).await.0, 128 + 15);

    let _held = granted(&client, "cli/busy", Duration::from_secs(5)).await;
    let busy = ["run", "--key", "cli/busy", "--ttl", "1s", "--", "true"];
    assert_eq!(cli(addr, &busy).await.0, 3, "LOCKED");
}

/// Starts `tenure run` with `script`, which must write $TENURE_LEASE_ID to the file named by
/// its first argument; releases the lease behind its back and returns its exit code.
async fn run_and_revoke(
    server: &TestServer,
    key: &str,
    grace: &str,
    script: &str,
) -> (i32, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("lease");
    let child = tenure_cli(&server.addr)
        .args([
            "run", "--key", key, "--ttl", "300ms", "--grace", grace, "--",
        ])
        .args(["sh", "-c", script, "sh"])
        .arg(&file)
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let lease_id = wait_for_lease_id(&file).await;
    let client = server.client().await;
    let released = client.release(key, lease_id).await.expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after the loss")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code().expect("exited normally"), stderr)
}

async fn wait_for_lease_id(file: &Path) -> LeaseId {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            if let Some(id) = LeaseId::from_hex(text.trim()) {
                return id;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the command never wrote its lease id"
        );
        tokio::time::sleep(ms(10)).await; // real time: a child process writes the file
    }
}

#[tokio::test]
async fn cli_run_kills_its_command_when_the_lease_is_lost() {
    let server = TestServer::start();
    // SIGTERM is enough for a command that does not catch it.
    let script = "echo $TENURE_LEASE_ID > \"$1\"; exec sleep 30";
    let started = Instant::now();
    let (code, stderr) = run_and_revoke(&server, "cli/loss", "5s", script).await;
    assert_eq!(code, 4, "{stderr}");
    assert!(stderr.contains("result=LOST"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(10), // far less than the command's 30 s
        "{:?}",
        started.elapsed()
    );

    // A command that ignores SIGTERM is killed after the grace period.
    let stubborn = "trap '' TERM; echo $TENURE_LEASE_ID > \"$1\"; while :; do sleep 0.05; done";
    let (code, stderr) = run_and_revoke(&server, "cli/stubborn", "200ms", stubborn).await;
    assert_eq!(code, 4, "{stderr}");
}

#[tokio::test]
async fn cli_observe_prints_each_new_leader() {
    let server = TestServer::start();
    let election = Election::new(server.client().await, "cli");
    let leader = election.campaign("alpha").await.expect("campaign");
    let mut observe = tenure_cli(&server.addr)
        .args(["observe", "cli"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let stdout = observe.stdout.take().expect("piped");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = timeout(PATIENCE, lines.next_line())
        .await
        .expect("a line")
        .expect("read");
    assert_eq!(
        line.as_deref(),
        Some(&*format!("term={} value=alpha", leader.term()))
    );
    leader.resign().await.expect("resign");
    let next = election.campaign("beta").await.expect("campaign");
    let line = timeout(PATIENCE, lines.next_line())
        .await
        .expect("a line")
        .expect("read");
    assert_eq!(
        line.as_deref(),
        Some(&*format!("term={} value=beta", next.term()))
    );
    observe.kill().await.expect("kill observe");
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

#[tokio::test]
async fn cli_elect_runs_the_command_while_leading_and_resigns() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("term");
    let script = "echo $TENURE_FENCING_TOKEN > \"$1\"; exit 9";
    let file_arg = file.to_str().expect("utf-8 path");
    let args = [
        "elect", "cli-g", "--value", "me", "--ttl", "1s", "--", "sh", "-c", script, "sh", file_arg,
    ];
    let (code, _, err) = cli(&server.addr, &args).await;
    assert_eq!(code, 9, "the command's status: {err}");
    assert_eq!(field(&err, "result"), "LEADING");
    let term = std::fs::read_to_string(&file).expect("the command ran");
    assert_eq!(term.trim(), field(&err, "term"));
    let client = server.client().await;
    let state = client.inspect("election/cli-g").await.expect("inspect");
    assert_eq!(state, KeyState::Free, "resigned after the command");
}

#[tokio::test]
async fn cli_run_passes_sigterm_on_and_still_releases() {
    let server = TestServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("lease");
    let script = "echo $TENURE_LEASE_ID > \"$1\"; exec sleep 30";
    let child = tenure_cli(&server.addr)
        .args([
            "run", "--key", "cli/term", "--ttl", "5s", "--", "sh", "-c", script, "sh",
        ])
        .arg(&file)
        .spawn()
        .expect("tenure runs");
    wait_for_lease_id(&file).await;
    let pid = child.id().expect("running").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(kill.expect("kill runs").success());
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(128 + 15), "the command's status");
    let client = server.client().await;
    let state = client.inspect("cli/term").await.expect("inspect");
    assert_eq!(state, KeyState::Free, "released, not left to expire");
}

#[tokio::test]
async fn cli_console_answers_one_line_per_command() {
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start();
    let mut console = tenure_cli(&server.addr)
        .arg("console")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let mut stdin = console.stdin.take().expect("piped");
    let input =
        "acquire con --ttl 5s --meta x\ninspect con\nbogus\n\nrun --key k --ttl 1s -- true\nping\n";
    stdin.write_all(input.as_bytes()).await.expect("write");
    drop(stdin);
    let output = timeout(PATIENCE, console.wait_with_output())
        .await
        .expect("console exits at end of input")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let results: Vec<&str> = stdout.lines().map(|line| field(line, "result")).collect();
    assert_eq!(
        results,
        ["GRANTED", "HELD", "ERROR", "ERROR", "PONG"],
        "{stdout}"
    );
}

// ---------------------------------------------------------------------------------------------
// A lease won after a long wait: its lease starts at the grant, not when the request was sent.

/// Lease length of the long-wait tests: waiters wait five of these, then hold for three.
const PATIENT_TTL: Duration = Duration::from_millis(400);

/// Waits until `key` has `count` waiters queued. Virtual time in the library's tests; real time
/// in the command line's, where the waiter is a `tenure` process.
async fn wait_for_waiters(client: &Client, key: &str, count: u32) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let KeyState::Held { waiters, .. } = client.inspect(key).await.expect("inspect") {
            if waiters == count {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never had {count} waiters");
        tokio::time::sleep(ms(5)).await;
    }
}

/// Checks for `span` that `is_valid` stays true and the server holds `key` under `token`.
async fn stays_held(
    client: &Client,
    key: &str,
    token: u64,
    span: Duration,
    is_valid: impl Fn() -> bool,
) {
    let started = Instant::now();
    while started.elapsed() < span {
        assert!(
            is_valid(),
            "lost validity {:?} after the grant",
            started.elapsed()
        );
        match client.inspect(key).await.expect("inspect") {
            KeyState::Held { token: held, .. } => {
                assert_eq!(held, token, "someone else holds {key}")
            }
            KeyState::Free => panic!("{key} is free {:?} after the grant", started.elapsed()),
        }
        tokio::time::sleep(ms(20)).await;
    }
}

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

/// Holds `key` through a renewing guard until `tenure` queues behind it, five TTLs more, then
/// releases it; `child` must then get the lock and run its three-TTL command to the end.
async fn cli_waits_then_holds(
    server: &TestServer,
    key: &str,
    guard: tenure::LeaseGuard,
    child: tokio::process::Child,
) -> String {
    let client = server.client().await;
    wait_for_waiters(&client, key, 1).await;
    // Real time: the waiter is a `tenure` process, on the real clock.
    tokio::time::sleep(5 * PATIENT_TTL).await;
    assert!(guard.is_valid(), "the holder kept renewing");
    guard.release().await.expect("release");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits after its command")
        .expect("tenure runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(0),
        "the command's status: {stderr}"
    );
    assert!(!stderr.contains("LOST"), "{stderr}");
    stderr
}

#[tokio::test]
async fn cli_run_keeps_a_lock_won_after_a_long_wait() {
    let server = TestServer::start();
    let holder = server.client().await;
    let guard = holder
        .lock("cli/patient", PATIENT_TTL, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let hold_for = format!("sleep {}", (3 * PATIENT_TTL).as_secs_f64());
    let child = tenure_cli(&server.addr)
        .args([
            "run",
            "--key",
            "cli/patient",
            "--ttl",
            "400ms",
            "--wait",
            "5s",
        ])
        .args(["--", "sh", "-c", &hold_for])
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let stderr = cli_waits_then_holds(&server, "cli/patient", guard, child).await;
    assert_eq!(field(&stderr, "result"), "GRANTED");
}

#[tokio::test]
async fn cli_elect_keeps_leading_after_a_long_wait() {
    let server = TestServer::start();
    let options = ElectionOptions {
        ttl: PATIENT_TTL,
        ..ElectionOptions::default()
    };
    let election = Election::with_options(server.client().await, "cli-patient", options);
    let leader = election.campaign("first").await.expect("campaign");
    let hold_for = format!("sleep {}", (3 * PATIENT_TTL).as_secs_f64());
    let child = tenure_cli(&server.addr)
        .args([
            "elect",
            "cli-patient",
            "--value",
            "second",
            "--ttl",
            "400ms",
        ])
        .args(["--", "sh", "-c", &hold_for])
        .stderr(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    let key = "election/cli-patient";
    let stderr = cli_waits_then_holds(&server, key, leader.into_guard(), child).await;
    assert_eq!(field(&stderr, "result"), "LEADING");
}

#[tokio::test]
async fn cli_acquire_prints_how_long_it_waited() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "cli/w", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "waited_ms")), (0, "0"), "{out}");
    let client = server.client().await;
    let guard = client
        .lock("cli/held", PATIENT_TTL, AcquireOptions::default())
        .await
        .expect("lock")
        .granted()
        .expect("free");
    let args = ["acquire", "cli/held", "--ttl", "5s", "--wait", "5s"];
    let spawned_at = Instant::now();
    let child = tenure_cli(addr)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("tenure runs");
    wait_for_waiters(&client, "cli/held", 1).await;
    tokio::time::sleep(PATIENT_TTL).await; // real time: the waiter is a `tenure` process
    guard.release().await.expect("release");
    let output = timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("tenure exits")
        .expect("tenure runs");
    let elapsed_ms = spawned_at.elapsed().as_millis();
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{out}");
    let waited_ms: u128 = field(&out, "waited_ms").parse().expect("a number");
    // In line from before it was seen queued until the release one TTL later (less 1 ms of
    // clock rounding), and not longer than the process ran.
    assert!(waited_ms + 1 >= PATIENT_TTL.as_millis(), "{out}");
    assert!(waited_ms <= elapsed_ms, "{out}: ran {elapsed_ms} ms");
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

// ---------------------------------------------------------------------------------------------
// One grammar and one name per thing: `tenure console` reads the server console's lines, and
// the command line prints the console's field names.

/// Every output line of the command line names things as the console does.
fn assert_console_names(text: &str) {
    for old in ["lease_id=", "ttl_left_ms", "\"lease_id\""] {
        assert!(!text.contains(old), "{old} in {text:?}");
    }
}

#[tokio::test]
async fn cli_prints_the_consoles_field_names() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, _) = cli(addr, &["acquire", "names", "--ttl", "5s"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(LeaseId::from_hex(field(&out, "lease")).is_some(), "{out}");
    assert_eq!(field(&out, "ttl_ms"), "5000", "{out}");
    assert!(out.trim_end().ends_with("waited_ms=0"), "{out}");
    let mut printed = out;
    let (code, out, _) = cli(addr, &["acquire", "names", "--ttl", "5s"]).await;
    assert_eq!((code, field(&out, "result")), (3, "LOCKED"), "{out}");
    let left_ms: u64 = field(&out, "ttl_ms").parse().expect("a number");
    assert!((1..=5000).contains(&left_ms), "{out}");
    printed += &out;
    let (code, out, _) = cli(addr, &["inspect", "names"]).await;
    assert_eq!((code, field(&out, "result")), (0, "HELD"), "{out}");
    let left_ms: u64 = field(&out, "ttl_ms").parse().expect("a number");
    assert!((1..=5000).contains(&left_ms), "{out}");
    printed += &out;
    let (_, json, _) = cli(addr, &["--json", "inspect", "names"]).await;
    assert!(json.contains(r#""ttl_ms":"#), "{json}");
    printed += &json;
    let (_, json, _) = cli(addr, &["--json", "acquire", "names/2", "--ttl", "5s"]).await;
    assert!(json.contains(r#""lease":""#), "{json}");
    printed += &json;
    assert_console_names(&printed);
}

#[tokio::test]
async fn cli_reads_a_bare_duration_as_milliseconds_with_a_deprecation_note() {
    let server = TestServer::start();
    let addr = server.addr.as_str();
    let (code, out, err) = cli(addr, &["acquire", "bare", "--ttl", "1500"]).await;
    assert_eq!((code, field(&out, "ttl_ms")), (0, "1500"), "{out}");
    assert!(err.contains("deprecated"), "{err:?}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    let (code, out, err) = cli(addr, &["acquire", "unit", "--ttl", "1500ms"]).await;
    assert_eq!((code, field(&out, "ttl_ms")), (0, "1500"), "{out}");
    assert_eq!(err, "", "no note when the unit is written");
}

/// A `tenure console` child with its stdin and stdout at hand, answering line by line.
struct Console {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Console {
    fn start(addr: &str) -> Console {
        let mut child = tenure_cli(addr)
            .arg("console")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tenure runs");
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stdout = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        Console {
            child,
            stdin,
            stdout,
        }
    }

    /// The next line the console prints.
    async fn next(&mut self) -> String {
        timeout(PATIENCE, self.stdout.next_line())
            .await
            .expect("an answer in time")
            .expect("read")
            .expect("a line before the end")
    }

    /// Sends `line` and returns the answer.
    async fn ask(&mut self, line: &str) -> String {
        use tokio::io::AsyncWriteExt;
        let sent = format!("{line}\n");
        self.stdin.write_all(sent.as_bytes()).await.expect("write");
        self.next().await
    }
}

#[tokio::test]
async fn cli_console_reads_the_server_consoles_grammar() {
    let server = TestServer::start();
    let mut console = Console::start(&server.addr);
    let granted = console.ask("ACQUIRE con/g 30000 5000 META=me").await;
    assert_eq!(field(&granted, "result"), "GRANTED", "{granted}");
    assert_eq!(field(&granted, "ttl_ms"), "30000", "{granted}");
    let (token, lease) = (field(&granted, "token"), field(&granted, "lease"));
    let held = console.ask("inspect con/g").await;
    assert_eq!(
        (field(&held, "result"), field(&held, "meta")),
        ("HELD", "me")
    );
    let locked = console.ask("ACQUIRE con/g 1000").await;
    assert_eq!(field(&locked, "result"), "LOCKED", "{locked}");
    let renewed = console.ask(&format!("RENEW con/g {lease} 20000")).await;
    assert_eq!(field(&renewed, "ttl_ms"), "20000", "{renewed}");
    let current = console.ask(&format!("CHECK con/g {token}")).await;
    assert_eq!(field(&current, "result"), "CURRENT", "{current}");
    let released = console.ask(&format!("RELEASE con/g {lease}")).await;
    assert_eq!(field(&released, "result"), "RELEASED", "{released}");
    let refused = console.ask("ACQUIRE con/g 30s").await;
    assert_eq!(
        (field(&refused, "result"), field(&refused, "code")),
        ("ERROR", "BAD_ARGS"),
        "{refused}"
    );
    let help = console.ask("HELP").await;
    assert!(
        help.contains("ACQUIRE <key> <ttl_ms> [<wait_ms>]"),
        "{help}"
    );
    let watching = console.ask("WATCH con/w").await;
    assert_eq!(field(&watching, "result"), "WATCHING", "{watching}");
    let _lease = granted_meta(&server.client().await, "con/w").await;
    let event = console.next().await;
    assert_eq!(
        (field(&event, "result"), field(&event, "kind")),
        ("EVENT", "GRANTED"),
        "{event}"
    );
    let unwatched = console.ask("UNWATCH con/w").await;
    assert_eq!(field(&unwatched, "result"), "UNWATCHED", "{unwatched}");
    assert_console_names(&[granted, held, locked].join("\n"));
    let old = console.ask("acquire con/old --ttl 5s").await;
    assert_eq!(
        field(&old, "result"),
        "GRANTED",
        "the old spelling still works: {old}"
    );
    let output = quit(console).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "one note: {stderr:?}");
    assert!(stderr.contains("deprecated"), "{stderr:?}");
}

/// Takes `key` with metadata, as a watcher's GRANTED event shows it.
async fn granted_meta(client: &Client, key: &str) -> tenure::Lease {
    let options = AcquireOptions {
        meta: "w".into(),
        ..AcquireOptions::default()
    };
    client
        .acquire(key, Duration::from_secs(5), options)
        .await
        .expect("acquire")
        .granted()
        .expect("free")
}

/// Sends QUIT; the console must print nothing more and exit 0.
async fn quit(mut console: Console) -> std::process::Output {
    use tokio::io::AsyncWriteExt;
    console.stdin.write_all(b"QUIT\n").await.expect("write");
    let rest = timeout(PATIENCE, console.stdout.next_line())
        .await
        .expect("the console ends")
        .expect("read");
    assert_eq!(rest, None, "nothing after QUIT");
    let output = timeout(PATIENCE, console.child.wait_with_output())
        .await
        .expect("the console exits after QUIT")
        .expect("tenure runs");
    assert_eq!(output.status.code(), Some(0));
    output
}
