//! Write-ahead log: makes every grant, release, renewal to a longer TTL and token
//! reservation durable, with group commit, and rebuilds the held leases on restart.
//!
//! # Layout
//! - [`record`]: the byte format of records and segment headers. Pure, no I/O.
//! - [`recovery`]: reads the segments in order, truncates a torn tail, refuses corruption,
//!   replays records into the set of held leases.
//! - [`writer`]: [`Wal`], the append path (group commit, rotation, snapshots, waiting).
//! - `syncer`: two threads, one writing batches while the other fsyncs what was written
//!   before (pipelined group commit); they publish the durable LSN and record a failure for
//!   good.
//! - [`storage`]: the file operations behind a trait, with a fault-injecting implementation.
//!
//! # Guarantees
//! - A record is *durable* once [`Wal::durable_lsn`] reaches its [`Lsn`]; the server replies
//!   to a client (and so shows a fencing token) only after that.
//! - After restart, every lease granted and not freed by a durable record comes back, and
//!   [`Recovered::token_floor`] exceeds every token any durable record mentions, and every
//!   token handed out, even if the disk lost the last token reservation (see "Token floor").
//! - After the first failed write or fsync nothing is written again ("fsyncgate": a failed
//!   fsync is not retried, since the kernel may have dropped the dirty pages). The durable
//!   LSN stops, every later append and wait fails, and the process can keep serving reads.
//!   The active segment is cut back to its last synced length, so records of the failed batch
//!   (never acknowledged) do not come back after a restart even if some of their bytes reached
//!   the disk.
//!
//! # On-disk format
//! A directory of segment files named `wal-{seq:016x}.log`; `seq` (u64) increases by one
//! per segment with no gaps. Every integer is big-endian. Each segment starts with a header:
//!
//! ```text
//!  0        8         12                 20                 28         32
//!  +--------+---------+------------------+------------------+----------+
//!  | magic  | version |   segment seq    |   token floor    |  crc32   |
//!  |  8 B   | u32     |       u64        |       u64        |   u32    |
//!  +--------+---------+------------------+------------------+----------+
//!  magic = "TENUREWL", version = 2, crc32 of bytes 0..28
//! ```
//!
//! The token floor is the log's token high-water mark when the segment was created: every
//! fencing token handed out before then is below it. Version 1 (24 bytes, no token floor)
//! is refused by name; this build does not read it.
//!
//! then records back to back, each:
//!
//! ```text
//!  0          4          8      9
//!  +----------+----------+------+---------------------------+
//!  | len  u32 | crc  u32 | type |   payload (len bytes)     |
//!  +----------+----------+------+---------------------------+
//! ```
//!
//! `len` counts the payload only and never exceeds [`record::PAYLOAD_LEN_MAX`] (a whole record
//! is at most [`record::RECORD_LEN_MAX`] = 4096 bytes); `crc` is CRC-32 (IEEE, as computed by
//! `crc32fast`) of the type byte and the payload. `bytes16` below is a u16 length and then
//! that many bytes. Payloads by type:
//!
//! ```text
//!  1 Reserve        token_limit u64
//!  2 Grant          key bytes16 (<= 1024) | lease_id 16 B | token u64 | ttl_ms u32
//!                   | flags u8 (bit 0: release on disconnect, bit 1: acquire id, bit 3:
//!                   shared (read) lease, bit 4: semaphore permits) | meta bytes16 (<= 1024)
//!                   | with bit 1: acquire_id 16 B
//!                   | with bit 4: count u32 | limit u32 (1 <= count <= limit <= 4096)
//!  3 Free           key bytes16 | token u64 | reason u8 (0 released, 1 expired,
//!                   2 disconnected)
//!  4 SnapshotBegin  segment_seq u64   (always the first record of that segment)
//!  5 SnapshotEnd    segment_seq u64   (names the segment of its SnapshotBegin)
//!  6 Renew          key bytes16 | token u64 | ttl_ms u32
//! ```
//!
//! The acquire id (flag bit 1) came later too, within format version 2: a Grant without the
//! flag reads as before, and a build that predates it refuses a Grant with it as malformed
//! (trailing bytes), rather than forget which ACQUIRE the lease answered.
//!
//! Flag bits 3 and 4 (read/write locks and semaphores, PROTOCOL.md 3.10) came later within
//! version 2 too: a Grant without them is written and read exactly as before; both set, or
//! counts out of range, are corruption. A build that predates them keeps bit 3 as an unknown
//! flag (bringing a read lease back as an exclusive one) and refuses a bit-4 Grant's trailing
//! counts, so a log holding them should not be opened by an older build. Optional fields
//! follow `meta` in increasing flag-bit order: the acquire id, then the permit counts.
//!
//! Renew records came after the other five, within format version 2: a log without them
//! reads as before, and a build that predates them refuses a log holding one ("unknown record
//! type 6", reported as corruption) rather than bring leases back shorter than renewed.
//!
//! # Replay
//! Records apply in log order: Reserve raises the token floor to its limit; Grant sets the
//! key's lease (overwriting) and Grant and Free raise the floor above their token; Free
//! removes the key's lease only if it holds exactly that token; Renew sets the TTL of the
//! key's lease, again only if it holds exactly that token (and raises the floor like Free).
//! A shared or permit Grant (bit 3 or 4) *joins* the key's other shared or permit leases
//! instead (replacing one with its own token, and dropping an exclusive holder or leases of
//! another limit, which the table never keeps beside it); an exclusive Grant drops the key's
//! shared leases. Free and Renew name one of several leases by its token.
//! The server writes a Renew only for a renewal to a longer TTL than the lease's last record
//! says, so a lease comes back with at least the longest TTL it was acknowledged with
//! (the server answers such a renewal once its record is durable). Replaying a
//! Grant of the lease a key already holds changes nothing, which is what lets a snapshot
//! interleave with live traffic: a snapshot's Grant carries the lease's logged TTL.
//!
//! # Token floor
//! Replay takes the highest of: every Reserve's limit, every Grant's, Free's and Renew's
//! token plus one, every segment header's token floor, and the floor files' (below). A
//! non-empty log then gets one more token block on top ([`WalOptions::token_floor_margin`],
//! set by the server to its block) before the new segment's header records the result, and
//! a second block if the newest segment's header was torn (see below).
//!
//! Why both: a process crash cannot lose a synced record, but a disk that drops synced
//! bytes at the end of the newest segment can, and a cut at a record boundary looks like a
//! clean end, so recovery never trusts that it saw the last reservation. Reservations step
//! by at most one block, and the one before a lost reservation survives, either as a record
//! or, if every record of the newest segment is lost, in that segment's header, which was
//! synced before any of them. So a start one block above what survives is above every token
//! handed out. The margin alone would not do: the header is what keeps the previous start's
//! margin once a start's snapshot has deleted the older segments. This covers the loss of
//! one reservation's worth of tail (up to a block of tokens, which at the default block is a
//! million), not a lost or deleted segment file: a newest segment deleted whole takes its
//! header with it, and an empty directory starts again at token 1. It costs one block of
//! token space per start (2^44 starts at the default block).
//!
//! A cut inside the newest segment's header loses the header's floor and everything after
//! it. Recovery cannot tell such a cut from a crash while the segment was being created, so
//! it takes the cautious case: the lost header carried what survives plus one block (a
//! start's floor), and one reservation after it may be lost too, so the start adds a second
//! block. When that segment was the only one (a snapshot had deleted the older ones), what
//! survives is the floor file: every segment's creation first writes its header's floor
//! into `floor-<floor as 16 hex digits>.tok` (8 bytes LE and their CRC-32), synced with the
//! directory before the segment is created, older floor files deleted after; recovery takes
//! the highest intact one (module `floor`).
//!
//! # Torn tail or corruption
//! Only the newest segment can end in a torn write: a segment is fsynced whole before the
//! next is created, and a new segment's header is fsynced before any record goes in. In the
//! newest segment, the first bad record (too short, impossible length, checksum mismatch) is
//! a torn tail, and the file is cut there, if everything after it is zero or if no valid
//! record starts at any later byte offset, bar the offsets inside the bad record as its
//! header declares it where its checksum does not end (its payload may hold a client's
//! metadata, and that the bytes of a whole record: `record::inside_bad_record`). It is
//! corruption, and [`open`] refuses with
//! [`WalError::Corrupt`] naming file and byte offset, if a valid record follows (it may be
//! an acknowledged one), if a record's checksum matches but its content is invalid, or if the
//! damage is in an older segment. A newest segment whose header is damaged and followed only
//! by zeros (a crash while creating it, or a cut inside the header) is deleted, and the
//! start takes one token block more than usual (see Token floor).
//!
//! One crash pattern is refused too: an unsynced write whose first pages never reached the
//! disk (zeros) but whose later pages did. Nothing acknowledged lies past such a hole, so an
//! operator who sees zeros at the reported offset may truncate the file there by hand.
//!
//! # Snapshots
//! Segments rotate at [`WalOptions::segment_size_max`]. To delete old ones the server copies
//! the live table into the log (see [`Wal::begin_snapshot`]): `SnapshotBegin` opens a fresh
//! segment, followed by a Reserve of the current token floor, then a Grant per live lease
//! (appended shard by shard, each shard in a few passes by key hash, interleaved with normal
//! traffic), then `SnapshotEnd`. Once `SnapshotEnd` is durable every segment before the
//! snapshot's is deleted. A crash before
//! that leaves the old segments in place, so replay from the oldest is always complete; a
//! crash after it but before the deletion is finished by the next [`open`]. Deletion goes
//! oldest first, so a crash in its middle can leave a log whose oldest segment starts inside
//! the replaced snapshot (which spanned several segments): recovery replays that remainder
//! like any other records (a copy in a snapshot changes nothing the records after it do not
//! decide) and requires that a later snapshot completed. Dropping the
//! [`SnapshotGuard`] instead of ending it abandons the snapshot and deletes nothing.
//!
//! Every [`open`] starts a new segment, so restarts alone would pile up segments that no
//! size threshold ever snapshots. When [`open`] finds two segments or more, it writes the
//! recovered state into the new segment as a snapshot (the same records, synced before the
//! server starts), then deletes the older segments. After a start the log is at most one
//! older segment plus the new one, and each start replays the live state plus at most two
//! runs' worth of traffic, however many restarts came before. A log of one segment is left
//! alone, so the restart right after a crash costs no more than its replay. A live state too
//! large for one segment is not snapshotted by [`open`] (recovery refuses segments over
//! [`SEGMENT_SIZE_LIMIT`]); [`Wal::should_snapshot`] then asks the server for its snapshot,
//! which rotates, straight away.
pub(crate) mod floor;
pub mod recovery;
pub mod storage;
mod syncer;
pub mod writer;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;

