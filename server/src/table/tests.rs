//! Unit tests of the lock table; the seeded simulation in `super::sim` covers combinations.

use std::cell::Cell;
use std::rc::Rc;

use super::*;

/// A waiter whose liveness the test controls.
#[derive(Clone, Debug)]
struct TestWaiter(Rc<Cell<bool>>);

impl WaiterSink for TestWaiter {
    fn is_live(&self) -> bool {
        self.0.get()
    }
}

fn waiter() -> TestWaiter {
    TestWaiter(Rc::new(Cell::new(true)))
}

const LIMITS: TableLimits = TableLimits {
    held_max: 100,
    waiters_max: 100,
    waiters_per_key_max: 10,
};

fn table() -> LockTable<TestWaiter> {
    LockTable::with_hash_seed(LIMITS, 42)
}

fn lease(n: u128) -> LeaseId {
    LeaseId::from_u128(n)
}

fn args<'a>(key: &'a [u8], id: u128, ttl_ms: u32, wait_ms: u32) -> AcquireArgs<'a, TestWaiter> {
    let waiter = (wait_ms > 0).then(waiter);
    AcquireArgs {
        key,
        lease_id: lease(id),
        ttl_ms,
        wait_ms,
        waiter,
        meta: b"",
    }
}

fn granted(outcome: Acquire<TestWaiter>) -> Grant {
    match outcome {
        Acquire::Granted(grant) => grant,
        other => panic!("expected Granted, got {other:?}"),
    }
}

fn queued(outcome: Acquire<TestWaiter>) -> u64 {
    match outcome {
        Acquire::Queued { waiter_id } => waiter_id,
        other => panic!("expected Queued, got {other:?}"),
    }
}

/// A `durable_lsn` for `renew` that must not be asked: the lease has no pending record.
fn unasked() -> u64 {
    panic!("renew asked how far the journal is durable for a lease with nothing pending")
}

#[test]
fn grant_lock_renew_release() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    let grant = granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    assert_eq!(
        grant,
        Grant {
            token: 1,
            lease_id: lease(1),
            ttl_ms: 100
        }
    );
    let locked = t.acquire(30, args(b"k", 2, 100, 0), &tokens, &mut ev);
    assert!(matches!(
        locked,
        Acquire::Locked {
            token: 1,
            ttl_left_ms: 70
        }
    ));
    assert_eq!(t.check(30, b"k", 1), Check::Current);
    assert_eq!(t.renew(50, b"k", lease(2), 100, unasked), Renew::Lost);
    assert_eq!(
        t.renew(50, b"k", lease(1), 100, unasked),
        Renew::Renewed {
            ttl_ms: 100,
            wait_lsn: 0
        }
    );
    assert!(matches!(
        t.inspect(60, b"k"),
        Inspect::Held {
            token: 1,
            ttl_left_ms: 90,
            ..
        }
    ));
    assert!(matches!(
        t.release(60, b"k", lease(2), &tokens, &mut ev),
        Release::NotOwner
    ));
    let released = t.release(60, b"k", lease(1), &tokens, &mut ev);
    assert!(matches!(
        released,
        Release::Released {
            token: 1,
            handoff: None
        }
    ));
    assert_eq!((t.slots_in_use(), ev.len()), (0, 0));
    assert_eq!(t.inspect(60, b"k"), Inspect::Free);
    t.check_invariants();
}

