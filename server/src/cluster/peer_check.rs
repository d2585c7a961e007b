//! Checks on every peer frame, both ways, before openraft sees it.
//!
//! openraft trusts what its network hands it. Its engine computes `term + 1` when it stands
//! for election (an overflow at `u64::MAX`: in a debug build a panic, in a release build a
//! wrap to term 0 that the next `unwrap()` on the vote comparison turns into one), and a
//! good many of its invariants are `debug_assert!`s on the shape of what a leader sends
//! (entries consecutive from `prev_log_id`, log ids rising). A frame that breaks them
//! panicked a node, and a saved vote of term `u64::MAX` panicked it again after every
//! restart (issue 22). So a frame is refused, and its connection closed, unless:
//! - every term is at most [`TERM_MAX`] and every log index at most [`LOG_INDEX_MAX`]:
//!   far above any real cluster's (2^48 elections at one a millisecond take 8 900 years),
//!   far enough below `u64::MAX` that `term + 1` and `index + 1` never overflow;
//! - a request's term is at most [`TERM_STEP_MAX`] above this node's own current term
//!   (unless the node is fresh: no term, no log). Without it one frame of term `TERM_MAX`
//!   was accepted, and the next election's `TERM_MAX + 1` was refused by every node: no
//!   leader ever again, and nodes that refused to restart over their saved votes. With it,
//!   reaching `TERM_MAX` takes 2^32 accepted frames, each of which deposes a leader;
//! - a vote names a node (id at least 1) and a leader's vote (AppendEntries, snapshot) is
//!   committed; a candidate's last log id is not of a later term than its vote;
//! - an append carries at most [`APPEND_ENTRIES_MAX`] entries, numbered one after another
//!   from `prev_log_id`, of terms that never fall and never pass the leader's, and its commit
//!   index is not of a later term either;
//! - an entry's records decode as the WAL records a batch may carry, with fencing tokens at
//!   most [`TOKEN_MAX`] (the token allocator adds a block to the limit); a membership has 1 or
//!   2 configurations (joint consensus), each of 1 to `CLUSTER_MEMBERS_MAX` voters listed
//!   among its nodes, at most [`NODES_MAX`] nodes, ids from 1, addresses within the protocol's
//!   length limit;
//! - a snapshot chunk starts at offset 0, where the snapshot's chunks so far ended, or where
//!   the last one started ([`SnapshotProgress`]: the receiver seeks to the offset in a buffer
//!   in memory, so a far offset is a huge allocation), ends by [`SNAPSHOT_LEN_MAX`], and its
//!   records are an entry's (the last chunk ending between two);
//! - a candidate asking for a vote is in this node's membership when it has one ([`Known`]);
//!   a leader's append is taken from a node outside it only if it cannot overwrite this
//!   node's log (it starts at or past its last entry: a follower that missed the entry
//!   adding a new leader must still be able to catch up from it) or carries a membership
//!   naming the sender;
//! - an append's log ids at or below this node's last applied one are of no later term
//!   than it (openraft takes a previous log id below its commit index as matching);
//! - replies obey the same bounds on terms and log ids.
//!
//! What these checks cannot stop: a frame that is well formed and names a real member,
//! sent by someone else. Only authentication of the peer port does that; CLUSTER.md's
//! threat model says what remains.

use std::collections::BTreeSet;
use std::sync::Mutex;

use openraft::{EntryPayload, Membership, RaftMetrics, Vote};
use tenure_protocol::limits::{CLUSTER_ADDR_LEN_MAX, CLUSTER_MEMBERS_MAX};

use super::network::{PeerReply, PeerRequest};
use super::prevote::PreVoteRequest;
use super::{Entry, LogId, NodeId, NodeInfo};
use crate::log_limit::Sampled;
use crate::record::{self, Record};

/// Highest term a peer frame may carry (see the module docs for why this one).
pub const TERM_MAX: u64 = 1 << 48;
/// Most a request's term may exceed the receiving node's current term: elections raise the
/// term by one each, and with pre-vote only when a leader is gone, so a node that missed
/// 65 536 elections is far beyond any real outage (start it empty: a fresh node takes any
/// term up to [`TERM_MAX`]).
pub const TERM_STEP_MAX: u64 = 1 << 16;
/// Highest log index a peer frame may carry.
pub const LOG_INDEX_MAX: u64 = 1 << 48;
/// Most entries an append may carry: openraft sends at most the node's
/// `max_payload_entries` (8) at once.
pub const APPEND_ENTRIES_MAX: usize = 64;
/// Largest snapshot a node receives, in bytes: a Grant record per lease, far more leases
/// than `held_max` allows.
pub const SNAPSHOT_LEN_MAX: u64 = 1 << 36;
/// Longest snapshot id, in bytes (openraft's are a few dozen).
pub const SNAPSHOT_ID_LEN_MAX: usize = 256;
/// Highest fencing token or token limit a replicated record may carry: tokens start at 1
/// and rise by one a grant, and the allocator adds a block to the limit without overflow.
pub const TOKEN_MAX: u64 = 1 << 62;
/// Most nodes (voters and learners) a membership may list: the voters, and as many
/// learners being added.
pub const NODES_MAX: usize = 2 * CLUSTER_MEMBERS_MAX;
/// Most configurations a membership has: two while a joint-consensus change is under way.
const JOINT_CONFIGS_MAX: usize = 2;

const _: () = assert!(TERM_MAX < u64::MAX / 2 && LOG_INDEX_MAX < u64::MAX / 2);
const _: () = assert!(
    APPEND_ENTRIES_MAX >= 8,
    "the node's max_payload_entries must pass"
);

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn refuse<T>(why: String) -> Result<T, Refused> {
    Err(Refused(why))
}

/// What this node knows that a frame can be checked against, read from its Raft metrics.
#[derive(Debug, Clone, Default)]
pub struct Known {
    /// The nodes of its membership (voters and learners); empty before it has one.
    pub members: BTreeSet<NodeId>,
    /// Its last log index, `None` for an empty log.
    pub last_log_index: Option<u64>,
    /// The last log id it applied: committed, so every honest leader has it.
    pub last_applied: Option<LogId>,
    /// Its current term (0 before any vote).
    pub current_term: u64,
}

