//! `tenure cluster status|add|remove` against three in-process cluster nodes that formed by
//! themselves from `--initial-cluster` (no INIT sent), and against a single-node server.
//! Real time: the command line is a process of its own; bounds are in seconds.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure::{AcquireOptions, AcquireOutcome, Client, KeyState};
use tenure_server::cluster::{ClusterNode, ClusterOptions, NodeId, NodeInfo};
use tenure_testkit::{field, ThreadServer as TestServer, PATIENCE};
use tokio::net::TcpListener;
use tokio::time::{timeout, Instant};

/// Longest an election, a takeover or a membership change may take here.
const CLUSTER_WAIT_MAX: Duration = Duration::from_secs(30);

struct Node {
    node: ClusterNode,
    info: NodeInfo,
    _dir: tempfile::TempDir,
}

async fn listeners() -> (TcpListener, TcpListener, NodeInfo) {
    let peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let info = NodeInfo {
        peer_addr: peers.local_addr().unwrap().to_string(),
        client_addr: clients.local_addr().unwrap().to_string(),
    };
    (peers, clients, info)
}

/// Node `id` on these listeners, bootstrapping from `initial` if given.
async fn start(
    id: NodeId,
    listeners: (TcpListener, TcpListener, NodeInfo),
    initial: Option<BTreeMap<NodeId, NodeInfo>>,
) -> Node {
    start_with(id, listeners, initial, tenure_server::Config::default()).await
}

/// As [`start`], with `config` for its client port.
async fn start_with(
    id: NodeId,
    (peers, clients, info): (TcpListener, TcpListener, NodeInfo),
    initial: Option<BTreeMap<NodeId, NodeInfo>>,
    config: tenure_server::Config,
) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(id, dir.path().to_path_buf());
    // Generous, so a loaded machine does not hold spurious elections mid-test.
    options.heartbeat_ms = 100;
    options.election_timeout_ms = (800, 1600);
    options.initial_cluster = initial;
    let node = ClusterNode::start(config, options, peers, clients)
        .await
        .unwrap();
    Node {
        node,
        info,
        _dir: dir,
    }
}

/// Runs `tenure --addr <addr> cluster <args>`; returns exit code, stdout and stderr.
async fn cli(addr: &str, args: &[&str]) -> (i32, String, String) {
    cli_as(addr, None, args).await
}

