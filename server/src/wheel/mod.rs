//! A hierarchical timer wheel: O(1) insert, expiry in deadline-slot order, no clock reads.
//!
//! The lock table needs one timer per lease and one per waiting request, potentially millions,
//! and it needs to find the due ones without sorting. A wheel gives O(1) inserts and pays for
//! expiry only at the slots that hold entries:
//!
//! ```text
//!  level 5  [ 64 slots x 2^30 ms ]   horizon 2^36 ms (~2.2 years); farther deadlines
//!    ...                              are clamped here and re-cascade every 2^36 ms
//!  level 1  [ 64 slots x 64 ms   ]   cascades into level 0 when its slot starts
//!  level 0  [ 64 slots x 1 ms    ]   entries here fire when their slot starts
//!             ^ occupied: u64 bitmap per level, one bit per non-empty slot
//! ```
//!
//! An entry sits at the level of the highest bit in which its deadline differs from
//! `elapsed_ms` (the wheel's own notion of "now"), in the slot named by the deadline's bits at
//! that level. Polling repeatedly takes the occupied slot with the earliest start (found with
//! one `rotate_right` + `trailing_zeros` per level, so an hour-long jump costs only the
//! occupied slots, never one step per tick), moves `elapsed_ms` to that start and re-inserts
//! its entries, which land on a lower level or in the ready queue. Every entry cascades at
//! most once per level, so expiry is amortized O(1) per entry.
//!
//! There is no cancel: owners validate fired entries themselves (the lock table stamps each
//! entry with a generation), which keeps an entry to a deadline plus a small payload
//! (16 bytes for an 8-byte payload) and inserts free of bookkeeping.
//!
//! The wheel never reads a clock: `now_ms` is handed in (one tick is one millisecond).

use std::collections::VecDeque;

mod linked;
pub use linked::{Link, LinkedWheel, Nodes, HEAD_BIT};

/// Number of levels; `LEVELS * SLOT_BITS` bits of deadline distance are tracked exactly.
const LEVELS: usize = 6;
/// Each level has `2^SLOT_BITS` slots, so its occupancy fits in one `u64`.
const SLOT_BITS: u32 = 6;
/// Slots per level.
const SLOTS: usize = 1 << SLOT_BITS;
/// Distance (ms) beyond which deadlines are clamped to the last level.
const HORIZON_MS: u64 = 1 << (LEVELS as u32 * SLOT_BITS);
/// Deadlines must stay below this so slot arithmetic cannot overflow (~146 million years).
pub const DEADLINE_MS_MAX: u64 = 1 << 62;
/// A drained slot keeps its vector for reuse only up to this capacity, so one burst does not
/// pin memory forever.
const SLOT_CAPACITY_RETAINED_MAX: usize = 1024;

/// One timer: the payload and the tick at which it becomes due.
#[derive(Debug)]
struct Entry<T> {
    /// Due when `now_ms >= deadline_ms`.
    deadline_ms: u64,
    /// What the owner gets back when the timer fires.
    item: T,
}

/// One ring of 64 slots with an occupancy bitmap.
#[derive(Debug)]
struct Level<T> {
    /// Bit `i` is set iff `slots[i]` is non-empty.
    occupied: u64,
    /// Entries per slot, unordered.
    slots: [Vec<Entry<T>>; SLOTS],
}

/// A hierarchical timer wheel with 1 ms ticks; see the module docs.
#[derive(Debug)]
pub struct TimerWheel<T> {
    /// `LEVELS` rings, finest first.
    levels: Box<[Level<T>]>,
    /// Entries already due but not yet handed out (because of a poll budget or because they
    /// were inserted with a deadline at or before `elapsed_ms`), in firing order.
    ready: VecDeque<Entry<T>>,
    /// Every entry still on a level has `deadline_ms > elapsed_ms`.
    elapsed_ms: u64,
    /// Entries on all levels plus the ready queue.
    len: usize,
}

impl<T> Default for TimerWheel<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> TimerWheel<T> {
    /// An empty wheel whose time starts at 0.
    pub fn new() -> Self {
        let levels = (0..LEVELS)
            .map(|_| Level {
                occupied: 0,
                slots: std::array::from_fn(|_| Vec::new()),
            })
            .collect();
        TimerWheel {
            levels,
            ready: VecDeque::new(),
            elapsed_ms: 0,
            len: 0,
        }
    }

    /// Number of entries not yet returned by `poll`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no entries are pending.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The wheel's time: every entry due at or before it has been moved to the ready queue.
    pub fn elapsed_ms(&self) -> u64 {
        self.elapsed_ms
    }