impl Known {
    /// What `metrics` say.
    pub fn from_metrics(metrics: &RaftMetrics<NodeId, NodeInfo>) -> Known {
        Known {
            members: metrics
                .membership_config
                .nodes()
                .map(|(id, _)| *id)
                .collect(),
            last_log_index: metrics.last_log_index,
            last_applied: metrics.last_applied,
            current_term: metrics.current_term,
        }
    }

    /// A term a request may carry: at most [`TERM_STEP_MAX`] above this node's, unless the
    /// node is fresh (a wiped node rejoining learns the cluster's term from its leader).
    fn check_step(&self, term: u64, what: &str) -> Result<(), Refused> {
        let fresh = self.current_term == 0 && self.last_log_index.is_none();
        let most = self.current_term.saturating_add(TERM_STEP_MAX);
        if !fresh && term > most {
            let now = self.current_term;
            return refuse(format!(
                "{what}: term {term} more than TERM_STEP_MAX ({TERM_STEP_MAX}) above this node's {now}"
            ));
        }
        Ok(())
    }
}

fn check_term(term: u64, what: &str) -> Result<(), Refused> {
    if term > TERM_MAX {
        return refuse(format!("{what}: term {term} over TERM_MAX ({TERM_MAX})"));
    }
    Ok(())
}

fn check_vote(vote: &Vote<NodeId>, what: &str) -> Result<(), Refused> {
    check_term(vote.leader_id().term, what)
}

/// A vote a node sends of itself: bounded, and naming a node.
fn check_sender_vote(vote: &Vote<NodeId>, what: &str) -> Result<NodeId, Refused> {
    check_vote(vote, what)?;
    let id = vote.leader_id().node_id;
    if id == 0 {
        return refuse(format!("{what}: node id 0"));
    }
    Ok(id)
}

fn check_log_id(id: Option<&LogId>, what: &str) -> Result<(), Refused> {
    let Some(id) = id else { return Ok(()) };
    check_term(id.leader_id.term, what)?;
    if id.index > LOG_INDEX_MAX {
        let index = id.index;
        return refuse(format!(
            "{what}: index {index} over LOG_INDEX_MAX ({LOG_INDEX_MAX})"
        ));
    }
    Ok(())
}

fn term_of(id: Option<&LogId>) -> u64 {
    id.map_or(0, |id| id.leader_id.term)
}

/// Checks a request from a peer; returns the node it says it comes from (the candidate or
/// the leader), `None` for the requests that name none.
///
/// # Errors
/// [`Refused`], saying what is out of bounds.
pub fn check_request(request: &PeerRequest, known: &Known) -> Result<Option<NodeId>, Refused> {
    match request {
        PeerRequest::Vote(rpc) => {
            let sender = check_sender_vote(&rpc.vote, "vote request")?;
            known.check_step(rpc.vote.leader_id().term, "vote request")?;
            check_log_id(rpc.last_log_id.as_ref(), "vote request's last log id")?;
            if term_of(rpc.last_log_id.as_ref()) > rpc.vote.leader_id().term {
                return refuse("vote request: last log id of a later term than the vote".into());
            }
            if !known.members.is_empty() && !known.members.contains(&sender) {
                return refuse(format!("vote request from node {sender}, not a member"));
            }
            Ok(Some(sender))
        }
        PeerRequest::Append(rpc) => {
            let sender = check_leader_vote(&rpc.vote, "append")?;
            let term = rpc.vote.leader_id().term;
            known.check_step(term, "append")?;
            check_log_id(rpc.leader_commit.as_ref(), "append's commit index")?;
            if term_of(rpc.leader_commit.as_ref()) > term {
                return refuse("append: commit index of a later term than the leader's".into());
            }
            check_entries(rpc.prev_log_id.as_ref(), &rpc.entries, term)?;
            check_append_sender(sender, rpc.prev_log_id.as_ref(), &rpc.entries, known)?;
            check_against_applied(rpc.prev_log_id.as_ref(), &rpc.entries, known)?;
            Ok(Some(sender))
        }
        PeerRequest::Snapshot(rpc) => {
            let sender = check_leader_vote(&rpc.vote, "snapshot")?;
            known.check_step(rpc.vote.leader_id().term, "snapshot")?;
            let meta = &rpc.meta;
            check_log_id(meta.last_log_id.as_ref(), "snapshot's last log id")?;
            check_log_id(
                meta.last_membership.log_id().as_ref(),
                "snapshot's membership",
            )?;
            check_membership(meta.last_membership.membership())?;
            if meta.snapshot_id.len() > SNAPSHOT_ID_LEN_MAX {
                return refuse(format!("snapshot id over {SNAPSHOT_ID_LEN_MAX} bytes"));
            }
            let end = rpc.offset.checked_add(rpc.data.len() as u64);
            if end.is_none_or(|end| end > SNAPSHOT_LEN_MAX) {
                return refuse(format!("snapshot chunk ends past {SNAPSHOT_LEN_MAX} bytes"));
            }
            Ok(Some(sender))
        }
        PeerRequest::Initialize(members) => {
            check_nodes(members.iter())?;
            if members.is_empty() {
                return refuse("initialisation with no members".into());
            }
            Ok(None)
        }
        PeerRequest::Probe | PeerRequest::Bootstrap => Ok(None),
        PeerRequest::PreVote(rpc) => check_pre_vote(rpc, known).map(Some),
    }
}

/// A pre-vote request, bounded as a vote request is: its candidate names a node of this
/// node's membership, its term and last log id are within bounds, the log id of no later
/// term than the one it would stand in.
fn check_pre_vote(rpc: &PreVoteRequest, known: &Known) -> Result<NodeId, Refused> {
    let sender = rpc.candidate;
    if sender == 0 {
        return refuse("pre-vote request: node id 0".into());
    }
    check_term(rpc.term, "pre-vote request")?;
    known.check_step(rpc.term, "pre-vote request")?;
    check_log_id(rpc.last_log_id.as_ref(), "pre-vote request's last log id")?;
    if term_of(rpc.last_log_id.as_ref()) > rpc.term {
        return refuse("pre-vote request: last log id of a later term than asked for".into());
    }
    if !known.members.is_empty() && !known.members.contains(&sender) {
        return refuse(format!("pre-vote request from node {sender}, not a member"));
    }
    Ok(sender)
}