/// As [`cli`], as identity `(name, secret)` if given.
async fn cli_as(
    addr: &str,
    identity: Option<(&str, &str)>,
    args: &[&str],
) -> (i32, String, String) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
    command.arg("--addr").arg(addr);
    if let Some((name, secret)) = identity {
        command
            .arg("--identity")
            .arg(name)
            .env("TENURE_SECRET", secret);
    }
    command.arg("cluster").args(args);
    let output = timeout(CLUSTER_WAIT_MAX, command.kill_on_drop(true).output())
        .await
        .expect("tenure finishes")
        .expect("tenure runs");
    (
        output.status.code().expect("exited normally"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Acquires `key` through `client`, retried while no leader serves.
async fn acquire(client: &Client, key: &str) -> tenure::Lease {
    let deadline = Instant::now() + CLUSTER_WAIT_MAX;
    loop {
        let options = AcquireOptions::default();
        match client.acquire(key, Duration::from_secs(60), options).await {
            Ok(AcquireOutcome::Granted(lease)) => return lease,
            other => assert!(Instant::now() < deadline, "{key}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The CLI's status of the node at `addr`, once `ok` holds for it.
async fn status_until(addr: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + CLUSTER_WAIT_MAX;
    loop {
        let (code, out, err) = cli(addr, &["status"]).await;
        assert_eq!(code, 0, "{out}{err}");
        if ok(&out) {
            return out;
        }
        assert!(Instant::now() < deadline, "{out}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenure_cluster_status_add_and_remove_on_a_self_formed_cluster() {
    let mut bound = Vec::new();
    for _ in 0..3 {
        bound.push(listeners().await);
    }
    let initial: BTreeMap<NodeId, NodeInfo> = (1..)
        .zip(bound.iter().map(|(_, _, info)| info.clone()))
        .collect();
    let mut nodes = Vec::new();
    for (id, b) in (1..).zip(bound) {
        nodes.push(start(id, b, Some(initial.clone())).await);
    }
    let addrs: Vec<String> = nodes.iter().map(|n| n.info.client_addr.clone()).collect();
    let client = Client::connect(addrs.join(",")).await.unwrap();
    let held = acquire(&client, "held").await;

    // Any node answers STATUS from its own view; the table names the leader.
    let status = status_until(&addrs[2], |s| !s.contains("leader_id=0 ")).await;
    assert_eq!(field(&status, "result"), "CLUSTER", "{status}");
    assert_eq!(field(&status, "node_id"), "3", "{status}");
    assert_eq!(field(&status, "voters").split(',').count(), 3, "{status}");
    assert!(status.contains("(leader)"), "{status}");
    let leader_id: NodeId = field(&status, "leader_id").parse().unwrap();

    // ADD, sent to a follower first: the client follows NOT_LEADER to the leader.
    let fourth = start(4, listeners().await, None).await;
    let follower = (1..=3).find(|&id| id != leader_id).unwrap();
    let order = format!("{},{}", addrs[follower as usize - 1], addrs.join(","));
    let member = format!("{}/{}", fourth.info.peer_addr, fourth.info.client_addr);
    let (code, out, err) = cli(&order, &["add", "4", &member]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        field(&out, "voters").contains(&format!("4={member}")),
        "{out}"
    );
    let status = status_until(&fourth.info.client_addr, |s| s.contains("role=follower")).await;
    assert!(status.contains("4      voter"), "{status}");
    nodes.push(fourth);

    // Refusals name themselves.
    let (code, out, _) = cli(&addrs.join(","), &["remove", "9"]).await;
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("CLUSTER_REFUSED"), "{out}");

    // REMOVE the leader: it steps down, the others elect, the lease and its token stay.
    let (code, out, err) = cli(&addrs.join(","), &["remove", &leader_id.to_string()]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !field(&out, "voters").contains(&format!("{leader_id}=")),
        "{out}"
    );
    let rest: Vec<String> = nodes
        .iter()
        .filter(|n| n.node.id() != leader_id)
        .map(|n| n.info.client_addr.clone())
        .collect();
    let client = Client::connect(rest.join(",")).await.unwrap();
    let fresh = acquire(&client, "fresh").await;
    assert!(fresh.fencing_token() > held.fencing_token());
    match client.inspect("held").await.unwrap() {
        KeyState::Held { token, .. } => assert_eq!(token, held.fencing_token()),
        other => panic!("the lease was lost: {other:?}"),
    }
    for n in nodes {
        n.node.kill().await;
    }
}

#[tokio::test]
async fn tenure_cluster_on_a_single_node_server_says_it_is_not_a_cluster() {
    let server = TestServer::start();
    let (code, out, err) = timeout(PATIENCE, cli(server.addr.as_str(), &["status"]))
        .await
        .unwrap();
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("not in cluster mode"), "{out}{err}");
}

/// The `result=MEMBER` line of member `id` in `tenure cluster status`'s output.
fn member_line(out: &str, id: NodeId) -> &str {
    let prefix = format!("result=MEMBER id={id} ");
    let line = out.lines().find(|l| l.starts_with(&prefix));
    line.unwrap_or_else(|| panic!("no member {id} in:\n{out}"))
}

/// An identities file with `admin` (everything) and `extra` entries.
fn identities(dir: &std::path::Path, file: &str, extra: &str) -> std::path::PathBuf {
    let hash = tenure_server::identity::hash_secret(b"admin-secret").unwrap();
    let text = format!(
        "[[identity]]\nname = \"admin\"\nsecret-hash = \"{hash}\"\nstats = true\nadmin = true\n{extra}"
    );
    let path = dir.join(file);
    std::fs::write(&path, text).unwrap();
    path
}

/// `tenure cluster status` asks every member: a member whose identities differ from the
/// leader's is flagged, a member cut off from the others shows it knows no leader while the
/// others do, and a member that is down is named unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenure_cluster_status_shows_every_members_view_and_flags_a_differing_one() {
    let files = tempfile::tempdir().unwrap();
    let same = identities(files.path(), "same.toml", "");
    let hash = tenure_server::identity::hash_secret(b"x").unwrap();
    let extra = format!("\n[[identity]]\nname = \"late\"\nsecret-hash = \"{hash}\"\n");
    let other = files.path().join("other.toml");
    std::fs::write(&other, std::fs::read_to_string(&same).unwrap() + &extra).unwrap();
    let mut bound = Vec::new();
    for _ in 0..3 {
        bound.push(listeners().await);
    }
    let initial: BTreeMap<NodeId, NodeInfo> = (1..)
        .zip(bound.iter().map(|(_, _, info)| info.clone()))
        .collect();
    let mut nodes = Vec::new();
    for (id, b) in (1..).zip(bound) {
        let file = if id == 3 { &other } else { &same };
        let config = tenure_server::Config {
            identities: Some(file.clone()),
            ..tenure_server::Config::default()
        };
        nodes.push(start_with(id, b, Some(initial.clone()), config).await);
    }
    let addr = nodes[0].info.client_addr.clone();
    let admin = Some(("admin", "admin-secret"));
    let status = |ok: fn(&str) -> bool| {
        let addr = addr.clone();
        async move {
            let deadline = Instant::now() + CLUSTER_WAIT_MAX;
            loop {
                let (code, out, err) = cli_as(&addr, admin, &["status"]).await;
                assert_eq!(code, 0, "{out}{err}");
                if ok(&out) {
                    return (out, err);
                }
                assert!(Instant::now() < deadline, "{out}{err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // Every member answers, and has heard the others.
    let (out, err) = status(|out| {
        (1..=3).all(|id| {
            out.lines().any(|l| {
                l.starts_with(&format!("result=MEMBER id={id} "))
                    && l.contains(" reachable=yes ")
                    && !l.contains("leader_id=0 ")
                    && !l.contains("last_contact_ms=- ")
            })
        })
    })
    .await;
    let leader = field(member_line(&out, 1), "leader_id").to_string();
    for id in 1..=3 {
        let line = member_line(&out, id);
        assert_eq!(field(line, "leader_id"), leader, "{out}");
        assert_eq!(field(line, "identities_digest").len(), 16, "{line}");
        assert!(field(line, "lag_entries").parse::<u64>().is_ok(), "{line}");
        let config = if id == 3 { "DIFFERS" } else { "same" };
        assert_eq!(field(line, "config"), config, "{out}");
    }
    assert!(
        err.contains("node 3: identities or trust set digest differs"),
        "{err}"
    );
    assert!(out.contains("CONTACT_MS"), "the views table: {out}");

    // Node 3 cut off from its peers: it stands for election and knows no leader, while the
    // others still name theirs.
    nodes[2].node.set_isolated(true);
    let (out, _) = status(|out| member_line(out, 3).contains("leader_id=0 ")).await;
    assert_eq!(field(member_line(&out, 1), "leader_id"), leader, "{out}");
    nodes[2].node.set_isolated(false);

    // A member that is down is named, and the others still answer.
    let third = nodes.pop().unwrap();
    third.node.kill().await;
    let (out, _) = status(|out| member_line(out, 3).contains("reachable=no")).await;
    assert!(member_line(&out, 1).contains("reachable=yes"), "{out}");
    assert!(out.contains("UNREACHABLE"), "{out}");
    for n in nodes {
        n.node.kill().await;
    }
}
