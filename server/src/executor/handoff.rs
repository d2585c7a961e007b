//! Hand-off: giving a freed lock to the next waiter (a blocking acquire queued behind the
//! holder). The table picks the waiter and makes the grant; this module logs it, delivers it
//! to the waiter's connection, and frees the lock again for the next in line if the waiter
//! vanished meanwhile or the grant cannot be logged. Frees (release, expiry, disconnect, undo)
//! all pass through `Executor::free`, the one place a lease ends and its successor is found.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tenure_protocol::{AcquireId, EndedHow, ErrorCode, EventKind, LeaseId};
use tokio::sync::oneshot;

use super::{clamp_ms, Executor};
use crate::journal::{Change, JournalError, Lease, Ticket};
use crate::obs::stats::Stats;
use crate::record::FreeReason;
use crate::table::{self, Event, Handoff, LockTable, Repeat};

/// What a waiter is eventually told.
#[derive(Debug)]
pub enum WaitResult {
    /// The lock was handed over; reply once `ticket` is durable.
    Granted {
        /// The grant.
        grant: table::Grant,
        /// The journal ticket of the grant.
        ticket: Ticket,
        /// Time from taking the request up to the grant, for the reply's `waited_ms`.
        waited_ms: u32,
    },
    /// The wait ran out while someone else held the lock.
    TimedOut {
        /// The holder's token.
        token: u64,
        /// Time left on the holder's lease.
        ttl_left_ms: u64,
    },
    /// The hand-over could not be made durable.
    Failed(ErrorCode, String),
    /// The waiter repeats an ACQUIRE (same key, same acquire id) whose lease was granted to
    /// an earlier send of it and has ended since: nothing was granted to it.
    Ended {
        /// How that lease ended.
        how: EndedHow,
        /// That lease's fencing token.
        token: u64,
    },
    /// The waiter repeats an ACQUIRE whose lease, granted to another send of it, still
    /// holds the key: beside the one this waiter would have got (a read lease or permits,
    /// granted in the same pass over the queue: whichever hand-off was made first holds), or
    /// when this waiter's wait ran out behind it. It is answered REGRANTED with that lease
    /// once `ticket` (that lease's grant) is durable; nothing is granted to it.
    Regranted {
        /// That lease's fencing token.
        token: u64,
        /// That lease's id.
        lease_id: LeaseId,
        /// Time left on it.
        ttl_left_ms: u64,
        /// The journal ticket of its grant.
        ticket: Ticket,
    },
}

/// A waiter's way back to its connection: the table's [`table::WaiterSink`].
pub struct WaitSlot {
    tx: oneshot::Sender<WaitResult>,
    release_on_disconnect: bool,
    /// When the request was taken up (`now_ms`), so a hand-off can tell how long it waited.
    received_ms: u64,
    /// The waiting identity's held-locks place (identities only): kept by the lease if the
    /// lock is handed over, given back when the slot goes otherwise.
    pub(crate) held_place: Option<crate::identity::PlaceCell>,
    /// The ACQUIRE's acquire id, if it had one: the lease handed over answers it.
    pub(crate) acquire_id: Option<AcquireId>,
    /// The session the ACQUIRE named, if any: the grant's record says so (it joins the
    /// session once its waiter hears of it, `Executor::join_session`).
    pub(crate) session_id: Option<tenure_protocol::SessionId>,
    /// That session's deadline in the executor's clock (0 once it ended), shared with the
    /// session table: read under a shard's lock, where the session table's lock may not be
    /// taken, so a waiter whose session ended is never handed the lock.
    pub(crate) session_deadline: Option<Arc<AtomicU64>>,
}

impl WaitSlot {
    /// A slot answering on `tx`.
    pub fn new(
        tx: oneshot::Sender<WaitResult>,
        release_on_disconnect: bool,
        received_ms: u64,
    ) -> WaitSlot {
        WaitSlot {
            tx,
            release_on_disconnect,
            received_ms,
            held_place: None,
            acquire_id: None,
            session_id: None,
            session_deadline: None,
        }
    }

