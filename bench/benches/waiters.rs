//! Waiters leaving at once: N blocking acquires queued on one held key are cancelled, in a
//! scattered order (as when the connections that queued them close), at 10K and 100K
//! waiters. Throughput is per waiter, so cost growing faster than linearly shows as a rate
//! that falls with N. Setup (queueing the waiters) is not timed.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use tenure_protocol::LeaseId;
use tenure_server::table::TokenAllocator;
use tenure_server::table::{Acquire, AcquireArgs, LockTable, TableLimits, WaiterSink};

/// Waiters queued on the one key, per benchmark.
const WAITER_POPULATIONS: [u64; 2] = [10_000, 100_000];
/// When the key is taken and the waiters queue, milliseconds.
const T_FILL_MS: u64 = 1_000;
/// Lease length and wait, long enough that nothing runs out.
const TTL_MS: u32 = 3_600_000;

/// Waiters are only cancelled, never handed the lock, so they carry nothing.
struct NoWaiter;

impl WaiterSink for NoWaiter {
    fn is_live(&self) -> bool {
        true
    }
}

/// A table whose one key is held with `waiters` blocking acquires queued behind it, and
/// their waiter ids in a scattered order.
fn queued_table(waiters: u64) -> (LockTable<NoWaiter>, Vec<u64>) {
    let limits = TableLimits {
        held_max: 16,
        waiters_max: waiters as usize,
        waiters_per_key_max: waiters as usize,
    };
    let mut table = LockTable::with_hash_seed(limits, 0x5eed);
    let tokens = TokenAllocator::new(1, u64::MAX / 2);
    let mut events = Vec::new();
    let mut ids = Vec::with_capacity(waiters as usize);
    for n in 0..=waiters {
        let args = AcquireArgs {
            key: b"hot",
            lease_id: LeaseId::from_u128(u128::from(n)),
            ttl_ms: TTL_MS,
            wait_ms: if n == 0 { 0 } else { TTL_MS },
            waiter: (n > 0).then_some(NoWaiter),
            meta: &[],
        };
        match table.acquire(T_FILL_MS, args, &tokens, &mut events) {
            Acquire::Granted(_) => assert_eq!(n, 0),
            Acquire::Queued { waiter_id } => ids.push(waiter_id),
            _ => panic!("waiter {n} not queued"),
        }
    }
    // A stride coprime with every population: a permutation, in no order the queue knows.
    let scattered = (0..waiters).map(|i| ids[(i.wrapping_mul(0x9e37_79b1) % waiters) as usize]);
    (table, scattered.collect())
}

fn cancel_waiters(c: &mut Criterion) {
    let mut group = c.benchmark_group("waiters");
    group.sample_size(10);
    for waiters in WAITER_POPULATIONS {
        group.throughput(Throughput::Elements(waiters));
        group.bench_function(BenchmarkId::new("cancel_all", waiters), |b| {
            b.iter_batched(
                || queued_table(waiters),
                |(mut table, ids)| {
                    for id in ids {
                        assert!(table.cancel_waiter(b"hot", id));
                    }
                    assert_eq!(table.waiters_count(), 0);
                    table
                },
                BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = tenure_bench::criterion_config(Duration::from_millis(500));
    targets = cancel_waiters
}
criterion_main!(benches);
