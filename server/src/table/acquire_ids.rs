//! Acquire ids: which live lease answered which ACQUIRE, and how recently ended ones ended,
//! so a repeat of an ACQUIRE (same key, same acquire id) is answered with the first one's
//! outcome instead of a second grant (PROTOCOL.md "Acquire ids").
//!
//! Beside the slots, not in them: a slot is most of a held lock's memory and most leases
//! have no acquire id, so a plain lease pays nothing (a plain ACQUIRE touches none of this;
//! a free only checks that the live map is not empty and that it is not the derived lease
//! just released). A lease granted at once derives its lease id from its acquire id and
//! costs nothing beyond a bit of its slot (below, "Derived lease ids"); any other lease with
//! one costs an entry of the live map, keyed by its fencing token (unique across keys, so
//! the key need not be stored: the key's holder names the token), hashed by one
//! multiplication (tokens are the server's own numbers).
//!
//! Ended ones go into a fixed table of [`ENDED_PER_SHARD_MAX`] entries per shard (made on a
//! shard's first ended id), at the place a seeded hash of the id picks: an end replaces
//! whatever was there. So an ended id is remembered until another end lands on its place,
//! or for [`ENDED_KEEP_MS`], whichever is first; a repeat after that is a new ACQUIRE. No
//! allocation, a bounded size, and no order to keep. The seed is the shard's, so a client
//! cannot pick ids that evict another's on purpose.
//!
//! The table (1.5 MB over 64 shards) does not stay in the cache, and a read of it is a miss
//! to memory: it was most of what an acquire id cost (BENCHMARKS.md). So an end only writes
//! its entry, and beside the entries a byte per place holds the top byte of the place's
//! fingerprint (1 KB a shard, which does stay cached): an ACQUIRE reads the entry only when
//! that byte matches its own, a first send one time in 256. Nor does an end's write wait:
//! a store that misses the cache holds up the shard's unlock (a locked instruction waits for
//! every earlier store), so an end asks for its place's lines and is written at the shard's
//! next end, when they are there; until then it is kept aside, and read as its place's.
//!
//! # Derived lease ids: no live map entry for the common grant
//!
//! The live map cost memory (about 38 bytes a lease) and time (two map operations a
//! cycle: BENCHMARKS.md). So an ACQUIRE with an acquire id that is granted at once on an
//! exclusive key gets no entry: its lease id is *derived*,
//! `AES-128(k1, acquire id XOR AES-128(k2, token))`, under two keys of 128 random bits
//! the server draws when it starts ([`LeaseIdCipher`]), and its slot is marked so
//! (a bit of its `LoggedTtl`). A repeat then recognises its lease from the slot alone (the
//! holder's lease id is what the repeat's acquire id and the holder's token derive), and the
//! lease's end recovers its acquire id from the lease id (decryption, then XOR the token's
//! mask) for the table of ended ids. To anyone without the keys the lease id is as
//! unpredictable as a random one, and no choice of acquire ids makes two grants share one
//! (the token is a tweak whose mask nobody can compute), so the contract's 128 random bits
//! hold for it as for any other.
//!
//! Everything else keeps its live map entry: a grant handed to a waiter, a read/write or
//! semaphore lease, a lease recovered from the journal or applied from a leader's log (the
//! key dies with the process, so a restarted or newly elected server cannot recognise the
//! derivation, and the journal's acquire id goes in the map), a lease put back by an undo.
//! The two kinds answer alike. A repeat of a derived lease waits for the newest derived
//! grant's journal ticket in the shard (its own grant's or a later one), as a renewal waits
//! for the shard's newest renewal record, rather than the slot keeping 8 bytes.
//!
//! The caller (the executor) keeps the live map in step with the table: it notes an id
//! when a grant with one is logged and tells [`LockTable::acquire_id_ended`] of every lease
//! end. Time arrives as `now_ms`, as everywhere in the table.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use tenure_protocol::{AcquireId, EndedHow, LeaseId, LeaseKind};

use super::extras::SlotHasher;
use super::index::hash_key;
use super::WaiterSink;
use super::{
    assert_acquire_args, Acquire, AcquireArgs, Event, LockTable, LoggedTtl, TokenAllocator,
};

/// Longest an ended lease's acquire id is remembered, in milliseconds: the longest wait plus
/// ten minutes of retries, longer than a client retries one ACQUIRE (its wait plus its
/// time-outs), so a retry inside it meets the answer (unless the shard's table of ended ids
/// has reused the place meanwhile).
pub const ENDED_KEEP_MS: u64 = tenure_protocol::limits::WAIT_MS_MAX as u64 + 600_000;
/// Places for ended acquire ids per shard (24 bytes each and a byte of tag, made on first
/// use): the most remembered at once. Small on purpose: the table is touched by every end,
/// and one of 4 096 places (48 bytes each then) over 64 shards cost a third more server CPU
/// per mixed-cycle op in cache misses, before the tags spared an ACQUIRE the read of its
/// entry (BENCHMARKS.md).
pub const ENDED_PER_SHARD_MAX: usize = 1024;
const _: () = assert!(ENDED_PER_SHARD_MAX.is_power_of_two());

/// A live lease granted to an ACQUIRE with an acquire id.
#[derive(Clone, Copy, Debug)]
struct Live {
    acquire_id: AcquireId,
    /// The journal ticket of its grant: a repeat's reply waits for it like the first one's.
    ticket: u64,
}

/// An ended lease of an ACQUIRE with an acquire id; a free place has token 0. 24 bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Ended {
    /// A 64-bit hash of the acquire id and the key under the shard's seed, so a repeat on
    /// another key is not taken for it. (Two pairs meeting on one fingerprint and one place:
    /// one chance in 2^64 per lookup; then a first send would hear ACQUIRE_ENDED.)
    fingerprint: u64,
    token: u64,
    /// When it ended, in the low 56 bits; how, in the top byte.
    ended_ms_how: u64,
}

