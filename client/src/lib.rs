//! The Rust client of tenure, a single-node lock server: leases that tell you when they are
//! lost, fencing tokens that make a lost lease harmless, leader election, and the `tenure`
//! command line.
//!
//! A lock in tenure is a *lease*: it is yours until its TTL runs out unless you renew it. A
//! holder can always lose it (a pause, a partition) without noticing in time, so this crate
//! makes loss loud — a [`LeaseGuard`] renews in the background and fires a loss signal the
//! moment it can no longer be sure — and makes it harmless: every grant carries a *fencing
//! token*, larger than every token before it, that the protected resource checks
//! ([`fence`]).
//!
//! # Example
//! ```no_run
//! use std::time::Duration;
//! use tenure::{AcquireOptions, AcquireOutcome, Client, Fence};
//!
//! # async fn write_row(token: u64) -> std::io::Result<()> { Ok(()) }
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("127.0.0.1:7878").await?;
//! let options = AcquireOptions::wait(Duration::from_secs(10));
//! let guard = match client.lock("reports/daily", Duration::from_secs(30), options).await? {
//!     AcquireOutcome::Granted(guard) => guard,
//!     AcquireOutcome::Locked(by) => return Err(format!("held by token {}", by.token).into()),
//! };
//! let token = guard.fencing_token();
//! tokio::select! {
//!     // The work: every write carries the token; the resource rejects stale ones
//!     // (`WHERE fence <= :token`, or `Fence::try_accept` in memory).
//!     result = write_row(token) => result?,
//!     // Loss fires on a LOST renewal or when the local deadline nears unconfirmed.
//!     reason = guard.lost() => return Err(format!("lock lost: {reason}").into()),
//! }
//! guard.release().await?;
//!
//! // At the resource:
//! let fence = Fence::new();
//! fence.try_accept("reports/daily", token)?;
//! # Ok(()) }
//! ```
//!
//! # Exactly-once ACQUIRE
//! Every ACQUIRE this crate sends ([`Client::acquire`], [`Client::lock`], elections, the
//! command line) carries a fresh random acquire id. When its answer is lost (connection lost
//! or reset, no answer in time, `NOT_LEADER` from a leader stepping down, `SHUTTING_DOWN`, a
//! restart), the same ACQUIRE with the same id is sent again, to the new leader in a cluster,
//! until its wait plus [`ClientConfig::acquire_retry_for`] after the first send. The caller
//! sees one grant (a repeat's grant counted from before the first send), LOCKED, or
//! [`Error::AcquireEnded`] when that one grant has already ended: never a second lease, and
//! no orphan holding the key for its TTL (PROTOCOL.md 3.9).
//!
//! # Semaphores and read/write locks
//! [`Client::semaphore`] takes one permit of a counting semaphore (at most N holders at
//! once), [`Client::read_lock`] a read lease beside other readers and [`Client::write_lock`]
//! the key alone. Each permit and read lease is a lease of its own in the same
//! [`LeaseGuard`]: its own renewal, loss signal and fencing token. How a resource fences
//! reads as well as writes with those tokens is in [`rwlock`]; the kinds on the wire are
//! [`LeaseKind`] ([`Client::acquire_kind`]).
//! # Sessions
//! One [`Session`] keeps many locks with one background keep-alive (every third of its TTL),
//! and its end frees them all; a [`SessionGuard`] needs no renewal and reports the session's
//! loss (PROTOCOL.md 3.11). The session is server state, not a connection: in a cluster its
//! keep-alive follows the leader and the session goes on there.
//! ```no_run
//! # use std::time::Duration;
//! # use tenure::{AcquireOutcome, Client};
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("127.0.0.1:7878").await?;
//! let session = client.session(Duration::from_secs(10)).await?;
//! let (Some(a), Some(b)) = (
//!     session.lock("jobs/a").await?.granted(),
//!     session.lock("jobs/b").await?.granted(),
//! ) else {
//!     return Err("held by someone else".into());
//! };
//! tokio::select! {
//!     _ = async { /* work fenced by a.fencing_token() and b.fencing_token() */ } => {}
//!     reason = session.lost() => return Err(format!("session lost: {reason}").into()),
//! }
//! drop((a, b));
//! session.close().await?; // frees whatever is still held in it
//! # Ok(()) }
//! ```
//!
//! A server with identities wants credentials, sent as AUTH on every (re)connect:
//! `Client::connect_with(addr, ClientOptions::default().with_credentials("orders", secret))`.
//!
//! # Time
//! Every deadline, timeout, renewal timer and back-off in this crate is tokio's:
//! [`Lease::deadline`] and [`LeaseGuard::deadline`] return a [`tokio::time::Instant`] (a thin
//! wrapper over [`std::time::Instant`]; `into_std()` converts), and the waits are
//! `tokio::time::sleep_until` and `timeout`. In a program this is the monotonic clock; in a
//! test whose runtime clock is paused (`#[tokio::test(start_paused = true)]`,
//! `tokio::time::advance`) it is virtual time, so expiry, renewal and loss can be tested
//! without waiting for them.
//!
//! # Layout
//! Each module's job and the modules it may import, lowest layer first. The table is kept by
//! a test (`client/tests/it/layout.rs`) that reads every module's `crate::` paths and fails
//! on an import not listed here, on a listed one nobody uses, and on a cycle; public types
//! are re-exported here (and from [`client`], where they lived before) from the module that
//! owns them.
//!
//! | module | its job | may import |
//! |--------|---------|------------|
//! | `error` | [`Error`], every way a request can fail | — |
//! | `fence` | [`Fence`] and [`SequencedFence`], the resource-side check, with the SQL pattern | — |
//! | `cluster` | the cluster's vocabulary (members, status) and a membership change's time-out | — |
//! | `tls` | [`TlsOptions`]: roots, client certificate, server name | `error` |
//! | `options` | [`ClientConfig`] with [`Credentials`], [`AcquireOptions`]: what requests are made with | `tls` |
//! | `outcome` | what answers mean: [`RenewOutcome`], [`KeyState`], [`WatchEvent`], ... | `error` |
//! | `conn` | one connection: handshake, writer and reader tasks, request ids, watch routing | `error`, `outcome`, `tls` |
//! | `router` | the connection manager: endpoints, reconnection, `NOT_LEADER` redirects, time-outs | `conn`, `error`, `options`, `outcome` |
//! | `lease` | [`Lease`] with a local deadline that never over-estimates, [`LeaseGuard`], [`AcquireOutcome`] | `conn`, `error`, `outcome`, `router` |
//! | `watch` | [`Watch`], the stream of one key's changes | `conn`, `error`, `outcome`, `router` |
//! | `client` | [`Client`]: the typed requests (acquire, lock, renew, watch, cluster admin) | `cluster`, `error`, `lease`, `options`, `outcome`, `router`, `watch` |
//! | `semaphore` | [`Client::semaphore`], [`Client::inspect_kinds`] and [`KindsState`]: permits of a counting semaphore | `client`, `error`, `lease`, `options`, `outcome` |
//! | `rwlock` | [`Client::read_lock`] and [`Client::write_lock`], and how a resource fences reads and writes | `client`, `error`, `lease`, `options` |
//! | `election` | [`Election`], [`Leadership`], [`Observer`]; [`Client::campaign`] and [`Client::observe`] | `client`, `error`, `lease`, `options`, `outcome`, `watch` |
//! | `session` | [`Session`]: one keep-alive for many locks, [`SessionGuard`]; [`Client::session`] | `client`, `error`, `lease`, `options`, `outcome`, `router` |
//!
//! A request goes down the table: [`Client`] builds it, `router` picks the connection and
//! follows redirects, `conn` frames it and matches the reply, and the answer comes back up as
//! an `outcome` (or a [`Lease`], which keeps a `router` handle to renew and release). Also:
//! - [`duration`]: `30s`/`500ms`/`2m` parsing, re-exported from `tenure_protocol`: one parser
//!   for every command line of the project.
//! - `fake` (tests only): a scripted stand-in server for behaviour a real one will not show
//!   on demand (renewals that hang, slow answers, odd handshakes).
//! - `src/bin/tenure/`: the `tenure` command line, built with the `cli` feature (on by
//!   default; `default-features = false` leaves out clap, anyhow and serde_json).
//!
//! # The `tenure` command line
//! `tenure [--addr HOST:PORT] [--json] COMMAND`, with `--addr` defaulting to `$TENURE_ADDR` or
//! `127.0.0.1:7878`. Commands: `acquire`, `renew`, `release`, `inspect`, `check`, `stats`,
//! `ping`, `run` (hold a lock while a command runs), `elect` (run a command while leading),
//! `observe` (print each new leader) and `console` (the server's text-console grammar, read
//! from stdin, `SHARED`, `PERMITS=` and `INSPECT <key> KINDS` included); `acquire` and `run`
//! take `--permits [COUNT/]LIMIT` (semaphore permits) or `--shared` (a read lease), and
//! `inspect --kinds` shows a key's holders and waiters by kind. Output is one line of `key=value` pairs per answer, with the text console's
//! field names (`token`, `lease`, `ttl_ms`, `waited_ms`), or JSON with `--json`. Durations
//! need a unit (`30s`, `500ms`; see [`duration`]). The command line is the `cli` feature, on
//! by default; depend on the library with `default-features = false` to leave it out.
//!
//! | exit code | meaning                                                        |
//! |-----------|----------------------------------------------------------------|
//! | 0         | success (for `run`/`elect`: the command's own status)          |
//! | 1         | error: I/O, server error, bad arguments                        |
//! | 3         | LOCKED: someone else holds the lock                            |
//! | 4         | LOST: the lease is gone (for `run`/`elect`: lost while running; for `acquire`: ENDED, a retried ACQUIRE whose lease had ended) |
//! | 5         | NOT_OWNER: release by a lease id that does not hold the lock   |
//! | 6         | STALE: the token does not belong to the live holder            |
//!
//! `run` and `elect` exit with the command's status, or 128 + the signal number when a signal
//! killed it.