#[test]
fn a_renewal_longer_than_the_logged_ttl_is_logged_first_and_later_ones_wait_for_it() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    let renewed = |ttl_ms, wait_lsn| Renew::Renewed { ttl_ms, wait_lsn };
    // The grant's TTL or less: nothing to log, nothing to wait for.
    assert_eq!(t.renew(10, b"k", lease(1), 100, unasked), renewed(100, 0));
    assert_eq!(t.renew(10, b"k", lease(1), 50, unasked), renewed(50, 0));
    // Longer: nothing changes until the caller has logged it.
    assert_eq!(
        t.renew(20, b"k", lease(1), 300, unasked),
        Renew::Unlogged { token: 1 }
    );
    assert!(matches!(
        t.inspect(20, b"k"),
        Inspect::Held {
            ttl_left_ms: 40,
            ..
        }
    ));
    t.renew_logged(20, b"k", 1, 300, 7);
    assert!(matches!(
        t.inspect(20, b"k"),
        Inspect::Held {
            ttl_left_ms: 300,
            ..
        }
    ));
    t.check_invariants();
    // While record 7 may be on its way to disk, a renewal it covers waits for it ...
    assert_eq!(t.renew(30, b"k", lease(1), 300, || 6), renewed(300, 7));
    // ... and once it is durable, neither waits nor asks again.
    assert_eq!(t.renew(40, b"k", lease(1), 200, || 7), renewed(200, 0));
    assert_eq!(t.renew(50, b"k", lease(1), 300, unasked), renewed(300, 0));
    assert_eq!(
        t.renew(60, b"k", lease(1), 301, unasked),
        Renew::Unlogged { token: 1 }
    );
    // A snapshot records the logged TTL, not the latest renewal's.
    let mut seen = Vec::new();
    t.for_each_held(60, |held| seen.push(held.ttl_ms));
    assert_eq!(seen, [300]);
    // A journal that logs no leases hands back position 0: nothing is pending then.
    t.renew_logged(60, b"k", 1, 400, 0);
    assert_eq!(t.renew(70, b"k", lease(1), 400, unasked), renewed(400, 0));
    t.check_invariants();
}

#[test]
fn expiry_is_judged_at_the_request_without_advance() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    assert_eq!(t.check(99, b"k", 1), Check::Current);
    assert_eq!(t.check(100, b"k", 1), Check::Stale);
    assert_eq!(t.renew(100, b"k", lease(1), 100, unasked), Renew::Lost);
    let grant = granted(t.acquire(100, args(b"k", 2, 100, 0), &tokens, &mut ev));
    assert_eq!(grant.token, 2);
    assert!(matches!(
        &ev[..],
        [Event::Expired {
            token: 1,
            handoff: None,
            ..
        }]
    ));
    t.check_invariants();
}

#[test]
fn release_hands_off_fifo_skipping_dead_waiters() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    let dead = AcquireArgs {
        waiter: Some(waiter()),
        ..args(b"k", 2, 100, 50)
    };
    let dead_flag = dead.waiter.clone().unwrap().0;
    queued(t.acquire(1, dead, &tokens, &mut ev));
    let second = queued(t.acquire(2, args(b"k", 3, 200, 50), &tokens, &mut ev));
    queued(t.acquire(3, args(b"k", 4, 100, 50), &tokens, &mut ev));
    dead_flag.set(false);
    t.check_invariants();
    let Release::Released {
        token: 1,
        handoff: Some(handoff),
    } = t.release(10, b"k", lease(1), &tokens, &mut ev)
    else {
        panic!("expected a handoff");
    };
    assert_eq!(handoff.waiter_id, second);
    assert_eq!(
        handoff.grant,
        Grant {
            token: 2,
            lease_id: lease(3),
            ttl_ms: 200
        }
    );
    assert_eq!(&*handoff.key, b"k");
    assert_eq!(t.waiters_count(), 1);
    assert_eq!(t.check(10, b"k", 2), Check::Current);
    t.check_invariants();
}

#[test]
fn advance_expires_hands_off_and_times_out() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    let short = queued(t.acquire(0, args(b"k", 2, 100, 50), &tokens, &mut ev));
    let long = queued(t.acquire(0, args(b"k", 3, 100, 500), &tokens, &mut ev));
    assert!(!t.advance(49, 10, &tokens, &mut ev));
    assert!(ev.is_empty());
    t.advance(50, 10, &tokens, &mut ev);
    let timed_out = std::mem::take(&mut ev);
    let [Event::WaitTimedOut {
        waiter_id,
        holder_token: 1,
        ttl_left_ms: 50,
        ..
    }] = &timed_out[..]
    else {
        panic!("expected one timeout, got {timed_out:?}");
    };
    assert_eq!(*waiter_id, short);
    t.advance(100, 10, &tokens, &mut ev);
    let Some(Event::Expired {
        token: 1,
        handoff: Some(handoff),
        ..
    }) = ev.pop()
    else {
        panic!("expected an expiry with handoff");
    };
    assert_eq!((handoff.waiter_id, handoff.grant.token), (long, 2));
    assert_eq!(
        t.inspect(150, b"k"),
        Inspect::Held {
            token: 2,
            ttl_left_ms: 50,
            waiters: 0,
            meta: b""
        }
    );
    t.check_invariants();
}

