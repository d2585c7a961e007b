//! Seeded deterministic simulation of the lock table against a naive reference model.
//!
//! Each seed drives a random sequence of operations over eight keys: acquires with and
//! without waiting, renews and releases with right and wrong lease ids, inspects, checks,
//! cancelled and dying waiters, small time steps and jumps of hours, `advance` with budgets
//! from 0 to unlimited, a token limit that runs out and is raised again, and other shards
//! taking and giving back places in the server-wide held and waiter quotas.
//!
//! The model (a `BTreeMap` of plain structs, everything by brute force) follows the same
//! rules as the table's documentation: expiry judged by deadline at each request, settling a
//! key on `acquire`, FIFO handoff to live waiters, deferred handoff without tokens. What the
//! model cannot know is *when* a budget-limited `advance` gets to a key, so for `advance` it
//! checks instead that each key the table settled was settled exactly as the model would at
//! that moment. Tokens are predicted exactly (one allocator, one thread).
//!
//! After every step: outcome and events equal the model's, `check_invariants` passes, counts
//! and every key's visible state agree, and, from the clients' point of view (grants seen so
//! far), tokens grow per key and no key has two unexpired holders.
//!
//! `TENURE_SIM_SEEDS=n` runs n seeds (default 128, about 3 s in a debug build);
//! `TENURE_SIM_SEED=s` runs only seed s. A failure names the seed and the step.

use std::cell::Cell;
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::Arc;

use rand::{rngs::StdRng, Rng, SeedableRng};
use tenure_protocol::LeaseId;

use crate::table::TokenAllocator;
use crate::table::{
    Acquire, AcquireArgs, Check, Event, Grant, Handoff, Inspect, Limit, LockTable, Quotas, Release,
    Renew, TableLimits, WaiterSink,
};

/// Seeds run by default.
const SEEDS_DEFAULT: u64 = 128;
/// Steps per seed.
const STEPS_PER_SEED: u32 = 2_000;
/// Limits small enough that the simulation hits every one of them.
const LIMITS: TableLimits = TableLimits {
    held_max: 6,
    waiters_max: 10,
    waiters_per_key_max: 4,
};

/// The key space: short keys (stored inline) and one long key (stored on the heap).
const KEYS: [&[u8]; 10] = [
    b"job:1234567890123456789",  // 23 bytes: the longest key kept in its slot
    b"job:12345678901234567890", // 24 bytes: the shortest in the key arena
    b"a",
    b"b",
    b"c",
    b"d",
    b"e",
    b"f",
    b"",
    b"a-key-longer-than-the-inline-limit",
];

/// A waiter whose connection the simulation can close.
#[derive(Debug)]
struct SimWaiter(Rc<Cell<bool>>);

impl WaiterSink for SimWaiter {
    fn is_live(&self) -> bool {
        self.0.get()
    }
}

/// A grant as seen by a client: the comparison form of `Handoff` and `Grant`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Given {
    key: Vec<u8>,
    waiter_id: u64,
    token: u64,
    lease_id: LeaseId,
    ttl_ms: u32,
    meta: Vec<u8>,
}

/// The comparison form of `Event`.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Expired {
        key: Vec<u8>,
        token: u64,
        handoff: Option<Given>,
    },
    HandedOff(Given),
    TimedOut {
        key: Vec<u8>,
        waiter_id: u64,
        holder_token: u64,
        ttl_left_ms: u64,
    },
}

/// The comparison form of `Acquire`.
#[derive(Debug, PartialEq, Eq)]
enum Acquired {
    Granted(Grant),
    Locked { token: u64, ttl_left_ms: u64 },
    Queued(u64),
    Full(Limit),
    Exhausted { waiter_returned: bool },
}

fn given(handoff: Handoff<SimWaiter>) -> Given {
    Given {
        key: handoff.key.to_vec(),
        waiter_id: handoff.waiter_id,
        token: handoff.grant.token,
        lease_id: handoff.grant.lease_id,
        ttl_ms: handoff.grant.ttl_ms,
        meta: handoff.meta.to_vec(),
    }
}

