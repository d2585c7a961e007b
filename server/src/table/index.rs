//! The key -> slot index of the lock table.
//!
//! The table must find a lock by key (client requests) and a key by lock (timers fire with a
//! slot number). `std::collections::HashMap<Box<[u8]>, u32>` would store every key twice or
//! force a second allocation, so instead each key lives once, in the shard's key arena, and
//! this index is a bare open-addressing table of `u64` buckets: the top 32 bits of the key's
//! hash (a tag that also gives the home bucket, so growing and deleting never rehash a key)
//! and the slot number. Lookups compare the key only on a tag match. Linear probing with
//! backward-shift deletion keeps it free of tombstones.
//!
//! The home bucket is the tag scaled onto the bucket count (multiply and shift), so the count
//! need not be a power of two, and the index grows by a quarter at a time: it is used between
//! 70 % and 87.5 %, where doubling would leave it between 44 % and 87.5 %, and a growth holds
//! the old and new arrays at once for 2.25 times the index, not 3 times.
//!
//! Buckets live in pages of [`PAGE_BUCKETS`] (32 KiB) once there are that many: a growth frees
//! pages of the one size every growth of every shard allocates again, where arrays of ever
//! larger sizes left the allocator holding freed blocks of sizes nothing asked for any more
//! (about 20 MB at 500K held locks over 64 shards).

/// Bucket value for "empty"; slot numbers stay below `u32::MAX` so it cannot collide.
const EMPTY: u64 = u64::MAX;
/// The index grows when more than `LOAD_NUMERATOR / LOAD_DENOMINATOR` of the buckets are used.
const LOAD_NUMERATOR: usize = 7;
/// See `LOAD_NUMERATOR`.
const LOAD_DENOMINATOR: usize = 8;
/// A growth adds `1 / GROWTH_DIVISOR` of the buckets.
const GROWTH_DIVISOR: usize = 4;
/// Smallest bucket count.
const BUCKETS_MIN: usize = 16;
/// At most 2^32 buckets, since the home bucket comes from the 32-bit tag.
const BUCKETS_MAX: usize = 1 << 32;
/// Buckets per page (a power of two); a larger index is a whole number of pages.
const PAGE_BUCKETS: usize = 4096;

/// The bucket array, in pages; see the module docs.
#[derive(Debug)]
struct Buckets {
    /// Every page has `PAGE_BUCKETS` buckets, or there is one smaller page.
    pages: Vec<Box<[u64]>>,
    /// Buckets in all pages.
    len: usize,
}

impl Buckets {
    /// `len` empty buckets: fewer than a page, or a whole number of pages.
    fn new(len: usize) -> Self {
        assert!(len < PAGE_BUCKETS || len.is_multiple_of(PAGE_BUCKETS));
        let page = len.min(PAGE_BUCKETS);
        let pages = (0..len.div_ceil(page))
            .map(|_| vec![EMPTY; page].into_boxed_slice())
            .collect();
        Buckets { pages, len }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes of the pages.
    fn bytes(&self) -> usize {
        self.len * size_of::<u64>() + self.pages.capacity() * size_of::<Box<[u64]>>()
    }

    fn iter(&self) -> impl Iterator<Item = &u64> + '_ {
        self.pages.iter().flat_map(|page| page.iter())
    }
}

impl std::ops::Index<usize> for Buckets {
    type Output = u64;

    fn index(&self, position: usize) -> &u64 {
        &self.pages[position / PAGE_BUCKETS][position % PAGE_BUCKETS]
    }
}

impl std::ops::IndexMut<usize> for Buckets {
    fn index_mut(&mut self, position: usize) -> &mut u64 {
        &mut self.pages[position / PAGE_BUCKETS][position % PAGE_BUCKETS]
    }
}

