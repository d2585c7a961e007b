//! Keys with several holders at once: read/write locks and counting semaphores.
//!
//! A plain lock lives in its 72-byte slot. A key that some ACQUIRE asked for as
//! [`LeaseKind::Shared`] or [`LeaseKind::Permits`] lives here instead, as an [`Entry`]: its
//! holders (each a lease of its own: lease id, fencing token, deadline, logged TTL, metadata)
//! and one FIFO queue of waiters of every kind. The table reaches it by one check per request
//! (`SharedKeys::is_empty`, then a hash lookup only while some key of the shard is here), so
//! plain locks keep their slot and their speed.
//!
//! # Two kinds of entry
//! - A **read/write** entry (`limit == None`): any number of [`LeaseKind::Shared`] holders
//!   (up to `PERMITS_MAX`) while no exclusive one, or one [`LeaseKind::Exclusive`] holder
//!   alone. A plain ACQUIRE of the key is the write side. A SHARED ACQUIRE of a key held as a
//!   plain lock moves the key here: its holder becomes the entry's writer and its waiters the
//!   entry's first exclusive waiters, in order and under their waiter ids.
//! - A **semaphore** entry (`limit == Some(n)`): holders of [`LeaseKind::Permits`] whose
//!   counts add up to at most `n`. Every ACQUIRE of the key must name the same limit while
//!   the entry exists (anyone holds or waits); any other kind or limit is refused
//!   ([`Acquire::KindMismatch`]), as is a PERMITS ACQUIRE of a key held as a plain or
//!   read/write lock. The entry goes when its last holder and waiter do, so the next
//!   ACQUIRE may name a new limit.
//!
//! # Strict FIFO
//! A request is granted at once only if no live waiter is queued on the key and it fits
//! beside the holders; otherwise it queues (or, with no wait, is answered LOCKED). Whenever
//! a holder ends (release, expiry, disconnect) or a waiter leaves, the queue is served from
//! its head: each head that fits is granted, with a fresh token, and the next one is looked
//! at; the first that does not fit stops the pass. Nobody overtakes the head: a writer in line
//! stops every reader behind it, a waiter asking for more permits than are free stops smaller
//! requests behind it, and one writer's end grants every reader queued in a row behind it.
//!
//! # Tokens
//! Every holder's token comes from the shard's [`TokenAllocator`], strictly increasing per key
//! (and table-wide), so a writer granted after readers has a token above every one of
//! theirs. CHECK answers CURRENT for a reader's token exactly while that read lease holds the
//! key unexpired, which is also exactly while no write lease was granted after it: a writer
//! is granted only once no reader holds.
//!
//! # Timers
//! Each entry has at most one live timer in `timers`, at or before its earliest holder or
//! waiter deadline (a stamp tells it from stale ones). When it fires the entry is settled:
//! expired holders end, timed-out waiters leave, the queue is served, and the timer is filed
//! again at the new earliest deadline. A renewal that shortens a lease re-files it at once.
//! Stale timers are compacted away once they outnumber the entries.
//!
//! # Serving
//! Whether a head fits is decided in constant time (`Entry::fits`: a count of the
//! semaphore's permits in use, and the first holder, since a writer holds alone), the timer
//! is re-filed once per pass, not per grant, and a settle before the entry's timer is due
//! skips the scan for expired holders and waiters. A release that grants k waiters thus costs
//! the search for its own lease among the holders plus O(k).
//!
//! # Memory
//! A key whose only lease is a read lease or permits, with no waiter, is not here at all:
//! it stays in a plain 72-byte slot, its kind in the slot's spare bits (module `one_lease`),
//! and moves here at its second holder or first waiter (keys over `KEY_INLINE_MAX` bytes
//! excepted: they come here from the first lease). Here, a holder is a 56-byte [`Holder`]
//! in its entry's vector, plus one held-lock unit of the quotas; the entry is paid once per
//! key: 104 bytes in chunks that never move, the key's bytes once on the heap, an
//! 8-byte bucket in the key index, a 16-byte timer. The holders' vector has room for exactly
//! one holder until a second comes, and the queue is a null pointer while nobody waits, so
//! an entry with one lease costs about 200 bytes, where a slot costs about 90 (its lease,
//! key and timer link share one 72-byte slot).

use std::collections::VecDeque;

use tenure_protocol::limits::PERMITS_MAX;
use tenure_protocol::{LeaseId, LeaseKind};

use super::one_lease;
use super::slot::LoggedTtl;
use super::*;

/// Entries per chunk of [`Entries`]: 256 of 104 bytes, 26 KiB.
const ENTRY_CHUNK_LEN: usize = 256;

/// The stale timers the shared wheel keeps before compaction, beyond one per entry.
const SHARED_TIMERS_STALE_MIN: usize = if cfg!(test) { 8 } else { 1024 };

/// The keys of one shard that have (or may have) several holders; see the module docs.
#[derive(Debug)]
pub(super) struct SharedKeys<W> {
    /// Key hash to entry number; the key itself is only in its entry, stored once.
    ids: KeyIndex,
    /// The seed of `ids`' key hash (the table's): clients choose keys.
    seed: u64,
    /// Entries by number; `None` on the free list.
    entries: Entries<W>,
    /// Numbers of vacant entries.
    vacant: Vec<u32>,
    /// Entry timers: (entry number, stamp), live while the entry's `armed` has that stamp.
    timers: TimerWheel<(u32, u32)>,
    /// The next timer stamp.
    next_stamp: u32,
    /// Entries whose queue could not be served for want of tokens (may repeat or be stale).
    stalled: Vec<u32>,
    /// Holders over all entries.
    holders_count: usize,
    /// Waiters over all entries.
    waiters_count: usize,
}

/// The entries of one shard, by number, in chunks of [`ENTRY_CHUNK_LEN`] allocated one at a
/// time and never moved, like the slab's: a vector grown by doubling would leave up to half
/// its room unused, and every growth would leave the allocator a freed block of a size
/// nothing asks for again (an entry is most of a one-lease key's memory). The first chunk
/// grows as a vector does, so a shard with few shared keys keeps a small one.
#[derive(Debug)]
struct Entries<W> {
    /// Every chunk but the last is full; none but the first ever reallocates.
    chunks: Vec<Vec<Option<Entry<W>>>>,
    /// Entries in all chunks (vacant ones included).
    len: usize,
}

impl<W> Entries<W> {
    fn len(&self) -> usize {
        self.len
    }