#[test]
fn renewal_moves_the_timer_lazily_and_shortening_rearms_it() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    assert_eq!(
        t.renew(90, b"k", lease(1), 1000, unasked),
        Renew::Unlogged { token: 1 }
    );
    t.renew_logged(90, b"k", 1, 1000, 0);
    t.advance(100, 10, &tokens, &mut ev);
    assert!(ev.is_empty());
    t.check_invariants();
    assert_eq!(
        t.renew(200, b"k", lease(1), 10, unasked),
        Renew::Renewed {
            ttl_ms: 10,
            wait_lsn: 0
        }
    );
    t.check_invariants();
    t.advance(210, 10, &tokens, &mut ev);
    assert!(matches!(
        &ev[..],
        [Event::Expired {
            token: 1,
            handoff: None,
            ..
        }]
    ));
    assert_eq!(t.slots_in_use(), 0);
    // The lease's first filing (at 1090) went when it was re-filed earlier: nothing is left.
    assert!(t.lease_timers.is_empty() && t.wait_timers.is_empty());
    t.advance(1090, 10, &tokens, &mut ev);
    assert_eq!(ev.len(), 1);
    t.check_invariants();
}

#[test]
fn tokens_exhausted_changes_nothing_then_handoff_is_deferred() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 2), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    let refused = t.acquire(0, args(b"j", 2, 100, 10), &tokens, &mut ev);
    assert!(matches!(
        refused,
        Acquire::TokensExhausted { waiter: Some(_) }
    ));
    assert_eq!(t.slots_in_use(), 1);
    let waiter_id = queued(t.acquire(0, args(b"k", 3, 100, 500), &tokens, &mut ev));
    t.advance(100, 10, &tokens, &mut ev);
    assert!(matches!(
        &ev[..],
        [Event::Expired {
            token: 1,
            handoff: None,
            ..
        }]
    ));
    ev.clear();
    t.check_invariants();
    // Reserved for the waiter: newcomers cannot jump the queue.
    assert_eq!(t.inspect(100, b"k"), Inspect::Free);
    let newcomer = t.acquire(101, args(b"k", 4, 100, 0), &tokens, &mut ev);
    assert!(matches!(
        newcomer,
        Acquire::TokensExhausted { waiter: None }
    ));
    assert!(!t.advance(102, 10, &tokens, &mut ev));
    tokens.extend_limit(10);
    assert!(t.advance(103, 0, &tokens, &mut ev));
    t.advance(103, 10, &tokens, &mut ev);
    let Some(Event::HandedOff(handoff)) = ev.pop() else {
        panic!("expected HandedOff")
    };
    assert_eq!((handoff.waiter_id, handoff.grant.token), (waiter_id, 2));
    assert!(ev.is_empty());
    t.check_invariants();
}

#[test]
fn reserved_key_is_freed_when_its_waiters_leave() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 2), Vec::new());
    granted(t.acquire(0, args(b"k", 1, 100, 0), &tokens, &mut ev));
    let waiter_id = queued(t.acquire(0, args(b"k", 2, 100, 500), &tokens, &mut ev));
    let released = t.release(5, b"k", lease(1), &tokens, &mut ev);
    assert!(matches!(
        released,
        Release::Released {
            token: 1,
            handoff: None
        }
    ));
    t.check_invariants();
    assert!(t.cancel_waiter(b"k", waiter_id));
    assert!(!t.cancel_waiter(b"k", waiter_id));
    assert_eq!((t.slots_in_use(), t.waiters_count()), (0, 0));
    t.check_invariants();
    tokens.extend_limit(3);
    t.advance(10, 10, &tokens, &mut ev);
    assert!(ev.is_empty());
    t.check_invariants();
}

