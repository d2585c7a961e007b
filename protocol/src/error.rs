//! Error codes on the wire and the decoder's two kinds of failure.

use thiserror::Error;

/// Machine-readable reason in an ERROR frame (u16 on the wire) and in console `ERR <CODE>` lines.
///
/// Outcomes such as LOCKED, LOST and NOT_OWNER are not errors and have their own replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// A code this version does not know (sent by a newer peer).
    Unknown = 0,
    /// The body does not have the shape its opcode requires.
    BadFrame = 1,
    /// The length prefix is over the limit; the connection closes.
    FrameTooLarge = 2,
    /// The opcode (or console command) is not one we know.
    UnknownOpcode = 3,
    /// The key is empty or too long.
    BadKey = 4,
    /// The TTL is out of range.
    BadTtl = 5,
    /// The wait is out of range.
    BadWait = 6,
    /// The holder metadata is too long.
    MetaTooLong = 7,
    /// The connection has too many requests in flight.
    TooManyInFlight = 8,
    /// The server holds as many locks as it is allowed to.
    HeldLimit = 9,
    /// The server (or this key) has as many waiters as it is allowed to.
    WaitersLimit = 10,
    /// The server has as many connections as it is allowed to; the connection closes.
    ConnectionsLimit = 11,
    /// The change could not be made durable (disk full, I/O error); nothing changed for you.
    Unavailable = 12,
    /// The server is shutting down.
    ShuttingDown = 13,
    /// The handshake was malformed or named a version the server does not speak.
    BadHandshake = 14,
    /// This connection watches as many keys as it is allowed to.
    WatchLimit = 15,
    /// Console only: the arguments do not fit the command.
    BadArgs = 16,
    /// Console only: the line is longer than the limit; the connection closes.
    LineTooLong = 17,
    /// The server refuses new grants for a while after a restart (token-only durability mode).
    Recovering = 18,
    /// The length prefix is under the minimum (opcode and request id); the connection closes.
    FrameTooShort = 19,
    /// Identities are configured and this connection has not authenticated (or its AUTH
    /// failed); only PING, HELP, AUTH and QUIT are answered until it does.
    Unauthenticated = 20,
    /// The connection's identity may not do this: the key is outside its prefixes, or the
    /// operation (STATS, WATCH) is not granted to it.
    Forbidden = 21,
    /// The connection's identity holds (or waits for) as many locks as its quota allows.
    Quota = 22,
    /// Cluster mode: this node is not the leader. The message is `leader=<host:port>` (the
    /// leader's client address) or `leader=unknown` (an election is under way); see
    /// [`leader_hint`]. On a write, the outcome is unknown.
    NotLeader = 23,
    /// Cluster mode: a CLUSTER INIT, ADD or REMOVE was refused (the node is initialised
    /// already, the id is present with other addresses, it is the last voter, ...); the
    /// message says why. Nothing changed.
    ClusterRefused = 24,
    /// The session id names no live session: never opened, closed, expired, opened by another
    /// identity, or lost to a restart (PROTOCOL.md 3.11). Nothing changed.
    NoSession = 25,
    /// The server or this connection has as many live sessions as it may; the message names
    /// which.
    SessionsLimit = 26,
    /// The session holds and waits for as many leases as it may.
    SessionLeasesLimit = 27,
    /// RENEW of a lease held in a session: keep the session alive instead. Nothing changed.
    SessionLease = 28,
    /// A repeated ACQUIRE names another session than its first send did. Nothing changed.
    SessionMismatch = 29,
    /// An ACQUIRE's kind does not fit the key: a semaphore ACQUIRE on a key held or awaited
    /// as a plain or read/write lock (or the other way round), or a semaphore ACQUIRE naming
    /// another limit than the key's holders and waiters have. The message says which.
    KindMismatch = 30,
    /// An ACQUIRE's permit counts are out of range (`1 <= count <= limit <= PERMITS_MAX`), or
    /// its kind byte is unknown.
    BadPermits = 31,
}

