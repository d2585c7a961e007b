//! The client crate's integration tests, one test binary, against a real `tenure-server` on
//! port 0 (the harness is the `tenure-testkit` crate's):
//! - `e2e`: the library — requests, lease guards, loss signals, fencing, watches, elections,
//!   leases and leaderships won after a long wait;
//! - `cli`: the `tenure` command line — `run`, `elect`, exit codes, output field names,
//!   `tenure console`;
//! - `auth`: credentials sent on every (re)connect, and `tenure --identity` with `TENURE_SECRET`;
//! - `cluster`: `tenure cluster status|add|remove` against in-process cluster nodes;
//! - `certs`: `tenure certs` and CLUSTER.md's openssl recipe make a secure cluster that serves;
//! - `failover`: lease guards and elections riding through a three-node cluster's fail-over,
//!   and a request sent mid-election;
//! - `kinds`: semaphores and read/write locks through the library, `tenure run --permits` /
//!   `--shared` and the console;
//! - `api_paths`: every public path of the crate still resolves (a compile-time guard);
//! - `layout`: the import rules of `client/src` (which module may use which);
//! - `readme`: README.md's console and command-line examples, read from it and run in order;
//! - `sessions`: one keep-alive for many locks, closing, a session whose keep-alives stop;
//! - `terminal`: `tenure run` at a pseudo-terminal: the command reads it, gets Ctrl-C and
//!   Ctrl-Z, and the shell gets the terminal back.
//!
//! Tests of leases, guards, expiry, renewals and elections run on a paused clock
//! (`#[tokio::test(start_paused = true)]`) with the server in the test's own runtime
//! ([`tenure_testkit::Server::start_virtual`]): a lease runs out in virtual time, so the tests
//! wait for nothing and their bounds hold on any machine, however slow. Tests that kill the
//! server ([`tenure_testkit::ThreadServer`], a runtime of its own that is dropped at once, as a
//! crash would) or run the `tenure` binary (a process of its own, on the real clock) run in
//! real time, with bounds in seconds.

mod api_paths;
mod auth;
mod certs;
mod cli;
mod cluster;
mod command_group;
mod e2e;
mod failover;
mod kinds;
mod layout;
mod readme;
mod sessions;
mod terminal;

use std::time::Duration;

use tenure::{AcquireOptions, AcquireOutcome, Client, KeyState, Leader};
use tenure_testkit::{ms, PATIENCE};
use tokio::time::{timeout, Instant};

/// Acquires `key` without waiting; panics unless it is granted.
pub(crate) async fn granted(client: &Client, key: &str, ttl: Duration) -> tenure::Lease {
    match client
        .acquire(key, ttl, AcquireOptions::default())
        .await
        .expect("acquire")
    {
        AcquireOutcome::Granted(lease) => lease,
        AcquireOutcome::Locked(by) => panic!("{key} is held by token {}", by.token),
    }
}

/// Waits until `observer` yields a leader; errors of a failed watch are skipped.
pub(crate) async fn next_leader(observer: &mut tenure::Observer) -> Leader {
    loop {
        match timeout(PATIENCE, observer.next()).await.expect("a leader") {
            Some(Ok(leader)) => return leader,
            Some(Err(e)) => eprintln!("observer: {e}"),
            None => panic!("observer ended"),
        }
    }
}

/// Lease length of the long-wait tests: waiters wait five of these, then hold for three.
pub(crate) const PATIENT_TTL: Duration = Duration::from_millis(400);

/// Waits until `key` has `count` waiters queued. Virtual time in the library's tests; real time
/// in the command line's, where the waiter is a `tenure` process.
pub(crate) async fn wait_for_waiters(client: &Client, key: &str, count: u32) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let KeyState::Held { waiters, .. } = client.inspect(key).await.expect("inspect") {
            if waiters == count {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never had {count} waiters");
        // Virtual time in the library's tests; real time in the command line's (a `tenure`
        // process waits), polling a few round trips.
        tokio::time::sleep(ms(5)).await;
    }
}

/// Checks for `span` that `is_valid` stays true and the server holds `key` under `token`.
pub(crate) async fn stays_held(
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
        // Virtual time in the library's tests; real time in the command line's, where the holder
        // is a `tenure` process on the real clock.
        tokio::time::sleep(ms(20)).await;
    }
}
