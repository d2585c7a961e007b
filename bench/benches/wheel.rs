//! The timer wheel behind expiry: inserting leases' timers and polling them when due, at 1K,
//! 100K and 1M timers with deadlines spread over a 30 s TTL, as the lock table uses it.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use tenure_server::wheel::TimerWheel;

/// Timer counts benchmarked.
const POPULATIONS: [u64; 3] = [1_000, 100_000, 1_000_000];
/// Deadlines spread over this span, milliseconds (the estimate's 30 s TTL).
const SPAN_MS: u64 = 30_000;
/// Most timers one poll may return, as the server's expiry pass would ask.
const POLL_BUDGET: usize = 4_096;

/// The deadline of timer `i` of `count`: evenly spread over the span, in scattered order.
fn deadline_ms(i: u64, count: u64) -> u64 {
    1 + (i.wrapping_mul(0x9e37_79b1) % count) * SPAN_MS / count
}

fn filled(count: u64) -> TimerWheel<u64> {
    let mut wheel = TimerWheel::new();
    for i in 0..count {
        wheel.insert(deadline_ms(i, count), i);
    }
    wheel
}

fn wheel(c: &mut Criterion) {
    let mut group = c.benchmark_group("wheel");
    for count in POPULATIONS {
        group.throughput(Throughput::Elements(count));
        group.bench_function(BenchmarkId::new("insert", count), |b| {
            b.iter_batched(
                TimerWheel::<u64>::new,
                |mut wheel| {
                    for i in 0..count {
                        wheel.insert(deadline_ms(i, count), i);
                    }
                    wheel
                },
                BatchSize::LargeInput,
            )
        });
        // Expire every timer by polling once per millisecond of the span, in bounded passes,
        // as the server's ticker does: at 1K timers the 30,000 polls themselves dominate.
        group.bench_function(BenchmarkId::new("poll_all", count), |b| {
            b.iter_batched(
                || (filled(count), Vec::with_capacity(POLL_BUDGET)),
                |(mut wheel, mut out)| {
                    for now_ms in 1..=SPAN_MS + 1 {
                        while wheel.poll(now_ms, POLL_BUDGET, &mut out) == POLL_BUDGET {
                            black_box(&out);
                            out.clear();
                        }
                        out.clear();
                    }
                    assert!(wheel.is_empty());
                    wheel
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
    targets = wheel
}
criterion_main!(benches);
