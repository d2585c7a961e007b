//! Cluster mode: the lock table replicated through Raft (openraft 0.9), behind the journal
//! seam. The design, and the argument for why leases and tokens stay safe across leaders, is
//! in `server/CLUSTER.md`; this is the code.
//!
//! # Layout
//! - this file: the Raft type configuration: an entry carries a batch of WAL records, a
//!   node's membership info carries its peer and client addresses.
//! - [`log_store`]: the Raft log, an append-only file per node, and the vote, in a small
//!   file replaced atomically.
//! - [`state`]: [`ReplicaState`], the committed leases and token limit every node applies,
//!   and its snapshots (today's snapshot records: a Reserve, then a Grant per lease).
//! - [`network`]: the peer port: length-prefixed postcard frames, both sides, and its
//!   connection slots.
//! - [`peer_check`]: the bounds every peer frame is checked against before openraft sees it.
//! - [`peer_tls`]: mutual TLS on the peer port, certificates naming node ids.
//! - [`cluster_id`]: the cluster id, stored with the log, and the opening of every peer
//!   connection that carries it: nodes of two clusters never talk.
//! - [`prevote`]: when a node asks openraft to start an election: only after a quorum said,
//!   over the peer port, that it would vote for it.
//! - [`journal`]: [`RaftJournal`], the leader's [`Journal`](crate::journal::Journal): group
//!   commit of WAL records as Raft entries, read confirmation through `ensure_linearizable`;
//!   and the follower's journal, which refuses everything with `NOT_LEADER`.
//! - [`admin`]: CLUSTER STATUS, INIT, ADD and REMOVE from the client port.
//! - [`observe`]: what makes a node watchable: the digests of its identities and trust set,
//!   its `tenure_cluster_*` series, and `/readyz`'s answer.
//! - [`bootstrap`]: `--initial-cluster`: the lowest id initialises, once every node
//!   answers that it is fresh.
//! - [`node`]: [`ClusterNode`], one node: Raft, the peer listener, the client listener, and
//!   the leader's life cycle (an executor built on takeover, dropped on loss).

pub mod admin;
pub mod bootstrap;
pub mod catch_up;
pub mod cluster_id;
pub mod journal;
pub mod log_store;
pub mod network;
pub mod node;
pub mod observe;
pub mod peer_check;
pub mod peer_tls;
pub mod prevote;
pub mod state;
#[cfg(test)]
mod tests;

use std::io::Cursor;

use serde::{Deserialize, Serialize};

pub use journal::RaftJournal;
pub use network::{initialize_remote, parse_members};
pub use node::{
    run, ClusterError, ClusterNode, ClusterOptions, ELECTION_TIMEOUT_MS_DEFAULT,
    HEARTBEAT_MS_DEFAULT,
};
pub use state::ReplicaState;

pub use crate::executor::NOT_CLUSTER;

/// A node's id in the cluster.
pub type NodeId = u64;

/// What the membership says about a node: where its peers and its clients reach it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The peer port (Raft traffic), `host:port`.
    pub peer_addr: String,
    /// The client port, `host:port`: what a follower names in `NOT_LEADER`.
    pub client_addr: String,
}

/// One Raft entry's application data: WAL records (`crate::wal::record` encoding), back to
/// back, as the leader's batcher gathered them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The encoded records.
    pub records: Vec<u8>,
}

openraft::declare_raft_types!(
    /// The Raft types of a tenure cluster.
    pub TypeConfig:
        D = Batch,
        R = (),
        NodeId = NodeId,
        Node = NodeInfo,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The openraft handle of this cluster's types.
pub type Raft = openraft::Raft<TypeConfig>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// A log position.
pub type LogId = openraft::LogId<NodeId>;
/// A storage failure, as openraft wants it.
pub type StorageError = openraft::StorageError<NodeId>;

/// An I/O error as openraft's storage error, saying what was being done.
pub(crate) fn storage_error(
    subject: openraft::ErrorSubject<NodeId>,
    verb: openraft::ErrorVerb,
    error: &(impl std::error::Error + 'static),
) -> StorageError {
    openraft::StorageIOError::new(subject, verb, openraft::AnyError::new(error)).into()
}
