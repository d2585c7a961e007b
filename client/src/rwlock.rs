//! Read/write locks (PROTOCOL.md 3.10): [`Client::read_lock`] takes a read lease beside other
//! readers, [`Client::write_lock`] the key alone (a plain exclusive lease, so a plain
//! [`Client::lock`] of the key is its write side too).
//!
//! Each read lease is a lease of its own, in the lock's [`LeaseGuard`]: its own lease id,
//! renewal, release, loss signal and fencing token. Queueing is strictly first in, first out:
//! a writer in line stops every reader that comes after it (no writer starves), and a writer's
//! release grants every reader queued behind it at once (no reader starves).
//!
//! # Fencing reads and writes
//! Every grant's token is larger than every token granted on the key before it, and a writer
//! is granted only once no reader holds, so a write's token is larger than that of every read
//! lease before it. A resource keeps the largest write token it has applied (`fence`) and takes
//! the token with every request:
//!
//! ```sql
//! -- a write with token :t: applies only if no write with a greater token came first
//! UPDATE accounts SET balance = :balance, fence = :t WHERE id = :id AND fence < :t;
//! -- a read with token :t: answers only if no write after its grant has been applied
//! SELECT balance FROM accounts WHERE id = :id AND fence < :t;
//! ```
//!
//! A reader paused past its lease, after which a writer was granted and wrote, holds a token
//! below the writer's: its read finds no row, and it knows its lease is gone. In memory,
//! [`Fence::try_accept`](crate::Fence::try_accept) with the write tokens is the `UPDATE`, and
//! [`Fence::check_read`](crate::Fence::check_read) with the read token the `SELECT`'s test. A
//! resource that cannot store a fence asks [`Client::check`]: CURRENT while the reader's token
//! names an unexpired holder, that is while no writer was granted after it (racy, as CHECK
//! always is: the answer can be out of date when it arrives).
//!
//! ```no_run
//! use std::time::Duration;
//! use tenure::{AcquireOptions, AcquireOutcome, Client};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("127.0.0.1:7878").await?;
//! let wait = AcquireOptions::wait(Duration::from_secs(10));
//! let ttl = Duration::from_secs(30);
//! if let AcquireOutcome::Granted(read) = client.read_lock("doc", ttl, wait.clone()).await? {
//!     let _token = read.fencing_token(); // send it with every read
//!     read.release().await?;
//! }
//! if let AcquireOutcome::Granted(write) = client.write_lock("doc", ttl, wait).await? {
//!     let _token = write.fencing_token(); // larger than every reader's before it
//!     write.release().await?;
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

use tenure_protocol::kind::LeaseKind;

use crate::client::Client;
use crate::error::Result;
use crate::lease::{AcquireOutcome, LeaseGuard};
use crate::options::AcquireOptions;

impl Client {
    /// A read lease on `key`, beside any other readers, as a [`LeaseGuard`] renewed in the
    /// background; waits in line up to `options.wait` while a writer holds the key or waits
    /// before this request.
    ///
    /// # Errors
    /// As [`Client::acquire_kind`]; [`Error::KindMismatch`](crate::Error::KindMismatch) when
    /// the key is a semaphore.
    pub async fn read_lock(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        self.lock_kind(key, ttl, LeaseKind::Shared, options).await
    }

    /// A write lease on `key`: the key alone, granted once no reader or writer holds it and
    /// everyone in line before it is served. The same request as [`Client::lock`].
    ///
    /// # Errors
    /// As [`Client::read_lock`].
    pub async fn write_lock(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        self.lock_kind(key, ttl, LeaseKind::Exclusive, options)
            .await
    }
}
