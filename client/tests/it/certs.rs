//! `tenure certs`, and the openssl recipe of server/CLUSTER.md that it stands for: the files
//! each makes start a cluster with peer TLS that elects and serves (with client TLS from
//! `--server`'s certificate), a node's certificate speaks for that node only, keys are
//! written 0600 and nothing is overwritten without `--force`. Real time: in-process nodes,
//! the command line a process of its own.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tenure::{AcquireOptions, AcquireOutcome, Client, ClientConfig, TlsOptions};
use tenure_server::cluster::cluster_id::ClusterId;
use tenure_server::cluster::network::{Dialer, PeerNetwork};
use tenure_server::cluster::peer_tls::{PeerTls, PeerTlsFiles};
use tenure_server::cluster::prevote::PreVoteRequest;
use tenure_server::cluster::{ClusterNode, ClusterOptions, NodeId, NodeInfo};
use tokio::net::TcpListener;
use tokio::time::{timeout, Instant};

/// Longest an election, a takeover or a command may take here.
const WAIT_MAX: Duration = Duration::from_secs(30);

/// Runs `tenure certs <args>`: exit code and output.
async fn certs(args: &[&str]) -> (i32, String) {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tenure"));
    command.arg("certs").args(args);
    let output = timeout(WAIT_MAX, command.kill_on_drop(true).output())
        .await
        .expect("tenure certs finishes")
        .expect("tenure runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code().expect("exited normally"), text)
}

/// Node `id`'s peer TLS files in `dir` (as both tools name them).
fn node_files(dir: &Path, id: NodeId) -> PeerTlsFiles {
    PeerTlsFiles {
        cert: dir.join(format!("node-{id}.pem")),
        key: dir.join(format!("node-{id}.key")),
        ca: dir.join("cluster-ca.pem"),
    }
}

struct Node {
    node: ClusterNode,
    info: NodeInfo,
    _dir: tempfile::TempDir,
}

/// Node `id` with the certificates in `certs`: peer TLS, and client TLS with
/// `server.pem`.
async fn start(id: NodeId, certs: &Path, files: PeerTlsFiles) -> Result<Node, String> {
    let peers = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let clients = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let info = NodeInfo {
        peer_addr: peers.local_addr().unwrap().to_string(),
        client_addr: clients.local_addr().unwrap().to_string(),
    };
    let dir = tempfile::tempdir().unwrap();
    let mut options = ClusterOptions::new(id, dir.path().to_path_buf());
    // Generous, so a loaded machine does not hold spurious elections mid-test.
    options.heartbeat_ms = 100;
    options.election_timeout_ms = (800, 1600);
    options.peer_tls = Some(files);
    let config = tenure_server::Config {
        tls: Some(tenure_server::tls::TlsFiles {
            cert: certs.join("server.pem"),
            key: certs.join("server.key"),
            client_ca: None,
        }),
        ..tenure_server::Config::default()
    };
    let node = ClusterNode::start(config, options, peers, clients)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Node {
        node,
        info,
        _dir: dir,
    })
}

/// Node `id`'s dialer, saying `cluster`.
fn dialer(certs: &Path, id: NodeId, cluster: Option<u128>) -> Dialer {
    let tls = PeerTls::load(&node_files(certs, id)).expect("node certificate loads");
    Dialer::new("127.0.0.1".parse().unwrap(), Some(Arc::new(tls)))
        .with_cluster_id(Arc::new(ClusterId::unstored(cluster)))
}

