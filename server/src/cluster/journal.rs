//! The journals of a cluster node: [`RaftJournal`] on the leader, [`FollowerJournal`]
//! everywhere else.
//!
//! # Group commit through Raft
//! `append` encodes the change as its WAL record into a queue and returns the next ticket;
//! `confirm` (a read: RENEW, CHECK, INSPECT) takes a ticket without a record. A batcher task
//! takes everything queued at once: records become one Raft entry (`client_write`), and a
//! batch of reads alone becomes one `ensure_linearizable` round, started after every read in
//! it was received. A batch that carries records needs no separate round for its reads: its
//! commit in this leader's term, after they were received, is the quorum's confirmation.
//! A round that finds no quorum in time is tried again for a while ([`CONFIRM_PATIENCE`]).
//! A few batches are in flight together (the batcher takes a slot, one of [`IN_FLIGHT_MAX`],
//! before it takes a batch, so changes gather in the queue while the slots are busy: group
//! commit), and a completer task waits for them in order, moving `Progress::lsn` to each batch's last ticket when it is applied (or
//! confirmed). So the order and "failure is final" rules of the [`Journal`] contract hold:
//! the first batch that fails (leadership lost, the Raft core stopped) fails the journal
//! with [`NOT_LEADER`], and nothing after it is ever reported durable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use openraft::error::{CheckIsLeaderError, RaftError};
use openraft::RaftMetrics;
use tokio::sync::{mpsc, watch, Notify};

use super::catch_up::{known_leader, CatchUp};
use super::network::PeerService;
use super::{Batch, NodeId, NodeInfo, Raft};
use crate::journal::{
    Change, Journal, JournalError, JournalStats, LeaseSource, Progress, Ticket, NOT_LEADER,
};
use crate::obs::metrics::Histogram;
use crate::wal::{record, WalError};

/// Most encoded record bytes waiting for the batcher; past it, appends are refused
/// (`UNAVAILABLE`, backlog) rather than growing memory, and one Raft entry never holds more.
pub const QUEUE_BYTES_MAX: usize = 4 << 20;
/// Batches proposed (or confirmation rounds started) that may wait for the completer, which
/// waits on one more: two in flight in all. Few, so that changes gather into large batches
/// meanwhile: every batch costs an fsync on each node, and on a small machine those fsyncs
/// and the nodes' wake-ups, not the network, bound the cluster. One measured faster than two
/// (BENCHMARKS.md, "a 3-node cluster beside a 3-node etcd"), and four slower still.
pub const IN_FLIGHT_MAX: usize = 1;
/// Longest a leader keeps trying to confirm its leadership for a batch of reads before it
/// gives up (its journal fails; the reads are answered `NOT_LEADER`).
pub const CONFIRM_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);
/// Pause between two confirmation rounds of one batch.
const CONFIRM_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);
/// Longest a batch of changes may wait to be committed before the journal fails as if the
/// leadership were lost: a leader cut off from its followers would otherwise leave every
/// write unanswered for as long as openraft keeps it leader (it never steps down on its own
/// for want of a quorum). Its waiting replies are then answered NOT_LEADER (outcome unknown)
/// and, if openraft still says it leads, a new executor takes over once a barrier commits.
pub const COMMIT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
/// How often a leader's journal looks at how long ago a quorum last acknowledged it
/// (check-quorum, [`check_quorum`]).
pub const QUORUM_CHECK_PERIOD: std::time::Duration = std::time::Duration::from_millis(25);

/// Names the leader for `NOT_LEADER` replies: the leader this node knows
/// ([`known_leader`]), as CLUSTER STATUS names it.
#[derive(Clone)]
pub struct LeaderHint {
    raft: Raft,
    me: NodeId,
    /// When this node last heard an AppendEntries.
    catch_up: Arc<CatchUp>,
    /// openraft's leader lease: a follower silent this long names no leader.
    lease: std::time::Duration,
}

