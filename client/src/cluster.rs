//! Cluster administration (PROTOCOL.md 3.8): the status of a node, and the membership's
//! first making, growth and shrinking. Each answers the node's view of its cluster after it.
//!
//! ADD and REMOVE run on the leader: given several addresses, the client follows
//! `NOT_LEADER` to it, as for every request. STATUS is answered by whichever node the client
//! is connected to, from its own view. A single-node server answers each
//! [`ErrorCode::UnknownOpcode`](crate::ErrorCode::UnknownOpcode) ("not in cluster mode").

use std::time::Duration;

use tenure_protocol::{Request, Response};

pub use tenure_protocol::cluster::{
    format_members, parse_addrs, parse_members, Digest, Member, Role, Status, StatusExtension,
};
use tenure_protocol::ErrorCode;

use crate::client::Client;
use crate::error::{Error, Result};

/// Least time a membership change is given, whatever the request timeout: an ADD waits for
/// the new node to catch up (the server gives up after 30 s) and for two commits.
pub const CHANGE_TIMEOUT_MIN: Duration = Duration::from_secs(60);

impl Client {
    /// The connected node's view of its cluster: its role and term, the leader, its log
    /// position and the membership, and its [`StatusExtension`] (the digests of its
    /// identities and trust set, its last contact) when the server has it: a server older
    /// than the extension refuses the request for it with `BAD_FRAME`, and is asked again
    /// without (`extension` is then `None`).
    ///
    /// # Errors
    /// [`Error::Server`] from a single-node server; otherwise any [`Error`] a request can meet.
    pub async fn cluster_status(&self) -> Result<Status> {
        let timeout = self.config().request_timeout;
        let extended = Request::ClusterStatus { extended: true };
        match self.cluster_call(extended, timeout).await {
            Err(Error::Server {
                code: ErrorCode::BadFrame,
                ..
            }) => {
                let plain = Request::ClusterStatus { extended: false };
                self.cluster_call(plain, timeout).await
            }
            answer => answer,
        }
    }

    /// Makes `members` the cluster's first membership, all voters, on the connected node
    /// (which must be among them and not yet initialised).
    ///
    /// # Errors
    /// [`Error::Server`] with [`ErrorCode::ClusterRefused`](crate::ErrorCode::ClusterRefused)
    /// when the node is initialised already or not among `members`; otherwise any [`Error`].
    pub async fn cluster_init(&self, members: Vec<Member>) -> Result<Status> {
        let request = Request::ClusterInit { members };
        self.cluster_call(request, self.change_timeout()).await
    }

    /// Adds `member`: a learner first, then, once it has caught up, a voter (joint
    /// consensus). Adding a voter again at the same addresses changes nothing.
    ///
    /// # Errors
    /// [`Error::Server`]: `CLUSTER_REFUSED` for an id present at other addresses or a change
    /// already under way, `UNAVAILABLE` when the node did not catch up in time (it stays a
    /// learner); otherwise any [`Error`].
    pub async fn cluster_add(&self, member: Member) -> Result<Status> {
        let request = Request::ClusterAdd { member };
        self.cluster_call(request, self.change_timeout()).await
    }

    /// Removes node `id` from the membership (the leader too: it steps down once the change
    /// is committed). The node may then be stopped.
    ///
    /// # Errors
    /// [`Error::Server`]: `CLUSTER_REFUSED` for an id that is not a member or the last
    /// voter; otherwise any [`Error`].
    pub async fn cluster_remove(&self, id: u64) -> Result<Status> {
        let request = Request::ClusterRemove { id };
        self.cluster_call(request, self.change_timeout()).await
    }

    fn change_timeout(&self) -> Duration {
        self.config().request_timeout.max(CHANGE_TIMEOUT_MIN)
    }

    async fn cluster_call(&self, request: Request, timeout: Duration) -> Result<Status> {
        let kind = request.kind();
        match self.call(request, timeout).await?.response {
            Response::Cluster(status) => Ok(status),
            Response::Error { code, message } => Err(Error::Server { code, message }),
            other => Err(Error::Protocol(format!(
                "unexpected reply {other:?} to {kind}"
            ))),
        }
    }
}
