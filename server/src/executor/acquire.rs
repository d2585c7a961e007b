//! ACQUIRE: a grant at once, LOCKED, a place in line as a waiter, or a retry once more
//! fencing tokens are reserved.

use std::sync::{Arc, MutexGuard};

use bytes::Bytes;

use tenure_protocol::{AcquireId, EventKind, LeaseId, LeaseKind, Request, Response};
use tokio::sync::oneshot;

use super::{clamp_ms, Executor, Outcome, Session, Undo, WaitResult, WaitSlot};
use crate::journal::{Change, Lease, Ticket, TICKET_NOW};
use crate::obs::stats::Stats;
use crate::record::FreeReason;
use crate::table::{self, Acquire, AcquireArgs, LockTable};

impl Executor {
    pub(super) fn acquire(
        self: &Arc<Self>,
        ctx: &mut Session,
        now_ms: u64,
        received_ms: u64,
        request: Request,
    ) -> Outcome {
        let Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            meta,
            acquire_id,
            kind,
            ..
        } = &request
        else {
            unreachable!("acquire called with {request:?}")
        };
        let mut shard = self.shard(key);
        // Under the same hold of the shard as the grant below, so two sends of one ACQUIRE
        // cannot both be granted (the repeat check is here or in `acquire_with_id`).
        let early = self.repeat_or_refusal(ctx, &mut shard, now_ms, key, *ttl_ms, *acquire_id);
        if let Some(answer) = early {
            return answer;
        }
        let (tx, rx) = oneshot::channel();
        let waiter = (*wait_ms > 0).then(|| wait_slot(ctx, tx, received_ms, &request));
        let args = AcquireArgs {
            key,
            lease_id: LeaseId::from_u128(rand::random()),
            ttl_ms: *ttl_ms,
            wait_ms: *wait_ms,
            waiter,
            meta,
        };
        let mut events = Vec::new();
        let outcome = self.table_acquire(&mut shard, now_ms, args, *kind, *acquire_id, &mut events);
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(met) => return self.repeat_met(ctx, shard, now_ms, received_ms, &request, met),
        };
        // Settling the key may have ended a lease or handed it on before this request's turn.
        self.apply_events(&mut shard, now_ms, &mut events);
        match outcome {
            Acquire::Granted(grant) => {
                let waited_ms = clamp_ms(now_ms - received_ms);
                self.granted(ctx, &mut shard, now_ms, &request, grant, waited_ms)
            }
            Acquire::Locked { token, ttl_left_ms } => {
                drop(shard);
                self.locked(token, ttl_left_ms)
            }
            Acquire::Queued { waiter_id } => queued(rx, &request, waiter_id),
            Acquire::Full(limit) => Outcome::Reply(self.full_error(limit), TICKET_NOW),
            Acquire::KindMismatch { key_limit } => {
                drop(shard);
                Outcome::Reply(self.kind_mismatch(*kind, key_limit), TICKET_NOW)
            }
            Acquire::TokensExhausted { .. } => {
                drop(shard);
                self.need_tokens(request, received_ms)
            }
        }
    }

    /// The table's answer to an ACQUIRE, or (with an acquire id) what the repeat it turned
    /// out to be meets.
    fn table_acquire(
        &self,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        args: AcquireArgs<'_, WaitSlot>,
        kind: LeaseKind,
        acquire_id: Option<AcquireId>,
        events: &mut Vec<table::Event<WaitSlot>>,
    ) -> Result<Acquire<WaitSlot>, table::Repeat> {
        let allocator = &self.tokens.allocator;
        match acquire_id {
            None => Ok(shard.acquire_kind(now_ms, args, kind, allocator, events)),
            Some(id) => shard.acquire_with_id(now_ms, args, kind, id, allocator, events),
        }
    }

    /// An ACQUIRE that found no fencing token left: more are reserved, and it is tried again.
    fn need_tokens(&self, request: Request, received_ms: u64) -> Outcome {
        self.tokens.reserve_ahead();
        Outcome::NeedTokens {
            request,
            received_ms,
        }
    }

    /// The answer to an ACQUIRE that repeats an earlier one, as `acquire_with_id` found:
    /// what it meets, once its key is settled if need be. Should settling leave nothing
    /// known of it, it is acquired afresh (under a new hold of the shard, checked again).
    fn repeat_met(
        self: &Arc<Self>,
        ctx: &mut Session,
        mut shard: MutexGuard<'_, LockTable<WaitSlot>>,
        now_ms: u64,
        received_ms: u64,
        request: &Request,
        repeat: table::Repeat,
    ) -> Outcome {
        let Request::Acquire {
            key,
            acquire_id: Some(acquire_id),
            ..
        } = request
        else {
            unreachable!("repeat_met called with {request:?}")
        };
        if let Some(answer) = self.repeat_answer(&mut shard, now_ms, key, *acquire_id, repeat) {
            return answer;
        }
        drop(shard);
        self.acquire(ctx, now_ms, received_ms, request.clone())
    }

    /// LOCKED with the holder's `token` and the time left on its lease.
    fn locked(&self, token: u64, ttl_left_ms: u64) -> Outcome {
        Stats::bump(&self.stats.locked);
        let ttl_left_ms = clamp_ms(ttl_left_ms);
        // A read of the table: vouched for like INSPECT (a leader cut off from its quorum
        // must not report a holder the majority may have let go).
        self.confirmed(Response::Locked { token, ttl_left_ms }, TICKET_NOW)
    }

    /// The answer to an ACQUIRE before the table is asked: a repeat's (first: a repeat is
    /// not a new hold, so no quota or limit refuses it), else a refusal, if any. Where no
    /// refusal is in sight (nearly always), the repeat check is left to the table's grant
    /// (`acquire_with_id`), which looks the key up once for both. A repeat of a shared
    /// (read) or permits lease is found among its key's holders (`repeat_of`).
    fn repeat_or_refusal(
        self: &Arc<Self>,
        ctx: &mut Session,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        key: &[u8],
        ttl_ms: u32,
        acquire_id: Option<AcquireId>,
    ) -> Option<Outcome> {
        if let Some(acquire_id) = acquire_id {
            // A node that does not lead cannot vouch for a lease.
            if let Some(refusal) = self.refuse_if_not_leader() {
                return Some(Outcome::Reply(refusal, TICKET_NOW));
            }
            if !self.may_refuse(ctx, now_ms, ttl_ms) {
                return None;
            }
            if let Some(answer) = self.repeat(shard, now_ms, key, acquire_id) {
                return Some(answer);
            }
        }
        let refusal = ctx.refusal_unless_repeat.take();
        let refusal = refusal.or_else(|| self.refuse_acquire(now_ms, ttl_ms))?;
        Some(Outcome::Reply(refusal, TICKET_NOW))
    }

    /// Whether an ACQUIRE may be refused by [`Executor::repeat_or_refusal`] (unless it is a
    /// repeat), counting nothing.
    fn may_refuse(&self, ctx: &Session, now_ms: u64, ttl_ms: u32) -> bool {
        ctx.refusal_unless_repeat.is_some() || self.may_refuse_acquire(now_ms, ttl_ms)
    }

    /// Logs a grant the table just made (still under its shard's lock) and builds its reply,
    /// or takes it back if it cannot be logged.
    fn granted(
        self: &Arc<Self>,
        ctx: &mut Session,
        shard: &mut LockTable<WaitSlot>,
        now_ms: u64,
        request: &Request,
        grant: table::Grant,
        waited_ms: u32,
    ) -> Outcome {
        let Request::Acquire {
            key,
            release_on_disconnect,
            meta,
            acquire_id,
            kind,
            session_id,
            ..
        } = request
        else {
            unreachable!("granted called with {request:?}")
        };
        let table::Grant {
            token,
            lease_id,
            ttl_ms,
        } = grant;
        let lease = Lease {
            key,
            lease_id,
            token,
            ttl_ms,
            release_on_disconnect: *release_on_disconnect,
            meta,
            acquire_id: *acquire_id,
            session_id: *session_id,
            kind: *kind,
        };
        let ticket = match self.journal.append(&Change::Grant(lease)) {
            Ok(ticket) => ticket,
            Err(e) => {
                // Not durable, so it must not stand: take it back before anyone hears of it
                // (and a repeat is then a new ACQUIRE, not told of its end).
                shard.forget_acquire_id(key, token);
                self.free(shard, now_ms, key, lease_id, FreeReason::Released);
                return Outcome::Reply(self.unavailable(&e), TICKET_NOW);
            }
        };
        if let Some(acquire_id) = acquire_id {
            shard.note_acquire_id(token, *acquire_id, ticket);
        }
        Stats::bump(&self.stats.grants);
        self.stats.count_kind_grant(*kind);
        self.hold(token, ctx.held_place.as_ref());
        self.watches.notify(key, EventKind::Granted, token, meta);
        if *release_on_disconnect {
            ctx.own(key.clone(), lease_id);
        }
        self.tokens.reserve_ahead();
        let response = Response::Granted {
            token,
            lease_id,
            ttl_ms,
            waited_ms,
        };
        self.logged_grant(response, key, lease_id, ticket)
    }

    /// The outcome of a logged grant: its reply, and how to take it back if the log entry
    /// fails to become durable.
    #[inline]
    fn logged_grant(
        &self,
        response: Response,
        key: &Bytes,
        lease_id: LeaseId,
        ticket: Ticket,
    ) -> Outcome {
        if !self.journal.logs_leases() {
            return Outcome::Reply(response, TICKET_NOW); // nothing was logged, nothing to undo
        }
        let undo = Undo::Grant {
            key: key.clone(),
            lease_id,
        };
        Outcome::Changed {
            response,
            ticket,
            undo,
        }
    }
}