const HOW_SHIFT: u32 = 56;

impl Ended {
    fn how(&self) -> Option<EndedHow> {
        EndedHow::from_u8((self.ended_ms_how >> HOW_SHIFT) as u8)
    }
    fn ended_ms(&self) -> u64 {
        self.ended_ms_how & ((1 << HOW_SHIFT) - 1)
    }
}
const _: () = assert!(size_of::<Ended>() == 24);

/// A shard's acquire ids; see the module docs.
#[derive(Debug, Default)]
pub(super) struct AcquireIds {
    /// Live leases with an acquire id, by fencing token.
    live: HashMap<u64, Live, BuildHasherDefault<SlotHasher>>,
    /// Ended ones, by place; empty until the shard's first.
    ended: Vec<Ended>,
    /// The top byte of each place's fingerprint ([`tag_of`]), 0 for a free place; empty as
    /// long as `ended` is.
    tags: Vec<u8>,
    /// The newest end and its place, not written there yet: it is written at the next end,
    /// its place's cache lines fetched meanwhile ([`prefetch`]). Written at once, the store
    /// missed the cache and the shard's unlock, which waits for every earlier store, waited
    /// for memory (most of what an acquire id cost, BENCHMARKS.md). Until written it is what
    /// its place holds: [`LockTable::ended_repeat`] reads it first.
    pending: Option<(usize, Ended)>,
    /// The fencing token and key hash of the last lease `LockTable::release` freed, so its
    /// end need not hash the key again (tokens are unique, so the token names the key).
    released: (u64, u64),
    /// The acquire id the next grant of `grant_free` derives its lease id from: set by
    /// `acquire_with_id` around the one call that may grant, never left set.
    pub(super) derive_next: Option<AcquireId>,
    /// The token of the shard's latest grant with a derived lease id, so its note
    /// ([`LockTable::note_acquire_id`]) makes no live map entry.
    pub(super) derived_last: u64,
    /// The journal ticket of the shard's newest derived grant: a repeat of a derived lease
    /// waits for it (at or after its own grant's).
    derived_ticket_max: u64,
    /// The token and lease id of the last derived lease `LockTable::release` freed, for the
    /// end the caller reports next ([`LockTable::acquire_id_ended`]).
    pub(super) released_derived: Option<(u64, LeaseId)>,
}

/// Derives lease ids from acquire ids and back (see the module docs): a tweakable block
/// cipher, the token the tweak, built from AES-128 under two keys of the shard ("XE": the
/// acquire id XOR a mask that the token's encryption under the second key gives, then
/// encrypted under the first). For each token a permutation of acquire ids, and for
/// different tokens permutations no one without the keys can relate, so no choice of acquire
/// ids makes two grants share a lease id (outside test a44: with the token itself as the
/// mask, ids chosen as a counter, `id XOR token` constant, gave every grant one lease id).
pub struct LeaseIdCipher {
    /// Encrypts the masked acquire id.
    ids: aes::Aes128,
    /// Encrypts the token into its mask.
    masks: aes::Aes128,
}

impl std::fmt::Debug for LeaseIdCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseIdCipher") // the keys are secrets
    }
}

impl LeaseIdCipher {
    /// A cipher under `keys` (the acquire ids' key, the masks' key).
    pub fn new(keys: [u128; 2]) -> LeaseIdCipher {
        use aes::cipher::KeyInit;
        let aes = |key: u128| aes::Aes128::new(&key.to_le_bytes().into());
        LeaseIdCipher {
            ids: aes(keys[0]),
            masks: aes(keys[1]),
        }
    }

    /// A cipher whose keys follow from `seed`, for tables made in tests and simulations,
    /// which must repeat; a server's tables get random keys ([`LockTable::set_lease_key`]).
    pub(super) fn from_seed(seed: u64) -> LeaseIdCipher {
        let half = |n: u64| u128::from(seed.wrapping_mul(n));
        let key = |a, b| half(a) << 64 | half(b);
        LeaseIdCipher::new([key(0x9e37_79b9_7f4a_7c15, 3), key(0xff51_afd7_ed55_8ccd, 5)])
    }

    /// The mask of token `token`: its encryption under the masks' key.
    fn mask(&self, token: u64) -> u128 {
        use aes::cipher::BlockEncrypt;
        let mut block = u128::from(token).to_le_bytes().into();
        self.masks.encrypt_block(&mut block);
        u128::from_le_bytes(block.into())
    }

    /// The lease id of the grant of `acquire_id` with fencing token `token`.
    pub(super) fn derive(&self, acquire_id: AcquireId, token: u64) -> LeaseId {
        use aes::cipher::BlockEncrypt;
        let masked = u128::from_le_bytes(acquire_id.0) ^ self.mask(token);
        let mut block = masked.to_le_bytes().into();
        self.ids.encrypt_block(&mut block);
        LeaseId(block.into())
    }

    /// The acquire id whose grant with token `token` has lease id `lease_id` ([`derive`]'s
    /// inverse).
    ///
    /// [`derive`]: LeaseIdCipher::derive
    pub(super) fn acquire_id_of(&self, lease_id: LeaseId, token: u64) -> AcquireId {
        use aes::cipher::BlockDecrypt;
        let mut block = lease_id.0.into();
        self.ids.decrypt_block(&mut block);
        AcquireId((u128::from_le_bytes(block.into()) ^ self.mask(token)).to_le_bytes())
    }
}

/// The byte of a fingerprint kept in `AcquireIds::tags`.
fn tag_of(fingerprint: u64) -> u8 {
    (fingerprint >> 56) as u8
}