impl LeaderHint {
    /// A hint for the node of `raft` that `service` serves.
    pub fn new(raft: Raft, service: &PeerService) -> LeaderHint {
        LeaderHint {
            raft,
            me: service.me,
            catch_up: Arc::clone(&service.catch_up),
            lease: service.prevote.lease(),
        }
    }

    /// `leader=<client address>` or `leader=unknown`. `self_ok`: whether this node may be
    /// named (not by a leader that just lost its place and may not know the next one yet).
    pub fn message(&self, self_ok: bool) -> Arc<str> {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        let cut_off = self.cut_off(&metrics);
        let leader = known_leader(&metrics, &self.catch_up, self.lease)
            .filter(|&id| (self_ok && !cut_off) || id != self.me)
            .and_then(|id| metrics.membership_config.membership().get_node(&id));
        let membership = metrics.membership_config.membership();
        match leader {
            Some(node) => format!("leader={}", node.client_addr).into(),
            // Named, it would send a client that knows only this address back here for as
            // long as the partition lasts (outside test a64, F4).
            None if cut_off => format!(
                "this node was elected for term {} but has heard from no quorum for over {} \
                 ms, so it does not serve (cut off from the other members?); leader=unknown",
                metrics.current_term,
                self.lease.as_millis()
            )
            .into(),
            // Removed (or never added), it will never know the leader: say so, as a client
            // searching only this address would otherwise wait out an election that is not.
            None if membership.get_node(&self.me).is_none() => {
                "this node is not in the cluster's membership (removed, or not yet added); \
                 leader=unknown"
                    .into()
            }
            None => "leader=unknown".into(),
        }
    }

    /// Whether openraft still says this node leads while no quorum has acknowledged it for
    /// a leader lease: check-quorum failed its journal, and a new leader may be serving.
    fn cut_off(&self, m: &RaftMetrics<NodeId, NodeInfo>) -> bool {
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        m.state == openraft::ServerState::Leader
            && m.millis_since_quorum_ack.is_some_and(|ms| ms > lease_ms)
    }
}

/// What waits for the batcher.
#[derive(Default)]
struct Queue {
    records: Vec<u8>,
    record_count: u64,
    /// The last ticket handed out.
    last_ticket: Ticket,
    /// Tickets handed out since the last batch was taken.
    waiting: bool,
    failed: bool,
}

