//! The rarely used part of the slots in use (metadata, waiter queue), kept beside the slab in
//! a map by slot number rather than behind a pointer in every slot: most locks have neither,
//! and an 8-byte pointer in each slot was a ninth of a lock's memory. A slot with an entry
//! here says so with a flag in its [`KeyRef`], so a slot without one never probes the map.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::keys::KeyRef;
use super::slab::Slab;
use super::slot::Extra;

/// Slot numbers to their extras; see the module docs.
pub(super) type Extras<W> = HashMap<u32, Extra<W>, BuildHasherDefault<SlotHasher>>;

/// Hashes a slot number by one multiplication: the numbers are the table's own, not a
/// client's, so they need spreading, not protection from collisions chosen on purpose.
#[derive(Default)]
pub(super) struct SlotHasher(u64);

impl Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(byte));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// The slot's extras, if it has any.
pub(super) fn get<'a, W>(
    slots: &Slab<W>,
    extras: &'a Extras<W>,
    slot: usize,
) -> Option<&'a Extra<W>> {
    if !slots[slot].key_ref.has_extra() {
        return None;
    }
    Some(
        extras
            .get(&(slot as u32))
            .expect("a slot flagged with extras has them"),
    )
}

/// The slot's extras to change, if it has any.
pub(super) fn get_mut<'a, W>(
    slots: &Slab<W>,
    extras: &'a mut Extras<W>,
    slot: usize,
) -> Option<&'a mut Extra<W>> {
    if !slots[slot].key_ref.has_extra() {
        return None;
    }
    Some(
        extras
            .get_mut(&(slot as u32))
            .expect("a slot flagged with extras has them"),
    )
}

/// The slot's extras, made empty ones if it had none.
pub(super) fn get_or_insert<'a, W>(
    slots: &mut Slab<W>,
    extras: &'a mut Extras<W>,
    slot: usize,
) -> &'a mut Extra<W> {
    let key = &mut slots[slot].key_ref;
    *key = key.with_extra(true);
    extras
        .entry(slot as u32)
        .or_insert_with(|| Extra::new(Box::default()))
}

/// Drops the slot's extras if they hold nothing (or `always`), clearing its flag.
pub(super) fn tidy<W>(slots: &mut Slab<W>, extras: &mut Extras<W>, slot: usize, always: bool) {
    let key = &mut slots[slot].key_ref;
    if !key.has_extra() {
        return;
    }
    let empty = extras
        .get(&(slot as u32))
        .is_some_and(|extra| extra.meta.is_empty() && extra.queue.is_empty());
    if empty || always {
        extras.remove(&(slot as u32));
        *key = key.with_extra(false);
    }
}

/// Sets the holder's metadata of a slot, adding extras only if needed.
pub(super) fn set_meta<W>(
    slots: &mut Slab<W>,
    extras: &mut Extras<W>,
    slot: usize,
    meta: Box<[u8]>,
) {
    match get_mut(slots, extras, slot) {
        Some(extra) => extra.meta = meta,
        None if meta.is_empty() => {}
        None => get_or_insert(slots, extras, slot).meta = meta,
    }
}

/// Flags a key reference; used by `KeyRef` so the flag sits in a word the slot has anyway.
pub(super) const EXTRA_FLAG: u32 = 1 << 31;

impl KeyRef {
    /// Whether the slot holding this reference has extras.
    pub(super) fn has_extra(self) -> bool {
        self.bits() & EXTRA_FLAG != 0
    }

    /// This reference with the extras flag set or clear.
    pub(super) fn with_extra(self, extra: bool) -> KeyRef {
        let bits = self.bits() & !EXTRA_FLAG;
        KeyRef::from_bits(if extra { bits | EXTRA_FLAG } else { bits })
    }
}