/// What a repeat of an ACQUIRE meets ([`LockTable::repeat_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeat {
    /// The key's holder (or, on a read/write or semaphore key, one of its holders) is the
    /// lease this acquire id was granted.
    Live {
        /// Its fencing token.
        token: u64,
        /// Its lease id.
        lease_id: LeaseId,
        /// Time left on it at `now_ms`.
        ttl_left_ms: u64,
        /// The journal ticket of its grant.
        ticket: u64,
    },
    /// Its lease ended (recently enough to be remembered).
    Ended {
        /// How.
        how: EndedHow,
        /// Its fencing token.
        token: u64,
    },
    /// The key's lease is past its deadline but not ended yet: settle the key
    /// (`settle_key`) and ask again.
    Unsettled,
    /// Nothing is known of it: a first send, or one forgotten.
    New,
}

/// A held lease found for a repeat ([`LockTable::repeat_of`]).
struct LiveLease {
    token: u64,
    lease_id: LeaseId,
    deadline_ms: u64,
    ticket: u64,
}

impl LiveLease {
    /// What a repeat meets at `now_ms`: this lease, or (past its deadline) `Unsettled`.
    fn at(&self, now_ms: u64) -> Repeat {
        if self.deadline_ms <= now_ms {
            return Repeat::Unsettled;
        }
        Repeat::Live {
            token: self.token,
            lease_id: self.lease_id,
            ttl_left_ms: self.deadline_ms - now_ms,
            ticket: self.ticket,
        }
    }
}

impl<W: WaiterSink> LockTable<W> {
    /// Gives this table the server's lease id derivation (one for every shard: 128 random
    /// bits a key, drawn at start; tables made otherwise have one from their seed). One, not
    /// one a shard, so its key schedules stay in the cache: 64 of them did not, and missed
    /// it on every grant and end (BENCHMARKS.md, "derived lease ids"). Call before the
    /// first grant.
    pub fn set_lease_ids(&mut self, cipher: std::sync::Arc<LeaseIdCipher>) {
        self.lease_ids = cipher;
    }

    /// Remembers that the lease with fencing token `token` answered `acquire_id`, its grant
    /// logged with `ticket` (0 for a lease brought back by recovery, durable already). A
    /// grant whose lease id was derived needs no entry: only its ticket is kept.
    pub fn note_acquire_id(&mut self, token: u64, acquire_id: AcquireId, ticket: u64) {
        let ids = &mut self.acquire_ids;
        if ids.derived_last == token {
            ids.derived_ticket_max = ids.derived_ticket_max.max(ticket);
            return;
        }
        ids.live.insert(token, Live { acquire_id, ticket });
    }

    /// The acquire id of the live lease with fencing token `token`, lease id `lease_id`
    /// and logged TTL `logged` (as the table gave them), if it had one.
    pub fn acquire_id_of(
        &self,
        token: u64,
        lease_id: LeaseId,
        logged: LoggedTtl,
    ) -> Option<AcquireId> {
        if logged.is_derived() {
            return Some(self.lease_ids.acquire_id_of(lease_id, token));
        }
        if self.acquire_ids.live.is_empty() {
            return None;
        }
        self.acquire_ids
            .live
            .get(&token)
            .map(|live| live.acquire_id)
    }

    /// The lease of `key` with fencing token `token` ended, `how`: its acquire id, if it had
    /// one, is remembered as ended. Cheap for leases without: an emptiness check while no
    /// lease of the shard has an id in the live map, and one of the last derived release.
    #[inline]
    pub fn acquire_id_ended(&mut self, now_ms: u64, key: &[u8], token: u64, how: EndedHow) {
        if let Some((released, lease_id)) = self.acquire_ids.released_derived {
            if released == token {
                self.acquire_ids.released_derived = None;
                return self.derived_ended(now_ms, key, token, lease_id, how);
            }
        }
        if self.acquire_ids.live.is_empty() {
            return;
        }
        if let Some(live) = self.acquire_ids.live.remove(&token) {
            self.remember_ended(now_ms, key, token, how, live.acquire_id);
        }
    }

    /// The derived lease `lease_id` of `key` with token `token` ended, `how`.
    pub(super) fn derived_ended(
        &mut self,
        now_ms: u64,
        key: &[u8],
        token: u64,
        lease_id: LeaseId,
        how: EndedHow,
    ) {
        let acquire_id = self.lease_ids.acquire_id_of(lease_id, token);
        self.not_derived_last(token);
        self.remember_ended(now_ms, key, token, how, acquire_id);
    }

    fn remember_ended(
        &mut self,
        now_ms: u64,
        key: &[u8],
        token: u64,
        how: EndedHow,
        acquire_id: AcquireId,
    ) {
        let (place, mixed) = ended_place(self.hash_seed, acquire_id);
        let key_hash = match self.acquire_ids.released {
            (released, hash) if released == token => hash,
            _ => hash_key(self.hash_seed, key),
        };
        let fingerprint = fingerprint(mixed, key_hash);
        let ids = &mut self.acquire_ids;
        if ids.ended.is_empty() {
            ids.ended = vec![Ended::default(); ENDED_PER_SHARD_MAX];
            ids.tags = vec![0; ENDED_PER_SHARD_MAX];
        }
        assert!(now_ms < 1 << HOW_SHIFT, "now_ms {now_ms} out of range");
        let ended = Ended {
            fingerprint,
            token,
            ended_ms_how: now_ms | u64::from(how as u8) << HOW_SHIFT,
        };
        prefetch(&ids.ended[place]);
        prefetch(&ids.tags[place]);
        // Written, never read here: what was there is replaced whatever it was.
        if let Some((place, older)) = ids.pending.replace((place, ended)) {
            ids.tags[place] = tag_of(older.fingerprint);
            ids.ended[place] = older;
        }
    }

    /// The acquire id of `key`'s held lease with fencing token `token`, if it had one (for
    /// a lease seen without its logged TTL: a snapshot's, a hand-off's).
    pub fn held_acquire_id(&self, key: &[u8], token: u64) -> Option<AcquireId> {
        if let Some(live) = self.acquire_ids.live.get(&token) {
            return Some(live.acquire_id);
        }
        let lock = &self.slots[self.find(key)?];
        (lock.token == token && lock.logged.is_derived())
            .then(|| self.lease_ids.acquire_id_of(lock.lease_id, token))
    }

