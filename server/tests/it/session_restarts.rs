//! Sessions across a `kill -9` of the real `tenured` (PROTOCOL.md 3.11): a session and its
//! leases are in the WAL, so after the restart the same session id keeps the same leases
//! (same tokens, same lease ids) alive, its close frees them all, one not kept alive ends a
//! whole TTL after the restart (never earlier), and a closed session stays closed.

use std::path::Path;
use std::time::{Duration, Instant};

use tenure_testkit::{field, token, Daemon, LineConn, Tenured};

fn tenured<'a>(dir: &'a Path, logs: &'a Path) -> Tenured<'a> {
    Tenured {
        bin: crate::tenured_bin(),
        dir,
        logs: Some(logs),
        args: &[],
    }
}

fn conn(daemon: &Daemon) -> LineConn {
    LineConn::connect(daemon.addr, Duration::from_secs(10)).unwrap()
}

fn open(c: &mut LineConn, ttl_ms: u32) -> String {
    let opened = c.cmd(&format!("SESSION_OPEN {ttl_ms}")).unwrap();
    assert!(opened.starts_with("OK session="), "{opened}");
    field(&opened, "session").to_string()
}

/// Takes `key` in `session`: its grant line.
fn acquire_in(c: &mut LineConn, key: &str, session: &str) -> String {
    let grant = c
        .cmd(&format!("ACQUIRE {key} 0 SESSION={session}"))
        .unwrap();
    assert!(grant.starts_with("OK token="), "{grant}");
    grant
}

#[test]
fn a_session_keeps_its_three_leases_through_kill_9_and_its_close_frees_them() {
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let session = open(&mut c, 60_000);
    let keys = ["job:a", "job:b", "job:c"];
    let grants: Vec<String> = keys
        .iter()
        .map(|k| acquire_in(&mut c, k, &session))
        .collect();
    daemon.kill9();
    daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let kept = c.cmd(&format!("SESSION_KEEPALIVE {session}")).unwrap();
    assert_eq!(kept, format!("OK session={session} ttl_ms=60000"));
    // An open naming the session's id (a resend after a lost answer) finds it, and opens
    // no second session.
    let again = c.cmd(&format!("SESSION_OPEN 60000 ID={session}")).unwrap();
    assert_eq!(again, kept);
    let stats = c.cmd("STATS").unwrap();
    assert_eq!(field(&stats, "sessions"), "1", "{stats}");
    assert_eq!(field(&stats, "session_leases"), "3", "{stats}");
    for (key, grant) in keys.iter().zip(&grants) {
        let held = c.cmd(&format!("INSPECT {key}")).unwrap();
        assert_eq!(token(&held), token(grant), "{held}");
        // The same lease id, and still the session's: a plain RENEW of it is refused.
        let renew = format!("RENEW {key} {} 1000", field(grant, "lease"));
        let refused = c.cmd(&renew).unwrap();
        assert!(refused.starts_with("ERR SESSION_LEASE"), "{refused}");
    }
    let closed = c.cmd(&format!("SESSION_CLOSE {session}")).unwrap();
    assert_eq!(closed, "OK released=3");
    for key in keys {
        assert_eq!(c.cmd(&format!("INSPECT {key}")).unwrap(), "FREE");
    }
    // Closed for good, across another restart too.
    daemon.kill9();
    daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let late = c.cmd(&format!("SESSION_KEEPALIVE {session}")).unwrap();
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
    assert_eq!(c.cmd("INSPECT job:a").unwrap(), "FREE");
}

#[test]
fn a_session_not_kept_alive_after_kill_9_ends_a_ttl_after_the_restart_never_earlier() {
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let ttl = Duration::from_millis(3_000);
    let session = open(&mut c, 3_000);
    let grant = acquire_in(&mut c, "job:s", &session);
    // Most of the TTL goes by before the crash: the restart counts it again in full.
    std::thread::sleep(Duration::from_millis(2_000));
    daemon.kill9();
    let restarting_at = Instant::now();
    daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let stats = c.cmd("STATS").unwrap();
    assert_eq!(field(&stats, "sessions"), "1", "{stats}");
    let deadline = restarting_at + Duration::from_secs(30);
    loop {
        let held = c.cmd("INSPECT job:s").unwrap();
        if held == "FREE" {
            break;
        }
        assert_eq!(token(&held), token(&grant), "{held}");
        assert!(Instant::now() < deadline, "job:s never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The server's clock started after `restarting_at`, so its deadline is later than this.
    assert!(
        restarting_at.elapsed() >= ttl,
        "freed before a TTL from the restart"
    );
    let late = c.cmd(&format!("SESSION_KEEPALIVE {session}")).unwrap();
    assert!(late.starts_with("ERR NO_SESSION"), "{late}");
}

#[test]
fn a_closed_session_stays_closed_after_kill_9_and_an_open_one_stays_open() {
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let closed = open(&mut c, 60_000);
    acquire_in(&mut c, "job:closed", &closed);
    let live = open(&mut c, 60_000);
    let grant = acquire_in(&mut c, "job:live", &live);
    let answer = c.cmd(&format!("SESSION_CLOSE {closed}")).unwrap();
    assert_eq!(answer, "OK released=1");
    daemon.kill9();
    daemon = Daemon::start(tenured(dir.path(), logs.path()));
    let mut c = conn(&daemon);
    let gone = c.cmd(&format!("SESSION_KEEPALIVE {closed}")).unwrap();
    assert!(gone.starts_with("ERR NO_SESSION"), "{gone}");
    assert_eq!(c.cmd("INSPECT job:closed").unwrap(), "FREE");
    let kept = c.cmd(&format!("SESSION_KEEPALIVE {live}")).unwrap();
    assert!(kept.starts_with("OK session="), "{kept}");
    let held = c.cmd("INSPECT job:live").unwrap();
    assert_eq!(token(&held), token(&grant), "{held}");
}