fn check_leader_vote(vote: &Vote<NodeId>, what: &str) -> Result<NodeId, Refused> {
    let sender = check_sender_vote(vote, what)?;
    if !vote.is_committed() {
        return refuse(format!("{what}: the leader's vote is not committed"));
    }
    Ok(sender)
}

/// The entries of an append: bounded in count, numbered from `prev`, terms rising to at
/// most the leader's, payloads valid.
fn check_entries(prev: Option<&LogId>, entries: &[Entry], term: u64) -> Result<(), Refused> {
    check_log_id(prev, "append's previous log id")?;
    if entries.len() > APPEND_ENTRIES_MAX {
        let count = entries.len();
        return refuse(format!(
            "append of {count} entries, limit {APPEND_ENTRIES_MAX}"
        ));
    }
    let mut index = prev.map_or(0, |prev| prev.index + 1);
    let mut floor = term_of(prev);
    for entry in entries {
        check_log_id(Some(&entry.log_id), "entry")?;
        let (entry_index, entry_term) = (entry.log_id.index, entry.log_id.leader_id.term);
        if entry_index != index {
            return refuse(format!(
                "append: entry {entry_index} where {index} comes next"
            ));
        }
        if entry_term < floor || entry_term > term {
            return refuse(format!(
                "append: entry {entry_index} of term {entry_term}, not within {floor}..={term}"
            ));
        }
        check_payload(&entry.payload)?;
        (index, floor) = (index + 1, entry_term);
    }
    if term_of(prev) > term {
        return refuse("append: previous log id of a later term than the leader's".into());
    }
    Ok(())
}

fn check_payload(payload: &EntryPayload<super::TypeConfig>) -> Result<(), Refused> {
    match payload {
        EntryPayload::Blank => Ok(()),
        EntryPayload::Normal(batch) => check_records(&batch.records),
        EntryPayload::Membership(membership) => check_membership(membership),
    }
}

/// A batch's bytes: WAL records a batch may carry (never a snapshot marker), with tokens at
/// most [`TOKEN_MAX`].
pub fn check_records(bytes: &[u8]) -> Result<(), Refused> {
    if bytes.len() > super::log_store::ENTRY_LEN_MAX {
        return refuse("entry over ENTRY_LEN_MAX".into());
    }
    let mut at = 0;
    while at < bytes.len() {
        let (record, len) = record::decode(&bytes[at..])
            .map_err(|e| Refused(format!("entry's records at byte {at}: {e}")))?;
        check_record(&record, "entry's", at as u64)?;
        at += len;
    }
    Ok(())
}

/// One record of an entry or a snapshot (`what`, the record at byte `at` of it): one the
/// replicated state applies (never a snapshot marker, which it refuses, stopping the Raft
/// core), with a fencing token or token limit of at most [`TOKEN_MAX`].
fn check_record(record: &Record<'_>, what: &str, at: u64) -> Result<(), Refused> {
    let token = match *record {
        Record::Reserve { token_limit } => token_limit,
        Record::Grant { token, .. } | Record::Free { token, .. } => token,
        Record::Renew { token, .. } => token,
        Record::SessionOpen { .. } | Record::SessionEnd { .. } => 0,
        Record::SnapshotBegin { .. } | Record::SnapshotEnd { .. } => {
            return refuse(format!("{what} records at byte {at}: a snapshot marker"));
        }
    };
    if token > TOKEN_MAX {
        return refuse(format!("{what} records: token {token} over TOKEN_MAX"));
    }
    Ok(())
}

fn check_membership(membership: &Membership<NodeId, NodeInfo>) -> Result<(), Refused> {
    let configs = membership.get_joint_config();
    if configs.is_empty() || configs.len() > JOINT_CONFIGS_MAX {
        let count = configs.len();
        return refuse(format!("membership of {count} configurations"));
    }
    check_nodes(membership.nodes())?;
    for voters in configs {
        if voters.is_empty() || voters.len() > CLUSTER_MEMBERS_MAX {
            let count = voters.len();
            return refuse(format!("membership configuration of {count} voters"));
        }
        if let Some(id) = voters.iter().find(|id| membership.get_node(id).is_none()) {
            return refuse(format!("membership: voter {id} is not among its nodes"));
        }
    }
    Ok(())
}

fn check_nodes<'a>(nodes: impl Iterator<Item = (&'a NodeId, &'a NodeInfo)>) -> Result<(), Refused> {
    for (count, (id, info)) in nodes.enumerate() {
        if count >= NODES_MAX {
            return refuse(format!("membership of over {NODES_MAX} nodes"));
        }
        if *id == 0 {
            return refuse("membership: node id 0".into());
        }
        for addr in [&info.peer_addr, &info.client_addr] {
            if addr.is_empty() || addr.len() > CLUSTER_ADDR_LEN_MAX {
                return refuse(format!(
                    "membership: node {id}'s address is not 1 to {CLUSTER_ADDR_LEN_MAX} bytes"
                ));
            }
        }
    }
    Ok(())
}

/// An append's log ids at or below this node's last applied one: an honest leader has the
/// same entries there, so none of a later term. openraft takes a previous log id below its
/// commit index as matching (asserting so in a debug build only) and would append after it.
fn check_against_applied(
    prev: Option<&LogId>,
    entries: &[Entry],
    known: &Known,
) -> Result<(), Refused> {
    let Some(applied) = known.last_applied else {
        return Ok(());
    };
    let ids = prev.into_iter().chain(entries.iter().map(|e| &e.log_id));
    for id in ids.take_while(|id| id.index <= applied.index) {
        if id.leader_id.term > applied.leader_id.term {
            return refuse(format!(
                "append: log id {id} below this node's applied {applied} is of a later term"
            ));
        }
    }
    Ok(())
}