/// The outcome of an ACQUIRE queued as waiter `waiter_id`, to hear its turn on `rx`.
fn queued(rx: oneshot::Receiver<WaitResult>, request: &Request, waiter_id: u64) -> Outcome {
    let Request::Acquire {
        key,
        release_on_disconnect,
        session_id,
        ..
    } = request
    else {
        unreachable!("queued called with {request:?}")
    };
    Outcome::Wait {
        rx,
        key: key.clone(),
        waiter_id,
        release_on_disconnect: *release_on_disconnect,
        session_id: *session_id,
    }
}

/// The place in line of an ACQUIRE that may wait, to be queued if the key is held: it keeps
/// the request's release-on-disconnect, acquire id and session.
#[inline]
fn wait_slot(
    ctx: &Session,
    tx: oneshot::Sender<WaitResult>,
    received_ms: u64,
    request: &Request,
) -> WaitSlot {
    let Request::Acquire {
        release_on_disconnect,
        acquire_id,
        session_id,
        ..
    } = request
    else {
        unreachable!("wait_slot called with {request:?}")
    };
    let mut slot = WaitSlot::new(tx, *release_on_disconnect, received_ms);
    slot.held_place = ctx.held_place.clone();
    slot.acquire_id = *acquire_id;
    slot.session_id = *session_id;
    slot.session_deadline = ctx.session_deadline.clone();
    slot
}
