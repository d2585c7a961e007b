//! Requests, responses and their byte layout.
//!
//! Every frame after the handshake has the same header; the body depends on the opcode:
//!
//! ```text
//!  0       4        5                13
//! +-------+--------+----------------+------------------+
//! | len   | opcode | request_id     | body ...         |
//! | u32BE | u8     | u64BE          | len - 9 bytes    |
//! +-------+--------+----------------+------------------+
//!   len counts everything after itself: 9 <= len <= FRAME_LEN_MAX
//! ```
//!
//! Variable-length fields (keys, metadata, messages, stat names) carry their own big-endian
//! length: `u16` for keys, metadata and messages, `u8` for stat names. PROTOCOL.md draws every
//! body; the tables there and the `encode_*`/`decode_*` pairs here describe the same bytes.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::cluster::{Member, Status};
use crate::error::{ErrorCode, FrameError, ProtocolError};
use crate::lease::{AcquireId, LeaseId, SessionId};
use crate::limits::*;

/// Request opcodes (client to server).
pub mod op {
    /// Liveness probe.
    pub const PING: u8 = 0x01;
    /// Take a lock, optionally waiting in line.
    pub const ACQUIRE: u8 = 0x02;
    /// Extend a lease the caller holds.
    pub const RENEW: u8 = 0x03;
    /// Give a lock back.
    pub const RELEASE: u8 = 0x04;
    /// Read a key's state.
    pub const INSPECT: u8 = 0x05;
    /// Ask whether a fencing token belongs to the live holder.
    pub const CHECK: u8 = 0x06;
    /// Server counters.
    pub const STATS: u8 = 0x07;
    /// Subscribe to a key's changes.
    pub const WATCH: u8 = 0x08;
    /// End a subscription.
    pub const UNWATCH: u8 = 0x09;
    /// Prove an identity: name and secret.
    pub const AUTH: u8 = 0x0A;
    /// Cluster mode: the answering node's view of its cluster.
    pub const CLUSTER_STATUS: u8 = 0x0B;
    /// Cluster mode: make the first membership, on a node not yet initialised.
    pub const CLUSTER_INIT: u8 = 0x0C;
    /// Cluster mode: add a node (as a learner, then a voter); the leader only.
    pub const CLUSTER_ADD: u8 = 0x0D;
    /// Cluster mode: remove a node from the membership; the leader only.
    pub const CLUSTER_REMOVE: u8 = 0x0E;
    /// Open a session of a TTL: one keep-alive for many leases (PROTOCOL.md 3.11).
    pub const SESSION_OPEN: u8 = 0x0F;
    /// Renew a session, and with it every lease in it.
    pub const SESSION_KEEPALIVE: u8 = 0x10;
    /// End a session, freeing every lease in it.
    pub const SESSION_CLOSE: u8 = 0x11;
}

/// Response opcodes (server to client). Bit 7 is set on every one of them.
pub mod rop {
    /// Reply to PING.
    pub const PONG: u8 = 0x81;
    /// The lock is yours.
    pub const GRANTED: u8 = 0x82;
    /// Someone else holds the lock (and the wait, if any, ran out).
    pub const LOCKED: u8 = 0x83;
    /// The lease was extended.
    pub const RENEWED: u8 = 0x84;
    /// The lease is gone: expired, released or never yours.
    pub const LOST: u8 = 0x85;
    /// The lock was released.
    pub const RELEASED: u8 = 0x86;
    /// Release refused: the lease id does not hold the lock.
    pub const NOT_OWNER: u8 = 0x87;
    /// INSPECT: nobody holds the key.
    pub const FREE: u8 = 0x88;
    /// INSPECT: the key is held.
    pub const HELD: u8 = 0x89;
    /// INSPECT with the kinds flag of a read/write or semaphore key: HELD and its kinds.
    pub const HELD_KINDS: u8 = 0x96;
    /// CHECK: the token belongs to the live holder.
    pub const CURRENT: u8 = 0x8A;
    /// CHECK: the token does not belong to the live holder.
    pub const STALE: u8 = 0x8B;
    /// Server counters.
    pub const STATS: u8 = 0x8C;
    /// WATCH accepted, with the key's state at that moment; events follow with the same
    /// request id.
    pub const WATCHING: u8 = 0x8D;
    /// UNWATCH done; no more events for that watch.
    pub const UNWATCHED: u8 = 0x8E;
    /// AUTH accepted: the connection now acts as that identity.
    pub const AUTHENTICATED: u8 = 0x8F;
    /// The answering node's view of its cluster: answers every CLUSTER_* request.
    pub const CLUSTER: u8 = 0x90;
    /// ACQUIRE with an acquire id: a repeat of an ACQUIRE whose lease still runs, answered
    /// with that lease. Only a request that carries an acquire id is ever answered with it.
    pub const REGRANTED: u8 = 0x91;
    /// ACQUIRE with an acquire id: a repeat of an ACQUIRE whose lease has ended, and how.
    /// Only a request that carries an acquire id is ever answered with it.
    pub const ACQUIRE_ENDED: u8 = 0x92;
    /// SESSION_OPEN or SESSION_KEEPALIVE: the session is live for its TTL from the request.
    pub const SESSION: u8 = 0x93;
    /// SESSION_CLOSE: the session ended, and how many leases that freed.
    pub const SESSION_CLOSED: u8 = 0x94;
    /// A pushed watch event, carrying the WATCH request's id.
    pub const EVENT: u8 = 0xA0;
    /// The request failed; see the error code.
    pub const ERROR: u8 = 0xFF;
}

/// ACQUIRE flag: free the lock the moment the acquiring connection closes.
pub const FLAG_RELEASE_ON_DISCONNECT: u8 = 0x01;
/// ACQUIRE flag: a 16-byte acquire id follows `meta` (PROTOCOL.md "Acquire ids").
pub const FLAG_ACQUIRE_ID: u8 = 0x02;
/// ACQUIRE flag: a `kind` byte (and, for permits, `count [4] limit [4]`) follows the other
/// fields: a shared (read) lease or semaphore permits; see [`crate::kind`].
pub const FLAG_KIND: u8 = 0x08;
/// ACQUIRE flag: a 16-byte session id follows (after the acquire id, if any): the lease lives
/// while that session lives (PROTOCOL.md 3.11).
pub const FLAG_SESSION: u8 = 0x04;
/// Every ACQUIRE flag this version understands; others are rejected so they can gain meaning later.
pub const FLAGS_KNOWN: u8 = FLAG_RELEASE_ON_DISCONNECT | FLAG_ACQUIRE_ID | FLAG_SESSION | FLAG_KIND;