    /// Forgets the lease of `key` with fencing token `token` as if it had never had an
    /// acquire id: a grant taken back because it never became durable (a repeat is then a
    /// new ACQUIRE).
    pub fn forget_acquire_id(&mut self, key: &[u8], token: u64) {
        if !self.acquire_ids.live.is_empty() {
            self.acquire_ids.live.remove(&token);
        }
        if let Some(slot) = self.find(key) {
            let lock = &mut self.slots[slot];
            if lock.token == token {
                lock.logged = lock.logged.with_derived(false);
            }
        }
        self.not_derived_last(token);
    }

    /// Moves the acquire id of `slot`'s lease, if derived, into the live map (with the
    /// ticket a repeat of it would have waited for): for a lease about to leave its slot.
    pub(super) fn underive(&mut self, slot: usize) {
        let lock = &mut self.slots[slot];
        if !lock.logged.is_derived() {
            return;
        }
        lock.logged = lock.logged.with_derived(false);
        let (token, lease_id) = (lock.token, lock.lease_id);
        let acquire_id = self.lease_ids.acquire_id_of(lease_id, token);
        let ticket = self.acquire_ids.derived_ticket_max;
        self.acquire_ids
            .live
            .insert(token, Live { acquire_id, ticket });
        self.not_derived_last(token);
    }

    /// `token`'s lease is no longer derived (it ended, or was forgotten): a note of it now
    /// (a lease put back by an undo) goes in the live map.
    fn not_derived_last(&mut self, token: u64) {
        if self.acquire_ids.derived_last == token {
            self.acquire_ids.derived_last = 0;
        }
    }

    /// What a repeat of `acquire_id` on `key` meets at `now_ms`.
    pub fn repeat_of(&mut self, now_ms: u64, key: &[u8], acquire_id: AcquireId) -> Repeat {
        let now_ms = self.observe(now_ms);
        let hash = hash_key(self.hash_seed, key);
        let live = match self.shared_holders(key) {
            Some(holders) => self.live_holder(holders, acquire_id),
            None => self.live_lock(self.find_hashed(hash, key), acquire_id),
        };
        match live {
            Some(live) => live.at(now_ms),
            None => self.ended_repeat(now_ms, acquire_id, hash),
        }
    }

    /// [`LockTable::acquire_kind`] for an ACQUIRE with `acquire_id`, unless it repeats an
    /// earlier one: then `Err` with what that repeat meets (never [`Repeat::New`]), and
    /// nothing changed. On a key that is not shared, the key is hashed and looked up once for
    /// both the repeat check and the grant, where `repeat_of` and then `acquire_kind` would
    /// do it twice (BENCHMARKS.md, "what an acquire id costs").
    pub fn acquire_with_id(
        &mut self,
        now_ms: u64,
        args: AcquireArgs<'_, W>,
        kind: LeaseKind,
        acquire_id: AcquireId,
        tokens: &TokenAllocator,
        events: &mut Vec<Event<W>>,
    ) -> Result<Acquire<W>, Repeat> {
        if !kind.is_exclusive() || self.shared.find(args.key).is_some() {
            return match self.repeat_of(now_ms, args.key, acquire_id) {
                Repeat::New if self.shared_hands_off_on_settling(args.key, now_ms) => {
                    Err(Repeat::Unsettled)
                }
                Repeat::New => Ok(self.acquire_kind(now_ms, args, kind, tokens, events)),
                repeat => Err(repeat),
            };
        }
        assert_acquire_args(&args);
        let now_ms = self.observe(now_ms);
        let hash = hash_key(self.hash_seed, args.key);
        let slot = self.find_hashed(hash, args.key);
        let repeat = match self.live_lock(slot, acquire_id) {
            Some(live) => live.at(now_ms),
            None if self.hands_off_on_settling(slot, now_ms) => Repeat::Unsettled,
            None => self.ended_repeat(now_ms, acquire_id, hash),
        };
        if repeat != Repeat::New {
            return Err(repeat);
        }
        self.acquire_ids.derive_next = Some(acquire_id);
        let outcome = self.acquire_plain(now_ms, slot, args, tokens, events);
        self.acquire_ids.derive_next = None; // not granted at once: nothing derived
        Ok(outcome)
    }

    /// What a repeat of `acquire_id` on the key hashed `key_hash` meets at `now_ms` that no
    /// live lease answers: its ended lease if the table of ended ids still has it (at its
    /// place, with its fingerprint, recent enough), else `New`. The entry is read only when
    /// the place's tag matches (see the module docs).
    fn ended_repeat(&self, now_ms: u64, acquire_id: AcquireId, key_hash: u64) -> Repeat {
        let ids = &self.acquire_ids;
        if ids.ended.is_empty() {
            return Repeat::New;
        }
        let (place, mixed) = ended_place(self.hash_seed, acquire_id);
        let fingerprint = fingerprint(mixed, key_hash);
        let ended = match ids.pending {
            Some((pending_place, pending)) if pending_place == place => pending,
            _ if ids.tags[place] != tag_of(fingerprint) => return Repeat::New,
            _ => ids.ended[place],
        };
        let fresh = now_ms.saturating_sub(ended.ended_ms()) <= ENDED_KEEP_MS;
        match ended.how() {
            Some(how) if ended.fingerprint == fingerprint && fresh && ended.token != 0 => {
                Repeat::Ended {
                    how,
                    token: ended.token,
                }
            }
            _ => Repeat::New,
        }
    }

