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
//! # Timers
//!
//! Every lease has exactly one timer: its slot's link in an intrusive wheel
//! ([`LinkedWheel`]), filed at or before the lease's deadline. Renewal only moves the
//! deadline (a field write); when the old filing comes due the wheel re-files the slot at the
//! deadline it has then. A renewal that *shortens* the lease re-files it at once, so a timer is
//! never late. Freeing a key unlinks its timer (O(1)), so no timer outlives its lease.
//!
//! Every waiter has one timer in a second wheel of entries, stamped with its id. Timers of
//! waiters that were served or cancelled fail validation and are dropped, so a cancel costs
//! nothing; they are compacted away once they outnumber the live ones, so that wheel stays
//! proportional to the waiters.
//!
//! # Renewals and the journal
//!
//! A restart gives every lease the TTL of its last journal record again, counted from the
//! restart. So a renewal to a longer TTL than that record's must be logged before it is
//! answered, or the restarted server could end the lease before the holder's deadline:
//! `renew` answers [`Renew::Unlogged`] and changes nothing, the caller logs the renewal and
//! calls `renew_logged` with the record's journal position. A renewal to the same or a
//! shorter TTL changes the deadline alone, logs nothing and is answered at once, unless the
//! lease's last record is a renewal that may not be durable yet; its reply then waits for the
//! shard's latest renewal record (`wait_lsn` of [`Renew::Renewed`]). The table knows journal
//! positions only as numbers its caller hands it.
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
//! Locks live in a slab of 72-byte `Slot`s in fixed chunks (lease id, token, deadline, the
//! lease timer's links, logged TTL, and a key of up to 23 bytes). Longer keys live in the
//! shard's key arena (`keys`: length plus one byte, in 4-byte granules, no allocation per
//! key). The rarely used rest (metadata, waiter queue) is in a map beside the slab
//! (`extras`), flagged in the slot. An index maps key hashes to slot numbers in 8-byte
//! buckets, growing by a quarter at a time (`index`). A lock with a key of up to 23 bytes
//! costs 72 bytes plus 9 to 12 of index; nothing else grows with the locks held. (Keys all
//! in the arena made slots 48 bytes, but a lookup then missed the cache three times, not
//! twice, and was up to twice as slow at 1M held locks, for the same memory at the
//! estimate's 23-byte keys.)
//!
//! # Read/write and semaphore keys
//!
//! A key asked for as a shared (read) lease or as semaphore permits ([`LeaseKind`], through
//! [`LockTable::acquire_kind`]) has several holders, each a lease of its own (lease id,
//! token, deadline, logged TTL). Such keys live in `shared`, not in the slab (but for one
//! with a single lease and no waiter, which keeps a plain slot, its kind in the slot's spare
//! bits: module `one_lease`, so it costs what a plain lock does): every request
//! first asks `shared` whether the key is there (`is_empty()`, then a hash lookup only while
//! the shard has such keys), so a plain lock keeps its 72-byte slot and its speed. A plain
//! ACQUIRE of a read/write key is its write side; a SHARED ACQUIRE of a plain lock moves
//! the key (holder and waiters, in order) into `shared`. Queues there are strictly FIFO:
//! nobody overtakes the head, so a waiting writer stops later readers and a large permit
//! request is never overtaken by smaller later ones. `shared`'s docs give the exact rules;
//! PROTOCOL.md 3.10 gives them to clients.
//!
//! # Layout
//! This file: [`LockTable`] and the requests (acquire, renew, release, inspect, check).
//! `shared`: read/write and semaphore keys (`shared_tests`: their tests and simulation).
//! `one_lease`: such a key's only lease kept in a plain slot.
//! `slot`: the slab entry, its extras, queued acquires, waiter timers. `slab`: slots in
//! chunks. `keys`: the key arena. `lease`: a lease's life
//! (grant, timer, settle, free). `queue`: waiters (queue, time-out, hand-off, compaction).
//! `upkeep`: ticker, recovery, snapshot and disconnect entry points. `index`: key -> slot.
//! `quota`: server-wide counts. `outcome`: the public vocabulary. `invariants`: self-checks.

mod acquire_ids;
mod extras;
mod index;
mod invariants;
mod keys;
mod lease;
mod one_lease;
mod outcome;
mod queue;
mod quota;
mod shared;
#[cfg(test)]
mod shared_tests;
#[cfg(test)]
pub(crate) mod sim;
mod slab;
mod slot;
mod tokens;
mod upkeep;

use std::sync::Arc;

use tenure_protocol::limits::{KEY_LEN_MAX, META_LEN_MAX, TTL_MS_MAX, TTL_MS_MIN, WAIT_MS_MAX};
use tenure_protocol::{LeaseId, LeaseKind};

