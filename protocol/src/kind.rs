//! [`LeaseKind`]: what an ACQUIRE asks for: the key alone (an exclusive lock, or the write
//! side of a read/write lock), a shared (read) lease beside other readers, or permits of a
//! counting semaphore. The wire carries it after ACQUIRE's `meta` when flag bit 3 is set.

use crate::error::{ErrorCode, FrameError};
use crate::limits::PERMITS_MAX;

/// ACQUIRE `kind` byte: a shared (read) lease; nothing follows.
pub const KIND_SHARED: u8 = 1;
/// ACQUIRE `kind` byte: permits of a semaphore; `count [4]` and `limit [4]` follow.
pub const KIND_PERMITS: u8 = 2;

/// What one lease holds of its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LeaseKind {
    /// The key alone: a plain lock, which is also the write side of a read/write lock.
    #[default]
    Exclusive,
    /// A read lease: any number of readers (up to `PERMITS_MAX`) hold the key together while
    /// no exclusive lease does.
    Shared,
    /// `count` of the key's `limit` permits.
    Permits {
        /// Permits this lease holds, `1..=limit`.
        count: u32,
        /// The key's number of permits, `1..=PERMITS_MAX`; fixed while anyone holds or waits.
        limit: u32,
    },
}

impl LeaseKind {
    /// Whether this is a plain exclusive lease (ACQUIRE without flag bit 3).
    pub fn is_exclusive(self) -> bool {
        self == LeaseKind::Exclusive
    }

    /// Checks the permit counts against `PERMITS_MAX`.
    ///
    /// # Errors
    /// [`ErrorCode::BadPermits`] for a count of 0, a count over the limit or a limit out of
    /// `1..=PERMITS_MAX`.
    pub fn validate(self) -> Result<(), FrameError> {
        if let LeaseKind::Permits { count, limit } = self {
            if !(1..=PERMITS_MAX).contains(&limit) || !(1..=limit).contains(&count) {
                return Err(FrameError::new(
                    ErrorCode::BadPermits,
                    format!(
                        "permits {count} of {limit}: need 1 <= count <= limit <= {PERMITS_MAX}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// INSPECT `flags` bit: answer a read/write or semaphore key with HELD_KINDS.
pub const INSPECT_FLAG_KINDS: u8 = 0x01;

/// What HELD_KINDS adds to HELD: a shared key's holders and waiters by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HolderKinds {
    /// A semaphore's number of permits; 0 for a read/write key.
    pub limit: u32,
    /// Unexpired leases holding the key.
    pub holders: u32,
    /// Permits held (a semaphore) or read leases (a read/write key).
    pub in_use: u32,
    /// Whether an exclusive (write) lease holds the key.
    pub writer: bool,
    /// Waiters for a read lease or permits.
    pub waiting_shared: u32,
    /// Waiters for the key alone (writers).
    pub waiting_exclusive: u32,
}
