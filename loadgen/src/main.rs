//! `tenure-loadgen`: drives a tenure server (or Redis, for comparison) with lock workloads and
//! reports throughput and latency from HDR histograms.
//!
//! # Scenarios
//! - `estimate` (default): the sizing estimate, open loop. Acquires arrive at `--rate`; each lock
//!   is held `--hold`, renewed every `--renew-every` with `--ttl`, then released. After a ramp of
//!   `--hold` (locks held climb to rate x hold) and `--warmup`, `--duration` is measured. The
//!   defaults are 50,000 acquires/s, 10 s holds, 30 s TTL renewed every 10 s: 500,000 locks held
//!   and 150,000 ops/s. Latency counts from each op's intended send time.
//! - `max`: closed loop at `--connections` x `--pipeline` for one `--op`: `acquire` (random keys
//!   of `--keys`, grants and refusals apart), `mixed` (acquire, renew, release cycles),
//!   `renew`, `release`, `ping`.
//! - `contention`: `--clients` on `--keys` hot keys with blocking acquires (`--wait`) and short
//!   holds; hand-off latency and fairness (Jain's index over per-client grants).
//!
//! - `semaphore`: the contention loop on `--keys` semaphore keys of `--permits [COUNT/]LIMIT`
//!   (default one of 4 permits), each grant held `--hold`: grants/s, hand-off latency, waits,
//!   and the most permits the clients held at once on a key (never over LIMIT: a break is
//!   counted in `exclusion_breaks`).
//! - `read-mostly`: the contention loop on `--keys` read/write keys, each ACQUIRE a read lease
//!   or, with probability `--write-ratio` (default 0.05), a write: grants/s, hand-off
//!   latency, and reader and writer wait percentiles apart (`read_wait_*`, `write_wait_*`).
//!
//! With `--permits [COUNT/]LIMIT` every tenure ACQUIRE of the run asks for permits of a
//! counting semaphore of LIMIT permits, with `--shared` for a read lease (PROTOCOL.md 3.10),
//! so each scenario measures semaphore or read-lock cycles: `--scenario semaphore` is
//! `contention --permits 4`, `--scenario max --op mixed --shared` read-lock cycles.
//!
//! # Targets
//! `tenure://HOST:PORT` speaks the binary protocol; `redis://HOST:PORT` runs the same workloads
//! with the usual Redis recipes (SET NX PX, compare-and-delete and compare-and-pexpire scripts,
//! and with `--redis-fenced` an acquire script that also returns a per-key fencing counter).
//! `etcd://HOST:PORT` runs them against etcd's v3 JSON gateway with the cycle of etcd's own lock
//! (lease grant and create-if-absent txn, keep-alive, revoke). Several addresses,
//! `tenure://a,b,c` or `etcd://a,b,c`, name a cluster: tenure's serving member is found first;
//! etcd's connections are spread over its members. `--scenario healthy` waits until a cluster
//! is healthy; `--scenario failover --pids ...` kills its leader and times the next grant.
//! Targets must be on loopback unless `--allow-remote` is given. A tenure target with TLS
//! (`--tls-ca`, optionally `--tls-server-name` and `--tls-client-cert`/`--tls-client-key`) or
//! identities (`--identity NAME`, the secret in `TENURE_SECRET`) is loaded as a client would
//! connect to it; each connection's setup cost (TLS, handshake, AUTH) is in the report.
//!
//! # Examples
//! ```text
//! tenure-loadgen                                         # the estimate against 127.0.0.1:7878
//! tenure-loadgen --rate 20000 --hold 5s --renew-every 5s --duration 20s --server-pid 1234
//! tenure-loadgen --scenario max --op mixed --connections 50 --pipeline 16 --duration 10s
//! tenure-loadgen --scenario contention --clients 200 --keys 4 --hold 1ms
//! tenure-loadgen --scenario semaphore --clients 200 --keys 4 --hold 1ms --permits 8
//! tenure-loadgen --scenario read-mostly --clients 200 --keys 16 --hold 1ms --write-ratio 0.05
//! tenure-loadgen --scenario max --op mixed --connections 50 --shared --keys 1000
//! tenure-loadgen --target redis://127.0.0.1:6379 --scenario max --op acquire --redis-fenced
//! tenure-loadgen --json ... > report.json                # progress stays on stderr
//! ```
//!
//! # Layout
//! Each module's job and the modules it may import, lowest layer first. The table is kept by
//! a test (`loadgen/tests/it/layout.rs`) that reads every module's `crate::` paths and fails
//! on an import not listed here, on a listed one nobody uses, and on a cycle.
//!
//! | module | its job | may import |
//! |--------|---------|------------|
//! | `op` | the shared vocabulary: ops, outcomes, key names | — |
//! | `procfs` | RSS and CPU ticks of a process, from `/proc` | — |
//! | `tls` | TLS to a tenure target: roots, client certificate | — |
//! | `wire` | tenure's codec: hand-written request frames, replies to outcomes, limits | `op` |
//! | `resp` | the Redis codec: RESP2 and the lock recipes | `op` |
//! | `etcd` | the etcd codec: the lock cycle over the v3 JSON gateway (HTTP/1.1) | `op` |
//! | `proto` | the dispatcher: one connection's protocol, over the three codecs | `etcd`, `op`, `resp`, `wire` |
//! | `stats` | counters and HDR histograms per op kind | `op` |
//! | `report` | the report, as text or JSON | `op`, `stats` |
//! | `args` | flags, defaults per scenario, limits, the long help | `wire` |
//! | `target` | target parsing, the loopback rule, TLS and credentials from the flags, connecting, handshakes and AUTH | `args`, `etcd`, `proto`, `resp`, `tls` |
//! | `conn` | one pipelined connection's state: in-flight slab, backlog, output buffer | `op`, `proto` |
//! | `scenario` | the workloads: what to send and when | `args`, `conn`, `op`, `report`, `stats` |
//! | `world` | the state a run's tasks share, and how bytes, ticks and the start move it | `conn`, `scenario`, `stats` |
//! | `socket` | each connection's reader and writer tasks | `conn`, `world` |
//! | `progress` | the once-a-second line on stderr | `op`, `world` |
//! | `cluster` | finding a leader, health, fail-over timing | `args`, `etcd`, `op`, `target` |
//! | `run` | the driver: connect, place the measured window, report | `args`, `cluster`, `conn`, `procfs`, `progress`, `report`, `scenario`, `socket`, `stats`, `target`, `world` |
//!
//! `main` parses the flags and calls `run` (or `cluster` for `healthy` and `failover`).

mod args;
mod cluster;
mod conn;
mod etcd;
mod op;
mod procfs;
mod progress;
mod proto;
mod report;
mod resp;
mod run;
mod scenario;
mod socket;
mod stats;
mod target;
mod tls;
mod wire;
mod world;

use std::process::ExitCode;

use clap::Parser;

// mimalloc: the load generator allocates little on its hot path, but connection buffers and
// histograms churn at start and end; it matches the server's allocator so both sides compare.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = match args::Args::parse().resolve() {
        Ok(args) => args,
        Err(e) => return fail(e),
    };
    let json = args.json;
    if matches!(
        args.scenario,
        args::Scenario::Failover | args::Scenario::Healthy
    ) {
        return match cluster::run_blocking(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(e),
        };
    }
    match run::run_blocking(args) {
        Ok(report) if json => println!("{}", report.json()),
        Ok(report) => print!("{}", report.text()),
        Err(e) => return fail(e),
    }
    ExitCode::SUCCESS
}

/// One line naming the cause chain; no backtrace, since these are operating errors.
fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("tenure-loadgen: {e:#}");
    ExitCode::FAILURE
}
