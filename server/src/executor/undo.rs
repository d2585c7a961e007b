//! Taking back a change whose journal record never became durable, so that the client's
//! "not durable, nothing changed" holds on the live server as it does after a restart.

use std::sync::Arc;

use bytes::Bytes;
use tenure_protocol::{AcquireId, ErrorCode, EventKind, LeaseId, Response};

use super::{Executor, Session};
use crate::journal::NOT_LEADER;
use crate::record::FreeReason;
use crate::table;

/// How to take back a change whose record never became durable.
#[derive(Debug)]
pub enum Undo {
    /// Revoke a grant (handing the lock to the next waiter, as a release would).
    Grant {
        /// The lock.
        key: Bytes,
        /// The grant's lease.
        lease_id: LeaseId,
    },
    /// Put a released lease back, unless someone else holds the key by now.
    Release {
        /// The lock.
        key: Bytes,
        /// The released lease.
        lease_id: LeaseId,
        /// Its fencing token.
        token: u64,
        /// Time it had left, in milliseconds; it gets at least that again.
        ttl_ms: u32,
        /// The TTL its journal records gave it, which it keeps: renewals up to that TTL
        /// need no new record.
        logged: table::LoggedTtl,
        /// Its holder metadata.
        meta: Bytes,
        /// The acquire id it answered, if any: it answers it again once put back.
        acquire_id: Option<AcquireId>,
        /// What it held (a shared or permit lease is put back only if its key has no
        /// other holder or waiter left).
        kind: tenure_protocol::LeaseKind,
    },
    /// Forget a session whose open never became durable (no client heard of it).
    SessionOpen {
        /// The session.
        session_id: tenure_protocol::SessionId,
    },
}

/// The answer to a change lost to a journal failure (`why`), after taking it back with
/// `undo` where there is one: a grant is revoked (and no longer released on `ctx`'s close),
/// a release put back.
pub fn answer_lost(
    executor: &Arc<Executor>,
    ctx: &mut Session,
    undo: Option<Undo>,
    why: &str,
) -> Response {
    let undone = match undo {
        Some(undo) => {
            if let Undo::Grant { lease_id, .. } = &undo {
                ctx.forget_owned(*lease_id);
            }
            executor.undo(undo)
        }
        None => false,
    };
    if why == NOT_LEADER {
        // The change reached Raft, so it may still commit (under this leader after a
        // partition heals, or the next one's): unlike a refusal before execution, this
        // answer must not read as "not executed" (outside test a65, 1).
        // Only the hint's `leader=` word: its other words speak of requests refused unrun.
        let hint = executor.journal.not_leader();
        let leader = hint
            .as_deref()
            .and_then(|hint| hint.split_whitespace().rfind(|w| w.starts_with("leader=")))
            .unwrap_or("leader=unknown");
        let message = format!(
            "the outcome is unknown: this node stopped leading before the request was \
             committed or confirmed; if it makes a change, that may still take effect (ask \
             the leader; an ACQUIRE sent again with its acquire id gets what the first send \
             got); {leader}"
        );
        return Response::Error {
            code: ErrorCode::NotLeader,
            message,
        };
    }
    let message = if undone {
        format!("not durable, nothing changed: {why}")
    } else {
        format!("not durable, the change may be lost: it holds until the server restarts: {why}")
    };
    Response::Error {
        code: ErrorCode::Unavailable,
        message,
    }
}

impl Executor {
    /// Takes back a change whose record never became durable; its requester is told so.
    /// Returns whether the live state is now as if the change had never been made.
    pub fn undo(self: &Arc<Self>, undo: Undo) -> bool {
        let now_ms = self.clock.now_ms();
        match undo {
            Undo::Grant { key, lease_id } => {
                let mut shard = self.shard(&key);
                // A grant that never was answers no repeat: one is a new ACQUIRE.
                if let Some(token) = shard.token_of(&key, lease_id) {
                    shard.forget_acquire_id(&key, token);
                }
                self.free(&mut shard, now_ms, &key, lease_id, FreeReason::Released);
                true
            }
            Undo::Release {
                key,
                lease_id,
                token,
                ttl_ms,
                logged,
                meta,
                acquire_id,
                kind,
            } => {
                let mut shard = self.shard(&key);
                // No grant can be made once the journal failed, so the key is free unless a
                // waiter's hand-off from this very release is not yet taken back, or the key
                // is kept for a waiter until fencing tokens are reserved (no holder, yet a
                // slot); then the release stands here, and a restart brings the lease back.
                let free = matches!(shard.inspect(now_ms, &key), table::Inspect::Free);
                if free && !shard.has_slot(&key) {
                    shard.restore_kind(now_ms, &key, lease_id, token, ttl_ms, kind, &meta);
                    shard.restore_logged_ttl(&key, token, logged);
                    if let Some(acquire_id) = acquire_id {
                        shard.note_acquire_id(token, acquire_id, crate::journal::TICKET_NOW);
                    }
                    // Watchers were told of the release; they learn the lease is back.
                    self.watches.notify(&key, EventKind::Granted, token, &meta);
                    true
                } else {
                    tracing::warn!("a release that failed to log could not be undone: the key is held or kept for a waiter");
                    false
                }
            }
            Undo::SessionOpen { session_id } => {
                self.undo_session_open(session_id);
                true
            }
        }
    }
}
