//! Record and segment-header encoding: pure functions over byte slices, no I/O.
//!
//! The layout is drawn in the [WAL's module docs](crate::wal). Decoding checks the announced length
//! against [`PAYLOAD_LEN_MAX`] before looking at (or allocating for) the payload, so a
//! corrupt length costs nothing.
use std::fmt;

/// Bytes before the payload: length (u32), checksum (u32), type (u8).
pub const RECORD_HEADER_LEN: usize = 9;
/// Longest record, header included, in bytes. Anything longer on disk is corruption.
pub const RECORD_LEN_MAX: usize = 4096;
/// Longest payload a record header may announce, in bytes.
pub const PAYLOAD_LEN_MAX: usize = RECORD_LEN_MAX - RECORD_HEADER_LEN;
/// Longest key a record may carry, in bytes (the wire limit).
pub const KEY_LEN_MAX: usize = tenure_protocol::limits::KEY_LEN_MAX;
/// Longest holder metadata a record may carry, in bytes (the wire limit).
pub const META_LEN_MAX: usize = tenure_protocol::limits::META_LEN_MAX;

/// Payload of the largest possible grant: key and meta at their limits, an acquire id and
/// permit counts.
const GRANT_PAYLOAD_LEN_MAX: usize =
    2 + KEY_LEN_MAX + 16 + 8 + 4 + 1 + 2 + META_LEN_MAX + 16 + 16 + 8;
const _: () = assert!(GRANT_PAYLOAD_LEN_MAX <= PAYLOAD_LEN_MAX);
// Key and meta lengths are stored as u16.
const _: () = assert!(KEY_LEN_MAX <= u16::MAX as usize && META_LEN_MAX <= u16::MAX as usize);

/// First bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"TENUREWL";
/// Segment format version written by this build; the only one it reads. Version 1 had no
/// token floor in the header.
pub const SEGMENT_VERSION: u32 = 2;
/// Bytes of the segment header: magic, version (u32), sequence (u64), token floor (u64),
/// checksum (u32).
pub const SEGMENT_HEADER_LEN: usize = 32;
/// Header bytes the checksum covers: all but the checksum itself.
const SEGMENT_HEADER_CHECKED_LEN: usize = SEGMENT_HEADER_LEN - 4;

/// Grant flag bit: release the lease when the holder's connection closes.
pub const GRANT_FLAG_RELEASE_ON_DISCONNECT: u8 = 0b0000_0001;
/// Grant flag bit: the ACQUIRE carried an acquire id, whose 16 bytes follow `meta`. (A build
/// without acquire ids refuses such a record as malformed: it cannot read a WAL made with
/// them.)
pub const GRANT_FLAG_ACQUIRE_ID: u8 = 0b0000_0010;
/// Grant flag bit: the lease is in a session, whose 16-byte id follows the acquire id (or
/// `meta`, without one). Its deadline is its session's: recovery gives it the session's TTL.
/// (A build without sessions refuses such a record as malformed.)
pub const GRANT_FLAG_SESSION: u8 = 0b0000_0100;
/// Longest session owner (an identity name) a SessionOpen record may carry, in bytes.
pub const OWNER_LEN_MAX: usize = tenure_protocol::limits::IDENTITY_NAME_LEN_MAX;
const _: () = assert!(OWNER_LEN_MAX <= u16::MAX as usize);
/// Grant flag bit: a shared (read) lease, one of several holders of its key.
pub const GRANT_FLAG_SHARED: u8 = 0b0000_1000;
/// Grant flag bit: semaphore permits; `count (u32)` and `limit (u32)` follow `meta` (and the
/// acquire id, if any: optional fields come in increasing flag-bit order).
pub const GRANT_FLAG_PERMITS: u8 = 0b0001_0000;
/// The flag bits that say a grant's kind: kept out of [`Record::Grant`]'s `flags` field,
/// which says them in its `kind`.
const GRANT_FLAGS_KIND: u8 = GRANT_FLAG_SHARED | GRANT_FLAG_PERMITS;

use tenure_protocol::LeaseKind;

const TYPE_RESERVE: u8 = 1;
const TYPE_GRANT: u8 = 2;
const TYPE_FREE: u8 = 3;
const TYPE_SNAPSHOT_BEGIN: u8 = 4;
const TYPE_SNAPSHOT_END: u8 = 5;
const TYPE_RENEW: u8 = 6;
const TYPE_SESSION_OPEN: u8 = 7;
// Type 8 stays reserved (PROTOCOL.md 3.11): a keep-alive that changed a session's TTL. None
// does: the TTL is fixed at open, and a restart counts it again, so keep-alives log nothing.
const TYPE_SESSION_END: u8 = 9;

/// Why a lease was freed; recorded for audit, replay treats all alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeReason {
    /// The holder released it.
    Released = 0,
    /// Its TTL ran out.
    Expired = 1,
    /// The holder's connection closed and the lease asked to be released then.
    Disconnected = 2,
    /// It was a session lease and SESSION_CLOSE ended its session (new with sessions: a
    /// log holding one also holds session records, which no older build reads either).
    Session = 3,
}

