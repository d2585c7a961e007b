//! The journal: the one place that decides "durable before visible".
//!
//! Every change the executor makes to the lock table (a grant, a free, a token reservation,
//! a renewal to a longer TTL than the lease's records say, a session's open and end) is
//! described as a [`Change`] and
//! handed to the [`Journal`] while the table's shard lock is still held, so the journal
//! orders changes to a key exactly as the table made them. The journal answers with a
//! [`Ticket`]; the change's reply waits until the journal's [`Progress`] passes that
//! ticket. If the journal fails first, a grant or release is taken back (`executor::Undo`) and the
//! requester told "not durable, nothing changed" (a renewal stays, and its requester is
//! told it may be lost); once it has failed, new changes are refused before the table is
//! touched ([`Journal::failed`]).
//!
//! The durability mode ([`Durability::Full`] or [`Durability::Tokens`]) is a journal policy:
//! the executor always describes its changes, and the journal decides which are logged. In
//! token-only mode only reservations are, so grants, frees, renewals and sessions come back
//! with [`TICKET_NOW`] (and no session survives a restart there).
//!
//! [`Change::record`] is the one place a WAL record is built from a change, used by live
//! writes, by snapshots of the table, and by the WAL's own start-up snapshot.
//!
//! # A second implementation
//! [`WalJournal`] (the local write-ahead log) is the first implementation; a replicated log
//! is meant to be the second, without the executor changing. It must guarantee:
//! - **Order**: changes become durable in the order `append` was called, and `Progress`'s
//!   `lsn` only grows: a ticket is durable once `progress().lsn >= ticket`.
//! - **Durable means survives**: whatever is durable is replayed by recovery after a crash
//!   (for a replicated log: committed by a quorum), and nothing after a failure point is
//!   reported durable.
//! - **Failure is final and visible**: once a change cannot become durable, `Progress`
//!   carries `failed`, every later `append` fails, and `lsn` never moves again, so every
//!   reply still waiting is answered "not durable" and its change undone.
//! - **Tokens**: `reserve_tokens(limit)` returns only after a record "tokens below `limit`
//!   may be used" is durable, so no fencing token is ever visible before it is covered.
//! - **No blocking in `append`**: it runs under a shard lock; it queues and returns.
//! - **Reads it must vouch for** (a replicated log only): [`Journal::confirm`] hands out a
//!   ticket that passes once the journal has confirmed, after the call, that this node may
//!   still answer (a leader's quorum round); [`Journal::not_leader`] says when it may not.
//!   A local log answers [`TICKET_NOW`] and `None`.
//!
//! `mem::MemJournal` (tests only) is the in-memory example: it keeps the changes, makes
//! them durable on command, and fails on cue, for the simulation to inject write failures.

#[cfg(test)]
pub mod mem;
#[cfg(test)]
mod repeat_tests;
#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod tests;
mod wal;

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

pub use self::wal::WalJournal;
pub use crate::config::Durability;
pub use crate::record::{Change, Lease};
use crate::wal::WalError;

/// A position in the journal: a change is durable once [`Progress::lsn`] reaches its
/// ticket. [`TICKET_NOW`] (0) is durable from the start: a reply that needs no wait.
pub type Ticket = crate::record::Lsn;

/// The ticket of a reply that waits for nothing.
pub const TICKET_NOW: Ticket = 0;

/// How far the journal is durable (`lsn`: every ticket up to it), and `failed` once it
/// failed, after which `lsn` never moves again. A second implementation publishes the same.
pub use crate::record::DurableState as Progress;

/// The failure reason a replicated journal publishes in [`Progress::failed`] when its node
/// lost leadership: replies still waiting are then answered `NOT_LEADER`, not `UNAVAILABLE`.
pub const NOT_LEADER: &str = "not leader";

/// Why a change could not be made durable.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The local write-ahead log refused or lost the change.
    #[error(transparent)]
    Wal(#[from] WalError),
    /// Cluster mode: this node does not lead; the message names the leader
    /// (`leader=<client address>` or `leader=unknown`).
    #[error("not leader: {0}")]
    NotLeader(Arc<str>),
    /// No block of fencing tokens fits above the limit reserved so far: the token floor
    /// recovery found (or a peer's snapshot carried) is damaged, as no count of grants gets
    /// near it.
    #[error("fencing tokens exhausted: no block of tokens fits above {limit}")]
    TokensExhausted {
        /// The limit reserved so far.
        limit: u64,
    },
}

