//! Handing freed memory back to the operating system after a one-off peak.
//!
//! `tenured` allocates through mimalloc, which keeps freed pages for a while (its purge
//! delay) and purges them during later allocations. Recovery builds the replayed leases
//! before the table holds them, frees that copy, and then the process may sit idle: without a
//! nudge its RSS after a restart stayed at the recovery's peak (192 MiB against 70 MiB before
//! the crash at 500K held locks). A forced collection right after recovery returns it.

/// Asks the allocator to return freed memory to the OS now. Costs a few milliseconds at
/// most, so call it after one-off work (recovery), not per request. Harmless when mimalloc is
/// not the global allocator (tests): it then has nothing to return.
#[allow(unsafe_code)]
pub fn release_freed() {
    // SAFETY: `mi_collect` takes no pointers; it only walks mimalloc's own structures, and
    // may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