use crate::wheel::{LinkedWheel, TimerWheel, HEAD_BIT};
pub use acquire_ids::{LeaseIdCipher, Repeat, ENDED_KEEP_MS, ENDED_PER_SHARD_MAX};
use index::{hash_key, KeyIndex};
use keys::KeyArena;
pub use outcome::{
    Acquire, AcquireArgs, Check, Event, Grant, Handoff, HeldLock, Inspect, Limit, Release, Renew,
    TableLimits, WaiterSink,
};
pub use quota::{Quota, Quotas};
pub use shared::SharedInspect;
use slab::Slab;
use slot::Extra;
pub use slot::LoggedTtl;
#[cfg(test)]
use slot::Queued;
use slot::{Slot, Timer};
pub use tokens::TokenAllocator; // size checked in the tests

/// The waiters' wheel is compacted (stale timers dropped) once it holds more than twice the
/// live waiters plus this many; compaction is O(timers), so this keeps it amortized O(1) per
/// insert and bounds the wheel's memory by the number of waiters. Small in tests so the
/// simulation exercises it.
const TIMERS_STALE_MIN: usize = if cfg!(test) { 8 } else { 4096 };

/// A queue is compacted (cancelled waiters dropped) once they outnumber its live waiters plus
/// this many, so a cancel is amortized O(1) and a queue's length stays within twice its live
/// waiters plus this.
const CANCELLED_SLACK: usize = if cfg!(test) { 2 } else { 16 };

