//! Micro-benchmarks of tenure's core, run with `cargo bench -p tenure-bench`.
//!
//! The benches call the same APIs the server calls, without sockets or clocks: throughput over
//! TCP belongs to `tenure-loadgen`. Every bench keeps its measurement short (2 s, 20 samples)
//! so the whole suite runs in a few minutes on a laptop.
//!
//! # Layout
//! - `benches/codec.rs`: encoding and decoding ACQUIRE requests and GRANTED replies.
//! - `benches/table.rs`: the lock table's acquire, renew and release at 1K, 100K and 1M held
//!   locks, on fresh and on existing keys.
//! - `benches/waiters.rs`: 10K and 100K waiters on one key leaving at once (their
//!   connections closed).
//! - `benches/wheel.rs`: timer wheel insert and poll at 1K, 100K and 1M timers.
//! - `benches/wal.rs`: WAL group commit at 1 to 4096 records per commit, fsync off and on.
//! - `compare-redis.sh`: the loadgen scenarios side by side against `tenured` and Redis.
//! - [`fixtures`]: frames and keys shared by the benches.

pub mod fixtures;

use std::time::Duration;

/// The criterion settings every bench shares: a 2 s measurement of 20 samples, after
/// `warm_up` (the WAL bench warms up for less, since each of its iterations is slow).
pub fn criterion_config(warm_up: Duration) -> criterion::Criterion {
    criterion::Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(warm_up)
        .sample_size(20)
}
