//! The lock table: one shard of the server's locks, with their waiters and timers.
//!
//! The server keeps several shards, each a `Mutex<LockTable<W>>` chosen by key hash; this
//! type is one shard. It is synchronous and deterministic: no I/O, no clock, no randomness.
//! Time arrives as `now_ms`, lease ids and the hash seed arrive as arguments, and fencing
//! tokens come from the shared [`TokenAllocator`].
//!
//! # Expiry is judged at the moment of each request
//!
//! A lease with deadline `d` is held while `now_ms < d` and expired from `now_ms >= d` on,
//! whether or not the timer wheel has fired yet. `renew`, `release`, `inspect` and `check`
//! judge a lease by its deadline alone. `acquire` first *settles* the key: it times out
//! waiters whose wait ran out and, if the lease is over, hands the lock to the next live
//! waiter in FIFO order (or frees the key). `advance` settles the keys whose timers fired.
//! Settling is the only place a lock changes hands on its own, and everything it does is
//! reported as [`Event`]s into the caller's vector: the server must act on every event (log
//! grants to the WAL, notify waiters), also those returned by `acquire` and `release`.
//!
//! A handoff grants the waiter's lease for the waiter's own `ttl_ms`, counted from the
//! `now_ms` of the call that settled the key.
//!
//! # Timers are lazy
//!
//! Every lease has one timer in the wheel, stamped with the slot's generation; every waiter
//! has one, stamped with its id. Renewal only moves the lease's deadline: when the timer fires
//! early it is put back at the new deadline (a renewal that *shortens* the lease arms a new
//! timer and bumps the generation, so the timer is never late). Timers of freed or re-granted
//! locks and of waiters that were served or cancelled fail validation and are dropped, so
//! there is no cancel operation and renew is a field write. Stale timers are compacted away
//! once they outnumber the live ones, so the wheel stays proportional to locks plus waiters
//! even when leases with day-long TTLs are released after milliseconds.
//!
//! # Token exhaustion
//!
//! A token is only handed out below the durable limit. If none is available when a free key
//! is requested, `acquire` returns [`Acquire::TokensExhausted`] and changes nothing. If none
//! is available for a handoff, the lease still ends (an `Expired` event with no handoff, or
//! `Released` with no handoff) but the key stays reserved for its queue: its waiters keep
//! their FIFO positions, newcomers without a wait get `TokensExhausted`, newcomers with a wait
//! queue behind. Once tokens are available again, the next `advance` (or `acquire` on the key)
//! completes the handoff and reports it as [`Event::HandedOff`].
//!
//! # Memory
//!
//! Locks live in a slab of `Slot`s (72 bytes: key inline up to 22 bytes, lease, deadline,
//! token, generation, TTL, and a pointer to rarely used extras: metadata and waiter queue).
//! A custom index maps key hashes to slab numbers in 8-byte buckets (see `index`), and each
//! lease timer costs 16 bytes in the wheel: 96 to 106 bytes per held lock by `size_of`, about
//! 105 to 115 bytes measured with slack (100k to 1M locks with 16-byte keys).

mod index;
mod invariants;
mod outcome;
mod quota;

use std::collections::VecDeque;
use std::sync::Arc;

use tenure_protocol::limits::{KEY_LEN_MAX, META_LEN_MAX, TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};
use tenure_protocol::LeaseId;

use crate::tokens::TokenAllocator;
use crate::wheel::TimerWheel;
use index::{hash_key, KeyBytes, KeyIndex};
pub use outcome::{
    Acquire, AcquireArgs, Check, Event, Grant, Handoff, HeldLock, Inspect, Limit, Release, Renew,
    TableLimits, Waiter,
};
pub use quota::{Quota, Quotas};

/// The wheel is compacted (stale timers dropped) once it holds more than twice the live
/// timers plus this many; compaction is O(timers), so this keeps it amortized O(1) per insert
/// and bounds the wheel's memory by the number of held locks and waiters. Small in tests so
/// the simulation exercises it.
const TIMERS_STALE_MIN: usize = if cfg!(test) { 8 } else { 4096 };

