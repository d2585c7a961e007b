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
//!
//! # Layout
//! This file: [`LockTable`] and the requests (acquire, renew, release, inspect, check).
//! `slot`: the slab entry, its extras, queued acquires, timers. `lease`: a lease's life
//! (grant, timer, settle, free). `queue`: waiters (queue, time-out, hand-off, compaction).
//! `upkeep`: ticker, recovery, snapshot and disconnect entry points. `index`: key -> slot.
//! `quota`: server-wide counts. `outcome`: the public vocabulary. `invariants`: self-checks.

mod index;
mod invariants;
mod lease;
mod outcome;
mod queue;
mod quota;
#[cfg(test)]
pub(crate) mod sim;
mod slot;
mod upkeep;

use std::sync::Arc;

use tenure_protocol::limits::{KEY_LEN_MAX, META_LEN_MAX, TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};
use tenure_protocol::LeaseId;

use crate::tokens::TokenAllocator;
use crate::wheel::TimerWheel;
use index::{hash_key, KeyIndex};
pub use outcome::{
    Acquire, AcquireArgs, Check, Event, Grant, Handoff, HeldLock, Inspect, Limit, Release, Renew,
    TableLimits, WaiterSink,
};
pub use quota::{Quota, Quotas};
use slot::{Slot, Timer};
#[cfg(test)]
use {index::KeyBytes, slot::Extra, slot::Queued}; // sizes checked in the tests

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

/// What `hand_off` did with a lock whose lease is over.
enum HandoffStep<W> {
    /// The next live waiter holds it.
    Granted(Handoff<W>),
    /// No live waiter: the key is free.
    Freed,
    /// Live waiters but no token: the key stays reserved for them.
    Deferred,
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

impl<W: WaiterSink> LockTable<W> {
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
    pub fn slots_in_use(&self) -> usize {
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
            HandoffStep::Granted(handoff) => Some(handoff),
            HandoffStep::Freed | HandoffStep::Deferred => None,
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

    /// The unexpired lease on `key` as of `now_ms`, whole (what a Grant record of it needs).
    pub fn held(&self, now_ms: u64, key: &[u8]) -> Option<HeldLock<'_>> {
        let now_ms = now_ms.max(self.now_ms);
        let lock = &self.slots[self.find(key)?];
        (lock.token != 0 && lock.deadline_ms > now_ms).then(|| HeldLock {
            key: lock.key.as_slice(),
            lease_id: lock.lease_id,
            token: lock.token,
            ttl_ms: lock.ttl_ms,
            ttl_left_ms: lock.deadline_ms - now_ms,
            meta: lock.meta(),
        })
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

    /// Whether `key` has a slot (held, expired but unreaped, or reserved): [`Self::restore`]
    /// needs a key without one, and the simulation sees a reserved key being freed by
    /// `advance`, the one change that yields no event.
    pub(crate) fn has_slot(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
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
