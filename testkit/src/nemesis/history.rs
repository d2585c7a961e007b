//! The client-side history: every operation the load and the probes sent, with an instant
//! taken before sending and one at the answer, and what the answer was.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tenure::{Error, ErrorCode, LeaseId, LeaseKind};

/// The `client` of operations sent by the harness's probes rather than by the load.
pub const PROBE_CLIENT: usize = usize::MAX;

/// What was asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// ACQUIRE, waiting in line up to `wait_ms` (0: no wait), of a lease of `lease_kind`:
    /// the key alone (a lock, or a write lease), a read lease, or semaphore permits.
    Acquire {
        /// The TTL asked for.
        ttl_ms: u32,
        /// The wait asked for.
        wait_ms: u32,
        /// The kind of lease asked for (PROTOCOL.md 3.10).
        lease_kind: LeaseKind,
    },
    /// RENEW of `lease` to `ttl_ms`.
    Renew {
        /// The lease renewed.
        lease: LeaseId,
        /// The TTL asked for.
        ttl_ms: u32,
    },
    /// RELEASE of `lease`.
    Release {
        /// The lease released.
        lease: LeaseId,
    },
    /// INSPECT.
    Inspect,
    /// CHECK of `token`: does it belong to a lease holding the key now?
    Check {
        /// The token asked about.
        token: u64,
    },
}

/// What came back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// ACQUIRE granted.
    Granted {
        /// Fencing token.
        token: u64,
        /// Lease id.
        lease: LeaseId,
        /// TTL granted.
        ttl_ms: u32,
        /// Time in line, by the server's clock.
        waited_ms: u32,
    },
    /// ACQUIRE refused: the key is held by `token`.
    Locked {
        /// The holder's token.
        token: u64,
    },
    /// RENEW confirmed.
    Renewed {
        /// TTL granted.
        ttl_ms: u32,
    },
    /// RENEW refused: the lease is gone.
    Lost,
    /// RELEASE done.
    Released,
    /// RELEASE refused: the lease does not hold the key.
    NotOwner,
    /// INSPECT: nobody holds the key.
    Free,
    /// INSPECT: the key is held by `token`.
    Held {
        /// The holder's token.
        token: u64,
    },
    /// CHECK: the token belongs to a lease holding the key.
    Current,
    /// CHECK: the token belongs to no lease holding the key.
    Stale,
    /// A definite failure: the server refused, nothing changed.
    Failed(String),
    /// No answer, or NOT_LEADER: a write may or may not have taken effect (PROTOCOL.md 3.8).
    Unknown(String),
}

impl Outcome {
    /// The outcome of a request that ended in `error`: unknown unless the server said no.
    pub fn from_error(error: &Error) -> Outcome {
        match error {
            Error::Server {
                code: ErrorCode::NotLeader,
                message,
            } => Outcome::Unknown(format!("NOT_LEADER {message}")),
            Error::Server { .. }
            | Error::Invalid { .. }
            | Error::KindMismatch(_)
            | Error::BadPermits(_) => Outcome::Failed(error.to_string()),
            _ => Outcome::Unknown(error.to_string()),
        }
    }
}

/// One operation of the history.
#[derive(Clone, Debug)]
pub struct Op {
    /// Which load task sent it ([`PROBE_CLIENT`] for the harness's probes).
    pub client: usize,
    /// The key.
    pub key: String,
    /// What was asked.
    pub kind: Kind,
    /// Taken before the request was sent.
    pub sent: Instant,
    /// Taken when the answer (or the failure) arrived.
    pub answered: Instant,
    /// What came back.
    pub outcome: Outcome,
}

/// The shared, append-only history of one run.
#[derive(Clone, Default)]
pub struct History(Arc<Mutex<Vec<Op>>>);

impl History {
    /// Appends `op`.
    pub fn record(&self, op: Op) {
        self.0.lock().expect("history mutex poisoned").push(op);
    }

    /// A copy of every operation so far.
    pub fn snapshot(&self) -> Vec<Op> {
        self.0.lock().expect("history mutex poisoned").clone()
    }

    /// The answer instant of the first acknowledged grant sent at or after `since`.
    pub fn first_grant_since(&self, since: Instant) -> Option<Instant> {
        let ops = self.0.lock().expect("history mutex poisoned");
        ops.iter()
            .filter(|op| op.sent >= since && matches!(op.outcome, Outcome::Granted { .. }))
            .map(|op| op.answered)
            .min()
    }
}
