//! An intrusive timer wheel: the levels and slots of [`super::TimerWheel`], but every timer is
//! a node its owner stores, with a [`Link`] (8 bytes) inside it, and the wheel keeps only a
//! list head per slot.
//!
//! The lock table has one timer per lease, often millions. In a wheel of entries each lease
//! would cost an entry (a deadline and a payload) plus the spare capacity of the slot vector it
//! sits in, and a lease released long before its deadline would leave a stale entry behind
//! until it fired. Here a lease's timer is two `u32` links in its slot: nothing is allocated
//! per timer, a timer is removed in O(1) when its lease ends, and there are never stale ones.
//!
//! A node's deadline is read from its owner ([`Nodes::deadline_ms`]) whenever the wheel
//! files it, so a deadline moved *later* needs no wheel operation: the node is filed at its
//! old deadline, and when that slot's time comes the wheel re-files it at the new one (a
//! renewal is then a field write). A deadline moved *earlier* must be re-inserted
//! ([`LinkedWheel::remove`] then [`LinkedWheel::insert`]), or the node would fire late.
//!
//! Each slot's list is doubly linked. The head's `prev` names its slot (with [`HEAD_BIT`]
//! set), so removing a head updates the slot without a search. Nodes are numbered below
//! `HEAD_BIT`.

use super::{earliest_slot, level_for, slot_for, DEADLINE_MS_MAX, LEVELS, SLOTS};

/// "No node": the end of a list, or an unlinked node's `prev`.
const NIL: u32 = u32::MAX;
/// Set in a list head's `prev`, whose other bits name the slot the node heads.
pub const HEAD_BIT: u32 = 1 << 31;
/// Slot lists on the levels, then the ready list.
const LISTS: usize = LEVELS * SLOTS + 1;
/// The list of nodes already due, in the order they came due.
const READY: usize = LEVELS * SLOTS;

/// A node's place in the wheel: its neighbours in one slot's list. Owners keep one per timer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The previous node, or `HEAD_BIT | list` for a list's first node, or `NIL` unlinked.
    prev: u32,
    /// The next node, or `NIL`.
    next: u32,
}

impl Link {
    /// A node in no list.
    pub const UNLINKED: Link = Link {
        prev: NIL,
        next: NIL,
    };

    /// Whether the node is in the wheel.
    pub fn is_linked(self) -> bool {
        self.prev != NIL
    }
}

/// The owner's storage of nodes: their deadlines and links.
pub trait Nodes {
    /// The node's deadline now; read whenever the wheel files the node.
    fn deadline_ms(&self, node: u32) -> u64;
    /// The node's link.
    fn link(&self, node: u32) -> Link;
    /// The node's link, to change.
    fn link_mut(&mut self, node: u32) -> &mut Link;
}

/// An intrusive hierarchical timer wheel with 1 ms ticks; see the module docs.
#[derive(Debug)]
pub struct LinkedWheel {
    /// First node of each slot's list (levels finest first), then of the ready list.
    heads: Box<[u32; LISTS]>,
    /// Last node of the ready list, which is appended to (due nodes fire in order).
    ready_tail: u32,
    /// Bit `slot` of `occupied[level]` is set iff that slot's list is not empty.
    occupied: [u64; LEVELS],
    /// Every node on a level has a deadline after this.
    elapsed_ms: u64,
    /// Nodes in the wheel.
    len: usize,
}

impl Default for LinkedWheel {
    fn default() -> Self {
        Self::new()
    }
}

impl LinkedWheel {
    /// An empty wheel whose time starts at 0.
    pub fn new() -> Self {
        LinkedWheel {
            heads: Box::new([NIL; LISTS]),
            ready_tail: NIL,
            occupied: [0; LEVELS],
            elapsed_ms: 0,
            len: 0,
        }
    }

    /// Nodes in the wheel (due ones not yet polled included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no node is in the wheel.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Files `node` at its deadline; one at or before the wheel's time fires on the next poll.
    ///
    /// # Panics
    /// If the node is linked already, is numbered `HEAD_BIT` or above, or its deadline is
    /// `DEADLINE_MS_MAX` or later.
    pub fn insert(&mut self, node: u32, nodes: &mut impl Nodes) {
        assert!(node < HEAD_BIT, "node {node} out of range");
        assert!(!nodes.link(node).is_linked(), "node {node} inserted twice");
        self.len += 1;
        self.place(node, nodes);
    }