fn seen(event: Event<SimWaiter>) -> Seen {
    match event {
        Event::Expired {
            key,
            token,
            handoff,
            ..
        } => Seen::Expired {
            key: key.to_vec(),
            token,
            handoff: handoff.map(given),
        },
        Event::HandedOff(handoff) => Seen::HandedOff(given(handoff)),
        Event::WaitTimedOut {
            key,
            waiter_id,
            holder_token,
            ttl_left_ms,
            ..
        } => Seen::TimedOut {
            key: key.to_vec(),
            waiter_id,
            holder_token,
            ttl_left_ms,
        },
    }
}

/// A queued request in the model.
#[derive(Debug)]
struct ModelWaiter {
    waiter_id: u64,
    lease_id: LeaseId,
    ttl_ms: u32,
    deadline_ms: u64,
    meta: Vec<u8>,
    live: Rc<Cell<bool>>,
}

/// A key with a slot in the model. `deadline_ms == 0`: reserved for a deferred handoff.
#[derive(Debug)]
struct ModelLock {
    lease_id: LeaseId,
    token: u64,
    deadline_ms: u64,
    /// The TTL a restart gives it: its grant's, or a longer renewal's (which is logged).
    ttl_ms: u32,
    meta: Vec<u8>,
    queue: VecDeque<ModelWaiter>,
}

/// The naive reference: the documented rules, applied literally.
#[derive(Debug, Default)]
struct Model {
    locks: BTreeMap<Vec<u8>, ModelLock>,
    next_token: u64,
    token_limit: u64,
    next_waiter_id: u64,
    /// Places in the held quota taken by other shards.
    held_elsewhere: usize,
    /// Places in the waiter quota taken by other shards.
    waiters_elsewhere: usize,
}

impl Model {
    fn tokens_available(&self) -> bool {
        self.next_token < self.token_limit
    }

