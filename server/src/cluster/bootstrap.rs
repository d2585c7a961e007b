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
use std::net::IpAddr;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::network::probe_remote;
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
/// Probes leave from `source`, the peer listener's address.
pub async fn run(
    raft: Raft,
    me: NodeId,
    members: BTreeMap<NodeId, NodeInfo>,
    source: IpAddr,
    stop: CancellationToken,
) {
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
        match probe(me, &members, source).await {
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
    match raft.initialize(members).await {
        Ok(()) => tracing::info!(count, "initialised the cluster from --initial-cluster"),
        Err(e) => tracing::warn!(error = %e, "--initial-cluster: initialisation refused"),
    }
}

/// Asks every member but `me` whether it is initialised.
async fn probe(me: NodeId, members: &BTreeMap<NodeId, NodeInfo>, source: IpAddr) -> Round {
    let mut missing = Vec::new();
    for (&id, info) in members.iter().filter(|(&id, _)| id != me) {
        match probe_remote(source, &info.peer_addr).await {
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
