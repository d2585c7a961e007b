//! The client's error type: everything that can stop a request from getting an answer.
//!
//! Outcomes such as LOCKED, LOST, NOT_OWNER and STALE are not errors: they are answers, and
//! each method returns them as an enum (see [`crate::client`]).

use std::sync::Arc;
use std::time::Duration;

use tenure_protocol::{EndedHow, ErrorCode, FrameError, Response};
use thiserror::Error;

/// Why a request got no answer, or got an answer that is a failure.
#[derive(Debug, Error)]
pub enum Error {
    /// Opening the TCP connection or the handshake's I/O failed (refused, reset, unreachable).
    /// The I/O error is the field and is in the message; it is not also given as `source()`,
    /// so that a printer of the chain (anyhow's `{:#}`) names it once, not twice.
    #[error("i/o error: {0}")]
    Io(std::io::Error),
    /// The connection closed while the request was in flight, or was already closed; the
    /// request may or may not have been applied. The next request reconnects.
    #[error("connection lost: {0}")]
    ConnectionLost(Arc<str>),
    /// No answer came within the request timeout (or connect timeout); the request may still
    /// be applied by the server later.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The server answered with an ERROR frame: bad input, a limit, or a durability failure
    /// ([`ErrorCode::Unavailable`]). Nothing changed on the server.
    #[error("server error {code}: {message}")]
    Server {
        /// Machine-readable reason.
        code: ErrorCode,
        /// Human-readable reason from the server.
        message: String,
    },
    /// An argument is outside the wire limits, so the request was never sent.
    #[error("invalid argument {code}: {message}")]
    Invalid {
        /// The code the server would have answered with.
        code: ErrorCode,
        /// Which field is out of range, and the limit.
        message: String,
    },
    /// The server said something this client cannot understand: a bad handshake, an
    /// undecodable frame, or a reply that does not fit the request.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The server speaks another protocol version.
    #[error("server speaks protocol version {server}, this client speaks {client}")]
    VersionMismatch {
        /// The version the server announced.
        server: u16,
        /// The version this client speaks.
        client: u16,
    },
    /// A watch fell more than [`crate::client::WATCH_EVENTS_MAX`] events behind and was
    /// dropped so that it could not stall the connection; watch again to resume.
    #[error("watch fell too far behind and was dropped")]
    WatchOverflow,
    /// TLS could not be set up: a PEM file without a usable certificate or key, or a handshake
    /// the certificates failed (an untrusted server, a name that does not match, a client
    /// certificate the server refused). Not transient: retrying will fail the same way.
    #[error("TLS: {0}")]
    Tls(String),
    /// An ACQUIRE whose first answer was lost was sent again with its acquire id, and the
    /// server says that it had granted this very ACQUIRE and the lease has ended since
    /// (released, expired, or its release-on-disconnect connection closed). Nothing is held
    /// now and nothing was granted twice: acquire again (a new ACQUIRE) to take the lock.
    /// Not transient: sending the same ACQUIRE again gets the same answer.
    #[error(
        "the acquire was granted (token {token}) and that lease has already ended: {}",
        .how.as_str()
    )]
    AcquireEnded {
        /// How the lease ended.
        how: EndedHow,
        /// The ended lease's fencing token.
        token: u64,
    },
    /// The key is held or awaited as another kind than the acquire asked for (PROTOCOL.md
    /// 3.10): permits of a plain or read/write key, a plain or read lease of a semaphore, or a
    /// semaphore of another limit. The message (the server's) says which; nothing changed.
    #[error("kind mismatch: {0}")]
    KindMismatch(String),
    /// Permit counts out of range: a count of 0 or over the limit, or a limit outside
    /// `1..=PERMITS_MAX`. Checked before sending, so the request was not sent.
    #[error("bad permits: {0}")]
    BadPermits(String),
}

impl From<std::io::Error> for Error {
    fn from(error: std::io::Error) -> Error {
        Error::Io(error)
    }
}

impl Error {
    /// The client-side counterpart of a server's rejection of a malformed field.
    pub(crate) fn invalid(frame: FrameError) -> Error {
        Error::Invalid {
            code: frame.code,
            message: frame.message,
        }
    }

    /// The typed errors of a lease's kind ([`Error::KindMismatch`], [`Error::BadPermits`]) for
    /// the server's (or the local check's) codes 30 and 31; any other error as it is.
    pub(crate) fn of_kind(self) -> Error {
        match self {
            Error::Server {
                code: ErrorCode::KindMismatch,
                message,
            } => Error::KindMismatch(message),
            Error::Server {
                code: ErrorCode::BadPermits,
                message,
            }
            | Error::Invalid {
                code: ErrorCode::BadPermits,
                message,
            } => Error::BadPermits(message),
            other => other,
        }
    }

    /// The protocol's code for a refusal: the server's (or the local check's) for
    /// [`Error::Server`] and [`Error::Invalid`], and the codes the typed refusals stand for
    /// (`KIND_MISMATCH`, `BAD_PERMITS`); `None` for an error no code names (I/O, a time-out,
    /// a repeat's [`Error::AcquireEnded`], which is an outcome rather than a refusal).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Server { code, .. } | Error::Invalid { code, .. } => Some(*code),
            Error::KindMismatch(_) => Some(ErrorCode::KindMismatch),
            Error::BadPermits(_) => Some(ErrorCode::BadPermits),
            _ => None,
        }
    }

    /// True when the error says nothing about the lock itself, only about reaching the server:
    /// retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Io(_) | Error::ConnectionLost(_) | Error::Timeout(_) => true,
            Error::Server { code, .. } => matches!(
                code,
                ErrorCode::Unavailable
                    | ErrorCode::ShuttingDown
                    | ErrorCode::Recovering
                    | ErrorCode::TooManyInFlight
                    | ErrorCode::ConnectionsLimit
                    | ErrorCode::NotLeader
            ),
            _ => false,
        }
    }
}

/// The error for an answer that fits no outcome of `request` (a request's name, for the
/// message): the server's own ERROR as [`Error::Server`], anything else as a protocol error.
pub(crate) fn unexpected(request: &str, response: Response) -> Error {
    match response {
        Response::Error { code, message } => Error::Server { code, message },
        other => Error::Protocol(format!("unexpected reply {other:?} to {request}")),
    }
}

/// Result with the client's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