impl FreeReason {
    fn from_u8(value: u8) -> Option<FreeReason> {
        match value {
            0 => Some(FreeReason::Released),
            1 => Some(FreeReason::Expired),
            2 => Some(FreeReason::Disconnected),
            3 => Some(FreeReason::Session),
            _ => None,
        }
    }
}

/// How a session ended; recorded for audit, replay treats both alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// SESSION_CLOSE.
    Closed = 1,
    /// It missed its deadline.
    Expired = 2,
}

impl SessionEnd {
    fn from_u8(value: u8) -> Option<SessionEnd> {
        match value {
            1 => Some(SessionEnd::Closed),
            2 => Some(SessionEnd::Expired),
            _ => None,
        }
    }
}

/// One WAL record. Borrows key and meta so appending allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record<'a> {
    /// Fencing tokens below `token_limit` may be handed out; recovery starts above it.
    Reserve {
        /// Exclusive upper bound of the tokens the server may hand out.
        token_limit: u64,
    },
    /// `key` is held under `lease_id` with fencing token `token` (overwrites any holder).
    Grant {
        /// The locked key, at most [`KEY_LEN_MAX`] bytes.
        key: &'a [u8],
        /// The lease id the holder presents (a `LeaseId`'s bytes).
        lease_id: [u8; 16],
        /// The fencing token of this grant.
        token: u64,
        /// Lease length; recovery counts it again from restart.
        ttl_ms: u32,
        /// Bit set of `GRANT_FLAG_*`, the kind bits aside.
        flags: u8,
        /// Holder metadata, at most [`META_LEN_MAX`] bytes.
        meta: &'a [u8],
        /// The ACQUIRE's acquire id, if it had one; present exactly when `flags` has
        /// [`GRANT_FLAG_ACQUIRE_ID`].
        acquire_id: Option<[u8; 16]>,
        /// The session the lease is in, if any (a `SessionId`'s bytes); present exactly when
        /// `flags` has [`GRANT_FLAG_SESSION`].
        session_id: Option<[u8; 16]>,
        /// What the lease holds. An exclusive grant is written as before the kinds existed
        /// and replaces the key's holders; a shared or permits grant (flag bit 3 or 4) joins
        /// them.
        kind: LeaseKind,
    },
    /// `key` is no longer held, if it is still held with exactly `token`.
    Free {
        /// The key that was freed.
        key: &'a [u8],
        /// The fencing token of the grant that ended.
        token: u64,
        /// Why it ended.
        reason: FreeReason,
    },
    /// First record of segment `segment_seq`: a snapshot of the live table follows.
    SnapshotBegin {
        /// The segment this record opens.
        segment_seq: u64,
    },
    /// The snapshot begun in segment `segment_seq` is complete.
    SnapshotEnd {
        /// The segment holding the matching [`Record::SnapshotBegin`].
        segment_seq: u64,
    },
    /// The lease holding `key` with `token`, if it still does, was renewed to `ttl_ms`,
    /// longer than its earlier records said; recovery counts the new TTL from restart.
    Renew {
        /// The renewed key.
        key: &'a [u8],
        /// The fencing token of the renewed lease (which names it, as in [`Record::Free`]).
        token: u64,
        /// The lease's new length.
        ttl_ms: u32,
    },
    /// Session `session_id` was opened with `ttl_ms` by `owner`; recovery counts its TTL
    /// again from restart. Written before any grant in it.
    SessionOpen {
        /// The session id (a `SessionId`'s bytes).
        session_id: [u8; 16],
        /// The session's TTL, fixed at open.
        ttl_ms: u32,
        /// The identity that opened it, at most [`OWNER_LEN_MAX`] bytes; empty without
        /// identities.
        owner: &'a [u8],
    },
    /// Session `session_id` ended; the leases still in it end with it.
    SessionEnd {
        /// The session id.
        session_id: [u8; 16],
        /// How it ended.
        how: SessionEnd,
    },
}

/// Whether an intact record found at `at` of a log lies inside the bytes of the bad record
/// at `bad` before it (one that did not decode), and so may be part of that record's
/// content rather than a record written after it: it starts after `bad` and before the end
/// the bad record's header declares (`header_len` bytes, a big-endian `u32` payload length
/// of at most `payload_len_max` first, then the CRC-32 of everything from byte 8 to the
/// end), and the bad record's checksum does not match its bytes cut at `at` (it would if
/// only its length were damaged: then the record at `at` is the one after it).
///
/// The WAL and the Raft log ask this of an intact record after bad bytes at their end,
/// which is damage only if something was written after those bytes: a client's metadata
/// may hold the bytes of a whole record, and a crash that tore the record carrying it left
/// that copy intact inside the torn one (review 9, finding 3). A header damaged in its
/// length and its checksum at once hides records within its declared length this way.
pub fn inside_bad_record(
    data: &[u8],
    bad: usize,
    at: usize,
    header_len: usize,
    payload_len_max: usize,
) -> bool {
    let Some(header) = data.get(bad..bad + 8) else {
        return false;
    };
    let len = u32::from_be_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    if at <= bad || len > payload_len_max || at >= bad + header_len + len {
        return false;
    }
    let stored = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes"));
    at < bad + header_len || crc32fast::hash(&data[bad + 8..at]) != stored
}