/// Where a [`ErrorCode::NotLeader`] message says the leader is: `Some(Some(addr))` for a
/// known leader, `Some(None)` while none is known, `None` for a message of another form.
pub fn leader_hint(message: &str) -> Option<Option<&str>> {
    let rest = message
        .split_whitespace()
        .find_map(|word| word.strip_prefix("leader="))?;
    match rest {
        "" => None,
        "unknown" => Some(None),
        addr => Some(Some(addr)),
    }
}

impl ErrorCode {
    /// Every code, for tables and tests.
    pub const ALL: [ErrorCode; 32] = [
        ErrorCode::Unknown,
        ErrorCode::BadFrame,
        ErrorCode::FrameTooLarge,
        ErrorCode::UnknownOpcode,
        ErrorCode::BadKey,
        ErrorCode::BadTtl,
        ErrorCode::BadWait,
        ErrorCode::MetaTooLong,
        ErrorCode::TooManyInFlight,
        ErrorCode::HeldLimit,
        ErrorCode::WaitersLimit,
        ErrorCode::ConnectionsLimit,
        ErrorCode::Unavailable,
        ErrorCode::ShuttingDown,
        ErrorCode::BadHandshake,
        ErrorCode::WatchLimit,
        ErrorCode::BadArgs,
        ErrorCode::LineTooLong,
        ErrorCode::Recovering,
        ErrorCode::FrameTooShort,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::Quota,
        ErrorCode::NotLeader,
        ErrorCode::ClusterRefused,
        ErrorCode::NoSession,
        ErrorCode::SessionsLimit,
        ErrorCode::SessionLeasesLimit,
        ErrorCode::SessionLease,
        ErrorCode::SessionMismatch,
        ErrorCode::KindMismatch,
        ErrorCode::BadPermits,
    ];

    /// The code for a wire value; values this version does not know map to `Unknown`.
    pub fn from_u16(value: u16) -> ErrorCode {
        ErrorCode::ALL
            .iter()
            .copied()
            .find(|c| *c as u16 == value)
            .unwrap_or(ErrorCode::Unknown)
    }

    /// The upper-case name used by the console (`ERR BAD_KEY ...`).
    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::Unknown => "UNKNOWN",
            ErrorCode::BadFrame => "BAD_FRAME",
            ErrorCode::FrameTooLarge => "FRAME_TOO_LARGE",
            ErrorCode::UnknownOpcode => "UNKNOWN_COMMAND",
            ErrorCode::BadKey => "BAD_KEY",
            ErrorCode::BadTtl => "BAD_TTL",
            ErrorCode::BadWait => "BAD_WAIT",
            ErrorCode::MetaTooLong => "META_TOO_LONG",
            ErrorCode::TooManyInFlight => "TOO_MANY_IN_FLIGHT",
            ErrorCode::HeldLimit => "HELD_LIMIT",
            ErrorCode::WaitersLimit => "WAITERS_LIMIT",
            ErrorCode::ConnectionsLimit => "CONNECTIONS_LIMIT",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::ShuttingDown => "SHUTTING_DOWN",
            ErrorCode::BadHandshake => "BAD_HANDSHAKE",
            ErrorCode::WatchLimit => "WATCH_LIMIT",
            ErrorCode::BadArgs => "BAD_ARGS",
            ErrorCode::LineTooLong => "LINE_TOO_LONG",
            ErrorCode::Recovering => "RECOVERING",
            ErrorCode::FrameTooShort => "FRAME_TOO_SHORT",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::Quota => "QUOTA",
            ErrorCode::NotLeader => "NOT_LEADER",
            ErrorCode::ClusterRefused => "CLUSTER_REFUSED",
            ErrorCode::NoSession => "NO_SESSION",
            ErrorCode::SessionsLimit => "SESSIONS_LIMIT",
            ErrorCode::SessionLeasesLimit => "SESSION_LEASES_LIMIT",
            ErrorCode::SessionLease => "SESSION_LEASE",
            ErrorCode::SessionMismatch => "SESSION_MISMATCH",
            ErrorCode::KindMismatch => "KIND_MISMATCH",
            ErrorCode::BadPermits => "BAD_PERMITS",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A frame that arrived whole but cannot be served. The stream is still in step, so the
/// connection answers with an ERROR frame carrying the request id and goes on.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{code}: {message}")]
pub struct FrameError {
    /// Machine-readable reason.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
    /// The lease length refused for being outside the wire format's range, so a server can
    /// name its own, narrower range instead (`--ttl-max-ms`).
    ttl_ms: Option<u32>,
}

impl FrameError {
    /// A frame error with a code and a reason.
    pub fn new(code: ErrorCode, message: String) -> Self {
        FrameError {
            code,
            message,
            ttl_ms: None,
        }
    }

