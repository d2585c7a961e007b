//! STATS: the counters (relaxed atomics bumped on the request path) and the reply's pairs,
//! gathered on demand from the counters, the shards, the tokens and the journal.

use std::sync::atomic::{AtomicU64, Ordering};

use tenure_protocol::Request;

use crate::executor::Executor;

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
    /// Acquires answered LOCKED (at once or after their wait ran out).
    pub locked: AtomicU64,
    /// Leases that ran out.
    pub expirations: AtomicU64,
    /// Requests answered with an ERROR.
    pub errors: AtomicU64,
    /// Latency, outcomes and the rest `/metrics` exports beyond these counters.
    pub metrics: crate::metrics::Metrics,
}

/// The request kinds counted, in the order STATS reports them.
pub const OP_KINDS: [&str; 11] = [
    "PING", "ACQUIRE", "RENEW", "RELEASE", "INSPECT", "CHECK", "STATS", "WATCH", "UNWATCH", "AUTH",
    "CLUSTER",
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

    /// Adds one to `counter`.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads `counter`.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Every STATS pair: held locks, waiters, connections, requests by kind, journal counters.
///
/// `held` counts lock slots in use: held leases, and leases past their deadline the ticker
/// has not reaped yet (the quota counts those until they are freed).
pub fn stats_pairs(executor: &Executor) -> Vec<(String, u64)> {
    let held = executor.quotas.held.count() as u64;
    let waiters = executor.quotas.waiters.count() as u64;
    let mut table_bytes = 0u64;
    for shard in executor.shards() {
        table_bytes += shard.lock().expect("shard poisoned").memory_bytes() as u64;
    }
    let s = &executor.stats;
    let tokens = &executor.tokens.allocator;
    let journal = executor.journal.stats();
    let mut pairs = vec![
        ("held".to_string(), held),
        ("waiters".to_string(), waiters),
        ("connections".to_string(), Stats::get(&s.connections)),
        ("watches".to_string(), executor.watches.len() as u64),
        ("grants".to_string(), Stats::get(&s.grants)),
        ("handoffs".to_string(), Stats::get(&s.handoffs)),
        ("locked".to_string(), Stats::get(&s.locked)),
        ("expirations".to_string(), Stats::get(&s.expirations)),
        ("errors".to_string(), Stats::get(&s.errors)),
        (
            "connections_total".to_string(),
            Stats::get(&s.connections_total),
        ),
        (
            "connections_refused".to_string(),
            Stats::get(&s.connections_refused),
        ),
        ("token_next".to_string(), tokens.next_token()),
        ("token_limit".to_string(), tokens.limit()),
        ("wal_records".to_string(), journal.records),
        ("wal_fsyncs".to_string(), journal.fsyncs),
        ("wal_bytes".to_string(), journal.bytes),
        ("table_bytes".to_string(), table_bytes),
        (
            "uptime_ms".to_string(),
            executor.clock.now_ms() + executor.uptime_offset_ms,
        ),
    ];
    pairs.extend(s.op_pairs());
    pairs
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
    };
    debug_assert_eq!(OP_KINDS[i], request.kind());
    i
}