/// Whether `type_byte` names a record type this build knows.
pub fn is_known_type(type_byte: u8) -> bool {
    (TYPE_RESERVE..=TYPE_SESSION_OPEN).contains(&type_byte) || type_byte == TYPE_SESSION_END
}

impl Record<'_> {
    fn type_byte(&self) -> u8 {
        match self {
            Record::Reserve { .. } => TYPE_RESERVE,
            Record::Grant { .. } => TYPE_GRANT,
            Record::Free { .. } => TYPE_FREE,
            Record::SnapshotBegin { .. } => TYPE_SNAPSHOT_BEGIN,
            Record::SnapshotEnd { .. } => TYPE_SNAPSHOT_END,
            Record::Renew { .. } => TYPE_RENEW,
            Record::SessionOpen { .. } => TYPE_SESSION_OPEN,
            Record::SessionEnd { .. } => TYPE_SESSION_END,
        }
    }

    fn payload_len(&self) -> usize {
        match self {
            Record::Reserve { .. } | Record::SnapshotBegin { .. } | Record::SnapshotEnd { .. } => 8,
            Record::Grant {
                key,
                meta,
                acquire_id,
                session_id,
                kind,
                ..
            } => {
                let id_len =
                    16 * (usize::from(acquire_id.is_some()) + usize::from(session_id.is_some()));
                let permits = if matches!(kind, LeaseKind::Permits { .. }) {
                    8
                } else {
                    0
                };
                2 + key.len() + 16 + 8 + 4 + 1 + 2 + meta.len() + id_len + permits
            }
            Record::Free { key, .. } => 2 + key.len() + 8 + 1,
            Record::Renew { key, .. } => 2 + key.len() + 8 + 4,
            Record::SessionOpen { owner, .. } => 16 + 4 + 2 + owner.len(),
            Record::SessionEnd { .. } => 16 + 1,
        }
    }

    /// Bytes this record takes on disk, header included.
    pub fn encoded_len(&self) -> usize {
        RECORD_HEADER_LEN + self.payload_len()
    }
}

/// Appends the encoded record to `out`.
///
/// # Panics
/// If key or meta exceed [`KEY_LEN_MAX`] / [`META_LEN_MAX`]: callers check wire limits first.
pub fn encode(record: &Record<'_>, out: &mut Vec<u8>) {
    let start = out.len();
    let payload_len = record.payload_len();
    assert!(payload_len <= PAYLOAD_LEN_MAX);
    out.reserve(RECORD_HEADER_LEN + payload_len);
    out.extend_from_slice(&(payload_len as u32).to_be_bytes());
    out.extend_from_slice(&[0; 4]); // checksum, filled in below
    out.push(record.type_byte());
    match *record {
        Record::Reserve { token_limit } => out.extend_from_slice(&token_limit.to_be_bytes()),
        Record::Grant { .. } => encode_grant(record, out),
        Record::Free { key, token, reason } => {
            assert!(key.len() <= KEY_LEN_MAX, "key longer than KEY_LEN_MAX");
            put_bytes16(out, key);
            out.extend_from_slice(&token.to_be_bytes());
            out.push(reason as u8);
        }
        Record::SnapshotBegin { segment_seq } | Record::SnapshotEnd { segment_seq } => {
            out.extend_from_slice(&segment_seq.to_be_bytes());
        }
        Record::Renew { key, token, ttl_ms } => {
            assert!(key.len() <= KEY_LEN_MAX, "key longer than KEY_LEN_MAX");
            put_bytes16(out, key);
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(&ttl_ms.to_be_bytes());
        }
        Record::SessionOpen {
            session_id,
            ttl_ms,
            owner,
        } => {
            assert!(
                owner.len() <= OWNER_LEN_MAX,
                "owner longer than OWNER_LEN_MAX"
            );
            out.extend_from_slice(&session_id);
            out.extend_from_slice(&ttl_ms.to_be_bytes());
            put_bytes16(out, owner);
        }
        Record::SessionEnd { session_id, how } => {
            out.extend_from_slice(&session_id);
            out.push(how as u8);
        }
    }
    assert_eq!(out.len() - start, RECORD_HEADER_LEN + payload_len);
    let crc = crc32fast::hash(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
}

/// A Grant's payload: the fields of every grant, then the optional ones in flag-bit order.
fn encode_grant(record: &Record<'_>, out: &mut Vec<u8>) {
    let Record::Grant {
        key,
        lease_id,
        token,
        ttl_ms,
        flags,
        meta,
        acquire_id,
        session_id,
        kind,
    } = *record
    else {
        unreachable!("encode_grant called with {record:?}")
    };
    assert!(key.len() <= KEY_LEN_MAX, "key longer than KEY_LEN_MAX");
    assert_eq!(
        flags & GRANT_FLAG_SESSION != 0,
        session_id.is_some(),
        "grant flags disagree with its session id"
    );
    assert!(meta.len() <= META_LEN_MAX, "meta longer than META_LEN_MAX");
    assert_eq!(
        flags & GRANT_FLAG_ACQUIRE_ID != 0,
        acquire_id.is_some(),
        "grant flags disagree with its acquire id"
    );
    assert!(
        flags & GRANT_FLAGS_KIND == 0,
        "kind bits in a grant's flags"
    );
    put_bytes16(out, key);
    out.extend_from_slice(&lease_id);
    out.extend_from_slice(&token.to_be_bytes());
    out.extend_from_slice(&ttl_ms.to_be_bytes());
    let kind_bits = match kind {
        LeaseKind::Exclusive => 0,
        LeaseKind::Shared => GRANT_FLAG_SHARED,
        LeaseKind::Permits { .. } => GRANT_FLAG_PERMITS,
    };
    out.push(flags | kind_bits);
    put_bytes16(out, meta);
    if let Some(acquire_id) = acquire_id {
        out.extend_from_slice(&acquire_id);
    }
    if let Some(session_id) = session_id {
        out.extend_from_slice(&session_id);
    }
    if let LeaseKind::Permits { count, limit } = kind {
        out.extend_from_slice(&count.to_be_bytes());
        out.extend_from_slice(&limit.to_be_bytes());
    }
}

fn put_bytes16(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// Why the bytes at some offset are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The buffer ends before the record does (a torn write, if at the end of the log).
    Incomplete {
        /// Bytes the record needs, as far as the header tells.
        needed: usize,
        /// Bytes available.
        available: usize,
    },
    /// The header announces a payload longer than [`PAYLOAD_LEN_MAX`].
    LengthImpossible {
        /// The announced payload length.
        len: u32,
    },
    /// The stored checksum does not match the type byte and payload.
    Checksum {
        /// Checksum stored in the header.
        stored: u32,
        /// Checksum of the bytes actually read.
        computed: u32,
    },
    /// The checksum matched but the type byte is unknown.
    UnknownType(u8),
    /// The checksum matched but the payload does not parse.
    Malformed(&'static str),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Incomplete { needed, available } => {
                write!(
                    f,
                    "incomplete record: needs {needed} bytes, {available} left"
                )
            }
            DecodeError::LengthImpossible { len } => {
                write!(f, "impossible payload length {len} (max {PAYLOAD_LEN_MAX})")
            }
            DecodeError::Checksum { stored, computed } => {
                write!(
                    f,
                    "checksum mismatch: stored {stored:08x}, computed {computed:08x}"
                )
            }
            DecodeError::UnknownType(t) => write!(f, "unknown record type {t}"),
            DecodeError::Malformed(why) => write!(f, "malformed payload: {why}"),
        }
    }
}