    /// `BAD_TTL` for `ttl_ms` outside `TTL_MS_MIN..=TTL_MS_MAX`.
    pub fn ttl_out_of_range(ttl_ms: u32) -> Self {
        use crate::limits::{TTL_MS_MAX, TTL_MS_MIN};
        // Worded as the server words it (its own limit replaces the upper bound there), so
        // a client's check and the server's refusal say the same.
        let message = if ttl_ms < TTL_MS_MIN {
            format!("ttl_ms {ttl_ms} under the shortest lease, {TTL_MS_MIN}")
        } else {
            format!("ttl_ms {ttl_ms} over the longest lease, {TTL_MS_MAX}")
        };
        FrameError {
            ttl_ms: Some(ttl_ms),
            ..FrameError::new(ErrorCode::BadTtl, message)
        }
    }

    /// The lease length this error refuses as out of the wire format's range, if it is one.
    pub fn refused_ttl_ms(&self) -> Option<u32> {
        self.ttl_ms
    }
}

/// A stream that can no longer be trusted: the connection must be closed.
#[derive(Debug, Error)]
pub enum ProtocolError {
    /// The length prefix announced more than `FRAME_LEN_MAX` bytes.
    #[error(
        "frame of {len} bytes is over the limit of {} bytes",
        crate::limits::FRAME_LEN_MAX
    )]
    FrameTooLarge {
        /// The announced length.
        len: usize,
    },
    /// The length prefix announced fewer bytes than an opcode and request id take.
    #[error(
        "frame of {len} bytes is under the minimum of {} bytes",
        crate::limits::FRAME_LEN_MIN
    )]
    FrameTooShort {
        /// The announced length.
        len: usize,
    },
    /// The handshake was not a tenure handshake or named another version.
    #[error("bad handshake: {0}")]
    BadHandshake(String),
    /// The server answered the hello with a refusal (see [`crate::handshake`]) and closes.
    #[error("handshake refused by a server of version {version}: {code}: {message}")]
    HandshakeRefused {
        /// The version the server speaks.
        version: u16,
        /// Why: [`ErrorCode::BadHandshake`] in this version.
        code: ErrorCode,
        /// The server's reason.
        message: String,
    },
    /// The transport failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ProtocolError {
    /// The wire code to send before closing, when one applies.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ProtocolError::FrameTooLarge { .. } => Some(ErrorCode::FrameTooLarge),
            ProtocolError::FrameTooShort { .. } => Some(ErrorCode::FrameTooShort),
            ProtocolError::BadHandshake(_) => Some(ErrorCode::BadHandshake),
            ProtocolError::HandshakeRefused { code, .. } => Some(*code),
            ProtocolError::Io(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_hint_reads_the_leaders_address() {
        assert_eq!(
            leader_hint("leader=10.0.0.2:7878"),
            Some(Some("10.0.0.2:7878"))
        );
        assert_eq!(leader_hint("leader=unknown"), Some(None));
        assert_eq!(
            leader_hint("not the leader; leader=[::1]:7878"),
            Some(Some("[::1]:7878"))
        );
        assert_eq!(leader_hint("leader="), None);
        assert_eq!(leader_hint("something else"), None);
        assert_eq!(ErrorCode::from_u16(23), ErrorCode::NotLeader);
    }
}
