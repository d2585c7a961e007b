//! A lease's life inside the table: finding a key's slot, granting a free key, arming the
//! lease's timer, firing timers, settling a key whose lease or waits ran out, freeing it.

use super::index::KeyBytes;
use super::slot::{timer_is_live, LoggedTtl, Timer};
use super::*;

impl<W: WaiterSink> LockTable<W> {
    /// Moves the table's time forward to `now_ms` (never back) and returns the table's time.
    pub(super) fn observe(&mut self, now_ms: u64) -> u64 {
        self.now_ms = self.now_ms.max(now_ms);
        self.now_ms
    }

    /// The slot of `key`, if it has one.
    pub(super) fn find(&self, key: &[u8]) -> Option<usize> {
        let hash = hash_key(self.hash_seed, key);
        let found = self
            .index
            .find(hash, |slot| self.slots[slot as usize].key.as_slice() == key);
        found.map(|slot| slot as usize)
    }

    /// Grants a key that has no slot, if limits and tokens allow.
    pub(super) fn grant_free(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        tokens: &TokenAllocator,
    ) -> Acquire<W> {
        if !self.quotas.held.try_take() {
            return Acquire::Full(Limit::HeldLocks);
        }
        let Some(token) = tokens.try_next() else {
            self.quotas.held.give_back(1);
            return Acquire::TokensExhausted {
                waiter: args.waiter,
            };
        };
        let grant = Grant {
            token,
            lease_id: args.lease_id,
            ttl_ms: args.ttl_ms,
        };
        self.install(now_ms, args.key, grant, args.meta.into());
        Acquire::Granted(grant)
    }

    /// Gives `key` a slot holding `grant` from `now_ms`, with its timer armed.
    pub(super) fn install(&mut self, now_ms: u64, key: &[u8], grant: Grant, meta: Box<[u8]>) {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot as usize,
            None => {
                if self.slots.len() == self.slots.capacity() {
                    // Grow by an eighth, not double: the slab is most of a lock's memory, and
                    // this bounds the unused tail to ~12% while staying amortized O(1).
                    self.slots.reserve_exact(self.slots.len() / 8 + 64);
                }
                self.slots.push(Slot::vacant(0));
                self.slots.len() - 1
            }
        };
        let lock = &mut self.slots[slot];
        assert!(lock.token == 0, "slot {slot} on the free list is in use");
        lock.key = KeyBytes::new(key);
        lock.set_meta(meta);
        self.index
            .insert(hash_key(self.hash_seed, key), slot as u32);
        self.start_lease(slot, now_ms, grant);
    }

    /// Makes `grant` the slot's lease from `now_ms` and arms its timer.
    pub(super) fn start_lease(&mut self, slot: usize, now_ms: u64, grant: Grant) {
        let lock = &mut self.slots[slot];
        lock.token = grant.token;
        lock.lease_id = grant.lease_id;
        lock.logged = LoggedTtl::settled(grant.ttl_ms);
        lock.deadline_ms = now_ms + u64::from(grant.ttl_ms);
        self.arm_lease(slot);
    }

    /// Arms a timer at the lease's deadline; earlier timers of the slot become stale.
    pub(super) fn arm_lease(&mut self, slot: usize) {
        let lock = &mut self.slots[slot];
        lock.generation = lock.generation.wrapping_add(1);
        let timer = Timer {
            slot: slot as u32,
            stamp: lock.generation,
        };
        let deadline_ms = lock.deadline_ms;
        self.insert_timer(deadline_ms, timer);
    }

    /// Adds a timer, first compacting the wheel if stale timers have piled up.
    pub(super) fn insert_timer(&mut self, deadline_ms: u64, timer: Timer) {
        let live_max = 2 * (self.index.len() + self.waiters_count) + TIMERS_STALE_MIN;
        if self.wheel.len() >= live_max {
            let slots = &self.slots;
            self.wheel
                .retain(|deadline_ms, timer| timer_is_live(slots, deadline_ms, timer));
        }
        self.wheel.insert(deadline_ms, timer);
    }

    /// Returns the key's slot to the free list.
    pub(super) fn free(&mut self, slot: usize) {
        let lock = &self.slots[slot];
        assert!(
            lock.extra
                .as_ref()
                .is_none_or(|extra| extra.queue.is_empty()),
            "freeing slot {slot} with waiters"
        );
        self.index
            .remove(hash_key(self.hash_seed, lock.key.as_slice()), slot as u32);
        self.quotas.held.give_back(1);
        let generation = lock.generation.wrapping_add(1);
        self.slots[slot] = Slot::vacant(generation);
        self.free_slots.push(slot as u32);
    }

    /// Handles one fired timer: drops stale ones, re-arms renewed leases, settles the rest.
    pub(super) fn fire(
        &mut self,
        timer: Timer,
        now_ms: u64,
        tokens: &TokenAllocator,
        out: &mut Vec<Event<W>>,
    ) {
        let slot = (timer.slot & !WAIT_TIMER_BIT) as usize;
        let lock = &self.slots[slot];
        if lock.token == 0 {
            return;
        }
        if timer.slot & WAIT_TIMER_BIT == 0 {
            if lock.generation != timer.stamp {
                return;
            }
            if lock.deadline_ms > now_ms {
                // Renewed since the timer was armed: lazily move it to the new deadline.
                let deadline_ms = lock.deadline_ms;
                self.insert_timer(deadline_ms, timer);
                return;
            }
        }
        self.settle(slot, now_ms, tokens, out);
    }

    /// Brings a key up to date at `now_ms`: times out waiters whose wait ran out, then, if the
    /// lease is over, hands the lock to the next live waiter or frees the key.
    pub(super) fn settle(
        &mut self,
        slot: usize,
        now_ms: u64,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) {
        self.time_out_waiters(slot, now_ms, events);
        let lock = &self.slots[slot];
        if lock.token == 0 || lock.deadline_ms > now_ms {
            return;
        }
        let already_ended = lock.deadline_ms == 0;
        let token = lock.token;
        let lease_id = lock.lease_id;
        let key: Box<[u8]> = if already_ended {
            Box::default()
        } else {
            lock.key.as_slice().into()
        };
        match self.hand_off(slot, now_ms, tokens) {
            HandoffStep::Granted(handoff) if already_ended => {
                events.push(Event::HandedOff(handoff))
            }
            HandoffStep::Granted(handoff) => events.push(Event::Expired {
                key,
                token,
                lease_id,
                handoff: Some(handoff),
            }),
            HandoffStep::Freed | HandoffStep::Deferred if !already_ended => {
                events.push(Event::Expired {
                    key,
                    token,
                    lease_id,
                    handoff: None,
                })
            }
            HandoffStep::Freed | HandoffStep::Deferred => {}
        }
    }
}