/// The record format lives in [`crate::record`], shared with the journal and the cluster;
/// `wal::record` keeps its old path.
pub use crate::record;
pub use crate::record::{
    DurableState, FreeReason, Lsn, Record, RecoveredLease, GRANT_FLAG_RELEASE_ON_DISCONNECT,
};
pub use recovery::Recovered;
pub use storage::{
    FaultPlan, Faults, FaultyStorage, FileWrapper, FsStorage, SegmentFile, Storage, WrapFiles,
};
pub use writer::{open, open_with_storage, wait_durable_on, SnapshotGuard, Wal, WalStats};

/// Default for [`WalOptions::segment_size_max`]: 64 MiB.
pub const SEGMENT_SIZE_MAX_DEFAULT: u64 = 64 << 20;
/// Largest `segment_size_max` allowed, and so the largest segment file recovery will read
/// into memory; a bigger file is refused as corrupt rather than allocated.
pub const SEGMENT_SIZE_LIMIT: u64 = 1 << 30;
const _: () = assert!(SEGMENT_SIZE_MAX_DEFAULT <= SEGMENT_SIZE_LIMIT);
/// Default for [`WalOptions::pending_bytes_max`]: 64 MiB.
pub const PENDING_BYTES_MAX_DEFAULT: usize = 64 << 20;
/// Default for [`WalOptions::batch_bytes_max`]: 4 MiB.
pub const BATCH_BYTES_MAX_DEFAULT: usize = 4 << 20;