/// Decodes the record at the start of `buf`, returning it and its encoded length.
///
/// # Errors
/// [`DecodeError`] if the bytes are not one whole, intact record.
pub fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    if buf.len() < RECORD_HEADER_LEN {
        return Err(DecodeError::Incomplete {
            needed: RECORD_HEADER_LEN,
            available: buf.len(),
        });
    }
    let len = u32::from_be_bytes(buf[0..4].try_into().expect("4 bytes"));
    // Check the length before trusting it for anything, allocation included.
    if len as usize > PAYLOAD_LEN_MAX {
        return Err(DecodeError::LengthImpossible { len });
    }
    let total = RECORD_HEADER_LEN + len as usize;
    if buf.len() < total {
        return Err(DecodeError::Incomplete {
            needed: total,
            available: buf.len(),
        });
    }
    let stored = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes"));
    let computed = crc32fast::hash(&buf[8..total]);
    if stored != computed {
        return Err(DecodeError::Checksum { stored, computed });
    }
    let record = decode_payload(buf[8], &buf[RECORD_HEADER_LEN..total])?;
    Ok((record, total))
}

fn decode_payload(type_byte: u8, payload: &[u8]) -> Result<Record<'_>, DecodeError> {
    let mut r = Reader { buf: payload };
    let record = match type_byte {
        TYPE_RESERVE => Record::Reserve {
            token_limit: r.u64()?,
        },
        TYPE_GRANT => decode_grant(&mut r)?,
        TYPE_FREE => Record::Free {
            key: r.bytes16(KEY_LEN_MAX, "key too long")?,
            token: r.u64()?,
            reason: FreeReason::from_u8(r.u8()?)
                .ok_or(DecodeError::Malformed("unknown free reason"))?,
        },
        TYPE_SNAPSHOT_BEGIN => Record::SnapshotBegin {
            segment_seq: r.u64()?,
        },
        TYPE_SNAPSHOT_END => Record::SnapshotEnd {
            segment_seq: r.u64()?,
        },
        TYPE_RENEW => Record::Renew {
            key: r.bytes16(KEY_LEN_MAX, "key too long")?,
            token: r.u64()?,
            ttl_ms: r.u32()?,
        },
        TYPE_SESSION_OPEN => Record::SessionOpen {
            session_id: r.array()?,
            ttl_ms: r.u32()?,
            owner: r.bytes16(OWNER_LEN_MAX, "session owner too long")?,
        },
        TYPE_SESSION_END => Record::SessionEnd {
            session_id: r.array()?,
            how: SessionEnd::from_u8(r.u8()?)
                .ok_or(DecodeError::Malformed("unknown session end"))?,
        },
        other => return Err(DecodeError::UnknownType(other)),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::Malformed("trailing bytes after payload"));
    }
    Ok(record)
}

