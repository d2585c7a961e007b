//! The exit codes of `tenure`, one per kind of answer (listed in `--help` by `cli` and in
//! the crate docs). Their own module, below every other, so that each command's module
//! returns them without importing the crate root.

/// Exit code for success.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit code for errors: I/O, server errors, bad arguments.
pub(crate) const EXIT_ERROR: u8 = 1;
/// Exit code when someone else holds the lock.
pub(crate) const EXIT_LOCKED: u8 = 3;
/// Exit code when the lease is gone.
pub(crate) const EXIT_LOST: u8 = 4;
/// Exit code when a release names a lease that does not hold the lock.
pub(crate) const EXIT_NOT_OWNER: u8 = 5;
/// Exit code when a token does not belong to the live holder.
pub(crate) const EXIT_STALE: u8 = 6;