    /// Appends `entry` and returns its number.
    fn push(&mut self, entry: Option<Entry<W>>) -> usize {
        if self.len.is_multiple_of(ENTRY_CHUNK_LEN) {
            let room = if self.chunks.is_empty() {
                0
            } else {
                ENTRY_CHUNK_LEN
            };
            self.chunks.push(Vec::with_capacity(room));
        }
        self.chunks.last_mut().expect("a chunk").push(entry);
        self.len += 1;
        self.len - 1
    }

    /// Every entry (vacant ones as `None`) in number order.
    fn iter(&self) -> impl Iterator<Item = &Option<Entry<W>>> + '_ {
        self.chunks.iter().flatten()
    }

    /// Heap bytes of the chunks and the chunk table.
    fn bytes(&self) -> usize {
        let chunks: usize = self.chunks.iter().map(Vec::capacity).sum();
        chunks * size_of::<Option<Entry<W>>>()
            + self.chunks.capacity() * size_of::<Vec<Option<Entry<W>>>>()
    }
}

impl<W> std::ops::Index<usize> for Entries<W> {
    type Output = Option<Entry<W>>;

    fn index(&self, number: usize) -> &Option<Entry<W>> {
        &self.chunks[number / ENTRY_CHUNK_LEN][number % ENTRY_CHUNK_LEN]
    }
}

impl<W> std::ops::IndexMut<usize> for Entries<W> {
    fn index_mut(&mut self, number: usize) -> &mut Option<Entry<W>> {
        &mut self.chunks[number / ENTRY_CHUNK_LEN][number % ENTRY_CHUNK_LEN]
    }
}

/// One shared key: its holders and its queue.
#[derive(Debug)]
pub(super) struct Entry<W> {
    /// The key.
    key: Box<[u8]>,
    /// A semaphore's number of permits; `None` for a read/write key.
    limit: Option<u32>,
    /// The permits its holders hold (a semaphore's; 0 for a read/write key), kept so that
    /// `fits` is one comparison, not a walk over the holders.
    in_use: u32,
    /// Holders, in token order (grant order; a restored one is put in its place), so the
    /// newest is the last. Room for exactly one on the first grant, growing as usual from
    /// the second.
    holders: Vec<Holder>,
    /// The earliest holder deadline (`u64::MAX` without holders), kept so that `locked`, the
    /// answer to every LOCKED, is constant time: found again by a walk only when the holder
    /// that had it ends or is renewed, which walked the holders to find it anyway.
    first_deadline_ms: u64,
    /// Waiters, first come first served.
    queue: Queue<W>,
    /// The deadline and stamp of the entry's live timer.
    armed: Option<(u64, u32)>,
    /// The newest token any lease of the key had (0 before the first): what LOCKED names
    /// while no lease holds the key (PROTOCOL.md 3.2 LOCKED), so it never names token 0.
    last_token: u64,
}

/// One lease on a shared key. 56 bytes.
#[derive(Debug, Clone)]
pub(super) struct Holder {
    /// The lease id its holder presents.
    pub(super) lease_id: LeaseId,
    /// Its fencing token.
    pub(super) token: u64,
    /// It is over once `now_ms >= deadline_ms`.
    pub(super) deadline_ms: u64,
    /// The TTL of its last journal record.
    pub(super) logged: LoggedTtl,
    /// What it holds ([`Held::kind`] with its entry's limit).
    pub(super) held: Held,
    /// Its metadata.
    pub(super) meta: Box<[u8]>,
}

// Most of a permit's or read lease's memory; see the module docs.
const _: () = assert!(size_of::<Holder>() == 56);
// A key's share of a shared key's memory (8 of it `last_token`, 8 `first_deadline_ms`); see
// the module docs.
const _: () = assert!(size_of::<Option<Entry<()>>>() == 104);

/// What a holder holds, in 4 bytes rather than a [`LeaseKind`]'s 12, since its entry knows
/// the semaphore's limit: the permits it holds of a semaphore (`1..=PERMITS_MAX`), or
/// [`Held::EXCLUSIVE`] / [`Held::SHARED`] of a read/write key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held(u32);

impl Held {
    /// The write side of a read/write key.
    const EXCLUSIVE: Held = Held(0);
    /// A read lease.
    const SHARED: Held = Held(u32::MAX);

    fn of(kind: LeaseKind) -> Held {
        match kind {
            LeaseKind::Exclusive => Held::EXCLUSIVE,
            LeaseKind::Shared => Held::SHARED,
            LeaseKind::Permits { count, .. } => {
                assert!((1..=PERMITS_MAX).contains(&count), "{count} permits");
                Held(count)
            }
        }
    }

    /// The lease's kind, in an entry of `limit`.
    ///
    /// # Panics
    /// If the holder does not belong in such an entry (a broken table).
    fn kind(self, limit: Option<u32>) -> LeaseKind {
        match (self, limit) {
            (Held::EXCLUSIVE, None) => LeaseKind::Exclusive,
            (Held::SHARED, None) => LeaseKind::Shared,
            (Held(count), Some(limit)) if (1..=PERMITS_MAX).contains(&count) => {
                LeaseKind::Permits { count, limit }
            }
            (held, limit) => panic!("a holder of {held:?} in an entry of limit {limit:?}"),
        }
    }

    /// The permits it holds of a semaphore; 0 of a read/write key.
    fn permits(self) -> u32 {
        if self == Held::SHARED {
            0
        } else {
            self.0
        }
    }
}

/// An entry's waiters: nothing but a null pointer while there are none (most keys, most of
/// the time), a boxed queue while there are.
// The box is the point: 8 bytes in every entry rather than a `VecDeque`'s 32.
#[allow(clippy::box_collection)]
#[derive(Debug)]
struct Queue<W>(Option<Box<VecDeque<Waiting<W>>>>);

