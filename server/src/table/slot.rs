//! The slab entry of the lock table and what hangs off it: a [`Slot`] (key, lease, lease
//! timer link), its rarely used [`Extra`] (metadata, waiter queue), a queued acquire
//! ([`Queued`]), and a waiter's [`Timer`] with the check that tells a live timer from a stale
//! one.

use std::collections::VecDeque;

use tenure_protocol::limits::PERMITS_MAX;
use tenure_protocol::{LeaseId, LeaseKind};

use std::marker::PhantomData;

use super::extras::{self, Extras, EXTRA_FLAG};
use super::keys::{KeyArena, KeyRef};
use super::slab::Slab;
use super::CANCELLED_SLACK;
use crate::wheel::Link;

/// Longest key stored in its slot: the load generator's keys (`job:` and 19 digits) fit, and
/// with the lease the slot stays 72 bytes.
pub(super) const KEY_INLINE_MAX: usize = 23;
/// `Slot::key_len` of a key in the arena.
const KEY_IN_ARENA: u8 = u8::MAX;

/// A waiter's timer in the waiters' wheel: which slot, and a stamp to tell whether it is
/// still wanted. (A lease's timer is the slot's own `link`.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Timer {
    /// Slot number.
    pub(super) slot: u32,
    /// The low 32 bits of the waiter's id.
    pub(super) stamp: u32,
}

/// The TTL of a lease's last journal record (its grant, a renewal to a longer TTL, a
/// snapshot's copy, or what recovery found), whether that record may not be durable yet,
/// and whether the lease id was derived from an acquire id (module `acquire_ids`): one
/// `u32`, the flags in the top bits, since a slot is most of a lock's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedTtl(u32);

/// Set in a [`LoggedTtl`] while its record, a renewal's, may not be durable yet.
const LOGGED_TTL_PENDING_BIT: u32 = 1 << 31;
/// Set in a [`LoggedTtl`] for as long as the lease's id is derived from its acquire id.
const LOGGED_TTL_DERIVED_BIT: u32 = 1 << 30;
const _: () = assert!(tenure_protocol::limits::TTL_MS_MAX < LOGGED_TTL_DERIVED_BIT);
const LOGGED_TTL_FLAGS: u32 = LOGGED_TTL_PENDING_BIT | LOGGED_TTL_DERIVED_BIT;

impl LoggedTtl {
    /// A free slot's.
    pub(super) const NONE: LoggedTtl = LoggedTtl(0);

    /// `ttl_ms`, whose record needs no waiting for: a grant's (no one can renew a lease
    /// before its grant was answered, hence durable) or a recovered one.
    pub(super) fn settled(ttl_ms: u32) -> LoggedTtl {
        assert!(ttl_ms < LOGGED_TTL_PENDING_BIT, "ttl_ms {ttl_ms} too large");
        LoggedTtl(ttl_ms)
    }

    /// `ttl_ms` from a renewal record that may not be durable yet.
    pub(super) fn pending(ttl_ms: u32) -> LoggedTtl {
        LoggedTtl(Self::settled(ttl_ms).0 | LOGGED_TTL_PENDING_BIT)
    }

    /// The logged TTL.
    pub(super) fn ttl_ms(self) -> u32 {
        self.0 & !LOGGED_TTL_FLAGS
    }

    /// Whether the lease's id is derived from its acquire id.
    pub(super) fn is_derived(self) -> bool {
        self.0 & LOGGED_TTL_DERIVED_BIT != 0
    }

    /// This, marked derived as `was` is: a renewal changes the record, not the lease id.
    pub(super) fn derived_as(self, was: LoggedTtl) -> LoggedTtl {
        LoggedTtl(self.0 | (was.0 & LOGGED_TTL_DERIVED_BIT))
    }

    /// This, marked derived or not.
    pub(super) fn with_derived(self, derived: bool) -> LoggedTtl {
        let flag = if derived { LOGGED_TTL_DERIVED_BIT } else { 0 };
        LoggedTtl(self.0 & !LOGGED_TTL_DERIVED_BIT | flag)
    }

