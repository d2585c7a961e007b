//! ACQUIRE: a grant at once, LOCKED, a place in line as a waiter, or a retry once more
//! fencing tokens are reserved.

use std::sync::Arc;

use tenure_protocol::{EventKind, LeaseId, Request, Response};
use tokio::sync::oneshot;

use super::{clamp_ms, Executor, Outcome, Session, Undo, WaitSlot};
use crate::journal::{Change, Lease, TICKET_NOW};
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
            release_on_disconnect,
            meta,
            acquire_id,
            kind,
            session_id,
        } = &request
        else {
            unreachable!("acquire called with {request:?}")
        };
        if let Some(refusal) = self.refuse_acquire(now_ms, *ttl_ms) {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        let (tx, rx) = oneshot::channel();
        let waiter = (*wait_ms > 0).then(|| {
            let mut slot = WaitSlot::new(tx, *release_on_disconnect, received_ms);
            slot.held_place = ctx.held_place.clone();
            slot.acquire_id = *acquire_id;
            slot
        });
        let args = AcquireArgs {
            key,
            lease_id: LeaseId::from_u128(rand::random()),
            ttl_ms: *ttl_ms,
            wait_ms: *wait_ms,
            waiter,
            meta,
        };
        let mut shard = self.shard(key);
        let mut events = Vec::new();
        if let Some(acquire_id) = acquire_id {
            // Under the same hold of the shard as the grant below, so two sends of one
            // ACQUIRE cannot both be granted. A repeat of a shared (read) or permits lease
            // is found among its key's holders the same way (`repeat_of`).
            if let Some(answer) = self.repeat(&mut shard, now_ms, key, *acquire_id) {
                return answer;
            }
        }
        let outcome = shard.acquire_kind(now_ms, args, *kind, &self.tokens.allocator, &mut events);
        // Settling the key may have ended a lease or handed it on before this request's turn.
        self.apply_events(&mut shard, now_ms, &mut events);
        match outcome {
            Acquire::Granted(grant) => {
                let waited_ms = clamp_ms(now_ms - received_ms);
                self.granted(ctx, &mut shard, now_ms, &request, grant, waited_ms)
            }
            Acquire::Locked { token, ttl_left_ms } => {
                drop(shard);
                Stats::bump(&self.stats.locked);
                let ttl_left_ms = clamp_ms(ttl_left_ms);
                // A read of the table: vouched for like INSPECT (a leader cut off from its
                // quorum must not report a holder the majority may have let go).
                self.confirmed(Response::Locked { token, ttl_left_ms }, TICKET_NOW)
            }
            Acquire::Queued { waiter_id } => Outcome::Wait {
                rx,
                key: key.clone(),
                waiter_id,
                release_on_disconnect: *release_on_disconnect,
                session_id: *session_id,
            },
            Acquire::Full(limit) => Outcome::Reply(self.full_error(limit), TICKET_NOW),
            Acquire::KindMismatch { key_limit } => {
                drop(shard);
                Outcome::Reply(self.kind_mismatch(*kind, key_limit), TICKET_NOW)
            }
            Acquire::TokensExhausted { .. } => {
                drop(shard);
                self.tokens.reserve_ahead();
                Outcome::NeedTokens {
                    request,
                    received_ms,
                }
            }
        }
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
            kind: *kind,
        };
        let ticket = match self.journal.append(&Change::Grant(lease)) {
            Ok(ticket) => ticket,
            Err(e) => {
                // Not durable, so it must not stand: take it back before anyone hears of it.
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