/// Hashes a key: FxHash-style word mixing from a per-table seed, then a 64-bit finalizer so
/// the top bits (used for the tag) depend on every input bit. Not cryptographic; the seed
/// makes collisions unpredictable to clients that do not know it.
pub(super) fn hash_key(seed: u64, key: &[u8]) -> u64 {
    const MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;
    let mut hash = seed ^ (key.len() as u64);
    let mut chunks = key.chunks_exact(8);
    for chunk in &mut chunks {
        let word = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        hash = (hash.rotate_left(5) ^ word).wrapping_mul(MULTIPLIER);
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    hash = (hash.rotate_left(5) ^ u64::from_le_bytes(tail)).wrapping_mul(MULTIPLIER);
    // murmur3 fmix64
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

/// Open-addressing map from key hash to slot number; see the module docs.
#[derive(Debug)]
pub(super) struct KeyIndex {
    /// `(tag << 32) | slot`, or `EMPTY`.
    buckets: Buckets,
    /// Used buckets.
    len: usize,
}

impl KeyIndex {
    /// An empty index.
    pub(super) fn new() -> Self {
        KeyIndex {
            buckets: Buckets::new(BUCKETS_MIN),
            len: 0,
        }
    }

    /// Number of keys indexed.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of memory held by the buckets.
    pub(super) fn bytes(&self) -> usize {
        self.buckets.bytes()
    }

    /// The slot of the key with this hash for which `is_key(slot)` is true.
    pub(super) fn find(&self, hash: u64, mut is_key: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = tag_of(hash);
        let mut position = self.home(tag);
        loop {
            let bucket = self.buckets[position];
            if bucket == EMPTY {
                return None;
            }
            if (bucket >> 32) as u32 == tag && is_key(bucket as u32) {
                return Some(bucket as u32);
            }
            position = self.after(position);
        }
    }

    /// Adds `slot` under `hash`; the caller has checked the key is absent.
    pub(super) fn insert(&mut self, hash: u64, slot: u32) {
        assert!(slot < u32::MAX, "slot number out of range");
        if (self.len + 1) * LOAD_DENOMINATOR > self.buckets.len() * LOAD_NUMERATOR {
            self.grow();
        }
        self.put(((tag_of(hash) as u64) << 32) | u64::from(slot));
        self.len += 1;
    }

    /// Removes `slot`, which is indexed under `hash`.
    ///
    /// # Panics
    /// If it is not there (the table's bookkeeping is broken).
    pub(super) fn remove(&mut self, hash: u64, slot: u32) {
        let wanted = ((tag_of(hash) as u64) << 32) | u64::from(slot);
        let mut hole = self.home(tag_of(hash));
        while self.buckets[hole] != wanted {
            assert!(
                self.buckets[hole] != EMPTY,
                "slot {slot} missing from key index"
            );
            hole = self.after(hole);
        }
        // Backward-shift deletion: pull later members of the probe run into the hole when
        // their home is not strictly between the hole and their position.
        let mut position = hole;
        loop {
            position = self.after(position);
            let bucket = self.buckets[position];
            if bucket == EMPTY {
                break;
            }
            let home = self.home((bucket >> 32) as u32);
            let distance_home = self.distance(home, position);
            let distance_hole = self.distance(hole, position);
            if distance_home >= distance_hole {
                self.buckets[hole] = bucket;
                hole = position;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
    }

    /// Every indexed slot number, in bucket order (for invariant checks).
    pub(super) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets
            .iter()
            .filter(|&&bucket| bucket != EMPTY)
            .map(|&bucket| bucket as u32)
    }

    /// The home bucket of a tag: the tag scaled onto the bucket count.
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.buckets.len() as u64) >> 32) as usize
    }

    /// The bucket after `position`, wrapping around.
    fn after(&self, position: usize) -> usize {
        if position + 1 == self.buckets.len() {
            0
        } else {
            position + 1
        }
    }

    /// Buckets from `from` forward to `to`, wrapping around.
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from {
            to - from
        } else {
            to + self.buckets.len() - from
        }
    }

    /// Stores a bucket value at the first free position of its probe run.
    fn put(&mut self, bucket: u64) {
        let mut position = self.home((bucket >> 32) as u32);
        while self.buckets[position] != EMPTY {
            position = self.after(position);
        }
        self.buckets[position] = bucket;
    }

    /// Adds a quarter to the bucket count; tags carry the home bucket, so no key is rehashed.
    fn grow(&mut self) {
        let mut count = self.buckets.len() + self.buckets.len() / GROWTH_DIVISOR;
        if count >= PAGE_BUCKETS {
            count = count.next_multiple_of(PAGE_BUCKETS);
        }
        let count = count.min(BUCKETS_MAX);
        assert!(count > self.buckets.len(), "key index full");
        let old = std::mem::replace(&mut self.buckets, Buckets::new(count));
        for &bucket in old.iter().filter(|&&bucket| bucket != EMPTY) {
            self.put(bucket);
        }
    }
}

/// The 32-bit tag of a hash: its top half.
fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use std::collections::HashMap;

    /// Random inserts and removes with a deliberately weak hash (many equal tags) against
    /// a `HashMap`.
    #[test]
    fn matches_hash_map() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut index = KeyIndex::new();
        let mut reference: HashMap<u32, u64> = HashMap::new();
        let mut next_slot = 0u32;
        for step in 0..20_000 {
            if rng.random_bool(0.55) || reference.is_empty() {
                let hash = u64::from(rng.random_range(0..64u32)) << 58 | rng.random::<u32>() as u64;
                index.insert(hash, next_slot);
                reference.insert(next_slot, hash);
                next_slot += 1;
            } else {
                let slot = *reference
                    .keys()
                    .nth(rng.random_range(0..reference.len()))
                    .unwrap();
                let hash = reference.remove(&slot).unwrap();
                index.remove(hash, slot);
            }
            assert_eq!(index.len(), reference.len(), "step {step}");
            if step % 97 == 0 {
                for (&slot, &hash) in &reference {
                    assert_eq!(
                        index.find(hash, |found| found == slot),
                        Some(slot),
                        "step {step}"
                    );
                }
            }
        }
    }
}
