//! Key storage of one shard for keys too long for their slot's inline room: their bytes in
//! an arena of fixed-size chunks, named by a 4-byte [`KeyRef`].
//!
//! A heap allocation per long key would add the allocator's own overhead and a pointer; here
//! a key costs its length plus a one- or three-byte length prefix, rounded up to
//! [`GRANULE_BYTES`], and no allocation. Freed entries go on a free list per size (in granules) and are
//! reused by the next key of that size, so a steady population of similar keys stays in the
//! room it first took. Chunks are allocated one at a time and never moved, so the arena grows
//! in steps of [`CHUNK_BYTES`] with no copying and no doubling.
//!
//! Entry layout: a length byte `n < 255` then `n` key bytes, or `255`, the length as a
//! little-endian `u16`, then the key bytes. A free entry's first four bytes hold the next free
//! entry of its size.

use tenure_protocol::limits::KEY_LEN_MAX;

use super::extras::EXTRA_FLAG;

/// Allocation unit: every entry starts on a granule and takes whole granules.
const GRANULE_BYTES: usize = 4;
/// Bytes per chunk (a power of two), allocated when the last one is full.
const CHUNK_BYTES: usize = 64 << 10;
/// Granules per chunk.
const CHUNK_GRANULES: usize = CHUNK_BYTES / GRANULE_BYTES;
/// A length byte of this value means a `u16` length follows.
const LONG_LEN: u8 = u8::MAX;
/// Longest prefix: the marker and a `u16`.
const PREFIX_LEN_MAX: usize = 3;
/// Most granules one entry can take.
const ENTRY_GRANULES_MAX: usize = (KEY_LEN_MAX + PREFIX_LEN_MAX).div_ceil(GRANULE_BYTES);
const _: () = assert!(ENTRY_GRANULES_MAX <= CHUNK_GRANULES);
const _: () = assert!(KEY_LEN_MAX <= u16::MAX as usize);
/// End of a free list.
const NIL: u32 = u32::MAX;

/// Where a key is in its shard's arena: the number of its first granule, below
/// `EXTRA_FLAG`, which the slot holding it may set (see `extras`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct KeyRef(u32);

impl KeyRef {
    /// No key (a free slot's).
    pub(super) const NONE: KeyRef = KeyRef(EXTRA_FLAG - 1);

    /// The raw word, flag included.
    pub(super) const fn bits(self) -> u32 {
        self.0
    }

    /// From a raw word, flag included.
    pub(super) fn from_bits(bits: u32) -> KeyRef {
        KeyRef(bits)
    }

    /// The granule number, without the flag.
    fn granule(self) -> u32 {
        self.0 & !EXTRA_FLAG
    }
}

/// The key bytes of one shard; see the module docs.
#[derive(Debug, Default)]
pub(super) struct KeyArena {
    /// Fixed-size chunks; granule `g` is in chunk `g / CHUNK_GRANULES`.
    chunks: Vec<Box<[u8]>>,
    /// Granules used in the last chunk.
    used: usize,
    /// First free entry of each size in granules (index 0 unused), or `NIL`.
    free: Vec<u32>,
    /// Keys stored.
    len: usize,
}

impl KeyArena {
    /// Stores `key` and returns where.
    ///
    /// # Panics
    /// If the key is longer than `KEY_LEN_MAX` or the arena has 2^32 granules.
    pub(super) fn insert(&mut self, key: &[u8]) -> KeyRef {
        assert!(key.len() <= KEY_LEN_MAX, "key of {} bytes", key.len());
        let granules = entry_granules(key.len());
        let at = self.take(granules);
        let entry = self.entry_mut(at, granules);
        let start = if key.len() < usize::from(LONG_LEN) {
            entry[0] = key.len() as u8;
            1
        } else {
            entry[0] = LONG_LEN;
            entry[1..3].copy_from_slice(&(key.len() as u16).to_le_bytes());
            PREFIX_LEN_MAX
        };
        entry[start..start + key.len()].copy_from_slice(key);
        self.len += 1;
        KeyRef(at)
    }

    /// The key at `at` (empty for [`KeyRef::NONE`]).
    pub(super) fn get(&self, at: KeyRef) -> &[u8] {
        if at.granule() == KeyRef::NONE.granule() {
            return &[];
        }
        let (chunk, offset) = locate(at.granule());
        let bytes = &self.chunks[chunk][offset..];
        let (start, len) = match bytes[0] {
            LONG_LEN => (
                PREFIX_LEN_MAX,
                usize::from(u16::from_le_bytes([bytes[1], bytes[2]])),
            ),
            short => (1, usize::from(short)),
        };
        &bytes[start..start + len]
    }

    /// Frees the key at `at` for reuse.
    pub(super) fn remove(&mut self, at: KeyRef) {
        let granules = entry_granules(self.get(at).len());
        self.give_back(at.granule(), granules);
        self.len -= 1;
    }

