//! `--sessions` (PROTOCOL.md 3.11): the estimate's locks acquired in sessions of the real
//! server, kept alive by one SESSION_KEEPALIVE per session every TTL / 3 instead of a RENEW
//! per lock; and the flags refused where they mean nothing.

use tenure_testkit::ThreadServer;

use crate::end_to_end::number;
use crate::kinds::stat;

/// Runs a short estimate against `server` with `flags`; returns success, stdout and stderr.
fn estimate(server: &ThreadServer, flags: &[&str]) -> (bool, String, String) {
    let target = format!("tenure://{}", server.addr);
    let mut args = vec!["--target", &target];
    args.extend(["--rate", "400", "--hold", "500ms", "--ttl", "600ms"]);
    args.extend(["--duration", "1s", "--warmup", "100ms"]);
    args.extend(["--connections", "2", "--json", "--quiet"]);
    args.extend(flags);
    crate::end_to_end::loadgen(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_estimate_in_sessions_keeps_them_alive_instead_of_renewing() {
    let server = ThreadServer::start();
    // 400 acquires/s held 500 ms: 200 locks in 4 sessions of 50; a 600 ms TTL, so a
    // keep-alive every 200 ms per session (20/s), where a lock would be renewed each 10 s
    // by default (the renew period is --renew-every's, unused here).
    let (ok, json, err) = estimate(&server, &["--sessions", "4", "--session-leases", "50"]);
    assert!(ok, "{err}");
    assert!(json.contains("\"errors\":{}"), "{json}");
    let acquires = number(&json, "acquire", "granted");
    assert!((300.0..=500.0).contains(&acquires), "{json}");
    assert!(number(&json, "release", "released") > 0.0, "{json}");
    assert!(!json.contains("\"renewed\""), "no lock is renewed: {json}");
    // Keep-alives at 20/s over the 1 s window; a session lost would show as lost here.
    let keepalives = number(&json, "keepalive", "session");
    assert!((10.0..=30.0).contains(&keepalives), "{json}");
    assert_eq!(number(&json, "summary", "sessions_lost"), 0.0, "{json}");
    // The server holds the locks in the sessions the load generator opened.
    assert_eq!(stat(&server, "sessions").await, 4);
    assert!(stat(&server, "session_leases").await > 0);
}

#[test]
fn sessions_flags_are_refused_where_they_mean_nothing() {
    let server = ThreadServer::start();
    // N x M must be the churn's held locks (400/s x 500 ms = 200).
    let (ok, _, err) = estimate(&server, &["--sessions", "4", "--session-leases", "10"]);
    assert!(!ok && err.contains("--session-leases 50"), "{err}");
    // More sessions than the connections may open (64 each).
    let (ok, _, err) = estimate(&server, &["--sessions", "200"]);
    assert!(!ok && err.contains("--connections 4"), "{err}");
    let (ok, _, err) = estimate(&server, &["--sessions", "2", "--scenario", "max"]);
    assert!(!ok && err.contains("--sessions is for"), "{err}");
    let (ok, _, err) = estimate(&server, &["--session-leases", "2"]);
    assert!(!ok && err.contains("--sessions"), "{err}");
}
