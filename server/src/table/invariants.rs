//! `LockTable::check_invariants`: every piece of the table's bookkeeping, checked against the
//! others. Tests and the simulation call it after every step; it is O(n log n) in the table
//! size and uses sorted vectors rather than hash sets, which are slow in debug builds.

use super::extras;
use super::keys::KeyRef;
use super::{LockTable, Slot, Timer, WaiterSink};
use tenure_protocol::limits::{KEY_LEN_MAX, META_LEN_MAX, TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};

impl<W: WaiterSink> LockTable<W> {
    /// Panics with a description of the first broken invariant: slab, free list, index and
    /// wheels agree; counts match; every running lease, and nothing else, is filed in the
    /// lease wheel at or before its deadline; every waiter has its timer; waiter ids are unique; queues only on keys with
    /// a slot; reserved keys have waiters and are on the deferred list.
    pub fn check_invariants(&self) {
        self.check_acquire_ids();
        let timers = self.timers_sorted();
        self.check_lease_timers();
        let mut free = vec![false; self.slots.len()];
        for &slot in &self.free_slots {
            assert!(
                !std::mem::replace(&mut free[slot as usize], true),
                "slot {slot} free twice"
            );
        }
        let mut waiter_ids = Vec::with_capacity(self.waiters_count);
        let mut used = 0;
        for (number, lock) in self.slots.iter().enumerate() {
            if lock.token == 0 {
                assert!(free[number], "free slot {number} not on the free list");
                assert!(
                    lock.key_ref == KeyRef::NONE && lock.key_len == 0 && !lock.link.is_linked(),
                    "free slot {number} has data"
                );
                continue;
            }
            assert!(!free[number], "slot {number} in use and on the free list");
            used += 1;
            self.check_lock(number, lock);
            self.check_queue(number, &timers, &mut waiter_ids);
        }
        assert_eq!(used, self.index.len(), "slots in use vs index entries");
        self.check_counts(used, &free);
        assert_eq!(waiter_ids.len(), self.waiters_count, "waiters_count is off");
        waiter_ids.sort_unstable();
        assert!(
            waiter_ids.windows(2).all(|pair| pair[0] != pair[1]),
            "a waiter id is queued twice"
        );
        // Other shards may share the quotas, so this table's counts are at most theirs.
        assert!(
            self.waiters_count + self.shared.waiters_count() <= self.quotas.waiters.count(),
            "waiters not counted in the quota"
        );
        assert!(
            self.index.len() + self.shared.holders_count() <= self.quotas.held.count(),
            "held locks not counted in the quota"
        );
        self.check_shared_invariants();
        self.check_one_lease_slots();
        let slab_len = self.slots.len();
        assert!(
            self.deferred.iter().all(|&slot| (slot as usize) < slab_len),
            "deferred slot out of range"
        );
    }

    /// Long keys, extras and index entries agree with the `used` slots in use; `free` marks
    /// the slots on the free list.
    fn check_counts(&self, used: usize, free: &[bool]) {
        let long = self
            .slots
            .iter()
            .filter(|lock| lock.token != 0 && lock.key_in_arena())
            .count();
        assert_eq!(
            long,
            self.keys.len(),
            "slots with long keys vs keys in the arena"
        );
        let flagged = self
            .slots
            .iter()
            .filter(|lock| lock.key_ref.has_extra())
            .count();
        assert_eq!(
            flagged,
            self.extras.len(),
            "slots flagged with extras vs extras"
        );
        let mut indexed: Vec<u32> = self.index.slots().collect();
        indexed.sort_unstable();
        indexed.dedup();
        assert_eq!(indexed.len(), used, "index has duplicate slot numbers");
        assert!(
            indexed.iter().all(|&slot| !free[slot as usize]),
            "index points at a free slot"
        );
    }

    /// The lease wheel's lists are consistent and hold exactly the running leases (a slot in
    /// use not reserved for a handoff), each filed no later than its deadline.
    fn check_lease_timers(&self) {
        let filed = self.lease_timers.nodes(&self.slots);
        for &(slot, floor_ms) in &filed {
            let lock = &self.slots[slot as usize];
            assert!(
                lock.token != 0 && lock.deadline_ms != 0,
                "slot {slot}: a lease timer without a running lease"
            );
            assert!(
                lock.deadline_ms >= floor_ms,
                "slot {slot}: lease timer filed after its deadline"
            );
        }
        let running = self
            .slots
            .iter()
            .filter(|lock| lock.token != 0 && lock.deadline_ms != 0)
            .count();
        assert_eq!(filed.len(), running, "running leases vs lease timers");
    }