    /// Whether its record may not be durable yet.
    pub(super) fn is_pending(self) -> bool {
        self.0 & LOGGED_TTL_PENDING_BIT != 0
    }
}

/// One slab entry: a key with its lease, or free (`token == 0`). 72 bytes: it is most of a
/// held lock's memory. A key of up to `KEY_INLINE_MAX` bytes is stored in the slot, so a
/// lookup reads the index and the slot and nothing else; a longer key is in the shard's key
/// arena. Metadata and waiters, when there are any, are in the table's extras, flagged in
/// `key_ref`.
#[derive(Debug)]
pub(super) struct Slot<W> {
    /// A key of up to `KEY_INLINE_MAX` bytes, zero-padded.
    pub(super) key_inline: [u8; KEY_INLINE_MAX],
    /// The inline key's length, or `KEY_IN_ARENA`.
    pub(super) key_len: u8,
    /// Where a longer key is in the key arena (else `KeyRef::NONE`), and whether the slot
    /// has extras.
    pub(super) key_ref: KeyRef,
    /// The holder's lease id.
    pub(super) lease_id: LeaseId,
    /// The holder's fencing token; 0 marks a free slot.
    pub(super) token: u64,
    /// The lease expires when `now_ms >= deadline_ms`. 0: the lease ended and the key is
    /// reserved for its waiters until a token is available.
    pub(super) deadline_ms: u64,
    /// The lease's timer: linked in the lease wheel while the lease runs (filed at or before
    /// `deadline_ms`), unlinked when free or reserved for a handoff.
    pub(super) link: Link,
    /// The TTL of the lease's last record in the journal: what a restart gives it again.
    pub(super) logged: LoggedTtl,
    /// Slots are typed by the table's waiter, whose queue is in the extras.
    pub(super) waiter: PhantomData<fn() -> W>,
}

/// The rarely used part of a slot (see `extras`).
#[derive(Debug)]
pub(super) struct Extra<W> {
    /// The holder's metadata.
    pub(super) meta: Box<[u8]>,
    /// Waiters, first come first served, in increasing `waiter_id` order (so a waiter is found
    /// by binary search). Cancelled waiters stay as entries without a waiter until the queue
    /// is compacted; the first entry is never one of them, and the queue is empty when no
    /// waiter is live.
    pub(super) queue: VecDeque<Queued<W>>,
    /// Entries of `queue` with a waiter.
    pub(super) live: usize,
    /// At most the smallest waiter deadline in `queue`, so settling skips the scan.
    pub(super) wait_deadline_min_ms: u64,
}

/// A queued acquire request.
#[derive(Debug)]
pub(super) struct Queued<W> {
    /// Where to deliver the outcome; `None` once cancelled.
    pub(super) waiter: Option<W>,
    /// Unique within the table.
    pub(super) waiter_id: u64,
    /// The lease id it will hold the lock under.
    pub(super) lease_id: LeaseId,
    /// The TTL it asked for.
    pub(super) ttl_ms: u32,
    /// It gives up when `now_ms >= deadline_ms`.
    pub(super) deadline_ms: u64,
    /// Its holder metadata.
    pub(super) meta: Box<[u8]>,
}

impl<W> Slot<W> {
    /// A free slot.
    pub(super) fn vacant() -> Self {
        Slot {
            key_inline: [0; KEY_INLINE_MAX],
            key_len: 0,
            key_ref: KeyRef::NONE,
            lease_id: LeaseId::default(),
            token: 0,
            deadline_ms: 0,
            link: Link::UNLINKED,
            logged: LoggedTtl::NONE,
            waiter: PhantomData,
        }
    }
}

impl<W> Slot<W> {
    /// The key (empty when free).
    pub(super) fn key<'a>(&'a self, keys: &'a KeyArena) -> &'a [u8] {
        if self.key_len == KEY_IN_ARENA {
            keys.get(self.key_ref)
        } else {
            &self.key_inline[..usize::from(self.key_len)]
        }
    }