/// The request id no request may carry: frames with it answer no request (an error about the
/// connection as a whole), so a client can always tell them apart.
pub const REQUEST_ID_NONE: u64 = 0;

/// WATCHING `state` byte: nobody holds the key; nothing follows.
pub const WATCH_STATE_FREE: u8 = 0;
/// WATCHING `state` byte: the key is held; the holder's fields follow, laid out as HELD's body.
pub const WATCH_STATE_HELD: u8 = 1;

/// One request, as the client sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Liveness probe.
    Ping,
    /// Take `key` for `ttl_ms`; wait up to `wait_ms` in line if it is held (0: do not wait).
    Acquire {
        /// The lock's name.
        key: Bytes,
        /// Lease length asked for, in milliseconds.
        ttl_ms: u32,
        /// How long to wait in line, in milliseconds; 0 answers LOCKED at once.
        wait_ms: u32,
        /// Free the lock when this connection closes.
        release_on_disconnect: bool,
        /// Holder metadata readable by INSPECT and watchers (for example a leader's address).
        meta: Bytes,
        /// The client's name for this ACQUIRE, the same in every retry of it: a repeat is
        /// answered with the first one's outcome ([`Response::Regranted`],
        /// [`Response::AcquireEnded`]) instead of being granted again.
        acquire_id: Option<AcquireId>,
        /// Exclusive (no flag bit 3 on the wire), shared, or semaphore permits.
        kind: crate::LeaseKind,
        /// The session the lease is to live in (then `ttl_ms` is 0 and
        /// `release_on_disconnect` false): it has no TTL of its own.
        session_id: Option<SessionId>,
    },
    /// Extend the lease `lease_id` on `key` to `ttl_ms` from now.
    Renew {
        /// The lock's name.
        key: Bytes,
        /// The lease being extended.
        lease_id: LeaseId,
        /// New lease length from now, in milliseconds.
        ttl_ms: u32,
    },
    /// Release `key` if `lease_id` holds it.
    Release {
        /// The lock's name.
        key: Bytes,
        /// The lease being released.
        lease_id: LeaseId,
    },
    /// Read the state of `key`.
    Inspect {
        /// The lock's name.
        key: Bytes,
        /// Ask for HELD_KINDS (holders and waiters by kind) on a read/write or semaphore
        /// key: INSPECT `flags` bit 0; without it the answer is FREE or HELD as always.
        kinds: bool,
    },
    /// Ask whether `token` belongs to the live holder of `key`.
    Check {
        /// The lock's name.
        key: Bytes,
        /// The fencing token to test.
        token: u64,
    },
    /// Server counters.
    Stats,
    /// Push an EVENT for every change of `key` until UNWATCH or disconnect.
    Watch {
        /// The lock's name.
        key: Bytes,
    },
    /// End the watch on `key`.
    Unwatch {
        /// The lock's name.
        key: Bytes,
    },
    /// Act as identity `name`, proven by `secret`.
    Auth {
        /// The identity's name.
        name: Bytes,
        /// Its secret; `Debug` never shows it.
        secret: Secret,
    },
    /// Cluster mode: the answering node's view of its cluster.
    ClusterStatus {
        /// Ask for the reply's extension ([`crate::cluster::StatusExtension`]): sent as a
        /// flags byte with bit 0 set, which a server older than the extension refuses with
        /// `BAD_FRAME` (a client then asks again without it). Without it the body is empty
        /// and the reply has the layout every client parses.
        extended: bool,
    },
    /// Cluster mode: make `members` the first membership, all voters.
    ClusterInit {
        /// The nodes, each with its addresses.
        members: Vec<Member>,
    },
    /// Cluster mode: add `member` as a learner, then make it a voter.
    ClusterAdd {
        /// The node and its addresses.
        member: Member,
    },
    /// Cluster mode: remove node `id` from the membership.
    ClusterRemove {
        /// The node's id.
        id: u64,
    },
    /// Open a session that lives `ttl_ms` from each keep-alive.
    SessionOpen {
        /// The session's TTL, in milliseconds (a lease TTL's range).
        ttl_ms: u32,
        /// The session id the client picked (128 random bits), so that an open sent again
        /// after a lost answer finds the session the first send opened (PROTOCOL.md 3.11);
        /// `None`: the server picks one, and a second send opens a second session.
        session_id: Option<SessionId>,
    },
    /// Renew session `session_id`, and every lease in it, for its TTL from now.
    SessionKeepalive {
        /// The session.
        session_id: SessionId,
    },
    /// End session `session_id`, freeing every lease in it.
    SessionClose {
        /// The session.
        session_id: SessionId,
    },
}

/// A secret on its way to the server. Its `Debug` prints `<secret>`, so a request logged with
/// `{:?}` does not leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Bytes);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<secret>")
    }
}

/// What happened to a watched key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A new holder was granted the lock.
    Granted = 1,
    /// The holder released the lock.
    Released = 2,
    /// The holder's lease ran out.
    Expired = 3,
}

/// How the lease of a repeated ACQUIRE ended ([`Response::AcquireEnded`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndedHow {
    /// Its holder released it.
    Released = 1,
    /// Its TTL ran out.
    Expired = 2,
    /// Its connection closed and it was to be released then.
    Disconnected = 3,
    /// It was a session lease and its session ended (closed or expired).
    Session = 4,
}

impl EndedHow {
    /// The wire byte's meaning, if it has one.
    pub fn from_u8(value: u8) -> Option<EndedHow> {
        match value {
            1 => Some(EndedHow::Released),
            2 => Some(EndedHow::Expired),
            3 => Some(EndedHow::Disconnected),
            4 => Some(EndedHow::Session),
            _ => None,
        }
    }

    /// The console's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            EndedHow::Released => "released",
            EndedHow::Expired => "expired",
            EndedHow::Disconnected => "disconnected",
            EndedHow::Session => "session",
        }
    }
}

/// A key's holder, as a WATCHING reply reports it (the same fields as [`Response::Held`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The holder's fencing token.
    pub token: u64,
    /// Time left on the holder's lease, in milliseconds.
    pub ttl_left_ms: u32,
    /// Acquires waiting in line.
    pub waiters: u32,
    /// The holder's metadata.
    pub meta: Bytes,
}

