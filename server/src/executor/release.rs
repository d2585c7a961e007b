//! RELEASE: free the lease (handing the lock on), and keep what it takes to put it back if
//! the free never becomes durable.

use std::sync::Arc;

use bytes::Bytes;
use tenure_protocol::{ErrorCode, LeaseId, LeaseKind, Response};

use super::Session;
use super::Undo;
use super::{clamp_ms, error, Executor, Outcome};
use crate::journal::TICKET_NOW;
use crate::obs::stats::Stats;
use crate::record::FreeReason;
use crate::table;

impl Executor {
    pub(super) fn release(
        self: &Arc<Self>,
        ctx: &mut Session,
        now_ms: u64,
        key: Bytes,
        lease_id: LeaseId,
    ) -> Outcome {
        if let Some(refusal) = self.refuse_if_journal_failed() {
            return Outcome::Reply(refusal, TICKET_NOW);
        }
        let mut shard = self.shard(&key);
        // What the lease looked like, to put it back if the release never becomes durable
        // (only logged changes can fail to become durable).
        let before = if self.journal.logs_leases() {
            lease_before(&shard, now_ms, &key, lease_id)
        } else {
            None
        };
        let Some(ticket) = self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released)
        else {
            drop(shard);
            // Nothing changed: a read, vouched for like INSPECT (a deposed leader must not
            // tell a holder its lease is gone while the majority still keeps it).
            return self.confirmed(Response::NotOwner, TICKET_NOW);
        };
        drop(shard);
        ctx.disown(&key, lease_id);
        self.sessions.detach(lease_id);
        match ticket {
            Ok(ticket) => match before {
                Some((token, ttl_left_ms, meta, logged, kind, acquire_id)) => Outcome::Changed {
                    response: Response::Released,
                    ticket,
                    undo: Undo::Release {
                        key,
                        lease_id,
                        token,
                        ttl_ms: clamp_ms(ttl_left_ms).max(tenure_protocol::limits::TTL_MS_MIN),
                        logged,
                        meta,
                        kind,
                        acquire_id,
                    },
                },
                None => Outcome::Reply(Response::Released, ticket),
            },
            Err(e) => {
                // The journal failed (or filled its backlog) between the check above and the
                // append: the lock is free here, but a restart would bring the lease back.
                Stats::bump(&self.stats.errors);
                tracing::error!(error = %e, "a release could not be logged");
                let message = format!(
                    "released, but not durable: the lease may come back after a restart: {e}"
                );
                Outcome::Reply(error(ErrorCode::Unavailable, message), TICKET_NOW)
            }
        }
    }
}

/// What the lease `lease_id` on `key` looks like before its release, for [`Undo::Release`]:
/// token, time left, metadata, logged TTL, kind and acquire id; `None` if it does not hold
/// the key (nothing to put back).
fn lease_before(
    shard: &table::LockTable<super::WaitSlot>,
    now_ms: u64,
    key: &[u8],
    lease_id: LeaseId,
) -> Option<Before> {
    let (token, ttl_left_ms, meta, logged, kind) = if shard.is_shared(key) {
        let (token, ttl_left_ms, logged, kind, meta) = shard.shared_lease(now_ms, key, lease_id)?;
        (token, ttl_left_ms, meta, logged, kind)
    } else {
        match (shard.inspect(now_ms, key), shard.logged_ttl(key)) {
            (
                table::Inspect::Held {
                    token,
                    ttl_left_ms,
                    meta,
                    ..
                },
                Some(logged),
            ) => (token, ttl_left_ms, meta, logged, LeaseKind::Exclusive),
            _ => return None,
        }
    };
    let acquire_id = shard.acquire_id_of(token, lease_id, logged);
    Some((
        token,
        ttl_left_ms,
        Bytes::copy_from_slice(meta),
        logged,
        kind,
        acquire_id,
    ))
}

/// A lease as [`lease_before`] saw it.
type Before = (
    u64,
    u64,
    Bytes,
    table::LoggedTtl,
    LeaseKind,
    Option<tenure_protocol::AcquireId>,
);