/// A Grant payload: the fields of every grant, then a semaphore's counts if flagged.
fn decode_grant<'a>(r: &mut Reader<'a>) -> Result<Record<'a>, DecodeError> {
    let key = r.bytes16(KEY_LEN_MAX, "key too long")?;
    let lease_id = r.array()?;
    let token = r.u64()?;
    let ttl_ms = r.u32()?;
    let flags = r.u8()?;
    let meta = r.bytes16(META_LEN_MAX, "meta too long")?;
    let acquire_id = if flags & GRANT_FLAG_ACQUIRE_ID != 0 {
        Some(r.array()?)
    } else {
        None
    };
    let session_id = if flags & GRANT_FLAG_SESSION != 0 {
        Some(r.array()?)
    } else {
        None
    };
    let kind = match flags & GRANT_FLAGS_KIND {
        0 => LeaseKind::Exclusive,
        GRANT_FLAG_SHARED => LeaseKind::Shared,
        GRANT_FLAG_PERMITS => LeaseKind::Permits {
            count: r.u32()?,
            limit: r.u32()?,
        },
        _ => return Err(DecodeError::Malformed("grant both shared and permits")),
    };
    if kind.validate().is_err() {
        return Err(DecodeError::Malformed("grant's permit counts out of range"));
    }
    Ok(Record::Grant {
        key,
        lease_id,
        token,
        ttl_ms,
        flags: flags & !GRANT_FLAGS_KIND,
        meta,
        acquire_id,
        session_id,
        kind,
    })
}

/// Cursor over a payload; every read fails cleanly on a short buffer.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Malformed("payload shorter than its fields"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn bytes16(&mut self, len_max: usize, why: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = usize::from(u16::from_be_bytes(self.array()?));
        if len > len_max {
            return Err(DecodeError::Malformed(why));
        }
        self.take(len)
    }
}

/// What a segment header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// The segment's sequence number.
    pub seq: u64,
    /// Every fencing token handed out before the segment was created is below this.
    pub token_floor: u64,
}

/// Encodes the header that opens segment `header.seq`.
pub fn encode_segment_header(header: SegmentHeader) -> [u8; SEGMENT_HEADER_LEN] {
    let mut out = [0u8; SEGMENT_HEADER_LEN];
    out[0..8].copy_from_slice(&SEGMENT_MAGIC);
    out[8..12].copy_from_slice(&SEGMENT_VERSION.to_be_bytes());
    out[12..20].copy_from_slice(&header.seq.to_be_bytes());
    out[20..28].copy_from_slice(&header.token_floor.to_be_bytes());
    let crc = crc32fast::hash(&out[..SEGMENT_HEADER_CHECKED_LEN]);
    out[SEGMENT_HEADER_CHECKED_LEN..].copy_from_slice(&crc.to_be_bytes());
    out
}

/// Why a segment header is unusable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer than [`SEGMENT_HEADER_LEN`] bytes.
    Incomplete,
    /// The magic bytes are wrong: not a tenure WAL segment.
    Magic,
    /// The header checksum does not match.
    Checksum,
    /// A format version this build does not read.
    Version(u32),
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Incomplete => write!(f, "segment header incomplete"),
            HeaderError::Magic => write!(f, "bad magic: not a tenure WAL segment"),
            HeaderError::Checksum => write!(f, "segment header checksum mismatch"),
            HeaderError::Version(v) => {
                write!(
                    f,
                    "segment format version {v}, this build reads {SEGMENT_VERSION}"
                )
            }
        }
    }
}

/// Decodes a segment header.
///
/// # Errors
/// [`HeaderError`] if the header is short, foreign, damaged or of another version. An older
/// version is recognised before the length and checksum (its header was shorter), so a
/// version 1 segment is reported as such rather than as damage.
pub fn decode_segment_header(buf: &[u8]) -> Result<SegmentHeader, HeaderError> {
    if buf.get(0..8).is_some_and(|magic| magic != SEGMENT_MAGIC) {
        return Err(HeaderError::Magic);
    }
    let version = buf
        .get(8..12)
        .map(|v| u32::from_be_bytes(v.try_into().expect("4 bytes")));
    if let Some(old @ 1..SEGMENT_VERSION) = version {
        // An older build's segment, whose header is shorter: name it, do not call it damage.
        return Err(HeaderError::Version(old));
    }
    let Some(header) = buf.get(..SEGMENT_HEADER_LEN) else {
        return Err(HeaderError::Incomplete);
    };
    let stored = u32::from_be_bytes(
        header[SEGMENT_HEADER_CHECKED_LEN..]
            .try_into()
            .expect("4 bytes"),
    );
    if stored != crc32fast::hash(&header[..SEGMENT_HEADER_CHECKED_LEN]) {
        return Err(HeaderError::Checksum);
    }
    if version != Some(SEGMENT_VERSION) {
        return Err(HeaderError::Version(version.unwrap_or(0)));
    }
    Ok(SegmentHeader {
        seq: u64::from_be_bytes(header[12..20].try_into().expect("8 bytes")),
        token_floor: u64::from_be_bytes(header[20..28].try_into().expect("8 bytes")),
    })
}

