//! tenured: a lock server whose fencing tokens survive crashes, on one node or as a Raft cluster.
//!
//! Clients take a lock on a key for a lease (a TTL) and get back a lease id, which renew and
//! release must present, and a fencing token, which strictly increases per key across
//! restarts and `kill -9`: the protected resource rejects writes carrying an older token.
//! Expiry is judged by the server's monotonic clock alone.
//!
//! # Layout
//! - [`server`]: [`run`] — recovery, the accept loop, the expiry ticker, ordered shutdown.
//! - [`per_core`]: the per-core runtime model ([`run_per_core`]): a thread, a current-thread
//!   runtime and an `SO_REUSEPORT` listener per core.
//! - [`error`]: [`ServerError`], why `run` could not start or stop cleanly.
//! - [`conn`]: one connection, binary or console, its reply queue and its [`conn::Session`].
//! - [`console`]: the text console's grammar, line in and line out.
//! - [`executor`]: request in, table call, outcome out; the one executor both surfaces call.
//!   `executor::sim` (tests only): a seeded simulation of executor, journal and restarts.
//! - [`journal`]: "durable before visible": what is logged, waiting for it, undo on failure;
//!   [`journal::WalJournal`] is its local implementation.
//! - [`handoff`]: giving a freed lock to the next waiter, and every free on the way there.
//! - [`table`]: the lock table (one shard): holders, FIFO waiters, hand-off. No I/O, no clock.
//!   `table::sim` (tests only): a seeded simulation of the table against a naive model.
//! - [`wheel`]: the hierarchical timer wheel behind expiry. No I/O, no clock.
//! - [`tokens`]: the fencing token allocator, bounded by a durable reservation, and that
//!   reservation.
//! - [`wal`]: the write-ahead log: record format, group commit, recovery, snapshots.
//! - [`watch`]: subscriptions to a key's changes, and WATCH/UNWATCH.
//! - [`clock`]: the one place that reads time.
//! - [`tls`]: TLS on the client port, mutual TLS, reload on SIGHUP.
//! - [`identity`]: identities, their permissions and quotas, from `--identities`.
//! - [`admission`]: bounds on connections that have not authenticated yet (per address and
//!   in all), the oldest evicted first.
//! - [`config`]: every runtime limit. [`stats`]: counters and the STATS reply.
//! - [`metrics`]: Prometheus instruments and the scrape; [`http`]: `/metrics`, `/healthz`,
//!   `/readyz` on `--metrics-listen`.

pub mod accept;
pub mod admission;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod conn;
pub mod console;
pub mod error;
pub mod executor;
pub mod http;
pub mod identity;
pub mod journal;
pub mod linger;
pub mod log_limit;
pub mod memory;
pub mod obs;
pub mod record;
pub mod scrape;
pub mod serve;
pub mod startup;
pub mod table;
pub mod tls;
pub mod wal;
pub mod wheel;

pub use config::{Config, Durability};
pub use error::ServerError;
pub use serve::per_core;
pub use serve::{run, run_per_core, run_with_metrics, run_with_storage};

#[cfg(test)]
mod layout_tests;