    /// Tells the waiter `result` (nothing if its connection is gone).
    pub(crate) fn answer(self, result: WaitResult) {
        let _ = self.tx.send(result);
    }

    /// Whether the waiter's session (if it has one) has ended by `now_ms`, or is about to:
    /// less than the shortest TTL left, so it could take no lease (PROTOCOL.md 3.11).
    pub(crate) fn session_ended(&self, now_ms: u64) -> bool {
        self.session_deadline.as_ref().is_some_and(|deadline_ms| {
            let min_ms = u64::from(tenure_protocol::limits::TTL_MS_MIN);
            deadline_ms.load(Ordering::Acquire) < now_ms.saturating_add(min_ms)
        })
    }
}

impl table::WaiterSink for WaitSlot {
    fn is_live(&self) -> bool {
        !self.tx.is_closed()
    }

    fn is_live_at(&self, now_ms: u64) -> bool {
        self.is_live() && !self.session_ended(now_ms)
    }
}

impl Executor {
    /// Releases `lease_id`'s hold on `key` if it has one: logs and announces it, then hands
    /// the lock to the next live waiter. `None` if the lease did not hold the key; otherwise
    /// the journal ticket of the free, or the error that kept it from being logged.
    pub(crate) fn free(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        reason: FreeReason,
    ) -> Option<Result<Ticket, JournalError>> {
        let mut events = Vec::new();
        let result = shard.release(now_ms, key, lease_id, &self.tokens.allocator, &mut events);
        let outcome = match result {
            table::Release::NotOwner => None,
            table::Release::Released { token, handoff } => {
                self.lease_ended(token);
                shard.acquire_id_ended(now_ms, key, token, ended_how(reason));
                let ticket = self.journal.append(&Change::Free { key, token, reason });
                let kind = if reason == FreeReason::Expired {
                    EventKind::Expired
                } else {
                    EventKind::Released
                };
                self.watches.notify(key, kind, token, b"");
                if let Some(handoff) = handoff {
                    // The head of the line was granted first: its hand-off (and GRANTED
                    // event) goes before those of any waiters granted after it by this
                    // release (a shared key's), so events keep grant order (PROTOCOL.md 3.4).
                    let at = events
                        .iter()
                        .position(|e| matches!(e, Event::HandedOff(_)))
                        .unwrap_or(events.len());
                    events.insert(at, Event::HandedOff(handoff));
                }
                Some(ticket)
            }
        };
        self.apply_events(shard, now_ms, &mut events);
        outcome
    }

    /// Gives a lock to a waiter: log the grant, then send it. A waiter that vanished in
    /// between, or a grant that cannot be logged, frees the lock again for the next in line.
    fn hand_off(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        handoff: Handoff<WaitSlot>,
    ) {
        let Handoff {
            waiter,
            grant,
            key,
            meta,
            kind,
            ..
        } = handoff;
        let WaitSlot {
            tx,
            release_on_disconnect,
            received_ms,
            held_place,
            acquire_id,
            session_id,
            session_deadline: _,
        } = waiter;
        if let Some(acquire_id) = acquire_id {
            if let Some(answer) = self.repeat_in_line(shard, now_ms, &key, acquire_id) {
                Stats::bump(&self.stats.repeats);
                let _ = tx.send(answer);
                self.free(shard, now_ms, &key, grant.lease_id, FreeReason::Released);
                return;
            }
        }
        let lease = Lease {
            key: &key,
            lease_id: grant.lease_id,
            token: grant.token,
            ttl_ms: grant.ttl_ms,
            release_on_disconnect,
            meta: &meta,
            acquire_id,
            session_id,
            kind,
        };
        let logged = self.journal.append(&Change::Grant(lease));
        // The lease runs from `now_ms` (the table counts a hand-off's TTL from the call that
        // settled the key), so this is exactly the time in line.
        let waited_ms = clamp_ms(now_ms.saturating_sub(received_ms));
        let message = handoff_message(&logged, grant, waited_ms);
        if tx.send(message).is_ok() && logged.is_ok() {
            if let (Some(acquire_id), Ok(ticket)) = (acquire_id, &logged) {
                shard.note_acquire_id(grant.token, acquire_id, *ticket);
            }
            if let Some(session_id) = session_id {
                self.sessions.joining(grant.lease_id, session_id);
            }
            Stats::bump(&self.stats.grants);
            Stats::bump(&self.stats.handoffs);
            self.stats.count_kind_grant(kind);
            self.hold(grant.token, held_place.as_ref());
            self.watches
                .notify(&key, EventKind::Granted, grant.token, &meta);
            self.tokens.reserve_ahead();
            return;
        }
        // Nobody will ever hear of this grant: free it so the next waiter is not held up.
        self.free(shard, now_ms, &key, grant.lease_id, FreeReason::Released);
    }