    /// Stores `key` in a vacant slot: inline if it fits, else in the arena.
    pub(super) fn set_key(&mut self, key: &[u8], keys: &mut KeyArena) {
        debug_assert!(self.key_len == 0 && self.key_ref == KeyRef::NONE);
        if key.len() <= KEY_INLINE_MAX {
            self.key_inline[..key.len()].copy_from_slice(key);
            self.key_len = key.len() as u8;
        } else {
            self.key_ref = keys.insert(key);
            self.key_len = KEY_IN_ARENA;
        }
    }

    /// Whether the key is in the arena.
    pub(super) fn key_in_arena(&self) -> bool {
        self.key_len == KEY_IN_ARENA
    }

    /// The kind of the slot's lease: exclusive (a plain lock), or the one lease of a
    /// read/write or semaphore key that has no other holder and no waiter (module
    /// `one_lease`), carried in `key_ref` (see `KIND_PLAIN`).
    #[inline]
    pub(super) fn kind(&self) -> LeaseKind {
        match self.kind_bits() {
            KIND_PLAIN => LeaseKind::Exclusive,
            KIND_SHARED => LeaseKind::Shared,
            bits => LeaseKind::Permits {
                count: bits >> KIND_COUNT_SHIFT,
                limit: bits & KIND_LIMIT_MASK,
            },
        }
    }

    /// Whether the slot holds a plain (exclusive) lock, or is free: the one check plain
    /// paths pay.
    #[inline]
    pub(super) fn is_plain(&self) -> bool {
        self.kind_bits() == KIND_PLAIN
    }

    fn kind_bits(&self) -> u32 {
        if self.key_len == KEY_IN_ARENA {
            KIND_PLAIN
        } else {
            self.key_ref.bits() & !EXTRA_FLAG
        }
    }

    /// Marks the lease of a slot with an inline key as `kind` (the extras flag kept).
    ///
    /// # Panics
    /// If the key is in the arena (its `key_ref` is taken) or the permit counts are out of
    /// range.
    pub(super) fn set_kind(&mut self, kind: LeaseKind) {
        assert!(!self.key_in_arena(), "a kind on a slot with a long key");
        let bits = match kind {
            LeaseKind::Exclusive => KIND_PLAIN,
            LeaseKind::Shared => KIND_SHARED,
            LeaseKind::Permits { count, limit } => {
                assert!(
                    (1..=limit).contains(&count) && limit <= PERMITS_MAX,
                    "{count} of {limit} permits"
                );
                count << KIND_COUNT_SHIFT | limit
            }
        };
        let extra = self.key_ref.bits() & EXTRA_FLAG;
        self.key_ref = KeyRef::from_bits(bits | extra);
    }
}

/// The kind of a slot's lease lives in `key_ref` when the key is inline, where it names no
/// arena key and its 31 bits (beside the extras flag) are free: `KeyRef::NONE`'s bits for a
/// plain lock (so a plain slot is untouched), `KIND_SHARED` for a read lease, else a
/// semaphore's permits as `count << KIND_COUNT_SHIFT | limit`.
const KIND_PLAIN: u32 = KeyRef::NONE.bits() & !EXTRA_FLAG;
/// A read lease's kind bits (never a permits code: its limit would be 0).
const KIND_SHARED: u32 = 0;
/// Where a permits code keeps its count; the limit is in the bits below.
const KIND_COUNT_SHIFT: u32 = 13;
const KIND_LIMIT_MASK: u32 = (1 << KIND_COUNT_SHIFT) - 1;
// The bit budget: counts and limits up to PERMITS_MAX fit, below the plain bits and the flag.
const _: () = assert!(PERMITS_MAX <= KIND_LIMIT_MASK);
const _: () = assert!((PERMITS_MAX << KIND_COUNT_SHIFT | PERMITS_MAX) < KIND_PLAIN);
const _: () = assert!(KIND_PLAIN & EXTRA_FLAG == 0 && KIND_PLAIN != KIND_SHARED);