/// Whether the syncer makes writes durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// `fdatasync` after every batch. The only safe mode for production.
    Data,
    /// Never sync: records count as durable once written to the page cache. For tests and
    /// benchmarks only; a power loss or kernel crash loses acknowledged records.
    Off,
}

/// Tunables of the WAL.
#[derive(Debug, Clone)]
pub struct WalOptions {
    /// Whether to fsync; see [`SyncMode`].
    pub sync_mode: SyncMode,
    /// Bytes after which the active segment is closed and a new one started; at most
    /// [`SEGMENT_SIZE_LIMIT`].
    pub segment_size_max: u64,
    /// Encoded bytes that may wait to be durable (pending, or written and not yet synced);
    /// beyond that appends fail with [`WalError::Backlog`] instead of growing memory (or
    /// dirty pages) without bound.
    pub pending_bytes_max: usize,
    /// Bytes the syncer writes in one go at most. An fsync covers every batch written while
    /// the fsync before it ran, so it may cover several.
    pub batch_bytes_max: usize,
    /// Added to the token floor recovery finds in a non-empty log: the largest step between
    /// two consecutive token reservations (the server's token block). A disk that loses synced
    /// bytes at the end of the log may take the last reservation with it; see "Token floor"
    /// in the module docs. 0 trusts the log's tail.
    pub token_floor_margin: u64,
    /// Where the syncer records fsync latency and batch sizes, for `/metrics`.
    pub metrics: std::sync::Arc<crate::obs::metrics::WalMetrics>,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            sync_mode: SyncMode::Data,
            segment_size_max: SEGMENT_SIZE_MAX_DEFAULT,
            pending_bytes_max: PENDING_BYTES_MAX_DEFAULT,
            batch_bytes_max: BATCH_BYTES_MAX_DEFAULT,
            token_floor_margin: 0,
            metrics: std::sync::Arc::default(),
        }
    }
}