    /// A hand-off whose waiter's connection ended before it took the grant up (the reply
    /// was never sent; `ctx` is that connection's, its waits already cancelled, so no other
    /// hand-off can come). With an acquire id the client may retry, and its retry must find
    /// the grant where its first send put it: in the session it named (it joins it here, as
    /// the connection would have: its keep-alives keep it, its close frees it, a repeat
    /// naming the session is answered with it), or, outside a session, with its TTL. Without
    /// one nobody can ever name this lease, and with release on disconnect its connection
    /// is gone: freed at once, as a hand-off to a waiter that left is (PROTOCOL.md 3.4).
    /// It left a session's lease out of its session (outside test a30, finding F1).
    pub fn undelivered_hand_off(
        self: &Arc<Self>,
        ctx: &super::Session,
        key: &bytes::Bytes,
        (grant, ticket): (table::Grant, Ticket),
        session: Option<(tenure_protocol::SessionId, u64)>,
        release_on_disconnect: bool,
    ) {
        let has_acquire_id = (self.shard(key))
            .held_acquire_id(key, grant.token)
            .is_some();
        if has_acquire_id && !release_on_disconnect {
            if let Some(session) = session {
                // Joined, or freed if its session ended meanwhile; nobody to tell either way.
                let _ = self.join_session(ctx, session, key, grant, ticket);
            }
            return;
        }
        if session.is_some() {
            self.sessions.joined(grant.lease_id);
        }
        let reason = if release_on_disconnect {
            FreeReason::Disconnected
        } else {
            FreeReason::Released
        };
        let now_ms = self.clock.now_ms();
        let mut shard = self.shard(key);
        let _ = self.free(&mut shard, now_ms, key, grant.lease_id, reason);
    }

    /// Counts the lease with fencing token `token` against its identity's held-locks quota
    /// until it ends (identities only).
    pub(crate) fn hold(&self, token: u64, cell: Option<&crate::identity::PlaceCell>) {
        let place = cell.and_then(crate::identity::take_place);
        if let (Some(identities), Some(place)) = (&self.identities, place) {
            identities.hold(token, place);
        }
    }

    /// The lease with fencing token `token` ended: its identity's place comes back.
    fn lease_ended(&self, token: u64) {
        if let Some(identities) = &self.identities {
            identities.ended(token);
        }
    }