    /// Schedules `item` to fire once `now_ms >= deadline_ms`. A deadline at or before the
    /// wheel's time fires on the next poll. O(1).
    ///
    /// # Panics
    /// If `deadline_ms >= DEADLINE_MS_MAX`.
    pub fn insert(&mut self, deadline_ms: u64, item: T) {
        assert!(
            deadline_ms < DEADLINE_MS_MAX,
            "deadline {deadline_ms} ms out of range"
        );
        self.len += 1;
        self.place(Entry { deadline_ms, item });
    }

    /// Puts an entry on its level, or in the ready queue if it is already due.
    fn place(&mut self, entry: Entry<T>) {
        if entry.deadline_ms <= self.elapsed_ms {
            self.ready.push_back(entry);
            return;
        }
        let level = level_for(self.elapsed_ms, entry.deadline_ms);
        let slot = slot_for(level, entry.deadline_ms);
        let ring = &mut self.levels[level];
        ring.occupied |= 1 << slot;
        ring.slots[slot].push(entry);
    }

    /// Moves up to `budget` entries with `deadline_ms <= now_ms` into `out` and returns how
    /// many it moved. Entries come out in slot order: by deadline across slots, unordered
    /// within one millisecond. Work beyond the budget is the cascading of occupied slots
    /// (amortized O(1) per entry); empty slots and levels are skipped by bitmap.
    ///
    /// `now_ms` earlier than a previous poll's is treated as that earlier time.
    ///
    /// # Panics
    /// If `now_ms >= DEADLINE_MS_MAX`.
    pub fn poll(&mut self, now_ms: u64, budget: usize, out: &mut Vec<T>) -> usize {
        assert!(now_ms < DEADLINE_MS_MAX, "now {now_ms} ms out of range");
        let mut fired = 0;
        loop {
            while fired < budget {
                let Some(entry) = self.ready.pop_front() else {
                    break;
                };
                self.len -= 1;
                out.push(entry.item);
                fired += 1;
            }
            if fired == budget {
                return fired;
            }
            match self.next_slot() {
                Some((level, slot, start_ms)) if start_ms <= now_ms => {
                    self.cascade(level, slot, start_ms)
                }
                _ => {
                    self.elapsed_ms = self.elapsed_ms.max(now_ms);
                    return fired;
                }
            }
        }
    }

    /// A lower bound on the next time a poll would return something: the wheel's time if
    /// entries are ready, else the start of the earliest occupied slot. `None` when empty.
    /// Useful for sleeping until there is work.
    pub fn next_due_ms(&self) -> Option<u64> {
        if !self.ready.is_empty() {
            return Some(self.elapsed_ms);
        }
        self.next_slot().map(|(_, _, start_ms)| start_ms)
    }

    /// Keeps only the entries for which `keep(deadline_ms, item)` is true, releasing most of
    /// the memory of the others. O(entries + slots). The wheel has no cancel; owners whose
    /// stale entries pile up (a lease released long before its deadline) compact with this.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, &T) -> bool) {
        self.ready
            .retain(|entry| keep(entry.deadline_ms, &entry.item));
        let mut len = self.ready.len();
        for ring in self.levels.iter_mut() {
            for (slot, entries) in ring.slots.iter_mut().enumerate() {
                entries.retain(|entry| keep(entry.deadline_ms, &entry.item));
                if entries.len() < entries.capacity() / 4 {
                    entries.shrink_to(entries.len() * 2);
                }
                if entries.is_empty() {
                    ring.occupied &= !(1 << slot);
                }
                len += entries.len();
            }
        }
        self.len = len;
    }

    /// Heap bytes reserved for entries (slot vectors and the ready queue, including unused
    /// capacity).
    pub fn memory_bytes(&self) -> usize {
        let slotted: usize = self
            .levels
            .iter()
            .flat_map(|ring| ring.slots.iter())
            .map(Vec::capacity)
            .sum();
        (slotted + self.ready.capacity()) * size_of::<Entry<T>>()
    }

    /// Every pending entry with its deadline, in no particular order (for invariant checks).
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> + '_ {
        let slotted = self.levels.iter().flat_map(|ring| {
            // Visit occupied slots only: tests call this after every step.
            let mut occupied = ring.occupied;
            std::iter::from_fn(move || {
                let slot = occupied.trailing_zeros() as usize;
                occupied &= occupied.wrapping_sub(1);
                (slot < SLOTS).then_some(slot)
            })
            .flat_map(|slot| ring.slots[slot].iter())
        });
        self.ready
            .iter()
            .chain(slotted)
            .map(|entry| (entry.deadline_ms, &entry.item))
    }

    /// The occupied slot with the earliest start, as `(level, slot, start_ms)`.
    fn next_slot(&self) -> Option<(usize, usize, u64)> {
        earliest_slot(
            self.elapsed_ms,
            self.levels.iter().map(|ring| ring.occupied),
        )
    }

    /// Empties one slot whose start has come, moving time to that start and re-placing its
    /// entries (lower levels, or ready if due; clamped ones may return to the last level).
    fn cascade(&mut self, level: usize, slot: usize, start_ms: u64) {
        assert!(start_ms > self.elapsed_ms, "cascade must move time forward");
        let ring = &mut self.levels[level];
        ring.occupied &= !(1 << slot);
        let mut entries = std::mem::take(&mut ring.slots[slot]);
        self.elapsed_ms = start_ms;
        for entry in entries.drain(..) {
            self.place(entry);
        }
        let ring = &mut self.levels[level];
        if ring.slots[slot].is_empty() && entries.capacity() <= SLOT_CAPACITY_RETAINED_MAX {
            ring.slots[slot] = entries;
        }
    }
}