/// Starts three nodes with the certificates in `certs`, initialises them over the peer
/// port with node 1's certificate, and checks that they elect and serve over client TLS,
/// that node 3 will not start with node 2's certificate and that node 2's certificate
/// cannot ask for a pre-vote as node 3 (it can as itself).
async fn a_cluster_elects_and_serves_with(certs: &Path) {
    let refused = start(3, certs, node_files(certs, 2)).await;
    let refused = refused
        .err()
        .expect("node 3 started with node 2's certificate");
    assert!(refused.contains("names node 2"), "{refused}");
    let mut nodes = Vec::new();
    for id in 1..=3 {
        nodes.push(start(id, certs, node_files(certs, id)).await.unwrap());
    }
    let members: BTreeMap<NodeId, NodeInfo> = nodes
        .iter()
        .map(|n| (n.node.id(), n.info.clone()))
        .collect();
    let init_dialer = dialer(certs, 1, None);
    let init = tenure_server::cluster::initialize_remote(
        &init_dialer,
        &nodes[0].info.peer_addr,
        members.clone(),
    );
    init.await.expect("cluster-init with node 1's certificate");

    let addrs: Vec<&str> = nodes.iter().map(|n| n.info.client_addr.as_str()).collect();
    let tls = TlsOptions::from_files(&certs.join("cluster-ca.pem"), None).unwrap();
    let config = ClientConfig::default().with_tls(tls);
    let client = Client::connect_with(addrs.join(","), config).await.unwrap();
    let deadline = Instant::now() + WAIT_MAX;
    let lease = loop {
        let acquired = client
            .acquire("certs", Duration::from_secs(60), AcquireOptions::default())
            .await;
        match acquired {
            Ok(AcquireOutcome::Granted(lease)) => break lease,
            other => assert!(Instant::now() < deadline, "no grant: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let again = client
        .acquire("certs", Duration::from_secs(1), AcquireOptions::default())
        .await;
    assert!(matches!(again, Ok(AcquireOutcome::Locked(_))), "{again:?}");

    let cluster = nodes[0].node.cluster_id();
    assert!(cluster.is_some());
    let term = nodes[0].node.raft().metrics().borrow().current_term;
    let mut network = PeerNetwork::new(Default::default(), dialer(certs, 2, cluster));
    let ask = |candidate| PreVoteRequest {
        candidate,
        term: term + 1,
        last_log_id: None,
    };
    let ttl = Duration::from_secs(5);
    let as_3 = network.ask_pre_vote(1, &members[&1], ask(3), ttl).await;
    assert!(
        as_3.is_err(),
        "node 2's certificate spoke as node 3: {as_3:?}"
    );
    let as_2 = network.ask_pre_vote(1, &members[&1], ask(2), ttl).await;
    assert!(as_2.is_ok(), "node 2's certificate as itself: {as_2:?}");
    drop((lease, client));
    for node in nodes {
        node.node.kill().await;
    }
}

fn mode(path: PathBuf) -> u32 {
    std::fs::metadata(&path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenure_certs_make_a_cluster_that_elects_and_serves_and_keep_their_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    let out_arg = out.to_str().unwrap();
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "1,2,3", "--server"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("result=OK "), "{text}");
    for name in ["cluster-ca", "node-1", "node-2", "node-3", "server"] {
        assert_eq!(mode(out.join(format!("{name}.key"))), 0o600, "{name}.key");
        assert_eq!(mode(out.join(format!("{name}.pem"))), 0o644, "{name}.pem");
    }
    let before = std::fs::read(out.join("cluster-ca.key")).unwrap();
    // A node added later (outside tester a29, finding 3: this made no certificate at all):
    // the CA already in the directory signs its certificate, so its peers trust it.
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "4"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(" ca=reused"), "{text}");
    assert_eq!(std::fs::read(out.join("cluster-ca.key")).unwrap(), before);
    let verified = std::process::Command::new("openssl")
        .args(["verify", "-CAfile"])
        .args([out.join("cluster-ca.pem"), out.join("node-4.pem")])
        .output()
        .expect("openssl runs (dev/test installs it)");
    let verified = String::from_utf8_lossy(&verified.stdout);
    assert!(verified.trim_end().ends_with(": OK"), "{verified}");
    let node_3 = std::fs::read(out.join("node-3.pem")).unwrap();
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "3,5"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("exists (--force replaces it)"), "{text}");
    assert_eq!(std::fs::read(out.join("node-3.pem")).unwrap(), node_3);
    assert!(
        !out.join("node-5.pem").exists(),
        "nothing is written on a refusal"
    );
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "0"]).await;
    assert_eq!(code, 1, "{text}");
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "6,6"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("names node 6 twice"), "{text}");
    // A node's certificate and key put in as the CA (outside re-check a29b) are refused:
    // what they signed would verify nowhere.
    let leaf_as_ca = dir.path().join("leaf-as-ca");
    std::fs::create_dir(&leaf_as_ca).unwrap();
    for ext in ["pem", "key"] {
        let (from, to) = (format!("node-1.{ext}"), format!("cluster-ca.{ext}"));
        std::fs::copy(out.join(from), leaf_as_ca.join(to)).unwrap();
    }
    let (code, text) = certs(&["--dir", leaf_as_ca.to_str().unwrap(), "--nodes", "5"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("is not a CA certificate"), "{text}");

    a_cluster_elects_and_serves_with(&out).await;

    let (code, text) = certs(&["--dir", out_arg, "--nodes", "1,2,3", "--server", "--force"]).await;
    assert_eq!(code, 0, "{text}");
    assert_ne!(std::fs::read(out.join("cluster-ca.key")).unwrap(), before);
    assert_eq!(mode(out.join("cluster-ca.key")), 0o600);
    // node-4.pem, signed by the old CA, is named: its node is no longer trusted. The ones
    // made again are not.
    let warning = text
        .lines()
        .find(|l| l.starts_with("warning="))
        .unwrap_or_default();
    assert!(
        warning.contains("node-4.pem were signed by the old CA"),
        "{text}"
    );
    // Its advice works: without --force the new CA signs node 4's certificate again.
    assert!(warning.contains("--nodes 4` without --force"), "{text}");
    for ext in ["pem", "key"] {
        std::fs::remove_file(out.join(format!("node-4.{ext}"))).unwrap();
    }
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "4"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(" ca=reused") && !text.contains("warning="),
        "{text}"
    );
    assert!(
        !warning.contains("node-3.pem") && !warning.contains("server.pem"),
        "{text}"
    );
}