/// A queue is compacted (cancelled waiters dropped) once they outnumber its live waiters plus
/// this many, so a cancel is amortized O(1) and a queue's length stays within twice its live
/// waiters plus this.
const CANCELLED_SLACK: usize = if cfg!(test) { 2 } else { 16 };

/// Marks a waiter timer (as opposed to a lease timer) in `Timer::slot`.
const WAIT_TIMER_BIT: u32 = 1 << 31;
/// Largest `held_max` a table accepts: slot numbers must leave `WAIT_TIMER_BIT` free.
pub const HELD_MAX_LIMIT: usize = (WAIT_TIMER_BIT - 1) as usize;

/// A timer in the wheel: which slot, and a stamp to tell whether it is still wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Timer {
    /// Slot number, with `WAIT_TIMER_BIT` set for a waiter timer.
    slot: u32,
    /// Lease timers: the slot's generation when armed. Waiter timers: low bits of the id.
    stamp: u32,
}

/// One slab entry: a key with its lease, or free (`token == 0`).
#[derive(Debug)]
struct Slot<W> {
    /// The key (empty when free).
    key: KeyBytes,
    /// The holder's lease id.
    lease_id: LeaseId,
    /// The holder's fencing token; 0 marks a free slot.
    token: u64,
    /// The lease expires when `now_ms >= deadline_ms`. 0: the lease ended and the key is
    /// reserved for its waiters until a token is available.
    deadline_ms: u64,
    /// Bumped whenever the lease's timer is re-armed or the lease ends, so old timers fail.
    generation: u32,
    /// The TTL of the current lease.
    ttl_ms: u32,
    /// Metadata and waiter queue; `None` when both are empty (the common case).
    extra: Option<Box<Extra<W>>>,
}

/// The rarely used part of a slot.
#[derive(Debug)]
struct Extra<W> {
    /// The holder's metadata.
    meta: Box<[u8]>,
    /// Waiters, first come first served, in increasing `waiter_id` order (so a waiter is found
    /// by binary search). Cancelled waiters stay as entries without a waiter until the queue
    /// is compacted; the first entry is never one of them, and the queue is empty when no
    /// waiter is live.
    queue: VecDeque<Queued<W>>,
    /// Entries of `queue` with a waiter.
    live: usize,
    /// At most the smallest waiter deadline in `queue`, so settling skips the scan.
    wait_deadline_min_ms: u64,
}

/// A queued acquire request.
#[derive(Debug)]
struct Queued<W> {
    /// Where to deliver the outcome; `None` once cancelled.
    waiter: Option<W>,
    /// Unique within the table.
    waiter_id: u64,
    /// The lease id it will hold the lock under.
    lease_id: LeaseId,
    /// The TTL it asked for.
    ttl_ms: u32,
    /// It gives up when `now_ms >= deadline_ms`.
    deadline_ms: u64,
    /// Its holder metadata.
    meta: Box<[u8]>,
}

/// What `hand_off` did with a lock whose lease is over.
enum HandOff<W> {
    /// The next live waiter holds it.
    Granted(Handoff<W>),
    /// No live waiter: the key is free.
    Freed,
    /// Live waiters but no token: the key stays reserved for them.
    Deferred,
}

impl<W> Slot<W> {
    /// A free slot.
    fn vacant(generation: u32) -> Self {
        Slot {
            key: KeyBytes::new(&[]),
            lease_id: LeaseId::default(),
            token: 0,
            deadline_ms: 0,
            generation,
            ttl_ms: 0,
            extra: None,
        }
    }

    /// The holder's metadata.
    fn meta(&self) -> &[u8] {
        self.extra.as_ref().map_or(&[], |extra| &extra.meta)
    }

    /// Waiters queued on the key (not counting cancelled ones).
    fn queue_len(&self) -> usize {
        self.extra.as_ref().map_or(0, |extra| extra.live)
    }

    /// Frees `extra` when it holds nothing.
    fn tidy_extra(&mut self) {
        if self
            .extra
            .as_ref()
            .is_some_and(|extra| extra.meta.is_empty() && extra.queue.is_empty())
        {
            self.extra = None;
        }
    }

