//! Three `tenured --cluster` processes whose peer links go through a [`Proxy`].
//!
//! Node `i` (0-based, node id `i + 1`) has its peer listener on `127.0.0.{i + 2}`, so its
//! peer connections leave from an address no other process uses (`127.0.0.1` is left to
//! everything else), and its client listener on `127.0.0.1`. The membership names the
//! proxy's addresses, so every peer link crosses the proxy. The peer port runs mutual TLS
//! (`--peer-tls-*`, a test CA made at start): the proxy passes TLS through, and each node's
//! certificate names its id, not an address.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::proxy::Proxy;
use crate::{free_port, signal, Daemon, Tenured};

/// Nodes in the cluster.
pub const NODES: usize = 3;
/// Longest one console question to a node may take before the node counts as silent.
const ASK_WAIT_MAX: Duration = Duration::from_secs(1);
/// Pause between two rounds of questions while waiting for a leader.
const ASK_PAUSE: Duration = Duration::from_millis(50);

/// One node: its addresses, data directory and process.
struct Node {
    peer: SocketAddr,
    client: SocketAddr,
    dir: TempDir,
    daemon: Option<Daemon>,
    stopped: bool,
}

/// The cluster: three daemons and the proxy between them.
pub struct Cluster {
    bin: PathBuf,
    logs: TempDir,
    /// The peer TLS flags of each node (certificate, key, the cluster's CA).
    peer_tls: Vec<[String; 6]>,
    /// Holds the CA and the node certificates.
    _certs: TempDir,
    /// Flags every node is started with beyond the harness's own.
    extra: Vec<String>,
    nodes: Vec<Node>,
    /// The proxy the peer links cross.
    pub proxy: Proxy,
}

fn node_ip(i: usize) -> IpAddr {
    let last = u8::try_from(i + 2).expect("few nodes");
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
}

fn free_port_on(ip: IpAddr) -> u16 {
    let listener = std::net::TcpListener::bind((ip, 0)).expect("bind port 0");
    listener.local_addr().expect("local addr").port()
}

/// A test CA in `dir` and, per node, the `--peer-tls-*` flags of a certificate from it.
fn peer_tls_flags(dir: &Path) -> Vec<[String; 6]> {
    let ca = crate::tls::TestCa::new(dir, "cluster");
    let path = |p: &Path| p.to_str().expect("UTF-8 path").to_string();
    (1..=NODES as u64)
        .map(|id| {
            let issued = ca.node(dir, id);
            [
                "--peer-tls-cert".to_string(),
                path(&issued.cert),
                "--peer-tls-key".to_string(),
                path(&issued.key),
                "--peer-tls-ca".to_string(),
                path(&ca.path),
            ]
        })
        .collect()
}

impl Cluster {
    /// Starts the proxy and three nodes, and initialises the membership.
    pub async fn start(bin: &Path) -> Cluster {
        Cluster::start_with(bin, &[]).await
    }

    /// [`Cluster::start`], every node (and every restart of one) given `extra` flags too.
    pub async fn start_with(bin: &Path, extra: &[&str]) -> Cluster {
        let peers: Vec<SocketAddr> = (0..NODES)
            .map(|i| SocketAddr::new(node_ip(i), free_port_on(node_ip(i))))
            .collect();
        let proxy = Proxy::start(peers.clone()).await;
        let nodes = peers
            .iter()
            .map(|&peer| Node {
                peer,
                client: SocketAddr::from(([127, 0, 0, 1], free_port())),
                dir: tempfile::tempdir().expect("data dir"),
                daemon: None,
                stopped: false,
            })
            .collect();
        let certs = tempfile::tempdir().expect("certificate dir");
        let peer_tls = peer_tls_flags(certs.path());
        let mut cluster = Cluster {
            bin: bin.to_owned(),
            logs: tempfile::tempdir().expect("log dir"),
            peer_tls,
            _certs: certs,
            extra: extra.iter().map(|flag| flag.to_string()).collect(),
            nodes,
            proxy,
        };
        for i in 0..NODES {
            cluster.launch(i);
        }
        cluster.init();
        cluster
    }

    fn init(&self) {
        let members: Vec<String> = (0..NODES)
            .map(|i| format!("{}={}/{}", i + 1, self.proxy.addr(i), self.nodes[i].client))
            .collect();
        let init = Command::new(&self.bin)
            .args(["cluster-init", "--peer", &self.nodes[0].peer.to_string()])
            .args(["--nodes", &members.join(",")])
            .args(&self.peer_tls[0])
            .output()
            .expect("run cluster-init");
        assert!(init.status.success(), "cluster-init: {init:?}");
    }

    /// Starts node `i`'s process on its ports and data directory.
    fn launch(&mut self, i: usize) {
        let node = &self.nodes[i];
        let (id, peer) = ((i + 1).to_string(), node.peer.to_string());
        let base = ["--cluster", "--node-id", &id, "--peer-listen", &peer];
        let tls = self.peer_tls[i]
            .iter()
            .chain(&self.extra)
            .map(String::as_str);
        let args: Vec<&str> = base.into_iter().chain(tls).collect();
        let what = Tenured {
            bin: &self.bin,
            dir: node.dir.path(),
            logs: Some(self.logs.path()),
            args: &args,
        };
        let client = node.client;
        let daemon = tokio::task::block_in_place(|| Daemon::start_on(what, client));
        self.nodes[i].daemon = Some(daemon);
        self.nodes[i].stopped = false;
    }