    fn take_token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token - 1
    }

    fn waiters_count(&self) -> usize {
        self.locks.values().map(|lock| lock.queue.len()).sum()
    }

    /// Times out due waiters, then ends an expired lease with a handoff or a free.
    fn settle(&mut self, key: &[u8], now_ms: u64) -> Vec<Seen> {
        let mut events = Vec::new();
        let Some(lock) = self.locks.get_mut(key) else {
            return events;
        };
        let (due, kept): (VecDeque<_>, VecDeque<_>) = lock
            .queue
            .drain(..)
            .partition(|waiter| waiter.deadline_ms <= now_ms);
        lock.queue = kept;
        for waiter in due {
            events.push(Seen::TimedOut {
                key: key.to_vec(),
                waiter_id: waiter.waiter_id,
                holder_token: lock.token,
                ttl_left_ms: lock.deadline_ms.saturating_sub(now_ms),
            });
        }
        if lock.deadline_ms == 0 && lock.queue.is_empty() {
            self.locks.remove(key);
            return events;
        }
        if lock.deadline_ms > now_ms {
            return events;
        }
        let (ended, token) = (lock.deadline_ms == 0, lock.token);
        match (self.hand_off(key, now_ms), ended) {
            (Some(next), true) => events.push(Seen::HandedOff(next)),
            (handoff, false) => events.push(Seen::Expired {
                key: key.to_vec(),
                token,
                handoff,
            }),
            (None, true) => {}
        }
        events
    }

    /// Passes an ended lease to the first live waiter, frees the key, or reserves it.
    fn hand_off(&mut self, key: &[u8], now_ms: u64) -> Option<Given> {
        let available = self.tokens_available();
        let lock = self
            .locks
            .get_mut(key)
            .expect("hand_off on a key with a slot");
        while available && lock.queue.front().is_some_and(|waiter| !waiter.live.get()) {
            lock.queue.pop_front();
        }
        if lock.queue.is_empty() {
            self.locks.remove(key);
            return None;
        }
        if !available {
            lock.deadline_ms = 0;
            return None;
        }
        let waiter = lock.queue.pop_front().expect("not empty");
        let token = self.next_token;
        self.next_token += 1;
        let lock = self.locks.get_mut(key).expect("still there");
        lock.lease_id = waiter.lease_id;
        lock.token = token;
        lock.deadline_ms = now_ms + u64::from(waiter.ttl_ms);
        lock.ttl_ms = waiter.ttl_ms;
        lock.meta = waiter.meta.clone();
        Some(Given {
            key: key.to_vec(),
            waiter_id: waiter.waiter_id,
            token,
            lease_id: waiter.lease_id,
            ttl_ms: waiter.ttl_ms,
            meta: waiter.meta,
        })
    }

    /// `acquire` by the book; `live` is the request's waiter flag when it waits.
    fn acquire(&mut self, now_ms: u64, request: &Request, events: &mut Vec<Seen>) -> Acquired {
        events.extend(self.settle(&request.key, now_ms));
        let Some(lock) = self.locks.get(&request.key) else {
            if self.locks.len() + self.held_elsewhere >= LIMITS.held_max {
                return Acquired::Full(Limit::HeldLocks);
            }
            if !self.tokens_available() {
                return Acquired::Exhausted {
                    waiter_returned: request.wait_ms > 0,
                };
            }
            let grant = Grant {
                token: self.take_token(),
                lease_id: request.lease_id,
                ttl_ms: request.ttl_ms,
            };
            let deadline_ms = now_ms + u64::from(request.ttl_ms);
            let lock = ModelLock {
                lease_id: request.lease_id,
                token: grant.token,
                deadline_ms,
                ttl_ms: request.ttl_ms,
                meta: request.meta.clone(),
                queue: VecDeque::new(),
            };
            self.locks.insert(request.key.clone(), lock);
            return Acquired::Granted(grant);
        };
        if request.wait_ms == 0 {
            if lock.deadline_ms == 0 {
                return Acquired::Exhausted {
                    waiter_returned: false,
                };
            }
            return Acquired::Locked {
                token: lock.token,
                ttl_left_ms: lock.deadline_ms - now_ms,
            };
        }
        if lock.queue.len() >= LIMITS.waiters_per_key_max {
            return Acquired::Full(Limit::WaitersPerKey);
        }
        if self.waiters_count() + self.waiters_elsewhere >= LIMITS.waiters_max {
            return Acquired::Full(Limit::Waiters);
        }
        let waiter_id = self.next_waiter_id;
        self.next_waiter_id += 1;
        let lock = self.locks.get_mut(&request.key).expect("present");
        lock.queue.push_back(ModelWaiter {
            waiter_id,
            lease_id: request.lease_id,
            ttl_ms: request.ttl_ms,
            deadline_ms: now_ms + u64::from(request.wait_ms),
            meta: request.meta.clone(),
            live: Rc::clone(&request.live),
        });
        Acquired::Queued(waiter_id)
    }

    /// The unexpired lease on `key`, if any.
    fn held(&self, key: &[u8], now_ms: u64) -> Option<&ModelLock> {
        self.locks.get(key).filter(|lock| lock.deadline_ms > now_ms)
    }

    fn renew(&mut self, now_ms: u64, key: &[u8], lease_id: LeaseId, ttl_ms: u32) -> Renew {
        match self.locks.get_mut(key) {
            Some(lock) if lock.deadline_ms > now_ms && lock.lease_id == lease_id => {
                lock.deadline_ms = now_ms + u64::from(ttl_ms);
                lock.ttl_ms = lock.ttl_ms.max(ttl_ms);
                Renew::Renewed {
                    ttl_ms,
                    wait_lsn: 0,
                }
            }
            _ => Renew::Lost,
        }
    }

    /// `release` by the book: `None` for NotOwner, else the token and the handoff.
    fn release(
        &mut self,
        now_ms: u64,
        key: &[u8],
        lease_id: LeaseId,
        events: &mut Vec<Seen>,
    ) -> Option<(u64, Option<Given>)> {
        let lock = self
            .held(key, now_ms)
            .filter(|lock| lock.lease_id == lease_id)?;
        let token = lock.token;
        // Settling a live lease only times out waiters, exactly what release does first.
        events.extend(self.settle(key, now_ms));
        Some((token, self.hand_off(key, now_ms)))
    }

    fn cancel(&mut self, key: &[u8], waiter_id: u64) -> bool {
        let Some(lock) = self.locks.get_mut(key) else {
            return false;
        };
        let Some(position) = lock.queue.iter().position(|w| w.waiter_id == waiter_id) else {
            return false;
        };
        lock.queue.remove(position);
        if lock.deadline_ms == 0 && lock.queue.is_empty() {
            self.locks.remove(key);
        }
        true
    }
}