impl<W> Extra<W> {
    /// Drops cancelled entries at the head, and all of them once they outnumber the live
    /// waiters (by more than `CANCELLED_SLACK`), keeping the queue's invariants. Returns the
    /// entries moved or dropped.
    pub(super) fn drop_cancelled(&mut self) -> usize {
        let before = self.queue.len();
        if self.live == 0 {
            self.queue.clear();
        } else if before - self.live > self.live + CANCELLED_SLACK {
            self.queue.retain(|queued| queued.waiter.is_some());
        } else {
            while self.queue.front().is_some_and(|q| q.waiter.is_none()) {
                self.queue.pop_front();
            }
        }
        before - self.queue.len()
    }

    /// Extras with metadata and no waiters.
    pub(super) fn new(meta: Box<[u8]>) -> Self {
        Extra {
            meta,
            queue: VecDeque::new(),
            live: 0,
            wait_deadline_min_ms: u64::MAX,
        }
    }
}

/// Whether a waiter's timer still matters: its waiter is still queued with that deadline.
pub(super) fn timer_is_live<W>(
    slots: &Slab<W>,
    extras: &Extras<W>,
    deadline_ms: u64,
    timer: &Timer,
) -> bool {
    let slot = timer.slot as usize;
    if slots[slot].token == 0 {
        return false;
    }
    let Some(queue) = extras::get(slots, extras, slot).map(|extra| &extra.queue) else {
        return false;
    };
    let (Some(first), Some(last)) = (queue.front(), queue.back()) else {
        return false;
    };
    let is_it = |w: &Queued<W>| {
        w.waiter_id as u32 == timer.stamp && w.deadline_ms == deadline_ms && w.waiter.is_some()
    };
    if last.waiter_id - first.waiter_id > u64::from(u32::MAX) {
        // Ids too far apart for the stamp's 32 bits to name one: look at each (never seen in
        // practice: it takes four billion waiters while one waits).
        return queue.iter().any(is_it);
    }
    // The stamp holds the id's low 32 bits, and the queue's ids span less than 2^32: the
    // full id is the one in that span with those bits. Binary search keeps wheel compaction
    // O(timers log n) even with one long queue.
    let waiter_id = first.waiter_id + u64::from(timer.stamp.wrapping_sub(first.waiter_id as u32));
    find_queued(queue, waiter_id).is_some_and(|position| is_it(&queue[position]))
}

/// The position of `waiter_id` in a queue sorted by waiter id. The first probe is where the
/// id would be if ids were spread evenly (they are contiguous on a key nobody else waits on,
/// cancelled entries keeping their places): one probe, where a binary search would take
/// log n cache misses across a long queue. Otherwise a binary search on the probe's side.
pub(super) fn find_queued<W>(queue: &VecDeque<Queued<W>>, waiter_id: u64) -> Option<usize> {
    let (first, last) = (queue.front()?.waiter_id, queue.back()?.waiter_id);
    if !(first..=last).contains(&waiter_id) {
        return None;
    }
    let span = u128::from(last - first).max(1);
    let guess = (u128::from(waiter_id - first) * (queue.len() as u128 - 1) / span) as usize;
    let (mut low, mut high) = match queue[guess].waiter_id.cmp(&waiter_id) {
        std::cmp::Ordering::Equal => return Some(guess),
        std::cmp::Ordering::Less => (guess + 1, queue.len()),
        std::cmp::Ordering::Greater => (0, guess),
    };
    while low < high {
        let middle = low + (high - low) / 2;
        match queue[middle].waiter_id.cmp(&waiter_id) {
            std::cmp::Ordering::Equal => return Some(middle),
            std::cmp::Ordering::Less => low = middle + 1,
            std::cmp::Ordering::Greater => high = middle,
        }
    }
    None
}