impl<W> Queue<W> {
    fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|queue| queue.is_empty())
    }

    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |queue| queue.len())
    }

    /// Heap bytes: the box and the queue's buffer.
    fn memory_bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |queue| {
            size_of::<VecDeque<Waiting<W>>>() + queue.capacity() * size_of::<Waiting<W>>()
        })
    }

    fn iter(&self) -> impl Iterator<Item = &Waiting<W>> + '_ {
        self.0.iter().flat_map(|queue| queue.iter())
    }

    fn front(&self) -> Option<&Waiting<W>> {
        self.0.as_ref()?.front()
    }

    fn push_back(&mut self, waiting: Waiting<W>) {
        self.0.get_or_insert_default().push_back(waiting);
    }

    /// Removes the waiter at `at`; the box goes with the last one.
    fn remove(&mut self, at: usize) -> Option<Waiting<W>> {
        let queue = self.0.as_mut()?;
        let waiting = queue.remove(at);
        if queue.is_empty() {
            self.0 = None;
        }
        waiting
    }

    fn pop_front(&mut self) -> Option<Waiting<W>> {
        self.remove(0)
    }

    /// Takes every waiter out, in order.
    fn take(&mut self) -> VecDeque<Waiting<W>> {
        self.0.take().map(|queue| *queue).unwrap_or_default()
    }

    /// Puts `queue` in place of the (empty) queue.
    fn set(&mut self, queue: VecDeque<Waiting<W>>) {
        assert!(self.is_empty(), "a queue set over waiters");
        self.0 = (!queue.is_empty()).then(|| Box::new(queue));
    }
}

/// A queued acquire on a shared key.
#[derive(Debug)]
struct Waiting<W> {
    /// Where to deliver the outcome.
    waiter: W,
    /// Unique within the table.
    waiter_id: u64,
    /// The lease id it will hold under.
    lease_id: LeaseId,
    /// The TTL it asked for.
    ttl_ms: u32,
    /// It gives up once `now_ms >= deadline_ms`.
    deadline_ms: u64,
    /// What it asks for.
    kind: LeaseKind,
    /// Its metadata.
    meta: Box<[u8]>,
}

/// What INSPECT tells of a shared key beyond HELD's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SharedInspect {
    /// A semaphore's limit; 0 for a read/write key.
    pub limit: u32,
    /// Unexpired holders.
    pub holders: u32,
    /// Permits held (a semaphore), or readers (a read/write key).
    pub in_use: u32,
    /// Whether an exclusive (write) lease holds it.
    pub writer: bool,
    /// Waiting for a shared lease or permits.
    pub waiting_shared: u32,
    /// Waiting for the key alone (writers).
    pub waiting_exclusive: u32,
}

impl<W> SharedKeys<W> {
    /// No shared key; keys hashed with `seed`.
    pub(super) fn new(seed: u64) -> Self {
        SharedKeys {
            ids: KeyIndex::new(),
            seed,
            entries: Entries {
                chunks: Vec::new(),
                len: 0,
            },
            vacant: Vec::new(),
            timers: TimerWheel::new(),
            next_stamp: 0,
            stalled: Vec::new(),
            holders_count: 0,
            waiters_count: 0,
        }
    }

    /// Whether no key of the shard is shared: the one check a plain request pays.
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.ids.len() == 0
    }

    /// Whether the ticker has anything to do here: entries, timers (stale ones too, which
    /// must be drained) or stalled queues.
    pub(super) fn has_work(&self) -> bool {
        !self.is_empty() || !self.timers.is_empty() || !self.stalled.is_empty()
    }

    /// The entry number of `key`, if it is shared.
    #[inline]
    pub(super) fn find(&self, key: &[u8]) -> Option<u32> {
        if self.is_empty() {
            return None;
        }
        let entries = &self.entries;
        self.ids.find(hash_key(self.seed, key), |number| {
            entries[number as usize]
                .as_ref()
                .is_some_and(|entry| *entry.key == *key)
        })
    }

    /// Holders over all entries.
    pub(super) fn holders_count(&self) -> usize {
        self.holders_count
    }

    /// Waiters over all entries.
    pub(super) fn waiters_count(&self) -> usize {
        self.waiters_count
    }

    /// Keys with an entry.
    pub(super) fn keys_count(&self) -> usize {
        self.ids.len()
    }

    /// Heap bytes of the entries and their holders and queues (keys and metadata aside).
    pub(super) fn memory_bytes(&self) -> usize {
        let entries = self.entries.bytes();
        let inside: usize = self
            .entries
            .iter()
            .flatten()
            .map(|e| e.holders.capacity() * size_of::<Holder>() + e.queue.memory_bytes())
            .sum();
        entries + inside + self.timers.memory_bytes() + self.ids.bytes()
    }

    fn entry(&self, number: u32) -> &Entry<W> {
        self.entries[number as usize]
            .as_ref()
            .expect("a live entry number")
    }

    fn entry_mut(&mut self, number: u32) -> &mut Entry<W> {
        self.entries[number as usize]
            .as_mut()
            .expect("a live entry number")
    }

    /// A new, empty entry for `key`.
    fn open(&mut self, key: &[u8], limit: Option<u32>) -> u32 {
        let entry = Entry {
            key: key.into(),
            limit,
            in_use: 0,
            holders: Vec::new(),
            first_deadline_ms: u64::MAX,
            queue: Queue(None),
            armed: None,
            last_token: 0,
        };
        let number = match self.vacant.pop() {
            Some(number) => {
                self.entries[number as usize] = Some(entry);
                number
            }
            None => {
                let number = self.entries.push(Some(entry));
                u32::try_from(number).expect("entries bounded by held_max")
            }
        };
        self.ids.insert(hash_key(self.seed, key), number);
        number
    }

    /// Drops an entry with no holder and no waiter.
    fn close(&mut self, number: u32) {
        let entry = self.entries[number as usize].take().expect("a live entry");
        assert!(entry.holders.is_empty() && entry.queue.is_empty());
        self.ids.remove(hash_key(self.seed, &entry.key), number);
        self.vacant.push(number);
    }
}

impl<W> Entry<W> {
    /// Whether `kind` may hold beside the holders now, in constant time: a writer holds
    /// alone (`check_entry`), so the first holder tells a read-held key from a write-held
    /// one, and `in_use` counts a semaphore's permits.
    fn fits(&self, kind: LeaseKind) -> bool {
        match kind {
            LeaseKind::Exclusive => self.holders.is_empty(),
            LeaseKind::Shared => {
                self.holders.len() < PERMITS_MAX as usize
                    && self.holders.first().is_none_or(|h| h.held == Held::SHARED)
            }
            LeaseKind::Permits { count, limit } => self.in_use + count <= limit,
        }
    }