/// One acquire request, shared by the table call and the model.
#[derive(Debug)]
struct Request {
    key: Vec<u8>,
    lease_id: LeaseId,
    ttl_ms: u32,
    wait_ms: u32,
    meta: Vec<u8>,
    live: Rc<Cell<bool>>,
}

/// Grants as the clients saw them, to check safety independently of the model.
#[derive(Debug, Default)]
struct Clients {
    /// Per key: (lease id, token, deadline) of grants not known to be released.
    holders: BTreeMap<Vec<u8>, Vec<(LeaseId, u64, u64)>>,
    /// Per key: the highest token seen.
    last_token: BTreeMap<Vec<u8>, u64>,
}

impl Clients {
    fn granted(
        &mut self,
        key: &[u8],
        lease_id: LeaseId,
        token: u64,
        deadline_ms: u64,
        now_ms: u64,
    ) {
        let last = self.last_token.entry(key.to_vec()).or_default();
        assert!(
            token > *last,
            "token {token} on {key:?} not above previous {last}"
        );
        *last = token;
        let holders = self.holders.entry(key.to_vec()).or_default();
        holders.retain(|&(_, _, deadline)| deadline > now_ms);
        assert!(
            holders.is_empty(),
            "{key:?} granted while {holders:?} still hold it"
        );
        holders.push((lease_id, token, deadline_ms));
    }

    fn renewed(&mut self, key: &[u8], lease_id: LeaseId, deadline_ms: u64) {
        for holder in self.holders.entry(key.to_vec()).or_default() {
            if holder.0 == lease_id {
                holder.2 = deadline_ms;
            }
        }
    }

    fn released(&mut self, key: &[u8], lease_id: LeaseId) {
        self.holders
            .entry(key.to_vec())
            .or_default()
            .retain(|holder| holder.0 != lease_id);
    }

    fn check(&self, now_ms: u64) {
        for (key, holders) in &self.holders {
            let live = holders
                .iter()
                .filter(|&&(_, _, deadline)| deadline > now_ms)
                .count();
            assert!(live <= 1, "{key:?} has {live} unexpired holders");
        }
    }
}

/// How often each interesting outcome happened, so a test that silently stopped reaching
/// one (and so checked nothing there) fails.
#[derive(Debug, Default)]
struct Coverage {
    /// Indexed by `Acquired` variant, then: 5 handoff on release, 6 handoff on expiry,
    /// 7 deferred handoff completed, 8 wait timeout, 9 reserved key, 10 renewed, 11 cancelled.
    counts: [u64; 12],
}

impl Coverage {
    fn acquired(&mut self, outcome: &Acquired) {
        let index = match outcome {
            Acquired::Granted(_) => 0,
            Acquired::Locked { .. } => 1,
            Acquired::Queued(_) => 2,
            Acquired::Full(_) => 3,
            Acquired::Exhausted { .. } => 4,
        };
        self.counts[index] += 1;
    }

    fn events(&mut self, events: &[Seen]) {
        for event in events {
            let index = match event {
                Seen::Expired {
                    handoff: Some(_), ..
                } => 6,
                Seen::Expired { handoff: None, .. } => continue,
                Seen::HandedOff(_) => 7,
                Seen::TimedOut { .. } => 8,
            };
            self.counts[index] += 1;
        }
    }
}

/// One seed's world: the table under test, the model, and the simulated clients.
struct Sim {
    coverage: Coverage,
    rng: StdRng,
    now_ms: u64,
    table: LockTable<SimWaiter>,
    /// The table's quotas, which the simulated other shards share.
    quotas: Arc<Quotas>,
    tokens: TokenAllocator,
    model: Model,
    clients: Clients,
    next_lease: u128,
    /// Every lease id handed to a request, per key (for right and wrong ids).
    leases: BTreeMap<Vec<u8>, Vec<LeaseId>>,
    /// Every waiter ever queued: key, id, liveness.
    waiters: Vec<(Vec<u8>, u64, Rc<Cell<bool>>)>,
}