    /// Whether settling the plain key in `slot` would hand it to a waiter: its lease is past
    /// its deadline and someone waits. That waiter may be an earlier send of the ACQUIRE
    /// being asked about, which would then be granted the key before this one's turn: the
    /// key is settled first (`Repeat::Unsettled`), its hand-off made and its acquire id
    /// noted, and the repeat asked again (outside test a30, finding F2: it was answered
    /// LOCKED, with its own first send's token). Not for a key reserved for its waiters
    /// (deadline 0): settling hands that on only once tokens are reserved.
    fn hands_off_on_settling(&self, slot: Option<usize>, now_ms: u64) -> bool {
        slot.is_some_and(|slot| {
            let deadline_ms = self.slots[slot].deadline_ms;
            deadline_ms != 0 && deadline_ms <= now_ms && self.queue_len(slot) > 0
        })
    }

    /// The lease of the plain key in `slot` if `acquire_id` was granted it (expired or not).
    fn live_lock(&self, slot: Option<usize>, acquire_id: AcquireId) -> Option<LiveLease> {
        let lock = &self.slots[slot?];
        if lock.token != 0 && lock.logged.is_derived() {
            let derived = self.lease_ids.derive(acquire_id, lock.token);
            return (derived == lock.lease_id).then_some(LiveLease {
                ticket: self.acquire_ids.derived_ticket_max,
                token: lock.token,
                lease_id: lock.lease_id,
                deadline_ms: lock.deadline_ms,
            });
        }
        let live = &self.acquire_ids.live;
        if live.is_empty() {
            return None;
        }
        let found = live.get(&lock.token)?;
        (found.acquire_id == acquire_id).then_some(LiveLease {
            ticket: found.ticket,
            token: lock.token,
            lease_id: lock.lease_id,
            deadline_ms: lock.deadline_ms,
        })
    }

    /// The one of a read/write or semaphore key's `holders` (module `shared`) granted to
    /// `acquire_id`, if one is (expired or not): it answers a repeat as a plain lock's lease
    /// does, REGRANTED with it.
    fn live_holder(
        &self,
        mut holders: impl Iterator<Item = (u64, LeaseId, u64)>,
        acquire_id: AcquireId,
    ) -> Option<LiveLease> {
        let live = &self.acquire_ids.live;
        if live.is_empty() {
            return None;
        }
        holders.find_map(|(token, lease_id, deadline_ms)| {
            let found = live.get(&token).filter(|l| l.acquire_id == acquire_id)?;
            Some(LiveLease {
                ticket: found.ticket,
                token,
                lease_id,
                deadline_ms,
            })
        })
    }

    /// The fencing token of `key`'s holder (or one of a shared key's) if `lease_id` is its
    /// lease.
    pub fn token_of(&self, key: &[u8], lease_id: LeaseId) -> Option<u64> {
        if let Some(mut holders) = self.shared_holders(key) {
            return holders.find(|h| h.1 == lease_id).map(|h| h.0);
        }
        let lock = &self.slots[self.find(key)?];
        (lock.token != 0 && lock.lease_id == lease_id).then_some(lock.token)
    }

    /// Leases with an acquire id, and places of ended ids in use, for STATS (which counts
    /// the places and the derived leases, a pass over the shard's tables, so an end need
    /// not read its place nor a grant keep a count).
    pub fn acquire_ids_count(&self) -> (usize, usize) {
        let derived = (self.slots.iter())
            .filter(|lock| lock.token != 0 && lock.deadline_ms != 0 && lock.logged.is_derived())
            .count();
        let ids = &self.acquire_ids;
        let ended = ids.ended.iter().filter(|e| e.token != 0).count();
        let pending_new = ids
            .pending
            .is_some_and(|(place, _)| ids.ended[place].token == 0);
        (ids.live.len() + derived, ended + usize::from(pending_new))
    }

    /// Checks the acquire ids against the table: every live one names a held lease.
    pub(super) fn check_acquire_ids(&self) {
        for lock in self.slots.iter().filter(|lock| lock.logged.is_derived()) {
            assert!(
                lock.token != 0 && lock.deadline_ms != 0 && lock.is_plain(),
                "a derived mark on a slot without its running exclusive lease (token {})",
                lock.token
            );
            assert!(
                !self.acquire_ids.live.contains_key(&lock.token),
                "derived lease {} also in the live map",
                lock.token
            );
        }
        assert!(
            self.acquire_ids.derive_next.is_none(),
            "derive_next left set"
        );
        if self.acquire_ids.live.is_empty() {
            return;
        }
        let held: std::collections::HashSet<u64> = (self.slots.iter().map(|lock| lock.token))
            .chain(self.shared_tokens())
            .collect();
        for token in self.acquire_ids.live.keys() {
            assert!(
                held.contains(token),
                "acquire id noted for token {token}, which no slot holds"
            );
        }
        let ids = &self.acquire_ids;
        assert_eq!(ids.tags.len(), ids.ended.len());
        for (ended, tag) in ids.ended.iter().zip(&ids.tags) {
            let tag_ok = ended.token == 0 || *tag == tag_of(ended.fingerprint);
            assert!(
                tag_ok,
                "the tag of ended token {} is not its own",
                ended.token
            );
        }
    }
}

/// Where an acquire id goes in a shard's table of ended ids, and the id's 64-bit hash under
/// the shard's `seed` (half of its fingerprint there, [`fingerprint`]): the place from the
/// id alone, so it can be read before the key is hashed.
fn ended_place(seed: u64, acquire_id: AcquireId) -> (usize, u64) {
    let [a, b] = [&acquire_id.0[..8], &acquire_id.0[8..]]
        .map(|half| u64::from_le_bytes(half.try_into().expect("8 bytes")));
    let mixed = (a ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.rotate_left(29);
    let mixed = mixed.wrapping_mul(0xff51_afd7_ed55_8ccd);
    let place = (mixed >> 32) as usize & (ENDED_PER_SHARD_MAX - 1);
    (place, mixed)
}

/// Asks the cache for the line holding `value`, to be written soon, without waiting for it
/// (a hint: nothing else changes, and a store to it later need not wait for memory). An
/// `Ended` may straddle two lines: both are asked for.
#[inline]
#[allow(unsafe_code)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = std::ptr::from_ref(value).cast::<i8>();
        // SAFETY: SSE is in every x86_64 target, and a prefetch neither reads nor writes
        // memory (an address it cannot use is ignored); both addresses are inside `value`.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(start);
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(size_of::<T>() - 1));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// The fingerprint of an acquire id (its hash `mixed`, from [`ended_place`]) on the key whose
/// hash (`index::hash_key`, same seed) is `key_hash`.
fn fingerprint(mixed: u64, key_hash: u64) -> u64 {
    (mixed ^ key_hash).wrapping_mul(0xc4ce_b9fe_1a85_ec53)
}

