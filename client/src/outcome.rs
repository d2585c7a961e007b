//! What the server's answers mean, as types: the outcome of each request (LOCKED, LOST,
//! NOT_OWNER and STALE are outcomes, not errors) and the events of a watch. Plain data below
//! the connection, so that the connection, leases, watches and the client all speak it
//! without importing one another. [`AcquireOutcome`](crate::AcquireOutcome) lives with
//! [`Lease`](crate::Lease), its default payload.

use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::{EventKind, Response};

use crate::error::{unexpected, Result};

/// The current holder of a lock, as reported to an acquire that did not get it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockedBy {
    /// The holder's fencing token.
    pub token: u64,
    /// Time left on the holder's lease, by the server's clock.
    pub ttl_left: Duration,
}

/// The answer to a renew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The lease now runs `ttl` from the server's receipt of the renewal.
    Renewed {
        /// The lease length granted.
        ttl: Duration,
    },
    /// The lease is gone (expired, released, or never this lease id's): stop working.
    Lost,
}

/// The answer to a release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The lock was released.
    Released,
    /// The lease id does not hold the lock (it expired or was released); nothing changed.
    NotOwner,
}

/// The answer to an inspect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// Nobody holds the key.
    Free,
    /// The key is held.
    Held {
        /// The holder's fencing token.
        token: u64,
        /// Time left on the holder's lease, by the server's clock.
        ttl_left: Duration,
        /// Acquires waiting in line.
        waiters: u32,
        /// The holder's metadata.
        meta: Bytes,
    },
}

/// The answer to a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckOutcome {
    /// The token belongs to the live holder.
    Current,
    /// The token does not belong to the live holder.
    Stale,
}

/// One change to a watched key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// What happened.
    pub kind: EventKind,
    /// The key that changed.
    pub key: Bytes,
    /// The fencing token of the lease granted, released or expired.
    pub token: u64,
    /// The new holder's metadata (empty unless `kind` is `Granted`).
    pub meta: Bytes,
}

/// The outcome a RENEW's answer means; an ERROR or an answer that fits no renewal is an
/// error.
pub(crate) fn renew_outcome(response: Response) -> Result<RenewOutcome> {
    match response {
        Response::Renewed { ttl_ms } => Ok(RenewOutcome::Renewed {
            ttl: Duration::from_millis(u64::from(ttl_ms)),
        }),
        Response::Lost => Ok(RenewOutcome::Lost),
        other => Err(unexpected("RENEW", other)),
    }
}