impl Sim {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let now_ms = rng.random_range(0..1u64 << 40);
        let next_token = rng.random_range(1..1000);
        let model = Model {
            next_token,
            token_limit: next_token + 50,
            next_waiter_id: 1,
            ..Model::default()
        };
        let quotas = Arc::new(Quotas::new(LIMITS));
        Sim {
            table: LockTable::with_quotas(Arc::clone(&quotas), rng.random()),
            quotas,
            tokens: TokenAllocator::new(next_token, next_token + 50),
            coverage: Coverage::default(),
            rng,
            now_ms,
            model,
            clients: Clients::default(),
            next_lease: 1,
            leases: BTreeMap::new(),
            waiters: Vec::new(),
        }
    }

    fn key(&mut self) -> Vec<u8> {
        KEYS[self.rng.random_range(0..KEYS.len())].to_vec()
    }

    fn ttl_ms(&mut self) -> u32 {
        match self.rng.random_range(0..40) {
            0 => tenure_protocol::limits::TTL_MS_MAX,
            1..=4 => tenure_protocol::limits::TTL_MS_MIN,
            _ => self.rng.random_range(10..400),
        }
    }

    /// A lease id for `key`: usually one it was granted under, sometimes a fresh wrong one.
    fn lease_for(&mut self, key: &[u8]) -> LeaseId {
        if let Some(lock) = self.model.locks.get(key) {
            if self.rng.random_bool(0.6) {
                return lock.lease_id;
            }
        }
        let known = self.leases.get(key).map_or(0, Vec::len);
        if known > 0 && self.rng.random_bool(0.5) {
            return self.leases[key][self.rng.random_range(0..known)];
        }
        LeaseId::from_u128(u128::MAX - self.rng.random_range(0..4u128))
    }

    fn step(&mut self) {
        match self.rng.random_range(0..104) {
            0..=19 => self.acquire(false),
            20..=34 => self.acquire(true),
            35..=45 => self.renew(),
            46..=57 => self.release(),
            58..=62 => self.inspect_and_check(),
            63..=67 => self.cancel(),
            68..=71 => self.kill_waiter(),
            72..=81 => self.now_ms += self.rng.random_range(0..20),
            82 => self.now_ms += self.rng.random_range(0..10_000_000),
            83 => self.now_ms += self.rng.random_range(0..100_000_000),
            84..=93 => self.advance(),
            94..=95 => self.starve_tokens(),
            96..=99 => self.extend_tokens(),
            _ => self.other_shards(),
        }
        self.compare_state();
    }

    fn acquire(&mut self, wait: bool) {
        let key = self.key();
        let lease_id = LeaseId::from_u128(self.next_lease);
        self.next_lease += 1;
        self.leases.entry(key.clone()).or_default().push(lease_id);
        let wait_ms = match (wait, self.rng.random_range(0..40)) {
            (false, _) => 0,
            (true, 0) => tenure_protocol::limits::WAIT_MS_MAX,
            (true, _) => self.rng.random_range(1..500),
        };
        let meta = [&b""[..], b"m", b"holder-7"][self.rng.random_range(0..3)].to_vec();
        let request = Request {
            key,
            lease_id,
            ttl_ms: self.ttl_ms(),
            wait_ms,
            meta,
            live: Rc::new(Cell::new(true)),
        };
        let mut expected_events = Vec::new();
        let expected = self
            .model
            .acquire(self.now_ms, &request, &mut expected_events);
        let args = AcquireArgs {
            key: &request.key,
            lease_id,
            ttl_ms: request.ttl_ms,
            wait_ms,
            waiter: (wait_ms > 0).then(|| SimWaiter(Rc::clone(&request.live))),
            meta: &request.meta,
        };
        let mut events = Vec::new();
        let actual = match self
            .table
            .acquire(self.now_ms, args, &self.tokens, &mut events)
        {
            Acquire::Granted(grant) => Acquired::Granted(grant),
            Acquire::Locked { token, ttl_left_ms } => Acquired::Locked { token, ttl_left_ms },
            Acquire::Queued { waiter_id } => Acquired::Queued(waiter_id),
            Acquire::Full(limit) => Acquired::Full(limit),
            Acquire::KindMismatch { .. } => unreachable!("this simulation asks for plain locks"),
            Acquire::TokensExhausted { waiter } => Acquired::Exhausted {
                waiter_returned: waiter.is_some(),
            },
        };
        self.expect_events(events, &expected_events);
        assert_eq!(actual, expected, "acquire {request:?}");
        self.coverage.acquired(&actual);
        match actual {
            Acquired::Granted(grant) => {
                let deadline_ms = self.now_ms + u64::from(grant.ttl_ms);
                self.clients.granted(
                    &request.key,
                    lease_id,
                    grant.token,
                    deadline_ms,
                    self.now_ms,
                );
            }
            Acquired::Queued(waiter_id) => {
                self.waiters.push((request.key, waiter_id, request.live))
            }
            _ => {}
        }
    }

    fn renew(&mut self) {
        let key = self.key();
        let lease_id = self.lease_for(&key);
        let ttl_ms = self.ttl_ms();
        let expected = self.model.renew(self.now_ms, &key, lease_id, ttl_ms);
        // The journal is always durable here: waits are the executor simulation's business.
        let durable_lsn = || u64::MAX;
        let actual = match self
            .table
            .renew(self.now_ms, &key, lease_id, ttl_ms, durable_lsn)
        {
            Renew::Unlogged { token } => {
                self.table.renew_logged(self.now_ms, &key, token, ttl_ms, 1);
                Renew::Renewed {
                    ttl_ms,
                    wait_lsn: 0,
                }
            }
            other => other,
        };
        assert_eq!(actual, expected, "renew {key:?} {lease_id:?}");
        if actual != Renew::Lost {
            self.coverage.counts[10] += 1;
            self.clients
                .renewed(&key, lease_id, self.now_ms + u64::from(ttl_ms));
        }
    }

    fn release(&mut self) {
        let key = self.key();
        let lease_id = self.lease_for(&key);
        let mut expected_events = Vec::new();
        let expected = self
            .model
            .release(self.now_ms, &key, lease_id, &mut expected_events);
        let mut events = Vec::new();
        let actual =
            match self
                .table
                .release(self.now_ms, &key, lease_id, &self.tokens, &mut events)
            {
                Release::Released { token, handoff } => Some((token, handoff.map(given))),
                Release::NotOwner => None,
            };
        self.expect_events(events, &expected_events);
        assert_eq!(actual, expected, "release {key:?} {lease_id:?}");
        if let Some((_, handoff)) = actual {
            self.clients.released(&key, lease_id);
            if let Some(next) = handoff {
                self.coverage.counts[5] += 1;
                self.see_grant(&next);
            }
        }
    }

    fn inspect_and_check(&mut self) {
        let key = self.key();
        let token = match self.model.locks.get(&key) {
            Some(lock) if self.rng.random_bool(0.7) => lock.token,
            _ => self.rng.random_range(0..self.model.next_token + 1),
        };
        let expected = match self.model.held(&key, self.now_ms) {
            Some(lock) if lock.token == token => Check::Current,
            _ => Check::Stale,
        };
        assert_eq!(
            self.table.check(self.now_ms, &key, token),
            expected,
            "check {key:?} {token}"
        );
    }

    fn cancel(&mut self) {
        if self.waiters.is_empty() {
            return;
        }
        let (mut key, waiter_id, _) =
            self.waiters[self.rng.random_range(0..self.waiters.len())].clone();
        if self.rng.random_bool(0.1) {
            key = self.key();
        }
        let expected = self.model.cancel(&key, waiter_id);
        assert_eq!(
            self.table.cancel_waiter(&key, waiter_id),
            expected,
            "cancel {key:?} {waiter_id}"
        );
        self.coverage.counts[11] += u64::from(expected);
    }

    fn kill_waiter(&mut self) {
        if let Some(index) =
            (!self.waiters.is_empty()).then(|| self.rng.random_range(0..self.waiters.len()))
        {
            self.waiters[index].2.set(false);
        }
    }

    /// Uses up the reservation except for 0 to 2 tokens, as other shards would.
    fn starve_tokens(&mut self) {
        let keep = self.rng.random_range(0..3);
        while self.model.token_limit - self.model.next_token > keep {
            let token = self.model.take_token();
            assert_eq!(
                self.tokens.try_next(),
                Some(token),
                "allocator drifted from the model"
            );
        }
    }

    fn extend_tokens(&mut self) {
        self.model.token_limit += self.rng.random_range(1..100);
        self.tokens.extend_limit(self.model.token_limit);
    }

    /// Runs `advance` and checks each key it settled against the model settling that key.
    fn advance(&mut self) {
        let budget = [0, 1, 2, 3, usize::MAX][self.rng.random_range(0..5)];
        let mut events = Vec::new();
        let more = self
            .table
            .advance(self.now_ms, budget, &self.tokens, &mut events);
        let mut events = events.into_iter().map(seen).peekable();
        while let Some(first) = events.next() {
            let key = event_key(&first).to_vec();
            let mut group = vec![first];
            while let Some(next) = events.next_if(|event| event_key(event) == key) {
                group.push(next);
            }
            let expected = self.model.settle(&key, self.now_ms);
            assert_eq!(group, expected, "advance settled {key:?}");
            self.see_events(&group);
        }
        // A reserved key whose waiters all died is freed without an event, when a retry finds
        // a token (which later handoffs in the same call may have used up, so the model cannot
        // replay it now): check that it was allowed, then follow the table.
        let reserved: Vec<Vec<u8>> = (self.model.locks.iter())
            .filter(|(_, lock)| lock.deadline_ms == 0)
            .map(|(key, _)| key.clone())
            .collect();
        for key in reserved.into_iter().filter(|key| !self.table.has_slot(key)) {
            let lock = self.model.locks.remove(&key).expect("listed above");
            let silent = (lock.queue.iter()).all(|w| !w.live.get() && w.deadline_ms > self.now_ms);
            assert!(
                silent,
                "table freed reserved {key:?}, whose queue was {:?}",
                lock.queue
            );
        }
        if budget == usize::MAX {
            assert!(!more, "unlimited advance left work");
            self.check_nothing_overdue();
        }
    }

    /// After an unlimited `advance`, no lease or wait may be overdue.
    fn check_nothing_overdue(&self) {
        for (key, lock) in &self.model.locks {
            assert!(
                lock.deadline_ms == 0 || lock.deadline_ms > self.now_ms,
                "{key:?} not expired"
            );
            let overdue = lock
                .queue
                .iter()
                .any(|waiter| waiter.deadline_ms <= self.now_ms);
            assert!(!overdue, "{key:?} has a waiter past its deadline");
            let reserved_with_tokens = lock.deadline_ms == 0 && self.model.tokens_available();
            assert!(
                !reserved_with_tokens,
                "{key:?} still reserved though tokens are available"
            );
        }
    }

    fn expect_events(&mut self, events: Vec<Event<SimWaiter>>, expected: &[Seen]) {
        let events: Vec<Seen> = events.into_iter().map(seen).collect();
        assert_eq!(events, expected, "events");
        self.see_events(&events);
    }

    fn see_events(&mut self, events: &[Seen]) {
        self.coverage.events(events);
        for event in events {
            match event {
                Seen::Expired {
                    handoff: Some(next),
                    ..
                }
                | Seen::HandedOff(next) => self.see_grant(next),
                Seen::Expired { handoff: None, .. } | Seen::TimedOut { .. } => {}
            }
        }
    }

    fn see_grant(&mut self, next: &Given) {
        let deadline_ms = self.now_ms + u64::from(next.ttl_ms);
        self.clients.granted(
            &next.key,
            next.lease_id,
            next.token,
            deadline_ms,
            self.now_ms,
        );
    }

    /// Another shard takes or gives back a place in the held or the waiter quota.
    fn other_shards(&mut self) {
        let (quota, elsewhere, count, max) = if self.rng.random_bool(0.5) {
            let count = self.model.locks.len();
            (
                &self.quotas.held,
                &mut self.model.held_elsewhere,
                count,
                LIMITS.held_max,
            )
        } else {
            let count = self.model.waiters_count();
            (
                &self.quotas.waiters,
                &mut self.model.waiters_elsewhere,
                count,
                LIMITS.waiters_max,
            )
        };
        if *elsewhere > 0 && self.rng.random_bool(0.5) {
            quota.give_back(1);
            *elsewhere -= 1;
        } else {
            assert_eq!(quota.try_take(), count + *elsewhere < max, "try_take");
            *elsewhere += usize::from(count + *elsewhere < max);
        }
    }

    /// Everything observable must match the model after every step.
    fn compare_state(&mut self) {
        let reserved = self.model.locks.values().any(|lock| lock.deadline_ms == 0);
        self.coverage.counts[9] += u64::from(reserved);
        self.table.check_invariants();
        self.clients.check(self.now_ms);
        assert_eq!(
            self.tokens.next_token(),
            self.model.next_token,
            "token counter"
        );
        assert_eq!(
            self.table.slots_in_use(),
            self.model.locks.len(),
            "slots_in_use"
        );
        assert_eq!(
            self.table.waiters_count(),
            self.model.waiters_count(),
            "waiters_count"
        );
        assert_eq!(
            self.quotas.held.count(),
            self.model.locks.len() + self.model.held_elsewhere,
            "held quota"
        );
        assert_eq!(
            self.quotas.waiters.count(),
            self.model.waiters_count() + self.model.waiters_elsewhere,
            "waiter quota"
        );
        for key in KEYS {
            let expected = match self.model.held(key, self.now_ms) {
                None => Inspect::Free,
                Some(lock) => Inspect::Held {
                    token: lock.token,
                    ttl_left_ms: lock.deadline_ms - self.now_ms,
                    waiters: lock.queue.len() as u32,
                    meta: &lock.meta,
                },
            };
            assert_eq!(
                self.table.inspect(self.now_ms, key),
                expected,
                "inspect {key:?}"
            );
        }
        let mut held = Vec::new();
        self.table.for_each_held(self.now_ms, |lock| {
            held.push((
                lock.key.to_vec(),
                lock.lease_id,
                lock.token,
                lock.ttl_ms,
                lock.meta.to_vec(),
            ))
        });
        held.sort();
        let expected: Vec<_> = (self.model.locks.iter())
            .filter(|(_, lock)| lock.deadline_ms > self.now_ms)
            .map(|(key, lock)| {
                (
                    key.clone(),
                    lock.lease_id,
                    lock.token,
                    lock.ttl_ms,
                    lock.meta.clone(),
                )
            })
            .collect();
        assert_eq!(held, expected, "for_each_held");
    }
}

