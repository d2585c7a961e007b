//! Server-wide limits over real TCP at the default shard count: each is exact (exactly N
//! granted or queued, the N+1th refused with a message naming the limit), and every way a
//! lock or a waiter goes away gives its place back exactly.

use std::time::Duration;

use bytes::BytesMut;
use tenure_protocol::frame::encode_request;
use tenure_protocol::{ErrorCode, Request, Response};
use tenure_server::wal::FaultPlan;
use tenure_server::Config;
use tenure_testkit::{field, Console, Raw, Server};
use tokio::time::Instant;

/// Distinct keys tried against a limit: many more than the limit, spread over the shards.
const KEYS_TRIED: usize = 40;
/// Longest a test polls STATS for a count to settle.
const SETTLE_MAX: Duration = Duration::from_secs(5);

/// A server at the default shard count, on a paused clock (the tests below let leases and
/// waits run out), with `tweak` applied to its configuration.
async fn start(tweak: impl FnOnce(&mut Config)) -> Server {
    Server::start_virtual_with(|config| {
        tweak(config);
        assert_eq!(config.shards, Config::default().shards, "default shards");
    })
    .await
}

/// What these tests ask of a console beyond one line out, one line back.
trait Counting {
    /// A STATS counter.
    async fn stat(&mut self, name: &str) -> u64;
    /// Polls STATS until `name` is `want`, for at most `SETTLE_MAX`.
    async fn settle(&mut self, name: &str, want: u64);
    /// Acquires `KEYS_TRIED` fresh keys `prefix0..`; returns the lease ids granted and checks
    /// every refusal is `refusal`.
    async fn acquire_many(&mut self, prefix: &str, suffix: &str, refusal: &str) -> Vec<String>;
}

impl Counting for Console {
    async fn stat(&mut self, name: &str) -> u64 {
        let stats = self.cmd("STATS").await;
        field(&stats, name).parse().unwrap()
    }