/// One reply or pushed event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// Reply to PING.
    Pong,
    /// The lock is yours until `waited_ms + ttl_ms` after you sent the request (count it
    /// from an instant taken before sending).
    Granted {
        /// Fencing token: larger than every token granted for this key before.
        token: u64,
        /// Present it to renew or release.
        lease_id: LeaseId,
        /// Lease length granted, in milliseconds, counted from the grant.
        ttl_ms: u32,
        /// How long the request waited on the server before it was granted, in milliseconds
        /// of the server's monotonic clock, from taking the request up to the grant: 0 for
        /// an immediate grant, the time in line for a blocking acquire.
        waited_ms: u32,
    },
    /// A repeat of an ACQUIRE (same key, same acquire id) whose lease still runs: that lease,
    /// unchanged. It runs `ttl_left_ms` from the server's receipt of the repeat (count it
    /// from an instant taken before sending the repeat).
    Regranted {
        /// The lease's fencing token, as first granted.
        token: u64,
        /// The lease's id, as first granted.
        lease_id: LeaseId,
        /// Time left on the lease, in milliseconds.
        ttl_left_ms: u32,
    },
    /// A repeat of an ACQUIRE whose lease was granted and has ended since: nothing was
    /// granted now.
    AcquireEnded {
        /// How it ended.
        how: EndedHow,
        /// The ended lease's fencing token.
        token: u64,
    },
    /// Someone else holds the lock.
    Locked {
        /// The holder's fencing token.
        token: u64,
        /// Time left on the holder's lease, in milliseconds.
        ttl_left_ms: u32,
    },
    /// The lease now runs `ttl_ms` from the server's receipt of the request.
    Renewed {
        /// Lease length from now, in milliseconds.
        ttl_ms: u32,
    },
    /// The lease is gone.
    Lost,
    /// The lock was released.
    Released,
    /// The lease id does not hold the lock; nothing changed.
    NotOwner,
    /// Nobody holds the key.
    Free,
    /// The key is held.
    Held {
        /// The holder's fencing token.
        token: u64,
        /// Time left on the holder's lease, in milliseconds.
        ttl_left_ms: u32,
        /// Acquires waiting in line.
        waiters: u32,
        /// The holder's metadata.
        meta: Bytes,
    },
    /// A read/write or semaphore key is held (INSPECT asked for kinds): HELD's fields of
    /// the newest holder, and the key's holders and waiters by kind.
    HeldKinds {
        /// The newest holder's fencing token.
        token: u64,
        /// Time until the first holder's lease ends, in milliseconds.
        ttl_left_ms: u32,
        /// Acquires waiting in line, of every kind.
        waiters: u32,
        /// The newest holder's metadata.
        meta: Bytes,
        /// Holders and waiters by kind.
        kinds: crate::kind::HolderKinds,
    },
    /// The token belongs to the live holder.
    Current,
    /// The token does not belong to the live holder.
    Stale,
    /// Server counters, name and value.
    Stats(Vec<(String, u64)>),
    /// The watch is on. `holder` is the key's state when the watch started: every change
    /// after it arrives as an [`Response::Event`], none before it does.
    Watching {
        /// The holder at that moment; `None` if the key was free.
        holder: Option<Holder>,
    },
    /// The watch is off.
    Unwatched,
    /// AUTH accepted: the connection now acts as identity `name`.
    Authenticated {
        /// The identity's name, as AUTH gave it.
        name: Bytes,
    },
    /// Cluster mode: the answering node's view of its cluster, after the change for INIT,
    /// ADD and REMOVE.
    Cluster(Status),
    /// SESSION_OPEN or SESSION_KEEPALIVE: the session (and every lease in it) runs `ttl_ms`
    /// from the server's handling of the request (count it from an instant taken before
    /// sending).
    Session {
        /// The session.
        session_id: SessionId,
        /// The session's TTL, in milliseconds.
        ttl_ms: u32,
    },
    /// SESSION_CLOSE: the session ended.
    SessionClosed {
        /// How many leases its end freed.
        released: u32,
    },
    /// A change to a watched key.
    Event {
        /// What happened.
        kind: EventKind,
        /// The key that changed.
        key: Bytes,
        /// The fencing token of the lease granted, released or expired.
        token: u64,
        /// The new holder's metadata (empty unless `kind` is `Granted`).
        meta: Bytes,
    },
    /// The request failed.
    Error {
        /// Machine-readable reason.
        code: ErrorCode,
        /// Human-readable reason.
        message: String,
    },
}

/// Writes the 4-byte length and 9-byte header, then lets `body` append the rest.
fn put_frame(dst: &mut BytesMut, opcode: u8, id: u64, body: impl FnOnce(&mut BytesMut)) {
    let start = dst.len();
    dst.put_u32(0); // patched below, once the body's length is known
    dst.put_u8(opcode);
    dst.put_u64(id);
    body(dst);
    let len = dst.len() - start - 4;
    assert!(len <= FRAME_LEN_MAX, "encoder produced a {len}-byte frame");
    dst[start..start + 4].copy_from_slice(&(len as u32).to_be_bytes());
}

fn put_bytes16(dst: &mut BytesMut, bytes: &[u8]) {
    let len = u16::try_from(bytes.len()).expect("field longer than u16 passed to encoder");
    dst.put_u16(len);
    dst.put_slice(bytes);
}

/// INSPECT's optional `flags` byte: whether it asks for kinds.
fn get_inspect_flags(b: &mut Body) -> Result<bool, FrameError> {
    if b.bytes.is_empty() {
        return Ok(false);
    }
    let flags = b.u8("flags")?;
    if flags & !crate::kind::INSPECT_FLAG_KINDS != 0 {
        return Err(FrameError::new(
            ErrorCode::BadFrame,
            format!("unknown inspect flags {flags:#04x}"),
        ));
    }
    Ok(flags != 0)
}

/// Appends an ACQUIRE's kind fields (nothing for an exclusive lease).
fn put_kind(b: &mut BytesMut, kind: crate::LeaseKind) {
    match kind {
        crate::LeaseKind::Exclusive => {}
        crate::LeaseKind::Shared => b.put_u8(crate::kind::KIND_SHARED),
        crate::LeaseKind::Permits { count, limit } => {
            b.put_u8(crate::kind::KIND_PERMITS);
            b.put_u32(count);
            b.put_u32(limit);
        }
    }
}

/// Reads an ACQUIRE's kind fields (flag bit 3 was set).
fn get_kind(b: &mut Body) -> Result<crate::LeaseKind, FrameError> {
    match b.u8("kind")? {
        crate::kind::KIND_SHARED => Ok(crate::LeaseKind::Shared),
        crate::kind::KIND_PERMITS => Ok(crate::LeaseKind::Permits {
            count: b.u32("count")?,
            limit: b.u32("limit")?,
        }),
        other => Err(FrameError::new(
            ErrorCode::BadPermits,
            format!("unknown acquire kind {other}"),
        )),
    }
}

