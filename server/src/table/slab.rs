//! The slab of one shard's slots: chunks of [`CHUNK_SLOTS`] slots allocated one at a time and
//! never moved, so a slot's number stays valid, the slab grows in small steps with no copying
//! (a doubling vector would, for a moment, hold the old and the new array), and at most one
//! chunk is partly used.

use std::ops::{Index, IndexMut};

use super::slot::Slot;
use crate::wheel::{Link, Nodes};

/// Slots per chunk (a power of two): 72 KiB of 72-byte slots, small beside a shard's
/// population yet large enough that the chunk table stays in cache.
const CHUNK_SLOTS: usize = 1024;

/// A growable array of slots in fixed chunks; see the module docs.
#[derive(Debug)]
pub(super) struct Slab<W> {
    /// Every chunk but the last is full; none ever reallocates.
    chunks: Vec<Vec<Slot<W>>>,
    /// Slots in all chunks.
    len: usize,
}

impl<W> Slab<W> {
    /// An empty slab.
    pub(super) fn new() -> Self {
        Slab {
            chunks: Vec::new(),
            len: 0,
        }
    }

    /// Slots in the slab (free ones included).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Appends `slot` and returns its number.
    pub(super) fn push(&mut self, slot: Slot<W>) -> usize {
        if self.len.is_multiple_of(CHUNK_SLOTS) {
            self.chunks.push(Vec::with_capacity(CHUNK_SLOTS));
        }
        self.chunks.last_mut().expect("a chunk").push(slot);
        self.len += 1;
        self.len - 1
    }

    /// Every slot in number order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Slot<W>> + '_ {
        self.chunks.iter().flatten()
    }

    /// Heap bytes reserved by the chunks and the chunk table.
    pub(super) fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK_SLOTS * size_of::<Slot<W>>()
            + self.chunks.capacity() * size_of::<Vec<Slot<W>>>()
    }
}

impl<W> Index<usize> for Slab<W> {
    type Output = Slot<W>;

    fn index(&self, number: usize) -> &Slot<W> {
        &self.chunks[number / CHUNK_SLOTS][number % CHUNK_SLOTS]
    }
}

impl<W> IndexMut<usize> for Slab<W> {
    fn index_mut(&mut self, number: usize) -> &mut Slot<W> {
        &mut self.chunks[number / CHUNK_SLOTS][number % CHUNK_SLOTS]
    }
}

/// Lease timers live in the slots: a lease's deadline and its link in the wheel.
impl<W> Nodes for Slab<W> {
    fn deadline_ms(&self, node: u32) -> u64 {
        self[node as usize].deadline_ms
    }

    fn link(&self, node: u32) -> Link {
        self[node as usize].link
    }

    fn link_mut(&mut self, node: u32) -> &mut Link {
        &mut self[node as usize].link
    }
}
