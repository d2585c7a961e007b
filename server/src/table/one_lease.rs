//! A read/write or semaphore key with one lease and no waiter, kept in a plain slot.
//!
//! Most such keys have one lease at a time (a read lease or a few permits on a key of its
//! own): an entry in `shared` for each cost about 200 bytes, a plain slot 72. So a SHARED or
//! PERMITS ACQUIRE of a free key with an inline key (up to `KEY_INLINE_MAX` bytes) takes a
//! slot as a plain lock does, its kind in the slot's spare `key_ref` bits (`Slot::kind`).
//! Renewal, release, expiry, CHECK and INSPECT need nothing more: the slot's lease is the
//! key's only lease, just as a plain lock's, and no waiter ever queues on such a slot. A
//! request that would make a second holder or a waiter (another read lease or permits,
//! or a write request that waits) moves the lease into an entry first (`move_to_shared`),
//! where the `shared` rules take over; one that only asks (no wait, no room) or names the
//! wrong kind is answered from the slot. An entry that comes down to one lease stays an
//! entry until its key goes. Longer keys keep the entry: their `key_ref` names the key.

use tenure_protocol::limits::PERMITS_MAX;

use super::extras;
use super::slot::KEY_INLINE_MAX;
use super::*;

/// Whether a key of `len` bytes can be kept in a one-lease slot (its `key_ref` is free).
pub(super) fn fits_one_lease(len: usize) -> bool {
    len <= KEY_INLINE_MAX
}

/// Whether a lease of `asked` may ever join a key held by a lease of `held` (not exclusive),
/// as `Entry::admits`, and whether it fits beside it now, as `Entry::fits`.
fn admits_fits(held: LeaseKind, asked: LeaseKind) -> (bool, bool) {
    match (held, asked) {
        (LeaseKind::Shared, LeaseKind::Shared) => (true, PERMITS_MAX > 1),
        (LeaseKind::Shared, LeaseKind::Exclusive) => (true, false),
        (
            LeaseKind::Permits { count, limit },
            LeaseKind::Permits {
                count: asked,
                limit: asked_limit,
            },
        ) if limit == asked_limit => (true, count + asked <= limit),
        _ => (false, false),
    }
}

/// The semaphore limit of a key held by a lease of `kind` (`None`: read/write or plain).
pub(super) fn limit_of(kind: LeaseKind) -> Option<u32> {
    match kind {
        LeaseKind::Permits { limit, .. } => Some(limit),
        _ => None,
    }
}

impl<W: WaiterSink> LockTable<W> {
    /// Grants a lease of a shared `kind` on a key with neither slot nor entry, in a slot of
    /// its own (the key fits inline: `fits_one_lease`).
    pub(super) fn grant_one_lease(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
        tokens: &TokenAllocator,
    ) -> Acquire<W> {
        assert!(
            fits_one_lease(args.key.len()),
            "a one-lease slot for a long key"
        );
        let key = args.key;
        let outcome = self.grant_free(now_ms, args, tokens);
        if matches!(outcome, Acquire::Granted(_)) {
            let slot = self.find(key).expect("a slot just installed");
            self.mark_kind(slot, kind);
        }
        outcome
    }

    /// Gives the lease of `slot` (with an inline key, just installed) the shared `kind`.
    pub(super) fn mark_kind(&mut self, slot: usize, kind: LeaseKind) {
        debug_assert!(self.slots[slot].is_plain() && !kind.is_exclusive());
        self.slots[slot].set_kind(kind);
        self.one_lease_slots += 1;
    }

    /// What a request of `asked` meets on the one-lease slot `slot` (held, settled) when it
    /// is answered from the slot: a mismatch, or LOCKED without a wait. `None`: the request
    /// needs the key's entry (a second holder, or a waiter).
    pub(super) fn beside_one_lease(
        &self,
        now_ms: u64,
        slot: usize,
        asked: LeaseKind,
        wait_ms: u32,
    ) -> Option<Acquire<W>> {
        let lock = &self.slots[slot];
        let held = lock.kind();
        let (admits, fits) = admits_fits(held, asked);
        if !admits {
            return Some(Acquire::KindMismatch {
                key_limit: limit_of(held),
            });
        }
        (!fits && wait_ms == 0).then(|| Acquire::Locked {
            token: lock.token,
            ttl_left_ms: lock.deadline_ms - now_ms,
        })
    }

    /// A plain (exclusive) ACQUIRE of a key held in a one-lease slot `slot` (settled, held):
    /// answered from the slot, or the lease moves to an entry and the request waits there.
    pub(super) fn acquire_beside_one_lease(
        &mut self,
        now_ms: u64,
        slot: usize,
        args: AcquireArgs<'_, W>,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Acquire<W> {
        let kind = LeaseKind::Exclusive;
        if let Some(answer) = self.beside_one_lease(now_ms, slot, kind, args.wait_ms) {
            return answer;
        }
        self.move_to_shared(slot);
        self.acquire_shared(now_ms, args, kind, tokens, events)
    }

    /// The one-lease slot of `key`, if it has one.
    pub(super) fn one_lease_slot(&self, key: &[u8]) -> Option<usize> {
        if self.one_lease_slots == 0 {
            return None;
        }
        self.find(key).filter(|&slot| !self.slots[slot].is_plain())
    }

    /// `inspect_kinds` of a key in a one-lease slot.
    pub(super) fn inspect_one_lease(&self, now_ms: u64, slot: usize) -> SharedInspect {
        let lock = &self.slots[slot];
        let kind = lock.kind();
        let live = lock.deadline_ms > now_ms;
        let in_use = match kind {
            LeaseKind::Permits { count, .. } => count,
            _ => 1,
        };
        SharedInspect {
            limit: limit_of(kind).unwrap_or(0),
            holders: u32::from(live),
            in_use: if live { in_use } else { 0 },
            ..SharedInspect::default()
        }
    }

    /// The one-lease slot's own invariants: an inline key, a running lease, no waiter.
    pub(super) fn check_one_lease_slots(&self) {
        let mut count = 0;
        for (number, lock) in self.slots.iter().enumerate() {
            if lock.token == 0 || lock.is_plain() {
                continue;
            }
            count += 1;
            assert!(
                lock.deadline_ms != 0 && self.queue_len(number) == 0,
                "one-lease slot {number} reserved or with waiters"
            );
            assert!(
                extras::get(&self.slots, &self.extras, number).is_none_or(|e| e.queue.is_empty()),
                "one-lease slot {number} has a queue"
            );
            assert!(lock.kind().validate().is_ok(), "slot {number}: kind");
            let key = lock.key(&self.keys);
            assert!(
                self.shared.find(key).is_none(),
                "key {key:?} in a slot and an entry"
            );
        }
        assert_eq!(count, self.one_lease_slots, "one-lease slots count");
    }
}