    /// All pending waiter timers with their deadlines, sorted by timer then deadline.
    fn timers_sorted(&self) -> Vec<(Timer, u64)> {
        let mut timers: Vec<(Timer, u64)> = self
            .wait_timers
            .iter()
            .map(|(deadline_ms, timer)| (*timer, deadline_ms))
            .collect();
        for (timer, _) in &timers {
            let slot = timer.slot as usize;
            assert!(
                slot < self.slots.len(),
                "timer for slot {slot} beyond the slab"
            );
        }
        timers.sort_unstable_by_key(|&(timer, deadline_ms)| (timer.slot, timer.stamp, deadline_ms));
        timers
    }

    /// Checks one slot in use, apart from its queue.
    fn check_lock(&self, number: usize, lock: &Slot<W>) {
        let key = lock.key(&self.keys);
        assert!(key.len() <= KEY_LEN_MAX, "slot {number}: key too long");
        assert_eq!(
            self.find(key),
            Some(number),
            "slot {number}: key {key:?} not indexed to it"
        );
        assert!(
            self.meta(number).len() <= META_LEN_MAX,
            "slot {number}: meta too long"
        );
        assert!(
            (TTL_MS_MIN..=TTL_MS_MAX).contains(&lock.logged.ttl_ms()),
            "slot {number}: logged ttl_ms"
        );
        assert!(
            !lock.logged.is_pending() || self.renewal_lsn_max > 0,
            "slot {number}: a renewal record pending, yet none was logged"
        );
        if let Some(extra) = extras::get(&self.slots, &self.extras, number) {
            assert!(
                !extra.meta.is_empty() || !extra.queue.is_empty(),
                "slot {number}: empty extra"
            );
        }
        if lock.deadline_ms == 0 {
            assert!(
                self.queue_len(number) > 0,
                "slot {number}: reserved for a handoff but no waiters"
            );
            assert!(
                self.deferred.contains(&(number as u32)),
                "slot {number}: reserved, not deferred"
            );
            return;
        }
        assert!(
            lock.link.is_linked(),
            "slot {number}: a running lease without a timer"
        );
    }

    /// Checks one slot's queue, collecting its waiter ids.
    fn check_queue(&self, number: usize, timers: &[(Timer, u64)], waiter_ids: &mut Vec<u64>) {
        let Some(extra) = extras::get(&self.slots, &self.extras, number) else {
            return;
        };
        assert!(
            extra.live <= self.quotas.waiters_per_key_max,
            "slot {number}: queue too long"
        );
        let live = extra.queue.iter().filter(|q| q.waiter.is_some()).count();
        assert_eq!(live, extra.live, "slot {number}: live waiters miscounted");
        assert!(
            extra.queue.len() - live <= live + super::CANCELLED_SLACK,
            "slot {number}: cancelled waiters not compacted"
        );
        assert!(
            extra.queue.front().is_none_or(|q| q.waiter.is_some()),
            "slot {number}: a cancelled waiter at the head"
        );
        assert!(
            extra
                .queue
                .iter()
                .zip(extra.queue.iter().skip(1))
                .all(|(a, b)| a.waiter_id < b.waiter_id),
            "slot {number}: queue not in waiter id order"
        );
        for queued in extra.queue.iter().filter(|q| q.waiter.is_some()) {
            let id = queued.waiter_id;
            waiter_ids.push(id);
            assert!(
                id < self.next_waiter_id,
                "waiter id {id} not handed out yet"
            );
            assert!(
                queued.deadline_ms >= extra.wait_deadline_min_ms,
                "slot {number}: wait minimum"
            );
            assert!(
                queued.deadline_ms <= self.now_ms + u64::from(WAIT_MS_MAX),
                "waiter {id}: deadline"
            );
            assert!(
                (TTL_MS_MIN..=TTL_MS_MAX).contains(&queued.ttl_ms),
                "waiter {id}: ttl_ms"
            );
            let timer = Timer {
                slot: number as u32,
                stamp: id as u32,
            };
            let armed = deadlines_of(timers, timer)
                .iter()
                .any(|&(_, d)| d == queued.deadline_ms);
            assert!(
                armed,
                "waiter {id} on slot {number} has no timer at its deadline"
            );
        }
    }
}

/// The entries of `timer` in a sorted timer list.
fn deadlines_of(timers: &[(Timer, u64)], timer: Timer) -> &[(Timer, u64)] {
    let key = (timer.slot, timer.stamp);
    let start = timers.partition_point(|(t, _)| (t.slot, t.stamp) < key);
    let end = timers.partition_point(|(t, _)| (t.slot, t.stamp) <= key);
    &timers[start..end]
}
