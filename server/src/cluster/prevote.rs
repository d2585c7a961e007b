//! Pre-vote: a node asks whether it could win before openraft raises its term.
//!
//! openraft 0.9 has no pre-vote. A follower cut off from its peers stood for election at
//! every timeout, raising its term each time; when it came back, the leader's next append
//! to it was answered with that higher vote, and the leader stepped down although nobody
//! would elect the returning node (issue 24). A follower starved of CPU did the same.
//!
//! So automatic elections are off (`Config::enable_elect = false`) and this module decides
//! *when* openraft starts one:
//! - [`run`] keeps openraft's own election timer: a voter that has not heard from a leader
//!   of its current term for openraft's leader lease (`election_timeout_max`, kept only while
//!   its vote is committed) plus a timeout drawn from `[min, max)` asks every other voter,
//!   over the peer port, "would you vote for me at term T+1, my last log id being L?"
//!   ([`PreVoteRequest`]). Nothing is saved, no term moves.
//! - A voter grants ([`decide`]) unless it heard from a leader within the lease (its vote is
//!   committed and was refreshed by an append that recently), or it is the leader and a
//!   quorum acknowledged it within the lease, or L is behind its own last log id (term, then
//!   index), or T+1 is not above its own term. A node whose vote guard is up
//!   ([`super::catch_up`]) does not answer at all.
//! - Unreachable voters and late answers count as refusals. With a quorum of grants, itself
//!   included, in every configuration of the membership (joint consensus has two), the node
//!   calls `raft.trigger().elect()`; otherwise it waits another timeout.
//!
//! Why this is safe: the election itself, the vote, the terms and the log comparison stay
//! openraft's (`handle_vote_req` answers the real vote as before). This code only holds back
//! the start of elections, so a bug here can delay or prevent an election, never make two
//! leaders. A leader still steps down only through openraft.
//!
//! The term in a request is one above the highest term the candidate knows: its own, or a
//! higher one a refusal named. A voter whose term is ahead (it voted in an election that
//! nobody won) would otherwise refuse every round of a candidate whose log it needs; when
//! such a candidate is granted by a quorum, openraft's election at its own term + 1 is
//! refused with the higher vote, which openraft adopts, and the next round goes above it.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::{Membership, ServerState};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::catch_up::CatchUp;
use super::log_store::LogStore;
use super::network::PeerNetwork;
use super::{LogId, NodeId, NodeInfo, Raft};

/// "Would you vote for me?": sent by a voter whose election timer fired, before it asks
/// openraft to start an election.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreVoteRequest {
    /// The node that would stand.
    pub candidate: NodeId,
    /// The term it would stand in: one above the highest it knows.
    pub term: u64,
    /// Its last log id (`None`: an empty log).
    pub last_log_id: Option<LogId>,
}

/// The answer to a [`PreVoteRequest`]; it changes nothing on the voter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreVoteReply {
    /// Whether the voter would grant its vote now.
    pub granted: bool,
    /// The voter's current term, from which a refused candidate asks next time.
    pub term: u64,
}

/// Why a pre-vote was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// This node heard from a leader within the lease.
    Lease,
    /// This node leads, and a quorum acknowledged it within the lease.
    Leading,
    /// The candidate's last log id is behind this node's.
    Log,
    /// The candidate's term is not above this node's.
    Term,
}

/// What a voter knows when it answers a pre-vote: its view, read from openraft.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Local {
    /// Its current term.
    pub term: u64,
    /// How long ago a leader's append refreshed its committed vote; `None` when its vote is
    /// not committed (it knows no leader of its term) or was never refreshed.
    pub since_leader: Option<Duration>,
    /// When it leads: how long ago a quorum last acknowledged it (`None`: never).
    pub leading_ack: Option<Option<Duration>>,
    /// Its last log id.
    pub last_log_id: Option<LogId>,
}

/// The pre-vote rule (see the module docs); `lease` is openraft's leader lease, the
/// largest election timeout, which its real vote applies too.
///
/// # Errors
/// The first reason to refuse, in the order of the module docs.
pub fn decide(request: &PreVoteRequest, local: &Local, lease: Duration) -> Result<(), Refusal> {
    if local.since_leader.is_some_and(|since| since < lease) {
        return Err(Refusal::Lease);
    }
    if let Some(ack) = local.leading_ack {
        if ack.is_some_and(|since| since < lease) {
            return Err(Refusal::Leading);
        }
    }
    // Option<LogId> orders None first, then by term, then by index: openraft's comparison.
    if request.last_log_id < local.last_log_id {
        return Err(Refusal::Log);
    }
    if request.term <= local.term {
        return Err(Refusal::Term);
    }
    Ok(())
}

