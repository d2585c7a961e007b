//! The Rust client's exactly-once ACQUIRE against the real `tenured` (PROTOCOL.md 3.9): a
//! proxy between the client and the server throws away the GRANTED reply (the grant is
//! durable: the server replies only then), the server is killed with `kill -9` (a single
//! node, restarted on its port; or a cluster's leader), and the client's own retry with the
//! same acquire id must come back as the one grant the caller sees: the same token and lease
//! id. A lease that ended before the retry arrived is reported as ended, not granted again.
//! Without the client's retries each of these ACQUIREs fails with a lost connection.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tenure::{AcquireOptions, ClientConfig, EndedHow, Error, KeyState};
use tenure_testkit::lossy::{self, proxy, Dropped, Trap};
use tenure_testkit::{Daemon, Tenured};
use tokio::sync::mpsc;

use super::tenured_bin;

/// Longest a grant, a restart or a fail-over may take here, on a loaded machine.
const STEP_MAX: Duration = Duration::from_secs(30);
fn single(dir: &Path) -> Tenured<'_> {
    Tenured {
        bin: tenured_bin(),
        dir,
        logs: None,
        args: &[],
    }
}

fn config() -> ClientConfig {
    ClientConfig {
        request_timeout: Duration::from_secs(5),
        acquire_retry_for: STEP_MAX,
        ..ClientConfig::default()
    }
}

async fn next_drop(rx: &mut mpsc::UnboundedReceiver<Dropped>) -> Dropped {
    lossy::next_drop(rx, STEP_MAX).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_nodes_grant_lost_to_kill_9_is_the_callers_one_grant_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(single(dir.path()));
    let upstream = daemon.addr;
    let (trap, mut dropped) = Trap::new();
    let (addr, _accepting) = proxy(upstream, Arc::clone(&trap)).await;
    let client = tenure::Client::connect_with(addr, config()).await.unwrap();
    let ttl = Duration::from_secs(60);

    // Granted and durable, the reply dropped, the server killed and restarted, then the
    // client's connection cut: the retry finds the grant in the restarted server's log.
    trap.arm();
    let acquiring = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .acquire("job:1", ttl, AcquireOptions::default())
                .await
        }
    });
    let (token, lease_id) = next_drop(&mut dropped).await;
    tokio::task::block_in_place(|| {
        daemon.kill9();
        daemon = Daemon::start_on(single(dir.path()), upstream);
    });
    trap.cut();
    let lease = acquiring
        .await
        .unwrap()
        .expect("one grant")
        .granted()
        .unwrap();
    assert_eq!((lease.fencing_token(), lease.lease_id()), (token, lease_id));
    match client.inspect("job:1").await.unwrap() {
        KeyState::Held { token: held, .. } => assert_eq!(held, token, "no ghost holds it"),
        KeyState::Free => panic!("the caller's lease is gone"),
    }
    assert_eq!(
        lease.release().await.unwrap(),
        tenure::ReleaseOutcome::Released
    );

    // The lease ends (released by someone who learnt its id) before the retry arrives: the
    // caller hears that it was granted and has ended, and nothing is granted again.
    trap.arm();
    let acquiring = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .acquire("job:2", ttl, AcquireOptions::default())
                .await
        }
    });
    let (token, lease_id) = next_drop(&mut dropped).await;
    let direct = tenure::Client::connect(upstream.to_string()).await.unwrap();
    let released = direct.release("job:2", lease_id).await.unwrap();
    assert_eq!(released, tenure::ReleaseOutcome::Released);
    trap.cut();
    let err = acquiring.await.unwrap().unwrap_err();
    assert!(
        matches!(err, Error::AcquireEnded { how: EndedHow::Released, token: t } if t == token),
        "{err:?}"
    );
    assert_eq!(direct.inspect("job:2").await.unwrap(), KeyState::Free);
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaders_grant_lost_to_kill_9_is_the_callers_one_grant_at_the_new_leader() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (mut daemons, clients) =
        tokio::task::block_in_place(|| super::cluster::three_daemons(&dirs));
    // A follower's NOT_LEADER names the leader's own address, which bypasses the proxies:
    // the leader's proxy comes first, so that the first send goes through it.
    let (leader, _) =
        tokio::task::block_in_place(|| super::cluster::at_leader(&clients, "INSPECT probe"));
    let mut order = clients.clone();
    order.sort_by_key(|&c| c != leader);
    let (trap, mut dropped) = Trap::new();
    let mut proxies = Vec::new();
    let mut accepting = Vec::new();
    for &node in &order {
        let (addr, task) = proxy(node, Arc::clone(&trap)).await;
        proxies.push(addr);
        accepting.push(task);
    }
    let client = tenure::Client::connect_with(proxies.join(","), config())
        .await
        .unwrap();
    let ttl = Duration::from_secs(60);
    trap.arm();
    let acquiring = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .acquire("job:1", ttl, AcquireOptions::default())
                .await
        }
    });
    let (token, lease_id) = next_drop(&mut dropped).await;
    // The grant was committed (the leader replies only then); the leader dies with it.
    let leader = clients.iter().position(|&c| c == leader).unwrap();
    tokio::task::block_in_place(|| daemons[leader].kill9());
    accepting[0].abort(); // the leader's proxy (first): refused from now on, as the node is
    trap.cut();
    let lease = acquiring
        .await
        .unwrap()
        .expect("one grant")
        .granted()
        .unwrap();
    assert_eq!((lease.fencing_token(), lease.lease_id()), (token, lease_id));
    let rest: Vec<SocketAddr> = (0..3)
        .filter(|&i| i != leader)
        .map(|i| clients[i])
        .collect();
    let (_, held) =
        tokio::task::block_in_place(|| super::cluster::at_leader(&rest, "INSPECT job:1"));
    assert!(held.contains(&format!("token={token} ")), "{held}");
    assert_eq!(
        lease.release().await.unwrap(),
        tenure::ReleaseOutcome::Released
    );
}

// Found by outside testing (a29, finding 2): against a node that answers every request
// NOT_LEADER (here one never added to a cluster), an ACQUIRE retried until its time ran out
// and then reported "no answer within 5s": each send looked for a leader for 10 s, past its
// own request time-out, and the last one was cut short. The caller must hear the NOT_LEADER
// every send did get.
#[tokio::test]
async fn an_acquire_every_node_refuses_not_leader_reports_not_leader() {
    let dir = tempfile::tempdir().unwrap();
    let peer = format!("127.0.0.1:{}", tenure_testkit::free_port());
    let args = [
        "--cluster",
        "--node-id",
        "4",
        "--peer-listen",
        peer.as_str(),
    ];
    let node = Daemon::start(Tenured {
        bin: tenured_bin(),
        dir: dir.path(),
        logs: None,
        args: &args,
    });
    let config = ClientConfig {
        request_timeout: Duration::from_secs(1),
        acquire_retry_for: Duration::from_secs(3),
        ..ClientConfig::default()
    };
    let client = tenure::Client::connect_with(node.addr.to_string(), config)
        .await
        .unwrap();
    let refused = client
        .acquire("k", Duration::from_secs(5), AcquireOptions::default())
        .await
        .expect_err("no node leads");
    assert!(
        matches!(
            &refused,
            Error::Server {
                code: tenure::ErrorCode::NotLeader,
                ..
            }
        ),
        "{refused:?}"
    );
}