    async fn settle(&mut self, name: &str, want: u64) {
        let deadline = Instant::now() + SETTLE_MAX;
        loop {
            let got = self.stat(name).await;
            if got == want {
                return;
            }
            assert!(Instant::now() < deadline, "{name} stays {got}, not {want}");
            // Virtual time (paused clock), except after a failed sync (real disk, real time).
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn acquire_many(&mut self, prefix: &str, suffix: &str, refusal: &str) -> Vec<String> {
        let mut leases = Vec::new();
        for i in 0..KEYS_TRIED {
            let reply = self.cmd(&format!("ACQUIRE {prefix}{i} {suffix}")).await;
            if reply.starts_with("OK ") {
                let lease = reply.split_whitespace().nth(2).unwrap();
                let lease = lease.strip_prefix("lease=").unwrap();
                leases.push(format!("{prefix}{i} {lease}"));
            } else {
                assert!(reply.starts_with(refusal), "{reply}");
            }
        }
        leases
    }
}

/// Pipelined blocking acquires over the binary protocol.
trait Waiting {
    async fn wait_for(&mut self, id: u64, key: &str, wait_ms: u32);
    async fn wait_for_many(&mut self, requests: &[(u64, String)], wait_ms: u32);
    /// Reads `count` replies; each must be an ERROR with `code` whose message names `flag`.
    async fn refusals(&mut self, count: usize, code: ErrorCode, flag: &str);
}

impl Waiting for Raw {
    /// Sends a blocking ACQUIRE of `key` as request `id`.
    async fn wait_for(&mut self, id: u64, key: &str, wait_ms: u32) {
        self.wait_for_many(&[(id, key.to_string())], wait_ms).await;
    }

    /// Sends blocking ACQUIREs in one write, so the server handles them in one pass.
    async fn wait_for_many(&mut self, requests: &[(u64, String)], wait_ms: u32) {
        let mut out = BytesMut::new();
        for (id, key) in requests {
            let request = Request::Acquire {
                key: key.as_bytes().to_vec().into(),
                ttl_ms: 30_000,
                wait_ms,
                release_on_disconnect: false,
                meta: Default::default(),
                acquire_id: None,
                kind: Default::default(),
                session_id: None,
            };
            encode_request(*id, &request, &mut out);
        }
        self.send_bytes(&out).await;
    }

    async fn refusals(&mut self, count: usize, code: ErrorCode, flag: &str) {
        for _ in 0..count {
            match self.frame().await {
                (_, Response::Error { code: got, message }) if got == code => {
                    assert!(message.contains(flag), "{message}");
                }
                other => panic!("expected {code:?}, got {other:?}"),
            }
        }
    }
}

/// With `--held-max 3` and 64 shards, exactly 3 of many distinct keys are granted, and each
/// way a lock goes (release, expiry, release on disconnect) gives exactly its place back.
#[tokio::test(start_paused = true)]
async fn held_max_is_exact_server_wide() {
    let server = start(|config| config.held_max = 3).await;
    let mut c = Console::connect(server.addr).await;
    let refusal = "ERR HELD_LIMIT the server holds 3 locks, its limit (--held-max)";
    let leases = c.acquire_many("a", "30000", refusal).await;
    assert_eq!(leases.len(), 3, "{leases:?}");
    assert_eq!(c.stat("held").await, 3);
    // A release frees exactly one place.
    assert_eq!(c.cmd(&format!("RELEASE {}", leases[0])).await, "OK");
    assert_eq!(c.acquire_many("b", "30000", refusal).await.len(), 1);
    for lease in &leases[1..] {
        assert_eq!(c.cmd(&format!("RELEASE {lease}")).await, "OK");
    }
    c.settle("held", 1).await;
    // Expiries free their places (two places are free, so both are granted however slowly).
    for key in ["c0", "c1"] {
        assert!(c
            .cmd(&format!("ACQUIRE {key} 100"))
            .await
            .starts_with("OK "));
    }
    c.settle("held", 1).await;
    // So does a connection that asked for release on disconnect.
    let mut gone = Console::connect(server.addr).await;
    let held = gone
        .acquire_many("d", "30000 RELEASE_ON_DISCONNECT", refusal)
        .await;
    assert_eq!(held.len(), 2);
    drop(gone);
    c.settle("held", 1).await;
    assert_eq!(c.acquire_many("e", "30000", refusal).await.len(), 2);
    server.stop().await;
}

/// With `--waiters-max 3` and 64 shards, exactly 3 blocking acquires on distinct keys queue,
/// and time-outs, hand-offs and closed connections give exactly their places back.
#[tokio::test(start_paused = true)]
async fn waiters_max_is_exact_server_wide() {
    let server = start(|config| config.waiters_max = 3).await;
    let mut c = Console::connect(server.addr).await;
    let leases = c.acquire_many("k", "30000", "never refused").await;
    let flag = "the server has 3 waiters, its limit (--waiters-max)";
    // 40 waiters on 40 keys: 37 refused at once, 3 queued.
    let waits: Vec<(u64, String)> = (0..KEYS_TRIED)
        .map(|i| (i as u64 + 1, format!("k{i}")))
        .collect();
    let mut w = Raw::connect(server.addr).await.0;
    w.wait_for_many(&waits, 30_000).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    assert_eq!(c.stat("waiters").await, 3);
    // A closed connection gives its places back.
    drop(w);
    c.settle("waiters", 0).await;
    // Waits that run out give theirs back.
    let mut w = Raw::connect(server.addr).await.0;
    w.wait_for_many(&waits, 500).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    for _ in 0..3 {
        assert!(matches!(w.frame().await.1, Response::Locked { .. }));
    }
    c.settle("waiters", 0).await;
    // A hand-off gives exactly one back.
    w.wait_for_many(&waits, 30_000).await;
    w.refusals(KEYS_TRIED - 3, ErrorCode::WaitersLimit, flag)
        .await;
    // The first three requests (k0, k1, k2) queued: releasing k0 hands it to its waiter.
    assert!(leases[0].starts_with("k0 "));
    assert_eq!(c.cmd(&format!("RELEASE {}", leases[0])).await, "OK");
    assert!(matches!(w.frame().await.1, Response::Granted { .. }));
    assert_eq!(c.stat("waiters").await, 2);
    w.wait_for(100, "k39", 30_000).await;
    w.wait_for(101, "k38", 30_000).await;
    w.refusals(1, ErrorCode::WaitersLimit, flag).await;
    assert_eq!(c.stat("waiters").await, 3);
    drop(w);
    server.stop().await;
}

/// The per-key cap is `--waiters-per-key-max`, not the server-wide cap split over shards,
/// and its refusal names it.
#[tokio::test(start_paused = true)]
async fn waiters_per_key_max_is_its_own_limit() {
    let server = start(|config| {
        config.waiters_max = 1_000;
        config.waiters_per_key_max = 200;
    })
    .await;
    let mut c = Console::connect(server.addr).await;
    assert!(c.cmd("ACQUIRE hot 30000").await.starts_with("OK "));
    let mut w = Raw::connect(server.addr).await.0;
    let waits: Vec<(u64, String)> = (1..=201).map(|id| (id, "hot".to_string())).collect();
    w.wait_for_many(&waits, 30_000).await;
    let flag = "this key has 200 waiters, its limit (--waiters-per-key-max)";
    w.refusals(1, ErrorCode::WaitersLimit, flag).await;
    assert_eq!(c.stat("waiters").await, 200);
    assert!(c.cmd("INSPECT hot").await.ends_with("waiters=200"));
    drop(w);
    c.settle("waiters", 0).await;
    server.stop().await;
}

/// A grant taken back because its WAL record could not be synced gives its place back.
#[tokio::test]
async fn grant_undone_after_a_failed_sync_gives_its_place_back() {
    // Real time: the failed sync is real disk I/O on the WAL's syncer thread.
    let dir = tempfile::tempdir().unwrap();
    let (mut config, faults, storage) = tenure_testkit::server::faulty_storage(dir.path());
    config.held_max = 2;
    let server = Server::start_with_storage(config, storage).await;
    let mut c = Console::connect(server.addr).await;
    assert!(c.cmd("ACQUIRE before 60000").await.starts_with("OK "));
    faults.set(FaultPlan {
        sync_fails_from: Some(faults.syncs() + 1),
        ..FaultPlan::default()
    });
    let failed = c.cmd("ACQUIRE x 60000").await;
    assert!(failed.starts_with("ERR UNAVAILABLE "), "{failed}");
    c.settle("held", 1).await;
    drop(c);
    let stopped = server.stop_result().await;
    assert!(stopped.is_err(), "the final sync must report the failure");
}

/// Watching the same key again replaces the watch: it neither counts twice against
/// `watches_per_connection_max` nor keeps the connection from watching other keys.
#[tokio::test(start_paused = true)]
async fn rewatching_a_key_counts_once() {
    let server = start(|config| config.watches_per_connection_max = 2).await;
    let mut c = Console::connect(server.addr).await;
    for _ in 0..3 {
        assert_eq!(c.cmd("WATCH a").await, "OK watching FREE");
    }
    assert_eq!(c.cmd("WATCH b").await, "OK watching FREE");
    let refused = c.cmd("WATCH c").await;
    assert!(refused.starts_with("ERR WATCH_LIMIT "), "{refused}");
    // Unwatching and watching again, many times, stays within the limit.
    for _ in 0..5 {
        assert_eq!(c.cmd("UNWATCH b").await, "OK");
        assert_eq!(c.cmd("WATCH b").await, "OK watching FREE");
    }
    assert_eq!(c.cmd("UNWATCH a").await, "OK");
    assert_eq!(c.cmd("WATCH c").await, "OK watching FREE");
    assert_eq!(c.stat("watches").await, 2);
    server.stop().await;
}

/// HELD_LIMIT names the real count of held locks: after a restart with a lower `--held-max`
/// the leases brought back stay held, more than the new limit, and the refusal says how many.
#[tokio::test]
async fn held_limit_names_the_real_count_when_over_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_in(dir.path(), |config| config.held_max = 10).await;
    let mut c = Console::connect(server.addr).await;
    for i in 0..5 {
        let granted = c.cmd(&format!("ACQUIRE over{i} 600000")).await;
        assert!(granted.starts_with("OK token="), "{granted}");
    }
    drop(c);
    server.stop().await;
    let server = Server::start_in(dir.path(), |config| config.held_max = 3).await;
    let mut c = Console::connect(server.addr).await;
    assert_eq!(
        c.cmd("ACQUIRE another 600000").await,
        "ERR HELD_LIMIT the server holds 5 locks, over 3, its limit (--held-max)"
    );
}