fn event_key(event: &Seen) -> &[u8] {
    match event {
        Seen::Expired { key, .. } | Seen::TimedOut { key, .. } => key,
        Seen::HandedOff(next) => &next.key,
    }
}

fn run_seed(seed: u64, step: &Cell<u32>) -> Coverage {
    let mut sim = Sim::new(seed);
    for index in 0..STEPS_PER_SEED {
        step.set(index);
        sim.step();
    }
    sim.coverage
}

/// The seeds a simulation runs: `TENURE_SIM_SEED=s` alone, or `TENURE_SIM_SEEDS=n` (default
/// `default`) seeds from 0. Shared by every simulation, so one variable drives them all.
pub(crate) fn seeds_from_env(default: u64) -> Vec<u64> {
    match std::env::var("TENURE_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("TENURE_SIM_SEED must be a number")],
        Err(_) => {
            let count = std::env::var("TENURE_SIM_SEEDS").map_or(default, |n| {
                n.parse().expect("TENURE_SIM_SEEDS must be a number")
            });
            (0..count).collect()
        }
    }
}

#[test]
fn lock_table_matches_model() {
    let seeds = seeds_from_env(SEEDS_DEFAULT);
    let mut total = [0u64; 12];
    for &seed in &seeds {
        let step = Cell::new(0);
        match catch_unwind(AssertUnwindSafe(|| run_seed(seed, &step))) {
            Ok(coverage) => total
                .iter_mut()
                .zip(coverage.counts)
                .for_each(|(sum, n)| *sum += n),
            Err(_) => panic!(
                "simulation failed at seed {seed}, step {}; rerun with TENURE_SIM_SEED={seed}",
                step.get()
            ),
        }
    }
    println!("simulation coverage over {} seeds: {total:?}", seeds.len());
    if seeds.len() >= 20 {
        assert!(
            total.iter().all(|&count| count > 0),
            "an outcome was never reached: {total:?}"
        );
    }
}
