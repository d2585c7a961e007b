//! Encoding and decoding the two hottest frames: ACQUIRE (client to server) and GRANTED (back).
//!
//! Decoding runs over a batch of frames back to back, as a server reads them from a pipelined
//! connection: `split_frame` then `decode_request` / `decode_response`, the same calls the
//! codec adapters make.

use std::hint::black_box;
use std::time::Duration;

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tenure_bench::fixtures;
use tenure_protocol::frame::{
    decode_request, decode_response, encode_request, encode_response, split_frame,
};

/// Frames per decode batch: about what one 64 KiB read of a pipelined connection holds.
const BATCH: u64 = 1024;

fn encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec/encode");
    group.throughput(Throughput::Elements(1));
    let acquire = fixtures::acquire(123_456_789);
    let granted = fixtures::granted(123_456_789);
    let mut out = BytesMut::with_capacity(64 * 1024);
    group.bench_function("acquire", |b| {
        b.iter(|| {
            if out.len() > 60 * 1024 {
                out.clear();
            }
            encode_request(black_box(7), black_box(&acquire), &mut out);
        })
    });
    group.bench_function("granted", |b| {
        b.iter(|| {
            if out.len() > 60 * 1024 {
                out.clear();
            }
            encode_response(black_box(7), black_box(&granted), &mut out);
        })
    });
    group.finish();
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec/decode");
    group.throughput(Throughput::Elements(BATCH));
    let acquires = fixtures::acquire_frames(BATCH);
    group.bench_function("acquire", |b| {
        b.iter_batched_ref(
            || acquires.clone(),
            |src| {
                while let Some((opcode, id, body)) = split_frame(src).expect("valid frames") {
                    black_box((id, decode_request(opcode, body).expect("valid acquire")));
                }
            },
            BatchSize::SmallInput,
        )
    });
    let grants = fixtures::granted_frames(BATCH);
    group.bench_function("granted", |b| {
        b.iter_batched_ref(
            || grants.clone(),
            |src| {
                while let Some((opcode, id, body)) = split_frame(src).expect("valid frames") {
                    black_box((id, decode_response(opcode, body).expect("valid granted")));
                }
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = tenure_bench::criterion_config(Duration::from_millis(500));
    targets = encode, decode
}
criterion_main!(benches);