    /// The client addresses, comma-separated, starting with node `first`'s.
    pub fn addr_list(&self, first: usize) -> String {
        (0..NODES)
            .map(|k| self.nodes[(first + k) % NODES].client.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node `i`'s client address.
    pub fn client_addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].client
    }

    /// `kill -9` of node `i`.
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut daemon) = self.nodes[i].daemon.take() {
            daemon.kill9();
        }
    }

    /// Starts node `i` again after [`Cluster::kill9`], on its ports and data directory.
    pub fn restart(&mut self, i: usize) {
        self.launch(i);
    }

    /// `kill -9` of node `i`, then a start on a new, empty data directory.
    pub fn wipe_and_restart(&mut self, i: usize) {
        self.kill9(i);
        self.nodes[i].dir = tempfile::tempdir().expect("data dir");
        self.launch(i);
    }

    /// SIGSTOP (`stop`) or SIGCONT of node `i`.
    pub fn pause(&mut self, i: usize, stop: bool) {
        let daemon = self.nodes[i].daemon.as_ref().expect("node running");
        signal(daemon.pid(), if stop { "STOP" } else { "CONT" });
        self.nodes[i].stopped = stop;
    }

    /// The node that answers as leader now, if one does.
    pub async fn leader(&self) -> Option<usize> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.daemon.is_none() || node.stopped {
                continue;
            }
            if ask(node.client, "INSPECT nemesis/leader")
                .await
                .is_some_and(|reply| reply == "FREE" || reply.starts_with("HELD"))
            {
                return Some(i);
            }
        }
        None
    }

    /// The leader, waited for up to `wait`.
    pub async fn wait_leader(&self, wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            if let Some(i) = self.leader().await {
                return Some(i);
            }
            tokio::time::sleep(ASK_PAUSE).await;
        }
        None
    }

    /// Waits up to `wait` until every node answers, the leader as leader and the others
    /// naming it; false if they did not.
    pub async fn wait_settled(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            if let Some(leader) = self.leader().await {
                let named = format!("ERR NOT_LEADER leader={}", self.nodes[leader].client);
                let mut all = true;
                for (i, node) in self.nodes.iter().enumerate() {
                    if i != leader {
                        let reply = ask(node.client, "INSPECT nemesis/leader").await;
                        all &= reply.is_some_and(|r| r.starts_with(&named));
                    }
                }
                if all {
                    return true;
                }
            }
            tokio::time::sleep(ASK_PAUSE).await;
        }
        false
    }

    /// The last index node `i` applied, from its CLUSTER STATUS.
    async fn applied(&self, i: usize) -> Option<u64> {
        self.status_number(i, "last_applied_index").await
    }

    /// Node `i`'s current term, from its CLUSTER STATUS.
    pub async fn term(&self, i: usize) -> Option<u64> {
        self.status_number(i, "term").await
    }

    /// Node `i`'s current term, asked until it answers, up to `wait`.
    pub async fn wait_term(&self, i: usize, wait: Duration) -> Option<u64> {
        let deadline = Instant::now() + wait;
        loop {
            let term = self.term(i).await;
            if term.is_some() || Instant::now() >= deadline {
                return term;
            }
            tokio::time::sleep(ASK_PAUSE).await;
        }
    }

    /// The number `name=` of node `i`'s CLUSTER STATUS.
    async fn status_number(&self, i: usize, name: &str) -> Option<u64> {
        let reply = ask(self.nodes[i].client, "CLUSTER STATUS").await?;
        let prefix = format!("{name}=");
        let value = reply
            .split_whitespace()
            .find_map(|word| word.strip_prefix(prefix.as_str()))?;
        value.parse().ok()
    }

    /// Waits up to `wait` until node `i`, restarted on a wiped data directory, has caught up
    /// with the leader: it applied something (so a leader has reached it and named its
    /// catch-up target), then everything the leader had applied after that. The target its
    /// vote guard waits for is then reached too (it is the leader's commit when it first
    /// reached the node), so the node votes again. False if it did not in time.
    pub async fn wait_caught_up(&self, i: usize, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut goal = None;
        while Instant::now() < deadline {
            let applied = self.applied(i).await.unwrap_or(0);
            if goal.is_none() && applied > 0 {
                if let Some(leader) = self.leader().await {
                    goal = self.applied(leader).await;
                }
            }
            if goal.is_some_and(|goal| applied >= goal) {
                return true;
            }
            tokio::time::sleep(ASK_PAUSE).await;
        }
        false
    }

    /// Where the daemons' logs are.
    pub fn logs(&self) -> &Path {
        self.logs.path()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(daemon) = &node.daemon {
                if node.stopped {
                    signal(daemon.pid(), "CONT");
                }
            }
            node.daemon = None; // Daemon's drop kills it
        }
    }
}

/// One console line to `addr` and its answer, or `None` if none came in time.
async fn ask(addr: SocketAddr, line: &str) -> Option<String> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.ok()?;
        stream
            .write_all(format!("{line}\n").as_bytes())
            .await
            .ok()?;
        let mut reader = BufReader::new(stream);
        let mut reply = String::new();
        reader.read_line(&mut reply).await.ok()?;
        Some(reply.trim_end().to_owned())
    };
    tokio::time::timeout(ASK_WAIT_MAX, exchange)
        .await
        .ok()
        .flatten()
}