    /// Sets the holder's metadata, allocating `extra` only if needed.
    fn set_meta(&mut self, meta: Box<[u8]>) {
        match &mut self.extra {
            Some(extra) => extra.meta = meta,
            None if meta.is_empty() => {}
            None => self.extra = Some(Box::new(Extra::new(meta))),
        }
    }
}

impl<W> Extra<W> {
    /// Drops cancelled entries at the head, and all of them once they outnumber the live
    /// waiters (by more than `CANCELLED_SLACK`), keeping the queue's invariants. Returns the
    /// entries moved or dropped.
    fn drop_cancelled(&mut self) -> usize {
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
    fn new(meta: Box<[u8]>) -> Self {
        Extra {
            meta,
            queue: VecDeque::new(),
            live: 0,
            wait_deadline_min_ms: u64::MAX,
        }
    }
}

/// One shard of locks; see the module docs.
#[derive(Debug)]
pub struct LockTable<W> {
    /// Limits and server-wide counts, shared with the other shards.
    quotas: Arc<Quotas>,
    /// Seed of the key hash, so clients cannot aim keys at one bucket.
    hash_seed: u64,
    /// The slab; a lock's number never changes while its key has a slot.
    slots: Vec<Slot<W>>,
    /// Numbers of free slots, reused before the slab grows.
    free_slots: Vec<u32>,
    /// Key hash to slot number.
    index: KeyIndex,
    /// Lease and waiter timers.
    wheel: TimerWheel<Timer>,
    /// Slots whose lease ended while no token was available (may hold stale numbers).
    deferred: Vec<u32>,
    /// Scratch space for timers fired by one `advance`.
    fired: Vec<Timer>,
    /// Waiters queued over all keys.
    waiters_count: usize,
    /// The next waiter id to hand out.
    next_waiter_id: u64,
    /// Queue entries visited or moved by `cancel_waiter`, so tests can check it stays
    /// O(log n) per cancel rather than O(n).
    #[cfg(test)]
    cancel_steps: u64,
    /// The latest `now_ms` seen: an earlier one (threads read the clock before taking the
    /// shard's mutex) is treated as this, so time never runs backwards inside the table.
    now_ms: u64,
}

impl<W: Waiter> LockTable<W> {
    /// An empty table hashing keys with a fixed seed; see [`LockTable::with_hash_seed`].
    ///
    /// # Panics
    /// If `limits.held_max > HELD_MAX_LIMIT`.
    pub fn new(limits: TableLimits) -> Self {
        Self::with_hash_seed(limits, 0)
    }

    /// An empty table hashing keys with `hash_seed`: with a random seed per process, clients
    /// cannot choose keys that collide in the index and slow every lookup down. The table's
    /// limits are its own; see [`LockTable::with_quotas`] for shards of one server.
    ///
    /// # Panics
    /// If `limits.held_max > HELD_MAX_LIMIT`.
    pub fn with_hash_seed(limits: TableLimits, hash_seed: u64) -> Self {
        Self::with_quotas(Arc::new(Quotas::new(limits)), hash_seed)
    }

    /// An empty table counting its locks and waiters in `quotas`, which the other shards of
    /// the server share, so the server-wide limits hold exactly whatever shards keys land in.
    ///
    /// # Panics
    /// If `quotas.held.max() > HELD_MAX_LIMIT`.
    pub fn with_quotas(quotas: Arc<Quotas>, hash_seed: u64) -> Self {
        assert!(
            quotas.held.max() <= HELD_MAX_LIMIT,
            "held_max {} too large",
            quotas.held.max()
        );
        LockTable {
            quotas,
            hash_seed,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: KeyIndex::new(),
            wheel: TimerWheel::new(),
            deferred: Vec::new(),
            fired: Vec::new(),
            waiters_count: 0,
            next_waiter_id: 1,
            #[cfg(test)]
            cancel_steps: 0,
            now_ms: 0,
        }
    }

    /// Keys with a slot: held, expired but not yet reaped, or reserved for a handoff.
    pub fn held_count(&self) -> usize {
        self.index.len()
    }

    /// Waiters queued over all keys (some may have timed out but not been reaped yet).
    pub fn waiters_count(&self) -> usize {
        self.waiters_count
    }

