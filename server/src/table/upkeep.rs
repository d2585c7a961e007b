//! What the server does to the table outside requests: the ticker's [`LockTable::advance`],
//! recovery's [`LockTable::restore`], a snapshot's [`LockTable::for_each_held`], and a closing
//! connection's [`LockTable::cancel_waiter`].

use super::extras;
use super::slot::find_queued;
use super::*;

impl<W: WaiterSink> LockTable<W> {
    /// Removes a queued waiter (its connection closed, or the server gave up on it) and
    /// drops it. Returns false if it is not queued on `key` (already served or timed out).
    ///
    /// O(log(waiters on the key)) amortized: the waiter is found by binary search and only
    /// marked cancelled; cancelled entries are dropped when they reach the head, or all at
    /// once when they outnumber the live ones. So a connection leaving with n waiters costs
    /// O(n log n), wherever in the queues they stood.
    pub fn cancel_waiter(&mut self, key: &[u8], waiter_id: u64) -> bool {
        self.take_waiter(key, waiter_id).is_some()
    }

    /// [`LockTable::cancel_waiter`], returning the waiter instead of dropping it, so its
    /// owner can be told why it left (a session that ended while it waited). A queue whose
    /// head left is served again by the next settling of its key.
    pub fn take_waiter(&mut self, key: &[u8], waiter_id: u64) -> Option<W> {
        if let Some(number) = self.shared.find(key) {
            return self.cancel_shared(number, waiter_id);
        }
        let slot = self.find(key)?;
        let extra = extras::get_mut(&self.slots, &mut self.extras, slot)?;
        #[cfg(test)]
        {
            self.cancel_steps += u64::from(usize::BITS - extra.queue.len().leading_zeros());
        }
        let position = find_queued(&extra.queue, waiter_id)?;
        let waiter = extra.queue[position].waiter.take()?;
        extra.live -= 1;
        let moved = extra.drop_cancelled();
        #[cfg(test)]
        {
            self.cancel_steps += moved as u64;
        }
        let _ = moved;
        self.waiters_left(1);
        self.after_queue_shrank(slot);
        Some(waiter)
    }

    /// Counts `n` waiters gone from the table.
    pub(super) fn waiters_left(&mut self, n: usize) {
        self.waiters_count -= n;
        self.quotas.waiters.give_back(n);
    }

    /// Processes up to `budget` due timers and deferred handoffs: expires leases whose
    /// deadline has passed (handing off to waiters), times out waiters, and re-arms timers of
    /// renewed leases. Each processed item settles one key fully, so `out` may receive more
    /// than `budget` events (at most `1 + waiters_per_key_max` per item). Returns true if due
    /// work remains, so the caller should call again soon.
    pub fn advance(
        &mut self,
        now_ms: u64,
        budget: usize,
        tokens: &TokenAllocator,
        out: &mut Vec<Event<W>>,
    ) -> bool {
        let now_ms = self.observe(now_ms);
        let mut spent = 0;
        if tokens.remaining() > 0 && !self.deferred.is_empty() {
            let mut deferred = std::mem::take(&mut self.deferred);
            spent = deferred.len().min(budget);
            for slot in deferred.drain(..spent) {
                let slot = slot as usize;
                if self.slots[slot].token != 0 && self.slots[slot].deadline_ms == 0 {
                    self.settle(slot, now_ms, tokens, out);
                    if self.slots[slot].token != 0 && self.slots[slot].deadline_ms == 0 {
                        self.deferred.push(slot as u32);
                    }
                }
            }
            self.deferred.append(&mut deferred);
        }
        let mut fired_leases = std::mem::take(&mut self.fired_leases);
        spent += self
            .lease_timers
            .poll(now_ms, budget - spent, &mut self.slots, &mut fired_leases);
        for slot in fired_leases.drain(..) {
            self.fire_lease(slot, now_ms, tokens, out);
        }
        self.fired_leases = fired_leases;
        let mut fired = std::mem::take(&mut self.fired);
        self.wait_timers.poll(now_ms, budget - spent, &mut fired);
        for timer in fired.drain(..) {
            self.fire_wait(timer, now_ms, tokens, out);
        }
        self.fired = fired;
        if self.shared.has_work() {
            self.advance_shared(now_ms, budget.saturating_sub(spent), tokens, out);
        }
        self.next_due_ms().is_some_and(|due_ms| due_ms <= now_ms)
            || (tokens.remaining() > 0 && !self.deferred.is_empty())
            || self.shared_due(now_ms, tokens)
    }

