//! The expiry ticker: leases expire and waiters time out here, and snapshots are started.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Executor;

/// Expires leases and times out waiters, every `tick_interval`, bounded per shard per pass.
/// Snapshots run on blocking threads tracked by `snapshots`.
pub async fn tick(shared: Arc<Executor>, stop: CancellationToken, snapshots: TaskTracker) {
    let mut interval = tokio::time::interval(shared.config().tick_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let budget = shared.config().expirations_per_tick_max;
    let mut events = Vec::new();
    let snapshotting = Arc::new(AtomicBool::new(false));
    while !stop.is_cancelled() {
        interval.tick().await;
        let now_ms = shared.clock().now_ms();
        // Sessions first: an ended session's waiters leave their queues before the shards'
        // expiries hand keys on (the table would skip them anyway, unanswered till then).
        shared.reap_sessions(now_ms);
        for shard in shared.shards() {
            let mut shard = shard.lock().expect("shard poisoned");
            // Whatever the budget leaves is picked up on the next tick.
            shard.advance(now_ms, budget, &shared.tokens().allocator, &mut events);
            shared.apply_events(&mut shard, now_ms, &mut events);
        }
        // The copy takes a while at a million locks: run it on a blocking thread, one at a
        // time, so neither the ticker nor a runtime worker waits for it.
        if shared.journal().snapshot_due() && !snapshotting.swap(true, Ordering::AcqRel) {
            let (shared, snapshotting) = (Arc::clone(&shared), Arc::clone(&snapshotting));
            snapshots.spawn_blocking(move || {
                shared.journal().snapshot(&*shared);
                snapshotting.store(false, Ordering::Release);
            });
        }
    }
}