/// Largest `held_max` a table accepts: slot numbers are the lease wheel's node numbers, which
/// stay below its `HEAD_BIT`.
pub const HELD_MAX_LIMIT: usize = (HEAD_BIT - 1) as usize;

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
    /// Derives the lease ids of ACQUIREs with an acquire id (module `acquire_ids`).
    lease_ids: Arc<acquire_ids::LeaseIdCipher>,
    /// The slab; a lock's number never changes while its key has a slot.
    slots: Slab<W>,
    /// The keys of the slots in use.
    keys: KeyArena,
    /// Metadata and waiter queues of the slots that have any.
    extras: extras::Extras<W>,
    /// Numbers of free slots, reused before the slab grows.
    free_slots: Vec<u32>,
    /// Key hash to slot number.
    index: KeyIndex,
    /// Lease timers: one per running lease, linked through its slot.
    lease_timers: LinkedWheel,
    /// Waiter timers (stale ones included until they fire or are compacted).
    wait_timers: TimerWheel<Timer>,
    /// Slots whose lease ended while no token was available (may hold stale numbers).
    deferred: Vec<u32>,
    /// Scratch space for lease timers fired by one `advance`.
    fired_leases: Vec<u32>,
    /// Scratch space for waiter timers fired by one `advance`.
    fired: Vec<Timer>,
    /// Waiters queued over all keys.
    waiters_count: usize,
    /// The next waiter id to hand out.
    next_waiter_id: u64,
    /// Queue entries visited or moved by `cancel_waiter`, so tests can check it stays
    /// O(log n) per cancel rather than O(n).
    #[cfg(test)]
    cancel_steps: u64,
    /// The journal position of the latest renewal record logged in this shard
    /// ([`LockTable::renew_logged`]), at or after that of any lease's pending renewal: a
    /// renewal waiting on a pending one waits for this, rather than a slot keeping 8 bytes.
    renewal_lsn_max: u64,
    /// Slots holding the one lease of a read/write or semaphore key (module `one_lease`).
    one_lease_slots: usize,
    /// The latest `now_ms` seen: an earlier one (threads read the clock before taking the
    /// shard's mutex) is treated as this, so time never runs backwards inside the table.
    now_ms: u64,
    /// Which live leases answered an ACQUIRE with an acquire id, and recently ended ones.
    acquire_ids: acquire_ids::AcquireIds,
    /// Read/write and semaphore keys, with several holders each (`shared`).
    shared: shared::SharedKeys<W>,
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
            slots: Slab::new(),
            keys: KeyArena::default(),
            extras: extras::Extras::default(),
            free_slots: Vec::new(),
            index: KeyIndex::new(),
            lease_timers: LinkedWheel::new(),
            wait_timers: TimerWheel::new(),
            deferred: Vec::new(),
            fired_leases: Vec::new(),
            fired: Vec::new(),
            waiters_count: 0,
            next_waiter_id: 1,
            #[cfg(test)]
            cancel_steps: 0,
            renewal_lsn_max: 0,
            one_lease_slots: 0,
            now_ms: 0,
            acquire_ids: acquire_ids::AcquireIds::default(),
            lease_ids: Arc::new(acquire_ids::LeaseIdCipher::from_seed(hash_seed)),
            shared: shared::SharedKeys::new(hash_seed),
        }
    }

    /// Keys with a slot: held, expired but not yet reaped, or reserved for a handoff.
    pub fn slots_in_use(&self) -> usize {
        self.index.len()
    }

    /// Leases held on read/write and semaphore keys (each permit lease counts once).
    pub fn shared_holders_count(&self) -> usize {
        self.shared.holders_count() + self.one_lease_slots
    }

    /// Read/write and semaphore keys with holders or waiters.
    pub fn shared_keys_count(&self) -> usize {
        self.shared.keys_count() + self.one_lease_slots
    }

    /// Waiters queued over all keys (some may have timed out but not been reaped yet).
    pub fn waiters_count(&self) -> usize {
        self.waiters_count + self.shared.waiters_count()
    }

    /// Heap bytes reserved by the slab, the keys, the index, the free list and the waiters'
    /// wheel (not counting metadata and waiters' queues).
    pub fn memory_bytes(&self) -> usize {
        self.slots.bytes()
            + self.keys.bytes()
            + self.index.bytes()
            + self.free_slots.capacity() * size_of::<u32>()
            + self.wait_timers.memory_bytes()
            + self.extras.capacity() * size_of::<(u32, Extra<W>)>()
            + self.acquire_ids.memory_bytes()
            + self.shared.memory_bytes()
    }

    /// The holder's metadata of a slot in use.
    fn meta(&self, slot: usize) -> &[u8] {
        extras::get(&self.slots, &self.extras, slot).map_or(&[], |extra| &extra.meta)
    }

    /// Waiters queued on a slot's key (not counting cancelled ones).
    fn queue_len(&self, slot: usize) -> usize {
        extras::get(&self.slots, &self.extras, slot).map_or(0, |extra| extra.live)
    }

    /// A lower bound on when `advance` will next have timers to process (`None`: no timers).
    pub fn next_due_ms(&self) -> Option<u64> {
        [
            self.lease_timers.next_due_ms(),
            self.wait_timers.next_due_ms(),
            self.shared_next_due_ms(),
        ]
        .into_iter()
        .flatten()
        .min()
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
        if let Some(number) = self.shared.find(args.key) {
            // The write side of a read/write key (or a mismatch on a semaphore's).
            self.settle_shared(number, now_ms, tokens, events);
            if self.shared.find(args.key).is_some() {
                return self.acquire_shared(now_ms, args, LeaseKind::Exclusive, tokens, events);
            }
        }
        let slot = self.find(args.key);
        self.acquire_plain(now_ms, slot, args, tokens, events)
    }

    /// The rest of [`LockTable::acquire`] on a key that is not shared, whose slot (if it has
    /// one) is `slot`, at the table's time `now_ms`.
    fn acquire_plain(
        &mut self,
        now_ms: u64,
        slot: Option<usize>,
        args: AcquireArgs<'_, W>,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Acquire<W> {
        let Some(slot) = slot else {
            return self.grant_free(now_ms, args, tokens);
        };
        self.settle(slot, now_ms, tokens, events);
        let lock = &self.slots[slot];
        if lock.token == 0 {
            return self.grant_free(now_ms, args, tokens);
        }
        if !lock.is_plain() {
            return self.acquire_beside_one_lease(now_ms, slot, args, tokens, events);
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

    /// Like [`LockTable::acquire`], for a lease of `kind`: a shared (read) lease or semaphore
    /// permits go to the key's multi-holder entry (module `shared`), an exclusive one to
    /// `acquire`.
    ///
    /// # Panics
    /// As `acquire`, and if `kind`'s permit counts are out of range.
    pub fn acquire_kind(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Acquire<W> {
        if kind.is_exclusive() {
            return self.acquire(now_ms, args, tokens, events);
        }
        assert_acquire_args(&args);
        assert!(kind.validate().is_ok(), "acquire_kind: {kind:?}");
        let now_ms = self.observe(now_ms);
        self.acquire_shared(now_ms, args, kind, tokens, events)
    }

    /// Extends the lease to `now_ms + ttl_ms` if `lease_id` holds the key unexpired, unless
    /// `ttl_ms` is longer than the lease's last journal record says: then nothing changes and
    /// the caller logs the renewal first ([`Renew::Unlogged`]). `durable_lsn` tells how far
    /// the journal is durable; it is asked only about a lease whose renewal record may not be
    /// durable yet, so the common renewal reads nothing shared.
    ///
    /// # Panics
    /// If `ttl_ms` is outside `TTL_MS_MIN..=TTL_MS_MAX`.
    pub fn renew(
        &mut self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        ttl_ms: u32,
        durable_lsn: impl FnOnce() -> u64,
    ) -> Renew {
        assert!(
            (TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms),
            "ttl_ms {ttl_ms} out of range"
        );
        let now_ms = self.observe(now_ms);
        if let Some(number) = self.shared.find(key) {
            return self.renew_shared(number, now_ms, lease_id, ttl_ms, durable_lsn);
        }
        let Some(slot) = self.find(key) else {
            return Renew::Lost;
        };
        let lock = &mut self.slots[slot];
        if lock.deadline_ms <= now_ms || lock.lease_id != lease_id {
            return Renew::Lost;
        }
        if ttl_ms > lock.logged.ttl_ms() {
            return Renew::Unlogged { token: lock.token };
        }
        let mut wait_lsn = 0;
        if lock.logged.is_pending() {
            // The record covering this TTL is at or before the shard's latest renewal record.
            if durable_lsn() >= self.renewal_lsn_max {
                lock.logged = LoggedTtl::settled(lock.logged.ttl_ms()).derived_as(lock.logged);
            } else {
                wait_lsn = self.renewal_lsn_max;
            }
        }
        self.extend(slot, now_ms, ttl_ms);
        Renew::Renewed { ttl_ms, wait_lsn }
    }

    /// Makes the renewal of `token`'s lease to `ttl_ms` that [`LockTable::renew`] answered
    /// [`Renew::Unlogged`], now that its record is at journal position `lsn` (0: the journal
    /// does not log leases, so there is nothing to wait for). Its reply waits for `lsn`.
    ///
    /// # Panics
    /// If `token`'s lease does not hold `key` unexpired: call it under the same hold of the
    /// shard's lock as the `renew`.
    pub fn renew_logged(&mut self, now_ms: u64, key: &[u8], token: u64, ttl_ms: u32, lsn: u64) {
        let now_ms = self.observe(now_ms);
        if let Some(number) = self.shared.find(key) {
            return self.renew_logged_shared(number, now_ms, token, ttl_ms, lsn);
        }
        let slot = self
            .find(key)
            .filter(|&slot| {
                self.slots[slot].token == token && self.slots[slot].deadline_ms > now_ms
            })
            .expect("renew_logged: the lease that renew answered Unlogged is gone");
        let was = self.slots[slot].logged;
        self.slots[slot].logged = if lsn == 0 {
            LoggedTtl::settled(ttl_ms)
        } else {
            LoggedTtl::pending(ttl_ms)
        }
        .derived_as(was);
        self.renewal_lsn_max = self.renewal_lsn_max.max(lsn);
        self.extend(slot, now_ms, ttl_ms);
    }

    /// Moves a held lease's deadline to `now_ms + ttl_ms`.
    fn extend(&mut self, slot: usize, now_ms: u64, ttl_ms: u32) {
        let lock = &mut self.slots[slot];
        let deadline_ms = now_ms + u64::from(ttl_ms);
        let shortened = deadline_ms < lock.deadline_ms;
        lock.deadline_ms = deadline_ms;
        if shortened {
            // The timer would be late: file it at the new deadline. (A longer lease leaves
            // it where it is; the wheel re-files it when the old filing comes due.)
            self.arm_lease(slot);
        }
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
        if let Some(number) = self.shared.find(key) {
            return self.release_shared(number, now_ms, lease_id, tokens, events);
        }
        let hash = hash_key(self.hash_seed, key);
        let Some(slot) = self.find_hashed(hash, key) else {
            return Release::NotOwner;
        };
        let lock = &mut self.slots[slot];
        if lock.deadline_ms <= now_ms || lock.lease_id != lease_id {
            return Release::NotOwner;
        }
        let token = lock.token;
        let derived = lock.logged.is_derived();
        if derived {
            // For the end the caller reports next; the mark goes with the lease.
            lock.logged = lock.logged.with_derived(false);
            self.acquire_ids.released_derived = Some((token, lease_id));
        }
        self.acquire_ids.released(token, hash, derived);
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
        if let Some(number) = self.shared.find(key) {
            self.settle_shared(number, now_ms, tokens, events);
        } else if let Some(slot) = self.find(key) {
            self.settle(slot, now_ms, tokens, events);
        }
    }

    /// The key's state as of `now_ms`, without settling it.
    pub fn inspect(&self, now_ms: u64, key: &[u8]) -> Inspect<'_> {
        let now_ms = now_ms.max(self.now_ms);
        if let Some(number) = self.shared.find(key) {
            return self.inspect_shared(number, now_ms);
        }
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
            waiters: u32::try_from(self.queue_len(slot)).expect("queue length bounded by limits"),
            meta: self.meta(slot),
        }
    }

    /// Whether `token` is the fencing token of the unexpired lease on `key`.
    pub fn check(&self, now_ms: u64, key: &[u8], token: u64) -> Check {
        let now_ms = now_ms.max(self.now_ms);
        if let Some(number) = self.shared.find(key) {
            return self.check_shared(number, now_ms, token);
        }
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
        self.find(key).is_some() || self.shared.find(key).is_some()
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
