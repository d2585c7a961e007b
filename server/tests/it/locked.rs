//! LOCKED to a blocking ACQUIRE whose wait ran out while no lease held the key (PROTOCOL.md
//! 3.2, LOCKED): it names the last lease's token with `ttl_ms=0`, never token 0, on a plain
//! key and on a read/write key, single node and cluster leader alike.
//!
//! The case needs the holder's lease and the waiter's wait both over when the key is next
//! settled. The daemon is stopped (SIGSTOP) with a waiter in line, until after both
//! deadlines, so when it runs again one pass over the key finds both: no timing window to
//! hit. (A cluster leader is stopped alone, with an election timeout long enough that its
//! followers do not elect another in the meantime.)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tenure_testkit::{field, signal, token, Daemon, LineConn, Tenured};

use super::tenured_bin;

/// The holder's lease.
const HOLDER_TTL: Duration = Duration::from_millis(3_000);
/// The waiter's wait: shorter than the lease, so the waiter is never handed the key.
const WAITER_WAIT: Duration = Duration::from_millis(1_500);
/// Kept stopped this long past both deadlines (the server counts from its own instants,
/// after the client's).
const PAST_DEADLINES: Duration = Duration::from_millis(300);
/// Longest a reply may take (a stopped daemon answers once it runs again).
const REPLY_WAIT_MAX: Duration = Duration::from_secs(20);
/// Rounds tried until one stops the daemon while the waiter is still in line.
const ROUNDS_MAX: usize = 4;
/// Longest the waiter may take to show in INSPECT.
const QUEUED_WAIT_MAX: Duration = Duration::from_secs(5);

/// SIGCONT on drop, so a failed assertion never leaves a daemon stopped.
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Stopped {
        signal(pid, "STOP");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

fn conn(addr: SocketAddr) -> LineConn {
    LineConn::connect(addr, REPLY_WAIT_MAX).unwrap()
}

/// Polls INSPECT until `key` has a waiter; when it was seen.
fn until_queued(addr: SocketAddr, key: &str) -> Instant {
    let mut inspect = conn(addr);
    let deadline = Instant::now() + QUEUED_WAIT_MAX;
    loop {
        let reply = inspect.cmd(&format!("INSPECT {key}")).unwrap();
        if reply.starts_with("HELD ") && field(&reply, "waiters") == "1" {
            return Instant::now();
        }
        assert!(Instant::now() < deadline, "no waiter in line: {reply}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One round on a fresh `key` (a read/write key if `shared`): the holder's token and the
/// waiter's answer.
fn round(addr: SocketAddr, pid: u32, key: &str, shared: bool) -> (u64, String) {
    let kind = if shared { " SHARED" } else { "" };
    let holder_ms = HOLDER_TTL.as_millis();
    let held = conn(addr)
        .cmd(&format!("ACQUIRE {key} {holder_ms}{kind}"))
        .unwrap();
    let granted_by = Instant::now();
    assert!(held.starts_with("OK "), "{held}");
    let mut waiter = conn(addr);
    let wait_ms = WAITER_WAIT.as_millis();
    waiter
        .send(&format!("ACQUIRE {key} 1000 {wait_ms}\n"))
        .unwrap();
    let queued_by = until_queued(addr, key);
    {
        let _stopped = Stopped::new(pid);
        let after = (granted_by + HOLDER_TTL).max(queued_by + WAITER_WAIT) + PAST_DEADLINES;
        std::thread::sleep(after.saturating_duration_since(Instant::now()));
    }
    (token(&held), waiter.line().unwrap())
}

/// Runs rounds until one exercised the case (the waiter's wait ran out while the daemon was
/// stopped, so its answer came with the holder's lease over: `ttl_ms=0`), checking each.
fn the_last_holders_token(addr: SocketAddr, pid: u32, shared: bool) {
    for n in 0..ROUNDS_MAX {
        let key = format!("k-{shared}-{n}");
        let (holder, answer) = round(addr, pid, &key, shared);
        assert!(answer.starts_with("LOCKED "), "{key}: {answer}");
        assert_eq!(token(&answer), holder, "{key}: {answer}");
        if field(&answer, "ttl_ms") == "0" {
            return;
        }
        // The wait ran out before the stop (a very slow machine): the holder was still on.
    }
    panic!("no round stopped the daemon before the wait ran out ({ROUNDS_MAX} tried)");
}

#[test]
fn single_node_a_wait_that_ran_out_with_no_holder_names_the_last_holders_token() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(Tenured {
        bin: tenured_bin(),
        dir: dir.path(),
        logs: None,
        args: &[],
    });
    the_last_holders_token(daemon.addr, daemon.pid(), false);
    the_last_holders_token(daemon.addr, daemon.pid(), true);
}

#[test]
fn cluster_a_wait_that_ran_out_with_no_holder_names_the_last_holders_token() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    // Followers elect after 3 to 4 election timeouts without a heartbeat: 9 s or more here, far
    // beyond the leader's stop.
    let flags = ["--election-timeout-ms", "3000"];
    let (daemons, clients) = super::cluster::three_daemons_with(&dirs, &flags);
    let (leader, reply) = super::cluster::at_leader(&clients, "ACQUIRE probe 60000");
    assert!(reply.starts_with("OK "), "{reply}");
    let index = clients.iter().position(|&c| c == leader).unwrap();
    let pid = daemons[index].pid();
    the_last_holders_token(leader, pid, false);
    the_last_holders_token(leader, pid, true);
}