/// An append from a node outside this node's membership: see the module docs.
fn check_append_sender(
    sender: NodeId,
    prev: Option<&LogId>,
    entries: &[Entry],
    known: &Known,
) -> Result<(), Refused> {
    if known.members.is_empty() || known.members.contains(&sender) {
        return Ok(());
    }
    let at_or_past_end = match (prev, known.last_log_index) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(prev), Some(last)) => prev.index >= last,
    };
    let names_sender = entries.iter().any(|entry| match &entry.payload {
        EntryPayload::Membership(m) => m.get_node(&sender).is_some(),
        _ => false,
    });
    if at_or_past_end || names_sender {
        return Ok(());
    }
    refuse(format!(
        "append from node {sender}, not a member, over this node's log"
    ))
}

/// Checks a peer's reply before openraft sees it.
///
/// # Errors
/// [`Refused`], saying what is out of bounds.
pub fn check_reply(reply: &PeerReply, sent_term: Option<u64>) -> Result<(), Refused> {
    use openraft::raft::AppendEntriesResponse as A;
    if let (Some(sent), Some(term)) = (sent_term, reply_term(reply)) {
        // A node far ahead (back from a long isolation, or lying) must not depose a leader
        // into a term its other followers refuse: the reply is as good as none.
        if term > sent.saturating_add(TERM_STEP_MAX) {
            return refuse(format!(
                "reply of term {term}: more than TERM_STEP_MAX ({TERM_STEP_MAX}) above the request's {sent}"
            ));
        }
    }
    match reply {
        PeerReply::Vote(Ok(vote)) => {
            check_vote(&vote.vote, "vote reply")?;
            check_log_id(vote.last_log_id.as_ref(), "vote reply's last log id")
        }
        PeerReply::Append(Ok(A::HigherVote(vote))) => check_vote(vote, "append reply"),
        PeerReply::Append(Ok(A::PartialSuccess(id))) => check_log_id(id.as_ref(), "append reply"),
        PeerReply::Snapshot(Ok(reply)) => check_vote(&reply.vote, "snapshot reply"),
        // The term names where the next request starts: bounded, so that `+ 1` holds.
        PeerReply::PreVote(reply) => check_term(reply.term, "pre-vote reply"),
        _ => Ok(()),
    }
}

/// The term of the vote a request carries, if it carries one.
pub fn request_term(request: &PeerRequest) -> Option<u64> {
    match request {
        PeerRequest::Vote(rpc) => Some(rpc.vote.leader_id().term),
        PeerRequest::Append(rpc) => Some(rpc.vote.leader_id().term),
        PeerRequest::Snapshot(rpc) => Some(rpc.vote.leader_id().term),
        PeerRequest::PreVote(rpc) => Some(rpc.term),
        PeerRequest::Initialize(_) | PeerRequest::Probe | PeerRequest::Bootstrap => None,
    }
}

fn reply_term(reply: &PeerReply) -> Option<u64> {
    use openraft::raft::AppendEntriesResponse as A;
    match reply {
        PeerReply::Vote(Ok(vote)) => Some(vote.vote.leader_id().term),
        PeerReply::Append(Ok(A::HigherVote(vote))) => Some(vote.leader_id().term),
        PeerReply::Snapshot(Ok(reply)) => Some(reply.vote.leader_id().term),
        PeerReply::PreVote(reply) => Some(reply.term),
        _ => None,
    }
}

/// The snapshot being received, shared by every peer connection of a node: where its chunks
/// end so far, and its records, checked as they arrive as an entry's are ([`check_record`]).
///
/// A chunk starts at 0 (a new or restarted transfer), where the chunks so far end (the next
/// one), or where the last one started (it again, after a lost reply): openraft's sender
/// sends nothing else. Its records are checked before openraft sees the chunk, so a snapshot
/// openraft installs has nothing its state machine refuses: a refusal there is a storage
/// error, which stops the Raft core, and a token limit past [`TOKEN_MAX`] would overflow the
/// next leader's reservation (review 9, finding 2).
#[derive(Debug, Default)]
pub struct SnapshotProgress {
    received: Mutex<Received>,
}

/// What [`SnapshotProgress`] knows of the snapshot being received.
#[derive(Debug, Default)]
struct Received {
    /// Its id.
    id: String,
    /// Where its chunks so far end.
    end: u64,
    /// Where the last chunk started.
    last_start: u64,
    /// The start of a record the chunks so far end inside (shorter than `RECORD_LEN_MAX`).
    partial: Vec<u8>,
    /// `partial` as it was before the last chunk, for that chunk sent again.
    partial_before_last: Vec<u8>,
}

impl SnapshotProgress {
    /// Checks a chunk (its place, and the records in it) and, if it is taken, records where
    /// it ends. `done`: the chunk is the snapshot's last.
    ///
    /// # Errors
    /// [`Refused`] for a chunk that would leave a gap or overlap other than a chunk sent
    /// again, for a record an entry could not carry, or for a last chunk that ends inside a
    /// record. Nothing is recorded then.
    pub fn admit(
        &self,
        snapshot_id: &str,
        offset: u64,
        data: &[u8],
        done: bool,
    ) -> Result<(), Refused> {
        let mut received = self.received.lock().expect("snapshot progress poisoned");
        let r = &mut *received;
        let before = if offset == 0 {
            Vec::new()
        } else if r.id != snapshot_id {
            return refuse(format!(
                "snapshot {snapshot_id} chunk at offset {offset}: no chunk of it came first"
            ));
        } else if offset == r.end {
            r.partial.clone()
        } else if offset == r.last_start {
            r.partial_before_last.clone()
        } else {
            return refuse(format!(
                "snapshot {snapshot_id} chunk at offset {offset}: its chunks so far end at {}, \
                 the last one started at {}",
                r.end, r.last_start
            ));
        };
        let partial = check_snapshot_chunk(&before, data, offset, done)?;
        if offset == 0 {
            r.id = snapshot_id.to_string();
        }
        r.last_start = offset;
        r.end = offset.saturating_add(data.len() as u64);
        r.partial_before_last = before;
        r.partial = partial;
        Ok(())
    }
}

