//! The vote guard of a node that starts with an empty data directory.
//!
//! Raft's safety rests on every voter keeping what it acknowledged: its log and its vote. A
//! node restarted on a wiped (or lost) data directory has neither, yet its peers still count
//! it. If it voted at once, an entry that was committed by the old leader and this node
//! alone could be lost: the old leader dies, and this node, empty, elects the other
//! follower, which never had the entry (an acknowledged grant gone, a fencing token handed
//! out twice). So a node that starts fresh neither votes nor stands for election until it
//! has caught up:
//! - the first AppendEntries from a leader that has committed an entry of its own term
//!   names that commit index (a leader that committed in its own term has every entry ever
//!   committed in its log, below that index);
//! - once this node has applied up to that index, it holds every entry any quorum it
//!   belonged to before the wipe had committed, and the guard lifts: it votes again, and
//!   may stand for election.
//!
//! Until then a vote request is left unanswered (the candidate counts it as unreachable).
//! A cluster that also loses its leader while a wiped node is catching up stops serving
//! rather than elect a leader that lacks committed entries: two of three nodes have failed.
//!
//! A brand-new cluster's nodes are all fresh too: the node that initialises it first asks
//! every other member, over the peer port, whether it is fresh ([`PeerRequest::Bootstrap`]);
//! each fresh one lifts its guard, and the initialisation goes ahead only if all are fresh.
//! A node added to a running cluster joins as a learner and catches up before it votes, as
//! above.
//!
//! [`PeerRequest::Bootstrap`]: super::network::PeerRequest::Bootstrap

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use openraft::raft::AppendEntriesRequest;
use openraft::{RaftMetrics, ServerState};

use super::{NodeId, NodeInfo, Raft, TypeConfig};

/// `target` before a leader has named one.
const NO_TARGET: u64 = u64::MAX;

/// See the module docs.
#[derive(Debug)]
pub struct CatchUp {
    guarding: AtomicBool,
    /// The commit index to apply before the guard lifts, once a leader named one.
    target: AtomicU64,
    /// When the guard was made: the origin of `last_append_ms`.
    started: Instant,
    /// Milliseconds after `started` of the last AppendEntries this node received, or
    /// [`NO_APPEND`]: kept here, where every append already passes, for CLUSTER STATUS's
    /// last contact and the metrics.
    last_append_ms: AtomicU64,
}

/// `last_append_ms` before any AppendEntries arrived.
const NO_APPEND: u64 = u64::MAX;

impl CatchUp {
    /// A guard that is up (`fresh`: the node started with an empty data directory) or not.
    pub fn new(fresh: bool) -> Arc<CatchUp> {
        Arc::new(CatchUp {
            guarding: AtomicBool::new(fresh),
            target: AtomicU64::new(NO_TARGET),
            started: Instant::now(),
            last_append_ms: AtomicU64::new(NO_APPEND),
        })
    }

    /// Whether vote requests are left unanswered.
    pub fn refuses_votes(&self) -> bool {
        self.guarding.load(Ordering::Acquire)
    }