    /// Takes `node` out of the wheel. O(1).
    ///
    /// # Panics
    /// If the node is not linked.
    pub fn remove(&mut self, node: u32, nodes: &mut impl Nodes) {
        let Link { prev, next } = nodes.link(node);
        assert!(prev != NIL, "node {node} is not in the wheel");
        if prev & HEAD_BIT != 0 {
            let list = (prev & !HEAD_BIT) as usize;
            self.heads[list] = next;
            if next == NIL && list != READY {
                self.occupied[list / SLOTS] &= !(1 << (list % SLOTS));
            }
        } else {
            nodes.link_mut(prev).next = next;
        }
        if next != NIL {
            nodes.link_mut(next).prev = prev;
        } else if self.ready_tail == node {
            self.ready_tail = if prev & HEAD_BIT != 0 { NIL } else { prev };
        }
        *nodes.link_mut(node) = Link::UNLINKED;
        self.len -= 1;
    }

    /// Takes up to `budget` nodes whose deadline is at or before `now_ms` out of the wheel
    /// into `out` and returns how many. Nodes come out in slot order: by deadline across
    /// slots, unordered within one millisecond. A node whose deadline moved later since it
    /// was filed is re-filed instead, when its old slot comes up. `now_ms` earlier than a
    /// previous poll's is treated as that earlier time.
    ///
    /// # Panics
    /// If `now_ms >= DEADLINE_MS_MAX`.
    pub fn poll(
        &mut self,
        now_ms: u64,
        budget: usize,
        nodes: &mut impl Nodes,
        out: &mut Vec<u32>,
    ) -> usize {
        assert!(now_ms < DEADLINE_MS_MAX, "now {now_ms} ms out of range");
        let mut fired = 0;
        loop {
            while fired < budget && self.heads[READY] != NIL {
                let node = self.heads[READY];
                self.remove(node, nodes);
                out.push(node);
                fired += 1;
            }
            if fired == budget {
                return fired;
            }
            match self.next_slot() {
                Some((level, slot, start_ms)) if start_ms <= now_ms => {
                    self.cascade(level, slot, start_ms, nodes)
                }
                _ => {
                    self.elapsed_ms = self.elapsed_ms.max(now_ms);
                    return fired;
                }
            }
        }
    }

    /// A lower bound on the next time a poll would return something (`None`: empty).
    pub fn next_due_ms(&self) -> Option<u64> {
        if self.heads[READY] != NIL {
            return Some(self.elapsed_ms);
        }
        self.next_slot().map(|(_, _, start_ms)| start_ms)
    }

    /// Every node in the wheel with the earliest deadline its slot allows (the wheel's time
    /// for ready nodes), checking every list's links on the way (for invariant checks).
    ///
    /// # Panics
    /// If a list's links are inconsistent or the count is off.
    pub fn nodes(&self, nodes: &impl Nodes) -> Vec<(u32, u64)> {
        let mut found = Vec::with_capacity(self.len);
        for (list, &head) in self.heads.iter().enumerate() {
            let floor_ms = self.slot_floor_ms(list);
            let mut prev = HEAD_BIT | list as u32;
            let mut node = head;
            while node != NIL {
                assert_eq!(nodes.link(node).prev, prev, "node {node}: broken back link");
                assert!(found.len() < self.len, "a list loops, or the count is off");
                found.push((node, floor_ms));
                prev = node;
                node = nodes.link(node).next;
            }
            if list == READY {
                assert_eq!(self.ready_tail, if head == NIL { NIL } else { prev });
            } else {
                let occupied = self.occupied[list / SLOTS] & (1 << (list % SLOTS)) != 0;
                assert_eq!(occupied, head != NIL, "list {list}: occupancy bit is off");
            }
        }
        assert_eq!(found.len(), self.len, "nodes in the lists vs the count");
        found
    }

    /// The earliest deadline a node in `list` may have: after the wheel's time on a level
    /// (the slot's start is later still), anything in the ready list.
    fn slot_floor_ms(&self, list: usize) -> u64 {
        if list == READY {
            0
        } else {
            self.elapsed_ms + 1
        }
    }