impl AcquireIds {
    /// `LockTable::release` freed the lease with fencing token `token` on the key hashed
    /// `key_hash`, its lease id `derived` or not (a store, only while a lease of the shard
    /// has an acquire id: one in the live map, or this one's derived id, whose end is
    /// reported next; until 2026-12-03 a derived lease's end hashed its key again).
    #[inline]
    pub(super) fn released(&mut self, token: u64, key_hash: u64, derived: bool) {
        if derived || !self.live.is_empty() {
            self.released = (token, key_hash);
        }
    }

    /// Bytes held, by capacity (the live map's entries and control bytes, the ended table).
    pub(super) fn memory_bytes(&self) -> usize {
        self.live.capacity() * (size_of::<(u64, Live)>() + 1)
            + self.ended.capacity() * size_of::<Ended>()
            + self.tags.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{Acquire, AcquireArgs, Quotas, TableLimits, TokenAllocator};
    use std::sync::Arc;

    #[derive(Debug)]
    struct Never;

    impl LockTable<Never> {
        /// `repeat_of` without moving the table's time.
        fn acquire_ids_peek(&mut self, key: &[u8], id: AcquireId) -> Repeat {
            let now_ms = self.now_ms;
            self.repeat_of(now_ms, key, id)
        }
    }
    impl WaiterSink for Never {
        fn is_live(&self) -> bool {
            false
        }
    }

    fn table() -> LockTable<Never> {
        let limits = TableLimits {
            held_max: 100,
            waiters_max: 100,
            waiters_per_key_max: 10,
        };
        LockTable::with_quotas(Arc::new(Quotas::new(limits)), 7)
    }

    /// Arguments of an ACQUIRE of `key` for 1 s, no wait, offering `lease_id`.
    fn args(key: &[u8], lease_id: u128) -> AcquireArgs<'_, Never> {
        AcquireArgs {
            key,
            lease_id: LeaseId::from_u128(lease_id),
            ttl_ms: 1000,
            wait_ms: 0,
            waiter: None,
            meta: b"",
        }
    }

    fn grant(t: &mut LockTable<Never>, tokens: &TokenAllocator, key: &[u8], now: u64) -> u64 {
        let args = args(key, now.into());
        match t.acquire(now, args, tokens, &mut Vec::new()) {
            Acquire::Granted(grant) => grant.token,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn live_then_ended_then_forgotten() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(42);
        let token = grant(&mut t, &tokens, b"k", 0);
        assert_eq!(t.repeat_of(0, b"k", id), Repeat::New);
        t.note_acquire_id(token, id, 9);
        t.check_acquire_ids();
        assert!(matches!(
            t.repeat_of(100, b"k", id),
            Repeat::Live { token: tk, ttl_left_ms: 900, ticket: 9, .. } if tk == token
        ));
        // Another key, another id: not a repeat.
        assert_eq!(t.repeat_of(100, b"other", id), Repeat::New);
        assert_eq!(
            t.repeat_of(100, b"k", AcquireId::from_u128(43)),
            Repeat::New
        );
        t.acquire_id_ended(200, b"k", token, EndedHow::Released);
        assert_eq!(
            t.repeat_of(300, b"k", id),
            Repeat::Ended {
                how: EndedHow::Released,
                token
            }
        );
        assert_eq!(t.repeat_of(300, b"other", id), Repeat::New);
        assert_eq!(t.repeat_of(200 + ENDED_KEEP_MS + 1, b"k", id), Repeat::New);
        assert_eq!(
            t.acquire_ids_count(),
            (0, 1),
            "forgotten by time, its place still used"
        );
    }

    #[test]
    fn ended_ids_are_bounded_by_count() {
        let mut t = table();
        let ids = 4 * ENDED_PER_SHARD_MAX as u64;
        for i in 0..ids {
            let id = AcquireId::from_u128(i.into());
            t.acquire_ids.live.insert(
                i + 1,
                Live {
                    acquire_id: id,
                    ticket: 0,
                },
            );
            t.acquire_id_ended(0, b"k", i + 1, EndedHow::Expired);
        }
        let (live, ended) = t.acquire_ids_count();
        assert_eq!(live, 0);
        assert!(ended <= ENDED_PER_SHARD_MAX, "{ended}");
        // The newest are remembered (nothing ended after them), most older ones were replaced.
        let mut remembered = |from: u64, to: u64| {
            (from..to)
                .filter(|&i| {
                    let id = AcquireId::from_u128(i.into());
                    matches!(t.acquire_ids_peek(b"k", id), Repeat::Ended { .. })
                })
                .count()
        };
        let newest = remembered(ids - 100, ids);
        let oldest = remembered(0, 100);
        assert!(newest >= 95, "{newest} of the newest 100 remembered");
        assert!(oldest <= 5, "{oldest} of the oldest 100 remembered");
    }

    /// What an acquire id costs a held lock, by capacity, at 100K held locks: printed for
    /// BENCHMARKS.md, and bounded so that a change that makes it grow is noticed.
    #[test]
    fn an_acquire_id_costs_a_held_lock_one_map_entry() {
        const HELD: u64 = 100_000;
        let limits = TableLimits {
            held_max: HELD as usize,
            waiters_max: 1,
            waiters_per_key_max: 1,
        };
        let tokens = TokenAllocator::new(1, u64::MAX);
        let mut bytes = [0usize; 2];
        for (with_ids, bytes) in [false, true].into_iter().zip(&mut bytes) {
            let mut t: LockTable<Never> = LockTable::with_quotas(Arc::new(Quotas::new(limits)), 7);
            for i in 0..HELD {
                let key = format!("job:{i:019}");
                let token = grant(&mut t, &tokens, key.as_bytes(), 0);
                if with_ids {
                    t.note_acquire_id(token, AcquireId::from_u128(i.into()), 0);
                }
            }
            *bytes = t.memory_bytes();
        }
        let per_lock = (bytes[1] - bytes[0]) as f64 / HELD as f64;
        eprintln!(
            "{HELD} held: {:.1} B per lock without acquire ids, {:.1} more with",
            bytes[0] as f64 / HELD as f64,
            per_lock
        );
        assert!(per_lock <= 80.0, "{per_lock} B per lock for its acquire id");
    }

    /// An ACQUIRE whose place and tag match an ended id's, but not its whole fingerprint (an
    /// id on another key, found by search), is new: the tag only spares reading the entry.
    #[test]
    fn a_matching_tag_alone_is_not_a_repeat() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(5);
        let token = grant(&mut t, &tokens, b"k", 0);
        t.note_acquire_id(token, id, 0);
        t.acquire_id_ended(1, b"k", token, EndedHow::Released);
        t.check_acquire_ids();
        let seed = t.hash_seed;
        let tag = |id, key| {
            let (place, mixed) = ended_place(seed, id);
            (place, tag_of(fingerprint(mixed, hash_key(seed, key))))
        };
        let ended = tag(id, b"k");
        let twin = (6..50_000_000u128)
            .map(AcquireId::from_u128)
            .find(|&other| tag(other, b"other") == ended)
            .expect("some id shares the place and the tag");
        assert_eq!(t.repeat_of(2, b"other", twin), Repeat::New);
        assert_eq!(t.repeat_of(2, b"other", id), Repeat::New);
        assert!(matches!(t.repeat_of(2, b"k", id), Repeat::Ended { .. }));
    }