    /// Adds a holder, keeping `in_use`.
    fn push_holder(&mut self, holder: Holder) {
        if self.holders.capacity() == 0 {
            // A first push would reserve four (256 bytes) for the one holder most keys have.
            self.holders.reserve_exact(1);
        }
        self.in_use += holder.held.permits();
        self.last_token = self.last_token.max(holder.token);
        self.first_deadline_ms = self.first_deadline_ms.min(holder.deadline_ms);
        match self.holders.last() {
            Some(last) if last.token > holder.token => {
                let at = self.holders.partition_point(|h| h.token < holder.token);
                self.holders.insert(at, holder);
            }
            _ => self.holders.push(holder),
        }
    }

    /// Finds `first_deadline_ms` again after the holder that had it ended or moved.
    fn refresh_first_deadline(&mut self) {
        let first = self.holders.iter().map(|h| h.deadline_ms).min();
        self.first_deadline_ms = first.unwrap_or(u64::MAX);
    }

    /// Moves the deadline of the holder at `at`, keeping `first_deadline_ms`.
    fn set_deadline(&mut self, at: usize, deadline_ms: u64) {
        let old_ms = std::mem::replace(&mut self.holders[at].deadline_ms, deadline_ms);
        if old_ms == self.first_deadline_ms && deadline_ms > old_ms {
            self.refresh_first_deadline();
        } else {
            self.first_deadline_ms = self.first_deadline_ms.min(deadline_ms);
        }
    }

    /// Removes the holder at `at`, keeping `in_use`.
    fn remove_holder(&mut self, at: usize) -> Holder {
        let holder = self.holders.remove(at);
        self.in_use -= holder.held.permits();
        if holder.deadline_ms == self.first_deadline_ms {
            self.refresh_first_deadline();
        }
        holder
    }

    /// Whether `kind` may ever be asked of this entry (its kind and limit).
    fn admits(&self, kind: LeaseKind) -> bool {
        match (self.limit, kind) {
            (Some(limit), LeaseKind::Permits { limit: asked, .. }) => limit == asked,
            (None, LeaseKind::Exclusive | LeaseKind::Shared) => true,
            _ => false,
        }
    }

    /// The earliest holder or waiter deadline.
    fn next_deadline_ms(&self) -> Option<u64> {
        let holders = self.holders.iter().map(|h| h.deadline_ms);
        let waiters = self.queue.iter().map(|w| w.deadline_ms);
        holders.chain(waiters).min()
    }

    /// The newest holder's token and the time until the first holder's lease ends, in
    /// constant time (holders in token order, `first_deadline_ms`); with no holder (the last
    /// lease just ended and the key goes to its waiters), the last lease's token and 0, as a
    /// plain key answers.
    fn locked(&self, now_ms: u64) -> (u64, u64) {
        let token = self.holders.last().map_or(self.last_token, |h| h.token);
        let left = match self.holders.is_empty() {
            true => 0,
            false => self.first_deadline_ms.saturating_sub(now_ms),
        };
        (token, left)
    }

    fn holder(&self, lease_id: LeaseId, now_ms: u64) -> Option<usize> {
        self.holders
            .iter()
            .position(|h| h.lease_id == lease_id && h.deadline_ms > now_ms)
    }
}

impl<W: WaiterSink> LockTable<W> {
    /// ACQUIRE of a shared key, or of any key with a shared kind (`args.kind`).
    pub(super) fn acquire_shared(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Acquire<W> {
        let number = match self.shared.find(args.key) {
            Some(number) => {
                self.settle_shared(number, now_ms, tokens, events);
                self.shared.find(args.key)
            }
            None => None,
        };
        let (number, args) = match number {
            Some(number) => (number, args),
            None => match self.open_shared(now_ms, args, kind, tokens, events) {
                Ok(opened) => opened,
                Err(answer) => return answer,
            },
        };
        let entry = self.shared.entry(number);
        if !entry.admits(kind) {
            let key_limit = entry.limit;
            self.close_if_idle(number);
            return Acquire::KindMismatch { key_limit };
        }
        if entry.queue.is_empty() && entry.fits(kind) {
            let outcome = self.grant_shared_now(number, now_ms, args, kind, tokens);
            self.close_if_idle(number);
            return outcome;
        }
        if args.wait_ms == 0 {
            let (token, ttl_left_ms) = entry.locked(now_ms);
            self.close_if_idle(number);
            return Acquire::Locked { token, ttl_left_ms };
        }
        self.enqueue_shared(number, now_ms, args, kind)
    }

    /// An entry for a key that has none: new, or the key's plain lock or one-lease slot
    /// moved here. `Err` with the answer if the request is answered without one: granted in
    /// a one-lease slot of its own (module `one_lease`), refused by the key's plain lock, or
    /// answered from its one-lease slot.
    fn open_shared<'a>(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'a, W>,
        kind: LeaseKind,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Result<(u32, AcquireArgs<'a, W>), Acquire<W>> {
        let limit = one_lease::limit_of(kind);
        let mut slot = self.find(args.key);
        if let Some(found) = slot {
            self.settle(found, now_ms, tokens, events);
            slot = self.find(args.key);
        }
        let Some(slot) = slot else {
            if one_lease::fits_one_lease(args.key.len()) {
                return Err(self.grant_one_lease(now_ms, args, kind, tokens));
            }
            return Ok((self.shared.open(args.key, limit), args));
        };
        if !self.slots[slot].is_plain() {
            if let Some(answer) = self.beside_one_lease(now_ms, slot, kind, args.wait_ms) {
                return Err(answer);
            }
        } else if limit.is_some() {
            return Err(Acquire::KindMismatch { key_limit: None });
        }
        Ok((self.move_to_shared(slot), args))
    }

    /// Moves a plain lock (its holder and waiters) into a new read/write entry, or a
    /// one-lease slot's lease (no waiters) into an entry of its kind.
    pub(super) fn move_to_shared(&mut self, slot: usize) -> u32 {
        let key: Box<[u8]> = self.slots[slot].key(&self.keys).into();
        let kind = self.slots[slot].kind();
        let number = self.shared.open(&key, one_lease::limit_of(kind));
        // A shared entry's holders keep their acquire ids in the live map, never by
        // derivation (module `acquire_ids`).
        self.underive(slot);
        let lock = &self.slots[slot];
        let token = lock.token;
        let holder = (lock.deadline_ms != 0).then(|| Holder {
            lease_id: lock.lease_id,
            token: lock.token,
            deadline_ms: lock.deadline_ms,
            logged: lock.logged,
            held: Held::of(kind),
            meta: self.meta(slot).into(),
        });
        let mut moved = VecDeque::new();
        if let Some(extra) = extras::get_mut(&self.slots, &mut self.extras, slot) {
            for queued in extra.queue.drain(..) {
                let Some(waiter) = queued.waiter else {
                    continue;
                };
                moved.push_back(Waiting {
                    waiter,
                    waiter_id: queued.waiter_id,
                    lease_id: queued.lease_id,
                    ttl_ms: queued.ttl_ms,
                    deadline_ms: queued.deadline_ms,
                    kind: LeaseKind::Exclusive,
                    meta: queued.meta,
                });
            }
            extra.live = 0;
        }
        // The waiters keep their quota units; only this table's count moves.
        self.waiters_count -= moved.len();
        self.shared.waiters_count += moved.len();
        // The holder keeps its held unit: take one before `free` gives the slot's back.
        self.quotas.held.take_anyway();
        self.free(slot);
        let entry = self.shared.entry_mut(number);
        entry.queue.set(moved);
        // A key reserved for its waiters has no holder: its last lease's token stays known.
        entry.last_token = token;
        if let Some(holder) = holder {
            entry.push_holder(holder);
            self.shared.holders_count += 1;
        } else {
            self.quotas.held.give_back(1);
        }
        self.arm_shared(number, None);
        number
    }

    /// Grants a request that fits now.
    fn grant_shared_now(
        &mut self,
        number: u32,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
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
        let due_ms = self.add_holder(number, now_ms, grant, kind, args.meta.into());
        self.arm_shared(number, Some(due_ms));
        Acquire::Granted(grant)
    }

    /// Makes `grant` a holder of the entry (its held unit already taken); returns its
    /// deadline, for the caller to `arm_shared` (once per pass when serving a queue).
    fn add_holder(
        &mut self,
        number: u32,
        now_ms: u64,
        grant: Grant,
        kind: LeaseKind,
        meta: Box<[u8]>,
    ) -> u64 {
        let deadline_ms = now_ms + u64::from(grant.ttl_ms);
        self.shared.entry_mut(number).push_holder(Holder {
            lease_id: grant.lease_id,
            token: grant.token,
            deadline_ms,
            logged: LoggedTtl::settled(grant.ttl_ms),
            held: Held::of(kind),
            meta,
        });
        self.shared.holders_count += 1;
        deadline_ms
    }

    /// Queues a request on a shared key.
    fn enqueue_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
    ) -> Acquire<W> {
        if self.shared.entry(number).queue.len() >= self.quotas.waiters_per_key_max {
            self.close_if_idle(number);
            return Acquire::Full(Limit::WaitersPerKey);
        }
        if !self.quotas.waiters.try_take() {
            self.close_if_idle(number);
            return Acquire::Full(Limit::Waiters);
        }
        let waiter_id = self.next_waiter_id;
        self.next_waiter_id += 1;
        let entry = self.shared.entry_mut(number);
        let deadline_ms = now_ms + u64::from(args.wait_ms);
        entry.queue.push_back(Waiting {
            waiter: args.waiter.expect("checked: waiting needs a waiter"),
            waiter_id,
            lease_id: args.lease_id,
            ttl_ms: args.ttl_ms,
            deadline_ms,
            kind,
            meta: args.meta.into(),
        });
        self.shared.waiters_count += 1;
        self.arm_shared(number, Some(deadline_ms));
        Acquire::Queued { waiter_id }
    }

