//! [`Change`]: one change to the durable state, as the executor describes it to a journal,
//! and the one builder of its [`Record`].
use tenure_protocol::{AcquireId, LeaseId, LeaseKind, SessionId};

use super::codec::{
    FreeReason, Record, SessionEnd, GRANT_FLAG_ACQUIRE_ID, GRANT_FLAG_RELEASE_ON_DISCONNECT,
    GRANT_FLAG_SESSION,
};

/// A held lease as the journal records it: by a live grant, a hand-off, or a snapshot.
#[derive(Clone, Copy, Debug)]
pub struct Lease<'a> {
    /// The lock.
    pub key: &'a [u8],
    /// The lease.
    pub lease_id: LeaseId,
    /// Its fencing token.
    pub token: u64,
    /// Its length, in milliseconds.
    pub ttl_ms: u32,
    /// Whether it is released when its connection closes.
    pub release_on_disconnect: bool,
    /// Holder metadata.
    pub meta: &'a [u8],
    /// The ACQUIRE's acquire id, if it had one: a repeat of it is answered with this lease.
    pub acquire_id: Option<AcquireId>,
    /// The session it is in, if any: it lives while the session lives.
    pub session_id: Option<SessionId>,
    /// What it holds: the key alone, a shared (read) lease, or semaphore permits.
    pub kind: LeaseKind,
}

/// One change to the durable state.
#[derive(Clone, Copy, Debug)]
pub enum Change<'a> {
    /// A lease was granted.
    Grant(Lease<'a>),
    /// The lease holding `key` with `token` ended.
    Free {
        /// The lock.
        key: &'a [u8],
        /// The ended lease's token.
        token: u64,
        /// Why it ended.
        reason: FreeReason,
    },
    /// Fencing tokens below `token_limit` may be handed out.
    Reserve {
        /// The new limit.
        token_limit: u64,
    },
    /// The lease holding `key` with `token` was renewed to `ttl_ms`, longer than its last
    /// record said: a restart must give it that much.
    Renew {
        /// The lock.
        key: &'a [u8],
        /// The renewed lease's token.
        token: u64,
        /// Its new length, in milliseconds.
        ttl_ms: u32,
    },
    /// A session was opened (logged before any grant in it).
    SessionOpen {
        /// The session.
        session_id: SessionId,
        /// Its TTL, fixed at open.
        ttl_ms: u32,
        /// The identity that opened it; empty without identities.
        owner: &'a [u8],
    },
    /// A session ended, and with it every lease still in it.
    SessionEnd {
        /// The session.
        session_id: SessionId,
        /// How.
        how: SessionEnd,
    },
}

impl<'a> Change<'a> {
    /// The WAL record of this change: the one builder of Grant, Free, Reserve, Renew and
    /// session records.
    pub fn record(&self) -> Record<'a> {
        match *self {
            Change::Grant(lease) => Record::Grant {
                key: lease.key,
                lease_id: lease.lease_id.0,
                token: lease.token,
                ttl_ms: lease.ttl_ms,
                flags: grant_flags(&lease),
                meta: lease.meta,
                acquire_id: lease.acquire_id.map(|id| id.0),
                session_id: lease.session_id.map(|id| id.0),
                kind: lease.kind,
            },
            Change::Free { key, token, reason } => Record::Free { key, token, reason },
            Change::Reserve { token_limit } => Record::Reserve { token_limit },
            Change::Renew { key, token, ttl_ms } => Record::Renew { key, token, ttl_ms },
            Change::SessionOpen {
                session_id,
                ttl_ms,
                owner,
            } => Record::SessionOpen {
                session_id: session_id.0,
                ttl_ms,
                owner,
            },
            Change::SessionEnd { session_id, how } => Record::SessionEnd {
                session_id: session_id.0,
                how,
            },
        }
    }
}

fn grant_flags(lease: &Lease<'_>) -> u8 {
    let mut flags = 0;
    if lease.release_on_disconnect {
        flags |= GRANT_FLAG_RELEASE_ON_DISCONNECT;
    }
    if lease.acquire_id.is_some() {
        flags |= GRANT_FLAG_ACQUIRE_ID;
    }
    if lease.session_id.is_some() {
        flags |= GRANT_FLAG_SESSION;
    }
    flags
}
