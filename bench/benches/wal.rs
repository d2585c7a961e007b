//! The write-ahead log: appending grant records and group commit (append a batch, wait until
//! it is durable) at several batch sizes, with fsync off and on, in a temporary directory.
//!
//! With fsync on, the figures are the disk's: one `fdatasync` per commit, so bigger batches
//! amortize it. With fsync off they show the log's own CPU cost per record.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tenure_server::wal::{self, Record, SyncMode, WalOptions};

/// Records per commit benchmarked.
const BATCHES: [u64; 4] = [1, 16, 256, 4096];

fn grant(n: u64, key: &[u8; 14]) -> Record<'_> {
    Record::Grant {
        key,
        lease_id: (u128::from(n) << 1 | 1).to_be_bytes(),
        token: n + 1,
        ttl_ms: 30_000,
        flags: 0,
        meta: &[],
        acquire_id: None,
        session_id: None,
        kind: Default::default(),
    }
}

/// `job:` and `n` in ten zero-padded digits, without allocating.
fn key_bytes(n: u64) -> [u8; 14] {
    let mut key = *b"job:0000000000";
    let mut rest = n;
    for digit in key[4..].iter_mut().rev() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    key
}

fn wal(c: &mut Criterion) {
    for (mode, name) in [(SyncMode::Off, "fsync_off"), (SyncMode::Data, "fsync_on")] {
        let mut group = c.benchmark_group(format!("wal/{name}"));
        let dir = tempfile::tempdir().expect("temporary directory");
        let options = WalOptions {
            sync_mode: mode,
            ..WalOptions::default()
        };
        let (log, _recovered) = wal::open(dir.path(), options).expect("open WAL");
        let mut n = 0u64;
        for batch in BATCHES {
            group.throughput(Throughput::Elements(batch));
            group.bench_function(BenchmarkId::new("group_commit", batch), |b| {
                b.iter(|| {
                    for _ in 0..batch {
                        let key = key_bytes(n);
                        log.append(&grant(n, &key)).expect("append");
                        n += 1;
                    }
                    log.flush().expect("commit")
                })
            });
        }
        group.finish();
        log.sync_and_stop().expect("stop WAL");
    }
}

criterion_group! {
    name = benches;
    config = tenure_bench::criterion_config(Duration::from_millis(300));
    targets = wal
}
criterion_main!(benches);