    /// Links `node` at the head of its slot's list, or at the end of the ready list if due.
    fn place(&mut self, node: u32, nodes: &mut impl Nodes) {
        let deadline_ms = nodes.deadline_ms(node);
        assert!(
            deadline_ms < DEADLINE_MS_MAX,
            "deadline {deadline_ms} ms out of range"
        );
        if deadline_ms <= self.elapsed_ms {
            let prev = match self.ready_tail {
                NIL => {
                    self.heads[READY] = node;
                    HEAD_BIT | READY as u32
                }
                tail => {
                    nodes.link_mut(tail).next = node;
                    tail
                }
            };
            *nodes.link_mut(node) = Link { prev, next: NIL };
            self.ready_tail = node;
            return;
        }
        let level = level_for(self.elapsed_ms, deadline_ms);
        let slot = slot_for(level, deadline_ms);
        let list = level * SLOTS + slot;
        let head = self.heads[list];
        if head != NIL {
            nodes.link_mut(head).prev = node;
        }
        *nodes.link_mut(node) = Link {
            prev: HEAD_BIT | list as u32,
            next: head,
        };
        self.heads[list] = node;
        self.occupied[level] |= 1 << slot;
    }

    /// The occupied slot with the earliest start, as `(level, slot, start_ms)`.
    fn next_slot(&self) -> Option<(usize, usize, u64)> {
        earliest_slot(self.elapsed_ms, self.occupied.iter().copied())
    }

