//! Cluster mode with the real binary: `tenured --cluster` times three, `tenured cluster-init`,
//! `kill -9` of the leader. The in-process tests of `tenure_server::cluster` cover the rest.

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use tenure_testkit::{field, free_port, Daemon, LineConn, Tenured};

use super::tenured_bin;

/// Longest an election and a takeover may take here, on a loaded machine.
const ELECTED_WAIT_MAX: Duration = Duration::from_secs(15);
/// Longest a reply may take.
const REPLY_WAIT_MAX: Duration = Duration::from_secs(5);

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The first of `clients` that grants `key`, with its reply, retried until one does.
fn acquire_at_leader(clients: &[SocketAddr], key: &str) -> (SocketAddr, String) {
    let deadline = Instant::now() + ELECTED_WAIT_MAX;
    while Instant::now() < deadline {
        for &addr in clients {
            let Ok(mut conn) = LineConn::connect(addr, REPLY_WAIT_MAX) else {
                continue;
            };
            if let Ok(reply) = conn.cmd(&format!("ACQUIRE {key} 60000")) {
                if reply.starts_with("OK ") {
                    return (addr, reply);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no node granted {key} within {ELECTED_WAIT_MAX:?}");
}

#[test]
fn three_daemons_elect_a_leader_and_survive_its_kill_9() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let peers: Vec<SocketAddr> = (0..3).map(|_| loopback(free_port())).collect();
    let clients: Vec<SocketAddr> = (0..3).map(|_| loopback(free_port())).collect();
    let mut daemons: Vec<Daemon> = (0..3)
        .map(|i| {
            let (id, peer) = ((i + 1).to_string(), peers[i].to_string());
            let args = ["--cluster", "--node-id", &id, "--peer-listen", &peer];
            let what = Tenured {
                bin: tenured_bin(),
                dir: dirs[i].path(),
                logs: None,
                args: &args,
            };
            Daemon::start_on(what, clients[i])
        })
        .collect();
    let nodes: Vec<String> = (0..3)
        .map(|i| format!("{}={}/{}", i + 1, peers[i], clients[i]))
        .collect();
    let init = Command::new(tenured_bin())
        .args(["cluster-init", "--peer", &peers[0].to_string()])
        .args(["--nodes", &nodes.join(",")])
        .output()
        .unwrap();
    assert!(init.status.success(), "{init:?}");

    let (leader, held) = acquire_at_leader(&clients, "held");
    let token = field(&held, "token").to_string();
    // A follower names the leader. (Retried: on a loaded machine a stall can move the
    // leadership between two requests.)
    let follower = *clients.iter().find(|&&c| c != leader).unwrap();
    let deadline = Instant::now() + ELECTED_WAIT_MAX;
    loop {
        let mut conn = LineConn::connect(follower, REPLY_WAIT_MAX).unwrap();
        let reply = conn.cmd("INSPECT held").unwrap();
        let named = reply.strip_prefix("ERR NOT_LEADER leader=");
        if named.is_some_and(|addr| addr != follower.to_string() && addr != "unknown") {
            break;
        }
        assert!(Instant::now() < deadline, "{reply}");
        std::thread::sleep(Duration::from_millis(50));
    }

    let index = clients.iter().position(|&c| c == leader).unwrap();
    daemons[index].kill9();
    let rest: Vec<SocketAddr> = clients.iter().copied().filter(|&c| c != leader).collect();
    let (_, fresh) = acquire_at_leader(&rest, "fresh");
    let fresh_token: u64 = field(&fresh, "token").parse().unwrap();
    assert!(fresh_token > token.parse::<u64>().unwrap(), "{fresh}");
}

#[test]
fn cluster_mode_names_what_it_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let listen = loopback(free_port()).to_string();
    let data = dir.path().to_str().unwrap();
    let base = ["--cluster", "--listen", &listen, "--data-dir", data];
    let cases: [(&[&str], &str); 2] = [(&[], "--node-id"), (&["--node-id", "1"], "--peer-listen")];
    for (extra, named) in cases {
        let out = Command::new(tenured_bin())
            .args(base)
            .args(extra)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}");
        assert!(stderr.contains(named), "{extra:?}: {stderr}");
    }
}