#[cfg(test)]
mod tests {
    use tenure_protocol::LeaseId;

    use super::*;

    #[test]
    fn grant_kinds_are_flag_bits_3_and_4() {
        let grant = |kind| Record::Grant {
            key: b"k",
            lease_id: [1; 16],
            token: 5,
            ttl_ms: 100,
            flags: 0,
            meta: b"",
            acquire_id: None,
            session_id: None,
            kind,
        };
        let mut plain = Vec::new();
        encode(&grant(LeaseKind::Exclusive), &mut plain);
        let mut permits = Vec::new();
        encode(
            &grant(LeaseKind::Permits { count: 2, limit: 4 }),
            &mut permits,
        );
        // The flags byte sits after the key (2 + 1), lease id, token and TTL.
        let flags_at = RECORD_HEADER_LEN + 3 + 16 + 8 + 4;
        assert_eq!(plain[flags_at], 0, "a plain grant is written as before");
        assert_eq!(permits[flags_at], GRANT_FLAG_PERMITS);
        assert_eq!(&permits[permits.len() - 8..], &[0, 0, 0, 2, 0, 0, 0, 4]);
        let mut shared = Vec::new();
        encode(&grant(LeaseKind::Shared), &mut shared);
        assert_eq!(shared[flags_at], GRANT_FLAG_SHARED);
        assert_eq!(shared.len(), plain.len());
        // Both kind bits, or counts out of range, are corruption, not a lease.
        let mut bad = shared.clone();
        bad[flags_at] = GRANT_FLAG_SHARED | GRANT_FLAG_PERMITS;
        let sum = crc32fast::hash(&bad[8..]);
        bad[4..8].copy_from_slice(&sum.to_be_bytes());
        assert!(matches!(decode(&bad), Err(DecodeError::Malformed(_))));
        let mut bad = permits.clone();
        let len = bad.len();
        bad[len - 8..len - 4].copy_from_slice(&5u32.to_be_bytes()); // 5 of 4
        let sum = crc32fast::hash(&bad[8..]);
        bad[4..8].copy_from_slice(&sum.to_be_bytes());
        assert!(matches!(decode(&bad), Err(DecodeError::Malformed(_))));
    }