/// Whether `granted` (voters that said yes, this node included) make a quorum in every
/// configuration of `membership`: a majority of each.
pub fn is_quorum(membership: &Membership<NodeId, NodeInfo>, granted: &BTreeSet<NodeId>) -> bool {
    membership.get_joint_config().iter().all(|voters| {
        let yes = voters.iter().filter(|id| granted.contains(id)).count();
        yes * 2 > voters.len()
    })
}

/// A node's election timing, from its settings, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Least election timeout.
    pub timeout_min_ms: u64,
    /// Largest election timeout: also openraft's leader lease.
    pub timeout_max_ms: u64,
}

impl Timing {
    /// openraft's leader lease: a voter that heard a leader this recently refuses votes.
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.timeout_max_ms)
    }

    /// A timeout drawn from `[min, max)`, afresh for every round.
    fn draw(&self) -> Duration {
        let ms = if self.timeout_max_ms > self.timeout_min_ms {
            rand::rng().random_range(self.timeout_min_ms..self.timeout_max_ms)
        } else {
            self.timeout_min_ms
        };
        Duration::from_millis(ms)
    }

    /// How long a round waits for the answers: the least timeout, as openraft gives a vote.
    fn round_max(&self) -> Duration {
        Duration::from_millis(self.timeout_min_ms)
    }
}

/// One node's pre-vote state: what it answers with, and what it counts.
pub struct PreVote {
    me: NodeId,
    timing: Timing,
    /// The Raft log (shared with openraft's store): its last log id, which openraft 0.9
    /// does not make public in `RaftState`.
    log: LogStore,
    /// Pre-votes this node refused.
    pub refused: AtomicU64,
    /// Pre-vote rounds this node ran.
    pub rounds: AtomicU64,
    /// Rounds that reached a quorum, after which this node asked openraft to elect.
    pub granted_rounds: AtomicU64,
    /// The highest term a refusal named: the next request asks for one above it.
    highest_seen: AtomicU64,
}

impl PreVote {
    /// Pre-vote state of node `me`, over its log `log`.
    pub fn new(me: NodeId, timing: Timing, log: LogStore) -> Arc<PreVote> {
        Arc::new(PreVote {
            me,
            timing,
            log,
            refused: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            granted_rounds: AtomicU64::new(0),
            highest_seen: AtomicU64::new(0),
        })
    }

    /// openraft's leader lease on this node (the largest election timeout).
    pub fn lease(&self) -> Duration {
        self.timing.lease()
    }

    /// The last log id, read off the async threads: the store's lock is held during an
    /// append's fsync.
    async fn last_log_id(&self) -> Option<LogId> {
        let log = self.log.clone();
        tokio::task::spawn_blocking(move || log.state().last_log_id)
            .await
            .ok()
            .flatten()
    }

    /// What this node knows, read from `raft`; `None` once its core has stopped.
    async fn local(&self, raft: &Raft) -> Option<Local> {
        let (term, since_leader) = raft
            .with_raft_state(|st| {
                let vote = st.vote_ref();
                let since = st.vote_last_modified().map(|at| at.elapsed());
                (vote.leader_id().term, since.filter(|_| vote.is_committed()))
            })
            .await
            .ok()?;
        let leading_ack = {
            let m = raft.metrics().borrow().clone();
            (m.state == ServerState::Leader)
                .then(|| m.millis_since_quorum_ack.map(Duration::from_millis))
        };
        Some(Local {
            term,
            since_leader,
            leading_ack,
            last_log_id: self.last_log_id().await,
        })
    }

    /// Answers a pre-vote; a node whose core stopped refuses.
    pub async fn answer(&self, raft: &Raft, request: &PreVoteRequest) -> PreVoteReply {
        let Some(local) = self.local(raft).await else {
            return PreVoteReply {
                granted: false,
                term: 0,
            };
        };
        let decided = decide(request, &local, self.timing.lease());
        if let Err(why) = decided {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(candidate = request.candidate, ?why, "pre-vote refused");
        }
        PreVoteReply {
            granted: decided.is_ok(),
            term: local.term,
        }
    }
}

/// What the election timer reads each time it looks.
struct Timer {
    /// Whether this node may stand: a voter, not the leader, its vote guard down.
    may_stand: bool,
    /// Whether it is the only voter: no lease to wait for, nobody to ask (openraft elects a
    /// sole voter at once too).
    sole: bool,
    /// How long ago it last heard from a leader of its term, or voted (openraft's vote
    /// time), and whether the lease applies (its vote is committed).
    since_vote: Option<Duration>,
    committed: bool,
}