/// A batch handed to Raft, to be waited for in order.
type InFlight = (Ticket, BoxFuture<'static, Result<(), String>>);

/// The leader's journal; see the module docs.
pub struct RaftJournal {
    queue: Mutex<Queue>,
    wake: Notify,
    progress_tx: watch::Sender<Progress>,
    hint: LeaderHint,
    records: AtomicU64,
    entries: AtomicU64,
    bytes: AtomicU64,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Held by the batcher while it checks for failure and proposes, so that once
    /// [`RaftJournal::fence`] returns no proposal of this journal can still reach Raft.
    proposing: tokio::sync::Mutex<()>,
    /// Each committed batch's time from proposal to commit (the node's, across leaders).
    commit: Arc<Histogram>,
}

impl RaftJournal {
    /// A journal proposing to `raft`, with its batcher and completer tasks running; each
    /// batch's time to commit goes to `commit`.
    pub fn start(raft: Raft, hint: LeaderHint, commit: Arc<Histogram>) -> Arc<RaftJournal> {
        let (progress_tx, _) = watch::channel(Progress::default());
        let journal = Arc::new(RaftJournal {
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            progress_tx,
            hint,
            records: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
            proposing: tokio::sync::Mutex::new(()),
            commit,
        });
        let (tx, rx) = mpsc::channel(IN_FLIGHT_MAX);
        let raft_for_check = raft.clone();
        // The tasks hold the journal; `fail` (called when leadership ends) aborts them, which
        // breaks the cycle.
        let batcher = tokio::spawn(batch_loop(Arc::clone(&journal), raft, tx));
        let completer = tokio::spawn(complete_loop(Arc::clone(&journal), rx));
        let checker = tokio::spawn(check_quorum(Arc::clone(&journal), raft_for_check));
        journal
            .tasks
            .lock()
            .expect("poisoned")
            .extend([batcher, completer, checker]);
        journal
    }

    /// Fails the journal for good with [`NOT_LEADER`]: leadership ended. Replies still
    /// waiting are answered `NOT_LEADER`; the journal's tasks end.
    pub fn fail(&self) {
        self.queue.lock().expect("poisoned").failed = true;
        self.progress_tx.send_if_modified(|p| {
            let first = p.failed.is_none();
            if first {
                p.failed = Some(NOT_LEADER.into());
            }
            first
        });
        for task in self.tasks.lock().expect("poisoned").drain(..) {
            task.abort();
        }
    }

    /// Fails the journal and waits until no proposal of it can reach Raft any more: every
    /// entry it will ever propose is then in the log, before anything proposed after this.
    pub async fn fence(&self) {
        self.fail();
        drop(self.proposing.lock().await);
    }

    fn refused(&self) -> JournalError {
        JournalError::NotLeader(self.hint.message(false))
    }

    /// Queues `record` (`None` for a read, which only takes a ticket) and returns its ticket.
    fn enqueue(&self, record: Option<&record::Record<'_>>) -> Result<Ticket, JournalError> {
        let mut queue = self.queue.lock().expect("poisoned");
        if queue.failed {
            return Err(self.refused());
        }
        if let Some(record) = record {
            let len = record.encoded_len();
            if queue.records.len() + len > QUEUE_BYTES_MAX {
                let pending_bytes = queue.records.len();
                return Err(WalError::Backlog { pending_bytes }.into());
            }
            record::encode(record, &mut queue.records);
            queue.record_count += 1;
        }
        queue.last_ticket += 1;
        queue.waiting = true;
        let ticket = queue.last_ticket;
        drop(queue);
        self.wake.notify_one();
        Ok(ticket)
    }

    /// Takes everything queued: `(records, record count, last ticket)`, `None` if nothing
    /// waits or the journal failed.
    fn take(&self) -> Option<(Vec<u8>, u64, Ticket)> {
        let mut queue = self.queue.lock().expect("poisoned");
        if queue.failed || !queue.waiting {
            return None;
        }
        queue.waiting = false;
        let count = std::mem::take(&mut queue.record_count);
        Some((std::mem::take(&mut queue.records), count, queue.last_ticket))
    }
}

/// Takes batches as they queue up and hands them to Raft, in order.
async fn batch_loop(journal: Arc<RaftJournal>, raft: Raft, tx: mpsc::Sender<InFlight>) {
    loop {
        journal.wake.notified().await;
        loop {
            // A slot first, then the batch: while earlier batches hold the slots, the queue
            // grows, and the next batch takes all of it. That is the group commit: a
            // proposal per change would cost an fsync per change on every node.
            let Ok(slot) = tx.reserve().await else {
                return;
            };
            let Some((records, count, ticket)) = journal.take() else {
                break;
            };
            let in_flight: BoxFuture<'static, Result<(), String>> = if records.is_empty() {
                // Spawned now, so the round starts after every read in the batch arrived.
                let round = tokio::spawn(confirm(raft.clone()));
                Box::pin(async move { round.await.unwrap_or_else(|e| Err(e.to_string())) })
            } else {
                journal.records.fetch_add(count, Ordering::Relaxed);
                journal.entries.fetch_add(1, Ordering::Relaxed);
                journal
                    .bytes
                    .fetch_add(records.len() as u64, Ordering::Relaxed);
                let gate = journal.proposing.lock().await;
                if journal.queue.lock().expect("poisoned").failed {
                    return;
                }
                let proposed_at = tokio::time::Instant::now();
                let give_up = proposed_at + COMMIT_PATIENCE;
                let proposed = raft.client_write_ff(Batch { records }).await;
                drop(gate);
                let commit = Arc::clone(&journal.commit);
                match proposed {
                    Ok(rx) => Box::pin(async move {
                        match tokio::time::timeout_at(give_up, rx).await {
                            Ok(Ok(Ok(_))) => {
                                commit.observe_duration(proposed_at.elapsed());
                                Ok(())
                            }
                            Ok(Ok(Err(e))) => Err(e.to_string()),
                            Ok(Err(_)) => Err("the Raft core dropped the write".to_string()),
                            Err(_) => Err(format!(
                                "no quorum committed a batch within {COMMIT_PATIENCE:?}"
                            )),
                        }
                    }),
                    Err(e) => Box::pin(std::future::ready(Err(e.to_string()))),
                }
            };
            slot.send((ticket, in_flight));
        }
    }
}

