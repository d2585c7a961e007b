//! Wire limits: every size and range a peer may send, in one place.
//!
//! The server's runtime limits (connections, held locks, waiters) live in its config; these are
//! the ones both ends of a connection must agree on. The `const` asserts at the bottom keep the
//! relations between them true when someone edits one number.

/// Longest key, in bytes. Keys are opaque bytes, at least one byte long.
pub const KEY_LEN_MAX: usize = 1024;
/// Longest holder metadata value attached to an acquire, in bytes.
pub const META_LEN_MAX: usize = 1024;
/// Shortest lease a client may ask for, in milliseconds.
pub const TTL_MS_MIN: u32 = 10;
/// Longest lease a client may ask for, in milliseconds (one day).
pub const TTL_MS_MAX: u32 = 86_400_000;
/// Longest time a blocking acquire may wait, in milliseconds (one hour).
pub const WAIT_MS_MAX: u32 = 3_600_000;
/// Longest console line, in bytes before its newline: a longer one is answered
/// `LINE_TOO_LONG` and the connection closed. It fits the longest key and metadata with room
/// for the command word and its numbers.
pub const LINE_LEN_MAX: usize = 4096;
/// Largest frame either side may send, counted after the 4-byte length prefix.
pub const FRAME_LEN_MAX: usize = 8 * 1024;
/// Smallest frame: opcode (1 byte) and request id (8 bytes).
pub const FRAME_LEN_MIN: usize = 1 + 8;
/// Default cap on requests a client may have in flight on one connection; the server announces
/// its actual cap in the handshake.
pub const IN_FLIGHT_MAX_DEFAULT: u32 = 4096;
/// Longest human-readable error message in an ERROR frame, in bytes.
pub const ERROR_MESSAGE_LEN_MAX: usize = 512;
/// Most name/value pairs in a STATS reply.
pub const STATS_COUNT_MAX: usize = 64;
/// Longest stat name, in bytes.
pub const STAT_NAME_LEN_MAX: usize = 48;
/// Longest identity name in AUTH, in bytes.
pub const IDENTITY_NAME_LEN_MAX: usize = 64;
/// Longest secret in AUTH, in bytes.
pub const SECRET_LEN_MAX: usize = 256;
/// Most nodes in a membership (voters and learners) that INIT takes or CLUSTER reports.
pub const CLUSTER_MEMBERS_MAX: usize = 9;
/// Longest peer or client address of a cluster member, in bytes (`host:port`).
pub const CLUSTER_ADDR_LEN_MAX: usize = 128;

/// Most permits a semaphore key may have, and most readers holding one key at once.
pub const PERMITS_MAX: u32 = 4096;
/// The largest request body: ACQUIRE with a maximal key, maximal metadata, an acquire id
/// (3.9), a session id (3.11) and a semaphore's kind fields (`kind`, `count`, `limit`):
/// 2 111 bytes, the least `frame_len_max` a server may announce.
pub const ACQUIRE_LEN_MAX: usize = FRAME_LEN_MIN
    + 2
    + KEY_LEN_MAX
    + 4
    + 4
    + 1
    + 2
    + META_LEN_MAX
    + ACQUIRE_ID_LEN
    + SESSION_ID_LEN
    + 1
    + 4
    + 4;
/// An acquire id's bytes on the wire (PROTOCOL.md 3.9).
const ACQUIRE_ID_LEN: usize = 16;
/// A session id's bytes on the wire (PROTOCOL.md 3.11).
const SESSION_ID_LEN: usize = 16;
const _: () = assert!(ACQUIRE_LEN_MAX == 2111);
/// The largest reply: a full STATS frame.
pub const STATS_LEN_MAX: usize = FRAME_LEN_MIN + 2 + STATS_COUNT_MAX * (1 + STAT_NAME_LEN_MAX + 8);
/// The largest CLUSTER reply (INIT's body is smaller: no per-member voter byte, no header),
/// its extension included.
pub const CLUSTER_STATUS_LEN_MAX: usize = FRAME_LEN_MIN
    + 8 * 5
    + 1
    + 2
    + CLUSTER_ADDR_LEN_MAX
    + 2
    + CLUSTER_MEMBERS_MAX * (1 + 8 + 2 * (2 + CLUSTER_ADDR_LEN_MAX))
    + 2
    + crate::cluster::STATUS_EXTENSION_LEN;

const _: () = assert!(ACQUIRE_LEN_MAX <= FRAME_LEN_MAX);
const _: () = assert!(CLUSTER_STATUS_LEN_MAX <= FRAME_LEN_MAX);
// A console INIT line with every member at its longest still fits a line.
const _: () =
    assert!(CLUSTER_MEMBERS_MAX * (20 + 3 + 2 * CLUSTER_ADDR_LEN_MAX) + 16 <= LINE_LEN_MAX);
const _: () = assert!(STATS_LEN_MAX <= FRAME_LEN_MAX);
const _: () = assert!(FRAME_LEN_MIN + 2 + 2 + ERROR_MESSAGE_LEN_MAX <= FRAME_LEN_MAX);
// Lengths of keys and metadata travel as u16.
const _: () = assert!(KEY_LEN_MAX <= u16::MAX as usize && META_LEN_MAX <= u16::MAX as usize);
const _: () = assert!(TTL_MS_MIN > 0 && TTL_MS_MIN <= TTL_MS_MAX);
const _: () = assert!(LINE_LEN_MAX > KEY_LEN_MAX + META_LEN_MAX + 64);
