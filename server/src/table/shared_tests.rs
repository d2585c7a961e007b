//! Read/write locks and semaphores in the table: unit tests of the rules in `shared`'s
//! docs, and a seeded simulation against a naive model of holders and queues.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::rc::Rc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tenure_protocol::LeaseKind;

use super::*;

/// A waiter whose liveness the test controls.
#[derive(Clone, Debug)]
struct W(Rc<Cell<bool>>);

impl WaiterSink for W {
    fn is_live(&self) -> bool {
        self.0.get()
    }
}

const LIMITS: TableLimits = TableLimits {
    held_max: 1000,
    waiters_max: 1000,
    waiters_per_key_max: 50,
};

const SHARED: LeaseKind = LeaseKind::Shared;
const WRITE: LeaseKind = LeaseKind::Exclusive;

fn permits(count: u32, limit: u32) -> LeaseKind {
    LeaseKind::Permits { count, limit }
}

fn args(key: &[u8], id: u128, ttl_ms: u32, wait_ms: u32) -> AcquireArgs<'_, W> {
    AcquireArgs {
        key,
        lease_id: LeaseId::from_u128(id),
        ttl_ms,
        wait_ms,
        waiter: (wait_ms > 0).then(|| W(Rc::new(Cell::new(true)))),
        meta: b"",
    }
}

struct T {
    table: LockTable<W>,
    tokens: TokenAllocator,
    events: Vec<Event<W>>,
}

impl T {
    fn new() -> T {
        T {
            table: LockTable::with_hash_seed(LIMITS, 7),
            tokens: TokenAllocator::new(1, 1_000_000),
            events: Vec::new(),
        }
    }

    fn acquire(
        &mut self,
        now: u64,
        key: &[u8],
        id: u128,
        wait: u32,
        kind: LeaseKind,
    ) -> Acquire<W> {
        let a = args(key, id, 100, wait);
        let out = self
            .table
            .acquire_kind(now, a, kind, &self.tokens, &mut self.events);
        self.table.check_invariants();
        out
    }

    fn granted(&mut self, now: u64, key: &[u8], id: u128, kind: LeaseKind) -> u64 {
        match self.acquire(now, key, id, 0, kind) {
            Acquire::Granted(grant) => grant.token,
            other => panic!("expected a grant of {kind:?}, got {other:?}"),
        }
    }

    fn release(&mut self, now: u64, key: &[u8], id: u128) -> Release<W> {
        let out = self.table.release(
            now,
            key,
            LeaseId::from_u128(id),
            &self.tokens,
            &mut self.events,
        );
        self.table.check_invariants();
        out
    }