/// A CA key others may read is warned of when the CA is reused, and a PEM file cut short
/// is named by the line it lacks (outside test a29: the error listed the line's bytes).
#[tokio::test]
async fn tenure_certs_warns_of_a_readable_ca_key_and_names_what_a_cut_pem_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    let out_arg = out.to_str().unwrap();
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "1"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains("warning="), "{text}");
    let key = out.join("cluster-ca.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "2"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("may be read by its group or others (mode 0644)"),
        "{text}"
    );

    let pem = std::fs::read_to_string(out.join("cluster-ca.pem")).unwrap();
    std::fs::write(out.join("cluster-ca.pem"), &pem[..pem.len() / 2]).unwrap();
    let (code, text) = certs(&["--dir", out_arg, "--nodes", "3"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains(r#"cut short or damaged: no \"-----END CERTIFICATE-----\" line"#),
        "{text}"
    );
    assert!(!text.contains("[67, "), "{text}");
}

/// The openssl commands of CLUSTER.md's "Peer TLS", read from the document and run by
/// bash as written, plus a client-port certificate as `tls-auth.sh` makes it: the same
/// cluster elects and serves. Needs bash and openssl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openssl_recipe_of_cluster_md_makes_a_cluster_that_elects_and_serves() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../server/CLUSTER.md"))
        .unwrap();
    let start = doc
        .find("The same with openssl")
        .expect("CLUSTER.md has the openssl recipe");
    let block = &doc[start..];
    let block = &block[block.find("```text\n").unwrap() + 8..];
    let recipe = &block[..block.find("```").unwrap()];
    let server = "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
        -subj /CN=tenured -keyout server.key -out server.csr && openssl x509 -req \
        -in server.csr -CA cluster-ca.pem -CAkey cluster-ca.key -days 1 \
        -extfile <(printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth') \
        -out server.pem";
    let dir = tempfile::tempdir().unwrap();
    let script = format!("set -euo pipefail\n{recipe}\n{server}\n");
    let output = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .output()
        .await
        .expect("bash runs");
    assert!(
        output.status.success(),
        "the recipe failed (openssl installed?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    a_cluster_elects_and_serves_with(dir.path()).await;
}