    /// Takes the catch-up target from a leader's AppendEntries, if it is the first that can
    /// name one: its commit index is of the leader's own term.
    pub fn note_append(&self, rpc: &AppendEntriesRequest<TypeConfig>) {
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(NO_APPEND - 1);
        self.last_append_ms.store(now_ms, Ordering::Relaxed);
        if !self.refuses_votes() || self.target.load(Ordering::Acquire) != NO_TARGET {
            return;
        }
        if let Some(commit) = rpc.leader_commit {
            if commit.leader_id.term == rpc.vote.leader_id().term {
                let _ = self.target.compare_exchange(
                    NO_TARGET,
                    commit.index,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
    }

    /// Milliseconds since this node last received an AppendEntries (a heartbeat counts);
    /// `None` if it has not since it started.
    pub fn since_append_ms(&self) -> Option<u64> {
        let at = self.last_append_ms.load(Ordering::Relaxed);
        let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        (at != NO_APPEND).then(|| now_ms.saturating_sub(at))
    }

    /// Lifts the guard: this node votes and may stand for election again.
    pub fn lift(&self, raft: &Raft, why: &str) {
        if self.guarding.swap(false, Ordering::AcqRel) {
            // With pre-vote, openraft never elects on its own: the pre-vote timer, which
            // reads this guard, decides.
            if raft.config().enable_elect {
                raft.runtime_config().elect(true);
            }
            tracing::info!(why, "vote guard lifted");
        }
    }

    /// Whether `applied` (the last applied index) reaches the target a leader named.
    fn caught_up(&self, applied: Option<u64>) -> bool {
        let target = self.target.load(Ordering::Acquire);
        target != NO_TARGET && applied.is_some_and(|applied| applied >= target)
    }
}

/// Holds `raft` back from elections while the guard is up, and lifts the guard once this
/// node has applied up to the target (see the module docs). Ends when the guard is down.
pub async fn watch(raft: Raft, guard: Arc<CatchUp>) {
    if !guard.refuses_votes() {
        return;
    }
    raft.runtime_config().elect(false);
    tracing::info!("started on an empty data directory: no votes until caught up with a leader");
    let mut metrics = raft.metrics();
    loop {
        if !guard.refuses_votes() {
            return;
        }
        let applied = metrics.borrow_and_update().last_applied.map(|id| id.index);
        if guard.caught_up(applied) {
            guard.lift(&raft, "caught up with the leader's commit");
            return;
        }
        // Also woken by the target arriving: metrics change with every append.
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// The leader node `m` knows, as CLUSTER STATUS, `/readyz`, `tenure_cluster_leader_id` and
/// `NOT_LEADER` report it. openraft's follower keeps naming its last leader however long it
/// has not heard from it (with pre-vote a cut-off follower no longer stands for election,
/// which used to clear it): past the leader lease (`lease`) without an AppendEntries, it
/// knows no leader. Here, where the last AppendEntries is kept, so that every report of the
/// leader reads it alike (outside test a35, N1: `NOT_LEADER` named a leader STATUS did not).
pub fn known_leader(
    m: &RaftMetrics<NodeId, NodeInfo>,
    catch_up: &CatchUp,
    lease: std::time::Duration,
) -> Option<NodeId> {
    let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
    let follows = m.state != ServerState::Leader && m.current_leader != Some(m.id);
    let silent = catch_up.since_append_ms().is_none_or(|ms| ms > lease_ms);
    m.current_leader.filter(|_| !(follows && silent))
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, LogId, Vote};

    use super::*;

    fn append(term: u64, commit: Option<(u64, u64)>) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(term, 1),
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: commit.map(|(t, index)| LogId::new(CommittedLeaderId::new(t, 1), index)),
        }
    }

    #[test]
    fn the_target_is_a_commit_of_the_leaders_own_term_and_is_kept() {
        let guard = CatchUp::new(true);
        // A new leader whose commit index is still of an older term says nothing yet.
        guard.note_append(&append(5, Some((4, 90))));
        assert!(!guard.caught_up(Some(1_000)));
        guard.note_append(&append(5, Some((5, 120))));
        assert!(!guard.caught_up(Some(119)));
        assert!(guard.caught_up(Some(120)));
        // Later appends do not move it.
        guard.note_append(&append(5, Some((5, 500))));
        assert!(guard.caught_up(Some(120)));
        assert!(guard.refuses_votes(), "only the watch lifts it");
    }

    #[test]
    fn a_node_that_was_not_fresh_never_guards() {
        let guard = CatchUp::new(false);
        assert!(!guard.refuses_votes());
        guard.note_append(&append(5, Some((5, 120))));
        assert!(!guard.caught_up(Some(1_000)), "no target taken");
    }
}
