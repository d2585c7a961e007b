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

/// mimalloc's `mi_option_purge_delay`: 15 in the option enums of both mimalloc 2 and 3 as
/// vendored by libmimalloc-sys 0.1.49, which names no constant for it (its constants follow
/// an older order). `the_purge_delay_option_is_the_one_we_think` checks the number.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// While alive, memory freed is handed back to the OS at once instead of after the purge
/// delay; the delay in force before comes back on drop.
///
/// For recovery: its replayed copy of the leases is freed while the table is filled, and a
/// forced collection afterwards cannot return what the allocator scheduled to purge a second
/// later (the arenas purge only what was due, and a server idle after a restart allocates
/// nothing that would trigger it). Not for serving: purging every free page at once costs a
/// system call each.
#[must_use = "the delay comes back when this is dropped"]
pub struct PurgeAtOnce {
    delay_before: std::os::raw::c_long,
}

impl PurgeAtOnce {
    /// Sets the purge delay to zero until the returned guard is dropped.
    #[allow(unsafe_code)]
    pub fn start() -> PurgeAtOnce {
        // SAFETY: option calls take no pointers and are safe from any thread.
        let delay_before = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, 0) };
        PurgeAtOnce { delay_before }
    }
}

impl Drop for PurgeAtOnce {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: as in `start`.
        unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, self.delay_before) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(unsafe_code)]
    fn the_purge_delay_option_is_the_one_we_think() {
        // SAFETY: as in `PurgeAtOnce::start`.
        let get = || unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        // mimalloc 3's documented default; another option's number would read another
        // default (none of its neighbours defaults to 1000). An override in the
        // environment would be the user's, so the test only runs without one.
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), 1000);
        }
        let before = get();
        {
            let _at_once = PurgeAtOnce::start();
            assert_eq!(get(), 0);
        }
        assert_eq!(get(), before);
    }
}
