//! STATS' counters: relaxed atomics bumped on the request path. The reply's pairs are
//! gathered by the executor (`executor::stats_pairs`), which owns what they count.

use std::sync::atomic::{AtomicU64, Ordering};

use tenure_protocol::Request;

/// Server-wide counters. Held locks and waiters are not kept here: they are read from the
/// shards, which own the truth.
#[derive(Default)]
pub struct Stats {
    /// Open client connections.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// Connections refused at the connection limit.
    pub connections_refused: AtomicU64,
    /// Requests by kind, indexed by [`Stats::slot`].
    ops: [AtomicU64; OP_KINDS.len()],
    /// Grants, including hand-offs to waiters.
    pub grants: AtomicU64,
    /// Grants handed straight to a waiter on release or expiry.
    pub handoffs: AtomicU64,
    /// Grants of shared (read) leases, hand-offs included.
    pub shared_grants: AtomicU64,
    /// Grants of semaphore permit leases, hand-offs included.
    pub permit_grants: AtomicU64,
    /// Acquires answered LOCKED (at once or after their wait ran out).
    pub locked: AtomicU64,
    /// Leases that ran out.
    pub expirations: AtomicU64,
    /// ACQUIREs answered as repeats of an earlier one with the same acquire id (REGRANTED or
    /// ACQUIRE_ENDED).
    pub repeats: AtomicU64,
    /// Requests answered with an ERROR.
    pub errors: AtomicU64,
    /// Latency, outcomes and the rest `/metrics` exports beyond these counters.
    pub metrics: super::metrics::Metrics,
}

/// The request kinds counted, in the order STATS reports them.
pub const OP_KINDS: [&str; 12] = [
    "PING", "ACQUIRE", "RENEW", "RELEASE", "INSPECT", "CHECK", "STATS", "WATCH", "UNWATCH", "AUTH",
    "CLUSTER", "SESSION",
];

impl Stats {
    /// Counts one request, by kind.
    pub fn count_op(&self, request: &Request) {
        let i = op_index(request);
        self.ops[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Name/value pairs for every request kind, as `ops_<kind>`.
    pub fn op_pairs(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        OP_KINDS.iter().zip(&self.ops).map(|(kind, n)| {
            (
                format!("ops_{}", kind.to_ascii_lowercase()),
                n.load(Ordering::Relaxed),
            )
        })
    }

    /// Counts a grant of `kind` beyond `grants` (shared and permit grants have their own).
    pub fn count_kind_grant(&self, kind: tenure_protocol::LeaseKind) {
        match kind {
            tenure_protocol::LeaseKind::Exclusive => {}
            tenure_protocol::LeaseKind::Shared => Self::bump(&self.shared_grants),
            tenure_protocol::LeaseKind::Permits { .. } => Self::bump(&self.permit_grants),
        }
    }

    /// Adds one to `counter`.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads `counter`.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The request's place in [`OP_KINDS`]: the index of its counter here and of its series in
/// the metrics. A match rather than a search, so the hot path does no string work.
pub fn op_index(request: &Request) -> usize {
    let i = match request {
        Request::Ping => 0,
        Request::Acquire { .. } => 1,
        Request::Renew { .. } => 2,
        Request::Release { .. } => 3,
        Request::Inspect { .. } => 4,
        Request::Check { .. } => 5,
        Request::Stats => 6,
        Request::Watch { .. } => 7,
        Request::Unwatch { .. } => 8,
        Request::Auth { .. } => 9,
        Request::ClusterStatus { .. }
        | Request::ClusterInit { .. }
        | Request::ClusterAdd { .. }
        | Request::ClusterRemove { .. } => 10,
        Request::SessionOpen { .. }
        | Request::SessionKeepalive { .. }
        | Request::SessionClose { .. } => 11,
    };
    debug_assert_eq!(OP_KINDS[i], request.kind());
    i
}
