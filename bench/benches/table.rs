//! The lock table at 1K, 100K and 1M held locks: acquire, renew and release on fresh and
//! existing keys, as one shard of the server sees them (no mutex, no WAL, no sockets).
//!
//! Time is fixed: every lock is taken at `now_ms` = 1,000 with a 30 s lease and every measured
//! op runs at 2,000, so no lease expires and the population stays put. Ops that would change
//! the population (acquiring a fresh key, releasing a held one) run in chunks of [`CHUNK`]
//! and are undone, untimed, after each chunk.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tenure_protocol::LeaseId;
use tenure_server::table::TokenAllocator;
use tenure_server::table::{
    Acquire, AcquireArgs, Event, LockTable, Release, Renew, TableLimits, WaiterSink,
};

/// Held-lock populations benchmarked.
const POPULATIONS: [u64; 3] = [1_000, 100_000, 1_000_000];
/// Population-changing ops per timed chunk.
const CHUNK: u64 = 256;
/// When the population was taken, milliseconds.
const T_FILL_MS: u64 = 1_000;
/// When measured ops run, milliseconds.
const T_RUN_MS: u64 = 2_000;
/// Lease length, milliseconds.
const TTL_MS: u32 = 30_000;
/// Keys are `job:` and ten digits, the width of the load generator's keys.
const KEY_LEN: usize = 14;
/// Fresh keys are numbers `population..population + FRESH_SPAN`, reused cyclically (each
/// chunk frees what it took).
const FRESH_SPAN: u64 = 64 * CHUNK;

/// The benches never wait, so the waiter type is never instantiated.
struct NoWaiter;

impl WaiterSink for NoWaiter {
    fn is_live(&self) -> bool {
        true
    }
}

/// A table holding `population` locks, plus the keys and lease ids to address them.
struct Fixture {
    table: LockTable<NoWaiter>,
    tokens: TokenAllocator,
    keys: Vec<u8>,
    leases: Vec<LeaseId>,
    events: Vec<Event<NoWaiter>>,
    /// Chunk positions used so far: picks fresh keys and scattered held keys.
    counter: u64,
}

impl Fixture {
    fn new(population: u64) -> Fixture {
        let limits = TableLimits {
            held_max: 2 * population as usize + 2 * CHUNK as usize,
            waiters_max: 1024,
            waiters_per_key_max: 64,
        };
        let mut fixture = Fixture {
            table: LockTable::with_hash_seed(limits, 0x5eed),
            tokens: TokenAllocator::new(1, u64::MAX / 2),
            keys: (0..population + FRESH_SPAN)
                .flat_map(|n| format!("job:{n:010}").into_bytes())
                .collect(),
            leases: Vec::with_capacity(population as usize),
            events: Vec::new(),
            counter: 0,
        };
        for n in 0..population {
            let lease = fixture.acquire(T_FILL_MS, n);
            fixture.leases.push(lease);
        }
        assert_eq!(fixture.table.slots_in_use() as u64, population);
        fixture
    }

    fn population(&self) -> u64 {
        self.leases.len() as u64
    }

    /// The fresh key number for chunk position `i`.
    fn fresh_key(&self, i: u64) -> u64 {
        self.population() + i % FRESH_SPAN
    }

    /// Takes key `n`, which must be free; returns its lease id.
    fn acquire(&mut self, now_ms: u64, n: u64) -> LeaseId {
        let lease_id = LeaseId::from_u128(u128::from(n) << 32 | u128::from(now_ms));
        let key = key_of(&self.keys, n);
        let args = AcquireArgs {
            key,
            lease_id,
            ttl_ms: TTL_MS,
            wait_ms: 0,
            waiter: None,
            meta: &[],
        };
        let outcome = self
            .table
            .acquire(now_ms, args, &self.tokens, &mut self.events);
        self.events.clear();
        assert!(
            matches!(outcome, Acquire::Granted(_)),
            "key {n} was not free"
        );
        lease_id
    }

    fn release(&mut self, now_ms: u64, n: u64, lease_id: LeaseId) {
        let key = key_of(&self.keys, n);
        let outcome = self
            .table
            .release(now_ms, key, lease_id, &self.tokens, &mut self.events);
        self.events.clear();
        assert!(
            matches!(outcome, Release::Released { .. }),
            "key {n} was not held"
        );
    }
}

/// Key number `n` in the packed key array.
fn key_of(keys: &[u8], n: u64) -> &[u8] {
    &keys[n as usize * KEY_LEN..][..KEY_LEN]
}