/// Counters for STATS.
#[derive(Clone, Copy, Debug, Default)]
pub struct JournalStats {
    /// Records appended.
    pub records: u64,
    /// Syncs made (one per group of records).
    pub fsyncs: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// Where a snapshot reads the live leases from: the lock table, part by part (shard by
/// shard), each part under its own lock; and the open sessions, copied first.
pub trait LeaseSource {
    /// Calls `each` with a [`Change::SessionOpen`] for every open session, under the session
    /// table's lock (so no open or end of one is logged meanwhile). A snapshot copies them
    /// before any lease: replay must know a session before the grants in it.
    fn for_each_session(&self, each: &mut dyn FnMut(Change<'_>));
    /// How many parts there are.
    fn parts(&self) -> usize;
    /// Calls `each` for every live lease of part `part`, under that part's lock.
    fn for_each_lease(&self, part: usize, each: &mut dyn FnMut(Lease<'_>));
    /// The allocator's durable token limit, which the snapshot records.
    fn token_limit(&self) -> u64;
}

/// The log that makes changes durable before anyone hears of them; see the module docs for
/// what an implementation must guarantee.
pub trait Journal: Send + Sync + 'static {
    /// Whether grants, frees and renewals are logged (durability `full`): only then can one
    /// need undoing.
    fn logs_leases(&self) -> bool;

    /// Queues `change` if the durability policy logs it and returns the ticket its reply must
    /// wait for ([`TICKET_NOW`] if it is not logged). Never blocks.
    ///
    /// # Errors
    /// When the journal failed or cannot take the change now; nothing was queued then.
    fn append(&self, change: &Change<'_>) -> Result<Ticket, JournalError>;

    /// Why the journal can no longer make a logged change durable, if it can't; `None` in a
    /// mode that logs no leases (nothing of theirs can fail).
    fn failed(&self) -> Option<Arc<str>>;

    /// The journal's progress, for connections whose replies wait on tickets.
    fn progress(&self) -> watch::Receiver<Progress>;

    /// Logs "tokens below `token_limit` may be used" and waits until that is durable.
    ///
    /// # Errors
    /// When it could not be made durable.
    fn reserve_tokens(&self, token_limit: u64) -> BoxFuture<'_, Result<(), JournalError>>;

    /// Counters for STATS.
    fn stats(&self) -> JournalStats;

    /// Whether the log has grown enough past the live state that a [`Journal::snapshot`]
    /// would pay.
    fn snapshot_due(&self) -> bool;

    /// Copies the live leases in `source` into the log, so older history may be dropped;
    /// failures are logged and abandon the copy. Blocking: run it off the async runtime.
    fn snapshot(&self, source: &dyn LeaseSource);

    /// Cluster mode: `Some("leader=<client address>")` (or `leader=unknown`) while this node
    /// does not lead, so requests are refused with `NOT_LEADER`; `None` on a single node.
    fn not_leader(&self) -> Option<Arc<str>> {
        None
    }

    /// A ticket a read's reply (RENEW, CHECK, INSPECT) waits for, taken after the read: it
    /// passes once everything appended before it is durable and the journal has confirmed,
    /// after this call, that this node may still answer ([`TICKET_NOW`] for a local log,
    /// which always may). Never blocks.
    ///
    /// # Errors
    /// When this node may not answer (it does not lead); nothing was queued then.
    fn confirm(&self) -> Result<Ticket, JournalError> {
        Ok(TICKET_NOW)
    }

    /// The local WAL behind this journal, if it is one, for its `/metrics` figures (fsync
    /// latency, batch sizes, segments, snapshots).
    fn wal(&self) -> Option<&crate::wal::Wal> {
        None
    }

    /// Makes everything appended durable and stops taking changes.
    ///
    /// # Errors
    /// When some appended change is not durable.
    fn sync_and_stop(&self) -> Result<(), JournalError>;
}

/// What becomes of a reply that waited on a ticket.
pub enum Settled {
    /// Not yet decided: keep waiting.
    Waiting,
    /// Durable (or it never needed the journal): send the reply.
    Durable,
    /// The journal failed before the ticket became durable, for this reason.
    Lost(Arc<str>),
}

/// Where a reply waiting on `ticket` stands, given the journal's `progress`.
pub fn settle(ticket: Ticket, progress: &Progress) -> Settled {
    if ticket <= progress.lsn {
        return Settled::Durable;
    }
    match &progress.failed {
        Some(why) => Settled::Lost(Arc::clone(why)),
        None => Settled::Waiting,
    }
}
