//! Acquire ids: which live lease answered which ACQUIRE, and how recently ended ones ended,
//! so a repeat of an ACQUIRE (same key, same acquire id) is answered with the first one's
//! outcome instead of a second grant (PROTOCOL.md "Acquire ids").
//!
//! Beside the slots, not in them: a slot is most of a held lock's memory and most leases
//! have no acquire id, so a plain lease pays nothing (a grant, a free and a plain ACQUIRE
//! touch none of this; a free only checks that the live map is not empty). A lease with
//! one costs an entry of the live map, keyed by its fencing token (unique across keys, so
//! the key need not be stored: the key's holder names the token).
//!
//! Ended ones are remembered for at most [`ENDED_KEEP_MS`] and at most [`ENDED_PER_SHARD_MAX`]
//! per shard, oldest forgotten first; a repeat after that is a new ACQUIRE.
//!
//! The caller (the executor) keeps the live map in step with the table: it notes an id
//! when a grant with one is logged and tells [`LockTable::acquire_id_ended`] of every lease
//! end. Time arrives as `now_ms`, as everywhere in the table.

use std::collections::{HashMap, VecDeque};

use tenure_protocol::{AcquireId, EndedHow, LeaseId};

use super::index::hash_key;
use super::{LockTable, WaiterSink};

/// Longest an ended lease's acquire id is remembered, in milliseconds: the longest wait plus
/// ten minutes of retries, longer than a client retries one ACQUIRE (its wait plus its
/// time-outs), so a retry inside it meets the answer.
pub const ENDED_KEEP_MS: u64 = tenure_protocol::limits::WAIT_MS_MAX as u64 + 600_000;
/// Most ended acquire ids remembered per shard (about 100 bytes each); the oldest goes first.
pub const ENDED_PER_SHARD_MAX: usize = 4096;

/// A live lease granted to an ACQUIRE with an acquire id.
#[derive(Clone, Copy, Debug)]
struct Live {
    acquire_id: AcquireId,
    /// The journal ticket of its grant: a repeat's reply waits for it like the first one's.
    ticket: u64,
}

/// An ended lease of an ACQUIRE with an acquire id.
#[derive(Clone, Copy, Debug)]
struct Ended {
    /// The key's hash under the shard's seed, so a repeat on another key is not taken for it.
    key_hash: u64,
    token: u64,
    how: EndedHow,
    ended_ms: u64,
}

/// A shard's acquire ids; see the module docs.
#[derive(Debug, Default)]
pub(super) struct AcquireIds {
    /// Live leases with an acquire id, by fencing token.
    live: HashMap<u64, Live>,
    ended: HashMap<AcquireId, Ended>,
    /// Ended ids, oldest first, for forgetting them (an id may also be in here for an entry
    /// of `ended` that was replaced: the token tells).
    ended_order: VecDeque<(AcquireId, u64)>,
}

/// What a repeat of an ACQUIRE meets ([`LockTable::repeat_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repeat {
    /// The key's holder is the lease this acquire id was granted.
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
    /// Nothing is known of it: a first send, or one forgotten.
    New,
}

impl<W: WaiterSink> LockTable<W> {
    /// Remembers that the lease with fencing token `token` answered `acquire_id`, its grant
    /// logged with `ticket` (0 for a lease brought back by recovery, durable already).
    pub fn note_acquire_id(&mut self, token: u64, acquire_id: AcquireId, ticket: u64) {
        self.acquire_ids
            .live
            .insert(token, Live { acquire_id, ticket });
        self.acquire_ids.ended.remove(&acquire_id);
    }

    /// The acquire id of the live lease with fencing token `token`, if it had one.
    pub fn acquire_id_of(&self, token: u64) -> Option<AcquireId> {
        if self.acquire_ids.live.is_empty() {
            return None;
        }
        self.acquire_ids
            .live
            .get(&token)
            .map(|live| live.acquire_id)
    }

    /// The lease of `key` with fencing token `token` ended, `how`: its acquire id, if it had
    /// one, is remembered as ended. Cheap for leases without: one emptiness check while no
    /// lease of the shard has an id.
    pub fn acquire_id_ended(&mut self, now_ms: u64, key: &[u8], token: u64, how: EndedHow) {
        if self.acquire_ids.live.is_empty() {
            return;
        }
        let Some(live) = self.acquire_ids.live.remove(&token) else {
            return;
        };
        let ended = Ended {
            key_hash: hash_key(self.hash_seed, key),
            token,
            how,
            ended_ms: now_ms,
        };
        let ids = &mut self.acquire_ids;
        ids.ended.insert(live.acquire_id, ended);
        ids.ended_order.push_back((live.acquire_id, token));
        ids.forget_old(now_ms);
    }

    /// Forgets the lease with fencing token `token` as if it had never had an acquire id: a
    /// grant taken back because it never became durable (a repeat is then a new ACQUIRE).
    pub fn forget_acquire_id(&mut self, token: u64) {
        if !self.acquire_ids.live.is_empty() {
            self.acquire_ids.live.remove(&token);
        }
    }

