//! Key storage and the key -> slot index of the lock table.
//!
//! The table must find a lock by key (client requests) and a key by lock (timers fire with a
//! slot number). `std::collections::HashMap<Box<[u8]>, u32>` would store every key twice or
//! force a second allocation, so instead each key lives once, in its slot, and this index is a
//! bare open-addressing table of `u64` buckets: the top 32 bits of the key's hash (a tag that
//! also gives the home bucket, so growing and deleting never rehash a key) and the slot
//! number. Lookups compare the key only on a tag match. Linear probing with backward-shift
//! deletion keeps it free of tombstones.
//!
//! Keys of up to `KEY_INLINE_MAX` bytes (the common case) are stored inline in the slot.

/// Bucket value for "empty"; slot numbers stay below `u32::MAX` so it cannot collide.
const EMPTY: u64 = u64::MAX;
/// The index grows when more than `LOAD_NUMERATOR / LOAD_DENOMINATOR` of the buckets are used.
const LOAD_NUMERATOR: usize = 7;
/// See `LOAD_NUMERATOR`.
const LOAD_DENOMINATOR: usize = 8;
/// Smallest bucket count (a power of two).
const BUCKETS_MIN: usize = 16;
/// At most 2^32 buckets, since the home bucket comes from the 32-bit tag.
const BUCKETS_MAX: usize = 1 << 32;
/// Longest key stored inside the slot without a heap allocation.
pub(super) const KEY_INLINE_MAX: usize = 22;

/// A key's bytes: inline when short, else on the heap.
#[derive(Clone, Debug)]
pub(super) enum KeyBytes {
    /// The first `len` bytes of `bytes` are the key.
    Inline {
        /// Key length, at most `KEY_INLINE_MAX`.
        len: u8,
        /// Key bytes, zero-padded.
        bytes: [u8; KEY_INLINE_MAX],
    },
    /// A key longer than `KEY_INLINE_MAX`.
    Heap(Box<[u8]>),
}

impl KeyBytes {
    /// Stores `key`, inline if it fits.
    pub(super) fn new(key: &[u8]) -> Self {
        if key.len() <= KEY_INLINE_MAX {
            let mut bytes = [0; KEY_INLINE_MAX];
            bytes[..key.len()].copy_from_slice(key);
            KeyBytes::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            KeyBytes::Heap(key.into())
        }
    }

    /// The key.
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { len, bytes } => &bytes[..usize::from(*len)],
            KeyBytes::Heap(bytes) => bytes,
        }
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
    /// `(tag << 32) | slot`, or `EMPTY`. Length is a power of two.
    buckets: Vec<u64>,
    /// Used buckets.
    len: usize,
}

impl KeyIndex {
    /// An empty index.
    pub(super) fn new() -> Self {
        KeyIndex {
            buckets: vec![EMPTY; BUCKETS_MIN],
            len: 0,
        }
    }

    /// Number of keys indexed.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of memory held by the buckets.
    pub(super) fn bytes(&self) -> usize {
        self.buckets.capacity() * size_of::<u64>()
    }

    /// The slot of the key with this hash for which `is_key(slot)` is true.
    pub(super) fn find(&self, hash: u64, mut is_key: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = tag_of(hash);
        let mask = self.buckets.len() - 1;
        let mut position = self.home(tag);
        loop {
            let bucket = self.buckets[position];
            if bucket == EMPTY {
                return None;
            }
            if (bucket >> 32) as u32 == tag && is_key(bucket as u32) {
                return Some(bucket as u32);
            }
            position = (position + 1) & mask;
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
        let mask = self.buckets.len() - 1;
        let mut hole = self.home(tag_of(hash));
        while self.buckets[hole] != wanted {
            assert!(
                self.buckets[hole] != EMPTY,
                "slot {slot} missing from key index"
            );
            hole = (hole + 1) & mask;
        }
        // Backward-shift deletion: pull later members of the probe run into the hole when
        // their home is not strictly between the hole and their position.
        let mut position = hole;
        loop {
            position = (position + 1) & mask;
            let bucket = self.buckets[position];
            if bucket == EMPTY {
                break;
            }
            let home = self.home((bucket >> 32) as u32);
            let distance_home = position.wrapping_sub(home) & mask;
            let distance_hole = position.wrapping_sub(hole) & mask;
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

    /// The home bucket of a tag: its top bits, as many as the bucket count needs.
    fn home(&self, tag: u32) -> usize {
        let bits = self.buckets.len().trailing_zeros();
        ((u64::from(tag) << 32) >> (64 - bits)) as usize
    }

    /// Stores a bucket value at the first free position of its probe run.
    fn put(&mut self, bucket: u64) {
        let mask = self.buckets.len() - 1;
        let mut position = self.home((bucket >> 32) as u32);
        while self.buckets[position] != EMPTY {
            position = (position + 1) & mask;
        }
        self.buckets[position] = bucket;
    }

    /// Doubles the bucket count; tags carry the home bucket, so no key is rehashed.
    fn grow(&mut self) {
        let count = self.buckets.len() * 2;
        assert!(count <= BUCKETS_MAX, "key index full");
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; count]);
        for bucket in old.into_iter().filter(|&bucket| bucket != EMPTY) {
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

    #[test]
    fn key_bytes_round_trip() {
        for len in [0, 1, KEY_INLINE_MAX, KEY_INLINE_MAX + 1, 1024] {
            let key: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let stored = KeyBytes::new(&key);
            assert_eq!(stored.as_slice(), &key[..]);
            assert_eq!(
                matches!(stored, KeyBytes::Inline { .. }),
                len <= KEY_INLINE_MAX
            );
        }
        assert_eq!(size_of::<KeyBytes>(), 24);
    }

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