async fn read_timer(raft: &Raft, me: NodeId, catch_up: &CatchUp) -> Option<Timer> {
    let (since_vote, committed) = raft
        .with_raft_state(|st| {
            let since = st.vote_last_modified().map(|at| at.elapsed());
            (since, st.vote_ref().is_committed())
        })
        .await
        .ok()?;
    let m = raft.metrics().borrow().clone();
    let voter = m.membership_config.voter_ids().any(|id| id == me);
    let sole = voter && m.membership_config.voter_ids().count() == 1;
    let may_stand = voter && m.state != ServerState::Leader && !catch_up.refuses_votes();
    Some(Timer {
        may_stand,
        sole,
        since_vote,
        committed,
    })
}

/// Runs this node's election timer and pre-vote rounds until `stop` or its Raft core
/// stops (see the module docs).
pub async fn run(
    raft: Raft,
    prevote: Arc<PreVote>,
    network: PeerNetwork,
    catch_up: Arc<CatchUp>,
    stop: CancellationToken,
) {
    let started = tokio::time::Instant::now();
    // The end of the last round: a refused node waits a whole timeout before the next.
    let mut last_round = started;
    loop {
        let timeout = prevote.timing.draw();
        loop {
            let Some(timer) = read_timer(&raft, prevote.me, &catch_up).await else {
                return;
            };
            let lease = if timer.committed {
                prevote.timing.lease()
            } else {
                Duration::ZERO
            };
            let since_vote = timer.since_vote.unwrap_or_else(|| started.elapsed());
            let wait_vote = (lease + timeout).saturating_sub(since_vote);
            let wait_round = timeout.saturating_sub(last_round.elapsed());
            // A sole voter still waits a timeout between rounds: its election takes a
            // moment, and a second one would only raise the term again.
            let wait = if timer.sole {
                wait_round
            } else {
                wait_vote.max(wait_round)
            };
            if timer.may_stand && wait.is_zero() {
                break;
            }
            // Not standing (leader, learner, guard up): look again a timeout later.
            let wait = if timer.may_stand { wait } else { timeout };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // A vote that moved during the round (a leader elected meanwhile, a vote granted)
        // makes its grants stale: standing now would only depose whoever won.
        let vote = raft.metrics().borrow().vote;
        let won = round(&raft, &prevote, &network).await;
        let unmoved = raft.metrics().borrow().vote == vote;
        if won && unmoved && raft.trigger().elect().await.is_err() {
            return;
        }
        last_round = tokio::time::Instant::now();
    }
}

/// One pre-vote round; whether a quorum granted.
async fn round(raft: &Raft, prevote: &PreVote, network: &PeerNetwork) -> bool {
    prevote.rounds.fetch_add(1, Ordering::Relaxed);
    let (term, membership) = {
        let m = raft.metrics().borrow().clone();
        (m.current_term, m.membership_config.membership().clone())
    };
    let highest = prevote.highest_seen.load(Ordering::Relaxed).max(term);
    let request = PreVoteRequest {
        candidate: prevote.me,
        term: highest + 1,
        last_log_id: prevote.last_log_id().await,
    };
    let mut granted: BTreeSet<NodeId> = [prevote.me].into_iter().collect();
    let mut asks = JoinSet::new();
    for id in membership.voter_ids().filter(|id| *id != prevote.me) {
        let Some(info) = membership.get_node(&id).cloned() else {
            continue;
        };
        let (mut network, request) = (network.clone(), request.clone());
        let ttl = prevote.timing.round_max();
        asks.spawn(async move {
            let reply = network.ask_pre_vote(id, &info, request, ttl).await;
            (id, reply)
        });
    }
    let deadline = tokio::time::Instant::now() + prevote.timing.round_max();
    while !is_quorum(&membership, &granted) {
        let Ok(Some(joined)) = tokio::time::timeout_at(deadline, asks.join_next()).await else {
            break;
        };
        match joined {
            Ok((id, Ok(reply))) if reply.granted => drop(granted.insert(id)),
            Ok((_, Ok(reply))) => drop(
                prevote
                    .highest_seen
                    .fetch_max(reply.term, Ordering::Relaxed),
            ),
            Ok((id, Err(why))) => tracing::debug!(peer = id, %why, "no pre-vote answer"),
            Err(_) => {}
        }
    }
    asks.abort_all();
    let won = is_quorum(&membership, &granted);
    if won {
        prevote.granted_rounds.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            term = request.term,
            ?granted,
            "pre-vote granted: standing for election"
        );
    } else {
        tracing::debug!(term = request.term, ?granted, "pre-vote refused");
    }
    won
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use openraft::CommittedLeaderId;

    use super::*;

    const LEASE: Duration = Duration::from_millis(300);

    fn log_id(term: u64, index: u64) -> Option<LogId> {
        Some(LogId::new(CommittedLeaderId::new(term, 1), index))
    }

    fn ask(term: u64, last: Option<LogId>) -> PreVoteRequest {
        PreVoteRequest {
            candidate: 2,
            term,
            last_log_id: last,
        }
    }

    /// A follower that has not heard its leader for the lease, with log (5, 10) at term 5.
    fn follower() -> Local {
        Local {
            term: 5,
            since_leader: Some(LEASE * 2),
            leading_ack: None,
            last_log_id: log_id(5, 10),
        }
    }

    #[test]
    fn a_pre_vote_is_granted_only_past_the_lease_to_a_log_as_long_in_a_later_term() {
        assert_eq!(decide(&ask(6, log_id(5, 10)), &follower(), LEASE), Ok(()));
        assert_eq!(decide(&ask(6, log_id(6, 3)), &follower(), LEASE), Ok(()));
        let no_leader = Local {
            since_leader: None,
            ..follower()
        };
        assert_eq!(decide(&ask(6, log_id(5, 11)), &no_leader, LEASE), Ok(()));

        let fed = Local {
            since_leader: Some(LEASE / 2),
            ..follower()
        };
        assert_eq!(
            decide(&ask(6, log_id(5, 10)), &fed, LEASE),
            Err(Refusal::Lease)
        );
        let leading = Local {
            since_leader: None,
            leading_ack: Some(Some(LEASE / 3)),
            ..follower()
        };
        assert_eq!(
            decide(&ask(6, log_id(5, 10)), &leading, LEASE),
            Err(Refusal::Leading)
        );
        // A leader whose quorum acks lapsed no longer holds anyone back.
        let lapsed = Local {
            leading_ack: Some(Some(LEASE * 2)),
            ..leading.clone()
        };
        assert_eq!(decide(&ask(6, log_id(5, 10)), &lapsed, LEASE), Ok(()));
        for behind in [None, log_id(5, 9), log_id(4, 20)] {
            assert_eq!(
                decide(&ask(6, behind), &follower(), LEASE),
                Err(Refusal::Log),
                "{behind:?}"
            );
        }
        for term in [4, 5] {
            assert_eq!(
                decide(&ask(term, log_id(5, 10)), &follower(), LEASE),
                Err(Refusal::Term)
            );
        }
    }

    fn membership(configs: Vec<Vec<NodeId>>) -> Membership<NodeId, NodeInfo> {
        let configs: Vec<BTreeSet<NodeId>> = configs
            .into_iter()
            .map(|c| c.into_iter().collect())
            .collect();
        let nodes: BTreeMap<NodeId, NodeInfo> = configs
            .iter()
            .flatten()
            .map(|id| (*id, NodeInfo::default()))
            .collect();
        Membership::new(configs, nodes)
    }

    #[test]
    fn a_quorum_is_a_majority_of_every_configuration() {
        let three = membership(vec![vec![1, 2, 3]]);
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<_>>();
        assert!(!is_quorum(&three, &set(&[1])));
        assert!(is_quorum(&three, &set(&[1, 3])));
        assert!(
            !is_quorum(&three, &set(&[1, 4, 5])),
            "non-voters do not count"
        );
        let four = membership(vec![vec![1, 2, 3, 4]]);
        assert!(!is_quorum(&four, &set(&[1, 2])), "half is not a majority");
        // Joint consensus: {1,2,3} to {3,4,5} needs a majority of both.
        let joint = membership(vec![vec![1, 2, 3], vec![3, 4, 5]]);
        assert!(!is_quorum(&joint, &set(&[1, 2])));
        assert!(!is_quorum(&joint, &set(&[4, 5])));
        assert!(is_quorum(&joint, &set(&[1, 3, 4])));
    }

    #[test]
    fn timeouts_are_drawn_from_min_to_max() {
        let timing = Timing {
            timeout_min_ms: 150,
            timeout_max_ms: 300,
        };
        let drawn: BTreeSet<u128> = (0..200).map(|_| timing.draw().as_millis()).collect();
        assert!(drawn.iter().all(|ms| (150..300).contains(ms)), "{drawn:?}");
        assert!(drawn.len() > 10, "not random: {drawn:?}");
        assert_eq!(timing.lease(), Duration::from_millis(300));
    }
}
