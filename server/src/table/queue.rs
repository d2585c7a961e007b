//! The waiter queue of a key: queueing an acquire, timing waiters out, handing the lock to the
//! first live waiter (or deferring that until a token is available), and compacting the
//! queue as cancelled waiters pile up.

use super::extras;
use super::slot::{Queued, Timer};
use super::*;

impl<W: WaiterSink> LockTable<W> {
    /// Queues the request on a held (or reserved) key.
    pub(super) fn enqueue(
        &mut self,
        slot: usize,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
    ) -> Acquire<W> {
        if self.queue_len(slot) >= self.quotas.waiters_per_key_max {
            return Acquire::Full(Limit::WaitersPerKey);
        }
        if !self.quotas.waiters.try_take() {
            return Acquire::Full(Limit::Waiters);
        }
        let waiter_id = self.next_waiter_id;
        self.next_waiter_id += 1;
        let deadline_ms = now_ms + u64::from(args.wait_ms);
        let queued = Queued {
            waiter: Some(args.waiter.expect("checked: waiting needs a waiter")),
            waiter_id,
            lease_id: args.lease_id,
            ttl_ms: args.ttl_ms,
            deadline_ms,
            meta: args.meta.into(),
        };
        let extra = extras::get_or_insert(&mut self.slots, &mut self.extras, slot);
        extra.queue.push_back(queued);
        extra.live += 1;
        extra.wait_deadline_min_ms = extra.wait_deadline_min_ms.min(deadline_ms);
        self.waiters_count += 1;
        let timer = Timer {
            slot: slot as u32,
            stamp: waiter_id as u32,
        };
        self.insert_wait_timer(deadline_ms, timer);
        Acquire::Queued { waiter_id }
    }

    /// Removes the key's waiters whose wait ran out by `now_ms`, reporting each.
    pub(super) fn time_out_waiters(
        &mut self,
        slot: usize,
        now_ms: u64,
        events: &mut Vec<Event<W>>,
    ) {
        let Some(extra) = extras::get_mut(&self.slots, &mut self.extras, slot) else {
            return;
        };
        let lock = &self.slots[slot];
        if extra.wait_deadline_min_ms > now_ms {
            return;
        }
        let holder_token = lock.token;
        let ttl_left_ms = lock.deadline_ms.saturating_sub(now_ms);
        let key = lock.key(&self.keys);
        let mut wait_deadline_min_ms = u64::MAX;
        let mut timed_out = 0;
        // In place, in order: cancelled entries go too, live ones keep their FIFO positions.
        extra.queue.retain_mut(|queued| {
            let Some(waiter) = queued.waiter.take_if(|_| queued.deadline_ms <= now_ms) else {
                if queued.waiter.is_some() {
                    wait_deadline_min_ms = wait_deadline_min_ms.min(queued.deadline_ms);
                }
                return queued.waiter.is_some();
            };
            timed_out += 1;
            events.push(Event::WaitTimedOut {
                waiter,
                waiter_id: queued.waiter_id,
                key: key.into(),
                holder_token,
                ttl_left_ms,
            });
            false
        });
        extra.live -= timed_out;
        extra.wait_deadline_min_ms = wait_deadline_min_ms;
        self.waiters_left(timed_out);
        self.after_queue_shrank(slot);
    }

    /// Frees a reserved key whose queue emptied, and `extra` if it holds nothing.
    pub(super) fn after_queue_shrank(&mut self, slot: usize) {
        if self.slots[slot].deadline_ms == 0 && self.queue_len(slot) == 0 {
            self.free(slot);
        } else {
            extras::tidy(&mut self.slots, &mut self.extras, slot, false);
        }
    }

    /// Passes a lock whose lease is over (expired, released, or ended earlier) to the first
    /// live waiter. Timed-out waiters must have been removed already.
    pub(super) fn hand_off(
        &mut self,
        slot: usize,
        now_ms: u64,
        tokens: &TokenAllocator,
    ) -> HandoffStep<W> {
        if self.queue_len(slot) > 0 && tokens.remaining() > 0 {
            self.drop_dead_waiters(slot, now_ms);
        }
        if self.queue_len(slot) == 0 {
            self.free(slot);
            return HandoffStep::Freed;
        }
        let Some(token) = tokens.try_next() else {
            if self.slots[slot].deadline_ms != 0 {
                self.defer(slot);
            }
            return HandoffStep::Deferred;
        };
        let extra =
            extras::get_mut(&self.slots, &mut self.extras, slot).expect("queue is not empty");
        let queued = extra.queue.pop_front().expect("queue is not empty");
        let waiter = queued
            .waiter
            .expect("the head of a queue is never cancelled");
        assert!(
            queued.deadline_ms > now_ms,
            "handing off to a timed-out waiter"
        );
        extra.live -= 1;
        extra.drop_cancelled();
        extras::set_meta(&mut self.slots, &mut self.extras, slot, queued.meta.clone());
        extras::tidy(&mut self.slots, &mut self.extras, slot, false);
        let key: Box<[u8]> = self.slots[slot].key(&self.keys).into();
        self.waiters_left(1);
        let grant = Grant {
            token,
            lease_id: queued.lease_id,
            ttl_ms: queued.ttl_ms,
        };
        self.start_lease(slot, now_ms, grant);
        HandoffStep::Granted(Handoff {
            waiter,
            waiter_id: queued.waiter_id,
            grant,
            key,
            meta: queued.meta,
            kind: tenure_protocol::LeaseKind::Exclusive,
        })
    }

    /// Ends the slot's lease without a successor, reserving the key for its waiters until a
    /// token is available.
    pub(super) fn defer(&mut self, slot: usize) {
        self.disarm_lease(slot);
        self.slots[slot].deadline_ms = 0;
        self.deferred.push(slot as u32);
        if self.deferred.len() > self.slots.len() {
            // Stale and repeated numbers: keep one entry per reserved slot, so the list stays
            // within the slab's size.
            let slots = &self.slots;
            self.deferred.sort_unstable();
            self.deferred.dedup();
            self.deferred.retain(|&slot| {
                slots[slot as usize].token != 0 && slots[slot as usize].deadline_ms == 0
            });
        }
    }

    /// Drops waiters at the head of the queue that nobody listens to any more.
    pub(super) fn drop_dead_waiters(&mut self, slot: usize, now_ms: u64) {
        let Some(extra) = extras::get_mut(&self.slots, &mut self.extras, slot) else {
            return;
        };
        let mut dropped = 0;
        while extra.queue.front().is_some_and(|queued| {
            queued
                .waiter
                .as_ref()
                .is_some_and(|w| !w.is_live_at(now_ms))
        }) {
            extra.queue.pop_front();
            extra.live -= 1;
            extra.drop_cancelled();
            dropped += 1;
        }
        self.waiters_left(dropped);
    }
}