/// Appends one request frame to `dst`.
///
/// # Panics
/// If a field is over its wire limit: callers validate first (see [`Request::validate`]).
pub fn encode_request(id: u64, request: &Request, dst: &mut BytesMut) {
    match request {
        Request::Ping => put_frame(dst, op::PING, id, |_| {}),
        Request::Acquire {
            key,
            ttl_ms,
            wait_ms,
            release_on_disconnect,
            meta,
            acquire_id,
            kind,
            session_id,
        } => put_frame(dst, op::ACQUIRE, id, |b| {
            put_bytes16(b, key);
            b.put_u32(*ttl_ms);
            b.put_u32(*wait_ms);
            let flags = acquire_flags(
                *release_on_disconnect,
                acquire_id.is_some(),
                session_id.is_some(),
                *kind,
            );
            b.put_u8(flags);
            put_bytes16(b, meta);
            // Optional fields follow `meta` in increasing flag-bit order: bits 1, 2, then 3.
            if let Some(acquire_id) = acquire_id {
                b.put_slice(&acquire_id.0);
            }
            if let Some(session_id) = session_id {
                b.put_slice(&session_id.0);
            }
            put_kind(b, *kind);
        }),
        Request::Renew {
            key,
            lease_id,
            ttl_ms,
        } => put_frame(dst, op::RENEW, id, |b| {
            put_bytes16(b, key);
            b.put_slice(&lease_id.0);
            b.put_u32(*ttl_ms);
        }),
        Request::Release { key, lease_id } => put_frame(dst, op::RELEASE, id, |b| {
            put_bytes16(b, key);
            b.put_slice(&lease_id.0);
        }),
        Request::Inspect { key, kinds } => put_frame(dst, op::INSPECT, id, |b| {
            put_bytes16(b, key);
            if *kinds {
                b.put_u8(crate::kind::INSPECT_FLAG_KINDS);
            }
        }),
        Request::Check { key, token } => put_frame(dst, op::CHECK, id, |b| {
            put_bytes16(b, key);
            b.put_u64(*token);
        }),
        Request::Stats => put_frame(dst, op::STATS, id, |_| {}),
        Request::Watch { key } => put_frame(dst, op::WATCH, id, |b| put_bytes16(b, key)),
        Request::Unwatch { key } => put_frame(dst, op::UNWATCH, id, |b| put_bytes16(b, key)),
        Request::Auth { name, secret } => put_frame(dst, op::AUTH, id, |b| {
            put_bytes16(b, name);
            put_bytes16(b, &secret.0);
        }),
        Request::ClusterStatus { extended } => put_frame(dst, op::CLUSTER_STATUS, id, |b| {
            if *extended {
                b.put_u8(crate::cluster::STATUS_FLAG_EXTENDED);
            }
        }),
        Request::ClusterInit { members } => put_frame(dst, op::CLUSTER_INIT, id, |b| {
            crate::cluster::put_members(b, members)
        }),
        Request::ClusterAdd { member } => put_frame(dst, op::CLUSTER_ADD, id, |b| {
            crate::cluster::put_member(b, member)
        }),
        Request::ClusterRemove { id: node } => {
            put_frame(dst, op::CLUSTER_REMOVE, id, |b| b.put_u64(*node))
        }
        Request::SessionOpen { ttl_ms, session_id } => put_frame(dst, op::SESSION_OPEN, id, |b| {
            b.put_u32(*ttl_ms);
            if let Some(session_id) = session_id {
                b.put_slice(&session_id.0);
            }
        }),
        Request::SessionKeepalive { session_id } => {
            put_frame(dst, op::SESSION_KEEPALIVE, id, |b| {
                b.put_slice(&session_id.0)
            })
        }
        Request::SessionClose { session_id } => {
            put_frame(dst, op::SESSION_CLOSE, id, |b| b.put_slice(&session_id.0))
        }
    }
}

/// The ACQUIRE flags byte announcing which optional fields follow `meta`.
#[inline]
fn acquire_flags(
    release_on_disconnect: bool,
    has_acquire_id: bool,
    has_session: bool,
    kind: crate::LeaseKind,
) -> u8 {
    let mut flags = 0;
    if release_on_disconnect {
        flags |= FLAG_RELEASE_ON_DISCONNECT;
    }
    if has_acquire_id {
        flags |= FLAG_ACQUIRE_ID;
    }
    if has_session {
        flags |= FLAG_SESSION;
    }
    if !kind.is_exclusive() {
        flags |= FLAG_KIND;
    }
    flags
}

/// Appends one response frame to `dst`. Over-long error messages are cut to the limit.
pub fn encode_response(id: u64, response: &Response, dst: &mut BytesMut) {
    match response {
        Response::Granted {
            token,
            lease_id,
            ttl_ms,
            waited_ms,
        } => put_frame(dst, rop::GRANTED, id, |b| {
            b.put_u64(*token);
            b.put_slice(&lease_id.0);
            b.put_u32(*ttl_ms);
            b.put_u32(*waited_ms);
        }),
        Response::Regranted {
            token,
            lease_id,
            ttl_left_ms,
        } => put_frame(dst, rop::REGRANTED, id, |b| {
            b.put_u64(*token);
            b.put_slice(&lease_id.0);
            b.put_u32(*ttl_left_ms);
        }),
        Response::AcquireEnded { how, token } => put_frame(dst, rop::ACQUIRE_ENDED, id, |b| {
            b.put_u8(*how as u8);
            b.put_u64(*token);
        }),
        Response::Session { session_id, ttl_ms } => put_frame(dst, rop::SESSION, id, |b| {
            b.put_slice(&session_id.0);
            b.put_u32(*ttl_ms);
        }),
        Response::SessionClosed { released } => {
            put_frame(dst, rop::SESSION_CLOSED, id, |b| b.put_u32(*released))
        }
        Response::Locked { token, ttl_left_ms } => put_frame(dst, rop::LOCKED, id, |b| {
            b.put_u64(*token);
            b.put_u32(*ttl_left_ms);
        }),
        Response::Renewed { ttl_ms } => put_frame(dst, rop::RENEWED, id, |b| b.put_u32(*ttl_ms)),
        Response::Lost => put_frame(dst, rop::LOST, id, |_| {}),
        Response::Released => put_frame(dst, rop::RELEASED, id, |_| {}),
        Response::NotOwner => put_frame(dst, rop::NOT_OWNER, id, |_| {}),
        other => encode_query_response(id, other, dst),
    }
}

