//! The STATS reply: its pairs, gathered on demand from the counters, the shards, the tokens
//! and the journal.

use super::Executor;
use crate::obs::stats::Stats;

/// Every STATS pair: held locks, waiters, connections, requests by kind, journal counters.
///
/// `held` counts lock slots in use: held leases, and leases past their deadline the ticker
/// has not reaped yet (the quota counts those until they are freed).
pub fn stats_pairs(executor: &Executor) -> Vec<(String, u64)> {
    let held = executor.quotas.held.count() as u64;
    let waiters = executor.quotas.waiters.count() as u64;
    let (mut table_bytes, mut acquire_ids, mut acquire_ids_ended) = (0u64, 0u64, 0u64);
    let mut shared_held = 0u64;
    for shard in executor.shards() {
        let shard = shard.lock().expect("shard poisoned");
        table_bytes += shard.memory_bytes() as u64;
        let (live, ended) = shard.acquire_ids_count();
        acquire_ids += live as u64;
        acquire_ids_ended += ended as u64;
        shared_held += shard.shared_holders_count() as u64;
    }
    let (sessions, session_leases) = executor.sessions.counts();
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
        ("acquire_ids".to_string(), acquire_ids),
        ("acquire_ids_ended".to_string(), acquire_ids_ended),
        ("repeats".to_string(), Stats::get(&s.repeats)),
        ("sessions".to_string(), sessions as u64),
        ("session_leases".to_string(), session_leases as u64),
        (
            "sessions_expired".to_string(),
            Stats::get(&executor.sessions.expired),
        ),
        (
            "sessions_closed".to_string(),
            Stats::get(&executor.sessions.closed),
        ),
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
    // After the request counts, so the pairs before them keep their places.
    pairs.extend([
        ("shared_held".to_string(), shared_held),
        ("shared_grants".to_string(), Stats::get(&s.shared_grants)),
        ("permit_grants".to_string(), Stats::get(&s.permit_grants)),
    ]);
    pairs
}
