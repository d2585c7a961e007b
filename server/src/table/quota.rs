//! Server-wide counts of held locks and waiters, shared by every shard.
//!
//! A limit split evenly over shards is not the limit the operator set: keys do not spread
//! evenly, so one shard refuses while others are empty, and the per-shard caps add up to more
//! than the total. Each shard instead takes a place from one shared counter before it inserts
//! a lock or a waiter, and gives it back when that lock or waiter goes, always while holding
//! its own mutex: so the counter is the exact sum of the shards' counts whenever no shard is
//! between a change and its count.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::TableLimits;

/// One counted resource with a maximum.
#[derive(Debug)]
pub struct Quota {
    /// Places taken.
    count: AtomicUsize,
    /// Most places that may be taken by [`Quota::try_take`].
    max: usize,
}

impl Quota {
    fn new(max: usize) -> Self {
        Quota {
            count: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes one place if fewer than `max` are taken. A compare-and-swap loop rather than
    /// add-then-undo: an add that overshoots, however briefly, could refuse a concurrent
    /// request while a place is free.
    pub fn try_take(&self) -> bool {
        let mut count = self.count.load(Ordering::Relaxed);
        loop {
            if count >= self.max {
                return false;
            }
            // Relaxed suffices: the count guards no other memory; each shard's mutex orders
            // its own changes.
            match self.count.compare_exchange_weak(
                count,
                count + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => count = now,
            }
        }
    }

    /// Takes one place even over `max` (locks recovered from the WAL must not be dropped).
    pub fn take_anyway(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Gives back `n` places.
    ///
    /// # Panics
    /// If fewer than `n` are taken: a place was given back twice.
    pub fn give_back(&self, n: usize) {
        let before = self.count.fetch_sub(n, Ordering::Relaxed);
        assert!(before >= n, "gave back {n} places of {before}");
    }

    /// Places taken now.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// The maximum.
    pub fn max(&self) -> usize {
        self.max
    }
}

/// The quotas of one server (or of one table used alone, as in tests).
#[derive(Debug)]
pub struct Quotas {
    /// Keys with a slot in any shard: held, expired but not yet reaped, or reserved.
    pub held: Quota,
    /// Waiters queued in any shard.
    pub waiters: Quota,
    /// Most waiters on one key; a key lives in one shard, so this needs no shared count.
    pub waiters_per_key_max: usize,
}

impl Quotas {
    /// Empty quotas with the maxima of `limits`.
    pub fn new(limits: TableLimits) -> Self {
        Quotas {
            held: Quota::new(limits.held_max),
            waiters: Quota::new(limits.waiters_max),
            waiters_per_key_max: limits.waiters_per_key_max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_up_to_max_then_give_back() {
        let quota = Quota::new(2);
        assert!(quota.try_take() && quota.try_take());
        assert!(!quota.try_take(), "third place over a max of 2");
        quota.give_back(1);
        assert!(quota.try_take());
        quota.take_anyway();
        assert_eq!(quota.count(), 3);
        quota.give_back(3);
        assert_eq!(quota.count(), 0);
    }

    #[test]
    fn racing_takers_get_exactly_max() {
        let quota = std::sync::Arc::new(Quota::new(1000));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let quota = std::sync::Arc::clone(&quota);
                std::thread::spawn(move || (0..600).filter(|_| quota.try_take()).count())
            })
            .collect();
        let taken: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(taken, 1000);
        assert_eq!(quota.count(), 1000);
    }
}