/// Errors of the WAL.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// A file operation failed while opening the log.
    #[error("WAL I/O error on {path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The log is damaged somewhere other than a torn tail; the server must not start.
    #[error("WAL corrupt: {path} at byte offset {offset}: {reason}")]
    Corrupt {
        /// The damaged segment file.
        path: PathBuf,
        /// Byte offset of the first bad byte range within that file.
        offset: u64,
        /// What is wrong there.
        reason: String,
    },
    /// A write or fsync failed earlier; nothing appended since can become durable.
    #[error("WAL failed, no further writes are durable: {0}")]
    Failed(Arc<str>),
    /// Too many bytes are waiting for the disk; the operation was not logged.
    #[error("WAL backlog full: {pending_bytes} bytes waiting for the disk")]
    Backlog {
        /// Bytes pending when the append was refused.
        pending_bytes: usize,
    },
    /// [`Wal::begin_snapshot`] was called while a snapshot was in progress.
    #[error("a WAL snapshot is already in progress")]
    SnapshotInProgress,
    /// [`Wal::sync_and_stop`] was called; the log takes no more writes.
    #[error("WAL stopped, no further writes")]
    Stopped,
}

/// File name of segment `seq`.
pub(crate) fn segment_name(seq: u64) -> String {
    format!("wal-{seq:016x}.log")
}

/// The sequence number in a segment file name, if `name` is one.
pub(crate) fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn segment_names_round_trip() {
        for seq in [0, 1, 0xabc, u64::MAX] {
            assert_eq!(parse_segment_name(&segment_name(seq)), Some(seq));
        }
        for name in [
            "wal-1.log",
            "wal-000000000000000g.log",
            "x-0000000000000001.log",
            "wal-",
        ] {
            assert_eq!(parse_segment_name(name), None, "{name}");
        }
    }
}
