//! Counting semaphores (PROTOCOL.md 3.10): [`Client::semaphore`] takes one permit of a key's
//! `permits`, [`Client::semaphore_permits`] several; [`Client::inspect_kinds`] reads a
//! semaphore's or read/write key's holders and waiters by kind.
//!
//! Each permit is a lease of its own, with its own lease id, renewal, release and fencing
//! token (larger than every token granted before on the key), so the [`LeaseGuard`] a permit
//! comes in is the lock's guard: the same loss signal, renewal and release. A crashed holder's
//! permit ends at its lease's end by the server's clock; no permit leaks.
//!
//! Waiters are served strictly first in, first out: a waiter asking for more permits than are
//! free is never overtaken by a smaller request that came after it.
//!
//! A key's limit is fixed while anyone holds or waits for it: asking for permits of another
//! limit, or a plain lock of a semaphore key, is [`Error::KindMismatch`](crate::Error).
//!
//! ```no_run
//! use std::time::Duration;
//! use tenure::{AcquireOptions, AcquireOutcome, Client};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::connect("127.0.0.1:7878").await?;
//! // At most 4 workers call the partner API at once.
//! let wait = AcquireOptions::wait(Duration::from_secs(10));
//! let ttl = Duration::from_secs(30);
//! if let AcquireOutcome::Granted(permit) = client.semaphore("partner-api", 4, ttl, wait).await? {
//!     let _token = permit.fencing_token();
//!     // ... call the API, select!-ing on permit.lost() ...
//!     permit.release().await?;
//! }
//! # Ok(()) }
//! ```

use std::time::Duration;

use bytes::Bytes;
use tenure_protocol::kind::{HolderKinds, LeaseKind};
use tenure_protocol::{Request, Response};

use crate::client::Client;
use crate::error::{unexpected, Result};
use crate::lease::{AcquireOutcome, LeaseGuard};
use crate::options::AcquireOptions;
use crate::outcome::KeyState;

/// The answer to [`Client::inspect_kinds`]: the key's state as INSPECT gives it, and, for a
/// held read/write or semaphore key, its holders and waiters by kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindsState {
    /// FREE, or HELD with the newest holder's token and metadata, the time until the first
    /// holder's lease ends, and the waiters of every kind.
    pub state: KeyState,
    /// `None` for a free key or a plain lock.
    pub kinds: Option<HolderKinds>,
}

impl Client {
    /// One permit of semaphore `key` of `permits` permits, as a [`LeaseGuard`] renewed in the
    /// background; waits in line up to `options.wait` while all permits are taken.
    ///
    /// # Errors
    /// As [`Client::acquire_kind`]: [`Error::KindMismatch`](crate::Error::KindMismatch) when
    /// the key is a plain or read/write lock, or a semaphore of another number of permits;
    /// [`Error::BadPermits`](crate::Error::BadPermits) for `permits` outside
    /// `1..=PERMITS_MAX`.
    pub async fn semaphore(
        &self,
        key: impl AsRef<[u8]>,
        permits: u32,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        self.semaphore_permits(key, 1, permits, ttl, options).await
    }

    /// `count` permits at once of semaphore `key` of `permits` permits, as one lease (one
    /// token, renewed and released together).
    ///
    /// # Errors
    /// As [`Client::semaphore`]; `count` of 0 or over `permits` is
    /// [`Error::BadPermits`](crate::Error::BadPermits).
    pub async fn semaphore_permits(
        &self,
        key: impl AsRef<[u8]>,
        count: u32,
        permits: u32,
        ttl: Duration,
        options: AcquireOptions,
    ) -> Result<AcquireOutcome<LeaseGuard>> {
        let kind = LeaseKind::Permits {
            count,
            limit: permits,
        };
        self.lock_kind(key, ttl, kind, options).await
    }

    /// Reads the state of `key` with its holders and waiters by kind (INSPECT with flag bit 0,
    /// answered HELD_KINDS for a read/write or semaphore key).
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) for a bad key; otherwise any
    /// [`Error`](crate::Error) a request can meet.
    pub async fn inspect_kinds(&self, key: impl AsRef<[u8]>) -> Result<KindsState> {
        let request = Request::Inspect {
            key: Bytes::copy_from_slice(key.as_ref()),
            kinds: true,
        };
        let ms = |ms: u32| Duration::from_millis(u64::from(ms));
        let (state, kinds) = match self.call_plain(request).await? {
            Response::Free => (KeyState::Free, None),
            Response::Held {
                token,
                ttl_left_ms,
                waiters,
                meta,
            } => (
                KeyState::Held {
                    token,
                    ttl_left: ms(ttl_left_ms),
                    waiters,
                    meta,
                },
                None,
            ),
            Response::HeldKinds {
                token,
                ttl_left_ms,
                waiters,
                meta,
                kinds,
            } => (
                KeyState::Held {
                    token,
                    ttl_left: ms(ttl_left_ms),
                    waiters,
                    meta,
                },
                Some(kinds),
            ),
            other => return Err(unexpected("INSPECT", other)),
        };
        Ok(KindsState { state, kinds })
    }
}
