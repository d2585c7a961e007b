//! A cluster is watched as a single node is: `/metrics` (through `promtool check metrics`)
//! on every node with the Raft series, which move on a leader change; `/readyz` as the
//! cluster defines it; the shipped cluster alerts and dashboard; and the digests of each
//! node's identities and trust set in CLUSTER STATUS and the metrics.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenure_server::cluster::observe::Security;
use tenure_server::cluster::{ClusterNode, ClusterOptions, NodeInfo};
use tenure_server::identity::hash_secret;
use tenure_server::tls::{Tls, TlsFiles};
use tenure_server::Config;
use tenure_testkit::{Daemon, Tenured, TestCa};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::metrics::{http_get, promtool, sample};

/// Longest any one step may take: an election, a commit, a reply.
const STEP_MAX: Duration = Duration::from_secs(20);

/// One node in this process, with its metrics endpoint.
struct Node {
    node: ClusterNode,
    info: NodeInfo,
    metrics: SocketAddr,
    http_stop: CancellationToken,
    _dir: tempfile::TempDir,
}

/// Starts node `id` with `identities` (if any) and its metrics endpoint.
async fn start(id: u64, identities: Option<PathBuf>) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let info = NodeInfo {
        peer_addr: peers.local_addr().unwrap().to_string(),
        client_addr: clients.local_addr().unwrap().to_string(),
    };
    let metrics = http.local_addr().unwrap();
    let mut options = ClusterOptions::new(id, dir.path().to_path_buf());
    // Generous, so a loaded machine does not hold spurious elections mid-test.
    options.heartbeat_ms = 100;
    options.election_timeout_ms = (800, 1600);
    let config = Config {
        identities,
        ..Config::for_tests(dir.path())
    };
    let node = ClusterNode::start(config, options, peers, clients)
        .await
        .unwrap();
    let http_stop = CancellationToken::new();
    tokio::spawn(tenure_server::http::serve(
        http,
        node.scrape(),
        http_stop.clone(),
    ));
    Node {
        node,
        info,
        metrics,
        http_stop,
        _dir: dir,
    }
}

/// Three nodes, the first two with `identities.0`, the third with `identities.1`,
/// initialised as one cluster.
async fn start_cluster(identities: (Option<PathBuf>, Option<PathBuf>)) -> Vec<Node> {
    let mut nodes = Vec::new();
    for id in 1..=3 {
        let file = if id == 3 {
            &identities.1
        } else {
            &identities.0
        };
        nodes.push(start(id, file.clone()).await);
    }
    let members: BTreeMap<u64, NodeInfo> = nodes
        .iter()
        .map(|n| (n.node.id(), n.info.clone()))
        .collect();
    nodes[0].node.initialize(members).await.unwrap();
    nodes
}

async fn stop(nodes: Vec<Node>) {
    for n in nodes {
        n.http_stop.cancel();
        n.node.kill().await;
    }
}

/// Polls `check` every 50 ms until it gives a value, for at most [`STEP_MAX`].
async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + STEP_MAX;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {STEP_MAX:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The index of the node serving as leader, among those not in `except`.
async fn serving(nodes: &[Node], except: Option<usize>) -> usize {
    until("a leader serves", || async move {
        (0..nodes.len()).find(|&i| Some(i) != except && nodes[i].node.serving())
    })
    .await
}

async fn scrape(node: &Node) -> String {
    let (status, body) = http_get(node.metrics, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body
}

fn check_metrics(text: &str) {
    let out = promtool(&["check", "metrics"], text);
    let report =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "promtool check metrics: {report}\n{text}"
    );
}

/// One console line to `addr` (after AUTH `auth`, if given), its reply.
async fn console(addr: &str, auth: Option<&str>, line: &str) -> String {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut ask = async |line: &str| {
        write
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        let mut reply = String::new();
        tokio::time::timeout(STEP_MAX, read.read_line(&mut reply))
            .await
            .expect("no reply in time")
            .unwrap();
        reply.trim_end().to_string()
    };
    if let Some(auth) = auth {
        let reply = ask(&format!("AUTH {auth}")).await;
        assert!(reply.starts_with("OK"), "{reply}");
    }
    ask(line).await
}

/// The value of `name=` in a reply line.
fn field<'a>(line: &'a str, name: &str) -> &'a str {
    let prefix = format!("{name}=");
    let word = line.split(' ').find(|w| w.starts_with(&prefix));
    &word.unwrap_or_else(|| panic!("no {name} in {line}"))[prefix.len()..]
}

/// The names `source` uses that start with `tenure_`.
fn tenure_names(source: &str) -> Vec<&str> {
    let names = source.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    names.filter(|n| n.starts_with("tenure_")).collect()
}