    /// Empties one slot whose start has come, moving time to that start and re-filing its
    /// nodes at their deadlines now (lower levels, or ready if due).
    fn cascade(&mut self, level: usize, slot: usize, start_ms: u64, nodes: &mut impl Nodes) {
        assert!(start_ms > self.elapsed_ms, "cascade must move time forward");
        let list = level * SLOTS + slot;
        let mut node = std::mem::replace(&mut self.heads[list], NIL);
        self.occupied[level] &= !(1 << slot);
        self.elapsed_ms = start_ms;
        while node != NIL {
            let next = nodes.link(node).next;
            self.place(node, nodes);
            node = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::HORIZON_MS;
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Nodes as a plain vector of (deadline, link).
    #[derive(Default)]
    struct Plain(Vec<(u64, Link)>);

    impl Nodes for Plain {
        fn deadline_ms(&self, node: u32) -> u64 {
            self.0[node as usize].0
        }
        fn link(&self, node: u32) -> Link {
            self.0[node as usize].1
        }
        fn link_mut(&mut self, node: u32) -> &mut Link {
            &mut self.0[node as usize].1
        }
    }

    fn plain(deadlines: &[u64]) -> Plain {
        Plain(deadlines.iter().map(|&d| (d, Link::UNLINKED)).collect())
    }

    fn poll_all(wheel: &mut LinkedWheel, nodes: &mut Plain, now_ms: u64) -> Vec<u32> {
        let mut out = Vec::new();
        wheel.poll(now_ms, usize::MAX, nodes, &mut out);
        out
    }

    #[test]
    fn fires_at_deadline_not_before() {
        let mut nodes = plain(&[5, 64, 4096 + 7]);
        let mut wheel = LinkedWheel::new();
        for node in 0..3 {
            wheel.insert(node, &mut nodes);
        }
        assert!(poll_all(&mut wheel, &mut nodes, 4).is_empty());
        assert_eq!(poll_all(&mut wheel, &mut nodes, 5), vec![0]);
        assert!(poll_all(&mut wheel, &mut nodes, 63).is_empty());
        assert_eq!(poll_all(&mut wheel, &mut nodes, 64), vec![1]);
        assert!(poll_all(&mut wheel, &mut nodes, 4096 + 6).is_empty());
        assert_eq!(poll_all(&mut wheel, &mut nodes, 4096 + 7), vec![2]);
        assert!(wheel.is_empty() && wheel.next_due_ms().is_none());
        assert!(nodes.0.iter().all(|(_, link)| !link.is_linked()));
    }

    #[test]
    fn a_deadline_moved_later_is_refiled_not_fired() {
        let mut nodes = plain(&[100]);
        let mut wheel = LinkedWheel::new();
        wheel.insert(0, &mut nodes);
        nodes.0[0].0 = 5000;
        assert!(poll_all(&mut wheel, &mut nodes, 4999).is_empty());
        assert_eq!(wheel.len(), 1);
        assert_eq!(poll_all(&mut wheel, &mut nodes, 5000), vec![0]);
    }

    #[test]
    fn removed_nodes_never_fire_and_heads_and_tails_stay_right() {
        let mut nodes = plain(&[10, 10, 10, 10, 3]);
        let mut wheel = LinkedWheel::new();
        for node in 0..5 {
            wheel.insert(node, &mut nodes);
        }
        wheel.remove(3, &mut nodes); // the head of slot 10 (inserted last)
        wheel.remove(1, &mut nodes); // a middle node
        wheel.nodes(&nodes);
        let mut out = Vec::new();
        assert_eq!(wheel.poll(20, 1, &mut nodes, &mut out), 1);
        assert_eq!(out, vec![4]);
        // Slot 10's nodes are ready now; remove the ready list's tail, then its head.
        assert_eq!(wheel.poll(20, 0, &mut nodes, &mut out), 0);
        wheel.nodes(&nodes);
        nodes.0.push((30, Link::UNLINKED));
        wheel.insert(5, &mut nodes);
        wheel.nodes(&nodes);
        assert_eq!(poll_all(&mut wheel, &mut nodes, 30).len(), 3);
        assert!(wheel.is_empty());
    }

    #[test]
    fn far_deadlines_are_clamped_and_recascade() {
        let far_ms = 3 * HORIZON_MS + 12_345;
        let mut nodes = plain(&[far_ms, HORIZON_MS]);
        let mut wheel = LinkedWheel::new();
        wheel.insert(0, &mut nodes);
        wheel.insert(1, &mut nodes);
        assert!(poll_all(&mut wheel, &mut nodes, HORIZON_MS - 1).is_empty());
        assert_eq!(poll_all(&mut wheel, &mut nodes, HORIZON_MS), vec![1]);
        assert!(poll_all(&mut wheel, &mut nodes, far_ms - 1).is_empty());
        assert_eq!(poll_all(&mut wheel, &mut nodes, far_ms), vec![0]);
    }

    /// Random inserts, removals, deadlines moved later (lazily) or earlier (re-inserted) and
    /// polls with small budgets: after each poll to `now_ms` exactly the linked nodes whose
    /// deadline is at or before `now_ms` have come out, none early, none left behind.
    #[test]
    fn fires_exactly_the_due_nodes_under_random_changes() {
        let mut rng = StdRng::seed_from_u64(12);
        let mut nodes = plain(&[]);
        let mut wheel = LinkedWheel::new();
        let mut now_ms = 0;
        for step in 0..40_000 {
            let count = nodes.0.len() as u32;
            let node = if count == 0 {
                0
            } else {
                rng.random_range(0..count)
            };
            match rng.random_range(0..10) {
                0..=3 => {
                    nodes
                        .0
                        .push((now_ms + rng.random_range(0..5000), Link::UNLINKED));
                    wheel.insert(count, &mut nodes);
                }
                4 if node < count && nodes.link(node).is_linked() => {
                    wheel.remove(node, &mut nodes);
                    if rng.random_bool(0.5) {
                        // Earlier (or anywhere): re-inserted.
                        nodes.0[node as usize].0 = now_ms + rng.random_range(0..100);
                        wheel.insert(node, &mut nodes);
                    }
                }
                5 if node < count && nodes.link(node).is_linked() => {
                    nodes.0[node as usize].0 += rng.random_range(1..3000);
                }
                _ => {
                    now_ms += rng.random_range(0..300);
                    let mut due: Vec<u32> = (0..count)
                        .filter(|&n| nodes.link(n).is_linked() && nodes.deadline_ms(n) <= now_ms)
                        .collect();
                    let budget = rng.random_range(1..50);
                    let mut got = Vec::new();
                    while wheel.poll(now_ms, budget, &mut nodes, &mut got) == budget {}
                    got.sort_unstable();
                    due.sort_unstable();
                    assert_eq!(got, due, "step {step} at {now_ms} ms");
                    assert!(got.iter().all(|&n| !nodes.link(n).is_linked()));
                }
            }
            if step % 250 == 0 {
                for (node, floor_ms) in wheel.nodes(&nodes) {
                    assert!(
                        nodes.deadline_ms(node) >= floor_ms,
                        "node {node} filed late"
                    );
                }
            }
        }
    }
}