#[test]
fn limits_refuse_without_changing_state() {
    let limits = TableLimits {
        held_max: 1,
        waiters_max: 2,
        waiters_per_key_max: 1,
    };
    let (mut t, tokens, mut ev) = (
        LockTable::new(limits),
        TokenAllocator::new(1, 100),
        Vec::new(),
    );
    granted(t.acquire(0, args(b"a", 1, 100, 0), &tokens, &mut ev));
    assert!(matches!(
        t.acquire(0, args(b"b", 2, 100, 0), &tokens, &mut ev),
        Acquire::Full(Limit::HeldLocks)
    ));
    queued(t.acquire(0, args(b"a", 3, 100, 10), &tokens, &mut ev));
    let per_key = t.acquire(0, args(b"a", 4, 100, 10), &tokens, &mut ev);
    assert!(matches!(per_key, Acquire::Full(Limit::WaitersPerKey)));
    assert_eq!(tokens.next_token(), 2);
    t.check_invariants();
}

#[test]
fn restore_and_snapshot() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(50, 100), Vec::new());
    let long_key = [7u8; 300];
    t.restore(1000, &long_key, lease(9), 41, 500, b"meta");
    t.restore(1000, b"short", lease(8), 40, 100, b"");
    let mut seen = Vec::new();
    t.for_each_held(1050, |held| {
        seen.push((
            held.key.to_vec(),
            held.token,
            held.ttl_left_ms,
            held.meta.to_vec(),
        ))
    });
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (long_key.to_vec(), 41, 450, b"meta".to_vec()),
            (b"short".to_vec(), 40, 50, vec![])
        ]
    );
    assert!(matches!(
        t.inspect(1050, &long_key),
        Inspect::Held { meta: b"meta", .. }
    ));
    assert!(matches!(
        t.acquire(1100, args(b"short", 1, 100, 0), &tokens, &mut ev),
        Acquire::Granted(Grant { token: 50, .. })
    ));
    t.check_invariants();
}

#[test]
fn time_never_runs_backwards_inside_the_table() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, 100), Vec::new());
    granted(t.acquire(100, args(b"k", 1, 100, 0), &tokens, &mut ev));
    // A request that read the clock earlier but got the mutex later sees the table's time.
    assert!(matches!(
        t.acquire(50, args(b"k", 2, 100, 0), &tokens, &mut ev),
        Acquire::Locked {
            ttl_left_ms: 100,
            ..
        }
    ));
}

#[test]
fn memory_per_held_lock() {
    let limits = TableLimits {
        held_max: 1 << 20,
        ..LIMITS
    };
    let mut t = LockTable::with_hash_seed(limits, 42);
    let (tokens, mut ev) = (TokenAllocator::new(1, u64::MAX - 1), Vec::new());
    let count = 100_000;
    for i in 0..count {
        let key = format!("lock/{i:011}"); // 16 bytes
        granted(t.acquire(0, args(key.as_bytes(), i, 30_000, 0), &tokens, &mut ev));
    }
    let bytes = t.memory_bytes();
    println!(
        "size_of Slot {} B, Extra {} B, Queued {} B; {} locks: {} B each",
        size_of::<Slot<TestWaiter>>(),
        size_of::<Extra<TestWaiter>>(),
        size_of::<Queued<TestWaiter>>(),
        count,
        bytes / count as usize,
    );
    assert_eq!(size_of::<Slot<TestWaiter>>(), 72);
    // 72 for the slot and its inline key, 9 to 12 of index, chunks' tails.
    assert!(
        bytes / (count as usize) < 90,
        "{} bytes per lock",
        bytes / count as usize
    );
}

#[test]
fn shard_of_spreads_keys() {
    let mut counts = [0u32; 8];
    for i in 0..8000 {
        counts[shard_of(format!("key-{i}").as_bytes(), 8)] += 1;
    }
    assert!(
        counts.iter().all(|&count| (800..1200).contains(&count)),
        "{counts:?}"
    );
}