fn exported(text: &str, name: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_serves_metrics_whose_raft_series_move_on_a_leader_change() {
    let owned = start_cluster((None, None)).await;
    let nodes = owned.as_slice();
    let leader = serving(nodes, None).await;
    let leader_id = nodes[leader].node.id();
    let followers: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    // A grant commits a batch through Raft: the commit histogram counts it.
    let granted = console(&nodes[leader].info.client_addr, None, "ACQUIRE k 60000").await;
    assert!(granted.starts_with("OK token="), "{granted}");

    let texts = until(
        "every node names the leader, followers heard it",
        || async move {
            let mut texts = Vec::new();
            for n in nodes {
                let text = scrape(n).await;
                let knows = sample(&text, "tenure_cluster_leader_id") == leader_id as f64;
                (knows && exported(&text, "tenure_cluster_last_contact_seconds")).then_some(())?;
                texts.push(text);
            }
            Some(texts)
        },
    )
    .await;
    for (i, text) in texts.iter().enumerate() {
        check_metrics(text);
        let role = if i == leader { "leader" } else { "follower" };
        assert_eq!(
            sample(text, &format!("tenure_cluster_role{{role=\"{role}\"}}")),
            1.0
        );
        assert_eq!(sample(text, "tenure_cluster_role{role=\"candidate\"}"), 0.0);
        assert_eq!(sample(text, "tenure_cluster_members{kind=\"voter\"}"), 3.0);
        assert_eq!(sample(text, "tenure_ready"), 1.0, "{text}");
        assert!(
            sample(text, "tenure_cluster_last_log_index") >= 3.0,
            "{text}"
        );
    }
    let on_leader = &texts[leader];
    assert_eq!(
        sample(on_leader, "tenure_grants_total"),
        1.0,
        "the leader's executor"
    );
    let won = sample(on_leader, "tenure_cluster_elections_won_total");
    assert_eq!(won, 1.0, "{on_leader}");
    assert!(sample(on_leader, "tenure_cluster_commit_duration_seconds_count") >= 1.0);
    for &f in &followers {
        let member = format!(
            "tenure_cluster_replication_lag_entries{{member=\"{}\"}}",
            f + 1
        );
        assert!(sample(on_leader, &member) >= 0.0);
        assert!(!exported(
            &texts[f],
            "tenure_cluster_replication_lag_entries"
        ));
        assert_eq!(
            sample(&texts[f], "tenure_grants_total"),
            0.0,
            "its own executor"
        );
    }
    let (status, body) = http_get(nodes[leader].metrics, "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ready: leader\n"));
    let (status, body) = http_get(nodes[followers[0]].metrics, "/readyz").await;
    let expected = format!("ready: follower, leader {leader_id}\n");
    assert_eq!((status, body), (200, expected));
    shipped_cluster_files_use_exported_metrics(&texts);

    // The leader is cut off: another is elected, and the series say so.
    let term = sample(on_leader, "tenure_cluster_term");
    let changes = sample(&texts[followers[0]], "tenure_cluster_leader_changes_total");
    nodes[leader].node.set_isolated(true);
    let next = serving(nodes, Some(leader)).await;
    let text = until("the new leader's series", || async move {
        let text = scrape(&nodes[next]).await;
        let leads = sample(&text, "tenure_cluster_role{role=\"leader\"}") == 1.0;
        leads.then_some(text)
    })
    .await;
    check_metrics(&text);
    assert!(sample(&text, "tenure_cluster_term") > term, "{text}");
    let won = sample(&text, "tenure_cluster_elections_won_total");
    assert!(won >= 1.0, "{text}");
    assert!(sample(&text, "tenure_cluster_elections_started_total") >= won);
    let next_id = nodes[next].node.id() as f64;
    assert_eq!(sample(&text, "tenure_cluster_leader_id"), next_id);
    let other = *followers.iter().find(|&&f| f != next).unwrap();
    let text = until("the other follower counts the change", || async move {
        let text = scrape(&nodes[other]).await;
        let counted = sample(&text, "tenure_cluster_leader_changes_total") > changes;
        (counted && sample(&text, "tenure_cluster_leader_id") == next_id).then_some(text)
    })
    .await;
    assert_eq!(sample(&text, "tenure_cluster_role{role=\"follower\"}"), 1.0);
    stop(owned).await;
}