    /// Heap bytes reserved by the slab, the index and the timer wheel (not counting keys
    /// longer than the inline size, metadata and waiters).
    pub fn memory_bytes(&self) -> usize {
        self.slots.capacity() * size_of::<Slot<W>>()
            + self.index.bytes()
            + self.wheel.memory_bytes()
    }

    /// A lower bound on when `advance` will next have timers to process (`None`: no timers).
    pub fn next_due_ms(&self) -> Option<u64> {
        self.wheel.next_due_ms()
    }

    /// Tries to lock `args.key`. The key is settled first (see the module docs); events from
    /// that go to `events` and must be handled even if the answer is not `Granted`.
    ///
    /// A free key is granted with a fresh token. A held key answers `Locked` when
    /// `wait_ms == 0`, else the request is queued behind earlier waiters.
    ///
    /// # Panics
    /// If an argument is outside its protocol limit or `wait_ms > 0` comes without a waiter
    /// (the server validates requests before calling).
    pub fn acquire(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Acquire<W> {
        assert_acquire_args(&args);
        let now_ms = self.observe(now_ms);
        let Some(slot) = self.find(args.key) else {
            return self.grant_free(now_ms, args, tokens);
        };
        self.settle(slot, now_ms, tokens, events);
        let lock = &self.slots[slot];
        if lock.token == 0 {
            return self.grant_free(now_ms, args, tokens);
        }
        if args.wait_ms > 0 {
            return self.enqueue(slot, now_ms, args);
        }
        if lock.deadline_ms == 0 {
            // Reserved for its waiters; the newcomer could only get it with a token.
            return Acquire::TokensExhausted {
                waiter: args.waiter,
            };
        }
        Acquire::Locked {
            token: lock.token,
            ttl_left_ms: lock.deadline_ms - now_ms,
        }
    }

    /// Extends the lease to `now_ms + ttl_ms` if `lease_id` holds the key unexpired.
    ///
    /// # Panics
    /// If `ttl_ms` is outside `TTL_MS_MIN..=TTL_MS_MAX`.
    pub fn renew(&mut self, now_ms: u64, key: &[u8], lease_id: LeaseId, ttl_ms: u32) -> Renew {
        assert!(
            (TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms),
            "ttl_ms {ttl_ms} out of range"
        );
        let now_ms = self.observe(now_ms);
        let Some(slot) = self.find(key) else {
            return Renew::Lost;
        };
        let lock = &mut self.slots[slot];
        if lock.deadline_ms <= now_ms || lock.lease_id != lease_id {
            return Renew::Lost;
        }
        let deadline_ms = now_ms + u64::from(ttl_ms);
        let shortened = deadline_ms < lock.deadline_ms;
        lock.deadline_ms = deadline_ms;
        lock.ttl_ms = ttl_ms;
        if shortened {
            // The armed timer would be late; arm one at the new deadline instead.
            self.arm_lease(slot);
        }
        Renew::Renewed { ttl_ms }
    }

    /// Ends the lease if `lease_id` holds the key unexpired, handing the lock to the next
    /// live waiter with a fresh token. Waiters found timed out are reported in `events`.
    pub fn release(
        &mut self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Release<W> {
        let now_ms = self.observe(now_ms);
        let Some(slot) = self.find(key) else {
            return Release::NotOwner;
        };
        let lock = &self.slots[slot];
        if lock.deadline_ms <= now_ms || lock.lease_id != lease_id {
            return Release::NotOwner;
        }
        let token = lock.token;
        self.time_out_waiters(slot, now_ms, events);
        let handoff = match self.hand_off(slot, now_ms, tokens) {
            HandOff::Granted(handoff) => Some(handoff),
            HandOff::Freed | HandOff::Deferred => None,
        };
        Release::Released { token, handoff }
    }

    /// Settles `key` at `now_ms` (see the module docs): a lease that ran out ends now, and its
    /// expiry and any hand-off go to `events`, instead of waiting for the wheel.
    pub fn settle_key(
        &mut self,
        now_ms: u64,
        key: &[u8],
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) {
        let now_ms = self.observe(now_ms);
        if let Some(slot) = self.find(key) {
            self.settle(slot, now_ms, tokens, events);
        }
    }

    /// The key's state as of `now_ms`, without settling it.
    pub fn inspect(&self, now_ms: u64, key: &[u8]) -> Inspect<'_> {
        let now_ms = now_ms.max(self.now_ms);
        let Some(slot) = self.find(key) else {
            return Inspect::Free;
        };
        let lock = &self.slots[slot];
        if lock.deadline_ms <= now_ms {
            return Inspect::Free;
        }
        Inspect::Held {
            token: lock.token,
            ttl_left_ms: lock.deadline_ms - now_ms,
            waiters: u32::try_from(lock.queue_len()).expect("queue length bounded by limits"),
            meta: lock.meta(),
        }
    }

    /// Whether `token` is the fencing token of the unexpired lease on `key`.
    pub fn check(&self, now_ms: u64, key: &[u8], token: u64) -> Check {
        let now_ms = now_ms.max(self.now_ms);
        match self.find(key) {
            Some(slot)
                if self.slots[slot].deadline_ms > now_ms && self.slots[slot].token == token =>
            {
                Check::Current
            }
            _ => Check::Stale,
        }
    }

    /// Removes a queued waiter (its connection closed, or the server gave up on it) and
    /// drops it. Returns false if it is not queued on `key` (already served or timed out).
    ///
    /// O(log(waiters on the key)) amortized: the waiter is found by binary search and only
    /// marked cancelled; cancelled entries are dropped when they reach the head, or all at
    /// once when they outnumber the live ones. So a connection leaving with n waiters costs
    /// O(n log n), wherever in the queues they stood.
    pub fn cancel_waiter(&mut self, key: &[u8], waiter_id: u64) -> bool {
        let Some(slot) = self.find(key) else {
            return false;
        };
        let Some(extra) = self.slots[slot].extra.as_mut() else {
            return false;
        };
        #[cfg(test)]
        {
            self.cancel_steps += u64::from(usize::BITS - extra.queue.len().leading_zeros());
        }
        let Some(position) = find_queued(&extra.queue, waiter_id) else {
            return false;
        };
        if extra.queue[position].waiter.take().is_none() {
            return false;
        }
        extra.live -= 1;
        let moved = extra.drop_cancelled();
        #[cfg(test)]
        {
            self.cancel_steps += moved as u64;
        }
        let _ = moved;
        self.waiters_left(1);
        self.after_queue_shrank(slot);
        true
    }

    /// Counts `n` waiters gone from the table.
    fn waiters_left(&mut self, n: usize) {
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
        let mut fired = std::mem::take(&mut self.fired);
        self.wheel.poll(now_ms, budget - spent, &mut fired);
        for timer in fired.drain(..) {
            self.fire(timer, now_ms, tokens, out);
        }
        self.fired = fired;
        self.wheel
            .next_due_ms()
            .is_some_and(|due_ms| due_ms <= now_ms)
            || (tokens.remaining() > 0 && !self.deferred.is_empty())
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

    /// Calls `visit` for every lease unexpired at `now_ms` (to snapshot the table).
    pub fn for_each_held(&self, now_ms: u64, mut visit: impl FnMut(HeldLock<'_>)) {
        let now_ms = now_ms.max(self.now_ms);
        for lock in self
            .slots
            .iter()
            .filter(|lock| lock.token != 0 && lock.deadline_ms > now_ms)
        {
            visit(HeldLock {
                key: lock.key.as_slice(),
                lease_id: lock.lease_id,
                token: lock.token,
                ttl_ms: lock.ttl_ms,
                ttl_left_ms: lock.deadline_ms - now_ms,
                meta: lock.meta(),
            });
        }
    }

    /// Whether `key` has a slot (held, expired but unreaped, or reserved): lets the simulation
    /// see a reserved key being freed by `advance`, the one change that yields no event.
    #[cfg(test)]
    pub(crate) fn has_slot(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// Moves the table's time forward to `now_ms` (never back) and returns the table's time.
    fn observe(&mut self, now_ms: u64) -> u64 {
        self.now_ms = self.now_ms.max(now_ms);
        self.now_ms
    }

    /// The slot of `key`, if it has one.
    fn find(&self, key: &[u8]) -> Option<usize> {
        let hash = hash_key(self.hash_seed, key);
        let found = self
            .index
            .find(hash, |slot| self.slots[slot as usize].key.as_slice() == key);
        found.map(|slot| slot as usize)
    }

    /// Grants a key that has no slot, if limits and tokens allow.
    fn grant_free(
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
    fn install(&mut self, now_ms: u64, key: &[u8], grant: Grant, meta: Box<[u8]>) {
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
    fn start_lease(&mut self, slot: usize, now_ms: u64, grant: Grant) {
        let lock = &mut self.slots[slot];
        lock.token = grant.token;
        lock.lease_id = grant.lease_id;
        lock.ttl_ms = grant.ttl_ms;
        lock.deadline_ms = now_ms + u64::from(grant.ttl_ms);
        self.arm_lease(slot);
    }

    /// Arms a timer at the lease's deadline; earlier timers of the slot become stale.
    fn arm_lease(&mut self, slot: usize) {
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
    fn insert_timer(&mut self, deadline_ms: u64, timer: Timer) {
        let live_max = 2 * (self.index.len() + self.waiters_count) + TIMERS_STALE_MIN;
        if self.wheel.len() >= live_max {
            let slots = &self.slots;
            self.wheel
                .retain(|deadline_ms, timer| timer_is_live(slots, deadline_ms, timer));
        }
        self.wheel.insert(deadline_ms, timer);
    }

    /// Returns the key's slot to the free list.
    fn free(&mut self, slot: usize) {
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

    /// Queues the request on a held (or reserved) key.
    fn enqueue(&mut self, slot: usize, now_ms: u64, args: AcquireArgs<'_, W>) -> Acquire<W> {
        if self.slots[slot].queue_len() >= self.quotas.waiters_per_key_max {
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
        let lock = &mut self.slots[slot];
        let extra = lock
            .extra
            .get_or_insert_with(|| Box::new(Extra::new(Box::default())));
        extra.queue.push_back(queued);
        extra.live += 1;
        extra.wait_deadline_min_ms = extra.wait_deadline_min_ms.min(deadline_ms);
        self.waiters_count += 1;
        let timer = Timer {
            slot: slot as u32 | WAIT_TIMER_BIT,
            stamp: waiter_id as u32,
        };
        self.insert_timer(deadline_ms, timer);
        Acquire::Queued { waiter_id }
    }

    /// Handles one fired timer: drops stale ones, re-arms renewed leases, settles the rest.
    fn fire(
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
    fn settle(
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
            HandOff::Granted(handoff) if already_ended => events.push(Event::HandedOff(handoff)),
            HandOff::Granted(handoff) => events.push(Event::Expired {
                key,
                token,
                lease_id,
                handoff: Some(handoff),
            }),
            HandOff::Freed | HandOff::Deferred if !already_ended => events.push(Event::Expired {
                key,
                token,
                lease_id,
                handoff: None,
            }),
            HandOff::Freed | HandOff::Deferred => {}
        }
    }

    /// Removes the key's waiters whose wait ran out by `now_ms`, reporting each.
    fn time_out_waiters(&mut self, slot: usize, now_ms: u64, events: &mut Vec<Event<W>>) {
        let lock = &mut self.slots[slot];
        let Some(extra) = lock.extra.as_mut() else {
            return;
        };
        if extra.wait_deadline_min_ms > now_ms {
            return;
        }
        let holder_token = lock.token;
        let ttl_left_ms = lock.deadline_ms.saturating_sub(now_ms);
        let key = lock.key.as_slice();
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
    fn after_queue_shrank(&mut self, slot: usize) {
        let lock = &mut self.slots[slot];
        if lock.deadline_ms == 0 && lock.queue_len() == 0 {
            self.free(slot);
        } else {
            lock.tidy_extra();
        }
    }

    /// Passes a lock whose lease is over (expired, released, or ended earlier) to the first
    /// live waiter. Timed-out waiters must have been removed already.
    fn hand_off(&mut self, slot: usize, now_ms: u64, tokens: &TokenAllocator) -> HandOff<W> {
        if self.slots[slot].queue_len() > 0 && tokens.remaining() > 0 {
            self.drop_dead_waiters(slot);
        }
        if self.slots[slot].queue_len() == 0 {
            self.free(slot);
            return HandOff::Freed;
        }
        let Some(token) = tokens.try_next() else {
            if self.slots[slot].deadline_ms != 0 {
                self.defer(slot);
            }
            return HandOff::Deferred;
        };
        let lock = &mut self.slots[slot];
        let extra = lock.extra.as_mut().expect("queue is not empty");
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
        lock.set_meta(queued.meta.clone());
        lock.tidy_extra();
        let key: Box<[u8]> = lock.key.as_slice().into();
        self.waiters_left(1);
        let grant = Grant {
            token,
            lease_id: queued.lease_id,
            ttl_ms: queued.ttl_ms,
        };
        self.start_lease(slot, now_ms, grant);
        HandOff::Granted(Handoff {
            waiter,
            waiter_id: queued.waiter_id,
            grant,
            key,
            meta: queued.meta,
        })
    }

    /// Ends the slot's lease without a successor, reserving the key for its waiters until a
    /// token is available.
    fn defer(&mut self, slot: usize) {
        let lock = &mut self.slots[slot];
        lock.deadline_ms = 0;
        lock.generation = lock.generation.wrapping_add(1);
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
    fn drop_dead_waiters(&mut self, slot: usize) {
        let Some(extra) = self.slots[slot].extra.as_mut() else {
            return;
        };
        let mut dropped = 0;
        while extra
            .queue
            .front()
            .is_some_and(|queued| queued.waiter.as_ref().is_some_and(|w| !w.is_live()))
        {
            extra.queue.pop_front();
            extra.live -= 1;
            extra.drop_cancelled();
            dropped += 1;
        }
        self.waiters_left(dropped);
    }
}

/// Seed of the shard hash; different from any table's seed in practice, so the keys of one
/// shard are not clustered in that shard's index.
const SHARD_HASH_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The shard (`0..shard_count`) that owns `key`.
///
/// # Panics
/// If `shard_count` is 0.
pub fn shard_of(key: &[u8], shard_count: usize) -> usize {
    assert!(shard_count > 0, "no shards");
    // Multiply-shift maps the hash onto 0..shard_count without a division.
    ((u128::from(hash_key(SHARD_HASH_SEED, key)) * shard_count as u128) >> 64) as usize
}

/// Whether a timer still matters: a lease timer of the slot's current, unended lease, or the
/// timer of a waiter still queued with that deadline.
fn timer_is_live<W>(slots: &[Slot<W>], deadline_ms: u64, timer: &Timer) -> bool {
    let lock = &slots[(timer.slot & !WAIT_TIMER_BIT) as usize];
    if lock.token == 0 {
        return false;
    }
    if timer.slot & WAIT_TIMER_BIT == 0 {
        return lock.deadline_ms != 0 && lock.generation == timer.stamp;
    }
    let Some(queue) = lock.extra.as_ref().map(|extra| &extra.queue) else {
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
fn find_queued<W>(queue: &VecDeque<Queued<W>>, waiter_id: u64) -> Option<usize> {
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

/// Asserts the protocol limits the server must have checked before calling `acquire`.
fn assert_acquire_args<W>(args: &AcquireArgs<'_, W>) {
    assert!(
        args.key.len() <= KEY_LEN_MAX,
        "key of {} bytes",
        args.key.len()
    );
    assert!(
        args.meta.len() <= META_LEN_MAX,
        "meta of {} bytes",
        args.meta.len()
    );
    assert!(
        (TTL_MS_MIN..=TTL_MS_MAX).contains(&args.ttl_ms),
        "ttl_ms {}",
        args.ttl_ms
    );
    assert!(args.wait_ms <= WAIT_MS_MAX, "wait_ms {}", args.wait_ms);
    assert!(
        args.wait_ms == 0 || args.waiter.is_some(),
        "wait_ms > 0 without a waiter"
    );
}

#[cfg(test)]
mod tests;