    fn samples() -> Vec<Record<'static>> {
        let key_max: &'static [u8] = Box::leak(vec![b'k'; KEY_LEN_MAX].into_boxed_slice());
        let meta_max: &'static [u8] = Box::leak(vec![7u8; META_LEN_MAX].into_boxed_slice());
        vec![
            Record::Reserve { token_limit: 0 },
            Record::Reserve {
                token_limit: u64::MAX,
            },
            Record::Grant {
                key: b"jobs/42",
                lease_id: LeaseId::from_u128(0xdead_beef).0,
                token: 17,
                ttl_ms: 30_000,
                flags: GRANT_FLAG_RELEASE_ON_DISCONNECT,
                meta: b"host-a pid 12",
                acquire_id: None,
                session_id: None,
                kind: Default::default(),
            },
            Record::Grant {
                key: b"",
                lease_id: [0; 16],
                token: 0,
                ttl_ms: 0,
                flags: 0,
                meta: b"",
                acquire_id: None,
                session_id: None,
                kind: Default::default(),
            },
            Record::Grant {
                key: key_max,
                lease_id: [0xff; 16],
                token: u64::MAX,
                ttl_ms: u32::MAX,
                flags: !GRANT_FLAGS_KIND,
                meta: meta_max,
                acquire_id: Some([0xee; 16]),
                session_id: Some([0xdd; 16]),
                kind: Default::default(),
            },
            Record::Grant {
                key: b"readers",
                lease_id: [3; 16],
                token: 18,
                ttl_ms: 1_000,
                flags: GRANT_FLAG_RELEASE_ON_DISCONNECT,
                meta: b"r",
                acquire_id: None,
                session_id: None,
                kind: LeaseKind::Shared,
            },
            Record::Grant {
                key: key_max,
                lease_id: [0xfe; 16],
                token: u64::MAX - 1,
                ttl_ms: u32::MAX,
                flags: !GRANT_FLAGS_KIND,
                meta: meta_max,
                acquire_id: Some([0xed; 16]),
                session_id: Some([0xdc; 16]),
                kind: LeaseKind::Permits {
                    count: 3,
                    limit: tenure_protocol::limits::PERMITS_MAX,
                },
            },
            Record::Free {
                key: b"jobs/42",
                token: 17,
                reason: FreeReason::Released,
            },
            Record::Free {
                key: b"x",
                token: 1,
                reason: FreeReason::Expired,
            },
            Record::Free {
                key: key_max,
                token: 2,
                reason: FreeReason::Disconnected,
            },
            Record::Free {
                key: b"s",
                token: 3,
                reason: FreeReason::Session,
            },
            Record::SnapshotBegin { segment_seq: 9 },
            Record::SnapshotEnd { segment_seq: 9 },
            Record::Renew {
                key: b"jobs/42",
                token: 17,
                ttl_ms: 60_000,
            },
            Record::Renew {
                key: key_max,
                token: u64::MAX,
                ttl_ms: u32::MAX,
            },
            Record::Grant {
                key: b"in-session",
                lease_id: [4; 16],
                token: 19,
                ttl_ms: 2_000,
                flags: GRANT_FLAG_SESSION,
                meta: b"",
                acquire_id: None,
                session_id: Some([0x5e; 16]),
                kind: LeaseKind::Permits { count: 1, limit: 2 },
            },
            Record::SessionOpen {
                session_id: [0x5e; 16],
                ttl_ms: 10_000,
                owner: b"orders",
            },
            Record::SessionOpen {
                session_id: [0xff; 16],
                ttl_ms: u32::MAX,
                owner: Box::leak(vec![b'o'; OWNER_LEN_MAX].into_boxed_slice()),
            },
            Record::SessionOpen {
                session_id: [0; 16],
                ttl_ms: 0,
                owner: b"",
            },
            Record::SessionEnd {
                session_id: [0x5e; 16],
                how: SessionEnd::Closed,
            },
            Record::SessionEnd {
                session_id: [1; 16],
                how: SessionEnd::Expired,
            },
        ]
    }

    /// Types 7 and 9 and grant flag bit 2, byte by byte: a session id is 16 bytes after the
    /// acquire id (optional fields in flag-bit order), before a semaphore's counts.
    #[test]
    fn session_records_and_the_session_flag_are_laid_out_as_documented() {
        let mut open = Vec::new();
        let record = Record::SessionOpen {
            session_id: [0xab; 16],
            ttl_ms: 0x0102_0304,
            owner: b"ab",
        };
        encode(&record, &mut open);
        assert_eq!(open[8], 7);
        let mut payload = vec![0xab; 16];
        payload.extend_from_slice(&[1, 2, 3, 4, 0, 2, b'a', b'b']);
        assert_eq!(&open[RECORD_HEADER_LEN..], &payload[..]);
        let mut end = Vec::new();
        let record = Record::SessionEnd {
            session_id: [0xab; 16],
            how: SessionEnd::Expired,
        };
        encode(&record, &mut end);
        assert_eq!(end[8], 9);
        assert_eq!(&end[RECORD_HEADER_LEN + 16..], &[2]);
        let mut grant = Vec::new();
        let record = Record::Grant {
            key: b"k",
            lease_id: [1; 16],
            token: 5,
            ttl_ms: 100,
            flags: GRANT_FLAG_ACQUIRE_ID | GRANT_FLAG_SESSION,
            meta: b"",
            acquire_id: Some([0xa1; 16]),
            session_id: Some([0x5e; 16]),
            kind: LeaseKind::Permits { count: 1, limit: 3 },
        };
        encode(&record, &mut grant);
        let flags_at = RECORD_HEADER_LEN + 3 + 16 + 8 + 4;
        assert_eq!(grant[flags_at], 0b0001_0110);
        let ids_at = flags_at + 1 + 2;
        assert_eq!(&grant[ids_at..ids_at + 16], &[0xa1; 16]);
        assert_eq!(&grant[ids_at + 16..ids_at + 32], &[0x5e; 16]);
        assert_eq!(&grant[ids_at + 32..], &[0, 0, 0, 1, 0, 0, 0, 3]);
        // A session flag whose id is missing, or an unknown end, is malformed, not a lease.
        let mut bad = grant[..grant.len() - 24].to_vec();
        let len = (bad.len() - RECORD_HEADER_LEN) as u32;
        bad[..4].copy_from_slice(&len.to_be_bytes());
        let sum = crc32fast::hash(&bad[8..]);
        bad[4..8].copy_from_slice(&sum.to_be_bytes());
        assert!(matches!(decode(&bad), Err(DecodeError::Malformed(_))));
        let mut bad = end.clone();
        let last = bad.len() - 1;
        bad[last] = 0;
        let sum = crc32fast::hash(&bad[8..]);
        bad[4..8].copy_from_slice(&sum.to_be_bytes());
        assert!(matches!(decode(&bad), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn every_record_type_round_trips() {
        for record in samples() {
            let mut buf = vec![0xAA]; // encode appends; prove it leaves earlier bytes alone
            encode(&record, &mut buf);
            assert_eq!(buf[0], 0xAA);
            assert_eq!(buf.len() - 1, record.encoded_len());
            assert!(record.encoded_len() <= RECORD_LEN_MAX);
            let (decoded, used) = decode(&buf[1..]).expect("decodes");
            assert_eq!(decoded, record);
            assert_eq!(used, record.encoded_len());
        }
    }

    #[test]
    fn every_strict_prefix_is_incomplete() {
        for record in samples() {
            let mut buf = Vec::new();
            encode(&record, &mut buf);
            for cut in 0..buf.len() {
                assert!(
                    matches!(decode(&buf[..cut]), Err(DecodeError::Incomplete { .. })),
                    "cut {cut} of {record:?}"
                );
            }
        }
    }

    #[test]
    fn any_flipped_byte_is_detected() {
        let record = samples()[2];
        let mut buf = Vec::new();
        encode(&record, &mut buf);
        for at in 0..buf.len() {
            let mut bad = buf.clone();
            bad[at] ^= 0x01;
            assert!(decode(&bad).is_err(), "flip at {at} went unnoticed");
        }
    }

    #[test]
    fn impossible_length_is_rejected_before_reading_payload() {
        let mut buf = vec![0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, TYPE_GRANT];
        assert_eq!(
            decode(&buf),
            Err(DecodeError::LengthImpossible { len: u32::MAX })
        );
        let just_over = (PAYLOAD_LEN_MAX + 1) as u32;
        buf[0..4].copy_from_slice(&just_over.to_be_bytes());
        assert_eq!(
            decode(&buf),
            Err(DecodeError::LengthImpossible { len: just_over })
        );
    }

    #[test]
    fn valid_checksum_with_bad_payload_is_malformed_or_unknown() {
        let forge = |type_byte: u8, payload: &[u8]| {
            let mut buf = (payload.len() as u32).to_be_bytes().to_vec();
            let mut body = vec![type_byte];
            body.extend_from_slice(payload);
            buf.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
            buf.extend_from_slice(&body);
            buf
        };
        assert_eq!(decode(&forge(0, &[])), Err(DecodeError::UnknownType(0)));
        assert_eq!(decode(&forge(99, &[1])), Err(DecodeError::UnknownType(99)));
        assert!(matches!(
            decode(&forge(TYPE_RESERVE, &[1, 2])),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            decode(&forge(TYPE_RESERVE, &[0; 9])),
            Err(DecodeError::Malformed(_))
        ));
        let mut free = vec![0, 1, b'k'];
        free.extend_from_slice(&5u64.to_be_bytes());
        free.push(9); // no such reason
        assert!(matches!(
            decode(&forge(TYPE_FREE, &free)),
            Err(DecodeError::Malformed(_))
        ));
        let long_key = ((KEY_LEN_MAX + 1) as u16).to_be_bytes();
        assert!(matches!(
            decode(&forge(TYPE_FREE, &long_key)),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            decode(&forge(TYPE_RENEW, &long_key)),
            Err(DecodeError::Malformed(_))
        ));
        let mut renew = vec![0, 1, b'k'];
        renew.extend_from_slice(&5u64.to_be_bytes());
        renew.extend_from_slice(&[0, 0, 1]); // ttl_ms one byte short
        assert!(matches!(
            decode(&forge(TYPE_RENEW, &renew)),
            Err(DecodeError::Malformed(_))
        ));
        assert_eq!(decode(&forge(8, &[])), Err(DecodeError::UnknownType(8)));
        assert_eq!(decode(&forge(10, &[])), Err(DecodeError::UnknownType(10)));
        assert!(!is_known_type(8) && is_known_type(7) && is_known_type(9));
        assert!(matches!(
            decode(&forge(TYPE_SESSION_OPEN, &[0; 16])),
            Err(DecodeError::Malformed(_))
        ));
        let mut open = vec![0; 20];
        open.extend_from_slice(&((OWNER_LEN_MAX + 1) as u16).to_be_bytes());
        assert!(matches!(
            decode(&forge(TYPE_SESSION_OPEN, &open)),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn segment_header_round_trips_and_rejects_damage() {
        let sample = SegmentHeader {
            seq: 0x0123_4567_89ab_cdef,
            token_floor: 0xfedc_ba98_7654_3210,
        };
        let header = encode_segment_header(sample);
        assert_eq!(decode_segment_header(&header), Ok(sample));
        assert_eq!(
            decode_segment_header(&header[..SEGMENT_HEADER_LEN - 1]),
            Err(HeaderError::Incomplete)
        );
        let mut bad = header;
        bad[0] = b'X';
        assert_eq!(decode_segment_header(&bad), Err(HeaderError::Magic));
        for at in [15, 23] {
            let mut bad = header;
            bad[at] ^= 1;
            assert_eq!(decode_segment_header(&bad), Err(HeaderError::Checksum));
        }
        let mut bad = header;
        bad[8..12].copy_from_slice(&3u32.to_be_bytes());
        let crc = crc32fast::hash(&bad[..SEGMENT_HEADER_CHECKED_LEN]);
        bad[SEGMENT_HEADER_CHECKED_LEN..].copy_from_slice(&crc.to_be_bytes());
        assert_eq!(decode_segment_header(&bad), Err(HeaderError::Version(3)));
        // A version 1 header (24 bytes, no token floor) is named, not called damage.
        let mut v1 = header[..24].to_vec();
        v1[8..12].copy_from_slice(&1u32.to_be_bytes());
        assert_eq!(decode_segment_header(&v1), Err(HeaderError::Version(1)));
    }
}