/// The occupied slot with the earliest start, as `(level, slot, start_ms)`, given the wheel's
/// time and each level's occupancy bitmap (finest level first).
fn earliest_slot(
    elapsed_ms: u64,
    occupancy: impl Iterator<Item = u64>,
) -> Option<(usize, usize, u64)> {
    let mut best: Option<(usize, usize, u64)> = None;
    for (level, occupied) in occupancy.enumerate() {
        if occupied == 0 {
            continue;
        }
        let shift = level as u32 * SLOT_BITS;
        let span_ms = 1u64 << (shift + SLOT_BITS);
        let elapsed_slot = ((elapsed_ms >> shift) as usize) & (SLOTS - 1);
        // Search in ring order starting just after the current slot; the current slot
        // itself comes last, meaning "next rotation".
        let first = (elapsed_slot + 1) & (SLOTS - 1);
        let distance = occupied.rotate_right(first as u32).trailing_zeros() as usize;
        let slot = (first + distance) & (SLOTS - 1);
        let mut start_ms = (elapsed_ms & !(span_ms - 1)) + ((slot as u64) << shift);
        if slot <= elapsed_slot {
            // Only clamped far-future entries on the last level can be a rotation ahead.
            assert!(
                level == LEVELS - 1,
                "wheel level {level} slot {slot} is behind time"
            );
            start_ms += span_ms;
        }
        if best.is_none_or(|(_, _, best_ms)| start_ms < best_ms) {
            best = Some((level, slot, start_ms));
        }
    }
    best
}

/// The level for a deadline: the highest 6-bit group in which it differs from `elapsed_ms`.
fn level_for(elapsed_ms: u64, deadline_ms: u64) -> usize {
    let masked = ((elapsed_ms ^ deadline_ms) | (SLOTS as u64 - 1)).min(HORIZON_MS - 1);
    let significant_bit = 63 - masked.leading_zeros();
    (significant_bit / SLOT_BITS) as usize
}

