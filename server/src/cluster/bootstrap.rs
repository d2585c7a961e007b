//! `--initial-cluster`: a cluster that forms by itself, safely.
//!
//! Every node is started with the same membership. Only the node with the lowest id ever
//! initialises, and only when:
//! - its own data directory is fresh (no log, no vote: openraft's `is_initialized`), and
//! - every other node listed has answered, over the peer port, that it is fresh too.
//!
//! If any node answers that it is initialised, this node never initialises: the cluster
//! exists, and this is a node whose data was wiped (or lost) coming back. It stays
//! uninitialised until the leader, which still has it in its membership, replicates to it:
//! it then catches up and follows as before. (A node whose addresses changed must be
//! removed and added again.) Until every node has answered, the probe is tried again after
//! a pause that doubles up to [`BACKOFF_MAX`]; a node that becomes initialised meanwhile (a
//! leader reached it) stops trying. A restart of an initialised node with the flag does
//! nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::network::{bootstrap_remote, probe_remote, Dialer, PeerService};
use super::{NodeId, NodeInfo, Raft};

/// First pause between two rounds of probes.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest pause between two rounds of probes.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What one round of probes found.
enum Round {
    /// Every other node is fresh: initialise.
    AllFresh,
    /// Some node is initialised (named): never initialise.
    Initialised(NodeId),
    /// Some nodes did not answer (named, with why): try again later.
    Waiting(Vec<String>),
}

/// Whether node `me` is the one of `members` that initialises: the lowest id.
pub fn initialises(me: NodeId, members: &BTreeMap<NodeId, NodeInfo>) -> bool {
    members.keys().next() == Some(&me)
}

/// Runs the bootstrap of node `me` (see the module docs) until it is done or `stop`.
/// Probes are dialled as Raft's connections are (`service.dialer`).
pub async fn run(
    raft: Raft,
    service: PeerService,
    members: BTreeMap<NodeId, NodeInfo>,
    stop: CancellationToken,
) {
    let me = service.me;
    if !initialises(me, &members) {
        return;
    }
    let mut backoff = BACKOFF_MIN;
    loop {
        match raft.is_initialized().await {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!("initialised already: --initial-cluster has nothing to do");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "bootstrap stopped: raft is not running");
                return;
            }
        }
        match probe(me, &members, &service.dialer).await {
            Round::AllFresh => break,
            Round::Initialised(node) => {
                tracing::warn!(
                    node,
                    "node {node} is initialised: the cluster exists, so this node does not \
                     initialise it again; its leader will bring this node back"
                );
                return;
            }
            Round::Waiting(missing) => {
                tracing::info!(?missing, retry_in = ?backoff, "waiting for every node of --initial-cluster");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    let count = members.len();
    match initialize(&raft, &service, members).await {
        Ok(()) => tracing::info!(count, "initialised the cluster from --initial-cluster"),
        Err(e) => tracing::warn!(error = %e, "--initial-cluster: initialisation refused"),
    }
}

/// Makes `members` the first membership, from this node (`cluster-init`, CLUSTER INIT,
/// `--initial-cluster`): only if every other member answers that it is fresh, which lifts
/// its vote guard for the first election ([`super::catch_up`]); then this node makes the
/// cluster id ([`super::cluster_id`]), its own guard lifts and openraft initialises.
///
/// # Errors
/// Why not: a member is initialised already (the cluster exists: a wiped node rejoins by
/// itself, never by a new initialisation), a member did not answer, or openraft refused.
pub async fn initialize(
    raft: &Raft,
    service: &PeerService,
    members: BTreeMap<NodeId, NodeInfo>,
) -> Result<(), String> {
    if !members.contains_key(&service.me) {
        return Err(format!(
            "node {} (this node) is not among the members",
            service.me
        ));
    }
    if raft.is_initialized().await.map_err(|e| e.to_string())? {
        return Err("this node is initialised already".to_string());
    }
    for (&id, info) in members.iter().filter(|(&id, _)| id != service.me) {
        match bootstrap_remote(&service.dialer, id, &info.peer_addr).await {
            Ok(false) => {}
            Ok(true) => {
                return Err(format!(
                    "node {id} belongs to a cluster already: a node with a wiped data \
                     directory rejoins its cluster by itself, without a new initialisation"
                ))
            }
            Err(why) => {
                return Err(format!(
                    "node {id} ({}) did not answer: {why}; start every node first",
                    info.peer_addr
                ))
            }
        }
    }
    // The cluster's id, stored before the first vote request can carry it.
    let ids = service.dialer.cluster_id();
    ids.mint()
        .map_err(|e| format!("cannot store the cluster id: {e}"))?;
    service.catch_up.lift(raft, "initialising a new cluster");
    raft.initialize(members).await.map_err(|e| e.to_string())
}

/// Asks every member but `me` whether it is initialised.
async fn probe(me: NodeId, members: &BTreeMap<NodeId, NodeInfo>, dialer: &Dialer) -> Round {
    let mut missing = Vec::new();
    for (&id, info) in members.iter().filter(|(&id, _)| id != me) {
        match probe_remote(dialer, id, &info.peer_addr).await {
            Ok(true) => return Round::Initialised(id),
            Ok(false) => {}
            Err(why) => missing.push(format!("{id}: {why}")),
        }
    }
    if missing.is_empty() {
        Round::AllFresh
    } else {
        Round::Waiting(missing)
    }
}