    /// The newest end is held back until the next one (`AcquireIds::pending`): it answers a
    /// repeat before it is written, and it replaces an older end at its place then too.
    #[test]
    fn the_newest_end_is_its_place_before_it_is_written() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let seed = t.hash_seed;
        let first = AcquireId::from_u128(11);
        let (place, _) = ended_place(seed, first);
        let second = (12..1_000_000u128)
            .map(AcquireId::from_u128)
            .find(|&id| ended_place(seed, id).0 == place)
            .expect("some id shares the place");
        let end = |t: &mut LockTable<Never>, id, now| {
            let token = grant(t, &tokens, b"k", now);
            t.note_acquire_id(token, id, 0);
            let lease_id = LeaseId::from_u128(now.into());
            let released = t.release(now, b"k", lease_id, &tokens, &mut Vec::new());
            assert!(matches!(released, crate::table::Release::Released { .. }));
            t.acquire_id_ended(now, b"k", token, EndedHow::Released);
            t.check_acquire_ids();
            token
        };
        let first_token = end(&mut t, first, 1);
        let ended = |token| Repeat::Ended {
            how: EndedHow::Released,
            token,
        };
        assert_eq!(t.repeat_of(2, b"k", first), ended(first_token));
        assert_eq!(
            t.acquire_ids_count(),
            (0, 1),
            "the held-back end is counted"
        );
        let second_token = end(&mut t, second, 3);
        assert_eq!(
            t.repeat_of(4, b"k", first),
            Repeat::New,
            "replaced at its place"
        );
        assert_eq!(t.repeat_of(4, b"k", second), ended(second_token));
        assert_eq!(t.acquire_ids_count(), (0, 1));
    }

    /// An ACQUIRE with an acquire id granted at once on a free key: `acquire_with_id`.
    fn grant_with_id(
        t: &mut LockTable<Never>,
        tokens: &TokenAllocator,
        key: &[u8],
        id: AcquireId,
        now: u64,
    ) -> (u64, LeaseId) {
        let args = args(key, 0xfeed);
        let kind = LeaseKind::Exclusive;
        match t.acquire_with_id(now, args, kind, id, tokens, &mut Vec::new()) {
            Ok(Acquire::Granted(grant)) => (grant.token, grant.lease_id),
            other => panic!("{other:?}"),
        }
    }

    /// A grant at once derives its lease id: no live map entry, yet a repeat meets it
    /// (renewed or not), its end is remembered with its acquire id, and a snapshot and
    /// an undo learn the id from the slot.
    #[test]
    fn a_derived_lease_is_met_by_its_repeats_and_remembered_at_its_end() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(0x1234_5678_9abc);
        let (token, lease_id) = grant_with_id(&mut t, &tokens, b"k", id, 0);
        assert_ne!(
            lease_id,
            LeaseId::from_u128(0xfeed),
            "derived, not the one offered"
        );
        t.note_acquire_id(token, id, 5);
        assert!(t.acquire_ids.live.is_empty(), "no live map entry");
        assert_eq!(t.acquire_ids_count().0, 1, "STATS still counts it");
        assert_eq!(t.held_acquire_id(b"k", token), Some(id));
        let logged = t.logged_ttl(b"k").unwrap();
        assert_eq!(t.acquire_id_of(token, lease_id, logged), Some(id));
        t.check_acquire_ids();
        let met = |t: &mut LockTable<Never>, now| t.repeat_of(now, b"k", id);
        assert!(matches!(
            met(&mut t, 100),
            Repeat::Live { token: tk, lease_id: l, ticket: 5, .. } if tk == token && l == lease_id
        ));
        assert_eq!(t.repeat_of(100, b"k", AcquireId::from_u128(7)), Repeat::New);
        assert_eq!(t.repeat_of(100, b"other", id), Repeat::New);
        let renewed = t.renew(200, b"k", lease_id, 1000, || 0);
        assert!(
            matches!(renewed, crate::table::Renew::Renewed { .. }),
            "{renewed:?}"
        );
        assert!(matches!(
            met(&mut t, 300),
            Repeat::Live {
                ttl_left_ms: 900,
                ..
            }
        ));
        let released = t.release(400, b"k", lease_id, &tokens, &mut Vec::new());
        assert!(matches!(released, crate::table::Release::Released { .. }));
        assert_eq!(
            t.acquire_ids.released,
            (token, hash_key(t.hash_seed, b"k")),
            "its end reuses the release's hash of the key"
        );
        t.acquire_id_ended(400, b"k", token, EndedHow::Released);
        t.check_acquire_ids();
        let ended = Repeat::Ended {
            how: EndedHow::Released,
            token,
        };
        assert_eq!(met(&mut t, 500), ended);
        assert_eq!(t.acquire_ids_count(), (0, 1));
    }

    /// A derived lease that runs out is remembered as expired by the table itself (the
    /// executor's report of the expiry finds nothing more to do), and its key then serves
    /// its repeat as ended, not as a new grant.
    #[test]
    fn a_derived_lease_that_expires_is_remembered_as_expired() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(99);
        let (token, _) = grant_with_id(&mut t, &tokens, b"k", id, 0);
        let mut events = Vec::new();
        t.advance(2000, 100, &tokens, &mut events);
        assert!(matches!(events.as_slice(), [Event::Expired { token: tk, .. }] if *tk == token));
        t.acquire_id_ended(2000, b"k", token, EndedHow::Expired);
        t.check_acquire_ids();
        let expired = Repeat::Ended {
            how: EndedHow::Expired,
            token,
        };
        assert_eq!(t.repeat_of(2001, b"k", id), expired);
        assert_eq!(t.acquire_ids_count(), (0, 1));
    }

    /// A derived grant taken back (never durable) answers no repeat, even once freed; a
    /// lease put back after a failed release keeps its id in the live map.
    #[test]
    fn a_derived_grant_forgotten_is_new_and_one_put_back_is_live() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(3);
        let (token, lease_id) = grant_with_id(&mut t, &tokens, b"k", id, 0);
        t.forget_acquire_id(b"k", token);
        t.release(1, b"k", lease_id, &tokens, &mut Vec::new());
        t.acquire_id_ended(1, b"k", token, EndedHow::Released);
        assert_eq!(t.repeat_of(2, b"k", id), Repeat::New);
        let (token, lease_id) = grant_with_id(&mut t, &tokens, b"k", id, 3);
        t.note_acquire_id(token, id, 0);
        let logged = t.logged_ttl(b"k").unwrap();
        t.release(4, b"k", lease_id, &tokens, &mut Vec::new());
        t.acquire_id_ended(4, b"k", token, EndedHow::Released);
        // The undo of that release: the lease comes back with its logged TTL and its id.
        t.restore(5, b"k", lease_id, token, 1000, b"");
        t.restore_logged_ttl(b"k", token, logged);
        t.note_acquire_id(token, id, 0);
        t.check_acquire_ids();
        assert!(matches!(t.repeat_of(6, b"k", id), Repeat::Live { token: tk, .. } if tk == token));
        assert_eq!(t.acquire_ids.live.len(), 1, "in the live map");
    }

    /// The derivation is a permutation under the table's key: back and forth, and another
    /// key derives another lease id.
    #[test]
    fn lease_ids_derive_and_give_their_acquire_ids_back() {
        let cipher = LeaseIdCipher::new([0x0123_4567_89ab_cdef_fedc_ba98_7654_3210, 77]);
        let id = AcquireId::from_u128(42);
        let lease_id = cipher.derive(id, 7);
        assert_eq!(cipher.acquire_id_of(lease_id, 7), id);
        assert_ne!(
            cipher.derive(id, 8),
            lease_id,
            "another token, another lease id"
        );
        assert_ne!(
            LeaseIdCipher::new([1, 77]).derive(id, 7),
            lease_id,
            "another key"
        );
        assert_ne!(
            LeaseIdCipher::new([0x0123_4567_89ab_cdef_fedc_ba98_7654_3210, 78]).derive(id, 7),
            lease_id,
            "another mask key"
        );
    }

    /// Acquire ids chosen so that `id XOR token` is one value (a counter beside the tokens)
    /// still give every grant its own lease id, on one key and across keys (outside test
    /// a44: they all got one lease id, and a stale holder could renew and release the next
    /// one's lease).
    #[test]
    fn acquire_ids_chosen_against_the_tokens_still_get_distinct_lease_ids() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let mut seen = std::collections::HashSet::new();
        for n in 1..=64u128 {
            let key = if n % 2 == 0 { b"a" } else { b"b" };
            let token = tokens.next_token();
            let id = AcquireId((0x5a5a ^ u128::from(token)).to_le_bytes());
            let (granted, lease_id) = grant_with_id(&mut t, &tokens, key, id, n as u64);
            assert_eq!(granted, token);
            assert!(seen.insert(lease_id), "lease id {lease_id:?} given twice");
            t.release(n as u64, key, lease_id, &tokens, &mut Vec::new());
            t.acquire_id_ended(n as u64, key, granted, EndedHow::Released);
        }
    }

    #[test]
    fn forgotten_grant_is_new() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(7);
        let token = grant(&mut t, &tokens, b"k", 0);
        t.note_acquire_id(token, id, 0);
        t.forget_acquire_id(b"k", token);
        assert_eq!(t.repeat_of(1, b"k", id), Repeat::New);
        t.acquire_id_ended(2, b"k", token, EndedHow::Released);
        assert_eq!(t.repeat_of(3, b"k", id), Repeat::New);
    }
}
