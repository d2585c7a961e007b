//! tenured: a lock server whose fencing tokens survive crashes, on one node or as a Raft cluster.
//!
//! Clients take a lock on a key for a lease (a TTL) and get back a lease id, which renew and
//! release must present, and a fencing token, which strictly increases per key across
//! restarts and `kill -9`: the protected resource rejects writes carrying an older token.
//! Expiry is judged by the server's monotonic clock alone.
//!
//! # Layout
//! Top-level modules from the bottom up; each imports only the modules it lists (the
//! import-rules test, `layout_tests.rs`, fails on any other `crate::` path, and on a cycle).
//! - [`clock`]: the one place that reads time. Imports nothing of the crate.
//! - [`wheel`]: the hierarchical timer wheel behind expiry; no I/O, no clock. Nothing.
//! - [`record`]: the durability vocabulary: [`record::Change`], [`record::Lease`],
//!   [`record::FreeReason`], the record and segment-header codec, [`record::Lsn`],
//!   [`record::DurableState`], the replay rules and [`record::RecoveredLease`]. Nothing.
//! - [`obs`]: instruments only: STATS counters and Prometheus histograms, bumped by the layers
//!   that are handed them. Nothing.
//! - [`identity`]: identities, their permissions and quotas, from `--identities`. Imports
//!   `log_limit` (a failed AUTH's log line is sampled).
//! - [`admission`]: bounds on connections not yet authenticated. Nothing.
//! - [`console`]: the text console's grammar, line in and line out. Nothing.
//! - [`memory`], [`log_limit`], [`linger`]: allocator purges, log rate limits, closing a
//!   socket without losing the error just written. Nothing.
//! - [`table`]: the lock table (one shard) and its [`table::TokenAllocator`]; no I/O, no
//!   clock, no tokio. Imports `wheel`. `table::sim` (tests): the table against a model.
//! - [`tls`]: TLS on the client port, mutual TLS, reload. Imports `linger`.
//! - [`wal`]: the write-ahead log: group commit, recovery, snapshots. Imports `record`, `obs`.
//! - [`config`]: every runtime limit. Imports `tls`, `wal` (file and segment settings).
//! - [`journal`]: "durable before visible": the [`journal::Journal`] contract, tickets and
//!   their settling, and [`journal::WalJournal`]. Imports `config`, `record`, `wal`.
//! - [`error`]: [`ServerError`], why `run` could not start or stop. Imports `journal`, `wal`.
//! - [`executor`]: request in, table call, outcome out; owns hand-off, undo, watches,
//!   sessions, tokens, the STATS reply and the ticker; built once from
//!   [`executor::ExecutorParts`]. Imports `clock`, `config`, `identity`, `journal`, `obs`,
//!   `record`, `table`. `executor::sim` (tests): executor, journal and restarts, seeded.
//! - [`conn`]: one connection, binary or console: reads, decodes, hands requests to the
//!   executor, waits on tickets, writes replies. Imports `admission`, `config`, `console`,
//!   `executor`, `identity`, `journal`, `linger`, `obs`; never `wal`, `serve` or `cluster`
//!   (CLUSTER requests go to the executor's [`executor::ClusterAdmin`]).
//! - [`scrape`]: `/metrics`' series and `/readyz`, read from the executor serving now.
//!   Imports `executor`, `identity`, `obs`.
//! - [`http`]: `/metrics`, `/healthz`, `/readyz` on `--metrics-listen`. Imports `scrape`.
//! - [`startup`]: what serving needs in both modes: the data directory's lock, TLS files,
//!   identities and their SIGHUP reload. Imports `config`, `error`, `identity`, `tls`.
//! - [`accept`]: the one accept loop of both modes. Imports `admission`, `config`, `conn`,
//!   `executor`, `obs`, `tls`.
//! - [`serve`]: the single node's composition root: [`run`], recovery, the per-core model
//!   ([`per_core`], [`run_per_core`]). Imports `accept`, `clock`, `config`, `error`,
//!   `executor`, `http`, `identity`, `journal`, `memory`, `scrape`, `startup`, `tls`, `wal`.
//! - [`cluster`]: the Raft cluster node, the other composition root, a sibling of `serve`:
//!   it implements [`journal::Journal`] and [`executor::ClusterAdmin`]. Imports `accept`,
//!   `clock`, `config`, `error`, `executor`, `http`, `identity`, `journal`, `log_limit`, `obs`,
//!   `record`, `scrape`, `startup`, `tls`, `wal`.
//!
//! # One ACQUIRE, socket to reply
//! In order, each file once (a single node, durability `full`, binary protocol):
//! 1. `accept.rs`: `accept_loop_shared` accepts, counts, sets keepalive; `serve_accepted`.
//! 2. `conn/mod.rs`: `serve` opens the connection; `Conn::run` reads into its buffer, and
//!    after the replies are encoded, writes them.
//! 3. `conn/requests.rs`: `handle_input` takes each request, `on_request` checks identity,
//!    `execute` calls the executor.
//! 4. `conn/surface.rs`: `decode` the frame (and later `encode` the reply).
//! 5. `executor/mod.rs`: `Executor::execute` → `run` → `acquire`.
//! 6. `executor/acquire.rs`: locks the key's shard, asks the table, appends the grant's
//!    [`record::Change`] to the journal under the shard lock: `Outcome::Changed`.
//! 7. `table/mod.rs`: `LockTable::acquire` finds the key's slot or none.
//! 8. `table/lease.rs`: `grant_free` takes a slot and a fencing token
//!    (`table/tokens.rs`' `try_next`, one compare-and-swap).
//! 9. `journal/mod.rs`: the `Journal::append` contract, the ticket, `settle`.
//! 10. `journal/wal.rs`: `WalJournal::append` hands the record to the WAL.
//! 11. `wal/writer.rs`: `Wal::append` queues it for group commit; the syncer thread
//!     (`wal/syncer.rs`) writes, fsyncs and publishes the durable LSN.
//! 12. `conn/reply.rs`: the reply waits in the queue; `flush_ready` settles it against the
//!     journal's progress and encodes it; `Conn::run` writes it.

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
