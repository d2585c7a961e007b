//! The server's integration tests, one test binary (one link, one process start per run):
//! - `acquire_ids`: an ACQUIRE's reply lost to `kill -9` of the real `tenured`, retried with
//!   its acquire id after the restart;
//! - `client_retry`: the Rust client's ACQUIRE retried with its acquire id after a reply
//!   lost to `kill -9` (single node and cluster leader), through a proxy that drops it;
//! - `client_sessions`: the Rust client's sessions kept alive through `kill -9` and restart of
//!   the real `tenured`, and through the cluster leader's `kill -9`;
//! - `auth`: identities, AUTH, permissions, quotas, reload on SIGHUP, `hash-secret`, and the
//!   loopback-only default;
//! - `cluster`: three `tenured --cluster` daemons, `cluster-init`, `kill -9` of the leader;
//! - `cluster_metrics`: `/metrics`, `/readyz` and the deploy files on cluster nodes, the
//!   security digests in CLUSTER STATUS and the metrics;
//! - `cluster_security`: identities, quotas, TLS and the admin permission on a cluster;
//! - `e2e`: console and binary protocol over real TCP, hand-off, expiry, limits, restarts,
//!   and `kill -9` and SIGTERM of the real `tenured` binary;
//! - `faults`: crashes, a damaged log and a failing disk (see that module);
//! - `lifecycle`: the handshake, its time limit, keepalive, broken frames, shutdown;
//! - `limits`: the server-wide limits, exact at the default shard count;
//! - `locked`: LOCKED to a wait that ran out while no lease held the key, single node and
//!   cluster leader;
//! - `metrics`: `/metrics` (through `promtool`), `/healthz`, `/readyz`, the HTTP limits, and
//!   the shipped dashboard and alert rules;
//! - `nemesis`: three cluster daemons under load and faults, the history checked;
//! - `protocol_doc`: every example in PROTOCOL.md, read from it and sent to a server;
//! - `session_restarts`: sessions and their leases across `kill -9` of the real `tenured`;
//! - `per_core`: `--runtime per-core`: threads, hand-off across them, shared limits, shutdown;
//! - `settings`: the binary's flags, environment, config file, logs and deployment files;
//! - `tls`: TLS and mutual TLS, plain text to a TLS port, certificate rotation;
//! - `watch`: watches and the protocol rules clients rely on.
//!
//! The harness (servers in process and as daemons, console and binary clients, reply
//! parsing) is the `tenure-testkit` crate's. Tests about time (expiry, waits, `waited_ms`,
//! time limits) run on a paused clock with the server in the test's runtime
//! ([`tenure_testkit::Server::start_virtual`]); the rest run in real time with bounds in
//! seconds.

mod acquire_ids;
mod auth;
mod client_retry;
mod client_sessions;
mod cluster;
mod cluster_metrics;
mod cluster_security;
mod e2e;
mod faults;
mod lifecycle;
mod limits;
mod locked;
mod metrics;
mod nemesis;
mod per_core;
mod protocol_doc;
mod session_restarts;
mod sessions;
mod settings;
mod shared;
mod tls;
mod watch;

use std::path::Path;

use tenure_testkit::{Daemon, Tenured};

/// The `tenured` binary cargo built for these tests.
fn tenured_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tenured"))
}

/// Starts the real `tenured` (fsync on unless `args` say otherwise) on a free port, data in
/// `dir`, its log discarded; it is killed with SIGKILL when dropped.
fn tenured(dir: &Path, args: &[&str]) -> Daemon {
    Daemon::start(Tenured {
        bin: tenured_bin(),
        dir,
        logs: None,
        args,
    })
}