/// The slot of a deadline on a level: its 6-bit group for that level.
fn slot_for(level: usize, deadline_ms: u64) -> usize {
    ((deadline_ms >> (level as u32 * SLOT_BITS)) as usize) & (SLOTS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use std::collections::BTreeMap;

    fn poll_all(wheel: &mut TimerWheel<u32>, now_ms: u64) -> Vec<u32> {
        let mut out = Vec::new();
        wheel.poll(now_ms, usize::MAX, &mut out);
        out
    }

    #[test]
    fn fires_at_deadline_not_before() {
        let mut wheel = TimerWheel::new();
        wheel.insert(5, 1);
        wheel.insert(64, 2);
        wheel.insert(4096 + 7, 3);
        assert_eq!(wheel.len(), 3);
        assert!(poll_all(&mut wheel, 4).is_empty());
        assert_eq!(poll_all(&mut wheel, 5), vec![1]);
        assert!(poll_all(&mut wheel, 63).is_empty());
        assert_eq!(poll_all(&mut wheel, 64), vec![2]);
        assert!(poll_all(&mut wheel, 4096 + 6).is_empty());
        assert_eq!(poll_all(&mut wheel, 4096 + 7), vec![3]);
        assert!(wheel.is_empty());
    }

    #[test]
    fn past_deadline_fires_on_next_poll() {
        let mut wheel = TimerWheel::new();
        poll_all(&mut wheel, 1000);
        wheel.insert(10, 7);
        assert_eq!(wheel.next_due_ms(), Some(1000));
        assert_eq!(poll_all(&mut wheel, 1000), vec![7]);
    }

    #[test]
    fn budget_limits_output_and_keeps_the_rest() {
        let mut wheel = TimerWheel::new();
        for i in 0..10 {
            wheel.insert(100 + i as u64, i);
        }
        let mut out = Vec::new();
        assert_eq!(wheel.poll(1000, 3, &mut out), 3);
        assert_eq!(wheel.poll(1000, 0, &mut out), 0);
        assert_eq!(wheel.poll(1000, 100, &mut out), 7);
        out.sort();
        assert_eq!(out, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn far_deadlines_are_clamped_and_recascade() {
        let mut wheel = TimerWheel::new();
        let far_ms = 3 * HORIZON_MS + 12_345;
        wheel.insert(far_ms, 1);
        wheel.insert(HORIZON_MS, 2);
        assert!(poll_all(&mut wheel, HORIZON_MS - 1).is_empty());
        assert_eq!(poll_all(&mut wheel, HORIZON_MS), vec![2]);
        assert!(poll_all(&mut wheel, far_ms - 1).is_empty());
        assert_eq!(poll_all(&mut wheel, far_ms), vec![1]);
    }

    #[test]
    fn retain_drops_entries_and_keeps_order_of_the_rest() {
        let mut wheel = TimerWheel::new();
        for i in 0..1000u32 {
            wheel.insert(u64::from(i) * 7, i);
        }
        wheel.retain(|_, &i| i % 3 == 0);
        assert_eq!(wheel.len(), 334);
        let fired = poll_all(&mut wheel, 7 * 1000);
        assert_eq!(fired.len(), 334);
        assert!(fired.iter().all(|i| i % 3 == 0));
        assert!(wheel.is_empty() && wheel.next_due_ms().is_none());
    }

    #[test]
    fn huge_jump_is_cheap() {
        let mut wheel = TimerWheel::new();
        for i in 0..1000u32 {
            wheel.insert(u64::from(i) * 3_600_000, i);
        }
        // Ten years in one poll: only occupied slots are visited.
        assert_eq!(poll_all(&mut wheel, 10 * 365 * 86_400_000).len(), 1000);
    }

    /// Random inserts, polls with small and huge steps and random budgets, against a sorted
    /// reference: each poll must return exactly the due entries (up to the budget) and only
    /// due entries; everything due is eventually returned.
    #[test]
    fn matches_reference_model() {
        for seed in 0..64u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut wheel = TimerWheel::new();
            let mut pending: BTreeMap<u32, u64> = BTreeMap::new();
            let mut now_ms = rng.random_range(0..1u64 << 40);
            let mut next_id = 0u32;
            for step in 0..3000 {
                match rng.random_range(0..10) {
                    0..=4 => {
                        let delta_ms = match rng.random_range(0..4) {
                            0 => rng.random_range(0..64),
                            1 => rng.random_range(0..100_000),
                            2 => rng.random_range(0..1u64 << 38),
                            _ => 0,
                        };
                        let deadline_ms = if rng.random_bool(0.1) {
                            now_ms.saturating_sub(delta_ms)
                        } else {
                            now_ms + delta_ms
                        };
                        wheel.insert(deadline_ms, next_id);
                        pending.insert(next_id, deadline_ms);
                        next_id += 1;
                    }
                    _ => {
                        now_ms += match rng.random_range(0..5) {
                            0 => 0,
                            1 => rng.random_range(0..10),
                            2 => rng.random_range(0..5000),
                            3 => rng.random_range(0..1u64 << 30),
                            _ => rng.random_range(0..1u64 << 37),
                        };
                        let budget = if rng.random_bool(0.5) { usize::MAX } else { 3 };
                        let mut out = Vec::new();
                        wheel.poll(now_ms, budget, &mut out);
                        let due = pending.values().filter(|&&d| d <= now_ms).count();
                        assert_eq!(out.len(), due.min(budget), "seed {seed} step {step}");
                        for id in out {
                            let deadline_ms = pending.remove(&id).expect("fired twice");
                            assert!(deadline_ms <= now_ms, "seed {seed} step {step}: early");
                        }
                    }
                }
                assert_eq!(wheel.len(), pending.len(), "seed {seed} step {step}");
            }
            let mut ids: Vec<u32> = wheel.iter().map(|(_, id)| *id).collect();
            ids.sort();
            assert_eq!(
                ids,
                pending.keys().copied().collect::<Vec<_>>(),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn entry_size() {
        // Wheel memory per lease timer in the lock table (8-byte payload).
        assert_eq!(size_of::<Entry<(u32, u32)>>(), 16);
    }
}