/// [`encode_response`] for everything but the lease replies (ACQUIRE, RENEW, RELEASE), which it
/// encodes itself so that the hot path is one match.
fn encode_query_response(id: u64, response: &Response, dst: &mut BytesMut) {
    match response {
        Response::Granted { .. }
        | Response::Regranted { .. }
        | Response::AcquireEnded { .. }
        | Response::Locked { .. }
        | Response::Renewed { .. }
        | Response::Lost
        | Response::Released
        | Response::NotOwner => unreachable!("lease replies are encoded by encode_response"),
        Response::Free => put_frame(dst, rop::FREE, id, |_| {}),
        Response::Session { session_id, ttl_ms } => put_frame(dst, rop::SESSION, id, |b| {
            b.put_slice(&session_id.0);
            b.put_u32(*ttl_ms);
        }),
        Response::SessionClosed { released } => {
            put_frame(dst, rop::SESSION_CLOSED, id, |b| b.put_u32(*released))
        }
        Response::Held {
            token,
            ttl_left_ms,
            waiters,
            meta,
        } => put_frame(dst, rop::HELD, id, |b| {
            b.put_u64(*token);
            b.put_u32(*ttl_left_ms);
            b.put_u32(*waiters);
            put_bytes16(b, meta);
        }),
        Response::HeldKinds {
            token,
            ttl_left_ms,
            waiters,
            meta,
            kinds,
        } => put_frame(dst, rop::HELD_KINDS, id, |b| {
            b.put_u64(*token);
            b.put_u32(*ttl_left_ms);
            b.put_u32(*waiters);
            put_bytes16(b, meta);
            put_holder_kinds(b, kinds);
        }),
        Response::Pong => put_frame(dst, rop::PONG, id, |_| {}),
        Response::Current => put_frame(dst, rop::CURRENT, id, |_| {}),
        Response::Stale => put_frame(dst, rop::STALE, id, |_| {}),
        Response::Stats(pairs) => put_frame(dst, rop::STATS, id, |b| put_stats(b, pairs)),
        Response::Watching { holder } => put_frame(dst, rop::WATCHING, id, |b| {
            put_watch_state(b, holder.as_ref())
        }),
        Response::Unwatched => put_frame(dst, rop::UNWATCHED, id, |_| {}),
        Response::Authenticated { name } => {
            put_frame(dst, rop::AUTHENTICATED, id, |b| put_bytes16(b, name))
        }
        Response::Cluster(status) => put_frame(dst, rop::CLUSTER, id, |b| {
            crate::cluster::put_status(b, status)
        }),
        Response::Event {
            kind,
            key,
            token,
            meta,
        } => put_frame(dst, rop::EVENT, id, |b| {
            b.put_u8(*kind as u8);
            put_bytes16(b, key);
            b.put_u64(*token);
            put_bytes16(b, meta);
        }),
        Response::Error { code, message } => put_frame(dst, rop::ERROR, id, |b| {
            b.put_u16(*code as u16);
            put_bytes16(b, truncate_utf8(message, ERROR_MESSAGE_LEN_MAX).as_bytes());
        }),
    }
}

/// HELD_KINDS' tail: the holder and waiter counts by kind.
fn put_holder_kinds(b: &mut BytesMut, kinds: &crate::kind::HolderKinds) {
    b.put_u32(kinds.limit);
    b.put_u32(kinds.holders);
    b.put_u32(kinds.in_use);
    b.put_u8(u8::from(kinds.writer));
    b.put_u32(kinds.waiting_shared);
    b.put_u32(kinds.waiting_exclusive);
}

/// The STATS body: a count, then each name (u8 length) and value.
fn put_stats(b: &mut BytesMut, pairs: &[(String, u64)]) {
    assert!(pairs.len() <= STATS_COUNT_MAX, "too many stats");
    b.put_u16(pairs.len() as u16);
    for (name, value) in pairs {
        assert!(
            name.len() <= STAT_NAME_LEN_MAX,
            "stat name too long: {name}"
        );
        b.put_u8(name.len() as u8);
        b.put_slice(name.as_bytes());
        b.put_u64(*value);
    }
}

/// The WATCHING body: free, or held and by whom.
fn put_watch_state(b: &mut BytesMut, holder: Option<&Holder>) {
    match holder {
        None => b.put_u8(WATCH_STATE_FREE),
        Some(holder) => {
            b.put_u8(WATCH_STATE_HELD);
            b.put_u64(holder.token);
            b.put_u32(holder.ttl_left_ms);
            b.put_u32(holder.waiters);
            put_bytes16(b, &holder.meta);
        }
    }
}