/// Visits `0..population` in a scattered order, so successive ops miss the cache as real
/// traffic would (a stride coprime with every population benchmarked).
fn scattered(i: u64, population: u64) -> u64 {
    (i.wrapping_mul(0x9e37_79b1)) % population
}

fn bench_population(c: &mut Criterion, population: u64) {
    let mut group = c.benchmark_group("table");
    group.throughput(Throughput::Elements(1));
    let mut f = Fixture::new(population);
    let id = |name: &str| BenchmarkId::new(name, population);

    group.bench_function(id("acquire_fresh"), |b| {
        b.iter_custom(|iters| chunked(iters, &mut f, acquire_fresh, undo_acquire))
    });
    group.bench_function(id("acquire_held_locked"), |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            let n = scattered(i, population);
            let key = key_of(&f.keys, n);
            let args = AcquireArgs {
                key,
                lease_id: LeaseId::from_u128(1),
                ttl_ms: TTL_MS,
                wait_ms: 0,
                waiter: None,
                meta: &[],
            };
            let outcome = f.table.acquire(T_RUN_MS, args, &f.tokens, &mut f.events);
            assert!(matches!(outcome, Acquire::Locked { .. }));
            black_box(outcome);
        })
    });
    group.bench_function(id("renew_held"), |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            let n = scattered(i, population);
            let lease_id = f.leases[n as usize];
            let key = key_of(&f.keys, n);
            // The grant's TTL again: nothing to log, and the journal is never asked.
            let outcome = f.table.renew(T_RUN_MS, key, lease_id, TTL_MS, || 0);
            assert!(matches!(outcome, Renew::Renewed { wait_lsn: 0, .. }));
        })
    });
    group.bench_function(id("renew_missing_lost"), |b| {
        b.iter(|| {
            let n = f.population() + FRESH_SPAN - 1; // chunks leave fresh keys free
            let key = key_of(&f.keys, n);
            let outcome = f
                .table
                .renew(T_RUN_MS, key, LeaseId::from_u128(1), TTL_MS, || 0);
            assert!(matches!(outcome, Renew::Lost));
        })
    });
    group.bench_function(id("release_held"), |b| {
        b.iter_custom(|iters| chunked(iters, &mut f, release_existing, undo_release))
    });
    group.finish();
    f.table.check_invariants();
}

/// Times `iters` calls of `op` in chunks of [`CHUNK`], running `undo` untimed after each.
fn chunked(
    iters: u64,
    f: &mut Fixture,
    op: impl Fn(&mut Fixture, u64),
    undo: impl Fn(&mut Fixture, u64, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let count = CHUNK.min(iters - done);
        let first = f.counter;
        let start = Instant::now();
        for n in first..first + count {
            op(f, n);
        }
        total += start.elapsed();
        undo(f, first, count);
        done += count;
    }
    total
}

/// Takes the fresh key of chunk position `i`.
fn acquire_fresh(f: &mut Fixture, i: u64) {
    let n = f.fresh_key(i);
    black_box(f.acquire(T_RUN_MS, n));
}

/// Frees the fresh keys a chunk of `acquire_fresh` took (their lease ids are recomputed).
fn undo_acquire(f: &mut Fixture, first: u64, count: u64) {
    for i in first..first + count {
        let n = f.fresh_key(i);
        let lease_id = LeaseId::from_u128(u128::from(n) << 32 | u128::from(T_RUN_MS));
        f.release(T_RUN_MS, n, lease_id);
    }
    f.counter += count;
}

/// Releases the held key chunk position `i` maps to.
fn release_existing(f: &mut Fixture, i: u64) {
    let population = f.population();
    let k = scattered(i, population);
    let lease_id = f.leases[k as usize];
    f.release(T_RUN_MS, k, lease_id);
}

/// Re-takes the keys a chunk of `release_held` freed and records their new lease ids.
fn undo_release(f: &mut Fixture, first: u64, count: u64) {
    let population = f.population();
    for i in first..first + count {
        let k = scattered(i, population);
        f.leases[k as usize] = f.acquire(T_RUN_MS, k);
    }
    f.counter += count;
}

fn table(c: &mut Criterion) {
    for population in POPULATIONS {
        bench_population(c, population);
    }
}

criterion_group! {
    name = benches;
    config = tenure_bench::criterion_config(Duration::from_millis(500));
    targets = table
}
criterion_main!(benches);