    /// Heap bytes reserved by the chunks.
    pub(super) fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK_BYTES + self.free.capacity() * size_of::<u32>()
    }

    /// Keys stored.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// A free entry of `granules`, reused or cut from the last chunk.
    fn take(&mut self, granules: usize) -> u32 {
        if let Some(&head) = self.free.get(granules).filter(|&&head| head != NIL) {
            let (chunk, offset) = locate(head);
            let next = &self.chunks[chunk][offset..offset + 4];
            self.free[granules] = u32::from_le_bytes(next.try_into().expect("4 bytes"));
            return head;
        }
        if self.chunks.is_empty() || self.used + granules > CHUNK_GRANULES {
            if !self.chunks.is_empty() && self.used < CHUNK_GRANULES {
                // The last chunk's unused tail becomes a free entry of its size.
                let at = self.granule_at(self.chunks.len() - 1, self.used);
                self.give_back(at, CHUNK_GRANULES - self.used);
            }
            assert!(
                (self.chunks.len() + 1) * CHUNK_GRANULES < KeyRef::NONE.granule() as usize,
                "key arena full"
            );
            self.chunks.push(vec![0; CHUNK_BYTES].into_boxed_slice());
            self.used = 0;
        }
        let at = self.granule_at(self.chunks.len() - 1, self.used);
        self.used += granules;
        at
    }

    /// Puts the entry of `granules` at granule `at` on its free list.
    fn give_back(&mut self, at: u32, granules: usize) {
        if self.free.len() <= granules {
            self.free.resize(granules + 1, NIL);
        }
        let next = self.free[granules];
        self.entry_mut(at, 1)[..4].copy_from_slice(&next.to_le_bytes());
        self.free[granules] = at;
    }

    /// The bytes of the entry of `granules` at granule `at`.
    fn entry_mut(&mut self, at: u32, granules: usize) -> &mut [u8] {
        let (chunk, offset) = locate(at);
        &mut self.chunks[chunk][offset..offset + granules * GRANULE_BYTES]
    }

    /// The number of granule `granule` of chunk `chunk`.
    fn granule_at(&self, chunk: usize, granule: usize) -> u32 {
        (chunk * CHUNK_GRANULES + granule) as u32
    }
}

/// Granules an entry for a key of `len` bytes takes.
fn entry_granules(len: usize) -> usize {
    let prefix = if len < usize::from(LONG_LEN) {
        1
    } else {
        PREFIX_LEN_MAX
    };
    (prefix + len).div_ceil(GRANULE_BYTES)
}

/// Chunk and byte offset of a granule.
fn locate(granule: u32) -> (usize, usize) {
    let granule = granule as usize;
    (
        granule / CHUNK_GRANULES,
        (granule % CHUNK_GRANULES) * GRANULE_BYTES,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn a_23_byte_key_takes_24_bytes() {
        assert_eq!(entry_granules(23) * GRANULE_BYTES, 24);
        assert_eq!(entry_granules(0), 1);
        assert_eq!(entry_granules(254) * GRANULE_BYTES, 256);
        assert_eq!(entry_granules(255) * GRANULE_BYTES, 260);
        assert_eq!(entry_granules(KEY_LEN_MAX), ENTRY_GRANULES_MAX);
    }

    /// Random inserts and removes of keys of every length against a map: every key reads
    /// back, and a steady population stops the arena from growing.
    #[test]
    fn keys_read_back_and_freed_room_is_reused() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut arena = KeyArena::default();
        let mut live: Vec<(KeyRef, Vec<u8>)> = Vec::new();
        let mut bytes_at_half = 0;
        for step in 0..60_000 {
            if step == 30_000 {
                bytes_at_half = arena.bytes();
            }
            if live.len() < 2000 || rng.random_bool(0.5) {
                let len = match rng.random_range(0..10) {
                    0 => rng.random_range(0..=KEY_LEN_MAX),
                    1 => rng.random_range(250..260),
                    _ => rng.random_range(0..40),
                };
                let key: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                let at = arena.insert(&key);
                live.push((at, key));
            } else {
                let (at, key) = live.swap_remove(rng.random_range(0..live.len()));
                assert_eq!(arena.get(at), &key[..]);
                arena.remove(at);
            }
            if step % 1000 == 0 {
                for (at, key) in &live {
                    assert_eq!(arena.get(*at), &key[..], "step {step}");
                }
            }
        }
        assert_eq!(arena.len(), live.len());
        // The population hovers around 2000 keys: the second half reuses the first's room.
        assert!(
            arena.bytes() <= bytes_at_half + 2 * CHUNK_BYTES,
            "{} bytes after, {bytes_at_half} at half",
            arena.bytes()
        );
        assert_eq!(arena.get(KeyRef::NONE), b"");
    }
}