    /// Tokens handed to waiters by the events so far (taken).
    fn handed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.events)
            .into_iter()
            .filter_map(|e| match e {
                Event::HandedOff(h) => Some(h.grant.token),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn readers_share_and_a_writer_waits_for_all_of_them() {
    let mut t = T::new();
    let r1 = t.granted(0, b"k", 1, SHARED);
    let r2 = t.granted(0, b"k", 2, SHARED);
    assert!(r2 > r1);
    assert!(
        matches!(t.acquire(0, b"k", 3, 0, WRITE), Acquire::Locked { token, .. } if token == r2)
    );
    assert!(matches!(
        t.acquire(0, b"k", 3, 500, WRITE),
        Acquire::Queued { .. }
    ));
    // A writer in line stops new readers, with or without a wait.
    assert!(matches!(
        t.acquire(1, b"k", 4, 0, SHARED),
        Acquire::Locked { .. }
    ));
    assert!(matches!(
        t.acquire(1, b"k", 4, 500, SHARED),
        Acquire::Queued { .. }
    ));
    assert!(matches!(
        t.acquire(1, b"k", 5, 500, SHARED),
        Acquire::Queued { .. }
    ));
    assert_eq!(t.table.check(1, b"k", r1), Check::Current);
    assert!(matches!(
        t.release(2, b"k", 1),
        Release::Released { handoff: None, .. }
    ));
    let Release::Released {
        handoff: Some(w), ..
    } = t.release(2, b"k", 2)
    else {
        panic!("the last reader's release hands the key to the writer")
    };
    assert!(
        w.grant.token > r2,
        "a writer's token is above every reader's"
    );
    assert_eq!(w.kind, WRITE);
    assert_eq!(t.table.check(2, b"k", r1), Check::Stale);
    assert_eq!(t.table.check(2, b"k", w.grant.token), Check::Current);
    // The writer's release grants both readers queued behind it, at once.
    let Release::Released {
        handoff: Some(first),
        ..
    } = t.release(3, b"k", 3)
    else {
        panic!("the writer's release hands off")
    };
    let rest = t.handed();
    assert_eq!(rest.len(), 1, "both readers are granted by one release");
    assert!(first.grant.token > w.grant.token && rest[0] > first.grant.token);
    let kinds = t.table.inspect_kinds(3, b"k").unwrap();
    assert_eq!((kinds.holders, kinds.in_use, kinds.writer), (2, 2, false));
}

#[test]
fn a_plain_lock_becomes_a_read_write_key_when_a_reader_asks() {
    let mut t = T::new();
    let plain = match t
        .table
        .acquire(0, args(b"k", 1, 100, 0), &t.tokens, &mut t.events)
    {
        Acquire::Granted(g) => g.token,
        other => panic!("{other:?}"),
    };
    let Acquire::Queued { waiter_id } =
        t.table
            .acquire(0, args(b"k", 2, 100, 500), &t.tokens, &mut t.events)
    else {
        panic!("a plain waiter queues")
    };
    assert!(matches!(
        t.acquire(1, b"k", 3, 500, SHARED),
        Acquire::Queued { .. }
    ));
    assert!(t.table.is_shared(b"k"));
    assert_eq!(t.table.check(1, b"k", plain), Check::Current);
    // The moved plain waiter keeps its id and its place ahead of the reader.
    let Release::Released {
        handoff: Some(h), ..
    } = t.release(2, b"k", 1)
    else {
        panic!("the writer's release hands off")
    };
    assert_eq!((h.waiter_id, h.kind), (waiter_id, WRITE));
    assert!(
        t.handed().is_empty(),
        "the reader waits for the second writer"
    );
    assert!(
        matches!(t.release(3, b"k", 2), Release::Released { handoff: Some(r), .. } if r.kind == SHARED)
    );
    assert!(matches!(
        t.release(4, b"k", 3),
        Release::Released { handoff: None, .. }
    ));
    assert!(!t.table.has_slot(b"k"), "an idle entry is dropped");
}

#[test]
fn semaphore_counts_permits_fifo_and_fixes_its_limit() {
    let mut t = T::new();
    let a = t.granted(0, b"s", 1, permits(2, 3));
    assert!(matches!(
        t.acquire(0, b"s", 2, 500, permits(2, 3)),
        Acquire::Queued { .. }
    ));
    // One permit is free, but the head wants two: nobody overtakes it.
    assert!(
        matches!(t.acquire(0, b"s", 3, 0, permits(1, 3)), Acquire::Locked { token, .. } if token == a)
    );
    assert!(matches!(
        t.acquire(0, b"s", 3, 500, permits(1, 3)),
        Acquire::Queued { .. }
    ));
    assert!(matches!(
        t.acquire(0, b"s", 4, 0, permits(1, 4)),
        Acquire::KindMismatch { key_limit: Some(3) }
    ));
    assert!(matches!(
        t.acquire(0, b"s", 4, 0, SHARED),
        Acquire::KindMismatch { key_limit: Some(3) }
    ));
    assert!(matches!(
        t.acquire(0, b"s", 4, 0, WRITE),
        Acquire::KindMismatch { key_limit: Some(3) }
    ));
    let Release::Released {
        handoff: Some(h), ..
    } = t.release(1, b"s", 1)
    else {
        panic!("a release hands off")
    };
    assert_eq!(h.kind, permits(2, 3));
    assert_eq!(
        t.handed().len(),
        1,
        "the one-permit waiter fits beside the two"
    );
    let kinds = t.table.inspect_kinds(1, b"s").unwrap();
    assert_eq!((kinds.limit, kinds.holders, kinds.in_use), (3, 2, 3));
    // A PERMITS acquire of a plain lock is refused; the lock is untouched.
    t.table
        .acquire(1, args(b"p", 9, 100, 0), &t.tokens, &mut t.events);
    assert!(matches!(
        t.acquire(1, b"p", 10, 0, permits(1, 2)),
        Acquire::KindMismatch { key_limit: None }
    ));
    assert!(!t.table.is_shared(b"p"));
}

#[test]
fn expired_permits_return_at_once_and_hand_off() {
    let mut t = T::new();
    t.granted(0, b"s", 1, permits(1, 1));
    assert!(matches!(
        t.acquire(0, b"s", 2, 1000, permits(1, 1)),
        Acquire::Queued { .. }
    ));
    // At the deadline the permit is back: the next acquire settles the key first.
    assert!(matches!(
        t.acquire(100, b"s", 3, 0, permits(1, 1)),
        Acquire::Locked { .. }
    ));
    let expired = t
        .events
        .iter()
        .filter(|e| matches!(e, Event::Expired { .. }))
        .count();
    assert_eq!((expired, t.handed().len()), (1, 1));
    // And the ticker ends the next one without any request.
    let mut out = Vec::new();
    t.table.advance(200, 100, &t.tokens, &mut out);
    t.table.check_invariants();
    assert!(out.iter().any(|e| matches!(e, Event::Expired { .. })));
    assert!(!t.table.has_slot(b"s"));
}

#[test]
fn renew_snapshot_restore_and_tokens_exhausted() {
    let mut t = T::new();
    let r = t.granted(0, b"k", 1, SHARED);
    let id = LeaseId::from_u128(1);
    assert!(matches!(
        t.table.renew(50, b"k", id, 100, || 0),
        Renew::Renewed { .. }
    ));
    assert!(
        matches!(t.table.renew(50, b"k", id, 200, || 0), Renew::Unlogged { token } if token == r)
    );
    t.table.renew_logged(50, b"k", r, 200, 0);
    t.granted(60, b"s", 2, permits(2, 5));
    let mut held = Vec::new();
    t.table.for_each_held(70, |h| {
        held.push((h.key.to_vec(), h.token, h.ttl_ms, h.kind))
    });
    assert_eq!(held.len(), 2);
    let mut again: LockTable<W> = LockTable::with_hash_seed(LIMITS, 8);
    for (key, token, ttl, kind) in &held {
        again.restore_kind(
            0,
            key,
            LeaseId::from_u128(*token as u128),
            *token,
            *ttl,
            *kind,
            b"",
        );
    }
    again.check_invariants();
    assert_eq!(again.check(0, b"k", r), Check::Current);
    assert_eq!(again.inspect_kinds(0, b"s").unwrap().in_use, 2);
    // Out of tokens: a free fit is refused, a hand-off waits for the ticker.
    let empty = TokenAllocator::new(1_000, 1_000);
    let mut ev = Vec::new();
    let out = again.acquire_kind(1, args(b"k", 5, 100, 0), SHARED, &empty, &mut ev);
    assert!(matches!(out, Acquire::TokensExhausted { .. }));
    again.check_invariants();
}

/// Ops of the simulation: keys 0..`Shape::keys`, even keys read/write, odd keys semaphores.
#[derive(Debug)]
struct Model {
    /// Every lease's TTL (`Shape::ttl_ms`).
    ttl_ms: u64,
    /// Key to holders: (lease id, token, deadline, kind).
    holders: HashMap<u8, Vec<(u128, u64, u64, LeaseKind)>>,
    /// Key to waiters in order: (waiter id, lease id, wait deadline, kind, ttl).
    queues: HashMap<u8, VecDeque<(u64, u128, u64, LeaseKind)>>,
    /// Key to the last token granted on it.
    last_token: HashMap<u8, u64>,
    /// Waiters whose connection went without a cancel.
    dead: Vec<u64>,
}

fn fits(holders: &[(u128, u64, u64, LeaseKind)], now: u64, kind: LeaseKind) -> bool {
    let live: Vec<_> = holders.iter().filter(|h| h.2 > now).collect();
    match kind {
        LeaseKind::Exclusive => live.is_empty(),
        LeaseKind::Shared => live.iter().all(|h| h.3 == SHARED),
        LeaseKind::Permits { count, limit } => {
            live.iter()
                .map(|h| match h.3 {
                    LeaseKind::Permits { count, .. } => count,
                    _ => unreachable!(),
                })
                .sum::<u32>()
                + count
                <= limit
        }
    }
}

impl Model {
    /// Applies the table's events, checking each against the model.
    fn absorb(&mut self, key_of: &HashMap<Vec<u8>, u8>, now: u64, events: Vec<Event<W>>) {
        for event in events {
            match event {
                Event::Expired {
                    key,
                    token,
                    handoff,
                    ..
                } => {
                    let k = key_of[&key[..]];
                    let hs = self.holders.get_mut(&k).unwrap();
                    let at = hs
                        .iter()
                        .position(|h| h.1 == token)
                        .expect("expired a holder");
                    assert!(hs[at].2 <= now, "expired early");
                    hs.remove(at);
                    if let Some(h) = handoff {
                        self.handed(key_of, now, h);
                    }
                }
                Event::HandedOff(h) => self.handed(key_of, now, h),
                Event::WaitTimedOut { key, waiter_id, .. } => {
                    let q = self.queues.get_mut(&key_of[&key[..]]).unwrap();
                    let at = q.iter().position(|w| w.0 == waiter_id).unwrap();
                    assert!(q[at].2 <= now, "timed out early");
                    q.remove(at);
                }
            }
        }
    }

    fn handed(&mut self, key_of: &HashMap<Vec<u8>, u8>, now: u64, h: Handoff<W>) {
        let k = key_of[&h.key[..]];
        let q = self.queues.get_mut(&k).unwrap();
        let dead = &self.dead;
        // Waiters nobody listens to any more are skipped at the head.
        while q
            .front()
            .is_some_and(|w| w.0 != h.waiter_id && dead.contains(&w.0))
        {
            q.pop_front();
        }
        let head = q.pop_front().expect("a hand-off with nobody queued");
        assert_eq!(head.0, h.waiter_id, "strict FIFO: only the head is granted");
        assert_eq!(head.3, h.kind);
        let hs = self.holders.entry(k).or_default();
        assert!(
            fits(hs, now, h.kind),
            "a hand-off beside an incompatible holder"
        );
        self.grant(k, head.1, h.grant.token, now + self.ttl_ms, h.kind);
    }

    fn grant(&mut self, k: u8, id: u128, token: u64, deadline: u64, kind: LeaseKind) {
        let last = self.last_token.entry(k).or_default();
        assert!(token > *last, "tokens strictly increase per key");
        *last = token;
        self.holders
            .entry(k)
            .or_default()
            .push((id, token, deadline, kind));
    }

    fn alive(&self, waiter_id: u64) -> bool {
        self.dead.iter().all(|&d| d != waiter_id)
    }

    /// After a full settle: no holders beyond their rule, and no head that would fit (on
    /// keys without a waiter whose connection went silently).
    fn check(&self, now: u64, _live: &BTreeMap<u64, Rc<Cell<bool>>>) {
        for (k, hs) in &self.holders {
            let live: Vec<_> = hs.iter().filter(|h| h.2 > now).collect();
            let writers = live.iter().filter(|h| h.3 == WRITE).count();
            assert!(
                writers == 0 || live.len() == 1,
                "key {k}: a writer beside a holder"
            );
            let Some(q) = self.queues.get(k) else {
                continue;
            };
            if let Some(head) = q.front().filter(|_| q.iter().all(|w| self.alive(w.0))) {
                assert!(!fits(hs, now, head.3), "key {k}: the head fits but waits");
            }
        }
    }
}

/// How a simulation loads its keys.
struct Shape {
    /// Keys 0..keys.
    keys: u8,
    /// The semaphores' limit; a permit request asks for 1..=`count_max`.
    limit: u32,
    /// See `limit`.
    count_max: u32,
    /// Every lease's TTL.
    ttl_ms: u32,
    /// A waiting request waits 1..`wait_ms_max`.
    wait_ms_max: u32,
    /// The chance that a step is an acquire regardless of the usual mix.
    acquire_bias: f64,
    /// The table's limits.
    limits: TableLimits,
}

/// Few holders and waiters on each of four keys, short leases: every rule's edge often.
const SPREAD: Shape = Shape {
    keys: 4,
    limit: 3,
    count_max: 3,
    ttl_ms: 100,
    wait_ms_max: 300,
    acquire_bias: 0.0,
    limits: LIMITS,
};

/// Two keys crowded with holders and waiters (a semaphore of 64, a read/write key with
/// dozens of readers), long leases, many acquires, so that a release serves many waiters at
/// once and the counters behind `Entry::fits` see every kind of change.
const CROWD: Shape = Shape {
    keys: 2,
    limit: 64,
    count_max: 8,
    ttl_ms: 2000,
    wait_ms_max: 3000,
    acquire_bias: 0.5,
    limits: TableLimits {
        held_max: 10_000,
        waiters_max: 10_000,
        waiters_per_key_max: 2_000,
    },
};

#[test]
fn simulation_against_a_model() {
    let seeds: u64 = std::env::var("TENURE_SIM_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100);
    for seed in 0..seeds {
        eprintln!("shared simulation: seed {seed}");
        let result = std::panic::catch_unwind(|| simulate(seed, 1000, &SPREAD));
        assert!(result.is_ok(), "simulation failed with seed {seed}");
    }
}

/// Many holders and many waiters per key: hand-offs of many grants at once.
#[test]
fn simulation_of_crowded_keys_against_a_model() {
    let seeds: u64 = std::env::var("TENURE_SIM_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20);
    let mut crowd_max = (0, 0);
    for seed in 0..seeds {
        eprintln!("crowded shared simulation: seed {seed}");
        let result = std::panic::catch_unwind(|| simulate(seed, 2000, &CROWD));
        assert!(result.is_ok(), "simulation failed with seed {seed}");
        let (holders, waiters) = result.unwrap();
        crowd_max = (crowd_max.0.max(holders), crowd_max.1.max(waiters));
    }
    // The shape does what it is for: keys with dozens of holders and of waiters.
    assert!(crowd_max.0 >= 20 && crowd_max.1 >= 50, "{crowd_max:?}");
}

/// One seeded run; returns the most holders and waiters any key had after a step.
fn simulate(seed: u64, steps: usize, shape: &Shape) -> (usize, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = T::new();
    t.table = LockTable::with_hash_seed(shape.limits, 7);
    // Short keys keep a one-lease key in a slot (module `one_lease`), long ones (every
    // third) in an entry: both ways, and the moves between slot and entry, meet the model.
    let keys: Vec<Vec<u8>> = (0..shape.keys)
        .map(|k| match k % 3 {
            2 => format!("a-key-too-long-for-a-slot-{k}").into_bytes(),
            _ => format!("key{k}").into_bytes(),
        })
        .collect();
    let key_of: HashMap<Vec<u8>, u8> = keys.iter().cloned().zip(0..).collect();
    let ttl = u64::from(shape.ttl_ms);
    let mut crowd_max = (0, 0);
    let mut model = Model {
        ttl_ms: ttl,
        holders: HashMap::new(),
        queues: HashMap::new(),
        last_token: HashMap::new(),
        dead: Vec::new(),
    };
    let mut live: BTreeMap<u64, Rc<Cell<bool>>> = BTreeMap::new();
    let (mut now, mut next_id) = (0u64, 1u128);
    for _ in 0..steps {
        let k = rng.random_range(0..shape.keys);
        let key = &keys[k as usize];
        let biased = shape.acquire_bias > 0.0 && rng.random_bool(shape.acquire_bias);
        match if biased { 0 } else { rng.random_range(0..10) } {
            0..=4 => {
                let kind = if k % 2 == 1 {
                    permits(rng.random_range(1..=shape.count_max), shape.limit)
                } else if rng.random_bool(0.6) {
                    SHARED
                } else {
                    WRITE
                };
                let wait = if rng.random_bool(0.6) {
                    rng.random_range(1..shape.wait_ms_max)
                } else {
                    0
                };
                next_id += 1;
                let flag = Rc::new(Cell::new(true));
                let a = AcquireArgs {
                    key,
                    lease_id: LeaseId::from_u128(next_id),
                    ttl_ms: shape.ttl_ms,
                    wait_ms: wait,
                    waiter: (wait > 0).then(|| W(Rc::clone(&flag))),
                    meta: b"",
                };
                let hs = model.holders.entry(k).or_default().clone();
                let mut events = Vec::new();
                let out = t.table.acquire_kind(now, a, kind, &t.tokens, &mut events);
                model.absorb(&key_of, now, events);
                let queue_empty = model.queues.get(&k).is_none_or(|q| q.is_empty());
                match out {
                    Acquire::Granted(g) => {
                        // Only past waiters whose connection went, which the table dropped.
                        let q = model.queues.entry(k).or_default();
                        assert!(
                            q.iter().all(|w| model.dead.contains(&w.0)),
                            "granted past a queue"
                        );
                        q.clear();
                        assert!(fits(&model.holders[&k], now, kind), "granted beside {hs:?}");
                        model.grant(k, next_id, g.token, now + ttl, kind);
                    }
                    Acquire::Queued { waiter_id } => {
                        live.insert(waiter_id, flag);
                        model.queues.entry(k).or_default().push_back((
                            waiter_id,
                            next_id,
                            now + u64::from(wait),
                            kind,
                        ));
                    }
                    Acquire::Locked { .. } => {
                        assert!(
                            !queue_empty || !fits(&model.holders[&k], now, kind),
                            "refused a fit"
                        )
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            5 if rng.random_bool(0.5) => renew_one(&mut t, &mut model, &mut rng, now, k, key),
            5 | 6 => {
                let hs = model.holders.get(&k).cloned().unwrap_or_default();
                if let Some(h) = hs.get(rng.random_range(0..hs.len().max(1))) {
                    let mut events = Vec::new();
                    let out =
                        t.table
                            .release(now, key, LeaseId::from_u128(h.0), &t.tokens, &mut events);
                    match out {
                        Release::Released { token, handoff } => {
                            assert!(h.2 > now, "released an expired lease");
                            let m = model.holders.get_mut(&k).unwrap();
                            m.retain(|x| x.1 != token);
                            if let Some(handoff) = handoff {
                                events.insert(0, Event::HandedOff(handoff));
                            }
                        }
                        Release::NotOwner => assert!(h.2 <= now, "NotOwner of a live lease"),
                    }
                    // Expiries reported by the release's settling come before its hand-offs
                    // in time, but are independent of them here.
                    let (expired, rest): (Vec<_>, Vec<_>) = events
                        .into_iter()
                        .partition(|e| !matches!(e, Event::HandedOff(_)));
                    model.absorb(&key_of, now, expired);
                    model.absorb(&key_of, now, rest);
                }
            }
            7 => {
                // A waiter's connection goes, or it cancels.
                if let Some((&id, flag)) = live.iter().nth(rng.random_range(0..live.len().max(1))) {
                    if rng.random_bool(0.5) {
                        flag.set(false);
                        model.dead.push(id);
                    } else if t.table.cancel_waiter(key, id) {
                        model.queues.get_mut(&k).unwrap().retain(|w| w.0 != id);
                    }
                }
            }
            8 if rng.random_bool(0.1) => {
                // A restart: the held leases come back from a snapshot, each with its kind
                // and its TTL counted again from now; waiters are gone with their
                // connections.
                let mut held = Vec::new();
                t.table.for_each_held(now, |h| {
                    held.push((h.key.to_vec(), h.lease_id, h.token, h.ttl_ms, h.kind))
                });
                t.table = LockTable::with_hash_seed(shape.limits, seed);
                for (key, lease_id, token, ttl_ms, kind) in held {
                    t.table
                        .restore_kind(now, &key, lease_id, token, ttl_ms, kind, b"");
                }
                t.table.check_invariants();
                model.queues.clear();
                live.clear();
                for holders in model.holders.values_mut() {
                    holders.retain(|h| h.2 > now);
                    for holder in holders.iter_mut() {
                        holder.2 = now + ttl;
                    }
                }
            }
            _ => now += rng.random_range(1..80),
        }
        let mut events = Vec::new();
        while t.table.advance(now, 1000, &t.tokens, &mut events) {}
        model.absorb(&key_of, now, events);
        t.table.check_invariants();
        model.check(now, &live);
        check_key(&t, &model, now, k, key);
        for (k, holders) in &model.holders {
            let waiters = model.queues.get(k).map_or(0, VecDeque::len);
            let live = holders.iter().filter(|h| h.2 > now).count();
            crowd_max = (crowd_max.0.max(live), crowd_max.1.max(waiters));
        }
    }
    crowd_max
}

/// A key's only read lease or permits stay in a plain slot (module `one_lease`): answered
/// from it while alone, moved to an entry at a second holder or a waiter, and reported with
/// its kind by snapshot, INSPECT KINDS and the release's undo.
#[test]
fn one_lease_keys_keep_a_slot_until_a_second_holder_or_a_waiter() {
    let mut t = T::new();
    let r = t.granted(0, b"r", 1, SHARED);
    let s = t.granted(0, b"s", 2, permits(3, 4));
    assert_eq!(t.table.shared_keys_count(), 2);
    assert_eq!(t.table.shared_holders_count(), 2);
    assert!(t.table.is_shared(b"r") && t.table.is_shared(b"s"));
    let entry = |t: &T, key: &[u8]| t.table.shared.find(key).is_some();
    assert!(!entry(&t, b"r") && !entry(&t, b"s"), "slots, no entries");
    // Answered from the slot: the wrong kind, LOCKED without a wait.
    let mismatch = |out: Acquire<W>| match out {
        Acquire::KindMismatch { key_limit } => key_limit,
        other => panic!("expected a mismatch, got {other:?}"),
    };
    assert_eq!(mismatch(t.acquire(1, b"s", 3, 0, permits(1, 5))), Some(4));
    assert_eq!(mismatch(t.acquire(1, b"s", 3, 0, SHARED)), Some(4));
    assert_eq!(mismatch(t.acquire(1, b"r", 3, 0, permits(1, 4))), None);
    assert!(matches!(t.acquire(1, b"s", 3, 0, permits(2, 4)),
        Acquire::Locked { token, ttl_left_ms: 99 } if token == s));
    let plain = t
        .table
        .acquire(1, args(b"r", 3, 100, 0), &t.tokens, &mut t.events);
    assert!(matches!(plain, Acquire::Locked { token, .. } if token == r));
    assert_eq!(t.table.check(1, b"r", r), Check::Current);
    let kinds = t.table.inspect_kinds(1, b"s").expect("a semaphore key");
    assert_eq!((kinds.limit, kinds.holders, kinds.in_use), (4, 1, 3));
    let mut held = Vec::new();
    t.table.for_each_held(1, |h| held.push((h.token, h.kind)));
    held.sort_unstable_by_key(|h| h.0);
    assert_eq!(held, vec![(r, SHARED), (s, permits(3, 4))]);
    let (token, _, _, kind, _) = t
        .table
        .shared_lease(1, b"s", LeaseId::from_u128(2))
        .unwrap();
    assert_eq!((token, kind), (s, permits(3, 4)));
    // A second permit holder, and a writer waiting behind the reader: both move to entries.
    let s2 = t.granted(2, b"s", 4, permits(1, 4));
    assert!(matches!(
        t.acquire(2, b"r", 5, 500, WRITE),
        Acquire::Queued { .. }
    ));
    assert_eq!(t.table.shared_holders_count(), 3);
    assert!(entry(&t, b"r") && entry(&t, b"s"), "moved to entries");
    let Release::Released {
        handoff: Some(w), ..
    } = t.release(3, b"r", 1)
    else {
        panic!("the reader's release hands the key to the writer")
    };
    assert!(w.grant.token > s2 && w.kind == WRITE);
    // Renewal, release and expiry of a slot's lease, as a plain lock's.
    let r2 = t.granted(4, b"r2", 6, SHARED);
    let renewed = t.table.renew(50, b"r2", LeaseId::from_u128(6), 100, || 0);
    assert!(matches!(renewed, Renew::Renewed { .. }));
    assert!(
        matches!(t.release(60, b"r2", 6), Release::Released { token, handoff: None } if token == r2)
    );
    assert!(!t.table.has_slot(b"r2"));
    t.granted(60, b"r3", 7, SHARED);
    let mut events = Vec::new();
    while t.table.advance(200, 100, &t.tokens, &mut events) {}
    assert!(!t.table.has_slot(b"r3"), "expired and freed by the ticker");
    // Undo of a release (restore_kind) puts the lease back in a slot, with its kind.
    t.table
        .restore_kind(200, b"r4", LeaseId::from_u128(8), 999, 100, SHARED, b"m");
    assert_eq!(
        t.table.inspect_kinds(200, b"r4").map(|k| k.holders),
        Some(1)
    );
    t.table.check_invariants();
}

/// RENEW of a random holder of key `k`: renewed exactly while the model has it unexpired.
fn renew_one(t: &mut T, model: &mut Model, rng: &mut StdRng, now: u64, k: u8, key: &[u8]) {
    let hs = model.holders.get(&k).cloned().unwrap_or_default();
    let Some(h) = hs.get(rng.random_range(0..hs.len().max(1))) else {
        return;
    };
    let ttl_ms = u32::try_from(model.ttl_ms).expect("a TTL");
    match t
        .table
        .renew(now, key, LeaseId::from_u128(h.0), ttl_ms, || u64::MAX)
    {
        Renew::Renewed { .. } => {
            assert!(h.2 > now, "renewed an expired lease");
            let m = model.holders.get_mut(&k).expect("holders");
            let held = m.iter_mut().find(|x| x.1 == h.1).expect("the holder");
            held.2 = now + model.ttl_ms;
        }
        Renew::Lost => assert!(h.2 <= now, "a live lease lost on renewal"),
        other => panic!("unexpected {other:?}"),
    }
}

/// CHECK, INSPECT and the kinds of key `k` agree with the model's holders.
fn check_key(t: &T, model: &Model, now: u64, k: u8, key: &[u8]) {
    let hs = model.holders.get(&k).cloned().unwrap_or_default();
    let live: Vec<_> = hs.iter().filter(|h| h.2 > now).collect();
    for h in &hs {
        let current = t.table.check(now, key, h.1) == Check::Current;
        assert_eq!(current, h.2 > now, "CHECK of token {}", h.1);
    }
    match t.table.inspect_kinds(now, key) {
        Some(kinds) => {
            assert_eq!(kinds.holders as usize, live.len(), "INSPECT holders");
            let writer = live.iter().any(|h| h.3.is_exclusive());
            assert_eq!(kinds.writer, writer, "INSPECT writer");
        }
        None => assert!(live.iter().all(|h| h.3.is_exclusive()), "kinds lost"),
    }
    let held = matches!(t.table.inspect(now, key), Inspect::Held { .. });
    assert_eq!(held, !live.is_empty(), "INSPECT held");
}

/// The table's own bytes per held lease (its accounting, `memory_bytes`: holders, queues,
/// entries, timers, the key index), for permits and read leases, many to a key and one to a
/// key. `--nocapture` prints the figures.
#[test]
fn memory_per_held_permit() {
    let per = |keys: u32, per_key: u32, kind: LeaseKind| {
        let limits = TableLimits {
            held_max: 100_000,
            waiters_max: 10,
            waiters_per_key_max: 10,
        };
        let mut table: LockTable<W> = LockTable::with_hash_seed(limits, 1);
        let tokens = TokenAllocator::new(1, u64::MAX / 2);
        let before = table.memory_bytes();
        let mut events = Vec::new();
        let mut id = 0u128;
        for k in 0..keys {
            let key = format!("job:{k:019}");
            for _ in 0..per_key {
                id += 1;
                let a = AcquireArgs {
                    key: key.as_bytes(),
                    lease_id: LeaseId::from_u128(id),
                    ttl_ms: 30_000,
                    wait_ms: 0,
                    waiter: None,
                    meta: b"",
                };
                assert!(matches!(
                    table.acquire_kind(0, a, kind, &tokens, &mut events),
                    Acquire::Granted(_)
                ));
            }
        }
        table.check_invariants();
        (table.memory_bytes() - before) as f64 / f64::from(keys * per_key)
    };
    let many = per(4, 4096, permits(1, PERMITS_MAX_FOR_TEST));
    let many_read = per(4, 4096, SHARED);
    let few = per(2000, 4, permits(1, PERMITS_MAX_FOR_TEST));
    let one = per(20_000, 1, permits(1, 4));
    let one_read = per(20_000, 1, SHARED);
    eprintln!(
        "table bytes per lease: permits {many:.1} (4 keys x 4096), read {many_read:.1} \
         (4 keys x 4096), permits {few:.1} (2000 keys x 4), permits {one:.1} (20000 keys x 1), \
         read {one_read:.1} (20000 keys x 1)"
    );
    assert!(many < 100.0, "{many} bytes per permit");
    assert!(many_read < 100.0, "{many_read} bytes per read lease");
    // One lease a key: a plain slot (72 bytes) and its index bucket, as a plain lock.
    assert!(one < 100.0, "{one} bytes per permit, one a key");
    assert!(
        one_read < 100.0,
        "{one_read} bytes per read lease, one a key"
    );
}

const PERMITS_MAX_FOR_TEST: u32 = tenure_protocol::limits::PERMITS_MAX;
