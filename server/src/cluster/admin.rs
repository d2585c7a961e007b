//! Cluster administration on the client port (PROTOCOL.md 3.8): CLUSTER STATUS, INIT, ADD
//! and REMOVE, each answered with the node's view of its cluster after it.
//!
//! STATUS is answered by every node from its own openraft metrics. INIT is openraft's
//! `initialize`, on a node that is not initialised. ADD and REMOVE run on the leader only
//! (another node answers `NOT_LEADER`, naming it, as for every request), through openraft's
//! joint consensus: ADD makes the node a learner, waits (bounded) until it has caught up,
//! then makes it a voter; REMOVE takes a voter out in one change (the leader too: openraft
//! keeps it leading until the change is committed, then it steps down and the others
//! elect). A replacement is an ADD of the new node, then a REMOVE of the old one.
//!
//! Each change runs on a task of its own, so a client that goes away mid-change does not
//! leave it half done (a learner never promoted).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::ChangeMembers;
use tenure_protocol::cluster::{Member, Role, Status, StatusExtension};
use tenure_protocol::{ErrorCode, Request, Response};

use super::journal::LeaderHint;
use super::network::PeerService;
use super::observe::Security;
use super::{NodeId, NodeInfo, Raft};

/// How long ADD waits for the new node's opening ([`Admin::refuse_if_of_another_cluster`]).
const ADD_PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a new node may take to catch up as a learner before ADD gives up (it stays a
/// learner: ADD it again once it runs, or REMOVE it).
pub const CATCH_UP_TIMEOUT: Duration = if cfg!(test) {
    // The in-process tests add a node that never runs: they need the refusal sooner.
    Duration::from_secs(3)
} else {
    Duration::from_secs(30)
};
/// Longest a membership change (both phases of joint consensus) or an INIT may take to
/// commit.
pub const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// The cluster administration of one node.
#[derive(Clone)]
pub struct Admin {
    raft: Raft,
    hint: LeaderHint,
    service: PeerService,
    /// What STATUS's extension digests.
    security: Security,
    /// The ADD or REMOVE this node runs now, if any, in words: one at a time, so a second
    /// is refused rather than interleaved with an ADD's catch-up (openraft refuses only
    /// while a joint configuration is uncommitted: outside test a63, F2).
    changing: Arc<Mutex<Option<String>>>,
}

/// An ADD or REMOVE under way ([`Admin::begin_change`]); its end lets the next one in.
struct Changing(Arc<Mutex<Option<String>>>);

impl Drop for Changing {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

fn refused(message: impl Into<String>) -> Response {
    Response::Error {
        code: ErrorCode::ClusterRefused,
        message: message.into(),
    }
}

fn not_caught_up(id: NodeId) -> Response {
    unavailable(format!(
        "node {id} did not catch up within {CATCH_UP_TIMEOUT:?}; it stays a learner: ADD it \
         again once it runs, or REMOVE it"
    ))
}

fn unavailable(message: impl Into<String>) -> Response {
    Response::Error {
        code: ErrorCode::Unavailable,
        message: message.into(),
    }
}

impl Admin {
    /// The administration of `raft`, node `service.me`, whose STATUS digests `security`.
    pub fn new(raft: Raft, service: PeerService, security: Security) -> Admin {
        Admin {
            hint: LeaderHint::new(raft.clone(), &service),
            raft,
            service,
            security,
            changing: Arc::new(Mutex::new(None)),
        }
    }

    /// Marks `what` under way here, unless another change is.
    fn begin_change(&self, what: String) -> Result<Changing, Response> {
        let mut running = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = running.as_ref() {
            return Err(refused(format!(
                "another membership change is under way here ({other}): send this one \
                 once it is answered"
            )));
        }
        *running = Some(what);
        Ok(Changing(Arc::clone(&self.changing)))
    }

    /// Answers a CLUSTER request (any other request is a programmer error).
    ///
    /// # Panics
    /// If `request` is not a CLUSTER request.
    pub async fn serve(&self, request: Request) -> Response {
        let admin = self.clone();
        let task = tokio::spawn(async move {
            match request {
                Request::ClusterStatus { extended } => {
                    let mut status = admin.status();
                    if extended {
                        status.extension = Some(Box::new(admin.extension()));
                    }
                    Response::Cluster(status)
                }
                Request::ClusterInit { members } => admin.init(members).await,
                Request::ClusterAdd { member } => admin.add(member).await,
                Request::ClusterRemove { id } => admin.remove(id).await,
                other => panic!("{} is not a cluster request", other.kind()),
            }
        });
        match task.await {
            Ok(response) => response,
            Err(e) => unavailable(format!("the cluster request failed: {e}")),
        }
    }

    /// STATUS's extension: this node's digests and last contact now.
    pub fn extension(&self) -> StatusExtension {
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        super::observe::extension(&m, &self.security, &self.service.catch_up)
    }

    /// This node's view of its cluster, without the extension.
    pub fn status(&self) -> Status {
        let metrics = self.raft.metrics();
        let m = metrics.borrow();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(&id, info)| (member(id, info), voters.contains(&id)))
            .collect();
        let known =
            super::catch_up::known_leader(&m, &self.service.catch_up, self.service.prevote.lease());
        let leader = known.and_then(|id| Some((id, membership.get_node(&id)?)));
        Status {
            node_id: m.id,
            role: super::observe::role_of(m.state),
            term: m.current_term,
            leader_id: leader.map_or(0, |(id, _)| id),
            leader_addr: leader.map_or(String::new(), |(_, n)| n.client_addr.clone()),
            last_log_index: m.last_log_index.unwrap_or(0),
            last_applied_index: m.last_applied.map_or(0, |l| l.index),
            members,
            extension: None,
        }
    }

    /// INIT: `members` become the first membership, all voters.
    async fn init(&self, members: Vec<Member>) -> Response {
        let me = self.status().node_id;
        if !members.iter().any(|m| m.id == me) {
            return refused(format!(
                "node {me} (this node) is not among the members given"
            ));
        }
        let members: BTreeMap<NodeId, NodeInfo> =
            members.into_iter().map(|m| (m.id, info(&m))).collect();
        let initialize = super::bootstrap::initialize(&self.raft, &self.service, members);
        match tokio::time::timeout(CHANGE_TIMEOUT, initialize).await {
            Ok(Ok(())) => Response::Cluster(self.status()),
            Ok(Err(e)) => refused(format!("cannot initialise: {e}")),
            Err(_) => unavailable(format!("the initialisation took over {CHANGE_TIMEOUT:?}")),
        }
    }

    /// `NOT_LEADER` naming the leader, unless this node leads.
    fn refuse_if_not_leader(&self) -> Option<Response> {
        let status = self.status();
        if status.role == Role::Leader && status.leader_id == status.node_id {
            return None;
        }
        Some(Response::Error {
            code: ErrorCode::NotLeader,
            message: self.hint.message(false).to_string(),
        })
    }

    /// ADD: `member` becomes a learner, catches up, then becomes a voter.
    async fn add(&self, member: Member) -> Response {
        if let Some(refusal) = self.refuse_if_not_leader() {
            return refusal;
        }
        let _changing = match self.begin_change(format!("ADD of node {}", member.id)) {
            Ok(changing) => changing,
            Err(refusal) => return refusal,
        };
        let status = self.status();
        let present = status.members.iter().find(|(m, _)| m.id == member.id);
        match present {
            Some((m, _)) if *m != member => {
                return refused(format!(
                    "node {} is a member already, at {}/{}: REMOVE it first to move it",
                    m.id, m.peer_addr, m.client_addr
                ))
            }
            Some((_, true)) => return Response::Cluster(status),
            _ => {}
        }
        let others = status.members.iter().map(|(m, _)| m);
        if let Err(e) = tenure_protocol::cluster::validate_distinct(&member, others) {
            return refused(e.message);
        }
        if let Err(why) = self.refuse_if_of_another_cluster(&member).await {
            return refused(why);
        }
        tracing::info!(node = member.id, peer = %member.peer_addr, "adding a node as a learner");
        let give_up = tokio::time::Instant::now() + CATCH_UP_TIMEOUT;
        let learner = self.raft.add_learner(member.id, info(&member), true);
        let added = match tokio::time::timeout_at(give_up, learner).await {
            Ok(Ok(added)) => added.log_id,
            Ok(Err(e)) => return self.write_failed(e),
            Err(_) => return not_caught_up(member.id),
        };
        // openraft's "blocking" add returns once the learner lags by less than its
        // replication_lag_threshold (5 000 entries), which a young log always does, even for
        // a node that is not running. So wait until the learner has the entry that added it.
        let mut metrics = self.raft.metrics();
        let has_it = |m: &openraft::RaftMetrics<NodeId, NodeInfo>| {
            let matched = m
                .replication
                .as_ref()
                .and_then(|r| r.get(&member.id).copied());
            matched.flatten().is_some_and(|id| id.index >= added.index)
        };
        match tokio::time::timeout_at(give_up, metrics.wait_for(has_it)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return unavailable("this node stopped while the learner caught up"),
            Err(_) => return not_caught_up(member.id),
        }
        tracing::info!(node = member.id, "learner caught up: making it a voter");
        let change = ChangeMembers::AddVoterIds(BTreeSet::from([member.id]));
        self.change(change).await
    }

    /// Refuses to add a node whose peer port answers with another cluster's id: every
    /// connection to it would be refused and it would never catch up. A node that cannot be
    /// reached now is added (it becomes a learner, and catches up once it runs).
    async fn refuse_if_of_another_cluster(&self, member: &Member) -> Result<(), String> {
        let dial = self.service.dialer.dial(member.id, &member.peer_addr);
        match tokio::time::timeout(ADD_PROBE_TIMEOUT, dial).await {
            Ok(Err(e)) if super::cluster_id::is_refusal(&e) => Err(format!(
                "node {} at {} belongs to another cluster ({e}): a node joins one cluster \
                 only; wipe its data directory to make it fresh",
                member.id, member.peer_addr
            )),
            _ => Ok(()),
        }
    }

    /// REMOVE: node `id` leaves the membership.
    async fn remove(&self, id: NodeId) -> Response {
        if let Some(refusal) = self.refuse_if_not_leader() {
            return refusal;
        }
        let _changing = match self.begin_change(format!("REMOVE of node {id}")) {
            Ok(changing) => changing,
            Err(refusal) => return refusal,
        };
        let status = self.status();
        let voters: Vec<u64> = status
            .members
            .iter()
            .filter(|(_, voter)| *voter)
            .map(|(m, _)| m.id)
            .collect();
        let change = match status.members.iter().find(|(m, _)| m.id == id) {
            None => return refused(format!("node {id} is not a member")),
            Some((_, false)) => ChangeMembers::RemoveNodes(BTreeSet::from([id])),
            Some(_) if voters == [id] => {
                return refused(format!("node {id} is the last voter: a cluster needs one"))
            }
            Some(_) => ChangeMembers::RemoveVoters(BTreeSet::from([id])),
        };
        tracing::info!(node = id, "removing a node");
        self.change(change).await
    }

    /// Runs a membership change (joint consensus, then the final membership), bounded.
    async fn change(&self, change: ChangeMembers<NodeId, NodeInfo>) -> Response {
        let change = self.raft.change_membership(change, false);
        match tokio::time::timeout(CHANGE_TIMEOUT, change).await {
            Ok(Ok(_)) => Response::Cluster(self.status()),
            Ok(Err(e)) => self.write_failed(e),
            Err(_) => unavailable(format!(
                "the membership change was not committed within {CHANGE_TIMEOUT:?} \
                 (CLUSTER STATUS shows where it stands)"
            )),
        }
    }

    /// A refused proposal: `NOT_LEADER` if leadership moved, else why.
    fn write_failed(
        &self,
        error: RaftError<NodeId, ClientWriteError<NodeId, NodeInfo>>,
    ) -> Response {
        match error {
            RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => Response::Error {
                code: ErrorCode::NotLeader,
                message: self.hint.message(false).to_string(),
            },
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                refused(e.to_string())
            }
            RaftError::Fatal(e) => unavailable(e.to_string()),
        }
    }
}

fn member(id: NodeId, info: &NodeInfo) -> Member {
    Member {
        id,
        peer_addr: info.peer_addr.clone(),
        client_addr: info.client_addr.clone(),
    }
}

fn info(member: &Member) -> NodeInfo {
    NodeInfo {
        peer_addr: member.peer_addr.clone(),
        client_addr: member.client_addr.clone(),
    }
}

/// The executor reaches the administration through this, and so never imports the cluster.
impl crate::executor::ClusterAdmin for Admin {
    fn serve(&self, request: Request) -> futures_util::future::BoxFuture<'_, Response> {
        Box::pin(Admin::serve(self, request))
    }
}
