//! [`ServerError`]: why [`crate::run`] could not start, or could not stop cleanly.

use std::path::PathBuf;

use crate::journal::JournalError;
use crate::wal::WalError;

/// What ends [`crate::run`] with an error. Each variant names what failed and where; the
/// binary prints it (with its sources) and exits non-zero.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A setting is out of range, or settings contradict each other.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A non-loopback address without identities (and without `insecure_no_auth`).
    #[error(
        "refusing to serve {0} (--listen) without identities: anyone who can reach it could take and \
         release every lock. Set up identities: hash a secret with `tenured hash-secret` \
         (it reads the secret on stdin), put it in a TOML file ([[identity]] name = \"...\" \
         secret-hash = \"...\" prefixes = [\"*\"]) and start with --identities FILE; or listen on \
         127.0.0.1; or, knowing the risk, pass --insecure-no-auth"
    )]
    NoIdentities(std::net::SocketAddr),
    /// The TLS certificate, key or client CA could not be read or used.
    #[error("{0}")]
    Tls(String),
    /// The identities file could not be read or is invalid.
    #[error("{0}")]
    Identities(String),
    /// The data directory or its `LOCK` file could not be created, opened or locked.
    #[error("{what} {}: {source}", path.display())]
    DataDir {
        /// What was being done ("cannot create", "cannot open", "cannot lock").
        what: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Another `tenured` holds the data directory's lock: two servers appending to one log
    /// would hand out the same fencing tokens.
    #[error("{} is in use by another tenured process", .0.display())]
    DataDirInUse(PathBuf),
    /// The data directory holds the other kind of server's files (`found` is one): a
    /// cluster node does not read a single node's WAL, nor a single node a cluster's log.
    #[error(
        "{} holds {} ({found}): {}",
        dir.display(),
        if *cluster { "a single-node server's state" } else { "a cluster node's state" },
        if *cluster {
            "a cluster node keeps its state in its Raft log and would not see those leases, and \
             would hand out fencing tokens below theirs; give a cluster node a fresh --data-dir \
             (server/CLUSTER.md)"
        } else {
            "start it with --cluster, or give a single node a fresh --data-dir"
        }
    )]
    DataDirOfOtherMode {
        /// The data directory.
        dir: PathBuf,
        /// One of the files that tells.
        found: String,
        /// Whether a cluster node was being started on it.
        cluster: bool,
    },
    /// The write-ahead log could not be opened or replayed (a corrupt log names the file
    /// and offset).
    #[error("cannot open the write-ahead log in {}: {source}", dir.display())]
    Recovery {
        /// The log's directory.
        dir: PathBuf,
        /// Why.
        source: WalError,
    },
    /// Recovery panicked (a bug); nothing was served.
    #[error("WAL recovery panicked")]
    RecoveryPanicked(#[source] tokio::task::JoinError),
    /// The first block of fencing tokens could not be made durable, so no grant can be made.
    #[error("could not sync the first block of fencing tokens: {0}")]
    FirstReservation(#[source] JournalError),
    /// A thread of the per-core runtime model could not be started (its runtime, its
    /// listener's registration or the thread itself).
    #[error("cannot start the per-core threads: {0}")]
    PerCore(#[source] std::io::Error),
    /// The final sync at shutdown failed: some acknowledged change may not be durable.
    #[error("final WAL sync failed: {0}")]
    FinalSync(#[source] JournalError),
}