    /// Inserts a held lock during WAL recovery; its TTL counts from `now_ms`. Recovered locks
    /// may exceed `held_max` (they were granted under the limits of the previous run and must
    /// not be forgotten); new grants are refused until the count drops.
    ///
    /// # Panics
    /// If the key already has a slot, `token` is 0, or an argument is outside its limit.
    pub fn restore(
        &mut self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        token: u64,
        ttl_ms: u32,
        meta: &[u8],
    ) {
        assert!(
            key.len() <= KEY_LEN_MAX && meta.len() <= META_LEN_MAX,
            "restore: too long"
        );
        assert!(
            (TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms),
            "restore: ttl_ms {ttl_ms}"
        );
        assert!(token != 0, "restore: token 0");
        assert!(self.find(key).is_none(), "restore: key restored twice");
        assert!(
            !self.is_shared(key),
            "restore: a plain lock on a shared key"
        );
        assert!(self.index.len() < HELD_MAX_LIMIT, "restore: table full");
        let now_ms = self.observe(now_ms);
        self.quotas.held.take_anyway();
        self.install(
            now_ms,
            key,
            Grant {
                token,
                lease_id,
                ttl_ms,
            },
            meta.into(),
        );
    }

    /// Like [`LockTable::restore`] for a lease of any kind: a shared (read) lease or permits
    /// join the key's entry (several per key), an exclusive one takes the key's slot.
    ///
    /// # Panics
    /// As `restore`, and if the lease does not fit the key's other restored leases.
    #[allow(clippy::too_many_arguments)]
    pub fn restore_kind(
        &mut self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        token: u64,
        ttl_ms: u32,
        kind: LeaseKind,
        meta: &[u8],
    ) {
        if kind.is_exclusive() {
            return self.restore(now_ms, key, lease_id, token, ttl_ms, meta);
        }
        assert!(
            key.len() <= KEY_LEN_MAX && meta.len() <= META_LEN_MAX,
            "restore: too long"
        );
        assert!(
            (TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms),
            "restore: ttl_ms {ttl_ms}"
        );
        assert!(
            token != 0 && kind.validate().is_ok(),
            "restore: {token} {kind:?}"
        );
        let now_ms = self.observe(now_ms);
        let grant = Grant {
            token,
            lease_id,
            ttl_ms,
        };
        self.restore_shared(now_ms, key, grant, kind, meta);
    }

    /// The logged TTL of `key`'s lease, if it has one: what a lease put back by
    /// [`LockTable::restore_logged_ttl`] after its release failed to log must keep, or it
    /// could no longer be renewed to its own TTL without a record.
    pub fn logged_ttl(&self, key: &[u8]) -> Option<LoggedTtl> {
        self.find(key).map(|slot| self.slots[slot].logged)
    }

    /// Gives the lease `token` on `key`, just put back with [`LockTable::restore`], the
    /// logged TTL it had before (from [`LockTable::logged_ttl`]); `restore` alone logs the
    /// time it had left as its TTL.
    ///
    /// # Panics
    /// If `token` does not hold `key`.
    pub fn restore_logged_ttl(&mut self, key: &[u8], token: u64, logged: LoggedTtl) {
        if let Some(number) = self.shared.find(key) {
            return self.restore_logged_ttl_shared(number, token, logged);
        }
        let slot = self
            .find(key)
            .filter(|&slot| self.slots[slot].token == token)
            .expect("restore_logged_ttl: the lease was not restored");
        // A lease put back keeps its acquire id in the live map (`note_acquire_id`), not by
        // derivation: the mark of one is not put back with it.
        self.slots[slot].logged = logged.with_derived(false);
    }

    /// Calls `visit` for every lease unexpired at `now_ms` (to snapshot the table).
    pub fn for_each_held(&self, now_ms: u64, mut visit: impl FnMut(HeldLock<'_>)) {
        let now_ms = now_ms.max(self.now_ms);
        for (slot, lock) in self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, lock)| lock.token != 0 && lock.deadline_ms > now_ms)
        {
            visit(HeldLock {
                key: lock.key(&self.keys),
                lease_id: lock.lease_id,
                token: lock.token,
                ttl_ms: lock.logged.ttl_ms(),
                ttl_left_ms: lock.deadline_ms - now_ms,
                meta: self.meta(slot),
                kind: lock.kind(),
            });
        }
        self.for_each_shared(now_ms, &mut visit);
    }
}