    /// What a repeat of `acquire_id` on `key` meets at `now_ms`. Call it on a settled key
    /// (`settle_key` first), so a lease past its deadline has ended and is reported so.
    pub fn repeat_of(&mut self, now_ms: u64, key: &[u8], acquire_id: AcquireId) -> Repeat {
        let now_ms = self.observe(now_ms);
        if let Some(slot) = self.find(key) {
            let lock = &self.slots[slot];
            let live = self.acquire_ids.live.get(&lock.token);
            if let Some(live) = live.filter(|live| live.acquire_id == acquire_id) {
                if lock.deadline_ms > now_ms {
                    return Repeat::Live {
                        token: lock.token,
                        lease_id: lock.lease_id,
                        ttl_left_ms: lock.deadline_ms - now_ms,
                        ticket: live.ticket,
                    };
                }
            }
        }
        self.acquire_ids.forget_old(now_ms);
        match self.acquire_ids.ended.get(&acquire_id) {
            Some(ended) if ended.key_hash == hash_key(self.hash_seed, key) => Repeat::Ended {
                how: ended.how,
                token: ended.token,
            },
            _ => Repeat::New,
        }
    }

    /// The fencing token of `key`'s holder if `lease_id` is its lease.
    pub fn token_of(&self, key: &[u8], lease_id: LeaseId) -> Option<u64> {
        let lock = &self.slots[self.find(key)?];
        (lock.token != 0 && lock.lease_id == lease_id).then_some(lock.token)
    }

    /// Leases with an acquire id, and ended ids remembered, for STATS.
    pub fn acquire_ids_count(&self) -> (usize, usize) {
        (self.acquire_ids.live.len(), self.acquire_ids.ended.len())
    }

    /// Checks the acquire ids against the table: every live one names a held lease.
    pub(super) fn check_acquire_ids(&self) {
        if self.acquire_ids.live.is_empty() {
            return;
        }
        let held: std::collections::HashSet<u64> =
            self.slots.iter().map(|lock| lock.token).collect();
        for token in self.acquire_ids.live.keys() {
            assert!(
                held.contains(token),
                "acquire id noted for token {token}, which no slot holds"
            );
        }
        assert!(self.acquire_ids.ended.len() <= ENDED_PER_SHARD_MAX);
    }
}

impl AcquireIds {
    /// Bytes held, by capacity (a map's entries and control bytes, the queue's entries).
    pub(super) fn memory_bytes(&self) -> usize {
        self.live.capacity() * (size_of::<(u64, Live)>() + 1)
            + self.ended.capacity() * (size_of::<(AcquireId, Ended)>() + 1)
            + self.ended_order.capacity() * size_of::<(AcquireId, u64)>()
    }

    /// Drops ended ids over the count limit or older than the time limit, oldest first.
    fn forget_old(&mut self, now_ms: u64) {
        while let Some(&(acquire_id, token)) = self.ended_order.front() {
            let entry = self.ended.get(&acquire_id).filter(|e| e.token == token);
            let stale = entry.is_none_or(|e| now_ms.saturating_sub(e.ended_ms) > ENDED_KEEP_MS);
            if !stale && self.ended_order.len() <= ENDED_PER_SHARD_MAX {
                return;
            }
            self.ended_order.pop_front();
            if entry.is_some() {
                self.ended.remove(&acquire_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{Acquire, AcquireArgs, Quotas, TableLimits, TokenAllocator};
    use std::sync::Arc;

    #[derive(Debug)]
    struct Never;
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

    fn grant(t: &mut LockTable<Never>, tokens: &TokenAllocator, key: &[u8], now: u64) -> u64 {
        let args = AcquireArgs {
            key,
            lease_id: LeaseId::from_u128(now.into()),
            ttl_ms: 1000,
            wait_ms: 0,
            waiter: None,
            meta: b"",
        };
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
        assert_eq!(t.acquire_ids_count(), (0, 0));
    }

    #[test]
    fn ended_ids_are_bounded_by_count() {
        let mut t = table();
        for i in 0..ENDED_PER_SHARD_MAX as u64 + 10 {
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
        assert_eq!(t.acquire_ids_count(), (0, ENDED_PER_SHARD_MAX));
        // The oldest went first.
        assert_eq!(t.repeat_of(0, b"k", AcquireId::from_u128(0)), Repeat::New);
        assert!(matches!(
            t.repeat_of(0, b"k", AcquireId::from_u128(20)),
            Repeat::Ended { .. }
        ));
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

    #[test]
    fn forgotten_grant_is_new() {
        let mut t = table();
        let tokens = TokenAllocator::new(1, 1000);
        let id = AcquireId::from_u128(7);
        let token = grant(&mut t, &tokens, b"k", 0);
        t.note_acquire_id(token, id, 0);
        t.forget_acquire_id(token);
        assert_eq!(t.repeat_of(1, b"k", id), Repeat::New);
        t.acquire_id_ended(2, b"k", token, EndedHow::Released);
        assert_eq!(t.repeat_of(3, b"k", id), Repeat::New);
    }
}