/// Every `tenure_*` name of the cluster alerts and dashboard is exported by some node
/// (`texts`), and the alert rules pass `promtool check rules` and their unit tests.
fn shipped_cluster_files_use_exported_metrics(texts: &[String]) {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let alerts = std::fs::read_to_string(deploy.join("cluster-alerts.yml")).unwrap();
    let dashboard = std::fs::read_to_string(deploy.join("grafana-cluster-dashboard.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 8));
    for name in tenure_names(&alerts)
        .into_iter()
        .chain(tenure_names(&dashboard))
    {
        assert!(
            texts.iter().any(|t| exported(t, name)),
            "{name} is not exported by any node"
        );
    }
    for args in [
        ["check", "rules", "cluster-alerts.yml"],
        ["test", "rules", "cluster-alerts.test.yml"],
    ] {
        let out = std::process::Command::new("promtool")
            .args(args)
            .current_dir(&deploy)
            .output()
            .expect("promtool is needed (Debian package `prometheus`)");
        let report = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "promtool {args:?}: {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_until_a_leader_is_known_and_for_a_node_cut_off() {
    let owned = vec![start(1, None).await, start(2, None).await];
    let nodes = owned.as_slice();
    let (status, body) = http_get(nodes[0].metrics, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not in the cluster's membership"), "{body}");
    let (status, _) = http_get(nodes[0].metrics, "/healthz").await;
    assert_eq!(status, 200);
    let text = scrape(&nodes[0]).await;
    assert_eq!(sample(&text, "tenure_ready"), 0.0);
    assert_eq!(sample(&text, "tenure_cluster_leader_id"), 0.0);
    check_metrics(&text);
    let members: BTreeMap<u64, NodeInfo> = nodes
        .iter()
        .map(|n| (n.node.id(), n.info.clone()))
        .collect();
    nodes[0].node.initialize(members).await.unwrap();
    let leader = serving(nodes, None).await;
    let follower = 1 - leader;
    until("the follower is ready", || async move {
        let (status, _) = http_get(nodes[follower].metrics, "/readyz").await;
        (status == 200).then_some(())
    })
    .await;
    // Cut off, the follower stops hearing the leader and stands for election: it knows no
    // leader, and says so.
    nodes[follower].node.set_isolated(true);
    let body = until("the cut-off node is not ready", || async move {
        let (status, body) = http_get(nodes[follower].metrics, "/readyz").await;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.starts_with("not ready: no leader known ("), "{body}");
    let text = scrape(&nodes[follower]).await;
    assert_eq!(sample(&text, "tenure_ready"), 0.0);
    assert_eq!(sample(&text, "tenure_cluster_leader_id"), 0.0);
    stop(owned).await;
}

/// An identities file: `admin` (everything) and `reader` (STATS), plus `extra` entries.
fn identities(dir: &Path, file: &str, extra: &str) -> PathBuf {
    let path = dir.join(file);
    let text = format!(
        "[[identity]]\nname = \"admin\"\nsecret-hash = \"{}\"\nstats = true\nadmin = true\n\n\
         [[identity]]\nname = \"reader\"\nsecret-hash = \"{}\"\nstats = true\n{extra}",
        hash_secret(b"admin-secret").unwrap(),
        hash_secret(b"reader-secret").unwrap(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_the_same_files_report_one_digest_and_a_differing_one_shows() {
    let files = tempfile::tempdir().unwrap();
    let same = identities(files.path(), "identities.toml", "");
    // Node 3's file: the same two identities and one more.
    let differing = files.path().join("other.toml");
    let extra = "\n[[identity]]\nname = \"late\"\nsecret-hash = \"HASH\"\n";
    let text = std::fs::read_to_string(&same).unwrap()
        + &extra.replace("HASH", &hash_secret(b"late").unwrap());
    std::fs::write(&differing, text).unwrap();
    let nodes = start_cluster((Some(same), Some(differing))).await;
    serving(&nodes, None).await;
    let mut lines = Vec::new();
    for n in &nodes {
        let line = until("a status with a last contact", || async move {
            let line = console(
                &n.info.client_addr,
                Some("admin admin-secret"),
                "CLUSTER STATUS",
            )
            .await;
            (field(&line, "last_contact_ms") != "-").then_some(line)
        })
        .await;
        assert!(line.starts_with("OK node_id="), "{line}");
        // The new fields come last, after the ones every client knows.
        let learners = line.find(" learners=").unwrap();
        assert!(
            line.find(" identities_digest=").unwrap() > learners,
            "{line}"
        );
        assert_eq!(field(&line, "trust_digest"), "-", "no client CA: {line}");
        lines.push(line);
    }
    let digest = |i: usize| field(&lines[i], "identities_digest").to_string();
    assert_eq!(digest(0).len(), 16, "{}", lines[0]);
    assert_eq!(digest(0), digest(1), "the same file");
    assert_ne!(digest(0), digest(2), "a different file");
    for (i, n) in nodes.iter().enumerate() {
        let text = scrape(n).await;
        check_metrics(&text);
        let series = format!(
            "tenure_cluster_config_digest_info{{identities=\"{}\",trust=\"-\"}}",
            digest(i)
        );
        assert_eq!(sample(&text, &series), 1.0, "{text}");
    }
    stop(nodes).await;
}

/// The trust digest is of the client CA certificates in force, as a set.
#[test]
fn trust_digest_is_of_the_client_ca_set_in_force() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (
        TestCa::new(dir.path(), "one"),
        TestCa::new(dir.path(), "two"),
    );
    let server = one.server(dir.path(), "server");
    let digest = |client_ca: Option<PathBuf>| {
        let files = TlsFiles {
            cert: server.cert.clone(),
            key: server.key.clone(),
            client_ca,
        };
        let tls = Arc::new(Tls::load(files).unwrap());
        Security::new(None, Some(tls)).trust_digest()
    };
    assert!(digest(None).is_none(), "no client CA");
    let both = dir.path().join("both.pem");
    std::fs::write(&both, one.pem.clone() + &two.pem).unwrap();
    let reversed = dir.path().join("reversed.pem");
    std::fs::write(&reversed, two.pem.clone() + &one.pem).unwrap();
    assert_eq!(
        digest(Some(one.path.clone())),
        digest(Some(one.path.clone()))
    );
    assert_ne!(
        digest(Some(one.path.clone())),
        digest(Some(two.path.clone()))
    );
    assert_eq!(digest(Some(both.clone())), digest(Some(reversed)), "a set");
    assert_ne!(digest(Some(both)), digest(Some(one.path.clone())));

    // A reload that takes effect changes it.
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &one.pem).unwrap();
    let files = TlsFiles {
        cert: server.cert.clone(),
        key: server.key.clone(),
        client_ca: Some(ca.clone()),
    };
    let tls = Arc::new(Tls::load(files).unwrap());
    let security = Security::new(None, Some(Arc::clone(&tls)));
    let before = security.trust_digest();
    std::fs::write(&ca, &two.pem).unwrap();
    assert_eq!(security.trust_digest(), before);
    tls.reload().unwrap();
    assert_ne!(security.trust_digest(), before);
}

/// `tenured --cluster --metrics-listen`: the daemon serves its metrics, and a SIGHUP that
/// changes the identities file changes the digest it reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_daemon_serves_metrics_and_its_digest_follows_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let identities = identities(files.path(), "identities.toml", "");
    let port = || tenure_testkit::free_port();
    let (peer, client, http) = (port(), port(), port());
    let peer = format!("127.0.0.1:{peer}");
    let client: SocketAddr = format!("127.0.0.1:{client}").parse().unwrap();
    let http: SocketAddr = format!("127.0.0.1:{http}").parse().unwrap();
    let initial = format!("1={peer}/{client}");
    let (http_arg, identities_arg) = (http.to_string(), identities.to_str().unwrap());
    let args = [
        "--cluster",
        "--node-id",
        "1",
        "--peer-listen",
        &peer,
        "--initial-cluster",
        &initial,
        "--metrics-listen",
        &http_arg,
        "--identities",
        identities_arg,
    ];
    let daemon = Daemon::start_on(
        Tenured {
            bin: super::tenured_bin(),
            dir: dir.path(),
            logs: None,
            args: &args,
        },
        client,
    );
    let body = until("the single node leads", || async move {
        let (status, body) = http_get(http, "/readyz").await;
        (status == 200).then_some(body)
    })
    .await;
    assert_eq!(body, "ready: leader\n");
    let text = until("its scrape", || async move {
        let (status, text) = http_get(http, "/metrics").await;
        (status == 200).then_some(text)
    })
    .await;
    check_metrics(&text);
    assert_eq!(sample(&text, "tenure_cluster_role{role=\"leader\"}"), 1.0);
    let digest = |text: &str| {
        let line = text
            .lines()
            .find(|l| l.starts_with("tenure_cluster_config_digest_info{"))
            .unwrap_or_else(|| panic!("no digest in {text}"))
            .to_string();
        line
    };
    let before = digest(&text);
    let before = before.as_str();
    let status = console(
        &client.to_string(),
        Some("reader reader-secret"),
        "CLUSTER STATUS",
    )
    .await;
    assert!(
        before.contains(&format!(
            "identities=\"{}\"",
            field(&status, "identities_digest")
        )),
        "{before} vs {status}"
    );
    std::fs::write(
        &identities,
        std::fs::read_to_string(&identities).unwrap() + "watch = true\n",
    )
    .unwrap();
    tenure_testkit::signal(daemon.pid(), "HUP");
    until("the digest changes with the reload", || async move {
        let (_, text) = http_get(http, "/metrics").await;
        (digest(&text) != before).then_some(())
    })
    .await;
    drop(daemon);
}