/// Checks the records of a snapshot chunk at `offset` whose chunks before it ended inside a
/// record that began with `partial`; returns the start of the record the chunk ends inside
/// (empty if it ends between records), which a last chunk (`done`) may not.
fn check_snapshot_chunk(
    partial: &[u8],
    data: &[u8],
    offset: u64,
    done: bool,
) -> Result<Vec<u8>, Refused> {
    let mut at = 0;
    if !partial.is_empty() {
        // The record the last chunk ended inside: its start, then as much of this chunk as
        // a record can be long.
        let take = data.len().min(record::RECORD_LEN_MAX);
        let straddling = [partial, &data[..take]].concat();
        let start = offset - partial.len() as u64;
        match record::decode(&straddling) {
            Ok((record, len)) => {
                check_record(&record, "snapshot's", start)?;
                at = len - partial.len();
            }
            Err(record::DecodeError::Incomplete { .. }) if take == data.len() && !done => {
                return Ok(straddling);
            }
            Err(e) => return refuse(format!("snapshot's records at byte {start}: {e}")),
        }
    }
    while at < data.len() {
        let place = offset + at as u64;
        match record::decode(&data[at..]) {
            Ok((record, len)) => {
                check_record(&record, "snapshot's", place)?;
                at += len;
            }
            Err(record::DecodeError::Incomplete { .. }) if !done => return Ok(data[at..].to_vec()),
            Err(e) => return refuse(format!("snapshot's records at byte {place}: {e}")),
        }
    }
    Ok(Vec::new())
}

/// Shortest time between two log lines about refused peer frames: a removed node left
/// running, or a flood, would otherwise write one per frame.
pub const REFUSAL_LOG_PERIOD_MS: u64 = 10_000;

/// Rate-limits the log lines about refused frames: the first goes out, then at most one a
/// [`REFUSAL_LOG_PERIOD_MS`], saying how many were not logged since.
#[derive(Debug, Default)]
pub struct RefusalLog(Sampled);