/// Confirms with a quorum that this node still leads. A round that finds no quorum in
/// time (openraft gives it one heartbeat interval) is tried again, for up to
/// [`CONFIRM_PATIENCE`]: a busy moment must not end a leadership; every later round also
/// starts after the reads it answers arrived.
async fn confirm(raft: Raft) -> Result<(), String> {
    let started = tokio::time::Instant::now();
    loop {
        match raft.ensure_linearizable().await {
            Ok(_) => return Ok(()),
            Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e)))
                if started.elapsed() < CONFIRM_PATIENCE =>
            {
                tracing::debug!(error = %e, "no quorum for a confirmation round; trying again");
                tokio::time::sleep(CONFIRM_RETRY_PAUSE).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Check-quorum: fails the journal once no quorum has acknowledged this leader for the
/// leader lease (openraft's largest election timeout, 2 E: the followers' lease, before
/// which no rival can be elected) and [`CONFIRM_PATIENCE`] on top, the patience a read's
/// confirmation round gets: a busy moment must not end a leadership (on this 2-core machine
/// under the sizing estimate, a quorum's acknowledgement came 350 ms late with the lease
/// alone, and every client of the leader saw its requests refused). Nothing it would serve
/// could be served anyway (a grant waits for its commit, a read for a confirmation round,
/// both needing that quorum); what it bounds is the wait: the requests queued here are
/// answered `NOT_LEADER` after about 1.3 s at default timing instead of
/// [`COMMIT_PATIENCE`], so clients look for the new leader while it is elected. openraft's
/// figure is refreshed on each pass of its core (at least every tick); a core blocked on
/// I/O reports an older, smaller one, so a stalled leader is failed later, never sooner.
/// (CLUSTER.md, "Check-quorum".)
async fn check_quorum(journal: Arc<RaftJournal>, raft: Raft) {
    let lease_ms = raft.config().election_timeout_max;
    let patience_ms = u64::try_from(CONFIRM_PATIENCE.as_millis()).unwrap_or(u64::MAX);
    let silence_max_ms = lease_ms.saturating_add(patience_ms);
    let metrics = raft.metrics();
    loop {
        tokio::time::sleep(QUORUM_CHECK_PERIOD).await;
        let silent_ms = {
            let m = metrics.borrow();
            let leads = m.state == openraft::ServerState::Leader;
            m.millis_since_quorum_ack.filter(|_| leads)
        };
        if let Some(silent_ms) = silent_ms.filter(|&ms| ms > silence_max_ms) {
            tracing::warn!(
                silent_ms,
                silence_max_ms,
                "check-quorum: no quorum acknowledged this leader within the lease and a \
                 confirmation's patience; \
                 its journal fails and its requests are answered NOT_LEADER"
            );
            journal.fail();
            return;
        }
    }
}

/// Waits for the batches in order and moves the journal's progress past each.
async fn complete_loop(journal: Arc<RaftJournal>, mut rx: mpsc::Receiver<InFlight>) {
    while let Some((ticket, in_flight)) = rx.recv().await {
        if let Err(e) = in_flight.await {
            tracing::info!(error = %e, "a Raft batch failed: this node no longer leads");
            journal.fail();
            return;
        }
        journal.progress_tx.send_if_modified(|p| {
            let moves = p.failed.is_none() && ticket > p.lsn;
            if moves {
                p.lsn = ticket;
            }
            moves
        });
    }
}

impl Journal for RaftJournal {
    fn logs_leases(&self) -> bool {
        true
    }

    fn append(&self, change: &Change<'_>) -> Result<Ticket, JournalError> {
        self.enqueue(Some(&change.record()))
    }

    fn failed(&self) -> Option<Arc<str>> {
        self.progress_tx.borrow().failed.clone()
    }

    fn progress(&self) -> watch::Receiver<Progress> {
        self.progress_tx.subscribe()
    }

    fn reserve_tokens(&self, token_limit: u64) -> BoxFuture<'_, Result<(), JournalError>> {
        Box::pin(async move {
            let ticket = self.append(&Change::Reserve { token_limit })?;
            crate::wal::wait_durable_on(&mut self.progress(), ticket).await?;
            Ok(())
        })
    }

    fn stats(&self) -> JournalStats {
        JournalStats {
            records: self.records.load(Ordering::Relaxed),
            fsyncs: self.entries.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Raft snapshots are openraft's business (built from the replicated state).
    fn snapshot_due(&self) -> bool {
        false
    }

    fn snapshot(&self, _source: &dyn LeaseSource) {}

    fn not_leader(&self) -> Option<Arc<str>> {
        self.failed().map(|_| self.hint.message(false))
    }

    fn confirm(&self) -> Result<Ticket, JournalError> {
        self.enqueue(None)
    }

    /// Stops taking changes; what was committed is the cluster's, and what was not is
    /// answered `NOT_LEADER` (outcome unknown) like any leadership loss.
    fn sync_and_stop(&self) -> Result<(), JournalError> {
        self.fail();
        Ok(())
    }
}

impl Drop for RaftJournal {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().expect("poisoned").drain(..) {
            task.abort();
        }
    }
}

/// The journal of a node that does not lead: everything but PING and HELP is refused
/// with `NOT_LEADER`, naming the leader as openraft knows it at the time of the request.
pub struct FollowerJournal {
    hint: LeaderHint,
    progress_tx: watch::Sender<Progress>,
}

impl FollowerJournal {
    /// The follower journal of the node `hint` describes.
    pub fn new(hint: LeaderHint) -> FollowerJournal {
        let (progress_tx, _) = watch::channel(Progress {
            failed: Some(NOT_LEADER.into()),
            ..Progress::default()
        });
        FollowerJournal { hint, progress_tx }
    }
}

impl Journal for FollowerJournal {
    fn logs_leases(&self) -> bool {
        true
    }

    fn append(&self, _change: &Change<'_>) -> Result<Ticket, JournalError> {
        Err(JournalError::NotLeader(self.hint.message(true)))
    }

    fn failed(&self) -> Option<Arc<str>> {
        Some(NOT_LEADER.into())
    }

    fn progress(&self) -> watch::Receiver<Progress> {
        self.progress_tx.subscribe()
    }

    fn reserve_tokens(&self, _token_limit: u64) -> BoxFuture<'_, Result<(), JournalError>> {
        Box::pin(async move { Err(JournalError::NotLeader(self.hint.message(true))) })
    }

    fn stats(&self) -> JournalStats {
        JournalStats::default()
    }

    fn snapshot_due(&self) -> bool {
        false
    }

    fn snapshot(&self, _source: &dyn LeaseSource) {}

    fn not_leader(&self) -> Option<Arc<str>> {
        Some(self.hint.message(true))
    }

    fn confirm(&self) -> Result<Ticket, JournalError> {
        Err(JournalError::NotLeader(self.hint.message(true)))
    }

    fn sync_and_stop(&self) -> Result<(), JournalError> {
        Ok(())
    }
}