#[test]
fn released_leases_leave_no_timers() {
    let (mut t, tokens, mut ev) = (table(), TokenAllocator::new(1, u64::MAX - 1), Vec::new());
    granted(t.acquire(0, args(b"kept", 0, TTL_MS_MAX, 0), &tokens, &mut ev));
    for i in 1..10_000 {
        // Each released lease leaves a timer a day ahead: without compaction they would pile up.
        granted(t.acquire(
            i,
            args(b"k", u128::from(i), TTL_MS_MAX, 0),
            &tokens,
            &mut ev,
        ));
        let released = t.release(i, b"k", lease(u128::from(i)), &tokens, &mut ev);
        assert!(matches!(released, Release::Released { handoff: None, .. }));
        // No timer outlives its lease.
        assert_eq!(t.lease_timers.len(), 1);
    }
    t.check_invariants();
    assert_eq!(t.check(10_000, b"kept", 1), Check::Current);
}

/// A table with room for `waiters` waiters on one key, `b"hot"`, held at time 0, and the ids
/// of those waiters in queue order.
fn hot_key(waiters: u64) -> (LockTable<TestWaiter>, TokenAllocator, Vec<u64>) {
    let limits = TableLimits {
        held_max: 10,
        waiters_max: waiters as usize,
        waiters_per_key_max: waiters as usize,
    };
    let mut t = LockTable::with_hash_seed(limits, 42);
    let (tokens, mut ev) = (TokenAllocator::new(1, u64::MAX - 1), Vec::new());
    granted(t.acquire(0, args(b"hot", 0, TTL_MS_MAX, 0), &tokens, &mut ev));
    let ids = (1..=waiters)
        .map(|i| {
            queued(t.acquire(
                0,
                args(b"hot", u128::from(i), 100, 60_000),
                &tokens,
                &mut ev,
            ))
        })
        .collect();
    (t, tokens, ids)
}

/// Cancelling n waiters of one queue, from the back or every other one (as a connection that
/// queued half of them leaves), takes O(n log n) queue steps, not O(n^2).
#[test]
fn cancelling_many_waiters_is_not_quadratic() {
    const WAITERS: u64 = 20_000;
    // Binary search and amortized compaction: a few dozen steps per cancel at this size.
    let steps_max = WAITERS * 64;
    let (mut t, _, ids) = hot_key(WAITERS);
    for &id in ids.iter().rev() {
        assert!(t.cancel_waiter(b"hot", id));
    }
    assert!(t.cancel_steps <= steps_max, "{} steps", t.cancel_steps);
    assert_eq!(t.waiters_count(), 0);
    t.check_invariants();

    let (mut t, _, ids) = hot_key(WAITERS);
    for &id in ids.iter().skip(1).step_by(2) {
        assert!(t.cancel_waiter(b"hot", id));
    }
    assert!(t.cancel_steps <= steps_max, "{} steps", t.cancel_steps);
    assert_eq!(t.waiters_count(), WAITERS as usize / 2);
    t.check_invariants();
}

/// Cancelled waiters are skipped at hand-off, FIFO order holds for the rest, and a waiter
/// cancels once.
#[test]
fn cancelled_waiters_keep_fifo_for_the_rest() {
    let (mut t, tokens, ids) = hot_key(100);
    let mut ev = Vec::new();
    // Cancel all but every tenth, in a scattered order, including the head.
    for &id in ids.iter().rev().filter(|&&id| id % 10 != 3) {
        assert!(t.cancel_waiter(b"hot", id));
        assert!(!t.cancel_waiter(b"hot", id), "cancelled twice");
    }
    t.check_invariants();
    assert!(matches!(
        t.inspect(0, b"hot"),
        Inspect::Held { waiters: 10, .. }
    ));
    let mut holder = lease(0);
    for expected in ids.iter().filter(|&&id| id % 10 == 3) {
        let released = t.release(1, b"hot", holder, &tokens, &mut ev);
        let Release::Released {
            handoff: Some(handoff),
            ..
        } = released
        else {
            panic!("no hand-off: {released:?}");
        };
        assert_eq!(handoff.waiter_id, *expected);
        holder = handoff.grant.lease_id;
        t.check_invariants();
    }
    assert!(matches!(
        t.inspect(1, b"hot"),
        Inspect::Held { waiters: 0, .. }
    ));
}
