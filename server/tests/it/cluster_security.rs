//! The client port of a cluster is the single node's: identities, prefixes, quotas and TLS
//! on every node, and membership changes only for an identity with `admin`.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure_server::cluster::{ClusterNode, ClusterOptions, NodeInfo};
use tenure_server::Config;
use tenure_testkit::TestCa;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::auth::identities_file;
use super::tls::TlsConsole;

/// Longest any one step may take: an election, a commit, a reply (failed AUTHs are slowed).
const STEP_MAX: Duration = Duration::from_secs(15);

/// Three nodes with identities and TLS on their client ports, and what they share.
struct Secured {
    nodes: Vec<(ClusterNode, NodeInfo)>,
    ca: TestCa,
    _dirs: Vec<tempfile::TempDir>,
    _files: tempfile::TempDir,
}

async fn start_secured() -> Secured {
    let files = tempfile::tempdir().unwrap();
    let ca = TestCa::new(files.path(), "cluster-clients");
    let server = ca.server(files.path(), "node");
    let identities = identities_file(files.path());
    let (mut nodes, mut dirs) = (Vec::new(), Vec::new());
    for id in 1..=3 {
        let dir = tempfile::tempdir().unwrap();
        let peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let info = NodeInfo {
            peer_addr: peers.local_addr().unwrap().to_string(),
            client_addr: clients.local_addr().unwrap().to_string(),
        };
        let mut options = ClusterOptions::new(id, dir.path().to_path_buf());
        // Generous, so a loaded machine does not hold spurious elections mid-test.
        options.heartbeat_ms = 100;
        options.election_timeout_ms = (800, 1600);
        let config = Config {
            token_block: 1000,
            identities: Some(identities.clone()),
            tls: Some(ca.server_files(&server, None)),
            ..Config::for_tests(dir.path())
        };
        let node = ClusterNode::start(config, options, peers, clients)
            .await
            .unwrap();
        nodes.push((node, info));
        dirs.push(dir);
    }
    let members: BTreeMap<u64, NodeInfo> = nodes
        .iter()
        .map(|(node, info)| (node.id(), info.clone()))
        .collect();
    nodes[0].0.initialize(members).await.unwrap();
    Secured {
        nodes,
        ca,
        _dirs: dirs,
        _files: files,
    }
}

impl Secured {
    /// The index of the node serving as leader, once one is.
    async fn leader(&self) -> usize {
        let found = async {
            loop {
                if let Some(i) = self.nodes.iter().position(|(n, _)| n.serving()) {
                    return i;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(STEP_MAX, found)
            .await
            .expect("no leader served in time")
    }

    async fn console(&self, node: usize, auth: Option<&str>) -> TlsConsole {
        let addr = &self.nodes[node].1.client_addr;
        let mut console = TlsConsole::connect_to(addr, &self.ca, None).await;
        if let Some(auth) = auth {
            let reply = console.cmd(&format!("AUTH {auth}")).await;
            assert!(reply.starts_with("OK"), "AUTH {auth}: {reply}");
        }
        console
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_serves_identities_and_tls_on_every_client_port() {
    let cluster = start_secured().await;
    let leader = cluster.leader().await;
    let follower = (leader + 1) % 3;

    // Plain text to a TLS port gets no console.
    let mut plain = TcpStream::connect(&cluster.nodes[leader].1.client_addr)
        .await
        .unwrap();
    plain.write_all(b"PING\n").await.unwrap();
    let mut answer = String::new();
    let mut lines = BufReader::new(&mut plain);
    let _ = tokio::time::timeout(STEP_MAX, lines.read_line(&mut answer)).await;
    assert!(
        !answer.contains("PONG"),
        "plain text on a TLS port: {answer}"
    );

    // Before AUTH, on the leader and on a follower alike.
    for node in [leader, follower] {
        let mut anonymous = cluster.console(node, None).await;
        let reply = anonymous.cmd("ACQUIRE orders/1 30000").await;
        assert!(reply.starts_with("ERR UNAUTHENTICATED"), "{reply}");
        let reply = anonymous.cmd("AUTH orders wrong-secret").await;
        assert!(reply.starts_with("ERR"), "{reply}");
    }

    let mut orders = cluster.console(leader, Some("orders orders-secret")).await;
    let granted = orders.cmd("ACQUIRE orders/1 30000").await;
    assert!(granted.starts_with("OK token="), "{granted}");
    let outside = orders.cmd("ACQUIRE billing/1 30000").await;
    assert!(outside.starts_with("ERR FORBIDDEN"), "{outside}");
    // held-max = 3 for `orders`, enforced by the leader.
    for key in ["orders/2", "orders/3"] {
        let reply = orders.cmd(&format!("ACQUIRE {key} 30000")).await;
        assert!(reply.starts_with("OK token="), "{reply}");
    }
    let over = orders.cmd("ACQUIRE orders/4 30000").await;
    assert!(over.starts_with("ERR QUOTA"), "{over}");

    // Membership needs `admin`; STATUS needs `stats` or `admin`.
    let (id, info) = (cluster.nodes[follower].0.id(), &cluster.nodes[follower].1);
    for line in [
        format!("CLUSTER REMOVE {id}"),
        format!("CLUSTER ADD 9 {}/{}", info.peer_addr, info.client_addr),
        "CLUSTER STATUS".to_string(),
    ] {
        let reply = orders.cmd(&line).await;
        assert!(reply.starts_with("ERR FORBIDDEN"), "{line}: {reply}");
    }
    let mut admin = cluster.console(leader, Some("admin admin-secret")).await;
    let status = admin.cmd("CLUSTER STATUS").await;
    let voters = tenure_testkit::field(&status, "voters").split(',').count();
    assert_eq!(voters, 3, "the membership is unchanged: {status}");

    // The follower answers NOT_LEADER to an authenticated identity, as without identities.
    let mut on_follower = cluster
        .console(follower, Some("orders orders-secret"))
        .await;
    let reply = on_follower.cmd("ACQUIRE orders/5 30000").await;
    assert!(reply.starts_with("ERR NOT_LEADER"), "{reply}");

    // After a fail-over the new leader enforces the quota on what it grants; the leases it
    // took over count against no identity, as after a single node's restart.
    drop((orders, admin, on_follower));
    let mut cluster = cluster;
    let (old, _) = cluster.nodes.remove(leader);
    old.kill().await;
    let leader = cluster.leader().await;
    let mut orders = cluster.console(leader, Some("orders orders-secret")).await;
    let held = orders.cmd("ACQUIRE orders/1 30000").await;
    assert!(
        !held.starts_with("OK"),
        "the lease survived the fail-over: {held}"
    );
    for key in ["orders/4", "orders/5", "orders/6"] {
        let reply = orders.cmd(&format!("ACQUIRE {key} 30000")).await;
        assert!(reply.starts_with("OK token="), "{reply}");
    }
    let over = orders.cmd("ACQUIRE orders/7 30000").await;
    assert!(over.starts_with("ERR QUOTA"), "{over}");

    for (node, _) in cluster.nodes {
        node.kill().await;
    }
}