    /// Brings an entry up to date: ends expired holders, times out waiters, serves the
    /// queue, and drops the entry if nothing is left.
    pub(super) fn settle_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) {
        // The timer is filed at or before every deadline: before it is due, no lease has run
        // out and no wait either, and settling costs only the queue's serving.
        let entry = self.shared.entry(number);
        if entry.armed.is_none_or(|(due_ms, _)| due_ms <= now_ms) {
            self.end_expired_shared(number, now_ms, events);
            self.time_out_shared(number, now_ms, events);
        }
        let due_ms = self.serve_shared(number, now_ms, tokens, events);
        if !self.close_if_idle(number) {
            self.arm_shared(number, due_ms);
        }
    }

    /// Ends the entry's holders whose lease ran out, reporting each.
    fn end_expired_shared(&mut self, number: u32, now_ms: u64, events: &mut Vec<Event<W>>) {
        let entry = self.shared.entry_mut(number);
        let (key, in_use) = (&entry.key, &mut entry.in_use);
        let mut ended = 0;
        entry.holders.retain(|holder| {
            if holder.deadline_ms > now_ms {
                return true;
            }
            ended += 1;
            *in_use -= holder.held.permits();
            events.push(Event::Expired {
                key: key.clone(),
                token: holder.token,
                lease_id: holder.lease_id,
                handoff: None,
            });
            false
        });
        if ended > 0 {
            entry.refresh_first_deadline();
        }
        self.shared.holders_count -= ended;
        self.quotas.held.give_back(ended);
    }

    /// Removes the entry's waiters whose wait ran out, reporting each.
    fn time_out_shared(&mut self, number: u32, now_ms: u64, events: &mut Vec<Event<W>>) {
        let entry = self.shared.entry_mut(number);
        if entry.queue.iter().all(|w| w.deadline_ms > now_ms) {
            return;
        }
        let (holder_token, ttl_left_ms) = entry.locked(now_ms);
        let mut kept = VecDeque::with_capacity(entry.queue.len());
        let mut gone = 0;
        for waiting in entry.queue.take() {
            if waiting.deadline_ms > now_ms {
                kept.push_back(waiting);
                continue;
            }
            gone += 1;
            events.push(Event::WaitTimedOut {
                waiter: waiting.waiter,
                waiter_id: waiting.waiter_id,
                key: entry.key.clone(),
                holder_token,
                ttl_left_ms,
            });
        }
        entry.queue.set(kept);
        self.shared_waiters_left(gone);
    }

    fn shared_waiters_left(&mut self, n: usize) {
        self.shared.waiters_count -= n;
        self.quotas.waiters.give_back(n);
    }

    /// Grants queued requests from the head while they fit (strict FIFO), each as a
    /// [`Event::HandedOff`]; returns the earliest deadline of the new holders, for one
    /// `arm_shared` after the pass. Each head costs constant time (`Entry::fits`), so the
    /// pass is linear in the waiters it grants. Out of tokens, the entry waits in `stalled`
    /// for `advance`.
    fn serve_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Option<u64> {
        let mut due_ms: Option<u64> = None;
        loop {
            let entry = self.shared.entry_mut(number);
            let mut dead = 0;
            while entry
                .queue
                .front()
                .is_some_and(|w| !w.waiter.is_live_at(now_ms))
            {
                entry.queue.pop_front();
                dead += 1;
            }
            self.shared_waiters_left(dead);
            let entry = self.shared.entry_mut(number);
            let Some(head) = entry.queue.front() else {
                return due_ms;
            };
            if !entry.fits(head.kind) {
                return due_ms;
            }
            let Some(token) = tokens.try_next() else {
                self.shared.stalled.push(number);
                return due_ms;
            };
            let waiting = entry.queue.pop_front().expect("a head");
            let key = entry.key.clone();
            self.shared_waiters_left(1);
            // A waiter was admitted with room in the waiters' quota; it becomes a holder
            // whatever the held count is now, like a plain lock's hand-off.
            self.quotas.held.take_anyway();
            let grant = Grant {
                token,
                lease_id: waiting.lease_id,
                ttl_ms: waiting.ttl_ms,
            };
            let meta = waiting.meta.clone();
            let deadline_ms = self.add_holder(number, now_ms, grant, waiting.kind, meta);
            due_ms = Some(due_ms.map_or(deadline_ms, |due_ms| due_ms.min(deadline_ms)));
            events.push(Event::HandedOff(Handoff {
                waiter: waiting.waiter,
                waiter_id: waiting.waiter_id,
                grant,
                key,
                meta: waiting.meta,
                kind: waiting.kind,
            }));
        }
    }

    /// Drops the entry if it has no holder and no waiter; returns whether it did.
    fn close_if_idle(&mut self, number: u32) -> bool {
        let entry = self.shared.entry(number);
        if !entry.holders.is_empty() || !entry.queue.is_empty() {
            return false;
        }
        self.shared.close(number);
        true
    }

    /// Keeps the entry's timer filed at or before its earliest deadline. `earlier_ms` is the
    /// earliest deadline added (or moved earlier) since the timer was filed: deadlines that
    /// only end or move later leave a filed timer early enough, so with a timer filed this
    /// costs one comparison. With none (a new entry, or its timer just fired) it files one
    /// at the earliest of all deadlines.
    fn arm_shared(&mut self, number: u32, earlier_ms: Option<u64>) {
        let entry = self.shared.entry(number);
        let due_ms = match entry.armed {
            Some((armed_ms, _)) => match earlier_ms {
                Some(due_ms) if due_ms < armed_ms => due_ms,
                _ => return,
            },
            None => match entry.next_deadline_ms() {
                Some(due_ms) => due_ms,
                None => return,
            },
        };
        let shared = &mut self.shared;
        let live_max = 2 * shared.ids.len() + SHARED_TIMERS_STALE_MIN;
        if shared.timers.len() >= live_max {
            let entries = &shared.entries;
            shared.timers.retain(|_, &(number, stamp)| {
                entries[number as usize]
                    .as_ref()
                    .is_some_and(|e| e.armed.is_some_and(|(_, s)| s == stamp))
            });
        }
        let stamp = shared.next_stamp;
        shared.next_stamp = shared.next_stamp.wrapping_add(1);
        shared.timers.insert(due_ms, (number, stamp));
        shared.entry_mut(number).armed = Some((due_ms, stamp));
    }

    /// The ticker's share for shared keys: stalled queues, then due timers, within `budget`.
    /// Returns the items processed.
    pub(super) fn advance_shared(
        &mut self,
        now_ms: u64,
        budget: usize,
        tokens: &TokenAllocator,
        out: &mut Vec<Event<W>>,
    ) -> usize {
        let mut spent = 0;
        if tokens.remaining() > 0 && !self.shared.stalled.is_empty() {
            let mut stalled = std::mem::take(&mut self.shared.stalled);
            stalled.sort_unstable();
            stalled.dedup();
            for number in stalled {
                if self.shared.entries[number as usize].is_none() {
                    continue; // gone since (a stale number)
                }
                if spent >= budget {
                    self.shared.stalled.push(number);
                    continue;
                }
                spent += 1;
                self.settle_shared(number, now_ms, tokens, out);
            }
        }
        let mut fired = Vec::new();
        spent += self
            .shared
            .timers
            .poll(now_ms, budget - spent.min(budget), &mut fired);
        for (number, stamp) in fired {
            let live = self.shared.entries[number as usize]
                .as_ref()
                .is_some_and(|e| e.armed.is_some_and(|(_, s)| s == stamp));
            if live {
                self.shared.entry_mut(number).armed = None;
                self.settle_shared(number, now_ms, tokens, out);
            }
        }
        spent
    }

    /// Whether the shared part has due work at `now_ms`.
    pub(super) fn shared_due(&self, now_ms: u64, tokens: &TokenAllocator) -> bool {
        self.shared
            .timers
            .next_due_ms()
            .is_some_and(|due| due <= now_ms)
            || (tokens.remaining() > 0 && !self.shared.stalled.is_empty())
    }

    /// When the shared wheel next has a timer due.
    pub(super) fn shared_next_due_ms(&self) -> Option<u64> {
        self.shared.timers.next_due_ms()
    }

    /// RENEW of a lease on a shared key (same rules as a plain lease's).
    pub(super) fn renew_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        lease_id: LeaseId,
        ttl_ms: u32,
        durable_lsn: impl FnOnce() -> u64,
    ) -> Renew {
        let renewal_lsn_max = self.renewal_lsn_max;
        let entry = self.shared.entry_mut(number);
        let Some(at) = entry.holder(lease_id, now_ms) else {
            return Renew::Lost;
        };
        let holder = &mut entry.holders[at];
        if ttl_ms > holder.logged.ttl_ms() {
            return Renew::Unlogged {
                token: holder.token,
            };
        }
        let mut wait_lsn = 0;
        if holder.logged.is_pending() {
            if durable_lsn() >= renewal_lsn_max {
                holder.logged = LoggedTtl::settled(holder.logged.ttl_ms());
            } else {
                wait_lsn = renewal_lsn_max;
            }
        }
        self.extend_shared(number, at, now_ms, ttl_ms);
        Renew::Renewed { ttl_ms, wait_lsn }
    }

    /// `renew_logged` of a lease on a shared key.
    pub(super) fn renew_logged_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        token: u64,
        ttl_ms: u32,
        lsn: u64,
    ) {
        let entry = self.shared.entry_mut(number);
        let at = entry
            .holders
            .iter()
            .position(|h| h.token == token && h.deadline_ms > now_ms)
            .expect("renew_logged: the lease that renew answered Unlogged is gone");
        entry.holders[at].logged = if lsn == 0 {
            LoggedTtl::settled(ttl_ms)
        } else {
            LoggedTtl::pending(ttl_ms)
        };
        self.renewal_lsn_max = self.renewal_lsn_max.max(lsn);
        self.extend_shared(number, at, now_ms, ttl_ms);
    }

    fn extend_shared(&mut self, number: u32, at: usize, now_ms: u64, ttl_ms: u32) {
        let deadline_ms = now_ms + u64::from(ttl_ms);
        self.shared.entry_mut(number).set_deadline(at, deadline_ms);
        // A shorter lease may be due before the filed timer: `arm_shared` files it earlier.
        self.arm_shared(number, Some(deadline_ms));
    }

    /// RELEASE of a lease on a shared key: it ends, and the queue is served. The first
    /// grant is the answer's `handoff`, the rest go to `events`.
    pub(super) fn release_shared(
        &mut self,
        number: u32,
        now_ms: u64,
        lease_id: LeaseId,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Release<W> {
        let entry = self.shared.entry_mut(number);
        let Some(at) = entry.holder(lease_id, now_ms) else {
            return Release::NotOwner;
        };
        let token = entry.remove_holder(at).token;
        self.shared.holders_count -= 1;
        self.quotas.held.give_back(1);
        let mark = events.len();
        self.settle_shared(number, now_ms, tokens, events);
        // The first hand-off of this release rides in its answer, as a plain lock's does.
        let first = events[mark..]
            .iter()
            .position(|e| matches!(e, Event::HandedOff(_)))
            .map(|at| mark + at);
        let handoff = first.map(|at| match events.remove(at) {
            Event::HandedOff(handoff) => handoff,
            _ => unreachable!("found as HandedOff"),
        });
        Release::Released { token, handoff }
    }

    /// Takes a queued waiter out of a shared key's queue; `None` if it is not queued there.
    pub(super) fn cancel_shared(&mut self, number: u32, waiter_id: u64) -> Option<W> {
        let entry = self.shared.entry_mut(number);
        let at = entry.queue.iter().position(|w| w.waiter_id == waiter_id)?;
        let waiting = entry.queue.remove(at).expect("found at `at`");
        self.shared_waiters_left(1);
        // A head that left may let the next ones in: the ticker serves the key soon.
        self.shared.stalled.push(number);
        self.close_if_idle(number);
        Some(waiting.waiter)
    }

    /// CHECK on a shared key: whether `token` names an unexpired holder.
    pub(super) fn check_shared(&self, number: u32, now_ms: u64, token: u64) -> Check {
        let entry = self.shared.entry(number);
        if entry
            .holders
            .iter()
            .any(|h| h.token == token && h.deadline_ms > now_ms)
        {
            Check::Current
        } else {
            Check::Stale
        }
    }

    /// INSPECT on a shared key, in HELD's words: the newest holder's token and metadata,
    /// the time until the first lease ends, the waiters.
    pub(super) fn inspect_shared(&self, number: u32, now_ms: u64) -> Inspect<'_> {
        let entry = self.shared.entry(number);
        let newest = entry
            .holders
            .iter()
            .filter(|h| h.deadline_ms > now_ms)
            .max_by_key(|h| h.token);
        let Some(newest) = newest else {
            return Inspect::Free;
        };
        let ttl_left_ms = entry
            .holders
            .iter()
            .filter(|h| h.deadline_ms > now_ms)
            .map(|h| h.deadline_ms - now_ms)
            .min()
            .expect("one holder at least");
        Inspect::Held {
            token: newest.token,
            ttl_left_ms,
            waiters: u32::try_from(entry.queue.len()).expect("bounded by limits"),
            meta: &newest.meta,
        }
    }

    /// What a shared key's holders and waiters are, as of `now_ms`.
    pub fn inspect_kinds(&self, now_ms: u64, key: &[u8]) -> Option<SharedInspect> {
        let now_ms = now_ms.max(self.now_ms);
        let Some(number) = self.shared.find(key) else {
            let slot = self.one_lease_slot(key)?;
            return Some(self.inspect_one_lease(now_ms, slot));
        };
        let entry = self.shared.entry(number);
        let live = entry.holders.iter().filter(|h| h.deadline_ms > now_ms);
        let mut out = SharedInspect {
            limit: entry.limit.unwrap_or(0),
            ..SharedInspect::default()
        };
        for holder in live {
            out.holders += 1;
            match holder.held.kind(entry.limit) {
                LeaseKind::Exclusive => out.writer = true,
                LeaseKind::Shared => out.in_use += 1,
                LeaseKind::Permits { count, .. } => out.in_use += count,
            }
        }
        for waiting in entry.queue.iter() {
            if waiting.kind == LeaseKind::Exclusive {
                out.waiting_exclusive += 1;
            } else {
                out.waiting_shared += 1;
            }
        }
        Some(out)
    }

    /// The unexpired lease `lease_id` on a shared key: its token, time left, logged TTL,
    /// kind and metadata (what undoing its release needs).
    pub fn shared_lease(
        &self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
    ) -> Option<(u64, u64, LoggedTtl, LeaseKind, &[u8])> {
        let now_ms = now_ms.max(self.now_ms);
        let Some(number) = self.shared.find(key) else {
            let lock = &self.slots[self.one_lease_slot(key)?];
            return (lock.lease_id == lease_id && lock.deadline_ms > now_ms).then(|| {
                let meta = self.meta(self.find(key).expect("a slot"));
                let left = lock.deadline_ms - now_ms;
                (lock.token, left, lock.logged, lock.kind(), meta)
            });
        };
        let entry = self.shared.entry(number);
        let holder = &entry.holders[entry.holder(lease_id, now_ms)?];
        Some((
            holder.token,
            holder.deadline_ms - now_ms,
            holder.logged,
            holder.held.kind(entry.limit),
            &holder.meta,
        ))
    }

    /// Whether settling the read/write or semaphore `key` would hand it on: a holder is
    /// past its deadline and someone waits (as `hands_off_on_settling` for a plain key).
    pub(super) fn shared_hands_off_on_settling(&self, key: &[u8], now_ms: u64) -> bool {
        self.shared.find(key).is_some_and(|number| {
            let entry = self.shared.entry(number);
            entry.first_deadline_ms <= now_ms && !entry.queue.is_empty()
        })
    }

    /// The holders of `key` if it is a shared key, unexpired or not: (token, lease id,
    /// deadline) each, in grant order. For the acquire-id lookups (`repeat_of`), which find
    /// a repeat's lease among a read/write or semaphore key's holders by its token.
    pub(super) fn shared_holders(
        &self,
        key: &[u8],
    ) -> Option<impl Iterator<Item = (u64, LeaseId, u64)> + '_> {
        let entry = self.shared.entry(self.shared.find(key)?);
        Some(
            entry
                .holders
                .iter()
                .map(|h| (h.token, h.lease_id, h.deadline_ms)),
        )
    }

    /// The fencing tokens of every holder of every shared key (for the invariant checks).
    pub(super) fn shared_tokens(&self) -> impl Iterator<Item = u64> + '_ {
        (self.shared.entries.iter().flatten()).flat_map(|e| e.holders.iter().map(|h| h.token))
    }

    /// Whether `key` is a shared key: it has an entry, or its one lease is in a slot.
    pub fn is_shared(&self, key: &[u8]) -> bool {
        self.shared.find(key).is_some() || self.one_lease_slot(key).is_some()
    }

    /// Puts a recovered (or un-released) lease of a shared kind back; see
    /// [`LockTable::restore_kind`].
    pub(super) fn restore_shared(
        &mut self,
        now_ms: u64,
        key: &[u8],
        grant: Grant,
        kind: LeaseKind,
        meta: &[u8],
    ) {
        let limit = one_lease::limit_of(kind);
        let number = match (self.shared.find(key), self.find(key)) {
            (Some(number), _) => number,
            (None, None) if one_lease::fits_one_lease(key.len()) => {
                assert!(self.index.len() < HELD_MAX_LIMIT, "restore: table full");
                self.quotas.held.take_anyway();
                self.install(now_ms, key, grant, meta.into());
                let slot = self.find(key).expect("a slot just installed");
                return self.mark_kind(slot, kind);
            }
            (None, None) => self.shared.open(key, limit),
            (None, Some(slot)) => {
                assert!(
                    !self.slots[slot].is_plain(),
                    "restore: a plain lock and a shared one"
                );
                self.move_to_shared(slot)
            }
        };
        let entry = self.shared.entry(number);
        assert!(
            entry.admits(kind) && entry.holders.iter().all(|h| h.token != grant.token),
            "restore: lease {kind:?} does not fit key's {:?}",
            entry.limit
        );
        self.quotas.held.take_anyway();
        let due_ms = self.add_holder(number, now_ms, grant, kind, meta.into());
        self.arm_shared(number, Some(due_ms));
    }

    /// `restore_logged_ttl` of a lease on a shared key.
    pub(super) fn restore_logged_ttl_shared(&mut self, number: u32, token: u64, logged: LoggedTtl) {
        let entry = self.shared.entry_mut(number);
        let holder = entry
            .holders
            .iter_mut()
            .find(|h| h.token == token)
            .expect("restore_logged_ttl: the lease was not restored");
        holder.logged = logged;
    }

    /// Calls `visit` for every unexpired lease on a shared key.
    pub(super) fn for_each_shared(&self, now_ms: u64, visit: &mut impl FnMut(HeldLock<'_>)) {
        for entry in self.shared.entries.iter().flatten() {
            for holder in entry.holders.iter().filter(|h| h.deadline_ms > now_ms) {
                visit(HeldLock {
                    key: &entry.key,
                    lease_id: holder.lease_id,
                    token: holder.token,
                    ttl_ms: holder.logged.ttl_ms(),
                    ttl_left_ms: holder.deadline_ms - now_ms,
                    meta: &holder.meta,
                    kind: holder.held.kind(entry.limit),
                });
            }
        }
    }

    /// The shared part's invariants (see `check_invariants`).
    pub(super) fn check_shared_invariants(&self) {
        let shared = &self.shared;
        let (mut holders, mut waiters) = (0, 0);
        for (number, entry) in shared.entries.iter().enumerate() {
            let Some(entry) = entry else {
                assert!(
                    shared.vacant.contains(&(number as u32)),
                    "lost entry {number}"
                );
                continue;
            };
            assert_eq!(shared.find(&entry.key), Some(number as u32), "entry index");
            if let (Some((armed_ms, _)), Some(due_ms)) = (entry.armed, entry.next_deadline_ms()) {
                assert!(
                    armed_ms <= due_ms,
                    "entry {number} timer after its deadline"
                );
            }
            assert!(self.find(&entry.key).is_none(), "key both plain and shared");
            assert!(
                !entry.holders.is_empty() || !entry.queue.is_empty(),
                "idle entry {number} kept"
            );
            holders += entry.holders.len();
            waiters += entry.queue.len();
            check_entry(entry);
        }
        assert_eq!(holders, shared.holders_count, "shared holders count");
        assert_eq!(waiters, shared.waiters_count, "shared waiters count");
        assert_eq!(shared.ids.len() + shared.vacant.len(), shared.entries.len());
    }
}

