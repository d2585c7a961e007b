//! A lease's life inside the table: finding a key's slot, granting a free key, arming the
//! lease's timer, firing timers, settling a key whose lease or waits ran out, freeing it.

use super::extras;
use super::slot::{timer_is_live, LoggedTtl, Timer};
use super::*;
use tenure_protocol::EndedHow;

impl<W: WaiterSink> LockTable<W> {
    /// Moves the table's time forward to `now_ms` (never back) and returns the table's time.
    pub(super) fn observe(&mut self, now_ms: u64) -> u64 {
        self.now_ms = self.now_ms.max(now_ms);
        self.now_ms
    }

    /// The slot of `key`, if it has one.
    pub(super) fn find(&self, key: &[u8]) -> Option<usize> {
        self.find_hashed(hash_key(self.hash_seed, key), key)
    }

    /// The slot of `key`, whose hash is `hash`, if it has one: for a caller that needs the
    /// hash again (the acquire-id lookups), so the key is hashed once.
    pub(super) fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<usize> {
        let found = self.index.find(hash, |slot| {
            self.slots[slot as usize].key(&self.keys) == key
        });
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
        // An ACQUIRE with an acquire id granted here (`acquire_with_id`) gets a lease id
        // derived from it, so its repeats and its end need no table of their own.
        let derived = self.acquire_ids.derive_next.take();
        let lease_id = match derived {
            Some(acquire_id) => self.lease_ids.derive(acquire_id, token),
            None => args.lease_id,
        };
        let grant = Grant {
            token,
            lease_id,
            ttl_ms: args.ttl_ms,
        };
        let slot = self.install(now_ms, args.key, grant, args.meta.into());
        if derived.is_some() {
            let lock = &mut self.slots[slot];
            lock.logged = lock.logged.with_derived(true);
            self.acquire_ids.derived_last = token;
        }
        Acquire::Granted(grant)
    }

    /// Gives `key` a slot holding `grant` from `now_ms`, with its timer armed.
    pub(super) fn install(
        &mut self,
        now_ms: u64,
        key: &[u8],
        grant: Grant,
        meta: Box<[u8]>,
    ) -> usize {
        let slot = match self.free_slots.pop() {
            Some(slot) => slot as usize,
            None => self.slots.push(Slot::vacant()),
        };
        let lock = &mut self.slots[slot];
        assert!(lock.token == 0, "slot {slot} on the free list is in use");
        lock.set_key(key, &mut self.keys);
        extras::set_meta(&mut self.slots, &mut self.extras, slot, meta);
        self.index
            .insert(hash_key(self.hash_seed, key), slot as u32);
        self.start_lease(slot, now_ms, grant);
        slot
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

    /// Files the lease's timer at its deadline (taking it from where it was filed before).
    pub(super) fn arm_lease(&mut self, slot: usize) {
        self.disarm_lease(slot);
        self.lease_timers.insert(slot as u32, &mut self.slots);
    }

    /// Takes the lease's timer out of the wheel, if it is in.
    pub(super) fn disarm_lease(&mut self, slot: usize) {
        if self.slots[slot].link.is_linked() {
            self.lease_timers.remove(slot as u32, &mut self.slots);
        }
    }

    /// Adds a waiter's timer, first compacting the waiters' wheel if stale timers have piled
    /// up.
    pub(super) fn insert_wait_timer(&mut self, deadline_ms: u64, timer: Timer) {
        let live_max = 2 * self.waiters_count + TIMERS_STALE_MIN;
        if self.wait_timers.len() >= live_max {
            let (slots, extras) = (&self.slots, &self.extras);
            self.wait_timers
                .retain(|deadline_ms, timer| timer_is_live(slots, extras, deadline_ms, timer));
        }
        self.wait_timers.insert(deadline_ms, timer);
    }

    /// Returns the key's slot to the free list.
    pub(super) fn free(&mut self, slot: usize) {
        assert!(
            extras::get(&self.slots, &self.extras, slot).is_none_or(|extra| extra.queue.is_empty()),
            "freeing slot {slot} with waiters"
        );
        extras::tidy(&mut self.slots, &mut self.extras, slot, true);
        let lock = &self.slots[slot];
        self.index
            .remove(hash_key(self.hash_seed, lock.key(&self.keys)), slot as u32);
        if lock.key_in_arena() {
            self.keys.remove(lock.key_ref);
        }
        self.quotas.held.give_back(1);
        if !lock.is_plain() {
            self.one_lease_slots -= 1;
        }
        self.disarm_lease(slot);
        self.slots[slot] = Slot::vacant();
        self.free_slots.push(slot as u32);
    }

    /// Handles a fired lease timer (the wheel has unlinked it): settles the key, or files the
    /// timer again if the lease was renewed after the wheel found it due (while it waited in
    /// the wheel's ready list for a poll with budget left).
    pub(super) fn fire_lease(
        &mut self,
        slot: u32,
        now_ms: u64,
        tokens: &TokenAllocator,
        out: &mut Vec<Event<W>>,
    ) {
        let lock = &self.slots[slot as usize];
        assert!(
            lock.token != 0 && lock.deadline_ms != 0,
            "slot {slot}: a lease timer fired for no running lease"
        );
        if lock.deadline_ms > now_ms {
            self.lease_timers.insert(slot, &mut self.slots);
            return;
        }
        self.settle(slot as usize, now_ms, tokens, out);
    }

    /// Handles a fired waiter timer: drops stale ones, settles the key of the rest.
    pub(super) fn fire_wait(
        &mut self,
        timer: Timer,
        now_ms: u64,
        tokens: &TokenAllocator,
        out: &mut Vec<Event<W>>,
    ) {
        if self.slots[timer.slot as usize].token != 0 {
            self.settle(timer.slot as usize, now_ms, tokens, out);
        }
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
        let derived = lock.logged.is_derived() && !already_ended;
        let key: Box<[u8]> = if already_ended {
            Box::default()
        } else {
            lock.key(&self.keys).into()
        };
        if derived {
            // Its acquire id is remembered here, the one place that knows it was derived;
            // the mark goes with the lease (a key kept for its waiters keeps the token).
            let lock = &mut self.slots[slot];
            lock.logged = lock.logged.with_derived(false);
            self.derived_ended(now_ms, &key, token, lease_id, EndedHow::Expired);
        }
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
