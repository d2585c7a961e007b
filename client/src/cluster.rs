//! Cluster administration (PROTOCOL.md 3.8): the status of a node, and the membership's
//! first making, growth and shrinking. Each answers the node's view of its cluster after it.
//!
//! ADD and REMOVE run on the leader: given several addresses, the client follows
//! `NOT_LEADER` to it, as for every request. STATUS is answered by whichever node the client
//! is connected to, from its own view. A single-node server answers each
//! [`ErrorCode::UnknownOpcode`](crate::ErrorCode::UnknownOpcode) ("not in cluster mode").
//!
//! This module holds the vocabulary (members, status, parsing) and the time-out of a
//! membership change; the requests are [`Client`](crate::Client)'s methods
//! (`cluster_status`, `cluster_init`, `cluster_add`, `cluster_remove`), next to the others.

use std::time::Duration;

pub use tenure_protocol::cluster::{
    format_members, parse_addrs, parse_members, Digest, Member, Role, Status, StatusExtension,
};

/// Least time a membership change is given, whatever the request timeout: an ADD waits for
/// the new node to catch up (the server gives up after 30 s) and for two commits.
pub const CHANGE_TIMEOUT_MIN: Duration = Duration::from_secs(60);