/// The longest prefix of `text` that is at most `len_max` bytes and ends on a char boundary.
fn truncate_utf8(text: &str, len_max: usize) -> &str {
    if text.len() <= len_max {
        return text;
    }
    let mut end = len_max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Reads a frame header from the front of `src` if a whole frame is there.
///
/// Returns the opcode, request id and body, consuming them from `src`. The announced length is
/// checked against [`FRAME_LEN_MAX`] *before* anything is reserved or waited for, so a peer
/// cannot make us buffer more than one maximal frame.
///
/// # Errors
/// [`ProtocolError`] when the length prefix is out of range: the stream can no longer be
/// trusted and the connection should be closed.
pub fn split_frame(src: &mut BytesMut) -> Result<Option<(u8, u64, Bytes)>, ProtocolError> {
    if src.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
    if len > FRAME_LEN_MAX {
        return Err(ProtocolError::FrameTooLarge { len });
    }
    if len < FRAME_LEN_MIN {
        return Err(ProtocolError::FrameTooShort { len });
    }
    if src.len() < 4 + len {
        src.reserve(4 + len - src.len());
        return Ok(None);
    }
    src.advance(4);
    let opcode = src.get_u8();
    let id = src.get_u64();
    let body = src.split_to(len - FRAME_LEN_MIN).freeze();
    Ok(Some((opcode, id, body)))
}

/// A cursor over a frame body that turns every short read into a [`FrameError`].
struct Body {
    bytes: Bytes,
}

impl crate::cluster::Read for Body {
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        Body::u8(self, what)
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, FrameError> {
        Body::u16(self, what)
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError> {
        Body::u64(self, what)
    }
    fn bytes16(&mut self, what: &'static str) -> Result<Bytes, FrameError> {
        Body::bytes16(self, what)
    }
    fn remaining(&self) -> usize {
        self.bytes.remaining()
    }
    fn skip(&mut self, n: usize, what: &'static str) -> Result<(), FrameError> {
        self.need(n, what)?;
        self.bytes.advance(n);
        Ok(())
    }
    fn array8(&mut self, what: &'static str) -> Result<[u8; 8], FrameError> {
        self.need(8, what)?;
        let mut out = [0u8; 8];
        self.bytes.copy_to_slice(&mut out);
        Ok(out)
    }
}

impl Body {
    fn need(&self, n: usize, what: &'static str) -> Result<(), FrameError> {
        if self.bytes.remaining() < n {
            return Err(FrameError::new(
                ErrorCode::BadFrame,
                format!("body ends inside {what}"),
            ));
        }
        Ok(())
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        self.need(1, what)?;
        Ok(self.bytes.get_u8())
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, FrameError> {
        self.need(2, what)?;
        Ok(self.bytes.get_u16())
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FrameError> {
        self.need(4, what)?;
        Ok(self.bytes.get_u32())
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError> {
        self.need(8, what)?;
        Ok(self.bytes.get_u64())
    }
    fn bytes16(&mut self, what: &'static str) -> Result<Bytes, FrameError> {
        let len = self.u16(what)? as usize;
        self.need(len, what)?;
        Ok(self.bytes.split_to(len))
    }
    fn lease_id(&mut self) -> Result<LeaseId, FrameError> {
        self.need(LeaseId::LEN, "lease id")?;
        let mut id = [0u8; LeaseId::LEN];
        self.bytes.copy_to_slice(&mut id);
        Ok(LeaseId(id))
    }
    fn acquire_id(&mut self) -> Result<AcquireId, FrameError> {
        self.need(AcquireId::LEN, "acquire id")?;
        let mut id = [0u8; AcquireId::LEN];
        self.bytes.copy_to_slice(&mut id);
        Ok(AcquireId(id))
    }
    fn session_id(&mut self) -> Result<SessionId, FrameError> {
        self.need(SessionId::LEN, "session id")?;
        let mut id = [0u8; SessionId::LEN];
        self.bytes.copy_to_slice(&mut id);
        Ok(SessionId(id))
    }
    fn finish(self) -> Result<(), FrameError> {
        if self.bytes.has_remaining() {
            return Err(FrameError::new(
                ErrorCode::BadFrame,
                match self.bytes.remaining() {
                    1 => "1 unexpected byte after the body".to_owned(),
                    n => format!("{n} unexpected bytes after the body"),
                },
            ));
        }
        Ok(())
    }
}

/// Decodes a request body (the part after the request id) and checks it against the limits.
///
/// # Errors
/// [`FrameError`] for an unknown opcode, a body of the wrong shape or a value out of range. The
/// frame boundary is intact, so the connection can answer with an ERROR frame and go on.
pub fn decode_request(opcode: u8, body: Bytes) -> Result<Request, FrameError> {
    let mut b = Body { bytes: body };
    let request = match opcode {
        op::PING => Request::Ping,
        op::ACQUIRE => decode_acquire(&mut b)?,
        op::RENEW => Request::Renew {
            key: b.bytes16("key")?,
            lease_id: b.lease_id()?,
            ttl_ms: b.u32("ttl_ms")?,
        },
        op::RELEASE => Request::Release {
            key: b.bytes16("key")?,
            lease_id: b.lease_id()?,
        },
        op::INSPECT => Request::Inspect {
            key: b.bytes16("key")?,
            kinds: get_inspect_flags(&mut b)?,
        },
        op::CHECK => Request::Check {
            key: b.bytes16("key")?,
            token: b.u64("token")?,
        },
        op::STATS => Request::Stats,
        op::WATCH => Request::Watch {
            key: b.bytes16("key")?,
        },
        op::UNWATCH => Request::Unwatch {
            key: b.bytes16("key")?,
        },
        op::AUTH => Request::Auth {
            name: b.bytes16("name")?,
            secret: Secret(b.bytes16("secret")?),
        },
        op::CLUSTER_STATUS => Request::ClusterStatus {
            extended: crate::cluster::get_status_flags(&mut b)?,
        },
        op::CLUSTER_INIT => Request::ClusterInit {
            members: crate::cluster::get_members(&mut b)?,
        },
        op::CLUSTER_ADD => Request::ClusterAdd {
            member: crate::cluster::get_member(&mut b)?,
        },
        op::CLUSTER_REMOVE => Request::ClusterRemove {
            id: b.u64("node id")?,
        },
        op::SESSION_OPEN => Request::SessionOpen {
            ttl_ms: b.u32("ttl_ms")?,
            // Optional, and last: a body of 4 bytes is a SESSION_OPEN without an id.
            session_id: match b.bytes.has_remaining() {
                true => Some(b.session_id()?),
                false => None,
            },
        },
        op::SESSION_KEEPALIVE => Request::SessionKeepalive {
            session_id: b.session_id()?,
        },
        op::SESSION_CLOSE => Request::SessionClose {
            session_id: b.session_id()?,
        },
        other => {
            return Err(FrameError::new(
                ErrorCode::UnknownOpcode,
                format!("unknown request opcode {other:#04x}"),
            ))
        }
    };
    b.finish()?;
    request.validate()?;
    Ok(request)
}

/// The ACQUIRE body: fixed fields, the flags byte, `meta`, then the optional fields it announces.
#[inline]
fn decode_acquire(b: &mut Body) -> Result<Request, FrameError> {
    let key = b.bytes16("key")?;
    let ttl_ms = b.u32("ttl_ms")?;
    let wait_ms = b.u32("wait_ms")?;
    let flags = b.u8("flags")?;
    let meta = b.bytes16("meta")?;
    if flags & !FLAGS_KNOWN != 0 {
        return Err(FrameError::new(
            ErrorCode::BadFrame,
            format!("unknown acquire flags {flags:#04x}"),
        ));
    }
    let release_on_disconnect = flags & FLAG_RELEASE_ON_DISCONNECT != 0;
    let acquire_id = if flags & FLAG_ACQUIRE_ID != 0 {
        Some(b.acquire_id()?)
    } else {
        None
    };
    let session_id = if flags & FLAG_SESSION != 0 {
        Some(b.session_id()?)
    } else {
        None
    };
    let kind = if flags & FLAG_KIND != 0 {
        get_kind(b)?
    } else {
        crate::LeaseKind::Exclusive
    };
    Ok(Request::Acquire {
        key,
        ttl_ms,
        wait_ms,
        release_on_disconnect,
        meta,
        acquire_id,
        kind,
        session_id,
    })
}

/// Decodes a response body (the part after the request id).
///
/// # Errors
/// [`FrameError`] for an unknown opcode or a body of the wrong shape.
pub fn decode_response(opcode: u8, body: Bytes) -> Result<Response, FrameError> {
    let mut b = Body { bytes: body };
    let response = match opcode {
        rop::PONG => Response::Pong,
        rop::GRANTED => Response::Granted {
            token: b.u64("token")?,
            lease_id: b.lease_id()?,
            ttl_ms: b.u32("ttl_ms")?,
            waited_ms: b.u32("waited_ms")?,
        },
        rop::REGRANTED => Response::Regranted {
            token: b.u64("token")?,
            lease_id: b.lease_id()?,
            ttl_left_ms: b.u32("ttl_left_ms")?,
        },
        rop::ACQUIRE_ENDED => decode_acquire_ended(&mut b)?,
        rop::SESSION => Response::Session {
            session_id: b.session_id()?,
            ttl_ms: b.u32("ttl_ms")?,
        },
        rop::SESSION_CLOSED => Response::SessionClosed {
            released: b.u32("released")?,
        },
        rop::LOCKED => Response::Locked {
            token: b.u64("token")?,
            ttl_left_ms: b.u32("ttl_left_ms")?,
        },
        rop::RENEWED => Response::Renewed {
            ttl_ms: b.u32("ttl_ms")?,
        },
        rop::LOST => Response::Lost,
        rop::RELEASED => Response::Released,
        rop::NOT_OWNER => Response::NotOwner,
        rop::FREE => Response::Free,
        rop::HELD => Response::Held {
            token: b.u64("token")?,
            ttl_left_ms: b.u32("ttl_left_ms")?,
            waiters: b.u32("waiters")?,
            meta: b.bytes16("meta")?,
        },
        rop::HELD_KINDS => decode_held_kinds(&mut b)?,
        rop::CURRENT => Response::Current,
        rop::STALE => Response::Stale,
        rop::STATS => Response::Stats(decode_stats(&mut b)?),
        rop::WATCHING => Response::Watching {
            holder: decode_watch_state(&mut b)?,
        },
        rop::UNWATCHED => Response::Unwatched,
        rop::AUTHENTICATED => Response::Authenticated {
            name: b.bytes16("name")?,
        },
        rop::CLUSTER => Response::Cluster(crate::cluster::get_status(&mut b)?),
        rop::EVENT => decode_event(&mut b)?,
        rop::ERROR => decode_error(&mut b)?,
        other => {
            return Err(FrameError::new(
                ErrorCode::UnknownOpcode,
                format!("unknown response opcode {other:#04x}"),
            ))
        }
    };
    b.finish()?;
    Ok(response)
}

/// The ACQUIRE_ENDED body: how the acquire ended and the token it saw.
#[inline]
fn decode_acquire_ended(b: &mut Body) -> Result<Response, FrameError> {
    let byte = b.u8("how")?;
    let how = EndedHow::from_u8(byte).ok_or_else(|| {
        FrameError::new(ErrorCode::BadFrame, format!("unknown ended outcome {byte}"))
    })?;
    Ok(Response::AcquireEnded {
        how,
        token: b.u64("token")?,
    })
}

/// The HELD_KINDS body: HELD's fields, then the holder counts by kind.
fn decode_held_kinds(b: &mut Body) -> Result<Response, FrameError> {
    Ok(Response::HeldKinds {
        token: b.u64("token")?,
        ttl_left_ms: b.u32("ttl_left_ms")?,
        waiters: b.u32("waiters")?,
        meta: b.bytes16("meta")?,
        kinds: crate::kind::HolderKinds {
            limit: b.u32("limit")?,
            holders: b.u32("holders")?,
            in_use: b.u32("in_use")?,
            writer: b.u8("writer")? != 0,
            waiting_shared: b.u32("waiting_shared")?,
            waiting_exclusive: b.u32("waiting_exclusive")?,
        },
    })
}

/// The EVENT body: what happened, to which key, with which token and meta.
fn decode_event(b: &mut Body) -> Result<Response, FrameError> {
    let kind = match b.u8("event kind")? {
        1 => EventKind::Granted,
        2 => EventKind::Released,
        3 => EventKind::Expired,
        other => {
            return Err(FrameError::new(
                ErrorCode::BadFrame,
                format!("unknown event kind {other}"),
            ))
        }
    };
    Ok(Response::Event {
        kind,
        key: b.bytes16("key")?,
        token: b.u64("token")?,
        meta: b.bytes16("meta")?,
    })
}

/// The ERROR body: a code and a message, decoded lossily so that bad UTF-8 still reads.
fn decode_error(b: &mut Body) -> Result<Response, FrameError> {
    let code = ErrorCode::from_u16(b.u16("error code")?);
    let message = b.bytes16("error message")?;
    Ok(Response::Error {
        code,
        message: String::from_utf8_lossy(&message).into_owned(),
    })
}

fn decode_watch_state(b: &mut Body) -> Result<Option<Holder>, FrameError> {
    match b.u8("watch state")? {
        WATCH_STATE_FREE => Ok(None),
        WATCH_STATE_HELD => Ok(Some(Holder {
            token: b.u64("token")?,
            ttl_left_ms: b.u32("ttl_left_ms")?,
            waiters: b.u32("waiters")?,
            meta: b.bytes16("meta")?,
        })),
        other => Err(FrameError::new(
            ErrorCode::BadFrame,
            format!("unknown watch state {other}"),
        )),
    }
}

fn decode_stats(b: &mut Body) -> Result<Vec<(String, u64)>, FrameError> {
    let count = b.u16("stats count")? as usize;
    if count > STATS_COUNT_MAX {
        return Err(FrameError::new(
            ErrorCode::BadFrame,
            format!("{count} stats, limit {STATS_COUNT_MAX}"),
        ));
    }
    let mut pairs = Vec::with_capacity(count);
    for _ in 0..count {
        let len = b.u8("stat name length")? as usize;
        b.need(len, "stat name")?;
        let name = String::from_utf8_lossy(&b.bytes.split_to(len)).into_owned();
        pairs.push((name, b.u64("stat value")?));
    }
    Ok(pairs)
}

/// Checks a key against the wire limits.
///
/// # Errors
/// [`ErrorCode::BadKey`] for an empty key or one longer than [`KEY_LEN_MAX`].
pub fn validate_key(key: &[u8]) -> Result<(), FrameError> {
    if key.is_empty() {
        return Err(FrameError::new(ErrorCode::BadKey, "key is empty".into()));
    }
    if key.len() > KEY_LEN_MAX {
        return Err(FrameError::new(
            ErrorCode::BadKey,
            format!("key is {} bytes, limit {KEY_LEN_MAX}", key.len()),
        ));
    }
    Ok(())
}

/// Checks AUTH's fields: a name of 1 to [`IDENTITY_NAME_LEN_MAX`] bytes and a secret of at
/// most [`SECRET_LEN_MAX`] bytes.
///
/// # Errors
/// [`ErrorCode::BadArgs`] naming the field out of range.
pub fn validate_auth(name: &[u8], secret: &[u8]) -> Result<(), FrameError> {
    if name.is_empty() || name.len() > IDENTITY_NAME_LEN_MAX {
        return Err(FrameError::new(
            ErrorCode::BadArgs,
            format!("identity name must be 1 to {IDENTITY_NAME_LEN_MAX} bytes"),
        ));
    }
    if secret.len() > SECRET_LEN_MAX {
        return Err(FrameError::new(
            ErrorCode::BadArgs,
            format!("secret is over {SECRET_LEN_MAX} bytes"),
        ));
    }
    Ok(())
}

/// Checks a lease length against the wire limits.
///
/// # Errors
/// [`ErrorCode::BadTtl`] outside `TTL_MS_MIN..=TTL_MS_MAX`.
pub fn validate_ttl(ttl_ms: u32) -> Result<(), FrameError> {
    if !(TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms) {
        return Err(FrameError::ttl_out_of_range(ttl_ms));
    }
    Ok(())
}

/// Checks an ACQUIRE's `ttl_ms` for its kind of lease: a session lease takes 0 (it has no TTL
/// of its own) and cannot also be released on disconnect; any other, a TTL in range.
///
/// # Errors
/// [`ErrorCode::BadTtl`] for a TTL that does not fit, [`ErrorCode::BadFrame`] for a session
/// lease asking to be released on disconnect.
pub fn validate_acquire_ttl(
    ttl_ms: u32,
    in_session: bool,
    release_on_disconnect: bool,
) -> Result<(), FrameError> {
    if !in_session {
        return validate_ttl(ttl_ms);
    }
    if release_on_disconnect {
        return Err(FrameError::new(
            ErrorCode::BadFrame,
            "a session lease cannot be released on disconnect (flags 0x01 and 0x04)".into(),
        ));
    }
    if ttl_ms != 0 {
        return Err(FrameError::new(
            ErrorCode::BadTtl,
            format!("a session lease takes ttl_ms 0, not {ttl_ms}"),
        ));
    }
    Ok(())
}

impl Request {
    /// Checks every field against the wire limits; both ends call it.
    ///
    /// # Errors
    /// A [`FrameError`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), FrameError> {
        match self {
            Request::Ping | Request::Stats | Request::ClusterStatus { .. } => Ok(()),
            Request::ClusterInit { members } => crate::cluster::validate_members(members),
            Request::ClusterAdd { member } => crate::cluster::validate_member(member),
            Request::ClusterRemove { id } => crate::cluster::validate_id(*id),
            Request::Auth { name, secret } => validate_auth(name, &secret.0),
            Request::Acquire {
                key,
                ttl_ms,
                wait_ms,
                meta,
                acquire_id,
                kind,
                release_on_disconnect,
                session_id,
                ..
            } => {
                validate_key(key)?;
                validate_acquire_ttl(*ttl_ms, session_id.is_some(), *release_on_disconnect)?;
                kind.validate()?;
                if *wait_ms > WAIT_MS_MAX {
                    return Err(FrameError::new(
                        ErrorCode::BadWait,
                        format!("wait_ms {wait_ms} over {WAIT_MS_MAX}"),
                    ));
                }
                if meta.len() > META_LEN_MAX {
                    return Err(FrameError::new(
                        ErrorCode::MetaTooLong,
                        format!("meta is {} bytes, limit {META_LEN_MAX}", meta.len()),
                    ));
                }
                if acquire_id.is_some_and(|id| id.0 == [0; 16]) {
                    // Not random: every client that forgot to pick one would share it, and
                    // a repeat of it hands over the first send's lease (PROTOCOL.md 3.9).
                    return Err(FrameError::new(
                        ErrorCode::BadArgs,
                        "acquire id is all zero: pick 128 random bits".into(),
                    ));
                }
                Ok(())
            }
            Request::Renew { key, ttl_ms, .. } => {
                validate_key(key)?;
                validate_ttl(*ttl_ms)
            }
            Request::SessionOpen { ttl_ms, session_id } => {
                validate_ttl(*ttl_ms)?;
                if session_id.is_some_and(|id| id.0 == [0; SessionId::LEN]) {
                    // Not random: every client that forgot to pick one would share it, and
                    // an open of it would answer with another client's session.
                    return Err(FrameError::new(
                        ErrorCode::BadArgs,
                        "session id is all zero: pick 128 random bits".into(),
                    ));
                }
                Ok(())
            }
            Request::SessionKeepalive { .. } | Request::SessionClose { .. } => Ok(()),
            Request::Release { key, .. }
            | Request::Inspect { key, kinds: _ }
            | Request::Check { key, .. }
            | Request::Watch { key }
            | Request::Unwatch { key } => validate_key(key),
        }
    }

    /// A short upper-case name for logs and per-kind counters.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Ping => "PING",
            Request::Acquire { .. } => "ACQUIRE",
            Request::Renew { .. } => "RENEW",
            Request::Release { .. } => "RELEASE",
            Request::Inspect { .. } => "INSPECT",
            Request::Check { .. } => "CHECK",
            Request::Stats => "STATS",
            Request::Watch { .. } => "WATCH",
            Request::Unwatch { .. } => "UNWATCH",
            Request::Auth { .. } => "AUTH",
            // One kind for the four: they are rare, and each kind is a counter and a series.
            Request::ClusterStatus { .. }
            | Request::ClusterInit { .. }
            | Request::ClusterAdd { .. }
            | Request::ClusterRemove { .. } => "CLUSTER",
            // One kind for the three, as for CLUSTER: `ops_session` in STATS.
            Request::SessionOpen { .. }
            | Request::SessionKeepalive { .. }
            | Request::SessionClose { .. } => "SESSION",
        }
    }
}