impl RefusalLog {
    /// Logs `why` (from `peer`) unless a line went out less than the period ago.
    pub fn refused(&self, now_ms: u64, peer: &str, why: &Refused) {
        if let Some(unlogged) = self.0.admit(now_ms, REFUSAL_LOG_PERIOD_MS) {
            tracing::warn!(
                peer,
                unlogged,
                "peer frame refused, connection closed: {why}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};
    use openraft::{CommittedLeaderId, SnapshotMeta, StoredMembership};
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::cluster::Batch;
    use crate::wal::record::FreeReason;

    /// Iterations of the mutation loop: about a second in a debug build.
    const MUTATIONS: usize = 100_000;

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    fn info(id: u64) -> NodeInfo {
        NodeInfo {
            peer_addr: format!("127.0.0.1:{}", 7000 + id),
            client_addr: format!("127.0.0.1:{}", 7800 + id),
        }
    }

    fn membership(ids: &[u64]) -> Membership<NodeId, NodeInfo> {
        let nodes: BTreeMap<_, _> = ids.iter().map(|id| (*id, info(*id))).collect();
        Membership::new(vec![ids.iter().copied().collect()], nodes)
    }

    fn records() -> Vec<u8> {
        let mut bytes = Vec::new();
        let grant = Record::Grant {
            key: b"k",
            lease_id: [7; 16],
            token: 41,
            ttl_ms: 30_000,
            flags: 0,
            meta: b"m",
            acquire_id: None,
            session_id: None,
            kind: Default::default(),
        };
        let free = Record::Free {
            key: b"k",
            token: 41,
            reason: FreeReason::Released,
        };
        for record in [Record::Reserve { token_limit: 1000 }, grant, free] {
            record::encode(&record, &mut bytes);
        }
        bytes
    }

    fn entry(term: u64, index: u64, payload: EntryPayload<crate::cluster::TypeConfig>) -> Entry {
        Entry {
            log_id: log_id(term, index),
            payload,
        }
    }

    fn append(term: u64, prev: Option<LogId>, entries: Vec<Entry>) -> PeerRequest {
        PeerRequest::Append(AppendEntriesRequest {
            vote: Vote::new_committed(term, 1),
            prev_log_id: prev,
            entries,
            leader_commit: Some(log_id(term, 3)),
        })
    }

    /// One valid frame of each kind, from node 1 to a member of {1, 2, 3}.
    fn valid_requests() -> Vec<PeerRequest> {
        let entries = vec![
            entry(5, 11, EntryPayload::Blank),
            entry(5, 12, EntryPayload::Normal(Batch { records: records() })),
            entry(6, 13, EntryPayload::Membership(membership(&[1, 2, 3]))),
        ];
        let meta = SnapshotMeta {
            last_log_id: Some(log_id(5, 90)),
            last_membership: StoredMembership::new(Some(log_id(1, 1)), membership(&[1, 2, 3])),
            snapshot_id: "5-90-1".to_string(),
        };
        let members: BTreeMap<_, _> = [1, 2, 3].iter().map(|id| (*id, info(*id))).collect();
        vec![
            PeerRequest::Vote(VoteRequest::new(Vote::new(7, 1), Some(log_id(6, 13)))),
            append(6, Some(log_id(5, 10)), entries),
            append(6, Some(log_id(6, 13)), Vec::new()),
            PeerRequest::Snapshot(InstallSnapshotRequest {
                vote: Vote::new_committed(6, 1),
                meta,
                offset: 0,
                data: records(),
                done: true,
            }),
            PeerRequest::Initialize(members),
            PeerRequest::Probe,
            PeerRequest::Bootstrap,
            PeerRequest::PreVote(PreVoteRequest {
                candidate: 2,
                term: 8,
                last_log_id: Some(log_id(6, 13)),
            }),
        ]
    }

    fn known() -> Known {
        Known {
            members: [1, 2, 3].into_iter().collect(),
            last_log_index: Some(20),
            last_applied: Some(log_id(6, 8)),
            current_term: 6,
        }
    }

    /// What a frame that passed the checks must hold, checked independently of them: every
    /// term and index it carries within the bounds.
    fn assert_in_bounds(request: &PeerRequest) {
        let ids: Vec<(u64, u64)> = match request {
            PeerRequest::Vote(rpc) => {
                let last = rpc
                    .last_log_id
                    .iter()
                    .map(|id| (id.leader_id.term, id.index));
                last.chain([(rpc.vote.leader_id().term, 0)]).collect()
            }
            PeerRequest::Append(rpc) => {
                let ids = rpc.prev_log_id.iter().chain(rpc.leader_commit.iter());
                let ids = ids.chain(rpc.entries.iter().map(|e| &e.log_id));
                let ids = ids.map(|id| (id.leader_id.term, id.index));
                assert!(rpc.entries.len() <= APPEND_ENTRIES_MAX);
                ids.chain([(rpc.vote.leader_id().term, 0)]).collect()
            }
            PeerRequest::Snapshot(rpc) => {
                assert!(rpc.offset + rpc.data.len() as u64 <= SNAPSHOT_LEN_MAX);
                let last = rpc
                    .meta
                    .last_log_id
                    .iter()
                    .map(|id| (id.leader_id.term, id.index));
                last.chain([(rpc.vote.leader_id().term, 0)]).collect()
            }
            PeerRequest::PreVote(rpc) => {
                assert!(rpc.candidate != 0, "{request:?}");
                let last = rpc
                    .last_log_id
                    .iter()
                    .map(|id| (id.leader_id.term, id.index));
                last.chain([(rpc.term, 0)]).collect()
            }
            _ => Vec::new(),
        };
        for (term, index) in ids {
            assert!(term <= TERM_MAX && index <= LOG_INDEX_MAX, "{request:?}");
        }
    }

    fn mutate(rng: &mut impl Rng, frame: &mut Vec<u8>) {
        match rng.random_range(0..5) {
            0 => {
                let at = rng.random_range(0..frame.len());
                frame[at] ^= 1 << rng.random_range(0..8);
            }
            1 => frame.truncate(rng.random_range(0..frame.len())),
            2 => {
                // A varint of u64::MAX or a large one where some field was.
                let at = rng.random_range(0..frame.len());
                let big: &[u8] = if rng.random() {
                    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
                } else {
                    &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]
                };
                let end = (at + rng.random_range(1..4)).min(frame.len());
                frame.splice(at..end, big.iter().copied());
            }
            3 => {
                let at = rng.random_range(0..=frame.len());
                frame.insert(at, rng.random());
            }
            _ => {
                for byte in frame.iter_mut() {
                    if rng.random_range(0..16) == 0 {
                        *byte = rng.random();
                    }
                }
            }
        }
    }

    #[test]
    fn valid_frames_pass() {
        for request in valid_requests() {
            let checked = check_request(&request, &known());
            assert!(checked.is_ok(), "{request:?}: {checked:?}");
            assert_in_bounds(&request);
        }
    }

    /// Mutated and random frames: decoding never panics, and what decodes and passes the
    /// checks is within every bound. Prints the seed on failure (set `PEER_FUZZ_SEED`).
    #[test]
    fn mutated_and_random_frames_never_panic_and_out_of_bounds_ones_are_refused() {
        let seed = std::env::var("PEER_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(22);
        let frames: Vec<Vec<u8>> = valid_requests()
            .iter()
            .map(|r| postcard::to_stdvec(r).unwrap())
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (mut decoded, mut passed) = (0, 0);
        for round in 0..MUTATIONS {
            let mut frame = if rng.random_range(0..10) == 0 {
                (0..rng.random_range(0..64)).map(|_| rng.random()).collect()
            } else {
                frames[rng.random_range(0..frames.len())].clone()
            };
            for _ in 0..rng.random_range(1..4) {
                if !frame.is_empty() {
                    mutate(&mut rng, &mut frame);
                }
            }
            let outcome = std::panic::catch_unwind(|| {
                let _ = postcard::from_bytes::<PeerReply>(&frame).map(|r| check_reply(&r, Some(7)));
                let request = postcard::from_bytes::<PeerRequest>(&frame).ok()?;
                let ok = check_request(&request, &known()).is_ok();
                if ok {
                    assert_in_bounds(&request);
                }
                Some(ok)
            });
            match outcome {
                Ok(Some(ok)) => (decoded, passed) = (decoded + 1, passed + usize::from(ok)),
                Ok(None) => {}
                Err(_) => panic!("seed {seed}, round {round}: panicked on {frame:?}"),
            }
        }
        // The loop must exercise the checks, not only the decoder.
        assert!(decoded > MUTATIONS / 20, "seed {seed}: {decoded} decoded");
        assert!(
            passed > 0 && passed < decoded,
            "seed {seed}: {passed} of {decoded}"
        );
    }

    /// Terms over TERM_MAX, up to `u64::MAX`, in requests and replies.
    #[test]
    fn terms_over_term_max_are_refused() {
        let over = [TERM_MAX + 1, u64::MAX - 1, u64::MAX];
        for term in over {
            let vote = PeerRequest::Vote(VoteRequest::new(Vote::new(term, 1), None));
            assert!(check_request(&vote, &known()).is_err(), "vote term {term}");
            let heartbeat = PeerRequest::Append(AppendEntriesRequest {
                vote: Vote::new_committed(term, 1),
                prev_log_id: None,
                entries: Vec::new(),
                leader_commit: None,
            });
            assert!(
                check_request(&heartbeat, &known()).is_err(),
                "append term {term}"
            );
            let reply = PeerReply::Append(Ok(openraft::raft::AppendEntriesResponse::HigherVote(
                Vote::new_committed(term, 2),
            )));
            assert!(check_reply(&reply, None).is_err(), "reply term {term}");
            let pre_vote = PeerRequest::PreVote(PreVoteRequest {
                candidate: 2,
                term,
                last_log_id: None,
            });
            assert!(
                check_request(&pre_vote, &known()).is_err(),
                "pre-vote {term}"
            );
            let reply = PeerReply::PreVote(crate::cluster::prevote::PreVoteReply {
                granted: false,
                term,
            });
            assert!(
                check_reply(&reply, None).is_err(),
                "pre-vote reply term {term}"
            );
        }
    }

    /// A pre-vote from node 0, from a stranger, or with a log of a later term than asked.
    #[test]
    fn pre_votes_out_of_range_are_refused() {
        let ask = |candidate, term, last: Option<LogId>| {
            PeerRequest::PreVote(PreVoteRequest {
                candidate,
                term,
                last_log_id: last,
            })
        };
        for bad in [
            ask(0, 8, None),
            ask(9, 8, None),
            ask(2, 8, Some(log_id(9, 13))),
            ask(2, 8, Some(log_id(6, LOG_INDEX_MAX + 1))),
        ] {
            assert!(check_request(&bad, &known()).is_err(), "{bad:?}");
        }
        let from = check_request(&ask(3, 8, Some(log_id(8, 2))), &known());
        assert_eq!(from, Ok(Some(3)), "the candidate is the sender");
    }

    /// A term far above this node's (a forged frame of the last term) is refused, one just
    /// within the step is taken, and a fresh node takes any term up to TERM_MAX.
    #[test]
    fn terms_far_above_the_nodes_own_are_refused_unless_it_is_fresh() {
        let vote = |term| PeerRequest::Vote(VoteRequest::new(Vote::new(term, 1), None));
        let heartbeat = |term| {
            PeerRequest::Append(AppendEntriesRequest {
                vote: Vote::new_committed(term, 1),
                prev_log_id: Some(log_id(6, 20)),
                entries: Vec::new(),
                leader_commit: None,
            })
        };
        let known = known();
        for request in [
            vote(TERM_MAX),
            heartbeat(TERM_MAX),
            heartbeat(6 + TERM_STEP_MAX + 1),
        ] {
            assert!(check_request(&request, &known).is_err(), "{request:?}");
        }
        let higher = |term| {
            PeerReply::Append(Ok(openraft::raft::AppendEntriesResponse::HigherVote(
                Vote::new_committed(term, 2),
            )))
        };
        assert!(check_reply(&higher(6 + TERM_STEP_MAX + 1), Some(6)).is_err());
        assert_eq!(check_reply(&higher(6 + TERM_STEP_MAX), Some(6)), Ok(()));
        for request in [vote(6 + TERM_STEP_MAX), heartbeat(6 + TERM_STEP_MAX)] {
            assert_eq!(check_request(&request, &known), Ok(Some(1)), "{request:?}");
        }
        let fresh = Known {
            last_log_index: None,
            last_applied: None,
            current_term: 0,
            ..known
        };
        let rejoin = PeerRequest::Append(AppendEntriesRequest {
            vote: Vote::new_committed(TERM_MAX, 1),
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: None,
        });
        assert_eq!(check_request(&rejoin, &fresh), Ok(Some(1)));
    }

    /// Each bound on an append, a vote and a snapshot, one field at a time.
    #[test]
    fn entries_senders_and_chunks_out_of_range_are_refused() {
        let refused = [
            // An index past LOG_INDEX_MAX.
            append(6, Some(log_id(5, LOG_INDEX_MAX + 1)), Vec::new()),
            // Entries not following prev_log_id, or not consecutive.
            append(
                6,
                Some(log_id(5, 10)),
                vec![entry(5, 12, EntryPayload::Blank)],
            ),
            append(
                6,
                Some(log_id(5, 10)),
                vec![
                    entry(5, 11, EntryPayload::Blank),
                    entry(5, 11, EntryPayload::Blank),
                ],
            ),
            // An entry of a later term than the leader's, or terms falling.
            append(
                6,
                Some(log_id(5, 10)),
                vec![entry(7, 11, EntryPayload::Blank)],
            ),
            append(
                6,
                Some(log_id(5, 10)),
                vec![entry(4, 11, EntryPayload::Blank)],
            ),
            // Too many entries.
            append(
                6,
                Some(log_id(6, 10)),
                (11..12 + APPEND_ENTRIES_MAX as u64)
                    .map(|i| entry(6, i, EntryPayload::Blank))
                    .collect(),
            ),
            // Records that do not decode, a token past TOKEN_MAX.
            append(
                6,
                Some(log_id(6, 10)),
                vec![entry(
                    6,
                    11,
                    EntryPayload::Normal(Batch {
                        records: vec![9; 40],
                    }),
                )],
            ),
            append(
                6,
                Some(log_id(6, 10)),
                vec![entry(6, 11, reserve(TOKEN_MAX + 1))],
            ),
            // A membership of node 0, of a voter that is not a node, of too many nodes.
            append(6, Some(log_id(6, 10)), vec![entry(6, 11, members(&[0, 1]))]),
            append(
                6,
                Some(log_id(6, 10)),
                vec![entry(6, 11, voter_without_node())],
            ),
            append(
                6,
                Some(log_id(6, 10)),
                vec![entry(
                    6,
                    11,
                    members(&(1..=NODES_MAX as u64 + 1).collect::<Vec<_>>()),
                )],
            ),
            // Node 0, and a vote from outside the membership.
            PeerRequest::Vote(VoteRequest::new(Vote::new(7, 0), None)),
            PeerRequest::Vote(VoteRequest::new(Vote::new(7, 99), None)),
            // A leader's vote that is not committed.
            PeerRequest::Append(AppendEntriesRequest {
                vote: Vote::new(6, 1),
                prev_log_id: None,
                entries: Vec::new(),
                leader_commit: None,
            }),
        ];
        for request in refused {
            assert!(check_request(&request, &known()).is_err(), "{request:?}");
        }
        let mut snapshot = valid_requests().swap_remove(3);
        if let PeerRequest::Snapshot(rpc) = &mut snapshot {
            rpc.offset = u64::MAX - 2;
        }
        assert!(check_request(&snapshot, &known()).is_err());
    }

    fn reserve(token_limit: u64) -> EntryPayload<crate::cluster::TypeConfig> {
        let mut records = Vec::new();
        record::encode(&Record::Reserve { token_limit }, &mut records);
        EntryPayload::Normal(Batch { records })
    }

    fn members(ids: &[u64]) -> EntryPayload<crate::cluster::TypeConfig> {
        EntryPayload::Membership(membership(ids))
    }

    fn voter_without_node() -> EntryPayload<crate::cluster::TypeConfig> {
        /// Membership's serde shape: `Membership::new` would add the missing node, a
        /// forged frame need not.
        #[derive(serde::Serialize)]
        struct Forged {
            configs: Vec<BTreeSet<NodeId>>,
            nodes: BTreeMap<NodeId, NodeInfo>,
        }
        let forged = Forged {
            configs: vec![[2].into()],
            nodes: [(1, info(1))].into_iter().collect(),
        };
        let bytes = postcard::to_stdvec(&forged).unwrap();
        EntryPayload::Membership(postcard::from_bytes(&bytes).unwrap())
    }

    /// A node outside the membership: its votes are refused, and its appends unless they
    /// can only extend this node's log (a follower that missed the entry adding a new
    /// leader catches up from it) or name it in a membership they carry.
    #[test]
    fn a_sender_outside_the_membership_is_refused_where_it_could_overwrite() {
        let from_99 = |prev: u64, entries| {
            let mut request = append(6, Some(log_id(5, prev)), entries);
            if let PeerRequest::Append(rpc) = &mut request {
                rpc.vote = Vote::new_committed(6, 99);
            }
            request
        };
        let known = known();
        assert!(check_request(&from_99(10, Vec::new()), &known).is_err());
        assert!(check_request(&from_99(20, Vec::new()), &known).is_ok());
        let naming = vec![entry(6, 11, members(&[1, 2, 99]))];
        assert!(check_request(&from_99(10, naming), &known).is_ok());
        assert!(check_request(&from_99(10, Vec::new()), &Known::default()).is_ok());
    }

    /// Below the applied index an honest leader's log is this node's: a later term there is
    /// forged (openraft would take it as matching).
    #[test]
    fn log_ids_at_or_below_the_applied_one_are_of_no_later_term() {
        let known = known(); // applied: term 6, index 8
        assert!(check_request(&append(7, Some(log_id(6, 8)), Vec::new()), &known).is_ok());
        assert!(check_request(&append(7, Some(log_id(7, 8)), Vec::new()), &known).is_err());
        assert!(check_request(&append(7, Some(log_id(7, 3)), Vec::new()), &known).is_err());
        let past = vec![entry(7, 9, EntryPayload::Blank)];
        assert!(check_request(&append(7, Some(log_id(6, 8)), past), &known).is_ok());
        let forged = vec![entry(7, 8, EntryPayload::Blank)];
        assert!(check_request(&append(7, Some(log_id(6, 7)), forged), &known).is_err());
    }

    /// Snapshot records: a Reserve of `token_limit`, then `sessions` SessionOpens.
    fn snapshot_bytes(token_limit: u64, sessions: u8) -> Vec<u8> {
        let mut out = Vec::new();
        record::encode(&Record::Reserve { token_limit }, &mut out);
        for n in 0..sessions {
            let open = Record::SessionOpen {
                session_id: (u128::from(n) + 1).to_be_bytes(),
                ttl_ms: 10_000,
                owner: b"alice",
            };
            record::encode(&open, &mut out);
        }
        out
    }

    #[test]
    fn a_snapshot_chunk_may_not_leave_a_gap() {
        let bytes = snapshot_bytes(100, 8);
        let progress = SnapshotProgress::default();
        assert!(
            progress.admit("a", 1, &bytes[1..11], false).is_err(),
            "no chunk yet"
        );
        progress.admit("a", 0, &bytes[..10], false).unwrap();
        progress.admit("a", 10, &bytes[10..20], false).unwrap();
        progress.admit("a", 10, &bytes[10..20], false).unwrap();
        assert!(
            progress.admit("a", 21, &bytes[21..31], false).is_err(),
            "a gap"
        );
        assert!(
            progress.admit("a", 5, &bytes[5..15], false).is_err(),
            "an overlap"
        );
        assert!(
            progress.admit("b", 20, &bytes[20..30], false).is_err(),
            "another snapshot"
        );
        progress.admit("b", 0, &bytes[..5], false).unwrap();
        assert!(
            progress.admit("a", 10, &bytes[10..20], false).is_err(),
            "a was replaced by b"
        );
    }

    #[test]
    fn a_snapshot_is_taken_in_chunks_of_any_size_resent_or_not() {
        let bytes = snapshot_bytes(100, 20);
        for size in [1, 2, 8, 9, 10, 31, 64, bytes.len()] {
            let progress = SnapshotProgress::default();
            let chunks: Vec<_> = bytes.chunks(size).collect();
            let mut offset = 0;
            for (n, chunk) in chunks.iter().enumerate() {
                let done = n + 1 == chunks.len();
                progress.admit("s", offset, chunk, done).unwrap();
                // Every chunk sent again, as after a lost reply: taken again.
                progress.admit("s", offset, chunk, done).unwrap();
                offset += chunk.len() as u64;
            }
        }
    }

    #[test]
    fn a_snapshot_with_a_record_no_entry_may_carry_is_refused_wherever_it_is_cut() {
        let over = snapshot_bytes(TOKEN_MAX + 1, 3);
        let mut marked = snapshot_bytes(100, 3);
        record::encode(&Record::SnapshotBegin { segment_seq: 7 }, &mut marked);
        let mut torn = snapshot_bytes(100, 3);
        torn.pop();
        let mut flipped = snapshot_bytes(100, 3);
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        for (what, bytes) in [
            ("over", over),
            ("marked", marked),
            ("torn", torn),
            ("flipped", flipped),
        ] {
            for size in [1, 7, 9, 13, bytes.len()] {
                let progress = SnapshotProgress::default();
                let chunks: Vec<_> = bytes.chunks(size).collect();
                let mut offset = 0;
                let refused = chunks.iter().enumerate().any(|(n, chunk)| {
                    let taken = progress.admit("s", offset, chunk, n + 1 == chunks.len());
                    offset += chunk.len() as u64;
                    taken.is_err()
                });
                assert!(refused, "{what} in chunks of {size} was taken");
            }
        }
    }

    #[test]
    fn refusals_are_logged_at_most_once_a_period() {
        let log = RefusalLog::default();
        let why = Refused("x".into());
        log.refused(1_000, "p", &why);
        log.refused(1_001, "p", &why);
        log.refused(2_000, "p", &why);
        // The next line is due a period after the first, and says two were left out.
        let at = 1_000 + REFUSAL_LOG_PERIOD_MS;
        assert_eq!(log.0.admit(at - 1, REFUSAL_LOG_PERIOD_MS), None);
        assert_eq!(log.0.admit(at, REFUSAL_LOG_PERIOD_MS), Some(3));
    }
}
