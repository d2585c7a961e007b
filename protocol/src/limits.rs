//! Wire limits: every size and range a peer may send, in one place.
//!
//! The server's runtime limits (connections, held locks, waiters) live in its config; these are
//! the ones both ends of a connection must agree on.

/// Longest key, in bytes.
pub const KEY_LEN_MAX: usize = 1024;
/// Longest holder metadata value attached to an acquire, in bytes.
pub const META_LEN_MAX: usize = 1024;
/// Shortest lease a client may ask for, in milliseconds.
pub const TTL_MS_MIN: u32 = 10;
/// Longest lease a client may ask for, in milliseconds (one day).
pub const TTL_MS_MAX: u32 = 86_400_000;
/// Longest time a blocking acquire may wait, in milliseconds (one hour).
pub const WAIT_MS_MAX: u32 = 3_600_000;