pub mod client;
pub mod cluster;
mod conn;
pub mod election;
pub mod error;
pub mod fence;
pub mod lease;
mod options;
mod outcome;
mod router;
pub mod rwlock;
pub mod semaphore;
pub mod session;
pub mod tls;
mod watch;

pub use bytes::Bytes;
pub use client::Client;
pub use election::{Election, ElectionOptions, Leader, Leadership, Observer};
pub use error::{Error, Result};
pub use fence::{Fence, Rejected, SequenceRejected, SequencedFence};
pub use lease::{AcquireOutcome, KeepAliveOptions, Lease, LeaseGuard, LossReason};
pub use options::{
    AcquireOptions, ClientConfig, ClientOptions, Credentials, ACQUIRE_RETRY_FOR_DEFAULT,
};
pub use outcome::{CheckOutcome, KeyState, LockedBy, ReleaseOutcome, RenewOutcome, WatchEvent};
pub use semaphore::KindsState;
pub use session::{Session, SessionGuard, SessionOptions};
pub use tenure_protocol::handshake::ServerLimits;
pub use tenure_protocol::kind::{HolderKinds, LeaseKind};
pub use tenure_protocol::{
    duration, AcquireId, EndedHow, ErrorCode, EventKind, LeaseId, SessionId,
};
pub use tls::TlsOptions;
pub use watch::Watch;

#[cfg(test)]
mod fake;