    /// Acts on everything the table did on its own: expiries, hand-offs, waits that ran out.
    /// Every grant the table makes reaches the server through here or an `Acquire::Granted`.
    pub fn apply_events(
        self: &Arc<Self>,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        events: &mut Vec<Event<WaitSlot>>,
    ) {
        for event in std::mem::take(events) {
            match event {
                Event::Expired {
                    key,
                    token,
                    lease_id,
                    handoff,
                } => {
                    Stats::bump(&self.stats.expirations);
                    self.lease_ended(token);
                    shard.acquire_id_ended(now_ms, &key, token, EndedHow::Expired);
                    self.stats.metrics.expired(lease_id);
                    // Not waited for: an expiry lost in a crash comes back as a held lease
                    // whose TTL runs again, which is the safe direction.
                    let reason = FreeReason::Expired;
                    let _ = self.journal.append(&Change::Free {
                        key: &key,
                        token,
                        reason,
                    });
                    self.watches.notify(&key, EventKind::Expired, token, b"");
                    if let Some(handoff) = handoff {
                        self.hand_off(shard, now_ms, handoff);
                    }
                }
                Event::HandedOff(handoff) => self.hand_off(shard, now_ms, handoff),
                Event::WaitTimedOut {
                    waiter,
                    key,
                    holder_token,
                    ttl_left_ms,
                    ..
                } => {
                    let repeat = waiter
                        .acquire_id
                        .and_then(|id| repeat_at_wait_end(shard, now_ms, &key, id, holder_token));
                    let result = repeat.unwrap_or_else(|| {
                        if waiter.session_ended(now_ms) {
                            // Its session ended first: that is what it hears (3.11).
                            return session_ended_result();
                        }
                        WaitResult::TimedOut {
                            token: holder_token,
                            ttl_left_ms,
                        }
                    });
                    let counter = match result {
                        WaitResult::TimedOut { .. } => &self.stats.locked,
                        _ => &self.stats.repeats,
                    };
                    Stats::bump(counter);
                    let _ = waiter.tx.send(result);
                }
            }
        }
    }
}

/// What a waiting repeat of an ACQUIRE is told when its wait runs out, if the earlier send
/// of it was granted: LOCKED would read as "not granted" and orphan that lease (PROTOCOL.md
/// "Acquire ids"). `None` if nothing is known of it (then it is LOCKED as any waiter).
fn repeat_at_wait_end(
    shard: &mut LockTable<WaitSlot>,
    now_ms: u64,
    key: &[u8],
    acquire_id: AcquireId,
    holder_token: u64,
) -> Option<WaitResult> {
    match shard.repeat_of(now_ms, key, acquire_id) {
        Repeat::New => None,
        Repeat::Live {
            token,
            lease_id,
            ttl_left_ms,
            ticket,
        } => Some(WaitResult::Regranted {
            token,
            lease_id,
            ttl_left_ms,
            ticket,
        }),
        Repeat::Ended { how, token } => Some(WaitResult::Ended { how, token }),
        // Its own lease, past its deadline but not reaped yet: a repeat hears "expired".
        Repeat::Unsettled => Some(WaitResult::Ended {
            how: EndedHow::Expired,
            token: holder_token,
        }),
    }
}

/// What a waiter whose session ended before its turn, or had less than the shortest TTL
/// left when the key came free (it takes no new lease then), is told (PROTOCOL.md 3.11).
/// The message says both: in the second case the session goes on, and a keep-alive in time
/// continues it (outside test a34, finding F3).
pub fn session_ended_result() -> WaitResult {
    let min_ms = tenure_protocol::limits::TTL_MS_MIN;
    WaitResult::Failed(
        ErrorCode::NoSession,
        format!(
            "the session ended, or had under {min_ms} ms left, while this ACQUIRE waited: \
             it takes no new lease"
        ),
    )
}

/// How a repeat of the ACQUIRE of a lease that ended for `reason` is told it ended.
pub(crate) fn ended_how(reason: FreeReason) -> EndedHow {
    match reason {
        FreeReason::Released => EndedHow::Released,
        FreeReason::Expired => EndedHow::Expired,
        FreeReason::Disconnected => EndedHow::Disconnected,
        FreeReason::Session => EndedHow::Session,
    }
}

/// What a waiter handed a lock hears: the grant once it is logged, else why there is none.
#[inline]
fn handoff_message(
    logged: &Result<Ticket, JournalError>,
    grant: table::Grant,
    waited_ms: u32,
) -> WaitResult {
    match logged {
        Ok(ticket) => WaitResult::Granted {
            grant,
            ticket: *ticket,
            waited_ms,
        },
        // Not logged, so the hand-off is undone; a deposed leader says so as every refusal of a
        // leader that lost its leadership does (PROTOCOL.md 3.8).
        Err(JournalError::NotLeader(leader)) => {
            WaitResult::Failed(ErrorCode::NotLeader, leader.to_string())
        }
        Err(e) => WaitResult::Failed(
            ErrorCode::Unavailable,
            format!("not durable, nothing changed: {e}"),
        ),
    }
}