/// One entry's holders fit together and its tokens are distinct.
fn check_entry<W>(entry: &Entry<W>) {
    for holder in &entry.holders {
        assert!(
            entry.admits(holder.held.kind(entry.limit)),
            "holder kind {:?} in {:?}",
            holder.held,
            entry.limit
        );
        assert!(holder.token != 0, "token 0");
    }
    let writers = entry
        .holders
        .iter()
        .filter(|h| h.held == Held::EXCLUSIVE)
        .count();
    assert!(
        writers == 0 || entry.holders.len() == 1,
        "a writer beside another holder"
    );
    assert!(
        entry.holders.windows(2).all(|w| w[0].token < w[1].token),
        "holders out of token order"
    );
    let first = entry.holders.iter().map(|h| h.deadline_ms).min();
    assert_eq!(
        first.unwrap_or(u64::MAX),
        entry.first_deadline_ms,
        "first deadline"
    );
    let in_use: u32 = entry.holders.iter().map(|h| h.held.permits()).sum();
    assert_eq!(in_use, entry.in_use, "permits in use");
    if let Some(limit) = entry.limit {
        assert!(in_use <= limit, "{in_use} permits of {limit}");
    }
    let mut tokens: Vec<u64> = entry.holders.iter().map(|h| h.token).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(
        tokens.len(),
        entry.holders.len(),
        "two holders share a token"
    );
}
