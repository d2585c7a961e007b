//! Test support for the tenure workspace, shared by the integration tests of every crate: one
//! copy of each harness instead of one per test file. Dev-only (`publish = false`).
//!
//! - [`server`]: a server in the test's own runtime ([`Server`], also on a paused clock), and
//!   one in a runtime of its own that a test can kill ([`ThreadServer`]).
//! - [`daemon`]: the real `tenured` binary, for `kill -9` and signals ([`Daemon`]).
//! - [`nemesis`]: a three-node cluster of daemons behind a peer proxy, under load and faults,
//!   and a checker of the client-side history.
//! - [`console`]: text-console clients, async ([`Console`]) and blocking ([`LineConn`]).
//! - [`raw`]: a bare binary-protocol client ([`Raw`]) and request builders.
//! - [`imports`]: the reader and checker behind each crate's import-rules test.
//! - [`lossy`]: a proxy that throws away a GRANTED reply, for exactly-once ACQUIRE tests.
//! - [`reply`]: `key=value` parsing of console and command-line output ([`field`], [`token`]).

pub mod console;
pub mod daemon;
pub mod imports;
pub mod lossy;
pub mod nemesis;
pub mod raw;
pub mod reply;
pub mod server;
pub mod tls;

use std::time::Duration;

pub use console::{Console, LineConn};
pub use daemon::{free_port, signal, Daemon, Tenured};
pub use raw::Raw;
pub use reply::{field, token};
pub use server::{Server, ThreadServer};
pub use tls::TestCa;

/// Generous bound on anything that should take a few round trips: a slow, loaded machine
/// must not fail a test, so no test bounds time tighter than this in real time.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Shorthand for a duration in milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}
